// test_validate.cpp: the schedule validator (validate, check_valid): hand-built GPipe and 1F1B schedules pass,
// and every rule, broken on purpose, is reported with its exact message, rank and action index. Not the
// lowering pass (test_lower.cpp) or the simulators' figures (test_simulate.cpp).
#include <gtest/gtest.h>

#include "sched_builders.h"

using namespace sched_test;

namespace {

// Expects validate(s) to fail with exactly `msg` at (rank, index).
void expect_bad(const Schedule& s, const std::string& msg, int rank, int index) {
  const Verdict v = validate(s);
  EXPECT_FALSE(v.ok) << to_text(s);
  EXPECT_EQ(v.error, msg) << to_text(s);
  EXPECT_EQ(v.rank, rank) << msg;
  EXPECT_EQ(v.index, index) << msg;
}

// GPipe pp = 2, m = 2 as text rows, to be edited by the tests.
const std::vector<std::string> kGpipe = {"0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"};
Schedule g2(std::vector<std::string> rows = kGpipe) { return from_rows(2, 2, {0, 1}, rows); }

// A V placement with pp = 2 (stages 0..3 on ranks 0, 1, 1, 0), m = 2.
Schedule v2(std::vector<std::string> rows) { return from_rows(4, 2, {0, 1, 1, 0}, rows); }
const std::vector<std::string> kV = {"0F0 0F1 3F0 3B0 0B0 3F1 3B1 0B1", "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1"};

}  // namespace

TEST(ScheduleValidate, HandBuiltSchedulesPass) {
  for (int pp : {1, 2, 3, 4, 8})
    for (int m : {pp, pp + 1, 2 * pp, 3 * pp + 2}) {
      for (const Schedule& s : {gpipe(pp, m), one_f_one_b(pp, m), one_f_one_b(pp, m, true)}) {
        const Verdict v = validate(s);
        EXPECT_TRUE(v.ok) << v.error;
        EXPECT_EQ(v.rank, -1);
        EXPECT_NO_THROW(check_valid(s));
      }
    }
  EXPECT_TRUE(validate(v2(kV)).ok) << validate(v2(kV)).error;
  // GPipe with fewer micro-batches than ranks is fine (1F1B's warm-up is then cut short too).
  EXPECT_TRUE(validate(gpipe(4, 2)).ok);
  EXPECT_TRUE(validate(one_f_one_b(4, 2)).ok);
}

TEST(ScheduleValidate, TheIssueExample) {
  // Stage 1 lives on rank 2 here; its eighth action (index 7) is a backward of mb 3 whose F comes later.
  const Schedule s = from_rows(3, 5, {0, 2, 1},
                               {"0F0 0F1 0F2 0F3 0F4 0B0 0B1 0B2 0B3 0B4", "2F0 2F1 2F2 2F3 2F4 2B0 2B1 2B2 2B3 2B4",
                                "1F0 1F1 1F2 1F4 1B0 1B1 1B2 1B3 1F3 1B4"});
  expect_bad(s, "rank 2, action 7 '1B3': no F for stage 1 mb 3 before it", 2, 7);
  const std::string e = error_of([&] { check_valid(s); });
  EXPECT_NE(e.find("schedule 'test' is invalid: rank 2, action 7 '1B3': no F for stage 1 mb 3 before it"),
            std::string::npos)
      << e;
}

TEST(ScheduleValidate, Shape) {
  Schedule s = g2();
  s.pp = 0;
  expect_bad(s, "schedule shape: pp = 0 must be >= 1", -1, -1);
  s = g2();
  s.pp = 3;
  s.stage_rank = {0, 1, 2};
  s.n_stages = 3;
  expect_bad(s, "schedule shape: 2 rank rows of actions for pp = 3", -1, -1);
  s = g2();
  s.stage_rank = {0};
  expect_bad(s, "schedule shape: stage_rank has 1 entries for n_stages = 2", -1, -1);
  s = g2();
  s.stage_rank = {0, 2};
  expect_bad(s, "schedule shape: stage_rank[1] = 2 is not a rank of 0..1", -1, -1);
  s = g2();
  s.n_microbatches = 0;
  expect_bad(s, "schedule shape: n_microbatches = 0 must be >= 1", -1, -1);
}

TEST(ScheduleValidate, RangeAndPlacement) {
  expect_bad(g2({"0F0 0F1 0B0 0B1", "1F0 2F1 1B0 1B1"}), "rank 1, action 1 '2F1': stage 2 out of range 0..1", 1, 1);
  expect_bad(g2({"0F0 0F1 0B0 0B1", "1F0 1F5 1B0 1B1"}),
             "rank 1, action 1 '1F5': micro-batch 5 out of range 0..1", 1, 1);
  expect_bad(g2({"0F0 0F1 1B0 0B1", "1F0 1F1 1B0 1B1"}), "rank 0, action 2 '1B0': stage 1 runs on rank 1, not rank 0",
             0, 2);
  // An FB half is checked too.
  expect_bad(g2({"0F0 0F1&1B0 0B0 0B1", "1F0 1F1 1B0 1B1"}),
             "rank 0, action 1 '0F1&1B0': stage 1 runs on rank 1, not rank 0", 0, 1);
  Schedule s = g2({"0F0 0F1&0B0 0B1", "1F0 1F1 1B0 1B1"});
  s.actions[0][1].op2 = Op::W;
  expect_bad(s, "rank 0, action 1 '0F1&0W0': the backward half of an F&B pair must be a B or an I", 0, 1);
}

