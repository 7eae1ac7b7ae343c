// grouped_gemm.cpp: grouped GEMM for MoE experts: validation, weight packing, workspace layout, the work-item
// schedule (one OpenMP parallel region per call), and the portable (scalar) tile kernel. The AMX, AVX-512 and
// AVX2 tile kernels live in grouped_gemm_amx.cpp / _avx512.cpp / _avx2.cpp and are chosen by active_isa() and
// amx_active(). Not a
// dense GEMM (that is gemm.cpp, through oneDNN).
//
// Work items. forward / dgrad: (expert, mt-row tile, nt-column tile); wgrad: (expert, mt-row tile of dW[e],
// nt-column tile) with the whole reduction over the expert's tokens inside the item. Each output element is
// computed by exactly one item in a fixed summation order, so results do not depend on the thread count, on
// the tiling or on which thread runs which item. Items are handed out dynamically, largest experts first.
// fp32 on AVX2: an item first copies its A operand into 6-row micro-panels (a per-thread scratch buffer).
#include "moetron/grouped_gemm.h"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "kernels/grouped_gemm_tile.h"
#include "moetron/check.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

gg::Tuning& gg::tuning() {
  static Tuning t;
  return t;
}

using gg::kPanel;
using gg::Tile;

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Packed weight layout: GroupedPackGeom (kernel_sizes.h; the sizes are shared with the accounting).
using PackGeom = GroupedPackGeom;
PackGeom pack_geom(GroupedPackKind kind, GemmPrec prec, int64_t K, int64_t N) {
  return grouped_pack_geom(kind, prec, K, N);
}

// ---------------------------------------------------------------------------------------------------------
// Portable tile kernel (scalar ISA). Same contract as the SIMD ones (grouped_gemm_tile.h); plain loops.
inline int64_t a_at(const Tile& t, int64_t r, int64_t s) {
  return (r / t.a_rb) * t.a_bs + (r % t.a_rb) * t.a_rs + s * t.a_ss;
}

void tile_bf16_scalar(const Tile& t) {
  const uint16_t* A = static_cast<const uint16_t*>(t.A);
  const uint16_t* B = static_cast<const uint16_t*>(t.B);
  auto f = [](uint16_t b) { return from_bf16(bf16{b}); };
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < t.cols; ++c) {
      const int64_t p = c / t.b_pw, cc = c % t.b_pw;
      float acc = t.accumulate ? t.C[r * t.ldc + c] : 0.0f;
      for (int64_t s = 0; s < t.steps; ++s) {
        const uint16_t* a = A + a_at(t, r, s);
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
      const int64_t p = c / t.b_pw, cc = c % t.b_pw;
      float acc = t.accumulate ? t.C[r * t.ldc + c] : 0.0f;
      for (int64_t s = 0; s < t.steps; ++s) acc += A[a_at(t, r, s)] * B[p * t.b_ps + s * t.b_ss + cc];
      t.C[r * t.ldc + c] = acc;
      if (t.Cb) t.Cb[r * t.ldc + c] = to_bf16(acc);
    }
}

}  // namespace

gg::TileFn gg::tile_fn(bool bf) {
  const Isa isa = active_isa();
  if (bf && gg::use_amx()) return tile_bf16_amx;
  if (bf) return isa == Isa::Avx512 ? tile_bf16_avx512 : isa == Isa::Avx2 ? tile_bf16_avx2 : tile_bf16_scalar;
  return isa == Isa::Avx512 ? tile_f32_avx512 : isa == Isa::Avx2 ? tile_f32_avx2 : tile_f32_scalar;
}

