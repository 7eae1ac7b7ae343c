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
// FSDP / ZeRO-3 (zero = 3): against one process with the same tolerances (see Zero3MatchesOneProcess),
// bitwise run to run, memory per category per rank equal to the layout's exact figure, resume bitwise, and
// checkpoints interchangeable with zero = 0 (one process or DP) in both directions. HSDP (zero = 3 with
// dp_replicate > 1): the memory per rank is FSDP's over dp_shard (HsdpMemoryPerRankIsTheDpShardShard).
// Not a benchmark; expert parallelism and the layout sweep are in test_mpi_layouts.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <map>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/fsdp.h"
#include "moetron/grouped_gemm.h"
#include "moetron/model.h"
#include "moetron/trainer.h"
#include "train_check.h"

using namespace moetron;
namespace fs = std::filesystem;

using namespace mt_test;  // world, repo, recorded, expect_same_on_all_ranks

namespace {

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
// fp32 compute (compute_dtype auto on CPUs without native bf16): the forward multiplies the fp32 masters
// themselves, so nothing absorbs the ~1e-8 relative reassociation difference of the first update: step 2's
// gradients differ everywhere by ~1e-8 relative (the losses stay within 5e-9). AdamW then divides each
// element's moment by sqrt(v): where an element's gradient has been small at every step (sqrt(v) near
// eps = 1e-8 in ds_tiny), a 1e-8 absolute change of m moves its update by a visible fraction of lr = 1e-3.
// Measured: params rel L2 2.2e-6 (DP 2), 1.8e-6 (zero 3 on 2 ranks), 4.8e-7 (DP 4, zero 3 on 4), max |dp|
// 5.1e-5 (5% of lr). We allow
// 1e-5: above the measured worst and 100x tighter than the layout sweep's 5-step bound (1e-3); the step-1
// loss stays bitwise and the loss bound is unchanged.
constexpr double kLossRelTol = 1e-6;
const double kParamRelL2Tol = resolve_compute_dtype(ComputeDtype::Auto) == ComputeDtype::FP32 ? 1e-5 : 1e-7;

// Every rank of one run shares the folder (rank 0 writes it); the folders of the references are per rank.
std::string dir_for(const std::string& name) { return mt_test::temp_dir("moetron_mpi_train_", name); }

JobConfig tiny(const std::string& dump, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"--job.dump_folder=" + dump,
                                 "--training.dataset=synthetic",
                                 "--metrics.peak_tflops=1.0",
                                 "--metrics.log_interval=1",
                                 "--training.steps=" + std::to_string(kSteps),
                                 "--training.micro_batch_size=" + std::to_string(kMicro),
                                 "--training.global_batch_size=" + std::to_string(kGlobal),
                                 // The bounds below are derived for a forward whose only bf16 roundings are the
                                 // weights' (they absorb the ~1e-8 reassociation differences); bf16 attention
                                 // (auto on AMD AVX512-BF16 and Intel AMX CPUs) also rounds q, k, v, P and dS,
                                 // and once a reassociation flips one of those roundings the runs part
                                 // (measured, zero 3 on 2 ranks: loss 9.5e-6 and parameters 8.9e-5 at step 5).
                                 // test_mpi_layouts.cpp holds auto, bf16 attention included, to its own bounds.
                                 "--training.attention_dtype=fp32"};
  for (auto& e : extra) ov.push_back(e);
  return load_config(repo("configs/ds_tiny.toml"), ov);
}

std::string shared_dir(const std::string& name) { return mt_test::shared_dir("moetron_mpi_train_", name); }

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
  for (int zero : {0, 1, 3}) {
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

namespace {
double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double d2 = 0, n2 = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    double d = double(a[i]) - double(b[i]);
    d2 += d * d, n2 += double(b[i]) * b[i];
  }
  return std::sqrt(d2 / n2);
}
int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }
}  // namespace

