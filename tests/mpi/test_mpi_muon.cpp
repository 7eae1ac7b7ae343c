// test_mpi_muon.cpp: Muon (optimizer.name = "muon") under the parallel layouts, run under mpirun with 2 and 4 ranks:
// ds_tiny, synthetic data, 5 steps of the same global batch (8 sequences, micro-batch 1), each layout against the
// single-process Muon run (every rank trains it once, comm_local()), and the sharded layouts against their unsharded
// twin; then resume under ZeRO-1 and FSDP, and the optimizer memory per rank. Context parallelism (fp32) against
// the fp32 single-process run: step 1's loss to the sweep's TP / CP bar (1e-6), the trajectory to the DP bars.
//
// What is bitwise and what is not (test_mpi_layouts.cpp derives the bars; Muon adds no reassociation of its own,
// it amplifies the layouts'):
//  - Muon's arithmetic does not depend on the layout: the momentum is element-wise, the owner of a matrix assembles
//    X exactly from the pieces, and Newton-Schulz runs on the whole matrix with the batch-invariant gemm_f32, whose
//    bits do not depend on the thread count (tests/ops/muon_cases.cpp). So a sharded run equals its unsharded twin
//    BITWISE at every step when both reduce the gradient alike: ZeRO-1 (all-reduce, then slices) against zero = 0
//    with the same dp and ep. This is the sharp check of the gather / orthogonalize / scatter scheme.
//  - PP alone is bitwise the single-process run (each stage holds whole matrices; the gradients are the same bits).
//  - DP, FSDP and EP reassociate the gradient sums (a few 1e-7 relative: kGradRel on step 1; step 1's loss is
//    bitwise, the parameters are the same). Newton-Schulz then amplifies that noise more than AdamW does: its
//    derivative at 0 is a^5 = 3.4445^5 = 485, so the small singular values of an ill-conditioned X (few tokens for
//    an expert, the first steps' momentum) carry the layouts' rounding differences into the update up to 485 times
//    larger, and a changed update can flip a later step's routing, as under AdamW. Measured on dp2 (2026-11-28):
//    parameters 6.7e-9 relative L2 apart after step 1, 2.6e-6 after 2, 8.3e-6 after 3, 1e-4 after 5 (AdamW in the
//    same runs: 5.9e-7 after 5); losses 4e-6 relative. The sweep's DP bars (loss 1e-4, parameters 1e-3 relative L2) still hold with a
//    factor 10 to 20 of room; a wrong scheme is far outside them (one element of each received piece shifted:
//    parameters 5e-3 to 9e-3 apart, losses 3e-4), and the ZeRO-1 twin check above is bitwise.
// Memory: the momentum has the layout of AdamW's first moment (padded flat runs, ZeRO-1 slices, FSDP shard blocks),
// v only the AdamW parameters' elements: summed over a shard group they are the single-process figures exactly.
// Not a benchmark.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "moetron/accounting.h"
#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/muon_params.h"
#include "moetron/param_layout.h"
#include "moetron/trainer.h"
#include "train/muon_state.h"
#include "train_check.h"

using namespace moetron;
using namespace mt_test;
namespace fs = std::filesystem;

namespace {

constexpr int kSteps = 5;
constexpr double kGradRel = 1e-6, kLossRel = 1e-4, kParamRelL2 = 1e-3, kCpStep1LossRel = 1e-6;

JobConfig tiny(const std::string& dump, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> ov = {"--job.dump_folder=" + dump, "--training.dataset=synthetic", "--metrics.peak_tflops=1.0",
                                 "--metrics.log_interval=1", "--checkpoint.enable=false",
                                 "--training.steps=" + std::to_string(kSteps), "--training.micro_batch_size=1",
                                 "--training.global_batch_size=8", "--optimizer.name=muon"};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return load_config(repo("configs/ds_tiny.toml"), ov);
}

std::string dir(const std::string& name) { return mt_test::shared_dir("moetron_mpi_muon_", name); }

// The single-process run, in the compute dtype the layout asks for (context parallelism computes in fp32).
const TrainResult& reference(bool fp32) {
  static Comm local = comm_local();
  static std::map<bool, TrainResult> cache;
  if (!cache.count(fp32)) {
    const std::string d = temp_dir("moetron_mpi_muon_ref_rank" + std::to_string(world().rank()), fp32 ? "_fp32" : "");
    fs::remove_all(d);
    std::vector<std::string> a;
    if (fp32) a.push_back("--training.compute_dtype=fp32");
    cache[fp32] = train(tiny(d, a), recorded(&local));
  }
  return cache[fp32];
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double d2 = 0, n2 = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    d2 += d * d, n2 += double(b[i]) * double(b[i]);
  }
  return std::sqrt(d2 / n2);
}

