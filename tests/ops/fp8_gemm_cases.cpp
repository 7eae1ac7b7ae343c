// fp8_gemm_cases.cpp: op-harness cases for the FP8 recipes' GEMMs (family fp8, fp8_gemm.h).
//   fp8/gemm_<recipe>_<fmt>[_pow2]     forward, dgrad and wgrad of one linear through fp8_gemm:
//       test  vs the float64 twin within gamma_K (pow2 scales) or gamma_(K+2) times sum |a b|; bitwise equal to
//             gemm_f32 of the operands dequantized by the reference dequantizer; exact transposes (tensorwise,
//             128 x 128 blocks) equal to quantizing the transpose again; E8M0 scales; 1 thread == 2 threads
//       grad  the exact fp64 gradients of Y = X W^T checked by finite differences, then the FP8 forward,
//             dgrad and wgrad against them as SQNR: >= 25 dB all-E4M3, >= 20 dB hybrid (E5M2 gradients)
//   fp8/grouped_<recipe>_<fmt>         the same for the M-grouped forward / dgrad and K-grouped wgrad (an expert
//                                      with no tokens included)
//   fp8/delayed_<fmt>                  delayed scaling: the scale comes from the amax history, saturation
// The data have outlier channels (a few activation columns 30x larger), as transformer activations do.
#include <omp.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "moetron/fp8_gemm.h"
#include "moetron/gemm.h"

using namespace moetron;
using namespace moetron::ops;

namespace {

const char* recipe_name(Fp8Recipe r) {
  return r == Fp8Recipe::Tensorwise ? "tensorwise"
         : r == Fp8Recipe::Rowwise  ? "rowwise"
         : r == Fp8Recipe::Blockwise ? "blockwise"
                                     : "mxfp8";
}

// Activations [R, C]: N(0, 1) with every 23rd column (a channel) 30x larger.
std::vector<float> activations(int64_t R, int64_t C, uint64_t seed) {
  auto x = randn(R * C, seed, 1.0f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 5; c < C; c += 23) x[r * C + c] *= 30.0f;
  return x;
}
// Gradients [R, C]: per-row magnitudes spread over 2^-8 .. 2^2 (tokens' gradients differ by orders).
std::vector<float> gradients(int64_t R, int64_t C, uint64_t seed) {
  auto g = randn(R * C, seed, 1e-3f);
  auto u = randu(R, seed + 1, -8.0f, 2.0f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) g[r * C + c] = std::ldexp(g[r * C + c], int(std::floor(u[r])));
  return g;
}

// The operand with |codes| (sign bit cleared): fp8_gemm_ref of two of them is sum_k |a_k| |b_k|.
Fp8Tensor abs_of(Fp8Tensor t) {
  for (auto& q : t.q) q &= 0x7f;
  return t;
}

// The bound on |fp8_gemm - fp8_gemm_ref|: gamma_n sum |a b|, n = K with power-of-two scales (only the
// accumulation rounds), K + 2 otherwise (the dequantized value and the product round once each), plus the
// float64 twin's own rounding.
void compare_to_ref(Report& r, const std::string& what, const float* got, const double* want, const double* absab,
                    int64_t n, int64_t K, bool pow2) {
  const double u = std::ldexp(1.0, -24), kk = double(K + (pow2 ? 0 : 2));
  const double gamma = kk * u / (1 - kk * u) + (K + 1) * std::ldexp(1.0, -52);
  int64_t bad = 0;
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double lim = gamma * absab[i] + 1e-300, err = std::fabs(double(got[i]) - want[i]);
    bad += !(err <= lim);
    worst = std::max(worst, err / lim);
  }
  std::ostringstream os;
  os << "K=" << K << " worst err/(gamma_" << int64_t(kk) << " sum|ab|)=" << worst << " violations=" << bad;
  r.check(bad == 0, what + " vs fp64 twin within gamma_K sum|ab|", os.str());
}

// got == gemm_f32(N, T) of the operands dequantized by fp8_dequantize_ref, bit for bit.
void compare_bitwise(Report& r, const std::string& what, const float* got, const Fp8Tensor& A, const Fp8Tensor& B) {
  auto deq = [](const Fp8Tensor& t) {
    std::vector<float> o(static_cast<size_t>(t.rows * t.cols));
    const Fp8Layout l = t.layout();
    fp8_dequantize_ref(o.data(), t.q.data(), t.scales.data(), t.rows, t.cols, t.fmt, l.scaling, l.block_r, l.block_c);
    return o;
  };
  auto a = deq(A), b = deq(B);
  std::vector<float> c(static_cast<size_t>(A.rows * B.rows));
  gemm_f32(Trans::N, Trans::T, A.rows, B.rows, A.cols, 1.0f, a.data(), A.cols, b.data(), B.cols, 0.0f, c.data(),
           B.rows);
  r.check(std::memcmp(c.data(), got, c.size() * sizeof(float)) == 0,
          what + " == gemm_f32 of the reference-dequantized operands (bits)");
}

