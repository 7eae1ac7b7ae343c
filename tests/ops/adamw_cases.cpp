// adamw_cases.cpp: op-harness cases for the AdamW step and the global gradient norm (family adamw).
//   adamw/step_n<N>[_nodecay]   kernel vs adamw_step_ref<float>: bitwise, 1 step and 10 steps; 10 steps
//                               vs the textbook AdamW in double within a stated tolerance
//   adamw/grad_norm             grad_norm_sq vs a double sum; bitwise independent of thread count and ISA
// Grad mode (AdamW has no gradient of its own to check): the clip math and the global norm against
// independent double / long double references, and the folded-scalar AdamW (T = double) against the
// textbook formula.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "moetron/optim.h"
#include "moetron/runtime.h"

using namespace moetron;
using namespace moetron::ops;

namespace {

template <class F>
void with_isa(Isa isa, F&& f) {
  Isa old = active_isa();
  set_isa_override(isa);
  f();
  set_isa_override(old);
}

AdamWConfig test_config() { return AdamWConfig{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f}; }

struct StepCase : OpCase {
  int64_t n;
  bool decay;
  StepCase(int64_t n_, bool d) : n(n_), decay(d) {
    name = "adamw/step_n" + std::to_string(n) + (d ? "" : "_nodecay");
    bytes = 28.0 * (1 << 22);  // perf: read p, m, v, g and write p, m, v (7 fp32 streams)
  }

  void test(Report& r) override {
    const AdamWConfig c = test_config();
    auto p = randn(n, 1, 0.02f), g0 = randn(n, 2, 1.0f);
    std::vector<float> m(n, 0.0f), v(n, 0.0f), pr = p, mr = m, vr = v;
    std::vector<double> pd = to_f64(p), md(n, 0.0), vd(n, 0.0);
    const float clip = 0.37f;  // a clip coefficient multiplied into g
    for (int64_t step = 1; step <= 10; ++step) {
      // Gradients that change from step to step, with a spread of magnitudes (tiny to large).
      std::vector<float> g(n);
      auto mag = randu(n, 100 + step, -6.0f, 2.0f);
      for (int64_t i = 0; i < n; ++i) g[i] = g0[i] * std::exp2(mag[i]) * (1.0f + 0.1f * float(step));
      adamw_step(p.data(), m.data(), v.data(), g.data(), n, c, step, clip, decay);
      adamw_step_ref<float>(pr.data(), mr.data(), vr.data(), g.data(), n, adamw_scalars(c, step), clip, decay);
      auto gd = to_f64(g);
      adamw_step_textbook(pd.data(), md.data(), vd.data(), gd.data(), n, c, step, double(clip), decay);
      if (step == 1 || step == 10) {
        const std::string s = " after " + std::to_string(step) + " step(s)";
        r.compare("p vs ref<float> (bitwise)" + s, p.data(), pr.data(), n, 0.0, 0.0);
        r.compare("m vs ref<float> (bitwise)" + s, m.data(), mr.data(), n, 0.0, 0.0);
        r.compare("v vs ref<float> (bitwise)" + s, v.data(), vr.data(), n, 0.0, 0.0);
      }
    }
    // Against double, 10 steps. Per step the fp32 kernel rounds p twice (2^-24 |p| each), and the update
    // lr * m_hat / (sqrt(v_hat) + eps), whose size is at most ~lr * (1 - b1) / sqrt(1 - b2) / bias terms
    // <= 3 lr here, carries a relative error of at most ~ (3 + 3 * steps) * 2^-24 from the m, v recurrences,
    // the folded scalars and sqrt / div: 3 lr * 40 * 2^-24 ~ 7e-6 lr. Over 10 steps:
    //   |p - p_double| <= 10 * (2 * 2^-24 |p| + 7e-6 * lr)  ->  rtol 1.2e-6, atol 10 * 7e-6 * lr.
    // m and v: a linear recurrence with <= 3 roundings per step -> rtol 30 * 2^-24 ~ 1.8e-6 (+ tiny atol for
    // values near zero from cancellation in m).
    auto pf = to_f64(p), mf = to_f64(m), vf = to_f64(v);
    r.compare("p vs textbook double, 10 steps", pf.data(), pd.data(), n, 10 * 7e-6 * c.lr, 1.2e-6);
    double gmax = 0;
    for (float x : g0) gmax = std::max(gmax, double(std::fabs(x)));
    r.compare("m vs textbook double, 10 steps", mf.data(), md.data(), n, 1e-6 * gmax * 8, 2e-6);
    r.compare("v vs textbook double, 10 steps", vf.data(), vd.data(), n, 0.0, 2e-6);
    // Thread-count independence (element-wise: trivially, but it guards the parallel split).
    std::vector<float> p1 = pr, m1 = mr, v1 = vr, p2 = pr, m2 = mr, v2 = vr;
    with_threads(1, [&] { adamw_step(p1.data(), m1.data(), v1.data(), g0.data(), n, c, 11, clip, decay); });
    adamw_step(p2.data(), m2.data(), v2.data(), g0.data(), n, c, 11, clip, decay);
    r.check(std::memcmp(p1.data(), p2.data(), n * 4) == 0 && std::memcmp(v1.data(), v2.data(), n * 4) == 0,
            "1 thread == default threads (bitwise)");
  }

