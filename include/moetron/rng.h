// rng.h: counter-based random numbers (Philox4x32-10). A value is a pure function of
// (seed, stream name, element index), so a parameter's initial values are identical however the model
// is later sharded: a shard fills its slice by asking for the global indices it owns.
// Not a stateful generator: there is nothing to save except the seed and the position you were at.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

namespace moetron {

// 64-bit key from a seed and a stream name (e.g. the tensor's name).
uint64_t rng_key(uint64_t seed, std::string_view stream);

// Philox4x32-10 on counter (ctr_lo, ctr_hi) with a 64-bit key.
std::array<uint32_t, 4> philox4x32(uint64_t key, uint64_t ctr_lo, uint64_t ctr_hi = 0);

// Uniform in [0, 1) with 24 random bits, and a standard normal (Box-Muller), for element `index`.
float rng_uniform(uint64_t key, uint64_t index);
float rng_normal(uint64_t key, uint64_t index);

// Fill out[i] for global indices first .. first+n-1.
void fill_uniform(float* out, int64_t n, uint64_t key, uint64_t first, float lo, float hi);
void fill_normal(float* out, int64_t n, uint64_t key, uint64_t first, float mean, float stddev);

}  // namespace moetron
