// grouped_gemm.cpp: grouped GEMM for MoE experts: validation, weight packing, workspace layout, the work-item
// schedule (one OpenMP parallel region per call), and the portable (scalar) tile kernel. The AVX-512 tile
// kernels live in grouped_gemm_avx512.cpp and are chosen by active_isa(). Not a dense GEMM (that is gemm.cpp,
// through oneDNN).
//
// Work items. forward / dgrad: (expert, MT-row tile, NT-column tile); wgrad: (expert, KT-row tile of dW[e],
// NT-column tile) with the whole reduction over the expert's tokens inside the item. Each output element is
// computed by exactly one item in a fixed summation order, so results do not depend on the thread count or
// on which thread runs which item. Items are handed out dynamically, largest experts first.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "kernels/grouped_gemm_tile.h"
#include "moetron/check.h"
#include "moetron/grouped_gemm.h"
#include "moetron/runtime.h"

namespace moetron {

using gg::kPanel;
using gg::Tile;

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
size_t align64(size_t b) { return (b + 63) & ~size_t(63); }

// ---------------------------------------------------------------------------------------------------------
// Packed weight layout. B = W[e] (Fwd, Kc = K contraction, Nc = N columns) or W[e]^T (Dgrad, Kc = N, Nc = K).
// Columns are cut into 64-wide panels (the last one zero-padded to 64). bf16 panel: [ceil(Kc/2)][64][2]
// (VNNI pairs along the contraction, zero-padded when Kc is odd); fp32 panel: [Kc][64].
struct PackGeom {
  int64_t Kc, Nc, steps, npanels, panel_elems, expert_elems, elem_bytes;
};
PackGeom pack_geom(GroupedPackKind kind, GemmPrec prec, int64_t K, int64_t N) {
  PackGeom g{};
  g.Kc = kind == GroupedPackKind::Fwd ? K : N;
  g.Nc = kind == GroupedPackKind::Fwd ? N : K;
  g.elem_bytes = prec == GemmPrec::BF16 ? 2 : 4;
  g.steps = prec == GemmPrec::BF16 ? ceil_div(g.Kc, 2) : g.Kc;
  g.npanels = ceil_div(g.Nc, kPanel);
  g.panel_elems = g.steps * kPanel * (prec == GemmPrec::BF16 ? 2 : 1);
  g.expert_elems = g.npanels * g.panel_elems;  // a multiple of 64 elements, so experts stay 64-byte aligned
  return g;
}

// ---------------------------------------------------------------------------------------------------------
// Portable tile kernel (scalar ISA and fallback). Same contract as the AVX-512 ones; plain loops.
void tile_bf16_scalar(const Tile& t) {
  const uint16_t* A = static_cast<const uint16_t*>(t.A);
  const uint16_t* B = static_cast<const uint16_t*>(t.B);
  auto f = [](uint16_t b) { return from_bf16(bf16{b}); };
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c) {
      const int64_t p = c / kPanel, cc = c % kPanel;
      float acc = t.accumulate ? t.C[r * t.ldc + c] : 0.0f;
      for (int64_t s = 0; s < t.steps; ++s) {
        const uint16_t* a = A + r * t.a_rs + s * t.a_ss;
        const uint16_t* b = B + p * t.b_ps + s * t.b_ss + 2 * cc;
        acc += f(a[0]) * f(b[0]);
        if (!(t.a_odd_tail && s == t.steps - 1)) acc += f(a[1]) * f(b[1]);
      }
      t.C[r * t.ldc + c] = acc;
      if (t.Cb) t.Cb[r * t.ldc + c] = to_bf16(acc);
    }
}

void tile_f32_scalar(const Tile& t) {
  const float* A = static_cast<const float*>(t.A);
  const float* B = static_cast<const float*>(t.B);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c) {
      const int64_t p = c / kPanel, cc = c % kPanel;
      float acc = t.accumulate ? t.C[r * t.ldc + c] : 0.0f;
      for (int64_t s = 0; s < t.steps; ++s) acc += A[r * t.a_rs + s * t.a_ss] * B[p * t.b_ps + s * t.b_ss + cc];
      t.C[r * t.ldc + c] = acc;
      if (t.Cb) t.Cb[r * t.ldc + c] = to_bf16(acc);
    }
}

