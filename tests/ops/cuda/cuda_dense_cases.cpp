// cuda_dense_cases.cpp: op harness cases (--device cuda) for the CUDA backend's dense GEMMs (cuBLAS), its grouped
// GEMM, RMSNorm, SwiGLU, RoPE and AdamW, each against the CPU op family's _ref twin in fp64 on the same inputs.
// Tolerances (normwise ||got - ref|| / ||ref||), derived:
//   fp32 element-wise/row ops (norm, swiglu): a few fp32 roundings per element plus a row sum of C terms:
//     ~1e-7..1e-6; held to 1e-5 ("far under 1e-3").
//   GEMMs on bf16 operands against the reference on the SAME bf16 values: products are exact in fp32, only the
//     fp32 accumulation rounds (sqrt(K) * 2^-24 ~ 1e-6 at K = 4096; tensor-core accumulation may drop alignment
//     bits): held to 1e-4. Against the unrounded fp32 operands the bf16 rounding of both operands (2^-9 each,
//     independent) gives ~ 2^-9 * sqrt(2) / sqrt(typical cancellation) ~ 3e-3: held to 1e-2 (the bf16 band).
//   bf16 outputs (y16, h16): one rounding to bf16, 2^-9 = 2e-3 relative per element: held to 4e-3.
//   AdamW and RoPE: the same fp32 operations in the same order without contraction: bitwise the float twin.
// Grad mode: the adjoint identities of the linear ops (<A x, y> = <x, A^T y> with the device's forward and
// backward), and directional derivatives of the device forward for RMSNorm and SwiGLU.
#include <cmath>
#include <memory>
#include <numeric>

#include "cuda/cuda_util.h"
#include "moetron/cuda/gemm.h"
#include "moetron/cuda/ops.h"
#include "moetron/gemm.h"
#include "moetron/norm.h"
#include "moetron/optim.h"
#include "moetron/rope.h"
#include "moetron/swiglu.h"

