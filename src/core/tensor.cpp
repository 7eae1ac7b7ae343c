// tensor.cpp: Storage and Tensor views.
#include "moetron/tensor.h"

#include <cstring>
#include <sstream>

namespace moetron {

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

Storage::Storage(size_t bytes, MemCategory c) : bytes_(bytes), cat_(c) { ptr_ = mt_alloc(bytes, c); }
Storage::Storage(void* external, size_t bytes) : ptr_(external), bytes_(bytes), owned_(false) {}
Storage::~Storage() {
  if (owned_) mt_free(ptr_, bytes_, cat_);
}

static Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (int64_t i = int64_t(s.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

static void check_shape(const Shape& s, const char* op) {
  for (auto d : s) MT_CHECK(d >= 0, op, "negative dimension in shape ", shape_str(s));
}

Tensor Tensor::empty(const Shape& shape, DType dt, MemCategory c, std::string name) {
  check_shape(shape, "Tensor::empty");
  Tensor t;
  t.storage_ = std::make_shared<Storage>(size_t(shape_numel(shape)) * dtype_size(dt), c);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dt;
  t.name_ = std::move(name);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dt, MemCategory c, std::string name) {
  Tensor t = empty(shape, dt, c, std::move(name));
  if (t.storage_->data()) std::memset(t.storage_->data(), 0, t.storage_->bytes());
  return t;
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dt, std::string name) {
  check_shape(shape, "Tensor::wrap");
  Tensor t;
  t.storage_ = std::make_shared<Storage>(data, size_t(shape_numel(shape)) * dtype_size(dt));
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dt;
  t.name_ = std::move(name);
  return t;
}

int64_t Tensor::size(int64_t d) const {
  if (d < 0) d += dim();
  MT_CHECK(d >= 0 && d < dim(), "Tensor::size", "dimension ", d, " out of range for shape ", shape_str(shape_));
  return shape_[d];
}

bool Tensor::is_contiguous() const { return strides_ == contiguous_strides(shape_); }

void* Tensor::raw() const {
  MT_CHECK(storage_ != nullptr, "Tensor::raw", "tensor '", name_, "' is undefined");
  return static_cast<char*>(storage_->data()) + offset_ * int64_t(dtype_size(dtype_));
}

Tensor Tensor::view(const Shape& new_shape) const {
  MT_CHECK(is_contiguous(), "Tensor::view", "tensor '", name_, "' with shape ", shape_str(shape_),
           " is not contiguous");
  Shape s = new_shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      MT_CHECK(infer < 0, "Tensor::view", "more than one -1 in ", shape_str(new_shape));
      infer = int64_t(i);
    } else {
      MT_CHECK(s[i] >= 0, "Tensor::view", "bad dimension in ", shape_str(new_shape));
      known *= s[i];
    }
  }
  if (infer >= 0) {
    MT_CHECK(known > 0 && numel() % known == 0, "Tensor::view", "cannot infer -1 viewing ", shape_str(shape_),
             " as ", shape_str(new_shape));
    s[infer] = numel() / known;
  }
  MT_CHECK(shape_numel(s) == numel(), "Tensor::view", "cannot view ", shape_str(shape_), " (", numel(),
           " elements) as ", shape_str(new_shape));
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end) const {
  if (d < 0) d += dim();
  MT_CHECK(d >= 0 && d < dim(), "Tensor::slice", "dimension ", d, " out of range for ", shape_str(shape_));
  MT_CHECK(0 <= start && start <= end && end <= shape_[d], "Tensor::slice", "range [", start, ", ", end,
           ") out of bounds for dimension ", d, " of ", shape_str(shape_));
  Tensor t = *this;
  t.offset_ += start * strides_[d];
  t.shape_[d] = end - start;
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  if (d < 0) d += dim();
  MT_CHECK(d >= 0 && d < dim(), "Tensor::select", "dimension ", d, " out of range for ", shape_str(shape_));
  MT_CHECK(index >= 0 && index < shape_[d], "Tensor::select", "index ", index, " out of bounds for dimension ",
           d, " of ", shape_str(shape_));
  Tensor t = *this;
  t.offset_ += index * strides_[d];
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::transpose(int64_t a, int64_t b) const {
  if (a < 0) a += dim();
  if (b < 0) b += dim();
  MT_CHECK(a >= 0 && a < dim() && b >= 0 && b < dim(), "Tensor::transpose", "dims ", a, ", ", b,
           " out of range for ", shape_str(shape_));
  Tensor t = *this;
  std::swap(t.shape_[a], t.shape_[b]);
  std::swap(t.strides_[a], t.strides_[b]);
  return t;
}

namespace {
// Calls f(dst_offset, src_offset) for every element, in row-major order of the shape.
template <class F>
void for_each_index(const Shape& shape, const Shape& s1, const Shape& s2, F&& f) {
  int64_t n = shape_numel(shape);
  if (n == 0) return;
  std::vector<int64_t> idx(shape.size(), 0);
  int64_t o1 = 0, o2 = 0;
  for (int64_t k = 0; k < n; ++k) {
    f(o1, o2);
    for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        o1 += s1[d];
        o2 += s2[d];
        break;
      }
      o1 -= s1[d] * (shape[d] - 1);
      o2 -= s2[d] * (shape[d] - 1);
      idx[d] = 0;
    }
  }
}
}  // namespace

