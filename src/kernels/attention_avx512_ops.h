// attention_avx512_ops.h: the AVX-512 pieces of the flash-attention backends, shared by the fp32 backend
// (attention_avx512.cpp) and the bf16 one (attention_bf16_avx512.cpp): a register-blocked fp32 tile GEMM
// (6 rows x 64 columns of accumulators, broadcast A, masked N tail), a vector exp2 (range reduction + degree-7
// polynomial + scalef, about 1 ulp; exactly 0 below 2^-150), 16x16 register transposes for packing, and the
// row/column softmax pieces (Avx512Ops, the Ops backend of attention_impl.h). Everything is in an anonymous
// namespace, so only *_avx512.cpp files (compiled with the AVX-512 flags) may include it. Not a public header.
#pragma once
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

#include "attention_impl.h"
#include "transpose_avx512.h"

namespace {

inline __mmask16 tail_mask(int64_t rem) { return rem >= 16 ? __mmask16(0xffff) : __mmask16((1u << rem) - 1u); }

// 2^x; x below -150 gives exactly 0, above 128 gives +inf.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(128.0f)), _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5], exact
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// C[MR, 16*NV] (+)= op(A)[MR, K] B[K, 16*NV]; the last of the NV vectors is masked by `last`.
template <int MR, int NV, bool ACC, bool TA>
void micro(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
           __mmask16 last) {
  __m512 c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[NV];
    const float* Bk = B + k * ldb;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      b[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, Bk + 16 * v) : _mm512_loadu_ps(Bk + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(TA ? A[k * lda + r] : A[r * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? last : __mmask16(0xffff);
      float* p = C + r * ldc + 16 * v;
      __m512 x = c[r][v];
      if (ACC) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, p));
      _mm512_mask_storeu_ps(p, m, x);
    }
}

constexpr int kMR = 6, kNV = 4;
using MicroFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, __mmask16);

template <bool ACC, bool TA, int MR, int... NVs>
constexpr std::array<MicroFn, sizeof...(NVs)> row_of(std::integer_sequence<int, NVs...>) {
  return {&micro<MR, NVs + 1, ACC, TA>...};
}
template <bool ACC, bool TA, int... MRs>
constexpr std::array<std::array<MicroFn, kNV>, sizeof...(MRs)> table_of(std::integer_sequence<int, MRs...>) {
  return {row_of<ACC, TA, MRs + 1>(std::make_integer_sequence<int, kNV>())...};
}
// kMicro[acc][ta][mr-1][nv-1]
const std::array<std::array<MicroFn, kNV>, kMR> kMicro[2][2] = {
    {table_of<false, false>(std::make_integer_sequence<int, kMR>()),
     table_of<false, true>(std::make_integer_sequence<int, kMR>())},
    {table_of<true, false>(std::make_integer_sequence<int, kMR>()),
     table_of<true, true>(std::make_integer_sequence<int, kMR>())}};

// dst[c*ldd + r] = src[r*lds + c] for a full 16 x 16 block (the register transpose of transpose_avx512.h).
inline void transpose16(float* dst, int64_t ldd, const float* src, int64_t lds) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(_mm512_loadu_ps(src + i * lds));
  transpose16x16_epi32(r, t);
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ldd, _mm512_castsi512_ps(t[i]));
}

struct Avx512Ops {
  static constexpr int64_t kRows = kMR;
  static void gemm(bool acc, bool trans_a, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                   const float* B, int64_t ldb, float* C, int64_t ldc) {
    for (int64_t n0 = 0; n0 < N; n0 += 16 * kNV) {
      const int64_t nn = std::min<int64_t>(16 * kNV, N - n0), nv = (nn + 15) / 16;
      const __mmask16 last = tail_mask(nn - 16 * (nv - 1));
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, M - m0);
        const float* Am = trans_a ? A + m0 : A + m0 * lda;
        kMicro[acc][trans_a][mr - 1][nv - 1](K, Am, lda, B + n0, ldb, C + m0 * ldc + n0, ldc, last);
      }
    }
  }
  static float exp2_row(float* p, int64_t n, float c, float m) {
    const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(m);
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = tail_mask(n - i);
      const __m512 e = exp2_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, p + i), vc, vm));
      _mm512_mask_storeu_ps(p + i, k, e);
      s = _mm512_mask_add_ps(s, k, s, e);
    }
    return _mm512_reduce_add_ps(s);
  }
  static void col_max(float* mx, const float* S, int64_t ld, int64_t rows, int64_t cols) {
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 k = tail_mask(cols - j);
      __m512 m = _mm512_maskz_loadu_ps(k, S + j);
      for (int64_t i = 1; i < rows; ++i) m = _mm512_max_ps(m, _mm512_maskz_loadu_ps(k, S + i * ld + j));
      _mm512_mask_storeu_ps(mx + j, k, m);
    }
  }
  static void exp2_cols(float* S, int64_t ld, int64_t rows, int64_t cols, float c, const float* m, float* sum) {
    const __m512 vc = _mm512_set1_ps(c);
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 k = tail_mask(cols - j);
      const __m512 vm = _mm512_maskz_loadu_ps(k, m + j);
      __m512 s = _mm512_setzero_ps();
      for (int64_t i = 0; i < rows; ++i) {
        float* p = S + i * ld + j;
        const __m512 e = exp2_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, p), vc, vm));
        _mm512_mask_storeu_ps(p, k, e);
        s = _mm512_add_ps(s, e);
      }
      _mm512_mask_storeu_ps(sum + j, k, s);
    }
  }
  static void scale_row(float* p, int64_t n, float a) {
    const __m512 va = _mm512_set1_ps(a);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = tail_mask(n - i);
      _mm512_mask_storeu_ps(p + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + i), va));
    }
  }
  static void zero_row(float* p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) _mm512_mask_storeu_ps(p + i, tail_mask(n - i), _mm512_setzero_ps());
  }
  static float dot(const float* a, const float* b, int64_t n) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = tail_mask(n - i);
      s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), s);
    }
    return _mm512_reduce_add_ps(s);
  }
  static void ds_row(float* s, float* dp, int64_t n, float c, float lse2, float Dr, float scale) {
    const __m512 vc = _mm512_set1_ps(c), vl = _mm512_set1_ps(lse2), vd = _mm512_set1_ps(Dr),
                 vs = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = tail_mask(n - i);
      const __m512 p = exp2_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, s + i), vc, vl));
      _mm512_mask_storeu_ps(s + i, k, p);
      const __m512 g = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dp + i), vd);
      _mm512_mask_storeu_ps(dp + i, k, _mm512_mul_ps(_mm512_mul_ps(vs, p), g));
    }
  }
  static void pack_t(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) {
    const int64_t r16 = rows / 16 * 16, c16 = cols / 16 * 16;
    for (int64_t r = 0; r < r16; r += 16)
      for (int64_t c = 0; c < c16; c += 16) transpose16(dst + c * ldd + r, ldd, src + r * lds + c, lds);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = (r < r16 ? c16 : 0); c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
};

}  // namespace