// zero = 3 against one process. Why not bitwise: step 1 is (same parameters, same micro-batches, loss sums
// folded in the same order), but FSDP reduce-scatters the gradient of EACH micro-batch (sum over ranks in
// rank order) and accumulates those sums in the shard, so the step's gradient is
//   (g[0,0] + g[1,0] + ...) + (g[0,1] + g[1,1] + ...) + ...      (g[rank, micro-batch])
// where one process computes ((g0 + g1) + g2) + ... and DP sums each rank's micro-batches first: the same
// terms in a third association. The bound is the DP one (kParamRelL2Tol, kLossRelTol above): at most
// (micro - 1) fp32 roundings of the sum of |g_i| per element. The global norm is also summed in another
// order (shard norms folded over ranks, in double: ~1e-16 relative), which can move the fp32 clip
// coefficient by one ulp (6e-8 relative of the update): inside the same bound.
TEST(MpiTrain, Zero3MatchesOneProcess) {
  if (!layout_ok()) GTEST_SKIP();
  const int p = world().size();
  const TrainResult& ref = reference();
  std::vector<std::string> ov = {"--parallelism.dp_shard=" + std::to_string(p), "--parallelism.zero=3"};
  TrainResult z = train(tiny(shared_dir("zero3"), ov), recorded(&world()));
  ASSERT_EQ(z.history.size(), size_t(kSteps));
  std::vector<uint64_t> hashes;
  for (auto& h : z.history) hashes.push_back(h.param_hash);
  expect_same_on_all_ranks(hashes.data(), int64_t(hashes.size() * 8), "zero=3 parameter hash per step");
  EXPECT_EQ(0, std::memcmp(&z.history[0].loss, &ref.history[0].loss, sizeof(double)))
      << z.history[0].loss << " vs " << ref.history[0].loss;
  double worst = 0;
  for (int i = 0; i < kSteps; ++i) {
    double rel = std::abs(z.history[size_t(i)].loss - ref.history[size_t(i)].loss) / std::abs(ref.history[size_t(i)].loss);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, kLossRelTol) << "step " << i + 1;
    EXPECT_LE(std::abs(z.history[size_t(i)].grad_norm - ref.history[size_t(i)].grad_norm),
              1e-6 * ref.history[size_t(i)].grad_norm) << "step " << i + 1;
  }
  ASSERT_EQ(z.final_params.size(), ref.final_params.size());
  const double rl2 = rel_l2(z.final_params, ref.final_params);
  EXPECT_LE(rl2, kParamRelL2Tol);
  if (world().rank() == 0)
    std::printf("[zero=3 dp=%d vs 1 process] max loss rel diff %.3e, final params rel L2 %.3e\n", p, worst, rl2);
  // Deterministic: bitwise itself.
  TrainResult z2 = train(tiny(shared_dir("zero3b"), ov), recorded(&world()));
  expect_bitwise_equal_runs(z2, z, "zero=3 run to run");
}

// The shard and the largest unit slot (elements) of one rank when every unit is sharded over p ranks.
struct ShardFigures {
  int64_t shard = 0, slot = 0;
};
ShardFigures shard_figures(const Model& probe, int p) {
  const auto& ms = probe.spec();
  const int nL = int(ms.n_layers);
  ShardFigures f;
  for (int u = 0; u < nL + 2; ++u) {
    int64_t unit_slot = 0;
    for (bool expert : {false, true}) {
      int64_t n = 0;
      for (auto& e : probe.params()) {
        int eu = e.layer >= 0 ? e.layer + 1 : (e.name == "embed" ? 0 : nL + 1);
        if (eu == u && e.expert == expert) n += pad16(e.numel);
      }
      if (n == 0) continue;
      int64_t chunk = pad16((n + p - 1) / p);
      f.shard += chunk, unit_slot += p * chunk;
    }
    f.slot = std::max(f.slot, unit_slot);
  }
  return f;
}

