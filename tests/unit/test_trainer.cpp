// test_trainer.cpp: the training loop end to end on ds_tiny with synthetic data: the LR schedule,
// bitwise determinism, bitwise resume from a checkpoint, the loss falling, recompute equivalence, and
// the errors a user sees for bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "moetron/attention.h"
#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/env.h"
#include "moetron/gemm.h"
#include "moetron/model.h"
#include "moetron/runtime.h"
#include "moetron/trainer.h"
#include "train_test_util.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {
std::string repo(const std::string& rel) { return moetron::testing::repo_path(rel); }
JobConfig tiny(const std::string& dump, std::vector<std::string> extra = {}) { return moetron::testing::tiny_job(dump, extra); }
std::string fresh_dir(const std::string& name) { return moetron::testing::fresh_test_dir("moetron_test_", name); }
TrainOptions quiet() { return moetron::testing::quiet_options(); }
}  // namespace

TEST(LrSchedule, WarmupThenCosineToMin) {
  OptimizerSpec o;
  o.lr = 1.0;
  LRSchedulerSpec s;
  s.warmup_steps = 4;
  s.decay_type = DecayType::Cosine;
  s.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(lr_at(o, s, 1, 10), 0.25);
  EXPECT_DOUBLE_EQ(lr_at(o, s, 4, 10), 1.0);
  EXPECT_NEAR(lr_at(o, s, 7, 10), 0.1 + 0.9 * 0.5, 1e-12);  // halfway through the decay
  EXPECT_NEAR(lr_at(o, s, 10, 10), 0.1, 1e-12);
  s.decay_type = DecayType::Linear;
  EXPECT_NEAR(lr_at(o, s, 7, 10), 1 - 0.9 * 0.5, 1e-12);
  s.decay_type = DecayType::None;
  EXPECT_DOUBLE_EQ(lr_at(o, s, 9, 10), 1.0);
  EXPECT_THROW(lr_at(o, s, 0, 10), Error);
}

TEST(Trainer, SameConfigAndSeedGiveBitwiseIdenticalLossCurve) {
  auto a = train(tiny(fresh_dir("det_a"), {"--training.steps=5"}), quiet());
  auto b = train(tiny(fresh_dir("det_b"), {"--training.steps=5"}), quiet());
  ASSERT_EQ(a.history.size(), 5u);
  ASSERT_EQ(b.history.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(std::memcmp(&a.history[i].loss, &b.history[i].loss, sizeof(double)), 0) << "step " << i + 1;
    EXPECT_EQ(std::memcmp(&a.history[i].grad_norm, &b.history[i].grad_norm, sizeof(double)), 0);
  }
  // A different seed gives a different curve (the test can fail).
  auto c = train(tiny(fresh_dir("det_c"), {"--training.steps=2", "--training.seed=7"}), quiet());
  EXPECT_NE(a.history[0].loss, c.history[0].loss);
}

TEST(Trainer, ResumeContinuesBitwiseIdentically) {
  std::string d1 = fresh_dir("resume_full");
  std::vector<std::string> ck = {"--checkpoint.enable=true", "--checkpoint.interval=3", "--checkpoint.keep_latest_k=2"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), ck.begin(), ck.end());
    return v;
  };
  auto full = train(tiny(d1, with({"--training.steps=6"})), quiet());
  ASSERT_EQ(full.history.size(), 6u);
  // Interrupted run: train the same 6-step schedule, then delete the newest checkpoint so that the
  // folder looks like a run that stopped after step 3. Train again: it must resume from step 3.
  std::string d3 = fresh_dir("resume_split6");
  {
    auto r = train(tiny(d3, with({"--training.steps=6"})), quiet());
    ASSERT_EQ(r.end_step, 6);
    fs::remove_all(fs::path(d3) / "checkpoint" / "step-6");
  }
  auto resumed = train(tiny(d3, with({"--training.steps=6"})), quiet());
  EXPECT_EQ(resumed.start_step, 3);
  ASSERT_EQ(resumed.history.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(std::memcmp(&resumed.history[i].loss, &full.history[3 + i].loss, sizeof(double)), 0)
        << "step " << 4 + i << ": resumed " << resumed.history[i].loss << " vs uninterrupted " << full.history[3 + i].loss;
  // keep_latest_k = 2 pruned older checkpoints in the uninterrupted run: step-3 and step-6 remain.
  EXPECT_TRUE(fs::exists(fs::path(d1) / "checkpoint" / "step-6"));
  EXPECT_TRUE(fs::exists(fs::path(d1) / "checkpoint" / "step-3"));
  // metrics.jsonl has the required keys on every line
  std::ifstream f(fs::path(d1) / "metrics.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    for (const char* k : {"step", "loss", "tokens_per_s", "tflops", "mfu", "mem_peak_bytes", "grad_norm", "lr"})
      EXPECT_TRUE(j.contains(k)) << k << " missing in " << line;
    ++n;
  }
  EXPECT_EQ(n, 6);
}

