// test_comm_sm_share.cpp: the SMs an overlapped EP exchange takes from the compute beside it (plan/cost.h,
// StageTime::comm_sm; issue 33's fifth state): DeepSeek-V3's 20 of 132 SMs, charged only under ep_overlap, as
// min(s A, s C / (1 - s)) per stage (A: the stage's exchanges, C: its GPU compute). Not the schedule replay.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/pipeline.h"
#include "plan_test_util.h"

using namespace moetron;
using plantest::cfg;

namespace {
const std::vector<std::string> kLayout = {"--parallelism.pp_schedule=interleaved_1f1b",
                                          "--parallelism.pp_virtual_stages=2", "--parallelism.pp=24",
                                          "--parallelism.ep=16", "--parallelism.cp=2",
                                          "--training.global_batch_size=768"};
std::vector<plan::StageTime> stages(bool overlap, const plan::Hardware& h) {
  std::vector<std::string> ov = kLayout;
  ov.push_back(std::string("--parallelism.ep_overlap=") + (overlap ? "true" : "false"));
  const JobConfig c = cfg("moe_1t", ov);
  const plan::Layout l = plan::layout_from_config(c, 768);
  return plan::stage_times(c, l, h, {}, *plan::stage_plan(c, l));
}
}  // namespace

TEST(PlanCommSmShare, OverlappedExchangeSlowsTheComputeBesideIt) {
  const double s = 20.0 / 132.0;
  for (const double out_bw : {10e9, 1e9}) {  // compute-bound and exchange-bound stages
    plan::Hardware h = plantest::round_gpu();
    h.scale_out.bw = out_bw;
    const auto off = stages(false, h), on = stages(true, h);
    ASSERT_EQ(off.size(), on.size());
    int charged = 0;
    for (size_t k = 0; k < on.size(); ++k) {
      const plan::StageTime &a = off[k], &b = on[k];
      EXPECT_EQ(a.comm_sm, 0.0);  // without the overlap nothing runs beside the compute
      const double A = a.a2a_f + a.a2a_b, C = a.f + a.i + a.w - a.host_f - a.host_b;
      double want = A > 0 ? std::min(s * A, s * C / (1 - s)) : 0.0;
      if (k + 1 == on.size()) {  // the last stage: the head and the loss (after the layers, beside no exchange)
        EXPECT_GT(b.comm_sm, 0.0);
        EXPECT_LE(b.comm_sm, want);
        want = b.comm_sm;
      }
      EXPECT_NEAR(b.comm_sm, want, 1e-12 * (C + A)) << "stage " << k;
      EXPECT_NEAR(b.f + b.i + b.w, a.f + a.i + a.w + want, 1e-9 * (C + A)) << "stage " << k;
      EXPECT_DOUBLE_EQ(b.a2a_f, a.a2a_f);
      charged += want > 0 ? 1 : 0;
    }
    EXPECT_GT(charged, 0) << out_bw;
  }
}

TEST(PlanCommSmShare, StepShowsTheShareAsCompute) {
  // The step's breakdown names it (compute.comm_sm_share) under ep_overlap, and has no such key without it.
  const plan::Hardware h = plantest::round_gpu();
  for (const bool overlap : {true, false}) {
    std::vector<std::string> ov = kLayout;
    ov.push_back(std::string("--parallelism.ep_overlap=") + (overlap ? "true" : "false"));
    const JobConfig c = cfg("moe_1t", ov);
    const plan::TimePlan t = plan::plan_time(c, plan::layout_from_config(c, 768), h, {});
    EXPECT_EQ(t.breakdown.count("compute.comm_sm_share"), overlap ? 1u : 0u);
    if (overlap) EXPECT_GT(t.breakdown.at("compute.comm_sm_share"), 0.0);
  }
}
