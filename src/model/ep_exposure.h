// ep_exposure.h: the exposed EP time of a rank, measured. Each model lane records the wall intervals it waits
// inside an EP exchange (dispatch / combine and the backward's exchanges, the blocking call) and the intervals
// it computes (holds the compute turn). The exposed time is the part of the union of the waits that no lane's
// compute covers: with the all-to-all overlap, a wait while the other lane computes is hidden; without it,
// every wait is exposed. A few timestamps per exchange; folded into a running total at points where no lane
// is inside an interval (the end of an overlapped pair, a metrics line).
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
  void fold();
  double exposed_total();  // folds first
  double wait_total();     // folds first

 private:
  void fold_locked();
  std::mutex mu_;
  std::vector<TimeSpan> waits_, busy_;
  double exposed_ = 0, wait_ = 0;
};

}  // namespace moetron
