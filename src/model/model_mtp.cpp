// model_mtp.cpp: DeepSeek-V3's multi-token prediction (model.mtp_layers = D; docs/model.md, "Multi-token
// prediction"), forward and backward, on the head stage after the main head. Depth k = 1..D at position i:
//   h'_i  = eh_proj [ RMSNorm_enorm(Emb(t_{i+k})) ; RMSNorm_hnorm(h^{k-1}_i) ]       (2d -> d)
//   h^k_i = Block_k(h'_i)                      (one decoder layer of the last layer's kind: layers[n_layers + k - 1])
//   loss  = CE(head(RMSNorm_norm_k(h^k_i)), t_{i+k+1})
// with h^0 the main model's last layer output (before the final norm), the embedding and the head shared with
// the main model, and enorm, hnorm, eh_proj, norm and the block the depth's own. The tokens come from the targets
// (t_{i+k} = targets[i+k-1]): a depth reads no input the head stage does not hold. Position i takes part in depth
// k's loss when i + k < T and both tokens are valid (else its input token is 0 and its target ignored). The depth's
// loss gradient is scaled by mtp_loss_weight / D / (the step's positions the depth has: ce_scale's T over T - k).
// Like the main head, each depth's fused head runs its backward in the forward and keeps dL/dh^k for the backward.
// Tensor parallelism (sequence parallel): the depth works on the rank's Nr rows like the main layers (its block is a
// TP block; enorm, hnorm, eh_proj and norm are whole on every rank, their gradients partial over the rows and summed
// over TP once per step); the embedding rows of the tokens ahead are the vocabulary-parallel lookup of every rank's
// token ids, reduce-scattered to its rows; the loss is the vocabulary-parallel fused kernel on the gathered rows.
// Context parallelism: the stage gets the whole sequences' targets, so the tokens ahead of each position are built
// on the whole sequence and the rank takes its chunks' rows of them (no communication: every CP rank has the ids).
// Not the block math (model_layer.cpp and the blocks) and not where the stage runs it (model_stage.cpp).
#include <algorithm>
#include <cstring>

#include "model/model_impl.h"
#include "moetron/cp_attention.h"
#include "moetron/loss.h"
#include "moetron/trace.h"
#include "moetron/vocab_parallel.h"

