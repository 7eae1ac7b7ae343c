// test_mpi_vocab.cpp: vocabulary parallelism (vocab_parallel.h) under mpirun -np 2 and 4: the vocabulary split, the
// vocab-parallel embedding (all-reduce and reduce-scatter forms) bitwise against the single-process embedding, and
// the vocab-parallel fused linear cross-entropy against the unfused reference in double (linear_xent_ref) and
// against the single-process fused kernel, plus a finite-difference check of its gradient. Each test runs on two
// tp groups: the whole world (P = 2 or 4) and a split of it (np 4: ranks 0-2 form P = 3, rank 3 alone P = 1; np 2:
// each rank alone, P = 1). Every rank generates the same full inputs and takes its shard. Not a benchmark.
//
// Tolerances (h [N, C], W [V, C], d = dlogits, u = 2^-24, u_d = 2^-53, s = loss_scale, n_valid = rows with a
// target, r_b = 2^-8 for bf16 dlogits (one bf16 ulp, relative; 0 for fp32)):
// vs the reference in double: the single-process bounds of tests/ops/loss_cases.cpp (derived there), with the two
// sums the split reassociates widened:
//   dz = C u max_{n,v} sum_c |h_nc||W_vc|  (0 for the _exact inputs: multiples of 1/8, every logit exact)
//   loss per row  2 dz + 16 u (1 + max row loss) + 2 (V + P) u_d   (the last term: the shards' double sums of exps
//                 summed over P ranks, V + P additions in all; the max is exact, the target logit a copy)
//   dh            2 s max|W| (2 dz + 8 u + r_b/2 + (V + P) u)  (the K = V sum of dlogits . W is now Vl terms in the
//                 shard's GEMM plus P in the fp32 all-reduce: at most V + P additions, gamma <= (V + P) u)
//   dW            n_valid s max|h| (2 dz + 8 u + r_b/2 + N u)  (each shard's rows: the same K = N GEMM as one process)
// vs the single-process fused kernel, on the _exact inputs (the logits are exact in both, so the max, every
// e = exp(z - max) and the target logit are bitwise the same; only the double sum of the e's is reassociated):
//   sums S1, S2 of the same V terms in two orders: |S1 - S2| <= 2 (V - 1) u_d S, so per row
//   |d loss| <= 2 (V + 2) u_d (1 + max row loss); inv = float(s / S) can then differ by one float ulp (2^-23
//   relative), so |d d_v| <= 2^-22 |d_v| + [v = t] 2^-23 s (+ one bf16 ulp, r_b |d_v|, for bf16 dlogits);
//   dh: sum_v |d d_v| |W_vc| + both GEMMs' rounding <= s max|W| (2^-21 + 2^-23 + 2 r_b + 4 (V + P) u);
//   dW: n_valid s max|h| (2^-22 + 2^-23 + r_b + 2 N u).
// On the random inputs the comparison with the single-process kernel takes the sum of both kernels' bounds against
// the reference (the logits GEMMs of a shard and of the whole W need not round alike). With P = 1 every result is
// held bitwise to the single-process kernel.
// Gradient check: central differences of the vocab-parallel fp32 forward along a random +-1 direction of h (then of
// W), eps = 2^-10 on the _exact inputs, where h +- eps u stays exact (multiples of 2^-10, |z| <= 20: 15 bits) so every
// logit is exact in fp32: |FD - <grad, u>| <= 2 delta / (2 eps) + eps^2 / 6 |L'''|, delta = the forward's loss
// bound above (dz = 0), |L'''| <= s sum_n (2 max_v |w_nv|)^3 with w = the direction in logit space.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/gemm.h"
#include "moetron/loss.h"
#include "moetron/vocab_parallel.h"

using namespace moetron;

