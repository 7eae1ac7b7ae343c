// validate.cpp: the planner against measured engine runs (plan/validate.h): the layouts `plan validate` runs and
// their overrides, the engine's trace scopes grouped like the projection's op groups, the projection of the same
// job under the engine's precision convention, and the comparison: errors, bounds, the report's rows, text and
// JSON. Works on figures handed in (MeasuredRun); runs nothing.
#include "moetron/plan/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "moetron/check.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"

namespace moetron::plan {

namespace {

// printf into a std::string of any length.
template <class... A>
std::string fmt(const char* f, A... a) {
  const int n = std::snprintf(nullptr, 0, f, a...);
  std::string s(size_t(std::max(n, 0)) + 1, '\0');
  std::snprintf(s.data(), s.size(), f, a...);
  s.pop_back();
  return s;
}

const char* const kStepPartNames[kNumStepParts] = {"recompute", "optimizer", "weight_refresh", "ep_comm",
                                                   "dp_comm",   "fsdp",      "other"};
const char* const kFigureNames[5] = {"params", "grads", "optimizer", "activations", "step_s"};

// The op group of an engine scope (src/model/*.cpp, src/train/*.cpp MT_TRACE names), -1 for none.
int scope_group(const std::string& n) {
  auto is = [&](std::initializer_list<const char*> names) {
    for (const char* x : names)
      if (n == x) return true;
    return false;
  };
  if (is({"fwd.attn.proj", "fwd.attn.out_proj", "bwd.attn.proj", "bwd.attn.out_proj"})) return kOpAttnProj;
  if (is({"fwd.attn.core", "bwd.attn.core"})) return kOpAttnCore;
  if (is({"fwd.norm", "bwd.norm"})) return kOpNorm;
  if (is({"fwd.mlp", "fwd.shared", "bwd.mlp"})) return kOpFfn;
  if (is({"fwd.router", "fwd.router.gate_gemm", "bwd.router"})) return kOpRouter;
  if (is({"fwd.permute", "fwd.combine", "bwd.permute", "bwd.combine"})) return kOpPermute;
  if (is({"fwd.experts", "bwd.experts"})) return kOpExperts;
  if (is({"loss.fused_linear_xent"})) return kOpLoss;
  return -1;
}

// The step-level part of an engine scope, -1 for none (other).
int scope_part(const std::string& name) {
  if (name.rfind("optim.", 0) == 0) return kOptimizer;
  if (name == "sync_weights") return kRefresh;
  if (name.rfind("fwd.ep.", 0) == 0 || name.rfind("bwd.ep.", 0) == 0) return kEp;
  if (name.rfind("dp.", 0) == 0) return kDp;
  if (name.rfind("fsdp.", 0) == 0) return kFsdp;
  return -1;
}

// The scopes grouped, seconds per step (`steps` profiled steps whose mean is step_s).
OpTimes engine_ops(const std::vector<std::pair<std::string, double>>& ops, double steps, double step_s,
                   double recompute_s) {
  OpTimes o;
  double grouped = 0;
  for (const auto& [name, sec] : ops) {
    const double t = sec / steps;
    const int g = scope_group(name);
    if (g >= 0) {
      (name.rfind("bwd.", 0) == 0 ? o.b : o.f)[g] += t;
      grouped += t;
      continue;
    }
    const int p = scope_part(name);
    if (p < 0) continue;  // other
    o.part[p] += t;
    grouped += t;
  }
  o.part[kRecompute] = recompute_s;
  o.part[kOther] = std::max(0.0, step_s - grouped);
  return o;
}

// The projection for the run: the engine's recipe, the routing imbalance, no DP overlap (the engine reduces
// gradients after the backward).
struct Projection {
  PlanOptions po;
  Layout layout;
  MemoryPlan memory;
  TimePlan time;
};
Projection project(const JobConfig& c, int world, const Hardware& h, const MeasuredRun& run,
                   const std::string& ep_imbalance) {
  Projection p;
  p.po.recipe = recipe_named("engine", c);
  if (c.parallelism.ep > 1) p.po.ep_imbalance = ep_imbalance_for(ep_imbalance, run.ep_rows_peak);
  const bool alone = c.parallelism.world_size() == 1;
  p.layout = layout_from_config(c, alone ? 1 : world, /*distributed_optimizer=*/false);
  p.memory = plan_memory(c, p.layout, h, p.po);
  TimeOptions tpo;
  tpo.memory = p.po;
  tpo.overlap_dp = false;
  p.time = plan_time(c, p.layout, h, tpo, &p.memory);
  return p;
}

// The memory figures and the step time: measured, projected (the largest rank's per category; the step at the
// run's share), the error and its bound.
void compare_figures(const MeasuredRun& run, const Projection& p, double at_share, const ValidationBounds& bounds,
                     LayoutValidation& v) {
  const double meas[5] = {run.params, run.grads, run.optimizer, run.activations, run.step_s};
  double proj[5] = {0, 0, 0, 0, p.time.step_time * at_share};
  for (const auto& rm : p.memory.per_rank) {
    proj[0] = std::max(proj[0], rm.params);
    proj[1] = std::max(proj[1], rm.grads);
    proj[2] = std::max(proj[2], rm.optimizer + rm.main_params);
    proj[3] = std::max(proj[3], rm.activations);
  }
  for (int i = 0; i < 5; ++i) {
    FigureRow f;
    f.figure = kFigureNames[i];
    f.measured = meas[i], f.projected = proj[i], f.error = relative_error(proj[i], meas[i]);
    const bool ep_act = i == 3 && v.ep;  // any layout with expert parallelism (its received rows grow)
    f.bound = i == 4 ? bounds.step_time : ep_act ? bounds.ep_activations : bounds.memory;
    f.over = f.bound > 0 && std::fabs(f.error) > f.bound;
    v.figures.push_back(f);
  }
}

// The op groups side by side (the projection at the run's share), and the dense GEMMs' speed in the run against
// the projection's (a diagnostic, not a correction: on a shared host the cores' speed moves by tens of percent
// within seconds, which the CPU share does not see; docs/planner.md).
void compare_ops(const OpTimes& me, const TimePlan& t, double at_share, LayoutValidation& v) {
  OpTimes pr = projected_ops(t);
  for (int k = 0; k < kNumPlanOps; ++k) pr.f[k] *= at_share, pr.b[k] *= at_share;
  for (double& x : pr.part) x *= at_share;
  for (int k = 0; k < kNumPlanOps; ++k) {
    if (k == kOpLoss) {  // one engine scope holds the fused loss's forward and backward
      v.ops.push_back({plan_op_name(k), me.f[k] + me.b[k], pr.f[k] + pr.b[k]});
      continue;
    }
    v.ops.push_back({std::string(plan_op_name(k)) + ".fwd", me.f[k], pr.f[k]});
    v.ops.push_back({std::string(plan_op_name(k)) + ".bwd", me.b[k], pr.b[k]});
  }
  for (int p = 0; p < kNumStepParts; ++p) v.ops.push_back({kStepPartNames[p], me.part[p], pr.part[p]});
  double dm = 0, dp = 0;
  for (int k : {kOpAttnProj, kOpFfn}) dm += me.f[k] + me.b[k], dp += pr.f[k] + pr.b[k];
  v.dense_gemm_speed = dm > 0 && dp > 0 ? dp / dm : 1.0;
}

}  // namespace

std::vector<ValidationCase> validation_cases() {
  return {
      {"single", 1, {}},
      {"dp", 2, {"--parallelism.dp_replicate={w}"}},
      {"zero1", 2, {"--parallelism.dp_replicate={w}", "--parallelism.zero=1"}},
      {"fsdp", 2, {"--parallelism.dp_shard={w}", "--parallelism.zero=3"}},
      {"ep_alltoall", 2, {"--parallelism.dp_shard={w}", "--parallelism.ep={w}"}},
      {"ep_sync_free", 2, {"--parallelism.dp_shard={w}", "--parallelism.ep={w}", "--parallelism.ep_dispatcher=sync_free"}},
      {"ep_shm", 2, {"--parallelism.dp_shard={w}", "--parallelism.ep={w}", "--parallelism.ep_transport=shm"}},
      {"ep_hierarchical", 2, {"--parallelism.dp_shard={w}", "--parallelism.ep={w}",
                              "--parallelism.ep_dispatcher=hierarchical", "--parallelism.ranks_per_node={w2}"}},
      {"pp_1f1b", 2, {"--parallelism.pp=2", "--parallelism.dp_shard={w2}"}},
      {"pp_interleaved", 2, {"--parallelism.pp=2", "--parallelism.dp_shard={w2}",
                             "--parallelism.pp_schedule=interleaved_1f1b", "--parallelism.pp_virtual_stages=2"}},
      {"recompute_full", 2, {"--parallelism.dp_replicate={w}", "--activation_checkpoint.mode=full"}},
      {"tp", 2, {"--parallelism.tp={w}", "--parallelism.expert_tp={w}"}},
      {"cp", 2, {"--parallelism.cp={w}"}},
      // The seeds' layout shape at small scale (8 ranks): tp x cp x pp with EP over the data (and context) ranks.
      {"tp2_cp2_pp2_ep2", 8, {"--parallelism.tp=2", "--parallelism.expert_tp=2", "--parallelism.cp=2",
                              "--parallelism.pp=2", "--parallelism.ep=2"}},
      {"hsdp", 4, {"--parallelism.dp_replicate=2", "--parallelism.dp_shard={w2}", "--parallelism.zero=3"}},
  };
}

std::string substitute_world(std::string s, int world) {
  auto rep = [&](const std::string& k, const std::string& v) {
    for (size_t p; (p = s.find(k)) != std::string::npos;) s.replace(p, k.size(), v);
  };
  rep("{w2}", std::to_string(world / 2));
  rep("{w}", std::to_string(world));
  return s;
}

bool case_picked(const std::string& name, const std::string& only) {
  bool picked = only.empty();
  for (size_t p = 0; !picked && p != std::string::npos;) {
    const size_t q = only.find(',', p);
    const std::string part = only.substr(p, q == std::string::npos ? std::string::npos : q - p);
    picked = !part.empty() && name.find(part) != std::string::npos;
    p = q == std::string::npos ? q : q + 1;
  }
  return picked;
}

std::vector<std::string> case_overrides(const ValidationCase& cs, int world, int64_t steps, const std::string& dump,
                                        const std::string& compute) {
  std::vector<std::string> ov = {"--training.steps=" + std::to_string(steps), "--checkpoint.enable=false",
                                 "--training.micro_batch_size=2", "--training.seq_len=128",
                                 "--training.global_batch_size=8", "--training.dataset=synthetic",
                                 "--metrics.peak_tflops=1", "--training.val_interval=0", "--job.dump_folder=" + dump,
                                 "--training.compute_dtype=" + compute, "--training.memory_check=false"};
  for (const auto& x : cs.args) ov.push_back(substitute_world(x, world));
  return ov;
}

double relative_error(double projected, double measured) { return measured != 0 ? projected / measured - 1 : 0; }

const char* step_part_name(int part) { return part >= 0 && part < kNumStepParts ? kStepPartNames[part] : "?"; }

double compute_seconds(const OpTimes& o) {
  double t = 0;
  for (int k = 0; k < kNumPlanOps; ++k) t += o.f[k] + o.b[k];
  return t;
}

const OpTimes& busiest(const std::vector<OpTimes>& ranks) {
  MT_CHECK(!ranks.empty(), "plan validate", "no ranks' op times");
  return *std::max_element(ranks.begin(), ranks.end(), [](const OpTimes& x, const OpTimes& y) {
    return compute_seconds(x) < compute_seconds(y);
  });
}

OpTimes measured_ops(const std::vector<std::pair<std::string, double>>& scopes, const std::vector<double>& step_seconds,
                     double recompute_s) {
  // The profiled steps (all but the first) and their mean, which the scope totals add up to.
  double prof_s = 0;
  for (size_t i = 1; i < step_seconds.size(); ++i) prof_s += step_seconds[i];
  const double steps = double(std::max<size_t>(1, step_seconds.size() > 1 ? step_seconds.size() - 1 : 1));
  return engine_ops(scopes, steps, prof_s / steps, recompute_s / double(std::max<size_t>(1, step_seconds.size())));
}

OpTimes projected_ops(const TimePlan& t) {
  OpTimes o;
  for (int k = 0; k < kNumPlanOps; ++k) o.f[k] = t.ops_f[size_t(k)], o.b[k] = t.ops_b[size_t(k)];
  auto at = [&](const char* k) {
    const auto it = t.breakdown.find(k);
    return it == t.breakdown.end() ? 0.0 : it->second;
  };
  // The engine's recomputed kernels are counted under their forward names: the projection's recompute goes into
  // the forward groups too, in proportion to them (full recompute is the layer's forward again), and stays in its
  // row as a figure of its own.
  o.part[kRecompute] = at("compute.recompute");
  double fwd = 0;
  for (int k = 0; k < kNumPlanOps; ++k) fwd += k == kOpLoss ? 0.0 : o.f[k];
  if (fwd > 0)
    for (int k = 0; k < kNumPlanOps; ++k)
      if (k != kOpLoss) o.f[k] += o.part[kRecompute] * o.f[k] / fwd;
  o.part[kOptimizer] = t.optimizer;
  o.part[kEp] = at("comm.ep");
  // The engine re-packs an FSDP unit inside its gather (the fsdp scopes): the refresh counts there.
  if (t.layout.zero == 3) o.part[kFsdp] = t.dp_exposed + t.weight_refresh;
  else o.part[kDp] = t.dp_exposed, o.part[kRefresh] = t.weight_refresh;
  o.part[kOther] = at("bubble_and_p2p") + at("comm.tp") + at("comm.cp");
  return o;
}

double run_step_time(const std::vector<double>& step_seconds) {
  std::vector<double> st(step_seconds.size() > 1 ? step_seconds.begin() + 1 : step_seconds.end(),
                         step_seconds.end());
  if (st.empty() && !step_seconds.empty()) st.push_back(step_seconds[0]);
  std::sort(st.begin(), st.end());
  return st.empty() ? 0.0 : st[st.size() / 2];
}

size_t median_run(const std::vector<double>& run_step_s) {
  MT_CHECK(!run_step_s.empty(), "plan validate", "a layout without runs");
  std::vector<size_t> order(run_step_s.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return run_step_s[x] < run_step_s[y]; });
  return order[order.size() / 2];
}

