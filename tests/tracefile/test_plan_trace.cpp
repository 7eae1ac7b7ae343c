// test_plan_trace.cpp: the planner's projected step written as per-rank traces (plan/trace_export.h) reads
// back through `trace analyze`: one file per rank, every rank's step equals the written step, its compute is
// its stages' durations times the micro-batches (plus the optimizer) and its exposed communication at least its
// EP exchanges and exposed DP collective, the pipeline bubble is the simulator's, the EP exchange matches across
// ranks without wait, and a world above the cap is refused by name.
#include <gtest/gtest.h>

#include <filesystem>

#include "moetron/config.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/pipeline.h"
#include "moetron/plan/trace_export.h"
#include "tracefile/analyze.h"
#include "tracefile/reader.h"

using namespace moetron;

namespace {

JobConfig tiny(std::vector<std::string> ov) {
  return load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/ds_tiny.toml", ov);
}

// Round figures: 100 TFLOP/s, 1 TB/s, one 8-GPU switch at 100 GB/s.
plan::Hardware gpu() {
  plan::Hardware h;
  h.name = "round";
  h.hbm_bytes = 100e9;
  h.hbm_bw = 1e12;
  h.peak_bf16 = h.achievable_bf16 = 100e12;
  h.peak_fp8 = h.achievable_fp8 = 200e12;
  h.kernel_overhead = 1e-6;
  h.scale_up.domain = 8;
  h.scale_up.bw = 100e9;
  h.scale_up.alpha = 1e-6;
  h.scale_out.domain = 1 << 20;
  h.scale_out.bw = 10e9;
  h.scale_out.alpha = 5e-6;
  return h;
}

// Per global rank, what plan_time's stage durations say its trace must hold: compute = the micro-batches times
// its stages' F + I + W (no TP or CP here: every part of a stage's duration is a kernel) plus the optimizer, and
// the EP exchanges (whole, or beside compute under ep_overlap) plus the exposed DP collective as communication.
struct Expect {
  double compute = 0, exchange = 0;
};
Expect expected(const JobConfig& c, const plan::Layout& l, const plan::TimePlan& tp, int rank) {
  const auto sp = plan::stage_plan(c, l);
  const int64_t p = rank / (l.world() / l.pp);
  Expect e;
  for (int st : sp->rank_stages[size_t(p)]) {
    const plan::StageTime& x = tp.stages[size_t(st)];
    e.compute += double(l.microbatches) * (x.f + x.i + x.w);
    e.exchange += double(l.microbatches) * (x.a2a_f + x.a2a_b);
  }
  e.compute += tp.optimizer;
  e.exchange += tp.dp_exposed;
  return e;
}

std::string tmpdir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() / ("moetron_plantrace_" + name);
  std::filesystem::remove_all(p);
  return p.string();
}

}  // namespace

TEST(PlanTrace, PipelineWithExpertsReadsBackThroughAnalyze) {
  const JobConfig c = tiny({"--parallelism.pp=2", "--parallelism.ep=2", "--parallelism.dp_shard=2",
                            "--training.global_batch_size=32"});
  const plan::Hardware h = gpu();
  const plan::Layout l = plan::layout_from_config(c, 4);
  ASSERT_EQ(l.pp, 2);
  ASSERT_EQ(l.ep, 2);
  plan::TimeOptions o;
  const plan::TimePlan tp = plan::plan_time(c, l, h, o);
  const std::string dir = tmpdir("pp2_ep2");
  const plan::TraceExport x = plan::write_plan_trace(c, l, h, o, dir);
  EXPECT_EQ(x.files, 4);
  // Few micro-batches: plan_time simulated all of them, so the written step is plan_time's.
  EXPECT_NEAR(x.step_time, tp.step_time, 1e-12 * tp.step_time);

  const tracefile::Trace t = tracefile::read_dir(dir);
  ASSERT_EQ(t.world(), 4);
  EXPECT_EQ(t.ranks[0].meta.source, "planner");
  EXPECT_EQ(t.ranks[0].meta.limits.flops_per_s, 100e12);
  const tracefile::Analysis a = tracefile::analyze(t);
  EXPECT_EQ(a.steps, 1);
  for (const auto& r : a.ranks) {
    EXPECT_NEAR(r.step_time_s, tp.step_time, 1e-9 * tp.step_time) << "rank " << r.rank;
    const Expect e = expected(c, l, tp, r.rank);
    ASSERT_GT(e.compute, 0);
    ASSERT_GT(e.exchange, 0);
    EXPECT_NEAR(r.compute_s, e.compute, 1e-9 * e.compute) << "rank " << r.rank;
    // The EP exchange is not overlapped without ep_overlap: all of it is exposed, and the pipeline's receives
    // wait on top of it.
    EXPECT_GE(r.exposed_comm_s, e.exchange * (1 - 1e-9)) << "rank " << r.rank;
    EXPECT_GE(r.idle_s, 0);
    EXPECT_NEAR(r.comm_wait_s, 0, 1e-15);  // members of a group run the same timeline
  }
  EXPECT_EQ(a.straggler_rank, -1);
  EXPECT_EQ(a.unmatched_collectives, 0);
  EXPECT_GT(a.matched_collectives, 0);
  bool a2a = false;
  for (const auto& cs : a.collectives) a2a |= cs.kind == "all_to_all" && cs.group_name == "ep" && cs.group_size == 2;
  EXPECT_TRUE(a2a);
  // Two pipeline groups (one per DP slice of the pp ranks), each with the simulator's bubble.
  ASSERT_EQ(a.pipeline.size(), 2u);
  for (const auto& g : a.pipeline) {
    ASSERT_EQ(g.ranks.size(), 2u);
    EXPECT_NEAR(g.bubble, tp.bubble_ratio, 1e-9);
  }
  // The compute is what the stages cost: per rank, busy = its stages' (f + i + w) x micro-batches, plus exposed
  // EP; the GEMM kernel's time over all ranks is the stages' GEMM time (3 passes) x micro-batches x dp.
  double gemm = 0;
  for (const auto& st : tp.stages) gemm += st.gemm;
  for (const auto& k : a.kernels) {
    if (k.name == "plan.gemm") {
      EXPECT_NEAR(k.total_s, gemm * double(l.microbatches) * double(l.dp), 1e-9 * gemm);
    }
  }
}