namespace {

Comm& world() {
  static Comm w = comm_world();
  return w;
}

// The tp groups every test runs on: the whole world, and a split of it (see the file comment).
const std::vector<Comm>& tp_groups() {
  static std::vector<Comm> g = [] {
    Comm& w = world();
    const int color = w.size() == 4 ? (w.rank() < 3 ? 0 : 1) : w.rank();
    return std::vector<Comm>{w, w.split(color, w.rank())};
  }();
  return g;
}

struct Buf {  // 64-byte aligned scratch
  void* p = nullptr;
  explicit Buf(size_t b) { p = b ? std::aligned_alloc(64, (b + 63) / 64 * 64) : nullptr; }
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

std::vector<float> randn(int64_t n, uint32_t seed, float scale) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = scale * nd(g);
  return v;
}
std::vector<double> f64(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }
std::vector<bf16> to_bf(const std::vector<float>& v) {
  std::vector<bf16> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = to_bf16(v[i]);
  return b;
}

// Inputs alike on every rank. Targets: ~15% ignored, every shard boundary of a P-way split (v0 and v1 - 1 of each
// rank), the first and last vocabulary rows, the rest random.
struct Case {
  int64_t N, C, V, chunk;
  bool bf, exact;
  std::vector<float> h, W;
  std::vector<int32_t> t;
  Case(int64_t N_, int64_t C_, int64_t V_, int64_t chunk_, bool bf_, bool exact_, int P)
      : N(N_), C(C_), V(V_), chunk(chunk_), bf(bf_), exact(exact_) {
    h = randn(N * C, 11, 1.0f);
    W = randn(V * C, 12, 0.5f);
    if (exact) {  // multiples of 1/8 in [-1/2, 1/2]: every product and partial sum of a logit is exact in fp32
      for (auto& x : h) x = std::max(-4.0f, std::min(4.0f, std::nearbyint(x * 2.0f))) / 8.0f;
      for (auto& x : W) x = std::max(-4.0f, std::min(4.0f, std::nearbyint(x * 4.0f))) / 8.0f;
    }
    if (bf) {
      for (auto& x : h) x = round_bf16(x);
      for (auto& x : W) x = round_bf16(x);
    }
    std::mt19937 g(13);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    t.resize(size_t(N));
    for (auto& x : t) {
      const float u = ud(g);
      x = u < 0.15f ? kIgnoreIndex : int32_t(std::min<int64_t>(V - 1, int64_t(ud(g) * float(V))));
    }
    std::vector<int32_t> bounds{0, int32_t(V - 1)};
    for (int r = 0; r < P; ++r) {
      const VocabRange vr = vocab_shard_range(V, r, P);
      bounds.push_back(int32_t(vr.v0));
      bounds.push_back(int32_t(vr.v1 - 1));
    }
    for (size_t i = 0; i < bounds.size() && 2 * i + 1 < size_t(N); ++i) t[2 * i + 1] = bounds[i];
  }
  int64_t valid() const {
    int64_t k = 0;
    for (auto x : t) k += x >= 0;
    return k;
  }
};

struct Result {
  double loss = 0;
  std::vector<float> dh;  // [N, C], the full rows (assembled from the reduce-scatter's if needed)
  std::vector<float> dW;  // this rank's rows [Vl, C]
  std::vector<double> row_loss;
};

// The vocab-parallel fwd+bwd on tp with dh_mode; dW starts from dW0's rows of this shard.
Result run_parallel(const Case& c, const Comm& tp, TpReduce mode, float scale, const std::vector<float>& dW0) {
  const VocabRange vr = vocab_shard_range(c.V, tp.rank(), tp.size());
  const int64_t P = tp.size();
  Result r;
  r.dW.assign(dW0.begin() + vr.v0 * c.C, dW0.begin() + vr.v1 * c.C);
  const int64_t dh_rows = mode == TpReduce::ReduceScatter ? c.N / P : c.N;
  std::vector<float> dh(size_t(dh_rows * c.C), 123.0f);
  Buf ws(vocab_xent_workspace_bytes(c.N, c.C, c.V, int(P), c.chunk, mode));
  if (c.bf) {
    const auto hb = to_bf(c.h), Wb = to_bf(std::vector<float>(c.W.begin() + vr.v0 * c.C, c.W.begin() + vr.v1 * c.C));
    r.loss = vocab_xent_fwd_bwd_bf16(dh.data(), r.dW.data(), hb.data(), Wb.data(), c.t.data(), c.N, c.C, c.V, tp, mode,
                                     scale, c.chunk, ws.p);
  } else {
    r.loss = vocab_xent_fwd_bwd_f32(dh.data(), r.dW.data(), c.h.data(), c.W.data() + vr.v0 * c.C, c.t.data(), c.N, c.C,
                                    c.V, tp, mode, scale, c.chunk, ws.p);
  }
  if (mode == TpReduce::ReduceScatter) {
    r.dh.resize(size_t(c.N * c.C));
    tp.all_gather(r.dh.data(), dh.data(), dh_rows * c.C * 4);
  } else {
    r.dh = dh;
  }
  return r;
}

// The vocab-parallel forward only.
Result run_parallel_fwd(const Case& c, const Comm& tp, float scale) {
  const VocabRange vr = vocab_shard_range(c.V, tp.rank(), tp.size());
  Result r;
  r.row_loss.assign(size_t(c.N), -1.0);
  Buf ws(vocab_xent_workspace_bytes(c.N, c.C, c.V, tp.size(), c.chunk, TpReduce::None));
  if (c.bf) {
    const auto hb = to_bf(c.h), Wb = to_bf(std::vector<float>(c.W.begin() + vr.v0 * c.C, c.W.begin() + vr.v1 * c.C));
    r.loss = vocab_xent_fwd_bf16(r.row_loss.data(), hb.data(), Wb.data(), c.t.data(), c.N, c.C, c.V, tp, scale, c.chunk,
                                 ws.p);
  } else {
    r.loss = vocab_xent_fwd_f32(r.row_loss.data(), c.h.data(), c.W.data() + vr.v0 * c.C, c.t.data(), c.N, c.C, c.V, tp,
                                scale, c.chunk, ws.p);
  }
  return r;
}

// The single-process fused kernel on the whole W (dW [V, C] from dW0).
Result run_single(const Case& c, float scale, const std::vector<float>& dW0) {
  Result r;
  r.dh.assign(size_t(c.N * c.C), 0.0f);
  r.dW = dW0;
  const int64_t ch = c.chunk > 0 ? c.chunk : 0;
  Buf ws(linear_xent_workspace_bytes(c.N, c.V, ch));
  if (c.bf) {
    const auto hb = to_bf(c.h), Wb = to_bf(c.W);
    r.loss = linear_xent_fwd_bwd_bf16(r.dh.data(), r.dW.data(), hb.data(), Wb.data(), c.t.data(), c.N, c.C, c.V, scale,
                                      ch, ws.p);
  } else {
    r.loss = linear_xent_fwd_bwd_f32(r.dh.data(), r.dW.data(), c.h.data(), c.W.data(), c.t.data(), c.N, c.C, c.V, scale,
                                     ch, ws.p);
  }
  return r;
}

// Largest |a - b| over n elements, and whether it is within tol (NaN fails).
double max_err(const float* a, const double* b, int64_t n) {
  double e = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::fabs(double(a[i]) - b[i]);
    e = std::isnan(d) ? INFINITY : std::max(e, d);
  }
  return e;
}
double max_err(const float* a, const float* b, int64_t n) {
  double e = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    e = std::isnan(d) ? INFINITY : std::max(e, d);
  }
  return e;
}

