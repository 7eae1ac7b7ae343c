// attention_bf16_avx512.cpp: the bf16 flash attention (AttnPrec::BF16) on AVX512-BF16: the same tiling,
// causal tile skipping, online softmax, schedules and summation order as the fp32 algorithm of attention_impl.h,
// with the products on vdpbf16ps (bf16 operand pairs, fp32 accumulation), or on the AMX tiles where amx_active()
// (attention_amx.h, same operands, trimmed per 16 rows): forward S^T = K Q^T and O += P V;
// backward S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K. Softmax, lse, the running max and
// sums, D = rowsum(dO * O), the rescaling and the accumulators stay fp32 (Avx512Ops of attention_avx512_ops.h).
// Operands: each call first converts q, k, v (and dout) once into the workspace, per 64-row tile, in the layout
// its GEMM reads (bf16 rows: pairs along the head dim; row pairs: pairs along the tokens; or the 32-bit
// transpose of bf16 rows); P and dS are rounded per tile. Conversions round to nearest even and flush
// subnormals (vcvtne*ps2bf16). Entry points forward/backward are called by attention.cpp when
// attention_bf16_active(d). Not the fp32 kernels (attention_avx512.cpp) and not a general bf16 GEMM.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <cstring>

#include "attention_avx512_ops.h"
#include "kernels/attention_amx.h"
#include "kernels/mask_avx512.h"
#include "moetron/runtime.h"

namespace {

using u32 = uint32_t;  // one bf16 pair: the element at the lower index in the low half
constexpr int64_t kHalf = kTile / 2;

inline int64_t half_up(int64_t n) { return (n + 1) / 2; }

// Floats p[0, n) (n <= 32; missing ones are 0) as 16 bf16 pairs (p[2i], p[2i+1]).
inline __m512i cvt_row32(const float* p, int64_t n) {
  const __m512 lo = _mm512_maskz_loadu_ps(mask16(n), p), hi = _mm512_maskz_loadu_ps(mask16(n - 16), p + 16);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
// Pairs (a[i], b[i]) of two rows' 16 columns (only the `m` lanes loaded; b == nullptr: zeros).
inline __m512i cvt_pair16(const float* a, const float* b, __mmask16 m) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512 va = _mm512_maskz_loadu_ps(m, a), vb = b ? _mm512_maskz_loadu_ps(m, b) : _mm512_setzero_ps();
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(vb, va));
}

// sum_e bf16 row a (pairs) * x[e], e < n, in fp32 (16 lanes of FMAs, then the tree of _mm512_reduce_add_ps).
inline float dot_bf16_row(const u32* a, const float* x, int64_t n) {
  __m512 s = _mm512_setzero_ps();
  for (int64_t e = 0; e < n; e += 16) {
    const __mmask16 m = mask16(n - e);
    const __m256i h = _mm256_maskz_loadu_epi16(__mmask16(m), reinterpret_cast<const uint16_t*>(a) + e);
    const __m512 va = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    s = _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + e), s);
  }
  return _mm512_reduce_add_ps(s);
}

// Pairs (a[i], b[i]) of two rows' 16 values in registers.
inline __m512i pair_regs(__m512 a, __m512 b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// The forward's Avx512Ops::exp2_cols fused with the key-pair interleave of P: S^T[key, query] in (nk rows, mq
// columns), P = 2^(S c - m[query]) goes straight to Pp[p*kTile + query] = (P[2p], P[2p+1]) (a missing odd key 0)
// and sum[query] adds the fp32 P over keys ascending: the values and the order of exp2_cols + pair_rows.
void exp2_pairs(u32* Pp, const float* St, int64_t nk, int64_t mq, float c, const float* m, float* sum) {
  const __m512 vc = _mm512_set1_ps(c);
  for (int64_t j = 0; j < mq; j += 16) {
    const __mmask16 k = mask16(mq - j);
    const __m512 vm = _mm512_maskz_loadu_ps(k, m + j);
    __m512 s = _mm512_setzero_ps();
    for (int64_t p = 0; 2 * p < nk; ++p) {
      const __m512 ea = exp2_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, St + 2 * p * kTile + j), vc, vm));
      s = _mm512_add_ps(s, ea);
      __m512 eb = _mm512_setzero_ps();
      if (2 * p + 1 < nk) {
        eb = exp2_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, St + (2 * p + 1) * kTile + j), vc, vm));
        s = _mm512_add_ps(s, eb);
      }
      _mm512_mask_storeu_epi32(Pp + p * kTile + j, k, pair_regs(ea, eb));
    }
    _mm512_mask_storeu_ps(sum + j, k, s);
  }
}

