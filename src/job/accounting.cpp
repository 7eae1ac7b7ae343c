// accounting.cpp: parameter counts, FLOPs per token, saved-activation bytes of a ModelSpec, and the
// per-rank memory estimate of a training job. THE one implementation (see accounting.h for the
// conventions). Every saved-activation figure is a list of named terms, one line per tensor, so that the
// engine's allocations can be compared term by term; the term list is written once, as templates over
// the arithmetic (int64 for the figures, double for the size checks). Not a planner: no layout search.
#include "moetron/accounting.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <type_traits>
#include <utility>

#include "moetron/check.h"
#include "moetron/kernel_sizes.h"
#include "moetron/muon_params.h"

namespace moetron {

// ---- parameters ------------------------------------------------------------------------------------
int64_t expert_params(const ModelSpec& s) { return 3 * s.d_model * s.moe.moe_inter_size; }

namespace {
// Attention weights: {all, matmul-only}.
std::pair<int64_t, int64_t> attention_params(const ModelSpec& s) {
  const auto& a = s.attn;
  const int64_t d = s.d_model, H = a.n_heads;
  if (a.type != AttnType::MLA) {
    const int64_t hd = a.head_dim, Hkv = a.n_kv_heads;
    const int64_t mm = d * H * hd + 2 * d * Hkv * hd + H * hd * d;  // q, k, v, o
    return {mm + (a.qk_norm ? 2 * hd : 0), mm};
  }
  const int64_t dqk = a.qk_head_dim(), dv = a.v_head_dim;
  int64_t mm = 0, vec = 0;
  if (a.q_lora_rank > 0) {
    mm += d * a.q_lora_rank + a.q_lora_rank * H * dqk;  // q_a, q_b
    vec += a.q_lora_rank;                               // q_a_norm
  } else {
    mm += d * H * dqk;  // q
  }
  mm += d * (a.kv_lora_rank + a.qk_rope_head_dim);          // kv_a (latent + shared rope key)
  vec += a.kv_lora_rank;                                    // kv_a_norm
  mm += a.kv_lora_rank * H * (a.qk_nope_head_dim + dv);     // kv_b (k_nope and v)
  mm += H * dv * d;                                         // o
  return {mm + vec, mm};
}
}  // namespace

LayerParams layer_params(const ModelSpec& s, int64_t layer) {
  MT_CHECK(layer >= 0 && layer < s.n_layers, "layer_params", "layer ", layer, " of ", s.n_layers);
  LayerParams p;
  const int64_t d = s.d_model;
  auto [attn, attn_mm] = attention_params(s);
  p.attention = attn;
  p.norms = 2 * d;
  p.moe = s.is_moe_layer(layer);
  int64_t mm = attn_mm;
  if (!p.moe) {
    p.dense_mlp = (s.ffn == FfnKind::GELU ? 2 : 3) * d * s.inter_size;  // up, down (+ gate for SwiGLU)
    mm += p.dense_mlp;
  } else {
    const auto& m = s.moe;
    const int64_t E = m.n_routed_experts;
    p.router = E * d + (m.load_balance == LoadBalance::AuxFree ? E : 0);
    p.routed_experts = E * expert_params(s);
    p.routed_active = m.topk * expert_params(s);
    p.shared_experts = m.n_shared_experts * expert_params(s);
    mm += E * d + p.routed_active + p.shared_experts;
  }
  p.matmul_active = mm;
  return p;
}

ParamCounts count_params(const ModelSpec& s) {
  ParamCounts c;
  const int64_t Vd = s.vocab_size * s.d_model;
  c.embedding = Vd;
  c.head = s.tie_embeddings ? 0 : Vd;
  c.final_norm = s.d_model;
  c.total = c.embedding + c.head + c.final_norm;
  c.active = c.total;
  for (int64_t l = 0; l < s.n_layers; ++l) {
    LayerParams p = layer_params(s, l);
    c.total += p.total();
    c.active += p.active();
    c.routed_experts += p.routed_experts;
    c.layers.push_back(p);
  }
  if (s.mtp_layers > 0) {  // the MTP depths: a block like the last layer's, two input norms, eh_proj, a head norm
    const LayerParams p = layer_params(s, s.n_layers - 1);
    const int64_t extra = 2 * s.d_model * s.d_model + 3 * s.d_model;
    c.mtp = s.mtp_layers * (p.total() + extra);
    c.total += c.mtp;
    c.active += s.mtp_layers * (p.active() + extra);
    c.routed_experts += s.mtp_layers * p.routed_experts;
  }
  // Without the input embedding; a tied table is still used (as the head) and stays in once.
  c.active_no_embed = c.active - (s.tie_embeddings ? 0 : c.embedding);
  c.dense_part = c.total - c.routed_experts;
  return c;
}

// ---- FLOPs ------------------------------------------------------------------------------------------
FlopsPerToken flops_per_token(const ModelSpec& s, int64_t seq_len, bool causal, const ActivationCheckpointSpec& ac) {
  MT_CHECK(seq_len > 0, "flops_per_token", "seq_len ", seq_len);
  FlopsPerToken f;
  const double ctx = causal ? (double(seq_len) + 1.0) / 2.0 : double(seq_len);
  const double attn_core =
      2.0 * double(s.attn.n_heads) * double(s.attn.qk_head_dim() + s.attn.v_dim()) * ctx;  // QK^T + PV
  double recompute = 0;
  for (int64_t l = 0; l < s.n_layers; ++l) {
    const double mm = 2.0 * double(layer_params(s, l).matmul_active);
    f.fwd_matmul += mm;
    f.fwd_attention += attn_core;
    f.layer_fwd.push_back(mm + attn_core);
    if (ac.applies_to(l)) {
      if (ac.mode == AcMode::Full) recompute += mm + attn_core;
      else if (ac.has_module("attention_core")) recompute += attn_core;  // moe_act, norm: elementwise only
    }
  }
  f.fwd_matmul += 2.0 * double(s.vocab_size) * double(s.d_model);  // output head (tied or not)
  if (s.mtp_layers > 0) {  // each MTP depth: eh_proj, a block like the last layer, the shared head again
    const double D = double(s.mtp_layers), d = double(s.d_model);
    f.fwd_matmul += D * (2.0 * double(layer_params(s, s.n_layers - 1).matmul_active) + 2.0 * 2 * d * d +
                         2.0 * double(s.vocab_size) * d);
    f.fwd_attention += D * attn_core;
    if (ac.applies_to(s.n_layers) && ac.mode == AcMode::Full)
      recompute += D * (2.0 * double(layer_params(s, s.n_layers - 1).matmul_active) + attn_core);
  }
  f.train = 3.0 * f.fwd();
  f.hw_train = f.train + recompute;
  return f;
}

// ---- saved activations ------------------------------------------------------------------------------
int64_t LayerActivations::total() const {
  int64_t t = 0;
  for (const auto& x : terms) t += x.bytes;
  return t;
}

namespace {

// Routed rows in the arithmetic Num (int64_t for the public figures, double for size checks).
template <class Num>
Num rows_for(const ModelSpec& s, Num tokens) {
  const auto& m = s.moe;
  const Num rows = tokens * Num(m.topk);
  if (m.capacity_factor <= 0) return rows;
  const double per_expert = m.capacity_factor * double(rows) / double(m.n_routed_experts);
  if constexpr (std::is_floating_point_v<Num>) {
    return Num(m.n_routed_experts) * std::ceil(per_expert);
  } else {
    const int64_t cap = int64_t(per_expert);
    return m.n_routed_experts * (double(cap) < per_expert ? cap + 1 : cap);  // E * ceil(cf * T * k / E)
  }
}

template <class Num>
Num ceil_div(Num a, int64_t b) {
  if constexpr (std::is_floating_point_v<Num>) return std::ceil(a / Num(b));
  else return (a + Num(b) - 1) / Num(b);
}

// The scales of an FP8-cached activation [rows, cols] (fp8_cached_scales, in the arithmetic Num), and its bytes.
template <class Num>
Num fp8_cache_scales(Fp8Recipe r, Num rows, Num cols, Num groups) {
  switch (r) {
    case Fp8Recipe::None: return 0;
    case Fp8Recipe::Tensorwise: return groups;
    case Fp8Recipe::Rowwise: return rows;
    case Fp8Recipe::Blockwise: return rows * ceil_div(cols, 128);
    case Fp8Recipe::MXFP8: return rows * ceil_div(cols, 32);
  }
  return 0;
}
template <class Num>
Num fp8_cache_size(Fp8Recipe r, Num rows, Num cols, Num groups) {
  if (r == Fp8Recipe::None) return 0;
  return rows * cols + fp8_cache_scales<Num>(r, rows, cols, groups) * Num(r == Fp8Recipe::MXFP8 ? 1 : 4);
}

// Every term one un-checkpointed layer saves, as emit(name, bytes, module): `module` is the selective
// recompute module that drops the term ("norm", "attention_core", "moe_act") or nullptr. In the arithmetic
// Num; a: activation element bytes, g: GEMM-input element bytes. THE list of terms (docs/model.md). With
// cached FP8 activations (f8) the inputs fp8_cache_plan names are terms "<linear>.x_fp8" in place of their
// g-byte copies.
template <class Num, class Emit>
void layer_terms_all(const ModelSpec& s, bool moe, Num B, Num S, Num a, Num g, Emit&& emit,
                     const ActShard& sh = {}, const Fp8CachePlan& f8p = {}) {
  // Sharding (all 1 on the engine): S is the sequence per cp rank; `q` divides the token-parallel regions
  // (norms, residual, router, dispatch: sequence parallelism over tp), `w` the head / width-split tensors (tp),
  // `e` the routed experts' width (expert_tp), whose rows are gathered over expert_tp.
  S = S / Num(sh.cp);
  const Num q = Num(sh.token_div()), w = Num(sh.tp), e = Num(sh.etp);
  const Num T = B * S, d = Num(s.d_model), f32 = 4, i32 = 4;
  const char* norm = "norm";
  const char* core = "attention_core";
  const char* act = "moe_act";

  // Attention block.
  const auto& at = s.attn;
  const Num H = Num(at.n_heads);
  // An FP8-cached input [T or R rows, cols] (g-byte copy dropped); `div` as the copy's sharding.
  auto f8 = [&](Num rows, Num cols, Num groups) { return fp8_cache_size<Num>(f8p.recipe, rows, cols, groups); };
  const bool c_attn = f8p.attention, c_mlp = f8p.dense_mlp && !moe, c_sh = f8p.shared_experts && moe;
  const bool c_exp = f8p.routed_experts && moe;
  emit("attn_norm.x", T * d * a / q, nullptr);
  emit("attn_norm.rstd", T * f32 / q, nullptr);
  if (!c_attn) emit("attn_norm.out", T * d * g / q, norm);
  else if (at.type != AttnType::MLA) emit("attn.wqkv.x_fp8", f8(T, d, 1) / q, norm);
  else {  // MLA: three projections read the normed input, each with its own FP8 operand
    emit(at.q_lora_rank > 0 ? "attn.wdq.x_fp8" : "attn.wq.x_fp8", f8(T, d, 1) / q, norm);
    emit("attn.wdkv.x_fp8", f8(T, d, 1) / q, norm);
    emit("attn.wkr.x_fp8", f8(T, d, 1) / q, norm);
  }
  if (at.type != AttnType::MLA) {
    const Num hd = Num(at.head_dim), Hkv = Num(at.n_kv_heads);
    if (at.qk_norm) {
      emit("attn.qk_norm.x", T * (H + Hkv) * hd * a / w, nullptr);
      emit("attn.qk_norm.rstd", T * (H + Hkv) * f32 / w, nullptr);
    }
    emit("attn.q", T * H * hd * a / w, nullptr);
    emit("attn.k", T * Hkv * hd * a / w, nullptr);
    emit("attn.v", T * Hkv * hd * a / w, nullptr);
  } else {
    const Num rq = Num(at.q_lora_rank), rkv = Num(at.kv_lora_rank), dqk = Num(at.qk_head_dim());
    if (at.q_lora_rank > 0) {
      emit("attn.q_a", T * rq * a / q, nullptr);
      emit("attn.q_a.rstd", T * f32 / q, nullptr);
      if (c_attn) emit("attn.wuq.x_fp8", f8(T, rq, 1) / q, norm);
      else emit("attn.q_a_norm.out", T * rq * g / q, norm);
    }
    emit("attn.kv_a", T * (rkv + Num(at.qk_rope_head_dim)) * a / q, nullptr);
    emit("attn.kv_a.rstd", T * f32 / q, nullptr);
    if (c_attn) emit("attn.wukv.x_fp8", f8(T, rkv, 1) / q, norm);
    else emit("attn.kv_a_norm.out", T * rkv * g / q, norm);
    emit("attn.q", T * H * dqk * a / w, nullptr);
    emit("attn.k", T * H * dqk * a / w, nullptr);
    emit("attn.v", T * H * Num(at.v_head_dim) * a / w, nullptr);
  }
  emit("attn.out", T * H * Num(at.v_dim()) * g / w, core);
  if (s.attention_impl == AttnImpl::Flash) {
    emit("attn.lse", B * H * S * f32 / w, core);
  } else {
    // Unfused (Megatron-LM 2021-22; Korthikanti et al. 2022, section 4.1, the 5 a s^2 b term): the softmax output
    // over the materialized scores [B, H, S, keys] and, with dropout, its 1-byte mask and the dropped output.
    const Num P = B * H * S * (S * Num(sh.cp)) / w;
    emit("attn.probs", P * a, core);
    if (s.dropout > 0) emit("attn.probs_mask", P, core), emit("attn.probs_dropped", P * a, core);
  }
  // Dropout (GPT): a 1-byte mask per element of the attention block's output and of the FFN's output, in the
  // token-parallel region. The attention probabilities' dropout keeps no mask: the fused attention regenerates it
  // from the RNG state in the backward, as it recomputes the probabilities.
  const bool drop = s.dropout > 0;
  if (drop) emit("attn.dropout_mask", T * d / q, nullptr);

  // FFN block.
  emit("ffn_norm.x", T * d * a / q, nullptr);
  emit("ffn_norm.rstd", T * f32 / q, nullptr);
  if (c_mlp) emit("mlp.w13.x_fp8", f8(T, d, 1) / q, norm);
  else emit("ffn_norm.out", T * d * g / q, norm);
  if (!moe) {
    const Num I = Num(s.inter_size);
    if (s.ffn == FfnKind::GELU) emit("mlp.up", T * I * a / w, nullptr);  // the GELU's input
    else emit("mlp.gate_up", T * 2 * I * a / w, nullptr);
    if (c_mlp) emit("mlp.w2.x_fp8", f8(T, I, 1) / w, nullptr);
    else emit("mlp.act", T * I * g / w, nullptr);  // kept: moe_act covers the experts only
    if (drop) emit("mlp.dropout_mask", T * d / q, nullptr);
    return;
  }
  const auto& m = s.moe;
  const Num E = Num(m.n_routed_experts), k = Num(m.topk), Im = Num(m.moe_inter_size);
  const Num R = rows_for(s, T) / q * e;  // rows this rank computes (dispatch keeps the count balanced)
  if (m.z_loss_coef > 0) emit("router.logits", T * E * f32 / q, nullptr);
  emit("router.scores", T * E * f32 / q, nullptr);
  emit("router.topk_idx", T * k * i32 / q, nullptr);
  emit("router.topk_w", T * k * f32 / q, nullptr);
  emit("moe.row_map", R * i32, nullptr);
  if (c_exp) emit("moe.w13.x_fp8", f8(R, d, E), nullptr);
  else emit("moe.x", R * d * g, nullptr);
  emit("moe.gate_up", R * 2 * Im * a / e, nullptr);
  if (c_exp) emit("moe.w2.x_fp8", f8(R, Im, E) / e, act);
  else emit("moe.act", R * Im * g / e, act);
  emit("moe.y", R * d * a, nullptr);
  if (m.n_shared_experts > 0) {
    const Num Is = Num(m.n_shared_experts) * Im;
    emit("shared.gate_up", T * 2 * Is * a / w, nullptr);
    if (c_sh) emit("shared.w2.x_fp8", f8(T, Is, 1) / w, act);
    else emit("shared.act", T * Is * g / w, act);
  }
  if (drop) emit("moe.dropout_mask", T * d / q, nullptr);
}

// The terms a layer keeps under `ac` (`on`: the mode applies to this layer), as emit(name, bytes).
template <class Num, class Emit>
void layer_terms_kept(const ModelSpec& s, bool moe, bool on, Num B, Num S, Num a, Num g,
                      const ActivationCheckpointSpec& ac, Emit&& emit, const ActShard& sh = {},
                      const Fp8CachePlan& f8 = {}) {
  if (on && ac.mode == AcMode::Full) {
    emit("layer.input", B * (S / Num(sh.cp)) * Num(s.d_model) * a / Num(sh.token_div()));
    return;
  }
  const bool sel = on && ac.mode == AcMode::Selective;
  layer_terms_all(s, moe, B, S, a, g, [&](const char* name, Num bytes, const char* module) {
    if (!(sel && module && ac.has_module(module))) emit(name, bytes);
  }, sh, f8);
}

// The model-level terms (embedding ids, final norm, loss), as emit(name, bytes).
template <class Num, class Emit>
void outside_terms(const ModelSpec& s, Num B, Num S, Num a, Num g, Emit&& emit) {
  const Num T = B * S, d = Num(s.d_model);
  emit("embed.ids", T * 4);
  if (s.dropout > 0) emit("embed.dropout_mask", T * d);  // 1 byte per element
  emit("final_norm.x", T * d * a);
  emit("final_norm.rstd", T * 4);
  emit("final_norm.out", T * d * g);
  // The fused head + loss never materializes logits or probabilities (chunked, in the kernel workspace); what
  // lives from the head stage's forward to its backward is dL/dx of the final norm's input, fp32.
  emit("loss.dx", T * d * 4);
}

// Per layer, in one pass each (not a search of the lists per layer: they may be as long as the model):
// is it a MoE layer (ModelSpec::is_moe_layer), does the checkpointing mode apply (applies_to).
std::vector<char> moe_map(const ModelSpec& s) {
  std::vector<char> m(size_t(std::max<int64_t>(s.n_layers, 0)), 0);
  if (!s.is_moe()) return m;
  for (int64_t l = std::max<int64_t>(s.first_k_dense, 0); l < s.n_layers; ++l) m[size_t(l)] = 1;
  for (int l : s.dense_layers)
    if (l >= 0 && l < s.n_layers) m[size_t(l)] = 0;
  return m;
}
// The same over the engine's blocks: the layers, then the MTP depths' blocks (model.mtp_layers), each of the last
// layer's kind (ModelSpec::is_moe_block).
std::vector<char> block_moe_map(const ModelSpec& s) {
  std::vector<char> m = moe_map(s);
  for (int64_t k = 0; k < s.mtp_layers; ++k) m.push_back(m.empty() ? 0 : m.back());
  return m;
}
std::vector<char> ac_map(const ActivationCheckpointSpec& ac, int64_t n_layers) {
  std::vector<char> m(size_t(std::max<int64_t>(n_layers, 0)), ac.mode != AcMode::None && ac.layer_ids.empty());
  if (ac.mode != AcMode::None)
    for (int l : ac.layer_ids)
      if (l >= 0 && l < n_layers) m[size_t(l)] = 1;
  return m;
}

// Activation and GEMM-input element bytes of a precision.
std::pair<int64_t, int64_t> elem_bytes(Precision p) {
  const int64_t a = p == Precision::FP32 ? 4 : 2;  // activation element bytes
  const int64_t g = p == Precision::FP8 ? 1 : a;   // GEMM-input element bytes (fp8 saves quantized inputs)
  return {a, g};
}

}  // namespace

int64_t routed_rows(const ModelSpec& s, int64_t tokens) { return rows_for<int64_t>(s, tokens); }

int64_t fp8_cached_scale_bytes(Fp8Recipe r) { return r == Fp8Recipe::MXFP8 ? 1 : 4; }

int64_t fp8_cached_scales(Fp8Recipe r, int64_t rows, int64_t cols, int64_t groups) {
  MT_CHECK(r != Fp8Recipe::None, "fp8_cached_scales", "recipe none has no FP8 operands");
  return fp8_cache_scales<int64_t>(r, rows, cols, groups);
}

int64_t fp8_cached_bytes(Fp8Recipe r, int64_t rows, int64_t cols, int64_t groups) {
  return fp8_cache_size<int64_t>(r, rows, cols, groups);
}

Fp8CachePlan fp8_cache_plan(const QuantizeSpec& q) {
  Fp8CachePlan p;
  if (!q.on() || !q.cache_fp8_activations) return p;
  p.recipe = q.recipe;
  p.attention = q.has_module("attention"), p.dense_mlp = q.has_module("dense_mlp");
  p.shared_experts = q.has_module("shared_experts"), p.routed_experts = q.has_module("routed_experts");
  return p;
}

LayerActivations layer_activation_terms(const ModelSpec& s, int64_t layer, int64_t B, int64_t S, Precision p,
                                        const ActivationCheckpointSpec& ac) {
  MT_CHECK(layer >= 0 && layer < s.n_layers, "layer_activation_terms", "layer ", layer, " of ", s.n_layers);
  MT_CHECK(B > 0 && S > 0, "layer_activation_terms", "micro_batch ", B, " seq_len ", S);
  LayerActivations out;
  out.layer = layer;
  const auto [a, g] = elem_bytes(p);
  layer_terms_kept<int64_t>(s, s.is_moe_layer(layer), ac.applies_to(layer), B, S, a, g, ac,
                            [&](const char* name, int64_t bytes) { out.terms.push_back({name, bytes}); });
  return out;
}

ActivationBytes activation_bytes(const ModelSpec& s, int64_t B, int64_t S, Precision p,
                                 const ActivationCheckpointSpec& ac) {
  const auto [a, g] = elem_bytes(p);
  return activation_bytes_sized(s, B, S, a, g, ac);
}

ActivationBytes engine_activation_bytes(const ModelSpec& s, int64_t B, int64_t S, int64_t compute_bytes,
                                        const ActivationCheckpointSpec& ac, const Fp8CachePlan& f8) {
  return activation_bytes_sized(s, B, S, 4, compute_bytes, ac, f8);
}

ActivationBytes activation_bytes_sized(const ModelSpec& s, int64_t B, int64_t S, int64_t a, int64_t g,
                                       const ActivationCheckpointSpec& ac, const Fp8CachePlan& f8) {
  MT_CHECK(B > 0 && S > 0, "activation_bytes", "micro_batch ", B, " seq_len ", S);
  ActivationBytes r;
  const std::vector<char> moe = moe_map(s), on = ac_map(ac, s.n_layers);
  for (int64_t l = 0; l < s.n_layers; ++l) {
    LayerActivations la;
    la.layer = l;
    layer_terms_kept<int64_t>(s, moe[size_t(l)], on[size_t(l)], B, S, a, g, ac,
                              [&](const char* name, int64_t bytes) { la.terms.push_back({name, bytes}); }, {}, f8);
    r.total += la.total();
    r.layers.push_back(std::move(la));
    if (ac.mode == AcMode::Full && on[size_t(l)]) {
      int64_t full = 0;
      layer_terms_all<int64_t>(s, moe[size_t(l)], B, S, a, g, [&](const char*, int64_t b, const char*) { full += b; },
                               {}, f8);
      r.recompute_transient = std::max(r.recompute_transient, full);
    }
  }
  outside_terms<int64_t>(s, B, S, a, g,
                         [&](const char* name, int64_t bytes) { r.outside.terms.push_back({name, bytes}); });
  r.total += r.outside.total();
  return r;
}

void sharded_layer_terms(const ModelSpec& s, int64_t layer, double B, double S, double a, double g,
                         const ActivationCheckpointSpec& ac, const ActShard& sh, TermFn fn, void* ctx,
                         const Fp8CachePlan& f8) {
  MT_CHECK(layer >= 0 && layer < s.n_layers, "sharded_layer_terms", "layer ", layer, " of ", s.n_layers);
  layer_terms_kept<double>(s, s.is_moe_layer(layer), ac.applies_to(layer), B, S, a, g, ac,
                           [&](const char* name, double b) { fn(ctx, name, b); }, sh, f8);
}

double sharded_layer_bytes(const ModelSpec& s, int64_t layer, double B, double S, double a, double g,
                           const ActivationCheckpointSpec& ac, const ActShard& sh, const Fp8CachePlan& f8) {
  double t = 0;
  layer_terms_kept<double>(s, s.is_moe_layer(layer), ac.applies_to(layer), B, S, a, g, ac,
                           [&](const char*, double b) { t += b; }, sh, f8);
  return t;
}

double sharded_layer_bytes_all(const ModelSpec& s, int64_t layer, double B, double S, double a, double g,
                               const ActShard& sh, const Fp8CachePlan& f8) {
  double t = 0;
  layer_terms_all<double>(s, s.is_moe_layer(layer), B, S, a, g, [&](const char*, double b, const char*) { t += b; }, sh,
                          f8);
  return t;
}

void sharded_outside_terms(const ModelSpec& s, double B, double S, double a, double g, const ActShard& sh,
                           bool fused_loss, bool first, bool last, TermFn fn, void* ctx) {
  const double T = B * S / double(sh.cp), q = double(sh.token_div()), d = double(s.d_model);
  if (first) fn(ctx, "embed.ids", T * 4 / q);
  if (first && s.dropout > 0) fn(ctx, "embed.dropout_mask", T * d / q);  // 1 byte per element
  if (!last) return;
  fn(ctx, "final_norm.x", T * d * a / q);
  fn(ctx, "final_norm.rstd", T * 4 / q);
  fn(ctx, "final_norm.out", T * d * g / q);
  if (!fused_loss) {
    const double v = double(s.vocab_size) / double(sh.tp);
    fn(ctx, "loss.logits", T * v * g);
    fn(ctx, "loss.softmax", T * v * 4);
  }
}

ActivationBytes activation_bytes(const JobConfig& c) {
  return activation_bytes(c.model, c.training.micro_batch_size, c.training.seq_len, precision_of(c.training.compute_dtype),
                          resolve_checkpointing(c));
}

ActivationSize activation_size(const ModelSpec& s, int64_t B, int64_t S, int64_t act_bytes, int64_t gemm_bytes,
                               const ActivationCheckpointSpec& ac) {
  ActivationSize r;
  auto add = [&](const char* name, double bytes) {
    r.total += bytes;
    if (bytes > r.largest_bytes) r.largest_bytes = bytes, r.largest = name;
  };
  const double b = double(B), sl = double(S), a = double(act_bytes), g = double(gemm_bytes);
  const std::vector<char> moe = moe_map(s), on = ac_map(ac, s.n_layers);
  for (int64_t l = 0; l < s.n_layers; ++l)
    layer_terms_kept<double>(s, moe[size_t(l)], on[size_t(l)], b, sl, a, g, ac, add);
  outside_terms<double>(s, b, sl, a, g, add);
  return r;
}

namespace {
std::string kv(const char* key, int64_t v) { return std::string(key) + " = " + std::to_string(v); }
}  // namespace

// ---- per-rank memory of a training job ---------------------------------------------------------------
namespace {

// The engine's buffers that the accounting's term list does not have (src/model/model.cpp alloc_bufs):
// with bf16 compute the fp32 ffn_norm and attention outputs next to their bf16 copies (with fp32 compute
// the copies are those tensors), MLA's k_nope half of kv, the router logits (kept even without z-loss),
// two more row maps and the per-expert counters. `sel_*`: the module's buffers are shared (selective
// recompute), not the layer's. cb: compute element bytes. With the dense MLP's input FP8-cached (f8) a dense
// layer's h2 is shared scratch too (nothing in its backward reads it).
double engine_extras(const ModelSpec& s, bool moe, double N, bool sel_norm, bool sel_attn, int64_t cb,
                     const Fp8CachePlan& f8 = {}) {
  const auto& at = s.attn;
  const double d = double(s.d_model), H = double(at.n_heads);
  double x = 0;
  if (!sel_norm && cb != 4 && !(f8.dense_mlp && !moe)) x += N * d * 4;  // h2 (fp32 ffn_norm output)
  if (!sel_attn && cb != 4) x += N * H * double(at.v_dim()) * 4;  // ao (fp32 attention output)
  if (at.type == AttnType::MLA) {
    x += N * H * double(at.qk_nope_head_dim) * 4;  // kv holds k_nope next to v
    if (sel_norm) x += N * double(at.q_lora_rank + at.kv_lora_rank) * double(cb);  // MLA norm outputs stay
  }
  if (moe) {
    const auto& m = s.moe;
    const double E = double(m.n_routed_experts), K = double(m.topk);
    if (m.z_loss_coef <= 0) x += N * E * 4;  // logits
    x += 2 * N * K * 4 + (3 * E + 1) * 4;     // token_of, slot_of; counts, kept, offsets
  }
  return x;
}

// Bytes of one layer's full (un-checkpointed) buffer set with the engine's element sizes.
double full_layer_bytes(const ModelSpec& s, bool moe, double B, double S, int64_t cb, const Fp8CachePlan& f8 = {}) {
  double t = 0;
  layer_terms_all<double>(s, moe, B, S, 4.0, double(cb), [&](const char*, double b, const char*) { t += b; }, {}, f8);
  return t + engine_extras(s, moe, B * S, false, false, cb, f8);
}

}  // namespace

namespace {

// Per-layer parameter counts, split as the trainer shards them (the 16-element padding of each tensor in
// the flat buffers is not counted).
struct ParamSplit {
  double dense = 0;      // everything but the routed experts (replicated under EP)
  double experts = 0;    // routed experts of all layers (E per MoE layer)
  double max_unit = 0;   // FSDP: the largest unit (embedding, one layer with its local experts, norm + head)
  double max_dense_run = 0, max_expert_run = 0;  // FSDP: the largest non-expert / local-expert part of a unit
  double max_flat_run = 0;  // flat layout under EP: the largest range of non-expert parameters between experts
  double muon_dense = 0;    // optimizer.name = "muon": the non-expert parameters Muon updates (muon_params.h)
  std::string keys;      // the config keys of the largest part
};

// The attention parameters the engine keeps whole under tensor parallelism: MLA's down projections, their norms and
// the shared rope key (docs/parallel.md, "Tensor parallelism in the trainer"); 0 for MHA / GQA.
double tp_replicated_attention(const ModelSpec& s) {
  const auto& a = s.attn;
  if (a.type != AttnType::MLA) return 0;
  const double d = double(s.d_model), rq = double(a.q_lora_rank), rkv = double(a.kv_lora_rank);
  return (rq > 0 ? d * rq + rq : 0) + d * rkv + rkv + d * double(a.qk_rope_head_dim);
}

// tp: this rank's share under tensor parallelism (the engine's slicing: heads, FFN widths, every expert's width and
// the vocabulary divided; norms, the router and MLA's down projections whole).
ParamSplit param_split(const ModelSpec& s, const std::vector<char>& moe, double ep, double tp = 1) {
  ParamSplit p;
  const double V = double(s.vocab_size) / tp, d = double(s.d_model);
  double attn = 0, dense_mlp = 0, experts = 0, emb = V * d * (s.tie_embeddings ? 1 : 2);
  p.max_unit = p.max_dense_run = std::max(V * d, d + (s.tie_embeddings ? 0 : V * d));
  const double rep = tp_replicated_attention(s);
  auto local_params = [&](int64_t layer) {  // this rank's slices (whole counts: tp divides every sliced width)
    LayerParams lp = layer_params(s, layer);
    if (tp > 1) {
      lp.attention = int64_t((double(lp.attention) - rep) / tp + rep);
      lp.dense_mlp = int64_t(double(lp.dense_mlp) / tp), lp.shared_experts = int64_t(double(lp.shared_experts) / tp);
      lp.routed_experts = int64_t(double(lp.routed_experts) / tp);
    }
    return lp;
  };
  // Every dense layer has the same parameters, and every MoE layer: one of each kind, times its count.
  for (char kind : {char(0), char(1)}) {
    const auto it = std::find(moe.begin(), moe.end(), kind);
    if (it == moe.end()) continue;
    const double n = double(std::count(moe.begin(), moe.end(), kind));
    const LayerParams lp = local_params(int64_t(it - moe.begin()));
    // The aux-free bias is counted by the router but is not a trained parameter: the engine keeps it apart.
    const double bias = kind && s.moe.load_balance == LoadBalance::AuxFree ? double(s.moe.n_routed_experts) : 0;
    const double dense = double(lp.total() - lp.routed_experts) - bias, local = double(lp.routed_experts) / ep;
    p.experts += n * double(lp.routed_experts);
    p.dense += n * dense;
    attn += n * double(lp.attention), dense_mlp += n * double(lp.dense_mlp);
    experts += n * double(lp.routed_experts + lp.shared_experts);
    p.max_unit = std::max(p.max_unit, dense + local);
    p.max_dense_run = std::max(p.max_dense_run, dense), p.max_expert_run = std::max(p.max_expert_run, local);
    const MuonLayerNumel mn = muon_layer_numel(s, int64_t(it - moe.begin()));
    p.muon_dense += n * (double(mn.sliced) / tp + double(mn.replicated));
  }
  p.dense += emb + d;
  {  // The flat layout: embedding, layers in order (a MoE layer's routed experts between its router and its
     // shared experts), final norm, head. Runs of non-expert parameters end at each layer's experts.
    double layer_n[2] = {0, 0}, pre = 0, post = 0;
    for (char kind : {char(0), char(1)}) {
      const auto it = std::find(moe.begin(), moe.end(), kind);
      if (it == moe.end()) continue;
      const LayerParams lp = local_params(int64_t(it - moe.begin()));
      layer_n[int(kind)] = double(lp.total() - lp.routed_experts);
      if (kind) post = double(lp.shared_experts), pre = layer_n[1] - post;
    }
    double run = V * d;
    for (char k : moe) {
      if (!k) {
        run += layer_n[0];
        continue;
      }
      p.max_flat_run = std::max(p.max_flat_run, run + pre);
      run = post;
    }
    p.max_flat_run = std::max(p.max_flat_run, run + d + (s.tie_embeddings ? 0 : V * d));
  }
  const auto& m = s.moe;
  const std::string L = kv("model.n_layers", s.n_layers), D = kv("model.d_model", s.d_model);
  if (emb >= std::max({attn, dense_mlp, experts})) p.keys = kv("model.vocab_size", s.vocab_size) + ", " + D;
  else if (experts >= std::max(attn, dense_mlp))
    p.keys = L + ", " + kv("model.n_routed_experts", m.n_routed_experts) + ", " + D + ", " +
             kv("model.moe_inter_size", m.moe_inter_size);
  else if (dense_mlp >= attn) p.keys = L + ", " + D + ", " + kv("model.inter_size", s.inter_size);
  else p.keys = L + ", " + D + ", " + kv("model.n_heads", s.attn.n_heads);
  return p;
}

}  // namespace

namespace {

// The quantities every part of estimate_memory reads, computed once; each part adds its categories to r in the
// order the single function did (the sums are bitwise those of one pass).
struct MemoryTerms {
  const JobConfig& c;
  int64_t cb;
  int threads;
  const ModelSpec& s;
  const ParallelSpec& par;
  const ActivationCheckpointSpec ac;
  const Fp8CachePlan f8;
  const MoESpec& m;
  const double D, EP, B, S, N, d, V, H, E, K, Fe, rows;
  const std::vector<char> moe, on;
  const double n_moe;
  const GemmPrec prec;
  const double copy;  // bf16 compute: a bf16 copy of every parameter (fp32 uses the masters)

