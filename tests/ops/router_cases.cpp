// router_cases.cpp: op-harness cases for the MoE router (family "router").
//   test: router_forward / router_backward vs the reference twins. The check is split so that the discrete
//         part can be exact while the float part has a tolerance: (1) scores vs router_forward_ref<float>
//         within an error bound; (2) the selection recomputed by router_select_ref from the OPTIMIZED scores
//         must equal the optimized topk_idx and counts exactly; (3) end to end, topk_idx equals the float
//         reference's at every token whose reference selection margin exceeds the score error bound (the
//         scalar path must match at every token); (4) weights, losses and dlogits vs the references evaluated
//         on the optimized scores and selection.
//   grad: router_backward_ref<double> vs central differences of the TOTAL loss
//         sum(g * topk_w) + L_aux + L_z (router_forward_ref<double>), skipping coordinates whose +-eps
//         perturbation changes the token's selection (top-k is piecewise constant).
// Not a benchmark: bench/bench_router.cpp.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "moetron/check.h"
#include "moetron/router.h"
#include "moetron/runtime.h"

namespace moetron::ops {
namespace {

constexpr double kU = 5.9604644775390625e-08;  // 2^-24, fp32 unit roundoff

enum class Data { Random, Skewed, Unpicked, Ties };

struct RouterSpec {
  std::string variant;
  RouterConfig cfg;
  int64_t N = 64;
  bool bias = false;
  Data data = Data::Random;
  uint64_t seed = 1;
};

template <class T>
double aux_loss_from(const std::vector<T>& s, const int32_t* idx, const RouterConfig& cfg, int64_t N) {
  std::vector<double> sd(s.begin(), s.end()), c = router_aux_coef_ref<double>(idx, cfg, N), sp(cfg.E);
  double a = 0;
  for (int64_t n = 0; n < N; ++n) {
    router_aux_scores_ref(sp.data(), sd.data() + n * cfg.E, cfg.E, cfg.score);
    for (int e = 0; e < cfg.E; ++e) a += c[n * cfg.E + e] * sp[e];
  }
  return a;
}

// Smallest gap (absolute) between adjacent selection values that decide token n's topk_idx: every pair of
// consecutive slots (the order matters), the k-th vs the first excluded eligible expert, and the last kept
// vs the first excluded group. Exactly equal values (true ties) are not near-ties: both implementations
// compute identical values for identical inputs and break the tie by index.
double selection_margin(const double* s, const double* bias, const RouterConfig& cfg) {
  const int E = cfg.E, G = E / cfg.n_group;
  std::vector<double> q(E);
  for (int e = 0; e < E; ++e) q[e] = s[e] + (bias ? bias[e] : 0.0);
  double m = INFINITY;
  auto gap = [&](double a, double b) {
    if (a != b) m = std::min(m, std::fabs(a - b));
  };
  std::vector<char> elig(E, 1);
  if (cfg.n_group > 1) {
    std::vector<double> gs(cfg.n_group);
    for (int g = 0; g < cfg.n_group; ++g) {
      std::vector<double> v(q.begin() + g * G, q.begin() + (g + 1) * G);
      std::sort(v.rbegin(), v.rend());
      gs[g] = cfg.group_score == GroupScore::Max || G < 2 ? v[0] : v[0] + v[1];
      if (cfg.group_score == GroupScore::Top2Sum && G > 2) gap(v[1], v[2]);  // which two are summed
    }
    std::vector<int> order(cfg.n_group);
    for (int g = 0; g < cfg.n_group; ++g) order[g] = g;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return gs[a] > gs[b]; });
    if (cfg.topk_group < cfg.n_group) gap(gs[order[cfg.topk_group - 1]], gs[order[cfg.topk_group]]);
    std::fill(elig.begin(), elig.end(), 0);
    for (int r = 0; r < cfg.topk_group; ++r)
      for (int j = 0; j < G; ++j) elig[order[r] * G + j] = 1;
  }
  std::vector<double> v;
  for (int e = 0; e < E; ++e)
    if (elig[e]) v.push_back(q[e]);
  std::sort(v.rbegin(), v.rend());
  for (int j = 0; j + 1 < int(v.size()) && j < cfg.topk; ++j) gap(v[j], v[j + 1]);
  return m;
}

