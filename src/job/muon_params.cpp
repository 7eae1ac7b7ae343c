// muon_params.cpp: the parameters Muon updates and their matrices (see moetron/muon_params.h), from the parameter
// names of model_param_layout and the ModelSpec. Not the trainer's Muon state and not the kernels.
#include "moetron/muon_params.h"

#include <string>

#include "moetron/check.h"

namespace moetron {

namespace {
bool ends_with(std::string_view s, std::string_view t) {
  return s.size() >= t.size() && s.substr(s.size() - t.size()) == t;
}
}  // namespace

MuonMatrices muon_matrices(const ModelSpec& spec, std::string_view name, const std::vector<int64_t>& shape) {
  MuonMatrices m;
  // Decoder-block weights only (the embedding, the head and the final norm are outside "layers."), 2-D or stacked
  // experts, never the router; the MTP depths' blocks and projections likewise (mtp.<k>.block.*, mtp.<k>.eh_proj).
  const bool mtp = name.substr(0, 4) == "mtp." &&
                   (name.find(".block.") != std::string_view::npos || ends_with(name, ".eh_proj"));
  if ((name.substr(0, 7) != "layers." && !mtp) || ends_with(name, "moe.gate")) return m;
  const bool stacked = name.find("moe.experts.") != std::string_view::npos;
  if (shape.size() != (stacked ? 3u : 2u)) return m;
  m.count = stacked ? shape[0] : 1;
  m.rows = shape[shape.size() - 2], m.cols = shape[shape.size() - 1];
  if (ends_with(name, "attn.wqkv")) {
    ModelSpec s = spec;
    s.resolve();
    const int64_t hd = s.attn.head_dim, q = s.attn.n_heads * hd, kv = s.attn.kv_heads() * hd;
    MT_CHECK(q + 2 * kv == m.cols, "muon_matrices", std::string(name), ": ", m.cols, " columns for q ", q, " + 2 x kv ",
             kv, " (a tensor-parallel slice? Muon refuses tp > 1)");
    m.col_segs = {q, kv, kv};
  } else if (ends_with(name, ".w13")) {  // dense, shared or routed SwiGLU: [gate | up]
    MT_CHECK(m.cols % 2 == 0, "muon_matrices", std::string(name), ": an odd width ", m.cols, " for gate | up");
    m.col_segs = {m.cols / 2, m.cols / 2};
  } else {
    m.col_segs = {m.cols};
  }
  if (m.count == 0 || m.rows == 0 || m.cols == 0) m.count = 0;
  return m;
}

MuonLayerNumel muon_layer_numel(const ModelSpec& spec, int64_t layer) {
  ModelSpec s = spec;
  s.resolve();
  MT_CHECK(layer >= 0 && layer < s.n_layers, "muon_layer_numel", "layer ", layer, " of ", s.n_layers);
  MuonLayerNumel n;
  const auto& a = s.attn;
  const int64_t d = s.d_model, H = a.n_heads;
  if (a.type != AttnType::MLA) {
    n.sliced += d * (H + 2 * a.kv_heads()) * a.head_dim + H * a.head_dim * d;  // wqkv, wo
  } else {
    const int64_t dqk = a.qk_head_dim();
    if (a.q_lora_rank > 0) n.replicated += d * a.q_lora_rank, n.sliced += a.q_lora_rank * H * dqk;  // wdq, wuq
    else n.sliced += d * H * dqk;                                                                   // wq
    n.replicated += d * a.kv_lora_rank + d * a.qk_rope_head_dim;                                    // wdkv, wkr
    n.sliced += a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim) + H * a.v_head_dim * d;    // wukv, wo
  }
  if (!s.is_moe_layer(layer)) {
    n.sliced += (s.ffn == FfnKind::GELU ? 2 : 3) * d * s.inter_size;
  } else {
    const int64_t per = 3 * d * s.moe.moe_inter_size;
    n.sliced += s.moe.n_shared_experts * per;
    n.experts += s.moe.n_routed_experts * per;
  }
  return n;
}

}  // namespace moetron
