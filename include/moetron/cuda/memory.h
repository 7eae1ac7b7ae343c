// cuda/memory.h: device memory with the CPU engine's accounting (memory.h): every byte cudaMalloc'ed for the
// engine is charged to a MemCategory (params, grads, optimizer, activations, comm, workspace, other) in a
// device-wide tracker with exact current and peak bytes per category; DeviceBuffer owns one allocation;
// DeviceArena is the bump allocator of memory.h's Arena on one device block (same charge-on-alloc rule).
// Plain cudaMalloc, never managed memory. Copies and fills take an optional stream (nullptr: the legacy default
// stream, and the call waits for the copy). Not a caching allocator. C++17-clean.
#pragma once
#include <cstddef>
#include <cstdint>

#include "moetron/memory.h"

namespace moetron::cuda {

// The device-wide tracker: MemoryTracker's implementation (memory.h), a second instance for device bytes.
class DeviceMemoryTracker : public MemoryTracker {
 public:
  static DeviceMemoryTracker& global();
};

inline constexpr size_t kDeviceAlignment = 256;

void* device_alloc(size_t bytes, MemCategory c);  // tracked cudaMalloc; throws naming the bytes on failure
void device_free(void* p, size_t bytes, MemCategory c);
void copy_h2d(void* dst, const void* src, size_t bytes, void* stream = nullptr);
void copy_d2h(void* dst, const void* src, size_t bytes, void* stream = nullptr);
void copy_d2d(void* dst, const void* src, size_t bytes, void* stream = nullptr);
void fill_bytes(void* dst, int byte, size_t bytes, void* stream = nullptr);
// Poison: 0xFF bytes, a NaN in fp32 and bf16 and -1 in integers; tests fill outputs with it before a call.
inline void poison(void* dst, size_t bytes, void* stream = nullptr) { fill_bytes(dst, 0xFF, bytes, stream); }

// One owned, tracked device allocation. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, MemCategory c);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() const { return p_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return cat_; }
  void upload(const void* host, size_t bytes, size_t offset = 0);
  void download(void* host, size_t bytes, size_t offset = 0) const;
  void poison() { cuda::poison(p_, bytes_); }
  void zero() { fill_bytes(p_, 0, bytes_); }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
  MemCategory cat_ = MemCategory::Other;
};

// Bump allocator over one device block: Arena's contract (memory.h) on the device. Bytes handed out are charged
// to the arena's category when allocated and credited back on release(mark)/reset(); the unused reservation is
// not charged. Throws when full.
class DeviceArena {
 public:
  DeviceArena(size_t capacity, MemCategory c);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  void* alloc(size_t bytes, size_t align = kDeviceAlignment);
  size_t mark() const { return used_; }
  void release(size_t mark);
  void reset() { release(0); }
  size_t used() const { return used_; }
  size_t peak_used() const { return peak_used_; }
  size_t capacity() const { return capacity_; }
  MemCategory category() const { return cat_; }

 private:
  char* base_ = nullptr;
  size_t capacity_ = 0, used_ = 0, peak_used_ = 0, charged_ = 0;
  MemCategory cat_;
};

}  // namespace moetron::cuda