class RouterCase : public OpCase {
 public:
  explicit RouterCase(RouterSpec sp) : sp_(std::move(sp)) {
    name = "router/" + sp_.variant;
    smooth = false;
    fd_eps = 1e-5;
    grad_tol = 1e-5;
    const RouterConfig& c = sp_.cfg;
    const int64_t N = sp_.N, E = c.E, k = c.topk;
    logits_ = randn(N * E, sp_.seed, 1.0f);
    if (sp_.data == Data::Skewed)
      for (int64_t n = 0; n < N; ++n) logits_[n * E + 3] += 6.0f;  // enough to win every token, not saturated
    if (sp_.data == Data::Unpicked)
      for (int64_t n = 0; n < N; ++n) logits_[n * E + E - 1] -= 30.0f;
    if (sp_.data == Data::Ties)  // few distinct values: many exact ties, broken by index
      for (auto& v : logits_) v = std::round(v * 2.0f) * 0.5f;
    if (sp_.bias) {
      float scale = c.score == ScoreFn::Softmax ? 0.5f / float(E) : 0.3f;
      bias_ = randn(E, sp_.seed + 7, scale);
    }
    g_ = randn(N * k, sp_.seed + 11, 1.0f);
    bytes = double(N * E) * 4 * 4 + double(N * k) * 16;  // fwd: logits, scores, idx, w; bwd: scores, g, idx, dlogits
  }

  const float* bias() const { return sp_.bias ? bias_.data() : nullptr; }

