// test_analyze.cpp: `trace analyze` on hand-built traces whose every figure is counted by hand in the comments:
// each term of the breakdown (compute, exposed communication, idle) and overlapped communication that is not
// exposed; a late rank shows as wait on the others and is the straggler; all-to-all matrix and imbalance; the
// pipeline bubble against pp_vis's own derive_stats; roofline verdicts; the hierarchy; multi-step averaging.
#include <gtest/gtest.h>

#include "trace_builder.h"
#include "tracefile/analyze.h"
#include "viz/ppvis.h"

using namespace moetron::tracefile;
using tracetest::RankBuilder;
using tracetest::trace_of;

namespace {
constexpr double us = 1e-6;
}

// One rank, step [0, 100) us:
//   track 0: kernel A [10,40); kernel B [50,70) holding kernel C [55,60); all_to_all [80,90);
//            kernel D [92,96) holding a barrier [93,95) (D waits on it: not compute)
//   track 1: all_reduce [30,60) beside A (30..40) and B (50..60): exposed only over [40,50)
// compute = 30 + 20 + (4 - 2) = 52; exposed = 10 (all_reduce) + 10 (all_to_all) + 2 (barrier) = 22;
// idle = 100 - 52 - 22 = 26; comm (union) = 30 + 10 + 2 = 42.
TEST(TraceAnalyze, BreakdownTermsAreHandCountedAndOverlappedCommIsNotExposed) {
  RankBuilder r(0, 1);
  r.group("w", "world", {0}).step(0, 0, 100);
  r.kernel("A", 10, 30).kernel("B", 50, 20).kernel("C", 55, 5).comm("all_to_all", "w", 0, 80, 10);
  r.kernel("D", 92, 4).comm("barrier", "w", 1, 93, 2);
  r.comm("all_reduce", "w", 2, 30, 30, 1000, 1);
  const Analysis a = analyze(trace_of({r}));
  ASSERT_EQ(a.ranks.size(), 1u);
  const RankBreakdown& b = a.ranks[0];
  EXPECT_NEAR(b.step_time_s, 100 * us, 1e-15);
  EXPECT_NEAR(b.compute_s, 52 * us, 1e-15);
  EXPECT_NEAR(b.exposed_comm_s, 22 * us, 1e-15);
  EXPECT_NEAR(b.idle_s, 26 * us, 1e-15);
  EXPECT_NEAR(b.comm_s, 42 * us, 1e-15);
  EXPECT_NEAR(b.exposed_comm_by_kind.at("all_reduce"), 10 * us, 1e-15);
  EXPECT_NEAR(b.exposed_comm_by_kind.at("all_to_all"), 10 * us, 1e-15);
  EXPECT_NEAR(b.exposed_comm_by_kind.at("barrier"), 2 * us, 1e-15);
  EXPECT_NEAR(b.compute_by_kernel.at("A"), 30 * us, 1e-15);
  EXPECT_NEAR(b.compute_by_kernel.at("B"), 15 * us, 1e-15);  // C's 5 us are C's
  EXPECT_NEAR(b.compute_by_kernel.at("C"), 5 * us, 1e-15);
  EXPECT_NEAR(b.compute_by_kernel.at("D"), 2 * us, 1e-15);
  // Kernel self times: B without C, D without its barrier.
  std::map<std::string, double> self;
  for (const KernelStat& k : a.kernels) self[k.name] = k.total_s;
  EXPECT_NEAR(self.at("B"), 15 * us, 1e-15);
  EXPECT_NEAR(self.at("D"), 2 * us, 1e-15);
  EXPECT_EQ(a.kernels[0].name, "A");  // largest first
  EXPECT_EQ(a.straggler_rank, -1);    // one member: nothing to wait for
}

