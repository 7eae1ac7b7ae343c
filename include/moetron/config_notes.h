// config_notes.h: the settings of a job that have no effect in a given run. A key set away from its default
// that another key or the run's layout makes moot (a checkpoint interval with checkpoints off, a sequence-
// parallel switch without tensor parallelism, the planner's [hardware] section in a training run) is not an
// error, but it must not pass in silence: the trainer prints one note per such key at start-up. Not the
// validation (config_validate.cpp refuses what cannot run) and not the engine's refusals of planned-only keys.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "moetron/config.h"

namespace moetron {

// The keys whose value differs from a default-constructed JobConfig's, "section.key" -> the value as TOML text
// (config.cpp, beside the field table).
std::map<std::string, std::string> non_default_settings(const JobConfig& c);

// What the run is: its process count and data-parallel size (from the mesh), and whether `--profile` asked for
// the per-op breakdown (which reads the profiling window without writing traces).
struct RunShape {
  int world = 1;
  int dp = 1;
  bool profile_flag = false;
};

struct InertSetting {
  std::string key;    // "section.key"
  std::string value;  // as TOML text
  std::string why;    // what makes it moot
};

// The engine's view: every non-default key that changes nothing in a training run of this shape.
std::vector<InertSetting> inert_settings(const JobConfig& c, const RunShape& run);
// "note: <key> = <value> has no effect: <why>"
std::string format_note(const InertSetting& s);

}  // namespace moetron
