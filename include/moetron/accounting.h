// accounting.h: THE parameter, FLOP and saved-activation accounting of a ModelSpec, and the per-rank
// memory estimate of a training job built on it. One implementation, read by `moetron model info`, by
// the planner (memory projection, cost model) and by the engine, whose allocations are checked against
// it (the start-up memory check, include/moetron/memcheck.h). Not a planner: no search over layouts, no
// hardware catalog.
//
// Conventions (docs/model.md):
//   params  - every weight, norms included; attention-internal norms (MLA q_a/kv_a norms, qk_norm) count
//             as attention; the two per-layer RMSNorms count as norms; the router counts its gate matrix
//             [E, d] plus, with aux_free balancing, its per-expert bias [E].
//   active  - the weights a token touches: routed experts count topk of E. `active` includes the input
//             embedding table and the output head (the convention of the DeepSeek and Mixtral papers:
//             37B, 21B, 12.9B); `active_no_embed` leaves out the input embedding (a lookup, no FLOPs).
//   flops   - model FLOPs per token for one training step = 3 x forward (backward = 2 x forward).
//             forward = 2 x (matmul weights a token touches, head included, embedding excluded)
//                     + attention core: 2*H*(dqk + dv) x context per layer, where context is the average
//                       number of keys a query sees: (seq_len + 1) / 2 with causal masking (the default),
//                       seq_len without. Recompute is NOT in model FLOPs (see hw_train).
//   saved activations - per layer per micro-batch, a list of named terms (tensor name, bytes) that the
//             layer's forward keeps for its backward, given precision and activation checkpointing. The
//             dense MLP keeps its first GEMM's output (SwiGLU: gate and up, "mlp.gate_up"; GELU: "mlp.up")
//             and the activation; with model.dropout > 0 each dropout keeps a 1-byte mask per element
//             ("*.dropout_mask": embedding, attention output, FFN output; the attention probabilities'
//             dropout keeps none, the fused attention regenerates it).
//   memory  - per rank, by the MemoryTracker's categories (memory.h): what the trainer allocates for a
//             JobConfig under its parallel layout (dp, ep, zero), in double arithmetic (no overflow).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/spec.h"

