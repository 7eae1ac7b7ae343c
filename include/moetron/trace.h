// trace.h: named timing scopes. When enabled, every MT_TRACE scope on the calling (main) thread records
// a complete event (name, start, duration); totals per name feed the trainer's per-op breakdown, and
// the events can be written as Chrome trace JSON (one process per rank), loadable in Perfetto.
// Disabled (the default), a scope costs one predictable branch. Not thread-safe by design: scopes are
// placed around whole kernel calls on the thread that drives the step, never inside parallel regions.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moetron::trace {

void enable(bool on);
bool enabled();
void reset();  // drop events and totals

struct OpTotal {
  std::string name;
  double seconds = 0;
  int64_t count = 0;
};
std::vector<OpTotal> totals();  // sorted by time, descending

// Chrome trace "X" events; pid = rank, tid = 0.
void write_chrome_trace(const std::string& path, int rank = 0);

class Scope {
 public:
  explicit Scope(const char* name) : name_(name), t0_(enabled() ? now_us() : -1) {}
  ~Scope() { stop(); }
  void stop() {  // end the scope early (records once)
    if (t0_ >= 0) record(name_, t0_, now_us());
    t0_ = -1;
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  static double now_us();
  static void record(const char* name, double t0, double t1);
  const char* name_;
  double t0_;
};

}  // namespace moetron::trace

#define MT_TRACE_CAT2(a, b) a##b
#define MT_TRACE_CAT(a, b) MT_TRACE_CAT2(a, b)
// MT_TRACE("moe.grouped_gemm"): times the rest of the enclosing block. The name must be a literal.
#define MT_TRACE(name) ::moetron::trace::Scope MT_TRACE_CAT(mt_trace_scope_, __LINE__)(name)
