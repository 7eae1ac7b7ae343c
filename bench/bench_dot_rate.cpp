// bench_dot_rate.cpp: the register-to-register rate of this CPU's two dot-product instructions the attention
// kernels are built on: vfmadd231ps zmm (fp32, 32 FLOPs) and vdpbf16ps zmm (bf16 pairs into fp32, 64 FLOPs),
// 24 independent accumulators each (no memory operands, no dependency stalls), one thread. Their ratio is what
// attention_bf16_preferred() encodes per CPU vendor (AMD Zen 4: vdpbf16ps at twice the FMAs' FLOP rate; Intel
// Sapphire Rapids, AMX: half). Not a kernel benchmark (bench_attention) and not a machine peak (bench_common's oneDNN matmul).
// GCC 12 warns about _mm512_undefined_*() inside its own intrinsic headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "bench_common.h"
#include "moetron/runtime.h"

namespace {

constexpr int kAcc = 24;

__attribute__((target("avx512f,avx512bf16"))) float run_bf16(int64_t n) {
  __m512 c[kAcc];
  for (int i = 0; i < kAcc; ++i) c[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 24
    for (int i = 0; i < kAcc; ++i) c[i] = _mm512_dpbf16_ps(c[i], a, a);
    asm volatile("" : "+v"(a));
  }
  float s = 0;
  for (int i = 0; i < kAcc; ++i) s += _mm512_reduce_add_ps(c[i]);
  return s;
}

__attribute__((target("avx512f,fma"))) float run_fma(int64_t n) {
  __m512 c[kAcc];
  for (int i = 0; i < kAcc; ++i) c[i] = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1e-9f);
  for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 24
    for (int i = 0; i < kAcc; ++i) c[i] = _mm512_fmadd_ps(a, a, c[i]);
    asm volatile("" : "+v"(a));
  }
  float s = 0;
  for (int i = 0; i < kAcc; ++i) s += _mm512_reduce_add_ps(c[i]);
  return s;
}

// Arg: 0 = vfmadd231ps zmm, 1 = vdpbf16ps zmm.
void BM_dot_rate(benchmark::State& st) {
  const bool bf = st.range(0) != 0;
  const auto& f = moetron::cpu_features();
  if (!f.avx512f || (bf && !f.avx512bf16)) {
    st.SkipWithError("this CPU lacks the instruction");
    return;
  }
  const int64_t n = 1 << 20;
  for (auto _ : st) benchmark::DoNotOptimize(bf ? run_bf16(n) : run_fma(n));
  const double flops = double(n) * kAcc * (bf ? 64 : 32);
  st.counters["GFLOPS"] = benchmark::Counter(flops * double(st.iterations()) * 1e-9, benchmark::Counter::kIsRate);
  st.counters["amx_bf16"] = f.amx_bf16 ? 1 : 0;
}

}  // namespace

BENCHMARK(BM_dot_rate)->ArgName("bf16")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
