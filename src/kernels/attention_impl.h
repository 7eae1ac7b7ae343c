// attention_impl.h: the flash-attention algorithm (tiling, causal tile skipping, online softmax, the
// recomputing backward), written once as templates over an `Ops` backend that supplies the tile GEMM
// and the row-wise vector pieces. Included by attention.cpp (portable Ops) and attention_avx512.cpp
// (AVX-512 Ops); everything here is in an anonymous namespace, so each ISA's translation unit gets its
// own copy compiled with its own flags. Not a public header.
//
// Ops must provide (all static):
//   static constexpr int64_t kRows;   rows per register block of its GEMM (the causal trimming granularity)
//   void gemm(bool acc, bool trans_a, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
//             const float* B, int64_t ldb, float* C, int64_t ldc);
//        C[M,N] (+)= op(A)[M,K] B[K,N], row-major; op(A)(m,k) = trans_a ? A[k*lda + m] : A[m*lda + k]
//   float exp2_row(float* p, int64_t n, float c, float m);   p = 2^(p*c - m), returns the sum
//   void  col_max(float* mx, const float* S, int64_t ld, int64_t rows, int64_t cols);   mx[c] = max_r S[r, c]
//   void  exp2_cols(float* S, int64_t ld, int64_t rows, int64_t cols, float c, const float* m, float* sum);
//         S[r, c] = 2^(S[r, c]*c - m[c]),  sum[c] = sum_r S[r, c] (r ascending)
//   void  scale_row(float* p, int64_t n, float a);
//   void  zero_row(float* p, int64_t n);
//   float dot(const float* a, const float* b, int64_t n);
//   void  ds_row(float* s, float* dp, int64_t n, float c, float lse2, float Dr, float scale);
//         s: scores in, P = 2^(s*c - lse2) out;  dp: dP in, dS = scale * P * (dP - Dr) out
//   void  pack_t(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols);
//         dst[c*ld_dst + r] = src[r*ld_src + c]  (r < rows, c < cols)
#pragma once
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "moetron/attention.h"
#include "moetron/kernel_sizes.h"