// Memory per category per rank. The exact figures from the layout (fsdp.h), computed here independently:
// every unit splits into a dense and an expert run; a run of n = sum pad16(numel) elements gives each rank
// chunk = pad16(ceil(n / p)); shard = sum of chunks. One unit slot (untied head) of the largest unit's
// sum of p * chunk elements: fp32 + bf16 copy + packed expert weights in params, fp32 in grads.
//   params    = 4 * shard + 6 * slot + packed(E, d, 2Fe) + packed(E, Fe, d) + expert biases
//   grads     = 4 * shard + 4 * slot
//   optimizer = 8 * shard
// against zero = 0: params 6 * np + packed per MoE layer + biases, grads 4 * np, optimizer 8 * np.
TEST(MpiTrain, Zero3MemoryPerRankIsTheShardPlusOneUnit) {
  if (!layout_ok()) GTEST_SKIP();
  const int p = world().size();
  JobConfig cfg = tiny("unused");
  // plain model: the parameter list and flat size (destroyed before training: the tracker is global)
  auto probe_ptr = std::make_unique<Model>(cfg.model, kMicro, cfg.training.seq_len);
  Model& probe = *probe_ptr;
  const auto& ms = cfg.model;
  const int nL = int(ms.n_layers), E = int(ms.moe.n_routed_experts);
  const int64_t d = ms.d_model, Fe = ms.moe.moe_inter_size;
  const auto [shard, slot] = shard_figures(probe, p);
  // Per parameter: the fp32 master plus, with bf16 compute, its bf16 copy; the packed experts are in the
  // compute dtype (the training runs below resolve compute_dtype = auto like the probe).
  const bool bf = probe.compute_dtype() == ComputeDtype::BF16;
  const int64_t per_param = bf ? 6 : 4;
  const GemmPrec gp = bf ? GemmPrec::BF16 : GemmPrec::F32;
  int64_t packed = 0;
  for (auto k : {GroupedPackKind::Fwd, GroupedPackKind::Dgrad})
    packed += int64_t(grouped_packed_bytes(k, gp, E, d, 2 * Fe) + grouped_packed_bytes(k, gp, E, Fe, d));
  const int n_moe = probe.n_moe_layers();
  const int64_t bias = int64_t(n_moe) * E * 4, np = probe.num_params();
  probe_ptr.reset();
  {
    FsdpOptions fo{world(), world()};
    ModelParallel par;
    par.fsdp = &fo;
    Model fm(cfg.model, kMicro, cfg.training.seq_len, {}, par);
    EXPECT_EQ(fm.fsdp()->shard_numel(), shard);
    EXPECT_EQ(fm.fsdp()->max_slot_numel(), slot);
  }
  TrainResult z = train(tiny(shared_dir("zero3mem"), {"--parallelism.dp_shard=" + std::to_string(p),
                                                      "--parallelism.zero=3", "--training.steps=1"}),
                        recorded(&world()));
  TrainResult d0 = train(tiny(shared_dir("zero0mem"), {"--parallelism.dp_shard=" + std::to_string(p),
                                                       "--training.steps=1"}),
                         recorded(&world()));
  EXPECT_EQ(z.optimizer_peak_bytes, 8 * shard);
  EXPECT_EQ(z.grads_peak_bytes, 4 * shard + 4 * slot);
  EXPECT_EQ(z.params_peak_bytes, 4 * shard + per_param * slot + packed + bias);
  EXPECT_EQ(d0.optimizer_peak_bytes, 8 * np);
  EXPECT_EQ(d0.grads_peak_bytes, 4 * np);
  EXPECT_EQ(d0.params_peak_bytes, per_param * np + n_moe * packed + bias);
  EXPECT_EQ(z.act_peak_bytes, d0.act_peak_bytes);  // same micro-batch per rank
  // The shards are 1/p of the model up to padding: p * shard - np < 16 * (2 units' runs) * p elements.
  EXPECT_LT(p * shard - np, int64_t(2 * (nL + 2)) * 16 * p);
  if (world().rank() == 0)
    std::printf("[dp=%d] bytes per rank zero=0 -> zero=3: params %lld -> %lld, grads %lld -> %lld, optimizer %lld -> "
                "%lld (shard %lld elements of %lld, slot %lld)\n",
                p, (long long)d0.params_peak_bytes, (long long)z.params_peak_bytes, (long long)d0.grads_peak_bytes,
                (long long)z.grads_peak_bytes, (long long)d0.optimizer_peak_bytes, (long long)z.optimizer_peak_bytes,
                (long long)shard, (long long)np, (long long)slot);
}

