// test_fsdp.cpp: the model in FSDP mode (zero = 3) with a one-rank communicator against the plain model:
// the sharded init is the unsharded init, and one micro-batch of forward + backward gives bitwise the same
// loss and gradients (same parameters, same bf16 copies, same packed experts; the gradient slot is zeroed
// like the plain gradient buffer and a one-rank reduce-scatter is a copy added to a zero shard). Covered:
// ds_tiny (MHA, dense + MoE layers), tied embeddings (the head is unit 0), MLA, full and selective
// recompute, forward only. With two micro-batches the gradients are NOT bitwise in general: the plain model
// accumulates micro-batch 2 into the buffer inside the kernels (g = (g1 + a) + b ...), FSDP sums each
// micro-batch in a zeroed slot and adds it to the shard (g1 + (a + b)); the test checks that bound.
// The trainer with zero = 3 in one process and one micro-batch per step is bitwise zero = 0 (the
// multi-rank trainer is tested under mpirun: tests/mpi/test_mpi_train.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <unistd.h>
#include <vector>

#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/fsdp.h"
#include "moetron/model.h"
#include "moetron/rng.h"
#include "moetron/trainer.h"

using namespace moetron;

namespace {

ModelParallel with_fsdp(const FsdpOptions* fo) {
  ModelParallel p;
  p.fsdp = fo;
  return p;
}
std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }

constexpr int64_t kB = 2, kT = 32;

void tokens(std::vector<int32_t>& in, std::vector<int32_t>& tg, int64_t V, uint64_t salt) {
  in.resize(size_t(kB * kT)), tg.resize(size_t(kB * kT));
  uint64_t key = rng_key(7 + salt, "fsdp.test");
  for (int64_t i = 0; i < kB * kT; ++i) {
    in[size_t(i)] = int32_t(philox4x32(key, uint64_t(i))[0] % uint64_t(V));
    tg[size_t(i)] = int32_t(philox4x32(key, uint64_t(i))[1] % uint64_t(V));
  }
}

// Full flat parameters / gradients of an FSDP model (gathered over its one-rank group).
std::vector<float> flat_of(Model& m, bool grads) {
  std::vector<float> f(size_t(m.num_params()), 0.0f);
  m.fsdp()->gather_flat(f.data(), grads ? m.fsdp()->grads() : m.fsdp()->params());
  return f;
}

void compare(const std::string& cfg_name, std::vector<std::string> ov, int micro, bool expect_bitwise) {
  JobConfig cfg = load_config(repo("configs/" + cfg_name), ov);
  FsdpOptions fo{comm_local(), comm_local()};
  Model a(cfg.model, kB, kT, cfg.activation_checkpoint);
  Model b(cfg.model, kB, kT, cfg.activation_checkpoint, with_fsdp(&fo));
  ASSERT_EQ(b.param_data(), nullptr) << "FSDP mode must not allocate the full parameter buffer";
  a.init_params(42), b.init_params(42);
  std::vector<float> pb = flat_of(b, false);
  for (auto& p : a.params())
    ASSERT_EQ(0, std::memcmp(pb.data() + p.offset, a.param_data() + p.offset, size_t(p.numel) * 4))
        << cfg_name << ": init of " << p.name;
  a.zero_grads(), b.zero_grads();
  const int64_t V = cfg.model.vocab_size;
  std::vector<int32_t> in, tg;
  for (int mb = 0; mb < micro; ++mb) {
    tokens(in, tg, V, uint64_t(mb));
    ForwardStats sa = a.forward_backward(in.data(), tg.data(), 1.0f / float(kB * kT * micro), 1.0f / float(micro));
    ForwardStats sb = b.forward_backward(in.data(), tg.data(), 1.0f / float(kB * kT * micro), 1.0f / float(micro));
    EXPECT_EQ(0, std::memcmp(&sa.ce_sum, &sb.ce_sum, 8)) << cfg_name << " micro " << mb << ": " << sa.ce_sum << " vs "
                                                         << sb.ce_sum;
    EXPECT_EQ(0, std::memcmp(&sa.aux_loss, &sb.aux_loss, 8)) << cfg_name;
  }
  std::vector<float> gb = flat_of(b, true);
  double worst = 0;
  int64_t differ = 0;
  for (auto& p : a.params()) {
    const float* x = a.grad_data() + p.offset;
    const float* y = gb.data() + p.offset;
    if (expect_bitwise) {
      EXPECT_EQ(0, std::memcmp(x, y, size_t(p.numel) * 4)) << cfg_name << ": gradient of " << p.name;
      continue;
    }
    // Two micro-batches: |g_plain - g_fsdp| <= 2 * 2^-24 * (|a| + |b|) per element (two reassociated adds);
    // |a| + |b| is not at hand, so bound by the norm of the tensor's gradient: relative L2 <= 4 * 2^-24.
    double d2 = 0, n2 = 0;
    for (int64_t i = 0; i < p.numel; ++i) {
      double d = double(x[i]) - double(y[i]);
      d2 += d * d, n2 += double(x[i]) * x[i], differ += x[i] != y[i];
    }
    double rel = n2 > 0 ? std::sqrt(d2 / n2) : std::sqrt(d2);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 4.0 / 16777216.0) << cfg_name << ": gradient of " << p.name;
  }
  if (!expect_bitwise) std::printf("[%s, %d micro-batches] %lld elements differ, worst rel L2 %.3e\n", cfg_name.c_str(),
                                   micro, (long long)differ, worst);
  // forward only (validation path)
  ForwardStats fa = a.forward(in.data(), tg.data());
  ForwardStats fb = b.forward(in.data(), tg.data());
  EXPECT_EQ(0, std::memcmp(&fa.ce_sum, &fb.ce_sum, 8)) << cfg_name << " forward only";
  std::vector<float> la(size_t(kB * kT * V)), lb(la.size());
  a.compute_logits(la.data(), in.data());
  b.compute_logits(lb.data(), in.data());
  EXPECT_EQ(0, std::memcmp(la.data(), lb.data(), la.size() * 4)) << cfg_name << " logits";
}
}  // namespace

