// ep_check.h: the EP dispatch/combine check shared by the single-process unit tests and the MPI tests.
// Every rank can regenerate every rank's tokens and routing from (seed, source rank), so each expert rank
// knows exactly which (source, token, slot) rows it must receive, in which order, with which payload; the
// payload also carries (source rank, token) in its first two values (DeepEP style) and the check asserts
// them. The experts apply y = x * (global expert id + 1) and the combine is compared with the single-process
// computation (moe_unpermute over the same rows) bitwise for fp32 rows. The backward helpers (redispatch,
// combine_scalars) are checked the same way against moe_unpermute_backward.
// Not a benchmark. Collective: every rank must call check_ep with the same arguments except the comm rank.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "moetron/comm.h"
#include "moetron/dtype.h"
#include "moetron/ep_dispatch.h"
#include "moetron/fp8.h"
#include "moetron/permute.h"

namespace ep_check {

using namespace moetron;

enum class Route {
  Random,       // k distinct uniform experts per token
  Skewed,       // every token picks experts 0..k-1 (slot s -> expert s): one rank gets (nearly) everything
  Empty,        // like Random, but odd ranks have no tokens at all
  NodeLimited,  // Random scores, node-limited to one node (ep_node_limited_topk, max_nodes = 1)
  Dropped,      // like Random, with dropped slots (topk_idx = -1, as capacity_factor > 0 makes them): about a
                // third of the slots, every slot of every 4th token, and every slot of the last rank (P > 1)
};

inline uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline float unit(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {  // in [-1, 1)
  const uint64_t h = mix(seed ^ mix(a ^ mix(b ^ mix(c))));
  return float(int64_t(h >> 40) - (int64_t(1) << 23)) / float(1 << 23);
}

struct Tokens {
  int64_t N = 0;
  std::vector<float> x, w;  // [N, D], [N, k]
  std::vector<int32_t> idx;  // [N, k]
};

inline int64_t tokens_of(int src, int64_t n_base, Route r) {
  if (r == Route::Empty && src % 2 == 1) return 0;
  return n_base + (src * 7) % 5;  // ranks hold different N
}

inline Tokens make_tokens(int src, int64_t n_base, Route route, int E, int k, int64_t D, int n_nodes,
                          uint64_t seed, int n_ranks = 1) {
  Tokens T;
  T.N = tokens_of(src, n_base, route);
  T.x.resize(size_t(T.N * D));
  T.w.resize(size_t(T.N * k));
  T.idx.resize(size_t(T.N * k));
  for (int64_t t = 0; t < T.N; ++t) {
    float* xr = T.x.data() + t * D;
    for (int64_t d = 0; d < D; ++d) xr[d] = unit(seed, uint64_t(src), uint64_t(t), uint64_t(d) + 7);
    xr[0] = float(src);  // the payload says where it came from
    if (D > 1) xr[1] = float(t);
    float sum = 0;
    for (int s = 0; s < k; ++s) sum += (T.w[size_t(t * k + s)] = 0.25f + std::fabs(unit(seed, 99, uint64_t(src), uint64_t(t * k + s))));
    for (int s = 0; s < k; ++s) T.w[size_t(t * k + s)] /= sum;
  }
  if (route == Route::Skewed) {
    for (int64_t t = 0; t < T.N; ++t)
      for (int s = 0; s < k; ++s) T.idx[size_t(t * k + s)] = s;
  } else if (route == Route::NodeLimited) {
    std::vector<float> q(size_t(T.N * E));
    for (int64_t i = 0; i < T.N * E; ++i) q[size_t(i)] = unit(seed, 5, uint64_t(src), uint64_t(i));
    ep_node_limited_topk(T.idx.data(), q.data(), T.N, E, k, n_nodes, 1);
  } else {
    std::vector<int> perm(static_cast<size_t>(E));
    for (int64_t t = 0; t < T.N; ++t) {
      for (int e = 0; e < E; ++e) perm[size_t(e)] = e;
      for (int s = 0; s < k; ++s) {  // partial Fisher-Yates
        const uint64_t h = mix(seed ^ mix(uint64_t(src) * 1000003ull + uint64_t(t * k + s)));
        const int j = s + int(h % uint64_t(E - s));
        std::swap(perm[size_t(s)], perm[size_t(j)]);
        T.idx[size_t(t * k + s)] = perm[size_t(s)];
      }
    }
  }
  if (route == Route::Dropped)
    for (int64_t t = 0; t < T.N; ++t)
      for (int s = 0; s < k; ++s) {
        const bool all = (src == n_ranks - 1 && n_ranks > 1) || t % 4 == 1;
        if (all || mix(seed ^ mix(uint64_t(src) * 7777ull + uint64_t(t * k + s))) % 3 == 0) T.idx[size_t(t * k + s)] = -1;
      }
  return T;
}

// What the expert rank sees for a token row after the dispatch payload round trip.
inline void seen_rows(float* out, const float* x, int64_t n, int64_t D, EpPayload p) {
  if (n == 0) return;
  if (p == EpPayload::F32) {
    std::memcpy(out, x, size_t(n * D * 4));
  } else if (p == EpPayload::BF16) {
    for (int64_t i = 0; i < n * D; ++i) out[i] = round_bf16(x[i]);
  } else {
    std::vector<uint8_t> q(size_t(n * D));
    std::vector<float> sc(size_t(fp8_num_scales(n, D, Fp8Scaling::Block, 1, 128)));
    fp8_quantize(q.data(), sc.data(), x, n, D, Fp8Format::E4M3, Fp8Scaling::Block, 1, 128);
    fp8_dequantize(out, q.data(), sc.data(), n, D, Fp8Format::E4M3, Fp8Scaling::Block, 1, 128);
  }
}

struct Result {
  EpTraffic dispatch, combine;  // this rank, this call
  double fp8_max_rel_err = 0;   // max |x' - x| / amax(block) over the received rows
  int64_t R = 0;
};

// Runs one dispatch + weighted combine + unweighted combine and checks everything it can.
inline Result check_ep(const Comm& comm, EpDispatch& ep, Route route, int64_t n_base, uint64_t seed) {
  const EpDispatchConfig& cfg = ep.config();
  const int P = comm.size(), me = comm.rank(), E = cfg.n_experts, k = cfg.topk, El = E / P;
  const int64_t D = cfg.hidden;
  const int L = (cfg.ranks_per_node == 0 || cfg.ranks_per_node >= P) ? P : cfg.ranks_per_node;
  const int n_nodes = P / L;
  const bool hier = cfg.kind == EpDispatcher::Hierarchical;
  Result res;

  std::vector<Tokens> all;
  for (int src = 0; src < P; ++src) all.push_back(make_tokens(src, n_base, route, E, k, D, n_nodes, seed, P));
  const Tokens& mine = all[size_t(me)];
  std::vector<std::vector<float>> seen_all(static_cast<size_t>(P));  // every source's rows as the experts see them
  for (int src = 0; src < P; ++src) {
    seen_all[size_t(src)].resize(all[size_t(src)].x.size());
    seen_rows(seen_all[size_t(src)].data(), all[size_t(src)].x.data(), all[size_t(src)].N, D, cfg.dispatch_payload);
  }

  // land_rows: the rows land in a buffer of this check's (odd seeds) or, when the landing has no room (even
  // seeds), in the dispatcher's own; either way undecoded, in the payload's type. rx: them as fp32.
  std::vector<char> landing;
  int64_t land_calls = 0, land_R = -1;
  const bool room = seed % 2 == 1;
  const int64_t R = !cfg.land_rows ? ep.dispatch(mine.x.data(), mine.idx.data(), mine.w.data(), mine.N)
                                   : ep.dispatch(mine.x.data(), mine.idx.data(), mine.w.data(), mine.N,
                                                 [&](int64_t r) -> void* {
                                                   ++land_calls, land_R = r;
                                                   if (!room) return nullptr;
                                                   const size_t wb = cfg.dispatch_payload == EpPayload::BF16 ? 2 : 4;
                                                   landing.assign(size_t(std::max<int64_t>(r, 1) * D) * wb, char(0x7f));
                                                   return landing.data();
                                                 });
  res.R = R;
  res.dispatch = ep.stats().last_dispatch;
  std::vector<float> rx(size_t(std::max<int64_t>(R, 1) * D));
  if (!cfg.land_rows) {
    if (R > 0) std::memcpy(rx.data(), ep.recv_x(), size_t(R * D) * 4);
  } else {
    EXPECT_EQ(land_calls, 1) << "rank " << me << ": the landing is asked once per dispatch";
    EXPECT_EQ(land_R, R) << "rank " << me << ": the landing is asked for R rows";
    EXPECT_EQ(ep.recv_x(), nullptr) << "rank " << me << ": no fp32 rows with land_rows";
    EXPECT_EQ(ep.recv_x_wire() == nullptr, room) << "rank " << me << ": recv_x_wire only when the landing had no room";
    const void* rows = room ? static_cast<const void*>(landing.data()) : ep.recv_x_wire();
    if (R > 0 && rows) {
      if (cfg.dispatch_payload == EpPayload::BF16)
        for (int64_t i = 0; i < R * D; ++i) rx[size_t(i)] = from_bf16(static_cast<const bf16*>(rows)[i]);
      else
        std::memcpy(rx.data(), rows, size_t(R * D) * 4);
    }
  }

  // ---- expected rows: (local expert, source, token, slot) order ----
  struct Row {
    int le, src, t, s;
  };
  std::vector<Row> want;
  for (int src = 0; src < P; ++src) {
    const Tokens& T = all[size_t(src)];
    for (int64_t t = 0; t < T.N; ++t)
      for (int s = 0; s < k; ++s) {
        const int e = T.idx[size_t(t * k + s)];
        if (e >= 0 && e / El == me) want.push_back({e % El, src, int(t), s});
      }
  }
  std::stable_sort(want.begin(), want.end(), [](const Row& a, const Row& b) {
    if (a.le != b.le) return a.le < b.le;
    if (a.src != b.src) return a.src < b.src;
    if (a.t != b.t) return a.t < b.t;
    return a.s < b.s;
  });
  EXPECT_EQ(R, int64_t(want.size())) << "rank " << me;
  if (R == int64_t(want.size())) {
    std::vector<int64_t> cnt(size_t(El), 0);
    for (const Row& r : want) ++cnt[size_t(r.le)];
    int64_t acc = 0;
    for (int le = 0; le < El; ++le) {
      EXPECT_EQ(ep.recv_offsets()[le], acc) << "rank " << me << " local expert " << le;
      EXPECT_EQ(ep.recv_counts()[le], cnt[size_t(le)]) << "rank " << me << " local expert " << le;
      acc += cnt[size_t(le)];
    }
    EXPECT_EQ(ep.recv_offsets()[El], R);
    int64_t bad_meta = 0, bad_payload = 0;
    for (int64_t r = 0; r < R; ++r) {
      const Row& w = want[size_t(r)];
      const Tokens& T = all[size_t(w.src)];
      if (ep.recv_src()[r] != w.src || ep.recv_token()[r] != w.t || ep.recv_slot()[r] != w.s ||
          ep.recv_weight()[r] != T.w[size_t(w.t * k + w.s)]) {
        if (bad_meta++ < 3)
          ADD_FAILURE() << "rank " << me << " row " << r << ": got (src " << ep.recv_src()[r] << ", token "
                        << ep.recv_token()[r] << ", slot " << ep.recv_slot()[r] << ") want (" << w.src << ", " << w.t
                        << ", " << w.s << ")";
        continue;
      }
      const float* got = rx.data() + r * D;
      const float* seen = seen_all[size_t(w.src)].data() + int64_t(w.t) * D;
      if (std::memcmp(got, seen, size_t(D * 4)) != 0) {
        if (bad_payload++ < 3) ADD_FAILURE() << "rank " << me << " row " << r << ": payload differs";
      }
      if (cfg.dispatch_payload == EpPayload::F32 && D > 1 && (got[0] != float(w.src) || got[1] != float(w.t)))
        ADD_FAILURE() << "rank " << me << " row " << r << ": payload says (" << got[0] << ", " << got[1] << ")";
      if (cfg.dispatch_payload == EpPayload::E4M3) {
        // E4M3 bound per element: half an ulp of 3 mantissa bits (2^-4 relative) for normals, 2^-10 * scale
        // for subnormals, plus the fp32 roundings of x / scale and q * scale.
        const float* x = T.x.data() + int64_t(w.t) * D;
        for (int64_t b0 = 0; b0 < D; b0 += 128) {
          const int64_t b1 = std::min(D, b0 + 128);
          float amax = 0;
          for (int64_t d = b0; d < b1; ++d) amax = std::max(amax, std::fabs(x[d]));
          const float scale = amax / 448.0f;
          for (int64_t d = b0; d < b1; ++d) {
            const float err = std::fabs(got[d] - x[d]);
            const float bound = std::ldexp(std::fabs(x[d]), -4) + std::ldexp(scale, -10) + std::ldexp(std::fabs(x[d]), -21);
            if (err > bound && bad_payload++ < 3)
              ADD_FAILURE() << "rank " << me << " e4m3 error " << err << " > bound " << bound << " at d=" << d;
            if (amax > 0) res.fp8_max_rel_err = std::max(res.fp8_max_rel_err, double(err / amax));
          }
        }
      }
    }
    EXPECT_EQ(bad_meta, 0) << "rank " << me;
    EXPECT_EQ(bad_payload, 0) << "rank " << me;
  }

  // ---- experts: y = x * (global expert id + 1), on the received rows ----
  std::vector<float> yr(size_t(std::max<int64_t>(R, 1) * D));
  for (int le = 0; le < El; ++le) {
    const float f = float(me * El + le + 1);
    for (int64_t r = ep.recv_offsets()[le]; r < ep.recv_offsets()[le + 1]; ++r)
      for (int64_t d = 0; d < D; ++d) yr[size_t(r * D + d)] = rx[size_t(r * D + d)] * f;
  }
  std::vector<float> y(size_t(std::max<int64_t>(mine.N, 1) * D), -7.0f), yu(y.size(), -7.0f);
  ep.combine(y.data(), yr.data(), true);
  res.combine = ep.stats().last_combine;
  ep.combine(yu.data(), yr.data(), false);

  // ---- single-process reference on the home rank ----
  const int64_t N = mine.N;
  const std::vector<float>& xs = seen_all[size_t(me)];
  std::vector<float> yp(size_t(std::max<int64_t>(N * k, 1) * D));
  std::vector<int32_t> ident(size_t(std::max<int64_t>(N * k, 1)));
  for (int64_t t = 0; t < N; ++t)
    for (int s = 0; s < k; ++s) {
      const float f = float(mine.idx[size_t(t * k + s)] + 1);  // 0 for a dropped slot (never read)
      ident[size_t(t * k + s)] = mine.idx[size_t(t * k + s)] >= 0 ? int32_t(t * k + s) : -1;
      for (int64_t d = 0; d < D; ++d) {
        float v = xs[size_t(t * D + d)] * f;
        if (cfg.combine_payload == EpPayload::BF16) v = round_bf16(v);
        yp[size_t((t * k + s) * D + d)] = v;
      }
    }
  std::vector<float> ref(y.size()), refu(y.size());
  const bool one_node_per_token = ep_max_nodes_per_token(mine.idx.data(), N, k, E, n_nodes) <= 1;
  if (N > 0) {
    if (!hier || one_node_per_token) {
      moe_unpermute(ref.data(), yp.data(), ident.data(), mine.w.data(), N, k, N * k, D);
      moe_permute_backward(refu.data(), yp.data(), ident.data(), N, k, N * k, D);
    } else {
      ep_combine_hierarchical_ref(ref.data(), yp.data(), mine.idx.data(), mine.w.data(), N, k, D, E, n_nodes);
      ep_combine_hierarchical_ref(refu.data(), yp.data(), mine.idx.data(), nullptr, N, k, D, E, n_nodes);
    }
  }
  const bool exact = !hier || cfg.combine_payload == EpPayload::F32;
  if (exact) {
    int64_t diff = 0, diffu = 0;
    for (int64_t i = 0; i < N * D; ++i) {
      diff += std::memcmp(&y[size_t(i)], &ref[size_t(i)], 4) != 0;
      diffu += std::memcmp(&yu[size_t(i)], &refu[size_t(i)], 4) != 0;
    }
    EXPECT_EQ(diff, 0) << "rank " << me << ": weighted combine differs bitwise from the reference in " << diff
                       << " of " << N * D << " values";
    EXPECT_EQ(diffu, 0) << "rank " << me << ": unweighted combine differs bitwise in " << diffu << " values";
  } else {
    // Hierarchical with bf16 rows: the forwarder's partial is rounded to bf16 once more. Bound: one bf16
    // rounding (2^-8 relative) of each partial, plus the fp32 re-association, on sum |w * yp|.
    for (int64_t t = 0; t < N; ++t)
      for (int64_t d = 0; d < D; ++d) {
        float mag = 0;
        for (int s = 0; s < k; ++s) mag += std::fabs(mine.w[size_t(t * k + s)] * yp[size_t((t * k + s) * D + d)]);
        const float tol = mag * (std::ldexp(1.0f, -8) + float(2 * (k + 1)) * std::ldexp(1.0f, -24));
        if (std::fabs(y[size_t(t * D + d)] - ref[size_t(t * D + d)]) > tol) {
          ADD_FAILURE() << "rank " << me << " t " << t << " d " << d << ": |" << y[size_t(t * D + d)] << " - "
                        << ref[size_t(t * D + d)] << "| > " << tol;
          t = N;
          break;
        }
      }
  }
  // ---- backward helpers: redispatch(dy), per-row dgrad/dw on the expert, combine_scalars(dw) ----
  {
    std::vector<float> dyr(size_t(std::max<int64_t>(R, 1) * D)), dyw(dyr.size()), dwr(size_t(std::max<int64_t>(R, 1)));
    std::vector<int32_t> id1(size_t(std::max<int64_t>(R, 1))), zero1(id1.size(), 0);
    for (int64_t r = 0; r < R; ++r) id1[size_t(r)] = int32_t(r);
    auto dy_of = [&](int src, int64_t t, int64_t d) { return unit(seed + 1, uint64_t(src), uint64_t(t), uint64_t(d)); };
    std::vector<float> dy(size_t(std::max<int64_t>(N, 1) * D));
    for (int64_t t = 0; t < N; ++t)
      for (int64_t d = 0; d < D; ++d) dy[size_t(t * D + d)] = dy_of(me, t, d);
    ep.redispatch(dyr.data(), dy.data());
    int64_t bad = 0;
    if (R == int64_t(want.size()))
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) {
          float v = dy_of(want[size_t(r)].src, want[size_t(r)].t, d);
          if (cfg.combine_payload == EpPayload::BF16) v = round_bf16(v);
          bad += std::memcmp(&v, &dyr[size_t(r * D + d)], 4) != 0;
        }
    EXPECT_EQ(bad, 0) << "rank " << me << ": redispatched rows differ";
    if (R > 0)
      moe_unpermute_backward(dyw.data(), dwr.data(), dyr.data(), yr.data(), id1.data(), id1.data(), zero1.data(),
                             ep.recv_weight(), R, 1, R, D);
    std::vector<float> dw(size_t(std::max<int64_t>(N * k, 1)), -3.0f);
    ep.combine_scalars(dw.data(), dwr.data());
    // Reference: the single-process backward of the weighted sum, on the rows as the experts saw them.
    if (N > 0) {
      std::vector<float> dys(dy.size()), yexp(size_t(N * k * D)), dyp(size_t(N * k * D)), dwref(size_t(N * k));
      for (int64_t i = 0; i < N * D; ++i)
        dys[size_t(i)] = cfg.combine_payload == EpPayload::BF16 ? round_bf16(dy[size_t(i)]) : dy[size_t(i)];
      for (int64_t t = 0; t < N; ++t)
        for (int s = 0; s < k; ++s) {
          const float f = float(mine.idx[size_t(t * k + s)] + 1);
          for (int64_t d = 0; d < D; ++d) yexp[size_t((t * k + s) * D + d)] = xs[size_t(t * D + d)] * f;
        }
      std::vector<int32_t> tok_of(size_t(N * k)), slot_of(size_t(N * k));
      for (int64_t i = 0; i < N * k; ++i) tok_of[size_t(i)] = int32_t(i / k), slot_of[size_t(i)] = int32_t(i % k);
      moe_unpermute_backward(dyp.data(), dwref.data(), dys.data(), yexp.data(), ident.data(), tok_of.data(),
                             slot_of.data(), mine.w.data(), N, k, N * k, D);
      EXPECT_EQ(0, std::memcmp(dw.data(), dwref.data(), size_t(N * k) * 4)) << "rank " << me << ": dw differs";
    }
    // combine_scalars routes exactly: v = (source, token, slot) code comes back to (t, s).
    std::vector<float> code(size_t(std::max<int64_t>(R, 1)));
    for (int64_t r = 0; r < R; ++r)
      code[size_t(r)] = float(ep.recv_src()[r] * 100000 + ep.recv_token()[r] * 10 + ep.recv_slot()[r]);
    ep.combine_scalars(dw.data(), code.data());
    for (int64_t t = 0; t < N; ++t)
      for (int s = 0; s < k; ++s)
        if (dw[size_t(t * k + s)] != (mine.idx[size_t(t * k + s)] >= 0 ? float(me * 100000 + t * 10 + s) : 0.0f)) {
          ADD_FAILURE() << "rank " << me << " combine_scalars (" << t << ", " << s << ") got " << dw[size_t(t * k + s)];
          t = N;
          break;
        }
  }
  if (hier && N > 0) {
    // Versus the flat (slot-order) result: a re-association of k products. |diff| <= 2 (k+1) u sum |w yp|.
    std::vector<float> flat(size_t(N * D));
    moe_unpermute(flat.data(), yp.data(), ident.data(), mine.w.data(), N, k, N * k, D);
    const float tol_rel = cfg.combine_payload == EpPayload::F32 ? float(2 * (k + 1)) * std::ldexp(1.0f, -24)
                                                                : std::ldexp(1.0f, -8) + float(2 * (k + 1)) * std::ldexp(1.0f, -24);
    int64_t bad = 0;
    for (int64_t t = 0; t < N; ++t)
      for (int64_t d = 0; d < D; ++d) {
        float mag = 0;
        for (int s = 0; s < k; ++s) mag += std::fabs(mine.w[size_t(t * k + s)] * yp[size_t((t * k + s) * D + d)]);
        bad += std::fabs(y[size_t(t * D + d)] - flat[size_t(t * D + d)]) > tol_rel * mag;
      }
    EXPECT_EQ(bad, 0) << "rank " << me << ": hierarchical combine outside the re-association bound of flat";
  }
  return res;
}

}  // namespace ep_check
