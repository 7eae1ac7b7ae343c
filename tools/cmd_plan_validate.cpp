// cmd_plan_validate.cpp: `moetron plan validate [--hw FILE]`: runs the engine here on a set of small layouts
// (DP, ZeRO-1, FSDP, EP with each dispatcher, PP with two schedules, recompute) and compares what it measured
// (peak bytes per memory category on every rank, step time) with the planner's projection of the same job on
// this machine's hardware (a calibrated TOML, or a quick calibration first) under the engine's own precision
// convention. Prints the error of every figure; --json for programs; --ops adds the step time by op group, the
// engine's trace scopes against the projection's op groups (plan/cost.h PlanOp). Under EP the projection takes the
// routing imbalance the engine measured (TrainResult::ep_rows_peak_ratio). Run it under mpirun (4 ranks covers
// every layout; fewer ranks skip what does not fit). Not a test by itself: tests/CMakeLists.txt holds it to its
// tolerances.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "cli.h"
#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/model.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"
#include "moetron/runtime.h"
#include "moetron/trainer.h"
#include "plan_cmds.h"

namespace {
using namespace moetron;

struct Case {
  std::string name;
  int min_world;
  std::vector<std::string> args;  // for a world of w ranks, "{w}" and "{w2}" (w / 2) are replaced
};

std::vector<Case> cases() {
  return {
      {"single", 1, {}},
      {"dp", 2, {"--parallelism.dp_replicate={w}"}},
      {"zero1", 2, {"--parallelism.dp_replicate={w}", "--parallelism.zero=1"}},
      {"fsdp", 2, {"--parallelism.dp_shard={w}", "--parallelism.zero=3"}},
      {"ep_alltoall", 2, {"--parallelism.dp_shard={w}", "--parallelism.ep={w}"}},
      {"ep_sync_free", 2, {"--parallelism.dp_shard={w}", "--parallelism.ep={w}", "--parallelism.ep_dispatcher=sync_free"}},
      {"ep_hierarchical", 2, {"--parallelism.dp_shard={w}", "--parallelism.ep={w}",
                              "--parallelism.ep_dispatcher=hierarchical", "--parallelism.ranks_per_node={w2}"}},
      {"pp_1f1b", 2, {"--parallelism.pp=2", "--parallelism.dp_shard={w2}"}},
      {"pp_interleaved", 2, {"--parallelism.pp=2", "--parallelism.dp_shard={w2}",
                             "--parallelism.pp_schedule=interleaved_1f1b", "--parallelism.pp_virtual_stages=2"}},
      {"recompute_full", 2, {"--parallelism.dp_replicate={w}", "--activation_checkpoint.mode=full"}},
  };
}

std::string subst(std::string s, int w) {
  auto rep = [&](const std::string& k, const std::string& v) {
    for (size_t p; (p = s.find(k)) != std::string::npos;) s.replace(p, k.size(), v);
  };
  rep("{w2}", std::to_string(w / 2));
  rep("{w}", std::to_string(w));
  return s;
}

double err(double projected, double measured) { return measured != 0 ? projected / measured - 1 : 0; }

// The step time by op group, seconds per step: the compute groups of plan/cost.h (forward, backward) and the
// step-level parts.
enum StepPart : int { kRecompute = 0, kOptimizer, kRefresh, kEp, kDp, kFsdp, kOther, kNumStepParts };  // recompute: inside the forward groups
const char* const kStepPartNames[kNumStepParts] = {"recompute", "optimizer", "weight_refresh", "ep_comm",
                                                   "dp_comm",   "fsdp",      "other"};
struct OpTimes {
  double f[plan::kNumPlanOps] = {}, b[plan::kNumPlanOps] = {};
  double part[kNumStepParts] = {};
};

// The engine's kernel scopes (trace::totals(): by name, none nested) grouped like the projection (src/model/*.cpp,
// src/train/*.cpp MT_TRACE names). A recomputed layer's kernels keep their forward names (inside a "recompute"
// module scope, which totals() does not split out): under recompute the forward groups hold them, and the recompute
// row is the model's own clock (TrainResult::recompute_seconds). What no scope covers (residual adds, the loss
// scale, the schedule's bookkeeping) and the untraced-by-the-projection scopes (embedding, data, bwd.weight) are
// `other`: the mean profiled step less the scopes it groups.
OpTimes engine_ops(const std::vector<std::pair<std::string, double>>& ops, double steps, double step_s,
                   double recompute_s) {
  OpTimes o;
  auto group = [](const std::string& n) -> int {
    auto is = [&](std::initializer_list<const char*> names) {
      for (const char* x : names)
        if (n == x) return true;
      return false;
    };
    if (is({"fwd.attn.proj", "fwd.attn.out_proj", "bwd.attn.proj", "bwd.attn.out_proj"})) return plan::kOpAttnProj;
    if (is({"fwd.attn.core", "bwd.attn.core"})) return plan::kOpAttnCore;
    if (is({"fwd.norm", "bwd.norm"})) return plan::kOpNorm;
    if (is({"fwd.mlp", "fwd.shared", "bwd.mlp"})) return plan::kOpFfn;
    if (is({"fwd.router", "fwd.router.gate_gemm", "bwd.router"})) return plan::kOpRouter;
    if (is({"fwd.permute", "fwd.combine", "bwd.permute", "bwd.combine"})) return plan::kOpPermute;
    if (is({"fwd.experts", "bwd.experts"})) return plan::kOpExperts;
    if (is({"loss.fused_linear_xent"})) return plan::kOpLoss;
    return -1;
  };
  double grouped = 0;
  for (const auto& [name, sec] : ops) {
    const double t = sec / steps;
    const int g = group(name);
    if (g >= 0) {
      (name.rfind("bwd.", 0) == 0 ? o.b : o.f)[g] += t;
      grouped += t;
      continue;
    }
    int p = -1;
    if (name.rfind("optim.", 0) == 0) p = kOptimizer;
    else if (name == "sync_weights") p = kRefresh;
    else if (name.rfind("fwd.ep.", 0) == 0 || name.rfind("bwd.ep.", 0) == 0) p = kEp;
    else if (name.rfind("dp.", 0) == 0) p = kDp;
    else if (name.rfind("fsdp.", 0) == 0) p = kFsdp;
    if (p < 0) continue;  // other
    o.part[p] += t;
    grouped += t;
  }
  o.part[kRecompute] = recompute_s;
  o.part[kOther] = std::max(0.0, step_s - grouped);
  return o;
}

// The projection's figures in the same groups.
OpTimes projected_ops(const plan::TimePlan& t) {
  OpTimes o;
  for (int k = 0; k < plan::kNumPlanOps; ++k) o.f[k] = t.ops_f[size_t(k)], o.b[k] = t.ops_b[size_t(k)];
  auto at = [&](const char* k) {
    const auto it = t.breakdown.find(k);
    return it == t.breakdown.end() ? 0.0 : it->second;
  };
  // The engine's recomputed kernels are counted under their forward names: the projection's recompute goes into
  // the forward groups too, in proportion to them (full recompute is the layer's forward again), and stays in its
  // row as a figure of its own.
  o.part[kRecompute] = at("compute.recompute");
  double fwd = 0;
  for (int k = 0; k < plan::kNumPlanOps; ++k) fwd += k == plan::kOpLoss ? 0.0 : o.f[k];
  if (fwd > 0)
    for (int k = 0; k < plan::kNumPlanOps; ++k)
      if (k != plan::kOpLoss) o.f[k] += o.part[kRecompute] * o.f[k] / fwd;
  o.part[kOptimizer] = t.optimizer;
  o.part[kEp] = at("comm.ep");
  // The engine re-packs an FSDP unit inside its gather (the fsdp scopes): the refresh counts there.
  if (t.layout.zero == 3) o.part[kFsdp] = t.dp_exposed + t.weight_refresh;
  else o.part[kDp] = t.dp_exposed, o.part[kRefresh] = t.weight_refresh;
  o.part[kOther] = at("bubble_and_p2p") + at("comm.tp") + at("comm.cp");
  return o;
}

}  // namespace

