// param_layout.cpp: a model's parameter table (see moetron/param_layout.h): the list for the whole model or a
// part of it (the layers of this rank's pipeline stages, with or without the embedding and the head, this rank's
// experts under EP), and each element's initial value. Not the model's buffers (src/model/param_layout.cpp).
#include "moetron/param_layout.h"

#include <string>

#include "moetron/check.h"
#include "moetron/rng.h"

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

void init_param_elements(float* dst, const ParamEntry& e, uint64_t seed, int64_t first, int64_t count) {
  if (e.ones) std::fill(dst, dst + count, 1.0f);
  else fill_normal(dst, count, rng_key(seed, e.name), uint64_t(e.shard_first + first), 0.0f, e.init_std);
}

}  // namespace moetron
