// cuda/moe.h: the CUDA backend's MoE routing and dispatch, the device twins of router.h and permute.h, on device
// pointers, enqueued on `stream` (a cudaStream_t; nullptr = the legacy default stream). Nothing is read back to
// the host: counts, offsets and rows are computed on the device and feed the grouped GEMM (cuda/gemm.h) directly.
// Not the gate GEMM (cuda/gemm.h), not the aux / z losses, Sinkhorn or capacity routing (the CPU router has them;
// the device router refuses a config that asks for them), not capacity dropping (R = N * k always). C++17-clean.
//
// Router (router.h's rule, per token, one warp per token):
//   s = softmax(l) or sigmoid(l) (fp32);  q_e = s_e + bias_e (one fp32 add, as on the CPU);
//   group-limited selection (n_group > 1, GroupScore Max or Top2Sum) then top-k over the eligible experts;
//   ties (equal q, equal group scores) go to the LOWER index; slot j holds the j-th largest.
//   w_j = route_scale * s_{i_j} / (norm_topk ? sum_m s_{i_m} + 1e-20 : 1), summed in slot order;
//   counts[e] = assignments to e (integer atomics: exact, order-free).
//   Given the same scores the device selects exactly what router_select_ref<float> selects (same comparisons
//   on the same fp32 values); the scores themselves may differ from the CPU's by an ulp (expf vs std::exp).
// Backward: dlogits of sum_{n,j} dtopk_w[n,j] * w[n,j] with the selection fixed (router_backward_ref with
//   AuxMode::None, z_coef 0).
// Aux-loss-free bias (DeepSeek-V3): bias_e += rate * sign(total - E * counts_e), from the device counts (exact
//   integers, as router_update_bias).
//
// Dispatch (permute.h's plan with capacity factor 0, and its kernels):
//   moe_plan: counts, offsets [E+1] (exclusive scan), row_of [N, k], token_of [R], slot_of [R] from topk_idx:
//     expert-major, stable in (token, slot) order, exactly moe_permute_plan_ref's; R = N * k. An index outside
//     [0, E) cannot be reported by name from the device: it traps (a launch error at chunk_hist_kernel).
//   moe_permute: xp[r] = x[token_of[r]] (fp32 -> fp32 or bf16);  moe_dispatch = moe_plan + moe_permute.
//   moe_permute_backward: dx[t] = sum_s dxp[row_of[t, s]] (slot order).
//   moe_unpermute: y[t] = sum_s w[t, s] * yp[row_of[t, s]] (slot order).
//   moe_unpermute_backward: dyp[row_of[t, s]] = w[t, s] * dy[t]; dw[t, s] = dot(dy[t], yp[row_of[t, s]]).
//   Every output is overwritten; per-token sums have a fixed order; no float atomics (deterministic).
#pragma once
#include <cstddef>
#include <cstdint>

namespace moetron {
struct bf16;
}

namespace moetron::cuda {

// The device router's configuration: router.h's RouterConfig without the losses (C++17-clean copy of the fields).
struct DeviceRouterConfig {
  int E = 0, topk = 0;
  bool sigmoid = false;     // ScoreFn::Sigmoid (else Softmax)
  int n_group = 1, topk_group = 1;
  bool group_top2sum = false;  // GroupScore::Top2Sum (else Max)
  bool norm_topk = true;
  float route_scale = 1.0f;
};
// The largest E the device router takes (a token's scores live in registers/shared memory of one warp).
inline constexpr int kDeviceRouterMaxExperts = 1024;

// topk_idx [N, k], topk_w [N, k], scores [N, E] are written; counts [E] is overwritten. bias may be null.
void router_forward(int32_t* topk_idx, float* topk_w, int32_t* counts, float* scores, const float* logits,
                    const float* bias, const DeviceRouterConfig& cfg, int64_t N, void* stream);
// dlogits [N, E] overwritten.
void router_backward(float* dlogits, const float* dtopk_w, const float* scores, const int32_t* topk_idx,
                     const DeviceRouterConfig& cfg, int64_t N, void* stream);
// bias [E] += rate * sign(total - E * counts[e]) (router_update_bias).
void router_update_bias(float* bias, const int32_t* counts, int E, float rate, void* stream);

// Device workspace of moe_plan for N * k assignments over E experts.
size_t moe_plan_workspace_bytes(int64_t N, int k, int E);
void moe_plan(int32_t* counts /* [E] */, int32_t* offsets /* [E+1] */, int32_t* row_of /* [N, k] */,
              int32_t* token_of /* [N*k] */, int32_t* slot_of /* [N*k] or null */, const int32_t* topk_idx,
              int64_t N, int k, int E, void* ws, void* stream);
void moe_permute(float* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D, void* stream);
void moe_permute(bf16* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D, void* stream);
// moe_plan then moe_permute (bf16 rows for the grouped GEMM), all on the device.
void moe_dispatch(bf16* xp, int32_t* counts, int32_t* offsets, int32_t* row_of, int32_t* token_of, int32_t* slot_of,
                  const float* x, const int32_t* topk_idx, int64_t N, int k, int E, int64_t D, void* ws,
                  void* stream);
void moe_permute_backward(float* dx, const float* dxp, const int32_t* row_of, int64_t N, int k, int64_t D,
                          void* stream);
void moe_unpermute(float* y, const float* yp, const int32_t* row_of, const float* w, int64_t N, int k, int64_t D,
                   void* stream);
// dyp [R, D] and dw [N, k] overwritten.
void moe_unpermute_backward(float* dyp, float* dw, const float* dy, const float* yp, const int32_t* row_of,
                            const float* w, int64_t N, int k, int64_t D, void* stream);

}  // namespace moetron::cuda
