// swiglu_cases.cpp: op-harness cases for SwiGLU (family "swiglu"), plain and row-scaled. F covers tails
// of the 8- and 16-lane kernels (F mod 16 in 1 - 7, 8 and 9 - 15).
// test: swiglu_[scaled_]forward / _backward against the fp64 reference, element by element with the bound
//       below; h16 against the reference rounded once to bf16.
// grad: the fp64 reference backward against central finite differences of sum(h * R) (w.r.t. gu and s).
// Tolerances (u = 2^-24). exp has <= 2 ulp (vector) or 1 ulp (libm), sigmoid = 1/(1+e) adds 2 roundings and
// damps exp's error by e/(1+e) < 1, each further product one rounding:
//   h, du:  |err| <= 16u |want|
//   dg:     |err| <= 16u |s dh u| sig (2 + 2|g|): the factor 1 + g (1 - sig) takes sig's absolute error
//           times |g| (1 - sig cancels when sig -> 1), and it cancels itself near g = -1.28.
//   ds:     |err| <= (F/16 + 32)u sum_f |dh silu u|  (a sum of F terms in 16 lanes)
//   h16:    |err| <= (2^-8 + 32u) |want|  (one bf16 rounding of h)
#include <cmath>
#include <sstream>

#include "harness.h"
#include "moetron/swiglu.h"

namespace moetron::ops {
namespace {

constexpr double kU = 5.9604644775390625e-08;  // 2^-24

// Element-wise bound check: |got - want| <= bound[i].
void compare_bound(Report& r, const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                   const std::vector<double>& bound) {
  int64_t bad = 0, wi = 0;
  double worst = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    double e = std::fabs(got[i] - want[i]), ratio = e == 0 ? 0 : e / bound[i];
    if (!(ratio <= 1)) ++bad;
    if (!(ratio <= worst)) worst = ratio, wi = int64_t(i);
  }
  std::ostringstream os;
  os << what << ": n=" << got.size() << " element-wise bound";
  if (!got.empty())
    os << ", worst at " << wi << " (got " << got[wi] << ", want " << want[wi] << ", " << worst << "x of bound "
       << bound[wi] << ")";
  if (bad) os << " violations=" << bad;
  r.check(bad == 0, os.str());
}

struct SwigluCase : OpCase {
  int64_t N, F;
  bool scaled;
  SwigluCase(int64_t n, int64_t f, bool sc) : N(n), F(f), scaled(sc) {
    std::ostringstream os;
    os << "swiglu/" << (scaled ? "scaled_" : "") << "N" << N << "_F" << F;
    name = os.str();
    fd_eps = 1e-6;
    grad_tol = 1e-6;
    bytes = double(sizeof(float)) * double(3 * N * F);
  }
  std::vector<float> make_gu() const { return randn(N * 2 * F, 21, 3.0f); }  // |g| up to ~15
  std::vector<float> make_s() const { return randu(N, 22, 0.05f, 1.0f); }

