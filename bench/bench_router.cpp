// bench_router.cpp: the MoE router (forward + backward) and the permute / unpermute kernels at the ds_mini
// shape (N = 2048 tokens, E = 64 experts, k = 6, D = 512), as GB/s and percent of this machine's memcpy.
// The isa argument selects the path (0 = portable scalar, 1 = AVX2, 2 = AVX-512), so one run gives the ratios.
// Bytes counted: every array read or written once (a row read k times from cache is counted once).
// Note: at this shape the permuted buffer is 25 MB and x is 4 MB, so the working set lives largely in the
// 32 MB L3, while the memcpy limit is measured on 256 MB (DRAM): pct_memcpy above 100 is possible.
#include <memory>
#include <vector>

#include "bench_common.h"
#include "moetron/permute.h"
#include "moetron/rng.h"
#include "moetron/router.h"
#include "moetron/runtime.h"

using namespace moetron;

namespace {

constexpr int64_t kN = 2048, kE = 64, kK = 6, kD = 512;

RouterConfig ds_mini_v3() {
  RouterConfig c;
  c.E = kE, c.topk = kK, c.score = ScoreFn::Sigmoid, c.n_group = 8, c.topk_group = 4;
  c.group_score = GroupScore::Top2Sum, c.norm_topk = true, c.route_scale = 2.5f;
  c.aux = AuxMode::SeqWise, c.aux_coef = 1e-3f, c.seq_len = 256;
  return c;
}
RouterConfig ds_mini_v2() {
  RouterConfig c;
  c.E = kE, c.topk = kK, c.score = ScoreFn::Softmax, c.n_group = 8, c.topk_group = 3;
  c.group_score = GroupScore::Max, c.norm_topk = false, c.route_scale = 1.0f;
  c.aux = AuxMode::Global, c.aux_coef = 1e-3f, c.z_coef = 1e-3f;
  return c;
}

using bench::IsaScope;
std::vector<float> normal(int64_t n, const char* name, float sd = 1.0f) { return bench::normal_vec(n, 7, name, sd); }

struct RouterData {
  RouterConfig cfg;
  std::vector<float> logits, bias, g, w, s, dl;
  std::vector<int32_t> idx, cnt;
  std::vector<char> ws;
  explicit RouterData(RouterConfig c) : cfg(c) {
    logits = normal(kN * kE, "logits");
    bias = normal(kE, "bias", 0.1f);
    g = normal(kN * kK, "g");
    w.resize(kN * kK), s.resize(kN * kE), dl.resize(kN * kE), idx.resize(kN * kK), cnt.resize(kE);
    ws.resize(router_workspace_bytes(cfg, kN));
  }
  void fwd() {
    RouterLosses L;
    router_forward(idx.data(), w.data(), cnt.data(), s.data(), &L, logits.data(), bias.data(), cfg, kN, ws.data());
  }
  void bwd() { router_backward(dl.data(), g.data(), s.data(), idx.data(), logits.data(), cfg, kN, ws.data()); }
};
const double kRouterFwdBytes = double(kN * kE) * 4 * 2 + double(kN * kK) * 8;  // logits, scores, idx, w
const double kRouterBwdBytes = double(kN * kE) * 4 * 2 + double(kN * kK) * 8;  // scores, dlogits, g, idx

void BM_router_fwd_bwd(benchmark::State& st) {
  IsaScope isa(st.range(1));
  RouterData d(st.range(0) == 3 ? ds_mini_v3() : ds_mini_v2());
  for (auto _ : st) {
    d.fwd();
    d.bwd();
  }
  bench::report_bytes(st, kRouterFwdBytes + kRouterBwdBytes);
}
BENCHMARK(BM_router_fwd_bwd)->ArgNames({"dsv", "isa"})->Args({3, 2})->Args({3, 0})->Args({3, 1})->Args({2, 2})->Args({2, 0})->Args({2, 1})
    ->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_router_fwd(benchmark::State& st) {
  IsaScope isa(st.range(1));
  RouterData d(st.range(0) == 3 ? ds_mini_v3() : ds_mini_v2());
  for (auto _ : st) d.fwd();
  bench::report_bytes(st, kRouterFwdBytes);
}
BENCHMARK(BM_router_fwd)->ArgNames({"dsv", "isa"})->Args({3, 2})->Args({3, 0})->Args({3, 1})->Args({2, 2})
    ->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_router_bwd(benchmark::State& st) {
  IsaScope isa(st.range(1));
  RouterData d(st.range(0) == 3 ? ds_mini_v3() : ds_mini_v2());
  d.fwd();
  for (auto _ : st) d.bwd();
  bench::report_bytes(st, kRouterBwdBytes);
}
BENCHMARK(BM_router_bwd)->ArgNames({"dsv", "isa"})->Args({3, 2})->Args({3, 0})->Args({3, 1})->Args({2, 2})
    ->Unit(benchmark::kMicrosecond)->UseRealTime();

// Permute data: a real routing (ds_mini V3 router on random logits) and its dropless plan.
struct PermData {
  int64_t kN;  // tokens (shadows the ds_mini constant: the big variant uses 8x the tokens)
  std::vector<int32_t> idx, cnt, off, row_of, token_of, slot_of;
  std::vector<float> x, xp, yp, y, w, dy, dyp, dw, dx;
  std::vector<bf16> xb, dypb;
  int64_t R = 0;
  explicit PermData(int64_t n) : kN(n) {
    std::vector<float> logits = normal(kN * kE, "perm.logits"), bias = normal(kE, "bias", 0.1f);
    RouterConfig c = ds_mini_v3();
    c.aux = AuxMode::None;
    std::vector<float> s(kN * kE);
    std::vector<char> ws(router_workspace_bytes(c, kN));
    idx.resize(kN * kK), cnt.resize(kE), w.resize(kN * kK);
    router_forward(idx.data(), w.data(), cnt.data(), s.data(), nullptr, logits.data(), bias.data(), c, kN, ws.data());
    off.resize(kE + 1), row_of.resize(kN * kK), token_of.resize(kN * kK), slot_of.resize(kN * kK);
    moe_permute_plan(off.data(), row_of.data(), token_of.data(), slot_of.data(), idx.data(), cnt.data(), kN, kK, kE, 0);
    R = off[kE];
    x = normal(kN * kD, "x"), yp = normal(R * kD, "yp"), dy = normal(kN * kD, "dy");
    xp.resize(R * kD), y.resize(kN * kD), dyp.resize(R * kD), dw.resize(kN * kK), dx.resize(kN * kD);
    xb.resize(R * kD), dypb.resize(R * kD);
  }
};
// ds_mini (N = 2048: the buffers mostly live in L3) or 8x the tokens (N = 16384: 200 MB buffers, DRAM-bound).
// One instance at a time, so the big one does not stay resident.
PermData& perm(int64_t n = kN) {
  static std::unique_ptr<PermData> d;
  if (!d || d->kN != n) {
    d.reset();
    d = std::make_unique<PermData>(n);
  }
  return *d;
}

void BM_moe_permute_plan(benchmark::State& st) {
  auto& d = perm();
  std::vector<int32_t> off(kE + 1), row_of(kN * kK), token_of(kN * kK), slot_of(kN * kK);
  for (auto _ : st)
    moe_permute_plan(off.data(), row_of.data(), token_of.data(), slot_of.data(), d.idx.data(), d.cnt.data(), kN, kK,
                     kE, st.range(0) / 100.0);
  bench::report_bytes(st, double(kN * kK) * 4 * 4);  // idx read, row_of, token_of, slot_of written
}
BENCHMARK(BM_moe_permute_plan)->ArgNames({"cf_x100"})->Arg(0)->Arg(125)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_moe_permute_f32(benchmark::State& st) {
  IsaScope isa(st.range(0));
  auto& d = perm(st.range(1));
  const int64_t kN = d.kN;
  for (auto _ : st) moe_permute(d.xp.data(), d.x.data(), d.token_of.data(), d.R, kN, kD);
  bench::report_bytes(st, double(d.R) * kD * 4 * 2);
}
BENCHMARK(BM_moe_permute_f32)->ArgNames({"isa", "N"})->Args({2, 2048})->Args({0, 2048})->Args({1, 2048})->Args({2, 16384})->Args({0, 16384})->Args({1, 16384})->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_moe_permute_bf16(benchmark::State& st) {
  IsaScope isa(st.range(0));
  auto& d = perm(st.range(1));
  const int64_t kN = d.kN;
  for (auto _ : st) moe_permute(d.xb.data(), d.x.data(), d.token_of.data(), d.R, kN, kD);
  bench::report_bytes(st, double(d.R) * kD * (4 + 2));
}
BENCHMARK(BM_moe_permute_bf16)->ArgNames({"isa", "N"})->Args({2, 2048})->Args({0, 2048})->Args({1, 2048})->Args({2, 16384})->Args({0, 16384})->Args({1, 16384})->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_moe_permute_backward(benchmark::State& st) {
  IsaScope isa(st.range(0));
  auto& d = perm(st.range(1));
  const int64_t kN = d.kN;
  for (auto _ : st) moe_permute_backward(d.dx.data(), d.yp.data(), d.row_of.data(), kN, kK, d.R, kD);
  bench::report_bytes(st, double(d.R) * kD * 4 + double(kN) * kD * 4);
}
BENCHMARK(BM_moe_permute_backward)->ArgNames({"isa", "N"})->Args({2, 2048})->Args({0, 2048})->Args({1, 2048})->Args({2, 16384})->Args({0, 16384})->Args({1, 16384})->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_moe_unpermute(benchmark::State& st) {
  IsaScope isa(st.range(0));
  auto& d = perm(st.range(1));
  const int64_t kN = d.kN;
  for (auto _ : st) moe_unpermute(d.y.data(), d.yp.data(), d.row_of.data(), d.w.data(), kN, kK, d.R, kD);
  bench::report_bytes(st, double(d.R) * kD * 4 + double(kN) * kD * 4);
}
BENCHMARK(BM_moe_unpermute)->ArgNames({"isa", "N"})->Args({2, 2048})->Args({0, 2048})->Args({1, 2048})->Args({2, 16384})->Args({0, 16384})->Args({1, 16384})->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_moe_unpermute_backward(benchmark::State& st) {
  IsaScope isa(st.range(0));
  auto& d = perm(st.range(1));
  const int64_t kN = d.kN;
  for (auto _ : st)
    moe_unpermute_backward(d.dyp.data(), d.dw.data(), d.dy.data(), d.yp.data(), d.row_of.data(), d.token_of.data(), d.slot_of.data(), d.w.data(), kN, kK,
                           d.R, kD);
  bench::report_bytes(st, double(d.R) * kD * 4 * 2 + double(kN) * kD * 4);  // yp read, dyp written, dy read
}
BENCHMARK(BM_moe_unpermute_backward)->ArgNames({"isa", "N"})->Args({2, 2048})->Args({0, 2048})->Args({1, 2048})->Args({2, 16384})->Args({0, 16384})->Args({1, 16384})->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_moe_unpermute_backward_bf16(benchmark::State& st) {
  IsaScope isa(st.range(0));
  auto& d = perm(st.range(1));
  const int64_t kN = d.kN;
  for (auto _ : st)
    moe_unpermute_backward(d.dypb.data(), d.dw.data(), d.dy.data(), d.yp.data(), d.row_of.data(), d.token_of.data(), d.slot_of.data(), d.w.data(), kN, kK,
                           d.R, kD);
  bench::report_bytes(st, double(d.R) * kD * (4 + 2) + double(kN) * kD * 4);
}
BENCHMARK(BM_moe_unpermute_backward_bf16)->ArgNames({"isa", "N"})->Args({2, 2048})->Args({0, 2048})->Args({1, 2048})->Args({2, 16384})->Args({0, 16384})->Args({1, 16384})->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
