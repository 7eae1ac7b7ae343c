// test_hf_semantics.cpp: does the Hugging Face export describe the model moetron computes? Each case
// exports a seeded moetron model (config.json + HF tensors) and runs hf_reference.h, which reads only
// that config.json and those tensors and applies the HF model type's own rules (not the moetron spec),
// then compares with moetron's logits. Covers the reference variants (deepseek V1 MHA/GQA, deepseek_v2
// greedy and group-limited with routed_scaling_factor 16, deepseek_v3, mixtral), the configurations
// transformers would evaluate differently or not load (each either exported faithfully or refused with
// the rule): deepseek_v2 with norm_topk_prob, V2/V3 without shared experts, MLA with norm_eps != 1e-6,
// V1 top-1 with norm_topk_prob, dense MLA models; the V3 routing-bias shift; and that every field
// written is one the type reads; DeepSeek-V3's MTP layers (the engine's depth losses against the reference's
// MTP logits) and the refusal of MTP in the other types. Not the weight layout tests (test_hf_export.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "hf_reference.h"
#include "moetron/config.h"
#include "moetron/hf_weights.h"
#include "moetron/model.h"
#include "moetron/rng.h"

#include "test_util.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }
JobConfig cfg_of(const std::string& rel, std::vector<std::string> ov = {}) {
  ov.push_back("--model.init_std=0.15");  // attention (so RoPE) and routing far from uniform
  return load_config(repo(rel), ov);
}
std::vector<std::string> plus(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

using moetron::testing::error_of;

// DeepSeek-V2 (MLA, softmax, no q compression) from the V3-shaped tiny config.
const std::vector<std::string> kV2 = {"--model.q_lora_rank=0",          "--model.score_func=softmax",
                                      "--model.load_balance=aux_loss",   "--model.route_scale=1.0",
                                      "--model.n_group=1",               "--model.topk_group=1",
                                      "--model.norm_topk_prob=false"};
const char* kDs = "configs/ds_tiny.toml";
const char* kMla = "configs/ds_tiny_mla.toml";
const char* kMixtral = "tests/data/hf_export/mixtral_tiny.toml";
const char* kQwen3 = "tests/data/hf_export/qwen3_tiny.toml";

constexpr int64_t kT = 12;

std::vector<int32_t> tokens(int64_t V) {
  std::vector<int32_t> tok(static_cast<size_t>(kT));
  for (int64_t t = 0; t < kT; ++t) tok[size_t(t)] = int32_t((t * 37 + 11) % V);
  return tok;
}

// A seeded model; a small non-zero expert bias where moetron routes with one.
std::unique_ptr<Model> seeded(const JobConfig& c) {
  // fp32 compute: the comparison holds the HF mapping to float accuracy (1e-5 relative, below); a bf16 run would
  // differ by bf16 rounding of activations the reference keeps in fp32.
  auto m = std::make_unique<Model>(c.model, 1, kT, ActivationCheckpointSpec{}, ModelParallel{}, ComputeDtype::FP32);
  m->init_params(uint64_t(c.training.seed));
  for (int i = 0; i < m->n_moe_layers(); ++i)
    fill_normal(m->expert_bias(i), c.model.moe.n_routed_experts, rng_key(4, "eb" + std::to_string(i)), 0, 0.0f, 0.01f);
  return m;
}

std::vector<float> moetron_logits(Model& m) {
  std::vector<float> got(static_cast<size_t>(kT * m.spec().vocab_size));
  auto tok = tokens(m.spec().vocab_size);
  m.compute_logits(got.data(), tok.data());
  return got;
}

struct HfExport {
  nlohmann::json config;
  std::vector<HfTensorData> tensors;
};
HfExport export_of(const ModelSpec& s, Model& m) {
  return {nlohmann::json::parse(to_hf_config_json(s)), export_hf_tensors(hf_weight_map(s), model_tensor_refs(m))};
}

// The reference's logits, with GEMM operands rounded as `m` computes them; `keys` / `unused` (optional)
// receive the config keys read and the tensors not used.
hfref::Mat hf_logits(const HfExport& x, const Model& m, std::set<std::string>* keys = nullptr,
                     std::vector<std::string>* unused = nullptr) {
  hfref::Config c{x.config, "?", {}};
  hfref::Rules r = hfref::parse_rules(c);
  hfref::Forward f(r, x.tensors, m.compute_dtype() == ComputeDtype::BF16);
  hfref::Mat out = f.logits(tokens(r.V));
  if (keys) *keys = c.read;
  if (unused)
    for (const auto& t : x.tensors)
      if (!f.used.count(t.name)) unused->push_back(t.name);
  return out;
}

struct Diff {
  double maxabs = 0, maxdiff = 0;
};
Diff diff(const hfref::Mat& want, const std::vector<float>& got) {
  Diff d;
  for (size_t i = 0; i < got.size(); ++i)
    d.maxabs = std::max(d.maxabs, std::fabs(want[i])), d.maxdiff = std::max(d.maxdiff, std::fabs(want[i] - got[i]));
  return d;
}
// GEMM operands are identical on both sides (bf16-rounded when the model computes in bf16); what remains
// is fp32-vs-double accumulation and the fp32 softmaxes. Measured with fp32 compute (this CPU has no
// native bf16): max |diff| 1.6e-6 .. 5.7e-6 for max |logit| 4.2 .. 5.2 (relative 3e-7 .. 1.2e-6). The
// wrong routing rules below give relative differences of 0.3 .. 1.
void expect_same(const Diff& d) {
  EXPECT_GT(d.maxabs, 0.5);  // the comparison means something
  EXPECT_LT(d.maxdiff, 1e-5 * d.maxabs) << "max |logit| " << d.maxabs << ", max |diff| " << d.maxdiff;
}
void expect_different(const Diff& d) {
  EXPECT_GT(d.maxdiff, 1e-3 * d.maxabs) << "max |logit| " << d.maxabs << ", max |diff| " << d.maxdiff;
}

// Export, run the HF rules, compare; also: every tensor written is loaded, every config field read.
const std::set<std::string> kNotModelFields = {"model_type", "architectures", "torch_dtype", "initializer_range",
                                               "moetron",    "aux_loss_alpha", "seq_aux",   "router_aux_loss_coef"};
void expect_fields_read(const nlohmann::json& config, const std::set<std::string>& keys) {
  for (const auto& [k, v] : config.items())
    EXPECT_TRUE(keys.count(k) || kNotModelFields.count(k))
        << config["model_type"] << " config field '" << k << "' = " << v.dump() << " is read by nothing";
}
void expect_faithful(const JobConfig& c, const std::string& want_type) {
  SCOPED_TRACE(want_type);
  auto m = seeded(c);
  HfExport x = export_of(c.model, *m);
  EXPECT_EQ(x.config["model_type"], want_type);
  std::set<std::string> keys;
  std::vector<std::string> unused;
  expect_same(diff(hf_logits(x, *m, &keys, &unused), moetron_logits(*m)));
  EXPECT_TRUE(unused.empty()) << unused.size() << " HF tensors unused, first " << unused[0];
  expect_fields_read(x.config, keys);
}

void expect_refused(const JobConfig& c, const std::vector<std::string>& parts) {
  std::string m = error_of([&] { to_hf_config_json(c.model); });
  for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "'" << p << "' not in: " << m;
  // The weight export and the CLI path refuse the same way.
  EXPECT_EQ(error_of([&] { hf_weight_map(c.model); }), m);
}

}  // namespace

