// bench_attention_step.cpp: what bf16 attention does to a training micro-step: ds_mini (configs/ds_mini.toml, its
// micro-batch of 8 x 256 tokens, bf16 compute) forward + backward with ModelParallel::attention = FP32 and = BF16,
// side by side in one run (repeat the run, alternating, on a shared machine). Counters: ms per micro-step (real
// time), tokens/s, and attn_bf16 (the attention the model was told to run, ModelParallel::attention). Skipped
// where bf16 compute is not native. Not the trainer (no optimizer step, no data loading): the step's compute only.
#include <vector>

#include "bench_common.h"
#include "moetron/config.h"
#include "moetron/gemm.h"
#include "moetron/model.h"

using namespace moetron;

namespace {

// Arg: 0 = fp32 attention, 1 = bf16 attention (both under bf16 compute).
void BM_ds_mini_step(benchmark::State& st) {
  if (!gemm_bf16_native()) {
    st.SkipWithError("bf16 compute is not native here");
    return;
  }
  const JobConfig c = load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/ds_mini.toml");
  const int64_t B = c.training.micro_batch_size, T = c.training.seq_len, N = B * T;
  ModelParallel mp;
  mp.attention = st.range(0) ? ComputeDtype::BF16 : ComputeDtype::FP32;
  Model m(c.model, B, T, {}, mp, ComputeDtype::BF16);
  m.init_params(1);
  m.sync_weights();
  std::vector<int32_t> tok(static_cast<size_t>(N)), tgt(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) tok[size_t(i)] = int32_t((i * 7919) % c.model.vocab_size), tgt[size_t(i)] = tok[size_t((i + 1) % N)];
  m.zero_grads();
  m.forward_backward(tok.data(), tgt.data(), 1.0f / float(N), 1.0f);  // warm-up (oneDNN primitives, pages)
  for (auto _ : st) m.forward_backward(tok.data(), tgt.data(), 1.0f / float(N), 1.0f);
  st.counters["tokens_per_s"] = benchmark::Counter(double(N) * double(st.iterations()), benchmark::Counter::kIsRate);
  st.counters["attn_bf16"] = st.range(0);
}

}  // namespace

BENCHMARK(BM_ds_mini_step)->ArgName("attn_bf16")->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
