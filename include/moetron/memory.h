// memory.h: tracked allocation. Every byte moetron allocates for a tensor is charged to a category
// (params, grads, optimizer, activations, comm buffers, workspace). Current and peak bytes per category
// are exact: they count requested bytes, not allocator rounding. The planner's memory projection is
// checked against these figures. Not a general-purpose allocator: no pooling beyond Arena.
#pragma once
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moetron {

enum class MemCategory : uint8_t { Params, Grads, Optimizer, Activations, Comm, Workspace, Other };
inline constexpr int kNumMemCategories = 7;
std::string_view mem_category_name(MemCategory c);

struct MemSnapshot {
  std::array<int64_t, kNumMemCategories> current{};
  std::array<int64_t, kNumMemCategories> peak{};
  int64_t total_current = 0;
  int64_t total_peak = 0;  // peak of the sum (not the sum of peaks)
};

class MemoryTracker {
 public:
  static MemoryTracker& global();
  void on_alloc(MemCategory c, int64_t bytes);
  void on_free(MemCategory c, int64_t bytes);
  int64_t current(MemCategory c) const { return cur_[int(c)].load(std::memory_order_relaxed); }
  int64_t peak(MemCategory c) const { return peak_[int(c)].load(std::memory_order_relaxed); }
  int64_t total_current() const { return total_.load(std::memory_order_relaxed); }
  int64_t total_peak() const { return total_peak_.load(std::memory_order_relaxed); }
  MemSnapshot snapshot() const;
  void reset_peaks();  // peaks restart from the current values

 private:
  std::array<std::atomic<int64_t>, kNumMemCategories> cur_{}, peak_{};
  std::atomic<int64_t> total_{0}, total_peak_{0};
};

inline constexpr size_t kAlignment = 64;

// Aligned, tracked allocation. mt_free must be given the same bytes and category.
void* mt_alloc(size_t bytes, MemCategory c);
void mt_free(void* p, size_t bytes, MemCategory c);

// Bump allocator over one tracked block. Bytes handed out are charged to the arena's category when
// allocated and credited back on release(mark)/reset(). The unused part of the reservation is not
// charged, so category figures equal the bytes that live tensors occupy (alignment padding included).
class Arena {
 public:
  Arena(size_t capacity, MemCategory c);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  void* alloc(size_t bytes, size_t align = kAlignment);  // throws if the arena is full
  size_t mark() const { return used_; }
  void release(size_t mark);  // frees everything allocated after mark
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

}  // namespace moetron
