// dispatch_hier.cpp: the hierarchical (DeepEP-style) dispatcher. EP ranks sit in nodes of L consecutive ranks.
// Stage 1 (inter-node, over the "rail" of ranks with the same local index): a token bound for experts on a
// node crosses once, to the rank with its own local index there (the forwarder). Stage 2 (intra-node): the
// forwarder fans the token out to the (slot) rows of the experts on its node, as 16-byte-header records that
// unpack() scatters into the grouped outputs. The combine runs backwards: the expert rank sends row g of its
// staging (receive) order back to its forwarder, which reduces the rows of its node (weighted, slot order),
// and one partial row per (token, node) crosses back to the home rank, which sums them in node order.
// Not the flat dispatchers (dispatch_flat.h) and not the reference of the combine order
// (ep_combine_hierarchical_ref, node_routing.cpp).
#include <algorithm>
#include <cstring>

#include "ep/dispatcher.h"

namespace moetron::ep {
namespace {

// Header of a stage-2 record, the form in which a row arrives at its expert rank.
struct RecMeta {
  int32_t token;
  int32_t src;
  int16_t slot;
  int16_t le;  // local expert on the receiving rank
  float w;
};
static_assert(sizeof(RecMeta) == 16);

class HierDispatcher final : public EpDispatch::Impl {
 public:
  HierDispatcher(const Comm& ep_comm, const EpDispatchConfig& cfg);

  void dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) override;
  void combine(float* y, const float* yr, bool weighted, EpTraffic& tr) override;
  void redispatch(float* out, const float* x, EpTraffic& tr) override;
  void combine_scalars(float* out, const float* v, EpTraffic& tr) override;
  std::vector<Buf*> all_bufs() override {
    return {&wcopy,        &row_of,    &hbuf,  &qbuf,  &sbuf,        &send1,       &recv1,    &send2,
            &recv2,        &row_of2,   &w2,    &out_x, &out_src,     &out_tok,     &out_slot, &out_w,
            &pos_of_stage, &rec_ptr,   &csend, &crecv, &cdec,        &partial,     &psend,    &precv,
            &pdec,         &slot_rec1, &vsend, &vrecv, &fwd_scalars, &home_scalars};
  }

 private:
  Comm node_comm, rail_comm;
  // rec: bytes of a stage-2 record (RecMeta + payload); m1: of a stage-1 record's metadata; rec1: of a
  // stage-1 record.
  int64_t rec = 0, m1 = 0, rec1 = 0;
  Buf send2{"dispatch.send_stage2"}, recv2{"dispatch.recv_stage2"};
  Buf row_of2{"forward.row_of [M1,k] i32"}, w2{"forward.weights [M1,k] f32"};
  std::vector<int64_t> cnt1, rcnt1, cnt2, rcnt2, off1, off2;
  // Per-call scratch, sized once: [Nn] x 4 (rail counts / displacements), [L] x 4 (node), cursors.
  std::vector<int64_t> rs[4], ns[4], c1s, c2s, r1start;
  std::vector<int> nodes_;
  Buf fwd_scalars{"backward.forward_scalars [M1,k] f32"}, home_scalars{"backward.home_scalars [S1,k] f32"};
  Buf slot_rec1{"home.slot_record [N,k] i32"};  // stage-1 record that carries slot (t, s)
  int64_t M1 = 0, S2 = 0;                       // stage-1 records received, stage-2 records sent

  // Expert side: the staging (receive) order of the stage-2 records and where each row went.
  Buf pos_of_stage{"expert.pos_of_stage [R] i64"}, rec_ptr{"expert.record_ptr [R]"};
  std::vector<int64_t> grp, cur;  // [El*P] rows per (local expert, source), cursors
  struct Block {
    const char* base;
    int64_t n;
  };
  std::vector<Block> blocks;  // staging blocks in arrival order (one per sender)

  // Combine.
  Buf partial{"combine.partial [M1,D] f32"}, psend{"combine.partial_send"}, precv{"combine.partial_recv"},
      pdec{"combine.partial_recv_f32"};

