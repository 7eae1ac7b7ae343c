// test_mtp_fp8.cpp: multi-token prediction (model.mtp_layers) under FP8 training ([quantize]; docs/fp8.md,
// "Multi-token prediction"): the MTP blocks' linears get FP8 sites like a main layer's (eh_proj and the norms stay in
// high precision), the FP8 step with MTP against its twin (every FP8 GEMM replaced by the fp32 GEMM of its
// dequantized operands), the cached FP8 activations, a short run next to the fp32 one, delayed scaling's bitwise
// resume with the MTP sites' histories, and their amax record in metrics.jsonl ("mtp.<module>").
// Not the layouts (tests/mpi/test_mpi_layouts.cpp: pp2_fp8_delayed_mtp) and not MTP without FP8 (test_mtp.cpp).
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
#include "moetron/trainer.h"
#include "fp8_test_util.h"
#include "test_util.h"
#include "train_test_util.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {
JobConfig tiny(const std::string& dump, std::vector<std::string> extra = {}) {
  extra.push_back("--model.mtp_layers=1");
  return moetron::testing::tiny_fp32_job(dump, std::move(extra));
}
std::string fresh_dir(const std::string& name) { return moetron::testing::fresh_test_dir("moetron_test_mtp_fp8_", name); }
TrainOptions quiet() { return moetron::testing::quiet_options(); }

QuantizeSpec recipe(Fp8Recipe r, const std::string& format = "e4m3") {
  QuantizeSpec q;
  q.recipe = r, q.format = format;
  return q;
}

int64_t sites(int64_t mtp_layers, const std::vector<std::string>& modules = {}) {
  const JobConfig c = load_config(moetron::testing::repo_path("configs/ds_tiny.toml"),
                                  {"--model.mtp_layers=" + std::to_string(mtp_layers)});
  Model m(c.model, 2, 16, {}, {}, ComputeDtype::FP32);
  QuantizeSpec q = recipe(Fp8Recipe::Tensorwise);
  if (!modules.empty()) q.modules = modules;
  m.set_quantize(q);
  return m.fp8_sites();
}
}  // namespace

// Each depth adds its block's FP8 linears, as many as a layer of the last layer's kind (ds_tiny: MoE with MHA
// attention: wqkv, wo, the shared experts' ws13, ws2, the routed experts' we13, we2 = 6), and nothing else: eh_proj
// and the depth's norms stay in high precision. A module left out of quantize.modules is left out of the MTP blocks.
TEST(MtpFp8, BlocksGetTheSitesOfALayerAndEhProjStaysHighPrecision) {
  const int64_t s0 = sites(0), s1 = sites(1), s2 = sites(2);
  EXPECT_EQ(s1 - s0, 6) << s0 << " sites without MTP, " << s1 << " with one depth";
  EXPECT_EQ(s2 - s1, 6);
  EXPECT_EQ(sites(1, {"attention"}) - sites(0, {"attention"}), 2);
  EXPECT_EQ(sites(1, {"dense_mlp"}) - sites(0, {"dense_mlp"}), 0);  // the MTP block is MoE, like ds_tiny's last layer
}

// The FP8 step with MTP is bitwise the fp32 computation on the dequantized operands (the MTP blocks' GEMMs too), and
// differs from fp32 (the MTP blocks are quantized: with only the MTP sites changing the loss moves) by < 2^-4.
TEST(MtpFp8, TrainingStepEqualsTheFp32ComputationOnDequantizedOperands) {
  using moetron::testing::fp8_pass;
  const std::vector<std::string> mtp = {"--model.mtp_layers=1"};
  const auto ref = fp8_pass(QuantizeSpec{}, "configs/ds_tiny.toml", {}, false, 1, mtp);
  for (const QuantizeSpec& q : {recipe(Fp8Recipe::Tensorwise), recipe(Fp8Recipe::Blockwise, "hybrid")}) {
    SCOPED_TRACE(to_string(q.recipe));
    const auto f = fp8_pass(q, "configs/ds_tiny.toml", {}, false, 1, mtp);
    const auto t = fp8_pass(q, "configs/ds_tiny.toml", {}, true, 1, mtp);
    EXPECT_EQ(std::memcmp(&f.loss, &t.loss, sizeof(double)), 0);
    ASSERT_EQ(f.grads.size(), t.grads.size());
    EXPECT_EQ(std::memcmp(f.grads.data(), t.grads.data(), f.grads.size() * 4), 0);
    EXPECT_NE(f.loss, ref.loss);
    EXPECT_LE(std::fabs(f.loss - ref.loss), 0.0625 * ref.loss);
  }
}

