// router.cpp: the MoE router kernels (forward: scores, group-limited top-k, weights, counts, aux and z
// losses; backward: dlogits through the weights, the aux loss, the score function and the z-loss), and the
// balancing helpers. Semantics and formulas: include/moetron/router.h. Not the gate GEMM, not dispatch.
//
// Parallel over tokens (one OpenMP region per call); each token's outputs depend only on its own logits.
// The only cross-token quantities (counts, the loss values, per-sequence counts for the aux loss) are integer
// histograms or fp64 sums taken in token order after the parallel part, so results never depend on the
// thread count. With AVX-512 (AVX2) the score rows, the selection and the z-loss rows go through
// router_avx512.cpp (router_avx2.cpp);
// the portable path below performs the same operations as router_forward_ref<float> (bitwise equal scores).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "moetron/check.h"
#include "moetron/router.h"
#include "router_topk.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

// router_avx512.cpp
void router_scores_row_avx512(float* s, const float* l, int E, bool softmax);
bool router_select_row_avx512(int32_t* idx, float* val, const float* s, const float* bias, int E, int k,
                              int n_group, int topk_group, bool top2sum);
float router_lse_row_avx512(const float* l, int E);
bool router_capacity_pick_avx512(int32_t* idx, const float* q, int32_t* counts, int64_t C, int E, int k);
void router_zgrad_row_avx512(float* dl, const float* l, int E, float coef);
// router_avx2.cpp (the same signatures)
void router_scores_row_avx2(float* s, const float* l, int E, bool softmax);
bool router_select_row_avx2(int32_t* idx, float* val, const float* s, const float* bias, int E, int k,
                            int n_group, int topk_group, bool top2sum);
float router_lse_row_avx2(const float* l, int E);
void router_zgrad_row_avx2(float* dl, const float* l, int E, float coef);

namespace {

constexpr float kNormEps = 1e-20f;

size_t align_up(size_t b) { return (b + 63) & ~size_t(63); }

int64_t aux_seq_len(const RouterConfig& cfg, int64_t N) { return cfg.aux == AuxMode::SeqWise ? cfg.seq_len : N; }
int64_t aux_nseq(const RouterConfig& cfg, int64_t N) {
  return cfg.aux == AuxMode::None || N == 0 ? 0 : N / aux_seq_len(cfg, N);
}
// Balanced routing over a micro-batch split across ranks: the whole score matrix is gathered (router.h).
bool whole_split(const RouterConfig& cfg) { return cfg.split > 1 && (cfg.sinkhorn_iters > 0 || cfg.capacity > 0); }
size_t split_ws_bytes(int64_t Nw, int E, int k) {  // gath, whole, wr, widx, ww, wcnt (carve)
  return 2 * align_up(size_t(Nw) * size_t(E) * sizeof(float)) + align_up(size_t(Nw) * sizeof(double)) +
         2 * align_up(size_t(Nw) * size_t(k) * 4) + align_up(size_t(E) * sizeof(int32_t));
}

struct Ws {
  double* tok_a;    // [N] per-token aux partial: sum_e c_e * s'_{n,e}; Sinkhorn: the row factors r
  double* tok_z;    // [N] per-token lse^2
  int32_t* cnt;     // [S, E] per-sequence (or global, S = 1) counts for the aux loss
  double* sk_c;     // [E] Sinkhorn column factors (sinkhorn_iters > 0)
  float* sk_cf;     // [E] the same in fp32 (the selection multiplies by these)
  // whole_split only, Nw = N * split rows of the micro-batch:
  float* gath;      // [Nw, E] the ranks' score rows in rank order (gather_rows)
  float* whole;     // [Nw, E] the same in the micro-batch's global order
  double* wr;       // [Nw] Sinkhorn row factors
  int32_t* widx;    // [Nw, k] capacity routing of the whole micro-batch
  float* ww;        // [Nw, k]
  int32_t* wcnt;    // [E]
};
Ws carve(void* ws, const RouterConfig& cfg, int64_t N) {
  char* p = static_cast<char*>(ws);
  Ws w;
  w.tok_a = reinterpret_cast<double*>(p);
  p += align_up(size_t(N) * sizeof(double));
  w.tok_z = reinterpret_cast<double*>(p);
  p += align_up(size_t(N) * sizeof(double));
  w.cnt = reinterpret_cast<int32_t*>(p);
  p += align_up(size_t(std::max<int64_t>(aux_nseq(cfg, N), 1)) * size_t(cfg.E) * sizeof(int32_t));
  w.sk_c = reinterpret_cast<double*>(p);
  p += align_up(size_t(cfg.E) * sizeof(double));
  w.sk_cf = reinterpret_cast<float*>(p);
  p += align_up(size_t(cfg.E) * sizeof(float));
  if (whole_split(cfg)) {
    const size_t Nw = size_t(N) * size_t(cfg.split), E = size_t(cfg.E), k = size_t(cfg.topk);
    w.gath = reinterpret_cast<float*>(p), p += align_up(Nw * E * sizeof(float));
    w.whole = reinterpret_cast<float*>(p), p += align_up(Nw * E * sizeof(float));
    w.wr = reinterpret_cast<double*>(p), p += align_up(Nw * sizeof(double));
    w.widx = reinterpret_cast<int32_t*>(p), p += align_up(Nw * k * sizeof(int32_t));
    w.ww = reinterpret_cast<float*>(p), p += align_up(Nw * k * sizeof(float));
    w.wcnt = reinterpret_cast<int32_t*>(p);
  } else {
    w.gath = w.whole = w.ww = nullptr, w.wr = nullptr, w.widx = w.wcnt = nullptr;
  }
  return w;
}

// Scalar score row, the same operations in the same order as router_scores_ref<float>.
void scores_row_scalar(float* s, const float* l, int E, bool softmax) {
  if (softmax) {
    float m = l[0];
    for (int e = 1; e < E; ++e) m = std::max(m, l[e]);
    float z = 0;
    for (int e = 0; e < E; ++e) {
      s[e] = std::exp(l[e] - m);
      z += s[e];
    }
    for (int e = 0; e < E; ++e) s[e] = s[e] / z;
  } else {
    for (int e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-l[e]));
  }
}

