// test_record.cpp: measured pipeline records (include/moetron/pipeline_record.h): the JSON form round-trips a
// timed replay exactly, a hand-made two-rank step gives the bubble derived by hand (measured and simulated),
// the measured durations are the per-stage means, and every malformed file is refused naming its field.
#include <gtest/gtest.h>

#include <string>

#include "moetron/check.h"
#include "moetron/pipeline_record.h"
#include "moetron/schedule.h"

using namespace moetron;
using namespace moetron::sched;

namespace {

// Two ranks, one micro-batch: rank 0 F [0,1], waits for the gradient, B [4,6]; rank 1 F [1,2], B [2,4].
// step 6; each rank busy 1 + 2 = 3: bubble 1 - 3/6 = 0.5 on both.
const char* kCsv = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n";
std::string hand_json(const std::string& ops0 = "[[0,0,1],[1,1,1],[2,1,4],[3,4,6]]",
                      const std::string& ops1 = "[[0,0,1],[1,1,2],[2,2,4],[3,4,4]]") {
  return std::string(R"({"format":"moetron.pipeline_record","version":1,"schedule":"hand","unit":"s","lowered_csv":")") +
         "0F0,0SEND_F0,0RECV_B0,0B0\\n1RECV_F0,1F0,1B0,1SEND_B0\\n" +
         R"(","steps":[{"step":3,"ranks":[{"rank":0,"ops":)" + ops0 + R"(},{"rank":1,"ops":)" + ops1 + "}]}]}";
}

