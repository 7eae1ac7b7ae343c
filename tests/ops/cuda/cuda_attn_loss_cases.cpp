// cuda_attn_loss_cases.cpp: op harness cases (--device cuda) for the CUDA backend's causal flash attention
// (cuda/attention.h) and fused linear cross-entropy (cuda/loss.h), against attention.h's and loss.h's _ref twins
// in fp64. Tolerances (normwise), derived:
//   attention forward (fp32 products): a Dqk-term dot per score (sqrt(Dqk) 2^-24 ~ 1e-6 relative typical), expf,
//     the online rescaling (one extra rounding per key tile) and a T-term weighted sum: ~1e-6 .. 5e-6 on the
//     shapes here, held to 2e-5; lse (values ~ log T, one logf): 1e-5.
//   attention backward: P recomputed from lse (error ~1e-6 relative), dP - D_t cancels (D_t is P's average of dP),
//     and dk/dv sum over G heads x T queries: ~1e-5, held to 1e-4.
//   attention on tensor cores (bf16 = true), against the fp64 twin on the same bf16-rounded q, k, v, dout: their
//     products are exact in fp32; P (forward) and P, dS (backward) are rounded to bf16 for the next product
//     (2^-9 relative per element, ~1.1e-3 RMS): out and the gradients held to 1e-2 (the bf16 band), lse (no bf16
//     rounding after the exact products) to 1e-5.
//   loss, fp32: logits GEMM (pedantic fp32, K = C), fp64 row sums: loss and row losses ~1e-6, held to 1e-5;
//     dh, dW: two chained fp32 GEMMs (K = V, K = N): ~ (sqrt(V) + sqrt(C)) 2^-24 ~ 3e-6, held to 2e-5.
//   loss, bf16 (against the fp64 twin on the same bf16 h, W): logits exact products with fp32 accumulation
//     (~1e-6): loss 1e-5; dlogits are rounded to bf16 for the backward GEMMs as on the CPU (2^-9 relative per
//     element, ~1.1e-3 RMS): dh, dW held to 1e-2 (the bf16 band of cuda_dense_cases.cpp).
//   dW accumulates (+=): a second call gives 2 dW (the same chunk products added again: a few fp32 roundings of
//     partial sums, ~1e-7: held to 1e-6).
// Grad mode: directional derivatives of the device forward (central differences in fp32, step 1e-2 along random
//   directions: truncation ~h^2 = 1e-4, rounding ~1e-7 / 1e-2 = 1e-5, held to 2e-3) for attention (q, k, v
//   together against <out, g>) and the fp32 loss (h and W together).
#include <cmath>
#include <memory>

#include "cuda/cuda_util.h"
#include "moetron/attention.h"
#include "moetron/cuda/attention.h"
#include "moetron/cuda/loss.h"
#include "moetron/loss.h"

namespace moetron::ops {
namespace {

using namespace cu;

// The valid elements of a strided [rows, H, D] view (row stride ld, head stride hs), in order.
template <class T>
std::vector<T> heads(const std::vector<float>& buf, int64_t rows, int64_t H, int64_t D, int64_t ld, int64_t hs) {
  std::vector<T> o;
  o.reserve(size_t(rows * H * D));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) o.push_back(T(buf[r * ld + h * hs + e]));
  return o;
}
template <class T>
std::vector<T> heads(const std::vector<double>& buf, int64_t rows, int64_t H, int64_t D, int64_t ld, int64_t hs) {
  std::vector<T> o;
  o.reserve(size_t(rows * H * D));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) o.push_back(T(buf[r * ld + h * hs + e]));
  return o;
}

