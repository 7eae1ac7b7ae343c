// model.h: the DeepSeek-family decoder (embeddings, attention MHA/GQA/MLA, dense SwiGLU or MoE FFN with
// shared experts, final norm, fused linear + cross-entropy head) with explicit forward and backward.
// All parameters live in one fp32 allocation, all gradients in another (llm.c style); bf16 copies (bf16
// compute only) and the packed expert weights are refreshed by sync_weights() after every optimizer step.
// GEMM operands and the activations saved for them are in the compute dtype (ComputeDtype: bf16, or fp32 on
// CPUs without native bf16); the residual stream, norms, softmax, router and losses are fp32 either way. Every activation
// buffer is allocated once at construction for the given micro-batch shape: nothing allocates in a step.
// Expert parallelism (ModelParallel::ep): the routed experts are sharded contiguously over the EP group
// (this rank holds experts [first_expert, first_expert + local_experts)); every MoE layer sends its routed
// rows to the experts' ranks with an EpDispatch (one per MoE layer, so that each layer's backward reuses
// its own forward layout) and combines them back. Everything else stays replicated. The trainer reduces
// the gradients (expert ones over the expert-data-parallel group).
// Not the trainer (no optimizer, no data).
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/ep_dispatch.h"
#include "moetron/param_layout.h"
#include "moetron/spec.h"
#include "moetron/tensor.h"

