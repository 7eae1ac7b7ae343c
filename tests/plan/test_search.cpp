// test_search.cpp: the layout search and strong scaling (plan/search.h): the winners obey every rule and fit,
// the ranking is by simulated throughput, impossible worlds find nothing without failing, each scaling run's
// baseline is the first world's layout projected again, and the 2T proxy's scaling on MI300X as a snapshot of the
// planner's own earlier figures and as a calibration point against the whitepaper's Table 1 (docs/planner.md,
// "Published results: calibration and validation points"). Not a validation against a published figure: the 2T
// table shaped the model.
#include <gtest/gtest.h>

#include <filesystem>

#include "moetron/plan/search.h"
#include "plan_test_util.h"

using namespace moetron;
using plantest::cfg;

namespace {
// The first world of a scaling run is its baseline: its efficiency is 1 by definition, so what can be wrong is the
// baseline itself. Its layout projected again by plan_time, outside the search, must give the tokens/s/GPU the run
// reports, and that figure must be the global batch over the step and the GPUs; every world's efficiency must be
// its own tokens/s/GPU over that re-projected figure.
void check_baseline(const JobConfig& c, const plan::Hardware& h, double gbt, const std::vector<plan::ScalePoint>& s,
                    const plan::SearchOptions& o = {}) {
  ASSERT_FALSE(s.empty());
  ASSERT_TRUE(s[0].found) << s[0].world;
  JobConfig cc = c;
  cc.training.global_batch_size = int64_t(gbt / double(c.training.seq_len));
  cc.parallelism.pp_microbatches = 0;
  const plan::Layout& l0 = s[0].best.layout;
  ASSERT_EQ(l0.world(), s[0].world);
  ASSERT_EQ(plan::layout_error(cc, l0, cc.training.global_batch_size), "") << l0.describe();
  const plan::TimePlan t0 = plan::plan_time(cc, l0, h, o.time);
  const double tok0 = gbt / (t0.step_time * double(s[0].world));
  EXPECT_NEAR(t0.tokens_per_s_per_gpu, tok0, 1e-12 * tok0);
  EXPECT_NEAR(s[0].best.time.tokens_per_s_per_gpu, tok0, 1e-9 * tok0) << l0.describe();
  EXPECT_NEAR(s[0].best.time.step_time, t0.step_time, 1e-9 * t0.step_time) << l0.describe();
  for (const auto& p : s) {
    if (!p.found) continue;
    const double tok = gbt / (p.best.time.step_time * double(p.world));
    EXPECT_NEAR(p.best.time.tokens_per_s_per_gpu, tok, 1e-9 * tok) << p.world;
    EXPECT_NEAR(p.efficiency, tok / tok0, 1e-9) << p.world;
  }
}
}  // namespace

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
constexpr double kGbt2T = 134217728.0;  // the whitepaper's global batch, 128M tokens

// The 2T proxy's strong scaling at 1K, 2K and 64K MI300X with the given EP dispatcher (the search picks the
// replica), printed beside the whitepaper's Table 1 (AMD, 2025: efficiency 1.0 up to 32K GPUs and 0.9 at 64K, GBS
// 128M tokens) as a calibration point: the dispatcher, the split of unpaired chunks and the carried weight gradients
// were added to the model while this table was in view.
std::vector<plan::ScalePoint> scale_2t(const std::string& dispatcher) {
  const std::vector<int64_t> worlds = {1024, 2048, 65536};
  const double paper[3] = {1.0, 1.0, 0.9};
  const JobConfig c = cfg("moe_2t", {"--parallelism.ep_dispatcher=" + dispatcher});
  const auto h = plan::catalog_hardware("mi300x");
  const auto s = plan::scale(c, h, worlds, kGbt2T);
  EXPECT_EQ(s.size(), 3u);
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_TRUE(s[i].found) << s[i].world;
    std::printf("[calibration] 2T mi300x %s, the search's replica: world %lld efficiency %.3f (Table 1 %.1f, "
                "difference %+.3f) %s\n",
                dispatcher.c_str(), (long long)s[i].world, s[i].efficiency, paper[i], s[i].efficiency - paper[i],
                s[i].best.layout.describe().c_str());
  }
  check_baseline(c, h, kGbt2T, s);
  return s;
}
}  // namespace