  int token_nodes(const int32_t* idx, int64_t t);  // the nodes of t's kept slots, ascending, into nodes_
  void plan_stage1(const int32_t* idx, int64_t n);
  char* pack_stage1(const float* x, const int32_t* idx, int64_t n);
  const char* exchange_stage1(const char* sb, EpTraffic& tr);
  void plan_stage2(const char* rb, const char* op);
  char* pack_stage2(const char* rb);
  void exchange_stage2(const char* sb2, EpTraffic& tr);
  void unpack(const char* op);
  char* pack_combine_send(const float* yr);
  void decode_staged(float* out, const char* staged) const;
};

HierDispatcher::HierDispatcher(const Comm& ep_comm, const EpDispatchConfig& cfg) : EpDispatch::Impl(ep_comm, cfg) {
  rec = 16 + round_up(pb, 16);
  m1 = round_up(4 + 8 * int64_t(k), 16);
  rec1 = m1 + round_up(pb, 16);
  const size_t PE = size_t(P) * size_t(El);
  grp.assign(PE, 0);
  cur.assign(PE, 0);
  node_comm = ep_comm.split(node, li);
  rail_comm = ep_comm.split(li, node);
  for (auto* v : {&cnt1, &rcnt1, &off1, &c1s}) v->assign(size_t(Nn), 0);
  for (auto* v : {&cnt2, &rcnt2, &off2, &c2s}) v->assign(size_t(L), 0);
  for (auto& v : rs) v.assign(size_t(Nn), 0);
  for (auto& v : ns) v.assign(size_t(L), 0);
  r1start.assign(size_t(Nn) + 1, 0);
  nodes_.assign(size_t(k), 0);
}

// ---- dispatch ----------------------------------------------------------------------------------------------

void HierDispatcher::dispatch(const float* x, const int32_t* idx, int64_t n, EpTraffic& tr) {
  const char* op = "ep_dispatch.hierarchical";
  plan_stage1(idx, n);
  char* sb = pack_stage1(x, idx, n);
  const char* rb = exchange_stage1(sb, tr);
  plan_stage2(rb, op);
  char* sb2 = pack_stage2(rb);
  exchange_stage2(sb2, tr);
  unpack(op);
}

int HierDispatcher::token_nodes(const int32_t* idx, int64_t t) {
  std::vector<int>& nodes = nodes_;
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
}

// Stage-1 plan: (token, node) records, node-major then token order. row_of[t, j] = the record of t's j-th node
// (-1 past the last); slot_rec1[t, s] = the record that carries slot s (-1: dropped).
void HierDispatcher::plan_stage1(const int32_t* idx, int64_t n) {
  std::fill(cnt1.begin(), cnt1.end(), 0);
  int32_t* ro1 = row_of.get<int32_t>(std::max<int64_t>(n * k, 1));
  const std::vector<int>& nodes = nodes_;
  for (int64_t t = 0; t < n; ++t) {
    const int m = token_nodes(idx, t);
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
    const int m = token_nodes(idx, t);
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
}

// Stage-1 record: [int32 token][int32 expert[k] (-1: not on this node)][float w[k]] padded to m1, payload.
char* HierDispatcher::pack_stage1(const float* x, const int32_t* idx, int64_t n) {
  const int32_t* ro1 = row_of.data<int32_t>();
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
  return sb;
}

// Count round and exchange on the rail (same local index on every node). Returns the received records.
const char* HierDispatcher::exchange_stage1(const char* sb, EpTraffic& tr) {
  timed_comm(tr, [&] { rail_comm.all_to_all(rcnt1.data(), cnt1.data(), 8); });
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
  timed_comm(tr, [&] { rail_comm.all_to_all_v(rb, r1c.data(), r1d.data(), sb, s1c.data(), s1d.data()); });
  tr.rounds += 1;
  tr.rows_sent += S1;
  return rb;
}

// Forwarder: the stage-2 plan over the node, (source node, token, slot) order per destination. row_of2[r, s] =
// the stage-2 record of slot s of stage-1 record r (-1: not on this node), w2 its weight.
void HierDispatcher::plan_stage2(const char* rb, const char* op) {
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
  int64_t acc = 0;
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
}

// Forwarder: one stage-2 record (RecMeta + the stage-1 payload) per kept slot on this node.
char* HierDispatcher::pack_stage2(const char* rb) {
  // Source node of each stage-1 record (records arrive grouped by rail peer = source node).
  r1start[0] = 0;
  for (int b = 0; b < Nn; ++b) r1start[size_t(b) + 1] = r1start[size_t(b)] + rcnt1[size_t(b)];
  const int32_t* ro2 = row_of2.data<int32_t>();
  const float* w2p = w2.data<float>();
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
  return sb2;
}

// Count round and exchange over the node; the received records become one staging block per sender.
void HierDispatcher::exchange_stage2(const char* sb2, EpTraffic& tr) {
  timed_comm(tr, [&] { node_comm.all_to_all(rcnt2.data(), cnt2.data(), 8); });
  tr.rounds += 1;
  auto& s2c = ns[0];
  auto& s2d = ns[1];
  auto& r2c = ns[2];
  auto& r2d = ns[3];
  int64_t rbytes = 0;
  for (int j = 0; j < L; ++j) {
    s2c[size_t(j)] = cnt2[size_t(j)] * rec;
    s2d[size_t(j)] = off2[size_t(j)] * rec;
    r2c[size_t(j)] = rcnt2[size_t(j)] * rec;
    r2d[size_t(j)] = rbytes;
    rbytes += r2c[size_t(j)];
    classify(tr, node * L + j, 8 + s2c[size_t(j)]);
  }
  char* rb2 = recv2.get(std::max<int64_t>(rbytes, 1));
  timed_comm(tr, [&] { node_comm.all_to_all_v(rb2, r2c.data(), r2d.data(), sb2, s2c.data(), s2d.data()); });
  tr.rounds += 1;
  tr.rows_sent += S2;
  blocks.clear();
  for (int j = 0; j < L; ++j) blocks.push_back({rb2 + r2d[size_t(j)], rcnt2[size_t(j)]});
}

// Counting scatter of the staged records into the grouped outputs. Records carry RecMeta.
void HierDispatcher::unpack(const char* op) {
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
  char* ox = open_rows(R);
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
    put_rows(ox, p, ptr[i] + 16, 1);
  }
}

// ---- combine -----------------------------------------------------------------------------------------------

// Expert side of every combine: rows of yr in staging order, encoded, into csend.
char* HierDispatcher::pack_combine_send(const float* yr) {
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

void HierDispatcher::combine(float* y, const float* yr, bool weighted, EpTraffic& tr) {
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
  timed_comm(tr, [&] { node_comm.all_to_all_v(in2, r2c.data(), r2d.data(), out, s2c.data(), s2d.data()); });
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
  timed_comm(tr, [&] { rail_comm.all_to_all_v(in1, r1c.data(), r1d.data(), pout, s1c.data(), s1d.data()); });
  tr.rounds += 1;
  tr.rows_sent += M1;
  tr.rows_recv += S1;
  // Home: sum the partials of each token in node order (row_of holds them node-ascending).
  reduce_rows(y, pdec, in1, row_of.data<int32_t>(), nullptr, N, S1);
}

// ---- backward helpers: the layout of the last dispatch, run again with other rows (no count round) --------
// Row bytes are cb (the combine payload): gradients travel like combine rows.

void HierDispatcher::decode_staged(float* out, const char* staged) const {
  const int64_t* pos = pos_of_stage.data<int64_t>();
#pragma omp parallel for schedule(static) if (R * D >= kParMin)
  for (int64_t g = 0; g < R; ++g) {
    if (cfg.combine_payload == EpPayload::F32) std::memcpy(out + pos[g] * D, staged + g * cb, size_t(D * 4));
    else from_wire_bf16(out + pos[g] * D, reinterpret_cast<const bf16*>(staged + g * cb), D);
  }
}

void HierDispatcher::redispatch(float* out, const float* x, EpTraffic& tr) {
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
  timed_comm(tr, [&] { rail_comm.all_to_all_v(f1, b.data(), bd.data(), s1, a.data(), ad.data()); });
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
  timed_comm(tr, [&] { node_comm.all_to_all_v(in, e.data(), ed.data(), s2, c.data(), cd.data()); });
  tr.rounds += 2;
  tr.rows_sent += S1 + S2;
  tr.rows_recv += R;
  decode_staged(out, in);
}

void HierDispatcher::combine_scalars(float* out, const float* v, EpTraffic& tr) {
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
  timed_comm(tr, [&] { node_comm.all_to_all_v(f2, e.data(), ed.data(), sv, c.data(), cd.data()); });
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
  timed_comm(tr, [&] { rail_comm.all_to_all_v(home, b.data(), bd.data(), per, a.data(), ad.data()); });
  tr.rounds += 2;
  const int32_t* sr1 = slot_rec1.data<int32_t>();
  for (int64_t i = 0; i < N * k; ++i) out[i] = sr1[i] >= 0 ? home[int64_t(sr1[i]) * k + i % k] : 0.0f;
}

}  // namespace

std::unique_ptr<EpDispatch::Impl> make_hierarchical(const Comm& ep_comm, const EpDispatchConfig& cfg) {
  return std::make_unique<HierDispatcher>(ep_comm, cfg);
}

}  // namespace moetron::ep
