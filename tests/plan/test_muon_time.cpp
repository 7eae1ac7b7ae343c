// test_muon_time.cpp: Muon's Newton-Schulz in the step-time projection (plan/cost.cpp newton_schulz_rank): its
// FLOPs at the GEMM rate, spread over the shard group by owner under a distributed optimizer, whole without one.
// Not the engine's Muon (tests/unit/test_muon.cpp) and not its memory (tests/plan/test_memory.cpp).
#include <gtest/gtest.h>

#include "moetron/muon_params.h"
#include "moetron/plan/cost.h"
#include "plan_test_util.h"

using namespace moetron;
using plantest::cfg;

namespace {
double optimizer_s(const JobConfig& c, int64_t world, bool distributed) {
  return plan::plan_time(c, plan::layout_from_config(c, world, distributed), plantest::round_gpu(), {}).optimizer;
}
// Every layer's matrices once: the FLOPs one process runs.
double ns_flops(const JobConfig& c) {
  double f = 0;
  for (int64_t l = 0; l < c.model.n_layers; ++l)
    for (const MuonShape& m : muon_layer_matrices(c.model, l))
      f += double(m.count) * newton_schulz_flops(m.rows, m.cols, c.optimizer.muon_ns_steps);
  return f;
}
}  // namespace

TEST(PlanMuon, NewtonSchulzIsItsFlopsAtTheGemmRate) {
  // One GPU of the round hardware (no GEMM curve: every shape at 1000 TFLOPS): Muon's optimizer term is AdamW's
  // (the same elements updated) plus the Newton-Schulz FLOPs at that rate.
  const JobConfig a = cfg("ds_mini", {"--optimizer.name=adamw"}), m = cfg("ds_mini", {"--optimizer.name=muon"});
  const double extra = optimizer_s(m, 1, true) - optimizer_s(a, 1, true);
  EXPECT_NEAR(extra, ns_flops(m) / 1000e12, 1e-9 * extra);
  EXPECT_GT(extra, 0.0);
  // Ten iterations: twice the work.
  const JobConfig m10 = cfg("ds_mini", {"--optimizer.name=muon", "--optimizer.muon_ns_steps=10"});
  EXPECT_NEAR(optimizer_s(m10, 1, true) - optimizer_s(a, 1, true), 2 * extra, 1e-9 * extra);
}

TEST(PlanMuon, OwnersShareTheWorkUnderADistributedOptimizer) {
  // dp 4 (no EP): a distributed optimizer spreads the matrices over the four ranks; without one each rank
  // orthogonalizes every matrix. The AdamW-side term divides by 4 as well under the distributed optimizer, so the
  // Newton-Schulz part is isolated against adamw at the same layout.
  const JobConfig a = cfg("ds_mini", {"--optimizer.name=adamw", "--training.global_batch_size=32"});
  const JobConfig m = cfg("ds_mini", {"--optimizer.name=muon", "--training.global_batch_size=32"});
  const double whole = ns_flops(m) / 1000e12;
  EXPECT_NEAR(optimizer_s(m, 4, true) - optimizer_s(a, 4, true), whole / 4, 1e-9 * whole);
  EXPECT_NEAR(optimizer_s(m, 4, false) - optimizer_s(a, 4, false), whole, 1e-9 * whole);
}

TEST(PlanMuon, MtpDepthsAddTheirMatrices) {
  // One MTP depth adds a block of the last layer's kind and eh_proj (2d x d) to Muon's matrices.
  const JobConfig m0 = cfg("ds_mini", {"--optimizer.name=muon"});
  const JobConfig m1 = cfg("ds_mini", {"--optimizer.name=muon", "--model.mtp_layers=1"});
  const JobConfig a1 = cfg("ds_mini", {"--optimizer.name=adamw", "--model.mtp_layers=1"});
  const int64_t steps = m1.optimizer.muon_ns_steps, d = m1.model.d_model;
  double extra = newton_schulz_flops(2 * d, d, steps);
  for (const MuonShape& m : muon_layer_matrices(m1.model, m1.model.n_layers - 1))
    extra += double(m.count) * newton_schulz_flops(m.rows, m.cols, steps);
  EXPECT_NEAR(optimizer_s(m1, 1, true) - optimizer_s(a1, 1, true), (ns_flops(m0) + extra) / 1000e12,
              1e-9 * ns_flops(m0) / 1000e12);
}