using TileFn = void (*)(const Tile&);
TileFn tile_fn(GemmPrec prec) {
  const Isa isa = active_isa();
  if (prec == GemmPrec::BF16) return isa == Isa::Avx512 ? gg::tile_bf16_avx512 : tile_bf16_scalar;
  return isa == Isa::Avx512 ? gg::tile_f32_avx512 : tile_f32_scalar;
}

// out[p][c][2] = (in[2p][c], in[2p+1][c]); rows >= n_rows and columns in [cols, width) are zero.
void interleave_rows(bf16* out, const bf16* in, int64_t ld, int64_t n_rows, int64_t cols, int64_t width) {
  if (active_isa() == Isa::Avx512) return gg::interleave_rows_avx512(out, in, ld, n_rows, cols, width);
  const int64_t npairs = ceil_div(n_rows, 2);
  for (int64_t p = 0; p < npairs; ++p)
    for (int64_t c = 0; c < width; ++c)
      for (int64_t j = 0; j < 2; ++j)
        out[(p * width + c) * 2 + j] = (2 * p + j < n_rows && c < cols) ? in[(2 * p + j) * ld + c] : bf16{};
}

// ---------------------------------------------------------------------------------------------------------
// Tile-size heuristics (kept apart from the kernels). Rows per item are a multiple of the microkernel's 6
// rows; columns per item a multiple of the 64-wide panel.
struct Plan {
  int64_t mt = 96;   // rows per item (M-grouped: tokens; wgrad: rows of dW[e], i.e. K)
  int64_t nt = 192;  // columns per item
};
Plan plan_mgrouped(int64_t n_out) {
  Plan p;
  p.mt = 96;
  p.nt = std::min<int64_t>(round_up(std::max<int64_t>(n_out, 1), kPanel), 256);
  return p;
}
Plan plan_wgrad(int64_t K, int64_t N) {
  Plan p;
  p.mt = 96;
  p.nt = std::min<int64_t>(round_up(std::max<int64_t>(N, 1), kPanel), 256);
  (void)K;
  return p;
}

// ---------------------------------------------------------------------------------------------------------
// Workspace: schedule arrays (int64) then, for bf16 wgrad, the interleaved operands.
//   off[E+1]    row offsets                      perm[E]      experts by descending count (stable)
//   pref[E+1]   prefix of work items in perm order
//   poff[E+1]   row offsets with each count rounded up to even     (bf16 wgrad)
//   cpref[E+1]  prefix of packing chunks per expert                  (bf16 wgrad)
//   xp          [sum ceil(m_e/2)][K16][2] bf16     yp         [sum ceil(m_e/2)][N16][2] bf16
struct WsLayout {
  size_t off, perm, pref, poff, cpref, xp, yp, total;
};
WsLayout ws_layout(GroupedOp op, GemmPrec prec, int64_t E, int64_t M, int64_t K, int64_t N) {
  WsLayout l{};
  size_t at = 0;
  auto take = [&](size_t bytes) {
    size_t p = at;
    at += align64(bytes);
    return p;
  };
  const size_t e1 = size_t(E + 1) * sizeof(int64_t);
  l.off = take(e1);
  l.perm = take(size_t(E) * sizeof(int64_t));
  l.pref = take(e1);
  l.poff = take(e1);
  l.cpref = take(e1);
  if (op == GroupedOp::Wgrad && prec == GemmPrec::BF16) {
    const size_t padded_rows = size_t(M + E);  // sum of round_up(m_e, 2) <= M + E
    l.xp = take(padded_rows * size_t(round_up(K, 16)) * 2);
    l.yp = take(padded_rows * size_t(round_up(N, 16)) * 2);
  }
  l.total = at;
  return l;
}

struct Sched {
  int64_t* off;
  int64_t* perm;
  int64_t* pref;
  int64_t* poff;
};

