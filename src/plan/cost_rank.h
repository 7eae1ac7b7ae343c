// cost_rank.h (internal to src/plan): the step-time terms of one pipeline rank outside the pipeline replay: the
// optimizer (gradient zeroing, the norm, AdamW), Muon's Newton-Schulz and the weight refresh. Used by cost.cpp's
// plan_time. Not the per-layer op costs (cost.cpp) and not the data-parallel collectives.
#pragma once
#include "moetron/config.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"
#include "moetron/plan/pipeline.h"

namespace moetron::plan {

double optimizer_rank(const Layout& l, const Hardware& h, const Recipe& rc, const RankMemory& rm);
double newton_schulz_rank(const JobConfig& c, const Layout& l, const Hardware& h, const Recipe& rc,
                          const StagePlan& sp, int r);
double refresh_rank(const Layout& l, const Hardware& h, const Recipe& rc, const RankMemory& rm);

}  // namespace moetron::plan