// Row reductions with 8 interleaved partial sums combined in a fixed tree: deterministic, and free of the
// 64-long add-latency chain of a sequential sum (the compiler vectorizes the 8 lanes).
float sum8(const float* x, int n) {
  float p[8] = {};
  int e = 0;
  for (; e + 8 <= n; e += 8)
    for (int j = 0; j < 8; ++j) p[j] += x[e + j];
  for (int j = 0; e < n; ++e, ++j) p[j] += x[e];
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}
float dot8(const float* a, const float* b, int n) {
  float p[8] = {};
  int e = 0;
  for (; e + 8 <= n; e += 8)
    for (int j = 0; j < 8; ++j) p[j] += a[e + j] * b[e + j];
  for (int j = 0; e < n; ++e, ++j) p[j] += a[e] * b[e];
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}
// sum_e c_e * s_e in fp64 (counts are exact; 4 partial sums).
double dot_counts(const int32_t* c, const float* s, int n) {
  double p[4] = {};
  int e = 0;
  for (; e + 4 <= n; e += 4)
    for (int j = 0; j < 4; ++j) p[j] += double(c[e + j]) * double(s[e + j]);
  for (int j = 0; e < n; ++e, ++j) p[j] += double(c[e]) * double(s[e]);
  return (p[0] + p[1]) + (p[2] + p[3]);
}
// sum_e c_e * s_e in fp32 (counts < 2^24 are exact in fp32).
float dot_counts_f(const int32_t* c, const float* s, int n) {
  float p[8] = {};
  int e = 0;
  for (; e + 8 <= n; e += 8)
    for (int j = 0; j < 8; ++j) p[j] += float(c[e + j]) * s[e + j];
  for (int j = 0; e < n; ++e, ++j) p[j] += float(c[e]) * s[e];
  return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
}

// Group-limited top-k of one token. idx/val: [k] outputs in slot order (val = selection score q).
void select_row(int32_t* idx, float* val, const float* s, const float* bias, const RouterConfig& cfg) {
  const int E = cfg.E, k = cfg.topk;
  int cnt = 0;
  if (cfg.n_group <= 1) {
    if (bias)
      for (int e = 0; e < E; ++e) topk_insert(val, idx, cnt, k, s[e] + bias[e], e);
    else
      for (int e = 0; e < E; ++e) topk_insert(val, idx, cnt, k, s[e] + 0.0f, e);
    return;
  }
  const int ng = cfg.n_group, G = E / ng;
  float gval[kRouterMaxGroups];
  int32_t gidx[kRouterMaxGroups];
  int gcnt = 0;
  for (int g = 0; g < ng; ++g) {
    float t1 = -INFINITY, t2 = -INFINITY;
    for (int e = g * G; e < (g + 1) * G; ++e) {
      const float q = s[e] + (bias ? bias[e] : 0.0f);
      t2 = std::max(t2, std::min(t1, q));  // the two largest values, with multiplicity
      t1 = std::max(t1, q);
    }
    float gs = cfg.group_score == GroupScore::Max || G < 2 ? t1 : t1 + t2;
    topk_insert(gval, gidx, gcnt, cfg.topk_group, gs, g);
  }
  // Visit the chosen groups in increasing group index so that experts arrive in increasing index.
  bool chosen[kRouterMaxGroups] = {};
  for (int r = 0; r < gcnt; ++r) chosen[gidx[r]] = true;
  for (int g = 0; g < ng; ++g) {
    if (!chosen[g]) continue;
    for (int e = g * G; e < (g + 1) * G; ++e) topk_insert(val, idx, cnt, k, s[e] + (bias ? bias[e] : 0.0f), e);
  }
}

