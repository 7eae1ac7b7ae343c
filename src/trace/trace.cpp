// trace.cpp: the event recorder behind MT_TRACE and the other scopes of trace.h: the on/off switch, the
// per-thread track and cost accumulator, kernel / module / action / step / memory events, and the per-kernel
// totals of the --profile breakdown. Not the communication events (trace_comm.cpp) or the file (trace_write.cpp).
#include "moetron/trace.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <unordered_map>

#include "trace/recorder.h"

namespace moetron::trace {

namespace detail {
std::atomic<bool> g_on{false};
thread_local int t_track = 0;

Store& store() {
  static Store s;
  return s;
}

Event* Store::push(const Event& e) {
  if (int64_t(events.size()) >= max_events) {
    ++dropped;
    return nullptr;
  }
  events.push_back(e);
  if (e.tid < 8) tid_used[e.tid] = true;
  return &events.back();
}
}  // namespace detail

using detail::Cat;
using detail::Event;
using detail::store;

namespace {
// The running figures of the calling thread's innermost open kernel scope.
struct ThreadState {
  int depth = 0;  // open kernel scopes
  double flops = 0, bytes = 0;
};
thread_local ThreadState t_state;

std::unordered_map<std::string, OpTotal>& op_totals() {  // under store().mu
  static std::unordered_map<std::string, OpTotal> t;
  return t;
}
}  // namespace

void enable(bool on) { detail::g_on.store(on); }

void reset() {
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  s.events.clear();
  s.side.clear();
  s.dropped = 0;
  s.groups.clear();
  s.group_of.clear();
  s.first_step = s.last_step = -1;
  op_totals().clear();
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void set_thread_track(int tid) { detail::t_track = tid; }

void add_cost(double flops, double bytes) {
  ThreadState& t = t_state;
  if (t.depth == 0 || omp_in_parallel()) return;  // no scope to charge, or a share of a kernel's work
  t.flops += flops, t.bytes += bytes;
}

void Scope::open() {
  ThreadState& t = t_state;
  outer_flops_ = t.flops, outer_bytes_ = t.bytes;
  t.flops = t.bytes = 0;
  ++t.depth;
  t0_ = now_us();
}

void Scope::close() {
  const double t1 = now_us();
  ThreadState& t = t_state;
  Event e;
  e.t0 = t0_, e.t1 = t1, e.name = name_, e.cat = Cat::Kernel, e.tid = uint8_t(detail::t_track);
  e.d[0] = t.flops, e.d[1] = t.bytes;
  t.flops = outer_flops_, t.bytes = outer_bytes_;
  --t.depth;
  t0_ = -1;
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  s.push(e);
  OpTotal& tot = op_totals()[name_];
  if (tot.name.empty()) tot.name = name_;
  tot.seconds += (t1 - e.t0) * 1e-6;
  tot.count += 1;
}

void Module::close() {
  Event e;
  e.t0 = t0_, e.t1 = now_us(), e.name = kind_, e.cat = Cat::Module, e.tid = uint8_t(detail::t_track);
  e.a[0] = layer_;
  t0_ = -1;
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  s.push(e);
}

void record_action(const ActionEvent& a) {
  Event e;
  e.t0 = a.t0, e.t1 = a.t1, e.name = a.name, e.cat = Cat::Action, e.tid = 0;
  e.a[0] = a.mb, e.a[1] = a.chunk, e.a[2] = a.stage, e.a[3] = a.mb2, e.a[4] = a.stage2, e.name2 = a.op2;
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  s.push(e);
}

void record_step(int64_t step, double t0_us, double t1_us) {
  Event e;
  e.t0 = t0_us, e.t1 = t1_us, e.name = "step", e.cat = Cat::Step, e.tid = 0;
  e.d[0] = double(step);
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  s.push(e);
  if (s.first_step < 0 || step < s.first_step) s.first_step = step;
  s.last_step = std::max(s.last_step, step);
}

void record_memory(const char* name, double t_us, const int64_t bytes[5]) {
  Event e;
  e.t0 = e.t1 = t_us, e.name = name, e.cat = Cat::Memory, e.tid = 0;
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  e.side = int64_t(s.side.size());
  if (!s.push(e)) return;
  for (int i = 0; i < 5; ++i) s.side.push_back(double(bytes[i]));
}

std::vector<OpTotal> totals() {
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  std::vector<OpTotal> v;
  for (auto& [k, t] : op_totals()) v.push_back(t);
  std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.seconds > b.seconds; });
  return v;
}

int64_t events_recorded() {
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  return int64_t(s.events.size());
}

int64_t events_dropped() {
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.dropped;
}

}  // namespace moetron::trace
