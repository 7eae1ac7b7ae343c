// cmd_plan.cpp: `moetron plan memory|time|search|scale CONFIG --hw H ...`: the planner's commands (tables for
// people, --json for programs; docs/planner.md lists the JSON keys). The planner library (src/plan/) links the
// job description and the schedule IR only; this file is its command line. Not the engine.
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli.h"
#include "plan_cmds.h"
#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"
#include "moetron/plan/search.h"
#include "moetron/plan/trace_export.h"

namespace {
using namespace moetron;

struct PlanArgs {
  std::string config, hw, recipe = "megatron";
  int64_t world = 0;
  double gbt = 0;  // global batch tokens (0 = the config's)
  double margin = 0.10;
  double ep_imbalance = 1.0;
  bool unfused_loss = false, json = false, no_dist_opt = false;
  int64_t top_k = 5;
  int64_t threads = 0;
  int64_t min_replica = 1;
  std::string worlds;
  std::string trace;  // plan time --trace DIR
};

void common(CLI::App* a, PlanArgs& p, bool need_world) {
  a->add_option("config", p.config, "TOML job config (e.g. configs/deepseek_v3.toml)")->required();
  a->add_option("--hw", p.hw, "hardware: mi300x, mi325x, mi355x, a100, a100_nccl, h100, h200, h800, b200, gb200, gb300, or a TOML file")->required();
  if (need_world) a->add_option("--world", p.world, "number of GPUs")->required();
  a->add_option("--global-batch-tokens", p.gbt, "global batch in tokens (default: training.global_batch_size x seq_len)");
  a->add_option("--recipe", p.recipe, "precision recipe: megatron (bf16 params, fp32 grads/main/moments) or engine");
  a->add_option("--margin", p.margin, "AT-RISK band below HBM (fraction, default 0.10)");
  a->add_option("--ep-imbalance", p.ep_imbalance,
                "routing imbalance under EP: the busiest rank's routed rows over the balanced count (>= 1, default 1)");
  a->add_flag("--unfused-loss", p.unfused_loss, "the loss keeps logits and softmax (no loss fusion)");
  a->add_flag("--json", p.json, "print one JSON object");
  a->add_flag("--no-distributed-optimizer", p.no_dist_opt,
              "keep parallelism.zero = 0 (by default the planner plans zero 0 as Megatron's distributed optimizer, zero 1)");
  a->allow_extras();
}

JobConfig load(const PlanArgs& p, CLI::App* a) {
  JobConfig c = load_config(p.config, a->remaining());
  if (p.gbt > 0) {
    const double seqs = p.gbt / double(c.training.seq_len);
    MT_CHECK(seqs >= 1 && std::floor(seqs) == seqs, "plan", "--global-batch-tokens = ", p.gbt,
             " must be a positive multiple of training.seq_len (", c.training.seq_len, ")");
    c.training.global_batch_size = int64_t(seqs);
    c.parallelism.pp_microbatches = 0;
  }
  return c;
}

plan::PlanOptions options(const PlanArgs& p, const JobConfig& c) {
  plan::PlanOptions o;
  o.recipe = plan::recipe_named(p.recipe, c);
  o.fused_loss = !p.unfused_loss;
  MT_CHECK(p.margin >= 0 && p.margin < 1, "plan", "--margin = ", p.margin, " must lie in [0, 1)");
  o.margin = p.margin;
  MT_CHECK(p.ep_imbalance >= 1, "plan", "--ep-imbalance = ", p.ep_imbalance,
           " must be >= 1 (the busiest rank's routed rows over the balanced count)");
  o.ep_imbalance = p.ep_imbalance;
  return o;
}

std::vector<int64_t> parse_worlds(const std::string& s) {
  std::vector<int64_t> w;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const long long v = std::stoll(item, &used);
      MT_CHECK(used == item.size() && v >= 1, "plan scale", "--worlds: '", item, "' is not a positive integer");
      w.push_back(v);
    } catch (const std::logic_error&) {
      MT_FAIL("plan scale", "--worlds: '", item, "' is not a positive integer");
    }
  }
  MT_CHECK(!w.empty(), "plan scale", "--worlds needs at least one size, e.g. 768,1024,2048");
  return w;
}

}  // namespace

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* plan = root.add_subcommand("plan", "Project a job onto a GPU cluster: memory, step time, layout search, scaling");
  plan->require_subcommand(1);

  auto pm = std::make_shared<PlanArgs>();
  auto* mem = plan->add_subcommand("memory", "Per-rank memory by category and pipeline stage, with a FITS / AT-RISK / OOM verdict");
  common(mem, *pm, true);
  mem->callback([mem, pm] {
    const JobConfig c = load(*pm, mem);
    const plan::Hardware h = plan::resolve_hardware(pm->hw);
    const plan::Layout l = plan::layout_from_config(c, pm->world, !pm->no_dist_opt);
    const plan::MemoryPlan m = plan::plan_memory(c, l, h, options(*pm, c));
    if (pm->json) std::printf("%s\n", plan::to_json(m).dump(2).c_str());
    else std::printf("%s", plan::format_memory(m).c_str());
  });

  auto pt = std::make_shared<PlanArgs>();
  auto* tim = plan->add_subcommand("time", "Step time, tokens/s/GPU, TFLOPS/GPU, MFU and a breakdown");
  common(tim, *pt, true);
  tim->add_option("--trace", pt->trace, "also write the simulated step as per-rank trace files (source = planner) "
                                        "into this directory, for `moetron trace analyze | diff`");
  tim->callback([tim, pt] {
    const JobConfig c = load(*pt, tim);
    const plan::Hardware h = plan::resolve_hardware(pt->hw);
    const plan::Layout l = plan::layout_from_config(c, pt->world, !pt->no_dist_opt);
    plan::TimeOptions o;
    o.memory = options(*pt, c);
    const plan::TimePlan t = plan::plan_time(c, l, h, o);
    if (pt->json) std::printf("%s\n", plan::to_json(t).dump(2).c_str());
    else std::printf("%s", plan::format_time(t).c_str());
    if (!pt->trace.empty()) {
      const plan::TraceExport x = plan::write_plan_trace(c, l, h, o, pt->trace);
      std::fprintf(pt->json ? stderr : stdout, "trace: %d files, %lld events, step %.6f s -> %s\n", x.files,
                   static_cast<long long>(x.events), x.step_time, pt->trace.c_str());
    }
  });

  auto ps = std::make_shared<PlanArgs>();
  auto* sea = plan->add_subcommand("search", "Search TP, CP, PP, VPP, schedule, EP, ZeRO, recompute and micro-batch");
  common(sea, *ps, true);
  sea->add_option("--top", ps->top_k, "candidates to print (default 5)");
  sea->add_option("--threads", ps->threads, "workers for the analytic pass (default: the machine's hardware threads)")
      ->check(CLI::Range(int64_t(1), int64_t(256)));
  sea->add_option("--min-replica", ps->min_replica, "only layouts whose replica (tp x cp x pp) has at least this many GPUs")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  sea->callback([sea, ps] {
    const JobConfig c = load(*ps, sea);
    const plan::Hardware h = plan::resolve_hardware(ps->hw);
    plan::SearchOptions o;
    o.time.memory = options(*ps, c);
    o.top_k = ps->top_k;
    o.threads = ps->threads;
    o.min_replica = ps->min_replica;
    const double gbt = ps->gbt > 0 ? ps->gbt : double(c.training.global_batch_size * c.training.seq_len);
    const plan::SearchResult r = plan::search(c, h, ps->world, gbt, o);
    if (ps->json) std::printf("%s\n", plan::to_json(r).dump(2).c_str());
    else std::printf("%s", plan::format_search(r).c_str());
  });

  auto pc = std::make_shared<PlanArgs>();
  auto* sca = plan->add_subcommand("scale", "Strong scaling at a fixed global batch: the best layout per world size");
  common(sca, *pc, false);
  sca->add_option("--worlds", pc->worlds, "comma-separated world sizes, e.g. 768,1024,2048")->required();
  sca->add_option("--threads", pc->threads, "workers for each search's analytic pass (default: the hardware threads)")
      ->check(CLI::Range(int64_t(1), int64_t(256)));
  sca->add_option("--min-replica", pc->min_replica,
                  "only replicas (tp x cp x pp) of at least this many GPUs, at every world (default 1: any)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  sca->callback([sca, pc] {
    const JobConfig c = load(*pc, sca);
    const plan::Hardware h = plan::resolve_hardware(pc->hw);
    plan::SearchOptions o;
    o.time.memory = options(*pc, c);
    o.threads = pc->threads;
    o.min_replica = pc->min_replica;
    const double gbt = pc->gbt > 0 ? pc->gbt : double(c.training.global_batch_size * c.training.seq_len);
    const auto s = plan::scale(c, h, parse_worlds(pc->worlds), gbt, o);
    if (pc->json) std::printf("%s\n", plan::to_json(s).dump(2).c_str());
    else std::printf("%s", plan::format_scale(s).c_str());
  });
  moetron::cli::add_plan_calibrate(plan);
  moetron::cli::add_plan_validate(plan);
});