// The combine weights of a token's chosen experts, from its raw scores s.
void capacity_weights(float* w, const int32_t* idx, const float* s, const RouterConfig& cfg) {
  float sum = 0;
  for (int j = 0; j < cfg.topk; ++j) sum += s[idx[j]];
  for (int j = 0; j < cfg.topk; ++j) w[j] = cfg.route_scale * (cfg.norm_topk ? s[idx[j]] / (sum + kNormEps) : s[idx[j]]);
}

// Capacity routing (router.h): tokens in order take their top-k among the experts below C assignments; rewrites
// topk_idx, topk_w and counts. q: the selection row s (* Sinkhorn factors) + bias.
void capacity_route(int32_t* topk_idx, float* topk_w, int32_t* counts, const float* scores, const float* skc,
                    const float* bias, const RouterConfig& cfg, int64_t N) {
  const int E = cfg.E, k = cfg.topk;
  const bool avx512 = active_isa() == Isa::Avx512;  // the pick on 16 lanes (router_capacity_pick_avx512), same choices
  const int64_t C = int64_t(std::ceil(double(cfg.capacity) * double(N) * k / E - 1e-9));
  std::memset(counts, 0, sizeof(int32_t) * size_t(E));
  std::vector<float> q(static_cast<size_t>(E));
  std::vector<char> used(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    const float* s = scores + n * E;
    for (int e = 0; e < E; ++e) q[size_t(e)] = (skc ? s[e] * skc[e] : s[e]) + (bias ? bias[e] : 0.0f);
    int32_t* idx = topk_idx + n * k;
    if (avx512 && router_capacity_pick_avx512(idx, q.data(), counts, C, E, k)) {
      capacity_weights(topk_w + n * k, idx, s, cfg);
      continue;
    }
    std::fill(used.begin(), used.end(), 0);
    for (int j = 0; j < k; ++j) {  // the largest available q, ties to the lower index
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (!used[size_t(e)] && counts[e] < C && (best < 0 || q[size_t(e)] > q[size_t(best)])) best = e;
      // Fewer than k experts with room (possible only when capacity < E / (E - k + 1)): the best unused one.
      if (best < 0)
        for (int e = 0; e < E; ++e)
          if (!used[size_t(e)] && (best < 0 || q[size_t(e)] > q[size_t(best)])) best = e;
      idx[j] = best, used[size_t(best)] = 1, ++counts[best];
    }
    capacity_weights(topk_w + n * k, idx, s, cfg);
  }
}

// Balanced routing's first pass: the score rows (the main loop writes them again, bitwise the same); with split > 1
// the micro-batch's rows of every rank in its global token order (w.whole); the Sinkhorn factors over the call's
// (or the whole micro-batch's) tokens. Returns the fp32 factors, or null without Sinkhorn.
const float* balance_prepass(const Ws& w, float* scores, const float* logits, const RouterConfig& cfg, int64_t N) {
  const bool split = whole_split(cfg);
  if (cfg.sinkhorn_iters == 0 && !split) return nullptr;
  const int E = cfg.E;
  const bool softmax = cfg.score == ScoreFn::Softmax, avx512 = active_isa() == Isa::Avx512,
             avx2 = active_isa() == Isa::Avx2;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits + n * E;
    float* s = scores + n * E;
    bool finite = true;
    for (int e = 0; e < E; ++e) finite &= std::isfinite(l[e]);
    if (!finite) for (int e = 0; e < E; ++e) s[e] = 0;
    else if (avx512) router_scores_row_avx512(s, l, E, softmax);
    else if (avx2) router_scores_row_avx2(s, l, E, softmax);
    else scores_row_scalar(s, l, E, softmax);
  }
  const int64_t Nw = split ? N * cfg.split : N;
  if (split) {  // the micro-batch's score rows from every rank, put in its global token order
    cfg.gather_rows(w.gath, scores, N * E);
    for (int64_t g = 0; g < Nw; ++g)
      std::memcpy(w.whole + cfg.split_rows[size_t(g)] * E, w.gath + g * E, sizeof(float) * size_t(E));
  }
  if (cfg.sinkhorn_iters == 0) return nullptr;
  router_sinkhorn_factors(w.sk_c, split ? w.whole : scores, Nw, E, cfg.sinkhorn_iters, split ? w.wr : w.tok_a);
  for (int e = 0; e < E; ++e) w.sk_cf[e] = float(w.sk_c[e]);
  return w.sk_cf;
}

