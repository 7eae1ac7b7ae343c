// bench_loss.cpp: fused linear + cross-entropy (forward + backward in one call) at LM-head shapes,
// against the same kernel run as an unfused baseline (chunk_rows = N: the full [N, V] fp32 logits are
// materialized, as an unfused implementation must). Reports GFLOPS (3 GEMMs of 2 N V C each) with the
// percentage of the measured bf16 matmul peak, and the memory: the fused workspace and the unfused
// logits, as charged to MemCategory::Workspace by the tracked allocator (peak over the run).
#include <algorithm>
#include <vector>

#include "bench_common.h"
#include "moetron/gemm.h"
#include "moetron/loss.h"
#include "moetron/memory.h"
#include "moetron/rng.h"

using namespace moetron;

namespace {

struct Inputs {
  std::vector<float> hf, Wf, dh, dW;
  std::vector<bf16> hb, Wb;
  std::vector<int32_t> t;
  Inputs(int64_t N, int64_t C, int64_t V) : hf(N * C), Wf(V * C), dh(N * C), dW(V * C, 0.0f), hb(N * C), Wb(V * C), t(N) {
    fill_normal(hf.data(), N * C, rng_key(1, "h"), 0, 0, 1);
    fill_normal(Wf.data(), V * C, rng_key(1, "W"), 0, 0, 0.05f);
    f32_to_bf16(hb.data(), hf.data(), N * C);
    f32_to_bf16(Wb.data(), Wf.data(), V * C);
    for (int64_t n = 0; n < N; ++n) t[n] = n % 10 == 9 ? -1 : int32_t((n * 7919) % V);
  }
};

// args: N, C, V, chunk_rows (0 = default, -1 = N: unfused), bf16 (1) or fp32 (0), backward (1) or forward only (0)
void BM_linear_xent(benchmark::State& st) {
  const int64_t N = st.range(0), C = st.range(1), V = st.range(2);
  const int64_t chunk = st.range(3) < 0 ? N : st.range(3);
  const bool bf = st.range(4) != 0, bwd = st.range(5) != 0;
  Inputs in(N, C, V);
  const size_t ws_bytes = linear_xent_workspace_bytes(N, V, chunk);
  auto& tr = MemoryTracker::global();
  const int64_t base = tr.current(MemCategory::Workspace);
  tr.reset_peaks();
  void* ws = mt_alloc(ws_bytes, MemCategory::Workspace);
  for (auto _ : st) {
    double l;
    if (bwd)
      l = bf ? linear_xent_fwd_bwd_bf16(in.dh.data(), in.dW.data(), in.hb.data(), in.Wb.data(), in.t.data(), N, C, V,
                                        1.0f / N, chunk, ws)
             : linear_xent_fwd_bwd_f32(in.dh.data(), in.dW.data(), in.hf.data(), in.Wf.data(), in.t.data(), N, C, V,
                                       1.0f / N, chunk, ws);
    else
      l = bf ? linear_xent_fwd_bf16(nullptr, in.hb.data(), in.Wb.data(), in.t.data(), N, C, V, 1.0f / N, chunk, ws)
             : linear_xent_fwd_f32(nullptr, in.hf.data(), in.Wf.data(), in.t.data(), N, C, V, 1.0f / N, chunk, ws);
    benchmark::DoNotOptimize(l);
  }
  const int64_t peak = tr.peak(MemCategory::Workspace) - base;
  mt_free(ws, ws_bytes, MemCategory::Workspace);
  bench::report_flops(st, (bwd ? 3.0 : 1.0) * 2.0 * double(N) * double(V) * double(C));
  st.counters["chunk"] = double(std::min(chunk > 0 ? chunk : linear_xent_default_chunk(V), N));
  st.counters["ws_MiB"] = double(peak) / (1 << 20);
  st.counters["full_logits_MiB"] = double(N) * double(V) * 4.0 / (1 << 20);
}

}  // namespace

// LM-head shape of the brief: N=2048 tokens, C=512, V=8192 (full fp32 logits: 64 MiB).
BENCHMARK(BM_linear_xent)
    ->ArgNames({"N", "C", "V", "chunk", "bf16", "bwd"})
    ->Args({2048, 512, 8192, 0, 1, 1})      // fused, default chunk
    ->Args({2048, 512, 8192, 64, 1, 1})
    ->Args({2048, 512, 8192, 128, 1, 1})
    ->Args({2048, 512, 8192, 512, 1, 1})
    ->Args({2048, 512, 8192, -1, 1, 1})     // unfused: one chunk holding all N rows
    ->Args({2048, 512, 8192, 0, 0, 1})      // fp32
    ->Args({2048, 512, 8192, -1, 0, 1})
    ->Args({2048, 512, 8192, 0, 1, 0})      // forward only (validation)
    ->Args({4096, 1024, 32000, 0, 1, 1})    // a larger vocabulary (full logits: 500 MiB)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
