// cuda/runtime.h: the CUDA backend's process-level facts: whether this build has it, which devices are usable,
// device selection, streams and event timers. One GPU per process now; a rank under mpirun will later pick
// device (local rank % device_count()) with select_device, and every call below acts on the current device.
// Not the kernels (cuda/ops.h, cuda/gemm.h, ...) and not memory (cuda/memory.h). C++17-clean: .cu files include it.
// Without MOETRON_CUDA only built(), device_count() and usable() exist (src/cuda/backend_stub.cpp).
#pragma once
#include <cstdint>
#include <string>

namespace moetron::cuda {

// True when this binary was built with -DMOETRON_CUDA=ON.
bool built();
// Usable CUDA devices: 0 when the build has no backend, no driver or no GPU, with the reason in *why.
int device_count(std::string* why = nullptr);
// Throws moetron::Error naming `what` (e.g. `training.device = "cuda"`) and the reason when no device is usable.
void require_device(const std::string& what);

struct DeviceInfo {
  std::string name;
  int index = 0, cc_major = 0, cc_minor = 0, sms = 0;
  int64_t mem_bytes = 0, l2_bytes = 0, smem_per_block_optin = 0;
  int runtime_version = 0, driver_version = 0;  // CUDART_VERSION style: 12040 = 12.4
};
DeviceInfo device_info(int dev);
std::string describe(const DeviceInfo& d);  // one line
void select_device(int dev);
int current_device();
void synchronize();  // the whole device

// A CUDA stream (non-blocking with respect to the legacy default stream). handle() is the cudaStream_t.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* handle() const { return s_; }
  void sync() const;

 private:
  void* s_ = nullptr;
};

// Device-side timer: two events on a stream; elapsed_ms() synchronizes on the second one.
class EventTimer {
 public:
  EventTimer();
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start(void* stream);
  void stop(void* stream);
  float elapsed_ms() const;

 private:
  void *a_ = nullptr, *b_ = nullptr;
};

}  // namespace moetron::cuda
