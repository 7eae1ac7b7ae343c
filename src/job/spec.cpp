// spec.cpp: ModelSpec helpers: enum names, dense/MoE layer map, derived defaults and validation (including
// the size limits that keep absurd shapes out of every loop and allocation). Not the TOML loader
// (src/job/config.cpp) and not HF import (hf_config.cpp).
#include "moetron/spec.h"

#include <algorithm>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "moetron/check.h"

namespace moetron {

std::string_view to_string(AttnType v) {
  switch (v) {
    case AttnType::MHA: return "mha";
    case AttnType::GQA: return "gqa";
    case AttnType::MLA: return "mla";
  }
  return "?";
}
std::string_view to_string(ScoreFunc v) { return v == ScoreFunc::Softmax ? "softmax" : "sigmoid"; }
std::string_view to_string(LoadBalance v) {
  switch (v) {
    case LoadBalance::None: return "none";
    case LoadBalance::AuxLoss: return "aux_loss";
    case LoadBalance::AuxFree: return "aux_free";
  }
  return "?";
}
std::string_view to_string(DropPolicy v) { return v == DropPolicy::Probs ? "probs" : "position"; }
std::string_view to_string(BiasUpdate v) { return v == BiasUpdate::Sign ? "sign" : "proportional"; }
std::string_view to_string(FfnKind v) { return v == FfnKind::SwiGLU ? "swiglu" : "gelu"; }
std::string_view to_string(AttnImpl v) { return v == AttnImpl::Flash ? "flash" : "unfused"; }
std::string_view to_string(ExpertAct v) { return v == ExpertAct::SwiGLU ? "swiglu" : "clamped_swiglu"; }

bool ModelSpec::is_moe_layer(int64_t layer) const {
  if (!is_moe() || layer < first_k_dense) return false;
  return std::find(dense_layers.begin(), dense_layers.end(), layer) == dense_layers.end();
}

int64_t ModelSpec::n_moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < n_layers; ++l) n += is_moe_layer(l);
  return n;
}

void ModelSpec::resolve() {
  if (attn.type == AttnType::MLA) return;
  if (attn.n_kv_heads == 0) attn.n_kv_heads = attn.n_heads;
  if (attn.head_dim == 0 && attn.n_heads > 0 && d_model % attn.n_heads == 0) attn.head_dim = d_model / attn.n_heads;
}

namespace {
// Validation messages read "invalid config: model.<key> = <value>: <why>".
template <class V, class... A>
[[noreturn]] void bad(const char* key, const V& value, const A&... why) {
  std::ostringstream os;
  os << "invalid config: model." << key << " = " << value << ": ";
  (os << ... << why);
  throw Error(os.str());
}

// Size limits (docs/model.md, "Size limits"). Generous for real models (DeepSeek-V3 and the 1T / 2T proxies
// are orders of magnitude below), small enough that a loop over layers, heads or experts ends at once and
// that every product the accounting and the engine form from these sizes fits in int64.
constexpr int kMaxLayersLog2 = 14;   // n_layers
constexpr int kMaxWidthLog2 = 24;    // vocab_size, d_model, ffn widths, head dims, MLA ranks, H * head_dim
constexpr int kMaxCountLog2 = 16;    // n_heads, n_kv_heads, experts, n_group
constexpr int kMaxParamsLog2 = 48;   // total parameters (2.8e14; moe_2t has 2.05e12)

void at_most(const char* key, int64_t v, int log2) {
  if (v > (int64_t(1) << log2)) bad(key, v, "must be <= 2^", log2, " = ", int64_t(1) << log2, " (size limit)");
}

// Every size key against its limit, before anything multiplies or loops over them.
void check_model_size_limits(const ModelSpec& s) {
  const auto& a = s.attn;
  const auto& m = s.moe;
  at_most("n_layers", s.n_layers, kMaxLayersLog2);
  at_most("first_k_dense", s.first_k_dense, kMaxLayersLog2);
  at_most("mtp_layers", s.mtp_layers, kMaxLayersLog2);
  for (const auto& [key, v] : {std::pair<const char*, int64_t>{"vocab_size", s.vocab_size},
                               {"d_model", s.d_model},
                               {"inter_size", s.inter_size},
                               {"head_dim", a.head_dim},
                               {"q_lora_rank", a.q_lora_rank},
                               {"kv_lora_rank", a.kv_lora_rank},
                               {"qk_nope_head_dim", a.qk_nope_head_dim},
                               {"qk_rope_head_dim", a.qk_rope_head_dim},
                               {"v_head_dim", a.v_head_dim},
                               {"moe_inter_size", m.moe_inter_size}})
    at_most(key, v, kMaxWidthLog2);
  for (const auto& [key, v] : {std::pair<const char*, int64_t>{"n_heads", a.n_heads},
                               {"n_kv_heads", a.n_kv_heads},
                               {"n_routed_experts", m.n_routed_experts},
                               {"n_shared_experts", m.n_shared_experts},
                               {"topk", m.topk},
                               {"n_group", m.n_group},
                               {"topk_group", m.topk_group}})
    at_most(key, v, kMaxCountLog2);
  if (!(m.capacity_factor <= double(int64_t(1) << kMaxCountLog2)))
    bad("capacity_factor", m.capacity_factor, "must be <= 2^", kMaxCountLog2, " (size limit)");
}

// The widths a layer forms from two keys (each already within its limit, so the products fit).
void check_derived_widths(const ModelSpec& s) {
  const auto& a = s.attn;
  const int64_t lim = int64_t(1) << kMaxWidthLog2;
  auto width = [&](const char* key, int64_t v, const char* what, int64_t w) {
    if (w > lim) bad(key, v, what, " = ", w, " must be <= 2^", kMaxWidthLog2, " = ", lim, " (size limit)");
  };
  if (a.type == AttnType::MLA) {
    width("n_heads", a.n_heads, "n_heads * (qk_nope_head_dim + qk_rope_head_dim)",
          a.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim));
    width("n_heads", a.n_heads, "n_heads * (qk_nope_head_dim + v_head_dim)",
          a.n_heads * (a.qk_nope_head_dim + a.v_head_dim));
  } else {
    width("n_heads", a.n_heads, "(n_heads + 2 * n_kv_heads) * head_dim", (a.n_heads + 2 * a.n_kv_heads) * a.head_dim);
  }
  width("n_shared_experts", s.moe.n_shared_experts, "n_shared_experts * moe_inter_size",
        s.moe.n_shared_experts * s.moe.moe_inter_size);
}

