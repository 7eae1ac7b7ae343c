// dispatch_sync_free.cpp: the sync_free dispatcher: one exchange per dispatch and no count round. Every peer
// slot of the receive buffer is a fixed worst-case region (a header with the El counts, then room for
// max_tokens * min(k, El) records), and every buffer is allocated once, at construction, and frozen: nothing
// is allocated per call. Only the real bytes cross the wire (Comm::exchange).
// Not the flat layout, the combine or the backward helpers (dispatch_flat.cpp, shared with alltoall).
#include <algorithm>

#include "ep/dispatch_flat.h"
#include "moetron/runtime.h"

namespace moetron::ep {
namespace {

class SyncFreeDispatcher final : public FlatDispatcher {
 public:
  SyncFreeDispatcher(const Comm& ep_comm, const EpDispatchConfig& cfg);

  void dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) override;
  void check_token_bound(int64_t n) const override {
    MT_CHECK(n <= cfg.max_tokens, "ep_dispatch", "N=", n, " exceeds max_tokens=", cfg.max_tokens,
             " (sync_free buffers are sized at construction)");
  }

 private:
  int64_t H = 0;           // per-peer header: El int64 counts, padded
  int64_t cap_rows = 0;    // records one peer can send to one rank
  int64_t slot_bytes = 0;  // one peer's region in the receive buffer

  void allocate_worst_case();
  void read_headers(const char* sb, const char* rb);
};

SyncFreeDispatcher::SyncFreeDispatcher(const Comm& ep_comm, const EpDispatchConfig& cfg)
    : FlatDispatcher(ep_comm, cfg, false) {
  MT_CHECK(cfg.max_tokens > 0, "ep_dispatch",
           "sync_free needs max_tokens > 0 (its buffers are sized at construction)");
  allocate_worst_case();
  for (Buf* b : all_bufs()) b->frozen = true;
}

// Worst case, one line per region (docs/parallel.md).
void SyncFreeDispatcher::allocate_worst_case() {
  const int64_t Nm = cfg.max_tokens;
  H = round_up(int64_t(El) * 8, 64);
  cap_rows = Nm * std::min<int64_t>(k, El);
  // one peer's region in the receive buffer: header, metadata (8 B a record), payload rows
  slot_bytes = H + round_up(cap_rows * 8, 64) + round_up(cap_rows * pb, 64);
  const int64_t Rmax = int64_t(P) * cap_rows;             // rows one rank can receive
  if (!shm()) {  // shm: the rows never pass through messages
    send1.get(int64_t(P) * (H + 128) + Nm * k * (8 + pb));  // every (token, slot) once + headers + padding
    recv1.get(int64_t(P) * slot_bytes);
  }
  if (!shm() || cfg.land_rows) out_x.get(Rmax * row_out());  // shm: decoded rows land in the shared segment
  out_src.get<int32_t>(Rmax);
  out_tok.get<int32_t>(Rmax);
  out_slot.get<int32_t>(Rmax);
  out_w.get<float>(Rmax);
  wcopy.get<float>(Nm * k);
  row_of.get<int32_t>(Nm * k);
  if (cfg.dispatch_payload == EpPayload::BF16 && !shm()) hbuf.get<bf16>(Nm * D);  // shm: encoded into the segment
  if (cfg.dispatch_payload == EpPayload::E4M3) {
    qbuf.get<uint8_t>(Nm * D);
    sbuf.get<float>(Nm * nb);
  }
  csend.get(Rmax * cb);
  crecv.get(Nm * k * cb);
  // the combine's per-thread blocks (reduce_fetched): bf16 wire rows, or any rows read in place over shm
  if (shm() || cfg.combine_payload == EpPayload::BF16) cdec.get(reduce_slot_bytes() * std::max(1, num_threads()));
  vsend.get<float>(Rmax);
  vrecv.get<float>(Nm * k);
}

void SyncFreeDispatcher::dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) {
  if (shm()) return shm_dispatch(x, idx, n, tr);  // the data segment was sized for max_tokens
  plan_send(idx, n);
  char* sb = pack_messages(x, idx, n, H);
  tr.rows_sent += S1;
  for (int q = 0; q < P; ++q) classify(tr, q, sc[size_t(q)]);
  sc[size_t(me)] = 0;  // this rank's own message is read where it was packed
  char* rb = recv1.data();
  timed_comm(tr, [&] { comm.exchange(rb, slot_bytes, sb, sc.data(), sd.data()); });
  tr.rounds += 1;
  read_headers(sb, rb);
  plan_recv();
  unpack_messages([&](int q) -> const char* { return q == me ? sb + sd[size_t(q)] : rb + q * slot_bytes; }, H);
}

// rcnt from the header of every peer's region (this rank's own from where it was packed), checked.
void SyncFreeDispatcher::read_headers(const char* sb, const char* rb) {
  for (int q = 0; q < P; ++q) {
    const char* region = q == me ? sb + sd[size_t(q)] : rb + q * slot_bytes;
    std::memcpy(rcnt.data() + size_t(q) * El, region, size_t(El * 8));
    int64_t s = 0;
    for (int le = 0; le < El; ++le) {
      const int64_t c = rcnt[size_t(q) * El + le];
      MT_CHECK(c >= 0, "ep_dispatch", "header from rank ", q, " announces a negative count ", c);
      s += c;
    }
    MT_CHECK(s <= cap_rows, "ep_dispatch", "header from rank ", q, " announces ", s,
             " records, more than the capacity ", cap_rows);
  }
}

}  // namespace

std::unique_ptr<EpDispatch::Impl> make_sync_free(const Comm& ep_comm, const EpDispatchConfig& cfg) {
  return std::make_unique<SyncFreeDispatcher>(ep_comm, cfg);
}

}  // namespace moetron::ep