// Capacity routing of the whole micro-batch (split > 1, w.whole from balance_prepass); this rank keeps its rows'
// experts and weights and counts their assignments.
void capacity_route_split(int32_t* topk_idx, float* topk_w, int32_t* counts, const Ws& w, const float* skc,
                          const float* bias, const RouterConfig& cfg, int64_t N) {
  const int E = cfg.E, k = cfg.topk;
  capacity_route(w.widx, w.ww, w.wcnt, w.whole, skc, bias, cfg, N * cfg.split);
  const int64_t base = int64_t(cfg.split_rank) * N;
  std::memset(counts, 0, sizeof(int32_t) * size_t(E));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = cfg.split_rows[size_t(base + n)];
    for (int j = 0; j < k; ++j) {
      topk_idx[n * k + j] = w.widx[g * k + j], topk_w[n * k + j] = w.ww[g * k + j];
      ++counts[topk_idx[n * k + j]];
    }
  }
}

void check_ptrs(const char* op, const RouterConfig& cfg, int64_t N, void* ws, std::initializer_list<const void*> ps) {
  router_validate(cfg, N);
  if (N == 0) return;
  for (const void* p : ps) MT_CHECK(p != nullptr, op, "null array argument (N=", N, ")");
  MT_CHECK(ws != nullptr, op, "null workspace (need ", router_workspace_bytes(cfg, N), " bytes)");
}

}  // namespace

void router_validate(const RouterConfig& c, int64_t N) {
  const char* op = "router";
  MT_CHECK(N >= 0, op, "negative token count N=", N);
  MT_CHECK(c.E >= 1, op, "E=", c.E, " must be >= 1");
  MT_CHECK(c.topk >= 1 && c.topk <= c.E, op, "topk=", c.topk, " must be in [1, E=", c.E, "]");
  MT_CHECK(c.n_group >= 1 && c.n_group <= kRouterMaxGroups, op, "n_group=", c.n_group, " must be in [1, ",
           kRouterMaxGroups, "]");
  MT_CHECK(c.E % c.n_group == 0, op, "E=", c.E, " is not divisible by n_group=", c.n_group);
  MT_CHECK(c.topk_group >= 1 && c.topk_group <= c.n_group, op, "topk_group=", c.topk_group,
           " must be in [1, n_group=", c.n_group, "]");
  MT_CHECK(int64_t(c.topk) <= int64_t(c.topk_group) * (c.E / c.n_group), op, "topk=", c.topk,
           " exceeds the experts in the kept groups: topk_group=", c.topk_group, " * group size ", c.E / c.n_group);
  MT_CHECK(std::isfinite(c.route_scale) && c.route_scale > 0, op, "route_scale=", c.route_scale, " must be > 0");
  MT_CHECK(std::isfinite(c.aux_coef) && c.aux_coef >= 0, op, "aux_coef=", c.aux_coef, " must be >= 0");
  MT_CHECK(c.split >= 1, op, "split=", c.split, " must be >= 1");
  MT_CHECK(c.split == 1 || c.aux == AuxMode::None || c.sum_counts, op, "split=", c.split,
           " needs sum_counts (the aux loss's counts over the ranks holding the sequence)");
  MT_CHECK(c.capacity == 0 || (std::isfinite(c.capacity) && c.capacity >= 1), op, "capacity=", c.capacity,
           " must be 0 (off) or >= 1");
  MT_CHECK(c.capacity == 0 || c.n_group == 1, op, "capacity=", c.capacity, " needs no group limit (n_group=",
           c.n_group, ")");
  MT_CHECK(c.sinkhorn_iters >= 0, op, "sinkhorn_iters=", c.sinkhorn_iters, " must be >= 0");
  if (whole_split(c)) {  // the whole micro-batch's selection: its score rows gathered and put in global order
    const int64_t Nw = N * c.split;
    MT_CHECK(c.gather_rows != nullptr, op, "split=", c.split, " with sinkhorn_iters=", c.sinkhorn_iters,
             " / capacity=", c.capacity, " needs gather_rows (the micro-batch's score rows from every rank)");
    MT_CHECK(c.split_rank >= 0 && c.split_rank < c.split, op, "split_rank=", c.split_rank, " outside [0, split=",
             c.split, ")");
    MT_CHECK(int64_t(c.split_rows.size()) == Nw, op, "split_rows has ", c.split_rows.size(),
             " entries, need N * split = ", Nw);
    std::vector<char> seen(size_t(Nw), 0);
    for (int64_t g = 0; g < Nw; ++g) {
      const int64_t r = c.split_rows[size_t(g)];
      MT_CHECK(r >= 0 && r < Nw && !seen[size_t(r)], op, "split_rows[", g, "]=", r,
               " is not a permutation of 0 .. N * split - 1 = ", Nw - 1);
      seen[size_t(r)] = 1;
    }
  }
  MT_CHECK(std::isfinite(c.z_coef) && c.z_coef >= 0, op, "z_coef=", c.z_coef, " must be >= 0");
  if (c.aux == AuxMode::SeqWise) {
    MT_CHECK(c.seq_len > 0, op, "AuxMode::SeqWise needs seq_len > 0, got ", c.seq_len);
    MT_CHECK(N % c.seq_len == 0, op, "N=", N, " is not a multiple of seq_len=", c.seq_len);
  }
}

