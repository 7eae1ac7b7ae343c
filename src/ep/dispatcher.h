// dispatcher.h: EpDispatch::Impl, the interface every EP dispatcher implements (dispatch, combine and the two
// backward helpers, one call each, plus the list of its buffers) and the state they all share: the group's
// shape, the payload sizes and codecs, the home side's weights and encoded tokens, the grouped outputs, and the
// combine's reduction. The public calls in ep_dispatch.cpp check their arguments and time the call; the
// dispatchers do the rest.
// Not a layout: the flat layout (alltoall, sync_free) is dispatch_flat.h, the hierarchical one
// dispatch_hier.cpp; not the wire helpers (ep_wire.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <omp.h>

#include "ep/ep_wire.h"
#include "moetron/comm.h"
#include "moetron/ep_dispatch.h"
#include "moetron/fp8.h"
#include "moetron/permute.h"
#include "moetron/runtime.h"

namespace moetron {

struct EpDispatch::Impl {
  // Checks the configuration and sets the shape and payload sizes below (not collective).
  Impl(const Comm& ep_comm, const EpDispatchConfig& config);
  virtual ~Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // ---- what a dispatcher implements (the public calls' contracts are in ep_dispatch.h) ----
  // Sends the encoded tokens (encode_tokens has run, wcopy holds the weights) and fills the grouped outputs
  // and R; tr is this call's traffic.
  virtual void dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) = 0;
  virtual void combine(float* y, const float* yr, bool weighted, EpTraffic& tr) = 0;
  virtual void redispatch(float* out, const float* x, EpTraffic& tr) = 0;
  virtual void combine_scalars(float* out, const float* v, EpTraffic& tr) = 0;
  // Every buffer it may allocate, in the order buffers() lists them.
  virtual std::vector<ep::Buf*> all_bufs() = 0;
  // True when dispatch() encodes the token rows itself (the shm transport writes them straight into shared
  // memory): the public call then skips encode_tokens.
  virtual bool encodes_tokens() const { return false; }
  // The shm transport's [R, D] fp32 rows of a decoded dispatch (recv_x) and its [R, D] combine rows (the
  // combine payload's type); null otherwise. combine(y, nullptr, ...) reads the combine rows in place.
  virtual float* expert_rows() const { return nullptr; }
  virtual void* combine_rows() const { return nullptr; }
  // Allocations that are not Bufs (the shm transport's segments), for buffers().
  virtual std::vector<EpBufferTerm> extra_terms() const { return {}; }
  // A bound on N beyond the common checks (sync_free: max_tokens); throws with the message of validate().
  virtual void check_token_bound(int64_t n) const {}

  // ---- shared state ----
  Comm comm;
  EpDispatchConfig cfg;
  // P ranks, this one me; E experts, El local; k slots; L EP ranks per node, Nn nodes, this rank's node and
  // its index there (li).
  int P = 1, me = 0, E = 0, El = 0, k = 0, L = 1, Nn = 1, node = 0, li = 0;
  // D hidden; nb fp8 scale blocks per row; pb / cb bytes of a dispatch / combine wire row.
  int64_t D = 0, nb = 0, pb = 0, cb = 0;
  EpStats st;

  // Home side.
  int64_t N = -1;  // tokens of the last dispatch (-1: none yet)
  int64_t S1 = 0;  // records sent by the last dispatch (flat: kept slots; hierarchical: stage-1 records)
  ep::Buf wcopy{"home.weights [N,k] f32"}, row_of{"home.row_of [N,k] i32"};
  ep::Buf hbuf{"home.token_bf16 [N,D]"}, qbuf{"home.token_e4m3 [N,D]"}, sbuf{"home.token_scales [N,D/128] f32"};
  ep::Buf send1{"dispatch.send"}, recv1{"dispatch.recv"};

