// test_memory.cpp: the memory projection (plan/memory.h): hand-counted parameter, gradient, main-parameter and
// optimizer bytes; activations from the simulator's in-flight sets; the verdict; and the seeds' conclusions
// for the 1T / 2T proxies on 768 MI300X-class GPUs, validation points (docs/planner.md, "Published results:
// calibration and validation points": no change to the model was made to meet them).
#include <gtest/gtest.h>

#include "moetron/accounting.h"
#include "moetron/muon_params.h"
#include "moetron/plan/memory.h"
#include "moetron/plan/pipeline.h"
#include "plan_test_util.h"

using namespace moetron;
using plantest::cfg;

namespace {
plan::MemoryPlan mem(const JobConfig& c, int64_t world, const plan::PlanOptions& o = {}) {
  return plan::plan_memory(c, plan::layout_from_config(c, world), plantest::round_gpu(), o);
}
double act_total(const plan::MemoryPlan& m, size_t r) { return m.per_rank.at(r).activations; }
}  // namespace

TEST(PlanMemory, OneGpuCountsEveryParameterOnce) {
  // ds_tiny on one GPU, Megatron recipe, zero 1 with dp 1: 2 + 4 + 4 + 8 bytes per parameter.
  const auto c = cfg("ds_tiny");
  const double P = double(count_params(c.model).total);
  const auto m = mem(c, 1);
  ASSERT_EQ(m.per_rank.size(), 1u);
  const auto& r = m.per_rank[0];
  EXPECT_DOUBLE_EQ(r.params_tp_sharded + r.params_replicated + r.params_experts, P);
  EXPECT_DOUBLE_EQ(r.params, 2 * P);
  EXPECT_DOUBLE_EQ(r.grads, 4 * P);
  EXPECT_DOUBLE_EQ(r.main_params, 4 * P);
  EXPECT_DOUBLE_EQ(r.optimizer, 8 * P);
  EXPECT_EQ(r.inflight_sets, 1);
  EXPECT_EQ(m.verdict, "FITS");
}

TEST(PlanMemory, ShardingDivisorsByBucket) {
  // 8 GPUs: tp 2, ep 4 (experts over ep; ep divides tp x dp = 8), dp 4, zero 1.
  const auto c0 = cfg("ds_tiny");
  const auto c = cfg("ds_tiny", {"--parallelism.tp=2", "--parallelism.ep=4", "--training.global_batch_size=16",
                                  "--training.micro_batch_size=4"});
  const ParamCounts pc = count_params(c.model);
  const auto m = mem(c, 8);
  const auto& r = m.per_rank.at(0);
  EXPECT_DOUBLE_EQ(r.params_experts, double(pc.routed_experts) / 4);
  const auto one = mem(c0, 1).per_rank[0];
  EXPECT_DOUBLE_EQ(r.params_tp_sharded, one.params_tp_sharded / 2);
  EXPECT_DOUBLE_EQ(r.params_replicated, one.params_replicated);
  // main params and moments: dense over dp x cp = 4, experts over edp = tp x dp / ep = 2
  const double Pd = r.params_tp_sharded + r.params_replicated, Pe = r.params_experts;
  EXPECT_DOUBLE_EQ(r.main_params, Pd * 4 / 4 + Pe * 4 / 2);
  EXPECT_DOUBLE_EQ(r.optimizer, 8 * (Pd / 4 + Pe / 2));
  EXPECT_DOUBLE_EQ(r.grads, 4 * (Pd + Pe));
  // zero 2 shards the gradients the same way; zero 0 shards nothing.
  auto c2 = c;
  c2.parallelism.zero = 2;
  EXPECT_DOUBLE_EQ(mem(c2, 8).per_rank[0].grads, 4 * (Pd / 4 + Pe / 2));
  const auto l0 = plan::layout_from_config(c, 8, /*distributed_optimizer=*/false);
  EXPECT_EQ(l0.zero, 0);
  EXPECT_DOUBLE_EQ(plan::plan_memory(c, l0, plantest::round_gpu(), {}).per_rank[0].optimizer, 8 * (Pd + Pe));
}

