// norm_cases.cpp: op-harness cases for RMSNorm (family "norm").
// test: rmsnorm_forward / rmsnorm_backward (and the split data/weight backward) against the fp64 reference,
//       bitwise thread-count independence of dw, and split == fused bitwise.
// grad: the fp64 reference backward against central finite differences of sum(y * R).
// Tolerances (u = 2^-24, the fp32 unit roundoff):
//   y, rstd: relative (C/16 + 16) u. The sum of squares has only positive terms, so its relative error is
//            bounded by the longest addition chain: C/32 per vector lane (two accumulators) plus the 16-lane
//            tree, doubled here for the portable path's 4-way split; sqrt/div/mul add a few u.
//   y16:     relative 2^-8 + 2x the y bound (one bf16 rounding, half an ulp <= 2^-8 relative, of the fp32 y).
//   dx:      absolute (C/16 + 16) u * max_c rstd (|w dy| + |xhat| |dot|): the mean term cancels, so the error is
//            relative to the size of the terms, not of the result.
//   dw:      absolute (rows per block + blocks + 16) u * max_c sum_n |dy xhat| (blocked summation bound).
#include <omp.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "moetron/norm.h"

namespace moetron::ops {
namespace {

constexpr double kU = 5.9604644775390625e-08;  // 2^-24

struct RmsNormCase : OpCase {
  int64_t N, C;
  float eps = 1e-5f;
  RmsNormCase(int64_t n, int64_t c) : N(n), C(c) {
    std::ostringstream os;
    os << "norm/rmsnorm_N" << N << "_C" << C;
    name = os.str();
    fd_eps = 1e-6;
    grad_tol = 1e-6;
    bytes = double(sizeof(float)) * double(2 * N * C + N + C);
  }

  // x: rows of different magnitude (1e-2 .. 1e2) so rstd varies; w around 1.
  std::vector<float> make_x() const {
    auto x = randn(N * C, 11);
    auto s = randu(N, 12, -2.0f, 2.0f);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) x[n * C + c] *= std::pow(10.0f, s[n]);
    return x;
  }
  std::vector<float> make_w() const {
    auto w = randn(C, 13, 0.3f);
    for (auto& v : w) v += 1.0f;
    return w;
  }

  void test(Report& r) override {
    auto x = make_x(), w = make_w(), dy = randn(N * C, 14), dw0 = randn(C, 15);
    std::vector<float> y(N * C), rstd(N), dx(N * C), dw = dw0;
    std::vector<bf16> y16(N * C);
    rmsnorm_forward(y.data(), y16.data(), rstd.data(), x.data(), w.data(), N, C, eps);
    auto xd = to_f64(x), wd = to_f64(w), dyd = to_f64(dy);
    std::vector<double> yr(N * C), rr(N), dxr(N * C), dwr = to_f64(dw0);
    rmsnorm_forward_ref<double>(yr.data(), rr.data(), xd.data(), wd.data(), N, C, double(eps));
    const double rt = (double(C) / 16 + 16) * kU;
    r.compare("y", to_f64(y).data(), yr.data(), N * C, 0.0, rt);
    r.compare("rstd", to_f64(rstd).data(), rr.data(), N, 0.0, rt);
    std::vector<double> y16d(N * C);
    for (int64_t i = 0; i < N * C; ++i) y16d[i] = from_bf16(y16[i]);
    r.compare("y16", y16d.data(), yr.data(), N * C, 0.0, std::ldexp(1.0, -8) + 2 * rt);

    rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    rmsnorm_backward_ref<double>(dxr.data(), dwr.data(), dyd.data(), xd.data(), wd.data(), rr.data(), N, C);
    double sdx = 0;
    std::vector<double> colsum(C, 0.0);
    for (int64_t n = 0; n < N; ++n) {
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += wd[c] * dyd[n * C + c] * xd[n * C + c] * rr[n];
      dot /= double(C);
      for (int64_t c = 0; c < C; ++c) {
        double xh = xd[n * C + c] * rr[n];
        sdx = std::max(sdx, rr[n] * (std::fabs(wd[c] * dyd[n * C + c]) + std::fabs(xh * dot)));
        colsum[c] += std::fabs(dyd[n * C + c] * xh);
      }
    }
    r.compare("dx", to_f64(dx).data(), dxr.data(), N * C, rt * sdx, 0.0);
    const int64_t nblk = std::max<int64_t>(1, std::min<int64_t>(64, (N + 15) / 16));
    double smax = 0;
    for (double v : colsum) smax = std::max(smax, v);
    for (int64_t c = 0; c < C; ++c) smax = std::max(smax, std::fabs(double(dw0[c])));
    r.compare("dw (+=)", to_f64(dw).data(), dwr.data(), C, (double(N) / nblk + nblk + 16) * kU * smax, 0.0);

    // Split backward == fused backward, bitwise; dw independent of the thread count, bitwise.
    std::vector<float> dx2(N * C), dw2 = dw0, dw1 = dw0, dx1(N * C);
    rmsnorm_backward_data(dx2.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    std::vector<char> ws(rmsnorm_backward_workspace_bytes(N, C) + 64);
    float* wsp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(ws.data()) + 63) & ~uintptr_t(63));
    rmsnorm_backward_weight(dw2.data(), dy.data(), x.data(), rstd.data(), N, C, wsp);
    r.check(std::memcmp(dx2.data(), dx.data(), dx.size() * 4) == 0, "backward_data == backward dx (bitwise)");
    r.check(std::memcmp(dw2.data(), dw.data(), dw.size() * 4) == 0, "backward_weight == backward dw (bitwise)");
    const int saved = omp_get_max_threads();
    omp_set_num_threads(saved == 1 ? 2 : 1);
    rmsnorm_backward(dx1.data(), dw1.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    omp_set_num_threads(saved);
    r.check(std::memcmp(dw1.data(), dw.data(), dw.size() * 4) == 0 && std::memcmp(dx1.data(), dx.data(), dx.size() * 4) == 0,
            "dx, dw bitwise equal with 1 and 2 threads");
  }

