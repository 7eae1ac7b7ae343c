// test_mpi_trace.cpp: per-rank traces of multi-rank runs (docs/profiling.md), run by CTest under
// `mpirun --oversubscribe -np 4`: ds_tiny with expert parallelism (dp 4, ep 2: the dp, ep and edp groups), with
// pipeline parallelism (pp 2 x dp 2, 1f1b), with FSDP (dp 4, zero 3: gathers and reduce-scatters inside the
// modules) and with tensor parallelism (tp 2 x dp 2 x ep 2: the tp group's gathers and reduce-scatters in every
// layer, which `trace analyze` reports apart from EP and DP) and with context parallelism (cp 2 x dp 2 x ep 2: the
// ring's sends and receives in the cp group, paired by `trace merge`), 3 steps each, each profiled into one shared folder. Rank 0 then
// checks: every rank's file exists and nests; the groups agree across their members; every collective's
// sequence number is seen by every member of its group with the same operation (and all-to-all byte counts
// agree between sender and receiver); and `trace merge` pairs every send with its receive and writes valid JSON
// with the flows. Not a check of timings.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

#include "../unit/trace_check.h"
#include "moetron/config.h"
#include "moetron/trainer.h"
#include "train_check.h"
#include "tracefile/analyze.h"
#include "tracefile/merge.h"
#include "tracefile/reader.h"

using namespace moetron;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Trains ds_tiny with `layout` overrides, profiled into <dir>/trace; returns the folder (on every rank).
std::string traced_run(const std::string& name, std::vector<std::string> layout) {
  const std::string dir = mt_test::shared_dir("moetron_mpi_trace_", name);
  std::vector<std::string> ov = {"--job.dump_folder=" + dir,     "--training.steps=3",
                                 "--training.micro_batch_size=2", "--training.global_batch_size=8",
                                 "--metrics.peak_tflops=1.0",     "--profiling.enable=true",
                                 "--profiling.folder=" + dir + "/trace"};
  ov.insert(ov.end(), layout.begin(), layout.end());
  const JobConfig cfg = load_config(mt_test::repo("configs/ds_tiny.toml"), ov);
  TrainOptions o;
  o.quiet = true;
  o.comm = &mt_test::world();
  train(cfg, o);
  mt_test::world().barrier();
  return dir + "/trace";
}

// The checks of one run's folder (rank 0).
void check_folder(const std::string& dir, bool expect_p2p) {
  const int W = mt_test::world().size();
  std::vector<json> ranks;
  for (int r = 0; r < W; ++r) {
    const std::string f = dir + "/rank" + std::to_string(r) + ".trace.json";
    ASSERT_TRUE(fs::exists(f)) << f;
    std::ifstream in(f);
    ranks.push_back(json::parse(in));
    EXPECT_EQ(ranks.back()["moetron"]["rank"], r);
    EXPECT_EQ(ranks.back()["moetron"]["world"], W);
    EXPECT_EQ(ranks.back()["moetron"]["dropped_events"], 0);
    EXPECT_EQ(moetron::testing::trace_nesting_problem(ranks.back()), "") << f;
  }
  // Groups: one description per id, and each member's file knows the group.
  std::map<std::string, json> groups;
  for (const auto& t : ranks)
    for (auto it = t["moetron"]["groups"].begin(); it != t["moetron"]["groups"].end(); ++it) {
      if (groups.count(it.key())) { EXPECT_EQ(groups[it.key()], it.value()) << it.key(); }
      groups[it.key()] = it.value();
    }
  // Collectives: (seq -> op) per group and rank; all-to-all counts per (group, seq, rank).
  std::map<std::string, std::map<int, std::map<int64_t, std::string>>> seqs;
  std::map<std::tuple<std::string, int64_t, int>, json> a2a;
  int64_t sends = 0, collectives = 0;
  for (int r = 0; r < W; ++r)
    for (const auto& e : ranks[size_t(r)]["traceEvents"]) {
      if (e.value("cat", "") != "comm") continue;
      const json& a = e["args"];
      const std::string g = a["group"];
      ASSERT_TRUE(groups.count(g)) << g;
      sends += e["name"] == "send";
      if (!a.contains("seq")) continue;
      ++collectives;
      seqs[g][r][a["seq"].get<int64_t>()] = e["name"];
      if (a.contains("recv_bytes")) a2a[{g, a["seq"].get<int64_t>(), r}] = a;
    }
  EXPECT_GT(collectives, 0);
  for (auto& [g, by_rank] : seqs) {
    const json& members = groups[g]["ranks"];
    for (const auto& m : members) {
      const int r = m.get<int>();
      ASSERT_TRUE(by_rank.count(r)) << "group " << g << ": member " << r << " recorded none of its collectives";
      EXPECT_EQ(by_rank[r], by_rank[members[0].get<int>()]) << "group " << g << ": rank " << r << " vs "
                                                            << members[0];
    }
  }
  for (auto& [key, a] : a2a) {  // what rank a sent to member j is what member j received from a
    const auto& [g, seq, r] = key;
    const json& members = groups[g]["ranks"];
    const int me = int(std::find(members.begin(), members.end(), json(r)) - members.begin());
    for (size_t j = 0; j < members.size(); ++j) {
      const auto other = a2a.find({g, seq, members[j].get<int>()});
      ASSERT_NE(other, a2a.end());
      EXPECT_EQ(a["send_bytes"][j], other->second["recv_bytes"][size_t(me)]) << g << " seq " << seq;
    }
  }
  // Merge: one process per rank, every send with its receive, valid JSON.
  const tracefile::MergeResult m = tracefile::merge_trace_dir(dir);
  EXPECT_EQ(m.ranks, W);
  EXPECT_EQ(m.unmatched_sends, 0);
  EXPECT_EQ(m.unmatched_recvs, 0);
  EXPECT_EQ(m.flows, sends);
  if (expect_p2p) { EXPECT_GT(m.flows, 0); }
  const json back = json::parse(m.trace.dump());
  std::map<int64_t, int> ends;
  std::set<int> pids;
  for (const auto& e : back["traceEvents"]) {
    if (e.value("cat", "") == "flow") ends[e["id"].get<int64_t>()] += e["ph"] == "s" ? 1 : 10;
    if (e.value("name", "") == "process_name") pids.insert(e["pid"].get<int>());
  }
  EXPECT_EQ(int64_t(ends.size()), m.flows);
  for (auto& [id, n] : ends) EXPECT_EQ(n, 11) << "flow " << id << " lacks its start or its end";
  EXPECT_EQ(int(pids.size()), W);
}

}  // namespace

