// schedule_flags.h: the command-line flags that name a pipeline schedule (--pp --vpp --microbatches
// --schedule --group-size --csv --durations), shared by `moetron schedule show` and `moetron viz pipeline`,
// and the one function that turns them into a validated, lowered schedule and its durations.
// Not the schedule logic itself (src/schedule/).
#pragma once
#include <CLI/CLI.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/schedule.h"

namespace moetron::cli {

struct ScheduleFlags {
  int pp = 4;
  int vpp = 0;  // 0 = the schedule's own default (1, or 2 for interleaved and V shapes)
  int microbatches = 8;
  int group_size = 0;
  bool ep_overlap = false;
  std::string schedule = "1f1b";
  std::string csv;        // a user's schedule instead of a generator
  std::string durations;  // "F,B,W,P2P[,A2A]"; empty = 1,2,1,0
};

inline void add_schedule_flags(CLI::App* c, ScheduleFlags& f) {
  c->add_option("--pp", f.pp, "Pipeline ranks")->check(CLI::Range(1, 4096));
  c->add_option("--vpp", f.vpp, "Stages per rank (interleaved: >= 2; V shapes: 2; 0 = the schedule's default)")
      ->check(CLI::Range(0, 1024));
  c->add_option("--microbatches", f.microbatches, "Micro-batches per step")->check(CLI::Range(1, 1 << 20));
  c->add_option("--schedule", f.schedule, "gpipe, 1f1b, interleaved_1f1b, zb1p, zbv or dualpipev");
  c->add_option("--group-size", f.group_size, "interleaved_1f1b: micro-batch group size per virtual stage (0 = pp)")
      ->check(CLI::Range(0, 1 << 20));
  c->add_flag("--ep-overlap", f.ep_overlap,
              "interleaved_1f1b: one more warm-up forward and the steady-state F/B pairs fused into FB actions (the "
              "1F1B all-to-all overlap; an FB costs max(f + b, a2a_f + a2a_b) in the timed replay)");
  c->add_option("--csv", f.csv, "Read the schedule from this CSV (one row of actions per rank) instead");
  c->add_option("--durations", f.durations,
                "Per-op times F,B,W,P2P[,A2A] (B is the full backward = I + W; A2A is paid by each F and B)");
}

// Durations from "F,B,W,P2P[,A2A]"; every stage gets the same costs.
inline sched::Durations parse_durations(const std::string& text, int n_stages) {
  std::vector<double> v;
  std::stringstream ss(text.empty() ? std::string("1,2,1,0") : text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      v.push_back(std::stod(item, &used));
      MT_CHECK(used == item.size(), "schedule", "--durations '", text, "': '", item, "' is not a number");
    } catch (const std::logic_error&) {
      MT_FAIL("schedule", "--durations '", text, "': '", item, "' is not a number");
    }
  }
  MT_CHECK(v.size() == 4 || v.size() == 5, "schedule", "--durations '", text,
           "': expected F,B,W,P2P or F,B,W,P2P,A2A (got ", v.size(), " values)");
  for (double x : v) MT_CHECK(x >= 0, "schedule", "--durations '", text, "': times must be >= 0");
  MT_CHECK(v[2] <= v[1], "schedule", "--durations '", text, "': W (", v[2], ") cannot exceed B (", v[1],
           "), the full backward that contains it");
  sched::Durations d = sched::Durations::uniform(n_stages, v[0], v[1], v[2], v[3]);
  if (v.size() == 5)
    for (auto& c : d.stage) c.a2a_f = c.a2a_b = v[4];
  return d;
}

// The schedule the flags name: generated (or read from --csv), validated, then lowered.
inline sched::Schedule schedule_from_flags(const ScheduleFlags& f) {
  sched::Schedule s;
  if (!f.csv.empty()) {
    s = sched::read_csv_file(f.csv);
  } else {
    sched::GenSpec g;
    g.schedule = f.schedule;
    g.pp = f.pp;
    g.vpp = f.vpp != 0 ? f.vpp : (f.schedule == "interleaved_1f1b" || sched::is_v_shape(f.schedule) ? 2 : 1);
    g.microbatches = f.microbatches;
    g.group_size = f.group_size;
    g.ep_overlap = f.ep_overlap;
    s = sched::generate(g);
  }
  sched::check_valid(s);
  return s.lowered ? s : sched::lower(s);
}

}  // namespace moetron::cli
