// attention_avx2.cpp: the AVX2 + FMA backend of the flash-attention algorithm in attention_impl.h, for CPUs
// without AVX-512: a register-blocked fp32 tile GEMM (6 rows x 16 columns = 12 ymm accumulators, A
// broadcast from memory, B loaded as 2 vectors, masked loads/stores only on an N tail), the vector exp2 of
// exp_avx2.h (same polynomial as the AVX-512 backend, about 1 ulp, exactly 0 below 2^-150), 8x8 register
// transposes for packing, and the row/column softmax pieces. Entry points forward/backward are called by
// attention.cpp when active_isa() is Avx2; everything else is file-local. Not a general GEMM.
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

#include "attention_impl.h"
#include "exp_avx2.h"

namespace {

// C[MR, 8*NV] (+)= op(A)[MR, K] B[K, 8*NV]; with TAIL the last of the NV vectors has only `rem` (< 8) columns.
// Each C element is the k-ascending FMA chain, then (+ C) once: the same sequence as the AVX-512 GEMM.
template <int MR, int NV, bool ACC, bool TA, bool TAIL>
void micro(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t rem) {
  const __m256i last = avx2_tail_mask(rem);
  __m256 c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) c[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 b[NV];
    const float* Bk = B + k * ldb;
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v)
      b[v] = TAIL && v == NV - 1 ? _mm256_maskload_ps(Bk + 8 * v, last) : _mm256_loadu_ps(Bk + 8 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(TA ? A + k * lda + r : A + r * lda + k);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) c[r][v] = _mm256_fmadd_ps(a, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      float* p = C + r * ldc + 8 * v;
      __m256 x = c[r][v];
      if (TAIL && v == NV - 1) {
        if (ACC) x = _mm256_add_ps(x, _mm256_maskload_ps(p, last));
        _mm256_maskstore_ps(p, last, x);
      } else {
        if (ACC) x = _mm256_add_ps(x, _mm256_loadu_ps(p));
        _mm256_storeu_ps(p, x);
      }
    }
}

constexpr int kMR = 6, kNV = 2;
using MicroFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);

template <bool ACC, bool TA, bool TAIL, int MR, int... NVs>
constexpr std::array<MicroFn, sizeof...(NVs)> row_of(std::integer_sequence<int, NVs...>) {
  return {&micro<MR, NVs + 1, ACC, TA, TAIL>...};
}
template <bool ACC, bool TA, bool TAIL, int... MRs>
constexpr std::array<std::array<MicroFn, kNV>, sizeof...(MRs)> table_of(std::integer_sequence<int, MRs...>) {
  return {row_of<ACC, TA, TAIL, MRs + 1>(std::make_integer_sequence<int, kNV>())...};
}
using Table = std::array<std::array<MicroFn, kNV>, kMR>;
template <bool ACC, bool TA, bool TAIL>
constexpr Table table() {
  return table_of<ACC, TA, TAIL>(std::make_integer_sequence<int, kMR>());
}
// kMicro[acc][ta][tail][mr-1][nv-1]
const Table kMicro[2][2][2] = {
    {{table<false, false, false>(), table<false, false, true>()},
     {table<false, true, false>(), table<false, true, true>()}},
    {{table<true, false, false>(), table<true, false, true>()},
     {table<true, true, false>(), table<true, true, true>()}}};

