// search.cpp: layout search and strong scaling (plan/search.h). Enumerates the layout space, prunes by the
// layout rules and the memory projection, ranks by the analytic step estimate, simulates the top candidates.
// Not a cost model.
#include "moetron/plan/search.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "moetron/accounting.h"
#include "moetron/check.h"
#include "moetron/plan/pipeline.h"

namespace moetron::plan {

namespace {

std::vector<int64_t> divisors_upto(int64_t n, int64_t cap) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= std::min(n, cap); ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

std::vector<int64_t> pow2_upto(int64_t cap) {
  std::vector<int64_t> v;
  for (int64_t x = 1; x <= cap; x *= 2) v.push_back(x);
  return v;
}

int64_t default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? int64_t(std::min(n, 16u)) : 1;
}

struct Ac {
  AcMode mode;
  std::vector<std::string> modules;
};

// The schedule generator's own preconditions for this layout's pipeline (micro-batches per pp, group sizes).
bool schedule_accepts(const Layout& l) {
  if (l.pp <= 1) return true;
  sched::GenSpec g;
  g.schedule = l.schedule, g.pp = int(l.pp), g.vpp = int(l.vpp), g.microbatches = int(l.microbatches);
  g.ep_overlap = l.ep_overlap;
  try {
    sched::check_spec(g);
  } catch (const Error&) {
    return false;
  }
  return true;
}

// A layout projected in full: memory with the module breakdown, the simulated step.
Candidate project(const JobConfig& c, const Layout& l, const Hardware& h, const SearchOptions& o) {
  Candidate cd;
  cd.layout = l;
  cd.memory = plan_memory(c, l, h, o.time.memory);
  cd.memory_total = cd.memory.max_total;
  cd.verdict = cd.memory.verdict;
  cd.time = plan_time(c, l, h, o.time, &cd.memory);
  return cd;
}

std::string explain(const Candidate& w, const std::vector<Candidate>& top) {
  std::ostringstream os;
  const auto& b = w.time.breakdown;
  double comm = 0;
  for (const auto& [k, v] : b)
    if (k.rfind("comm.", 0) == 0) comm += v;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%s wins at %.0f tokens/s/GPU (MFU %.1f%%): bubble %.1f%% of the step, exposed communication "
                "%.1f%%, recompute %.1f%%, peak memory %.1f GB (%s).",
                w.layout.describe().c_str(), w.time.tokens_per_s_per_gpu, 100 * w.time.mfu,
                100 * b.at("bubble_and_p2p") / w.time.step_time, 100 * comm / w.time.step_time,
                100 * b.at("compute.recompute") / w.time.step_time, w.memory.max_total / 1e9, w.memory.verdict.c_str());
  os << buf;
  if (top.size() > 1) {
    const auto& r = top[1];
    std::snprintf(buf, sizeof buf, " The runner-up %s reaches %.0f tokens/s/GPU (%.1f%% less).",
                  r.layout.describe().c_str(), r.time.tokens_per_s_per_gpu,
                  100 * (1 - r.time.tokens_per_s_per_gpu / w.time.tokens_per_s_per_gpu));
    os << buf;
  }
  return os.str();
}

}  // namespace