  void test(Report& r) override {
    const RouterConfig& c = sp_.cfg;
    const int64_t N = sp_.N, E = c.E, k = c.topk;
    // optimized
    std::vector<int32_t> idx(N * k), cnt(E);
    std::vector<float> w(N * k), s(N * E), dl(N * E);
    std::vector<char> ws(router_workspace_bytes(c, N));
    RouterLosses L;
    router_forward(idx.data(), w.data(), cnt.data(), s.data(), &L, logits_.data(), bias(), c, N, ws.data());
    router_backward(dl.data(), g_.data(), s.data(), idx.data(), logits_.data(), c, N, ws.data());
    // float reference, end to end
    std::vector<int32_t> idx_r(N * k), cnt_r(E);
    std::vector<float> w_r(N * k), s_r(N * E);
    float aux_r = 0, z_r = 0;
    router_forward_ref<float>(idx_r.data(), w_r.data(), cnt_r.data(), s_r.data(), &aux_r, &z_r, logits_.data(), bias(),
                              c, N);

    // (1) scores. Softmax: exp (<= 2 ulp), a sum of E terms (<= (E-1) u), a division: <= (E + 4) u relative
    // for either implementation, so they differ by <= 2 (E + 4) u; sigmoid: <= 4 u each. atol covers denormals.
    const double rtol_s = c.score == ScoreFn::Softmax ? 2.0 * (E + 4) * kU : 8 * kU;
    r.compare("scores", s.data(), s_r.data(), N * E, 1e-37, rtol_s);

    // (2) the selection from the optimized scores is exact.
    std::vector<int32_t> idx_x(N * k), cnt_x(E, 0);
    for (int64_t n = 0; n < N; ++n) router_select_ref<float>(idx_x.data() + n * k, s.data() + n * E, bias(), c);
    for (int64_t i = 0; i < N * k; ++i) ++cnt_x[idx_x[i]];
    r.compare("topk_idx == select_ref(optimized scores)", idx.data(), idx_x.data(), N * k);
    r.compare("counts", cnt.data(), cnt_x.data(), E);

    // (3) end to end vs the float reference, except at near-ties. The selection values q = s + b carry the
    // score error (<= rtol_s * s) plus one rounding of the addition: 2 * (rtol_s + 2 u) * max|q| bounds it.
    {
      std::vector<double> sd(s_r.begin(), s_r.end()), bd(bias_.begin(), bias_.end());
      int64_t mismatched = 0, near = 0, bad = 0;
      for (int64_t n = 0; n < N; ++n) {
        double qmax = 0;
        for (int e = 0; e < E; ++e) qmax = std::max(qmax, std::fabs(sd[n * E + e] + (sp_.bias ? bd[e] : 0.0)));
        double thr = 4.0 * (rtol_s + 2 * kU) * qmax;
        bool is_near = selection_margin(sd.data() + n * E, sp_.bias ? bd.data() : nullptr, c) <= thr;
        near += is_near;
        bool same = std::equal(idx.begin() + n * k, idx.begin() + (n + 1) * k, idx_r.begin() + n * k);
        if (!same) ++mismatched;
        if (!same && !is_near) ++bad;
      }
      std::ostringstream os;
      os << mismatched << " of " << N << " tokens differ, " << near << " near-tie tokens, " << bad
         << " differ without a near tie";
      bool scalar_path = active_isa() == Isa::Scalar;  // the portable path is bitwise the float reference
      r.check(bad == 0 && (!scalar_path || mismatched == 0), "topk_idx vs router_forward_ref<float>", os.str());
    }

    // (4) weights from the optimized scores and selection (same formula: a sum of k, a division, a product).
    std::vector<float> w_x(N * k);
    for (int64_t n = 0; n < N; ++n) {
      float sum = 0;
      for (int j = 0; j < k; ++j) sum += s[n * E + idx[n * k + j]];
      for (int j = 0; j < k; ++j) {
        float v = s[n * E + idx[n * k + j]];
        w_x[n * k + j] = c.route_scale * (c.norm_topk ? v / (sum + 1e-20f) : v);
      }
    }
    r.compare("topk_w", w.data(), w_x.data(), N * k, 0, 2.0 * (k + 3) * kU);
    // Losses: references in fp64 on the optimized scores and selection. The optimized aux sums fp32 s'
    // (sigmoid: one division after an E-term fp32 sum, <= (E + 1) u relative) in fp64.
    if (c.aux != AuxMode::None) {
      double a = aux_loss_from(s, idx.data(), c, N);
      double got = L.aux;
      r.compare("aux loss", &got, &a, 1, 1e-30, 2.0 * (E + 2) * kU);
    } else {
      r.check(L.aux == 0.0f, "aux loss is 0 without AuxMode");
    }
    {
      double z = 0;
      if (c.z_coef > 0) {
        std::vector<double> ld(logits_.begin(), logits_.end());
        for (int64_t n = 0; n < N; ++n) {
          double lse = logsumexp_ref(ld.data() + n * E, int(E));
          z += lse * lse;
        }
        z = double(c.z_coef) * z / double(N);
      }
      // Portable path: fp64 inside, one rounding to fp32. AVX-512 and AVX2 paths: fp32 logsumexp (vector exp, an E-term
      // sum, a log): |d lse| <= (E + 8) u max(1, |lse|), so lse^2 is within 2 (E + 8) u when |lse| >= 1 (here
      // lse >= log E); 2x margin.
      double got = L.z, rtol_z = active_isa() != Isa::Scalar ? 4.0 * (E + 8) * kU : 2 * kU;
      r.compare("z loss", &got, &z, 1, 1e-30, rtol_z);
    }
    // dlogits vs router_backward_ref<double> on the same (fp32) inputs. dlogits = s * (ds - dot) (softmax) or
    // ds * s (1 - s) (sigmoid), where ds collects rs/S * (g - sum g s/S) and the aux terms. Each fp32 step
    // rounds relative to the terms BEFORE their cancellation, so the absolute error is bounded by
    // ~(E + k + 8) u * max_n [ max_e s_ne * B_n ], B_n = rs max|g_n| (2/S_n if normalized) + aux scale
    // (x 2/sum s for sigmoid) + the z-loss gradient scale; a 4x margin on top.
    {
      std::vector<double> dld(N * E), gd = to_f64(g_), sd(s.begin(), s.end()), ld = to_f64(logits_);
      router_backward_ref<double>(dld.data(), gd.data(), sd.data(), idx.data(), ld.data(), c, N);
      std::vector<double> ca = router_aux_coef_ref<double>(idx.data(), c, N);
      double mag = 0;
      for (double v : dld) mag = std::max(mag, std::fabs(v));
      for (int64_t n = 0; n < N; ++n) {
        double smax = 0, ssum = 0, S = 0, gmax = 0, cmax = 0;
        for (int e = 0; e < E; ++e) smax = std::max(smax, sd[n * E + e]), ssum += sd[n * E + e];
        for (int e = 0; e < E; ++e) cmax = std::max(cmax, ca[n * E + e]);
        for (int j = 0; j < k; ++j) S += sd[n * E + idx[n * k + j]], gmax = std::max(gmax, std::fabs(gd[n * k + j]));
        double B = c.route_scale * gmax * (c.norm_topk ? 2.0 / S : 1.0);
        B += cmax * (c.score == ScoreFn::Sigmoid ? 2.0 / ssum : 1.0);
        mag = std::max(mag, smax * B);
      }
      std::vector<double> dlf(dl.begin(), dl.end());
      double tol = 4.0 * (E + k + 8) * kU;
      r.compare("dlogits", dlf.data(), dld.data(), N * E, tol * mag, tol);
    }

    // Determinism: bitwise the same outputs with 1 and 3 threads (uneven static splits).
    if (N >= 256) {
      const int saved = omp_get_max_threads();
      auto run = [&](int threads, std::vector<int32_t>& i2, std::vector<float>& w2, std::vector<float>& dl2,
                     RouterLosses& L2) {
        omp_set_num_threads(threads);
        std::vector<int32_t> c2(E);
        std::vector<float> s2(N * E);
        router_forward(i2.data(), w2.data(), c2.data(), s2.data(), &L2, logits_.data(), bias(), c, N, ws.data());
        router_backward(dl2.data(), g_.data(), s2.data(), i2.data(), logits_.data(), c, N, ws.data());
      };
      std::vector<int32_t> i1(N * k), i3(N * k);
      std::vector<float> w1(N * k), w3(N * k), d1(N * E), d3(N * E);
      RouterLosses L1, L3;
      run(1, i1, w1, d1, L1);
      run(3, i3, w3, d3, L3);
      omp_set_num_threads(saved);
      bool same = i1 == i3 && std::memcmp(w1.data(), w3.data(), w1.size() * 4) == 0 &&
                  std::memcmp(d1.data(), d3.data(), d1.size() * 4) == 0 && std::memcmp(&L1, &L3, sizeof L1) == 0;
      r.check(same, "bitwise identical with 1 and 3 threads (idx, w, losses, dlogits)");
    }

    // Data-specific facts.
    if (sp_.data == Data::Skewed) r.check(cnt[3] == N, "skewed: every token picks expert 3", std::to_string(cnt[3]));
    if (sp_.data == Data::Unpicked) r.check(cnt[E - 1] == 0, "expert E-1 is never picked", std::to_string(cnt[E - 1]));
    if (sp_.data == Data::Ties) {
      // all-equal logits: the lowest indices win, in order (groups too: the lowest groups)
      std::vector<float> zl(E, 0.0f), zs(E), zw(k);
      std::vector<int32_t> zi(k), zc(E);
      std::vector<char> zws(router_workspace_bytes(c, 1));
      RouterConfig c1 = c;
      c1.aux = AuxMode::None;
      router_forward(zi.data(), zw.data(), zc.data(), zs.data(), nullptr, zl.data(), nullptr, c1, 1, zws.data());
      std::vector<int32_t> want(k);
      for (int j = 0; j < k; ++j) want[j] = j;
      r.compare("all-equal logits pick experts 0..k-1", zi.data(), want.data(), k);
    }
    if (sp_.bias && N >= 16) {  // the bias changes the selection of some tokens, but never the weights' source
      std::vector<int32_t> idx_nb(N * k);
      for (int64_t n = 0; n < N; ++n) router_select_ref<float>(idx_nb.data() + n * k, s.data() + n * E, nullptr, c);
      r.check(idx_nb != idx, "bias changes the selection of some tokens");
    }
    if (c.norm_topk) {
      double worst = 0;
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0;
        for (int j = 0; j < k; ++j) sum += w[n * k + j];
        worst = std::max(worst, std::fabs(sum / c.route_scale - 1.0));
      }
      r.check(worst <= 4.0 * (k + 2) * kU, "normalized weights sum to route_scale", std::to_string(worst));
    }
  }

  void grad(Report& r) override {
    const RouterConfig& c = sp_.cfg;
    const int64_t N = sp_.N, E = c.E, k = c.topk;
    std::vector<double> x = to_f64(logits_), b = to_f64(bias_), g = to_f64(g_);
    const double* bp = sp_.bias ? b.data() : nullptr;
    std::vector<int32_t> idx(N * k), cnt(E);
    std::vector<double> w(N * k), s(N * E), dl(N * E);
    double aux = 0, z = 0;
    auto forward = [&]() {
      router_forward_ref<double>(idx.data(), w.data(), cnt.data(), s.data(), &aux, &z, x.data(), bp, c, N);
      return dot(g.data(), w.data(), N * k) + aux + z;
    };
    forward();
    const std::vector<int32_t> idx0 = idx;
    router_backward_ref<double>(dl.data(), g.data(), s.data(), idx.data(), x.data(), c, N);
    // Skip a coordinate if moving it by +-eps changes its token's selection (or slot order).
    std::vector<double> srow(E);
    std::vector<int32_t> irow(k);
    auto changes = [&](int64_t i, double delta) {
      const int64_t n = i / E;
      double x0 = x[i];
      x[i] = x0 + delta;
      router_scores_ref(srow.data(), x.data() + n * E, int(E), c.score);
      router_select_ref(irow.data(), srow.data(), bp, c);
      x[i] = x0;
      return !std::equal(irow.begin(), irow.end(), idx0.begin() + n * k);
    };
    auto skip = [&](int64_t i) { return changes(i, fd_eps) || changes(i, -fd_eps); };
    r.fd_check("dlogits (total loss)", x.data(), N * E, dl.data(), forward, fd_eps, grad_tol, 48, skip);
    // The loss terms separately, so that a wrong aux or z gradient cannot hide behind the main term.
    if (c.aux != AuxMode::None || c.z_coef > 0) {
      std::vector<double> g0(N * k, 0.0), dl0(N * E);
      forward();
      router_backward_ref<double>(dl0.data(), g0.data(), s.data(), idx.data(), x.data(), c, N);
      auto loss0 = [&]() {
        forward();
        return aux + z;
      };
      double gmax0 = 0;
      for (double v : dl0) gmax0 = std::max(gmax0, std::fabs(v));
      if (gmax0 > 1e-12) {
        r.fd_check("dlogits (aux + z only)", x.data(), N * E, dl0.data(), loss0, fd_eps, grad_tol, 24, skip);
      } else {
        // e.g. k == E: every f_e = 1/E, so L_aux = aux_coef * sum_e P_e = aux_coef is constant. The gradient
        // must vanish, and the loss must not move under perturbations (up to fp64 roundoff).
        double l0 = loss0(), worst = 0;
        for (int64_t i = 0; i < std::min<int64_t>(N * E, 24); ++i) {
          double x0 = x[i];
          x[i] = x0 + 1e-3;
          worst = std::max(worst, std::fabs(loss0() - l0));
          x[i] = x0;
        }
        r.check(worst <= 1e-13 * std::max(1.0, std::fabs(l0)), "aux + z loss is constant when its gradient is 0",
                "max |dL| " + std::to_string(worst) + ", max |grad| " + std::to_string(gmax0));
      }
    }
  }

  void perf() override {
    const RouterConfig& c = sp_.cfg;
    const int64_t N = sp_.N, E = c.E, k = c.topk;
    if (perf_ws_.empty()) {
      perf_ws_.resize(router_workspace_bytes(c, N));
      pidx_.resize(N * k);
      pcnt_.resize(E);
      pw_.resize(N * k);
      ps_.resize(N * E);
      pdl_.resize(N * E);
    }
    RouterLosses L;
    router_forward(pidx_.data(), pw_.data(), pcnt_.data(), ps_.data(), &L, logits_.data(), bias(), c, N,
                   perf_ws_.data());
    router_backward(pdl_.data(), g_.data(), ps_.data(), pidx_.data(), logits_.data(), c, N, perf_ws_.data());
  }

 private:
  RouterSpec sp_;
  std::vector<float> logits_, bias_, g_;
  std::vector<char> perf_ws_;
  std::vector<int32_t> pidx_, pcnt_;
  std::vector<float> pw_, ps_, pdl_;
};

