// test_accounting.cpp: parameter counts against published totals (within 3%, or within the published figure's
// rounding for the issue-33 presets) and hand counts, FLOPs per token, the named saved-activation terms under every
// precision and checkpointing mode, their double twin used by the size checks, and the per-rank memory estimate's
// sharding against hand formulas.
#include <gtest/gtest.h>

#include <cstdio>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>

#include "moetron/accounting.h"
#include "moetron/check.h"
#include "moetron/config.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {
const fs::path kRoot = MOETRON_SOURCE_DIR;  // the source tree (not __FILE__, which a compiler cache may make relative)
JobConfig preset(const std::string& name, std::vector<std::string> overrides = {}) {
  return load_config((kRoot / "configs" / (name + ".toml")).string(), overrides);
}
void expect_within(double got, double published, double tol, const char* what) {
  EXPECT_LE(std::abs(got / published - 1.0), tol) << what << ": got " << got << ", published " << published;
}
std::map<std::string, int64_t> terms(const LayerActivations& a) {
  std::map<std::string, int64_t> m;
  for (const auto& t : a.terms) m[t.name] = t.bytes;
  return m;
}
}  // namespace

// ---- published figures ------------------------------------------------------------------------------

TEST(Accounting, TotalsMatchPublishedFiguresWithin3Percent) {
  struct Case {
    const char* name;
    double total;  // published total parameters
  };
  // DeepSeek-V3: 671B is the main model without the 14B MTP module (HF's 685B includes it).
  // Llama 4 Scout: 109B is the whole model with its vision encoder; the text model is ~108B.
  for (const auto& c : std::vector<Case>{{"deepseek_v2_lite", 15.7e9},
                                         {"deepseek_v2", 236e9},
                                         {"deepseek_v3", 671e9},
                                         {"mixtral_8x7b", 46.7e9},
                                         {"qwen3_30b_a3b", 30.5e9},
                                         {"llama4_scout", 108e9}}) {
    SCOPED_TRACE(c.name);
    expect_within(double(count_params(preset(c.name).model).total), c.total, 0.03, "total");
  }
}

// DeepSeek-V3 with its MTP module (model.mtp_layers = 1): HF's 685B counts the checkpoint's tensors, whose layer 61
// carries its own copies of embed_tokens and shared_head.head (V d each); moetron shares both with the main model, so
// its trainable total is 685B minus those two copies. Within 0.5% (measured 684.49B, 0.07% off: 685 is rounded to
// 1B): leaving the MTP module out gives 672.9B, 1.8% off, and so fails. The report's "14B MTP
// module" is 685 - 671 of two rounded figures; ours is 11.61B + 2 x 0.93B copies = 13.47B (printed, not checked).
TEST(Accounting, DeepSeekV3WithMtpMatchesHf685B) {
  ModelSpec s = preset("deepseek_v3").model;
  const ParamCounts main = count_params(s);
  s.mtp_layers = 1;
  const ParamCounts c = count_params(s);
  const double copies = 2.0 * double(s.vocab_size) * double(s.d_model);
  expect_within(double(c.total) + copies, 685e9, 0.005, "total with the checkpoint's copies");
  EXPECT_GT(c.mtp, int64_t(11e9));
  EXPECT_EQ(c.total - main.total, c.mtp);
  std::printf("deepseek_v3 + MTP: %.3fB trainable (%.3fB MTP), %.3fB as HF counts it\n", double(c.total) / 1e9,
              double(c.mtp) / 1e9, (double(c.total) + copies) / 1e9);
}

TEST(Accounting, ActiveMatchesPublishedFiguresWithin3Percent) {
  // Published active counts include the embedding table (active), except DeepSeek-V2-Lite's 2.4B, which
  // matches the count without the input embedding (active_no_embed = 2.45B; 2.66B with it).
  expect_within(double(count_params(preset("deepseek_v2").model).active), 21e9, 0.03, "deepseek_v2");
  expect_within(double(count_params(preset("deepseek_v3").model).active), 37e9, 0.03, "deepseek_v3");
  expect_within(double(count_params(preset("mixtral_8x7b").model).active), 12.9e9, 0.03, "mixtral");
  expect_within(double(count_params(preset("qwen3_30b_a3b").model).active), 3.3e9, 0.03, "qwen3");
  expect_within(double(count_params(preset("llama4_scout").model).active), 17e9, 0.03, "scout");
  expect_within(double(count_params(preset("deepseek_v2_lite").model).active_no_embed), 2.4e9, 0.03, "v2-lite");
}

