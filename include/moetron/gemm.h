// gemm.h: dense matrix multiply, row-major.
//   C[M,N] = alpha * op(A)[M,K] · op(B)[K,N] + beta * C[M,N]
// op(X) is X or X^T (Trans::T means the stored matrix is the transpose: A stored [K,M] with lda >= M).
// gemm_f32 is our own batch-invariant kernel: every element is acc = the fp32 sum over k = 0..K-1 in that order
// (fused multiply-adds from 0), then C = alpha * acc (beta = 0) or C = fma(beta, C, alpha * acc), the same
// way for every shape. So row i of C is bitwise the same whatever M is, whatever rows surround it and
// whatever the thread count (and column j whatever N is), for a given ISA level; the AVX2 and AVX-512 paths
// give the same bits, the scalar path (no FMA) does not. gemm_f32_onednn is oneDNN's sgemm: usually a bit
// faster, NOT batch invariant (its kernel and K partitioning depend on the shape and thread count); kept to
// measure the machine's sgemm limit. bf16 inputs (gemm_bf16, oneDNN) accumulate in fp32 and write fp32.
// beta = 0 means C is write-only (never read, NaN there is harmless); K = 0 gives C = beta * C. Sizes, leading
// dimensions (lda >= K or M by op, ldb >= N or K, ldc >= N, all >= 1) and null pointers are checked
// (moetron::Error). Thread-safe; each call runs one OpenMP parallel region (small problems run on the calling
// thread). gemm_ref is the naive twin (float or double). Grouped (MoE) GEMMs: grouped_gemm.h.
#pragma once
#include <cstdint>

#include "moetron/dtype.h"

namespace moetron {

enum class Trans : uint8_t { N, T };

void gemm_f32(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
              const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// oneDNN's dnnl_sgemm, same contract except batch invariance (see above).
void gemm_f32_onednn(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// bf16 operands, fp32 accumulation and output: oneDNN's bf16 matmul where it has one; elsewhere the operands
// are widened to fp32 (exactly) and go through gemm_f32 (correct, not fast: the trainer refuses bf16 compute
// on such CPUs, see gemm_bf16_native).
void gemm_bf16(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
               const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc);

// True when bf16 GEMMs run natively here: the CPU has AVX512-BF16 and oneDNN creates a bf16 matmul (an ISA
// cap such as DNNL_MAX_CPU_ISA=AVX2 makes it false). resolve_compute_dtype (model.h) asks it.
bool gemm_bf16_native();

template <class T>
void gemm_ref(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
              int64_t ldb, T beta, T* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      T acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        T a = ta == Trans::N ? A[i * lda + k] : A[k * lda + i];
        T b = tb == Trans::N ? B[k * ldb + j] : B[j * ldb + k];
        acc += a * b;
      }
      C[i * ldc + j] = alpha * acc + (beta == T(0) ? T(0) : beta * C[i * ldc + j]);
    }
}

// Vector conversions (SIMD-dispatched), bitwise equal to to_bf16 / from_bf16 (round to nearest even,
// denormals kept). The plain versions split large arrays over the OpenMP threads in fixed chunks; the
// _serial versions run on the calling thread (for use inside parallel regions).
void f32_to_bf16(bf16* out, const float* in, int64_t n);
void bf16_to_f32(float* out, const bf16* in, int64_t n);
void f32_to_bf16_serial(bf16* out, const float* in, int64_t n);
void bf16_to_f32_serial(float* out, const bf16* in, int64_t n);
// Zeroes `bytes` bytes, split over the OpenMP threads like the conversions (one thread's stores do not reach
// the memory bandwidth of two cores).
void zero_bytes(void* p, size_t bytes);

}  // namespace moetron
