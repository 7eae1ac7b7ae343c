// test_config.cpp: JobConfig loading (TOML + overrides), every error path (messages name the key, the
// line and a suggestion), the size limits (absurd values rejected by name, within a second), to_toml /
// JSON round trips, the presets, and HF config.json import/export.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "moetron/accounting.h"
#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/config_notes.h"
#include "test_util.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {
const fs::path kRoot = MOETRON_SOURCE_DIR;  // the source tree (not __FILE__, which a compiler cache may make relative)
std::string preset(const std::string& name) { return (kRoot / "configs" / (name + ".toml")).string(); }
std::string hf_fixture(const std::string& name) { return (kRoot / "tests/data/hf" / (name + ".json")).string(); }

const std::vector<std::string> kPresets = {"ds_tiny",         "ds_tiny_mla",   "ds_mini",      "deepseek_v2_lite",
                                           "deepseek_v2",     "deepseek_v3",   "mixtral_8x7b", "qwen3_30b_a3b",
                                           "llama4_scout",    "moe_1t",        "moe_2t",       "qwen3_235b_a22b",
                                           "mixtral_8x22b",   "gpt_oss_120b"};

// A minimal valid config; tests break one thing at a time.
const char* kTiny = R"(
[model]
vocab_size = 64
d_model = 32
n_layers = 2
first_k_dense = 1
inter_size = 64
n_heads = 4
n_routed_experts = 4
moe_inter_size = 16
topk = 2

[training]
seq_len = 16
micro_batch_size = 2
global_batch_size = 4
)";

using moetron::testing::error_of;
std::string load_error(const std::string& toml, std::vector<std::string> overrides = {}) {
  return error_of([&] { load_config_string(toml, overrides, "test.toml"); });
}
#define EXPECT_HAS(msg, sub) EXPECT_NE((msg).find(sub), std::string::npos) << "message: " << (msg)
}  // namespace

// ---- loading and defaults ---------------------------------------------------------------------------

TEST(Config, MinimalConfigLoadsWithDefaultsAndDerivedValues) {
  JobConfig c = load_config_string(kTiny);
  EXPECT_EQ(c.model.d_model, 32);
  EXPECT_EQ(c.model.attn.type, AttnType::MHA);
  EXPECT_EQ(c.model.attn.n_kv_heads, 4);  // derived: mha
  EXPECT_EQ(c.model.attn.head_dim, 8);    // derived: d_model / n_heads
  EXPECT_EQ(c.model.n_moe_layers(), 1);
  EXPECT_FALSE(c.model.is_moe_layer(0));
  EXPECT_TRUE(c.model.is_moe_layer(1));
  EXPECT_EQ(c.optimizer.name, "adamw");
  EXPECT_EQ(c.training.compute_dtype, ComputeDtype::Auto);
  EXPECT_EQ(c.parallelism.ep_dispatcher, EpDispatcher::AllToAll);
}

TEST(Config, GlobalBatchDefaultsToMicroBatchTimesDp) {
  std::string t = kTiny;
  t.replace(t.find("global_batch_size = 4"), 21, "");
  JobConfig c = load_config_string(t, {"--parallelism.dp_shard=2"});
  EXPECT_EQ(c.training.global_batch_size, 4);
}

TEST(Config, EveryPresetLoadsValidatesAndRoundTripsThroughToml) {
  for (const auto& name : kPresets) {
    SCOPED_TRACE(name);
    JobConfig c = load_config(preset(name));
    EXPECT_EQ(c.job.name, name);
    std::string text = to_toml(c);
    JobConfig back = load_config_string(text, {}, name + " (to_toml)");
    EXPECT_EQ(back, c);
    EXPECT_EQ(to_toml(back), text);
  }
}

TEST(Config, JsonRoundTrip) {
  for (const auto& name : {"ds_tiny", "deepseek_v3", "qwen3_30b_a3b"}) {
    SCOPED_TRACE(name);
    JobConfig c = load_config(preset(name), {"--activation_checkpoint.mode=selective",
                                             "--activation_checkpoint.modules=[norm, moe_act]",
                                             "--activation_checkpoint.layer_ids=[0,2]"});
    nlohmann::json j = to_json(c);
    EXPECT_EQ(j["model"]["d_model"], c.model.d_model);
    EXPECT_EQ(j["activation_checkpoint"]["modules"][1], "moe_act");
    EXPECT_EQ(config_from_json(j), c);
    EXPECT_EQ(config_from_json(nlohmann::json::parse(j.dump())), c);
  }
  nlohmann::json j = to_json(load_config_string(kTiny));
  j["training"]["steps"] = "ten";
  std::string m = error_of([&] { config_from_json(j); });
  EXPECT_HAS(m, "training.steps: expected integer");
  j = to_json(load_config_string(kTiny));
  j["traning"] = {{"steps", 5}};
  m = error_of([&] { config_from_json(j); });
  EXPECT_HAS(m, "did you mean 'training.steps'?");
  // A checkpoint written before a key was retired still loads: retired keys in stored JSON are skipped, while
  // an unknown key in the same section is still an error.
  const JobConfig tiny = load_config_string(kTiny);
  j = to_json(tiny);
  j["parallelism"]["pipeline_layout"] = "";
  j["training"]["dtype"] = "bf16";
  EXPECT_EQ(config_from_json(j), tiny);
  j["parallelism"]["pipeline_layuot"] = "";
  EXPECT_HAS(error_of([&] { config_from_json(j); }), "unknown key 'parallelism.pipeline_layuot'");
}

TEST(Config, TomlFloatsAndStringsAreWrittenExactly) {
  JobConfig c = load_config_string(kTiny, {"--optimizer.lr=0.1", "--model.norm_eps=1e-06", "--training.max_norm=3",
                                           "--job.description=quote \" backslash \\ tab\t end"});
  std::string t = to_toml(c);
  EXPECT_HAS(t, "lr = 0.1\n");
  EXPECT_HAS(t, "max_norm = 3.0\n");
  EXPECT_EQ(load_config_string(t), c);
}

TEST(Config, ConfigKeysAreUniqueAndCoverEverySection) {
  auto keys = config_keys();
  std::set<std::string> uniq(keys.begin(), keys.end());
  EXPECT_EQ(uniq.size(), keys.size());
  std::set<std::string> secs;
  for (const auto& k : keys) secs.insert(k.substr(0, k.find('.')));
  EXPECT_EQ(secs, (std::set<std::string>{"job", "model", "training", "optimizer", "lr_scheduler", "parallelism",
                                         "checkpoint", "activation_checkpoint", "quantize", "comm", "metrics",
                                         "profiling", "hardware"}));
  for (const char* k : {"model.q_lora_rank", "model.dense_layers", "model.drop_policy", "parallelism.fp8_dispatch",
                        "parallelism.pp_layout", "activation_checkpoint.modules", "metrics.peak_tflops"})
    EXPECT_TRUE(uniq.count(k)) << k;
}

// ---- overrides --------------------------------------------------------------------------------------

TEST(Config, OverridesParseByFieldType) {
  JobConfig c = load_config_string(kTiny, {
                                              "--training.steps=123",            // int
                                              "--optimizer.lr=2.5e-4",           // float
                                              "--metrics.jsonl=false",           // bool
                                              "--job.name=run 7",                // string
                                              "--job.dump_folder=\"/tmp/x y\"",  // quoted string
                                              "--model.score_func=sigmoid",      // enum
                                              "--model.first_k_dense=0",
                                              "--model.dense_layers=[0]",                     // int list
                                              "--activation_checkpoint.mode=selective",       //
                                              "--activation_checkpoint.modules=[\"norm\"]",   // string list
                                              "training.seed=7",                              // no leading --
                                          });
  EXPECT_EQ(c.training.steps, 123);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2.5e-4);
  EXPECT_FALSE(c.metrics.jsonl);
  EXPECT_EQ(c.job.name, "run 7");
  EXPECT_EQ(c.job.dump_folder, "/tmp/x y");
  EXPECT_EQ(c.model.moe.score_func, ScoreFunc::Sigmoid);
  EXPECT_EQ(c.model.dense_layers, std::vector<int>{0});
  EXPECT_EQ(c.activation_checkpoint.modules, std::vector<std::string>{"norm"});
  EXPECT_EQ(c.training.seed, 7);
  // Lists without brackets, empty lists, ints for floats.
  c = load_config_string(kTiny, {"--model.first_k_dense=0", "--model.dense_layers=0", "--optimizer.lr=1"});
  EXPECT_EQ(c.model.dense_layers, std::vector<int>{0});
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1.0);
  c = load_config_string(kTiny, {"--model.dense_layers=[]"});
  EXPECT_TRUE(c.model.dense_layers.empty());
  // Later overrides win.
  c = load_config_string(kTiny, {"--training.steps=1", "--training.steps=2"});
  EXPECT_EQ(c.training.steps, 2);
}

