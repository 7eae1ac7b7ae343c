// bench_attention.cpp: causal flash attention forward and backward at ds_mini shapes and a few others, in
// fp32 (bf16:0) and bf16 (bf16:1, AttnPrec::BF16: vdpbf16ps products where AVX512-BF16 is native, else the
// fp32 kernels; the counter bf16_active says which ran), side by side in one run. FLOPs count only the causal
// (key <= query) pairs: forward 2 matmuls, backward 5 (S recomputed, dP, dV, dK, dQ); see
// attention_forward_flops / attention_backward_flops. Counters: GFLOPS, pct_bf16_peak (vs a large oneDNN bf16
// matmul measured at the start of the same run) and pct_f32_peak (vs sgemm, the like-for-like ratio of fp32).
#include <vector>

#include "bench_common.h"
#include "moetron/attention.h"
#include "moetron/rng.h"
#include "moetron/runtime.h"

using namespace moetron;

namespace {

AttnDims dims(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dqk, int64_t Dv, bool bf16) {
  AttnDims d{};
  d.prec = bf16 ? AttnPrec::BF16 : AttnPrec::F32;
  d.B = B, d.T = T, d.Hq = Hq, d.Hkv = Hkv, d.Dqk = Dqk, d.Dv = Dv;
  d.head_q = d.head_k = Dqk, d.head_v = d.head_o = Dv;
  d.ldq = Hq * Dqk, d.ldk = Hkv * Dqk, d.ldv = Hkv * Dv, d.ldo = Hq * Dv;
  d.scale = 1.0f / std::sqrt(float(Dqk));
  return d;
}

struct Buffers {
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv;
  std::vector<char> ws;
  explicit Buffers(const AttnDims& d) {
    const int64_t BT = d.B * d.T;
    q.resize(BT * d.ldq), k.resize(BT * d.ldk), v.resize(BT * d.ldv), out.resize(BT * d.ldo);
    lse.resize(d.B * d.Hq * d.T), dout.resize(BT * d.ldo);
    dq.resize(q.size()), dk.resize(k.size()), dv.resize(v.size());
    fill_normal(q.data(), int64_t(q.size()), rng_key(1, "q"), 0, 0, 1);
    fill_normal(k.data(), int64_t(k.size()), rng_key(1, "k"), 0, 0, 1);
    fill_normal(v.data(), int64_t(v.size()), rng_key(1, "v"), 0, 0, 1);
    fill_normal(dout.data(), int64_t(dout.size()), rng_key(1, "do"), 0, 0, 1);
    ws.resize(attention_workspace_bytes(d, num_threads()));
  }
};

void add_f32_pct(benchmark::State& st, double flops) {
  st.counters["pct_f32_peak"] = benchmark::Counter(flops * double(st.iterations()) * 1e-9 /
                                                       bench::limits().f32_gflops * 100.0,
                                                   benchmark::Counter::kIsRate);
}

AttnDims from_args(const benchmark::State& st) {
  return dims(st.range(0), st.range(1), st.range(2), st.range(3), st.range(4), st.range(5), st.range(6) != 0);
}

void BM_attention_fwd(benchmark::State& st) {
  const AttnDims d = from_args(st);
  Buffers b(d);
  for (auto _ : st) attention_forward(b.out.data(), b.lse.data(), b.q.data(), b.k.data(), b.v.data(), d, b.ws.data());
  bench::report_flops(st, attention_forward_flops(d));
  add_f32_pct(st, attention_forward_flops(d));
  st.counters["bf16_active"] = attention_bf16_active(d) ? 1 : 0;
}

void BM_attention_bwd(benchmark::State& st) {
  const AttnDims d = from_args(st);
  Buffers b(d);
  attention_forward(b.out.data(), b.lse.data(), b.q.data(), b.k.data(), b.v.data(), d, b.ws.data());
  for (auto _ : st)
    attention_backward(b.dq.data(), b.dk.data(), b.dv.data(), b.dout.data(), b.out.data(), b.lse.data(), b.q.data(),
                       b.k.data(), b.v.data(), d, b.ws.data());
  bench::report_flops(st, attention_backward_flops(d));
  add_f32_pct(st, attention_backward_flops(d));
  st.counters["bf16_active"] = attention_bf16_active(d) ? 1 : 0;
}

// Args: B, T, Hq, Hkv, Dqk, Dv, bf16; each shape in fp32, then bf16.
void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "T", "Hq", "Hkv", "Dqk", "Dv", "bf16"});
  for (int64_t bf : {0, 1}) {
    b->Args({8, 256, 8, 8, 64, 64, bf});     // ds_mini
    b->Args({8, 256, 8, 2, 64, 64, bf});     // ds_mini with GQA 4:1
    b->Args({2, 1024, 8, 8, 64, 64, bf});    // longer sequence, same tokens
    b->Args({2, 256, 8, 8, 192, 128, bf});   // MLA head dims (DeepSeek-V3: dn 128 + dr 64, dv 128)
    b->Args({1, 1024, 8, 1, 64, 64, bf});    // one MQA sequence: the backward takes its two-pass schedule
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_attention_fwd)->Apply(shapes);
BENCHMARK(BM_attention_bwd)->Apply(shapes);