namespace {

// Query rows and key columns per tile (equal, so diagonal tiles align); kernel_sizes.h holds the value.
constexpr int64_t kTile = moetron::kAttnTile;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// Aliased k (v) head under GQA: the gradient row of key t of sequence b is the sum of the per-kv-head partials
// part[(b, h, t)] (rows of `stride` floats, n used) in kv-head order h = 0 .. Hkv-1. Both precisions' backwards.
inline void sum_kv_partials(float* dst, const float* part, int64_t b, int64_t t, int64_t Hkv, int64_t Tk,
                            int64_t stride, int64_t n) {
  const float* first = part + ((b * Hkv) * Tk + t) * stride;
  std::copy(first, first + n, dst);
  for (int64_t h = 1; h < Hkv; ++h) {
    const float* src = part + ((b * Hkv + h) * Tk + t) * stride;
    for (int64_t e = 0; e < n; ++e) dst[e] += src[e];
  }
}

// Workspace sizes: one definition for the kernels and the accounting (kernel_sizes.h). The forward carves
// [round16(Dqk), kTile] + [kTile, kTile] per thread, the backward the tiles listed in flash_backward.
inline moetron::AttnWorkspaceShape ws_shape(const moetron::AttnDims& d) {
  moetron::AttnWorkspaceShape s;
  s.B = d.B, s.T = d.keys(), s.Hkv = d.Hkv, s.Dqk = d.Dqk, s.Dv = d.Dv;
  s.shared_k = d.head_k == 0, s.shared_v = d.head_v == 0;
  s.bf16 = d.prec == moetron::AttnPrec::BF16, s.Tq = d.T, s.Hq = d.Hq;
  return s;
}
// Per-thread scratch, in floats.
inline int64_t thread_floats(const moetron::AttnDims& d) { return moetron::attention_thread_floats(d.Dqk, d.Dv); }
inline bool alias_k(const moetron::AttnDims& d) { return d.head_k == 0 && d.Hkv > 1; }
inline bool alias_v(const moetron::AttnDims& d) { return d.head_v == 0 && d.Hkv > 1; }
// Shared scratch: per-kv-head partial gradients when several kv heads alias one k (or v) head.
inline int64_t shared_floats(const moetron::AttnDims& d) { return moetron::attention_shared_floats(ws_shape(d)); }

// The GEMMs of a diagonal tile (i0 == j0) only need part of the work: row block [m0, m0 + kRows) of
// op(A) or C is cut where the causal mask makes the rest zero or unused (uncomputed C entries are
// masked or never read by the caller).
enum class Tri {
  None,    // full GEMM
  NUpTo,   // C(m, n) needed for n <= m only
  NFrom,   // C(m, n) needed for n >= m only
  KUpTo,   // op(A)(m, k) = 0 for k > m
  KFrom,   // op(A)(m, k) = 0 for k < m
};
template <class Ops>
void tri_gemm(Tri tri, bool acc, bool ta, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
              const float* B, int64_t ldb, float* C, int64_t ldc) {
  if (tri == Tri::None) return Ops::gemm(acc, ta, M, N, K, A, lda, B, ldb, C, ldc);
  for (int64_t m0 = 0; m0 < M; m0 += Ops::kRows) {
    const int64_t mr = std::min<int64_t>(Ops::kRows, M - m0);
    const float* Am = ta ? A + m0 : A + m0 * lda;
    float* Cm = C + m0 * ldc;
    switch (tri) {
      case Tri::NUpTo: Ops::gemm(acc, ta, mr, std::min(N, m0 + mr), K, Am, lda, B, ldb, Cm, ldc); break;
      case Tri::NFrom:
        if (m0 < N) Ops::gemm(acc, ta, mr, N - m0, K, Am, lda, B + m0, ldb, Cm + m0, ldc);
        break;
      case Tri::KUpTo: Ops::gemm(acc, ta, mr, N, std::min(K, m0 + mr), Am, lda, B, ldb, Cm, ldc); break;
      case Tri::KFrom: {
        const int64_t k0 = std::min(m0, K);
        Ops::gemm(acc, ta, mr, N, K - k0, Am + (ta ? k0 * lda : k0), lda, B + k0 * ldb, ldb, Cm, ldc);
        break;
      }
      case Tri::None: break;
    }
  }
}

// Forward. Work item = (b, q head, q tile), heaviest (last) tiles first, dynamic schedule: each item's
// arithmetic does not depend on which thread runs it, so the result is thread-count independent.
// Scores are computed transposed, S^T = K_j Q_i^T [keys, queries], so that Q_i is packed once per item
// (K_j rows are read in place) and the online softmax runs down the columns, vectorized over queries.
// The output rows of the item serve as the O accumulator. Full mask: every key tile, none diagonal.
template <class Ops>
void flash_forward(float* out, float* lse, const float* q, const float* k, const float* v, const moetron::AttnDims& d,
                   float* ws, int nthreads) {
  const int64_t G = d.Hq / d.Hkv, nqt = (d.T + kTile - 1) / kTile, items = d.B * d.Hq * nqt;
  const int64_t Tk = d.keys(), nkt = (Tk + kTile - 1) / kTile;
  const bool causal = d.causal();
  const float c = d.scale * kLog2e;
  const int64_t per_thread = thread_floats(d);
#pragma omp parallel num_threads(nthreads)
  {
    float* Qt = ws + per_thread * omp_get_thread_num();  // [Dqk, kTile]
    float* St = Qt + round16(d.Dqk) * kTile;             // [kTile keys, kTile queries]
    alignas(64) float m[kTile], l[kTile], mx[kTile], alpha[kTile], sum[kTile];
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t qt = nqt - 1 - it / (d.B * d.Hq), bh = it % (d.B * d.Hq), b = bh / d.Hq, h = bh % d.Hq;
      const int64_t hk = h / G, i0 = qt * kTile, mq = std::min(kTile, d.T - i0);
      float* O = out + (b * d.T + i0) * d.ldo + h * d.head_o;
      Ops::pack_t(Qt, kTile, q + (b * d.T + i0) * d.ldq + h * d.head_q, d.ldq, mq, d.Dqk);
      for (int64_t r = 0; r < mq; ++r) m[r] = -INFINITY, l[r] = 0.0f;
      const int64_t kt_end = causal ? qt + 1 : nkt;
      for (int64_t kt = 0; kt < kt_end; ++kt) {
        const int64_t j0 = kt * kTile, nk = std::min(kTile, Tk - j0);
        const float* Kj = k + (b * Tk + j0) * d.ldk + hk * d.head_k;
        const float* Vj = v + (b * Tk + j0) * d.ldv + hk * d.head_v;
        const bool diag = causal && kt == qt;
        tri_gemm<Ops>(diag ? Tri::NFrom : Tri::None, false, false, nk, mq, d.Dqk, Kj, d.ldk, Qt, kTile, St, kTile);
        if (diag)  // diagonal tile (i0 == j0): key jj is visible to query r only if jj <= r
          for (int64_t jj = 1; jj < nk; ++jj)
            for (int64_t r = 0; r < std::min(jj, mq); ++r) St[jj * kTile + r] = -INFINITY;
        Ops::col_max(mx, St, kTile, nk, mq);
        for (int64_t r = 0; r < mq; ++r) {
          const float mnew = std::max(m[r], mx[r] * c);
          alpha[r] = m[r] - mnew;  // exponentiated below; 2^-inf = 0 on the first tile
          m[r] = mnew;
        }
        Ops::exp2_row(alpha, mq, 1.0f, 0.0f);
        Ops::exp2_cols(St, kTile, nk, mq, c, m, sum);
        for (int64_t r = 0; r < mq; ++r) {
          l[r] = l[r] * alpha[r] + sum[r];
          if (kt > 0 && alpha[r] != 1.0f) Ops::scale_row(O + r * d.ldo, d.Dv, alpha[r]);
        }
        tri_gemm<Ops>(diag ? Tri::KUpTo : Tri::None, kt > 0, true, mq, d.Dv, nk, St, kTile, Vj, d.ldv, O, d.ldo);
      }
      float* L = lse + (b * d.Hq + h) * d.T + i0;
      for (int64_t r = 0; r < mq; ++r) {
        Ops::scale_row(O + r * d.ldo, d.Dv, 1.0f / l[r]);
        L[r] = (m[r] + std::log2(l[r])) * kLn2;
      }
    }
  }
}