  void grad(Report& r) override {
    // The folding of bias correction into step_size and the denominator (the kernel's algebra), in
    // double, against the textbook formula: equal up to double rounding over 10 steps.
    const AdamWConfig c = test_config();
    const int64_t k = std::min<int64_t>(n, 4096);
    auto p0 = to_f64(randn(k, 3, 0.02f)), g = to_f64(randn(k, 4, 1.0f));
    std::vector<double> pa = p0, ma(k, 0.0), va(k, 0.0), pb = p0, mb(k, 0.0), vb(k, 0.0);
    for (int64_t step = 1; step <= 10; ++step) {
      // adamw_scalars rounds the folded scalars to float; recompute them in double here so that this
      // compares the algebra only.
      const double bc1 = 1 - std::pow(double(c.beta1), double(step)), bc2 = 1 - std::pow(double(c.beta2), double(step));
      for (int64_t i = 0; i < k; ++i) {
        double gi = g[i] * 0.5;
        ma[i] = c.beta1 * ma[i] + (1.0 - c.beta1) * gi;
        va[i] = c.beta2 * va[i] + (1.0 - c.beta2) * (gi * gi);
        if (decay) pa[i] *= 1.0 - double(c.lr) * c.weight_decay;
        pa[i] -= (double(c.lr) / bc1) * (ma[i] / (std::sqrt(va[i]) * (1.0 / std::sqrt(bc2)) + c.eps));
      }
      adamw_step_textbook(pb.data(), mb.data(), vb.data(), g.data(), k, c, step, 0.5, decay);
    }
    // eps placement differs: (sqrt(v)/sqrt(bc2) + eps) vs (sqrt(v/bc2) + eps): identical algebra.
    r.compare("folded-scalar AdamW (double) vs textbook, 10 steps", pa.data(), pb.data(), k, 1e-15, 1e-12);
  }

  void perf() override {
    const int64_t N = 1 << 22;
    static std::vector<float> p = randn(N, 1, 0.02f), m(N, 0.0f), v(N, 0.0f), g = randn(N, 2, 1.0f);
    static int64_t step = 0;
    adamw_step(p.data(), m.data(), v.data(), g.data(), N, test_config(), ++step, 1.0f, decay);
  }
};

struct NormCase : OpCase {
  NormCase() {
    name = "adamw/grad_norm";
    bytes = 4.0 * (1 << 24);
  }

