// plan/trace_export.h: the planner's projected step written in moetron's trace format (docs/profiling.md,
// source = "planner"), one rank<r>.trace.json per rank, so that `moetron trace analyze` reads a projection
// like a measured run and `moetron trace diff measured/ projected/` compares them per category. The step is
// the timed schedule simulator's replay with the cost model's per-stage durations (plan/cost.h), then the
// exposed data-parallel collectives and the optimizer. Not the cost model and not the trace reader.
#pragma once
#include <string>

#include "moetron/config.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"

namespace moetron::plan {

struct TraceExport {
  int files = 0;             // one per rank of the layout
  double step_time = 0;      // seconds: the written step (the simulated pipeline + exposed DP + optimizer)
  double pipeline_time = 0;  // seconds: the simulator's pipeline over all of the layout's micro-batches
  int64_t events = 0;        // X events over every file
};

// Writes DIR/rank<r>.trace.json for every rank of `l` (at most kMaxTraceRanks; a larger world is refused by
// name). The simulator replays every micro-batch (plan_time extrapolates long steps; the written step may then
// differ from plan_time's by that extrapolation).
TraceExport write_plan_trace(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o,
                             const std::string& dir);
inline constexpr int kMaxTraceRanks = 256;

}  // namespace moetron::plan
