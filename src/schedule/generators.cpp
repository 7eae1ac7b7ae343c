// generators.cpp: the built-in pipeline schedules as compute-only action lists (gpipe, 1f1b,
// interleaved_1f1b, zb1p; the V shapes zbv and dualpipev live in generators_v.cpp), their preconditions
// (check_spec) and the name registry. Not the lowering pass (no SEND/RECV here), not the validator or the
// simulators, and not the runtime that executes a schedule.
//
// Orders follow the published schedules:
//   gpipe            all forwards, then all backwards (micro-batch order), as torch.distributed.pipelining's
//                    ScheduleGPipe.
//   1f1b             Megatron-Core's non-interleaved schedule: rank r runs pp-1-r warm-up forwards, then
//                    alternates one forward and one backward (forward first), then drains the backwards.
//   interleaved_1f1b Megatron-Core's interleaved schedule with its micro-batch group size per virtual stage
//                    (`group_size`, default pp): the forward order walks the table "group g, chunk 0..v-1,
//                    micro-batches of group g"; the backward order walks the same table with the chunks
//                    reversed; rank r warms up with 2*(pp-1-r) + (v-1)*group_size forwards.
//   zb1p             ZB-H1 of the zero-bubble paper: the 1F1B order with each backward split into I (input
//                    gradient) and W (weight gradient); rank r postpones its first r W's, which then trail
//                    one step behind and fill the cool-down bubble. The peak number of activation sets held on
//                    any rank stays pp, as 1F1B's rank 0.
//
// Preconditions (check_spec), each taken from the reference implementation of the schedule:
//   all              pp >= 1, pp_microbatches >= 1, at most kMaxComputeActions compute actions
//   gpipe            one stage per rank; any number of micro-batches (torch's ScheduleGPipe)
//   1f1b, zb1p       one stage per rank; pp_microbatches >= pp (torch's Schedule1F1B refuses fewer)
//   interleaved_1f1b pp >= 2 and pp_virtual_stages >= 2 (Megatron-Core refuses an interleaved schedule on one
//                    rank); group_size n (0 = pp) in [pp, pp_microbatches], so pp_microbatches >= pp; when
//                    pp_microbatches is not a multiple of n the last group holds the remainder, which must be
//                    >= pp (Megatron-Core refuses a smaller remainder: it would stall the pipeline). With the
//                    default n = pp that means pp_microbatches must be a multiple of pp.
//   zbv, dualpipev   exactly 2 stages per rank; zbv takes any number of micro-batches (fewer than 2*pp-1
//                    leave bubbles, as torch's ScheduleZBVZeroBubble); dualpipev needs pp_microbatches >= 2*pp
//                    (DeepSeek's DualPipeV and torch's ScheduleDualPipeV assert it)
//   group_size       must stay 0 for every schedule but interleaved_1f1b.
#include <algorithm>
#include <string>

#include "moetron/check.h"
#include "moetron/schedule.h"
#include "schedule/generators_internal.h"

