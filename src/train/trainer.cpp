// trainer.cpp: `moetron train`: the learning-rate schedule, the in-run matmul peak, and train(), which walks a
// TrainSession (src/train/train_session.h) through resume, the steps and the summary. See trainer.h.
#include "moetron/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "moetron/check.h"
#include "moetron/gemm.h"
#include "moetron/memory.h"
#include "moetron/rng.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"
#include "train/train_session.h"

namespace fs = std::filesystem;

namespace moetron {

double lr_at(const OptimizerSpec& o, const LRSchedulerSpec& s, int64_t step, int64_t total) {
  MT_CHECK(step >= 1, "lr_at", "step must be >= 1, got ", step);
  const double lr = o.lr;
  if (s.warmup_steps > 0 && step <= s.warmup_steps) return lr * double(step) / double(s.warmup_steps);
  if (s.decay_type == DecayType::None) return lr;
  int64_t span = total - s.warmup_steps;
  double p = span > 0 ? std::min(1.0, double(step - s.warmup_steps) / double(span)) : 1.0;
  double mn = s.min_lr_ratio;
  double f = s.decay_type == DecayType::Cosine ? mn + (1 - mn) * 0.5 * (1 + std::cos(M_PI * p)) : 1 - (1 - mn) * p;
  return lr * f;
}

double measure_peak_gflops(ComputeDtype dt, int64_t n, int reps) {
  MT_CHECK(dt != ComputeDtype::Auto, "measure_peak_gflops", "resolve the compute dtype first");
  std::vector<float> a(size_t(n * n)), c(size_t(n * n));
  fill_normal(a.data(), n * n, rng_key(1, "peak"), 0, 0, 1);
  std::vector<bf16> ab(dt == ComputeDtype::BF16 ? size_t(n * n) : 0);
  if (!ab.empty()) f32_to_bf16(ab.data(), a.data(), n * n);
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {  // the first call creates the oneDNN primitive: not timed
    auto t0 = std::chrono::steady_clock::now();
    if (dt == ComputeDtype::BF16)
      gemm_bf16(Trans::N, Trans::N, n, n, n, 1.0f, ab.data(), n, ab.data(), n, 0.0f, c.data(), n);
    else  // the machine's sgemm limit: oneDNN's own sgemm, not moetron's batch-invariant kernel
      gemm_f32_onednn(Trans::N, Trans::N, n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f, c.data(), n);
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, t);
  }
  return 2.0 * double(n) * n * n / best * 1e-9;
}

double measure_memcpy_gbps(int64_t bytes, int reps) {
  MT_CHECK(bytes > 0 && reps >= 1, "measure_memcpy_gbps", "bytes ", bytes, " and reps ", reps, " must be positive");
  std::vector<char> src(size_t(bytes), 1), dst(size_t(bytes), 0);
  const int nt = num_threads();
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {  // the first pass faults the pages in: not timed
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < nt; ++t) {
      const int64_t lo = bytes * t / nt, hi = bytes * (t + 1) / nt;
      std::memcpy(dst.data() + lo, src.data() + lo, size_t(hi - lo));
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, dt);
  }
  return 2.0 * double(bytes) / best * 1e-9;
}

TrainResult train(const JobConfig& cfg, const TrainOptions& opt) {
  TrainSession s(cfg, opt);
  s.resume();
  s.res.start_step = s.step;
  const auto& tr = s.cfg.training;
  if (s.step >= tr.steps && s.say)
    std::printf("nothing to train: the checkpoint is at step %lld and training.steps is %lld\n", (long long)s.step,
                (long long)tr.steps);
  s.res.metrics_path = (fs::path(s.res.dump_folder) / "metrics.jsonl").string();
  if (cfg.metrics.jsonl && s.root) {
    s.metrics.open(s.res.metrics_path, s.step > 0 ? std::ios::app : std::ios::trunc);
    MT_CHECK(s.metrics.good(), "train", "cannot open ", s.res.metrics_path, " for writing");
  }
  s.print_start();
  MemoryTracker::global().reset_peaks();
  s.mcs.dp.reset_stats();
  trace::reset();
  s.begin_profiling();  // the profiled steps' window; with [profiling] enable, the trace session (collective)
  s.ep_window0 = s.model->ep_traffic(), s.ep_run0 = s.ep_window0;
  s.ep_exp_window0 = s.model->ep_exposed(), s.ep_run0_exposed = s.ep_exp_window0;
  while (s.step < tr.steps) s.run_step();
  s.wait_for_checkpoint();  // [checkpoint] async: the last write is done (or its error raised) before the summary
  s.res.end_step = s.step;
  s.finish();
  return s.res;
}

}  // namespace moetron
