// test_reference.cpp: the whole model against an independent PyTorch implementation (llm.c's
// test_gpt2.c pattern). For each variant in tests/data/ref/<v>.toml the file <v>.safetensors holds the
// engine's initial parameters and a batch (from `moetron debug dump-init`) and what
// tools/torch_ref/moetron_ref.py computed from them in float64: logits, CE loss, aux / z losses, every
// parameter gradient and the parameters (and expert biases) after 5 trainer steps. Torch is not needed here;
// tools/torch_ref/gen_refs.sh regenerates the files.
//
// Two reference sets per file:
//   exact ("logits", "grad.<p>", "step5.<p>", ...): float64 throughout. moetron rounds every matmul operand to
//       bf16, so the comparison is limited by bf16 (tolerances below).
//   emu ("emu.logits", "emu.grad.<p>", ...): float64, but with every matmul operand rounded to bf16 exactly
//       where model.cpp rounds it (forward x16/W16, backward dy16), the router gate unrounded. What is left is
//       fp32 vs fp64 accumulation and elementwise math, so these tolerances are ~100x tighter and catch small
//       terms (an aux-loss gradient, a missing rounding, a wrong weight-decay mask) that bf16 noise would hide.
// Routing is piecewise constant: the exact set replays the emu set's expert choice at every step (the file's
// counts.<i> are the emu choice at step 1 and the engine must reproduce them exactly).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/model.h"
#include "moetron/optim.h"
#include "moetron/safetensors.h"
#include "moetron/trainer.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

const fs::path kRoot = fs::path(__FILE__).parent_path().parent_path().parent_path();
const char* kStale = "reference file is stale: run tools/torch_ref/gen_refs.sh";

std::vector<float> read_f32(const SafetensorsFile& f, const std::string& name, int64_t n) {
  std::vector<float> v(size_t(n));
  load_into(f, name, DType::F32, {n}, v.data());
  return v;
}
std::vector<float> read_f32(const SafetensorsFile& f, const std::string& name) {
  const auto& i = f.info(name);
  std::vector<float> v(size_t(shape_numel(i.shape)));
  load_into(f, name, DType::F32, i.shape, v.data());
  return v;
}

struct Err {
  double rel = 0;  // ||a - b|| / ||b||
  double max = 0;  // max |a - b| / max |b|
};
Err compare(const float* a, const float* b, int64_t n, const float* base = nullptr) {
  // base != null: compare the updates a - base and b - base (parameters after optimizer steps).
  double d2 = 0, b2 = 0, dm = 0, bm = 0;
  for (int64_t i = 0; i < n; ++i) {
    double x = a[i], y = b[i];
    if (base) x -= base[i], y -= base[i];
    d2 += (x - y) * (x - y), b2 += y * y;
    dm = std::max(dm, std::fabs(x - y)), bm = std::max(bm, std::fabs(y));
  }
  Err e;
  e.rel = b2 > 0 ? std::sqrt(d2 / b2) : std::sqrt(d2);
  e.max = bm > 0 ? dm / bm : dm;
  return e;
}

// Tolerances (per tensor: rel on the Frobenius norm, max on the largest element), see the derivation below.
struct Tol {
  double rel, max;
};
struct Tols {
  Tol logits, grad, step5;
  double loss;  // |a - b| / |b| for CE loss, aux loss and z-loss values
};