TEST(Trainer, LossFallsOnLearnableData) {
  auto r = train(tiny(fresh_dir("falls"), {"--training.steps=40", "--optimizer.lr=3e-3"}), quiet());
  double first = r.history.front().loss, last = r.history.back().loss;
  EXPECT_LT(last, first - 1.0) << "first " << first << " last " << last;
}

TEST(Trainer, FullRecomputeGivesIdenticalLossAndSavesActivationMemory) {
  auto a = train(tiny(fresh_dir("ac_none"), {"--training.steps=3"}), quiet());
  auto b = train(tiny(fresh_dir("ac_full"), {"--training.steps=3", "--activation_checkpoint.mode=full"}), quiet());
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(std::memcmp(&a.history[i].loss, &b.history[i].loss, sizeof(double)), 0) << "step " << i + 1;
  EXPECT_GT(b.recompute_seconds, 0.0);
  EXPECT_LT(b.act_peak_bytes, a.act_peak_bytes);
  for (const char* mods : {"[\"norm\"]", "[\"attention_core\"]", "[\"moe_act\"]",
                           "[\"norm\", \"attention_core\", \"moe_act\"]"}) {
    auto c = train(tiny(fresh_dir("ac_sel"), {"--training.steps=3", "--activation_checkpoint.mode=selective",
                                              std::string("--activation_checkpoint.modules=") + mods}),
                   quiet());
    for (size_t i = 0; i < 3; ++i)
      EXPECT_EQ(std::memcmp(&a.history[i].loss, &c.history[i].loss, sizeof(double)), 0) << mods << " step " << i + 1;
    EXPECT_LT(c.act_peak_bytes, a.act_peak_bytes) << mods;
    EXPECT_GT(c.recompute_seconds, 0.0) << mods;
  }
  // layer_ids restricts recompute to the listed layers: less saving than all layers.
  auto one = train(tiny(fresh_dir("ac_one"), {"--training.steps=3", "--activation_checkpoint.mode=selective",
                                              "--activation_checkpoint.modules=[\"norm\"]",
                                              "--activation_checkpoint.layer_ids=[2]"}),
                   quiet());
  auto all = train(tiny(fresh_dir("ac_all"), {"--training.steps=3", "--activation_checkpoint.mode=selective",
                                              "--activation_checkpoint.modules=[\"norm\"]"}),
                   quiet());
  EXPECT_EQ(std::memcmp(&a.history[2].loss, &one.history[2].loss, sizeof(double)), 0);
  EXPECT_LE(all.act_peak_bytes, one.act_peak_bytes);
}

