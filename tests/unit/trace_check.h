// trace_check.h: checks of a rank trace file (docs/profiling.md, "Trace format (version 1)") shared by the unit
// test (tests/unit/test_trace.cpp) and the MPI test (tests/mpi/test_mpi_trace.cpp): the nesting on each track.
#pragma once
#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace moetron::testing {

// step 4 > action 3 > module 2 > kernel 1; communication (0) may sit inside anything and holds nothing.
inline int trace_level(const std::string& cat) {
  if (cat == "step") return 4;
  if (cat == "action") return 3;
  if (cat == "module") return 2;
  if (cat == "kernel") return 1;
  return 0;
}

// "" when every track's complete events nest (each inside the previous still open one, or after it) with
// step ⊇ action ⊇ module ⊇ kernel, communication only at the leaves, and on track 0 every kernel, module and
// action inside a step; else the first problem. Times are printed to the nanosecond: 5 ns of slack.
inline std::string trace_nesting_problem(const nlohmann::json& trace) {
  struct Ev {
    double t0, t1;
    int level;
    std::string name;
  };
  std::map<std::pair<int, int>, std::vector<Ev>> tracks;
  for (const auto& e : trace["traceEvents"]) {
    if (e.value("ph", "") != "X") continue;
    const double ts = e.value("ts", 0.0);
    tracks[{e.value("pid", 0), e.value("tid", 0)}].push_back(
        {ts, ts + e.value("dur", 0.0), trace_level(e.value("cat", "")), e.value("name", "")});
  }
  const double eps = 0.005;
  for (auto& [key, v] : tracks) {
    std::sort(v.begin(), v.end(), [](const Ev& a, const Ev& b) {
      if (a.t0 != b.t0) return a.t0 < b.t0;
      if (a.t1 != b.t1) return a.t1 > b.t1;
      return a.level > b.level;
    });
    std::vector<const Ev*> open;
    const std::string where = "pid " + std::to_string(key.first) + " tid " + std::to_string(key.second) + ": ";
    for (const Ev& e : v) {
      while (!open.empty() && open.back()->t1 <= e.t0 + eps) open.pop_back();
      if (!open.empty()) {
        const Ev& p = *open.back();
        if (e.t1 > p.t1 + eps)
          return where + e.name + " [" + std::to_string(e.t0) + ", " + std::to_string(e.t1) + "] overlaps " + p.name +
                 " [" + std::to_string(p.t0) + ", " + std::to_string(p.t1) + "] without nesting";
        if (p.level == 0 || (e.level > 0 && e.level >= p.level))
          return where + e.name + " (level " + std::to_string(e.level) + ") inside " + p.name + " (level " +
                 std::to_string(p.level) + ")";
      } else if (key.second == 0 && e.level >= 1 && e.level <= 3) {
        return where + e.name + " at " + std::to_string(e.t0) + " is outside every step";
      }
      open.push_back(&e);
    }
  }
  return "";
}

}  // namespace moetron::testing