namespace moetron {

class Fsdp;
struct FsdpOptions;

struct ForwardStats {
  double ce_sum = 0;      // sum of per-token cross-entropy (unscaled) over valid targets
  int64_t ce_count = 0;   // valid targets
  double aux_loss = 0;    // router aux loss summed over MoE layers (coefficient included), in layer order
  double z_loss = 0;
  int64_t dropped = 0;    // tokens dropped by capacity
  // Per MoE layer (global MoE index; 0 for the layers this pass did not run): the router aux and z losses.
  // Pipeline stages report their layers here, so a step can fold the whole model's sum in layer order.
  std::vector<double> aux_by_layer, z_by_layer;
  // Multi-token prediction (model.mtp_layers = D; the head stage's): per depth, the sum of its cross-entropy over
  // its valid positions and their count, unweighted. The MTP loss is mtp_loss_weight * the mean over depths of
  // mtp_ce[k] / mtp_n[k]; ce_sum / ce_count stay the main model's alone.
  std::vector<double> mtp_ce;
  std::vector<int64_t> mtp_n;
};

// One pipeline stage this rank holds (include/moetron/pp_layout.h decides which): its global stage id, its
// decoder layers (ascending and contiguous, possibly none), whether it starts with the embedding and ends
// with the final norm + head + loss (and the MTP modules, model.mtp_layers, which live with the head), and how many micro-batches it keeps activations for at once (the
// schedule's peak in-flight count for the stage).
struct ModelStagePart {
  int stage = 0;
  std::vector<int64_t> layers;
  bool embedding = false, head = false;
  int slots = 1;
};

// How the model is split over ranks. ep null or of size 1: all experts local (no communication).
struct ModelParallel {
  const Comm* ep = nullptr;  // the expert-parallel group (copied; must outlive nothing)
  // Tensor parallelism with sequence parallelism (docs/parallel.md, "Tensor parallelism"): attention heads and FFN
  // widths (every expert's too: expert_tp = tp) divided over this group, the residual stream's rows too (each rank
  // holds micro-batch rows [r N / tp, (r + 1) N / tp)). Not with FSDP, the EP overlap, selective recompute or FP8.
  const Comm* tp = nullptr;
  // Context parallelism (docs/parallel.md, "Context parallelism in the trainer"): each sequence of the micro-batch
  // cut into 2 cp chunks, this rank holding chunks r and 2cp-1-r (cp_attention.h); attention is ring attention over
  // this group, every other block runs on the rank's tokens alone. The model takes the whole micro-batch's tokens
  // and targets and uses its own rows of them. seq_len must be divisible by 2 cp.
  const Comm* cp = nullptr;
  EpDispatcher dispatcher = EpDispatcher::AllToAll;
  EpTransport ep_transport = EpTransport::Mpi;
  bool fp8_dispatch = false;  // E4M3 1x128 dispatch payload (else bf16, which is exact: the experts
                              // consume bf16 rows anyway); combine and the backward rows stay fp32
  int ep_ranks_per_node = 0;  // EP ranks per node (0 = one node)
  const FsdpOptions* fsdp = nullptr;  // FSDP / ZeRO-3 mode (see the constructor)
  // Pipeline parallelism: this rank's stages, ascending stage ids (null or empty: the whole model as one
  // stage with one activation slot). Parameters, saved activations and dispatchers exist for these stages
  // only; parameter names stay global ("layers.7.attn.wo").
  const std::vector<ModelStagePart>* stages = nullptr;
  // The 1F1B all-to-all overlap: every EP dispatcher gets a communicator of its own (so two micro-batches'
  // exchanges can run at once) and the model a second execution lane (set_thread_lane). Needs MPI with
  // MPI_THREAD_MULTIPLE; not with FSDP or activation recompute.
  bool ep_overlap = false;
  // How the two lanes share the cores and the link ([parallelism] ep_baton, ep_link): the free lane order (else
  // strict turns) and the paced link (one exchange in flight per rank; needs the turns).
  bool ep_free_order = true;
  bool ep_paced_link = false;
  // The attention kernels' products under bf16 compute: Auto = bf16 where attention_bf16_preferred() (the
  // faster choice on this CPU), else fp32; BF16 / FP32 force one (BF16 needs bf16 compute). fp32 compute always
  // runs fp32 attention. The trainer takes [training] attention_dtype.
  ComputeDtype attention = ComputeDtype::Auto;
};

// training.compute_dtype for this machine: Auto -> BF16 where bf16 GEMMs are native (the kernels run at
// AVX-512 with AVX512-BF16 and oneDNN creates a bf16 matmul), else FP32. BF16 where it is not native throws,
// naming the missing CPU feature and the key to change. `why` (optional) gets the one-line reason.
ComputeDtype resolve_compute_dtype(ComputeDtype requested, std::string* why = nullptr);

class Model {
 public:
  // B sequences of T tokens per micro-batch (the shape every buffer is sized for). Collective over the EP
  // group when par.ep has more than one rank.
  // par.fsdp != nullptr: FSDP / ZeRO-3 mode (include/moetron/fsdp.h): no full parameter / gradient / bf16
  // buffers; every rank keeps its shards in fsdp(), and a unit (embedding, decoder layer, final norm + head)
  // is all-gathered into a slot before use and released after (its gradient reduce-scattered into the
  // gradient shard, accumulating over micro-batches). param_data() / grad_data() then return nullptr, and
  // forward, forward_backward and compute_logits are collective over the FSDP groups.
  // compute: the GEMM dtype (Auto resolves with resolve_compute_dtype).
  Model(const ModelSpec& spec, int64_t B, int64_t T, const ActivationCheckpointSpec& ac = {},
        const ModelParallel& par = {}, ComputeDtype compute = ComputeDtype::Auto);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelSpec& spec() const { return spec_; }
  ComputeDtype compute_dtype() const { return compute_; }  // resolved: BF16 or FP32
  bool attention_bf16() const;  // attention's products in bf16 (ModelParallel::attention resolved)
  const std::vector<ParamEntry>& params() const { return params_; }
  const ParamEntry& param(const std::string& name) const;
  int64_t num_params() const { return n_params_; }
  Fsdp* fsdp() { return fsdp_.get(); }  // nullptr unless FSDP mode
  float* param_data() { return pbuf_.defined() ? pbuf_.data<float>() : nullptr; }
  float* grad_data() {  // settles a step begun by begin_grads() first (settle_grads)
    settle_grads();
    return gbuf_.defined() ? gbuf_.data<float>() : nullptr;
  }
  const float* param_data() const { return pbuf_.defined() ? pbuf_.data<float>() : nullptr; }