double sqnr_db(const float* got, const double* exact, int64_t n) {
  double s = 0, e = 0;
  for (int64_t i = 0; i < n; ++i) s += exact[i] * exact[i], e += (got[i] - exact[i]) * (got[i] - exact[i]);
  return 10.0 * std::log10(s / std::max(e, 1e-300));
}

bool same(const Fp8Tensor& a, const Fp8Tensor& b) {
  return a.rows == b.rows && a.cols == b.cols && a.q == b.q &&
         std::memcmp(a.scales.data(), b.scales.data(), a.scales.size() * 4) == 0 && a.scales.size() == b.scales.size();
}

// W^T [in, out] quantized along out: the exact transpose where the recipe allows it, else a requantization.
Fp8Tensor weight_t(const Fp8Tensor& Wq, const std::vector<float>& W, int64_t out, int64_t in, bool pow2) {
  if (Wq.recipe == Fp8Recipe::Tensorwise || Wq.recipe == Fp8Recipe::Blockwise) return fp8_transpose(Wq);
  return fp8_quantize_operand_t(W.data(), out, in, Wq.fmt, Wq.recipe, Fp8Role::Weight, pow2);
}

// ---------------------------------------------------------------------------------------------------
struct GemmCase : OpCase {
  Fp8Recipe rec;
  Fp8Format gfmt;  // gradients' format: E4M3 (all-E4M3) or E5M2 (hybrid); X and W are E4M3
  bool pow2;
  int64_t M = 150, K = 300, N = 140;  // partial 128- and 32-tiles along every contraction
  GemmCase(Fp8Recipe r, Fp8Format g, bool p2) : rec(r), gfmt(g), pow2(p2) {
    name = std::string("fp8/gemm_") + recipe_name(r) + (g == Fp8Format::E4M3 ? "_e4m3" : "_hybrid") +
           (p2 && r != Fp8Recipe::MXFP8 ? "_pow2" : "");
    flops = 2.0 * 512 * 512 * 512;
  }
  bool p2() const { return pow2 || rec == Fp8Recipe::MXFP8; }