TEST(PlanMemory, EngineRecipeMatchesTheEnginesConvention) {
  const auto c = cfg("ds_tiny", {"--training.compute_dtype=fp32"});
  plan::PlanOptions o;
  o.recipe = plan::recipe_named("engine", c);
  const ParamCounts pc = count_params(c.model);
  const double P = double(pc.total), Pe = double(pc.routed_experts);
  const auto r = mem(c, 1, o).per_rank[0];
  // fp32 masters, no bf16 copy under fp32 compute, each MoE layer's experts packed twice more (two fp32 layouts,
  // padded to the grouped kernels' tiles: at least 8 bytes per expert element) and its fp32 routing bias (kept
  // whatever the balancing): the engine's own estimate
  const double n_moe = double(c.model.n_moe_layers());
  const double packed = n_moe * engine_packed_expert_bytes(c.model, 1, 1, 4);
  EXPECT_GE(packed, 8 * Pe);
  EXPECT_DOUBLE_EQ(r.params, 4 * P + packed + n_moe * double(c.model.moe.n_routed_experts) * 4);
  EXPECT_DOUBLE_EQ(r.params, estimate_memory(c, 4, 1).params);
  EXPECT_DOUBLE_EQ(r.main_params, 0);
  EXPECT_THROW(plan::recipe_named("apex", c), Error);
}

// optimizer.name = "muon": one moment for Muon's matrices (every block weight and expert), two for the rest. With the
// engine recipe the projection is the engine's estimate (estimate_memory) under zero 0, 1 and 3, with EP and PP, and
// both equal the engine's measured state on one rank of ds_mini: 610,799,616 bytes (AdamW 1,152,585,728; `moetron
// train configs/ds_mini.toml --optimizer.name=muon`, 2026-11-28). The megatron recipe saves 4 bytes per Muon element.
TEST(PlanMemory, MuonCountsOneMomentForItsMatrices) {
  for (const std::vector<std::string>& lay :
       {std::vector<std::string>{}, {"--parallelism.dp_shard=2", "--parallelism.zero=1"},
        {"--parallelism.dp_shard=2", "--parallelism.zero=3"}, {"--parallelism.dp_shard=2", "--parallelism.ep=2"},
        {"--parallelism.pp=2"}}) {
    std::vector<std::string> a = lay;
    a.push_back("--optimizer.name=muon");
    const auto c = cfg("ds_mini", a);
    SCOPED_TRACE(lay.empty() ? "one rank" : lay.back());
    plan::PlanOptions o;
    o.recipe = plan::recipe_named("engine", c);
    const int64_t world = c.parallelism.world_size();
    const auto m = plan::plan_memory(c, plan::layout_from_config(c, world, false), plantest::round_gpu(), o);
    if (c.parallelism.pp == 1) {
      EXPECT_NEAR(m.per_rank.at(0).optimizer, estimate_memory(c, 2, 1).optimizer, 1e-9 * m.per_rank.at(0).optimizer);
    }
    if (lay.empty()) {
      EXPECT_DOUBLE_EQ(m.per_rank.at(0).optimizer, 610799616.0);
    }
    // Against AdamW: 4 bytes less per Muon element held (its share under zero 1 / 3).
    JobConfig ca = c;
    ca.optimizer.name = "adamw";
    const auto ma = plan::plan_memory(ca, plan::layout_from_config(ca, world, false), plantest::round_gpu(), o);
    double muon = 0;
    for (int64_t l = 0; l < c.model.n_layers; ++l) muon += double(muon_layer_numel(c.model, l).total());
    const double got = m.per_rank.at(0).optimizer, adam = ma.per_rank.at(0).optimizer;  // pipeline rank 0
    if (c.parallelism.ep == 1 && c.parallelism.pp == 1) {  // zero 1 / 3: its 1/dp share of every element
      const double share = c.parallelism.zero >= 1 ? 1.0 / double(c.parallelism.dp_shard) : 1.0;
      EXPECT_NEAR(adam - got, 4 * muon * share, 1e-6 * got);
    }
    EXPECT_LT(got, adam);
  }
}

