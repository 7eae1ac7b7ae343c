// test_muon.cpp: Muon in the trainer on one process (optimizer.name = "muon"): which parameters are Muon matrices and
// how they split (muon_params.h) against the parameter table; the config keys and their refusals; the first step
// of a whole ds_tiny run against a float64 twin of the optimizer (Muon per matrix, AdamW for the rest); bitwise
// resume with the momentum in the checkpoint; the optimizer memory measured against estimate_memory.
// Not the kernels' tests (tests/ops/muon_cases.cpp) and not the parallel layouts (tests/mpi/test_mpi_muon.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "moetron/accounting.h"
#include "moetron/checkpoint.h"
#include "moetron/config.h"
#include "moetron/muon.h"
#include "moetron/muon_params.h"
#include "moetron/optim.h"
#include "moetron/param_layout.h"
#include "moetron/trainer.h"
#include "train_test_util.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {
JobConfig tiny(const std::string& dump, std::vector<std::string> extra = {}) {
  return moetron::testing::tiny_job(dump, extra);
}
std::string fresh_dir(const std::string& name) { return moetron::testing::fresh_test_dir("moetron_muon_", name); }
TrainOptions quiet() { return moetron::testing::quiet_options(); }

const std::vector<std::string> kMla = {"--model.attn_type=mla", "--model.q_lora_rank=32", "--model.kv_lora_rank=32",
                                       "--model.qk_nope_head_dim=16", "--model.qk_rope_head_dim=8",
                                       "--model.v_head_dim=16"};
const std::vector<std::string> kGqa = {"--model.attn_type=gqa", "--model.n_kv_heads=2", "--model.qk_norm=true"};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// Muon takes every 2-D block weight and each expert's matrices; AdamW the embedding, head, norms and router. The
// element counts the accounting uses (muon_layer_numel) are the table's.
TEST(MuonParams, MatricesOfEveryAttentionKind) {
  for (const auto& extra : {std::vector<std::string>{}, kMla, kGqa}) {
    const ModelSpec s = tiny("unused", extra).model;
    int64_t muon = 0, layer_sum = 0;
    std::set<std::string> adam;
    for (const ParamEntry& e : model_param_layout(s)) {
      const MuonMatrices mm = muon_matrices(s, e.name, e.shape);
      if (!mm.muon()) {
        adam.insert(e.name.substr(e.name.rfind('.') + 1));
        EXPECT_TRUE(e.shape.size() == 1 || e.name == "embed" || e.name == "head" || e.name.find("moe.gate") != std::string::npos)
            << e.name << " is a matrix AdamW would take";
        continue;
      }
      muon += e.numel;
      EXPECT_EQ(mm.count * mm.rows * mm.cols, e.numel) << e.name;
      int64_t sum = 0;
      for (int64_t c : mm.col_segs) sum += c;
      EXPECT_EQ(sum, mm.cols) << e.name;
      if (e.name.find("experts") != std::string::npos) EXPECT_EQ(mm.count, s.moe.n_routed_experts) << e.name;
      if (e.name.find("w13") != std::string::npos) EXPECT_EQ(mm.col_segs.size(), 2u) << e.name << ": gate | up";
      if (e.name.find("wqkv") != std::string::npos) EXPECT_EQ(mm.col_segs.size(), 3u) << e.name << ": q | k | v";
    }
    for (int64_t l = 0; l < s.n_layers; ++l) layer_sum += muon_layer_numel(s, l).total();
    EXPECT_EQ(muon, layer_sum) << "muon_layer_numel against the parameter table";
    EXPECT_TRUE(adam.count("gate") && adam.count("embed") && adam.count("head") && adam.count("attn_norm"));
  }
  // Under EP a rank's expert tensor is [E / ep, R, C]: that many matrices.
  const ModelSpec s = tiny("unused").model;
  ParamSelection sel;
  sel.ep = 2, sel.ep_rank = 1;
  for (const ParamEntry& e : model_param_layout(s, sel))
    if (e.expert) EXPECT_EQ(muon_matrices(s, e.name, e.shape).count, s.moe.n_routed_experts / 2) << e.name;
}