  // Expert side (outputs of dispatch).
  int64_t R = 0;
  // out_x: recv_x, fp32; with cfg.land_rows the rows in the payload's type when the caller's landing had no room.
  ep::Buf out_x{"expert.recv_x [R,D] f32 (land_rows: payload type)"}, out_src{"expert.recv_src [R] i32"},
      out_tok{"expert.recv_token [R] i32"}, out_slot{"expert.recv_slot [R] i32"}, out_w{"expert.recv_weight [R] f32"};
  std::vector<int64_t> counts, offsets;  // [El], [El + 1]

  // Combine and backward.
  ep::Buf csend{"combine.send"}, crecv{"combine.recv"}, cdec{"combine.recv_f32"};
  ep::Buf vsend{"backward.scalars_send"}, vrecv{"backward.scalars_recv"};  // combine_scalars

  // ---- shared helpers ----
  int node_of(int ep_rank) const { return ep_rank / L; }
  void classify(EpTraffic& t, int dst_ep_rank, int64_t bytes) const {
    if (dst_ep_rank == me) t.bytes_self += bytes;
    else if (node_of(dst_ep_rank) == node) t.bytes_intra += bytes;
    else t.bytes_inter += bytes;
  }

  void validate(const float* x, const int32_t* idx, int64_t n) const;
  void copy_weights(const float* w, int64_t n);

  // Dispatch payload: token rows encoded once per call (bf16 into hbuf, e4m3 into qbuf + sbuf), then written
  // to the wire per (token, slot) and read back to fp32 on the expert rank.
  void encode_tokens(const float* x, int64_t n);
  void write_payload(char* dst, const float* x, int64_t t) const {
    switch (cfg.dispatch_payload) {
      case EpPayload::F32: std::memcpy(dst, x + t * D, size_t(D * 4)); break;
      case EpPayload::BF16: std::memcpy(dst, hbuf.data<bf16>() + t * D, size_t(D * 2)); break;
      case EpPayload::E4M3:
        std::memcpy(dst, sbuf.data<float>() + t * nb, size_t(nb * 4));
        std::memcpy(dst + nb * 4, qbuf.data<uint8_t>() + t * D, size_t(D));
        break;
    }
  }
  void read_payload(float* out, const char* src) const {
    switch (cfg.dispatch_payload) {
      case EpPayload::F32: std::memcpy(out, src, size_t(D * 4)); break;
      case EpPayload::BF16: ep::from_wire_bf16(out, reinterpret_cast<const bf16*>(src), D); break;
      case EpPayload::E4M3: {
        float sc_[1];
        fp8_decode(out, reinterpret_cast<const uint8_t*>(src + nb * 4), D, Fp8Format::E4M3);
        for (int64_t b = 0; b < nb; ++b) {
          std::memcpy(sc_, src + b * 4, 4);
          const int64_t e = std::min(D, (b + 1) * ep::kFp8Block);
          for (int64_t d = b * ep::kFp8Block; d < e; ++d) out[d] *= sc_[0];
        }
        break;
      }
    }
  }

  // The grouped rows of a dispatch. open_rows(R): where they go (recv_x; with cfg.land_rows the caller's
  // landing, else out_x in the payload's type), row_out bytes a row there; put_rows: n wire rows of pb bytes from
  // src to rows p.. of it, copied as they crossed (fp32 payload, or landed) or decoded to fp32.
  const EpDispatch::RowLanding* land = nullptr;  // set for the span of a landed dispatch
  bool landed_in_caller = false;                 // the last dispatch's rows went to the caller's landing
  bool rows_as_crossed() const { return cfg.land_rows || cfg.dispatch_payload == EpPayload::F32; }  // no decode
  int64_t row_out() const { return cfg.land_rows ? pb : D * 4; }
  char* open_rows(int64_t rows);
  void put_rows(char* dst, int64_t p, const char* src, int64_t n) const {
    if (n <= 0) return;
    if (rows_as_crossed()) {
      std::memcpy(dst + p * pb, src, size_t(n * pb));
      return;
    }
    float* o = reinterpret_cast<float*>(dst) + p * D;
    for (int64_t i = 0; i < n; ++i) read_payload(o + i * D, src + i * pb);
  }

