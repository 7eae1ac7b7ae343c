// test_comm.cpp: single-process tests of the parallel foundation: the local Comm backend (collectives are
// copies, stats, trace hook, errors), the device mesh (mapping, groups, every validation rule), the EP
// dispatchers on one rank (all three, every payload, skewed / empty routing) and the node-limited routing
// helpers. The multi-rank behaviour is tested under mpirun by tests/mpi/.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "../mpi/ep_check.h"
#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/ep_dispatch.h"
#include "moetron/mesh.h"
#include "moetron/router.h"
#include "test_util.h"

using namespace moetron;

namespace {
using moetron::testing::error_of;
}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Comm, single-process backend

TEST(CommLocal, CollectivesAreCopies) {
  Comm c = comm_local();
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.size(), 1);
  EXPECT_EQ(c.backend_name(), "local");
  std::vector<float> f = {1.5f, -2.0f, 3.25f};
  c.all_reduce(f.data(), 3);
  EXPECT_EQ(f, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  std::vector<int64_t> l = {int64_t(1) << 40, -3};
  c.all_reduce(l.data(), 2);
  EXPECT_EQ(l[0], int64_t(1) << 40);
  std::vector<double> din = {1, 2}, dout(2);
  c.reduce_scatter(dout.data(), din.data(), 2);
  EXPECT_EQ(dout, din);
  std::vector<char> g(4);
  c.all_gather(g.data(), "abcd", 4);
  EXPECT_EQ(std::string(g.begin(), g.end()), "abcd");
  const char src[8] = "0123456";
  char dst[8] = {};
  int64_t sc = 3, sd = 2, rc = 3, rd = 1;
  c.all_to_all_v(dst, &rc, &rd, src, &sc, &sd);
  EXPECT_EQ(std::string(dst + 1, 3), "234");
  char xr[16] = {};
  int64_t xs = 4, xd = 0;
  c.exchange(xr, 16, "wxyz", &xs, &xd);
  EXPECT_EQ(std::string(xr, 4), "wxyz");
  int v = 42, w = 0;
  c.send(&v, sizeof v, 0, 5);
  c.recv(&w, sizeof w, 0, 5);
  EXPECT_EQ(w, 42);
  c.barrier();
  Comm s = c.split(3, 0);
  EXPECT_EQ(s.size(), 1);
}

TEST(CommLocal, StatsCountCallsAndBytes) {
  Comm c = comm_local();
  std::vector<float> f(100);
  c.all_reduce(f.data(), 100);
  c.all_reduce(f.data(), 50);
  std::vector<char> g(10);
  c.all_gather(g.data(), f.data(), 10);
  int n_events = 0;
  c.set_trace_hook([&](const CommEvent& e) {
    ++n_events;
    EXPECT_EQ(e.op, CommOp::Barrier);
    EXPECT_LE(e.t_begin, e.t_end);
  });
  c.barrier();
  const CommStats st = c.stats();
  EXPECT_EQ(st[CommOp::AllReduce].calls, 2);
  EXPECT_EQ(st[CommOp::AllReduce].bytes, 600);
  EXPECT_EQ(st[CommOp::AllReduce].wire_bytes, 0);  // nothing leaves a single process
  EXPECT_EQ(st[CommOp::AllGather].bytes, 10);
  EXPECT_EQ(st[CommOp::Barrier].calls, 1);
  EXPECT_EQ(st.total().calls, 4);
  EXPECT_EQ(n_events, 1);
  EXPECT_NE(st.summary().find("all_reduce: calls 2"), std::string::npos);
  Comm copy = c;  // copies share the stats
  copy.barrier();
  EXPECT_EQ(c.stats()[CommOp::Barrier].calls, 2);
  c.reset_stats();
  EXPECT_EQ(c.stats().total().calls, 0);
}

