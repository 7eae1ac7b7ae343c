// cuda_moe_cases.cpp: op harness cases (--device cuda) for the CUDA backend's router and MoE dispatch
// (cuda/moe.h), against router.h's and permute.h's _ref twins. Tolerances, derived:
//   router scores vs the fp64 twin: softmax = expf (<= 2 ulp) over a warp-tree sum of E terms (log2(E) + 1
//     roundings) and a division: ~1e-7 per element, held to 1e-6; sigmoid likewise.
//   router selection: EXACT. router_select_ref<float> is run on the device's own fp32 scores and the same bias,
//     so both sides compare the same fp32 values with the same order (ties to the lower index): index for index.
//     Tie-heavy inputs (logits and bias on coarse grids) make the tie rule decide many slots.
//   weights: k-term fp32 sum and one division: ~k * 6e-8, held to 1e-6; counts, bias update: exact (integers;
//     the bias update is the same fp32 add of +-rate).
//   router backward vs the fp64 twin (same selection, the device scores): a k-term and an E-term fp32 sum:
//     ~1e-6, held to 1e-5.
//   dispatch plan (counts, offsets, row_of, token_of, slot_of): EXACT (integers). permute: a copy (fp32) or one
//     bf16 rounding (RNE on both sides): bitwise. unpermute / permute backward: k-term fp32 sums, <= k 2^-24 ~ 5e-7
//     relative: held to 1e-6; unpermute backward dyp one product (1e-6), dw a D-term dot: sqrt(D) 2^-24 ~ 1e-6
//     typical, held to 1e-5.
// Grad mode: the router's directional derivative of <w, g> along random logit directions (central differences,
//   step 1e-2, over the tokens whose selection is the same at both ends: truncation ~h^2 = 1e-4, rounding
//   ~1e-7 / 1e-2, held to 2e-3); the dispatch's adjoint identities <P x, g> = <x, P^T g>, <U yp, g> = <yp, U^T g>
//   and the linearity of the unpermute in w: <U_d yp, g> = <dw, d> (fp32 sums: 1e-5).
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>

#include "cuda/cuda_util.h"
#include "moetron/cuda/moe.h"
#include "moetron/permute.h"
#include "moetron/router.h"

