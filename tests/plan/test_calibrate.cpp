// tests/plan/test_calibrate.cpp: the calibration's fit (plan/calibrate.h) on hand-made rounds (calib::Round): the
// curve points against the first reference and their re-basing on the achievable rate, the clamps, the rates per
// byte and per parameter, the one-rank assumptions and the two-rank alpha-beta with the bandwidth fitted to the
// all-reduce, the comment lines word for word, the medians over rounds and the header of the TOML. Every figure is
// a hand computation from round numbers. Not the measuring (the engine's, tools/ and src/calib/).
#include <gtest/gtest.h>

#include "../unit/test_util.h"

#include <string>
#include <vector>

#include "moetron/calib_round.h"
#include "moetron/plan/calibrate.h"
#include "moetron/plan/comm_model.h"
#include "moetron/plan/hardware.h"

using namespace moetron;
using namespace moetron::plan;

namespace {

using moetron::testing::error_of;

// One rank, fp32, round numbers. The first reference is 100 GFLOPS and the median of {100, 80, 120} is 100 too, so
// every fraction below is the hand quotient x / 100 GFLOPS unless a test changes the references.
calib::Round round_one_rank() {
  calib::Round r;
  r.cpu = "Test CPU";
  r.ranks = 1, r.local_ranks = 2, r.threads = 4, r.bf16 = false;
  r.mem_total_bytes = 64e9;
  r.cpu_share = 0.9;
  r.big = 512;
  r.reference = {100e9, 80e9, 120e9};
  r.skinny = {{8, 10e9}, {64, 50e9}};
  r.check_m = 256, r.check_cold = 70e9, r.check_hot = 90e9;
  // te 4: 1 GFLOP forward in 0.1 s = 10 GFLOPS (0.1); backward 2 GFLOP in 0.4 s = 5 GFLOPS (0.05).
  // te 64: 4 GFLOP in 0.05 s = 80 GFLOPS (0.8); 8 GFLOP in 0.1 s (0.8).
  // te 256: 10 GFLOP in 0.05 s = 200 GFLOPS (2.0, clamped to 1); backward 20 GFLOP in 1e4 s (2e-5, clamped to 0.001).
  r.grouped = {{4, 1e9, 0.1, 0.4}, {64, 4e9, 0.05, 0.1}, {256, 10e9, 0.05, 1e4}};
  r.kernel_overhead_s = 5e-6;
  // 3 x 1 GFLOP in 0.06 s = 50 GFLOPS (0.5); 3 x 2 GFLOP in 0.1 s = 60 GFLOPS (0.6, the scalar: the longest).
  r.attention = {{128, 1e9, 0.06}, {512, 2e9, 0.1}};
  r.loss_flops = 6e9, r.loss_s = 0.2;  // 30 GFLOPS: 0.3
  // norm: 3 x 1 MB in 100 us (30 GB/s); swiglu: 3 x 2 MB in 300 us (20 GB/s); together 9 MB in 400 us.
  r.memory_bound = {{"norm", 1e6, 1e-4}, {"swiglu", 2e6, 3e-4}};
  r.optimizer_params = 1e6, r.adamw_s = 2e-3, r.grad_norm_s = 4e-4, r.zero_s = 2e-4;
  r.pack_params = 2e6, r.pack_s = 1e-3, r.pack_fused_s = 6e-4;
  r.copy_bytes = 16e6, r.copy_s = 2e-3;  // 32 MB moved in 2 ms: 16 GB/s
  return r;
}

// Two ranks: 8 B ping-pong round trip 4 us (alpha 2 us one way), 8 MiB round trip 2 ms + 4 us (1 ms beyond alpha:
// 8.388608 GB/s); 16 MiB all-reduce segments in 4 ms beyond the ring's latency 2 (p - 1) alpha = 4 us.
calib::Round round_two_ranks() {
  calib::Round r = round_one_rank();
  r.ranks = 2;
  r.pingpong_small_bytes = 8, r.pingpong_small_s = 4e-6;
  r.pingpong_large_bytes = double(8 << 20), r.pingpong_large_s = 2e-3 + 4e-6;
  r.all_reduce_elements = double(int64_t(1) << 22), r.all_reduce_s = 4e-3 + 4e-6;
  r.all_gather_s = 2e-3 + 2e-6, r.reduce_scatter_s = 4e-3 + 2e-6;  // one ring pass of 16 MiB plus (p - 1) alpha
  r.all_to_all_bytes = double(4 << 20), r.all_to_all_s = 1e-3;
  return r;
}

void expect_curve(const std::vector<EffPoint>& got, const std::vector<EffPoint>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_DOUBLE_EQ(got[i].dim, want[i].dim) << "point " << i;
    EXPECT_NEAR(got[i].eff, want[i].eff, 1e-12) << "point " << i;
  }
}

}  // namespace