// Fills off, perm (descending count, ties by index) and pref (items of perm[j] = tiles(count)).
template <class TilesOf>
Sched make_sched(void* ws, const WsLayout& l, const int32_t* counts, int64_t E, int64_t M, TilesOf tiles_of) {
  char* w = static_cast<char*>(ws);
  Sched s{reinterpret_cast<int64_t*>(w + l.off), reinterpret_cast<int64_t*>(w + l.perm),
          reinterpret_cast<int64_t*>(w + l.pref), reinterpret_cast<int64_t*>(w + l.poff)};
  grouped_offsets(s.off, counts, E, M);
  std::iota(s.perm, s.perm + E, int64_t(0));
  std::stable_sort(s.perm, s.perm + E, [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  s.pref[0] = 0;
  for (int64_t j = 0; j < E; ++j) s.pref[j + 1] = s.pref[j] + tiles_of(s.perm[j]);
  return s;
}

// item -> (position in perm order, local item index)
inline void locate(const Sched& s, int64_t E, int64_t item, int64_t& j, int64_t& local) {
  j = int64_t(std::upper_bound(s.pref, s.pref + E + 1, item) - s.pref) - 1;
  local = item - s.pref[j];
}

void check_common(const char* op, const int32_t* counts, int64_t E, int64_t M, int64_t K, int64_t N, const void* ws) {
  MT_CHECK(E >= 0 && M >= 0 && K >= 0 && N >= 0, op, "negative size E=", E, " M=", M, " K=", K, " N=", N);
  MT_CHECK(counts || E == 0, op, "counts is null (E=", E, ")");
  MT_CHECK(ws, op, "workspace is null (need grouped_gemm_workspace_bytes)");
}

void check_packed(const char* op, const GroupedPackedWeights& W, GroupedPackKind kind, GemmPrec prec, int64_t E,
                  int64_t K, int64_t N) {
  MT_CHECK(W.kind == kind, op, "weights packed for ", W.kind == GroupedPackKind::Fwd ? "Fwd" : "Dgrad",
           ", this op needs ", kind == GroupedPackKind::Fwd ? "Fwd" : "Dgrad");
  MT_CHECK(W.prec == prec, op, "weights packed as ", W.prec == GemmPrec::BF16 ? "bf16" : "fp32",
           " but inputs are ", prec == GemmPrec::BF16 ? "bf16" : "fp32");
  MT_CHECK(W.E == E && W.K == K && W.N == N, op, "packed weights are [", W.E, ",", W.K, ",", W.N,
           "] but the call has [", E, ",", K, ",", N, "]");
  MT_CHECK(W.data || E * K * N == 0, op, "packed weights data is null");
}

// M-grouped: Out[M, Nc] = In[M, Kc] · B_e (packed). Forward: (Kc, Nc) = (K, N); dgrad: (N, K).
void run_mgrouped(const char* op, GemmPrec prec, float* out, bf16* out_bf16, const void* in,
                  const GroupedPackedWeights& W, GroupedPackKind kind, const int32_t* counts, int64_t E, int64_t M,
                  int64_t K, int64_t N, void* ws) {
  check_common(op, counts, E, M, K, N, ws);
  check_packed(op, W, kind, prec, E, K, N);
  const PackGeom g = pack_geom(kind, prec, K, N);
  MT_CHECK((out && in) || M == 0 || g.Nc == 0, op, "null input or output");
  const WsLayout l = ws_layout(kind == GroupedPackKind::Fwd ? GroupedOp::Fwd : GroupedOp::Dgrad, prec, E, M, K, N);
  const Plan plan = plan_mgrouped(g.Nc);
  const int64_t ntn = ceil_div(g.Nc, plan.nt);
  const Sched s = make_sched(ws, l, counts, E, M, [&](int64_t e) { return ceil_div(counts[e], plan.mt) * ntn; });
  if (M == 0 || g.Nc == 0) return;
  const int64_t nitems = s.pref[E];
  const TileFn fn = tile_fn(prec);
  const int64_t esz = prec == GemmPrec::BF16 ? 2 : 4;
  const char* inb = static_cast<const char*>(in);
  const char* wb = static_cast<const char*>(W.data);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < nitems; ++item) {
    int64_t j, local;
    locate(s, E, item, j, local);
    const int64_t e = s.perm[j];
    const int64_t mi = local / ntn, ni = local % ntn;
    const int64_t r0 = s.off[e] + mi * plan.mt, c0 = ni * plan.nt;
    Tile t;
    t.rows = std::min(plan.mt, s.off[e + 1] - r0);
    t.cols = std::min(plan.nt, g.Nc - c0);
    t.A = inb + r0 * g.Kc * esz;
    t.a_rs = g.Kc;
    t.a_ss = prec == GemmPrec::BF16 ? 2 : 1;
    t.B = wb + (e * g.expert_elems + (c0 / kPanel) * g.panel_elems) * esz;
    t.b_ps = g.panel_elems;
    t.b_ss = prec == GemmPrec::BF16 ? 2 * kPanel : kPanel;
    t.C = out + r0 * g.Nc + c0;
    t.Cb = out_bf16 ? out_bf16 + r0 * g.Nc + c0 : nullptr;
    t.ldc = g.Nc;
    t.steps = g.steps;
    t.a_odd_tail = prec == GemmPrec::BF16 && (g.Kc % 2 == 1);
    t.accumulate = false;
    fn(t);
  }
}

void run_wgrad(const char* op, GemmPrec prec, float* dW, const void* X, const void* dY, const int32_t* counts,
               int64_t E, int64_t M, int64_t K, int64_t N, bool accumulate, void* ws) {
  check_common(op, counts, E, M, K, N, ws);
  MT_CHECK(dW || E * K * N == 0, op, "dW is null");
  MT_CHECK((X && dY) || M == 0 || K * N == 0, op, "null X or dY");
  const WsLayout l = ws_layout(GroupedOp::Wgrad, prec, E, M, K, N);
  const Plan plan = plan_wgrad(K, N);
  const int64_t ntm = ceil_div(K, plan.mt), ntn = ceil_div(N, plan.nt);
  const Sched s = make_sched(ws, l, counts, E, M, [&](int64_t e) {
    return (accumulate && counts[e] == 0) ? int64_t(0) : ntm * ntn;  // accumulate into an empty expert: no-op
  });
  if (K == 0 || N == 0) return;
  const TileFn fn = tile_fn(prec);
  const int64_t K16 = round_up(K, 16), N16 = round_up(N, 16);
  const bool bf = prec == GemmPrec::BF16;
  char* w = static_cast<char*>(ws);
  bf16* xp = bf ? reinterpret_cast<bf16*>(w + l.xp) : nullptr;
  bf16* yp = bf ? reinterpret_cast<bf16*>(w + l.yp) : nullptr;
  // bf16 packing items: (expert, chunk of kPackPairs row pairs), in expert order.
  constexpr int64_t kPackPairs = 64;
  int64_t* poff = s.poff;
  int64_t* cpref = reinterpret_cast<int64_t*>(w + l.cpref);
  poff[0] = cpref[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    poff[e + 1] = poff[e] + round_up(counts[e], 2);
    cpref[e + 1] = cpref[e] + (bf ? ceil_div(ceil_div(counts[e], 2), kPackPairs) : 0);
  }
  const int64_t npack = cpref[E];
  const int64_t nitems = s.pref[E];
  const char* xb = static_cast<const char*>(X);
  const char* yb = static_cast<const char*>(dY);
  const int64_t esz = bf ? 2 : 4;
#pragma omp parallel
  {
    if (bf) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < npack; ++it) {
        const int64_t e = int64_t(std::upper_bound(cpref, cpref + E + 1, it) - cpref) - 1;
        const int64_t c = it - cpref[e], pe = poff[e];
        const int64_t r0 = 2 * c * kPackPairs;
        const int64_t nr = std::min<int64_t>(2 * kPackPairs, counts[e] - r0);
        const int64_t row = s.off[e] + r0;
        interleave_rows(xp + (pe + r0) * K16, reinterpret_cast<const bf16*>(X) + row * K, K, nr, K, K16);
        interleave_rows(yp + (pe + r0) * N16, reinterpret_cast<const bf16*>(dY) + row * N, N, nr, N, N16);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nitems; ++item) {
      int64_t j, local;
      locate(s, E, item, j, local);
      const int64_t e = s.perm[j];
      const int64_t mi = local / ntn, ni = local % ntn;
      const int64_t k0 = mi * plan.mt, n0 = ni * plan.nt;
      const int64_t m = counts[e];
      Tile t;
      t.rows = std::min(plan.mt, K - k0);
      t.cols = std::min(plan.nt, N - n0);
      if (bf) {
        const int64_t pe = poff[e];
        t.A = xp + pe * K16 + 2 * k0;
        t.a_rs = 2;
        t.a_ss = 2 * K16;
        t.B = yp + pe * N16 + 2 * n0;
        t.b_ps = 2 * kPanel;
        t.b_ss = 2 * N16;
        t.steps = ceil_div(m, 2);
      } else {
        t.A = xb + (s.off[e] * K + k0) * esz;
        t.a_rs = 1;
        t.a_ss = K;
        t.B = yb + (s.off[e] * N + n0) * esz;
        t.b_ps = kPanel;
        t.b_ss = N;
        t.steps = m;
      }
      t.C = dW + e * K * N + k0 * N + n0;
      t.ldc = N;
      t.accumulate = accumulate;
      fn(t);
    }
  }
}

}  // namespace

