// test_mpi_cp.cpp: context parallelism's ring attention (src/parallel/cp_attention.cpp) under mpirun: the split
// (positions, row counts, take / put), and cp_attention_forward / cp_attention_backward on cp = world size,
// cp = 2 groups (split of 4 ranks) and cp = 1 against the single-rank attention_forward / attention_backward of the whole
// sequence, which every rank computes itself from the same seeded inputs. Shapes: MHA, GQA in a fused qkv row,
// MLA (Dqk != Dv, v read in place from the kv row), one shared k head (head_k = 0); B = 2; T = 3, 5, 13, 30, 64
// and 300 (chunks of length 0, 1, uneven, and over one 64-wide kernel tile).
// Tolerance (derived in docs/parallel.md "Context parallelism: ring attention"): the ring computes the same sums
// as the one-rank kernel but grouped by chunk pairs and merged by lse, so each result differs from the
// one-rank one by reassociation only: |cp - ref| <= 16 u (2 cp + ceil(T / 64)) max|ref| per tensor
// (u = 2^-24: 16 u per regrouping step, one per merged block and per key tile, a factor 2 over the measured).
// Not: the model's wiring (the lead's), timing of the overlap.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moetron/attention.h"
#include "moetron/comm.h"
#include "moetron/cp_attention.h"

using namespace moetron;

namespace {

constexpr double kU = 5.9604644775390625e-08;  // 2^-24

// One token row holds q, k and v (fused, like the model's qkv / MLA buffers); out has its own rows.
struct Shape {
  std::string name;
  AttnDims d{};
  int64_t row = 0, qo = 0, ko = 0, vo = 0;  // row width and the column where q, k, v start
};

Shape mha(int64_t H, int64_t D) {
  Shape s{"mha"};
  AttnDims& d = s.d;
  d.Hq = d.Hkv = H, d.Dqk = d.Dv = D, d.head_q = d.head_k = d.head_v = d.head_o = D;
  s.qo = 0, s.ko = H * D, s.vo = 2 * H * D, s.row = 3 * H * D;
  d.ldo = H * D;
  return s;
}
Shape gqa_fused(int64_t Hq, int64_t Hkv, int64_t D, int64_t pad) {
  Shape s{"gqa_fused"};
  AttnDims& d = s.d;
  d.Hq = Hq, d.Hkv = Hkv, d.Dqk = d.Dv = D, d.head_q = d.head_k = d.head_v = D, d.head_o = D + 1;
  s.qo = 0, s.ko = Hq * D, s.vo = (Hq + Hkv) * D, s.row = (Hq + 2 * Hkv) * D + pad;
  d.ldo = Hq * (D + 1) + 3;
  return s;
}
// MLA: q heads [nope | pe], k [k_nope | k_pe] per head, v in place in the kv up-projection [k_nope | v] per head.
Shape mla(int64_t H, int64_t dn, int64_t dr, int64_t dv) {
  Shape s{"mla"};
  AttnDims& d = s.d;
  d.Hq = d.Hkv = H, d.Dqk = dn + dr, d.Dv = dv;
  d.head_q = d.head_k = dn + dr, d.head_v = dn + dv, d.head_o = dv;
  s.qo = 0, s.ko = H * (dn + dr), s.vo = 2 * H * (dn + dr) + dn, s.row = 2 * H * (dn + dr) + H * (dn + dv);
  d.ldo = H * dv;
  return s;
}
Shape shared_k(int64_t H, int64_t Dqk, int64_t Dv) {
  Shape s{"shared_k"};
  AttnDims& d = s.d;
  d.Hq = d.Hkv = H, d.Dqk = Dqk, d.Dv = Dv, d.head_q = Dqk, d.head_k = 0, d.head_v = Dv, d.head_o = Dv;
  s.qo = 0, s.ko = H * Dqk, s.vo = H * Dqk + Dqk, s.row = H * Dqk + Dqk + H * Dv;
  d.ldo = H * Dv;
  return s;
}
std::vector<Shape> shapes() {
  std::vector<Shape> v = {mha(3, 16), gqa_fused(4, 2, 8, 5), mla(2, 16, 8, 16), shared_k(4, 12, 8)};
  for (Shape& s : v) {
    s.d.ldq = s.d.ldk = s.d.ldv = s.row;
    s.d.scale = float(1.0 / std::sqrt(double(s.d.Dqk)));
  }
  return v;
}

std::vector<float> randn(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(n);
  for (float& e : x) e = nd(g);
  return x;
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float e : x) m = std::max(m, double(std::fabs(e)));
  return m;
}
double max_err(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::fabs(a[i] - b[i])));
  return m;
}

struct Outcome {
  double worst_per_step = 0;  // max over cases and tensors of error / (u max|ref| steps)
  double worst[3] = {0, 0, 0};  // out, lse, gradients: max error / (u max|ref|)
};

