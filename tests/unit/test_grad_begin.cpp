// test_grad_begin.cpp: a step's gradients begun without the zeroing pass (Model::begin_grads: the first
// weight-gradient GEMM of a parameter writes, other writers find the gradient zeroed on first use, settle_grads()
// zeroes what no one wrote) against the zeroed start (Model::zero_grads): every gradient bit for bit after two
// micro-batches, from a gradient buffer filled with garbage, in fp32 and bf16 compute, with tied embeddings and an
// MTP depth, with full recompute; and a step in which nothing was written reads as zeros. Not the trainer's use of it
// (the layout sweep and the trainer tests run through it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/gemm.h"
#include "moetron/model.h"
#include "moetron/rng.h"

using namespace moetron;

namespace {

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }
constexpr int64_t kB = 2, kT = 32;

void batch(int64_t V, uint64_t seed, std::vector<int32_t>& in, std::vector<int32_t>& tg) {
  in.clear(), tg.clear();
  const uint64_t key = rng_key(seed, "grad_begin.test");
  for (int64_t i = 0; i < kB * kT; ++i) {
    in.push_back(int32_t(philox4x32(key, uint64_t(i))[0] % uint64_t(V)));
    tg.push_back(int32_t(philox4x32(key, uint64_t(i))[1] % uint64_t(V)));
  }
}

// Two micro-batches' gradients, begun either way from a buffer holding garbage.
std::vector<float> grads(const JobConfig& c, ComputeDtype dt, bool begun) {
  Model m(c.model, kB, kT, c.activation_checkpoint, ModelParallel{}, dt);
  m.init_params(11);
  std::fill(m.grad_data(), m.grad_data() + m.num_params(), 7.0f);
  if (begun) m.begin_grads();
  else m.zero_grads();
  std::vector<int32_t> in, tg;
  for (uint64_t mb = 0; mb < 2; ++mb) {
    batch(c.model.vocab_size, 3 + mb, in, tg);
    m.forward_backward(in.data(), tg.data(), 1.0f / float(2 * kB * kT), 0.5f);
  }
  m.settle_grads();
  return std::vector<float>(m.grad_data(), m.grad_data() + m.num_params());
}

void expect_same(const JobConfig& c, ComputeDtype dt) {
  const std::vector<float> want = grads(c, dt, false), got = grads(c, dt, true);
  ASSERT_EQ(want.size(), got.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.size(); ++i)
    if (std::memcmp(&want[i], &got[i], 4) != 0 && !(want[i] == 0.0f && got[i] == 0.0f)) first = bad++ ? first : i;
  EXPECT_EQ(bad, 0u) << "first differing gradient element " << first << ": " << got[first] << " against "
                     << want[first];
}

}  // namespace

TEST(GradBegin, BegunStepEqualsZeroedStepFp32) {
  expect_same(load_config(repo("configs/ds_tiny.toml")), ComputeDtype::FP32);
}

TEST(GradBegin, BegunStepEqualsZeroedStepBf16) {
  const JobConfig c = load_config(repo("configs/ds_tiny.toml"));
  if (!gemm_bf16_native()) GTEST_SKIP() << "bf16 compute is not native here";
  expect_same(c, ComputeDtype::BF16);
}

TEST(GradBegin, TiedEmbeddingsMtpAndRecompute) {
  expect_same(load_config(repo("configs/ds_tiny.toml"), {"--model.tie_embeddings=true", "--model.mtp_layers=1",
                                                         "--activation_checkpoint.mode=full"}),
              ComputeDtype::FP32);
}

TEST(GradBegin, NothingWrittenReadsAsZeros) {
  const JobConfig c = load_config(repo("configs/ds_tiny.toml"));
  Model m(c.model, kB, kT, {}, ModelParallel{}, ComputeDtype::FP32);
  m.init_params(11);
  std::fill(m.grad_data(), m.grad_data() + m.num_params(), 7.0f);
  m.begin_grads();
  const float* g = m.grad_data();  // settles: no micro-batch ran, so every gradient is zeroed here
  EXPECT_EQ(std::count(g, g + m.num_params(), 0.0f), m.num_params());
}
