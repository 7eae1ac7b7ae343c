// loss_cases.cpp: op-harness cases for the fused linear + cross-entropy (family loss).
//   loss/fused_<f32|bf16>_N<n>_C<c>_V<v>_ch<chunk>   fused forward+backward and forward-only vs the
//        unfused reference (double) on the same (bf16-rounded) inputs; bitwise determinism run to run and
//        1 vs 2 threads; dW accumulates (+=); ignored rows give zero loss and gradient
// Grad mode: the reference in double vs central finite differences, for dh and dW.
//
// Tolerances (per case, from error analysis on the case's own data):
//   dz     = gamma_C * max_{n,v} sum_c |h_nc||W_vc|     fp32-accumulated logits error, gamma_C = C 2^-24
//   loss   : per row |d(lse - z_t)| <= 2 dz + exp/log rounding (taken as 16 2^-24 (1 + max row loss))
//            -> atol = |loss_scale| * n_valid * that
//   The worst-case dz is loose for random data (oneDNN's actual error is ~1000x smaller), so the _exact
//   cases use inputs whose logits are exact (dz = 0): there the bounds are tight and a small error in the
//   row kernel (e.g. an fp32 sum of exps) shows.
//   dlogits: |d p_v| <= p_v (2 dz + 8 2^-24)  (softmax is 1-Lipschitz in the max-norm of z, times p)
//            bf16 adds rounding 2^-9 |d_v| per entry (dlogits are rounded to bf16 for the GEMMs)
//   dh     : sum_v |d d_nv| |W_vc| <= 2 |loss_scale| max|W| (2 dz + 8 2^-24 + r_b) + gamma_V-term
//   dW     : sum_n |d d_nv| |h_nc| <= n_valid |loss_scale| max|h| (2 dz + 8 2^-24 + r_b) (+ gamma_N term)
//            with r_b = 2^-9 for bf16 (0 for fp32); each |d_nv| <= |loss_scale|, sum_v |d_nv| <= 2 |loss_scale|.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "moetron/gemm.h"
#include "moetron/loss.h"
#include "moetron/memory.h"

using namespace moetron;
using namespace moetron::ops;

namespace {

struct Workspace {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Workspace(size_t b) : bytes(b) { p = b ? mt_alloc(b, MemCategory::Workspace) : nullptr; }
  ~Workspace() {
    if (p) mt_free(p, bytes, MemCategory::Workspace);
  }
};

std::vector<int32_t> make_targets(int64_t N, int64_t V, uint64_t seed) {
  auto u = randu(N, seed, 0.0f, 1.0f);
  std::vector<int32_t> t(N);
  for (int64_t n = 0; n < N; ++n) t[n] = u[n] < 0.15f ? kIgnoreIndex : int32_t(std::min<int64_t>(V - 1, int64_t(u[n] * V)));
  if (N > 0) t[0] = int32_t(V - 1);  // the last vocabulary entry (tail lanes) is a target at least once
  return t;
}

struct FusedCase : OpCase {
  bool bf;
  int64_t N, C, V, chunk;
  bool exact;  // inputs k/8 (|k| <= 4): every product and partial sum of the logits GEMM is exact in fp32
  FusedCase(bool bf16_, int64_t N_, int64_t C_, int64_t V_, int64_t chunk_, bool exact_ = false)
      : bf(bf16_), N(N_), C(C_), V(V_), chunk(chunk_), exact(exact_) {
    std::ostringstream os;
    os << "loss/fused_" << (bf ? "bf16" : "f32") << "_N" << N << "_C" << C << "_V" << V << "_ch" << chunk
       << (exact ? "_exact" : "");
    name = os.str();
    fd_eps = 1e-5;
    grad_tol = 1e-6;
  }

  // Inputs as float (bf16-rounded for the bf16 variant, so the reference sees exactly the kernel's input).
  void inputs(std::vector<float>& h, std::vector<float>& W, std::vector<int32_t>& t) const {
    h = randn(N * C, 21, 1.0f);
    W = randn(V * C, 22, 0.5f);
    if (exact) {
      // Multiples of 1/8 in [-1/2, 1/2]: products are multiples of 1/64 and |z| <= C/4, so with C <= 2^12
      // every partial sum fits in 24 bits: the logits are exact in any summation order (dz = 0 below).
      for (auto& x : h) x = std::max(-4.0f, std::min(4.0f, std::nearbyint(x * 2.0f))) / 8.0f;
      for (auto& x : W) x = std::max(-4.0f, std::min(4.0f, std::nearbyint(x * 4.0f))) / 8.0f;
    }
    if (bf) {
      for (auto& x : h) x = round_bf16(x);
      for (auto& x : W) x = round_bf16(x);
    }
    t = make_targets(N, V, 23);
  }

