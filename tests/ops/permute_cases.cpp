// permute_cases.cpp: op-harness cases for the MoE permutation plan and permute / unpermute (family "permute").
//   test: the plan (integer) equals moe_permute_plan_ref exactly; the data kernels vs their *_ref twins:
//         pure copies and single products exactly, the slot-order sums within k roundings, the dw dot products
//         within the bound of a D-term fp32 dot product.
//   grad: the references in fp64 vs central differences (the ops are linear / bilinear, so smooth).
// Not a benchmark: bench/bench_router.cpp has the GB/s figures.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "harness.h"
#include "moetron/check.h"
#include "moetron/permute.h"
#include "moetron/router.h"

namespace moetron::ops {
namespace {

constexpr double kU = 5.9604644775390625e-08;  // 2^-24

enum class Route { Random, Skewed, Unpicked };

struct PermuteSpec {
  std::string variant;
  int64_t N;
  int k, E;
  int64_t D;
  double cf = 0;
  Route route = Route::Random;
  uint64_t seed = 1;
  bool probs = false;   // drop by routing weight (model.drop_policy = "probs") instead of by position
  bool tied = false;    // weights on a coarse grid (many ties: the earlier (t, s) must win)
};

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

class PermuteCase : public OpCase {
 public:
  explicit PermuteCase(PermuteSpec sp) : sp_(std::move(sp)) {
    name = "permute/" + sp_.variant;
    fd_eps = 1e-3;
    grad_tol = 1e-8;
    const int64_t N = sp_.N, k = sp_.k, E = sp_.E, D = sp_.D;
    // Routing: the top-k of random scores (distinct experts per token), optionally skewed.
    std::vector<float> sc = randn(N * E, sp_.seed, 1.0f);
    for (int64_t n = 0; n < N; ++n) {
      if (sp_.route == Route::Skewed) sc[n * E + 2] += 100.0f;
      if (sp_.route == Route::Unpicked) sc[n * E + E - 1] -= 100.0f;
    }
    RouterConfig c;
    c.E = sp_.E, c.topk = sp_.k;
    idx_.resize(N * k);
    counts_.assign(E, 0);
    for (int64_t n = 0; n < N; ++n) router_select_ref<float>(idx_.data() + n * k, sc.data() + n * E, nullptr, c);
    for (int32_t e : idx_) ++counts_[e];
    // Plan (the reference one; the optimized plan is compared against it in test()).
    offsets_.resize(E + 1);
    row_of_.resize(N * k);
    token_of_.resize(N * k);
    slot_of_.resize(N * k);
    w_ = randu(N * k, sp_.seed + 5, 0.05f, 1.0f);
    if (sp_.tied)
      for (float& x : w_) x = std::round(x * 4.0f) / 4.0f;
    drop_w_ = sp_.probs ? w_.data() : nullptr;
    dropped_ = moe_permute_plan_ref(offsets_.data(), row_of_.data(), token_of_.data(), slot_of_.data(), idx_.data(),
                                    counts_.data(), N, sp_.k, sp_.E, sp_.cf, drop_w_);
    R_ = offsets_[E];
    x_ = randn(N * D, sp_.seed + 1);
    yp_ = randn(R_ * D, sp_.seed + 2);
    dxp_ = randn(R_ * D, sp_.seed + 3);
    dy_ = randn(N * D, sp_.seed + 4);
    bytes = double(R_) * D * 4 * 2;  // perf: moe_permute fp32 (read + write)
  }

