// memory.cpp: aligned tracked allocation and the bump arena (the tracker itself: memory_tracker.cpp).
#include "moetron/memory.h"

#include <cstdlib>
#include <new>

#include "moetron/check.h"

namespace moetron {

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
