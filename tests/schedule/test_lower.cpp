// test_lower.cpp: the lowering pass (lower): exact SEND/RECV placement on small hand-built schedules, local
// passing between same-rank neighbours of a V, the RECV hoisting that keeps every rank pair's receives in
// send order, refusals, and a randomized property test (random valid compute-only schedules lower to valid,
// deadlock-free schedules whose per-pair order matches, checked independently of the validator). Not the
// validator's messages (test_validate.cpp) or timings (test_simulate.cpp).
#include <gtest/gtest.h>

#include "sched_builders.h"

using namespace sched_test;

namespace {

// SENDs sit right after their producer; for schedules that need no hoisting, each RECV is followed (after
// any other RECVs) by the compute action that consumes it.
void expect_adjacent(const Schedule& low) {
  for (int r = 0; r < low.pp; ++r) {
    const auto& row = low.actions[size_t(r)];
    for (size_t i = 0; i < row.size(); ++i) {
      const Action& a = row[i];
      if (a.op == Op::SEND_F || a.op == Op::SEND_B) {
        size_t j = i;
        while (j > 0 && (row[j - 1].op == Op::SEND_F || row[j - 1].op == Op::SEND_B)) --j;
        ASSERT_GT(j, 0u) << to_string(a);
        const Action p = row[j - 1];
        const Action want = a.op == Op::SEND_F ? F(a.stage, a.mb) : B(a.stage, a.mb);
        const bool ok = fwd_half(p) == want || bwd_half(p) == want ||
                        (a.op == Op::SEND_B && bwd_half(p) == I(a.stage, a.mb));
        EXPECT_TRUE(ok) << "rank " << r << ": " << to_string(a) << " follows " << to_string(p);
      }
      if (a.op == Op::RECV_F || a.op == Op::RECV_B) {
        size_t j = i;
        while (j < row.size() && is_comm(row[j].op)) ++j;
        ASSERT_LT(j, row.size()) << to_string(a);
        const Action c = row[j];
        const Action want = a.op == Op::RECV_F ? F(a.stage, a.mb) : B(a.stage, a.mb);
        const bool ok = fwd_half(c) == want || bwd_half(c) == want ||
                        (a.op == Op::RECV_B && bwd_half(c) == I(a.stage, a.mb));
        EXPECT_TRUE(ok) << "rank " << r << ": " << to_string(a) << " precedes " << to_string(c);
      }
    }
  }
}

// Compute actions survive lowering unchanged and in order.
void expect_same_compute(const Schedule& in, const Schedule& low) {
  ASSERT_EQ(in.pp, low.pp);
  for (int r = 0; r < in.pp; ++r) {
    std::vector<Action> kept;
    for (const Action& a : low.actions[size_t(r)])
      if (is_compute(a.op)) kept.push_back(a);
    EXPECT_EQ(kept, in.actions[size_t(r)]) << "rank " << r;
  }
}

}  // namespace

TEST(ScheduleLower, OneFOneBExact) {
  const Schedule low = lower(one_f_one_b(3, 3));
  EXPECT_TRUE(low.lowered);
  EXPECT_EQ(row_text(low.actions[0]),
            "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2");
  EXPECT_EQ(row_text(low.actions[1]),
            "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1B0 1SEND_B0 1RECV_F2 1F2 1SEND_F2 1RECV_B1 1B1 "
            "1SEND_B1 1RECV_B2 1B2 1SEND_B2");
  EXPECT_EQ(row_text(low.actions[2]),
            "2RECV_F0 2F0 2B0 2SEND_B0 2RECV_F1 2F1 2B1 2SEND_B1 2RECV_F2 2F2 2B2 2SEND_B2");
  EXPECT_TRUE(validate(low).ok) << validate(low).error;
}