// Under tensor parallelism the engine recipe prices what the engine allocates (its gathered norm outputs, the
// router on every row, the packed experts at the TP-sliced width with the kernels' padding): the projection's
// parameters and activations are the engine's own estimate, in fp32 and in bf16, with and without full recompute
// and with CP beside TP (estimate_memory is checked against the engine's measured peaks by `plan validate`).
TEST(PlanMemory, EngineRecipeUnderTpIsTheEnginesEstimate) {
  for (const char* dt : {"fp32", "bf16"})
    for (const char* extra : {"--activation_checkpoint.mode=none", "--activation_checkpoint.mode=full",
                              "--parallelism.cp=2"}) {
      SCOPED_TRACE(std::string(dt) + " " + extra);
      const auto c = cfg("ds_mini", {"--parallelism.tp=2", "--parallelism.expert_tp=2",
                                     std::string("--training.compute_dtype=") + dt, extra});
      plan::PlanOptions o;
      o.recipe = plan::recipe_named("engine", c);
      const int64_t world = c.parallelism.world_size();
      const auto r = plan::plan_memory(c, plan::layout_from_config(c, world, false), plantest::round_gpu(), o)
                         .per_rank.at(0);
      const MemoryEstimate e = estimate_memory(c, std::string(dt) == "fp32" ? 4 : 2, 1);
      EXPECT_NEAR(r.params, e.params, 1e-9 * e.params);
      EXPECT_NEAR(r.activations, e.activations, 1e-9 * e.activations);
    }
}

// HSDP (zero 3, dp_replicate 2 x dp_shard 2 on 4 GPUs): every state term is sharded over dp_shard = 2, as FSDP over
// 2 GPUs, and with the engine recipe the optimizer state and the gradients (shard + one unit slot) are the engine's
// own estimate (estimate_memory, src/job/accounting.cpp), which the engine's measured memory is checked against.
TEST(PlanMemory, HsdpShardsOverDpShardAsTheEngineDoes) {
  const std::vector<std::string> fp32 = {"--training.compute_dtype=fp32", "--training.global_batch_size=16"};
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.end(), fp32.begin(), fp32.end());
    return cfg("ds_tiny", a);
  };
  const auto hs = with({"--parallelism.dp_replicate=2", "--parallelism.dp_shard=2", "--parallelism.zero=3"});
  const auto f2 = with({"--parallelism.dp_shard=2", "--parallelism.zero=3"});
  const auto f4 = with({"--parallelism.dp_shard=4", "--parallelism.zero=3"});
  const double P = double(count_params(hs.model).total);
  for (const char* rec : {"megatron", "engine"}) {
    SCOPED_TRACE(rec);
    plan::PlanOptions o;
    o.recipe = plan::recipe_named(rec, hs);
    const auto h = mem(hs, 4, o).per_rank.at(0), f = mem(f2, 2, o).per_rank.at(0), q = mem(f4, 4, o).per_rank.at(0);
    EXPECT_DOUBLE_EQ(h.optimizer_elements, P / 2);
    EXPECT_DOUBLE_EQ(h.optimizer, f.optimizer);
    EXPECT_DOUBLE_EQ(h.main_params, f.main_params);
    EXPECT_DOUBLE_EQ(h.grads, f.grads);
    EXPECT_DOUBLE_EQ(h.params, f.params);
    EXPECT_DOUBLE_EQ(h.optimizer, 2 * q.optimizer);  // not FSDP over the 4 data-parallel GPUs
  }
  plan::PlanOptions o;
  o.recipe = plan::recipe_named("engine", hs);
  const auto h = mem(hs, 4, o).per_rank.at(0);
  const MemoryEstimate e = estimate_memory(hs, 4, 1);
  EXPECT_DOUBLE_EQ(h.optimizer, e.optimizer);
  EXPECT_DOUBLE_EQ(h.grads, e.grads);
}

