// test_simulate.cpp: the lock-step and timed simulators and the closed bubble formula, against hand-derived
// numbers (step counts, bubble (p-1)/(m+p-1) of 1F1B and GPipe, peak in-flight m and pp - r, the extra time
// point-to-point latency adds on small pipelines, FB and all-to-all costs), a naive data-flow twin of the
// timed replay, and the seed documents' PP16 GA16 figures. Not the validator's messages (test_validate.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "sched_builders.h"

using namespace sched_test;

namespace {

std::string pct(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", 100.0 * x);
  return buf;
}

// Duration of a compute action, as the header specifies it (the twin's own copy).
double dur(const Durations& d, const Action& a) {
  const StageCost c = d.stage[size_t(a.stage)];
  switch (a.op) {
    case Op::F: return c.f + c.a2a_f;
    case Op::I: return c.i + c.a2a_b;
    case Op::B: return c.i + c.w + c.a2a_b;
    case Op::W: return c.w;
    case Op::FB: {
      const StageCost cb = d.stage[size_t(a.stage2)];
      return std::max(c.f + (a.op2 == Op::B ? cb.i + cb.w : cb.i), c.a2a_f + cb.a2a_b);
    }
    default: return 0;
  }
}

// Naive data-flow twin of the timed replay for a compute-only schedule whose lowering needs no reordering
// (GPipe, 1F1B): an action starts when its rank is free and each input is there, an input from another
// rank p2p after its producer ended. Sweeps the ranks until every end time is known. Returns end times per
// rank and action.
std::vector<std::vector<double>> twin(const Schedule& s, const Durations& d) {
  const int n = s.n_stages, m = s.n_microbatches;
  auto key = [&](int kind, int st, int mb) { return (size_t(st) * size_t(m) + size_t(mb)) * 3 + size_t(kind); };
  std::vector<double> done(size_t(n) * size_t(m) * 3, -1);  // kind 0 F, 1 B/I, 2 W
  std::vector<std::vector<double>> end(size_t(s.pp));
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < s.pp; ++r) {
      auto& e = end[size_t(r)];
      const auto& row = s.actions[size_t(r)];
      while (e.size() < row.size()) {
        const Action& a = row[e.size()];
        double start = e.empty() ? 0.0 : e.back();
        bool ready = true;
        auto need = [&](int kind, int st, int mb, bool cross) {
          const double t = done[key(kind, st, mb)];
          if (t < 0) ready = false;
          else start = std::max(start, t + (cross ? d.p2p : 0.0));
        };
        const Action halves[2] = {fwd_half(a), bwd_half(a)};
        for (int k = 0; k < (a.op == Op::FB ? 2 : 1); ++k) {
          const Action& h = halves[k];
          if (h.op == Op::F && h.stage > 0)
            need(0, h.stage - 1, h.mb, s.stage_rank[size_t(h.stage - 1)] != r);
          if (h.op == Op::B || h.op == Op::I) {
            need(0, h.stage, h.mb, false);
            if (h.stage < n - 1) need(1, h.stage + 1, h.mb, s.stage_rank[size_t(h.stage + 1)] != r);
          }
          if (h.op == Op::W) need(1, h.stage, h.mb, false);
        }
        if (!ready) break;
        const double fin = start + dur(d, a);
        for (int k = 0; k < (a.op == Op::FB ? 2 : 1); ++k) {
          const Action& h = halves[k];
          done[key(h.op == Op::F ? 0 : h.op == Op::W ? 2 : 1, h.stage, h.mb)] = fin;
        }
        e.push_back(fin);
        progress = true;
      }
    }
  }
  return end;
}

Durations uniform_for(const Schedule& s, double f, double b, double w, double p2p) {
  return Durations::uniform(s.n_stages, f, b, w, p2p);
}

}  // namespace

