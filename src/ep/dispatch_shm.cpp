// dispatch_shm.cpp: the flat layout's rows through shared memory (ep_transport = "shm"), for alltoall and
// sync_free when every EP rank is on one node. No message is packed and none is unpacked: a home rank writes
// its records' metadata and its token rows (once per token, in the payload's type) into its own data segment
// and publishes a flag; each expert rank then reads the rows it receives straight from the homes' segments
// into their grouped place (the caller's landing with land_rows), decoding as it copies. The combine runs the
// other way: each expert rank encodes its output rows straight into the homes' segments, in the home's record
// order, and each home reduces them from its own segment. So the only passes over the rows are the ones any
// transport must make: one copy each way, fused with the encode / decode / gather, and the combine's sum.
//
// Synchronization is by flags in small per-rank control segments, not by collectives: a home overwrites its
// segment only after every peer has acknowledged reading the previous dispatch, and an expert writes into a
// home's combine rows only after that home has reduced the previous combine. When a rank needs a larger data
// segment, every rank sees it in the published sizes and all regrow together (a collective, the only one).
// The backward helpers (redispatch, combine_scalars) keep the MPI rounds of dispatch_flat.cpp over the same
// plan (the counts and offsets are filled here as the MPI dispatch fills them).
// Not the MPI exchanges (dispatch_alltoall.cpp, dispatch_sync_free.cpp) and not the hierarchical dispatcher.
#include <algorithm>
#include <atomic>

#include "ep/dispatch_flat.h"
#include "moetron/check.h"

namespace moetron::ep {
namespace {

// Control segment, in int64 slots: each flag on its own cache line, then this rank's sizes and its send counts.
constexpr int64_t kReady = 0;     // dispatches whose data this rank has published
constexpr int64_t kAck = 8;       // dispatches whose peers' data this rank has finished reading
constexpr int64_t kPushed = 16;   // combines whose rows this rank has written into every home's segment
constexpr int64_t kReduced = 24;  // combines this rank has reduced (its combine rows are free again)
constexpr int64_t kNeed = 32, kTokens = 33, kRecords = 34;  // data bytes needed, N, S1 of the last dispatch
constexpr int64_t kCounts = 40;                             // [P*El] records per (destination, local expert)

// Where a home's regions start in its data segment: metadata [S1 x 8 B], token rows [N x pb], combine rows [S1 x cb].
int64_t rows_at(int64_t s1) { return round_up(s1 * 8, 64); }
int64_t comb_rows_at(int64_t n, int64_t s1, int64_t pb) { return rows_at(s1) + round_up(n * pb, 64); }

}  // namespace

int64_t* FlatDispatcher::shm_flags(int q) const { return reinterpret_cast<int64_t*>(shm_ctrl->segment(q)); }

void FlatDispatcher::shm_wait(int64_t slot, int64_t v, EpTraffic& tr) const {
  timed_comm(tr, [&] {
    shm_ctrl->wait_until([&] {
      for (int q = 0; q < P; ++q)
        if (SharedMemory::seen(shm_flags(q) + slot) < v) return false;
      return true;
    });
  });
}

int64_t FlatDispatcher::shm_need(int64_t n, int64_t s1) const { return comb_rows_at(n, s1, pb) + s1 * cb; }

void FlatDispatcher::shm_open(int64_t data_bytes) {
  shm_ctrl = comm.share_memory((kCounts + int64_t(P) * El) * 8);
  MT_CHECK(shm_ctrl != nullptr, "ep_dispatch",
           "ep_transport = shm needs every EP rank on one node (shared memory); these ", P,
           " ranks are not: use ep_transport = mpi");
  std::memset(shm_ctrl->segment(me), 0, size_t(shm_ctrl->bytes()));
  shm_data = comm.share_memory(data_bytes);
  hoff.assign(size_t(P) * El, 0);
  comb_at.assign(size_t(P), 0);
  comm.barrier();  // every control segment is zeroed before anyone reads one
}

void FlatDispatcher::shm_dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) {
  plan_send(idx, n);
  const int64_t g = ++shm_gen;
  // Peers read this rank's segment until they acknowledge its previous dispatch.
  shm_wait(kAck, g - 1, tr);
  int64_t* mine = shm_flags(me);
  mine[kNeed] = shm_need(n, S1);
  mine[kTokens] = n;
  mine[kRecords] = S1;
  std::copy(cnt.begin(), cnt.end(), mine + kCounts);
  // This rank's records and token rows (the payload's encoding, once per token) into its own segment.
  auto write_home = [&] {
    char* seg = shm_data->segment(me);
    const int32_t* ro = row_of.data<int32_t>();
    const float* wc = wcopy.data<float>();
    for (int64_t i = 0; i < n * k; ++i)
      if (ro[i] >= 0) {
        const WireMeta m{int32_t(i), wc[i]};
        std::memcpy(seg + int64_t(ro[i]) * 8, &m, sizeof m);
      }
    char* rows = seg + rows_at(S1);
    if (cfg.dispatch_payload == EpPayload::BF16) {
      to_wire_bf16_rows(reinterpret_cast<bf16*>(rows), x, n, D);
    } else if (cfg.dispatch_payload == EpPayload::F32) {
      if (n > 0) std::memcpy(rows, x, size_t(n * D * 4));
    } else {
      encode_tokens(x, n);
      for (int64_t t = 0; t < n; ++t) write_payload(rows + t * pb, x, t);
    }
  };
  if (mine[kNeed] <= shm_data->bytes()) write_home();
  SharedMemory::publish(mine + kReady, g);
  shm_wait(kReady, g, tr);
  int64_t top = 0;
  for (int q = 0; q < P; ++q) top = std::max(top, shm_flags(q)[kNeed]);
  if (top > shm_data->bytes()) {  // every rank sees the same sizes: all regrow here, together
    MT_CHECK(!send1.frozen, "ep_dispatch", "shared segment of ", shm_data->bytes(), " bytes is too small for ", top,
             " (sync_free sizes it at construction)");
    timed_comm(tr, [&] {
      shm_data.reset();
      shm_data = comm.share_memory(round_up(top + top / 16, 64));
    });
    write_home();
    timed_comm(tr, [&] {
      std::atomic_thread_fence(std::memory_order_seq_cst);
      comm.barrier();
      std::atomic_thread_fence(std::memory_order_seq_cst);
    });
    tr.rounds += 1;
  }
  // What arrives: block (q, le) is home q's records for (this rank, le), at hoff in q's record order.
  for (int q = 0; q < P; ++q) {
    const int64_t* qc = shm_flags(q) + kCounts;
    int64_t acc = 0;
    for (int64_t b = 0; b < int64_t(me) * El; ++b) acc += qc[b];
    for (int le = 0; le < El; ++le) {
      const size_t b = size_t(q) * El + le;
      rcnt[b] = qc[int64_t(me) * El + le];
      MT_CHECK(rcnt[b] >= 0 && acc + rcnt[b] <= shm_flags(q)[kRecords], "ep_dispatch", "rank ", q,
               " published a corrupt count ", rcnt[b], " for local expert ", le);
      hoff[b] = acc;
      acc += rcnt[b];
    }
    comb_at[size_t(q)] = comb_rows_at(shm_flags(q)[kTokens], shm_flags(q)[kRecords], pb);
  }
  plan_recv();
  char* ox = alloc_outputs();
  const int64_t nblk = int64_t(P) * El;
  int64_t bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : bad) if (R * D >= kParMin)
  for (int64_t b = 0; b < nblk; ++b) {
    const int q = int(b / El);
    const char* seg = shm_data->segment(q);
    const char* meta = seg + hoff[size_t(b)] * 8;
    const char* rows = seg + rows_at(shm_flags(q)[kRecords]);
    const int64_t nq = shm_flags(q)[kTokens];
    for (int64_t i = 0; i < rcnt[size_t(b)]; ++i) {
      WireMeta m;
      std::memcpy(&m, meta + i * 8, 8);
      const int64_t t = m.code / k;
      if (m.code < 0 || t >= nq) {
        ++bad;
        break;
      }
      put_rows(ox, fpos[size_t(b)] + i, rows + t * pb, 1);
    }
    bad += !scatter_meta(b, meta);
  }
  MT_CHECK(bad == 0, "ep_dispatch", bad, " block(s) with corrupt record metadata");
  for (int q = 0; q < P; ++q) classify(tr, q, peer_send[size_t(q)] * (pb + 8) + int64_t(El) * 8);
  tr.rows_sent += S1;
  tr.rounds += 1;
  SharedMemory::publish(mine + kAck, g);
}