size_t router_workspace_bytes(const RouterConfig& cfg, int64_t N) {
  int64_t S = std::max<int64_t>(aux_nseq(cfg, N), 1);
  return align_up(size_t(N) * sizeof(double))      // tok_a
         + align_up(size_t(N) * sizeof(double))    // tok_z
         + align_up(size_t(S) * size_t(cfg.E) * sizeof(int32_t))  // cnt
         + (cfg.sinkhorn_iters > 0 ? align_up(size_t(cfg.E) * sizeof(double)) + align_up(size_t(cfg.E) * sizeof(float))
                                   : 0)  // sk_c, sk_cf
         + (whole_split(cfg) ? (cfg.sinkhorn_iters > 0 ? 0 : align_up(size_t(cfg.E) * sizeof(double)) +
                                                             align_up(size_t(cfg.E) * sizeof(float))) +
                                   split_ws_bytes(N * cfg.split, cfg.E, cfg.topk)
                             : 0);
}

void router_sinkhorn_factors(double* c, const float* s, int64_t N, int E, int iters, void* ws) {
  MT_CHECK(c && E >= 1 && N >= 0 && iters >= 0 && (N == 0 || (s && ws)), "router_sinkhorn_factors", "E=", E, " N=", N,
           " iters=", iters);
  double* r = static_cast<double*>(ws);  // [N] row factors
  for (int e = 0; e < E; ++e) c[e] = 1.0;
  if (N == 0) return;
  std::vector<double> col(static_cast<size_t>(E));
  for (int it = 0; it < iters; ++it) {
    for (int64_t n = 0; n < N; ++n) {
      const float* row = s + n * E;
      double t = 0;
      for (int e = 0; e < E; ++e) t += double(row[e]) * c[e];
      r[n] = t > 0 ? 1.0 / t : 0.0;
    }
    std::fill(col.begin(), col.end(), 0.0);
    for (int64_t n = 0; n < N; ++n) {  // token order: the sums do not depend on the thread count
      const float* row = s + n * E;
      for (int e = 0; e < E; ++e) col[size_t(e)] += double(row[e]) * r[n];
    }
    for (int e = 0; e < E; ++e) c[e] = col[size_t(e)] > 0 ? (double(N) / E) / col[size_t(e)] : 1.0;
  }
  double mean = 0;
  for (int e = 0; e < E; ++e) mean += c[e];
  mean /= E;
  for (int e = 0; e < E; ++e) c[e] /= mean;
}

