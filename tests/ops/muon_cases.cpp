// muon_cases.cpp: op-harness cases for the Muon kernels (family muon; moetron/muon.h).
//   muon/ns_<R>x<C>[_ld<L>]  newton_schulz vs its float twin (bitwise, the active ISA's accumulation), vs the float64
//                            twin within a derived tolerance, its singular values against the quintic iterated on the
//                            input's (and in the quintic's band for a well-conditioned input), thread-count independence
//   muon/update_<R>x<C>      three whole Muon steps (momentum, Nesterov, Newton-Schulz per column block, scale,
//                            decoupled decay, apply) of the kernels vs muon_update_ref<double>
// Grad mode (Muon has no gradient of its own): the algebra of the float64 twin: NS of U diag(s) V^T is
// U diag(p^k(s / |s|)) V^T for random orthogonal U, V (singular vectors kept, each singular value through the scalar
// quintic p(x) = a x + b x^3 + c x^5).
// Not a test of which parameters are Muon matrices (tests/unit/test_muon.cpp) or of the trainer.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "harness.h"
#include "moetron/muon.h"
#include "moetron/runtime.h"

using namespace moetron;
using namespace moetron::ops;

namespace {

constexpr int kSteps = 5;
constexpr double kU = 5.960464477539063e-08;  // 2^-24, fp32 unit roundoff

double quintic(double x) { return kMuonNsA * x + kMuonNsB * x * x * x + kMuonNsC * x * x * x * x * x; }

// Eigenvalues of the symmetric n x n matrix S (cyclic Jacobi, double), ascending.
std::vector<double> sym_eigenvalues(std::vector<double> S, int64_t n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = i + 1; j < n; ++j) off += S[i * n + j] * S[i * n + j];
    if (off < 1e-30) break;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = S[p * n + q];
        if (std::abs(apq) < 1e-300) continue;
        const double theta = (S[q * n + q] - S[p * n + p]) / (2 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::abs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int64_t k = 0; k < n; ++k) {  // columns p, q
          const double kp = S[k * n + p], kq = S[k * n + q];
          S[k * n + p] = c * kp - s * kq, S[k * n + q] = s * kp + c * kq;
        }
        for (int64_t k = 0; k < n; ++k) {  // rows p, q
          const double pk = S[p * n + k], qk = S[q * n + k];
          S[p * n + k] = c * pk - s * qk, S[q * n + k] = s * pk + c * qk;
        }
      }
  }
  std::vector<double> ev(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ev[size_t(i)] = S[i * n + i];
  std::sort(ev.begin(), ev.end());
  return ev;
}

// Singular values of the rows x cols matrix X (leading dimension ld), ascending: the square roots of the
// eigenvalues of the smaller Gram matrix.
template <class T>
std::vector<double> singular_values(const T* X, int64_t rows, int64_t cols, int64_t ld) {
  const bool tr = rows > cols;
  const int64_t m = tr ? cols : rows, n = tr ? rows : cols;
  auto at = [&](int64_t i, int64_t k) { return double(tr ? X[k * ld + i] : X[i * ld + k]); };
  std::vector<double> G(size_t(m * m), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t k = 0; k < n; ++k) s += at(i, k) * at(j, k);
      G[size_t(i * m + j)] = s;
    }
  std::vector<double> ev = sym_eigenvalues(G, m);
  for (double& e : ev) e = std::sqrt(std::max(0.0, e));
  return ev;
}

// The derived bound on |NS_fp32(X) - NS_fp64(X)| relative to max |NS_fp64(X)| (both scaled alike). Each iteration
// forms three products in fp32 whose dot products are k-term sums (k = n, m, m for A = Y Y^T, A A, B Y): the rounding
// of a k-term sum is about sqrt(k) u relative to the sum of |terms| (the probabilistic bound of Higham and Mary, 2019;
// the worst case k u is never approached by these sums), and the three compose: delta = 3 sqrt(n) u per iteration
// (n >= m the longest sum). The iteration carries an earlier error forward through the derivative of the matrix map,
// whose gain is bounded by the scalar quintic's: max |p'| over [0, 1.21] = 3.88 = L (divided differences of p over
// the band, and p(s)/s <= a = 3.4445 < L). After k iterations: delta (L^k - 1) / (L - 1), plus the input's rounding
// (the 1 / norm scaling, u) carried the same way: ~ (3 sqrt(n) + 1) u (L^k - 1) / (L - 1).
double ns_tolerance(int64_t rows, int64_t cols, int steps) {
  const double n = double(std::max(rows, cols)), L = 3.88;
  return (3 * std::sqrt(n) + 1) * kU * (std::pow(L, steps) - 1) / (L - 1);
}