TEST(ScheduleLockstep, UnloweredStepCounts) {
  // Each F and B takes one step: both GPipe and 1F1B need 2 (m + p - 1) steps.
  for (int pp : {1, 2, 3, 5})
    for (int m : {pp, pp + 2, 3 * pp}) {
      EXPECT_EQ(simulate_lockstep(gpipe(pp, m)).steps, 2 * (m + pp - 1)) << pp << " " << m;
      const LockstepResult r = simulate_lockstep(one_f_one_b(pp, m));
      EXPECT_FALSE(r.deadlock);
      EXPECT_EQ(r.steps, 2 * (m + pp - 1)) << pp << " " << m;
    }
}

TEST(ScheduleLockstep, LoweredHandCase) {
  // rank 0: 0F0 0SEND_F0 0RECV_B0 0B0, rank 1: 1RECV_F0 1F0 1B0 1SEND_B0. Steps: 1 0F0; 2 0SEND_F0; 3 1RECV_F0
  // (the SEND ran in an earlier step); 4 1F0; 5 1B0; 6 1SEND_B0; 7 0RECV_B0; 8 0B0.
  const Schedule low = lower(gpipe(2, 1));
  EXPECT_EQ(row_text(low.actions[0]), "0F0 0SEND_F0 0RECV_B0 0B0");
  EXPECT_EQ(row_text(low.actions[1]), "1RECV_F0 1F0 1B0 1SEND_B0");
  const LockstepResult r = simulate_lockstep(low);
  EXPECT_FALSE(r.deadlock);
  EXPECT_EQ(r.steps, 8);
  EXPECT_EQ(r.error, "");
}

TEST(ScheduleLockstep, DeadlockNamesEveryStuckRank) {
  const Schedule s = from_rows(3, 1, {0, 1, 2}, {"0F0 0B0", "1B0 1F0", "2F0 2B0"});
  // Rank 1 wants 1B0 before its own 1F0: it has no F yet, which is a structural error, refused outright.
  EXPECT_NE(error_of([&] { simulate_lockstep(s); }).find("no F for stage 1 mb 0 before it"), std::string::npos);
  // Three ranks in a cycle of waits: rank 1 runs 1F1 before 1F0, rank 0 waits for 1B0 before sending mb 1.
  const Schedule t = from_rows(3, 2, {0, 1, 2}, {"0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1", "2F0 2F1 2B0 2B1"});
  const LockstepResult r = simulate_lockstep(t);
  EXPECT_TRUE(r.deadlock);
  EXPECT_EQ(r.steps, 1);
  EXPECT_EQ(r.error,
            "deadlock after 1 step: rank 0 waits at action 1 '0B0' for 1B0 or 1I0; rank 1 waits at action 0 '1F1' "
            "for 0F1; rank 2 waits at action 0 '2F0' for 1F0");
  EXPECT_NE(error_of([&] { simulate_timed(t, {}); }).find("is not lowered"), std::string::npos);
}

TEST(ScheduleTimed, OneFOneBAndGpipeBubbleMatchTheFormula) {
  for (int pp : {1, 2, 3, 4, 8})
    for (int m : {pp, 2 * pp, 3 * pp + 1}) {
      // The split variant runs each W right after its I; with W = 0 it is 1F1B again. (With W > 0 its
      // gradients leave after I alone, which shortens the step: not the closed formula's case.)
      for (const Schedule& s : {one_f_one_b(pp, m), gpipe(pp, m), one_f_one_b(pp, m, true)}) {
        const Schedule low = lower(s);
        const double w = s.actions[0].size() > size_t(2 * m) ? 0.0 : 0.5;
        const TimedResult t = simulate_timed(low, uniform_for(s, 1.0, 1.0, w, 0.0));
        const double want = double(pp - 1) / double(m + pp - 1);
        EXPECT_NEAR(t.bubble_ratio, want, 1e-12) << s.name << " pp " << pp << " m " << m;
        EXPECT_NEAR(t.bubble_ratio, bubble_formula(pp, m, 1), 1e-12);
        EXPECT_NEAR(t.step_time, 2.0 * (m + pp - 1), 1e-12);
        for (const RankStats& r : t.ranks) {
          EXPECT_NEAR(r.busy, 2.0 * m, 1e-12);
          EXPECT_NEAR(r.bubble_ratio, want, 1e-12);
        }
        EXPECT_EQ(t.steps, simulate_lockstep(low).steps);
      }
    }
}

