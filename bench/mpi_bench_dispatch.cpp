// mpi_bench_dispatch.cpp: EP dispatch + combine throughput under MPI, for the three dispatchers (and
// alltoall with alltoall_direct) and the payload formats, each compared with a raw MPI_Alltoall that moves
// the same number of bytes per rank in the same run (the ratio is the figure that survives a noisy machine).
// Its own main (Google Benchmark does not fit a collective loop). Not a correctness test (tests/mpi/).
//
//   mpirun --oversubscribe -np 4 build/bench/mpi_bench_dispatch [--tokens 2048] [--hidden 512] [--topk 6]
//          [--experts 64] [--rpn 2] [--iters 8] [--warmup 2]
//          [--only alltoall,direct,sync_free,hierarchical] [--payloads f32,bf16,e4m3,bf16f32]
//          [--land no|yes|both] [--mpi-thread multiple|funneled] [--transport mpi,shm]
//
// Payloads (dispatch/combine): f32 f32/f32, bf16 bf16/bf16, e4m3 e4m3/bf16, bf16f32 bf16/f32 (what the trainer
// sends under bf16 compute). --land: with f32 or bf16 dispatch rows, also (yes: only) the land_rows form, where
// the rows land undecoded in a buffer of the caller's (the trainer's experts' input) instead of fp32 recv_x;
// the "experts" then read an fp32 buffer of R rows of their own for the combine.
// --mpi-thread: the thread level MPI_Init is asked for (the trainer's [comm] mpi_thread; default multiple).
// --transport: the EP transports to run (ep_transport: mpi messages, shm = shared memory, alltoall and sync_free
// only; the "+shm" rows). Default both.
// Per configuration, per iteration: barrier; dispatch; combine (the "experts" are the identity: yr = recv_x);
// the iteration time is the slowest rank's. bytes = what one rank sends in dispatch + combine, averaged over
// ranks, all destinations (self included; payload rows, per-record metadata, headers and count rounds, i.e.
// everything that crosses; not the local copies). GB/s = bytes / time. raw: MPI_Alltoall with bytes / P per
// peer (contiguous buffers), timed in alternation with the dispatcher; ratio = GB/s / raw_GB/s (best of the
// iterations for both). rawr / ratio_r: the same bytes split into as many MPI_Alltoall calls as the
// dispatcher's communication rounds (what the synchronizations alone cost). comm_ms: time inside communication
// calls (slowest rank; includes waiting for slower ranks). Inter-node bytes treat ranks r / rpn as nodes (on
// one machine there is no real inter-node link: see docs/parallel.md); with more than one node the run ends
// with the routing's expected hierarchical reduction and the measured one.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "moetron/comm.h"
#include "moetron/dtype.h"
#include "moetron/ep_dispatch.h"
#include "moetron/permute.h"
#include "moetron/runtime.h"

using namespace moetron;

