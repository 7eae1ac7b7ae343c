// dispatch_shm.cpp: the flat layout's rows through shared memory (ep_transport = "shm"), for alltoall and
// sync_free when every EP rank is on one node. No message is packed and none is unpacked: a home rank writes
// its records' metadata and its token rows (once per token, in the payload's type) into its own data segment
// and publishes a flag; each expert rank then reads the rows it receives straight from the homes' segments
// into their grouped place (the caller's landing with land_rows, else its own segment's fp32 rows, which are
// recv_x), decoding as it copies. The combine runs the other way without a transfer pass: the expert rows
// stay in the expert rank's segment (the experts wrote them there in the combine payload's type,
// combine_in_place; or they are recv_x itself; or the combine encodes them there), and each home reads the k
// rows of each token straight from the experts' segments into a cache-sized block, rounding fp32 rows to the
// combine payload as the wire would, and sums them with the same kernel as the MPI path (bitwise its result).
// So the passes over the rows are one copy each way, fused with the encode / decode / gather, and the sum.
//
// Synchronization is by flags in small per-rank control segments, not by collectives: a home overwrites its
// records only after every peer has acknowledged reading the previous dispatch; a rank overwrites its expert
// and combine rows only after every home has reduced the previous combine. When a rank needs a larger data
// segment (every rank can compute every rank's need from the published counts), all regrow together (a
// collective, the only one). The backward helpers (redispatch, combine_scalars) keep the MPI rounds of
// dispatch_flat.cpp over the same plan (the counts and offsets are filled here as the MPI dispatch fills them).
// Not the MPI exchanges (dispatch_alltoall.cpp, dispatch_sync_free.cpp) and not the hierarchical dispatcher.
#include <algorithm>
#include <atomic>
#include <bit>

#include "ep/dispatch_flat.h"
#include "moetron/check.h"

namespace moetron::ep {
namespace {

// Control segment, in int64 slots: each flag on its own cache line, then this rank's sizes and its send counts.
constexpr int64_t kReady = 0;     // dispatches whose records this rank has published
constexpr int64_t kAck = 8;       // dispatches whose peers' records this rank has finished reading
constexpr int64_t kPushed = 16;   // combines whose expert rows this rank has in place
constexpr int64_t kReduced = 24;  // combines this rank has reduced (it reads no peer's rows any more)
constexpr int64_t kTokens = 32, kRecords = 33;  // N, S1 of the last dispatch
constexpr int64_t kSource = 34;                 // the last combine's rows: 0 recv_x (fp32), 1 the combine rows
constexpr int64_t kCounts = 40;                 // [P*El] records per (destination, local expert)

int64_t rows_at(int64_t s1) { return round_up(s1 * 8, 64); }

// dst = src rounded to bf16 and back (from_bf16(to_bf16(x)) of dtype.h, quiet NaNs included), in one pass.
void round_bf16_row(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(src[i]);
    const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) : u + 0x7fffu + ((u >> 16) & 1u);
    dst[i] = std::bit_cast<float>(r & 0xffff0000u);
  }
}

}  // namespace

// A rank's data segment: metadata [S1 x 8 B], token rows [N x pb], recv_x [R x D] fp32 (decoded dispatches
// only), combine rows [R x cb].
int64_t FlatDispatcher::shm_xrows_at(int64_t n, int64_t s1) const { return rows_at(s1) + round_up(n * pb, 64); }
int64_t FlatDispatcher::shm_crows_at(int64_t n, int64_t s1, int64_t r) const {
  return shm_xrows_at(n, s1) + (cfg.land_rows ? 0 : round_up(r * D * 4, 64));
}
int64_t FlatDispatcher::shm_need(int64_t n, int64_t s1, int64_t r) const { return shm_crows_at(n, s1, r) + r * cb; }

int64_t* FlatDispatcher::shm_flags(int q) const { return reinterpret_cast<int64_t*>(shm_ctrl->segment(q)); }

void FlatDispatcher::shm_wait(std::initializer_list<std::pair<int64_t, int64_t>> until, EpTraffic& tr) const {
  timed_comm(tr, [&] {
    comm.wait_shared(*shm_ctrl, [&] {
      for (int q = 0; q < P; ++q)
        for (const auto& [slot, v] : until)
          if (SharedMemory::seen(shm_flags(q) + slot) < v) return false;
      return true;
    });
  });
}

void FlatDispatcher::shm_open(int64_t data_bytes) {
  shm_ctrl = comm.share_memory((kCounts + int64_t(P) * El) * 8);
  MT_CHECK(shm_ctrl != nullptr, "ep_dispatch",
           "ep_transport = shm needs every EP rank on one node (shared memory); these ", P,
           " ranks are not: use ep_transport = mpi");
  std::memset(shm_ctrl->segment(me), 0, size_t(shm_ctrl->bytes()));
  shm_data = comm.share_memory(data_bytes);
  hoff.assign(size_t(P) * El, 0);
  rpos.assign(size_t(P) * El, 0);
  xrows_at.assign(size_t(P), 0);
  crows_at.assign(size_t(P), 0);
  comm.barrier();  // every control segment is zeroed before anyone reads one
}