// ---- exact (float64) reference: bf16 rounding budget -------------------------------------------------
// bf16 keeps 8 significant bits: round-to-nearest gives a relative error |d| <= u = 2^-9 = 1.95e-3 per
// rounding, uniformly distributed for random data, i.e. RMS u/sqrt(3) = 1.1e-3. A GEMM with both operands
// rounded has a norm-wise relative output error of about sqrt(2) * 1.1e-3 = 1.6e-3 (independent errors add in
// quadrature over the K-term dot products, relative to a sum that grows the same way).
// Forward, logits: embedding -> 3 layers of (attention: 2-4 chained GEMMs; FFN: 2 GEMMs) -> head. The residual
// stream carries most of the signal unrounded, so the logits see ~ 1 GEMM's error plus the branch errors
// scaled by the branches' share: measured 3e-3; budget 1e-2 (3 GEMM errors in series, sqrt(9) * 1.6e-3 = 5e-3,
// times 2 for the max-norm spread across tensors).
// Backward: a weight gradient is a GEMM of two rounded operands (x16, dy16) whose dy went through up to ~20
// rounded GEMMs from the head down to layer 0; sqrt(20) * 1.6e-3 = 7e-3, and some gradients are differences of
// near-cancelling terms (the softmax-router gate, RMSNorm weights: the projection onto x-hat removes most of
// dy), which amplifies relative errors by ~3x: budget 3e-2. Measured worst: see the per-variant summary the
// test prints (all below 1.5e-2).
// Max-element checks: an element's error is bounded by the same rounding budget relative to the row norms, so
// relative to the tensor's largest element we allow 3x the norm budget.
// After 5 AdamW steps the updates, not the parameters, are compared (parameters are equal at step 0). Adam's
// first update is lr * g / (|g| + eps) = lr * sign(g): an element whose gradient is smaller than the bf16
// noise (1e-2 * rms) flips sign and moves 2 lr instead of 0. For Gaussian gradients that is ~1% of the elements,
// a norm-wise relative error of sqrt(0.01 * 4) = 0.2 on the update; the fp64 comparison of step5 can only
// catch gross errors (a wrong learning rate, decay on norms, a missing clip: all >= 0.5), budget 0.35. The emu
// reference below is the meaningful optimizer check.
constexpr Tols kExact{{1e-2, 3e-2}, {3e-2, 1e-1}, {0.35, 1.0}, 1e-2};

// ---- emu reference: same roundings, fp32 vs fp64 arithmetic ----------------------------------------------
// Left: fp32 accumulation (|error| <= K * 2^-24 worst case, ~sqrt(K) * 6e-8 typical for K <= 512: 1.3e-6)
// and fp32 elementwise math (softmax, exp, rsqrt: a few ulp), compounded over ~20 ops: ~1e-5. On top, a value
// that lands within that distance of a bf16 rounding boundary rounds the other way in one implementation:
// a 2^-8 relative jump of one element (probability ~ 1e-5 / 4e-3 per element), which for a tensor of n
// elements adds about 2^-8 * sqrt(p) ~ 2e-4 to the norm-wise error of whatever it feeds. Budget: 2e-3
// for gradients (measured worst 5e-4), 5e-4 for logits and losses.
// Step5: a sign flip of the first Adam update now needs |g| < 1e-4 * rms (probability ~1e-4), so the
// update's norm-wise error is ~ sqrt(1e-4 * 4) = 2e-2 at worst; budget 5e-2, and a max-element budget
// of 2 lr-steps (1.0 of the largest update: one flipped element may move by that much).
constexpr Tols kEmu{{5e-4, 2e-3}, {2e-3, 2e-2}, {5e-2, 1.0}, 5e-4};

struct Worst {
  double rel = 0, max = 0;
  std::string rel_at, max_at;
  void add(const Err& e, const std::string& what) {
    if (e.rel > rel) rel = e.rel, rel_at = what;
    if (e.max > max) max = e.max, max_at = what;
  }
};

void check(const char* set, const char* kind, const std::string& name, const Err& e, const Tol& t, Worst& w) {
  w.add(e, name);
  EXPECT_LE(e.rel, t.rel) << set << " " << kind << " " << name << ": ||a-b||/||b|| = " << e.rel;
  EXPECT_LE(e.max, t.max) << set << " " << kind << " " << name << ": max|a-b|/max|b| = " << e.max;
}

void check_scalar(const char* set, const char* what, double got, double want, double tol) {
  double rel = std::fabs(got - want) / std::max(std::fabs(want), 1e-12);
  EXPECT_LE(rel, tol) << set << " " << what << ": engine " << got << ", reference " << want << " (rel " << rel
                      << ")";
}

