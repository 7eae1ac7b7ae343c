// fuzz_checkpoint: feeds the checkpoint state file reader (load_checkpoint's state.json checks,
// src/train/checkpoint.cpp) and then what resume parses out of it (config_from_json of "config", the loader
// position fields of "data"). At start-up the target writes one real checkpoint, step-1/ with model and optimizer
// safetensors, through save_checkpoint; each input replaces its state.json. Input: state.json text. A finding is
// anything but a clean moetron::Error (a crash, a sanitizer report, a hang, an nlohmann exception leaking out).
// MOETRON_FUZZ_SEED_OUT=<file>: also copy the state.json save_checkpoint wrote there (how the seed was made).
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/checkpoint.h"
#include "moetron/config.h"

namespace {

std::string make_checkpoint() {
  using namespace moetron;
  const auto& root = fuzz::scratch_dir("checkpoint");
  static const std::vector<float> w = {1.0f, -2.0f, 0.5f, 4.0f}, m = {0.0f, 0.1f, 0.2f, 0.3f};
  CheckpointWriteRequest req;
  req.step = 1;
  req.model = {{"w", DType::F32, {2, 2}, w.data()}};
  req.optimizer = {{"m.w", DType::F32, {2, 2}, m.data()}};
  req.state = {{"data", {{"kind", "loader"}, {"epoch", 0}, {"position", 8}, {"micro", 0}}},
               {"config", to_json(JobConfig{})}};
  std::string dir = save_checkpoint(root.string(), req, 0);
  if (const char* out = std::getenv("MOETRON_FUZZ_SEED_OUT"))
    std::filesystem::copy_file(std::filesystem::path(dir) / "state.json", out,
                               std::filesystem::copy_options::overwrite_existing);
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  static const std::string dir = make_checkpoint();
  fuzz::write_bytes(std::filesystem::path(dir) / "state.json", data, size);
  try {
    LoadedCheckpoint ck = load_checkpoint(dir);
    if (ck.state.contains("config")) (void)config_from_json(ck.state["config"]);
  } catch (const Error&) {
  }
  return 0;
}
