// grouped_gemm_cases.cpp: op-harness cases for the grouped (MoE expert) GEMM: forward, dgrad and wgrad
// (=, +=), bf16 and fp32, against the naive twins grouped_gemm_*_ref, on uniform, skewed, zero-size-group,
// single-expert and odd-shaped groups (bf16 on an AMX CPU: the AMX tile kernel, and the AVX-512 one beside it);
// determinism across thread counts; fp32 results bitwise equal to the
// batch-invariant dense gemm_f32 run per expert; bad input throws.
// Grad mode checks the three reference ops against each other as vector-Jacobian products, by finite
// differences in double. Not a benchmark: see bench/bench_grouped_gemm.cpp.
//
// Tolerances (docs/kernels/gemm.md). With inputs rounded to bf16 once (so the reference sees the same values)
// the only error left is fp32 accumulation over n terms: |err| <= gamma_n * sum_k |a_k||b_k|, gamma_n = n*2^-24
// / (1 - n*2^-24), checked element by element. Against the unrounded inputs, bf16 rounding of a and b adds
// (2*2^-8 + 2^-16) * sum |a_k||b_k| (worst case; typical is ~sqrt(n) times smaller).
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "harness.h"
#include "moetron/check.h"
#include "moetron/grouped_gemm.h"
#include "moetron/rng.h"
#include "moetron/runtime.h"

namespace moetron::ops {
namespace {

struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) : p(std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64))) {}
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

double gamma(int64_t n) {
  const double u = std::ldexp(1.0, -24);
  return n * u / (1 - n * u);
}
const double kBf16Round = 2 * std::ldexp(1.0, -8) + std::ldexp(1.0, -16);  // bf16 unit roundoff u = 2^-8

// Passes when |got_i - want_i| <= bound_i for all i (NaN fails). Reports the worst element.
void compare_bound(Report& r, const std::string& what, const float* got, const double* want, const double* bound,
                   int64_t n) {
  double worst = 0;
  int64_t wi = -1, bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    double err = std::fabs(double(got[i]) - want[i]);
    double ratio = err == 0 ? 0 : (bound[i] > 0 ? err / bound[i] : INFINITY);
    if (!(ratio <= 1.0)) ++bad;
    if (wi < 0 || !(ratio <= worst)) worst = ratio, wi = i;
  }
  std::ostringstream os;
  os << "n=" << n;
  if (wi >= 0)
    os << " worst at " << wi << " (got " << got[wi] << ", want " << want[wi] << ", bound " << bound[wi] << ", " << worst
       << "x of bound)";
  if (bad) os << " violations=" << bad;
  r.check(bad == 0, what, os.str());
}

std::vector<double> absd(const std::vector<double>& v) {
  std::vector<double> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = std::fabs(v[i]);
  return o;
}
std::vector<double> round_bf16_d(const std::vector<float>& v) {
  std::vector<double> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = round_bf16(v[i]);
  return o;
}
std::vector<bf16> to_bf16_vec(const std::vector<float>& v) {
  std::vector<bf16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = to_bf16(v[i]);
  return o;
}
template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

int64_t sum_counts(const std::vector<int32_t>& c) {
  int64_t s = 0;
  for (int32_t v : c) s += v;
  return s;
}

struct GroupedCase : OpCase {
  std::vector<int32_t> counts;
  int64_t E, M, K, N;
  GemmPrec prec;
  bool bad_inputs = false;  // also check that bad inputs throw

  GroupedCase(std::string variant, std::vector<int32_t> c, int64_t k, int64_t n, GemmPrec p)
      : counts(std::move(c)), K(k), N(n), prec(p) {
    name = "grouped_gemm/" + variant + (p == GemmPrec::BF16 ? "_bf16" : "_f32");
    E = int64_t(counts.size());
    M = sum_counts(counts);
    fd_eps = 1e-3;  // the ops are bilinear: central differences are exact up to rounding
    grad_tol = 1e-7;
    flops = 2.0 * double(M) * double(K) * double(N);
  }

