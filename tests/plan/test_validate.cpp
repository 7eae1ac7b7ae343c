// tests/plan/test_validate.cpp: the planner's side of `plan validate` (plan/validate.h) on hand-made runs: the
// layouts and their overrides, --only, the engine's scopes grouped like the projection (per step, `other` the
// rest), the projection's groups (recompute spread over the forward groups), the step time and median run picks,
// the routing imbalance option, and a layout compared with its projection: error signs, the bounds (EP
// activations apart), the CPU share, the report's lines and JSON. Not the engine's runs (tools/).
#include <gtest/gtest.h>

#include "../unit/test_util.h"
#include "plan_test_util.h"

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moetron/plan/cost.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"
#include "moetron/plan/validate.h"

using namespace moetron;
using namespace moetron::plan;

namespace {

using moetron::testing::error_of;

const ValidationCase& case_named(const std::string& name) {
  static const std::vector<ValidationCase> all = validation_cases();
  for (const ValidationCase& c : all)
    if (c.name == name) return c;
  ADD_FAILURE() << "no case " << name;
  return all.front();
}

// A picked case's config at a world, as the command loads it.
JobConfig case_config(const std::string& name, int world) {
  return plantest::cfg("ds_mini", case_overrides(case_named(name), world, 2, "/tmp/moetron_validate_test", "fp32"));
}

// The projection validate_layout makes, made here by hand: the engine's recipe, no DP overlap.
struct Proj {
  MemoryPlan mp;
  TimePlan tp;
};
Proj project_by_hand(const JobConfig& c, int world, const Hardware& h, double ep_imbalance) {
  PlanOptions po;
  po.recipe = recipe_named("engine", c);
  po.ep_imbalance = ep_imbalance;
  const Layout l = layout_from_config(c, world, false);
  Proj p;
  p.mp = plan_memory(c, l, h, po);
  TimeOptions to;
  to.memory = po;
  to.overlap_dp = false;
  p.tp = plan_time(c, l, h, to, &p.mp);
  return p;
}

// The largest rank's projected figure of one category.
double proj_max(const MemoryPlan& m, int cat) {
  double x = 0;
  for (const RankMemory& rm : m.per_rank)
    x = std::max(x, cat == 0 ? rm.params : cat == 1 ? rm.grads : cat == 2 ? rm.optimizer + rm.main_params
                                                                         : rm.activations);
  return x;
}

const FigureRow& row(const LayoutValidation& v, const std::string& figure) {
  for (const FigureRow& f : v.figures)
    if (f.figure == figure) return f;
  ADD_FAILURE() << "no figure " << figure;
  return v.figures.front();
}

}  // namespace

TEST(Validate, CasesAndOverrides) {
  const std::vector<ValidationCase> cs = validation_cases();
  ASSERT_EQ(cs.size(), 15u);
  EXPECT_EQ(case_named("tp2_cp2_pp2_ep2").min_world, 8);
  EXPECT_EQ(case_named("ep_shm").args.back(), "--parallelism.ep_transport=shm");
  EXPECT_EQ(case_named("tp").args, (std::vector<std::string>{"--parallelism.tp={w}", "--parallelism.expert_tp={w}"}));
  EXPECT_EQ(case_named("cp").args, (std::vector<std::string>{"--parallelism.cp={w}"}));
  EXPECT_EQ(cs.front().name, "single");
  EXPECT_EQ(cs.front().min_world, 1);
  EXPECT_EQ(case_named("recompute_full").min_world, 2);
  EXPECT_EQ(case_named("hsdp").min_world, 4);  // dp_replicate 2 x dp_shard w / 2
  EXPECT_EQ(substitute_world("--parallelism.ranks_per_node={w2} --x={w}", 4), "--parallelism.ranks_per_node=2 --x=4");
  const std::vector<std::string> ov = case_overrides(case_named("ep_hierarchical"), 4, 6, "/d", "bf16");
  ASSERT_EQ(ov.size(), 11u + 4u);
  EXPECT_EQ(ov[0], "--training.steps=6");
  EXPECT_EQ(ov[8], "--job.dump_folder=/d");
  EXPECT_EQ(ov[9], "--training.compute_dtype=bf16");
  EXPECT_EQ(ov[11], "--parallelism.dp_shard=4");
  EXPECT_EQ(ov[14], "--parallelism.ranks_per_node=2");
  // Every case loads at 2 and 4 ranks from its smallest world on (the small job divides every layout), the 8-rank
  // case at 8.
  for (const ValidationCase& c : cs)
    for (int w : {2, 4, 8}) {
      if (w >= c.min_world && (w < 8 || c.min_world == 8)) {
        EXPECT_EQ(error_of([&] { case_config(c.name, w); }), "") << c.name << " at " << w;
      }
    }
}

