// bench_gemm.cpp: dense GEMM at transformer shapes, including the transposed operand layouts of backward
// passes (dX = dY·W^T: NT; dW = X^T·dY: TN).
//   BM_f32_vs_onednn: moetron's batch-invariant gemm_f32 against oneDNN's sgemm (gemm_f32_onednn) on the same
//     operands, in alternating rounds; reports both GFLOPS and ratio = t(onednn) / t(gemm_f32) (the target:
//     >= 0.90) from the best round of each, so the ratio survives a noisy machine.
//   BM_gemm_bf16 / BM_gemm_bf16_trans: the oneDNN bf16 matmul.
// Not a correctness test (tests/ops/gemm_cases.cpp).
#include <algorithm>
#include <chrono>
#include <vector>

#include "bench_common.h"
#include "moetron/gemm.h"
#include "moetron/rng.h"

using namespace moetron;

namespace {

template <class F>
double seconds(F&& f) {
  auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Operands for op(A)[M,K]·op(B)[K,N] in the stored layouts of gemm.h.
struct Operands {
  int64_t M, N, K, lda, ldb;
  Trans ta, tb;
  std::vector<float> a, b, c;
  Operands(int64_t m, int64_t n, int64_t k, bool at, bool bt)
      : M(m), N(n), K(k), lda(at ? m : k), ldb(bt ? k : n), ta(at ? Trans::T : Trans::N), tb(bt ? Trans::T : Trans::N) {
    a.resize(M * K), b.resize(K * N), c.resize(M * N);
    fill_normal(a.data(), M * K, rng_key(1, "a"), 0, 0, 1);
    fill_normal(b.data(), K * N, rng_key(1, "b"), 0, 0, 1);
  }
  void ours() { gemm_f32(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), N); }
  void onednn() { gemm_f32_onednn(ta, tb, M, N, K, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), N); }
  double flops() const { return 2.0 * double(M) * double(N) * double(K); }
};

// Args: {M, N, K, ta, tb} with 0 = N, 1 = T. Rounds of (oneDNN, ours) first, then the framework times ours.
void BM_f32_vs_onednn(benchmark::State& st) {
  constexpr int kRounds = 7;
  Operands p(st.range(0), st.range(1), st.range(2), st.range(3) != 0, st.range(4) != 0);
  p.onednn(), p.ours();  // warm-up: page faults, oneDNN's and our scratch
  double to = 1e30, tm = 1e30;
  for (int r = 0; r < kRounds; ++r) {
    to = std::min(to, seconds([&] { p.onednn(); }));
    tm = std::min(tm, seconds([&] { p.ours(); }));
  }
  for (auto _ : st) p.ours();
  st.counters["GFLOPS"] = benchmark::Counter(p.flops() * 1e-9 * double(st.iterations()), benchmark::Counter::kIsRate);
  st.counters["best_gflops"] = p.flops() / tm * 1e-9;
  st.counters["onednn_gflops"] = p.flops() / to * 1e-9;
  st.counters["ratio"] = to / tm;  // the target: >= 0.90
}
BENCHMARK(BM_f32_vs_onednn)
    ->ArgNames({"M", "N", "K", "ta", "tb"})
    // forward layers: x·W (NN) at d = 512, ffn 1408, lm head 8192
    ->Args({2048, 512, 512, 0, 0})
    ->Args({2048, 1408, 512, 0, 0})
    ->Args({2048, 512, 1408, 0, 0})
    ->Args({2048, 2048, 2048, 0, 0})
    ->Args({4096, 512, 8192, 0, 0})
    ->Args({4096, 4096, 4096, 0, 0})
    // dgrad / logits: dY·W^T (NT)
    ->Args({2048, 512, 1408, 0, 1})
    ->Args({2048, 1408, 512, 0, 1})
    ->Args({4096, 8192, 512, 0, 1})
    ->Args({2048, 2048, 2048, 0, 1})
    // wgrad: X^T·dY (TN), the contraction over tokens
    ->Args({512, 1408, 2048, 1, 0})
    ->Args({1408, 512, 2048, 1, 0})
    ->Args({8192, 512, 4096, 1, 0})
    ->Args({2048, 2048, 2048, 1, 0})
    // TT for completeness
    ->Args({2048, 512, 512, 1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_gemm_bf16(benchmark::State& st) {
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

// Args: {M, N, K, ta, tb} with 0 = N, 1 = T (stored shapes follow gemm.h).
void BM_gemm_bf16_trans(benchmark::State& st) {
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

}  // namespace