TEST(CommLocal, OrderedSumIsTheSequentialFold) {
  Comm c = comm_local();
  // Values whose sum depends on the order: the result must be the left fold in part order.
  const int64_t m = 5, n = 4;
  std::vector<float> parts(size_t(m * n));
  for (int64_t i = 0; i < m * n; ++i) parts[size_t(i)] = (i % 3 == 0 ? 1e8f : 1.0f) * (i % 2 ? -1.0f : 1.0f) + 0.1f * float(i);
  std::vector<float> out(static_cast<size_t>(n)), want(static_cast<size_t>(n));
  c.all_reduce_ordered(out.data(), parts.data(), m, n);
  for (int64_t j = 0; j < n; ++j) {
    float acc = parts[size_t(j)];
    for (int64_t i = 1; i < m; ++i) acc += parts[size_t(i * n + j)];
    want[size_t(j)] = acc;
  }
  EXPECT_EQ(0, std::memcmp(out.data(), want.data(), size_t(n) * 4));
  // No parts anywhere: zeros.
  c.all_reduce_ordered(out.data(), parts.data(), 0, n);
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(CommLocal, BadArgumentsNameTheOp) {
  Comm c = comm_local();
  char buf[8];
  EXPECT_NE(error_of([&] { c.send(buf, 1, 0, kCommMaxUserTag + 1); }).find("[comm.send] "), std::string::npos);
  EXPECT_NE(error_of([&] { c.send(buf, 1, 1, 0); }).find("destination rank 1"), std::string::npos);
  EXPECT_NE(error_of([&] { c.recv(buf, 1, 0, 9); }).find("no matching send"), std::string::npos);
  int64_t neg = -1, z = 0;
  EXPECT_NE(error_of([&] { c.all_to_all_v(buf, &z, &z, buf, &neg, &z); }).find("negative"), std::string::npos);
  int64_t four = 4, two = 2;
  EXPECT_NE(error_of([&] { c.all_to_all_v(buf, &two, &z, buf, &four, &z); }).find("self block"), std::string::npos);
  EXPECT_NE(error_of([&] { c.exchange(buf, 2, buf, &four, &z); }).find("capacity"), std::string::npos);
  EXPECT_NE(error_of([&] { c.all_reduce(static_cast<float*>(nullptr), 3); }).find("null"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)c.split(-1, 0); }).find("color"), std::string::npos);
  int a = 1, b = 2;
  c.send(&a, 4, 0, 1);
  EXPECT_NE(error_of([&] { c.recv(&b, 2, 0, 1); }).find("expected 2"), std::string::npos);
}

TEST(CommLocal, NonBlockingLoopback) {
  Comm c = comm_local();
  // isend first: buffered at once, complete when posted; the irecv takes it.
  float a[3] = {1.5f, -2.0f, 3.0f}, b[3] = {};
  CommRequest s = c.isend(a, 12, 0, 4);
  EXPECT_TRUE(s.pending());
  a[0] = 99.0f;  // the local backend copied the message when posted
  CommRequest r = c.irecv(b, 12, 0, 4);
  EXPECT_EQ(c.pending_requests(), 2);
  c.wait(r);
  c.wait(s);
  EXPECT_FALSE(r.pending());
  EXPECT_EQ(c.pending_requests(), 0);
  EXPECT_EQ(b[0], 1.5f);
  EXPECT_EQ(b[2], 3.0f);
  // irecv first: the next send of that tag completes it, oldest posted irecv first (MPI's order); a
  // message with another tag does not.
  int x1 = -1, x2 = -1, y = -1;
  CommRequest r1 = c.irecv(&x1, 4, 0, 7);
  CommRequest r2 = c.irecv(&x2, 4, 0, 7);
  int v1 = 10, v2 = 20, v3 = 30;
  c.send(&v3, 4, 0, 8);
  CommRequest s1 = c.isend(&v1, 4, 0, 7);
  c.send(&v2, 4, 0, 7);
  CommRequest both[2] = {std::move(r2), std::move(r1)};
  EXPECT_FALSE(r1.pending());  // moved from
  c.wait_all(both, 2);
  c.wait(s1);
  EXPECT_EQ(x1, 10);
  EXPECT_EQ(x2, 20);
  c.recv(&y, 4, 0, 8);
  EXPECT_EQ(y, 30);
  c.wait_all(nullptr, 0);
}

