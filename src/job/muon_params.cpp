// muon_params.cpp: the parameters Muon updates and their matrices (see moetron/muon_params.h), from the parameter
// names of model_param_layout and the ModelSpec. Not the trainer's Muon state and not the kernels.
#include "moetron/muon_params.h"

#include <algorithm>
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

std::vector<MuonShape> muon_layer_matrices(const ModelSpec& spec, int64_t layer) {
  ModelSpec s = spec;
  s.resolve();
  MT_CHECK(layer >= 0 && layer < s.n_layers, "muon_layer_matrices", "layer ", layer, " of ", s.n_layers);
  using K = MuonShape::Kind;
  std::vector<MuonShape> out;
  auto add = [&](K kind, int64_t count, int64_t rows, int64_t cols) {
    if (count > 0 && rows > 0 && cols > 0) out.push_back({kind, count, rows, cols});
  };
  const auto& a = s.attn;
  const int64_t d = s.d_model, H = a.n_heads;
  if (a.type != AttnType::MLA) {
    add(K::Sliced, 1, d, H * a.head_dim), add(K::Sliced, 2, d, a.kv_heads() * a.head_dim);  // wqkv: q, k, v
    add(K::Sliced, 1, H * a.head_dim, d);                                                     // wo
  } else {
    const int64_t dqk = a.qk_head_dim();
    if (a.q_lora_rank > 0) add(K::Replicated, 1, d, a.q_lora_rank), add(K::Sliced, 1, a.q_lora_rank, H * dqk);
    else add(K::Sliced, 1, d, H * dqk);                                         // wdq, wuq / wq
    add(K::Replicated, 1, d, a.kv_lora_rank), add(K::Replicated, 1, d, a.qk_rope_head_dim);  // wdkv, wkr
    add(K::Sliced, 1, a.kv_lora_rank, H * (a.qk_nope_head_dim + a.v_head_dim));             // wukv
    add(K::Sliced, 1, H * a.v_head_dim, d);                                                  // wo
  }
  if (!s.is_moe_layer(layer)) {
    add(K::Sliced, s.ffn == FfnKind::GELU ? 1 : 2, d, s.inter_size), add(K::Sliced, 1, s.inter_size, d);
  } else {
    const int64_t Fe = s.moe.moe_inter_size, Fs = s.moe.n_shared_experts * Fe, E = s.moe.n_routed_experts;
    add(K::Sliced, 2, d, Fs), add(K::Sliced, 1, Fs, d);                  // shared experts: gate, up; down
    add(K::Experts, 2 * E, d, Fe), add(K::Experts, E, Fe, d);            // each routed expert's gate, up; down
  }
  return out;
}

MuonLayerNumel muon_layer_numel(const ModelSpec& spec, int64_t layer) {
  MuonLayerNumel n;
  for (const MuonShape& m : muon_layer_matrices(spec, layer)) {
    const int64_t e = m.count * m.rows * m.cols;
    (m.kind == MuonShape::Kind::Sliced ? n.sliced : m.kind == MuonShape::Kind::Replicated ? n.replicated : n.experts) += e;
  }
  return n;
}

double newton_schulz_flops(int64_t rows, int64_t cols, int64_t steps) {
  const double m = double(std::min(rows, cols)), n = double(std::max(rows, cols));
  return double(steps) * (4 * m * m * n + 2 * m * m * m);
}

}  // namespace moetron