// The backward's Avx512Ops::ds_row (P = 2^(S c - lse2), dS = scale P (dP - D), 0 past the causal diagonal) for
// two query rows at a time, written straight into the bf16 operands: Pp / dSp[p*kTile + key] = the rows' pairs
// (kv), dSb[row*kHalf + key pair] = each row's bf16 dS (q). S, dP: [mq, nk] fp32 (ld kTile), read only.
struct DsOut {
  u32 *Pp, *dSp, *dSb;
  bool kv, q;
};
void ds_pairs(const DsOut& o, const float* S, const float* dP, int64_t mq, int64_t nk, bool diag, float c,
              const float* lse2, const float* Dr, float scale) {
  const __m512 vc = _mm512_set1_ps(c), vs = _mm512_set1_ps(scale);
  const int64_t np = half_up(nk);
  for (int64_t p = 0; 2 * p < mq; ++p) {
    __m512 pr[2][2], ds[2][2];  // [row a / b][16-column half]
    for (int64_t c0 = 0; c0 < nk; c0 += 32) {
      for (int64_t i = 0; i < 2; ++i) {
        const int64_t r = 2 * p + i, nv = r >= mq ? 0 : diag ? std::min(nk, r + 1) : nk;
        const __m512 vl = _mm512_set1_ps(r < mq ? lse2[r] : 0.0f), vd = _mm512_set1_ps(r < mq ? Dr[r] : 0.0f);
        for (int64_t hh = 0; hh < 2; ++hh) {
          const int64_t cc = c0 + 16 * hh;
          const __mmask16 k = mask16(nv - cc);
          const __m512 e = exp2_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, S + r * kTile + cc), vc, vl));
          const __m512 g = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dP + r * kTile + cc), vd);
          pr[i][hh] = _mm512_maskz_mov_ps(k, e);
          ds[i][hh] = _mm512_maskz_mov_ps(k, _mm512_mul_ps(_mm512_mul_ps(vs, e), g));
        }
      }
      for (int64_t hh = 0; hh < 2 && o.kv; ++hh) {
        const int64_t cc = c0 + 16 * hh;
        const __mmask16 k = mask16(nk - cc);
        _mm512_mask_storeu_epi32(o.Pp + p * kTile + cc, k, pair_regs(pr[0][hh], pr[1][hh]));
        _mm512_mask_storeu_epi32(o.dSp + p * kTile + cc, k, pair_regs(ds[0][hh], ds[1][hh]));
      }
      for (int64_t i = 0; i < 2 && o.q; ++i)
        if (2 * p + i < mq)
          _mm512_mask_storeu_epi32(o.dSb + (2 * p + i) * kHalf + c0 / 2, mask16(np - c0 / 2),
                                   (__m512i)_mm512_cvtne2ps_pbh(ds[i][1], ds[i][0]));
    }
  }
}

// bf16 rows: dst[r*ldd + p] = (src[r][2p], src[r][2p+1]), r < rows, p < ceil(cols / 2) (a missing odd column 0).
void rows_bf16(u32* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) {
  const int64_t np = half_up(cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p0 = 0; p0 < np; p0 += 16)
      _mm512_mask_storeu_epi32(dst + r * ldd + p0, mask16(np - p0), cvt_row32(src + r * lds + 2 * p0, cols - 2 * p0));
}
// Row pairs: dst[p*ldd + c] = (src[2p][c], src[2p+1][c]), p < ceil(rows / 2) (a missing odd row 0), c < cols.
void pair_rows(u32* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) {
  for (int64_t p = 0; p < half_up(rows); ++p) {
    const float* a = src + 2 * p * lds;
    const float* b = 2 * p + 1 < rows ? a + lds : nullptr;
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const __mmask16 m = mask16(cols - c0);
      _mm512_mask_storeu_epi32(dst + p * ldd + c0, m, cvt_pair16(a + c0, b ? b + c0 : nullptr, m));
    }
  }
}
// The 32-bit transpose of bf16 rows: dst[p*kTile + r] = (src[r][2p], src[r][2p+1]), r < rows <= kTile,
// p < ceil(cols / 2); columns r >= rows of a 16-row block that holds rows are 0, the others unwritten.
void t_pairs(u32* dst, const float* src, int64_t lds, int64_t rows, int64_t cols) {
  const int64_t np = half_up(cols);
  alignas(64) u32 a[16][16], t[16][16];
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t p0 = 0; p0 < np; p0 += 16) {
      for (int64_t i = 0; i < 16; ++i)
        _mm512_store_si512(a[i], r0 + i < rows ? cvt_row32(src + (r0 + i) * lds + 2 * p0, cols - 2 * p0)
                                               : _mm512_setzero_si512());
      transpose16(reinterpret_cast<float*>(&t[0][0]), 16, reinterpret_cast<const float*>(&a[0][0]), 16);
      for (int64_t j = 0; j < 16 && p0 + j < np; ++j)
        _mm512_storeu_si512(dst + (p0 + j) * kTile + r0, _mm512_load_si512(t[j]));
    }
}

