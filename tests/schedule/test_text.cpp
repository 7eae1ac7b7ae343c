// test_text.cpp: the schedule IR's text and CSV forms: every action kind round-trips, bad text is refused
// with a message naming it, CSV rows become ranks with inferred stages and placement. Not the generators.
#include <gtest/gtest.h>

#include "../unit/test_util.h"
#include "moetron/check.h"
#include "moetron/schedule.h"

using namespace moetron;
using namespace moetron::sched;

namespace {
using moetron::testing::error_of;
}  // namespace

TEST(ScheduleText, EveryKindRoundTrips) {
  const std::vector<std::pair<Action, std::string>> cases = {
      {F(0, 3), "0F3"},
      {B(1, 0), "1B0"},
      {I(1, 2), "1I2"},
      {W(1, 2), "1W2"},
      {{Op::SEND_F, 2, 5}, "2SEND_F5"},
      {{Op::RECV_F, 3, 5}, "3RECV_F5"},
      {{Op::SEND_B, 3, 1}, "3SEND_B1"},
      {{Op::RECV_B, 2, 1}, "2RECV_B1"},
      {FB(0, 3, 5, 1), "0F3&5B1"},
      {FB(12, 40, 3, 17, Op::I), "12F40&3I17"},
  };
  for (const auto& [a, text] : cases) {
    EXPECT_EQ(to_string(a), text);
    EXPECT_EQ(parse_action(text), a) << text;
  }
  EXPECT_EQ(parse_action("  7W11 "), W(7, 11));
  EXPECT_EQ(fwd_half(FB(0, 3, 5, 1)), F(0, 3));
  EXPECT_EQ(bwd_half(FB(0, 3, 5, 1, Op::I)), I(5, 1));
}

TEST(ScheduleText, BadActionsNameTheText) {
  EXPECT_NE(error_of([] { parse_action("F3"); }).find("'F3': expected a stage number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_action("0X3"); }).find("'0X3': unknown kind"), std::string::npos);
  EXPECT_NE(error_of([] { parse_action("0F"); }).find("'0F': expected a micro-batch number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_action("0F3x"); }).find("unexpected 'x'"), std::string::npos);
  EXPECT_NE(error_of([] { parse_action("0B3&1B2"); }).find("must be an F"), std::string::npos);
  EXPECT_NE(error_of([] { parse_action("0F3&1W2"); }).find("must be a B or an I"), std::string::npos);
  EXPECT_NE(error_of([] { parse_action(""); }).find("empty action"), std::string::npos);
  EXPECT_NE(error_of([] { parse_action("99999999999F1"); }).find("too long"), std::string::npos);
}

TEST(ScheduleText, CsvRoundTripsAndInfersShape) {
  Schedule s;
  s.name = "csv";
  s.pp = 2;
  s.n_stages = 4;
  s.n_microbatches = 2;
  s.stage_rank = {0, 1, 1, 0};  // a V
  s.actions = {{F(0, 0), F(0, 1), F(3, 0), B(3, 0), B(0, 0), F(3, 1), B(3, 1), B(0, 1)},
               {F(1, 0), F(2, 0), F(1, 1), F(2, 1), B(2, 0), B(1, 0), B(2, 1), B(1, 1)}};
  const std::string csv = to_csv(s);
  EXPECT_EQ(csv.substr(0, csv.find('\n')), "0F0,0F1,3F0,3B0,0B0,3F1,3B1,0B1");
  const Schedule back = from_csv(csv);
  EXPECT_EQ(back, s);
  EXPECT_FALSE(back.lowered);
  // Windows line ends, spaces and an empty trailing cell are accepted; communication marks it lowered.
  const Schedule l = from_csv("0F0 , 0SEND_F0,\r\n1RECV_F0,1F0\r\n");
  EXPECT_TRUE(l.lowered);
  EXPECT_EQ(l.pp, 2);
  EXPECT_EQ(l.n_stages, 2);
  EXPECT_EQ(l.stage_rank, (std::vector<int>{0, 1}));
  EXPECT_EQ(l.actions[0].size(), 2u);
}

TEST(ScheduleText, BadCsvNamesRowAndColumn) {
  EXPECT_NE(error_of([] { from_csv("0F0,0F1\n1F0,1Q1\n"); }).find("CSV row 2, column 2"), std::string::npos);
  EXPECT_NE(error_of([] { from_csv("\n\n"); }).find("no rows"), std::string::npos);
  EXPECT_NE(error_of([] { from_csv("0F0,2F0\n1F0\n"); }).find("3 stages on 2 ranks"), std::string::npos);
  EXPECT_NE(error_of([] { from_csv("0F0,3F0,0B0\n2F0,2B0\n"); }).find("no rank computes stage 1"), std::string::npos);
  EXPECT_NE(error_of([] { from_csv("0F0,999999999F0\n"); }).find("only 2 compute actions"), std::string::npos);
  EXPECT_NE(error_of([] { read_csv_file("/no/such/schedule.csv"); }).find("/no/such/schedule.csv"),
            std::string::npos);
}

TEST(ScheduleText, Placements) {
  EXPECT_EQ(loop_placement(2, 6), (std::vector<int>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(v_placement(3), (std::vector<int>{0, 1, 2, 2, 1, 0}));
  EXPECT_NE(error_of([] { loop_placement(4, 6); }).find("multiple of pp = 4"), std::string::npos);
}
