// cost_terms.cpp: the step-time terms of cost_terms.h, each priced from a named public source. Not the op list
// (cost.cpp) and not the pipeline or the data-parallel terms.
#include "cost_terms.h"

#include "moetron/config.h"

#include <algorithm>

namespace moetron::plan {

namespace {
// FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608), BF16 on H100 SXM5, non-causal, the cuDNN series (the
// fused attention Transformer Engine runs under Megatron-Core), TFLOPS at sequence 4k / 8k / 16k:
//   Figure 5 (forward):  head dim 64: 408 / 412 / 413;  head dim 128: 609 / 600 / 595
//   Figure 6 (backward): head dim 64: 417 / 432 / 433;  head dim 128: 499 / 518 / 516
// A training pass is one forward and one backward of 2.5 times the forward's FLOPs (the paper's convention), so
// its rate at head dim d is 3.5 / (1 / fwd + 2.5 / bwd); head dim 64 over head dim 128: 0.788 / 0.790 / 0.796 at
// 4k / 8k / 16k, mean 0.791. The paper's head dim 256 (forward 581 in the same series, no backward read) is not
// used: from 128 up the factor is 1, so the catalog's figure stands for every head dimension of 128 and more.
constexpr double kHeadDim64Factor = 0.791;
}  // namespace

double attention_head_dim_factor(double head_dim) {
  if (head_dim >= 128) return 1.0;
  if (head_dim <= 64) return kHeadDim64Factor;  // below 64: no figure read; held at 64's (an assumption)
  return kHeadDim64Factor + (1.0 - kHeadDim64Factor) * (head_dim - 64) / 64;
}

double fused_attention_rate(const Hardware& h, double seq_len, double head_dim) {
  const double eff = h.attention_eff(seq_len);
  return h.achievable_bf16 * (h.attention_seq_efficiency.empty() ? eff * attention_head_dim_factor(head_dim) : eff);
}

// Bytes an element of a GEMM input costs to quantize. Every recipe reads bf16 and writes fp8 (3). Row-, block- and
// mx-scaled recipes also write the transposed copy the backward GEMMs read (1 more). Tensorwise (Megatron-Bridge's
// FP8-CS, Transformer Engine's Float8CurrentScaling) under current scaling, the default: "two tensor reads per
// quantization: one to compute amax, one to cast" (Transformer Engine docs, "FP8 Delayed Scaling"), 2 more; and as
// Hopper's FP8 GEMMs take only the TN layout, "some tensors need to be physically transposed in memory" (Transformer
// Engine docs, "Performance considerations: Handling transposes"), 1 more: 6 (5 before issue 33's fifth state, no
// transpose); delayed scaling reads once: 4. The catalog has no architecture flag, so a Blackwell tensorwise run
// (no transpose needed there) pays the transpose too; no published row is one.
double fp8_quant_bytes(const QuantizeSpec& q) {
  if (q.recipe != Fp8Recipe::Tensorwise) return 4.0;
  return q.delayed() ? 4.0 : 6.0;
}
// Kernels one quantized GEMM input costs the host: current scaling's amax is a reduction over the whole tensor, a
// kernel of its own before the cast (the same page's two reads), 2; a local or delayed scale casts in one, 1.
double fp8_quant_kernels(const QuantizeSpec& q) {
  return q.recipe == Fp8Recipe::Tensorwise && !q.delayed() ? 2.0 : 1.0;
}

}  // namespace moetron::plan