  void test(Report& r) override {
    const int64_t N = sp_.N, k = sp_.k, E = sp_.E, D = sp_.D, R = R_;
    // Plan: exact.
    std::vector<int32_t> off(E + 1), row_of(N * k), token_of(N * k), slot_of(N * k);
    int64_t dropped = moe_permute_plan(off.data(), row_of.data(), token_of.data(), slot_of.data(), idx_.data(),
                                       counts_.data(), N, sp_.k, sp_.E, sp_.cf, drop_w_);
    r.compare("plan offsets", off.data(), offsets_.data(), E + 1);
    r.compare("plan row_of", row_of.data(), row_of_.data(), N * k);
    r.compare("plan token_of", token_of.data(), token_of_.data(), N * k);
    r.compare("plan slot_of", slot_of.data(), slot_of_.data(), N * k);
    r.check(dropped == dropped_ && dropped == N * k - R, "plan dropped count",
            std::to_string(dropped) + " (ref " + std::to_string(dropped_) + ", N*k-R " + std::to_string(N * k - R) + ")");
    {  // invariants: rows ordered by (expert, token, slot); each kept (t, s) maps to a row holding it
      bool ok = true;
      for (int64_t t = 0; t < N; ++t)
        for (int s = 0; s < k; ++s) {
          int32_t rr = row_of[t * k + s];
          if (rr >= 0) ok &= token_of[rr] == t && slot_of[rr] == s && rr >= off[idx_[t * k + s]] &&
                             rr < off[idx_[t * k + s] + 1];
        }
      for (int64_t rr = 1; rr < R; ++rr) {
        // within an expert the source (token, slot) strictly increases
        int e_prev = idx_[token_of[rr - 1] * k + slot_of[rr - 1]], e_cur = idx_[token_of[rr] * k + slot_of[rr]];
        int64_t a = int64_t(token_of[rr - 1]) * k + slot_of[rr - 1], b = int64_t(token_of[rr]) * k + slot_of[rr];
        ok &= e_prev < e_cur || (e_prev == e_cur && a < b);
      }
      int64_t C = moe_capacity(sp_.cf, N, sp_.k, sp_.E);
      for (int e = 0; e < E; ++e) ok &= C == 0 || off[e + 1] - off[e] <= C;
      r.check(ok, "plan invariants (stable expert-major order, capacity respected)");
    }
    if (sp_.route == Route::Skewed && sp_.cf > 0) r.check(dropped > 0, "skewed routing with capacity drops tokens");
    if (sp_.probs && sp_.cf > 0) {  // by probability: no kept weight of an expert is below one it dropped
      std::vector<float> min_kept(size_t(E), 2.0f), max_dropped(size_t(E), -1.0f);
      for (int64_t i = 0; i < N * k; ++i) {
        float& m = row_of[i] >= 0 ? min_kept[size_t(idx_[i])] : max_dropped[size_t(idx_[i])];
        m = row_of[i] >= 0 ? std::min(m, w_[i]) : std::max(m, w_[i]);
      }
      bool ok = dropped > 0;
      for (int e = 0; e < E; ++e) ok &= max_dropped[size_t(e)] <= min_kept[size_t(e)];
      r.check(ok, "drop by probability keeps each expert's largest weights (and drops some)");
    }
    if (sp_.route == Route::Unpicked)
      r.check(counts_[E - 1] == 0 && off[E - 1] == off[E], "unpicked expert has an empty range");

    // permute fp32 and bf16: exact (a copy; a round-to-nearest-even conversion of normal numbers)
    {
      std::vector<float> xp(R * D), xp_r(R * D);
      moe_permute(xp.data(), x_.data(), token_of_.data(), R, N, D);
      moe_permute_ref(xp_r.data(), x_.data(), token_of_.data(), R, D);
      r.compare("permute fp32", xp.data(), xp_r.data(), R * D, 0, 0);
      std::vector<bf16> xb(R * D), xb_r(R * D);
      moe_permute(xb.data(), x_.data(), token_of_.data(), R, N, D);
      moe_permute_ref(xb_r.data(), x_.data(), token_of_.data(), R, D);
      std::vector<float> a(R * D), b(R * D);
      for (int64_t i = 0; i < R * D; ++i) a[i] = from_bf16(xb[i]), b[i] = from_bf16(xb_r[i]);
      r.compare("permute bf16", a.data(), b.data(), R * D, 0, 0);
    }
    // permute backward: a sum of <= k terms in slot order, as the reference: <= k roundings of max|dxp|.
    {
      std::vector<float> dx(N * D), dx_r(N * D);
      moe_permute_backward(dx.data(), dxp_.data(), row_of_.data(), N, sp_.k, R, D);
      moe_permute_backward_ref(dx_r.data(), dxp_.data(), row_of_.data(), N, sp_.k, D);
      r.compare("permute_backward dx", dx.data(), dx_r.data(), N * D, k * kU * k * max_abs(dxp_), k * kU);
    }
    // unpermute: sum of <= k rounded products: <= 2k roundings of max|w| max|yp| * k.
    {
      std::vector<float> y(N * D), y_r(N * D);
      moe_unpermute(y.data(), yp_.data(), row_of_.data(), w_.data(), N, sp_.k, R, D);
      moe_unpermute_ref(y_r.data(), yp_.data(), row_of_.data(), w_.data(), N, sp_.k, D);
      r.compare("unpermute y", y.data(), y_r.data(), N * D, 2 * k * kU * k * max_abs(w_) * max_abs(yp_), 2 * k * kU);
    }
    // unpermute backward: dyp is one product (exact vs the reference); dw is a D-term dot product,
    // compared with the fp64 reference: |err| <= (D/64 + 8) u * sum|dy * yp| (4 x 16-lane fp32 accumulators,
    // then a fixed tree); the scalar path sums sequentially: D u * sum|dy yp|; we allow the larger.
    {
      std::vector<float> dyp(R * D, NAN), dyp_r(R * D, NAN), dw(N * k), dw_r(N * k);
      moe_unpermute_backward(dyp.data(), dw.data(), dy_.data(), yp_.data(), row_of_.data(), token_of_.data(), slot_of_.data(), w_.data(), N, sp_.k, R, D);
      moe_unpermute_backward_ref(dyp_r.data(), dw_r.data(), dy_.data(), yp_.data(), row_of_.data(), w_.data(), N,
                                 sp_.k, D);
      r.compare("unpermute_backward dyp", dyp.data(), dyp_r.data(), R * D, 0, 0);
      std::vector<bf16> dyb(R * D), dyb_r(R * D);
      std::vector<float> dw2(N * k);
      moe_unpermute_backward(dyb.data(), dw2.data(), dy_.data(), yp_.data(), row_of_.data(), token_of_.data(), slot_of_.data(), w_.data(), N, sp_.k, R, D);
      moe_unpermute_backward_ref(dyb_r.data(), dw_r.data(), dy_.data(), yp_.data(), row_of_.data(), w_.data(), N,
                                 sp_.k, D);
      std::vector<float> a(R * D), b(R * D);
      for (int64_t i = 0; i < R * D; ++i) a[i] = from_bf16(dyb[i]), b[i] = from_bf16(dyb_r[i]);
      r.compare("unpermute_backward dyp (bf16)", a.data(), b.data(), R * D, 0, 0);
      r.compare("unpermute_backward dw (bf16 dyp variant) == fp32 variant", dw2.data(), dw.data(), N * k, 0, 0);
      std::vector<double> dwd(N * k), dypd(R * D), dyd = to_f64(dy_), ypd = to_f64(yp_), wd = to_f64(w_);
      moe_unpermute_backward_ref(dypd.data(), dwd.data(), dyd.data(), ypd.data(), row_of_.data(), wd.data(), N,
                                 sp_.k, D);
      double mag = 0;  // max over (t, s) of sum_d |dy yp|
      for (int64_t t = 0; t < N; ++t)
        for (int s = 0; s < k; ++s) {
          int32_t rr = row_of_[t * k + s];
          if (rr < 0) continue;
          double m = 0;
          for (int64_t d = 0; d < D; ++d) m += std::fabs(dyd[t * D + d] * ypd[int64_t(rr) * D + d]);
          mag = std::max(mag, m);
        }
      std::vector<double> dwf(dw.begin(), dw.end());
      r.compare("unpermute_backward dw", dwf.data(), dwd.data(), N * k, double(D + 8) * kU * mag, 0);
      bool zero_dropped = true;
      for (int64_t i = 0; i < N * k; ++i) zero_dropped &= row_of_[i] >= 0 || dw[i] == 0.0f;
      r.check(zero_dropped, "dw is 0 for dropped slots");
    }
    // Determinism: bitwise the same outputs with 1 and 3 threads (uneven static splits).
    if (R * D >= (int64_t(1) << 20)) {
      const int saved = omp_get_max_threads();
      auto run = [&](int threads, std::vector<float>& y, std::vector<float>& dx, std::vector<float>& dw) {
        omp_set_num_threads(threads);
        std::vector<float> dyp(R * D);
        moe_unpermute(y.data(), yp_.data(), row_of_.data(), w_.data(), N, sp_.k, R, D);
        moe_permute_backward(dx.data(), dxp_.data(), row_of_.data(), N, sp_.k, R, D);
        moe_unpermute_backward(dyp.data(), dw.data(), dy_.data(), yp_.data(), row_of_.data(), token_of_.data(),
                               slot_of_.data(), w_.data(), N, sp_.k, R, D);
      };
      std::vector<float> y1(N * D), y3(N * D), x1(N * D), x3(N * D), w1(N * k), w3(N * k);
      run(1, y1, x1, w1);
      run(3, y3, x3, w3);
      omp_set_num_threads(saved);
      r.check(std::memcmp(y1.data(), y3.data(), y1.size() * 4) == 0 && std::memcmp(x1.data(), x3.data(), x1.size() * 4) == 0 &&
                  std::memcmp(w1.data(), w3.data(), w1.size() * 4) == 0,
              "bitwise identical with 1 and 3 threads (y, dx, dw)");
    }
  }

