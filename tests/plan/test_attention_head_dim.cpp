// test_attention_head_dim.cpp: the fused attention's rate by head dimension (src/plan/cost_terms.h, issue 33's
// sixth state): on a catalog-style GPU (one attention_efficiency figure) a head dimension of 64 runs at 0.791 of
// the rate of 128 (FlashAttention-3 paper, cuDNN series, forward + backward); from 128 up, and on a GPU with a
// measured attention_seq_efficiency curve, the head dimension does not enter. Not the attention's FLOP count.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/pipeline.h"
#include "plan_test_util.h"

using namespace moetron;

namespace {
// Seconds of the core attention (forward, backward) of GPT-OSS-120B cut to 2 layers on one GPU, with n_heads heads
// of head_dim (n_heads x head_dim = 4096 in every call below: the same attention FLOPs) unless a test says otherwise.
std::pair<double, double> attn_seconds(const plan::Hardware& h, int n_heads, int head_dim) {
  const JobConfig c = plantest::cfg("gpt_oss_120b", {"--model.n_layers=2", "--model.n_heads=" + std::to_string(n_heads),
                                                     "--model.head_dim=" + std::to_string(head_dim),
                                                     "--training.global_batch_size=1"});
  const plan::Layout l = plan::layout_from_config(c, 1);
  const auto st = plan::stage_times(c, l, h, {}, *plan::stage_plan(c, l));
  double f = 0, b = 0;
  for (const auto& s : st) f += s.op_f[plan::kOpAttnCore], b += s.op_b[plan::kOpAttnCore];
  return {f, b};
}
}  // namespace

TEST(PlanAttentionHeadDim, HeadDim64RunsAtTheFa3PapersCudnnRatio) {
  plan::Hardware h = plantest::round_gpu();
  h.attention_efficiency = 0.6;
  const auto [f64, b64] = attn_seconds(h, 64, 64);
  const auto [f128, b128] = attn_seconds(h, 32, 128);
  ASSERT_GT(f128, 0.0);
  // the same FLOPs at 0.791 of the rate; the backward prices twice the forward in both
  EXPECT_NEAR(f64 / f128, 1 / 0.791, 1e-9);
  EXPECT_NEAR(b64 / b128, 1 / 0.791, 1e-9);
  // halfway between 64 and 128: linear in the head dimension (40 heads of 96 = 3840 of width; FLOPs scale with it)
  const auto [f96, b96] = attn_seconds(h, 40, 96);
  EXPECT_NEAR(f96 / f128, (3840.0 / 4096.0) / (0.791 + (1 - 0.791) * 0.5), 1e-9);
  // 256 (16 heads): no change from 128
  const auto [f256, b256] = attn_seconds(h, 16, 256);
  EXPECT_NEAR(f256 / f128, 1.0, 1e-9);
}

TEST(PlanAttentionHeadDim, MeasuredCurveIsTakenAsItIs) {
  // A calibrated file's attention_seq_efficiency was measured at the engine's own head dimension: no factor.
  plan::Hardware h = plantest::round_gpu();
  h.attention_seq_efficiency = {{128, 0.3}, {8192, 0.3}};
  const auto [f64, b64] = attn_seconds(h, 64, 64);
  const auto [f128, b128] = attn_seconds(h, 32, 128);
  EXPECT_NEAR(f64 / f128, 1.0, 1e-9);
  EXPECT_NEAR(b64 / b128, 1.0, 1e-9);
}