  MemoryTerms(const JobConfig& c_, int64_t cb_, int threads_)
      : c(c_), cb(cb_), threads(threads_), s(c_.model), par(c_.parallelism), ac(resolve_checkpointing(c_)),
        // CP: the gradients are summed (and ZeRO / FSDP shard) over dp x cp; each rank holds seq_len / cp tokens of
        // every sequence, and every activation and scratch buffer follows them.
        f8(fp8_cache_plan(c_.quantize)), m(c_.model.moe), D(double(par.dp() * par.cp)), EP(double(par.ep)),
        B(double(c_.training.micro_batch_size)), S(double(c_.training.seq_len / par.cp)), N(B * S),
        d(double(s.d_model)),
        V(double(s.vocab_size)), H(double(s.attn.n_heads)), E(double(m.n_routed_experts)), K(double(m.topk)),
        Fe(double(m.moe_inter_size)), rows(N * K),  // routed rows (the engine's buffers hold T * topk)
        moe(block_moe_map(s)), on(ac_map(ac, s.n_blocks())), n_moe(double(std::count(moe.begin(), moe.end(), char(1)))),
        prec(cb == 4 ? GemmPrec::F32 : GemmPrec::BF16), copy(cb == 4 ? 0 : 2) {}

  // Parameters, gradients, optimizer state and communication buffers.
  void add_state(MemoryEstimate& r) const {
    ParamSplit ps = param_split(s, moe, EP, double(par.tp));  // the MTP blocks are in `moe`
    if (s.mtp_layers > 0) {  // each depth's own: eh_proj (2d x d, a Muon matrix), enorm, hnorm, its head norm
      const double own = 2 * d * d + 3 * d, Dm = double(s.mtp_layers);
      ps.dense += Dm * own, ps.muon_dense += Dm * 2 * d * d;
      // (FSDP: a depth's unit is its block plus these 2d^2 + 3d, not added to max_unit: at most that much low.)
    }
    const double local = ps.dense + ps.experts / EP;  // this rank's parameters (flat layout)
    // The packed expert weights of one MoE layer (forward and dgrad layouts of gate/up and down, in the
    // compute dtype, as the grouped GEMM kernels pad them).
    const double packed_layer = s.is_moe() ? engine_packed_expert_bytes(s, par.ep, par.tp, cb) : 0.0;
    const double packed = n_moe * packed_layer;
    const double bias = n_moe * E * 4;                // aux-free biases (fp32, every expert)
    const double edp = D / EP;  // the expert-data-parallel group
    if (par.zero == 3) {
      // The shard group: dp_shard ranks (all of dp for FSDP, one replica's for HSDP, dp_replicate > 1); dense
      // parameters over it, local experts over its ranks holding the same experts (dp_shard / ep).
      const double Ds = double(par.dp_shard), esh = Ds / EP, R = double(par.dp_replicate);
      const double shard = (ps.dense + ps.experts) / Ds;
      const double slots = s.tie_embeddings ? 2 : 1;
      r.params = shard * 4 + slots * (ps.max_unit * (4 + copy) + packed_layer) + bias;
      r.grads = shard * 4 + slots * ps.max_unit * 4;
      // AdamW: m and v of the shard; Muon: m of the shard, v of its AdamW part (every matrix is Muon's).
      r.optimizer = c.optimizer.muon() ? shard * 4 + (ps.dense - ps.muon_dense) / Ds * 4 : shard * 8;
      // Reduce-scatter staging: the largest chunk of a unit's run. Over more than one rank, each group's
      // communicator keeps a workspace of its largest run (gather and reduce-scatter of a unit); HSDP's replicate
      // group one of its all-reduce segment (the gradient shard, at most 2^22 elements).
      r.comm = std::max(ps.max_dense_run / Ds, ps.max_expert_run / esh) * 4;
      if (Ds > 1) r.comm += ps.max_dense_run * 4;
      if (esh > 1) r.comm += ps.max_expert_run * 4;
      if (R > 1) r.comm += std::min(shard, double(int64_t(1) << 22)) * 4;
    } else {
      r.params = local * (4 + copy) + packed + bias;
      // With tied embeddings the head's gradient has a buffer of its own until it joins the embedding's (this
      // rank's vocabulary rows under TP).
      // MTP (model.mtp_layers) keeps the same buffer for its depths' embedding rows (model.cpp tied_hg).
      r.grads = local * 4 + (s.tie_embeddings || s.mtp_layers > 0 ? V / double(par.tp) * d * 4 : 0);
      // AdamW: m and v; Muon: m of every parameter, v of the AdamW ones (the routed experts are all Muon's). Under
      // ZeRO-1 both are 1/D of the whole (the average rank: a rank's slice of the flat runs holds more or less of the
      // AdamW tensors; the sum over the ranks is exact).
      const double share = par.zero == 1 && D > 1 ? 1.0 / D : 1.0;
      r.optimizer = (par.zero == 1 && D > 1 ? (ps.dense + ps.experts) / D : local) * (c.optimizer.muon() ? 4 : 8) +
                    (c.optimizer.muon() ? (ps.dense - ps.muon_dense) * share * 4 : 0.0);
      // The gradient all-reduce in segments of at most 2^22 elements: a workspace of the largest segment per
      // communicator (the DP group; under EP the expert-data-parallel group for the experts' runs).
      const double seg = double(int64_t(1) << 22);
      if (D > 1) r.comm = std::min(EP > 1 ? ps.max_flat_run : local, seg) * 4;
      if (EP > 1 && edp > 1) r.comm += std::min(ps.max_expert_run, seg) * 4;
    }
    if (EP > 1) {  // one dispatcher per MoE layer (src/ep/, its buffers() terms)
      // A dispatched row: the payload (the compute dtype, or e4m3 with a fp32 scale per 128 values) and 8 bytes
      // of metadata. The home rank keeps a payload copy of its tokens unless they go as fp32.
      const double payload = par.fp8_dispatch ? d + 4 * std::ceil(d / 128) : double(cb) * d, row = payload + 8;
      const double home = (!par.fp8_dispatch && cb == 4 ? 0 : N * payload) + N * K * 12;  // + weights, maps
      double per;
      if (par.ep_transport == EpTransport::Shm) {  // the MPI terms less the 2 message rows, plus the shm segment:
        // metadata, token rows (no home copy), fp32 combine rows (sync_free's worst case, or rows + 1/16)
        const double cap = EP * N * std::min(K, E / EP), toks = N * payload * (par.fp8_dispatch ? 2 : 1) + N * K * 12;
        const bool sf = par.ep_dispatcher == EpDispatcher::SyncFree;
        per = toks + (sf ? cap * (12 * d + 20) + rows * (4 * d + 8) : rows * (16.25 * d + 28));
      } else if (par.ep_dispatcher == EpDispatcher::SyncFree) {  // receive side sized for the worst case, once
        const double cap = EP * N * std::min(K, E / EP);
        per = rows * row + cap * row + cap * d * 8 + cap * 20 + rows * d * 4 + home;
      } else {  // received rows = routed rows on average: send, receive, fp32 expert rows, combine both ways
        per = rows * (2 * row + 12 * d + 20) + home;
        if (par.ep_dispatcher == EpDispatcher::Hierarchical) {
          // Stage 1 moves each token once per node it uses (M1 rows; uniform routing: the expected number
          // of distinct nodes among its k experts); partial sums come back per (token, node).
          const double rpn = double(std::min<int64_t>(par.ranks_per_node, par.world_size()));
          const double nodes = std::ceil(EP / std::min(EP, rpn)), En = E / nodes;
          double miss = 1;  // a given node holds none of a token's k experts
          for (int64_t i = 0; i < m.topk; ++i) miss *= std::max(0.0, (E - En - double(i)) / (E - double(i)));
          const double M1 = N * nodes * (1 - miss);
          per += M1 * (2 * (payload + 8 * K + 16) + 12 * d + 16 * K) + rows * 16;
        }
      }
      r.comm += n_moe * per;
    }
    r.param_keys = ps.keys + ", " + kv("parallelism.dp_replicate", par.dp_replicate) + ", " +
                   kv("parallelism.dp_shard", par.dp_shard) + ", " + kv("parallelism.ep", par.ep) + ", " +
                   kv("parallelism.zero", par.zero);

  }

