// gemm.h: dense matrix multiply, row-major, through oneDNN.
//   C[M,N] = alpha * op(A)[M,K] · op(B)[K,N] + beta * C[M,N]
// op(X) is X or X^T (Trans::T means the stored matrix is the transpose: A stored [K,M] with lda >= M).
// bf16 inputs accumulate in fp32 and write fp32. beta = 0 means C is write-only (never read, NaN there is
// harmless); K = 0 gives C = beta * C. Sizes, leading dimensions (lda >= K or M by op, ldb >= N or K, ldc >= N,
// all >= 1) and null pointers are checked (moetron::Error). Thread-safe; each call runs oneDNN's own OpenMP
// parallel region. gemm_ref is the naive twin (float or double). Grouped (MoE) GEMMs: grouped_gemm.h.
#pragma once
#include <cstdint>

#include "moetron/dtype.h"

namespace moetron {

enum class Trans : uint8_t { N, T };

void gemm_f32(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
              const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// oneDNN's own sgemm (same contract as gemm_f32): the machine's fp32 GEMM limit for benchmarks and MFU.
void gemm_f32_onednn(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// True when bf16 GEMMs run natively here: the CPU has AVX512-BF16 and oneDNN creates a bf16 matmul (an
// ISA cap such as DNNL_MAX_CPU_ISA=AVX2 makes it false). gemm_bf16 throws, naming the missing feature and
// the training.compute_dtype key, where oneDNN has no bf16 matmul.
bool gemm_bf16_native();

void gemm_bf16(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
               const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc);

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

}  // namespace moetron
