// test_mpi.cpp: multi-rank tests of Comm (MPI backend), the device mesh's sub-communicators and the EP
// dispatchers, run by CTest under `mpirun --oversubscribe -np N` (N = 2, 4, 8). Every rank runs every test;
// a test that needs a particular world size skips itself elsewhere. Only rank 0 prints the usual gtest
// output; other ranks print their failures, prefixed with the rank. Data are generated so that any rank can
// recompute any other rank's inputs, which is how results are checked without extra communication.
// Not a benchmark (bench/mpi_bench_dispatch.cpp).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "ep_check.h"
#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/ep_dispatch.h"
#include "moetron/mesh.h"

using namespace moetron;

namespace {

Comm& world() {
  static Comm w = comm_world();
  return w;
}

float val(int rank, int64_t i, int salt = 0) { return ep_check::unit(uint64_t(salt), uint64_t(rank), uint64_t(i), 3); }

// Every rank's copy of `x` [n floats] must be bitwise identical: gather and compare.
void expect_same_on_all_ranks(const Comm& c, const float* x, int64_t n, const char* what) {
  std::vector<float> all(size_t(n * c.size()));
  c.all_gather(all.data(), x, n * 4);
  for (int q = 0; q < c.size(); ++q)
    EXPECT_EQ(0, std::memcmp(all.data() + q * n, x, size_t(n * 4))) << what << ": rank " << q << " differs";
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Comm

TEST(MpiComm, AllReduceIsTheRankOrderFoldOnEveryRank) {
  Comm& c = world();
  const int p = c.size(), me = c.rank();
  ASSERT_EQ(c.backend_name(), "mpi");
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(p - 1), int64_t(7), int64_t(1000), int64_t(100003)}) {
    std::vector<float> x(static_cast<size_t>(n)), want(static_cast<size_t>(n));
    std::vector<double> xd(static_cast<size_t>(n));
    std::vector<int32_t> xi(static_cast<size_t>(n));
    std::vector<int64_t> xl(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      // Mixed magnitudes so that a different association would give a different float.
      x[size_t(i)] = val(me, i) * (i % 3 == 0 ? 1e6f : 1.0f);
      xd[size_t(i)] = double(x[size_t(i)]) * 1e-3;
      xi[size_t(i)] = int32_t(i) * (me + 1) + 2000000000;  // wraps: the sum is taken modulo 2^32
      xl[size_t(i)] = int64_t(i) * (me + 1) - (int64_t(1) << 40);
    }
    for (int64_t i = 0; i < n; ++i) {
      float acc = val(0, i) * (i % 3 == 0 ? 1e6f : 1.0f);
      for (int q = 1; q < p; ++q) acc += val(q, i) * (i % 3 == 0 ? 1e6f : 1.0f);
      want[size_t(i)] = acc;
    }
    c.all_reduce(x.data(), n);
    c.all_reduce(xd.data(), n);
    c.all_reduce(xi.data(), n);
    c.all_reduce(xl.data(), n);
    EXPECT_EQ(0, std::memcmp(x.data(), want.data(), size_t(n) * 4)) << "n=" << n;
    expect_same_on_all_ranks(c, x.data(), n, "all_reduce f32");
    for (int64_t i = 0; i < n; ++i) {
      uint32_t wi = 0;
      int64_t wl = 0;
      for (int q = 0; q < p; ++q) {
        wi += uint32_t(int32_t(i) * (q + 1) + 2000000000);
        wl += int64_t(i) * (q + 1) - (int64_t(1) << 40);
      }
      ASSERT_EQ(uint32_t(xi[size_t(i)]), wi) << "i=" << i;
      ASSERT_EQ(xl[size_t(i)], wl) << "i=" << i;
    }
  }
}

TEST(MpiComm, AllReduceAcrossSegments) {
  Comm& c = world();
  if (c.size() != 2) GTEST_SKIP() << "np 2 only (16 MiB per rank)";
  const int64_t n = kCommReduceSegment + 5;
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = val(c.rank(), i);
  c.all_reduce(x.data(), n);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += x[size_t(i)] != val(0, i) + val(1, i);
  EXPECT_EQ(bad, 0);
}

