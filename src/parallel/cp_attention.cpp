// cp_attention.cpp: context parallelism's ring attention (forward, backward) and the load-balanced split of a
// sequence over the cp ranks. See cp_attention.h and docs/parallel.md "Context parallelism: ring attention".
// Not the attention kernel (src/kernels/attention*.cpp, whose key-block masks this calls) and not the model's
// wiring.
#include "moetron/cp_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "moetron/check.h"
#include "moetron/runtime.h"

namespace moetron {

int64_t cp_chunk_begin(int64_t T, int cp, int c) {
  MT_CHECK(T >= 0 && cp >= 1 && c >= 0 && c <= 2 * cp, "cp_chunk_begin", "T=", T, " cp=", cp, " chunk ", c,
           " outside [0, ", 2 * cp, "]");
  return int64_t(c) * T / (2 * int64_t(cp));
}

namespace {

constexpr int kTagKv = 7101;   // K/V blocks around the ring
constexpr int kTagDkv = 7102;  // dK/dV partials travelling with them

// One rank's share of a sequence: chunks r and 2cp-1-r, local rows [off[u], off[u] + len[u]).
struct Share {
  int chunk[2];
  int64_t len[2], off[2], n;
};
Share share(int64_t T, int cp, int r) {
  MT_CHECK(cp >= 1 && r >= 0 && r < cp, "cp_attention", "rank ", r, " outside [0, ", cp, ")");
  Share s;
  s.chunk[0] = r, s.chunk[1] = 2 * cp - 1 - r;
  for (int u = 0; u < 2; ++u) s.len[u] = cp_chunk_begin(T, cp, s.chunk[u] + 1) - cp_chunk_begin(T, cp, s.chunk[u]);
  s.off[0] = 0, s.off[1] = s.len[0], s.n = s.len[0] + s.len[1];
  return s;
}

// How query chunk cq sees key chunk ck: an earlier chunk entirely, its own chunk causally, a later one not.
enum class Sees { None, Full, Causal };
Sees sees(int cq, int ck) { return ck < cq ? Sees::Full : ck == cq ? Sees::Causal : Sees::None; }

// Packed layouts. A K/V block (what travels, and its dK/dV) holds one rank's two chunks:
//   [K chunk 0: B, len0, kw][K chunk 1: B, len1, kw][V chunk 0: B, len0, vw][V chunk 1: B, len1, vw]
// with kw = nhk Dqk (nhk = 1 for a shared k head, head_k = 0, else Hkv), vw likewise. Query-side tensors are
// packed per chunk: q [B, len, Hq Dqk], out / dout [B, len, Hq Dv], lse [B, Hq, len].
struct Pack {
  int64_t B, Hq, Dqk, Dv, nhk, nhv, kw, vw;
  explicit Pack(const AttnDims& d)
      : B(d.B), Hq(d.Hq), Dqk(d.Dqk), Dv(d.Dv), nhk(d.head_k == 0 ? 1 : d.Hkv), nhv(d.head_v == 0 ? 1 : d.Hkv),
        kw(nhk * d.Dqk), vw(nhv * d.Dv) {}
  int64_t block(const Share& s) const { return B * s.n * (kw + vw); }
  float* k(float* blk, const Share& s, int u) const { return blk + B * (u ? s.len[0] : 0) * kw; }
  float* v(float* blk, const Share& s, int u) const { return blk + B * s.n * kw + B * (u ? s.len[0] : 0) * vw; }
  // The kernel's dims for query chunk length Lq against key chunk length Lk.
  AttnDims dims(const AttnDims& d, int64_t Lq, int64_t Lk, Sees m) const {
    AttnDims e = d;
    e.T = Lq, e.Tk = m == Sees::Full ? Lk : 0, e.mask = m == Sees::Full ? AttnMask::Full : AttnMask::Causal;
    e.ldq = Hq * Dqk, e.head_q = Dqk, e.ldo = Hq * Dv, e.head_o = Dv;
    e.ldk = kw, e.head_k = d.head_k == 0 ? 0 : Dqk, e.ldv = vw, e.head_v = d.head_v == 0 ? 0 : Dv;
    return e;
  }
};

// Rows [off, off + len) of each of B sequences of N rows, H heads of D at stride hs, row stride ld, to or from
// a compact [B, len, H D].
void pack_rows(float* dst, const float* src, int64_t B, int64_t N, int64_t off, int64_t len, int64_t ld, int64_t H,
               int64_t hs, int64_t D) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < len; ++t)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(dst + ((b * len + t) * H + h) * D, src + (b * N + off + t) * ld + h * hs, size_t(D) * 4);
}
void unpack_rows(float* dst, const float* src, int64_t B, int64_t N, int64_t off, int64_t len, int64_t ld, int64_t H,
                 int64_t hs, int64_t D) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < len; ++t)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(dst + (b * N + off + t) * ld + h * hs, src + ((b * len + t) * H + h) * D, size_t(D) * 4);
}
// lse columns [off, off + len) of [B, Hq, N] to [B, Hq, len], and back.
void pack_lse(float* chunk, const float* lse, int64_t BH, int64_t N, int64_t off, int64_t len) {
  for (int64_t i = 0; i < BH; ++i) std::memcpy(chunk + i * len, lse + i * N + off, size_t(len) * 4);
}
void unpack_lse(float* lse, const float* chunk, int64_t BH, int64_t N, int64_t off, int64_t len) {
  for (int64_t i = 0; i < BH; ++i) std::memcpy(lse + i * N + off, chunk + i * len, size_t(len) * 4);
}