struct Tol {
  double loss_row, loss, dh, dW;                  // vs the reference in double
  double single_loss, single_dh, single_dW;        // vs the single-process kernel
};

Tol tolerances(const Case& c, const std::vector<double>& rl_ref, float scale, int P) {
  const auto hd = f64(c.h), Wd = f64(c.W);
  double dzsum = 0, maxW = 0, maxh = 0, maxlse = 0;
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t v = 0; v < c.V; ++v) {
      double s = 0;
      for (int64_t k = 0; k < c.C; ++k) s += std::fabs(hd[n * c.C + k] * Wd[v * c.C + k]);
      dzsum = std::max(dzsum, s);
    }
  for (double x : Wd) maxW = std::max(maxW, std::fabs(x));
  for (double x : hd) maxh = std::max(maxh, std::fabs(x));
  for (double x : rl_ref) maxlse = std::max(maxlse, std::fabs(x));
  const double u = std::ldexp(1.0, -24), ud = std::ldexp(1.0, -53), s = scale, nv = double(c.valid());
  const double dz = c.exact ? 0.0 : double(c.C) * u * dzsum;
  const double rb = c.bf ? std::ldexp(1.0, -8) : 0.0;
  const double dd = 2 * dz + 8 * u + rb / 2;  // rb/2: round to nearest, half a bf16 ulp (loss_cases' 2^-9)
  Tol t;
  t.loss_row = 2 * dz + 16 * u * (1 + maxlse) + 2 * double(c.V + P) * ud;
  t.loss = s * nv * t.loss_row;
  t.dh = 2 * s * maxW * (dd + double(c.V + P) * u);
  t.dW = nv * s * maxh * (dd + double(c.N) * u);
  if (c.exact) {
    t.single_loss = s * nv * 2 * double(c.V + 2) * ud * (1 + maxlse) + double(c.N) * ud * s * nv * (1 + maxlse);
    t.single_dh = s * maxW * (std::ldexp(1.0, -21) + std::ldexp(1.0, -23) + 2 * rb + 4 * double(c.V + P) * u);
    t.single_dW = nv * s * maxh * (std::ldexp(1.0, -22) + std::ldexp(1.0, -23) + rb + 2 * double(c.N) * u);
  } else {  // both kernels' bounds against the reference
    t.single_loss = 2 * t.loss;
    t.single_dh = 2 * t.dh;
    t.single_dW = 2 * t.dW;
  }
  return t;
}

