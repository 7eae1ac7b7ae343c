// accounting.cpp: parameter counts, FLOPs per token and saved-activation bytes of a ModelSpec.
// THE one implementation (see accounting.h for the conventions). Every saved-activation figure is a
// list of named terms, one line per tensor, so that the engine's allocations can be compared term by
// term. Not a memory planner: no optimizer state, sharding or workspaces here.
#include "moetron/accounting.h"

#include <algorithm>

#include "moetron/check.h"

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
    p.dense_mlp = 3 * d * s.inter_size;
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

int64_t routed_rows(const ModelSpec& s, int64_t tokens) {
  const auto& m = s.moe;
  const int64_t rows = tokens * m.topk;
  if (m.capacity_factor <= 0) return rows;
  const int64_t E = m.n_routed_experts;
  const double per_expert = m.capacity_factor * double(rows) / double(E);
  const int64_t cap = int64_t(per_expert);
  return E * (double(cap) < per_expert ? cap + 1 : cap);  // E * ceil(cf * T * k / E)
}

LayerActivations layer_activation_terms(const ModelSpec& s, int64_t layer, int64_t B, int64_t S, Precision p,
                                        const ActivationCheckpointSpec& ac) {
  MT_CHECK(layer >= 0 && layer < s.n_layers, "layer_activation_terms", "layer ", layer, " of ", s.n_layers);
  MT_CHECK(B > 0 && S > 0, "layer_activation_terms", "micro_batch ", B, " seq_len ", S);
  LayerActivations out;
  out.layer = layer;
  const int64_t T = B * S, d = s.d_model;
  const int64_t a = p == Precision::FP32 ? 4 : 2;  // activation element bytes
  const int64_t g = p == Precision::FP8 ? 1 : a;   // GEMM-input element bytes (fp8 saves quantized inputs)
  const int64_t f32 = 4, i32 = 4;
  const bool on = ac.applies_to(layer);
  if (on && ac.mode == AcMode::Full) {
    out.terms.push_back({"layer.input", T * d * a});
    return out;
  }
  const bool sel = on && ac.mode == AcMode::Selective;
  const bool rc_core = sel && ac.has_module("attention_core");
  const bool rc_act = sel && ac.has_module("moe_act");
  const bool rc_norm = sel && ac.has_module("norm");
  auto add = [&](const char* name, int64_t bytes, bool recomputed = false) {
    if (!recomputed) out.terms.push_back({name, bytes});
  };

  // Attention block.
  const auto& at = s.attn;
  const int64_t H = at.n_heads;
  add("attn_norm.x", T * d * a);
  add("attn_norm.rstd", T * f32);
  add("attn_norm.out", T * d * g, rc_norm);
  if (at.type != AttnType::MLA) {
    const int64_t hd = at.head_dim, Hkv = at.n_kv_heads;
    if (at.qk_norm) {
      add("attn.qk_norm.x", T * (H + Hkv) * hd * a);
      add("attn.qk_norm.rstd", T * (H + Hkv) * f32);
    }
    add("attn.q", T * H * hd * a);
    add("attn.k", T * Hkv * hd * a);
    add("attn.v", T * Hkv * hd * a);
  } else {
    if (at.q_lora_rank > 0) {
      add("attn.q_a", T * at.q_lora_rank * a);
      add("attn.q_a.rstd", T * f32);
      add("attn.q_a_norm.out", T * at.q_lora_rank * g, rc_norm);
    }
    add("attn.kv_a", T * (at.kv_lora_rank + at.qk_rope_head_dim) * a);
    add("attn.kv_a.rstd", T * f32);
    add("attn.kv_a_norm.out", T * at.kv_lora_rank * g, rc_norm);
    add("attn.q", T * H * at.qk_head_dim() * a);
    add("attn.k", T * H * at.qk_head_dim() * a);
    add("attn.v", T * H * at.v_head_dim * a);
  }
  add("attn.out", T * H * at.v_dim() * g, rc_core);
  add("attn.lse", B * H * S * f32, rc_core);

  // FFN block.
  add("ffn_norm.x", T * d * a);
  add("ffn_norm.rstd", T * f32);
  add("ffn_norm.out", T * d * g, rc_norm);
  if (!s.is_moe_layer(layer)) {
    add("mlp.gate_up", T * 2 * s.inter_size * a);
    add("mlp.act", T * s.inter_size * g);
    return out;
  }
  const auto& m = s.moe;
  const int64_t E = m.n_routed_experts, k = m.topk, Im = m.moe_inter_size;
  const int64_t R = routed_rows(s, T);
  if (m.z_loss_coef > 0) add("router.logits", T * E * f32);
  add("router.scores", T * E * f32);
  add("router.topk_idx", T * k * i32);
  add("router.topk_w", T * k * f32);
  add("moe.row_map", R * i32);
  add("moe.x", R * d * g);
  add("moe.gate_up", R * 2 * Im * a);
  add("moe.act", R * Im * g, rc_act);
  add("moe.y", R * d * a);
  if (m.n_shared_experts > 0) {
    const int64_t Is = m.n_shared_experts * Im;
    add("shared.gate_up", T * 2 * Is * a);
    add("shared.act", T * Is * g, rc_act);
  }
  return out;
}

ActivationBytes activation_bytes(const ModelSpec& s, int64_t B, int64_t S, Precision p,
                                 const ActivationCheckpointSpec& ac) {
  ActivationBytes r;
  for (int64_t l = 0; l < s.n_layers; ++l) {
    r.layers.push_back(layer_activation_terms(s, l, B, S, p, ac));
    r.total += r.layers.back().total();
    if (ac.mode == AcMode::Full && ac.applies_to(l))
      r.recompute_transient = std::max(r.recompute_transient, layer_activation_terms(s, l, B, S, p, {}).total());
  }
  const int64_t T = B * S, d = s.d_model;
  const int64_t a = p == Precision::FP32 ? 4 : 2;
  const int64_t g = p == Precision::FP8 ? 1 : a;
  auto& o = r.outside;
  o.terms = {
      {"embed.ids", T * 4},
      {"final_norm.x", T * d * a},
      {"final_norm.rstd", T * 4},
      {"final_norm.out", T * d * g},
      {"loss.probs", T * s.vocab_size * 4},
  };
  r.total += o.total();
  return r;
}

ActivationBytes activation_bytes(const JobConfig& c) {
  return activation_bytes(c.model, c.training.micro_batch_size, c.training.seq_len, precision_of(c.training.compute_dtype),
                          c.activation_checkpoint);
}

}  // namespace moetron
