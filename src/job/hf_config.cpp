// hf_config.cpp: ModelSpec <-> Hugging Face config.json for DeepSeek (V1, V2, V3), Mixtral and
// Qwen3-MoE. Reads and writes the architecture fields only: weights and tokenizers are not here.
// Not modelled (ignored on import): rope_scaling (YaRN), max_position_embeddings, sliding windows.
// DeepSeek-V3's num_nextn_predict_layers is model.mtp_layers. Training-only fields that HF formats do not carry
// (load_balance, capacity_factor, mtp_loss_weight, ...) travel in an extra "moetron" object, which transformers ignores.
// Every other field written is one the type's modelling code reads, with moetron's meaning; a spec that
// code would evaluate differently is refused with the rule (docs/hf_export.md lists them per type).
#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moetron/check.h"
#include "moetron/spec.h"

namespace moetron {
namespace {

using json = nlohmann::json;

struct Reader {
  const json& j;
  std::string src, type;

  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw Error(src + ": " + type + " config: '" + key + "' " + why);
  }
  bool has(const char* k) const { return j.contains(k) && !j.at(k).is_null(); }
  int64_t i(const char* k) const {
    if (!has(k)) fail(k, "is missing");
    const json& v = j.at(k);
    if (!v.is_number_integer()) fail(k, std::string("must be an integer, got ") + v.type_name());
    return v.get<int64_t>();
  }
  int64_t i(const char* k, int64_t def) const { return has(k) ? i(k) : def; }
  double f(const char* k, double def) const {
    if (!has(k)) return def;
    const json& v = j.at(k);
    if (!v.is_number()) fail(k, std::string("must be a number, got ") + v.type_name());
    return v.get<double>();
  }
  bool b(const char* k, bool def) const {
    if (!has(k)) return def;
    const json& v = j.at(k);
    if (!v.is_boolean()) fail(k, std::string("must be a boolean, got ") + v.type_name());
    return v.get<bool>();
  }
  std::string s(const char* k, const std::string& def) const {
    if (!has(k)) return def;
    const json& v = j.at(k);
    if (!v.is_string()) fail(k, std::string("must be a string, got ") + v.type_name());
    return v.get<std::string>();
  }
};

// Canonical form of the dense-layer map: a prefix becomes first_k_dense, anything else a list.
void set_dense(ModelSpec& s, const std::vector<bool>& dense) {
  int64_t k = 0;
  while (k < int64_t(dense.size()) && dense[k]) ++k;
  bool prefix = std::none_of(dense.begin() + k, dense.end(), [](bool x) { return x; });
  s.first_k_dense = 0;
  s.dense_layers.clear();
  if (!s.is_moe()) return;
  if (prefix) {
    s.first_k_dense = k;
  } else {
    for (size_t l = 0; l < dense.size(); ++l)
      if (dense[l]) s.dense_layers.push_back(int(l));
  }
}

void common(ModelSpec& s, const Reader& r) {
  if (r.s("hidden_act", "silu") != "silu") r.fail("hidden_act", "must be silu (moetron FFNs are SwiGLU)");
  if (r.b("attention_bias", false)) r.fail("attention_bias", "is true: moetron layers have no biases");
  s.vocab_size = r.i("vocab_size");
  s.d_model = r.i("hidden_size");
  s.n_layers = r.i("num_hidden_layers");
  s.norm_eps = r.f("rms_norm_eps", 1e-6);
  s.rope_theta = r.f("rope_theta", 10000.0);
  s.tie_embeddings = r.b("tie_word_embeddings", false);
  s.init_std = r.f("initializer_range", 0.02);
  s.attn.n_heads = r.i("num_attention_heads");
}

void gqa_or_mha(ModelSpec& s, const Reader& r) {
  s.attn.n_kv_heads = r.i("num_key_value_heads", s.attn.n_heads);
  s.attn.type = s.attn.n_kv_heads == s.attn.n_heads ? AttnType::MHA : AttnType::GQA;
  s.attn.head_dim = r.has("head_dim") ? r.i("head_dim") : (s.attn.n_heads ? s.d_model / s.attn.n_heads : 0);
}

// DeepSeek V1 (DeepSeekMoE remote code), V2 and V3 (transformers' modeling_deepseek_v2 / _v3). Each
// version reads only the fields its own modelling code reads, with that code's meaning:
//   V1: softmax; top-k weights renormalized only when num_experts_per_tok > 1 and norm_topk_prob;
//       no routed_scaling_factor, no groups.
//   V2: softmax; greedy or group_limited_greedy (group score = max); weights * routed_scaling_factor,
//       never renormalized (transformers does not read norm_topk_prob).
//   V3: sigmoid + e_score_correction_bias; groups always (n_group, topk_group); renormalized when
//       norm_topk_prob, then * routed_scaling_factor.
void import_deepseek(ModelSpec& s, const Reader& r, int version) {
  common(s, r);
  s.inter_size = r.i("intermediate_size");
  if (version > 1) {
    s.attn.type = AttnType::MLA;
    s.attn.q_lora_rank = r.i("q_lora_rank", 0);
    s.attn.kv_lora_rank = r.i("kv_lora_rank");
    s.attn.qk_nope_head_dim = r.i("qk_nope_head_dim");
    s.attn.qk_rope_head_dim = r.i("qk_rope_head_dim");
    s.attn.v_head_dim = r.i("v_head_dim");
  } else {
    gqa_or_mha(s, r);
  }
  auto& m = s.moe;
  m.n_routed_experts = r.i("n_routed_experts", 0);
  if (m.n_routed_experts > 0) {
    m.n_shared_experts = r.i("n_shared_experts", 0);
    m.moe_inter_size = r.i("moe_intermediate_size");
    m.topk = r.i("num_experts_per_tok");
    const std::string want_sf = version == 3 ? "sigmoid" : "softmax";
    const std::string sf = r.s("scoring_func", want_sf);
    if (sf != want_sf) r.fail("scoring_func", "must be " + want_sf + " for " + r.type + ", got " + sf);
    m.score_func = version == 3 ? ScoreFunc::Sigmoid : ScoreFunc::Softmax;
    m.aux_coef = r.f("aux_loss_alpha", 0.001);
    m.aux_seq_wise = r.b("seq_aux", true);
    m.load_balance = LoadBalance::AuxLoss;
    const bool norm = r.b("norm_topk_prob", false);
    if (version == 1) {
      // A single expert keeps its softmax score: the same as no renormalization.
      m.norm_topk_prob = norm && m.topk > 1;
    } else if (version == 2) {
      if (norm)
        r.fail("norm_topk_prob",
               "is true: transformers' DeepseekV2 gate ignores it (weights are scaled by routed_scaling_factor, "
               "never renormalized) while DeepSeek's remote code renormalizes instead of scaling; the model "
               "is ambiguous");
      m.norm_topk_prob = false;
    } else {
      m.norm_topk_prob = norm;
    }
    if (version > 1) m.route_scale = r.f("routed_scaling_factor", 1.0);
    const std::string method = r.s("topk_method", version == 3 ? "noaux_tc" : "greedy");
    if (version == 2) {
      if (method == "greedy") {
        m.n_group = m.topk_group = 1;
      } else if (method == "group_limited_greedy") {
        m.n_group = r.i("n_group", 1);
        m.topk_group = r.i("topk_group", 1);
      } else {
        r.fail("topk_method", "must be greedy or group_limited_greedy, got " + method);
      }
    } else if (version == 3) {
      if (method != "noaux_tc") r.fail("topk_method", "must be noaux_tc, got " + method);
      m.n_group = r.i("n_group", 1);  // transformers' V3 router always routes by groups
      m.topk_group = r.i("topk_group", 1);
      m.load_balance = LoadBalance::AuxFree;
    }
  }
  if (version == 3) {  // the MTP depths: decoder layers num_hidden_layers + k of the checkpoint
    s.mtp_layers = r.i("num_nextn_predict_layers", 0);
    if (s.mtp_layers < 0) r.fail("num_nextn_predict_layers", "must be >= 0");
  }
  const int64_t first_k = r.i("first_k_dense_replace", 0), freq = r.i("moe_layer_freq", 1);
  if (freq < 1) r.fail("moe_layer_freq", "must be >= 1");
  std::vector<bool> dense(size_t(std::max<int64_t>(s.n_layers, 0)));
  for (int64_t l = 0; l < s.n_layers; ++l) dense[l] = !(l >= first_k && l % freq == 0);
  set_dense(s, dense);
}

void import_mixtral(ModelSpec& s, const Reader& r) {
  common(s, r);
  gqa_or_mha(s, r);
  auto& m = s.moe;
  m.n_routed_experts = r.i("num_local_experts");
  m.moe_inter_size = r.i("intermediate_size");
  m.topk = r.i("num_experts_per_tok");
  m.score_func = ScoreFunc::Softmax;
  m.norm_topk_prob = true;  // Mixtral renormalizes the top-k softmax weights
  m.load_balance = LoadBalance::AuxLoss;
  m.aux_coef = r.f("router_aux_loss_coef", 0.02);
  m.aux_seq_wise = false;
}

void import_qwen3_moe(ModelSpec& s, const Reader& r) {
  common(s, r);
  gqa_or_mha(s, r);
  s.attn.qk_norm = true;
  s.inter_size = r.i("intermediate_size", 0);
  auto& m = s.moe;
  m.n_routed_experts = r.i("num_experts");
  m.moe_inter_size = r.i("moe_intermediate_size");
  m.topk = r.i("num_experts_per_tok");
  m.score_func = ScoreFunc::Softmax;
  m.norm_topk_prob = r.b("norm_topk_prob", false);
  m.load_balance = LoadBalance::AuxLoss;
  m.aux_coef = r.f("router_aux_loss_coef", 0.001);
  m.aux_seq_wise = false;
  const int64_t step = r.i("decoder_sparse_step", 1);
  if (step < 1) r.fail("decoder_sparse_step", "must be >= 1");
  std::vector<int64_t> mlp_only;
  if (r.has("mlp_only_layers")) {
    const json& v = r.j.at("mlp_only_layers");
    if (!v.is_array()) r.fail("mlp_only_layers", "must be an array of layer ids");
    for (const auto& e : v) {
      if (!e.is_number_integer()) r.fail("mlp_only_layers", "must be an array of layer ids");
      mlp_only.push_back(e.get<int64_t>());
    }
  }
  std::vector<bool> dense(size_t(std::max<int64_t>(s.n_layers, 0)));
  for (int64_t l = 0; l < s.n_layers; ++l)
    dense[l] = std::count(mlp_only.begin(), mlp_only.end(), l) > 0 || (l + 1) % step != 0;
  set_dense(s, dense);
}

// The "moetron" object: training-only fields (see the file comment).
json extras(const ModelSpec& s) {
  const auto& m = s.moe;
  json x{{"load_balance", std::string(to_string(m.load_balance))},
              {"aux_coef", m.aux_coef},
              {"aux_seq_wise", m.aux_seq_wise},
              {"bias_update_rate", m.bias_update_rate},
              {"bias_update", std::string(to_string(m.bias_update))},
              {"sinkhorn_iters", m.sinkhorn_iters},
              {"route_capacity", m.route_capacity},
              {"z_loss_coef", m.z_loss_coef},
              {"capacity_factor", m.capacity_factor},
              {"drop_policy", std::string(to_string(m.drop_policy))}};
  if (s.mtp_layers > 0) x["mtp_loss_weight"] = s.mtp_loss_weight;
  return x;
}

void apply_extras(ModelSpec& s, const Reader& r) {
  if (!r.has("moetron")) return;
  const json& x = r.j.at("moetron");
  if (!x.is_object()) r.fail("moetron", "must be an object");
  Reader e{x, r.src, r.type + " moetron"};
  auto& m = s.moe;
  const std::string lb = e.s("load_balance", std::string(to_string(m.load_balance)));
  if (lb == "none") m.load_balance = LoadBalance::None;
  else if (lb == "aux_loss") m.load_balance = LoadBalance::AuxLoss;
  else if (lb == "aux_free") m.load_balance = LoadBalance::AuxFree;
  else e.fail("load_balance", "must be none, aux_loss or aux_free, got " + lb);
  m.aux_coef = e.f("aux_coef", m.aux_coef);
  m.aux_seq_wise = e.b("aux_seq_wise", m.aux_seq_wise);
  m.bias_update_rate = e.f("bias_update_rate", m.bias_update_rate);
  const std::string bu = e.s("bias_update", std::string(to_string(m.bias_update)));
  if (bu == "sign") m.bias_update = BiasUpdate::Sign;
  else if (bu == "proportional") m.bias_update = BiasUpdate::Proportional;
  else e.fail("bias_update", "must be sign or proportional, got " + bu);
  m.sinkhorn_iters = e.i("sinkhorn_iters", m.sinkhorn_iters);
  m.route_capacity = e.f("route_capacity", m.route_capacity);
  m.z_loss_coef = e.f("z_loss_coef", m.z_loss_coef);
  m.capacity_factor = e.f("capacity_factor", m.capacity_factor);
  const std::string dp = e.s("drop_policy", std::string(to_string(m.drop_policy)));
  if (dp == "probs") m.drop_policy = DropPolicy::Probs;
  else if (dp == "position") m.drop_policy = DropPolicy::Position;
  else e.fail("drop_policy", "must be probs or position, got " + dp);
  s.mtp_loss_weight = e.f("mtp_loss_weight", s.mtp_loss_weight);
}

[[noreturn]] void cannot(const char* type, const std::string& why) {
  throw Error(std::string("to_hf_config_json: the spec cannot be written as HF model_type ") + type + ": " + why);
}

}  // namespace