TEST(Validate, OnlyPicksByParts) {
  EXPECT_TRUE(case_picked("ep_alltoall", ""));
  EXPECT_TRUE(case_picked("ep_alltoall", "single,alltoall"));
  EXPECT_FALSE(case_picked("ep_alltoall", "single,pp"));
  EXPECT_TRUE(case_picked("pp_1f1b", "single,pp"));
  EXPECT_FALSE(case_picked("dp", ","));  // empty parts pick nothing
  EXPECT_TRUE(case_picked("zero1", "zero1,"));
}

TEST(Validate, RelativeErrorSigns) {
  EXPECT_NEAR(relative_error(110, 100), 0.10, 1e-15);   // projected above: positive
  EXPECT_NEAR(relative_error(90, 100), -0.10, 1e-15);   // below: negative
  EXPECT_DOUBLE_EQ(relative_error(5, 0), 0);                        // nothing measured: no error
}

// Three steps of 1.0, 0.5 and 0.7 s: two profiled steps (the first is not), their mean 0.6 s. Each scope's total
// over those two steps is halved; `other` is the mean less what the scopes grouped; recompute 0.3 s over all three
// steps is 0.1 s a step.
TEST(Validate, MeasuredOpsPerStep) {
  const std::vector<std::pair<std::string, double>> scopes = {
      {"fwd.attn.proj", 0.2}, {"bwd.attn.proj", 0.4}, {"loss.fused_linear_xent", 0.1}, {"optim.adamw", 0.1},
      {"sync_weights", 0.02}, {"fwd.ep.dispatch", 0.04}, {"dp.all_reduce", 0.06}, {"fsdp.gather", 0.08},
      {"embedding", 0.3},     {"fwd.experts", 0.12},     {"bwd.router", 0.02}};
  const OpTimes o = measured_ops(scopes, {1.0, 0.5, 0.7}, 0.3);
  EXPECT_NEAR(o.f[kOpAttnProj], 0.1, 1e-12);
  EXPECT_NEAR(o.b[kOpAttnProj], 0.2, 1e-12);
  EXPECT_NEAR(o.f[kOpLoss], 0.05, 1e-12);
  EXPECT_NEAR(o.f[kOpExperts], 0.06, 1e-12);
  EXPECT_NEAR(o.b[kOpRouter], 0.01, 1e-12);
  EXPECT_NEAR(o.part[kOptimizer], 0.05, 1e-12);
  EXPECT_NEAR(o.part[kRefresh], 0.01, 1e-12);
  EXPECT_NEAR(o.part[kEp], 0.02, 1e-12);
  EXPECT_NEAR(o.part[kDp], 0.03, 1e-12);
  EXPECT_NEAR(o.part[kFsdp], 0.04, 1e-12);
  EXPECT_NEAR(o.part[kRecompute], 0.1, 1e-12);
  // grouped: 0.1 + 0.2 + 0.05 + 0.05 + 0.01 + 0.02 + 0.03 + 0.04 + 0.06 + 0.01 = 0.57 of 0.6 (embedding is other)
  EXPECT_NEAR(o.part[kOther], 0.03, 1e-12);
  EXPECT_NEAR(compute_seconds(o), 0.1 + 0.2 + 0.05 + 0.06 + 0.01, 1e-12);
  // One step: it is the profiled one; the scopes above it leave no negative `other`.
  const OpTimes one = measured_ops(scopes, {0.2}, 0);
  EXPECT_NEAR(one.f[kOpAttnProj], 0.2, 1e-12);
  EXPECT_DOUBLE_EQ(one.part[kOther], 0.0);
  EXPECT_STREQ(step_part_name(kRefresh), "weight_refresh");
}

