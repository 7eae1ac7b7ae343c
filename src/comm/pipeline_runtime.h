// pipeline_runtime.h: the pipeline-parallel runtime. It executes one rank's list of a lowered schedule
// (include/moetron/schedule.h) over the stages this rank holds: calls their forward / backward halves in list
// order, moves activations and input gradients between ranks (non-blocking sends, blocking receives on the
// pipeline communicator) and between neighbouring stages of the same rank (in memory), and records every
// action with its start and end. Not the model: a stage is anything implementing PipelineStage (the model's
// stages, or a toy chain in the tests). Not a scheduler either: the order comes from the schedule.
//
// Matching: every pipeline message uses one tag (RuntimeOptions::tag) and relies on the per-pair FIFO order
// that lower() guarantees (between two ranks the RECVs appear in the order of the SENDs). Each message
// carries a 64-byte header (kind, producer stage, micro-batch, size, step) that the receiver checks, so a
// mismatch (ranks running different schedules, foreign traffic on the tag) is a clear error, never silently
// wrong data.
//
// Buffers: planned once from the schedule when the runtime is built, allocated once, reused every step.
//   * activation slots: each stage holds at most its peak in-flight count (F run, its B or W not yet) of
//     micro-batches; the runtime numbers the slots and passes the slot to every call;
//   * received activations / gradients and same-rank hand-overs: one pool per stage and direction, sized by
//     the peak number waiting for their consumer;
//   * outgoing tensors: one pool per stage and direction. A send buffer is reused only once the send is known
//     to be complete: the peer has posted its receive, which this rank knows when it receives a message the
//     peer sent after that receive (the schedule says which). Sends still open at the end of a step are
//     waited for then.
// FB actions run their forward half, then their backward half, one after the other, unless
// RuntimeOptions::run_fb runs them otherwise (the EP overlap: at once, on two threads).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "moetron/comm.h"
#include "moetron/schedule.h"

namespace moetron::pipeline {

inline constexpr int kPipelineTag = 29000;  // default tag of every pipeline message

// What the runtime tells a stage once, before its first step.
struct StageSetup {
  int stage = 0;           // global stage id
  int n_stages = 1;
  int n_microbatches = 1;
  int rank = 0;            // pipeline rank that holds the stage
  int slots = 0;           // activation slots: the stage's peak in-flight micro-batches in this schedule
  bool split_backward = false;  // the schedule runs I then W (instead of B) for this stage
  // The micro-batch order of this stage's weight-gradient computations (its B, or its W with split
  // backward). When it is 0, 1, ..., M-1, accumulating weight gradients as they come gives the same bits as
  // the sequential run of the micro-batches; otherwise keep one part per micro-batch and sum the parts in
  // micro-batch order at the end of the step. Every built-in generator runs each stage in micro-batch order.
  std::vector<int> weight_grad_order;
  bool weight_grads_in_mb_order = true;
};

// One pipeline stage as the runtime drives it. Sizes are fp32 elements per micro-batch.
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  // in_size: the activation received from stage-1 (and the gradient returned to it); 0 on the first stage,
  // which fetches its own micro-batch input from the data. out_size: the activation passed to stage+1 (and
  // the gradient received back); 0 on the last stage, which computes the loss.
  virtual int64_t in_size() const = 0;
  virtual int64_t out_size() const = 0;
  virtual bool supports_split_backward() const { return false; }  // implements backward_input / _weight
  virtual void setup(const StageSetup& s) = 0;  // once, before the first step
  // F of micro-batch mb: reads `in` [in_size] (null on the first stage; valid during the call only), writes
  // `out` [out_size] (null on the last stage, which computes mb's loss). Keeps what its backward needs in
  // activation slot `slot` (0 <= slot < setup.slots) until mb's B or W.
  virtual void forward(int mb, int slot, const float* in, float* out) = 0;
  // B: reads `dout` [out_size] (null on the last stage: start from the loss), writes `din` [in_size] (null on
  // the first stage), adds mb's weight gradients; slot `slot` is free afterwards.
  virtual void backward(int mb, int slot, const float* dout, float* din) = 0;
  // I: B without the weight gradient; keeps in the slot what W needs. W: mb's weight gradients; frees the
  // slot. Only called when supports_split_backward(); the defaults refuse.
  virtual void backward_input(int mb, int slot, const float* dout, float* din);
  virtual void backward_weight(int mb, int slot);
};