namespace moetron::ops {
namespace {

using namespace cu;

RouterConfig host_cfg(const cuda::DeviceRouterConfig& d) {
  RouterConfig c;
  c.E = d.E;
  c.topk = d.topk;
  c.score = d.sigmoid ? ScoreFn::Sigmoid : ScoreFn::Softmax;
  c.n_group = d.n_group;
  c.topk_group = d.topk_group;
  c.group_score = d.group_top2sum ? GroupScore::Top2Sum : GroupScore::Max;
  c.norm_topk = d.norm_topk;
  c.route_scale = d.route_scale;
  return c;
}

struct RouterCase : OpCase {
  cuda::DeviceRouterConfig dc;
  int64_t N;
  bool with_bias, ties, big;
  RouterCase(const char* nm, cuda::DeviceRouterConfig c, int64_t n, bool bias, bool t, bool b = false)
      : dc(c), N(n), with_bias(bias), ties(t), big(b) {
    name = nm;
    device = "cuda";
    bytes = double(N) * dc.E * 4 * 2;
  }
  std::vector<float> logits(const std::string& tag) {
    auto l = rnd(N * dc.E, name + tag, ties ? 1.0f : 2.0f);
    if (ties)
      for (auto& x : l) x = std::round(x);  // about 7 values: many exactly equal scores among the top ones
    return l;
  }
  std::vector<float> bias(const std::string& tag) {
    if (!with_bias) return {};
    auto b = rnd(dc.E, name + tag, 0.05f);
    if (ties)
      for (auto& x : b) x = std::round(x * 4.0f) / 4.0f;  // mostly 0: equal scores stay equal selection scores
    return b;
  }
  void test(Report& r) override {
    const int E = dc.E, k = dc.topk;
    const RouterConfig rc = host_cfg(dc);
    auto l = logits("l"), b = bias("b"), g = rnd(N * k, name + "g");
    auto dl = up(l), db = with_bias ? up(b) : cuda::DeviceBuffer(), dg = up(g);
    auto idx = poisoned<int32_t>(N * k), w = poisoned<float>(N * k), cnt = poisoned<int32_t>(E),
         sc = poisoned<float>(N * E), dlog = poisoned<float>(N * E);
    const float* bp = with_bias ? db.as<float>() : nullptr;
    cuda::router_forward(idx.as<int32_t>(), w.as<float>(), cnt.as<int32_t>(), sc.as<float>(), dl.as<float>(), bp, dc,
                         N, nullptr);
    auto s = down<float>(sc, N * E);
    auto id = down<int32_t>(idx, N * k);
    auto wt = down<float>(w, N * k);
    // scores vs fp64
    std::vector<double> sref(N * E), lrow(E);
    for (int64_t n = 0; n < N; ++n) {
      for (int e = 0; e < E; ++e) lrow[e] = l[n * E + e];
      router_scores_ref<double>(sref.data() + n * E, lrow.data(), E, rc.score);
    }
    r.compare_rel("scores vs fp64 twin", s.data(), sref.data(), N * E, 1e-6);
    // selection: exactly router_select_ref<float> on the device's scores
    std::vector<int32_t> want(N * k);
    for (int64_t n = 0; n < N; ++n)
      router_select_ref<float>(want.data() + n * k, s.data() + n * E, with_bias ? b.data() : nullptr, rc);
    r.compare("top-k indices vs router_select_ref<float> on the same scores (exact, ties to the lower index)",
              id.data(), want.data(), N * k);
    int64_t tied = 0;  // how often the tie rule decided: the last chosen and the best unchosen are equal
    for (int64_t n = 0; n < N; ++n) {
      std::vector<float> q(E);
      for (int e = 0; e < E; ++e) q[e] = s[n * E + e] + (with_bias ? b[e] : 0.0f);
      for (int j = 0; j + 1 < k; ++j) tied += q[want[n * k + j]] == q[want[n * k + j + 1]];
    }
    if (ties) r.check(tied > N / 4, "tie-heavy input: adjacent slots with equal q", std::to_string(tied));
    // weights from the device scores and selection, in fp64
    std::vector<double> wref(N * k);
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += s[n * E + id[n * k + j]];
      for (int j = 0; j < k; ++j) {
        const double sj = s[n * E + id[n * k + j]];
        wref[n * k + j] = double(dc.route_scale) * (dc.norm_topk ? sj / (sum + 1e-20) : sj);
      }
    }
    r.compare_rel("weights vs fp64 on the device's scores", wt.data(), wref.data(), N * k, 1e-6);
    std::vector<int32_t> cref(E, 0);
    for (int32_t e : id) ++cref[e];
    auto cgot = down<int32_t>(cnt, E);
    r.compare("counts (exact)", cgot.data(), cref.data(), E);
    if (big) return;
    // backward vs fp64 twin on the same selection
    cuda::router_backward(dlog.as<float>(), dg.as<float>(), sc.as<float>(), idx.as<int32_t>(), dc, N, nullptr);
    std::vector<double> dref(N * E), gd(g.begin(), g.end()), sd(s.begin(), s.end());
    router_backward_ref<double>(dref.data(), gd.data(), sd.data(), id.data(), nullptr, rc, N);
    r.compare_rel("dlogits vs fp64 twin", down<float>(dlog, N * E).data(), dref.data(), N * E, 1e-5);
    // aux-free bias update: bitwise router_update_bias
    auto b0 = rnd(E, name + "b0", 0.1f);
    auto dbias = up(b0);
    cuda::router_update_bias(dbias.as<float>(), cnt.as<int32_t>(), E, 1e-3f, nullptr);
    router_update_bias(b0.data(), cgot.data(), E, 1e-3f);
    compare_bitwise(r, "bias update vs router_update_bias", down<float>(dbias, E).data(), b0.data(), E);
  }
  void grad(Report& r) override {
    if (big) return r.check(true, "large shape: perf only");
    const int E = dc.E, k = dc.topk;
    auto l = rnd(N * E, name + "gl", 2.0f), d = rnd(N * E, name + "gd"), g = rnd(N * k, name + "gg");
    auto b = bias("gb");
    auto db = with_bias ? up(b) : cuda::DeviceBuffer(), dg = up(g);
    const float* bp = with_bias ? db.as<float>() : nullptr;
    auto idx = poisoned<int32_t>(N * k), w = poisoned<float>(N * k), cnt = poisoned<int32_t>(E),
         sc = poisoned<float>(N * E), dlog = poisoned<float>(N * E);
    auto fwd = [&](float e, std::vector<int32_t>* id) {
      std::vector<float> x(l);
      for (size_t i = 0; i < x.size(); ++i) x[i] += e * d[i];
      auto dx = up(x);
      cuda::router_forward(idx.as<int32_t>(), w.as<float>(), cnt.as<int32_t>(), sc.as<float>(), dx.as<float>(), bp,
                           dc, N, nullptr);
      *id = down<int32_t>(idx, N * k);
      return down<float>(w, N * k);
    };
    const float h = 1e-2f;
    std::vector<int32_t> i0, ip, im;
    auto wp = fwd(h, &ip), wm = fwd(-h, &im);
    fwd(0.0f, &i0);
    cuda::router_backward(dlog.as<float>(), dg.as<float>(), sc.as<float>(), idx.as<int32_t>(), dc, N, nullptr);
    auto dl = down<float>(dlog, N * E);
    double num = 0, ana = 0;
    int64_t used = 0;
    for (int64_t n = 0; n < N; ++n) {
      if (!std::equal(i0.begin() + n * k, i0.begin() + (n + 1) * k, ip.begin() + n * k) ||
          !std::equal(i0.begin() + n * k, i0.begin() + (n + 1) * k, im.begin() + n * k))
        continue;
      ++used;
      for (int j = 0; j < k; ++j) num += double(g[n * k + j]) * (double(wp[n * k + j]) - double(wm[n * k + j]));
      for (int e = 0; e < E; ++e) ana += double(dl[n * E + e]) * double(d[n * E + e]);
    }
    num /= 2.0 * h;
    r.check(used > N / 2, "tokens with an unchanged selection at +-h", std::to_string(used) + " of " + std::to_string(N));
    std::vector<float> got{float(ana)};
    std::vector<double> want{num};
    r.compare_rel("<dlogits, d> vs central difference of <w, g>", got.data(), want.data(), 1, 2e-3);
  }
  void perf() override {
    static std::unique_ptr<cuda::DeviceBuffer> l, idx, w, cnt, sc;
    static const void* owner = nullptr;
    if (owner != this) {
      owner = this;
      l = std::make_unique<cuda::DeviceBuffer>(up(cheap(N * dc.E, 2.0f)));
      idx = std::make_unique<cuda::DeviceBuffer>(poisoned<int32_t>(N * dc.topk));
      w = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(N * dc.topk));
      cnt = std::make_unique<cuda::DeviceBuffer>(poisoned<int32_t>(dc.E));
      sc = std::make_unique<cuda::DeviceBuffer>(poisoned<float>(N * dc.E));
    }
    cuda::router_forward(idx->as<int32_t>(), w->as<float>(), cnt->as<int32_t>(), sc->as<float>(), l->as<float>(),
                         nullptr, dc, N, nullptr);
    sync();
  }
};