  // forward, dgrad, wgrad results of one linear
  struct Run {
    std::vector<float> Y, dX, dW;
  };
  Run run(const std::vector<float>& X, const std::vector<float>& W, const std::vector<float>& G, Report* r) {
    const Fp8Format e4 = Fp8Format::E4M3;
    Fp8Tensor Xq = fp8_quantize_operand(X.data(), M, K, e4, rec, Fp8Role::Activation, pow2);
    Fp8Tensor Wq = fp8_quantize_operand(W.data(), N, K, e4, rec, Fp8Role::Weight, pow2);
    Fp8Tensor Gq = fp8_quantize_operand(G.data(), M, N, gfmt, rec, Fp8Role::Activation, pow2);
    Fp8Tensor Wt = weight_t(Wq, W, N, K, pow2);
    Fp8Tensor Gt = fp8_quantize_operand_t(G.data(), M, N, gfmt, rec, Fp8Role::Activation, pow2);
    Fp8Tensor Xt = fp8_quantize_operand_t(X.data(), M, K, e4, rec, Fp8Role::Activation, pow2);
    Run o{std::vector<float>(M * N), std::vector<float>(M * K), std::vector<float>(N * K)};
    fp8_gemm(o.Y.data(), N, Xq, Wq);
    fp8_gemm(o.dX.data(), K, Gq, Wt);
    fp8_gemm(o.dW.data(), K, Gt, Xt);
    if (r) {
      struct Op {
        const char* what;
        const Fp8Tensor &A, &B;
        const float* got;
      };
      for (const Op& op : {Op{"forward", Xq, Wq, o.Y.data()}, Op{"dgrad", Gq, Wt, o.dX.data()},
                           Op{"wgrad", Gt, Xt, o.dW.data()}}) {
        const int64_t n = op.A.rows * op.B.rows;
        std::vector<double> ref(n), absab(n);
        fp8_gemm_ref(ref.data(), op.A, op.B);
        fp8_gemm_ref(absab.data(), abs_of(op.A), abs_of(op.B));
        compare_to_ref(*r, op.what, op.got, ref.data(), absab.data(), n, op.A.cols, p2());
        compare_bitwise(*r, op.what, op.got, op.A, op.B);
      }
      // Transposed weights: exact where the tiles are square, and then equal to quantizing W^T again.
      if (rec == Fp8Recipe::Tensorwise || rec == Fp8Recipe::Blockwise) {
        Fp8Tensor again = fp8_quantize_operand_t(W.data(), N, K, e4, rec, Fp8Role::Weight, pow2);
        r->check(same(Wt, again), "fp8_transpose(W) == quantize(W^T) (codes and scale bits)");
        std::vector<float> a(N * K), b(N * K);
        fp8_dequantize_operand(a.data(), Wq);
        fp8_dequantize_operand(b.data(), Wt);
        bool ok = true;
        for (int64_t i = 0; i < N; ++i)
          for (int64_t k = 0; k < K; ++k)
            ok &= std::bit_cast<uint32_t>(a[i * K + k]) == std::bit_cast<uint32_t>(b[k * N + i]);
        r->check(ok, "dequantize(fp8_transpose(W)) == dequantize(W)^T (bits)");
      } else {
        r->expect_throw("fp8_transpose of non-square tiles", [&] { fp8_transpose(Xq); });
      }
      if (rec == Fp8Recipe::Blockwise) r->expect_throw("fp8_transpose of 1 x 128 tiles", [&] { fp8_transpose(Xq); });
      if (p2()) {
        bool ok = true;
        for (float s : Xq.scales) ok &= fp8_e8m0_decode(fp8_e8m0_encode(s)) == s;
        r->check(ok, "power-of-two scales round-trip through E8M0");
      }
    }
    return o;
  }

  void test(Report& r) override {
    auto X = activations(M, K, 1), W = randn(N * K, 2, 0.02f), G = gradients(M, N, 3);
    Run a = run(X, W, G, &r);
    Run b;
    with_threads(1, [&] { b = run(X, W, G, nullptr); });
    r.check(a.Y == b.Y && a.dX == b.dX && a.dW == b.dW, "1 thread == " + std::to_string(omp_get_max_threads()) +
                                                             " threads (forward, dgrad, wgrad)");
    // Shape and recipe errors are named.
    Fp8Tensor Xq = fp8_quantize_operand(X.data(), M, K, Fp8Format::E4M3, rec, Fp8Role::Activation, pow2);
    Fp8Tensor Gq = fp8_quantize_operand(G.data(), M, N, gfmt, rec, Fp8Role::Activation, pow2);
    std::vector<float> C(M * M);
    r.expect_throw("contraction sizes differ", [&] { fp8_gemm(C.data(), M, Xq, Gq); });
    r.expect_throw("recipe none", [&] { fp8_recipe_layout(Fp8Recipe::None, Fp8Role::Weight); });
    r.expect_throw("E8M0 of a non-power of two", [] { fp8_e8m0_encode(3.0f); });
  }

