// bench_optim_step.cpp: the optimizer step's memory passes on ds_mini (configs/ds_mini.toml, every parameter on one
// rank): AdamW over every parameter followed by the weight refresh (Model::sync_weights: the bf16 copy, the routed
// experts' packed panels), against the same work fused piece by piece (Model::update_and_sync: each piece refreshed
// right after its update, while its masters are in cache). Each iteration runs both, alternating which goes first,
// so the two figures share the machine's conditions, then AdamW alone (what the refresh adds); counters are the
// medians (ms) and fused / separate. The results are bitwise the same (the trainer's tests hold that); this is not
// a correctness check.
#include <algorithm>
#include <chrono>
#include <vector>

#include "bench_common.h"
#include "moetron/config.h"
#include "moetron/model.h"
#include "moetron/optim.h"

using namespace moetron;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void BM_optim_step(benchmark::State& st) {
  const JobConfig c = load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/ds_mini.toml");
  Model m(c.model, c.training.micro_batch_size, c.training.seq_len, {}, {}, ComputeDtype::Auto);
  m.init_params(1);
  const int64_t n = m.num_params();
  std::vector<float> mom(size_t(n), 0.0f), var(size_t(n), 0.0f);
  float* g = m.grad_data();
  for (int64_t i = 0; i < n; ++i) g[i] = 1e-3f * float((i * 7919) % 2001 - 1000) / 1000.0f;
  AdamWConfig ac;
  float* p = m.param_data();
  int64_t step = 0;
  auto adamw = [&](int64_t lo, int64_t hi) {  // the parameters' elements in [lo, hi)
    for (const ParamEntry& e : m.params()) {
      const int64_t a = std::max(lo, e.offset), b = std::min(hi, e.offset + e.numel);
      if (a < b) adamw_step(p + a, mom.data() + a, var.data() + a, g + a, b - a, ac, step, 1.0f, e.decay);
    }
  };
  auto separate = [&] {
    adamw(0, n);
    m.sync_weights();
  };
  auto fused = [&] { m.update_and_sync(adamw); };
  auto time = [&](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    ++step;
    f();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  time(separate), time(fused);  // warm-up (pages, the refresh's piece plan)
  std::vector<double> ts, tf, ta;
  bool fused_first = false;
  for (auto _ : st) {
    if (fused_first) tf.push_back(time(fused)), ts.push_back(time(separate));
    else ts.push_back(time(separate)), tf.push_back(time(fused));
    ta.push_back(time([&] { adamw(0, n); }));
    fused_first = !fused_first;
  }
  st.counters["adamw_only_ms"] = median(ta);
  st.counters["separate_ms"] = median(ts);
  st.counters["fused_ms"] = median(tf);
  st.counters["fused_over_separate"] = median(tf) / median(ts);
  st.counters["params_M"] = double(n) / 1e6;
}

}  // namespace

BENCHMARK(BM_optim_step)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(20);
