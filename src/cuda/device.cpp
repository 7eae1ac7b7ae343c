// device.cpp: the CUDA backend's process-level facts (cuda/runtime.h): device probe and selection, device info,
// streams and event timers, through the CUDA runtime API. Host code only (no kernels). Not memory (device_memory.cpp).
#include "moetron/cuda/runtime.h"

#include <cuda_runtime.h>

#include <sstream>

#include "cuda_common.cuh"
#include "moetron/check.h"

namespace moetron::cuda {

bool built() { return true; }

int device_count(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so later calls start clean
    if (why) *why = std::string("no usable CUDA device: cudaGetDeviceCount: ") + cudaGetErrorName(e) + ": " +
                    cudaGetErrorString(e);
    return 0;
  }
  if (n == 0 && why) *why = "no usable CUDA device: cudaGetDeviceCount found 0 devices";
  return n;
}

void require_device(const std::string& what) {
  std::string why;
  if (device_count(&why) == 0) MT_FAIL("cuda", what, ": ", why);
}

DeviceInfo device_info(int dev) {
  cudaDeviceProp p{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  DeviceInfo d;
  d.name = p.name;
  d.index = dev;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.sms = p.multiProcessorCount;
  d.mem_bytes = int64_t(p.totalGlobalMem);
  d.l2_bytes = int64_t(p.l2CacheSize);
  d.smem_per_block_optin = int64_t(p.sharedMemPerBlockOptin);
  MT_CUDA_CHECK(cudaRuntimeGetVersion(&d.runtime_version));
  MT_CUDA_CHECK(cudaDriverGetVersion(&d.driver_version));
  return d;
}

std::string describe(const DeviceInfo& d) {
  std::ostringstream os;
  os << "cuda:" << d.index << " " << d.name << " sm_" << d.cc_major << d.cc_minor << ", " << d.sms << " SMs, "
     << (d.mem_bytes >> 20) << " MiB, L2 " << (d.l2_bytes >> 20) << " MiB, runtime " << d.runtime_version / 1000 << "."
     << (d.runtime_version % 1000) / 10 << ", driver " << d.driver_version / 1000 << "."
     << (d.driver_version % 1000) / 10;
  return os.str();
}

void select_device(int dev) { MT_CUDA_CHECK(cudaSetDevice(dev)); }
int current_device() {
  int d = 0;
  MT_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}
void synchronize() { MT_CUDA_CHECK(cudaDeviceSynchronize()); }

Stream::Stream() {
  cudaStream_t s = nullptr;
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  s_ = s;
}
Stream::~Stream() {
  if (s_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(s_));
}
void Stream::sync() const { MT_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(s_))); }

EventTimer::EventTimer() {
  cudaEvent_t a = nullptr, b = nullptr;
  MT_CUDA_CHECK(cudaEventCreate(&a));
  MT_CUDA_CHECK(cudaEventCreate(&b));
  a_ = a;
  b_ = b;
}
EventTimer::~EventTimer() {
  if (a_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(a_));
  if (b_) (void)cudaEventDestroy(static_cast<cudaEvent_t>(b_));
}
void EventTimer::start(void* stream) { MT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(a_), static_cast<cudaStream_t>(stream))); }
void EventTimer::stop(void* stream) { MT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(b_), static_cast<cudaStream_t>(stream))); }
float EventTimer::elapsed_ms() const {
  MT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(b_)));
  float ms = 0;
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(a_), static_cast<cudaEvent_t>(b_)));
  return ms;
}

}  // namespace moetron::cuda
