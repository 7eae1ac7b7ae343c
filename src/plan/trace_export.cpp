// trace_export.cpp: the planner's projected step as per-rank trace files (plan/trace_export.h). The durations
// are plan_time's (plan/cost.h): per stage and micro-batch F, I, W and the EP exchange, the point-to-point
// message time, the exposed data-parallel collectives and the optimizer; the order and start of every action
// come from the shared timed simulator. Not a cost model: nothing here prices an op.
//
// What one rank's file holds (times in microseconds from the step's start):
//   step     [0, step]                         the pipeline, then the exposed DP collective, then the optimizer
//   action   F / B / I / W / FB                 the simulator's ops of the rank's pipeline index (mb, stage, chunk)
//     kernel plan.gemm, plan.attention, plan.memory_bound, plan.fp8_quantize, plan.recompute: the action's
//            compute parts from StageTime (F: a third of the stage's GEMM, attention and memory-bound time, half
//            its quantize time; I: a third of the GEMM, two thirds of attention and memory-bound, half the
//            quantize, the recompute; W: the weight-gradient GEMMs; whatever the parts leave of f or i, e.g. the
//            head's loss, is plan.memory_bound), one after another from the action's start
//     comm   all_gather + reduce_scatter (TP, group tp), exchange (CP ring, group cp), all_to_all dispatch and
//            combine (EP, group ep); in an FB action the EP exchanges run on track 2 beside the compute (the
//            simulator's max(f + b, a2a_f + a2a_b))
//   comm     send (zero length, when issued) and recv (until the message arrives), peer = the other pipeline rank
//   comm     the exposed part of the DP gradient collective (reduce_scatter with a distributed optimizer, else
//            all_reduce), group dp
//   module   optimizer > kernel plan.optimizer
// FLOPs and bytes are not carried (0): the cost model prices ops without exporting them per action.
// Ranks: pp outermost, then dp, cp, tp (plan/layout.h); the expert groups are blocks of ep x etp of a pipeline
// slice with ep strided by etp.
#include "moetron/plan/trace_export.h"

#include <algorithm>
#include <map>

#include "moetron/check.h"
#include "moetron/plan/pipeline.h"
#include "moetron/schedule.h"
#include "tracefile/reader.h"

