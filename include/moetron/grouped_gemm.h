// grouped_gemm.h: the MoE expert GEMMs. Tokens routed to E experts sit in one buffer grouped by expert:
// rows of expert e are [off[e], off[e+1]) with off the exclusive prefix sum of counts[E] (int32, from the
// router). Weights are fp32 masters W[E, K, N] (in -> out). Three operations, each ONE OpenMP parallel region
// over (expert, tile) work items:
//   forward  (M-grouped):  Y_e[m_e, N]  = X_e[m_e, K] · W[e][K, N]
//   dgrad    (M-grouped):  dX_e[m_e, K] = dY_e[m_e, N] · W[e]^T
//   wgrad    (K-grouped):  dW[e][K, N]  = (or +=) X_e^T · dY_e      (reduction over the m_e tokens of e)
// bf16 inputs with fp32 accumulation (main path) or fp32 inputs. Outputs are fp32; forward and dgrad can
// also write a bf16 copy of their output. Forward and dgrad read weights packed once per optimizer step by
// grouped_pack_weights (layout in docs/kernels/gemm.md); the caller re-packs after each step.
// Results are bitwise independent of the thread count. Not a general batched GEMM: row-major, contiguous
// activations (leading dimension = width), one weight tensor per call.
// The naive twins grouped_gemm_{fwd,dgrad,wgrad}_ref<T> are loops of gemm_ref.
#pragma once
#include <cstddef>
#include <cstdint>

#include "moetron/dtype.h"
#include "moetron/gemm.h"
#include "moetron/kernel_sizes.h"

