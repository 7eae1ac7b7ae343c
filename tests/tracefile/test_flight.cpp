// test_flight.cpp: `moetron trace flight` on hand-made flight-recorder dumps (docs/reliability.md, "Watchdog"): a
// rank that never scheduled a collective the others started, a rank without a dump, a kind and a size
// disagreement (and sizes that may differ: all_to_all_v), a clean set, and malformed dumps refused by field.
// Linked against moetron_tracefile only.
#include <gtest/gtest.h>

#include <stdexcept>

#include "tracefile/flight.h"

using json = nlohmann::json;
using namespace moetron::tracefile;

namespace {

json entry(const std::string& group, int64_t seq, const std::string& kind, int64_t bytes, const std::string& state,
           double t = 1.0) {
  return {{"group", group}, {"seq", seq}, {"kind", kind}, {"bytes", bytes}, {"state", state},
          {"t_scheduled", 0.0}, {"t_started", t}, {"t_completed", state == "completed" ? t + 0.1 : 0.0}};
}

json dump(int rank, int world, json entries, const std::string& reason = "timeout") {
  json g = json::object();
  std::vector<int> all;
  for (int r = 0; r < world; ++r) all.push_back(r);
  for (const auto& e : entries) g[e["group"].get<std::string>()] = all;
  return {{"rank", rank}, {"world_size", world}, {"reason", reason}, {"now", 9.0}, {"entries", entries}, {"groups", g}};
}

}  // namespace

TEST(Flight, NamesTheRankThatNeverScheduledTheCollective) {
  std::vector<json> d;
  for (int r : {0, 2, 3})
    d.push_back(dump(r, 4, {entry("dp@0", 9, "all_reduce", 128, "completed"), entry("dp@0", 10, "all_reduce", 8, "started", 2.0)}));
  d.push_back(dump(1, 4, {entry("dp@0", 9, "all_reduce", 128, "completed")}, "rank 0 timed out"));
  const FlightAnalysis a = analyze_flight(d);
  ASSERT_EQ(a.missing.size(), 1u);
  EXPECT_EQ(a.missing[0].group, "dp@0");
  EXPECT_EQ(a.missing[0].seq, 10);
  EXPECT_EQ(a.missing[0].started, (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(a.missing[0].absent, (std::vector<int>{1}));
  EXPECT_TRUE(a.mismatches.empty());
  EXPECT_NE(a.text().find("NOT JOINED: all_reduce #10 on dp@0 (8 bytes), started by rank(s) 0, 2, 3; never scheduled by "
                          "rank(s) 1"),
            std::string::npos)
      << a.text();
}

TEST(Flight, AMemberWithoutADumpIsNamed) {
  std::vector<json> d;
  for (int r : {0, 1}) d.push_back(dump(r, 3, {entry("world@0", 4, "barrier", 0, "started")}));
  const FlightAnalysis a = analyze_flight(d);
  ASSERT_EQ(a.missing.size(), 1u);
  EXPECT_EQ(a.missing[0].no_dump, (std::vector<int>{2}));
  EXPECT_TRUE(a.missing[0].absent.empty());
  EXPECT_NE(a.text().find("no dump from rank(s) 2"), std::string::npos) << a.text();
}

TEST(Flight, KindAndSizeDisagreementsAreReported) {
  std::vector<json> d = {dump(0, 2, {entry("world@0", 7, "all_reduce", 32, "started")}),
                         dump(1, 2, {entry("world@0", 7, "barrier", 0, "started")})};
  FlightAnalysis a = analyze_flight(d);
  ASSERT_EQ(a.mismatches.size(), 1u);
  EXPECT_EQ(a.mismatches[0].seq, 7);
  EXPECT_NE(a.text().find("DISAGREE: world@0 #7: rank 0 all_reduce 32 bytes; rank 1 barrier 0 bytes;"), std::string::npos)
      << a.text();
  // sizes of an all_reduce must agree ...
  d = {dump(0, 2, {entry("dp@0", 3, "all_reduce", 32, "started")}), dump(1, 2, {entry("dp@0", 3, "all_reduce", 64, "started")})};
  EXPECT_EQ(analyze_flight(d).mismatches.size(), 1u);
  // ... those of an all_to_all_v need not
  d = {dump(0, 2, {entry("ep@0", 3, "all_to_all_v", 32, "completed")}),
       dump(1, 2, {entry("ep@0", 3, "all_to_all_v", 64, "completed")})};
  EXPECT_TRUE(analyze_flight(d).mismatches.empty());
}

TEST(Flight, AWaitingReceiveWhoseSendWasNeverPostedIsNamed) {
  // pp@0 = world ranks {0, 1, 2}: rank 0 waits for message 4 from group rank 1; rank 2 waits for message 4 from
  // rank 1 too, but rank 1 has posted that one; rank 1 is in no call.
  auto p2p = [](const std::string& kind, const std::string& state, int peer, int64_t msg) {
    json e = entry("pp@0", -1, kind, 64, state);
    e["peer"] = peer, e["tag"] = 29000, e["msg"] = msg;
    return e;
  };
  std::vector<json> d = {dump(0, 3, {p2p("recv", "completed", 1, 3), p2p("recv", "started", 1, 4)}),
                         dump(1, 3, {p2p("send", "completed", 0, 3), p2p("send", "scheduled", 2, 4)}),
                         dump(2, 3, {p2p("recv", "started", 1, 4)})};
  const FlightAnalysis a = analyze_flight(d);
  ASSERT_EQ(a.unsent.size(), 1u);
  EXPECT_EQ(a.unsent[0].receiver, 0);
  EXPECT_EQ(a.unsent[0].sender, 1);
  EXPECT_EQ(a.unsent[0].msg, 4);
  EXPECT_EQ(a.idle, (std::vector<int>{1}));
  EXPECT_NE(a.text().find("NOT SENT: rank 0 waits for message #4 (tag 29000, 64 bytes) from rank 1 on pp@0; rank 1 never "
                          "posted it"),
            std::string::npos)
      << a.text();
  EXPECT_NE(a.text().find("rank(s) 1 were inside no communication call"), std::string::npos) << a.text();
}

TEST(Flight, ACleanSetReportsNothing) {
  std::vector<json> d = {dump(0, 2, {entry("dp@0", 1, "all_reduce", 8, "completed")}),
                         dump(1, 2, {entry("dp@0", 1, "all_reduce", 8, "completed")})};
  const FlightAnalysis a = analyze_flight(d);
  EXPECT_TRUE(a.missing.empty());
  EXPECT_TRUE(a.mismatches.empty());
  EXPECT_NE(a.text().find("no collective that some ranks started"), std::string::npos);
}

TEST(Flight, MalformedDumpsAreRefusedByField) {
  json d = dump(0, 1, {entry("dp@0", 1, "all_reduce", 8, "completed")});
  d.erase("groups");
  try {
    analyze_flight({d});
    ADD_FAILURE() << "accepted a dump without groups";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0's dump: missing field \"groups\""), std::string::npos) << e.what();
  }
  d = dump(0, 1, {entry("dp@0", 1, "all_reduce", 8, "completed")});
  d["entries"][0]["seq"] = "one";
  EXPECT_THROW(analyze_flight({d}), std::exception);
  EXPECT_THROW(analyze_flight_dir("/nonexistent/flight"), std::exception);
}