// Total parameters in double (cannot overflow), against the limit; the message names the keys of the
// largest part.
void check_param_total(const ModelSpec& s, int64_t n_moe_layers) {
  const auto& a = s.attn;
  const auto& m = s.moe;
  const double d = double(s.d_model), H = double(a.n_heads), V = double(s.vocab_size);
  double attn;
  if (a.type == AttnType::MLA) {
    const double dqk = double(a.qk_nope_head_dim + a.qk_rope_head_dim), rq = double(a.q_lora_rank);
    const double rkv = double(a.kv_lora_rank);
    attn = (rq > 0 ? d * rq + rq + rq * H * dqk : d * H * dqk) + d * (rkv + double(a.qk_rope_head_dim)) + rkv +
           rkv * H * double(a.qk_nope_head_dim + a.v_head_dim) + H * double(a.v_head_dim) * d;
  } else {
    attn = d * double(a.n_heads + 2 * a.n_kv_heads) * double(a.head_dim) + H * double(a.head_dim) * d;
  }
  const double n_moe = double(n_moe_layers), n_dense = double(s.n_layers) - n_moe;
  const double L = double(s.n_layers), D = double(s.mtp_layers);
  const double mtp_moe = s.mtp_layers > 0 && n_moe_layers > 0 && s.is_moe_layer(s.n_layers - 1) ? D : 0;
  const double mtp_dense = D - mtp_moe;
  struct Part {
    double n;
    std::string keys;
  };
  auto kv = [](const char* k, auto v) { return std::string("model.") + k + " = " + std::to_string(v); };
  const std::vector<Part> parts = {
      {V * d * (s.tie_embeddings ? 1 : 2), kv("vocab_size", s.vocab_size) + ", " + kv("d_model", s.d_model)},
      {(L + D) * attn, kv("n_layers", s.n_layers) + ", " + kv("d_model", s.d_model) + ", " + kv("n_heads", a.n_heads)},
      {D * (2 * d * d + 3 * d), kv("mtp_layers", s.mtp_layers) + ", " + kv("d_model", s.d_model)},
      {(n_dense + mtp_dense) * (s.ffn == FfnKind::GELU ? 2 : 3) * d * double(s.inter_size),
       kv("n_layers", s.n_layers) + ", " + kv("d_model", s.d_model) + ", " + kv("inter_size", s.inter_size)},
      {(n_moe + mtp_moe) * (double(m.n_routed_experts + m.n_shared_experts) * 3 * d * double(m.moe_inter_size) +
                double(m.n_routed_experts) * (d + 1)),
       kv("n_layers", s.n_layers) + ", " + kv("n_routed_experts", m.n_routed_experts) + ", " +
           kv("d_model", s.d_model) + ", " + kv("moe_inter_size", m.moe_inter_size)},
  };
  double total = (L + D) * 2 * d + d;
  const Part* big = &parts[0];
  for (const auto& p : parts) {
    total += p.n;
    if (p.n > big->n) big = &p;
  }
  const double lim = double(int64_t(1) << kMaxParamsLog2);
  if (total > lim) {
    std::ostringstream os;
    os << "invalid config: the model has " << total << " parameters, more than 2^" << kMaxParamsLog2 << " = " << lim
       << " (size limit); the largest part comes from " << big->keys;
    throw Error(os.str());
  }
}
}  // namespace