std::string where(const Comm& tp, const Case& c, const char* mode) {
  return "P=" + std::to_string(tp.size()) + " rank " + std::to_string(tp.rank()) + (c.bf ? " bf16" : " f32") +
         (c.exact ? " exact" : " random") + " N=" + std::to_string(c.N) + " V=" + std::to_string(c.V) +
         " chunk=" + std::to_string(c.chunk) + " " + mode;
}

void expect_alike(const Comm& tp, const void* x, int64_t bytes, const std::string& what) {
  std::vector<char> all(static_cast<size_t>(bytes * tp.size()));
  tp.all_gather(all.data(), x, bytes);
  for (int q = 0; q < tp.size(); ++q)
    EXPECT_EQ(0, std::memcmp(all.data() + q * bytes, x, size_t(bytes))) << what << ": rank " << q << " differs";
}

// One case on one tp group: every check of the loss.
void check_loss_case(const Comm& tp, int64_t N, int64_t C, int64_t V, int64_t chunk, bool bf, bool exact) {
  const int P = tp.size();
  const Case c(N, C, V, chunk, bf, exact, P);
  const float scale = 1.0f / float(std::max<int64_t>(c.valid(), 1));
  const VocabRange vr = vocab_shard_range(V, tp.rank(), P);
  const auto dW0 = randn(V * C, 14, 0.01f);
  // The reference in double on the whole vocabulary.
  const auto hd = f64(c.h), Wd = f64(c.W);
  std::vector<double> dh_ref(static_cast<size_t>(N * C)), dW_ref = f64(dW0), rl_ref(static_cast<size_t>(N));
  const double loss_ref = linear_xent_ref<double>(rl_ref.data(), dh_ref.data(), dW_ref.data(), hd.data(), Wd.data(),
                                                  c.t.data(), N, C, V, double(scale));
  const Tol tol = tolerances(c, rl_ref, scale, P);
  const Result single = run_single(c, scale, dW0);
  Result ar;
  for (TpReduce mode : {TpReduce::AllReduce, TpReduce::ReduceScatter, TpReduce::None}) {
    const char* mname = mode == TpReduce::AllReduce ? "all_reduce" : mode == TpReduce::ReduceScatter ? "reduce_scatter"
                                                                                                     : "none";
    const std::string at = where(tp, c, mname);
    Result r = run_parallel(c, tp, mode, scale, dW0);
    if (mode == TpReduce::None) {  // the partials summed over tp (Comm's order) are the all-reduced dh, bitwise
      tp.all_reduce(r.dh.data(), N * C);
      EXPECT_EQ(r.dh, ar.dh) << at << ": partials summed != all-reduced dh";
      continue;
    }
    if (mode == TpReduce::ReduceScatter) {  // the reduce-scatter's rows are the all-reduce's, bitwise
      EXPECT_EQ(0, std::memcmp(&r.loss, &ar.loss, 8)) << at;
      EXPECT_EQ(r.dh, ar.dh) << at << ": reduce-scattered rows != all-reduced dh";
      EXPECT_EQ(r.dW, ar.dW) << at;
      continue;
    }
    ar = r;
    expect_alike(tp, &r.loss, 8, at + " loss");
    expect_alike(tp, r.dh.data(), N * C * 4, at + " dh");
    EXPECT_LE(std::fabs(r.loss - loss_ref), tol.loss) << at << " loss " << r.loss << " ref " << loss_ref;
    EXPECT_LE(max_err(r.dh.data(), dh_ref.data(), N * C), tol.dh) << at << " dh vs ref";
    EXPECT_LE(max_err(r.dW.data(), dW_ref.data() + vr.v0 * C, vr.size() * C), tol.dW) << at << " dW vs ref";
    if (world().rank() == 0) {  // the measured errors against their bounds, for the record
      std::printf("  [%s] vs ref: loss %.2g/%.2g dh %.2g/%.2g dW %.2g/%.2g; vs single: loss %.2g/%.2g dh %.2g/%.2g "
                  "dW %.2g/%.2g\n",
                  at.c_str(), std::fabs(r.loss - loss_ref), tol.loss, max_err(r.dh.data(), dh_ref.data(), N * C), tol.dh,
                  max_err(r.dW.data(), dW_ref.data() + vr.v0 * C, vr.size() * C), tol.dW, std::fabs(r.loss - single.loss),
                  tol.single_loss, max_err(r.dh.data(), single.dh.data(), N * C), tol.single_dh,
                  max_err(r.dW.data(), single.dW.data() + vr.v0 * C, vr.size() * C), tol.single_dW);
    }
    if (P == 1) {  // one shard: bitwise the single-process kernel
      EXPECT_EQ(0, std::memcmp(&r.loss, &single.loss, 8)) << at << " loss " << r.loss << " vs " << single.loss;
      EXPECT_EQ(r.dh, single.dh) << at;
      EXPECT_EQ(r.dW, single.dW) << at;
    } else {
      EXPECT_LE(std::fabs(r.loss - single.loss), tol.single_loss) << at << " loss vs single " << single.loss;
      EXPECT_LE(max_err(r.dh.data(), single.dh.data(), N * C), tol.single_dh) << at << " dh vs single";
      EXPECT_LE(max_err(r.dW.data(), single.dW.data() + vr.v0 * C, vr.size() * C), tol.single_dW)
          << at << " dW vs single";
    }
    // Ignored rows: zero dh.
    bool ign = true;
    for (int64_t n = 0; n < N; ++n)
      if (c.t[size_t(n)] < 0)
        for (int64_t k = 0; k < C; ++k) ign &= r.dh[size_t(n * C + k)] == 0.0f;
    EXPECT_TRUE(ign) << at << ": an ignored row has a nonzero dh";
    // Run to run, bitwise.
    const Result again = run_parallel(c, tp, mode, scale, dW0);
    EXPECT_TRUE(std::memcmp(&again.loss, &r.loss, 8) == 0 && again.dh == r.dh && again.dW == r.dW) << at;
  }
  // Forward only: the same loss bitwise, per-row losses alike on every rank and within the row bound.
  const std::string at = where(tp, c, "forward only");
  const Result f = run_parallel_fwd(c, tp, scale);
  EXPECT_EQ(0, std::memcmp(&f.loss, &ar.loss, 8)) << at << " " << f.loss << " vs " << ar.loss;
  expect_alike(tp, f.row_loss.data(), N * 8, at + " row_loss");
  double e = 0;
  for (int64_t n = 0; n < N; ++n) e = std::max(e, std::fabs(f.row_loss[size_t(n)] - rl_ref[size_t(n)]));
  EXPECT_LE(e, tol.loss_row) << at << " row loss vs ref";
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------

TEST(VocabSplit, RangesCoverTheVocabularyAndOwnersAgree) {
  for (int64_t V : {1, 3, 7, 64, 1000, 1003, 50257})
    for (int P = 1; P <= 8 && P <= V; ++P) {
      int64_t next = 0;
      for (int r = 0; r < P; ++r) {
        const VocabRange vr = vocab_shard_range(V, r, P);
        EXPECT_EQ(vr.v0, next) << "V=" << V << " P=" << P << " r=" << r;
        EXPECT_TRUE(vr.size() == V / P || vr.size() == (V + P - 1) / P) << "V=" << V << " P=" << P << " r=" << r;
        EXPECT_LE(vr.size(), vocab_shard_max_rows(V, P));
        for (int64_t v = vr.v0; v < vr.v1; ++v) ASSERT_EQ(vocab_shard_owner(V, P, v), r) << "V=" << V << " v=" << v;
        next = vr.v1;
      }
      EXPECT_EQ(next, V);
    }
}

TEST(VocabSplit, RefusesByName) {
  const Comm& tp = tp_groups()[0];
  auto msg = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg([] { vocab_shard_range(3, 0, 4); }).find("at least one row per tp rank"), std::string::npos);
  if (tp.size() > 1) {
    const int64_t N = tp.size() + 1, d = 4, V = 16;
    std::vector<float> x(static_cast<size_t>(N * d)), E(size_t(V * d));
    std::vector<int32_t> tok(size_t(N), 0);
    Buf ws(vocab_embed_workspace_bytes(N, d, TpReduce::ReduceScatter));
    EXPECT_NE(msg([&] { vocab_embed_forward(x.data(), E.data(), tok.data(), N, d, V, tp, TpReduce::ReduceScatter, ws.p); })
                  .find("tp must divide N"),
              std::string::npos);
  }
  std::vector<float> x(8), E(8);
  std::vector<int32_t> tok{0, 9};
  EXPECT_NE(msg([&] { vocab_embed_forward(x.data(), E.data(), tok.data(), 2, 4, 8, comm_local(), TpReduce::AllReduce,
                                          nullptr); })
                .find("tokens[1]=9 outside [0, V=8)"),
            std::string::npos);
}