TEST(ScheduleValidate, Dependencies) {
  expect_bad(g2({"0F0 0F0 0B0 0B1", "1F0 1F1 1B0 1B1"}), "rank 0, action 1 '0F0': second F for stage 0 mb 0", 0, 1);
  expect_bad(g2({"0F0 0F1 0B0 0B1", "1B0 1F0 1F1 1B1"}), "rank 1, action 0 '1B0': no F for stage 1 mb 0 before it", 1,
             0);
  expect_bad(g2({"0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B0 1B1"}), "rank 1, action 3 '1B0': second B for stage 1 mb 0",
             1, 3);
  // Split backward: W without I, B and I both, a second I, a second W.
  const std::string r0 = "0F0 0F1 0I0 0W0 0B1";
  expect_bad(g2({r0, "1F0 1W0 1I0 1F1 1B1"}), "rank 1, action 1 '1W0': no I for stage 1 mb 0 before it", 1, 1);
  expect_bad(g2({r0, "1F0 1I0 1B0 1W0 1F1 1B1"}), "rank 1, action 2 '1B0': stage 1 mb 0 has both B and I", 1, 2);
  expect_bad(g2({r0, "1F0 1B0 1I0 1F1 1B1"}), "rank 1, action 2 '1I0': stage 1 mb 0 has both B and I", 1, 2);
  expect_bad(g2({r0, "1F0 1I0 1I0 1W0 1F1 1B1"}), "rank 1, action 2 '1I0': second I for stage 1 mb 0", 1, 2);
  expect_bad(g2({r0, "1F0 1I0 1W0 1W0 1F1 1B1"}), "rank 1, action 3 '1W0': second W for stage 1 mb 0", 1, 3);
  // W after a full B is still a W without its I.
  expect_bad(g2({r0, "1F0 1B0 1W0 1F1 1B1"}), "rank 1, action 2 '1W0': no I for stage 1 mb 0 before it", 1, 2);
  // An FB's backward half cannot use its own forward half.
  expect_bad(g2({"0F0 0F1&0B1 0B0", "1F0 1F1 1B0 1B1"}), "rank 0, action 1 '0F1&0B1': no F for stage 0 mb 1 before it",
             0, 1);
}

TEST(ScheduleValidate, SameRankNeighboursInAVShape) {
  expect_bad(v2({"0F0 0F1 3F0 3B0 0B0 3F1 3B1 0B1", "2F0 1F0 1F1 2F1 2B0 1B0 2B1 1B1"}),
             "rank 1, action 0 '2F0': no F for stage 1 mb 0 before it", 1, 0);
  expect_bad(v2({"0F0 0F1 3F0 3B0 0B0 3F1 3B1 0B1", "1F0 2F0 1F1 2F1 1B0 2B0 2B1 1B1"}),
             "rank 1, action 4 '1B0': no B or I for stage 2 mb 0 before it", 1, 4);
}

TEST(ScheduleValidate, Completeness) {
  // No backward: rank 0's 0B1 would wait forever too, but the missing backward is reported first.
  expect_bad(g2({"0F0 0F1 0B0 0B1", "1F0 1F1 1B0"}), "rank 1, at the end: stage 1 mb 1 has no backward", 1, 3);
  expect_bad(g2({"0F0 0B0", "1F0 1B0"}), "rank 0, at the end: stage 0 mb 1 has no F", 0, 2);
  expect_bad(g2({"0F0 0F1 0B0 0B1", "1F0 1F1 1I0 1B1"}), "rank 1, at the end: stage 1 mb 0 has an I but no W", 1, 4);
}

TEST(ScheduleValidate, Deadlock) {
  // Rank 0 waits for rank 1's 1B0, which comes after 1F1, which waits for rank 0's 0F1, which comes after 0B0.
  const Schedule s = g2({"0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"});
  expect_bad(s,
             "rank 0, action 1 '0B0': never runs: deadlock after 1 step: rank 0 waits at action 1 '0B0' for 1B0 or "
             "1I0; rank 1 waits at action 0 '1F1' for 0F1",
             0, 1);
}

