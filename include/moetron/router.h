// router.h: the MoE router with DeepSeek-V2/V3 semantics, from gate logits to (expert, weight) pairs,
// its auxiliary losses, its backward, and two small helpers for aux-loss-free balancing and load stats.
// Not the gate GEMM (the caller computes logits = x · W_gate), not the dispatch (see permute.h).
//
// Per token n (logits l[n, 0..E), fp32):
//   s_e   = softmax(l)_e                or sigmoid(l_e)               (ScoreFn)      -> scores [N, E]
//   q_e   = s_e + bias_e                (bias may be null: 0)          selection scores; bias selects only
//   Sinkhorn selection (sinkhorn_iters = I > 0; Megatron-LM's "sinkhorn" balancing, S-BASE): the score matrix
//         s [N, E] of the call's N tokens is scaled to equal column sums by I fixed iterations of
//           r_n = 1 / sum_e s_{n,e} c_e,   c_e = (N / E) / sum_n s_{n,e} r_n    (c_e = 1 before the first),
//         c then divided by its mean; q_e = s_e * c_e + bias_e. Selection only: the weights, the losses and the
//         backward use s. The column sums run in token order in fp64 (deterministic); a token's selection then
//         depends on the other tokens of the call (not batch invariant; with split > 1, of the whole micro-batch).
//   Capacity routing (capacity = f >= 1, n_group = 1): C = ceil(f N k / E); tokens in order n = 0 .. N-1 take
//         their k largest q_e among the experts holding fewer than C of the call's assignments so far (a full
//         expert passes the token to its next choice; no token is dropped). With capacity >= E / (E - k + 1)
//         some k experts always have room and no expert exceeds C, so the load's cv is at most
//         sqrt(C E / (N k) - 1) (Bhatia-Davis: variance <= (max - mean) (mean - min)); below that, a token that
//         finds fewer than k experts with room takes its best unused ones. Depends on the other tokens of the call
//         and their order.
//   group-limited selection (n_group > 1): experts split into n_group contiguous groups of G = E / n_group;
//         group score = max_{e in g} q_e (GroupScore::Max, DeepSeek-V2)
//                    or sum of the top min(2, G) q_e in g (GroupScore::Top2Sum, DeepSeek-V3);
//         the topk_group best groups are kept, the other experts are not eligible.
//   top-k: the k eligible experts with the largest q_e; slot j holds the j-th largest.
//         Ties (exactly equal values) go to the LOWER index, for groups and experts alike.
//   w_j   = route_scale * s_{i_j} / (norm_topk ? sum_m s_{i_m} + 1e-20 : 1)        -> topk_w [N, k]
//   counts[e] = #(n, j) with i_{n,j} = e                                         -> counts [E]
// Losses (added to the training loss by the caller; values returned in RouterLosses):
//   s'_{n,e} = s_{n,e} for softmax, s_{n,e} / (sum_m s_{n,m} + 1e-20) for sigmoid (DeepSeek-V3).
//   Global:  L_aux = aux_coef * E * sum_e f_e * P_e,  f_e = counts_e / (N k),  P_e = (1/N) sum_n s'_{n,e}
//   SeqWise: tokens n = b*T .. b*T+T-1 form sequence b (T = seq_len, S = N / T sequences);
//            L_aux = (1/S) sum_b aux_coef * E * sum_e f_{b,e} * P_{b,e},
//            f_{b,e} = c_{b,e} / (T k) (c counted over sequence b),  P_{b,e} = (1/T) sum_{n in b} s'_{n,e}
//   f is a constant (no gradient flows through the selection); P carries the gradient.
//   z-loss:  L_z = z_coef * (1/N) sum_n logsumexp(l_n)^2
// Backward: dlogits = d/dlogits [ sum_{n,j} dtopk_w[n,j] * w_{n,j} + L_aux + L_z ] with the selection held
//   fixed (top-k is piecewise constant). To scale the aux/z terms (e.g. by 1/micro-batches) scale the coefs.
// Determinism: every token's outputs depend on that token's logits only (batch invariant), counts are
// integer, and the loss sums are taken in a fixed token order in fp64; no result depends on the thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace moetron {

