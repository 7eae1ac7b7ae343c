// model_attention.cpp: the attention block of a decoder layer, forward and backward: the q/k/v projections
// (fused wqkv for MHA/GQA, with Qwen3's per-head q/k RMSNorm under qk_norm; MLA's low-rank q and kv paths with
// their norms and the shared rope key), rope,
// the attention core (softmax(q k^T) v, also what selective "attention_core" recompute re-runs) and the
// output projection's backward. The block's input is the normed h1 (b.h1c); its output is b.ao / b.aoc.
// Not the attention norm, the output projection's forward or the residual (model_layer.cpp), and not the
// attention kernels themselves (include/moetron/attention.h).
#include <cmath>
#include <cstring>

#include "model/model_impl.h"
#include "moetron/cp_attention.h"
#include "moetron/rope.h"
#include "moetron/trace.h"

namespace moetron {

AttnDims Model::Impl::attn_dims() const {
  AttnDims a{};
  a.B = m.B_, a.T = m.T_, a.Hq = H, a.Hkv = Hkv, a.Dqk = Dqk, a.Dv = Dv;
  if (s.attn.type == AttnType::MLA) {
    a.ldq = H * Dqk, a.head_q = Dqk;
    a.ldk = H * Dqk, a.head_k = Dqk;
    a.ldv = H * (dn + Dv), a.head_v = dn + Dv;
  } else {
    a.ldq = a.ldk = a.ldv = Wqkv;
    a.head_q = a.head_k = a.head_v = hd;
  }
  a.ldo = H * Dv, a.head_o = Dv;
  a.scale = float(1.0 / std::sqrt(double(Dqk)));
  a.prec = attn16 ? AttnPrec::BF16 : AttnPrec::F32;
  return a;
}

void Model::Impl::attn_forward(Layer& L, LayerBufs& b) {
  {
  MT_TRACE("fwd.attn.proj");
  const int64_t B = m.B_, T = m.T_;
  const void* h = b.h1c.raw();
  const float* cs = rope_cos.data<float>();
  const float* sn = rope_sin.data<float>();
  if (s.attn.type != AttnType::MLA) {
    float* qkv = b.qkv.data<float>();
    lin_fwd(qkv, h, L.wqkv, N, d, Wqkv);
    if (L.q_head_norm >= 0) qk_norm_forward(L, b);
    rope_forward(qkv, B, T, H + Hkv, Wqkv, hd, 0, hd, cs, sn);  // q heads then k heads are adjacent
  } else {
    float* q = b.q.data<float>();
    if (rq > 0) {
      lin_fwd(b.cq.data<float>(), h, L.wdq, N, d, rq);
      norm_fwd_c(b.cqnc, b.rstdq.data<float>(), b.cq.data<float>(), P(L.q_norm), N, rq);
      lin_fwd(q, b.cqnc.raw(), L.wuq, N, rq, H * Dqk);
    } else {
      lin_fwd(q, h, L.wq, N, d, H * Dqk);
    }
    rope_forward(q, B, T, H, H * Dqk, Dqk, dn, dr, cs, sn);
    lin_fwd(b.ckv.data<float>(), h, L.wdkv, N, d, rkv);
    norm_fwd_c(b.ckvnc, b.rstdkv.data<float>(), b.ckv.data<float>(), P(L.kv_norm), N, rkv);
    float* kpe = b.kpe.data<float>();
    lin_fwd(kpe, h, L.wkr, N, d, dr);
    rope_forward(kpe, B, T, 1, dr, dr, 0, dr, cs, sn);
    float* kv = b.kv.data<float>();
    lin_fwd(kv, b.ckvnc.raw(), L.wukv, N, rkv, H * (dn + Dv));
    float* k = b.k.data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; ++t)
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(k + (t * H + h) * Dqk, kv + (t * H + h) * (dn + Dv), size_t(dn) * 4);
        std::memcpy(k + (t * H + h) * Dqk + dn, kpe + t * dr, size_t(dr) * 4);
      }
  }
  }
  attn_core(b);
}