double ep_imbalance_for(const std::string& option, double measured) {
  if (option == "measured") return std::max(1.0, measured);
  double v = 0;
  try {
    v = std::stod(option);
  } catch (const std::logic_error&) {
    MT_FAIL("plan validate", "--ep-imbalance = '", option, "': expected 'measured' or a number >= 1");
  }
  MT_CHECK(v >= 1, "plan validate", "--ep-imbalance = ", v, " must be >= 1");
  return v;
}

LayoutValidation validate_layout(const JobConfig& c, const std::string& name, int world, const Hardware& h,
                                 const MeasuredRun& run, const ValidationBounds& bounds,
                                 const std::string& ep_imbalance) {
  const Projection p = project(c, world, h, run, ep_imbalance);
  LayoutValidation v;
  v.name = name;
  v.planner_layout = p.layout.describe();
  v.ep = c.parallelism.ep > 1;
  v.ep_measured = run.ep_rows_peak, v.ep_held = run.ep_rows_held, v.ep_projected_with = p.po.ep_imbalance;
  // The projection is for ranks that own their cores (the calibration's figures are scaled to a full share); this
  // run got `cpu_share` of them (other processes on the machine): compare at that share.
  const double at_share = 1.0 / std::max(0.05, std::min(1.0, run.cpu_share));
  compare_figures(run, p, at_share, bounds, v);
  compare_ops(run.ops, p.time, at_share, v);
  v.cpu_share = run.cpu_share;
  v.step_full_share = p.time.step_time;
  v.step_runs = run.step_runs;
  return v;
}

