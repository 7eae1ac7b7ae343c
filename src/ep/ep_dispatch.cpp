// ep_dispatch.cpp: the public EpDispatch (include/moetron/ep_dispatch.h): it constructs the dispatcher that
// cfg.kind names, checks the arguments of every call, times it and keeps the traffic statistics, and lists the
// buffers. The contract (row order, combine order, payload formats) is in ep_dispatch.h; docs/parallel.md has
// the buffer arithmetic and measured figures.
// Not a dispatcher: alltoall, sync_free and hierarchical are src/ep/dispatch_*.cpp over the shared state of
// dispatcher.h; the node-limited routing helpers are node_routing.cpp. Not the expert computation: the caller
// runs its experts on recv_x between dispatch and combine.
//
// Shape of one call (flat): encode token rows once -> count -> plan (row_of = record index, blocks per
//   (peer, local expert)) -> pack payload rows + 8-byte metadata straight into the per-peer messages
//   (OpenMP over tokens) -> [count round] -> exchange -> whole blocks copied / decoded into the grouped
//   output (recv_x, or with land_rows the caller's landing, undecoded). alltoall_direct: fp32 or landed rows
//   land in the grouped output (one all_to_all_v per local expert).
// Combine: the expert rows go back block by block (staged: packed peer-major; direct: straight from yr), the
//   home rank sums them with moe_unpermute (bf16 rows decoded per token chunk inside the sum).
// Hierarchical: two exchanges (rail, then node) and a forwarding step in between; its stage 2 arrives as
//   16-byte-header records scattered by unpack(). Its combine reverses the staging order: the expert rank
//   sends row g of its staging (receive) order back to where it came from.
#include "moetron/ep_dispatch.h"

#include "ep/dispatcher.h"
#include "moetron/check.h"

namespace moetron {

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

std::unique_ptr<EpDispatch::Impl> make_dispatcher(const Comm& ep_comm, const EpDispatchConfig& cfg) {
  switch (cfg.kind) {
    case EpDispatcher::SyncFree: return ep::make_sync_free(ep_comm, cfg);
    case EpDispatcher::Hierarchical: return ep::make_hierarchical(ep_comm, cfg);
    case EpDispatcher::AllToAll: break;
  }
  return ep::make_alltoall(ep_comm, cfg);
}

}  // namespace

EpDispatch::EpDispatch(const Comm& ep_comm, const EpDispatchConfig& cfg) : p_(make_dispatcher(ep_comm, cfg)) {}

EpDispatch::~EpDispatch() = default;

const EpDispatchConfig& EpDispatch::config() const { return p_->cfg; }
int EpDispatch::ep_size() const { return p_->P; }
int EpDispatch::ep_rank() const { return p_->me; }
int EpDispatch::local_experts() const { return p_->El; }
int EpDispatch::first_expert() const { return p_->me * p_->El; }

int64_t EpDispatch::dispatch(const float* x, const int32_t* topk_idx, const float* topk_w, int64_t N) {
  return dispatch(x, topk_idx, topk_w, N, RowLanding{});  // refused there when land_rows is set
}

int64_t EpDispatch::dispatch(const float* x, const int32_t* topk_idx, const float* topk_w, int64_t N,
                             const RowLanding& land) {
  Impl& I = *p_;
  MT_CHECK(I.cfg.land_rows == bool(land), "ep_dispatch",
           I.cfg.land_rows ? "land_rows is set: dispatch needs a RowLanding"
                           : "a RowLanding needs land_rows in the dispatch configuration");
  I.land = land ? &land : nullptr;
  struct Clear {
    Impl& i;
    ~Clear() { i.land = nullptr; }
  } clear{I};
  ep::record_call(I.st.last_dispatch, I.st.dispatch, [&](EpTraffic& tr) {
    I.validate(x, topk_idx, N);
    I.N = -1;
    I.copy_weights(topk_w, N);
    if (!I.encodes_tokens()) I.encode_tokens(x, N);
    I.dispatch(x, topk_idx, N, tr);
    I.N = N;
    tr.rows_recv = I.R;
  });
  return I.R;
}

int64_t EpDispatch::recv_rows() const { return p_->R; }
const float* EpDispatch::recv_x() const {
  if (p_->cfg.land_rows) return nullptr;
  const float* shared = p_->expert_rows();
  return shared ? shared : p_->out_x.data<float>();
}
void* EpDispatch::combine_rows() const { return p_->N >= 0 ? p_->combine_rows() : nullptr; }

void EpDispatch::combine_in_place(float* y, bool weighted) {
  Impl& I = *p_;
  const char* op = "ep_combine";
  MT_CHECK(I.N >= 0, op, "combine before any dispatch");
  MT_CHECK(I.combine_rows() != nullptr, op, "combine_in_place needs ep_transport = shm (combine_rows() is null)");
  MT_CHECK(y != nullptr || I.N == 0, op, "null y for N=", I.N);
  ep::record_call(I.st.last_combine, I.st.combine, [&](EpTraffic& tr) { I.combine(y, nullptr, weighted, tr); });
}
const void* EpDispatch::recv_x_wire() const {
  return p_->cfg.land_rows && !p_->landed_in_caller ? p_->out_x.data() : nullptr;
}
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
  ep::record_call(I.st.last_combine, I.st.combine, [&](EpTraffic& tr) { I.combine(y, yr, weighted, tr); });
}

void EpDispatch::redispatch(float* out, const float* x) {
  Impl& I = *p_;
  const char* op = "ep_redispatch";
  MT_CHECK(I.N >= 0, op, "redispatch before any dispatch");
  MT_CHECK(out != nullptr || I.R == 0, op, "null out for R=", I.R);
  MT_CHECK(x != nullptr || I.N == 0, op, "null x for N=", I.N);
  ep::record_call(I.st.last_backward, I.st.backward, [&](EpTraffic& tr) { I.redispatch(out, x, tr); });
}

void EpDispatch::combine_scalars(float* out, const float* v) {
  Impl& I = *p_;
  const char* op = "ep_combine_scalars";
  MT_CHECK(I.N >= 0, op, "combine_scalars before any dispatch");
  MT_CHECK(out != nullptr || I.N == 0, op, "null out for N=", I.N);
  MT_CHECK(v != nullptr || I.R == 0, op, "null v for R=", I.R);
  ep::record_call(I.st.last_backward, I.st.backward, [&](EpTraffic& tr) { I.combine_scalars(out, v, tr); });
}

EpStats EpDispatch::stats() const { return p_->st; }
void EpDispatch::reset_stats() { p_->st = EpStats{}; }

std::vector<EpBufferTerm> EpDispatch::buffers() const {
  std::vector<EpBufferTerm> out;
  for (ep::Buf* b : p_->all_bufs())
    if (b->bytes > 0) out.push_back({b->name, int64_t(b->bytes)});
  for (auto& t : p_->extra_terms()) out.push_back(t);
  return out;
}

int64_t EpDispatch::buffer_bytes() const {
  int64_t s = 0;
  for (const auto& t : buffers()) s += t.bytes;
  return s;
}

}  // namespace moetron
