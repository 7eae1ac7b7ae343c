// pipeline_executor.h: one optimizer step's forward and backward as a schedule. It owns this rank's ModelStage
// adapters and the PipelineRuntime that runs the lowered IR; a step fetches the step's micro-batches (every
// pipeline rank reads the same ones), runs the rank's action list, and returns each micro-batch's statistics
// and the executed actions with their times. One process is the trivial schedule (pp = 1: with 1f1b,
// F0 B0 F1 B1 ... with one activation slot, as the plain micro-batch loop did).
// Not the optimizer step and not the reductions over DP (the trainer), not the model (model_stages.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/model.h"
#include "moetron/pipeline_record.h"
#include "moetron/schedule.h"
#include "comm/pipeline_runtime.h"
#include "train/model_stages.h"
#include "train/train_data.h"

namespace moetron {

struct StepOutcome {
  std::vector<MicroStats> micro;         // [micro-batches]: this rank's stages' share
  pipeline::StepStats runtime;           // this rank's step
  std::vector<sched::TimedOp> record;    // executed actions (when recording)
};

class PipelineExecutor {
 public:
  // Collective over pp: builds the adapters and the runtime (which plans the activation slots; `plan.parts`
  // gets them) before the model exists. act_floats: the residual stream of one micro-batch, B * T * d_model.
  // ep_overlap: FB actions run their halves at once, the backward half on a worker thread as the model's
  // lane 1 (Model::set_thread_lane), the forward half on this thread.
  // pair: parallelism.ep_pair_backward (auto | b | iw | iwfill | iwcarry), read with ep_overlap only.
  PipelineExecutor(PipelinePlan& plan, const Comm& pp, int64_t act_floats, bool ep_overlap = false,
                   const std::string& pair = "auto");
  ~PipelineExecutor();
  void bind(Model& m);  // once the model is built with plan.parts
  const pipeline::PipelineRuntime& runtime() const { return *rt_; }
  int microbatches() const { return M_; }

  // Fetches the step's micro-batches from src (a hash per sequence into `seqs` when given, with the index of
  // micro-batch mb's first sequence at seq_base + mb * B), then runs the schedule once.
  StepOutcome run(BatchSource& src, int64_t B, int64_t T, bool record, std::vector<uint64_t>* seqs = nullptr);
  // Collective over pp: every pipeline rank's recorded actions of a run (run with record = true) on every rank,
  // the times moved to one origin, the earliest rank's step start. steady_clock is one clock for every process
  // of a host, so on one host the ranks' times are directly comparable; across hosts the offsets would carry
  // the clocks' difference (the trainer only records on one host's worth of ranks meaningfully).
  sched::RecordedStep gather_record(int64_t step, const StepOutcome& o, const Comm& pp) const;

 private:
  void trace_actions(const std::vector<sched::TimedOp>& ops) const;
  struct Worker;  // the lane-1 thread of the EP overlap
  std::unique_ptr<Worker> worker_;
  Model* model_ = nullptr;
  bool wgrad_fill_ = false;   // parallelism.ep_pair_backward = iwfill or iwcarry
  bool wgrad_carry_ = false;  // iwcarry
  bool pair_auto_ = false;    // ep_pair_backward = auto: iwcarry if the model can, else b
  int M_ = 1;
  std::vector<std::unique_ptr<ModelStage>> stages_;
  std::unique_ptr<pipeline::PipelineRuntime> rt_;
  StepBatches data_;
  std::vector<MicroStats> stats_;
};

}  // namespace moetron
