// trace.cpp: the event recorder behind MT_TRACE and the Chrome trace writer.
#include "moetron/trace.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <chrono>
#include <fstream>
#include <unordered_map>

#include "moetron/check.h"

namespace moetron::trace {

namespace {
struct Event {
  const char* name;
  double t0, t1;
};
std::atomic<bool> g_on{false};
std::mutex g_mu;
std::vector<Event> g_events;
std::unordered_map<std::string, OpTotal> g_tot;
const auto g_epoch = std::chrono::steady_clock::now();
}  // namespace

void enable(bool on) { g_on.store(on); }
bool enabled() { return g_on.load(std::memory_order_relaxed); }
void reset() {
  g_events.clear();
  g_tot.clear();
}

double Scope::now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - g_epoch).count();
}

void Scope::record(const char* name, double t0, double t1) {
  std::lock_guard<std::mutex> lock(g_mu);  // the EP overlap runs two model lanes on two threads
  g_events.push_back({name, t0, t1});
  auto& t = g_tot[name];
  t.name = name;
  t.seconds += (t1 - t0) * 1e-6;
  t.count += 1;
}

std::vector<OpTotal> totals() {
  std::vector<OpTotal> v;
  for (auto& [k, t] : g_tot) v.push_back(t);
  std::sort(v.begin(), v.end(), [](auto& a, auto& b) { return a.seconds > b.seconds; });
  return v;
}

void write_chrome_trace(const std::string& path, int rank) {
  std::ofstream f(path);
  MT_CHECK(f.good(), "trace", "cannot write ", path);
  f << "{\"traceEvents\":[\n";
  f << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank << ",\"args\":{\"name\":\"rank " << rank << "\"}}";
  for (auto& e : g_events)
    f << ",\n{\"name\":\"" << e.name << "\",\"ph\":\"X\",\"pid\":" << rank << ",\"tid\":0,\"ts\":" << e.t0
      << ",\"dur\":" << (e.t1 - e.t0) << "}";
  f << "\n]}\n";
}

}  // namespace moetron::trace
