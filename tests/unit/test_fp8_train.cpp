// test_fp8_train.cpp: FP8 training in the model ([quantize], docs/fp8.md): the config keys and their errors, the
// model's FP8 linears against their twin (the same training step with every FP8 GEMM replaced by the fp32 GEMM
// of its dequantized operands), recipe none unchanged, a short training run next to fp32, delayed scaling's
// bitwise resume, and the per-module amax / scale record in metrics.jsonl.
// Not the FP8 kernels (tests/ops/fp8_gemm_cases.cpp) and not the loss-gap study (bench/fp8_loss_gap.sh).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "moetron/config.h"
#include "moetron/fp8.h"
#include "moetron/model.h"
#include "moetron/rng.h"
#include "moetron/trainer.h"
#include "test_util.h"
#include "fp8_test_util.h"
#include "train_test_util.h"

using namespace moetron;
using moetron::testing::error_of;
namespace fs = std::filesystem;

namespace {
JobConfig tiny(const std::string& dump, std::vector<std::string> extra = {}) {
  return moetron::testing::tiny_fp32_job(dump, std::move(extra));
}
std::string fresh_dir(const std::string& name) { return moetron::testing::fresh_test_dir("moetron_test_fp8_", name); }
TrainOptions quiet() { return moetron::testing::quiet_options(); }

using Pass = moetron::testing::Fp8Pass;
// One forward + backward of ds_tiny (MHA) or ds_tiny_mla with the given [quantize], with or without the twins.
Pass one_pass(const QuantizeSpec& q, bool twin, const std::string& attn = "mha") {
  return moetron::testing::fp8_pass(q, attn == "mla" ? "configs/ds_tiny_mla.toml" : "configs/ds_tiny.toml", {}, twin);
}

QuantizeSpec recipe(Fp8Recipe r, const std::string& format = "e4m3") {
  QuantizeSpec q;
  q.recipe = r, q.format = format;
  return q;
}
}  // namespace

TEST(Fp8Config, KeysParseRoundTripAndBadValuesAreNamed) {
  JobConfig c = tiny("/tmp", {"--quantize.recipe=tensorwise", "--quantize.format=hybrid", "--quantize.scaling=delayed",
                              "--quantize.amax_history_len=4", "--quantize.modules=[\"attention\", \"routed_experts\"]"});
  EXPECT_TRUE(c.quantize.hybrid());
  EXPECT_TRUE(c.quantize.delayed());
  EXPECT_TRUE(c.quantize.has_module("routed_experts"));
  EXPECT_FALSE(c.quantize.has_module("dense_mlp"));
  EXPECT_EQ(load_config_string(to_toml(c)), c);
  EXPECT_EQ(config_from_json(to_json(c)), c);
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--quantize.recipe=blockwise", "--quantize.scaling=delayed"},
       "quantize.scaling = delayed: delayed scaling is implemented for recipe = tensorwise only"},
      {{"--quantize.recipe=mxfp8", "--quantize.scaling=delayed"}, "use scaling = \"current\""},
      {{"--quantize.format=hybrid"}, "quantize.format = hybrid: has no effect with quantize.recipe = none"},
      {{"--quantize.cache_fp8_activations=true"}, "quantize.cache_fp8_activations = true: has no effect"},
      {{"--quantize.recipe=rowwise", "--quantize.modules=[\"router\"]"}, "quantize.modules = \"router\": expected"},
      {{"--quantize.recipe=rowwise", "--quantize.modules=[]"}, "needs at least one module"},
      {{"--quantize.recipe=rowwise", "--quantize.modules=[\"attention\",\"attention\"]"}, "listed twice"},
      {{"--quantize.recipe=tensorwise", "--quantize.amax_history_len=8"}, "applies to scaling = \"delayed\" only"},
      {{"--quantize.recipe=tensorwise", "--quantize.scaling=delayed", "--quantize.amax_history_len=0"},
       "quantize.amax_history_len = 0: must be in [1, 1024]"},
      {{"--quantize.format=e5m2"}, "quantize.format"},
  };
  for (const auto& [ov, expect] : bad) {
    const std::string e = error_of([&] { tiny("/tmp", ov); });
    EXPECT_NE(e.find(expect), std::string::npos) << ov[0] << ": " << e;
  }
}

