// cuda_util.h: helpers of the op harness's CUDA cases: fresh random host data for this run's seed, device buffers
// filled from host vectors, poisoned (NaN) device outputs, read-back, bf16 rounding, and the fp64 views the
// reference twins take. Test code only; not part of the backend.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "moetron/cuda/memory.h"
#include "moetron/cuda/runtime.h"
#include "moetron/dtype.h"

namespace moetron::ops::cu {

namespace cuda = ::moetron::cuda;

// The dot product of two host vectors in double (the gradient cases' <y, g> = <x, dx> identities).
inline double dotd(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// Fresh inputs: this run's seed mixed with a tag, so every tensor of every case gets its own draw.
inline std::vector<float> rnd(int64_t n, const std::string& tag, float scale = 1.0f) {
  return randn(n, run_seed() ^ (std::hash<std::string>{}(tag) * 0x9e3779b97f4a7c15ull), scale);
}
inline std::vector<float> rnd_u(int64_t n, const std::string& tag, float lo, float hi) {
  return randu(n, run_seed() ^ (std::hash<std::string>{}(tag) * 0x9e3779b97f4a7c15ull), lo, hi);
}
// Cheap filler for the perf cases' large inputs (the values do not matter for timing; randn of 10^8 values would
// take seconds of the device check): a hash of the index, uniform-ish in [-scale, scale].
inline std::vector<float> cheap(int64_t n, float scale = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[size_t(i)] = float(int64_t((uint64_t(i) * 2654435761u >> 7) % 2001) - 1000) * (scale * 1e-3f);
  return v;
}
template <class T>
cuda::DeviceBuffer up(const std::vector<T>& v) {
  cuda::DeviceBuffer d(v.size() * sizeof(T) + 16, MemCategory::Workspace);
  d.upload(v.data(), v.size() * sizeof(T));
  return d;
}
// An output buffer of n elements, filled with NaN (0xFF bytes) so that an element the kernel skips fails.
template <class T>
cuda::DeviceBuffer poisoned(int64_t n) {
  cuda::DeviceBuffer d(size_t(n) * sizeof(T) + 16, MemCategory::Workspace);
  d.poison();
  return d;
}
template <class T>
std::vector<T> down(const cuda::DeviceBuffer& d, int64_t n) {
  cuda::synchronize();
  std::vector<T> v(static_cast<size_t>(n));
  d.download(v.data(), v.size() * sizeof(T));
  return v;
}
inline std::vector<bf16> to_bf(const std::vector<float>& v) {
  std::vector<bf16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = to_bf16(v[i]);
  return o;
}
inline std::vector<double> bf_f64(const std::vector<bf16>& v) {
  std::vector<double> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = from_bf16(v[i]);
  return o;
}
inline std::vector<float> bf_f32(const std::vector<bf16>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = from_bf16(v[i]);
  return o;
}
// Bitwise equality of two float arrays (NaN never equal), recorded as one check.
inline void compare_bitwise(Report& r, const std::string& what, const float* got, const float* want, int64_t n) {
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; ++i)
    if (!(got[i] == want[i])) {
      if (first < 0) first = i;
      ++bad;
    }
  r.check(bad == 0, what + ": bitwise, n=" + std::to_string(n),
          bad ? std::to_string(bad) + " differ, first at " + std::to_string(first) + " (got " +
                    std::to_string(got[first]) + ", want " + std::to_string(want[first]) + ")"
              : std::string());
}
// The perf cases time one call including a device synchronize (the harness reads the host clock).
inline void sync() { cuda::synchronize(); }

}  // namespace moetron::ops::cu
