// model_stages.h: the engine's model as the pipeline runtime's stages, and the pieces of a pipeline step that
// know about the model: which stages this rank holds (from the resolved [parallelism] pipeline), the adapter
// that lets PipelineRuntime drive Model::stage_forward / stage_backward (split I / W included), the
// per-micro-batch statistics a step collects from its stages, the forward-only chain used by validation,
// and the tied-embedding gradient exchange between the first and the last stage's ranks.
// Not the schedule (src/schedule/), not the runtime (src/comm/pipeline_runtime.h) and not the optimizer
// step (the trainer).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/model.h"
#include "moetron/schedule.h"
#include "comm/pipeline_runtime.h"

namespace moetron {

// The resolved pipeline of a job on one pipeline rank: the lowered schedule and the stage parts this rank
// holds (slots filled once the runtime has planned them).
struct PipelinePlan {
  PipelineSetup setup;
  sched::Schedule lowered;
  int pp = 1, pp_rank = 0;
  std::vector<ModelStagePart> parts;  // this rank's stages, ascending
  int first_stage_rank = 0, last_stage_rank = 0;  // pipeline ranks of the embedding and the head stage
};
// pp = 1 runs the configured schedule on one rank (1f1b: one slot, F B F B ...; gpipe: every F first).
PipelinePlan make_pipeline_plan(const JobConfig& cfg, int pp_rank);

// One micro-batch's statistics from this rank's stages, merged (each MoE layer and the loss come from one
// stage only, so merging is exact).
struct MicroStats {
  double ce_sum = 0;
  int64_t ce_count = 0, dropped = 0;
  std::vector<double> aux_by_layer, z_by_layer;  // global MoE index
  std::vector<double> mtp_ce;                    // MTP: per depth (the head stage's)
  std::vector<int64_t> mtp_n;
  void add(const ForwardStats& s);
};

// The data of one step, per micro-batch: tokens and targets [B*T] (every pipeline rank reads the same
// micro-batches; the embedding stage uses the tokens, the head stage the targets).
struct StepBatches {
  std::vector<std::vector<int32_t>> tokens, targets;
};

// One local stage of a Model as a PipelineStage. Built before the model (the runtime's setup() gives the
// slot count the model is then built with); bind() attaches the model and the step's data.
class ModelStage : public pipeline::PipelineStage {
 public:
  ModelStage(int local, const ModelStagePart& part, int64_t act_floats);
  void bind(Model* m, const StepBatches* data, std::vector<MicroStats>* stats) { m_ = m, data_ = data, stats_ = stats; }
  int slots() const { return slots_; }

  int64_t in_size() const override { return part_.embedding ? 0 : act_; }
  int64_t out_size() const override { return part_.head ? 0 : act_; }
  bool supports_split_backward() const override { return true; }
  void setup(const pipeline::StageSetup& s) override;
  void forward(int mb, int slot, const float* in, float* out) override;
  void backward(int mb, int slot, const float* dout, float* din) override;
  void backward_input(int mb, int slot, const float* dout, float* din) override;
  void backward_weight(int mb, int slot) override;

 private:
  int local_;
  ModelStagePart part_;
  int64_t act_;
  int slots_ = 0;
  Model* m_ = nullptr;
  const StepBatches* data_ = nullptr;
  std::vector<MicroStats>* stats_ = nullptr;
};

// Forward only through every stage, micro-batch by micro-batch (validation): stage order on the pipeline
// communicator with activation messages on tag kPipelineTag + 1. Returns ce_sum / ce_count of the head stage
// on every pipeline rank (summed over pp, where only the head rank's are nonzero). Collective over pp.
ForwardStats pipeline_forward_only(Model& m, const PipelinePlan& plan, const Comm& pp, const int32_t* tokens,
                                   const int32_t* targets);

// Tied embeddings after the micro-batches of a step: the head's gradient joins the embedding's (rows first,
// then the head's, whatever the layout), and the head stage's rank receives the same sum so both copies of the
// tied weight take the same update. The same for the MTP depths' embedding gradient (model.mtp_layers > 0: the
// head stage holds a copy of the embedding). Collective between the two ranks (tag kPipelineTag + 2); a no-op when
// the embeddings are not tied and there is no MTP. Under FSDP (zero = 3; MTP only, tied embeddings need one stage)
// the two ranks exchange their blocks of the embedding's gradient shard (the head stage's copy is its own unit).
void exchange_tied_grads(Model& m, const PipelinePlan& plan, const Comm& pp);

}  // namespace moetron
