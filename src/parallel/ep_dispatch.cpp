// ep_dispatch.cpp: the three EP dispatchers (alltoall, sync_free, hierarchical), their combine, and the
// node-limited routing helpers. The contract (row order, combine order, payload formats) is in
// ep_dispatch.h; docs/parallel.md has the buffer arithmetic and measured figures.
// Not the expert computation: the caller runs its experts on recv_x between dispatch and combine.
//
// Shape of one call (flat): encode token rows once -> count -> plan (row_of = record index, blocks per
//   (peer, local expert)) -> pack payload rows + 8-byte metadata straight into the per-peer messages
//   (OpenMP over tokens) -> [count round] -> exchange -> whole blocks copied / decoded into the grouped
//   output. alltoall_direct: fp32 rows land in the grouped output (one all_to_all_v per local expert).
// Combine: the expert rows go back block by block (staged: packed peer-major; direct: straight from yr), the
//   home rank sums them with moe_unpermute (bf16 rows decoded per token chunk inside the sum).
// Hierarchical: two exchanges (rail, then node) and a forwarding step in between; its stage 2 arrives as
//   16-byte-header records scattered by unpack(). Its combine reverses the staging order: the expert rank
//   sends row g of its staging (receive) order back to where it came from.
#include "moetron/ep_dispatch.h"
#include "moetron/gemm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include <omp.h>

#include "moetron/check.h"
#include "moetron/fp8.h"
#include "moetron/memory.h"
#include "moetron/permute.h"
#include "moetron/runtime.h"

namespace moetron {

// ep_dispatch_avx512.cpp

std::string_view to_string(EpPayload p) {
  switch (p) {
    case EpPayload::F32: return "f32";
    case EpPayload::BF16: return "bf16";
    case EpPayload::E4M3: return "e4m3";
  }
  return "?";
}

void EpTraffic::add(const EpTraffic& o) {
  calls += o.calls;
  rows_sent += o.rows_sent;
  rows_recv += o.rows_recv;
  bytes_self += o.bytes_self;
  bytes_intra += o.bytes_intra;
  bytes_inter += o.bytes_inter;
  rounds += o.rounds;
  seconds += o.seconds;
  seconds_comm += o.seconds_comm;
}

namespace {

constexpr int64_t kFp8Block = 128;
// Loops over fewer elements than this stay serial: a parallel region costs more than it saves, and much
// more when ranks oversubscribe the cores.
constexpr int64_t kParMin = int64_t(1) << 16;

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Wire conversions: serial (the callers parallelize over rows), AVX-512 when active, else the scalar codecs
// of dtype.h; both are bitwise to_bf16 / from_bf16.
void to_wire_bf16(bf16* out, const float* in, int64_t n);
void from_wire_bf16(float* out, const bf16* in, int64_t n);
// Row-parallel versions for [rows, D] blocks.
void to_wire_bf16_rows(bf16* out, const float* in, int64_t rows, int64_t D);
void from_wire_bf16_rows(float* out, const bf16* in, int64_t rows, int64_t D);

void to_wire_bf16(bf16* out, const float* in, int64_t n) { f32_to_bf16_serial(out, in, n); }
void from_wire_bf16(float* out, const bf16* in, int64_t n) { bf16_to_f32_serial(out, in, n); }

void to_wire_bf16_rows(bf16* out, const float* in, int64_t rows, int64_t D) {
#pragma omp parallel for schedule(static) if (rows * D >= kParMin)
  for (int64_t r = 0; r < rows; ++r) to_wire_bf16(out + r * D, in + r * D, D);
}
void from_wire_bf16_rows(float* out, const bf16* in, int64_t rows, int64_t D) {
#pragma omp parallel for schedule(static) if (rows * D >= kParMin)
  for (int64_t r = 0; r < rows; ++r) from_wire_bf16(out + r * D, in + r * D, D);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One public call's traffic: body(tr) fills it, the wall time is added, and it becomes the "last" record and
// is added to the running total.
template <class Body>
void record_call(EpTraffic& last, EpTraffic& total, Body&& body) {
  const double t0 = now_s();
  EpTraffic tr;
  tr.calls = 1;
  body(tr);
  tr.seconds = now_s() - t0;
  last = tr;
  total.add(tr);
}

// Header of a record that arrives at an expert rank (flat records and hierarchical stage-2 records).
struct RecMeta {
  int32_t token;
  int32_t src;
  int16_t slot;
  int16_t le;  // local expert on the receiving rank
  float w;
};
static_assert(sizeof(RecMeta) == 16);

// A tracked buffer that only grows (or, when frozen, refuses to grow).
struct Buf {
  const char* name = "";
  char* p = nullptr;
  size_t bytes = 0;
  bool frozen = false;
  explicit Buf(const char* n) : name(n) {}
  ~Buf() { mt_free(p, bytes, MemCategory::Comm); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <class T = char>
  T* get(int64_t count) {
    const size_t need = size_t(count) * sizeof(T);
    if (need > bytes) {
      MT_CHECK(!frozen, "ep_dispatch", "buffer '", name, "' needs ", need, " bytes but sync_free allocated ", bytes,
               " at construction");
      mt_free(p, bytes, MemCategory::Comm);
      p = nullptr;
      p = static_cast<char*>(mt_alloc(need, MemCategory::Comm));
      bytes = need;
    }
    return reinterpret_cast<T*>(p);
  }
  template <class T = char>
  T* data() const {
    return reinterpret_cast<T*>(p);
  }
};

}  // namespace

struct EpDispatch::Impl {
  Comm comm, node_comm, rail_comm;
  EpDispatchConfig cfg;
  int P = 1, me = 0, E = 0, El = 0, k = 0, L = 1, Nn = 1, node = 0, li = 0;
  int64_t D = 0, nb = 0, pb = 0, rec = 0, m1 = 0, rec1 = 0, cb = 0, H = 0, cap_rows = 0, slot_bytes = 0;
  bool sync_free = false, hier = false, direct = false;
  EpStats st;

  // Home side.
  int64_t N = -1;  // tokens of the last dispatch (-1: none yet)
  Buf wcopy{"home.weights [N,k] f32"}, row_of{"home.row_of [N,k] i32"};
  Buf hbuf{"home.token_bf16 [N,D]"}, qbuf{"home.token_e4m3 [N,D]"}, sbuf{"home.token_scales [N,D/128] f32"};
  Buf send1{"dispatch.send"}, recv1{"dispatch.recv"};
  std::vector<int64_t> cnt, rcnt, off;       // flat: [P*El] send counts, recv counts, send offsets (records)
  std::vector<int64_t> sc, sd, rc, rd;       // per-peer byte counts / displacements scratch
  std::vector<int64_t> peer_send, peer_recv;  // records per peer of the current layout (flat) / rail (hier)
  std::vector<int64_t> blk_start;            // sync_free: byte offset of peer q's first payload row in send1
  std::vector<int64_t> fpos, poff;           // flat: [P*El] block b's first row, grouped / peer-major order
  Buf msend{"dispatch.meta_send [S] 8B"}, mrecv{"dispatch.meta_recv [R] 8B"},
      stage{"expert.recv_stage [R] wire rows"};

  // Hierarchical.
  Buf send2{"dispatch.send_stage2"}, recv2{"dispatch.recv_stage2"};
  Buf row_of2{"forward.row_of [M1,k] i32"}, w2{"forward.weights [M1,k] f32"};
  std::vector<int64_t> cnt1, rcnt1, cnt2, rcnt2, off1, off2;
  // Per-call scratch, sized once: [Nn] x 4 (rail counts / displacements), [L] x 4 (node), cursors.
  std::vector<int64_t> rs[4], ns[4], c1s, c2s, r1start;
  std::vector<int> nodes_;
  Buf fwd_scalars{"backward.forward_scalars [M1,k] f32"}, home_scalars{"backward.home_scalars [S1,k] f32"};
  Buf slot_rec1{"home.slot_record [N,k] i32"};  // stage-1 record that carries slot (t, s)
  int64_t M1 = 0, S1 = 0, S2 = 0;  // stage-1 records received / sent, stage-2 records sent

  // Expert side (outputs of dispatch).
  int64_t R = 0;
  Buf out_x{"expert.recv_x [R,D] f32"}, out_src{"expert.recv_src [R] i32"}, out_tok{"expert.recv_token [R] i32"},
      out_slot{"expert.recv_slot [R] i32"}, out_w{"expert.recv_weight [R] f32"};
  Buf pos_of_stage{"expert.pos_of_stage [R] i64"}, rec_ptr{"expert.record_ptr [R]"};
  std::vector<int64_t> counts, offsets, grp, cur;
  struct Block {
    const char* base;
    int64_t n;
  };
  std::vector<Block> blocks;  // staging blocks in arrival order (one per sender)

  // Combine.
  Buf csend{"combine.send"}, crecv{"combine.recv"}, cdec{"combine.recv_f32"};
  Buf partial{"combine.partial [M1,D] f32"}, psend{"combine.partial_send"}, precv{"combine.partial_recv"},
      pdec{"combine.partial_recv_f32"};
  Buf vsend{"backward.scalars_send"}, vrecv{"backward.scalars_recv"};  // combine_scalars

  std::vector<Buf*> all_bufs() {
    return {&wcopy, &row_of, &hbuf, &qbuf, &sbuf, &send1, &recv1, &send2, &recv2, &row_of2, &w2, &out_x, &out_src,
            &out_tok, &out_slot, &out_w, &pos_of_stage, &rec_ptr, &csend, &crecv, &cdec, &partial, &psend, &precv,
            &pdec, &slot_rec1, &vsend, &vrecv, &fwd_scalars, &home_scalars, &msend, &mrecv, &stage};
  }

  int node_of(int ep_rank) const { return ep_rank / L; }
  void classify(EpTraffic& t, int dst_ep_rank, int64_t bytes) const {
    if (dst_ep_rank == me) t.bytes_self += bytes;
    else if (node_of(dst_ep_rank) == node) t.bytes_intra += bytes;
    else t.bytes_inter += bytes;
  }

  // ---- payload codecs ----
  void encode_tokens(const float* x, int64_t n) {
    if (n == 0) return;
    if (cfg.dispatch_payload == EpPayload::BF16) {
      to_wire_bf16_rows(hbuf.get<bf16>(n * D), x, n, D);
    } else if (cfg.dispatch_payload == EpPayload::E4M3) {
      fp8_quantize(qbuf.get<uint8_t>(n * D), sbuf.get<float>(n * nb), x, n, D, Fp8Format::E4M3, Fp8Scaling::Block, 1,
                   kFp8Block);
    }
  }
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
      case EpPayload::BF16: from_wire_bf16(out, reinterpret_cast<const bf16*>(src), D); break;
      case EpPayload::E4M3: {
        float sc_[1];
        fp8_decode(out, reinterpret_cast<const uint8_t*>(src + nb * 4), D, Fp8Format::E4M3);
        for (int64_t b = 0; b < nb; ++b) {
          std::memcpy(sc_, src + b * 4, 4);
          const int64_t e = std::min(D, (b + 1) * kFp8Block);
          for (int64_t d = b * kFp8Block; d < e; ++d) out[d] *= sc_[0];
        }
        break;
      }
    }
  }
  // Combine rows: fp32 rows [n, D] <-> wire rows [n, cb bytes].
  void encode_rows(char* dst, const float* src, int64_t n) const {
    if (n == 0) return;
    if (cfg.combine_payload == EpPayload::BF16) to_wire_bf16_rows(reinterpret_cast<bf16*>(dst), src, n, D);
    else std::memcpy(dst, src, size_t(n * D * 4));
  }

