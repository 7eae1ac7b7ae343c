// permute_avx512.cpp: AVX-512 bodies of the MoE permute / unpermute kernels (validation and dispatch live
// in permute.cpp). Not the plan. Rows are processed in 64-float register blocks; the weighted sums are
// fused multiply-adds in slot order (one rounding per slot, where the reference rounds the product and the
// sum); the dot products for dw use 16 lanes x 4 accumulators combined in a fixed order. fp32 -> bf16 uses
// VCVTNE2PS2BF16 (round to nearest even; note: it flushes denormal inputs to zero, unlike to_bf16).
// GCC 12 warns falsely about _mm512_undefined_* inside its own intrinsic headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstdint>

#include "moetron/dtype.h"
#include "permute_walk.h"

namespace moetron {

namespace {

inline __mmask16 tail_mask(int64_t rem) { return rem >= 16 ? __mmask16(0xffff) : __mmask16((1u << rem) - 1); }

inline void copy_row(float* dst, const float* src, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m512 a = _mm512_loadu_ps(src + d), b = _mm512_loadu_ps(src + d + 16);
    __m512 c = _mm512_loadu_ps(src + d + 32), e = _mm512_loadu_ps(src + d + 48);
    _mm512_storeu_ps(dst + d, a);
    _mm512_storeu_ps(dst + d + 16, b);
    _mm512_storeu_ps(dst + d + 32, c);
    _mm512_storeu_ps(dst + d + 48, e);
  }
  for (; d < D; d += 16) {
    __mmask16 m = tail_mask(D - d);
    _mm512_mask_storeu_ps(dst + d, m, _mm512_maskz_loadu_ps(m, src + d));
  }
}

inline __m256i cvt16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

inline void cvt_row(bf16* dst, const float* src, int64_t D) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m512i p = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + d + 16), _mm512_loadu_ps(src + d));
    _mm512_storeu_si512(dst + d, p);
  }
  for (; d < D; d += 16) {
    __mmask16 m = tail_mask(D - d);
    _mm256_mask_storeu_epi16(dst + d, m, cvt16(_mm512_maskz_loadu_ps(m, src + d)));
  }
}

}  // namespace

void moe_permute_f32_avx512(float* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) copy_row(xp + r * D, x + int64_t(token_of[r]) * D, D);
}

void moe_permute_bf16_avx512(bf16* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) cvt_row(xp + r * D, x + int64_t(token_of[r]) * D, D);
}

namespace {

// o = sum over the kept slots s (rows[s] >= 0), in slot order, of src row rows[s], each scaled by wt[s] when
// Weighted (fma(w, v, acc), one rounding per slot: the reference's order) or not (acc + v).
template <bool Weighted>
inline void sum_rows(float* o, const float* src, const int32_t* rows, const float* wt, int k, int64_t D) {
  auto acc = [&](__m512 a, int s, __m512 v) {
    if constexpr (Weighted) return _mm512_fmadd_ps(_mm512_set1_ps(wt[s]), v, a);
    else return _mm512_add_ps(a, v);
  };
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int s = 0; s < k; ++s) {
      if (rows[s] < 0) continue;
      const float* v = src + int64_t(rows[s]) * D + d;
      a0 = acc(a0, s, _mm512_loadu_ps(v));
      a1 = acc(a1, s, _mm512_loadu_ps(v + 16));
      a2 = acc(a2, s, _mm512_loadu_ps(v + 32));
      a3 = acc(a3, s, _mm512_loadu_ps(v + 48));
    }
    _mm512_storeu_ps(o + d, a0);
    _mm512_storeu_ps(o + d + 16, a1);
    _mm512_storeu_ps(o + d + 32, a2);
    _mm512_storeu_ps(o + d + 48, a3);
  }
  for (; d < D; d += 16) {
    __mmask16 m = tail_mask(D - d);
    __m512 a = _mm512_setzero_ps();
    for (int s = 0; s < k; ++s)
      if (rows[s] >= 0) a = acc(a, s, _mm512_maskz_loadu_ps(m, src + int64_t(rows[s]) * D + d));
    _mm512_mask_storeu_ps(o + d, m, a);
  }
}

}  // namespace

// dx[t] = sum_s dxp[row(t, s)]: 0 + v0 + v1 + ... per element, as the reference.
void moe_permute_backward_avx512(float* dx, const float* dxp, const int32_t* row_of, int64_t N, int k, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) sum_rows<false>(dx + t * D, dxp, row_of + t * k, nullptr, k, D);
}

// y[t] = sum_s w[t,s] * yp[row(t, s)]: fma(w1, v1, fma(w0, v0, 0)) ... in slot order.
void moe_unpermute_avx512(float* y, const float* yp, const int32_t* row_of, const float* w, int64_t N, int k,
                          int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) sum_rows<true>(y + t * D, yp, row_of + t * k, w + t * k, k, D);
}

namespace {

// One pass over a (t, s) pair: o = ws * g (fp32 or bf16) and returns dot(g, v), 16 lanes x 4 accumulators.
template <bool kBf16>
inline float scale_and_dot(void* out, const float* g, const float* v, float ws, int64_t D) {
  const __m512 vs = _mm512_set1_ps(ws);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) {
    __m512 g0 = _mm512_loadu_ps(g + d), g1 = _mm512_loadu_ps(g + d + 16);
    __m512 g2 = _mm512_loadu_ps(g + d + 32), g3 = _mm512_loadu_ps(g + d + 48);
    if constexpr (kBf16) {
      bf16* o = static_cast<bf16*>(out) + d;
      _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(vs, g1), _mm512_mul_ps(vs, g0)));
      _mm512_storeu_si512(o + 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(vs, g3), _mm512_mul_ps(vs, g2)));
    } else {
      float* o = static_cast<float*>(out) + d;
      _mm512_storeu_ps(o, _mm512_mul_ps(vs, g0));
      _mm512_storeu_ps(o + 16, _mm512_mul_ps(vs, g1));
      _mm512_storeu_ps(o + 32, _mm512_mul_ps(vs, g2));
      _mm512_storeu_ps(o + 48, _mm512_mul_ps(vs, g3));
    }
    s0 = _mm512_fmadd_ps(g0, _mm512_loadu_ps(v + d), s0);
    s1 = _mm512_fmadd_ps(g1, _mm512_loadu_ps(v + d + 16), s1);
    s2 = _mm512_fmadd_ps(g2, _mm512_loadu_ps(v + d + 32), s2);
    s3 = _mm512_fmadd_ps(g3, _mm512_loadu_ps(v + d + 48), s3);
  }
  for (; d < D; d += 16) {
    __mmask16 m = tail_mask(D - d);
    __m512 g0 = _mm512_maskz_loadu_ps(m, g + d);
    if constexpr (kBf16) _mm256_mask_storeu_epi16(static_cast<bf16*>(out) + d, m, cvt16(_mm512_mul_ps(vs, g0)));
    else _mm512_mask_storeu_ps(static_cast<float*>(out) + d, m, _mm512_mul_ps(vs, g0));
    s0 = _mm512_fmadd_ps(g0, _mm512_maskz_loadu_ps(m, v + d), s0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

}  // namespace

// dyp[r] = w[t,s] * dy[t] (fp32 into dyp32 or bf16 into dyp16) and dw[t,s] = dot(dy[t], yp[r]), walking the
// permuted rows r in order (t = token_of[r], s = slot_of[r]): the two large buffers stream sequentially and
// only the dy rows are gathered. Dropped slots (row_of < 0) get dw = 0.
void moe_unpermute_backward_avx512(float* dyp32, bf16* dyp16, float* dw, const float* dy, const float* yp,
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