TEST(ScheduleLower, InvariantsOnHandBuiltSchedules) {
  for (int pp : {1, 2, 3, 4, 6})
    for (int m : {pp, pp + 1, 2 * pp + 1}) {
      for (const Schedule& s : {gpipe(pp, m), one_f_one_b(pp, m), one_f_one_b(pp, m, true)}) {
        const Schedule low = lower(s);
        EXPECT_TRUE(validate(low).ok) << validate(low).error;
        expect_same_compute(s, low);
        expect_adjacent(low);
        expect_same_order_per_pair(low);
        // One SEND and one RECV per tensor crossing a rank boundary: 2 (pp - 1) m of each.
        int sends = 0, recvs = 0;
        for (const auto& row : low.actions)
          for (const Action& a : row) {
            sends += a.op == Op::SEND_F || a.op == Op::SEND_B;
            recvs += a.op == Op::RECV_F || a.op == Op::RECV_B;
          }
        EXPECT_EQ(sends, 2 * (pp - 1) * m);
        EXPECT_EQ(recvs, 2 * (pp - 1) * m);
      }
    }
}

TEST(ScheduleLower, VShapePassesLocally) {
  // pp = 2, stages 0..3 on ranks 0, 1, 1, 0: 1 -> 2 (and back) stays on rank 1, 3 -> ... is the last stage.
  const Schedule v = from_rows(4, 2, {0, 1, 1, 0},
                               {"0F0 0F1 3F0 3B0 0B0 3F1 3B1 0B1", "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1"});
  const Schedule low = lower(v);
  // Rank 1 sends 2SEND_F1 (after 2F1) before 1SEND_B0 (after 1B0), but rank 0 uses mb 0's gradient (0B0)
  // before mb 1's activation (3F1): 3RECV_F1 moves up next to 0RECV_B0 to keep the 1 -> 0 order.
  EXPECT_EQ(row_text(low.actions[0]),
            "0F0 0SEND_F0 0F1 0SEND_F1 3RECV_F0 3F0 3B0 3SEND_B0 3RECV_F1 0RECV_B0 0B0 3F1 3B1 3SEND_B1 0RECV_B1 "
            "0B1");
  EXPECT_EQ(row_text(low.actions[1]),
            "1RECV_F0 1F0 2F0 2SEND_F0 1RECV_F1 1F1 2F1 2SEND_F1 2RECV_B0 2B0 1B0 1SEND_B0 2RECV_B1 2B1 1B1 1SEND_B1");
  EXPECT_TRUE(validate(low).ok) << validate(low).error;
  for (const auto& row : low.actions)
    for (const Action& a : row) {
      EXPECT_NE(a, (Action{Op::SEND_F, 1, a.mb}));
      EXPECT_NE(a, (Action{Op::RECV_F, 2, a.mb}));
      EXPECT_NE(a, (Action{Op::SEND_B, 2, a.mb}));
      EXPECT_NE(a, (Action{Op::RECV_B, 1, a.mb}));
    }
  expect_same_order_per_pair(low);
  // Ranks 0 and 1 exchange in both directions and both kinds: 0->1 carries 0's activations and 3's gradients.
  EXPECT_EQ(simulate_lockstep(low).deadlock, false);
}

TEST(ScheduleLower, HoistsReceivesToKeepSendOrder) {
  // Rank 1 consumes mb 1 before mb 0, but rank 0 sends mb 0 first: rank 1 receives mb 0 first, right before
  // its first consumer of either.
  const Schedule s = from_rows(2, 2, {0, 1}, {"0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"});
  ASSERT_TRUE(validate(s).ok) << validate(s).error;
  const Schedule low = lower(s);
  EXPECT_EQ(row_text(low.actions[0]), "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1");
  EXPECT_EQ(row_text(low.actions[1]), "1RECV_F0 1RECV_F1 1F1 1F0 1B0 1SEND_B0 1B1 1SEND_B1");
  EXPECT_TRUE(validate(low).ok) << validate(low).error;
  expect_same_order_per_pair(low);
  // The backward direction too: rank 1 sends mb 1's gradient first, rank 0 uses mb 0's first.
  const Schedule t = from_rows(2, 2, {0, 1}, {"0F0 0F1 0B0 0B1", "1F0 1F1 1B1 1B0"});
  const Schedule lt = lower(t);
  EXPECT_EQ(row_text(lt.actions[0]), "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0RECV_B0 0B0 0B1");
  expect_same_order_per_pair(lt);
  EXPECT_TRUE(validate(lt).ok) << validate(lt).error;
}

