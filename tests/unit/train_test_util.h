// train_test_util.h: the small-job helpers the trainer-level unit tests share: a path in the source tree, the
// ds_tiny job on synthetic data with overrides, a fresh temporary folder and quiet train options. Not for
// tests that need a model only (they build it from the spec).
#pragma once
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/trainer.h"

namespace moetron::testing {

inline std::string repo_path(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }

// configs/ds_tiny.toml dumping to `dump`, synthetic data, every step logged, then `extra` overrides.
inline JobConfig tiny_job(const std::string& dump, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> ov = {"--job.dump_folder=" + dump, "--training.dataset=synthetic",
                                 "--metrics.peak_tflops=1.0", "--metrics.log_interval=1"};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return load_config(repo_path("configs/ds_tiny.toml"), ov);
}

// tiny_job in fp32 (the FP8 path's reference dtype on every CPU), then `extra`.
inline JobConfig tiny_fp32_job(const std::string& dump, std::vector<std::string> extra = {}) {
  extra.insert(extra.begin(), "--training.compute_dtype=fp32");
  return tiny_job(dump, extra);
}

// An empty temporary folder named after the test file's prefix, the case and the process.
inline std::string fresh_test_dir(const std::string& prefix, const std::string& name) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / (prefix + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  return p.string();
}

inline TrainOptions quiet_options() {
  TrainOptions o;
  o.quiet = true;
  return o;
}

}  // namespace moetron::testing
