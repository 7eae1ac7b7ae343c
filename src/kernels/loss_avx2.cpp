// loss_avx2.cpp: the AVX2 + FMA row passes of the fused linear cross-entropy (loss_row.h, driven by loss.cpp),
// for CPUs without AVX-512: max, exp and sum (in double lanes), then dlogits = (softmax - onehot) * scale in
// place, as fp32 or as bf16 packed at the start of the row. Same contract as the scalar passes in loss.cpp and
// the same algorithm as loss_avx512.cpp (the exp is exp_ps of exp_avx2.h, within ~2 ulp of libm's; the sum is
// lane-striped over 8 lanes). Not a driver: no threading, GEMMs or input checks here. Only row_ops() is
// visible outside this file.
#include <immintrin.h>

#include <cstdint>

#include "exp_avx2.h"
#include "loss_row.h"

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

float row_max(const float* z, int64_t V) {
  const int64_t V8 = V / 8 * 8;
  const __m256i tail = avx2_tail_mask(V - V8);
  const __m256 ninf = _mm256_set1_ps(-__builtin_inff());
  // Max, and a flag for non-finite logits (|x| >= inf, unordered for NaN).
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
  return _mm256_movemask_ps(bad) ? __builtin_nanf("") : avx2_hmax(mx);
}

// e = exp(z - max), summed in two double accumulators (lanes 0-3, 4-7), stored if kStore.
template <bool kStore>
double row_exp_impl(float* z, int64_t V, float mxs) {
  const int64_t V8 = V / 8 * 8;
  const __m256i tail = avx2_tail_mask(V - V8);
  const __m256 vmx = _mm256_set1_ps(mxs);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  auto accumulate = [&](__m256 e) {
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  };
  for (int64_t j = 0; j < V8; j += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(z + j), vmx));
    accumulate(e);
    if constexpr (kStore) _mm256_storeu_ps(z + j, e);
  }
  if (V8 < V) {
    const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_maskload_ps(z + V8, tail), vmx)),
                                   _mm256_castsi256_ps(tail));
    accumulate(e);
    if constexpr (kStore) _mm256_maskstore_ps(z + V8, tail, e);
  }
  return avx2_hsum(_mm256_add_pd(s0, s1));
}
double row_exp(float* z, int64_t V, float mx, bool store) {
  return store ? row_exp_impl<true>(z, V, mx) : row_exp_impl<false>(z, V, mx);
}

// d = e * inv; then the target entry (if in the row) gets e_t * inv - scale. In bf16 mode the 16 bytes
// written at 2j lie below float j + 8, which this iteration has already read.
template <bool kBf16>
void row_grad_impl(float* z, int64_t V, int64_t t, float inv, float scale) {
  const int64_t V8 = V / 8 * 8;
  const __m256i tail = avx2_tail_mask(V - V8);
  const float et = t >= 0 && t < V ? z[t] : 0.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t j = 0; j < V8; j += 8) put8<kBf16>(z, j, _mm256_mul_ps(_mm256_loadu_ps(z + j), vinv), 8);
  if (V8 < V) put8<kBf16>(z, V8, _mm256_mul_ps(_mm256_maskload_ps(z + V8, tail), vinv), V - V8);
  if (t >= 0 && t < V) put8<kBf16>(z, t, _mm256_set1_ps(et * inv - scale), 1);
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

namespace moetron::loss_avx2 {

XentRowOps row_ops() { return {row_max, row_exp, row_grad, row_fill}; }

}  // namespace moetron::loss_avx2
