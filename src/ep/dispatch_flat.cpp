// dispatch_flat.cpp: the flat layout shared by alltoall and sync_free (dispatch_flat.h): plans, messages, the
// two ways rows cross in that layout (one round per local expert, or one staged round), and the combine and
// backward helpers, which reuse the layout of the last dispatch (no count round).
// Not the dispatch exchange of either dispatcher (dispatch_alltoall.cpp, dispatch_sync_free.cpp).
#include "ep/dispatch_flat.h"

#include <algorithm>

namespace moetron::ep {

FlatDispatcher::FlatDispatcher(const Comm& ep_comm, const EpDispatchConfig& cfg, bool direct)
    : EpDispatch::Impl(ep_comm, cfg), direct(direct) {
  const size_t PE = size_t(P) * size_t(El);
  for (auto* v : {&cnt, &rcnt, &off, &cur, &fpos, &poff}) v->assign(PE, 0);
  for (auto* v : {&sc, &sd, &rc, &rd, &peer_send, &peer_recv, &blk_start}) v->assign(size_t(P), 0);
  // shm: reserve for max_tokens tokens and, as rows in, sync_free's worst case (it never grows) or alltoall's
  // average (it grows beyond on demand)
  if (cfg.transport == EpTransport::Shm) {
    const int64_t Nm = cfg.max_tokens, rows_in = cfg.kind == EpDispatcher::SyncFree ? P * Nm * std::min(k, El) : Nm * k;
    shm_open(Nm > 0 ? shm_need(Nm, Nm * k, rows_in) : 64);
  }
}

std::vector<Buf*> FlatDispatcher::all_bufs() {
  std::vector<Buf*> v{&wcopy,   &row_of,   &hbuf,  &qbuf,  &sbuf,  &send1, &recv1, &out_x, &out_src,
                      &out_tok, &out_slot, &out_w, &csend, &crecv, &cdec,  &vsend, &vrecv};
  for (Buf* b : extra_bufs()) v.push_back(b);
  return v;
}

int64_t FlatDispatcher::peer_major(const std::vector<int64_t>& c, std::vector<int64_t>& start,
                                   std::vector<int64_t>& per_peer) const {
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

void FlatDispatcher::plan_send(const int32_t* idx, int64_t n) {
  std::fill(cnt.begin(), cnt.end(), 0);
  for (int64_t i = 0; i < n * k; ++i)
    if (idx[i] >= 0) ++cnt[size_t(idx[i])];  // expert e = q*El + le: block order already; -1: dropped
  S1 = peer_major(cnt, off, peer_send);  // records sent (kept slots)
  int32_t* ro = row_of.get<int32_t>(std::max<int64_t>(n * k, 1));
  std::copy(off.begin(), off.end(), cur.begin());
  for (int64_t i = 0; i < n * k; ++i) ro[i] = idx[i] >= 0 ? int32_t(cur[size_t(idx[i])]++) : -1;
}

void FlatDispatcher::plan_recv() {
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

void FlatDispatcher::alloc_maps() {
  const int64_t Rm = std::max<int64_t>(R, 1);
  out_src.get<int32_t>(Rm);
  out_tok.get<int32_t>(Rm);
  out_slot.get<int32_t>(Rm);
  out_w.get<float>(Rm);
}

char* FlatDispatcher::alloc_outputs() {
  alloc_maps();
  return open_rows(R);
}

bool FlatDispatcher::scatter_meta(int64_t b, const char* mb) {
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

char* FlatDispatcher::pack_messages(const float* x, const int32_t* idx, int64_t n, int64_t hdr) {
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
      idx, x, n, [&](int64_t j, int q) { return sb + blk_start[size_t(q)] + (j - off[size_t(q) * El]) * pb; },
      [&](int64_t j, int q) { return sb + sd[size_t(q)] + hdr + (j - off[size_t(q) * El]) * 8; });
  return sb;
}

void FlatDispatcher::direct_rounds(char* dst, const char* src, int64_t rb, bool to_experts, EpTraffic& tr) {
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
    timed_comm(tr, [&] { comm.all_to_all_v(dst, rc.data(), rd.data(), src, sc.data(), sd.data()); });
    tr.rounds += 1;
  }
}

void FlatDispatcher::staged_round(char* dst, const char* src, int64_t rb, bool to_experts, EpTraffic& tr,
                                  bool skip_self) {
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
  timed_comm(tr, [&] { comm.all_to_all_v(dst, rc.data(), rd.data(), src, sc.data(), sd.data()); });
  tr.rounds += 1;
}

void FlatDispatcher::to_home(char* in, const float* v, int64_t w, bool bf, bool direct_rows, Buf& scratch,
                             EpTraffic& tr) {
  const int64_t rb = w * (bf ? 2 : 4);
  if (direct_rows) {
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

void FlatDispatcher::to_experts(float* out, const char* send, int64_t w, bool bf, bool direct_rows, Buf& scratch,
                                EpTraffic& tr) {
  const int64_t rb = w * (bf ? 2 : 4);
  if (direct_rows) {
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

void FlatDispatcher::combine(float* y, const float* yr, bool weighted, EpTraffic& tr) {
  if (shm()) return shm_combine(y, yr, weighted, tr);
  char* in = crecv.get(std::max<int64_t>(S1 * cb, 1));
  const bool bf = cfg.combine_payload == EpPayload::BF16;  // bf16: the encode touches every row anyway
  to_home(in, yr, D, bf, direct && !bf, csend, tr);
  tr.rows_sent += R;
  tr.rows_recv += S1;
  reduce_rows(y, cdec, in, row_of.data<int32_t>(), weighted ? wcopy.data<float>() : nullptr, N, S1);
}

void FlatDispatcher::redispatch(float* out, const float* x, EpTraffic& tr) {
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

void FlatDispatcher::combine_scalars(float* out, const float* v, EpTraffic& tr) {
  float* rv = vrecv.get<float>(std::max<int64_t>(S1, 1));
  to_home(reinterpret_cast<char*>(rv), v, 1, false, false, vsend, tr);
  const int32_t* ro = row_of.data<int32_t>();
  for (int64_t i = 0; i < N * k; ++i) out[i] = ro[i] >= 0 ? rv[ro[i]] : 0.0f;
}

}  // namespace moetron::ep