// ---- the reference variants --------------------------------------------------------------------

TEST(HfSemantics, DeepSeekV1Mha) { expect_faithful(cfg_of(kDs), "deepseek"); }
TEST(HfSemantics, DeepSeekV1Gqa) {
  expect_faithful(cfg_of(kDs, {"--model.attn_type=gqa", "--model.n_kv_heads=2"}), "deepseek");
}
TEST(HfSemantics, DeepSeekV3) { expect_faithful(cfg_of(kMla), "deepseek_v3"); }
TEST(HfSemantics, DeepSeekV2Greedy) { expect_faithful(cfg_of(kMla, kV2), "deepseek_v2"); }
TEST(HfSemantics, DeepSeekV2GroupLimitedRouteScale16) {
  expect_faithful(cfg_of(kMla, plus(kV2, {"--model.n_group=4", "--model.topk_group=2", "--model.route_scale=16",
                                          "--model.q_lora_rank=32"})),
                  "deepseek_v2");
}
TEST(HfSemantics, Mixtral) { expect_faithful(cfg_of(kMixtral), "mixtral"); }
TEST(HfSemantics, MixtralTop1) { expect_faithful(cfg_of(kMixtral, {"--model.topk=1"}), "mixtral"); }
// qwen3_moe: GQA with per-head q / k RMSNorm before RoPE, softmax routing renormalized (norm_topk_prob), every layer
// MoE; and with norm_topk_prob off and a dense first layer (mlp_only_layers).
TEST(HfSemantics, Qwen3Moe) {
  expect_faithful(cfg_of(kQwen3), "qwen3_moe");
  expect_faithful(cfg_of(kQwen3, {"--model.norm_topk_prob=false", "--model.first_k_dense=1", "--model.inter_size=48"}),
                  "qwen3_moe");
}