TEST(MpiComm, ReduceScatterGatherAllToAll) {
  Comm& c = world();
  const int p = c.size(), me = c.rank();
  // reduce_scatter: block me of the rank-order fold.
  const int64_t n = 33;
  std::vector<float> in(size_t(p * n)), out(static_cast<size_t>(n));
  for (int64_t i = 0; i < p * n; ++i) in[size_t(i)] = val(me, i, 1);
  c.reduce_scatter(out.data(), in.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    float acc = val(0, me * n + i, 1);
    for (int q = 1; q < p; ++q) acc += val(q, me * n + i, 1);
    ASSERT_EQ(out[size_t(i)], acc);
  }
  // all_gather_v with rank-dependent sizes.
  std::vector<int64_t> cnt(static_cast<size_t>(p)), dsp(static_cast<size_t>(p));
  int64_t tot = 0;
  for (int q = 0; q < p; ++q) {
    cnt[size_t(q)] = 3 * q + 1;
    dsp[size_t(q)] = tot;
    tot += cnt[size_t(q)];
  }
  std::vector<char> mine(static_cast<size_t>(cnt[size_t(me)]), char('a' + me)), all(static_cast<size_t>(tot));
  c.all_gather_v(all.data(), cnt.data(), dsp.data(), mine.data());
  for (int q = 0; q < p; ++q)
    for (int64_t j = 0; j < cnt[size_t(q)]; ++j) ASSERT_EQ(all[size_t(dsp[size_t(q)] + j)], char('a' + q));
  // all_to_all_v: rank r sends (r + q) % 3 + r int32 values to q, each encoding (r, q, j).
  auto nsend = [](int r, int q) { return int64_t((r + q) % 3 + r); };
  std::vector<int64_t> sc(static_cast<size_t>(p)), sd(static_cast<size_t>(p)), rc(static_cast<size_t>(p)), rd(static_cast<size_t>(p));
  int64_t so = 0, ro = 0;
  for (int q = 0; q < p; ++q) {
    sc[size_t(q)] = nsend(me, q) * 4;
    sd[size_t(q)] = so;
    so += sc[size_t(q)];
    rc[size_t(q)] = nsend(q, me) * 4;
    rd[size_t(q)] = ro;
    ro += rc[size_t(q)];
  }
  std::vector<int32_t> sb(size_t(so / 4 + 1)), rb(size_t(ro / 4 + 1), -1);
  for (int q = 0; q < p; ++q)
    for (int64_t j = 0; j < nsend(me, q); ++j) sb[size_t(sd[size_t(q)] / 4 + j)] = int32_t(me * 10000 + q * 100 + j);
  c.reset_stats();
  c.all_to_all_v(rb.data(), rc.data(), rd.data(), sb.data(), sc.data(), sd.data());
  for (int q = 0; q < p; ++q)
    for (int64_t j = 0; j < nsend(q, me); ++j)
      ASSERT_EQ(rb[size_t(rd[size_t(q)] / 4 + j)], int32_t(q * 10000 + me * 100 + j)) << "from " << q;
  const CommStats st = c.stats();
  EXPECT_EQ(st[CommOp::AllToAllV].bytes, so);
  EXPECT_EQ(st[CommOp::AllToAllV].wire_bytes, so - sc[size_t(me)]);
  // exchange: capacity 64 bytes per peer, the first int says how many follow.
  std::vector<int32_t> xs(size_t(16 * p)), xr(size_t(16 * p), -1);
  std::vector<int64_t> xc(static_cast<size_t>(p)), xd(static_cast<size_t>(p));
  for (int q = 0; q < p; ++q) {
    const int m = (me + 2 * q) % 15;
    xs[size_t(16 * q)] = m;
    for (int j = 0; j < m; ++j) xs[size_t(16 * q + 1 + j)] = me * 1000 + q * 10 + j;
    xc[size_t(q)] = 4 * (m + 1);
    xd[size_t(q)] = 64 * q;
  }
  c.exchange(xr.data(), 64, xs.data(), xc.data(), xd.data());
  for (int q = 0; q < p; ++q) {
    const int m = (q + 2 * me) % 15;
    ASSERT_EQ(xr[size_t(16 * q)], m);
    for (int j = 0; j < m; ++j) ASSERT_EQ(xr[size_t(16 * q + 1 + j)], q * 1000 + me * 10 + j);
  }
  // send / recv around a ring.
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  int64_t token = me * 7, got = -1;
  if (me % 2 == 0) {
    c.send(&token, 8, next, 3);
    c.recv(&got, 8, prev, 3);
  } else {
    c.recv(&got, 8, prev, 3);
    c.send(&token, 8, next, 3);
  }
  EXPECT_EQ(got, prev * 7);
  c.barrier();
}