bool bitwise_runs(const TrainResult& a, const TrainResult& b) {
  if (a.history.size() != b.history.size() || a.final_params.size() != b.final_params.size()) return false;
  for (size_t i = 0; i < a.history.size(); ++i)
    if (std::memcmp(&a.history[i].loss, &b.history[i].loss, 8) != 0 || a.history[i].param_hash != b.history[i].param_hash)
      return false;
  return std::memcmp(a.final_params.data(), b.final_params.data(), a.final_params.size() * 4) == 0;
}

enum class Bar { Exact, Bitwise, Cp };

struct Layout {
  std::string name;
  int world;
  std::vector<std::string> args;
  Bar bar;
  std::string twin;  // a layout of the list that this one must equal bitwise ("" = none)
};

std::vector<Layout> layouts() {
  const std::string dp = "--parallelism.dp_shard=", ep = "--parallelism.ep=", z = "--parallelism.zero=";
  const std::string pp = "--parallelism.pp=", lay = "--parallelism.pp_layout=", sch = "--parallelism.pp_schedule=";
  return {
      {"dp2", 2, {dp + "2"}, Bar::Exact, ""},
      {"dp2_zero1", 2, {dp + "2", z + "1"}, Bar::Exact, "dp2"},
      {"dp2_fsdp", 2, {dp + "2", z + "3"}, Bar::Exact, ""},
      {"ep2", 2, {dp + "2", ep + "2"}, Bar::Exact, ""},
      {"ep2_fsdp", 2, {dp + "2", ep + "2", z + "3"}, Bar::Exact, ""},
      {"pp2", 2, {pp + "2", lay + "Ett|tL"}, Bar::Bitwise, ""},
      {"pp2_zbv", 2, {pp + "2", sch + "zbv", lay + "Et|t|t|L"}, Bar::Bitwise, ""},
      {"cp2", 2, {"--parallelism.cp=2", "--training.compute_dtype=fp32"}, Bar::Cp, ""},
      {"cp2_dp2_zero1", 4, {"--parallelism.cp=2", dp + "2", z + "1", "--training.compute_dtype=fp32"}, Bar::Cp, ""},
      {"dp4", 4, {dp + "4"}, Bar::Exact, ""},
      {"dp4_zero1", 4, {dp + "4", z + "1"}, Bar::Exact, "dp4"},
      {"dp4_fsdp", 4, {dp + "4", z + "3"}, Bar::Exact, ""},
      {"ep2_np4", 4, {dp + "4", ep + "2"}, Bar::Exact, ""},
      {"ep2_np4_zero1", 4, {dp + "4", ep + "2", z + "1"}, Bar::Exact, "ep2_np4"},
      {"ep2_np4_fsdp", 4, {dp + "4", ep + "2", z + "3"}, Bar::Exact, ""},
      {"hsdp2x2_ep2", 4, {"--parallelism.dp_replicate=2", dp + "2", ep + "2", z + "3"}, Bar::Exact, ""},
      {"pp2_dp2_zero1", 4, {pp + "2", dp + "2", z + "1", lay + "Ett|tL"}, Bar::Exact, ""},
      {"pp2_ep2", 4, {pp + "2", dp + "2", ep + "2", lay + "Et|ttL"}, Bar::Exact, ""},
  };
}