// Distinct experts per token (a router's output), seeded by the run.
std::vector<int32_t> random_routing(int64_t N, int k, int E, const std::string& tag) {
  std::mt19937_64 g(run_seed() ^ std::hash<std::string>{}(tag));
  std::vector<int32_t> idx(N * k), all(E);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t n = 0; n < N; ++n) {
    std::shuffle(all.begin(), all.end(), g);
    std::copy(all.begin(), all.begin() + k, idx.begin() + n * k);
  }
  return idx;
}

struct PermuteCase : OpCase {
  int64_t N, D;
  int k, E;
  bool big;
  PermuteCase(const char* nm, int64_t n, int kk, int e, int64_t dd, bool b = false) : N(n), D(dd), k(kk), E(e), big(b) {
    name = nm;
    device = "cuda";
    bytes = double(N) * k * D * (4 + 2) + double(N) * D * 4;
  }
  struct Plan {
    cuda::DeviceBuffer cnt, off, row_of, token_of, slot_of, ws;
  };
  Plan plan(const cuda::DeviceBuffer& idx) {
    Plan p{poisoned<int32_t>(E), poisoned<int32_t>(E + 1), poisoned<int32_t>(N * k), poisoned<int32_t>(N * k),
           poisoned<int32_t>(N * k), cuda::DeviceBuffer(cuda::moe_plan_workspace_bytes(N, k, E), MemCategory::Workspace)};
    return p;
  }
  void test(Report& r) override {
    const int64_t R = N * k;
    auto idx = random_routing(N, k, E, name + "idx");
    auto x = rnd(N * D, name + "x");
    auto didx = up(idx), dx = up(x);
    Plan p = plan(didx);
    auto xp16 = poisoned<bf16>(R * D);
    cuda::moe_dispatch(xp16.as<bf16>(), p.cnt.as<int32_t>(), p.off.as<int32_t>(), p.row_of.as<int32_t>(),
                       p.token_of.as<int32_t>(), p.slot_of.as<int32_t>(), dx.as<float>(), didx.as<int32_t>(), N, k, E,
                       D, p.ws.data(), nullptr);
    std::vector<int32_t> cref(E, 0), off(E + 1), row_of(R), token_of(R), slot_of(R);
    for (int32_t e : idx) ++cref[e];
    moe_permute_plan_ref(off.data(), row_of.data(), token_of.data(), slot_of.data(), idx.data(), cref.data(), N, k, E,
                         0.0);
    r.compare("counts (exact)", down<int32_t>(p.cnt, E).data(), cref.data(), E);
    r.compare("offsets (exact)", down<int32_t>(p.off, E + 1).data(), off.data(), E + 1);
    r.compare("row_of (exact)", down<int32_t>(p.row_of, R).data(), row_of.data(), R);
    r.compare("token_of (exact)", down<int32_t>(p.token_of, R).data(), token_of.data(), R);
    r.compare("slot_of (exact)", down<int32_t>(p.slot_of, R).data(), slot_of.data(), R);
    if (big) return;
    std::vector<bf16> want16(R * D);
    moe_permute_ref<bf16, float>(want16.data(), x.data(), token_of.data(), R, D);
    compare_bitwise(r, "xp (bf16) vs moe_permute_ref", bf_f32(down<bf16>(xp16, R * D)).data(), bf_f32(want16).data(),
                    R * D);
    auto xp = poisoned<float>(R * D);
    cuda::moe_permute(xp.as<float>(), dx.as<float>(), p.token_of.as<int32_t>(), R, D, nullptr);
    std::vector<float> want(R * D);
    moe_permute_ref<float, float>(want.data(), x.data(), token_of.data(), R, D);
    compare_bitwise(r, "xp (fp32) vs moe_permute_ref", down<float>(xp, R * D).data(), want.data(), R * D);
    // unpermute, and the two backwards
    auto yp = rnd(R * D, name + "yp"), w = rnd_u(N * k, name + "w", 0.0f, 1.0f), dy = rnd(N * D, name + "dy");
    auto dyp_in = up(yp), dw_in = up(w), ddy = up(dy);
    auto y = poisoned<float>(N * D), dxo = poisoned<float>(N * D), dyp = poisoned<float>(R * D),
         dw = poisoned<float>(N * k);
    cuda::moe_unpermute(y.as<float>(), dyp_in.as<float>(), p.row_of.as<int32_t>(), dw_in.as<float>(), N, k, D, nullptr);
    cuda::moe_permute_backward(dxo.as<float>(), dyp_in.as<float>(), p.row_of.as<int32_t>(), N, k, D, nullptr);
    cuda::moe_unpermute_backward(dyp.as<float>(), dw.as<float>(), ddy.as<float>(), dyp_in.as<float>(),
                                 p.row_of.as<int32_t>(), dw_in.as<float>(), N, k, D, nullptr);
    auto ypd = to_f64(yp), wd = to_f64(w), dyd = to_f64(dy);
    std::vector<double> yr(N * D), dxr(N * D), dypr(R * D), dwr(N * k);
    moe_unpermute_ref<double>(yr.data(), ypd.data(), row_of.data(), wd.data(), N, k, D);
    moe_permute_backward_ref<double>(dxr.data(), ypd.data(), row_of.data(), N, k, D);
    moe_unpermute_backward_ref<double, double>(dypr.data(), dwr.data(), dyd.data(), ypd.data(), row_of.data(),
                                               wd.data(), N, k, D);
    r.compare_rel("unpermute y vs fp64 twin", down<float>(y, N * D).data(), yr.data(), N * D, 1e-6);
    r.compare_rel("permute backward dx vs fp64 twin", down<float>(dxo, N * D).data(), dxr.data(), N * D, 1e-6);
    r.compare_rel("unpermute backward dyp vs fp64 twin", down<float>(dyp, R * D).data(), dypr.data(), R * D, 1e-6);
    r.compare_rel("unpermute backward dw vs fp64 twin", down<float>(dw, N * k).data(), dwr.data(), N * k, 1e-5);
  }
  void grad(Report& r) override {
    if (big) return r.check(true, "large shape: perf only");
    const int64_t R = N * k;
    auto idx = random_routing(N, k, E, name + "gidx");
    auto didx = up(idx);
    Plan p = plan(didx);
    cuda::moe_plan(p.cnt.as<int32_t>(), p.off.as<int32_t>(), p.row_of.as<int32_t>(), p.token_of.as<int32_t>(), nullptr,
                   didx.as<int32_t>(), N, k, E, p.ws.data(), nullptr);
    auto x = rnd(N * D, name + "gx"), gp = rnd(R * D, name + "gp"), yp = rnd(R * D, name + "gyp"),
         gy = rnd(N * D, name + "gy"), w = rnd_u(N * k, name + "gw", 0.0f, 1.0f), dd = rnd(N * k, name + "gdd");
    auto dx = up(x), dgp = up(gp), dyp = up(yp), dgy = up(gy), dw = up(w), ddd = up(dd);
    auto xp = poisoned<float>(R * D), px = poisoned<float>(N * D), y = poisoned<float>(N * D),
         uy = poisoned<float>(R * D), dwo = poisoned<float>(N * k), yd = poisoned<float>(N * D);
    cuda::moe_permute(xp.as<float>(), dx.as<float>(), p.token_of.as<int32_t>(), R, D, nullptr);
    cuda::moe_permute_backward(px.as<float>(), dgp.as<float>(), p.row_of.as<int32_t>(), N, k, D, nullptr);
    cuda::moe_unpermute(y.as<float>(), dyp.as<float>(), p.row_of.as<int32_t>(), dw.as<float>(), N, k, D, nullptr);
    cuda::moe_unpermute_backward(uy.as<float>(), dwo.as<float>(), dgy.as<float>(), dyp.as<float>(),
                                 p.row_of.as<int32_t>(), dw.as<float>(), N, k, D, nullptr);
    cuda::moe_unpermute(yd.as<float>(), dyp.as<float>(), p.row_of.as<int32_t>(), ddd.as<float>(), N, k, D, nullptr);
    std::vector<float> got{float(dotd(x, down<float>(px, N * D))), float(dotd(yp, down<float>(uy, R * D))),
                           float(dotd(down<float>(dwo, N * k), dd))};
    std::vector<double> want{dotd(down<float>(xp, R * D), gp), dotd(down<float>(y, N * D), gy),
                             dotd(down<float>(yd, N * D), gy)};
    r.compare_rel("<P x, g> = <x, P^T g>; <U yp, g> = <yp, U^T g>; <U_d yp, g> = <dw, d>", got.data(), want.data(), 3,
                  1e-5);
  }
  void perf() override {  // the whole dispatch: plan + bf16 gather
    static std::unique_ptr<cuda::DeviceBuffer> idx, x, xp, cnt, off, ro, to, ws;
    const int64_t R = N * k;
    static const void* owner = nullptr;
    if (owner != this) {
      owner = this;
      idx = std::make_unique<cuda::DeviceBuffer>(up(random_routing(N, k, E, "pidx")));
      x = std::make_unique<cuda::DeviceBuffer>(up(cheap(N * D)));
      xp = std::make_unique<cuda::DeviceBuffer>(poisoned<bf16>(R * D));
      cnt = std::make_unique<cuda::DeviceBuffer>(poisoned<int32_t>(E));
      off = std::make_unique<cuda::DeviceBuffer>(poisoned<int32_t>(E + 1));
      ro = std::make_unique<cuda::DeviceBuffer>(poisoned<int32_t>(R));
      to = std::make_unique<cuda::DeviceBuffer>(poisoned<int32_t>(R));
      ws = std::make_unique<cuda::DeviceBuffer>(cuda::moe_plan_workspace_bytes(N, k, E), MemCategory::Workspace);
    }
    cuda::moe_dispatch(xp->as<bf16>(), cnt->as<int32_t>(), off->as<int32_t>(), ro->as<int32_t>(), to->as<int32_t>(),
                       nullptr, x->as<float>(), idx->as<int32_t>(), N, k, E, D, ws->data(), nullptr);
    sync();
  }
};

