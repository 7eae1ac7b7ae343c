// test_fp8_passes.cpp: what the step-time projection charges for FP8 (plan/cost.h; issue 33's fifth state): the
// quantization bytes of current scaling (an amax read before the cast, Hopper's transposed copy) against delayed
// scaling and MXFP8, the amax kernel the host issues per quantized input, and the GEMMs FP8 does not reach (the
// router and the output head stay BF16). Not the published rows' errors (docs/planner.md, "Published MoE runs").
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "plan_test_util.h"

using namespace moetron;
using plantest::cfg;

namespace {
plan::TimePlan time_of(const std::vector<std::string>& ov, double host_launch_s = 0) {
  const JobConfig c = cfg("ds_mini", ov);
  plan::Hardware h = plantest::round_gpu();  // no kernel floor: every pass is its bytes over the bandwidth
  h.host_launch = host_launch_s;
  return plan::plan_time(c, plan::layout_from_config(c, 1), h, {});
}
double part(const plan::TimePlan& t, const std::string& k) {
  const auto it = t.breakdown.find(k);
  return it == t.breakdown.end() ? -1.0 : it->second;
}
}  // namespace

TEST(PlanFp8Passes, CurrentScalingReadsTwiceAndWritesTheTranspose) {
  // Per quantized element: MXFP8 4 bytes (read 2, write 1, transposed copy 1); tensorwise with current scaling 6
  // (the amax read, 2 more); tensorwise with delayed scaling 4 (one read). Same GEMMs, no floor: exact ratios.
  const double mx = part(time_of({"--quantize.recipe=mxfp8"}), "compute.fp8_quantize");
  const double cur = part(time_of({"--quantize.recipe=tensorwise"}), "compute.fp8_quantize");
  const double del =
      part(time_of({"--quantize.recipe=tensorwise", "--quantize.scaling=delayed"}), "compute.fp8_quantize");
  ASSERT_GT(mx, 0.0);
  EXPECT_NEAR(cur / mx, 6.0 / 4.0, 1e-12);
  EXPECT_NEAR(del / mx, 1.0, 1e-12);
}

TEST(PlanFp8Passes, RouterAndHeadStayBf16UnderFp8) {
  // Megatron-Core's router is a plain matmul and its output layer no Transformer Engine module: under an FP8 recipe
  // both cost exactly what they cost in BF16, while the experts' GEMMs get faster.
  const plan::TimePlan bf = time_of({}), f8 = time_of({"--quantize.recipe=mxfp8"});
  EXPECT_DOUBLE_EQ(f8.ops_f[plan::kOpRouter], bf.ops_f[plan::kOpRouter]);
  EXPECT_DOUBLE_EQ(f8.ops_b[plan::kOpRouter], bf.ops_b[plan::kOpRouter]);
  EXPECT_DOUBLE_EQ(f8.ops_f[plan::kOpLoss], bf.ops_f[plan::kOpLoss]);
  EXPECT_DOUBLE_EQ(f8.ops_b[plan::kOpLoss], bf.ops_b[plan::kOpLoss]);
  EXPECT_NE(f8.ops_f[plan::kOpExperts], bf.ops_f[plan::kOpExperts]);
}

TEST(PlanFp8Passes, CurrentScalingIssuesAnAmaxKernelPerQuantizedInput) {
  // 1 ms a kernel: every span is host-bound. Current scaling issues one more kernel (the amax) per quantized input:
  // two per FP8 GEMM in the forward, one in the backward; so over the step at least 3 ms per FP8 GEMM and
  // micro-batch more host time than delayed scaling, whose GPU passes are cheaper still.
  const plan::TimePlan cur = time_of({"--quantize.recipe=tensorwise"}, 1e-3);
  const plan::TimePlan del = time_of({"--quantize.recipe=tensorwise", "--quantize.scaling=delayed"}, 1e-3);
  const double m = double(cur.layout.microbatches);
  EXPECT_GT(part(cur, "host.exposed") - part(del, "host.exposed"), m * 3e-3);
  EXPECT_GT(cur.step_time, del.step_time);
}