// C[MR, 16*NV] (+)= sum_p A2(r, p) B2(p, :), A2(r, p) = A[r*ars + p*aps], B2(p, n) = B[p*ldb + n]: bf16 pairs,
// fp32 accumulators (vdpbf16ps: the odd element's product added first, then the even one's); the last of the
// NV vectors is masked by `last`.
template <int MR, int NV, bool ACC>
void micro16(int64_t steps, const u32* A, int64_t ars, int64_t aps, const u32* B, int64_t ldb, float* C, int64_t ldc,
             __mmask16 last) {
  __m512 c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < steps; ++p) {
    __m512bh b[NV];
    const u32* Bp = B + p * ldb;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      b[v] = (__m512bh)(v == NV - 1 ? _mm512_maskz_loadu_epi32(last, Bp + 16 * v) : _mm512_loadu_si512(Bp + 16 * v));
    const u32* Ap = A + p * aps;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(Ap[r * ars]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, b[v]);
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

using Micro16Fn = void (*)(int64_t, const u32*, int64_t, int64_t, const u32*, int64_t, float*, int64_t, __mmask16);
template <bool ACC, int MR, int... NVs>
constexpr std::array<Micro16Fn, sizeof...(NVs)> row16_of(std::integer_sequence<int, NVs...>) {
  return {&micro16<MR, NVs + 1, ACC>...};
}
template <bool ACC, int... MRs>
constexpr std::array<std::array<Micro16Fn, kNV>, sizeof...(MRs)> table16_of(std::integer_sequence<int, MRs...>) {
  return {row16_of<ACC, MRs + 1>(std::make_integer_sequence<int, kNV>())...};
}
// kMicro16[acc][mr-1][nv-1]
const std::array<std::array<Micro16Fn, kNV>, kMR> kMicro16[2] = {
    table16_of<false>(std::make_integer_sequence<int, kMR>()), table16_of<true>(std::make_integer_sequence<int, kMR>())};

// C[M,N] (+)= op(A)[M,K] B[K,N] over K elements = ceil(K/2) pair steps. op(A)(m, pair p) = trans_a ?
// A[p*lda + m] : A[m*lda + p]; B[p*ldb + n]; lda, ldb in pairs. Operand pairs past K hold 0.
void gemm16(bool acc, bool trans_a, int64_t M, int64_t N, int64_t K, const u32* A, int64_t lda, const u32* B,
            int64_t ldb, float* C, int64_t ldc) {
  const int64_t steps = half_up(K), ars = trans_a ? 1 : lda, aps = trans_a ? lda : 1;
  for (int64_t n0 = 0; n0 < N; n0 += 16 * kNV) {
    const int64_t nn = std::min<int64_t>(16 * kNV, N - n0), nv = (nn + 15) / 16;
    const __mmask16 last = mask16(nn - 16 * (nv - 1));
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t mr = std::min<int64_t>(kMR, M - m0);
      kMicro16[acc][mr - 1][nv - 1](steps, A + m0 * ars, ars, aps, B + n0, ldb, C + m0 * ldc + n0, ldc, last);
    }
  }
}

