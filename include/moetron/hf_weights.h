// hf_weights.h: the name and layout mapping between moetron parameters and Hugging Face checkpoints
// (model.safetensors + config.json) for the model types to_hf_config_json chooses: deepseek (V1,
// MHA/GQA), deepseek_v2 / deepseek_v3 (MLA), mixtral and qwen3_moe. Export (moetron -> HF) and import
// (HF -> moetron) are exact inverses: both walk the same HfWeightMap, so an f32 round trip is bitwise
// (one exception: the DeepSeek-V3 routing bias is exported shifted, see below).
// Not a converter for other architectures, not a tensor library, and no FP8 (block-scaled) HF weights:
// import accepts F32 and BF16 tensors only. docs/hf_export.md has the full mapping table.
//
// Layout differences the map handles:
//   - moetron stores Linear weights input-major [in, out]; HF stores them [out, in] (transposed);
//     the embedding and the head are [V, d] on both sides (copied);
//   - fused moetron tensors are split: wqkv -> q_proj | k_proj | v_proj; w13 -> gate_proj | up_proj;
//     [E, in, out] expert tensors -> one HF tensor per expert; MLA wdkv and wkr are concatenated into
//     kv_a_proj_with_mqa [rkv + dr, d];
//   - RoPE: moetron rotates half-split pairs (i, i + R/2) (rope.h). HF Llama / Mixtral / Qwen3 /
//     DeepSeek V1 do the same (rotate_half): no permutation. HF DeepSeek-V2/V3 MLA code first
//     de-interleaves q_pe / k_pe (element 2i -> i, 2i+1 -> i + R/2) and then applies rotate_half, so
//     their projections emit the rotary dims interleaved. On export the rotary output rows of q_b_proj
//     (or q_proj; per head, the last dr rows) and the k_pe rows of kv_a_proj_with_mqa are permuted:
//         HF row 2i   <- moetron rotary dim i
//         HF row 2i+1 <- moetron rotary dim i + dr/2          (i < dr/2), and the inverse on import.
//   - the aux-loss-free expert bias (checkpoint tensor expert_bias.<moe layer index>) is DeepSeek-V3's
//     mlp.gate.e_score_correction_bias, exported as bias - min(bias) when min(bias) < 0: transformers'
//     V3 router masks the experts of unselected groups with 0.0, so a negative biased score could lose
//     to a masked expert; a common shift leaves moetron's routing unchanged and keeps every biased score
//     positive. Import copies it. With load_balance != aux_free moetron routes without the bias, so the
//     V3 tensor is written as zeros. The other formats have no such tensor (export drops it, with a note
//     when moetron routes with it and it is non-zero; import sets it to zero).
//   - DeepSeek-V2/V3 without shared experts: config.json says n_shared_experts = 0 and the shared-expert
//     tensors are written empty ([0, d] and [d, 0]), as transformers builds them.
//   - multi-token prediction (deepseek_v3 only, model.mtp_layers = D): depth k + 1 is HF decoder layer
//     n_layers + k (num_nextn_predict_layers = D): enorm, hnorm, eh_proj [d, 2d] (the transpose of the
//     engine's mtp.<k>.eh_proj [2d, d]; both act on [enorm(embedding) ; hnorm(hidden)]), the block's tensors,
//     shared_head.norm (mtp.<k>.norm) and copies of the embedding and the head (HfTensorMap::duplicate_of).
//   - Qwen3 per-head q/k RMSNorm weights: the engine's qk_norm parameters
//     layers.<l>.attn.q_head_norm / attn.k_head_norm [head_dim] (attn.q_norm is MLA's q-latent norm).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/dtype.h"
#include "moetron/model.h"
#include "moetron/safetensors.h"
#include "moetron/spec.h"
#include "moetron/tensor.h"