std::string validation_header() {
  return fmt("%-16s %-10s %12s %12s %8s\n", "layout", "figure", "measured", "projected", "error");
}

std::string format_validation(const LayoutValidation& v, bool ops) {
  const char* n = v.name.c_str();
  std::string s;
  for (const FigureRow& f : v.figures)
    s += fmt("%-16s %-10s %12.4g %12.4g %+7.1f%%\n", n, f.figure.c_str(), f.measured, f.projected, 100 * f.error);
  if (ops)
    for (const OpRow& o : v.ops)
      s += fmt("%-16s   %-18s %10.4f %12.4f %+7.1f%%\n", n, o.name.c_str(), o.measured_s, o.projected_s,
               100 * relative_error(o.projected_s, o.measured_s));
  s += fmt("%-16s CPU share during the run %.2f (the smallest over ranks; 1 = no other process took these cores): "
           "step projected %.4g s at a full share, %.4g s at this one\n",
           n, v.cpu_share, v.step_full_share, v.figures.back().projected);
  s += fmt("%-16s the dense GEMMs (attention projections, dense FFN, shared experts) ran at %.2f x their projected "
           "rate\n",
           n, v.dense_gemm_speed);
  if (v.step_runs.size() > 1) {
    s += fmt("%-16s step time of each run:", n);
    for (double x : v.step_runs) s += fmt(" %.4g", x);
    s += " s (the median's run is reported)\n";
  }
  if (v.ep)
    s += fmt("%-16s ep rows: the most one dispatch brought %.3f x balanced (projected with %.3f); the buffers hold "
             "%.3f x\n",
             n, v.ep_measured, v.ep_projected_with, v.ep_held);
  return s;
}

