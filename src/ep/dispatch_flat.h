// dispatch_flat.h: the flat layout that alltoall and sync_free share (every rank sends to every expert rank
// directly): the send and receive plans, the per-peer messages and their unpacking into the grouped outputs,
// the exchanges of rows in that layout, and the combine / redispatch / combine_scalars built on them.
// Not the dispatch exchange itself, which is where the two differ (count round or not): dispatch_alltoall.cpp
// and dispatch_sync_free.cpp; not the hierarchical layout (dispatch_hier.cpp).
//
// Home side: kept (token, slot) records in (peer q, local expert le, token, slot) order; block b = q*El + le
// starts at record off[b] and has cnt[b] records; row_of[t, s] = the record index (-1: dropped). Expert side:
// block b (from peer q, for local expert le) has rcnt[b] rows; it sits at row fpos[b] of the grouped
// (expert-major) layout and at row poff[b] of the peer-major staging order.
// Payload rows and metadata travel separately, so the payload rows of a block are contiguous on both sides:
// alltoall lands them in their final (grouped) place with one all_to_all_v per local expert ("direct");
// sync_free (one exchange, no count round) lands them per peer and copies whole blocks into place.
#pragma once
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include "ep/dispatcher.h"

namespace moetron::ep {

// Metadata of a flat record; its payload row travels apart from it.
struct WireMeta {
  int32_t code;  // token * k + slot
  float w;
};
static_assert(sizeof(WireMeta) == 8);

class FlatDispatcher : public EpDispatch::Impl {
 public:
  // direct: alltoall_direct (fp32 rows land in place, one round per local expert).
  FlatDispatcher(const Comm& ep_comm, const EpDispatchConfig& cfg, bool direct);  // collective with shm

  void combine(float* y, const float* yr, bool weighted, EpTraffic& tr) override;
  bool encodes_tokens() const override { return shm(); }  // shm: straight into the data segment
  float* expert_rows() const override { return shm() && !cfg.land_rows ? shm_rows() : nullptr; }
  void* combine_rows() const override {
    return shm() ? shm_data->segment(me) + crows_at[size_t(me)] : nullptr;
  }
  std::vector<EpBufferTerm> extra_terms() const override;
  void redispatch(float* out, const float* x, EpTraffic& tr) override;
  void combine_scalars(float* out, const float* v, EpTraffic& tr) override;
  std::vector<Buf*> all_bufs() override;

 protected:
  // Buffers of the dispatcher itself, listed after the shared ones.
  virtual std::vector<Buf*> extra_bufs() { return {}; }

  const bool direct;
  // ---- ep_transport = "shm" (dispatch_shm.cpp): rows move through the ranks' shared segments ----
  // A control segment per rank (flags, this rank's sizes and counts; fixed size) and a data segment per rank
  // (this rank's records' metadata and its token rows once each, then the fp32 rows [R, D] it received when
  // decoded (recv_x), and [R, D] rows of the combine payload's type the experts may write their outputs into),
  // all of one size, regrown together when a rank needs more.
  std::unique_ptr<SharedMemory> shm_ctrl, shm_data;
  int64_t shm_gen = 0, shm_comb = 0;  // dispatches and combines so far through shared memory
  std::vector<int64_t> hoff;          // [P*El] block (q, le)'s first record on home q
  std::vector<int64_t> rpos;          // [P*El] where this rank's records for expert e = (q, le) sit in q's rows
  std::vector<int64_t> xrows_at;      // [P] where rank q's recv_x rows start in its data segment
  std::vector<int64_t> crows_at;      // [P] where rank q's combine rows start
  std::vector<int32_t> sidx;          // [N*k] the last dispatch's experts (the combine finds each row's rank)
  bool shm() const { return shm_ctrl != nullptr; }
  void shm_open(int64_t data_bytes);  // collective: the control segments, and data segments of that size
  void shm_dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr);
  void shm_combine(float* y, const float* yr, bool weighted, EpTraffic& tr);
  int64_t shm_need(int64_t n, int64_t s1, int64_t r) const;  // data bytes for n tokens, s1 records, r rows in
  int64_t shm_xrows_at(int64_t n, int64_t s1) const;            // recv_x in the data segment
  int64_t shm_crows_at(int64_t n, int64_t s1, int64_t r) const;  // the combine rows
  int64_t* shm_flags(int q) const;                           // rank q's control segment
  // Until every rank's flags are at least the given values: {slot, value} pairs (one recorded barrier).
  void shm_wait(std::initializer_list<std::pair<int64_t, int64_t>> until, EpTraffic& tr) const;
  float* shm_rows() const { return reinterpret_cast<float*>(shm_data->segment(me) + xrows_at[size_t(me)]); }