namespace moetron::sched {

namespace {

const std::vector<std::string> kNames = {"gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev"};

std::string known_list() {
  std::string s;
  for (size_t i = 0; i < kNames.size(); ++i) s += (i ? ", " : "") + kNames[i];
  return s;
}

bool known(std::string_view name) { return std::find(kNames.begin(), kNames.end(), name) != kNames.end(); }

// gpipe: rank r = stage r runs F0..F(m-1) then B0..B(m-1).
Schedule gen_gpipe(const GenSpec& g) {
  Schedule s = empty_schedule(g, loop_placement(g.pp, g.pp));
  for (int r = 0; r < g.pp; ++r) {
    auto& row = s.actions[size_t(r)];
    for (int m = 0; m < g.microbatches; ++m) row.push_back(F(r, m));
    for (int m = 0; m < g.microbatches; ++m) row.push_back(B(r, m));
  }
  return s;
}

// 1F1B with optional I/W split (zb1p). Rank r: warm-up forwards F0..F(w-1) with w = pp-1-r; a steady phase of
// (F, backward) pairs; a cool-down of backwards. With `split`, each backward is an I, and rank r holds back its
// first r W's: after the (k+1)-th I (k >= r) it runs the W of micro-batch k-r, and the last r W's run after the
// final I.
Schedule gen_1f1b(const GenSpec& g, bool split) {
  Schedule s = empty_schedule(g, loop_placement(g.pp, g.pp));
  const int M = g.microbatches;
  for (int r = 0; r < g.pp; ++r) {
    auto& row = s.actions[size_t(r)];
    const int warm = warmup_forwards(g, r);
    const int hold = split ? std::min(r, M) : 0;
    int next_w = 0;
    auto backward = [&](int k) {  // the (k+1)-th backward of this rank, micro-batch k
      if (!split) {
        row.push_back(B(r, k));
        return;
      }
      row.push_back(I(r, k));
      if (k >= hold) row.push_back(W(r, next_w++));
    };
    for (int m = 0; m < warm; ++m) row.push_back(F(r, m));
    for (int k = 0; k < M - warm; ++k) {
      row.push_back(F(r, warm + k));
      backward(k);
    }
    for (int k = M - warm; k < M; ++k) backward(k);
    while (split && next_w < M) row.push_back(W(r, next_w++));
  }
  return s;
}

// Megatron-Core's interleaved 1F1B. The table lists (micro-batch, chunk) pairs in forward order: for each group
// of `n` consecutive micro-batches (the last group takes whatever is left), every chunk in turn runs the whole
// group. Forward k uses table[k]; backward k uses table[k] with the chunk mirrored (v-1-chunk). Rank r runs
// min(total, 2*(pp-1-r) + (v-1)*n) warm-up forwards, then alternates forward and backward, then drains. With
// ep_overlap: one warm-up forward more, and each steady-state forward / backward pair is one FB action.
Schedule gen_interleaved(const GenSpec& g) {
  const int pp = g.pp, v = g.vpp, M = g.microbatches;
  const int n = g.group_size > 0 ? g.group_size : pp;
  Schedule s = empty_schedule(g, loop_placement(pp, pp * v));
  struct Entry {
    int mb, chunk;
  };
  std::vector<Entry> table;
  table.reserve(size_t(M) * size_t(v));
  for (int first = 0; first < M; first += n) {
    const int last = std::min(first + n, M);  // Megatron: the group that reaches M ends at M
    for (int c = 0; c < v; ++c)
      for (int m = first; m < last; ++m) table.push_back({m, c});
  }
  const int total = M * v;
  for (int r = 0; r < pp; ++r) {
    auto& row = s.actions[size_t(r)];
    const int warm = warmup_forwards(g, r);
    auto fwd = [&](int k) { row.push_back(F(table[size_t(k)].chunk * pp + r, table[size_t(k)].mb)); };
    auto bwd = [&](int k) { row.push_back(B((v - 1 - table[size_t(k)].chunk) * pp + r, table[size_t(k)].mb)); };
    for (int k = 0; k < warm; ++k) fwd(k);
    for (int k = 0; k < total - warm; ++k) {
      fwd(warm + k);
      bwd(k);
      if (g.ep_overlap) {  // the pair as one FB action: forward half first, then the backward half
        const Action b = row.back();
        row.pop_back();
        const Action f = row.back();
        row.back() = FB(f.stage, f.mb, b.stage, b.mb, Op::B);
      }
    }
    for (int k = total - warm; k < total; ++k) bwd(k);
  }
  return s;
}

template <class... A>
[[noreturn]] void refuse(const GenSpec& g, const A&... what) {
  MT_FAIL("schedule", g.schedule, ": ", what...);
}

// Number of compute actions the generator emits at most (FB pairs count once, so split schedules bound
// dualpipev too).
int64_t compute_action_bound(const GenSpec& g) {
  const int64_t per_pair = uses_split_backward(g.schedule) || g.schedule == "dualpipev" ? 3 : 2;
  return per_pair * int64_t(g.pp) * int64_t(g.vpp) * int64_t(g.microbatches);
}

}  // namespace

Schedule empty_schedule(const GenSpec& g, std::vector<int> placement) {
  Schedule s;
  s.name = g.schedule;
  s.pp = g.pp;
  s.n_stages = int(placement.size());
  s.n_microbatches = g.microbatches;
  s.stage_rank = std::move(placement);
  s.actions.assign(size_t(g.pp), {});
  return s;
}

int interleaved_warmup(int pp, int vpp, int group_size, int rank) {
  return 2 * (pp - 1 - rank) + (vpp - 1) * group_size;
}

int warmup_forwards(const GenSpec& g, int rank) {
  MT_CHECK(rank >= 0 && rank < g.pp, "schedule", g.schedule, ": warmup_forwards: rank ", rank, " outside pp = ", g.pp);
  const int M = g.microbatches;
  if (g.schedule == "gpipe") return M;
  if (g.schedule == "1f1b" || g.schedule == "zb1p") return std::min(g.pp - 1 - rank, M);
  if (g.schedule == "interleaved_1f1b") {
    const int n = g.group_size > 0 ? g.group_size : g.pp;
    // ep_overlap: one more warm-up forward, so that both halves of every fused pair have their inputs.
    return std::min(M * g.vpp, interleaved_warmup(g.pp, g.vpp, n, rank) + (g.ep_overlap ? 1 : 0));
  }
  MT_FAIL("schedule", g.schedule, ": warmup_forwards is defined for gpipe, 1f1b, zb1p and interleaved_1f1b only");
}

const std::vector<std::string>& schedule_names() { return kNames; }

bool uses_split_backward(std::string_view schedule) {
  return schedule == "zb1p" || schedule == "zbv" || schedule == "dualpipev";
}

bool is_v_shape(std::string_view schedule) { return schedule == "zbv" || schedule == "dualpipev"; }

void check_spec(const GenSpec& g) {
  if (!known(g.schedule))
    MT_FAIL("schedule", "unknown pp_schedule '", g.schedule, "' (known: ", known_list(), ")");
  const std::string& name = g.schedule;
  if (g.pp < 1) refuse(g, "pp = ", g.pp, " must be >= 1");
  if (g.microbatches < 1) refuse(g, "pp_microbatches = ", g.microbatches, " must be >= 1");

  // Stages per rank.
  if (is_v_shape(name)) {
    if (g.vpp != 2)
      refuse(g, "needs exactly 2 stages per rank (pp_virtual_stages = ", g.vpp, "): the V puts stages r and 2*pp-1-r on rank r");
  } else if (name == "interleaved_1f1b") {
    if (g.vpp < 2)
      refuse(g, "pp_virtual_stages = ", g.vpp, " must be >= 2 (with one stage per rank use 1f1b)");
  } else if (g.vpp != 1) {
    refuse(g, "runs one stage per rank (pp_virtual_stages = ", g.vpp,
           "); use interleaved_1f1b, zbv or dualpipev for several stages per rank");
  }
  if (g.group_size != 0 && name != "interleaved_1f1b")
    refuse(g, "group_size = ", g.group_size, " applies to interleaved_1f1b only (leave it 0)");
  if (g.ep_overlap && name != "interleaved_1f1b")
    refuse(g, "ep_overlap applies to interleaved_1f1b only (the 1F1B all-to-all overlap fuses its steady-state "
              "forward / backward pairs)");

  // Size cap, checked before anything that depends on the size (the factors are checked one at a time so the
  // product cannot overflow).
  if (int64_t(g.pp) * int64_t(g.vpp) > kMaxComputeActions || g.microbatches > kMaxComputeActions ||
      compute_action_bound(g) > kMaxComputeActions)
    refuse(g, "pp * pp_virtual_stages * pp_microbatches = ", g.pp, " * ", g.vpp, " * ", g.microbatches,
           " gives more than kMaxComputeActions = ", kMaxComputeActions, " compute actions");

  // Micro-batch and shape rules, per schedule.
  if (name == "gpipe") return;  // any m >= 1
  if (name == "1f1b" || name == "zb1p") {
    if (g.microbatches < g.pp)
      refuse(g, "pp_microbatches = ", g.microbatches, " must be >= pp = ", g.pp);
    return;
  }
  if (name == "interleaved_1f1b") {
    if (g.pp < 2) refuse(g, "pp = ", g.pp, " must be >= 2 (with one rank every virtual stage is local; use 1f1b)");
    if (g.microbatches < g.pp)
      refuse(g, "pp_microbatches = ", g.microbatches, " must be >= pp = ", g.pp);
    const int n = g.group_size > 0 ? g.group_size : g.pp;
    if (g.group_size < 0) refuse(g, "group_size = ", g.group_size, " must be >= 0 (0 means pp)");
    if (n < g.pp || n > g.microbatches)
      refuse(g, "group_size = ", n, " must lie in [pp, pp_microbatches] = [", g.pp, ", ", g.microbatches,
             "] (Megatron's micro-batch group size per virtual stage)");
    const int rest = g.microbatches % n;
    if (rest != 0 && rest < g.pp)
      refuse(g, "pp_microbatches = ", g.microbatches, " leaves a last group of ", rest,
             " micro-batches (pp_microbatches mod group_size ", n, "), fewer than pp = ", g.pp,
             "; use a multiple of the group size or a remainder >= pp");
    return;
  }
  if (name == "zbv") return;  // any m >= 1: fewer than 2*pp-1 micro-batches leave bubbles but stay valid
  if (name == "dualpipev") {
    if (g.microbatches < 2 * g.pp)
      refuse(g, "pp_microbatches = ", g.microbatches, " must be >= 2 * pp = ", 2 * g.pp);
    return;
  }
}

Schedule generate(const GenSpec& spec) {
  check_spec(spec);
  const std::string& n = spec.schedule;
  if (n == "gpipe") return gen_gpipe(spec);
  if (n == "1f1b") return gen_1f1b(spec, false);
  if (n == "zb1p") return gen_1f1b(spec, true);
  if (n == "interleaved_1f1b") return gen_interleaved(spec);
  if (n == "zbv") return gen_zbv(spec);
  return gen_dualpipev(spec);
}

}  // namespace moetron::sched
