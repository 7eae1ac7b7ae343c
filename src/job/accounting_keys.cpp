// accounting_keys.cpp: which config keys an activation term's size comes from (activation_term_keys, see
// accounting.h), for the messages of the memory check and the run report. Not the sizes themselves (accounting.cpp).
#include <sstream>
#include <string>

#include "moetron/accounting.h"

namespace moetron {

namespace {
std::string kv(const char* key, int64_t v) { return std::string(key) + " = " + std::to_string(v); }
}  // namespace

std::string activation_term_keys(const ModelSpec& s, const std::string& term) {
  auto starts = [&](const char* p) { return term.rfind(p, 0) == 0; };
  const auto& at = s.attn;
  const auto& m = s.moe;
  if (starts("loss.")) return kv("model.d_model", s.d_model);
  if (term.size() >= 12 && term.compare(term.size() - 12, 12, "dropout_mask") == 0) {
    std::ostringstream p;
    p << s.dropout;
    return "model.dropout = " + p.str() + ", " + kv("model.d_model", s.d_model);
  }
  if (starts("router.")) return kv("model.n_routed_experts", m.n_routed_experts);
  if (starts("mlp.")) return kv("model.inter_size", s.inter_size);
  if (starts("shared."))
    return kv("model.n_shared_experts", m.n_shared_experts) + ", " + kv("model.moe_inter_size", m.moe_inter_size);
  if (term == "moe.gate_up" || term == "moe.act")
    return kv("model.topk", m.topk) + ", " + kv("model.moe_inter_size", m.moe_inter_size);
  if (starts("moe.")) return kv("model.topk", m.topk) + ", " + kv("model.d_model", s.d_model);
  if (starts("attn.") && !starts("attn_norm")) {
    if (at.type != AttnType::MLA) return kv("model.n_heads", at.n_heads) + ", " + kv("model.head_dim", at.head_dim);
    if (starts("attn.q_a")) return kv("model.q_lora_rank", at.q_lora_rank);
    if (starts("attn.kv_a")) return kv("model.kv_lora_rank", at.kv_lora_rank);
    return kv("model.n_heads", at.n_heads) + ", " + kv("model.qk_nope_head_dim", at.qk_nope_head_dim) + ", " +
           kv("model.v_head_dim", at.v_head_dim);
  }
  return kv("model.d_model", s.d_model);
}

}  // namespace moetron