  size_t ws_bytes(GroupedOp op, int threads = 0) const {
    return grouped_gemm_workspace_bytes(op, prec, E, M, K, N, threads);
  }

  // Runs the three optimized ops at the current thread count.
  struct Out {
    std::vector<float> Y, dX, dW, dWacc;
    std::vector<bf16> Yb, dXb;
  };
  // ws_threads > 0: workspace sized for that many threads (fewer slots than threads is allowed).
  Out run(const std::vector<float>& X, const std::vector<float>& W, const std::vector<float>& dY,
          const std::vector<float>& dW0, int ws_threads = 0) const {
    Out o;
    o.Y.assign(M * N, NAN);
    o.dX.assign(M * K, NAN);
    o.dW.assign(E * K * N, NAN);
    o.dWacc = dW0;
    o.Yb.assign(M * N, bf16{0xffff});
    o.dXb.assign(M * K, bf16{0xffff});
    Buf pf(grouped_packed_bytes(GroupedPackKind::Fwd, prec, E, K, N));
    Buf pd(grouped_packed_bytes(GroupedPackKind::Dgrad, prec, E, K, N));
    auto Wf = grouped_pack_weights(pf.p, W.data(), E, K, N, prec, GroupedPackKind::Fwd);
    auto Wd = grouped_pack_weights(pd.p, W.data(), E, K, N, prec, GroupedPackKind::Dgrad);
    const size_t nf = ws_bytes(GroupedOp::Fwd, ws_threads), nd = ws_bytes(GroupedOp::Dgrad, ws_threads),
                 nw = ws_bytes(GroupedOp::Wgrad, ws_threads);
    Buf wsf(nf), wsd(nd), wsw(nw);
    if (prec == GemmPrec::BF16) {
      auto Xb = to_bf16_vec(X), dYb = to_bf16_vec(dY);
      grouped_gemm_fwd(o.Y.data(), o.Yb.data(), Xb.data(), Wf, counts.data(), E, M, K, N, wsf.p, nf);
      grouped_gemm_dgrad(o.dX.data(), o.dXb.data(), dYb.data(), Wd, counts.data(), E, M, K, N, wsd.p, nd);
      grouped_gemm_wgrad(o.dW.data(), Xb.data(), dYb.data(), counts.data(), E, M, K, N, false, wsw.p, nw);
      grouped_gemm_wgrad(o.dWacc.data(), Xb.data(), dYb.data(), counts.data(), E, M, K, N, true, wsw.p, nw);
    } else {
      grouped_gemm_fwd(o.Y.data(), X.data(), Wf, counts.data(), E, M, K, N, wsf.p, nf);
      grouped_gemm_dgrad(o.dX.data(), dY.data(), Wd, counts.data(), E, M, K, N, wsd.p, nd);
      grouped_gemm_wgrad(o.dW.data(), X.data(), dY.data(), counts.data(), E, M, K, N, false, wsw.p, nw);
      grouped_gemm_wgrad(o.dWacc.data(), X.data(), dY.data(), counts.data(), E, M, K, N, true, wsw.p, nw);
    }
    return o;
  }