void router_forward(int32_t* topk_idx, float* topk_w, int32_t* counts, float* scores, RouterLosses* losses,
                    const float* logits, const float* bias, const RouterConfig& cfg, int64_t N, void* ws) {
  const char* op = "router_forward";
  check_ptrs(op, cfg, N, ws, {topk_idx, topk_w, scores, logits});
  MT_CHECK(counts != nullptr, op, "null counts");
  const int E = cfg.E, k = cfg.topk;
  if (bias)
    for (int e = 0; e < E; ++e) MT_CHECK(std::isfinite(bias[e]), op, "non-finite bias[", e, "]=", bias[e]);
  if (losses) *losses = RouterLosses{};
  std::memset(counts, 0, sizeof(int32_t) * size_t(E));
  if (N == 0) return;
  // Scores (exp and normalization), selection and the loss statistics: about 6 flops per logit; logits read,
  // scores written, the top-k indices and weights.
  MT_TRACE_COST(6.0 * double(N * E), 8.0 * double(N * E) + 8.0 * double(N * k));

  Ws w = carve(ws, cfg, N);
  const bool want_aux = losses && cfg.aux != AuxMode::None;
  const bool want_z = losses && cfg.z_coef > 0;
  const bool softmax = cfg.score == ScoreFn::Softmax;
  const bool avx512 = active_isa() == Isa::Avx512, avx2 = active_isa() == Isa::Avx2;
  const int64_t T = aux_seq_len(cfg, N), S = aux_nseq(cfg, N);
  int64_t bad_row = -1;
  const bool split = whole_split(cfg);
  const float* skc = balance_prepass(w, scores, logits, cfg, N);  // Sinkhorn column factors, or null

  // The aux loss's counts of sequence b (SeqWise) or of the micro-batch (Global), from the selection.
  auto aux_counts = [&](int64_t b) {
    int32_t* c = w.cnt + b * E;
    if (cfg.aux == AuxMode::Global) {
      std::memcpy(c, counts, sizeof(int32_t) * size_t(E));
    } else {
      std::memset(c, 0, sizeof(int32_t) * size_t(E));
      for (int64_t i = b * T * k; i < (b + 1) * T * k; ++i) ++c[topk_idx[i]];
    }
  };
#pragma omp parallel
  {
    int64_t my_bad = -1;
    std::vector<float> qrow(skc ? size_t(E) : 0);  // Sinkhorn: the selection row s * c
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* l = logits + n * E;
      float* s = scores + n * E;
      float lmax = l[0];
      bool finite = true;
      for (int e = 0; e < E; ++e) {
        finite &= std::isfinite(l[e]);
        lmax = std::max(lmax, l[e]);
      }
      if (!finite) {
        if (my_bad < 0) my_bad = n;
        for (int e = 0; e < E; ++e) s[e] = 0;
      } else if (avx512) {
        router_scores_row_avx512(s, l, E, softmax);
      } else if (avx2) {
        router_scores_row_avx2(s, l, E, softmax);
      } else {
        scores_row_scalar(s, l, E, softmax);
      }
      int32_t* idx = topk_idx + n * k;
      float* wt = topk_w + n * k;
      const float* sel = s;
      if (skc) {
        for (int e = 0; e < E; ++e) qrow[size_t(e)] = s[e] * skc[e];
        sel = qrow.data();
      }
      const bool top2 = cfg.group_score == GroupScore::Top2Sum;
      if (!(avx512 && router_select_row_avx512(idx, wt, sel, bias, E, k, cfg.n_group, cfg.topk_group, top2)) &&
          !(avx2 && router_select_row_avx2(idx, wt, sel, bias, E, k, cfg.n_group, cfg.topk_group, top2)))
        select_row(idx, wt, sel, bias, cfg);
      float sum = 0;
      for (int j = 0; j < k; ++j) sum += s[idx[j]];
      for (int j = 0; j < k; ++j)
        wt[j] = cfg.route_scale * (cfg.norm_topk ? s[idx[j]] / (sum + kNormEps) : s[idx[j]]);
      if (want_z && (avx512 || avx2) && finite) {
        const double lse = avx512 ? router_lse_row_avx512(l, E) : router_lse_row_avx2(l, E);
        w.tok_z[n] = lse * lse;
      } else if (want_z) {
        double z = 0;
        for (int e = 0; e < E; ++e) z += std::exp(double(l[e]) - double(lmax));
        double lse = double(lmax) + std::log(z);
        w.tok_z[n] = lse * lse;
      }
    }
#pragma omp critical(router_forward_bad)
    if (my_bad >= 0 && (bad_row < 0 || my_bad < bad_row)) bad_row = my_bad;

#pragma omp single
    for (int64_t i = 0; i < N * k; ++i) ++counts[topk_idx[i]];
    // (implicit barrier: counts are complete)

    if (want_aux) {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < S; ++b) aux_counts(b);
    }
  }
  MT_CHECK(bad_row < 0, op, "non-finite logits in token ", bad_row);
  if (cfg.capacity > 0) {  // the selection again, in token order under the capacity; then the aux loss's counts
    if (split) capacity_route_split(topk_idx, topk_w, counts, w, skc, bias, cfg, N);
    else capacity_route(topk_idx, topk_w, counts, scores, skc, bias, cfg, N);
    if (want_aux)
      for (int64_t b = 0; b < S; ++b) aux_counts(b);
  }
  if (want_aux && cfg.split > 1) cfg.sum_counts(w.cnt, S * E);  // the whole sequences' counts (exact: integers)
  if (want_aux) {
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        const int32_t* c = w.cnt + (n / T) * E;
        const float* s = scores + n * E;
        // softmax: sum_e c_e s_e; sigmoid: sum_e c_e s_e / (sum_e s_e + 1e-20)
        const double a = dot_counts(c, s, E);
        w.tok_a[n] = softmax ? a : a / double(sum8(s, E) + kNormEps);
      }
  }
  const double Tt = double(T) * cfg.split, Nt = double(N) * cfg.split;  // tokens of the whole sequence / batch
  if (want_aux) {
    double a = 0;
    for (int64_t n = 0; n < N; ++n) a += w.tok_a[n];
    // L = (1/S) sum_b aux_coef * E * sum_e (c_be / (T k)) * (1/T) sum_{n in b} s'_ne
    losses->aux = float(double(cfg.aux_coef) * E * a / (Tt * Tt * k * double(S)));
  }
  if (want_z) {
    double z = 0;
    for (int64_t n = 0; n < N; ++n) z += w.tok_z[n];
    losses->z = float(double(cfg.z_coef) * z / Nt);
  }
}

