// kernel_sizes.cpp: the kernels' buffer sizes as plain arithmetic (kernel_sizes.h), shared by the kernels
// and the accounting. Not the kernels and not their argument checks: the kernels check their inputs before
// calling these.
#include "moetron/kernel_sizes.h"

#include <algorithm>

namespace moetron {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }
size_t align64(size_t b) { return (b + 63) & ~size_t(63); }
}  // namespace

// ---- flash attention

int64_t attention_thread_floats(int64_t Dqk, int64_t Dv) {
  const int64_t t = kAttnTile;
  const int64_t fwd = round16(Dqk) * t + t * t;                                 // Q^T tile, scores
  const int64_t bwd = (round16(Dqk) + round16(Dv)) * t * 2 + 2 * t * t + 2 * t;  // K^T, V^T, dK, dV, S, dP, rows
  return std::max(fwd, bwd);
}

int64_t attention_shared_floats(const AttnWorkspaceShape& s) {
  return (s.shared_k && s.Hkv > 1 ? s.B * s.Hkv * s.T * round16(s.Dqk) : 0) +
         (s.shared_v && s.Hkv > 1 ? s.B * s.Hkv * s.T * round16(s.Dv) : 0);
}

int64_t attention_bf16_thread_words(int64_t Dqk, int64_t Dv) {
  const int64_t t = kAttnTile, dh16 = round16(ceil_div(Dqk, 2));
  const int64_t fwd = dh16 * t + t * t + t / 2 * t;                         // Q^T pairs, S^T, P pairs
  const int64_t bwd = (round16(Dqk) + round16(Dv)) * t + 2 * t * t + 3 * t / 2 * t + 2 * t;  // dK, dV, S, dP,
  return std::max(fwd, bwd);                                               // P / dS pairs, dS rows, lse, D
}

int64_t attention_bf16_shared_words(const AttnWorkspaceShape& s) {
  const int64_t t = kAttnTile, dh = ceil_div(s.Dqk, 2), dvh = ceil_div(s.Dv, 2);
  const int64_t Tq = s.Tq > 0 ? s.Tq : s.T, Hq = s.Hq > 0 ? s.Hq : s.Hkv;
  const int64_t ktiles = s.B * s.Hkv * ceil_div(s.T, t), qtiles = s.B * Hq * ceil_div(Tq, t);
  const int64_t fwd = ktiles * (t * dh + t / 2 * s.Dv);                                     // k rows, v pairs
  const int64_t bwd = ktiles * (dh * t + t / 2 * s.Dqk + dvh * t) +                          // k^T, k pairs, v^T
                      qtiles * (t * dh + t / 2 * s.Dqk + t * dvh + t / 2 * s.Dv);            // q, q pairs, dO, dO pairs
  return std::max(fwd, bwd);
}

size_t attention_workspace_size(const AttnWorkspaceShape& s, int threads) {
  if (!s.bf16)
    return sizeof(float) * size_t(attention_thread_floats(s.Dqk, s.Dv) * threads + attention_shared_floats(s)) + 64;
  const int64_t per = std::max(attention_thread_floats(s.Dqk, s.Dv), attention_bf16_thread_words(s.Dqk, s.Dv));
  return 4 * size_t(per * threads + attention_bf16_shared_words(s) + attention_shared_floats(s)) + 64;
}

// ---- grouped GEMM

GroupedPackGeom grouped_pack_geom(GroupedPackKind kind, GemmPrec prec, int64_t K, int64_t N) {
  GroupedPackGeom g{};
  g.Kc = kind == GroupedPackKind::Fwd ? K : N;
  g.Nc = kind == GroupedPackKind::Fwd ? N : K;
  g.elem_bytes = prec == GemmPrec::BF16 ? 2 : 4;
  g.steps = prec == GemmPrec::BF16 ? ceil_div(g.Kc, 2) : g.Kc;
  g.npanels = ceil_div(g.Nc, kGroupedPanel);
  g.panel_elems = g.steps * kGroupedPanel * (prec == GemmPrec::BF16 ? 2 : 1);
  g.expert_elems = g.npanels * g.panel_elems;  // a multiple of 64 elements, so experts stay 64-byte aligned
  return g;
}

size_t grouped_packed_size(GroupedPackKind kind, GemmPrec prec, int64_t E, int64_t K, int64_t N) {
  const GroupedPackGeom g = grouped_pack_geom(kind, prec, K, N);
  return align64(size_t(E) * size_t(g.expert_elems) * size_t(g.elem_bytes));
}

int64_t grouped_wgrad_item_rows(int64_t K, int64_t wgrad_rows) {
  return std::min<int64_t>(round_up(std::max<int64_t>(K, 1), kGroupedMR), wgrad_rows);
}

GroupedWsLayout grouped_ws_layout(GroupedOp op, GemmPrec prec, int64_t E, int64_t K, int64_t N, int64_t wgrad_rows,
                                  int64_t wgrad_chunk) {
  GroupedWsLayout l;
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
  l.slots = l.fixed = at;
  if (op == GroupedOp::Wgrad && prec == GemmPrec::BF16) {
    const int64_t mt = grouped_wgrad_item_rows(K, wgrad_rows);
    const size_t pair = 2 * sizeof(uint16_t);  // two bf16
    l.slot_a = align64(size_t(round_up(mt, kGroupedPanel)) * size_t(wgrad_chunk) * pair);
    l.slot_bytes =
        l.slot_a + align64(size_t(round_up(std::max<int64_t>(N, 1), kGroupedPanel)) * size_t(wgrad_chunk) * pair);
  }
  return l;
}

size_t grouped_workspace_size(GroupedOp op, GemmPrec prec, int64_t E, int64_t K, int64_t N, int threads,
                              int64_t wgrad_rows, int64_t wgrad_chunk) {
  const GroupedWsLayout l = grouped_ws_layout(op, prec, E, K, N, wgrad_rows, wgrad_chunk);
  return l.fixed + size_t(threads) * l.slot_bytes;
}

// ---- fused linear + cross-entropy

// 256 rows wins for V > 8192 (e.g. V = 32000: 31 MiB of logits instead of 8 MiB).
int64_t linear_xent_default_chunk(int64_t V) {
  const int64_t by_memory = (int64_t(8) << 20) / (4 * std::max<int64_t>(V, 1)) / 16 * 16;
  return std::max<int64_t>(256, by_memory);
}

}  // namespace moetron
