// swiglu_avx512.cpp: AVX-512 row kernels for SwiGLU (called by swiglu.cpp when active_isa() is Avx512),
// with the vector exp of exp_avx512.h (Cody-Waite range reduction, degree-7 polynomial, scalef; about 2 ulp).
// Not a driver: no threading or input checks here.
// GCC 12 warns about _mm512_undefined_ps() inside its own intrinsic headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "exp_avx512.h"
#include "moetron/dtype.h"

namespace moetron::swiglu_avx512 {

namespace {
inline __mmask16 tail_mask(int64_t rem) { return rem >= 16 ? __mmask16(0xffff) : __mmask16((1u << rem) - 1u); }

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