void FlatDispatcher::shm_combine(float* y, const float* yr, bool weighted, EpTraffic& tr) {
  const int64_t c = ++shm_comb;
  // A home's combine rows are free once it has reduced the previous combine.
  shm_wait(kReduced, c - 1, tr);
  const int64_t nblk = int64_t(P) * El;
#pragma omp parallel for schedule(dynamic, 1) if (R * D >= kParMin)
  for (int64_t b = 0; b < nblk; ++b) {
    const int q = int(b / El);
    char* dst = shm_data->segment(q) + comb_at[size_t(q)] + hoff[size_t(b)] * cb;
    const float* src = yr + fpos[size_t(b)] * D;
    for (int64_t i = 0; i < rcnt[size_t(b)]; ++i) encode_row(dst + i * cb, src + i * D);
  }
  for (int q = 0; q < P; ++q) classify(tr, q, peer_recv[size_t(q)] * cb);
  tr.rows_sent += R;
  tr.rows_recv += S1;
  tr.rounds += 1;
  SharedMemory::publish(shm_flags(me) + kPushed, c);
  shm_wait(kPushed, c, tr);
  reduce_rows(y, cdec, shm_data->segment(me) + comb_at[size_t(me)], row_of.data<int32_t>(),
              weighted ? wcopy.data<float>() : nullptr, N, S1);
  SharedMemory::publish(shm_flags(me) + kReduced, c);
}

std::vector<EpBufferTerm> FlatDispatcher::extra_terms() const {
  if (!shm()) return {};
  return {{"shm.control [P] flags, sizes, counts", shm_ctrl->bytes()},
          {"shm.data [S1] meta + [N] token rows + [S1] combine rows", shm_data->bytes()}};
}

}  // namespace moetron::ep