TEST(Config, OverrideErrors) {
  std::string m = load_error(kTiny, {"--traning.steps=5"});
  EXPECT_HAS(m, "unknown key 'traning.steps'; did you mean 'training.steps'?");
  m = load_error(kTiny, {"--training.steps=abc"});
  EXPECT_HAS(m, "training.steps: expected integer, got 'abc'");
  m = load_error(kTiny, {"--training.steps=1.5"});
  EXPECT_HAS(m, "training.steps: expected integer, got '1.5'");
  m = load_error(kTiny, {"--optimizer.lr=fast"});
  EXPECT_HAS(m, "optimizer.lr: expected float, got 'fast'");
  m = load_error(kTiny, {"--metrics.jsonl=maybe"});
  EXPECT_HAS(m, "metrics.jsonl: expected boolean, got 'maybe'");
  m = load_error(kTiny, {"--model.attn_type=mlx"});
  EXPECT_HAS(m, "model.attn_type: expected one of mha|gqa|mla, got 'mlx'");
  m = load_error(kTiny, {"--model.ffn=relu"});
  EXPECT_HAS(m, "model.ffn: expected one of swiglu|gelu, got 'relu'");
  m = load_error(kTiny, {"--model.dense_layers=[1,x]"});
  EXPECT_HAS(m, "model.dense_layers: expected array of integers");
  m = load_error(kTiny, {"--model.dense_layers=[1"});
  EXPECT_HAS(m, "model.dense_layers");
  m = load_error(kTiny, {"--training.steps"});
  EXPECT_HAS(m, "expected --section.key=value");
  m = load_error(kTiny, {"--steps=3"});
  EXPECT_HAS(m, "unknown key 'steps'; did you mean 'training.steps'?");
}

// ---- TOML errors ------------------------------------------------------------------------------------

TEST(Config, UnknownSectionNamesKeyLineAndSuggestion) {
  std::string m = load_error(std::string(kTiny) + "\n[traning]\nsteps = 5\n");
  EXPECT_HAS(m, "unknown key 'traning.steps'; did you mean 'training.steps'?");
  EXPECT_HAS(m, "test.toml:19:");
}

TEST(Config, UnknownKeyNamesKeyLineAndSuggestion) {
  std::string m = load_error("[training]\nstep = 5\n");
  EXPECT_HAS(m, "test.toml:2: unknown key 'training.step'; did you mean 'training.steps'?");
  m = load_error("[model]\nn_head = 4\n");
  EXPECT_HAS(m, "did you mean 'model.n_heads'?");
  m = load_error("[model]\nlr = 0.1\n");  // right key, wrong section
  EXPECT_HAS(m, "unknown key 'model.lr'; did you mean 'optimizer.lr'?");
  m = load_error("steps = 5\n");  // top level
  EXPECT_HAS(m, "unknown key 'steps'; did you mean 'training.steps'?");
  m = load_error("[model]\nfrobnicate = 1\n");  // nothing close: no suggestion
  EXPECT_HAS(m, "unknown key 'model.frobnicate'");
  EXPECT_EQ(m.find("did you mean"), std::string::npos) << m;
  m = load_error("inherit = \"ds_tiny.toml\"\n");  // presets are flat
  EXPECT_HAS(m, "unknown key 'inherit'");
  m = load_error("training = 5\n");  // a section given as a value
  EXPECT_HAS(m, "test.toml:1: training: expected a table ([training]), got integer");
  m = load_error("[model.moe]\ntopk = 2\n");  // no nested tables
  EXPECT_HAS(m, "unknown key 'model.moe'");
}

// The retired training.dtype never does nothing: file and override both name the replacement key.
TEST(Config, RetiredDtypeKeyNamesItsReplacement) {
  std::string m = load_error("[training]\ndtype = \"fp32\"\n");
  EXPECT_HAS(m, "test.toml:2: key 'training.dtype' was retired");
  EXPECT_HAS(m, "training.compute_dtype = \"auto\" | \"bf16\" | \"fp32\"");
  try {
    JobConfig c;
    apply_override(c, "--training.dtype=bf16");
    ADD_FAILURE() << "override of the retired key accepted";
  } catch (const Error& e) {
    EXPECT_HAS(std::string(e.what()), "key 'training.dtype' was retired");
  }
  JobConfig c;
  for (auto [text, want] : {std::pair{"auto", ComputeDtype::Auto}, {"bf16", ComputeDtype::BF16}, {"fp32", ComputeDtype::FP32}}) {
    apply_override(c, std::string("--training.compute_dtype=") + text);
    EXPECT_EQ(c.training.compute_dtype, want) << text;
  }
  m = load_error("[training]\ncompute_dtype = \"fp8\"\n");
  EXPECT_HAS(m, "training.compute_dtype");
}

TEST(Config, WrongTypesNameKeyExpectedAndGot) {
  std::string m = load_error("[training]\nsteps = \"ten\"\n");
  EXPECT_HAS(m, "test.toml:2: training.steps: expected integer, got string");
  m = load_error("[training]\nsteps = 1.5\n");
  EXPECT_HAS(m, "training.steps: expected integer, got float");
  m = load_error("[optimizer]\nlr = \"0.1\"\n");
  EXPECT_HAS(m, "optimizer.lr: expected float, got string");
  m = load_error("[model]\ntie_embeddings = 1\n");
  EXPECT_HAS(m, "model.tie_embeddings: expected boolean, got integer");
  m = load_error("[model]\ndense_layers = [\"a\"]\n");
  EXPECT_HAS(m, "model.dense_layers: expected array of integers, got array containing a string");
  m = load_error("[model]\ndense_layers = 3\n");
  EXPECT_HAS(m, "model.dense_layers: expected array of integers, got integer");
  m = load_error("[model]\nattn_type = \"MLA\"\n");
  EXPECT_HAS(m, "test.toml:2: model.attn_type: expected one of mha|gqa|mla, got 'MLA'");
  m = load_error("[activation_checkpoint]\nmodules = \"norm\"\n");
  EXPECT_HAS(m, "activation_checkpoint.modules: expected array of strings, got string");
  m = load_error("[model]\ndense_layers = [99999999999]\n");
  EXPECT_HAS(m, "model.dense_layers: value 99999999999 out of range");
}

TEST(Config, SyntaxErrorAndMissingFile) {
  std::string m = load_error("[model]\nd_model = = 3\n");
  EXPECT_HAS(m, "test.toml:2: TOML syntax error");
  m = error_of([] { load_config("/nonexistent/nope.toml"); });
  EXPECT_HAS(m, "config file '/nonexistent/nope.toml' not found");
}

TEST(Config, SuggestKey) {
  EXPECT_EQ(suggest_key("traning.steps"), "training.steps");
  EXPECT_EQ(suggest_key("model.kv_lora"), "model.kv_lora_rank");
  EXPECT_EQ(suggest_key("parallelism.ep_dispacher"), "parallelism.ep_dispatcher");
  EXPECT_EQ(suggest_key("lr"), "optimizer.lr");
  EXPECT_EQ(suggest_key("zzzzzzzzzzzz.qqqqqqq"), "");
}

// ---- impossible values ------------------------------------------------------------------------------