// Recompute 2 s spread over the forward groups (loss excluded) in proportion: attn_proj 1 and ffn 3 take 0.5 and
// 1.5; the refresh is its own row, or inside fsdp under zero 3; `other` is the bubble and the TP / CP comm.
TEST(Validate, ProjectedOpsGroups) {
  TimePlan t;
  t.ops_f[kOpAttnProj] = 1, t.ops_f[kOpFfn] = 3, t.ops_f[kOpLoss] = 2;
  t.ops_b[kOpFfn] = 6;
  t.breakdown = {{"compute.recompute", 2}, {"comm.ep", 0.25}, {"bubble_and_p2p", 0.5}, {"comm.tp", 0.125}};
  t.optimizer = 0.75, t.dp_exposed = 0.375, t.weight_refresh = 0.0625;
  t.layout.zero = 1;
  const OpTimes o = projected_ops(t);
  EXPECT_DOUBLE_EQ(o.f[kOpAttnProj], 1.5);
  EXPECT_DOUBLE_EQ(o.f[kOpFfn], 4.5);
  EXPECT_DOUBLE_EQ(o.f[kOpLoss], 2);
  EXPECT_DOUBLE_EQ(o.b[kOpFfn], 6);
  EXPECT_DOUBLE_EQ(o.part[kRecompute], 2);
  EXPECT_DOUBLE_EQ(o.part[kOptimizer], 0.75);
  EXPECT_DOUBLE_EQ(o.part[kEp], 0.25);
  EXPECT_DOUBLE_EQ(o.part[kDp], 0.375);
  EXPECT_DOUBLE_EQ(o.part[kRefresh], 0.0625);
  EXPECT_DOUBLE_EQ(o.part[kFsdp], 0);
  EXPECT_DOUBLE_EQ(o.part[kOther], 0.625);
  t.layout.zero = 3;
  const OpTimes f = projected_ops(t);
  EXPECT_DOUBLE_EQ(f.part[kFsdp], 0.4375);
  EXPECT_DOUBLE_EQ(f.part[kDp], 0);
  EXPECT_DOUBLE_EQ(f.part[kRefresh], 0);
}

TEST(Validate, BusiestRank) {
  std::vector<OpTimes> r(3);
  r[0].f[kOpFfn] = 1, r[0].part[kDp] = 10;  // waits are not compute
  r[1].f[kOpFfn] = 2, r[1].b[kOpFfn] = 1;
  r[2].b[kOpExperts] = 3;                   // ties rank 1: the first stays
  EXPECT_EQ(&busiest(r), &r[1]);
  EXPECT_NE(error_of([] { busiest({}); }), "");
}

TEST(Validate, StepTimeAndMedianRun) {
  EXPECT_DOUBLE_EQ(run_step_time({5, 1, 3, 2}), 2);  // the first step dropped, the median of {1, 3, 2}
  EXPECT_DOUBLE_EQ(run_step_time({5, 1, 3}), 3);     // the upper middle of two
  EXPECT_DOUBLE_EQ(run_step_time({4}), 4);           // one step: itself
  EXPECT_DOUBLE_EQ(run_step_time({}), 0);
  EXPECT_EQ(median_run({3, 1, 2}), 2u);
  EXPECT_EQ(median_run({5, 4}), 0u);  // the slower of two
  EXPECT_EQ(median_run({7}), 0u);
  EXPECT_NE(error_of([] { median_run({}); }), "");
}

TEST(Validate, EpImbalanceOption) {
  EXPECT_DOUBLE_EQ(ep_imbalance_for("measured", 0.8), 1.0);  // never below balanced
  EXPECT_DOUBLE_EQ(ep_imbalance_for("measured", 1.3), 1.3);
  EXPECT_DOUBLE_EQ(ep_imbalance_for("1.5", 1.3), 1.5);
  EXPECT_NE(error_of([] { ep_imbalance_for("0.5", 1); }).find("--ep-imbalance = 0.5 must be >= 1"), std::string::npos);
  EXPECT_NE(error_of([] { ep_imbalance_for("lots", 1); }).find("expected 'measured' or a number >= 1"),
            std::string::npos);
}

