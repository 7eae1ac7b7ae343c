// rope_cases.cpp: op-harness cases for RoPE (family "rope") on strided views: plain heads, a partial
// rotary slice, q and k inside a fused qkv buffer, and the MLA layout (rope on q_pe of every head, and
// on the single shared k_pe head that follows c_kv in the kv down-projection output).
// test: rope_table vs rope_table_ref<double>; rope_forward/backward vs rope_ref<double> given the same
//       (float) table; elements outside the rotary slices are untouched (bitwise); backward(forward(x)) ~ x.
// grad: the fp64 reference (inverse rotation as the backward) against central finite differences.
// Tolerances (u = 2^-24):
//   table:   |err| <= u/2 + 1e-12 (one rounding of a value in [-1, 1] computed in double)
//   rotate:  |err| <= 3u (|x0 c| + |x1 s|) per element (a product, then a fused multiply-add or two
//            roundings); absolute in the size of the terms because the difference may cancel.
//   round trip: |x - back(fwd(x))| <= 12u (|x0| + |x1|): each rotation's error <= 3u (|x0| + |x1|) per element,
//            carried through the other rotation with gain |c| + |s| <= sqrt 2, plus c^2 + s^2 = 1 +- 2u.
#include <cmath>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "moetron/rope.h"

namespace moetron::ops {
namespace {

constexpr double kU = 5.9604644775390625e-08;  // 2^-24

struct View {
  int64_t H, ld_head, offset, base;  // base: start of this view within a token
};

struct RopeCase : OpCase {
  int64_t B, T, ld_token, R;
  std::vector<View> views;  // each gets rope with the same R
  RopeCase(std::string variant, int64_t b, int64_t t, int64_t ldt, int64_t r, std::vector<View> vs)
      : B(b), T(t), ld_token(ldt), R(r), views(std::move(vs)) {
    name = "rope/" + variant;
    fd_eps = 1e-6;
    grad_tol = 1e-6;
    int64_t rot = 0;
    for (auto& v : views) rot += v.H * R;
    bytes = double(sizeof(float)) * double(B * T * rot * 2);
  }
  int64_t n() const { return B * T * ld_token; }

  // Which elements some view rotates (each element in at most one view).
  std::vector<char> rotated() const {
    std::vector<char> m(n(), 0);
    for (int64_t bt = 0; bt < B * T; ++bt)
      for (auto& v : views)
        for (int64_t h = 0; h < v.H; ++h)
          for (int64_t i = 0; i < R; ++i) m[bt * ld_token + v.base + h * v.ld_head + v.offset + i] = 1;
    return m;
  }

  template <class Tv>
  void apply_ref(Tv* x, const Tv* c, const Tv* s, bool inverse) const {
    for (auto& v : views) rope_ref<Tv>(x + v.base, B, T, v.H, ld_token, v.ld_head, v.offset, R, c, s, inverse);
  }
  void apply(float* x, const float* c, const float* s, bool inverse) const {
    for (auto& v : views)
      (inverse ? rope_backward : rope_forward)(x + v.base, B, T, v.H, ld_token, v.ld_head, v.offset, R, c, s);
  }

  // |p0 c| + |p1 s| at both elements of every rotated pair (the size of the terms of the rotation).
  std::vector<double> term_bound(const std::vector<float>& x, const std::vector<double>& c,
                                 const std::vector<double>& s) const {
    const int64_t half = R / 2;
    std::vector<double> out(n(), 0.0);
    for (int64_t bt = 0; bt < B * T; ++bt)
      for (auto& v : views)
        for (int64_t h = 0; h < v.H; ++h) {
          const int64_t o = bt * ld_token + v.base + h * v.ld_head + v.offset, t = bt % T;
          for (int64_t i = 0; i < half; ++i) {
            double t0 = std::fabs(x[o + i]), t1 = std::fabs(x[o + i + half]);
            double cc = std::fabs(c[t * half + i]), ss = std::fabs(s[t * half + i]);
            out[o + i] = t0 * cc + t1 * ss;
            out[o + i + half] = t1 * cc + t0 * ss;
          }
        }
    return out;
  }

