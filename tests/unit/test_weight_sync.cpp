// test_weight_sync.cpp: the optimizer step fused with the weight refresh (Model::update_and_sync) against the
// separate passes (AdamW over every parameter, then Model::sync_weights): the same masters, and the same compute
// copies, seen through the next forward and backward (losses and every gradient bit for bit), in bf16 and fp32
// compute, with the default pieces and with pieces small enough to cut every tensor and put one expert in each
// routed-expert piece. Also: the pieces cover the flat parameter buffer once, in order; FSDP models are refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moetron/config.h"
#include "moetron/fsdp.h"
#include "moetron/gemm.h"
#include "moetron/model.h"
#include "moetron/optim.h"
#include "moetron/rng.h"

using namespace moetron;

namespace {

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }
constexpr int64_t kB = 2, kT = 32;

struct Batch {
  std::vector<int32_t> in, tg;
};
Batch batch(int64_t V, uint64_t seed) {
  Batch b;
  const uint64_t key = rng_key(seed, "weight_sync.test");
  for (int64_t i = 0; i < kB * kT; ++i) {
    b.in.push_back(int32_t(philox4x32(key, uint64_t(i))[0] % uint64_t(V)));
    b.tg.push_back(int32_t(philox4x32(key, uint64_t(i))[1] % uint64_t(V)));
  }
  return b;
}

// One model with its AdamW moments, stepped either way.
struct Stepped {
  Model m;
  std::vector<float> mom, var;
  Stepped(const JobConfig& c, ComputeDtype dt) : m(c.model, kB, kT, {}, {}, dt) {
    m.init_params(7);
    mom.assign(size_t(m.num_params()), 0.0f), var.assign(size_t(m.num_params()), 0.0f);
  }
  double fwd_bwd(const Batch& b) {
    m.zero_grads();
    return m.forward_backward(b.in.data(), b.tg.data(), 1.0f / float(kB * kT), 1.0f).ce_sum;
  }
  void adamw(int64_t lo, int64_t hi, int64_t step) {
    AdamWConfig ac;
    ac.lr = 3e-3f;
    for (const ParamEntry& e : m.params()) {
      const int64_t a = std::max(lo, e.offset), z = std::min(hi, e.offset + e.numel);
      if (a < z)
        adamw_step(m.param_data() + a, mom.data() + a, var.data() + a, m.grad_data() + a, z - a, ac, step, 0.5f,
                   e.decay);
    }
  }
};

void check_fused_is_separate(ComputeDtype dt, int64_t piece) {
  const JobConfig c = load_config(repo("configs/ds_tiny.toml"));
  Stepped sep(c, dt), fus(c, dt);
  if (piece > 0) fus.m.set_sync_piece_elems(piece);
  const int64_t n = sep.m.num_params();
  for (int64_t step = 1; step <= 3; ++step) {
    const Batch b = batch(c.model.vocab_size, uint64_t(step));
    const double ls = sep.fwd_bwd(b), lf = fus.fwd_bwd(b);
    ASSERT_EQ(ls, lf) << "loss before step " << step;  // the previous step's copies and packs feed this pass
    for (const ParamEntry& e : sep.m.params())
      ASSERT_EQ(0, std::memcmp(sep.m.grad_data() + e.offset, fus.m.grad_data() + e.offset, size_t(e.numel) * 4))
          << "gradient of " << e.name << " before step " << step;
    sep.adamw(0, n, step);
    sep.m.sync_weights();
    std::vector<std::pair<int64_t, int64_t>> seen;
    fus.m.update_and_sync([&](int64_t lo, int64_t hi) {
      seen.emplace_back(lo, hi);
      fus.adamw(lo, hi, step);
    });
    ASSERT_FALSE(seen.empty());
    EXPECT_EQ(seen.front().first, 0);
    EXPECT_EQ(seen.back().second, n);
    for (size_t k = 0; k < seen.size(); ++k) {
      EXPECT_LT(seen[k].first, seen[k].second) << "piece " << k;
      if (k) {
        EXPECT_EQ(seen[k - 1].second, seen[k].first) << "pieces " << k - 1 << " and " << k << " do not abut";
      }
    }
    if (piece > 0) {
      EXPECT_GT(seen.size(), sep.m.params().size()) << "small pieces should cut the tensors";
    }
    ASSERT_EQ(0, std::memcmp(sep.m.param_data(), fus.m.param_data(), size_t(n) * 4)) << "masters after step " << step;
  }
}

}  // namespace

TEST(WeightSync, FusedIsSeparateBf16) {
  if (!gemm_bf16_native()) GTEST_SKIP() << "bf16 compute is not native here";
  check_fused_is_separate(ComputeDtype::BF16, 0);
}
TEST(WeightSync, FusedIsSeparateBf16SmallPieces) {
  if (!gemm_bf16_native()) GTEST_SKIP() << "bf16 compute is not native here";
  check_fused_is_separate(ComputeDtype::BF16, 1000);
}
TEST(WeightSync, FusedIsSeparateFp32) { check_fused_is_separate(ComputeDtype::FP32, 0); }
TEST(WeightSync, FusedIsSeparateFp32SmallPieces) { check_fused_is_separate(ComputeDtype::FP32, 777); }

TEST(WeightSync, Refusals) {
  const JobConfig c = load_config(repo("configs/ds_tiny.toml"));
  Model m(c.model, kB, kT, {}, {}, ComputeDtype::FP32);
  EXPECT_THROW(m.set_sync_piece_elems(0), std::exception);
  FsdpOptions fo{comm_local(), comm_local()};
  ModelParallel par;
  par.fsdp = &fo;
  Model f(c.model, kB, kT, {}, par, ComputeDtype::FP32);
  EXPECT_THROW(f.update_and_sync([](int64_t, int64_t) {}), std::exception);
}
