// plan/cost.h: the step-time projection of a job's layout on a GPU cluster. Per pipeline stage and
// micro-batch: compute from per-op FLOPs and bytes against the hardware's achievable rates (dense GEMMs,
// grouped GEMMs by tokens per expert, attention, the memory-bound ops, FP8 quantization passes), the TP / CP
// communication a layer exposes, and the EP all-to-all per MoE layer; the timed schedule simulator replays the
// pipeline with these durations (the EP exchange hides in FB actions under ep_overlap); then the data-parallel
// gradient / parameter collectives with the overlap each layout allows, and the optimizer step.
// Host-bound spans: a training framework issues every kernel from the host; the host runs ahead of the GPU except
// after a device-host synchronization, which an MoE layer's forward has once (the tokens per expert are read back
// to size the grouped GEMMs and the all-to-all; not under the sync_free dispatcher). Between synchronizations a span costs the slower of the GPU's work
// and the host's issue time (kernels x Hardware::host_launch); the excess is StageTime::host_f / host_b.
// Under ep_overlap the exchange's kernels hold a share of the SMs (DeepSeek-V3: 20 of 132) while the compute beside
// it runs: StageTime::comm_sm.
// Not a memory model (plan/memory.h) and not a search (plan/search.h).
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"
#include "moetron/plan/pipeline.h"
#include "moetron/schedule.h"

namespace moetron::plan {

// The projection's compute by op group, each named after the engine's trace scopes it lines up with (`plan validate
// --ops` prints them side by side): attn_proj (q/k/v and output projections, RoPE: fwd/bwd.attn.proj, .out_proj),
// attn_core (fwd/bwd.attn.core), norm (fwd/bwd.norm), ffn (the dense FFN and the shared experts: fwd.mlp,
// fwd.shared, bwd.mlp), router (fwd/bwd.router), permute (fwd/bwd.permute, .combine), experts (the routed
// experts' grouped GEMMs and SwiGLU: fwd/bwd.experts), loss (the head and the loss: loss.fused_linear_xent),
// other (residual adds: untraced in the engine).
enum PlanOp : int { kOpAttnProj, kOpAttnCore, kOpNorm, kOpFfn, kOpRouter, kOpPermute, kOpExperts, kOpLoss, kOpOther,
                    kNumPlanOps };
const char* plan_op_name(int op);
using OpSeconds = std::array<double, kNumPlanOps>;

// One micro-batch of one stage, seconds.
struct StageTime {
  double f = 0, i = 0, w = 0;     // compute (F; backward input and weight halves), incl. exposed TP/CP comm
  double a2a_f = 0, a2a_b = 0;    // EP dispatch + combine per F and per backward
  // With parallelism.ep_overlap_split: the chunk as two half micro-batches (half the tokens: the grouped GEMMs at
  // half the tokens per expert, every kernel and exchange with its own launch / latency), both halves summed.
  double f2 = 0, i2 = 0, w2 = 0, a2a_f2 = 0, a2a_b2 = 0;
  int n_a2a = 1;  // exchanges per chunk and direction: dispatch and combine of each MoE layer (at least 1)
  double gemm = 0, attention = 0, memory_bound = 0, quantize = 0, recompute = 0;  // compute parts (f+i+w)
  double tp_comm = 0, cp_comm = 0;  // exposed, included in f / i
  double host_f = 0, host_b = 0;    // exposed host kernel issue (Hardware::host_launch), included in f / i
  double comm_sm = 0;               // under ep_overlap: the compute slowed by the exchange's SMs, included in f+i+w
  double flops = 0;               // hardware FLOPs of F+B (incl. recompute)
  OpSeconds op_f{}, op_b{};       // compute by op group: forward, backward (I + W); recompute apart
};

struct TimePlan {
  Layout layout;
  std::string hardware;
  std::vector<StageTime> stages;  // [n_stages]
  double p2p = 0;                 // one activation / gradient message
  double pipeline_time = 0;       // the simulator's step (compute + EP + p2p + bubbles)
  double bubble_ratio = 0;
  double dp_exposed = 0;          // gradient reduce-scatter / all-reduce and parameter all-gather not hidden
  double dp_total = 0;            // the same before overlap
  double optimizer = 0;           // gradient zeroing, norm and AdamW over the rank's shard
  double weight_refresh = 0;      // rebuilding the weights' compute copies / packed layouts (engine recipe)
  double step_time = 0;
  double tokens_per_step = 0;
  double tokens_per_s_per_gpu = 0;
  double tflops_per_gpu = 0;      // model FLOPs (3 x forward, accounting.h) per second per GPU
  double mfu = 0;                 // against the bf16 dense peak
  std::map<std::string, double> breakdown;  // seconds per step, per kind (sums to step_time)
  OpSeconds ops_f{}, ops_b{};     // per step, the slowest pipeline rank: compute by op group (forward, backward)
  bool simulated = true;          // false: the analytic estimate (search's first pass)
  // ep_overlap's unpaired backwards queued their weight gradients into later exchange waits (the engine's iwcarry:
  // parallelism.ep_pair_backward = "iwcarry", or "auto" where it projects faster than b; never under [quantize] or
  // ep_baton = "turn", where the engine keeps b).
  bool carry_w = false;
  int64_t simulated_microbatches = 0;
};

struct TimeOptions {
  PlanOptions memory;             // recipe, loss fusion (for the FLOP / byte counts)
  bool simulate = true;           // replay the schedule (else the analytic pipeline estimate)
  double model_flops_per_token = 0;  // the accounting's train FLOPs per token, when the caller has it (0 = count)
  // The data-parallel collectives overlap the last backward / first forward (Megatron's overlap_grad_reduce /
  // overlap_param_gather, FSDP prefetch). moetron's engine runs them after the backward: false when validating.
  bool overlap_dp = true;
  // Whether ep_overlap's weight gradients are carried is not an option here: plan_time reads the job's
  // parallelism.ep_pair_backward, as the engine does (auto projects both and keeps the faster: carried ones delay
  // the stages' gradient reduction, which overlap_dp needs early).
};

// `memory`: the layout's memory projection when the caller has it (the DP collectives read its parameter counts).
// `durations`: this layout's stage_times() when the caller has them (the search prices a stage shape once for the
// layouts that differ only in overlap or micro-batch count).
TimePlan plan_time(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o = {},
                   const MemoryPlan* memory = nullptr, const StagePlan* stages = nullptr,
                   const std::vector<StageTime>* durations = nullptr);
// The per-stage durations alone: stage_times_at(..., 1.0), with the split halves under ep_overlap_split.
std::vector<StageTime> stage_times(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o,
                                   const StagePlan& sp);
// The stages' durations with `token_share` of the micro-batch's tokens on each rank (1: the whole micro-batch;
// 0.5: one half of a split chunk); they depend on the layout's shape, not on its overlap or micro-batch count.
std::vector<StageTime> stage_times_at(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o,
                                      const StagePlan& sp, double token_share);
// Fills the split fields (f2 ... a2a_b2) of `whole` from the same stages priced at half the tokens.
void set_split_halves(std::vector<StageTime>& whole, const std::vector<StageTime>& half);
// The timed replay's durations of a plan: its stages, P2P message and the layout's split of unpaired chunks
// (filled by plan_time up to its stages and p2p).
sched::Durations replay_durations(const TimePlan& t);
nlohmann::json to_json(const TimePlan& t);
std::string format_time(const TimePlan& t);

}  // namespace moetron::plan
