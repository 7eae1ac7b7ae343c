// cuda_fp8_cases.cpp: op harness cases (--device cuda) for the CUDA backend's FP8 (cuda/fp8.h): tensorwise
// current-scaled E4M3 quantization against fp8.h's fp8_quantize_ref / fp8_dequantize_ref, and the cuBLASLt FP8
// GEMM against an fp64 GEMM of the dequantized operands. Tolerances, derived:
//   quantize: the same integer steps on the same fp32 values (amax exact, one IEEE division for the scale and one
//     per element): q and the scale BITWISE; dequantize: one decode (exact) and one fp32 product: bitwise (a NaN
//     code must give a NaN; its payload is not compared: the GPU's NaN is canonical).
//   GEMM vs fp64 on the dequantized operands: E4M3 products are exact in fp32, the tensor cores accumulate with
//     fewer bits than fp32 between cuBLAS's promotions to fp32 (about 2^-14 relative per partial sum at worst):
//     held to 1e-3 normwise; vs the unquantized fp32 operands: E4M3 keeps 3 mantissa bits, a relative rounding
//     of at most 2^-4 (RMS ~ 2^-4 / sqrt(3) = 0.036) per operand, ~0.05 for a product of two: held to 0.1.
// Grad mode: the straight-through backward of a quantize is the identity, whose premise is checked: every finite
//   x with |x / scale| in E4M3's normal range is returned within 2^-4 |x|, every other within half the subnormal
//   unit (2^-10 scale) or at the saturation (448 scale); and the GEMM is linear in each operand's scale (an operand
//   times 2 quantizes to the same codes with twice the scale, and C doubles: 1e-6).
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "cuda/cuda_util.h"
#include "moetron/cuda/fp8.h"
#include "moetron/dtype.h"
#include "moetron/fp8.h"

