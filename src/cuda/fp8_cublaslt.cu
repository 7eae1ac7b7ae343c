// fp8_cublaslt.cu: tensorwise current-scaled E4M3 quantization on the GPU and the cuBLASLt FP8 GEMM (cuda/fp8.h). The
// amax is an integer atomicMax over the bit patterns of |x| (non-negative floats order like their bits: exact and
// independent of the order); the scale follows on the device; the codec repeats dtype.cpp's steps (frexp, scale
// to M mantissa bits, round to nearest even, saturate) in fp32, where every step is exact, so it is bitwise the
// CPU's. The GEMM is compiled only with CUDA >= 12 (CUDART_VERSION); older toolkits get the refusal.
#include <mutex>

#include "cuda_common.cuh"
#include "moetron/cuda/fp8.h"
#include "moetron/cuda/runtime.h"

#if CUDART_VERSION >= 12000
#include <cublasLt.h>
#endif

namespace moetron::cuda {
namespace {

constexpr float kE4M3Max = 448.0f;

// dtype.cpp's encode_fp8(f, M = 3, bias = 7, max_bits = 0x7e, nan_bits = 0x7f).
__device__ __forceinline__ uint8_t encode_e4m3(float f) {
  const uint8_t sign = uint8_t((__float_as_uint(f) >> 31) << 7);
  if (isnan(f)) return uint8_t(sign | 0x7f);
  const float a = fabsf(f);
  if (a == 0.0f) return sign;
  if (isinf(a)) return uint8_t(sign | 0x7e);
  constexpr int M = 3, bias = 7, emin = 1 - bias;
  int e;
  frexpf(a, &e);
  e -= 1;
  uint32_t bits;
  if (e < emin) {
    bits = uint32_t(rintf(ldexpf(a, M - emin)));  // exact scaling, then round to nearest even
  } else {
    float m = rintf(ldexpf(a, M - e));
    if (m >= float(1u << (M + 1))) {
      m = float(1u << M);
      e += 1;
    }
    const int ef = e + bias;
    if (ef > (0x7f >> M)) return uint8_t(sign | 0x7e);
    bits = (uint32_t(ef) << M) | (uint32_t(m) - (1u << M));
  }
  if (bits > 0x7eu) bits = 0x7eu;
  return uint8_t(sign | bits);
}

// dtype.cpp's decode_fp8 for E4M3 (no infinities; 0x7f / 0xff are NaN).
__device__ __forceinline__ float decode_e4m3(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int v = b & 0x7f;
  if (v == 0x7f) return NAN;
  const int ef = v >> 3, mant = v & 7;
  if (ef == 0) return sign * ldexpf(float(mant), -9);
  return sign * ldexpf(1.0f + float(mant) / 8.0f, ef - 7);
}

// fp8.cpp's fp8_scale_from_amax without pow2 scales.
__device__ __forceinline__ float scale_from_amax(float amax) {
  const float s = __fdiv_rn(amax, kE4M3Max);
  return (!(s > 0.0f) || isinf(s)) ? 1.0f : s;
}

__global__ void amax_kernel(unsigned int* __restrict__ amax_bits, const float* __restrict__ x, int64_t n) {
  unsigned int m = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float a = fabsf(x[i]);
    if (isfinite(a)) m = max(m, __float_as_uint(a));
  }
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) atomicMax(amax_bits, m);
}

__global__ void quantize_kernel(uint8_t* __restrict__ q, float* __restrict__ scale,
                                const unsigned int* __restrict__ amax_bits, const float* __restrict__ x, int64_t n) {
  const float sc = scale_from_amax(__uint_as_float(*amax_bits));
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale = sc;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    q[i] = encode_e4m3(__fdiv_rn(x[i], sc));
}

__global__ void dequantize_kernel(float* __restrict__ x, const uint8_t* __restrict__ q, const float* __restrict__ scale,
                                  int64_t n) {
  const float sc = *scale;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __fmul_rn(decode_e4m3(q[i]), sc);
}

int grid_for(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return int(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

}  // namespace

size_t fp8_quantize_workspace_bytes() { return 256; }

void fp8_quantize_tensor_e4m3(uint8_t* q, float* scale, const float* x, int64_t n, void* ws, void* stream) {
  MT_CUDA_ARG(n >= 0 && q && scale && x && ws, "cuda.fp8_quantize_tensor_e4m3",
              "needs n >= 0, q, scale, x and a workspace of fp8_quantize_workspace_bytes()");
  auto st = static_cast<cudaStream_t>(stream);
  auto* amax = static_cast<unsigned int*>(ws);
  MT_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(unsigned int), st));
  if (n > 0) {
    amax_kernel<<<grid_for(n), 256, 0, st>>>(amax, x, n);
    MT_CUDA_LAUNCHED("amax_kernel");
  }
  quantize_kernel<<<grid_for(n), 256, 0, st>>>(q, scale, amax, x, n);
  MT_CUDA_LAUNCHED("quantize_kernel");
}

