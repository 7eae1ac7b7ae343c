// gemm_cublas.cu: dense GEMMs through cuBLAS (cuda/gemm.h): bf16 x bf16 -> fp32 or bf16 with fp32 accumulation,
// and pedantic fp32, row-major by computing C^T = op(B)^T op(A)^T in cuBLAS's column-major terms; one cuBLAS handle
// per device; and the version-guarded cuBLAS grouped GEMM (CUDA >= 12.5) used as a comparison point.
// Not our grouped kernel (grouped_gemm_wmma.cu).
#include <cublas_v2.h>

#include <mutex>
#include <vector>

#include "cuda_common.cuh"
#include "moetron/cuda/gemm.h"

namespace moetron::cuda {
namespace {

cublasOperation_t op_of(Op o) { return o == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T; }

void check_dims(const char* op, Op ta, Op tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  MT_CUDA_ARG(M >= 0 && N >= 0 && K >= 0, op, "negative size");
  MT_CUDA_ARG(M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX, op, "a size is over cuBLAS's int range");
  MT_CUDA_ARG(lda >= (ta == Op::N ? K : M) && lda >= 1, op, "lda is below the stored row length");
  MT_CUDA_ARG(ldb >= (tb == Op::N ? N : K) && ldb >= 1, op, "ldb is below the stored row length");
  MT_CUDA_ARG(ldc >= N && ldc >= 1, op, "ldc is below N");
}

void gemm_ex(const char* name, Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
             int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc, cudaDataType_t ab,
             cudaDataType_t c, cublasComputeType_t compute, void* stream) {
  check_dims(name, ta, tb, M, N, K, lda, ldb, ldc);
  if (M == 0 || N == 0) return;
  auto h = static_cast<cublasHandle_t>(cublas_handle());
  MT_CUBLAS_CHECK(cublasSetStream(h, static_cast<cudaStream_t>(stream)));
  // Row-major C[M,N] is column-major C^T[N,M] = op(B)^T[N,K] · op(A)^T[K,M].
  MT_CUBLAS_CHECK(cublasGemmEx(h, op_of(tb), op_of(ta), int(N), int(M), int(K), &alpha, B, ab, int(ldb), A, ab,
                               int(lda), &beta, C, c, int(ldc), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void* cublas_handle() {
  static std::mutex mu;
  static std::vector<cublasHandle_t> handles;
  int dev = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (int(handles.size()) <= dev) handles.resize(size_t(dev) + 1, nullptr);
  if (!handles[size_t(dev)]) MT_CUBLAS_CHECK(cublasCreate(&handles[size_t(dev)]));
  return handles[size_t(dev)];
}

void gemm_bf16(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda, const bf16* B,
               int64_t ldb, float beta, float* C, int64_t ldc, void* stream) {
  gemm_ex("cuda.gemm_bf16", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, CUDA_R_16BF, CUDA_R_32F,
          CUBLAS_COMPUTE_32F, stream);
}
void gemm_bf16_out_bf16(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
                        const bf16* B, int64_t ldb, float beta, bf16* C, int64_t ldc, void* stream) {
  gemm_ex("cuda.gemm_bf16_out_bf16", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, CUDA_R_16BF, CUDA_R_16BF,
          CUBLAS_COMPUTE_32F, stream);
}
void gemm_f32(Op ta, Op tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
              int64_t ldb, float beta, float* C, int64_t ldc, void* stream) {
  gemm_ex("cuda.gemm_f32", ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, CUDA_R_32F, CUDA_R_32F,
          CUBLAS_COMPUTE_32F_PEDANTIC, stream);
}

#if CUDART_VERSION >= 12050
bool grouped_gemm_cublas_available() { return true; }
void grouped_gemm_fwd_cublas(float* Y, const bf16* X, const bf16* W, const int32_t* host_counts, int64_t E, int64_t M,
                             int64_t K, int64_t N, void* stream) {
  MT_CUDA_ARG(E > 0 && M >= 0 && K > 0 && N > 0, "cuda.grouped_gemm_fwd_cublas", "bad sizes");
  // One group per expert with one matrix each; empty experts are left out (cuBLAS wants m >= 1... and so do we).
  std::vector<cublasOperation_t> tn;
  std::vector<int> m, n, k, lda, ldb, ldc, gsize;
  std::vector<float> alpha, beta;
  std::vector<const void*> a, b;
  std::vector<void*> c;
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t me = host_counts[e];
    if (me > 0) {
      tn.push_back(CUBLAS_OP_N);
      m.push_back(int(N));  // column-major: C_e^T [N, m_e] = W_e^T [N, K] · X_e^T [K, m_e]
      n.push_back(int(me));
      k.push_back(int(K));
      lda.push_back(int(N));
      ldb.push_back(int(K));
      ldc.push_back(int(N));
      gsize.push_back(1);
      alpha.push_back(1.0f);
      beta.push_back(0.0f);
      a.push_back(reinterpret_cast<const char*>(W) + size_t(e) * size_t(K * N) * 2);
      b.push_back(reinterpret_cast<const char*>(X) + size_t(row) * size_t(K) * 2);
      c.push_back(Y + row * N);
    }
    row += me;
  }
  MT_CUDA_ARG(row == M, "cuda.grouped_gemm_fwd_cublas", "the counts do not sum to M");
  if (a.empty()) return;
  const size_t G = a.size();
  // The pointer arrays live on the device.
  void** dptr = nullptr;
  MT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&dptr), 3 * G * sizeof(void*)));
  auto st = static_cast<cudaStream_t>(stream);
  MT_CUDA_CHECK(cudaMemcpyAsync(dptr, a.data(), G * sizeof(void*), cudaMemcpyHostToDevice, st));
  MT_CUDA_CHECK(cudaMemcpyAsync(dptr + G, b.data(), G * sizeof(void*), cudaMemcpyHostToDevice, st));
  MT_CUDA_CHECK(cudaMemcpyAsync(dptr + 2 * G, c.data(), G * sizeof(void*), cudaMemcpyHostToDevice, st));
  auto h = static_cast<cublasHandle_t>(cublas_handle());
  MT_CUBLAS_CHECK(cublasSetStream(h, st));
  MT_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      h, tn.data(), tn.data(), m.data(), n.data(), k.data(), alpha.data(), const_cast<const void* const*>(dptr),
      CUDA_R_16BF, lda.data(), const_cast<const void* const*>(dptr + G), CUDA_R_16BF, ldb.data(), beta.data(),
      dptr + 2 * G, CUDA_R_32F, ldc.data(), int(G), gsize.data(), CUBLAS_COMPUTE_32F));
  MT_CUDA_CHECK(cudaStreamSynchronize(st));
  MT_CUDA_CHECK(cudaFree(dptr));
}
#else
bool grouped_gemm_cublas_available() { return false; }
void grouped_gemm_fwd_cublas(float*, const bf16*, const bf16*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                             void*) {
  detail::arg_fail("cuda.grouped_gemm_fwd_cublas", "cuBLAS's grouped GEMM needs CUDA 12.5 or newer; this build has an older CUDA");
}
#endif

}  // namespace moetron::cuda
