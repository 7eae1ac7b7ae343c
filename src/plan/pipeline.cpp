// pipeline.cpp: stage layers and the in-flight activation peaks per pipeline rank (plan/pipeline.h), from the
// shared schedule generators and timed simulator. Not a cost model.
#include "moetron/plan/pipeline.h"

#include <map>
#include <mutex>
#include <tuple>

#include "moetron/check.h"

namespace moetron::plan {

StagePlan stage_plan(const JobConfig& c, const Layout& l) {
  const PipelineSetup ps = resolve_pipeline(apply_layout(c, l));
  StagePlan p;
  p.layout = ps.layout;
  p.spec = ps.spec;
  p.from_csv = ps.from_csv;
  p.csv = ps.csv;
  return p;
}

int64_t inflight_microbatches(const sched::GenSpec& g) {
  const int64_t cap = 4 * int64_t(g.pp);
  return g.microbatches > cap ? cap : g.microbatches;
}

namespace {
// Per rank, the held-set events in time order: +stage at F, -stage at B / W (FB: both halves at its start /
// end, forward first).
struct Events {
  std::vector<std::vector<int>> per_rank;  // stage + 1 for acquire, -(stage + 1) for release
};

Events replay(const sched::Schedule& lowered) {
  sched::Durations d;  // uniform: F = 1, I = W = 1 (B = 2)
  const sched::TimedResult r = sched::simulate_timed(lowered, d);
  const bool split = [&] {
    for (const auto& rk : lowered.actions)
      for (const auto& a : rk)
        if (a.op == sched::Op::W) return true;
    return false;
  }();
  Events e;
  e.per_rank.assign(size_t(lowered.pp), {});
  for (const auto& op : r.ops) {  // rank by rank, in each rank's order
    const auto& a = op.action;
    auto& ev = e.per_rank[size_t(op.rank)];
    auto release = [&](sched::Op o, int stage) {
      if (o == sched::Op::B || (split && o == sched::Op::W) || (!split && o == sched::Op::I)) ev.push_back(-(stage + 1));
    };
    if (a.op == sched::Op::F) ev.push_back(a.stage + 1);
    else if (a.op == sched::Op::FB) ev.push_back(a.stage + 1), release(a.op2, a.stage2);
    else release(a.op, a.stage);
  }
  return e;
}

std::mutex g_mu;
std::map<std::tuple<std::string, int, int, int64_t, bool, int>, Events> g_cache;
}  // namespace

Inflight inflight(const StagePlan& p, const std::vector<double>& stage_bytes) {
  Inflight out;
  Events ev;
  if (p.from_csv) {
    ev = replay(sched::lower(p.csv));
    out.simulated_microbatches = p.csv.n_microbatches;
  } else {
    sched::GenSpec g = p.spec;
    g.microbatches = int(inflight_microbatches(g));
    out.simulated_microbatches = g.microbatches;
    const auto key = std::make_tuple(g.schedule, g.pp, g.vpp, int64_t(g.microbatches), g.ep_overlap, g.group_size);
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_cache.find(key);
    if (it == g_cache.end()) it = g_cache.emplace(key, replay(sched::lower(sched::generate(g)))).first;
    ev = it->second;
  }
  const size_t pp = ev.per_rank.size();
  out.peak_sets.assign(pp, 0);
  out.peak_bytes.assign(pp, 0.0);
  for (size_t r = 0; r < pp; ++r) {
    int held = 0;
    double bytes = 0;
    for (int e : ev.per_rank[r]) {
      const int stage = (e > 0 ? e : -e) - 1;
      const double b = stage_bytes.empty() ? 0.0 : stage_bytes.at(size_t(stage));
      if (e > 0) held += 1, bytes += b;
      else held -= 1, bytes -= b;
      out.peak_sets[r] = std::max(out.peak_sets[r], held);
      out.peak_bytes[r] = std::max(out.peak_bytes[r], bytes);
    }
  }
  return out;
}

}  // namespace moetron::plan