  // Philox init keyed by (seed, parameter name): identical whatever the sharding.
  void init_params(uint64_t seed);
  // Refresh the bf16 weight copies and the packed expert weights from the fp32 masters.
  void sync_weights();
  // The optimizer step fused with the refresh: update(lo, hi) must apply the step to the master elements [lo, hi)
  // of the flat parameter buffer (and leave alone those it does not own); the model calls it once for every piece of
  // [0, num_params()) in offset order and refreshes the piece's compute copies right after, while its masters are
  // still in cache. The same bits as updating everything and then sync_weights(). Not for FSDP models (a unit is
  // refreshed where it is gathered).
  void update_and_sync(const std::function<void(int64_t lo, int64_t hi)>& update);
  // The refresh's pieces: at most `elems` flat elements (a piece of routed experts: whole experts, at least one);
  // kSyncPieceElems unless set (tests use small pieces to cut every tensor).
  static constexpr int64_t kSyncPieceElems = int64_t(1) << 19;
  void set_sync_piece_elems(int64_t elems);
  // Whole experts of expert_elems masters each in one piece of at most `piece` elements (at least one).
  static int64_t sync_experts_per_piece(int64_t expert_elems, int64_t piece = kSyncPieceElems) {
    return std::max<int64_t>(1, piece / std::max<int64_t>(expert_elems, 1));
  }
  void zero_grads();
  // A step's gradients without the zeroing pass: every parameter's gradient is marked unwritten instead; the first
  // weight-gradient GEMM that produces a whole parameter's gradient writes it (beta 0: the bits of adding to zeros),
  // any other writer finds it zeroed on first use (Impl::G), and settle_grads() zeroes what no one wrote. Call
  // settle_grads() before reading gradients through pointers taken earlier (grad_data() settles by itself). FSDP
  // models zero their shards at once.
  void begin_grads();
  void settle_grads() {
    if (grads_pending_) settle_pending_grads();
  }

  // One micro-batch: forward and backward, gradients accumulated (+=). tokens/targets are [B*T];
  // target -1 is ignored. ce_scale multiplies the cross-entropy gradient (e.g. 1 / valid tokens of the
  // whole step); aux_scale multiplies the router aux / z losses' gradients (e.g. 1 / micro-batches).
  ForwardStats forward_backward(const int32_t* tokens, const int32_t* targets, float ce_scale, float aux_scale);
  // Forward only (validation). forward_backward, forward and compute_logits need the whole model (no stages).
  ForwardStats forward(const int32_t* tokens, const int32_t* targets);

  // Aux-loss-free balancing state: per MoE layer bias [E] and the tokens-per-expert counts summed since
  // the last take_expert_counts() call. n_moe_layers() counts the local MoE layers; expert_bias takes a
  // global MoE index (one of local_moe_layers()); counts and updates are in local_moe_layers() order.
  int n_moe_layers() const;
  float* expert_bias(int moe_layer);
  std::vector<std::vector<int64_t>> take_expert_counts();
  // Apply the DeepSeek-V3 bias update with the given (possibly all-reduced) counts.
  void update_expert_bias(const std::vector<std::vector<int64_t>>& counts);

  // The logits of the last forward are not kept (loss fusion); for tests, compute them explicitly:
  // logits [B*T, V] for the given tokens, fp32, with the same compute-dtype weights the training path uses.
  void compute_logits(float* logits, const int32_t* tokens);

  int64_t tokens_per_micro_batch() const { return B_ * T_; }  // this rank's (its CP rows)
  int64_t residual_rows() const;  // rows of the activations between stages on this rank (its CP and TP share)

