// optim_avx512.cpp: AVX-512 AdamW step and sum-of-squares block for optim.cpp. Each function
// reproduces the scalar path bitwise: every multiply and add uses the *_round_ps builtins with
// _MM_FROUND_CUR_DIRECTION, which the compiler cannot contract into FMAs, and the operation order is
// the one written in include/moetron/optim.h. Not called directly: optim.cpp dispatches here.
// GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_* helpers (a known
// false positive); silence it for this file only.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "moetron/optim.h"

namespace moetron::optim_avx512 {

namespace {

constexpr int R = _MM_FROUND_CUR_DIRECTION;

inline __m512 mul(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, R); }
inline __m512 add(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, R); }
inline __m512 sub(__m512 a, __m512 b) { return _mm512_sub_round_ps(a, b, R); }

struct Consts {
  __m512 b1, omb1, b2, omb2, decay, ss, isb, eps, gs;
};

template <bool kDecay>
inline void adamw16(float* p, float* m, float* v, const float* g, const Consts& k, __mmask16 mask) {
  __m512 gi = mul(_mm512_maskz_loadu_ps(mask, g), k.gs);
  __m512 mm = add(mul(k.b1, _mm512_maskz_loadu_ps(mask, m)), mul(k.omb1, gi));
  __m512 vv = add(mul(k.b2, _mm512_maskz_loadu_ps(mask, v)), mul(k.omb2, mul(gi, gi)));
  __m512 pp = _mm512_maskz_loadu_ps(mask, p);
  if constexpr (kDecay) pp = mul(pp, k.decay);
  __m512 denom = add(mul(_mm512_sqrt_ps(vv), k.isb), k.eps);
  pp = sub(pp, mul(k.ss, _mm512_div_ps(mm, denom)));
  _mm512_mask_storeu_ps(m, mask, mm);
  _mm512_mask_storeu_ps(v, mask, vv);
  _mm512_mask_storeu_ps(p, mask, pp);
}

template <bool kDecay>
void adamw_impl(float* p, float* m, float* v, const float* g, int64_t n, const Consts& k) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) adamw16<kDecay>(p + i, m + i, v + i, g + i, k, __mmask16(0xffff));
  if (i < n) adamw16<kDecay>(p + i, m + i, v + i, g + i, k, __mmask16((1u << (n - i)) - 1));
}

}  // namespace

void adamw_range(float* p, float* m, float* v, const float* g, int64_t n, const AdamWScalars& s, float grad_scale,
                 bool apply_decay) {
  Consts k{_mm512_set1_ps(s.b1),    _mm512_set1_ps(s.one_minus_b1), _mm512_set1_ps(s.b2),
           _mm512_set1_ps(s.one_minus_b2), _mm512_set1_ps(s.decay), _mm512_set1_ps(s.step_size),
           _mm512_set1_ps(s.inv_sqrt_bc2), _mm512_set1_ps(s.eps),  _mm512_set1_ps(grad_scale)};
  if (apply_decay) adamw_impl<true>(p, m, v, g, n, k);
  else adamw_impl<false>(p, m, v, g, n, k);
}

// Lane j of the 16 double lanes accumulates elements i with i % 16 == j: lanes 0-7 live in lo and
// 8-15 in hi. The square of a float is exact in double, so FMA and mul+add agree. The lane tree is
// (j, j+8), then (j, j+4), (j, j+2), (j, j+1), as in the scalar path.
double norm_block(const float* g, int64_t n) {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 x = _mm512_loadu_ps(g + i);
    __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    lo = _mm512_fmadd_pd(a, a, lo);
    hi = _mm512_fmadd_pd(b, b, hi);
  }
  if (i < n) {
    __m512 x = _mm512_maskz_loadu_ps(__mmask16((1u << (n - i)) - 1), g + i);
    __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    lo = _mm512_fmadd_pd(a, a, lo);
    hi = _mm512_fmadd_pd(b, b, hi);
  }
  __m512d s8 = _mm512_add_pd(lo, hi);                                                       // j + (j+8)
  __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));  // j + (j+4)
  __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));      // j + (j+2)
  return _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));                          // 0 + 1
}

}  // namespace moetron::optim_avx512