// Backward. One (key tile j, q head h, q tile i >= j) pair: recompute P from lse, then dV_j += P^T dO_i,
// dP = dO_i V_j^T, dS = scale P (dP - D_i), dK_j += dS^T Q_i (into the tile accumulators dKa/dVa), and
// dQ_i += dS K_j (into dq). K_j^T and V_j^T must be packed in Kt/Vt.
struct BwdScratch {
  float *Kt, *Vt, *dKa, *dVa, *S, *dP, *lse2, *Dr;
};
template <class Ops>
void bwd_pair(const BwdScratch& w, bool first, bool do_kv, bool do_q, int64_t b, int64_t h, int64_t kt, int64_t qt,
              float* dq, const float* dout, const float* out, const float* lse, const float* q, const float* k,
              const moetron::AttnDims& d) {
  const int64_t Dq16 = round16(d.Dqk), Dv16 = round16(d.Dv), hk = h / (d.Hq / d.Hkv), Tk = d.keys();
  const int64_t j0 = kt * kTile, nk = std::min(kTile, Tk - j0), i0 = qt * kTile, mq = std::min(kTile, d.T - i0);
  const float c = d.scale * kLog2e;
  const float* Q = q + (b * d.T + i0) * d.ldq + h * d.head_q;
  const float* dO = dout + (b * d.T + i0) * d.ldo + h * d.head_o;
  const float* O = out + (b * d.T + i0) * d.ldo + h * d.head_o;
  const float* L = lse + (b * d.Hq + h) * d.T + i0;
  for (int64_t r = 0; r < mq; ++r) {
    w.lse2[r] = L[r] * kLog2e;
    w.Dr[r] = Ops::dot(dO + r * d.ldo, O + r * d.ldo, d.Dv);
  }
  const bool diag = d.causal() && qt == kt;
  const Tri up = diag ? Tri::NUpTo : Tri::None, kup = diag ? Tri::KUpTo : Tri::None,
            kfrom = diag ? Tri::KFrom : Tri::None;
  tri_gemm<Ops>(up, false, false, mq, nk, d.Dqk, Q, d.ldq, w.Kt, kTile, w.S, kTile);
  tri_gemm<Ops>(up, false, false, mq, nk, d.Dv, dO, d.ldo, w.Vt, kTile, w.dP, kTile);
  for (int64_t r = 0; r < mq; ++r) {
    const int64_t nv = diag ? std::min(nk, r + 1) : nk;
    Ops::ds_row(w.S + r * kTile, w.dP + r * kTile, nv, c, w.lse2[r], w.Dr[r], d.scale);
    if (nv < nk) {
      Ops::zero_row(w.S + r * kTile + nv, nk - nv);
      Ops::zero_row(w.dP + r * kTile + nv, nk - nv);
    }
  }
  if (do_kv) {
    tri_gemm<Ops>(kfrom, !first, true, nk, d.Dv, mq, w.S, kTile, dO, d.ldo, w.dVa, Dv16);
    tri_gemm<Ops>(kfrom, !first, true, nk, d.Dqk, mq, w.dP, kTile, Q, d.ldq, w.dKa, Dq16);
  }
  if (do_q) {
    const float* Kj = k + (b * Tk + j0) * d.ldk + hk * d.head_k;
    float* dQ = dq + (b * d.T + i0) * d.ldq + h * d.head_q;
    tri_gemm<Ops>(kup, true, false, mq, d.Dqk, nk, w.dP, kTile, Kj, d.ldk, dQ, d.ldq);
  }
}