TEST(ScheduleLower, FBSendsBothHalves) {
  // pp = 2, m = 2: rank 1 overlaps mb 1's forward with mb 0's backward.
  const Schedule s = from_rows(2, 2, {0, 1}, {"0F0 0F1 0B0 0B1", "1F0 1F1&1B0 1B1"});
  const Schedule low = lower(s);
  EXPECT_EQ(row_text(low.actions[1]), "1RECV_F0 1F0 1RECV_F1 1F1&1B0 1SEND_B0 1B1 1SEND_B1");
  // Two stages per rank, both halves crossing ranks: rank 0 owns stages 0 and 2, rank 1 owns 1 and 3.
  const Schedule ok = from_rows(4, 2, {0, 1, 0, 1},
                                {"0F0 0F1 2F0 2F1&2B0 2B1 0B0 0B1", "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"});
  const Schedule lok = lower(ok);
  EXPECT_TRUE(validate(lok).ok) << validate(lok).error;
  EXPECT_EQ(row_text(lok.actions[0]),
            "0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2RECV_B0 2F1&2B0 2SEND_F1 2SEND_B0 2RECV_B1 2B1 "
            "2SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1");
  expect_same_order_per_pair(lok);
}

TEST(ScheduleLower, Refusals) {
  const Schedule low = lower(gpipe(2, 2));
  const std::string e = error_of([&] { lower(low); });
  EXPECT_NE(e.find("lower: schedule 'test' is already lowered (it has SEND/RECV actions); lower its compute-only "
                   "form instead"),
            std::string::npos)
      << e;
  // An invalid compute-only schedule is refused with the validator's message.
  const Schedule bad = from_rows(2, 2, {0, 1}, {"0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"});
  EXPECT_NE(error_of([&] { lower(bad); }).find("rank 1, action 0 '1B0': no F for stage 1 mb 0 before it"),
            std::string::npos);
  const Schedule dead = from_rows(2, 2, {0, 1}, {"0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"});
  EXPECT_NE(error_of([&] { lower(dead); }).find("deadlock"), std::string::npos);
}

TEST(ScheduleLower, SingleRankAddsNothing) {
  const Schedule s = from_rows(2, 2, {0, 0}, {"0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1"});
  const Schedule low = lower(s);
  EXPECT_TRUE(low.lowered);
  EXPECT_EQ(low.actions, s.actions);
}

TEST(ScheduleLower, RandomValidSchedulesLowerSafely) {
  std::mt19937 rng(12345);
  int hoisted = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int pp = 1 + int(rng() % 4);
    const bool v = rng() % 3 == 0;
    const int vpp = v ? 2 : 1 + int(rng() % 3);
    const int m = 1 + int(rng() % 5);
    const Schedule s = random_schedule(rng, pp, vpp, m, v);
    const Verdict vs = validate(s);
    ASSERT_TRUE(vs.ok) << vs.error << "\n" << to_text(s);
    const Schedule low = lower(s);
    const Verdict vl = validate(low);  // includes the lock-step replay: no deadlock
    ASSERT_TRUE(vl.ok) << vl.error << "\n" << to_text(low);
    expect_same_compute(s, low);
    expect_same_order_per_pair(low);
    // Count schedules where some RECV had to move above an unrelated compute action.
    for (const auto& row : low.actions)
      for (size_t i = 0; i < row.size(); ++i)
        if (row[i].op == Op::RECV_F || row[i].op == Op::RECV_B) {
          size_t j = i;
          while (is_comm(row[j].op)) ++j;  // a compute action follows every RECV
          const Action& r = row[i];
          const Action c = row[j], cb = bwd_half(c);
          const bool uses = r.op == Op::RECV_F ? fwd_half(c) == F(r.stage, r.mb)
                                               : (cb.op == Op::B || cb.op == Op::I) && cb.stage == r.stage &&
                                                     cb.mb == r.mb;
          hoisted += !uses;
        }
  }
  EXPECT_GT(hoisted, 10);  // the property test really exercises the reordering
}