namespace moetron {

// ---- parameters ----------------------------------------------------------------------------------
struct LayerParams {
  int64_t attention = 0;
  int64_t norms = 0;       // attn_norm + ffn_norm
  int64_t dense_mlp = 0;
  int64_t router = 0;
  int64_t routed_experts = 0;  // all E experts
  int64_t shared_experts = 0;
  int64_t routed_active = 0;   // topk experts' worth
  bool moe = false;
  int64_t total() const { return attention + norms + dense_mlp + router + routed_experts + shared_experts; }
  int64_t active() const { return attention + norms + dense_mlp + router + routed_active + shared_experts; }
  // Weights used as GEMM operands (norms and norm-like vectors excluded): the FLOP base.
  int64_t matmul_active = 0;
};

struct ParamCounts {
  std::vector<LayerParams> layers;
  int64_t embedding = 0;   // [V, d]
  int64_t head = 0;        // [V, d], 0 when tied
  int64_t final_norm = 0;  // [d]
  int64_t total = 0;
  int64_t active = 0;           // incl. input embedding and head
  int64_t active_no_embed = 0;  // excl. input embedding (incl. head, or the tied table once)
  int64_t dense_part = 0;       // everything but the routed experts (replicated under EP)
  int64_t routed_experts = 0;   // sum over layers of all routed experts (sharded under EP)
  // Multi-token prediction (model.mtp_layers, in total / active / dense_part / routed_experts): per depth one block
  // of the last layer's kind plus enorm, hnorm, eh_proj [2d, d] and its norm; the embedding and head are shared.
  // Not in `layers` (the decoder layers only). The memory estimate and the planner do not count them yet.
  int64_t mtp = 0;
};

// Parameters of one expert (always SwiGLU: gate, up, down; model.ffn is the dense MLP's kind).
int64_t expert_params(const ModelSpec& s);
LayerParams layer_params(const ModelSpec& s, int64_t layer);
ParamCounts count_params(const ModelSpec& s);

// ---- FLOPs ----------------------------------------------------------------------------------------
struct FlopsPerToken {
  double fwd_matmul = 0;     // 2 x active matmul weights (layers + head)
  double fwd_attention = 0;  // QK^T and PV, at the given seq_len and masking
  double fwd() const { return fwd_matmul + fwd_attention; }
  double train = 0;          // 3 x fwd: MODEL FLOPs per token (MFU numerator)
  double hw_train = 0;       // train + the forward work recomputed under activation checkpointing
  std::vector<double> layer_fwd;  // per layer forward FLOPs per token (matmul + attention)
};
FlopsPerToken flops_per_token(const ModelSpec& s, int64_t seq_len, bool causal = true,
                              const ActivationCheckpointSpec& ac = {});

// ---- saved activations ----------------------------------------------------------------------------
struct ActTerm {
  std::string name;  // e.g. "attn.q", "moe.gate_up"
  int64_t bytes = 0;
};
struct LayerActivations {
  int64_t layer = -1;  // -1 for the model-level terms (embedding, final norm, loss)
  std::vector<ActTerm> terms;
  int64_t total() const;
};
struct ActivationBytes {
  std::vector<LayerActivations> layers;  // saved between forward and backward, per layer
  LayerActivations outside;              // embedding ids, final norm, loss
  int64_t total = 0;                     // sum of the above
  // Largest set of terms re-materialized at once while recomputing a fully checkpointed layer
  // (0 without full checkpointing): it adds to the peak during that layer's backward.
  int64_t recompute_transient = 0;
};
// ---- cached FP8 activations ([quantize] cache_fp8_activations; docs/fp8.md "Cached FP8 activations") ----------
// An activation [rows, cols] kept for its weight gradient as the FP8 operand of its forward GEMM (quantized along
// cols): 1 byte per code plus the recipe's scales. tensorwise: one fp32 per group (the routed experts quantize
// each expert's rows on their own: groups = experts; a dense linear: 1); rowwise: one fp32 per row; blockwise:
// one fp32 per 1 x 128 tile; mxfp8: one E8M0 byte per 1 x 32 tile. THE sizes: the engine allocates its caches
// with them (src/model/model_fp8.cpp).
int64_t fp8_cached_scales(Fp8Recipe r, int64_t rows, int64_t cols, int64_t groups);
int64_t fp8_cached_scale_bytes(Fp8Recipe r);  // 1 (mxfp8, E8M0) or 4 (fp32)
int64_t fp8_cached_bytes(Fp8Recipe r, int64_t rows, int64_t cols, int64_t groups);
// Which linears' inputs the engine keeps as FP8 for `q` (false for all when cache_fp8_activations is off). Only
// inputs whose high-precision buffer has no other reader in the backward are cached: the attention projections
// that read the normed input (wqkv; MLA wq / wdq, wdkv, wkr) and MLA's normed latents (wuq, wukv); a dense layer's
// w13 (the ffn norm output) and w2 (the SwiGLU output); the shared experts' w2; the routed experts' w13 (the
// permuted rows) and w2. Not cached: the output projection wo (its input is the attention output, which the
// attention backward reads) and the shared experts' w13 (its input is the ffn norm output, which the router's
// weight gradient reads).
struct Fp8CachePlan {
  Fp8Recipe recipe = Fp8Recipe::None;
  bool attention = false, dense_mlp = false, shared_experts = false, routed_experts = false;
  bool any() const { return attention || dense_mlp || shared_experts || routed_experts; }
};
Fp8CachePlan fp8_cache_plan(const QuantizeSpec& q);

// Bytes per micro-batch (micro_batch_size sequences of seq_len tokens) on one rank holding all layers.
// With expert parallelism the routed-expert rows a rank holds are the same on average (T*topk).
ActivationBytes activation_bytes(const ModelSpec& s, int64_t micro_batch, int64_t seq_len, Precision p,
                                 const ActivationCheckpointSpec& ac = {});
// The terms one layer saves under `ac` (pass {} for none: what a full recompute re-materializes).
LayerActivations layer_activation_terms(const ModelSpec& s, int64_t layer, int64_t micro_batch,
                                        int64_t seq_len, Precision p, const ActivationCheckpointSpec& ac);
// The same with explicit element sizes (a: activations, g: GEMM inputs), and the engine's convention: its
// activations are fp32 (the residual stream, norm inputs and GEMM outputs) whatever the compute dtype, its GEMM
// inputs are `compute_bytes` (2 = bf16, 4 = fp32).
ActivationBytes activation_bytes_sized(const ModelSpec& s, int64_t micro_batch, int64_t seq_len, int64_t a, int64_t g,
                                       const ActivationCheckpointSpec& ac = {}, const Fp8CachePlan& f8 = {});
ActivationBytes engine_activation_bytes(const ModelSpec& s, int64_t micro_batch, int64_t seq_len,
                                        int64_t compute_bytes, const ActivationCheckpointSpec& ac = {},
                                        const Fp8CachePlan& f8 = {});
// The engine's buffers per layer and micro-batch of `tokens` that the term list does not have (with bf16 compute
// the fp32 ffn_norm and attention outputs beside their bf16 copies, MLA's k_nope, the router logits, row maps
// and counters), as estimate_memory counts them; 0 for a fully recomputed layer.
double engine_activation_extras(const ModelSpec& s, int64_t layer, double tokens, const ActivationCheckpointSpec& ac,
                                int64_t compute_bytes, const Fp8CachePlan& f8 = {});
// One layer's saved buffers under tensor parallelism (tp > 1, sequence parallel) as the engine allocates them, for a
// micro-batch of N tokens (this rank's CP share): the layer input's N / tp rows (input = true; a fully recomputed
// layer keeps only that), the gathered norm outputs, the rank's heads and widths, the router on every row.
double engine_tp_layer_bytes(const ModelSpec& s, bool moe, double N, double tp, int64_t compute_bytes,
                             bool input = true);
// Of those, a MoE layer's buffers with one entry per routed row (N * topk): they follow the routing imbalance.
double engine_tp_routed_row_bytes(const ModelSpec& s, double N, double tp, int64_t compute_bytes);
// The final norm's buffers under TP for N tokens: its input and rstd on the rank's N / tp rows, its output on all N.
double engine_tp_final_norm_bytes(const ModelSpec& s, double N, double tp, int64_t compute_bytes);
// One MoE layer's routed-expert weights packed for the grouped GEMMs (forward and dgrad layouts of gate/up and down,
// in the compute dtype, with the kernels' tile padding) on a rank holding E / ep experts of width moe_inter / etp.
double engine_packed_expert_bytes(const ModelSpec& s, int64_t ep, int64_t etp, int64_t compute_bytes);
// Convenience: everything from a JobConfig (training.micro_batch_size, seq_len, dtype and the
// [activation_checkpoint] section).
ActivationBytes activation_bytes(const JobConfig& c);

// Rows a MoE layer feeds to its routed experts for T tokens: T*topk when dropless, otherwise
// E * ceil(capacity_factor * T * topk / E).
int64_t routed_rows(const ModelSpec& s, int64_t tokens);

// The same total as activation_bytes (every term, layers and outside) in double arithmetic, with explicit
// element sizes (act: activations, gemm: GEMM inputs), and the largest single term. For size checks that
// must not overflow: JobConfig::validate bounds it before any int64 figure is formed.
struct ActivationSize {
  double total = 0;
  double largest_bytes = 0;
  std::string largest;  // term name, e.g. "moe.gate_up"
};
ActivationSize activation_size(const ModelSpec& s, int64_t micro_batch, int64_t seq_len, int64_t act_bytes,
                               int64_t gemm_bytes, const ActivationCheckpointSpec& ac = {});
// "model.d_model = 7168, ..." : the config keys (with their values) that a term's width comes from.
std::string activation_term_keys(const ModelSpec& s, const std::string& term);

// ---- sharded activations: the planner's GPU convention ---------------------------------------------
// The same term list, divided over a GPU layout: cp splits the sequence; with sequence parallelism (sp) the
// token-parallel regions (norms, residual, router, dispatched rows) split over tp too; head- and width-split
// tensors over tp; routed experts' widths over etp (their rows gathered over etp). The planner calls these
// with a = 2 (bf16 activations and GEMM outputs, Megatron / Transformer Engine) and g = the GEMM-input bytes
// (2, or 1 under an FP8 recipe); the engine's figures are the same functions at a = 4, all divisors 1.
struct ActShard {
  int64_t tp = 1;
  bool sp = false;
  int64_t cp = 1;
  int64_t etp = 1;
  int64_t token_div() const { return sp ? tp : 1; }  // what divides the token-parallel regions
};
using TermFn = void (*)(void* ctx, const char* name, double bytes);
// One layer's kept terms per micro-batch of B sequences of S tokens under `ac` (applies_to(layer) decides).
// f8: the inputs kept as FP8 operands (the engine's cache_fp8_activations; {} = none).
void sharded_layer_terms(const ModelSpec& s, int64_t layer, double B, double S, double a, double g,
                         const ActivationCheckpointSpec& ac, const ActShard& sh, TermFn fn, void* ctx,
                         const Fp8CachePlan& f8 = {});
double sharded_layer_bytes(const ModelSpec& s, int64_t layer, double B, double S, double a, double g,
                           const ActivationCheckpointSpec& ac, const ActShard& sh, const Fp8CachePlan& f8 = {});
// Every term of the layer (what a full recompute re-materializes at once during its backward).
double sharded_layer_bytes_all(const ModelSpec& s, int64_t layer, double B, double S, double a, double g,
                               const ActShard& sh, const Fp8CachePlan& f8 = {});
// The last stage's terms (final norm, head input, loss). fused_loss = false adds the logits (g bytes) and the
// fp32 softmax the unfused vocab-parallel cross-entropy keeps, T x V / tp each. The first stage's embedding
// ids: "embed.ids".
void sharded_outside_terms(const ModelSpec& s, double B, double S, double a, double g, const ActShard& sh,
                           bool fused_loss, bool first, bool last, TermFn fn, void* ctx);

// ---- per-rank memory of a training job ------------------------------------------------------------
// What one rank of the trainer holds at its peak, by MemoryTracker category, for the layout in
// c.parallelism (dp = dp_replicate * dp_shard, ep, zero) and one micro-batch of c.training:
//   params      - fp32 parameters + their bf16 copy (bf16 compute only) + the packed expert weights (two
//                 layouts in the compute dtype) + the aux-free expert biases; under ep a rank holds E / ep
//                 experts per MoE layer; zero = 3: the fp32 shard (1/dp) plus the gathered unit slot(s)
//                 (two with tied embeddings);
//   grads       - fp32, local layout (zero = 3: shard + slot);
//   optimizer   - AdamW m and v, fp32 (zero = 1 or 3: 1/dp of all parameters);
//   activations - what the engine keeps for the backward of one micro-batch: the saved-activation terms
//                 with fp32 activations (the residual stream, norm inputs and GEMM outputs are fp32
//                 whatever the compute dtype) and GEMM inputs of `compute_bytes` (2 = bf16, 4 = fp32: the
//                 resolved training.compute_dtype), plus the engine's extra buffers; checkpointed layers
//                 keep their input and share one set of buffers per layer kind (full) or per recomputed
//                 module (selective);
//   workspace   - backward scratch, RoPE tables and the largest kernel workspace (chunked loss, attention,
//                 router, grouped GEMMs);
//   comm        - DP all-reduce / FSDP reduce-scatter workspace, EP dispatch buffers (approximate).
// Not counted: allocations the tracker does not see (the process itself, data loader, oneDNN caches).
struct MemoryEstimate {
  double params = 0, grads = 0, optimizer = 0, activations = 0, workspace = 0, comm = 0;
  // The config keys (with values) that drive the categories, for messages.
  std::string param_keys;       // params, grads, optimizer: the largest parameter part and the sharding
  std::string activation_keys;  // micro-batch, seq_len, n_layers, the largest term's width, checkpointing
  std::string workspace_keys;   // micro-batch, seq_len and the widest scratch
  // Bytes held while the model is built, when that is above the training peak: with selective recompute
  // the engine allocates every layer's full buffer set before the recomputed modules share theirs (about:
  // params and grads as above plus those sets). 0 otherwise.
  double build_peak = 0;
  double total() const { return params + grads + optimizer + activations + workspace + comm; }
  double peak() const { return std::max(total(), build_peak); }
};
// `threads`: the OpenMP threads of one rank (kernel workspaces have a part per thread). The grouped GEMM's
// packing and workspace sizes, the attention workspace and the loss chunk come from kernel_sizes.h, the same
// arithmetic the kernels size their buffers with. For a validated config.
MemoryEstimate estimate_memory(const JobConfig& c, int64_t compute_bytes, int threads);

}  // namespace moetron
