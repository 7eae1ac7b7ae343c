// convert_avx512.cpp: AVX-512 fp32 -> bf16 with exactly to_bf16's rounding (round to nearest even, NaN kept
// quiet, denormals NOT flushed: integer arithmetic, not VCVTNEPS2BF16) and bf16 -> fp32. Serial; called by
// the dispatchers in gemm.cpp after checking active_isa(); helpers stay in an anonymous namespace.
// GCC 12 warns falsely about _mm512_undefined_* inside its own intrinsic headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "moetron/dtype.h"

namespace moetron {

namespace {
inline __mmask16 tail(int64_t rem) { return rem >= 16 ? __mmask16(0xffff) : __mmask16((1u << rem) - 1); }

inline __m256i f32_to_bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}
}  // namespace

void f32_to_bf16_avx512(bf16* out, const float* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), f32_to_bf16_16(_mm512_loadu_ps(in + i)));
  if (i < n) {
    const __mmask16 m = tail(n - i);
    _mm256_mask_storeu_epi16(out + i, m, f32_to_bf16_16(_mm512_maskz_loadu_ps(m, in + i)));
  }
}

void bf16_to_f32_avx512(float* out, const bf16* in, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    _mm512_storeu_si512(out + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  if (i < n) {
    const __mmask16 m = tail(n - i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, in + i);
    _mm512_mask_storeu_ps(out + i, m, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
}

}  // namespace moetron
