// rng.cpp: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11),
// keyed by a hash of (seed, stream name).
#include "moetron/rng.h"

#include <cmath>

namespace moetron {

namespace {
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

uint64_t rng_key(uint64_t seed, std::string_view stream) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the stream name
  for (unsigned char c : stream) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return splitmix64(splitmix64(seed) ^ h);
}

std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t ctr_lo, uint64_t ctr_hi) {
  uint32_t c0 = uint32_t(ctr_lo), c1 = uint32_t(ctr_lo >> 32), c2 = uint32_t(ctr_hi), c3 = uint32_t(ctr_hi >> 32);
  uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = uint64_t(kM0) * c0, p1 = uint64_t(kM1) * c2;
    uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0;
    uint32_t n1 = uint32_t(p1);
    uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    uint32_t n3 = uint32_t(p0);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += kW0;
    k1 += kW1;
  }
  return {c0, c1, c2, c3};
}

float rng_uniform(uint64_t key, uint64_t index) {
  return float(philox4x32(key, index)[0] >> 8) * (1.0f / 16777216.0f);
}

float rng_normal(uint64_t key, uint64_t index) {
  auto r = philox4x32(key, index);
  // u1 in (0, 1], u2 in [0, 1); computed in double so the result is the same on every ISA.
  double u1 = (double(r[0]) + 1.0) * (1.0 / 4294967296.0);
  double u2 = double(r[1]) * (1.0 / 4294967296.0);
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

void fill_uniform(float* out, int64_t n, uint64_t key, uint64_t first, float lo, float hi) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = lo + (hi - lo) * rng_uniform(key, first + uint64_t(i));
}

void fill_normal(float* out, int64_t n, uint64_t key, uint64_t first, float mean, float stddev) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = mean + stddev * rng_normal(key, first + uint64_t(i));
}

}  // namespace moetron
