// train_session.h: the state of one `moetron train` run on one rank, and the steps train() walks through:
// set-up (layout, communicators, data, pipeline plan, model, parameter state), resume, the training steps,
// validation, checkpoints, and the reports (start-up lines, the per-log-step metrics, the summary).
// Private to src/train: train() in trainer.cpp is the only user.
//   train_session.cpp   set-up, validation, resume and save
//   train_step.cpp      one optimizer step: the pipeline executor, the step-wide reductions, AdamW
//   train_report.cpp    printing and metrics.jsonl
// Not the model, the runtime or the optimizer kernels.
#pragma once
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/accounting.h"
#include "moetron/config.h"
#include "moetron/ep_dispatch.h"
#include "moetron/fault.h"
#include "moetron/flight_recorder.h"
#include "moetron/mesh.h"
#include "moetron/model.h"
#include "moetron/optim.h"
#include "moetron/trainer.h"
#include "train/checkpoint_writer.h"
#include "train/model_stages.h"
#include "train/param_state.h"
#include "train/pipeline_executor.h"
#include "train/train_data.h"

namespace moetron {

struct FsdpOptions;

// What one step produced, folded over the step's micro-batches and every rank.
struct StepTotals {
  double ce = 0, aux = 0;   // loss sums (aux already divided by the micro-batch count)
  std::vector<double> mtp_ce;   // MTP: per depth, the cross-entropy sum and its positions over the step
  std::vector<int64_t> mtp_n;
  int64_t ce_n = 0;
  double grad_norm = 0;
  std::vector<std::vector<int64_t>> counts;  // tokens per expert of this rank's MoE layers, summed over DP
  pipeline::StepStats runtime;
  std::vector<Model::Fp8Stat> fp8;  // [quantize]: the step's amax and scales per module (every rank)
};

struct TrainSession {
  TrainSession(const JobConfig& cfg, const TrainOptions& opt);
  ~TrainSession();

  void resume();                  // from the latest complete checkpoint, if any
  std::string save(int64_t step);  // collective; rank 0 writes (in the background with async), returns the path there
  void wait_for_checkpoint();      // the background write in flight, if any, done (its error rethrown)
  double validate();              // mean validation loss (collective)
  void run_step();                // one optimizer step, its record, its log line, its checkpoint
  void finish();                  // the result's totals and the summary
  // Profiling (train_profile.cpp): the window of profiled steps from [profiling] / --profile, and with
  // [profiling] enable the trace session (collective: the start barrier; limits measured first); the step's
  // trace events around run_step; this rank's trace file at the end.
  void begin_profiling();
  bool profiled(int64_t s) const { return profiling && s >= prof_first && s <= prof_last; }
  void trace_step_begin();
  void trace_step_end(int64_t s);
  void end_profiling();

  // reports (train_report.cpp)
  void print_start() const;
  void log_step(const StepRecord& rec, const StepTotals& t, bool do_val);
  void print_summary() const;

  JobConfig cfg;
  const TrainOptions& opt;
  std::string compute_why;  // before `compute`: its initializer writes the reason here
  ComputeDtype compute = ComputeDtype::Auto;
  Comm world;
  DeviceMesh mesh;
  MeshComms mcs;
  // Where gradients are summed: the data-parallel ranks, and under CP their CP ranks too (each holds a share of
  // every sequence): gdp for the dense parameters, gedp for the routed experts (the ranks holding the same ones).
  Comm gdp, gedp;
  int EP = 1, PP = 1, rank = 0, D = 1, pp_rank = 0;
  bool root = true, say = false, tty = false, zero3 = false, profiling = false;
  bool tracing = false;        // [profiling] enable: per-rank trace files
  int64_t prof_first = 0, prof_last = 0;
  double trace_step_t0 = 0;
  std::string trace_folder, trace_file;  // this rank's trace file, once written
  int64_t B = 0, T = 0, G = 0, micro = 0, micro_local = 0;
  TrainResult res;
  TrainSources data;
  PipelinePlan plan;
  std::unique_ptr<FsdpOptions> fsdp_opts;
  std::unique_ptr<PipelineExecutor> exec;
  std::unique_ptr<Model> model;
  std::unique_ptr<ParamState> state;
  FlopsPerToken fpt;
  AdamWConfig adam;
  std::string ckdir;
  CheckpointWriter ckwriter;  // [checkpoint] async: rank 0's background write
  std::ofstream metrics;
  FaultInjector faults;        // MOETRON_FAULT's faults of this rank (fault.h)
  std::unique_ptr<FlightWatchdog> watchdog;  // [comm] timeout_s > 0 (flight_recorder.h)
  int64_t skipped_steps = 0;   // steps whose optimizer update was skipped (training.nonfinite = "skip")
  int64_t step = 0;
  double time_total = 0, window_t = 0;
  int64_t tokens_total = 0, window_tok = 0, window_steps = 0;
  // Tokens per expert of this rank's MoE layers (summed over DP) over the steps since the last log record: an
  // expert with none is "dead" in that record (metrics.jsonl expert_counts.dead).
  std::vector<std::vector<int64_t>> window_counts;
  EpTraffic ep_window0, ep_run0;
  Model::EpExposed ep_exp_window0, ep_run0_exposed;
  std::vector<int32_t> vin, vtg;  // validation batch
  // Profiled steps (every step after the first when profiling): each pipeline rank's executed actions,
  // gathered; rank 0 writes them to <dump_folder>/pipeline_record.json at the end (at most kMaxRecordedSteps).
  static constexpr size_t kMaxRecordedSteps = 64;
  sched::PipelineRecord record;

 private:
  StepTotals forward_backward();  // the executor and the step-wide sums (train_step.cpp)
  // The faults due at this point of the current step (fault.h); true if one of them is a nan fault.
  bool fault_point(FaultPhase phase);
  // training.nonfinite (train_step.cpp): true when the step must not update (collective: every rank gets the
  // same answer). Under "halt" it throws, naming the first parameter whose gradient is not finite.
  bool nonfinite_step(double loss, double grad_norm);
};

std::string human_bytes(int64_t b);

}  // namespace moetron