// An EP layout compared with a run made from its own projection: params measured 1/1.1 of the projection (error
// +10%), grads 1/0.9 (-10%), optimizer equal, activations 1/1.08 (+8%: within the EP bound 10%, beyond the memory
// bound 5%), the step at half the cores: projected x 2, measured equal to that (0%).
TEST(Validate, LayoutAgainstItsProjection) {
  const JobConfig c = case_config("ep_alltoall", 2);
  const Hardware h = plantest::round_gpu();
  const Proj p = project_by_hand(c, 2, h, 1.2);
  MeasuredRun run;
  run.params = proj_max(p.mp, 0) / 1.1;
  run.grads = proj_max(p.mp, 1) / 0.9;
  run.optimizer = proj_max(p.mp, 2);
  run.activations = proj_max(p.mp, 3) / 1.08;
  run.cpu_share = 0.5;
  run.step_s = 2 * p.tp.step_time;
  run.ep_rows_peak = 1.2, run.ep_rows_held = 1.3;
  run.ops.f[kOpAttnProj] = 1, run.ops.f[kOpFfn] = 1;
  run.step_runs = {run.step_s, 1.5 * run.step_s};
  const ValidationBounds b{0.05, 0.10, 0};
  const LayoutValidation v = validate_layout(c, "ep_alltoall", 2, h, run, b);
  EXPECT_EQ(v.planner_layout, p.tp.layout.describe());
  EXPECT_TRUE(v.ep);
  EXPECT_DOUBLE_EQ(v.ep_projected_with, 1.2);
  ASSERT_EQ(v.figures.size(), 5u);
  EXPECT_NEAR(row(v, "params").error, 0.1, 1e-12);
  EXPECT_NEAR(row(v, "grads").error, -0.1, 1e-12);
  EXPECT_NEAR(row(v, "optimizer").error, 0, 1e-12);
  EXPECT_NEAR(row(v, "activations").error, 0.08, 1e-12);
  EXPECT_NEAR(row(v, "step_s").projected, 2 * p.tp.step_time, 1e-15);
  EXPECT_NEAR(row(v, "step_s").error, 0, 1e-12);
  EXPECT_DOUBLE_EQ(row(v, "activations").bound, 0.10);  // EP activations: their own bound
  EXPECT_DOUBLE_EQ(row(v, "params").bound, 0.05);
  EXPECT_DOUBLE_EQ(row(v, "step_s").bound, 0);          // report only
  EXPECT_TRUE(row(v, "params").over);
  EXPECT_TRUE(row(v, "grads").over);
  EXPECT_FALSE(row(v, "activations").over);
  EXPECT_FALSE(row(v, "step_s").over);
  const std::vector<std::string> over = beyond_bounds(v);
  ASSERT_EQ(over.size(), 2u);
  EXPECT_EQ(over[0], "ep_alltoall params error " + std::to_string(row(v, "params").error));
  EXPECT_EQ(over[1].rfind("ep_alltoall grads error -0.1", 0), 0u);
  // The dense GEMMs: the projection's attn_proj + ffn (at the run's share) over the run's 2 s.
  const OpTimes pr = projected_ops(p.tp);
  const double dp = 2 * (pr.f[kOpAttnProj] + pr.b[kOpAttnProj] + pr.f[kOpFfn] + pr.b[kOpFfn]);
  EXPECT_NEAR(v.dense_gemm_speed, dp / 2, 1e-12 * dp);
  // A time bound now holds the step too; the EP bound follows the layout's expert parallelism, not its name; a
  // layout without EP, 8 % off, takes the memory bound and is over it.
  const LayoutValidation t = validate_layout(c, "tp2_cp2_pp2_ep2", 2, h, run, ValidationBounds{0.05, 0.10, 0.01});
  EXPECT_DOUBLE_EQ(row(t, "activations").bound, 0.10);
  EXPECT_FALSE(row(t, "step_s").over);
  const JobConfig cd = case_config("dp", 2);
  MeasuredRun rd = run;
  rd.activations = proj_max(project_by_hand(cd, 2, h, 1.0).mp, 3) / 1.08;
  const LayoutValidation t2 = validate_layout(cd, "ep_named", 2, h, rd, ValidationBounds{0.05, 0.10, 0.01});
  EXPECT_DOUBLE_EQ(row(t2, "activations").bound, 0.05);
  EXPECT_TRUE(row(t2, "activations").over);
}