TEST(ScheduleTimed, PeakInFlight) {
  for (int pp : {1, 2, 4, 6})
    for (int m : {pp, 2 * pp + 1}) {
      const Durations d = Durations::uniform(pp, 1, 2, 1, 0.1);
      const TimedResult g = simulate_timed(lower(gpipe(pp, m)), d);
      for (const RankStats& r : g.ranks) {
        EXPECT_EQ(r.peak_inflight, m);
        EXPECT_EQ(r.peak_inflight_microbatches, double(m));
      }
      for (bool split : {false, true}) {
        const TimedResult o = simulate_timed(lower(one_f_one_b(pp, m, split)), d);
        for (const RankStats& r : o.ranks) EXPECT_EQ(r.peak_inflight, pp - r.rank) << "rank " << r.rank;
      }
    }
  // Holding the W back keeps the activation set: I's alone free nothing.
  const Schedule held = from_rows(1, 3, {0}, {"0F0 0I0 0F1 0I1 0F2 0I2 0W0 0W1 0W2"});
  EXPECT_EQ(simulate_timed(held, {}).ranks[0].peak_inflight, 3);
  // Two stages per rank: peak_inflight_microbatches divides by the stages the rank owns.
  const Schedule v = from_rows(2, 1, {0, 0}, {"0F0 1F0 1B0 0B0"});
  const TimedResult tv = simulate_timed(v, {});
  EXPECT_EQ(tv.ranks[0].peak_inflight, 2);
  EXPECT_EQ(tv.ranks[0].peak_inflight_microbatches, 1.0);
}

TEST(ScheduleTimed, PointToPointLatencyHandCases) {
  // 1F1B, pp = 2, m = 2, F = B = 1, latency d. Rank 0: 0F0 [0,1], 0F1 [1,2], waits for 1B0's gradient (sent at
  // 3 + d) until 3 + 2d, 0B0 [3+2d, 4+2d], 0B1 after the gradient sent at 5 + d: [5+2d, 6+2d].
  const double d = 0.25;
  const Schedule low = lower(one_f_one_b(2, 2));
  ASSERT_EQ(row_text(low.actions[0]), "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1");
  ASSERT_EQ(row_text(low.actions[1]), "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1");
  const TimedResult t = simulate_timed(low, Durations::uniform(2, 1, 1, 0.5, d));
  const TimedResult t0 = simulate_timed(low, Durations::uniform(2, 1, 1, 0.5, 0));
  EXPECT_DOUBLE_EQ(t0.step_time, 6.0);
  EXPECT_DOUBLE_EQ(t.step_time, 6.0 + 2 * d);
  const std::vector<std::pair<double, double>> rank0 = {{0, 1},         {1, 1},         {1, 2},
                                                        {2, 2},         {2, 3 + 2 * d}, {3 + 2 * d, 4 + 2 * d},
                                                        {4 + 2 * d, 5 + 2 * d}, {5 + 2 * d, 6 + 2 * d}};
  const std::vector<std::pair<double, double>> rank1 = {{0, 1 + d},     {1 + d, 2 + d}, {2 + d, 3 + d},
                                                        {3 + d, 3 + d}, {3 + d, 3 + d}, {3 + d, 4 + d},
                                                        {4 + d, 5 + d}, {5 + d, 5 + d}};
  ASSERT_EQ(t.ops.size(), 16u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(t.ops[i].rank, 0);
    EXPECT_EQ(t.ops[i].index, int(i));
    EXPECT_EQ(t.ops[i].action, low.actions[0][i]);
    EXPECT_DOUBLE_EQ(t.ops[i].start, rank0[i].first) << i;
    EXPECT_DOUBLE_EQ(t.ops[i].end, rank0[i].second) << i;
    EXPECT_EQ(t.ops[8 + i].rank, 1);
    EXPECT_DOUBLE_EQ(t.ops[8 + i].start, rank1[i].first) << i;
    EXPECT_DOUBLE_EQ(t.ops[8 + i].end, rank1[i].second) << i;
  }
  // Busy time is compute only: waiting in a RECV is bubble.
  EXPECT_DOUBLE_EQ(t.ranks[0].busy, 4.0);
  EXPECT_DOUBLE_EQ(t.ranks[0].bubble_ratio, 1.0 - 4.0 / (6.0 + 2 * d));
  // pp = 3, m = 1: the single micro-batch crosses four rank boundaries: 6 + 4d.
  const TimedResult c = simulate_timed(lower(one_f_one_b(3, 1)), Durations::uniform(3, 1, 1, 0, d));
  EXPECT_DOUBLE_EQ(c.step_time, 6.0 + 4 * d);
}