// Backward driver. Every element's arithmetic is one fixed sequence: dK_j, dV_j sum over (q head of the
// group, q tile i >= j) in that order; dQ_i sums over key tiles j <= i ascending. Two schedules perform
// exactly that sequence, so they give bitwise equal results:
//  - one pass: work item = (b, kv head), owning dk/dv of its head and dq of its group's q heads;
//  - two passes, when there are fewer (b, kv head) items than 2 x threads: first items (b, kv head, key
//    tile) for dK/dV, then items (b, q head, q tile) for dQ (recomputing P and dS: 3 more GEMMs per pair
//    out of 5, for up to B*Hq*T/64 parallel items instead of B*Hkv).
// Nothing is shared between threads, so there are no atomics. Full mask: key tile j pairs with every q tile
// (i from 0), q tile i with every key tile; no pair is diagonal. The caller handles T == 0.
template <class Ops>
void flash_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                    const float* q, const float* k, const float* v, const moetron::AttnDims& d, float* ws,
                    int nthreads) {
  const int64_t G = d.Hq / d.Hkv, nqt = (d.T + kTile - 1) / kTile;
  const int64_t Tk = d.keys(), nkt = (Tk + kTile - 1) / kTile;
  const bool causal = d.causal();
  const int64_t Dq16 = round16(d.Dqk), Dv16 = round16(d.Dv);
  const int64_t per_thread = thread_floats(d);
  const bool ak = alias_k(d), av = alias_v(d);
  const bool two_pass = nthreads > 1 && d.B * d.Hkv < 2 * nthreads;
  float* part_k = ws + per_thread * nthreads;                     // [B, Hkv, Tk, Dq16] when ak
  float* part_v = part_k + (ak ? d.B * d.Hkv * Tk * Dq16 : 0);    // [B, Hkv, Tk, Dv16] when av
#pragma omp parallel num_threads(nthreads)
  {
    BwdScratch w;
    w.Kt = ws + per_thread * omp_get_thread_num();  // [Dqk, kTile]
    w.Vt = w.Kt + Dq16 * kTile;                     // [Dv, kTile]
    w.dKa = w.Vt + Dv16 * kTile;                    // [kTile, Dq16]
    w.dVa = w.dKa + kTile * Dq16;                   // [kTile, Dv16]
    w.S = w.dVa + kTile * Dv16;                     // [kTile, kTile]  scores, then P
    w.dP = w.S + kTile * kTile;                     // [kTile, kTile]  dP, then dS
    w.lse2 = w.dP + kTile * kTile;                  // [kTile]
    w.Dr = w.lse2 + kTile;                          // [kTile]
    auto pack = [&](int64_t b, int64_t hk, int64_t kt) {
      const int64_t j0 = kt * kTile, nk = std::min(kTile, Tk - j0);
      Ops::pack_t(w.Kt, kTile, k + (b * Tk + j0) * d.ldk + hk * d.head_k, d.ldk, nk, d.Dqk);
      Ops::pack_t(w.Vt, kTile, v + (b * Tk + j0) * d.ldv + hk * d.head_v, d.ldv, nk, d.Dv);
    };
    // dK_j, dV_j of (b, hk) for key tile kt, over the group's q heads; with_q: dQ contributions too.
    auto kv_tile = [&](int64_t b, int64_t hk, int64_t kt, bool with_q) {
      const int64_t j0 = kt * kTile, nk = std::min(kTile, Tk - j0);
      pack(b, hk, kt);
      bool first = true;  // the first contribution overwrites dKa/dVa
      for (int64_t g = 0; g < G; ++g)
        for (int64_t qt = causal ? kt : 0; qt < nqt; ++qt, first = false)
          bwd_pair<Ops>(w, first, true, with_q, b, hk * G + g, kt, qt, dq, dout, out, lse, q, k, d);
      // Every key tile has at least its diagonal q tile (Full: q tile 0, T > 0), so dKa/dVa are set.
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
            Ops::zero_row(dq + (b * d.T + t) * d.ldq + (hk * G + g) * d.head_q, d.Dqk);
        for (int64_t kt = 0; kt < nkt; ++kt) kv_tile(b, hk, kt, true);
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < d.B * d.Hkv * nkt; ++it) {  // key tile 0 (the heaviest) first
        const int64_t kt = it / (d.B * d.Hkv), bh = it % (d.B * d.Hkv);
        kv_tile(bh / d.Hkv, bh % d.Hkv, kt, false);
      }
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < d.B * d.Hq * nqt; ++it) {  // last q tile (the heaviest) first
        const int64_t qt = nqt - 1 - it / (d.B * d.Hq), bh = it % (d.B * d.Hq), b = bh / d.Hq, h = bh % d.Hq;
        const int64_t i0 = qt * kTile, mq = std::min(kTile, d.T - i0);
        for (int64_t r = 0; r < mq; ++r) Ops::zero_row(dq + (b * d.T + i0 + r) * d.ldq + h * d.head_q, d.Dqk);
        for (int64_t kt = 0; kt < (causal ? qt + 1 : nkt); ++kt) {
          pack(b, h / G, kt);
          bwd_pair<Ops>(w, true, false, true, b, h, kt, qt, dq, dout, out, lse, q, k, d);
        }
      }
    }
    // Aliased k (v) head: sum the per-kv-head partials in kv-head order.
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