// tri_gemm (attention_impl.h) for gemm16: the same trimming per kMR-row block. KFrom starts at k0 = m0, even
// (kMR is), so at a whole pair; KUpTo's K = m0 + mr may be odd: its last pair's second element is a masked 0.
// On AMX (amx_active() and the tile kernel built) every product goes to the tiles (attention_amx.h), which
// trim per 16 rows.
static_assert(kMR % 2 == 0, "KFrom needs pair-aligned row blocks");
static_assert(int(Tri::NUpTo) == moetron::attn_amx::kNUpTo && int(Tri::NFrom) == moetron::attn_amx::kNFrom &&
                  int(Tri::KUpTo) == moetron::attn_amx::kKUpTo && int(Tri::KFrom) == moetron::attn_amx::kKFrom &&
                  int(Tri::None) == moetron::attn_amx::kNone,
              "attention_amx.h numbers the trims as Tri does");
inline bool use_amx() { return moetron::attn_amx::built() && moetron::amx_active(); }
void tri16(Tri tri, bool acc, bool ta, int64_t M, int64_t N, int64_t K, const u32* A, int64_t lda, const u32* B,
           int64_t ldb, float* C, int64_t ldc) {
  if (use_amx())
    return moetron::attn_amx::gemm(int(tri), acc, ta, M, N, K, A, lda, B, ldb, C, ldc);
  if (tri == Tri::None) return gemm16(acc, ta, M, N, K, A, lda, B, ldb, C, ldc);
  for (int64_t m0 = 0; m0 < M; m0 += kMR) {
    const int64_t mr = std::min<int64_t>(kMR, M - m0);
    const u32* Am = ta ? A + m0 : A + m0 * lda;
    float* Cm = C + m0 * ldc;
    switch (tri) {
      case Tri::NUpTo: gemm16(acc, ta, mr, std::min(N, m0 + mr), K, Am, lda, B, ldb, Cm, ldc); break;
      case Tri::NFrom:
        if (m0 < N) gemm16(acc, ta, mr, N - m0, K, Am, lda, B + m0, ldb, Cm + m0, ldc);
        break;
      case Tri::KUpTo: gemm16(acc, ta, mr, N, std::min(K, m0 + mr), Am, lda, B, ldb, Cm, ldc); break;
      case Tri::KFrom: {
        const int64_t k0 = std::min(m0, K), p0 = k0 / 2;  // k0 odd only when K < m0: no steps are left
        gemm16(acc, ta, mr, N, K - k0, Am + (ta ? p0 * lda : p0), lda, B + p0 * ldb, ldb, Cm, ldc);
        break;
      }
      case Tri::None: break;
    }
  }
}

// Per-thread words: the sizing of kernel_sizes.h (at least the fp32 kernels' tiles, for the fallback).
inline int64_t thread_words(const moetron::AttnDims& d) {
  return std::max(moetron::attention_thread_floats(d.Dqk, d.Dv), moetron::attention_bf16_thread_words(d.Dqk, d.Dv));
}

// The call's converted operands in the shared workspace, tile by tile (kernel_sizes.h's attention_bf16_*).
struct Tiles16 {
  int64_t dh, dvh, nkt, nqt, ktiles, qtiles;
  u32* base;
  Tiles16(const moetron::AttnDims& d, u32* b)
      : dh(half_up(d.Dqk)), dvh(half_up(d.Dv)), nkt((d.keys() + kTile - 1) / kTile), nqt((d.T + kTile - 1) / kTile),
        ktiles(d.B * d.Hkv * nkt), qtiles(d.B * d.Hq * nqt), base(b) {}
  int64_t kidx(const moetron::AttnDims& d, int64_t b, int64_t hk, int64_t kt) const { return (b * d.Hkv + hk) * nkt + kt; }
  int64_t qidx(const moetron::AttnDims& d, int64_t b, int64_t h, int64_t qt) const { return (b * d.Hq + h) * nqt + qt; }
};