// The presets added for the published MoE runs (issue 33), against their publishers' stated totals. Each bound is
// derived, not chosen: half a unit of the published figure's last digit (its rounding), plus what the preset leaves
// out by construction (named in its header). Hand counts of the presets, for reference: Qwen3-235B-A22B 235.094B
// total, 22.19B active, 233.85B without embedding and head; Mixtral 8x22B 140.63B / 39.16B; GPT-OSS-120B 116.789B
// total, 5.131B active without the input embedding.
TEST(Accounting, Issue33PresetsMatchTheirPublishedTotalsWithinRounding) {
  auto expect_near_published = [](double got, double published, double bound, const char* what) {
    EXPECT_LE(std::abs(got - published), bound) << what << ": got " << got << ", published " << published
                                                << ", bound " << bound;
  };
  // Qwen3-235B-A22B, model card of Qwen/Qwen3-235B-A22B (Hugging Face): "235B in total and 22B activated", "Number
  // of Paramaters (Non-Embedding): 234B". Every feature of the model is in the preset, so the bound is the rounding
  // alone: 0.5B. The card does not say whether 22B counts the embedding table; moetron's `active` (with it, 22.19B)
  // and `active_no_embed` (21.57B) are both within 0.5B.
  {
    const ParamCounts p = count_params(preset("qwen3_235b_a22b").model);
    expect_near_published(double(p.total), 235e9, 0.5e9, "qwen3_235b total");
    expect_near_published(double(p.active), 22e9, 0.5e9, "qwen3_235b active");
    expect_near_published(double(p.active_no_embed), 22e9, 0.5e9, "qwen3_235b active_no_embed");
    expect_near_published(double(p.total - p.embedding - p.head), 234e9, 0.5e9, "qwen3_235b non-embedding");
  }
  // Mixtral 8x22B, Mistral AI's announcement "Cheaper, Better, Faster, Stronger" (2024-04-17): "39B active
  // parameters out of 141B". Bound: the rounding, 0.5B, plus the vocabulary the count may use (32768 in the preset,
  // 32000 in the first conversion: 2 x 768 x 6144 = 9.4M): 0.5094B.
  {
    const ParamCounts p = count_params(preset("mixtral_8x22b").model);
    expect_near_published(double(p.total), 141e9, 0.5e9 + 9.4e6, "mixtral_8x22b total");
    expect_near_published(double(p.active), 39e9, 0.5e9 + 9.4e6, "mixtral_8x22b active");
  }
  // GPT-OSS-120B, OpenAI's gpt-oss-120b model card (arXiv 2508.10925): 116.8B total, 5.1B active. The active figure
  // leaves out the input embedding (a lookup): moetron's active_no_embed. Bound: the rounding, 0.05B, plus what the
  // preset cannot express and so does not count (configs/gpt_oss_120b.toml): biases and attention sinks, 40.1M of the
  // total and 1.54M of the active.
  {
    const ParamCounts p = count_params(preset("gpt_oss_120b").model);
    expect_near_published(double(p.total), 116.8e9, 0.05e9 + 40.1e6, "gpt_oss_120b total");
    expect_near_published(double(p.active_no_embed), 5.1e9, 0.05e9 + 1.54e6, "gpt_oss_120b active_no_embed");
  }
}

TEST(Accounting, PrimusProxiesAreNearTheirNominalSize) {
  // Only the total is checked (within 5%: "1T"/"2T" are round numbers); the published active figures
  // (44B, 80B) are below what the published dimensions give (57B, 94B): see configs/moe_1t.toml.
  expect_within(double(count_params(preset("moe_1t").model).total), 1e12, 0.05, "moe_1t");
  expect_within(double(count_params(preset("moe_2t").model).total), 2e12, 0.05, "moe_2t");
}

TEST(Accounting, DsMiniIsTheSpecifiedShape) {
  ModelSpec s = preset("ds_mini").model;
  EXPECT_EQ(s.vocab_size, 8192);
  EXPECT_EQ(s.d_model, 512);
  EXPECT_EQ(s.n_layers, 8);
  EXPECT_EQ(s.n_dense_layers(), 1);
  EXPECT_FALSE(s.is_moe_layer(0));
  EXPECT_EQ(s.inter_size, 1408);
  EXPECT_EQ(s.attn.type, AttnType::MHA);
  EXPECT_EQ(s.attn.n_heads, 8);
  EXPECT_EQ(s.attn.head_dim, 64);
  EXPECT_EQ(s.moe.n_routed_experts, 64);
  EXPECT_EQ(s.moe.topk, 6);
  EXPECT_EQ(s.moe.score_func, ScoreFunc::Softmax);
  EXPECT_EQ(s.moe.n_shared_experts, 2);
  EXPECT_EQ(s.moe.moe_inter_size, 176);
  EXPECT_FALSE(s.tie_embeddings);
  JobConfig c = preset("ds_mini");
  EXPECT_EQ(c.training.seq_len, 256);
  EXPECT_EQ(c.training.micro_batch_size, 8);
}

