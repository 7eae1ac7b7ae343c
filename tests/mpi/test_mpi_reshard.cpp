// test_mpi_reshard.cpp: checkpoints across layouts, run under mpirun with 4 ranks. ds_tiny with aux-loss-free
// balancing (so the expert biases travel too), synthetic data, 4 steps of the same global batch, a checkpoint at
// step 3. Every layout below saves once (its uninterrupted run); then every layout's step-3 checkpoint is resumed
// under every other layout for step 4. Layouts: one process; DP with ZeRO 0, 1 and 3; EP 2 (alltoall) and EP 4
// (sync_free, hierarchical); PP 4 (1f1b), PP 2 x DP 2 (interleaved), PP 2 x EP 2; HSDP 2 x 2 (zero = 3 over dp_shard
// 2, replicated over dp_replicate 2) without and with EP 2; TP 2 x DP 2; CP 2 x DP 2 with EP 2 over dp x cp.
//
// What a resumed step must match, and why (the layout sweep's reasoning, tests/mpi/test_mpi_layouts.cpp):
//  - The learning rate, the step counter and the sequences each rank trains are exactly those of the new
//    layout's uninterrupted step 4 (the data position is global at a step boundary).
//  - Against ONE PROCESS resuming the same checkpoint (the same starting state, so only the new layout's own
//    arithmetic differs): the step-4 loss bitwise (DP, flat EP and PP fold in the single-process order), within
//    1e-6 relative for the hierarchical combine (per-node partial sums) and for TP / CP (row-parallel partial sums,
//    ring-attention merges, losses summed over the CP ranks); the parameters after the step within
//    1e-6 relative L2 (the gradient's reassociation under DP / EP, a few 1e-7, through one AdamW step).
//  - Against the new layout's UNINTERRUPTED run: the sweep's trajectory bars, loss 1e-4 relative and parameters
//    1e-3 relative L2 (the two step-3 states differ by the layouts' reassociation and routing-flip noise).
// Not a speed test.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/trainer.h"
#include "train_check.h"

using namespace moetron;
using namespace mt_test;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 4, kSaved = 3;
constexpr double kStepLossRelHier = 1e-6, kStepParamRel = 1e-6, kLossRel = 1e-4, kParamRelL2 = 1e-3;

struct Layout {
  std::string name;
  bool one_process;  // trained by rank 0 alone
  bool hierarchical;
  std::vector<std::string> args;
};

std::vector<Layout> layouts() {
  const std::string dp = "--parallelism.dp_shard=", ep = "--parallelism.ep=", pp = "--parallelism.pp=",
                    rep = "--parallelism.dp_replicate=";
  const std::string disp = "--parallelism.ep_dispatcher=", sch = "--parallelism.pp_schedule=",
                    lay = "--parallelism.pp_layout=";
  return {
      {"one", true, false, {}},
      {"dp4", false, false, {dp + "4"}},
      {"dp4_zero1", false, false, {dp + "4", "--parallelism.zero=1"}},
      {"dp4_fsdp", false, false, {dp + "4", "--parallelism.zero=3"}},
      {"ep2_alltoall", false, false, {dp + "4", ep + "2", disp + "alltoall"}},
      {"ep4_sync_free", false, false, {dp + "4", ep + "4", disp + "sync_free"}},
      {"ep4_hierarchical", false, true, {dp + "4", ep + "4", disp + "hierarchical", "--parallelism.ranks_per_node=2"}},
      {"pp4_1f1b", false, false, {pp + "4", sch + "1f1b", lay + "Et|t|t|L"}},
      {"pp2_dp2_interleaved", false, false, {pp + "2", dp + "2", sch + "interleaved_1f1b", lay + "Et|t|t|L"}},
      {"pp2_ep2", false, false, {pp + "2", dp + "2", ep + "2", lay + "Et|ttL"}},
      {"hsdp2x2", false, false, {rep + "2", dp + "2", "--parallelism.zero=3"}},
      {"hsdp2x2_ep2", false, false, {rep + "2", dp + "2", "--parallelism.zero=3", ep + "2"}},
      // Tensor and context parallelism: their partial sums reassociate (the sweep's Bar::Tp), held like the
      // hierarchical combine against one process.
      {"tp2_dp2", false, true, {"--parallelism.tp=2", "--parallelism.expert_tp=2", dp + "2"}},
      {"cp2_dp2_ep2", false, true, {"--parallelism.cp=2", dp + "2", ep + "2"}},
  };
}

