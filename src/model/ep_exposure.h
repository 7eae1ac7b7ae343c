// ep_exposure.h: the exposed EP time of a rank, measured. Each model lane records the wall intervals it waits
// inside an EP exchange (dispatch / combine and the backward's exchanges, the blocking call) and the intervals
// it computes (holds the compute turn). The exposed time is the part of the union of the waits that no lane's
// compute covers: with the all-to-all overlap, a wait while the other lane computes is hidden; without it,
// every wait is exposed. A few timestamps per exchange; folded into a running total at points where no lane
// is inside an interval (the start and end of an overlapped pair, a metrics line). What a pair's fold adds is
// also kept apart (exposed_paired): the rest is the exposure of actions that ran alone (unpaired warm-up and
// cool-down chunks, plain runs).
// Not the exchange itself (ep_dispatch.h) or the compute turn (Model::Impl::Baton).
#pragma once

#include <mutex>
#include <vector>

namespace moetron {

struct TimeSpan {
  double t0 = 0, t1 = 0;  // seconds on one clock, t0 <= t1
};

// The length of (union of waits) minus (union of busy). Spans in any order, may overlap; empty or reversed
// spans count nothing.
double exposed_seconds(std::vector<TimeSpan> waits, std::vector<TimeSpan> busy);

// Shared by a model's lanes (threads): the recorded spans and the running totals.
class EpExposure {
 public:
  static double now();  // seconds on the steady clock
  void wait(double t0, double t1);
  void busy(double t0, double t1);
  // Folds the recorded spans into the totals and drops them. Call only when no lane is inside a span that
  // could overlap a recorded one (no exchange or compute turn in flight on another thread).
  // paired: the spans are one overlapped pair's (the end of a pair).
  void fold(bool paired = false);
  double exposed_total();         // folds first
  double exposed_paired_total();  // of which inside overlapped pairs; folds first
  double wait_total();            // folds first

 private:
  void fold_locked(bool paired = false);
  std::mutex mu_;
  std::vector<TimeSpan> waits_, busy_;
  double exposed_ = 0, exposed_paired_ = 0, wait_ = 0;
};

}  // namespace moetron