// ---- 1. deepseek_v2 with norm_topk_prob = true -------------------------------------------------
// transformers' V2 gate scales by routed_scaling_factor and never renormalizes: refused.
TEST(HfSemantics, DeepSeekV2NormTopkProbIsRefused) {
  const auto ov = plus(kV2, {"--model.route_scale=2.0"});
  JobConfig norm = cfg_of(kMla, plus(ov, {"--model.norm_topk_prob=true"}));
  expect_refused(norm, {"HF model_type deepseek_v2", "model.norm_topk_prob = true", "never reads norm_topk_prob",
                        "routed_scaling_factor"});
  // Why: the same weights under V2's rules (exported from the norm_topk_prob = false twin) give the
  // twin's logits, not those of the renormalizing model.
  JobConfig plain = cfg_of(kMla, ov);
  auto a = seeded(plain), b = seeded(norm);
  HfExport x = export_of(plain.model, *a);
  hfref::Mat hf = hf_logits(x, *a);
  expect_same(diff(hf, moetron_logits(*a)));
  expect_different(diff(hf, moetron_logits(*b)));
}

// ---- 2. deepseek_v2 / deepseek_v3 without shared experts ---------------------------------------
TEST(HfSemantics, DeepSeekV2V3WithoutSharedExpertsExportZeroAndEmptyTensors) {
  for (auto ov : {plus(kV2, {"--model.n_shared_experts=0"}), std::vector<std::string>{"--model.n_shared_experts=0"}}) {
    JobConfig c = cfg_of(kMla, ov);
    auto m = seeded(c);
    HfExport x = export_of(c.model, *m);
    const std::string type = x.config["model_type"];
    SCOPED_TRACE(type);
    ASSERT_TRUE(x.config["n_shared_experts"].is_number_integer()) << x.config["n_shared_experts"];
    EXPECT_EQ(x.config["n_shared_experts"], 0);
    for (const auto& t : x.tensors)
      if (t.name.find("shared_experts") != std::string::npos) {
        EXPECT_EQ(t.shape, (t.name.ends_with("down_proj.weight") ? Shape{64, 0} : Shape{0, 64})) << t.name;
      }
    expect_faithful(c, type);
    // The reference fails, as transformers does, on what the export used to write.
    HfExport old = x;
    old.config["n_shared_experts"] = nullptr;
    EXPECT_NE(error_of([&] { hf_logits(old, *m); }).find("'n_shared_experts' is null"), std::string::npos);
    // Through the files: the empty tensors are written, read back, and the round trip is exact.
    const std::string dir = (fs::temp_directory_path() / ("moetron_hfs_noshared_" + type)).string();
    HfExportOptions opt;
    opt.dtype = DType::F32;
    HfExportResult r = write_hf_model(dir, c.model, model_tensor_refs(*m), opt);
    SafetensorsFile f = SafetensorsFile::open(r.safetensors_path);
    EXPECT_EQ(f.info("model.layers.1.mlp.shared_experts.down_proj.weight").shape, (Shape{64, 0}));
    Model back(c.model, 1, kT, ActivationCheckpointSpec{}, ModelParallel{}, ComputeDtype::FP32);
    load_hf_weights(c.model, f, model_tensor_refs(back));
    back.sync_weights();
    EXPECT_EQ(moetron_logits(back), moetron_logits(*m));
    EXPECT_EQ(load_hf_config(r.config_path), c.model);
    fs::remove_all(dir);
  }
}

