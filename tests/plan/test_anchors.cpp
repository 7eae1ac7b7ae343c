// test_anchors.cpp: the planner against the public dense anchors (docs/planner.md, "Public dense anchors" and
// "Published results: calibration and validation points"): GPT models of Korthikanti et al. 2022 ("Reducing Activation Recomputation
// in Large Transformer Models": Table 3 layouts, Table 5 iteration times, the Table 2 activation formulas behind
// its memory figures) and of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
// Using Megatron-LM": Table 2 PTD-P throughput), all on A100 80GB with the configs in configs/anchors/. Each row
// prints the published figure, the projection and the difference ("[anchor]" lines).
//   - The activation-memory rows are validation points (PlanAnchorsValidation): compared first in the change that
//     wrote the GPT accounting they exercise, within 10 % then, and moved by no later change.
//   - The step-time rows are calibration points (PlanAnchorsCalibration): the unfused attention's pricing and the
//     catalog entry a100_nccl, whose scale-up bandwidth is FITTED (200 GB/s against the 300 GB/s line rate), were
//     added after these rows fell short, in the changes that tightened their bound. Their 15 % bound is a
//     regression guard on the calibrated model, not agreement; each row also prints the projection on the
//     sourced entry a100 (the line rate), with no bound.
// The hand-counted tests (PlanAnchors) check the GPT features' pricing and counting, not a published figure.
// Not a test of the engine (which refuses ffn = "gelu", dropout > 0 and attention_impl = "unfused").
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "moetron/accounting.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"

using namespace moetron;

namespace {

JobConfig anchor(const std::string& name, std::vector<std::string> ov = {}) {
  return load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/anchors/" + name + ".toml", ov);
}

// Korthikanti's "full recompute" baseline: tensor parallel without sequence parallelism, every layer recomputed.
const std::vector<std::string> kFullRecompute = {"--parallelism.sequence_parallel=false",
                                                 "--activation_checkpoint.mode=full",
                                                 "--activation_checkpoint.modules=[]"};

// Megatron-LM in 2021-2022: no loss fusion (the vocabulary-parallel cross entropy keeps its softmax) and, for
// Narayanan's runs, no distributed optimizer (it came later).
plan::PlanOptions megatron_2022() {
  plan::PlanOptions o;
  o.fused_loss = false;
  return o;
}

double err(double projected, double published) { return projected / published - 1; }

void report(const char* what, const std::string& row, double published, double projected, const char* unit,
            double scale) {
  std::printf("[anchor] %-22s %-34s published %9.2f %s  projected %9.2f %s  difference %+6.1f %%\n", what,
              row.c_str(), published / scale, unit, projected / scale, unit, 100 * err(projected, published));
}

// A calibration row: the projection on the fitted a100_nccl (bounded by the test) and on the sourced a100 (line
// rate; printed only).
void report_time(const std::string& row, double published, double fitted, double line_rate) {
  report("time, calibration", row + " a100_nccl", published, fitted, "s ", 1);
  report("time, calibration", row + " a100", published, line_rate, "s ", 1);
}

// The first pipeline stage's activation bytes by the paper's formulas (Korthikanti et al. 2022, Table 2, as
// Megatron-LM codes them for the first stage in megatron/training/theoretical_memory_usage.py): per layer
// 34 sbh / t with sequence parallelism and selective recompute, 2 sbh with full recompute (no sequence
// parallelism); L layers held (p micro-batches of L / p layers, 1F1B), times 1 + (p - 1) / (p v) under the
// interleaved schedule; the first stage also keeps the input ids (8 sbp) and the embedding dropout mask (sbhp),
// and with p = 1 the final layer norm, the head input and the loss (4 sbh (1 + V / h)). Without sequence
// parallelism nothing of the residual region splits over t, the loss's vocabulary does.
double korthikanti_activations(const JobConfig& c, bool selective) {
  const double s = double(c.training.seq_len), b = double(c.training.micro_batch_size);
  const double h = double(c.model.d_model), L = double(c.model.n_layers), V = double(c.model.vocab_size);
  const double t = double(c.parallelism.tp), p = double(c.parallelism.pp);
  const double v = c.parallelism.pp_virtual_stages > 1 ? double(c.parallelism.pp_virtual_stages) : 0;
  const double sbh = s * b * h;
  double a = (selective ? 34 * sbh / t : 2 * sbh) * L;
  a += (8 * s * b * p + sbh * p) / (selective ? t : 1);
  if (v > 0) a *= 1 + (p - 1) / (p * v);
  if (p == 1) a += selective ? 4 * sbh * (1 + V / h) / t : 4 * sbh + 4 * s * b * V / t;
  return a;
}

// Narayanan et al. 2021, Eq. 3: FLOPs of one iteration with activation recomputation,
// 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)); the published TFLOP/s per GPU are these over time and GPUs.
double narayanan_iteration_flops(const JobConfig& c) {
  const double B = double(c.training.global_batch_size), s = double(c.training.seq_len);
  const double l = double(c.model.n_layers), h = double(c.model.d_model), V = double(c.model.vocab_size);
  return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
}

// On a100_nccl by default: the scale-up bandwidth fitted to these anchors (docs/hardware.md).
plan::TimePlan project_time(const JobConfig& c, int64_t world, bool distributed_optimizer,
                            const char* hw = "a100_nccl") {
  const plan::Layout l = plan::layout_from_config(c, world, distributed_optimizer);
  plan::TimeOptions o;
  o.memory = megatron_2022();
  return plan::plan_time(c, l, plan::catalog_hardware(hw), o);
}

}  // namespace