void fp8_dequantize_tensor_e4m3(float* x, const uint8_t* q, const float* scale, int64_t n, void* stream) {
  MT_CUDA_ARG(n >= 0, "cuda.fp8_dequantize_tensor_e4m3", "needs n >= 0");
  if (n == 0) return;
  dequantize_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(stream)>>>(x, q, scale, n);
  MT_CUDA_LAUNCHED("dequantize_kernel");
}

size_t fp8_gemm_workspace_bytes() { return size_t(32) << 20; }

bool fp8_gemm_available(std::string* why) {
#if CUDART_VERSION >= 12000
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    if (why) *why = "no usable CUDA device";
    return false;
  }
  const int cc = major * 10 + minor;
  if (cc < 89) {
    if (why) *why = "FP8 GEMMs need sm_89 or newer (this device is sm_" + std::to_string(cc) + ")";
    return false;
  }
  if (cc == 89 && CUDART_VERSION < 12010) {
    if (why) *why = "FP8 GEMMs on sm_89 need CUDA 12.1 or newer (this build's CUDA is 12.0)";
    return false;
  }
  return true;
#else
  if (why) *why = "FP8 GEMMs need CUDA 12.0 or newer at build time (this build's CUDA is " +
                  std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10) + ")";
  return false;
#endif
}

#if CUDART_VERSION >= 12000
namespace {
cublasLtHandle_t lt_handle() {
  static std::mutex mu;
  static cublasLtHandle_t handles[64] = {};
  int dev = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  MT_CUDA_ARG(dev >= 0 && dev < 64, "cuda.fp8_gemm_e4m3", "device index above 63");
  std::lock_guard<std::mutex> lock(mu);
  if (!handles[dev]) MT_CUBLAS_CHECK(cublasLtCreate(&handles[dev]));
  return handles[dev];
}
}  // namespace
#endif

void fp8_gemm_e4m3(float* C, const uint8_t* A, const float* a_scale, const uint8_t* B, const float* b_scale, int64_t M,
                   int64_t N, int64_t K, void* ws, size_t ws_bytes, void* stream) {
  const char* op = "cuda.fp8_gemm_e4m3";
  std::string why;
  MT_CUDA_ARG(fp8_gemm_available(&why), op, why.c_str());
  MT_CUDA_ARG(M >= 16 && N >= 16 && K >= 16 && M % 16 == 0 && N % 16 == 0 && K % 16 == 0, op,
              "needs M, N, K positive multiples of 16 (cuBLASLt FP8)");
  MT_CUDA_ARG(((reinterpret_cast<uintptr_t>(A) | reinterpret_cast<uintptr_t>(B) | reinterpret_cast<uintptr_t>(C)) &
               15) == 0,
              op, "needs 16-byte aligned A, B, C");
#if CUDART_VERSION >= 12000
  // Row-major C [M, N] is column-major C^T [N, M] = B [N, K] · A^T: cuBLASLt's A is our B (stored K x N, op T),
  // its B is our A (stored K x M, op N): the "TN" layout FP8 requires.
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof(tA)));
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof(tB)));
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_scale, sizeof(b_scale)));
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_scale, sizeof(a_scale)));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, uint64_t(K), uint64_t(N), K));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, uint64_t(K), uint64_t(M), K));
  MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, uint64_t(N), uint64_t(M), N));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                       sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  cublasLtHandle_t lt = lt_handle();
  MT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &heur, &found));
  if (found == 0) {
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatmulDescDestroy(desc);
    detail::arg_fail(op, "cuBLASLt has no FP8 algorithm for this shape / workspace on this device");
  }
  const float alpha = 1.0f, beta = 0.0f;
  MT_CUBLAS_CHECK(cublasLtMatmul(lt, desc, &alpha, B, la, A, lb, &beta, C, lc, C, lc, &heur.algo, ws, ws_bytes,
                                 static_cast<cudaStream_t>(stream)));
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatmulDescDestroy(desc);
#else
  (void)C, (void)A, (void)a_scale, (void)B, (void)b_scale, (void)ws, (void)ws_bytes, (void)stream;
#endif
}

}  // namespace moetron::cuda