namespace moetron {

using model_detail::add_inplace;
using model_detail::f32buf;

void Model::Impl::mtp_build() {
  if (Dm == 0 || !has_head) return;
  int slots = 1;
  for (const auto& st : stages)
    if (st.part.head) slots = st.part.slots;
  mtp_slot.assign(size_t(slots), std::vector<MtpBufs>(size_t(Dm)));
  for (auto& per : mtp_slot)
    for (auto& b : per) {
      // the rank's residual rows (TP: Nr = N / tp); the token ids of every row of the micro-batch (CP: its rows)
      b.hin = f32buf(Nr * d), b.erows = f32buf(Nr * d), b.rstd_e = f32buf(Nr), b.rstd_h = f32buf(Nr);
      b.cat = cbuf(Nr * 2 * d), b.hg = f32buf(Nr * d);
      b.tok.assign(size_t(N), 0), b.tgt.assign(size_t(N), -1);
    }
  mtp_scratch();
}

// The lane's own scratch (the EP overlap's lane 1 gets its own in make_lane; it uses lane 0's per-slot buffers, as
// it does the layers' saved activations: a slot's forward and backward may run on different lanes).
void Model::Impl::mtp_scratch() {
  if (Dm == 0 || !has_head) return;
  mtp_x = f32buf(N * d, MemCategory::Workspace), mtp_a = f32buf(N * 2 * d, MemCategory::Workspace);
  mtp_b = f32buf(N * d, MemCategory::Workspace);
  mtp_hfc = cbuf(N * d, MemCategory::Workspace), mtp_rstd = f32buf(N, MemCategory::Workspace);
}

double Model::Impl::mtp_head(int64_t k, const float* x, const int32_t* tgt, bool backward, float scale, float* g) {
  const MtpParams& mp = mtp[size_t(k)];
  const int lu = layer_unit(s.n_layers + k), hu = head == emb ? 0 : head_unit();
  const bool own_h = !fs_on || fs_slot_of[size_t(hu)] < 0;  // tied under FSDP: unit 0 may be held for the pass
  fs_acquire(lu, true, backward);
  if (own_h) fs_acquire(hu, true, backward && head != emb);
  {
    MT_TRACE("fwd.norm");
    norm_fwd_c(tp == 1 ? mtp_hfc : tp_fullc, mtp_rstd.data<float>(), x, P(mp.norm), Nr, d);
  }
  if (tp > 1) tp_gather_rows(mtp_hfc.raw(), tp_fullc.raw(), d * (f32 ? 4 : 2));  // the head sees every row
  const int64_t chunk = tp > 1 ? vocab_xent_default_chunk(V, tp) : linear_xent_default_chunk(V);
  const bf16* Wb = f32 ? nullptr : static_cast<const bf16*>(W(head));
  trace::Scope tr_loss("loss.fused_linear_xent");
  double ce = 0;
  if (!backward && tp > 1) {  // vocabulary-parallel (vocab_parallel.h): every TP rank gets the whole loss
    ce = f32 ? vocab_xent_fwd_f32(nullptr, mtp_hfc.data<float>(), P(head), tgt, N, d, V, tp_comm, 1.0f, chunk, wsp())
             : vocab_xent_fwd_bf16(nullptr, mtp_hfc.data<bf16>(), Wb, tgt, N, d, V, tp_comm, 1.0f, chunk, wsp());
  } else if (!backward) {
    ce = f32 ? linear_xent_fwd_f32(nullptr, mtp_hfc.data<float>(), P(head), tgt, N, d, V, 1.0f, chunk, wsp())
             : linear_xent_fwd_bf16(nullptr, mtp_hfc.data<bf16>(), Wb, tgt, N, d, V, 1.0f, chunk, wsp());
  } else {
    float* dhf = dh.data<float>();  // TP: dL/dh reduce-scattered to the rank's rows
    const auto RS = TpReduce::ReduceScatter;
    const double scaled =
        tp > 1 ? (f32 ? vocab_xent_fwd_bwd_f32(dhf, head_weight_grad(), mtp_hfc.data<float>(), P(head), tgt, N, d, V,
                                               tp_comm, RS, scale, chunk, wsp())
                      : vocab_xent_fwd_bwd_bf16(dhf, head_weight_grad(), mtp_hfc.data<bf16>(), Wb, tgt, N, d, V,
                                                tp_comm, RS, scale, chunk, wsp()))
        : f32  ? linear_xent_fwd_bwd_f32(dhf, head_weight_grad(), mtp_hfc.data<float>(), P(head), tgt, N, d, V, scale,
                                         chunk, wsp())
               : linear_xent_fwd_bwd_bf16(dhf, head_weight_grad(), mtp_hfc.data<bf16>(), Wb, tgt, N, d, V, scale,
                                          chunk, wsp());
    ce = scale != 0 ? scaled / scale : 0;
    tr_loss.stop();
    MT_TRACE("bwd.norm");
    rmsnorm_backward(g, G(mp.norm), dhf, x, P(mp.norm), mtp_rstd.data<float>(), Nr, d, wsp());
  }
  if (own_h) fs_release(hu);
  fs_release(lu);
  return ce;
}

void Model::Impl::mtp_forward(int slot, const float* h0, const int32_t* targets, bool backward, float ce_scale,
                              ForwardStats& st) {
  const int64_t T = m.seq_len_, Bn = m.B_;  // the whole sequences (CP: this rank holds its chunks' rows of them)
  st.mtp_ce.assign(size_t(Dm), 0.0), st.mtp_n.assign(size_t(Dm), 0);
  const float* hprev = h0;
  float* xk = mtp_x.data<float>();
  float* cat = mtp_a.data<float>();
  float* tmp = mtp_b.data<float>();
  for (int64_t k = 0; k < Dm; ++k) {
    const int64_t l = s.n_layers + k;
    MT_TRACE_MODULE("mtp", int(l));
    MtpBufs& b = mtp_buf(slot, k);
    const MtpParams& mp = mtp[size_t(k)];
    std::memcpy(b.hin.data<float>(), hprev, size_t(Nr * d) * 4);
    // Depth k + 1 at position i: input t_{i+k+1} = targets[i + k], target t_{i+k+2} = targets[i + k + 1], built on the
    // whole sequences (CP: then this rank's rows of them are taken).
    std::vector<int32_t> full_tok, full_tgt;
    int32_t* tok = b.tok.data();
    int32_t* tgt = b.tgt.data();
    if (cp > 1) {
      full_tok.resize(size_t(Bn * T)), full_tgt.resize(size_t(Bn * T));
      tok = full_tok.data(), tgt = full_tgt.data();
    }
    for (int64_t q = 0; q < Bn; ++q)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t t = q * T + i;
        const int32_t in = i + k < T ? targets[t + k] : -1;
        const int32_t out = i + k + 1 < T ? targets[t + k + 1] : -1;
        MT_CHECK(in < V && out < V, "Model::forward (mtp)", "target ", std::max(in, out), " outside the vocabulary [0, ",
                 V, ")");
        tok[t] = in >= 0 ? in : 0;
        tgt[t] = in >= 0 ? out : -1;
      }
    if (cp > 1) {
      cp_take_rows(b.tok.data(), tok, Bn, T, 4, cp, cp_rank);
      cp_take_rows(b.tgt.data(), tgt, Bn, T, 4, cp, cp_rank);
    }
    int64_t n_valid = 0;  // this rank's positions in the depth's loss (CP: summed over the group by the trainer)
    for (int64_t t = 0; t < N; ++t) n_valid += b.tgt[size_t(t)] >= 0;
    {  // the embedding rows of the input tokens (TP: the vocabulary-parallel lookup, reduce-scattered to the rows)
      MT_TRACE("fwd.embed");
      const bool own0 = fs_on && fs_slot_of[0] < 0;
      if (own0) fs_acquire(0, true, false);
      const float* E0 = P(emb);
      float* er = b.erows.data<float>();
      if (tp > 1) {
        vocab_embed_forward(er, E0, b.tok.data(), N, d, V, tp_comm, TpReduce::ReduceScatter, tp_full.raw());
      } else {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < N; ++t) std::memcpy(er + t * d, E0 + int64_t(b.tok[size_t(t)]) * d, size_t(d) * 4);
      }
      if (own0) fs_release(0);
    }
    fs_acquire(layer_unit(l), true, false);
    {
      MT_TRACE("fwd.norm");  // [enorm(e) | hnorm(h)] rows of 2d, then its compute copy
      const float eps = float(s.norm_eps);
      rmsnorm_forward(tmp, nullptr, b.rstd_e.data<float>(), b.erows.data<float>(), P(mp.enorm), Nr, d, eps);
      for (int64_t t = 0; t < Nr; ++t) std::memcpy(cat + t * 2 * d, tmp + t * d, size_t(d) * 4);
      rmsnorm_forward(tmp, nullptr, b.rstd_h.data<float>(), b.hin.data<float>(), P(mp.hnorm), Nr, d, eps);
      for (int64_t t = 0; t < Nr; ++t) std::memcpy(cat + t * 2 * d + d, tmp + t * d, size_t(d) * 4);
      copy_c(b.cat, cat, Nr * 2 * d);
    }
    {
      MT_TRACE("fwd.mtp.eh_proj");  // TP: whole on every rank, on its rows
      lin_fwd(xk, b.cat.raw(), mp.eh_proj, Nr, 2 * d, d);
    }
    fs_release(layer_unit(l));
    forward_layer(l, xk);  // xk: h^{k+1}
    const float scale = float(double(ce_scale) * double(T) / double(T - k - 1) * s.mtp_loss_weight / double(Dm));
    st.mtp_ce[size_t(k)] = mtp_head(k, xk, b.tgt.data(), backward, scale, b.hg.data<float>());
    st.mtp_n[size_t(k)] = n_valid;
    hprev = xk;
  }
}