TEST(Config, ImpossibleValuesNameTheKey) {
  struct Case {
    std::vector<std::string> overrides;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {{"--model.d_model=30"}, "model.n_heads = 4: d_model (30) must be divisible by n_heads for mha"},
      {{"--model.d_model=-32"}, "model.d_model = -32: must be > 0"},
      {{"--model.vocab_size=0"}, "model.vocab_size = 0: must be > 0"},
      {{"--model.n_layers=-1"}, "model.n_layers = -1: must be > 0"},
      {{"--model.n_routed_experts=-4"}, "model.n_routed_experts = -4: must be >= 0"},
      {{"--model.moe_inter_size=-16"}, "model.moe_inter_size = -16: must be > 0"},
      {{"--model.topk=5"}, "model.topk = 5: must be <= n_routed_experts (4)"},
      {{"--model.topk=0"}, "model.topk = 0: must be > 0"},
      {{"--model.n_group=3", "--model.topk_group=1"}, "model.n_group = 3: must divide n_routed_experts (4)"},
      {{"--model.n_group=2", "--model.topk_group=3"}, "model.topk_group = 3: must be in [1, n_group = 2]"},
      {{"--model.n_group=4", "--model.topk_group=1"}, "model.topk = 2: more than the 1 experts"},
      {{"--model.route_scale=0"}, "model.route_scale = 0: must be > 0"},
      {{"--model.dropout=1"}, "model.dropout = 1: must be in [0, 1)"},
      {{"--model.dropout=-0.1"}, "model.dropout = -0.1: must be in [0, 1)"},
      {{"--model.ffn=gelu"}, "model.ffn = gelu: the gelu FFN is for dense models (n_routed_experts = 0)"},
      {{"--model.capacity_factor=-1"}, "model.capacity_factor = -1"},
      {{"--model.head_dim=7", "--model.attn_type=gqa"}, "model.head_dim = 7: must be even"},
      {{"--model.attn_type=gqa", "--model.n_kv_heads=3"}, "model.n_kv_heads = 3: must divide n_heads (4)"},
      {{"--model.n_kv_heads=2"}, "model.n_kv_heads = 2: mha attention needs n_kv_heads == n_heads"},
      {{"--model.attn_type=mla", "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=4",
        "--model.v_head_dim=8"},
       "model.kv_lora_rank = 0: mla attention needs kv_lora_rank > 0"},
      {{"--model.attn_type=mla", "--model.kv_lora_rank=16", "--model.qk_rope_head_dim=4", "--model.v_head_dim=8"},
       "model.qk_nope_head_dim = 0"},
      {{"--model.attn_type=mla", "--model.kv_lora_rank=16", "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=3",
        "--model.v_head_dim=8"},
       "model.qk_rope_head_dim = 3"},
      {{"--model.kv_lora_rank=16"}, "model.attn_type = mha: MLA dimensions"},
      {{"--model.dense_layers=[0]"}, "model.dense_layers = [0]: set together with model.first_k_dense = 1"},
      {{"--model.first_k_dense=0", "--model.dense_layers=[2]"}, "model.dense_layers = 2: layer id out of range"},
      {{"--model.first_k_dense=0", "--model.dense_layers=[0,0]"}, "model.dense_layers = 0: listed twice"},
      {{"--model.first_k_dense=3"}, "model.first_k_dense = 3: must be in [0, n_layers = 2]"},
      {{"--model.first_k_dense=2"}, "model.first_k_dense = 2: every layer is dense"},
      {{"--model.inter_size=0"}, "model.inter_size = 0: must be > 0: the model has 1 dense layer(s)"},
      {{"--model.n_routed_experts=0", "--model.n_shared_experts=1"}, "model.n_shared_experts = 1: shared experts"},
      {{"--model.norm_eps=0"}, "model.norm_eps = 0"},
      {{"--training.global_batch_size=5"},
       "training.global_batch_size = 5: must be a multiple of micro_batch_size * dp = 2 * 1"},
      {{"--parallelism.dp_shard=4"}, "training.global_batch_size = 4: must be a multiple of micro_batch_size * dp = 2 * 4"},
      {{"--training.seq_len=0"}, "training.seq_len = 0: must be > 0"},
      {{"--training.micro_batch_size=-2"}, "training.micro_batch_size = -2: must be > 0"},
      {{"--training.val_interval=10"}, "training.val_steps = 0: must be > 0 when val_interval"},
      {{"--optimizer.lr=0"}, "optimizer.lr = 0: must be > 0"},
      {{"--optimizer.beta2=1"}, "optimizer.beta2 = 1: must be in [0, 1)"},
      {{"--lr_scheduler.min_lr_ratio=1.5"}, "lr_scheduler.min_lr_ratio = 1.5: must be in [0, 1]"},
      {{"--parallelism.ep=3", "--parallelism.dp_shard=3", "--training.global_batch_size=6"},
       "parallelism.ep = 3: must divide model.n_routed_experts (4)"},
      {{"--parallelism.ep=2", "--parallelism.dp_shard=3", "--training.global_batch_size=6"},
       "parallelism.ep = 2: ep x expert_tp (2) must divide tp x cp x dp (3)"},
      {{"--parallelism.zero=4"}, "parallelism.zero = 4: must be 0, 1, 2 or 3"},
      {{"--parallelism.tp=3"}, "parallelism.tp = 3: must divide model.n_heads"},
      {{"--parallelism.cp=3"}, "parallelism.cp = 3: 2 * cp must divide training.seq_len"},
      {{"--parallelism.expert_tp=0"}, "parallelism.expert_tp = 0: must be >= 1"},
      {{"--parallelism.ep_overlap_split=true"},
       "parallelism.ep_overlap_split = true: needs parallelism.ep_overlap = true"},
      {{"--parallelism.pp=3", "--training.global_batch_size=6"},
       "parallelism.pp = 3: cannot split model.n_layers = 2 over pp * stages per rank = 3 * 1 = 3 stages: only 2 "
       "layer-equivalents"},
      {{"--activation_checkpoint.mode=selective"}, "activation_checkpoint.modules = []: selective mode needs"},
      {{"--activation_checkpoint.mode=selective", "--activation_checkpoint.modules=[attn]"},
       "activation_checkpoint.modules = \"attn\": expected attention_core, moe_act or norm"},
      {{"--activation_checkpoint.modules=[norm]"}, "module(s) listed but mode is none"},
      {{"--activation_checkpoint.mode=full", "--activation_checkpoint.layer_ids=[2]"},
       "activation_checkpoint.layer_ids = 2: layer id out of range [0, 2)"},
      {{"--checkpoint.enable=true", "--checkpoint.interval=0"}, "checkpoint.interval = 0"},
      {{"--metrics.log_interval=0"}, "metrics.log_interval = 0: must be >= 1"},
  };
  for (const auto& c : cases) {
    std::string m = load_error(kTiny, c.overrides);
    SCOPED_TRACE(c.overrides.front());
    EXPECT_HAS(m, c.expect);
    EXPECT_HAS(m, "test.toml: invalid config: ");
  }
  // Sanity: the base itself is valid and the fixes are accepted.
  EXPECT_EQ(load_error(kTiny), "");
  EXPECT_EQ(load_error(kTiny, {"--parallelism.ep=2", "--parallelism.dp_shard=2"}), "");
  EXPECT_EQ(load_error(kTiny, {"--model.attn_type=mla", "--model.kv_lora_rank=16", "--model.qk_nope_head_dim=8",
                               "--model.qk_rope_head_dim=4", "--model.v_head_dim=8"}),
            "");
}

// ---- size limits ------------------------------------------------------------------------------------

