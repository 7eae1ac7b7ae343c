// ep_dispatch.h: expert-parallel dispatch and combine over an EP communicator. Each rank holds N tokens,
// the router's top-k expert ids and weights for each; the E routed experts are sharded contiguously over the
// P ranks of the EP group (El = E / P per rank: rank q owns experts q*El .. q*El+El-1). dispatch sends each
// (token, slot) row to the rank owning its expert; combine brings the expert outputs back and sums them on
// the token's home rank. Also a router-side helper for node-limited routing.
// Not the router, not the expert GEMMs, not the in-process permute (permute.h), not the trainer wiring.
//
// Three dispatchers (EpDispatcher in job_enums.h); all give the SAME received rows in the same order:
//   alltoall      count round (all_to_all of El counts per peer), then one all_to_all_v of the records (a
//                 message per peer: metadata, then payload rows), copied / decoded block by block into
//                 place. alltoall_direct (fp32 or landed rows): the rows land in place instead, one all_to_all_v per
//                 local expert (no unpack / combine pack copy; El + 2 rounds instead of 2).
//   sync_free     one exchange, no count round: every peer slot is a fixed worst-case region
//                 (header with the El counts + capacity max_tokens * min(k, El) records) and all buffers are
//                 allocated once, at construction; nothing is allocated per call. Only the real bytes cross
//                 the wire (Comm::exchange). Extra memory: see buffers().
//   hierarchical  DeepEP-style, ranks in nodes of ranks_per_node consecutive EP ranks (L per node, P / L
//                 nodes). Stage 1 (inter-node, "rail" ranks with the same local index): a token bound for
//                 experts on a node crosses ONCE to the rank with its own local index on that node (its own
//                 node included: then the "forwarder" is the rank itself). Stage 2 (intra-node): the
//                 forwarder fans the token out to the (slot) rows of the experts on its node. Combine runs
//                 backwards: the forwarder reduces the rows of its node first (weighted, slot order), and one
//                 partial row per (token, node) crosses back.
//
// Received rows (recv_x and the metadata arrays, R rows): grouped by local expert (recv_offsets), and in
// each group ordered by (source rank, token, slot). This is the input of the grouped GEMM.
//
// Combine and its order (what the equivalence tests state):
//   flat (alltoall, sync_free): y[t] = moe_unpermute(rows of t, w[t]) exactly as the single-process MoE does:
//     slot order, from 0, on the token's home rank; so it is BITWISE the single-process result for fp32.
//   hierarchical: y[t] = sum over the nodes b that t uses, in increasing b, of partial_b[t], where
//     partial_b[t] = moe_unpermute over the slots of t whose expert is on node b (slot order, from 0);
//     the outer sum is moe_permute_backward's (from 0, node order). With fp32 combine rows and all of a token's
//     experts on one node this equals the flat result bitwise; otherwise it is a different association (see
//     ep_combine_hierarchical_ref for the reference and docs/parallel.md for the tolerance).
//   weighted = false gives the unweighted sum (moe_permute_backward): the backward of dispatch.
//
// Payload. Dispatch rows cross as F32, BF16 or E4M3 (1 x 128 block scales per token row, quantized once per
// token on the home rank, decoded to fp32 on the expert rank); combine rows as F32 or BF16 (hierarchical with
// BF16 rounds twice: the expert rows, then the forwarder's partial sum). Flat records carry 8 bytes of
// metadata (token * k + slot, weight) apart from the payload row, so payload rows are contiguous; the
// source rank and local expert follow from where the row arrives. Hierarchical stage-2 records carry a
// 16-byte header (token, source rank, slot, local expert, weight), stage-1 records (token, k expert ids,
// k weights).
//
// All calls are collective over the EP communicator. topk_idx entries must be in [0, E) or -1, and the
// non-negative ones distinct within a token (the router guarantees it; sync_free's capacity bound relies on
// it). N may differ between ranks and may be 0; experts may receive nothing.
//
// Dropped slots (capacity_factor > 0: the home rank drops some (token, slot) pairs before dispatch):
// topk_idx[t, s] == -1 means the slot is not sent. dispatch: no record, no row anywhere (R counts only kept
// slots; a token whose slots are all dropped sends nothing; a rank may drop everything). redispatch: nothing
// for it. combine: the slot contributes nothing, y[t] = the sum over the KEPT slots in slot order, exactly
// moe_unpermute / moe_permute_backward with row_of = -1 for dropped slots (y[t] = 0 when all are dropped);
// hierarchical: nodes are those of the kept slots. combine_scalars: out[t, s] = 0 for a dropped slot.
// topk_w of a dropped slot is ignored.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "moetron/comm.h"
#include "moetron/job_enums.h"