TEST(PlanTrace, EpOverlapPutsTheExchangeBesideCompute) {
  const JobConfig c = tiny({"--parallelism.pp=2", "--parallelism.ep=2", "--parallelism.dp_shard=2",
                            "--parallelism.pp_schedule=interleaved_1f1b", "--parallelism.pp_virtual_stages=2",
                            "--parallelism.ep_overlap=true", "--model.n_layers=4", "--training.global_batch_size=64",
                            "--parallelism.ep_pair_backward=b"});
  const plan::Layout l = plan::layout_from_config(c, 4);
  ASSERT_TRUE(l.ep_overlap);
  const std::string dir = tmpdir("overlap");
  // Weight gradients run in their backward (ep_pair_backward = b). With them carried (the faster projection here) the
  // export still draws each backward's weight gradient inside the backward's action, past the action's end, where
  // the replay ran it in later waits: the drawn compute then overlaps itself and comes out short of the stages'.
  plan::TimeOptions o;
  plan::write_plan_trace(c, l, gpu(), o, dir);
  const plan::TimePlan tp = plan::plan_time(c, l, gpu(), o);
  ASSERT_FALSE(tp.carry_w);
  const tracefile::Analysis a = tracefile::analyze(tracefile::read_dir(dir));
  for (const auto& r : a.ranks) {
    const Expect e = expected(c, l, tp, r.rank);
    EXPECT_NEAR(r.compute_s, e.compute, 1e-9 * e.compute) << "rank " << r.rank;
    EXPECT_GT(r.comm_s, r.exposed_comm_s);  // some of the exchange hides behind the other half's compute
  }
}

// The split of unpaired chunks (parallelism.ep_overlap_split) is refused by name: the trace does not draw halves.
TEST(PlanTrace, EpOverlapSplitIsRefusedByName) {
  const JobConfig c = tiny({"--parallelism.pp=2", "--parallelism.ep=2", "--parallelism.dp_shard=2",
                            "--parallelism.pp_schedule=interleaved_1f1b", "--parallelism.pp_virtual_stages=2",
                            "--parallelism.ep_overlap=true", "--parallelism.ep_overlap_split=true",
                            "--model.n_layers=4", "--training.global_batch_size=64"});
  const plan::Layout l = plan::layout_from_config(c, 4);
  ASSERT_TRUE(l.ep_overlap_split);
  try {
    plan::write_plan_trace(c, l, gpu(), {}, tmpdir("split"));
    FAIL() << "the split layout was traced";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("--trace does not draw parallelism.ep_overlap_split"), std::string::npos)
        << e.what();
  }
}

TEST(PlanTrace, TooLargeAWorldIsRefused) {
  const JobConfig c = tiny({"--model.n_routed_experts=512", "--parallelism.ep=512", "--parallelism.dp_shard=512",
                           "--training.global_batch_size=2048"});
  const plan::Layout l = plan::layout_from_config(c, 512);
  try {
    plan::write_plan_trace(c, l, gpu(), {}, tmpdir("big"));
    FAIL() << "world 512 was written";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("--world 512 exceeds 256"), std::string::npos) << e.what();
  }
}