  void grad(Report& r) override {
    const int64_t N = sp_.N, k = sp_.k, D = sp_.D, R = R_;
    // Each loss evaluation touches the whole buffer: few coordinates for the big shape (the small cases cover
    // every code path; linear ops have no coordinate-dependent behaviour besides dropped rows).
    const int checks = R * D > (int64_t(1) << 20) ? 6 : 48;
    // permute: loss = sum G . xp(x)
    {
      std::vector<double> x = to_f64(x_), G = to_f64(dxp_), xp(R * D), dx(N * D);
      moe_permute_backward_ref(dx.data(), G.data(), row_of_.data(), N, sp_.k, D);
      auto loss = [&]() {
        moe_permute_ref(xp.data(), x.data(), token_of_.data(), R, D);
        return dot(G.data(), xp.data(), R * D);
      };
      r.fd_check("permute: dx", x.data(), N * D, dx.data(), loss, fd_eps, grad_tol, checks);
    }
    // unpermute: loss = sum H . y(yp, w)
    {
      std::vector<double> yp = to_f64(yp_), w = to_f64(w_), H = to_f64(dy_), y(N * D), dyp(R * D), dw(N * k);
      moe_unpermute_backward_ref(dyp.data(), dw.data(), H.data(), yp.data(), row_of_.data(), w.data(), N, sp_.k, D);
      auto loss = [&]() {
        moe_unpermute_ref(y.data(), yp.data(), row_of_.data(), w.data(), N, sp_.k, D);
        return dot(H.data(), y.data(), N * D);
      };
      r.fd_check("unpermute: dyp", yp.data(), R * D, dyp.data(), loss, fd_eps, grad_tol, checks);
      r.fd_check("unpermute: dw", w.data(), N * k, dw.data(), loss, fd_eps, grad_tol, checks);
    }
  }

