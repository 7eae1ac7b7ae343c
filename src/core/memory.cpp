// memory.cpp: the global memory tracker, aligned tracked allocation and the bump arena.
#include "moetron/memory.h"

#include <cstdlib>
#include <new>

#include "moetron/check.h"

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

void* mt_alloc(size_t bytes, MemCategory c) {
  if (bytes == 0) return nullptr;
  size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  MT_CHECK(p != nullptr, "mt_alloc", "out of memory allocating ", bytes, " bytes for ", mem_category_name(c));
  MemoryTracker::global().on_alloc(c, int64_t(bytes));
  return p;
}

void mt_free(void* p, size_t bytes, MemCategory c) {
  if (!p) return;
  std::free(p);
  MemoryTracker::global().on_free(c, int64_t(bytes));
}

Arena::Arena(size_t capacity, MemCategory c) : capacity_(capacity), cat_(c) {
  if (capacity_ > 0) {
    size_t rounded = (capacity_ + kAlignment - 1) / kAlignment * kAlignment;
    base_ = static_cast<char*>(std::aligned_alloc(kAlignment, rounded));
    MT_CHECK(base_ != nullptr, "Arena", "out of memory reserving ", capacity_, " bytes");
  }
}

Arena::~Arena() {
  if (charged_) MemoryTracker::global().on_free(cat_, int64_t(charged_));
  std::free(base_);
}

void* Arena::alloc(size_t bytes, size_t align) {
  size_t start = (used_ + align - 1) / align * align;
  MT_CHECK(start + bytes <= capacity_, "Arena", "arena for ", mem_category_name(cat_), " is full: need ", bytes,
           " bytes at offset ", start, ", capacity ", capacity_);
  size_t new_used = start + bytes;
  MemoryTracker::global().on_alloc(cat_, int64_t(new_used - used_));
  charged_ += new_used - used_;
  used_ = new_used;
  if (used_ > peak_used_) peak_used_ = used_;
  return base_ + start;
}

void Arena::release(size_t mark) {
  MT_CHECK(mark <= used_, "Arena", "release mark ", mark, " beyond used ", used_);
  MemoryTracker::global().on_free(cat_, int64_t(used_ - mark));
  charged_ -= used_ - mark;
  used_ = mark;
}

}  // namespace moetron
