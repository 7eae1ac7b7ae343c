// bench_fp8_accum.cpp: two numerics studies of the FP8 recipes (a plain program, not Google Benchmark):
//   accum  the accumulation-precision study of DeepSeek-V3 (section 3.3.2): a GEMM with K = 4096 whose
//          running sum keeps only `bits` significant bits (rounded after every add, to nearest even or toward
//          zero), against the same with the partial sum promoted into an fp32 accumulator every N_C products;
//   sqnr   quantization error per recipe and format as SQNR (dB): of the tensors themselves and of the
//          forward, dgrad and wgrad GEMM outputs (fp8_gemm) against the exact fp64 products, on synthetic
//          activations (outlier channels), weights and gradients (per-token magnitudes over --octaves octaves).
// Not a speed benchmark: on a CPU the FP8 GEMM decodes to fp32 and is no faster than gemm_f32.
//   speed  fp8_gemm (decode + gemm_f32) against gemm_f32, same run, 1024^3.
// Usage: bench_fp8_accum [accum|sqnr|speed|all] [--k 4096] [--bits 14] [--nc 128] [--octaves 10] [--outlier 30]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "moetron/fp8_gemm.h"
#include "moetron/gemm.h"
#include "moetron/rng.h"

using namespace moetron;

namespace {

// A stream of draws from the counter-based generator of rng.h.
struct Rng {
  uint64_t key, i = 0;
  explicit Rng(uint64_t seed) : key(rng_key(seed, "bench_fp8_accum")) {}
  float uniform() { return rng_uniform(key, i++); }
  float normal() { return rng_normal(key, i++); }
};

std::vector<float> normal(int64_t n, uint64_t seed, float scale) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = scale * rng.normal();
  return v;
}

// v rounded to `bits` significant bits: to nearest (ties to even) or toward zero.
double round_bits(double v, int bits, bool truncate) {
  if (v == 0.0 || !std::isfinite(v)) return v;
  int e;
  std::frexp(v, &e);  // |v| in [2^(e-1), 2^e)
  const double ulp = std::ldexp(1.0, e - bits);
  return (truncate ? std::trunc(v / ulp) : std::nearbyint(v / ulp)) * ulp;
}

struct AccumResult {
  double max_rel = 0, norm_rel = 0;
};

// products: P[o][k] for each output o. Accumulates in `bits` bits (0 = fp32), promoting every nc (0 = never).
AccumResult accumulate(const std::vector<std::vector<double>>& P, const std::vector<double>& exact, int bits,
                       bool truncate, int64_t nc) {
  AccumResult r;
  double num = 0, den = 0;
  for (size_t o = 0; o < P.size(); ++o) {
    float total = 0.0f;  // the fp32 accumulator products are promoted into
    double part = 0.0;
    const int64_t K = int64_t(P[o].size());
    for (int64_t k = 0; k < K; ++k) {
      part = bits > 0 ? round_bits(part + P[o][k], bits, truncate) : double(float(part + P[o][k]));
      if (nc > 0 && (k + 1) % nc == 0) total += float(part), part = 0.0;
    }
    const double got = nc > 0 ? double(total + float(part)) : part;
    const double err = std::fabs(got - exact[o]);
    r.max_rel = std::max(r.max_rel, err / std::fabs(exact[o]));
    num += err * err, den += exact[o] * exact[o];
  }
  r.norm_rel = std::sqrt(num / den);
  return r;
}

