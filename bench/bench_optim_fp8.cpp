// bench_optim_fp8.cpp: the bandwidth-bound kernels: AdamW step, gradient norm, FP8 quantize /
// dequantize / fake quant, each as GB/s with the percentage of the memcpy bandwidth measured in the
// same process (bench_common). Bytes are the logical traffic: every array read or written once.
// Tensor scaling reads x twice (amax pass, then encode) but is counted once, like the others.
#include <omp.h>

#include <cstring>
#include <vector>

#include "bench_common.h"
#include "moetron/fp8.h"
#include "moetron/optim.h"
#include "moetron/rng.h"

using namespace moetron;

namespace {

std::vector<float> randn_vec(int64_t n, const char* name, float sd) {
  std::vector<float> v(n);
  fill_normal(v.data(), n, rng_key(1, name), 0, 0, sd);
  return v;
}

// A copy split over the OpenMP threads: the bandwidth the threaded kernels below can reach (the
// bench_common memcpy limit is one thread's std::memcpy, which one core cannot saturate DRAM with).
void BM_parallel_copy(benchmark::State& st) {
  const int64_t n = st.range(0);
  std::vector<float> a = randn_vec(n, "a", 1.0f), b(n);
  for (auto _ : st) {
#pragma omp parallel
    {
      const int t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t i0 = n * t / T, i1 = n * (t + 1) / T;
      std::memcpy(b.data() + i0, a.data() + i0, size_t(i1 - i0) * sizeof(float));
    }
    benchmark::ClobberMemory();
  }
  bench::report_bytes(st, 8.0 * double(n));
}
BENCHMARK(BM_parallel_copy)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_adamw_step(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto p = randn_vec(n, "p", 0.02f), g = randn_vec(n, "g", 1.0f);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  AdamWConfig c{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f};
  int64_t step = 0;
  for (auto _ : st) adamw_step(p.data(), m.data(), v.data(), g.data(), n, c, ++step, 0.9f, true);
  bench::report_bytes(st, 28.0 * double(n));  // read p, m, v, g; write p, m, v
}
BENCHMARK(BM_adamw_step)->Arg(1 << 24)->Arg(1 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_grad_norm_sq(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto g = randn_vec(n, "g", 1.0f);
  for (auto _ : st) benchmark::DoNotOptimize(grad_norm_sq(g.data(), n));
  bench::report_bytes(st, 4.0 * double(n));
}
BENCHMARK(BM_grad_norm_sq)->Arg(1 << 24)->Arg(1 << 20)->Unit(benchmark::kMillisecond)->UseRealTime();

// args: R, C, format (0 e4m3, 1 e5m2), scaling (0 tensor, 1 row, 2 block), block_r, block_c, op (0 quantize,
// 1 dequantize, 2 fake quant)
void BM_fp8(benchmark::State& st) {
  const int64_t R = st.range(0), C = st.range(1);
  const auto f = Fp8Format(st.range(2));
  const auto s = Fp8Scaling(st.range(3));
  const int64_t br = st.range(4), bc = st.range(5), op = st.range(6);
  auto x = randn_vec(R * C, "x", 2.0f);
  std::vector<uint8_t> q(R * C);
  std::vector<float> y(R * C), sc(fp8_num_scales(R, C, s, br, bc));
  fp8_quantize(q.data(), sc.data(), x.data(), R, C, f, s, br, bc);
  for (auto _ : st) {
    if (op == 0) fp8_quantize(q.data(), sc.data(), x.data(), R, C, f, s, br, bc);
    else if (op == 1) fp8_dequantize(y.data(), q.data(), sc.data(), R, C, f, s, br, bc);
    else fp8_fake_quant(y.data(), sc.data(), x.data(), R, C, f, s, br, bc);
    benchmark::ClobberMemory();
  }
  const double n = double(R) * double(C);
  bench::report_bytes(st, (op == 2 ? 8.0 : 5.0) * n + 4.0 * double(sc.size()));
}
BENCHMARK(BM_fp8)
    ->ArgNames({"R", "C", "fmt", "scaling", "br", "bc", "op"})
    ->Args({4096, 4096, 0, 2, 1, 128, 0})    // quantize e4m3 1x128 (activations)
    ->Args({4096, 4096, 0, 2, 128, 128, 0})  // quantize e4m3 128x128 (weights)
    ->Args({4096, 4096, 0, 1, 0, 0, 0})      // quantize e4m3 row-wise
    ->Args({4096, 4096, 0, 0, 0, 0, 0})      // quantize e4m3 tensor-wise (two passes over x)
    ->Args({4096, 4096, 1, 2, 1, 128, 0})    // quantize e5m2 1x128
    ->Args({4096, 4096, 0, 2, 1, 128, 1})    // dequantize e4m3 1x128
    ->Args({4096, 4096, 0, 2, 128, 128, 1})  // dequantize e4m3 128x128
    ->Args({4096, 4096, 0, 2, 1, 128, 2})    // fake quant e4m3 1x128
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