TEST(PlanMemory, ActivationsFollowTheSimulatedInflightSets) {
  // 1f1b at pp 4 with 8 micro-batches: rank r holds pp - r sets of its stage.
  const auto c = cfg("ds_mini", {"--parallelism.pp=4", "--training.global_batch_size=8", "--training.micro_batch_size=1"});
  const auto l = plan::layout_from_config(c, 4);
  const auto m = plan::plan_memory(c, l, plantest::round_gpu(), {});
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(m.per_rank[size_t(r)].inflight_sets, 4 - r) << r;
    EXPECT_NEAR(act_total(m, size_t(r)), (4 - r) * m.per_rank[size_t(r)].act_per_microbatch, 1e-6) << r;
  }
}

TEST(PlanMemory, CappedSimulationGivesTheSamePeaks) {
  // The in-flight peak is reached in the warm-up: simulating 4 pp micro-batches gives the full run's peak.
  for (std::string s : {"1f1b", "interleaved_1f1b", "zb1p", "zbv"}) {
    sched::GenSpec g;
    g.schedule = s, g.pp = 4, g.vpp = (s == "interleaved_1f1b" || s == "zbv") ? 2 : 1;
    plan::StagePlan capped;
    capped.spec = g;
    capped.spec.microbatches = 64;  // simulated at 16
    EXPECT_EQ(plan::inflight_microbatches(capped.spec), 16);
    // Compare against an uncapped run at 64 through the simulator directly.
    sched::GenSpec g64 = g;
    g64.microbatches = 64;
    const auto r = sched::simulate_timed(sched::lower(sched::generate(g64)), sched::Durations{});
    const auto ic = plan::inflight(capped);
    for (int rk = 0; rk < 4; ++rk) EXPECT_EQ(ic.peak_sets[size_t(rk)], r.ranks[size_t(rk)].peak_inflight) << s << " rank " << rk;
  }
}

TEST(PlanMemory, LossFusionAndRecomputeCutActivations) {
  const auto c = cfg("ds_mini");
  const auto fused = mem(c, 1);
  plan::PlanOptions o;
  o.fused_loss = false;
  const auto unfused = mem(c, 1, o);
  // unfused keeps T x V logits (2 bytes) and fp32 softmax (4 bytes)
  const double T = double(c.training.micro_batch_size * c.training.seq_len);
  EXPECT_NEAR(act_total(unfused, 0) - act_total(fused, 0), T * double(c.model.vocab_size) * 6, 1.0);
  auto cf = c;
  cf.activation_checkpoint.mode = AcMode::Full;
  const auto full = mem(cf, 1);
  EXPECT_LT(act_total(full, 0), act_total(fused, 0) / 3);
  EXPECT_GT(full.per_rank[0].workspace, fused.per_rank[0].workspace);  // the re-materialized layer
}

TEST(PlanMemory, Verdict) {
  EXPECT_EQ(plan::verdict_for(89e9, 100e9, 0.1), "FITS");
  EXPECT_EQ(plan::verdict_for(95e9, 100e9, 0.1), "AT-RISK");
  EXPECT_EQ(plan::verdict_for(101e9, 100e9, 0.1), "OOM");
}

// ---- the seeds' memory conclusions (AMD MoE best-practice blog, "Memory Projection", 1T and 2T on 768 GPUs).
namespace {
plan::MemoryPlan seed_layout(const std::string& model, int64_t pp, int64_t ep, int64_t cp) {
  // A global batch of 1536 sequences: enough micro-batches for every layout here (in-flight sets saturate at pp).
  const auto c = cfg(model, {"--parallelism.pp=" + std::to_string(pp), "--parallelism.ep=" + std::to_string(ep),
                             "--parallelism.cp=" + std::to_string(cp), "--training.global_batch_size=1536"});
  return plan::plan_memory(c, plan::layout_from_config(c, 768), plan::catalog_hardware("mi300x"), {});
}
double worst_act(const plan::MemoryPlan& m) {
  double a = 0;
  for (const auto& r : m.per_rank) a = std::max(a, r.activations);
  return a;
}
}  // namespace

