// spec.h: ModelSpec, the one description of a model's shape that the engine, the accounting and the
// planner all read. Plain structs with validation; HF config.json import/export is declared here too.
// Not a layer implementation and not a config loader (see config.h for TOML + overrides).
//
// Conventions (docs/model.md has the long form):
//   - layer l is dense (an MLP of width inter_size) when n_routed_experts == 0, when l < first_k_dense,
//     or when l is listed in dense_layers; otherwise it is an MoE layer;
//   - the dense MLP is SwiGLU (gate, up, down; three matrices) or, for GPT-style dense models (ffn = gelu),
//     GELU (up d -> inter_size, down inter_size -> d; two matrices, no gate); experts are always SwiGLU;
//     no biases anywhere;
//   - dropout (GPT-style, probability `dropout`) after the embedding, the attention block and the FFN, and on
//     the attention probabilities; 0 = none (DeepSeek). The engine runs neither gelu nor dropout: they are
//     described so that the accounting and the planner can project dense GPT runs (docs/planner.md);
//   - attention mha / gqa: q [d -> H*hd], k,v [d -> Hkv*hd], o [H*hd -> d], RoPE on the full head_dim;
//     mla (DeepSeek-V2/V3): q via q_lora_rank (0 = plain q projection), kv via kv_lora_rank, decoupled
//     RoPE part of width qk_rope_head_dim shared by all heads;
//   - multi-token prediction (DeepSeek-V3, mtp_layers = D > 0): D sequential MTP modules after the main model,
//     each one transformer block of the last layer's kind (docs/model.md, "Multi-token prediction"). The blocks
//     are numbered after the layers: block b in [0, n_blocks()) is layer b for b < n_layers, else MTP depth
//     b - n_layers + 1.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moetron {

enum class AttnType : uint8_t { MHA, GQA, MLA };
enum class ScoreFunc : uint8_t { Softmax, Sigmoid };
enum class LoadBalance : uint8_t { None, AuxLoss, AuxFree };
enum class DropPolicy : uint8_t { Probs, Position };
// The aux-free bias update: DeepSeek-V3's fixed step in the sign of the load error, or a step proportional to
// the load error over the balanced load, clipped to [-1, 1] (router.h, router_update_bias_proportional).
enum class BiasUpdate : uint8_t { Sign, Proportional };
enum class FfnKind : uint8_t { SwiGLU, GELU };
enum class AttnImpl : uint8_t { Flash, Unfused };
// The routed experts' activation: SwiGLU, or GPT-OSS's clamped SwiGLU with the down projection's bias (planned only).
enum class ExpertAct : uint8_t { SwiGLU, ClampedSwiGLU };

std::string_view to_string(AttnType v);
std::string_view to_string(ScoreFunc v);
std::string_view to_string(LoadBalance v);
std::string_view to_string(DropPolicy v);
std::string_view to_string(BiasUpdate v);
std::string_view to_string(FfnKind v);
std::string_view to_string(AttnImpl v);
std::string_view to_string(ExpertAct v);

struct AttentionSpec {
  AttnType type = AttnType::MHA;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;  // mha: == n_heads (0 = n_heads); gqa: divides n_heads; mla: unused (kept 0)
  int64_t head_dim = 0;    // mha/gqa (0 = d_model / n_heads); mla: unused (kept 0)
  bool qk_norm = false;    // RMSNorm with learned [head_dim] weights on q and on k (Qwen3); not for mla
  // MLA only.
  int64_t q_lora_rank = 0;  // 0 = no q compression (DeepSeek-V2-Lite)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  // Per-head widths, whatever the type.
  int64_t qk_head_dim() const { return type == AttnType::MLA ? qk_nope_head_dim + qk_rope_head_dim : head_dim; }
  int64_t v_dim() const { return type == AttnType::MLA ? v_head_dim : head_dim; }
  int64_t kv_heads() const { return type == AttnType::MLA ? n_heads : n_kv_heads; }
  bool operator==(const AttentionSpec&) const = default;
};

