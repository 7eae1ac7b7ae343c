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
// Not the block math (model_layer.cpp and the blocks) and not where the stage runs it (model_stage.cpp).
#include <algorithm>
#include <cstring>

#include "model/model_impl.h"
#include "moetron/loss.h"
#include "moetron/trace.h"

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
      b.hin = f32buf(N * d), b.erows = f32buf(N * d), b.rstd_e = f32buf(N), b.rstd_h = f32buf(N);
      b.cat = cbuf(N * 2 * d), b.hg = f32buf(N * d);
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
    norm_fwd_c(mtp_hfc, mtp_rstd.data<float>(), x, P(mp.norm), N, d);
  }
  const int64_t chunk = linear_xent_default_chunk(V);
  const bf16* Wb = f32 ? nullptr : static_cast<const bf16*>(W(head));
  trace::Scope tr_loss("loss.fused_linear_xent");
  double ce = 0;
  if (!backward) {
    ce = f32 ? linear_xent_fwd_f32(nullptr, mtp_hfc.data<float>(), P(head), tgt, N, d, V, 1.0f, chunk, wsp())
             : linear_xent_fwd_bf16(nullptr, mtp_hfc.data<bf16>(), Wb, tgt, N, d, V, 1.0f, chunk, wsp());
  } else {
    float* dhf = dh.data<float>();
    const double scaled =
        f32 ? linear_xent_fwd_bwd_f32(dhf, head_weight_grad(), mtp_hfc.data<float>(), P(head), tgt, N, d, V, scale,
                                      chunk, wsp())
            : linear_xent_fwd_bwd_bf16(dhf, head_weight_grad(), mtp_hfc.data<bf16>(), Wb, tgt, N, d, V, scale, chunk,
                                       wsp());
    ce = scale != 0 ? scaled / scale : 0;
    tr_loss.stop();
    MT_TRACE("bwd.norm");
    rmsnorm_backward(g, G(mp.norm), dhf, x, P(mp.norm), mtp_rstd.data<float>(), N, d, wsp());
  }
  if (own_h) fs_release(hu);
  fs_release(lu);
  return ce;
}

void Model::Impl::mtp_forward(int slot, const float* h0, const int32_t* targets, bool backward, float ce_scale,
                              ForwardStats& st) {
  const int64_t T = m.seq_len_, Bn = m.B_;
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
    std::memcpy(b.hin.data<float>(), hprev, size_t(N * d) * 4);
    // Depth k + 1 at position i: input t_{i+k+1} = targets[i + k], target t_{i+k+2} = targets[i + k + 1].
    int64_t n_valid = 0;
    for (int64_t q = 0; q < Bn; ++q)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t t = q * T + i;
        const int32_t in = i + k < T ? targets[t + k] : -1;
        const int32_t out = i + k + 1 < T ? targets[t + k + 1] : -1;
        MT_CHECK(in < V && out < V, "Model::forward (mtp)", "target ", std::max(in, out), " outside the vocabulary [0, ",
                 V, ")");
        b.tok[size_t(t)] = in >= 0 ? in : 0;
        b.tgt[size_t(t)] = in >= 0 ? out : -1;
        n_valid += b.tgt[size_t(t)] >= 0;
      }
    {  // the embedding rows of the input tokens
      MT_TRACE("fwd.embed");
      const bool own0 = fs_on && fs_slot_of[0] < 0;
      if (own0) fs_acquire(0, true, false);
      const float* E0 = P(emb);
      float* er = b.erows.data<float>();
#pragma omp parallel for schedule(static)
      for (int64_t t = 0; t < N; ++t) std::memcpy(er + t * d, E0 + int64_t(b.tok[size_t(t)]) * d, size_t(d) * 4);
      if (own0) fs_release(0);
    }
    fs_acquire(layer_unit(l), true, false);
    {
      MT_TRACE("fwd.norm");  // [enorm(e) | hnorm(h)] rows of 2d, then its compute copy
      rmsnorm_forward(tmp, nullptr, b.rstd_e.data<float>(), b.erows.data<float>(), P(mp.enorm), N, d, float(s.norm_eps));
      for (int64_t t = 0; t < N; ++t) std::memcpy(cat + t * 2 * d, tmp + t * d, size_t(d) * 4);
      rmsnorm_forward(tmp, nullptr, b.rstd_h.data<float>(), b.hin.data<float>(), P(mp.hnorm), N, d, float(s.norm_eps));
      for (int64_t t = 0; t < N; ++t) std::memcpy(cat + t * 2 * d + d, tmp + t * d, size_t(d) * 4);
      copy_c(b.cat, cat, N * 2 * d);
    }
    {
      MT_TRACE("fwd.mtp.eh_proj");
      lin_fwd(xk, b.cat.raw(), mp.eh_proj, N, 2 * d, d);
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
      const void* gk_c = to_c(dyc, gk, N * d);
      lin_dgrad(dcat, gk_c, mp.eh_proj, N, 2 * d, d);
      lin_wgrad(mp.eh_proj, b.cat.raw(), gk_c, N, 2 * d, d);
    }
    float* dprev = k > 0 ? mtp_buf(slot, k - 1).hg.data<float>() : g;
    float* de = mtp_x.data<float>();
    {
      MT_TRACE("bwd.norm");
      for (int64_t t = 0; t < N; ++t) std::memcpy(tmp + t * d, dcat + t * 2 * d + d, size_t(d) * 4);
      rmsnorm_backward(de, G(mp.hnorm), tmp, b.hin.data<float>(), P(mp.hnorm), b.rstd_h.data<float>(), N, d, wsp());
      add_inplace(dprev, de, N * d);
      for (int64_t t = 0; t < N; ++t) std::memcpy(tmp + t * d, dcat + t * 2 * d, size_t(d) * 4);
      rmsnorm_backward(de, G(mp.enorm), tmp, b.erows.data<float>(), P(mp.enorm), b.rstd_e.data<float>(), N, d, wsp());
    }
    fs_release(layer_unit(l));
    {  // the embedding rows' gradient, in token order (deterministic), into the head stage's embedding gradient
      MT_TRACE("bwd.embed");
      float* gE = tied_hg.data<float>();
      for (int64_t t = 0; t < N; ++t) {
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
