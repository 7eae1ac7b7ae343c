// test_env.cpp: the environment knobs' readers (env.h): defaults when unset or empty, accepted values, and every
// refusal naming the variable, its value and what it may be.
#include <gtest/gtest.h>

#include <cstdlib>

#include "moetron/env.h"
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