  // y [n, D] = moe_unpermute (weights w) or moe_permute_backward (w null) of the wire rows in [S, cb bytes]
  // picked by ro [n, k]. bf16 rows are decoded a chunk of tokens at a time into a cache-sized buffer (per
  // thread) and reduced by the same kernel: a token's result depends only on its own rows, so this is bitwise
  // the one-call result on fully decoded rows, without writing and re-reading them all.
  int64_t reduce_chunk_tokens() const { return std::max<int64_t>(1, (int64_t(1) << 16) / (int64_t(k) * D)); }
  int64_t reduce_slot_bytes() const { return reduce_chunk_tokens() * k * (D * 4 + 4); }
  void reduce_rows(float* y, Buf& tmp, const char* in, const int32_t* ro, const float* w, int64_t n, int64_t S) {
    if (n == 0) return;
    if (cfg.combine_payload == EpPayload::F32) {
      const float* rows = reinterpret_cast<const float*>(in);
      if (w) moe_unpermute(y, rows, ro, w, n, k, S, D);
      else moe_permute_backward(y, rows, ro, n, k, S, D);
      return;
    }
    const int64_t tc = reduce_chunk_tokens(), nch = (n + tc - 1) / tc, slot = reduce_slot_bytes();
    int nt = std::max(1, int(std::min<int64_t>(num_threads(), nch)));
    if (tmp.frozen) nt = std::max(1, std::min(nt, int(int64_t(tmp.bytes) / slot)));
    char* ws = tmp.get(int64_t(nt) * slot);
    const bf16* rows = reinterpret_cast<const bf16*>(in);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1 && n * k * D >= kParMin)
    for (int64_t c = 0; c < nch; ++c) {
      char* mine = ws + int64_t(omp_get_thread_num()) * slot;
      float* buf = reinterpret_cast<float*>(mine);
      int32_t* lro = reinterpret_cast<int32_t*>(mine + tc * k * D * 4);
      const int64_t t0 = c * tc, t1 = std::min(n, t0 + tc);
      int32_t j = 0;
      for (int64_t i = t0 * k; i < t1 * k; ++i) {
        const int32_t r = ro[i];
        lro[i - t0 * k] = r >= 0 ? j : -1;
        if (r >= 0) from_wire_bf16(buf + int64_t(j++) * D, rows + int64_t(r) * D, D);
      }
      if (w) moe_unpermute(y + t0 * D, buf, lro, w + t0 * k, t1 - t0, k, j, D);
      else moe_permute_backward(y + t0 * D, buf, lro, t1 - t0, k, j, D);
    }
  }

  void validate(const float* x, const int32_t* idx, int64_t n) const {
    const char* op = "ep_dispatch";
    MT_CHECK(n >= 0, op, "negative token count N=", n);
    if (sync_free)
      MT_CHECK(n <= cfg.max_tokens, op, "N=", n, " exceeds max_tokens=", cfg.max_tokens,
               " (sync_free buffers are sized at construction)");
    MT_CHECK(n <= std::numeric_limits<int32_t>::max() / std::max(k, 1), op, "N=", n, " too large");
    if (n == 0) return;
    MT_CHECK(x && idx, op, "null x or topk_idx with N=", n);
    for (int64_t t = 0; t < n; ++t)
      for (int s = 0; s < k; ++s) {
        const int32_t e = idx[t * k + s];
        MT_CHECK(e >= -1 && e < E, op, "topk_idx[", t, ",", s, "]=", e, " outside [0, E=", E, ") and not -1 (dropped)");
        if (e < 0) continue;
        for (int s2 = 0; s2 < s; ++s2)
          MT_CHECK(idx[t * k + s2] != e, op, "token ", t, " routes to expert ", e, " twice (slots ", s2, " and ", s,
                   ")");
      }
  }

  void copy_weights(const float* w, int64_t n) {
    float* wc = wcopy.get<float>(std::max<int64_t>(n * k, 1));
    for (int64_t i = 0; i < n * k; ++i) wc[i] = w ? w[i] : 1.0f;
  }

  // Counting scatter of the staged records into the grouped outputs. Records carry RecMeta.
  void unpack(const char* op) {
    R = 0;
    for (const Block& b : blocks) R += b.n;
    std::fill(grp.begin(), grp.end(), 0);
    for (const Block& b : blocks)
      for (int64_t r = 0; r < b.n; ++r) {
        RecMeta m;
        std::memcpy(&m, b.base + r * rec, sizeof m);
        MT_CHECK(m.le >= 0 && m.le < El && m.src >= 0 && m.src < P && m.slot >= 0 && m.slot < k, op,
                 "corrupt record header (local expert ", m.le, ", source ", m.src, ", slot ", m.slot, ")");
        ++grp[size_t(m.le) * P + m.src];
      }
    int64_t acc = 0;
    for (int le = 0; le < El; ++le) {
      offsets[size_t(le)] = acc;
      for (int q = 0; q < P; ++q) {
        const int64_t c = grp[size_t(le) * P + q];
        cur[size_t(le) * P + q] = acc;
        acc += c;
      }
      counts[size_t(le)] = acc - offsets[size_t(le)];
    }
    offsets[size_t(El)] = acc;
    const int64_t Rm = std::max<int64_t>(R, 1);
    float* ox = out_x.get<float>(Rm * D);
    int32_t* os = out_src.get<int32_t>(Rm);
    int32_t* ot = out_tok.get<int32_t>(Rm);
    int32_t* ol = out_slot.get<int32_t>(Rm);
    float* ow = out_w.get<float>(Rm);
    int64_t* pos = pos_of_stage.get<int64_t>(Rm);
    const char** ptr = rec_ptr.get<const char*>(Rm);
    int64_t g = 0;
    for (const Block& b : blocks)
      for (int64_t r = 0; r < b.n; ++r, ++g) {
        RecMeta m;
        std::memcpy(&m, b.base + r * rec, sizeof m);
        pos[g] = cur[size_t(m.le) * P + m.src]++;
        ptr[g] = b.base + r * rec;
      }
#pragma omp parallel for schedule(static) if (R * D >= kParMin)
    for (int64_t i = 0; i < R; ++i) {
      RecMeta m;
      std::memcpy(&m, ptr[i], sizeof m);
      const int64_t p = pos[i];
      os[p] = m.src;
      ot[p] = m.token;
      ol[p] = m.slot;
      ow[p] = m.w;
      read_payload(ox + p * D, ptr[i] + 16);
    }
  }

