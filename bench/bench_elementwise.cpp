// bench_elementwise.cpp: the bandwidth-bound kernels next to attention: RMSNorm (forward, backward),
// SwiGLU (forward, backward) and RoPE (forward, in place). Bytes count each array read or written once
// (the minimum traffic); counters GBps and pct_memcpy (vs a 256 MiB memcpy, read + write).
// Shapes: ds_mini-like (2048 tokens: fits in L3, so it can beat the 256 MiB memcpy) and a large one
// (DRAM-bound); BM_memcpy at 4, 64 and 256 MiB gives the like-for-like copy rate for each footprint.
#include <cstring>
#include <vector>

#include "bench_common.h"
#include "moetron/norm.h"
#include "moetron/rng.h"
#include "moetron/rope.h"
#include "moetron/swiglu.h"

using namespace moetron;

namespace {

std::vector<float> randv(int64_t n, const char* name) { return bench::normal_vec(n, 1, name); }

void BM_rmsnorm_fwd(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1);
  auto x = randv(N * C, "x"), w = randv(C, "w");
  std::vector<float> y(N * C), rstd(N);
  for (auto _ : st) rmsnorm_forward(y.data(), nullptr, rstd.data(), x.data(), w.data(), N, C, 1e-6f);
  bench::report_bytes(st, 4.0 * double(2 * N * C + N + C));
}

void BM_rmsnorm_fwd_bf16out(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1);
  auto x = randv(N * C, "x"), w = randv(C, "w");
  std::vector<float> y(N * C), rstd(N);
  std::vector<bf16> y16(N * C);
  for (auto _ : st) rmsnorm_forward(y.data(), y16.data(), rstd.data(), x.data(), w.data(), N, C, 1e-6f);
  bench::report_bytes(st, 4.0 * double(2 * N * C + N + C) + 2.0 * double(N * C));
}

void BM_rmsnorm_bwd(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1);
  auto x = randv(N * C, "x"), w = randv(C, "w"), dy = randv(N * C, "dy");
  std::vector<float> y(N * C), rstd(N), dx(N * C), dw(C);
  std::vector<char> ws(rmsnorm_backward_workspace_bytes(N, C));
  rmsnorm_forward(y.data(), nullptr, rstd.data(), x.data(), w.data(), N, C, 1e-6f);
  for (auto _ : st)
    rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C, ws.data());
  bench::report_bytes(st, 4.0 * double(3 * N * C + N + 2 * C));
}

void BM_swiglu_fwd(benchmark::State& st) {
  const int64_t N = st.range(0), F = st.range(1);
  auto gu = randv(N * 2 * F, "gu");
  std::vector<float> h(N * F);
  for (auto _ : st) swiglu_forward(h.data(), nullptr, gu.data(), N, F);
  bench::report_bytes(st, 4.0 * double(3 * N * F));
}

void BM_swiglu_bwd(benchmark::State& st) {
  const int64_t N = st.range(0), F = st.range(1);
  auto gu = randv(N * 2 * F, "gu"), dh = randv(N * F, "dh");
  std::vector<float> dgu(N * 2 * F);
  for (auto _ : st) swiglu_backward(dgu.data(), dh.data(), gu.data(), N, F);
  bench::report_bytes(st, 4.0 * double(5 * N * F));
}

// q [N tokens, H heads, D], rope over all D dims; T = 256 positions per sequence.
void BM_rope_fwd(benchmark::State& st) {
  const int64_t N = st.range(0), H = st.range(1), D = st.range(2), T = 256;
  auto x = randv(N * H * D, "x");
  std::vector<float> c(T * D / 2), s(T * D / 2);
  rope_table(c.data(), s.data(), T, D, 10000.0f);
  for (auto _ : st) rope_forward(x.data(), N / T, T, H, H * D, D, 0, D, c.data(), s.data());
  bench::report_bytes(st, 4.0 * double(2 * N * H * D));
}

// The reference line: memcpy of the same footprint (read + write counted), in this process's conditions.
void BM_memcpy(benchmark::State& st) {
  const size_t bytes = size_t(st.range(0)) << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : st) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
  }
  bench::report_bytes(st, 2.0 * double(bytes));
}

}  // namespace

BENCHMARK(BM_memcpy)->Arg(4)->Arg(64)->Arg(256)->UseRealTime();
BENCHMARK(BM_rmsnorm_fwd)->Args({2048, 512})->Args({16384, 2048})->UseRealTime();
BENCHMARK(BM_rmsnorm_fwd_bf16out)->Args({2048, 512})->Args({16384, 2048})->UseRealTime();
BENCHMARK(BM_rmsnorm_bwd)->Args({2048, 512})->Args({16384, 2048})->UseRealTime();
BENCHMARK(BM_swiglu_fwd)->Args({64, 1408})->Args({2048, 1408})->Args({16384, 2048})->UseRealTime();
BENCHMARK(BM_swiglu_bwd)->Args({64, 1408})->Args({2048, 1408})->Args({16384, 2048})->UseRealTime();
BENCHMARK(BM_rope_fwd)->Args({2048, 8, 64})->Args({16384, 16, 128})->UseRealTime();