void add_to(float* acc, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

// Online-softmax merge of a partial (Ob, Lb) into the running (Oa, La) of one query chunk [B, len, Hq Dv]:
//   L = log(e^La + e^Lb),  Oa = e^(La - L) Oa + e^(Lb - L) Ob   (weights in fp64, rows in fp32).
void merge(float* Oa, float* La, const float* Ob, const float* Lb, int64_t B, int64_t Hq, int64_t len, int64_t Dv) {
#pragma omp parallel for schedule(static) num_threads(num_threads())
  for (int64_t i = 0; i < B * Hq * len; ++i) {
    const int64_t b = i / (Hq * len), h = (i / len) % Hq, t = i % len;
    const double a = La[i], c = Lb[i];
    const double L = std::max(a, c) + std::log1p(std::exp(-std::fabs(a - c)));
    const float wa = float(std::exp(a - L)), wc = float(std::exp(c - L));
    float* o = Oa + ((b * len + t) * Hq + h) * Dv;
    const float* p = Ob + ((b * len + t) * Hq + h) * Dv;
    for (int64_t e = 0; e < Dv; ++e) o[e] = wa * o[e] + wc * p[e];
    La[i] = float(L);
  }
}

void check_args(const AttnDims& d, int64_t seq_len, const Comm& cp, const char* op) {
  attention_check(d, op);
  MT_CHECK(d.Tk == 0 && d.causal(), op, "d describes the local rows of causal attention: Tk=", d.Tk,
           " must be 0 and the mask Causal");
  MT_CHECK(seq_len >= 0, op, "seq_len=", seq_len);
  const int64_t n = cp_local_rows(seq_len, cp.size(), cp.rank());
  MT_CHECK(d.T == n, op, "d.T=", d.T, " but CP rank ", cp.rank(), " of ", cp.size(), " holds ", n,
           " rows of a sequence of ", seq_len, " (cp_local_rows)");
}

// The ring's neighbours and the block held at step s: rank (r - s) mod cp's.
struct Ring {
  int P, r, next, prev;
  explicit Ring(const Comm& c) : P(c.size()), r(c.rank()), next((r + 1) % P), prev((r + P - 1) % P) {}
  int held(int s) const { return ((r - s) % P + P) % P; }
};

// Step s of a ring over the K/V blocks kv[2] (held: kv[s % 2]): posts the receive of the next block from prev into
// kv[(s + 1) % 2] and the send of the held one to next, before the step computes on it (the transfer overlaps the
// compute). Nothing at the last step (reqs stay empty).
void post_next_kv(CommRequest reqs[2], const Comm& cp, const Ring& ring, const Pack& pk, std::vector<float> kv[2],
                  int s, int64_t seq_len) {
  if (s + 1 >= ring.P) return;
  const Share held = share(seq_len, ring.P, ring.held(s)), nxt = share(seq_len, ring.P, ring.held(s + 1));
  reqs[0] = cp.irecv(kv[(s + 1) % 2].data(), pk.block(nxt) * 4, ring.prev, kTagKv);
  reqs[1] = cp.isend(kv[s % 2].data(), pk.block(held) * 4, ring.next, kTagKv);
}

}  // namespace

int64_t cp_local_rows(int64_t T, int cp, int rank) { return share(T, cp, rank).n; }

std::vector<int64_t> cp_positions(int64_t T, int cp, int rank) {
  const Share s = share(T, cp, rank);
  std::vector<int64_t> pos;
  pos.reserve(size_t(s.n));
  for (int u = 0; u < 2; ++u)
    for (int64_t t = 0; t < s.len[u]; ++t) pos.push_back(cp_chunk_begin(T, cp, s.chunk[u]) + t);
  return pos;
}

