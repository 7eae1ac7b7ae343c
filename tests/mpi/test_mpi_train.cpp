// test_mpi_train.cpp: data parallelism in the trainer, run by CTest under `mpirun --oversubscribe -np N`
// (N = 2, 4). Every rank also trains the single-process reference itself (comm_local(), same thread count:
// one OpenMP thread per rank) on ds_tiny with synthetic data, 5 steps, micro-batch 2, global batch 8, so
// DP = 1, 2, 4 see the same global batches. Checks:
//   bitwise: the sequences (token hashes, by step and index in the global batch) of the union over ranks
//            equal the single-process ones; parameters + expert biases are identical on every rank after
//            every step; step 1's loss equals the single-process loss (same parameters, same micro-batches,
//            loss sums folded in global micro-batch order); ZeRO-1 equals plain DP; dp_replicate equals
//            dp_shard; a resumed DP run equals the uninterrupted one.
//   tolerance: the loss of steps 2..5 and the final parameters vs one process (see kLossRelTol below;
//            measured: the losses are bitwise equal too, parameters differ by ~1e-8 relative L2).
// Not a benchmark; expert parallelism and the layout sweep are in test_mpi_layouts.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/trainer.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

Comm& world() {
  static Comm w = comm_world();
  return w;
}

constexpr int kSteps = 5;
constexpr int64_t kMicro = 2, kGlobal = 8;

// Tolerances (DP vs one process). Parameters are identical at step 1 and every micro-batch gradient is
// computed bitwise identically; only the fp32 SUM over micro-batches is associated differently: one
// process accumulates ((g0 + g1) + g2) + ... into the gradient buffer (inside the wgrad GEMMs, beta = 1),
// DP sums each rank's micro-batches locally and then folds the ranks in order. Each association differs
// by a few fp32 roundings: |dg| <~ (micro - 1) * 2^-24 * sum_i |g_i| per element, ~1e-7 relative where
// the micro-batch gradients do not cancel. AdamW's update lr * m / (sqrt(v) + eps) inherits that relative
// error, so after 5 steps |dp| ~ 5 * lr * 1e-7 = 5e-10 per element against |p| ~ init_std = 0.02:
// a relative L2 difference of order 1e-8 (measured 7.5e-9 for DP = 2, 6.5e-9 for DP = 4, max |dp|
// 4.5e-8). We allow 1e-7. (Where a gradient component is itself a cancellation, |sum g_i| << sum |g_i|,
// AdamW being scale-free could move that element by up to 2 lr: one such element would break 1e-7 and
// the test would show it; none occurs in this configuration.)
// Loss: the forward pass uses bf16 copies of the weights, so fp32 differences of ~1e-8 relative change
// a bf16 weight only when they cross a bf16 rounding boundary; measured: the loss of all 5 steps is
// bitwise the single-process loss for DP = 2 and 4. We allow a relative 1e-6, i.e. a few bf16 weight
// flips (each changes the loss by far less than 2^-8 relative), not a wrong gradient (which moves the
// loss of step 2 by ~1e-3).
constexpr double kLossRelTol = 1e-6;
constexpr double kParamRelL2Tol = 1e-7;

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }

std::string dir_for(const std::string& name) {
  // Every rank of one run shares the folder (rank 0 writes it); the folders of the references are per rank.
  return (fs::temp_directory_path() / ("moetron_mpi_train_" + name)).string();
}

JobConfig tiny(const std::string& dump, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"--job.dump_folder=" + dump,
                                 "--training.dataset=synthetic",
                                 "--metrics.peak_tflops=1.0",
                                 "--metrics.log_interval=1",
                                 "--training.steps=" + std::to_string(kSteps),
                                 "--training.micro_batch_size=" + std::to_string(kMicro),
                                 "--training.global_batch_size=" + std::to_string(kGlobal)};
  for (auto& e : extra) ov.push_back(e);
  return load_config(repo("configs/ds_tiny.toml"), ov);
}

TrainOptions recorded(const Comm* c) {
  TrainOptions o;
  o.quiet = true;
  o.comm = c;
  o.record_data = true;
  o.record_param_hash = true;
  o.keep_params = true;
  return o;
}

// Fresh folder shared by all ranks: rank 0 clears it, everybody waits.
std::string shared_dir(const std::string& name) {
  std::string d = dir_for(name + "_np" + std::to_string(world().size()));
  if (world().rank() == 0) fs::remove_all(d);
  world().barrier();
  return d;
}

