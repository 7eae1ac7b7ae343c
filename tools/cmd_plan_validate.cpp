// cmd_plan_validate.cpp: `moetron plan validate [--hw FILE]`: runs the engine here on a set of small layouts
// (DP, ZeRO-1, FSDP, EP with each dispatcher, PP with two schedules, recompute) and compares what it measured
// (peak bytes per memory category on every rank, step time) with the planner's projection of the same job on
// this machine's hardware (a calibrated TOML, or a quick calibration first) under the engine's own precision
// convention. Prints the error of every figure; --json for programs. Run it under mpirun (4 ranks covers every
// layout; fewer ranks skip what does not fit). Not a test by itself: tests/CMakeLists.txt holds it to its
// tolerances.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli.h"
#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/model.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"
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

}  // namespace

namespace moetron::cli {
void add_plan_validate(CLI::App* plan) {
  auto* val = plan->add_subcommand(
      "validate", "Run the engine on small layouts and compare measured memory and step time with the projection");
  struct Args {
    std::string config, hw, only;
    int64_t steps = 4;
    bool json = false, quick = false;
    double max_mem = 0, max_ep_act = 0.30, max_time = 0;
  };
  auto a = std::make_shared<Args>();
  val->add_option("--config", a->config, "the job (default configs/ds_mini.toml)");
  val->add_option("--hw", a->hw, "this machine's hardware TOML (default: calibrate first)");
  val->add_option("--steps", a->steps, "training steps per layout (default 4; the first is not timed)");
  val->add_option("--only", a->only, "run the layouts whose name contains one of these comma-separated texts");
  val->add_flag("--quick", a->quick, "a quick calibration when --hw is not given");
  val->add_flag("--json", a->json, "print one JSON object");
  val->add_option("--max-memory-error", a->max_mem,
                  "fail when a memory figure's |error| exceeds this fraction (0 = report only); EP activations "
                  "use --max-ep-activation-error");
  val->add_option("--max-ep-activation-error", a->max_ep_act,
                  "the bound for EP layouts' activations (the engine sizes routed rows by the most a rank has "
                  "received: routing skew the projection's balanced rows do not see; default 0.30)");
  val->add_option("--max-time-error", a->max_time, "fail when a step time's |error| exceeds this (0 = report only)");
  val->callback([a] {
    const Comm w = comm_world();
    const bool root = w.rank() == 0;
    std::string header;
    const plan::Hardware h = a->hw.empty() ? calibrate_machine(w, a->quick, &header) : plan::resolve_hardware(a->hw);
    const std::string cfg_path = a->config.empty() ? "configs/ds_mini.toml" : a->config;
    const ComputeDtype dt = resolve_compute_dtype(ComputeDtype::Auto);
    const std::string dump = (std::filesystem::temp_directory_path() / "moetron_plan_validate").string();
    nlohmann::json out = nlohmann::json::array();
    std::vector<std::string> over;  // figures beyond their bound
    if (root && !a->json)
      std::printf("%-16s %-10s %12s %12s %8s\n", "layout", "figure", "measured", "projected", "error");
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
      const JobConfig c = load_config(cfg_path, ov);
      // The one-process layout runs on every rank at once, each alone (the same share of the cores as the others).
      const Comm self = w.split(w.rank(), 0);
      const bool alone = c.parallelism.world_size() == 1;
      TrainOptions to;
      to.quiet = true;
      to.comm = alone ? &self : &w;
      const TrainResult r = train(c, to);
      // Measured: the largest rank's figure per category, then its step time.
      double meas[5] = {double(r.params_peak_bytes), double(r.grads_peak_bytes), double(r.optimizer_peak_bytes),
                        double(r.act_peak_bytes), 0};
      for (int i = 0; i < 4; ++i) meas[i] = max_over_ranks(w, meas[i]);
      // Step time: the median over the steps after the first (which creates the kernels' primitives), the
      // slowest rank's.
      {
        std::vector<double> st;
        for (size_t i = 1; i < r.history.size(); ++i) st.push_back(r.history[i].seconds);
        if (st.empty() && !r.history.empty()) st.push_back(r.history[0].seconds);
        std::sort(st.begin(), st.end());
        meas[4] = max_over_ranks(w, st.empty() ? 0.0 : st[st.size() / 2]);
      }
      // Projected: the same job on this machine, the engine's precision convention.
      plan::PlanOptions po;
      po.recipe = plan::recipe_named("engine", c);
      const plan::Layout l = plan::layout_from_config(c, alone ? 1 : w.size(), /*distributed_optimizer=*/false);
      const plan::MemoryPlan mp = plan::plan_memory(c, l, h, po);
      plan::TimeOptions tpo;
      tpo.memory = po;
      tpo.overlap_dp = false;  // the engine reduces gradients after the backward
      const plan::TimePlan tp = plan::plan_time(c, l, h, tpo, &mp);
      double proj[5] = {0, 0, 0, 0, tp.step_time};
      for (const auto& rm : mp.per_rank) {
        proj[0] = std::max(proj[0], rm.params);
        proj[1] = std::max(proj[1], rm.grads);
        proj[2] = std::max(proj[2], rm.optimizer + rm.main_params);
        proj[3] = std::max(proj[3], rm.activations);
      }
      const char* names[5] = {"params", "grads", "optimizer", "activations", "step_s"};
      nlohmann::json j{{"layout", cs.name}, {"planner_layout", l.describe()}};
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
