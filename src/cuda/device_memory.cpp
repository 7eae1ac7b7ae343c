// device_memory.cpp: device memory with the engine's accounting (cuda/memory.h): the device tracker, tracked
// cudaMalloc/cudaFree, copies and fills, DeviceBuffer and DeviceArena. Host code (CUDA runtime API only).
// Not a caching allocator: every DeviceBuffer is one cudaMalloc.
#include "moetron/cuda/memory.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "cuda_common.cuh"
#include "moetron/check.h"

namespace moetron::cuda {

DeviceMemoryTracker& DeviceMemoryTracker::global() {
  static DeviceMemoryTracker t;
  return t;
}
void* device_alloc(size_t bytes, MemCategory c) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    MT_FAIL("cuda", "cudaMalloc of ", bytes, " bytes (", mem_category_name(c), ") failed: ", cudaGetErrorName(e),
            "; device has ", free_b, " of ", total_b, " bytes free");
  }
  DeviceMemoryTracker::global().on_alloc(c, int64_t(bytes));
  return p;
}
void device_free(void* p, size_t bytes, MemCategory c) {
  if (!p) return;
  MT_CUDA_CHECK(cudaFree(p));
  DeviceMemoryTracker::global().on_free(c, int64_t(bytes));
}

static void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, void* stream) {
  if (bytes == 0) return;
  if (stream) {
    MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, static_cast<cudaStream_t>(stream)));
  } else {
    MT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, kind));
  }
}
void copy_h2d(void* dst, const void* src, size_t bytes, void* stream) { copy(dst, src, bytes, cudaMemcpyHostToDevice, stream); }
void copy_d2h(void* dst, const void* src, size_t bytes, void* stream) { copy(dst, src, bytes, cudaMemcpyDeviceToHost, stream); }
void copy_d2d(void* dst, const void* src, size_t bytes, void* stream) { copy(dst, src, bytes, cudaMemcpyDeviceToDevice, stream); }
void fill_bytes(void* dst, int byte, size_t bytes, void* stream) {
  if (bytes == 0) return;
  if (stream) {
    MT_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, static_cast<cudaStream_t>(stream)));
  } else {
    MT_CUDA_CHECK(cudaMemset(dst, byte, bytes));
    MT_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

DeviceBuffer::DeviceBuffer(size_t bytes, MemCategory c) : p_(device_alloc(bytes, c)), bytes_(bytes), cat_(c) {}
DeviceBuffer::~DeviceBuffer() {
  if (p_) {
    (void)cudaFree(p_);  // no throw from a destructor
    DeviceMemoryTracker::global().on_free(cat_, int64_t(bytes_));
  }
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), cat_(o.cat_) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    this->~DeviceBuffer();
    p_ = std::exchange(o.p_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    cat_ = o.cat_;
  }
  return *this;
}
void DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  MT_CHECK(offset + bytes <= bytes_, "DeviceBuffer::upload", offset + bytes, " bytes into a buffer of ", bytes_);
  copy_h2d(static_cast<char*>(p_) + offset, host, bytes);
}
void DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  MT_CHECK(offset + bytes <= bytes_, "DeviceBuffer::download", offset + bytes, " bytes from a buffer of ", bytes_);
  copy_d2h(host, static_cast<const char*>(p_) + offset, bytes);
}

DeviceArena::DeviceArena(size_t capacity, MemCategory c) : capacity_(capacity), cat_(c) {
  if (capacity_ == 0) return;
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, capacity_);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    MT_FAIL("DeviceArena", "cudaMalloc of ", capacity_, " bytes failed: ", cudaGetErrorName(e));
  }
  base_ = static_cast<char*>(p);
}
DeviceArena::~DeviceArena() {
  if (charged_) DeviceMemoryTracker::global().on_free(cat_, int64_t(charged_));
  if (base_) (void)cudaFree(base_);
}
void* DeviceArena::alloc(size_t bytes, size_t align) {
  MT_CHECK(align > 0 && (align & (align - 1)) == 0, "DeviceArena", "alignment ", align, " is not a power of two");
  size_t start = (used_ + align - 1) / align * align;
  MT_CHECK(start + bytes <= capacity_, "DeviceArena", "out of space: ", bytes, " bytes requested, ", capacity_ - used_,
           " of ", capacity_, " left (", mem_category_name(cat_), ")");
  used_ = start + bytes;
  peak_used_ = std::max(peak_used_, used_);
  DeviceMemoryTracker::global().on_alloc(cat_, int64_t(used_ - charged_));
  charged_ = used_;
  return base_ + start;
}
void DeviceArena::release(size_t mark) {
  MT_CHECK(mark <= used_, "DeviceArena", "release to ", mark, " above the used ", used_, " bytes");
  DeviceMemoryTracker::global().on_free(cat_, int64_t(charged_ - mark));
  used_ = charged_ = mark;
}

}  // namespace moetron::cuda