  void test(Report& r) override {
    const int64_t half = R / 2;
    std::vector<float> c(T * half), s(T * half);
    rope_table(c.data(), s.data(), T, R, 10000.0f);
    std::vector<double> cr(T * half), sr(T * half);
    rope_table_ref<double>(cr.data(), sr.data(), T, R, 10000.0);
    r.compare("cos table", to_f64(c).data(), cr.data(), T * half, kU / 2 + 1e-12, 0.0);
    r.compare("sin table", to_f64(s).data(), sr.data(), T * half, kU / 2 + 1e-12, 0.0);

    auto x = randn(n(), 31);
    auto y = x;
    apply(y.data(), c.data(), s.data(), false);
    auto yr = to_f64(x), cd = to_f64(c), sd = to_f64(s);
    apply_ref<double>(yr.data(), cd.data(), sd.data(), false);
    auto ax = term_bound(x, cd, sd);
    auto mask = rotated();
    int64_t bad = 0, untouched_bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < n(); ++i) {
      if (!mask[i]) {
        untouched_bad += std::memcmp(&x[i], &y[i], 4) != 0;
        continue;
      }
      double lim = 3 * kU * ax[i] + 1e-30, e = std::fabs(double(y[i]) - yr[i]);
      worst = std::max(worst, e / lim);
      bad += e > lim;
    }
    std::ostringstream os;
    os << "forward vs ref: bound 3u(|x0 c|+|x1 s|), worst " << worst << "x of bound";
    if (bad) os << " violations=" << bad;
    r.check(bad == 0, os.str());
    r.check(untouched_bad == 0, "elements outside the rotary slices untouched", std::to_string(untouched_bad) + " changed");

    auto dy = randn(n(), 32);
    auto dx = dy;
    apply(dx.data(), c.data(), s.data(), true);
    auto dxr = to_f64(dy);
    apply_ref<double>(dxr.data(), cd.data(), sd.data(), true);
    auto ad = term_bound(dy, cd, sd);
    bad = 0, worst = 0;
    for (int64_t i = 0; i < n(); ++i) {
      double lim = mask[i] ? 3 * kU * ad[i] + 1e-30 : 0.0, e = std::fabs(double(dx[i]) - dxr[i]);
      worst = std::max(worst, lim > 0 ? e / lim : e);
      bad += e > lim;
    }
    os.str("");
    os << "backward vs ref: bound 3u(|d0 c|+|d1 s|), worst " << worst << "x of bound";
    if (bad) os << " violations=" << bad;
    r.check(bad == 0, os.str());

    auto z = y;
    apply(z.data(), c.data(), s.data(), true);
    const std::vector<double> ones(T * half, 1.0);
    auto pair_sum = term_bound(x, ones, ones);  // |x0| + |x1|
    bad = 0;
    for (int64_t i = 0; i < n(); ++i) {
      double lim = mask[i] ? 12 * kU * pair_sum[i] + 1e-30 : 0.0;
      bad += std::fabs(double(z[i]) - double(x[i])) > lim;
    }
    r.check(bad == 0, "backward(forward(x)) == x within 12u(|x0|+|x1|)", std::to_string(bad) + " violations");
  }

  void grad(Report& r) override {
    const int64_t half = R / 2;
    std::vector<double> c(T * half), s(T * half);
    rope_table_ref<double>(c.data(), s.data(), T, R, 10000.0);
    auto x = to_f64(randn(n(), 33)), Rm = to_f64(randn(n(), 34));
    std::vector<double> y(n());
    auto loss = [&] {
      y = x;
      apply_ref<double>(y.data(), c.data(), s.data(), false);
      return dot(y.data(), Rm.data(), n());
    };
    auto dx = Rm;
    apply_ref<double>(dx.data(), c.data(), s.data(), true);
    r.fd_check("dx", x.data(), n(), dx.data(), loss, fd_eps, grad_tol);
  }

