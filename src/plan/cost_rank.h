// cost_rank.h (internal to src/plan): the step-time terms of one pipeline rank outside the pipeline replay: the
// optimizer (gradient zeroing, the norm, AdamW), Muon's Newton-Schulz and the weight refresh, and the windows the
// data-parallel collectives have behind the pipeline replay. Used by cost.cpp's plan_time. Not the per-layer op
// costs (cost.cpp) and not the collectives' costs (comm_model.h).
#pragma once
#include "moetron/config.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"
#include "moetron/plan/pipeline.h"
#include "moetron/schedule.h"

#include <vector>

namespace moetron::plan {

double optimizer_rank(const Layout& l, const Hardware& h, const Recipe& rc, const RankMemory& rm);
double newton_schulz_rank(const JobConfig& c, const Layout& l, const Hardware& h, const Recipe& rc,
                          const StagePlan& sp, int r);
double refresh_rank(const Layout& l, const Hardware& h, const Recipe& rc, const RankMemory& rm);

// The data-parallel collectives of one pipeline rank, stage by stage, on one communication stream (Megatron's
// overlap_grad_reduce / overlap_param_gather issue them per model chunk in this order). A stage's gradients are
// final during its last backward: their reduction may start when that action starts (buckets stream out as the
// backward produces them). A stage's parameters must have arrived by the end of its first forward (buckets are
// waited for layer by layer). Times are the pipeline replay's; `end` is the pipeline's last action.
struct DpWindow {
  double last_bwd_start = 0;  // start of the stage's last backward (B, W, the FB holding it, or a carried W)
  double first_fwd_end = 0;   // end of the stage's first forward (F, or the FB holding it)
  double share = 0;           // the stage's fraction of the rank's parameters
};
// Seconds the reduction runs past `end`: the stages in the order their gradients become final, each after the
// previous one on the stream.
double reduce_overrun(std::vector<DpWindow> w, double total, double end);
// Seconds the rank's pipeline must wait for its parameters: the gathers issued at the start of the step in the
// order the stages first run forward; the largest lateness against a first forward's end delays everything after.
double gather_stall(std::vector<DpWindow> w, double total);
// The windows read off a timed replay: per rank, per stage it owns.
std::vector<std::vector<DpWindow>> dp_windows(const sched::TimedResult& r, int pp, int n_stages);

}  // namespace moetron::plan
