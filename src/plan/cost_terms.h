// cost_terms.h (internal to src/plan): step-time terms of the cost model kept apart from cost.cpp (which is at its
// size limit), each with its named public source. Used by cost.cpp's layer costs. Not the op list (cost.cpp), not
// the per-rank terms (cost_rank.h), not the collectives (comm_model.h).
#pragma once
#include "moetron/config.h"
#include "moetron/plan/hardware.h"

namespace moetron::plan {

// A fused attention kernel's training rate (forward + backward) at head dimension `head_dim` over its rate at head
// dimension 128, from the cuDNN series of FlashAttention-3's BF16 benchmarks on H100 SXM5 (Shah et al. 2024,
// arXiv 2407.08608, Figures 5 and 6, non-causal): 0.791 at 64, 1 from 128 up; linear in between; 0.791 below 64.
double attention_head_dim_factor(double head_dim);

// The fused (flash) attention's FLOP rate on `h` at sequence `seq_len` and head dimension `head_dim`: a measured
// curve (attention_seq_efficiency, from `plan calibrate`, measured at the engine's own head dimension) as it is;
// the catalog's single attention_efficiency (an assumption for large head dimensions) times
// attention_head_dim_factor. Issue 33's sixth state; before it the head dimension did not enter.
double fused_attention_rate(const Hardware& h, double seq_len, double head_dim);

// Bytes an element of an FP8 GEMM input costs to quantize under the recipe, and the host kernels it costs (sources
// at the definitions: Transformer Engine's docs on current scaling and on Hopper's transposes).
double fp8_quant_bytes(const QuantizeSpec& q);
double fp8_quant_kernels(const QuantizeSpec& q);

}  // namespace moetron::plan