// Forward: flash_forward's items, order and online softmax; S^T = K_j Q_i^T from bf16 k rows (A) and the
// item's Q^T pairs (B); O += P V from P's key pairs (A, transposed) and v row pairs (B).
void forward16(float* out, float* lse, const float* q, const float* k, const float* v, const moetron::AttnDims& d,
               float* ws, int nthreads) {
  const int64_t G = d.Hq / d.Hkv, nqt = (d.T + kTile - 1) / kTile, items = d.B * d.Hq * nqt;
  const int64_t Tk = d.keys(), nkt = (Tk + kTile - 1) / kTile;
  const bool causal = d.causal();
  const float c = d.scale * kLog2e;
  const int64_t per = thread_words(d), dh16 = round16(half_up(d.Dqk));
  const Tiles16 tl(d, reinterpret_cast<u32*>(ws + per * nthreads));
  u32* Kb = tl.base;                                 // [ktiles][kTile][dh]     k rows
  u32* Vp = Kb + tl.ktiles * kTile * tl.dh;          // [ktiles][kHalf][Dv]     v row pairs
#pragma omp parallel num_threads(nthreads)
  {
    const moetron::attn_amx::Session amx_session(use_amx());  // the tiles configured once per thread
    u32* Qt = reinterpret_cast<u32*>(ws + per * omp_get_thread_num());  // [dh16][kTile] q^T pairs
    float* St = reinterpret_cast<float*>(Qt + dh16 * kTile);            // [kTile keys][kTile queries]
    u32* Pp = reinterpret_cast<u32*>(St + kTile * kTile);               // [kHalf][kTile] P key pairs
    alignas(64) float m[kTile], l[kTile], mx[kTile], alpha[kTile], sum[kTile];
#pragma omp for schedule(static)
    for (int64_t it = 0; it < tl.ktiles; ++it) {
      const int64_t kt = it % nkt, bh = it / nkt, b = bh / d.Hkv, hk = bh % d.Hkv, j0 = kt * kTile;
      const int64_t nk = std::min(kTile, Tk - j0);
      rows_bf16(Kb + it * kTile * tl.dh, tl.dh, k + (b * Tk + j0) * d.ldk + hk * d.head_k, d.ldk, nk, d.Dqk);
      pair_rows(Vp + it * kHalf * d.Dv, d.Dv, v + (b * Tk + j0) * d.ldv + hk * d.head_v, d.ldv, nk, d.Dv);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t qt = nqt - 1 - it / (d.B * d.Hq), bh = it % (d.B * d.Hq), b = bh / d.Hq, h = bh % d.Hq;
      const int64_t hk = h / G, i0 = qt * kTile, mq = std::min(kTile, d.T - i0);
      float* O = out + (b * d.T + i0) * d.ldo + h * d.head_o;
      t_pairs(Qt, q + (b * d.T + i0) * d.ldq + h * d.head_q, d.ldq, mq, d.Dqk);
      for (int64_t r = 0; r < mq; ++r) m[r] = -INFINITY, l[r] = 0.0f;
      const int64_t kt_end = causal ? qt + 1 : nkt;
      for (int64_t kt = 0; kt < kt_end; ++kt) {
        const int64_t j0 = kt * kTile, nk = std::min(kTile, Tk - j0), ti = tl.kidx(d, b, hk, kt);
        const bool diag = causal && kt == qt;
        tri16(diag ? Tri::NFrom : Tri::None, false, false, nk, mq, d.Dqk, Kb + ti * kTile * tl.dh, tl.dh, Qt, kTile,
              St, kTile);
        if (diag)
          for (int64_t jj = 1; jj < nk; ++jj)
            for (int64_t r = 0; r < std::min(jj, mq); ++r) St[jj * kTile + r] = -INFINITY;
        Avx512Ops::col_max(mx, St, kTile, nk, mq);
        for (int64_t r = 0; r < mq; ++r) {
          const float mnew = std::max(m[r], mx[r] * c);
          alpha[r] = m[r] - mnew;
          m[r] = mnew;
        }
        Avx512Ops::exp2_row(alpha, mq, 1.0f, 0.0f);
        exp2_pairs(Pp, St, nk, mq, c, m, sum);  // l sums the fp32 P; P V takes P rounded to bf16
        for (int64_t r = 0; r < mq; ++r) {
          l[r] = l[r] * alpha[r] + sum[r];
          if (kt > 0 && alpha[r] != 1.0f) Avx512Ops::scale_row(O + r * d.ldo, d.Dv, alpha[r]);
        }
        tri16(diag ? Tri::KUpTo : Tri::None, kt > 0, true, mq, d.Dv, nk, Pp, kTile, Vp + ti * kHalf * d.Dv, d.Dv, O,
              d.ldo);
      }
      float* L = lse + (b * d.Hq + h) * d.T + i0;
      for (int64_t r = 0; r < mq; ++r) {
        Avx512Ops::scale_row(O + r * d.ldo, d.Dv, 1.0f / l[r]);
        L[r] = (m[r] + std::log2(l[r])) * kLn2;
      }
    }
  }
}