  std::vector<float> px, pc, ps;
  void perf() override {
    if (px.empty()) {
      px = randn(n(), 35), pc.resize(T * R / 2), ps.resize(T * R / 2);
      rope_table(pc.data(), ps.data(), T, R, 10000.0f);
    }
    apply(px.data(), pc.data(), ps.data(), false);
  }
};

struct RopeChecks : OpCase {
  RopeChecks() { name = "rope/bad_input"; }
  void test(Report& r) override {
    float x[64] = {}, c[16] = {}, s[16] = {};
    auto throws = [](auto f) {
      try {
        f();
      } catch (const std::exception& e) {
        return std::string(e.what()).find("[rope") != std::string::npos;
      }
      return false;
    };
    r.check(throws([&] { rope_forward(x, 1, 2, 1, 8, 8, 0, 3, c, s); }), "odd R rejected");
    r.check(throws([&] { rope_forward(x, 1, 2, 2, 16, 4, 0, 8, c, s); }), "overlapping heads rejected");
    r.check(throws([&] { rope_backward(x, 1, 2, 2, 6, 4, 0, 4, c, s); }), "overlapping tokens rejected");
    r.check(throws([&] { rope_table(c, s, 2, 4, 1.0f); }), "theta <= 1 rejected");
  }
  void grad(Report& r) override { r.check(true, "no gradient (input validation case)"); }
  void perf() override {}
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  // q [B, T, H, D], rope over the whole head.
  v.push_back(std::make_unique<RopeCase>("heads_B2_T5_H3_D8", 2, 5, 3 * 8, 8, std::vector<View>{{3, 8, 0, 0}}));
  // partial rotary slice in the middle of each head, odd half (R/2 = 3).
  v.push_back(std::make_unique<RopeCase>("partial_D16_R6_off4", 2, 7, 2 * 16, 6, std::vector<View>{{2, 16, 4, 0}}));
  // fused qkv [T, (Hq + 2 Hkv) D]: q heads then k heads get rope, v untouched. Hq=4, Hkv=2, D=10.
  v.push_back(std::make_unique<RopeCase>("fused_qkv_Hq4_Hkv2_D10", 2, 9, 8 * 10, 10,
                                         std::vector<View>{{4, 10, 0, 0}, {2, 10, 0, 40}}));
  // MLA: q token = H heads of [q_nope 8 | q_pe 4] (48 floats), then the kv down-projection output
  // [c_kv 16 | k_pe 4] (one shared rotary head) in the same token row: ld_token = 48 + 20.
  v.push_back(std::make_unique<RopeCase>("mla_q_pe_and_shared_k_pe", 2, 6, 48 + 20, 4,
                                         std::vector<View>{{4, 12, 8, 0}, {1, 0, 16, 48}}));
  // MLA at DeepSeek-V3 head shapes (dn 128, dr 64), few heads.
  v.push_back(std::make_unique<RopeCase>("mla_v3_dims_H2", 1, 33, 2 * 192 + 512 + 64, 64,
                                         std::vector<View>{{2, 192, 128, 0}, {1, 0, 512, 384}}));
  // ds_mini-like q: B=2, T=256, H=8, D=64; and an odd long rotary (R = 34).
  v.push_back(std::make_unique<RopeCase>("heads_B2_T256_H8_D64", 2, 256, 8 * 64, 64, std::vector<View>{{8, 64, 0, 0}}));
  v.push_back(std::make_unique<RopeCase>("T1_R34", 3, 1, 40, 34, std::vector<View>{{1, 0, 3, 0}}));
  v.push_back(std::make_unique<RopeChecks>());
  return v;
}
MT_REGISTER_OP_CASES(make_cases);

}  // namespace
}  // namespace moetron::ops