namespace moetron::ops {
namespace {

using namespace cu;

// ---- dense GEMM (cuBLAS) -------------------------------------------------------------------------------------
struct GemmBf16Case : OpCase {
  cuda::Op ta, tb;
  int64_t M, N, K;
  float beta;
  GemmBf16Case(cuda::Op a, cuda::Op b, int64_t m, int64_t n, int64_t k, float be, const char* nm)
      : ta(a), tb(b), M(m), N(n), K(k), beta(be) {
    name = nm;
    device = "cuda";
    flops = 2.0 * double(M) * double(N) * double(K);
  }
  int64_t lda() const { return ta == cuda::Op::N ? K : M; }
  int64_t ldb() const { return tb == cuda::Op::N ? N : K; }
  void test(Report& r) override {
    if (double(M) * N * K > 1e9) return sampled(r);
    auto A = rnd(M * K, name + "A"), B = rnd(K * N, name + "B"), C0 = rnd(M * N, name + "C");
    auto A16 = to_bf(A), B16 = to_bf(B);
    auto dA = up(A16), dB = up(B16);
    cuda::DeviceBuffer dC = beta == 0 ? poisoned<float>(M * N) : up(C0);
    cuda::gemm_bf16(ta, tb, M, N, K, 1.0f, dA.as<bf16>(), lda(), dB.as<bf16>(), ldb(), beta, dC.as<float>(), N, nullptr);
    auto got = down<float>(dC, M * N);
    std::vector<double> ref(M * N), ref32(M * N), Cd(C0.begin(), C0.end()), Cd2 = Cd;
    const Trans TA = ta == cuda::Op::N ? Trans::N : Trans::T, TB = tb == cuda::Op::N ? Trans::N : Trans::T;
    auto Ad = bf_f64(A16), Bd = bf_f64(B16);
    gemm_ref<double>(TA, TB, M, N, K, 1.0, Ad.data(), lda(), Bd.data(), ldb(), beta, Cd.data(), N);
    r.compare_rel("C vs fp64 twin on the bf16 operands", got.data(), Cd.data(), M * N, 1e-4);
    auto Af = to_f64(A), Bf = to_f64(B);
    gemm_ref<double>(TA, TB, M, N, K, 1.0, Af.data(), lda(), Bf.data(), ldb(), beta, Cd2.data(), N);
    r.compare_rel("C vs fp64 twin on the unrounded fp32 operands", got.data(), Cd2.data(), M * N, 1e-2);
  }
  // Large shapes (NN, beta 0): the fp64 twin on every 64th row only (the CPU reference would take minutes).
  void sampled(Report& r) {
    auto A16 = to_bf(rnd(M * K, name + "A")), B16 = to_bf(rnd(K * N, name + "B"));
    auto dA = up(A16), dB = up(B16);
    auto dC = poisoned<float>(M * N);
    cuda::gemm_bf16(cuda::Op::N, cuda::Op::N, M, N, K, 1.0f, dA.as<bf16>(), K, dB.as<bf16>(), N, 0.0f, dC.as<float>(), N, nullptr);
    auto got = down<float>(dC, M * N);
    auto Ad = bf_f64(A16), Bd = bf_f64(B16);
    std::vector<float> g;
    std::vector<double> want;
    std::vector<double> row(N);
    for (int64_t i = 0; i < M; i += 64) {
      gemm_ref<double>(Trans::N, Trans::N, 1, N, K, 1.0, Ad.data() + i * K, K, Bd.data(), N, 0.0, row.data(), N);
      g.insert(g.end(), got.begin() + i * N, got.begin() + (i + 1) * N);
      want.insert(want.end(), row.begin(), row.end());
    }
    int64_t nonfinite = 0;
    for (float x : got) nonfinite += !std::isfinite(x);
    r.check(nonfinite == 0, "every element of C written and finite", std::to_string(nonfinite) + " not");
    r.compare_rel("C rows 0, 64, 128, ... vs fp64 twin on the bf16 operands", g.data(), want.data(), int64_t(g.size()), 1e-4);
  }
  void grad(Report& r) override {  // <A B, G> = <A, G B^T> through the device's own NT product
    if (double(M) * N * K > 1e9) return r.check(true, "adjoint: covered by the small NN case");
    if (ta != cuda::Op::N || tb != cuda::Op::N) return r.check(true, "adjoint: covered by the NN case");
    auto A16 = to_bf(rnd(M * K, name + "gA")), B16 = to_bf(rnd(K * N, name + "gB")), G16 = to_bf(rnd(M * N, name + "gG"));
    auto dA = up(A16), dB = up(B16), dG = up(G16);
    auto dC = poisoned<float>(M * N), dGA = poisoned<float>(M * K);
    cuda::gemm_bf16(cuda::Op::N, cuda::Op::N, M, N, K, 1.0f, dA.as<bf16>(), K, dB.as<bf16>(), N, 0.0f, dC.as<float>(), N, nullptr);
    cuda::gemm_bf16(cuda::Op::N, cuda::Op::T, M, K, N, 1.0f, dG.as<bf16>(), N, dB.as<bf16>(), N, 0.0f, dGA.as<float>(), K, nullptr);
    const double lhs = dotd(down<float>(dC, M * N), bf_f32(G16)), rhs = dotd(bf_f32(A16), down<float>(dGA, M * K));
    std::vector<float> got{float(lhs)};
    std::vector<double> want{rhs};
    r.compare_rel("<A B, G> = <A, G B^T>", got.data(), want.data(), 1, 1e-4);
  }
  void perf() override {
    static std::unique_ptr<cuda::DeviceBuffer> a, b, c;
    static const void* owner = nullptr;
    if (owner != this) {
      owner = this;
      a = std::make_unique<cuda::DeviceBuffer>(up(to_bf(rnd(M * K, "pa"))));
      b = std::make_unique<cuda::DeviceBuffer>(up(to_bf(rnd(K * N, "pb"))));
      c = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(M * N));
    }
    cuda::gemm_bf16(ta, tb, M, N, K, 1.0f, a->as<bf16>(), lda(), b->as<bf16>(), ldb(), 0.0f, c->as<float>(), N, nullptr);
    sync();
  }
};

struct GemmF32Case : OpCase {
  int64_t M = 129, N = 100, K = 300;
  GemmF32Case() {
    name = "gemm/cuda_f32_nt";
    device = "cuda";
    flops = 2.0 * double(M) * double(N) * double(K);
  }
  void test(Report& r) override {
    auto A = rnd(M * K, "fA"), B = rnd(N * K, "fB");
    auto dA = up(A), dB = up(B);
    auto dC = poisoned<float>(M * N);
    cuda::gemm_f32(cuda::Op::N, cuda::Op::T, M, N, K, 0.5f, dA.as<float>(), K, dB.as<float>(), K, 0.0f, dC.as<float>(), N, nullptr);
    auto got = down<float>(dC, M * N);
    std::vector<double> ref(M * N);
    auto Ad = to_f64(A), Bd = to_f64(B);
    gemm_ref<double>(Trans::N, Trans::T, M, N, K, 0.5, Ad.data(), K, Bd.data(), K, 0.0, ref.data(), N);
    r.compare_rel("C (fp32, no TF32) vs fp64 twin", got.data(), ref.data(), M * N, 1e-5);
  }
  void grad(Report& r) override { r.check(true, "adjoint: covered by gemm/cuda_bf16_nn"); }
  void perf() override {}
};

// ---- grouped GEMM (own kernel, counts read on the device) ----------------------------------------------------
struct GroupedCase : OpCase {
  int64_t E, K, N;
  std::vector<int32_t> counts;
  GroupedCase(const char* nm, int64_t e, int64_t k, int64_t n, std::vector<int32_t> c) : E(e), K(k), N(n), counts(std::move(c)) {
    name = nm;
    device = "cuda";
    flops = 2.0 * double(M()) * double(K) * double(N);
  }
  int64_t M() const { return std::accumulate(counts.begin(), counts.end(), int64_t(0)); }
  void test(Report& r) override {
    const int64_t Mr = M();
    if (double(Mr) * K * N > 1e9) return r.check(true, "large shape: perf only (gpu_check.sh's bench times it)");
    auto X16 = to_bf(rnd(Mr * K, name + "X")), W16 = to_bf(rnd(E * K * N, name + "W", 0.05f)),
         dY16 = to_bf(rnd(Mr * N, name + "dY"));
    auto dW0 = rnd(E * K * N, name + "dW0");
    auto dX = up(X16), dWt = up(W16), ddY = up(dY16), dcounts = up(counts);
    cuda::DeviceBuffer ws(cuda::grouped_gemm_workspace_bytes(E), MemCategory::Workspace);
    auto Y = poisoned<float>(Mr * N), dXo = poisoned<float>(Mr * K), dW = up(dW0);
    cuda::grouped_gemm_fwd(Y.as<float>(), dX.as<bf16>(), dWt.as<bf16>(), dcounts.as<int32_t>(), E, Mr, K, N, ws.data(), nullptr);
    cuda::grouped_gemm_dgrad(dXo.as<float>(), ddY.as<bf16>(), dWt.as<bf16>(), dcounts.as<int32_t>(), E, Mr, K, N, ws.data(), nullptr);
    cuda::grouped_gemm_wgrad(dW.as<float>(), dX.as<bf16>(), ddY.as<bf16>(), dcounts.as<int32_t>(), E, Mr, K, N, true, ws.data(), nullptr);
    auto Xd = bf_f64(X16), Wd = bf_f64(W16), dYd = bf_f64(dY16);
    std::vector<double> Yr(Mr * N), dXr(Mr * K), dWr(dW0.begin(), dW0.end());
    int64_t row = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = counts[e];
      const double* We = Wd.data() + e * K * N;
      gemm_ref<double>(Trans::N, Trans::N, m, N, K, 1.0, Xd.data() + row * K, K, We, N, 0.0, Yr.data() + row * N, N);
      gemm_ref<double>(Trans::N, Trans::T, m, K, N, 1.0, dYd.data() + row * N, N, We, N, 0.0, dXr.data() + row * K, K);
      gemm_ref<double>(Trans::T, Trans::N, K, N, m, 1.0, Xd.data() + row * K, K, dYd.data() + row * N, N, 1.0,
                       dWr.data() + e * K * N, N);
      row += m;
    }
    r.compare_rel("forward Y vs twin", down<float>(Y, Mr * N).data(), Yr.data(), Mr * N, 1e-4);
    r.compare_rel("dgrad dX vs twin", down<float>(dXo, Mr * K).data(), dXr.data(), Mr * K, 1e-4);
    r.compare_rel("wgrad dW (+=) vs twin", down<float>(dW, E * K * N).data(), dWr.data(), E * K * N, 1e-4);
  }
  void grad(Report& r) override {  // <fwd(X), dY> = <X, dgrad(dY)> = <W, wgrad(X, dY)>
    const int64_t Mr = M();
    if (double(Mr) * K * N > 1e9) return r.check(true, "large shape: perf only");
    auto X16 = to_bf(rnd(Mr * K, name + "gX")), W16 = to_bf(rnd(E * K * N, name + "gW")), dY16 = to_bf(rnd(Mr * N, name + "gdY"));
    auto dX = up(X16), dWt = up(W16), ddY = up(dY16), dcounts = up(counts);
    cuda::DeviceBuffer ws(cuda::grouped_gemm_workspace_bytes(E), MemCategory::Workspace);
    auto Y = poisoned<float>(Mr * N), dXo = poisoned<float>(Mr * K), dW = poisoned<float>(E * K * N);
    cuda::grouped_gemm_fwd(Y.as<float>(), dX.as<bf16>(), dWt.as<bf16>(), dcounts.as<int32_t>(), E, Mr, K, N, ws.data(), nullptr);
    cuda::grouped_gemm_dgrad(dXo.as<float>(), ddY.as<bf16>(), dWt.as<bf16>(), dcounts.as<int32_t>(), E, Mr, K, N, ws.data(), nullptr);
    cuda::grouped_gemm_wgrad(dW.as<float>(), dX.as<bf16>(), ddY.as<bf16>(), dcounts.as<int32_t>(), E, Mr, K, N, false, ws.data(), nullptr);
    const double a = dotd(down<float>(Y, Mr * N), bf_f32(dY16)), b = dotd(bf_f32(X16), down<float>(dXo, Mr * K)),
                 c = dotd(bf_f32(W16), down<float>(dW, E * K * N));
    std::vector<float> got{float(b), float(c)};
    std::vector<double> want{a, a};
    r.compare_rel("<Y, dY> = <X, dX> = <W, dW>", got.data(), want.data(), 2, 1e-4);
  }
  void perf() override {
    static std::unique_ptr<cuda::DeviceBuffer> x, w, y, c, ws;
    const int64_t Mr = M();
    static const void* owner = nullptr;
    if (owner != this) {
      owner = this;
      x = std::make_unique<cuda::DeviceBuffer>(up(to_bf(rnd(Mr * K, "px"))));
      w = std::make_unique<cuda::DeviceBuffer>(up(to_bf(rnd(E * K * N, "pw"))));
      y = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(Mr * N));
      c = std::make_unique<cuda::DeviceBuffer>(up(counts));
      ws = std::make_unique<cuda::DeviceBuffer>(cuda::grouped_gemm_workspace_bytes(E), MemCategory::Workspace);
    }
    cuda::grouped_gemm_fwd(y->as<float>(), x->as<bf16>(), w->as<bf16>(), c->as<int32_t>(), E, Mr, K, N, ws->data(), nullptr);
    sync();
  }
};