TEST(Config, AbsurdSizesAreRejectedNamingTheKeyWithinASecond) {
  struct Case {
    std::vector<std::string> overrides;
    const char* expect;
  };
  const std::string big = "1000000000000";  // 10^12
  const std::vector<Case> cases = {
      {{"--model.n_layers=" + big}, "model.n_layers = 1000000000000: must be <= 2^14 = 16384 (size limit)"},
      {{"--model.d_model=" + big}, "model.d_model = 1000000000000: must be <= 2^24 = 16777216 (size limit)"},
      {{"--model.vocab_size=" + big}, "model.vocab_size = 1000000000000: must be <= 2^24"},
      {{"--model.inter_size=" + big}, "model.inter_size = 1000000000000: must be <= 2^24"},
      {{"--model.moe_inter_size=" + big}, "model.moe_inter_size = 1000000000000: must be <= 2^24"},
      {{"--model.n_heads=" + big}, "model.n_heads = 1000000000000: must be <= 2^16 = 65536"},
      {{"--model.attn_type=gqa", "--model.head_dim=" + big}, "model.head_dim = 1000000000000: must be <= 2^24"},
      {{"--model.attn_type=gqa", "--model.n_kv_heads=" + big}, "model.n_kv_heads = 1000000000000: must be <= 2^16"},
      {{"--model.attn_type=mla", "--model.kv_lora_rank=" + big}, "model.kv_lora_rank = 1000000000000: must be <= 2^24"},
      {{"--model.attn_type=mla", "--model.q_lora_rank=" + big}, "model.q_lora_rank = 1000000000000: must be <= 2^24"},
      {{"--model.attn_type=mla", "--model.qk_nope_head_dim=" + big}, "model.qk_nope_head_dim = 1000000000000"},
      {{"--model.attn_type=mla", "--model.qk_rope_head_dim=" + big}, "model.qk_rope_head_dim = 1000000000000"},
      {{"--model.attn_type=mla", "--model.v_head_dim=" + big}, "model.v_head_dim = 1000000000000"},
      {{"--model.n_routed_experts=" + big}, "model.n_routed_experts = 1000000000000: must be <= 2^16"},
      {{"--model.n_shared_experts=" + big}, "model.n_shared_experts = 1000000000000: must be <= 2^16"},
      {{"--model.topk=" + big}, "model.topk = 1000000000000: must be <= 2^16"},
      {{"--model.n_group=" + big}, "model.n_group = 1000000000000: must be <= 2^16"},
      {{"--model.topk_group=" + big}, "model.topk_group = 1000000000000: must be <= 2^16"},
      {{"--model.first_k_dense=" + big}, "model.first_k_dense = 1000000000000: must be <= 2^14"},
      {{"--model.capacity_factor=1e300"}, "model.capacity_factor = 1e+300: must be <= 2^16"},
      // Products of keys that are each within their limit.
      {{"--model.attn_type=gqa", "--model.n_heads=65536", "--model.n_kv_heads=65536", "--model.head_dim=65536"},
       "model.n_heads = 65536: (n_heads + 2 * n_kv_heads) * head_dim = 12884901888 must be <= 2^24"},
      {{"--model.attn_type=mla", "--model.n_heads=65536", "--model.kv_lora_rank=16", "--model.qk_nope_head_dim=8192",
        "--model.qk_rope_head_dim=8", "--model.v_head_dim=8"},
       "model.n_heads = 65536: n_heads * (qk_nope_head_dim + qk_rope_head_dim) = 537395200 must be <= 2^24"},
      {{"--model.n_shared_experts=65536", "--model.moe_inter_size=65536"},
       "model.n_shared_experts = 65536: n_shared_experts * moe_inter_size = 4294967296 must be <= 2^24"},
      {{"--model.n_layers=16384", "--model.d_model=65536", "--model.n_heads=64", "--model.n_routed_experts=4096",
        "--model.moe_inter_size=65536"},
       "parameters, more than 2^48 = 2.81475e+14 (size limit); the largest part comes from model.n_layers = 16384, "
       "model.n_routed_experts = 4096, model.d_model = 65536, model.moe_inter_size = 65536"},
      // Training, parallelism and the rest.
      {{"--training.seq_len=" + big}, "training.seq_len = 1000000000000: must be <= 2^24"},
      {{"--training.micro_batch_size=" + big}, "training.micro_batch_size = 1000000000000: must be <= 2^24"},
      {{"--training.global_batch_size=1000000000000000"},
       "training.global_batch_size = 1000000000000000: must be <= 2^40"},
      {{"--training.steps=1000000000000000"}, "training.steps = 1000000000000000: must be <= 2^40"},
      {{"--training.val_interval=1000000000000000"}, "training.val_interval = 1000000000000000: must be <= 2^40"},
      {{"--training.val_steps=" + big}, "training.val_steps = 1000000000000: must be <= 2^20"},
      {{"--training.threads=1000000"}, "training.threads = 1000000: must be <= 2^16"},
      {{"--lr_scheduler.warmup_steps=1000000000000000"},
       "lr_scheduler.warmup_steps = 1000000000000000: must be <= 2^40"},
      {{"--parallelism.dp_shard=" + big}, "parallelism.dp_shard = 1000000000000: must be <= 2^20"},
      {{"--parallelism.dp_replicate=" + big}, "parallelism.dp_replicate = 1000000000000: must be <= 2^20"},
      {{"--parallelism.ep=" + big}, "parallelism.ep = 1000000000000: must be <= 2^20"},
      {{"--parallelism.pp=" + big}, "parallelism.pp = 1000000000000: must be <= 2^20"},
      {{"--parallelism.ranks_per_node=" + big}, "parallelism.ranks_per_node = 1000000000000: must be <= 2^16"},
      {{"--hardware.num_nodes=" + big}, "hardware.num_nodes = 1000000000000: must be <= 2^24"},
      {{"--hardware.gpus_per_node=" + big}, "hardware.gpus_per_node = 1000000000000: must be <= 2^16"},
      {{"--parallelism.dp_replicate=1048576", "--parallelism.dp_shard=1048576"},
       "parallelism.dp_shard = 1048576: dp_replicate * dp_shard = 1099511627776 must be <= 2^24"},
      {{"--training.global_batch_size=1073741824"},
       "training.global_batch_size = 1073741824: global_batch_size / (micro_batch_size * dp) = 536870912 "
       "micro-batches per rank per step must be <= 2^20"},
      {{"--training.micro_batch_size=1048576", "--training.seq_len=4096", "--training.global_batch_size=1048576"},
       "training.micro_batch_size = 1048576: micro_batch_size * seq_len (4096) * max(1, model.topk) (2) = 8589934592 "
       "rows per micro-batch must be < 2^31"},
      // One micro-batch of 2^29 tokens at d_model 2^22: each [T, d] fp32 tensor is 2^53 bytes.
      {{"--model.d_model=4194304", "--model.n_heads=1", "--training.micro_batch_size=8192", "--training.seq_len=65536",
        "--training.global_batch_size=8192"},
       "bytes of activations, more than 2^56 (size limit): training.micro_batch_size = 8192, training.seq_len = "
       "65536, model.n_layers = 2; the largest term is"},
      {{"--activation_checkpoint.mode=full", "--activation_checkpoint.layer_ids=[1,0,1]"},
       "activation_checkpoint.layer_ids = 1: listed twice"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.overrides.back());
    const auto t0 = std::chrono::steady_clock::now();
    std::string m = load_error(kTiny, c.overrides);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_HAS(m, c.expect);
    EXPECT_HAS(m, "test.toml: invalid config: ");
    EXPECT_LT(s, 1.0) << "rejection took " << s << " s";
  }
  // The limits leave real models alone: every preset loads (EveryPresetLoadsValidatesAndRoundTripsThroughToml),
  // and values at the limits themselves pass.
  EXPECT_EQ(load_error(kTiny, {"--model.n_layers=16384", "--parallelism.dp_shard=4096",
                               "--parallelism.dp_replicate=4096", "--training.global_batch_size=33554432",
                               "--training.steps=1099511627776"}),
            "");
}

TEST(Config, MemoryCheckKeyDefaultsOnAndRoundTrips) {
  JobConfig c = load_config_string(kTiny);
  EXPECT_TRUE(c.training.memory_check);
  JobConfig off = load_config_string(kTiny, {"--training.memory_check=false"});
  EXPECT_FALSE(off.training.memory_check);
  EXPECT_HAS(to_toml(off), "memory_check = false\n");
  EXPECT_EQ(load_config_string(to_toml(off)), off);
  EXPECT_EQ(to_json(off)["training"]["memory_check"], false);
  EXPECT_EQ(config_from_json(to_json(off)), off);
  auto keys = config_keys();
  EXPECT_NE(std::find(keys.begin(), keys.end(), "training.memory_check"), keys.end());
  EXPECT_HAS(load_error(kTiny, {"--training.memory_check=maybe"}), "training.memory_check: expected boolean");
}

// ---- how ep_overlap's lanes and the MPI transport run (environment variables once) ----------------------------

namespace {
// kTiny with the 1F1B all-to-all overlap on: interleaved, pp 2 x dp 2, ep 2.
const std::vector<std::string> kOverlap = {"--model.n_layers=4", "--parallelism.pp=2", "--parallelism.dp_shard=2",
                                           "--parallelism.ep=2", "--parallelism.pp_schedule=interleaved_1f1b",
                                           "--parallelism.ep_overlap=true", "--training.global_batch_size=8"};
std::vector<std::string> overlap_with(std::vector<std::string> extra) {
  std::vector<std::string> a = kOverlap;
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}
const char* kLaneKeys[] = {"parallelism.ep_pair_backward", "parallelism.ep_baton", "parallelism.ep_link",
                           "comm.mpi_wait", "comm.mpi_max_nap_us", "comm.mpi_thread"};
}  // namespace

TEST(ConfigLanes, KeysDefaultToTheEnginesFormerDefaultsParseAndRoundTrip) {
  const JobConfig d = load_config_string(kTiny);
  EXPECT_EQ(d.parallelism.ep_pair_backward, "auto");
  EXPECT_EQ(d.parallelism.ep_baton, "free");
  EXPECT_EQ(d.parallelism.ep_link, "shared");
  EXPECT_EQ(d.comm.mpi_wait, "poll");
  EXPECT_EQ(d.comm.mpi_max_nap_us, 200);
  EXPECT_EQ(d.comm.mpi_thread, "multiple");
  const JobConfig c = load_config_string(kTiny, {"--parallelism.ep_pair_backward=iwfill", "--parallelism.ep_baton=turn",
                                                 "--parallelism.ep_link=paced", "--comm.mpi_wait=spin",
                                                 "--comm.mpi_max_nap_us=1000", "--comm.mpi_thread=funneled"});
  EXPECT_EQ(c.parallelism.ep_pair_backward, "iwfill");
  EXPECT_EQ(c.parallelism.ep_baton, "turn");
  EXPECT_EQ(c.parallelism.ep_link, "paced");
  EXPECT_EQ(c.comm.mpi_wait, "spin");
  EXPECT_EQ(c.comm.mpi_max_nap_us, 1000);
  EXPECT_EQ(c.comm.mpi_thread, "funneled");
  const std::string t = to_toml(c);
  for (const char* line : {"ep_pair_backward = \"iwfill\"\n", "ep_baton = \"turn\"\n", "ep_link = \"paced\"\n",
                           "mpi_wait = \"spin\"\n", "mpi_max_nap_us = 1000\n", "mpi_thread = \"funneled\"\n"})
    EXPECT_HAS(t, line);
  EXPECT_EQ(load_config_string(t), c);
  EXPECT_EQ(config_from_json(to_json(c)), c);
  EXPECT_EQ(to_json(c)["comm"]["mpi_max_nap_us"], 1000);
  const auto keys = config_keys();
  for (const char* k : kLaneKeys) EXPECT_NE(std::find(keys.begin(), keys.end(), k), keys.end()) << k;
  // A stored config written before these keys existed (a checkpoint's) loads with the defaults.
  nlohmann::json old = to_json(d);
  old["parallelism"].erase("ep_pair_backward");
  old["comm"].erase("mpi_thread");
  EXPECT_EQ(config_from_json(old), d);
}