TEST(CommLocal, NonBlockingStatsMatchBlocking) {
  Comm blocking = comm_local(), nb = comm_local();
  std::vector<char> buf(100), got(100);
  blocking.send(buf.data(), 100, 0, 1);
  blocking.recv(got.data(), 100, 0, 1);
  int n_events = 0;
  nb.set_trace_hook([&](const CommEvent& e) {
    ++n_events;
    EXPECT_EQ(e.bytes, 100);
    EXPECT_LE(e.t_begin, e.t_end);
  });
  CommRequest r = nb.irecv(got.data(), 100, 0, 1);
  CommRequest s = nb.isend(buf.data(), 100, 0, 1);
  EXPECT_EQ(n_events, 0);  // reported when completed
  CommRequest all[2] = {std::move(s), std::move(r)};
  nb.wait_all(all, 2);
  EXPECT_EQ(n_events, 2);
  for (CommOp op : {CommOp::Send, CommOp::Recv}) {
    EXPECT_EQ(nb.stats()[op].calls, blocking.stats()[op].calls);
    EXPECT_EQ(nb.stats()[op].bytes, blocking.stats()[op].bytes);
    EXPECT_EQ(nb.stats()[op].wire_bytes, blocking.stats()[op].wire_bytes);  // to itself: 0
  }
  EXPECT_EQ(nb.stats()[CommOp::Send].bytes, 100);
  EXPECT_EQ(nb.stats().total().calls, 2);
}

TEST(CommLocal, NonBlockingMisuseIsRefused) {
  Comm c = comm_local(), other = comm_local();
  int v = 1, w = 0;
  CommRequest empty;
  const std::string e_empty = error_of([&] { c.wait(empty); });
  EXPECT_NE(e_empty.find("[comm.wait] "), std::string::npos) << e_empty;
  EXPECT_NE(e_empty.find("request 0 of 1 is empty"), std::string::npos) << e_empty;
  CommRequest r = c.irecv(&w, 4, 0, 2);
  EXPECT_NE(error_of([&] { c.wait(r); }).find("irecv of 4 bytes (tag 2) has no matching send and would block forever"),
            std::string::npos);
  EXPECT_NE(error_of([&] { other.wait(r); }).find("posted on another communicator"), std::string::npos);
  EXPECT_NE(error_of([&] { c.send(&v, 2, 0, 2); }).find("message of 2 bytes, expected 4 (tag 2, posted by irecv)"),
            std::string::npos);
  c.send(&v, 4, 0, 2);
  c.wait(r);
  EXPECT_EQ(w, 1);
  EXPECT_NE(error_of([&] { c.wait(r); }).find("is empty (never posted, or already completed)"), std::string::npos);
  const std::string e_dst = error_of([&] { (void)c.isend(&v, 4, 1, 0); });
  EXPECT_NE(e_dst.find("[comm.isend] "), std::string::npos) << e_dst;
  EXPECT_NE(e_dst.find("destination rank 1 outside [0, 1)"), std::string::npos) << e_dst;
  const std::string e_tag = error_of([&] { (void)c.irecv(&v, 4, 0, -1); });
  EXPECT_NE(e_tag.find("[comm.irecv] "), std::string::npos) << e_tag;
  EXPECT_NE(e_tag.find("tag -1 outside"), std::string::npos) << e_tag;
  EXPECT_NE(error_of([&] { (void)c.irecv(nullptr, 4, 0, 0); }).find("bad buffer"), std::string::npos);
  c.send(&v, 4, 0, 3);
  EXPECT_NE(error_of([&] { (void)c.irecv(&w, 8, 0, 3); }).find("message of 4 bytes, expected 8"), std::string::npos);
}

TEST(CommLocal, WorldWithoutLauncherIsLocalOrMpiSingleton) {
  Comm w = comm_world();
  EXPECT_EQ(w.size(), 1);
  EXPECT_EQ(w.rank(), 0);
}

// ---------------------------------------------------------------------------------------------------------
// Device mesh

namespace {
ParallelSpec spec(int64_t rep, int64_t shard, int64_t ep, int64_t pp = 1, int64_t rpn = 8) {
  ParallelSpec p;
  p.dp_replicate = rep;
  p.dp_shard = shard;
  p.ep = ep;
  p.pp = pp;
  p.ranks_per_node = rpn;
  return p;
}
}  // namespace