// The embedding: forward in both forms bitwise E[token] (E holds -0.0 entries: the non-owners' -0.0 keeps them);
// backward bitwise the single-process scatter-add (tokens repeat many times with mixed magnitudes, so any other
// order of the additions would show).
TEST(VocabEmbed, ForwardAndBackwardBitwiseTheSingleProcess) {
  for (const Comm& tp : tp_groups()) {
    const int P = tp.size();
    const int64_t N = 96, d = 24, V = 1003;
    const VocabRange vr = vocab_shard_range(V, tp.rank(), P);
    auto E = randn(V * d, 21, 1.0f);
    for (int64_t i = 0; i < V * d; i += 7) E[size_t(i)] = -0.0f;
    std::vector<int32_t> tok(static_cast<size_t>(N));
    std::mt19937 g(22);
    for (auto& x : tok) x = int32_t(g() % 8 == 0 ? g() % uint32_t(V) : g() % 5);  // mostly 5 tokens, repeated
    for (int r = 0; r < P; ++r) {  // every shard boundary
      tok[size_t(4 * r + 10)] = int32_t(vocab_shard_range(V, r, P).v0);
      tok[size_t(4 * r + 11)] = int32_t(vocab_shard_range(V, r, P).v1 - 1);
    }
    auto gr = randn(N * d, 23, 1.0f);
    for (int64_t i = 0; i < N * d; i += 3) gr[size_t(i)] *= 1e6f;
    // The single process (model_embed_head.cpp).
    std::vector<float> x_ref(static_cast<size_t>(N * d)), gE_ref(size_t(V * d), 0.25f);
    for (int64_t n = 0; n < N; ++n) std::memcpy(&x_ref[size_t(n * d)], &E[size_t(tok[size_t(n)] * d)], size_t(d) * 4);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < d; ++i) gE_ref[size_t(tok[size_t(n)] * d + i)] += gr[size_t(n * d + i)];
    const std::vector<float> Es(E.begin() + vr.v0 * d, E.begin() + vr.v1 * d);
    for (TpReduce mode : {TpReduce::AllReduce, TpReduce::ReduceScatter}) {
      const std::string at = "P=" + std::to_string(P) + " rank " + std::to_string(tp.rank()) +
                             (mode == TpReduce::AllReduce ? " all_reduce" : " reduce_scatter");
      const bool rs = mode == TpReduce::ReduceScatter;
      const int64_t rows = rs ? N / P : N, r0 = rs ? tp.rank() * N / P : 0;
      Buf ws(vocab_embed_workspace_bytes(N, d, mode));
      std::vector<float> x(size_t(rows * d), 7.0f);
      vocab_embed_forward(x.data(), Es.data(), tok.data(), N, d, V, tp, mode, ws.p);
      EXPECT_EQ(0, std::memcmp(x.data(), &x_ref[size_t(r0 * d)], size_t(rows * d) * 4)) << at << " forward";
      std::vector<float> gE(gE_ref.size(), 0.25f);
      std::vector<float> gEs(gE.begin() + vr.v0 * d, gE.begin() + vr.v1 * d);
      vocab_embed_backward(gEs.data(), &gr[size_t(r0 * d)], tok.data(), N, d, V, tp, mode, ws.p);
      EXPECT_EQ(0, std::memcmp(gEs.data(), &gE_ref[size_t(vr.v0 * d)], size_t(vr.size() * d) * 4)) << at << " backward";
    }
  }
}