TEST(PlanMemoryValidation, SeedsActivationsDominate) {
  for (std::string model : {"moe_1t", "moe_2t"}) {
    const auto m = seed_layout(model, 24, 8, 1);
    const auto& r = m.per_rank.at(size_t(m.worst_rank));
    EXPECT_GT(r.activations, r.params) << model;
    EXPECT_GT(r.activations, r.optimizer + r.main_params) << model;
    EXPECT_GT(r.activations, r.grads) << model;
  }
}

TEST(PlanMemoryValidation, SeedsCp2HalvesActivations) {
  // Seeds: CP2 saves about 76 GB per GPU (1T) and about 131 GB (2T). The projection must halve the
  // activations; the saved GB is printed and held within 25% of the seeds' figure (docs/planner.md has the error
  // and its cause, a counting convention).
  const double seed_saved[2] = {76e9, 131e9};
  int i = 0;
  for (std::string model : {"moe_1t", "moe_2t"}) {
    const double a1 = worst_act(seed_layout(model, 24, 8, 1)), a2 = worst_act(seed_layout(model, 24, 8, 2));
    EXPECT_NEAR(a2 / a1, 0.5, 0.02) << model;
    const double saved = a1 - a2;
    std::printf("[seed] %s CP2 saves %.1f GB per GPU (seed: ~%.0f GB, error %+.1f%%)\n", model.c_str(), saved / 1e9,
                seed_saved[i] / 1e9, 100 * (saved / seed_saved[i] - 1));
    // Why 25 %: the planner counts each routed copy's expert input rows, which the seeds' source does not
    // (docs/planner.md, "Where the 21-24 % activation gap to the seeds comes from"), so the saving is 21.5 % (1T) and
    // 23.8 % (2T) above the seeds' figures, 1-3 points inside the bound, which dates from the planner's first
    // tests. It is no agreement with the seeds (they and the planner count different tensors): it guards the present
    // count. What it misses: a change that moves the saving by less than those 1-3 points upward or by up to 46-49
    // points downward. The halving itself (0.02 above) is the firm check.
    EXPECT_NEAR(saved / seed_saved[i], 1.0, 0.25) << model;
    ++i;
  }
}

TEST(PlanMemoryValidation, SeedsEp16BarelyChangesAndPp48DoesNotCutActivations) {
  for (std::string model : {"moe_1t", "moe_2t"}) {
    // "EP 8 -> 16 doesn't significantly lower memory" against "CP2 halves the activations": read as EP 16 saving
    // less than a third of what CP2 saves.
    const auto e8 = seed_layout(model, 24, 8, 2), e16 = seed_layout(model, 24, 16, 2);
    const double cp_saved = seed_layout(model, 24, 8, 1).max_total - e8.max_total;
    const double ep_saved = e8.max_total - e16.max_total;
    std::printf("[seed] %s EP 8 -> 16 saves %.1f GB (%.1f%% of %.1f GB); CP2 saves %.1f GB\n", model.c_str(), ep_saved / 1e9,
                100 * ep_saved / e8.max_total, e8.max_total / 1e9, cp_saved / 1e9);
    EXPECT_LT(ep_saved, cp_saved / 3) << model;
    const auto p24 = seed_layout(model, 24, 8, 2), p48 = seed_layout(model, 48, 8, 2);
    std::printf("[seed] %s PP 24 -> 48: activations %.1f -> %.1f GB\n", model.c_str(), worst_act(p24) / 1e9, worst_act(p48) / 1e9);
    EXPECT_GE(worst_act(p48), 0.97 * worst_act(p24)) << model << " PP 24 -> 48 does not cut activations";
  }
}

