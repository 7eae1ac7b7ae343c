// model_mlp.cpp: the dense SwiGLU feed-forward, forward and backward: a dense layer's FFN and, with width
// n_shared * moe_inter_size, an MoE layer's shared experts. y = (SwiGLU(h2 W13)) W2 with W13 = [gate | up].
// Not the routed experts (model_moe.cpp), not the layer's norm / residual wiring (model_layer.cpp).
#include "model/model_impl.h"
#include "moetron/trace.h"

namespace moetron {

void Model::Impl::swiglu_mlp_forward(LayerBufs& b, int w13, int w2, int64_t Fw, float* y, bool acc) {
  lin_fwd(b.gu.data<float>(), b.h2c.raw(), w13, N, d, 2 * Fw);
  swiglu_c(b.actc, b.gu.data<float>(), N, Fw);
  lin_fwd(y, b.actc.raw(), w2, N, Fw, d, acc);
}

void Model::Impl::swiglu_mlp_backward(LayerBufs& b, int w13, int w2, int64_t Fw, const void* dy_c, float* dh2out,
                                      bool acc) {
  MT_TRACE("bwd.mlp");
  lin_wgrad(w2, b.actc.raw(), dy_c, N, Fw, d);
  float* dact = s_f1.data<float>();
  lin_dgrad(dact, dy_c, w2, N, Fw, d);
  const void* dgu_c = swiglu_backward_c(s_c1, s_f2.data<float>(), dact, b.gu.data<float>(), N, Fw);
  lin_wgrad(w13, b.h2c.raw(), dgu_c, N, d, 2 * Fw);
  lin_dgrad(dh2out, dgu_c, w13, N, d, 2 * Fw, acc);
}

}  // namespace moetron