void ModelSpec::validate() const {
  if (vocab_size <= 0) bad("vocab_size", vocab_size, "must be > 0");
  if (d_model <= 0) bad("d_model", d_model, "must be > 0");
  if (n_layers <= 0) bad("n_layers", n_layers, "must be > 0");
  check_model_size_limits(*this);
  if (first_k_dense < 0 || first_k_dense > n_layers)
    bad("first_k_dense", first_k_dense, "must be in [0, n_layers = ", n_layers, "]");
  if (first_k_dense > 0 && !dense_layers.empty()) {
    std::string list = "[";
    for (size_t i = 0; i < dense_layers.size(); ++i) list += (i ? ", " : "") + std::to_string(dense_layers[i]);
    bad("dense_layers", list + "]", "set together with model.first_k_dense = ", first_k_dense, "; use one or the other");
  }
  std::vector<char> listed(size_t(n_layers), 0);  // linear in the list: it may be long
  for (int l : dense_layers) {
    if (l < 0 || l >= n_layers) bad("dense_layers", l, "layer id out of range [0, ", n_layers, ")");
    if (listed[size_t(l)]++) bad("dense_layers", l, "listed twice");
  }
  int64_t n_moe = 0;  // n_moe_layers(), in one pass
  if (is_moe())
    for (int64_t l = first_k_dense; l < n_layers; ++l) n_moe += !listed[size_t(l)];
  const int64_t n_dense = n_layers - n_moe;
  if (!(norm_eps > 0)) bad("norm_eps", norm_eps, "must be > 0");
  if (!(init_std > 0)) bad("init_std", init_std, "must be > 0");
  if (!(rope_theta > 0)) bad("rope_theta", rope_theta, "must be > 0");
  if (n_dense > 0 && inter_size <= 0)
    bad("inter_size", inter_size, "must be > 0: the model has ", n_dense, " dense layer(s)");
  if (inter_size < 0) bad("inter_size", inter_size, "must be >= 0");
  if (mtp_layers < 0) bad("mtp_layers", mtp_layers, "must be >= 0 (0 = no multi-token prediction)");
  if (!(mtp_loss_weight >= 0 && mtp_loss_weight <= 1e6))
    bad("mtp_loss_weight", mtp_loss_weight, "must be a finite number >= 0 (DeepSeek-V3 used 0.3, then 0.1)");
  if (!(dropout >= 0 && dropout < 1)) bad("dropout", dropout, "must be in [0, 1) (0 = no dropout)");
  if (moe.expert_act != ExpertAct::SwiGLU && !is_moe())
    bad("expert_act", to_string(moe.expert_act),
        "is the routed experts' activation: the model has none (n_routed_experts = 0)");
  if (ffn == FfnKind::GELU && is_moe())
    bad("ffn", to_string(ffn), "the gelu FFN is for dense models (n_routed_experts = 0); experts are SwiGLU");

  // Attention.
  const auto& a = attn;
  if (a.n_heads <= 0) bad("n_heads", a.n_heads, "must be > 0");
  if (a.type == AttnType::MHA || a.type == AttnType::GQA) {
    if (a.type == AttnType::MHA && d_model % a.n_heads != 0)
      bad("n_heads", a.n_heads, "d_model (", d_model, ") must be divisible by n_heads for mha attention");
    if (a.head_dim <= 0)
      bad("head_dim", a.head_dim, "must be > 0 (or omitted with d_model divisible by n_heads = ", a.n_heads, ")");
    if (a.head_dim % 2 != 0) bad("head_dim", a.head_dim, "must be even (RoPE rotates pairs)");
    if (a.type == AttnType::MHA && a.n_kv_heads != a.n_heads)
      bad("n_kv_heads", a.n_kv_heads, "mha attention needs n_kv_heads == n_heads (", a.n_heads,
          "); use attn_type = \"gqa\"");
    if (a.n_kv_heads <= 0) bad("n_kv_heads", a.n_kv_heads, "must be > 0");
    if (a.n_heads % a.n_kv_heads != 0)
      bad("n_kv_heads", a.n_kv_heads, "must divide n_heads (", a.n_heads, ")");
    if (a.q_lora_rank || a.kv_lora_rank || a.qk_nope_head_dim || a.qk_rope_head_dim || a.v_head_dim)
      bad("attn_type", to_string(a.type), "MLA dimensions (q_lora_rank, kv_lora_rank, qk_*_head_dim, v_head_dim) "
          "are set but attention is not mla");
  } else {
    if (a.kv_lora_rank <= 0) bad("kv_lora_rank", a.kv_lora_rank, "mla attention needs kv_lora_rank > 0");
    if (a.q_lora_rank < 0) bad("q_lora_rank", a.q_lora_rank, "must be >= 0 (0 = no q compression)");
    if (a.qk_nope_head_dim <= 0) bad("qk_nope_head_dim", a.qk_nope_head_dim, "mla attention needs it > 0");
    if (a.qk_rope_head_dim <= 0 || a.qk_rope_head_dim % 2 != 0)
      bad("qk_rope_head_dim", a.qk_rope_head_dim, "mla attention needs it > 0 and even (RoPE rotates pairs)");
    if (a.v_head_dim <= 0) bad("v_head_dim", a.v_head_dim, "mla attention needs it > 0");
    if (a.qk_norm) bad("qk_norm", "true", "not supported with mla attention (MLA normalizes its latents)");
    if (a.n_kv_heads != 0 && a.n_kv_heads != a.n_heads)
      bad("n_kv_heads", a.n_kv_heads, "mla attention has n_heads (", a.n_heads, ") k/v heads; leave it unset");
  }

  check_derived_widths(*this);

  // MoE.
  const auto& m = moe;
  if (m.n_routed_experts < 0) bad("n_routed_experts", m.n_routed_experts, "must be >= 0 (0 = dense model)");
  if (m.n_shared_experts < 0) bad("n_shared_experts", m.n_shared_experts, "must be >= 0");
  if (!is_moe()) {
    if (m.n_shared_experts > 0)
      bad("n_shared_experts", m.n_shared_experts, "shared experts need n_routed_experts > 0");
    check_param_total(*this, n_moe);
    return;
  }
  if (n_moe == 0) bad("first_k_dense", first_k_dense, "every layer is dense although n_routed_experts > 0");
  if (m.moe_inter_size <= 0) bad("moe_inter_size", m.moe_inter_size, "must be > 0 for a MoE model");
  if (m.topk <= 0) bad("topk", m.topk, "must be > 0");
  if (m.topk > m.n_routed_experts)
    bad("topk", m.topk, "must be <= n_routed_experts (", m.n_routed_experts, ")");
  if (m.n_group <= 0) bad("n_group", m.n_group, "must be >= 1 (1 = no group-limited routing)");
  if (m.n_routed_experts % m.n_group != 0)
    bad("n_group", m.n_group, "must divide n_routed_experts (", m.n_routed_experts, ")");
  if (m.topk_group < 1 || m.topk_group > m.n_group)
    bad("topk_group", m.topk_group, "must be in [1, n_group = ", m.n_group, "]");
  if (m.topk > m.topk_group * (m.n_routed_experts / m.n_group))
    bad("topk", m.topk, "more than the ", m.topk_group * (m.n_routed_experts / m.n_group),
        " experts in topk_group (", m.topk_group, ") groups of ", m.n_routed_experts / m.n_group);
  if (!(m.route_scale > 0)) bad("route_scale", m.route_scale, "must be > 0");
  if (!(m.aux_coef >= 0)) bad("aux_coef", m.aux_coef, "must be >= 0");
  if (!(m.bias_update_rate >= 0)) bad("bias_update_rate", m.bias_update_rate, "must be >= 0");
  if (m.sinkhorn_iters < 0 || m.sinkhorn_iters > 1000) bad("sinkhorn_iters", m.sinkhorn_iters, "must be in [0, 1000]");
  if (!(m.route_capacity == 0 || (m.route_capacity >= 1 && m.route_capacity <= 1e6)))
    bad("route_capacity", m.route_capacity, "must be 0 (off) or in [1, 1e6]");
  if (m.route_capacity > 0 && m.n_group > 1)
    bad("route_capacity", m.route_capacity, "is not implemented with group-limited routing (n_group = ", m.n_group, ")");
  if (!(m.z_loss_coef >= 0)) bad("z_loss_coef", m.z_loss_coef, "must be >= 0");
  if (!(m.capacity_factor >= 0)) bad("capacity_factor", m.capacity_factor, "must be >= 0 (0 = dropless)");
  check_param_total(*this, n_moe);
}

}  // namespace moetron