TEST(ConfigLanes, BadValuesNameTheKeyAndTheValue) {
  EXPECT_HAS(load_error(kTiny, {"--parallelism.ep_pair_backward=wb"}),
             "parallelism.ep_pair_backward: expected one of auto|b|iw|iwfill|iwcarry, got 'wb'");
  EXPECT_HAS(load_error(kTiny, {"--parallelism.ep_baton=fast"}), "parallelism.ep_baton: expected one of free|turn, got 'fast'");
  EXPECT_HAS(load_error(kTiny, {"--parallelism.ep_link=wide"}), "parallelism.ep_link: expected one of shared|paced, got 'wide'");
  EXPECT_HAS(load_error(kTiny, {"--comm.mpi_wait=sleep"}), "comm.mpi_wait: expected one of poll|spin, got 'sleep'");
  EXPECT_HAS(load_error(kTiny, {"--comm.mpi_thread=serialized"}),
             "comm.mpi_thread: expected one of multiple|funneled, got 'serialized'");
  EXPECT_HAS(load_error(kTiny, {"--comm.mpi_max_nap_us=fast"}), "comm.mpi_max_nap_us: expected integer");
  for (const char* v : {"19", "5001", "-1"}) {
    const std::string m = load_error(kTiny, {std::string("--comm.mpi_max_nap_us=") + v});
    EXPECT_HAS(m, std::string("invalid config: comm.mpi_max_nap_us = ") + v + ": must be in [20, 5000] microseconds");
  }
  EXPECT_EQ(load_error(kTiny, {"--comm.mpi_max_nap_us=20"}), "");
  EXPECT_HAS(load_error(kTiny, {"--parallelism.ep_transport=tcp"}),
             "parallelism.ep_transport: expected one of mpi|shm, got 'tcp'");
  EXPECT_HAS(load_error(kTiny, {"--parallelism.ep_transport=shm", "--parallelism.ep_dispatcher=hierarchical"}),
             "invalid config: parallelism.ep_transport = \"shm\": moves the rows of the flat dispatchers");
  EXPECT_EQ(load_error(kTiny, {"--comm.mpi_max_nap_us=5000"}), "");
}

// The combinations that cannot run are refused naming the keys, with ep_overlap on; without it the keys are moot
// (accepted, and noted by the trainer: below).
TEST(ConfigLanes, TheOverlapRefusesWhatItCannotRunNamingTheKeys) {
  ASSERT_EQ(load_error(kTiny, kOverlap), "");
  for (const char* pair : {"auto", "b", "iw", "iwfill", "iwcarry"})
    EXPECT_EQ(load_error(kTiny, overlap_with({std::string("--parallelism.ep_pair_backward=") + pair})), "") << pair;
  EXPECT_EQ(load_error(kTiny, overlap_with({"--parallelism.ep_baton=turn", "--parallelism.ep_link=paced"})), "");
  EXPECT_EQ(load_error(kTiny, overlap_with({"--parallelism.ep_baton=turn", "--parallelism.ep_pair_backward=b"})), "");
  EXPECT_EQ(load_error(kTiny, overlap_with({"--quantize.recipe=tensorwise"})), "");  // auto: b under [quantize]
  struct Case {
    std::vector<std::string> overrides;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{"--parallelism.ep_link=paced"},
       "invalid config: parallelism.ep_link = paced: needs parallelism.ep_baton = \"turn\" (got \"free\")"},
      {{"--parallelism.ep_pair_backward=iwcarry", "--parallelism.ep_baton=turn"},
       "invalid config: parallelism.ep_pair_backward = iwcarry: needs the free lane order (parallelism.ep_baton"},
      {{"--parallelism.ep_pair_backward=iwfill", "--parallelism.ep_baton=turn"},
       "invalid config: parallelism.ep_pair_backward = iwfill: needs the free lane order"},
      {{"--parallelism.ep_pair_backward=iwfill", "--quantize.recipe=rowwise"},
       "invalid config: parallelism.ep_pair_backward = iwfill: is not implemented with [quantize] (quantize.recipe = "
       "rowwise"},
      {{"--parallelism.ep_pair_backward=iwcarry", "--quantize.recipe=tensorwise"},
       "invalid config: parallelism.ep_pair_backward = iwcarry: is not implemented with [quantize]"},
      {{"--comm.mpi_thread=funneled"},
       "invalid config: comm.mpi_thread = funneled: parallelism.ep_overlap = true runs two micro-batches' EP exchanges"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.overrides.front());
    EXPECT_HAS(load_error(kTiny, overlap_with(c.overrides)), c.expect);
    std::vector<std::string> off = c.overrides;  // the same without the overlap: moot, accepted
    off.push_back("--parallelism.ep_overlap=false");
    EXPECT_EQ(load_error(kTiny, overlap_with(off)), "");
  }
}

// Set where they change nothing, the keys are named in the trainer's notes (config_notes.cpp), never ignored in
// silence: the lanes' keys without ep_overlap, the MPI keys on one process, the nap under the spinning wait.
TEST(ConfigLanes, MootSettingsAreNoted) {
  auto noted = [](const JobConfig& c, const RunShape& r) {
    std::set<std::string> keys;
    for (const InertSetting& s : inert_settings(c, r)) keys.insert(s.key);
    return keys;
  };
  const JobConfig off = load_config_string(kTiny, {"--parallelism.ep_pair_backward=b", "--parallelism.ep_baton=turn",
                                                   "--parallelism.ep_link=paced", "--comm.mpi_wait=spin",
                                                   "--comm.mpi_max_nap_us=1000", "--comm.mpi_thread=funneled"});
  auto one = noted(off, RunShape{1, 1, false});
  for (const char* k : kLaneKeys) EXPECT_TRUE(one.count(k)) << k;
  for (const InertSetting& s : inert_settings(off, RunShape{1, 1, false})) {
    if (s.key == "parallelism.ep_pair_backward") {
      EXPECT_EQ(format_note(s), "note: parallelism.ep_pair_backward = \"b\" has no effect: parallelism.ep_overlap = "
                                "false runs no overlapped pairs (these keys choose how the overlap's two lanes run)");
    }
  }
  auto four = noted(off, RunShape{4, 2, false});  // several processes: only the nap, which "spin" never takes
  EXPECT_TRUE(four.count("comm.mpi_max_nap_us"));
  EXPECT_FALSE(four.count("comm.mpi_wait"));
  EXPECT_FALSE(four.count("comm.mpi_thread"));
  EXPECT_TRUE(four.count("parallelism.ep_baton"));  // still no overlap
  const JobConfig on = load_config_string(kTiny, overlap_with({"--parallelism.ep_pair_backward=b",
                                                               "--parallelism.ep_baton=turn", "--comm.mpi_max_nap_us=1000"}));
  auto ran = noted(on, RunShape{4, 2, false});
  for (const char* k : kLaneKeys) EXPECT_FALSE(ran.count(k)) << k;
}

// ---- [parallelism] pipeline keys ----------------------------------------------------------------------

namespace {
// A schedule CSV in the temp directory (one row per pipeline rank).
std::string write_csv(const std::string& name, const std::string& text) {
  const fs::path p = fs::temp_directory_path() / ("moetron_test_config_" + name + ".csv");
  std::ofstream(p) << text;
  return p.string();
}
}  // namespace