// ---- hand counts ------------------------------------------------------------------------------------

TEST(Accounting, HandCountMhaTiny) {
  ModelSpec s = preset("ds_tiny").model;  // V 512, d 64, 3 layers (1 dense), 4 heads x 16, E 8 top-2 + 1 shared
  ParamCounts p = count_params(s);
  const int64_t attn = 4 * 64 * 64;         // q, k, v, o: 64 x 64 each
  const int64_t norms = 2 * 64;
  const int64_t dense = 3 * 64 * 128;
  const int64_t expert = 3 * 64 * 32;
  const int64_t router = 8 * 64;
  EXPECT_EQ(p.layers[0].total(), attn + norms + dense);
  EXPECT_EQ(p.layers[1].total(), attn + norms + router + 8 * expert + expert);
  EXPECT_EQ(p.layers[1].routed_active, 2 * expert);
  EXPECT_EQ(p.layers[1].matmul_active, attn + router + 2 * expert + expert);
  EXPECT_EQ(p.embedding, 512 * 64);
  EXPECT_EQ(p.head, 512 * 64);
  EXPECT_EQ(p.total, 251328);
  EXPECT_EQ(p.total, 2 * 512 * 64 + 64 + (attn + norms + dense) + 2 * (attn + norms + router + 9 * expert));
  EXPECT_EQ(p.active, 2 * 512 * 64 + 64 + (attn + norms + dense) + 2 * (attn + norms + router + 3 * expert));
  EXPECT_EQ(p.active_no_embed, p.active - 512 * 64);
  EXPECT_EQ(p.routed_experts, 2 * 8 * expert);
  EXPECT_EQ(p.dense_part, p.total - p.routed_experts);
  // Tied embeddings: the head disappears, the table stays in the active count once.
  s.tie_embeddings = true;
  ParamCounts t = count_params(s);
  EXPECT_EQ(t.total, p.total - 512 * 64);
  EXPECT_EQ(t.active_no_embed, t.active);
}

TEST(Accounting, HandCountMlaTiny) {
  ModelSpec s = preset("ds_tiny_mla").model;  // d 64, 4 heads, q_lora 32, kv_lora 32, nope 16, rope 8, v 16
  const int64_t q = 64 * 32 + 32 + 32 * 4 * 24;  // q_a, q_a_norm, q_b
  const int64_t kv = 64 * (32 + 8) + 32 + 32 * 4 * (16 + 16);  // kv_a, kv_a_norm, kv_b
  const int64_t o = 4 * 16 * 64;
  LayerParams l1 = layer_params(s, 1);
  EXPECT_EQ(l1.attention, q + kv + o);
  EXPECT_EQ(l1.router, 8 * 64 + 8);  // aux_free: gate + per-expert bias
  EXPECT_EQ(l1.matmul_active, (q - 32) + (kv - 32) + o + 8 * 64 + 2 * 3 * 64 * 32 + 3 * 64 * 32);
  // Without q compression the q projection is plain.
  s.attn.q_lora_rank = 0;
  EXPECT_EQ(layer_params(s, 1).attention, 64 * 4 * 24 + kv + o);
  // qk_norm adds two head_dim vectors to GQA attention.
  ModelSpec g = preset("qwen3_30b_a3b").model;
  const int64_t mm = 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048;
  EXPECT_EQ(layer_params(g, 0).attention, mm + 2 * 128);
}

TEST(Accounting, LayerParamsRejectsBadLayer) {
  ModelSpec s = preset("ds_tiny").model;
  EXPECT_THROW(layer_params(s, 3), Error);
  EXPECT_THROW(layer_params(s, -1), Error);
}

// ---- FLOPs ------------------------------------------------------------------------------------------