  void test(Report& r) override {
    const bool bf = prec == GemmPrec::BF16;
    auto X = randn(M * K, 11), W = randn(E * K * N, 12, 0.5f), dY = randn(M * N, 13), dW0 = randn(E * K * N, 14);
    // The values the kernel multiplies (bf16-rounded for the bf16 path), in double.
    auto Xd = bf ? round_bf16_d(X) : to_f64(X), Wd = bf ? round_bf16_d(W) : to_f64(W);
    auto dYd = bf ? round_bf16_d(dY) : to_f64(dY);
    auto dW0d = to_f64(dW0);
    std::vector<double> Y(M * N), dX(M * K), dW(E * K * N), dWacc = dW0d;
    grouped_gemm_fwd_ref<double>(Y.data(), Xd.data(), Wd.data(), counts.data(), E, M, K, N);
    grouped_gemm_dgrad_ref<double>(dX.data(), dYd.data(), Wd.data(), counts.data(), E, M, K, N);
    grouped_gemm_wgrad_ref<double>(dW.data(), Xd.data(), dYd.data(), counts.data(), E, M, K, N, false);
    grouped_gemm_wgrad_ref<double>(dWacc.data(), Xd.data(), dYd.data(), counts.data(), E, M, K, N, true);
    // sum_k |a_k||b_k| for each output (the scale of every error bound).
    auto aX = absd(Xd), aW = absd(Wd), adY = absd(dYd);
    std::vector<double> sY(M * N), sdX(M * K), sdW(E * K * N);
    grouped_gemm_fwd_ref<double>(sY.data(), aX.data(), aW.data(), counts.data(), E, M, K, N);
    grouped_gemm_dgrad_ref<double>(sdX.data(), adY.data(), aW.data(), counts.data(), E, M, K, N);
    grouped_gemm_wgrad_ref<double>(sdW.data(), aX.data(), adY.data(), counts.data(), E, M, K, N, false);
    int64_t max_m = 0;
    for (int32_t c : counts) max_m = std::max<int64_t>(max_m, c);
    auto bounds = [](const std::vector<double>& s, double g, const std::vector<double>* extra) {
      std::vector<double> b(s.size());
      for (size_t i = 0; i < s.size(); ++i) b[i] = g * (s[i] + (extra ? std::fabs((*extra)[i]) : 0.0)) + 1e-30;
      return b;
    };
    auto bY = bounds(sY, gamma(K), nullptr), bdX = bounds(sdX, gamma(N), nullptr);
    auto bdW = bounds(sdW, gamma(max_m), nullptr), bdWacc = bounds(sdW, gamma(max_m + 1), &dW0d);

    Out o = run(X, W, dY, dW0);
    compare_bound(r, "fwd Y vs ref (gamma_K bound)", o.Y.data(), Y.data(), bY.data(), M * N);
    compare_bound(r, "dgrad dX vs ref (gamma_N bound)", o.dX.data(), dX.data(), bdX.data(), M * K);
    compare_bound(r, "wgrad dW vs ref (gamma_m bound)", o.dW.data(), dW.data(), bdW.data(), E * K * N);
    compare_bound(r, "wgrad dW += vs ref", o.dWacc.data(), dWacc.data(), bdWacc.data(), E * K * N);
    if (bf && amx_active()) {  // the AMX tiles ran above; the vdpbf16ps kernel is held to the same bounds
      set_amx_override(0);
      Out q = run(X, W, dY, dW0);
      set_amx_override(-1);
      compare_bound(r, "AVX-512 beside AMX: fwd Y vs ref", q.Y.data(), Y.data(), bY.data(), M * N);
      compare_bound(r, "AVX-512 beside AMX: dgrad dX vs ref", q.dX.data(), dX.data(), bdX.data(), M * K);
      compare_bound(r, "AVX-512 beside AMX: wgrad dW vs ref", q.dW.data(), dW.data(), bdW.data(), E * K * N);
      compare_bound(r, "AVX-512 beside AMX: wgrad dW += vs ref", q.dWacc.data(), dWacc.data(), bdWacc.data(), E * K * N);
    }
    if (bf) {
      // The bf16 copies are the fp32 outputs rounded to nearest even.
      std::vector<float> yb(M * N), yr(M * N), xb(M * K), xr(M * K);
      for (int64_t i = 0; i < M * N; ++i) yb[i] = from_bf16(o.Yb[i]), yr[i] = round_bf16(o.Y[i]);
      for (int64_t i = 0; i < M * K; ++i) xb[i] = from_bf16(o.dXb[i]), xr[i] = round_bf16(o.dX[i]);
      r.compare("fwd Y_bf16 == bf16(Y)", yb.data(), yr.data(), M * N, 0, 0);
      r.compare("dgrad dX_bf16 == bf16(dX)", xb.data(), xr.data(), M * K, 0, 0);
      // Against the unrounded fp32 inputs: bf16 rounding of both factors, plus accumulation.
      std::vector<double> Yu(M * N), sYu(M * N);
      auto Xu = to_f64(X), Wu = to_f64(W), aXu = absd(Xu), aWu = absd(Wu);
      grouped_gemm_fwd_ref<double>(Yu.data(), Xu.data(), Wu.data(), counts.data(), E, M, K, N);
      grouped_gemm_fwd_ref<double>(sYu.data(), aXu.data(), aWu.data(), counts.data(), E, M, K, N);
      auto bYu = bounds(sYu, kBf16Round * (1 + gamma(K)) + gamma(K), nullptr);
      compare_bound(r, "fwd Y vs unrounded fp32 inputs (bf16 bound)", o.Y.data(), Yu.data(), bYu.data(), M * N);
    }
    // Bitwise independence of the thread count.
    const int nt0 = omp_get_max_threads();
    bool same = true;
    for (int nt : {1, 3, -1}) {  // -1: default threads, workspace with a single slot
      omp_set_num_threads(nt > 0 ? nt : nt0);
      Out p = run(X, W, dY, dW0, nt > 0 ? 0 : 1);
      same = same && bitwise_equal(o.Y, p.Y) && bitwise_equal(o.dX, p.dX) && bitwise_equal(o.dW, p.dW) &&
             bitwise_equal(o.dWacc, p.dWacc);
    }
    omp_set_num_threads(nt0);
    r.check(same, "bitwise identical with 1, 3 and " + std::to_string(nt0) + " threads, and a 1-slot workspace");
    if (!bf) check_dense_bitwise(r, o, X, W, dY);
    if (bad_inputs) check_bad_inputs(r, X, W);
    // Packed weights are bitwise the same whichever ISA packs them (RNE as to_bf16 everywhere).
    bool pack_same = true;
    for (GroupedPackKind kind : {GroupedPackKind::Fwd, GroupedPackKind::Dgrad}) {
      const size_t nb = grouped_packed_bytes(kind, prec, E, K, N);
      Buf a(nb), b(nb);
      std::memset(a.p, 0xab, nb), std::memset(b.p, 0xcd, nb);
      grouped_pack_weights(a.p, W.data(), E, K, N, prec, kind);
      const Isa isa = active_isa();
      set_isa_override(Isa::Scalar);
      grouped_pack_weights(b.p, W.data(), E, K, N, prec, kind);
      set_isa_override(isa);
      pack_same = pack_same && std::memcmp(a.p, b.p, nb) == 0;
    }
    r.check(pack_same, "packed weights identical to the scalar packer");
    // Packed by expert ranges (the weight refresh's pieces), last range first: the same bytes as one call, and
    // a range leaves the other experts' bytes alone.
    bool ranges_same = true, others_kept = true;
    for (GroupedPackKind kind : {GroupedPackKind::Fwd, GroupedPackKind::Dgrad}) {
      const size_t nb = grouped_packed_bytes(kind, prec, E, K, N);
      Buf a(nb), b(nb), c(nb);
      std::memset(a.p, 0xab, nb), std::memset(b.p, 0xcd, nb), std::memset(c.p, 0xef, nb);
      grouped_pack_weights(a.p, W.data(), E, K, N, prec, kind);
      const int64_t cut = E / 2 + 1;
      grouped_pack_weights(b.p, W.data(), E, K, N, prec, kind, cut, E);
      grouped_pack_weights(b.p, W.data(), E, K, N, prec, kind, 0, cut);
      ranges_same = ranges_same && std::memcmp(a.p, b.p, nb) == 0;
      grouped_pack_weights(c.p, W.data(), E, K, N, prec, kind, cut, E);
      const size_t split = nb / size_t(E) * size_t(cut);  // the experts' packed blocks are equal and in order
      for (size_t i = 0; i < split; ++i) others_kept = others_kept && static_cast<unsigned char*>(c.p)[i] == 0xef;
      others_kept = others_kept && std::memcmp(static_cast<char*>(c.p) + split, static_cast<char*>(a.p) + split,
                                               nb - split) == 0;
    }
    r.check(ranges_same, "packed by expert ranges [cut, E) then [0, cut): identical to one call");
    r.check(others_kept, "a range's pack leaves the other experts' bytes as they were");
    r.expect_throw("expert range past E", [&] {
      Buf a(grouped_packed_bytes(GroupedPackKind::Fwd, prec, E, K, N));
      grouped_pack_weights(a.p, W.data(), E, K, N, prec, GroupedPackKind::Fwd, 1, E + 1);
    });
  }

