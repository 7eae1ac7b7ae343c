// ep_exposure.cpp: the interval arithmetic and the shared recorder of ep_exposure.h.
#include "model/ep_exposure.h"

#include <algorithm>
#include <chrono>

namespace moetron {

namespace {
// Sorted, disjoint spans covering the same time as v (empty ones dropped).
std::vector<TimeSpan> merged(std::vector<TimeSpan> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](const TimeSpan& s) { return !(s.t1 > s.t0); }), v.end());
  std::sort(v.begin(), v.end(), [](const TimeSpan& a, const TimeSpan& b) { return a.t0 < b.t0; });
  std::vector<TimeSpan> out;
  for (const TimeSpan& s : v) {
    if (!out.empty() && s.t0 <= out.back().t1) out.back().t1 = std::max(out.back().t1, s.t1);
    else out.push_back(s);
  }
  return out;
}
double length(const std::vector<TimeSpan>& v) {
  double t = 0;
  for (const TimeSpan& s : v) t += s.t1 - s.t0;
  return t;
}
}  // namespace

double exposed_seconds(std::vector<TimeSpan> waits, std::vector<TimeSpan> busy) {
  const std::vector<TimeSpan> w = merged(std::move(waits)), b = merged(std::move(busy));
  double covered = 0;  // |w ∩ b|: both are sorted and disjoint, so one sweep
  size_t j = 0;
  for (const TimeSpan& s : w) {
    while (j < b.size() && b[j].t1 <= s.t0) ++j;
    for (size_t k = j; k < b.size() && b[k].t0 < s.t1; ++k)
      covered += std::min(s.t1, b[k].t1) - std::max(s.t0, b[k].t0);
  }
  return length(w) - covered;
}

double EpExposure::now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
void EpExposure::wait(double t0, double t1) {
  std::lock_guard<std::mutex> lk(mu_);
  waits_.push_back({t0, t1});
}
void EpExposure::busy(double t0, double t1) {
  std::lock_guard<std::mutex> lk(mu_);
  busy_.push_back({t0, t1});
}
void EpExposure::fold_locked(bool paired) {
  if (waits_.empty()) {
    busy_.clear();
    return;
  }
  wait_ += length(merged(waits_));
  const double x = exposed_seconds(std::move(waits_), std::move(busy_));
  exposed_ += x;
  if (paired) exposed_paired_ += x;
  waits_.clear(), busy_.clear();
}
void EpExposure::fold(bool paired) {
  std::lock_guard<std::mutex> lk(mu_);
  fold_locked(paired);
}
double EpExposure::exposed_paired_total() {
  std::lock_guard<std::mutex> lk(mu_);
  fold_locked();
  return exposed_paired_;
}
double EpExposure::exposed_total() {
  std::lock_guard<std::mutex> lk(mu_);
  fold_locked();
  return exposed_;
}
double EpExposure::wait_total() {
  std::lock_guard<std::mutex> lk(mu_);
  fold_locked();
  return wait_;
}

}  // namespace moetron