JobConfig tiny(const std::string& dump, const std::vector<std::string>& extra) {
  std::vector<std::string> ov = {"--job.dump_folder=" + dump,
                                 "--training.dataset=synthetic",
                                 "--metrics.peak_tflops=1.0",
                                 "--metrics.log_interval=1",
                                 "--training.val_interval=0",
                                 "--training.steps=" + std::to_string(kSteps),
                                 "--training.micro_batch_size=1",
                                 "--training.global_batch_size=8",
                                 "--model.load_balance=aux_free",
                                 "--checkpoint.enable=true",
                                 "--checkpoint.interval=" + std::to_string(kSaved),
                                 "--checkpoint.keep_latest_k=0",
                                 // fp32 compute: the bounds above are the sweep's, derived for fp32 wherever a
                                 // layout reassociates (TP / CP: the sweep runs them in fp32). In bf16 a TP partial
                                 // sum's reassociation can flip the bf16 rounding of an activation, and bf16
                                 // attention (auto on AMD AVX512-BF16 and Intel AMX CPUs) rounds q, k, v, P and dS
                                 // too: the runs then part by more (measured on an AMD EPYC: tp2_dp2 4.7e-6 against
                                 // one process, 1.03e-3 against its own run; bf16 attention 2.4e-3). The
                                 // checkpoints hold fp32 masters whatever the compute dtype; test_mpi_layouts.cpp
                                 // holds the bf16 layouts to their own bounds.
                                 "--training.compute_dtype=fp32"};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return load_config(repo("configs/ds_tiny.toml"), ov);
}

Comm& local() {
  static Comm c = comm_local();
  return c;
}

// Trains layout L in `dump` (rank 0 alone for the one-process layout: the others get an empty result).
TrainResult run(const Layout& L, const std::string& dump) {
  TrainResult r;
  if (!L.one_process) r = train(tiny(dump, L.args), recorded(&world()));
  else if (world().rank() == 0) r = train(tiny(dump, L.args), recorded(&local()));
  world().barrier();
  return r;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double d2 = 0, n2 = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    d2 += d * d, n2 += double(b[i]) * b[i];
  }
  return std::sqrt(d2 / n2);
}

std::vector<SeqRecord> step_data(const TrainResult& r, int64_t step) {
  std::vector<SeqRecord> v;
  for (const auto& s : r.data)
    if (s.step == step) v.push_back(s);
  return v;
}

}  // namespace

TEST(MpiReshard, EveryLayoutResumesEveryOthersCheckpoint) {
  if (world().size() != 4) GTEST_SKIP() << "the matrix is laid out for 4 ranks";
  const bool r0 = world().rank() == 0;
  const std::vector<Layout> all = layouts();
  std::map<std::string, TrainResult> full;  // uninterrupted runs, which also wrote the step-3 checkpoints
  std::map<std::string, std::string> saved;
  for (const Layout& L : all) {
    saved[L.name] = shared_dir("moetron_mpi_reshard_", "save_" + L.name);
    full[L.name] = run(L, saved[L.name]);
  }
  int pairs = 0;
  for (const Layout& A : all) {
    // One process resumes A's checkpoint first: the same starting state as every other resume below.
    TrainResult one_from_a;
    for (const Layout& B : all) {
      if (B.name == A.name && !B.one_process) continue;
      const std::string what = A.name + " -> " + B.name;
      const std::string d = shared_dir("moetron_mpi_reshard_", "resume");
      copy_one_checkpoint(saved[A.name], d, "step-" + std::to_string(kSaved), false);
      TrainResult got = run(B, d);
      const TrainResult& ref = full[B.name];
      if (B.one_process) one_from_a = got;
      ++pairs;
      if (B.one_process && !r0) continue;
      ASSERT_EQ(got.start_step, kSaved) << what;
      ASSERT_EQ(got.history.size(), size_t(kSteps - kSaved)) << what;
      const StepRecord &g = got.history[0], &u = ref.history[size_t(kSaved)];
      EXPECT_EQ(g.step, u.step) << what;
      EXPECT_EQ(0, std::memcmp(&g.lr, &u.lr, sizeof(double))) << what << ": learning rate";
      // Each rank trains the sequences it trains in B's own uninterrupted step 4.
      const auto gd = step_data(got, kSteps), ud = step_data(ref, kSteps);
      ASSERT_EQ(gd.size(), ud.size()) << what;
      for (size_t i = 0; i < gd.size(); ++i)
        EXPECT_TRUE(gd[i].index == ud[i].index && gd[i].hash == ud[i].hash) << what << ": sequence " << i;
      EXPECT_LE(std::abs(g.loss - u.loss) / u.loss, kLossRel) << what << ": loss against B's uninterrupted run";
      ASSERT_EQ(got.final_params.size(), ref.final_params.size()) << what;
      EXPECT_LE(rel_l2(got.final_params, ref.final_params), kParamRelL2) << what << ": parameters";
      if (r0 && !B.one_process) {
        const double l1 = one_from_a.history.at(0).loss;
        if (B.hierarchical)
          EXPECT_LE(std::abs(g.loss - l1) / l1, kStepLossRelHier) << what << ": loss against one process";
        else
          EXPECT_EQ(0, std::memcmp(&g.loss, &l1, sizeof(double)))
              << what << ": loss " << g.loss << " against one process " << l1;
        EXPECT_LE(rel_l2(got.final_params, one_from_a.final_params), kStepParamRel) << what << ": parameters";
      }
    }
  }
  EXPECT_EQ(pairs, int(all.size() * all.size() - (all.size() - 1)));
}