struct AttnCase : OpCase {
  int64_t B, T, Hq, Hkv, Dqk, Dv, pad;
  bool bf, big, time_bwd;
  AttnCase(const char* nm, int64_t b, int64_t t, int64_t hq, int64_t hkv, int64_t dqk, int64_t dv, int64_t p,
           bool bf16 = false, bool bg = false, bool tb = false)
      : B(b), T(t), Hq(hq), Hkv(hkv), Dqk(dqk), Dv(dv), pad(p), bf(bf16), big(bg), time_bwd(tb) {
    name = nm;
    device = "cuda";
    flops = tb ? attention_backward_flops(hd()) : attention_forward_flops(hd());
  }
  cuda::DeviceAttnDims dd() const {
    cuda::DeviceAttnDims d;
    d.B = B, d.T = T, d.Hq = Hq, d.Hkv = Hkv, d.Dqk = Dqk, d.Dv = Dv;
    d.ldq = Hq * Dqk + pad, d.ldk = Hkv * Dqk + pad, d.ldv = Hkv * Dv + pad, d.ldo = Hq * Dv + pad;
    d.head_q = Dqk, d.head_k = Dqk, d.head_v = Dv, d.head_o = Dv;
    d.scale = float(1.0 / std::sqrt(double(Dqk)));
    d.bf16 = bf;
    return d;
  }
  AttnDims hd() const {
    const auto d = dd();
    AttnDims a{d.B, d.T, d.Hq, d.Hkv, d.Dqk, d.Dv, d.ldq, d.ldk, d.ldv, d.ldo,
               d.head_q, d.head_k, d.head_v, d.head_o, d.scale};
    return a;
  }
  int64_t nq() const { return B * T * dd().ldq; }
  int64_t nk() const { return B * T * dd().ldk; }
  int64_t nv() const { return B * T * dd().ldv; }
  int64_t no() const { return B * T * dd().ldo; }
  void test(Report& r) override {
    if (big) return r.check(true, "large shape: perf only (the fp64 twin would take minutes)");
    const auto d = dd();
    const AttnDims a = hd();
    auto q = rnd(nq(), name + "q"), k = rnd(nk(), name + "k"), v = rnd(nv(), name + "v"), g = rnd(no(), name + "g");
    if (bf)  // the operands the tensor cores see: the twin runs on the same bf16 values
      for (auto* x : {&q, &k, &v, &g}) *x = bf_f32(to_bf(*x));
    const double to = bf ? 1e-2 : 2e-5, tg = bf ? 1e-2 : 1e-4;
    auto dq_ = up(q), dk_ = up(k), dv_ = up(v), dg = up(g);
    auto out = poisoned<float>(no()), lse = poisoned<float>(B * Hq * T);
    cuda::attention_forward(out.as<float>(), lse.as<float>(), dq_.as<float>(), dk_.as<float>(), dv_.as<float>(), d,
                            nullptr);
    auto qd = to_f64(q), kd = to_f64(k), vd = to_f64(v), gd = to_f64(g);
    std::vector<double> outr(no(), 0.0), lser(B * Hq * T);
    attention_forward_ref<double>(outr.data(), lser.data(), qd.data(), kd.data(), vd.data(), a);
    const int64_t rows = B * T;
    auto o_got = down<float>(out, no());
    r.compare_rel("out vs fp64 twin", heads<float>(o_got, rows, Hq, Dv, d.ldo, Dv).data(),
                  heads<double>(outr, rows, Hq, Dv, d.ldo, Dv).data(), rows * Hq * Dv, to);
    r.compare_rel("lse vs fp64 twin", down<float>(lse, B * Hq * T).data(), lser.data(), B * Hq * T, 1e-5);
    cuda::DeviceBuffer ws(cuda::attention_backward_workspace_bytes(d), MemCategory::Workspace);
    auto dq = poisoned<float>(nq()), dk = poisoned<float>(nk()), dv = poisoned<float>(nv());
    cuda::attention_backward(dq.as<float>(), dk.as<float>(), dv.as<float>(), dg.as<float>(), out.as<float>(),
                             lse.as<float>(), dq_.as<float>(), dk_.as<float>(), dv_.as<float>(), d, ws.data(), nullptr);
    std::vector<double> dqr(nq(), 0.0), dkr(nk(), 0.0), dvr(nv(), 0.0);
    attention_backward_ref<double>(dqr.data(), dkr.data(), dvr.data(), gd.data(), outr.data(), qd.data(), kd.data(),
                                   vd.data(), a);
    r.compare_rel("dq vs fp64 twin", heads<float>(down<float>(dq, nq()), rows, Hq, Dqk, d.ldq, Dqk).data(),
                  heads<double>(dqr, rows, Hq, Dqk, d.ldq, Dqk).data(), rows * Hq * Dqk, tg);
    r.compare_rel("dk vs fp64 twin", heads<float>(down<float>(dk, nk()), rows, Hkv, Dqk, d.ldk, Dqk).data(),
                  heads<double>(dkr, rows, Hkv, Dqk, d.ldk, Dqk).data(), rows * Hkv * Dqk, tg);
    r.compare_rel("dv vs fp64 twin", heads<float>(down<float>(dv, nv()), rows, Hkv, Dv, d.ldv, Dv).data(),
                  heads<double>(dvr, rows, Hkv, Dv, d.ldv, Dv).data(), rows * Hkv * Dv, tg);
  }
  void grad(Report& r) override {
    if (big) return r.check(true, "large shape: perf only");
    if (bf) return r.check(true, "directional derivative: on the fp32 cases (bf16 inputs cannot take a 1e-2 step)");
    const auto d = dd();
    const int64_t rows = B * T;
    auto q = rnd(nq(), name + "gq"), k = rnd(nk(), name + "gk"), v = rnd(nv(), name + "gv"), g = rnd(no(), name + "gg");
    auto a = rnd(nq(), name + "ga"), b = rnd(nk(), name + "gb"), c = rnd(nv(), name + "gc");
    auto out = poisoned<float>(no()), lse = poisoned<float>(B * Hq * T);
    auto gv = heads<float>(g, rows, Hq, Dv, d.ldo, Dv);
    auto loss = [&](float e) {
      std::vector<float> qe(q), ke(k), ve(v);
      for (size_t i = 0; i < qe.size(); ++i) qe[i] += e * a[i];
      for (size_t i = 0; i < ke.size(); ++i) ke[i] += e * b[i];
      for (size_t i = 0; i < ve.size(); ++i) ve[i] += e * c[i];
      auto x = up(qe), y = up(ke), z = up(ve);
      cuda::attention_forward(out.as<float>(), lse.as<float>(), x.as<float>(), y.as<float>(), z.as<float>(), d, nullptr);
      return dotd(heads<float>(down<float>(out, no()), rows, Hq, Dv, d.ldo, Dv), gv);
    };
    const float h = 1e-2f;
    const double num = (loss(h) - loss(-h)) / (2 * h);
    auto x = up(q), y = up(k), z = up(v), dg = up(g);
    cuda::attention_forward(out.as<float>(), lse.as<float>(), x.as<float>(), y.as<float>(), z.as<float>(), d, nullptr);
    cuda::DeviceBuffer ws(cuda::attention_backward_workspace_bytes(d), MemCategory::Workspace);
    auto dq = poisoned<float>(nq()), dk = poisoned<float>(nk()), dv = poisoned<float>(nv());
    cuda::attention_backward(dq.as<float>(), dk.as<float>(), dv.as<float>(), dg.as<float>(), out.as<float>(),
                             lse.as<float>(), x.as<float>(), y.as<float>(), z.as<float>(), d, ws.data(), nullptr);
    const double ana = dotd(heads<float>(down<float>(dq, nq()), rows, Hq, Dqk, d.ldq, Dqk),
                            heads<float>(a, rows, Hq, Dqk, d.ldq, Dqk)) +
                       dotd(heads<float>(down<float>(dk, nk()), rows, Hkv, Dqk, d.ldk, Dqk),
                            heads<float>(b, rows, Hkv, Dqk, d.ldk, Dqk)) +
                       dotd(heads<float>(down<float>(dv, nv()), rows, Hkv, Dv, d.ldv, Dv),
                            heads<float>(c, rows, Hkv, Dv, d.ldv, Dv));
    std::vector<float> got{float(ana)};
    std::vector<double> want{num};
    r.compare_rel("<dq, a> + <dk, b> + <dv, c> vs central difference of <out, g>", got.data(), want.data(), 1, 2e-3);
  }
  void perf() override {
    static std::unique_ptr<cuda::DeviceBuffer> q, k, v, o, l, dq, dk, dv, ws;
    const auto d = dd();
    static const void* owner = nullptr;
    if (owner != this) {
      owner = this;
      q = std::make_unique<cuda::DeviceBuffer>(up(cheap(nq())));
      k = std::make_unique<cuda::DeviceBuffer>(up(cheap(nk())));
      v = std::make_unique<cuda::DeviceBuffer>(up(cheap(nv())));
      o = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(no()));
      l = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(B * Hq * T));
      dq = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(nq()));
      dk = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(nk()));
      dv = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(nv()));
      ws = std::make_unique<cuda::DeviceBuffer>(cuda::attention_backward_workspace_bytes(d), MemCategory::Workspace);
      cuda::attention_forward(o->as<float>(), l->as<float>(), q->as<float>(), k->as<float>(), v->as<float>(), d, nullptr);
    }
    if (time_bwd)  // dout = out (any values do)
      cuda::attention_backward(dq->as<float>(), dk->as<float>(), dv->as<float>(), o->as<float>(), o->as<float>(),
                               l->as<float>(), q->as<float>(), k->as<float>(), v->as<float>(), d, ws->data(), nullptr);
    else
      cuda::attention_forward(o->as<float>(), l->as<float>(), q->as<float>(), k->as<float>(), v->as<float>(), d, nullptr);
    sync();
  }
};