namespace moetron {

// One moetron tensor (fp32, row-major) by name: a parameter (Model::params() names) or expert_bias.<i>.
struct HfTensorRef {
  std::string name;
  Shape shape;
  float* data = nullptr;
};

// Where rows of one HF tensor come from. transpose = false: the HF tensor is the moetron tensor `src`
// element for element (same numel, row-major; 1-D norms, embed, head, bias). transpose = true: HF row
// row0 + i, column j == element [j, cols[i]] of the [in, out] matrix `src` (expert slice `expert` of an
// [E, in, out] tensor when expert >= 0); the HF tensor has `in` columns.
// shift_nonneg (copy parts only): export writes src - min(src) when min(src) < 0, else src; import copies.
struct HfPart {
  std::string src;
  int64_t expert = -1;
  bool transpose = false;
  std::vector<int64_t> cols;  // transpose only: one source column per HF row
  bool shift_nonneg = false;
};

// An HF tensor with no parts has no moetron source: export writes zeros; import accepts it absent or
// all zero (anything else is an error, since moetron cannot represent it).
struct HfTensorMap {
  std::string hf_name;
  Shape hf_shape;
  std::vector<HfPart> parts;  // concatenated along HF rows
  std::string how;            // human-readable transform, e.g. "T, cols [0, 64)" (docs, --list)
  // Non-empty: a second copy of the HF tensor named here (DeepSeek-V3's MTP layer repeats the embedding and the
  // head: model.layers.<L+k>.embed_tokens / shared_head.head). Export writes it like any other; import reads
  // it only to check that it equals that tensor element for element, and refuses it by name if not.
  std::string duplicate_of;
};

struct HfWeightMap {
  std::string model_type;                // as to_hf_config_json writes it
  std::vector<HfTensorRef> moetron;      // every moetron tensor the map covers (data == nullptr)
  std::vector<HfTensorMap> hf;           // every HF tensor, in file order
  std::vector<std::string> not_in_hf;    // moetron tensors with no HF counterpart (zeroed on import)
  bool routes_with_bias = false;         // the spec's router uses expert_bias (load_balance = aux_free)
};

// The HF model_type to_hf_config_json chooses for the spec (throws if the spec is not expressible).
std::string hf_model_type(const ModelSpec& spec);
// The full mapping for a spec. Covers every element of every moetron tensor exactly once (except the
// not_in_hf ones), and every HF tensor element exactly once.
HfWeightMap hf_weight_map(const ModelSpec& spec);

// moetron tensors of a Model: its parameters (views of param_data()) then expert_bias.<i> for each MoE
// layer, named as the trainer's checkpoints name them.
std::vector<HfTensorRef> model_tensor_refs(Model& model);

// One exported HF tensor, fp32.
struct HfTensorData {
  std::string name;
  Shape shape;
  std::vector<float> data;
};

// Builds every HF tensor from the moetron tensors in `src` (each tensor of map.moetron must be present
// with its shape; extra refs are an error). `notes` (optional) receives warnings, e.g. a non-zero
// expert bias that moetron routes with but the format cannot carry.
std::vector<HfTensorData> export_hf_tensors(const HfWeightMap& map, const std::vector<HfTensorRef>& src,
                                            std::vector<std::string>* notes = nullptr);

struct HfLoadOptions {
  // Tensors in the files that the map does not know are an error unless this is set (e.g. the
  // DeepSeek-V3 MTP layer). lm_head.weight of a tied model and *.rotary_emb.inv_freq are always ignored.
  bool allow_unexpected = false;
};

// Fills the moetron tensors in `dst` from HF safetensors files (one file, or the shards of a sharded
// checkpoint). Checks everything first and reports every missing tensor, unexpected tensor, wrong
// shape and unsupported dtype by HF name in one moetron::Error; then copies (F32 exactly, BF16
// widened). Tensors in map.not_in_hf are zeroed. Each ref in dst must match map.moetron by name and
// shape.
void load_hf_weights(const ModelSpec& spec, const std::vector<SafetensorsFile>& files,
                     const std::vector<HfTensorRef>& dst, const HfLoadOptions& opt = {});
void load_hf_weights(const ModelSpec& spec, const SafetensorsFile& file, const std::vector<HfTensorRef>& dst,
                     const HfLoadOptions& opt = {});
// Flat-buffer form: the tensors named in `params` live at params[i].offset in `data` (Model layout);
// `expert_bias` (may be empty) holds one [E] pointer per MoE layer.
void load_hf_weights(const ModelSpec& spec, const SafetensorsFile& file, float* data,
                     const std::vector<ParamEntry>& params, const std::vector<float*>& expert_bias,
                     const HfLoadOptions& opt = {});

// Opens DIR/model.safetensors, or the shards listed in DIR/model.safetensors.index.json.
std::vector<SafetensorsFile> open_hf_safetensors(const std::string& dir);

// ---- whole exports ----

struct HfExportOptions {
  DType dtype = DType::BF16;  // F32 or BF16 for the weights; the DeepSeek-V3 expert bias stays F32
};

struct HfExportResult {
  std::string model_type, safetensors_path, config_path;
  int64_t n_tensors = 0;
  uint64_t file_bytes = 0;
  std::vector<std::string> notes;
};

// Writes out_dir/model.safetensors (metadata {"format": "pt"}) and out_dir/config.json
// (to_hf_config_json, with torch_dtype set to the chosen dtype). Creates out_dir.
HfExportResult write_hf_model(const std::string& out_dir, const ModelSpec& spec, const std::vector<HfTensorRef>& src,
                              const HfExportOptions& opt = {});

// What `moetron export --hf` does. Source: the checkpoint directory `checkpoint` (a step-N folder),
// or, when empty, the latest complete checkpoint in <job.dump_folder>/<checkpoint.folder>; with
// init = true, the seed initialisation (training.seed) instead of any checkpoint.
struct HfExportRequest {
  std::string out_dir;
  std::string checkpoint;
  bool init = false;
  HfExportOptions opt;
};
HfExportResult export_hf(const JobConfig& cfg, const HfExportRequest& req, std::string* source_used = nullptr);

}  // namespace moetron
