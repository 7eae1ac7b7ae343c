// schedule.h: the pipeline schedule IR shared by the engine (executes it), the planner (replays it) and
// pp_vis (draws it): per pipeline rank an ordered list of actions; generators, the lowering pass that adds
// point-to-point communication, the validator, the lock-step and timed simulators, and the text/CSV form.
// Not the pipeline runtime (src/parallel/) and not the layer layout (pp_layout.h). Depends on nothing of the
// engine: the planner links this without kernels or model.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moetron::sched {

// ---- actions ---------------------------------------------------------------------------------------------
// Compute: F forward, B full backward (input + weight gradient), I input gradient only, W weight gradient
// only (after its I), FB one micro-batch's forward overlapped with another's backward (DualPipe; the second
// half is `stage2`/`mb2`). Communication (added by lower()): SEND_F / RECV_F move a forward activation from
// stage s to s+1, SEND_B / RECV_B move an input gradient from stage s to s-1. A SEND names the stage that
// produced the tensor, a RECV the stage that consumes it (so `2SEND_F5` pairs with `3RECV_F5`).
enum class Op : uint8_t { F, B, I, W, FB, SEND_F, RECV_F, SEND_B, RECV_B };

struct Action {
  Op op = Op::F;
  int32_t stage = 0;   // global stage id, 0 .. n_stages-1
  int32_t mb = 0;      // micro-batch id, 0 .. n_microbatches-1
  // FB only: the backward half (the forward half is stage/mb): B or I, its stage and micro-batch.
  Op op2 = Op::B;
  int32_t stage2 = -1;
  int32_t mb2 = -1;
  bool operator==(const Action&) const = default;
};

inline Action F(int s, int m) { return {Op::F, s, m}; }
inline Action B(int s, int m) { return {Op::B, s, m}; }
inline Action I(int s, int m) { return {Op::I, s, m}; }
inline Action W(int s, int m) { return {Op::W, s, m}; }
inline Action FB(int fs, int fm, int bs, int bm, Op bwd = Op::B) { return {Op::FB, fs, fm, bwd, bs, bm}; }
// The halves of an FB action as plain actions (for others: the action itself, twice).
inline Action fwd_half(const Action& a) { return a.op == Op::FB ? Action{Op::F, a.stage, a.mb} : a; }
inline Action bwd_half(const Action& a) { return a.op == Op::FB ? Action{a.op2, a.stage2, a.mb2} : a; }

bool is_compute(Op op);  // F, B, I, W, FB
bool is_comm(Op op);     // SEND_* / RECV_*

// Text form: "<stage><OP><mb>", e.g. 0F3, 1B0, 1I2, 1W2, 2SEND_F5, 3RECV_B1; FB as "<fwd>&<bwd>", e.g.
// "0F3&5B1" (the backward half may be B or I; an FB with an I half needs its W later).
std::string to_string(const Action& a);
Action parse_action(std::string_view text);  // throws moetron::Error naming the text and what is wrong

// ---- schedules -------------------------------------------------------------------------------------------
// `stage_rank[s]` places stage s on a pipeline rank. Interleaved schedules put stage s on rank s mod pp;
// V shapes (zbv, dualpipev) put stage s on rank s for s < pp and on rank 2*pp-1-s after that.
struct Schedule {
  std::string name;     // generator name or "csv"
  int pp = 1;           // pipeline ranks
  int n_stages = 1;     // pp * stages per rank
  int n_microbatches = 1;
  std::vector<int> stage_rank;                // [n_stages]
  std::vector<std::vector<Action>> actions;  // [pp][...], in execution order
  bool lowered = false;                       // communication actions present
  int stages_per_rank() const { return n_stages / pp; }
  bool operator==(const Schedule&) const = default;
};

// Stage placements.
std::vector<int> loop_placement(int pp, int n_stages);  // s -> s mod pp
std::vector<int> v_placement(int pp);                   // 2*pp stages in a V

