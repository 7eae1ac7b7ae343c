// test_diff_reader.cpp: `trace diff` of two hand-built runs whose change is known (it lands in its category
// and the deltas add up to the step-time change), and the reader: a written trace reads back to the same
// analysis, and malformed traces are refused with the file and the field named.
#include <gtest/gtest.h>

#include <filesystem>
#include <cmath>
#include <fstream>
#include <map>

#include "trace_builder.h"
#include "tracefile/analyze.h"
#include "tracefile/diff.h"

using namespace moetron::tracefile;
using tracetest::RankBuilder;
using tracetest::trace_of;

namespace {
constexpr double us = 1e-6;

// Two ranks: step [0, S), kernel gemm [0, 40), then the all_reduce over both, then idle.
std::vector<RankBuilder> run(double step, double recompute, double comm) {
  std::vector<RankBuilder> rs;
  for (int r = 0; r < 2; ++r) {
    RankBuilder b(r, 2);
    b.group("dp", "dp", {0, 1}).step(0, 0, step).action("B", 0, 40 + recompute).kernel("gemm", 0, 40, 4e6, 1e5);
    if (recompute > 0) b.module("layer0.recompute", 40, recompute, 0).kernel("recompute.layer", 40, recompute, 1e6, 1e5);
    b.comm("all_reduce", "dp", 0, 40 + recompute, comm, 1e6);
    rs.push_back(b);
  }
  return rs;
}

std::string tmpdir(const std::string& name) {
  const auto p = std::filesystem::temp_directory_path() / ("moetron_tracefile_" + name);
  std::filesystem::remove_all(p);
  return p.string();
}
}  // namespace

// A: step 100, compute 40, comm 10, idle 50. B (recompute on): step 120, compute 60, comm 10, idle 50.
// Step +20 us = compute +20 + exposed comm 0 + idle 0; recompute.layer is new.
TEST(TraceDiff, RecomputeLandsInCompute) {
  const Analysis a = analyze(trace_of(run(100, 0, 10), "A"));
  const Analysis b = analyze(trace_of(run(120, 20, 10), "B"));
  const TraceDiff d = diff(a, b);
  EXPECT_NEAR(d.step.delta(), 20 * us, 1e-15);
  ASSERT_EQ(d.categories.size(), 3u);
  EXPECT_EQ(d.categories[0].name, "compute");
  EXPECT_NEAR(d.categories[0].delta(), 20 * us, 1e-15);
  EXPECT_NEAR(d.categories[1].delta(), 0, 1e-15);
  EXPECT_NEAR(d.categories[2].delta(), 0, 1e-15);
  EXPECT_NEAR(d.categories[0].delta() + d.categories[1].delta() + d.categories[2].delta(), d.step.delta(), 1e-18);
  EXPECT_EQ(d.largest, "compute");
  EXPECT_NEAR(d.flops.a, 4e6, 1e-6);  // per rank and step: gemm 4e6, plus 1e6 recomputed
  EXPECT_NEAR(d.flops.b, 5e6, 1e-6);
  EXPECT_EQ(d.new_ops, (std::vector<std::string>{"module:layer0.recompute", "recompute.layer"}));
  EXPECT_TRUE(d.missing_ops.empty());
  ASSERT_FALSE(d.ops.empty());
  std::map<std::string, OpDelta> ops;
  for (const OpDelta& o : d.ops) ops[o.name] = o;
  EXPECT_EQ(ops["recompute.layer"].status, "new");
  EXPECT_NEAR(ops["recompute.layer"].time_b, 20 * us, 1e-15);
  EXPECT_NEAR(ops["recompute.layer"].time_b - ops["recompute.layer"].time_a, 20 * us, 1e-15);
  EXPECT_NEAR(ops["recompute.layer"].rate_b, 1e6 / 20e-6, 1e-3);
  EXPECT_EQ(ops["recompute.layer"].rate_unit, "FLOP/s");
  EXPECT_EQ(ops["module:layer0.recompute"].kind, "module");
  EXPECT_NEAR(ops["module:layer0.recompute"].time_b, 20 * us, 1e-15);
  EXPECT_NEAR(ops["module:layer0.recompute"].count_b, 1, 1e-12);
  EXPECT_NEAR(std::fabs(d.ops[0].time_b - d.ops[0].time_a), 20 * us, 1e-15);  // largest change first
  for (const OpDelta& o : d.ops) {
    if (o.name == "gemm") {
      EXPECT_NEAR(o.time_b - o.time_a, 0, 1e-15);
    }
  }
  EXPECT_NEAR(d.actions[0].delta(), 20 * us, 1e-15);  // the B action grew by the recompute
  // Swapped: the op is missing in B, the step shrinks by the same compute.
  const TraceDiff back = diff(b, a);
  EXPECT_EQ(back.missing_ops, (std::vector<std::string>{"module:layer0.recompute", "recompute.layer"}));
  EXPECT_NEAR(back.categories[0].delta(), -20 * us, 1e-15);
}

