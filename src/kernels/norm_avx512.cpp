// norm_avx512.cpp: AVX-512 row kernels for RMSNorm (called by the drivers in norm.cpp when
// active_isa() is Avx512). Rows of any length C: the tail uses masked loads and stores.
// Not a driver: no threading or input checks here.
// GCC 12 warns about _mm512_undefined_ps() inside its own intrinsic headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "moetron/dtype.h"

namespace moetron::norm_avx512 {

namespace {
inline __mmask16 tail_mask(int64_t rem) { return rem >= 16 ? __mmask16(0xffff) : __mmask16((1u << rem) - 1u); }
inline void store_bf16(bf16* p, __m512 v, __mmask16 m) {
  __m256i b = (__m256i)_mm512_cvtneps_pbh(v);  // round to nearest even, like to_bf16
  _mm256_mask_storeu_epi16(p, m, b);
}
}  // namespace

void rmsnorm_fwd_row(float* y, bf16* y16, float* rstd, const float* x, const float* w, int64_t C, float eps) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= C; c += 32) {
    __m512 a = _mm512_loadu_ps(x + c), b = _mm512_loadu_ps(x + c + 16);
    s0 = _mm512_fmadd_ps(a, a, s0);
    s1 = _mm512_fmadd_ps(b, b, s1);
  }
  for (; c < C; c += 16) {
    __m512 a = _mm512_maskz_loadu_ps(tail_mask(C - c), x + c);
    s0 = _mm512_fmadd_ps(a, a, s0);
  }
  float ss = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  float r = 1.0f / std::sqrt(ss / float(C) + eps);
  *rstd = r;
  const __m512 vr = _mm512_set1_ps(r);
  for (c = 0; c < C; c += 16) {
    __mmask16 m = tail_mask(C - c);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vr), _mm512_maskz_loadu_ps(m, w + c));
    _mm512_mask_storeu_ps(y + c, m, v);
    if (y16) store_bf16(y16 + c, v, m);
  }
}

void rmsnorm_bwd_row(float* dx, float* dwacc, const float* dy, const float* x, const float* w, float r, int64_t C) {
  const __m512 vr = _mm512_set1_ps(r);
  __m512 s = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    __mmask16 m = tail_mask(C - c);
    __m512 xh = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vr);
    __m512 wdy = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + c), _mm512_maskz_loadu_ps(m, dy + c));
    s = _mm512_fmadd_ps(wdy, xh, s);
  }
  const __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(s) / float(C));
  for (int64_t c = 0; c < C; c += 16) {
    __mmask16 m = tail_mask(C - c);
    __m512 xh = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vr);
    __m512 d = _mm512_maskz_loadu_ps(m, dy + c);
    __m512 wdy = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + c), d);
    _mm512_mask_storeu_ps(dx + c, m, _mm512_mul_ps(vr, _mm512_fnmadd_ps(xh, dot, wdy)));
    if (dwacc) _mm512_mask_storeu_ps(dwacc + c, m, _mm512_fmadd_ps(d, xh, _mm512_maskz_loadu_ps(m, dwacc + c)));
  }
}

void rmsnorm_dw_row(float* dwacc, const float* dy, const float* x, float r, int64_t C) {
  const __m512 vr = _mm512_set1_ps(r);
  for (int64_t c = 0; c < C; c += 16) {
    __mmask16 m = tail_mask(C - c);
    __m512 xh = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), vr);
    __m512 d = _mm512_maskz_loadu_ps(m, dy + c);
    _mm512_mask_storeu_ps(dwacc + c, m, _mm512_fmadd_ps(d, xh, _mm512_maskz_loadu_ps(m, dwacc + c)));
  }
}

void add_rows(float* acc, const float* x, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) {
    __mmask16 m = tail_mask(n - c);
    _mm512_mask_storeu_ps(acc + c, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + c), _mm512_maskz_loadu_ps(m, x + c)));
  }
}

}  // namespace moetron::norm_avx512