TEST(Trainer, BadInputGivesClearErrors) {
  auto msg = [](auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  std::string m = msg([] { load_config(repo("configs/ds_tiny.toml"), {"--traning.steps=3"}); });
  EXPECT_NE(m.find("training.steps"), std::string::npos) << m;
  m = msg([] { load_config(repo("configs/ds_tiny.toml"), {"--training.steps=abc"}); });
  EXPECT_NE(m.find("training.steps"), std::string::npos) << m;
  m = msg([] { load_config(repo("configs/no_such_file.toml")); });
  EXPECT_NE(m.find("no_such_file.toml"), std::string::npos) << m;
  m = msg([] { load_config(repo("configs/ds_tiny.toml"), {"--model.topk=99"}); });
  EXPECT_NE(m.find("topk"), std::string::npos) << m;
  m = msg([&] {
    train(tiny(fresh_dir("missing"), {"--training.dataset=/no/such/corpus", "--training.dataset_path=/no/such/dir"}),
          quiet());
  });
  EXPECT_NE(m.find("/no/such"), std::string::npos) << m;
}

TEST(Trainer, ParallelismThatDoesNotMatchTheWorldFailsAtStartUp) {
  // One process (no mpirun) asked for dp = 2: the mesh's message names the world size and the product.
  try {
    train(tiny(fresh_dir("dp_mismatch"), {"--parallelism.dp_shard=2", "--training.steps=1"}), quiet());
    FAIL() << "no error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("world size 1 != pp (1) * dp_replicate (1) * dp_shard (2) * cp (1) * tp (1) = 2"), std::string::npos) << m;
  }
}

// training.compute_dtype: auto resolves to what the CPU computes natively; bf16 where it is not native is a
// clear error naming the CPU feature and the key. MOETRON_ISA's override (set_isa_override) lowers the
// kernels to AVX2 so that the non-native branch is tested on every machine.
TEST(ComputeDtype, AutoPicksNativeBf16OrFp32AndBf16ElsewhereNamesFeatureAndKey) {
  std::string why;
  const ComputeDtype a = resolve_compute_dtype(ComputeDtype::Auto, &why);
  EXPECT_EQ(a, gemm_bf16_native() && active_isa() == Isa::Avx512 ? ComputeDtype::BF16 : ComputeDtype::FP32) << why;
  EXPECT_NE(why.find("auto: "), std::string::npos) << why;
  EXPECT_EQ(resolve_compute_dtype(ComputeDtype::FP32), ComputeDtype::FP32);  // fp32 is possible everywhere
  const Isa before = active_isa();
  set_isa_override(Isa::Avx2);
  EXPECT_EQ(resolve_compute_dtype(ComputeDtype::Auto, &why), ComputeDtype::FP32);
  EXPECT_NE(why.find(cpu_features().avx512bf16 ? "MOETRON_ISA" : "AVX512-BF16"), std::string::npos) << why;
  try {
    (void)resolve_compute_dtype(ComputeDtype::BF16);
    ADD_FAILURE() << "bf16 accepted where it is not native";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("training.compute_dtype"), std::string::npos) << m;
    EXPECT_NE(m.find(cpu_features().avx512bf16 ? "MOETRON_ISA" : "AVX512-BF16"), std::string::npos) << m;
  }
  // The trainer refuses it before building anything.
  EXPECT_THROW(train(tiny(fresh_dir("bf16_refused"), {"--training.compute_dtype=bf16", "--training.steps=1"}), quiet()),
               Error);
  set_isa_override(before);
}

// training.attention_dtype reaches the attention kernels: under bf16 compute "fp32" and "bf16" train differently
// (the bf16 products round q, k, v, P, dS) and "auto" is the one attention_bf16_preferred() names; under fp32
// compute "bf16" is refused naming both keys and "auto" equals "fp32" bitwise.
TEST(ComputeDtype, AttentionDtypeKeyChoosesTheAttentionProducts) {
  auto run = [](const std::string& name, std::vector<std::string> ov) {
    ov.push_back("--training.steps=2");
    return train(tiny(fresh_dir(name), ov), quiet()).history;
  };
  auto same = [](const std::vector<StepRecord>& a, const std::vector<StepRecord>& b) {
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].loss != b[i].loss) return false;
    return a.size() == b.size();
  };
  const auto f_auto = run("attn_f_auto", {"--training.compute_dtype=fp32"});
  EXPECT_TRUE(same(f_auto, run("attn_f_f32", {"--training.compute_dtype=fp32", "--training.attention_dtype=fp32"})));
  try {
    run("attn_f_bf16", {"--training.compute_dtype=fp32", "--training.attention_dtype=bf16"});
    ADD_FAILURE() << "bf16 attention accepted under fp32 compute";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("training.attention_dtype = \"bf16\" needs bf16 compute"), std::string::npos) << m;
    EXPECT_NE(m.find("training.compute_dtype"), std::string::npos) << m;
  }
  if (!(gemm_bf16_native() && active_isa() == Isa::Avx512)) GTEST_SKIP() << "bf16 is not native here";
  const auto b32 = run("attn_b_f32", {"--training.compute_dtype=bf16", "--training.attention_dtype=fp32"});
  const auto b16 = run("attn_b_bf16", {"--training.compute_dtype=bf16", "--training.attention_dtype=bf16"});
  const auto bau = run("attn_b_auto", {"--training.compute_dtype=bf16"});
  EXPECT_FALSE(same(b32, b16)) << "attention_dtype fp32 and bf16 gave the same losses";
  EXPECT_TRUE(same(bau, attention_bf16_preferred() ? b16 : b32)) << "auto is not the preferred choice";
  for (size_t i = 0; i < b32.size(); ++i)  // both train the same model: bf16-level agreement
    EXPECT_NEAR(b16[i].loss, b32[i].loss, 1e-2 * std::fabs(b32[i].loss)) << "step " << i + 1;
}