// The loss: fp32 and bf16, exact and random inputs, a chunk that splits N unevenly and the default chunk, V = 1003
// (not divisible by 2, 3 or 4) and V = 64.
TEST(VocabXent, MatchesTheReferenceAndTheSingleProcessKernel) {
  for (const Comm& tp : tp_groups())
    for (bool bf : {false, true})
      for (bool exact : {true, false}) {
        check_loss_case(tp, 48, 40, 1003, 20, bf, exact);
        check_loss_case(tp, 12, 32, 64, 0, bf, exact);
      }
}

// A non-finite logit on one shard makes that row's loss, and the total, NaN on every rank.
TEST(VocabXent, NonFiniteLogitOnOneShardIsNaNEverywhere) {
  for (const Comm& tp : tp_groups()) {
    Case c(24, 16, 101, 8, false, false, tp.size());
    const int64_t row = 2;
    c.t[size_t(row)] = 0;
    const int P = tp.size();
    const VocabRange last = vocab_shard_range(c.V, P - 1, P);
    for (int64_t k = 0; k < c.C; ++k) c.W[size_t(last.v1 - 1) * c.C + k] = k == 0 ? INFINITY : 0.0f;  // last shard
    const Result r = run_parallel_fwd(c, tp, 1.0f);
    EXPECT_TRUE(std::isnan(r.loss) && std::isnan(r.row_loss[size_t(row)])) << "P=" << P << " rank " << tp.rank();
  }
}