namespace moetron {

enum class EpPayload : uint8_t { F32, BF16, E4M3 };
std::string_view to_string(EpPayload p);

struct EpDispatchConfig {
  EpDispatcher kind = EpDispatcher::AllToAll;
  int n_experts = 0;       // E, all routed experts (a multiple of the EP size)
  int topk = 0;            // k
  int64_t hidden = 0;      // D
  int64_t max_tokens = 0;  // upper bound on N per rank per call: sync_free sizes its buffers from it (required
                           // > 0 there); the others reserve for it and grow beyond it (0: grow on demand)
  int ranks_per_node = 0;  // EP ranks per node (EP ranks r, r' share a node iff r / rpn == r' / rpn);
                           // 0 = all on one node. Must divide the EP size. See DeviceMesh::ep_ranks_per_node.
  EpPayload dispatch_payload = EpPayload::F32;
  EpPayload combine_payload = EpPayload::F32;  // F32 or BF16
  // alltoall only, fp32 rows (dispatch / combine / redispatch each by its own payload): rows land in place,
  // one all_to_all_v per local expert (dispatch: straight into recv_x; combine: straight from yr), so no
  // unpack / pack copy, but El + 2 (dispatch) and El (combine) synchronizations instead of 2 and 1. Wins when
  // copies cost more than synchronizations; on an oversubscribed machine they usually do not (docs/parallel.md).
  bool alltoall_direct = false;
  // The caller names where the grouped rows go (dispatch with a RowLanding): rows land in the dispatch
  // payload's own type (F32 or BF16; E4M3 is refused), as they crossed, with no decode to fp32; recv_x() is
  // then null. What a trainer wants when the payload is its compute dtype: the rows land where the grouped
  // GEMM reads them. alltoall_direct then lands bf16 rows in place too.
  bool land_rows = false;
  // How rows move (alltoall and sync_free): MPI messages, or shared memory (every EP rank on one node; the
  // constructor, collective then, refuses otherwise). Hierarchical refuses shm: it exists to cross nodes.
  EpTransport transport = EpTransport::Mpi;
};

// What one rank did in one call (or a sum of calls). Bytes are the bytes this rank SENT, split by where
// they went: to itself, to a rank on its node, to a rank on another node (count rounds included).
struct EpTraffic {
  int64_t calls = 0;
  int64_t rows_sent = 0, rows_recv = 0;  // records (dispatch) or rows (combine) sent / received by this rank
  int64_t bytes_self = 0, bytes_intra = 0, bytes_inter = 0;
  int64_t rounds = 0;  // communication calls made (count rounds included)
  double seconds = 0;       // wall time of the call
  double seconds_comm = 0;  // of which inside communication calls (the rest: local planning, packing,
                            // payload encode/decode, the combine's reduction)
  int64_t bytes_remote() const { return bytes_intra + bytes_inter; }
  void add(const EpTraffic& o);
};

struct EpStats {
  EpTraffic dispatch, combine;            // totals since construction / reset_stats()
  EpTraffic last_dispatch, last_combine;  // the most recent call
  EpTraffic backward, last_backward;      // redispatch + combine_scalars
};

// One named allocation (DeepEP style: a buffer size is a sum of named terms).
struct EpBufferTerm {
  std::string name;
  int64_t bytes = 0;
};

class EpDispatch {
 public:
  // Collective (hierarchical splits the EP communicator into node and rail communicators).
  EpDispatch(const Comm& ep_comm, const EpDispatchConfig& cfg);
  ~EpDispatch();
  EpDispatch(const EpDispatch&) = delete;
  EpDispatch& operator=(const EpDispatch&) = delete;

  const EpDispatchConfig& config() const;
  int ep_size() const;
  int ep_rank() const;
  int local_experts() const;  // El
  int first_expert() const;   // ep_rank * El

  // x [N, D]; topk_idx [N, k] global expert ids; topk_w [N, k] or null (all weights 1). Returns R.
  // Needs cfg.land_rows false.
  int64_t dispatch(const float* x, const int32_t* topk_idx, const float* topk_w, int64_t N);
  // cfg.land_rows: land(R) is called once R is known (inside the call, before any row lands) and returns room
  // for R rows of the payload's type (R * D elements, bf16 or fp32), or null when it has none now: the rows
  // then land in the dispatcher's own buffer, recv_x_wire(), for the caller to move after the call.
  using RowLanding = std::function<void*(int64_t R)>;
  int64_t dispatch(const float* x, const int32_t* topk_idx, const float* topk_w, int64_t N, const RowLanding& land);