TEST(ConfigPipeline, KeysDefaultParseAndRoundTrip) {
  JobConfig c = load_config_string(kTiny);
  const auto& p = c.parallelism;
  EXPECT_EQ(p.pp_schedule, "1f1b");
  EXPECT_EQ(p.pp_virtual_stages, 0);
  EXPECT_EQ(p.pp_microbatches, 0);
  EXPECT_EQ(p.pp_layout, "");
  EXPECT_EQ(p.pp_schedule_csv, "");
  EXPECT_EQ(p.pp_first_stage_less_layers, 0);
  EXPECT_EQ(p.pp_last_stage_less_layers, 0);
  const std::string t = to_toml(c);
  EXPECT_HAS(t, "zero = 0\npp_schedule = \"1f1b\"\npp_virtual_stages = 0\npp_microbatches = 0\npp_layout = \"\"\n"
                "pp_schedule_csv = \"\"\npp_first_stage_less_layers = 0\npp_last_stage_less_layers = 0\n");
  EXPECT_EQ(t.find("pipeline_layout"), std::string::npos);
  // Defaults: one stage with everything, micro-batches = global_batch_size / (micro_batch_size * dp) = 4 / 2.
  PipelineSetup d = resolve_pipeline(c);
  EXPECT_EQ(d.stages_per_rank, 1);
  EXPECT_EQ(d.microbatches, 2);
  EXPECT_EQ(d.spec.schedule, "1f1b");
  EXPECT_EQ(d.spec.pp, 1);
  EXPECT_EQ(d.spec.vpp, 1);
  EXPECT_EQ(d.spec.microbatches, 2);
  EXPECT_FALSE(d.from_csv);
  EXPECT_EQ(d.layout.to_string(), "EttL");

  JobConfig o = load_config_string(kTiny, {"--model.n_layers=8", "--parallelism.pp=2",
                                           "--parallelism.pp_schedule=interleaved_1f1b", "--parallelism.pp_virtual_stages=2",
                                           "--parallelism.pp_microbatches=2", "--parallelism.pp_layout=Et*2|t*2|t*2|t*2L"});
  EXPECT_EQ(o.parallelism.pp_schedule, "interleaved_1f1b");
  EXPECT_EQ(o.parallelism.pp_virtual_stages, 2);
  EXPECT_EQ(o.parallelism.pp_microbatches, 2);
  EXPECT_EQ(o.parallelism.pp_layout, "Et*2|t*2|t*2|t*2L");
  EXPECT_EQ(load_config_string(to_toml(o)), o);
  EXPECT_EQ(config_from_json(to_json(o)), o);
  PipelineSetup s = resolve_pipeline(o);
  EXPECT_EQ(s.stages_per_rank, 2);
  EXPECT_EQ(s.layout.to_string(), "Ett|tt|tt|ttL");
  EXPECT_EQ(s.layout.stage_rank, (std::vector<int>{0, 1, 0, 1}));
  o = load_config_string(kTiny, {"--parallelism.pp_first_stage_less_layers=1", "--parallelism.pp_last_stage_less_layers=1"});
  EXPECT_EQ(o.parallelism.pp_first_stage_less_layers, 1);
  EXPECT_EQ(o.parallelism.pp_last_stage_less_layers, 1);
  EXPECT_EQ(load_config_string(to_toml(o)), o);

  // The enum accepts exactly the generators' names.
  std::string names;
  for (const auto& n : sched::schedule_names()) {
    JobConfig x;
    apply_override(x, "--parallelism.pp_schedule=" + n);
    EXPECT_EQ(x.parallelism.pp_schedule, n);
    names += (names.empty() ? "" : "|") + n;
  }
  EXPECT_HAS(load_error(kTiny, {"--parallelism.pp_schedule=1F1B"}),
             "parallelism.pp_schedule: expected one of " + names + ", got '1F1B'");
}

TEST(ConfigPipeline, RetiredPipelineLayoutNamesPpLayout) {
  std::string m = load_error("[parallelism]\npipeline_layout = \"Et|tL\"\n");
  EXPECT_HAS(m, "test.toml:2: key 'parallelism.pipeline_layout' was retired: use parallelism.pp_layout");
  JobConfig c;
  m = error_of([&] { apply_override(c, "--parallelism.pipeline_layout=EtL"); });
  EXPECT_HAS(m, "key 'parallelism.pipeline_layout' was retired: use parallelism.pp_layout");
}

TEST(ConfigPipeline, StagesPerRankAndPlacementResolve) {
  const std::vector<std::string> base = {"--model.n_layers=8", "--parallelism.pp=2"};
  auto setup = [&](std::vector<std::string> more) {
    more.insert(more.begin(), base.begin(), base.end());
    return resolve_pipeline(load_config_string(kTiny, more));
  };
  PipelineSetup s = setup({});  // 1f1b: 1 stage per rank, even split 4 + 4
  EXPECT_EQ(s.stages_per_rank, 1);
  EXPECT_EQ(s.layout.to_string(), "Etttt|ttttL");
  s = setup({"--parallelism.pp_schedule=interleaved_1f1b"});  // default 2 stages per rank, loop placement
  EXPECT_EQ(s.stages_per_rank, 2);
  EXPECT_EQ(s.layout.to_string(), "Ett|tt|tt|ttL");
  EXPECT_EQ(s.layout.stage_rank, (std::vector<int>{0, 1, 0, 1}));
  s = setup({"--parallelism.pp_schedule=zbv"});  // V placement
  EXPECT_EQ(s.stages_per_rank, 2);
  EXPECT_EQ(s.layout.stage_rank, (std::vector<int>{0, 1, 1, 0}));
  // A layout fixes the stages per rank when pp_virtual_stages is 0: 6 stages on 2 ranks = 3.
  s = setup({"--parallelism.pp_schedule=interleaved_1f1b", "--parallelism.pp_layout=Et|t|t|tt|tt|tL"});
  EXPECT_EQ(s.stages_per_rank, 3);
  EXPECT_EQ(s.spec.vpp, 3);
  EXPECT_EQ(s.layout.layers(3), (std::vector<int>{3, 4}));
  // ... and must agree with it when it is given.
  std::string m = load_error(kTiny, {"--model.n_layers=8", "--parallelism.pp=2", "--parallelism.pp_schedule=interleaved_1f1b",
                                     "--parallelism.pp_virtual_stages=2", "--parallelism.pp_layout=Et|t|t|tt|tt|tL"});
  EXPECT_HAS(m, "invalid config: parallelism.pp_layout = \"Et|t|t|tt|tt|tL\": has 6 stages, pp * stages per rank = "
                "2 * 2 = 4");
  // The less-layers options shape the even split: e = 8 + 1 + 1 = 10 over 2 stages, 5 each, minus 1 at each end.
  s = setup({"--parallelism.pp_first_stage_less_layers=1", "--parallelism.pp_last_stage_less_layers=1"});
  EXPECT_EQ(s.layout.to_string(), "Etttt|ttttL");
  s = setup({"--parallelism.pp_first_stage_less_layers=2"});  // e = 10: stage 0 = 5 - 2 = 3 layers
  EXPECT_EQ(s.layout.to_string(), "Ettt|tttttL");
}

TEST(ConfigPipeline, MicrobatchesDeriveOrDefineTheGlobalBatch) {
  EXPECT_EQ(resolve_pipeline(load_config_string(kTiny)).microbatches, 2);  // 4 / (2 * 1)
  std::string t = kTiny;
  t.replace(t.find("global_batch_size = 4"), 21, "");
  JobConfig c = load_config_string(t, {"--parallelism.pp_microbatches=4", "--parallelism.dp_shard=2"});
  EXPECT_EQ(c.training.global_batch_size, 16);  // micro_batch_size 2 * dp 2 * 4 micro-batches
  EXPECT_EQ(resolve_pipeline(c).microbatches, 4);
  EXPECT_EQ(load_error(kTiny, {"--parallelism.pp_microbatches=2"}), "");
  EXPECT_HAS(load_error(kTiny, {"--parallelism.pp_microbatches=3"}),
             "test.toml: invalid config: parallelism.pp_microbatches = 3: must equal training.global_batch_size / "
             "(micro_batch_size * dp) = 4 / (2 * 1) = 2");
  EXPECT_HAS(load_error(kTiny, {"--parallelism.pp_microbatches=-1"}), "parallelism.pp_microbatches = -1: must be in [0, 2^20]");
  EXPECT_HAS(load_error(t, {"--parallelism.pp_microbatches=1000000000000"}),
             "parallelism.pp_microbatches = 1000000000000: must be in [0, 2^20]");
  EXPECT_HAS(load_error(t, {"--parallelism.pp_microbatches=1000000", "--training.micro_batch_size=16777216",
                            "--parallelism.dp_shard=1048576"}),
             "parallelism.pp_microbatches = 1000000: training.global_batch_size = micro_batch_size * dp_replicate * "
             "dp_shard * pp_microbatches = 16777216 * 1 * 1048576 * 1000000 overflows int64");
}

