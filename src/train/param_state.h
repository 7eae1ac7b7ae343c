// param_state.h: the trainer's parameter-side state and arithmetic around one Model on one rank: the AdamW
// moments and how they are laid out (whole, ZeRO-1 slices over the run's group, or FSDP's shard segments),
// the DP gradient reduction, the global gradient norm, the clipped AdamW step with the ZeRO-1 parameter
// all-gather, and the global layout that checkpoints, parameter hashes and tests see: every parameter of the
// whole model (all experts, all pipeline stages) at the offsets of model_param_layout(spec), gathered over
// the EP and pipeline groups, plus the expert biases of every MoE layer.
// Not the forward / backward (the pipeline step) and not the file format (checkpoint.h).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/model.h"
#include "moetron/optim.h"
#include "moetron/tensor.h"
#include "train/muon_state.h"

namespace moetron {

struct ParamStateComms {
  Comm dp, ep, edp, pp;
  Comm tp;  // tensor parallelism: sliced parameters gathered over it, partial gradients summed over it
};

// Who holds what across the pipeline: the pipeline rank owning each global parameter and each MoE layer's
// expert bias (the embedding: the first stage's rank, even when the head stage holds a tied copy).
struct PipelineOwnership {
  std::vector<int> param_rank;  // [global params]
  std::vector<int> moe_rank;    // [MoE layers]
};

class ParamState {
 public:
  // zero: 0, 1 (AdamW moments sliced over each run's group) or 3 (the model is in FSDP mode).
  ParamState(Model& m, const JobConfig& cfg, const ParamStateComms& c, const PipelineOwnership& own, int pp_rank);

  // AdamW m + v on this rank; under Muon the momentum of its matrices (in m) and no v for them.
  int64_t state_bytes() const { return (ns_ + nv_) * 4; }
  bool zero1() const { return sharded_; }
  bool zero3() const { return zero3_; }

  // ---- the step
  // TP: the partial gradients (ParamEntry::tp_partial) summed over the TP group first. DP: gradients summed over
  // each run's group (rank-order fold, identical on every rank) in buckets of kCommReduceSegment elements; zero = 3
  // reduced unit by unit during the backward already (HSDP: the gradient shard is all-reduced here over the
  // replicas).
  void reduce_grads();
  // The global gradient norm. Plain and ZeRO-1: per parameter (an expert tensor's shards summed over EP in
  // rank order), folded in global parameter order, so any pipeline split gives the same bits as one process.
  // zero = 3: the FSDP shard norms, then summed over the pipeline ranks in rank order. TP: a sliced tensor's slices
  // summed over the TP group in rank order; an unsliced one (the same on every TP rank) counted once.
  double grad_norm();
  // The optimizer step: AdamW on every parameter, or (optimizer.name = "muon") Muon on the Muon matrices and AdamW
  // on the rest, with ac.lr and ac.weight_decay for both; then the ZeRO-1 parameter all-gather; then the model's
  // compute copies (Model::sync_weights; with every master on this rank, fused: Model::update_and_sync).
  void step(const AdamWConfig& ac, int64_t step, float clip);
  // Muon: whether global parameter g is a Muon matrix (its checkpoint has no "v." tensor).
  bool muon_param(size_t g) const { return !muon_global_.empty() && muon_global_[g]; }
  // Fault injection (fault.h): this rank's first gradient element (model or FSDP shard) becomes a quiet NaN.
  void poison_grad();
  // ... or its first parameter element (the master copy: model or FSDP shard).
  void poison_param();

  // ---- the global layout (collective over EP and PP; zero = 3 also over DP)
  int64_t global_numel() const { return gnp_; }
  const std::vector<ParamEntry>& global_params() const { return gparams_; }
  std::vector<float> global_params_values();  // the model's parameters
  std::vector<float> global_grads();          // the model's gradients
  std::vector<float> global_moment(int which);  // AdamW m (0; Muon's momentum for its matrices) or v (1; 0 there)
  std::vector<float> global_biases();          // [n_moe_total * E]: every MoE layer's expert bias
  // Loading: the local parts of global vectors (no communication).
  void set_params(const std::vector<float>& g);
  void set_moment(int which, const std::vector<float>& g);
  void set_biases(const std::vector<float>& g);

 private:
  struct Run {
    int64_t lo, hi, s_lo, s_hi, st;  // range, this rank's slice, slice's offset in the state buffers
    bool expert;
    const Comm* comm;
    std::vector<int64_t> counts, displs;  // bytes per group rank (all_gather_v of the slices)
  };
  const float* local_params();
  const float* local_grads();
  // An AdamW tensor piece: state index st (m), v index, flat offset (zero = 3: = st), count, local parameter.
  struct AdamPiece {
    int64_t st, v, flat, n;
    int param;
  };
  void build_optimizer(const JobConfig& cfg);
  std::vector<float> v_state() const;          // v in the m layout (zeros at the Muon matrices)
  void set_v_state(const std::vector<float>& st);
  std::vector<float> gather_state(const float* st);  // local flat layout from the state buffers
  void slice_state(float* st, const std::vector<float>& flat);
  std::vector<float> to_global(const float* local);
  void from_global(float* local, const std::vector<float>& g);
  void gather_pp(std::vector<float>& g, const std::vector<int64_t>& offs, const std::vector<int64_t>& sizes,
                 const std::vector<int>& owner);

  Model& m_;
  Fsdp* fsdp_;
  ParamStateComms c_;
  PipelineOwnership own_;
  int pp_rank_;
  int EP_;
  int64_t E_ = 0;  // routed experts (bias length)
  bool zero3_, sharded_;
  int64_t np_ = 0, ns_ = 0, nv_ = 0;  // parameters, m elements, v elements on this rank
  std::vector<Run> runs_;
  std::vector<AdamPiece> adam_;
  std::unique_ptr<MuonState> muon_;
  std::vector<char> muon_global_;  // [global params]
  Tensor mbuf_, vbuf_;
  std::vector<float> stage_, flat_;
  std::vector<ParamEntry> gparams_;
  std::vector<int> gidx_;  // [local param] -> global index
  std::vector<int64_t> goff_;
  int64_t gnp_ = 0;
};

// The pipeline ownership of a job's parameters and expert biases under a plan's stage placement.
PipelineOwnership pipeline_ownership(const ModelSpec& spec, const std::vector<ParamEntry>& global_params,
                                     const std::vector<std::vector<int>>& stage_layers,
                                     const std::vector<int>& stage_rank, int first_stage_rank, int last_stage_rank);

}  // namespace moetron