// qk_norm: each token row of qkv holds H q heads then Hkv k heads (then v), hd each. The rmsnorm kernels take
// contiguous rows, so the q heads of every token are gathered into [N*H, hd] and the k heads into [N*Hkv, hd]
// (b.qkx, the pre-norm values the backward needs), normed into scratch and written back over qkv. Row-wise, so the
// result does not depend on the gathering; under TP each rank norms its own heads with the whole weights.
void Model::Impl::qk_norm_forward(Layer& L, LayerBufs& b) {
  MT_TRACE("fwd.attn.qk_norm");
  float* qkv = b.qkv.data<float>();
  float* xq = b.qkx.data<float>();
  float* xk = xq + N * H * hd;
  float* y = s_f3.data<float>();  // [N*H, hd] then [N*Hkv, hd]
  const int64_t nq = H * hd, nk = Hkv * hd;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    std::memcpy(xq + t * nq, qkv + t * Wqkv, size_t(nq) * 4);
    std::memcpy(xk + t * nk, qkv + t * Wqkv + nq, size_t(nk) * 4);
  }
  float* rstd = b.qkrstd.data<float>();
  const float eps = float(s.norm_eps);
  rmsnorm_forward(y, nullptr, rstd, xq, P(L.q_head_norm), N * H, hd, eps);
  rmsnorm_forward(y + N * nq, nullptr, rstd + N * H, xk, P(L.k_head_norm), N * Hkv, hd, eps);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    std::memcpy(qkv + t * Wqkv, y + t * nq, size_t(nq) * 4);
    std::memcpy(qkv + t * Wqkv + nq, y + N * nq + t * nk, size_t(nk) * 4);
  }
}

// dqkv [N, Wqkv]: the gradient w.r.t. the normed q / k heads in, w.r.t. the projection's q / k out (v untouched).
// The weight gradients sum over this rank's (token, head) rows: a partial sum under TP (TpKind::Partial).
void Model::Impl::qk_norm_backward(Layer& L, LayerBufs& b, float* dqkv) {
  MT_TRACE("bwd.attn.qk_norm");
  const float* xq = b.qkx.data<float>();
  const float* xk = xq + N * H * hd;
  const float* rstd = b.qkrstd.data<float>();
  float* dy = s_f2.data<float>();  // gathered like b.qkx
  float* dx = s_f3.data<float>();
  const int64_t nq = H * hd, nk = Hkv * hd;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    std::memcpy(dy + t * nq, dqkv + t * Wqkv, size_t(nq) * 4);
    std::memcpy(dy + N * nq + t * nk, dqkv + t * Wqkv + nq, size_t(nk) * 4);
  }
  rmsnorm_backward(dx, G(L.q_head_norm), dy, xq, P(L.q_head_norm), rstd, N * H, hd, wsp());
  rmsnorm_backward(dx + N * nq, G(L.k_head_norm), dy + N * nq, xk, P(L.k_head_norm), rstd + N * H, N * Hkv, hd, wsp());
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    std::memcpy(dqkv + t * Wqkv, dx + t * nq, size_t(nq) * 4);
    std::memcpy(dqkv + t * Wqkv + nq, dx + N * nq + t * nk, size_t(nk) * 4);
  }
}

// softmax(q k^T) v and its compute copy for the output projection (what attention_core recompute redoes).
void Model::Impl::attn_core(LayerBufs& b) {
  MT_TRACE("fwd.attn.core");
  AttnDims ad = attn_dims();
  const float *q, *k, *v;
  if (s.attn.type != AttnType::MLA) {
    const float* qkv = b.qkv.data<float>();
    q = qkv, k = qkv + H * hd, v = qkv + (H + Hkv) * hd;
  } else {
    q = b.q.data<float>(), k = b.k.data<float>(), v = b.kv.data<float>() + dn;
  }
  if (cp > 1) cp_attention_forward(b.ao.data<float>(), b.lse.data<float>(), q, k, v, ad, m.seq_len_, cp_comm);
  else attention_forward(b.ao.data<float>(), b.lse.data<float>(), q, k, v, ad, wsp());
  to_c(b.aoc, b.ao.data<float>(), N * H * Dv);  // aoc is ao itself in fp32 mode
}

// The attention core's backward: the kernel, or under CP ring attention over the CP group.
void Model::Impl::attn_core_backward(float* dq, float* dk, float* dv, const float* dao, LayerBufs& b, const float* q,
                                     const float* k, const float* v, const AttnDims& ad) {
  if (cp > 1)
    cp_attention_backward(dq, dk, dv, dao, b.ao.data<float>(), b.lse.data<float>(), q, k, v, ad, m.seq_len_, cp_comm);
  else
    attention_backward(dq, dk, dv, dao, b.ao.data<float>(), b.lse.data<float>(), q, k, v, ad, wsp());
}

