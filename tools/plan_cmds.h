// plan_cmds.h: the `moetron plan` subcommands that need the engine (calibrate measures this machine's kernels
// and MPI; validate runs the engine), added to the `plan` command by tools/cmd_plan.cpp.
#pragma once
#include <CLI/CLI.hpp>
#include <time.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/plan/hardware.h"

namespace moetron::cli {
// The largest of every rank's x (a collective over w).
inline double max_over_ranks(const Comm& w, double x) {
  std::vector<double> all(static_cast<size_t>(w.size()));
  w.all_gather(all.data(), &x, sizeof(double));
  return *std::max_element(all.begin(), all.end());
}

// The smallest of every rank's x (a collective over w).
inline double min_over_ranks(const Comm& w, double x) { return -max_over_ranks(w, -x); }

// The share of the cores this process received since construction, while it wanted them: the time its threads
// ran over the time they ran plus the time they sat runnable in a run queue (Linux's /proc/self/task/*/schedstat).
// 1 = it never waited for a core; other processes on the machine lower it. Time a thread sleeps (MPI waits sleep
// between tests, a pipeline bubble, a barrier) counts in neither, so a rank's own waiting does not lower it.
// Without schedstat: CPU time over wall time x threads (which a sleeping wait does lower).
class CpuShare {
 public:
  explicit CpuShare(int threads)
      : threads_(std::max(1, threads)), wall0_(now(CLOCK_MONOTONIC)), cpu0_(now(CLOCK_PROCESS_CPUTIME_ID)),
        sched0_(schedstat()) {}
  double share() const {
    const Sched s = schedstat();
    if (s.ok && sched0_.ok) {
      const double run = s.run_ns - sched0_.run_ns, wait = s.wait_ns - sched0_.wait_ns;
      if (run > 0 && wait >= 0) return run / (run + wait);
    }
    const double wall = now(CLOCK_MONOTONIC) - wall0_;
    return wall > 0 ? (now(CLOCK_PROCESS_CPUTIME_ID) - cpu0_) / (wall * threads_) : 1.0;
  }

 private:
  struct Sched {
    double run_ns = 0, wait_ns = 0;
    bool ok = false;
  };
  static Sched schedstat() {  // summed over this process's threads
    Sched r;
    std::error_code ec;
    for (const auto& t : std::filesystem::directory_iterator("/proc/self/task", ec)) {
      std::ifstream in(t.path() / "schedstat");
      double run = 0, wait = 0;
      if (in >> run >> wait) r.run_ns += run, r.wait_ns += wait, r.ok = true;
    }
    return r;
  }
  static double now(clockid_t c) {
    timespec t{};
    clock_gettime(c, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  }
  int threads_;
  double wall0_, cpu0_;
  Sched sched0_;
};

void add_plan_calibrate(CLI::App* plan);
void add_plan_validate(CLI::App* plan);
// This machine measured as planner hardware (every rank of `w` at once), `rounds` passes over every figure with
// the median kept; check_out receives a comment header with the measurement's provenance and the collectives
// timed against the model.
plan::Hardware calibrate_machine(const Comm& w, bool quick, std::string* check_out, int rounds);
}  // namespace moetron::cli