  // The exact gradients of L = <G, X W^T> by finite differences, then the FP8 run against them (SQNR bars).
  void grad(Report& r) override {
    {
      const int64_t m = 3, k = 5, n = 4;
      auto x = to_f64(randn(m * k, 7)), w = to_f64(randn(n * k, 8)), g = to_f64(randn(m * n, 9));
      auto loss = [&] {
        std::vector<double> y(m * n);
        gemm_ref<double>(Trans::N, Trans::T, m, n, k, 1.0, x.data(), k, w.data(), k, 0.0, y.data(), n);
        return dot(y.data(), g.data(), m * n);
      };
      std::vector<double> dx(m * k), dw(n * k);
      gemm_ref<double>(Trans::N, Trans::N, m, k, n, 1.0, g.data(), n, w.data(), k, 0.0, dx.data(), k);  // G W
      gemm_ref<double>(Trans::T, Trans::N, n, k, m, 1.0, g.data(), n, x.data(), k, 0.0, dw.data(), k);  // G^T X
      r.fd_check("dX = G W", x.data(), m * k, dx.data(), loss, fd_eps, grad_tol);
      r.fd_check("dW = G^T X", w.data(), n * k, dw.data(), loss, fd_eps, grad_tol);
    }
    auto X = activations(M, K, 11), W = randn(N * K, 12, 0.02f), G = gradients(M, N, 13);
    Run o = run(X, W, G, nullptr);
    auto x = to_f64(X), w = to_f64(W), g = to_f64(G);
    std::vector<double> y(M * N), dx(M * K), dw(N * K);
    gemm_ref<double>(Trans::N, Trans::T, M, N, K, 1.0, x.data(), K, w.data(), K, 0.0, y.data(), N);
    gemm_ref<double>(Trans::N, Trans::N, M, K, N, 1.0, g.data(), N, w.data(), K, 0.0, dx.data(), K);
    gemm_ref<double>(Trans::T, Trans::N, N, K, M, 1.0, g.data(), N, x.data(), K, 0.0, dw.data(), K);
    const double fwd_bar = 25.0, grad_bar = gfmt == Fp8Format::E4M3 ? 25.0 : 20.0;
    auto bar = [&](const char* what, double db, double want) {
      std::ostringstream os;
      os << db << " dB (bar " << want << ")";
      r.check(db >= want, std::string("SQNR ") + what, os.str());
    };
    bar("forward Y", sqnr_db(o.Y.data(), y.data(), M * N), fwd_bar);
    bar("dgrad dX", sqnr_db(o.dX.data(), dx.data(), M * K), grad_bar);
    bar("wgrad dW", sqnr_db(o.dW.data(), dw.data(), N * K), grad_bar);
  }

  void perf() override {
    static auto X = activations(512, 512, 1), W = randn(512 * 512, 2, 0.02f);
    static Fp8Tensor Xq = fp8_quantize_operand(X.data(), 512, 512, Fp8Format::E4M3, rec, Fp8Role::Activation, pow2);
    static Fp8Tensor Wq = fp8_quantize_operand(W.data(), 512, 512, Fp8Format::E4M3, rec, Fp8Role::Weight, pow2);
    static std::vector<float> Y(512 * 512);
    fp8_gemm(Y.data(), 512, Xq, Wq);
  }
};

// ---------------------------------------------------------------------------------------------------
struct GroupedCase : OpCase {
  Fp8Recipe rec;
  Fp8Format gfmt;
  std::vector<int32_t> counts{5, 0, 140, 19};  // an empty expert, one longer than a 128-token tile
  int64_t E = 4, M = 164, K = 200, N = 72;
  GroupedCase(Fp8Recipe r, Fp8Format g) : rec(r), gfmt(g) {
    name = std::string("fp8/grouped_") + recipe_name(r) + (g == Fp8Format::E4M3 ? "_e4m3" : "_hybrid");
    flops = 2.0 * M * K * N;
  }
  bool p2() const { return rec == Fp8Recipe::MXFP8; }

