// router_split_cases.cpp: op-harness case "router/split" (family "router"): balanced routing (Sinkhorn selection,
// capacity routing) with the micro-batch split over `split` ranks as context parallelism splits it, simulated in
// one process: each "rank" calls router_forward / router_backward on its rows with a fake gather_rows (the other
// ranks' score rows, concatenated in rank order) and a fake sum_counts (the other ranks' aux-loss counts), and its
// selection, weights, counts, dlogits and loss shares are held to the single call on the whole micro-batch.
// Not the MPI path (tests/mpi/test_mpi_layouts.cpp, cp2_balanced*), not the unsplit kernel (router_cases.cpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "harness.h"
#include "moetron/router.h"

namespace moetron::ops {
namespace {

constexpr double kU = 5.9604644775390625e-08;  // 2^-24, fp32 unit roundoff

// The CP layout written from its definition (docs/parallel.md): chunk c of a sequence of T tokens is
// [floor(c T / 2P), floor((c+1) T / 2P)); rank r holds chunk r, then chunk 2P-1-r.
std::vector<int64_t> positions(int64_t T, int P, int r) {
  std::vector<int64_t> pos;
  for (int c : {r, 2 * P - 1 - r})
    for (int64_t t = c * T / (2 * P); t < (c + 1) * T / (2 * P); ++t) pos.push_back(t);
  return pos;
}

class RouterSplit : public OpCase {
 public:
  RouterSplit() { name = "router/split"; }