std::vector<int32_t> ragged_counts() { return {0, 1, 63, 64, 65, 130, 7, 0, 200, 17}; }
std::vector<int32_t> even_counts(int64_t E, int32_t m) { return std::vector<int32_t>(size_t(E), m); }

MT_REGISTER_OP_CASES([] {
  std::vector<std::unique_ptr<OpCase>> v;
  using O = cuda::Op;
  v.push_back(std::make_unique<GemmBf16Case>(O::N, O::N, 257, 384, 200, 0.0f, "gemm/cuda_bf16_nn"));
  v.push_back(std::make_unique<GemmBf16Case>(O::N, O::T, 130, 96, 513, 0.5f, "gemm/cuda_bf16_nt_beta"));
  v.push_back(std::make_unique<GemmBf16Case>(O::T, O::N, 64, 200, 77, 0.0f, "gemm/cuda_bf16_tn"));
  v.push_back(std::make_unique<GemmBf16Case>(O::N, O::N, 4096, 4096, 4096, 0.0f, "gemm/cuda_bf16_4096"));
  v.push_back(std::make_unique<GemmF32Case>());
  v.push_back(std::make_unique<GroupedCase>("grouped_gemm/cuda_ragged", 10, 96, 80, ragged_counts()));
  v.push_back(std::make_unique<GroupedCase>("grouped_gemm/cuda_v2lite", 16, 2048, 1408, even_counts(16, 1024)));
  return v;
});

}  // namespace
}  // namespace moetron::ops