enum class ScoreFn : uint8_t { Softmax, Sigmoid };
enum class GroupScore : uint8_t { Max, Top2Sum };
enum class AuxMode : uint8_t { None, SeqWise, Global };

struct RouterConfig {
  int E = 0;     // routed experts
  int topk = 0;  // experts per token
  ScoreFn score = ScoreFn::Softmax;
  int n_group = 1;     // expert groups (1: no group limit)
  int topk_group = 1;  // groups kept per token
  GroupScore group_score = GroupScore::Max;
  bool norm_topk = true;    // divide the chosen scores by their sum
  float route_scale = 1.0f;  // multiplies the weights (after normalization)
  AuxMode aux = AuxMode::None;
  float aux_coef = 0.0f;
  float z_coef = 0.0f;
  int seq_len = 0;  // tokens per sequence, for AuxMode::SeqWise (N must be a multiple)
  // Context parallelism: each sequence (SeqWise) or the micro-batch (Global) is split over `split` ranks, each
  // holding an equal share of its tokens (seq_len and N are this rank's). The aux loss's per-sequence expert counts
  // are then summed over the ranks by `sum_counts` (in place, the same result on every rank) before they are used,
  // in the forward and again in the backward, and every normalization by a token count (the aux loss's, the
  // z-loss's) counts the tokens of all `split` ranks: each rank's losses and gradients are its share of the whole
  // sequence's, so the ranks' losses add up to the single-rank loss. split = 1: sum_counts is not called.
  int split = 1;
  std::function<void(int32_t* counts, int64_t n)> sum_counts;
  int sinkhorn_iters = 0;  // > 0: Sinkhorn selection (above)
  float capacity = 0.0f;   // > 0 (>= 1): capacity routing (above); needs n_group = 1
  // Balanced routing with split > 1 (sinkhorn_iters > 0 or capacity > 0): the selection is that of the whole
  // micro-batch, N * split tokens in its global order (the single-process call's). gather_rows(gathered, local, n)
  // writes every rank's `local` [n floats] one after the other in rank order (the same on every rank; the router
  // passes its score rows [N, E]); split_rows [N * split] names the global row of each gathered row (gathered row
  // g is rank g / N's local row g % N), a permutation of 0 .. N * split - 1; split_rank is this rank. Every rank
  // then runs the same Sinkhorn factors and capacity greedy over the whole score matrix and keeps its own rows'
  // experts and weights. counts stays this rank's (its rows' assignments: summed over the ranks by the caller, as
  // for the aux loss with sum_counts); C = ceil(f N split k / E). The backward needs only the local rows.
  int split_rank = 0;
  std::vector<int64_t> split_rows;
  std::function<void(float* gathered, const float* local, int64_t n)> gather_rows;
};

// The largest n_group supported (per-token group scores live on the stack).
inline constexpr int kRouterMaxGroups = 256;

// Throws moetron::Error (naming the field and value) unless cfg is valid for N tokens:
// E >= 1, 1 <= topk <= E, E % n_group == 0, 1 <= topk_group <= n_group <= kRouterMaxGroups,
// topk <= topk_group * E / n_group, route_scale > 0, aux_coef >= 0, z_coef >= 0,
// SeqWise: seq_len > 0 and N % seq_len == 0.
void router_validate(const RouterConfig& cfg, int64_t N);

struct RouterLosses {
  float aux = 0;  // the aux loss as defined above (0 for AuxMode::None), coefficient included
  float z = 0;    // the z-loss, coefficient included
};

// Workspace for router_forward / router_backward (both take the same size; 8-byte aligned).
size_t router_workspace_bytes(const RouterConfig& cfg, int64_t N);

// The Sinkhorn column factors c [E] (mean 1) of the score matrix s [N, E] after `iters` iterations (above).
// ws: router_workspace_bytes of a config with sinkhorn_iters > 0.
void router_sinkhorn_factors(double* c /* [E] */, const float* scores /* [N, E] */, int64_t N, int E, int iters,
                             void* ws);

