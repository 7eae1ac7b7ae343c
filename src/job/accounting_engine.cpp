// accounting_engine.cpp: sizes of buffers the engine holds beyond the shared term list, read by both the engine's
// estimate_memory (accounting.cpp) and the planner's engine recipe (src/plan/memory.cpp), so that the two count
// them once: the layer set under tensor parallelism, the final norm's under TP, the packed expert weights. Not the
// term list (accounting.cpp) and not the config keys behind a term (accounting_keys.cpp).
#include "moetron/accounting.h"
#include "moetron/kernel_sizes.h"

namespace moetron {

// One MoE layer's routed-row buffers under TP (R = N * topk rows, every expert's width over TP): the gathered input
// copy, the gate/up output, the activation copy and the expert output.
double engine_tp_routed_row_bytes(const ModelSpec& s, double N, double tp, int64_t cb) {
  const double d = double(s.d_model), c = double(cb), R = N * double(s.moe.topk), Fe = double(s.moe.moe_inter_size) / tp;
  return R * d * c + R * 2 * Fe * 4 + R * Fe * c + R * d * 4;  // xpc, egu, eactc, ez
}

// One layer's saved buffers under tensor parallelism (tp > 1, sequence parallel), as the engine allocates them
// (src/model/model.cpp alloc_bufs): N rows of the micro-batch, Nr = N / tp of them in the residual stream; the
// gathered norm outputs, the attention's and FFN's tensors on the rank's heads / widths, the router's on every row.
// `input`: the layer input (Nr rows), which a fully recomputed layer keeps alone.
double engine_tp_layer_bytes(const ModelSpec& s, bool moe, double N, double tp, int64_t cb, bool input) {
  const auto& at = s.attn;
  const double d = double(s.d_model), c = double(cb), Nr = N / tp, H = double(at.n_heads) / tp;
  const double copy = cb == 4 ? 0 : c;  // a compute-dtype copy beside an fp32 tensor (fp32 mode: the tensor itself)
  double x = (input ? Nr * d * 4 : 0) + Nr * 4 + N * d * c + Nr * d * 4 + Nr * 4 + N * d * (4 + copy);
  if (at.type == AttnType::MLA) {
    const double rq = double(at.q_lora_rank), rkv = double(at.kv_lora_rank), dqk = double(at.qk_head_dim());
    const double dn = double(at.qk_nope_head_dim), dr = double(at.qk_rope_head_dim), dv = double(at.v_dim());
    if (rq > 0) x += N * rq * 4 + N * 4 + N * rq * c;
    x += N * H * dqk * 4 + N * rkv * 4 + N * 4 + N * rkv * c + N * dr * 4 + N * H * (dn + dv) * 4 + N * H * dqk * 4;
  } else {
    x += N * double(at.n_heads + 2 * at.n_kv_heads) / tp * double(at.head_dim) * 4;  // qkv
    if (at.qk_norm) x += N * double(at.n_heads + at.n_kv_heads) / tp * (double(at.head_dim) + 1) * 4;  // q/k, rstd
  }
  x += N * H * double(at.v_dim()) * (4 + copy) + N * H * 4;  // ao, aoc, lse
  if (!moe) return x + N * 2 * double(s.inter_size) / tp * 4 + N * double(s.inter_size) / tp * c;  // gu, actc
  const auto& m = s.moe;
  const double E = double(m.n_routed_experts), K = double(m.topk);
  const double Fs = double(m.n_shared_experts) * double(m.moe_inter_size) / tp;
  x += 2 * N * E * 4 + 2 * N * K * 4 + (3 * E + 1) * 4 + 3 * N * K * 4;  // logits, scores, top-k, counts, row maps
  x += engine_tp_routed_row_bytes(s, N, tp, cb);
  if (Fs > 0) x += N * 2 * Fs * 4 + N * Fs * c;  // shared gu, actc
  return x;
}

double engine_tp_final_norm_bytes(const ModelSpec& s, double N, double tp, int64_t cb) {
  const double d = double(s.d_model), Nr = N / tp;
  return Nr * d * 4 + Nr * 4 + N * d * double(cb);  // input and rstd (its rows), output (all rows)
}

double engine_packed_expert_bytes(const ModelSpec& s, int64_t ep, int64_t etp, int64_t cb) {
  const auto& m = s.moe;
  const GemmPrec prec = cb == 4 ? GemmPrec::F32 : GemmPrec::BF16;
  const int64_t el = m.n_routed_experts / ep, dm = s.d_model, fe = m.moe_inter_size / etp;
  double b = 0;
  for (auto kind : {GroupedPackKind::Fwd, GroupedPackKind::Dgrad})
    b += double(grouped_packed_size(kind, prec, el, dm, 2 * fe)) + double(grouped_packed_size(kind, prec, el, fe, dm));
  return b;
}

}  // namespace moetron
