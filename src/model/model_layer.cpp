// model_layer.cpp: one decoder layer, x_mid = x + Attn(RMSNorm(x)); x_out = x_mid + FFN(RMSNorm(x_mid)):
// its wiring (the two pre-norms, the attention output projection, the residual adds, dense or MoE FFN),
// its backward, and activation recompute (full: the whole layer forward again before its backward;
// selective: the chosen modules right before the backward needs them). forward_layer(l) / backward_layer(l)
// run layer l by index with its FSDP unit gathered, so a pipeline stage can run any contiguous range.
// Not the blocks themselves (model_attention.cpp, model_mlp.cpp, model_moe.cpp), not the embedding or the
// head (model_embed_head.cpp), and not the order of layers in a pass (Impl::run in model.cpp).
#include <chrono>
#include <cstring>
#include <utility>

#include "model/model_impl.h"
#include "moetron/trace.h"

namespace moetron {

using model_detail::add_inplace;

void Model::Impl::forward_layer(int64_t l, float* x) {
  Layer& L = layers[size_t(l)];
  fs_acquire(layer_unit(l), true, false);
  std::memcpy(L.x_in.data<float>(), x, size_t(Nr * d) * 4);
  layer_forward(L, L.x_in.data<float>(), x);
  fs_release(layer_unit(l));
}

void Model::Impl::backward_layer(int64_t l, float* g) {
  Layer& L = layers[size_t(l)];
  fs_acquire(layer_unit(l), true, true);
  if (L.recompute) {
    auto t0 = std::chrono::steady_clock::now();
    MT_TRACE_MODULE("recompute", int(l));  // the layer's forward again: its kernels, without module scopes
    recomputing = true;
    layer_forward(L, L.x_in.data<float>(), recompute_out.data<float>());
    recomputing = false;
    m.recompute_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  layer_backward(L, g);
  fs_release(layer_unit(l));
}

void Model::Impl::layer_forward(Layer& L, const float* xin, float* xout) {
  LayerBufs& b = *L.bufs;
  f8_bufs = &b;  // cache_fp8_activations: where this layer's FP8 linears keep their inputs
  const int li = int(&L - layers.data());
  trace::Module tm_attn("attn", li, !recomputing);
  {
    MT_TRACE("fwd.norm");
    // this rank's rows (under TP into scratch, gathered below)
    norm_fwd_c(tp == 1 ? b.h1c : tp_fullc, b.rstd1.data<float>(), xin, P(L.attn_norm), Nr, d);
  }
  if (tp > 1) tp_gather_rows(b.h1c.raw(), tp_fullc.raw(), d * (f32 ? 4 : 2));
  attn_forward(L, b);
  float* xm = b.x_mid.data<float>();
  {
    MT_TRACE("fwd.attn.out_proj");
    float* o = tp == 1 ? xm : tp_full.data<float>();  // under TP a partial sum over the heads held
    lin_fwd(o, b.aoc.raw(), L.wo, N, H * Dv, d);
    if (tp > 1) tp_scatter_sum(xm, o);
    add_inplace(xm, xin, Nr * d);
  }
  tm_attn.stop();
  MT_TRACE_MODULE(L.moe ? "moe" : "mlp", li, !recomputing);
  {
    MT_TRACE("fwd.norm");
    if (tp == 1) {
      norm_fwd(b.h2.data<float>(), b.h2c, b.rstd2.data<float>(), xm, P(L.ffn_norm), N, d);
    } else {  // this rank's rows in fp32, gathered, then the compute copy of all rows
      norm_fwd(tp_full.data<float>(), tp_fullc, b.rstd2.data<float>(), xm, P(L.ffn_norm), Nr, d);
      tp_gather_rows(b.h2.data<float>(), tp_full.data<float>(), d * 4);
      if (!f32) copy_c(b.h2c, b.h2.data<float>(), N * d);
    }
  }
  float* y = tp == 1 ? xout : tp_full.data<float>();
  ffn_forward(L, b, y);
  if (tp > 1) tp_scatter_sum(xout, y);
  add_inplace(xout, xm, Nr * d);
}

void Model::Impl::layer_backward(Layer& L, float* g) {
  LayerBufs& b = *L.bufs;
  f8_bufs = &b;
  const int li = int(&L - layers.data());
  trace::Module tm_ffn(L.moe ? "moe" : "mlp", li);
  // FFN branch: g is the gradient w.r.t. x_out = x_mid + ffn(norm(x_mid)). Under TP g holds this rank's rows: the
  // branch takes all rows (gathered into tp_full) and returns a partial sum, reduce-scattered back to the rows.
  float* dffn = dh.data<float>();
  recompute_selected_ffn(L, b);
  float* gfull = g;
  if (tp > 1) gfull = tp_full.data<float>(), tp_gather_rows(gfull, g, d * 4);
  ffn_backward(L, b, gfull, dffn, cur_aux_scale);
  float* dxm = dh2.data<float>();
  trace::Scope tr_norm("bwd.norm");
  if (tp > 1) tp_scatter_sum(dxm, dffn), std::swap(dxm, dffn);  // dffn: this rank's rows; dxm: free scratch
  rmsnorm_backward(dxm, G(L.ffn_norm), dffn, b.x_mid.data<float>(), P(L.ffn_norm), b.rstd2.data<float>(), Nr, d,
                   wsp());
  add_inplace(g, dxm, Nr * d);  // g is now d x_mid
  tr_norm.stop();
  tm_ffn.stop();
  // attention branch
  MT_TRACE_MODULE("attn", li);
  dffn = dh.data<float>(), dxm = dh2.data<float>();
  if (tp > 1) gfull = tp_full.data<float>(), tp_gather_rows(gfull, g, d * 4);
  const void* g_c = to_c(dyc, gfull, N * d);  // g itself in fp32 mode (not written until after attn_backward)
  recompute_selected_attn(L, b);
  attn_backward(L, b, g_c, dffn);
  MT_TRACE("bwd.norm");
  if (tp > 1) tp_scatter_sum(dxm, dffn), std::swap(dxm, dffn);
  rmsnorm_backward(dxm, G(L.attn_norm), dffn, L.x_in.data<float>(), P(L.attn_norm), b.rstd1.data<float>(), Nr, d,
                   wsp());
  add_inplace(g, dxm, Nr * d);  // g is now d x_in
}

void Model::Impl::ffn_forward(Layer& L, LayerBufs& b, float* y) {
  if (!L.moe) {
    MT_TRACE("fwd.mlp");
    swiglu_mlp_forward(b, L.w13, L.w2, F, y, false);
    return;
  }
  moe_forward(L, b, y);
}

// dy: gradient w.r.t. the FFN output [N,d]; dh2 (out): gradient w.r.t. the FFN input h2.
void Model::Impl::ffn_backward(Layer& L, LayerBufs& b, const float* dy, float* dh2out, float aux_scale) {
  // This lane's row scratch must hold the rows the forward received before dy's compute copy is made: growing it
  // later (ep_ffn_backward) would reallocate dyc under dy_c. The forward may have run on the other lane (the EP
  // overlap), whose scratch grew instead of this one.
  if (L.moe) ensure_scratch(b.R);
  const void* dy_c = to_c(dyc, dy, N * d);  // dy itself in fp32 mode
  if (!L.moe) {
    swiglu_mlp_backward(b, L.w13, L.w2, F, dy_c, dh2out, false);
    return;
  }
  moe_backward(L, b, dy, dy_c, dh2out, aux_scale);
}

void Model::Impl::recompute_selected_ffn(Layer& L, LayerBufs& b) {
  if (!L.sel_norm && !L.sel_act) return;
  auto t0 = std::chrono::steady_clock::now();
  if (L.sel_norm)
    norm_fwd(b.h2.data<float>(), b.h2c, b.rstd2.data<float>(), b.x_mid.data<float>(), P(L.ffn_norm), N, d);
  if (L.sel_act) {
    swiglu_c(b.eactc, b.egu.data<float>(), b.R, Fe);
    if (Fs > 0) swiglu_c(b.actc, b.gu.data<float>(), N, Fs);
  }
  m.recompute_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Model::Impl::recompute_selected_attn(Layer& L, LayerBufs& b) {
  if (!L.sel_norm && !L.sel_attn) return;
  auto t0 = std::chrono::steady_clock::now();
  if (L.sel_norm)
    norm_fwd_c(b.h1c, b.rstd1.data<float>(), L.x_in.data<float>(), P(L.attn_norm), N, d);
  if (L.sel_attn) attn_core(b);
  m.recompute_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace moetron