  // Expert side of every combine: rows of yr in staging order, encoded, into csend.
  char* pack_combine_send(const float* yr) {
    char* out = csend.get(std::max<int64_t>(R * cb, 1));
    const int64_t* pos = pos_of_stage.data<int64_t>();
    if (cfg.combine_payload == EpPayload::F32) {
#pragma omp parallel for schedule(static) if (R * D >= kParMin)
      for (int64_t g = 0; g < R; ++g) std::memcpy(out + g * cb, yr + pos[g] * D, size_t(D * 4));
    } else {
#pragma omp parallel for schedule(static) if (R * D >= kParMin)
      for (int64_t g = 0; g < R; ++g) to_wire_bf16(reinterpret_cast<bf16*>(out + g * cb), yr + pos[g] * D, D);
    }
    return out;
  }

  // ------------------------------------------------------------------------------------------------------
  // Flat layout. Home side: kept (token, slot) records in (peer q, local expert le, token, slot) order; block
  // b = q*El + le starts at record off[b] and has cnt[b] records; row_of[t, s] = the record index (-1:
  // dropped). Expert side: block b (from peer q, for local expert le) has rcnt[b] rows; it sits at row fpos[b]
  // of the grouped (expert-major) layout and at row poff[b] of the peer-major staging order.
  // Payload rows and metadata travel separately, so the payload rows of a block are contiguous on both sides:
  // alltoall lands them in their final (grouped) place with one all_to_all_v per local expert ("direct");
  // sync_free (one exchange, no count round) lands them per peer and copies whole blocks into place.
  struct WireMeta {
    int32_t code;  // token * k + slot
    float w;
  };
  static_assert(sizeof(WireMeta) == 8);

  // Blocks b = q*El + le in peer-major order: start[b] = the rows of the blocks before b, per_peer[q] = the
  // rows of peer q's blocks; returns the total.
  int64_t peer_major(const std::vector<int64_t>& c, std::vector<int64_t>& start, std::vector<int64_t>& per_peer) const {
    int64_t acc = 0;
    for (int q = 0; q < P; ++q) {
      per_peer[size_t(q)] = 0;
      for (int le = 0; le < El; ++le) {
        const size_t b = size_t(q) * El + le;
        start[b] = acc;
        acc += c[b];
        per_peer[size_t(q)] += c[b];
      }
    }
    return acc;
  }

  void plan_send(const int32_t* idx, int64_t n) {
    std::fill(cnt.begin(), cnt.end(), 0);
    for (int64_t i = 0; i < n * k; ++i)
      if (idx[i] >= 0) ++cnt[size_t(idx[i])];  // expert e = q*El + le: block order already; -1: dropped
    S1 = peer_major(cnt, off, peer_send);  // records sent (kept slots)
    int32_t* ro = row_of.get<int32_t>(std::max<int64_t>(n * k, 1));
    std::copy(off.begin(), off.end(), cur.begin());
    for (int64_t i = 0; i < n * k; ++i) ro[i] = idx[i] >= 0 ? int32_t(cur[size_t(idx[i])]++) : -1;
  }

  void plan_recv() {
    int64_t acc = 0;
    for (int le = 0; le < El; ++le) {
      offsets[size_t(le)] = acc;
      for (int q = 0; q < P; ++q) {
        fpos[size_t(q) * El + le] = acc;
        acc += rcnt[size_t(q) * El + le];
      }
      counts[size_t(le)] = acc - offsets[size_t(le)];
    }
    offsets[size_t(El)] = acc;
    R = acc;
    peer_major(rcnt, poff, peer_recv);
  }

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

  float* alloc_outputs() {
    const int64_t Rm = std::max<int64_t>(R, 1);
    out_src.get<int32_t>(Rm);
    out_tok.get<int32_t>(Rm);
    out_slot.get<int32_t>(Rm);
    out_w.get<float>(Rm);
    return out_x.get<float>(Rm * D);
  }
  // Metadata of block b's rows (mb = the block's first WireMeta) into the grouped outputs. Returns false on a
  // corrupt record (callable inside a parallel loop: the caller checks).
  bool scatter_meta(int64_t b, const char* mb) {
    const int q = int(b / El);
    int32_t* os = out_src.data<int32_t>();
    int32_t* ot = out_tok.data<int32_t>();
    int32_t* ol = out_slot.data<int32_t>();
    float* ow = out_w.data<float>();
    for (int64_t i = 0, p = fpos[size_t(b)]; i < rcnt[size_t(b)]; ++i, ++p) {
      WireMeta m;
      std::memcpy(&m, mb + i * 8, 8);
      if (m.code < 0) return false;
      os[p] = q;
      ot[p] = m.code / k;
      ol[p] = m.code % k;
      ow[p] = m.w;
    }
    return true;
  }

