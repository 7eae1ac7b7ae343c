// simulate_lockstep.cpp: the lock-step simulator of the schedule IR (simulate_lockstep). It replays a schedule
// in rounds to find deadlocks and count steps; it has no notion of time (simulate_timed.cpp has). Not the
// validator's structural checks (validate.cpp), which it runs first.
//
// Rules. Every step, each rank that has actions left looks at its next one and runs it if its inputs were
// produced in an EARLIER step (never in the same step), so a chain of k dependent actions takes k steps:
//   F(s, m)     after F(s-1, m); B/I(s, m) after F(s, m) and B/I(s+1, m) (s < last); W(s, m) after I(s, m);
//               FB after the inputs of both halves. In a lowered schedule an input from a stage on another
//               rank counts as produced once this rank's RECV of it has run; in a compute-only schedule,
//               once the producing action has run on its rank. Inputs from the same rank were produced
//               earlier in the rank's own list.
//   SEND        after the compute that produced its tensor (earlier on the same rank); never blocks.
//   RECV        after the matching SEND ran.
// Every action, communication included, takes one step. `steps` is the number of rounds until every list is
// done. When a round moves no rank while some have actions left, the schedule deadlocks; `error` then lists
// every stuck rank with its next action and what that action waits for, e.g.
//   "deadlock after 1 step: rank 0 waits at action 1 '0B0' for 1B0 or 1I0; rank 1 waits at action 0 '1F1' for 0F1"
// A structurally invalid schedule (see validate.cpp, phases 0-3) is refused with moetron::Error instead.
#include "moetron/check.h"
#include "moetron/schedule.h"
#include "schedule/sim_internal.h"

namespace moetron::sched {
namespace detail {

namespace {

// Step at which each thing happened; 0 = not yet.
struct Progress {
  int m = 0;
  std::vector<int> f, bwd, w;        // [stage * m + mb]
  std::vector<int> sent[2], recvd[2];  // [fwd?1:0][producer stage * m + mb]
  size_t at(int s, int mb) const { return size_t(s) * size_t(m) + size_t(mb); }
};

bool before(int when, int step) { return when > 0 && when < step; }

// What the plain compute half `h` still waits for at `step` ("" when ready).
std::string half_waits(const Schedule& s, const Progress& p, const Action& h, int step) {
  const bool cross_in = !remote_inputs(s, h).empty();
  if (h.op == Op::F) {
    if (h.stage == 0) return "";
    if (cross_in && s.lowered)
      return before(p.recvd[1][p.at(h.stage - 1, h.mb)], step) ? "" : to_string(recv_of({true, h.stage - 1, h.mb}));
    return before(p.f[p.at(h.stage - 1, h.mb)], step) ? "" : to_string(F(h.stage - 1, h.mb));
  }
  if (h.op == Op::W) return before(p.bwd[p.at(h.stage, h.mb)], step) ? "" : to_string(I(h.stage, h.mb));
  // B or I
  if (!before(p.f[p.at(h.stage, h.mb)], step)) return to_string(F(h.stage, h.mb));
  if (h.stage == s.n_stages - 1) return "";
  if (cross_in && s.lowered)
    return before(p.recvd[0][p.at(h.stage + 1, h.mb)], step) ? "" : to_string(recv_of({false, h.stage + 1, h.mb}));
  return before(p.bwd[p.at(h.stage + 1, h.mb)], step)
             ? ""
             : to_string(B(h.stage + 1, h.mb)) + " or " + to_string(I(h.stage + 1, h.mb));
}

std::string waits(const Schedule& s, const Progress& p, const Action& a, int step) {
  if (is_compute(a.op)) {
    Action h[2];
    const int nh = halves(a, h);
    for (int k = 0; k < nh; ++k)
      if (std::string w = half_waits(s, p, h[k], step); !w.empty()) return w;
    return "";
  }
  const Msg msg = msg_of(a);
  const size_t i = p.at(msg.stage, msg.mb);
  if (a.op == Op::SEND_F) return before(p.f[i], step) ? "" : to_string(F(msg.stage, msg.mb));
  if (a.op == Op::SEND_B)
    return before(p.bwd[i], step) ? "" : to_string(B(msg.stage, msg.mb)) + " or " + to_string(I(msg.stage, msg.mb));
  return before(p.sent[msg.fwd ? 1 : 0][i], step) ? "" : to_string(send_of(msg));
}

void run(Progress& p, const Action& a, int step) {
  if (is_compute(a.op)) {
    Action h[2];
    const int nh = halves(a, h);
    for (int k = 0; k < nh; ++k) {
      const size_t i = p.at(h[k].stage, h[k].mb);
      if (h[k].op == Op::F) p.f[i] = step;
      else if (h[k].op == Op::W) p.w[i] = step;
      else p.bwd[i] = step;
    }
    return;
  }
  const Msg msg = msg_of(a);
  const bool is_send = a.op == Op::SEND_F || a.op == Op::SEND_B;
  (is_send ? p.sent : p.recvd)[msg.fwd ? 1 : 0][p.at(msg.stage, msg.mb)] = step;
}

}  // namespace

LockstepResult lockstep(const Schedule& s, int* stuck_rank, int* stuck_index) {
  Progress p;
  p.m = s.n_microbatches;
  const size_t cells = size_t(s.n_stages) * size_t(s.n_microbatches);
  p.f.assign(cells, 0);
  p.bwd.assign(cells, 0);
  p.w.assign(cells, 0);
  for (int k = 0; k < 2; ++k) {
    p.sent[k].assign(cells, 0);
    p.recvd[k].assign(cells, 0);
  }
  std::vector<size_t> pc(size_t(s.pp), 0);
  std::vector<int> active;
  for (int r = 0; r < s.pp; ++r)
    if (!s.actions[size_t(r)].empty()) active.push_back(r);

  LockstepResult res;
  int step = 0;
  while (!active.empty()) {
    ++step;
    bool moved = false;
    std::vector<int> still;
    for (int r : active) {
      const auto& row = s.actions[size_t(r)];
      const Action& a = row[pc[size_t(r)]];
      if (waits(s, p, a, step).empty()) {
        run(p, a, step);
        moved = true;
        ++pc[size_t(r)];
      }
      if (pc[size_t(r)] < row.size()) still.push_back(r);
    }
    if (!moved) {
      res.deadlock = true;
      res.steps = step - 1;
      res.error = "deadlock after " + std::to_string(step - 1) + (step - 1 == 1 ? " step: " : " steps: ");
      for (size_t k = 0; k < active.size(); ++k) {
        const int r = active[k];
        const size_t i = pc[size_t(r)];
        const Action& a = s.actions[size_t(r)][i];
        res.error += (k ? "; " : "") + std::string("rank ") + std::to_string(r) + " waits at action " +
                     std::to_string(i) + " '" + to_string(a) + "' for " + waits(s, p, a, step);
      }
      if (stuck_rank) *stuck_rank = active.front();
      if (stuck_index) *stuck_index = int(pc[size_t(active.front())]);
      return res;
    }
    active.swap(still);
  }
  res.steps = step;
  return res;
}

}  // namespace detail

LockstepResult simulate_lockstep(const Schedule& s) {
  const Verdict v = detail::validate_structure(s);
  MT_CHECK(v.ok, "schedule", "simulate_lockstep: schedule '", s.name, "' is invalid: ", v.error);
  return detail::lockstep(s, nullptr, nullptr);
}

}  // namespace moetron::sched