ModelSpec model_spec_from_hf_json(std::string_view text, std::string_view source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number that overflows (1e999)
    throw Error(std::string(source) + ": invalid JSON: " + e.what());
  }
  if (!j.is_object()) throw Error(std::string(source) + ": expected a JSON object");
  if (j.contains("text_config") && !j.contains("model_type"))
    throw Error(std::string(source) + ": multimodal config; pass its text_config");
  Reader r{j, std::string(source), "?"};
  const std::string type = r.s("model_type", "");
  r.type = type.empty() ? "?" : type;
  ModelSpec s;
  if (type == "deepseek") import_deepseek(s, r, 1);
  else if (type == "deepseek_v2") import_deepseek(s, r, 2);
  else if (type == "deepseek_v3") import_deepseek(s, r, 3);
  else if (type == "mixtral") import_mixtral(s, r);
  else if (type == "qwen3_moe") import_qwen3_moe(s, r);
  else
    throw Error(std::string(source) + ": unsupported model_type '" + type +
                "' (supported: deepseek, deepseek_v2, deepseek_v3, mixtral, qwen3_moe)");
  apply_extras(s, r);
  s.resolve();
  try {
    s.validate();
  } catch (const Error& e) {
    throw Error(std::string(source) + ": " + e.what());
  }
  return s;
}