// ---- 3. MLA with norm_eps != 1e-6 --------------------------------------------------------------
// transformers builds q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever rms_norm_eps says: refused.
TEST(HfSemantics, MlaNormEpsOtherThan1em6IsRefused) {
  expect_refused(cfg_of(kMla, {"--model.norm_eps=1e-5"}),
                 {"HF model_type deepseek_v3", "model.norm_eps = 1e-05", "q_a_layernorm and kv_a_layernorm"});
  expect_refused(cfg_of(kMla, plus(kV2, {"--model.norm_eps=1e-5"})), {"deepseek_v2", "model.norm_eps = 1e-05"});
  // The reference applies 1e-6 to the latent norms: with a config that claims rms_norm_eps = 1e-5, a
  // model with norm_eps = 1e-5 everywhere no longer matches (a large eps makes the gap visible).
  JobConfig six = cfg_of(kMla), big = cfg_of(kMla, {"--model.norm_eps=0.5"});
  auto a = seeded(six), b = seeded(big);
  HfExport x = export_of(six.model, *a);
  x.config["rms_norm_eps"] = 0.5;
  expect_different(diff(hf_logits(x, *a), moetron_logits(*b)));
  // MHA models have no latent norms: any eps exports.
  expect_faithful(cfg_of(kDs, {"--model.norm_eps=1e-5"}), "deepseek");
}

// ---- 4. deepseek (V1) with top-1 and norm_topk_prob = true -------------------------------------
// V1 renormalizes only when top_k > 1: the single expert keeps its softmax score. Refused.
TEST(HfSemantics, DeepSeekV1Top1NormTopkProbIsRefused) {
  JobConfig norm = cfg_of(kDs, {"--model.topk=1", "--model.norm_topk_prob=true"});
  expect_refused(norm, {"HF model_type deepseek", "model.norm_topk_prob = true with model.topk = 1",
                        "only when num_experts_per_tok > 1"});
  JobConfig plain = cfg_of(kDs, {"--model.topk=1"});
  expect_faithful(plain, "deepseek");
  auto a = seeded(plain), b = seeded(norm);
  hfref::Mat hf = hf_logits(export_of(plain.model, *a), *a);
  expect_different(diff(hf, moetron_logits(*b)));
  // A V1 config with top-1 and norm_topk_prob = true imports as the model V1 computes.
  auto j = nlohmann::json::parse(to_hf_config_json(plain.model));
  j["norm_topk_prob"] = true;
  EXPECT_EQ(model_spec_from_hf_json(j.dump()), plain.model);
  // top-2 with norm_topk_prob = true is renormalized by V1 too: faithful.
  expect_faithful(cfg_of(kDs, {"--model.norm_topk_prob=true"}), "deepseek");
}

// ---- 5. dense MLA models (no routed experts) ---------------------------------------------------
TEST(HfSemantics, DenseModelsWriteFirstKDenseReplaceEqualToLayers) {
  const std::vector<std::string> dense = {"--model.n_routed_experts=0", "--model.n_shared_experts=0",
                                          "--model.first_k_dense=0"};
  for (const auto& [ov, type] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {plus(dense, kV2), "deepseek_v2"}, {dense, "deepseek_v3"}, {plus(dense, {"--model.q_lora_rank=0"}), "deepseek_v3"}}) {
    JobConfig c = cfg_of(kMla, ov);
    auto m = seeded(c);
    HfExport x = export_of(c.model, *m);
    SCOPED_TRACE(type);
    EXPECT_EQ(x.config["first_k_dense_replace"], c.model.n_layers);
    EXPECT_TRUE(x.config["n_routed_experts"].is_null());
    expect_faithful(c, type);
    HfExport old = x;
    old.config["first_k_dense_replace"] = 0;
    EXPECT_NE(error_of([&] { hf_logits(old, *m); }).find("range(None)"), std::string::npos);
  }
  JobConfig mha = cfg_of(kDs, dense);
  expect_faithful(mha, "deepseek");
  EXPECT_EQ(nlohmann::json::parse(to_hf_config_json(mha.model))["first_k_dense_replace"], mha.model.n_layers);
}