// Runs of this process's world, by name (a twin is trained before the layouts that name it: list order).
std::map<std::string, TrainResult>& runs() {
  static std::map<std::string, TrainResult> m;
  return m;
}

}  // namespace

class MpiMuon : public ::testing::TestWithParam<Layout> {};

TEST_P(MpiMuon, MatchesOneProcess) {
  const Layout& L = GetParam();
  if (L.world != world().size()) GTEST_SKIP() << L.name << " needs " << L.world << " ranks";
  bool fp32 = false;
  for (const auto& a : L.args) fp32 = fp32 || a == "--training.compute_dtype=fp32";
  const TrainResult& ref = reference(fp32);
  const TrainResult& got = runs()[L.name] = train(tiny(dir(L.name), L.args), recorded(&world()));
  ASSERT_EQ(got.history.size(), size_t(kSteps));
  ASSERT_EQ(got.final_params.size(), ref.final_params.size());
  expect_same_on_all_ranks(got.final_params.data(), int64_t(got.final_params.size() * 4), L.name + ": final params");
  const double l1 = got.history[0].loss, r1 = ref.history[0].loss;
  if (L.bar == Bar::Cp) {  // ring attention's merges and the CP sums reassociate: the sweep's TP / CP bar
    EXPECT_LE(std::abs(l1 - r1) / std::abs(r1), kCpStep1LossRel) << L.name << ": step 1 loss";
  } else {
    EXPECT_EQ(0, std::memcmp(&l1, &r1, 8)) << L.name << ": step 1 loss " << l1 << " vs one process " << r1;
  }
  if (L.bar == Bar::Bitwise) {
    EXPECT_TRUE(bitwise_runs(got, ref)) << L.name << ": every step and parameter, bitwise";
  }
  const double gd = rel_l2(got.first_grads, ref.first_grads), pd = rel_l2(got.final_params, ref.final_params);
  EXPECT_LE(gd, kGradRel) << L.name << ": step 1 gradient";
  double worst = 0;
  for (int i = 0; i < kSteps; ++i) {
    const double a = got.history[size_t(i)].loss, b = ref.history[size_t(i)].loss;
    worst = std::max(worst, std::abs(a - b) / std::abs(b));
  }
  EXPECT_LE(worst, kLossRel) << L.name << ": loss over " << kSteps << " steps";
  EXPECT_LE(pd, kParamRelL2) << L.name << ": parameters after " << kSteps << " steps";
  bool twin_bitwise = true;
  if (!L.twin.empty()) {
    ASSERT_TRUE(runs().count(L.twin)) << L.twin << " runs first";
    twin_bitwise = bitwise_runs(got, runs()[L.twin]);
    EXPECT_TRUE(twin_bitwise) << L.name << " vs " << L.twin << ": the sharded Muon step must give the same bits";
  }
  if (world().rank() == 0)
    std::printf("[%-16s] step 1: loss %s, grad rel L2 %.2e; %d steps: loss max rel %.2e, params rel L2 %.2e%s\n",
                L.name.c_str(), l1 == r1 ? "bitwise" : "differs", gd, kSteps, worst, pd,
                L.twin.empty() ? "" : twin_bitwise ? "; bitwise equal to its unsharded twin" : "; NOT equal to its twin");
}

INSTANTIATE_TEST_SUITE_P(Sweep, MpiMuon, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<Layout>& i) { return i.param.name; });