  // Runs the fused kernel (grad: fwd+bwd, else forward only).
  double run(std::vector<float>& dh, std::vector<float>& dW, std::vector<double>* row_loss, const std::vector<float>& h,
             const std::vector<float>& W, const std::vector<int32_t>& t, float scale, bool grad) const {
    Workspace ws(linear_xent_workspace_bytes(N, V, chunk));
    if (bf) {
      std::vector<bf16> hb(N * C), Wb(V * C);
      f32_to_bf16(hb.data(), h.data(), N * C);
      f32_to_bf16(Wb.data(), W.data(), V * C);
      if (grad) return linear_xent_fwd_bwd_bf16(dh.data(), dW.data(), hb.data(), Wb.data(), t.data(), N, C, V, scale, chunk, ws.p);
      return linear_xent_fwd_bf16(row_loss ? row_loss->data() : nullptr, hb.data(), Wb.data(), t.data(), N, C, V, scale,
                                  chunk, ws.p);
    }
    if (grad) return linear_xent_fwd_bwd_f32(dh.data(), dW.data(), h.data(), W.data(), t.data(), N, C, V, scale, chunk, ws.p);
    return linear_xent_fwd_f32(row_loss ? row_loss->data() : nullptr, h.data(), W.data(), t.data(), N, C, V, scale,
                               chunk, ws.p);
  }

  void test(Report& r) override {
    std::vector<float> h, W;
    std::vector<int32_t> t;
    inputs(h, W, t);
    int64_t valid = 0;
    for (auto x : t) valid += x >= 0;
    const float scale = 1.0f / float(std::max<int64_t>(valid, 1));
    // Reference in double; dW starts from a nonzero value to check the accumulation.
    auto dW0 = randn(V * C, 24, 0.01f);
    auto hd = to_f64(h), Wd = to_f64(W);
    std::vector<double> dh_ref(N * C), dW_ref = to_f64(dW0), rl_ref(N);
    const double loss_ref =
        linear_xent_ref<double>(rl_ref.data(), dh_ref.data(), dW_ref.data(), hd.data(), Wd.data(), t.data(), N, C, V, scale);

    std::vector<float> dh(N * C, 123.0f), dW = dW0;
    const double loss = run(dh, dW, nullptr, h, W, t, scale, true);

    // Tolerances from the header comment.
    double dzsum = 0, maxW = 0, maxh = 0, maxlse = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = 0; v < V; ++v) {
        double s = 0;
        for (int64_t c = 0; c < C; ++c) s += std::fabs(hd[n * C + c] * Wd[v * C + c]);
        dzsum = std::max(dzsum, s);
      }
    for (double x : Wd) maxW = std::max(maxW, std::fabs(x));
    for (double x : hd) maxh = std::max(maxh, std::fabs(x));
    for (double x : rl_ref) maxlse = std::max(maxlse, std::fabs(x));
    const double u = std::ldexp(1.0, -24);
    const double dz = exact ? 0.0 : C * u * dzsum;
    const double rb = bf ? std::ldexp(1.0, -9) : 0.0;
    const double dd = 2 * dz + 8 * u + rb;  // relative error of one dlogit
    // Row kernel (exp within 2 ulp, double sum and log): a few ulp of the row's logit scale, taken as 16 u.
    const double row_tol = 2 * dz + 16 * u * (1 + maxlse);
    const double atol_loss = scale * valid * row_tol;
    const double atol_dh = 2 * scale * maxW * (dd + V * u);
    const double atol_dW = valid * scale * maxh * (dd + N * u);
    r.compare("loss vs unfused ref (double)", &loss, &loss_ref, 1, atol_loss, 0.0);
    auto dhf = to_f64(dh), dWf = to_f64(dW);
    r.compare("dh vs ref", dhf.data(), dh_ref.data(), N * C, atol_dh, 0.0);
    r.compare("dW (+= onto nonzero) vs ref", dWf.data(), dW_ref.data(), V * C, atol_dW, 0.0);

    // The twin in T = float (same unfused algorithm, fp32 sums): within the same analytic bounds.
    {
      std::vector<float> dhr(N * C), dWr = dW0, rlr(N);
      const float lr = linear_xent_ref<float>(rlr.data(), dhr.data(), dWr.data(), h.data(), W.data(), t.data(), N, C, V,
                                              scale);
      const double lrd = lr;
      auto a = to_f64(dhr), b = to_f64(dWr);
      r.compare("ref<float> loss vs ref<double>", &lrd, &loss_ref, 1, atol_loss + scale * valid * V * u * 4, 0.0);
      r.compare("ref<float> dh vs ref<double>", a.data(), dh_ref.data(), N * C, atol_dh, 0.0);
      r.compare("ref<float> dW vs ref<double>", b.data(), dW_ref.data(), V * C, atol_dW, 0.0);
    }

