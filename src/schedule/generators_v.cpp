// generators_v.cpp: the V-shape pipeline schedules zbv (zero-bubble V of the zero-bubble paper, section 6)
// and dualpipev (DeepSeek's DualPipeV) as compute-only action lists. Rank r owns two stages: "chunk 0" =
// stage r on the way down the V and "chunk 1" = stage 2*pp-1-r on the way back (v_placement). Not the
// lowering pass, not the validator, not the runtime; preconditions are checked in generators.cpp.
#include <algorithm>
#include <deque>

#include "schedule/generators_internal.h"

namespace moetron::sched {

namespace {

// Emits one rank's actions while counting, per chunk, the next forward, backward (B or I) and weight (W)
// micro-batch. Forwards and backwards of a chunk both run in micro-batch order.
struct RankEmitter {
  std::vector<Action>& row;
  int stage[2];
  int next_f[2] = {0, 0};
  int next_b[2] = {0, 0};  // B or I
  int next_w[2] = {0, 0};  // W by chunk counter (zbv)
  std::deque<Action> w_fifo;  // W's owed for I's, oldest first (dualpipev)

  RankEmitter(std::vector<Action>& r, int s0, int s1) : row(r), stage{s0, s1} {}

  Action take_f(int c) { return F(stage[c], next_f[c]++); }
  Action take_b(int c, Op op) {
    const Action a{op, stage[c], next_b[c]++};
    if (op == Op::I) w_fifo.push_back(W(a.stage, a.mb));
    return a;
  }
  void fwd(int c) { row.push_back(take_f(c)); }
  void bwd(int c, Op op) { row.push_back(take_b(c, op)); }
  void w_chunk(int c) { row.push_back(W(stage[c], next_w[c]++)); }
  void w_oldest() {
    if (w_fifo.empty()) return;
    row.push_back(w_fifo.front());
    w_fifo.pop_front();
  }
  void fb(int fc, int bc) {
    const Action f = take_f(fc);
    const Action b = take_b(bc, Op::B);
    row.push_back(FB(f.stage, f.mb, b.stage, b.mb, Op::B));
  }
};

}  // namespace

// zbv, the handcrafted ZB-V order (as torch.distributed.pipelining's ScheduleZBVZeroBubble builds it), for
// n = max(2*pp-1, M) micro-batches; actions on micro-batches >= M are then dropped, so fewer micro-batches
// than 2*pp-1 still give a valid (if bubblier) schedule. Rank r:
//   warm-up   2*(pp-r)-1 forwards of chunk 0; r pairs (F chunk 1, F chunk 0); pp-r triples (F, I, W) of chunk 1
//   steady    (F chunk 0 while any remain, I chunk 0, W chunk 0, F chunk 1, I chunk 1, W chunk 1) until every
//             forward has run
//   cool-down r pairs (I chunk 0, I chunk 1) whose W's wait; pp-r pairs (I chunk 0, W chunk 0 oldest first);
//             then the chunk-1 W's still owed, then the chunk-0 W's still owed.
Schedule gen_zbv(const GenSpec& g) {
  const int pp = g.pp, M = g.microbatches;
  Schedule s = empty_schedule(g, v_placement(pp));
  const int n = std::max(2 * pp - 1, M);
  for (int r = 0; r < pp; ++r) {
    std::vector<Action> full;
    RankEmitter e(full, r, 2 * pp - 1 - r);
    for (int k = 0; k < 2 * (pp - r) - 1; ++k) e.fwd(0);
    for (int k = 0; k < r; ++k) {
      e.fwd(1);
      e.fwd(0);
    }
    for (int k = 0; k < pp - r; ++k) {
      e.fwd(1);
      e.bwd(1, Op::I);
      e.w_chunk(1);
    }
    while (e.next_f[1] < e.next_f[0] || e.next_f[0] < n) {
      if (e.next_f[0] < n) e.fwd(0);
      e.bwd(0, Op::I);
      e.w_chunk(0);
      e.fwd(1);
      e.bwd(1, Op::I);
      e.w_chunk(1);
    }
    for (int k = 0; k < r; ++k) {
      e.bwd(0, Op::I);
      e.bwd(1, Op::I);
    }
    for (int k = 0; k < pp - r; ++k) {
      e.bwd(0, Op::I);
      e.w_chunk(0);
    }
    while (e.next_w[1] < e.next_b[1]) e.w_chunk(1);
    while (e.next_w[0] < e.next_b[0]) e.w_chunk(0);
    auto& row = s.actions[size_t(r)];
    for (const Action& a : full)
      if (a.mb < M) row.push_back(a);
  }
  return s;
}

// dualpipev, DeepSeek's DualPipeV order (dualpipev.py) for M >= 2*pp micro-batches. Rank r, with "F0" a
// forward of chunk 0, "B1" a full backward of chunk 1, "F0&B1" the two overlapped in one FB action:
//   1  2*(pp-1-r) x F0
//   2  (r+1) x (F0, F1)
//   3  (pp-1-r) x (I1, W of that I, F1)
//   4  (M-2*pp+r+1) x (F0&B1, F1&B0); the last rank runs its first F0 and B1 apart (DualPipeV does not overlap
//      them, which shortens the bubble)
//   5  (pp-1-r) x (B1, F1&B0)
//   6  (r+1) x (backward chunk 1, backward chunk 0): full B's in the first half, I's (weight gradient
//      deferred) from the middle iteration on; on odd ranks the middle iteration's chunk-1 half is already
//      an I, on even ranks only its chunk-0 half
//   7  (pp-1-r) x (oldest owed W, I0)
//   8  the owed W's, oldest first (r+1 of them).
Schedule gen_dualpipev(const GenSpec& g) {
  const int pp = g.pp, M = g.microbatches;
  Schedule s = empty_schedule(g, v_placement(pp));
  for (int r = 0; r < pp; ++r) {
    RankEmitter e(s.actions[size_t(r)], r, 2 * pp - 1 - r);
    const int down = pp - 1 - r;  // ranks below this one on the way down the V
    for (int k = 0; k < 2 * down; ++k) e.fwd(0);
    for (int k = 0; k < r + 1; ++k) {
      e.fwd(0);
      e.fwd(1);
    }
    for (int k = 0; k < down; ++k) {
      e.bwd(1, Op::I);
      e.w_oldest();
      e.fwd(1);
    }
    const int main_steps = M - 2 * pp + r + 1;
    for (int k = 0; k < main_steps; ++k) {
      if (k == 0 && r == pp - 1) {
        e.fwd(0);
        e.bwd(1, Op::B);
      } else {
        e.fb(0, 1);
      }
      e.fb(1, 0);
    }
    for (int k = 0; k < down; ++k) {
      e.bwd(1, Op::B);
      e.fb(1, 0);
    }
    bool split = false;
    const int half = (r + 1) / 2;
    for (int k = 0; k < r + 1; ++k) {
      if (k == half && r % 2 == 1) split = true;
      e.bwd(1, split ? Op::I : Op::B);
      if (k == half && r % 2 == 0) split = true;
      e.bwd(0, split ? Op::I : Op::B);
    }
    for (int k = 0; k < down; ++k) {
      e.w_oldest();
      e.bwd(0, Op::I);
    }
    while (!e.w_fifo.empty()) e.w_oldest();
  }
  return s;
}

}  // namespace moetron::sched