// The optimizer state per rank: momentum in the m layout, v for the AdamW parameters only. Over the shard group the
// v elements add up to the single-process AdamW count exactly, and so does the momentum (ZeRO-1; FSDP adds its
// chunks' padding). estimate_memory: exact without sharding; the average rank under ZeRO-1 / FSDP.
TEST(MpiMuonState, OptimizerMemoryPerRank) {
  const int p = world().size();
  const ModelSpec s = tiny("unused").model;
  int64_t padded = 0, adam = 0;
  for (const ParamEntry& e : model_param_layout(s)) {
    padded += param_padded_numel(e.numel);
    if (!muon_matrices(s, e.name, e.shape).muon()) adam += e.numel;
  }
  for (int zero : {0, 1, 3}) {
    const std::vector<std::string> a = {"--parallelism.dp_shard=" + std::to_string(p), "--parallelism.zero=" + std::to_string(zero),
                                        "--training.steps=1"};
    const TrainResult r = train(tiny(dir("mem"), a), recorded(&world()));
    int64_t sum = r.opt_state_bytes, mx = r.opt_state_bytes;
    world().all_reduce(&sum, 1);
    std::vector<int64_t> all(static_cast<size_t>(p));
    world().all_gather(all.data(), &r.opt_state_bytes, 8);
    for (int64_t v : all) mx = std::max(mx, v);
    const double est = estimate_memory(tiny("unused", a), 2, 1).optimizer;
    if (zero == 0) {
      EXPECT_EQ(r.opt_state_bytes, 4 * (padded + adam)) << "zero = 0: the whole state on every rank";
      EXPECT_EQ(est, double(r.opt_state_bytes));
    } else if (zero == 1) {
      EXPECT_EQ(sum, 4 * (padded + adam)) << "zero = 1: the slices partition m, and v's AdamW elements";
      EXPECT_NEAR(est, double(sum) / p, 0.01 * double(sum) / p) << "zero = 1: the estimate is the average rank";
    } else {
      // FSDP: m is the shard, p chunks of pad16(ceil(n / p)) per run of a unit (n: its pad16 elements), so the sum
      // is the padded layout plus at most 16 p floats per run (a unit has a dense and an expert run; units: embedding,
      // each layer, norm + head); v exactly the AdamW elements of the shard.
      const int64_t runs = 2 * (s.n_layers + 2);
      EXPECT_GE(sum, 4 * (padded + adam)) << "zero = 3";
      EXPECT_LE(sum, 4 * (padded + adam) + 4 * 16 * p * runs) << "zero = 3";
      EXPECT_NEAR(est, double(sum) / p, 0.02 * double(sum) / p) << "zero = 3: the estimate is the average rank";
    }
    if (world().rank() == 0)
      std::printf("[muon memory zero=%d np%d] optimizer per rank: max %lld, sum %lld (one process %lld), estimate %.0f\n",
                  zero, p, (long long)mx, (long long)sum, (long long)(4 * (padded + adam)), est);
  }
}

// Resume under ZeRO-1 and FSDP: the momentum of every matrix, gathered to the global layout and written, then sliced
// back, continues bitwise.
TEST(MpiMuonState, ResumeContinuesBitwise) {
  const int p = world().size();
  for (int zero : {1, 3}) {
    const std::vector<std::string> ov = {"--parallelism.dp_shard=" + std::to_string(p), "--parallelism.zero=" + std::to_string(zero),
                                         "--checkpoint.enable=true", "--checkpoint.interval=3", "--training.steps=6"};
    const TrainResult full = train(tiny(dir("resume_full"), ov), recorded(&world()));
    const std::string d = dir("resume_cut");
    train(tiny(d, ov), recorded(&world()));
    if (world().rank() == 0) fs::remove_all(fs::path(d) / "checkpoint" / "step-6");
    world().barrier();
    const TrainResult res = train(tiny(d, ov), recorded(&world()));
    EXPECT_EQ(res.start_step, 3) << "zero=" << zero;
    ASSERT_EQ(res.history.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(0, std::memcmp(&res.history[i].loss, &full.history[3 + i].loss, 8)) << "zero=" << zero << " step " << 4 + i;
      EXPECT_EQ(res.history[i].param_hash, full.history[3 + i].param_hash) << "zero=" << zero << " step " << 4 + i;
    }
  }
}