// HSDP (zero = 3, dp_replicate 2 x dp_shard 2 on 4 ranks): every rank holds the shard of FSDP over dp_shard = 2,
// not over the 4 data-parallel ranks. Measured from the tracked memory: the optimizer state (8 bytes per shard
// element), the gradient and master-parameter shards (4 each, plus the one gathered unit's slots) are the exact
// figures of the layout at p = 2, equal to what FSDP over 2 ranks measures (each half of the world trains FSDP
// dp_shard = 2 on its own communicator), and half of one process's optimizer state up to the 16-element padding
// of each run's chunk.
TEST(MpiTrain, HsdpMemoryPerRankIsTheDpShardShard) {
  if (world().size() != 4) GTEST_SKIP() << "HSDP 2 x 2 needs 4 ranks";
  JobConfig cfg = tiny("unused");
  auto probe_ptr = std::make_unique<Model>(cfg.model, kMicro, cfg.training.seq_len);
  const ShardFigures f2 = shard_figures(*probe_ptr, 2), f4 = shard_figures(*probe_ptr, 4);
  const int64_t np = probe_ptr->num_params();
  const int units = int(cfg.model.n_layers) + 2;
  probe_ptr.reset();
  TrainResult h = train(tiny(shared_dir("hsdp_mem"), {"--parallelism.dp_replicate=2", "--parallelism.dp_shard=2",
                                                       "--parallelism.zero=3", "--training.steps=1"}),
                        recorded(&world()));
  // FSDP over 2 ranks: ranks {0, 1} and {2, 3} each train it on their own communicator.
  const int pair = world().rank() / 2;
  const Comm two = world().split(pair, world().rank() % 2);
  const std::string fd = temp_dir("moetron_mpi_train_", "hsdp_mem_fsdp2_pair" + std::to_string(pair));
  if (two.rank() == 0) fs::remove_all(fd);
  two.barrier();
  TrainResult f = train(tiny(fd, {"--parallelism.dp_shard=2", "--parallelism.zero=3", "--training.steps=1"}),
                        recorded(&two));
  const TrainResult& one = reference();
  EXPECT_EQ(h.optimizer_peak_bytes, 8 * f2.shard);
  EXPECT_EQ(h.optimizer_peak_bytes, f.optimizer_peak_bytes);
  EXPECT_EQ(h.grads_peak_bytes, 4 * f2.shard + 4 * f2.slot);
  EXPECT_EQ(h.grads_peak_bytes, f.grads_peak_bytes);
  EXPECT_EQ(h.params_peak_bytes, f.params_peak_bytes);
  EXPECT_EQ(h.opt_state_bytes, 8 * f2.shard);
  // Half of one process: 2 * shard - np is the padding, under 16 elements per run (two runs per unit) per rank.
  EXPECT_EQ(one.optimizer_peak_bytes, 8 * np);
  EXPECT_GE(2 * f2.shard, np);
  EXPECT_LT(2 * f2.shard - np, int64_t(2 * units) * 16 * 2);
  EXPECT_GT(f2.shard, f4.shard);  // not the shard over all 4 data-parallel ranks
  if (world().rank() == 0)
    std::printf("[hsdp 2x2] bytes per rank: optimizer %lld (one process %lld, FSDP over 2 %lld, over 4 %lld), grads "
                "%lld, params %lld (FSDP over 2: %lld, %lld)\n",
                (long long)h.optimizer_peak_bytes, (long long)one.optimizer_peak_bytes, (long long)f.optimizer_peak_bytes,
                (long long)(8 * f4.shard), (long long)h.grads_peak_bytes, (long long)h.params_peak_bytes,
                (long long)f.grads_peak_bytes, (long long)f.params_peak_bytes);
  world().barrier();
}