  void perf() override {
    if (pxp_.empty()) pxp_.resize(R_ * sp_.D);
    moe_permute(pxp_.data(), x_.data(), token_of_.data(), R_, sp_.N, sp_.D);
  }

 private:
  PermuteSpec sp_;
  std::vector<int32_t> idx_, counts_, offsets_, row_of_, token_of_, slot_of_;
  int64_t dropped_ = 0, R_ = 0;
  std::vector<float> x_, yp_, dxp_, dy_, w_, pxp_;
  const float* drop_w_ = nullptr;  // w_ when the case drops by probability
};

class PermuteBadInput : public OpCase {
 public:
  PermuteBadInput() { name = "permute/bad_input"; }
  void run(Report& r) {
    const int64_t N = 4;
    const int k = 2, E = 4, D = 8;
    std::vector<int32_t> idx = {0, 1, 1, 2, 2, 3, 3, 0}, counts = {2, 2, 2, 2};
    std::vector<int32_t> off(E + 1), row_of(N * k), token_of(N * k);
    std::vector<float> x(N * D), xp(N * k * D), w(N * k, 1.0f);
    r.expect_throw("counts disagree with topk_idx", [&] {
      std::vector<int32_t> c2 = {3, 1, 2, 2};
      moe_permute_plan(off.data(), row_of.data(), token_of.data(), nullptr, idx.data(), c2.data(), N, k, E, 0);
    });
    r.expect_throw("topk_idx out of range", [&] {
      std::vector<int32_t> i2 = idx;
      i2[3] = E;
      moe_permute_plan(off.data(), row_of.data(), token_of.data(), nullptr, i2.data(), counts.data(), N, k, E, 0);
    });
    r.expect_throw("negative capacity factor", [&] {
      moe_permute_plan(off.data(), row_of.data(), token_of.data(), nullptr, idx.data(), counts.data(), N, k, E, -1);
    });
    int64_t dropped =
        moe_permute_plan(off.data(), row_of.data(), token_of.data(), nullptr, idx.data(), counts.data(), N, k, E, 0);
    r.check(dropped == 0 && off[E] == N * k, "valid plan");
    r.expect_throw("token_of out of range", [&] {
      std::vector<int32_t> t2 = token_of;
      t2[5] = int32_t(N);
      moe_permute(xp.data(), x.data(), t2.data(), N * k, N, D);
    });
    r.expect_throw("row_of out of range", [&] {
      std::vector<int32_t> r2 = row_of;
      r2[1] = int32_t(N * k);
      moe_unpermute(x.data(), xp.data(), r2.data(), w.data(), N, k, N * k, D);
    });
    r.expect_throw("slot_of out of range", [&] {
      std::vector<int32_t> s2(N * k, 0), dyp(N * k * D);
      s2[3] = k;
      std::vector<float> dypf(N * k * D), dw(N * k);
      moe_unpermute_backward(dypf.data(), dw.data(), x.data(), xp.data(), row_of.data(), token_of.data(), s2.data(),
                             w.data(), N, k, N * k, D);
    });
    r.expect_throw("R > N*k", [&] { moe_permute_backward(x.data(), xp.data(), row_of.data(), N, k, N * k + 1, D); });
    r.expect_throw("k = 0", [&] { moe_unpermute(x.data(), xp.data(), row_of.data(), w.data(), N, 0, 0, D); });
    r.check(moe_capacity(1.0, 2048, 6, 64) == 192 && moe_capacity(1.25, 2048, 6, 64) == 240 &&
                moe_capacity(0.1, 640, 1, 64) == 1 && moe_capacity(1.1, 100, 1, 8) == 14 &&
                moe_capacity(0, 100, 2, 8) == 0,
            "moe_capacity = ceil(cf N k / E)");
  }
  void test(Report& r) override { run(r); }
  void grad(Report& r) override { run(r); }
  void perf() override {}
};

std::vector<std::unique_ptr<OpCase>> permute_cases() {
  std::vector<PermuteSpec> specs = {
      {"dropless", 64, 3, 8, 100, 0},
      {"capacity_skewed", 64, 2, 8, 37, 1.0, Route::Skewed},
      {"capacity_random", 96, 4, 16, 64, 1.25},
      {"capacity_tight", 96, 2, 8, 48, 0.5},
      {"all_to_one_expert_capacity", 50, 1, 5, 40, 1.0, Route::Skewed},
      {"k1", 33, 1, 4, 16, 0},
      {"k_eq_E", 20, 4, 4, 20, 0},
      {"n1", 1, 2, 4, 24, 0},
      {"unpicked_expert", 40, 2, 8, 32, 0, Route::Unpicked},
      {"ds_mini", 2048, 6, 64, 512, 0},
      {.variant = "capacity_probs_skewed", .N = 64, .k = 2, .E = 8, .D = 37, .cf = 1.0, .route = Route::Skewed,
       .probs = true},
      {.variant = "capacity_probs_tight", .N = 96, .k = 2, .E = 8, .D = 48, .cf = 0.5, .probs = true},
      {.variant = "capacity_probs_tied", .N = 96, .k = 4, .E = 16, .D = 16, .cf = 0.75, .probs = true, .tied = true},
  };
  std::vector<std::unique_ptr<OpCase>> v;
  uint64_t seed = 300;
  for (auto& s : specs) {
    s.seed = seed++;
    v.push_back(std::make_unique<PermuteCase>(s));
  }
  v.push_back(std::make_unique<PermuteBadInput>());
  return v;
}

}  // namespace
MT_REGISTER_OP_CASES(permute_cases);
}  // namespace moetron::ops
