// test_checkpoint_async.cpp: `[checkpoint] async = true` on ds_tiny (one process, synthetic data): the background
// writer produces the same files and losses as the synchronous save, training goes on while a write is in
// flight, and a process killed at any point of a background write leaves the previous complete checkpoint as the
// latest one, from which a restart continues bitwise. The store's own crash protocol is in test_checkpoint.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "moetron/checkpoint.h"
#include "moetron/config.h"
#include "moetron/trainer.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 6;

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }

// Named after the test process; a death test's child (re-executed: a process of its own) uses its parent's pid,
// so that both see the same folder.
std::string fresh_dir(const std::string& name) {
  const long owner = GTEST_FLAG_GET(internal_run_death_test).empty() ? long(::getpid()) : long(::getppid());
  fs::path p = fs::temp_directory_path() / ("moetron_test_ckasync_" + name + "_" + std::to_string(owner));
  fs::remove_all(p);
  return p.string();
}

JobConfig tiny(const std::string& dump, bool async) {
  return load_config(repo("configs/ds_tiny.toml"),
                     {"--job.dump_folder=" + dump, "--training.dataset=synthetic", "--metrics.peak_tflops=1.0",
                      "--metrics.log_interval=1", "--training.steps=" + std::to_string(kSteps),
                      "--training.val_interval=0", "--checkpoint.enable=true", "--checkpoint.interval=2",
                      "--checkpoint.keep_latest_k=0", std::string("--checkpoint.async=") + (async ? "true" : "false")});
}

TrainResult run(const std::string& dump, bool async) {
  TrainOptions o;
  o.quiet = true;
  o.keep_params = true;
  return train(tiny(dump, async), o);
}

std::string bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Steps logged so far in the run's metrics.jsonl (the trainer flushes every line).
int64_t logged_steps(const std::string& dump) {
  std::ifstream in(fs::path(dump) / "metrics.jsonl");
  int64_t last = 0;
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step")) last = j["step"].get<int64_t>();
  }
  return last;
}

struct HookReset {
  ~HookReset() { set_checkpoint_fault_hook({}); }
};

}  // namespace

TEST(CheckpointAsync, SameFilesAndLossesAsTheSynchronousSave) {
  const std::string a = fresh_dir("sync"), b = fresh_dir("async");
  TrainResult ra = run(a, false), rb = run(b, true);
  ASSERT_EQ(ra.history.size(), size_t(kSteps));
  ASSERT_EQ(rb.history.size(), size_t(kSteps));
  for (int i = 0; i < kSteps; ++i)
    EXPECT_EQ(0, std::memcmp(&ra.history[size_t(i)].loss, &rb.history[size_t(i)].loss, sizeof(double))) << i + 1;
  for (int s = 2; s <= kSteps; s += 2)
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      const fs::path pa = fs::path(checkpoint_path(a + "/checkpoint", s)) / f;
      const fs::path pb = fs::path(checkpoint_path(b + "/checkpoint", s)) / f;
      ASSERT_TRUE(fs::exists(pb)) << pb;
      EXPECT_TRUE(bytes(pa) == bytes(pb)) << "step " << s << " " << f;
    }
  for (int s = 2; s <= kSteps; s += 2) {  // the data position too: the state is taken at the step boundary
    auto sa = load_checkpoint(checkpoint_path(a + "/checkpoint", s)).state;
    auto sb = load_checkpoint(checkpoint_path(b + "/checkpoint", s)).state;
    EXPECT_EQ(sa.at("data"), sb.at("data")) << "step " << s;
  }
  fs::remove_all(a), fs::remove_all(b);
}