// Exposed communication split by the parallelism of its group (the name up to its first '.'). One rank, step
// [0, 100) us: kernel [0, 20); tp all-gather [20, 30) exposed; cp send [30, 45) exposed, with a kernel [40, 60) over
// its last 5 us; an ep.1 (dispatcher) all-to-all [60, 68) and a dp all-reduce [70, 90), both exposed.
// tp 10, cp 10, ep 8, dp 20: the four add up to the exposed 48 us.
TEST(TraceAnalyze, ExposedCommunicationIsSplitByParallelism) {
  RankBuilder r(0, 1);
  r.group("t", "tp", {0}).group("c", "cp", {0}).group("e", "ep.1", {0}).group("d", "dp", {0}).step(0, 0, 100);
  r.kernel("A", 0, 20).comm("all_gather", "t", 0, 20, 10).comm("send", "c", 0, 30, 15).kernel("B", 40, 20);
  r.comm("all_to_all", "e", 0, 60, 8).comm("all_reduce", "d", 0, 70, 20);
  const RankBreakdown b = analyze(trace_of({r})).ranks.at(0);
  EXPECT_NEAR(b.exposed_comm_s, 48 * us, 1e-15);
  EXPECT_NEAR(b.exposed_comm_by_group.at("tp"), 10 * us, 1e-15);
  EXPECT_NEAR(b.exposed_comm_by_group.at("cp"), 10 * us, 1e-15);
  EXPECT_NEAR(b.exposed_comm_by_group.at("ep"), 8 * us, 1e-15);
  EXPECT_NEAR(b.exposed_comm_by_group.at("dp"), 20 * us, 1e-15);
  EXPECT_EQ(b.exposed_comm_by_group.size(), 4u);
}

// Three ranks all-reduce twice on group g (bytes_in 1 MB each time).
//   seq 0: rank 0 [100,400) 300 us, rank 1 [200,400) 200 us, rank 2 (late) [350,400) 50 us
//          transfer 50; waits 250, 150, 0; rank 2 caused 400 us
//   seq 1: rank 0 [500,560) 60, rank 1 (late) [540,560) 20, rank 2 [500,560) 60
//          transfer 20; waits 40, 0, 40; rank 1 caused 80 us
// straggler = rank 2. all_reduce: bytes 2 MB over transfer 70 us -> algbw 2e6 / 70e-6; busbw x 2 * 2/3.
TEST(TraceAnalyze, LateRankShowsAsWaitOnTheOthersAndIsTheStraggler) {
  std::vector<RankBuilder> rs;
  const double start0[3] = {100, 200, 350}, start1[3] = {500, 540, 500};
  for (int r = 0; r < 3; ++r) {
    RankBuilder b(r, 3);
    b.group("g", "dp", {0, 1, 2}).step(0, 0, 1000);
    b.comm("all_reduce", "g", 0, start0[r], 400 - start0[r], 1e6);
    b.comm("all_reduce", "g", 1, start1[r], 560 - start1[r], 1e6);
    rs.push_back(b);
  }
  const Analysis a = analyze(trace_of(rs));
  EXPECT_EQ(a.straggler_rank, 2);
  EXPECT_EQ(a.matched_collectives, 2);
  EXPECT_EQ(a.unmatched_collectives, 0);
  EXPECT_NEAR(a.ranks[0].comm_wait_s, 290 * us, 1e-12);
  EXPECT_NEAR(a.ranks[1].comm_wait_s, 150 * us, 1e-12);
  EXPECT_NEAR(a.ranks[2].comm_wait_s, 40 * us, 1e-12);
  EXPECT_NEAR(a.ranks[2].wait_caused_s, 400 * us, 1e-12);
  EXPECT_NEAR(a.ranks[1].wait_caused_s, 80 * us, 1e-12);
  EXPECT_NEAR(a.ranks[0].wait_caused_s, 0, 1e-15);
  EXPECT_NEAR(a.ranks[0].exposed_comm_s, 360 * us, 1e-12);  // nothing computes: all of it is exposed
  ASSERT_EQ(a.collectives.size(), 1u);
  const CollectiveStat& c = a.collectives[0];
  EXPECT_EQ(c.kind, "all_reduce");
  EXPECT_EQ(c.group_name, "dp");
  EXPECT_EQ(c.group_size, 3);
  EXPECT_EQ(c.count, 2);
  EXPECT_NEAR(c.transfer_s, 70 * us, 1e-12);
  EXPECT_NEAR(c.wait_s, 480 * us, 1e-12);
  EXPECT_NEAR(c.time_s, c.wait_s + 3 * c.transfer_s, 1e-12);
  EXPECT_NEAR(c.algbw, 2e6 / 70e-6, 1e3);
  EXPECT_NEAR(c.busbw_factor, 4.0 / 3.0, 1e-12);
  EXPECT_NEAR(c.busbw, c.algbw * 4.0 / 3.0, 1e3);
}

