// test_mtp_time.cpp: the MTP depths in the step-time projection (plan/cost.cpp, model.mtp_layers): they cost the
// last stage alone, and what they add in FLOPs is what the accounting's flops_per_token adds for them. Not the
// engine's MTP (tests/unit/test_mtp.cpp). Also their activations in the memory plan.
#include <gtest/gtest.h>

#include "moetron/accounting.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/memory.h"
#include "moetron/plan/pipeline.h"
#include "plan_test_util.h"

using namespace moetron;
using plantest::cfg;

namespace {
plan::TimePlan time_of(const JobConfig& c, int64_t world) {
  return plan::plan_time(c, plan::layout_from_config(c, world), plantest::round_gpu(), {});
}
}  // namespace

TEST(PlanMtp, DepthsCostTheLastStageTheirAccountedFlops) {
  for (int depths : {1, 2}) {
    const std::vector<std::string> pp2 = {"--parallelism.pp=2", "--parallelism.pp_schedule=1f1b"};
    auto with = [&](int d) {
      std::vector<std::string> o = pp2;
      o.push_back("--model.mtp_layers=" + std::to_string(d));
      return cfg("ds_mini", o);
    };
    const JobConfig c0 = with(0), c1 = with(depths);
    const plan::TimePlan t0 = time_of(c0, 2), t1 = time_of(c1, 2);
    ASSERT_EQ(t1.stages.size(), 2u);
    // The first stage is untouched; the last one grows.
    EXPECT_DOUBLE_EQ(t1.stages[0].f, t0.stages[0].f);
    EXPECT_DOUBLE_EQ(t1.stages[0].flops, t0.stages[0].flops);
    EXPECT_GT(t1.stages[1].f, t0.stages[1].f);
    EXPECT_GT(t1.step_time, t0.step_time);
    // FLOPs per token the depths add: the planner's (hardware FLOPs of one micro-batch's F + B over its tokens)
    // against the accounting's train FLOPs (3 x forward, no recompute here).
    const double T = double(c0.training.micro_batch_size * c0.training.seq_len);
    const double planner = (t1.stages[1].flops - t0.stages[1].flops) / T;
    const double accounting = flops_per_token(c1.model, c1.training.seq_len).train -
                              flops_per_token(c0.model, c0.training.seq_len).train;
    EXPECT_NEAR(planner, accounting, 1e-6 * accounting) << depths << " depths";
  }
}

TEST(PlanMtp, DepthsParametersSitOnTheLastStage) {
  // The planner's parameter elements per pipeline rank (tp = ep = 1): the depths add the accounting's MTP count on
  // the last rank, and under PP the last rank's copy of the embedding.
  for (int pp : {1, 2}) {
    auto with = [&](int d) {
      return cfg("ds_mini", {"--parallelism.pp=" + std::to_string(pp), "--parallelism.pp_schedule=1f1b",
                             "--model.mtp_layers=" + std::to_string(d)});
    };
    const JobConfig c0 = with(0), c1 = with(1);
    const auto h = plantest::round_gpu();
    const plan::MemoryPlan m0 = plan::plan_memory(c0, plan::layout_from_config(c0, pp), h, {});
    const plan::MemoryPlan m1 = plan::plan_memory(c1, plan::layout_from_config(c1, pp), h, {});
    auto elems = [](const plan::RankMemory& r) { return r.params_tp_sharded + r.params_replicated + r.params_experts; };
    const double copy = pp > 1 ? double(c1.model.vocab_size * c1.model.d_model) : 0.0;
    EXPECT_DOUBLE_EQ(elems(m1.per_rank.back()) - elems(m0.per_rank.back()), double(count_params(c1.model).mtp) + copy)
        << "pp " << pp;
    if (pp > 1) EXPECT_DOUBLE_EQ(elems(m1.per_rank.front()), elems(m0.per_rank.front()));
  }
}

// The depths' activations (plan/memory.cpp stage_activations): with the engine recipe they add, on the last pipeline
// rank alone, what they add to the engine's own estimate (estimate_memory, held to the engine's measured peaks by
// MemCheck.MtpDepthsAreInTheEstimateOnDsMini): D blocks of the last layer's kind and each depth's own buffers.
TEST(PlanMtp, DepthsActivationsAreTheEnginesOnTheLastStage) {
  for (const char* dt : {"fp32", "bf16"})
    for (const char* ac : {"none", "full"})
      for (int depths : {1, 2}) {
        SCOPED_TRACE(std::string(dt) + " recompute " + ac + ", " + std::to_string(depths) + " depths");
        auto with = [&](int d, int pp) {
          return cfg("ds_mini", {"--parallelism.pp=" + std::to_string(pp), "--parallelism.pp_schedule=1f1b",
                                 std::string("--training.compute_dtype=") + dt,
                                 std::string("--activation_checkpoint.mode=") + ac,
                                 "--model.mtp_layers=" + std::to_string(d)});
        };
        plan::PlanOptions o;
        o.recipe = plan::recipe_named("engine", with(0, 1));
        const auto h = plantest::round_gpu();
        const int64_t cb = std::string(dt) == "fp32" ? 4 : 2;
        const double engine = estimate_memory(with(depths, 1), cb, 1).activations - estimate_memory(with(0, 1), cb, 1).activations;
        EXPECT_GT(engine, 0);
        for (int pp : {1, 2}) {
          const JobConfig c0 = with(0, pp), c1 = with(depths, pp);
          const plan::MemoryPlan m0 = plan::plan_memory(c0, plan::layout_from_config(c0, pp), h, o);
          const plan::MemoryPlan m1 = plan::plan_memory(c1, plan::layout_from_config(c1, pp), h, o);
          // The last stage of 1F1B keeps one micro-batch in flight, as one process does.
          const double added = m1.per_rank.back().activations - m0.per_rank.back().activations;
          EXPECT_NEAR(added, engine, 1e-9 * engine) << "pp " << pp;
          if (pp > 1) EXPECT_DOUBLE_EQ(m1.per_rank.front().activations, m0.per_rank.front().activations);
        }
      }
}