ModelSpec load_hf_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error("HF config '" + path + "' not found or unreadable");
  std::stringstream ss;
  ss << in.rdbuf();
  return model_spec_from_hf_json(ss.str(), path);
}

std::string to_hf_config_json(const ModelSpec& s) {
  s.validate();
  // The GPT-style description (a GELU MLP, dropout) has no field in the model types written here.
  if (s.ffn != FfnKind::SwiGLU)
    throw Error(std::string("to_hf_config_json: model.ffn = ") + std::string(to_string(s.ffn)) +
                " cannot be written: every supported HF model_type (deepseek, deepseek_v2, deepseek_v3, mixtral, "
                "qwen3_moe) has SwiGLU MLPs");
  if (s.moe.expert_act != ExpertAct::SwiGLU)
    throw Error(std::string("to_hf_config_json: model.expert_act = ") + std::string(to_string(s.moe.expert_act)) +
                " cannot be written: every supported HF model_type has SwiGLU experts (GPT-OSS's gpt_oss type is not "
                "one of them)");
  if (s.dropout > 0) {
    std::ostringstream p;
    p << s.dropout;
    throw Error("to_hf_config_json: model.dropout = " + p.str() +
                " cannot be written: the supported HF model types carry no dropout of the hidden states "
                "(their attention_dropout covers the attention probabilities only)");
  }
  const auto& a = s.attn;
  const auto& m = s.moe;
  const bool mla = a.type == AttnType::MLA;
  std::string t;
  if (mla) t = m.score_func == ScoreFunc::Sigmoid ? "deepseek_v3" : "deepseek_v2";
  else if (a.qk_norm) t = "qwen3_moe";
  else if (!s.is_moe() || m.n_shared_experts > 0 || s.n_dense_layers() > 0 || !m.norm_topk_prob) t = "deepseek";
  else t = "mixtral";
  const char* type = t.c_str();
  // Multi-token prediction: DeepSeek-V3 checkpoints keep it (num_nextn_predict_layers, decoder layer n_layers + k;
  // hf_weights.cpp); no other type has a field for it.
  if (s.mtp_layers > 0 && t != "deepseek_v3")
    throw Error("to_hf_config_json: model.mtp_layers = " + std::to_string(s.mtp_layers) +
                " cannot be written as HF model_type " + t +
                ", which has no multi-token prediction field (only deepseek_v3 has num_nextn_predict_layers; "
                "that type needs MLA attention with sigmoid scores); export a model with mtp_layers = 0");

  json j;
  j["model_type"] = t;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["vocab_size"] = s.vocab_size;
  j["hidden_size"] = s.d_model;
  j["num_hidden_layers"] = s.n_layers;
  j["num_attention_heads"] = a.n_heads;
  j["num_key_value_heads"] = a.kv_heads();
  j["rms_norm_eps"] = s.norm_eps;
  j["rope_theta"] = s.rope_theta;
  j["tie_word_embeddings"] = s.tie_embeddings;
  j["initializer_range"] = s.init_std;
  j["torch_dtype"] = "bfloat16";

  if (t == "deepseek" || t == "deepseek_v2" || t == "deepseek_v3") {
    j["architectures"] = {t == "deepseek"      ? "DeepseekForCausalLM"
                          : t == "deepseek_v2" ? "DeepseekV2ForCausalLM"
                                               : "DeepseekV3ForCausalLM"};
    if (!s.dense_layers.empty()) cannot(type, "dense layers must be the first k (model.dense_layers is a list)");
    if (t == "deepseek") {
      if (m.score_func != ScoreFunc::Softmax) cannot(type, "score_func must be softmax");
      if (m.route_scale != 1.0 || m.n_group != 1) cannot(type, "no route_scale or group-limited routing in V1");
      if (a.head_dim * a.n_heads != s.d_model) cannot(type, "head_dim must be d_model / n_heads");
      if (s.is_moe() && m.topk == 1 && m.norm_topk_prob)
        cannot(type, "model.norm_topk_prob = true with model.topk = 1: the DeepSeek-V1 gate renormalizes the "
                     "top-k weights only when num_experts_per_tok > 1, so its single expert keeps its softmax "
                     "score where moetron gives it weight 1, and no HF field says otherwise");
    } else {
      if (s.norm_eps != 1e-6) {
        std::ostringstream eps;
        eps << s.norm_eps;
        cannot(type, "model.norm_eps = " + eps.str() +
                         ": transformers builds the MLA q_a_layernorm and kv_a_layernorm with eps 1e-6 whatever "
                         "rms_norm_eps says, while moetron uses norm_eps for q_norm and kv_norm; only "
                         "norm_eps = 1e-6 is expressible");
      }
      if (t == "deepseek_v2" && s.is_moe() && m.norm_topk_prob)
        cannot(type, "model.norm_topk_prob = true: the transformers DeepseekV2 gate never reads norm_topk_prob "
                     "(it multiplies the top-k softmax weights by routed_scaling_factor and does not "
                     "renormalize them), so no HF field says what moetron computes");
      if (t == "deepseek_v3" && s.is_moe() && m.n_routed_experts / m.n_group < 2)
        cannot(type, "model.n_routed_experts / model.n_group = " + std::to_string(m.n_routed_experts / m.n_group) +
                         ": the DeepSeek-V3 router scores each expert group by its top 2 experts, so a group "
                         "needs at least 2 experts");
    }
    j["intermediate_size"] = s.inter_size;
    // Dense model: every layer below first_k_dense_replace (transformers' V2/V3 build an MoE block for
    // every layer at or after it, whatever n_routed_experts says).
    j["first_k_dense_replace"] = s.is_moe() ? s.first_k_dense : s.n_layers;
    // DeepSeek's remote configuration_deepseek.py defaults it to 1: written always, 0 when there is no MTP.
    if (t == "deepseek_v3") j["num_nextn_predict_layers"] = s.mtp_layers;
    j["moe_layer_freq"] = 1;
    if (mla) {
      j["q_lora_rank"] = a.q_lora_rank > 0 ? json(a.q_lora_rank) : json(nullptr);
      j["kv_lora_rank"] = a.kv_lora_rank;
      j["qk_nope_head_dim"] = a.qk_nope_head_dim;
      j["qk_rope_head_dim"] = a.qk_rope_head_dim;
      j["v_head_dim"] = a.v_head_dim;
    }
    if (s.is_moe()) {
      j["n_routed_experts"] = m.n_routed_experts;
      // V1 reads null as "no shared experts"; V2/V3 need a number (V3 multiplies it, V2 always adds the
      // shared block), so they get 0 and empty shared-expert tensors (hf_weight_map).
      j["n_shared_experts"] = m.n_shared_experts > 0 || t != "deepseek" ? json(m.n_shared_experts) : json(nullptr);
      j["moe_intermediate_size"] = m.moe_inter_size;
      j["num_experts_per_tok"] = m.topk;
      j["scoring_func"] = std::string(to_string(m.score_func));
      j["norm_topk_prob"] = m.norm_topk_prob;
      if (t != "deepseek") {  // V1 reads none of these
        j["routed_scaling_factor"] = m.route_scale;
        j["topk_method"] = t == "deepseek_v3" ? "noaux_tc" : m.n_group > 1 ? "group_limited_greedy" : "greedy";
        if (j["topk_method"] != "greedy") {  // V2's greedy reads no group fields; V3 always routes by group
          j["n_group"] = m.n_group;
          j["topk_group"] = m.topk_group;
        }
      }
      j["aux_loss_alpha"] = m.aux_coef;
      j["seq_aux"] = m.aux_seq_wise;
    } else {
      j["n_routed_experts"] = nullptr;
    }
  } else {
    // mixtral / qwen3_moe: no shared experts, softmax, no scaling or groups.
    if (m.n_shared_experts > 0) cannot(type, "no shared experts");
    if (m.score_func != ScoreFunc::Softmax) cannot(type, "score_func must be softmax");
    if (m.route_scale != 1.0) cannot(type, "route_scale must be 1");
    if (m.n_group != 1) cannot(type, "no group-limited routing");
    j["head_dim"] = a.head_dim;
    j["num_experts_per_tok"] = m.topk;
    j["router_aux_loss_coef"] = m.aux_coef;
    if (t == "mixtral") {
      j.erase("attention_bias");  // Mixtral attention has no bias and no such field
      j["architectures"] = {"MixtralForCausalLM"};
      j["num_local_experts"] = m.n_routed_experts;
      j["intermediate_size"] = m.moe_inter_size;
    } else {
      j["architectures"] = {"Qwen3MoeForCausalLM"};
      j["num_experts"] = m.n_routed_experts;
      j["moe_intermediate_size"] = m.moe_inter_size;
      j["intermediate_size"] = s.inter_size;
      j["norm_topk_prob"] = m.norm_topk_prob;
      j["decoder_sparse_step"] = 1;
      std::vector<int64_t> dense;
      for (int64_t l = 0; l < s.n_layers; ++l)
        if (!s.is_moe_layer(l)) dense.push_back(l);
      j["mlp_only_layers"] = dense;
    }
  }
  j["moetron"] = extras(s);
  return j.dump(2);
}

}  // namespace moetron