namespace {

// A layout the analytic pass ranked, with its score (analytic tokens/s/GPU).
struct Ranked {
  Layout layout;
  double score = 0;
};

// One work item per (tp, cp, pp): the items run on o.threads workers and their results are joined in the
// items' order, so the ranking does not depend on the thread count.
struct Item {
  int64_t tp, cp, pp;
  std::vector<Ranked> ok;
  int64_t enumerated = 0, invalid = 0, oom = 0, evaluated = 0;
};

// What every work item reads: the job (its batch fixed by the search), the hardware, the options, the recompute
// choices and the two cheap passes (the analytic step, the memory projection without module detail).
struct SearchCtx {
  const JobConfig& c;
  const Hardware& h;
  const SearchOptions& o;
  int64_t world = 0, gbs = 0, E = 1;
  std::vector<Ac> acs;
  TimeOptions analytic;
  PlanOptions quick;
  // The job's lane keys (parallelism.ep_pair_backward, ep_baton, ep_link) may rule the overlap out (the engine
  // refuses iwcarry under turns, say): its layouts then count as invalid.
  bool lanes_ok = true;
};

// The stage plans of one (pp, vpp, schedule): by (micro-batches, overlap).
using StagePlans = std::map<std::pair<int64_t, int>, std::shared_ptr<const StagePlan>>;

// What the overlap choices of one shape (ep, zero, recompute, micro-batch) share: its stage durations (priced
// once, and at half the tokens once for the split) and, with and without the split, the memory projection.
struct ShapeShare {
  std::vector<StageTime> whole, split;
  MemoryPlan overlap_mp;
  bool have_overlap_mp = false;
};

// Whether the job's lane keys allow the EP overlap at all (validate_overlap_lanes accepts them).
bool lanes_allowed(const JobConfig& c) {
  try {
    validate_overlap_lanes(c);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// The job as the search prices it: the global batch from the tokens, the layout-bound choices cleared.
JobConfig search_config(const JobConfig& c_in, int64_t world, double gbt) {
  JobConfig c = c_in;
  const int64_t S = c.training.seq_len;
  MT_CHECK(world >= 1, "plan search", "--world = ", world, " must be >= 1");
  MT_CHECK(gbt > 0 && std::fmod(gbt, double(S)) == 0, "plan search", "--global-batch-tokens = ", gbt,
           " must be a positive multiple of training.seq_len (", S, ")");
  c.training.global_batch_size = int64_t(gbt / double(S));
  c.parallelism.pp_layout.clear();
  c.parallelism.pp_schedule_csv.clear();
  c.parallelism.pp_microbatches = 0;
  c.parallelism.pp_virtual_stages = 0;
  c.activation_checkpoint.layer_ids.clear();
  c.activation_checkpoint.stage_ids.clear();
  return c;
}

// One layout through the rules, the memory projection and the analytic step. `static_oom`: what a rank holds
// before activations did not fit for this (ep, zero); set here when a projection shows it.
void evaluate(const SearchCtx& x, Item& it, Layout l, int ov, StagePlans& plans, bool& static_oom, ShapeShare& sh) {
  if (l.pp == 1 && l.schedule != "1f1b") { ++it.invalid; return; }
  if (ov && !x.lanes_ok) { ++it.invalid; return; }
  // The two rules most candidates break, as integer tests before the named check.
  if (x.gbs % (l.mbs * l.dp) != 0 || (l.tp * l.cp * l.dp) % l.ep != 0) { ++it.invalid; return; }
  if (!layout_error(x.c, l, x.gbs).empty()) { ++it.invalid; return; }
  l.microbatches = x.gbs / (l.mbs * l.dp);
  if (!schedule_accepts(l)) { ++it.invalid; return; }
  if (static_oom) { ++it.oom; return; }
  // The stage plan depends on (pp, vpp, schedule, micro-batches, overlap): kept per shape here.
  auto& spp = plans[{l.microbatches, ov > 0}];
  MemoryPlan own;
  const MemoryPlan* mp = &own;
  try {
    if (!spp) spp = stage_plan(x.c, l);
    // The split changes durations, not what a rank holds: its memory is the overlap's.
    if (ov == 2 && sh.have_overlap_mp) mp = &sh.overlap_mp;
    else own = plan_memory(x.c, l, x.h, x.quick, spp.get());
  } catch (const Error&) {
    ++it.invalid;
    return;
  }
  if (ov == 1) sh.overlap_mp = std::move(own), sh.have_overlap_mp = true, mp = &sh.overlap_mp;
  if (mp->verdict != "FITS") {
    ++it.oom;
    for (const RankMemory& rm : mp->per_rank)
      if (verdict_for(rm.params + rm.grads + rm.main_params + rm.optimizer, mp->hbm, mp->margin) != "FITS")
        static_oom = true;
    return;
  }
  if (sh.whole.empty()) sh.whole = stage_times_at(x.c, l, x.h, x.analytic, *spp, 1.0);
  const std::vector<StageTime>* d = &sh.whole;
  if (ov == 2) {
    sh.split = sh.whole;
    set_split_halves(sh.split, stage_times_at(x.c, l, x.h, x.analytic, *spp, 0.5));
    d = &sh.split;
  }
  const double score = plan_time(x.c, l, x.h, x.analytic, mp, spp.get(), d).tokens_per_s_per_gpu;
  ++it.evaluated;
  it.ok.push_back({std::move(l), score});
}

// Every recompute choice, micro-batch and overlap choice of one (tp, cp, pp, vpp, schedule, ep, zero). What a
// rank holds before activations (parameters, gradients, main parameters, optimizer state) depends on neither
// recompute, micro-batch nor overlap: once it alone does not fit, no layout of this (ep, zero) fits, and the
// rest are counted out of memory without a projection.
void run_ep_zero(const SearchCtx& x, Item& it, const Layout& base, StagePlans& plans) {
  const SearchOptions& o = x.o;
  bool static_oom = false;
  for (const Ac& ac : x.acs)
    for (int64_t mbs : pow2_upto(o.max_mbs)) {
      ShapeShare sh;
      for (int ov = 0; ov < 3; ++ov) {  // no overlap; ep_overlap; ep_overlap with the split
        if (base.zero == 3 && !o.allow_fsdp) continue;
        if (ov && !(o.allow_ep_overlap && base.ep > 1 && base.schedule == "interleaved_1f1b")) continue;
        if (ov == 2 && !o.allow_ep_overlap_split) continue;
        ++it.enumerated;
        Layout l = base;
        l.ep_overlap = ov > 0, l.ep_overlap_split = ov == 2, l.recompute = ac.mode, l.recompute_modules = ac.modules;
        l.mbs = mbs;
        evaluate(x, it, std::move(l), ov, plans, static_oom, sh);
      }
    }
}

// Every schedule, virtual-stage count, ep and zero of one (tp, cp, pp).
void run_item(const SearchCtx& x, Item& it) {
  const int64_t dp = x.world / (it.tp * it.cp * it.pp);
  for (const auto& sched : x.o.schedules) {
    std::vector<int64_t> vpps = {1};
    if (sched == "interleaved_1f1b") vpps = {2, 3, 4, 6, 8};
    if (sched == "zbv") vpps = {2};
    for (int64_t vpp : vpps) {
      StagePlans plans;
      for (int64_t ep : divisors_upto(x.E, x.E))
        for (int64_t zero : {int64_t(1), int64_t(3)}) {
          Layout l;
          l.tp = it.tp, l.cp = it.cp, l.pp = it.pp, l.vpp = vpp, l.dp = dp, l.ep = ep, l.zero = zero;
          l.schedule = sched;
          run_ep_zero(x, it, l, plans);
        }
    }
  }
}

// The work items: every (tp, cp, pp) that divides the world within the options' caps.
std::vector<Item> work_items(const SearchCtx& x, int64_t max_tp, int64_t max_cp, int64_t max_pp) {
  std::vector<Item> items;
  for (int64_t tp : pow2_upto(max_tp))
    for (int64_t cp : pow2_upto(max_cp)) {
      if (x.world % (tp * cp) != 0) continue;
      for (int64_t pp : divisors_upto(x.world / (tp * cp), max_pp))
        if (tp * cp * pp >= x.o.min_replica) items.push_back({tp, cp, pp, {}});
    }
  return items;
}

// The items on `threads` workers (the first an exception stops them all and is rethrown here). The items with
// the most pipeline stages cost the most: they are dealt first so the workers end together.
void run_items(const SearchCtx& x, std::vector<Item>& items, int64_t threads) {
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(threads > 0 ? threads : default_threads(),
                                                                   int64_t(items.size())));
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return items[a].pp > items[b].pp; });
  std::atomic<size_t> next{0};
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n_threads));
  auto worker = [&](size_t k) {
    try {
      for (size_t i = next++; i < items.size(); i = next++) run_item(x, items[order[i]]);
    } catch (...) {
      errors[k] = std::current_exception();
      next = items.size();
    }
  };
  std::vector<std::thread> pool;
  for (int64_t k = 1; k < n_threads; ++k) pool.emplace_back(worker, size_t(k));
  worker(0);
  for (auto& t : pool) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// A ranked layout of some item (no copy).