  // One configuration: the whole micro-batch (B sequences of T tokens) against P ranks' calls.
  void one(Report& r, RouterConfig c, int P, int64_t B, int64_t T, const std::string& tag) {
    const int E = c.E, k = c.topk;
    const int64_t Nw = B * T, Tl = T / P, N = B * Tl;
    // Collapsed scores (docs/routing.md): one shared row plus a small per-token spread, so that plain top-k
    // sends every token to the same experts and the capacity and Sinkhorn decide the routing.
    std::vector<float> logits(size_t(Nw * E)), bias(static_cast<size_t>(E)), g(size_t(Nw * k));
    uint64_t st = 777 + uint64_t(P);
    auto unif = [&] {
      st ^= st << 13, st ^= st >> 7, st ^= st << 17;
      return double(st >> 11) / 9007199254740992.0;
    };
    std::vector<double> shared(static_cast<size_t>(E));
    for (auto& x : shared) x = 0.5 * (unif() - 0.5);
    for (int64_t n = 0; n < Nw; ++n)
      for (int e = 0; e < E; ++e) logits[size_t(n * E + e)] = float(shared[size_t(e)] + 0.05 * (unif() - 0.5));
    for (auto& x : bias) x = float(0.01 * (unif() - 0.5));
    for (auto& x : g) x = float(unif() - 0.5);
    const float* bp = c.aux == AuxMode::None ? bias.data() : nullptr;  // the aux-free bias where no aux loss

    // The single call.
    RouterConfig cw = c;
    cw.seq_len = int(T);
    std::vector<int32_t> idx_w(size_t(Nw * k)), cnt_w(static_cast<size_t>(E));
    std::vector<float> w_w(size_t(Nw * k)), s_w(size_t(Nw * E)), dl_w(size_t(Nw * E));
    std::vector<char> ws_w(router_workspace_bytes(cw, Nw));
    RouterLosses lw;
    router_forward(idx_w.data(), w_w.data(), cnt_w.data(), s_w.data(), &lw, logits.data(), bp, cw, Nw, ws_w.data());
    router_backward(dl_w.data(), g.data(), s_w.data(), idx_w.data(), logits.data(), cw, Nw, ws_w.data());

    // The split: rank q's rows are (b, pos_q[i]) of every sequence b; gathered row q N + n is its local row n.
    RouterConfig cs = c;
    cs.seq_len = int(Tl), cs.split = P;
    std::vector<std::vector<int64_t>> rows(static_cast<size_t>(P));  // rank q's local row n -> row of the whole micro-batch
    for (int q = 0; q < P; ++q) {
      const std::vector<int64_t> pos = positions(T, P, q);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t : pos) rows[size_t(q)].push_back(b * T + t), cs.split_rows.push_back(b * T + t);
    }
    auto take = [&](auto& dst, const auto& src, int q, int64_t width) {
      for (int64_t n = 0; n < N; ++n)
        std::copy_n(src.begin() + rows[size_t(q)][size_t(n)] * width, width, dst.begin() + n * width);
    };
    // Every rank's score rows (a score row depends on its token's logits alone): the fake gather's data.
    std::vector<std::vector<float>> lg(static_cast<size_t>(P), std::vector<float>(size_t(N * E))), sc = lg;
    for (int q = 0; q < P; ++q) {
      take(lg[size_t(q)], logits, q, E);
      RouterConfig plain = c;
      plain.seq_len = int(Tl), plain.sinkhorn_iters = 0, plain.capacity = 0;
      std::vector<int32_t> i0(size_t(N * k)), c0(static_cast<size_t>(E));
      std::vector<float> w0(size_t(N * k));
      std::vector<char> ws0(router_workspace_bytes(plain, N));
      router_forward(i0.data(), w0.data(), c0.data(), sc[size_t(q)].data(), nullptr, lg[size_t(q)].data(), bp, plain,
                     N, ws0.data());
    }
    // Pass 1 without losses (no sum_counts): each rank's selection, for pass 2's fake sum_counts.
    std::vector<std::vector<int32_t>> idx(static_cast<size_t>(P), std::vector<int32_t>(size_t(N * k)));
    std::vector<std::vector<int32_t>> cnt(static_cast<size_t>(P), std::vector<int32_t>(static_cast<size_t>(E)));
    std::vector<std::vector<float>> wt(static_cast<size_t>(P), std::vector<float>(size_t(N * k)));
    std::vector<std::vector<float>> s(static_cast<size_t>(P), std::vector<float>(size_t(N * E))), dl = s;
    std::vector<char> ws(router_workspace_bytes(cs, N));
    bool own_rows = true;  // the rank's own score rows reach the gather bitwise as computed apart
    for (int pass = 0; pass < 2; ++pass) {
      double aux = 0, z = 0;
      for (int q = 0; q < P; ++q) {
        cs.split_rank = q;
        cs.gather_rows = [&](float* all, const float* mine, int64_t n) {
          for (int o = 0; o < P; ++o) std::memcpy(all + o * n, o == q ? mine : sc[size_t(o)].data(), sizeof(float) * size_t(n));
          own_rows = own_rows && std::memcmp(mine, sc[size_t(q)].data(), sizeof(float) * size_t(n)) == 0;
        };
        cs.sum_counts = [&](int32_t* cc, int64_t n) {  // + the other ranks' per-sequence counts (pass 1's selection)
          for (int o = 0; o < P; ++o) {
            if (o == q) continue;
            for (int64_t i = 0; i < N * k; ++i) {
              const int64_t b = cs.aux == AuxMode::SeqWise ? (i / k) / Tl : 0;
              if (b * E + idx[size_t(o)][size_t(i)] < n) ++cc[b * E + idx[size_t(o)][size_t(i)]];
            }
          }
        };
        std::vector<int32_t> iq(size_t(N * k)), cq(static_cast<size_t>(E));
        std::vector<float> wq(size_t(N * k));
        RouterLosses lq;
        router_forward(iq.data(), wq.data(), cq.data(), s[size_t(q)].data(), pass ? &lq : nullptr,
                       lg[size_t(q)].data(), bp, cs, N, ws.data());
        if (pass == 0) {
          idx[size_t(q)] = iq, cnt[size_t(q)] = cq, wt[size_t(q)] = wq;
          continue;
        }
        r.check(iq == idx[size_t(q)] && cq == cnt[size_t(q)], "rank " + std::to_string(q) +
                                                                  ": the same selection with and without the losses (" + tag + ")");
        aux += lq.aux, z += lq.z;
        std::vector<float> gq(size_t(N * k));
        take(gq, g, q, k);
        router_backward(dl[size_t(q)].data(), gq.data(), s[size_t(q)].data(), iq.data(), lg[size_t(q)].data(), cs, N,
                        ws.data());
      }
      if (pass == 0) continue;
      // The loss shares add up to the single call's: each rank's value is one fp32 rounding of an fp64 sum
      // (2^-24 relative), the single call's another, and the P shares are added in fp64: (P + 1) 2^-24 of the
      // value, doubled for the fp64 sums' order (1e-16 each, negligible): 2 (P + 1) 2^-24.
      const double tol = 2.0 * (P + 1) * kU;
      const double wa = lw.aux, wz = lw.z;
      r.compare("aux loss: the ranks' shares add up to the single call's (" + tag + ")", &aux, &wa, 1, 0, tol);
      r.compare("z-loss: the ranks' shares add up to the single call's (" + tag + ")", &z, &wz, 1, 0, tol);
    }
    r.check(own_rows, "gather_rows receives the rank's own score rows (" + tag + ")");
    // Selection, weights, scores and dlogits: bitwise the single call's rows (the same per-row operations on the
    // same fp32 scores, factors and counts); counts: the ranks' add up to the single call's.
    std::vector<int32_t> sum(size_t(E), 0);
    for (int q = 0; q < P; ++q) {
      std::vector<int32_t> iw(size_t(N * k));
      std::vector<float> ww(size_t(N * k)), sw(size_t(N * E)), dw(size_t(N * E));
      take(iw, idx_w, q, k), take(ww, w_w, q, k), take(sw, s_w, q, E), take(dw, dl_w, q, E);
      const std::string rt = "rank " + std::to_string(q) + " of " + std::to_string(P) + ", " + tag;
      r.compare("selection = the whole micro-batch's at its rows (" + rt + ")", idx[size_t(q)].data(), iw.data(), N * k);
      r.compare("weights (" + rt + ")", wt[size_t(q)].data(), ww.data(), N * k, 0, 0);
      r.compare("scores (" + rt + ")", s[size_t(q)].data(), sw.data(), N * E, 0, 0);
      r.compare("dlogits: local rows only (" + rt + ")", dl[size_t(q)].data(), dw.data(), N * E, 0, 0);
      for (int e = 0; e < E; ++e) sum[size_t(e)] += cnt[size_t(q)][size_t(e)];
    }
    r.compare("counts: the ranks' add up to the single call's (" + tag + ")", sum.data(), cnt_w.data(), E);
  }