void FlatDispatcher::shm_dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) {
  plan_send(idx, n);
  const int64_t g = ++shm_gen;
  // Peers read this rank's records until they acknowledge its previous dispatch, and its expert rows until they
  // have reduced the last combine.
  shm_wait({{kAck, g - 1}, {kReduced, shm_comb}}, tr);
  int64_t* mine = shm_flags(me);
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
  if (shm_xrows_at(n, S1) <= shm_data->bytes()) write_home();
  SharedMemory::publish(mine + kReady, g);
  shm_wait({{kReady, g}}, tr);
  // Every rank's need, from the published counts: its records and tokens, and the rows it receives.
  std::vector<int64_t> rows_in(static_cast<size_t>(P), 0);
  for (int s = 0; s < P; ++s) {
    const int64_t* sc_ = shm_flags(s) + kCounts;
    for (int q = 0; q < P; ++q)
      for (int le = 0; le < El; ++le) rows_in[size_t(q)] += sc_[int64_t(q) * El + le];
  }
  int64_t top = 0;
  for (int q = 0; q < P; ++q)
    top = std::max(top, shm_need(shm_flags(q)[kTokens], shm_flags(q)[kRecords], rows_in[size_t(q)]));
  if (top > shm_data->bytes()) {  // every rank computes the same sizes: all regrow here, together
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
  // What arrives: block (q, le) is home q's records for (this rank, le), at hoff in q's record order. Where this
  // rank's records for expert (q, le) land on q: after every source's rows for q's earlier experts and the
  // earlier sources' rows for this one (q's grouped order).
  for (int q = 0; q < P; ++q) {
    const int64_t* qc = shm_flags(q) + kCounts;
    int64_t acc = 0;
    for (int64_t b = 0; b < int64_t(me) * El; ++b) acc += qc[b];
    int64_t at = 0;
    for (int le = 0; le < El; ++le) {
      const size_t b = size_t(q) * El + le;
      rcnt[b] = qc[int64_t(me) * El + le];
      MT_CHECK(rcnt[b] >= 0 && acc + rcnt[b] <= shm_flags(q)[kRecords], "ep_dispatch", "rank ", q,
               " published a corrupt count ", rcnt[b], " for local expert ", le);
      hoff[b] = acc;
      acc += rcnt[b];
      for (int s = 0; s < P; ++s) {
        if (s == me) rpos[b] = at;
        at += shm_flags(s)[kCounts + int64_t(q) * El + le];
      }
    }
    xrows_at[size_t(q)] = shm_xrows_at(shm_flags(q)[kTokens], shm_flags(q)[kRecords]);
    crows_at[size_t(q)] = shm_crows_at(shm_flags(q)[kTokens], shm_flags(q)[kRecords], rows_in[size_t(q)]);
  }
  plan_recv();
  alloc_maps();
  char* ox = cfg.land_rows ? open_rows(R) : reinterpret_cast<char*>(shm_rows());
  sidx.assign(idx, idx + n * k);
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
  // Where the homes read this rank's rows: recv_x itself, the combine rows the experts wrote (yr null), or
  // yr encoded into the combine rows here.
  int64_t source = 1;
  if (!cfg.land_rows && yr == shm_rows()) {
    source = 0;
  } else if (yr != nullptr && R > 0) {
    char* dst = shm_data->segment(me) + crows_at[size_t(me)];
#pragma omp parallel for schedule(static) if (R * D >= kParMin)
    for (int64_t r = 0; r < R; ++r) encode_row(dst + r * cb, yr + r * D);
  }
  for (int q = 0; q < P; ++q) classify(tr, q, peer_recv[size_t(q)] * cb);
  tr.rows_sent += R;
  tr.rows_recv += S1;
  tr.rounds += 1;
  shm_flags(me)[kSource] = source;
  SharedMemory::publish(shm_flags(me) + kPushed, c);
  shm_wait({{kPushed, c}}, tr);
  // Each token's k rows, read from the experts' segments into a cache-sized block (fp32 rows rounded to bf16
  // and back when the combine payload is bf16, as the wire would), then summed by the MPI path's kernel.
  const bool bf = cfg.combine_payload == EpPayload::BF16;
  std::vector<const char*> src_base(static_cast<size_t>(P));
  std::vector<int64_t> src_kind(static_cast<size_t>(P));
  for (int q = 0; q < P; ++q) {
    src_kind[size_t(q)] = shm_flags(q)[kSource];
    const bool x = src_kind[size_t(q)] == 0;
    src_base[size_t(q)] = shm_data->segment(q) + (x ? xrows_at[size_t(q)] : crows_at[size_t(q)]);
  }
  const int32_t* ro = row_of.data<int32_t>();
  reduce_fetched(y, cdec, ro, weighted ? wcopy.data<float>() : nullptr, N, [&](int64_t i, float* dst) {
    const int e = sidx[size_t(i)], q = e / El;
    const int64_t row = rpos[size_t(e)] + ro[i] - off[size_t(e)];
    if (src_kind[size_t(q)] == 0) {  // fp32 recv_x
      const float* src = reinterpret_cast<const float*>(src_base[size_t(q)]) + row * D;
      if (bf) round_bf16_row(dst, src, D);
      else std::memcpy(dst, src, size_t(D * 4));
    } else if (bf) {
      from_wire_bf16(dst, reinterpret_cast<const bf16*>(src_base[size_t(q)]) + row * D, D);
    } else {
      std::memcpy(dst, reinterpret_cast<const float*>(src_base[size_t(q)]) + row * D, size_t(D * 4));
    }
  });
  SharedMemory::publish(shm_flags(me) + kReduced, c);
}

std::vector<EpBufferTerm> FlatDispatcher::extra_terms() const {
  if (!shm()) return {};
  return {{"shm.control [P] flags, sizes, counts", shm_ctrl->bytes()},
          {"shm.data [S1] meta + [N] token rows + [R,D] f32 recv_x + [R,D] combine rows", shm_data->bytes()}};
}

}  // namespace moetron::ep