  // The activations of one micro-batch (and the selective build's peak).
  void add_activations(MemoryEstimate& r) const {
    if (par.tp > 1) return add_tp_activations(r);
    const bool selective = ac.mode == AcMode::Selective, full = ac.mode == AcMode::Full;
    int64_t full_rep[2] = {-1, -1};  // a fully recomputed layer of each kind (dense, MoE): one shared set each
    bool sel_norm = false, sel_attn = false, sel_act = false;
    const bool has_norm = ac.has_module("norm"), has_core = ac.has_module("attention_core");
    const bool has_act = ac.has_module("moe_act");
    double largest = 0;
    std::string largest_term;
    for (int64_t l = 0; l < s.n_blocks(); ++l) {  // the MTP depths' blocks too, each like a layer
      const bool here = on[size_t(l)], is_moe = moe[size_t(l)];
      if (full && here) {
        r.activations += N * d * 4;  // the layer input
        full_rep[is_moe] = l;
        continue;
      }
      const bool sn = selective && here && has_norm, sa = selective && here && has_core;
      sel_norm |= sn, sel_attn |= sa, sel_act |= selective && here && is_moe && has_act;
      layer_terms_kept<double>(s, is_moe, here, B, S, 4.0, double(cb), ac, [&](const char* name, double b) {
        r.activations += b;
        if (b > largest) largest = b, largest_term = name;
      }, {}, f8);
      r.activations += engine_extras(s, is_moe, N, sn, sa, cb, f8);
    }
    for (int64_t l : full_rep)
      if (l >= 0) r.activations += full_layer_bytes(s, moe[size_t(l)], B, S, cb, f8) - N * d * 4;  // shared set, no x_in
    // The shared sets of selective recompute (with fp32 compute the copies of h2 and ao are those tensors).
    const double norm_set = N * d * (double(cb) + 4 + copy);                             // h1c, h2, h2c
    const double attn_set = N * H * (double(s.attn.v_dim()) * (4 + copy) + 4);          // ao, aoc, lse
    const double act_set = (rows * Fe + N * double(m.n_shared_experts) * Fe) * double(cb);  // eactc, actc
    r.activations += (sel_norm ? norm_set : 0) + (sel_attn ? attn_set : 0) + (sel_act ? act_set : 0);
    r.activations += N * d * (4 + double(cb)) + N * 4;  // final norm: input, rstd, output
    // Each MTP depth (model_mtp.cpp mtp_build): its input h^{k-1}, the embedding rows, both rstd, the
    // [enorm | hnorm] rows in the compute dtype and dL/dh^k.
    r.activations += double(s.mtp_layers) * (N * d * (12 + 2 * double(cb)) + N * 8);
    if (selective) {  // the engine builds every layer's full set before the selected modules share theirs
      double sets = 0;
      for (int64_t l = 0; l < s.n_blocks(); ++l) sets += full_layer_bytes(s, moe[size_t(l)], B, S, cb);
      const double shared = (sel_norm ? norm_set : 0) + (sel_attn ? attn_set : 0) + (sel_act ? act_set : 0);
      r.build_peak = r.params + r.grads + sets + shared;
    }
    if (largest_term.empty()) largest_term = "layer.input";
    r.activation_keys = kv("training.micro_batch_size", c.training.micro_batch_size) + ", " +
                        kv("training.seq_len", c.training.seq_len) + ", " + kv("model.n_layers", s.n_layers) + ", " +
                        activation_term_keys(s, largest_term) + ", activation_checkpoint.mode = " +
                        std::string(to_string(ac.mode));

  }

