// fp8_cases.cpp: op-harness cases for FP8 quantize / dequantize / fake quant (family fp8).
//   fp8/codec_<fmt>              vector codec vs scalar dtype.h codec, bit for bit, over every code and a
//                                large set of floats (ties, subnormals, saturation, NaN, a stride over
//                                all 2^32 bit patterns)
//   fp8/<fmt>_<scaling>[_pow2]   quantize / dequantize / fake quant vs the reference twins (bitwise),
//                                round-trip error vs the format's bound, thread-count independence
// Grad mode: the straight-through backward is the identity, and the quantized-GEMM recipe
// dequant(quant(A)) · dequant(quant(B))^T stays within its analytic error bound vs the exact product.
#include <omp.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "moetron/fp8.h"
#include "moetron/gemm.h"
#include "moetron/rng.h"

using namespace moetron;
using namespace moetron::ops;

namespace {

std::vector<int32_t> widen(const std::vector<uint8_t>& v) { return std::vector<int32_t>(v.begin(), v.end()); }
std::vector<int32_t> float_bits(const std::vector<float>& v) {
  std::vector<int32_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = std::bit_cast<int32_t>(v[i]);
  return o;
}

uint8_t enc_scalar(float v, Fp8Format f) { return f == Fp8Format::E4M3 ? float_to_e4m3_bits(v) : float_to_e5m2_bits(v); }
float dec_scalar(uint8_t b, Fp8Format f) { return f == Fp8Format::E4M3 ? e4m3_bits_to_float(b) : e5m2_bits_to_float(b); }

// Runs f with the OpenMP thread count set to n, then restores it.
// ---------------------------------------------------------------------------------------------------
struct CodecCase : OpCase {
  Fp8Format fmt;
  explicit CodecCase(Fp8Format f) : fmt(f) {
    name = std::string("fp8/codec_") + fp8_format_name(f);
    bytes = 5.0 * (1 << 20);
  }

  std::vector<float> inputs() const {
    std::vector<float> x;
    auto both = [&](float v) {
      x.push_back(v);
      x.push_back(-v);
    };
    // Every code, the midpoints between neighbouring codes (ties) and one float ulp either side.
    std::vector<float> vals;
    for (int b = 0; b < 128; ++b) {
      float v = dec_scalar(uint8_t(b), fmt);
      if (std::isfinite(v)) vals.push_back(v);
    }
    for (size_t i = 0; i < vals.size(); ++i) {
      both(vals[i]);
      both(std::nextafter(vals[i], 0.0f));
      both(std::nextafter(vals[i], INFINITY));
      if (i + 1 < vals.size()) {
        float mid = 0.5f * (vals[i] + vals[i + 1]);  // exact: neighbours differ in few bits
        both(mid);
        both(std::nextafter(mid, 0.0f));
        both(std::nextafter(mid, INFINITY));
      }
    }
    // Saturation: beyond the largest finite value, the would-be next code's midpoint, huge, inf.
    const float mx = fp8_max(fmt);
    for (float v : {mx * 1.03125f, mx * 1.0625f, mx * 1.07f, mx * 1.125f, mx * 2.0f, 1e30f, FLT_MAX, INFINITY}) both(v);
    // Zeros, float subnormals, NaNs with several payloads and signs.
    for (float v : {0.0f, std::ldexp(1.0f, -149), std::ldexp(1.0f, -130), FLT_MIN}) both(v);
    for (uint32_t u : {0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0xffc00000u, 0xff800001u, 0x7fa00000u})
      x.push_back(std::bit_cast<float>(u));
    // A stride through all 2^32 float bit patterns (a prime stride touches every exponent and sign).
    for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 4093) x.push_back(std::bit_cast<float>(uint32_t(u)));
    return x;
  }

