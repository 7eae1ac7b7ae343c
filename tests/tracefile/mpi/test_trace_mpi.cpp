// test_trace_mpi.cpp: `trace analyze` on traces the engine's recorder writes over real MPI (the Comm trace sink
// numbers the collectives; the files come from trace::end_session). One rank sleeps before one all-reduce: the
// analysis must show that as wait on the other ranks and name the late rank the straggler; the sleep, outside any
// kernel or collective, is the late rank's idle time, and the kernel scopes' 7 ms per step its compute. Run under
// mpirun with 4 ranks (tests/CMakeLists.txt: trace.mpi.np4). The delay lives here, in the test, not in the engine.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "moetron/comm.h"
#include "moetron/trace.h"
#include "tracefile/analyze.h"
#include "tracefile/reader.h"

using namespace moetron;

namespace {

// A kernel scope of about `ms` milliseconds. It sleeps rather than spins: four ranks share two cores in the
// test, and spinning ranks would make each other late at random; inside a kernel scope the time is compute.
void work(double ms) {
  MT_TRACE("test.work");
  std::this_thread::sleep_for(std::chrono::microseconds(int64_t(ms * 1000)));
}

}  // namespace

TEST(TraceMpi, InjectedDelayShowsAsWaitOnTheOthersAndNamesTheLateRank) {
  const Comm w = comm_world();
  ASSERT_GE(w.size(), 2) << "run under mpirun with several ranks";
  const int late = w.size() - 1;
  constexpr double kDelayMs = 150;
  constexpr int kSteps = 3;
  const std::string dir = (std::filesystem::temp_directory_path() / ("moetron_trace_mpi_np" + std::to_string(w.size()))).string();
  if (w.rank() == 0) std::filesystem::remove_all(dir);
  w.barrier();

  trace::reset();
  trace::begin_session(w, 100000, nlohmann::json{{"source", "engine"}});
  trace::enable(true);
  std::vector<float> buf(1024, 1.0f);
  for (int s = 0; s < kSteps; ++s) {
    const double t0 = trace::now_us();
    work(5);
    if (s == 1 && w.rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(int(kDelayMs)));
    w.all_reduce(buf.data(), int64_t(buf.size()));
    work(2);
    w.barrier();
    trace::record_step(s, t0, trace::now_us());
  }
  trace::enable(false);
  trace::end_session(dir + "/" + tracefile::rank_file_name(w.rank()));
  w.barrier();

  const tracefile::Analysis a = tracefile::analyze(tracefile::read_dir(dir));
  ASSERT_EQ(a.world, w.size());
  EXPECT_EQ(a.steps, kSteps);
  EXPECT_EQ(a.unmatched_collectives, 0);
  EXPECT_EQ(a.straggler_rank, late);
  // Each term of the breakdown against what the test did (per step, the mean over kSteps steps): compute is the
  // two kernel scopes, 7 ms of sleep (more when the sleeps overrun, far less than the delay); the late rank's idle
  // is its delay (it sleeps outside any scope), and nobody else's.
  const double delay_per_step = kDelayMs * 1e-3 / kSteps;
  for (const auto& r : a.ranks) {
    EXPECT_GT(r.compute_s, 0.006) << "rank " << r.rank;
    EXPECT_LT(r.compute_s, 0.007 + 0.5 * delay_per_step) << "rank " << r.rank;
    if (r.rank == late) {
      EXPECT_GT(r.idle_s, 0.9 * delay_per_step) << "rank " << r.rank;
      continue;
    }
    EXPECT_LT(r.idle_s, 0.5 * delay_per_step) << "rank " << r.rank;
    // Every other rank waited about the delay in that step's all-reduce: per step, a third of it at least (the
    // late rank's sleep minus scheduling noise, over kSteps steps).
    EXPECT_GT(r.comm_wait_s, 0.5 * delay_per_step) << "rank " << r.rank;
    EXPECT_GT(r.exposed_comm_s, r.comm_wait_s * 0.9) << "rank " << r.rank;
  }
  EXPECT_GT(a.ranks[size_t(late)].wait_caused_s, double(w.size() - 1) * 0.5 * kDelayMs * 1e-3 / kSteps);
  EXPECT_LT(a.ranks[size_t(late)].comm_wait_s, a.ranks[0].comm_wait_s);
  bool all_reduce = false;
  for (const auto& c : a.collectives)
    if (c.kind == "all_reduce" && c.group_name == "world") {
      all_reduce = true;
      EXPECT_EQ(c.count, kSteps);
      EXPECT_GT(c.wait_s, double(w.size() - 1) * 0.5 * kDelayMs * 1e-3);
    }
  EXPECT_TRUE(all_reduce);
  if (w.rank() == 0) std::printf("%s", tracefile::format_text(a, 5, -1).c_str());
}