// The report's lines and JSON for the layout above.
TEST(Validate, ReportLinesAndJson) {
  const JobConfig c = case_config("ep_alltoall", 2);
  const Hardware h = plantest::round_gpu();
  const Proj p = project_by_hand(c, 2, h, 1.2);
  MeasuredRun run;
  run.params = proj_max(p.mp, 0) / 1.1;
  run.grads = run.optimizer = run.activations = 1;
  run.cpu_share = 0.5, run.step_s = 1;
  run.ep_rows_peak = 1.2, run.ep_rows_held = 1.3;
  run.step_runs = {1, 1.25};
  const LayoutValidation v = validate_layout(c, "ep_alltoall", 2, h, run, ValidationBounds{});
  EXPECT_EQ(validation_header(), "layout           figure         measured    projected    error\n");
  const std::string text = format_validation(v, false);
  EXPECT_NE(text.find("ep_alltoall      params     "), std::string::npos);
  EXPECT_NE(text.find("  +10.0%\nep_alltoall      grads"), std::string::npos);
  EXPECT_NE(text.find("ep_alltoall      CPU share during the run 0.50 (the smallest over ranks"), std::string::npos);
  EXPECT_NE(text.find("ep_alltoall      step time of each run: 1 1.25 s (the median's run is reported)\n"),
            std::string::npos);
  EXPECT_NE(text.find("ep rows: the most one dispatch brought 1.200 x balanced (projected with 1.200); the buffers "
                      "hold 1.300 x\n"),
            std::string::npos);
  EXPECT_EQ(text.find("attn_proj.fwd"), std::string::npos);  // op rows only with --ops
  const std::string with_ops = format_validation(v, true);
  EXPECT_NE(with_ops.find("ep_alltoall        attn_proj.fwd"), std::string::npos);
  EXPECT_NE(with_ops.find("ep_alltoall        loss "), std::string::npos);  // the fused loss: one row
  EXPECT_EQ(with_ops.find("loss.fwd"), std::string::npos);
  EXPECT_EQ(v.ops.size(), size_t(2 * (kNumPlanOps - 1) + 1 + kNumStepParts));

  const nlohmann::json j = to_json(v);
  EXPECT_EQ(j["layout"], "ep_alltoall");
  EXPECT_NEAR(j["params"]["error"].get<double>(), 0.1, 1e-12);
  EXPECT_EQ(j["step_s"]["runs"].size(), 2u);
  EXPECT_DOUBLE_EQ(j["step_s"]["projected_full_share"].get<double>(), p.tp.step_time);
  EXPECT_DOUBLE_EQ(j["ep_imbalance"]["held"].get<double>(), 1.3);
  EXPECT_TRUE(j["ops"].contains("ep_comm"));
  EXPECT_DOUBLE_EQ(j["cpu_share"].get<double>(), 0.5);
  const nlohmann::json doc = validation_json(2, h, "# calibration\n", {v});
  EXPECT_EQ(doc["world"], 2);
  EXPECT_EQ(doc["calibration"], "# calibration\n");
  EXPECT_EQ(doc["layouts"].size(), 1u);
  EXPECT_EQ(doc["hardware"], hardware_to_toml(h));
  // Without EP: no imbalance in the JSON nor the EP line in the text.
  const LayoutValidation s = validate_layout(case_config("single", 1), "single", 1, h, run, ValidationBounds{});
  EXPECT_FALSE(to_json(s).contains("ep_imbalance"));
  EXPECT_EQ(format_validation(s, false).find("ep rows"), std::string::npos);
}