  // Combine payload: fp32 rows [n, D] <-> wire rows [n, cb bytes].
  void encode_rows(char* dst, const float* src, int64_t n) const;
  void encode_row(char* dst, const float* src) const {
    if (cfg.combine_payload == EpPayload::F32) std::memcpy(dst, src, size_t(D * 4));
    else ep::to_wire_bf16(reinterpret_cast<bf16*>(dst), src, D);
  }

  // y [n, D] = moe_unpermute (weights w) or moe_permute_backward (w null) of the wire rows in [S, cb bytes]
  // picked by ro [n, k]. bf16 rows are decoded a chunk of tokens at a time into a cache-sized buffer (per
  // thread) and reduced by the same kernel: a token's result depends only on its own rows, so this is bitwise
  // the one-call result on fully decoded rows, without writing and re-reading them all.
  int64_t reduce_chunk_tokens() const { return std::max<int64_t>(1, (int64_t(1) << 16) / (int64_t(k) * D)); }
  int64_t reduce_slot_bytes() const { return reduce_chunk_tokens() * k * (D * 4 + 4); }
  void reduce_rows(float* y, ep::Buf& tmp, const char* in, const int32_t* ro, const float* w, int64_t n, int64_t S);
  // The chunked form of it for rows that are not one fp32 array: fetch(i, dst) writes the row of kept (token,
  // slot) i (ro[i] >= 0) as fp32 into dst [D]; a chunk of tokens is fetched into a cache-sized block per thread and
  // reduced by the same kernel (a token's result depends only on its own rows: bitwise the one-call result).
  template <class Fetch>
  void reduce_fetched(float* y, ep::Buf& tmp, const int32_t* ro, const float* w, int64_t n, Fetch fetch);
};

template <class Fetch>
void EpDispatch::Impl::reduce_fetched(float* y, ep::Buf& tmp, const int32_t* ro, const float* w, int64_t n,
                                      Fetch fetch) {
  if (n == 0) return;
  const int64_t tc = reduce_chunk_tokens(), nch = (n + tc - 1) / tc, slot = reduce_slot_bytes();
  int nt = std::max(1, int(std::min<int64_t>(num_threads(), nch)));
  if (tmp.frozen) nt = std::max(1, std::min(nt, int(int64_t(tmp.bytes) / slot)));
  char* ws = tmp.get(int64_t(nt) * slot);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && n * k * D >= ep::kParMin)
  for (int64_t c = 0; c < nch; ++c) {
    char* mine = ws + int64_t(omp_get_thread_num()) * slot;
    float* buf = reinterpret_cast<float*>(mine);
    int32_t* lro = reinterpret_cast<int32_t*>(mine + tc * k * D * 4);
    const int64_t t0 = c * tc, t1 = std::min(n, t0 + tc);
    int32_t j = 0;
    for (int64_t i = t0 * k; i < t1 * k; ++i) {
      lro[i - t0 * k] = ro[i] >= 0 ? j : -1;
      if (ro[i] >= 0) fetch(i, buf + int64_t(j++) * D);
    }
    if (w) moe_unpermute(y + t0 * D, buf, lro, w + t0 * k, t1 - t0, k, j, D);
    else moe_permute_backward(y + t0 * D, buf, lro, t1 - t0, k, j, D);
  }
}

namespace ep {

// The dispatchers, one file each; ep_dispatch.cpp picks one from cfg.kind. Collective (hierarchical splits
// the EP communicator).
std::unique_ptr<EpDispatch::Impl> make_alltoall(const Comm& ep_comm, const EpDispatchConfig& cfg);
std::unique_ptr<EpDispatch::Impl> make_sync_free(const Comm& ep_comm, const EpDispatchConfig& cfg);
std::unique_ptr<EpDispatch::Impl> make_hierarchical(const Comm& ep_comm, const EpDispatchConfig& cfg);

}  // namespace ep
}  // namespace moetron
