// cuda_row_cases.cpp: op harness cases (--device cuda) for the CUDA backend's row-wise and element-wise kernels:
// RMSNorm and SwiGLU (fp64 twins, normwise 1e-5; their bf16 copies 4e-3: see cuda_dense_cases.cpp for the
// derivations), RoPE and AdamW (bitwise the float twins: same operations, same order, no contraction), the
// gradient's sum of squares (fp64 on both sides: 1e-12). Grad mode: directional derivatives of the device forward
// (central differences in fp32 with step 1e-2 along a random unit-scale direction: truncation ~ h^2 = 1e-4,
// rounding ~ 1e-7 / 1e-2 = 1e-5, held to 2e-3) for RMSNorm and SwiGLU; the inverse rotation for RoPE; the
// textbook fp64 AdamW for AdamW.
#include <cmath>
#include <memory>

#include "cuda/cuda_util.h"
#include "moetron/cuda/ops.h"
#include "moetron/norm.h"
#include "moetron/optim.h"
#include "moetron/rope.h"
#include "moetron/swiglu.h"

namespace moetron::ops {
namespace {

using namespace cu;

struct NormCase : OpCase {
  int64_t N, C;
  NormCase(const char* nm, int64_t n, int64_t c) : N(n), C(c) {
    name = nm;
    device = "cuda";
    bytes = double(N * C) * 4 * 3;
  }
  void test(Report& r) override {
    auto x = rnd(N * C, name + "x"), w = rnd_u(C, name + "w", 0.5f, 1.5f), dy = rnd(N * C, name + "dy"),
         dw0 = rnd(C, name + "dw0");
    auto dx_ = up(x), dw_ = up(w), ddy = up(dy), ddw = up(dw0);
    auto y = poisoned<float>(N * C), rs = poisoned<float>(N), dxo = poisoned<float>(N * C);
    auto y16 = poisoned<bf16>(N * C);
    cuda::DeviceBuffer ws(cuda::rmsnorm_backward_workspace_bytes(N, C) + 16, MemCategory::Workspace);
    cuda::rmsnorm_forward(y.as<float>(), y16.as<bf16>(), rs.as<float>(), dx_.as<float>(), dw_.as<float>(), N, C, 1e-6f, nullptr);
    cuda::rmsnorm_backward(dxo.as<float>(), ddw.as<float>(), ddy.as<float>(), dx_.as<float>(), dw_.as<float>(),
                           rs.as<float>(), N, C, ws.data(), nullptr);
    auto xd = to_f64(x), wd = to_f64(w), dyd = to_f64(dy);
    std::vector<double> yr(N * C), rr(N), dxr(N * C), dwr(dw0.begin(), dw0.end());
    rmsnorm_forward_ref<double>(yr.data(), rr.data(), xd.data(), wd.data(), N, C, 1e-6);
    rmsnorm_backward_ref<double>(dxr.data(), dwr.data(), dyd.data(), xd.data(), wd.data(), rr.data(), N, C);
    r.compare_rel("y", down<float>(y, N * C).data(), yr.data(), N * C, 1e-5);
    r.compare_rel("y16 (bf16)", bf_f32(down<bf16>(y16, N * C)).data(), yr.data(), N * C, 4e-3);
    r.compare_rel("rstd", down<float>(rs, N).data(), rr.data(), N, 1e-5);
    r.compare_rel("dx", down<float>(dxo, N * C).data(), dxr.data(), N * C, 1e-5);
    r.compare_rel("dw (+=)", down<float>(ddw, C).data(), dwr.data(), C, 1e-5);
  }
  void grad(Report& r) override {
    auto x = rnd(N * C, name + "gx"), w = rnd_u(C, name + "gw", 0.5f, 1.5f), g = rnd(N * C, name + "gg"),
         d = rnd(N * C, name + "gd");
    auto dw_ = up(w), dg = up(g);
    auto y = poisoned<float>(N * C), rs = poisoned<float>(N), dxo = poisoned<float>(N * C), dwo = up(std::vector<float>(C, 0.f));
    cuda::DeviceBuffer ws(cuda::rmsnorm_backward_workspace_bytes(N, C) + 16, MemCategory::Workspace);
    auto loss = [&](float h) {
      std::vector<float> xh(x);
      for (size_t i = 0; i < xh.size(); ++i) xh[i] += h * d[i];
      auto dx_ = up(xh);
      cuda::rmsnorm_forward(y.as<float>(), nullptr, rs.as<float>(), dx_.as<float>(), dw_.as<float>(), N, C, 1e-6f, nullptr);
      return dotd(down<float>(y, N * C), g);
    };
    const float h = 1e-2f;
    const double num = (loss(h) - loss(-h)) / (2 * h);
    auto dx_ = up(x);
    cuda::rmsnorm_forward(y.as<float>(), nullptr, rs.as<float>(), dx_.as<float>(), dw_.as<float>(), N, C, 1e-6f, nullptr);
    cuda::rmsnorm_backward(dxo.as<float>(), dwo.as<float>(), dg.as<float>(), dx_.as<float>(), dw_.as<float>(),
                           rs.as<float>(), N, C, ws.data(), nullptr);
    std::vector<float> got{float(dotd(down<float>(dxo, N * C), d))};
    std::vector<double> want{num};
    r.compare_rel("<dx, d> vs central difference of <y, g>", got.data(), want.data(), 1, 2e-3);
  }
  void perf() override {
    static std::unique_ptr<cuda::DeviceBuffer> x, w, y, rs;
    static const void* owner = nullptr;
    if (owner != this) {
      owner = this;
      x = std::make_unique<cuda::DeviceBuffer>(up(rnd(N * C, "px")));
      w = std::make_unique<cuda::DeviceBuffer>(up(rnd(C, "pw")));
      y = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(N * C));
      rs = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(N));
    }
    cuda::rmsnorm_forward(y->as<float>(), nullptr, rs->as<float>(), x->as<float>(), w->as<float>(), N, C, 1e-6f, nullptr);
    sync();
  }
};