TEST(ScheduleTimed, MatchesANaiveDataFlowTwin) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.1, 2.0);
  for (int trial = 0; trial < 40; ++trial) {
    const int pp = 1 + int(rng() % 5), m = pp + int(rng() % 4);
    const int kind = int(rng() % 3);
    const Schedule s = kind == 0 ? gpipe(pp, m) : one_f_one_b(pp, m, kind == 2);
    Durations d;
    for (int st = 0; st < pp; ++st) d.stage.push_back({u(rng), u(rng), u(rng), u(rng) - 0.1, u(rng) - 0.1});
    d.p2p = u(rng) - 0.1;
    const auto ends = twin(s, d);
    const TimedResult t = simulate_timed(lower(s), d);
    double step = 0;
    for (int r = 0; r < pp; ++r) {
      ASSERT_EQ(ends[size_t(r)].size(), s.actions[size_t(r)].size());
      step = std::max(step, ends[size_t(r)].back());
      std::vector<double> got;
      for (const TimedOp& op : t.ops)
        if (op.rank == r && is_compute(op.action.op)) got.push_back(op.end);
      ASSERT_EQ(got.size(), ends[size_t(r)].size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], ends[size_t(r)][i], 1e-9) << r << " " << i;
    }
    EXPECT_NEAR(t.step_time, step, 1e-9);
  }
}

TEST(ScheduleTimed, FBAndAllToAllCosts) {
  // One rank, one stage: 0F0 = f + a2a_f = 3; the F&B pair = max(f + i + w, a2a_f + a2a_b) = max(2.5, 5) = 5;
  // 0B1 = i + w + a2a_b = 4.5.
  Durations d;
  d.stage = {{1.0, 1.0, 0.5, 2.0, 3.0}};
  const Schedule s = from_rows(1, 2, {0}, {"0F0 0F1&0B0 0B1"});
  const TimedResult t = simulate_timed(s, d);
  EXPECT_DOUBLE_EQ(t.step_time, 12.5);
  EXPECT_DOUBLE_EQ(t.ops[1].start, 3.0);
  EXPECT_DOUBLE_EQ(t.ops[1].end, 8.0);
  EXPECT_DOUBLE_EQ(t.ranks[0].busy, 12.5);
  EXPECT_DOUBLE_EQ(t.bubble_ratio, 0.0);
  EXPECT_EQ(t.ranks[0].peak_inflight, 2);  // both sets live while the pair overlaps them
  // Without all-to-all the pair costs f + b: 1 + 2.5 + 1.5.
  d.stage[0].a2a_f = d.stage[0].a2a_b = 0;
  EXPECT_DOUBLE_EQ(simulate_timed(s, d).step_time, 5.0);
  // An I half costs f + i; its W comes later on its own: 1 + max(2, 0) + 0.5 + 1.5.
  const Schedule si = from_rows(1, 2, {0}, {"0F0 0F1&0I0 0W0 0B1"});
  EXPECT_DOUBLE_EQ(simulate_timed(si, d).step_time, 5.0);
  EXPECT_EQ(simulate_timed(si, d).ranks[0].peak_inflight, 2);
}

