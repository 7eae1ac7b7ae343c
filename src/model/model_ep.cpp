// model_ep.cpp: an MoE layer's routed experts under expert parallelism (ep > 1): the kept (token, slot)
// rows go to the ranks owning their experts through the layer's EpDispatch, the local experts run on the
// received rows, and combine brings the outputs home; the backward mirrors it. Also the growth of the
// buffers that hold received rows (their count is data-dependent under EP).
// Not the router, the capacity plan or the shared experts (model_moe.cpp, before and after this), and not
// the dispatcher's communication (src/parallel/, include/moetron/ep_dispatch.h).
#include <algorithm>
#include <cstring>

#include "model/model_impl.h"
#include "moetron/permute.h"
#include "moetron/trace.h"

namespace moetron {

using model_detail::f32buf;

// Routed experts under expert parallelism. The home rank has routed (and, with a capacity, dropped) its
// tokens; the kept (token, slot) rows go to the ranks owning their experts in the compute dtype (bitwise
// what the single-process permute feeds the GEMMs: bf16, or fp32 in fp32 mode, landed in the experts' input
// buffer as they crossed) or E4M3 (decoded, then rounded to the compute dtype), the experts run
// on the received rows (grouped by local expert, ordered by source rank, token, slot), and combine brings
// fp32 rows back and sums them in slot order on the home rank: the single-process moe_unpermute. The backward
// mirrors it with the dispatcher's redispatch / combine_scalars / combine (see ep_dispatch.h).
void Model::Impl::ep_ffn_forward(Layer& L, LayerBufs& b, float* y) {
  const int32_t* idx = b.topk_idx.data<int32_t>();
  const int32_t* send = idx;
  if (s.moe.capacity_factor > 0) {  // slots the home rank's capacity plan dropped are not sent
    const int32_t* row_of = b.row_of.data<int32_t>();
    int32_t* si = send_idx.data<int32_t>();
    for (int64_t i = 0; i < N * K; ++i) si[i] = row_of[i] < 0 ? -1 : idx[i];
    send = si;
  }
  int64_t R;
  const bool land = L.disp->config().land_rows;
  {
    MT_TRACE("fwd.ep.dispatch");
    EpYield y(*this);
    const float* h2 = b.h2.data<float>();
    const float* w = b.topk_w.data<float>();
    // Rows in the compute dtype land in xpc, where the experts' GEMMs read them, when it has room; growing it
    // waits for the baton (the other lane computes during the exchange), so a larger R lands in the
    // dispatcher and is copied below.
    R = land ? L.disp->dispatch(h2, send, w, N, [&b](int64_t r) { return r <= b.rows_cap ? b.xpc.raw() : nullptr; })
             : L.disp->dispatch(h2, send, w, N);
  }
  ensure_rows(L, R);
  b.R = R;
  int32_t* kept = b.kept.data<int32_t>();
  const int64_t* rc = L.disp->recv_counts();
  for (int64_t e = 0; e < El; ++e) kept[e] = int32_t(rc[e]);
  if (!land) {
    MT_TRACE("fwd.permute");
    copy_c(b.xpc, L.disp->recv_x(), R * d);
  } else if (const void* wire = L.disp->recv_x_wire()) {
    MT_TRACE("fwd.permute");
    std::memcpy(b.xpc.raw(), wire, size_t(R * d) * dtype_size(b.xpc.dtype()));
  }
  experts_forward(L, b, R);
  MT_TRACE("fwd.ep.combine");
  EpYield yc(*this);
  L.disp->combine(y, b.ez.data<float>(), true);
}

void Model::Impl::ep_ffn_backward(Layer& L, LayerBufs& b, const float* dy, float* dh2out) {
  const int64_t R = b.R;
  ensure_scratch(R);  // the forward grew its lane's scratch; the backward may run on the other lane
  float* dyr = s_f3.data<float>();
  {
    MT_TRACE("bwd.ep.redispatch");
    EpYield y(*this);
    L.disp->redispatch(dyr, dy);
  }
  float* dw_r = dwr.data<float>();
  {
    MT_TRACE("bwd.combine");
    // Each received row is its own "token" with one slot: dz = w * dy, dw = dot(dy, z), as on one process.
    const int32_t* io = iota_r.data<int32_t>();
    if (f32)
      moe_unpermute_backward(s_c2.data<float>(), dw_r, dyr, b.ez.data<float>(), io, io, zero_r.data<int32_t>(),
                             L.disp->recv_weight(), R, 1, R, d);
    else
      moe_unpermute_backward(s_c2.data<bf16>(), dw_r, dyr, b.ez.data<float>(), io, io, zero_r.data<int32_t>(),
                             L.disp->recv_weight(), R, 1, R, d);
  }
  {
    MT_TRACE("bwd.ep.combine_scalars");
    EpYield y(*this);
    L.disp->combine_scalars(dtopk_w.data<float>(), dw_r);
  }
  float* dxp = experts_backward(L, b, s_c2.raw(), R);
  MT_TRACE("bwd.ep.combine");
  EpYield y(*this);
  L.disp->combine(dh2out, dxp, false);
}

// Under EP a rank receives a data-dependent number of routed rows: at most ep * N * min(k, El), N * k on
// average. Buffers start at N * k rows and grow (by at least a quarter) when a dispatch brings more; the
// growth is the only allocation a step can make, and the memory tracker sees it.
void Model::Impl::ensure_rows(Layer& L, int64_t R) {
  LayerBufs& b = *L.bufs;
  b.rows_peak = std::max(b.rows_peak, R);
  if (R > b.rows_cap) {
    const int64_t cap = std::max(R, b.rows_cap + b.rows_cap / 4);
    b.xpc = cbuf(cap * d), b.egu = f32buf(cap * 2 * Fe), b.ez = f32buf(cap * d);
    if (!L.sel_act) b.eactc = cbuf(cap * Fe);
    b.rows_cap = cap;
  }
  if (L.sel_act && R > sel_rows_cap) {
    sel_rows_cap = std::max(R, sel_rows_cap + sel_rows_cap / 4);
    sel.eactc = cbuf(sel_rows_cap * Fe);
    for (LayerBufs* o : sel_act_bufs) o->eactc = sel.eactc;
  }
  ensure_scratch(R);
}

void Model::Impl::ensure_scratch(int64_t R) {
  if (R <= scratch_rows) return;
  alloc_row_scratch(std::max(R, scratch_rows + scratch_rows / 4));
  const size_t w = grouped_ws_bytes(scratch_rows);
  if (w > ws_bytes) {
    ws = Tensor::zeros({int64_t((w + 3) / 4)}, DType::F32, MemCategory::Workspace, "kernel.ws");
    ws_bytes = w;
  }
}

}  // namespace moetron