// A snapshot, not a match: the figures held here are the planner's own output of 2026-11-27 (docs/planner.md,
// "The 2T scaling figures"), kept so that a change that moves them is seen and its figures re-recorded in the
// docs. Agreement with a published figure is never read from this test. Flat all-to-all (the preset's
// dispatcher), then node-deduplicated (hierarchical: not the preset's dispatcher).
TEST(PlanScaleSnapshot, TwoTrillionOnMi300xWithTheSearchsReplica) {
  const auto flat = scale_2t("alltoall");
  const auto hier = scale_2t("hierarchical");
  ASSERT_EQ(flat.size(), 3u);
  ASSERT_EQ(hier.size(), 3u);
  for (const auto* s : {&flat, &hier}) {
    // near-linear at small scale: 0.95 until issue 33's fifth state, whose overlapped exchange SM share moved the
    // flat search's 1K layout (now zero 3, full recompute, 8 micro-batches: 0.921 at 2K against it)
    EXPECT_GT((*s)[1].efficiency, 0.9);
    EXPECT_LT((*s)[2].efficiency, (*s)[1].efficiency);  // the drop comes at 64K
    EXPECT_TRUE((*s)[2].best.layout.ep_overlap_split) << (*s)[2].best.layout.describe();
  }
  // The snapshot (split alternating at every exchange, each layout with or without carried weight gradients,
  // whichever is faster): flat 0.921 at 2K and 0.695 at 64K; hierarchical 0.997 and 0.821 (issue 33's fifth state,
  // the overlapped exchange's SM share; before it 1.012, 0.743, 0.997, 0.800). 0.02 is a regression band, not an
  // error bar: it lets pricing changes below 2 points of efficiency through unrecorded and stops anything larger.
  EXPECT_NEAR(flat[1].efficiency, 0.921, 0.02);
  EXPECT_NEAR(flat[2].efficiency, 0.695, 0.02);
  EXPECT_NEAR(hier[1].efficiency, 0.997, 0.02);
  EXPECT_NEAR(hier[2].efficiency, 0.821, 0.02);
  EXPECT_GT(hier[2].best.time.tokens_per_s_per_gpu, flat[2].best.time.tokens_per_s_per_gpu);
}

// A calibration point with an input taken from the paper, not a validation: the whitepaper's replica was 384 GPUs
// (seed 003: the 768-GPU run with dp 2, its 64K point extrapolated), and here the search is forced to replicas of
// at least that size (--min-replica 384; power-of-two worlds give 512), with the hierarchical dispatcher (not the
// preset's), the planner-only split of unpaired chunks and carried weight gradients counted as fully hidden (the
// engine hid 51-75 % of them). All of these entered the model while this table was in view. Table 1 gives one
// decimal: 1.0 at 1K to 32K, 0.9 at 64K.
TEST(PlanScaleCalibration, TwoTrillionWithThePapersReplicaWithinTable1Rounding) {
  plan::SearchOptions o;
  o.min_replica = 384;
  const std::vector<int64_t> worlds = {1024, 2048, 16384, 32768, 65536};
  const double paper[5] = {1.0, 1.0, 1.0, 1.0, 0.9};
  const JobConfig c = cfg("moe_2t", {"--parallelism.ep_dispatcher=hierarchical"});
  const auto h = plan::catalog_hardware("mi300x");
  const auto s = plan::scale(c, h, worlds, kGbt2T, o);
  ASSERT_EQ(s.size(), worlds.size());
  check_baseline(c, h, kGbt2T, s, o);
  for (size_t i = 0; i < s.size(); ++i) {
    ASSERT_TRUE(s[i].found) << s[i].world;
    const plan::Layout& l = s[i].best.layout;
    EXPECT_GE(l.tp * l.cp * l.pp, 384) << l.describe();
    std::printf("[calibration] 2T mi300x, the paper's replica (input from the paper, >= 384): world %lld efficiency "
                "%.3f (Table 1 %.1f) %s\n",
                (long long)s[i].world, s[i].efficiency, paper[i], l.describe().c_str());
    // 0.05 is the table's rounding (a figure within it rounds to the table's decimal), not an error bar. It misses
    // any error the one decimal hides. 32K sat at 0.951 until the host-bound spans (plan/cost.h, 2026-11-28: the
    // hierarchical dispatcher reads the counts back, so its MoE layers wait for the host): the search now prefers
    // mbs 8 and projects 0.924, outside the table's rounding by 0.026. A calibration MISS, reported in
    // docs/planner.md, not re-fitted; held here in a 0.02 regression band.
    if (worlds[i] == 32768) EXPECT_NEAR(s[i].efficiency, 0.924, 0.02) << s[i].world;
    else EXPECT_NEAR(s[i].efficiency, paper[i], 0.05) << s[i].world;
    if (i > 0) {
      // Falling with the world; 0.005 lets two worlds whose replicas run the same step differ by rounding.
      EXPECT_LT(s[i].efficiency, s[i - 1].efficiency + 0.005) << s[i].world;
    }
  }
}

