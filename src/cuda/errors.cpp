// errors.cpp: the CUDA backend's failure reports as moetron::Error: the failing call with its file:line, the
// CUDA or cuBLAS status by name; argument checks of the launchers; the launch check (and MOETRON_CUDA_SYNC=1).
// Host C++20 (uses check.h); the .cu files reach it through src/cuda/cuda_common.cuh. Not a logger.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "cuda_common.cuh"
#include "moetron/check.h"

namespace moetron::cuda::detail {

static const char* cublas_status_name(int s) {
  switch (s) {
    case 1: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case 3: return "CUBLAS_STATUS_ALLOC_FAILED";
    case 7: return "CUBLAS_STATUS_INVALID_VALUE";
    case 8: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case 11: return "CUBLAS_STATUS_MAPPING_ERROR";
    case 13: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case 14: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case 15: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case 16: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_?";
  }
}

void cuda_fail(const char* file, int line, const char* call, int code, const char* name, const char* msg) {
  ::moetron::detail::check_fail(file, line, "cuda", "", call, " failed: ", name, " (", code, "): ", msg);
}
void cublas_fail(const char* file, int line, const char* call, int status) {
  ::moetron::detail::check_fail(file, line, "cublas", "", call, " failed: ", cublas_status_name(status), " (", status,
                                ")");
}
void arg_fail(const char* op, const char* msg) { MT_FAIL(op, msg); }

static bool sync_after_launch() {
  static const bool on = [] {
    const char* v = std::getenv("MOETRON_CUDA_SYNC");
    return v && std::strcmp(v, "0") != 0 && *v;
  }();
  return on;
}
void launched(const char* file, int line, const char* kernel) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && sync_after_launch()) e = cudaDeviceSynchronize();
  if (e != cudaSuccess)
    ::moetron::detail::check_fail(file, line, "cuda", "", "kernel ", kernel, " failed: ", cudaGetErrorName(e), " (",
                                  int(e), "): ", cudaGetErrorString(e));
}

}  // namespace moetron::cuda::detail
