// test_mtp.cpp: DeepSeek-V3 multi-token prediction (model.mtp_layers; src/model/model_mtp.cpp) in one process: the
// keys' refusals and note, the parameter names checkpoints keep, the main loss untouched by the MTP depths, each
// depth's positions, recompute bitwise no recompute, and the combinations refused by name (the EP overlap with tied
// embeddings, a sequence too short, the HF export). FP8: test_mtp_fp8.cpp. Not the numerics against PyTorch
// (test_reference.cpp, variant "mtp") and not the parallel layouts (tests/mpi/test_mpi_layouts.cpp: dp2_mtp, pp2_mtp,
// pp2_zbv_mtp, ep2_np2_mtp_fsdp, pp2_fp8_delayed_mtp, MpiLayoutOverlap.EpOverlapWithMtpIsBitwiseThePlainRun).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/config_notes.h"
#include "moetron/model.h"
#include "moetron/param_layout.h"
#include "moetron/rng.h"
#include "moetron/spec.h"
#include "test_util.h"

using namespace moetron;
using moetron::testing::error_of;

namespace {

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }
constexpr int64_t kB = 2, kT = 16;

JobConfig tiny(std::vector<std::string> ov = {}) { return load_config(repo("configs/ds_tiny.toml"), ov); }

void batch(int64_t V, std::vector<int32_t>& in, std::vector<int32_t>& tg) {
  in.resize(size_t(kB * kT)), tg.resize(size_t(kB * kT));
  const uint64_t key = rng_key(3, "mtp.test");
  for (int64_t i = 0; i < kB * kT; ++i) in[size_t(i)] = int32_t(philox4x32(key, uint64_t(i))[0] % uint64_t(V));
  for (int64_t i = 0; i < kB * kT; ++i)  // next-token targets, as the loader makes them
    tg[size_t(i)] = (i + 1) % kT != 0 ? in[size_t(i + 1)] : int32_t(philox4x32(key, uint64_t(i))[1] % uint64_t(V));
}

std::vector<float> grads(const JobConfig& cfg, ForwardStats* out = nullptr) {
  std::vector<int32_t> in, tg;
  batch(cfg.model.vocab_size, in, tg);
  Model m(cfg.model, kB, kT, cfg.activation_checkpoint, ModelParallel{}, ComputeDtype::FP32);
  m.init_params(5);
  m.zero_grads();
  ForwardStats st = m.forward_backward(in.data(), tg.data(), 1.0f / float(kB * kT), 1.0f);
  if (out) *out = st;
  return std::vector<float>(m.grad_data(), m.grad_data() + m.num_params());
}

}  // namespace

TEST(Mtp, BadValuesAreRefusedByName) {
  EXPECT_NE(error_of([] { tiny({"--model.mtp_layers=-1"}); }).find("model.mtp_layers = -1"), std::string::npos);
  EXPECT_NE(error_of([] { tiny({"--model.mtp_loss_weight=-0.5"}); }).find("model.mtp_loss_weight = -0.5"),
            std::string::npos);
  // Recompute ids: the MTP blocks follow the layers (ds_tiny: 3 layers, so 3 and 4 with two depths).
  EXPECT_NO_THROW(tiny({"--model.mtp_layers=2", "--activation_checkpoint.mode=full",
                        "--activation_checkpoint.layer_ids=[4]"}));
  EXPECT_NE(error_of([] {
              tiny({"--model.mtp_layers=2", "--activation_checkpoint.mode=full", "--activation_checkpoint.layer_ids=[5]"});
            }).find("activation_checkpoint.layer_ids"),
            std::string::npos);
  // The weight without depths does nothing: the run says so.
  const JobConfig c = tiny({"--model.mtp_loss_weight=0.1"});
  bool noted = false;
  for (const auto& n : inert_settings(c, RunShape{})) noted |= n.key == "model.mtp_loss_weight";
  EXPECT_TRUE(noted) << "model.mtp_loss_weight without model.mtp_layers is not noted";
}

TEST(Mtp, ParametersAreNamedPerDepth) {
  const JobConfig c = tiny({"--model.mtp_layers=2"});
  Model m(c.model, kB, kT, {}, {}, ComputeDtype::FP32);
  const int64_t d = c.model.d_model;
  for (int k : {0, 1}) {
    const std::string q = "mtp." + std::to_string(k) + ".";
    EXPECT_EQ(m.param(q + "enorm").shape, Shape({d}));
    EXPECT_EQ(m.param(q + "hnorm").shape, Shape({d}));
    EXPECT_EQ(m.param(q + "eh_proj").shape, Shape({2 * d, d}));
    EXPECT_EQ(m.param(q + "norm").shape, Shape({d}));
    EXPECT_EQ(m.param(q + "block.moe.gate").layer, c.model.n_layers + k);  // ds_tiny's last layer is MoE
    EXPECT_EQ(m.param(q + "block.attn_norm").layer, c.model.n_layers + k);
  }
  EXPECT_EQ(m.n_moe_layers_total(), int(c.model.n_moe_layers()) + 2);
}

