// model_params.cpp: the model's storage from its parameter table (moetron/param_layout.h, src/params/): the
// held part's entries with their layer fields, the flat fp32 parameter / gradient buffers and the bf16 copy, or
// FSDP's shards and slots. Not the table itself.
#include <string>

#include "model/model_impl.h"

namespace moetron {

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
  // Tensor parallelism: this rank's heads and widths (model_param_layout checks that tp divides them), and its rows
  // of the residual stream.
  MT_CHECK(N % tp == 0, "Model", "micro_batch_size * seq_len = ", N, " is not divisible by parallelism.tp = ", tp,
           ": under sequence parallelism each TP rank holds an equal share of the micro-batch's rows");
  Nr = N / tp;
  Vl = V / tp;  // model_param_layout checks that tp divides V
  if (tp > 1) {
    H /= tp, F /= tp, Fe /= tp, Fs /= tp;
    if (s.attn.type != AttnType::MLA) Hkv /= tp, Wqkv = (H + 2 * Hkv) * hd;
    else Hkv = H;
  }
  ParamSelection sel;
  sel.layers.resize(size_t(s.n_layers));  // the decoder layers (the MTP blocks come with the head)
  for (size_t l = 0; l < sel.layers.size(); ++l) sel.layers[l] = layers[l].held;
  sel.embedding = has_emb, sel.head = has_head, sel.ep = ep, sel.ep_rank = ep > 1 ? ep_comm.rank() : 0;
  sel.tp = tp, sel.tp_rank = tp_rank;
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
                 {"moe.shared.w2", &Layer::ws2},       {"attn.q_head_norm", &Layer::q_head_norm},
                 {"attn.k_head_norm", &Layer::k_head_norm}};
  int moe_i = 0;  // the MTP blocks' MoE layers are numbered after the main model's
  for (int64_t l = 0; l < s.n_blocks(); ++l) {
    Layer& L = layers[size_t(l)];
    L.moe = s.is_moe_block(l);
    if (L.moe) L.moe_index = moe_i++;
  }
  mtp.assign(size_t(s.mtp_layers), MtpParams{});
  n_moe_total = moe_i;
  for (size_t i = 0; i < m.params_.size(); ++i) {
    const ParamEntry& e = m.params_[i];
    if (e.layer < 0) {
      if (e.name == "embed") emb = int(i);
      else if (e.name == "final_norm") final_norm = int(i);
      else if (e.name == "head") head = int(i);
      continue;
    }
    const bool in_mtp = e.layer >= s.n_layers;  // mtp.<k>.block.<layer field> or mtp.<k>.<MtpParams field>
    const std::string mpre = "mtp." + std::to_string(e.layer - s.n_layers) + ".";
    const std::string pre = in_mtp ? mpre + "block." : "layers." + std::to_string(e.layer) + ".";
    if (in_mtp && e.name.compare(0, pre.size(), pre) != 0) {
      MtpParams& mp = mtp[size_t(e.layer - s.n_layers)];
      const std::string f = e.name.substr(mpre.size());
      int* slot = f == "enorm" ? &mp.enorm : f == "hnorm" ? &mp.hnorm : f == "eh_proj" ? &mp.eh_proj
                  : f == "norm" ? &mp.norm : nullptr;
      MT_CHECK(slot != nullptr, "Model", "parameter ", e.name, " has no MTP field");
      *slot = int(i);
      continue;
    }
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