std::vector<std::string> beyond_bounds(const LayoutValidation& v) {
  std::vector<std::string> out;
  for (const FigureRow& f : v.figures)
    if (f.over) out.push_back(v.name + " " + f.figure + " error " + std::to_string(f.error));
  return out;
}

nlohmann::json to_json(const LayoutValidation& v) {
  nlohmann::json j{{"layout", v.name}, {"planner_layout", v.planner_layout}};
  if (v.ep) j["ep_imbalance"] = {{"measured", v.ep_measured}, {"held", v.ep_held}, {"projected_with", v.ep_projected_with}};
  for (const FigureRow& f : v.figures)
    j[f.figure] = {{"measured", f.measured}, {"projected", f.projected}, {"error", f.error}};
  nlohmann::json jo;
  for (const OpRow& o : v.ops) jo[o.name] = {{"measured_s", o.measured_s}, {"projected_s", o.projected_s}};
  j["ops"] = jo;
  j["cpu_share"] = v.cpu_share;
  j["step_s"]["runs"] = v.step_runs;
  j["step_s"]["projected_full_share"] = v.step_full_share;
  j["dense_gemm_speed"] = v.dense_gemm_speed;
  return j;
}

nlohmann::json validation_json(int world, const Hardware& h, const std::string& calibration,
                               const std::vector<LayoutValidation>& layouts) {
  nlohmann::json out = nlohmann::json::array();
  for (const LayoutValidation& v : layouts) out.push_back(to_json(v));
  return nlohmann::json{{"world", world}, {"hardware", hardware_to_toml(h)}, {"calibration", calibration},
                        {"layouts", out}};
}

}  // namespace moetron::plan