// Invalid configurations and inputs must throw moetron::Error.
class RouterBadInput : public OpCase {
 public:
  RouterBadInput() { name = "router/bad_input"; }
  void run(Report& r) {
    RouterConfig ok;
    ok.E = 8;
    ok.topk = 2;
    auto bad = [&](const char* what, auto&& mod, int64_t N = 16) {
      RouterConfig c = ok;
      mod(c);
      r.expect_throw(what, [&] { router_validate(c, N); });
    };
    bad("k > E", [](RouterConfig& c) { c.topk = 9; });
    bad("k = 0", [](RouterConfig& c) { c.topk = 0; });
    bad("E % n_group != 0", [](RouterConfig& c) { c.n_group = 3; });
    bad("topk_group > n_group", [](RouterConfig& c) { c.n_group = 2, c.topk_group = 3; });
    bad("k > topk_group * E / n_group", [](RouterConfig& c) { c.n_group = 4, c.topk_group = 1, c.topk = 3; });
    bad("SeqWise without seq_len", [](RouterConfig& c) { c.aux = AuxMode::SeqWise; });
    bad("N % seq_len != 0", [](RouterConfig& c) { c.aux = AuxMode::SeqWise, c.seq_len = 5; });
    bad("route_scale = 0", [](RouterConfig& c) { c.route_scale = 0; });
    bad("negative aux_coef", [](RouterConfig& c) { c.aux_coef = -1; });
    bad("negative N", [](RouterConfig&) {}, -1);
    {
      RouterConfig c = ok;
      std::vector<float> l(16 * 8, 0.0f), s(16 * 8), w(16 * 2);
      std::vector<int32_t> idx(16 * 2), cnt(8);
      std::vector<char> ws(router_workspace_bytes(c, 16));
      l[37] = NAN;
      r.expect_throw("NaN logits", [&] {
        router_forward(idx.data(), w.data(), cnt.data(), s.data(), nullptr, l.data(), nullptr, c, 16, ws.data());
      });
      l[37] = 0;
      r.expect_throw("null workspace", [&] {
        router_forward(idx.data(), w.data(), cnt.data(), s.data(), nullptr, l.data(), nullptr, c, 16, nullptr);
      });
      c.z_coef = 0.1f;
      r.expect_throw("z-loss backward without logits", [&] {
        router_backward(s.data(), w.data(), s.data(), idx.data(), nullptr, c, 16, ws.data());
      });
    }
    RouterConfig good = ok;
    good.n_group = 4;
    good.topk_group = 1;  // k = 2 = 1 group * 2 experts: allowed
    bool threw = false;
    try {
      router_validate(good, 16);
    } catch (const Error&) {
      threw = true;
    }
    r.check(!threw, "k == topk_group * E / n_group is accepted");
  }
  void test(Report& r) override { run(r); }
  void grad(Report& r) override { run(r); }
  void perf() override {}
};