TEST(TraceAnalyze, CollectiveMissingOnAMemberIsUnmatched) {
  std::vector<RankBuilder> rs;
  for (int r = 0; r < 2; ++r) {
    RankBuilder b(r, 2);
    b.group("g", "dp", {0, 1}).step(0, 0, 100);
    b.comm("all_reduce", "g", 0, 10, 10, 8);
    if (r == 0) b.comm("all_reduce", "g", 1, 30, 10, 8);  // rank 1 never ran seq 1 (e.g. dropped events)
    rs.push_back(b);
  }
  const Analysis a = analyze(trace_of(rs));
  EXPECT_EQ(a.matched_collectives, 1);
  EXPECT_EQ(a.unmatched_collectives, 1);
  EXPECT_FALSE(a.warnings.empty());
}

// EP group of three ranks, two all-to-alls (send_bytes per destination):
//   call 0: r0 [0,100,200] r1 [300,0,100] r2 [600,300,0] -> sent 300, 400, 900: max / mean = 900 / 533.3 = 1.6875
//   call 1: every rank sends 100 to each other rank      -> 200 each: 1.0
// matrix = [0,200,300; 400,0,200; 700,400,0]; sent 500, 600, 1100: imbalance 1100 / 733.3 = 1.5;
// per call mean (1.6875 + 1) / 2 = 1.34375, worst 1.6875.
TEST(TraceAnalyze, AllToAllMatrixAndImbalance) {
  const std::vector<std::vector<double>> call0 = {{0, 100, 200}, {300, 0, 100}, {600, 300, 0}};
  const std::vector<std::vector<double>> call1 = {{0, 100, 100}, {100, 0, 100}, {100, 100, 0}};
  std::vector<RankBuilder> rs;
  for (int r = 0; r < 3; ++r) {
    RankBuilder b(r, 3);
    b.group("ep0", "ep", {0, 1, 2}).step(0, 0, 100);
    b.a2a("ep0", 0, 10, 10, call0[size_t(r)]).a2a("ep0", 1, 30, 10, call1[size_t(r)]);
    rs.push_back(b);
  }
  const Analysis a = analyze(trace_of(rs));
  ASSERT_EQ(a.all_to_all.size(), 1u);
  const AllToAllStat& t = a.all_to_all[0];
  EXPECT_EQ(t.count, 2);
  const std::vector<std::vector<double>> want = {{0, 200, 300}, {400, 0, 200}, {700, 400, 0}};
  EXPECT_EQ(t.matrix, want);
  EXPECT_EQ(t.sent, (std::vector<double>{500, 600, 1100}));
  EXPECT_EQ(t.received, (std::vector<double>{1100, 600, 500}));
  EXPECT_NEAR(t.imbalance, 1.5, 1e-12);
  EXPECT_NEAR(t.imbalance_mean, 1.34375, 1e-12);
  EXPECT_NEAR(t.imbalance_max, 1.6875, 1e-12);
  // all_to_all bytes: the mean over members of bytes_in; call 0: (300+400+900)/3, call 1: 200.
  ASSERT_EQ(a.collectives.size(), 1u);
  EXPECT_NEAR(a.collectives[0].bytes, 1600.0 / 3 + 200, 1e-9);
  EXPECT_NEAR(a.collectives[0].busbw_factor, 2.0 / 3.0, 1e-12);
}