// Keys the planner reads and the engine does not implement yet are refused by name, not ignored.
TEST(Trainer, RefusesPlannerOnlyKeys) {
  const std::string dense = "--model.n_routed_experts=0 --model.n_shared_experts=0";  // gelu is for dense models
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--parallelism.tp=2 --parallelism.expert_tp=2 --parallelism.sequence_parallel=false",
       "parallelism.sequence_parallel = false with tp = 2 is not implemented in the engine"},
      {"--parallelism.expert_tp=2", "so expert_tp must equal tp"},
      {"--model.n_layers=4 --parallelism.ep=2 --parallelism.pp=2 --parallelism.pp_schedule=interleaved_1f1b "
       "--parallelism.ep_overlap=true --parallelism.ep_overlap_split=true",
       "parallelism.ep_overlap_split = true is not implemented in the engine"},
      {"--quantize.recipe=blockwise --quantize.cache_fp8_activations=true --activation_checkpoint.mode=selective "
       "--activation_checkpoint.modules=[\"norm\"]",
       "quantize.cache_fp8_activations = true is not implemented with activation_checkpoint.mode = \"selective\""},
      {"--parallelism.zero=2", "parallelism.zero = 2 is not implemented in the trainer"},
      {"--parallelism.dp_replicate=2 --parallelism.dp_shard=2 --parallelism.zero=3 --parallelism.ep=4 "
       "--training.global_batch_size=16",
       "parallelism.ep = 4 with zero = 3 and dp_replicate = 2 (HSDP) needs ep to divide dp_shard = 2"},
      {dense + " --model.ffn=gelu", "model.ffn = gelu is not implemented in the engine"},
      {"--model.dropout=0.1", "model.dropout = 0.1 is not implemented in the engine"},
      {"--model.attention_impl=unfused", "model.attention_impl = unfused is not implemented in the engine"},
  };
  for (const auto& [ov, expect] : cases) {
    std::vector<std::string> extra = {"--training.steps=1"};
    std::istringstream words(ov);
    for (std::string w; words >> w;) extra.push_back(w);
    try {
      train(tiny(fresh_dir("planner_keys"), extra), quiet());
      ADD_FAILURE() << ov << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << ov << ": " << e.what();
    }
  }
}

// The environment variables that once chose behaviour are config keys now: the trainer refuses each one set,
// naming its key and value, before it starts anything (env.h), so nobody's setting is silently ignored.
TEST(Trainer, RefusesRetiredEnvironmentVariablesNamingTheirKeys) {
  for (const RetiredEnv& r : retired_env()) {
    setenv(r.name, "x", 1);
    try {
      train(tiny(fresh_dir("retired_env"), {"--training.steps=1", "--training.compute_dtype=fp32"}), quiet());
      ADD_FAILURE() << r.name << " accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(std::string(r.name) + "=x was retired: set the config key " + r.key), std::string::npos) << m;
    }
    unsetenv(r.name);
  }
}