TEST(ConfigPipeline, BadValuesNameTheKey) {
  struct Case {
    std::vector<std::string> overrides;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {{"--parallelism.pp_virtual_stages=-1"}, "parallelism.pp_virtual_stages = -1: must be in [0, 1024]"},
      {{"--parallelism.pp_virtual_stages=2000"}, "parallelism.pp_virtual_stages = 2000: must be in [0, 1024]"},
      {{"--parallelism.pp_first_stage_less_layers=-1"}, "parallelism.pp_first_stage_less_layers = -1: must be in [0, 2^14]"},
      {{"--parallelism.pp_last_stage_less_layers=100000"},
       "parallelism.pp_last_stage_less_layers = 100000: must be in [0, 2^14]"},
      {{"--parallelism.pp_layout=EttL", "--parallelism.pp_first_stage_less_layers=1"},
       "parallelism.pp_first_stage_less_layers = 1: applies to the even split only, but parallelism.pp_layout = "
       "\"EttL\" places every layer"},
      {{"--parallelism.pp_layout=Et|x"}, "parallelism.pp_layout = \"Et|x\": unknown character 'x' at position 4"},
      {{"--parallelism.pp_layout=E(t|tL"}, "parallelism.pp_layout = \"E(t|tL\": unbalanced parentheses: '(' at position 2"},
      {{"--parallelism.pp_layout=Et*0|tL"}, "parallelism.pp_layout = \"Et*0|tL\": bad repeat count: *0 at position 3"},
      {{"--parallelism.pp=2", "--parallelism.pp_layout=Ettt|tL"},
       "parallelism.pp_layout = \"Ettt|tL\": has 4 decoder layers, model.n_layers = 2"},
      {{"--parallelism.pp=2", "--parallelism.pp_layout=tE|tL"},
       "parallelism.pp_layout = \"tE|tL\": E (embedding) at position 2 must be the first item of stage 0"},
      {{"--parallelism.pp=2", "--parallelism.pp_layout=EtL|t"},
       "parallelism.pp_layout = \"EtL|t\": L (loss) at position 3 must be the last item of the last stage (stage 1)"},
      {{"--parallelism.pp=2", "--parallelism.pp_layout=Et|t|L"},
       "parallelism.pp_layout = \"Et|t|L\": has 3 stages, not divisible by pp = 2"},
      {{"--parallelism.pp=3", "--training.global_batch_size=6"},
       "parallelism.pp = 3: cannot split model.n_layers = 2 over pp * stages per rank = 3 * 1"},
      {{"--parallelism.pp=2", "--parallelism.pp_first_stage_less_layers=3"},
       "parallelism.pp_first_stage_less_layers = 3 exceeds the 2 layer-equivalents of a stage (5 over 2 stages)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.overrides.back());
    std::string m = load_error(kTiny, c.overrides);
    EXPECT_HAS(m, c.expect);
    EXPECT_HAS(m, "test.toml: invalid config: ");
    EXPECT_EQ(m.find(".cpp:"), std::string::npos) << m;  // keys and values, not source locations
  }
  // A layout may leave a middle stage empty, and pp may then exceed n_layers.
  EXPECT_EQ(load_error(kTiny, {"--parallelism.pp=4", "--parallelism.pp_layout=Et||t|L", "--training.global_batch_size=8"}),
            "");
}

TEST(ConfigPipeline, SchedulePreconditionsSurfaceThroughValidation) {
  // 1f1b on 2 ranks needs at least 2 micro-batches; global 2 / (micro 2 * dp 1) = 1.
  std::string m = load_error(kTiny, {"--parallelism.pp=2", "--training.global_batch_size=2"});
  EXPECT_HAS(m, "test.toml: invalid config: parallelism.pp_schedule = 1f1b: ");
  EXPECT_HAS(m, "(pp = 2, stages per rank = 1 by default, micro-batches = 1 = global_batch_size / "
                "(micro_batch_size * dp))");
  EXPECT_EQ(m.find(".cpp:"), std::string::npos) << m;
  // V schedules need exactly 2 stages per rank.
  m = load_error(kTiny, {"--model.n_layers=8", "--parallelism.pp=2", "--parallelism.pp_schedule=zbv",
                         "--parallelism.pp_virtual_stages=3", "--training.global_batch_size=8"});
  EXPECT_HAS(m, "invalid config: parallelism.pp_schedule = zbv: ");
  EXPECT_HAS(m, "stages per rank = 3 from pp_virtual_stages, micro-batches = 4");
  // The same job with the schedule's own default passes.
  EXPECT_EQ(load_error(kTiny, {"--model.n_layers=8", "--parallelism.pp=2", "--parallelism.pp_schedule=zbv",
                               "--training.global_batch_size=8"}),
            "");
}

TEST(ConfigPipeline, ScheduleCsvIsReadAndValidated) {
  // pp 1, 2 micro-batches (kTiny): one rank computes F then B for each.
  const std::string ok = write_csv("ok", "0F0,0F1,0B0,0B1\n");
  JobConfig c = load_config_string(kTiny, {"--parallelism.pp_schedule_csv=" + ok});
  EXPECT_EQ(c.parallelism.pp_schedule_csv, ok);
  PipelineSetup s = resolve_pipeline(c);
  EXPECT_TRUE(s.from_csv);
  EXPECT_EQ(s.csv.n_microbatches, 2);
  EXPECT_EQ(s.layout.stage_rank, std::vector<int>{0});
  EXPECT_EQ(load_config_string(to_toml(c)), c);

  auto err = [](const std::string& path, std::vector<std::string> more = {}) {
    more.push_back("--parallelism.pp_schedule_csv=" + path);
    return load_error(kTiny, more);
  };
  std::string m = err("/nonexistent/dir/s.csv");
  EXPECT_HAS(m, "test.toml: invalid config: parallelism.pp_schedule_csv = \"/nonexistent/dir/s.csv\": cannot open "
                "schedule CSV '/nonexistent/dir/s.csv'");
  EXPECT_EQ(m.find(".cpp:"), std::string::npos) << m;
  const std::string bad = write_csv("bad", "0F0,0Q1\n");
  m = err(bad);
  EXPECT_HAS(m, "parallelism.pp_schedule_csv = \"" + bad + "\": " + bad + ": CSV row 1, column 2");
  EXPECT_EQ(m.find(".cpp:"), std::string::npos) << m;
  m = err(ok, {"--model.n_layers=8", "--parallelism.pp=2"});
  EXPECT_HAS(m, "parallelism.pp_schedule_csv = \"" + ok + "\": has 1 rows (one per pipeline rank), parallelism.pp = 2");
  const std::string one_mb = write_csv("one_mb", "0F0,0B0\n");
  EXPECT_HAS(err(one_mb), "runs 1 micro-batches, the job has 2 per optimizer step");
  m = err(ok, {"--parallelism.pp_virtual_stages=2"});
  EXPECT_HAS(m, "has 1 stages, pp * stages per rank = 1 * 2 = 2 (pp_virtual_stages)");
  const std::string order = write_csv("order", "0F0,0B1,0F1,0B0\n");  // B of micro-batch 1 before its F
  m = err(order);
  EXPECT_HAS(m, "parallelism.pp_schedule_csv = \"" + order + "\": schedule 'csv' is invalid: rank 0, action 1 '0B1': "
                "no F for stage 0 mb 1 before it");
  EXPECT_EQ(m.find(".cpp:"), std::string::npos) << m;
}

// ---- HF config.json ---------------------------------------------------------------------------------

TEST(HfConfig, ImportMatchesPresets) {
  const std::vector<std::pair<std::string, std::string>> pairs = {{"deepseek_v2_lite", "deepseek_v2_lite"},
                                                                  {"deepseek_v2", "deepseek_v2"},
                                                                  {"deepseek_v3", "deepseek_v3"},
                                                                  {"mixtral_8x7b", "mixtral_8x7b"},
                                                                  {"qwen3_30b_a3b", "qwen3_30b_a3b"}};
  for (const auto& [fixture, name] : pairs) {
    SCOPED_TRACE(name);
    ModelSpec hf = load_hf_config(hf_fixture(fixture));
    ModelSpec pre = load_config(preset(name)).model;
    ParamCounts a = count_params(hf), b = count_params(pre);
    // The preset keeps the paper's init std where HF configs carry a generic 0.02 (DeepSeek-V3: 0.006).
    hf.init_std = pre.init_std;
    // DeepSeek-V3's config.json says num_nextn_predict_layers = 1 (its MTP module); the preset leaves it out.
    EXPECT_EQ(hf.mtp_layers, fixture == "deepseek_v3" ? 1 : 0);
    if (fixture == "deepseek_v3") {
      EXPECT_GT(a.mtp, int64_t(11e9));  // one depth: a block of the last layer's kind, eh_proj, norms
      hf.mtp_layers = 0;
      a = count_params(hf);
    }
    EXPECT_EQ(a.total, b.total);
    EXPECT_EQ(a.active, b.active);
    EXPECT_EQ(hf, pre);
  }
}

TEST(HfConfig, ExportRoundTripsEveryExpressiblePreset) {
  for (const auto& name : kPresets) {
    SCOPED_TRACE(name);
    ModelSpec s = load_config(preset(name)).model;
    if (name == "llama4_scout") {  // sigmoid routing with MHA/GQA + shared experts: no matching HF type here
      std::string m = error_of([&] { to_hf_config_json(s); });
      EXPECT_HAS(m, "cannot be written as HF model_type deepseek: score_func must be softmax");
      continue;
    }
    if (name == "gpt_oss_120b") {  // GPT-OSS's clamped SwiGLU experts: no supported HF type carries them
      EXPECT_HAS(error_of([&] { to_hf_config_json(s); }), "model.expert_act = clamped_swiglu cannot be written");
      continue;
    }
    std::string j = to_hf_config_json(s);
    EXPECT_EQ(model_spec_from_hf_json(j, name), s) << j;
  }
  auto type_of = [](const std::string& n) {
    return nlohmann::json::parse(to_hf_config_json(load_config(preset(n)).model))["model_type"].get<std::string>();
  };
  EXPECT_EQ(type_of("deepseek_v3"), "deepseek_v3");
  EXPECT_EQ(type_of("deepseek_v2_lite"), "deepseek_v2");
  EXPECT_EQ(type_of("ds_mini"), "deepseek");
  EXPECT_EQ(type_of("mixtral_8x7b"), "mixtral");
  EXPECT_EQ(type_of("qwen3_30b_a3b"), "qwen3_moe");
  // The exported V2-Lite carries q_lora_rank null, like the real file.
  auto j = nlohmann::json::parse(to_hf_config_json(load_config(preset("deepseek_v2_lite")).model));
  EXPECT_TRUE(j["q_lora_rank"].is_null());
  EXPECT_EQ(j["topk_method"], "greedy");
}

// The GPT-style keys (a GELU MLP, dropout) have no field in the HF types written here: export refuses them by name.
TEST(HfConfig, ExportRefusesGptKeys) {
  const JobConfig dense = load_config_string(kTiny, {"--model.n_routed_experts=0", "--model.first_k_dense=0"});
  EXPECT_NO_THROW(to_hf_config_json(dense.model));
  ModelSpec gelu = dense.model;
  gelu.ffn = FfnKind::GELU;
  EXPECT_HAS(error_of([&] { to_hf_config_json(gelu); }), "model.ffn = gelu cannot be written");
  ModelSpec drop = dense.model;
  drop.dropout = 0.1;
  EXPECT_HAS(error_of([&] { to_hf_config_json(drop); }), "model.dropout = 0.1 cannot be written");
  // GPT-OSS's clamped SwiGLU experts (planned only) likewise.
  ModelSpec clamped = load_config_string(kTiny).model;
  clamped.moe.expert_act = ExpertAct::ClampedSwiGLU;
  EXPECT_HAS(error_of([&] { to_hf_config_json(clamped); }), "model.expert_act = clamped_swiglu cannot be written");
  const JobConfig oss = load_config_string(kTiny, {"--model.expert_act=clamped_swiglu"});
  EXPECT_EQ(oss.model.moe.expert_act, ExpertAct::ClampedSwiGLU);
  EXPECT_EQ(load_config_string(to_toml(oss)), oss);
  EXPECT_HAS(load_error(kTiny, {"--model.expert_act=clamped_swiglu", "--model.n_routed_experts=0",
                                "--model.n_shared_experts=0", "--model.first_k_dense=0"}),
             "model.expert_act");
  // Both keys load, round-trip through TOML and default to the DeepSeek shape.
  EXPECT_EQ(dense.model.ffn, FfnKind::SwiGLU);
  EXPECT_EQ(dense.model.dropout, 0.0);
  EXPECT_EQ(dense.model.attention_impl, AttnImpl::Flash);
  const JobConfig gpt = load_config_string(kTiny, {"--model.n_routed_experts=0", "--model.first_k_dense=0",
                                                   "--model.ffn=gelu", "--model.dropout=0.1",
                                                   "--model.attention_impl=unfused"});
  EXPECT_EQ(gpt.model.ffn, FfnKind::GELU);
  EXPECT_EQ(gpt.model.attention_impl, AttnImpl::Unfused);
  EXPECT_EQ(load_config_string(to_toml(gpt)), gpt);
}

TEST(HfConfig, DenseLayerPatternsImport) {
  // Qwen3-MoE with decoder_sparse_step 2 and an mlp_only layer: dense layers 0, 2, 3 -> explicit list.
  std::ifstream in(hf_fixture("qwen3_30b_a3b"));
  nlohmann::json j = nlohmann::json::parse(in);
  j["num_hidden_layers"] = 6;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  ModelSpec s = model_spec_from_hf_json(j.dump());
  EXPECT_EQ(s.first_k_dense, 0);
  EXPECT_EQ(s.dense_layers, (std::vector<int>{0, 2, 3, 4}));
  EXPECT_TRUE(s.is_moe_layer(1));
  EXPECT_TRUE(s.is_moe_layer(5));
  EXPECT_EQ(model_spec_from_hf_json(to_hf_config_json(s)), s);
  // DeepSeek moe_layer_freq 2 after 1 dense layer: MoE at 2, 4.
  std::ifstream in2(hf_fixture("deepseek_v2_lite"));
  nlohmann::json d = nlohmann::json::parse(in2);
  d["num_hidden_layers"] = 5;
  d["moe_layer_freq"] = 2;
  s = model_spec_from_hf_json(d.dump());
  EXPECT_EQ(s.dense_layers, (std::vector<int>{0, 1, 3}));
  std::string m = error_of([&] { to_hf_config_json(s); });
  EXPECT_HAS(m, "dense layers must be the first k");
}

TEST(HfConfig, ImportErrors) {
  std::string m = error_of([] { model_spec_from_hf_json(R"({"model_type": "llama"})", "x.json"); });
  EXPECT_HAS(m, "x.json: unsupported model_type 'llama'");
  m = error_of([] { model_spec_from_hf_json("{not json", "x.json"); });
  EXPECT_HAS(m, "x.json: invalid JSON");
  m = error_of([] { load_hf_config("/nonexistent/config.json"); });
  EXPECT_HAS(m, "not found");

  std::ifstream in(hf_fixture("mixtral_8x7b"));
  const nlohmann::json base = nlohmann::json::parse(in);
  nlohmann::json j = base;
  j.erase("hidden_size");
  m = error_of([&] { model_spec_from_hf_json(j.dump(), "x.json"); });
  EXPECT_HAS(m, "x.json: mixtral config: 'hidden_size' is missing");
  j = base;
  j["num_local_experts"] = "8";
  m = error_of([&] { model_spec_from_hf_json(j.dump(), "x.json"); });
  EXPECT_HAS(m, "'num_local_experts' must be an integer, got string");
  j = base;
  j["hidden_act"] = "gelu";
  m = error_of([&] { model_spec_from_hf_json(j.dump(), "x.json"); });
  EXPECT_HAS(m, "'hidden_act' must be silu");
  j = base;
  j["num_experts_per_tok"] = 9;
  m = error_of([&] { model_spec_from_hf_json(j.dump(), "x.json"); });
  EXPECT_HAS(m, "x.json: invalid config: model.topk = 9: must be <= n_routed_experts (8)");
}

TEST(ConfigPipeline, RecomputeStageIdsResolveToTheirLayers) {
  const std::vector<std::string> base = {"--model.n_layers=8", "--parallelism.pp=2",
                                         "--parallelism.pp_schedule=interleaved_1f1b",
                                         "--parallelism.pp_layout=Et*2|t*2|t*2|t*2L",
                                         "--activation_checkpoint.mode=full"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), base.begin(), base.end());
    return load_config_string(kTiny, more);
  };
  JobConfig c = with({"--activation_checkpoint.stage_ids=[0, 2]"});
  EXPECT_EQ(c.activation_checkpoint.stage_ids, (std::vector<int>{0, 2}));
  EXPECT_EQ(load_config_string(to_toml(c)), c);
  ActivationCheckpointSpec a = resolve_checkpointing(c);
  EXPECT_TRUE(a.stage_ids.empty());
  EXPECT_EQ(a.layer_ids, (std::vector<int>{0, 1, 4, 5}));  // stage 0: layers 0-1, stage 2: layers 4-5
  EXPECT_TRUE(a.applies_to(4));
  EXPECT_FALSE(a.applies_to(2));
  // with layer_ids: the layers in both; nothing left turns recompute off
  a = resolve_checkpointing(with({"--activation_checkpoint.stage_ids=[2]", "--activation_checkpoint.layer_ids=[5, 7]"}));
  EXPECT_EQ(a.layer_ids, (std::vector<int>{5}));
  a = resolve_checkpointing(with({"--activation_checkpoint.stage_ids=[1]", "--activation_checkpoint.layer_ids=[5]"}));
  EXPECT_EQ(a.mode, AcMode::None);
  EXPECT_FALSE(a.applies_to(5));
  // without stage_ids the section is unchanged
  EXPECT_EQ(resolve_checkpointing(with({})), with({}).activation_checkpoint);
  EXPECT_HAS(load_error(kTiny, {"--model.n_layers=8", "--parallelism.pp=2", "--activation_checkpoint.mode=full",
                                "--activation_checkpoint.stage_ids=[2]"}),
             "activation_checkpoint.stage_ids = 2: pipeline stage out of range [0, 2)");
  EXPECT_HAS(load_error(kTiny, {"--activation_checkpoint.mode=full", "--activation_checkpoint.stage_ids=[0, 0]"}),
             "activation_checkpoint.stage_ids = 0: listed twice");
  EXPECT_HAS(load_error(kTiny, {"--activation_checkpoint.stage_ids=[0]"}),
             "stage(s) listed but mode is none");
}