  // Results of the last dispatch (valid until the next dispatch).
  int64_t recv_rows() const;
  const float* recv_x() const;          // [R, D] fp32 (null with cfg.land_rows)
  const void* recv_x_wire() const;      // cfg.land_rows: [R, D] of the payload type when the landing gave no
                                        // room in the last dispatch; else null
  const int64_t* recv_counts() const;   // [El] rows per local expert
  const int64_t* recv_offsets() const;  // [El + 1]
  const int32_t* recv_src() const;      // [R] source EP rank
  const int32_t* recv_token() const;    // [R] token index on the source rank
  const int32_t* recv_slot() const;     // [R] slot (0..k-1)
  const float* recv_weight() const;     // [R] router weight of (token, slot)

  // y [N, D] for the N of the last dispatch; yr [R, D] in recv_x order (may be recv_x itself).
  void combine(float* y, const float* yr, bool weighted = true);
  // ep_transport = shm: [R, D] rows of the combine payload's type (fp32 or bf16) in this rank's shared segment,
  // where the experts may write their outputs (in recv_x order) for combine_in_place, which the homes read where
  // they are. Valid from a dispatch until the next; null with the MPI transport or before any dispatch. (A
  // combine whose yr is recv_x() is read in place too; any other yr is encoded into these rows first.)
  void* combine_rows() const;
  void combine_in_place(float* y, bool weighted = true);

  // Backward helpers. Collective; they reuse the layout of the last dispatch (no count round) and move rows
  // as the combine payload (F32 or BF16). With them the MoE backward is, per (token, slot), the
  // single-process computation:
  //   dyr = redispatch(dy);                 expert rows of dy, in recv_x order
  //   moe_unpermute_backward(dyr_w, dw_r, dyr, yr, iota [R], iota [R], zeros [R], recv_weight(), R, 1, R, D)
  //                                         dyr_w[r] = w_r * dy_r, dw_r[r] = dot(dy_r, yr[r]) on the expert rank
  //   combine_scalars(dw, dw_r);            dw [N, k] back on the home rank
  //   combine(dx, dxr, /*weighted=*/false); dx from the experts' input gradients
  // out [R, D]: out[r] = x[t] for the (token t, slot) of received row r; x [N, D] on the home rank.
  void redispatch(float* out, const float* x);
  // out [N, k] on the home rank: out[t, s] = v[r] for the received row r of (t, s); v [R] on the expert rank.
  void combine_scalars(float* out, const float* v);

  EpStats stats() const;
  void reset_stats();
  std::vector<EpBufferTerm> buffers() const;  // current allocations, one line per region
  int64_t buffer_bytes() const;               // their sum

  struct Impl;

 private:
  std::unique_ptr<Impl> p_;
};

// ---------------------------------------------------------------------------------------------------------
// Node-limited routing (DeepSeek-V3): a token may use experts on at most M nodes. Experts are grouped into
// n_nodes contiguous groups of E / n_nodes (the experts of one node when they are sharded contiguously over
// an EP group of n_nodes nodes). Node score = sum of the top max(1, k / M) selection scores q of its
// experts; the M best nodes are kept (ties to the lower index), the other experts get -inf.
// q_out may alias q. Apply top-k to q_out (ties to the lower index, like the router) to select.
void ep_node_limit_scores(float* q_out /* [N, E] */, const float* q /* [N, E] */, int64_t N, int E, int n_nodes,
                          int max_nodes, int k);
// Selection under the limit: topk_idx[n, j] = the j-th best eligible expert (larger q first, ties lower index).
void ep_node_limited_topk(int32_t* topk_idx /* [N, k] */, const float* q /* [N, E] */, int64_t N, int E, int k,
                          int n_nodes, int max_nodes);
// The largest number of distinct nodes any token uses (entries -1, dropped slots, are skipped).
int ep_max_nodes_per_token(const int32_t* topk_idx /* [N, k] */, int64_t N, int k, int E, int n_nodes);

// Reference for the hierarchical combine order on one process: yp [N*k, D] holds the expert output of
// (t, s) at row t*k + s; node_of_expert(e) = e / (E / n_nodes). y as defined above (weights w or 1);
// topk_idx entries -1 (dropped slots) contribute nothing.
void ep_combine_hierarchical_ref(float* y /* [N, D] */, const float* yp /* [N*k, D] */,
                                 const int32_t* topk_idx /* [N, k] */, const float* w /* [N, k] or null */,
                                 int64_t N, int k, int64_t D, int E, int n_nodes);

}  // namespace moetron
