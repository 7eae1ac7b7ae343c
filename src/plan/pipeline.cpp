// pipeline.cpp: stage layers and the in-flight activation peaks per pipeline rank (plan/pipeline.h), from the
// shared schedule generators and timed simulator. Not a cost model.
#include "moetron/plan/pipeline.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "moetron/check.h"

namespace moetron::plan {

namespace {
std::shared_ptr<const InflightPeaks> cached_peaks(const sched::GenSpec& spec);
std::mutex g_plan_mu;
// Stage plans of generated schedules by (config's pipeline keys, layout's pipeline shape): a search asks for the
// same few thousand shapes many times.
std::map<std::string, std::shared_ptr<const StagePlan>> g_plans;
}  // namespace

std::shared_ptr<const StagePlan> stage_plan(const JobConfig& c, const Layout& l) {
  const ParallelSpec& p = c.parallelism;
  const bool cacheable = p.pp_schedule_csv.empty();
  std::string key;
  if (cacheable) {
    // Everything the plan reads: the pipeline keys and which layers are MoE (the per-stage kind counts).
    std::string dense;
    for (int dl : c.model.dense_layers) dense += std::to_string(dl) + ",";
    key = std::to_string(c.model.n_layers) + "|" + std::to_string(c.model.moe.n_routed_experts) + "|" +
          std::to_string(c.model.first_k_dense) + "|" + dense + "|" + p.pp_layout + "|" + std::to_string(p.pp_first_stage_less_layers) +
          "|" + std::to_string(p.pp_last_stage_less_layers) + "|" + l.schedule + "|" + std::to_string(l.pp) + "|" +
          std::to_string(l.vpp) + "|" + std::to_string(l.microbatches) + "|" + (l.ep_overlap ? "o" : "-") + "|" +
          std::to_string(p.pp_virtual_stages) + "|" + std::to_string(p.pp_microbatches);
    std::lock_guard<std::mutex> lk(g_plan_mu);
    if (auto it = g_plans.find(key); it != g_plans.end()) return it->second;
  }
  const PipelineSetup ps = resolve_pipeline(apply_layout(c, l));
  auto spp = std::make_shared<StagePlan>();
  StagePlan& sp = *spp;
  sp.layout = ps.layout;
  sp.spec = ps.spec;
  sp.from_csv = ps.from_csv;
  sp.csv = ps.csv;
  const int n = sp.layout.n_stages;
  for (int st = 0; st < n; ++st) {
    sp.stage_layers.push_back(sp.layout.layers(st));
    int moe = 0, rm = -1, rd = -1;
    for (int layer : sp.stage_layers.back()) {
      const bool is = c.model.is_moe_layer(layer);
      moe += is ? 1 : 0;
      if (is && rm < 0) rm = layer;
      if (!is && rd < 0) rd = layer;
    }
    sp.rep_moe.push_back(rm);
    sp.rep_dense.push_back(rd);
    sp.n_moe.push_back(moe);
    sp.n_dense.push_back(int(sp.stage_layers.back().size()) - moe);
    sp.first.push_back(sp.layout.has_embedding(st) ? 1 : 0);
    sp.last.push_back(sp.layout.has_loss(st) ? 1 : 0);
  }
  for (int r = 0; r < sp.layout.pp; ++r) sp.rank_stages.push_back(sp.layout.stages_for_rank(r));
  if (!sp.from_csv) sp.peaks = cached_peaks(sp.spec);
  if (cacheable) {
    std::lock_guard<std::mutex> lk(g_plan_mu);
    if (g_plans.size() > 100000) g_plans.clear();
    g_plans.emplace(key, spp);
  }
  return spp;
}

int64_t inflight_microbatches(const sched::GenSpec& g) {
  const int64_t cap = 4 * int64_t(g.pp);
  return g.microbatches > cap ? cap : g.microbatches;
}

// Per rank, the held-set peaks of a replayed schedule: every maximal vector of held sets per stage (a vector no
// other one covers), so that the peak bytes for any per-stage sizes is the best dot product among a few vectors.
struct InflightPeaks {
  std::vector<std::vector<int>> stages;                  // per rank: its stage ids (the vectors' order)
  std::vector<std::vector<std::vector<int>>> vectors;    // per rank: non-dominated held-count vectors
  std::vector<int> peak_sets;                            // per rank
};

namespace {
using Peaks = InflightPeaks;
Peaks replay(const sched::Schedule& lowered) {
  sched::Durations d;  // uniform: F = 1, I = W = 1 (B = 2)
  const sched::TimedResult r = sched::simulate_timed(lowered, d);
  const bool split = [&] {
    for (const auto& rk : lowered.actions)
      for (const auto& a : rk)
        if (a.op == sched::Op::W) return true;
    return false;
  }();
  const size_t pp = size_t(lowered.pp);
  Peaks pk;
  pk.stages.assign(pp, {});
  pk.vectors.assign(pp, {});
  pk.peak_sets.assign(pp, 0);
  std::vector<int> local(size_t(lowered.n_stages), -1);
  for (int st = 0; st < lowered.n_stages; ++st) {
    auto& v = pk.stages[size_t(lowered.stage_rank[size_t(st)])];
    local[size_t(st)] = int(v.size());
    v.push_back(st);
  }
  std::vector<std::vector<int>> held(pp);
  std::vector<int> total(pp, 0);
  for (size_t rk = 0; rk < pp; ++rk) held[rk].assign(pk.stages[rk].size(), 0);
  auto keep = [&](size_t rk) {
    auto& list = pk.vectors[rk];
    const auto& h = held[rk];
    for (const auto& v : list) {
      bool covered = true;
      for (size_t i = 0; i < h.size() && covered; ++i) covered = v[i] >= h[i];
      if (covered) return;
    }
    list.erase(std::remove_if(list.begin(), list.end(),
                              [&](const std::vector<int>& v) {
                                for (size_t i = 0; i < h.size(); ++i)
                                  if (v[i] > h[i]) return false;
                                return true;
                              }),
               list.end());
    list.push_back(h);
  };
  for (const auto& op : r.ops) {  // rank by rank, in each rank's order
    const auto& a = op.action;
    const size_t rk = size_t(op.rank);
    auto acquire = [&](int stage) {
      held[rk][size_t(local[size_t(stage)])] += 1;
      pk.peak_sets[rk] = std::max(pk.peak_sets[rk], ++total[rk]);
      keep(rk);
    };
    auto release = [&](sched::Op o, int stage) {
      if (o == sched::Op::B || (split && o == sched::Op::W) || (!split && o == sched::Op::I))
        held[rk][size_t(local[size_t(stage)])] -= 1, --total[rk];
    };
    if (a.op == sched::Op::F) acquire(a.stage);
    else if (a.op == sched::Op::FB) acquire(a.stage), release(a.op2, a.stage2);
    else release(a.op, a.stage);
  }
  return pk;
}

std::mutex g_mu;
std::map<std::tuple<std::string, int, int, int64_t, bool, int>, std::shared_ptr<const Peaks>> g_cache;

std::shared_ptr<const Peaks> cached_peaks(const sched::GenSpec& spec) {
  sched::GenSpec g = spec;
  g.microbatches = int(inflight_microbatches(g));
  const auto key = std::make_tuple(g.schedule, g.pp, g.vpp, int64_t(g.microbatches), g.ep_overlap, g.group_size);
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (auto it = g_cache.find(key); it != g_cache.end()) return it->second;
  }
  // Replayed outside the lock (the search's workers miss on different shapes); a shape two workers replayed at
  // once keeps the first copy stored.
  auto pk = std::make_shared<const Peaks>(replay(sched::lower(sched::generate(g))));
  std::lock_guard<std::mutex> lk(g_mu);
  return g_cache.emplace(key, std::move(pk)).first->second;
}
}  // namespace