  void test(Report& r) override {
    // Sizes: empty, tails, one block, block + 1, many blocks, and more than kNormChunks blocks (a chunk
    // then holds several blocks).
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(15), int64_t(4096), int64_t(4097), int64_t(300001),
                      int64_t(kNormBlock * kNormChunks * 3 + 1234)}) {
      auto g = randn(n, 7 + n, 1.0f);
      for (int64_t i = 0; i < n; i += 101) g[i] *= 1e3f;  // spread of magnitudes
      const double got = grad_norm_sq(g.data(), n);
      double want = 0;
      for (int64_t i = 0; i < n; ++i) want += double(g[i]) * double(g[i]);
      // Sums of non-negative terms in double: relative error <= (n - 1) 2^-53 for any order.
      const double tol = std::max<double>(1, double(n)) * std::ldexp(1.0, -53);
      r.compare("grad_norm_sq n=" + std::to_string(n) + " vs double sum", &got, &want, 1, 0.0, tol);
      double one = -1, scal = -2;
      with_threads(1, [&] { one = grad_norm_sq(g.data(), n); });
      with_isa(Isa::Scalar, [&] { scal = grad_norm_sq(g.data(), n); });
      r.check(std::memcmp(&one, &got, 8) == 0, "n=" + std::to_string(n) + ": 1 thread == default (bitwise)");
      r.check(std::memcmp(&scal, &got, 8) == 0, "n=" + std::to_string(n) + ": scalar ISA == active ISA (bitwise)");
    }
    // Many tensors: the ordered sum of the per-tensor results.
    auto a = randn(5000, 1, 1.0f), b = randn(77, 2, 3.0f), c = randn(70000, 3, 0.1f);
    const float* gs[3] = {a.data(), b.data(), c.data()};
    const int64_t ns[3] = {5000, 77, 70000};
    double multi = grad_norm_sq_multi(gs, ns, 3);
    double seq = grad_norm_sq(a.data(), 5000) + grad_norm_sq(b.data(), 77) + grad_norm_sq(c.data(), 70000);
    r.check(std::memcmp(&multi, &seq, 8) == 0, "grad_norm_sq_multi == ordered per-tensor sum (bitwise)");
  }

  void grad(Report& r) override {
    // Global norm over several tensors vs a long double reference, and the clip coefficient vs its
    // formula in double; clipped gradients have norm max_norm (to 1e-6 relative from the +1e-6 guard).
    std::vector<std::vector<float>> ts;
    for (int i = 0; i < 5; ++i) ts.push_back(randn(1000 + 3777 * i, 40 + i, 0.5f * float(i + 1)));
    std::vector<const float*> ptrs;
    std::vector<int64_t> ns;
    long double ref = 0;
    for (auto& t : ts) {
      ptrs.push_back(t.data());
      ns.push_back(int64_t(t.size()));
      for (float x : t) ref += (long double)x * x;
    }
    const double norm = std::sqrt(grad_norm_sq_multi(ptrs.data(), ns.data(), int64_t(ts.size())));
    const double want = double(std::sqrt(ref));
    r.compare("global norm vs long double", &norm, &want, 1, 0.0, 1e-13);
    for (double max_norm : {0.5, 1.0, 1e6, 0.0, -1.0}) {
      const float coef = clip_coefficient(norm, max_norm);
      const double expect = max_norm <= 0 ? 1.0 : std::min(1.0, max_norm / (norm + 1e-6));
      const double got = coef;
      r.compare("clip_coefficient(norm, " + std::to_string(max_norm) + ")", &got, &expect, 1, 0.0, 1e-7);
      if (max_norm > 0 && max_norm < norm) {
        long double s = 0;
        for (auto& t : ts)
          for (float x : t) s += (long double)(x * coef) * (x * coef);
        const double clipped = double(std::sqrt(s));
        r.compare("norm after clipping to " + std::to_string(max_norm), &clipped, &max_norm, 1, 0.0, 2e-6);
      }
    }
    r.check(std::isnan(clip_coefficient(NAN, 1.0)) && std::isnan(clip_coefficient(INFINITY, 1.0)),
            "non-finite norm gives a NaN coefficient (caller skips the step)");
  }

  void perf() override {
    static std::vector<float> g = randn(1 << 24, 9, 1.0f);
    [[maybe_unused]] static volatile double sink;
    sink = grad_norm_sq(g.data(), 1 << 24);
  }
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  v.push_back(std::make_unique<StepCase>(1037, true));
  v.push_back(std::make_unique<StepCase>(1037, false));
  v.push_back(std::make_unique<StepCase>(100003, true));  // above the parallel threshold, odd tail
  v.push_back(std::make_unique<NormCase>());
  return v;
}

MT_REGISTER_OP_CASES(make_cases);

}  // namespace