namespace {

gg::TileFn tile_fn(GemmPrec prec) { return gg::tile_fn(prec == GemmPrec::BF16); }

// Row pairs interleaved into 64-column panels (contract in grouped_gemm_tile.h).
void pack_pairs(bf16* out, int64_t panel_stride, const bf16* in, int64_t ld, int64_t n_rows, int64_t cols) {
  if (active_isa() == Isa::Avx512) return gg::pack_pairs_avx512(out, panel_stride, in, ld, n_rows, cols);
  if (active_isa() == Isa::Avx2) return gg::pack_pairs_avx2(out, panel_stride, in, ld, n_rows, cols);
  const int64_t npairs = ceil_div(n_rows, 2), width = round_up(cols, kPanel);
  for (int64_t p = 0; p < npairs; ++p)
    for (int64_t c = 0; c < width; ++c)
      for (int64_t j = 0; j < 2; ++j)
        out[(c / kPanel) * panel_stride + p * 2 * kPanel + 2 * (c % kPanel) + j] =
            (2 * p + j < n_rows && c < cols) ? in[(2 * p + j) * ld + c] : bf16{};
}

// ---------------------------------------------------------------------------------------------------------
// Tile-size heuristics (kept apart from the kernels; values in gg::tuning()). Rows per item are a multiple
// of the microkernel's 6 rows, columns a multiple of the 64-wide panel. None of them changes results: every
// output element is summed in the same order whatever the tiling (K blocks and wgrad row chunks continue
// the running sum through C).
struct Plan {
  int64_t mt = 0;  // rows per item (M-grouped: tokens; wgrad: rows of dW[e], i.e. K)
  int64_t nt = 0;  // columns per item
  int64_t mc = 0;  // bf16 wgrad: token pairs per packed chunk
};
Plan plan_mgrouped(int64_t n_out) {
  const gg::Tuning& tu = gg::tuning();
  Plan p;
  p.mt = active_isa() == Isa::Avx2 ? tu.mt_avx2 : tu.mt;
  p.nt = std::min<int64_t>(round_up(std::max<int64_t>(n_out, 1), kPanel), tu.nt);
  return p;
}
Plan plan_wgrad(GemmPrec prec, int64_t K, int64_t N) {
  const gg::Tuning& tu = gg::tuning();
  Plan p;
  p.mt = grouped_wgrad_item_rows(K, tu.wmt);
  // bf16 packs whole rows of dY per chunk, so an item covers all N columns.
  p.nt = prec == GemmPrec::BF16 ? round_up(std::max<int64_t>(N, 1), kPanel)
                                : std::min<int64_t>(round_up(std::max<int64_t>(N, 1), kPanel), tu.wnt);
  p.mc = tu.wmc;
  return p;
}

// ---------------------------------------------------------------------------------------------------------
// Workspace: schedule arrays (int64), then for bf16 wgrad one packing slot per thread:
//   off[E+1]    row offsets
//   perm[E]     experts by descending count (ties by index): big experts are handed out first
//   pref[E+1]   prefix of work items in perm order
//   slot[t]     a  [ceil(mt/64)][mc][64][2] bf16 (A operand: 64-row groups of a chunk of X_e^T)
//               b  [ceil(N/64)][mc][64][2] bf16  (B operand: 64-column panels of a chunk of dY_e)
// The number of slots is what ws_bytes allows, at most the OpenMP thread count; it caps the threads of the
// wgrad region (results do not depend on it).
using WsLayout = GroupedWsLayout;
WsLayout ws_layout(GroupedOp op, GemmPrec prec, int64_t E, int64_t K, int64_t N) {
  const gg::Tuning& tu = gg::tuning();
  return grouped_ws_layout(op, prec, E, K, N, tu.wmt, tu.wmc);
}

struct Sched {
  int64_t* off;
  int64_t* perm;
  int64_t* pref;
};

// Fills off, perm and pref (items of perm[j] = tiles_of(perm[j])).
template <class TilesOf>
Sched make_sched(void* ws, const WsLayout& l, const int32_t* counts, int64_t E, int64_t M, TilesOf tiles_of) {
  char* w = static_cast<char*>(ws);
  Sched s{reinterpret_cast<int64_t*>(w + l.off), reinterpret_cast<int64_t*>(w + l.perm),
          reinterpret_cast<int64_t*>(w + l.pref)};
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

void check_common(const char* op, const int32_t* counts, int64_t E, int64_t M, int64_t K, int64_t N, const void* ws,
                  size_t ws_bytes, size_t need) {
  MT_CHECK(E >= 0 && M >= 0 && K >= 0 && N >= 0, op, "negative size E=", E, " M=", M, " K=", K, " N=", N);
  MT_CHECK(counts || E == 0, op, "counts is null (E=", E, ")");
  MT_CHECK(ws, op, "workspace is null (need grouped_gemm_workspace_bytes)");
  MT_CHECK(reinterpret_cast<uintptr_t>(ws) % 64 == 0, op, "workspace ", ws, " is not 64-byte aligned");
  MT_CHECK(ws_bytes >= need, op, "workspace of ", ws_bytes, " bytes, need at least ", need);
}

void check_packed(const char* op, const GroupedPackedWeights& W, GroupedPackKind kind, GemmPrec prec, int64_t E,
                  int64_t K, int64_t N) {
  MT_CHECK(W.kind == kind, op, "weights packed for ", W.kind == GroupedPackKind::Fwd ? "Fwd" : "Dgrad",
           ", this op needs ", kind == GroupedPackKind::Fwd ? "Fwd" : "Dgrad");
  MT_CHECK(W.prec == prec, op, "weights packed as ", W.prec == GemmPrec::BF16 ? "bf16" : "fp32", " but inputs are ",
           prec == GemmPrec::BF16 ? "bf16" : "fp32");
  MT_CHECK(W.E == E && W.K == K && W.N == N, op, "packed weights are [", W.E, ",", W.K, ",", W.N,
           "] but the call has [", E, ",", K, ",", N, "]");
  MT_CHECK(W.data || E * K * N == 0, op, "packed weights data is null");
}

// Grow-only 64-byte aligned fp32 scratch, one per thread: the fp32 A micro-panels of the AVX2 path.
float* thread_scratch(size_t floats) {
  struct Buf {
    float* p = nullptr;
    size_t n = 0;
    ~Buf() { std::free(p); }
  };
  static thread_local Buf b;
  if (floats > b.n) {
    std::free(b.p);
    b.p = static_cast<float*>(std::aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64));
    MT_CHECK(b.p, "grouped_gemm", "cannot allocate ", floats * sizeof(float), " bytes of scratch");
    b.n = floats;
  }
  return b.p;
}

// M-grouped: Out[M, Nc] = In[M, Kc] · B_e (packed). Forward: (Kc, Nc) = (K, N); dgrad: (N, K).
void run_mgrouped(const char* op, GemmPrec prec, float* out, bf16* out_bf16, const void* in,
                  const GroupedPackedWeights& W, GroupedPackKind kind, const int32_t* counts, int64_t E, int64_t M,
                  int64_t K, int64_t N, void* ws, size_t ws_bytes) {
  const WsLayout l = ws_layout(kind == GroupedPackKind::Fwd ? GroupedOp::Fwd : GroupedOp::Dgrad, prec, E, K, N);
  check_common(op, counts, E, M, K, N, ws, ws_bytes, l.fixed);
  check_packed(op, W, kind, prec, E, K, N);
  const PackGeom g = pack_geom(kind, prec, K, N);
  MT_CHECK((out && in) || M == 0 || g.Nc == 0, op, "null input or output");
  {  // the [M, K] x [K, N] products of the experts' rows (dgrad: K and N as the caller names them, swapped)
    const double es = prec == GemmPrec::BF16 ? 2.0 : 4.0, in_w = kind == GroupedPackKind::Fwd ? double(K) : double(N);
    const double out_w = kind == GroupedPackKind::Fwd ? double(N) : double(K);
    MT_TRACE_COST(2.0 * double(M) * double(K) * double(N),
                  es * (double(M) * in_w + double(E) * double(K) * double(N)) + double(M) * out_w * (out_bf16 ? 6.0 : 4.0));
  }
  const Plan plan = plan_mgrouped(g.Nc);
  const int64_t ntn = ceil_div(g.Nc, plan.nt);
  const Sched s = make_sched(ws, l, counts, E, M, [&](int64_t e) { return ceil_div(counts[e], plan.mt) * ntn; });
  if (M == 0 || g.Nc == 0) return;
  const int64_t nitems = s.pref[E];
  const gg::TileFn fn = tile_fn(prec);
  const int64_t esz = prec == GemmPrec::BF16 ? 2 : 4;
  const char* inb = static_cast<const char*>(in);
  const char* wb = static_cast<const char*>(W.data);
  const bool fpack = prec == GemmPrec::F32 && active_isa() == Isa::Avx2 && gg::tuning().fpack_avx2;
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
    t.a_bs = gg::kMR * g.Kc;
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
    t.stream = gg::tuning().stream && out_bf16 == nullptr;
    if (fpack) {  // the item's rows as 6-row micro-panels: one contiguous stream per microkernel call
      float* ab = thread_scratch(size_t(round_up(t.rows, gg::kMR) * g.Kc + 2));
      gg::pack_a_rows_f32_avx2(ab, static_cast<const float*>(in) + r0 * g.Kc, g.Kc, t.rows, g.Kc);
      t.A = ab;
      t.a_bs = gg::kMR * g.Kc;
      t.a_rs = 1;
      t.a_ss = gg::kMR;
    }
    fn(t);
  }
}