namespace {

uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double now() { return MPI_Wtime(); }

double max_over_ranks(double v) {
  double m = 0;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}
double sum_over_ranks(double v) {
  double m = 0;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return m;
}

struct Args {
  int64_t tokens = 2048, hidden = 512;
  int topk = 6, experts = 64, rpn = 2, iters = 8, warmup = 2;
  std::string only = "alltoall,direct,sync_free,hierarchical", payloads = "f32,bf16,e4m3,bf16f32", land = "both";
  std::string mpi_thread = "multiple", transport = "mpi,shm";
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    long long v = std::atoll(argv[i + 1]);
    if (k == "--only") a.only = argv[i + 1];
    else if (k == "--payloads") a.payloads = argv[i + 1];
    else if (k == "--land") a.land = argv[i + 1];
    else if (k == "--transport") a.transport = argv[i + 1];
    else if (k == "--mpi-thread") a.mpi_thread = argv[i + 1];
    else if (k == "--tokens") a.tokens = v;
    else if (k == "--hidden") a.hidden = v;
    else if (k == "--topk") a.topk = int(v);
    else if (k == "--experts") a.experts = int(v);
    else if (k == "--rpn") a.rpn = int(v);
    else if (k == "--iters") a.iters = int(v);
    else if (k == "--warmup") a.warmup = int(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  if (a.land != "no" && a.land != "yes" && a.land != "both") {
    std::fprintf(stderr, "--land must be no, yes or both, not '%s'\n", a.land.c_str());
    std::exit(2);
  }
  const std::string& t = a.transport;
  if (t != "mpi" && t != "shm" && t != "mpi,shm" && t != "shm,mpi") {
    std::fprintf(stderr, "--transport must list mpi and/or shm, not '%s'\n", a.transport.c_str());
    std::exit(2);
  }
  if (a.mpi_thread != "multiple" && a.mpi_thread != "funneled") {
    std::fprintf(stderr, "--mpi-thread must be multiple or funneled, not '%s'\n", a.mpi_thread.c_str());
    std::exit(2);
  }
  return a;
}

struct Timing {
  double best = 1e30, median = 0;
};
Timing summarize(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2]};
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  comm_request_mpi_thread(a.mpi_thread == "multiple");  // before comm_world() starts MPI
  Comm world = comm_world();
  const int P = world.size(), me = world.rank();
  init_threads(0, P);
  if (a.experts % P != 0) {
    if (me == 0) std::fprintf(stderr, "experts (%d) must be a multiple of the rank count (%d)\n", a.experts, P);
    comm_finalize();
    return 2;
  }
  // Inputs: uniform routing, k distinct experts per token.
  const int64_t N = a.tokens, D = a.hidden;
  const int k = a.topk, E = a.experts;
  std::vector<float> x(size_t(N * D)), w(size_t(N * k));
  std::vector<int32_t> idx(size_t(N * k));
  for (int64_t i = 0; i < N * D; ++i) x[size_t(i)] = float(int64_t(mix(uint64_t(me) << 40 | uint64_t(i)) >> 40) - (1 << 23)) / float(1 << 23);
  std::vector<int> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < N; ++t) {
    for (int e = 0; e < E; ++e) perm[size_t(e)] = e;
    for (int s = 0; s < k; ++s) {
      const int j = s + int(mix(uint64_t(me) * 7919u + uint64_t(t * k + s) + 17) % uint64_t(E - s));
      std::swap(perm[size_t(s)], perm[size_t(j)]);
      idx[size_t(t * k + s)] = perm[size_t(s)];
      w[size_t(t * k + s)] = 1.0f / float(k);
    }
  }
  std::vector<float> y(size_t(N * D));

  if (me == 0) {
    std::printf("# mpi_bench_dispatch: %d ranks (%s), %s\n", P, "one machine, ranks share its cores", runtime_summary().c_str());
    std::printf("# tokens/rank %lld, hidden %lld, top-%d of %d experts (%d per rank), nodes of %d ranks, iters %d\n",
                (long long)N, (long long)D, k, E, E / P, a.rpn, a.iters);
    std::printf("%-15s %-10s %8s %8s %8s %8s %7s %8s %6s %7s %8s %6s %7s %8s\n", "dispatcher", "payload", "ms_best",
                "ms_med", "comm_ms", "MB/rank", "GB/s", "raw_GB/s", "ratio", "rounds", "rawr_GB/s", "ratio_r",
                "inter%", "buf_MB");
  }

  struct Case {
    EpDispatcher kind;
    EpPayload dp, cp;
    bool direct, land, shm;
  };
  std::vector<Case> cases;
  auto listed = [](const std::string& list, std::string_view name) {  // name is an item of the comma list
    size_t i = 0;
    while (i <= list.size()) {
      const size_t j = std::min(list.find(',', i), list.size());
      if (std::string_view(list).substr(i, j - i) == name) return true;
      i = j + 1;
    }
    return false;
  };
  struct Pay {
    const char* name;
    EpPayload dp, cp;
  };
  for (EpDispatcher kd : {EpDispatcher::AllToAll, EpDispatcher::SyncFree, EpDispatcher::Hierarchical})
    for (Pay y : {Pay{"f32", EpPayload::F32, EpPayload::F32}, Pay{"bf16", EpPayload::BF16, EpPayload::BF16},
                  Pay{"e4m3", EpPayload::E4M3, EpPayload::BF16}, Pay{"bf16f32", EpPayload::BF16, EpPayload::F32}})
      if (listed(a.payloads, y.name))
        for (bool land : {false, true}) {
          if (land ? (a.land == "no" || y.dp == EpPayload::E4M3) : (a.land == "yes" && y.dp != EpPayload::E4M3)) continue;
          if (listed(a.transport, "mpi")) {
            if (listed(a.only, to_string(kd))) cases.push_back({kd, y.dp, y.cp, false, land, false});
            if (kd == EpDispatcher::AllToAll && listed(a.only, "direct"))
              cases.push_back({kd, y.dp, y.cp, true, land, false});
          }
          // shm: flat dispatchers only (hierarchical refuses it); alltoall_direct changes nothing there
          if (listed(a.transport, "shm") && kd != EpDispatcher::Hierarchical && listed(a.only, to_string(kd)))
            cases.push_back({kd, y.dp, y.cp, false, land, true});
        }

  // Routing facts (all ranks): nodes touched per token (nodes = groups of rpn ranks), slots on another node
  // than the token's home, and remote nodes per token. Flat sends one row per remote slot across nodes,
  // hierarchical one per remote node: expected inter-node row reduction = remote slots / remote nodes
  // (and, as usually quoted, k / nodes touched).
  const int rpn = a.rpn <= 0 || a.rpn > P ? P : a.rpn, n_nodes = P / rpn, El = E / P;
  double route[3] = {0, 0, 0};  // sum over tokens of nodes touched, remote slots, remote nodes
  {
    std::vector<char> seen(static_cast<size_t>(n_nodes));
    for (int64_t t = 0; t < N; ++t) {
      std::fill(seen.begin(), seen.end(), 0);
      for (int s = 0; s < k; ++s) {
        const int b = (idx[size_t(t * k + s)] / El) / rpn;
        route[1] += b != me / rpn;
        if (!seen[size_t(b)]) {
          seen[size_t(b)] = 1;
          route[0] += 1;
          route[2] += b != me / rpn;
        }
      }
    }
    for (double& v : route) v = sum_over_ranks(v) / double(N * P);
  }
  struct Row {
    EpDispatcher kind;
    EpPayload dp;
    double inter_bytes, ms;
  };
  std::vector<Row> rows;

  std::vector<char> raw_send, raw_recv;
  for (const Case& c : cases) {
    EpDispatchConfig cfg;
    cfg.kind = c.kind;
    cfg.n_experts = E;
    cfg.topk = k;
    cfg.hidden = D;
    cfg.max_tokens = N;
    cfg.ranks_per_node = a.rpn;
    cfg.dispatch_payload = c.dp;
    cfg.combine_payload = c.cp;
    cfg.alltoall_direct = c.direct;
    cfg.land_rows = c.land;
    cfg.transport = c.shm ? EpTransport::Shm : EpTransport::Mpi;
    EpDispatch ep(world, cfg);
    // land_rows: the caller's buffer for the rows (as the trainer's experts' input) and the experts' fp32
    // output the combine reads (any values: the combine's cost does not depend on them); with shm the experts'
    // output is the dispatcher's combine rows (combine_in_place), written once after the sizing call.
    std::vector<char> landing;
    std::vector<float> yr_own;
    const size_t wire_row = size_t(D) * (c.dp == EpPayload::BF16 ? 2 : 4);
    const EpDispatch::RowLanding land = [&](int64_t r) -> void* {
      if (landing.size() < size_t(r) * wire_row) landing.resize(size_t(r) * wire_row);
      if (yr_own.size() < size_t(r * D)) yr_own.resize(size_t(r * D), 0.5f);
      return landing.data();
    };
    auto dispatch_combine = [&] {
      if (!c.land) {
        ep.dispatch(x.data(), idx.data(), w.data(), N);
        ep.combine(y.data(), ep.recv_x(), true);
      } else if (c.shm) {  // the experts' outputs already in the combine rows (as a GEMM would write them)
        ep.dispatch(x.data(), idx.data(), w.data(), N, land);
        ep.combine_in_place(y.data(), true);
      } else {
        ep.dispatch(x.data(), idx.data(), w.data(), N, land);
        ep.combine(y.data(), yr_own.data(), true);
      }
    };
    // One call to size things and count bytes.
    dispatch_combine();
    if (c.shm && c.land && ep.recv_rows() > 0) {
      const int64_t n = ep.recv_rows() * D;
      if (c.cp == EpPayload::BF16) std::fill_n(static_cast<bf16*>(ep.combine_rows()), n, to_bf16(0.5f));
      else std::fill_n(static_cast<float*>(ep.combine_rows()), n, 0.5f);
    }
    const EpStats st0 = ep.stats();
    const EpTraffic& d0 = st0.last_dispatch;
    const EpTraffic& c0 = st0.last_combine;
    const double bytes = double(d0.bytes_self + d0.bytes_remote() + c0.bytes_self + c0.bytes_remote());
    const double inter = double(d0.bytes_inter + c0.bytes_inter);
    const double avg_bytes = sum_over_ranks(bytes) / P, avg_inter = sum_over_ranks(inter) / P;
    // Payload error (bf16 / e4m3) of what the experts received: max |x' - x| / amax of the 128-block.
    double err = 0;
    if (c.dp != EpPayload::F32 && !c.land) {
      // Recompute from the source's inputs is not possible here (other ranks' x); use local rows: the tokens
      // this rank sent to itself come back in recv_x with src == me.
      const int64_t R = ep.recv_rows();
      for (int64_t r = 0; r < R; ++r) {
        if (ep.recv_src()[r] != me) continue;
        const float* got = ep.recv_x() + r * D;
        const float* ref = x.data() + int64_t(ep.recv_token()[r]) * D;
        for (int64_t b0 = 0; b0 < D; b0 += 128) {
          float amax = 0, e = 0;
          for (int64_t d = b0; d < std::min(D, b0 + 128); ++d) {
            amax = std::max(amax, std::fabs(ref[d]));
            e = std::max(e, std::fabs(got[d] - ref[d]));
          }
          if (amax > 0) err = std::max(err, double(e / amax));
        }
      }
      err = max_over_ranks(err);
    }
    // Raw all-to-all of the same bytes per rank.
    const int64_t per_peer = int64_t(std::ceil(avg_bytes / P));
    raw_send.assign(size_t(per_peer * P), 1);
    raw_recv.assign(size_t(per_peer * P), 0);
    if (per_peer > INT32_MAX) {
      if (me == 0) std::fprintf(stderr, "too many bytes for one MPI_Alltoall\n");
      break;
    }
    // Raw all-to-all split into as many calls as the dispatcher makes (count rounds included): how much of
    // the gap is the number of synchronizations rather than the local copies.
    const int nrounds = int(std::max<int64_t>(1, d0.rounds + c0.rounds));
    const int64_t per_peer_r = std::max<int64_t>(1, per_peer / nrounds);
    std::vector<double> t_ep, t_raw, t_comm, t_rawr;
    for (int it = 0; it < a.warmup + a.iters; ++it) {
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = now();
      dispatch_combine();
      const double te = max_over_ranks(now() - t0);
      const EpStats sti = ep.stats();
      const double tc = max_over_ranks(sti.last_dispatch.seconds_comm + sti.last_combine.seconds_comm);
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = now();
      MPI_Alltoall(raw_send.data(), int(per_peer), MPI_BYTE, raw_recv.data(), int(per_peer), MPI_BYTE, MPI_COMM_WORLD);
      const double tr = max_over_ranks(now() - t0);
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = now();
      for (int r = 0; r < nrounds; ++r) {  // each round its own part of the buffers (no cache-hot replays)
        const size_t o = size_t(r) * size_t(per_peer_r) * size_t(P);
        MPI_Alltoall(raw_send.data() + o, int(per_peer_r), MPI_BYTE, raw_recv.data() + o, int(per_peer_r), MPI_BYTE,
                     MPI_COMM_WORLD);
      }
      const double trr = max_over_ranks(now() - t0);
      if (it >= a.warmup) {
        t_rawr.push_back(trr);
        t_ep.push_back(te);
        t_raw.push_back(tr);
        t_comm.push_back(tc);
      }
    }
    const Timing te = summarize(t_ep), tr = summarize(t_raw), tcm = summarize(t_comm), trr = summarize(t_rawr);
    const double raw_r = double(per_peer_r * nrounds * P) / trr.best * 1e-9;
    if (!c.direct && !c.land && !c.shm && c.cp == (c.dp == EpPayload::F32 ? EpPayload::F32 : EpPayload::BF16))
      rows.push_back({c.kind, c.dp, avg_inter, te.best * 1e3});
    const double gbs = avg_bytes / te.best * 1e-9, raw = avg_bytes / tr.best * 1e-9;
    const double buf = max_over_ranks(double(ep.buffer_bytes())) / 1048576.0;
    if (me == 0) {
      std::string pl = std::string(to_string(c.dp)) + "/" + std::string(to_string(c.cp)) + (c.land ? "+L" : "");
      char errs[32] = "-";
      if (c.dp != EpPayload::F32) std::snprintf(errs, sizeof errs, "%.4f", err);
      std::printf("%-15s %-10s %8.2f %8.2f %8.2f %8.1f %7.2f %8.2f %6.2f %7d %8.2f %6.2f %6.1f%% %8.1f  rel_err %s\n",
                  (std::string(to_string(c.kind)) + (c.direct ? "+direct" : "") + (c.shm ? "+shm" : "")).c_str(),
                  pl.c_str(), te.best * 1e3, te.median * 1e3, tcm.best * 1e3,
                  avg_bytes / 1e6, gbs, raw, gbs / raw, nrounds, raw_r, gbs / raw_r, 100.0 * avg_inter / avg_bytes, buf,
                  errs);
      std::fflush(stdout);
    }
  }
  // The floor on this machine: the local passes any fp32 dispatch + combine must make besides moving the bytes
  // (gather the k rows of each token into a send buffer; read the k returned rows of each token to sum them),
  // all ranks at once and no communication, against the raw all-to-all of the fp32 rows of both directions.
  // ratio bound = raw / (raw + local) if nothing overlaps (blocking collectives).
  if (listed(a.payloads, "f32")) {
    std::vector<float> buf(size_t(N * k * D));
    std::vector<int32_t> ident(size_t(N * k));
    for (int64_t i = 0; i < N * k; ++i) ident[size_t(i)] = int32_t(i);
    const int64_t pp = N * k * D * 4 * 2 / P;
    raw_send.assign(size_t(pp * P), 1);
    raw_recv.assign(size_t(pp * P), 0);
    std::vector<double> tl, tr;
    for (int it = 0; it < a.warmup + a.iters; ++it) {
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = now();
      for (int64_t t = 0; t < N; ++t)
        for (int s = 0; s < k; ++s) std::memcpy(buf.data() + (t * k + s) * D, x.data() + t * D, size_t(D * 4));
      moe_unpermute(y.data(), buf.data(), ident.data(), w.data(), N, k, N * k, D);
      const double l = max_over_ranks(now() - t0);
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = now();
      MPI_Alltoall(raw_send.data(), int(pp), MPI_BYTE, raw_recv.data(), int(pp), MPI_BYTE, MPI_COMM_WORLD);
      const double r = max_over_ranks(now() - t0);
      if (it >= a.warmup) {
        tl.push_back(l);
        tr.push_back(r);
      }
    }
    const double l = summarize(tl).best, r = summarize(tr).best;
    if (me == 0)
      std::printf("# floor (f32): necessary local passes %.2f ms (gather k rows/token + weighted sum), raw all-to-all of "
                  "the rows both ways %.2f ms -> ratio bound without overlap %.2f\n",
                  l * 1e3, r * 1e3, r / (r + l));
  }
  if (me == 0 && n_nodes > 1) {
    std::printf("# routing: %.3f nodes touched per token (of %d), %.3f slots and %.3f nodes remote per token\n",
                route[0], n_nodes, route[1], route[2]);
    std::printf("# expected inter-node reduction hierarchical vs flat: k / nodes touched = %.2fx; remote slots / "
                "remote nodes = %.2fx (payload rows; headers differ)\n",
                double(k) / route[0], route[1] / route[2]);
    for (const Row& h : rows) {
      if (h.kind != EpDispatcher::Hierarchical) continue;
      for (const Row& f : rows)
        if (f.kind == EpDispatcher::AllToAll && f.dp == h.dp)
          std::printf("# %-5s inter-node MB per rank per call (dispatch+combine): alltoall %.2f, hierarchical %.2f "
                      "(%.2fx less); time %.2f vs %.2f ms\n",
                      std::string(to_string(h.dp)).c_str(), f.inter_bytes / 1e6, h.inter_bytes / 1e6,
                      f.inter_bytes / h.inter_bytes, f.ms, h.ms);
    }
  }
  comm_finalize();
  return 0;
}