TEST(Accounting, FlopsPerTokenByHand) {
  ModelSpec s = preset("ds_tiny").model;
  ParamCounts p = count_params(s);
  const int64_t S = 32;
  FlopsPerToken f = flops_per_token(s, S);
  double mm = 2.0 * 512 * 64;  // head
  for (const auto& l : p.layers) mm += 2.0 * double(l.matmul_active);
  const double attn_layer = 2.0 * 4 * (16 + 16) * (S + 1) / 2.0;
  EXPECT_DOUBLE_EQ(f.fwd_matmul, mm);
  EXPECT_DOUBLE_EQ(f.fwd_attention, 3 * attn_layer);
  EXPECT_DOUBLE_EQ(f.train, 3.0 * (mm + 3 * attn_layer));
  EXPECT_DOUBLE_EQ(f.hw_train, f.train);
  ASSERT_EQ(f.layer_fwd.size(), 3u);
  EXPECT_DOUBLE_EQ(f.layer_fwd[1], 2.0 * double(p.layers[1].matmul_active) + attn_layer);
  // Without causal masking every query sees all S keys.
  FlopsPerToken nc = flops_per_token(s, S, false);
  EXPECT_DOUBLE_EQ(nc.fwd_attention, 3 * 2.0 * 4 * 32 * S);
  // The matmul part is 2 x (active params without the input embedding, minus norm vectors).
  const double vecs = 3 * 2 * 64 + 64;  // per-layer norms + final norm
  EXPECT_DOUBLE_EQ(f.fwd_matmul, 2.0 * (double(p.active_no_embed) - vecs));
  EXPECT_THROW(flops_per_token(s, 0), Error);
}

TEST(Accounting, RecomputeAddsForwardWork) {
  ModelSpec s = preset("ds_tiny").model;
  FlopsPerToken base = flops_per_token(s, 32);
  ActivationCheckpointSpec full{AcMode::Full, {}, {}};
  EXPECT_DOUBLE_EQ(flops_per_token(s, 32, true, full).hw_train,
                   base.train + base.layer_fwd[0] + base.layer_fwd[1] + base.layer_fwd[2]);
  ActivationCheckpointSpec some{AcMode::Full, {1}, {}};
  EXPECT_DOUBLE_EQ(flops_per_token(s, 32, true, some).hw_train, base.train + base.layer_fwd[1]);
  ActivationCheckpointSpec core{AcMode::Selective, {}, {"attention_core", "moe_act"}};
  EXPECT_DOUBLE_EQ(flops_per_token(s, 32, true, core).hw_train, base.train + base.fwd_attention);
  EXPECT_DOUBLE_EQ(flops_per_token(s, 32, true, full).train, base.train);  // model FLOPs do not change
}

TEST(Accounting, DeepSeekV3FlopsAreNearSixTimesActive) {
  // Sanity against the 6N rule: at 4K context attention adds ~14% to 6 x active matmul weights.
  JobConfig c = preset("deepseek_v3");
  ParamCounts p = count_params(c.model);
  FlopsPerToken f = flops_per_token(c.model, c.training.seq_len);
  EXPECT_GT(f.train, 6.0 * double(p.active_no_embed) * 0.99);
  EXPECT_LT(f.train, 6.0 * double(p.active_no_embed) * 1.2);
}

// ---- saved activations ------------------------------------------------------------------------------

TEST(Accounting, ActivationTermsOfAnMhaDenseAndMoeLayer) {
  ModelSpec s = preset("ds_tiny").model;
  const int64_t B = 2, S = 8, T = 16, d = 64;
  auto dense = terms(layer_activation_terms(s, 0, B, S, Precision::BF16, {}));
  const std::map<std::string, int64_t> want_dense = {
      {"attn_norm.x", T * d * 2},   {"attn_norm.rstd", T * 4},     {"attn_norm.out", T * d * 2},
      {"attn.q", T * 64 * 2},       {"attn.k", T * 64 * 2},        {"attn.v", T * 64 * 2},
      {"attn.out", T * 64 * 2},     {"attn.lse", B * 4 * S * 4},   {"ffn_norm.x", T * d * 2},
      {"ffn_norm.rstd", T * 4},     {"ffn_norm.out", T * d * 2},   {"mlp.gate_up", T * 256 * 2},
      {"mlp.act", T * 128 * 2}};
  EXPECT_EQ(dense, want_dense);
  auto moe = terms(layer_activation_terms(s, 1, B, S, Precision::BF16, {}));
  const int64_t R = T * 2;  // dropless: T * topk rows
  EXPECT_EQ(moe.count("mlp.gate_up"), 0u);
  EXPECT_EQ(moe.at("router.scores"), T * 8 * 4);
  EXPECT_EQ(moe.at("router.topk_idx"), T * 2 * 4);
  EXPECT_EQ(moe.at("router.topk_w"), T * 2 * 4);
  EXPECT_EQ(moe.at("moe.row_map"), R * 4);
  EXPECT_EQ(moe.at("moe.x"), R * d * 2);
  EXPECT_EQ(moe.at("moe.gate_up"), R * 64 * 2);
  EXPECT_EQ(moe.at("moe.act"), R * 32 * 2);
  EXPECT_EQ(moe.at("moe.y"), R * d * 2);
  EXPECT_EQ(moe.at("shared.gate_up"), T * 64 * 2);
  EXPECT_EQ(moe.at("shared.act"), T * 32 * 2);
  EXPECT_EQ(moe.count("router.logits"), 0u);
  s.moe.z_loss_coef = 1e-3;  // z-loss needs the raw logits
  EXPECT_EQ(terms(layer_activation_terms(s, 1, B, S, Precision::BF16, {})).at("router.logits"), T * 8 * 4);
}