void Model::Impl::mtp_backward(int slot, float* g) {
  float* dcat = mtp_a.data<float>();
  float* tmp = mtp_b.data<float>();
  for (int64_t k = Dm - 1; k >= 0; --k) {
    const int64_t l = s.n_layers + k;
    MT_TRACE_MODULE("mtp", int(l));
    MtpBufs& b = mtp_buf(slot, k);
    const MtpParams& mp = mtp[size_t(k)];
    float* gk = b.hg.data<float>();  // dL/dh^{k+1}: its head's, plus depth k + 2's through its hnorm
    backward_layer(l, gk);           // now dL/d(eh_proj output)
    fs_acquire(layer_unit(l), true, true);
    {
      MT_TRACE("bwd.mtp.eh_proj");
      const void* gk_c = to_c(dyc, gk, Nr * d);
      lin_dgrad(dcat, gk_c, mp.eh_proj, Nr, 2 * d, d);
      lin_wgrad(mp.eh_proj, b.cat.raw(), gk_c, Nr, 2 * d, d);  // TP: partial over the rows (summed over TP)
    }
    float* dprev = k > 0 ? mtp_buf(slot, k - 1).hg.data<float>() : g;
    float* de = mtp_x.data<float>();
    {
      MT_TRACE("bwd.norm");
      for (int64_t t = 0; t < Nr; ++t) std::memcpy(tmp + t * d, dcat + t * 2 * d + d, size_t(d) * 4);
      rmsnorm_backward(de, G(mp.hnorm), tmp, b.hin.data<float>(), P(mp.hnorm), b.rstd_h.data<float>(), Nr, d, wsp());
      add_inplace(dprev, de, Nr * d);
      for (int64_t t = 0; t < Nr; ++t) std::memcpy(tmp + t * d, dcat + t * 2 * d, size_t(d) * 4);
      rmsnorm_backward(de, G(mp.enorm), tmp, b.erows.data<float>(), P(mp.enorm), b.rstd_e.data<float>(), Nr, d, wsp());
    }
    fs_release(layer_unit(l));
    {  // the embedding rows' gradient, in token order (deterministic), into the head stage's embedding gradient
      MT_TRACE("bwd.embed");
      float* gE = tied_hg.data<float>();
      // TP: the rows all-gathered, then this rank's vocabulary rows in the same order (vocab_parallel.h)
      if (tp > 1) vocab_embed_backward(gE, de, b.tok.data(), N, d, V, tp_comm, TpReduce::ReduceScatter, tp_full.raw());
      for (int64_t t = 0; t < N && tp == 1; ++t) {
        float* dst = gE + int64_t(b.tok[size_t(t)]) * d;
        const float* src = de + t * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) dst[i] += src[i];
      }
    }
  }
  // FSDP on a head stage without the embedding stage (PP): the depths' rows join the embedding copy's unit here, per
  // micro-batch, before its reduce-scatter (with the embedding stage on this rank its backward folds them:
  // embed_backward); the stages' shards are then exchanged after the step (exchange_tied_grads).
  if (fs_on && !has_emb) {
    fs_acquire(0, false, true);
    model_detail::add_inplace(G(emb), tied_hg.data<float>(), Vl * d);
    tied_hg.zero_();
    fs_release(0);
  }
}

}  // namespace moetron
