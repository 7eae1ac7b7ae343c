// test_fault.cpp: the MOETRON_FAULT grammar (fault.h) and, in one process on ds_tiny, what training.nonfinite
// does with an injected NaN: "skip" leaves parameters and optimizer state bitwise untouched and counts the step
// in metrics.jsonl; "halt" stops naming the poisoned parameter; no checkpoint holds a non-finite value. The
// MPI forms are in tests/mpi/test_mpi_faults.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/fault.h"
#include "moetron/trainer.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }

std::string fresh(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("moetron_fault_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

JobConfig tiny(const std::string& dump, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"--job.dump_folder=" + dump, "--training.steps=5", "--metrics.peak_tflops=1.0",
                                 "--metrics.log_interval=1"};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return load_config(repo("configs/ds_tiny.toml"), ov);
}

TrainOptions quiet() {
  TrainOptions o;
  o.quiet = true;
  o.record_param_hash = true;
  return o;
}

// MOETRON_FAULT for the lifetime of the object.
struct FaultEnv {
  explicit FaultEnv(const std::string& v) { ::setenv("MOETRON_FAULT", v.c_str(), 1); }
  ~FaultEnv() { ::unsetenv("MOETRON_FAULT"); }
};

std::string error_of(const std::string& spec) {
  try {
    parse_faults(spec);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Fault, ParsesEveryKind) {
  auto f = parse_faults("kill:rank=2:step=7:phase=backward; delay:rank=1:step=3:phase=forward:ms=2000;"
                        "nan:step=4:rank=0:phase=forward;mismatch:rank=3:step=1:phase=checkpoint");
  ASSERT_EQ(f.size(), 4u);
  EXPECT_EQ(f[0].kind, FaultKind::Kill);
  EXPECT_EQ(f[0].rank, 2);
  EXPECT_EQ(f[0].step, 7);
  EXPECT_EQ(f[0].phase, FaultPhase::Backward);
  EXPECT_EQ(f[1].kind, FaultKind::Delay);
  EXPECT_EQ(f[1].ms, 2000);
  EXPECT_EQ(f[1].phase, FaultPhase::Forward);
  EXPECT_EQ(f[2].kind, FaultKind::Nan);
  EXPECT_EQ(f[2].rank, 0);
  EXPECT_EQ(f[2].step, 4);
  EXPECT_EQ(f[3].kind, FaultKind::Mismatch);
  EXPECT_EQ(f[3].phase, FaultPhase::Checkpoint);
  EXPECT_TRUE(parse_faults("").empty());
  EXPECT_TRUE(parse_faults(" ; ").empty());
}

TEST(Fault, BadSpecsAreRefusedByName) {
  EXPECT_NE(error_of("kil:rank=1:step=1:phase=forward").find("unknown kind \"kil\""), std::string::npos);
  EXPECT_NE(error_of("kill:rank=1:step=1").find("phase=P is missing"), std::string::npos);
  EXPECT_NE(error_of("kill:step=1:phase=forward").find("rank=R is missing"), std::string::npos);
  EXPECT_NE(error_of("kill:rank=1:phase=forward").find("step=S is missing"), std::string::npos);
  EXPECT_NE(error_of("kill:rank=x:step=1:phase=forward").find("rank=x is not a non-negative integer"),
            std::string::npos);
  EXPECT_NE(error_of("kill:rank=1:step=0:phase=forward").find("step=0 must be >= 1"), std::string::npos);
  EXPECT_NE(error_of("kill:rank=1:step=1:phase=sideways").find("unknown phase \"sideways\""), std::string::npos);
  EXPECT_NE(error_of("kill:rank=1:step=1:phase=forward:when=now").find("unknown key \"when\""), std::string::npos);
  EXPECT_NE(error_of("kill:rank=1:rank=2:step=1:phase=forward").find("given twice"), std::string::npos);
  EXPECT_NE(error_of("delay:rank=1:step=1:phase=forward").find("needs ms=M"), std::string::npos);
  EXPECT_NE(error_of("kill:rank=1:step=1:phase=forward:ms=5").find("ms applies to delay only"), std::string::npos);
  EXPECT_NE(error_of("nan:rank=1:step=1:phase=optimizer").find("not phase=optimizer"), std::string::npos);
  EXPECT_TRUE(error_of("nan:rank=1:step=1:phase=checkpoint").empty());
  EXPECT_NE(error_of("kill:rank=1:step=1:phase").find("is not key=value"), std::string::npos);
  EXPECT_NE(error_of("kill:rank=1:step=99999999999999999999:phase=forward").find("too large"), std::string::npos);
  // the message names the spec
  EXPECT_NE(error_of("ok;kil:rank=1").find("MOETRON_FAULT: \"ok\""), std::string::npos);
}

TEST(Fault, InjectorFiresOnceAtItsRankStepAndPhase) {
  auto all = parse_faults("delay:rank=1:step=3:phase=forward:ms=0;nan:rank=0:step=3:phase=backward;"
                          "mismatch:rank=0:step=2:phase=optimizer");
  FaultInjector r1(all, 1);
  EXPECT_TRUE(r1.take(FaultPhase::Forward, 2).empty());
  EXPECT_TRUE(r1.take(FaultPhase::Backward, 3).empty());  // rank 0's
  // a mismatch reaches every rank: the others run the other side of the collective
  ASSERT_EQ(r1.take(FaultPhase::Optimizer, 2).size(), 1u);
  auto due = r1.take(FaultPhase::Forward, 3);
  ASSERT_EQ(due.size(), 1u);
  EXPECT_EQ(due[0].kind, FaultKind::Delay);
  EXPECT_TRUE(r1.take(FaultPhase::Forward, 3).empty());  // once
  EXPECT_TRUE(r1.empty());
}

TEST(Fault, ConfigKeysAreCheckedByName) {
  const std::string d = fresh("cfg");
  EXPECT_EQ(tiny(d).training.nonfinite, "halt");  // the default
  EXPECT_EQ(tiny(d, {"--training.nonfinite=skip"}).training.nonfinite, "skip");
  try {
    tiny(d, {"--training.nonfinite=ignore"});
    ADD_FAILURE() << "accepted nonfinite = ignore";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("training.nonfinite"), std::string::npos) << e.what();
  }
  try {
    tiny(d, {"--comm.timeout_s=-1"});
    ADD_FAILURE() << "accepted timeout_s = -1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("comm.timeout_s"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tiny(d, {"--comm.timeout_s=2.5"}).comm.timeout_s, 2.5);
}

TEST(Fault, SkipLeavesTheStateBitwiseAndCountsTheStep) {
  const std::string clean = fresh("skip_clean"), bad = fresh("skip_nan");
  TrainResult a = train(tiny(clean, {"--training.nonfinite=skip"}), quiet());
  TrainResult b;
  {
    FaultEnv env("nan:rank=0:step=3:phase=backward");
    b = train(tiny(bad, {"--training.nonfinite=skip"}), quiet());
  }
  ASSERT_EQ(a.history.size(), 5u);
  ASSERT_EQ(b.history.size(), 5u);
  for (int s = 0; s < 2; ++s) EXPECT_EQ(a.history[size_t(s)].param_hash, b.history[size_t(s)].param_hash);
  EXPECT_TRUE(b.history[2].skipped);
  EXPECT_FALSE(a.history[2].skipped);
  EXPECT_TRUE(std::isnan(b.history[2].grad_norm));
  EXPECT_TRUE(std::isfinite(b.history[2].loss));  // the loss was computed before the poisoning
  // step 3 changed nothing: parameters and biases as after step 2
  EXPECT_EQ(b.history[2].param_hash, b.history[1].param_hash);
  EXPECT_NE(a.history[2].param_hash, a.history[1].param_hash);
  // and the run goes on (its later steps differ from the clean run: one update fewer)
  EXPECT_TRUE(std::isfinite(b.history[4].loss));
  EXPECT_NE(b.history[3].param_hash, b.history[2].param_hash);
  // metrics.jsonl counts it
  std::ifstream f(fs::path(bad) / "metrics.jsonl");
  std::string line;
  int64_t last_count = -1;
  bool marked = false;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    last_count = j.at("skipped_steps").get<int64_t>();
    if (j.at("step") == 3) marked = j.value("skipped", false);
  }
  EXPECT_EQ(last_count, 1);
  EXPECT_TRUE(marked);
}

TEST(Fault, SkipOfANonFiniteLossToo) {
  FaultEnv env("nan:rank=0:step=2:phase=forward");
  TrainResult r = train(tiny(fresh("skip_loss"), {"--training.nonfinite=skip", "--training.steps=3"}), quiet());
  ASSERT_EQ(r.history.size(), 3u);
  EXPECT_TRUE(std::isnan(r.history[1].loss));
  EXPECT_TRUE(r.history[1].skipped);
  EXPECT_EQ(r.history[1].param_hash, r.history[0].param_hash);
}

TEST(Fault, HaltNamesTheFirstNonFiniteParameter) {
  const std::string d = fresh("halt");
  FaultEnv env("nan:rank=0:step=2:phase=backward");
  try {
    train(tiny(d, {"--checkpoint.enable=true", "--checkpoint.interval=1"}), quiet());
    ADD_FAILURE() << "a NaN gradient did not halt the run";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("step 2"), std::string::npos) << m;
    EXPECT_NE(m.find("not finite"), std::string::npos) << m;
    EXPECT_NE(m.find("embed"), std::string::npos) << m;  // the first parameter: the embedding
    EXPECT_NE(m.find("element 0"), std::string::npos) << m;
  }
  // the checkpoint of step 1 is there, none of step 2
  EXPECT_TRUE(fs::exists(fs::path(d) / "checkpoint" / "step-1"));
  EXPECT_FALSE(fs::exists(fs::path(d) / "checkpoint" / "step-2"));
}