// Backward scratch of one thread and the call's converted operands of one (key tile, query tile) pair.
struct Bwd16 {
  float *dKa, *dVa, *S, *dP, *lse2, *Dr;
  u32 *Pp, *dSp, *dSb;
};
struct Ops16 {
  const u32 *Kt, *Kp, *Vt, *Qb, *Qp, *dOb, *dOp;
};

// flash_backward's bwd_pair on bf16 operands: S = Q_i K_j^T, dP = dO_i V_j^T (fp32 out), P and dS in fp32 as
// the fp32 kernel computes them, then rounded: dV_j += P^T dO_i, dK_j += dS^T Q_i, dQ_i += dS K_j.
void bwd_pair16(const Bwd16& w, const Ops16& o, bool first, bool do_kv, bool do_q, int64_t b, int64_t h, int64_t kt,
                int64_t qt, float* dq, const float* out, const float* lse,
                const moetron::AttnDims& d) {
  const int64_t Dq16 = round16(d.Dqk), Dv16 = round16(d.Dv), Tk = d.keys();
  const int64_t j0 = kt * kTile, nk = std::min(kTile, Tk - j0), i0 = qt * kTile, mq = std::min(kTile, d.T - i0);
  const int64_t dh = half_up(d.Dqk), dvh = half_up(d.Dv);
  const float c = d.scale * kLog2e;
  const float* O = out + (b * d.T + i0) * d.ldo + h * d.head_o;
  const float* L = lse + (b * d.Hq + h) * d.T + i0;
  // D_t = rowsum(bf16(dO) * O): dP is formed from bf16(dO) too, so dS = P (dP - D) keeps sum_s dS_ts = 0.
  for (int64_t r = 0; r < mq; ++r) {
    w.lse2[r] = L[r] * kLog2e;
    w.Dr[r] = dot_bf16_row(o.dOb + r * dvh, O + r * d.ldo, d.Dv);
  }
  const bool diag = d.causal() && qt == kt;
  const Tri up = diag ? Tri::NUpTo : Tri::None, kup = diag ? Tri::KUpTo : Tri::None,
            kfrom = diag ? Tri::KFrom : Tri::None;
  tri16(up, false, false, mq, nk, d.Dqk, o.Qb, dh, o.Kt, kTile, w.S, kTile);
  tri16(up, false, false, mq, nk, d.Dv, o.dOb, dvh, o.Vt, kTile, w.dP, kTile);
  ds_pairs(DsOut{w.Pp, w.dSp, w.dSb, do_kv, do_q}, w.S, w.dP, mq, nk, diag, c, w.lse2, w.Dr, d.scale);
  if (do_kv) {
    tri16(kfrom, !first, true, nk, d.Dv, mq, w.Pp, kTile, o.dOp, d.Dv, w.dVa, Dv16);
    tri16(kfrom, !first, true, nk, d.Dqk, mq, w.dSp, kTile, o.Qp, d.Dqk, w.dKa, Dq16);
  }
  if (do_q) {
    float* dQ = dq + (b * d.T + i0) * d.ldq + h * d.head_q;
    tri16(kup, true, false, mq, d.Dqk, nk, w.dSb, kHalf, o.Kp, d.Dqk, dQ, d.ldq);
  }
}

