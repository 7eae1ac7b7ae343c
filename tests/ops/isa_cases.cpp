// isa_cases.cpp: op-harness cases (family isa) holding the AVX2 memory-bound passes to their portable twins in one
// process: each case runs an op with the ISA forced to Avx2 and to Scalar (set_isa_override) on the same inputs,
// at every MOETRON_ISA level (the override may lower the ISA below the environment's choice, never above the CPU).
//   isa/rope_*      rope_forward / rope_backward: bitwise (the same products and differences, no FMA)
//   isa/adamw_*     adamw_step, with and without decay, a tail of n mod 8: bitwise (adamw_step_ref's order)
//   isa/permute_*   bf16 gather (NaN, subnormals, ties included), permute backward, unpermute, unpermute
//                   backward's dyp (fp32 and bf16): bitwise; its dw (a reordered D-term dot): a derived bound
//   isa/norm_*      RMSNorm y, rstd, dx, dw: derived bounds (both paths are held to the fp64 reference by the
//                   norm family with bound b, so they differ by at most 2b)
//   isa/router_*    scores and z loss within 2x the router family's bounds; the top-k equal where no near tie
// A CPU without AVX2 (override clamps below Avx2) records a skipped check. Not the comparison with the fp64
// references (the other families do that, at every ISA level through ops.test.all.*), not a benchmark.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "harness.h"
#include "moetron/dtype.h"
#include "moetron/norm.h"
#include "moetron/optim.h"
#include "moetron/permute.h"
#include "moetron/rope.h"
#include "moetron/router.h"
#include "moetron/runtime.h"

using namespace moetron;
using namespace moetron::ops;

