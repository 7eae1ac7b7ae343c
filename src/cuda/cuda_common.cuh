// cuda_common.cuh: what every .cu file of the backend shares: the checks that name the failing CUDA or cuBLAS
// call (they throw moetron::Error through src/cuda/errors.cpp), the launch check, bf16 conversions and small
// warp reductions. C++17 (nvcc 11.8): no moetron header that needs C++20 is included here.
// Not a public header: host C++ code uses include/moetron/cuda/*.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moetron::cuda::detail {
[[noreturn]] void cuda_fail(const char* file, int line, const char* call, int code, const char* name, const char* msg);
[[noreturn]] void cublas_fail(const char* file, int line, const char* call, int status);
[[noreturn]] void arg_fail(const char* op, const char* msg);
// After a launch: cudaGetLastError, and with MOETRON_CUDA_SYNC=1 a device synchronize, so an asynchronous fault
// is reported at the kernel that caused it. `kernel` names it in the error.
void launched(const char* file, int line, const char* kernel);
inline int blocks_for(int64_t n, int threads) { return int((n + threads - 1) / threads); }
// Opts `kernel` in to `bytes` of dynamic shared memory per block, refusing (naming `op`) what the current device
// cannot give (cudaDevAttrMaxSharedMemoryPerBlockOptin).
void smem_optin(const void* kernel, size_t bytes, const char* op);
}  // namespace moetron::cuda::detail

#define MT_CUDA_CHECK(call)                                                                                   \
  do {                                                                                                        \
    cudaError_t mt_e_ = (call);                                                                               \
    if (mt_e_ != cudaSuccess)                                                                                 \
      ::moetron::cuda::detail::cuda_fail(__FILE__, __LINE__, #call, int(mt_e_), cudaGetErrorName(mt_e_),      \
                                         cudaGetErrorString(mt_e_));                                          \
  } while (0)
#define MT_CUBLAS_CHECK(call)                                                                                 \
  do {                                                                                                        \
    int mt_s_ = int(call);                                                                                    \
    if (mt_s_ != 0) ::moetron::cuda::detail::cublas_fail(__FILE__, __LINE__, #call, mt_s_);                   \
  } while (0)
#define MT_CUDA_LAUNCHED(kernel) ::moetron::cuda::detail::launched(__FILE__, __LINE__, kernel)
#define MT_CUDA_ARG(cond, op, msg)                          \
  do {                                                      \
    if (!(cond)) ::moetron::cuda::detail::arg_fail(op, msg); \
  } while (0)

#ifdef __CUDACC__
namespace moetron::cuda::dev {
__device__ __forceinline__ float bf(const __nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 to_bf(float v) { return __float2bfloat16_rn(v); }
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets the result.
// The order is fixed by the block size, so the result is the same on every run.
template <class T>
__device__ T block_sum(T v, T* smem /* [32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  T r = lane < nw ? smem[lane] : T(0);
  r = warp_sum(r);
  return r;
}
}  // namespace moetron::cuda::dev
#endif  // __CUDACC__
