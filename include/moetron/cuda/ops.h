// cuda/ops.h: the CUDA backend's row-wise and element-wise kernels, each the device twin of a CPU op family:
// RMSNorm (norm.h), SwiGLU (swiglu.h), RoPE (rope.h), AdamW (optim.h). Same formulas and layouts as the CPU
// entry points, on device pointers, enqueued on `stream` (a cudaStream_t; nullptr = the legacy default stream).
// Nothing is read back to the host. C++17-clean (the .cu files include it). Not GEMMs (cuda/gemm.h), not MoE
// (cuda/moe.h), not attention (cuda/attention.h).
#pragma once
#include <cstddef>
#include <cstdint>

#include "moetron/optim.h"

namespace moetron {
struct bf16;  // dtype.h: 16 bits, bit-compatible with __nv_bfloat16
}

namespace moetron::cuda {

// RMSNorm forward: y = x * rstd * w per row (norm.h). y16 may be null. One block per row.
void rmsnorm_forward(float* y, bf16* y16, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps, void* stream);
// Backward: dx overwritten, dw accumulated (+=). dw's reduction over rows runs in fixed blocks of
// kRmsnormRowBlock rows whose partials are summed in block order: deterministic, independent of the launch.
// ws: rmsnorm_backward_workspace_bytes(N, C) device bytes.
inline constexpr int64_t kRmsnormRowBlock = 128;
size_t rmsnorm_backward_workspace_bytes(int64_t N, int64_t C);
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t N, int64_t C, void* ws, void* stream);

// SwiGLU on a fused [N, 2F] gate|up buffer (swiglu.h). s (row scale) may be null; h16 may be null; ds may be null.
void swiglu_forward(float* h, bf16* h16, const float* gu, const float* s, int64_t N, int64_t F, void* stream);
void swiglu_backward(float* dgu, float* ds, const float* dh, const float* gu, const float* s, int64_t N, int64_t F,
                     void* stream);

// RoPE in place on a strided view (rope.h's layout); cos/sin are device tables [T, R/2] (rope_table's values).
// inverse = true applies the backward (transposed) rotation.
void rope_apply(float* x, int64_t B, int64_t T, int64_t H, int64_t ld_token, int64_t ld_head, int64_t offset,
                int64_t R, const float* cos, const float* sin, bool inverse, void* stream);

// One AdamW step with the CPU kernel's per-element operation order and no FMA contraction, so the result is
// bitwise adamw_step_ref<float> (optim.h) with the same scalars (adamw_scalars on the host).
void adamw_step(float* p, float* m, float* v, const float* g, int64_t n, const AdamWScalars& s, float grad_scale,
                bool apply_decay, void* stream);
// Sum of squares of g in double into *out (a device double): fixed blocks, partials summed in block order.
// ws: grad_norm_sq_workspace_bytes(n) device bytes.
size_t grad_norm_sq_workspace_bytes(int64_t n);
void grad_norm_sq(double* out, const float* g, int64_t n, void* ws, void* stream);

}  // namespace moetron::cuda