void cp_take_rows(void* local, const void* full, int64_t B, int64_t T, int64_t row_bytes, int cp, int rank) {
  const std::vector<int64_t> pos = cp_positions(T, cp, rank);
  const int64_t n = int64_t(pos.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(static_cast<char*>(local) + (b * n + i) * row_bytes,
                  static_cast<const char*>(full) + (b * T + pos[size_t(i)]) * row_bytes, size_t(row_bytes));
}

void cp_put_rows(void* full, const void* local, int64_t B, int64_t T, int64_t row_bytes, int cp, int rank) {
  const std::vector<int64_t> pos = cp_positions(T, cp, rank);
  const int64_t n = int64_t(pos.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(static_cast<char*>(full) + (b * T + pos[size_t(i)]) * row_bytes,
                  static_cast<const char*>(local) + (b * n + i) * row_bytes, size_t(row_bytes));
}

void cp_attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, const AttnDims& d,
                          int64_t seq_len, const Comm& cp) {
  check_args(d, seq_len, cp, "cp_attention_forward");
  const Ring ring(cp);
  const Share me = share(seq_len, ring.P, ring.r);
  const Pack pk(d);
  const int64_t B = d.B, Hq = d.Hq, Lmax = std::max(me.len[0], me.len[1]);
  int64_t block_max = 0;
  for (int j = 0; j < ring.P; ++j) block_max = std::max(block_max, pk.block(share(seq_len, ring.P, j)));
  std::vector<float> kv[2] = {std::vector<float>(size_t(block_max)), std::vector<float>(size_t(block_max))};
  std::vector<float> qc[2], oc[2], lc[2], opart(size_t(B * Lmax * Hq * d.Dv)), lpart(size_t(B * Hq * Lmax));
  bool have[2] = {false, false};
  for (int u = 0; u < 2; ++u) {
    qc[u].resize(size_t(B * me.len[u] * Hq * d.Dqk));
    oc[u].resize(size_t(B * me.len[u] * Hq * d.Dv));
    lc[u].resize(size_t(B * Hq * me.len[u]));
    pack_rows(qc[u].data(), q, B, me.n, me.off[u], me.len[u], d.ldq, Hq, d.head_q, d.Dqk);
    pack_rows(pk.k(kv[0].data(), me, u), k, B, me.n, me.off[u], me.len[u], d.ldk, pk.nhk, d.head_k, d.Dqk);
    pack_rows(pk.v(kv[0].data(), me, u), v, B, me.n, me.off[u], me.len[u], d.ldv, pk.nhv, d.head_v, d.Dv);
  }
  for (int s = 0; s < ring.P; ++s) {
    const Share held = share(seq_len, ring.P, ring.held(s));
    float* blk = kv[s % 2].data();
    CommRequest reqs[2];
    post_next_kv(reqs, cp, ring, pk, kv, s, seq_len);
    for (int u = 0; u < 2; ++u)
      for (int w = 0; w < 2; ++w) {
        const Sees m = sees(me.chunk[u], held.chunk[w]);
        if (m == Sees::None || me.len[u] == 0 || held.len[w] == 0) continue;
        const AttnDims e = pk.dims(d, me.len[u], held.len[w], m);
        float* o = have[u] ? opart.data() : oc[u].data();
        float* l = have[u] ? lpart.data() : lc[u].data();
        attention_forward(o, l, qc[u].data(), pk.k(blk, held, w), pk.v(blk, held, w), e);
        if (have[u]) merge(oc[u].data(), lc[u].data(), o, l, B, Hq, me.len[u], d.Dv);
        have[u] = true;
      }
    if (s + 1 < ring.P) cp.wait_all(reqs, 2);
  }
  for (int u = 0; u < 2; ++u) {
    unpack_rows(out, oc[u].data(), B, me.n, me.off[u], me.len[u], d.ldo, Hq, d.head_o, d.Dv);
    unpack_lse(lse, lc[u].data(), B * Hq, me.n, me.off[u], me.len[u]);
  }
}

void cp_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                           const float* q, const float* k, const float* v, const AttnDims& d, int64_t seq_len,
                           const Comm& cp) {
  check_args(d, seq_len, cp, "cp_attention_backward");
  const Ring ring(cp);
  const Share me = share(seq_len, ring.P, ring.r);
  const Pack pk(d);
  const int64_t B = d.B, Hq = d.Hq, Lmax = std::max(me.len[0], me.len[1]);
  int64_t block_max = 0, lk_max = 0;
  for (int j = 0; j < ring.P; ++j) {
    const Share sj = share(seq_len, ring.P, j);
    block_max = std::max(block_max, pk.block(sj));
    lk_max = std::max({lk_max, sj.len[0], sj.len[1]});
  }
  auto buf = [](int64_t n) { return std::vector<float>(size_t(n)); };
  std::vector<float> kv[2] = {buf(block_max), buf(block_max)}, dkv[2] = {buf(block_max), buf(block_max)};
  std::vector<float> mine = buf(block_max), dq_part = buf(B * Lmax * Hq * d.Dqk), dk_part = buf(B * lk_max * pk.kw),
                     dv_part = buf(B * lk_max * pk.vw);
  std::vector<float> qc[2], doc[2], oc[2], lc[2], dqc[2];
  for (int u = 0; u < 2; ++u) {
    const int64_t L = me.len[u];
    qc[u] = buf(B * L * Hq * d.Dqk), dqc[u] = buf(B * L * Hq * d.Dqk);
    doc[u] = buf(B * L * Hq * d.Dv), oc[u] = buf(B * L * Hq * d.Dv), lc[u] = buf(B * Hq * L);
    pack_rows(qc[u].data(), q, B, me.n, me.off[u], L, d.ldq, Hq, d.head_q, d.Dqk);
    pack_rows(doc[u].data(), dout, B, me.n, me.off[u], L, d.ldo, Hq, d.head_o, d.Dv);
    pack_rows(oc[u].data(), out, B, me.n, me.off[u], L, d.ldo, Hq, d.head_o, d.Dv);
    pack_lse(lc[u].data(), lse, B * Hq, me.n, me.off[u], L);
    pack_rows(pk.k(kv[0].data(), me, u), k, B, me.n, me.off[u], L, d.ldk, pk.nhk, d.head_k, d.Dqk);
    pack_rows(pk.v(kv[0].data(), me, u), v, B, me.n, me.off[u], L, d.ldv, pk.nhv, d.head_v, d.Dv);
  }
  CommRequest dkv_recv, dkv_send;
  for (int s = 0; s < ring.P; ++s) {
    const Share held = share(seq_len, ring.P, ring.held(s));
    float* blk = kv[s % 2].data();
    CommRequest reqs[2];
    post_next_kv(reqs, cp, ring, pk, kv, s, seq_len);
    // This rank's contributions to the held block's dK/dV (into `mine`) and to its own dQ, in a fixed order.
    std::fill(mine.begin(), mine.begin() + pk.block(held), 0.0f);
    for (int u = 0; u < 2; ++u)
      for (int w = 0; w < 2; ++w) {
        const Sees m = sees(me.chunk[u], held.chunk[w]);
        if (m == Sees::None || me.len[u] == 0 || held.len[w] == 0) continue;
        const AttnDims e = pk.dims(d, me.len[u], held.len[w], m);
        attention_backward(dq_part.data(), dk_part.data(), dv_part.data(), doc[u].data(), oc[u].data(), lc[u].data(),
                           qc[u].data(), pk.k(blk, held, w), pk.v(blk, held, w), e);
        add_to(dqc[u].data(), dq_part.data(), B * me.len[u] * Hq * d.Dqk);
        add_to(pk.k(mine.data(), held, w), dk_part.data(), B * held.len[w] * pk.kw);
        add_to(pk.v(mine.data(), held, w), dv_part.data(), B * held.len[w] * pk.vw);
      }
    // The travelling dK/dV of the held block: the sum over ranks held(s), held(s)+1, ..., in ring order.
    float* acc = dkv[s % 2].data();
    if (s == 0) std::copy(mine.begin(), mine.begin() + pk.block(held), acc);
    else {
      cp.wait(dkv_recv);
      add_to(acc, mine.data(), pk.block(held));
    }
    if (ring.P > 1) {
      if (dkv_send.pending()) cp.wait(dkv_send);  // its buffer receives next
      const Share from = share(seq_len, ring.P, ring.held(s + 1));  // what the previous rank held at step s
      dkv_recv = cp.irecv(dkv[(s + 1) % 2].data(), pk.block(from) * 4, ring.prev, kTagDkv);
      dkv_send = cp.isend(acc, pk.block(held) * 4, ring.next, kTagDkv);
    }
    if (s + 1 < ring.P) cp.wait_all(reqs, 2);
  }
  // After cp steps every block's dK/dV has visited every rank; the last hop brought this rank its own.
  float* fin = dkv[0].data();
  if (ring.P > 1) {
    cp.wait(dkv_recv);
    cp.wait(dkv_send);
    fin = dkv[ring.P % 2].data();
  }
  for (int u = 0; u < 2; ++u) {
    unpack_rows(dq, dqc[u].data(), B, me.n, me.off[u], me.len[u], d.ldq, Hq, d.head_q, d.Dqk);
    unpack_rows(dk, pk.k(fin, me, u), B, me.n, me.off[u], me.len[u], d.ldk, pk.nhk, d.head_k, d.Dqk);
    unpack_rows(dv, pk.v(fin, me, u), B, me.n, me.off[u], me.len[u], d.ldv, pk.nhv, d.head_v, d.Dv);
  }
}

}  // namespace moetron