// topk_idx, topk_w, counts, scores are written in full. losses may be null (the loss values are then not
// computed; nothing else changes). bias may be null. ws: router_workspace_bytes(cfg, N) bytes.
// Throws on invalid cfg, null pointers or non-finite logits.
void router_forward(int32_t* topk_idx /* [N, k] */, float* topk_w /* [N, k] */, int32_t* counts /* [E] */,
                    float* scores /* [N, E] */, RouterLosses* losses, const float* logits /* [N, E] */,
                    const float* bias /* [E] or null */, const RouterConfig& cfg, int64_t N, void* ws);

// dlogits is overwritten. scores and topk_idx are the forward's outputs; logits is needed only when
// z_coef > 0 (may be null otherwise). ws: router_workspace_bytes(cfg, N) bytes.
void router_backward(float* dlogits /* [N, E] */, const float* dtopk_w /* [N, k] */, const float* scores /* [N, E] */,
                     const int32_t* topk_idx /* [N, k] */, const float* logits /* [N, E] or null */,
                     const RouterConfig& cfg, int64_t N, void* ws);

// Aux-loss-free balancing (DeepSeek-V3): bias_e += rate * sign(mean_count - counts_e), sign(0) = 0,
// mean_count = sum_e counts_e / E. counts may be all-reduced across ranks by the caller (hence int64).
void router_update_bias(float* bias /* [E] */, const int64_t* counts /* [E] */, int E, float rate);
void router_update_bias(float* bias /* [E] */, const int32_t* counts /* [E] */, int E, float rate);
// The proportional form (model.bias_update = "proportional"): bias_e += rate * clamp((mean_count - counts_e) /
// mean_count, -1, 1): an idle expert rises by rate, one at twice the balanced load or more falls by rate, and the
// step shrinks with the error, so the bias settles where the sign form keeps jumping by +-rate. No step when no
// token was routed (mean_count = 0).
void router_update_bias_proportional(float* bias /* [E] */, const int64_t* counts /* [E] */, int E, float rate);

struct LoadStats {
  int64_t min = 0, max = 0;
  double mean = 0;
  double cv = 0;  // coefficient of variation: population std / mean (0 when mean == 0)
};
LoadStats router_load_stats(const int32_t* counts /* [E] */, int E);
LoadStats router_load_stats(const int64_t* counts /* [E] */, int E);

// ---------------------------------------------------------------------------------------------------------
// Reference twins: naive, for clarity, T = float or double. They allocate and do not validate much.
// The float instantiation makes the same selection decisions as router_forward except at near-ties
// (scores may differ by a few ulp between the two; see docs/kernels/moe.md).

namespace router_detail {
// Selection order: larger value first, then lower index.
template <class T>
inline bool before(T va, int ia, T vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}
}  // namespace router_detail

// Scores of one token.
template <class T>
void router_scores_ref(T* s /* [E] */, const T* l /* [E] */, int E, ScoreFn fn) {
  if (fn == ScoreFn::Softmax) {
    T m = l[0];
    for (int e = 1; e < E; ++e) m = std::max(m, l[e]);
    T z = 0;
    for (int e = 0; e < E; ++e) z += std::exp(l[e] - m);
    for (int e = 0; e < E; ++e) s[e] = std::exp(l[e] - m) / z;
  } else {
    for (int e = 0; e < E; ++e) s[e] = T(1) / (T(1) + std::exp(-l[e]));
  }
}

template <class T>
T logsumexp_ref(const T* l, int E) {
  T m = l[0];
  for (int e = 1; e < E; ++e) m = std::max(m, l[e]);
  T z = 0;
  for (int e = 0; e < E; ++e) z += std::exp(l[e] - m);
  return m + std::log(z);
}

