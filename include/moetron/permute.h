// permute.h: MoE dispatch inside one process: the permutation plan (expert-major, stable) with optional
// capacity dropping, and the fused gather (permute) / weighted scatter-add (unpermute) with their backwards.
// Not the all-to-all between ranks (src/parallel) and not the expert GEMMs (grouped GEMM).
//
// Plan. From topk_idx [N, k] (the router's choice for each (token t, slot s)) and counts [E]:
//   kept_e      = min(counts_e, C)        with capacity C = ceil(cf * N * k / E), or counts_e when cf == 0
//   offsets     = exclusive prefix sum of kept: expert e owns rows offsets[e] .. offsets[e+1]-1, R = offsets[E]
//   rows of e   = the (t, s) with topk_idx[t, s] == e in (t, s) order (token, then slot): stable;
//                 with a capacity, C of them are kept and the rest dropped: the first C in that order
//                 (drop by position), or, given the routing weights w [N, k], the C with the largest w[t, s]
//                 (drop by probability; equal weights keep the earlier (t, s)); kept rows stay in (t, s) order.
//   row_of[t,s] = its row, or -1 if dropped;  token_of[r], slot_of[r] = the (t, s) of row r (r < R);
//                 entries r >= R of token_of / slot_of are set to -1.
// Kernels (R rows of D features; the plan's rows are each referenced by exactly one (t, s)):
//   moe_permute             xp[r] = x[token_of[r]]                        (fp32 -> fp32 or fp32 -> bf16)
//   moe_permute_backward    dx[t] = sum_s dxp[row_of[t,s]]                (slot order, dropped slots skip)
//   moe_unpermute           y[t]  = sum_s w[t,s] * yp[row_of[t,s]]        (slot order, dropped slots skip)
//   moe_unpermute_backward  dyp[row_of[t,s]] = w[t,s] * dy[t]; dw[t,s] = dot(dy[t], yp[row_of[t,s]])
//                           (dw = 0 for a dropped slot; dyp optionally bf16)
// Every output is overwritten (no accumulation). Per-token sums run over the slots in order and are
// computed per token, so there are no atomics and no dependence on the thread count.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "moetron/dtype.h"