Inflight inflight(const StagePlan& p, const std::vector<double>& stage_bytes) {
  Inflight out;
  std::shared_ptr<const Peaks> own;
  if (p.from_csv) {
    own = std::make_shared<const Peaks>(replay(sched::lower(p.csv)));
    out.simulated_microbatches = p.csv.n_microbatches;
  } else {
    own = p.peaks ? p.peaks : cached_peaks(p.spec);
    out.simulated_microbatches = inflight_microbatches(p.spec);
  }
  const Peaks* pkp = own.get();
  const Peaks& pk = *pkp;
  const size_t pp = pk.stages.size();
  out.peak_sets = pk.peak_sets;
  out.peak_bytes.assign(pp, 0.0);
  size_t n_stages = 0;
  for (const auto& st : pk.stages) n_stages += st.size();
  out.stage_peak.assign(n_stages, 0);
  for (size_t r = 0; r < pp; ++r)
    for (const auto& v : pk.vectors[r])
      for (size_t i = 0; i < v.size(); ++i) {
        int& sp = out.stage_peak[size_t(pk.stages[r][i])];
        sp = std::max(sp, v[i]);
      }
  if (stage_bytes.empty()) return out;
  for (size_t r = 0; r < pp; ++r)
    for (const auto& v : pk.vectors[r]) {
      double b = 0;
      for (size_t i = 0; i < v.size(); ++i) b += double(v[i]) * stage_bytes.at(size_t(pk.stages[r][i]));
      out.peak_bytes[r] = std::max(out.peak_bytes[r], b);
    }
  return out;
}

}  // namespace moetron::plan