  void grad(Report& r) override {
    auto x = to_f64(make_x()), w = to_f64(make_w()), R = to_f64(randn(N * C, 16));
    std::vector<double> y(N * C), rstd(N), dx(N * C), dw(C, 0.0);
    auto loss = [&] {
      rmsnorm_forward_ref<double>(y.data(), rstd.data(), x.data(), w.data(), N, C, double(eps));
      return dot(y.data(), R.data(), N * C);
    };
    loss();
    rmsnorm_backward_ref<double>(dx.data(), dw.data(), R.data(), x.data(), w.data(), rstd.data(), N, C);
    r.fd_check("dx", x.data(), N * C, dx.data(), loss, fd_eps, grad_tol);
    r.fd_check("dw", w.data(), C, dw.data(), loss, fd_eps, grad_tol);
  }

  std::vector<float> px, pw, py, prstd;
  void perf() override {
    if (px.empty()) px = make_x(), pw = make_w(), py.resize(N * C), prstd.resize(N);
    rmsnorm_forward(py.data(), nullptr, prstd.data(), px.data(), pw.data(), N, C, eps);
  }
};

struct RmsNormChecks : OpCase {
  RmsNormChecks() { name = "norm/rmsnorm_bad_input"; }
  void test(Report& r) override {
    float a[4] = {1, 2, 3, 4}, b[4] = {1, 1, 1, 1}, rs[2];
    auto throws = [](auto f) {
      try {
        f();
      } catch (const std::exception& e) {
        return std::string(e.what()).find("[rmsnorm") != std::string::npos;
      }
      return false;
    };
    r.check(throws([&] { rmsnorm_forward(a, nullptr, rs, a, b, 2, 0, 1e-5f); }), "C=0 rejected");
    r.check(throws([&] { rmsnorm_forward(a, nullptr, rs, a, b, -1, 2, 1e-5f); }), "N<0 rejected");
    r.check(throws([&] { rmsnorm_forward(a, nullptr, nullptr, a, b, 2, 2, 1e-5f); }), "null rstd rejected");
    r.check(throws([&] { rmsnorm_backward(a, b, a, a, nullptr, rs, 2, 2); }), "null w rejected");
  }
  void grad(Report& r) override { r.check(true, "no gradient (input validation case)"); }
  void perf() override {}
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  for (auto [n, c] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {3, 7}, {5, 37}, {17, 64}, {33, 1000}, {300, 129}, {1024, 512}, {4096, 17}})
    v.push_back(std::make_unique<RmsNormCase>(n, c));
  v.push_back(std::make_unique<RmsNormChecks>());
  return v;
}
MT_REGISTER_OP_CASES(make_cases);

}  // namespace
}  // namespace moetron::ops
