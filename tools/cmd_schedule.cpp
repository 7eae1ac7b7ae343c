// cmd_schedule.cpp: `moetron schedule show`: a pipeline schedule's action lists, the validator's verdict and
// the simulators' figures (steps, step time, bubble ratio and peak in-flight micro-batches per rank), as
// text, CSV or JSON. Not the schedule logic (src/schedule/) and not the picture (`moetron viz pipeline`).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "schedule_flags.h"
#include "schedule_compare.h"

namespace {
using namespace moetron;

struct ShowArgs {
  cli::ScheduleFlags flags;
  std::string format = "text";
};

nlohmann::json to_json(const sched::Schedule& compute, const sched::Schedule& lowered,
                       const sched::TimedResult& t) {
  nlohmann::json j;
  j["schedule"] = compute.name;
  j["pp"] = compute.pp;
  j["stages"] = compute.n_stages;
  j["vpp"] = compute.stages_per_rank();
  j["microbatches"] = compute.n_microbatches;
  j["valid"] = true;
  j["deadlock"] = false;  // the validator (schedule_from_flags) refuses a schedule that deadlocks
  j["steps"] = t.steps;
  j["step_time"] = t.step_time;
  j["bubble_ratio"] = t.bubble_ratio;
  j["bubble_formula"] = sched::bubble_formula(compute.pp, compute.n_microbatches, compute.stages_per_rank());
  j["ranks"] = nlohmann::json::array();
  for (const auto& r : t.ranks) {
    nlohmann::json a = nlohmann::json::array(), la = nlohmann::json::array();
    for (const auto& x : compute.actions[size_t(r.rank)]) a.push_back(sched::to_string(x));
    for (const auto& x : lowered.actions[size_t(r.rank)]) la.push_back(sched::to_string(x));
    j["ranks"].push_back({{"rank", r.rank},
                          {"bubble_ratio", r.bubble_ratio},
                          {"busy", r.busy},
                          {"peak_inflight", r.peak_inflight},
                          {"peak_inflight_microbatches", r.peak_inflight_microbatches},
                          {"actions", a},
                          {"lowered", la}});
  }
  return j;
}

void show(const ShowArgs& a) {
  const sched::Schedule lowered = cli::schedule_from_flags(a.flags);
  // The compute-only view of the same schedule: the lowered lists without their communication actions.
  sched::Schedule compute = lowered;
  for (auto& row : compute.actions) std::erase_if(row, [](const sched::Action& x) { return sched::is_comm(x.op); });
  compute.lowered = false;
  const sched::TimedResult t =
      sched::simulate_timed(lowered, cli::parse_durations(a.flags.durations, lowered.n_stages));

  if (a.format == "csv") {
    std::fputs(sched::to_csv(lowered).c_str(), stdout);
    return;
  }
  if (a.format == "json") {
    std::printf("%s\n", to_json(compute, lowered, t).dump(1).c_str());
    return;
  }
  std::printf("schedule %s: pp %d, %d stages (%d per rank), %d micro-batches\n", compute.name.c_str(), compute.pp,
              compute.n_stages, compute.stages_per_rank(), compute.n_microbatches);
  std::fputs(sched::to_text(compute).c_str(), stdout);
  std::printf("lowered (with point-to-point communication):\n");
  std::fputs(sched::to_text(lowered).c_str(), stdout);
  std::printf("validator: ok; lock-step: %d steps, no deadlock\n", t.steps);
  std::printf("timed: step %.4g, bubble %.2f%% (formula (p-1)/(p-1+m*v): %.2f%%)\n", t.step_time,
              100 * t.bubble_ratio,
              100 * sched::bubble_formula(compute.pp, compute.n_microbatches, compute.stages_per_rank()));
  for (const auto& r : t.ranks)
    std::printf("  rank %d: busy %.4g, bubble %.2f%%, peak in-flight %d activation sets (%.3g micro-batches)\n",
                r.rank, r.busy, 100 * r.bubble_ratio, r.peak_inflight, r.peak_inflight_microbatches);
}
}  // namespace

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* sc = root.add_subcommand("schedule", "Pipeline schedules: generate, validate and simulate");
  sc->require_subcommand(1);
  auto args = std::make_shared<ShowArgs>();
  auto* c = sc->add_subcommand("show", "Print a schedule's actions, the validator's verdict and simulated figures");
  cli::add_schedule_flags(c, args->flags);
  c->add_option("--format", args->format, "text, csv (the lowered schedule) or json")
      ->check(CLI::IsMember({"text", "csv", "json"}));
  c->callback([args] { show(*args); });
  moetron::cli::add_compare_command(sc);
});