namespace moetron {

// Per-expert capacity for capacity factor cf: 0 (meaning unlimited) when cf == 0, else
// ceil(cf * N * k / E) computed in fp64 (minus 1e-9 so that an exact integer is not pushed up by rounding).
int64_t moe_capacity(double capacity_factor, int64_t N, int k, int E);

// Builds the plan; returns the number of dropped (token, slot) assignments (0 when cf == 0).
// slot_of may be null; drop_w (the routing weights [N, k]) chooses dropping by probability, null by position.
// Throws if topk_idx has an index outside [0, E) or counts disagree with topk_idx.
int64_t moe_permute_plan(int32_t* offsets /* [E+1] */, int32_t* row_of /* [N, k] */, int32_t* token_of /* [N*k] */,
                         int32_t* slot_of /* [N*k] or null */, const int32_t* topk_idx /* [N, k] */,
                         const int32_t* counts /* [E] */, int64_t N, int k, int E, double capacity_factor,
                         const float* drop_w = nullptr /* [N, k] or null */);

void moe_permute(float* xp /* [R, D] */, const float* x /* [N, D] */, const int32_t* token_of /* [R] */, int64_t R,
                 int64_t N, int64_t D);
void moe_permute(bf16* xp /* [R, D] */, const float* x /* [N, D] */, const int32_t* token_of /* [R] */, int64_t R,
                 int64_t N, int64_t D);
void moe_permute_backward(float* dx /* [N, D] */, const float* dxp /* [R, D] */, const int32_t* row_of /* [N, k] */,
                          int64_t N, int k, int64_t R, int64_t D);

void moe_unpermute(float* y /* [N, D] */, const float* yp /* [R, D] */, const int32_t* row_of /* [N, k] */,
                   const float* w /* [N, k] */, int64_t N, int k, int64_t R, int64_t D);
// Walks the permuted rows in order (hence token_of and slot_of, which the plan must have produced);
// row_of marks the dropped slots, whose dw is 0.
void moe_unpermute_backward(float* dyp /* [R, D] */, float* dw /* [N, k] */, const float* dy /* [N, D] */,
                            const float* yp /* [R, D] */, const int32_t* row_of /* [N, k] */,
                            const int32_t* token_of /* [R] */, const int32_t* slot_of /* [R] */,
                            const float* w /* [N, k] */, int64_t N, int k, int64_t R, int64_t D);
void moe_unpermute_backward(bf16* dyp /* [R, D] */, float* dw /* [N, k] */, const float* dy /* [N, D] */,
                            const float* yp /* [R, D] */, const int32_t* row_of /* [N, k] */,
                            const int32_t* token_of /* [R] */, const int32_t* slot_of /* [R] */,
                            const float* w /* [N, k] */, int64_t N, int k, int64_t R, int64_t D);

// ---------------------------------------------------------------------------------------------------------
// Reference twins (naive, for clarity; T = float or double; outputs TO = T or bf16).

namespace permute_detail {
template <class TO, class T>
inline TO cvt(T v) {
  if constexpr (std::is_same_v<TO, bf16>) return to_bf16(float(v));
  else return TO(v);
}
}  // namespace permute_detail

// Plan by definition: for each expert, list its (t, s) in order; with a capacity keep the first C of them, or
// (drop_w given) the C largest weights, ties to the earlier (t, s); place the kept ones in (t, s) order.
inline int64_t moe_permute_plan_ref(int32_t* offsets, int32_t* row_of, int32_t* token_of, int32_t* slot_of,
                                    const int32_t* topk_idx, const int32_t* counts, int64_t N, int k, int E,
                                    double capacity_factor, const float* drop_w = nullptr) {
  (void)counts;
  const int64_t C = moe_capacity(capacity_factor, N, k, E);
  int64_t row = 0, dropped = 0;
  for (int64_t i = 0; i < N * k; ++i) {
    row_of[i] = -1;
    token_of[i] = -1;
    if (slot_of) slot_of[i] = -1;
  }
  for (int e = 0; e < E; ++e) {
    offsets[e] = int32_t(row);
    std::vector<int64_t> mine;  // (t, s) flat indices routed to e, in order
    for (int64_t i = 0; i < N * k; ++i)
      if (topk_idx[i] == e) mine.push_back(i);
    std::vector<bool> keep(mine.size(), true);
    if (C > 0 && int64_t(mine.size()) > C) {
      std::vector<size_t> order(mine.size());
      for (size_t j = 0; j < order.size(); ++j) order[j] = j;
      if (drop_w)
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return drop_w[mine[a]] > drop_w[mine[b]]; });
      for (size_t j = size_t(C); j < order.size(); ++j) keep[order[j]] = false;
    }
    for (size_t j = 0; j < mine.size(); ++j) {
      if (!keep[j]) {
        ++dropped;
        continue;
      }
      const int64_t i = mine[j];
      row_of[i] = int32_t(row);
      token_of[row] = int32_t(i / k);
      if (slot_of) slot_of[row] = int32_t(i % k);
      ++row;
    }
  }
  offsets[E] = int32_t(row);
  return dropped;
}

template <class TO, class T>
void moe_permute_ref(TO* xp, const T* x, const int32_t* token_of, int64_t R, int64_t D) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) xp[r * D + d] = permute_detail::cvt<TO>(x[int64_t(token_of[r]) * D + d]);
}

template <class T>
void moe_permute_backward_ref(T* dx, const T* dxp, const int32_t* row_of, int64_t N, int k, int64_t D) {
  for (int64_t t = 0; t < N; ++t)
    for (int64_t d = 0; d < D; ++d) {
      T acc = 0;
      for (int s = 0; s < k; ++s) {
        int32_t r = row_of[t * k + s];
        if (r >= 0) acc += dxp[int64_t(r) * D + d];
      }
      dx[t * D + d] = acc;
    }
}

template <class T>
void moe_unpermute_ref(T* y, const T* yp, const int32_t* row_of, const T* w, int64_t N, int k, int64_t D) {
  for (int64_t t = 0; t < N; ++t)
    for (int64_t d = 0; d < D; ++d) {
      T acc = 0;
      for (int s = 0; s < k; ++s) {
        int32_t r = row_of[t * k + s];
        if (r >= 0) acc += w[t * k + s] * yp[int64_t(r) * D + d];
      }
      y[t * D + d] = acc;
    }
}

template <class TO, class T>
void moe_unpermute_backward_ref(TO* dyp, T* dw, const T* dy, const T* yp, const int32_t* row_of, const T* w,
                                int64_t N, int k, int64_t D) {
  for (int64_t t = 0; t < N; ++t)
    for (int s = 0; s < k; ++s) {
      int32_t r = row_of[t * k + s];
      T acc = 0;
      if (r >= 0)
        for (int64_t d = 0; d < D; ++d) {
          dyp[int64_t(r) * D + d] = permute_detail::cvt<TO>(w[t * k + s] * dy[t * D + d]);
          acc += dy[t * D + d] * yp[int64_t(r) * D + d];
        }
      dw[t * k + s] = acc;
    }
}

}  // namespace moetron