std::string error_of(const std::string& text) {
  try {
    record_from_json(text, "r.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Record, HandMadeStepGivesTheHandDerivedBubble) {
  const PipelineRecord r = record_from_json(hand_json(), "hand");
  ASSERT_EQ(r.lowered.pp, 2);
  ASSERT_EQ(r.steps.size(), 1u);
  EXPECT_EQ(r.steps[0].step, 3);
  EXPECT_EQ(r.steps[0].ops[3].action, B(0, 0));  // the action comes from the schedule by index
  const TimedResult m = measured_result(r, 0);
  EXPECT_DOUBLE_EQ(m.step_time, 6);
  EXPECT_DOUBLE_EQ(m.ranks[0].busy, 3);
  EXPECT_DOUBLE_EQ(m.ranks[0].bubble_ratio, 0.5);
  EXPECT_DOUBLE_EQ(m.ranks[1].bubble_ratio, 0.5);
  EXPECT_DOUBLE_EQ(m.bubble_ratio, 0.5);
  const Durations d = measured_durations(r);
  ASSERT_EQ(d.stage.size(), 2u);
  EXPECT_DOUBLE_EQ(d.stage[0].f, 1);
  EXPECT_DOUBLE_EQ(d.stage[0].i, 2);  // a full B is fed as i with w = 0
  EXPECT_DOUBLE_EQ(d.stage[0].w, 0);
  EXPECT_DOUBLE_EQ(d.stage[1].i, 2);
  const BubbleComparison c = compare_bubbles(r);
  EXPECT_DOUBLE_EQ(c.measured[0], 0.5);
  EXPECT_DOUBLE_EQ(c.simulated[0], 0.5);  // F 0-1, F 1-2, B 2-4, B 4-6: the same picture
  EXPECT_DOUBLE_EQ(c.simulated[1], 0.5);
  // A slower rank 1 backward: measured and simulated move together (B of stage 1 now 3: step 7, rank 1 busy 4).
  const PipelineRecord r2 = record_from_json(hand_json("[[0,0,1],[1,1,1],[2,1,5],[3,5,7]]",
                                                       "[[0,0,1],[1,1,2],[2,2,5],[3,5,5]]"), "hand2");
  const BubbleComparison c2 = compare_bubbles(r2);
  EXPECT_DOUBLE_EQ(c2.measured[1], 1 - 4.0 / 7);
  EXPECT_DOUBLE_EQ(c2.simulated[1], 1 - 4.0 / 7);
}

TEST(Record, JsonRoundTripsATimedReplay) {
  GenSpec g;
  g.schedule = "interleaved_1f1b", g.pp = 2, g.vpp = 2, g.microbatches = 4;
  PipelineRecord r;
  r.schedule_name = "interleaved_1f1b";
  r.lowered = lower(generate(g));
  const TimedResult t = simulate_timed(r.lowered, Durations::uniform(r.lowered.n_stages, 0.25, 0.5, 0.125, 0.0625));
  r.steps.push_back({9, t.ops});
  r.steps.push_back({10, t.ops});
  const PipelineRecord back = record_from_json(record_to_json(r), "mem");
  EXPECT_EQ(back.schedule_name, r.schedule_name);
  EXPECT_EQ(to_csv(back.lowered), to_csv(r.lowered));
  ASSERT_EQ(back.steps.size(), 2u);
  EXPECT_EQ(back.steps[1].step, 10);
  ASSERT_EQ(back.steps[0].ops.size(), t.ops.size());
  // ops come back grouped by rank in list order; the replay lists them rank by rank too
  for (size_t k = 0; k < t.ops.size(); ++k) {
    const TimedOp &a = back.steps[0].ops[k], &b = t.ops[k];
    EXPECT_EQ(a.rank, b.rank);
    EXPECT_EQ(a.index, b.index);
    EXPECT_EQ(a.action, b.action);
    EXPECT_EQ(a.start, b.start);
    EXPECT_EQ(a.end, b.end);
  }
  // the replay's own bubble is what the measured view of it gives
  const TimedResult m = measured_result(back, 0);
  EXPECT_NEAR(m.bubble_ratio, t.bubble_ratio, 1e-12);
}

TEST(Record, MalformedFilesNameTheField) {
  EXPECT_NE(error_of("{").find("r.json: (file): not JSON"), std::string::npos);
  EXPECT_NE(error_of(R"({"format":"x"})").find("format: expected"), std::string::npos);
  std::string j = hand_json();
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = j;
    s.replace(s.find(from), from.size(), to);
    return error_of(s);
  };
  EXPECT_NE(with("\"version\":1", "\"version\":2").find("version: expected 1"), std::string::npos);
  EXPECT_NE(with("\"unit\":\"s\"", "\"unit\":\"ms\"").find("unit: expected"), std::string::npos);
  EXPECT_NE(with("0F0,0SEND_F0", "0F0,0SEND_F1").find("lowered_csv"), std::string::npos);
  EXPECT_NE(with("{\"rank\":1", "{\"rank\":0").find("steps[0].ranks[1].rank: expected 1"), std::string::npos);
  EXPECT_NE(with("[3,4,6]", "[9,4,6]").find("steps[0].ranks[0].ops[3]: index 9"), std::string::npos);
  EXPECT_NE(with("[3,4,6]", "[3,6,4]").find("ops[3]: times must be finite"), std::string::npos);
  EXPECT_NE(with("[3,4,6]", "[3,-1,4]").find("ops[3]: times"), std::string::npos);
  EXPECT_NE(with("[3,4,6]", "[3,4]").find("ops[3]: expected [index, start, end]"), std::string::npos);
  EXPECT_NE(with("[2,1,4],[3,4,6]", "[3,4,6],[2,1,4]").find("is not after the previous op"), std::string::npos);
  EXPECT_NE(with(",\"steps\":[", ",\"stepz\":[").find("steps: missing"), std::string::npos);
  EXPECT_NE(error_of(R"({"format":"moetron.pipeline_record","version":1,"schedule":"h","unit":"s","lowered_csv":")" +
                     std::string("0F0\\n1F0\\n") + R"(","steps":[]})")
                .find("lowered_csv: not a valid lowered schedule"),
            std::string::npos);
  EXPECT_THROW(read_record("/nonexistent/pipeline_record.json"), Error);
  EXPECT_THROW(compare_bubbles(PipelineRecord{}), Error);
}
