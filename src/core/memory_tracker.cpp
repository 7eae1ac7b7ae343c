// memory_tracker.cpp: the category names and MemoryTracker (exact current and peak bytes per category, and of the
// total), in moetron_base so that the CPU engine's tracker and the CUDA backend's device tracker
// (include/moetron/cuda/memory.h) are one implementation. Not the allocators (memory.cpp, src/cuda).
#include <atomic>

#include "moetron/check.h"
#include "moetron/memory.h"

namespace moetron {

std::string_view mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::Params: return "params";
    case MemCategory::Grads: return "grads";
    case MemCategory::Optimizer: return "optimizer";
    case MemCategory::Activations: return "activations";
    case MemCategory::Comm: return "comm";
    case MemCategory::Workspace: return "workspace";
    case MemCategory::Other: return "other";
  }
  return "?";
}

MemoryTracker& MemoryTracker::global() {
  static MemoryTracker t;
  return t;
}

static void atomic_max(std::atomic<int64_t>& a, int64_t v) {
  int64_t prev = a.load(std::memory_order_relaxed);
  while (prev < v && !a.compare_exchange_weak(prev, v, std::memory_order_relaxed)) {
  }
}

void MemoryTracker::on_alloc(MemCategory c, int64_t bytes) {
  int64_t now = cur_[int(c)].fetch_add(bytes, std::memory_order_relaxed) + bytes;
  atomic_max(peak_[int(c)], now);
  int64_t tot = total_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  atomic_max(total_peak_, tot);
}

void MemoryTracker::on_free(MemCategory c, int64_t bytes) {
  int64_t now = cur_[int(c)].fetch_sub(bytes, std::memory_order_relaxed) - bytes;
  MT_CHECK(now >= 0, "memory", "category ", mem_category_name(c), " went negative: ", now);
  total_.fetch_sub(bytes, std::memory_order_relaxed);
}

MemSnapshot MemoryTracker::snapshot() const {
  MemSnapshot s;
  for (int i = 0; i < kNumMemCategories; ++i) {
    s.current[i] = cur_[i].load();
    s.peak[i] = peak_[i].load();
  }
  s.total_current = total_.load();
  s.total_peak = total_peak_.load();
  return s;
}

void MemoryTracker::reset_peaks() {
  for (int i = 0; i < kNumMemCategories; ++i) peak_[i].store(cur_[i].load());
  total_peak_.store(total_.load());
}

}  // namespace moetron