  void test(Report& r) override {
    const Fp8Format e4 = Fp8Format::E4M3;
    auto X = activations(M, K, 21), G = gradients(M, N, 22);
    std::vector<std::vector<float>> W;
    std::vector<Fp8Tensor> Wq, Wt;
    for (int64_t e = 0; e < E; ++e) {
      W.push_back(randn(N * K, 30 + e, 0.02f));
      Wq.push_back(fp8_quantize_operand(W.back().data(), N, K, e4, rec, Fp8Role::Weight));
      Wt.push_back(weight_t(Wq.back(), W.back(), N, K, false));
    }
    Fp8Tensor Xq = fp8_quantize_operand(X.data(), M, K, e4, rec, Fp8Role::Activation);
    Fp8Tensor Gq = fp8_quantize_operand(G.data(), M, N, gfmt, rec, Fp8Role::Activation);
    auto absv = [](const std::vector<Fp8Tensor>& v) {
      std::vector<Fp8Tensor> o;
      for (const auto& t : v) o.push_back(abs_of(t));
      return o;
    };
    // forward and dgrad (M-grouped)
    for (int pass = 0; pass < 2; ++pass) {
      const Fp8Tensor& A = pass == 0 ? Xq : Gq;
      const std::vector<Fp8Tensor>& B = pass == 0 ? Wq : Wt;
      const int64_t cols = B[0].rows, kc = A.cols;
      std::vector<float> C(M * cols, NAN);
      std::vector<double> ref(M * cols), absab(M * cols);
      fp8_grouped_gemm_m(C.data(), A, B, counts.data());
      fp8_grouped_gemm_m_ref(ref.data(), A, B, counts.data());
      fp8_grouped_gemm_m_ref(absab.data(), abs_of(A), absv(B), counts.data());
      const std::string what = pass == 0 ? "grouped forward" : "grouped dgrad";
      compare_to_ref(r, what, C.data(), ref.data(), absab.data(), M * cols, kc, p2());
      // Each expert's rows == fp8_gemm of that expert's slice (bits).
      bool ok = true;
      for (int64_t e = 0, o = 0; e < E; o += counts[e], ++e) {
        if (counts[e] == 0) continue;
        Fp8Tensor slice = A;  // the rows of expert e, with their scales (row-local tiles; tensorwise: the one scale)
        slice.rows = counts[e];
        slice.q.assign(A.q.begin() + o * kc, A.q.begin() + (o + counts[e]) * kc);
        if (rec != Fp8Recipe::Tensorwise) {
          const int64_t per_row = int64_t(A.scales.size()) / M;
          slice.scales.assign(A.scales.begin() + o * per_row, A.scales.begin() + (o + counts[e]) * per_row);
        }
        std::vector<float> c(counts[e] * cols);
        fp8_gemm(c.data(), cols, slice, B[e]);
        ok &= std::memcmp(c.data(), C.data() + o * cols, c.size() * 4) == 0;
      }
      r.check(ok, what + ": each expert's rows == fp8_gemm of its slice (bits)");
    }
    // wgrad (K-grouped): dW[e] [N, K] = dY_e^T X_e, operands quantized along each expert's tokens.
    auto Gt = fp8_quantize_groups_t(G.data(), M, N, counts.data(), E, gfmt, rec);
    auto Xt = fp8_quantize_groups_t(X.data(), M, K, counts.data(), E, e4, rec);
    std::vector<float> dW(E * N * K, NAN), dW2(E * N * K);
    std::vector<double> ref(E * N * K), absab(E * N * K);
    fp8_grouped_gemm_k(dW.data(), Gt, Xt, N, K, false);
    fp8_grouped_gemm_k_ref(ref.data(), Gt, Xt, N, K);
    fp8_grouped_gemm_k_ref(absab.data(), absv(Gt), absv(Xt), N, K);
    compare_to_ref(r, "grouped wgrad", dW.data(), ref.data(), absab.data(), E * N * K, 140, p2());
    bool zero = true;
    for (int64_t i = N * K; i < 2 * N * K; ++i) zero &= dW[i] == 0.0f;
    r.check(zero, "expert without tokens: dW[e] == 0");
    dW2 = dW;
    fp8_grouped_gemm_k(dW2.data(), Gt, Xt, N, K, true);
    bool twice = true;
    for (int64_t i = 0; i < E * N * K; ++i) twice &= dW2[i] == 2.0f * dW[i];  // fma(1, c, c) = 2c exactly
    r.check(twice, "accumulate: dW += same product gives 2 dW (bits)");
    r.expect_throw("expert weight of the wrong shape", [&] {
      std::vector<Fp8Tensor> bad = Wq;
      bad[2] = Wt[2];
      std::vector<float> C(M * N);
      fp8_grouped_gemm_m(C.data(), Xq, bad, counts.data());
    });
  }

  void grad(Report& r) override {
    // SQNR of the grouped forward against the exact product (the bars of the dense case).
    const Fp8Format e4 = Fp8Format::E4M3;
    auto X = activations(M, K, 41);
    std::vector<Fp8Tensor> Wq;
    std::vector<std::vector<double>> W64;
    for (int64_t e = 0; e < E; ++e) {
      auto w = randn(N * K, 50 + e, 0.02f);
      Wq.push_back(fp8_quantize_operand(w.data(), N, K, e4, rec, Fp8Role::Weight));
      W64.push_back(to_f64(w));
    }
    Fp8Tensor Xq = fp8_quantize_operand(X.data(), M, K, e4, rec, Fp8Role::Activation);
    std::vector<float> Y(M * N);
    fp8_grouped_gemm_m(Y.data(), Xq, Wq, counts.data());
    auto x = to_f64(X);
    std::vector<double> y(M * N);
    for (int64_t e = 0, o = 0; e < E; o += counts[e], ++e)
      gemm_ref<double>(Trans::N, Trans::T, counts[e], N, K, 1.0, x.data() + o * K, K, W64[e].data(), K, 0.0,
                       y.data() + o * N, N);
    const double db = sqnr_db(Y.data(), y.data(), M * N);
    std::ostringstream os;
    os << db << " dB (bar 25)";
    r.check(db >= 25.0, "SQNR grouped forward", os.str());
  }

