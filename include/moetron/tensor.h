// tensor.h: a strided view over tracked storage. Shape, strides (in elements), dtype and an offset.
// Views (reshape, slice, transpose, select) share storage. Not an autograd tensor: kernels take raw
// pointers and sizes; Tensor is the owning and bookkeeping type around them.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/dtype.h"
#include "moetron/memory.h"

namespace moetron {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

class Storage {
 public:
  Storage(size_t bytes, MemCategory c);
  Storage(void* external, size_t bytes);  // not owned, not tracked
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return cat_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  MemCategory cat_ = MemCategory::Other;
  bool owned_ = true;
};

class Tensor {
 public:
  Tensor() = default;
  // Allocates a zero-filled contiguous tensor charged to category c.
  static Tensor zeros(const Shape& shape, DType dt, MemCategory c, std::string name = {});
  static Tensor empty(const Shape& shape, DType dt, MemCategory c, std::string name = {});
  // Wraps memory owned elsewhere (e.g. an Arena). Not tracked by this tensor.
  static Tensor wrap(void* data, const Shape& shape, DType dt, std::string name = {});

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return int64_t(shape_.size()); }
  int64_t size(int64_t d) const;
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  const std::string& name() const { return name_; }
  void set_name(std::string n) { name_ = std::move(n); }
  bool is_contiguous() const;

  void* raw() const;
  template <class T>
  T* data() const {
    MT_CHECK(dtype_of<T>() == dtype_, "Tensor::data", "tensor '", name_, "' has dtype ", dtype_name(dtype_),
             ", requested ", dtype_name(dtype_of<T>()));
    return static_cast<T*>(raw());
  }

  // Views.
  Tensor view(const Shape& new_shape) const;             // requires contiguity; one dim may be -1
  Tensor slice(int64_t d, int64_t start, int64_t end) const;  // [start, end) along d
  Tensor select(int64_t d, int64_t index) const;         // drops dimension d
  Tensor transpose(int64_t a, int64_t b) const;
  Tensor contiguous(MemCategory c = MemCategory::Workspace) const;  // copy if not contiguous
  void copy_from(const Tensor& src);                     // same shape and dtype; any strides
  void zero_();

  // Element access for tests and slow paths (f32 / bf16 / fp8 read as float).
  float get(std::initializer_list<int64_t> idx) const;
  int64_t offset() const { return offset_; }

 private:
  std::shared_ptr<Storage> storage_;
  Shape shape_, strides_;
  int64_t offset_ = 0;
  DType dtype_ = DType::F32;
  std::string name_;
};

}  // namespace moetron
