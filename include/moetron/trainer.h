// trainer.h: the single-process training loop: data, micro-batches with gradient accumulation, AdamW with
// clipping and an LR schedule, aux-loss-free bias updates, validation, metrics (terminal + metrics.jsonl),
// checkpoints with automatic resume. Data parallel under MPI (dp_replicate * dp_shard ranks, ep = pp = 1):
// every rank trains its share of each global batch, gradients are summed over DP with Comm's rank-order
// all_reduce in a few large buckets, and every rank keeps bitwise identical parameters; rank 0 alone
// prints, writes metrics.jsonl and checkpoints. parallelism.zero = 1 shards the AdamW state over DP;
// zero = 3 (FSDP) shards parameters, gradients and AdamW state (include/moetron/fsdp.h).
// Expert parallel with ep > 1 (experts sharded over the EP group, dispatch/combine in the MoE layers,
// expert gradients reduced over the expert-data-parallel group). Not pipeline parallel yet
// (docs/parallel.md).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/config.h"

namespace moetron {

// Learning rate at optimizer step `step` (1-based): linear warmup, then cosine / linear decay to
// lr * min_lr_ratio at the last step, or constant.
double lr_at(const OptimizerSpec& o, const LRSchedulerSpec& s, int64_t step, int64_t total_steps);

// Matmul throughput of this machine right now (GFLOPS) in the compute dtype dt (BF16 or FP32): the best of
// `reps` n^3 oneDNN matmuls (bf16 matmul, or oneDNN's sgemm: the machine's fp32 limit). The trainer measures
// at start-up (2048, 6) and again briefly at every log step (1024, 3), keeping the best figure, so MFU is
// against the best peak seen in the same run.
double measure_peak_gflops(ComputeDtype dt, int64_t n = 2048, int reps = 6);
// Memory bandwidth of this machine right now (GB/s): the best of `reps` copies of `bytes` split over the OpenMP
// threads, counting bytes read and written. Profiled runs measure it at start-up for the traces' roofline limits.
double measure_memcpy_gbps(int64_t bytes = int64_t(64) << 20, int reps = 3);

struct TrainOptions {
  bool progress = true;     // progress line on a terminal; plain lines otherwise
  bool quiet = false;       // no output at all (tests)
  std::string data_root = "data";  // where named datasets (brown) are prepared
  bool profile = false;            // per-op time breakdown at the end (MT_TRACE scopes), over [profiling]'s steps
  // The world communicator (its size must match [parallelism]); nullptr = comm_world(), which is the
  // single-process communicator unless the process was started by mpirun.
  const Comm* comm = nullptr;
  // For equivalence tests (cost: a hash per sequence / of all parameters per step, a copy at the end).
  bool record_data = false;   // TrainResult::data
  bool record_param_hash = false;  // StepRecord::param_hash
  bool keep_params = false;   // TrainResult::final_params (+ expert biases appended)
  bool keep_first_grads = false;  // TrainResult::first_grads
};

// One training sequence a rank computed: step, index in the global batch [0, G), FNV-1a hash of its
// inputs and targets.
struct SeqRecord {
  int64_t step = 0, index = 0;
  uint64_t hash = 0;
};

struct StepRecord {
  int64_t step = 0;
  double loss = 0, aux_loss = 0, lr = 0, grad_norm = 0;
  // model.mtp_layers > 0: the MTP loss added to the optimized loss (mtp_loss_weight * the mean over depths of each
  // depth's mean cross-entropy); `loss` stays the main model's cross-entropy alone, comparable to runs without MTP.
  double mtp_loss = 0;
  double val_loss = -1;  // -1 when not computed this step
  double seconds = 0;    // wall time of the step on this rank (forward, backward, optimizer, weight refresh)
  uint64_t param_hash = 0;  // FNV-1a of all parameters and expert biases after the step (record_param_hash)
  bool skipped = false;     // not finite: the optimizer step was skipped (training.nonfinite = "skip")
};

struct TrainResult {
  int64_t start_step = 0, end_step = 0;  // resumed from start_step
  std::vector<StepRecord> history;       // one per step run in this process
  double final_loss = 0, final_val_loss = -1;
  double tokens_per_s = 0, tflops = 0, mfu = 0, peak_gflops = 0;
  ComputeDtype compute_dtype = ComputeDtype::Auto;  // as resolved for this run (BF16 or FP32)
  double recompute_seconds = 0;
  int64_t mem_peak_bytes = 0;
  int64_t act_peak_bytes = 0;  // peak of the activations category (what recompute saves)
  // The accounting's prediction of that peak for this rank: per local pipeline stage, its activation slots
  // (the schedule's peak in-flight micro-batches) times the bytes one micro-batch saves in the stage's layers
  // (activation_bytes), plus the model-level terms of the embedding / head stage once.
  int64_t act_predicted_bytes = 0;
  // Peaks per category on this rank over the training loop (MemoryTracker): with zero = 3 the params /
  // grads / optimizer figures are this rank's shards plus the gathered unit slot(s) (docs/parallel.md).
  int64_t params_peak_bytes = 0, grads_peak_bytes = 0, optimizer_peak_bytes = 0;
  std::string dump_folder, metrics_path, checkpoint_dir;
  std::string pipeline_record_path;  // profiled runs: every pipeline rank's executed actions (pipeline_record.h)
  double unigram_entropy = -1;  // of the training data (nats/token) when known
  std::vector<std::pair<std::string, double>> op_seconds;  // per-op breakdown when profiling
  int rank = 0, world = 1;              // this process in the DP group
  int64_t opt_state_bytes = 0;          // AdamW m + v held by this rank (1/dp of the total with zero = 1)
  double comm_seconds = 0;              // time in DP collectives (gradient all-reduce, parameter gather, stats)
  int ep = 1;                           // expert-parallel size
  double ep_bytes_inter_per_step = 0;   // EP bytes this rank sent per step to other nodes / inside its node
  double ep_bytes_intra_per_step = 0;
  double ep_seconds = 0;                // time in EP dispatch / combine (forward and backward)
  double ep_wait_seconds = 0;           // union of the lanes' exchange waits (Model::ep_exposed)
  double ep_exposed_seconds = 0;        // of which no lane computed: the EP time not hidden
  double ep_exposed_paired_seconds = 0; // of which inside overlapped F&B pairs (0 without ep_overlap)
  int64_t ep_wgrad_fill_tasks = 0;      // weight gradients run inside exchange waits (ep_pair_backward = iwfill, iwcarry)
  int64_t ep_buffer_bytes = 0;          // the dispatchers' buffers on this rank
  // Routing skew under EP (Model::ep_rows): over this rank's MoE layers, the most routed rows one dispatch
  // brought, and the rows the buffers hold, each over the balanced tokens x topk (1 = balanced; 0 without EP).
  double ep_rows_peak_ratio = 0, ep_rows_held_ratio = 0;
  std::vector<SeqRecord> data;          // record_data
  std::vector<float> final_params;      // keep_params
  std::vector<float> first_grads;       // keep_first_grads: the reduced gradient of the first step run (global
                                        // layout, before clipping), what the optimizer is given
};

TrainResult train(const JobConfig& cfg, const TrainOptions& opt = {});

}  // namespace moetron
