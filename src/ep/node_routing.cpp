// node_routing.cpp: the router-side helpers of expert parallelism declared in ep_dispatch.h: node-limited
// routing (DeepSeek-V3: a token may use experts on at most M nodes), the number of nodes a routing uses, and
// the one-process reference of the hierarchical combine order.
// Not a dispatcher (src/ep/dispatch_*.cpp) and not the router itself (src/kernels/router.cpp).
#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "ep/ep_wire.h"
#include "moetron/check.h"
#include "moetron/ep_dispatch.h"
#include "moetron/permute.h"

namespace moetron {

using ep::kParMin;

namespace {
inline bool before(float va, int ia, float vb, int ib) { return va > vb || (va == vb && ia < ib); }

void check_node_args(const char* op, int64_t N, int E, int n_nodes, int max_nodes, int k) {
  MT_CHECK(N >= 0, op, "negative N=", N);
  MT_CHECK(E >= 1 && n_nodes >= 1 && E % n_nodes == 0, op, "n_nodes=", n_nodes, " must divide E=", E);
  MT_CHECK(max_nodes >= 1 && max_nodes <= n_nodes, op, "max_nodes=", max_nodes, " outside [1, n_nodes=", n_nodes,
           "]");
  MT_CHECK(k >= 1 && k <= max_nodes * (E / n_nodes), op, "topk=", k, " cannot be met by ", max_nodes,
           " node(s) of ", E / n_nodes, " experts");
}
}  // namespace

void ep_node_limit_scores(float* q_out, const float* q, int64_t N, int E, int n_nodes, int max_nodes, int k) {
  const char* op = "ep_node_limit_scores";
  check_node_args(op, N, E, n_nodes, max_nodes, k);
  MT_CHECK((q_out && q) || N == 0, op, "null array");
  const int G = E / n_nodes, top = std::max(1, std::min(G, k / max_nodes));
#pragma omp parallel if (int64_t(N) * E >= kParMin)
  {
    std::vector<float> v(static_cast<size_t>(G)), score(static_cast<size_t>(n_nodes));
    std::vector<int> order(static_cast<size_t>(n_nodes));
    std::vector<char> keep(static_cast<size_t>(n_nodes));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* qn = q + n * E;
      for (int b = 0; b < n_nodes; ++b) {
        for (int j = 0; j < G; ++j) v[size_t(j)] = qn[b * G + j];
        std::partial_sort(v.begin(), v.begin() + top, v.end(), std::greater<float>());
        float s = 0;
        for (int j = 0; j < top; ++j) s += v[size_t(j)];
        score[size_t(b)] = s;
        order[size_t(b)] = b;
      }
      std::sort(order.begin(), order.end(),
                [&](int a, int b) { return before(score[size_t(a)], a, score[size_t(b)], b); });
      std::fill(keep.begin(), keep.end(), 0);
      for (int r = 0; r < max_nodes; ++r) keep[size_t(order[size_t(r)])] = 1;
      float* o = q_out + n * E;
      for (int e = 0; e < E; ++e) o[e] = keep[size_t(e / G)] ? qn[e] : -std::numeric_limits<float>::infinity();
    }
  }
}

void ep_node_limited_topk(int32_t* topk_idx, const float* q, int64_t N, int E, int k, int n_nodes, int max_nodes) {
  const char* op = "ep_node_limited_topk";
  check_node_args(op, N, E, n_nodes, max_nodes, k);
  MT_CHECK((topk_idx && q) || N == 0, op, "null array");
  std::vector<float> masked(size_t(N * E));
  ep_node_limit_scores(masked.data(), q, N, E, n_nodes, max_nodes, k);
  std::vector<int> cand(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    const float* m = masked.data() + n * E;
    int c = 0;
    for (int e = 0; e < E; ++e)
      if (m[e] != -std::numeric_limits<float>::infinity()) cand[size_t(c++)] = e;
    std::partial_sort(cand.begin(), cand.begin() + k, cand.begin() + c,
                      [&](int a, int b) { return before(m[a], a, m[b], b); });
    for (int j = 0; j < k; ++j) topk_idx[n * k + j] = cand[size_t(j)];
  }
}

int ep_max_nodes_per_token(const int32_t* topk_idx, int64_t N, int k, int E, int n_nodes) {
  const char* op = "ep_max_nodes_per_token";
  MT_CHECK(E >= 1 && n_nodes >= 1 && E % n_nodes == 0, op, "n_nodes=", n_nodes, " must divide E=", E);
  const int G = E / n_nodes;
  int best = 0;
  std::vector<char> seen(static_cast<size_t>(n_nodes));
  for (int64_t n = 0; n < N; ++n) {
    std::fill(seen.begin(), seen.end(), 0);
    int c = 0;
    for (int j = 0; j < k; ++j) {
      const int32_t e = topk_idx[n * k + j];
      MT_CHECK(e >= -1 && e < E, op, "topk_idx[", n, ",", j, "]=", e, " outside [0, ", E, ") and not -1");
      if (e < 0) continue;
      if (!seen[size_t(e / G)]) {
        seen[size_t(e / G)] = 1;
        ++c;
      }
    }
    best = std::max(best, c);
  }
  return best;
}

void ep_combine_hierarchical_ref(float* y, const float* yp, const int32_t* topk_idx, const float* w, int64_t N,
                                 int k, int64_t D, int E, int n_nodes) {
  const char* op = "ep_combine_hierarchical_ref";
  MT_CHECK(E >= 1 && n_nodes >= 1 && E % n_nodes == 0, op, "n_nodes=", n_nodes, " must divide E=", E);
  const int G = E / n_nodes;
  // Per (token, node) partials through the same kernels as the dispatcher, then the node-order sum.
  std::vector<int32_t> ro(size_t(N * k)), ro1(size_t(N * k), -1);
  std::vector<float> part(size_t(N * k * D)), ptmp(size_t(N * D));
  int64_t np = 0;
  for (int b = 0; b < n_nodes; ++b) {
    bool any = false;
    for (int64_t i = 0; i < N * k; ++i) {
      ro[size_t(i)] = topk_idx[i] >= 0 && topk_idx[i] / G == b ? int32_t(i) : -1;
      any |= ro[size_t(i)] >= 0;
    }
    if (!any) continue;
    if (w) moe_unpermute(ptmp.data(), yp, ro.data(), w, N, k, N * k, D);
    else moe_permute_backward(ptmp.data(), yp, ro.data(), N, k, N * k, D);
    for (int64_t t = 0; t < N; ++t) {
      bool uses = false;
      for (int s = 0; s < k; ++s) uses |= topk_idx[t * k + s] >= 0 && topk_idx[t * k + s] / G == b;
      if (!uses) continue;
      int j = 0;
      while (ro1[size_t(t * k + j)] >= 0) ++j;
      ro1[size_t(t * k + j)] = int32_t(np);
      std::memcpy(part.data() + np * D, ptmp.data() + t * D, size_t(D * 4));
      ++np;
    }
  }
  moe_permute_backward(y, part.data(), ro1.data(), N, k, np, D);
}

}  // namespace moetron