struct Ref {
  double score;
  const Layout* layout;
};

// The items' counts added up and their layouts in enumeration order (items in order, then each item's own order).
std::vector<Ref> collect_items(const std::vector<Item>& items, SearchResult& res) {
  std::vector<Ref> ok;
  for (const Item& it : items) {
    res.enumerated += it.enumerated, res.invalid += it.invalid, res.oom += it.oom, res.evaluated += it.evaluated;
    for (const Ranked& r : it.ok) ok.push_back({r.score, &r.layout});
  }
  return ok;
}

// The top candidates by the estimate through the timed simulator (twice top_k, then the best top_k).
void project_top(const JobConfig& c, const Hardware& h, const SearchOptions& o, const std::vector<Ref>& ok,
                 SearchResult& res) {
  const size_t n = std::min(ok.size(), size_t(2 * o.top_k));
  std::vector<Candidate> best(n);
  for (size_t i = 0; i < n; ++i) {
    best[i] = project(c, *ok[i].layout, h, o);
    best[i].analytic_tokens_per_s_per_gpu = ok[i].score;
  }
  std::sort(best.begin(), best.end(), [](const Candidate& a, const Candidate& b) {
    return a.time.tokens_per_s_per_gpu > b.time.tokens_per_s_per_gpu;
  });
  for (size_t i = 0; i < std::min(n, size_t(o.top_k)); ++i) res.top.push_back(std::move(best[i]));
}

}  // namespace

