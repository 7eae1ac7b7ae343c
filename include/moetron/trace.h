// trace.h: the profiler's event recorder. While enabled (the trainer enables it for the profiled steps) it
// records, per rank, the events of docs/profiling.md ("Trace format (version 1)"): kernel scopes (MT_TRACE)
// with the FLOPs and bytes of the work done inside them, module scopes (layer<i>.attn / .moe / .mlp, embed,
// head, optimizer), schedule actions, steps, communication calls (through the Comm trace sink) and memory
// counters; it keeps per-kernel totals for the trainer's --profile breakdown, and writes one Chrome trace JSON
// file per rank (trace_write.cpp). Disabled (the default), a scope costs one predictable branch and a kernel's
// cost report one more.
//
// Threads: every event lands on the calling thread's track (set_thread_track: 0 = the thread that drives the
// step, 2 = the EP overlap's second lane). Recording is thread-safe; a scope opens and closes on one thread.
// Costs: a kernel entry point reports its work with MT_TRACE_COST(flops, bytes) on the calling thread, outside
// any OpenMP parallel region; the figures go to the innermost kernel scope open on that thread (not to its
// parents), so a scope's `flops` are the work of the kernels called inside it.
// Not the trace file reader or merger (src/tracefile/), not the analysis.
#pragma once
#include <atomic>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace moetron {
class Comm;
}

namespace moetron::trace {

namespace detail {
extern std::atomic<bool> g_on;
}
inline bool enabled() { return detail::g_on.load(std::memory_order_relaxed); }
void enable(bool on);
void reset();  // drop events, totals and the session

struct OpTotal {
  std::string name;
  double seconds = 0;
  int64_t count = 0;
};
std::vector<OpTotal> totals();  // kernel scopes by name, sorted by time, descending

// The calling thread's track (Chrome `tid`): 0 compute (default), 1 communication progress, 2 the EP overlap's
// second lane.
void set_thread_track(int tid);
double now_us();  // steady_clock microseconds since its epoch (the recorder's clock)

// Work done by the calling thread, for the innermost open kernel scope (see above). Use MT_TRACE_COST.
void add_cost(double flops, double bytes);

// A kernel scope: times the rest of the enclosing block (or until stop()); `name` must be a literal.
class Scope {
 public:
  explicit Scope(const char* name) : name_(name) {
    if (enabled()) open();
  }
  ~Scope() { stop(); }
  void stop() {  // end the scope early (records once)
    if (t0_ >= 0) close();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  void open();
  void close();
  const char* name_;
  double t0_ = -1;
  double outer_flops_ = 0, outer_bytes_ = 0;  // the enclosing kernel scope's figures, restored on close
};

// A module scope: `kind` ("attn", "moe", "mlp", "recompute" with a layer; "embed", "head", "optimizer" with
// layer -1) names it `layer<i>.<kind>` or `<kind>`. `on` = false records nothing (e.g. the inner modules of a
// recomputed layer, which sit inside its `recompute` module).
class Module {
 public:
  Module(const char* kind, int layer = -1, bool on = true) : kind_(kind), layer_(layer) {
    if (on && enabled()) t0_ = now_us();
  }
  ~Module() { stop(); }
  void stop() {
    if (t0_ >= 0) close();
  }
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

 private:
  void close();
  const char* kind_;
  int layer_;
  double t0_ = -1;
};

// A schedule action on track 0 (times in now_us()'s clock): F, B, I, W or FB with its micro-batch, chunk (the
// stage's index among this rank's stages) and global stage; FB also its backward half (op2 "B"/"I", mb2, stage2).
struct ActionEvent {
  const char* name = "F";
  double t0 = 0, t1 = 0;
  int mb = 0, chunk = 0, stage = 0;
  const char* op2 = nullptr;
  int mb2 = -1, stage2 = -1;
};
void record_action(const ActionEvent& a);
void record_step(int64_t step, double t0_us, double t1_us);
// A counter sample (Chrome "C") named `name` ("memory", "memory_peak") at t_us: bytes per category in the
// order params, grads, optimizer, activations, buffers.
void record_memory(const char* name, double t_us, const int64_t bytes[5]);

// A rank's trace session. begin_session is collective over `world` (a barrier: every rank's clock is aligned to
// its end, which becomes ts 0); it installs the Comm trace sink, so every communicator's calls are recorded
// while enabled. `meta` is merged into the file's metadata object (layout, limits, config, source). At most
// max_events events are kept; later ones are counted in `dropped_events`.
void begin_session(const Comm& world, int64_t max_events, const nlohmann::json& meta);
bool in_session();
// Writes this rank's file (docs/profiling.md) and ends the session (removes the sink).
void end_session(const std::string& path);
void cancel_session();  // ends a session (if any) without writing
int64_t events_recorded();
int64_t events_dropped();

}  // namespace moetron::trace

#define MT_TRACE_CAT2(a, b) a##b
#define MT_TRACE_CAT(a, b) MT_TRACE_CAT2(a, b)
// MT_TRACE("moe.grouped_gemm"): a kernel scope for the rest of the enclosing block. The name must be a literal.
#define MT_TRACE(name) ::moetron::trace::Scope MT_TRACE_CAT(mt_trace_scope_, __LINE__)(name)
// A kernel's work (evaluated only while tracing): MT_TRACE_COST(2.0 * M * N * K, bytes).
#define MT_TRACE_COST(flops, bytes)                                                      \
  do {                                                                                   \
    if (::moetron::trace::enabled()) ::moetron::trace::add_cost(double(flops), double(bytes)); \
  } while (0)
// A kernel scope with explicit figures (for work no instrumented kernel reports): MT_TRACE_K(name, flops, bytes).
#define MT_TRACE_K(name, flops, bytes) \
  MT_TRACE(name);                      \
  MT_TRACE_COST(flops, bytes)
// A module scope for the rest of the enclosing block: MT_TRACE_MODULE("attn", layer) / MT_TRACE_MODULE("embed").
#define MT_TRACE_MODULE(...) ::moetron::trace::Module MT_TRACE_CAT(mt_trace_module_, __LINE__)(__VA_ARGS__)