  // Tensor parallelism (no selective recompute, no FP8: the engine refuses both with tp): every held layer's set,
  // or with full recompute its input and one shared set per layer kind; the final norm's rows.
  void add_tp_activations(MemoryEstimate& r) const {
    const double tp = double(par.tp), Nr = N / tp;
    bool shared[2] = {false, false};
    for (int64_t l = 0; l < s.n_blocks(); ++l) {  // the MTP depths' blocks too, each a TP layer
      const bool is_moe = moe[size_t(l)];
      if (ac.mode == AcMode::Full && on[size_t(l)]) {
        r.activations += Nr * d * 4;
        if (!shared[is_moe]) r.activations += engine_tp_layer_bytes(s, is_moe, N, tp, cb, false), shared[is_moe] = true;
      } else {
        r.activations += engine_tp_layer_bytes(s, is_moe, N, tp, cb);
      }
    }
    r.activations += engine_tp_final_norm_bytes(s, N, tp, cb);
    // Each MTP depth's own buffers (model_mtp.cpp mtp_build) on the rank's rows, as without TP.
    r.activations += double(s.mtp_layers) * (Nr * d * (12 + 2 * double(cb)) + Nr * 8);
    r.activation_keys = kv("training.micro_batch_size", c.training.micro_batch_size) + ", " +
                        kv("training.seq_len", c.training.seq_len) + ", " + kv("model.n_layers", s.n_layers) + ", " +
                        kv("parallelism.tp", par.tp);
  }