// The model description follows the GELU kind: two matrices per MLP, so the 175B model counts what Narayanan's
// Eq. 2 gives (P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)) = 174.6e9, biases, LayerNorm and position
// embedding included; moetron has none of those, under 0.03 % here), and the FLOPs are 3 x forward of it.
TEST(PlanAnchors, GeluModelCountsAsGpt) {
  const JobConfig c = anchor("gpt_175b");
  const double l = 96, h = 12288, V = 51200, s = 2048;
  const double eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h));
  const ParamCounts pc = count_params(c.model);
  EXPECT_NEAR(double(pc.total) / eq2, 1.0, 3e-4) << pc.total << " vs " << eq2;
  EXPECT_EQ(pc.layers[0].dense_mlp, 2 * 12288 * 4 * 12288);  // up and down, no gate
  // Forward matmul FLOPs per token: 2 x (12 h^2 per layer + the tied head V h).
  const FlopsPerToken f = flops_per_token(c.model, 2048);
  EXPECT_DOUBLE_EQ(f.fwd_matmul, 2 * (12 * l * h * h + V * h));
  // The same model as SwiGLU has a gate: 3 matrices.
  JobConfig sw = c;
  sw.model.ffn = FfnKind::SwiGLU;
  EXPECT_EQ(count_params(sw.model).layers[0].dense_mlp, 3 * 12288 * 4 * 12288);
}

// The step-time model prices the GELU MLP as two GEMMs (up, down) and its elementwise pass as read I, write I; the
// dropout masks as one more byte written per residual element (attention and MLP outputs). Hand counts on the
// 22B layout (tp 8 with SP, one micro-batch of 4 x 2048 tokens, 48 layers).
TEST(PlanAnchors, GeluFfnAndDropoutPricing) {
  JobConfig gelu = anchor("gpt_22b");
  gelu.model.attention_impl = AttnImpl::Flash;  // the unfused attention's own dropout: UnfusedAttentionPricing
  JobConfig swiglu = gelu, nodrop = gelu;
  swiglu.model.ffn = FfnKind::SwiGLU;
  nodrop.model.dropout = 0;
  const plan::Hardware a100 = plan::catalog_hardware("a100");
  auto stage = [&](const JobConfig& c) { return project_time(c, 8, true).stages.at(0); };
  const double L = 48, T = 4 * 2048, d = 6144, I = 4 * 6144 / 8.0, q = 8;
  // SwiGLU has one more T x I x d GEMM per layer, in the forward, the input gradient and the weight gradient.
  EXPECT_DOUBLE_EQ(stage(swiglu).flops - stage(gelu).flops, L * 3 * 2 * T * I * d);
  // The activation pass: SwiGLU reads 2 I and writes I, GELU reads I and writes I (bf16), F + 2 x backward.
  EXPECT_NEAR(stage(swiglu).memory_bound - stage(gelu).memory_bound, L * 3 * (I * 2 * T) / a100.stream_bw(), 1e-9);
  // Dropout: two 1-byte masks of T / q x d per layer.
  EXPECT_NEAR(stage(gelu).memory_bound - stage(nodrop).memory_bound, L * 3 * (2 * d * T / q) / a100.stream_bw(),
              1e-9);
}