struct MoESpec {
  int64_t n_routed_experts = 0;  // 0 = dense model (every layer dense)
  int64_t n_shared_experts = 0;
  int64_t moe_inter_size = 0;    // ffn width of one routed (and one shared) expert
  int64_t topk = 0;
  ScoreFunc score_func = ScoreFunc::Softmax;
  int64_t n_group = 1;     // group-limited routing: experts split in n_group groups (1 = off)
  int64_t topk_group = 1;  // ... a token may use experts of at most topk_group groups
  bool norm_topk_prob = false;
  double route_scale = 1.0;  // multiplies the combine weights (DeepSeek routed_scaling_factor)
  LoadBalance load_balance = LoadBalance::AuxLoss;
  double aux_coef = 0.001;         // balance loss coefficient (aux_loss; complementary loss with aux_free)
  bool aux_seq_wise = false;       // balance loss per sequence (DeepSeek "seq_aux") rather than per batch
  double bias_update_rate = 0.001; // aux_free: step of the per-expert bias update
  BiasUpdate bias_update = BiasUpdate::Sign;
  // > 0: the top-k selects on the scores scaled to equal column sums over the micro-batch's tokens by this many
  // Sinkhorn iterations (router.h; Megatron-LM's "sinkhorn"); weights and losses keep the scores. 0 = off.
  int64_t sinkhorn_iters = 0;
  // > 0 (>= 1): capacity routing: in token order, a token's top-k skips the experts that already hold
  // ceil(route_capacity * N * topk / E) of the micro-batch's N tokens' assignments (router.h). 0 = off.
  double route_capacity = 0.0;  // aux_free: the step's form (sign of the load error, or proportional)
  double z_loss_coef = 0.0;
  double capacity_factor = 0.0;    // 0 = dropless
  // clamped_swiglu: GPT-OSS's experts (out = (up + 1) * g * sigmoid(1.702 g), g = min(gate, 7), up clamped to
  // [-7, 7], and a bias on the down projection). The accounting counts its parameters as SwiGLU's (the biases,
  // 0.03 % of GPT-OSS, are left out); the planner prices Megatron-Core's implementation of it (plan/cost.cpp); the
  // engine and HF export refuse it.
  ExpertAct expert_act = ExpertAct::SwiGLU;
  DropPolicy drop_policy = DropPolicy::Probs;
  bool operator==(const MoESpec&) const = default;
};

struct ModelSpec {
  int64_t vocab_size = 0;
  int64_t d_model = 0;
  int64_t n_layers = 0;
  int64_t first_k_dense = 0;          // the first k layers are dense ...
  std::vector<int> dense_layers;      // ... or an explicit list of dense layer ids (not both)
  int64_t inter_size = 0;             // dense ffn width
  FfnKind ffn = FfnKind::SwiGLU;      // the dense MLP: swiglu (gate, up, down) or gelu (up, down)
  double dropout = 0.0;               // dropout probability (embedding, attention, FFN outputs, attention probs)
  // The core attention's implementation: flash (fused, tiled; the engine's) or unfused (Megatron-LM 2021-22:
  // batched score GEMMs, a fused scale-mask-softmax and a dropout over the materialized [b, a, s, s] scores).
  // Planned only: the engine refuses unfused.
  AttnImpl attention_impl = AttnImpl::Flash;
  double norm_eps = 1e-6;
  bool tie_embeddings = false;
  double init_std = 0.02;
  double rope_theta = 10000.0;
  AttentionSpec attn;
  MoESpec moe;
  // DeepSeek-V3 multi-token prediction: D MTP depths (0 = none) and the weight of their loss (the mean over depths
  // of each depth's mean cross-entropy, times this, added to the main loss). Default 0.3: DeepSeek-V3's weight for
  // its first 10T tokens (0.1 after).
  int64_t mtp_layers = 0;
  double mtp_loss_weight = 0.3;

  bool is_moe() const { return moe.n_routed_experts > 0; }
  bool is_moe_layer(int64_t layer) const;
  int64_t n_moe_layers() const;  // of the main model (the MTP blocks not counted)
  int64_t n_dense_layers() const { return n_layers - n_moe_layers(); }
  // Blocks: the main layers, then one per MTP depth (of the last layer's kind: MoE when it is MoE).
  int64_t n_blocks() const { return n_layers + mtp_layers; }
  bool is_moe_block(int64_t b) const { return is_moe_layer(b < n_layers ? b : n_layers - 1); }
  int64_t n_moe_blocks() const { return n_moe_layers() + (n_layers > 0 && is_moe_layer(n_layers - 1) ? mtp_layers : 0); }

  // Fill derived defaults (n_kv_heads, head_dim for mha/gqa) so that the stored spec is explicit.
  void resolve();
  // Throws moetron::Error naming the offending key ("model.topk: ...") for impossible values.
  void validate() const;
  bool operator==(const ModelSpec&) const = default;
};

// ---- Hugging Face config.json ----------------------------------------------------------------------
// Supported model_type: deepseek (DeepSeekMoE V1), deepseek_v2, deepseek_v3 (num_nextn_predict_layers is
// mtp_layers), mixtral, qwen3_moe. Returns a resolved, validated spec.
ModelSpec model_spec_from_hf_json(std::string_view json_text, std::string_view source = "config.json");
ModelSpec load_hf_config(const std::string& path);
// The inverse. Chooses deepseek_v3 (mla + sigmoid), deepseek_v2 (mla), deepseek (mha/gqa with shared
// experts or dense layers), qwen3_moe (qk_norm), mixtral (otherwise); throws if the spec is not
// expressible in any of them. model_spec_from_hf_json(to_hf_config_json(s)) == s for the model fields
// those formats carry.
std::string to_hf_config_json(const ModelSpec& s);

}  // namespace moetron
