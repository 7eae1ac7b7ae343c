// loss_avx512.cpp: the AVX-512 row passes of the fused linear cross-entropy (loss_row.h, driven by loss.cpp):
// max, exp and sum (in double lanes), then dlogits = (softmax - onehot) * scale in place, as fp32 or as bf16
// packed at the start of the row. Same contract as the scalar passes in loss.cpp; not bitwise equal to them
// (the exp here is a polynomial within ~2 ulp of libm's, and the sum is lane-striped). Not a driver: no
// threading, GEMMs or input checks here.
// GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_* helpers (a known
// false positive); silence it for this file only.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "exp_avx512.h"
#include "loss_row.h"

namespace moetron::loss_avx512 {

namespace {

// exp(x) for x <= ~88 (exp_avx512.h's variant clamped only below, at -104: those inputs give 0).
inline __m512 exp16(__m512 x) { return exp_ps<false>(x); }

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

// Writes d (16 lanes, masked) as fp32 over z + j or as bf16 at byte offset 2j of the row.
template <bool kBf16>
inline void put16(float* z, int64_t j, __m512 d, __mmask16 m) {
  if constexpr (kBf16) {
    __m256i b = (__m256i)_mm512_cvtneps_pbh(d);
    _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(z) + j, m, b);
  } else {
    _mm512_mask_storeu_ps(z + j, m, d);
  }
}

template <bool kBf16>
void fill_row(float* z, int64_t V, float value) {
  const __m512 d = _mm512_set1_ps(value);
  for (int64_t j = 0; j < V; j += 16) put16<kBf16>(z, j, d, tail_mask(V - j));
}

float row_max(const float* z, int64_t V) {
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
  __m512 mx = _mm512_set1_ps(-__builtin_inff());
  __mmask16 bad = 0;
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 m = tail_mask(V - j);
    __m512 x = _mm512_maskz_loadu_ps(m, z + j);
    __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), absmask));
    bad |= _mm512_mask_cmp_ps_mask(m, a, inf, _CMP_NLT_UQ);  // inf or NaN
    mx = _mm512_mask_max_ps(mx, m, mx, x);
  }
  return bad ? __builtin_nanf("") : _mm512_reduce_max_ps(mx);
}

// e = exp(z - max), summed in two double accumulators (lanes 0-7, 8-15), stored if kStore.
template <bool kStore>
double row_exp_impl(float* z, int64_t V, float mxs) {
  const __m512 vmx = _mm512_set1_ps(mxs);
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 m = tail_mask(V - j);
    __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, z + j), vmx)));
    s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    if constexpr (kStore) _mm512_mask_storeu_ps(z + j, m, e);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
}
double row_exp(float* z, int64_t V, float mx, bool store) {
  return store ? row_exp_impl<true>(z, V, mx) : row_exp_impl<false>(z, V, mx);
}

// d = e * inv; then the target entry (if in the row) gets e_t * inv - scale.
template <bool kBf16>
void row_grad_impl(float* z, int64_t V, int64_t t, float inv, float scale) {
  const float et = t >= 0 && t < V ? z[t] : 0.0f;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 m = tail_mask(V - j);
    put16<kBf16>(z, j, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, z + j), vinv), m);
  }
  if (t >= 0 && t < V) put16<kBf16>(z, t, _mm512_set1_ps(et * inv - scale), __mmask16(1));
}
void row_grad(float* z, int64_t V, int64_t t, float inv, float scale, bool bf16) {
  if (bf16) row_grad_impl<true>(z, V, t, inv, scale);
  else row_grad_impl<false>(z, V, t, inv, scale);
}

void row_fill(float* z, int64_t V, float value, bool bf16) {
  if (bf16) fill_row<true>(z, V, value);
  else fill_row<false>(z, V, value);
}

}  // namespace

XentRowOps row_ops() { return {row_max, row_exp, row_grad, row_fill}; }

}  // namespace moetron::loss_avx512