  // fp32: each expert's rows are bitwise what the batch-invariant dense gemm_f32 gives for that expert alone
  // (both are the plain sequential sum from 0), so a token's expert output does not depend on which other
  // tokens were routed with it, nor on whether the grouped or the dense path computed it.
  void check_dense_bitwise(Report& r, const Out& o, const std::vector<float>& X, const std::vector<float>& W,
                           const std::vector<float>& dY) const {
    std::vector<float> Y(M * N), dX(M * K), dW(E * K * N);
    int64_t row = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = counts[e];
      const float* We = W.data() + e * K * N;
      gemm_f32(Trans::N, Trans::N, m, N, K, 1.0f, X.data() + row * K, K, We, N, 0.0f, Y.data() + row * N, N);
      gemm_f32(Trans::N, Trans::T, m, K, N, 1.0f, dY.data() + row * N, N, We, N, 0.0f, dX.data() + row * K, K);
      gemm_f32(Trans::T, Trans::N, K, N, m, 1.0f, X.data() + row * K, K, dY.data() + row * N, N, 0.0f,
               dW.data() + e * K * N, N);
      row += m;
    }
    r.check(bitwise_equal(o.Y, Y), "fwd Y bitwise == per-expert gemm_f32");
    r.check(bitwise_equal(o.dX, dX), "dgrad dX bitwise == per-expert gemm_f32 (NT)");
    r.check(bitwise_equal(o.dW, dW), "wgrad dW bitwise == per-expert gemm_f32 (TN)");
  }

  // fp32 variant only (uses the fp32 overloads).
  void check_bad_inputs(Report& r, const std::vector<float>& X, const std::vector<float>& W) {
    Buf pf(grouped_packed_bytes(GroupedPackKind::Fwd, prec, E, K, N));
    Buf pd(grouped_packed_bytes(GroupedPackKind::Dgrad, prec, E, K, N));
    auto Wf = grouped_pack_weights(pf.p, W.data(), E, K, N, prec, GroupedPackKind::Fwd);
    auto Wd = grouped_pack_weights(pd.p, W.data(), E, K, N, prec, GroupedPackKind::Dgrad);
    const size_t nws = ws_bytes(GroupedOp::Wgrad);
    Buf ws(nws);
    std::vector<float> Y(M * N + N), dWv(E * K * N);
    std::vector<float> Xf = X;
    Xf.resize(M * K + K);
    auto neg = counts;
    neg[1] += neg[0] + 1, neg[0] = -1;  // still sums to M
    auto more = counts;
    more[0] += 1;  // sums to M + 1
    r.expect_throw("negative count", [&] { grouped_gemm_fwd(Y.data(), Xf.data(), Wf, neg.data(), E, M, K, N, ws.p, nws); });
    r.expect_throw("counts sum != M", [&] { grouped_gemm_fwd(Y.data(), Xf.data(), Wf, more.data(), E, M, K, N, ws.p, nws); });
    r.expect_throw("wgrad counts sum != M",
           [&] { grouped_gemm_wgrad(dWv.data(), Xf.data(), Y.data(), more.data(), E, M, K, N, false, ws.p, nws); });
    r.expect_throw("dgrad with Fwd-packed weights",
           [&] { grouped_gemm_dgrad(Xf.data(), Y.data(), Wf, counts.data(), E, M, K, N, ws.p, nws); });
    r.expect_throw("fwd with Dgrad-packed weights",
           [&] { grouped_gemm_fwd(Y.data(), Xf.data(), Wd, counts.data(), E, M, K, N, ws.p, nws); });
    r.expect_throw("packed shape mismatch",
           [&] { grouped_gemm_fwd(Y.data(), Xf.data(), Wf, counts.data(), E, M, K, N + 1, ws.p, nws); });
    r.expect_throw("null workspace",
           [&] { grouped_gemm_fwd(Y.data(), Xf.data(), Wf, counts.data(), E, M, K, N, nullptr, nws); });
    r.expect_throw("misaligned workspace", [&] {
      grouped_gemm_fwd(Y.data(), Xf.data(), Wf, counts.data(), E, M, K, N, static_cast<char*>(ws.p) + 8, nws - 8);
    });
    r.expect_throw("workspace too small",
           [&] { grouped_gemm_fwd(Y.data(), Xf.data(), Wf, counts.data(), E, M, K, N, ws.p, 8); });
    std::vector<bf16> Xb(Xf.size()), Yb(Y.size());
    r.expect_throw("bf16 inputs with fp32-packed weights",
           [&] { grouped_gemm_fwd(Y.data(), nullptr, Xb.data(), Wf, counts.data(), E, M, K, N, ws.p, nws); });
    r.expect_throw("negative E", [&] { grouped_gemm_workspace_bytes(GroupedOp::Fwd, prec, -1, M, K, N); });
  }

  void grad(Report& r) override {
    // The three reference ops as functions of their inputs, each checked through a random projection:
    //   L1 = <G, fwd(X, W)>       dL1/dX = dgrad(G, W),  dL1/dW = wgrad(X, G)
    //   L2 = <H, dgrad(dY, W)>    dL2/ddY = fwd(H, W),   dL2/dW = wgrad(H, dY)
    //   L3 = <P, wgrad(X, dY)>    dL3/dX = dgrad(dY, P), dL3/ddY = fwd(X, P)
    auto X = to_f64(randn(M * K, 21)), W = to_f64(randn(E * K * N, 22)), dY = to_f64(randn(M * N, 23));
    auto G = to_f64(randn(M * N, 24)), H = to_f64(randn(M * K, 25)), P = to_f64(randn(E * K * N, 26));
    const int32_t* c = counts.data();
    std::vector<double> tmpMN(M * N), tmpMK(M * K), tmpW(E * K * N);
    auto L1 = [&] {
      grouped_gemm_fwd_ref<double>(tmpMN.data(), X.data(), W.data(), c, E, M, K, N);
      return dot(G.data(), tmpMN.data(), M * N);
    };
    auto L2 = [&] {
      grouped_gemm_dgrad_ref<double>(tmpMK.data(), dY.data(), W.data(), c, E, M, K, N);
      return dot(H.data(), tmpMK.data(), M * K);
    };
    auto L3 = [&] {
      grouped_gemm_wgrad_ref<double>(tmpW.data(), X.data(), dY.data(), c, E, M, K, N, false);
      return dot(P.data(), tmpW.data(), E * K * N);
    };
    std::vector<double> gX(M * K), gW(E * K * N), gdY(M * N);
    grouped_gemm_dgrad_ref<double>(gX.data(), G.data(), W.data(), c, E, M, K, N);
    grouped_gemm_wgrad_ref<double>(gW.data(), X.data(), G.data(), c, E, M, K, N, false);
    r.fd_check("fwd: dX = dgrad(G, W)", X.data(), M * K, gX.data(), L1, fd_eps, grad_tol);
    r.fd_check("fwd: dW = wgrad(X, G)", W.data(), E * K * N, gW.data(), L1, fd_eps, grad_tol);
    grouped_gemm_fwd_ref<double>(gdY.data(), H.data(), W.data(), c, E, M, K, N);
    grouped_gemm_wgrad_ref<double>(gW.data(), H.data(), dY.data(), c, E, M, K, N, false);
    r.fd_check("dgrad: ddY = fwd(H, W)", dY.data(), M * N, gdY.data(), L2, fd_eps, grad_tol);
    r.fd_check("dgrad: dW = wgrad(H, dY)", W.data(), E * K * N, gW.data(), L2, fd_eps, grad_tol);
    grouped_gemm_dgrad_ref<double>(gX.data(), dY.data(), P.data(), c, E, M, K, N);
    grouped_gemm_fwd_ref<double>(gdY.data(), X.data(), P.data(), c, E, M, K, N);
    r.fd_check("wgrad: dX = dgrad(dY, P)", X.data(), M * K, gX.data(), L3, fd_eps, grad_tol);
    r.fd_check("wgrad: ddY = fwd(X, P)", dY.data(), M * N, gdY.data(), L3, fd_eps, grad_tol);
  }

  void perf() override {
    static thread_local std::vector<float> Y;
    if (!perf_ready) {
      pX = randn(M * K, 31);
      auto W = randn(E * K * N, 32);
      pXb = to_bf16_vec(pX);
      pack = std::make_unique<Buf>(grouped_packed_bytes(GroupedPackKind::Fwd, prec, E, K, N));
      pW = grouped_pack_weights(pack->p, W.data(), E, K, N, prec, GroupedPackKind::Fwd);
      pws_bytes = ws_bytes(GroupedOp::Fwd);
      pws = std::make_unique<Buf>(pws_bytes);
      perf_ready = true;
    }
    Y.resize(M * N);
    if (prec == GemmPrec::BF16)
      grouped_gemm_fwd(Y.data(), nullptr, pXb.data(), pW, counts.data(), E, M, K, N, pws->p, pws_bytes);
    else
      grouped_gemm_fwd(Y.data(), pX.data(), pW, counts.data(), E, M, K, N, pws->p, pws_bytes);
  }
  bool perf_ready = false;
  std::vector<float> pX;
  std::vector<bf16> pXb;
  std::unique_ptr<Buf> pack, pws;
  size_t pws_bytes = 0;
  GroupedPackedWeights pW;
};