// router_update_bias and router_load_stats on hand-computed values.
class RouterHelpers : public OpCase {
 public:
  RouterHelpers() { name = "router/helpers"; }
  void run(Report& r) {
    const int E = 4;
    int32_t c32[E] = {10, 2, 4, 0};  // mean 4
    float bias[E] = {0.5f, 0, 0, -1};
    router_update_bias(bias, c32, E, 0.25f);
    const float want[E] = {0.25f, 0.25f, 0.0f, -0.75f};
    r.compare("update_bias: bias += rate * sign(mean - count)", bias, want, E, 0, 0);
    int64_t c64[E] = {10, 2, 4, 0};
    float bias64[E] = {0.5f, 0, 0, -1};
    router_update_bias(bias64, c64, E, 0.25f);
    r.compare("update_bias (int64 counts)", bias64, want, E, 0, 0);
    // Proportional (model.bias_update = "proportional"): counts 10, 2, 4, 0 of mean 4: errors (4 - c) / 4 =
    // -1.5 (clipped to -1), 0.5, 0, 1; rate 0.25: steps -0.25, 0.125, 0, 0.25 (exact in binary).
    float biasp[E] = {0.5f, 0, 0, -1};
    router_update_bias_proportional(biasp, c64, E, 0.25f);
    const float wantp[E] = {0.25f, 0.125f, 0.0f, -0.75f};
    r.compare("update_bias_proportional: bias += rate * clamp((mean - count) / mean, -1, 1)", biasp, wantp, E, 0, 0);
    int64_t none[E] = {0, 0, 0, 0};
    router_update_bias_proportional(biasp, none, E, 0.25f);
    r.compare("update_bias_proportional: no token routed, no step", biasp, wantp, E, 0, 0);
    LoadStats st = router_load_stats(c32, E);
    // mean 4, deviations 6, -2, 0, -4: variance 56/4 = 14, cv = sqrt(14)/4
    r.check(st.min == 0 && st.max == 10 && st.mean == 4.0, "load stats min/max/mean");
    double cv = st.cv, want_cv = std::sqrt(14.0) / 4.0;
    r.compare("load stats cv", &cv, &want_cv, 1, 0, 1e-15);
    int32_t zeros[E] = {0, 0, 0, 0};
    r.check(router_load_stats(zeros, E).cv == 0.0, "cv of all-zero counts is 0");
  }
  void test(Report& r) override { run(r); }
  void grad(Report& r) override { run(r); }
  void perf() override {}
};