TEST(MpiComm, NonBlockingPointToPoint) {
  Comm& c = world();
  const int p = c.size(), me = c.rank();
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  // K messages in flight each way around the ring, receives posted first on even ranks and last on odd
  // ones; sizes from 0 bytes to past the eager limit. Per pair and tag they arrive in send order.
  const int K = 6;
  auto len = [](int k) { return int64_t(k == 0 ? 0 : 37 * k * k * k + 3); };  // floats
  auto value = [](int src, int k, int64_t i) { return float(src * 1000000 + k * 10000) + float(i % 9973); };
  std::vector<std::vector<float>> out(K), in(K);
  for (int k = 0; k < K; ++k) {
    out[size_t(k)].resize(size_t(len(k)));
    in[size_t(k)].assign(size_t(len(k)), -1.0f);
    for (int64_t i = 0; i < len(k); ++i) out[size_t(k)][size_t(i)] = value(me, k, i);
  }
  c.reset_stats();
  std::vector<CommRequest> reqs;
  auto post_recvs = [&] {
    for (int k = 0; k < K; ++k) reqs.push_back(c.irecv(in[size_t(k)].data(), len(k) * 4, prev, 11));
  };
  if (me % 2 == 0) post_recvs();
  for (int k = 0; k < K; ++k) reqs.push_back(c.isend(out[size_t(k)].data(), len(k) * 4, next, 11));
  if (me % 2 == 1) post_recvs();
  EXPECT_EQ(c.pending_requests(), 2 * K);
  c.wait(reqs[0]);
  c.wait_all(reqs.data() + 1, reqs.size() - 1);
  EXPECT_EQ(c.pending_requests(), 0);
  int64_t total = 0;
  for (int k = 0; k < K; ++k) {
    total += len(k) * 4;
    for (int64_t i = 0; i < len(k); ++i) ASSERT_EQ(in[size_t(k)][size_t(i)], value(prev, k, i)) << "k " << k;
  }
  // The same accounting as blocking send / recv: calls and bytes when posted, wire bytes for the sends.
  const CommStats st = c.stats();
  EXPECT_EQ(st[CommOp::Send].calls, K);
  EXPECT_EQ(st[CommOp::Send].bytes, total);
  EXPECT_EQ(st[CommOp::Send].wire_bytes, total);
  EXPECT_EQ(st[CommOp::Recv].calls, K);
  EXPECT_EQ(st[CommOp::Recv].bytes, total);
  EXPECT_EQ(st[CommOp::Recv].wire_bytes, 0);
  // A shorter message than the irecv asked for is an error naming the sizes and the peer.
  float one[2] = {1, 2};
  if (me == 0) {
    CommRequest r = c.irecv(one, 8, 1, 12);
    std::string e;
    try {
      c.wait(r);
    } catch (const Error& x) {
      e = x.what();
    }
    EXPECT_NE(e.find("message of 4 bytes from rank 1, expected 8 (tag 12, posted by irecv)"), std::string::npos) << e;
  } else if (me == 1) {
    CommRequest s = c.isend(one, 4, 0, 12);
    c.wait(s);
  }
  c.barrier();
}

TEST(MpiComm, OrderedSumDoesNotDependOnTheSplit) {
  Comm& c = world();
  const int p = c.size(), me = c.rank();
  const int64_t M = 11, n = 257;  // 11 global parts
  auto part = [&](int64_t i, int64_t j) { return val(int(i), j, 9) * (j % 2 ? 3e5f : 1.0f); };
  std::vector<float> want(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    float acc = part(0, j);
    for (int64_t i = 1; i < M; ++i) acc += part(i, j);
    want[size_t(j)] = acc;
  }
  // Two different splits of the same 11 parts over the ranks (the first gives everything to the last rank).
  for (int split = 0; split < 2; ++split) {
    std::vector<int64_t> first(size_t(p) + 1, 0);
    for (int q = 0; q < p; ++q) {
      const int64_t m = split == 0 ? (q == p - 1 ? M : 0) : (M * (q + 1)) / p - (M * q) / p;
      first[size_t(q) + 1] = first[size_t(q)] + m;
    }
    const int64_t m = first[size_t(me) + 1] - first[size_t(me)];
    std::vector<float> parts(size_t(std::max<int64_t>(m, 1) * n)), out(static_cast<size_t>(n));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) parts[size_t(i * n + j)] = part(first[size_t(me)] + i, j);
    c.all_reduce_ordered(out.data(), parts.data(), m, n);
    EXPECT_EQ(0, std::memcmp(out.data(), want.data(), size_t(n) * 4)) << "split " << split;
  }
  // With one part per rank it is all_reduce.
  std::vector<float> one(static_cast<size_t>(n)), ar(static_cast<size_t>(n)), ord(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) one[size_t(j)] = ar[size_t(j)] = part(me, j);
  c.all_reduce(ar.data(), n);
  c.all_reduce_ordered(ord.data(), one.data(), 1, n);
  EXPECT_EQ(0, std::memcmp(ar.data(), ord.data(), size_t(n) * 4));
}