// One shape, one T, on the group `cp`: forward and backward held to the one-rank kernel on the whole sequence.
void check_case(const Shape& sh, int64_t T, const Comm& cp, Outcome& oc) {
  const int P = cp.size(), r = cp.rank();
  const int64_t B = 2;
  AttnDims d = sh.d;
  d.B = B, d.T = T;
  // Whole-sequence inputs from a seed (the same on every rank); q scaled so that rows are neither flat nor peaked.
  std::vector<float> in = randn(size_t(B * T * sh.row), 1000 + uint64_t(T), 1.0f);
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t e = 0; e < d.Hq * d.head_q; ++e) in[size_t(bt * sh.row + sh.qo + e)] *= 2.0f;
  std::vector<float> dout = randn(size_t(B * T * d.ldo), 2000 + uint64_t(T), 1.0f);
  std::vector<float> out(size_t(B * T * d.ldo), 0.0f), lse(size_t(B * d.Hq * T)), din(in.size(), 0.0f);
  const float* x = in.data();
  attention_forward(out.data(), lse.data(), x + sh.qo, x + sh.ko, x + sh.vo, d);
  attention_backward(din.data() + sh.qo, din.data() + sh.ko, din.data() + sh.vo, dout.data(), out.data(), lse.data(),
                     x + sh.qo, x + sh.ko, x + sh.vo, d);
  // This rank's rows.
  const int64_t n = cp_local_rows(T, P, r);
  AttnDims dl = d;
  dl.T = n;
  const std::vector<float> lin = cp_take(in, B, T, sh.row, P, r), ldout = cp_take(dout, B, T, d.ldo, P, r);
  std::vector<float> lout(size_t(B * n * d.ldo), 0.0f), llse(size_t(B * d.Hq * n)), ldin(lin.size(), 0.0f);
  const float* y = lin.data();
  cp_attention_forward(lout.data(), llse.data(), y + sh.qo, y + sh.ko, y + sh.vo, dl, T, cp);
  cp_attention_backward(ldin.data() + sh.qo, ldin.data() + sh.ko, ldin.data() + sh.vo, ldout.data(), lout.data(),
                        llse.data(), y + sh.qo, y + sh.ko, y + sh.vo, dl, T, cp);
  // The reference's rows of this rank; lse picked by position.
  const std::vector<float> rout = cp_take(out, B, T, d.ldo, P, r), rdin = cp_take(din, B, T, sh.row, P, r);
  const std::vector<int64_t> pos = cp_positions(T, P, r);
  std::vector<float> rlse(llse.size());
  for (int64_t bh = 0; bh < B * d.Hq; ++bh)
    for (int64_t i = 0; i < n; ++i) rlse[size_t(bh * n + i)] = lse[size_t(bh * T + pos[size_t(i)])];
  // Gradients: every element of the row (the views' gaps are 0 in both).
  const double steps = double(2 * P + (T + 63) / 64), tol = 16 * kU * steps;
  const std::string what = sh.name + " T=" + std::to_string(T) + " cp=" + std::to_string(P) + " rank " +
                           std::to_string(r);
  auto hold = [&](int i, const char* t, const std::vector<float>& got, const std::vector<float>& want, double scale) {
    const double e = max_err(got, want), ratio = e / (kU * scale);
    oc.worst_per_step = std::max(oc.worst_per_step, ratio / steps);
    oc.worst[i] = std::max(oc.worst[i], ratio);
    EXPECT_LE(e, tol * scale) << what << " " << t << ": max error " << e << " = " << ratio
                              << " u max|ref| (limit " << tol / kU << " u)";
  };
  hold(0, "out", lout, rout, max_abs(out));
  hold(1, "lse", llse, rlse, max_abs(lse));
  hold(2, "dq dk dv", ldin, rdin, max_abs(din));
}

// cp = 2 on 4 ranks: groups {0, 1} and {2, 3}; cp = world otherwise.
Comm cp_group(int cp) {
  Comm w = comm_world();
  Comm g = w.split(w.rank() / cp, w.rank());
  g.set_name("cp");
  return g;
}

}  // namespace