// The unfused core attention (attention_impl = "unfused", the anchors' Megatron-LM of 2021-22), hand-counted on
// the 22B layout: tp 8 (8 of 64 heads, head dim 96 per rank), one micro-batch of 4 x 2048 tokens, 48 layers,
// selective recompute of attention_core, dropout 0.1.
TEST(PlanAnchors, UnfusedAttentionPricing) {
  const JobConfig unf = anchor("gpt_22b");
  ASSERT_EQ(unf.model.attention_impl, AttnImpl::Unfused);
  JobConfig flash = unf, nodrop = unf;
  flash.model.attention_impl = AttnImpl::Flash;
  nodrop.model.dropout = 0;
  const plan::Hardware a100 = plan::catalog_hardware("a100");
  auto stage = [&](const JobConfig& c) { return project_time(c, 8, true).stages.at(0); };
  const plan::StageTime u = stage(unf), f = stage(flash), n = stage(nodrop);
  const double L = 48, T = 4 * 2048, S = 2048, H = 8, hd = 96;
  const double elems = H * T * S;  // the score matrix [4, 8, 2048, 2048] per rank per layer
  // Score passes: forward softmax 2 + 2 bytes, dropout 2 + 2 + 1 (mask); backward dropout 2 + 1 + 2, softmax
  // 2 + 2 + 2: 9 + 11 bytes an element; flash has none. The selective recompute redoes the forward's 9.
  const double rate = a100.elementwise_rate();
  EXPECT_NEAR(u.memory_bound - f.memory_bound, L * elems * 20 / rate, 1e-9);
  // Without dropout: softmax only, 4 forward + 6 backward.
  JobConfig nodrop_flash = nodrop;
  nodrop_flash.model.attention_impl = AttnImpl::Flash;
  EXPECT_NEAR(n.memory_bound - stage(nodrop_flash).memory_bound, L * elems * 10 / rate, 1e-9);
  // FLOPs: QK^T and PV over the full (masked) matrix, where flash does the causal half ((S + 1) / 2 keys); F+B = 3x.
  EXPECT_DOUBLE_EQ(u.flops - f.flops, L * 3 * 2 * H * T * 2 * hd * (S - (S + 1) / 2));
  // The score GEMMs are GEMMs, not attention: no attention time left; their time at least the FLOPs at the
  // achievable rate (three passes: F, dgrad, wgrad).
  EXPECT_DOUBLE_EQ(u.attention, 0.0);
  const double g_unf = (u.gemm - f.gemm) / 3 / L;  // one layer's score GEMMs, forward
  EXPECT_GE(g_unf, 2 * H * T * S * 2 * hd / a100.achievable_bf16);
  // Selective recompute of attention_core redoes the score GEMMs and the forward passes instead of flash's kernel.
  const double flash_fwd = f.attention / 3 / L;
  EXPECT_NEAR(u.recompute - f.recompute, L * (g_unf + elems * 9 / rate - flash_fwd), 1e-9);
}

// The unfused attention's activations (Korthikanti's 5 a s^2 b per layer): the softmax output (2 bytes), the
// dropout mask (1) and the dropped probabilities (2) per score element, in place of flash's fp32 log-sum-exp;
// all dropped by selective recompute of attention_core.
TEST(PlanAnchors, UnfusedAttentionActivations) {
  const JobConfig unf = anchor("gpt_22b");
  JobConfig flash = unf;
  flash.model.attention_impl = AttnImpl::Flash;
  const ActivationCheckpointSpec none{}, sel = unf.activation_checkpoint;
  const ActShard sh{8, true, 1, 1};
  const double B = 4, S = 2048, H = 8;
  auto bytes = [&](const JobConfig& c, const ActivationCheckpointSpec& ac) {
    return sharded_layer_bytes(c.model, 0, B, S, 2, 2, ac, sh);
  };
  EXPECT_DOUBLE_EQ(bytes(unf, none) - bytes(flash, none), B * H * S * S * 5 - B * H * S * 4);
  EXPECT_DOUBLE_EQ(bytes(unf, sel), bytes(flash, sel));
}