void grouped_offsets(int64_t* off, const int32_t* counts, int64_t E, int64_t M) {
  MT_CHECK(E >= 0, "grouped_gemm", "negative expert count E=", E);
  MT_CHECK(M >= 0, "grouped_gemm", "negative row count M=", M);
  MT_CHECK(off && (counts || E == 0), "grouped_gemm", "null offsets or counts");
  off[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    MT_CHECK(counts[e] >= 0, "grouped_gemm", "counts[", e, "]=", counts[e], " is negative");
    off[e + 1] = off[e] + counts[e];
  }
  MT_CHECK(off[E] == M, "grouped_gemm", "counts sum to ", off[E], " but M=", M);
}

size_t grouped_packed_bytes(GroupedPackKind kind, GemmPrec prec, int64_t E, int64_t K, int64_t N) {
  MT_CHECK(E >= 0 && K >= 0 && N >= 0, "grouped_pack_weights", "negative size E=", E, " K=", K, " N=", N);
  const PackGeom g = pack_geom(kind, prec, K, N);
  return align64(size_t(E) * size_t(g.expert_elems) * size_t(g.elem_bytes));
}

GroupedPackedWeights grouped_pack_weights(void* data, const float* W, int64_t E, int64_t K, int64_t N, GemmPrec prec,
                                          GroupedPackKind kind) {
  const size_t bytes = grouped_packed_bytes(kind, prec, E, K, N);
  MT_CHECK((data && W) || bytes == 0, "grouped_pack_weights", "null data or W");
  const PackGeom g = pack_geom(kind, prec, K, N);
  const bool fwd = kind == GroupedPackKind::Fwd;
  // B(k, c) for expert e: W[e][k][c] (Fwd) or W[e][c][k] (Dgrad).
  const int64_t items = E * g.npanels;
#pragma omp parallel for schedule(static) if (items > 1 && E * K * N > 65536)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t e = it / g.npanels, p = it % g.npanels;
    const float* We = W + e * K * N;
    const int64_t c0 = p * kPanel, pc = std::min(kPanel, g.Nc - c0);
    auto b = [&](int64_t k, int64_t c) -> float {
      if (k >= g.Kc || c >= pc) return 0.0f;
      return fwd ? We[k * N + c0 + c] : We[(c0 + c) * N + k];
    };
    if (prec == GemmPrec::BF16) {
      bf16* out = static_cast<bf16*>(data) + e * g.expert_elems + p * g.panel_elems;
      if (fwd) {
        for (int64_t s = 0; s < g.steps; ++s)
          for (int64_t c = 0; c < kPanel; ++c) {
            out[(s * kPanel + c) * 2 + 0] = to_bf16(b(2 * s, c));
            out[(s * kPanel + c) * 2 + 1] = to_bf16(b(2 * s + 1, c));
          }
      } else {  // read rows of W[e] (c fixed) contiguously
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t k = 0; k < 2 * g.steps; ++k) out[((k / 2) * kPanel + c) * 2 + (k & 1)] = to_bf16(b(k, c));
      }
    } else {
      float* out = static_cast<float*>(data) + e * g.expert_elems + p * g.panel_elems;
      if (fwd) {
        for (int64_t s = 0; s < g.steps; ++s)
          for (int64_t c = 0; c < kPanel; ++c) out[s * kPanel + c] = b(s, c);
      } else {
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t s = 0; s < g.steps; ++s) out[s * kPanel + c] = b(s, c);
      }
    }
  }
  GroupedPackedWeights w;
  w.data = data;
  w.E = E;
  w.K = K;
  w.N = N;
  w.prec = prec;
  w.kind = kind;
  return w;
}

