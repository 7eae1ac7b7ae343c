// cuda/gemm.h: the CUDA backend's matrix products, row-major like gemm.h / grouped_gemm.h:
//   dense    C[M,N] = alpha * op(A)[M,K] · op(B)[K,N] + beta * C, through cuBLAS: bf16 operands with fp32
//            accumulation (CUBLAS_COMPUTE_32F) writing fp32 or bf16, and fp32 (CUBLAS_COMPUTE_32F_PEDANTIC: no TF32);
//            beta = 0 never reads C.
//   grouped  the MoE expert GEMMs of grouped_gemm.h over all experts in one launch each, with the per-expert
//            counts read ON THE DEVICE (no host read-back; the grid is sized by the bound ceil(M/64) + E tiles):
//            forward Y_e = X_e · W[e], dgrad dX_e = dY_e · W[e]^T, wgrad dW[e] (+)= X_e^T · dY_e; bf16 inputs,
//            fp32 accumulation and output, W unpacked [E, K, N] bf16. Our own kernel (tensor cores via WMMA).
//   cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx, CUDA >= 12.5) as a comparison point: it needs the counts
//            on the host, so it is not the training path; grouped_gemm_cublas_available() says whether this build
//            has it.
// Everything is enqueued on `stream` (nullptr: the legacy default stream). C++17-clean.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moetron {
struct bf16;
}

namespace moetron::cuda {

enum class Op : uint8_t { N, T };

void gemm_bf16(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda, const bf16* B,
               int64_t ldb, float beta, float* C, int64_t ldc, void* stream);
void gemm_bf16_out_bf16(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
                        const bf16* B, int64_t ldb, float beta, bf16* C, int64_t ldc, void* stream);
void gemm_f32(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
              int64_t ldb, float beta, float* C, int64_t ldc, void* stream);

// Device workspace of one grouped call: the row offsets and tile offsets (E + 1 each).
size_t grouped_gemm_workspace_bytes(int64_t E);
// counts: device int32 [E], sum = M (rows past M are ignored). X [M, K], W [E, K, N], Y [M, N].
void grouped_gemm_fwd(float* Y, const bf16* X, const bf16* W, const int32_t* counts, int64_t E, int64_t M, int64_t K,
                      int64_t N, void* ws, void* stream);
void grouped_gemm_dgrad(float* dX, const bf16* dY, const bf16* W, const int32_t* counts, int64_t E, int64_t M,
                        int64_t K, int64_t N, void* ws, void* stream);
void grouped_gemm_wgrad(float* dW, const bf16* X, const bf16* dY, const int32_t* counts, int64_t E, int64_t M,
                        int64_t K, int64_t N, bool accumulate, void* ws, void* stream);

bool grouped_gemm_cublas_available();
// The forward through cublasGemmGroupedBatchedEx with HOST counts (throws where the build's CUDA has none).
void grouped_gemm_fwd_cublas(float* Y, const bf16* X, const bf16* W, const int32_t* host_counts, int64_t E, int64_t M,
                             int64_t K, int64_t N, void* stream);

// The cuBLAS handle of the current device (created on first use, kept for the process). For the backend's own use.
void* cublas_handle();

}  // namespace moetron::cuda