namespace moetron {

// GemmPrec (element type of activations and packed weights), GroupedPackKind (packed W[e] for the forward or
// W[e]^T for dgrad) and GroupedOp come from kernel_sizes.h, with the size arithmetic the accounting shares.

// Rows of expert e are [off[e], off[e+1]). Throws if E < 0, M < 0, a count is negative or sum(counts) != M.
void grouped_offsets(int64_t* off /* [E+1] */, const int32_t* counts /* [E] */, int64_t E, int64_t M);

// A packed weight tensor: caller-owned storage plus what it was packed for (checked on use).
struct GroupedPackedWeights {
  const void* data = nullptr;
  int64_t E = 0, K = 0, N = 0;
  GemmPrec prec = GemmPrec::BF16;
  GroupedPackKind kind = GroupedPackKind::Fwd;
};

// Bytes of packed storage for W[E, K, N] (a multiple of 64; pass 64-byte aligned memory).
size_t grouped_packed_bytes(GroupedPackKind kind, GemmPrec prec, int64_t E, int64_t K, int64_t N);
// Pack fp32 W[E, K, N] into `data` (grouped_packed_bytes(kind, prec, E, K, N) bytes), rounding to bf16 for
// GemmPrec::BF16. Parallel over (expert, panel). Returns the descriptor to pass to forward / dgrad.
// [e0, e1): pack only those experts (e1 < 0: to E); the rest of `data` is left as it is, the descriptor is the
// whole tensor's. Packing the experts in any split of [0, E) gives the same bytes as one call.
GroupedPackedWeights grouped_pack_weights(void* data, const float* W /* [E, K, N] */, int64_t E, int64_t K, int64_t N,
                                          GemmPrec prec, GroupedPackKind kind, int64_t e0 = 0, int64_t e1 = -1);

// Workspace for one call: the schedule (O(E)) and, for bf16 wgrad, one packing slot (~0.3 MiB at d=512) per
// thread. Valid for any counts; `threads` <= 0 means num_threads(). Pass it as ws / ws_bytes (64-byte aligned);
// a call uses at most as many threads as ws_bytes has slots for, and throws if it is below one slot.
size_t grouped_gemm_workspace_bytes(GroupedOp op, GemmPrec prec, int64_t E, int64_t M, int64_t K, int64_t N,
                                    int threads = 0);

// Forward. W must be packed with kind Fwd and the matching precision. Y_bf16 may be null.
void grouped_gemm_fwd(float* Y /* [M, N] */, bf16* Y_bf16 /* [M, N] or null */, const bf16* X /* [M, K] */,
                      const GroupedPackedWeights& W, const int32_t* counts /* [E] */, int64_t E, int64_t M, int64_t K,
                      int64_t N, void* ws, size_t ws_bytes);
void grouped_gemm_fwd(float* Y /* [M, N] */, const float* X /* [M, K] */, const GroupedPackedWeights& W,
                      const int32_t* counts /* [E] */, int64_t E, int64_t M, int64_t K, int64_t N, void* ws,
                      size_t ws_bytes);

// Data gradient. Wt must be packed with kind Dgrad (from the same W[E, K, N]). dX_bf16 may be null.
void grouped_gemm_dgrad(float* dX /* [M, K] */, bf16* dX_bf16 /* [M, K] or null */, const bf16* dY /* [M, N] */,
                        const GroupedPackedWeights& Wt, const int32_t* counts /* [E] */, int64_t E, int64_t M,
                        int64_t K, int64_t N, void* ws, size_t ws_bytes);
void grouped_gemm_dgrad(float* dX /* [M, K] */, const float* dY /* [M, N] */, const GroupedPackedWeights& Wt,
                        const int32_t* counts /* [E] */, int64_t E, int64_t M, int64_t K, int64_t N, void* ws,
                        size_t ws_bytes);

// Weight gradient: dW[e] = X_e^T · dY_e, or dW[e] += X_e^T · dY_e with accumulate. An expert with no tokens
// gets dW[e] = 0 (or keeps its value when accumulating).
void grouped_gemm_wgrad(float* dW /* [E, K, N] */, const bf16* X /* [M, K] */, const bf16* dY /* [M, N] */,
                        const int32_t* counts /* [E] */, int64_t E, int64_t M, int64_t K, int64_t N, bool accumulate,
                        void* ws, size_t ws_bytes);
void grouped_gemm_wgrad(float* dW /* [E, K, N] */, const float* X /* [M, K] */, const float* dY /* [M, N] */,
                        const int32_t* counts /* [E] */, int64_t E, int64_t M, int64_t K, int64_t N, bool accumulate,
                        void* ws, size_t ws_bytes);

// ---- naive twins (float or double): per-expert loops of gemm_ref on unpacked W ----
template <class T>
void grouped_gemm_fwd_ref(T* Y /* [M, N] */, const T* X /* [M, K] */, const T* W /* [E, K, N] */,
                          const int32_t* counts /* [E] */, int64_t E, int64_t M, int64_t K, int64_t N) {
  int64_t o = 0;
  for (int64_t e = 0; e < E; ++e) {
    gemm_ref<T>(Trans::N, Trans::N, counts[e], N, K, T(1), X + o * K, K, W + e * K * N, N, T(0), Y + o * N, N);
    o += counts[e];
  }
  (void)M;
}

template <class T>
void grouped_gemm_dgrad_ref(T* dX /* [M, K] */, const T* dY /* [M, N] */, const T* W /* [E, K, N] */,
                            const int32_t* counts /* [E] */, int64_t E, int64_t M, int64_t K, int64_t N) {
  int64_t o = 0;
  for (int64_t e = 0; e < E; ++e) {
    gemm_ref<T>(Trans::N, Trans::T, counts[e], K, N, T(1), dY + o * N, N, W + e * K * N, N, T(0), dX + o * K, K);
    o += counts[e];
  }
  (void)M;
}

template <class T>
void grouped_gemm_wgrad_ref(T* dW /* [E, K, N] */, const T* X /* [M, K] */, const T* dY /* [M, N] */,
                            const int32_t* counts /* [E] */, int64_t E, int64_t M, int64_t K, int64_t N,
                            bool accumulate) {
  int64_t o = 0;
  for (int64_t e = 0; e < E; ++e) {
    gemm_ref<T>(Trans::T, Trans::N, K, N, counts[e], T(1), X + o * K, K, dY + o * N, N, accumulate ? T(1) : T(0),
                dW + e * K * N, N);
    o += counts[e];
  }
  (void)M;
}

}  // namespace moetron