cuda::DeviceRouterConfig rcfg(int E, int k, bool sigmoid, int ng, int tg, bool top2, bool norm, float rs) {
  cuda::DeviceRouterConfig c;
  c.E = E, c.topk = k, c.sigmoid = sigmoid, c.n_group = ng, c.topk_group = tg, c.group_top2sum = top2;
  c.norm_topk = norm, c.route_scale = rs;
  return c;
}

MT_REGISTER_OP_CASES([] {
  std::vector<std::unique_ptr<OpCase>> v;
  v.push_back(std::make_unique<RouterCase>("router/cuda_softmax_topk", rcfg(64, 6, false, 1, 1, false, true, 1.0f), 333,
                                           false, false));
  v.push_back(std::make_unique<RouterCase>("router/cuda_sigmoid_group_top2_bias",
                                           rcfg(64, 8, true, 8, 4, true, true, 2.5f), 257, true, false));
  v.push_back(std::make_unique<RouterCase>("router/cuda_softmax_group_max_nonorm",
                                           rcfg(40, 5, false, 5, 3, false, false, 1.0f), 150, true, false));
  v.push_back(std::make_unique<RouterCase>("router/cuda_ties", rcfg(32, 4, false, 4, 2, false, true, 1.0f), 300, true,
                                           true));
  v.push_back(std::make_unique<RouterCase>("router/cuda_ties_sigmoid_top2",
                                           rcfg(48, 6, true, 6, 3, true, true, 1.0f), 300, true, true));
  v.push_back(std::make_unique<RouterCase>("router/cuda_v3_16k", rcfg(256, 8, true, 8, 4, true, true, 2.5f), 16384,
                                           true, false, true));
  v.push_back(std::make_unique<PermuteCase>("permute/cuda_dispatch", 1000, 6, 64, 96));
  v.push_back(std::make_unique<PermuteCase>("permute/cuda_dispatch_one_expert", 77, 1, 1, 33));
  v.push_back(std::make_unique<PermuteCase>("permute/cuda_dispatch_16k", 16384, 8, 256, 2048, true));
  return v;
});

}  // namespace
}  // namespace moetron::ops