  // One all_to_all_v per local expert: rows of rb bytes from the home record order (src) to the grouped order
  // (dst) when to_experts, else back.
  void direct_rounds(char* dst, const char* src, int64_t rb, bool to_experts, EpTraffic& tr) {
    for (int le = 0; le < El; ++le) {
      for (int q = 0; q < P; ++q) {
        const size_t b = size_t(q) * El + le;
        const int64_t hs = cnt[b] * rb, ho = off[b] * rb, es = rcnt[b] * rb, eo = fpos[b] * rb;
        sc[size_t(q)] = to_experts ? hs : es;
        sd[size_t(q)] = to_experts ? ho : eo;
        rc[size_t(q)] = to_experts ? es : hs;
        rd[size_t(q)] = to_experts ? eo : ho;
        classify(tr, q, sc[size_t(q)]);
      }
      {
        const double c0_ = now_s();
        comm.all_to_all_v(dst, rc.data(), rd.data(), src, sc.data(), sd.data());
        tr.seconds_comm += now_s() - c0_;
      }
      tr.rounds += 1;
    }
  }
  // One all_to_all_v between the home record order and the expert's peer-major staging order. skip_self:
  // the block for this rank itself does not go through the transport (the caller moves it; its bytes
  // still count as bytes_self).
  void staged_round(char* dst, const char* src, int64_t rb, bool to_experts, EpTraffic& tr, bool skip_self = false) {
    for (int q = 0; q < P; ++q) {
      const size_t b = size_t(q) * El;
      const int64_t hs = peer_send[size_t(q)] * rb, ho = off[b] * rb, es = peer_recv[size_t(q)] * rb,
                    eo = poff[b] * rb;
      sc[size_t(q)] = to_experts ? hs : es;
      sd[size_t(q)] = to_experts ? ho : eo;
      rc[size_t(q)] = to_experts ? es : hs;
      rd[size_t(q)] = to_experts ? eo : ho;
      classify(tr, q, sc[size_t(q)]);
    }
    if (skip_self) sc[size_t(me)] = rc[size_t(me)] = 0;
    {
      const double c0_ = now_s();
      comm.all_to_all_v(dst, rc.data(), rd.data(), src, sc.data(), sd.data());
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
  }

  void dispatch_alltoall(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) {
    plan_send(idx, n);
    const bool f32 = cfg.dispatch_payload == EpPayload::F32 && direct;
    char* ps = nullptr;
    WireMeta* ms = nullptr;
    if (f32) {
      ps = send1.get(std::max<int64_t>(S1 * pb, 1));
      ms = msend.get<WireMeta>(std::max<int64_t>(S1, 1));
      pack_records(
          idx, x, n, [&](int64_t j, int) { return ps + j * pb; },
          [&](int64_t j, int) { return reinterpret_cast<char*>(ms + j); });
    } else {
      ps = pack_messages(x, idx, n, 0);
    }
    tr.rows_sent += S1;
    {
      const double c0_ = now_s();
      comm.all_to_all(rcnt.data(), cnt.data(), int64_t(El) * 8);  // count round: El counts to every peer
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
    for (int q = 0; q < P; ++q) classify(tr, q, int64_t(El) * 8);
    plan_recv();
    if (!f32) return dispatch_alltoall_staged(ps, tr);  // wire payload, or not direct
    // fp32 rows: metadata in one round, then the rows straight into recv_x, one round per local expert.
    WireMeta* mr = mrecv.get<WireMeta>(std::max<int64_t>(R, 1));
    staged_round(reinterpret_cast<char*>(mr), reinterpret_cast<const char*>(ms), 8, true, tr);
    float* ox = alloc_outputs();
    direct_rounds(reinterpret_cast<char*>(ox), ps, pb, true, tr);
    const int64_t nblk = int64_t(P) * El;
    for (int64_t b = 0; b < nblk; ++b)
      MT_CHECK(scatter_meta(b, reinterpret_cast<const char*>(mr + poff[size_t(b)])), "ep_dispatch",
               "corrupt record metadata from rank ", b / El);
  }

  // Staged messages: to peer q [hdr bytes: El int64 counts (sync_free) or nothing][n_q WireMeta, padded to
  // 64][n_q payload rows]. Returns the send buffer; sc / sd / blk_start describe it.
  char* pack_messages(const float* x, const int32_t* idx, int64_t n, int64_t hdr) {
    int64_t bytes = 0;
    for (int q = 0; q < P; ++q) {
      sd[size_t(q)] = bytes;
      blk_start[size_t(q)] = bytes + hdr + round_up(peer_send[size_t(q)] * 8, 64);  // payload of peer q
      sc[size_t(q)] = blk_start[size_t(q)] - bytes + peer_send[size_t(q)] * pb;
      bytes += round_up(sc[size_t(q)], 64);
    }
    char* sb = send1.get(std::max<int64_t>(bytes, 1));
    if (hdr > 0)
      for (int q = 0; q < P; ++q) std::memcpy(sb + sd[size_t(q)], cnt.data() + size_t(q) * El, size_t(El * 8));
    pack_records(
        idx, x, n,
        [&](int64_t j, int q) { return sb + blk_start[size_t(q)] + (j - off[size_t(q) * El]) * pb; },
        [&](int64_t j, int q) { return sb + sd[size_t(q)] + hdr + (j - off[size_t(q) * El]) * 8; });
    return sb;
  }
  // The received messages (region(q) = peer q's message) into the grouped outputs: whole blocks, decoded.
  template <class Region>
  void unpack_messages(Region region, int64_t hdr) {
    float* ox = alloc_outputs();
    const int64_t nblk = int64_t(P) * El;
    int64_t bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : bad) if (R * D >= kParMin)
    for (int64_t b = 0; b < nblk; ++b) {
      const int q = int(b / El);
      const char* reg = region(q);
      const int64_t first = poff[size_t(b)] - poff[size_t(q) * El];
      const char* pay = reg + hdr + round_up(peer_recv[size_t(q)] * 8, 64) + first * pb;
      float* o = ox + fpos[size_t(b)] * D;
      if (cfg.dispatch_payload == EpPayload::F32) {
        if (rcnt[size_t(b)] > 0) std::memcpy(o, pay, size_t(rcnt[size_t(b)] * pb));
      } else {
        for (int64_t i = 0; i < rcnt[size_t(b)]; ++i) read_payload(o + i * D, pay + i * pb);
      }
      bad += !scatter_meta(b, reg + hdr + first * 8);
    }
    MT_CHECK(bad == 0, "ep_dispatch", bad, " block(s) with corrupt record metadata");
  }

  // alltoall, staged: one round per call, a message per peer (metadata in front); rows are copied (fp32) or
  // decoded (bf16 / e4m3: the decode touches every row anyway) block by block into their grouped place.
  void dispatch_alltoall_staged(char* sb, EpTraffic& tr) {
    int64_t rbytes = 0;
    for (int q = 0; q < P; ++q) {
      rd[size_t(q)] = rbytes;
      rc[size_t(q)] = round_up(peer_recv[size_t(q)] * 8, 64) + peer_recv[size_t(q)] * pb;
      rbytes += round_up(rc[size_t(q)], 64);
      classify(tr, q, sc[size_t(q)]);
    }
    sc[size_t(me)] = rc[size_t(me)] = 0;  // this rank's own message is read where it was packed
    char* rb = recv1.get(std::max<int64_t>(rbytes, 1));
    {
      const double c0_ = now_s();
      comm.all_to_all_v(rb, rc.data(), rd.data(), sb, sc.data(), sd.data());
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
    unpack_messages([&](int q) { return q == me ? sb + sd[size_t(q)] : rb + rd[size_t(q)]; }, 0);
  }

  void dispatch_sync_free(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) {
    plan_send(idx, n);
    char* sb = pack_messages(x, idx, n, H);
    tr.rows_sent += S1;
    for (int q = 0; q < P; ++q) classify(tr, q, sc[size_t(q)]);
    sc[size_t(me)] = 0;  // this rank's own message is read where it was packed
    char* rb = recv1.data();
    {
      const double c0_ = now_s();
      comm.exchange(rb, slot_bytes, sb, sc.data(), sd.data());
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
    auto region = [&](int q) -> const char* { return q == me ? sb + sd[size_t(q)] : rb + q * slot_bytes; };
    for (int q = 0; q < P; ++q) {
      std::memcpy(rcnt.data() + size_t(q) * El, region(q), size_t(El * 8));
      int64_t s = 0;
      for (int le = 0; le < El; ++le) {
        const int64_t c = rcnt[size_t(q) * El + le];
        MT_CHECK(c >= 0, "ep_dispatch", "header from rank ", q, " announces a negative count ", c);
        s += c;
      }
      MT_CHECK(s <= cap_rows, "ep_dispatch", "header from rank ", q, " announces ", s,
               " records, more than the capacity ", cap_rows);
    }
    plan_recv();
    unpack_messages(region, H);
  }

  // Expert -> home: rows v [R, w] in grouped order arrive in the home record order, in [S1, rb] (rb = w * 4 or
  // w * 2 with bf). direct: one round per local expert, sent straight from v when f32; else one round through
  // the peer-major staging (scratch).
  void to_home(char* in, const float* v, int64_t w, bool bf, bool direct, Buf& scratch, EpTraffic& tr) {
    const int64_t rb = w * (bf ? 2 : 4);
    if (direct) {
      const char* src = reinterpret_cast<const char*>(v);
      if (bf) {
        bf16* o = scratch.get<bf16>(std::max<int64_t>(R * w, 1));
        to_wire_bf16_rows(o, v, R, w);
        src = reinterpret_cast<const char*>(o);
      }
      direct_rounds(in, src, rb, false, tr);
      return;
    }
    char* o = scratch.get(std::max<int64_t>(R * rb, 1));
    const int64_t nblk = int64_t(P) * El;
#pragma omp parallel for schedule(dynamic, 1) if (R * w >= kParMin)
    for (int64_t b = 0; b < nblk; ++b) {
      const int64_t n = rcnt[size_t(b)];
      // this rank's own rows go straight to their home place (no transport copy)
      char* dst = b / El == me ? in + off[size_t(b)] * rb : o + poff[size_t(b)] * rb;
      const float* src = v + fpos[size_t(b)] * w;
      if (bf) to_wire_bf16(reinterpret_cast<bf16*>(dst), src, n * w);
      else if (n > 0) std::memcpy(dst, src, size_t(n * rb));
    }
    staged_round(in, o, rb, false, tr, true);
  }
  // Home -> experts: rows [S1, rb] in the home record order arrive as out [R, w] f32 in grouped order.
  void to_experts(float* out, const char* send, int64_t w, bool bf, bool direct, Buf& scratch, EpTraffic& tr) {
    const int64_t rb = w * (bf ? 2 : 4);
    if (direct) {
      char* dst = bf ? scratch.get(std::max<int64_t>(R * rb, 1)) : reinterpret_cast<char*>(out);
      direct_rounds(dst, send, rb, true, tr);
      if (bf && R > 0) from_wire_bf16_rows(out, reinterpret_cast<const bf16*>(dst), R, w);
      return;
    }
    char* st = scratch.get(std::max<int64_t>(R * rb, 1));
    staged_round(st, send, rb, true, tr, true);
    const int64_t nblk = int64_t(P) * El;
#pragma omp parallel for schedule(dynamic, 1) if (R * w >= kParMin)
    for (int64_t b = 0; b < nblk; ++b) {
      const int64_t n = rcnt[size_t(b)];
      const char* src = b / El == me ? send + off[size_t(b)] * rb : st + poff[size_t(b)] * rb;
      float* dst = out + fpos[size_t(b)] * w;
      if (bf) from_wire_bf16(dst, reinterpret_cast<const bf16*>(src), n * w);
      else if (n > 0) std::memcpy(dst, src, size_t(n * rb));
    }
  }

  void combine_flat(float* y, const float* yr, bool weighted, EpTraffic& tr) {
    char* in = crecv.get(std::max<int64_t>(S1 * cb, 1));
    const bool bf = cfg.combine_payload == EpPayload::BF16;  // bf16: the encode touches every row anyway
    to_home(in, yr, D, bf, direct && !bf, csend, tr);
    tr.rows_sent += R;
    tr.rows_recv += S1;
    reduce_rows(y, cdec, in, row_of.data<int32_t>(), weighted ? wcopy.data<float>() : nullptr, N, S1);
  }
  // ------------------------------------------------------------------------------------------------------
  // Stage-1 record: [int32 token][int32 expert[k] (-1: not on this node)][float w[k]] padded to m1, payload.
  void dispatch_hier(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) {
    const char* op = "ep_dispatch.hierarchical";
    // ---- stage 1 plan: (token, node) records, node-major then token order ----
    std::fill(cnt1.begin(), cnt1.end(), 0);
    int32_t* ro1 = row_of.get<int32_t>(std::max<int64_t>(n * k, 1));
    std::vector<int>& nodes = nodes_;
    auto token_nodes = [&](int64_t t) {
      int m = 0;
      for (int s = 0; s < k; ++s) {
        if (idx[t * k + s] < 0) continue;
        const int b = (idx[t * k + s] / El) / L;
        bool seen = false;
        for (int j = 0; j < m; ++j) seen |= nodes[size_t(j)] == b;
        if (!seen) nodes[size_t(m++)] = b;
      }
      std::sort(nodes.begin(), nodes.begin() + m);
      return m;
    };
    for (int64_t t = 0; t < n; ++t) {
      const int m = token_nodes(t);
      for (int j = 0; j < m; ++j) ++cnt1[size_t(nodes[size_t(j)])];
    }
    std::vector<int64_t>& c1 = c1s;
    int64_t acc = 0;
    for (int b = 0; b < Nn; ++b) {
      off1[size_t(b)] = acc;
      acc += cnt1[size_t(b)];
    }
    S1 = acc;
    c1 = off1;
    int32_t* sr1 = slot_rec1.get<int32_t>(std::max<int64_t>(n * k, 1));
    for (int64_t t = 0; t < n; ++t) {
      const int m = token_nodes(t);
      for (int j = 0; j < k; ++j) ro1[t * k + j] = j < m ? int32_t(c1[size_t(nodes[size_t(j)])]++) : -1;
      for (int s = 0; s < k; ++s) {
        if (idx[t * k + s] < 0) {
          sr1[t * k + s] = -1;
          continue;
        }
        const int b = (idx[t * k + s] / El) / L;
        int j = 0;
        while (nodes[size_t(j)] != b) ++j;
        sr1[t * k + s] = ro1[t * k + j];
      }
    }
    char* sb = send1.get(std::max<int64_t>(S1 * rec1, 1));
    const float* wc = wcopy.data<float>();
#pragma omp parallel for schedule(static) if (n * k * D >= kParMin)
    for (int64_t t = 0; t < n; ++t)
      for (int j = 0; j < k; ++j) {
        const int32_t r = ro1[t * k + j];
        if (r < 0) break;
        char* p = sb + int64_t(r) * rec1;
        const int b = int(std::upper_bound(off1.begin(), off1.end(), int64_t(r)) - off1.begin()) - 1;
        int32_t tok = int32_t(t);
        std::memcpy(p, &tok, 4);
        for (int s = 0; s < k; ++s) {
          const int32_t e = idx[t * k + s];
          const int32_t ex = e >= 0 && (e / El) / L == b ? e : -1;
          std::memcpy(p + 4 + 4 * s, &ex, 4);
          std::memcpy(p + 4 + 4 * k + 4 * s, wc + t * k + s, 4);
        }
        write_payload(p + m1, x, t);
      }
    // Count round and exchange on the rail (same local index on every node).
    {
      const double c0_ = now_s();
      rail_comm.all_to_all(rcnt1.data(), cnt1.data(), 8);
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
    auto& s1c = rs[0];
    auto& s1d = rs[1];
    auto& r1c = rs[2];
    auto& r1d = rs[3];
    int64_t rbytes = 0;
    M1 = 0;
    for (int b = 0; b < Nn; ++b) {
      s1c[size_t(b)] = cnt1[size_t(b)] * rec1;
      s1d[size_t(b)] = off1[size_t(b)] * rec1;
      r1c[size_t(b)] = rcnt1[size_t(b)] * rec1;
      r1d[size_t(b)] = rbytes;
      rbytes += r1c[size_t(b)];
      M1 += rcnt1[size_t(b)];
      classify(tr, b * L + li, 8 + s1c[size_t(b)]);
    }
    char* rb = recv1.get(std::max<int64_t>(rbytes, 1));
    {
      const double c0_ = now_s();
      rail_comm.all_to_all_v(rb, r1c.data(), r1d.data(), sb, s1c.data(), s1d.data());
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
    tr.rows_sent += S1;

    // ---- forward: stage-2 plan over the node, (source node, token, slot) order per destination ----
    std::fill(cnt2.begin(), cnt2.end(), 0);
    const int64_t M1m = std::max<int64_t>(M1, 1);
    int32_t* ro2 = row_of2.get<int32_t>(M1m * k);
    float* w2p = w2.get<float>(M1m * k);
    for (int64_t r = 0; r < M1; ++r) {
      const char* p = rb + r * rec1;
      for (int s = 0; s < k; ++s) {
        int32_t e;
        std::memcpy(&e, p + 4 + 4 * s, 4);
        if (e < 0) continue;
        MT_CHECK(e < E && (e / El) / L == node, op, "stage-1 record names expert ", e, " which is not on node ", node);
        ++cnt2[size_t((e / El) % L)];
      }
    }
    acc = 0;
    for (int j = 0; j < L; ++j) {
      off2[size_t(j)] = acc;
      acc += cnt2[size_t(j)];
    }
    S2 = acc;
    std::vector<int64_t>& c2 = c2s;
    std::copy(off2.begin(), off2.end(), c2.begin());
    for (int64_t r = 0; r < M1; ++r) {
      const char* p = rb + r * rec1;
      for (int s = 0; s < k; ++s) {
        int32_t e;
        std::memcpy(&e, p + 4 + 4 * s, 4);
        std::memcpy(w2p + r * k + s, p + 4 + 4 * k + 4 * s, 4);
        ro2[r * k + s] = e < 0 ? -1 : int32_t(c2[size_t((e / El) % L)]++);
      }
    }
    // Source node of each stage-1 record (records arrive grouped by rail peer = source node).
    r1start[0] = 0;
    for (int b = 0; b < Nn; ++b) r1start[size_t(b) + 1] = r1start[size_t(b)] + rcnt1[size_t(b)];
    char* sb2 = send2.get(std::max<int64_t>(S2 * rec, 1));
#pragma omp parallel for schedule(static) if (M1 * k * D >= kParMin)
    for (int64_t r = 0; r < M1; ++r) {
      const char* p = rb + r * rec1;
      const int a = int(std::upper_bound(r1start.begin(), r1start.end(), r) - r1start.begin()) - 1;
      int32_t tok;
      std::memcpy(&tok, p, 4);
      for (int s = 0; s < k; ++s) {
        const int32_t g = ro2[r * k + s];
        if (g < 0) continue;
        int32_t e;
        std::memcpy(&e, p + 4 + 4 * s, 4);
        char* o = sb2 + int64_t(g) * rec;
        RecMeta m{tok, int32_t(a * L + li), int16_t(s), int16_t(e % El), w2p[r * k + s]};
        std::memcpy(o, &m, sizeof m);
        std::memcpy(o + 16, p + m1, size_t(rec - 16));
      }
    }
    {
      const double c0_ = now_s();
      node_comm.all_to_all(rcnt2.data(), cnt2.data(), 8);
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
    auto& s2c = ns[0];
    auto& s2d = ns[1];
    auto& r2c = ns[2];
    auto& r2d = ns[3];
    rbytes = 0;
    for (int j = 0; j < L; ++j) {
      s2c[size_t(j)] = cnt2[size_t(j)] * rec;
      s2d[size_t(j)] = off2[size_t(j)] * rec;
      r2c[size_t(j)] = rcnt2[size_t(j)] * rec;
      r2d[size_t(j)] = rbytes;
      rbytes += r2c[size_t(j)];
      classify(tr, node * L + j, 8 + s2c[size_t(j)]);
    }
    char* rb2 = recv2.get(std::max<int64_t>(rbytes, 1));
    {
      const double c0_ = now_s();
      node_comm.all_to_all_v(rb2, r2c.data(), r2d.data(), sb2, s2c.data(), s2d.data());
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
    tr.rows_sent += S2;
    blocks.clear();
    for (int j = 0; j < L; ++j) blocks.push_back({rb2 + r2d[size_t(j)], rcnt2[size_t(j)]});
    unpack(op);
  }

  void combine_hier(float* y, const float* yr, bool weighted, EpTraffic& tr) {
    // Expert -> forwarder (node), rows in stage-2 receive order.
    char* out = pack_combine_send(yr);
    auto& s2c = ns[0];
    auto& s2d = ns[1];
    auto& r2c = ns[2];
    auto& r2d = ns[3];
    int64_t sbytes = 0;
    for (int j = 0; j < L; ++j) {
      s2c[size_t(j)] = rcnt2[size_t(j)] * cb;
      s2d[size_t(j)] = sbytes;
      sbytes += s2c[size_t(j)];
      r2c[size_t(j)] = cnt2[size_t(j)] * cb;
      r2d[size_t(j)] = off2[size_t(j)] * cb;
      classify(tr, node * L + j, s2c[size_t(j)]);
    }
    char* in2 = crecv.get(std::max<int64_t>(S2 * cb, 1));
    {
      const double c0_ = now_s();
      node_comm.all_to_all_v(in2, r2c.data(), r2d.data(), out, s2c.data(), s2d.data());
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
    tr.rows_sent += R;
    // Forwarder: reduce the node's slots of every stage-1 record (slot order, from 0).
    float* part = partial.get<float>(std::max<int64_t>(M1 * D, 1));
    reduce_rows(part, cdec, in2, row_of2.data<int32_t>(), weighted ? w2.data<float>() : nullptr, M1, S2);
    // Forwarder -> home (rail), one partial row per stage-1 record, in stage-1 receive order (fp32: as is).
    char* pout = reinterpret_cast<char*>(part);
    if (cfg.combine_payload != EpPayload::F32) {
      pout = psend.get(std::max<int64_t>(M1 * cb, 1));
      encode_rows(pout, part, M1);
    }
    auto& s1c = rs[0];
    auto& s1d = rs[1];
    auto& r1c = rs[2];
    auto& r1d = rs[3];
    sbytes = 0;
    int64_t roff = 0;
    for (int b = 0; b < Nn; ++b) {
      s1c[size_t(b)] = rcnt1[size_t(b)] * cb;
      s1d[size_t(b)] = sbytes;
      sbytes += s1c[size_t(b)];
      r1c[size_t(b)] = cnt1[size_t(b)] * cb;
      r1d[size_t(b)] = roff;
      roff += r1c[size_t(b)];
      classify(tr, b * L + li, s1c[size_t(b)]);
    }
    char* in1 = precv.get(std::max<int64_t>(S1 * cb, 1));
    {
      const double c0_ = now_s();
      rail_comm.all_to_all_v(in1, r1c.data(), r1d.data(), pout, s1c.data(), s1d.data());
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 1;
    tr.rows_sent += M1;
    tr.rows_recv += S1;
    // Home: sum the partials of each token in node order (row_of holds them node-ascending).
    reduce_rows(y, pdec, in1, row_of.data<int32_t>(), nullptr, N, S1);
  }

  // ------------------------------------------------------------------------------------------------------
  // Backward helpers: the layout of the last dispatch, run again with other rows (no count round).
  // Row bytes are cb (the combine payload): gradients travel like combine rows.
  void decode_staged(float* out, const char* staged) const {
    const int64_t* pos = pos_of_stage.data<int64_t>();
#pragma omp parallel for schedule(static) if (R * D >= kParMin)
    for (int64_t g = 0; g < R; ++g) {
      if (cfg.combine_payload == EpPayload::F32) std::memcpy(out + pos[g] * D, staged + g * cb, size_t(D * 4));
      else from_wire_bf16(out + pos[g] * D, reinterpret_cast<const bf16*>(staged + g * cb), D);
    }
  }
  void encode_row(char* dst, const float* src) const {
    if (cfg.combine_payload == EpPayload::F32) std::memcpy(dst, src, size_t(D * 4));
    else to_wire_bf16(reinterpret_cast<bf16*>(dst), src, D);
  }

  void redispatch_flat(float* out, const float* x, EpTraffic& tr) {
    char* sb = crecv.get(std::max<int64_t>(S1 * cb, 1));
    const int32_t* ro = row_of.data<int32_t>();
#pragma omp parallel for schedule(static) if (N * k * D >= kParMin)
    for (int64_t i = 0; i < N * k; ++i)
      if (ro[i] >= 0) encode_row(sb + int64_t(ro[i]) * cb, x + (i / k) * D);
    const bool bf = cfg.combine_payload == EpPayload::BF16;
    to_experts(out, sb, D, bf, direct && !bf, csend, tr);
    tr.rows_sent += S1;
    tr.rows_recv += R;
  }

  void redispatch_hier(float* out, const float* x, EpTraffic& tr) {
    // Home -> forwarders: one row per stage-1 record.
    char* s1 = precv.get(std::max<int64_t>(S1 * cb, 1));
    const int32_t* ro1 = row_of.data<int32_t>();
#pragma omp parallel for schedule(static) if (N * k * D >= kParMin)
    for (int64_t t = 0; t < N; ++t)
      for (int j = 0; j < k && ro1[t * k + j] >= 0; ++j) encode_row(s1 + int64_t(ro1[t * k + j]) * cb, x + t * D);
    auto& a = rs[0];
    auto& ad = rs[1];
    auto& b = rs[2];
    auto& bd = rs[3];
    int64_t rb = 0;
    for (int q = 0; q < Nn; ++q) {
      a[size_t(q)] = cnt1[size_t(q)] * cb;
      ad[size_t(q)] = off1[size_t(q)] * cb;
      b[size_t(q)] = rcnt1[size_t(q)] * cb;
      bd[size_t(q)] = rb;
      rb += b[size_t(q)];
      classify(tr, q * L + li, a[size_t(q)]);
    }
    char* f1 = psend.get(std::max<int64_t>(rb, 1));
    {
      const double c0_ = now_s();
      rail_comm.all_to_all_v(f1, b.data(), bd.data(), s1, a.data(), ad.data());
      tr.seconds_comm += now_s() - c0_;
    }
    // Forwarder -> experts: fan out to the stage-2 rows.
    char* s2 = crecv.get(std::max<int64_t>(S2 * cb, 1));
    const int32_t* ro2 = row_of2.data<int32_t>();
    for (int64_t r = 0; r < M1; ++r)
      for (int s = 0; s < k; ++s)
        if (ro2[r * k + s] >= 0) std::memcpy(s2 + int64_t(ro2[r * k + s]) * cb, f1 + r * cb, size_t(cb));
    auto& c = ns[0];
    auto& cd = ns[1];
    auto& e = ns[2];
    auto& ed = ns[3];
    rb = 0;
    for (int j = 0; j < L; ++j) {
      c[size_t(j)] = cnt2[size_t(j)] * cb;
      cd[size_t(j)] = off2[size_t(j)] * cb;
      e[size_t(j)] = rcnt2[size_t(j)] * cb;
      ed[size_t(j)] = rb;
      rb += e[size_t(j)];
      classify(tr, node * L + j, c[size_t(j)]);
    }
    char* in = csend.get(std::max<int64_t>(rb, 1));
    {
      const double c0_ = now_s();
      node_comm.all_to_all_v(in, e.data(), ed.data(), s2, c.data(), cd.data());
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 2;
    tr.rows_sent += S1 + S2;
    tr.rows_recv += R;
    decode_staged(out, in);
  }

  void scalars_flat(float* out, const float* v, EpTraffic& tr) {
    float* rv = vrecv.get<float>(std::max<int64_t>(S1, 1));
    to_home(reinterpret_cast<char*>(rv), v, 1, false, false, vsend, tr);
    const int32_t* ro = row_of.data<int32_t>();
    for (int64_t i = 0; i < N * k; ++i) out[i] = ro[i] >= 0 ? rv[ro[i]] : 0.0f;
  }

  void scalars_hier(float* out, const float* v, EpTraffic& tr) {
    // Experts -> forwarders (one float per stage-2 row), forwarders -> home (k floats per stage-1 record).
    float* sv = vsend.get<float>(std::max<int64_t>(std::max(R, M1 * k), 1));
    const int64_t* pos = pos_of_stage.data<int64_t>();
    for (int64_t g = 0; g < R; ++g) sv[g] = v[pos[g]];
    auto& c = ns[0];
    auto& cd = ns[1];
    auto& e = ns[2];
    auto& ed = ns[3];
    int64_t sb = 0;
    for (int j = 0; j < L; ++j) {
      c[size_t(j)] = rcnt2[size_t(j)] * 4;
      cd[size_t(j)] = sb;
      sb += c[size_t(j)];
      e[size_t(j)] = cnt2[size_t(j)] * 4;
      ed[size_t(j)] = off2[size_t(j)] * 4;
      classify(tr, node * L + j, c[size_t(j)]);
    }
    float* f2 = vrecv.get<float>(std::max<int64_t>(std::max(S2, S1 * k), 1));
    {
      const double c0_ = now_s();
      node_comm.all_to_all_v(f2, e.data(), ed.data(), sv, c.data(), cd.data());
      tr.seconds_comm += now_s() - c0_;
    }
    // Forwarder: k values per stage-1 record (0 for slots of other nodes; never read).
    float* per = fwd_scalars.get<float>(std::max<int64_t>(M1 * k, 1));
    const int32_t* ro2 = row_of2.data<int32_t>();
    for (int64_t i = 0; i < M1 * k; ++i) per[i] = ro2[i] >= 0 ? f2[ro2[i]] : 0.0f;
    auto& a = rs[0];
    auto& ad = rs[1];
    auto& b = rs[2];
    auto& bd = rs[3];
    sb = 0;
    for (int q = 0; q < Nn; ++q) {
      a[size_t(q)] = rcnt1[size_t(q)] * k * 4;
      ad[size_t(q)] = sb;
      sb += a[size_t(q)];
      b[size_t(q)] = cnt1[size_t(q)] * k * 4;
      bd[size_t(q)] = off1[size_t(q)] * k * 4;
      classify(tr, q * L + li, a[size_t(q)]);
    }
    float* home = home_scalars.get<float>(std::max<int64_t>(S1 * k, 1));
    {
      const double c0_ = now_s();
      rail_comm.all_to_all_v(home, b.data(), bd.data(), per, a.data(), ad.data());
      tr.seconds_comm += now_s() - c0_;
    }
    tr.rounds += 2;
    const int32_t* sr1 = slot_rec1.data<int32_t>();
    for (int64_t i = 0; i < N * k; ++i) out[i] = sr1[i] >= 0 ? home[int64_t(sr1[i]) * k + i % k] : 0.0f;
  }
};

// ---------------------------------------------------------------------------------------------------------

EpDispatch::EpDispatch(const Comm& ep_comm, const EpDispatchConfig& cfg) : p_(std::make_unique<Impl>()) {
  const char* op = "ep_dispatch";
  Impl& I = *p_;
  I.comm = ep_comm;
  I.cfg = cfg;
  I.P = ep_comm.size();
  I.me = ep_comm.rank();
  MT_CHECK(cfg.n_experts >= 1, op, "n_experts=", cfg.n_experts, " must be >= 1");
  MT_CHECK(cfg.n_experts % I.P == 0, op, "EP size ", I.P, " must divide n_experts=", cfg.n_experts);
  MT_CHECK(cfg.topk >= 1 && cfg.topk <= cfg.n_experts, op, "topk=", cfg.topk, " outside [1, n_experts=",
           cfg.n_experts, "]");
  MT_CHECK(cfg.hidden >= 1, op, "hidden=", cfg.hidden, " must be >= 1");
  MT_CHECK(cfg.max_tokens >= 0, op, "max_tokens=", cfg.max_tokens, " must be >= 0");
  MT_CHECK(cfg.ranks_per_node >= 0, op, "ranks_per_node=", cfg.ranks_per_node, " must be >= 0");
  MT_CHECK(cfg.combine_payload != EpPayload::E4M3, op, "combine payload must be f32 or bf16 (got e4m3)");
  I.E = cfg.n_experts;
  I.El = cfg.n_experts / I.P;
  MT_CHECK(I.El <= 32767 && cfg.topk <= 32767, op, "too many local experts (", I.El, ") or topk (", cfg.topk, ")");
  I.k = cfg.topk;
  I.D = cfg.hidden;
  I.L = (cfg.ranks_per_node == 0 || cfg.ranks_per_node >= I.P) ? I.P : cfg.ranks_per_node;
  MT_CHECK(I.P % I.L == 0, op, "ranks_per_node=", cfg.ranks_per_node, " must divide the EP size ", I.P);
  I.Nn = I.P / I.L;
  I.node = I.me / I.L;
  I.li = I.me % I.L;
  I.sync_free = cfg.kind == EpDispatcher::SyncFree;
  I.hier = cfg.kind == EpDispatcher::Hierarchical;
  I.direct = cfg.kind == EpDispatcher::AllToAll && cfg.alltoall_direct;
  if (I.sync_free)
    MT_CHECK(cfg.max_tokens > 0, op, "sync_free needs max_tokens > 0 (its buffers are sized at construction)");
  I.nb = (I.D + kFp8Block - 1) / kFp8Block;
  switch (cfg.dispatch_payload) {
    case EpPayload::F32: I.pb = I.D * 4; break;
    case EpPayload::BF16: I.pb = I.D * 2; break;
    case EpPayload::E4M3: I.pb = I.nb * 4 + I.D; break;
  }
  I.rec = 16 + round_up(I.pb, 16);
  I.m1 = round_up(4 + 8 * int64_t(I.k), 16);
  I.rec1 = I.m1 + round_up(I.pb, 16);
  I.cb = cfg.combine_payload == EpPayload::BF16 ? I.D * 2 : I.D * 4;
  const size_t PE = size_t(I.P) * size_t(I.El);
  I.cnt.assign(PE, 0);
  I.rcnt.assign(PE, 0);
  I.off.assign(PE, 0);
  I.grp.assign(PE, 0);
  I.cur.assign(PE, 0);
  I.fpos.assign(PE, 0);
  I.poff.assign(PE, 0);
  I.counts.assign(size_t(I.El), 0);
  I.offsets.assign(size_t(I.El) + 1, 0);
  for (auto* v : {&I.sc, &I.sd, &I.rc, &I.rd, &I.peer_send, &I.peer_recv, &I.blk_start}) v->assign(size_t(I.P), 0);
  if (I.hier) {
    I.node_comm = ep_comm.split(I.node, I.li);
    I.rail_comm = ep_comm.split(I.li, I.node);
    I.cnt1.assign(size_t(I.Nn), 0);
    I.rcnt1.assign(size_t(I.Nn), 0);
    I.cnt2.assign(size_t(I.L), 0);
    I.rcnt2.assign(size_t(I.L), 0);
    I.off2.assign(size_t(I.L), 0);
    I.off1.assign(size_t(I.Nn), 0);
    for (auto& v : I.rs) v.assign(size_t(I.Nn), 0);
    for (auto& v : I.ns) v.assign(size_t(I.L), 0);
    I.c1s.assign(size_t(I.Nn), 0);
    I.c2s.assign(size_t(I.L), 0);
    I.r1start.assign(size_t(I.Nn) + 1, 0);
    I.nodes_.assign(size_t(I.k), 0);
  }
  if (I.sync_free) {
    // Worst case, one line per region (docs/parallel.md):
    const int64_t Nm = cfg.max_tokens, k = I.k, D = I.D, P = I.P;
    I.H = round_up(int64_t(I.El) * 8, 64);              // per-peer header: El int64 counts
    I.cap_rows = Nm * std::min<int64_t>(k, I.El);        // records one peer can send to one rank
    // one peer's region in the receive buffer: header, metadata (8 B a record), payload rows
    I.slot_bytes = I.H + round_up(I.cap_rows * 8, 64) + round_up(I.cap_rows * I.pb, 64);
    const int64_t Rmax = P * I.cap_rows;                 // rows one rank can receive
    I.send1.get(P * (I.H + 128) + Nm * k * (8 + I.pb));  // every (token, slot) once + headers + padding
    I.recv1.get(P * I.slot_bytes);
    I.out_x.get<float>(Rmax * D);
    I.out_src.get<int32_t>(Rmax);
    I.out_tok.get<int32_t>(Rmax);
    I.out_slot.get<int32_t>(Rmax);
    I.out_w.get<float>(Rmax);
    I.wcopy.get<float>(Nm * k);
    I.row_of.get<int32_t>(Nm * k);
    if (cfg.dispatch_payload == EpPayload::BF16) I.hbuf.get<bf16>(Nm * D);
    if (cfg.dispatch_payload == EpPayload::E4M3) {
      I.qbuf.get<uint8_t>(Nm * D);
      I.sbuf.get<float>(Nm * I.nb);
    }
    I.csend.get(Rmax * I.cb);
    I.crecv.get(Nm * k * I.cb);
    if (cfg.combine_payload == EpPayload::BF16) I.cdec.get(I.reduce_slot_bytes() * std::max(1, num_threads()));
    I.vsend.get<float>(Rmax);
    I.vrecv.get<float>(Nm * k);
    for (Buf* b : I.all_bufs()) b->frozen = true;
  }
}

EpDispatch::~EpDispatch() = default;

const EpDispatchConfig& EpDispatch::config() const { return p_->cfg; }
int EpDispatch::ep_size() const { return p_->P; }
int EpDispatch::ep_rank() const { return p_->me; }
int EpDispatch::local_experts() const { return p_->El; }
int EpDispatch::first_expert() const { return p_->me * p_->El; }

int64_t EpDispatch::dispatch(const float* x, const int32_t* topk_idx, const float* topk_w, int64_t N) {
  Impl& I = *p_;
  record_call(I.st.last_dispatch, I.st.dispatch, [&](EpTraffic& tr) {
    I.validate(x, topk_idx, N);
    I.N = -1;
    I.copy_weights(topk_w, N);
    I.encode_tokens(x, N);
    if (I.hier) I.dispatch_hier(x, topk_idx, N, tr);
    else if (I.sync_free) I.dispatch_sync_free(x, topk_idx, N, tr);
    else I.dispatch_alltoall(x, topk_idx, N, tr);
    I.N = N;
    tr.rows_recv = I.R;
  });
  return I.R;
}

int64_t EpDispatch::recv_rows() const { return p_->R; }
const float* EpDispatch::recv_x() const { return p_->out_x.data<float>(); }
const int64_t* EpDispatch::recv_counts() const { return p_->counts.data(); }
const int64_t* EpDispatch::recv_offsets() const { return p_->offsets.data(); }
const int32_t* EpDispatch::recv_src() const { return p_->out_src.data<int32_t>(); }
const int32_t* EpDispatch::recv_token() const { return p_->out_tok.data<int32_t>(); }
const int32_t* EpDispatch::recv_slot() const { return p_->out_slot.data<int32_t>(); }
const float* EpDispatch::recv_weight() const { return p_->out_w.data<float>(); }

void EpDispatch::combine(float* y, const float* yr, bool weighted) {
  Impl& I = *p_;
  const char* op = "ep_combine";
  MT_CHECK(I.N >= 0, op, "combine before any dispatch");
  MT_CHECK(y != nullptr || I.N == 0, op, "null y for N=", I.N);
  MT_CHECK(yr != nullptr || I.R == 0, op, "null expert rows for R=", I.R);
  record_call(I.st.last_combine, I.st.combine, [&](EpTraffic& tr) {
    if (I.hier) I.combine_hier(y, yr, weighted, tr);
    else I.combine_flat(y, yr, weighted, tr);
  });
}

void EpDispatch::redispatch(float* out, const float* x) {
  Impl& I = *p_;
  const char* op = "ep_redispatch";
  MT_CHECK(I.N >= 0, op, "redispatch before any dispatch");
  MT_CHECK(out != nullptr || I.R == 0, op, "null out for R=", I.R);
  MT_CHECK(x != nullptr || I.N == 0, op, "null x for N=", I.N);
  record_call(I.st.last_backward, I.st.backward, [&](EpTraffic& tr) {
    if (I.hier) I.redispatch_hier(out, x, tr);
    else I.redispatch_flat(out, x, tr);
  });
}

void EpDispatch::combine_scalars(float* out, const float* v) {
  Impl& I = *p_;
  const char* op = "ep_combine_scalars";
  MT_CHECK(I.N >= 0, op, "combine_scalars before any dispatch");
  MT_CHECK(out != nullptr || I.N == 0, op, "null out for N=", I.N);
  MT_CHECK(v != nullptr || I.R == 0, op, "null v for R=", I.R);
  record_call(I.st.last_backward, I.st.backward, [&](EpTraffic& tr) {
    if (I.hier) I.scalars_hier(out, v, tr);
    else I.scalars_flat(out, v, tr);
  });
}

EpStats EpDispatch::stats() const { return p_->st; }
void EpDispatch::reset_stats() { p_->st = EpStats{}; }

std::vector<EpBufferTerm> EpDispatch::buffers() const {
  std::vector<EpBufferTerm> out;
  for (Buf* b : p_->all_bufs())
    if (b->bytes > 0) out.push_back({b->name, int64_t(b->bytes)});
  return out;
}

int64_t EpDispatch::buffer_bytes() const {
  int64_t s = 0;
  for (const auto& t : buffers()) s += t.bytes;
  return s;
}

// ---------------------------------------------------------------------------------------------------------
// Node-limited routing.

namespace {
inline bool before(float va, int ia, float vb, int ib) { return va > vb || (va == vb && ia < ib); }

void check_node_args(const char* op, int64_t N, int E, int n_nodes, int max_nodes, int k) {
  MT_CHECK(N >= 0, op, "negative N=", N);
  MT_CHECK(E >= 1 && n_nodes >= 1 && E % n_nodes == 0, op, "n_nodes=", n_nodes, " must divide E=", E);
  MT_CHECK(max_nodes >= 1 && max_nodes <= n_nodes, op, "max_nodes=", max_nodes, " outside [1, n_nodes=", n_nodes,
           "]");
  MT_CHECK(k >= 1 && k <= max_nodes * (E / n_nodes), op, "topk=", k, " cannot be met by ", max_nodes,
           " node(s) of ", E / n_nodes, " experts");
}
}  // namespace

void ep_node_limit_scores(float* q_out, const float* q, int64_t N, int E, int n_nodes, int max_nodes, int k) {
  const char* op = "ep_node_limit_scores";
  check_node_args(op, N, E, n_nodes, max_nodes, k);
  MT_CHECK((q_out && q) || N == 0, op, "null array");
  const int G = E / n_nodes, top = std::max(1, std::min(G, k / max_nodes));
#pragma omp parallel if (int64_t(N) * E >= kParMin)
  {
    std::vector<float> v(static_cast<size_t>(G)), score(static_cast<size_t>(n_nodes));
    std::vector<int> order(static_cast<size_t>(n_nodes));
    std::vector<char> keep(static_cast<size_t>(n_nodes));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* qn = q + n * E;
      for (int b = 0; b < n_nodes; ++b) {
        for (int j = 0; j < G; ++j) v[size_t(j)] = qn[b * G + j];
        std::partial_sort(v.begin(), v.begin() + top, v.end(), std::greater<float>());
        float s = 0;
        for (int j = 0; j < top; ++j) s += v[size_t(j)];
        score[size_t(b)] = s;
        order[size_t(b)] = b;
      }
      std::sort(order.begin(), order.end(),
                [&](int a, int b) { return before(score[size_t(a)], a, score[size_t(b)], b); });
      std::fill(keep.begin(), keep.end(), 0);
      for (int r = 0; r < max_nodes; ++r) keep[size_t(order[size_t(r)])] = 1;
      float* o = q_out + n * E;
      for (int e = 0; e < E; ++e) o[e] = keep[size_t(e / G)] ? qn[e] : -std::numeric_limits<float>::infinity();
    }
  }
}

void ep_node_limited_topk(int32_t* topk_idx, const float* q, int64_t N, int E, int k, int n_nodes, int max_nodes) {
  const char* op = "ep_node_limited_topk";
  check_node_args(op, N, E, n_nodes, max_nodes, k);
  MT_CHECK((topk_idx && q) || N == 0, op, "null array");
  std::vector<float> masked(size_t(N * E));
  ep_node_limit_scores(masked.data(), q, N, E, n_nodes, max_nodes, k);
  std::vector<int> cand(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    const float* m = masked.data() + n * E;
    int c = 0;
    for (int e = 0; e < E; ++e)
      if (m[e] != -std::numeric_limits<float>::infinity()) cand[size_t(c++)] = e;
    std::partial_sort(cand.begin(), cand.begin() + k, cand.begin() + c,
                      [&](int a, int b) { return before(m[a], a, m[b], b); });
    for (int j = 0; j < k; ++j) topk_idx[n * k + j] = cand[size_t(j)];
  }
}

int ep_max_nodes_per_token(const int32_t* topk_idx, int64_t N, int k, int E, int n_nodes) {
  const char* op = "ep_max_nodes_per_token";
  MT_CHECK(E >= 1 && n_nodes >= 1 && E % n_nodes == 0, op, "n_nodes=", n_nodes, " must divide E=", E);
  const int G = E / n_nodes;
  int best = 0;
  std::vector<char> seen(static_cast<size_t>(n_nodes));
  for (int64_t n = 0; n < N; ++n) {
    std::fill(seen.begin(), seen.end(), 0);
    int c = 0;
    for (int j = 0; j < k; ++j) {
      const int32_t e = topk_idx[n * k + j];
      MT_CHECK(e >= -1 && e < E, op, "topk_idx[", n, ",", j, "]=", e, " outside [0, ", E, ") and not -1");
      if (e < 0) continue;
      if (!seen[size_t(e / G)]) {
        seen[size_t(e / G)] = 1;
        ++c;
      }
    }
    best = std::max(best, c);
  }
  return best;
}

void ep_combine_hierarchical_ref(float* y, const float* yp, const int32_t* topk_idx, const float* w, int64_t N,
                                 int k, int64_t D, int E, int n_nodes) {
  const char* op = "ep_combine_hierarchical_ref";
  MT_CHECK(E >= 1 && n_nodes >= 1 && E % n_nodes == 0, op, "n_nodes=", n_nodes, " must divide E=", E);
  const int G = E / n_nodes;
  // Per (token, node) partials through the same kernels as the dispatcher, then the node-order sum.
  std::vector<int32_t> ro(size_t(N * k)), ro1(size_t(N * k), -1);
  std::vector<float> part(size_t(N * k * D)), ptmp(size_t(N * D));
  int64_t np = 0;
  for (int b = 0; b < n_nodes; ++b) {
    bool any = false;
    for (int64_t i = 0; i < N * k; ++i) {
      ro[size_t(i)] = topk_idx[i] >= 0 && topk_idx[i] / G == b ? int32_t(i) : -1;
      any |= ro[size_t(i)] >= 0;
    }
    if (!any) continue;
    if (w) moe_unpermute(ptmp.data(), yp, ro.data(), w, N, k, N * k, D);
    else moe_permute_backward(ptmp.data(), yp, ro.data(), N, k, N * k, D);
    for (int64_t t = 0; t < N; ++t) {
      bool uses = false;
      for (int s = 0; s < k; ++s) uses |= topk_idx[t * k + s] >= 0 && topk_idx[t * k + s] / G == b;
      if (!uses) continue;
      int j = 0;
      while (ro1[size_t(t * k + j)] >= 0) ++j;
      ro1[size_t(t * k + j)] = int32_t(np);
      std::memcpy(part.data() + np * D, ptmp.data() + t * D, size_t(D * 4));
      ++np;
    }
  }
  moe_permute_backward(y, part.data(), ro1.data(), N, k, np, D);
}

}  // namespace moetron
