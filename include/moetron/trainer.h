// trainer.h: the single-process training loop: data, micro-batches with gradient accumulation, AdamW with
// clipping and an LR schedule, aux-loss-free bias updates, validation, metrics (terminal + metrics.jsonl),
// checkpoints with automatic resume. Not parallel (the parallel runtime will drive the same step).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moetron/config.h"

namespace moetron {

// Learning rate at optimizer step `step` (1-based): linear warmup, then cosine / linear decay to
// lr * min_lr_ratio at the last step, or constant.
double lr_at(const OptimizerSpec& o, const LRSchedulerSpec& s, int64_t step, int64_t total_steps);

// bf16 matmul throughput of this machine right now (GFLOPS), measured with a few 2048^3 oneDNN matmuls.
double measure_bf16_peak_gflops();

struct TrainOptions {
  bool progress = true;     // progress line on a terminal; plain lines otherwise
  bool quiet = false;       // no output at all (tests)
  std::string data_root = "data";  // where named datasets (brown) are prepared
  bool profile = false;            // per-op time breakdown at the end (MT_TRACE scopes)
  std::string trace_path;          // also write a Chrome trace JSON there (implies profile)
};

struct StepRecord {
  int64_t step = 0;
  double loss = 0, aux_loss = 0, lr = 0, grad_norm = 0;
  double val_loss = -1;  // -1 when not computed this step
};

struct TrainResult {
  int64_t start_step = 0, end_step = 0;  // resumed from start_step
  std::vector<StepRecord> history;       // one per step run in this process
  double final_loss = 0, final_val_loss = -1;
  double tokens_per_s = 0, tflops = 0, mfu = 0, peak_gflops = 0;
  double recompute_seconds = 0;
  int64_t mem_peak_bytes = 0;
  int64_t act_peak_bytes = 0;  // peak of the activations category (what recompute saves)
  std::string dump_folder, metrics_path, checkpoint_dir;
  double unigram_entropy = -1;
  std::vector<std::pair<std::string, double>> op_seconds;  // per-op breakdown when profiling  // of the training data (nats/token) when known
};

TrainResult train(const JobConfig& cfg, const TrainOptions& opt = {});

}  // namespace moetron