TEST(Accounting, ActivationTermsOfMla) {
  ModelSpec s = preset("ds_tiny_mla").model;
  const int64_t T = 8;
  auto m = terms(layer_activation_terms(s, 1, 1, 8, Precision::BF16, {}));
  EXPECT_EQ(m.at("attn.q_a"), T * 32 * 2);
  EXPECT_EQ(m.at("attn.q_a_norm.out"), T * 32 * 2);
  EXPECT_EQ(m.at("attn.kv_a"), T * (32 + 8) * 2);
  EXPECT_EQ(m.at("attn.kv_a_norm.out"), T * 32 * 2);
  EXPECT_EQ(m.at("attn.q"), T * 4 * 24 * 2);
  EXPECT_EQ(m.at("attn.k"), T * 4 * 24 * 2);
  EXPECT_EQ(m.at("attn.v"), T * 4 * 16 * 2);
  EXPECT_EQ(m.at("attn.out"), T * 4 * 16 * 2);
}

TEST(Accounting, PrecisionChangesElementSizes) {
  ModelSpec s = preset("ds_tiny").model;
  auto bf = terms(layer_activation_terms(s, 1, 2, 8, Precision::BF16, {}));
  auto f32 = terms(layer_activation_terms(s, 1, 2, 8, Precision::FP32, {}));
  auto f8 = terms(layer_activation_terms(s, 1, 2, 8, Precision::FP8, {}));
  EXPECT_EQ(f32.at("attn.q"), 2 * bf.at("attn.q"));
  EXPECT_EQ(f32.at("moe.x"), 2 * bf.at("moe.x"));
  EXPECT_EQ(f32.at("attn_norm.rstd"), bf.at("attn_norm.rstd"));  // fp32 either way
  // FP8 keeps GEMM inputs quantized (1 byte), everything else bf16.
  EXPECT_EQ(2 * f8.at("moe.x"), bf.at("moe.x"));
  EXPECT_EQ(2 * f8.at("moe.act"), bf.at("moe.act"));
  EXPECT_EQ(2 * f8.at("attn_norm.out"), bf.at("attn_norm.out"));
  EXPECT_EQ(f8.at("moe.gate_up"), bf.at("moe.gate_up"));
  EXPECT_EQ(f8.at("attn.q"), bf.at("attn.q"));
  EXPECT_EQ(f8.at("moe.y"), bf.at("moe.y"));
}

TEST(Accounting, CheckpointingDropsNamedTerms) {
  ModelSpec s = preset("ds_tiny").model;
  auto none = terms(layer_activation_terms(s, 1, 2, 8, Precision::BF16, {}));
  ActivationCheckpointSpec core{AcMode::Selective, {}, {"attention_core"}};
  auto c = terms(layer_activation_terms(s, 1, 2, 8, Precision::BF16, core));
  EXPECT_EQ(c.count("attn.out") + c.count("attn.lse"), 0u);
  EXPECT_EQ(c.size(), none.size() - 2);
  ActivationCheckpointSpec act{AcMode::Selective, {}, {"moe_act"}};
  auto a = terms(layer_activation_terms(s, 1, 2, 8, Precision::BF16, act));
  EXPECT_EQ(a.count("moe.act") + a.count("shared.act"), 0u);
  EXPECT_EQ(a.size(), none.size() - 2);
  EXPECT_EQ(terms(layer_activation_terms(s, 0, 2, 8, Precision::BF16, act)).count("mlp.act"), 1u);  // dense kept
  ActivationCheckpointSpec norm{AcMode::Selective, {}, {"norm"}};
  auto n = terms(layer_activation_terms(s, 1, 2, 8, Precision::BF16, norm));
  EXPECT_EQ(n.count("attn_norm.out") + n.count("ffn_norm.out"), 0u);
  EXPECT_EQ(n.count("attn_norm.x"), 1u);
  EXPECT_EQ(n.count("attn_norm.rstd"), 1u);
  ActivationCheckpointSpec full{AcMode::Full, {}, {}};
  auto f = terms(layer_activation_terms(s, 1, 2, 8, Precision::BF16, full));
  EXPECT_EQ(f, (std::map<std::string, int64_t>{{"layer.input", 16 * 64 * 2}}));
  // layer_ids restricts the mode to those layers.
  ActivationCheckpointSpec only0{AcMode::Full, {0}, {}};
  EXPECT_EQ(terms(layer_activation_terms(s, 1, 2, 8, Precision::BF16, only0)), none);
}