void Tensor::copy_from(const Tensor& src) {
  MT_CHECK(shape_ == src.shape_, "Tensor::copy_from", "shape ", shape_str(src.shape_), " into ", shape_str(shape_));
  MT_CHECK(dtype_ == src.dtype_, "Tensor::copy_from", "dtype ", dtype_name(src.dtype_), " into ",
           dtype_name(dtype_));
  size_t es = dtype_size(dtype_);
  if (is_contiguous() && src.is_contiguous()) {
    std::memmove(raw(), src.raw(), nbytes());
    return;
  }
  char* d = static_cast<char*>(raw());
  const char* s = static_cast<const char*>(src.raw());
  for_each_index(shape_, strides_, src.strides_,
                 [&](int64_t od, int64_t os) { std::memcpy(d + od * int64_t(es), s + os * int64_t(es), es); });
}

Tensor Tensor::contiguous(MemCategory c) const {
  if (is_contiguous()) return *this;
  Tensor t = empty(shape_, dtype_, c, name_);
  t.copy_from(*this);
  return t;
}

void Tensor::zero_() {
  if (is_contiguous()) {
    std::memset(raw(), 0, nbytes());
    return;
  }
  size_t es = dtype_size(dtype_);
  char* d = static_cast<char*>(raw());
  for_each_index(shape_, strides_, strides_, [&](int64_t od, int64_t) { std::memset(d + od * int64_t(es), 0, es); });
}

float Tensor::get(std::initializer_list<int64_t> idx) const {
  MT_CHECK(int64_t(idx.size()) == dim(), "Tensor::get", "got ", idx.size(), " indices for shape ", shape_str(shape_));
  int64_t off = 0, d = 0;
  for (auto i : idx) {
    MT_CHECK(i >= 0 && i < shape_[d], "Tensor::get", "index ", i, " out of bounds for dim ", d, " of ",
             shape_str(shape_));
    off += i * strides_[d++];
  }
  const char* base = static_cast<const char*>(raw());
  switch (dtype_) {
    case DType::F32: return reinterpret_cast<const float*>(base)[off];
    case DType::BF16: return from_bf16(reinterpret_cast<const bf16*>(base)[off]);
    case DType::F8E4M3: return e4m3_bits_to_float(reinterpret_cast<const uint8_t*>(base)[off]);
    case DType::F8E5M2: return e5m2_bits_to_float(reinterpret_cast<const uint8_t*>(base)[off]);
    case DType::I32: return float(reinterpret_cast<const int32_t*>(base)[off]);
    case DType::I64: return float(reinterpret_cast<const int64_t*>(base)[off]);
    case DType::U8: return float(reinterpret_cast<const uint8_t*>(base)[off]);
  }
  return 0.0f;
}

}  // namespace moetron