TEST(Mesh, RankOrderAndGroups) {
  // 16 ranks: pp 2 x dp_replicate 2 x dp_shard 4, ep 4 (edp 2), nodes of 4.
  DeviceMesh m(spec(2, 4, 4, 2, 4), 16, 64);
  EXPECT_EQ(m.dp(), 8);
  EXPECT_EQ(m.edp(), 2);
  EXPECT_EQ(m.num_nodes(), 4);
  EXPECT_TRUE(m.ep_within_node());
  for (int r = 0; r < 16; ++r) {
    const MeshCoord c = m.coord(r);
    EXPECT_EQ(r, (c.pp * 2 + c.dp_replicate) * 4 + c.dp_shard);
    EXPECT_EQ(c.dp, c.dp_replicate * 4 + c.dp_shard);
    EXPECT_EQ(c.ep, c.dp % 4);
    EXPECT_EQ(c.edp, c.dp / 4);
    EXPECT_EQ(c.node, r / 4);
    EXPECT_EQ(m.rank_of(c.pp, c.dp), r);
    EXPECT_EQ(m.rank_of_ep(c.pp, c.edp, c.ep), r);
  }
  EXPECT_EQ(m.group(MeshGroup::Dp, 9), (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(m.group(MeshGroup::Ep, 9), (std::vector<int>{8, 9, 10, 11}));  // contiguous, one node
  EXPECT_EQ(m.group(MeshGroup::Edp, 9), (std::vector<int>{9, 13}));
  EXPECT_EQ(m.group(MeshGroup::DpShard, 13), (std::vector<int>{12, 13, 14, 15}));
  EXPECT_EQ(m.group(MeshGroup::DpReplicate, 13), (std::vector<int>{9, 13}));
  EXPECT_EQ(m.group(MeshGroup::Pp, 5), (std::vector<int>{5, 13}));
  // Every group partitions the world: each rank appears in exactly one group of each kind.
  for (MeshGroup g : {MeshGroup::Dp, MeshGroup::DpShard, MeshGroup::DpReplicate, MeshGroup::Ep, MeshGroup::Edp,
                      MeshGroup::Pp}) {
    for (int r = 0; r < 16; ++r) {
      auto grp = m.group(g, r);
      int pos = 0;
      for (int q : grp) {
        EXPECT_EQ(m.group(g, q), grp);
        pos += q == r;
      }
      EXPECT_EQ(pos, 1);
    }
  }
  EXPECT_NE(m.describe().find("ep 4 x edp 2"), std::string::npos);
}

// pp 2 x dp_shard 2 x cp 2 x tp 2 with ep 2 on 16 ranks: tp innermost, then cp, then dp, then pp (mesh.h). Every
// group checked by its members' world ranks, and every rank's coordinates round-trip.
TEST(Mesh, TensorAndContextParallelRankOrder) {
  ParallelSpec p = spec(1, 2, 2, 2);
  p.cp = 2, p.tp = 2;
  DeviceMesh m(p, 16, 8);
  EXPECT_EQ(m.tp(), 2);
  EXPECT_EQ(m.cp(), 2);
  const MeshCoord c = m.coord(13);  // 13 = ((1 * 2 + 1) * 2 + 0) * 2 + 1
  EXPECT_EQ(c.pp, 1);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.cp, 0);
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.ep, 0);  // dc = 1 * 2 + 0 = 2: ep 0, edp 1
  EXPECT_EQ(c.edp, 1);
  EXPECT_EQ(m.group(MeshGroup::Edp, 13), (std::vector<int>{9, 13}));  // dc 0 (rank 9), dc 2 (rank 13)
  EXPECT_EQ(m.group(MeshGroup::Tp, 13), (std::vector<int>{12, 13}));
  EXPECT_EQ(m.group(MeshGroup::Cp, 13), (std::vector<int>{13, 15}));
  EXPECT_EQ(m.group(MeshGroup::Dp, 13), (std::vector<int>{9, 13}));
  EXPECT_EQ(m.group(MeshGroup::Ep, 13), (std::vector<int>{13, 15}));  // dc = dp * cp + cp_idx: 2 (rank 13), 3 (15)
  EXPECT_EQ(m.group(MeshGroup::Pp, 13), (std::vector<int>{5, 13}));
  EXPECT_EQ(m.group(MeshGroup::DpCp, 13), (std::vector<int>{9, 11, 13, 15}));
  for (int r = 0; r < 16; ++r) {
    const MeshCoord k = m.coord(r);
    EXPECT_EQ(m.rank_of(k.pp, k.dp, k.cp, k.tp), r);
  }
  EXPECT_NE(m.describe().find("x cp 2 x tp 2"), std::string::npos) << m.describe();
  p.ep_dispatcher = EpDispatcher::Hierarchical;
  try {
    DeviceMesh bad(p, 16, 8);
    ADD_FAILURE() << "hierarchical dispatch over strided EP ranks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hierarchical dispatch groups"), std::string::npos) << e.what();
  }
}