namespace {

constexpr double kU = 5.9604644775390625e-08;  // 2^-24

// Runs f with the ISA forced to isa; returns false (f not run) when the CPU lacks it. Restores the level.
template <class F>
bool at_isa(Isa isa, F&& f) {
  const Isa old = active_isa();
  set_isa_override(isa);
  const bool ok = active_isa() == isa;
  if (ok) f();
  set_isa_override(old);
  return ok;
}

bool same_bits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

// Both paths on the same inputs: f(true) at Avx2 first, then f(false) at Scalar. Records a skip when AVX2 is missing.
template <class F>
bool both(Report& r, F&& f) {
  if (!at_isa(Isa::Avx2, [&] { f(true); })) {
    r.check(true, "skipped: this CPU has no AVX2 + FMA");
    return false;
  }
  at_isa(Isa::Scalar, [&] { f(false); });
  return true;
}

struct IsaCase : OpCase {
  void grad(Report& r) override { r.check(true, "no gradient: a cross-ISA identity (see the op's own family)"); }
  void perf() override {}
};

struct RopeCase : IsaCase {
  int64_t B, T, H, R;
  RopeCase(int64_t B_, int64_t T_, int64_t H_, int64_t R_) : B(B_), T(T_), H(H_), R(R_) {
    name = "isa/rope_B" + std::to_string(B) + "_T" + std::to_string(T) + "_H" + std::to_string(H) + "_R" +
           std::to_string(R);
  }
  void test(Report& r) override {
    const int64_t ld_head = R + 3, ld_token = H * ld_head + 5;  // gaps: nothing outside the slices may change
    std::vector<float> cs(T * R / 2), sn(T * R / 2);
    rope_table(cs.data(), sn.data(), T, R, 10000.0f);
    const auto x0 = randn(B * T * ld_token, 31);
    std::vector<float> fa = x0, fs = x0, ba = x0, bs = x0;
    if (!both(r, [&](bool a) {
          rope_forward((a ? fa : fs).data(), B, T, H, ld_token, ld_head, 2, R, cs.data(), sn.data());
          rope_backward((a ? ba : bs).data(), B, T, H, ld_token, ld_head, 2, R, cs.data(), sn.data());
        }))
      return;
    r.check(same_bits(fa.data(), fs.data(), fa.size() * 4), "rope_forward avx2 == scalar, bitwise");
    r.check(same_bits(ba.data(), bs.data(), ba.size() * 4), "rope_backward avx2 == scalar, bitwise");
    r.check(fa != x0, "rope_forward changed the input");
  }
};

struct AdamWCase : IsaCase {
  int64_t n;
  explicit AdamWCase(int64_t n_) : n(n_) { name = "isa/adamw_n" + std::to_string(n); }
  void test(Report& r) override {
    const AdamWConfig c{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
    for (bool decay : {true, false}) {
      const auto p0 = randn(n, 41), m0 = randn(n, 42, 0.1f), g = randn(n, 44);
      auto v0 = randn(n, 43, 0.1f);
      for (auto& x : v0) x = x * x;
      std::vector<float> p[2] = {p0, p0}, m[2] = {m0, m0}, v[2] = {v0, v0};
      if (!both(r, [&](bool a) {
            const int i = a ? 0 : 1;
            for (int64_t step = 1; step <= 3; ++step)
              adamw_step(p[i].data(), m[i].data(), v[i].data(), g.data(), n, c, step, 0.5f, decay);
          }))
        return;
      const std::string d = decay ? " (decay)" : " (no decay)";
      r.check(same_bits(p[0].data(), p[1].data(), 4 * n), "p avx2 == scalar, bitwise, 3 steps" + d);
      r.check(same_bits(m[0].data(), m[1].data(), 4 * n), "m avx2 == scalar, bitwise" + d);
      r.check(same_bits(v[0].data(), v[1].data(), 4 * n), "v avx2 == scalar, bitwise" + d);
    }
  }
};

struct PermuteCase : IsaCase {
  int64_t N, D;
  int k = 2, E = 4;
  PermuteCase(int64_t N_, int64_t D_) : N(N_), D(D_) {
    name = "isa/permute_N" + std::to_string(N) + "_D" + std::to_string(D);
  }
  void test(Report& r) override {
    // Expert choice: token t's slots are (t mod E, (t + 1 + t / E) mod E), distinct; capacity 0.8 drops some.
    std::vector<int32_t> topk(N * k), counts(E, 0), off(E + 1), row_of(N * k), token_of(N * k), slot_of(N * k);
    for (int64_t t = 0; t < N; ++t) {
      topk[t * k] = int32_t(t % E);
      topk[t * k + 1] = int32_t((t % E + 1 + (t / E) % (E - 1)) % E);
    }
    for (int32_t e : topk) ++counts[e];
    moe_permute_plan(off.data(), row_of.data(), token_of.data(), slot_of.data(), topk.data(), counts.data(), N, k, E,
                     0.8);
    const int64_t R = off[E];
    auto x = randn(N * D, 51), dxp = randn(R * D, 52), yp = randn(R * D, 53), dy = randn(N * D, 54);
    const auto w = randu(N * k, 55, 0.05f, 1.0f);
    // Values whose bf16 rounding is delicate: NaNs (the quiet one; payloads that plain rounding would carry into
    // the exponent or turn into -0), +-inf, subnormals, exact ties to even, the largest finite.
    const float special[] = {NAN, std::bit_cast<float>(0x7fffffffu), std::bit_cast<float>(0x7f800001u), INFINITY,
                             -INFINITY, 1e-40f, -3e-39f, 1.00390625f, 1.01171875f, 3.4028235e38f};
    for (int i = 0; i < 10 && i < N * D; ++i) x[(i * 7) % (N * D)] = special[i];
    std::vector<bf16> xp16[2] = {std::vector<bf16>(R * D), std::vector<bf16>(R * D)};
    std::vector<bf16> dyp16[2] = {std::vector<bf16>(R * D), std::vector<bf16>(R * D)};
    std::vector<float> dx[2], y[2], dyp[2], dw[2], dw16[2];
    for (int i = 0; i < 2; ++i)
      dx[i].assign(N * D, -1), y[i].assign(N * D, -1), dyp[i].assign(R * D, -1), dw[i].assign(N * k, -1),
          dw16[i].assign(N * k, -1);
    if (!both(r, [&](bool a) {
          const int i = a ? 0 : 1;
          moe_permute(xp16[i].data(), x.data(), token_of.data(), R, N, D);
          moe_permute_backward(dx[i].data(), dxp.data(), row_of.data(), N, k, R, D);
          moe_unpermute(y[i].data(), yp.data(), row_of.data(), w.data(), N, k, R, D);
          moe_unpermute_backward(dyp[i].data(), dw[i].data(), dy.data(), yp.data(), row_of.data(), token_of.data(),
                                 slot_of.data(), w.data(), N, k, R, D);
          moe_unpermute_backward(dyp16[i].data(), dw16[i].data(), dy.data(), yp.data(), row_of.data(),
                                 token_of.data(), slot_of.data(), w.data(), N, k, R, D);
        }))
      return;
    r.check(R < N * k, "the plan drops some slots (row_of = -1 exercised)", "R=" + std::to_string(R));
    r.check(same_bits(xp16[0].data(), xp16[1].data(), 2 * R * D), "moe_permute(bf16) avx2 == scalar, bitwise");
    r.check(same_bits(dx[0].data(), dx[1].data(), 4 * N * D), "moe_permute_backward avx2 == scalar, bitwise");
    r.check(same_bits(y[0].data(), y[1].data(), 4 * N * D), "moe_unpermute avx2 == scalar, bitwise");
    r.check(same_bits(dyp[0].data(), dyp[1].data(), 4 * R * D), "unpermute_backward dyp avx2 == scalar, bitwise");
    r.check(same_bits(dyp16[0].data(), dyp16[1].data(), 2 * R * D), "unpermute_backward dyp16 avx2 == scalar, bitwise");
    // dw = dot(dy[t], yp[r]) over D terms, summed in different orders: each within (D - 1) u sum|dy yp| of the
    // exact dot (first-order), so they differ by <= 2 (D - 1) u sum|.|; bound 2 (D + 8) u D max|dy| max|yp|, as
    // the permute family's (D + 8) u mag, times 2 for two paths.
    double mag = 0;
    for (float v : dy) mag = std::max(mag, double(std::fabs(v)));
    double ymag = 0;
    for (float v : yp) ymag = std::max(ymag, double(std::fabs(v)));
    const double atol = 2.0 * double(D + 8) * kU * double(D) * mag * ymag;
    r.compare("unpermute_backward dw avx2 vs scalar", dw[0].data(), dw[1].data(), N * k, atol, 0);
    r.compare("unpermute_backward(bf16) dw avx2 vs scalar", dw16[0].data(), dw16[1].data(), N * k, atol, 0);
  }
};

struct NormCase : IsaCase {
  int64_t N, C;
  NormCase(int64_t N_, int64_t C_) : N(N_), C(C_) {
    name = "isa/norm_N" + std::to_string(N) + "_C" + std::to_string(C);
  }
  void test(Report& r) override {
    auto x = randn(N * C, 61), w = randn(C, 62, 0.3f), dy = randn(N * C, 63);
    for (auto& v : w) v += 1.0f;
    std::vector<float> y[2], rs[2], dx[2], dw[2];
    std::vector<bf16> y16[2];
    for (int i = 0; i < 2; ++i)
      y[i].assign(N * C, 0), rs[i].assign(N, 0), dx[i].assign(N * C, 0), dw[i].assign(C, 0.5f),
          y16[i].assign(N * C, bf16{});
    if (!both(r, [&](bool a) {
          const int i = a ? 0 : 1;
          rmsnorm_forward(y[i].data(), y16[i].data(), rs[i].data(), x.data(), w.data(), N, C, 1e-6f);
          rmsnorm_backward(dx[i].data(), dw[i].data(), dy.data(), x.data(), w.data(), rs[0].data(), N, C);
        }))
      return;
    // The backward of both paths takes the AVX2 rstd (so dx and dw compare the backward alone).
    // The norm family's bound rt = (C / 16 + 16) u (relative, y and rstd) holds for both paths; 2 rt between them.
    const double rt = (double(C) / 16 + 16) * kU;
    r.compare("y avx2 vs scalar", y[0].data(), y[1].data(), N * C, 0, 2 * rt);
    r.compare("rstd avx2 vs scalar", rs[0].data(), rs[1].data(), N, 0, 2 * rt);
    // dx: the family's absolute bound rt * max r (|w dy| + |xhat dot|), twice; dw: (N / nblk + nblk + 16) u
    // max column sum |dy xhat|, twice. Magnitudes taken from the scalar outputs (first order).
    double sdx = 0, smax = 0.5;
    std::vector<double> col(C, 0.0);
    for (int64_t n = 0; n < N; ++n) {
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += double(w[c]) * dy[n * C + c] * x[n * C + c] * rs[1][n];
      dot /= double(C);
      for (int64_t c = 0; c < C; ++c) {
        const double xh = double(x[n * C + c]) * rs[1][n];
        sdx = std::max(sdx, rs[1][n] * (std::fabs(double(w[c]) * dy[n * C + c]) + std::fabs(xh * dot)));
        col[c] += std::fabs(dy[n * C + c] * xh);
      }
    }
    for (double v : col) smax = std::max(smax, v);
    const int64_t nblk = std::max<int64_t>(1, std::min<int64_t>(64, (N + 15) / 16));
    r.compare("dx avx2 vs scalar", dx[0].data(), dx[1].data(), N * C, 2 * rt * sdx, 0);
    r.compare("dw avx2 vs scalar", dw[0].data(), dw[1].data(), C, 2 * (double(N) / nblk + nblk + 16) * kU * smax, 0);
    // y16 rounds y: equal where y is, else one bf16 ulp apart at most.
    int64_t far = 0;
    for (int64_t i = 0; i < N * C; ++i) far += std::abs(int(y16[0][i].bits) - int(y16[1][i].bits)) > 1;
    r.check(far == 0, "y16 avx2 vs scalar within one bf16 ulp", std::to_string(far) + " elements further apart");
  }
};

struct RouterCase : IsaCase {
  int64_t N;
  int E, k, groups;
  bool softmax;
  RouterCase(int64_t N_, int E_, int k_, int groups_, bool softmax_)
      : N(N_), E(E_), k(k_), groups(groups_), softmax(softmax_) {
    name = "isa/router_" + std::string(softmax ? "softmax" : "sigmoid") + "_E" + std::to_string(E) + "_k" +
           std::to_string(k) + "_g" + std::to_string(groups);
  }
  void test(Report& r) override {
    RouterConfig c;
    c.E = E, c.topk = k, c.score = softmax ? ScoreFn::Softmax : ScoreFn::Sigmoid;
    c.n_group = groups, c.topk_group = groups > 1 ? groups / 2 : 1, c.z_coef = 1e-3f;
    // Logits spaced 0.05 apart per token (a shuffled ladder): no two scores within 5% of each other, far beyond
    // either path's rounding, so the selections must agree exactly. One token at -95 .. -92 for the saturated
    // sigmoid (exp overflows) and the softmax's exact-0 tail.
    // Sigmoid: a bias of exact quarters (0, 0.25, 0.5) exercises the biased selection; softmax: none (its scores,
    // ~1/E, would sit within a bias step of each other).
    std::vector<float> logits(N * E), bias(E);
    for (int e = 0; e < E; ++e) bias[e] = 0.25f * float(e % 3);
    for (int64_t n = 0; n < N; ++n)
      for (int e = 0; e < E; ++e) logits[n * E + e] = 0.05f * float((e * 37 + n * 11) % E) - 1.5f;
    for (int e = 0; e < E; ++e) logits[e] = -95.0f + 0.05f * float(e);
    std::vector<int32_t> idx[2], cnt[2];
    std::vector<float> wt[2], s[2];
    RouterLosses L[2];
    std::vector<char> ws(router_workspace_bytes(c, N));
    for (int i = 0; i < 2; ++i)
      idx[i].assign(N * k, 0), cnt[i].assign(E, 0), wt[i].assign(N * k, 0), s[i].assign(N * E, 0);
    if (!both(r, [&](bool a) {
          const int i = a ? 0 : 1;
          router_forward(idx[i].data(), wt[i].data(), cnt[i].data(), s[i].data(), &L[i], logits.data(),
                         softmax ? nullptr : bias.data(), c,
                         N, ws.data());
        }))
      return;
    // The router family's bounds: softmax scores within (E + 4) u of exact, sigmoid 4 u; twice between paths.
    const double rtol_s = softmax ? 2.0 * (E + 4) * kU : 8 * kU;
    r.compare("scores avx2 vs scalar", s[0].data(), s[1].data(), N * E, 1e-37, 2 * rtol_s);
    r.compare("topk_idx avx2 == scalar (no near ties)", idx[0].data(), idx[1].data(), N * k);
    r.compare("counts avx2 == scalar", cnt[0].data(), cnt[1].data(), E);
    r.compare("topk_w avx2 vs scalar", wt[0].data(), wt[1].data(), N * k, 1e-37, 2 * rtol_s + 2.0 * (k + 3) * kU);
    // z loss: AVX2 fp32 logsumexp within 2 (E + 8) u of the fp64 value (router family), scalar 2 u.
    double za = L[0].z, zs = L[1].z;
    r.compare("z loss avx2 vs scalar", &za, &zs, 1, 1e-30, 4.0 * (E + 8) * kU + 2 * kU);
  }
};

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  v.push_back(std::make_unique<RopeCase>(2, 5, 3, 22));   // half 11: one vector and a 3-lane tail
  v.push_back(std::make_unique<RopeCase>(1, 9, 2, 128));  // half 64: whole vectors only
  v.push_back(std::make_unique<RopeCase>(1, 3, 4, 2));    // half 1: the tail alone
  v.push_back(std::make_unique<AdamWCase>(1037));          // 8 x 129 + 5
  v.push_back(std::make_unique<AdamWCase>(100003));        // the parallel path, 4096-element items, tail 3
  v.push_back(std::make_unique<PermuteCase>(13, 37));      // 32 + 5: the 4-vector block and a tail
  v.push_back(std::make_unique<PermuteCase>(40, 64));
  v.push_back(std::make_unique<PermuteCase>(9, 6));        // the tail alone
  v.push_back(std::make_unique<NormCase>(37, 77));         // 64 + 13: every loop and both tails
  v.push_back(std::make_unique<NormCase>(100, 512));
  v.push_back(std::make_unique<NormCase>(3, 5));
  v.push_back(std::make_unique<RouterCase>(33, 61, 6, 1, true));   // E mod 8 = 5
  v.push_back(std::make_unique<RouterCase>(33, 61, 6, 1, false));
  v.push_back(std::make_unique<RouterCase>(40, 64, 8, 8, false));  // group-limited (DeepSeek-V3 style)
  v.push_back(std::make_unique<RouterCase>(17, 160, 6, 8, true));
  return v;
}

MT_REGISTER_OP_CASES(make_cases);

}  // namespace