// Two pipeline ranks. Rank 0: step [0,100), actions [0,10) [10,20) [40,60) [60,80), optimizer kernel [85,95)
// after them; rank 1: step [5,100), actions [10,20) [20,40) [45,50) [50,70).
// Span = earliest step start (0) to the latest action end (80) = 80 us.
// busy 0 = 60 -> bubble 0.25; busy 1 = 55 -> 0.3125; group 1 - 115 / 160 = 0.28125.
TEST(TraceAnalyze, PipelineBubbleIsPpVisMeasure) {
  RankBuilder r0(0, 2), r1(1, 2);
  for (RankBuilder* b : {&r0, &r1}) b->group("pp0", "pp", {0, 1});
  r0.step(0, 0, 100).action("F", 0, 10, 0).action("F", 10, 10, 1).action("B", 40, 20, 0).action("B", 60, 20, 1);
  r0.kernel("optimizer", 85, 10);
  r1.step(0, 5, 95).action("F", 10, 10, 0, 1).action("B", 20, 20, 0, 1).action("F", 45, 5, 1, 1);
  r1.action("B", 50, 20, 1, 1);
  const Analysis a = analyze(trace_of({r0, r1}));
  ASSERT_EQ(a.pipeline.size(), 1u);
  const PipelineGroup& g = a.pipeline[0];
  EXPECT_EQ(g.group, "pp0");
  ASSERT_EQ(g.ranks.size(), 2u);
  EXPECT_NEAR(g.ranks[0].bubble, 0.25, 1e-12);
  EXPECT_NEAR(g.ranks[1].bubble, 0.3125, 1e-12);
  EXPECT_NEAR(g.ranks[0].span_s, 80 * us, 1e-15);
  EXPECT_NEAR(g.bubble, 0.28125, 1e-12);

  // pp_vis's own statistics of the same blocks (times from the span's start) give the same bubbles.
  namespace viz = moetron::viz;
  viz::Timeline tl;
  tl.pp = 2, tl.microbatches = 2;
  tl.step_time = 80;
  tl.ranks.resize(2);
  tl.ranks[0].rank = 0, tl.ranks[1].rank = 1;
  auto blk = [](viz::Kind k, int mb, double s, double e) { return viz::Block{k, 0, 0, mb, s, e, false}; };
  tl.ranks[0].blocks = {blk(viz::Kind::F, 0, 0, 10), blk(viz::Kind::F, 1, 10, 20), blk(viz::Kind::B, 0, 40, 60),
                        blk(viz::Kind::B, 1, 60, 80)};
  tl.ranks[1].blocks = {blk(viz::Kind::F, 0, 10, 20), blk(viz::Kind::B, 0, 20, 40), blk(viz::Kind::F, 1, 45, 50),
                        blk(viz::Kind::B, 1, 50, 70)};
  viz::derive_stats(tl);
  EXPECT_NEAR(g.ranks[0].bubble, tl.ranks[0].bubble_ratio, 1e-12);
  EXPECT_NEAR(g.ranks[1].bubble, tl.ranks[1].bubble_ratio, 1e-12);
  EXPECT_NEAR(g.bubble, tl.bubble_ratio, 1e-12);
}

// Limits 100 GFLOP/s and 10 GB/s: ridge 10 FLOP/B.
//   gemm: 1000 us, 5e7 FLOP, 1e6 B -> 50 FLOP/B, compute-bound, 5e10 FLOP/s = 50 % of the limit
//   norm: 100 us, 1e5 FLOP, 5e5 B -> 0.2 FLOP/B, memory-bound, 5e9 B/s = 50 % of the limit
//   misc: no FLOPs, no bytes -> unknown
TEST(TraceAnalyze, RooflineVerdicts) {
  RankBuilder r(0, 1);
  r.limits(100e9, 10e9).step(0, 0, 2000);
  r.kernel("gemm", 0, 1000, 5e7, 1e6).kernel("norm", 1000, 100, 1e5, 5e5).kernel("misc", 1100, 10);
  const Analysis a = analyze(trace_of({r}));
  std::map<std::string, KernelStat> k;
  for (const KernelStat& s : a.kernels) k[s.name] = s;
  EXPECT_EQ(k["gemm"].bound, "compute");
  EXPECT_NEAR(k["gemm"].flops_per_s, 5e10, 1);
  EXPECT_NEAR(k["gemm"].intensity, 50, 1e-12);
  EXPECT_NEAR(k["gemm"].limit_share, 0.5, 1e-9);
  EXPECT_EQ(k["norm"].bound, "memory");
  EXPECT_NEAR(k["norm"].bytes_per_s, 5e9, 1);
  EXPECT_NEAR(k["norm"].limit_share, 0.5, 1e-9);
  EXPECT_EQ(k["misc"].bound, "unknown");
  // Other limits (a planner hardware file): 1 TFLOP/s, 1 GB/s, ridge 1000: gemm turns memory-bound at 1e9 B/s.
  AnalyzeOptions o;
  o.limits = Limits{1e12, 1e9, "bf16", "hardware file x"};
  const Analysis b = analyze(trace_of({r}), o);
  for (const KernelStat& s : b.kernels)
    if (s.name == "gemm") {
      EXPECT_EQ(s.bound, "memory");
      EXPECT_NEAR(s.limit_share, 1.0, 1e-9);
    }
  // No limits at all: achieved rates, verdict unknown.
  RankBuilder n(0, 1);
  n.step(0, 0, 2000).kernel("gemm", 0, 1000, 5e7, 1e6);
  const Analysis c = analyze(trace_of({n}));
  EXPECT_EQ(c.kernels[0].bound, "unknown");
  EXPECT_NEAR(c.kernels[0].flops_per_s, 5e10, 1);
}