    // Forward only: the same loss bitwise (same GEMM, same row kernel), and per-row losses.
    std::vector<double> rl(N, -1.0);
    std::vector<float> unused;
    const double loss_fwd = run(unused, unused, &rl, h, W, t, scale, false);
    r.check(std::memcmp(&loss_fwd, &loss, 8) == 0, "forward-only loss == fused loss (bitwise)");
    r.compare("per-row loss vs ref (unscaled)", rl.data(), rl_ref.data(), N, row_tol, 0.0);
    bool ign = true;
    for (int64_t n = 0; n < N; ++n)
      if (t[n] < 0) {
        ign &= rl[n] == 0.0;
        for (int64_t c = 0; c < C; ++c) ign &= dh[n * C + c] == 0.0f;
      }
    r.check(ign, "ignored rows: zero row loss and zero dh");

    // Determinism: run to run, and 1 thread vs the default, bitwise.
    std::vector<float> dh2(N * C), dW2 = dW0, dh1(N * C), dW1 = dW0;
    const double loss2 = run(dh2, dW2, nullptr, h, W, t, scale, true);
    double loss1 = 0;
    with_threads(1, [&] { loss1 = run(dh1, dW1, nullptr, h, W, t, scale, true); });
    r.check(std::memcmp(&loss2, &loss, 8) == 0 && dh2 == dh && dW2 == dW, "run to run (bitwise)");
    r.check(std::memcmp(&loss1, &loss, 8) == 0 && dh1 == dh && dW1 == dW,
            "1 thread == " + std::to_string(omp_get_max_threads()) + " threads (bitwise)");

    // A non-finite logit makes that row's loss (and the total) NaN instead of hiding it.
    std::vector<float> hn = h;
    const int64_t bad_row = t[0] >= 0 ? 0 : 1;
    hn[bad_row * C] = NAN;
    std::vector<double> rln(N);
    const double lossn = run(unused, unused, &rln, hn, W, t, scale, false);
    r.check(std::isnan(lossn) && std::isnan(rln[bad_row]), "NaN input -> NaN row loss and total");
  }

  void grad(Report& r) override {
    std::vector<float> hf, Wf;
    std::vector<int32_t> t;
    inputs(hf, Wf, t);
    auto h = to_f64(hf), W = to_f64(Wf);
    const double scale = 0.37;
    std::vector<double> dh(N * C), dW(V * C, 0.0);
    linear_xent_ref<double>(nullptr, dh.data(), dW.data(), h.data(), W.data(), t.data(), N, C, V, scale);
    auto loss = [&] {
      return linear_xent_ref<double>(nullptr, nullptr, nullptr, h.data(), W.data(), t.data(), N, C, V, scale);
    };
    r.fd_check("dh (ref, double)", h.data(), N * C, dh.data(), loss, fd_eps, grad_tol);
    r.fd_check("dW (ref, double)", W.data(), V * C, dW.data(), loss, fd_eps, grad_tol);
  }

  void perf() override {
    // The benchmark shape of bench_loss: N=2048, C=512, V=8192 (fp32 or bf16 inputs).
    const int64_t n = 2048, c = 512, v = 8192;
    struct Data {
      std::vector<float> hf, Wf, dh, dW;
      std::vector<bf16> hb, Wb;
      std::vector<int32_t> t;
      Workspace ws{linear_xent_workspace_bytes(2048, 8192, 0)};
    };
    static Data* d = nullptr;
    if (!d) {
      d = new Data;
      d->hf = randn(n * c, 1, 1.0f), d->Wf = randn(v * c, 2, 0.05f);
      d->hb.resize(n * c), d->Wb.resize(v * c), d->dh.resize(n * c), d->dW.assign(v * c, 0.0f);
      f32_to_bf16(d->hb.data(), d->hf.data(), n * c);
      f32_to_bf16(d->Wb.data(), d->Wf.data(), v * c);
      d->t = make_targets(n, v, 3);
    }
    flops = 3 * 2.0 * double(n) * double(v) * double(c);
    if (bf)
      linear_xent_fwd_bwd_bf16(d->dh.data(), d->dW.data(), d->hb.data(), d->Wb.data(), d->t.data(), n, c, v, 1.0f / n, 0,
                               d->ws.p);
    else
      linear_xent_fwd_bwd_f32(d->dh.data(), d->dW.data(), d->hf.data(), d->Wf.data(), d->t.data(), n, c, v, 1.0f / n, 0,
                              d->ws.p);
  }
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  // Partial last chunk, V not a multiple of 16, a single chunk, and the default chunk.
  v.push_back(std::make_unique<FusedCase>(false, 37, 40, 123, 16));
  v.push_back(std::make_unique<FusedCase>(true, 37, 40, 123, 16));
  v.push_back(std::make_unique<FusedCase>(true, 50, 64, 1000, 0));
  v.push_back(std::make_unique<FusedCase>(false, 9, 24, 301, 64));
  v.push_back(std::make_unique<FusedCase>(false, 37, 64, 200, 16, true));
  v.push_back(std::make_unique<FusedCase>(true, 37, 64, 200, 16, true));
  return v;
}

MT_REGISTER_OP_CASES(make_cases);

}  // namespace
