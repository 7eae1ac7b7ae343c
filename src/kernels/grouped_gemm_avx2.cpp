// grouped_gemm_avx2.cpp: AVX2 + FMA tile kernels for the grouped GEMM (contract in grouped_gemm_tile.h), for
// CPUs without AVX512-BF16. Same packed layouts as the AVX-512 path; bf16 pairs are widened to fp32 with a
// shift (even element) and a mask (odd element) and accumulated with two FMAs. Register block: 6 rows x 8
// columns. A correct, moderately fast fallback, not a tuned kernel. Everything but the entry points is
// file-local.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "kernels/grouped_gemm_tile.h"

namespace moetron::gg {

namespace {

inline __m256i tail_mask(int64_t n) {  // lanes < n set
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(std::min<int64_t>(n, 8))), idx);
}

// File-local bit helpers (no inline functions from shared headers in an ISA-flagged file).
inline float as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float bf_lo(uint32_t pair) { return as_float(pair << 16); }
inline float bf_hi(uint32_t pair) { return as_float(pair & 0xffff0000u); }

inline uint16_t f32_to_bf16_bits(float f) {  // round to nearest even, NaN stays NaN (as moetron::to_bf16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// C[mr, nc <= 8] over `steps` steps. a(i, s) at A + i*rs + s*ss; b(s, :) at B + s*bss.
template <int MR, bool BF>
void ukr(const void* Av, int64_t rs, int64_t ss, const void* Bv, int64_t bss, int64_t steps, bool half_tail, int64_t nc,
         float* C, int64_t ldc, bool from_c, bf16* Cb) {
  const __m256i m = tail_mask(nc);
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = from_c ? _mm256_maskload_ps(C + i * ldc, m) : _mm256_setzero_ps();
  if constexpr (BF) {
    const uint16_t* A = static_cast<const uint16_t*>(Av);
    const uint16_t* B = static_cast<const uint16_t*>(Bv);
    const __m256i hi_mask = _mm256_set1_epi32(int32_t(0xffff0000u));
    for (int64_t s = 0; s < steps; ++s) {
      const __m256i b = _mm256_maskload_epi32(reinterpret_cast<const int*>(B + s * bss), m);
      const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
      const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(b, hi_mask));
      const bool half = half_tail && s == steps - 1;
      for (int i = 0; i < MR; ++i) {
        const uint16_t* a = A + i * rs + s * ss;
        uint32_t pair = a[0];
        if (!half) pair |= uint32_t(a[1]) << 16;
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(bf_lo(pair)), b0, acc[i]);
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(bf_hi(pair)), b1, acc[i]);
      }
    }
  } else {
    const float* A = static_cast<const float*>(Av);
    const float* B = static_cast<const float*>(Bv);
    for (int64_t s = 0; s < steps; ++s) {
      const __m256 b = _mm256_maskload_ps(B + s * bss, m);
      for (int i = 0; i < MR; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(A[i * rs + s * ss]), b, acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_maskstore_ps(C + i * ldc, m, acc[i]);
    if (Cb) {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, acc[i]);
      for (int64_t j = 0; j < nc; ++j) Cb[i * ldc + j].bits = f32_to_bf16_bits(tmp[j]);
    }
  }
}

template <bool BF>
using Fn = void (*)(const void*, int64_t, int64_t, const void*, int64_t, int64_t, bool, int64_t, float*, int64_t, bool,
                    bf16*);
template <bool BF>
Fn<BF> pick(int mr) {
  static constexpr Fn<BF> t[kMR] = {ukr<1, BF>, ukr<2, BF>, ukr<3, BF>, ukr<4, BF>, ukr<5, BF>, ukr<6, BF>};
  return t[mr - 1];
}

template <bool BF>
void run_tile(const Tile& t) {
  const int64_t esz = BF ? 2 : 4, pair = BF ? 2 : 1;  // elements per B column step
  const char* A = static_cast<const char*>(t.A);
  const char* B = static_cast<const char*>(t.B);
  for (int64_t g0 = 0; g0 < t.rows; g0 += t.a_rb) {
    const int64_t ge = std::min(g0 + t.a_rb, t.rows);
    for (int64_t r0 = g0; r0 < ge; r0 += kMR) {
      const int mr = int(std::min<int64_t>(kMR, ge - r0));
      const char* Ar = A + ((g0 / t.a_rb) * t.a_bs + (r0 - g0) * t.a_rs) * esz;
      for (int64_t c = 0; c < t.cols; c += 8) {
        const int64_t p = c / kPanel, cc = c % kPanel;
        const char* Bc = B + (p * t.b_ps + cc * pair) * esz;
        pick<BF>(mr)(Ar, t.a_rs, t.a_ss, Bc, t.b_ss, t.steps, t.a_odd_tail, std::min<int64_t>(8, t.cols - c),
                     t.C + r0 * t.ldc + c, t.ldc, t.accumulate, t.Cb ? t.Cb + r0 * t.ldc + c : nullptr);
      }
    }
  }
}

}  // namespace

void tile_bf16_avx2(const Tile& t) { run_tile<true>(t); }
void tile_f32_avx2(const Tile& t) { run_tile<false>(t); }

}  // namespace moetron::gg