TEST(PlanPresets, EveryPresetPlansMemoryTimeSearchAndScale) {
  // Every preset in configs/: its own [parallelism] layout through plan memory and plan time (at the smallest
  // world that layout allows: tp x cp x pp x ep GPUs), then a search and a two-world strong scaling. The engine's
  // own commands (calibrate, validate) train for real and are tested on ds_tiny / ds_mini (tests/mpi).
  const auto h = plan::catalog_hardware("mi300x");
  const std::vector<std::pair<std::string, int64_t>> presets = {
      {"ds_tiny", 8},        {"ds_tiny_mla", 8},      {"ds_mini", 8},         {"deepseek_v2_lite", 64},
      {"deepseek_v2", 64},   {"qwen3_30b_a3b", 64},   {"mixtral_8x7b", 64},   {"llama4_scout", 256},
      {"deepseek_v3", 1024}, {"moe_1t", 1024},        {"moe_2t", 1024},       {"qwen3_235b_a22b", 256},
      {"mixtral_8x22b", 64}, {"gpt_oss_120b", 64}};
  size_t seen = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(MOETRON_SOURCE_DIR) + "/configs"))
    if (e.path().extension() == ".toml") ++seen;
  EXPECT_EQ(seen, presets.size()) << "a preset was added or removed: list it here";
  plan::SearchOptions so;
  so.top_k = 1;
  for (const auto& [name, world] : presets) {
    SCOPED_TRACE(name);
    JobConfig c = cfg(name);
    const auto& p = c.parallelism;
    const int64_t own = p.tp * p.cp * p.pp * p.ep;
    const plan::Layout own_l = plan::layout_from_config(c, own);
    EXPECT_EQ(plan::layout_error(c, own_l, c.training.global_batch_size), "") << own_l.describe();
    const auto mem = plan::plan_memory(c, own_l, h, {});
    std::printf("[preset] %s own layout %s: %s %.1f GB\n", name.c_str(), own_l.describe().c_str(),
                mem.verdict.c_str(), mem.max_total / 1e9);
    EXPECT_GT(mem.max_total, 0);
    EXPECT_FALSE(mem.verdict.empty());
    const auto t = plan::plan_time(c, own_l, h);
    EXPECT_GT(t.step_time, 0);
    EXPECT_GT(t.tokens_per_s_per_gpu, 0);
    const double gbt = double(c.training.seq_len) * double(world) * 4;
    const auto r = plan::search(c, h, world, gbt, so);
    ASSERT_EQ(r.top.size(), 1u) << "nothing fits " << name << " on " << world << " GPUs";
    EXPECT_EQ(r.top[0].memory.verdict, "FITS");
    const auto s = plan::scale(c, h, {world, 2 * world}, gbt, so);
    ASSERT_EQ(s.size(), 2u);
    EXPECT_TRUE(s[0].found && s[1].found);
    check_baseline(c, h, gbt, s, so);
    EXPECT_GT(s[1].efficiency, 0);
  }
}