// ---- generators ------------------------------------------------------------------------------------------
// Names: gpipe, 1f1b, interleaved_1f1b, zb1p, zbv, dualpipev. `vpp` is stages per rank (1 for gpipe, 1f1b
// and zb1p; >= 2 for interleaved_1f1b; exactly 2 for zbv and dualpipev). `group_size` is Megatron's
// micro-batch group size per virtual stage for interleaved_1f1b (0 = pp). Every generator checks its
// preconditions and throws a moetron::Error that names the schedule and the rule, e.g.
// "[schedule] 1f1b: pp_microbatches = 2 must be >= pp = 4".
struct GenSpec {
  std::string schedule = "1f1b";
  int pp = 1;
  int vpp = 1;
  int microbatches = 1;
  int group_size = 0;
  // interleaved_1f1b only: the 1F1B all-to-all overlap. One more warm-up forward per rank, then every
  // steady-state (forward, backward) pair fused into one FB action, so that one micro-batch's forward and another
  // micro-batch's backward can interleave layer by layer and each hides the other's EP dispatch / combine (the
  // timed simulator charges an FB max(f + b, a2a_f + a2a_b)). Each stage's backwards keep micro-batch order.
  bool ep_overlap = false;
};
Schedule generate(const GenSpec& spec);  // compute actions only (lowered = false); calls check_spec first
// The preconditions alone (cheap; config validation calls it): known name, pp/vpp/microbatches/group_size
// rules of that schedule, and a size cap (at most kMaxComputeActions compute actions, so an absurd
// pp * vpp * microbatches is refused before anything is allocated).
void check_spec(const GenSpec& spec);
inline constexpr int64_t kMaxComputeActions = int64_t(1) << 24;
const std::vector<std::string>& schedule_names();
// Forward actions rank `rank` runs before its first backward, as the generator emits them (gpipe: every
// micro-batch; 1f1b / zb1p: min(pp - 1 - rank, microbatches); interleaved_1f1b: min(microbatches * vpp,
// 2 * (pp - 1 - rank) + (vpp - 1) * group_size), plus one under ep_overlap). These are the forwards that no
// backward pairs with in the warm-up, and as many backwards run unpaired in the cool-down. The V-shaped
// schedules are refused (their warm-up mixes chunks; see generators_v.cpp).
int warmup_forwards(const GenSpec& spec, int rank);
bool uses_split_backward(std::string_view schedule);  // I/W rather than B
bool is_v_shape(std::string_view schedule);

// ---- lowering --------------------------------------------------------------------------------------------
// Adds SEND/RECV around every compute action whose producer or consumer stage sits on another rank; the
// sender's lowering places the matching RECV in the peer's list just before the consumer. Stages on the same
// rank pass tensors locally (no action). Between any two ranks the point-to-point calls appear in the same
// order on both sides, so blocking receives with non-blocking sends cannot hang a valid schedule.
Schedule lower(const Schedule& compute_only);

// ---- validation ------------------------------------------------------------------------------------------
// Per stage: exactly n_microbatches forwards; per micro-batch a complete backward (one B, or one I then one
// W, counting the halves of FB actions); every B/I after its F (and after the next stage's B/I), every W
// after its I, each compute action on the rank that owns its stage; for lowered schedules every SEND has one
// matching RECV on the peer and vice versa. `error` names the first bad action:
//   "rank 2, action 7 '1B3': no F for stage 1 mb 3 before it"
struct Verdict {
  bool ok = true;
  std::string error;
  int rank = -1;
  int index = -1;
};
Verdict validate(const Schedule& s);
void check_valid(const Schedule& s);  // throws moetron::Error with the verdict's message

// ---- simulators ------------------------------------------------------------------------------------------
// Lock-step: every step each rank tries its next action; a compute action runs when its inputs were produced
// in an earlier step (a RECV when its SEND has run, or for unlowered schedules when the producing compute
// action ran on another rank in an earlier step or earlier on this rank). Finds deadlocks and counts steps.
struct LockstepResult {
  bool deadlock = false;
  int steps = 0;
  std::string error;  // on deadlock: each stuck rank's next action
};
LockstepResult simulate_lockstep(const Schedule& s);