  // ---- pipeline stages (ModelParallel::stages; without them the whole model is local stage 0, 1 slot) ----
  // A stage's F / B / I / W for one micro-batch, with its activations in slot `slot` (< its slots). `in` /
  // `out` are the residual stream [B*T, d] fp32 entering / leaving the stage (in: null on the embedding
  // stage, which reads `tokens`; out: null on the head stage). The head stage's forward also runs the loss
  // backward (the fused head), keeping dL/dx in the slot until its backward; its head weight gradient is
  // added then. `targets` are read by the head stage only, `tokens` by the embedding stage only. The step's
  // loss scales come from set_loss_scales. stage_backward: `dout` = dL/d(out) (null on the head stage),
  // `din` = dL/d(in) out (null on the embedding stage, which adds the embedding gradient). weights = false
  // is the I half: the weight-gradient GEMMs are recorded (their operands copied into the slot's arena) and
  // run by stage_backward_weight (W), in the same order, so the gradients are bitwise those of the full B.
  // Statistics (loss, aux, z, dropped, expert counts) are the stage's share.
  int n_stages() const;  // local stages
  const ModelStagePart& stage_part(int local) const;
  void set_loss_scales(float ce_scale, float aux_scale);
  ForwardStats stage_forward(int local, int slot, const int32_t* tokens, const int32_t* targets, const float* in,
                             float* out, bool backward = true);
  void stage_backward(int local, int slot, const int32_t* tokens, const float* dout, float* din, bool weights = true);
  void stage_backward_weight(int local, int slot);
  bool holds_embedding() const;  // the embedding stage is local
  bool holds_head() const;       // the head stage is local
  bool holds_layer(int64_t layer) const;
  // Tied embeddings: the head's weight gradient accumulates in a buffer of its own [V, d], not in the
  // embedding's. fold_tied_head_grad adds it into the embedding gradient and zeroes it (FSDP mode folds it
  // into the unit's gradient at every embedding backward instead, before the reduce-scatter). forward_backward folds after every call; a pipeline step folds once
  // after the step (the pipeline trainer moves it between the first and the last stage's ranks), so the
  // embedding gradient is (embedding rows of every micro-batch) + (head gradient of every micro-batch)
  // whatever the layout. nullptr when not tied, in FSDP mode, or without the head stage.
  float* tied_head_grad();
  void fold_tied_head_grad();
  // Lanes (ModelParallel::ep_overlap): the stage calls of a thread run on its lane, 0 (the default) or 1. Two
  // threads may run stage calls at once only on different lanes, for different slots, and lane 1 runs
  // backwards only (forwards count the routing on lane 0).
  static void set_thread_lane(int lane);
  // Around one FB pair run on the two lanes: the lanes take turns (lane 0 first), handing over at every EP
  // exchange and when a half ends, in the same order on every EP rank.
  // The EP overlap's fill (parallelism.ep_pair_backward = "iwfill"): a pair's backward lane runs its recorded weight
  // gradients while it waits in an exchange and the other lane does not compute. Needs ep_overlap, free order.
  // carry ("iwcarry"): every backward (paired or alone) records its weight gradients and
  // carries them; later exchange waits on either lane run the oldest first (inside a pair when no lane computes),
  // a slot's reuse runs those up to it, and flush_carried_wgrads() runs what is left (the executor, at a step's end).
  void set_ep_wgrad_fill(bool on, bool carry = false);
  bool ep_wgrad_fill_possible() const;  // ep_overlap with the free lane order and no [quantize]
  void flush_carried_wgrads();
  void begin_overlap_pair();
  void end_overlap_pair();
  bool has_lanes() const { return lane1_ != nullptr; }

  // Global MoE indices of the local MoE layers, ascending (all of them without pipeline stages).
  std::vector<int> local_moe_layers() const;
  int n_moe_layers_total() const;

  // Expert parallelism: EP group size and this rank's experts.
  int ep_size() const;
  int first_expert() const;
  int local_experts() const;  // routed experts held here (all of them without EP)
  // This rank's EP traffic since construction, summed over the MoE layers' dispatchers and over dispatch,
  // combine and the backward's row moves (zeros without EP), and the bytes of the dispatchers' buffers.
  EpTraffic ep_traffic() const;
  int64_t ep_buffer_bytes() const;
  // This rank's measured EP waiting since construction (zeros without EP): wait_seconds = the union of the wall
  // intervals some lane spent inside an exchange; exposed_seconds = the part of it during which no lane
  // computed (without the all-to-all overlap, all of it); exposed_paired_seconds = the part of that inside
  // overlapped F&B pairs (the rest: actions that ran alone). wgrad_fill_*: the weight gradients a lane ran inside
  // its own exchange waits (parallelism.ep_pair_backward = "iwfill" or "iwcarry"), their count and seconds. Call between passes, not
  // while one runs.
  struct EpExposed {
    double wait_seconds = 0, exposed_seconds = 0, exposed_paired_seconds = 0;
    int64_t wgrad_fill_tasks = 0;
    double wgrad_fill_seconds = 0;
  };
  EpExposed ep_exposed() const;
  // Routing skew under EP, over this rank's MoE layers (the largest over a layer's activation slots): the most
  // rows one dispatch brought (peak) and the rows the layer's buffers hold (held), summed, against the balanced
  // tokens x topk per layer (balanced). Zeros without EP.
  struct EpRows {
    int64_t peak = 0, held = 0, balanced = 0;
  };
  EpRows ep_rows() const;