TEST(ScheduleTimed, UnevenStages) {
  // GPipe pp = 2, m = 1, stage 0: f 1, i 1; stage 1: f 2, i 3. Chain 1 + 2 + 3 + 1 = 7; busy 2 and 5.
  Durations d;
  d.stage = {{1, 1, 0, 0, 0}, {2, 3, 0, 0, 0}};
  const TimedResult t = simulate_timed(lower(gpipe(2, 1)), d);
  EXPECT_DOUBLE_EQ(t.step_time, 7.0);
  EXPECT_DOUBLE_EQ(t.ranks[0].busy, 2.0);
  EXPECT_DOUBLE_EQ(t.ranks[1].busy, 5.0);
  EXPECT_DOUBLE_EQ(t.ranks[0].bubble_ratio, 5.0 / 7.0);
  EXPECT_DOUBLE_EQ(t.ranks[1].bubble_ratio, 2.0 / 7.0);
  EXPECT_DOUBLE_EQ(t.bubble_ratio, 0.5);
}

TEST(ScheduleTimed, Refusals) {
  const Schedule s = gpipe(2, 2);
  EXPECT_NE(error_of([&] { simulate_timed(s, {}); })
                .find("simulate_timed: schedule 'test' is not lowered; run lower() first"),
            std::string::npos);
  const Schedule low = lower(s);
  EXPECT_NE(error_of([&] { simulate_timed(low, Durations::uniform(3, 1, 1, 0, 0)); })
                .find("durations for 3 stages, the schedule has n_stages = 2"),
            std::string::npos);
  Durations neg = Durations::uniform(2, 1, 1, 0, 0);
  neg.stage[1].f = -1;
  EXPECT_NE(error_of([&] { simulate_timed(low, neg); }).find("stage 1 f = -1 must be finite and >= 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Durations::uniform(2, 1, 1, 2, 0); }).find("w = 2 must be <= b = 1"), std::string::npos);
  EXPECT_NE(error_of([&] { Durations::uniform(0, 1, 1, 0, 0); }).find("n_stages = 0"), std::string::npos);
  EXPECT_NE(error_of([&] { bubble_formula(0, 4, 1); }).find("pp = 0"), std::string::npos);
  // An invalid lowered schedule is refused with the validator's message.
  Schedule bad = low;
  bad.actions[1].erase(bad.actions[1].begin());  // drop 1RECV_F0
  EXPECT_NE(error_of([&] { simulate_timed(bad, {}); }).find("no matching 1RECV_F0 on rank 1"), std::string::npos);
  // Uniform durations split B into I = b - w and W = w.
  const Durations u = Durations::uniform(3, 1.5, 2.0, 0.5, 0.25);
  ASSERT_EQ(u.stage.size(), 3u);
  EXPECT_EQ(u.stage[2].f, 1.5);
  EXPECT_EQ(u.stage[2].i, 1.5);
  EXPECT_EQ(u.stage[2].w, 0.5);
  EXPECT_EQ(u.p2p, 0.25);
}

TEST(ScheduleTimed, SeedFigures) {
  // PP16 GA16: (p-1)/(p-1+m*v) = 15/31 with VPP1 (48.39%; the seed text's "~48.43%" is a rounding slip) and
  // 15/111 with VPP6 (13.51%).
  EXPECT_DOUBLE_EQ(bubble_formula(16, 16, 1), 15.0 / 31.0);
  EXPECT_EQ(pct(bubble_formula(16, 16, 1)), "48.39");
  EXPECT_DOUBLE_EQ(bubble_formula(16, 16, 6), 15.0 / 111.0);
  EXPECT_EQ(pct(bubble_formula(16, 16, 6)), "13.51");
  EXPECT_DOUBLE_EQ(bubble_formula(1, 8, 1), 0.0);
  // The simulator agrees for 1F1B PP16 GA16 with equal F and B times.
  const Schedule low = lower(one_f_one_b(16, 16));
  const TimedResult t = simulate_timed(low, Durations::uniform(16, 1, 1, 0.5, 0));
  EXPECT_NEAR(t.bubble_ratio, 15.0 / 31.0, 1e-12);
  EXPECT_EQ(pct(t.bubble_ratio), "48.39");
  EXPECT_EQ(t.ranks[0].peak_inflight, 16);
  EXPECT_EQ(t.ranks[15].peak_inflight, 1);
}
