// transpose_avx512.h: the one 16 x 16 transpose of 32-bit lanes in AVX-512 registers, for the packers that turn
// rows into columns (the AMX wgrad operand, the grouped GEMM's dgrad weight panels, the attention kernels'
// transpose16 of attention_avx512_ops.h): after the call, lane k of
// w[c] is lane c of v[k]. Four stages: 32-bit and 64-bit unpacks inside 128-bit lanes, then two rounds of
// 128-bit lane shuffles. Include only from files compiled with the AVX-512 flags; everything here is in an
// anonymous namespace. Not a matrix kernel.
#pragma once
#include <immintrin.h>

namespace {

inline void transpose16x16_epi32(const __m512i (&v)[16], __m512i (&w)[16]) {
  __m512i t[16], u[16];
  for (int m = 0; m < 8; ++m) {
    t[2 * m] = _mm512_unpacklo_epi32(v[2 * m], v[2 * m + 1]);
    t[2 * m + 1] = _mm512_unpackhi_epi32(v[2 * m], v[2 * m + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + j], 128-bit lane L: lane 4L + j of v[4g .. 4g + 3]
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i y01 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), y23 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
    const __m512i z01 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i z23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
    w[j] = _mm512_shuffle_i32x4(y01, z01, 0x88);
    w[4 + j] = _mm512_shuffle_i32x4(y01, z01, 0xdd);
    w[8 + j] = _mm512_shuffle_i32x4(y23, z23, 0x88);
    w[12 + j] = _mm512_shuffle_i32x4(y23, z23, 0xdd);
  }
}

}  // namespace