void study_accum(int64_t K, int bits, int64_t nc) {
  // E4M3 operands (their products are exact in fp64), uniform in [0, 1): all products positive, so every
  // output is a sum that grows linearly with K (no cancellation to hide or inflate the relative error).
  // And N(0, 1) operands, where signs cancel.
  const int64_t outs = 512;
  std::printf("accumulation study: %lld outputs, K = %lld, E4M3 operands, accumulator %d significant bits, "
              "promotion every N_C = %lld\n",
              (long long)outs, (long long)K, bits, (long long)nc);
  std::printf("%-22s %-18s %14s %14s\n", "data", "accumulator", "max rel err", "norm rel err");
  for (int dist = 0; dist < 2; ++dist) {
    Rng rng(1234 + dist);
    std::vector<float> a(static_cast<size_t>(outs * K)), b(static_cast<size_t>(K));
    for (auto& x : a) x = dist == 0 ? float(rng.uniform()) : rng.normal();
    for (auto& x : b) x = dist == 0 ? float(rng.uniform()) : rng.normal();
    Fp8Tensor A = fp8_quantize_operand(a.data(), outs, K, Fp8Format::E4M3, Fp8Recipe::Tensorwise, Fp8Role::Activation);
    Fp8Tensor B = fp8_quantize_operand(b.data(), 1, K, Fp8Format::E4M3, Fp8Recipe::Tensorwise, Fp8Role::Weight);
    std::vector<float> ad(a.size()), bd(b.size());
    fp8_dequantize_operand(ad.data(), A);
    fp8_dequantize_operand(bd.data(), B);
    std::vector<std::vector<double>> P(static_cast<size_t>(outs), std::vector<double>(static_cast<size_t>(K)));
    std::vector<double> exact(size_t(outs), 0.0);
    for (int64_t o = 0; o < outs; ++o)
      for (int64_t k = 0; k < K; ++k) {
        P[o][k] = double(ad[o * K + k]) * double(bd[k]);
        exact[o] += P[o][k];
      }
    const char* dn = dist == 0 ? "uniform [0,1) (>= 0)" : "normal N(0,1)";
    struct Row {
      const char* name;
      int bits;
      bool trunc;
      int64_t nc;
    };
    const std::string lim = std::to_string(bits) + "b";
    const std::string names[] = {lim + " nearest", lim + " toward 0", lim + " nearest, N_C", lim + " toward 0, N_C",
                                 "fp32"};
    const Row rows[] = {{names[0].c_str(), bits, false, 0},
                        {names[1].c_str(), bits, true, 0},
                        {names[2].c_str(), bits, false, nc},
                        {names[3].c_str(), bits, true, nc},
                        {names[4].c_str(), 0, false, 0}};
    for (const Row& rw : rows) {
      AccumResult r = accumulate(P, exact, rw.bits, rw.trunc, rw.nc);
      std::printf("%-22s %-18s %13.4f%% %13.4f%%\n", dn, rw.name, 100 * r.max_rel, 100 * r.norm_rel);
    }
  }
}

double sqnr(const float* got, const double* exact, int64_t n) {
  double s = 0, e = 0;
  for (int64_t i = 0; i < n; ++i) s += exact[i] * exact[i], e += (got[i] - exact[i]) * (got[i] - exact[i]);
  return 10 * std::log10(s / e);
}
double sqnr_f(const float* got, const float* x, int64_t n) {
  std::vector<double> d(x, x + n);
  return sqnr(got, d.data(), n);
}

// The 10th percentile over rows of each row's SQNR: whole-tensor SQNR is dominated by the largest values, so
// rows (tokens) crushed into the subnormals by a coarse scale only show here.
double row_sqnr_p10(const float* got, const float* x, int64_t R, int64_t C) {
  std::vector<double> v;
  for (int64_t r = 0; r < R; ++r) v.push_back(sqnr_f(got + r * C, x + r * C, C));
  std::sort(v.begin(), v.end());
  return v[size_t(R / 10)];
}