// A slower all-reduce (10 -> 30 us) lands in exposed communication, all_reduce kind.
TEST(TraceDiff, SlowerCollectiveLandsInExposedComm) {
  const TraceDiff d = diff(analyze(trace_of(run(100, 0, 10))), analyze(trace_of(run(120, 0, 30))));
  EXPECT_EQ(d.largest, "exposed_comm");
  EXPECT_NEAR(d.categories[1].delta(), 20 * us, 1e-15);
  EXPECT_NEAR(d.categories[0].delta(), 0, 1e-15);
  ASSERT_FALSE(d.exposed_comm_by_kind.empty());
  EXPECT_EQ(d.exposed_comm_by_kind[0].name, "all_reduce");
  EXPECT_NEAR(d.exposed_comm_by_kind[0].delta(), 20 * us, 1e-15);
  const nlohmann::json j = to_json(d);
  EXPECT_EQ(j["largest_category"], "exposed_comm");
  EXPECT_NE(format_text(d).find("exposed comm +0.020"), std::string::npos);
}

TEST(TraceReader, WrittenTraceReadsBackToTheSameAnalysis) {
  auto rs = run(100, 20, 10);
  rs[0].limits(1e11, 1e10);
  rs[1].limits(1e11, 1e10);
  rs[0].t.memory.push_back({"memory", 5, {{"params", 100}, {"activations", 40}}});
  const std::string dir = tmpdir("roundtrip");
  for (const auto& r : rs) write_rank_file(r.t, dir);
  const Trace t = read_dir(dir);
  ASSERT_EQ(t.world(), 2);
  EXPECT_EQ(t.ranks[1].meta.groups.at("dp").ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(t.ranks[0].meta.limits.flops_per_s, 1e11);
  const nlohmann::json a = to_json(analyze(trace_of(rs, dir)));
  const nlohmann::json b = to_json(analyze(t));
  EXPECT_EQ(a, b);
  EXPECT_EQ(b["ranks"][0]["peak_memory_bytes"]["params"], 100);
}

namespace {
// Rank 0's file with one event replaced, read back: the error message.
std::string refusal(const std::string& event_json, const std::string& meta_extra = "") {
  const std::string dir = tmpdir("bad");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/rank0.trace.json")
      << R"({"traceEvents": [)" << event_json
      << R"(], "moetron": {"format": "moetron-trace", "version": 1, "rank": 0, "world": 1, "source": "engine",
            "groups": {"g": {"name": "dp", "ranks": [0]}})" << meta_extra << "}}";
  try {
    read_dir(dir);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(accepted)";
}
}  // namespace

TEST(TraceReader, RefusalsNameFileEventAndField) {
  EXPECT_NE(refusal(R"({"ph":"X","cat":"comm","name":"all_reduce","pid":0,"tid":0,"ts":1,"dur":2,"args":{"group":"g"}})")
                .find("traceEvents[0] (comm 'all_reduce') args: seq missing"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"ph":"X","cat":"comm","name":"all_reduce","pid":0,"tid":0,"ts":1,"dur":2,"args":{"group":"h","seq":0}})")
                .find("group 'h' is not in moetron.groups"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"ph":"X","cat":"kernel","name":"k","pid":0,"tid":0,"ts":1,"dur":-2})").find("dur = -2 must be >= 0"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"ph":"X","cat":"step","name":"step","pid":0,"tid":0,"ts":1,"dur":2,"args":{}})").find("step missing"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"ph":"X","cat":"kernel","name":"k","pid":3,"tid":0,"ts":1,"dur":2})").find("pid = 3"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"ph":"X","cat":"comm","name":"send","pid":0,"tid":0,"ts":1,"dur":0,"args":{}})").find("peer missing"),
            std::string::npos);
  EXPECT_NE(refusal("", R"(, "limits": {"flops_per_s": "fast", "bytes_per_s": 1})").find("flops_per_s = \"fast\" is not a number"),
            std::string::npos);
  EXPECT_EQ(refusal(R"({"ph":"X","cat":"kernel","name":"k","pid":0,"tid":0,"ts":1,"dur":2})"), "(accepted)");

  const std::string dir = tmpdir("missing_rank");
  RankBuilder r0(0, 2);
  write_rank_file(r0.t, dir);
  try {
    read_dir(dir);
    FAIL() << "a missing rank was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("rank1.trace.json missing (rank 0 says world = 2)"), std::string::npos) << e.what();
  }
  try {
    read_dir(tmpdir("empty_dir_that_does_not_exist"));
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("not a directory"), std::string::npos);
  }
}