  void test(Report& r) override {
    auto x = inputs();
    const int64_t n = int64_t(x.size());
    std::vector<uint8_t> got(n), want(n);
    fp8_encode(got.data(), x.data(), n, fmt);
    for (int64_t i = 0; i < n; ++i) want[i] = enc_scalar(x[i], fmt);
    auto g = widen(got), w = widen(want);
    r.compare("encode vs scalar codec (" + std::to_string(n) + " floats)", g.data(), w.data(), n);
    // Odd lengths exercise the masked tails.
    for (int64_t len : {1, 7, 15, 17, 33}) {
      std::vector<uint8_t> t(len + 1, 0xAA);
      fp8_encode(t.data(), x.data() + 100, len, fmt);
      bool ok = t[len] == 0xAA;
      for (int64_t i = 0; i < len; ++i) ok &= t[i] == want[100 + i];
      r.check(ok, "encode tail length " + std::to_string(len) + " (and no write past the end)");
    }
    // Decode: all 256 codes, bit for bit (NaN codes give the scalar decoder's NaN bits).
    std::vector<uint8_t> codes(256);
    for (int b = 0; b < 256; ++b) codes[b] = uint8_t(b);
    std::vector<float> dg(256), dw(256);
    fp8_decode(dg.data(), codes.data(), 256, fmt);
    for (int b = 0; b < 256; ++b) dw[b] = dec_scalar(uint8_t(b), fmt);
    auto bg = float_bits(dg), bw = float_bits(dw);
    r.compare("decode all 256 codes (bits)", bg.data(), bw.data(), 256);
    std::vector<float> t(20, -7.0f);
    fp8_decode(t.data(), codes.data() + 60, 19, fmt);
    bool ok = t[19] == -7.0f;
    for (int i = 0; i < 19; ++i) ok &= std::bit_cast<uint32_t>(t[i]) == std::bit_cast<uint32_t>(dw[60 + i]);
    r.check(ok, "decode tail length 19 (and no write past the end)");
  }

  void grad(Report& r) override {
    // No gradient of its own: the codec's rounding is checked against the half-ulp bound instead.
    const int M = fp8_mantissa_bits(fmt), emin = fp8_min_normal_exp(fmt);
    auto x = randn(1 << 14, 71, 30.0f);
    std::vector<uint8_t> q(x.size());
    std::vector<float> y(x.size());
    fp8_encode(q.data(), x.data(), int64_t(x.size()), fmt);
    fp8_decode(y.data(), q.data(), int64_t(x.size()), fmt);
    int64_t bad = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      double a = std::fabs(double(x[i]));
      double lim = a >= std::ldexp(1.0, emin) ? std::ldexp(a, -(M + 1)) : std::ldexp(1.0, emin - M - 1);
      if (a > fp8_max(fmt)) lim = a - fp8_max(fmt);
      if (std::fabs(double(y[i]) - double(x[i])) > lim) ++bad;
    }
    r.check(bad == 0, "unscaled codec round trip within half an ulp", "violations=" + std::to_string(bad));
  }

  void perf() override {
    static std::vector<float> x = randn(1 << 20, 5, 50.0f);
    static std::vector<uint8_t> q(1 << 20);
    fp8_encode(q.data(), x.data(), 1 << 20, fmt);
  }
};

// ---------------------------------------------------------------------------------------------------
struct QuantCase : OpCase {
  Fp8Format fmt;
  Fp8Scaling sc;
  int64_t R, C, br, bc;
  bool pow2;
  QuantCase(Fp8Format f, Fp8Scaling s, int64_t R_, int64_t C_, int64_t br_, int64_t bc_, bool p2)
      : fmt(f), sc(s), R(R_), C(C_), br(br_), bc(bc_), pow2(p2) {
    std::ostringstream os;
    os << "fp8/" << fp8_format_name(f) << "_" << fp8_scaling_name(s);
    if (s == Fp8Scaling::Block) os << br << "x" << bc;
    if (p2) os << "_pow2";
    os << "_" << R << "x" << C;
    name = os.str();
    bytes = 5.0 * 2048 * 2048;  // perf: read fp32, write fp8
  }