TEST(Accounting, ActivationTotalsAndRecomputeTransient) {
  JobConfig c = preset("ds_tiny");
  ActivationBytes none = activation_bytes(c);
  int64_t sum = none.outside.total();
  for (const auto& l : none.layers) sum += l.total();
  EXPECT_EQ(none.total, sum);
  EXPECT_EQ(none.recompute_transient, 0);
  const int64_t T = c.training.micro_batch_size * c.training.seq_len;
  auto out = terms(none.outside);
  EXPECT_EQ(out.at("loss.dx"), T * 64 * 4);  // dL/dx kept from the fused head's forward to the backward
  EXPECT_EQ(out.at("embed.ids"), T * 4);
  c.activation_checkpoint.mode = AcMode::Full;
  ActivationBytes full = activation_bytes(c);
  EXPECT_EQ(full.total, none.outside.total() + 3 * T * 64 * 2);
  EXPECT_EQ(full.recompute_transient, std::max(none.layers[0].total(), none.layers[1].total()));
  EXPECT_LT(full.total, none.total);
}

TEST(Accounting, CapacityFactorBoundsRoutedRows) {
  ModelSpec s = preset("ds_tiny").model;  // E 8, top-2
  EXPECT_EQ(routed_rows(s, 100), 200);
  s.moe.capacity_factor = 1.0;
  EXPECT_EQ(routed_rows(s, 100), 200);  // 8 * ceil(25)
  s.moe.capacity_factor = 1.25;
  EXPECT_EQ(routed_rows(s, 100), 8 * 32);  // ceil(31.25) = 32
  s.moe.capacity_factor = 1.3;
  EXPECT_EQ(routed_rows(s, 10), 8 * 4);  // ceil(3.25)
  auto m = terms(layer_activation_terms(s, 1, 1, 10, Precision::BF16, {}));
  EXPECT_EQ(m.at("moe.x"), 8 * 4 * 64 * 2);
}

// ---- size checks in double ----------------------------------------------------------------------------

TEST(Accounting, ActivationSizeInDoubleAgreesWithTheInt64Figures) {
  for (const char* name : {"ds_tiny", "ds_tiny_mla", "ds_mini", "deepseek_v3"}) {
    SCOPED_TRACE(name);
    JobConfig c = preset(name);
    const ModelSpec& s = c.model;
    const int64_t B = c.training.micro_batch_size, S = c.training.seq_len;
    for (Precision p : {Precision::BF16, Precision::FP32, Precision::FP8}) {
      const int64_t a = p == Precision::FP32 ? 4 : 2, g = p == Precision::FP8 ? 1 : a;
      for (const ActivationCheckpointSpec& ac :
           {ActivationCheckpointSpec{}, ActivationCheckpointSpec{AcMode::Full, {}, {}},
            ActivationCheckpointSpec{AcMode::Selective, {}, {"norm", "moe_act"}}}) {
        ActivationBytes ib = activation_bytes(s, B, S, p, ac);
        ActivationSize ds = activation_size(s, B, S, a, g, ac);
        EXPECT_EQ(ds.total, double(ib.total)) << to_string(p) << " " << to_string(ac.mode);
        int64_t largest = 0;
        for (const auto& l : ib.layers)
          for (const auto& t : l.terms) largest = std::max(largest, t.bytes);
        for (const auto& t : ib.outside.terms) largest = std::max(largest, t.bytes);
        EXPECT_EQ(ds.largest_bytes, double(largest));
      }
    }
  }
  // A shape whose int64 byte count would overflow stays finite and ordered in double.
  ModelSpec s = preset("ds_tiny").model;
  s.d_model = int64_t(1) << 24;
  const ActivationSize huge = activation_size(s, int64_t(1) << 24, int64_t(1) << 24, 4, 4);
  EXPECT_GT(huge.total, 1e20);
  EXPECT_TRUE(std::isfinite(huge.total));
  EXPECT_EQ(huge.largest, "moe.x");  // [T * topk, d] rows: the widest term at d = 2^24 (first of moe.x, moe.y)
  EXPECT_EQ(huge.largest_bytes, 2.0 * 4 * std::ldexp(1.0, 48) * std::ldexp(1.0, 24));
}