TEST(MpiCp, SplitCoversTheSequenceBalanced) {
  for (int P : {1, 2, 3, 4})
    for (int64_t T : {0, 1, 3, 5, 7, 13, 30, 64, 301}) {
      std::vector<int> seen(size_t(T), 0);
      int64_t work_min = INT64_MAX, work_max = 0;
      for (int r = 0; r < P; ++r) {
        const std::vector<int64_t> pos = cp_positions(T, P, r);
        ASSERT_EQ(int64_t(pos.size()), cp_local_rows(T, P, r));
        int64_t work = 0;  // causal (query, key) pairs of this rank's rows
        for (int64_t p : pos) ++seen[size_t(p)], work += p + 1;
        work_min = std::min(work_min, work), work_max = std::max(work_max, work);
        // Chunk r then chunk 2P-1-r, each ascending; chunk c = [floor(c T / 2P), floor((c + 1) T / 2P)).
        std::vector<int64_t> want;
        for (int c : {r, 2 * P - 1 - r})
          for (int64_t t = c * T / (2 * P); t < (c + 1) * T / (2 * P); ++t) want.push_back(t);
        EXPECT_EQ(pos, want) << "T=" << T << " cp=" << P << " rank " << r;
      }
      for (int64_t t = 0; t < T; ++t) EXPECT_EQ(seen[size_t(t)], 1) << "position " << t << " T=" << T << " cp=" << P;
      // Balanced causal work: ranks differ by at most one chunk's worth of rows times a row's keys.
      const int64_t chunk = (T + 2 * P - 1) / (2 * P);
      EXPECT_LE(work_max - work_min, 2 * chunk * (chunk + 2)) << "T=" << T << " cp=" << P;
      std::vector<int32_t> full(size_t(2 * T * 3)), back(full.size(), -1);
      for (size_t i = 0; i < full.size(); ++i) full[i] = int32_t(i);
      for (int r = 0; r < P; ++r) {
        std::vector<int32_t> loc = cp_take(full, 2, T, 3, P, r);
        cp_put_rows(back.data(), loc.data(), 2, T, 3 * 4, P, r);
      }
      EXPECT_EQ(full, back) << "take / put round trip T=" << T << " cp=" << P;
    }
  EXPECT_EQ(cp_positions(13, 2, 0), (std::vector<int64_t>{0, 1, 2, 9, 10, 11, 12}));
  EXPECT_EQ(cp_positions(13, 2, 1), (std::vector<int64_t>{3, 4, 5, 6, 7, 8}));
}

TEST(MpiCp, RingAttentionMatchesOneRank) {
  Comm w = comm_world();
  std::vector<int> cps = {w.size(), 1};  // cp = 1: the two chunks of one rank, merged, no ring
  if (w.size() == 4) cps.push_back(2);    // two cp = 2 groups side by side
  for (int P : cps) {
    Comm cp = cp_group(P);
    Outcome oc;
    for (const Shape& sh : shapes())
      for (int64_t T : {3, 5, 13, 30, 64, 300}) {
        if (T == 300 && sh.name != "mha") continue;
        check_case(sh, T, cp, oc);
      }
    // Measured on rank 0's rows (each rank checks its own).
    if (w.rank() == 0)
      std::printf("cp=%d: max error / (u max|ref|): out %.3g, lse %.3g, dq dk dv %.3g; per regrouping step %.3g "
                  "(limit 16)\n", P, oc.worst[0], oc.worst[1], oc.worst[2], oc.worst_per_step);
  }
}

TEST(MpiCp, DeterministicAndRingTraffic) {
  Comm cp = cp_group(comm_world().size());
  const Shape sh = shapes()[1];
  AttnDims d = sh.d;
  const int64_t T = 30, B = 2, n = cp_local_rows(T, cp.size(), cp.rank());
  d.B = B, d.T = n;
  const std::vector<float> in = randn(size_t(B * n * sh.row), 7 + uint64_t(cp.rank()), 1.0f);
  const std::vector<float> dout = randn(size_t(B * n * d.ldo), 8 + uint64_t(cp.rank()), 1.0f);
  std::vector<float> res[2];
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<float> out(size_t(B * n * d.ldo)), lse(size_t(B * d.Hq * n)), din(in.size(), 0.0f);
    const float* x = in.data();
    cp.reset_stats();
    cp_attention_forward(out.data(), lse.data(), x + sh.qo, x + sh.ko, x + sh.vo, d, T, cp);
    // Forward: cp - 1 K/V hops, each an isend and an irecv.
    EXPECT_EQ(cp.stats()[CommOp::Send].calls, cp.size() - 1);
    EXPECT_EQ(cp.stats()[CommOp::Recv].calls, cp.size() - 1);
    cp.reset_stats();
    cp_attention_backward(din.data() + sh.qo, din.data() + sh.ko, din.data() + sh.vo, dout.data(), out.data(),
                          lse.data(), x + sh.qo, x + sh.ko, x + sh.vo, d, T, cp);
    // Backward: cp - 1 K/V hops and cp dK/dV hops (the last one home).
    const int64_t hops = cp.size() == 1 ? 0 : 2 * cp.size() - 1;
    EXPECT_EQ(cp.stats()[CommOp::Send].calls, hops);
    EXPECT_EQ(cp.pending_requests(), 0);
    res[rep] = out;
    res[rep].insert(res[rep].end(), lse.begin(), lse.end());
    res[rep].insert(res[rep].end(), din.begin(), din.end());
  }
  EXPECT_EQ(0, std::memcmp(res[0].data(), res[1].data(), res[0].size() * 4)) << "two runs differ";
  EXPECT_EQ(cp.info().name, "cp");
}

TEST(MpiCp, RefusesRowsThatAreNotThisRanksShare) {
  Comm cp = cp_group(comm_world().size());
  Shape sh = shapes()[0];
  AttnDims d = sh.d;
  d.B = 1, d.T = cp_local_rows(13, cp.size(), cp.rank()) + 1;
  std::vector<float> buf(size_t(64 * sh.row));
  try {
    cp_attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), d, 13, cp);
    FAIL() << "accepted d.T = " << d.T;
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cp_local_rows"), std::string::npos) << e.what();
  }
}
