// generators_internal.h: helpers shared by the schedule generators (generators.cpp, generators_v.cpp) inside
// the moetron_schedule library. Not part of the public API (include/moetron/schedule.h is) and not used by
// the lowering pass, the validator or the simulators.
#pragma once
#include <vector>

#include "moetron/schedule.h"

namespace moetron::sched {

// Megatron-Core's interleaved warm-up forward count for `rank` (before capping at pp_microbatches * vpp):
// 2 * (pp - 1 - rank) + (vpp - 1) * group_size.
int interleaved_warmup(int pp, int vpp, int group_size, int rank);

// A schedule named g.schedule with g.pp empty rank lists, g.microbatches and the given stage placement.
Schedule empty_schedule(const GenSpec& g, std::vector<int> placement);

// The V-shape generators (placement v_placement(pp)); the caller has run check_spec.
Schedule gen_zbv(const GenSpec& g);
Schedule gen_dualpipev(const GenSpec& g);

}  // namespace moetron::sched