// The fp32 path trains: the loss falls, the run is bitwise deterministic, and where bf16 is native the two
// dtypes agree to bf16 accuracy (the bf16 run rounds every GEMM operand: relative 2^-9 per operand).
TEST(ComputeDtype, Fp32TrainsDeterministicallyAndAgreesWithBf16) {
  auto f1 = train(tiny(fresh_dir("f32_a"), {"--training.steps=4", "--training.compute_dtype=fp32"}), quiet());
  auto f2 = train(tiny(fresh_dir("f32_b"), {"--training.steps=4", "--training.compute_dtype=fp32"}), quiet());
  ASSERT_EQ(f1.history.size(), 4u);
  EXPECT_EQ(f1.compute_dtype, ComputeDtype::FP32);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(f1.history[i].loss, f2.history[i].loss) << "step " << i + 1;
  EXPECT_LT(f1.history[3].loss, f1.history[0].loss);
  if (!(gemm_bf16_native() && active_isa() == Isa::Avx512)) GTEST_SKIP() << "bf16 is not native here";
  auto b = train(tiny(fresh_dir("bf_a"), {"--training.steps=4", "--training.compute_dtype=bf16"}), quiet());
  for (size_t i = 0; i < 4; ++i)
    EXPECT_NEAR(b.history[i].loss, f1.history[i].loss, 1e-2 * f1.history[i].loss) << "step " << i + 1;
}

TEST(Trainer, RunReportPredictsTheMtpDepthsActivations) {
  // The run report's activation prediction against the measured peak (one process, tp = 1): the engine's buffers to
  // the byte plus the embedding's token ids, which the report counts and the engine keeps untracked. Adding MTP depths
  // must not change that difference; the depths' blocks follow their own recompute choice (by block id: the MTP
  // blocks follow the n_layers decoder layers), and full recompute's shared re-materialization set is counted.
  const JobConfig base = tiny("unused");
  const std::string mtp_ids = "[" + std::to_string(base.model.n_layers) + ", " + std::to_string(base.model.n_layers + 1) + "]";
  for (const std::vector<std::string>& ac :
       {std::vector<std::string>{}, {"--activation_checkpoint.mode=full"},
        {"--activation_checkpoint.mode=full", "--activation_checkpoint.layer_ids=" + mtp_ids}}) {
    std::vector<std::string> plain_args = {"--training.steps=1"}, mtp_args = {"--training.steps=1", "--model.mtp_layers=2"};
    plain_args.insert(plain_args.end(), ac.begin(), ac.end());
    mtp_args.insert(mtp_args.end(), ac.begin(), ac.end());
    if (ac.size() == 2) plain_args.pop_back();  // the MTP block ids do not exist without MTP: recompute nothing there
    if (ac.size() == 2) plain_args.pop_back();
    const TrainResult plain = train(tiny(fresh_dir("mtp_pred_plain"), plain_args), quiet());
    const TrainResult mtp = train(tiny(fresh_dir("mtp_pred"), mtp_args), quiet());
    SCOPED_TRACE(ac.empty() ? std::string("no recompute") : ac.back());
    std::printf("%s: plain predicted %lld measured %lld; mtp predicted %lld measured %lld\n",
                ac.empty() ? "no recompute" : ac.back().c_str(), (long long)plain.act_predicted_bytes,
                (long long)plain.act_peak_bytes, (long long)mtp.act_predicted_bytes, (long long)mtp.act_peak_bytes);
    EXPECT_GT(mtp.act_peak_bytes, plain.act_peak_bytes);
    // Exactly the token ids apart (4 bytes a token of the micro-batch), with and without full recompute.
    const JobConfig c = tiny("unused");
    EXPECT_EQ(plain.act_predicted_bytes - plain.act_peak_bytes, 4 * c.training.micro_batch_size * c.training.seq_len);
    EXPECT_EQ(mtp.act_predicted_bytes - mtp.act_peak_bytes, plain.act_predicted_bytes - plain.act_peak_bytes)
        << "plain: predicted " << plain.act_predicted_bytes << " measured " << plain.act_peak_bytes << "; mtp: predicted "
        << mtp.act_predicted_bytes << " measured " << mtp.act_peak_bytes;
  }
}