TEST(Fault, HaltOnALossNamesNoParameter) {
  FaultEnv env("nan:rank=0:step=1:phase=forward");
  try {
    train(tiny(fresh("halt_loss")), quiet());
    ADD_FAILURE() << "a NaN loss did not halt the run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("every gradient is finite"), std::string::npos) << e.what();
  }
}

TEST(Fault, ACheckpointWithANonFiniteParameterIsNotWritten) {
  // A parameter poisoned just before the save of step 2: under halt the save refuses with the tensor's name ...
  {
    const std::string d = fresh("ck_halt");
    FaultEnv env("nan:rank=0:step=2:phase=checkpoint");
    try {
      train(tiny(d, {"--checkpoint.enable=true", "--checkpoint.interval=1", "--training.steps=3"}), quiet());
      ADD_FAILURE() << "a non-finite parameter was saved";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("checkpoint at step 2 refused: embed element 0"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(fs::exists(fs::path(d) / "checkpoint" / "step-1"));
    EXPECT_FALSE(fs::exists(fs::path(d) / "checkpoint" / "step-2"));
  }
  // ... under skip it is not written and the run goes on; the NaN stays in the parameter (AdamW keeps it), so the
  // checkpoint of step 3 is not written either
  const std::string d = fresh("ck_skip");
  FaultEnv env("nan:rank=0:step=2:phase=checkpoint");
  TrainResult r = train(tiny(d, {"--checkpoint.enable=true", "--checkpoint.interval=1", "--training.steps=3",
                                 "--training.nonfinite=skip"}),
                        quiet());
  ASSERT_EQ(r.history.size(), 3u);
  EXPECT_TRUE(fs::exists(fs::path(d) / "checkpoint" / "step-1"));
  EXPECT_FALSE(fs::exists(fs::path(d) / "checkpoint" / "step-2"));
  EXPECT_FALSE(fs::exists(fs::path(d) / "checkpoint" / "step-3"));
}

TEST(Fault, BadFaultSpecStopsTrainingAtStartUp) {
  FaultEnv env("nan:rank=0:step=1:phase=optimizer");
  EXPECT_THROW(train(tiny(fresh("badspec")), quiet()), Error);
}