  void test(Report& r) override {
    auto gu = make_gu(), dh = randn(N * F, 23), s = make_s();
    std::vector<float> h(N * F), dgu(N * 2 * F), ds(N);
    std::vector<bf16> h16(N * F);
    if (scaled) {
      swiglu_scaled_forward(h.data(), h16.data(), gu.data(), s.data(), N, F);
      swiglu_scaled_backward(dgu.data(), ds.data(), dh.data(), gu.data(), s.data(), N, F);
    } else {
      swiglu_forward(h.data(), h16.data(), gu.data(), N, F);
      swiglu_backward(dgu.data(), dh.data(), gu.data(), N, F);
    }
    auto gud = to_f64(gu), dhd = to_f64(dh), sd = to_f64(s);
    const double* sp = scaled ? sd.data() : nullptr;
    std::vector<double> hr(N * F), dgur(N * 2 * F), dsr(N);
    swiglu_forward_ref<double>(hr.data(), gud.data(), sp, N, F);
    swiglu_backward_ref<double>(dgur.data(), dsr.data(), dhd.data(), gud.data(), sp, N, F);
    std::vector<double> bh(N * F), b16(N * F), bg(N * 2 * F), bds(N), h16d(N * F);
    for (int64_t n = 0; n < N; ++n) {
      double sc = scaled ? sd[n] : 1.0, asum = 0;
      for (int64_t f = 0; f < F; ++f) {
        double g = gud[n * 2 * F + f], u = gud[n * 2 * F + F + f], d = dhd[n * F + f];
        double sig = 1 / (1 + std::exp(-g));
        bh[n * F + f] = 16 * kU * std::fabs(hr[n * F + f]) + 1e-30;
        b16[n * F + f] = (std::ldexp(1.0, -8) + 32 * kU) * std::fabs(hr[n * F + f]) + 1e-30;
        bg[n * 2 * F + f] = 16 * kU * std::fabs(sc * d * u) * sig * (2 + 2 * std::fabs(g)) + 1e-30;
        bg[n * 2 * F + F + f] = 16 * kU * std::fabs(dgur[n * 2 * F + F + f]) + 1e-30;
        asum += std::fabs(d * g * sig * u);
        h16d[n * F + f] = from_bf16(h16[n * F + f]);
      }
      bds[n] = (double(F) / 16 + 32) * kU * asum + 1e-30;
    }
    compare_bound(r, "h", to_f64(h), hr, bh);
    compare_bound(r, "h16", h16d, hr, b16);
    compare_bound(r, "dgu", to_f64(dgu), dgur, bg);
    if (scaled) compare_bound(r, "ds", to_f64(ds), dsr, bds);
    {  // the forward with only its bf16 copy asked for (h null): the same bits, poisoned output first
      std::vector<bf16> only16(size_t(N * F), bf16{0xffff});
      if (scaled) swiglu_scaled_forward(nullptr, only16.data(), gu.data(), s.data(), N, F);
      else swiglu_forward(nullptr, only16.data(), gu.data(), N, F);
      int64_t bad = 0;
      for (int64_t i = 0; i < N * F; ++i) bad += only16[size_t(i)].bits != h16[size_t(i)].bits;
      r.check(bad == 0, "h16 alone (h null) = h16 bit for bit (" + std::to_string(bad) + " differ)");
    }
    if (!scaled) {  // the bf16 form: bitwise the fp32 gradient rounded (to_bf16), poisoned output first
      std::vector<bf16> dgu16(size_t(N * 2 * F), bf16{0xffff});
      swiglu_backward_bf16(dgu16.data(), dh.data(), gu.data(), N, F);
      int64_t bad = 0;
      for (int64_t i = 0; i < N * 2 * F; ++i) bad += dgu16[size_t(i)].bits != to_bf16(dgu[size_t(i)]).bits;
      r.check(bad == 0, "dgu16 = to_bf16(dgu) bit for bit (" + std::to_string(bad) + " differ)");
    }
  }

  void grad(Report& r) override {
    auto gu = to_f64(make_gu()), s = to_f64(make_s()), R = to_f64(randn(N * F, 24));
    std::vector<double> h(N * F), dgu(N * 2 * F), ds(N);
    const double* sp = scaled ? s.data() : nullptr;
    auto loss = [&] {
      swiglu_forward_ref<double>(h.data(), gu.data(), sp, N, F);
      return dot(h.data(), R.data(), N * F);
    };
    swiglu_backward_ref<double>(dgu.data(), ds.data(), R.data(), gu.data(), sp, N, F);
    r.fd_check("dgu", gu.data(), N * 2 * F, dgu.data(), loss, fd_eps, grad_tol);
    if (scaled) r.fd_check("ds", s.data(), N, ds.data(), loss, fd_eps, grad_tol);
  }

  std::vector<float> pgu, ph;
  void perf() override {
    if (pgu.empty()) pgu = make_gu(), ph.resize(N * F);
    swiglu_forward(ph.data(), nullptr, pgu.data(), N, F);
  }
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  for (auto [n, f] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 5}, {7, 33}, {64, 176}, {256, 1408}, {5, 1000}})
    v.push_back(std::make_unique<SwigluCase>(n, f, false));
  for (auto [n, f] : std::vector<std::pair<int64_t, int64_t>>{{1, 3}, {40, 100}, {96, 176}, {5, 27}})
    v.push_back(std::make_unique<SwigluCase>(n, f, true));
  return v;
}
MT_REGISTER_OP_CASES(make_cases);

}  // namespace
}  // namespace moetron::ops