struct NsCase : OpCase {
  int64_t R, C, ld;
  NsCase(int64_t r, int64_t c, int64_t l) : R(r), C(c), ld(l) {
    name = "muon/ns_" + std::to_string(R) + "x" + std::to_string(C) + (ld != C ? "_ld" + std::to_string(ld) : "");
    const double m = double(std::min(R, C)), n = double(std::max(R, C));
    flops = kSteps * 2.0 * (2 * m * m * n + m * m * m);
  }

  void test(Report& r) override {
    const auto X0 = randn(R * ld, 17 + uint64_t(R * 131 + C), 1.0f);
    const float scale = muon_scale(R, C);
    std::vector<float> work(static_cast<size_t>(muon_ns_workspace(R, C)));
    std::vector<float> got = X0, twin = X0;
    newton_schulz(got.data(), R, C, ld, kSteps, scale, work.data());
    const bool fused = active_isa() != Isa::Scalar;
    newton_schulz_ref<float>(twin.data(), R, C, ld, kSteps, scale, fused);
    r.compare("kernel vs float twin (bitwise)", got.data(), twin.data(), R * ld, 0.0, 0.0);
    bool pad_kept = true;  // columns [C, ld) are not touched
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = C; j < ld; ++j) pad_kept = pad_kept && got[size_t(i * ld + j)] == X0[size_t(i * ld + j)];
    r.check(pad_kept, "columns beyond cols untouched");

    std::vector<double> exact = to_f64(X0);
    newton_schulz_ref<double>(exact.data(), R, C, ld, kSteps, double(scale));
    double omax = 0;
    for (double v : exact) omax = std::max(omax, std::abs(v));
    const double tol = ns_tolerance(R, C, kSteps);
    std::vector<double> g64 = to_f64(got);
    r.compare("kernel vs float64 twin (derived tolerance " + std::to_string(tol) + " of max|O|)", g64.data(),
              exact.data(), R * ld, tol * omax, 0.0);