TEST(ScheduleValidate, LoweredRules) {
  const Schedule low = lower(g2());
  ASSERT_EQ(row_text(low.actions[0]), "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1");
  ASSERT_EQ(row_text(low.actions[1]), "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1");
  ASSERT_TRUE(validate(low).ok) << validate(low).error;
  const std::string r0 = row_text(low.actions[0]), r1 = row_text(low.actions[1]);
  auto lowered = [](std::vector<std::string> rows) { return from_rows(2, 2, {0, 1}, rows, true); };

  Schedule s = low;
  s.lowered = false;
  expect_bad(s,
             "rank 0, action 1 '0SEND_F0': SEND/RECV in a schedule not marked lowered (lower() adds them to a "
             "compute-only schedule)",
             0, 1);
  // SEND without RECV, RECV without SEND.
  expect_bad(lowered({r0, "1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1"}),
             "rank 0, action 3 '0SEND_F1': no matching 1RECV_F1 on rank 1", 0, 3);
  expect_bad(lowered({"0F0 0SEND_F0 0F1 0RECV_B0 0B0 0RECV_B1 0B1", r1}),
             "rank 1, action 2 '1RECV_F1': no matching 0SEND_F1 on rank 0", 1, 2);
  // A compute action whose input from another rank was not received before it.
  expect_bad(lowered({r0, "1F0 1RECV_F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"}),
             "rank 1, action 0 '1F0': no RECV_F for stage 1 mb 0 before it", 1, 0);
  expect_bad(lowered({"0F0 0SEND_F0 0F1 0SEND_F1 0B0 0RECV_B0 0RECV_B1 0B1", r1}),
             "rank 0, action 4 '0B0': no RECV_B for stage 0 mb 0 before it", 0, 4);
  // A SEND before the compute that produces its tensor; a second RECV.
  expect_bad(lowered({"0SEND_F0 0F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1", r1}),
             "rank 0, action 0 '0SEND_F0': no F for stage 0 mb 0 before it", 0, 0);
  expect_bad(lowered({"0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B1", r1}),
             "rank 0, action 8 '0RECV_B1': second RECV_B for stage 0 mb 1", 0, 8);
  expect_bad(lowered({r0, "1RECV_F0 1F0 1RECV_F1 1F1 1SEND_B0 1B0 1B1 1SEND_B1"}),
             "rank 1, action 4 '1SEND_B0': no B or I for stage 1 mb 0 before it", 1, 4);
  // Edges of the pipeline, and a SEND on the wrong rank.
  expect_bad(lowered({r0, r1 + " 1SEND_F1"}), "rank 1, action 8 '1SEND_F1': the last stage sends no activation", 1, 8);
  expect_bad(lowered({"0RECV_F0 " + r0, r1}), "rank 0, action 0 '0RECV_F0': the first stage receives no activation",
             0, 0);
  expect_bad(lowered({"0SEND_B0 " + r0, r1}), "rank 0, action 0 '0SEND_B0': the first stage sends no gradient", 0, 0);
  expect_bad(lowered({r0, "1RECV_B0 " + r1}), "rank 1, action 0 '1RECV_B0': the last stage receives no gradient", 1,
             0);
  expect_bad(lowered({"1RECV_F0 " + r0, r1}), "rank 0, action 0 '1RECV_F0': stage 1 runs on rank 1, not rank 0", 0, 0);
  // Receives in another order than the sends between the same two ranks.
  expect_bad(lowered({r0, "1RECV_F1 1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1"}),
             "rank 1, action 0 '1RECV_F1': out of order: rank 0 sends 0SEND_F0 to rank 1 before 0SEND_F1, so rank 1 "
             "must receive 1RECV_F0 first",
             1, 0);
  // Neighbours on one rank pass tensors locally (V shape: stages 1 and 2 on rank 1).
  const Schedule lv = lower(v2(kV));
  Schedule bad_v = lv;
  auto& row1 = bad_v.actions[1];
  row1.insert(std::find(row1.begin(), row1.end(), F(1, 0)) + 1, Action{Op::SEND_F, 1, 0});
  const int at = int(std::find(row1.begin(), row1.end(), Action{Op::SEND_F, 1, 0}) - row1.begin());
  expect_bad(bad_v,
             "rank 1, action " + std::to_string(at) +
                 " '1SEND_F0': stages 1 and 2 are both on rank 1: they pass the tensor locally, without SEND/RECV",
             1, at);
}

TEST(ScheduleValidate, LoweredDeadlock) {
  // Each rank first waits for the other's tensor.
  const Schedule s =
      from_rows(2, 1, {0, 1}, {"0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"}, /*lowered=*/true);
  expect_bad(s,
             "rank 0, action 0 '0RECV_B0': never runs: deadlock after 0 steps: rank 0 waits at action 0 '0RECV_B0' "
             "for 1SEND_B0; rank 1 waits at action 0 '1RECV_F0' for 0SEND_F0",
             0, 0);
  const LockstepResult lr = simulate_lockstep(s);
  EXPECT_TRUE(lr.deadlock);
  EXPECT_EQ(lr.steps, 0);
}