  // Workspace: src/model/model.cpp build()'s scratch, RoPE tables and the largest kernel workspace.
  void add_workspace(MemoryEstimate& r) const {
    const bool full = ac.mode == AcMode::Full;
    const auto& at = s.attn;
    const bool mla = at.type == AttnType::MLA;
    const double dqk = double(at.qk_head_dim()), dv = double(at.v_dim()), dn = double(at.qk_nope_head_dim);
    const double rq = double(at.q_lora_rank), rkv = double(at.kv_lora_rank), dr = double(at.qk_rope_head_dim);
    const double F = double(s.inter_size), Fs = double(m.n_shared_experts) * Fe;
    const double Fw = (s.ffn == FfnKind::GELU ? 1 : 2) * F;  // the dense MLP's first GEMM output width
    const double attn_w = mla ? std::max({H * dqk, H * (dn + dv), rq, rkv})
                              : double(at.n_heads + 2 * at.n_kv_heads) * double(at.head_dim);
    const double big = std::max({attn_w, Fw, 2 * Fs, H * dv, d});
    const double big_rows = std::max(N * big, rows * std::max(2 * Fe, d));
    double ws = 4 * N * d * 4;                                               // x, dx, dh, dh2
    ws += big_rows * (2 * 4 + double(cb));                                   // s_f1, s_f2, s_c2
    if (cb != 4) ws += (std::max(N * d, rows * d) + big_rows) * double(cb);  // bf16 only: dyc, s_c1
    ws += std::max(N * big, rows * d) * 4 + N * H * dv * 4;                 // s_f3, s_dao
    ws += S * (mla ? dr : double(at.head_dim)) * 4;                          // RoPE cos + sin
    if (mla) ws += N * (2 * H * dqk + H * (dn + dv) + dr + rq + rkv) * 4;   // MLA backward scratch
    if (s.is_moe()) ws += N * (K + E) * 4;                                   // dtopk_w, dlogits
    if (EP > 1) ws += N * K * 4 + rows * 3 * 4;                              // send_idx, dwr, iota_r, zero_r
    if (full) ws += N * d * 4;                                               // recompute_out
    if (s.mtp_layers > 0) ws += N * d * (16 + double(cb)) + N * 4;          // MTP: x, [e|h] rows, tmp, normed, rstd
    if (par.tp > 1) ws += N * d * (4 + double(cb));                          // TP: gathered rows / partial sums
    if (f8.any()) {  // cached FP8 activations: the shared scratch that replaces the cached inputs' copies
      const bool any_dense = n_moe < double(moe.size()), any_moe = n_moe > 0;
      if (f8.attention) ws += N * (d + (mla ? rq + rkv : 0)) * double(cb);     // h1c (MLA: + the normed latents)
      if (f8.dense_mlp && any_dense) ws += N * d * (4 + (cb != 4 ? double(cb) : 0));  // h2 (+ its bf16 copy)
      ws += N * std::max(f8.dense_mlp && any_dense ? F : 0, f8.shared_experts && any_moe ? Fs : 0) * double(cb);  // actc
      if (f8.routed_experts && any_moe) ws += rows * (d + Fe) * double(cb);   // xpc, eactc
    }
    // Kernel workspace, one buffer for the largest need: the chunked fused loss (chunk rows: at least 256,
    // about 8 MiB of logits), attention tiles per thread, the router, the grouped GEMMs (a packing slot per
    // thread for the bf16 weight gradient).
    const double chunk = std::min(N, double(linear_xent_default_chunk(s.vocab_size)));
    double kernel = chunk * V * 4 + chunk * 8;
    {
      AttnWorkspaceShape aw;  // the engine's k and v heads are never shared (no head stride of 0)
      aw.B = c.training.micro_batch_size, aw.T = c.training.seq_len / par.cp, aw.Hkv = at.kv_heads();
      aw.Dqk = at.qk_head_dim(), aw.Dv = at.v_dim();
      // bf16 compute: the bf16 attention workspace (its operand copies), whichever kernels the CPU then runs;
      // the heads are this rank's (TP divides them).
      aw.bf16 = cb != 4, aw.Tq = aw.T, aw.Hq = std::max<int64_t>(1, at.n_heads / par.tp);
      if (aw.bf16) aw.Hkv = std::max<int64_t>(1, at.kv_heads() / par.tp);
      kernel = std::max(kernel, double(attention_workspace_size(aw, threads)));
    }
    if (s.is_moe()) {
      double router = N * 16 + (m.aux_seq_wise ? B : 1) * E * 4;
      if (par.cp > 1 && (m.sinkhorn_iters > 0 || m.route_capacity > 0)) {  // the whole micro-batch's rows (router.h)
        const double Nw = N * par.cp;
        router += E * 12 + Nw * (2 * E * 4 + 8 + 2 * K * 4) + E * 4;
      }
      kernel = std::max(kernel, router);
      const int64_t el = m.n_routed_experts / par.ep, dm = s.d_model, fe = m.moe_inter_size / par.tp;  // TP: its width
      for (GroupedOp op : {GroupedOp::Fwd, GroupedOp::Dgrad, GroupedOp::Wgrad})
        for (auto [k_in, n_out] : {std::pair<int64_t, int64_t>{dm, 2 * fe}, {fe, dm}})
          kernel = std::max(kernel, double(grouped_workspace_size(op, prec, el, k_in, n_out, threads)));
    }
    r.workspace = ws + kernel;
    const bool layer_wide = big * N >= chunk * V;
    r.workspace_keys = kv("training.micro_batch_size", c.training.micro_batch_size) + ", " +
                       kv("training.seq_len", c.training.seq_len) +
                       (layer_wide ? " (the widest layer: " + kv("model.d_model", s.d_model)
                                   : " (the loss chunk: " + kv("model.vocab_size", s.vocab_size)) + ")";
  }
};

}  // namespace

MemoryEstimate estimate_memory(const JobConfig& c, int64_t cb, int threads) {
  MT_CHECK(cb == 2 || cb == 4, "estimate_memory", "compute element bytes ", cb, " (expected 2 = bf16 or 4 = fp32)");
  MT_CHECK(threads >= 1, "estimate_memory", "threads = ", threads, " (expected >= 1)");
  const MemoryTerms t(c, cb, threads);
  MemoryEstimate r;
  t.add_state(r);
  t.add_activations(r);
  t.add_workspace(r);
  return r;
}

double engine_activation_extras(const ModelSpec& s, int64_t layer, double tokens, const ActivationCheckpointSpec& ac,
                                int64_t compute_bytes, const Fp8CachePlan& f8) {
  const bool here = ac.applies_to(layer);
  if (here && ac.mode == AcMode::Full) return 0;  // the layer keeps its input only
  const bool sel = here && ac.mode == AcMode::Selective;
  return engine_extras(s, s.is_moe_block(layer), tokens, sel && ac.has_module("norm"),
                       sel && ac.has_module("attention_core"), compute_bytes, f8);
}

}  // namespace moetron
