// cuda/attention.h: the CUDA backend's causal flash-style attention, forward and backward, the device twin of
// attention.h (mask Causal, Tk = T; fp32 or bf16 products): MHA, GQA/MQA (q head h reads kv head
// h / (Hq / Hkv)) and MLA-shaped heads (Dqk != Dv, e.g. 192 / 128), on strided views with attention.h's layout:
//   q  [(b*T + t)*ldq + h*head_q + d] (h < Hq, d < Dqk), k like q with ldk/head_k (h < Hkv), v with ldv/head_v
//   (d < Dv), out with ldo/head_o (h < Hq, d < Dv); lse [B, Hq, T].
// Forward: tiles of 32 queries x 32 keys in shared memory, online softmax, only lse stored (never T x T).
// Backward (FlashAttention-2's): D_t = rowsum(dout * out), then one kernel per key tile and kv head for dk, dv
// (looping over the group's q heads and the query tiles in order) and one per query tile and q head for dq: every
// gradient element is written by one block in a fixed order, no atomics: deterministic.
// Two variants, same tiling and order: fp32 SIMT tiles (default: fp32 products, attention.h's AttnPrec::F32) and
// bf16 tensor-core tiles (bf16 = true, WMMA). Correct-first, not tuned. Dqk, Dv <= 256. Not: head_k / head_v = 0
// (a shared head: expand it first), key blocks (Full mask, cp_attention.h), dropout. C++17-clean.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moetron::cuda {

struct DeviceAttnDims {
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, Dqk = 0, Dv = 0;
  int64_t ldq = 0, ldk = 0, ldv = 0, ldo = 0;
  int64_t head_q = 0, head_k = 0, head_v = 0, head_o = 0;
  float scale = 1.0f;
  // true: every product on tensor cores (WMMA bf16 x bf16 -> fp32) with its operands rounded to bf16 (q, k, v, dO,
  // P, dS: attention.h's AttnPrec::BF16 semantics); softmax, lse, D_t, accumulators fp32. Needs sm_80+.
  bool bf16 = false;
};
inline constexpr int64_t kDeviceAttnMaxHeadDim = 256;

// Shared memory one launch of each kernel needs (bytes); the calls refuse shapes above the device's opt-in limit.
size_t attention_forward_smem_bytes(const DeviceAttnDims& d);
size_t attention_backward_smem_bytes(const DeviceAttnDims& d);
// Device workspace of the backward: D_t, B * Hq * T floats.
size_t attention_backward_workspace_bytes(const DeviceAttnDims& d);
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, const DeviceAttnDims& d,
                       void* stream);
// dq, dk, dv overwritten (dk, dv sum over the q heads of each kv group). out and lse from attention_forward.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, const DeviceAttnDims& d, void* ws,
                        void* stream);

}  // namespace moetron::cuda