void study_sqnr(int octaves, float outlier) {
  const int64_t T = 1024, D = 512, F = 512;  // tokens, in, out
  // Activations: N(0,1), every 23rd channel `outlier` times larger. Weights: N(0, 0.02) with a Student-t(4)
  // tail (a few large entries). Gradients: N(0, 1e-3) per token scaled by 2^u, u uniform in [2 - octaves, 2).
  auto X = normal(T * D, 1, 1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 5; c < D; c += 23) X[t * D + c] *= outlier;
  auto W = normal(F * D, 2, 0.02f);
  {
    Rng rng(3);
    for (auto& w : W) {  // t(4) = z / sqrt(chi2_4 / 4)
      double chi = 0;
      for (int i = 0; i < 4; ++i) {
        const double z = rng.normal();
        chi += z * z;
      }
      w = float(w / std::sqrt(chi / 4));
    }
  }
  auto G = normal(T * F, 4, 1e-3f);
  {
    Rng rng(5);
    for (int64_t t = 0; t < T; ++t) {
      const int u = int(std::floor(2 - octaves + octaves * rng.uniform()));
      for (int64_t c = 0; c < F; ++c) G[t * F + c] = std::ldexp(G[t * F + c], u);
    }
  }
  // Exact GEMM outputs in fp64.
  std::vector<double> x(X.begin(), X.end()), w(W.begin(), W.end()), g(G.begin(), G.end());
  std::vector<double> Y(T * F), dX(T * D), dW(F * D);
  gemm_ref<double>(Trans::N, Trans::T, T, F, D, 1.0, x.data(), D, w.data(), D, 0.0, Y.data(), F);
  gemm_ref<double>(Trans::N, Trans::N, T, D, F, 1.0, g.data(), F, w.data(), D, 0.0, dX.data(), D);
  gemm_ref<double>(Trans::T, Trans::N, F, D, T, 1.0, g.data(), F, x.data(), D, 0.0, dW.data(), D);

  std::printf("SQNR (dB), synthetic tensors: X [%lld, %lld] with every 23rd channel x%g, W [%lld, %lld] t(4)-tailed, "
              "dY [%lld, %lld] over %d octaves per token\n",
              (long long)T, (long long)D, double(outlier), (long long)F, (long long)D, (long long)T, (long long)F,
              octaves);
  std::printf("%-11s %-7s %7s %7s %7s %9s | %8s %8s %8s\n", "recipe", "dY fmt", "q(X)", "q(W)", "q(dY)",
              "dY rowp10", "Y fwd", "dX dgrad", "dW wgrad");
  const Fp8Format e4 = Fp8Format::E4M3;
  for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Rowwise, Fp8Recipe::Blockwise, Fp8Recipe::MXFP8})
    for (Fp8Format gf : {Fp8Format::E4M3, Fp8Format::E5M2}) {
      Fp8Tensor Xq = fp8_quantize_operand(X.data(), T, D, e4, r, Fp8Role::Activation);
      Fp8Tensor Wq = fp8_quantize_operand(W.data(), F, D, e4, r, Fp8Role::Weight);
      Fp8Tensor Gq = fp8_quantize_operand(G.data(), T, F, gf, r, Fp8Role::Activation);
      Fp8Tensor Wt = (r == Fp8Recipe::Tensorwise || r == Fp8Recipe::Blockwise)
                         ? fp8_transpose(Wq)
                         : fp8_quantize_operand_t(W.data(), F, D, e4, r, Fp8Role::Weight);
      Fp8Tensor Gt = fp8_quantize_operand_t(G.data(), T, F, gf, r, Fp8Role::Activation);
      Fp8Tensor Xt = fp8_quantize_operand_t(X.data(), T, D, e4, r, Fp8Role::Activation);
      std::vector<float> xd(T * D), wd(F * D), gd(T * F), y(T * F), dx(T * D), dw(F * D);
      fp8_dequantize_operand(xd.data(), Xq);
      fp8_dequantize_operand(wd.data(), Wq);
      fp8_dequantize_operand(gd.data(), Gq);
      fp8_gemm(y.data(), F, Xq, Wq);
      fp8_gemm(dx.data(), D, Gq, Wt);
      fp8_gemm(dw.data(), D, Gt, Xt);
      std::printf("%-11s %-7s %7.1f %7.1f %7.1f %9.1f | %8.1f %8.1f %8.1f\n", std::string(to_string(r)).c_str(),
                  fp8_format_name(gf), sqnr_f(xd.data(), X.data(), T * D), sqnr_f(wd.data(), W.data(), F * D),
                  sqnr_f(gd.data(), G.data(), T * F), row_sqnr_p10(gd.data(), G.data(), T, F),
                  sqnr(y.data(), Y.data(), T * F), sqnr(dx.data(), dX.data(), T * D),
                  sqnr(dw.data(), dW.data(), F * D));
    }
}

