// test_merge.cpp: `moetron trace merge` on hand-made rank files (docs/profiling.md): one process per rank, the
// flow pairing rule (group, sender, receiver, tag, message index), unmatched ends counted, and the errors a bad
// folder or file gets. Linked against moetron_tracefile only.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>

#include "tracefile/merge.h"

using json = nlohmann::json;
using namespace moetron::tracefile;
namespace fs = std::filesystem;

namespace {

json rank_file(int rank, int world, json events) {
  json t = {{"traceEvents", json::array()}, {"displayTimeUnit", "ms"}};
  t["traceEvents"].push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                              {"args", {{"name", "rank " + std::to_string(rank)}}}});
  for (auto& e : events) t["traceEvents"].push_back(e);
  t["moetron"] = {{"format", "moetron-trace"}, {"version", 1}, {"rank", rank}, {"world", world}, {"config", "x"},
                  {"groups", {{"pp@0", {{"name", "pp"}, {"ranks", {0, 1}}}}}}};
  return t;
}

json p2p(const char* name, int pid, double ts, int peer, int tag, int msg, const char* group = "pp@0") {
  return {{"name", name}, {"cat", "comm"}, {"ph", "X"}, {"pid", pid}, {"tid", 0}, {"ts", ts}, {"dur", 2.0},
          {"args", {{"group", group}, {"peer", peer}, {"tag", tag}, {"msg", msg}, {"bytes_in", 0}, {"bytes_out", 4}}}};
}

std::string fresh_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("moetron_merge_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TraceMerge, FlowsPairTheKthSendWithTheKthReceive) {
  // Rank 0 sends messages 0, 1, 2 to rank 1 on tag 5; rank 1's receives are listed out of time order, and its
  // trace lacks message 0 (outside its profiled steps). A message with another tag and one on another group only
  // pair with their own kind.
  json r0 = rank_file(0, 2, {p2p("send", 0, 10, 1, 5, 0), p2p("send", 0, 20, 1, 5, 1), p2p("send", 0, 30, 1, 5, 2),
                             p2p("send", 0, 40, 1, 6, 0), p2p("recv", 0, 50, 1, 5, 0, "dp@0")});
  json r1 = rank_file(1, 2, {p2p("recv", 1, 35, 0, 5, 2), p2p("recv", 1, 25, 0, 5, 1), p2p("recv", 1, 45, 0, 6, 0),
                             p2p("send", 1, 48, 0, 5, 0, "dp@0")});
  const MergeResult m = merge_traces({r0, r1}, {"r0", "r1"});
  EXPECT_EQ(m.ranks, 2);
  EXPECT_EQ(m.flows, 4);  // msgs 1 and 2 on tag 5, tag 6, and the dp@0 message from 1 to 0
  EXPECT_EQ(m.unmatched_sends, 1);
  EXPECT_EQ(m.unmatched_recvs, 0);
  // Each flow: a start inside a send slice and an end inside the matching receive slice, one id.
  std::map<int64_t, json> starts, ends;
  for (const auto& e : m.trace["traceEvents"]) {
    if (e.value("cat", "") != "flow") continue;
    (e["ph"] == "s" ? starts : ends)[e["id"].get<int64_t>()] = e;
    if (e["ph"] == "f") { EXPECT_EQ(e["bp"], "e"); }
  }
  ASSERT_EQ(starts.size(), 4u);
  ASSERT_EQ(ends.size(), 4u);
  std::multiset<std::pair<double, double>> pairs;
  for (auto& [id, s] : starts) pairs.insert({s["ts"].get<double>(), ends.at(id)["ts"].get<double>()});
  // Midpoints of the slices (dur 2): 21 -> 26, 31 -> 36, 41 -> 46, 49 -> 51.
  EXPECT_EQ(pairs, (std::multiset<std::pair<double, double>>{{21, 26}, {31, 36}, {41, 46}, {49, 51}}));
  // One process per rank, both ranks' events kept, metadata merged.
  int procs = 0;
  for (const auto& e : m.trace["traceEvents"]) procs += e.value("name", "") == "process_name";
  EXPECT_EQ(procs, 2);
  EXPECT_EQ(m.trace["moetron"]["format"], "moetron-trace-merged");
  EXPECT_EQ(m.trace["moetron"]["ranks"].size(), 2u);
  EXPECT_FALSE(m.trace["moetron"]["ranks"][0].contains("config"));
  EXPECT_EQ(m.trace["moetron"]["config"], "x");
  EXPECT_TRUE(m.trace["moetron"]["groups"].contains("pp@0"));
  EXPECT_EQ(json::parse(m.trace.dump()), m.trace);  // valid JSON back
}

TEST(TraceMerge, WithoutMessageIndexTimeOrderPairs) {
  json s0 = p2p("send", 0, 10, 1, 5, 0), s1 = p2p("send", 0, 20, 1, 5, 0);
  json d0 = p2p("recv", 1, 30, 0, 5, 0), d1 = p2p("recv", 1, 12, 0, 5, 0);
  for (json* e : {&s0, &s1, &d0, &d1}) (*e)["args"].erase("msg");
  const MergeResult m = merge_traces({rank_file(0, 2, {s1, s0}), rank_file(1, 2, {d0, d1})}, {"a", "b"});
  EXPECT_EQ(m.flows, 2);
  std::map<int64_t, std::pair<double, double>> f;
  for (const auto& e : m.trace["traceEvents"])
    if (e.value("cat", "") == "flow")
      (e["ph"] == "s" ? f[e["id"].get<int64_t>()].first : f[e["id"].get<int64_t>()].second) = e["ts"].get<double>();
  std::set<std::pair<double, double>> got;
  for (auto& [id, p] : f) got.insert(p);
  EXPECT_EQ(got, (std::set<std::pair<double, double>>{{11, 13}, {21, 31}}));
}

TEST(TraceMerge, FolderAndFileErrorsNameTheProblem) {
  const std::string dir = fresh_dir("errors");
  EXPECT_NE(error_of([&] { merge_trace_dir(dir); }).find("no rank<r>.trace.json files"), std::string::npos);
  EXPECT_NE(error_of([&] { merge_trace_dir(dir + "/nope"); }).find("not a directory"), std::string::npos);
  std::ofstream(dir + "/rank0.trace.json") << rank_file(0, 2, {}).dump();
  EXPECT_NE(error_of([&] { merge_trace_dir(dir); }).find("rank 1 of 2 has no trace file"), std::string::npos);
  std::ofstream(dir + "/rank1.trace.json") << "{\"traceEvents\": [";
  EXPECT_NE(error_of([&] { merge_trace_dir(dir); }).find("rank1.trace.json: not valid JSON"), std::string::npos);
  json bad = rank_file(1, 2, {});
  bad["moetron"]["version"] = 2;
  std::ofstream(dir + "/rank1.trace.json") << bad.dump();
  EXPECT_NE(error_of([&] { merge_trace_dir(dir); }).find("moetron.version 2 is not supported"), std::string::npos);
  std::ofstream(dir + "/rank1.trace.json") << rank_file(1, 2, {}).dump();
  const MergeResult ok = merge_trace_dir(dir);
  EXPECT_EQ(ok.ranks, 2);
  EXPECT_NE(error_of([&] { merge_traces({rank_file(0, 2, {}), rank_file(0, 2, {})}, {"x", "y"}); }).find("y: rank 0 again"),
            std::string::npos);
  fs::remove_all(dir);
}
