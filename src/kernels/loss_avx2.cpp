// loss_avx2.cpp: the AVX2 + FMA row kernel of the fused linear cross-entropy (loss.cpp), for CPUs without
// AVX-512: max, exp and sum (in double lanes), then dlogits = (softmax - onehot) * scale in place, as fp32
// or as bf16 packed at the start of the row. Same contract as xent_row_scalar in loss.cpp and the same
// algorithm as loss_avx512.cpp (the exp is exp_ps of exp_avx2.h, within ~2 ulp of libm's; the sum is
// lane-striped over 8 lanes). Not a driver: no threading, GEMMs or input checks here. Only the entry point
// xent_row is visible outside this file.
#include <immintrin.h>

#include <cstdint>

#include "exp_avx2.h"

namespace {

// Writes the first n (<= 8) lanes of d as fp32 over z + j, or as bf16 at byte offset 2j of the row.
template <bool kBf16>
inline void put8(float* z, int64_t j, __m256 d, int64_t n) {
  if constexpr (kBf16) {
    store_bf16x8(reinterpret_cast<uint16_t*>(z) + j, d, n);
  } else if (n >= 8) {
    _mm256_storeu_ps(z + j, d);
  } else {
    _mm256_maskstore_ps(z + j, avx2_tail_mask(n), d);
  }
}

template <bool kBf16>
void fill_row(float* z, int64_t V, float value) {
  const __m256 d = _mm256_set1_ps(value);
  for (int64_t j = 0; j < V; j += 8) put8<kBf16>(z, j, d, V - j);
}

template <int kMode>  // 0 forward only, 1 fp32 dlogits, 2 bf16 dlogits
double xent_row_impl(float* z, int64_t V, int32_t t, float scale) {
  constexpr bool kGrad = kMode != 0, kBf16 = kMode == 2;
  if (t < 0) {
    if constexpr (kGrad) fill_row<kBf16>(z, V, 0.0f);
    return 0.0;
  }
  const int64_t V8 = V / 8 * 8;
  const __m256i tail = avx2_tail_mask(V - V8);
  const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
  // Pass 1: max, and a flag for non-finite logits (|x| >= inf, unordered for NaN).
  const __m256 inf = _mm256_set1_ps(__builtin_inff());
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = ninf, bad = _mm256_setzero_ps();
  for (int64_t j = 0; j < V8; j += 8) {
    const __m256 x = _mm256_loadu_ps(z + j);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(x, absmask), inf, _CMP_NLT_UQ));
    mx = _mm256_max_ps(mx, x);
  }
  if (V8 < V) {  // masked lanes load 0: finite, and replaced by -inf for the max
    const __m256 x = _mm256_maskload_ps(z + V8, tail);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(x, absmask), inf, _CMP_NLT_UQ));
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(tail)));
  }
  if (_mm256_movemask_ps(bad)) {
    if constexpr (kGrad) fill_row<kBf16>(z, V, __builtin_nanf(""));
    return __builtin_nan("");
  }
  const float mxs = avx2_hmax(mx);
  const float zt = z[t];
  // Pass 2: e = exp(z - max), summed in two double accumulators (lanes 0-3, 4-7), stored if grad.
  const __m256 vmx = _mm256_set1_ps(mxs);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  auto accumulate = [&](__m256 e) {
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  };
  for (int64_t j = 0; j < V8; j += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(z + j), vmx));
    accumulate(e);
    if constexpr (kGrad) _mm256_storeu_ps(z + j, e);
  }
  if (V8 < V) {
    const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_maskload_ps(z + V8, tail), vmx)),
                                   _mm256_castsi256_ps(tail));
    accumulate(e);
    if constexpr (kGrad) _mm256_maskstore_ps(z + V8, tail, e);
  }
  const double sum = avx2_hsum(_mm256_add_pd(s0, s1));
  // log(sum), sum in [1, V]: a call into libm, as in the AVX-512 kernel.
  const double loss = double(mxs) + __builtin_log(sum) - double(zt);
  if constexpr (kGrad) {
    // Pass 3: d = e * (scale / sum); then the target entry gets e_t * inv - scale. In bf16 mode the 16 bytes
    // written at 2j lie below float j + 8, which this iteration has already read.
    const float inv = float(double(scale) / sum);
    const float et = z[t];
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t j = 0; j < V8; j += 8) put8<kBf16>(z, j, _mm256_mul_ps(_mm256_loadu_ps(z + j), vinv), 8);
    if (V8 < V) put8<kBf16>(z, V8, _mm256_mul_ps(_mm256_maskload_ps(z + V8, tail), vinv), V - V8);
    put8<kBf16>(z, t, _mm256_set1_ps(et * inv - scale), 1);
  }
  return loss;
}

}  // namespace

namespace moetron::loss_avx2 {

double xent_row(float* z, int64_t V, int32_t t, float scale, int mode) {
  switch (mode) {
    case 0: return xent_row_impl<0>(z, V, t, scale);
    case 1: return xent_row_impl<1>(z, V, t, scale);
    default: return xent_row_impl<2>(z, V, t, scale);
  }
}

}  // namespace moetron::loss_avx2