TEST(Fsdp, OneRankIsBitwiseThePlainModel) { compare("ds_tiny.toml", {}, 1, true); }
TEST(Fsdp, OneRankTiedEmbeddings) { compare("ds_tiny.toml", {"--model.tie_embeddings=true"}, 1, true); }
TEST(Fsdp, OneRankMla) { compare("ds_tiny_mla.toml", {}, 1, true); }
TEST(Fsdp, OneRankFullRecompute) { compare("ds_tiny.toml", {"--activation_checkpoint.mode=full"}, 1, true); }
TEST(Fsdp, OneRankSelectiveRecompute) {
  compare("ds_tiny.toml",
          {"--activation_checkpoint.mode=selective",
           "--activation_checkpoint.modules=[\"norm\", \"attention_core\", \"moe_act\"]"},
          1, true);
}
TEST(Fsdp, OneRankTwoMicroBatchesWithinReassociation) { compare("ds_tiny.toml", {}, 2, false); }

TEST(Fsdp, LayoutShardsEveryRunInEqualPaddedBlocks) {
  JobConfig cfg = load_config(repo("configs/ds_tiny.toml"));
  FsdpOptions fo{comm_local(), comm_local()};
  Model b(cfg.model, kB, kT, {}, with_fsdp(&fo));
  const Fsdp& f = *b.fsdp();
  EXPECT_EQ(f.n_units(), int(cfg.model.n_layers) + 2);
  int64_t real = 0;
  for (auto& s : f.segments()) real += s.count;
  int64_t want = 0;
  for (auto& p : b.params()) want += p.numel;
  EXPECT_EQ(real, want);  // every element in exactly one segment of the one rank
  // MoE layers have a dense and an expert run; the others one run.
  for (int u = 0; u < f.n_units(); ++u) {
    bool moe = u >= 1 && u <= cfg.model.n_layers && cfg.model.is_moe_layer(u - 1);
    EXPECT_EQ(f.unit(u).runs.size(), moe ? 2u : 1u) << "unit " << u;
  }
}

TEST(Fsdp, TrainerZero3OneProcessOneMicroBatchIsBitwiseZero0) {
  auto run = [](int zero) {
    std::string d = (std::filesystem::temp_directory_path() / ("moetron_test_fsdp_z" + std::to_string(zero) + "_" +
                                                               std::to_string(::getpid())))
                        .string();
    JobConfig cfg = load_config(repo("configs/ds_tiny.toml"),
                                {"--job.dump_folder=" + d, "--training.dataset=synthetic", "--metrics.peak_tflops=1.0",
                                 "--training.steps=3", "--training.micro_batch_size=8", "--training.global_batch_size=8",
                                 "--training.val_interval=3", "--training.val_steps=2", "--parallelism.zero=" + std::to_string(zero)});
    TrainOptions o;
    o.quiet = true, o.keep_params = true, o.record_param_hash = true;
    static Comm local = comm_local();
    o.comm = &local;
    TrainResult r = train(cfg, o);
    std::filesystem::remove_all(d);
    return r;
  };
  TrainResult a = run(0), b = run(3);
  ASSERT_EQ(a.history.size(), 3u);
  ASSERT_EQ(b.history.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(0, std::memcmp(&a.history[i].loss, &b.history[i].loss, 8)) << "step " << i + 1;
    EXPECT_EQ(a.history[i].param_hash, b.history[i].param_hash) << "step " << i + 1;
  }
  EXPECT_EQ(0, std::memcmp(&a.final_val_loss, &b.final_val_loss, 8));
  ASSERT_EQ(a.final_params.size(), b.final_params.size());
  EXPECT_EQ(0, std::memcmp(a.final_params.data(), b.final_params.data(), a.final_params.size() * 4));
  EXPECT_EQ(b.optimizer_peak_bytes, a.optimizer_peak_bytes);  // one rank: the shard is the whole model
}