// Sinkhorn selection (RouterConfig::sinkhorn_iters): the column factors vs a float64 twin written from the
// definition in router.h, the selection vs the top-k of s * c, and the effect it exists for: N tokens that share
// one score row up to a small per-token spread (the collapsed router input of docs/routing.md) all pick the same
// k experts without it, and spread over the experts with it.
class RouterSinkhorn : public OpCase {
 public:
  RouterSinkhorn() { name = "router/sinkhorn"; }
  void run(Report& r) {
    const int E = 16, k = 2, iters = 8;
    const int64_t N = 256;
    std::vector<float> logits(static_cast<size_t>(N * E));
    uint64_t st = 12345;
    auto unif = [&] {  // xorshift in [0, 1)
      st ^= st << 13, st ^= st >> 7, st ^= st << 17;
      return double(st >> 11) / 9007199254740992.0;
    };
    std::vector<double> shared(static_cast<size_t>(E));
    for (auto& x : shared) x = 0.5 * (unif() - 0.5);                   // per-expert level: spread 0.29
    for (int64_t n = 0; n < N; ++n)
      for (int e = 0; e < E; ++e) logits[size_t(n * E + e)] = float(shared[size_t(e)] + 0.02 * (unif() - 0.5));
    for (ScoreFn fn : {ScoreFn::Softmax, ScoreFn::Sigmoid}) {
      const std::string tag = fn == ScoreFn::Softmax ? "softmax" : "sigmoid";
      RouterConfig c;
      c.E = E, c.topk = k, c.score = fn, c.norm_topk = false;
      std::vector<int32_t> idx(static_cast<size_t>(N * k)), cnt0(static_cast<size_t>(E)), cnt(static_cast<size_t>(E));
      std::vector<float> w(static_cast<size_t>(N * k)), s(static_cast<size_t>(N * E));
      std::vector<char> ws(router_workspace_bytes(RouterConfig{c}, N) + 4096);
      router_forward(idx.data(), w.data(), cnt0.data(), s.data(), nullptr, logits.data(), nullptr, c, N, ws.data());
      c.sinkhorn_iters = iters;
      std::vector<char> ws2(router_workspace_bytes(c, N));
      router_forward(idx.data(), w.data(), cnt.data(), s.data(), nullptr, logits.data(), nullptr, c, N, ws2.data());
      // float64 twin of the factors on the same fp32 scores
      std::vector<double> cf(static_cast<size_t>(E), 1.0), rr(static_cast<size_t>(N));
      for (int it = 0; it < iters; ++it) {
        for (int64_t n = 0; n < N; ++n) {
          double t = 0;
          for (int e = 0; e < E; ++e) t += double(s[size_t(n * E + e)]) * cf[size_t(e)];
          rr[size_t(n)] = 1.0 / t;
        }
        for (int e = 0; e < E; ++e) {
          double t = 0;
          for (int64_t n = 0; n < N; ++n) t += double(s[size_t(n * E + e)]) * rr[size_t(n)];
          cf[size_t(e)] = (double(N) / E) / t;
        }
      }
      double mean = 0;
      for (double x : cf) mean += x;
      for (double& x : cf) x /= mean / E;
      std::vector<double> got(static_cast<size_t>(E));
      router_sinkhorn_factors(got.data(), s.data(), N, E, iters, ws2.data());
      // The same fp64 operations in the same order: equal up to the compiler's contraction of a*b+c (one rounding
      // of 2^-53 per term, N*E terms per factor, amplified at most ~E by the iteration): 1e-11 relative.
      r.compare("sinkhorn factors vs float64 twin (" + tag + ")", got.data(), cf.data(), E, 0, 1e-11);
      bool sel_ok = true;
      for (int64_t n = 0; n < N && sel_ok; ++n) {  // the kernel's choice is the top-k of q = s * float(c)
        std::vector<float> q(static_cast<size_t>(E));
        for (int e = 0; e < E; ++e) q[size_t(e)] = s[size_t(n * E + e)] * float(got[size_t(e)]);
        std::vector<int> order(static_cast<size_t>(E));
        for (int e = 0; e < E; ++e) order[size_t(e)] = e;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return q[size_t(a)] > q[size_t(b)]; });
        for (int j = 0; j < k; ++j) sel_ok = sel_ok && idx[size_t(n * k + j)] == order[size_t(j)];
      }
      r.check(sel_ok, "sinkhorn selection = top-k of s * c (" + tag + ")");
      const int max0 = *std::max_element(cnt0.begin(), cnt0.end()), max1 = *std::max_element(cnt.begin(), cnt.end());
      // Without it every token picks the same 2 experts (max N = 256); balanced is N k / E = 32 per expert.
      r.check(max0 == N, "collapsed input: plain top-k puts every token on one expert (" + tag + ", max " +
                             std::to_string(max0) + ")");
      r.check(max1 <= 2 * N * k / E, "sinkhorn selection: no expert above twice the balanced load (" + tag +
                                         ", max " + std::to_string(max1) + ")");
      // Capacity routing on the same collapsed scores, without and with Sinkhorn, held to a naive greedy twin
      // (tokens in order, the largest available q, ties to the lower index):
      // - capacity 1.5: C = ceil(1.5 * 256 * 2 / 16) = 48 >= the bound E / (E - k + 1) = 16 / 15 needs, so every
      //   token finds k experts with room: every expert at most C;
      // - capacity 1.0: C = 32, below that bound: the last tokens find fewer than k experts with room and take their
      //   best unused experts (the fallback); without Sinkhorn the twin must take it at least once, so it is exercised.
      for (float capf : {1.5f, 1.0f})
        for (int it : {0, iters}) {
          RouterConfig cc = c;
          cc.sinkhorn_iters = it, cc.capacity = capf;
          std::vector<char> ws3(router_workspace_bytes(cc, N));
          std::vector<int32_t> cidx(static_cast<size_t>(N * k)), ccnt(static_cast<size_t>(E));
          router_forward(cidx.data(), w.data(), ccnt.data(), s.data(), nullptr, logits.data(), nullptr, cc, N,
                         ws3.data());
          std::vector<double> fac(static_cast<size_t>(E), 1.0);
          if (it > 0) router_sinkhorn_factors(fac.data(), s.data(), N, E, it, ws3.data());
          const int C = capf > 1.2f ? 48 : 32;
          std::vector<int32_t> want(static_cast<size_t>(N * k)), wcnt(static_cast<size_t>(E), 0);
          int fallbacks = 0;
          auto qv = [&](int64_t n, int e) {
            return it > 0 ? s[size_t(n * E + e)] * float(fac[size_t(e)]) : s[size_t(n * E + e)];
          };
          for (int64_t n = 0; n < N; ++n)
            for (int j = 0; j < k; ++j) {
              auto taken = [&](int e) {
                for (int i = 0; i < j; ++i)
                  if (want[size_t(n * k + i)] == e) return true;
                return false;
              };
              int best = -1;
              for (int e = 0; e < E; ++e)
                if (!taken(e) && wcnt[size_t(e)] < C && (best < 0 || qv(n, e) > qv(n, best))) best = e;
              if (best < 0) {
                ++fallbacks;
                for (int e = 0; e < E; ++e)
                  if (!taken(e) && (best < 0 || qv(n, e) > qv(n, best))) best = e;
              }
              want[size_t(n * k + j)] = best, ++wcnt[size_t(best)];
            }
          const std::string ctag = tag + ", capacity " + (capf > 1.2f ? "1.5" : "1.0") + (it > 0 ? ", sinkhorn" : "");
          r.compare("capacity routing = greedy twin (" + ctag + ")", cidx.data(), want.data(), N * k);
          r.compare("capacity routing counts (" + ctag + ")", ccnt.data(), wcnt.data(), E);
          bool distinct = true;
          for (int64_t n = 0; n < N; ++n)
            for (int a = 0; a < k; ++a)
              for (int b = a + 1; b < k; ++b) distinct = distinct && cidx[size_t(n * k + a)] != cidx[size_t(n * k + b)];
          r.check(distinct, "capacity routing: k distinct experts per token (" + ctag + ")");
          if (capf > 1.2f)
            r.check(*std::max_element(ccnt.begin(), ccnt.end()) <= C,
                    "capacity routing: no expert above C = 48 (" + ctag + ")");
          else if (it == 0)  // (with Sinkhorn's spread choices the collapsed input leaves room to the end)
            r.check(fallbacks > 0, "capacity 1.0 exercises the fallback (" + ctag + ", " +
                                       std::to_string(fallbacks) + " fallbacks in the twin)");
        }
    }
  }
  void test(Report& r) override { run(r); }
  void grad(Report& r) override { run(r); }
  void perf() override {}
};