// A GPT-style dense layer (model.ffn = gelu, model.dropout > 0): two MLP matrices, the GELU's input and output
// kept, a 1-byte mask per dropout (attention output, MLP output, embedding); recompute drops them like the rest.
TEST(Accounting, GeluAndDropoutTermsByHand) {
  ModelSpec s = preset("ds_tiny", {"--model.n_routed_experts=0", "--model.n_shared_experts=0", "--model.ffn=gelu",
                                   "--model.dropout=0.1"}).model;
  const int64_t B = 2, S = 8, T = 16, d = 64, I = 128, attn = 4 * 64 * 64;
  const ParamCounts p = count_params(s);
  EXPECT_EQ(p.layers[0].dense_mlp, 2 * d * I);
  EXPECT_EQ(p.total, 2 * 512 * 64 + 64 + 3 * (attn + 2 * d + 2 * d * I));
  const FlopsPerToken f = flops_per_token(s, S);
  EXPECT_DOUBLE_EQ(f.fwd_matmul, 2.0 * (3 * (attn + 2 * d * I) + 512 * 64));
  auto dense = terms(layer_activation_terms(s, 0, B, S, Precision::BF16, {}));
  EXPECT_EQ(dense.count("mlp.gate_up"), 0u);
  EXPECT_EQ(dense.at("mlp.up"), T * I * 2);
  EXPECT_EQ(dense.at("mlp.act"), T * I * 2);
  EXPECT_EQ(dense.at("attn.dropout_mask"), T * d);
  EXPECT_EQ(dense.at("mlp.dropout_mask"), T * d);
  const ActivationBytes all = activation_bytes(s, B, S, Precision::BF16);
  EXPECT_EQ(terms(all.outside).at("embed.dropout_mask"), T * d);
  // Selective recompute of the attention core keeps the masks; full recompute keeps the layer input only.
  ActivationCheckpointSpec sel;
  sel.mode = AcMode::Selective;
  sel.modules = {"attention_core"};
  auto kept = terms(layer_activation_terms(s, 0, B, S, Precision::BF16, sel));
  EXPECT_EQ(kept.at("attn.dropout_mask"), T * d);
  EXPECT_EQ(kept.count("attn.out"), 0u);
  ActivationCheckpointSpec full;
  full.mode = AcMode::Full;
  EXPECT_EQ(terms(layer_activation_terms(s, 0, B, S, Precision::BF16, full)).size(), 1u);
  // Sharded (the planner): sequence parallelism splits the masks over tp with the residual region.
  ActShard sh;
  sh.tp = 2, sh.sp = true;
  const double whole = sharded_layer_bytes(s, 0, B, S, 2, 2, {}, {}), split = sharded_layer_bytes(s, 0, B, S, 2, 2, {}, sh);
  EXPECT_DOUBLE_EQ(split, whole / 2);
  EXPECT_EQ(activation_term_keys(s, "mlp.dropout_mask"), "model.dropout = 0.1, model.d_model = 64");
  EXPECT_EQ(activation_term_keys(s, "mlp.up"), "model.inter_size = 128");
}

TEST(Accounting, ActivationTermKeysNameTheWidths) {
  ModelSpec s = preset("ds_tiny").model;
  EXPECT_EQ(activation_term_keys(s, "moe.gate_up"), "model.topk = 2, model.moe_inter_size = 32");
  EXPECT_EQ(activation_term_keys(s, "loss.dx"), "model.d_model = 64");
  EXPECT_EQ(activation_term_keys(s, "router.scores"), "model.n_routed_experts = 8");
  EXPECT_EQ(activation_term_keys(s, "attn.q"), "model.n_heads = 4, model.head_dim = 16");
  EXPECT_EQ(activation_term_keys(s, "attn_norm.x"), "model.d_model = 64");
  EXPECT_EQ(activation_term_keys(s, "mlp.gate_up"), "model.inter_size = 128");
}

// ---- per-rank memory estimate -------------------------------------------------------------------------

