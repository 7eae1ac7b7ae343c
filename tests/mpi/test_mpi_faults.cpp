// test_mpi_faults.cpp: training.nonfinite across ranks (part of mpi_train_tests, run under mpirun -np 2 and 4). One
// rank's gradient is poisoned by MOETRON_FAULT=nan:rank=1:step=2:phase=backward under DP, ZeRO-3, EP and PP:
// with "skip" every rank skips step 2 (parameters after it bitwise those after step 1, identical on every rank)
// and the run goes on; with "halt" every rank stops with the same error naming a parameter. A rank that took
// another decision would hang the others at the next collective: these tests would time out. Killed ranks and
// the watchdog are in check_faults.py (they need their own mpirun).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/trainer.h"
#include "train_check.h"

using namespace moetron;
using mt_test::world;

namespace {

JobConfig faulty(const std::string& dump, const std::vector<std::string>& layout, const std::string& policy) {
  std::vector<std::string> ov = {"--job.dump_folder=" + dump, "--metrics.peak_tflops=1.0", "--training.steps=3",
                                 "--training.micro_batch_size=2", "--training.global_batch_size=8",
                                 "--training.nonfinite=" + policy};
  ov.insert(ov.end(), layout.begin(), layout.end());
  return load_config(mt_test::repo("configs/ds_tiny.toml"), ov);
}

// The layouts of this world size that the fault reaches (rank 1 exists in all of them).
std::vector<std::pair<std::string, std::vector<std::string>>> layouts() {
  const std::string p = std::to_string(world().size());
  return {{"dp", {"--parallelism.dp_shard=" + p}},
          {"zero3", {"--parallelism.dp_shard=" + p, "--parallelism.zero=3"}},
          {"ep", {"--parallelism.dp_shard=" + p, "--parallelism.ep=" + p}},
          {"pp", {"--parallelism.pp=" + p, "--model.n_layers=4"}}};
}

struct FaultEnv {
  explicit FaultEnv(const char* v) { ::setenv("MOETRON_FAULT", v, 1); }
  ~FaultEnv() { ::unsetenv("MOETRON_FAULT"); }
};

}  // namespace

TEST(MpiFaults, NanGradientIsSkippedOnEveryRank) {
  FaultEnv env("nan:rank=1:step=2:phase=backward");
  for (const auto& [name, layout] : layouts()) {
    TrainOptions o = mt_test::recorded(&world());
    TrainResult r = train(faulty(mt_test::shared_dir("moetron_mpi_faults_", "skip_" + name), layout, "skip"), o);
    ASSERT_EQ(r.history.size(), 3u) << name;
    EXPECT_FALSE(r.history[0].skipped) << name;
    EXPECT_TRUE(r.history[1].skipped) << name;
    EXPECT_FALSE(r.history[2].skipped) << name;
    EXPECT_EQ(r.history[1].param_hash, r.history[0].param_hash) << name << ": step 2 changed the parameters";
    EXPECT_NE(r.history[2].param_hash, r.history[1].param_hash) << name << ": step 3 did not train";
    const uint64_t h[3] = {r.history[0].param_hash, r.history[1].param_hash, r.history[2].param_hash};
    mt_test::expect_same_on_all_ranks(h, sizeof h, name + " parameter hashes");
  }
}

TEST(MpiFaults, NanGradientHaltsEveryRankNamingTheParameter) {
  FaultEnv env("nan:rank=1:step=2:phase=backward");
  for (const auto& [name, layout] : layouts()) {
    std::string msg;
    try {
      train(faulty(mt_test::shared_dir("moetron_mpi_faults_", "halt_" + name), layout, "halt"), mt_test::recorded(&world()));
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("step 2: loss"), std::string::npos) << name << ": " << msg;
    EXPECT_NE(msg.find("first non-finite gradient in parameter order is "), std::string::npos) << name << ": " << msg;
    // every rank halted (a rank still training would hang this barrier's partners)
    int32_t halted = msg.empty() ? 0 : 1;
    world().all_reduce(&halted, 1);
    EXPECT_EQ(halted, world().size()) << name;
  }
}