RouterConfig make(int E, int k, ScoreFn fn, int ng, int tg, GroupScore gs, bool norm, float rs, AuxMode aux,
                  float aux_coef, float z, int seq = 0) {
  RouterConfig c;
  c.E = E, c.topk = k, c.score = fn, c.n_group = ng, c.topk_group = tg, c.group_score = gs, c.norm_topk = norm;
  c.route_scale = rs, c.aux = aux, c.aux_coef = aux_coef, c.z_coef = z, c.seq_len = seq;
  return c;
}

std::vector<std::unique_ptr<OpCase>> router_cases() {
  using enum ScoreFn;
  using enum GroupScore;
  using enum AuxMode;
  std::vector<RouterSpec> specs = {
      // DeepSeek-V2 style: softmax, group max, no normalization, route_scale, global aux
      {"softmax_group_max", make(16, 4, Softmax, 4, 2, Max, false, 2.5f, Global, 0.01f, 0), 96, false},
      {"softmax_norm_z", make(8, 2, Softmax, 1, 1, Max, true, 1.0f, None, 0, 0.01f), 64, false},
      {"softmax_bias_seqwise", make(12, 3, Softmax, 1, 1, Max, false, 1.0f, SeqWise, 0.1f, 0, 16), 64, true},
      // DeepSeek-V3 style: sigmoid, group top-2 sum, normalized, route_scale, bias, seq-wise aux
      {"sigmoid_v3", make(16, 4, Sigmoid, 4, 2, Top2Sum, true, 2.5f, SeqWise, 0.01f, 0.001f, 32), 96, true},
      {"sigmoid_plain_global", make(8, 2, Sigmoid, 1, 1, Max, false, 1.0f, Global, 0.05f, 0), 64, false},
      {"sigmoid_group_nonorm_z", make(24, 3, Sigmoid, 4, 2, Top2Sum, false, 1.5f, Global, 0.02f, 0.01f), 64, true},
      {"sigmoid_group_max_norm", make(24, 5, Sigmoid, 6, 3, Max, true, 1.0f, None, 0, 0), 48, false},
      // ds_mini shape (also the perf case)
      {"ds_mini", make(64, 6, Sigmoid, 8, 4, Top2Sum, true, 2.5f, SeqWise, 0.001f, 0, 256), 2048, true},
      // edges
      {"k1", make(8, 1, Softmax, 1, 1, Max, true, 1.0f, Global, 0.05f, 0.01f), 32, false},
      {"k_eq_E", make(8, 8, Sigmoid, 2, 2, Top2Sum, true, 1.0f, Global, 0.05f, 0), 32, true},
      {"k_eq_E_softmax", make(8, 8, Softmax, 1, 1, Max, false, 1.0f, None, 0, 0), 16, false},
      {"n1", make(16, 3, Softmax, 4, 2, Max, true, 1.0f, Global, 0.05f, 0.01f), 1, false},
      {"n1_seqwise", make(16, 3, Sigmoid, 4, 2, Top2Sum, true, 1.0f, SeqWise, 0.05f, 0, 1), 1, true},
      {"skewed_one_expert", make(8, 2, Softmax, 1, 1, Max, true, 1.0f, Global, 0.05f, 0), 48, false, Data::Skewed},
      {"unpicked_expert", make(8, 2, Sigmoid, 2, 1, Top2Sum, true, 1.0f, Global, 0.05f, 0), 48, false, Data::Unpicked},
      {"ties", make(8, 2, Softmax, 1, 1, Max, true, 1.0f, None, 0, 0), 64, false, Data::Ties},
      {"ties_groups", make(16, 3, Sigmoid, 4, 2, Top2Sum, true, 1.0f, None, 0, 0), 64, false, Data::Ties},
  };
  std::vector<std::unique_ptr<OpCase>> v;
  uint64_t seed = 100;
  for (auto& s : specs) {
    s.seed = seed++;
    v.push_back(std::make_unique<RouterCase>(s));
  }
  v.push_back(std::make_unique<RouterBadInput>());
  v.push_back(std::make_unique<RouterHelpers>());
  v.push_back(std::make_unique<RouterSinkhorn>());
  return v;
}

}  // namespace
MT_REGISTER_OP_CASES(router_cases);
}  // namespace moetron::ops
