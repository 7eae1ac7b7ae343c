// model_embed_head.cpp: the two ends of the decoder: the token embedding (lookup and its gradient) and the
// last step, final RMSNorm + the fused linear head and cross-entropy (the logits are never materialised;
// compute_logits makes them explicitly for tests). With tied embeddings the head is the embedding matrix,
// so in FSDP mode its unit stays gathered from the embedding to the head (and its backward).
// Not the decoder layers (model_layer.cpp) and not the loss kernels (include/moetron/loss.h).
#include <cstring>
#include <vector>

#include "model/model_impl.h"
#include "moetron/loss.h"
#include "moetron/trace.h"
#include "moetron/vocab_parallel.h"

namespace moetron {

void Model::Impl::embed_forward(const int32_t* tokens, float* xcur, bool head_grads) {
  MT_TRACE_MODULE("embed");
  const bool tied = head == emb;
  fs_acquire(0, true, head_grads && tied);
  const float* E0 = P(emb);
  if (tp > 1) {  // vocabulary-parallel: this rank's rows of the table, summed into each rank's rows of the batch
    MT_TRACE_K("fwd.embed", 0, 8.0 * double(N * d));
    vocab_embed_forward(xcur, E0, tokens, N, d, V, tp_comm, TpReduce::ReduceScatter, tp_full.raw());
  } else {
    MT_TRACE_K("fwd.embed", 0, 8.0 * double(N * d));  // a row gather
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; ++t) std::memcpy(xcur + t * d, E0 + int64_t(tokens[t]) * d, size_t(d) * 4);
  }
  if (!tied) fs_release(0);
}

void Model::Impl::head_loss(const float* xcur, const int32_t* targets, bool backward, float ce_scale, float* g,
                            ForwardStats& st) {
  MT_TRACE_MODULE("head");
  const bool tied = head == emb;
  const int last_u = head_unit();
  fs_acquire(last_u, true, backward);
  {
    MT_TRACE("fwd.norm");
    norm_fwd_c(tp == 1 ? hfc : tp_fullc, rstdf.data<float>(), xcur, P(final_norm), Nr, d);
  }
  if (tp > 1) tp_gather_rows(hfc.raw(), tp_fullc.raw(), d * (f32 ? 4 : 2));  // the head sees every row
  std::memcpy(xf.data<float>(), xcur, size_t(Nr * d) * 4);
  for (int64_t t = 0; t < N; ++t) st.ce_count += targets[t] >= 0;
  const int64_t chunk = tp > 1 ? vocab_xent_default_chunk(V, tp) : linear_xent_default_chunk(V);
  trace::Scope tr_loss("loss.fused_linear_xent");
  const bf16* Wb = f32 ? nullptr : static_cast<const bf16*>(W(head));
  if (!backward) {
    if (tp > 1)  // vocabulary-parallel: every rank gets the whole loss
      st.ce_sum = f32 ? vocab_xent_fwd_f32(nullptr, hfc.data<float>(), P(head), targets, N, d, V, tp_comm, 1.0f, chunk,
                                           wsp())
                      : vocab_xent_fwd_bf16(nullptr, hfc.data<bf16>(), Wb, targets, N, d, V, tp_comm, 1.0f, chunk, wsp());
    else
      st.ce_sum = f32 ? linear_xent_fwd_f32(nullptr, hfc.data<float>(), P(head), targets, N, d, V, 1.0f, chunk, wsp())
                      : linear_xent_fwd_bf16(nullptr, hfc.data<bf16>(), Wb, targets, N, d, V, 1.0f, chunk, wsp());
    tr_loss.stop();
    fs_release(last_u);
    if (tied) fs_release(0);
    return;
  }
  float* dhf = dh.data<float>();
  // The fused kernel returns the scaled loss; recover the plain sum for reporting. Under TP the vocabulary-parallel
  // kernel reduce-scatters dL/dh to this rank's rows.
  const auto RS = TpReduce::ReduceScatter;
  double scaled =
      tp > 1 ? (f32 ? vocab_xent_fwd_bwd_f32(dhf, head_weight_grad(), hfc.data<float>(), P(head), targets, N, d, V,
                                             tp_comm, RS, ce_scale, chunk, wsp())
                    : vocab_xent_fwd_bwd_bf16(dhf, head_weight_grad(), hfc.data<bf16>(), Wb, targets, N, d, V, tp_comm,
                                              RS, ce_scale, chunk, wsp()))
      : f32  ? linear_xent_fwd_bwd_f32(dhf, head_weight_grad(), hfc.data<float>(), P(head), targets, N, d, V, ce_scale,
                                       chunk, wsp())
             : linear_xent_fwd_bwd_bf16(dhf, head_weight_grad(), hfc.data<bf16>(), Wb, targets, N, d, V, ce_scale, chunk,
                                        wsp());
  st.ce_sum = ce_scale != 0 ? scaled / ce_scale : 0;
  tr_loss.stop();
  {
    MT_TRACE("bwd.norm");
    rmsnorm_backward(g, G(final_norm), dhf, xf.data<float>(), P(final_norm), rstdf.data<float>(), Nr, d, wsp());
  }
  fs_release(last_u);
}

void Model::Impl::embed_backward(const int32_t* tokens, const float* g) {
  MT_TRACE_MODULE("embed");
  if (head != emb) fs_acquire(0, false, true);
  trace::Scope tr_embed("bwd.embed");  // a row scatter-add (the FSDP release below is its own scope)
  MT_TRACE_COST(double(N * d), 12.0 * double(N * d));
  float* gE = G(emb);
  if (tp > 1) {
    vocab_embed_backward(gE, g, tokens, N, d, V, tp_comm, TpReduce::ReduceScatter, tp_full.raw());
  } else {
    for (int64_t t = 0; t < N; ++t) {
      float* dst = gE + int64_t(tokens[t]) * d;
      const float* src = g + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) dst[i] += src[i];
    }
  }
  // FSDP with tied embeddings: the head's gradient of this micro-batch joins the unit's before it is reduced
  // (the plain model folds once per step: fold_tied_head_grad).
  if (fs_on && tied_hg.defined()) {
    model_detail::add_inplace(gE, tied_hg.data<float>(), Vl * d);
    tied_hg.zero_();
  }
  tr_embed.stop();
  fs_release(0);
}

void Model::compute_logits(float* logits, const int32_t* tokens) {
  MT_CHECK(impl_->tp == 1 && impl_->cp == 1, "Model::compute_logits", "not implemented under tensor or context "
           "parallelism");
  std::vector<int32_t> tg(size_t(impl_->N), -1);
  impl_->run(tokens, tg.data(), false, 0.0f, 0.0f);
  auto& I = *impl_;
  std::vector<float> hf(size_t(I.N * I.d)), wh(size_t(I.V * I.d));
  if (I.f32) std::memcpy(hf.data(), I.hfc.raw(), hf.size() * 4);
  else bf16_to_f32(hf.data(), I.hfc.data<bf16>(), I.N * I.d);
  const int hu = I.head == I.emb ? 0 : I.head_unit();
  I.fs_acquire(hu, true, false);
  if (I.f32) std::memcpy(wh.data(), I.P(I.head), wh.size() * 4);
  else bf16_to_f32(wh.data(), static_cast<const bf16*>(I.W(I.head)), I.V * I.d);
  I.fs_release(hu);
  gemm_f32(Trans::N, Trans::T, I.N, I.V, I.d, 1.0f, hf.data(), I.d, wh.data(), I.d, 0.0f, logits, I.V);
}

}  // namespace moetron