class Reference : public ::testing::TestWithParam<std::string> {};

TEST_P(Reference, MatchesTorch) {
  const std::string v = GetParam();
  const fs::path cfg_path = kRoot / "tests/data/ref" / (v + ".toml");
  const fs::path ref_path = kRoot / "tests/data/ref" / (v + ".safetensors");
  ASSERT_TRUE(fs::exists(ref_path)) << ref_path << " is missing: " << kStale;
  JobConfig cfg = load_config(cfg_path.string());
  SafetensorsFile ref = SafetensorsFile::open(ref_path.string());
  ASSERT_EQ(ref.metadata().at("config_toml"), to_toml(cfg)) << v << ": config differs from the one used: " << kStale;

  const int64_t B = cfg.training.micro_batch_size, T = cfg.training.seq_len, N = B * T, V = cfg.model.vocab_size;
  Model model(cfg.model, B, T);
  model.init_params(uint64_t(cfg.training.seed));
  const int64_t np = model.num_params();
  for (auto& p : model.params()) {
    ASSERT_TRUE(ref.contains("param." + p.name)) << "no param." << p.name << " in " << ref_path << ": " << kStale;
    std::vector<float> want = read_f32(ref, "param." + p.name);
    ASSERT_EQ(int64_t(want.size()), p.numel) << p.name << ": " << kStale;
    ASSERT_EQ(std::memcmp(want.data(), model.param_data() + p.offset, size_t(p.numel) * 4), 0)
        << "initial " << p.name << " differs bitwise from the file: " << kStale;
  }
  const int64_t E = cfg.model.moe.n_routed_experts;
  for (int i = 0; i < model.n_moe_layers(); ++i) {
    auto b = read_f32(ref, "expert_bias." + std::to_string(i), E);
    std::copy(b.begin(), b.end(), model.expert_bias(i));
  }
  std::vector<int32_t> tokens(size_t(N)), targets(size_t(N));
  load_into(ref, "tokens", DType::I32, {N}, tokens.data());
  load_into(ref, "targets", DType::I32, {N}, targets.data());
  std::vector<float> p0(model.param_data(), model.param_data() + np);

  Worst w[2][3];  // [exact, emu] x [logits, grad, step5]
  const char* sets[2] = {"exact", "emu"};
  const char* pre[2] = {"", "emu."};
  const Tols* tols[2] = {&kExact, &kEmu};

  // ---- logits and routing
  std::vector<float> logits(size_t(N * V));
  model.compute_logits(logits.data(), tokens.data());
  for (int s = 0; s < 2; ++s)
    check(sets[s], "logits", "logits", compare(logits.data(), read_f32(ref, std::string(pre[s]) + "logits").data(), N * V),
          tols[s]->logits, w[s][0]);
  auto counts = model.take_expert_counts();
  for (int i = 0; i < model.n_moe_layers(); ++i) {
    std::vector<int32_t> want(size_t(E));
    load_into(ref, "counts." + std::to_string(i), DType::I32, {E}, want.data());
    for (int64_t e = 0; e < E; ++e)
      EXPECT_EQ(counts[size_t(i)][size_t(e)], want[size_t(e)])
          << "MoE layer " << i << " expert " << e << ": tokens routed differ from the reference's choice";
  }

  // ---- step 1 forward / backward (the trainer's scales for one micro-batch of N tokens)
  model.zero_grads();
  ForwardStats fs1 = model.forward_backward(tokens.data(), targets.data(), float(1.0 / double(N)), 1.0f);
  ASSERT_EQ(fs1.ce_count, N);
  for (int s = 0; s < 2; ++s) {
    const std::string p = pre[s];
    check_scalar(sets[s], "loss", fs1.ce_sum / double(fs1.ce_count), read_f32(ref, p + "loss", 1)[0], tols[s]->loss);
    if (E > 0) check_scalar(sets[s], "aux_loss", fs1.aux_loss, read_f32(ref, p + "aux_loss", 1)[0], tols[s]->loss);
    if (cfg.model.moe.z_loss_coef > 0)
      check_scalar(sets[s], "z_loss", fs1.z_loss, read_f32(ref, p + "z_loss", 1)[0], tols[s]->loss);
    for (auto& pe : model.params())
      check(sets[s], "grad", pe.name,
            compare(model.grad_data() + pe.offset, read_f32(ref, p + "grad." + pe.name).data(), pe.numel),
            tols[s]->grad, w[s][1]);
  }

  // ---- 5 trainer steps on the same batch (trainer.cpp: clip, lr_at, adamw_step, bias update, sync)
  const int64_t steps = 5;
  ASSERT_EQ(cfg.training.steps, steps);
  (void)model.take_expert_counts();  // forget the counts of the logits pass and the first forward_backward
  Tensor mbuf = Tensor::zeros({np}, DType::F32, MemCategory::Optimizer);
  Tensor vbuf = Tensor::zeros({np}, DType::F32, MemCategory::Optimizer);
  AdamWConfig ac;
  ac.beta1 = float(cfg.optimizer.beta1), ac.beta2 = float(cfg.optimizer.beta2), ac.eps = float(cfg.optimizer.eps);
  ac.weight_decay = float(cfg.optimizer.weight_decay);
  std::vector<double> losses;
  for (int64_t step = 1; step <= steps; ++step) {
    model.zero_grads();
    ForwardStats st = model.forward_backward(tokens.data(), targets.data(), float(1.0 / double(N)), 1.0f);
    losses.push_back(st.ce_sum / double(st.ce_count));
    double gn = std::sqrt(grad_norm_sq(model.grad_data(), np));
    float clip = cfg.training.max_norm > 0 ? clip_coefficient(gn, cfg.training.max_norm) : 1.0f;
    ac.lr = float(lr_at(cfg.optimizer, cfg.lr_scheduler, step, steps));
    for (auto& p : model.params())
      adamw_step(model.param_data() + p.offset, mbuf.data<float>() + p.offset, vbuf.data<float>() + p.offset,
                 model.grad_data() + p.offset, p.numel, ac, step, clip, p.decay);
    model.update_expert_bias(model.take_expert_counts());
    model.sync_weights();
  }
  for (int s = 0; s < 2; ++s) {
    const std::string p = pre[s];
    auto want = read_f32(ref, p + "losses", steps);
    for (int64_t i = 0; i < steps; ++i)
      check_scalar(sets[s], ("loss at step " + std::to_string(i + 1)).c_str(), losses[size_t(i)], want[size_t(i)],
                   tols[s]->loss);
    for (auto& pe : model.params())
      check(sets[s], "step5", pe.name,
            compare(model.param_data() + pe.offset, read_f32(ref, p + "step5." + pe.name).data(), pe.numel,
                    p0.data() + pe.offset),
            tols[s]->step5, w[s][2]);
    for (int i = 0; i < model.n_moe_layers(); ++i) {
      auto b = read_f32(ref, p + "step5.expert_bias." + std::to_string(i), E);
      for (int64_t e = 0; e < E; ++e)  // +-rate steps from the same integer counts: exact up to fp32 sums
        EXPECT_NEAR(model.expert_bias(i)[e], b[size_t(e)], 1e-6) << "expert bias " << i << "." << e;
    }
  }
  for (int s = 0; s < 2; ++s)
    std::printf("[ %-7s ] %-7s %-5s logits %.2e/%.2e  grad %.2e (%s)/%.2e (%s)  step5 %.2e (%s)/%.2e\n", v.c_str(),
                sets[s], "", w[s][0].rel, w[s][0].max, w[s][1].rel, w[s][1].rel_at.c_str(), w[s][1].max,
                w[s][1].max_at.c_str(), w[s][2].rel, w[s][2].rel_at.c_str(), w[s][2].max);
}

INSTANTIATE_TEST_SUITE_P(Variants, Reference,
                         ::testing::Values("mha", "gqa", "mla", "mla_noq", "group", "sigmoid"),
                         [](const auto& info) { return info.param; });

}  // namespace
