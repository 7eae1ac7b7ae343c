// permute_avx2.cpp: AVX2 bodies of the MoE permute / unpermute kernels (validation and dispatch live in
// permute.cpp; chosen when active_isa() is Avx2). Not the plan, not the AVX-512 file, not the fp32 gather
// (the portable memcpy is already glibc's vector copy). Bitwise the portable path
// everywhere but one output: the bf16 gather rounds as to_bf16 (nearest even, NaN quiet,
// subnormals kept), the sums add in slot order and the weighted sum rounds the product and then the sum (this
// file is compiled with -ffp-contract=off and uses FMAs only in the dot product). The exception is dw of the
// unpermute backward, dot(dy, yp): 8 lanes x 4 accumulators combined in a fixed order, where the portable code
// sums sequentially; it is held to the same (D + 8) u bound as the AVX-512 kernel's 16 x 4 lanes.
#include <immintrin.h>

#include <cstdint>

#include "exp_avx2.h"
#include "moetron/dtype.h"
#include "permute_walk.h"

namespace moetron {

namespace {

inline void cvt_row(bf16* dst, const float* src, int64_t D) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) store_bf16x8(dst + d, _mm256_loadu_ps(src + d), 8);
  if (d < D) store_bf16x8(dst + d, _mm256_maskload_ps(src + d, avx2_tail_mask(D - d)), D - d);
}

// o = sum over the kept slots s (rows[s] >= 0), in slot order, of src row rows[s], times wt[s] when Weighted
// (acc + w * v, product and sum rounded separately: the portable order) or not (acc + v); acc starts at 0.
template <bool Weighted>
inline void sum_rows(float* o, const float* src, const int32_t* rows, const float* wt, int k, int64_t D) {
  auto acc = [&](__m256 a, int s, __m256 v) {
    if constexpr (Weighted) return _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(wt[s]), v));
    else return _mm256_add_ps(a, v);
  };
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int s = 0; s < k; ++s) {
      if (rows[s] < 0) continue;
      const float* v = src + int64_t(rows[s]) * D + d;
      a0 = acc(a0, s, _mm256_loadu_ps(v));
      a1 = acc(a1, s, _mm256_loadu_ps(v + 8));
      a2 = acc(a2, s, _mm256_loadu_ps(v + 16));
      a3 = acc(a3, s, _mm256_loadu_ps(v + 24));
    }
    _mm256_storeu_ps(o + d, a0);
    _mm256_storeu_ps(o + d + 8, a1);
    _mm256_storeu_ps(o + d + 16, a2);
    _mm256_storeu_ps(o + d + 24, a3);
  }
  for (; d < D; d += 8) {
    const __m256i m = avx2_tail_mask(D - d);
    __m256 a = _mm256_setzero_ps();
    for (int s = 0; s < k; ++s)
      if (rows[s] >= 0) a = acc(a, s, _mm256_maskload_ps(src + int64_t(rows[s]) * D + d, m));
    _mm256_maskstore_ps(o + d, m, a);
  }
}

// One pass over a (t, s) pair: o = ws * g (fp32 or bf16) and returns dot(g, v), 8 lanes x 4 accumulators
// combined as ((s0 + s1) + (s2 + s3)), then avx2_hsum's fixed lane order.
template <bool kBf16>
inline float scale_and_dot(void* out, const float* g, const float* v, float ws, int64_t D) {
  const __m256 vs = _mm256_set1_ps(ws);
  auto put = [&](int64_t d, __m256 x, int64_t n) {
    if constexpr (kBf16) store_bf16x8(static_cast<bf16*>(out) + d, x, n);
    else if (n >= 8) _mm256_storeu_ps(static_cast<float*>(out) + d, x);
    else _mm256_maskstore_ps(static_cast<float*>(out) + d, avx2_tail_mask(n), x);
  };
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    const __m256 g0 = _mm256_loadu_ps(g + d), g1 = _mm256_loadu_ps(g + d + 8);
    const __m256 g2 = _mm256_loadu_ps(g + d + 16), g3 = _mm256_loadu_ps(g + d + 24);
    put(d, _mm256_mul_ps(vs, g0), 8);
    put(d + 8, _mm256_mul_ps(vs, g1), 8);
    put(d + 16, _mm256_mul_ps(vs, g2), 8);
    put(d + 24, _mm256_mul_ps(vs, g3), 8);
    s0 = _mm256_fmadd_ps(g0, _mm256_loadu_ps(v + d), s0);
    s1 = _mm256_fmadd_ps(g1, _mm256_loadu_ps(v + d + 8), s1);
    s2 = _mm256_fmadd_ps(g2, _mm256_loadu_ps(v + d + 16), s2);
    s3 = _mm256_fmadd_ps(g3, _mm256_loadu_ps(v + d + 24), s3);
  }
  for (; d < D; d += 8) {
    const __m256i m = avx2_tail_mask(D - d);
    const __m256 g0 = _mm256_maskload_ps(g + d, m);
    put(d, _mm256_mul_ps(vs, g0), D - d);
    s0 = _mm256_fmadd_ps(g0, _mm256_maskload_ps(v + d, m), s0);
  }
  return avx2_hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

}  // namespace

void moe_permute_bf16_avx2(bf16* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) cvt_row(xp + r * D, x + int64_t(token_of[r]) * D, D);
}

// dx[t] = sum_s dxp[row(t, s)]: 0 + v0 + v1 + ... per element, as the portable path.
void moe_permute_backward_avx2(float* dx, const float* dxp, const int32_t* row_of, int64_t N, int k, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) sum_rows<false>(dx + t * D, dxp, row_of + t * k, nullptr, k, D);
}

// y[t] = sum_s w[t,s] * yp[row(t, s)]: ((0 + w0 v0) + w1 v1) + ... in slot order, as the portable path.
void moe_unpermute_avx2(float* y, const float* yp, const int32_t* row_of, const float* w, int64_t N, int k,
                        int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) sum_rows<true>(y + t * D, yp, row_of + t * k, w + t * k, k, D);
}

// dyp[r] = w[t,s] * dy[t] (fp32 into dyp32 or bf16 into dyp16) and dw[t,s] = dot(dy[t], yp[r]), walking the
// permuted rows in order (the two large buffers stream; the dy rows are gathered). Dropped slots get dw = 0.
void moe_unpermute_backward_avx2(float* dyp32, bf16* dyp16, float* dw, const float* dy, const float* yp,
                                 const int32_t* row_of, const int32_t* token_of, const int32_t* slot_of,
                                 const float* w, int64_t N, int k, int64_t R, int64_t D) {
  if (dyp32)
    unpermute_backward_walk(dyp32, dw, dy, yp, row_of, token_of, slot_of, w, N, k, R, D,
                            [](float* o, const float* g, const float* v, float wi, int64_t n) {
                              return scale_and_dot<false>(o, g, v, wi, n);
                            });
  else
    unpermute_backward_walk(dyp16, dw, dy, yp, row_of, token_of, slot_of, w, N, k, R, D,
                            [](bf16* o, const float* g, const float* v, float wi, int64_t n) {
                              return scale_and_dot<true>(o, g, v, wi, n);
                            });
}

}  // namespace moetron