TEST(MpiComm, SplitEvenOdd) {
  Comm& c = world();
  const int p = c.size(), me = c.rank();
  Comm s = c.split(me % 2, -me);  // key reverses the order
  const int expect_size = (p + (me % 2 == 0 ? 1 : 0)) / 2;
  EXPECT_EQ(s.size(), expect_size);
  int32_t v = me;
  std::vector<int32_t> all(size_t(s.size()));
  s.all_gather(all.data(), &v, 4);
  for (int i = 1; i < s.size(); ++i) EXPECT_GT(all[size_t(i - 1)], all[size_t(i)]);
  for (int32_t r : all) EXPECT_EQ(r % 2, me % 2);
}

// ---------------------------------------------------------------------------------------------------------
// Mesh

TEST(MpiMesh, SubCommunicatorsMatchTheGroups) {
  Comm& c = world();
  const int p = c.size();
  ParallelSpec spec;
  if (p == 2) {
    spec.dp_shard = 2, spec.ep = 2;
  } else if (p == 4) {
    spec.dp_replicate = 2, spec.dp_shard = 2, spec.ep = 2, spec.ranks_per_node = 2;
  } else if (p == 8) {
    spec.pp = 2, spec.dp_replicate = 2, spec.dp_shard = 2, spec.ep = 4, spec.ranks_per_node = 4;
  } else {
    GTEST_SKIP() << "np 2, 4 or 8";
  }
  DeviceMesh mesh(spec, p, 8);
  MeshComms mc = make_mesh_comms(mesh, c);
  for (MeshGroup g : {MeshGroup::Dp, MeshGroup::DpShard, MeshGroup::DpReplicate, MeshGroup::Ep, MeshGroup::Edp,
                      MeshGroup::Pp}) {
    const Comm& sub = mc.get(g);
    const std::vector<int> want = mesh.group(g, c.rank());
    ASSERT_EQ(sub.size(), int(want.size()));
    int32_t me = c.rank();
    std::vector<int32_t> got(want.size());
    sub.all_gather(got.data(), &me, 4);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "group " << int(g) << " index " << i;
    EXPECT_EQ(want[size_t(sub.rank())], c.rank());
  }
}

// ---------------------------------------------------------------------------------------------------------
// EP dispatch

namespace {
EpDispatchConfig cfg(EpDispatcher kind, int E, int k, int64_t D, int rpn, EpPayload dp = EpPayload::F32,
                     EpPayload cp = EpPayload::F32, int64_t max_tokens = 64) {
  EpDispatchConfig c;
  c.kind = kind;
  c.n_experts = E;
  c.topk = k;
  c.hidden = D;
  c.ranks_per_node = rpn;
  c.max_tokens = max_tokens;
  c.dispatch_payload = dp;
  c.combine_payload = cp;
  return c;
}

void run_routes(const Comm& c, EpDispatch& ep, bool node_limited) {
  using ep_check::Route;
  ep_check::check_ep(c, ep, Route::Random, 40, 1);
  ep_check::check_ep(c, ep, Route::Skewed, 30, 2);
  ep_check::check_ep(c, ep, Route::Empty, 25, 3);
  if (node_limited) ep_check::check_ep(c, ep, Route::NodeLimited, 20, 4);
  ep_check::check_ep(c, ep, Route::Random, 2, 5);  // tiny: most experts get nothing
  ep_check::check_ep(c, ep, Route::Dropped, 30, 6);  // capacity drops: topk_idx -1, the last rank drops all
}

void dispatcher_suite(EpDispatcher kind, bool direct = false, EpTransport transport = EpTransport::Mpi) {
  Comm& c = world();
  const int p = c.size();
  const int rpn = kind == EpDispatcher::Hierarchical ? std::max(1, p / 2) : 0;  // 2 "nodes"
  struct Pay {
    EpPayload dp, cp;
    bool land;
  };
  for (Pay y : {Pay{EpPayload::F32, EpPayload::F32, false}, Pay{EpPayload::BF16, EpPayload::BF16, false},
                Pay{EpPayload::E4M3, EpPayload::F32, false}, Pay{EpPayload::F32, EpPayload::F32, true},
                Pay{EpPayload::BF16, EpPayload::F32, true}}) {
    SCOPED_TRACE(std::string(to_string(kind)) + " " + std::string(to_string(y.dp)) + "/" +
                 std::string(to_string(y.cp)) + (y.land ? " landed" : ""));
    EpDispatchConfig cf = cfg(kind, 4 * p, 3, 160, rpn, y.dp, y.cp);
    cf.alltoall_direct = direct;
    cf.land_rows = y.land;
    cf.transport = transport;
    EpDispatch ep(c, cf);
    run_routes(c, ep, kind == EpDispatcher::Hierarchical);
  }
  // Fewer local experts than k (El = 1): a token may send several slots to one rank.
  EpDispatchConfig cf1 = cfg(kind, p, std::min(p, 3), 64, rpn);
  cf1.alltoall_direct = direct;
  cf1.transport = transport;
  EpDispatch ep1(c, cf1);
  run_routes(c, ep1, false);
}
}  // namespace