size_t grouped_gemm_workspace_bytes(GroupedOp op, GemmPrec prec, int64_t E, int64_t M, int64_t K, int64_t N) {
  MT_CHECK(E >= 0 && M >= 0 && K >= 0 && N >= 0, "grouped_gemm", "negative size E=", E, " M=", M, " K=", K, " N=",
           N);
  return ws_layout(op, prec, E, M, K, N).total;
}

void grouped_gemm_fwd(float* Y, bf16* Y_bf16, const bf16* X, const GroupedPackedWeights& W, const int32_t* counts,
                      int64_t E, int64_t M, int64_t K, int64_t N, void* ws) {
  run_mgrouped("grouped_gemm_fwd", GemmPrec::BF16, Y, Y_bf16, X, W, GroupedPackKind::Fwd, counts, E, M, K, N, ws);
}
void grouped_gemm_fwd(float* Y, const float* X, const GroupedPackedWeights& W, const int32_t* counts, int64_t E,
                      int64_t M, int64_t K, int64_t N, void* ws) {
  run_mgrouped("grouped_gemm_fwd", GemmPrec::F32, Y, nullptr, X, W, GroupedPackKind::Fwd, counts, E, M, K, N, ws);
}
void grouped_gemm_dgrad(float* dX, bf16* dX_bf16, const bf16* dY, const GroupedPackedWeights& Wt,
                        const int32_t* counts, int64_t E, int64_t M, int64_t K, int64_t N, void* ws) {
  run_mgrouped("grouped_gemm_dgrad", GemmPrec::BF16, dX, dX_bf16, dY, Wt, GroupedPackKind::Dgrad, counts, E, M, K, N,
               ws);
}
void grouped_gemm_dgrad(float* dX, const float* dY, const GroupedPackedWeights& Wt, const int32_t* counts, int64_t E,
                        int64_t M, int64_t K, int64_t N, void* ws) {
  run_mgrouped("grouped_gemm_dgrad", GemmPrec::F32, dX, nullptr, dY, Wt, GroupedPackKind::Dgrad, counts, E, M, K, N,
               ws);
}
void grouped_gemm_wgrad(float* dW, const bf16* X, const bf16* dY, const int32_t* counts, int64_t E, int64_t M,
                        int64_t K, int64_t N, bool accumulate, void* ws) {
  run_wgrad("grouped_gemm_wgrad", GemmPrec::BF16, dW, X, dY, counts, E, M, K, N, accumulate, ws);
}
void grouped_gemm_wgrad(float* dW, const float* X, const float* dY, const int32_t* counts, int64_t E, int64_t M,
                        int64_t K, int64_t N, bool accumulate, void* ws) {
  run_wgrad("grouped_gemm_wgrad", GemmPrec::F32, dW, X, dY, counts, E, M, K, N, accumulate, ws);
}

}  // namespace moetron