struct XentCase : OpCase {
  int64_t N, C, V, chunk;
  bool bf, big;
  XentCase(const char* nm, int64_t n, int64_t c, int64_t v, int64_t ch, bool b, bool bg = false)
      : N(n), C(c), V(v), chunk(ch), bf(b), big(bg) {
    name = nm;
    device = "cuda";
    flops = 6.0 * double(N) * double(C) * double(V);
  }
  std::vector<int32_t> targets(const std::string& tag) {
    auto u = rnd_u(N, name + tag, 0.0f, 1.0f);
    std::vector<int32_t> t(N);
    for (int64_t n = 0; n < N; ++n) t[n] = u[n] < 0.1f ? -1 : int32_t(std::min<int64_t>(V - 1, int64_t(u[n] * V)));
    return t;
  }
  // One call: the device loss, row losses, dh and dW (+= onto dW).
  void call(cuda::DeviceBuffer& loss, cuda::DeviceBuffer* rl, cuda::DeviceBuffer* dh, cuda::DeviceBuffer* dW,
            const cuda::DeviceBuffer& h, const cuda::DeviceBuffer& W, const cuda::DeviceBuffer& t,
            cuda::DeviceBuffer& ws) {
    double* rlp = rl ? rl->as<double>() : nullptr;
    float* dhp = dh ? dh->as<float>() : nullptr;
    float* dWp = dW ? dW->as<float>() : nullptr;
    const float sc = 1.0f / float(N);
    if (bf)
      cuda::linear_xent_bf16(loss.as<double>(), rlp, dhp, dWp, h.as<bf16>(), W.as<bf16>(), t.as<int32_t>(), N, C, V,
                             sc, chunk, ws.data(), nullptr);
    else
      cuda::linear_xent_f32(loss.as<double>(), rlp, dhp, dWp, h.as<float>(), W.as<float>(), t.as<int32_t>(), N, C, V,
                            sc, chunk, ws.data(), nullptr);
  }
  void test(Report& r) override {
    if (big) return r.check(true, "large shape: perf only (the fp64 twin would take minutes)");
    auto h = rnd(N * C, name + "h"), W = rnd(V * C, name + "W", 0.1f);
    auto t = targets("t");
    std::vector<double> hd, Wd;
    cuda::DeviceBuffer dh_in, dW_in;
    if (bf) {
      auto h16 = to_bf(h), W16 = to_bf(W);
      hd = bf_f64(h16), Wd = bf_f64(W16), dh_in = up(h16), dW_in = up(W16);
    } else {
      hd = to_f64(h), Wd = to_f64(W), dh_in = up(h), dW_in = up(W);
    }
    auto dt = up(t);
    cuda::DeviceBuffer ws(cuda::linear_xent_workspace_bytes(N, V, chunk), MemCategory::Workspace);
    auto loss = poisoned<double>(1), rl = poisoned<double>(N), dh = poisoned<float>(N * C),
         dW = up(std::vector<float>(size_t(V * C), 0.0f)), loss2 = poisoned<double>(1);
    call(loss, &rl, &dh, &dW, dh_in, dW_in, dt, ws);
    std::vector<double> rlr(N), dhr(N * C), dWr(V * C, 0.0);
    const double lr = linear_xent_ref<double>(rlr.data(), dhr.data(), dWr.data(), hd.data(), Wd.data(), t.data(), N, C,
                                              V, 1.0 / double(N));
    const double lg = down<double>(loss, 1)[0];
    std::vector<float> lgf{float(lg)};
    std::vector<double> lrd{lr};
    r.compare_rel("loss vs fp64 twin", lgf.data(), lrd.data(), 1, 1e-5);
    auto rlg = down<double>(rl, N);
    r.compare_rel("row losses vs fp64 twin", std::vector<float>(rlg.begin(), rlg.end()).data(), rlr.data(), N, 1e-5);
    const double tg = bf ? 1e-2 : 2e-5;
    auto dW1 = down<float>(dW, V * C);
    r.compare_rel("dh vs fp64 twin", down<float>(dh, N * C).data(), dhr.data(), N * C, tg);
    r.compare_rel("dW vs fp64 twin", dW1.data(), dWr.data(), V * C, tg);
    call(loss2, nullptr, &dh, &dW, dh_in, dW_in, dt, ws);  // dW accumulates: 2 dW
    std::vector<double> twice(dW1.begin(), dW1.end());
    for (auto& x : twice) x *= 2.0;
    r.compare_rel("dW += (a second call doubles it)", down<float>(dW, V * C).data(), twice.data(), V * C, 1e-6);
    call(loss2, nullptr, nullptr, nullptr, dh_in, dW_in, dt, ws);  // forward only: the same loss
    const double lf = down<double>(loss2, 1)[0];
    r.check(lf == lg, "forward-only loss equals the forward+backward loss (same GEMM, same row kernel)",
            std::to_string(lf) + " vs " + std::to_string(lg));
  }
  void grad(Report& r) override {
    if (big) return r.check(true, "large shape: perf only");
    if (bf) return r.check(true, "directional derivative: checked on the fp32 case (bf16 differs in operand rounding)");
    auto h = rnd(N * C, name + "gh"), W = rnd(V * C, name + "gW", 0.1f), a = rnd(N * C, name + "ga"),
         b = rnd(V * C, name + "gb", 0.1f);
    auto t = targets("gt");
    auto dt = up(t);
    cuda::DeviceBuffer ws(cuda::linear_xent_workspace_bytes(N, V, chunk), MemCategory::Workspace);
    auto loss = poisoned<double>(1), dh = poisoned<float>(N * C), dW = up(std::vector<float>(size_t(V * C), 0.0f));
    auto L = [&](float e) {
      std::vector<float> he(h), We(W);
      for (size_t i = 0; i < he.size(); ++i) he[i] += e * a[i];
      for (size_t i = 0; i < We.size(); ++i) We[i] += e * b[i];
      auto x = up(he), y = up(We);
      call(loss, nullptr, nullptr, nullptr, x, y, dt, ws);
      return down<double>(loss, 1)[0];
    };
    const float e = 1e-2f;
    const double num = (L(e) - L(-e)) / (2 * e);
    auto x = up(h), y = up(W);
    call(loss, nullptr, &dh, &dW, x, y, dt, ws);
    std::vector<float> got{float(dotd(down<float>(dh, N * C), a) + dotd(down<float>(dW, V * C), b))};
    std::vector<double> want{num};
    r.compare_rel("<dh, a> + <dW, b> vs central difference of the loss", got.data(), want.data(), 1, 2e-3);
  }
  void perf() override {
    static std::unique_ptr<cuda::DeviceBuffer> h, W, t, loss, dh, dW, ws;
    static const XentCase* owner = nullptr;
    if (owner != this) {
      owner = this;
      h = std::make_unique<cuda::DeviceBuffer>(bf ? up(to_bf(cheap(N * C))) : up(cheap(N * C)));
      W = std::make_unique<cuda::DeviceBuffer>(bf ? up(to_bf(cheap(V * C, 0.02f))) : up(cheap(V * C, 0.02f)));
      t = std::make_unique<cuda::DeviceBuffer>(up(targets("pt")));
      loss = std::make_unique<cuda::DeviceBuffer>(poisoned<double>(1));
      dh = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(N * C));
      dW = std::make_unique<cuda::DeviceBuffer>(size_t(V * C) * 4, MemCategory::Workspace);
      dW->zero();
      ws = std::make_unique<cuda::DeviceBuffer>(cuda::linear_xent_workspace_bytes(N, V, chunk), MemCategory::Workspace);
    }
    call(*loss, nullptr, dh.get(), dW.get(), *h, *W, *t, *ws);
    sync();
  }
};