TEST(MpiEp, AllToAll) { dispatcher_suite(EpDispatcher::AllToAll); }
TEST(MpiEp, AllToAllDirect) { dispatcher_suite(EpDispatcher::AllToAll, true); }
TEST(MpiEp, SyncFree) { dispatcher_suite(EpDispatcher::SyncFree); }
TEST(MpiEp, Hierarchical) { dispatcher_suite(EpDispatcher::Hierarchical); }
TEST(MpiEp, AllToAllSharedMemory) { dispatcher_suite(EpDispatcher::AllToAll, false, EpTransport::Shm); }
TEST(MpiEp, AllToAllDirectSharedMemory) { dispatcher_suite(EpDispatcher::AllToAll, true, EpTransport::Shm); }
TEST(MpiEp, SyncFreeSharedMemory) { dispatcher_suite(EpDispatcher::SyncFree, false, EpTransport::Shm); }

TEST(MpiEp, SharedMemoryGrowsTogetherAndCountsTheSameBytes) {
  // alltoall over shared memory reserving nothing (max_tokens 0): the first dispatch and every larger one regrow
  // the segments of all ranks together, the calls in between reuse them. The bytes it counts as sent are the
  // MPI path's without its padding and count round: rows, metadata and the counts, per destination.
  Comm& c = world();
  EpDispatchConfig a = cfg(EpDispatcher::AllToAll, 4 * c.size(), 3, 96, 0, EpPayload::BF16, EpPayload::BF16, 0);
  EpDispatchConfig m = a;
  a.transport = EpTransport::Shm;
  EpDispatch shm(c, a), mpi(c, m);
  int64_t data_bytes = 0;
  for (int64_t n : {2, 40, 12, 150, 150}) {
    SCOPED_TRACE("N " + std::to_string(n));
    auto s = ep_check::check_ep(c, shm, ep_check::Route::Random, n, uint64_t(n));
    auto r = ep_check::check_ep(c, mpi, ep_check::Route::Random, n, uint64_t(n));
    EXPECT_EQ(s.dispatch.rows_sent, r.dispatch.rows_sent);
    EXPECT_EQ(s.dispatch.rows_recv, r.dispatch.rows_recv);
    EXPECT_EQ(s.combine.bytes_remote() + s.combine.bytes_self, r.combine.bytes_remote() + r.combine.bytes_self);
    const int64_t rows = s.dispatch.rows_sent;
    EXPECT_EQ(s.dispatch.bytes_remote() + s.dispatch.bytes_self, rows * (96 * 2 + 8) + int64_t(c.size()) * 4 * 8);
    int64_t now = 0;
    for (const auto& t : shm.buffers())
      if (t.name.rfind("shm.data", 0) == 0) now = t.bytes;
    EXPECT_GE(now, data_bytes);  // segments only grow
    data_bytes = now;
  }
  EXPECT_GE(data_bytes, 150 * 3 * (8 + 2 * 96) + 150 * 2 * 96);  // records, token rows, combine rows
}

