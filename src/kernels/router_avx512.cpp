// router_avx512.cpp: AVX-512 score rows for the router (softmax or sigmoid over E experts per token).
// Not the selection (shared scalar code in router.cpp). The exp is a degree-7 polynomial after a
// Cody-Waite reduction, within 2 ulp of the correctly rounded expf on the router's input range, so the scores
// differ from router_scores_ref<float> by a few ulp (the tolerance rationale is in docs/kernels/moe.md).
// GCC 12 warns falsely about _mm512_undefined_* inside its own intrinsic headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace moetron {

namespace {

inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  // e^r, |r| <= 0.35: Taylor to r^7 (truncation < 5e-9 relative).
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // p * 2^n, with exact underflow to 0 / overflow to inf
}

inline __mmask16 tail_mask(int rem) { return rem >= 16 ? __mmask16(0xffff) : __mmask16((1u << rem) - 1); }

void softmax_row(float* s, const float* l, int E) {
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int e = 0; e < E; e += 16)
    vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(E - e), l + e));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 vz = _mm512_setzero_ps();
  for (int e = 0; e < E; e += 16) {
    __mmask16 k = tail_mask(E - e);
    __m512 v = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + e), m));
    v = _mm512_maskz_mov_ps(k, v);
    _mm512_mask_storeu_ps(s + e, k, v);
    vz = _mm512_add_ps(vz, v);
  }
  const __m512 z = _mm512_set1_ps(_mm512_reduce_add_ps(vz));
  for (int e = 0; e < E; e += 16) {
    __mmask16 k = tail_mask(E - e);
    _mm512_mask_storeu_ps(s + e, k, _mm512_div_ps(_mm512_maskz_loadu_ps(k, s + e), z));
  }
}

void sigmoid_row(float* s, const float* l, int E) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int e = 0; e < E; e += 16) {
    __mmask16 k = tail_mask(E - e);
    __m512 x = _mm512_maskz_loadu_ps(k, l + e);
    __m512 v = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    _mm512_mask_storeu_ps(s + e, k, v);
  }
}

}  // namespace

void router_scores_rows_avx512(float* s, const float* l, int64_t rows, int E, bool softmax) {
  for (int64_t r = 0; r < rows; ++r) {
    if (softmax) softmax_row(s + r * E, l + r * E, E);
    else sigmoid_row(s + r * E, l + r * E, E);
  }
}

}  // namespace moetron
