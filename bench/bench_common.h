// bench_common.h: this machine's own limits, measured in the same process as the benchmark that is
// compared with them: a large oneDNN bf16 matmul (compute peak) and a large memcpy (bandwidth).
// Each benchmark reports its figure and the ratio to these, so the ratio survives a noisy machine.
#pragma once
#include <benchmark/benchmark.h>

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

}  // namespace moetron::bench