// Top-k selection of one token from its scores (group-limited); writes idx [k] in slot order.
template <class T>
void router_select_ref(int32_t* idx /* [k] */, const T* s /* [E] */, const T* bias /* [E] or null */,
                       const RouterConfig& cfg) {
  using router_detail::before;
  const int E = cfg.E, G = E / cfg.n_group;
  std::vector<T> q(E);
  for (int e = 0; e < E; ++e) q[e] = s[e] + (bias ? bias[e] : T(0));
  std::vector<char> eligible(E, 1);
  if (cfg.n_group > 1) {
    std::vector<T> gs(cfg.n_group);
    for (int g = 0; g < cfg.n_group; ++g) {
      std::vector<int> in(G);
      for (int j = 0; j < G; ++j) in[j] = g * G + j;
      std::sort(in.begin(), in.end(), [&](int a, int b) { return before(q[a], a, q[b], b); });
      if (cfg.group_score == GroupScore::Max) gs[g] = q[in[0]];
      else gs[g] = G >= 2 ? q[in[0]] + q[in[1]] : q[in[0]];
    }
    std::vector<int> order(cfg.n_group);
    for (int g = 0; g < cfg.n_group; ++g) order[g] = g;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return before(gs[a], a, gs[b], b); });
    std::fill(eligible.begin(), eligible.end(), 0);
    for (int r = 0; r < cfg.topk_group; ++r)
      for (int j = 0; j < G; ++j) eligible[order[r] * G + j] = 1;
  }
  std::vector<int> cand;
  for (int e = 0; e < E; ++e)
    if (eligible[e]) cand.push_back(e);
  std::sort(cand.begin(), cand.end(), [&](int a, int b) { return before(q[a], a, q[b], b); });
  for (int j = 0; j < cfg.topk; ++j) idx[j] = cand[j];
}

// s' (the scores the aux loss averages): s for softmax, s / (sum s + 1e-20) for sigmoid.
template <class T>
void router_aux_scores_ref(T* sp /* [E] */, const T* s /* [E] */, int E, ScoreFn fn) {
  T sum = 0;
  for (int e = 0; e < E; ++e) sum += s[e];
  for (int e = 0; e < E; ++e) sp[e] = fn == ScoreFn::Softmax ? s[e] : s[e] / (sum + T(1e-20));
}

// Per-token aux-loss gradient coefficient c[n, e] = dL_aux / ds'[n, e] (f held constant).
template <class T>
std::vector<T> router_aux_coef_ref(const int32_t* topk_idx, const RouterConfig& cfg, int64_t N) {
  const int E = cfg.E, k = cfg.topk;
  std::vector<T> c(size_t(N) * E, T(0));
  if (cfg.aux == AuxMode::None || N == 0) return c;
  const int64_t T_ = cfg.aux == AuxMode::Global ? N : cfg.seq_len, S = N / T_;
  for (int64_t b = 0; b < S; ++b) {
    std::vector<int64_t> cnt(E, 0);
    for (int64_t n = b * T_; n < (b + 1) * T_; ++n)
      for (int j = 0; j < k; ++j) ++cnt[topk_idx[n * k + j]];
    for (int64_t n = b * T_; n < (b + 1) * T_; ++n)
      for (int e = 0; e < E; ++e) {
        T f = T(cnt[e]) / (T(T_) * T(k));
        c[n * E + e] = T(cfg.aux_coef) * T(E) * f / (T(T_) * T(S));
      }
  }
  return c;
}