// The main cross-entropy is the main model's alone (bitwise the run without MTP: every parameter is initialised from
// its name); each depth k (1-based) has B (T - k) positions and a positive loss.
TEST(Mtp, MainLossUnchangedAndDepthPositions) {
  ForwardStats plain, mtp;
  grads(tiny(), &plain);
  grads(tiny({"--model.mtp_layers=2"}), &mtp);
  EXPECT_EQ(plain.ce_sum, mtp.ce_sum);
  EXPECT_EQ(plain.ce_count, mtp.ce_count);
  ASSERT_EQ(mtp.mtp_ce.size(), 2u);
  for (int64_t k = 0; k < 2; ++k) {
    EXPECT_EQ(mtp.mtp_n[size_t(k)], kB * (kT - k - 1)) << "depth " << k + 1;
    EXPECT_GT(mtp.mtp_ce[size_t(k)], 0.0);
  }
  EXPECT_TRUE(plain.mtp_ce.empty());
}

// Full and selective recompute re-run the MTP block like any layer: the gradients are bitwise those without.
TEST(Mtp, RecomputeIsBitwise) {
  const std::vector<float> none = grads(tiny({"--model.mtp_layers=2"}));
  EXPECT_TRUE(none == grads(tiny({"--model.mtp_layers=2", "--activation_checkpoint.mode=full"})));
  EXPECT_TRUE(none == grads(tiny({"--model.mtp_layers=2", "--activation_checkpoint.mode=full",
                                  "--activation_checkpoint.layer_ids=[3, 4]"})));  // the MTP blocks only
  EXPECT_TRUE(none == grads(tiny({"--model.mtp_layers=2", "--activation_checkpoint.mode=selective",
                                  "--activation_checkpoint.modules=[\"norm\", \"attention_core\", \"moe_act\"]"})));
}

// Tensor and context parallelism are implemented (no longer refused): the MPI layout sweep holds tp2_mtp, cp2_mtp and
// tp2_cp2_mtp to one process (tests/mpi/test_mpi_layouts.cpp). Under TP a depth's own tensors (enorm, hnorm, eh_proj,
// norm) are whole on every rank and see its sequence-parallel rows, so their gradients are partial sums (summed over
// TP once per step); its block is sliced like a main layer.
TEST(Mtp, DepthTensorsUnderTensorParallelism) {
  const ModelSpec s = tiny({"--model.mtp_layers=2"}).model;
  ParamSelection sel;
  sel.tp = 2, sel.tp_rank = 1;
  int own = 0, sliced = 0;
  for (const ParamEntry& e : model_param_layout(s, sel)) {
    if (e.name.rfind("mtp.", 0) != 0) continue;
    const bool depth_own = e.name.find(".block.") == std::string::npos;
    if (depth_own) {
      ++own;
      EXPECT_TRUE(e.tp_partial && !e.tp_sliced()) << e.name;
      EXPECT_EQ(e.numel, e.tp_whole_numel) << e.name;
    }
    sliced += e.tp_sliced();
    if (e.name.find(".block.attn.wqkv") != std::string::npos || e.name.find(".block.attn.wo") != std::string::npos)
      EXPECT_TRUE(e.tp_sliced()) << e.name;
  }
  EXPECT_EQ(own, 2 * 4);
  EXPECT_GT(sliced, 0);
}

TEST(Mtp, UnimplementedCombinationsAreRefusedByName) {
  const JobConfig c = tiny({"--model.mtp_layers=1"});
  // (TP and CP: implemented, see Mtp.DepthTensorsUnderTensorParallelism and the MPI layout sweep.)
  {  // FP8 training is implemented (test_mtp_fp8.cpp)
    Model m(c.model, kB, kT, {}, {}, ComputeDtype::FP32);
    QuantizeSpec q;
    q.recipe = Fp8Recipe::Tensorwise;
    q.modules = {"attention"};
    EXPECT_NO_THROW(m.set_quantize(q));
  }
  // The EP overlap with tied embeddings: the lanes would add into the tied weight's gradient at once (untied: the
  // MPI layout sweep, MpiLayoutOverlap.EpOverlapWithMtpIsBitwiseThePlainRun).
  ModelParallel ov;
  ov.ep_overlap = true;
  const JobConfig tied = tiny({"--model.mtp_layers=1", "--model.tie_embeddings=true"});
  EXPECT_NE(error_of([&] { Model m(tied.model, kB, kT, {}, ov, ComputeDtype::FP32); })
                .find("parallelism.ep_overlap = true and model.tie_embeddings = true"),
            std::string::npos);
  const JobConfig deep = tiny({"--model.mtp_layers=16"});
  EXPECT_NE(error_of([&] { Model m(deep.model, kB, kT, {}, {}, ComputeDtype::FP32); }).find("training.seq_len = 16"),
            std::string::npos);
  // The HF export: no type but deepseek_v3 has MTP, and its MTP weights are not written yet.
  EXPECT_NE(error_of([&] { to_hf_config_json(c.model); }).find("model.mtp_layers = 1 cannot be written"),
            std::string::npos);
}
