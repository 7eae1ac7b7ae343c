// test_host_spans.cpp: the host-bound spans of the step-time projection (plan/cost.h): the host's kernel issue is
// exposed only where it exceeds the GPU's work between two device-host synchronizations (one per MoE layer's
// forward; none under the sync_free dispatcher, none in the backward), and Hardware::host_launch reads and writes
// as `host_launch_us`. Not the fit of the catalog's figure (docs/planner.md, "Published MoE runs").
#include <gtest/gtest.h>

#include <string>

#include "moetron/check.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "plan_test_util.h"

using namespace moetron;
using plantest::cfg;

namespace {
plan::TimePlan time_with(const JobConfig& c, double host_launch_s) {
  plan::Hardware h = plantest::round_gpu();
  h.host_launch = host_launch_s;
  return plan::plan_time(c, plan::layout_from_config(c, 1), h, {});
}
double exposed(const plan::TimePlan& t) {
  const auto it = t.breakdown.find("host.exposed");
  return it == t.breakdown.end() ? -1.0 : it->second;
}
}  // namespace

TEST(PlanHostSpans, AHostFasterThanTheGpuIsHidden) {
  // ds_mini on one GPU (no DP, no EP: the step is the micro-batches' F + I + W): 1 ns a kernel is far below any
  // span's GPU time, so nothing is exposed and the step is the one without a host term.
  const JobConfig c = cfg("ds_mini");
  const plan::TimePlan t0 = time_with(c, 0), t1 = time_with(c, 1e-9);
  EXPECT_EQ(exposed(t0), 0.0);
  EXPECT_EQ(exposed(t1), 0.0);
  EXPECT_DOUBLE_EQ(t1.step_time, t0.step_time);
}

TEST(PlanHostSpans, AHostBoundStepGrowsByTheExposedHostTime) {
  // 1 ms a kernel: every span is host-bound. With one GPU the step grows by exactly the exposed host time, and
  // the exposure is at least the router's 31 kernels a MoE layer and pass beyond all of the GPU's work.
  const JobConfig c = cfg("ds_mini");
  const plan::TimePlan t0 = time_with(c, 0), t1 = time_with(c, 1e-3);
  const double e = exposed(t1);
  ASSERT_GT(e, 0.0);
  EXPECT_NEAR(t1.step_time - t0.step_time, e, 1e-9 * t1.step_time);
  double moe_layers = 0;
  for (int64_t l = 0; l < c.model.n_layers; ++l) moe_layers += c.model.is_moe_layer(l) ? 1 : 0;
  const double m = double(t1.layout.microbatches);
  EXPECT_GT(e, m * moe_layers * 2 * 31 * 1e-3 - t0.step_time);
}

TEST(PlanHostSpans, EachMoeSynchronizationEndsASpanButSyncFreeRunsAhead) {
  // With a synchronization per MoE layer the host's excess is summed span by span; sync_free makes the forward one
  // span, whose excess can only be smaller (a sum of positive parts >= the positive part of the sum). Strictly
  // smaller where the first span (the dense layer with the first MoE layer) is GPU-bound while the MoE-only spans
  // are host-bound: some host cost in the sweep below does that.
  const JobConfig sync = cfg("ds_mini", {"--parallelism.ep_dispatcher=alltoall"});
  const JobConfig free = cfg("ds_mini", {"--parallelism.ep_dispatcher=sync_free"});
  bool strictly = false;
  for (double us = 1; us <= 400; us *= 1.25) {
    const double a = exposed(time_with(sync, us * 1e-6)), b = exposed(time_with(free, us * 1e-6));
    EXPECT_GE(a, b - 1e-12) << us << " us";
    strictly = strictly || a > b * 1.01 + 1e-9;
  }
  EXPECT_TRUE(strictly);
}

TEST(PlanHostSpans, HostLaunchReadsWritesAndRefusesNegative) {
  plan::Hardware h = plantest::round_gpu();
  h.peak_bf16 = h.achievable_bf16 = 1000e12;
  h.host_launch = 45e-6;
  const plan::Hardware back = plan::hardware_from_toml(plan::hardware_to_toml(h));
  EXPECT_NEAR(back.host_launch, 45e-6, 1e-12);
  std::string toml = plan::hardware_to_toml(h);
  const auto at = toml.find("host_launch_us = ");
  ASSERT_NE(at, std::string::npos);
  toml.insert(at + 17, "-");
  try {
    plan::validate_hardware(plan::hardware_from_toml(toml), "test");
    FAIL() << "a negative host_launch_us was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("host_launch_us"), std::string::npos) << e.what();
  }
  // The catalog's entries carry the fitted figure with its source line.
  const plan::Hardware h100 = plan::catalog_hardware("h100");
  EXPECT_GT(h100.host_launch, 0.0);
  EXPECT_NE(h100.sources.at("host_launch_us").find("FITTED"), std::string::npos);
}