// step [0,100) > F [0,60) > layer0.attn [0,30) > attn.core [5,25) ; F > layer0.moe [30,60) > experts [30,50)
//   > all_to_all [50,58); then the optimizer module [70,90) > adamw [70,90).
TEST(TraceAnalyze, HierarchyStepActionModuleKernel) {
  RankBuilder r(0, 1);
  r.group("w", "world", {0}).step(0, 0, 100).action("F", 0, 60).module("layer0.attn", 0, 30, 0);
  r.kernel("attn.core", 5, 20).module("layer0.moe", 30, 30, 0).kernel("experts", 30, 20);
  r.comm("all_to_all", "w", 0, 50, 8).module("optimizer", 70, 20).kernel("adamw", 70, 20);
  const Analysis a = analyze(trace_of({r}));
  std::map<std::string, HierNode> n;
  for (const HierNode& h : a.hierarchy[0]) n[h.path] = h;
  ASSERT_TRUE(n.count("step/F/layer0.moe/experts"));
  EXPECT_EQ(n["step"].depth, 0);
  EXPECT_NEAR(n["step"].total_s, 100 * us, 1e-15);
  EXPECT_NEAR(n["step"].self_s, 20 * us, 1e-15);  // 100 - F 60 - optimizer 20
  EXPECT_NEAR(n["step/F"].self_s, 0, 1e-15);
  EXPECT_NEAR(n["step/F/layer0.attn"].self_s, 10 * us, 1e-15);
  EXPECT_NEAR(n["step/F/layer0.moe"].self_s, 2 * us, 1e-15);  // 30 - 20 - 8
  EXPECT_EQ(n["step/F/layer0.moe/all_to_all"].cat, Cat::Comm);
  EXPECT_EQ(n["step/optimizer/adamw"].depth, 2);
  // Depth-first: the step first, then F (60) before the optimizer (20).
  EXPECT_EQ(a.hierarchy[0][0].path, "step");
  EXPECT_EQ(a.hierarchy[0][1].path, "step/F");
  EXPECT_NEAR(a.ranks[0].action_s.at("F"), 60 * us, 1e-15);
}

// Two steps of 100 and 200 us with 50 and 150 us of compute: per-step means 150 / 100 / 50.
TEST(TraceAnalyze, FiguresArePerStepMeans) {
  RankBuilder r(0, 1);
  r.step(0, 0, 100).kernel("k", 0, 50).step(1, 100, 200).kernel("k", 100, 150);
  r.kernel("k", 400, 999);  // outside every step: not counted
  const Analysis a = analyze(trace_of({r}));
  EXPECT_EQ(a.steps, 2);
  EXPECT_NEAR(a.ranks[0].step_time_s, 150 * us, 1e-15);
  EXPECT_NEAR(a.ranks[0].compute_s, 100 * us, 1e-15);
  EXPECT_NEAR(a.ranks[0].idle_s, 50 * us, 1e-15);
  EXPECT_EQ(a.kernels[0].count, 2);
  EXPECT_NEAR(a.kernels[0].per_rank_step_s, 100 * us, 1e-15);
}

TEST(TraceAnalyze, JsonHasTheDocumentedKeys) {
  RankBuilder r(0, 1);
  r.group("w", "world", {0}).step(0, 0, 100).kernel("k", 0, 50).comm("all_reduce", "w", 0, 50, 10, 64);
  const nlohmann::json j = to_json(analyze(trace_of({r})));
  for (const char* k : {"rank", "step_time_s", "compute_s", "exposed_comm_s", "idle_s"})
    EXPECT_TRUE(j["ranks"][0].contains(k)) << k;
  EXPECT_TRUE(j["top_kernels"].is_array());
  EXPECT_TRUE(j["collectives"].is_array());
  EXPECT_TRUE(j.contains("straggler_rank"));
  EXPECT_EQ(j["straggler_rank"], -1);
  EXPECT_NEAR(j["ranks"][0]["compute_s"].get<double>(), 50 * us, 1e-15);
  EXPECT_NE(format_text(analyze(trace_of({r}))).find("breakdown per rank"), std::string::npos);
}