const TrainResult& reference() {
  static TrainResult r = [] {
    static Comm local = comm_local();
    std::string d = dir_for("ref_rank" + std::to_string(world().rank()));
    fs::remove_all(d);
    return train(tiny(d), recorded(&local));
  }();
  return r;
}

bool layout_ok() { return kGlobal % (kMicro * world().size()) == 0; }

// All ranks' copies of `x` must be bitwise identical.
void expect_same_on_all_ranks(const void* x, int64_t bytes, const std::string& what) {
  const Comm& c = world();
  std::vector<char> all(size_t(bytes * c.size()));
  c.all_gather(all.data(), x, bytes);
  for (int q = 0; q < c.size(); ++q)
    EXPECT_EQ(0, std::memcmp(all.data() + q * bytes, x, size_t(bytes))) << what << ": rank " << q << " differs";
}

void expect_bitwise_equal_runs(const TrainResult& a, const TrainResult& b, const std::string& what) {
  ASSERT_EQ(a.history.size(), b.history.size()) << what;
  for (size_t i = 0; i < a.history.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(&a.history[i].loss, &b.history[i].loss, sizeof(double))) << what << " step " << i + 1;
    EXPECT_EQ(a.history[i].param_hash, b.history[i].param_hash) << what << " parameters after step " << i + 1;
  }
  ASSERT_EQ(a.final_params.size(), b.final_params.size());
  EXPECT_EQ(0, std::memcmp(a.final_params.data(), b.final_params.data(), a.final_params.size() * 4)) << what;
}

}  // namespace

TEST(MpiTrain, DataParallelMatchesOneProcess) {
  if (!layout_ok()) GTEST_SKIP() << "global batch " << kGlobal << " does not split over " << world().size();
  const int p = world().size();
  const TrainResult& ref = reference();
  TrainResult dp = train(tiny(shared_dir("dp"), {"--parallelism.dp_shard=" + std::to_string(p)}), recorded(&world()));
  ASSERT_EQ(dp.world, p);
  ASSERT_EQ(dp.history.size(), size_t(kSteps));

  // Data: the union over ranks of what each rank trained on is the single-process data, bitwise.
  const int64_t per = kSteps * (kGlobal / p);
  ASSERT_EQ(int64_t(dp.data.size()), per);
  std::vector<SeqRecord> all(size_t(per * p));
  world().all_gather(all.data(), dp.data.data(), per * int64_t(sizeof(SeqRecord)));
  std::map<std::pair<int64_t, int64_t>, uint64_t> got;
  for (auto& s : all) EXPECT_TRUE(got.emplace(std::make_pair(s.step, s.index), s.hash).second) << "duplicate";
  ASSERT_EQ(ref.data.size(), got.size());
  for (auto& s : ref.data) {
    auto it = got.find({s.step, s.index});
    ASSERT_NE(it, got.end()) << "step " << s.step << " sequence " << s.index << " not trained by any rank";
    EXPECT_EQ(it->second, s.hash) << "step " << s.step << " sequence " << s.index << " differs from one process";
  }
  // Each rank took its contiguous chunk.
  for (auto& s : dp.data) EXPECT_EQ(s.index / (kGlobal / p), dp.rank) << "step " << s.step;

  // Replicas: every rank holds the same parameters and biases after every step, and logs the same numbers.
  std::vector<uint64_t> hashes;
  std::vector<double> losses;
  for (auto& h : dp.history) hashes.push_back(h.param_hash), losses.push_back(h.loss), losses.push_back(h.grad_norm);
  expect_same_on_all_ranks(hashes.data(), int64_t(hashes.size() * 8), "parameter hash per step");
  expect_same_on_all_ranks(losses.data(), int64_t(losses.size() * 8), "loss and grad norm per step");
  expect_same_on_all_ranks(dp.final_params.data(), int64_t(dp.final_params.size() * 4), "final parameters");

  // Step 1: same parameters, same micro-batches, loss sums folded in the same order: bitwise.
  EXPECT_EQ(0, std::memcmp(&dp.history[0].loss, &ref.history[0].loss, sizeof(double)))
      << dp.history[0].loss << " vs " << ref.history[0].loss;
  // Later steps: within the reassociation tolerance (see kLossRelTol).
  double worst = 0;
  for (int i = 0; i < kSteps; ++i) {
    double rel = std::abs(dp.history[size_t(i)].loss - ref.history[size_t(i)].loss) / std::abs(ref.history[size_t(i)].loss);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, kLossRelTol) << "step " << i + 1 << ": dp " << dp.history[size_t(i)].loss << " one process "
                                << ref.history[size_t(i)].loss;
  }
  ASSERT_EQ(dp.final_params.size(), ref.final_params.size());
  double d2 = 0, n2 = 0, dmax = 0;
  for (size_t i = 0; i < ref.final_params.size(); ++i) {
    double d = double(dp.final_params[i]) - double(ref.final_params[i]);
    d2 += d * d, n2 += double(ref.final_params[i]) * ref.final_params[i], dmax = std::max(dmax, std::abs(d));
  }
  const double rel_l2 = std::sqrt(d2 / n2);
  EXPECT_LE(rel_l2, kParamRelL2Tol);
  if (world().rank() == 0)
    std::printf("[dp=%d vs 1 process] max loss rel diff %.3e (steps 1..%d), final params rel L2 %.3e, max abs %.3e\n",
                p, worst, kSteps, rel_l2, dmax);

  // dp_replicate = p is the same DP group in the same order: bitwise the dp_shard run.
  TrainResult rep =
      train(tiny(shared_dir("dprep"), {"--parallelism.dp_replicate=" + std::to_string(p)}), recorded(&world()));
  expect_bitwise_equal_runs(rep, dp, "dp_replicate vs dp_shard");

  // ZeRO-1: AdamW is element-wise, so updating slices and gathering is bitwise plain DP; the state is 1/p.
  TrainResult z = train(tiny(shared_dir("zero1"), {"--parallelism.dp_shard=" + std::to_string(p), "--parallelism.zero=1"}),
                        recorded(&world()));
  expect_bitwise_equal_runs(z, dp, "zero=1 vs zero=0");
  int64_t zsum = z.opt_state_bytes;
  world().all_reduce(&zsum, 1);
  EXPECT_EQ(zsum, dp.opt_state_bytes);  // the shards partition the state exactly
  EXPECT_LE(z.opt_state_bytes, dp.opt_state_bytes / p + 8 * p);
  if (world().rank() == 0)
    std::printf("[dp=%d] optimizer state per rank: %lld bytes (zero=0) -> %lld bytes (zero=1)\n", p,
                (long long)dp.opt_state_bytes, (long long)z.opt_state_bytes);
}

