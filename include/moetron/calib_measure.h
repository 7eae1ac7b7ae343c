// calib_measure.h: the engine's side of `moetron plan calibrate`: one round of timings of the engine's own kernels
// and Comm on this machine (every rank at once), handed back as plain figures (calib_round.h), and the helpers
// measuring runs share (figures reduced over ranks, the share of the cores a process received). Not the fit:
// turning rounds into planner hardware is the planner's (plan/calibrate.h), which links no engine.
#pragma once
#include <time.h>

#include "moetron/calib_round.h"
#include "moetron/comm.h"

namespace moetron::calib {

// The largest / smallest of every rank's x (a collective over w).
double max_over_ranks(const Comm& w, double x);
double min_over_ranks(const Comm& w, double x);

// The share of the cores this process received since construction, while it wanted them: the time its threads
// ran over the time they ran plus the time they sat runnable in a run queue (Linux's /proc/self/task/*/schedstat).
// 1 = it never waited for a core; other processes on the machine lower it. Time a thread sleeps (MPI waits sleep
// between tests, a pipeline bubble, a barrier) counts in neither, so a rank's own waiting does not lower it.
// Without schedstat: CPU time over wall time x threads (which a sleeping wait does lower).
class CpuShare {
 public:
  explicit CpuShare(int threads);
  double share() const;

 private:
  struct Sched {
    double run_ns = 0, wait_ns = 0;
    bool ok = false;
  };
  static Sched schedstat();  // summed over this process's threads
  static double now(clockid_t c);
  int threads_;
  double wall0_, cpu0_;
  Sched sched0_;
};

// One pass over every figure on every rank of w at once, each op the engine's kernel measured in isolation in the
// compute dtype, in its own window of 0.25 s or more (--quick: 0.1 s, fewer repetitions and sizes). Sets the
// engine's thread count first (the cores over the ranks sharing this machine, unless
// OMP_NUM_THREADS says otherwise). With two ranks or more, also point-to-point messages and collectives.
Round measure_round(const Comm& w, bool quick);

}  // namespace moetron::calib