namespace moetron::plan {

namespace {

using tracefile::Cat;
using tracefile::Event;

constexpr double kUs = 1e6;  // seconds -> trace microseconds

struct Ids {
  std::string pp, dp, tp, cp, ep;  // this rank's group ids ("" = none: size 1)
};

struct Writer {
  tracefile::RankTrace& t;
  std::map<std::string, int64_t>& seq;  // per group: the next sequence number on this rank
  Event& add(Cat c, const std::string& name, double ts, double dur, int tid = 0) {
    Event e;
    e.cat = c, e.name = name, e.ts = ts, e.dur = dur, e.tid = tid;
    t.events.push_back(e);
    return t.events.back();
  }
  // A kernel or collective of `dur` seconds at `*cur` (microseconds), advancing *cur; zero-length parts are skipped.
  void part(double* cur, const std::string& name, double dur, int tid = 0) {
    if (dur <= 0) return;
    add(Cat::Kernel, name, *cur, dur * kUs, tid);
    *cur += dur * kUs;
  }
  void coll(double* cur, const std::string& kind, const std::string& group, double dur, int tid = 0) {
    if (dur <= 0 || group.empty()) {
      if (dur > 0) *cur += dur * kUs;  // a size-1 group moves nothing but the cost model charged it
      return;
    }
    Event& e = add(Cat::Comm, kind, *cur, dur * kUs, tid);
    e.group = group;
    e.seq = seq[group]++;
    *cur += dur * kUs;
  }
};

// Compute parts of one pass of a stage: F (fwd) or the backward input half I (with or without W).
void compute_parts(Writer& w, double* cur, const StageTime& st, const Ids& ids, bool fwd, bool sp) {
  const double gemm = st.gemm / 3, quant = st.quantize / 2, tp = st.tp_comm / 2;
  const double attn = fwd ? st.attention / 3 : 2 * st.attention / 3;
  const double cp = fwd ? st.cp_comm / 3 : 2 * st.cp_comm / 3;
  const double rec = fwd ? 0 : st.recompute;
  const double total = fwd ? st.f : st.i;
  const double mem = std::max(0.0, total - gemm - quant - tp - attn - cp - rec);
  w.part(cur, "plan.gemm", gemm);
  w.part(cur, "plan.attention", attn);
  w.part(cur, "plan.memory_bound", mem);
  w.part(cur, "plan.fp8_quantize", quant);
  w.part(cur, "plan.recompute", rec);
  if (sp) {
    w.coll(cur, "all_gather", ids.tp, tp / 2);
    w.coll(cur, "reduce_scatter", ids.tp, tp / 2);
  } else {
    w.coll(cur, "all_reduce", ids.tp, tp);
  }
  w.coll(cur, "exchange", ids.cp, cp);
}

void ep_parts(Writer& w, double* cur, const Ids& ids, double a2a, int tid = 0) {
  w.coll(cur, "all_to_all", ids.ep, a2a / 2, tid);  // dispatch
  w.coll(cur, "all_to_all", ids.ep, a2a / 2, tid);  // combine
}

const char* op_name(sched::Op op) {
  switch (op) {
    case sched::Op::F: return "F";
    case sched::Op::B: return "B";
    case sched::Op::I: return "I";
    case sched::Op::W: return "W";
    default: return "FB";
  }
}

}  // namespace

TraceExport write_plan_trace(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o,
                             const std::string& dir) {
  const int64_t world = l.world();
  MT_CHECK(world <= kMaxTraceRanks, "plan time", "--trace writes one file per rank; --world ", world, " exceeds ",
           kMaxTraceRanks, " (trace a smaller world: the per-rank timelines of one pipeline slice repeat)");
  MT_CHECK(!l.ep_overlap_split, "plan time", "--trace does not draw parallelism.ep_overlap_split yet (the two "
           "halves of a split chunk interleave); trace the layout without it");
  TimeOptions to = o;
  to.simulate = true;
  const TimePlan tp = plan_time(c, l, h, to);
  const auto sp = stage_plan(c, l);
  sched::Schedule s;
  if (sp->from_csv) {
    s = sp->csv;
  } else {
    sched::GenSpec g = sp->spec;
    g.microbatches = int(l.microbatches);
    s = sched::generate(g);
  }
  const sched::Schedule low = sched::lower(s);
  const sched::TimedResult sim = sched::simulate_timed(low, replay_durations(tp));

  TraceExport out;
  out.pipeline_time = sim.step_time;
  out.step_time = sim.step_time + tp.dp_exposed + tp.optimizer;
  const int64_t inner_n = world / l.pp;
  const bool sp_on = l.sp && l.tp > 1;
  const JobConfig applied = apply_layout(c, l);
  const std::string config = to_toml(applied);
  nlohmann::json layout = {{"dp", l.dp}, {"ep", l.ep},     {"pp", l.pp},     {"vpp", l.vpp}, {"zero", l.zero},
                           {"fsdp", l.zero == 3}, {"schedule", l.schedule}, {"tp", l.tp}, {"cp", l.cp}};

  // Groups of every rank (ids and members), by the rank order above.
  std::map<std::string, tracefile::Group> groups;
  std::vector<Ids> ids(static_cast<size_t>(world));
  auto join = [&](const std::string& id, const std::string& name, int r) {
    tracefile::Group& g = groups[id];
    g.id = id, g.name = name;
    g.ranks.push_back(r);
  };
  for (int64_t p = 0; p < l.pp; ++p)
    for (int64_t in = 0; in < inner_n; ++in) {
      const int r = int(p * inner_n + in);
      const int64_t tp_idx = in % l.tp, dp_idx = in / (l.tp * l.cp);
      Ids& x = ids[size_t(r)];
      join("world", "world", r);
      if (l.pp > 1) join(x.pp = "pp." + std::to_string(in), "pp", r);
      if (l.dp * l.cp > 1) join(x.dp = "dp." + std::to_string(p) + "." + std::to_string(tp_idx), "dp", r);
      if (l.tp > 1) join(x.tp = "tp." + std::to_string(p) + "." + std::to_string(in / l.tp), "tp", r);
      if (l.cp > 1)
        join(x.cp = "cp." + std::to_string(p) + "." + std::to_string(dp_idx) + "." + std::to_string(tp_idx), "cp", r);
      if (l.ep > 1) {
        const int64_t blk = in / (l.ep * l.etp), e = in % l.etp;
        join(x.ep = "ep." + std::to_string(p) + "." + std::to_string(blk) + "." + std::to_string(e), "ep", r);
      }
    }
  for (auto& [id, g] : groups) std::sort(g.ranks.begin(), g.ranks.end());

  for (int64_t r = 0; r < world; ++r) {
    const int p = int(r / inner_n);
    const int64_t in = r % inner_n;
    const Ids& x = ids[size_t(r)];
    tracefile::RankTrace t;
    tracefile::Meta& m = t.meta;
    m.rank = int(r), m.world = int(world), m.source = "planner", m.config = config, m.layout = layout;
    m.limits.flops_per_s = c.quantize.recipe != Fp8Recipe::None ? h.achievable_fp8 : h.achievable_bf16;
    m.limits.bytes_per_s = h.stream_bw();
    m.limits.dtype = c.quantize.recipe != Fp8Recipe::None ? "fp8" : "bf16";
    m.limits.source = "hardware file " + h.name;
    m.first_step = m.last_step = 0;
    for (const auto& [id, g] : groups)
      if (std::find(g.ranks.begin(), g.ranks.end(), int(r)) != g.ranks.end()) m.groups[id] = g;
    t.track_names[0] = "compute";
    std::map<std::string, int64_t> seq;  // the group's members run the same actions: their sequences agree
    Writer w{t, seq};
    Event& step = w.add(Cat::Step, "step", 0, out.step_time * kUs);
    step.step = 0;
    const auto& mine = sp->rank_stages[size_t(p)];
    auto chunk_of = [&](int stage) {
      return int64_t(std::find(mine.begin(), mine.end(), stage) - mine.begin());
    };
    auto peer_of = [&](int stage) { return int(int64_t(low.stage_rank[size_t(stage)]) * inner_n + in); };
    for (const sched::TimedOp& op : sim.ops) {
      if (op.rank != p) continue;
      const sched::Action& a = op.action;
      const double t0 = op.start * kUs, t1 = op.end * kUs;
      if (sched::is_compute(a.op)) {
        Event& act = w.add(Cat::Action, op_name(a.op), t0, t1 - t0);
        act.mb = a.mb, act.stage = a.stage, act.chunk = chunk_of(a.stage);
        double cur = t0;
        const StageTime& st = tp.stages[size_t(a.stage)];
        switch (a.op) {
          case sched::Op::F:
            compute_parts(w, &cur, st, x, true, sp_on);
            ep_parts(w, &cur, x, st.a2a_f);
            break;
          case sched::Op::I:
          case sched::Op::B:
            compute_parts(w, &cur, st, x, false, sp_on);
            if (a.op == sched::Op::B) w.part(&cur, "plan.gemm", st.w);
            ep_parts(w, &cur, x, st.a2a_b);
            break;
          case sched::Op::W: w.part(&cur, "plan.gemm", st.w); break;
          default: {  // FB: both halves' compute on track 0, both halves' EP exchange on track 2 beside it
            const StageTime& sb = tp.stages[size_t(a.stage2)];
            compute_parts(w, &cur, st, x, true, sp_on);
            compute_parts(w, &cur, sb, x, false, sp_on);
            if (a.op2 == sched::Op::B) w.part(&cur, "plan.gemm", sb.w);
            double lane = t0;
            ep_parts(w, &lane, x, st.a2a_f, 2);
            ep_parts(w, &lane, x, sb.a2a_b, 2);
            if (!x.ep.empty()) t.track_names[2] = "ep overlap";
            break;
          }
        }
      } else {
        const bool send = a.op == sched::Op::SEND_F || a.op == sched::Op::SEND_B;
        const bool fwd = a.op == sched::Op::SEND_F || a.op == sched::Op::RECV_F;
        // SEND_F s -> stage s+1, SEND_B s -> s-1; RECV_F s <- s-1, RECV_B s <- s+1.
        const int other = send ? (fwd ? a.stage + 1 : a.stage - 1) : (fwd ? a.stage - 1 : a.stage + 1);
        Event& e = w.add(Cat::Comm, send ? "send" : "recv", t0, send ? 0 : t1 - t0);
        e.peer = peer_of(other);
        e.tag = fwd ? 0 : 1;
        e.group = x.pp;
        e.bytes_in = e.bytes_out = 0;
      }
    }
    double cur = sim.step_time * kUs;
    w.coll(&cur, l.zero >= 1 ? "reduce_scatter" : "all_reduce", x.dp, tp.dp_exposed);
    if (tp.optimizer > 0) {
      w.add(Cat::Module, "optimizer", cur, tp.optimizer * kUs);
      w.part(&cur, "plan.optimizer", tp.optimizer);
    }
    out.events += int64_t(t.events.size());
    tracefile::write_rank_file(t, dir);
    ++out.files;
  }
  return out;
}

}  // namespace moetron::plan
