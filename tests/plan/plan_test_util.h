// plan_test_util.h: small helpers of the planner tests: configs from configs/, a synthetic GPU whose figures
// are round numbers (so hand counts stay readable), not a catalog entry.
#pragma once
#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/plan/hardware.h"

namespace plantest {

inline moetron::JobConfig cfg(const std::string& name, std::vector<std::string> ov = {}) {
  return moetron::load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/" + name + ".toml", ov);
}

// 100 GB HBM at 1 TB/s, 1000 TFLOPS bf16 achievable = peak, 8 GPUs behind a 100 GB/s switch, 10 GB/s NICs.
inline moetron::plan::Hardware round_gpu() {
  moetron::plan::Hardware h;
  h.name = "round";
  h.hbm_bytes = 100e9;
  h.hbm_bw = 1e12;
  h.peak_bf16 = h.achievable_bf16 = 1000e12;
  h.peak_fp8 = h.achievable_fp8 = 2000e12;
  h.scale_up.domain = 8;
  h.scale_up.bw = 100e9;
  h.scale_up.alpha = 0;
  h.scale_out.domain = 1 << 20;
  h.scale_out.bw = 10e9;
  h.scale_out.alpha = 0;
  return h;
}

}  // namespace plantest