TEST(Mesh, SmallWorldIsOneNode) {
  DeviceMesh m(spec(1, 4, 4), 4, 8);  // ranks_per_node 8 > world 4
  EXPECT_EQ(m.ranks_per_node(), 4);
  EXPECT_EQ(m.num_nodes(), 1);
  EXPECT_EQ(m.ep_ranks_per_node(), 4);
  DeviceMesh m2(spec(1, 8, 8, 1, 2), 8, 16);  // EP spans 4 nodes of 2
  EXPECT_FALSE(m2.ep_within_node());
  EXPECT_EQ(m2.ep_ranks_per_node(), 2);
}

TEST(Mesh, EveryValidationRuleHasItsMessage) {
  auto err = [](const ParallelSpec& p, int world, int64_t E) { return error_of([&] { DeviceMesh m(p, world, E); }); };
  EXPECT_NE(err(spec(1, 4, 1), 6, 8).find("world size 6 != pp (1) * dp_replicate (1) * dp_shard (4) * cp (1) * tp (1) = 4"),
            std::string::npos);
  EXPECT_NE(err(spec(1, 6, 4), 6, 8).find("must divide dp"), std::string::npos);
  EXPECT_NE(err(spec(1, 4, 4), 4, 6).find("must divide n_routed_experts (6)"), std::string::npos);
  EXPECT_NE(err(spec(1, 4, 2), 4, 0).find("needs a MoE model"), std::string::npos);
  EXPECT_NE(err(spec(1, 6, 1, 1, 4), 6, 8).find("ranks_per_node (4) must divide the world size (6)"),
            std::string::npos);
  EXPECT_NE(err(spec(0, 4, 1), 4, 8).find("dp_replicate = 0"), std::string::npos);
  EXPECT_NE(err(spec(1, 0, 1), 4, 8).find("dp_shard = 0"), std::string::npos);
  EXPECT_NE(err(spec(1, 4, 0), 4, 8).find("ep = 0"), std::string::npos);
  EXPECT_NE(err(spec(1, 4, 1, 0), 4, 8).find("pp = 0"), std::string::npos);
  EXPECT_NE(err(spec(1, 4, 1, 1, 0), 4, 8).find("ranks_per_node = 0"), std::string::npos);
  EXPECT_NE(err(spec(1, 4, 1), 0, 8).find("world size 0"), std::string::npos);
  ParallelSpec h = spec(1, 12, 4, 1, 6);  // EP groups of 4 straddle nodes of 6
  h.ep_dispatcher = EpDispatcher::Hierarchical;
  EXPECT_NE(err(h, 12, 8).find("hierarchical dispatch needs the EP group"), std::string::npos);
  h.ep_dispatcher = EpDispatcher::AllToAll;
  EXPECT_EQ(err(h, 12, 8), "");  // the flat dispatchers do not care
  EXPECT_EQ(err(spec(1, 4, 1), 4, -1), "");
  EXPECT_NE(error_of([] { DeviceMesh(spec(1, 4, 1), 4).coord(4); }).find("rank 4 outside"), std::string::npos);
}