// Same-run timing of fp8_gemm (dequantize + gemm_f32) against gemm_f32 on the dequantized operands: the
// emulation's cost, not an FP8 speed-up (there is none on a CPU).
void study_speed(int64_t n) {
  auto X = normal(n * n, 7, 1.0f), W = normal(n * n, 8, 0.02f);
  std::vector<float> Y(static_cast<size_t>(n * n)), xd(X.size()), wd(W.size());
  std::printf("speed, %lld^3, %d threads, best of 5 (ms):\n", (long long)n, omp_get_max_threads());
  auto best = [](auto&& f) {
    double b = 1e30;
    for (int r = 0; r < 6; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      const double s = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) b = std::min(b, s);
    }
    return b;
  };
  for (Fp8Recipe r : {Fp8Recipe::Tensorwise, Fp8Recipe::Blockwise, Fp8Recipe::MXFP8}) {
    Fp8Tensor Xq = fp8_quantize_operand(X.data(), n, n, Fp8Format::E4M3, r, Fp8Role::Activation);
    Fp8Tensor Wq = fp8_quantize_operand(W.data(), n, n, Fp8Format::E4M3, r, Fp8Role::Weight);
    fp8_dequantize_operand(xd.data(), Xq);
    fp8_dequantize_operand(wd.data(), Wq);
    const double q = best([&] {
      Fp8Tensor a = fp8_quantize_operand(X.data(), n, n, Fp8Format::E4M3, r, Fp8Role::Activation);
      (void)a;
    });
    const double d = best([&] { fp8_dequantize_operand(xd.data(), Xq); });
    const double g8 = best([&] { fp8_gemm(Y.data(), n, Xq, Wq); });
    const double g32 = best([&] {
      gemm_f32(Trans::N, Trans::T, n, n, n, 1.0f, xd.data(), n, wd.data(), n, 0.0f, Y.data(), n);
    });
    std::printf("%-11s quantize %.2f  dequantize %.2f  fp8_gemm %.2f  gemm_f32 %.2f  ratio %.2f\n",
                std::string(to_string(r)).c_str(), q, d, g8, g32, g8 / g32);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string what = "all";
  int64_t K = 4096, nc = 128;
  int bits = 14, octaves = 10;
  float outlier = 30.0f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_fp8_accum: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--k") K = std::atoll(next());
    else if (a == "--bits") bits = std::atoi(next());
    else if (a == "--nc") nc = std::atoll(next());
    else if (a == "--octaves") octaves = std::atoi(next());
    else if (a == "--outlier") outlier = float(std::atof(next()));
    else if (a == "accum" || a == "sqnr" || a == "speed" || a == "all") what = a;
    else {
      std::fprintf(stderr,
                   "bench_fp8_accum: unknown argument '%s' (usage: [accum|sqnr|speed|all] [--k N] [--bits B] "
                   "[--nc N] [--octaves N] [--outlier F])\n",
                   a.c_str());
      return 2;
    }
  }
  if (K < 1 || bits < 2 || bits > 52 || nc < 1 || octaves < 1 || octaves > 60 || !(outlier > 0)) {
    std::fprintf(stderr, "bench_fp8_accum: need --k >= 1, 2 <= --bits <= 52, --nc >= 1, 1 <= --octaves <= 60, "
                         "--outlier > 0\n");
    return 2;
  }
  if (what == "speed") {
    study_speed(1024);
    return 0;
  }
  if (what != "sqnr") study_accum(K, bits, nc);
  if (what == "all") std::printf("\n");
  if (what != "accum") study_sqnr(octaves, outlier);
  return 0;
}
