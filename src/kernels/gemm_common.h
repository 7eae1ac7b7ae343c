// gemm_common.h: argument checks and the K = 0 case shared by the dense GEMM entry points (gemm.cpp,
// gemm_f32.cpp). Private to src/kernels; not a GEMM.
#pragma once
#include <cstdint>

#include "moetron/check.h"
#include "moetron/gemm.h"

namespace moetron::gemm_detail {

inline void check_dims(const char* op, Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb,
                       int64_t ldc) {
  MT_CHECK(M >= 0 && N >= 0 && K >= 0, op, "negative size M=", M, " N=", N, " K=", K);
  MT_CHECK(lda >= (ta == Trans::N ? K : M) && lda >= 1, op, "lda=", lda, " too small for ", ta == Trans::N ? "K=" : "M=",
           ta == Trans::N ? K : M);
  MT_CHECK(ldb >= (tb == Trans::N ? N : K) && ldb >= 1, op, "ldb=", ldb, " too small for ", tb == Trans::N ? "N=" : "K=",
           tb == Trans::N ? N : K);
  MT_CHECK(ldc >= N && ldc >= 1, op, "ldc=", ldc, " smaller than N=", N);
}

inline void check_ptrs(const char* op, const void* A, const void* B, const void* C, int64_t M, int64_t N, int64_t K) {
  MT_CHECK(C || M == 0 || N == 0, op, "C is null");
  MT_CHECK((A && B) || M == 0 || N == 0 || K == 0, op, "A or B is null");
}

// K = 0: C = beta * C (C is write-only when beta = 0).
inline void scale_c(float* C, int64_t ldc, int64_t M, int64_t N, float beta) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
}

// Every dense entry point's prologue: checks sizes, leading dimensions and pointers (naming `op`), and does
// the trivial cases (M or N = 0: nothing; K = 0: C = beta * C). Returns true when nothing is left to compute.
inline bool prologue(const char* op, Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                     const void* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  check_dims(op, ta, tb, M, N, K, lda, ldb, ldc);
  check_ptrs(op, A, B, C, M, N, K);
  if (M == 0 || N == 0) return true;
  if (K == 0) return scale_c(C, ldc, M, N, beta), true;
  return false;
}

}  // namespace moetron::gemm_detail
