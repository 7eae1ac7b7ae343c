// test_env.cpp: the environment variables' readers (env.h): defaults when unset or empty, accepted values, and every
// refusal naming the variable, its value and what it may be; and the retired variables, each refused naming the
// config key that replaced it. Not the trainer's own refusal (test_trainer.cpp) nor the command line's (CTest cli.*).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "moetron/env.h"
#include "moetron/runtime.h"
#include "test_util.h"

using namespace moetron;
using moetron::testing::error_of;

TEST(Env, ChoiceTakesTheDefaultAValueOrRefusesByName) {
  unsetenv("MOETRON_TEST_KNOB");
  EXPECT_EQ(env_choice("MOETRON_TEST_KNOB", "b", {"a", "b"}, "test"), "b");
  setenv("MOETRON_TEST_KNOB", "", 1);
  EXPECT_EQ(env_choice("MOETRON_TEST_KNOB", "b", {"a", "b"}, "test"), "b");
  setenv("MOETRON_TEST_KNOB", "a", 1);
  EXPECT_EQ(env_choice("MOETRON_TEST_KNOB", "b", {"a", "b"}, "test"), "a");
  setenv("MOETRON_TEST_KNOB", "A", 1);  // case counts
  EXPECT_NE(error_of([] { env_choice("MOETRON_TEST_KNOB", "b", {"a", "b"}, "test"); })
                .find("[test] MOETRON_TEST_KNOB must be 'a' or 'b', not 'A'"),
            std::string::npos);
  setenv("MOETRON_TEST_KNOB", "d", 1);
  EXPECT_NE(error_of([] { env_choice("MOETRON_TEST_KNOB", "a", {"a", "b", "c"}, "test"); })
                .find("MOETRON_TEST_KNOB must be 'a', 'b' or 'c', not 'd'"),
            std::string::npos);
  unsetenv("MOETRON_TEST_KNOB");
}

TEST(Env, IntegerInRangeOrRefusedByName) {
  unsetenv("MOETRON_TEST_INT");
  EXPECT_EQ(env_int_in("MOETRON_TEST_INT", 200, 20, 5000, "test"), 200);
  setenv("MOETRON_TEST_INT", "20", 1);
  EXPECT_EQ(env_int_in("MOETRON_TEST_INT", 200, 20, 5000, "test"), 20);
  setenv("MOETRON_TEST_INT", "5000", 1);
  EXPECT_EQ(env_int_in("MOETRON_TEST_INT", 200, 20, 5000, "test"), 5000);
  for (const char* bad : {"19", "5001", "12us", "x", "-3", "99999999999999999999999"}) {
    setenv("MOETRON_TEST_INT", bad, 1);
    EXPECT_NE(error_of([] { env_int_in("MOETRON_TEST_INT", 200, 20, 5000, "test"); })
                  .find(std::string("MOETRON_TEST_INT must be an integer in [20, 5000], not '") + bad + "'"),
              std::string::npos)
        << bad;
  }
  unsetenv("MOETRON_TEST_INT");
}

// The variables that chose behaviour are config keys now: each one set is an error naming its key (and its value),
// never a setting silently ignored; set to "" it means unset, as it always did.
TEST(Env, RetiredVariablesAreRefusedNamingTheirConfigKeys) {
  const std::vector<std::pair<std::string, std::string>> want = {
      {"MOETRON_EP_PAIR_BACKWARD", "parallelism.ep_pair_backward"}, {"MOETRON_EP_BATON", "parallelism.ep_baton"},
      {"MOETRON_EP_LINK", "parallelism.ep_link"},         {"MOETRON_MPI_WAIT", "comm.mpi_wait"},
      {"MOETRON_MPI_MAX_NAP_US", "comm.mpi_max_nap_us"},  {"MOETRON_MPI_THREAD", "comm.mpi_thread"},
      {"MOETRON_NUM_THREADS", "training.threads"}};
  ASSERT_EQ(retired_env().size(), want.size());
  size_t k = 0;
  for (const RetiredEnv& r : retired_env()) {
    EXPECT_EQ(r.name, want[k].first);
    EXPECT_EQ(r.key, want[k].second);
    ++k;
  }
  for (const RetiredEnv& r : retired_env()) unsetenv(r.name);
  EXPECT_EQ(error_of([] { refuse_retired_env(); }), "");
  for (const auto& [name, key] : want) {
    SCOPED_TRACE(name);
    setenv(name.c_str(), "", 1);  // empty: unset
    EXPECT_EQ(error_of([] { refuse_retired_env(); }), "");
    setenv(name.c_str(), "7", 1);
    const std::string m = error_of([] { refuse_retired_env(); });
    EXPECT_NE(m.find("environment variable " + name + "=7 was retired: set the config key " + key + " instead"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("--" + key + "=..."), std::string::npos) << m;
    unsetenv(name.c_str());
  }
  // Programs without a config (benchmarks, the op harness) size their threads here: OMP_NUM_THREADS, and the
  // retired MOETRON_NUM_THREADS refused rather than read.
  const int threads = num_threads();  // restored below: the other tests run with this process's count
  setenv("MOETRON_NUM_THREADS", "1", 1);
  EXPECT_NE(error_of([] { init_threads(); }).find("config key training.threads"), std::string::npos);
  EXPECT_EQ(error_of([] { init_threads(2); }), "");  // a count given (training.threads) reads no variable
  unsetenv("MOETRON_NUM_THREADS");
  EXPECT_EQ(error_of([] { init_threads(); }), "");
  init_threads(threads);
}