namespace moetron::ops {
namespace {

using namespace cu;

std::vector<int32_t> as_i32(const std::vector<uint8_t>& v) { return std::vector<int32_t>(v.begin(), v.end()); }

struct Fp8QuantCase : OpCase {
  int64_t R, C;
  bool specials;
  Fp8QuantCase(const char* nm, int64_t r, int64_t c, bool s) : R(r), C(c), specials(s) {
    name = nm;
    device = "cuda";
    bytes = double(R * C) * (4 + 4 + 1);
  }
  std::vector<float> input(const std::string& tag) {
    auto x = rnd(R * C, name + tag, 3.0f);
    auto u = rnd_u(R * C, name + tag + "u", -30.0f, 10.0f);
    for (int64_t i = 0; i < R * C; ++i) x[i] *= std::exp2(std::floor(u[i] / 4.0f));  // a wide range of magnitudes
    if (specials && R * C >= 16) {
      const float inf = std::numeric_limits<float>::infinity();
      const float sp[] = {std::numeric_limits<float>::quiet_NaN(), inf, -inf, 0.0f, -0.0f, 1e-30f, -1e-38f, 1e-44f};
      for (int j = 0; j < 8; ++j) x[size_t(j * (R * C / 8))] = sp[j];
    }
    return x;
  }
  void test(Report& r) override {
    const int64_t n = R * C;
    auto x = input("x");
    auto dx = up(x);
    auto q = poisoned<uint8_t>(n), sc = poisoned<float>(1), xd = poisoned<float>(n);
    cuda::DeviceBuffer ws(cuda::fp8_quantize_workspace_bytes(), MemCategory::Workspace);
    cuda::fp8_quantize_tensor_e4m3(q.as<uint8_t>(), sc.as<float>(), dx.as<float>(), n, ws.data(), nullptr);
    cuda::fp8_dequantize_tensor_e4m3(xd.as<float>(), q.as<uint8_t>(), sc.as<float>(), n, nullptr);
    std::vector<uint8_t> qr(n);
    float sr = 0;
    fp8_quantize_ref(qr.data(), &sr, x.data(), R, C, Fp8Format::E4M3, Fp8Scaling::Tensor, 0, 0);
    auto qg = down<uint8_t>(q, n);
    r.compare("E4M3 codes vs fp8_quantize_ref (exact)", as_i32(qg).data(), as_i32(qr).data(), n);
    auto sg = down<float>(sc, 1);
    compare_bitwise(r, "tensor scale vs fp8_quantize_ref", sg.data(), &sr, 1);
    std::vector<float> dr(n);
    fp8_dequantize_ref(dr.data(), qr.data(), &sr, R, C, Fp8Format::E4M3, Fp8Scaling::Tensor, 0, 0);
    auto dg = down<float>(xd, n);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t a, b;
      std::memcpy(&a, &dg[i], 4);
      std::memcpy(&b, &dr[i], 4);
      bad += std::isnan(dr[i]) ? !std::isnan(dg[i]) : a != b;
    }
    r.check(bad == 0, "dequantize vs fp8_dequantize_ref: bitwise (NaN as NaN)", std::to_string(bad) + " differ");
  }
  void grad(Report& r) override {
    const int64_t n = R * C;
    auto x = input("g");
    auto dx = up(x);
    auto q = poisoned<uint8_t>(n), sc = poisoned<float>(1), xd = poisoned<float>(n);
    cuda::DeviceBuffer ws(cuda::fp8_quantize_workspace_bytes(), MemCategory::Workspace);
    cuda::fp8_quantize_tensor_e4m3(q.as<uint8_t>(), sc.as<float>(), dx.as<float>(), n, ws.data(), nullptr);
    cuda::fp8_dequantize_tensor_e4m3(xd.as<float>(), q.as<uint8_t>(), sc.as<float>(), n, nullptr);
    const double s = down<float>(sc, 1)[0];
    auto y = down<float>(xd, n);
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(x[i])) continue;
      const double a = std::fabs(double(x[i])), e = std::fabs(double(y[i]) - double(x[i]));
      // slack 1e-6 a: the fp32 roundings of x / scale and of decode * scale (~1.2e-7 a)
      const bool ok = a / s >= std::ldexp(1.0, -6) ? e <= std::ldexp(a, -4) + 1e-6 * a : e <= std::ldexp(s, -10) + 1e-6 * a;
      if (!ok && first < 0) first = i;
      bad += !ok;
    }
    r.check(bad == 0, "|dequant(quant(x)) - x| within E4M3's rounding bound (the straight-through premise)",
            bad ? std::to_string(bad) + " outside, first at " + std::to_string(first) : std::string());
  }
  void perf() override {
    static std::unique_ptr<cuda::DeviceBuffer> x, q, sc, ws;
    static int64_t size = 0;
    if (size != R * C) {
      size = R * C;
      x = std::make_unique<cuda::DeviceBuffer>(up(cheap(size)));
      q = std::make_unique<cuda::DeviceBuffer>(poisoned<uint8_t>(size));
      sc = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(1));
      ws = std::make_unique<cuda::DeviceBuffer>(cuda::fp8_quantize_workspace_bytes(), MemCategory::Workspace);
    }
    cuda::fp8_quantize_tensor_e4m3(q->as<uint8_t>(), sc->as<float>(), x->as<float>(), size, ws->data(), nullptr);
    sync();
  }
};

