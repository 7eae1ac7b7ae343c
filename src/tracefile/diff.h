// tracefile/diff.h: `moetron trace diff A B`: two analyzed runs side by side (B against A): the step-time
// change split over compute, exposed communication and idle (the three deltas add up to it), exposed
// communication per collective kind, time per schedule action, and per op (kernels, modules and collective
// kinds) the time, count and achieved rate, with the ops only one side has. Every time is seconds per rank and step (the
// mean over ranks of the per-step figures), so runs with different step counts or a measured run and the
// planner's projected step compare directly. docs/profiling.md ("trace diff"). Not the analysis (analyze.h).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tracefile/analyze.h"

namespace moetron::tracefile {

struct Delta {
  std::string name;
  double a = 0, b = 0;
  double delta() const { return b - a; }
};

struct OpDelta {
  std::string name;
  std::string kind;    // "kernel", "module" (named "module:<name>") or "comm" ("comm:<collective kind>")
  std::string status;  // "both", "new" (only in B) or "missing" (only in A)
  double time_a = 0, time_b = 0;    // seconds per rank and step
  double count_a = 0, count_b = 0;  // calls per rank and step
  double rate_a = 0, rate_b = 0;    // achieved FLOP/s (kernels with FLOPs), bytes/s (other kernels), bus bytes/s (comm)
  std::string rate_unit;            // "FLOP/s", "B/s", "busB/s" or "-" (no FLOPs or bytes recorded)
};

struct TraceDiff {
  std::string a_dir, b_dir, a_source, b_source;
  Delta step;                              // mean step time over ranks
  std::vector<Delta> categories;           // compute, exposed_comm, idle: deltas sum to step.delta()
  Delta flops;                             // kernel FLOPs per rank and step: the work, free of timing noise
  std::vector<Delta> exposed_comm_by_kind; // splits the exposed_comm delta
  std::vector<Delta> actions;              // time inside actions per name (F, B, I, W, FB)
  std::vector<Delta> ranks;                // step time per rank (when both have the same world)
  std::vector<OpDelta> ops;                // by |time delta|, largest first
  std::vector<std::string> new_ops, missing_ops;
  std::string largest;                     // the category with the largest |delta|
};

TraceDiff diff(const Analysis& a, const Analysis& b);
nlohmann::json to_json(const TraceDiff& d);
std::string format_text(const TraceDiff& d, int top = 20);

}  // namespace moetron::tracefile
