// swiglu_avx512.cpp: AVX-512 row kernels for SwiGLU (called by swiglu.cpp when active_isa() is Avx512),
// with a vector exp (Cody-Waite range reduction, degree-7 polynomial, scalef; about 2 ulp).
// Not a driver: no threading or input checks here.
// GCC 12 warns about _mm512_undefined_ps() inside its own intrinsic headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "moetron/dtype.h"

namespace moetron::swiglu_avx512 {

namespace {
inline __mmask16 tail_mask(int64_t rem) { return rem >= 16 ? __mmask16(0xffff) : __mmask16((1u << rem) - 1u); }

// exp(x) for x in [-104, 89] (clamped outside: below gives 0, above +inf).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 hi (exact in n*hi)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);   // ln2 lo
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
inline __m512 sigmoid_ps(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}
}  // namespace

void fwd_row(float* h, bf16* h16, const float* g, const float* u, float s, int64_t F) {
  const __m512 vs = _mm512_set1_ps(s);
  for (int64_t f = 0; f < F; f += 16) {
    __mmask16 m = tail_mask(F - f);
    __m512 vg = _mm512_maskz_loadu_ps(m, g + f), vu = _mm512_maskz_loadu_ps(m, u + f);
    __m512 v = _mm512_mul_ps(vs, _mm512_mul_ps(_mm512_mul_ps(vg, sigmoid_ps(vg)), vu));
    _mm512_mask_storeu_ps(h + f, m, v);
    if (h16) _mm256_mask_storeu_epi16(h16 + f, m, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

float bwd_row(float* dg, float* du, const float* dh, const float* g, const float* u, float s, int64_t F) {
  const __m512 vs = _mm512_set1_ps(s), one = _mm512_set1_ps(1.0f);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t f = 0; f < F; f += 16) {
    __mmask16 m = tail_mask(F - f);
    __m512 vg = _mm512_maskz_loadu_ps(m, g + f), vu = _mm512_maskz_loadu_ps(m, u + f);
    __m512 d = _mm512_maskz_loadu_ps(m, dh + f);
    __m512 sig = sigmoid_ps(vg);
    __m512 silu = _mm512_mul_ps(vg, sig);
    __m512 dsilu = _mm512_mul_ps(sig, _mm512_fmadd_ps(vg, _mm512_sub_ps(one, sig), one));
    __m512 dsu = _mm512_mul_ps(d, vu);
    _mm512_mask_storeu_ps(dg + f, m, _mm512_mul_ps(vs, _mm512_mul_ps(dsu, dsilu)));
    _mm512_mask_storeu_ps(du + f, m, _mm512_mul_ps(vs, _mm512_mul_ps(d, silu)));
    acc = _mm512_fmadd_ps(dsu, silu, acc);  // masked lanes are 0
  }
  return _mm512_reduce_add_ps(acc);
}

}  // namespace moetron::swiglu_avx512
