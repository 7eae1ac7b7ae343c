// train_profile.cpp: TrainSession's profiling: which steps are profiled ([profiling] start_step / end_step, for
// both `--profile`'s per-op breakdown and the traces), the trace session of a run with [profiling] enable (the
// machine limits, the layout and the config in the metadata; the start barrier), the step's own events (the step,
// memory counters at its boundaries) and, at the end, this rank's trace file and the per-op breakdown.
// Not the recorder or the file format (src/trace/, docs/profiling.md), not the schedule actions
// (pipeline_executor.cpp records them).
#include <cstdio>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "moetron/memory.h"
#include "moetron/trace.h"
#include "train/train_session.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moetron {

namespace {

// The trace's memory categories (docs/profiling.md): buffers = comm + workspace + other.
void memory_now(int64_t cur[5], int64_t peak[5]) {
  const MemSnapshot m = MemoryTracker::global().snapshot();
  const auto at = [](const auto& a, MemCategory c) { return a[size_t(c)]; };
  for (int k = 0; k < 2; ++k) {
    const auto& a = k == 0 ? m.current : m.peak;
    int64_t* o = k == 0 ? cur : peak;
    o[0] = at(a, MemCategory::Params), o[1] = at(a, MemCategory::Grads), o[2] = at(a, MemCategory::Optimizer);
    o[3] = at(a, MemCategory::Activations);
    o[4] = at(a, MemCategory::Comm) + at(a, MemCategory::Workspace) + at(a, MemCategory::Other);
  }
}

}  // namespace

void TrainSession::begin_profiling() {
  const ProfilingSpec& p = cfg.profiling;
  tracing = p.enable;
  profiling = opt.profile || tracing;
  prof_first = p.start_step > 0 ? p.start_step : res.start_step + 2;  // this run's first step warms caches
  prof_last = p.end_step > 0 ? p.end_step : std::numeric_limits<int64_t>::max();
  if (!tracing) return;
  trace_folder = fs::path(p.folder).is_absolute() ? p.folder : (fs::path(res.dump_folder) / p.folder).string();
  fs::create_directories(trace_folder);
  // The roofline's limits: the start-up matmul peak (or the stated one) and a copy's bandwidth, both per rank.
  const double gbps = measure_memcpy_gbps();
  json meta;
  meta["source"] = "engine";
  meta["config"] = to_toml(cfg);
  meta["limits"] = {{"flops_per_s", res.peak_gflops * 1e9},
                    {"bytes_per_s", gbps * 1e9},
                    {"dtype", std::string(to_string(compute))},
                    {"source", cfg.metrics.peak_tflops > 0 ? "metrics.peak_tflops (flops), start-up measurement (bytes)"
                                                           : "start-up measurement"}};
  meta["layout"] = {{"dp", D},
                    {"ep", EP},
                    {"pp", PP},
                    {"vpp", plan.setup.stages_per_rank},
                    {"zero", cfg.parallelism.zero},
                    {"fsdp", zero3},
                    {"schedule", plan.lowered.name},
                    {"ep_dispatcher", std::string(to_string(cfg.parallelism.ep_dispatcher))},
                    {"ep_overlap", cfg.parallelism.ep_overlap},
                    {"micro_batches", micro_local},
                    {"tokens_per_step", G * T}};
  meta["flops_per_token"] = {{"model", fpt.train}, {"hardware", fpt.hw_train}};
  trace::begin_session(world, cfg.profiling.max_events, meta);
}

void TrainSession::trace_step_begin() {
  trace_step_t0 = trace::now_us();
  if (!tracing) return;
  int64_t cur[5], peak[5];
  memory_now(cur, peak);
  trace::record_memory("memory", trace_step_t0, cur);
}

void TrainSession::trace_step_end(int64_t s) {
  if (!tracing) return;
  const double t1 = trace::now_us();
  int64_t cur[5], peak[5];
  memory_now(cur, peak);
  trace::record_memory("memory", t1, cur);
  trace::record_memory("memory_peak", t1, peak);  // the run's peaks so far (the summary's figures)
  trace::record_step(s, trace_step_t0, t1);
}

void TrainSession::end_profiling() {
  if (!profiling) return;
  double tot = 0;
  for (auto& t : trace::totals()) {
    res.op_seconds.push_back({t.name, t.seconds});
    tot += t.seconds;
  }
  if (tracing) {
    const int64_t n = trace::events_recorded(), dropped = trace::events_dropped();
    trace_file = (fs::path(trace_folder) / ("rank" + std::to_string(world.rank()) + ".trace.json")).string();
    trace::end_session(trace_file);
    if (say)
      std::printf("trace: %s/rank<r>.trace.json (rank 0: %lld events%s; moetron trace merge %s -o run.json)\n",
                  trace_folder.c_str(), (long long)n,
                  dropped ? (", " + std::to_string(dropped) + " dropped at profiling.max_events").c_str() : "",
                  trace_folder.c_str());
  }
  if (say) {
    std::printf("\nper-op time over steps %lld..%lld (kernel scopes; a recomputed layer's are inside its "
                "layer<i>.recompute module):\n",
                (long long)std::max(prof_first, res.start_step + 1), (long long)std::min(prof_last, res.end_step));
    for (auto& [n, sec] : res.op_seconds)
      std::printf("  %-22s %8.3f s  %5.1f%%\n", n.c_str(), sec, tot > 0 ? 100 * sec / tot : 0.0);
  }
}

}  // namespace moetron