namespace moetron::cli {
void add_plan_validate(CLI::App* plan) {
  auto* val = plan->add_subcommand(
      "validate", "Run the engine on small layouts and compare measured memory and step time with the projection");
  struct Args {
    std::string config, hw, only;
    int64_t steps = 6;
    int rounds = 3;
    int repeats = 1;
    bool json = false, quick = false, ops = false;
    double max_mem = 0, max_ep_act = 0.10, max_time = 0;
    std::string ep_imbalance = "measured";
  };
  auto a = std::make_shared<Args>();
  val->add_option("--config", a->config, "the job (default configs/ds_mini.toml)");
  auto* hw = val->add_option("--hw", a->hw, "this machine's hardware TOML (default: calibrate first)");
  val->add_option("--steps", a->steps, "training steps per layout (default 6; the first is not timed)");
  val->add_option("--rounds", a->rounds, "calibration rounds when --hw is not given (default 3, see plan calibrate)")
      ->check(CLI::Range(1, 50))
      ->excludes(hw);  // with --hw there is no calibration for it to shape
  val->add_option("--repeats", a->repeats,
                  "engine runs per layout, interleaved over the layouts (default 1); each layout reports the run with "
                  "the median step time, so a run the host slowed for a while does not decide the figure")
      ->check(CLI::Range(1, 9));
  val->add_option("--only", a->only, "run the layouts whose name contains one of these comma-separated texts");
  val->add_flag("--quick", a->quick, "a quick calibration when --hw is not given")->excludes(hw);
  val->add_flag("--json", a->json, "print one JSON object");
  val->add_flag("--ops", a->ops, "also print the step time by op group (engine trace scopes against the projection)");
  val->add_option("--ep-imbalance", a->ep_imbalance,
                  "routing imbalance the EP layouts are projected with: 'measured' (default: the engine's most rows "
                  "one dispatch brought over tokens x topk) or a number >= 1");
  val->add_option("--max-memory-error", a->max_mem,
                  "fail when a memory figure's |error| exceeds this fraction (0 = report only); EP activations "
                  "use --max-ep-activation-error");
  val->add_option("--max-ep-activation-error", a->max_ep_act,
                  "the bound for EP layouts' activations (projected with the measured routing imbalance; the engine's "
                  "buffers also keep the slack of their growth history; default 0.10)");
  val->add_option("--max-time-error", a->max_time, "fail when a step time's |error| exceeds this (0 = report only)");
  val->callback([a] {
    const Comm w = comm_world();
    const bool root = w.rank() == 0;
    std::string header;
    const plan::Hardware h =
        a->hw.empty() ? calibrate_machine(w, a->quick, &header, a->rounds) : plan::resolve_hardware(a->hw);
    const std::string cfg_path = a->config.empty() ? "configs/ds_mini.toml" : a->config;
    const ComputeDtype dt = resolve_compute_dtype(ComputeDtype::Auto);
    const std::string dump = (std::filesystem::temp_directory_path() / "moetron_plan_validate").string();
    nlohmann::json out = nlohmann::json::array();
    std::vector<std::string> over;  // figures beyond their bound
    if (root && !a->json)
      std::printf("%-16s %-10s %12s %12s %8s\n", "layout", "figure", "measured", "projected", "error");
    // The layouts picked, each with its config, then their runs: repeat after repeat over all of them, so that a
    // slow spell of the host falls on different layouts' runs.
    struct Picked {
      Case cs;
      JobConfig c;
      std::vector<TrainResult> runs;
      std::vector<double> shares, steps;  // per run: the CPU share, the step time (below)
    };
    std::vector<Picked> todo;
    for (const Case& cs : cases()) {
      bool picked = a->only.empty();
      for (size_t p = 0; !picked && p != std::string::npos;) {  // --only: comma-separated names (or parts)
        const size_t q = a->only.find(',', p);
        const std::string part = a->only.substr(p, q == std::string::npos ? std::string::npos : q - p);
        picked = !part.empty() && cs.name.find(part) != std::string::npos;
        p = q == std::string::npos ? q : q + 1;
      }
      if (w.size() < cs.min_world || !picked) continue;
      // A small job: 2 sequences of 128 tokens per micro-batch, 8 per step (every layout here divides it).
      std::vector<std::string> ov = {"--training.steps=" + std::to_string(a->steps), "--checkpoint.enable=false",
                                     "--training.micro_batch_size=2", "--training.seq_len=128",
                                     "--training.global_batch_size=8",
                                     "--training.dataset=synthetic", "--metrics.peak_tflops=1",
                                     "--training.val_interval=0", "--job.dump_folder=" + dump,
                                     std::string("--training.compute_dtype=") + (dt == ComputeDtype::BF16 ? "bf16" : "fp32"),
                                     "--training.memory_check=false"};
      for (const auto& x : cs.args) ov.push_back(subst(x, w.size()));
      todo.push_back(Picked{cs, load_config(cfg_path, ov), {}, {}, {}});
    }
    for (int rep = 0; rep < a->repeats; ++rep)
      for (Picked& pk : todo) {
        // The one-process layout runs on every rank at once, each alone (the same share of the cores as the others).
        const Comm self = w.split(w.rank(), 0);
        TrainOptions to;
        to.quiet = true;
        to.profile = true;  // the per-op breakdown (trace scopes: a branch and a clock read each)
        to.comm = pk.c.parallelism.world_size() == 1 ? &self : &w;
        const CpuShare cpu_share(num_threads());
        pk.runs.push_back(train(pk.c, to));
        pk.shares.push_back(min_over_ranks(w, cpu_share.share()));
        // Step time: the median over the steps after the first (which creates the kernels' primitives), the
        // slowest rank's.
        const TrainResult& r = pk.runs.back();
        std::vector<double> st;
        for (size_t i = 1; i < r.history.size(); ++i) st.push_back(r.history[i].seconds);
        if (st.empty() && !r.history.empty()) st.push_back(r.history[0].seconds);
        std::sort(st.begin(), st.end());
        pk.steps.push_back(max_over_ranks(w, st.empty() ? 0.0 : st[st.size() / 2]));
      }
    for (const Picked& pk : todo) {
      const Case& cs = pk.cs;
      const JobConfig& c = pk.c;
      const bool alone = c.parallelism.world_size() == 1;
      // The run with the median step time (the same on every rank: the step times are reduced over ranks).
      std::vector<size_t> order(pk.steps.size());
      for (size_t k = 0; k < order.size(); ++k) order[k] = k;
      std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return pk.steps[x] < pk.steps[y]; });
      const size_t pick = order[order.size() / 2];
      const TrainResult& r = pk.runs[pick];
      const double share = pk.shares[pick];

      // Measured: the largest rank's figure per category, then its step time.
      double meas[5] = {double(r.params_peak_bytes), double(r.grads_peak_bytes), double(r.optimizer_peak_bytes),
                        double(r.act_peak_bytes), pk.steps[pick]};
      for (int i = 0; i < 4; ++i) meas[i] = max_over_ranks(w, meas[i]);
      // Projected: the same job on this machine, the engine's precision convention.
      plan::PlanOptions po;
      po.recipe = plan::recipe_named("engine", c);
      const double measured_imb = max_over_ranks(w, r.ep_rows_peak_ratio);
      const double held_imb = max_over_ranks(w, r.ep_rows_held_ratio);
      if (c.parallelism.ep > 1) {
        if (a->ep_imbalance == "measured") {
          po.ep_imbalance = std::max(1.0, measured_imb);
        } else {
          try {
            po.ep_imbalance = std::stod(a->ep_imbalance);
          } catch (const std::logic_error&) {
            MT_FAIL("plan validate", "--ep-imbalance = '", a->ep_imbalance, "': expected 'measured' or a number >= 1");
          }
          MT_CHECK(po.ep_imbalance >= 1, "plan validate", "--ep-imbalance = ", po.ep_imbalance, " must be >= 1");
        }
      }
      const plan::Layout l = plan::layout_from_config(c, alone ? 1 : w.size(), /*distributed_optimizer=*/false);
      const plan::MemoryPlan mp = plan::plan_memory(c, l, h, po);
      plan::TimeOptions tpo;
      tpo.memory = po;
      tpo.overlap_dp = false;  // the engine reduces gradients after the backward
      const plan::TimePlan tp = plan::plan_time(c, l, h, tpo, &mp);
      // The projection is for ranks that own their cores (the calibration's figures are scaled to a full share);
      // this run got `share` of them (other processes on the machine): compare at that share.
      const double at_share = 1.0 / std::max(0.05, std::min(1.0, share));
      double proj[5] = {0, 0, 0, 0, tp.step_time * at_share};
      for (const auto& rm : mp.per_rank) {
        proj[0] = std::max(proj[0], rm.params);
        proj[1] = std::max(proj[1], rm.grads);
        proj[2] = std::max(proj[2], rm.optimizer + rm.main_params);
        proj[3] = std::max(proj[3], rm.activations);
      }
      const char* names[5] = {"params", "grads", "optimizer", "activations", "step_s"};
      nlohmann::json j{{"layout", cs.name}, {"planner_layout", l.describe()}};
      if (c.parallelism.ep > 1)
        j["ep_imbalance"] = {{"measured", measured_imb}, {"held", held_imb}, {"projected_with", po.ep_imbalance}};
      for (int i = 0; i < 5; ++i) {
        j[names[i]] = {{"measured", meas[i]}, {"projected", proj[i]}, {"error", err(proj[i], meas[i])}};
        const bool ep_act = i == 3 && cs.name.rfind("ep_", 0) == 0;
        const double bound = i == 4 ? a->max_time : ep_act ? a->max_ep_act : a->max_mem;
        if (bound > 0 && std::fabs(err(proj[i], meas[i])) > bound)
          over.push_back(cs.name + " " + names[i] + " error " + std::to_string(err(proj[i], meas[i])));
        if (root && !a->json)
          std::printf("%-16s %-10s %12.4g %12.4g %+7.1f%%\n", cs.name.c_str(), names[i], meas[i], proj[i],
                      100 * err(proj[i], meas[i]));
      }
      double gemm_speed = 1.0;  // the run's dense-GEMM speed over the calibration's (below)
      // By op group: the engine's scopes over the profiled steps (all but the first) on the rank that computes the
      // most (the projection's groups are those of its slowest pipeline rank; a rank that computes less waits
      // inside its communication, which a per-group maximum over ranks would count twice).
      {
        // The profiled steps (all but the first) and their mean, which the scope totals add up to.
        double prof_s = 0;
        for (size_t i = 1; i < r.history.size(); ++i) prof_s += r.history[i].seconds;
        const double steps = double(std::max<size_t>(1, r.history.size() > 1 ? r.history.size() - 1 : 1));
        OpTimes me = engine_ops(r.op_seconds, steps, prof_s / steps,
                                 r.recompute_seconds / double(std::max<size_t>(1, r.history.size())));
        OpTimes pr = projected_ops(tp);
        for (int k = 0; k < plan::kNumPlanOps; ++k) pr.f[k] *= at_share, pr.b[k] *= at_share;
        for (double& x : pr.part) x *= at_share;
        {
          static_assert(std::is_trivially_copyable_v<OpTimes>);
          std::vector<OpTimes> all(static_cast<size_t>(w.size()));
          w.all_gather(all.data(), &me, sizeof(OpTimes));
          auto compute = [](const OpTimes& o) {
            double t = 0;
            for (int k = 0; k < plan::kNumPlanOps; ++k) t += o.f[k] + o.b[k];
            return t;
          };
          me = *std::max_element(all.begin(), all.end(),
                                 [&](const OpTimes& x, const OpTimes& y) { return compute(x) < compute(y); });
        }
        nlohmann::json jo;
        auto row = [&](const std::string& name, double m_s, double p_s) {
          jo[name] = {{"measured_s", m_s}, {"projected_s", p_s}};
          if (root && !a->json && a->ops)
            std::printf("%-16s   %-18s %10.4f %12.4f %+7.1f%%\n", cs.name.c_str(), name.c_str(), m_s, p_s,
                        100 * err(p_s, m_s));
        };
        for (int k = 0; k < plan::kNumPlanOps; ++k) {
          if (k == plan::kOpLoss) {  // one engine scope holds the fused loss's forward and backward
            row(plan::plan_op_name(k), me.f[k] + me.b[k], pr.f[k] + pr.b[k]);
            continue;
          }
          row(std::string(plan::plan_op_name(k)) + ".fwd", me.f[k], pr.f[k]);
          row(std::string(plan::plan_op_name(k)) + ".bwd", me.b[k], pr.b[k]);
        }
        for (int p = 0; p < kNumStepParts; ++p) row(kStepPartNames[p], me.part[p], pr.part[p]);
        j["ops"] = jo;
        // The dense GEMMs' speed in this run against the projection's (a diagnostic, not a correction): on a shared
        // host the cores' speed moves by tens of percent within seconds (a neighbour on the sibling hardware threads,
        // the shared cache), which the CPU share does not see; a reference GEMM timed just before and after a run
        // was tried and did not predict the run's speed (docs/planner.md).
        double dm = 0, dp = 0;
        for (int k : {plan::kOpAttnProj, plan::kOpFfn}) dm += me.f[k] + me.b[k], dp += pr.f[k] + pr.b[k];
        gemm_speed = dm > 0 && dp > 0 ? dp / dm : 1.0;
      }
      j["cpu_share"] = share;
      j["step_s"]["runs"] = pk.steps;
      j["step_s"]["projected_full_share"] = tp.step_time;
      j["dense_gemm_speed"] = gemm_speed;
      if (root && !a->json) {
        std::printf("%-16s CPU share during the run %.2f (the smallest over ranks; 1 = no other process took these "
                    "cores): step projected %.4g s at a full share, %.4g s at this one\n", cs.name.c_str(), share,
                    tp.step_time, proj[4]);
        std::printf("%-16s the dense GEMMs (attention projections, dense FFN, shared experts) ran at %.2f x their "
                    "projected rate\n", cs.name.c_str(), gemm_speed);
      }
      if (root && !a->json && pk.steps.size() > 1) {
        std::printf("%-16s step time of each run:", cs.name.c_str());
        for (double x : pk.steps) std::printf(" %.4g", x);
        std::printf(" s (the median's run is reported)\n");
      }
      if (root && !a->json && c.parallelism.ep > 1)
        std::printf("%-16s ep rows: the most one dispatch brought %.3f x balanced (projected with %.3f); the buffers "
                    "hold %.3f x\n", cs.name.c_str(), measured_imb, po.ep_imbalance, held_imb);
      out.push_back(j);
    }
    if (root && !over.empty()) {
      for (const auto& o : over) std::fprintf(stderr, "plan validate: beyond its bound: %s\n", o.c_str());
    }
    MT_CHECK(over.empty(), "plan validate", over.size(), " figure(s) beyond their bound (listed above)");
    if (root && a->json) {
      nlohmann::json doc{{"world", w.size()}, {"hardware", plan::hardware_to_toml(h)}, {"calibration", header},
                         {"layouts", out}};
      std::printf("%s\n", doc.dump(2).c_str());
    }
  });
}
}  // namespace moetron::cli