struct RuntimeOptions {
  int tag = kPipelineTag;  // in [0, kCommMaxUserTag]
  // How an FB action runs its two halves (each a call of its stage's forward / backward): null = the forward
  // half, then the backward half. The trainer's EP overlap runs them at once on two threads. The halves use
  // different stages' or slots' data and different buffers; they may not touch the pipeline communicator.
  std::function<void(const std::function<void()>& fwd_half, const std::function<void()>& bwd_half)> run_fb;
  // An FB's full-backward half (B) runs as its input half then its weight half (backward_input, backward_weight
  // of the same micro-batch, when the stage supports it): the EP exchanges all sit in the input half, so the
  // forward half's compute can cover them and the weight GEMMs, which need no cover, come last. Same result bit
  // for bit (the weight gradients are the same GEMMs, accumulated in the same order).
  bool fb_backward_split = false;
};

struct StepStats {
  double seconds = 0;          // step wall time on this rank
  double compute_seconds = 0;  // inside compute actions
  double recv_seconds = 0;     // inside RECV actions (waiting included)
  double send_wait_seconds = 0;  // waiting for sends to complete (buffer reuse and end of step)
  int64_t messages_sent = 0, bytes_sent = 0;  // bytes include the 64-byte headers
  int64_t messages_received = 0, bytes_received = 0;
};

class PipelineRuntime {
 public:
  // `schedule`: lowered, or compute-only (then lowered here). `stages`: this rank's stages in ascending stage
  // id (schedule.stage_rank says which). `pp`: the pipeline communicator, size = schedule.pp, rank r runs
  // list r. Collective over `pp`: checks the schedule (valid, pp ranks, the same on every rank), the stages
  // (count, sizes chained: out_size(s) == in_size(s+1), 0 at the ends, split backward where needed), plans
  // and allocates the buffers and calls every stage's setup(). Errors name the rank, stage and values.
  PipelineRuntime(const sched::Schedule& schedule, std::vector<PipelineStage*> stages, Comm pp,
                  RuntimeOptions opt = {});
  ~PipelineRuntime();
  PipelineRuntime(const PipelineRuntime&) = delete;
  PipelineRuntime& operator=(const PipelineRuntime&) = delete;

  // Runs this rank's list once. `record` (optional) receives every executed action in list order as
  // sched::TimedOp {rank, index in the lowered list, action, start, end}, seconds on steady_clock since the
  // step started on this rank: the format of simulate_timed's ops, so pp_vis can draw a measured step.
  StepStats run_step(std::vector<sched::TimedOp>* record = nullptr);

  const sched::Schedule& schedule() const;  // the lowered schedule it runs
  int rank() const;
  const std::vector<int>& stage_ids() const;  // this rank's stages, ascending
  int stage_slots(int stage) const;           // activation slots of one of this rank's stages
  int peak_inflight() const;                  // this rank's peak activation sets (simulate_timed's figure)
  int64_t buffer_bytes() const;               // communication / hand-over buffers allocated
  double step_start() const;                  // steady_clock seconds when the last step started
  void set_fb_backward_split(bool on);        // RuntimeOptions::fb_backward_split, between steps

 private:
  struct Impl;
  std::unique_ptr<Impl> p_;
};

// One step with a runtime built for it (tests and one-off runs; a training loop keeps a PipelineRuntime).
StepStats run_schedule(const sched::Schedule& schedule, std::vector<PipelineStage*> stages, const Comm& pp,
                       std::vector<sched::TimedOp>* record = nullptr);

}  // namespace moetron::pipeline
