// cmd_plan_validate.cpp: `moetron plan validate [--hw FILE]`: runs the engine here on a set of small layouts (DP,
// ZeRO-1, FSDP, EP with each dispatcher, PP with two schedules, recompute) and hands what it measured (peak bytes
// per memory category on every rank, step time, the trace scopes) to the planner's comparison with its projection
// of the same job on this machine's hardware (a calibrated TOML, or a quick calibration first): plan/validate.h
// holds the layouts, the projection, the errors, the bounds and the report. Here: the flags, the engine's runs,
// and their figures reduced over ranks. Run it under mpirun (4 ranks covers every layout; fewer ranks skip what
// does not fit). Not a test by itself: tests/CMakeLists.txt holds it to its tolerances.
#include <algorithm>
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
#include "moetron/plan/calibrate.h"
#include "moetron/plan/published.h"
#include "moetron/plan/validate.h"
#include "moetron/runtime.h"
#include "moetron/trainer.h"
#include "plan_cmds.h"

namespace moetron::cli {
namespace {

struct Args {
  std::string config, hw, only;
  std::string published, presets = "configs";  // --published FILE: project published runs, no engine
  int64_t steps = 6;
  int rounds = 3;
  int repeats = 1;
  bool json = false, quick = false, ops = false;
  plan::ValidationBounds bounds{0, 0.10, 0};
  std::string ep_imbalance = "measured";
};

// A picked layout with its config and its runs: per run the engine's result, the CPU share and the step time.
struct Picked {
  plan::ValidationCase cs;
  JobConfig c;
  std::vector<TrainResult> runs;
  std::vector<double> shares, steps;
};

std::vector<double> step_seconds(const TrainResult& r) {
  std::vector<double> s;
  for (const auto& h : r.history) s.push_back(h.seconds);
  return s;
}

// The layouts --only picks that fit the world, each with its config.
std::vector<Picked> pick_layouts(const Args& a, int world) {
  const std::string cfg_path = a.config.empty() ? "configs/ds_mini.toml" : a.config;
  const std::string compute = resolve_compute_dtype(ComputeDtype::Auto) == ComputeDtype::BF16 ? "bf16" : "fp32";
  const std::string dump = (std::filesystem::temp_directory_path() / "moetron_plan_validate").string();
  std::vector<Picked> todo;
  for (const plan::ValidationCase& cs : plan::validation_cases()) {
    if (world < cs.min_world || !plan::case_picked(cs.name, a.only)) continue;
    todo.push_back(Picked{cs, load_config(cfg_path, plan::case_overrides(cs, world, a.steps, dump, compute)), {}, {}, {}});
  }
  return todo;
}

// One engine run of a layout, profiled: the one-process layout runs on every rank at once, each alone (the same
// share of the cores as the others). Its CPU share (the smallest over ranks) and step time (the slowest rank's).
void run_once(const Comm& w, Picked& pk) {
  const Comm self = w.split(w.rank(), 0);
  TrainOptions to;
  to.quiet = true;
  to.profile = true;  // the per-op breakdown (trace scopes: a branch and a clock read each)
  to.comm = pk.c.parallelism.world_size() == 1 ? &self : &w;
  const CpuShare cpu_share(num_threads());
  pk.runs.push_back(train(pk.c, to));
  pk.shares.push_back(min_over_ranks(w, cpu_share.share()));
  pk.steps.push_back(max_over_ranks(w, plan::run_step_time(step_seconds(pk.runs.back()))));
}

// The run with the median step time (the same on every rank: the step times are reduced over ranks), its figures
// reduced over ranks, its op groups those of the rank that computes the most.
plan::MeasuredRun measured(const Comm& w, const Picked& pk) {
  const size_t pick = plan::median_run(pk.steps);
  const TrainResult& r = pk.runs[pick];
  plan::MeasuredRun m;
  m.params = max_over_ranks(w, double(r.params_peak_bytes));
  m.grads = max_over_ranks(w, double(r.grads_peak_bytes));
  m.optimizer = max_over_ranks(w, double(r.optimizer_peak_bytes));
  m.activations = max_over_ranks(w, double(r.act_peak_bytes));
  m.step_s = pk.steps[pick];
  m.cpu_share = pk.shares[pick];
  m.ep_rows_peak = max_over_ranks(w, r.ep_rows_peak_ratio);
  m.ep_rows_held = max_over_ranks(w, r.ep_rows_held_ratio);
  const plan::OpTimes me = plan::measured_ops(r.op_seconds, step_seconds(r), r.recompute_seconds);
  static_assert(std::is_trivially_copyable_v<plan::OpTimes>);
  std::vector<plan::OpTimes> all(static_cast<size_t>(w.size()));
  w.all_gather(all.data(), &me, sizeof(plan::OpTimes));
  m.ops = plan::busiest(all);
  m.step_runs = pk.steps;
  return m;
}

void run_validate(const Args& a) {
  const Comm w = comm_world();
  const bool root = w.rank() == 0;
  std::string header;
  if (root && !a.json) std::printf("%s", plan::validation_header().c_str());
  std::vector<Picked> todo = pick_layouts(a, w.size());
  // Repeat after repeat over all the layouts, so that a slow spell of the host falls on different layouts' runs.
  // Without --hw the calibration's rounds are spread over the same span: before repeat k its share of
  // max(rounds, repeats) rounds, every figure the median over all of them (the host's speed moves over minutes;
  // a calibration taken before the runs alone measures another moment: docs/planner.md).
  const int total = std::max(a.rounds, a.repeats);
  std::vector<calib::Round> rounds;
  for (int rep = 0; rep < a.repeats; ++rep) {
    if (a.hw.empty())
      for (int i = rep * total / a.repeats; i < (rep + 1) * total / a.repeats; ++i)
        rounds.push_back(calib::measure_round(w, a.quick));
    for (Picked& pk : todo) run_once(w, pk);
  }
  const plan::Hardware h =
      a.hw.empty() ? plan::calibrated_hardware(rounds, &header) : plan::resolve_hardware(a.hw);
  std::vector<plan::LayoutValidation> done;
  std::vector<std::string> over;  // figures beyond their bound
  for (const Picked& pk : todo) {
    done.push_back(plan::validate_layout(pk.c, pk.cs.name, w.size(), h, measured(w, pk), a.bounds, a.ep_imbalance));
    for (const std::string& o : plan::beyond_bounds(done.back())) over.push_back(o);
    if (root && !a.json) std::printf("%s", plan::format_validation(done.back(), a.ops).c_str());
  }
  if (root && !a.json && !header.empty()) std::printf("calibration (spread over the repeats):\n%s", header.c_str());
  if (root && !over.empty()) {
    for (const auto& o : over) std::fprintf(stderr, "plan validate: beyond its bound: %s\n", o.c_str());
  }
  MT_CHECK(over.empty(), "plan validate", over.size(), " figure(s) beyond their bound (listed above)");
  if (root && a.json) std::printf("%s\n", plan::validation_json(w.size(), h, header, done).dump(2).c_str());
}

// --published FILE: every row projected with plan time's path (plan/published.h); no engine, no MPI.
void run_published(const Args& a) {
  const std::vector<plan::PublishedRow> rows = plan::read_published(a.published);
  std::vector<plan::PublishedResult> rs;
  for (const auto& r : rows) rs.push_back(plan::project_row(r, a.presets));
  const std::vector<plan::SplitSummary> ss = {plan::summarize(rs, "calibration"), plan::summarize(rs, "validation")};
  if (a.json) std::printf("%s\n", plan::published_json(rs, ss).dump(2).c_str());
  else std::printf("%s", plan::format_published(rs, ss).c_str());
}

}  // namespace

void add_plan_validate(CLI::App* plan) {
  auto* val = plan->add_subcommand(
      "validate", "Run the engine on small layouts and compare measured memory and step time with the projection");
  auto a = std::make_shared<Args>();
  val->add_option("--config", a->config, "the job (default configs/ds_mini.toml)");
  auto* hw = val->add_option("--hw", a->hw,
                             "this machine's hardware TOML (default: calibrate here, the rounds spread over the "
                             "repeats: before each repeat of the layouts its share of them)");
  val->add_option("--steps", a->steps, "training steps per layout (default 6; the first is not timed)");
  val->add_option("--rounds", a->rounds,
                  "calibration rounds when --hw is not given (default 3, at least one before each repeat; see plan "
                  "calibrate)")
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
  val->add_option("--max-memory-error", a->bounds.memory,
                  "fail when a memory figure's |error| exceeds this fraction (0 = report only); EP activations "
                  "use --max-ep-activation-error");
  val->add_option("--max-ep-activation-error", a->bounds.ep_activations,
                  "the bound for EP layouts' activations (projected with the measured routing imbalance; the engine's "
                  "buffers also keep the slack of their growth history; default 0.10)");
  val->add_option("--max-time-error", a->bounds.step_time,
                  "fail when a step time's |error| exceeds this (0 = report only)");
  auto* pub = val->add_option("--published", a->published,
                               "project the published runs of this CSV (tests/data/published_moe_runs.csv) with "
                               "plan time and compare with their throughput; runs no engine");
  pub->excludes(hw)->excludes("--config")->excludes("--rounds")->excludes("--quick");
  val->add_option("--presets", a->presets, "--published: the folder of the model presets (default configs)");
  val->callback([a] {
    if (!a->published.empty()) run_published(*a);
    else run_validate(*a);
  });
}
}  // namespace moetron::cli