TEST(MpiEp, SharedMemoryCombinesInPlaceAsTheMpiPathDoes) {
  // The shm combine's in-place forms against the MPI path on the same routing, bitwise: yr = recv_x() itself
  // (decoded rows, fp32 rows read where they are), and combine_in_place after the experts wrote their outputs
  // into combine_rows() in the combine payload's type (landed rows); weighted and not.
  Comm& c = world();
  const int P = c.size(), E = 4 * P, k = 3;
  const int64_t D = 160, N = 37 + 3 * c.rank();
  std::vector<float> x(size_t(N * D)), w(size_t(N * k));
  std::vector<int32_t> idx(size_t(N * k));
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t d = 0; d < D; ++d)
      x[size_t(t * D + d)] = ep_check::unit(7, uint64_t(c.rank()), uint64_t(t), uint64_t(d));
    for (int s = 0; s < k; ++s) {
      idx[size_t(t * k + s)] = int32_t((t * 5 + s * 7 + c.rank()) % E);  // distinct for k = 3, E >= 8
      w[size_t(t * k + s)] = 0.25f + 0.125f * float(s);
    }
  }
  for (EpPayload cp : {EpPayload::F32, EpPayload::BF16})
    for (bool land : {false, true}) {
      SCOPED_TRACE(std::string(to_string(cp)) + (land ? " landed" : " decoded"));
      // decoded: fp32 rows, so recv_x holds values the bf16 combine must round
      EpDispatchConfig m = cfg(EpDispatcher::AllToAll, E, k, D, 0, land ? EpPayload::BF16 : EpPayload::F32, cp, 0);
      m.land_rows = land;
      EpDispatchConfig a = m;
      a.transport = EpTransport::Shm;
      EpDispatch shm(c, a), mpi(c, m);
      std::vector<char> room_s, room_m;
      auto landing = [](std::vector<char>& v) {
        return [&v](int64_t r) -> void* { v.assign(size_t(std::max<int64_t>(r, 1) * 160 * 2), 0); return v.data(); };
      };
      const int64_t R = land ? shm.dispatch(x.data(), idx.data(), w.data(), N, landing(room_s))
                             : shm.dispatch(x.data(), idx.data(), w.data(), N);
      ASSERT_EQ(R, land ? mpi.dispatch(x.data(), idx.data(), w.data(), N, landing(room_m))
                        : mpi.dispatch(x.data(), idx.data(), w.data(), N));
      // the experts' outputs: any function of the received rows (recv_x, or the landed bf16 rows)
      std::vector<float> yr(size_t(std::max<int64_t>(R, 1) * D));
      for (int64_t i = 0; i < R * D; ++i)
        yr[size_t(i)] = land ? 1.5f * from_bf16(reinterpret_cast<const bf16*>(room_s.data())[i]) : shm.recv_x()[i];
      for (bool weighted : {true, false}) {
        std::vector<float> ys(size_t(N * D), -1.0f), ym(size_t(N * D), -2.0f);
        if (land) {
          ASSERT_NE(shm.combine_rows(), nullptr);
          for (int64_t i = 0; i < R * D; ++i) {
            if (cp == EpPayload::BF16) static_cast<bf16*>(shm.combine_rows())[i] = to_bf16(yr[size_t(i)]);
            else static_cast<float*>(shm.combine_rows())[i] = yr[size_t(i)];
          }
          shm.combine_in_place(ys.data(), weighted);
        } else {
          shm.combine(ys.data(), shm.recv_x(), weighted);
        }
        mpi.combine(ym.data(), yr.data(), weighted);
        for (size_t i = 0; i < ys.size(); ++i) ASSERT_EQ(ys[i], ym[i]) << "rank " << c.rank() << " element " << i;
      }
    }
  EpDispatch plain(c, cfg(EpDispatcher::AllToAll, E, k, D, 0));
  std::vector<float> y(size_t(N * D));
  plain.dispatch(x.data(), idx.data(), w.data(), N);
  EXPECT_EQ(plain.combine_rows(), nullptr);
  EXPECT_THROW(plain.combine_in_place(y.data()), std::exception);
}

TEST(MpiEp, SharedMemoryRefusesHierarchical) {
  Comm& c = world();
  EpDispatchConfig h = cfg(EpDispatcher::Hierarchical, 4 * c.size(), 3, 64, std::max(1, c.size() / 2));
  h.transport = EpTransport::Shm;
  try {
    EpDispatch ep(c, h);
    FAIL() << "hierarchical accepted ep_transport = shm";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("ep_transport = mpi"), std::string::npos) << e.what();
  }
}

TEST(MpiEp, HierarchicalOneRankPerNode) {
  Comm& c = world();
  EpDispatch ep(c, cfg(EpDispatcher::Hierarchical, 4 * c.size(), 4, 96, 1));
  run_routes(c, ep, true);
}

TEST(MpiEp, OnEveryEpGroupOfTheMesh) {
  // Two (or more) independent EP groups of 2 side by side, from the mesh.
  Comm& c = world();
  const int p = c.size();
  if (p % 2 != 0 || p < 4) GTEST_SKIP() << "needs an even world >= 4";
  ParallelSpec spec;
  spec.dp_shard = p, spec.ep = 2, spec.ranks_per_node = 2;
  spec.ep_dispatcher = EpDispatcher::Hierarchical;
  DeviceMesh mesh(spec, p, 8);
  MeshComms mc = make_mesh_comms(mesh, c);
  for (EpDispatcher kind : {EpDispatcher::AllToAll, EpDispatcher::SyncFree, EpDispatcher::Hierarchical}) {
    EpDispatch ep(mc.ep, cfg(kind, 8, 3, 64, mesh.ep_ranks_per_node()));
    ep_check::check_ep(mc.ep, ep, ep_check::Route::Random, 20, uint64_t(mesh.coord(c.rank()).edp) + 100);
  }
}