struct SwigluCase : OpCase {
  int64_t N, F;
  bool scaled;
  SwigluCase(const char* nm, int64_t n, int64_t f, bool s) : N(n), F(f), scaled(s) {
    name = nm;
    device = "cuda";
    bytes = double(N * F) * 4 * 3;
  }
  void test(Report& r) override {
    auto gu = rnd(N * 2 * F, name + "gu", 2.0f), dh = rnd(N * F, name + "dh"), s = rnd_u(N, name + "s", 0.1f, 1.0f);
    auto dgu_ = up(gu), ddh = up(dh), ds_ = up(s);
    auto h = poisoned<float>(N * F), h16 = poisoned<bf16>(N * F), dgu = poisoned<float>(N * 2 * F), dso = poisoned<float>(N);
    const float* sp = scaled ? ds_.as<float>() : nullptr;
    cuda::swiglu_forward(h.as<float>(), h16.as<bf16>(), dgu_.as<float>(), sp, N, F, nullptr);
    cuda::swiglu_backward(dgu.as<float>(), dso.as<float>(), ddh.as<float>(), dgu_.as<float>(), sp, N, F, nullptr);
    auto gud = to_f64(gu), dhd = to_f64(dh), sd = to_f64(s);
    std::vector<double> hr(N * F), dgur(N * 2 * F), dsr(N);
    swiglu_forward_ref<double>(hr.data(), gud.data(), scaled ? sd.data() : nullptr, N, F);
    swiglu_backward_ref<double>(dgur.data(), dsr.data(), dhd.data(), gud.data(), scaled ? sd.data() : nullptr, N, F);
    r.compare_rel("h", down<float>(h, N * F).data(), hr.data(), N * F, 1e-5);
    r.compare_rel("h16 (bf16)", bf_f32(down<bf16>(h16, N * F)).data(), hr.data(), N * F, 4e-3);
    r.compare_rel("dgu", down<float>(dgu, N * 2 * F).data(), dgur.data(), N * 2 * F, 1e-5);
    r.compare_rel("ds", down<float>(dso, N).data(), dsr.data(), N, 1e-5);
  }
  void grad(Report& r) override {
    auto gu = rnd(N * 2 * F, name + "ggu", 2.0f), g = rnd(N * F, name + "gg"), d = rnd(N * 2 * F, name + "gd");
    auto s = rnd_u(N, name + "gs", 0.1f, 1.0f);
    auto ds_ = up(s), dg = up(g);
    const float* sp = scaled ? ds_.as<float>() : nullptr;
    auto h = poisoned<float>(N * F), dgu = poisoned<float>(N * 2 * F);
    auto loss = [&](float e) {
      std::vector<float> x(gu);
      for (size_t i = 0; i < x.size(); ++i) x[i] += e * d[i];
      auto dx = up(x);
      cuda::swiglu_forward(h.as<float>(), nullptr, dx.as<float>(), sp, N, F, nullptr);
      return dotd(down<float>(h, N * F), g);
    };
    const float e = 1e-2f;
    const double num = (loss(e) - loss(-e)) / (2 * e);
    auto dx = up(gu);
    cuda::swiglu_backward(dgu.as<float>(), nullptr, dg.as<float>(), dx.as<float>(), sp, N, F, nullptr);
    std::vector<float> got{float(dotd(down<float>(dgu, N * 2 * F), d))};
    std::vector<double> want{num};
    r.compare_rel("<dgu, d> vs central difference of <h, g>", got.data(), want.data(), 1, 2e-3);
  }
  void perf() override {}
};