  void perf() override {
    static auto X = activations(M, K, 21);
    static Fp8Tensor Xq = fp8_quantize_operand(X.data(), M, K, Fp8Format::E4M3, rec, Fp8Role::Activation);
    static std::vector<Fp8Tensor> Wq = [&] {
      std::vector<Fp8Tensor> v;
      for (int64_t e = 0; e < E; ++e) {
        auto w = randn(N * K, 30 + e, 0.02f);
        v.push_back(fp8_quantize_operand(w.data(), N, K, Fp8Format::E4M3, rec, Fp8Role::Weight));
      }
      return v;
    }();
    static std::vector<float> Y(M * N);
    fp8_grouped_gemm_m(Y.data(), Xq, Wq, counts.data());
  }
};

// ---------------------------------------------------------------------------------------------------
struct DelayedCase : OpCase {
  Fp8Format fmt;
  explicit DelayedCase(Fp8Format f) : fmt(f) { name = std::string("fp8/delayed_") + fp8_format_name(f); }

  void test(Report& r) override {
    const int64_t R = 8, C = 50;
    Fp8AmaxHistory h(3);
    r.check(h.scale(fmt) == 1.0f, "empty history: scale 1");
    const float amaxes[] = {2.0f, 8.0f, 1.0f, 0.5f, 0.25f};
    float expect_hist_max = 0;
    std::vector<float> seen;
    for (int step = 0; step < 5; ++step) {
      auto x = randn(R * C, 60 + step, 0.3f * amaxes[step]);
      x[7] = amaxes[step];  // an element of this size; the recorded amax is measured below
      float a = 0;
      for (float v : x) a = std::max(a, std::fabs(v));
      const float s = h.scale(fmt);
      expect_hist_max = 0;
      for (size_t i = seen.size() >= 3 ? seen.size() - 3 : 0; i < seen.size(); ++i)
        expect_hist_max = std::max(expect_hist_max, seen[i]);
      const float want_s = fp8_scale_from_amax(expect_hist_max, fmt, false);
      Fp8Tensor q = fp8_quantize_delayed(x.data(), R, C, fmt, Fp8Role::Activation, h);
      seen.push_back(a);
      bool codes = true;
      for (int64_t i = 0; i < R * C; ++i)
        codes &= q.q[i] == (fmt == Fp8Format::E4M3 ? float_to_e4m3_bits(x[i] / want_s)
                                                   : float_to_e5m2_bits(x[i] / want_s));
      std::ostringstream os;
      os << "step " << step << ": scale " << s << " want " << want_s << " (max of the last 3 amaxes)";
      r.check(s == want_s && q.scales.size() == 1 && q.scales[0] == want_s && codes, "delayed scale and codes",
              os.str());
      if (step == 1) {  // amax 8 with the scale of amax 2: the largest values saturate to +-max
        std::vector<float> y(R * C);
        fp8_dequantize_operand(y.data(), q);
        float ym = 0;
        for (float v : y) ym = std::max(ym, std::fabs(v));
        r.check(ym == fp8_max(fmt) * want_s, "values beyond the delayed scale saturate to max * scale");
      }
    }
    r.check(h.pos == 5 % 3, "history ring position");
    r.expect_throw("history length 0", [] { Fp8AmaxHistory bad(0); });
  }
  void grad(Report& r) override { r.check(true, "no gradient (quantization only; see fp8/gemm_*)"); }
  void perf() override {}
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  using R = Fp8Recipe;
  for (R rec : {R::Tensorwise, R::Rowwise, R::Blockwise, R::MXFP8})
    for (Fp8Format g : {Fp8Format::E4M3, Fp8Format::E5M2}) v.push_back(std::make_unique<GemmCase>(rec, g, false));
  v.push_back(std::make_unique<GemmCase>(R::Blockwise, Fp8Format::E4M3, true));
  v.push_back(std::make_unique<GemmCase>(R::Tensorwise, Fp8Format::E5M2, true));
  for (R rec : {R::Tensorwise, R::Rowwise, R::Blockwise, R::MXFP8})
    v.push_back(std::make_unique<GroupedCase>(rec, rec == R::Blockwise ? Fp8Format::E5M2 : Fp8Format::E4M3));
  v.push_back(std::make_unique<DelayedCase>(Fp8Format::E4M3));
  v.push_back(std::make_unique<DelayedCase>(Fp8Format::E5M2));
  return v;
}

MT_REGISTER_OP_CASES(make_cases);

}  // namespace
