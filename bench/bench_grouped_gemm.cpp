// bench_grouped_gemm.cpp: the MoE expert GEMMs at DeepSeek-V2-Lite-like shapes scaled down: 64 experts, top-6,
// d = 512, expert ffn = 176, 2048 tokens (12288 routed rows), skewed random counts. In one run:
//   grouped forward, dgrad and wgrad for the up projection (K=512, N=176) and the down projection (K=176,
//   N=512), bf16 inputs with fp32 accumulation (BM_grouped) and fp32 inputs (BM_grouped_f32);
//   oneDNN dense matmul of the same FLOPs (bf16: gemm_bf16; fp32: gemm_f32_onednn, i.e. dnnl_sgemm), the
//   target being grouped >= 85% of it;
//   a loop of per-expert oneDNN calls of the same kind (what the grouped kernel replaces);
//   weight packing (once per optimizer step); the tile kernel of the active ISA alone, in cache.
// Each grouped benchmark also reports vs_dense = t(dense) / t(grouped) and vs_loop = t(loop) / t(grouped) from
// alternating rounds of the three (best of each), so the ratios survive a noisy machine.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_common.h"
#include "kernels/grouped_gemm_tile.h"
#include "moetron/gemm.h"
#include "moetron/grouped_gemm.h"
#include "moetron/rng.h"

using namespace moetron;

namespace {

constexpr int64_t kE = 64, kTopK = 6, kTokens = 2048, kD = 512, kF = 176, kM = kTokens * kTopK;

struct AlignedBuf {
  void* p;
  explicit AlignedBuf(size_t b) : p(std::aligned_alloc(64, std::max<size_t>(64, (b + 63) / 64 * 64))) {}
  ~AlignedBuf() { std::free(p); }
};

// Skewed routing: expert popularity exp(1.2 * z_e), z_e ~ N(0,1); each token takes the top-6 of
// log-popularity + Gumbel noise (distinct experts per token). Deterministic.
std::vector<int32_t> routed_counts() {
  std::vector<double> logp(kE);
  for (int64_t e = 0; e < kE; ++e) logp[e] = 1.2 * rng_normal(rng_key(7, "bench.popularity"), uint64_t(e));
  std::vector<int32_t> counts(kE, 0);
  std::vector<std::pair<double, int>> s(kE);
  const uint64_t key = rng_key(7, "bench.gumbel");
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t e = 0; e < kE; ++e) {
      double u = std::max(1e-12, double(rng_uniform(key, uint64_t(t * kE + e))));
      s[e] = {logp[e] - std::log(-std::log(u)), int(e)};
    }
    std::partial_sort(s.begin(), s.begin() + kTopK, s.end(), std::greater<>());
    for (int k = 0; k < kTopK; ++k) ++counts[s[k].second];
  }
  return counts;
}

const std::vector<int32_t>& counts() {
  static const std::vector<int32_t> c = [] {
    auto c = routed_counts();
    auto mm = std::minmax_element(c.begin(), c.end());
    std::printf("routed counts: E=%lld rows=%lld min=%d max=%d mean=%.1f (%lld empty)\n", (long long)kE, (long long)kM,
                *mm.first, *mm.second, double(kM) / kE, (long long)std::count(c.begin(), c.end(), 0));
    return c;
  }();
  return c;
}

std::vector<float> rand_f32(int64_t n, const char* name) {
  std::vector<float> f(n);
  fill_normal(f.data(), n, rng_key(3, name), 0, 0, 1);
  return f;
}