TEST(MpiEp, HierarchicalCrossesNodesOncePerToken) {
  // 2 "nodes" x 2 ranks. Same routing through flat alltoall (bytes classified by node too) and hierarchical.
  Comm& c = world();
  if (c.size() != 4) GTEST_SKIP() << "np 4 only";
  const int E = 16, k = 6;
  const int64_t D = 256, N = 64;
  EpDispatch flat(c, cfg(EpDispatcher::AllToAll, E, k, D, 2, EpPayload::F32, EpPayload::F32, N));
  EpDispatch hier(c, cfg(EpDispatcher::Hierarchical, E, k, D, 2, EpPayload::F32, EpPayload::F32, N));
  auto f = ep_check::check_ep(c, flat, ep_check::Route::Random, N, 77);
  auto h = ep_check::check_ep(c, hier, ep_check::Route::Random, N, 77);
  int64_t v[4] = {f.dispatch.bytes_inter, h.dispatch.bytes_inter, f.combine.bytes_inter, h.combine.bytes_inter};
  c.all_reduce(v, 4);
  if (c.rank() == 0)
    std::printf("[ info ] inter-node bytes, 4 ranks as 2 nodes x 2, k=6 of 16 experts, D=256, fp32: dispatch flat %lld "
                "hier %lld (%.2fx less), combine flat %lld hier %lld (%.2fx less)\n",
                (long long)v[0], (long long)v[1], double(v[0]) / double(v[1]), (long long)v[2], (long long)v[3],
                double(v[2]) / double(v[3]));
  // Each token uses both nodes almost always with 3 of its 6 experts on the remote one on average: flat sends
  // ~3 rows per token across, hierarchical 1 (plus a 64-byte stage-1 header instead of 8 bytes of metadata).
  EXPECT_LT(double(v[1]), 0.5 * double(v[0]));
  EXPECT_LT(double(v[3]), 0.5 * double(v[2]));
  // Intra-node traffic goes up instead (the fan-out), but the total on-node + cross-node rows are all counted.
  EXPECT_GT(h.dispatch.bytes_intra + h.dispatch.bytes_self, 0);
}

TEST(MpiEp, Fp8DispatchSavesBytesWithinTheBound) {
  Comm& c = world();
  const int64_t D = 512;
  EpDispatch f32(c, cfg(EpDispatcher::AllToAll, 4 * c.size(), 4, D, 0));
  EpDispatch fp8(c, cfg(EpDispatcher::AllToAll, 4 * c.size(), 4, D, 0, EpPayload::E4M3));
  auto a = ep_check::check_ep(c, f32, ep_check::Route::Random, 48, 8);
  auto b = ep_check::check_ep(c, fp8, ep_check::Route::Random, 48, 8);
  int64_t v[2] = {a.dispatch.bytes_remote() + a.dispatch.bytes_self, b.dispatch.bytes_remote() + b.dispatch.bytes_self};
  c.all_reduce(v, 2);
  double err = b.fp8_max_rel_err;
  std::vector<double> errs(size_t(c.size()));
  c.all_gather(errs.data(), &err, 8);
  for (double e : errs) err = std::max(err, e);
  if (c.rank() == 0)
    std::printf("[ info ] e4m3 dispatch: %lld bytes vs %lld fp32 (%.3f), max |x'-x| / block amax = %.4f\n",
                (long long)v[1], (long long)v[0], double(v[1]) / double(v[0]), err);
  // Record = 8 B metadata + payload: fp32 8 + 2048 = 2056; e4m3 8 + 512 + 4*4 = 536 (0.261, plus padding).
  EXPECT_LT(double(v[1]) / double(v[0]), 0.27);
  EXPECT_LE(err, 1.0 / 16.0);
}