  std::vector<int64_t> cnt, rcnt, off;        // [P*El] send counts, recv counts, send offsets (records)
  std::vector<int64_t> cur;                   // [P*El] cursors of plan_send
  std::vector<int64_t> sc, sd, rc, rd;        // per-peer byte counts / displacements scratch
  std::vector<int64_t> peer_send, peer_recv;  // records per peer of the current layout
  std::vector<int64_t> blk_start;             // byte offset of peer q's first payload row in send1
  std::vector<int64_t> fpos, poff;            // [P*El] block b's first row, grouped / peer-major order

  // Blocks b = q*El + le in peer-major order: start[b] = the rows of the blocks before b, per_peer[q] = the
  // rows of peer q's blocks; returns the total.
  int64_t peer_major(const std::vector<int64_t>& c, std::vector<int64_t>& start, std::vector<int64_t>& per_peer) const;
  void plan_send(const int32_t* idx, int64_t n);  // cnt, off, peer_send, S1, row_of
  void plan_recv();                               // from rcnt: counts, offsets, fpos, poff, peer_recv, R

  // Home: payload and metadata of every kept (token, slot), written where pay_at / meta_at(record, peer) say.
  template <class PayAt, class MetaAt>
  void pack_records(const int32_t* idx, const float* x, int64_t n, PayAt pay_at, MetaAt meta_at) const {
    const int32_t* ro = row_of.data<int32_t>();
    const float* wc = wcopy.data<float>();
#pragma omp parallel for schedule(static) if (n * k * D >= kParMin)
    for (int64_t t = 0; t < n; ++t)
      for (int s = 0; s < k; ++s) {
        const int32_t j = ro[t * k + s];
        if (j < 0) continue;
        const int q = idx[t * k + s] / El;
        const WireMeta m{int32_t(t * k + s), wc[t * k + s]};
        std::memcpy(meta_at(j, q), &m, sizeof m);
        write_payload(pay_at(j, q), x, t);
      }
  }

  char* alloc_outputs();  // the grouped outputs for R rows; returns where the rows go (open_rows)
  void alloc_maps();      // the grouped outputs but the rows (src, token, slot, weight)
  // Metadata of block b's rows (mb = the block's first WireMeta) into the grouped outputs. Returns false on a
  // corrupt record (callable inside a parallel loop: the caller checks).
  bool scatter_meta(int64_t b, const char* mb);

  // Staged messages: to peer q [hdr bytes: El int64 counts (sync_free) or nothing][n_q WireMeta, padded to
  // 64][n_q payload rows]. Returns the send buffer; sc / sd / blk_start describe it.
  char* pack_messages(const float* x, const int32_t* idx, int64_t n, int64_t hdr);
  // The received messages (region(q) = peer q's message) into the grouped outputs: whole blocks, decoded.
  template <class Region>
  void unpack_messages(Region region, int64_t hdr) {
    char* ox = alloc_outputs();
    const int64_t nblk = int64_t(P) * El;
    int64_t bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : bad) if (R * D >= kParMin)
    for (int64_t b = 0; b < nblk; ++b) {
      const int q = int(b / El);
      const char* reg = region(q);
      const int64_t first = poff[size_t(b)] - poff[size_t(q) * El];
      put_rows(ox, fpos[size_t(b)], reg + hdr + round_up(peer_recv[size_t(q)] * 8, 64) + first * pb, rcnt[size_t(b)]);
      bad += !scatter_meta(b, reg + hdr + first * 8);
    }
    MT_CHECK(bad == 0, "ep_dispatch", bad, " block(s) with corrupt record metadata");
  }

  // One all_to_all_v per local expert: rows of rb bytes from the home record order (src) to the grouped order
  // (dst) when to_experts, else back.
  void direct_rounds(char* dst, const char* src, int64_t rb, bool to_experts, EpTraffic& tr);
  // One all_to_all_v between the home record order and the expert's peer-major staging order. skip_self:
  // the block for this rank itself does not go through the transport (the caller moves it; its bytes
  // still count as bytes_self).
  void staged_round(char* dst, const char* src, int64_t rb, bool to_experts, EpTraffic& tr, bool skip_self = false);

  // Expert -> home: rows v [R, w] in grouped order arrive in the home record order, in [S1, rb] (rb = w * 4 or
  // w * 2 with bf). direct_rows: one round per local expert, sent straight from v when f32; else one round
  // through the peer-major staging (scratch).
  void to_home(char* in, const float* v, int64_t w, bool bf, bool direct_rows, Buf& scratch, EpTraffic& tr);
  // Home -> experts: rows [S1, rb] in the home record order arrive as out [R, w] f32 in grouped order.
  void to_experts(float* out, const char* send, int64_t w, bool bf, bool direct_rows, Buf& scratch, EpTraffic& tr);
};

}  // namespace moetron::ep
