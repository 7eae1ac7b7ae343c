// parallel_rules.h: the rules that tie the parallel degrees (tp, cp, ep, expert_tp, dp, zero) to the model and
// the sequence, written once for both halves: the config validation (JobConfig::validate) and the planner's
// layouts (plan::layout_error, which checks millions of candidates: no allocation unless a rule is broken).
// Not the pipeline rules (resolve_pipeline) and not the launched world (the engine's mesh checks that).
#pragma once
#include <cstdint>
#include <string>

#include "moetron/spec.h"

namespace moetron {

struct ParallelDegrees {
  int64_t tp = 1, cp = 1, ep = 1, etp = 1;
  int64_t dp = 0;  // 0: not known yet (the world decides it; the rules that need dp are skipped)
  bool sp = false;  // sequence parallelism (applies with tp > 1)
  int64_t zero = 0;
};

// "" when every rule holds, else the first broken one as "parallelism.<key> = <value>: <why>" (the form of the
// config's messages, without the "invalid config: " lead).
std::string parallel_degree_error(const ModelSpec& m, int64_t seq_len, const ParallelDegrees& d);

}  // namespace moetron