SearchResult search(const JobConfig& c_in, const Hardware& h, int64_t world, double gbt, const SearchOptions& o) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const JobConfig c = search_config(c_in, world, gbt);
  const ModelSpec& s = c.model;
  const int64_t S = c.training.seq_len;
  SearchResult res;
  res.world = world;
  res.global_batch_tokens = gbt;
  std::vector<Ac> acs = {{AcMode::None, {}}};
  if (o.allow_recompute) acs.push_back({AcMode::Selective, {"attention_core", "moe_act", "norm"}}), acs.push_back({AcMode::Full, {}});
  TimeOptions analytic = o.time;
  analytic.simulate = false;
  analytic.model_flops_per_token = flops_per_token(s, S).train;
  PlanOptions quick = o.time.memory;
  quick.detail = false;
  const SearchCtx x{c, h, o, world, c.training.global_batch_size, s.is_moe() ? s.moe.n_routed_experts : 1,
                    std::move(acs), std::move(analytic), std::move(quick), lanes_allowed(c)};
  std::vector<Item> items = work_items(x, o.allow_tp ? h.scale_up.domain : 1, o.allow_cp ? 8 : 1,
                                       o.max_pp > 0 ? o.max_pp : s.n_layers);
  run_items(x, items, o.threads);
  std::vector<Ref> ok = collect_items(items, res);
  const double analytic_s = std::chrono::duration<double>(clock::now() - t0).count();
  res.layouts_per_second = analytic_s > 0 ? double(res.enumerated) / analytic_s : 0;
  // Ranked by score, ties in enumeration order.
  std::stable_sort(ok.begin(), ok.end(), [](const Ref& a, const Ref& b) { return a.score > b.score; });
  project_top(c, h, o, ok, res);
  if (!res.top.empty()) res.why = explain(res.top[0], res.top);
  res.seconds = std::chrono::duration<double>(clock::now() - t0).count();
  return res;
}

