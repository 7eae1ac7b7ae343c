// parallel_rules.cpp: the parallel-degree rules of parallel_rules.h, in the order a user meets them (degrees,
// experts, heads and vocabulary, sequence, expert groups, ZeRO stage). Not the pipeline's rules.
#include "moetron/parallel_rules.h"

#include <sstream>

namespace moetron {

namespace {
template <class... A>
std::string rule(const char* key, int64_t value, const A&... why) {
  std::ostringstream os;
  os << "parallelism." << key << " = " << value << ": ";
  (os << ... << why);
  return os.str();
}
}  // namespace

std::string parallel_degree_error(const ModelSpec& m, int64_t seq_len, const ParallelDegrees& d) {
  const std::pair<const char*, int64_t> degrees[] = {{"tp", d.tp}, {"cp", d.cp}, {"ep", d.ep}, {"expert_tp", d.etp}};
  for (const auto& [key, v] : degrees)
    if (v < 1) return rule(key, v, "must be >= 1");
  if (d.dp < 0) return rule("dp", d.dp, "must be >= 1");
  if (!m.is_moe()) {
    if (d.ep > 1) return rule("ep", d.ep, "expert parallelism needs a MoE model");
    if (d.etp > 1) return rule("expert_tp", d.etp, "expert tensor parallelism needs a MoE model");
  } else {
    if (m.moe.n_routed_experts % d.ep != 0)
      return rule("ep", d.ep, "must divide model.n_routed_experts (", m.moe.n_routed_experts, ")");
    if (m.moe.moe_inter_size % d.etp != 0)
      return rule("expert_tp", d.etp, "must divide model.moe_inter_size (", m.moe.moe_inter_size, ")");
  }
  if (d.tp > 1) {
    if (m.attn.n_heads % d.tp != 0) return rule("tp", d.tp, "must divide model.n_heads (", m.attn.n_heads, ")");
    if (m.attn.type == AttnType::GQA && m.attn.n_kv_heads % d.tp != 0)
      return rule("tp", d.tp, "must divide model.n_kv_heads (", m.attn.n_kv_heads, ")");
    if (m.vocab_size % d.tp != 0)
      return rule("tp", d.tp, "must divide model.vocab_size (", m.vocab_size, "): the vocabulary is split over tp");
  }
  if (d.cp > 1 && seq_len % (2 * d.cp) != 0)
    return rule("cp", d.cp, "2 * cp must divide training.seq_len (", seq_len,
                "): the causal load balance gives each rank two chunks");
  if (d.tp > 1 && d.sp && (seq_len / d.cp) % d.tp != 0)
    return rule("tp", d.tp, "must divide the sequence per cp rank (", seq_len / d.cp, ") under sequence parallelism");
  if (d.dp > 0 && (d.tp * d.cp * d.dp) % (d.ep * d.etp) != 0)
    return rule("ep", d.ep, "ep x expert_tp (", d.ep * d.etp, ") must divide tp x cp x dp (", d.tp * d.cp * d.dp,
                "): expert groups are carved out of the tensor, context and data-parallel ranks");
  if (d.zero < 0 || d.zero > 3) return rule("zero", d.zero, "must be 0, 1, 2 or 3");
  return {};
}

}  // namespace moetron