// Skewed counts: expert e gets a share proportional to u^3 (u uniform), so a few experts get most tokens and
// several get none. Deterministic.
std::vector<int32_t> skewed_counts(int64_t E, int64_t M, uint64_t seed) {
  std::vector<double> w(E);
  double s = 0;
  for (int64_t e = 0; e < E; ++e) {
    double u = rng_uniform(rng_key(seed, "counts"), uint64_t(e));
    w[e] = u * u * u;
    s += w[e];
  }
  std::vector<int32_t> c(E);
  int64_t used = 0;
  for (int64_t e = 0; e < E; ++e) used += (c[e] = int32_t(std::floor(w[e] / s * double(M))));
  c[0] += int32_t(M - used);
  return c;
}

std::vector<std::unique_ptr<OpCase>> make_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  for (GemmPrec p : {GemmPrec::BF16, GemmPrec::F32}) {
    auto add = [&](std::string n, std::vector<int32_t> c, int64_t k, int64_t nn, bool bad = false) {
      auto cs = std::make_unique<GroupedCase>(std::move(n), std::move(c), k, nn, p);
      cs->bad_inputs = bad;
      v.push_back(std::move(cs));
    };
    add("uniform", {24, 24, 24, 24}, 64, 48, /*bad=*/p == GemmPrec::F32);
    add("skewed", {1, 0, 150, 2, 3, 0, 7}, 72, 80);  // one expert has two M tiles
    add("zero_groups", {0, 5, 0, 0, 9, 0}, 32, 40);
    add("all_empty", {0, 0, 0}, 16, 16);
    add("single_expert", {37}, 17, 130);   // E = 1, odd K, two column panels + remainder
    add("odd_shapes", {7, 13, 6}, 7, 33);  // odd K and N, masked tails
    add("long_k", {50, 11, 1}, 301, 20);   // several K blocks, odd K
    add("wide_n", {9, 20}, 24, 300);       // several column tiles
    add("skewed_many", skewed_counts(16, 400, 5), 40, 56);
    add("long_m", {600, 5, 0, 301}, 40, 72);  // wgrad over 600 tokens (several K blocks), many row tiles
  }
  return v;
}

}  // namespace
}  // namespace moetron::ops

MT_REGISTER_OP_CASES(moetron::ops::make_cases);
