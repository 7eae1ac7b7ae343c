// dispatch_alltoall.cpp: the alltoall dispatcher's dispatch over the flat layout: a count round (El counts to
// every peer), then either one all_to_all_v of per-peer messages (metadata in front of the payload rows),
// copied or decoded block by block into the grouped outputs ("staged"), or, with alltoall_direct and rows that
// need no decode (fp32, or land_rows), the metadata in one round and the rows straight into their grouped place,
// one round per local expert ("direct").
// Not the combine and backward helpers (dispatch_flat.cpp, shared with sync_free) and not the other
// dispatchers.
#include <algorithm>

#include "ep/dispatch_flat.h"

namespace moetron::ep {
namespace {

class AllToAllDispatcher final : public FlatDispatcher {
 public:
  AllToAllDispatcher(const Comm& ep_comm, const EpDispatchConfig& cfg, bool direct)
      : FlatDispatcher(ep_comm, cfg, direct) {}

  void dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) override;

 private:
  Buf msend{"dispatch.meta_send [S] 8B"}, mrecv{"dispatch.meta_recv [R] 8B"};  // direct: the metadata apart

  std::vector<Buf*> extra_bufs() override { return {&msend, &mrecv}; }
  void count_round(EpTraffic& tr);
  void dispatch_staged(char* sb, EpTraffic& tr);
  void dispatch_direct(const char* ps, const WireMeta* ms, EpTraffic& tr);
};

void AllToAllDispatcher::dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) {
  if (shm()) return shm_dispatch(x, idx, n, tr);
  plan_send(idx, n);
  // direct: rows that need no decode (fp32, or landed as they crossed) go straight to their grouped place
  const bool in_place = direct && rows_as_crossed();
  char* ps = nullptr;
  WireMeta* ms = nullptr;
  if (in_place) {
    ps = send1.get(std::max<int64_t>(S1 * pb, 1));
    ms = msend.get<WireMeta>(std::max<int64_t>(S1, 1));
    pack_records(
        idx, x, n, [&](int64_t j, int) { return ps + j * pb; },
        [&](int64_t j, int) { return reinterpret_cast<char*>(ms + j); });
  } else {
    ps = pack_messages(x, idx, n, 0);
  }
  tr.rows_sent += S1;
  count_round(tr);
  plan_recv();
  if (!in_place) return dispatch_staged(ps, tr);  // rows to decode, or not direct
  dispatch_direct(ps, ms, tr);
}

void AllToAllDispatcher::count_round(EpTraffic& tr) {
  timed_comm(tr, [&] { comm.all_to_all(rcnt.data(), cnt.data(), int64_t(El) * 8); });  // El counts to every peer
  tr.rounds += 1;
  for (int q = 0; q < P; ++q) classify(tr, q, int64_t(El) * 8);
}

// One round per call, a message per peer (metadata in front); rows are copied (fp32) or decoded (bf16 / e4m3:
// the decode touches every row anyway) block by block into their grouped place.
void AllToAllDispatcher::dispatch_staged(char* sb, EpTraffic& tr) {
  int64_t rbytes = 0;
  for (int q = 0; q < P; ++q) {
    rd[size_t(q)] = rbytes;
    rc[size_t(q)] = round_up(peer_recv[size_t(q)] * 8, 64) + peer_recv[size_t(q)] * pb;
    rbytes += round_up(rc[size_t(q)], 64);
    classify(tr, q, sc[size_t(q)]);
  }
  sc[size_t(me)] = rc[size_t(me)] = 0;  // this rank's own message is read where it was packed
  char* rb = recv1.get(std::max<int64_t>(rbytes, 1));
  timed_comm(tr, [&] { comm.all_to_all_v(rb, rc.data(), rd.data(), sb, sc.data(), sd.data()); });
  tr.rounds += 1;
  unpack_messages([&](int q) { return q == me ? sb + sd[size_t(q)] : rb + rd[size_t(q)]; }, 0);
}

// fp32 or landed rows: metadata in one round, then the rows straight into their grouped place, one round per
// local expert.
void AllToAllDispatcher::dispatch_direct(const char* ps, const WireMeta* ms, EpTraffic& tr) {
  WireMeta* mr = mrecv.get<WireMeta>(std::max<int64_t>(R, 1));
  staged_round(reinterpret_cast<char*>(mr), reinterpret_cast<const char*>(ms), 8, true, tr);
  direct_rounds(alloc_outputs(), ps, pb, true, tr);
  const int64_t nblk = int64_t(P) * El;
  for (int64_t b = 0; b < nblk; ++b)
    MT_CHECK(scatter_meta(b, reinterpret_cast<const char*>(mr + poff[size_t(b)])), "ep_dispatch",
             "corrupt record metadata from rank ", b / El);
}

}  // namespace

std::unique_ptr<EpDispatch::Impl> make_alltoall(const Comm& ep_comm, const EpDispatchConfig& cfg) {
  return std::make_unique<AllToAllDispatcher>(ep_comm, cfg,
                                              cfg.kind == EpDispatcher::AllToAll && cfg.alltoall_direct);
}

}  // namespace moetron::ep