TEST(Accounting, MemoryEstimateShardsAsTheTrainerDoes) {
  // Hand formulas from the parameter counts (P all, R routed experts): fp32 grads, AdamW m + v in fp32,
  // fp32 + bf16 parameters plus two bf16 layouts of the packed experts.
  JobConfig c = preset("ds_tiny");
  const ParamCounts pc = count_params(c.model);
  const double P = double(pc.total), R = double(pc.routed_experts);
  auto est = [&](std::vector<std::string> ov) { return estimate_memory(preset("ds_tiny", ov), 2, 1); };
  const MemoryEstimate one = est({});
  EXPECT_EQ(one.grads, 4 * P);
  EXPECT_EQ(one.optimizer, 8 * P);
  EXPECT_GE(one.params - 6 * P, 4 * R);         // packed experts: at least 2 x bf16 of every expert weight
  EXPECT_LE(one.params - 6 * P, 4 * R * 1.25);  // ... and little padding
  EXPECT_EQ(one.comm, 0);
  // ZeRO-1 over 4 ranks: the optimizer state is a quarter, nothing else changes.
  const MemoryEstimate z1 =
      est({"--parallelism.dp_shard=4", "--parallelism.zero=1", "--training.global_batch_size=16"});
  EXPECT_EQ(z1.optimizer, 8 * P / 4);
  EXPECT_EQ(z1.grads, one.grads);
  EXPECT_EQ(z1.params, one.params);
  EXPECT_GT(z1.comm, 0);  // the all-reduce workspace
  // EP over 2 ranks (dp 2): each rank holds half of the routed experts.
  const MemoryEstimate ep = est({"--parallelism.dp_shard=2", "--parallelism.ep=2"});
  EXPECT_EQ(ep.grads, 4 * (P - R / 2));
  EXPECT_EQ(ep.optimizer, 8 * (P - R / 2));
  // FSDP over 4 ranks: a quarter of everything plus one gathered unit. ds_tiny's largest unit is a MoE
  // layer: attention 4*64*64, norms 2*64, router 8*64, 8 + 1 experts of 3*64*32.
  const double unit = 4 * 64 * 64 + 2 * 64 + 8 * 64 + 9 * 3 * 64 * 32;
  const MemoryEstimate z3 =
      est({"--parallelism.dp_shard=4", "--parallelism.zero=3", "--training.global_batch_size=16"});
  EXPECT_EQ(z3.optimizer, 8 * P / 4);
  EXPECT_EQ(z3.grads, 4 * (P / 4 + unit));
  // HSDP 2 x 2 (dp_replicate x dp_shard, zero 3): sharded over dp_shard = 2 only, so every state term is FSDP's over
  // 2 ranks (not over the 4 data-parallel ranks); the replicas' all-reduce adds a workspace of the gradient shard.
  const std::string hsdp_gb = "--training.global_batch_size=16";
  const MemoryEstimate hs =
      est({"--parallelism.dp_replicate=2", "--parallelism.dp_shard=2", "--parallelism.zero=3", hsdp_gb});
  const MemoryEstimate f2 = est({"--parallelism.dp_shard=2", "--parallelism.zero=3"});
  EXPECT_EQ(hs.optimizer, 8 * P / 2);
  EXPECT_EQ(hs.grads, 4 * (P / 2 + unit));
  EXPECT_EQ(hs.optimizer, f2.optimizer);
  EXPECT_EQ(hs.grads, f2.grads);
  EXPECT_EQ(hs.params, f2.params);
  EXPECT_EQ(hs.comm, f2.comm + 4 * P / 2);
  // ... and with EP 2 inside each shard group: the experts' shard is over the dp_shard / ep = 1 rank holding them.
  const MemoryEstimate hse = est({"--parallelism.dp_replicate=2", "--parallelism.dp_shard=2", "--parallelism.zero=3",
                                  "--parallelism.ep=2", hsdp_gb});
  EXPECT_EQ(hse.optimizer, 8 * ((P - R) / 2 + R / 2));
  // Activations: linear in the micro-batch (up to the per-expert counters); checkpointing saves them;
  // fp32 GEMM inputs cost more than bf16.
  const MemoryEstimate b8 = est({"--training.micro_batch_size=8", "--training.global_batch_size=8"});
  EXPECT_NEAR(b8.activations / one.activations, 2.0, 1e-3);
  const MemoryEstimate full = est({"--activation_checkpoint.mode=full"});
  const MemoryEstimate sel = est({"--activation_checkpoint.mode=selective", "--activation_checkpoint.modules=[norm]"});
  EXPECT_LT(full.activations, sel.activations);
  EXPECT_LT(sel.activations, one.activations);
  EXPECT_GT(sel.build_peak, 0);  // every layer's full set exists while the model is built
  EXPECT_EQ(one.build_peak, 0);
  // fp32 compute: no bf16 copy of the parameters, the experts packed in fp32 (at least 2 x 4 bytes each).
  const MemoryEstimate f32 = estimate_memory(c, 4, 1);
  EXPECT_GE(f32.params - 4 * P, 8 * R);
  EXPECT_LE(f32.params - 4 * P, 8 * R * 1.25);
  EXPECT_EQ(f32.grads, one.grads);
  EXPECT_GT(f32.activations, one.activations);
  EXPECT_THROW(estimate_memory(c, 3, 1), Error);
  // Kernel workspace has a per-thread part (attention tiles, the grouped GEMMs' packing slots).
  EXPECT_GE(estimate_memory(c, 2, 64).workspace, one.workspace);
}