std::vector<ScalePoint> scale(const JobConfig& c_in, const Hardware& h, const std::vector<int64_t>& worlds, double gbt,
                              const SearchOptions& o) {
  std::vector<ScalePoint> out;
  JobConfig c = c_in;
  c.training.global_batch_size = int64_t(gbt / double(c.training.seq_len));
  c.parallelism.pp_microbatches = 0;
  // The replica: the best layout at the largest world (the replica must still have micro-batches to pipeline
  // when the global batch is spread over the most replicas).
  const int64_t wmax = *std::max_element(worlds.begin(), worlds.end());
  const SearchResult at_max = search(c_in, h, wmax, gbt, o);
  const bool have_replica = !at_max.top.empty();
  const Layout replica = have_replica ? at_max.top[0].layout : Layout{};
  for (int64_t w : worlds) {
    ScalePoint p;
    p.world = w;
    const SearchResult r = w == wmax ? at_max : search(c_in, h, w, gbt, o);  // the largest world: searched once
    if (!r.top.empty()) p.searched_ok = true, p.searched = r.top[0];
    if (have_replica && w % (replica.tp * replica.cp * replica.pp) == 0) {
      Layout l = replica;
      l.dp = w / (l.tp * l.cp * l.pp);
      const int64_t gbs = c.training.global_batch_size;
      if (layout_error(c, l, gbs).empty()) {
        l.microbatches = gbs / (l.mbs * l.dp);
        if (schedule_accepts(l)) {
          Candidate cd = project(c, l, h, o);
          if (cd.verdict == "FITS") p.replica_ok = true, p.replica = std::move(cd);
        }
      }
    }
    // The replica scaled in dp is the scaling figure; a world it cannot run on takes the searched best.
    if (p.replica_ok) p.found = true, p.best = p.replica;
    else if (p.searched_ok) p.found = true, p.best = p.searched;
    if (!p.found)
      p.note = "no layout fits (" + std::to_string(r.oom) + " out of memory, " + std::to_string(r.invalid) + " invalid)";
    out.push_back(std::move(p));
  }
  const ScalePoint* base = nullptr;
  for (const auto& p : out)
    if (p.found) { base = &p; break; }
  for (auto& p : out) {
    if (!p.found || !base) continue;
    p.efficiency = p.best.time.tokens_per_s_per_gpu / base->best.time.tokens_per_s_per_gpu;
    if (&p == base) { p.note = "baseline"; continue; }
    // Where the efficiency goes: the breakdown shares that grew against the baseline.
    const auto& b0 = base->best.time.breakdown;
    const auto& b1 = p.best.time.breakdown;
    std::string worst;
    double grow = 0;
    for (const auto& [k, v] : b1) {
      const double share1 = v / p.best.time.step_time;
      const double share0 = b0.count(k) ? b0.at(k) / base->best.time.step_time : 0.0;
      if (share1 - share0 > grow) grow = share1 - share0, worst = k;
    }
    char buf[200];
    if (grow > 0.005)
      std::snprintf(buf, sizeof buf, "%s grew from %.1f%% to %.1f%% of the step", worst.c_str(),
                    100 * (b0.count(worst) ? b0.at(worst) / base->best.time.step_time : 0.0),
                    100 * b1.at(worst) / p.best.time.step_time);
    else
      std::snprintf(buf, sizeof buf, "no overhead grew by more than 0.5%% of the step");
    p.note = buf;
  }
  return out;
}