  void run(Report& r) {
    const int E = 16, k = 2;
    const int64_t B = 4, T = 32;
    for (ScoreFn fn : {ScoreFn::Softmax, ScoreFn::Sigmoid})
      for (int P : {2, 4})
        for (auto [it, capf, aux] : {std::tuple{4, 1.5f, AuxMode::SeqWise}, std::tuple{4, 0.0f, AuxMode::SeqWise},
                                     std::tuple{0, 1.5f, AuxMode::Global}, std::tuple{4, 1.0f, AuxMode::None}}) {
          RouterConfig c;
          c.E = E, c.topk = k, c.score = fn, c.norm_topk = fn == ScoreFn::Sigmoid, c.sinkhorn_iters = it;
          c.capacity = capf, c.aux = aux, c.aux_coef = aux == AuxMode::None ? 0.0f : 0.01f, c.z_coef = 0.001f;
          const std::string tag = std::string(fn == ScoreFn::Softmax ? "softmax" : "sigmoid") + ", split " +
                                  std::to_string(P) + ", sinkhorn " + std::to_string(it) + ", capacity " +
                                  std::to_string(capf).substr(0, 3) + (aux == AuxMode::None ? ", bias" : "");
          one(r, c, P, B, T, tag);
        }
    // What the split needs, refused by name.
    RouterConfig c;
    c.E = E, c.topk = k, c.sinkhorn_iters = 4, c.split = 2, c.seq_len = int(T / 2);
    r.expect_throw("split sinkhorn without gather_rows", [&] { router_validate(c, B * T / 2); });
    c.gather_rows = [](float*, const float*, int64_t) {};
    r.expect_throw("split_rows of the wrong size", [&] { router_validate(c, B * T / 2); });
    for (int64_t i = 0; i < B * T; ++i) c.split_rows.push_back(i == 1 ? 0 : i);
    r.expect_throw("split_rows not a permutation", [&] { router_validate(c, B * T / 2); });
  }
  void test(Report& r) override { run(r); }
  void grad(Report& r) override { run(r); }  // nothing differentiable beyond router/*: the same checks
  void perf() override {}
};

std::vector<std::unique_ptr<OpCase>> router_split_cases() {
  std::vector<std::unique_ptr<OpCase>> v;
  v.push_back(std::make_unique<RouterSplit>());
  return v;
}

}  // namespace
MT_REGISTER_OP_CASES(router_split_cases);
}  // namespace moetron::ops
