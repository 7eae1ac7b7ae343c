// bench_passes.cpp: the memory-bound passes of issue 34 (RMSNorm forward and backward, RoPE forward, AdamW) at
// each ISA path in one process: the first argument selects it (0 = portable scalar, 1 = AVX2, 2 = AVX-512,
// through set_isa_override, so one run gives the ratios under the same machine conditions). Bytes count each
// array read or written once (the minimum traffic); counters GBps and pct_memcpy (vs the 256 MiB memcpy that
// bench_common measures at start-up), and BM_memcpy copies the same footprint as each shape for a like-for-like
// line. The router and permute passes are in bench_router.cpp (same isa argument). Not a correctness check.
#include <cstring>
#include <vector>

#include "bench_common.h"
#include "moetron/norm.h"
#include "moetron/optim.h"
#include "moetron/rng.h"
#include "moetron/rope.h"
#include "moetron/runtime.h"

using namespace moetron;

namespace {

using bench::IsaScope;
std::vector<float> randv(int64_t n, const char* name, float sd = 1.0f) { return bench::normal_vec(n, 3, name, sd); }

// memcpy of `mib` MiB (read + write counted), in this process's conditions.
void BM_memcpy(benchmark::State& st) {
  const size_t bytes = size_t(st.range(0)) << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : st) std::memcpy(dst.data(), src.data(), bytes);
  bench::report_bytes(st, 2.0 * double(bytes));
}

void BM_rmsnorm_fwd(benchmark::State& st) {
  IsaScope isa(st.range(0));
  const int64_t N = st.range(1), C = st.range(2);
  auto x = randv(N * C, "x"), w = randv(C, "w");
  std::vector<float> y(N * C), rstd(N);
  for (auto _ : st) rmsnorm_forward(y.data(), nullptr, rstd.data(), x.data(), w.data(), N, C, 1e-6f);
  bench::report_bytes(st, 4.0 * double(2 * N * C + N + C));  // x read, y written
}

void BM_rmsnorm_bwd(benchmark::State& st) {
  IsaScope isa(st.range(0));
  const int64_t N = st.range(1), C = st.range(2);
  auto x = randv(N * C, "x"), w = randv(C, "w"), dy = randv(N * C, "dy");
  std::vector<float> y(N * C), rstd(N), dx(N * C), dw(C);
  std::vector<char> ws(rmsnorm_backward_workspace_bytes(N, C));
  rmsnorm_forward(y.data(), nullptr, rstd.data(), x.data(), w.data(), N, C, 1e-6f);
  for (auto _ : st)
    rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C, ws.data());
  bench::report_bytes(st, 4.0 * double(3 * N * C + N + 2 * C));  // x, dy read, dx written
}

// q [N tokens, H heads, D], rope over all D dims in place; T = 256 positions per sequence.
void BM_rope_fwd(benchmark::State& st) {
  IsaScope isa(st.range(0));
  const int64_t N = st.range(1), H = st.range(2), D = st.range(3), T = 256;
  auto x = randv(N * H * D, "x");
  std::vector<float> c(T * D / 2), s(T * D / 2);
  rope_table(c.data(), s.data(), T, D, 10000.0f);
  for (auto _ : st) rope_forward(x.data(), N / T, T, H, H * D, D, 0, D, c.data(), s.data());
  bench::report_bytes(st, 4.0 * double(2 * N * H * D));  // read and written in place
}

void BM_adamw(benchmark::State& st) {
  IsaScope isa(st.range(0));
  const int64_t n = st.range(1);
  auto p = randv(n, "p", 0.02f), g = randv(n, "g");
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  const AdamWConfig c{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f};
  int64_t step = 0;
  for (auto _ : st) adamw_step(p.data(), m.data(), v.data(), g.data(), n, c, ++step, 0.9f, true);
  bench::report_bytes(st, 28.0 * double(n));  // p, m, v, g read; p, m, v written
}

}  // namespace

// Footprints: rmsnorm 2048 x 512 = 8 MiB moved per call (ds_mini), 16384 x 1024 = 128 MiB; rope the same;
// AdamW 2^20 (28 MiB) and 2^23 (224 MiB) parameters. memcpy 8, 32 and 128 MiB (x 2 moved).
BENCHMARK(BM_memcpy)->Arg(4)->Arg(16)->Arg(64)->UseRealTime();
BENCHMARK(BM_rmsnorm_fwd)->ArgNames({"isa", "N", "C"})->ArgsProduct({{0, 1, 2}, {2048}, {512}})
    ->ArgsProduct({{0, 1, 2}, {16384}, {1024}})->UseRealTime();
BENCHMARK(BM_rmsnorm_bwd)->ArgNames({"isa", "N", "C"})->ArgsProduct({{0, 1, 2}, {2048}, {512}})
    ->ArgsProduct({{0, 1, 2}, {16384}, {1024}})->UseRealTime();
BENCHMARK(BM_rope_fwd)->ArgNames({"isa", "N", "H", "D"})->ArgsProduct({{0, 1, 2}, {2048}, {8}, {64}})
    ->ArgsProduct({{0, 1, 2}, {16384}, {8}, {128}})->UseRealTime();
BENCHMARK(BM_adamw)->ArgNames({"isa", "n"})->ArgsProduct({{0, 1, 2}, {1 << 20, 1 << 23}})->UseRealTime();
