// bench_common.cpp: measuring the machine limits, and main() for every benchmark executable
// (prints the limits first, then runs the registered benchmarks with OpenMP threads initialised).
#include "bench_common.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "moetron/gemm.h"
#include "moetron/rng.h"
#include "moetron/runtime.h"

namespace moetron::bench {

namespace {
template <class F>
double best_seconds(F&& f, int reps) {
  f();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}
}  // namespace

const MachineLimits& limits() {
  static const MachineLimits L = [] {
    MachineLimits l;
    const int64_t n = 2048;
    std::vector<float> a(n * n), b(n * n), c(n * n);
    fill_normal(a.data(), n * n, rng_key(1, "peak.a"), 0, 0, 1);
    fill_normal(b.data(), n * n, rng_key(1, "peak.b"), 0, 0, 1);
    std::vector<bf16> ab(n * n), bb(n * n);
    f32_to_bf16(ab.data(), a.data(), n * n);
    f32_to_bf16(bb.data(), b.data(), n * n);
    double flops = 2.0 * n * n * n;
    l.bf16_gflops = flops / best_seconds([&] {
      gemm_bf16(Trans::N, Trans::N, n, n, n, 1.0f, ab.data(), n, bb.data(), n, 0.0f, c.data(), n);
    }, 5) * 1e-9;
    l.f32_gflops = flops / best_seconds([&] {
      gemm_f32(Trans::N, Trans::N, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    }, 3) * 1e-9;
    const size_t bytes = size_t(256) << 20;
    std::vector<char> src(bytes, 1), dst(bytes, 0);
    l.memcpy_gbs = 2.0 * double(bytes) / best_seconds([&] { std::memcpy(dst.data(), src.data(), bytes); }, 5) * 1e-9;
    return l;
  }();
  return L;
}

void report_flops(benchmark::State& st, double flops_per_iter) {
  double total = flops_per_iter * double(st.iterations());
  st.counters["GFLOPS"] = benchmark::Counter(total * 1e-9, benchmark::Counter::kIsRate);
  // A rate counter divides by elapsed time, so this is achieved GFLOPS / peak GFLOPS in percent.
  st.counters["pct_bf16_peak"] = benchmark::Counter(total * 1e-9 / limits().bf16_gflops * 100.0,
                                                    benchmark::Counter::kIsRate);
}

void report_bytes(benchmark::State& st, double bytes_per_iter) {
  double total = bytes_per_iter * double(st.iterations());
  st.counters["GBps"] = benchmark::Counter(total * 1e-9, benchmark::Counter::kIsRate);
  st.counters["pct_memcpy"] = benchmark::Counter(total * 1e-9 / limits().memcpy_gbs * 100.0,
                                                 benchmark::Counter::kIsRate);
}

}  // namespace moetron::bench

int main(int argc, char** argv) {
  moetron::init_threads();
  const auto& L = moetron::bench::limits();
  std::printf("machine limits (%s): bf16 matmul %.1f GFLOPS, f32 sgemm %.1f GFLOPS, memcpy %.2f GB/s\n",
              moetron::runtime_summary().c_str(), L.bf16_gflops, L.f32_gflops, L.memcpy_gbs);
  benchmark::AddCustomContext("bf16_peak_gflops", std::to_string(L.bf16_gflops));
  benchmark::AddCustomContext("memcpy_gbs", std::to_string(L.memcpy_gbs));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
