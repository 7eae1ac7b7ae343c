// backend_stub.cpp: the CUDA backend's probe in a build without it (MOETRON_CUDA=OFF): built() is false, no
// device is usable and require_device refuses by name. Not compiled when the backend is built (src/cuda/device.cpp).
#include "moetron/check.h"
#include "moetron/cuda/runtime.h"

namespace moetron::cuda {

static const char* kNoBackend = "this build has no CUDA backend (configure with -DMOETRON_CUDA=ON, see docs/gpu.md)";

bool built() { return false; }
int device_count(std::string* why) {
  if (why) *why = kNoBackend;
  return 0;
}
void require_device(const std::string& what) { MT_FAIL("cuda", what, ": ", kNoBackend); }

}  // namespace moetron::cuda
