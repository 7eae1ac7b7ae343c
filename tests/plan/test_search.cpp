// test_search.cpp: the layout search and strong scaling (plan/search.h): the winners obey every rule and fit,
// the ranking is by simulated throughput, impossible worlds find nothing without failing, and the 2T proxy's
// scaling on MI300X keeps the whitepaper's shape (near 1.0 at small worlds, the lowest efficiency at 64K).
#include <gtest/gtest.h>

#include "moetron/plan/search.h"
#include "plan_test_util.h"

using namespace moetron;
using plantest::cfg;

TEST(PlanSearch, WinnersObeyTheRulesAndFit) {
  const auto c = cfg("deepseek_v3");
  const auto h = plan::catalog_hardware("mi300x");
  plan::SearchOptions o;
  o.top_k = 4;
  const auto r = plan::search(c, h, 1024, 16777216.0, o);
  EXPECT_GT(r.enumerated, 100000);  // the space the issue asks for at this size
  EXPECT_EQ(r.enumerated, r.invalid + r.oom + r.evaluated);
  ASSERT_EQ(r.top.size(), 4u);
  for (size_t i = 0; i < r.top.size(); ++i) {
    const auto& cd = r.top[i];
    EXPECT_EQ(cd.layout.world(), 1024);
    JobConfig cc = c;
    cc.training.global_batch_size = 16777216 / 4096;
    EXPECT_EQ(plan::layout_error(cc, cd.layout, cc.training.global_batch_size), "") << cd.layout.describe();
    EXPECT_EQ(cd.memory.verdict, "FITS") << cd.layout.describe();
    EXPECT_TRUE(cd.time.simulated);
    if (i > 0) {
      EXPECT_GE(r.top[i - 1].time.tokens_per_s_per_gpu, cd.time.tokens_per_s_per_gpu);
    }
  }
  EXPECT_NE(r.why.find(r.top[0].layout.describe()), std::string::npos);
}

TEST(PlanSearch, WorkersDoNotChangeTheAnswer) {
  // The analytic pass on one worker and on three: the same counts and the same top candidates in the same order
  // (the workers' items are joined in order and ranked by a stable sort).
  const auto c = cfg("deepseek_v3");
  const auto h = plan::catalog_hardware("mi300x");
  plan::SearchOptions o;
  o.top_k = 6;
  o.threads = 1;
  const auto one = plan::search(c, h, 256, 4194304.0, o);
  o.threads = 3;
  const auto three = plan::search(c, h, 256, 4194304.0, o);
  EXPECT_EQ(one.enumerated, three.enumerated);
  EXPECT_EQ(one.invalid, three.invalid);
  EXPECT_EQ(one.oom, three.oom);
  EXPECT_EQ(one.evaluated, three.evaluated);
  ASSERT_EQ(one.top.size(), three.top.size());
  ASSERT_FALSE(one.top.empty());
  for (size_t i = 0; i < one.top.size(); ++i) {
    EXPECT_EQ(one.top[i].layout.describe(), three.top[i].layout.describe()) << i;
    EXPECT_EQ(one.top[i].analytic_tokens_per_s_per_gpu, three.top[i].analytic_tokens_per_s_per_gpu) << i;
  }
}

TEST(PlanSearch, MinReplicaKeepsOnlyLargeReplicas) {
  // --min-replica: every ranked layout's replica (tp x cp x pp) has at least that many GPUs and fewer layouts are
  // enumerated.
  const auto c = cfg("deepseek_v3");
  const auto h = plan::catalog_hardware("mi300x");
  plan::SearchOptions o;
  o.top_k = 4;
  const auto any = plan::search(c, h, 256, 4194304.0, o);
  o.min_replica = 32;
  const auto big = plan::search(c, h, 256, 4194304.0, o);
  ASSERT_FALSE(any.top.empty());
  ASSERT_FALSE(big.top.empty());
  EXPECT_LT(big.enumerated, any.enumerated);
  for (const auto& cd : big.top) EXPECT_GE(cd.layout.tp * cd.layout.cp * cd.layout.pp, 32) << cd.layout.describe();
  o.min_replica = 512;  // more than the world: nothing to rank
  EXPECT_TRUE(plan::search(c, h, 256, 4194304.0, o).top.empty());
}