    // Singular values: NS maps s to p^k(s / |X|_F) and keeps the vectors (the kernel's, divided by the scale).
    std::vector<double> sin = singular_values(X0.data(), R, C, ld), sout = singular_values(got.data(), R, C, ld);
    double fro = 0;
    for (double s : sin) fro += s * s;
    fro = std::sqrt(fro);
    std::vector<double> want;
    for (double s : sin) {
      double x = s / (fro + kMuonNsEps);
      for (int k = 0; k < kSteps; ++k) x = quintic(x);
      want.push_back(x);
    }
    std::sort(want.begin(), want.end());
    for (double& s : sout) s /= scale;
    // Weyl: each singular value moves by at most the spectral norm of the error, <= its Frobenius norm <=
    // sqrt(R C) times the elementwise bound above (the derived one, not the measured error: a broken kernel must not
    // widen its own tolerance), plus the Jacobi's 1e-9 (eigenvalues of the Gram matrix in double).
    const double sv_tol = std::sqrt(double(R * C)) * tol * omax / scale + 1e-9;
    r.compare("singular values vs the quintic iterated on the input's", sout.data(), want.data(), int64_t(want.size()),
              sv_tol, 0.0);
    // The band: inputs whose singular values are >= 0.003 |X|_F (random matrices that are not square) come out in
    // [0.682, 1.203] after 5 steps (the scalar map's range over [0.003, 1], computed on a grid of 20000 points).
    if (sin.front() / fro >= 0.003 && kSteps == 5) {
      const bool in_band = sout.front() >= 0.68 - sv_tol && sout.back() <= 1.21 + sv_tol;
      r.check(in_band, "singular values in the quintic's band [0.68, 1.21]",
              "min " + std::to_string(sout.front()) + " max " + std::to_string(sout.back()));
    }
    std::vector<float> one = X0;
    with_threads(1, [&] { newton_schulz(one.data(), R, C, ld, kSteps, scale, work.data()); });
    r.check(std::memcmp(one.data(), got.data(), got.size() * 4) == 0, "1 thread == default threads (bitwise)");
  }

  void grad(Report& r) override {
    // U diag(s) V^T with random orthogonal U [R, k], V [C, k] (k = min): NS_fp64 == U diag(p^k(s / |s|)) V^T.
    const int64_t k = std::min(R, C);
    auto orth = [&](int64_t rows, uint64_t seed) {  // k orthonormal columns (Gram-Schmidt, twice)
      std::vector<double> Q = to_f64(randn(rows * k, seed, 1.0f));
      for (int pass = 0; pass < 2; ++pass)
        for (int64_t j = 0; j < k; ++j) {
          for (int64_t i = 0; i < j; ++i) {
            double d = 0;
            for (int64_t t = 0; t < rows; ++t) d += Q[t * k + i] * Q[t * k + j];
            for (int64_t t = 0; t < rows; ++t) Q[t * k + j] -= d * Q[t * k + i];
          }
          double nn = 0;
          for (int64_t t = 0; t < rows; ++t) nn += Q[t * k + j] * Q[t * k + j];
          for (int64_t t = 0; t < rows; ++t) Q[t * k + j] /= std::sqrt(nn);
        }
      return Q;
    };
    const std::vector<double> U = orth(R, 5), V = orth(C, 6);
    std::vector<double> s(static_cast<size_t>(k)), ps(static_cast<size_t>(k));
    double fro = 0;
    for (int64_t i = 0; i < k; ++i) s[size_t(i)] = 0.05 + double(i % 7) * 0.3 + double(i) / double(k), fro += s[size_t(i)] * s[size_t(i)];
    fro = std::sqrt(fro);
    for (int64_t i = 0; i < k; ++i) {
      double x = s[size_t(i)] / (fro + kMuonNsEps);
      for (int t = 0; t < kSteps; ++t) x = quintic(x);
      ps[size_t(i)] = x;
    }
    std::vector<double> X(size_t(R * C), 0.0), want(size_t(R * C), 0.0);
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < C; ++j)
        for (int64_t t = 0; t < k; ++t) {
          X[size_t(i * C + j)] += U[size_t(i * k + t)] * s[size_t(t)] * V[size_t(j * k + t)];
          want[size_t(i * C + j)] += U[size_t(i * k + t)] * ps[size_t(t)] * V[size_t(j * k + t)];
        }
    newton_schulz_ref<double>(X.data(), R, C, C, kSteps, 1.0);
    // Double rounding through 5 iterations of 3 products (sqrt(n) 1.1e-16 each, gain <= 3.88 per step): ~1e-12.
    r.compare("NS(U S V^T) == U p^5(S) V^T (float64)", X.data(), want.data(), R * C, 1e-11, 0.0);
  }

  void perf() override {
    static std::vector<float> x = randn(R * ld, 3, 1.0f), w(static_cast<size_t>(muon_ns_workspace(R, C)));
    newton_schulz(x.data(), R, C, ld, kSteps, 1.0f, w.data());
  }
};

struct UpdateCase : OpCase {
  int64_t R, C;
  std::vector<int64_t> segs;
  UpdateCase(int64_t r, int64_t c, std::vector<int64_t> s) : R(r), C(c), segs(std::move(s)) {
    name = "muon/update_" + std::to_string(R) + "x" + std::to_string(C) + (segs.size() > 1 ? "_segs" : "");
  }