template <class T>
void router_forward_ref(int32_t* topk_idx /* [N, k] */, T* topk_w /* [N, k] */, int32_t* counts /* [E] */,
                        T* scores /* [N, E] */, T* aux_loss, T* z_loss, const T* logits /* [N, E] */,
                        const T* bias /* [E] or null */, const RouterConfig& cfg, int64_t N) {
  const int E = cfg.E, k = cfg.topk;
  for (int e = 0; e < E; ++e) counts[e] = 0;
  for (int64_t n = 0; n < N; ++n) {
    T* s = scores + n * E;
    router_scores_ref(s, logits + n * E, E, cfg.score);
    int32_t* idx = topk_idx + n * k;
    router_select_ref(idx, s, bias, cfg);
    T sum = 0;
    for (int j = 0; j < k; ++j) sum += s[idx[j]];
    for (int j = 0; j < k; ++j)
      topk_w[n * k + j] = T(cfg.route_scale) * (cfg.norm_topk ? s[idx[j]] / (sum + T(1e-20)) : s[idx[j]]);
    for (int j = 0; j < k; ++j) ++counts[idx[j]];
  }
  // L_aux = sum_{n,e} c[n,e] * s'[n,e]  (c as in router_aux_coef_ref; the loss is linear in s').
  T aux = 0;
  if (cfg.aux != AuxMode::None && N > 0) {
    std::vector<T> c = router_aux_coef_ref<T>(topk_idx, cfg, N), sp(E);
    for (int64_t n = 0; n < N; ++n) {
      router_aux_scores_ref(sp.data(), scores + n * E, E, cfg.score);
      for (int e = 0; e < E; ++e) aux += c[n * E + e] * sp[e];
    }
  }
  T z = 0;
  if (cfg.z_coef > 0 && N > 0) {
    for (int64_t n = 0; n < N; ++n) {
      T lse = logsumexp_ref(logits + n * E, E);
      z += lse * lse;
    }
    z = T(cfg.z_coef) * z / T(N);
  }
  if (aux_loss) *aux_loss = aux;
  if (z_loss) *z_loss = z;
}

template <class T>
void router_backward_ref(T* dlogits /* [N, E] */, const T* dtopk_w /* [N, k] */, const T* scores /* [N, E] */,
                         const int32_t* topk_idx /* [N, k] */, const T* logits /* [N, E] or null */,
                         const RouterConfig& cfg, int64_t N) {
  const int E = cfg.E, k = cfg.topk;
  const T rs = T(cfg.route_scale);
  std::vector<T> c = router_aux_coef_ref<T>(topk_idx, cfg, N);
  std::vector<T> ds(E), sm(E);
  for (int64_t n = 0; n < N; ++n) {
    const T* s = scores + n * E;
    const int32_t* idx = topk_idx + n * k;
    const T* g = dtopk_w + n * k;
    std::fill(ds.begin(), ds.end(), T(0));
    // 1. weights: w_j = rs * s_{i_j} / S (S = sum_m s_{i_m} + 1e-20 when normalized)
    if (cfg.norm_topk) {
      T S = 0, gs = 0;
      for (int j = 0; j < k; ++j) S += s[idx[j]];
      S += T(1e-20);
      for (int j = 0; j < k; ++j) gs += g[j] * s[idx[j]];
      for (int j = 0; j < k; ++j) ds[idx[j]] += rs * (g[j] / S - gs / (S * S));
    } else {
      for (int j = 0; j < k; ++j) ds[idx[j]] += rs * g[j];
    }
    // 2. aux loss through s'
    if (cfg.aux != AuxMode::None) {
      const T* cn = c.data() + n * E;
      if (cfg.score == ScoreFn::Softmax) {
        for (int e = 0; e < E; ++e) ds[e] += cn[e];
      } else {
        T sum = 0, cs = 0;
        for (int e = 0; e < E; ++e) sum += s[e];
        sum += T(1e-20);
        for (int e = 0; e < E; ++e) cs += cn[e] * s[e] / sum;
        for (int e = 0; e < E; ++e) ds[e] += (cn[e] - cs) / sum;
      }
    }
    // 3. score function
    T* dl = dlogits + n * E;
    if (cfg.score == ScoreFn::Softmax) {
      T dot = 0;
      for (int e = 0; e < E; ++e) dot += ds[e] * s[e];
      for (int e = 0; e < E; ++e) dl[e] = s[e] * (ds[e] - dot);
    } else {
      for (int e = 0; e < E; ++e) dl[e] = ds[e] * s[e] * (T(1) - s[e]);
    }
    // 4. z-loss: d/dl z_coef/N * lse^2 = 2 z_coef/N * lse * softmax(l)
    if (cfg.z_coef > 0) {
      const T* l = logits + n * E;
      T lse = logsumexp_ref(l, E);
      router_scores_ref(sm.data(), l, E, ScoreFn::Softmax);
      for (int e = 0; e < E; ++e) dl[e] += T(2) * T(cfg.z_coef) / T(N) * lse * sm[e];
    }
  }
}

}  // namespace moetron