// ---- the DeepSeek-V3 routing bias ----------------------------------------------------------------
// transformers' V3 router masks the experts of unselected groups with 0.0. With this bias the best
// group's second-best biased score is about -2.5, below the masked 0.0: exported as is, HF would pick a
// masked expert. Exported as bias - min(bias), every biased score is positive and HF routes as moetron.
TEST(HfSemantics, DeepSeekV3BiasIsShiftedSoThatMaskedGroupsCannotWin) {
  JobConfig c = cfg_of(kMla);
  auto m = seeded(c);
  const int64_t E = c.model.moe.n_routed_experts;  // 8 experts, 2 groups of 4, top-2 from 1 group
  const std::vector<float> bias = {3, -3, -3, -3, -1, -1, -1, -1};
  for (int i = 0; i < m->n_moe_layers(); ++i) std::copy(bias.begin(), bias.end(), m->expert_bias(i));
  HfExport x = export_of(c.model, *m);
  for (auto& t : x.tensors)
    if (t.name.ends_with("e_score_correction_bias")) {
      for (int64_t e = 0; e < E; ++e) EXPECT_EQ(t.data[size_t(e)], bias[size_t(e)] + 3.0f) << t.name;
    }
  const std::vector<float> want = moetron_logits(*m);
  expect_same(diff(hf_logits(x, *m), want));
  // Negative control: the unshifted bias under HF's rules routes differently.
  for (auto& t : x.tensors)
    if (t.name.ends_with("e_score_correction_bias")) std::copy(bias.begin(), bias.end(), t.data.begin());
  expect_different(diff(hf_logits(x, *m), want));
  // A non-negative bias is written unchanged.
  for (int i = 0; i < m->n_moe_layers(); ++i)
    for (int64_t e = 0; e < E; ++e) m->expert_bias(i)[e] = 0.25f * float(e);
  HfExport y = export_of(c.model, *m);
  for (const auto& t : y.tensors)
    if (t.name.ends_with("e_score_correction_bias")) {
      for (int64_t e = 0; e < E; ++e) EXPECT_EQ(t.data[size_t(e)], 0.25f * float(e));
    }
}