// The model's FP8 path is bitwise the fp32 computation on the dequantized operands, for every recipe, both
// formats and both attention kinds; and it is FP8 (it differs from the fp32 model).
TEST(Fp8Model, TrainingStepEqualsTheFp32ComputationOnDequantizedOperands) {
  const Pass ref = one_pass(QuantizeSpec{}, false);
  struct Case {
    Fp8Recipe r;
    const char* fmt;
    const char* attn;
  };
  for (const Case& k : {Case{Fp8Recipe::Tensorwise, "e4m3", "mha"}, Case{Fp8Recipe::Rowwise, "hybrid", "mha"},
                        Case{Fp8Recipe::Blockwise, "e4m3", "mla"}, Case{Fp8Recipe::MXFP8, "hybrid", "mha"}}) {
    const QuantizeSpec q = recipe(k.r, k.fmt);
    const Pass a = one_pass(q, false, k.attn), t = one_pass(q, true, k.attn);
    const std::string what = std::string(to_string(k.r)) + "/" + k.fmt + "/" + k.attn;
    EXPECT_EQ(std::memcmp(&a.loss, &t.loss, sizeof(double)), 0) << what << ": " << a.loss << " vs twin " << t.loss;
    ASSERT_EQ(a.grads.size(), t.grads.size());
    EXPECT_EQ(std::memcmp(a.grads.data(), t.grads.data(), a.grads.size() * 4), 0) << what << ": gradients differ";
    if (std::string(k.attn) == "mha") {
      EXPECT_NE(a.loss, ref.loss) << what << ": FP8 gave the fp32 loss bitwise (nothing quantized?)";
      // One pass at initialisation: every GEMM operand is rounded to E4M3 (relative error <= 2^-4), so the
      // loss may move by at most that much relative (it moves far less: the errors are unbiased and the
      // logits of a fresh model are small).
      EXPECT_LT(std::fabs(a.loss - ref.loss) / ref.loss, 0.0625) << what;
    }
  }
}

// Recipe none is the plain path: the same bits as a model that never heard of [quantize]; and a model whose
// modules exclude everything present stays fp32 too.
TEST(Fp8Model, RecipeNoneAndUnselectedModulesAreBitwiseUnchanged) {
  const Pass ref = one_pass(QuantizeSpec{}, false);
  QuantizeSpec q = recipe(Fp8Recipe::Blockwise);
  q.modules = {"dense_mlp"};  // ds_tiny's layer 0 is dense: only its MLP is FP8
  const Pass dense_only = one_pass(q, false);
  EXPECT_NE(std::memcmp(&dense_only.loss, &ref.loss, sizeof(double)), 0);
  Pass none = one_pass(QuantizeSpec{}, false);
  EXPECT_EQ(std::memcmp(&none.loss, &ref.loss, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(none.grads.data(), ref.grads.data(), ref.grads.size() * 4), 0);
}

// A short run per recipe stays near the fp32 run of the same seed and data. Bound: E4M3 rounds each operand
// to 4 significant bits (relative error <= 2^-4 = 6.25 %); the loss over a few steps must stay well inside one
// such unit: |loss_fp8 - loss_fp32| <= 2^-4 * loss_fp32 / 4 at every step (observed: < 0.1 %).
TEST(Fp8Train, ShortRunsStayCloseToFp32) {
  const auto ref = train(tiny(fresh_dir("ref"), {"--training.steps=4", "--optimizer.lr=3e-3"}), quiet());
  for (const char* r : {"tensorwise", "blockwise"}) {
    const auto f = train(tiny(fresh_dir(r), {"--training.steps=4", "--optimizer.lr=3e-3",
                                             std::string("--quantize.recipe=") + r, "--quantize.format=hybrid"}),
                         quiet());
    ASSERT_EQ(f.history.size(), ref.history.size());
    for (size_t i = 0; i < ref.history.size(); ++i)
      EXPECT_LE(std::fabs(f.history[i].loss - ref.history[i].loss), 0.0625 / 4 * ref.history[i].loss)
          << r << " step " << i + 1;
    EXPECT_NE(f.history.back().loss, ref.history.back().loss) << r;
  }
}

// Delayed scaling: the amax histories travel in the checkpoint; 2 steps + resume + 2 steps equals 4 straight.
TEST(Fp8Train, DelayedScalingResumesBitwise) {
  const auto [full, resumed] = moetron::testing::train_delayed_and_resume(
      [](const std::string& d, const std::vector<std::string>& q) { return tiny(d, q); }, fresh_dir("delayed_full"),
      fresh_dir("delayed_split"));
  ASSERT_EQ(resumed.start_step, 2);
  ASSERT_EQ(resumed.history.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(std::memcmp(&resumed.history[i].loss, &full.history[2 + i].loss, sizeof(double)), 0) << "step " << 3 + i;
    EXPECT_EQ(resumed.history[i].param_hash, full.history[2 + i].param_hash) << "step " << 3 + i;
  }
  // Without the histories the resumed scales differ: a fresh history gives scale 1 at step 3 (a real test of the
  // checkpointed state, not of the data order).
  const auto cur = train(tiny(fresh_dir("delayed_vs_current"), {"--quantize.recipe=tensorwise", "--training.steps=4"}),
                         quiet());
  EXPECT_NE(cur.history[3].loss, full.history[3].loss);
}

// metrics.jsonl carries per-module amax and scales; with tensorwise current scaling the largest scale of an
// operand is exactly the scale of its largest amax.
TEST(Fp8Train, MetricsRecordAmaxAndScalesPerModule) {
  const std::string d = fresh_dir("metrics");
  train(tiny(d, {"--training.steps=2", "--quantize.recipe=tensorwise", "--quantize.format=hybrid"}), quiet());
  EXPECT_EQ(moetron::testing::expect_fp8_module_metrics(d, {"attention", "dense_mlp", "shared_experts", "routed_experts"}), 2);
}