// The planner prices Newton-Schulz from muon_layer_matrices (the spec alone): per layer the same matrices, by
// shape and count, as the trainer orthogonalizes from the parameter table (muon_matrices' column blocks).
TEST(MuonParams, LayerMatricesAreTheTablesMatrices) {
  for (const auto& extra : {std::vector<std::string>{}, kMla, kGqa}) {
    const ModelSpec s = tiny("unused", extra).model;
    std::vector<std::map<std::pair<int64_t, int64_t>, int64_t>> table(size_t(s.n_layers)), spec(size_t(s.n_layers));
    for (const ParamEntry& e : model_param_layout(s)) {
      const MuonMatrices mm = muon_matrices(s, e.name, e.shape);
      if (!mm.muon()) continue;
      for (int64_t seg : mm.col_segs) table[size_t(e.layer)][{mm.rows, seg}] += mm.count;
    }
    for (int64_t l = 0; l < s.n_layers; ++l)
      for (const MuonShape& m : muon_layer_matrices(s, l)) spec[size_t(l)][{m.rows, m.cols}] += m.count;
    for (int64_t l = 0; l < s.n_layers; ++l) EXPECT_EQ(spec[size_t(l)], table[size_t(l)]) << "layer " << l;
  }
  EXPECT_DOUBLE_EQ(newton_schulz_flops(3, 5, 2), 2.0 * (4 * 9 * 5 + 2 * 27));
  EXPECT_DOUBLE_EQ(newton_schulz_flops(5, 3, 2), newton_schulz_flops(3, 5, 2));
}

TEST(MuonConfig, KeysAndRefusals) {
  const std::string d = fresh_dir("cfg");
  JobConfig c = tiny(d, {"--optimizer.name=muon", "--optimizer.muon_momentum=0.9", "--optimizer.muon_nesterov=false",
                         "--optimizer.muon_ns_steps=4"});
  EXPECT_TRUE(c.optimizer.muon());
  EXPECT_EQ(load_config_string(to_toml(c)), c) << "to_toml round trip";
  // A muon_* key under AdamW does nothing: refused by name.
  std::string e = error_of([&] { tiny(d, {"--optimizer.muon_momentum=0.9"}); });
  EXPECT_NE(e.find("optimizer.muon_momentum = 0.9: applies to optimizer.name = \"muon\" only"), std::string::npos) << e;
  e = error_of([&] { tiny(d, {"--optimizer.muon_nesterov=false"}); });
  EXPECT_NE(e.find("optimizer.muon_nesterov"), std::string::npos) << e;
  e = error_of([&] { tiny(d, {"--optimizer.name=muon", "--optimizer.muon_ns_steps=0"}); });
  EXPECT_NE(e.find("optimizer.muon_ns_steps = 0: must be in [1, 20]"), std::string::npos) << e;
  e = error_of([&] { tiny(d, {"--optimizer.name=muon", "--optimizer.muon_momentum=1"}); });
  EXPECT_NE(e.find("optimizer.muon_momentum = 1: must be in [0, 1)"), std::string::npos) << e;
  // Tensor parallelism slices the matrices: refused with Muon, naming both.
  e = error_of([&] {
    tiny(d, {"--optimizer.name=muon", "--parallelism.tp=2", "--parallelism.expert_tp=2", "--training.compute_dtype=fp32"});
  });
  EXPECT_NE(e.find("optimizer.name = \"muon\": not implemented with parallelism.tp = 2"), std::string::npos) << e;
  EXPECT_NO_THROW(tiny(d, {"--parallelism.tp=2", "--parallelism.expert_tp=2", "--training.compute_dtype=fp32"}));
  e = error_of([&] { tiny(d, {"--optimizer.name=lion"}); });
  EXPECT_NE(e.find("optimizer.name"), std::string::npos) << e;
}