TEST(PlanMemoryValidation, SeedsTwoTrillionWithCp2AndEp8FitsMi355xNotMi300x) {
  // Seeds: "With CP2, EP8 doesn't fit on MI300X but works on MI355X" (2T, 768 GPUs, PP24).
  const auto c = cfg("moe_2t", {"--parallelism.pp=24", "--parallelism.ep=8", "--parallelism.cp=2",
                                "--training.global_batch_size=1536"});
  const auto l = plan::layout_from_config(c, 768);
  const auto m300 = plan::plan_memory(c, l, plan::catalog_hardware("mi300x"), {});
  const auto m355 = plan::plan_memory(c, l, plan::catalog_hardware("mi355x"), {});
  std::printf("[seed] moe_2t PP24 EP8 CP2: %.1f GB -> mi300x %s, mi355x %s\n", m300.max_total / 1e9, m300.verdict.c_str(),
              m355.verdict.c_str());
  EXPECT_EQ(m300.verdict, "OOM");
  EXPECT_NE(m355.verdict, "OOM");
}

TEST(PlanMemory, EpImbalanceScalesTheRoutedRows) {
  // ds_mini on 8 GPUs with ep 8: the busiest rank holds imb x (tokens x topk) routed rows. The terms with one entry
  // per routed row (moe.x, moe.gate_up, moe.act, moe.y) grow by (imb - 1) of their balanced bytes, hand-counted
  // here, and so do the EP dispatch buffers; nothing else moves.
  const auto c = cfg("ds_mini", {"--parallelism.ep=8", "--training.global_batch_size=64"});
  const auto& m = c.model.moe;
  const double R = double(c.training.micro_batch_size * c.training.seq_len * m.topk), d = double(c.model.d_model),
               Im = double(m.moe_inter_size);
  auto routed = [&](double a, double g) { return R * d * g + R * 2 * Im * a + R * Im * g + R * d * a; };
  plan::PlanOptions o;
  const auto one = mem(c, 8, o).per_rank.at(0);
  o.ep_imbalance = 1.5;
  const auto skew = mem(c, 8, o).per_rank.at(0);
  const double n_moe = double(c.model.n_moe_layers());
  EXPECT_NEAR(skew.act_per_microbatch - one.act_per_microbatch, 0.5 * n_moe * routed(2, 2), 1e-6);
  EXPECT_NEAR(skew.buffers, 1.5 * one.buffers, 1e-6);  // ep_dispatch only (pp 1)
  EXPECT_DOUBLE_EQ(skew.params, one.params);
  // The engine's buffers start at the balanced rows and grow by at least a quarter: an imbalance of 1.1 holds 1.25.
  const auto ce = cfg("ds_mini", {"--parallelism.ep=8", "--training.global_batch_size=64", "--training.compute_dtype=fp32"});
  plan::PlanOptions oe;
  oe.recipe = plan::recipe_named("engine", ce);
  const auto e1 = mem(ce, 8, oe).per_rank.at(0);
  oe.ep_imbalance = 1.1;
  const auto e2 = mem(ce, 8, oe).per_rank.at(0);
  EXPECT_NEAR(e2.act_per_microbatch - e1.act_per_microbatch, 0.25 * n_moe * routed(4, 4), 1e-6);
  // Without EP a rank holds every expert: its rows are the balanced count whatever the routing.
  const auto c1 = cfg("ds_mini");
  plan::PlanOptions o1;
  const double a1 = mem(c1, 1, o1).per_rank.at(0).activations;
  o1.ep_imbalance = 2;
  EXPECT_DOUBLE_EQ(mem(c1, 1, o1).per_rank.at(0).activations, a1);
  o1.ep_imbalance = 0.9;
  EXPECT_THROW(mem(c1, 1, o1), Error);
}