TEST(PlanSearch, SharedStageDurationsPriceAsPlanTimeDoes) {
  // The search prices a stage shape once and hands the durations to plan_time: with the split, the halves set
  // from stage_times_at(0.5) must give exactly plan_time's own figures.
  const auto c = cfg("deepseek_v3");
  const auto h = plan::catalog_hardware("mi300x");
  plan::Layout l;
  l.tp = 1, l.cp = 1, l.pp = 4, l.vpp = 2, l.dp = 64, l.ep = 64, l.zero = 1, l.mbs = 1;
  l.schedule = "interleaved_1f1b", l.ep_overlap = true, l.ep_overlap_split = true;
  l.microbatches = 16;
  JobConfig cc = c;
  cc.training.global_batch_size = l.microbatches * l.mbs * l.dp;
  ASSERT_EQ(plan::layout_error(cc, l, cc.training.global_batch_size), "");
  plan::TimeOptions o;
  o.simulate = false;
  const auto sp = plan::stage_plan(cc, l);
  auto d = plan::stage_times_at(cc, l, h, o, *sp, 1.0);
  plan::set_split_halves(d, plan::stage_times_at(cc, l, h, o, *sp, 0.5));
  const auto own = plan::plan_time(cc, l, h, o, nullptr, sp.get());
  const auto shared = plan::plan_time(cc, l, h, o, nullptr, sp.get(), &d);
  EXPECT_GT(own.step_time, 0);
  EXPECT_EQ(own.step_time, shared.step_time);
  EXPECT_EQ(own.stages.size(), shared.stages.size());
  for (size_t k = 0; k < own.stages.size(); ++k) EXPECT_EQ(own.stages[k].a2a_f2, shared.stages[k].a2a_f2) << k;
  d.pop_back();  // durations for another layout's stages: refused by name
  EXPECT_THROW(plan::plan_time(cc, l, h, o, nullptr, sp.get(), &d), Error);
}

TEST(PlanSearch, NothingFitsIsAnAnswerNotAFailure) {
  // DeepSeek-V3 on 8 H100s cannot hold its 671B parameters.
  const auto r = plan::search(cfg("deepseek_v3"), plan::catalog_hardware("h100"), 8, 8 * 4096.0);
  EXPECT_TRUE(r.top.empty());
  EXPECT_GT(r.oom, 0);
  EXPECT_THROW(plan::search(cfg("deepseek_v3"), plan::catalog_hardware("h100"), 8, 1000.0), Error);  // not whole sequences
}

namespace {
// The 2T proxy's strong scaling at 1K, 2K and 64K MI300X with the given EP dispatcher, printed with the error
// against the whitepaper's Table 1 (AMD, 2025: efficiency 1.0 up to 32K GPUs and 0.9 at 64K, GBS 128M tokens).
std::vector<plan::ScalePoint> scale_2t(const std::string& dispatcher) {
  const std::vector<int64_t> worlds = {1024, 2048, 65536};
  const double paper[3] = {1.0, 1.0, 0.9};
  const auto s = plan::scale(cfg("moe_2t", {"--parallelism.ep_dispatcher=" + dispatcher}),
                             plan::catalog_hardware("mi300x"), worlds, 134217728.0);
  EXPECT_EQ(s.size(), 3u);
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_TRUE(s[i].found) << s[i].world;
    std::printf("[seed] 2T mi300x %s world %lld efficiency %.3f (whitepaper %.1f, error %+.1f%%) %s\n",
                dispatcher.c_str(), (long long)s[i].world, s[i].efficiency, paper[i],
                100 * (s[i].efficiency / paper[i] - 1), s[i].best.layout.describe().c_str());
  }
  return s;
}
}  // namespace

TEST(PlanScaleSeeds, TwoTrillionOnMi300xKeepsTheWhitepapersShape) {
  // Flat all-to-all (the preset's dispatcher), then node-deduplicated (hierarchical: what DeepEP's normal kernels
  // do with NVLink / RDMA forwarding, the whitepaper's "DeepEP-like" EP wider than a node).
  const auto flat = scale_2t("alltoall");
  const auto hier = scale_2t("hierarchical");
  ASSERT_EQ(flat.size(), 3u);
  ASSERT_EQ(hier.size(), 3u);
  for (const auto* s : {&flat, &hier}) {
    EXPECT_DOUBLE_EQ((*s)[0].efficiency, 1.0);
    EXPECT_GT((*s)[1].efficiency, 0.95);              // near-linear at small scale
    EXPECT_LT((*s)[2].efficiency, (*s)[1].efficiency);  // the drop comes at 64K
    EXPECT_TRUE((*s)[2].best.layout.ep_overlap_split) << (*s)[2].best.layout.describe();
  }
  // The figures of 2026-11-27 (docs/planner.md, Checks), the split alternating at every exchange: flat 1.010 at
  // 2K and 0.717 at 64K; hierarchical 0.996 and 0.800.
  EXPECT_NEAR(flat[1].efficiency, 1.010, 0.02);
  EXPECT_NEAR(flat[2].efficiency, 0.717, 0.02);
  EXPECT_NEAR(hier[1].efficiency, 0.996, 0.02);
  EXPECT_NEAR(hier[2].efficiency, 0.800, 0.02);
  EXPECT_GT(hier[2].best.time.tokens_per_s_per_gpu, flat[2].best.time.tokens_per_s_per_gpu);
}