// Central differences of the vocab-parallel fp32 forward along a +-1 direction of h, then of W (file comment).
TEST(VocabXent, GradientMatchesFiniteDifferences) {
  for (const Comm& tp : tp_groups()) {
    const int P = tp.size();
    Case c(24, 20, 203, 8, false, true, P);
    const float scale = 1.0f / float(c.valid());
    const VocabRange vr = vocab_shard_range(c.V, tp.rank(), P);
    const std::vector<float> dW0(size_t(c.V * c.C), 0.0f);
    const Result g = run_parallel(c, tp, TpReduce::AllReduce, scale, dW0);
    std::vector<double> rl(static_cast<size_t>(c.N));
    linear_xent_ref<double>(rl.data(), nullptr, nullptr, f64(c.h).data(), f64(c.W).data(), c.t.data(), c.N, c.C, c.V,
                            double(scale));
    const double eps = std::ldexp(1.0, -10);
    std::mt19937 gen(31);
    for (int which = 0; which < 2; ++which) {  // 0: h, 1: W
      std::vector<float>& x = which == 0 ? c.h : c.W;
      std::vector<float> u(x.size());
      for (auto& v : u) v = gen() % 2 ? 1.0f : -1.0f;
      const std::vector<float> x0 = x;
      auto loss_at = [&](double sgn) {
        for (size_t i = 0; i < x.size(); ++i) x[i] = float(double(x0[i]) + sgn * eps * double(u[i]));
        const double l = run_parallel_fwd(c, tp, scale).loss;
        x = x0;
        return l;
      };
      const double fd = (loss_at(1.0) - loss_at(-1.0)) / (2 * eps);
      // <grad, u>: dh is whole on every rank; dW's rows are sharded, so sum the shards' parts over tp.
      double an = 0;
      if (which == 0) {
        for (size_t i = 0; i < u.size(); ++i) an += double(g.dh[i]) * double(u[i]);
      } else {
        for (int64_t i = 0; i < vr.size() * c.C; ++i) an += double(g.dW[size_t(i)]) * double(u[size_t(vr.v0 * c.C + i)]);
        tp.all_reduce(&an, 1);
      }
      // |L'''| along the direction: s sum_n (2 max_v |w_nv|)^3, w = u . W^T (h direction) or h . U^T (W direction).
      double l3 = 0;
      for (int64_t n = 0; n < c.N; ++n) {
        if (c.t[size_t(n)] < 0) continue;
        double m = 0;
        for (int64_t v = 0; v < c.V; ++v) {
          double w = 0;
          for (int64_t k = 0; k < c.C; ++k)
            w += which == 0 ? double(u[size_t(n * c.C + k)]) * c.W[size_t(v * c.C + k)]
                            : double(c.h[size_t(n * c.C + k)]) * u[size_t(v * c.C + k)];
          m = std::max(m, std::fabs(w));
        }
        l3 += double(scale) * std::pow(2 * m, 3);
      }
      // delta: the forward's loss error with exact logits: the max, z - max and the target logit are exact, each
      // e = exp(z - max) is within 9 u (the polynomial's 2^-26 truncation and at most 8 fp32 roundings), the double
      // sums and the row formula add 2 (V + P) u_d + 4 u_d (1 + max row loss).
      const double u24 = std::ldexp(1.0, -24), ud = std::ldexp(1.0, -53);
      double maxlse = 0;
      for (double x : rl) maxlse = std::max(maxlse, std::fabs(x));
      const double delta = double(scale) * double(c.valid()) * (9 * u24 + 2 * double(c.V + P) * ud + 4 * ud * (1 + maxlse));
      const double bound = 2 * delta / (2 * eps) + eps * eps / 6 * l3;
      EXPECT_LE(std::fabs(fd - an), bound) << "P=" << P << " rank " << tp.rank() << (which ? " W" : " h") << ": FD "
                                           << fd << " analytic " << an;
      if (tp.rank() == 0 && world().rank() == 0)
        std::printf("  [grad P=%d %s] FD %.9g analytic %.9g |diff| %.3g bound %.3g (rounding %.3g, truncation %.3g)\n",
                    P, which ? "W" : "h", fd, an, std::fabs(fd - an), bound, delta / eps, eps * eps / 6 * l3);
    }
  }
}
