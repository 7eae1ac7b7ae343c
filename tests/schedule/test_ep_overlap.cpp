// test_ep_overlap.cpp: the interleaved schedule with the 1F1B all-to-all overlap (GenSpec::ep_overlap): one
// warm-up forward more than Megatron's interleaved table on every rank, every steady-state pair fused into an
// FB action, the same actions otherwise (same forward order, same backward order, per stage still in
// micro-batch order), valid and deadlock-free over a grid, and in the timed replay the FB pairs hide the
// all-to-all the plain schedule pays.
#include <gtest/gtest.h>

#include "moetron/check.h"
#include "moetron/schedule.h"

using namespace moetron;
using namespace moetron::sched;

namespace {

GenSpec spec(int pp, int vpp, int m, bool overlap) {
  GenSpec g;
  g.schedule = "interleaved_1f1b", g.pp = pp, g.vpp = vpp, g.microbatches = m, g.ep_overlap = overlap;
  return g;
}

}  // namespace

TEST(EpOverlapSchedule, OneMoreWarmupForwardAndFusedPairsOverAGrid) {
  int checked = 0;
  for (int pp : {2, 3, 4})
    for (int vpp : {2, 3})
      for (int m : {pp, 2 * pp, 3 * pp, 4 * pp}) {
        const Schedule plain = generate(spec(pp, vpp, m, false));
        const Schedule ov = generate(spec(pp, vpp, m, true));
        const Verdict v = validate(ov);
        ASSERT_TRUE(v.ok) << "pp " << pp << " vpp " << vpp << " m " << m << ": " << v.error;
        const Schedule low = lower(ov);
        ASSERT_TRUE(validate(low).ok);
        ASSERT_FALSE(simulate_lockstep(low).deadlock) << "pp " << pp << " vpp " << vpp << " m " << m;
        const int total = m * vpp;
        for (int r = 0; r < pp; ++r) {
          const auto& a = plain.actions[size_t(r)];
          const auto& b = ov.actions[size_t(r)];
          // Forwards run before the first backward (an FB runs its forward half first).
          auto before_first_backward = [](const std::vector<Action>& list) {
            int n = 0;
            for (const Action& x : list) {
              if (x.op == Op::F) ++n;
              else if (x.op == Op::FB) return n + 1;
              else return n;
            }
            return n;
          };
          int fb = 0, plain_f = 0;
          for (const Action& x : b) fb += x.op == Op::FB;
          while (plain_f < int(b.size()) && b[size_t(plain_f)].op == Op::F) ++plain_f;
          EXPECT_EQ(before_first_backward(b), std::min(total, before_first_backward(a) + 1)) << "rank " << r;
          // warmup_forwards: the forwards that run unpaired, as the generator emits them.
          EXPECT_EQ(std::min(total, warmup_forwards(spec(pp, vpp, m, false), r) + 1), before_first_backward(a)) << "rank " << r;
          EXPECT_EQ(warmup_forwards(spec(pp, vpp, m, true), r), plain_f) << "rank " << r;
          EXPECT_EQ(fb, total - plain_f) << "rank " << r;  // every steady-state pair fused
          // Unfused, the overlap schedule runs the same forwards and backwards in the same orders.
          std::vector<Action> fa, fo, ba, bo;
          for (const Action& x : a) (x.op == Op::F ? fa : ba).push_back(x);
          for (const Action& x : b) {
            if (x.op == Op::FB) fo.push_back(fwd_half(x)), bo.push_back(bwd_half(x));
            else (x.op == Op::F ? fo : bo).push_back(x);
          }
          EXPECT_EQ(fa, fo) << "rank " << r << " forward order";
          EXPECT_EQ(ba, bo) << "rank " << r << " backward order";
        }
        ++checked;
      }
  EXPECT_EQ(checked, 24);
}

TEST(EpOverlapSchedule, FusedPairsHideTheAllToAllInTheTimedReplay) {
  // F = 1, B = 2, all-to-all 1 per F and per B: the plain schedule pays 5 per pair, an FB pays max(3, 2) = 3.
  const int pp = 4, vpp = 2, m = 16;
  Durations d = Durations::uniform(pp * vpp, 1, 2, 0, 0);
  for (auto& c : d.stage) c.a2a_f = 1, c.a2a_b = 1;
  const TimedResult plain = simulate_timed(lower(generate(spec(pp, vpp, m, false))), d);
  const TimedResult ov = simulate_timed(lower(generate(spec(pp, vpp, m, true))), d);
  EXPECT_LT(ov.step_time, 0.8 * plain.step_time) << plain.step_time << " vs " << ov.step_time;
  // Exposed all-to-all, hand-counted: the plain schedule pays 1 per F and per B (2 per chunk, m * vpp chunks);
  // the fused one only on its unpaired warm-up forwards and cool-down backwards (an FB's 2 hide under its 3).
  for (int r = 0; r < pp; ++r) {
    EXPECT_DOUBLE_EQ(plain.ranks[size_t(r)].a2a_exposed, 2.0 * m * vpp) << "rank " << r;
    EXPECT_DOUBLE_EQ(ov.ranks[size_t(r)].a2a_exposed, 2.0 * warmup_forwards(spec(pp, vpp, m, true), r)) << "rank " << r;
  }
  // An all-to-all longer than the pair's compute shows through by the difference: 4 + 4 against 3 per FB.
  for (auto& c : d.stage) c.a2a_f = 4, c.a2a_b = 4;
  const TimedResult big = simulate_timed(lower(generate(spec(pp, vpp, m, true))), d);
  for (int r = 0; r < pp; ++r) {
    const int warm = warmup_forwards(spec(pp, vpp, m, true), r);
    EXPECT_DOUBLE_EQ(big.ranks[size_t(r)].a2a_exposed, 8.0 * warm + 5.0 * (m * vpp - warm)) << "rank " << r;
  }
  // Without all-to-all there is nothing to hide: the fused schedule is no faster.
  const Durations d0 = Durations::uniform(pp * vpp, 1, 2, 0, 0);
  EXPECT_GE(simulate_timed(lower(generate(spec(pp, vpp, m, true))), d0).step_time,
            simulate_timed(lower(generate(spec(pp, vpp, m, false))), d0).step_time);
}

TEST(EpOverlapSchedule, OnlyForTheInterleavedSchedule) {
  for (const char* name : {"gpipe", "1f1b", "zb1p", "zbv", "dualpipev"}) {
    GenSpec g = spec(2, 1, 8, true);
    g.schedule = name;
    if (is_v_shape(name)) g.vpp = 2;
    try {
      check_spec(g);
      ADD_FAILURE() << name << " accepted ep_overlap";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ep_overlap applies to interleaved_1f1b only"), std::string::npos) << e.what();
    }
  }
}