TEST(Calibrate, Median) {
  EXPECT_DOUBLE_EQ(median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(median({4, 1, 3, 2}), 2.5);  // an even count: the mean of the middle two
  EXPECT_DOUBLE_EQ(median({7}), 7);
  EXPECT_NE(error_of([] { median({}); }), "");
}

// The cube's median (100) beats every skinny point: the achievable rate is 100 GFLOPS and the fractions stay the
// hand quotients, clamped to [0.001, 1].
TEST(Calibrate, OneRoundCurvesAgainstTheReference) {
  const Hardware h = hardware_from_round(round_one_rank());
  EXPECT_EQ(h.name, "this_machine");
  EXPECT_EQ(h.description, "this machine (Test CPU), one rank's share: fp32 compute");
  EXPECT_DOUBLE_EQ(h.achievable_bf16, 100e9);
  EXPECT_DOUBLE_EQ(h.peak_bf16, 100e9);
  EXPECT_DOUBLE_EQ(h.achievable_fp8, 0);
  expect_curve(h.gemm_efficiency, {{8, 0.1}, {64, 0.5}, {512, 1.0}});
  expect_curve(h.grouped_fwd_efficiency, {{4, 0.1}, {64, 0.8}, {256, 1.0}});
  expect_curve(h.grouped_bwd_efficiency, {{4, 0.05}, {64, 0.8}, {256, 0.001}});
  expect_curve(h.attention_seq_efficiency, {{128, 0.5}, {512, 0.6}});
  EXPECT_NEAR(h.attention_efficiency, 0.6, 1e-12);
  EXPECT_NEAR(h.loss_efficiency, 0.3, 1e-12);
  EXPECT_DOUBLE_EQ(h.kernel_overhead, 5e-6);
}

// A skinny GEMM at 150 GFLOPS and references {100, 140} (the upper middle, 140, is their median): the achievable
// rate is the best measured, 150 GFLOPS; every fraction of the first reference (100) is re-based by 100 / 150.
TEST(Calibrate, OneRoundRebasedOnTheBestGemm) {
  calib::Round r = round_one_rank();
  r.reference = {100e9, 140e9};
  r.skinny = {{8, 10e9}, {64, 150e9}};
  const Hardware h = hardware_from_round(r);
  EXPECT_NEAR(h.achievable_bf16, 150e9, 1e-3);
  expect_curve(h.gemm_efficiency, {{8, 10.0 / 150}, {64, 1.0}, {512, 140.0 / 150}});
  expect_curve(h.grouped_fwd_efficiency, {{4, 10.0 / 150}, {64, 80.0 / 150}, {256, 1.0}});
  expect_curve(h.attention_seq_efficiency, {{128, 50.0 / 150}, {512, 60.0 / 150}});
  EXPECT_NEAR(h.attention_efficiency, 60.0 / 150, 1e-12);
  EXPECT_NEAR(h.loss_efficiency, 30.0 / 150, 1e-12);
}

// Bytes and parameters: the memory-bound kernels' bytes (3 x the forward's) over their time, per-parameter times,
// the copy's bandwidth (read + write), the node's memory over its ranks; one rank: the message assumptions.
TEST(Calibrate, OneRoundRatesAndOneRankMessages) {
  const Hardware h = hardware_from_round(round_one_rank());
  EXPECT_NEAR(h.elementwise_bw, 9e6 / 4e-4, 1);  // 22.5 GB/s
  EXPECT_NEAR(h.optimizer_per_param, 2e-9, 1e-21);
  EXPECT_NEAR(h.grad_norm_per_param, 4e-10, 1e-21);
  EXPECT_NEAR(h.expert_pack_per_param, 5e-10, 1e-21);
  EXPECT_NEAR(h.expert_pack_fused_per_param, 3e-10, 1e-21);
  EXPECT_NEAR(h.hbm_bw, 16e9, 1);
  EXPECT_DOUBLE_EQ(h.hbm_efficiency, 1.0);
  EXPECT_DOUBLE_EQ(h.hbm_bytes, 32e9);  // 64 GB over 2 local ranks
  EXPECT_EQ(h.scale_up.domain, 1);
  EXPECT_EQ(h.scale_up.topology, "switch");
  EXPECT_DOUBLE_EQ(h.scale_up.alpha, 1e-6);
  EXPECT_NEAR(h.scale_up.bw, 8e9, 1);  // half the copy bandwidth
  EXPECT_EQ(h.scale_out.domain, 1 << 20);
  EXPECT_DOUBLE_EQ(h.scale_out.alpha, h.scale_up.alpha);
  EXPECT_DOUBLE_EQ(h.scale_out.bw, h.scale_up.bw);
  EXPECT_EQ(h.sources.at("scale_up.alpha_us"), "one rank: no message measured (assumption: 1 us)");
  EXPECT_EQ(h.sources.at("scale_up.bw_gbps"), "one rank: no message measured (half the copy bandwidth)");
  EXPECT_EQ(h.sources.at("hbm_gb"), "MemTotal of /proc/meminfo over the ranks on this node");
  EXPECT_EQ(h.sources.at("scale_out.bw_gbps"), "one node: the scale-up figures");
  EXPECT_EQ(h.sources.at("gemm_efficiency"),
            "measured by `moetron plan calibrate` on Test CPU, 1 rank(s) at once, 4 thread(s) each");
}

// Two ranks: alpha is the small message's one-way time; the point-to-point bandwidth the large message's bytes
// over its time beyond that; the collective bandwidth the ring all-reduce's bytes, 2 (p - 1) / p x 16 MiB, over
// the measured time less 2 (p - 1) alpha, here below the point-to-point one.
TEST(Calibrate, TwoRanksAlphaBetaFittedToTheAllReduce) {
  const Hardware h = hardware_from_round(round_two_ranks());
  EXPECT_NEAR(h.scale_up.alpha, 2e-6, 1e-15);
  const double ring = 2.0 * 1 / 2 * 4.0 * double(int64_t(1) << 22);  // 16 MiB
  EXPECT_NEAR(h.scale_up.bw, ring / 4e-3, 1e-3 * ring / 4e-3);
  EXPECT_DOUBLE_EQ(h.scale_out.bw, h.scale_up.bw);
  // The all-gather and the reduce-scatter, one ring pass each (half the all-reduce's bytes): their own fits, used
  // by the collectives of their kind (a plain all-reduce keeps bw).
  EXPECT_NEAR(h.scale_up.gather_bw, ring / 2 / 2e-3, 1e-9 * ring);
  EXPECT_NEAR(h.scale_up.scatter_bw, ring / 2 / 4e-3, 1e-9 * ring);
  const Group g2{2, 2};
  EXPECT_NEAR(all_gather(h, ring, g2), 2e-3 + 2e-6, 1e-12);
  EXPECT_NEAR(reduce_scatter(h, ring, g2), 4e-3 + 2e-6, 1e-12);
  EXPECT_NEAR(all_reduce_ring(h, ring, g2), 4e-3 + 4e-6, 1e-12);
  EXPECT_EQ(h.scale_up.domain, 2);
  EXPECT_NE(h.sources.at("scale_up.bw_gbps").find("fitted to back-to-back 16 MiB all-reduces"), std::string::npos);
  EXPECT_EQ(h.sources.count("scale_up.alpha_us"), 1u);
  EXPECT_EQ(h.sources.at("scale_up.alpha_us").rfind("measured by", 0), 0u);

  // An all-reduce faster than the ping-pong implies: the fit may not raise the bandwidth above point-to-point.
  calib::Round fast = round_two_ranks();
  fast.all_reduce_s = 1e-3;
  const double p2p = double(8 << 20) / ((fast.pingpong_large_s - fast.pingpong_small_s) / 2);
  EXPECT_NEAR(hardware_from_round(fast).scale_up.bw, p2p, 1e-6 * p2p);
  // One no longer than the latency: nothing to fit, the point-to-point figure stays.
  calib::Round instant = round_two_ranks();
  instant.all_reduce_s = 4e-6;
  EXPECT_NEAR(hardware_from_round(instant).scale_up.bw, p2p, 1e-6 * p2p);
}

// The comment lines of one round, word for word from the hand figures.
TEST(Calibrate, OneRoundComments) {
  std::string c;
  hardware_from_round(round_one_rank(), &c);
  EXPECT_EQ(c,
            "# measured by `moetron plan calibrate` on Test CPU, 1 rank(s) at once, 4 thread(s) each\n"
            "# CPU share during the calibration: 0.90 (the smallest over ranks; 1 = no other process took these "
            "cores; every figure is scaled to a full share)\n"
            "# reference GEMM (512 cube) over the calibration: 3 samples, 80.0 to 120.0 GFLOPS (at a full share of "
            "the cores), median 100.0; achievable (the best GEMM measured) 100.0\n"
            "# dense GEMM 256 x 256 x 256: weight read cold 70.0 GFLOPS (the curve's convention), hot in the caches "
            "90.0\n"
            "# memory-bound kernels (forward + backward, the cost model's bytes over the time): norm 30.00 GB/s "
            "(100 us); swiglu 20.00 GB/s (300 us);\n"
            "# AdamW 2.00 ns/param; gradient norm 10.00 GB/s, zeroing 20.00 GB/s (read / write 4 B a parameter)\n");
}

// Two ranks add the fit and the collectives measured against the model (printed with the model's own figures).
TEST(Calibrate, TwoRanksCheckLines) {
  std::string c;
  const Hardware h = hardware_from_round(round_two_ranks(), &c);
  const Group g{2, 2};
  char want[800];
  std::snprintf(want, sizeof want,
                "# point-to-point 8.39 GB/s (8 MiB ping-pong), alpha 2.00 us (8 B); bw_gbps fitted to the all-reduce: "
                "4.19 GB/s; gather_bw_gbps 4.19, scatter_bw_gbps 2.10 (0: not measured)\n# check: all-reduce 16 MiB (one "
                "of a run of segments) measured 4.004 ms, model %.3f ms; all-gather 2.002 / %.3f ms, reduce-scatter "
                "4.002 / %.3f ms; all-to-all 4 MiB measured 1.000 ms, model %.3f ms\n",
                1e3 * all_reduce(h, 16.0 * 1024 * 1024, g), 1e3 * all_gather(h, 16.0 * 1024 * 1024, g),
                1e3 * reduce_scatter(h, 16.0 * 1024 * 1024, g), 1e3 * all_to_all(h, 4.0 * 1024 * 1024, g));
  ASSERT_GE(c.size(), std::string(want).size());
  EXPECT_EQ(c.substr(c.size() - std::string(want).size()), want);
}

// The ranks' drift (measure_skew): a curve point per segment (ms, fraction), a measured 0 kept at 1e-4 (a curve
// point must be > 0), a point not longer than the last dropped; one rank has none; rounds take the median.
TEST(Calibrate, TwoRanksRankSkewCurve) {
  calib::Round r = round_two_ranks();
  r.skew = {{2e-3, 0.05}, {16e-3, 0.02}, {12e-3, 0.5}, {64e-3, 0.0}};
  std::string c;
  const Hardware h = hardware_from_round(r, &c);
  expect_curve(h.rank_skew, {{2.0, 0.05}, {16.0, 0.02}, {64.0, 1e-4}});
  EXPECT_NE(c.find("# rank skew (the slowest rank's excess over the mean, same GEMMs on every rank, by segment): "
                   "2.0 ms 5.00 % 16.0 ms 2.00 % 64.0 ms 0.00 %\n"),
            std::string::npos)
      << c;
  EXPECT_DOUBLE_EQ(h.skew_fraction(2e-3), 0.05);
  EXPECT_DOUBLE_EQ(h.skew_fraction(1.0), 1e-4);  // clamped at the longest segment
  calib::Round one = round_one_rank();
  one.skew = r.skew;
  EXPECT_TRUE(hardware_from_round(one).rank_skew.empty());
  EXPECT_TRUE(hardware_from_round(round_two_ranks()).rank_skew.empty());
  calib::Round r2 = r, r3 = r;
  r2.skew[0].excess = 0.07, r3.skew[0].excess = 0.01;
  const Hardware m = combine_rounds({hardware_from_round(r), hardware_from_round(r2), hardware_from_round(r3)});
  EXPECT_DOUBLE_EQ(m.rank_skew[0].eff, 0.05);
  // The TOML keeps it.
  const Hardware back = hardware_from_toml(hardware_to_toml(h));
  expect_curve(back.rank_skew, h.rank_skew);
}

TEST(Calibrate, TwoRanksWaitOvershoot) {
  calib::Round r = round_two_ranks();
  r.wait_overshoot_s = 180e-6;
  std::string c;
  const Hardware h = hardware_from_round(r, &c);
  EXPECT_DOUBLE_EQ(h.wait_overshoot, 180e-6);
  EXPECT_NE(c.find("# wait overshoot (a partner 2 ms late, the late rank's exchange beyond one entered together): "
                   "180.0 us\n"),
            std::string::npos)
      << c;
  calib::Round one = round_one_rank();
  one.wait_overshoot_s = 180e-6;
  EXPECT_EQ(hardware_from_round(one).wait_overshoot, 0.0);  // one rank: no exchange measured
  calib::Round r2 = r, r3 = r;
  r2.wait_overshoot_s = 400e-6, r3.wait_overshoot_s = 90e-6;
  EXPECT_DOUBLE_EQ(combine_rounds({hardware_from_round(r), hardware_from_round(r2), hardware_from_round(r3)})
                       .wait_overshoot,
                   180e-6);
  EXPECT_NEAR(hardware_from_toml(hardware_to_toml(h)).wait_overshoot, 180e-6, 1e-12);
}

TEST(Calibrate, OneRoundRefusals) {
  calib::Round r = round_one_rank();
  r.reference.clear();
  EXPECT_NE(error_of([&] { hardware_from_round(r); }).find("reference GEMM"), std::string::npos);
  calib::Round bad = round_one_rank();
  bad.copy_s = -1;  // a negative bandwidth: validate_hardware names the key
  EXPECT_NE(error_of([&] { hardware_from_round(bad); }).find("hbm_bw"), std::string::npos);
}

// Three rounds with achievable rates 100, 120 and 110 GFLOPS: the median is 110. Each curve point is combined as
// its median absolute rate: the dense point {1.1, 1.0, 1.05} x {100, 120, 110} = {110, 120, 115.5} has median
// 115.5, above 110, so the achievable rate written is 115.5 and every point is that rate's fraction.
TEST(Calibrate, CombineRoundsMediansOfAbsoluteRates) {
  std::vector<Hardware> r(3);
  const double ach[3] = {100e9, 120e9, 110e9}, dense[3] = {1.1, 1.0, 1.05}, grouped[3] = {0.5, 0.25, 0.5};
  const double bw[3] = {10e9, 30e9, 20e9}, alpha[3] = {3e-6, 1e-6, 2e-6}, attn[3] = {0.5, 0.5, 0.4};
  for (int i = 0; i < 3; ++i) {
    r[size_t(i)].name = "round" + std::to_string(i);
    r[size_t(i)].achievable_bf16 = r[size_t(i)].peak_bf16 = ach[i];
    r[size_t(i)].gemm_efficiency = {{64, dense[i]}};
    r[size_t(i)].grouped_fwd_efficiency = {{4, grouped[i]}};
    r[size_t(i)].hbm_bw = bw[i];
    r[size_t(i)].scale_up.alpha = alpha[i];
    r[size_t(i)].attention_efficiency = attn[i];
    r[size_t(i)].loss_efficiency = 2.0;  // clamped to 1 after combining
  }
  const Hardware h = combine_rounds(r);
  EXPECT_EQ(h.name, "round2");  // the rest is the last round's
  EXPECT_NEAR(h.achievable_bf16, 115.5e9, 1e-3);
  EXPECT_DOUBLE_EQ(h.peak_bf16, h.achievable_bf16);
  expect_curve(h.gemm_efficiency, {{64, 1.0}});
  // grouped: {50, 30, 55} GFLOPS, median 50, over 115.5.
  expect_curve(h.grouped_fwd_efficiency, {{4, 50.0 / 115.5}});
  EXPECT_DOUBLE_EQ(h.hbm_bw, 20e9);
  EXPECT_DOUBLE_EQ(h.scale_up.alpha, 2e-6);
  // attention: {50, 60, 44} GFLOPS, median 50.
  EXPECT_NEAR(h.attention_efficiency, 50.0 / 115.5, 1e-12);
  EXPECT_DOUBLE_EQ(h.loss_efficiency, 1.0);
}

// Two rounds: even counts take the mean of the middle two.
TEST(Calibrate, CombineTwoRoundsMeanOfTheMiddle) {
  std::vector<Hardware> r(2);
  r[0].achievable_bf16 = 100e9, r[1].achievable_bf16 = 200e9;
  r[0].gemm_efficiency = r[1].gemm_efficiency = {{64, 0.5}};  // 50 and 100 GFLOPS: 75
  r[0].kernel_overhead = 2e-6, r[1].kernel_overhead = 4e-6;
  const Hardware h = combine_rounds(r);
  EXPECT_DOUBLE_EQ(h.achievable_bf16, 150e9);
  expect_curve(h.gemm_efficiency, {{64, 0.5}});
  EXPECT_DOUBLE_EQ(h.kernel_overhead, 3e-6);
  EXPECT_NE(error_of([] { combine_rounds({}); }), "");
}

// The rounds end to end: the header names every round's achievable rate and the one written, then the last
// round's comments; the hardware is the combination's. The second round's references are 20% faster.
TEST(Calibrate, CalibratedHardwareHeader) {
  calib::Round a = round_one_rank(), b = round_one_rank();
  for (double& x : b.reference) x *= 1.2;
  b.cpu = "Other CPU";
  std::string header, last;
  const Hardware h = calibrated_hardware({a, b}, &header);
  hardware_from_round(b, &last);
  EXPECT_NEAR(h.achievable_bf16, 110e9, 1e-3);  // the mean of 100 and 120
  EXPECT_EQ(header,
            "# 2 round(s), every figure the median over them (the comments below are the last round's); achievable "
            "GEMM rate per round: 100.0 120.0 GFLOPS, written 110.0\n" +
                last);
  EXPECT_NE(last.find("Other CPU"), std::string::npos);
  // The TOML the command writes reads back to the same figures.
  const Hardware back = hardware_from_toml(header + hardware_to_toml(h), "calibrated");
  EXPECT_NEAR(back.achievable_bf16, h.achievable_bf16, 1e-6 * h.achievable_bf16);
  ASSERT_EQ(back.grouped_bwd_efficiency.size(), h.grouped_bwd_efficiency.size());
  EXPECT_NEAR(back.elementwise_bw, h.elementwise_bw, 1e-6 * h.elementwise_bw);
  EXPECT_NE(error_of([] { calibrated_hardware({}); }).find("must lie in 1..50"), std::string::npos);
  EXPECT_NE(error_of([&] { calibrated_hardware(std::vector<calib::Round>(51, a)); }).find("must lie in 1..50"),
            std::string::npos);
}