// The first write (step 2) holds at its last stage until the trainer has logged step 3, so the test passes only
// if the steps run while the write is in flight. The synchronous save cannot get there (the hook gives up).
TEST(CheckpointAsync, TrainingGoesOnWhileTheWriteIsInFlight) {
  HookReset reset;
  for (bool async : {true, false}) {
    const std::string d = fresh_dir(async ? "inflight_async" : "inflight_sync");
    std::atomic<int> calls{0};
    std::atomic<bool> saw_step3{false};
    const auto patience = std::chrono::seconds(async ? 60 : 2);
    set_checkpoint_fault_hook([&](std::string_view stage) {
      if (stage != "before_rename" || calls++ != 0) return;
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - t0 < patience) {
        if (logged_steps(d) >= 3) {
          saw_step3 = true;
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
    TrainResult r = run(d, async);
    set_checkpoint_fault_hook({});
    EXPECT_EQ(r.history.size(), size_t(kSteps));
    EXPECT_EQ(saw_step3.load(), async) << (async ? "async: step 3 was not logged while the step-2 write was open"
                                                 : "sync: a step ran during the save");
    EXPECT_EQ(latest_complete_checkpoint(d + "/checkpoint"), checkpoint_path(d + "/checkpoint", kSteps));
    fs::remove_all(d);
  }
}

// A write that fails (not a crash) is reported by the run, not lost: the error surfaces at the next save or at
// the end of the run, naming the failure.
TEST(CheckpointAsync, AFailedBackgroundWriteFailsTheRun) {
  HookReset reset;
  const std::string d = fresh_dir("fail");
  set_checkpoint_fault_hook([](std::string_view stage) {
    if (stage == "state_written") throw Error("injected write failure");
  });
  try {
    run(d, true);
    FAIL() << "the run ended without reporting the failed write";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("injected write failure"), std::string::npos) << e.what();
  }
  set_checkpoint_fault_hook({});
  EXPECT_EQ(latest_complete_checkpoint(d + "/checkpoint"), std::nullopt);
  fs::remove_all(d);
}

// The process dies at one stage of the step-4 background write (the trainer is then in step 5 or 6, or waiting
// at the end). The checkpoint counts only once complete: the latest is step 2 (step 4 after the rename), and
// rerunning the same command continues from it with the losses of an uninterrupted run, bitwise.
class CheckpointAsyncCrash : public ::testing::TestWithParam<const char*> {};

TEST_P(CheckpointAsyncCrash, RestartContinuesBitwiseFromTheLastCompleteCheckpoint) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child trains with OpenMP: re-executed, not forked
  const std::string stage = GetParam();
  const std::string d = fresh_dir(std::string("crash_") + stage);
  EXPECT_EXIT(
      {
        int seen = 0;
        set_checkpoint_fault_hook([&](std::string_view s) {
          if (s == stage && ++seen == 2) ::_exit(42);  // the second write: step 4
        });
        run(d, true);
      },
      ::testing::ExitedWithCode(42), "");
  const int64_t expect_step = stage == "after_rename" ? 4 : 2;
  ASSERT_EQ(latest_complete_checkpoint(d + "/checkpoint"), checkpoint_path(d + "/checkpoint", expect_step));
  TrainResult resumed = run(d, true);
  const std::string ref_dir = fresh_dir(std::string("crash_ref_") + stage);
  TrainResult full = run(ref_dir, false);
  ASSERT_EQ(resumed.start_step, expect_step);
  ASSERT_EQ(resumed.history.size(), size_t(kSteps - expect_step));
  for (size_t i = 0; i < resumed.history.size(); ++i)
    EXPECT_EQ(0, std::memcmp(&resumed.history[i].loss, &full.history[i + size_t(expect_step)].loss, sizeof(double)))
        << "step " << i + size_t(expect_step) + 1;
  ASSERT_EQ(resumed.final_params.size(), full.final_params.size());
  EXPECT_EQ(0, std::memcmp(resumed.final_params.data(), full.final_params.data(), full.final_params.size() * 4));
  fs::remove_all(d), fs::remove_all(ref_dir);
}

INSTANTIATE_TEST_SUITE_P(AnyStage, CheckpointAsyncCrash,
                         ::testing::Values("tmp_created", "model_written", "optimizer_written", "state_written",
                                           "before_rename", "after_rename"));