  // ---- FP8 training ([quantize]; docs/fp8.md; src/model/model_fp8.cpp) ----
  // The chosen linears (attention projections, dense MLP, shared experts, routed experts) run forward, dgrad and
  // wgrad as FP8 GEMMs with q's recipe; recipe none (the default) is the plain compute-dtype path, unchanged.
  // Call after construction, before the first pass.
  void set_quantize(const QuantizeSpec& q);
  const QuantizeSpec& quantize() const;
  int64_t fp8_sites() const;  // quantized parameters of the whole model
  // Tests: every FP8 GEMM replaced by gemm_f32 of its dequantized operands (the twin the FP8 GEMM equals).
  void set_fp8_twin(bool on);
  // Per module (attention, dense_mlp, shared_experts, routed_experts, those present): the step's largest amax
  // and the smallest / largest scale used, per operand (0 = X, 1 = W, 2 = dY); 0 where nothing was quantized.
  struct Fp8Stat {
    std::string module;
    float amax[3], scale_min[3], scale_max[3];
  };
  // After every optimizer step (collective over `world`, every rank of the job): the step's amaxes gathered over
  // the ranks (max) and, with delayed scaling, pushed into the histories the next step's scales come from. The
  // per-module statistics of the step. Empty without FP8.
  std::vector<Fp8Stat> fp8_end_step(const Comm& world);
  // Delayed scaling's state for checkpoints: every site's three histories, oldest first ([sites, 3, len]; empty
  // with current scaling), and its restore (bitwise: the next scales are the same).
  std::vector<float> fp8_history() const;
  void set_fp8_history(const std::vector<float>& h);

  // Tools (bench/bench_fp8_real.cpp): the fp32 operands of the dense linear `param` (a 2-D weight of the
  // attention, dense MLP or shared experts) in the following passes: X [rows, in] and W [in, out] from its
  // forward, dY [rows, out] from its dgrad (the last micro-batch's). "" stops capturing.
  struct LinearOperands {
    std::vector<float> x, w, dy;
    int64_t rows = 0, in = 0, out = 0;
  };
  void capture_linear(const std::string& param);
  const LinearOperands& captured_linear() const;

  // Time spent in recompute and bytes saved by activation checkpointing (0 when off).
  double recompute_seconds() const { return recompute_s_; }

  struct Impl;

 private:
  ModelSpec spec_;
  ActivationCheckpointSpec ac_;
  int64_t B_, T_;          // T_: this rank's tokens per sequence (seq_len / cp)
  int64_t seq_len_ = 0;     // the whole sequence (the tokens / targets the stage calls take)
  ComputeDtype compute_;
  std::vector<ParamEntry> params_;
  int64_t n_params_ = 0;
  Tensor pbuf_, gbuf_;
  std::vector<uint8_t> grad_unwritten_;  // per parameter, during a step begun by begin_grads()
  bool grads_pending_ = false;           // some grad_unwritten_ may be set
  void settle_pending_grads();
  int64_t sync_piece_elems_ = kSyncPieceElems;
  void plan_sync_pieces();       // Impl::sync_pieces, once
  void refresh_piece(size_t k);  // the compute copies made from piece k
  std::unique_ptr<Fsdp> fsdp_;
  double recompute_s_ = 0;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<Impl> lane1_;  // ep_overlap: the second execution lane
  Impl& lane();                  // this thread's lane
  friend struct Impl;
};

}  // namespace moetron