struct Fp8GemmCase : OpCase {
  int64_t M, N, K;
  bool big;
  Fp8GemmCase(const char* nm, int64_t m, int64_t n, int64_t k, bool b = false) : M(m), N(n), K(k), big(b) {
    name = nm;
    device = "cuda";
    flops = 2.0 * double(M) * double(N) * double(K);
  }
  struct Q {
    cuda::DeviceBuffer q, s;
  };
  static Q quant(const std::vector<float>& x) {
    auto dx = up(x);
    Q o{poisoned<uint8_t>(int64_t(x.size())), poisoned<float>(1)};
    cuda::DeviceBuffer ws(cuda::fp8_quantize_workspace_bytes(), MemCategory::Workspace);
    cuda::fp8_quantize_tensor_e4m3(o.q.as<uint8_t>(), o.s.as<float>(), dx.as<float>(), int64_t(x.size()), ws.data(),
                                   nullptr);
    return o;
  }
  std::vector<float> gemm(const Q& a, const Q& b) {
    cuda::DeviceBuffer ws(cuda::fp8_gemm_workspace_bytes(), MemCategory::Workspace);
    auto c = poisoned<float>(M * N);
    cuda::fp8_gemm_e4m3(c.as<float>(), a.q.as<uint8_t>(), a.s.as<float>(), b.q.as<uint8_t>(), b.s.as<float>(), M, N, K,
                        ws.data(), ws.bytes(), nullptr);
    return down<float>(c, M * N);
  }
  // The dequantized operand in fp64: decode(q) * scale.
  static std::vector<double> deq(const Q& a, int64_t n) {
    auto q = down<uint8_t>(a.q, n);
    const double s = down<float>(a.s, 1)[0];
    std::vector<double> o(n);
    for (int64_t i = 0; i < n; ++i) o[i] = double(e4m3_bits_to_float(q[i])) * s;
    return o;
  }
  void test(Report& r) override {
    std::string why;
    if (big) return r.check(true, "large shape: perf only (the small case checks results or the refusal)");
    auto A = rnd(M * K, name + "A", 3.0f), B = rnd(N * K, name + "B", 0.01f);
    if (!cuda::fp8_gemm_available(&why)) {
      auto qa = quant(A), qb = quant(B);
      r.expect_throw("fp8_gemm_e4m3 refuses here (" + why + ")", [&] { gemm(qa, qb); });
      return;
    }
    auto qa = quant(A), qb = quant(B);
    r.expect_throw("M not a multiple of 16", [&] {
      cuda::fp8_gemm_e4m3(nullptr, qa.q.as<uint8_t>(), qa.s.as<float>(), qb.q.as<uint8_t>(), qb.s.as<float>(), 15, N, K,
                          nullptr, 0, nullptr);
    });
    auto got = gemm(qa, qb);
    auto Ad = deq(qa, M * K), Bd = deq(qb, N * K);
    std::vector<double> ref(M * N), ref32(M * N);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double acc = 0, acc32 = 0;
        for (int64_t k = 0; k < K; ++k) {
          acc += Ad[i * K + k] * Bd[j * K + k];
          acc32 += double(A[i * K + k]) * double(B[j * K + k]);
        }
        ref[i * N + j] = acc, ref32[i * N + j] = acc32;
      }
    r.compare_rel("C vs fp64 on the dequantized operands", got.data(), ref.data(), M * N, 1e-3);
    r.compare_rel("C vs fp64 on the unquantized fp32 operands", got.data(), ref32.data(), M * N, 0.1);
  }
  void grad(Report& r) override {
    std::string why;
    if (!cuda::fp8_gemm_available(&why)) return r.check(true, "FP8 GEMM not available here: " + why);
    if (big) return r.check(true, "large shape: perf only");
    auto A = rnd(M * K, name + "gA"), B = rnd(N * K, name + "gB");
    auto A2 = A, B2 = B;
    for (auto& x : A2) x *= 2.0f;
    for (auto& x : B2) x *= 2.0f;
    auto c = gemm(quant(A), quant(B)), ca = gemm(quant(A2), quant(B)), cb = gemm(quant(A), quant(B2));
    std::vector<double> twice(c.begin(), c.end());
    for (auto& x : twice) x *= 2.0;
    r.compare_rel("C(2A, B) = 2 C(A, B): A's scale is applied", ca.data(), twice.data(), M * N, 1e-6);
    r.compare_rel("C(A, 2B) = 2 C(A, B): B's scale is applied", cb.data(), twice.data(), M * N, 1e-6);
  }
  void perf() override {
    static std::unique_ptr<Q> a, b;
    static std::unique_ptr<cuda::DeviceBuffer> c, ws;
    if (!cuda::fp8_gemm_available()) return;
    static const void* owner = nullptr;
    if (owner != this) {
      owner = this;
      a = std::make_unique<Q>(quant(cheap(M * K)));
      b = std::make_unique<Q>(quant(cheap(N * K)));
      c = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(M * N));
      ws = std::make_unique<cuda::DeviceBuffer>(cuda::fp8_gemm_workspace_bytes(), MemCategory::Workspace);
    }
    cuda::fp8_gemm_e4m3(c->as<float>(), a->q.as<uint8_t>(), a->s.as<float>(), b->q.as<uint8_t>(), b->s.as<float>(), M,
                        N, K, ws->data(), ws->bytes(), nullptr);
    sync();
  }
};

MT_REGISTER_OP_CASES([] {
  std::vector<std::unique_ptr<OpCase>> v;
  v.push_back(std::make_unique<Fp8QuantCase>("fp8/cuda_quant_e4m3_tensor", 97, 131, false));
  v.push_back(std::make_unique<Fp8QuantCase>("fp8/cuda_quant_e4m3_specials", 64, 100, true));
  v.push_back(std::make_unique<Fp8QuantCase>("fp8/cuda_quant_e4m3_58M", 8192, 7168, false));
  v.push_back(std::make_unique<Fp8GemmCase>("fp8/cuda_gemm_e4m3", 128, 96, 256));
  v.push_back(std::make_unique<Fp8GemmCase>("fp8/cuda_gemm_e4m3_8192", 8192, 8192, 8192, true));
  return v;
});

}  // namespace
}  // namespace moetron::ops