  void test(Report& r) override {
    const int64_t n = R * C;
    const float lr = 0.02f, wd = 0.1f, mu = 0.95f, clip = 0.37f;
    auto w = randn(n, 41, 0.02f), m = std::vector<float>(size_t(n), 0.0f);
    std::vector<double> wd64 = to_f64(w), md64(size_t(n), 0.0);
    std::vector<float> x(static_cast<size_t>(n)), work;
    for (int64_t s : segs) work.resize(std::max(work.size(), size_t(muon_ns_workspace(R, s))));
    const int steps = 3;
    for (int step = 1; step <= steps; ++step) {
      const auto g = randn(n, 50 + uint64_t(step), 1.0f);
      muon_momentum(m.data(), x.data(), g.data(), n, mu, true, clip);
      int64_t c0 = 0;
      for (int64_t s : segs) newton_schulz(x.data() + c0, R, s, C, kSteps, muon_scale(R, s), work.data()), c0 += s;
      muon_apply(w.data(), x.data(), n, lr, wd, true);
      const auto g64 = to_f64(g);
      muon_update_ref<double>(wd64.data(), md64.data(), g64.data(), R, C, segs, mu, true, kSteps, clip, lr, wd, true);
    }
    // The momentum: a linear recurrence with 3 fp32 roundings per element per step (gi, mu m, +): relative
    // 3 * steps * u of its terms' magnitude, |terms| <= clip |g| / (1 - mu) <= 20 * 0.37 * 5 (|g| < 5).
    auto m64 = to_f64(m);
    r.compare("momentum vs float64 twin", m64.data(), md64.data(), n, 3.0 * steps * kU * 20 * 0.37 * 5, 0.0);
    // The weights: per step lr |U - U64|, where |U - U64| <= tol_NS * max|U64| (NsCase's bound) and max|U64| <=
    // scale * 1.21 (an entry is at most the largest singular value, <= 1.21 in the band); plus two roundings of w
    // (decay, subtract): 2 u |w| per step.
    double smax = 0;
    for (int64_t s : segs) smax = std::max(smax, double(muon_scale(R, s)) * ns_tolerance(R, s, kSteps));
    const double per_step = double(lr) * smax * 1.21;  // max |O| <= the largest singular value <= 1.21
    auto w64 = to_f64(w);
    r.compare("weights vs float64 twin after 3 steps", w64.data(), wd64.data(), n, steps * per_step, 2.0 * steps * kU);
  }

  void grad(Report& r) override {
    // Momentum 0 and no Nesterov: the update is NS of the gradient alone (the twin's algebra, in float64).
    const int64_t n = R * C;
    std::vector<double> w(size_t(n), 0.0), m(size_t(n), 0.0), g = to_f64(randn(n, 9, 1.0f)), o = g;
    muon_update_ref<double>(w.data(), m.data(), g.data(), R, C, segs, 0.0, false, kSteps, 1.0, 1.0, 0.0, false);
    int64_t c0 = 0;
    for (int64_t s : segs) newton_schulz_ref<double>(o.data() + c0, R, s, C, kSteps, -std::sqrt(double(std::max(R, s))) * kMuonRms), c0 += s;
    r.compare("momentum 0: w = -lr * 0.2 sqrt(max) NS(g) per block", w.data(), o.data(), n, 1e-15, 1e-13);
  }

  void perf() override {}
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  v.push_back(std::make_unique<NsCase>(64, 256, 256));
  v.push_back(std::make_unique<NsCase>(256, 64, 80));    // rows > cols: the transposed path, strided
  v.push_back(std::make_unique<NsCase>(33, 100, 100));   // odd sizes
  v.push_back(std::make_unique<NsCase>(48, 48, 48));     // square: no band (small singular values stay small)
  v.push_back(std::make_unique<NsCase>(176, 512, 512));  // a ds_mini routed expert's down projection, transposed
  v.push_back(std::make_unique<UpdateCase>(64, 192, std::vector<int64_t>{64, 64, 64}));  // wqkv-like: q | k | v
  v.push_back(std::make_unique<UpdateCase>(96, 40, std::vector<int64_t>{40}));
  return v;
}

}  // namespace

MT_REGISTER_OP_CASES(make_cases);
