// sim_internal.h: pieces shared by the lowering pass, the validator and the two simulators of the schedule
// IR (src/schedule/{lower,validate,simulate_lockstep,simulate_timed}.cpp): the data-flow rules between
// compute actions, the point-to-point message a communication action moves, and the structural half of the
// validator. Internal to the moetron_schedule library; not part of include/moetron/schedule.h.
#pragma once
#include <string>
#include <vector>

#include "moetron/schedule.h"

namespace moetron::sched::detail {

// The tensor a communication action moves, named by its producer: `fwd` = the activation of F(stage, mb)
// going to stage+1, otherwise the input gradient of B/I(stage, mb) going to stage-1.
struct Msg {
  bool fwd = true;
  int stage = 0;  // producer stage
  int mb = 0;
  int dst_stage() const { return fwd ? stage + 1 : stage - 1; }
};
// The message of a SEND_* / RECV_* action (a RECV names the consumer stage, so it is shifted back).
Msg msg_of(const Action& a);
Action send_of(const Msg& m);  // SEND_F / SEND_B naming the producer stage
Action recv_of(const Msg& m);  // RECV_F / RECV_B naming the consumer stage

// The (one or two) plain compute halves of a compute action: F/B/I/W itself, or an FB's forward then its
// backward half.
int halves(const Action& a, Action out[2]);

// Messages a plain compute action consumes from, and produces for, a stage on another rank (local neighbours
// pass tensors in memory and need none). F(s, m) consumes s-1's activation and produces s+1's; B or I (s, m)
// consumes s+1's gradient and produces s-1's; W moves nothing.
std::vector<Msg> remote_inputs(const Schedule& s, const Action& half);
std::vector<Msg> remote_outputs(const Schedule& s, const Action& half);

// "rank 2, action 7 '1B3': " — the prefix of every validator message about one action.
std::string where(int rank, int index, const Action& a);

// Validator phases 0-3 (shape, per-action rules, completeness, point-to-point order): everything but the
// deadlock search. Leaves `ok` true when the schedule is well formed.
Verdict validate_structure(const Schedule& s);

// Lock-step replay of a structurally valid schedule. On deadlock also gives the lowest stuck rank and its
// position (for the validator's verdict).
LockstepResult lockstep(const Schedule& s, int* stuck_rank, int* stuck_index);

}  // namespace moetron::sched::detail