// Timed replay of a lowered schedule. Durations per stage (uneven layouts give uneven stages); a B costs
// i + w; F and B also pay their stage's exposed all-to-all (a2a_f / a2a_b) unless overlapped in an FB action,
// which costs max(f + b, a2a_f + a2a_b) (compute of one half hides the other half's all-to-all). A SEND costs
// its rank nothing (non-blocking); the matching RECV completes p2p after the SEND was issued.
struct StageCost {
  double f = 1, i = 1, w = 1;   // compute time of F, I and W; B = i + w
  double a2a_f = 0, a2a_b = 0;  // exposed all-to-all per F and per B/I (MoE dispatch + combine)
  // The same chunk run as two half micro-batches (Durations::split_unpaired): compute and all-to-all of both
  // halves summed (half-size GEMMs run less efficiently and each exchange pays its own latency).
  double f2 = 0, i2 = 0, w2 = 0, a2a_f2 = 0, a2a_b2 = 0;
  // Exchanges per chunk and direction (2 per MoE layer: dispatch, combine): the split halves alternate at
  // each of them (split_chunk_time).
  int n_a2a = 1;
};
struct Durations {
  std::vector<StageCost> stage;  // [n_stages]; empty = uniform(...) defaults
  double p2p = 0;                // latency + transfer of one activation or gradient
  // The planner's split of unpaired chunks (parallelism.ep_overlap_split): an F, I or B with an all-to-all runs
  // as two half micro-batches whose compute and exchange alternate, costing split_chunk_time(f2.., a2a_*2).
  bool split_unpaired = false;
  // The engine's carried weight gradients under ep_overlap (its default pair backward, iwcarry): a B that runs
  // alone (not a fused pair's half) defers its weight-gradient GEMMs (w, or w2 when split) into its rank's queue
  // and lasts its input gradient and exchange only; any exposed exchange wait on the rank (an action's duration
  // beyond its compute) runs queued weight gradients inside it; what is still queued runs at the rank's end.
  bool carry_w = false;
  static Durations uniform(int n_stages, double f, double b, double w, double p2p);  // i = b - w
};
// A chunk run as two halves (x2, a2 = both halves' compute and all-to-all summed) with one compute stream and
// one communication stream. Each half is n segments of compute then exchange (equal parts: x2 / 2n and
// a2 / 2n); segment k + 1 of a half starts after its exchange k. The compute stream takes the halves in turn
// (half 1's segment k, then half 2's), the communication stream in arrival order, so one half exchanges while
// the other computes. n = 1: x2/2 + max(x2/2, a2/2) + a2/2 = max(x2, a2) + min(x2, a2) / 2 (a two-job,
// two-machine flow shop); larger n exposes less, down to max(x2, a2) plus one segment's fill and drain.
double split_chunk_time(double x2, double a2, int n = 1);
// An F, I or B that runs alone (not the half of an FB): compute then its all-to-all, or, split,
// split_chunk_time(x2, a2, n) of its halves when it has an all-to-all. The timed replay and the planner's
// analytic pass both use it.
double unpaired_time(double compute, double a2a, double x2, double a2, bool split, int n = 1);

struct TimedOp {
  int rank = 0;
  int index = 0;  // position in the rank's lowered list
  Action action;
  double start = 0, end = 0;
};
struct RankStats {
  int rank = 0;
  double busy = 0;          // compute time on this rank
  double bubble_ratio = 0;  // 1 - busy / step_time
  double a2a_exposed = 0;   // the part of busy that is exposed all-to-all (an action's time beyond its compute)
  int peak_inflight = 0;    // max (stage, mb) activation sets held: F done, backward (B, or W) not yet done
  double peak_inflight_microbatches = 0;  // peak_inflight / stages_per_rank (whole-rank micro-batches)
};
struct TimedResult {
  double step_time = 0;
  double bubble_ratio = 0;  // 1 - sum(busy) / (pp * step_time)
  int steps = 0;            // lock-step count of the same schedule
  std::vector<RankStats> ranks;
  std::vector<TimedOp> ops;  // compute and communication actions with their times, rank by rank
  // Durations::carry_w: each queued weight gradient as a W of its B's (stage, mb), from the first to the last
  // second a wait (its tail: the exchange follows the compute) or the rank's final run spent on it; the B it
  // came from has `index`. Not in `ops`: it runs inside other actions' time.
  std::vector<TimedOp> carried;
};
TimedResult simulate_timed(const Schedule& lowered, const Durations& d);

// Closed formula (Megatron / the seed documents): (pp - 1) / (pp - 1 + m * vpp), for equal F and B times.
double bubble_formula(int pp, int microbatches, int vpp);

// ---- text and CSV ----------------------------------------------------------------------------------------
// CSV: one row per pipeline rank, the rank's actions in order, comma separated (no header). Reading infers
// pp (rows), n_stages and n_microbatches (largest ids + 1) and stage_rank (the rank that computes each stage),
// and marks the schedule lowered when it has communication actions. Errors name row and column.
std::string to_csv(const Schedule& s);
Schedule from_csv(std::string_view text);
Schedule read_csv_file(const std::string& path);
std::string to_text(const Schedule& s);  // human-readable: "rank 0: 0F0 0F1 ..."

}  // namespace moetron::sched