// dst[c*ldd + r] = src[r*lds + c] for a full 8 x 8 block.
inline void transpose8(float* dst, int64_t ldd, const float* src, int64_t lds) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // per 128-bit lane: a0 b0 a1 b1
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);  //                   a2 b2 a3 b3
  }
  // u[4g + c'] holds, in 128-bit lane L, column 4L + c' of rows 4g .. 4g+3.
  for (int g = 0; g < 2; ++g) {
    r[4 * g + 0] = _mm256_shuffle_ps(t[4 * g + 0], t[4 * g + 2], 0x44);
    r[4 * g + 1] = _mm256_shuffle_ps(t[4 * g + 0], t[4 * g + 2], 0xEE);
    r[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    r[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  for (int cp = 0; cp < 4; ++cp) {
    _mm256_storeu_ps(dst + cp * ldd, _mm256_permute2f128_ps(r[cp], r[4 + cp], 0x20));
    _mm256_storeu_ps(dst + (4 + cp) * ldd, _mm256_permute2f128_ps(r[cp], r[4 + cp], 0x31));
  }
}

struct Avx2Ops {
  static constexpr int64_t kRows = kMR;
  static void gemm(bool acc, bool trans_a, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                   const float* B, int64_t ldb, float* C, int64_t ldc) {
    for (int64_t n0 = 0; n0 < N; n0 += 8 * kNV) {
      const int64_t nn = std::min<int64_t>(8 * kNV, N - n0), nv = (nn + 7) / 8, rem = nn - 8 * (nv - 1);
      const Table& tab = kMicro[acc][trans_a][rem < 8];
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, M - m0);
        const float* Am = trans_a ? A + m0 : A + m0 * lda;
        tab[mr - 1][nv - 1](K, Am, lda, B + n0, ldb, C + m0 * ldc + n0, ldc, rem);
      }
    }
  }
  static float exp2_row(float* p, int64_t n, float c, float m) {
    const __m256 vc = _mm256_set1_ps(c), vm = _mm256_set1_ps(m);
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp2_ps(_mm256_fmsub_ps(_mm256_loadu_ps(p + i), vc, vm));
      _mm256_storeu_ps(p + i, e);
      s = _mm256_add_ps(s, e);
    }
    if (i < n) {
      const __m256i k = avx2_tail_mask(n - i);
      const __m256 e = exp2_ps(_mm256_fmsub_ps(_mm256_maskload_ps(p + i, k), vc, vm));
      _mm256_maskstore_ps(p + i, k, e);
      s = _mm256_add_ps(s, _mm256_and_ps(e, _mm256_castsi256_ps(k)));
    }
    return avx2_hsum(s);
  }
  static void col_max(float* mx, const float* S, int64_t ld, int64_t rows, int64_t cols) {
    for (int64_t j = 0; j < cols; j += 8) {
      const __m256i k = avx2_tail_mask(cols - j);
      __m256 m = _mm256_maskload_ps(S + j, k);
      for (int64_t i = 1; i < rows; ++i) m = _mm256_max_ps(m, _mm256_maskload_ps(S + i * ld + j, k));
      _mm256_maskstore_ps(mx + j, k, m);
    }
  }
  static void exp2_cols(float* S, int64_t ld, int64_t rows, int64_t cols, float c, const float* m, float* sum) {
    const __m256 vc = _mm256_set1_ps(c);
    int64_t j = 0;
    for (; j + 8 <= cols; j += 8) {  // full column groups: plain loads and stores
      const __m256 vm = _mm256_loadu_ps(m + j);
      __m256 s = _mm256_setzero_ps();
      for (int64_t i = 0; i < rows; ++i) {
        float* p = S + i * ld + j;
        const __m256 e = exp2_ps(_mm256_fmsub_ps(_mm256_loadu_ps(p), vc, vm));
        _mm256_storeu_ps(p, e);
        s = _mm256_add_ps(s, e);
      }
      _mm256_storeu_ps(sum + j, s);
    }
    if (j < cols) {
      const __m256i k = avx2_tail_mask(cols - j);
      const __m256 vm = _mm256_maskload_ps(m + j, k);
      __m256 s = _mm256_setzero_ps();
      for (int64_t i = 0; i < rows; ++i) {
        float* p = S + i * ld + j;
        const __m256 e = exp2_ps(_mm256_fmsub_ps(_mm256_maskload_ps(p, k), vc, vm));
        _mm256_maskstore_ps(p, k, e);
        s = _mm256_add_ps(s, e);
      }
      _mm256_maskstore_ps(sum + j, k, s);
    }
  }
  static void scale_row(float* p, int64_t n, float a) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), va));
    if (i < n) {
      const __m256i k = avx2_tail_mask(n - i);
      _mm256_maskstore_ps(p + i, k, _mm256_mul_ps(_mm256_maskload_ps(p + i, k), va));
    }
  }
  static void zero_row(float* p, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, _mm256_setzero_ps());
    if (i < n) _mm256_maskstore_ps(p + i, avx2_tail_mask(n - i), _mm256_setzero_ps());
  }
  static float dot(const float* a, const float* b, int64_t n) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    if (i < n) {
      const __m256i k = avx2_tail_mask(n - i);
      s = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, k), _mm256_maskload_ps(b + i, k), s);
    }
    return avx2_hsum(s);
  }
  static void ds_row(float* s, float* dp, int64_t n, float c, float lse2, float Dr, float scale) {
    const __m256 vc = _mm256_set1_ps(c), vl = _mm256_set1_ps(lse2), vd = _mm256_set1_ps(Dr),
                 vs = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 p = exp2_ps(_mm256_fmsub_ps(_mm256_loadu_ps(s + i), vc, vl));
      _mm256_storeu_ps(s + i, p);
      const __m256 g = _mm256_sub_ps(_mm256_loadu_ps(dp + i), vd);
      _mm256_storeu_ps(dp + i, _mm256_mul_ps(_mm256_mul_ps(vs, p), g));
    }
    if (i < n) {
      const __m256i k = avx2_tail_mask(n - i);
      const __m256 p = exp2_ps(_mm256_fmsub_ps(_mm256_maskload_ps(s + i, k), vc, vl));
      _mm256_maskstore_ps(s + i, k, p);
      const __m256 g = _mm256_sub_ps(_mm256_maskload_ps(dp + i, k), vd);
      _mm256_maskstore_ps(dp + i, k, _mm256_mul_ps(_mm256_mul_ps(vs, p), g));
    }
  }
  static void pack_t(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) {
    const int64_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
    for (int64_t r = 0; r < r8; r += 8)
      for (int64_t c = 0; c < c8; c += 8) transpose8(dst + c * ldd + r, ldd, src + r * lds + c, lds);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = (r < r8 ? c8 : 0); c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
};

}  // namespace

namespace moetron::attention_avx2 {

void forward(float* out, float* lse, const float* q, const float* k, const float* v, const AttnDims& d, float* ws,
             int nthreads) {
  flash_forward<Avx2Ops>(out, lse, q, k, v, d, ws, nthreads);
}

void backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse, const float* q,
              const float* k, const float* v, const AttnDims& d, float* ws, int nthreads) {
  flash_backward<Avx2Ops>(dq, dk, dv, dout, out, lse, q, k, v, d, ws, nthreads);
}

}  // namespace moetron::attention_avx2