nlohmann::json to_json(const SearchResult& r) {
  nlohmann::json j;
  j["world"] = r.world;
  j["global_batch_tokens"] = r.global_batch_tokens;
  j["enumerated"] = r.enumerated;
  j["invalid"] = r.invalid;
  j["out_of_memory"] = r.oom;
  j["evaluated"] = r.evaluated;
  j["seconds"] = r.seconds;
  j["layouts_per_second"] = r.layouts_per_second;
  j["why"] = r.why;
  j["top"] = nlohmann::json::array();
  for (const auto& cd : r.top) {
    nlohmann::json x = to_json(cd.time);
    x["memory"] = to_json(cd.memory);
    j["top"].push_back(x);
  }
  return j;
}

std::string format_search(const SearchResult& r) {
  std::ostringstream os;
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "%lld layouts enumerated (%lld invalid, %lld out of memory, %lld ranked) in %.3f s "
                "(%.0f layouts/s)\n\n",
                (long long)r.enumerated, (long long)r.invalid, (long long)r.oom, (long long)r.evaluated, r.seconds,
                r.layouts_per_second);
  os << buf;
  os << " #  tokens/s/GPU   MFU    step (s)  bubble  mem (GB)  layout\n";
  for (size_t i = 0; i < r.top.size(); ++i) {
    const auto& cd = r.top[i];
    std::snprintf(buf, sizeof buf, "%2zu  %12.0f  %5.1f%%  %8.3f  %5.1f%%  %8.1f  %s\n", i + 1,
                  cd.time.tokens_per_s_per_gpu, 100 * cd.time.mfu, cd.time.step_time, 100 * cd.time.bubble_ratio,
                  cd.memory.max_total / 1e9, cd.layout.describe().c_str());
    os << buf;
  }
  if (!r.top.empty()) os << "\n" << format_time(r.top[0].time) << "\nwhy: " << r.why << "\n";
  else os << "\nno layout fits this world and global batch\n";
  return os.str();
}

nlohmann::json to_json(const std::vector<ScalePoint>& s) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& p : s) {
    nlohmann::json x{{"world", p.world}, {"found", p.found}, {"efficiency", p.efficiency}, {"note", p.note}};
    if (p.replica_ok) x["replica_scaled"] = {{"layout", p.replica.layout.describe()}, {"tokens_per_s_per_gpu", p.replica.time.tokens_per_s_per_gpu}};
    if (p.searched_ok) x["searched"] = {{"layout", p.searched.layout.describe()}, {"tokens_per_s_per_gpu", p.searched.time.tokens_per_s_per_gpu}};
    if (p.found) {
      x["layout"] = p.best.layout.describe();
      x["tokens_per_s_per_gpu"] = p.best.time.tokens_per_s_per_gpu;
      x["step_time_s"] = p.best.time.step_time;
      x["mfu"] = p.best.time.mfu;
      x["memory_bytes"] = p.best.memory.max_total;
    }
    j.push_back(x);
  }
  return j;
}

std::string format_scale(const std::vector<ScalePoint>& s) {
  std::ostringstream os;
  char buf[400];
  os << "   world  tokens/s/GPU   MFU   step (s)  efficiency  layout / where efficiency goes\n";
  for (const auto& p : s) {
    if (!p.found) {
      std::snprintf(buf, sizeof buf, "%8lld  %s\n", (long long)p.world, p.note.c_str());
    } else {
      std::snprintf(buf, sizeof buf, "%8lld  %12.0f  %5.1f%%  %8.3f  %10.3f  %s (%s)\n%56s%s\n", (long long)p.world,
                    p.best.time.tokens_per_s_per_gpu, 100 * p.best.time.mfu, p.best.time.step_time, p.efficiency,
                    p.best.layout.describe().c_str(), p.replica_ok && p.best.layout.describe() == p.replica.layout.describe()
                                                          ? "replica x dp" : "searched",
                    "", p.note.c_str());
    }
    os << buf;
  }
  return os.str();
}

}  // namespace moetron::plan