// dh (out) = gradient w.r.t. the attention block's input h1 (before the attention norm backward).
// do_c: the gradient of the attention output o, in the compute dtype.
void Model::Impl::attn_backward(Layer& L, LayerBufs& b, const void* do_c, float* dhout) {
  const int64_t B = m.B_, T = m.T_;
  const void* h = b.h1c.raw();
  AttnDims ad = attn_dims();
  const float* cs = rope_cos.data<float>();
  const float* sn = rope_sin.data<float>();
  float* dao = s_dao.data<float>();
  {
    MT_TRACE("bwd.attn.out_proj");
    lin_wgrad(L.wo, b.aoc.raw(), do_c, N, H * Dv, d);
    lin_dgrad(dao, do_c, L.wo, N, H * Dv, d);
  }
  if (s.attn.type != AttnType::MLA) {
    const float* qkv = b.qkv.data<float>();
    float* dqkv = s_f1.data<float>();
    {
    MT_TRACE("bwd.attn.core");
    attn_core_backward(dqkv, dqkv + H * hd, dqkv + (H + Hkv) * hd, dao, b, qkv, qkv + H * hd, qkv + (H + Hkv) * hd,
                       ad);
    }
    MT_TRACE("bwd.attn.proj");
    rope_backward(dqkv, B, T, H + Hkv, Wqkv, hd, 0, hd, cs, sn);
    if (L.q_head_norm >= 0) qk_norm_backward(L, b, dqkv);
    const void* dqkv_c = to_c(s_c1, dqkv, N * Wqkv);
    lin_wgrad(L.wqkv, h, dqkv_c, N, d, Wqkv);
    lin_dgrad(dhout, dqkv_c, L.wqkv, N, d, Wqkv);
    return;
  }
  // MLA
  float* dq = m_dq.data<float>();
  float* dk = m_dk.data<float>();
  float* dkv = m_dkv.data<float>();
  const float* q = b.q.data<float>();
  const float* kv = b.kv.data<float>();
  // dv lands directly in its slot of dkv (same strides as v); dk_nope is copied next to it afterwards.
  {
  MT_TRACE("bwd.attn.core");
  attn_core_backward(dq, dk, dkv + dn, dao, b, q, b.k.data<float>(), kv + dn, ad);
  }
  MT_TRACE("bwd.attn.proj");
  float* dkpe = m_dkpe.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* dp = dkpe + t * dr;
    for (int64_t i = 0; i < dr; ++i) dp[i] = 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      const float* src = dk + (t * H + h) * Dqk;
      std::memcpy(dkv + (t * H + h) * (dn + Dv), src, size_t(dn) * 4);
      for (int64_t i = 0; i < dr; ++i) dp[i] += src[dn + i];
    }
  }
  // Under TP the shared rope key's gradient sums over the heads this rank holds: summed over the TP group.
  tp_sum(dkpe, N * dr);
  rope_backward(dq, B, T, H, H * Dqk, Dqk, dn, dr, cs, sn);
  rope_backward(dkpe, B, T, 1, dr, dr, 0, dr, cs, sn);
  // kv up-projection and kv norm
  const void* t = to_c(s_c1, dkv, N * H * (dn + Dv));
  lin_wgrad(L.wukv, b.ckvnc.raw(), t, N, rkv, H * (dn + Dv));
  float* dckvn = s_f2.data<float>();
  lin_dgrad(dckvn, t, L.wukv, N, rkv, H * (dn + Dv));
  tp_sum(dckvn, N * rkv);  // TP: wukv's columns are this rank's heads, so this is a partial sum
  float* dckv = m_dckv.data<float>();
  rmsnorm_backward(dckv, G(L.kv_norm), dckvn, b.ckv.data<float>(), P(L.kv_norm), b.rstdkv.data<float>(), N, rkv, wsp());
  // The down projections and their norms are replicated under TP (every rank has the same gradients after the sums
  // above): their input-gradient terms join the partial sum dhout on one TP rank only (tp_lead).
  const bool rep = tp_lead();
  t = to_c(s_c1, dckv, N * rkv);
  lin_wgrad(L.wdkv, h, t, N, d, rkv);
  if (rep) lin_dgrad(dhout, t, L.wdkv, N, d, rkv);
  else std::memset(dhout, 0, size_t(N * d) * 4);
  t = to_c(s_c1, dkpe, N * dr);
  lin_wgrad(L.wkr, h, t, N, d, dr);
  if (rep) lin_dgrad(dhout, t, L.wkr, N, d, dr, true);
  // q path
  t = to_c(s_c1, dq, N * H * Dqk);
  if (rq > 0) {
    lin_wgrad(L.wuq, b.cqnc.raw(), t, N, rq, H * Dqk);
    float* dcqn = s_f2.data<float>();
    lin_dgrad(dcqn, t, L.wuq, N, rq, H * Dqk);
    tp_sum(dcqn, N * rq);
    float* dcq = m_dcq.data<float>();
    rmsnorm_backward(dcq, G(L.q_norm), dcqn, b.cq.data<float>(), P(L.q_norm), b.rstdq.data<float>(), N, rq, wsp());
    t = to_c(s_c1, dcq, N * rq);
    lin_wgrad(L.wdq, h, t, N, d, rq);
    if (rep) lin_dgrad(dhout, t, L.wdq, N, d, rq, true);
  } else {
    lin_wgrad(L.wq, h, t, N, d, H * Dqk);
    lin_dgrad(dhout, t, L.wq, N, d, H * Dqk, true);
  }
}

}  // namespace moetron