TEST(MpiEp, EightRanksAllDispatchers) {
  Comm& c = world();
  if (c.size() != 8) GTEST_SKIP() << "np 8 only";
  for (EpDispatcher kind : {EpDispatcher::AllToAll, EpDispatcher::SyncFree, EpDispatcher::Hierarchical}) {
    SCOPED_TRACE(std::string(to_string(kind)));
    EpDispatchConfig cf = cfg(kind, 32, 4, 128, kind == EpDispatcher::Hierarchical ? 4 : 2, EpPayload::BF16);
    cf.alltoall_direct = kind == EpDispatcher::AllToAll;  // bf16 dispatch staged, fp32 combine in place
    EpDispatch ep(c, cf);
    ep_check::check_ep(c, ep, ep_check::Route::Random, 24, 31);
    ep_check::check_ep(c, ep, ep_check::Route::Skewed, 16, 32);
    ep_check::check_ep(c, ep, ep_check::Route::Empty, 16, 33);
    ep_check::check_ep(c, ep, ep_check::Route::Dropped, 16, 34);
  }
}

TEST(MpiEp, BigEnoughForThePackingThreads) {
  // N * k * D above the serial cutoff, so the OpenMP paths (pack, block copies, chunked bf16 reduction) run;
  // the checks are bitwise against the single-process computation, so they also hold with OMP_NUM_THREADS > 1.
  Comm& c = world();
  for (int v = 0; v < 6; ++v)  // the three dispatchers, alltoall direct, then alltoall and sync_free over shm
    for (auto [dp, cp] : {std::pair{EpPayload::F32, EpPayload::F32}, std::pair{EpPayload::BF16, EpPayload::BF16},
                          std::pair{EpPayload::BF16, EpPayload::F32}}) {
      const EpDispatcher kind = v == 1 || v == 5 ? EpDispatcher::SyncFree
                                : v == 2          ? EpDispatcher::Hierarchical
                                                  : EpDispatcher::AllToAll;
      const bool land = cp == EpPayload::F32 && dp == EpPayload::BF16;  // the trainer's bf16 configuration
      SCOPED_TRACE(std::string(to_string(kind)) + (v == 3 ? " direct " : v >= 4 ? " shm " : " ") +
                   std::string(to_string(dp)) + (land ? " landed" : ""));
      EpDispatchConfig cf = cfg(kind, 4 * c.size(), 4, 256, std::max(1, c.size() / 2), dp, cp, 160);
      cf.alltoall_direct = v == 3;
      cf.transport = v >= 4 ? EpTransport::Shm : EpTransport::Mpi;
      cf.land_rows = land;
      EpDispatch ep(c, cf);
      ep_check::check_ep(c, ep, ep_check::Route::Dropped, 150, 40);
      ep_check::check_ep(c, ep, ep_check::Route::Random, 150, 41);
    }
}

TEST(MpiEp, DroppedSlotsEverywhere) {
  // Every rank drops every slot: nothing is sent, every y[t] is 0, combine_scalars gives 0; then a normal
  // call on the same object (the layout of the empty call must not leak into the next one).
  Comm& c = world();
  for (int v = 0; v < 6; ++v) {  // the three dispatchers, alltoall with alltoall_direct, alltoall / sync_free shm
    const EpDispatcher kind = v == 1 || v == 5 ? EpDispatcher::SyncFree
                              : v == 2          ? EpDispatcher::Hierarchical
                                                : EpDispatcher::AllToAll;
    SCOPED_TRACE(std::string(to_string(kind)) + (v == 3 ? " direct" : v >= 4 ? " shm" : ""));
    const int E = 2 * c.size(), k = 2;
    const int64_t D = 32, N = 5;
    EpDispatchConfig cf = cfg(kind, E, k, D, std::max(1, c.size() / 2));
    cf.alltoall_direct = v == 3;
    cf.transport = v >= 4 ? EpTransport::Shm : EpTransport::Mpi;
    EpDispatch ep(c, cf);
    std::vector<float> x(size_t(N * D), 1.5f), w(size_t(N * k), 0.5f), y(size_t(N * D), -1.0f), dw(size_t(N * k), -1.0f);
    std::vector<int32_t> idx(size_t(N * k), -1);
    EXPECT_EQ(ep.dispatch(x.data(), idx.data(), w.data(), N), 0);
    EXPECT_EQ(ep.stats().last_dispatch.rows_sent, 0);
    ep.combine(y.data(), nullptr, true);
    for (float v : y) ASSERT_EQ(v, 0.0f);
    ep.combine_scalars(dw.data(), nullptr);
    for (float v : dw) ASSERT_EQ(v, 0.0f);
    ep_check::check_ep(c, ep, ep_check::Route::Dropped, 12, 35);
    ep_check::check_ep(c, ep, ep_check::Route::Random, 12, 36);
  }
}

// ---------------------------------------------------------------------------------------------------------
// main() is tests/mpi/mpi_gtest_main.cpp, shared by the MPI test binaries.
