// bench_common.h: this machine's own limits, measured in the same process as the benchmark that is
// compared with them: a large oneDNN bf16 matmul (compute peak) and a large memcpy (bandwidth).
// Each benchmark reports its figure and the ratio to these, so the ratio survives a noisy machine. Also the
// small helpers several benchmarks share: an ISA override for one benchmark's scope and seeded random inputs.
#pragma once
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "moetron/rng.h"
#include "moetron/runtime.h"

namespace moetron::bench {

struct MachineLimits {
  double bf16_gflops = 0;  // best of several 2048^3 bf16 matmuls (fp32 accumulate)
  double f32_gflops = 0;   // same with fp32 sgemm
  double memcpy_gbs = 0;   // bytes read + written per second, 256 MiB copy
};
const MachineLimits& limits();  // measured once, on first use

// Sets GFLOPS and pct_of_bf16_peak (or GB/s and pct_of_memcpy) counters from per-iteration work.
void report_flops(benchmark::State& st, double flops_per_iter);
void report_bytes(benchmark::State& st, double bytes_per_iter);

// The kernels' ISA set for one benchmark's scope (set_isa_override, clamped to the CPU), restored after it.
struct IsaScope {
  explicit IsaScope(int64_t isa) : saved(active_isa()) { set_isa_override(Isa(isa)); }
  ~IsaScope() { set_isa_override(saved); }
  Isa saved;
};

// n normal values of standard deviation sd keyed by (seed, name): the same inputs in every run.
inline std::vector<float> normal_vec(int64_t n, uint64_t seed, const char* name, float sd = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  fill_normal(v.data(), n, rng_key(seed, name), 0, 0.0f, sd);
  return v;
}

}  // namespace moetron::bench
