// test_cost.cpp: the step-time projection (plan/cost.h): identities (MFU, the breakdown's sum), hand-counted
// communication terms, what each layout feature must move (TP/EP collectives, the all-to-all overlap, FP8,
// recompute), the analytic estimate against the simulator, and the seeds' bubble ratios.
#include <gtest/gtest.h>

#include <cmath>

#include "moetron/accounting.h"
#include "moetron/plan/comm_model.h"
#include "moetron/plan/cost.h"
#include "plan_test_util.h"

using namespace moetron;
using plantest::cfg;

namespace {
plan::TimePlan timeof(const JobConfig& c, int64_t world, const plan::Hardware& h, bool simulate = true) {
  plan::TimeOptions o;
  o.simulate = simulate;
  return plan::plan_time(c, plan::layout_from_config(c, world), h, o);
}
}  // namespace

TEST(PlanCost, MfuAndBreakdownIdentities) {
  const auto c = cfg("deepseek_v3", {"--parallelism.pp=4", "--parallelism.ep=8", "--training.global_batch_size=64"});
  const auto h = plan::catalog_hardware("h100");
  const auto t = timeof(c, 64, h);
  const double fl = flops_per_token(c.model, c.training.seq_len).train;
  EXPECT_NEAR(t.mfu, fl * t.tokens_per_s_per_gpu / h.peak_bf16, 1e-12);
  EXPECT_NEAR(t.tokens_per_s_per_gpu, 64.0 * 4096 / t.step_time / 64, 1e-6);
  double sum = 0;
  for (const auto& [k, v] : t.breakdown) {
    EXPECT_GE(v, 0) << k;
    sum += v;
  }
  EXPECT_NEAR(sum, t.step_time, 1e-9 * t.step_time + 1e-12);
  EXPECT_GT(t.mfu, 0.05);
  EXPECT_LT(t.mfu, 0.9);
}

TEST(PlanCost, TensorParallelCollectivesAreTheCommModels) {
  // One dense layer pair with tp 2 + SP: per layer and pass two all-gathers and two reduce-scatters of T x d bf16.
  const auto h = plantest::round_gpu();
  const auto c1 = cfg("ds_mini", {"--parallelism.tp=2", "--model.n_routed_experts=0", "--model.n_shared_experts=0",
                                    "--model.moe_inter_size=0", "--model.topk=0", "--model.first_k_dense=0"});
  const auto t = timeof(c1, 2, h);
  const double T = double(c1.training.micro_batch_size * c1.training.seq_len), d = double(c1.model.d_model);
  const plan::Group g{2, 2};
  const double per_layer = 2 * (plan::all_gather(h, T * d * 2, g) + plan::reduce_scatter(h, T * d * 2, g));
  const double expect = 2 * per_layer * double(c1.model.n_layers) * double(t.layout.microbatches);
  EXPECT_NEAR(t.breakdown.at("comm.tp"), expect, 1e-9 * expect);
}

TEST(PlanCost, EpOverlapHidesAllToAll) {
  // A slow scale-out makes EP expensive; the 1F1B all-to-all overlap must hide part of it.
  auto h = plan::catalog_hardware("h100");
  h.scale_out.bw /= 8;
  auto c = cfg("deepseek_v3", {"--parallelism.pp_schedule=interleaved_1f1b", "--parallelism.pp_virtual_stages=2",
                               "--parallelism.pp=4", "--parallelism.ep=64", "--training.global_batch_size=2048"});
  const auto base = timeof(c, 256, h);
  c.parallelism.ep_overlap = true;
  const auto ov = timeof(c, 256, h);
  EXPECT_GT(base.breakdown.at("comm.ep"), 0.05 * base.step_time);
  EXPECT_LT(ov.step_time, base.step_time * 0.97) << base.step_time << " vs " << ov.step_time;
}

TEST(PlanCost, Fp8SpeedsGemmsAndPaysQuantization) {
  const auto h = plan::catalog_hardware("h100");
  auto c = cfg("deepseek_v3", {"--parallelism.pp=4", "--parallelism.ep=8", "--training.global_batch_size=64"});
  const auto bf = timeof(c, 64, h);
  c.quantize.recipe = Fp8Recipe::Blockwise;
  const auto f8 = timeof(c, 64, h);
  EXPECT_LT(f8.breakdown.at("compute.gemm"), 0.8 * bf.breakdown.at("compute.gemm"));
  EXPECT_GT(f8.breakdown.at("compute.fp8_quantize"), 0);
  EXPECT_EQ(bf.breakdown.at("compute.fp8_quantize"), 0);
}