void router_backward(float* dlogits, const float* dtopk_w, const float* scores, const int32_t* topk_idx,
                     const float* logits, const RouterConfig& cfg, int64_t N, void* ws) {
  const char* op = "router_backward";
  check_ptrs(op, cfg, N, ws, {dlogits, dtopk_w, scores, topk_idx});
  MT_CHECK(cfg.z_coef == 0 || logits != nullptr || N == 0, op, "z_coef=", cfg.z_coef, " needs the logits");
  if (N == 0) return;
  const int E = cfg.E, k = cfg.topk;
  for (int64_t i = 0; i < N * k; ++i)
    MT_CHECK(topk_idx[i] >= 0 && topk_idx[i] < E, op, "topk_idx[", i, "]=", topk_idx[i], " outside [0, E=", E, ")");
  MT_TRACE_COST(6.0 * double(N * E), 12.0 * double(N * E) + 8.0 * double(N * k));  // scores, logits read; dlogits
  Ws w = carve(ws, cfg, N);
  const bool aux = cfg.aux != AuxMode::None;
  const bool softmax = cfg.score == ScoreFn::Softmax;
  const int64_t T = aux_seq_len(cfg, N), S = aux_nseq(cfg, N);
  // dL_aux/ds'_{n,e} = aux_coef * E * c_{b(n),e} / (T k) / (T S)  (T: the whole sequence's tokens)
  const double Tt = double(T) * cfg.split;
  const float aux_scale = aux ? float(double(cfg.aux_coef) * E / (Tt * Tt * k * double(S))) : 0.0f;
  const float rs = cfg.route_scale;
  const double zc = 2.0 * double(cfg.z_coef) / (double(N) * cfg.split);
  const bool avx512 = active_isa() == Isa::Avx512, avx2 = active_isa() == Isa::Avx2;

  if (aux) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < S; ++b) {
      int32_t* c = w.cnt + b * E;
      std::memset(c, 0, sizeof(int32_t) * size_t(E));
      for (int64_t i = b * T * k; i < (b + 1) * T * k; ++i) ++c[topk_idx[i]];
    }
    if (cfg.split > 1) cfg.sum_counts(w.cnt, S * E);
  }
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* s = scores + n * E;
      const int32_t* idx = topk_idx + n * k;
      const float* g = dtopk_w + n * k;
      float* ds = dlogits + n * E;  // ds (dL/ds) first, transformed in place into dL/dl
      // 1. weights
      if (aux && softmax) {
        const int32_t* c = w.cnt + (n / T) * E;
        for (int e = 0; e < E; ++e) ds[e] = aux_scale * float(c[e]);
      } else if (aux) {
        const int32_t* c = w.cnt + (n / T) * E;
        const float sum = sum8(s, E) + kNormEps;
        const float cs = aux_scale * dot_counts_f(c, s, E) / sum;
        for (int e = 0; e < E; ++e) ds[e] = (aux_scale * float(c[e]) - cs) / sum;
      } else {
        for (int e = 0; e < E; ++e) ds[e] = 0;
      }
      if (cfg.norm_topk) {
        // ds_i = rs / S * (g_i - sum_j g_j * (s_j / S)); with k = 1 the bracket is exactly 0, as it should be
        float Ssum = 0, off = 0;
        for (int j = 0; j < k; ++j) Ssum += s[idx[j]];
        Ssum += kNormEps;
        for (int j = 0; j < k; ++j) off += g[j] * (s[idx[j]] / Ssum);
        const float inv = rs / Ssum;
        for (int j = 0; j < k; ++j) ds[idx[j]] += inv * (g[j] - off);
      } else {
        for (int j = 0; j < k; ++j) ds[idx[j]] += rs * g[j];
      }
      // 3. score function
      if (softmax) {
        const float dot = dot8(ds, s, E);
        for (int e = 0; e < E; ++e) ds[e] = s[e] * (ds[e] - dot);
      } else {
        for (int e = 0; e < E; ++e) ds[e] = ds[e] * s[e] * (1.0f - s[e]);
      }
      // 4. z-loss
      if (cfg.z_coef > 0 && avx512) {
        router_zgrad_row_avx512(ds, logits + n * E, E, float(zc));
      } else if (cfg.z_coef > 0 && avx2) {
        router_zgrad_row_avx2(ds, logits + n * E, E, float(zc));
      } else if (cfg.z_coef > 0) {
        const float* l = logits + n * E;
        float m = l[0];
        for (int e = 1; e < E; ++e) m = std::max(m, l[e]);
        double z = 0;
        for (int e = 0; e < E; ++e) z += std::exp(double(l[e]) - double(m));
        const double lse = double(m) + std::log(z);
        const float f = float(zc * lse / z);
        for (int e = 0; e < E; ++e) ds[e] += f * std::exp(l[e] - m);
      }
    }
  }
}

