// param_layout.cpp: the model's parameter list, written once: names, shapes, flat offsets (each tensor padded
// to 16 floats), weight-decay and init flags, for the whole model or for a part of it (the layers of this
// rank's pipeline stages, with or without the embedding and the head, this rank's experts under EP). The
// Model lays out its buffers from it (build_params) and the trainer computes the global checkpoint layout
// from it (model_param_layout with the defaults). Not the buffers and not FSDP's shards.
#include <string>

#include "model/model_impl.h"

namespace moetron {

std::vector<ParamEntry> model_param_layout(const ModelSpec& spec, const ParamSelection& sel) {
  ModelSpec s = spec;
  s.resolve();
  const int64_t d = s.d_model, V = s.vocab_size, H = s.attn.n_heads;
  const int64_t Dqk = s.attn.qk_head_dim(), Dv = s.attn.v_dim();
  const int64_t F = s.inter_size;
  int64_t E = 0, Fe = 0, Fs = 0;
  if (s.is_moe()) E = s.moe.n_routed_experts, Fe = s.moe.moe_inter_size, Fs = s.moe.n_shared_experts * Fe;
  MT_CHECK(sel.ep >= 1 && sel.ep_rank >= 0 && sel.ep_rank < sel.ep, "model_param_layout", "EP rank ", sel.ep_rank,
           " of ", sel.ep);
  MT_CHECK(sel.ep == 1 || (E > 0 && E % sel.ep == 0), "model_param_layout", "n_routed_experts = ", E,
           " is not divisible by the expert-parallel size ", sel.ep);
  MT_CHECK(sel.layers.empty() || int64_t(sel.layers.size()) == s.n_layers, "model_param_layout", "layer mask of ",
           sel.layers.size(), " entries for ", s.n_layers, " layers");
  const int64_t El = sel.ep > 1 ? E / sel.ep : E, e0 = int64_t(sel.ep_rank) * El;
  std::vector<ParamEntry> P;
  int64_t off = 0;
  auto add = [&](const std::string& name, Shape shape, bool decay, int layer, bool expert = false,
                 bool ones = false) {
    ParamEntry e;
    e.name = name, e.shape = shape, e.numel = shape_numel(shape), e.decay = decay, e.layer = layer;
    e.expert = expert, e.ones = ones, e.init_std = float(s.init_std), e.offset = off;
    e.global_shape = shape;
    if (expert && sel.ep > 1) {  // this rank's experts [e0, e0 + El) of the [E, ...] tensor
      e.shape[0] = El;
      e.numel = shape_numel(e.shape);
      e.shard_first = e0 * (e.numel / El);
    }
    off += param_padded_numel(e.numel);  // keep every tensor 64-byte aligned
    P.push_back(e);
  };
  // The embedding on its stage, and on the head's when tied (the head multiplies by it).
  if (sel.embedding || (sel.head && s.tie_embeddings)) add("embed", {V, d}, true, -1);
  for (int64_t l = 0; l < s.n_layers; ++l) {
    if (!sel.layers.empty() && !sel.layers[size_t(l)]) continue;
    const std::string p = "layers." + std::to_string(l) + ".";
    const int li = int(l);
    add(p + "attn_norm", {d}, false, li, false, true);
    if (s.attn.type == AttnType::MLA) {
      const int64_t dn = s.attn.qk_nope_head_dim, dr = s.attn.qk_rope_head_dim;
      const int64_t rq = s.attn.q_lora_rank, rkv = s.attn.kv_lora_rank;
      if (rq > 0) {
        add(p + "attn.wdq", {d, rq}, true, li);
        add(p + "attn.q_norm", {rq}, false, li, false, true);
        add(p + "attn.wuq", {rq, H * Dqk}, true, li);
      } else {
        add(p + "attn.wq", {d, H * Dqk}, true, li);
      }
      add(p + "attn.wdkv", {d, rkv}, true, li);
      add(p + "attn.wkr", {d, dr}, true, li);
      add(p + "attn.kv_norm", {rkv}, false, li, false, true);
      add(p + "attn.wukv", {rkv, H * (dn + Dv)}, true, li);
    } else {
      add(p + "attn.wqkv", {d, (H + 2 * s.attn.kv_heads()) * s.attn.head_dim}, true, li);
    }
    add(p + "attn.wo", {H * Dv, d}, true, li);
    add(p + "ffn_norm", {d}, false, li, false, true);
    if (!s.is_moe_layer(l)) {
      add(p + "mlp.w13", {d, 2 * F}, true, li);
      add(p + "mlp.w2", {F, d}, true, li);
    } else {
      add(p + "moe.gate", {d, E}, true, li);
      add(p + "moe.experts.w13", {E, d, 2 * Fe}, true, li, true);
      add(p + "moe.experts.w2", {E, Fe, d}, true, li, true);
      if (Fs > 0) {
        add(p + "moe.shared.w13", {d, 2 * Fs}, true, li);
        add(p + "moe.shared.w2", {Fs, d}, true, li);
      }
    }
  }
  if (sel.head) {
    add("final_norm", {d}, false, -1, false, true);
    if (!s.tie_embeddings) add("head", {V, d}, true, -1);
  }
  return P;
}

// The parameter list of the held part (model_param_layout), each layer field set from its parameter name,
// and the storage: the flat fp32 parameter / gradient buffers and the bf16 copy, or FSDP's shards and slots.
void Model::Impl::build_params() {
  N = m.B_ * m.T_, d = s.d_model, V = s.vocab_size;
  H = s.attn.n_heads;
  Hkv = s.attn.kv_heads();
  Dqk = s.attn.qk_head_dim(), Dv = s.attn.v_dim();
  if (s.attn.type == AttnType::MLA) {
    dn = s.attn.qk_nope_head_dim, dr = s.attn.qk_rope_head_dim, rq = s.attn.q_lora_rank, rkv = s.attn.kv_lora_rank;
  } else {
    hd = s.attn.head_dim;
    Wqkv = (H + 2 * Hkv) * hd;
  }
  F = s.inter_size;
  if (s.is_moe()) {
    E = s.moe.n_routed_experts, K = s.moe.topk, Fe = s.moe.moe_inter_size, Fs = s.moe.n_shared_experts * Fe;
    Rmax = N * K;
    MT_CHECK(E % ep == 0, "Model", "n_routed_experts = ", E, " is not divisible by the expert-parallel size ", ep);
    El = E / ep, e0 = int64_t(ep_comm.rank()) * El;
  }
  ParamSelection sel;
  sel.layers.resize(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) sel.layers[l] = layers[l].held;
  sel.embedding = has_emb, sel.head = has_head, sel.ep = ep, sel.ep_rank = ep > 1 ? ep_comm.rank() : 0;
  m.params_ = model_param_layout(s, sel);
  m.n_params_ = m.params_.empty() ? 0 : m.params_.back().offset + param_padded_numel(m.params_.back().numel);

  static const struct {
    const char* suffix;
    int Layer::*field;
  } kFields[] = {{"attn_norm", &Layer::attn_norm},     {"attn.wdq", &Layer::wdq},         {"attn.q_norm", &Layer::q_norm},
                 {"attn.wuq", &Layer::wuq},            {"attn.wq", &Layer::wq},           {"attn.wdkv", &Layer::wdkv},
                 {"attn.wkr", &Layer::wkr},            {"attn.kv_norm", &Layer::kv_norm}, {"attn.wukv", &Layer::wukv},
                 {"attn.wqkv", &Layer::wqkv},          {"attn.wo", &Layer::wo},           {"ffn_norm", &Layer::ffn_norm},
                 {"mlp.w13", &Layer::w13},             {"mlp.w2", &Layer::w2},            {"moe.gate", &Layer::gate},
                 {"moe.experts.w13", &Layer::we13},    {"moe.experts.w2", &Layer::we2},   {"moe.shared.w13", &Layer::ws13},
                 {"moe.shared.w2", &Layer::ws2}};
  int moe_i = 0;
  for (int64_t l = 0; l < s.n_layers; ++l) {
    Layer& L = layers[size_t(l)];
    L.moe = s.is_moe_layer(l);
    if (L.moe) L.moe_index = moe_i++;
  }
  n_moe_total = moe_i;
  for (size_t i = 0; i < m.params_.size(); ++i) {
    const ParamEntry& e = m.params_[i];
    if (e.layer < 0) {
      if (e.name == "embed") emb = int(i);
      else if (e.name == "final_norm") final_norm = int(i);
      else if (e.name == "head") head = int(i);
      continue;
    }
    const std::string pre = "layers." + std::to_string(e.layer) + ".";
    const std::string suffix = e.name.substr(pre.size());
    bool found = false;
    for (const auto& f : kFields)
      if (suffix == f.suffix) layers[size_t(e.layer)].*(f.field) = int(i), found = true;
    MT_CHECK(found, "Model", "parameter ", e.name, " has no layer field");
  }
  if (has_head && s.tie_embeddings) head = emb;

  if (fs_opts) {
    fs_build();
  } else {
    m.pbuf_ = Tensor::zeros({m.n_params_}, DType::F32, MemCategory::Params, "params");
    m.gbuf_ = Tensor::zeros({m.n_params_}, DType::F32, MemCategory::Grads, "grads");
    if (!f32) wc = Tensor::zeros({m.n_params_}, DType::BF16, MemCategory::Params, "params.bf16");
  }
}

}  // namespace moetron