// K-grouped: dW[e][K, N] (+)= X_e^T · dY_e. Items: (expert, mt-row tile of dW[e], nt-column tile), the whole
// reduction over the expert's tokens inside the item. bf16: the item packs its operands chunk by chunk (mc
// token pairs) into its thread's slot, which stays in L2, and accumulates the chunks through C in token order.
// fp32: the kernel reads X and dY in place (no packing).
void run_wgrad(const char* op, GemmPrec prec, float* dW, const void* X, const void* dY, const int32_t* counts,
               int64_t E, int64_t M, int64_t K, int64_t N, bool accumulate, void* ws, size_t ws_bytes) {
  const bool bf = prec == GemmPrec::BF16;
  const WsLayout l = ws_layout(GroupedOp::Wgrad, prec, E, K, N);
  check_common(op, counts, E, M, K, N, ws, ws_bytes, l.fixed + l.slot_bytes);
  MT_CHECK(dW || E * K * N == 0, op, "dW is null");
  MT_CHECK((X && dY) || M == 0 || K * N == 0, op, "null X or dY");
  MT_TRACE_COST(2.0 * double(M) * double(K) * double(N),
                (bf ? 2.0 : 4.0) * double(M) * double(K + N) + double(E * K * N) * (accumulate ? 8.0 : 4.0));
  Plan plan = plan_wgrad(prec, K, N);
  // Few experts for many threads: cut dW[e] into more row tiles (at least ~4 items per thread). The slot
  // was sized for plan.mt, and smaller tiles fit; results do not depend on the tiling.
  const int64_t busy =
      std::max<int64_t>(1, int64_t(std::count_if(counts, counts + E, [](int32_t c) { return c > 0; })));
  const int64_t want_tiles = ceil_div(4 * int64_t(num_threads()), busy);
  if (want_tiles > 1) plan.mt = std::max<int64_t>(kPanel, std::min(plan.mt, round_up(ceil_div(K, want_tiles), kPanel)));
  const int64_t ntm = ceil_div(K, plan.mt), ntn = ceil_div(N, plan.nt);
  const Sched s = make_sched(ws, l, counts, E, M, [&](int64_t e) {
    return (accumulate && counts[e] == 0) ? int64_t(0) : ntm * ntn;  // accumulating an empty expert: no-op
  });
  if (K == 0 || N == 0) return;
  const gg::TileFn fn = tile_fn(prec);
  const int64_t nitems = s.pref[E];
  const int64_t nslots =
      bf ? std::min<int64_t>(num_threads(), int64_t((ws_bytes - l.fixed) / l.slot_bytes)) : num_threads();
  const int64_t mc = plan.mc;
  const bool wpack = !bf && active_isa() == Isa::Avx2 && gg::tuning().wpack_avx2;
  const bool amx = bf && gg::use_amx();  // X^T packed as rows of token pairs (pack_xt_pairs_amx)
  const int64_t wmc = std::max<int64_t>(1, gg::tuning().wmc_f32);
  char* w = static_cast<char*>(ws);
#pragma omp parallel num_threads(int(std::max <int64_t>(1, std::min <int64_t>(nslots, nitems))))
  {
    char* slot = w + l.slots + size_t(omp_get_thread_num()) * l.slot_bytes;
    bf16* abuf = reinterpret_cast<bf16*>(slot);
    bf16* bbuf = reinterpret_cast<bf16*>(slot + l.slot_a);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nitems; ++item) {
      int64_t j, local;
      locate(s, E, item, j, local);
      const int64_t e = s.perm[j];
      const int64_t mi = local / ntn, ni = local % ntn;
      const int64_t k0 = mi * plan.mt, n0 = ni * plan.nt, m = counts[e], row0 = s.off[e];
      Tile t;
      t.rows = std::min(plan.mt, K - k0);
      t.cols = std::min(plan.nt, N - n0);
      t.C = dW + e * K * N + k0 * N + n0;
      t.ldc = N;
      if (wpack) {  // chunks of wmc tokens: X_e^T packed into 6-row micro-panels, the sum carried through C
        float* ab = thread_scratch(size_t(round_up(t.rows, gg::kMR) * std::min(wmc, std::max<int64_t>(m, 1))));
        int64_t r = 0;
        do {  // an empty expert runs once with 0 steps (writes zeros)
          const int64_t nr = std::min(wmc, m - r);
          if (nr > 0) gg::pack_at_f32_avx2(ab, static_cast<const float*>(X) + (row0 + r) * K + k0, K, t.rows, K - k0, nr);
          t.A = ab;
          t.a_bs = gg::kMR * nr;
          t.a_rs = 1;
          t.a_ss = gg::kMR;
          t.B = static_cast<const float*>(dY) + (row0 + r) * N + n0;
          t.b_ps = kPanel;
          t.b_ss = N;
          t.steps = nr;
          t.accumulate = accumulate || r > 0;
          fn(t);
          r += nr;
        } while (r < m);
        continue;
      }
      if (!bf) {
        t.A = static_cast<const float*>(X) + row0 * K + k0;
        t.a_bs = gg::kMR;
        t.a_rs = 1;
        t.a_ss = K;
        t.B = static_cast<const float*>(dY) + row0 * N + n0;
        t.b_ps = kPanel;
        t.b_ss = N;
        t.steps = m;
        t.accumulate = accumulate;
        fn(t);
        continue;
      }
      int64_t r = 0;
      do {  // chunks of 2*mc tokens; an empty expert runs once with 0 steps (writes zeros)
        const int64_t nr = std::min(2 * mc, m - r), hp = ceil_div(nr, 2);
        const bf16* xr = static_cast<const bf16*>(X) + (row0 + r) * K + k0;
        const bf16* yr = static_cast<const bf16*>(dY) + (row0 + r) * N;
        if (nr > 0) {
          if (amx)
            gg::pack_xt_pairs_amx(abuf, 2 * hp, xr, K, nr, t.rows);
          else
            pack_pairs(abuf, hp * 2 * kPanel, xr, K, nr, t.rows);
          pack_pairs(bbuf, hp * 2 * kPanel, yr, N, nr, N);
        }
        t.A = abuf;
        t.a_rb = amx ? 1 : kPanel;
        t.a_bs = amx ? 2 * hp : hp * 2 * kPanel;
        t.a_rs = amx ? 2 * hp : 2;
        t.a_ss = amx ? 2 : 2 * kPanel;
        t.B = bbuf;
        t.b_ps = hp * 2 * kPanel;
        t.b_ss = 2 * kPanel;
        t.steps = hp;
        t.accumulate = accumulate || r > 0;
        // Overlap the next chunk's DRAM reads with this chunk's arithmetic: prefetch its rows of X and dY
        // (the next chunk of this item, else the first chunk of the next item in schedule order, which this
        // or the other thread will take; either way it comes from cache, not DRAM).
        t.pf_bytes[0] = t.pf_bytes[1] = 0;
        if (gg::tuning().prefetch) {
          int64_t pe = e, pr = r + nr, pk0 = k0, pm = m;
          if (pr >= m && item + 1 < nitems) {
            int64_t pj, pl;
            locate(s, E, item + 1, pj, pl);
            pe = s.perm[pj], pr = 0, pk0 = (pl / ntn) * plan.mt, pm = counts[pe];
          }
          const int64_t pn = std::min(2 * mc, pm - pr);
          if (pr < pm && pn > 0) {
            const int64_t prow = s.off[pe] + pr, pcols = std::min(plan.mt, K - pk0);
            t.pf[0] = reinterpret_cast<const char*>(static_cast<const bf16*>(X) + prow * K + pk0);
            t.pf_bytes[0] = ((pn - 1) * K + pcols) * int64_t(sizeof(bf16));
            t.pf[1] = reinterpret_cast<const char*>(static_cast<const bf16*>(dY) + prow * N);
            t.pf_bytes[1] = pn * N * int64_t(sizeof(bf16));
          }
        }
        fn(t);
        r += nr;
      } while (r < m);
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
  return grouped_packed_size(kind, prec, E, K, N);
}

GroupedPackedWeights grouped_pack_weights(void* data, const float* W, int64_t E, int64_t K, int64_t N, GemmPrec prec,
                                          GroupedPackKind kind, int64_t e0, int64_t e1) {
  const size_t bytes = grouped_packed_bytes(kind, prec, E, K, N);
  MT_CHECK((data && W) || bytes == 0, "grouped_pack_weights", "null data or W");
  MT_CHECK(reinterpret_cast<uintptr_t>(data) % 64 == 0, "grouped_pack_weights", "data ", data,
           " is not 64-byte aligned");
  if (e1 < 0) e1 = E;
  MT_CHECK(0 <= e0 && e0 <= e1 && e1 <= E, "grouped_pack_weights", "expert range [", e0, ", ", e1,
           ") is not within [0, ", E, "]");
  const PackGeom g = pack_geom(kind, prec, K, N);
  const bool fwd = kind == GroupedPackKind::Fwd;
  const bool avx512 = active_isa() == Isa::Avx512;
  const int64_t items = (e1 - e0) * g.npanels;
#pragma omp parallel for schedule(static) if (items > 1 && (e1 - e0) * K * N > 65536)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t e = e0 + it / g.npanels, p = it % g.npanels;
    const float* We = W + e * K * N;
    const int64_t c0 = p * kPanel, pc = std::min(kPanel, g.Nc - c0);
    // B(k, c) = W_e[k][c0 + c] (Fwd) or W_e[c0 + c][k] (Dgrad); zero outside [0, Kc) x [0, pc).
    auto b = [&](int64_t k, int64_t c) -> float {
      if (k >= g.Kc || c >= pc) return 0.0f;
      return fwd ? We[k * N + c0 + c] : We[(c0 + c) * N + k];
    };
    if (prec == GemmPrec::BF16) {
      bf16* out = static_cast<bf16*>(data) + e * g.expert_elems + p * g.panel_elems;
      if (avx512) {
        gg::pack_weight_panel_bf16_avx512(out, We, K, N, fwd, c0, pc, g.steps);
      } else if (fwd) {
        for (int64_t s = 0; s < g.steps; ++s)
          for (int64_t c = 0; c < kPanel; ++c) {
            out[(s * kPanel + c) * 2 + 0] = to_bf16(b(2 * s, c));
            out[(s * kPanel + c) * 2 + 1] = to_bf16(b(2 * s + 1, c));
          }
      } else {  // read rows of W_e (c fixed) contiguously
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t k = 0; k < 2 * g.steps; ++k) out[((k / 2) * kPanel + c) * 2 + (k & 1)] = to_bf16(b(k, c));
      }
    } else {
      float* out = static_cast<float*>(data) + e * g.expert_elems + p * g.panel_elems;
      if (fwd) {
        for (int64_t s = 0; s < g.steps; ++s)
          for (int64_t c = 0; c < kPanel; ++c) out[s * kPanel + c] = b(s, c);
      } else if (active_isa() != Isa::Scalar) {  // W_e^T panel: an 8 x 8 transposing copy
        gg::pack_bt_panel_f32_avx2(out, We + c0 * N, N, g.steps, pc, kPanel);
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

size_t grouped_gemm_workspace_bytes(GroupedOp op, GemmPrec prec, int64_t E, int64_t M, int64_t K, int64_t N,
                                    int threads) {
  MT_CHECK(E >= 0 && M >= 0 && K >= 0 && N >= 0, "grouped_gemm", "negative size E=", E, " M=", M, " K=", K, " N=", N);
  const gg::Tuning& tu = gg::tuning();
  return grouped_workspace_size(op, prec, E, K, N, threads > 0 ? threads : num_threads(), tu.wmt, tu.wmc);
}

void grouped_gemm_fwd(float* Y, bf16* Y_bf16, const bf16* X, const GroupedPackedWeights& W, const int32_t* counts,
                      int64_t E, int64_t M, int64_t K, int64_t N, void* ws, size_t ws_bytes) {
  run_mgrouped("grouped_gemm_fwd", GemmPrec::BF16, Y, Y_bf16, X, W, GroupedPackKind::Fwd, counts, E, M, K, N, ws,
               ws_bytes);
}
void grouped_gemm_fwd(float* Y, const float* X, const GroupedPackedWeights& W, const int32_t* counts, int64_t E,
                      int64_t M, int64_t K, int64_t N, void* ws, size_t ws_bytes) {
  run_mgrouped("grouped_gemm_fwd", GemmPrec::F32, Y, nullptr, X, W, GroupedPackKind::Fwd, counts, E, M, K, N, ws,
               ws_bytes);
}
void grouped_gemm_dgrad(float* dX, bf16* dX_bf16, const bf16* dY, const GroupedPackedWeights& Wt, const int32_t* counts,
                        int64_t E, int64_t M, int64_t K, int64_t N, void* ws, size_t ws_bytes) {
  run_mgrouped("grouped_gemm_dgrad", GemmPrec::BF16, dX, dX_bf16, dY, Wt, GroupedPackKind::Dgrad, counts, E, M, K, N,
               ws, ws_bytes);
}
void grouped_gemm_dgrad(float* dX, const float* dY, const GroupedPackedWeights& Wt, const int32_t* counts, int64_t E,
                        int64_t M, int64_t K, int64_t N, void* ws, size_t ws_bytes) {
  run_mgrouped("grouped_gemm_dgrad", GemmPrec::F32, dX, nullptr, dY, Wt, GroupedPackKind::Dgrad, counts, E, M, K, N, ws,
               ws_bytes);
}
void grouped_gemm_wgrad(float* dW, const bf16* X, const bf16* dY, const int32_t* counts, int64_t E, int64_t M,
                        int64_t K, int64_t N, bool accumulate, void* ws, size_t ws_bytes) {
  run_wgrad("grouped_gemm_wgrad", GemmPrec::BF16, dW, X, dY, counts, E, M, K, N, accumulate, ws, ws_bytes);
}
void grouped_gemm_wgrad(float* dW, const float* X, const float* dY, const int32_t* counts, int64_t E, int64_t M,
                        int64_t K, int64_t N, bool accumulate, void* ws, size_t ws_bytes) {
  run_wgrad("grouped_gemm_wgrad", GemmPrec::F32, dW, X, dY, counts, E, M, K, N, accumulate, ws, ws_bytes);
}

}  // namespace moetron
