// fp8_test_util.h: one forward + backward of a ds_tiny model in fp32 with a given [quantize], the loss and every
// gradient: what the FP8 unit tests (test_fp8_train.cpp, test_fp8_cache.cpp) compare between recipes, the float64
// twin and the cached operands; and the delayed-scaling resume and the metrics check both FP8 training tests run. Not a trainer-level
// helper (train_test_util.h is).
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/fp8.h"
#include "moetron/model.h"
#include "train_test_util.h"

namespace moetron::testing {

struct Fp8Pass {
  double loss = 0;
  std::vector<float> grads;
};

// `cfg` (a path in the source tree, e.g. configs/ds_tiny.toml) at B = 2, T = 32, seed 7, fixed tokens; `twin` runs
// the FP8 GEMMs' float64 twins; `reps` passes on the same model (a later pass reads what an earlier one cached),
// the last one's loss and gradients returned.
// `extra`: more config overrides (e.g. --model.mtp_layers=1).
inline Fp8Pass fp8_pass(const QuantizeSpec& q, const std::string& cfg, const ActivationCheckpointSpec& ac = {},
                        bool twin = false, int reps = 1, std::vector<std::string> extra = {}) {
  extra.insert(extra.begin(), "--training.compute_dtype=fp32");
  const JobConfig c = load_config(repo_path(cfg), extra);
  const int64_t B = 2, T = 32, V = c.model.vocab_size;
  Model m(c.model, B, T, ac, {}, ComputeDtype::FP32);
  m.init_params(7);
  m.set_quantize(q);
  if (twin) m.set_fp8_twin(true);
  std::vector<int32_t> tok(size_t(B * T)), tgt(size_t(B * T));
  for (int64_t i = 0; i < B * T; ++i) tok[size_t(i)] = int32_t((i * 37 + 11) % V), tgt[size_t(i)] = int32_t((i * 91 + 5) % V);
  Fp8Pass p;
  for (int rep = 0; rep < reps; ++rep) {
    m.zero_grads();
    const ForwardStats st = m.forward_backward(tok.data(), tgt.data(), 1.0f / float(B * T), 1.0f);
    p.loss = st.ce_sum / double(st.ce_count);
  }
  const ParamEntry& last = m.params().back();
  p.grads.assign(m.grad_data(), m.grad_data() + last.offset + last.numel);
  return p;
}

// Delayed tensorwise scaling (history 3) with a checkpoint every 2 steps: 4 steps straight in `dir_full`, and 2
// steps + resume + 2 steps in `dir_split` (the step-4 checkpoint removed before the resume); param hashes recorded.
// `tiny(dir, overrides)` builds the test file's config. The callers compare the resumed steps with steps 3-4.
struct DelayedResume {
  TrainResult full, resumed;
};
template <class Tiny>
inline DelayedResume train_delayed_and_resume(Tiny tiny, const std::string& dir_full, const std::string& dir_split) {
  const std::vector<std::string> q = {"--quantize.recipe=tensorwise", "--quantize.scaling=delayed",
                                      "--quantize.amax_history_len=3", "--checkpoint.enable=true",
                                      "--checkpoint.interval=2", "--training.steps=4"};
  TrainOptions o = quiet_options();
  o.record_param_hash = true;
  DelayedResume r;
  r.full = train(tiny(dir_full, q), o);
  train(tiny(dir_split, q), o);
  std::filesystem::remove_all(std::filesystem::path(dir_split) / "checkpoint" / "step-4");
  r.resumed = train(tiny(dir_split, q), o);
  return r;
}

// metrics.jsonl of a tensorwise current-scaling run in `dir`: every record has an "fp8" object with each of
// `modules`, and each module's x, w, dy statistics have amax > 0, scale_max exactly the scale of that amax (E4M3 for
// x and w, E5M2 for dy: the hybrid format) and scale_min <= scale_max; none of `absent` is there. Returns the number
// of records.
inline int expect_fp8_module_metrics(const std::string& dir, const std::vector<const char*>& modules,
                                     const std::vector<const char*>& absent = {}) {
  std::ifstream f(std::filesystem::path(dir) / "metrics.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_TRUE(j.contains("fp8")) << line;
    if (!j.contains("fp8")) return n;
    for (const char* mod : absent) EXPECT_FALSE(j["fp8"].contains(mod)) << mod;
    for (const char* mod : modules) {
      EXPECT_TRUE(j["fp8"].contains(mod)) << mod;
      if (!j["fp8"].contains(mod)) continue;
      for (const char* op : {"x", "w", "dy"}) {
        const auto& o = j["fp8"][mod][op];
        const float amax = o["amax"].get<float>();
        EXPECT_GT(amax, 0.0f) << mod << "." << op;
        const Fp8Format fmt = std::string(op) == "dy" ? Fp8Format::E5M2 : Fp8Format::E4M3;
        EXPECT_EQ(o["scale_max"].get<float>(), fp8_scale_from_amax(amax, fmt, false)) << mod << "." << op;
        EXPECT_LE(o["scale_min"].get<float>(), o["scale_max"].get<float>());
      }
    }
    ++n;
  }
  return n;
}

}  // namespace moetron::testing