template <class C>
static void update_bias_impl(float* bias, const C* counts, int E, float rate) {
  MT_CHECK(E >= 1 && bias && counts, "router_update_bias", "E=", E, " bias=", (const void*)bias, " counts=",
           (const void*)counts);
  int64_t total = 0;
  for (int e = 0; e < E; ++e) {
    MT_CHECK(counts[e] >= 0, "router_update_bias", "negative counts[", e, "]=", int64_t(counts[e]));
    total += counts[e];
  }
  // sign(mean - c) = sign(total - E * c): exact in integers.
  for (int e = 0; e < E; ++e) {
    int64_t d = total - int64_t(E) * int64_t(counts[e]);
    bias[e] += d > 0 ? rate : d < 0 ? -rate : 0.0f;
  }
}
void router_update_bias(float* bias, const int64_t* counts, int E, float rate) {
  update_bias_impl(bias, counts, E, rate);
}
void router_update_bias(float* bias, const int32_t* counts, int E, float rate) {
  update_bias_impl(bias, counts, E, rate);
}

void router_update_bias_proportional(float* bias, const int64_t* counts, int E, float rate) {
  MT_CHECK(E >= 1 && bias && counts, "router_update_bias_proportional", "E=", E, " bias=", (const void*)bias,
           " counts=", (const void*)counts);
  int64_t total = 0;
  for (int e = 0; e < E; ++e) {
    MT_CHECK(counts[e] >= 0, "router_update_bias_proportional", "negative counts[", e, "]=", counts[e]);
    total += counts[e];
  }
  if (total == 0) return;
  // (mean - c) / mean = (total - E c) / total: formed in integers, then one division (fp64), then clipped.
  for (int e = 0; e < E; ++e) {
    const double err = double(total - int64_t(E) * counts[e]) / double(total);
    bias[e] += float(double(rate) * std::clamp(err, -1.0, 1.0));
  }
}

template <class C>
static LoadStats load_stats_impl(const C* counts, int E) {
  MT_CHECK(E >= 1 && counts, "router_load_stats", "E=", E);
  LoadStats st;
  st.min = st.max = counts[0];
  double sum = 0;
  for (int e = 0; e < E; ++e) {
    st.min = std::min<int64_t>(st.min, counts[e]);
    st.max = std::max<int64_t>(st.max, counts[e]);
    sum += double(counts[e]);
  }
  st.mean = sum / E;
  double var = 0;
  for (int e = 0; e < E; ++e) var += (double(counts[e]) - st.mean) * (double(counts[e]) - st.mean);
  var /= E;
  st.cv = st.mean > 0 ? std::sqrt(var) / st.mean : 0.0;
  return st;
}
LoadStats router_load_stats(const int32_t* counts, int E) { return load_stats_impl(counts, E); }
LoadStats router_load_stats(const int64_t* counts, int E) { return load_stats_impl(counts, E); }

}  // namespace moetron
