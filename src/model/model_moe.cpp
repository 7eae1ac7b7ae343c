// model_moe.cpp: an MoE layer's FFN, forward and backward: the router (fp32 gate GEMM, top-k with the
// aux-free bias, aux / z losses, per-expert counts), the capacity plan and permute, the local experts as
// grouped gate/up and down GEMMs around SwiGLU, the weighted combine, then the shared experts (the dense
// SwiGLU of model_mlp.cpp). Also the packed expert weights the grouped GEMMs read.
// Not the expert-parallel path (model_ep.cpp: rows sent to other ranks), not the dense SwiGLU itself, and
// not the router / permute / grouped GEMM kernels (include/moetron/router.h, permute.h, grouped_gemm.h).
#include <algorithm>

#include "model/model_impl.h"
#include "moetron/permute.h"
#include "moetron/trace.h"

namespace moetron {

void Model::Impl::moe_forward(Layer& L, LayerBufs& b, float* y) {
  // router (fp32 gate GEMM: routing decisions are sensitive to rounding)
  float* logits = b.logits.data<float>();
  {
    MT_TRACE("fwd.router.gate_gemm");
    gemm_f32(Trans::N, Trans::N, N, E, d, 1.0f, b.h2.data<float>(), d, P(L.gate), E, 0.0f, logits, E);
  }
  trace::Scope tr_router("fwd.router");  // scores, top-k, losses and the permute plan (the gate GEMM is apart)
  RouterLosses rl;
  const float* bias = s.moe.load_balance == LoadBalance::AuxFree ? L.bias.data<float>() : nullptr;
  int32_t* idx = b.topk_idx.data<int32_t>();
  int32_t* counts = b.counts.data<int32_t>();
  router_forward(idx, b.topk_w.data<float>(), counts, b.scores.data<float>(), &rl, logits, bias, rcfg, N, wsp());
  if (!recomputing) {
    last_aux += rl.aux, last_z += rl.z;
    cur_aux[size_t(L.moe_index)] += rl.aux, cur_z[size_t(L.moe_index)] += rl.z;
    for (int64_t e = 0; e < E; ++e) L.count_acc[e] += counts[e];
  }
  int32_t* off = b.offsets.data<int32_t>();
  // With a capacity, an over-full expert drops its lowest routing weights (probs) or its last tokens (position).
  const float* drop_w = s.moe.drop_policy == DropPolicy::Probs ? b.topk_w.data<float>() : nullptr;
  int64_t dropped = moe_permute_plan(off, b.row_of.data<int32_t>(), b.token_of.data<int32_t>(),
                                     b.slot_of.data<int32_t>(), idx, counts, N, int(K), int(E), s.moe.capacity_factor,
                                     drop_w);
  if (!recomputing) last_dropped += dropped;
  tr_router.stop();
  int32_t* kept = b.kept.data<int32_t>();
  if (ep > 1) {
    ep_ffn_forward(L, b, y);
  } else {
    for (int64_t e = 0; e < E; ++e) kept[e] = off[e + 1] - off[e];
    const int64_t R = off[E];
    b.R = R;
    {
      MT_TRACE("fwd.permute");
      if (f32) moe_permute(b.xpc.data<float>(), b.h2.data<float>(), b.token_of.data<int32_t>(), R, N, d);
      else moe_permute(b.xpc.data<bf16>(), b.h2.data<float>(), b.token_of.data<int32_t>(), R, N, d);
    }
    experts_forward(L, b, R);
    {
      MT_TRACE("fwd.combine");
      moe_unpermute(y, b.ez.data<float>(), b.row_of.data<int32_t>(), b.topk_w.data<float>(), N, int(K), R, d);
    }
  }
  if (Fs > 0) {
    MT_TRACE("fwd.shared");
    swiglu_mlp_forward(b, L.ws13, L.ws2, Fs, y, true);
  }
}

// dy: gradient w.r.t. the FFN output [N,d] (dy_c: the same in the compute dtype); dh2 (out): gradient
// w.r.t. the FFN input h2.
void Model::Impl::moe_backward(Layer& L, LayerBufs& b, const float* dy, const void* dy_c, float* dh2out,
                               float aux_scale) {
  if (ep > 1) {
    ep_ffn_backward(L, b, dy, dh2out);
  } else {
    const int64_t R = b.R;
    const int32_t* row_of = b.row_of.data<int32_t>();
    // combine backward -> gradient of expert outputs (compute dtype, for the GEMMs) and of the routing weights
    float* dtw = dtopk_w.data<float>();
    {
      MT_TRACE("bwd.combine");
      if (f32)
        moe_unpermute_backward(s_c2.data<float>(), dtw, dy, b.ez.data<float>(), row_of, b.token_of.data<int32_t>(),
                               b.slot_of.data<int32_t>(), b.topk_w.data<float>(), N, int(K), R, d);
      else
        moe_unpermute_backward(s_c2.data<bf16>(), dtw, dy, b.ez.data<float>(), row_of, b.token_of.data<int32_t>(),
                               b.slot_of.data<int32_t>(), b.topk_w.data<float>(), N, int(K), R, d);
    }
    float* dxp = experts_backward(L, b, s_c2.raw(), R);
    {
      MT_TRACE("bwd.permute");
      moe_permute_backward(dh2out, dxp, row_of, N, int(K), R, d);
    }
  }
  float* dtw = dtopk_w.data<float>();
  // TP (expert_tp = tp): this rank's expert outputs are partial sums over the width it holds, so are their routing
  // weights' gradients; summed, every TP rank runs the same router backward.
  tp_sum(dtw, N * K);
  // router
  trace::Scope tr_router("bwd.router");
  RouterConfig rc = rcfg;
  rc.aux_coef *= aux_scale;
  rc.z_coef *= aux_scale;
  float* dlg = dlogits.data<float>();
  router_backward(dlg, dtw, b.scores.data<float>(), b.topk_idx.data<int32_t>(), b.logits.data<float>(), rc, N, wsp());
  lin_wgrad_f32(L.gate, b.h2.data<float>(), dlg, N, d, E);
  if (tp_lead()) gemm_f32(Trans::N, Trans::T, N, d, E, 1.0f, dlg, E, P(L.gate), E, 1.0f, dh2out, d);  // once over TP
  tr_router.stop();
  if (Fs > 0) swiglu_mlp_backward(b, L.ws13, L.ws2, Fs, dy_c, dh2out, true);
}

void Model::Impl::experts_forward(Layer& L, LayerBufs& b, int64_t R) {
  MT_TRACE("fwd.experts");
  const int32_t* kept = b.kept.data<int32_t>();
  if (const int s = fp8_site(L.we13); s >= 0) fp8_gg_fwd(s, b.egu.data<float>(), b.xpc.raw(), L.we13, kept, R, d, 2 * Fe);
  else gg_fwd(b.egu.data<float>(), b.xpc.raw(), L.pk13f, kept, R, d, 2 * Fe);
  swiglu_c(b.eactc, b.egu.data<float>(), R, Fe);
  if (const int s = fp8_site(L.we2); s >= 0) fp8_gg_fwd(s, b.ez.data<float>(), b.eactc.raw(), L.we2, kept, R, Fe, d);
  else gg_fwd(b.ez.data<float>(), b.eactc.raw(), L.pk2f, kept, R, Fe, d);
}

float* Model::Impl::experts_backward(Layer& L, LayerBufs& b, const void* dz, int64_t R) {
  MT_TRACE("bwd.experts");
  const int32_t* kept = b.kept.data<int32_t>();
  gg_wgrad(L.we2, b.eactc.raw(), dz, kept, R, Fe, d);
  float* deact = s_f1.data<float>();
  if (const int s = fp8_site(L.we2); s >= 0) fp8_gg_dgrad(s, deact, dz, L.we2, kept, R, Fe, d);
  else gg_dgrad(deact, dz, L.pk2d, kept, R, Fe, d);
  const void* degu_c = swiglu_backward_c(s_c1, s_f2.data<float>(), deact, b.egu.data<float>(), R, Fe);
  gg_wgrad(L.we13, b.xpc.raw(), degu_c, kept, R, d, 2 * Fe);
  float* dxp = s_f1.data<float>();
  if (const int s = fp8_site(L.we13); s >= 0) fp8_gg_dgrad(s, dxp, degu_c, L.we13, kept, R, d, 2 * Fe);
  else gg_dgrad(dxp, degu_c, L.pk13d, kept, R, d, 2 * Fe);
  return dxp;
}

void Model::Impl::alloc_packed(Tensor& p13f, Tensor& p13d, Tensor& p2f, Tensor& p2d, const char* name) {
  auto buf = [&](GroupedPackKind k, int64_t in, int64_t out) {
    const int64_t bytes = int64_t(grouped_packed_bytes(k, prec(), El, in, out));
    return f32 ? Tensor::zeros({bytes / 4}, DType::F32, MemCategory::Params, name)
               : Tensor::zeros({bytes / 2}, DType::BF16, MemCategory::Params, name);
  };
  p13f = buf(GroupedPackKind::Fwd, d, 2 * Fe), p13d = buf(GroupedPackKind::Dgrad, d, 2 * Fe);
  p2f = buf(GroupedPackKind::Fwd, Fe, d), p2d = buf(GroupedPackKind::Dgrad, Fe, d);
}

void Model::Impl::pack_experts(Layer& L, Tensor& p13f, Tensor& p13d, Tensor& p2f, Tensor& p2d) {
  pack_expert_range(L, 0, 0, El, p13f, p13d);
  pack_expert_range(L, 1, 0, El, p2f, p2d);
}

void Model::Impl::pack_expert_range(Layer& L, int mat, int64_t e0, int64_t e1, Tensor& pf, Tensor& pd) {
  const int64_t K = mat == 0 ? d : Fe, N = mat == 0 ? 2 * Fe : d;
  const float* w = P(mat == 0 ? L.we13 : L.we2);
  (mat == 0 ? L.pk13f : L.pk2f) = grouped_pack_weights(pf.raw(), w, El, K, N, prec(), GroupedPackKind::Fwd, e0, e1);
  (mat == 0 ? L.pk13d : L.pk2d) = grouped_pack_weights(pd.raw(), w, El, K, N, prec(), GroupedPackKind::Dgrad, e0, e1);
}

// The grouped GEMMs' workspace (every op, both expert matmuls) for `rows` routed rows.
size_t Model::Impl::grouped_ws_bytes(int64_t rows) const {
  size_t w = 0;
  for (GroupedOp op : {GroupedOp::Fwd, GroupedOp::Dgrad, GroupedOp::Wgrad}) {
    w = std::max(w, grouped_gemm_workspace_bytes(op, prec(), El, rows, d, 2 * Fe));
    w = std::max(w, grouped_gemm_workspace_bytes(op, prec(), El, rows, Fe, d));
  }
  return w;
}

}  // namespace moetron