TEST(PlanCost, RecomputeCostsTime) {
  const auto h = plan::catalog_hardware("mi300x");
  auto c = cfg("moe_1t", {"--parallelism.pp=24", "--parallelism.ep=8", "--parallelism.cp=2",
                          "--training.global_batch_size=1536"});
  const auto none = timeof(c, 768, h);
  c.activation_checkpoint.mode = AcMode::Full;
  const auto full = timeof(c, 768, h);
  EXPECT_GT(full.step_time, none.step_time * 1.1);
  EXPECT_GT(full.breakdown.at("compute.recompute"), 0);
}

TEST(PlanCost, AnalyticEstimateTracksTheSimulator) {
  const auto h = plan::catalog_hardware("mi300x");
  for (std::string s : {"1f1b", "interleaved_1f1b"}) {
    auto c = cfg("moe_1t", {"--parallelism.pp_schedule=" + s, "--parallelism.pp=24", "--parallelism.ep=8",
                            "--parallelism.cp=2", "--training.global_batch_size=1536"});
    const auto sim = timeof(c, 768, h, true), est = timeof(c, 768, h, false);
    EXPECT_NEAR(est.step_time / sim.step_time, 1.0, 0.15) << s;
  }
}

TEST(PlanCostSeeds, BubbleRatios) {
  // Seeds (AMD MoE best practices, interleaved PP): PP16 with 16 micro-batches: 48.43 % (VPP 1) and 13.51 %
  // (VPP 6). moe_1t's 96 layers split evenly into 16 x 6 stages.
  // ... and free point-to-point messages (the closed formula's assumptions): a network with no latency and a
  // bandwidth no message notices.
  auto h = plan::catalog_hardware("mi300x");
  h.scale_out.bw = h.scale_up.bw = 1e18, h.scale_out.alpha = h.scale_up.alpha = 0;
  h.scale_up.topology = "switch";
  const double seed[2] = {0.4843, 0.1351};
  int i = 0;
  for (int vpp : {1, 6}) {
    // The seeds' figures are for equal stages: a 128-token vocabulary makes the embedding and head negligible.
    auto c = cfg("moe_1t", {vpp == 1 ? "--parallelism.pp_schedule=1f1b" : "--parallelism.pp_schedule=interleaved_1f1b",
                            "--parallelism.pp_virtual_stages=" + std::to_string(vpp), "--parallelism.pp=16",
                            "--parallelism.ep=8", "--training.global_batch_size=128", "--model.vocab_size=128"});
    const auto t = timeof(c, 128, h);  // dp 8: 128 / 8 = 16 micro-batches
    ASSERT_EQ(t.layout.microbatches, 16);
    std::printf("[seed] PP16 GA16 VPP%d bubble %.2f%% (seed %.2f%%)\n", vpp, 100 * t.bubble_ratio, 100 * seed[i]);
    EXPECT_NEAR(t.bubble_ratio, seed[i], 0.01) << vpp;
    ++i;
  }
}

TEST(PlanCost, GroupedGemmCurvePricesTheExperts) {
  // With a grouped-GEMM curve the experts run at achievable x eff(tokens per expert): halving eff doubles their
  // time, and only theirs (attention, dense GEMMs and the rest stay).
  auto c = cfg("ds_mini");
  auto h = plantest::round_gpu();
  h.grouped_gemm_efficiency = {{1.0, 1.0}, {1e6, 1.0}};
  const auto full = timeof(c, 1, h);
  h.grouped_gemm_efficiency = {{1.0, 0.5}, {1e6, 0.5}};
  const auto half = timeof(c, 1, h);
  // Expert FLOPs per step, hand-counted: 3 passes x 2 FLOPs x rows x (2 Im d + Im d), rows = tokens x topk.
  const auto& m = c.model.moe;
  const double tokens = double(c.training.global_batch_size * c.training.seq_len);
  const double flops = 3.0 * 2 * tokens * double(m.topk) * 3.0 * double(m.moe_inter_size) * double(c.model.d_model) *
                       double(c.model.n_moe_layers());
  EXPECT_NEAR(half.breakdown.at("compute.gemm") - full.breakdown.at("compute.gemm"), flops / h.achievable_bf16,
              1e-6 * flops / h.achievable_bf16);
  EXPECT_DOUBLE_EQ(half.breakdown.at("compute.attention"), full.breakdown.at("compute.attention"));
  // The key survives the TOML round trip.
  const auto back = plan::hardware_from_toml(plan::hardware_to_toml(plan::catalog_hardware("h100")) +
                                             "", "h100");
  EXPECT_TRUE(back.grouped_gemm_efficiency.empty());
  auto withc = plan::catalog_hardware("h100");
  withc.grouped_gemm_efficiency = {{4, 0.25}, {64, 0.8}};
  const auto rt = plan::hardware_from_toml(plan::hardware_to_toml(withc), "h100+curve");
  ASSERT_EQ(rt.grouped_gemm_efficiency.size(), 2u);
  EXPECT_DOUBLE_EQ(rt.grouped_eff(16), 0.25 + 0.5 * (0.8 - 0.25));  // log-linear: 16 is half-way from 4 to 64
}
