// schedule_compare.h: `moetron schedule compare --run DIR`: the measured bubble of a profiled pipeline run
// (DIR/pipeline_record.json, include/moetron/pipeline_record.h) per rank beside the timed simulator's, fed the
// op durations measured in the same run. A table, or --json. Not the measurement (the trainer writes the
// record) and not the simulator.
#pragma once
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli.h"
#include "moetron/pipeline_record.h"

namespace moetron::cli {

// DIR/pipeline_record.json, or DIR itself when it names the file.
inline std::string record_path(const std::string& dir) {
  namespace fs = std::filesystem;
  return fs::is_directory(dir) ? (fs::path(dir) / "pipeline_record.json").string() : dir;
}

inline void add_compare_command(CLI::App* sc) {
  struct Args {
    std::string run;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  auto* c = sc->add_subcommand("compare", "Measured bubble per rank of a profiled pipeline run against the timed "
                                          "simulator fed the run's own op durations");
  c->add_option("--run", a->run, "Run folder (its pipeline_record.json) or the record file")->required();
  c->add_flag("--json", a->json, "JSON: {schedule, pp, steps, ranks: [{rank, measured, simulated, diff}], "
                                 "total: {measured, simulated}, durations: [{stage, f, i, w}]}");
  c->callback([a] {
    const sched::PipelineRecord r = sched::read_record(record_path(a->run));
    const sched::BubbleComparison cmp = sched::compare_bubbles(r);
    if (a->json) {
      nlohmann::json j{{"schedule", r.schedule_name}, {"pp", r.lowered.pp}, {"steps", r.steps.size()}};
      for (int q = 0; q < r.lowered.pp; ++q)
        j["ranks"].push_back({{"rank", q}, {"measured", cmp.measured[size_t(q)]}, {"simulated", cmp.simulated[size_t(q)]},
                              {"diff", cmp.measured[size_t(q)] - cmp.simulated[size_t(q)]}});
      j["total"] = {{"measured", cmp.measured_total}, {"simulated", cmp.simulated_total}};
      for (size_t s = 0; s < cmp.durations.stage.size(); ++s) {
        const auto& st = cmp.durations.stage[s];
        j["durations"].push_back({{"stage", s}, {"f", st.f}, {"i", st.i}, {"w", st.w}});
      }
      std::printf("%s\n", j.dump(1).c_str());
      return;
    }
    std::printf("%s: pp %d, %d stages, %d micro-batches, %zu recorded steps; simulator fed the measured mean F / "
                "B (or I) / W per stage, P2P 0\n",
                r.schedule_name.c_str(), r.lowered.pp, r.lowered.n_stages, r.lowered.n_microbatches, r.steps.size());
    std::printf("%-6s %10s %10s %10s\n", "rank", "measured", "simulated", "diff");
    for (int q = 0; q < r.lowered.pp; ++q)
      std::printf("%-6d %9.2f%% %9.2f%% %+9.2f\n", q, 100 * cmp.measured[size_t(q)], 100 * cmp.simulated[size_t(q)],
                  100 * (cmp.measured[size_t(q)] - cmp.simulated[size_t(q)]));
    std::printf("%-6s %9.2f%% %9.2f%% %+9.2f   (points, absolute)\n", "all", 100 * cmp.measured_total,
                100 * cmp.simulated_total, 100 * (cmp.measured_total - cmp.simulated_total));
  });
}

}  // namespace moetron::cli