// MuonState alone (src/train/muon_state.h), without a model: an element space of three Muon parameters (three stacked
// 40 x 24 matrices in gate | up blocks, a 50 x 30 and a 16 x 64 matrix, 16-aligned like the flat layout) cut into the
// world's ranks at points that split matrices, two steps, against the same space held whole by one rank (comm null).
// Owners, the two exchanges and the batching (one matrix per batch, two, all) must give the whole run's bits.
TEST(MpiMuonState, ShardedBlocksEqualTheWholeSpaceBitwise) {
  const int p = world().size(), me = world().rank();
  std::vector<MuonBlock::Param> params;
  int64_t n = 0;
  auto add = [&](int64_t count, int64_t rows, int64_t cols, std::vector<int64_t> segs) {
    MuonBlock::Param q;
    q.start = n, q.mm.count = count, q.mm.rows = rows, q.mm.cols = cols, q.mm.col_segs = std::move(segs);
    params.push_back(q);
    n += (count * rows * cols + 15) / 16 * 16;
  };
  add(3, 40, 24, {12, 12});
  add(1, 50, 30, {30});
  add(1, 16, 64, {32, 32});
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto randv = [&](float sc) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = sc * nd(rng);
    return v;
  };
  const std::vector<float> w0 = randv(0.02f), g1 = randv(1.0f), g2 = randv(0.5f);
  // The whole space on this rank alone.
  std::vector<float> wa = w0, ga = g1, ma(static_cast<size_t>(n), 0.0f);
  MuonBlock whole;
  whole.bounds = {0, n}, whole.p = wa.data(), whole.g = ga.data(), whole.m = ma.data(), whole.params = params;
  MuonState one({whole}, 0.95f, true, 5);
  one.step(0.01f, 0.1f, 0.7f);
  ga = g2;
  one.step(0.008f, 0.1f, 1.0f);
  for (int64_t batch : {int64_t(1), int64_t(2000), int64_t(1) << 22}) {
    std::vector<int64_t> bounds;
    for (int q = 0; q <= p; ++q) bounds.push_back(n * q / p + (q > 0 && q < p ? 7 : 0));  // cuts inside matrices
    const int64_t lo = bounds[size_t(me)], hi = bounds[size_t(me) + 1];
    std::vector<float> w(w0.begin() + lo, w0.begin() + hi), g(g1.begin() + lo, g1.begin() + hi);
    std::vector<float> m(static_cast<size_t>(hi - lo), 0.0f);
    MuonBlock b;
    b.comm = &world(), b.me = me, b.bounds = bounds, b.p = w.data(), b.g = g.data(), b.m = m.data(), b.params = params;
    MuonState st({b}, 0.95f, true, 5, batch);
    st.step(0.01f, 0.1f, 0.7f);
    std::copy(g2.begin() + lo, g2.begin() + hi, g.begin());
    st.step(0.008f, 0.1f, 1.0f);
    std::vector<int64_t> counts, displs;
    for (int q = 0; q < p; ++q) counts.push_back((bounds[size_t(q) + 1] - bounds[size_t(q)]) * 4), displs.push_back(bounds[size_t(q)] * 4);
    std::vector<float> wall(static_cast<size_t>(n)), mall(static_cast<size_t>(n));
    world().all_gather_v(wall.data(), counts.data(), displs.data(), w.data());
    world().all_gather_v(mall.data(), counts.data(), displs.data(), m.data());
    EXPECT_EQ(0, std::memcmp(wall.data(), wa.data(), size_t(n) * 4)) << "weights, batch " << batch;
    EXPECT_EQ(0, std::memcmp(mall.data(), ma.data(), size_t(n) * 4)) << "momentum, batch " << batch;
    int64_t owned = st.owned_matrices();
    world().all_reduce(&owned, 1);
    EXPECT_EQ(owned, 5) << "every matrix has one owner";
  }
  double moved = 0;
  for (int64_t i = 0; i < n; ++i) moved = std::max(moved, double(std::abs(wa[size_t(i)] - w0[size_t(i)])));
  EXPECT_GT(moved, 1e-4) << "the steps changed the weights";
}