TEST(MpiTrain, ResumeUnderMpiContinuesBitwise) {
  if (!layout_ok()) GTEST_SKIP();
  const int p = world().size();
  for (int zero : {0, 1}) {
    std::vector<std::string> ov = {"--parallelism.dp_shard=" + std::to_string(p), "--parallelism.zero=" + std::to_string(zero),
                                   "--checkpoint.enable=true", "--checkpoint.interval=3", "--training.steps=6"};
    TrainResult full = train(tiny(shared_dir("resume_full"), ov), recorded(&world()));
    std::string d = shared_dir("resume_cut");
    train(tiny(d, ov), recorded(&world()));
    if (world().rank() == 0) fs::remove_all(fs::path(d) / "checkpoint" / "step-6");
    world().barrier();
    TrainResult res = train(tiny(d, ov), recorded(&world()));
    EXPECT_EQ(res.start_step, 3) << "zero=" << zero;
    ASSERT_EQ(res.history.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(0, std::memcmp(&res.history[i].loss, &full.history[3 + i].loss, sizeof(double)))
          << "zero=" << zero << " step " << 4 + i;
      EXPECT_EQ(res.history[i].param_hash, full.history[3 + i].param_hash) << "zero=" << zero << " step " << 4 + i;
    }
  }
}

TEST(MpiTrain, ImpossibleLayoutsFailAtStartUp) {
  const int p = world().size();
  auto msg = [](auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  // World size vs parallelism: dp = 2p ranks asked for, p launched.
  std::string m = msg([&] {
    train(tiny(dir_for("bad_world_r" + std::to_string(world().rank())),
               {"--parallelism.dp_shard=" + std::to_string(2 * p),
                "--training.global_batch_size=" + std::to_string(kMicro * 2 * p)}),
          recorded(&world()));
  });
  EXPECT_NE(m.find("world size " + std::to_string(p)), std::string::npos) << m;
  // (Every other impossible layout: tests/mpi/test_mpi_layouts.cpp.)
  world().barrier();
}
// main() is tests/mpi/mpi_gtest_main.cpp, shared by the MPI test binaries.