// One projection: W[E, K, N] (K in, N out), activations X[M, K], output grads dY[M, N], in bf16 (BF = true)
// or fp32.
template <bool BF>
struct Problem {
  using In = std::conditional_t<BF, bf16, float>;
  static constexpr GemmPrec kPrec = BF ? GemmPrec::BF16 : GemmPrec::F32;
  int64_t K, N;
  std::vector<float> W;
  std::vector<In> Wb, X, dY;  // Wb: W in the input type, for the oneDNN baselines
  std::unique_ptr<AlignedBuf> pf, pd, ws;
  size_t ws_bytes = 0;
  GroupedPackedWeights Wf, Wd;
  std::vector<float> Y, dX, dW;
  Problem(int64_t k, int64_t n) : K(k), N(n) {
    W.resize(kE * K * N);
    fill_normal(W.data(), kE * K * N, rng_key(3, "W"), 0, 0, 0.05f);
    Wb = convert(W);
    X = convert(rand_f32(kM * K, "X"));
    dY = convert(rand_f32(kM * N, "dY"));
    pf = std::make_unique<AlignedBuf>(grouped_packed_bytes(GroupedPackKind::Fwd, kPrec, kE, K, N));
    pd = std::make_unique<AlignedBuf>(grouped_packed_bytes(GroupedPackKind::Dgrad, kPrec, kE, K, N));
    Wf = grouped_pack_weights(pf->p, W.data(), kE, K, N, kPrec, GroupedPackKind::Fwd);
    Wd = grouped_pack_weights(pd->p, W.data(), kE, K, N, kPrec, GroupedPackKind::Dgrad);
    size_t wsb = 0;
    for (GroupedOp op : {GroupedOp::Fwd, GroupedOp::Dgrad, GroupedOp::Wgrad})
      wsb = std::max(wsb, grouped_gemm_workspace_bytes(op, kPrec, kE, kM, K, N));
    ws = std::make_unique<AlignedBuf>(wsb);
    ws_bytes = wsb;
    Y.resize(kM * N);
    dX.resize(kM * K);
    dW.resize(kE * K * N);
  }
  static std::vector<In> convert(const std::vector<float>& f) {
    if constexpr (BF) {
      std::vector<bf16> b(f.size());
      f32_to_bf16(b.data(), f.data(), int64_t(f.size()));
      return b;
    } else {
      return f;
    }
  }
  double flops() const { return 2.0 * double(kM) * double(K) * double(N); }
  static void gemm(Trans ta, Trans tb, int64_t m, int64_t n, int64_t k, const In* a, int64_t lda, const In* b,
                   int64_t ldb, float* c, int64_t ldc, float beta = 0.0f) {
    if constexpr (BF)
      gemm_bf16(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
    else
      gemm_f32_onednn(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  }

  // op: 0 fwd, 1 dgrad, 2 wgrad into a fresh dW, 3 wgrad added to dW (the trainer's case: gradients accumulate)
  void grouped(int op) {
    const int32_t* c = counts().data();
    if constexpr (BF) {
      if (op == 0) grouped_gemm_fwd(Y.data(), nullptr, X.data(), Wf, c, kE, kM, K, N, ws->p, ws_bytes);
      if (op == 1) grouped_gemm_dgrad(dX.data(), nullptr, dY.data(), Wd, c, kE, kM, K, N, ws->p, ws_bytes);
    } else {
      if (op == 0) grouped_gemm_fwd(Y.data(), X.data(), Wf, c, kE, kM, K, N, ws->p, ws_bytes);
      if (op == 1) grouped_gemm_dgrad(dX.data(), dY.data(), Wd, c, kE, kM, K, N, ws->p, ws_bytes);
    }
    if (op >= 2) grouped_gemm_wgrad(dW.data(), X.data(), dY.data(), c, kE, kM, K, N, op == 3, ws->p, ws_bytes);
  }
  // Dense oneDNN matmul with the same FLOPs and the same operand layouts (expert 0's weights).
  void dense(int op) {
    if (op == 0) gemm(Trans::N, Trans::N, kM, N, K, X.data(), K, Wb.data(), N, Y.data(), N);
    if (op == 1) gemm(Trans::N, Trans::T, kM, K, N, dY.data(), N, Wb.data(), N, dX.data(), K);
    if (op >= 2) gemm(Trans::T, Trans::N, K, N, kM, X.data(), K, dY.data(), N, dW.data(), N, op == 3 ? 1.0f : 0.0f);
  }
  // A loop of per-expert oneDNN calls (each one parallel inside).
  void loop(int op) {
    int64_t o = 0;
    for (int64_t e = 0; e < kE; ++e) {
      const int64_t m = counts()[e];
      const In* We = Wb.data() + e * K * N;
      if (op == 0 && m) gemm(Trans::N, Trans::N, m, N, K, X.data() + o * K, K, We, N, Y.data() + o * N, N);
      if (op == 1 && m) gemm(Trans::N, Trans::T, m, K, N, dY.data() + o * N, N, We, N, dX.data() + o * K, K);
      if (op >= 2)
        gemm(Trans::T, Trans::N, K, N, m, X.data() + o * K, K, dY.data() + o * N, N, dW.data() + e * K * N, N,
             op == 3 ? 1.0f : 0.0f);
      o += m;
    }
  }
};

template <bool BF>
Problem<BF>& problem(int which) {  // 0: up (K=d, N=ffn), 1: down (K=ffn, N=d)
  static Problem<BF> up(kD, kF), down(kF, kD);
  return which == 0 ? up : down;
}

// GFLOPS as a rate counter; bf16 benchmarks also report pct_bf16_peak (bench_common.h), fp32 ones do not.
template <bool BF>
void gflops(benchmark::State& st, double flops_per_iter) {
  if constexpr (BF)
    bench::report_flops(st, flops_per_iter);
  else
    st.counters["GFLOPS"] =
        benchmark::Counter(flops_per_iter * 1e-9 * double(st.iterations()), benchmark::Counter::kIsRate);
}

// Wall time, or with MOETRON_BENCH_CPUTIME=1 the process's CPU time: with OMP_NUM_THREADS=1 on a loaded machine
// that is the time the work itself took, without the time other processes had the core (with more threads it
// would also count spin-waiting).
template <class F>
double seconds(F&& f) {
  static const bool cpu = [] {
    const char* v = std::getenv("MOETRON_BENCH_CPUTIME");
    return v && *v == '1';
  }();
  if (cpu) {
    timespec a, b;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
    f();
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
    return double(b.tv_sec - a.tv_sec) + 1e-9 * double(b.tv_nsec - a.tv_nsec);
  }
  auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Tuning experiments without a rebuild, for this process only:
//   MOETRON_BENCH_GG_MT=96          the M-grouped rows per work item (gg::tuning().mt and .mt_avx2);
//   MOETRON_BENCH_GG_SET="k=v,..."  other gg::Tuning fields (the names in tuning_field below);
//   MOETRON_BENCH_GG_AB="k=v,..."   a variant timed in the same alternating rounds as the grouped op:
//                                   BM_grouped* then also report ab = t(variant) / t(grouped) (> 1: the
//                                   variant is slower).
int64_t* tuning_i64(const std::string& k) {
  gg::Tuning& t = gg::tuning();
  if (k == "mt") return &t.mt;
  if (k == "mt_avx2") return &t.mt_avx2;
  if (k == "nt") return &t.nt;
  if (k == "wmt") return &t.wmt;
  if (k == "wnt") return &t.wnt;
  if (k == "wmc_f32") return &t.wmc_f32;
  if (k == "kc_f32_avx2") return &t.kc_f32_avx2;
  if (k == "kc_bf16") return &t.kc_bf16;
  if (k == "wmc") return &t.wmc;
  return nullptr;
}
bool* tuning_bool(const std::string& k) {
  gg::Tuning& t = gg::tuning();
  if (k == "stream") return &t.stream;
  if (k == "prefetch") return &t.prefetch;
  if (k == "fpack_avx2") return &t.fpack_avx2;
  if (k == "wpack_avx2") return &t.wpack_avx2;
  if (k == "strip_copy_avx2") return &t.strip_copy_avx2;
  if (k == "strip_pf_avx2") return &t.strip_pf_avx2;
  if (k == "strip_f32_avx2") return &t.strip_f32_avx2;
  return nullptr;
}
// Applies "k=v,k=v"; returns the previous values in the same form (to undo it).
std::string apply_tuning(const std::string& spec) {
  std::string undo;
  size_t p = 0;
  while (p < spec.size()) {
    size_t q = spec.find(',', p);
    if (q == std::string::npos) q = spec.size();
    const std::string kv = spec.substr(p, q - p);
    const size_t eq = kv.find('=');
    if (eq == std::string::npos) throw std::runtime_error("MOETRON_BENCH_GG_*: '" + kv + "' is not key=value");
    const std::string k = kv.substr(0, eq);
    const long long v = std::atoll(kv.c_str() + eq + 1);
    if (!undo.empty()) undo += ',';
    if (k == "order") {
      undo += k + "=" + std::to_string(gg::tuning().order), gg::tuning().order = int(v);
    } else if (int64_t* f = tuning_i64(k)) {
      undo += k + "=" + std::to_string(*f), *f = v;
    } else if (bool* b = tuning_bool(k)) {
      undo += k + "=" + std::to_string(int(*b)), *b = v != 0;
    } else {
      throw std::runtime_error("MOETRON_BENCH_GG_*: unknown gg::Tuning field '" + k + "'");
    }
    p = q + 1;
  }
  return undo;
}
const bool kTuningFromEnv = [] {
  if (const char* v = std::getenv("MOETRON_BENCH_GG_MT")) gg::tuning().mt = gg::tuning().mt_avx2 = std::atoll(v);
  if (const char* v = std::getenv("MOETRON_BENCH_GG_SET")) apply_tuning(v);
  return true;
}();
const char* ab_spec() { return std::getenv("MOETRON_BENCH_GG_AB"); }

// Grouped op, timed by the framework. Before that, kRounds alternating rounds of (dense, loop, grouped) calls:
// the best of each gives same-moment ratios vs_dense = t(dense) / t(grouped) and vs_loop = t(loop) / t(grouped),
// which survive a shared, noisy machine better than ratios of separately run benchmarks.
template <bool BF>
void run_grouped(benchmark::State& st) {
  constexpr int kRounds = 15;
  const int which = int(st.range(0)), op = int(st.range(1));
  Problem<BF>& p = problem<BF>(which);
  p.dense(op), p.loop(op), p.grouped(op);  // warm-up (oneDNN primitive creation, page faults)
  const char* ab = ab_spec();
  double td = 1e30, tl = 1e30, tg = 1e30, tv = 1e30;
  for (int r = 0; r < kRounds; ++r) {
    td = std::min(td, seconds([&] { p.dense(op); }));
    tl = std::min(tl, seconds([&] { p.loop(op); }));
    tg = std::min(tg, seconds([&] { p.grouped(op); }));
    if (ab) {
      const std::string undo = apply_tuning(ab);
      tv = std::min(tv, seconds([&] { p.grouped(op); }));
      apply_tuning(undo);
    }
  }
  for (auto _ : st) p.grouped(op);
  gflops<BF>(st, p.flops());
  st.counters["best_ms"] = tg * 1e3;
  st.counters["dense_best_ms"] = td * 1e3;
  st.counters["loop_best_ms"] = tl * 1e3;
  st.counters["vs_dense"] = td / tg;  // the target: >= 0.85
  st.counters["vs_loop"] = tl / tg;
  if (ab) st.counters["ab"] = tv / tg;
}
void BM_grouped(benchmark::State& st) { run_grouped<true>(st); }
void BM_grouped_f32(benchmark::State& st) { run_grouped<false>(st); }

template <bool BF>
void run_dense(benchmark::State& st) {
  Problem<BF>& p = problem<BF>(int(st.range(0)));
  const int op = int(st.range(1));
  p.dense(op);
  for (auto _ : st) p.dense(op);
  gflops<BF>(st, p.flops());
}
void BM_dense_onednn(benchmark::State& st) { run_dense<true>(st); }
void BM_dense_onednn_f32(benchmark::State& st) { run_dense<false>(st); }

template <bool BF>
void run_loop(benchmark::State& st) {
  Problem<BF>& p = problem<BF>(int(st.range(0)));
  const int op = int(st.range(1));
  p.loop(op);
  for (auto _ : st) p.loop(op);
  gflops<BF>(st, p.flops());
}
void BM_loop_onednn(benchmark::State& st) { run_loop<true>(st); }
void BM_loop_onednn_f32(benchmark::State& st) { run_loop<false>(st); }

template <bool BF>
void run_pack(benchmark::State& st) {  // Fwd + Dgrad packing of all experts, once per optimizer step
  Problem<BF>& p = problem<BF>(int(st.range(0)));
  for (auto _ : st) {
    grouped_pack_weights(p.pf->p, p.W.data(), kE, p.K, p.N, Problem<BF>::kPrec, GroupedPackKind::Fwd);
    grouped_pack_weights(p.pd->p, p.W.data(), kE, p.K, p.N, Problem<BF>::kPrec, GroupedPackKind::Dgrad);
  }
  bench::report_bytes(st, double(p.W.size()) * (4 + (BF ? 2 : 4)) * 2);
}
void BM_pack_weights(benchmark::State& st) { run_pack<true>(st); }
void BM_pack_weights_f32(benchmark::State& st) { run_pack<false>(st); }

// The tile kernel of the active ISA alone, operands in cache, on the calling thread: the ceiling the grouped
// kernels can reach. Args: {rows, cols, steps (K pairs for bf16, K for fp32)}. Run with OMP_NUM_THREADS=1.
template <bool BF>
void run_tile(benchmark::State& st) {
  const int64_t rows = st.range(0), cols = st.range(1), steps = st.range(2), e = BF ? 2 : 1;
  const int64_t npan = (cols + gg::kPanel - 1) / gg::kPanel;
  auto A = Problem<BF>::convert(rand_f32(rows * e * steps, "tile.A"));
  auto B = Problem<BF>::convert(rand_f32(npan * steps * gg::kPanel * e, "tile.B"));
  std::vector<float> C(rows * cols);
  gg::Tile t;
  t.A = A.data(), t.a_bs = gg::kMR * e * steps, t.a_rs = e * steps, t.a_ss = e;
  if (!BF && st.range(3)) t.a_rs = 1, t.a_ss = gg::kMR;  // fp32 A as 6-row micro-panels (fpack_avx2's layout)
  t.B = B.data(), t.b_ps = steps * gg::kPanel * e, t.b_ss = gg::kPanel * e;
  t.C = C.data(), t.ldc = cols, t.rows = rows, t.cols = cols, t.steps = steps;
  const gg::TileFn fn = gg::tile_fn(BF);
  for (auto _ : st) fn(t);
  gflops<BF>(st, 2.0 * rows * cols * steps * e);
}
void BM_tile_bf16(benchmark::State& st) { run_tile<true>(st); }
void BM_tile_f32(benchmark::State& st) { run_tile<false>(st); }
BENCHMARK(BM_tile_bf16)
    ->ArgNames({"rows", "cols", "pairs"})
    ->Args({96, 192, 256})
    ->Args({96, 192, 64})
    ->Args({96, 512, 88})
    ->Args({96, 64, 256})
    ->Args({6, 64, 256})
    ->Args({6, 64, 1024})
    ->UseRealTime();
BENCHMARK(BM_tile_f32)
    ->ArgNames({"rows", "cols", "steps", "packed_a"})
    ->Args({96, 192, 512, 0})
    ->Args({96, 512, 176, 0})
    ->Args({96, 512, 176, 1})
    ->Args({192, 512, 176, 1})
    ->Args({96, 64, 512, 0})
    ->Args({6, 64, 512, 0})
    ->UseRealTime();

// Args: {projection (0 up: K=512 N=176, 1 down: K=176 N=512), op (0 fwd, 1 dgrad, 2 wgrad, 3 wgrad accumulating)}
void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"proj", "op"});
  for (int which : {0, 1})
    for (int op : {0, 1, 2, 3}) b->Args({which, op});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_grouped)->Apply(shapes);
BENCHMARK(BM_dense_onednn)->Apply(shapes);
BENCHMARK(BM_loop_onednn)->Apply(shapes);
BENCHMARK(BM_pack_weights)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_grouped_f32)->Apply(shapes);
BENCHMARK(BM_dense_onednn_f32)->Apply(shapes);
BENCHMARK(BM_loop_onednn_f32)->Apply(shapes);
BENCHMARK(BM_pack_weights_f32)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
