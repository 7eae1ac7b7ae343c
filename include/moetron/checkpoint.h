// checkpoint.h: the checkpoint store. One checkpoint is a directory <folder>/step-<N>/ holding
//   model.safetensors      parameters
//   optimizer.safetensors  optimizer state (m, v, the optimizer's step count, ...)
//   state.json             step, the caller's state (RNG, data loader position, config TOML, ...),
//                          moetron version, and the size + CRC32C of each file
// written atomically (temporary directory, fsync, rename, fsync parent). A checkpoint is complete only
// if state.json parses and every file's size and CRC32C verify. See docs/checkpoint.md.
// Not a resharding tool and not a distributed protocol: one process writes one folder; callers that
// shard state across ranks give each rank its own folder (or gather first).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "moetron/dtype.h"
#include "moetron/safetensors.h"
#include "moetron/tensor.h"

namespace moetron {

// Recorded in state.json as "moetron_version".
inline constexpr std::string_view kMoetronVersion = "0.1";
// state.json "format_version"; bumped on incompatible layout changes.
inline constexpr int kCheckpointFormatVersion = 1;

struct CheckpointTensor {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  const void* data = nullptr;  // numel(shape) * dtype_size(dtype) bytes, row-major
};

struct CheckpointWriteRequest {
  int64_t step = 0;  // >= 0
  std::vector<CheckpointTensor> model, optimizer;
  // The caller's state: a JSON object. Conventional keys (see docs/checkpoint.md): "rng"
  // ({"seed": ..., "offsets": {...}}), "data_loader" (opaque), "config_toml" (string). The keys
  // "format", "format_version", "step", "moetron_version" and "files" are reserved for the store.
  nlohmann::json state = nlohmann::json::object();
};

// The directory name of a step ("step-<step>") and its path under folder (what save_checkpoint returns).
std::string step_dir_name(int64_t step);
std::string checkpoint_path(const std::string& folder, int64_t step);

// Writes <folder>/step-<step>/ atomically, replacing an existing checkpoint of the same step atomically.
// Then prunes: complete checkpoints beyond the newest keep_latest_k (by step; keep_latest_k <= 0 keeps
// all) and stale temporary directories (*.tmp-<pid> whose process is not alive). Returns the path.
std::string save_checkpoint(const std::string& folder, const CheckpointWriteRequest& req, int keep_latest_k);

// Path of the highest-step complete checkpoint in folder, verifying checksums; incomplete or corrupt
// ones are skipped with a warning on stderr. nullopt if there is none (or the folder does not exist).
std::optional<std::string> latest_complete_checkpoint(const std::string& folder);

struct LoadedCheckpoint {
  std::string dir;
  int64_t step = 0;
  nlohmann::json state;  // the whole state.json (caller's keys plus the store's)
  SafetensorsFile model, optimizer;
};

// Opens and fully verifies a checkpoint directory (state.json, sizes, CRC32C, safetensors structure,
// step consistency). Throws moetron::Error "<path>: <problem>" on any violation.
LoadedCheckpoint load_checkpoint(const std::string& dir);

// Lists step-<N> directories in folder (complete or not), sorted by increasing step.
std::vector<std::pair<int64_t, std::string>> list_checkpoint_dirs(const std::string& folder);

// Test hook: called at named points of save_checkpoint ("tmp_created", "model_written",
// "optimizer_written", "state_written", "before_rename", "after_rename"). Tests use it to simulate a
// crash (e.g. _exit in a forked child). Pass an empty function to clear.
void set_checkpoint_fault_hook(std::function<void(std::string_view stage)> hook);

}  // namespace moetron