struct RopeCase : OpCase {
  int64_t B = 2, T = 17, H = 3, Dh = 24, R = 16, off = 8, ld_token = 3 * 24 + 5;
  RopeCase() {
    name = "rope/cuda_strided";
    device = "cuda";
  }
  void test(Report& r) override {
    const int64_t n = B * T * ld_token;
    auto x = rnd(n, "rx");
    std::vector<float> cs(T * R / 2), sn(T * R / 2);
    rope_table_ref<float>(cs.data(), sn.data(), T, R, 10000.0);
    auto dx = up(x), dc = up(cs), dsn = up(sn);
    cuda::rope_apply(dx.as<float>(), B, T, H, ld_token, Dh, off, R, dc.as<float>(), dsn.as<float>(), false, nullptr);
    auto got = down<float>(dx, n);
    std::vector<float> want(x);
    rope_ref<float>(want.data(), B, T, H, ld_token, Dh, off, R, cs.data(), sn.data(), false);
    compare_bitwise(r, "forward rotation (and the untouched elements) vs the float twin", got.data(), want.data(), n);
    cuda::rope_apply(dx.as<float>(), B, T, H, ld_token, Dh, off, R, dc.as<float>(), dsn.as<float>(), true, nullptr);
    rope_ref<float>(want.data(), B, T, H, ld_token, Dh, off, R, cs.data(), sn.data(), true);
    compare_bitwise(r, "inverse rotation vs the float twin", down<float>(dx, n).data(), want.data(), n);
  }
  void grad(Report& r) override {  // the backward is the inverse: R^T R x = x up to rounding
    const int64_t n = B * T * ld_token;
    auto x = rnd(n, "rgx");
    std::vector<float> cs(T * R / 2), sn(T * R / 2);
    rope_table_ref<float>(cs.data(), sn.data(), T, R, 10000.0);
    auto dx = up(x), dc = up(cs), dsn = up(sn);
    cuda::rope_apply(dx.as<float>(), B, T, H, ld_token, Dh, off, R, dc.as<float>(), dsn.as<float>(), false, nullptr);
    cuda::rope_apply(dx.as<float>(), B, T, H, ld_token, Dh, off, R, dc.as<float>(), dsn.as<float>(), true, nullptr);
    auto xd = to_f64(x);
    r.compare_rel("backward(forward(x)) = x", down<float>(dx, n).data(), xd.data(), n, 1e-6);
  }
  void perf() override {}
};

struct AdamwCase : OpCase {
  int64_t n = 10007;
  AdamwCase() {
    name = "adamw/cuda_step";
    device = "cuda";
  }
  void test(Report& r) override {
    auto p = rnd(n, "ap"), m = rnd(n, "am", 0.1f), v = rnd_u(n, "av", 0.0f, 0.01f), g = rnd(n, "ag");
    AdamWConfig c;
    const AdamWScalars s = adamw_scalars(c, 7);
    auto dp = up(p), dm = up(m), dv = up(v), dg = up(g);
    cuda::adamw_step(dp.as<float>(), dm.as<float>(), dv.as<float>(), dg.as<float>(), n, s, 0.5f, true, nullptr);
    adamw_step_ref<float>(p.data(), m.data(), v.data(), g.data(), n, s, 0.5f, true);
    compare_bitwise(r, "p", down<float>(dp, n).data(), p.data(), n);
    compare_bitwise(r, "m", down<float>(dm, n).data(), m.data(), n);
    compare_bitwise(r, "v", down<float>(dv, n).data(), v.data(), n);
    cuda::DeviceBuffer ws(cuda::grad_norm_sq_workspace_bytes(n), MemCategory::Workspace);
    auto out = poisoned<double>(1);
    cuda::grad_norm_sq(out.as<double>(), dg.as<float>(), n, ws.data(), nullptr);
    const double got = down<double>(out, 1)[0], want = grad_norm_sq_ref<double>(to_f64(g).data(), n);
    std::vector<float> gotf{float(got)};
    std::vector<double> wantd{want};
    r.compare_rel("grad_norm_sq vs fp64 sum", gotf.data(), wantd.data(), 1, 1e-7);
  }
  void grad(Report& r) override {  // against the textbook fp64 AdamW straight from the config
    auto p = rnd(n, "bp"), m = rnd(n, "bm", 0.1f), v = rnd_u(n, "bv", 0.0f, 0.01f), g = rnd(n, "bg");
    AdamWConfig c;
    auto dp = up(p), dm = up(m), dv = up(v), dg = up(g);
    cuda::adamw_step(dp.as<float>(), dm.as<float>(), dv.as<float>(), dg.as<float>(), n, adamw_scalars(c, 3), 1.0f, true, nullptr);
    auto pd = to_f64(p), md = to_f64(m), vd = to_f64(v), gd = to_f64(g);
    adamw_step_textbook(pd.data(), md.data(), vd.data(), gd.data(), n, c, 3, 1.0, true);
    r.compare_rel("p vs textbook fp64", down<float>(dp, n).data(), pd.data(), n, 1e-6);
  }
  void perf() override {}
};

MT_REGISTER_OP_CASES([] {
  std::vector<std::unique_ptr<OpCase>> v;
  v.push_back(std::make_unique<NormCase>("norm/cuda_rmsnorm", 67, 300));
  v.push_back(std::make_unique<NormCase>("norm/cuda_rmsnorm_big", 8192, 2048));
  v.push_back(std::make_unique<SwigluCase>("swiglu/cuda_plain", 50, 333, false));
  v.push_back(std::make_unique<SwigluCase>("swiglu/cuda_scaled", 41, 129, true));
  v.push_back(std::make_unique<RopeCase>());
  v.push_back(std::make_unique<AdamwCase>());
  return v;
});

}  // namespace
}  // namespace moetron::ops