TEST(Mesh, CommsOnOneRank) {
  DeviceMesh m(spec(1, 1, 1), 1, 8);
  MeshComms c = make_mesh_comms(m, comm_local());
  for (MeshGroup g : {MeshGroup::Dp, MeshGroup::Ep, MeshGroup::Edp, MeshGroup::Pp}) EXPECT_EQ(c.get(g).size(), 1);
  DeviceMesh m4(spec(1, 4, 1), 4, 8);
  EXPECT_NE(error_of([&] { make_mesh_comms(m4, comm_local()); }).find("communicator size 1 != mesh world size 4"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------
// EP dispatch on one rank: every dispatcher, payload and routing shape.

namespace {
EpDispatchConfig ep_cfg(EpDispatcher kind, EpPayload dp, EpPayload cp, int E = 8, int k = 3, int64_t D = 200,
                        int64_t max_tokens = 64) {
  EpDispatchConfig c;
  c.kind = kind;
  c.n_experts = E;
  c.topk = k;
  c.hidden = D;
  c.max_tokens = max_tokens;
  c.dispatch_payload = dp;
  c.combine_payload = cp;
  return c;
}
}  // namespace

namespace {
void all_payloads_and_routes(EpDispatcher kind, EpTransport transport = EpTransport::Mpi) {
  Comm c = comm_local();
  for (EpPayload dp : {EpPayload::F32, EpPayload::BF16, EpPayload::E4M3})
    for (EpPayload cp : {EpPayload::F32, EpPayload::BF16})
      for (bool land : {false, true}) {
        if (land && dp == EpPayload::E4M3) continue;  // refused (EpDispatchLocal.BadInput)
        SCOPED_TRACE(std::string(to_string(kind)) + " " + std::string(to_string(dp)) + "/" + std::string(to_string(cp)) +
                     (land ? " landed" : ""));
        EpDispatchConfig cf = ep_cfg(kind, dp, cp);
        cf.land_rows = land;
        cf.transport = transport;
        EpDispatch ep(c, cf);
        // Several calls on one object: buffers are reused, N changes; with land_rows the odd seeds land in the
        // check's buffer, the even ones in the dispatcher's.
        for (auto route : {ep_check::Route::Random, ep_check::Route::Skewed, ep_check::Route::Empty})
          ep_check::check_ep(c, ep, route, 37, 11);
        ep_check::check_ep(c, ep, ep_check::Route::Random, 3, 12);
        EXPECT_EQ(ep.stats().dispatch.calls, 4);
        EXPECT_EQ(ep.stats().combine.calls, 8);
        EXPECT_EQ(ep.stats().dispatch.bytes_inter + ep.stats().dispatch.bytes_intra, 0);  // all to self
      }
}
}  // namespace

TEST(EpDispatchLocal, AllToAll) { all_payloads_and_routes(EpDispatcher::AllToAll); }
TEST(EpDispatchLocal, SyncFree) { all_payloads_and_routes(EpDispatcher::SyncFree); }
TEST(EpDispatchLocal, Hierarchical) { all_payloads_and_routes(EpDispatcher::Hierarchical); }
TEST(EpDispatchLocal, AllToAllSharedMemory) { all_payloads_and_routes(EpDispatcher::AllToAll, EpTransport::Shm); }
TEST(EpDispatchLocal, SyncFreeSharedMemory) { all_payloads_and_routes(EpDispatcher::SyncFree, EpTransport::Shm); }

TEST(EpDispatchLocal, SyncFreeSharedMemoryAllocatesOnce) {
  // sync_free over shared memory: its segment is sized for max_tokens at construction and never grows; no
  // message buffers.
  Comm c = comm_local();
  EpDispatchConfig cf = ep_cfg(EpDispatcher::SyncFree, EpPayload::BF16, EpPayload::F32, 8, 3, 256, 64);
  cf.transport = EpTransport::Shm;
  EpDispatch ep(c, cf);
  const int64_t before = ep.buffer_bytes();
  ep_check::check_ep(c, ep, ep_check::Route::Skewed, 50, 1);
  ep_check::check_ep(c, ep, ep_check::Route::Random, 60, 3);
  EXPECT_EQ(ep.buffer_bytes(), before);
  int64_t data = 0;
  bool has_recv = false;
  for (const auto& t : ep.buffers()) {
    has_recv |= t.name == "dispatch.recv";
    if (t.name.rfind("shm.data", 0) == 0) data = t.bytes;
  }
  EXPECT_FALSE(has_recv);
  EXPECT_GE(data, 64 * 3 * (8 + 256 * 4) + 64 * 256 * 2);  // records + fp32 combine rows, bf16 token rows
}

TEST(EpDispatchLocal, NoTokensAtAll) {
  Comm c = comm_local();
  EpDispatch ep(c, ep_cfg(EpDispatcher::SyncFree, EpPayload::F32, EpPayload::F32));
  EXPECT_EQ(ep.dispatch(nullptr, nullptr, nullptr, 0), 0);
  for (int le = 0; le < 8; ++le) EXPECT_EQ(ep.recv_counts()[le], 0);
  ep.combine(nullptr, nullptr);
}

TEST(EpDispatchLocal, SyncFreeAllocatesOnceAndReportsIt) {
  Comm c = comm_local();
  EpDispatch ep(c, ep_cfg(EpDispatcher::SyncFree, EpPayload::E4M3, EpPayload::F32, 8, 3, 256, 64));
  const int64_t before = ep.buffer_bytes();
  EXPECT_GT(before, 64 * 3 * 256 * 4);  // at least the worst-case received fp32 rows
  ep_check::check_ep(c, ep, ep_check::Route::Skewed, 50, 1);
  EXPECT_EQ(ep.buffer_bytes(), before);  // nothing grew
  bool has_recv = false;
  for (const auto& t : ep.buffers()) has_recv |= t.name == "dispatch.recv";
  EXPECT_TRUE(has_recv);
  std::vector<float> x(65 * 256);
  std::vector<int32_t> idx(65 * 3, 0);
  for (int i = 0; i < 65; ++i) idx[size_t(3 * i + 1)] = 1, idx[size_t(3 * i + 2)] = 2;
  EXPECT_NE(error_of([&] { ep.dispatch(x.data(), idx.data(), nullptr, 65); }).find("exceeds max_tokens=64"),
            std::string::npos);
}

TEST(EpDispatchLocal, BadInput) {
  Comm c = comm_local();
  auto cfg = ep_cfg(EpDispatcher::AllToAll, EpPayload::F32, EpPayload::F32, 8, 2, 16);
  EpDispatch ep(c, cfg);
  std::vector<float> x(2 * 16);
  std::vector<int32_t> dup = {1, 1, 2, 3}, oob = {0, 8, 1, 2};
  EXPECT_NE(error_of([&] { ep.combine(x.data(), x.data()); }).find("combine before any dispatch"), std::string::npos);
  EXPECT_NE(error_of([&] { ep.dispatch(x.data(), dup.data(), nullptr, 2); }).find("expert 1 twice"), std::string::npos);
  EXPECT_NE(error_of([&] { ep.dispatch(x.data(), oob.data(), nullptr, 2); }).find("outside [0, E=8)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ep.dispatch(nullptr, oob.data(), nullptr, 2); }).find("null x"), std::string::npos);
  auto bad = cfg;
  bad.topk = 9;
  EXPECT_NE(error_of([&] { EpDispatch e(c, bad); }).find("topk=9"), std::string::npos);
  bad = cfg;
  bad.combine_payload = EpPayload::E4M3;
  EXPECT_NE(error_of([&] { EpDispatch e(c, bad); }).find("combine payload"), std::string::npos);
  bad = cfg;
  bad.kind = EpDispatcher::SyncFree;
  bad.max_tokens = 0;
  EXPECT_NE(error_of([&] { EpDispatch e(c, bad); }).find("max_tokens > 0"), std::string::npos);
  bad = cfg;
  bad.hidden = 0;
  EXPECT_NE(error_of([&] { EpDispatch e(c, bad); }).find("hidden=0"), std::string::npos);
  // land_rows: not with e4m3 rows; the landing is required with it and refused without it.
  bad = cfg;
  bad.land_rows = true;
  bad.dispatch_payload = EpPayload::E4M3;
  EXPECT_NE(error_of([&] { EpDispatch e(c, bad); }).find("land_rows needs an f32 or bf16 dispatch payload"),
            std::string::npos);
  std::vector<int32_t> ok = {0, 1, 2, 3};
  float room[2 * 2 * 16];
  const EpDispatch::RowLanding land = [&](int64_t) -> void* { return room; };
  EXPECT_NE(error_of([&] { ep.dispatch(x.data(), ok.data(), nullptr, 2, land); }).find("needs land_rows"),
            std::string::npos);
  bad = cfg;
  bad.land_rows = true;
  EpDispatch landed(c, bad);
  EXPECT_NE(error_of([&] { landed.dispatch(x.data(), ok.data(), nullptr, 2); }).find("dispatch needs a RowLanding"),
            std::string::npos);
  EXPECT_EQ(landed.dispatch(x.data(), ok.data(), nullptr, 2, land), 4);
}

// ---------------------------------------------------------------------------------------------------------
// Node-limited routing helpers

TEST(NodeLimited, AtMostMNodesAndMatchesGroupLimitedRouter) {
  const int E = 32, k = 4, n_nodes = 4, M = 2;
  const int64_t N = 200;
  std::vector<float> q(size_t(N * E));
  for (int64_t i = 0; i < N * E; ++i) q[size_t(i)] = 0.5f + 0.5f * ep_check::unit(3, 1, 2, uint64_t(i));
  std::vector<int32_t> idx(size_t(N * k));
  ep_node_limited_topk(idx.data(), q.data(), N, E, k, n_nodes, M);
  EXPECT_LE(ep_max_nodes_per_token(idx.data(), N, k, E, n_nodes), M);
  // k / M = 2: the node score is the top-2 sum, i.e. the router's group-limited selection with groups = nodes.
  RouterConfig rc;
  rc.E = E;
  rc.topk = k;
  rc.n_group = n_nodes;
  rc.topk_group = M;
  rc.group_score = GroupScore::Top2Sum;
  std::vector<int32_t> ref(static_cast<size_t>(k));
  for (int64_t n = 0; n < N; ++n) {
    router_select_ref<float>(ref.data(), q.data() + n * E, nullptr, rc);
    for (int j = 0; j < k; ++j) ASSERT_EQ(idx[size_t(n * k + j)], ref[size_t(j)]) << "token " << n;
  }
  // The mask form: ineligible experts are -inf, eligible ones keep their score.
  std::vector<float> masked(q.size());
  ep_node_limit_scores(masked.data(), q.data(), N, E, n_nodes, 1, k);
  for (int64_t n = 0; n < N; ++n) {
    int kept = 0;
    for (int b = 0; b < n_nodes; ++b) kept += std::isfinite(masked[size_t(n * E + b * (E / n_nodes))]);
    EXPECT_EQ(kept, 1);
  }
  EXPECT_NE(error_of([&] { ep_node_limited_topk(idx.data(), q.data(), N, E, k, 3, M); }).find("must divide E"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ep_node_limited_topk(idx.data(), q.data(), N, E, 20, n_nodes, M); }).find("cannot be met"),
            std::string::npos);
}

TEST(NodeLimited, HierarchicalReferenceEqualsFlatOnOneNode) {
  // Every token's experts on one node: the hierarchical order is the flat slot order, bitwise.
  const int E = 16, k = 3, n_nodes = 4;
  const int64_t N = 20, D = 70;
  auto T = ep_check::make_tokens(0, N, ep_check::Route::NodeLimited, E, k, D, n_nodes, 5);
  std::vector<float> yp(size_t(T.N * k * D));
  for (size_t i = 0; i < yp.size(); ++i) yp[i] = ep_check::unit(1, 2, 3, i);
  std::vector<int32_t> ident(size_t(T.N * k));
  std::iota(ident.begin(), ident.end(), 0);
  std::vector<float> a(size_t(T.N * D)), b(a.size());
  ep_combine_hierarchical_ref(a.data(), yp.data(), T.idx.data(), T.w.data(), T.N, k, D, E, n_nodes);
  moe_unpermute(b.data(), yp.data(), ident.data(), T.w.data(), T.N, k, T.N * k, D);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
}