// cache_fp8_activations covers the MTP blocks like the layers: tensorwise is bitwise the uncached step (two passes,
// the second reading what the first cached), with and without full recompute.
TEST(MtpFp8, CachedActivationsAreBitwiseTheUncachedStep) {
  using moetron::testing::fp8_pass;
  const std::vector<std::string> mtp = {"--model.mtp_layers=1"};
  QuantizeSpec q = recipe(Fp8Recipe::Tensorwise);
  ActivationCheckpointSpec full;
  full.mode = AcMode::Full;
  for (const ActivationCheckpointSpec& ac : {ActivationCheckpointSpec{}, full}) {
    q.cache_fp8_activations = false;
    const auto plain = fp8_pass(q, "configs/ds_tiny.toml", ac, false, 2, mtp);
    q.cache_fp8_activations = true;
    const auto cached = fp8_pass(q, "configs/ds_tiny.toml", ac, false, 2, mtp);
    EXPECT_EQ(std::memcmp(&plain.loss, &cached.loss, sizeof(double)), 0);
    ASSERT_EQ(plain.grads.size(), cached.grads.size());
    EXPECT_EQ(std::memcmp(plain.grads.data(), cached.grads.data(), plain.grads.size() * 4), 0);
  }
}

// A short run stays near the fp32 run of the same seed and data, the main loss and the MTP loss. Bound as
// Fp8Train.ShortRunsStayCloseToFp32: E4M3 rounds each operand by at most 2^-4 relative, and a few steps' loss must
// stay well inside one such unit: |loss_fp8 - loss_fp32| <= 2^-4 / 4 * loss_fp32 at every step, each finite.
TEST(MtpFp8, ShortRunsStayCloseToFp32) {
  const std::vector<std::string> base = {"--training.steps=4", "--optimizer.lr=3e-3"};
  const auto ref = train(tiny(fresh_dir("ref"), base), quiet());
  for (const char* r : {"tensorwise", "blockwise"}) {
    std::vector<std::string> a = base;
    a.push_back(std::string("--quantize.recipe=") + r), a.push_back("--quantize.format=hybrid");
    const auto f = train(tiny(fresh_dir(r), a), quiet());
    ASSERT_EQ(f.history.size(), ref.history.size());
    for (size_t i = 0; i < ref.history.size(); ++i) {
      const StepRecord &x = f.history[i], &y = ref.history[i];
      EXPECT_TRUE(std::isfinite(x.loss) && std::isfinite(x.mtp_loss)) << r << " step " << i + 1;
      EXPECT_GT(x.mtp_loss, 0.0);
      EXPECT_LE(std::fabs(x.loss - y.loss), 0.0625 / 4 * y.loss) << r << " step " << i + 1;
      EXPECT_LE(std::fabs(x.mtp_loss - y.mtp_loss), 0.0625 / 4 * y.mtp_loss) << r << " step " << i + 1;
      std::printf("[mtp_fp8 %s] step %zu loss %.6f (fp32 %.6f, %+.3e rel) mtp_loss %.6f (fp32 %.6f, %+.3e rel)\n", r,
                  i + 1, x.loss, y.loss, (x.loss - y.loss) / y.loss, x.mtp_loss, y.mtp_loss,
                  (x.mtp_loss - y.mtp_loss) / y.mtp_loss);
    }
    EXPECT_NE(f.history.back().mtp_loss, ref.history.back().mtp_loss) << r;
  }
}

// Delayed scaling: the MTP sites' amax histories travel in the checkpoint with the others; 2 steps + resume + 2
// steps equals 4 straight (losses, MTP losses, parameter hashes). Control: current scaling differs at step 4.
TEST(MtpFp8, DelayedScalingResumesBitwise) {
  const auto [full, resumed] = moetron::testing::train_delayed_and_resume(
      [](const std::string& d, const std::vector<std::string>& q) { return tiny(d, q); }, fresh_dir("delayed_full"),
      fresh_dir("delayed_split"));
  ASSERT_EQ(resumed.start_step, 2);
  ASSERT_EQ(resumed.history.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const StepRecord &a = resumed.history[i], &b = full.history[2 + i];
    EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof(double)), 0) << "step " << 3 + i;
    EXPECT_EQ(std::memcmp(&a.mtp_loss, &b.mtp_loss, sizeof(double)), 0) << "step " << 3 + i;
    EXPECT_EQ(a.param_hash, b.param_hash) << "step " << 3 + i;
  }
  const auto cur = train(tiny(fresh_dir("delayed_vs_current"), {"--quantize.recipe=tensorwise", "--training.steps=4"}),
                         quiet());
  EXPECT_NE(cur.history[3].mtp_loss, full.history[3].mtp_loss);
}

// metrics.jsonl: the MTP blocks' operands apart from the main layers', as "mtp.<module>" (ds_tiny's MTP block is
// MoE: attention, shared and routed experts; no dense MLP); with tensorwise current scaling the largest scale of an
// operand is exactly the scale of its largest amax.
TEST(MtpFp8, MetricsRecordTheMtpBlocksAmaxApart) {
  const std::string d = fresh_dir("metrics");
  train(tiny(d, {"--training.steps=2", "--quantize.recipe=tensorwise", "--quantize.format=hybrid"}), quiet());
  EXPECT_EQ(moetron::testing::expect_fp8_module_metrics(d, {"attention", "dense_mlp", "mtp.attention", "mtp.shared_experts", "mtp.routed_experts"}, {"mtp.dense_mlp"}), 2);
}
