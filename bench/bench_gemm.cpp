// bench_gemm.cpp: dense GEMM through oneDNN (fp32 and bf16) at transformer shapes, including the transposed
// operand layouts of backward passes (dX = dY·W^T: NT; dW = X^T·dY: TN).
#include <vector>

#include "bench_common.h"
#include "moetron/gemm.h"
#include "moetron/rng.h"

using namespace moetron;

static void BM_gemm_bf16(benchmark::State& st) {
  int64_t M = st.range(0), N = st.range(1), K = st.range(2);
  std::vector<float> a(M * K), b(K * N), c(M * N);
  fill_normal(a.data(), M * K, rng_key(1, "a"), 0, 0, 1);
  fill_normal(b.data(), K * N, rng_key(1, "b"), 0, 0, 1);
  std::vector<bf16> ab(M * K), bb(K * N);
  f32_to_bf16(ab.data(), a.data(), M * K);
  f32_to_bf16(bb.data(), b.data(), K * N);
  for (auto _ : st) gemm_bf16(Trans::N, Trans::N, M, N, K, 1.0f, ab.data(), K, bb.data(), N, 0.0f, c.data(), N);
  bench::report_flops(st, 2.0 * M * N * K);
}
BENCHMARK(BM_gemm_bf16)->Args({2048, 2048, 2048})->Args({2048, 512, 512})->Args({2048, 1408, 512})
    ->Args({12288, 176, 512})->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_gemm_f32(benchmark::State& st) {
  int64_t M = st.range(0), N = st.range(1), K = st.range(2);
  std::vector<float> a(M * K), b(K * N), c(M * N);
  fill_normal(a.data(), M * K, rng_key(1, "a"), 0, 0, 1);
  fill_normal(b.data(), K * N, rng_key(1, "b"), 0, 0, 1);
  for (auto _ : st) gemm_f32(Trans::N, Trans::N, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c.data(), N);
  bench::report_flops(st, 2.0 * M * N * K);
}
BENCHMARK(BM_gemm_f32)->Args({2048, 2048, 2048})->Args({2048, 512, 512})->Unit(benchmark::kMillisecond)->UseRealTime();

// Args: {M, N, K, ta, tb} with 0 = N, 1 = T (stored shapes follow gemm.h).
static void BM_gemm_bf16_trans(benchmark::State& st) {
  int64_t M = st.range(0), N = st.range(1), K = st.range(2);
  Trans ta = st.range(3) ? Trans::T : Trans::N, tb = st.range(4) ? Trans::T : Trans::N;
  std::vector<float> a(M * K), b(K * N), c(M * N);
  fill_normal(a.data(), M * K, rng_key(1, "a"), 0, 0, 1);
  fill_normal(b.data(), K * N, rng_key(1, "b"), 0, 0, 1);
  std::vector<bf16> ab(M * K), bb(K * N);
  f32_to_bf16(ab.data(), a.data(), M * K);
  f32_to_bf16(bb.data(), b.data(), K * N);
  const int64_t lda = ta == Trans::N ? K : M, ldb = tb == Trans::N ? N : K;
  for (auto _ : st) gemm_bf16(ta, tb, M, N, K, 1.0f, ab.data(), lda, bb.data(), ldb, 0.0f, c.data(), N);
  bench::report_flops(st, 2.0 * M * N * K);
}
BENCHMARK(BM_gemm_bf16_trans)->ArgNames({"M", "N", "K", "ta", "tb"})
    ->Args({12288, 512, 176, 0, 1})->Args({512, 176, 12288, 1, 0})->Args({2048, 512, 512, 0, 1})
    ->Args({512, 512, 2048, 1, 0})->Unit(benchmark::kMillisecond)->UseRealTime();
