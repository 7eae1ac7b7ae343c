// optim_avx2.cpp: the AdamW step and the gradient norm's block sum with AVX2 (compiled with -mavx2 -mfma and
// -ffp-contract=off, chosen at run time by optim.cpp). Both are bitwise the scalar path: AdamW performs the
// operations of adamw_step_ref<float> in its order, each multiply and add rounded on its own (no contraction
// into FMAs: this file is compiled with -ffp-contract=off and uses no FMA intrinsic in AdamW); the norm keeps
// the same 16 striped double lanes and the same lane tree. Not the AVX-512 file, not a driver (no threading).
#include <immintrin.h>

#include <cstdint>

#include "exp_avx2.h"
#include "moetron/optim.h"

namespace moetron::optim_avx2 {

namespace {

struct Consts {
  __m256 b1, omb1, b2, omb2, decay, ss, isb, eps, gs;
};

// Eight elements (a tail of n < 8 through masked loads and stores): m, v, p as adamw_step_ref<float>.
template <bool kDecay, bool kTail>
inline void adamw8(float* p, float* m, float* v, const float* g, const Consts& k, __m256i mask) {
  auto ld = [&](const float* a) { return kTail ? _mm256_maskload_ps(a, mask) : _mm256_loadu_ps(a); };
  auto st = [&](float* a, __m256 x) {
    if constexpr (kTail) _mm256_maskstore_ps(a, mask, x);
    else _mm256_storeu_ps(a, x);
  };
  const __m256 gi = _mm256_mul_ps(ld(g), k.gs);
  const __m256 mm = _mm256_add_ps(_mm256_mul_ps(k.b1, ld(m)), _mm256_mul_ps(k.omb1, gi));
  const __m256 vv = _mm256_add_ps(_mm256_mul_ps(k.b2, ld(v)), _mm256_mul_ps(k.omb2, _mm256_mul_ps(gi, gi)));
  __m256 pp = ld(p);
  if constexpr (kDecay) pp = _mm256_mul_ps(pp, k.decay);
  const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vv), k.isb), k.eps);
  pp = _mm256_sub_ps(pp, _mm256_mul_ps(k.ss, _mm256_div_ps(mm, denom)));
  st(m, mm);
  st(v, vv);
  st(p, pp);
}

template <bool kDecay>
void adamw_impl(float* p, float* m, float* v, const float* g, int64_t n, const Consts& k) {
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) adamw8<kDecay, false>(p + i, m + i, v + i, g + i, k, all);
  if (i < n) adamw8<kDecay, true>(p + i, m + i, v + i, g + i, k, avx2_tail_mask(n - i));
}

}  // namespace

void adamw_range(float* p, float* m, float* v, const float* g, int64_t n, const AdamWScalars& s, float grad_scale,
                 bool apply_decay) {
  const Consts k{_mm256_set1_ps(s.b1),           _mm256_set1_ps(s.one_minus_b1), _mm256_set1_ps(s.b2),
                 _mm256_set1_ps(s.one_minus_b2), _mm256_set1_ps(s.decay),        _mm256_set1_ps(s.step_size),
                 _mm256_set1_ps(s.inv_sqrt_bc2), _mm256_set1_ps(s.eps),          _mm256_set1_ps(grad_scale)};
  if (apply_decay) adamw_impl<true>(p, m, v, g, n, k);
  else adamw_impl<false>(p, m, v, g, n, k);
}

// Lane j of the 16 double lanes accumulates elements i with i % 16 == j: lanes 0-3, 4-7, 8-11 and 12-15 live in
// a0..a3. The square of a float is exact in double, so FMA and mul+add agree. The tree is (j, j+8), (j, j+4),
// (j, j+2), (j, j+1), as in the scalar path; a tail of fewer than 16 elements continues the lanes in scalar code.
double norm_block(const float* g, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x = _mm256_loadu_ps(g + i), y = _mm256_loadu_ps(g + i + 8);
    const __m256d x0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), x1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    const __m256d y0 = _mm256_cvtps_pd(_mm256_castps256_ps128(y)), y1 = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
    a0 = _mm256_fmadd_pd(x0, x0, a0);
    a1 = _mm256_fmadd_pd(x1, x1, a1);
    a2 = _mm256_fmadd_pd(y0, y0, a2);
    a3 = _mm256_fmadd_pd(y1, y1, a3);
  }
  alignas(32) double lane[16];
  _mm256_store_pd(lane, a0);
  _mm256_store_pd(lane + 4, a1);
  _mm256_store_pd(lane + 8, a2);
  _mm256_store_pd(lane + 12, a3);
  for (; i < n; ++i) {
    const double x = double(g[i]);
    lane[i & 15] += x * x;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] = lane[j] + lane[j + w];
  return lane[0];
}

}  // namespace moetron::optim_avx2