TEST(MpiTrace, ExpertParallelRun) {
  if (mt_test::world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const std::string dir = traced_run("ep", {"--parallelism.dp_shard=4", "--parallelism.ep=2"});
  if (mt_test::world().rank() == 0) check_folder(dir, false);
  mt_test::world().barrier();
}

TEST(MpiTrace, PipelineRun) {
  if (mt_test::world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const std::string dir = traced_run("pp", {"--parallelism.pp=2", "--parallelism.dp_shard=2"});
  if (mt_test::world().rank() == 0) check_folder(dir, true);
  mt_test::world().barrier();
}

TEST(MpiTrace, FsdpRun) {
  if (mt_test::world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const std::string dir = traced_run("fsdp", {"--parallelism.dp_shard=4", "--parallelism.zero=3"});
  if (mt_test::world().rank() == 0) check_folder(dir, false);
  mt_test::world().barrier();
}

TEST(MpiTrace, TensorParallelRun) {
  if (mt_test::world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const std::string dir = traced_run("tp", {"--parallelism.tp=2", "--parallelism.expert_tp=2", "--parallelism.dp_shard=2",
                                            "--parallelism.ep=2"});
  if (mt_test::world().rank() == 0) {
    check_folder(dir, false);
    const tracefile::Analysis a = tracefile::analyze(tracefile::read_dir(dir));
    ASSERT_EQ(a.ranks.size(), 4u);
    for (const auto& r : a.ranks) {  // every rank spent exposed time in each parallelism's collectives
      for (const char* g : {"tp", "ep", "dp"})
        EXPECT_GT(r.exposed_comm_by_group.count(g) ? r.exposed_comm_by_group.at(g) : 0.0, 0.0)
            << "rank " << r.rank << ": no exposed " << g << " communication";
    }
  }
  mt_test::world().barrier();
}

TEST(MpiTrace, ContextParallelRun) {
  if (mt_test::world().size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const std::string dir = traced_run("cp", {"--parallelism.cp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2"});
  if (mt_test::world().rank() == 0) {
    check_folder(dir, true);  // the ring's sends pair with their receives
    const tracefile::Analysis a = tracefile::analyze(tracefile::read_dir(dir));
    ASSERT_EQ(a.ranks.size(), 4u);
    for (const auto& r : a.ranks)
      for (const char* g : {"cp", "ep", "dp_cp"})
        EXPECT_GT(r.exposed_comm_by_group.count(g) ? r.exposed_comm_by_group.at(g) : 0.0, 0.0)
            << "rank " << r.rank << ": no exposed " << g << " communication";
  }
  mt_test::world().barrier();
}