  // Test data: normal values with a per-row dynamic range of 2^-24 .. 2^4 (so the scaled values reach
  // the fp8 subnormals), an all-zero block, and a NaN and +-inf placed in one block.
  std::vector<float> data() const {
    std::vector<float> x = randn(R * C, 11 + uint64_t(fmt), 1.0f);
    auto u = randu(R * C, 12, -24.0f, 4.0f);
    for (int64_t i = 0; i < R * C; ++i) x[i] = std::ldexp(x[i], int(std::floor(u[i])));
    int64_t zr = std::min<int64_t>(R, 2), zc = std::min<int64_t>(C, 3);  // rows [0, zr) x cols [0, zc) zero
    for (int64_t r = 0; r < zr; ++r)
      for (int64_t c = 0; c < zc; ++c) x[r * C + c] = 0.0f;
    if (R > 3 && C > 7) {
      x[3 * C + 5] = NAN;
      x[3 * C + 6] = INFINITY;
      x[3 * C + 7] = -INFINITY;
    }
    return x;
  }

  void test(Report& r) override {
    const auto x = data();
    const int64_t n = R * C, ns = fp8_num_scales(R, C, sc, br, bc);
    std::vector<uint8_t> q(n), qr(n);
    std::vector<float> s(ns), sr(ns), y(n), yr(n), f(n), fs(ns);
    fp8_quantize(q.data(), s.data(), x.data(), R, C, fmt, sc, br, bc, pow2);
    fp8_quantize_ref(qr.data(), sr.data(), x.data(), R, C, fmt, sc, br, bc, pow2);
    auto a = widen(q), b = widen(qr);
    r.compare("codes vs ref", a.data(), b.data(), n);
    auto sb = float_bits(s), srb = float_bits(sr);
    r.compare("scales vs ref (bits), " + std::to_string(ns) + " scales", sb.data(), srb.data(), ns);
    fp8_dequantize(y.data(), q.data(), s.data(), R, C, fmt, sc, br, bc);
    fp8_dequantize_ref(yr.data(), qr.data(), sr.data(), R, C, fmt, sc, br, bc);
    auto yb = float_bits(y), yrb = float_bits(yr);
    r.compare("dequantize vs ref (bits)", yb.data(), yrb.data(), n);
    fp8_fake_quant(f.data(), fs.data(), x.data(), R, C, fmt, sc, br, bc, pow2);
    auto fb = float_bits(f);
    r.compare("fake quant == dequant(quant) (bits)", fb.data(), yb.data(), n);

    // Round-trip error bound. y = x/s (rounded), q = RNE(y), x' = q*s (rounded):
    //   normal range of the scaled format: |x - x'| <= 2^-(M+1) |x| (1 + 2^-24) + 2^-24 (|x| + |x'|)
    //   below 2^emin (scaled):             |x - x'| <= 2^(emin-M-1) s + 2^-24 (|x| + |x'|)
    // With power-of-two scales the division and product are exact and the 2^-24 terms vanish.
    const int M = fp8_mantissa_bits(fmt), emin = fp8_min_normal_exp(fmt);
    int64_t pb, pc;
    fp8_block_shape(&pb, &pc, R, C, sc, br, bc);
    const int64_t nbc = (C + pc - 1) / pc;
    const double fl = pow2 ? 0.0 : std::ldexp(1.0, -24);
    int64_t bad = 0, nonfinite_bad = 0, checked = 0;
    double worst = 0;
    for (int64_t rr = 0; rr < R; ++rr)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = rr * C + c;
        const double sv = s[(rr / pb) * nbc + c / pc];
        const double xv = x[i], yv = y[i];
        if (std::isnan(xv)) {
          nonfinite_bad += !std::isnan(yv);
          continue;
        }
        if (std::isinf(xv)) {  // saturates to +-max * scale
          nonfinite_bad += float(yv) != std::copysign(fp8_max(fmt) * float(sv), float(xv));  // float product, as decode*scale
          continue;
        }
        const double ax = std::fabs(xv), ay = std::fabs(yv);
        const bool normal = ax / sv >= std::ldexp(1.0, emin);
        const double lim = (normal ? std::ldexp(ax, -(M + 1)) * (1 + fl) : std::ldexp(sv, emin - M - 1)) +
                           fl * (ax + ay);
        const double err = std::fabs(xv - yv);
        if (err > lim) ++bad;
        if (lim > 0) worst = std::max(worst, err / lim);
        ++checked;
      }
    std::ostringstream os;
    os << "checked=" << checked << " worst err/bound=" << worst << " violations=" << bad;
    r.check(bad == 0, "round trip within 2^-(M+1)|x| (normal) / half subnormal spacing * scale", os.str());
    r.check(nonfinite_bad == 0, "NaN stays NaN, +-inf saturates to +-max*scale");
    // An all-zero matrix: every scale is 1, every code 0 (amax = 0 must not divide by zero).
    {
      std::vector<float> z(n, 0.0f), zs(ns, -1.0f);
      std::vector<uint8_t> zq(n, 0xff);
      fp8_quantize(zq.data(), zs.data(), z.data(), R, C, fmt, sc, br, bc, pow2);
      bool ok = true;
      for (float v : zs) ok &= v == 1.0f;
      for (uint8_t v : zq) ok &= v == 0;
      r.check(ok, "all-zero input: scales 1, codes 0");
    }
    if (pow2) {
      bool ok = true;
      for (float v : s) {
        int e;
        ok &= std::frexp(v, &e) == 0.5f;
      }
      r.check(ok, "pow2 scales are powers of two");
    }
    // Thread-count independence: 1 thread vs the default, bitwise.
    std::vector<uint8_t> q1(n);
    std::vector<float> s1(ns), f1(n), fs1(ns);
    with_threads(1, [&] {
      fp8_quantize(q1.data(), s1.data(), x.data(), R, C, fmt, sc, br, bc, pow2);
      fp8_fake_quant(f1.data(), fs1.data(), x.data(), R, C, fmt, sc, br, bc, pow2);
    });
    r.check(std::memcmp(q1.data(), q.data(), n) == 0 && std::memcmp(s1.data(), s.data(), ns * 4) == 0 &&
                std::memcmp(f1.data(), f.data(), n * 4) == 0,
            "1 thread == " + std::to_string(omp_get_max_threads()) + " threads (bitwise)");
  }

  // Grad: STE backward is the identity; then the quantized GEMM recipe is within its analytic bound.
  void grad(Report& r) override {
    auto dy = randn(R * C, 91, 1.0f);
    std::vector<float> dx(R * C, 0.0f);
    fp8_fake_quant_backward(dx.data(), dy.data(), R * C);
    r.compare("STE backward: dx == dy", dx.data(), dy.data(), R * C, 0.0, 0.0);
    gemm_recipe(r, 40, C, 24);
  }

  // Y = X · W^T with X [Mr, K] and W [Nr, K] both fake-quantized with this case's scaling along K.
  // Per element of a fake-quantized value: |e(v)| <= u |v| + h(block) with u = 2^-(M+1) + 3 * 2^-24
  // (1 + 2^-24 of the exact formula folded in) and h = 2^(emin-M-1) * scale (subnormal region).
  //   |Y'_mn - Y_mn| <= sum_k [ e(x_mk) |w_nk| + |x_mk| e(w_nk) + e(x_mk) e(w_nk) ]  +  gamma_K sum_k |x'||w'|
  // with gamma_K = K 2^-24 / (1 - K 2^-24) for the fp32 GEMM of the dequantized operands.
  void gemm_recipe(Report& r, int64_t Mr, int64_t K, int64_t Nr) {
    auto X = randn(Mr * K, 31, 1.0f), W = randn(Nr * K, 32, 0.05f);
    for (int64_t i = 0; i < Mr * K; i += 17) X[i] *= 40.0f;  // outliers: the reason for fine-grained scales
    const int64_t nsx = fp8_num_scales(Mr, K, sc, br, bc), nsw = fp8_num_scales(Nr, K, sc, br, bc);
    std::vector<float> Xq(Mr * K), Wq(Nr * K), sx(nsx), sw(nsw), Y(Mr * Nr);
    fp8_fake_quant(Xq.data(), sx.data(), X.data(), Mr, K, fmt, sc, br, bc, pow2);
    fp8_fake_quant(Wq.data(), sw.data(), W.data(), Nr, K, fmt, sc, br, bc, pow2);
    gemm_f32(Trans::N, Trans::T, Mr, Nr, K, 1.0f, Xq.data(), K, Wq.data(), K, 0.0f, Y.data(), Nr);
    const int M = fp8_mantissa_bits(fmt), emin = fp8_min_normal_exp(fmt);
    const double u = std::ldexp(1.0, -(M + 1)) + 3 * std::ldexp(1.0, -24);
    auto bound_of = [&](const std::vector<float>& v, const std::vector<float>& s, int64_t rows) {
      int64_t pb, pc;
      fp8_block_shape(&pb, &pc, rows, K, sc, br, bc);
      const int64_t nbc = (K + pc - 1) / pc;
      std::vector<double> e(v.size());
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t k = 0; k < K; ++k)
          e[i * K + k] = u * std::fabs(v[i * K + k]) + std::ldexp(double(s[(i / pb) * nbc + k / pc]), emin - M - 1);
      return e;
    };
    auto ex = bound_of(X, sx, Mr), ew = bound_of(W, sw, Nr);
    const double gk = K * std::ldexp(1.0, -24) / (1 - K * std::ldexp(1.0, -24));
    int64_t bad = 0;
    double worst = 0, worst_err = 0;
    for (int64_t m = 0; m < Mr; ++m)
      for (int64_t nn = 0; nn < Nr; ++nn) {
        double exact = 0, lim = 0, absq = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double x = X[m * K + k], w = W[nn * K + k];
          exact += x * w;
          lim += ex[m * K + k] * std::fabs(w) + std::fabs(x) * ew[nn * K + k] + ex[m * K + k] * ew[nn * K + k];
          absq += std::fabs(double(Xq[m * K + k]) * double(Wq[nn * K + k]));
        }
        lim += gk * absq;
        const double err = std::fabs(double(Y[m * Nr + nn]) - exact);
        bad += err > lim;
        if (err / lim > worst) worst = err / lim, worst_err = err;
      }
    std::ostringstream os;
    os << Mr << "x" << K << "x" << Nr << ": worst err/bound=" << worst << " (err " << worst_err << ") violations=" << bad;
    r.check(bad == 0, "fp8 GEMM recipe error within the analytic bound", os.str());
  }

  void perf() override {
    static std::vector<float> x = randn(2048 * 2048, 5, 3.0f);
    static std::vector<uint8_t> q(2048 * 2048);
    static std::vector<float> s(2048 * 2048 / 128 + 2048);
    fp8_quantize(q.data(), s.data(), x.data(), 2048, 2048, fmt, sc, br, bc, pow2);
  }
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  v.push_back(std::make_unique<CodecCase>(Fp8Format::E4M3));
  v.push_back(std::make_unique<CodecCase>(Fp8Format::E5M2));
  using F = Fp8Format;
  using S = Fp8Scaling;
  // Shapes with partial blocks in both directions.
  v.push_back(std::make_unique<QuantCase>(F::E4M3, S::Tensor, 45, 200, 0, 0, false));
  v.push_back(std::make_unique<QuantCase>(F::E5M2, S::Tensor, 45, 200, 0, 0, false));
  v.push_back(std::make_unique<QuantCase>(F::E4M3, S::Row, 33, 257, 0, 0, false));
  v.push_back(std::make_unique<QuantCase>(F::E5M2, S::Row, 33, 257, 0, 0, true));
  v.push_back(std::make_unique<QuantCase>(F::E4M3, S::Block, 37, 300, 1, 128, false));
  v.push_back(std::make_unique<QuantCase>(F::E4M3, S::Block, 37, 300, 1, 128, true));
  v.push_back(std::make_unique<QuantCase>(F::E5M2, S::Block, 37, 300, 1, 128, false));
  v.push_back(std::make_unique<QuantCase>(F::E4M3, S::Block, 200, 330, 128, 128, false));
  v.push_back(std::make_unique<QuantCase>(F::E5M2, S::Block, 200, 330, 128, 128, true));
  // 3 blocks: with 2 threads the per-block amax is a parallel reduction, with 1 thread each block is a
  // work item, so the thread-count check also compares the two code paths bitwise.
  v.push_back(std::make_unique<QuantCase>(F::E4M3, S::Block, 100, 300, 128, 128, false));
  return v;
}

MT_REGISTER_OP_CASES(make_cases);

}  // namespace