// One step of ds_tiny (fp32 compute) against the optimizer's float64 twin applied to the initial parameters and the
// step's reduced gradient: Muon per matrix and column block (muon_update_ref), AdamW (adamw_step_textbook) for the
// rest. The tolerance per element: Muon lr * scale * 1.21 * the Newton-Schulz bound of tests/ops/muon_cases.cpp (the
// fp32 kernel against the float64 twin, relative to max |O| <= 1.21) plus 2 roundings of w; AdamW lr * 7e-6 + 2 u
// |w| (adamw_cases.cpp's bound for one step).
TEST(MuonTrainer, FirstStepMatchesTheFloat64Twin) {
  TrainOptions o = quiet();
  o.keep_params = true, o.keep_first_grads = true;
  const JobConfig c = tiny(fresh_dir("twin"), {"--optimizer.name=muon", "--training.steps=1",
                                               "--training.compute_dtype=fp32", "--optimizer.weight_decay=0.3"});
  const TrainResult r = train(c, o);
  ASSERT_EQ(r.history.size(), 1u);
  const std::vector<ParamEntry> gp = model_param_layout(c.model);
  const float clip = clip_coefficient(r.history[0].grad_norm, c.training.max_norm);
  const double lr = r.history[0].lr, wd = c.optimizer.weight_decay, u = 5.960464477539063e-08;
  AdamWConfig ac;
  ac.lr = float(lr), ac.beta1 = float(c.optimizer.beta1), ac.beta2 = float(c.optimizer.beta2);
  ac.eps = float(c.optimizer.eps), ac.weight_decay = float(wd);
  int64_t muon_elems = 0;
  for (const ParamEntry& e : gp) {
    std::vector<float> w0(static_cast<size_t>(e.numel));
    init_param_elements(w0.data(), e, uint64_t(c.training.seed), 0, e.numel);
    std::vector<double> w(w0.begin(), w0.end()), m(w.size(), 0.0), v(w.size(), 0.0);
    std::vector<double> g(r.first_grads.begin() + e.offset, r.first_grads.begin() + e.offset + e.numel);
    const MuonMatrices mm = muon_matrices(c.model, e.name, e.shape);
    double atol = lr * 7e-6;
    if (mm.muon()) {
      muon_elems += e.numel;
      const int64_t sz = mm.rows * mm.cols;
      for (int64_t k = 0; k < mm.count; ++k)
        muon_update_ref<double>(w.data() + k * sz, m.data() + k * sz, g.data() + k * sz, mm.rows, mm.cols, mm.col_segs,
                                c.optimizer.muon_momentum, c.optimizer.muon_nesterov, int(c.optimizer.muon_ns_steps),
                                clip, lr, wd, e.decay);
      atol = 0;
      for (int64_t s : mm.col_segs) {  // the bound of muon_cases.cpp's ns_tolerance, 5 steps, L = 3.88
        const double n = double(std::max(mm.rows, s)), L = 3.88;
        const double tol = (3 * std::sqrt(n) + 1) * u * (std::pow(L, 5) - 1) / (L - 1);
        atol = std::max(atol, lr * muon_scale(mm.rows, s) * 1.21 * tol);
      }
    } else {
      adamw_step_textbook(w.data(), m.data(), v.data(), g.data(), e.numel, ac, 1, clip, e.decay);
    }
    double worst = 0;
    for (int64_t i = 0; i < e.numel; ++i) {
      const double got = r.final_params[size_t(e.offset + i)], want = w[size_t(i)];
      const double err = std::abs(got - want), lim = atol + 2 * u * std::abs(want);
      worst = std::max(worst, err / lim);
      if (err > lim) {
        ADD_FAILURE() << e.name << " element " << i << ": " << got << " vs float64 twin " << want << " (limit " << lim
                      << (mm.muon() ? ", Muon)" : ", AdamW)");
        break;
      }
    }
    if (e.name.find("layers.1.") == 0 || e.name == "embed")
      std::printf("[muon twin] %-28s %s worst %.3f of the limit\n", e.name.c_str(), mm.muon() ? "muon " : "adamw", worst);
  }
  EXPECT_GT(muon_elems, 0);
}