// Backward: flash_backward's two schedules and summation order (so its results are thread-count independent
// too), on operands converted once per call: per key tile k^T pairs, k row pairs and v^T pairs, per query
// tile q rows, q row pairs, dout rows and dout row pairs.
void backward16(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                const float* q, const float* k, const float* v, const moetron::AttnDims& d, float* ws, int nthreads) {
  const int64_t G = d.Hq / d.Hkv, nqt = (d.T + kTile - 1) / kTile;
  const int64_t Tk = d.keys(), nkt = (Tk + kTile - 1) / kTile;
  const bool causal = d.causal();
  const int64_t Dq16 = round16(d.Dqk), Dv16 = round16(d.Dv);
  const int64_t per = thread_words(d);
  const bool ak = alias_k(d), av = alias_v(d);
  const bool two_pass = nthreads > 1 && d.B * d.Hkv < 2 * nthreads;
  const Tiles16 tl(d, reinterpret_cast<u32*>(ws + per * nthreads));
  const int64_t kt_sz = tl.dh * kTile, kp_sz = kHalf * d.Dqk, vt_sz = tl.dvh * kTile;
  const int64_t qb_sz = kTile * tl.dh, qp_sz = kHalf * d.Dqk, ob_sz = kTile * tl.dvh, op_sz = kHalf * d.Dv;
  u32* Kt = tl.base;                      // [ktiles][dh][kTile]   k^T pairs
  u32* Kp = Kt + tl.ktiles * kt_sz;       // [ktiles][kHalf][Dqk]  k row pairs
  u32* Vt = Kp + tl.ktiles * kp_sz;       // [ktiles][dvh][kTile]  v^T pairs
  u32* Qb = Vt + tl.ktiles * vt_sz;       // [qtiles][kTile][dh]   q rows
  u32* Qp = Qb + tl.qtiles * qb_sz;       // [qtiles][kHalf][Dqk]  q row pairs
  u32* Ob = Qp + tl.qtiles * qp_sz;       // [qtiles][kTile][dvh]  dout rows
  u32* Op = Ob + tl.qtiles * ob_sz;       // [qtiles][kHalf][Dv]   dout row pairs
  float* part_k = ws + per * nthreads + moetron::attention_bf16_shared_words(ws_shape(d));  // [B, Hkv, Tk, Dq16]
  float* part_v = part_k + (ak ? d.B * d.Hkv * Tk * Dq16 : 0);                            // [B, Hkv, Tk, Dv16]
  auto ops = [&](int64_t b, int64_t h, int64_t kt, int64_t qt) {
    const int64_t ki = tl.kidx(d, b, h / G, kt), qi = tl.qidx(d, b, h, qt);
    return Ops16{Kt + ki * kt_sz, Kp + ki * kp_sz, Vt + ki * vt_sz, Qb + qi * qb_sz,
                 Qp + qi * qp_sz, Ob + qi * ob_sz, Op + qi * op_sz};
  };
#pragma omp parallel num_threads(nthreads)
  {
    const moetron::attn_amx::Session amx_session(use_amx());  // the tiles configured once per thread
    Bwd16 w;
    w.dKa = ws + per * omp_get_thread_num();              // [kTile, Dq16]
    w.dVa = w.dKa + kTile * Dq16;                         // [kTile, Dv16]
    w.S = w.dVa + kTile * Dv16;                           // [kTile, kTile]  scores, then P
    w.dP = w.S + kTile * kTile;                           // [kTile, kTile]  dP, then dS
    w.Pp = reinterpret_cast<u32*>(w.dP + kTile * kTile);  // [kHalf, kTile]  P query pairs
    w.dSp = w.Pp + kHalf * kTile;                         // [kHalf, kTile]  dS query pairs
    w.dSb = w.dSp + kHalf * kTile;                        // [kTile, kHalf]  dS rows
    w.lse2 = reinterpret_cast<float*>(w.dSb + kTile * kHalf);
    w.Dr = w.lse2 + kTile;
#pragma omp for schedule(static) nowait
    for (int64_t it = 0; it < tl.ktiles; ++it) {
      const int64_t kt = it % nkt, bh = it / nkt, b = bh / d.Hkv, hk = bh % d.Hkv, j0 = kt * kTile;
      const int64_t nk = std::min(kTile, Tk - j0);
      const float* K = k + (b * Tk + j0) * d.ldk + hk * d.head_k;
      t_pairs(Kt + it * kt_sz, K, d.ldk, nk, d.Dqk);
      pair_rows(Kp + it * kp_sz, d.Dqk, K, d.ldk, nk, d.Dqk);
      t_pairs(Vt + it * vt_sz, v + (b * Tk + j0) * d.ldv + hk * d.head_v, d.ldv, nk, d.Dv);
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < tl.qtiles; ++it) {
      const int64_t qt = it % nqt, bh = it / nqt, b = bh / d.Hq, h = bh % d.Hq, i0 = qt * kTile;
      const int64_t mq = std::min(kTile, d.T - i0);
      const float* Q = q + (b * d.T + i0) * d.ldq + h * d.head_q;
      const float* dO = dout + (b * d.T + i0) * d.ldo + h * d.head_o;
      rows_bf16(Qb + it * qb_sz, tl.dh, Q, d.ldq, mq, d.Dqk);
      pair_rows(Qp + it * qp_sz, d.Dqk, Q, d.ldq, mq, d.Dqk);
      rows_bf16(Ob + it * ob_sz, tl.dvh, dO, d.ldo, mq, d.Dv);
      pair_rows(Op + it * op_sz, d.Dv, dO, d.ldo, mq, d.Dv);
    }
    auto kv_tile = [&](int64_t b, int64_t hk, int64_t kt, bool with_q) {
      const int64_t j0 = kt * kTile, nk = std::min(kTile, Tk - j0);
      bool first = true;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t qt = causal ? kt : 0; qt < nqt; ++qt, first = false)
          bwd_pair16(w, ops(b, hk * G + g, kt, qt), first, true, with_q, b, hk * G + g, kt, qt, dq, out, lse, d);
      const int64_t it = b * d.Hkv + hk;
      for (int64_t r = 0; r < nk; ++r) {
        float* dkr = ak ? part_k + ((it * Tk) + j0 + r) * Dq16 : dk + (b * Tk + j0 + r) * d.ldk + hk * d.head_k;
        float* dvr = av ? part_v + ((it * Tk) + j0 + r) * Dv16 : dv + (b * Tk + j0 + r) * d.ldv + hk * d.head_v;
        std::copy(w.dKa + r * Dq16, w.dKa + r * Dq16 + d.Dqk, dkr);
        std::copy(w.dVa + r * Dv16, w.dVa + r * Dv16 + d.Dv, dvr);
      }
    };
    if (!two_pass) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < d.B * d.Hkv; ++it) {
        const int64_t b = it / d.Hkv, hk = it % d.Hkv;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t t = 0; t < d.T; ++t)
            Avx512Ops::zero_row(dq + (b * d.T + t) * d.ldq + (hk * G + g) * d.head_q, d.Dqk);
        for (int64_t kt = 0; kt < nkt; ++kt) kv_tile(b, hk, kt, true);
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < d.B * d.Hkv * nkt; ++it) {
        const int64_t kt = it / (d.B * d.Hkv), bh = it % (d.B * d.Hkv);
        kv_tile(bh / d.Hkv, bh % d.Hkv, kt, false);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < d.B * d.Hq * nqt; ++it) {
        const int64_t qt = nqt - 1 - it / (d.B * d.Hq), bh = it % (d.B * d.Hq), b = bh / d.Hq, h = bh % d.Hq;
        const int64_t i0 = qt * kTile, mq = std::min(kTile, d.T - i0);
        for (int64_t r = 0; r < mq; ++r) Avx512Ops::zero_row(dq + (b * d.T + i0 + r) * d.ldq + h * d.head_q, d.Dqk);
        for (int64_t kt = 0; kt < (causal ? qt + 1 : nkt); ++kt)
          bwd_pair16(w, ops(b, h, kt, qt), true, false, true, b, h, kt, qt, dq, out, lse, d);
      }
    }
    if (ak || av) {
#pragma omp for schedule(static)
      for (int64_t bt = 0; bt < d.B * Tk; ++bt) {
        const int64_t b = bt / Tk, t = bt % Tk;
        if (ak) sum_kv_partials(dk + bt * d.ldk, part_k, b, t, d.Hkv, Tk, Dq16, d.Dqk);
        if (av) sum_kv_partials(dv + bt * d.ldv, part_v, b, t, d.Hkv, Tk, Dv16, d.Dv);
      }
    }
  }
}

}  // namespace

namespace moetron::attention_bf16_avx512 {

void forward(float* out, float* lse, const float* q, const float* k, const float* v, const AttnDims& d, float* ws,
             int nthreads) {
  forward16(out, lse, q, k, v, d, ws, nthreads);
}

void backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse, const float* q,
              const float* k, const float* v, const AttnDims& d, float* ws, int nthreads) {
  backward16(dq, dk, dv, dout, out, lse, q, k, v, d, ws, nthreads);
}

}  // namespace moetron::attention_bf16_avx512