// Checkpoints are the full tensors whatever zero is. With ONE micro-batch per rank per step (global batch =
// micro * p) zero = 3 is bitwise plain DP: each rank's gradient is computed in a zeroed buffer either way,
// the reduce-scatter folds the ranks in the same order as the all-reduce, the shard adds it to zero, AdamW
// is element-wise; only the global norm's double sum is ordered differently (~1e-16 relative, which
// reaches the fp32 clip coefficient with probability ~1e-9). So here everything is bitwise:
//   zero = 3 run == zero = 0 run (losses, parameters after every step), and their checkpoint files
//   (model.safetensors, optimizer.safetensors) are byte-identical;
//   a zero = 0 checkpoint resumed under zero = 3, and a zero = 3 checkpoint under zero = 0, continue the
//   uninterrupted run bitwise;
//   a zero = 3 checkpoint resumed in ONE process: its first step's loss (which depends only on the loaded
//   parameters and data position) is the saving run's, and the whole continuation equals one process
//   resumed from the zero = 0 checkpoint.
// (With several micro-batches per rank zero = 3 and DP differ by reassociation, see Zero3MatchesOneProcess,
// and after a few steps a parameter can cross a bf16 rounding boundary in one run and not in the other; the
// 1e-7 parameter bound then no longer holds: observed in one process with 2 micro-batches at step 5 of 6.)
TEST(MpiTrain, Zero3CheckpointsResumeUnderOtherLayouts) {
  if (!layout_ok()) GTEST_SKIP();
  const int p = world().size();
  const std::vector<std::string> base = {"--parallelism.dp_shard=" + std::to_string(p), "--checkpoint.enable=true",
                                         "--checkpoint.interval=3", "--training.steps=6",
                                         "--training.global_batch_size=" + std::to_string(kMicro * p)};
  auto with = [&](std::vector<std::string> a, bool dp = true) {
    for (auto& x : base)
      if (dp || x.find("dp_shard") == std::string::npos) a.push_back(x);
    return a;
  };
  auto same_continuation = [&](const TrainResult& res, const TrainResult& full, const std::string& what) {
    EXPECT_EQ(res.start_step, 3) << what;
    ASSERT_EQ(res.history.size(), 3u) << what;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(0, std::memcmp(&res.history[i].loss, &full.history[3 + i].loss, sizeof(double)))
          << what << ": step " << 4 + i << " " << res.history[i].loss << " vs " << full.history[3 + i].loss;
      EXPECT_EQ(res.history[i].param_hash, full.history[3 + i].param_hash) << what << " step " << 4 + i;
    }
  };
  // `to` gets only the step-3 checkpoint of `from` (per rank when `local`).
  auto cut_copy = [&](const std::string& from, const std::string& to, bool local) {
    copy_one_checkpoint(from, to, "step-3", local);
  };
  auto file_bytes = [](const fs::path& f) {
    std::ifstream in(f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  static Comm local = comm_local();
  const std::string d0 = shared_dir("mix_z0"), d3 = shared_dir("mix_z3");
  TrainResult full0 = train(tiny(d0, with({})), recorded(&world()));
  TrainResult full3 = train(tiny(d3, with({"--parallelism.zero=3"})), recorded(&world()));
  expect_bitwise_equal_runs(full3, full0, "zero=3 vs zero=0, one micro-batch per rank");
  if (world().rank() == 0) {
    for (const char* f : {"model.safetensors", "optimizer.safetensors"})
      for (const char* st : {"step-3", "step-6"}) {
        EXPECT_TRUE(file_bytes(fs::path(d0) / "checkpoint" / st / f) == file_bytes(fs::path(d3) / "checkpoint" / st / f))
            << st << "/" << f << " differs between zero=0 and zero=3";
      }
  }
  const std::string a = shared_dir("mix_0to3");
  cut_copy(d0, a, false);
  same_continuation(train(tiny(a, with({"--parallelism.zero=3"})), recorded(&world())), full0,
                    "zero=0 checkpoint -> zero=3");
  const std::string b = shared_dir("mix_3to0");
  cut_copy(d3, b, false);
  same_continuation(train(tiny(b, with({})), recorded(&world())), full3, "zero=3 checkpoint -> zero=0");
  // One process (each rank on its own copy).
  const std::string r = std::to_string(world().rank());
  const std::string l3 = dir_for("mix_local3_r" + r), l0 = dir_for("mix_local0_r" + r);
  cut_copy(d3, l3, true);
  cut_copy(d0, l0, true);
  TrainResult one3 = train(tiny(l3, with({}, false)), recorded(&local));
  TrainResult one0 = train(tiny(l0, with({}, false)), recorded(&local));
  ASSERT_EQ(one3.history.size(), 3u);
  EXPECT_EQ(0, std::memcmp(&one3.history[0].loss, &full3.history[3].loss, sizeof(double)))
      << "zero=3 checkpoint -> one process, step 4: " << one3.history[0].loss << " vs " << full3.history[3].loss;
  expect_bitwise_equal_runs(one3, one0, "one process resumed from the zero=3 vs the zero=0 checkpoint");
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
  if (p == 2) {  // cached FP8 activations: not built with EP nor with a split backward (docs/fp8.md), refused by name
    const std::vector<std::string> f8 = {"--quantize.recipe=tensorwise", "--quantize.cache_fp8_activations=true"};
    const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
        {{"--parallelism.dp_shard=2", "--parallelism.ep=2"},
         "quantize.cache_fp8_activations = true is not implemented with expert parallelism (parallelism.ep = 2)"},
        {{"--parallelism.pp=2", "--parallelism.pp_schedule=zb1p", "--parallelism.pp_layout=Ett|tL"},
         "quantize.cache_fp8_activations = true is not implemented with a split backward (parallelism.pp_schedule = "
         "zb1p"},
    };
    for (const auto& [ov, expect] : cases) {
      std::vector<std::string> all = ov;
      all.insert(all.end(), f8.begin(), f8.end());
      m = msg([&] { train(tiny(dir_for("f8cache_r" + std::to_string(world().rank())), all), recorded(&world())); });
      EXPECT_NE(m.find(expect), std::string::npos) << m;
    }
  }
  // (Every other impossible layout: tests/mpi/test_mpi_layouts.cpp.)
  world().barrier();
}
// main() is tests/mpi/mpi_gtest_main.cpp, shared by the MPI test binaries.