// Resume: the momentum (m.) of every matrix and AdamW's m. / v. of the rest are in the checkpoint; a run resumed from
// step 3 continues bitwise as the uninterrupted one. Muon matrices have no v. tensor.
TEST(MuonTrainer, ResumeContinuesBitwise) {
  const std::vector<std::string> ck = {"--optimizer.name=muon", "--checkpoint.enable=true", "--checkpoint.interval=3",
                                       "--checkpoint.keep_latest_k=0", "--training.steps=6"};
  TrainOptions o = quiet();
  o.keep_params = true;
  const std::string d1 = fresh_dir("resume_full"), d2 = fresh_dir("resume_split");
  const TrainResult full = train(tiny(d1, ck), o);
  {
    const TrainResult r = train(tiny(d2, ck), o);
    ASSERT_EQ(r.end_step, 6);
    fs::remove_all(fs::path(d2) / "checkpoint" / "step-6");
  }
  const TrainResult resumed = train(tiny(d2, ck), o);
  EXPECT_EQ(resumed.start_step, 3);
  ASSERT_EQ(resumed.history.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(std::memcmp(&resumed.history[i].loss, &full.history[3 + i].loss, sizeof(double)), 0)
        << "step " << 4 + i << ": resumed " << resumed.history[i].loss << " vs " << full.history[3 + i].loss;
  ASSERT_EQ(resumed.final_params.size(), full.final_params.size());
  EXPECT_EQ(std::memcmp(resumed.final_params.data(), full.final_params.data(), full.final_params.size() * 4), 0)
      << "final parameters after resuming";
  const LoadedCheckpoint lc = load_checkpoint((fs::path(d1) / "checkpoint" / "step-3").string());
  const JobConfig c = tiny(d1, ck);
  for (const ParamEntry& e : model_param_layout(c.model)) {
    const bool muon = muon_matrices(c.model, e.name, e.shape).muon();
    EXPECT_TRUE(lc.optimizer.contains("m." + e.name)) << e.name;
    EXPECT_EQ(lc.optimizer.contains("v." + e.name), !muon) << e.name;
  }
  // A checkpoint of another optimizer is refused by name (its moments do not carry over).
  const std::string e = error_of([&] {
    std::vector<std::string> adam = ck;
    adam[0] = "--optimizer.name=adamw";
    train(tiny(d2, adam), quiet());
  });
  EXPECT_NE(e.find("holds the state of optimizer.name = \"muon\", this run is optimizer.name = \"adamw\""),
            std::string::npos) << e;
}

// The optimizer state: 4 bytes of momentum per parameter element (padded like the flat buffer) and 4 of v per AdamW
// element; estimate_memory counts the same (unpadded: within the 16-float padding of each tensor, 1 %).
TEST(MuonTrainer, OptimizerMemoryAgainstTheEstimate) {
  for (const auto& extra : {std::vector<std::string>{}, kMla}) {
    std::vector<std::string> a = {"--optimizer.name=muon", "--training.steps=1"};
    a.insert(a.end(), extra.begin(), extra.end());
    const JobConfig c = tiny(fresh_dir("mem"), a);
    const TrainResult r = train(c, quiet());
    int64_t padded = 0, adam = 0;
    for (const ParamEntry& e : model_param_layout(c.model)) {
      padded += param_padded_numel(e.numel);
      if (!muon_matrices(c.model, e.name, e.shape).muon()) adam += e.numel;
    }
    EXPECT_EQ(r.opt_state_bytes, 4 * (padded + adam));
    EXPECT_EQ(r.optimizer_peak_bytes, r.opt_state_bytes);
    const MemoryEstimate est = estimate_memory(c, 2, 1);
    EXPECT_NEAR(est.optimizer, double(r.optimizer_peak_bytes), 0.01 * double(r.optimizer_peak_bytes));
    JobConfig ca = c;
    ca.optimizer.name = "adamw";
    std::printf("[muon memory] optimizer: measured %lld, estimate %.0f (AdamW estimate %.0f)\n",
                (long long)r.optimizer_peak_bytes, est.optimizer, estimate_memory(ca, 2, 1).optimizer);
  }
}