// Korthikanti et al. 2022: the first stage's activation memory per GPU, sequence parallel + selective recompute
// ("present work") and full recompute, against the paper's formulas on its Table 3 layouts. Validation points.
TEST(PlanAnchorsValidation, KorthikantiActivationMemory) {
  const plan::Hardware a100 = plan::catalog_hardware("a100");
  struct Row {
    const char* config;
    int64_t world;
  };
  for (const Row& r : {Row{"gpt_22b", 8}, Row{"gpt_175b", 64}, Row{"gpt_530b", 280}, Row{"gpt_1t", 512}}) {
    for (bool selective : {true, false}) {
      const JobConfig c = selective ? anchor(r.config) : anchor(r.config, kFullRecompute);
      const double published = korthikanti_activations(c, selective);
      const plan::MemoryPlan m = plan::plan_memory(c, plan::layout_from_config(c, r.world), a100, megatron_2022());
      const double projected = m.per_rank.at(0).activations;
      report("memory, validation", std::string(r.config) + (selective ? " SP+selective" : " full recompute"),
             published, projected, "GB", 1e9);
      // The target, 10 %; the rows lie at -5.8 to +7.3 %. It would miss a change of up to 2.7-4.2 points on the
      // rows nearest the bound and more on the others.
      EXPECT_LT(std::fabs(err(projected, published)), 0.10) << r.config;
    }
  }
}

// Korthikanti et al. 2022, Table 5: iteration time with full recompute and with sequence parallelism + selective
// recompute. Calibration points (the file's header): not agreement.
TEST(PlanAnchorsCalibration, KorthikantiIterationTime) {
  struct Row {
    const char* config;
    int64_t world;
    double full_s, present_s;  // Table 5
  };
  const Row rows[] = {{"gpt_22b", 8, 1.42, 1.10},
                      {"gpt_175b", 64, 18.13, 13.75},
                      {"gpt_530b", 280, 49.05, 37.83},
                      {"gpt_1t", 512, 94.42, 71.49}};
  for (const Row& r : rows) {
    for (bool selective : {true, false}) {
      const JobConfig c = selective ? anchor(r.config) : anchor(r.config, kFullRecompute);
      const double published = selective ? r.present_s : r.full_s;
      const plan::TimePlan t = project_time(c, r.world, true);
      report_time(std::string(r.config) + (selective ? " SP+selective" : " full recompute"), published,
                  t.step_time, project_time(c, r.world, true, "a100").step_time);
      // The target, 15 %. It became two-sided (it was -17 % to 0) in the change that added the fitted
      // a100_nccl, which brought every row inside it (-1.9 to -12.2 %): the bound holds the calibrated model where
      // it was left and would miss a drift of up to 2.8 points on the row nearest it (and any drift that keeps the
      // rows short of the published times, which is what the unpriced 2022 GEMM rate makes them).
      EXPECT_LT(std::fabs(err(t.step_time, published)), 0.15) << r.config;
    }
  }
}

// Narayanan et al. 2021, Table 2 (PTD-P rows): achieved TFLOP/s per GPU (Eq. 3 FLOPs) at a fixed global batch on
// three world sizes; the published iteration time is Eq. 3 / (GPUs x TFLOP/s). Calibration points.
TEST(PlanAnchorsCalibration, NarayananThroughput) {
  struct Row {
    const char* config;
    int64_t world;
    double tflops;  // Table 2
  };
  const Row rows[] = {{"narayanan_175b", 384, 153}, {"narayanan_175b", 768, 149}, {"narayanan_175b", 1536, 141},
                      {"narayanan_530b", 560, 171}, {"narayanan_530b", 1120, 167}, {"narayanan_530b", 2240, 159}};
  for (const Row& r : rows) {
    const JobConfig c = anchor(r.config);
    const double published = narayanan_iteration_flops(c) / (double(r.world) * r.tflops * 1e12);
    const plan::TimePlan t = project_time(c, r.world, false);
    report_time(std::string(r.config) + " on " + std::to_string(r.world), published, t.step_time,
                project_time(c, r.world, false, "a100").step_time);
    // As KorthikantiIterationTime: the rows lie at -11.3 to -13.5 %, 1.5-3.7 points inside the bound.
    EXPECT_LT(std::fabs(err(t.step_time, published)), 0.15) << r.config << " " << r.world;
  }
}