MT_REGISTER_OP_CASES([] {
  std::vector<std::unique_ptr<OpCase>> v;
  v.push_back(std::make_unique<AttnCase>("attention/cuda_mha", 2, 77, 4, 4, 64, 64, 0));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_gqa_strided", 1, 130, 8, 2, 128, 128, 24));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_mla_192_128", 1, 100, 4, 4, 192, 128, 0));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_mqa_odd_dims", 2, 33, 3, 1, 40, 24, 5));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_bf16_mha", 2, 77, 4, 4, 64, 64, 0, true));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_bf16_gqa_strided", 1, 130, 8, 2, 128, 128, 24, true));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_bf16_mla_192_128", 1, 100, 4, 4, 192, 128, 0, true));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_bf16_mqa_odd_dims", 2, 33, 3, 1, 40, 24, 5, true));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_fwd_mla_4k", 1, 4096, 16, 16, 192, 128, 0, false, true));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_bwd_mla_4k", 1, 4096, 16, 16, 192, 128, 0, false, true, true));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_bf16_fwd_mla_4k", 1, 4096, 16, 16, 192, 128, 0, true, true));
  v.push_back(std::make_unique<AttnCase>("attention/cuda_bf16_bwd_mla_4k", 1, 4096, 16, 16, 192, 128, 0, true, true,
                                         true));
  v.push_back(std::make_unique<XentCase>("loss/cuda_xent_f32", 200, 96, 1000, 64, false));
  v.push_back(std::make_unique<XentCase>("loss/cuda_xent_bf16", 200, 96, 1000, 64, true));
  v.push_back(std::make_unique<XentCase>("loss/cuda_xent_bf16_default_chunk", 37, 40, 333, 0, true));
  v.push_back(std::make_unique<XentCase>("loss/cuda_xent_v2lite_bf16", 4096, 2048, 102400, 0, true, true));
  return v;
});

}  // namespace
}  // namespace moetron::ops