// With load_balance != aux_free moetron routes without the bias: V3 gets zeros, and a V3 checkpoint
// with a non-zero bias does not load into such a spec.
TEST(HfSemantics, DeepSeekV3WithoutAuxFreeWritesAZeroBias) {
  JobConfig c = cfg_of(kMla, {"--model.load_balance=aux_loss"});
  auto m = seeded(c);  // non-zero expert_bias, which moetron ignores here
  HfExport x = export_of(c.model, *m);
  for (const auto& t : x.tensors)
    if (t.name.ends_with("e_score_correction_bias")) {
      for (float v : t.data) EXPECT_EQ(v, 0.0f) << t.name;
    }
  expect_faithful(c, "deepseek_v3");
  std::vector<std::string> notes;
  export_hf_tensors(hf_weight_map(c.model), model_tensor_refs(*m), &notes);
  EXPECT_TRUE(notes.empty());  // nothing lost: moetron does not route with it
  const std::string dir = (fs::temp_directory_path() / "moetron_hfs_zero_bias").string();
  fs::create_directories(dir);
  std::vector<SafetensorsEntry> e;
  for (auto& t : x.tensors) {
    if (t.name == "model.layers.2.mlp.gate.e_score_correction_bias") t.data[3] = 0.5f;
    e.push_back({t.name, DType::F32, t.shape, t.data.data(), t.data.size() * 4});
  }
  write_safetensors(dir + "/model.safetensors", e, {{"format", "pt"}});
  std::string msg = error_of([&] { load_hf_weights(c.model, SafetensorsFile::open(dir + "/model.safetensors"), model_tensor_refs(*m)); });
  EXPECT_NE(msg.find("'model.layers.2.mlp.gate.e_score_correction_bias' must be all zero"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(HfSemantics, DeepSeekV3GroupsOfOneExpertAreRefused) {
  expect_refused(cfg_of(kMla, {"--model.n_group=8", "--model.topk_group=2"}),
                 {"deepseek_v3", "model.n_routed_experts / model.n_group = 1", "top 2 experts"});
}

// ---- every field written is read ---------------------------------------------------------------
// Also for the types the engine cannot run (qwen3_moe): the config rules alone.
TEST(HfSemantics, EveryWrittenFieldIsOneTheTypeReads) {
  JobConfig q = load_config(repo("tests/data/hf_export/qwen3_tiny.toml"));
  nlohmann::json j = nlohmann::json::parse(to_hf_config_json(q.model));
  hfref::Config c{j, "?", {}};
  hfref::Rules r = hfref::parse_rules(c);
  EXPECT_EQ(r.type, "qwen3_moe");
  EXPECT_EQ(r.E, 8);
  EXPECT_TRUE(r.norm == hfref::Norm::NoEps);
  expect_fields_read(j, c.read);
  // V1 no longer writes V2/V3-only routing fields, V2 greedy no group fields, Mixtral no attention_bias.
  JobConfig v1 = cfg_of(kDs);
  auto j1 = nlohmann::json::parse(to_hf_config_json(v1.model));
  for (const char* k : {"routed_scaling_factor", "n_group", "topk_group", "topk_method"}) EXPECT_FALSE(j1.contains(k)) << k;
  EXPECT_TRUE(j1["n_shared_experts"].is_number_integer());
  auto j2 = nlohmann::json::parse(to_hf_config_json(cfg_of(kMla, kV2).model));
  EXPECT_FALSE(j2.contains("n_group"));
  EXPECT_FALSE(nlohmann::json::parse(to_hf_config_json(cfg_of(kMixtral).model)).contains("attention_bias"));
  // V1 without shared experts: null, which V1 reads as "none".
  auto j3 = nlohmann::json::parse(to_hf_config_json(cfg_of(kMixtral, {"--model.norm_topk_prob=false"}).model));
  EXPECT_EQ(j3["model_type"], "deepseek");
  EXPECT_TRUE(j3["n_shared_experts"].is_null());
  expect_faithful(cfg_of(kMixtral, {"--model.norm_topk_prob=false"}), "deepseek");
}

// ---- multi-token prediction (DeepSeek-V3's MTP layers) ---------------------------------------------
// The engine's depth losses (Model::forward's mtp_ce) against the reference's MTP logits (hf_reference.h
// mtp_logits: DeepSeek-V3's rules on the exported layer L + k - 1, its own embed_tokens / shared_head copies).
namespace {

// Sum over positions of -log softmax(lg[i])[tgt[i]], in double.
double ce_sum(const hfref::Mat& lg, int64_t n, int64_t V, const int32_t* tgt) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double* z = &lg[size_t(i * V)];
    const double mx = *std::max_element(z, z + V);
    double se = 0;
    for (int64_t v = 0; v < V; ++v) se += std::exp(z[v] - mx);
    s += mx + std::log(se) - z[tgt[i]];
  }
  return s;
}

void expect_mtp_faithful(const JobConfig& c) {
  const int64_t D = c.model.mtp_layers, V = c.model.vocab_size, L = c.model.n_layers;
  auto m = seeded(c);
  HfExport x = export_of(c.model, *m);
  EXPECT_EQ(x.config["model_type"], "deepseek_v3");
  EXPECT_EQ(x.config["num_hidden_layers"], L);  // the MTP layers come after, as DeepSeek-V3's layer 61
  EXPECT_EQ(x.config["num_nextn_predict_layers"], D);
  // kT + 1 tokens: the engine reads tokens seq[0, kT) and targets seq[1, kT]; depth k predicts seq[i + k + 1] at
  // positions i < kT - k from seq[i + k].
  std::vector<int32_t> seq(size_t(kT + 1));
  for (int64_t t = 0; t <= kT; ++t) seq[size_t(t)] = int32_t((t * 37 + 11) % V);
  const ForwardStats st = m->forward(seq.data(), seq.data() + 1);
  ASSERT_EQ(int64_t(st.mtp_ce.size()), D);

  hfref::Config cf{x.config, "?", {}};
  hfref::Rules r = hfref::parse_rules(cf);
  EXPECT_EQ(r.mtp, D);
  hfref::Forward f(r, x.tensors, false);
  expect_same(diff(f.logits(tokens(V)), moetron_logits(*m)));  // the main model, as in the other cases
  for (int64_t k = 1; k <= D; ++k) {
    SCOPED_TRACE("MTP depth " + std::to_string(k));
    const int64_t n = kT - k;
    const hfref::Mat lg = f.mtp_logits(seq, k);  // kT + 1 - k positions; the last has no target in the engine
    double maxabs = 0;
    for (int64_t i = 0; i < n * V; ++i) maxabs = std::max(maxabs, std::fabs(lg[size_t(i)]));
    EXPECT_GT(maxabs, 0.5);
    const double want = ce_sum(lg, n, V, seq.data() + k + 1);
    // CE_i = logsumexp(z) - z_y moves by at most 2 max_j |dz_j|; the logits are held to 1e-5 * max |z| (above),
    // so the sum over n positions to 2 n 1e-5 max |z|.
    const double tol = 2.0 * double(n) * 1e-5 * maxabs;
    EXPECT_EQ(st.mtp_n[size_t(k - 1)], n);
    EXPECT_NEAR(st.mtp_ce[size_t(k - 1)], want, tol) << "max |logit| " << maxabs;
    std::printf("[ MTP      ] %s depth %lld: engine CE sum %.9g, HF reference %.9g, |diff| %.3g (bound %.3g)\n",
                hf_model_type(c.model).c_str(), (long long)k, st.mtp_ce[size_t(k - 1)], want,
                std::fabs(st.mtp_ce[size_t(k - 1)] - want), tol);
    // The concatenation read the other way round ([hnorm(h) ; enorm(e)]) is a different model.
    const double swapped = ce_sum(f.mtp_logits(seq, k, true), n, V, seq.data() + k + 1);
    EXPECT_GT(std::fabs(swapped - want), 100 * tol) << "swapped " << swapped << ", right " << want;
  }
  std::vector<std::string> unused;
  for (const auto& t : x.tensors)
    if (!f.used.count(t.name)) unused.push_back(t.name);
  EXPECT_TRUE(unused.empty()) << unused.size() << " HF tensors unused, first " << unused[0];
  expect_fields_read(x.config, cf.read);
}

}  // namespace

TEST(HfSemantics, DeepSeekV3MtpDepthsMatchTheEngine) {
  expect_mtp_faithful(cfg_of(kMla, {"--model.mtp_layers=2"}));  // MoE blocks (the last layer is MoE)
  // A dense MLA model: the MTP layer index L >= first_k_dense_replace = L, but n_routed_experts is null, so
  // its block is dense in DeepSeek's MTP module as in the engine.
  expect_mtp_faithful(cfg_of(kMla, {"--model.n_routed_experts=0", "--model.n_shared_experts=0",
                                    "--model.first_k_dense=0", "--model.mtp_layers=1"}));
}

// Only deepseek_v3 has a field for the MTP layers: every other type the exporter writes refuses them by name.
TEST(HfSemantics, MtpInOtherTypesIsRefused) {
  for (const auto& [c, type] : std::vector<std::pair<JobConfig, std::string>>{
           {cfg_of(kDs, {"--model.mtp_layers=1"}), "deepseek"},
           {cfg_of(kMla, plus(kV2, {"--model.mtp_layers=1"})), "deepseek_v2"},
           {cfg_of(kMixtral, {"--model.mtp_layers=1"}), "mixtral"},
           {cfg_of(kQwen3, {"--model.mtp_layers=1"}), "qwen3_moe"}}) {
    SCOPED_TRACE(type);
    const std::string e = error_of([&] { hf_weight_map(c.model); });
    EXPECT_NE(e.find("model.mtp_layers = 1 cannot be written as HF model_type " + type +
                     ", which has no multi-token prediction field"),
              std::string::npos)
        << e;
  }
}
