// model.cpp: the decoder's parameters, buffers, forward and backward. See model.h.
// Per layer: x_mid = x + Attn(RMSNorm(x)); x_out = x_mid + FFN(RMSNorm(x_mid)), FFN dense SwiGLU or MoE
// (router -> permute -> grouped gate/up GEMM -> SwiGLU -> grouped down GEMM -> weighted combine, plus
// shared experts as one dense SwiGLU of width n_shared * moe_inter_size).
// Matmuls take operands in the compute dtype (bf16, or fp32 on CPUs without native bf16; see
// resolve_compute_dtype) with fp32 accumulation; the residual stream, norms, softmax, router and losses are
// fp32. A buffer named *c holds a GEMM operand in the compute dtype: in fp32 mode it is the fp32 tensor
// itself where one exists (no copy), otherwise its bf16 copy. Weights are stored input-major ([in, out])
// except the embedding and the head ([V, d]).
#include "moetron/model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "moetron/attention.h"
#include "moetron/check.h"
#include "moetron/fsdp.h"
#include "moetron/gemm.h"
#include "moetron/grouped_gemm.h"
#include "moetron/loss.h"
#include "moetron/norm.h"
#include "moetron/permute.h"
#include "moetron/rng.h"
#include "moetron/rope.h"
#include "moetron/router.h"
#include "moetron/runtime.h"
#include "moetron/swiglu.h"
#include "moetron/trace.h"

namespace moetron {

namespace {

void add_inplace(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

Tensor f32buf(int64_t n, MemCategory c = MemCategory::Activations) {
  return Tensor::zeros({n}, DType::F32, c);
}
Tensor i32buf(int64_t n, MemCategory c = MemCategory::Activations) {
  return Tensor::zeros({n}, DType::I32, c);
}

}  // namespace

// Saved activations of one layer (a checkpointed layer shares one set with the others of its kind and
// keeps only its input).
struct LayerBufs {
  Tensor rstd1, h1c, x_mid, rstd2, h2, h2c;
  // attention (mha/gqa)
  Tensor qkv;
  // attention (mla)
  Tensor cq, rstdq, cqnc, q, ckv, rstdkv, ckvnc, kpe, kv, k;
  Tensor ao, aoc, lse;
  // dense ffn / shared experts
  Tensor gu, actc;
  // moe
  Tensor logits, scores, topk_idx, topk_w, counts, kept, offsets, row_of, token_of, slot_of, xpc, egu, eactc, ez;
  int64_t R = 0;         // routed rows of the last forward (received rows under EP)
  int64_t rows_cap = 0;  // rows xpc / egu / eactc / ez hold (grows under EP when routing is skewed)
};

struct Layer {
  bool moe = false;
  bool recompute = false;                                 // full: re-run the whole layer forward
  bool sel_norm = false, sel_attn = false, sel_act = false;  // selective: recompute these modules
  int moe_index = -1;
  // parameter indices (-1 = absent)
  int attn_norm = -1, ffn_norm = -1;
  int wqkv = -1, wo = -1;                                          // mha/gqa
  int wq = -1, wdq = -1, q_norm = -1, wuq = -1, wdkv = -1, wkr = -1, kv_norm = -1, wukv = -1;  // mla
  int w13 = -1, w2 = -1;                                           // dense ffn
  int gate = -1, we13 = -1, we2 = -1, ws13 = -1, ws2 = -1;         // moe
  Tensor x_in;        // [N, d] saved layer input (always)
  LayerBufs* bufs = nullptr;
  // packed expert weights (refreshed by sync_weights)
  Tensor p13f, p13d, p2f, p2d;
  GroupedPackedWeights pk13f, pk13d, pk2f, pk2d;
  Tensor bias;        // [E] aux-free expert bias
  std::vector<int64_t> count_acc;  // tokens per expert since last take
  std::unique_ptr<EpDispatch> disp;  // expert parallelism: this layer's dispatcher (keeps its layout for backward)
};

struct Model::Impl {
  Model& m;
  const ModelSpec& s;
  int64_t N, d, V;
  // attention dims
  int64_t H, Hkv, hd, Dqk, Dv, dn = 0, dr = 0, rq = 0, rkv = 0, Wqkv = 0;
  int64_t F = 0, E = 0, K = 0, Fe = 0, Fs = 0, Rmax = 0;
  // expert parallelism: El experts held here, the first is e0; ep = EP group size
  int64_t El = 0, e0 = 0;
  int ep = 1;
  ModelParallel par;
  Comm ep_comm;
  Tensor send_idx, dwr, iota_r, zero_r;  // EP scratch: slots sent (-1 = dropped), per-row dw, row maps
  int64_t scratch_rows = 0, sel_rows_cap = 0;
  std::vector<Layer> layers;
  std::vector<std::unique_ptr<LayerBufs>> owned_bufs;
  Tensor wc;  // bf16 copy of every parameter (bf16 mode only: fp32 mode multiplies the masters)
  Tensor rope_cos, rope_sin;
  Tensor xf, rstdf, hfc;  // final norm
  int emb = -1, head = -1, final_norm = -1;
  // scratch
  Tensor x, dx, dh, dh2, dyc, s_f1, s_f2, s_c1, s_c2, s_f3, s_dao, dtopk_w, dlogits;
  Tensor m_dq, m_dk, m_dkv, m_dkpe, m_dcq, m_dckv;  // MLA backward scratch
  Tensor ws;  // workspace for kernels (max of all needs)
  size_t ws_bytes = 0;
  RouterConfig rcfg;
  double last_aux = 0, last_z = 0;
  int64_t last_dropped = 0;
  float cur_aux_scale = 1.0f;
  bool recomputing = false;  // re-running a checkpointed layer's forward: statistics are not counted twice
  Tensor recompute_out;  // [N, d] output of a recomputed layer (discarded: it equals the next x_in)

  explicit Impl(Model& model) : m(model), s(model.spec_) {}

  // ---- FSDP mode (see model.h, fsdp.h): units 0 = embedding, 1..n_layers = decoder layers,
  // n_layers + 1 = final norm + head (tied: the head is the embedding, unit 0). A unit in use lives in a
  // slot: fp32 parameters, their bf16 copy, the packed expert weights (MoE layers), fp32 gradients.
  struct FsSlot {
    Tensor p, wc, g, p13f, p13d, p2f, p2d;
    int unit = -1;
    bool grads = false;
  };
  bool fs_on = false;
  const FsdpOptions* fs_opts = nullptr;  // construction only
  std::vector<FsSlot> fs_slots;
  std::vector<int> fs_slot_of;      // [unit] slot index or -1
  std::vector<int> fs_unit;         // [param] unit
  std::vector<int64_t> fs_local;    // [param] offset in the unit slot
  FsSlot& fs_slot(int i) {
    const int k = fs_slot_of[size_t(fs_unit[size_t(i)])];
    MT_CHECK(k >= 0, "Model(fsdp)", "parameter ", m.params_[size_t(i)].name, " used while its unit ",
             fs_unit[size_t(i)], " is not gathered");
    return fs_slots[size_t(k)];
  }
  void fs_build();
  void fs_acquire(int u, bool params, bool grads);
  void fs_release(int u);

  // Parameter i's fp32 value, gradient and bf16 copy: in the flat buffers, or in FSDP mode in its unit's slot.
  float* P(int i) {
    return fs_on ? fs_slot(i).p.data<float>() + fs_local[i] : m.pbuf_.data<float>() + m.params_[i].offset;
  }
  float* G(int i) {
    return fs_on ? fs_slot(i).g.data<float>() + fs_local[i] : m.gbuf_.data<float>() + m.params_[i].offset;
  }
  // Parameter i as a GEMM operand: the fp32 master itself in fp32 mode, else its bf16 copy.
  const void* W(int i) {
    if (f32) return P(i);
    return fs_on ? fs_slot(i).wc.data<bf16>() + fs_local[i] : wc.data<bf16>() + m.params_[i].offset;
  }
  void* wsp() { return ws.defined() ? ws.raw() : nullptr; }

  // ---- the compute dtype: every call that depends on it goes through these ----
  bool f32 = false;  // compute dtype FP32 (else BF16)
  GemmPrec prec() const { return f32 ? GemmPrec::F32 : GemmPrec::BF16; }
  Tensor cbuf(int64_t n, MemCategory c = MemCategory::Activations) const {
    return Tensor::zeros({n}, f32 ? DType::F32 : DType::BF16, c);
  }
  // A compute-dtype buffer that in fp32 mode is the fp32 tensor `same` itself.
  Tensor cbuf_or(const Tensor& same, int64_t n) const { return f32 ? same : cbuf(n); }
  // src in the compute dtype: src itself in fp32 mode (nothing copied), else rounded to bf16 into dst.
  const void* to_c(Tensor& dst, const float* src, int64_t n) {
    if (f32) return src;
    f32_to_bf16(dst.data<bf16>(), src, n);
    return dst.raw();
  }
  // src copied into the compute-dtype buffer dst (rounded to bf16 in bf16 mode).
  void copy_c(Tensor& dst, const float* src, int64_t n) {
    if (f32) std::memcpy(dst.raw(), src, size_t(n) * 4);
    else f32_to_bf16(dst.data<bf16>(), src, n);
  }
  // y[N,out] (+)= x[N,in] · W[in,out]
  void lin_fwd(float* y, const void* x, const void* w, int64_t rows, int64_t in, int64_t out, bool acc = false) {
    gemm_c(Trans::N, Trans::N, rows, out, in, x, in, w, out, acc ? 1.0f : 0.0f, y, out);
  }
  // dx[N,in] (+)= dy[N,out] · W[in,out]^T
  void lin_dgrad(float* dx, const void* dy, const void* w, int64_t rows, int64_t in, int64_t out, bool acc = false) {
    gemm_c(Trans::N, Trans::T, rows, in, out, dy, out, w, out, acc ? 1.0f : 0.0f, dx, in);
  }
  // dW[in,out] += x[N,in]^T · dy[N,out]
  void lin_wgrad(float* dw, const void* x, const void* dy, int64_t rows, int64_t in, int64_t out) {
    gemm_c(Trans::T, Trans::N, in, out, rows, x, in, dy, out, 1.0f, dw, out);
  }
  void gemm_c(Trans ta, Trans tb, int64_t M, int64_t Nn, int64_t Kk, const void* A, int64_t lda, const void* B,
              int64_t ldb, float beta, float* C, int64_t ldc) {
    if (f32)
      gemm_f32(ta, tb, M, Nn, Kk, 1.0f, static_cast<const float*>(A), lda, static_cast<const float*>(B), ldb, beta, C,
               ldc);
    else
      gemm_bf16(ta, tb, M, Nn, Kk, 1.0f, static_cast<const bf16*>(A), lda, static_cast<const bf16*>(B), ldb, beta, C,
                ldc);
  }
  // RMSNorm of x into y (fp32, kept) and yc (its compute copy; the same tensor in fp32 mode).
  void norm_fwd(float* y, Tensor& yc, float* rstd, const float* x, const float* w, int64_t rows, int64_t C) {
    rmsnorm_forward(y, f32 ? nullptr : yc.data<bf16>(), rstd, x, w, rows, C, float(s.norm_eps));
  }
  // RMSNorm whose output only feeds GEMMs: written once, in the compute dtype (fp32 scratch in bf16 mode).
  void norm_fwd_c(Tensor& yc, float* rstd, const float* x, const float* w, int64_t rows, int64_t C) {
    if (f32) rmsnorm_forward(yc.data<float>(), nullptr, rstd, x, w, rows, C, float(s.norm_eps));
    else rmsnorm_forward(s_f3.data<float>(), yc.data<bf16>(), rstd, x, w, rows, C, float(s.norm_eps));
  }
  // SwiGLU whose output only feeds the down GEMM: into hc in the compute dtype (scratch: fp32 in bf16 mode).
  void swiglu_c(Tensor& hc, float* scratch, const float* gu, int64_t rows, int64_t Fw) {
    if (f32) swiglu_forward(hc.data<float>(), nullptr, gu, rows, Fw);
    else swiglu_forward(scratch, hc.data<bf16>(), gu, rows, Fw);
  }
  // Grouped expert GEMMs on compute-dtype rows (weights packed in prec()).
  void gg_fwd(float* Y, const void* X, const GroupedPackedWeights& W, const int32_t* kept, int64_t R, int64_t in,
              int64_t out) {
    if (f32) grouped_gemm_fwd(Y, static_cast<const float*>(X), W, kept, El, R, in, out, wsp(), ws_bytes);
    else grouped_gemm_fwd(Y, nullptr, static_cast<const bf16*>(X), W, kept, El, R, in, out, wsp(), ws_bytes);
  }
  void gg_dgrad(float* dX, const void* dY, const GroupedPackedWeights& Wt, const int32_t* kept, int64_t R, int64_t in,
                int64_t out) {
    if (f32) grouped_gemm_dgrad(dX, static_cast<const float*>(dY), Wt, kept, El, R, in, out, wsp(), ws_bytes);
    else grouped_gemm_dgrad(dX, nullptr, static_cast<const bf16*>(dY), Wt, kept, El, R, in, out, wsp(), ws_bytes);
  }
  void gg_wgrad(float* dW, const void* X, const void* dY, const int32_t* kept, int64_t R, int64_t in, int64_t out) {
    if (f32)
      grouped_gemm_wgrad(dW, static_cast<const float*>(X), static_cast<const float*>(dY), kept, El, R, in, out, true,
                         wsp(), ws_bytes);
    else
      grouped_gemm_wgrad(dW, static_cast<const bf16*>(X), static_cast<const bf16*>(dY), kept, El, R, in, out, true,
                         wsp(), ws_bytes);
  }

  AttnDims attn_dims() const {
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
    return a;
  }

  void alloc_bufs(LayerBufs& b, bool moe) {
    b.rstd1 = f32buf(N), b.h1c = cbuf(N * d), b.x_mid = f32buf(N * d), b.rstd2 = f32buf(N);
    b.h2 = f32buf(N * d), b.h2c = cbuf_or(b.h2, N * d);
    if (s.attn.type == AttnType::MLA) {
      if (rq > 0) b.cq = f32buf(N * rq), b.rstdq = f32buf(N), b.cqnc = cbuf(N * rq);
      b.q = f32buf(N * H * Dqk), b.ckv = f32buf(N * rkv), b.rstdkv = f32buf(N), b.ckvnc = cbuf(N * rkv);
      b.kpe = f32buf(N * dr), b.kv = f32buf(N * H * (dn + Dv)), b.k = f32buf(N * H * Dqk);
    } else {
      b.qkv = f32buf(N * Wqkv);
    }
    b.ao = f32buf(N * H * Dv), b.aoc = cbuf_or(b.ao, N * H * Dv), b.lse = f32buf(N * H);
    if (!moe) {
      b.gu = f32buf(N * 2 * F), b.actc = cbuf(N * F);
    } else {
      b.logits = f32buf(N * E), b.scores = f32buf(N * E), b.topk_idx = i32buf(N * K), b.topk_w = f32buf(N * K);
      b.counts = i32buf(E), b.kept = i32buf(E), b.offsets = i32buf(E + 1), b.row_of = i32buf(N * K),
      b.token_of = i32buf(N * K), b.slot_of = i32buf(N * K);
      b.xpc = cbuf(Rmax * d), b.egu = f32buf(Rmax * 2 * Fe), b.eactc = cbuf(Rmax * Fe), b.ez = f32buf(Rmax * d);
      b.rows_cap = Rmax;
      if (Fs > 0) b.gu = f32buf(N * 2 * Fs), b.actc = cbuf(N * Fs);
    }
  }

  void build();
  void ensure_rows(Layer& L, int64_t R);
  void ensure_scratch(int64_t R);
  void alloc_row_scratch(int64_t rows);
  // Packed expert weights (gate/up and down, forward and dgrad layouts) of the El local experts: the four
  // buffers, and packing a layer's fp32 expert weights into them (the layer's pk* handles point there).
  void alloc_packed(Tensor& p13f, Tensor& p13d, Tensor& p2f, Tensor& p2d, const char* name);
  void pack_experts(Layer& L, Tensor& p13f, Tensor& p13d, Tensor& p2f, Tensor& p2d);
  size_t grouped_ws_bytes(int64_t rows) const;
  void forward_layer(Layer& L, const float* xin, float* xout);
  void backward_layer(Layer& L, float* dxio);  // dxio: gradient w.r.t. layer output in, input out
  void attn_forward(Layer& L, LayerBufs& b);
  void attn_core(LayerBufs& b);
  void recompute_selected_ffn(Layer& L, LayerBufs& b);
  void recompute_selected_attn(Layer& L, LayerBufs& b);
  LayerBufs sel;  // buffers shared by the layers whose modules are selectively recomputed
  void attn_backward(Layer& L, LayerBufs& b, const void* do_c, float* dh /* [N,d] out: grad of h1 */);
  void ffn_forward(Layer& L, LayerBufs& b, float* y /* [N,d] */);
  void ffn_backward(Layer& L, LayerBufs& b, const float* dy, float* dh2 /* out */, float aux_scale);
  // The El local experts on R rows grouped by expert (b.kept counts, b.xpc input): gate/up GEMM, SwiGLU,
  // down GEMM into b.ez; and the backward from the weighted output gradient dz (compute dtype), which
  // accumulates the expert weight gradients and returns the input gradient [R, d] (in s_f1).
  void experts_forward(Layer& L, LayerBufs& b, int64_t R);
  float* experts_backward(Layer& L, LayerBufs& b, const void* dz, int64_t R);
  // The routed experts under expert parallelism (after the router; before the shared experts).
  void ep_ffn_forward(Layer& L, LayerBufs& b, float* y);
  void ep_ffn_backward(Layer& L, LayerBufs& b, const float* dy, float* dh2);
  ForwardStats run(const int32_t* tokens, const int32_t* targets, bool backward, float ce_scale, float aux_scale);
};

// ---------------------------------------------------------------------------------------------------
// construction

ComputeDtype resolve_compute_dtype(ComputeDtype requested, std::string* why) {
  const CpuFeatures& cf = cpu_features();
  const bool isa_ok = active_isa() == Isa::Avx512;  // the project's bf16 kernels need AVX512-BF16
  const bool native = isa_ok && gemm_bf16_native();
  std::string reason;
  if (native) reason = "this CPU computes bf16 dot products natively (AVX512-BF16)";
  else if (!cf.avx512bf16) reason = "this CPU has no AVX512-BF16 or AMX-BF16, so oneDNN has no bf16 matmul here";
  else if (!isa_ok) reason = "MOETRON_ISA caps the kernels below AVX-512, where bf16 is not native";
  else reason = "oneDNN cannot create a bf16 matmul here (DNNL_MAX_CPU_ISA caps it below AVX512-BF16)";
  if (requested == ComputeDtype::BF16)
    MT_CHECK(native, "compute_dtype", "training.compute_dtype = \"bf16\" needs native bf16 GEMMs, but ", reason,
             ". Set training.compute_dtype = \"fp32\" (or \"auto\", which picks fp32 here)");
  const ComputeDtype got =
      requested == ComputeDtype::Auto ? (native ? ComputeDtype::BF16 : ComputeDtype::FP32) : requested;
  if (why)
    *why = requested == ComputeDtype::Auto ? std::string("auto: ") + reason
                                            : std::string("asked for in training.compute_dtype");
  return got;
}

Model::Model(const ModelSpec& spec, int64_t B, int64_t T, const ActivationCheckpointSpec& ac, const ModelParallel& par,
             ComputeDtype compute)
    : spec_(spec), ac_(ac), B_(B), T_(T), compute_(resolve_compute_dtype(compute)) {
  spec_.resolve();
  spec_.validate();
  MT_CHECK(B > 0 && T > 0, "Model", "micro-batch shape B=", B, " T=", T, " must be positive");
  MT_CHECK(!spec_.attn.qk_norm, "Model", "attention.qk_norm (Qwen3) is not implemented by the engine yet");
  impl_ = std::make_unique<Impl>(*this);
  impl_->f32 = compute_ == ComputeDtype::FP32;
  impl_->par = par;
  if (par.ep && par.ep->size() > 1) impl_->ep_comm = *par.ep, impl_->ep = par.ep->size();
  MT_CHECK(impl_->ep == 1 || spec_.is_moe(), "Model", "expert parallelism (ep = ", impl_->ep,
           ") needs an MoE model; this one has no routed experts");
  impl_->fs_opts = par.fsdp;
  impl_->build();
  impl_->fs_opts = nullptr;
}

Model::~Model() = default;

void Model::Impl::build() {
  auto& P_ = m.params_;
  N = m.B_ * m.T_, d = s.d_model, V = s.vocab_size;
  H = s.attn.n_heads;
  Hkv = s.attn.kv_heads();
  Dqk = s.attn.qk_head_dim(), Dv = s.attn.v_dim();
  if (s.attn.type == AttnType::MLA) {
    dn = s.attn.qk_nope_head_dim, dr = s.attn.qk_rope_head_dim, rq = s.attn.q_lora_rank, rkv = s.attn.kv_lora_rank;
  } else {
    hd = s.attn.head_dim;
    Wqkv = (H + 2 * Hkv) * hd;
  }
  F = s.inter_size;
  if (s.is_moe()) {
    E = s.moe.n_routed_experts, K = s.moe.topk, Fe = s.moe.moe_inter_size, Fs = s.moe.n_shared_experts * Fe;
    Rmax = N * K;
    MT_CHECK(E % ep == 0, "Model", "n_routed_experts = ", E, " is not divisible by the expert-parallel size ", ep);
    El = E / ep, e0 = int64_t(ep_comm.rank()) * El;
  }
  const float std0 = float(s.init_std);
  auto add = [&](const std::string& name, Shape shape, bool decay, int layer, bool expert = false,
                 bool ones = false) {
    ParamEntry e;
    e.name = name, e.shape = shape, e.numel = shape_numel(shape), e.decay = decay, e.layer = layer;
    e.expert = expert, e.ones = ones, e.init_std = std0, e.offset = m.n_params_;
    e.global_shape = shape;
    if (expert && ep > 1) {  // this rank's experts [e0, e0 + El) of the [E, ...] tensor
      e.shape[0] = El;
      e.numel = shape_numel(e.shape);
      e.shard_first = e0 * (e.numel / El);
    }
    m.n_params_ += param_padded_numel(e.numel);  // keep every tensor 64-byte aligned
    P_.push_back(e);
    return int(P_.size() - 1);
  };
  emb = add("embed", {V, d}, true, -1);
  int moe_i = 0;
  layers.resize(size_t(s.n_layers));
  for (int64_t l = 0; l < s.n_layers; ++l) {
    Layer& L = layers[l];
    std::string p = "layers." + std::to_string(l) + ".";
    int li = int(l);
    L.attn_norm = add(p + "attn_norm", {d}, false, li, false, true);
    if (s.attn.type == AttnType::MLA) {
      if (rq > 0) {
        L.wdq = add(p + "attn.wdq", {d, rq}, true, li);
        L.q_norm = add(p + "attn.q_norm", {rq}, false, li, false, true);
        L.wuq = add(p + "attn.wuq", {rq, H * Dqk}, true, li);
      } else {
        L.wq = add(p + "attn.wq", {d, H * Dqk}, true, li);
      }
      L.wdkv = add(p + "attn.wdkv", {d, rkv}, true, li);
      L.wkr = add(p + "attn.wkr", {d, dr}, true, li);
      L.kv_norm = add(p + "attn.kv_norm", {rkv}, false, li, false, true);
      L.wukv = add(p + "attn.wukv", {rkv, H * (dn + Dv)}, true, li);
    } else {
      L.wqkv = add(p + "attn.wqkv", {d, Wqkv}, true, li);
    }
    L.wo = add(p + "attn.wo", {H * Dv, d}, true, li);
    L.ffn_norm = add(p + "ffn_norm", {d}, false, li, false, true);
    L.moe = s.is_moe_layer(l);
    if (!L.moe) {
      L.w13 = add(p + "mlp.w13", {d, 2 * F}, true, li);
      L.w2 = add(p + "mlp.w2", {F, d}, true, li);
    } else {
      L.moe_index = moe_i++;
      L.gate = add(p + "moe.gate", {d, E}, true, li);
      L.we13 = add(p + "moe.experts.w13", {E, d, 2 * Fe}, true, li, true);
      L.we2 = add(p + "moe.experts.w2", {E, Fe, d}, true, li, true);
      if (Fs > 0) {
        L.ws13 = add(p + "moe.shared.w13", {d, 2 * Fs}, true, li);
        L.ws2 = add(p + "moe.shared.w2", {Fs, d}, true, li);
      }
    }
  }
  final_norm = add("final_norm", {d}, false, -1, false, true);
  if (!s.tie_embeddings) head = add("head", {V, d}, true, -1);
  else head = emb;

  if (fs_opts) {
    fs_build();
  } else {
    m.pbuf_ = Tensor::zeros({m.n_params_}, DType::F32, MemCategory::Params, "params");
    m.gbuf_ = Tensor::zeros({m.n_params_}, DType::F32, MemCategory::Grads, "grads");
    if (!f32) wc = Tensor::zeros({m.n_params_}, DType::BF16, MemCategory::Params, "params.bf16");
  }

  // Buffers: every non-recomputed layer owns its saved activations; recomputed layers share one set
  // per kind (dense / MoE).
  LayerBufs* shared[2] = {nullptr, nullptr};
  for (int64_t l = 0; l < s.n_layers; ++l) {
    Layer& L = layers[l];
    L.x_in = f32buf(N * d);
    L.recompute = m.ac_.mode == AcMode::Full && m.ac_.applies_to(l);
    if (L.recompute && shared[L.moe]) {
      L.bufs = shared[L.moe];
      continue;
    }
    owned_bufs.push_back(std::make_unique<LayerBufs>());
    alloc_bufs(*owned_bufs.back(), L.moe);
    L.bufs = owned_bufs.back().get();
    if (L.recompute) shared[L.moe] = L.bufs;
  }
  // Selective recompute: the chosen modules' outputs live in one set of buffers shared by every
  // selected layer; each layer recomputes them right before its backward needs them.
  const bool selective = m.ac_.mode == AcMode::Selective;
  bool any_norm = false, any_attn = false, any_act = false;
  for (int64_t l = 0; l < s.n_layers; ++l) {
    Layer& L = layers[l];
    if (!selective || !m.ac_.applies_to(l)) continue;
    L.sel_norm = m.ac_.has_module("norm");
    L.sel_attn = m.ac_.has_module("attention_core");
    L.sel_act = L.moe && m.ac_.has_module("moe_act");
    any_norm |= L.sel_norm, any_attn |= L.sel_attn, any_act |= L.sel_act;
  }
  if (any_norm) sel.h1c = cbuf(N * d), sel.h2 = f32buf(N * d), sel.h2c = cbuf_or(sel.h2, N * d);
  if (any_attn) sel.ao = f32buf(N * H * Dv), sel.aoc = cbuf_or(sel.ao, N * H * Dv), sel.lse = f32buf(N * H);
  if (any_act) {
    sel.eactc = cbuf(Rmax * Fe), sel_rows_cap = Rmax;
    if (Fs > 0) sel.actc = cbuf(N * Fs);
  }
  for (auto& L : layers) {
    if (!(L.sel_norm || L.sel_attn || L.sel_act)) continue;
    LayerBufs& b = *L.bufs;  // owned by this layer (full recompute is a different mode)
    if (L.sel_norm) b.h1c = sel.h1c, b.h2 = sel.h2, b.h2c = sel.h2c;
    if (L.sel_attn) b.ao = sel.ao, b.aoc = sel.aoc, b.lse = sel.lse;
    if (L.sel_act) {
      b.eactc = sel.eactc;
      if (Fs > 0) b.actc = sel.actc;
    }
  }
  for (auto& L : layers) {
    if (!L.moe) continue;
    L.bias = f32buf(E, MemCategory::Params);
    L.count_acc.assign(size_t(E), 0);
    if (ep > 1) {
      EpDispatchConfig dc;
      dc.kind = par.dispatcher, dc.n_experts = int(E), dc.topk = int(K), dc.hidden = d, dc.max_tokens = N;
      dc.ranks_per_node = par.ep_ranks_per_node;
      dc.dispatch_payload = par.fp8_dispatch ? EpPayload::E4M3 : f32 ? EpPayload::F32 : EpPayload::BF16;
      dc.combine_payload = EpPayload::F32;
      L.disp = std::make_unique<EpDispatch>(ep_comm, dc);
    }
    if (fs_on) continue;  // FSDP: the packed expert weights live in the unit slots
    alloc_packed(L.p13f, L.p13d, L.p2f, L.p2d, "experts.packed");
  }
  if (ep > 1) send_idx = i32buf(N * K, MemCategory::Workspace);
  xf = f32buf(N * d), rstdf = f32buf(N), hfc = cbuf(N * d);
  if (m.ac_.mode == AcMode::Full) recompute_out = f32buf(N * d, MemCategory::Workspace);

  // rope tables
  int64_t R = s.attn.type == AttnType::MLA ? dr : hd;
  rope_cos = f32buf(m.T_ * R / 2, MemCategory::Workspace);
  rope_sin = f32buf(m.T_ * R / 2, MemCategory::Workspace);
  rope_table(rope_cos.data<float>(), rope_sin.data<float>(), m.T_, R, float(s.rope_theta));

  // scratch
  x = f32buf(N * d, MemCategory::Workspace), dx = f32buf(N * d, MemCategory::Workspace);
  dh = f32buf(N * d, MemCategory::Workspace), dh2 = f32buf(N * d, MemCategory::Workspace);
  alloc_row_scratch(Rmax);
  s_dao = f32buf(N * H * Dv, MemCategory::Workspace);
  if (s.attn.type == AttnType::MLA) {
    m_dq = f32buf(N * H * Dqk, MemCategory::Workspace), m_dk = f32buf(N * H * Dqk, MemCategory::Workspace);
    m_dkv = f32buf(N * H * (dn + Dv), MemCategory::Workspace), m_dkpe = f32buf(N * dr, MemCategory::Workspace);
    if (rq > 0) m_dcq = f32buf(N * rq, MemCategory::Workspace);
    m_dckv = f32buf(N * rkv, MemCategory::Workspace);
  }
  if (E > 0) dtopk_w = f32buf(N * K, MemCategory::Workspace), dlogits = f32buf(N * E, MemCategory::Workspace);

  // kernel workspace: the max over every call site
  AttnDims ad = attn_dims();
  size_t w = attention_workspace_bytes(ad, num_threads());
  w = std::max(w, linear_xent_workspace_bytes(N, V, linear_xent_default_chunk(V)));
  w = std::max(w, rmsnorm_backward_workspace_bytes(N, std::max<int64_t>({d, rq, rkv})));
  if (E > 0) {
    rcfg.E = int(E), rcfg.topk = int(K);
    rcfg.score = s.moe.score_func == ScoreFunc::Softmax ? ScoreFn::Softmax : ScoreFn::Sigmoid;
    rcfg.n_group = int(s.moe.n_group), rcfg.topk_group = int(s.moe.topk_group);
    rcfg.group_score = rcfg.score == ScoreFn::Sigmoid ? GroupScore::Top2Sum : GroupScore::Max;
    rcfg.norm_topk = s.moe.norm_topk_prob, rcfg.route_scale = float(s.moe.route_scale);
    if (s.moe.load_balance == LoadBalance::AuxLoss || (s.moe.load_balance == LoadBalance::AuxFree && s.moe.aux_coef > 0)) {
      rcfg.aux = s.moe.aux_seq_wise ? AuxMode::SeqWise : AuxMode::Global;
      rcfg.aux_coef = float(s.moe.aux_coef);
    }
    rcfg.z_coef = float(s.moe.z_loss_coef);
    rcfg.seq_len = int(m.T_);
    router_validate(rcfg, N);
    w = std::max(w, router_workspace_bytes(rcfg, N));
    w = std::max(w, grouped_ws_bytes(Rmax));
  }
  ws_bytes = w;
  if (w > 0) ws = Tensor::zeros({int64_t((w + 3) / 4)}, DType::F32, MemCategory::Workspace, "kernel.ws");
}

// Under EP a rank receives a data-dependent number of routed rows: at most ep * N * min(k, El), N * k on
// average. Buffers start at N * k rows and grow (by at least a quarter) when a dispatch brings more; the
// growth is the only allocation a step can make, and the memory tracker sees it.
void Model::Impl::ensure_rows(Layer& L, int64_t R) {
  LayerBufs& b = *L.bufs;
  if (R > b.rows_cap) {
    const int64_t cap = std::max(R, b.rows_cap + b.rows_cap / 4);
    b.xpc = cbuf(cap * d), b.egu = f32buf(cap * 2 * Fe), b.ez = f32buf(cap * d);
    if (!L.sel_act) b.eactc = cbuf(cap * Fe);
    b.rows_cap = cap;
  }
  if (L.sel_act && R > sel_rows_cap) {
    sel_rows_cap = std::max(R, sel_rows_cap + sel_rows_cap / 4);
    sel.eactc = cbuf(sel_rows_cap * Fe);
    for (auto& O : layers)
      if (O.sel_act) O.bufs->eactc = sel.eactc;
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

// The scratch whose size follows the routed rows it must hold (`rows` >= N * k), allocated for `rows`.
void Model::Impl::alloc_row_scratch(int64_t rows) {
  const int64_t attn_w = s.attn.type == AttnType::MLA ? std::max({H * Dqk, H * (dn + Dv), rq, rkv}) : Wqkv;
  const int64_t big = std::max({attn_w, 2 * F, 2 * Fs, H * Dv, d});
  const int64_t big_rows = std::max(N * big, rows * std::max(2 * Fe, d));
  // bf16 mode only: rounded copies of fp32 gradients for the GEMMs (fp32 mode multiplies the fp32 ones)
  if (!f32) dyc = cbuf(std::max(N * d, rows * d), MemCategory::Workspace);
  s_f1 = f32buf(big_rows, MemCategory::Workspace), s_f2 = f32buf(big_rows, MemCategory::Workspace);
  s_f3 = f32buf(std::max(N * big, rows * d), MemCategory::Workspace);
  if (!f32) s_c1 = cbuf(big_rows, MemCategory::Workspace);
  s_c2 = cbuf(big_rows, MemCategory::Workspace);
  if (ep > 1) {
    dwr = f32buf(rows, MemCategory::Workspace), iota_r = i32buf(rows, MemCategory::Workspace);
    zero_r = i32buf(rows, MemCategory::Workspace);
    for (int64_t r = 0; r < rows; ++r) iota_r.data<int32_t>()[r] = int32_t(r);
  }
  scratch_rows = rows;
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
  const float* w13 = P(L.we13);
  const float* w2 = P(L.we2);
  L.pk13f = grouped_pack_weights(p13f.raw(), w13, El, d, 2 * Fe, prec(), GroupedPackKind::Fwd);
  L.pk13d = grouped_pack_weights(p13d.raw(), w13, El, d, 2 * Fe, prec(), GroupedPackKind::Dgrad);
  L.pk2f = grouped_pack_weights(p2f.raw(), w2, El, Fe, d, prec(), GroupedPackKind::Fwd);
  L.pk2d = grouped_pack_weights(p2d.raw(), w2, El, Fe, d, prec(), GroupedPackKind::Dgrad);
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

const ParamEntry& Model::param(const std::string& name) const {
  for (auto& p : params_)
    if (p.name == name) return p;
  MT_FAIL("Model::param", "no parameter named '", name, "'");
}

void init_param_elements(float* dst, const ParamEntry& e, uint64_t seed, int64_t first, int64_t count) {
  if (e.ones) std::fill(dst, dst + count, 1.0f);
  else fill_normal(dst, count, rng_key(seed, e.name), uint64_t(e.shard_first + first), 0.0f, e.init_std);
}

void Model::init_params(uint64_t seed) {
  if (fsdp_) {
    fsdp_->init(seed);
    for (auto& L : impl_->layers)
      if (L.moe) L.bias.zero_();
    return;
  }
  float* p = pbuf_.data<float>();
  for (auto& e : params_) init_param_elements(p + e.offset, e, seed, 0, e.numel);
  for (auto& L : impl_->layers)
    if (L.moe) L.bias.zero_();
  sync_weights();
}

void Model::sync_weights() {
  auto& I = *impl_;
  if (fsdp_) return;  // FSDP: a unit's bf16 copy and packed experts are made when it is gathered
  if (!I.f32) f32_to_bf16(I.wc.data<bf16>(), pbuf_.data<float>(), n_params_);
  for (auto& L : I.layers) {
    if (!L.moe) continue;
    I.pack_experts(L, L.p13f, L.p13d, L.p2f, L.p2d);
  }
}

void Model::zero_grads() {
  if (fsdp_) fsdp_->zero_grads();
  else gbuf_.zero_();
}

int Model::ep_size() const { return impl_->ep; }
int Model::first_expert() const { return int(impl_->e0); }
int Model::local_experts() const { return int(impl_->El); }

EpTraffic Model::ep_traffic() const {
  EpTraffic t;
  for (auto& L : impl_->layers) {
    if (!L.disp) continue;
    EpStats s = L.disp->stats();
    t.add(s.dispatch), t.add(s.combine), t.add(s.backward);
  }
  return t;
}

int64_t Model::ep_buffer_bytes() const {
  int64_t b = 0;
  for (auto& L : impl_->layers)
    if (L.disp) b += L.disp->buffer_bytes();
  return b;
}

int Model::n_moe_layers() const {
  int n = 0;
  for (auto& L : impl_->layers) n += L.moe;
  return n;
}

float* Model::expert_bias(int moe_layer) {
  for (auto& L : impl_->layers)
    if (L.moe && L.moe_index == moe_layer) return L.bias.data<float>();
  MT_FAIL("Model::expert_bias", "no MoE layer ", moe_layer);
}

std::vector<std::vector<int64_t>> Model::take_expert_counts() {
  std::vector<std::vector<int64_t>> out;
  for (auto& L : impl_->layers) {
    if (!L.moe) continue;
    out.push_back(L.count_acc);
    std::fill(L.count_acc.begin(), L.count_acc.end(), 0);
  }
  return out;
}

void Model::update_expert_bias(const std::vector<std::vector<int64_t>>& counts) {
  if (spec_.moe.load_balance != LoadBalance::AuxFree) return;
  MT_CHECK(int(counts.size()) == n_moe_layers(), "Model::update_expert_bias", "got counts for ", counts.size(),
           " MoE layers, model has ", n_moe_layers());
  int i = 0;
  for (auto& L : impl_->layers) {
    if (!L.moe) continue;
    router_update_bias(L.bias.data<float>(), counts[i++].data(), int(impl_->E), float(spec_.moe.bias_update_rate));
  }
}

// ---------------------------------------------------------------------------------------------------
// attention

void Model::Impl::attn_forward(Layer& L, LayerBufs& b) {
  {
  MT_TRACE("fwd.attn.proj");
  const int64_t B = m.B_, T = m.T_;
  const void* h = b.h1c.raw();
  const float* cs = rope_cos.data<float>();
  const float* sn = rope_sin.data<float>();
  if (s.attn.type != AttnType::MLA) {
    float* qkv = b.qkv.data<float>();
    lin_fwd(qkv, h, W(L.wqkv), N, d, Wqkv);
    rope_forward(qkv, B, T, H + Hkv, Wqkv, hd, 0, hd, cs, sn);  // q heads then k heads are adjacent
  } else {
    float* q = b.q.data<float>();
    if (rq > 0) {
      lin_fwd(b.cq.data<float>(), h, W(L.wdq), N, d, rq);
      norm_fwd_c(b.cqnc, b.rstdq.data<float>(), b.cq.data<float>(), P(L.q_norm), N, rq);
      lin_fwd(q, b.cqnc.raw(), W(L.wuq), N, rq, H * Dqk);
    } else {
      lin_fwd(q, h, W(L.wq), N, d, H * Dqk);
    }
    rope_forward(q, B, T, H, H * Dqk, Dqk, dn, dr, cs, sn);
    lin_fwd(b.ckv.data<float>(), h, W(L.wdkv), N, d, rkv);
    norm_fwd_c(b.ckvnc, b.rstdkv.data<float>(), b.ckv.data<float>(), P(L.kv_norm), N, rkv);
    float* kpe = b.kpe.data<float>();
    lin_fwd(kpe, h, W(L.wkr), N, d, dr);
    rope_forward(kpe, B, T, 1, dr, dr, 0, dr, cs, sn);
    float* kv = b.kv.data<float>();
    lin_fwd(kv, b.ckvnc.raw(), W(L.wukv), N, rkv, H * (dn + Dv));
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

// softmax(q k^T) v and its compute copy for the output projection (what attention_core recompute redoes).
void Model::Impl::attn_core(LayerBufs& b) {
  MT_TRACE("fwd.attn.core");
  AttnDims ad = attn_dims();
  if (s.attn.type != AttnType::MLA) {
    const float* qkv = b.qkv.data<float>();
    attention_forward(b.ao.data<float>(), b.lse.data<float>(), qkv, qkv + H * hd, qkv + (H + Hkv) * hd, ad, wsp());
  } else {
    attention_forward(b.ao.data<float>(), b.lse.data<float>(), b.q.data<float>(), b.k.data<float>(),
                      b.kv.data<float>() + dn, ad, wsp());
  }
  to_c(b.aoc, b.ao.data<float>(), N * H * Dv);  // aoc is ao itself in fp32 mode
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
    lin_wgrad(G(L.wo), b.aoc.raw(), do_c, N, H * Dv, d);
    lin_dgrad(dao, do_c, W(L.wo), N, H * Dv, d);
  }
  if (s.attn.type != AttnType::MLA) {
    const float* qkv = b.qkv.data<float>();
    float* dqkv = s_f1.data<float>();
    {
    MT_TRACE("bwd.attn.core");
    attention_backward(dqkv, dqkv + H * hd, dqkv + (H + Hkv) * hd, dao, b.ao.data<float>(), b.lse.data<float>(), qkv,
                       qkv + H * hd, qkv + (H + Hkv) * hd, ad, wsp());
    }
    MT_TRACE("bwd.attn.proj");
    rope_backward(dqkv, B, T, H + Hkv, Wqkv, hd, 0, hd, cs, sn);
    const void* dqkv_c = to_c(s_c1, dqkv, N * Wqkv);
    lin_wgrad(G(L.wqkv), h, dqkv_c, N, d, Wqkv);
    lin_dgrad(dhout, dqkv_c, W(L.wqkv), N, d, Wqkv);
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
  attention_backward(dq, dk, dkv + dn, dao, b.ao.data<float>(), b.lse.data<float>(), q, b.k.data<float>(), kv + dn,
                     ad, wsp());
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
  rope_backward(dq, B, T, H, H * Dqk, Dqk, dn, dr, cs, sn);
  rope_backward(dkpe, B, T, 1, dr, dr, 0, dr, cs, sn);
  // kv up-projection and kv norm
  const void* t = to_c(s_c1, dkv, N * H * (dn + Dv));
  lin_wgrad(G(L.wukv), b.ckvnc.raw(), t, N, rkv, H * (dn + Dv));
  float* dckvn = s_f2.data<float>();
  lin_dgrad(dckvn, t, W(L.wukv), N, rkv, H * (dn + Dv));
  float* dckv = m_dckv.data<float>();
  rmsnorm_backward(dckv, G(L.kv_norm), dckvn, b.ckv.data<float>(), P(L.kv_norm), b.rstdkv.data<float>(), N, rkv, wsp());
  t = to_c(s_c1, dckv, N * rkv);
  lin_wgrad(G(L.wdkv), h, t, N, d, rkv);
  lin_dgrad(dhout, t, W(L.wdkv), N, d, rkv);
  t = to_c(s_c1, dkpe, N * dr);
  lin_wgrad(G(L.wkr), h, t, N, d, dr);
  lin_dgrad(dhout, t, W(L.wkr), N, d, dr, true);
  // q path
  t = to_c(s_c1, dq, N * H * Dqk);
  if (rq > 0) {
    lin_wgrad(G(L.wuq), b.cqnc.raw(), t, N, rq, H * Dqk);
    float* dcqn = s_f2.data<float>();
    lin_dgrad(dcqn, t, W(L.wuq), N, rq, H * Dqk);
    float* dcq = m_dcq.data<float>();
    rmsnorm_backward(dcq, G(L.q_norm), dcqn, b.cq.data<float>(), P(L.q_norm), b.rstdq.data<float>(), N, rq, wsp());
    t = to_c(s_c1, dcq, N * rq);
    lin_wgrad(G(L.wdq), h, t, N, d, rq);
    lin_dgrad(dhout, t, W(L.wdq), N, d, rq, true);
  } else {
    lin_wgrad(G(L.wq), h, t, N, d, H * Dqk);
    lin_dgrad(dhout, t, W(L.wq), N, d, H * Dqk, true);
  }
}

// ---------------------------------------------------------------------------------------------------
// feed-forward (dense or MoE)

void Model::Impl::ffn_forward(Layer& L, LayerBufs& b, float* y) {
  const void* h = b.h2c.raw();
  if (!L.moe) {
    MT_TRACE("fwd.mlp");
    lin_fwd(b.gu.data<float>(), h, W(L.w13), N, d, 2 * F);
    swiglu_c(b.actc, s_f3.data<float>(), b.gu.data<float>(), N, F);
    lin_fwd(y, b.actc.raw(), W(L.w2), N, F, d);
    return;
  }
  // router (fp32 gate GEMM: routing decisions are sensitive to rounding)
  float* logits = b.logits.data<float>();
  trace::Scope tr_router("fwd.router");
  {
    MT_TRACE("fwd.router.gate_gemm");
    gemm_f32(Trans::N, Trans::N, N, E, d, 1.0f, b.h2.data<float>(), d, P(L.gate), E, 0.0f, logits, E);
  }
  RouterLosses rl;
  const float* bias = s.moe.load_balance == LoadBalance::AuxFree ? L.bias.data<float>() : nullptr;
  int32_t* idx = b.topk_idx.data<int32_t>();
  int32_t* counts = b.counts.data<int32_t>();
  router_forward(idx, b.topk_w.data<float>(), counts, b.scores.data<float>(), &rl, logits, bias, rcfg, N, wsp());
  if (!recomputing) {
    last_aux += rl.aux, last_z += rl.z;
    for (int64_t e = 0; e < E; ++e) L.count_acc[e] += counts[e];
  }
  int32_t* off = b.offsets.data<int32_t>();
  int64_t dropped = moe_permute_plan(off, b.row_of.data<int32_t>(), b.token_of.data<int32_t>(), b.slot_of.data<int32_t>(), idx, counts, N,
                                   int(K), int(E), s.moe.capacity_factor);
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
    lin_fwd(b.gu.data<float>(), h, W(L.ws13), N, d, 2 * Fs);
    swiglu_c(b.actc, s_f3.data<float>(), b.gu.data<float>(), N, Fs);  // (s_f3 read here: EP may regrow it)
    lin_fwd(y, b.actc.raw(), W(L.ws2), N, Fs, d, true);
  }
}

// dy: gradient w.r.t. the FFN output [N,d]; dh2 (out): gradient w.r.t. the FFN input h2.
void Model::Impl::ffn_backward(Layer& L, LayerBufs& b, const float* dy, float* dh2out, float aux_scale) {
  const void* h = b.h2c.raw();
  const void* dyc_ = to_c(dyc, dy, N * d);  // dy itself in fp32 mode
  auto dense_bwd = [&](int w13, int w2, int64_t Fw, bool acc) {
    MT_TRACE("bwd.mlp");
    lin_wgrad(G(w2), b.actc.raw(), dyc_, N, Fw, d);
    float* dact = s_f1.data<float>();
    lin_dgrad(dact, dyc_, W(w2), N, Fw, d);
    float* dgu = s_f2.data<float>();
    swiglu_backward(dgu, dact, b.gu.data<float>(), N, Fw);
    const void* dgu_c = to_c(s_c1, dgu, N * 2 * Fw);
    lin_wgrad(G(w13), h, dgu_c, N, d, 2 * Fw);
    lin_dgrad(dh2out, dgu_c, W(w13), N, d, 2 * Fw, acc);
  };
  if (!L.moe) {
    dense_bwd(L.w13, L.w2, F, false);
    return;
  }
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
  // router
  trace::Scope tr_router("bwd.router");
  RouterConfig rc = rcfg;
  rc.aux_coef *= aux_scale;
  rc.z_coef *= aux_scale;
  float* dlg = dlogits.data<float>();
  router_backward(dlg, dtw, b.scores.data<float>(), b.topk_idx.data<int32_t>(), b.logits.data<float>(), rc, N, wsp());
  gemm_f32(Trans::T, Trans::N, d, E, N, 1.0f, b.h2.data<float>(), d, dlg, E, 1.0f, G(L.gate), E);
  gemm_f32(Trans::N, Trans::T, N, d, E, 1.0f, dlg, E, P(L.gate), E, 1.0f, dh2out, d);
  tr_router.stop();
  if (Fs > 0) {
    dense_bwd(L.ws13, L.ws2, Fs, true);
  }
}

void Model::Impl::experts_forward(Layer& L, LayerBufs& b, int64_t R) {
  MT_TRACE("fwd.experts");
  const int32_t* kept = b.kept.data<int32_t>();
  gg_fwd(b.egu.data<float>(), b.xpc.raw(), L.pk13f, kept, R, d, 2 * Fe);
  swiglu_c(b.eactc, s_f1.data<float>(), b.egu.data<float>(), R, Fe);
  gg_fwd(b.ez.data<float>(), b.eactc.raw(), L.pk2f, kept, R, Fe, d);
}

float* Model::Impl::experts_backward(Layer& L, LayerBufs& b, const void* dz, int64_t R) {
  MT_TRACE("bwd.experts");
  const int32_t* kept = b.kept.data<int32_t>();
  gg_wgrad(G(L.we2), b.eactc.raw(), dz, kept, R, Fe, d);
  float* deact = s_f1.data<float>();
  gg_dgrad(deact, dz, L.pk2d, kept, R, Fe, d);
  float* degu = s_f2.data<float>();
  swiglu_backward(degu, deact, b.egu.data<float>(), R, Fe);
  const void* degu_c = to_c(s_c1, degu, R * 2 * Fe);
  gg_wgrad(G(L.we13), b.xpc.raw(), degu_c, kept, R, d, 2 * Fe);
  float* dxp = s_f1.data<float>();
  gg_dgrad(dxp, degu_c, L.pk13d, kept, R, d, 2 * Fe);
  return dxp;
}

// Routed experts under expert parallelism. The home rank has routed (and, with a capacity, dropped) its
// tokens; the kept (token, slot) rows go to the ranks owning their experts in the compute dtype (bitwise
// what the single-process permute feeds the GEMMs: bf16, or fp32 in fp32 mode) or E4M3, the experts run on the received rows (grouped by local
// expert, ordered by source rank, token, slot), and combine brings fp32 rows back and sums them in slot
// order on the home rank: the single-process moe_unpermute. The backward mirrors it with the dispatcher's
// redispatch / combine_scalars / combine (see ep_dispatch.h).
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
  {
    MT_TRACE("fwd.ep.dispatch");
    R = L.disp->dispatch(b.h2.data<float>(), send, b.topk_w.data<float>(), N);
  }
  ensure_rows(L, R);
  b.R = R;
  int32_t* kept = b.kept.data<int32_t>();
  const int64_t* rc = L.disp->recv_counts();
  for (int64_t e = 0; e < El; ++e) kept[e] = int32_t(rc[e]);
  {
    MT_TRACE("fwd.permute");
    copy_c(b.xpc, L.disp->recv_x(), R * d);
  }
  experts_forward(L, b, R);
  MT_TRACE("fwd.ep.combine");
  L.disp->combine(y, b.ez.data<float>(), true);
}

void Model::Impl::ep_ffn_backward(Layer& L, LayerBufs& b, const float* dy, float* dh2out) {
  const int64_t R = b.R;
  float* dyr = s_f3.data<float>();
  {
    MT_TRACE("bwd.ep.redispatch");
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
    L.disp->combine_scalars(dtopk_w.data<float>(), dw_r);
  }
  float* dxp = experts_backward(L, b, s_c2.raw(), R);
  MT_TRACE("bwd.ep.combine");
  L.disp->combine(dh2out, dxp, false);
}

// ---------------------------------------------------------------------------------------------------
// layers and the whole model

void Model::Impl::forward_layer(Layer& L, const float* xin, float* xout) {
  LayerBufs& b = *L.bufs;
  {
    MT_TRACE("fwd.norm");
    norm_fwd_c(b.h1c, b.rstd1.data<float>(), xin, P(L.attn_norm), N, d);
  }
  attn_forward(L, b);
  float* xm = b.x_mid.data<float>();
  {
    MT_TRACE("fwd.attn.out_proj");
    lin_fwd(xm, b.aoc.raw(), W(L.wo), N, H * Dv, d);
    add_inplace(xm, xin, N * d);
  }
  {
    MT_TRACE("fwd.norm");
    norm_fwd(b.h2.data<float>(), b.h2c, b.rstd2.data<float>(), xm, P(L.ffn_norm), N, d);
  }
  ffn_forward(L, b, xout);
  add_inplace(xout, xm, N * d);
}

void Model::Impl::recompute_selected_ffn(Layer& L, LayerBufs& b) {
  if (!L.sel_norm && !L.sel_act) return;
  auto t0 = std::chrono::steady_clock::now();
  if (L.sel_norm)
    norm_fwd(b.h2.data<float>(), b.h2c, b.rstd2.data<float>(), b.x_mid.data<float>(), P(L.ffn_norm), N, d);
  if (L.sel_act) {
    swiglu_c(b.eactc, s_f1.data<float>(), b.egu.data<float>(), b.R, Fe);
    if (Fs > 0) swiglu_c(b.actc, s_f1.data<float>(), b.gu.data<float>(), N, Fs);
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

void Model::Impl::backward_layer(Layer& L, float* g) {
  LayerBufs& b = *L.bufs;
  // FFN branch: g is the gradient w.r.t. x_out = x_mid + ffn(norm(x_mid)).
  float* dffn = dh.data<float>();
  recompute_selected_ffn(L, b);
  ffn_backward(L, b, g, dffn, cur_aux_scale);
  float* dxm = dh2.data<float>();
  trace::Scope tr_norm("bwd.norm");
  rmsnorm_backward(dxm, G(L.ffn_norm), dffn, b.x_mid.data<float>(), P(L.ffn_norm), b.rstd2.data<float>(), N, d, wsp());
  add_inplace(g, dxm, N * d);  // g is now d x_mid
  tr_norm.stop();
  // attention branch
  const void* g_c = to_c(dyc, g, N * d);  // g itself in fp32 mode (not written until after attn_backward)
  recompute_selected_attn(L, b);
  attn_backward(L, b, g_c, dffn);
  rmsnorm_backward(dxm, G(L.attn_norm), dffn, L.x_in.data<float>(), P(L.attn_norm), b.rstd1.data<float>(), N, d,
                   wsp());
  add_inplace(g, dxm, N * d);  // g is now d x_in
}

ForwardStats Model::Impl::run(const int32_t* tokens, const int32_t* targets, bool backward, float ce_scale,
                              float aux_scale) {
  last_aux = last_z = 0;
  last_dropped = 0;
  cur_aux_scale = aux_scale;
  for (int64_t t = 0; t < N; ++t)
    MT_CHECK(tokens[t] >= 0 && tokens[t] < V, "Model::forward", "token ", tokens[t], " at position ", t,
             " outside the vocabulary [0, ", V, ")");
  // FSDP: units are gathered before use and released after (no-ops otherwise). With tied embeddings unit 0
  // (embedding = head) stays gathered for the whole pass.
  const bool tied = head == emb;
  const int last_u = int(layers.size()) + 1;
  if (fs_on) {  // a previous pass that threw may have left units held
    for (auto& sl : fs_slots) sl.unit = -1;
    std::fill(fs_slot_of.begin(), fs_slot_of.end(), -1);
  }
  fs_acquire(0, true, backward && tied);
  // embedding
  float* xcur = x.data<float>();
  const float* E0 = P(emb);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) std::memcpy(xcur + t * d, E0 + int64_t(tokens[t]) * d, size_t(d) * 4);
  if (!tied) fs_release(0);
  for (size_t l = 0; l < layers.size(); ++l) {
    Layer& L = layers[l];
    fs_acquire(int(l) + 1, true, false);
    std::memcpy(L.x_in.data<float>(), xcur, size_t(N * d) * 4);
    forward_layer(L, L.x_in.data<float>(), xcur);
    fs_release(int(l) + 1);
  }
  fs_acquire(last_u, true, backward);
  norm_fwd_c(hfc, rstdf.data<float>(), xcur, P(final_norm), N, d);
  std::memcpy(xf.data<float>(), xcur, size_t(N * d) * 4);
  ForwardStats st;
  for (int64_t t = 0; t < N; ++t) st.ce_count += targets[t] >= 0;
  const int64_t chunk = linear_xent_default_chunk(V);
  trace::Scope tr_loss("loss.fused_linear_xent");
  if (!backward) {
    st.ce_sum = f32 ? linear_xent_fwd_f32(nullptr, hfc.data<float>(), P(head), targets, N, d, V, 1.0f, chunk, wsp())
                    : linear_xent_fwd_bf16(nullptr, hfc.data<bf16>(), static_cast<const bf16*>(W(head)), targets, N,
                                           d, V, 1.0f, chunk, wsp());
    fs_release(last_u);
    if (tied) fs_release(0);
  } else {
    float* g = dx.data<float>();
    float* dhf = dh.data<float>();
    // The fused kernel returns the scaled loss; recover the plain sum for reporting.
    double scaled =
        f32 ? linear_xent_fwd_bwd_f32(dhf, G(head), hfc.data<float>(), P(head), targets, N, d, V, ce_scale, chunk,
                                      wsp())
            : linear_xent_fwd_bwd_bf16(dhf, G(head), hfc.data<bf16>(), static_cast<const bf16*>(W(head)), targets, N, d,
                                       V, ce_scale, chunk, wsp());
    st.ce_sum = ce_scale != 0 ? scaled / ce_scale : 0;
    tr_loss.stop();
    {
    MT_TRACE("bwd.norm");
    rmsnorm_backward(g, G(final_norm), dhf, xf.data<float>(), P(final_norm), rstdf.data<float>(), N, d, wsp());
    }
    fs_release(last_u);
    for (int64_t l = int64_t(layers.size()) - 1; l >= 0; --l) {
      Layer& L = layers[l];
      fs_acquire(int(l) + 1, true, true);
      if (L.recompute) {
        auto t0 = std::chrono::steady_clock::now();
        MT_TRACE("recompute.layer");
        recomputing = true;
        forward_layer(L, L.x_in.data<float>(), recompute_out.data<float>());
        recomputing = false;
        m.recompute_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
      backward_layer(L, g);
      fs_release(int(l) + 1);
    }
    // embedding gradient: rows in token order (deterministic)
    if (!tied) fs_acquire(0, false, true);
    MT_TRACE("bwd.embed");
    float* gE = G(emb);
    for (int64_t t = 0; t < N; ++t) {
      float* dst = gE + int64_t(tokens[t]) * d;
      const float* src = g + t * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) dst[i] += src[i];
    }
    fs_release(0);
  }
  st.aux_loss = last_aux;
  st.z_loss = last_z;
  st.dropped = last_dropped;
  return st;
}

ForwardStats Model::forward_backward(const int32_t* tokens, const int32_t* targets, float ce_scale, float aux_scale) {
  return impl_->run(tokens, targets, true, ce_scale, aux_scale);
}

ForwardStats Model::forward(const int32_t* tokens, const int32_t* targets) {
  return impl_->run(tokens, targets, false, 0.0f, 0.0f);
}

void Model::compute_logits(float* logits, const int32_t* tokens) {
  std::vector<int32_t> tg(size_t(impl_->N), -1);
  impl_->run(tokens, tg.data(), false, 0.0f, 0.0f);
  auto& I = *impl_;
  std::vector<float> hf(size_t(I.N * I.d)), wh(size_t(I.V * I.d));
  if (I.f32) std::memcpy(hf.data(), I.hfc.raw(), hf.size() * 4);
  else bf16_to_f32(hf.data(), I.hfc.data<bf16>(), I.N * I.d);
  const int hu = I.head == I.emb ? 0 : int(I.layers.size()) + 1;
  I.fs_acquire(hu, true, false);
  if (I.f32) std::memcpy(wh.data(), I.P(I.head), wh.size() * 4);
  else bf16_to_f32(wh.data(), static_cast<const bf16*>(I.W(I.head)), I.V * I.d);
  I.fs_release(hu);
  gemm_f32(Trans::N, Trans::T, I.N, I.V, I.d, 1.0f, hf.data(), I.d, wh.data(), I.d, 0.0f, logits, I.V);
}

}  // namespace moetron

// ---------------------------------------------------------------------------------------------------
// FSDP mode: unit slots, gather / release (the communication and the shards are in src/parallel/fsdp.cpp)

namespace moetron {

void Model::Impl::fs_build() {
  const int nL = int(layers.size());
  fs_unit.resize(m.params_.size());
  for (size_t i = 0; i < m.params_.size(); ++i) {
    const ParamEntry& e = m.params_[i];
    fs_unit[i] = e.layer >= 0 ? e.layer + 1 : (int(i) == emb ? 0 : nL + 1);
  }
  m.fsdp_ = std::make_unique<Fsdp>(m.params_, fs_unit, nL + 2, *fs_opts);
  fs_on = true;
  fs_local.resize(m.params_.size());
  for (size_t i = 0; i < m.params_.size(); ++i) fs_local[i] = m.fsdp_->local_offset(int(i));
  fs_slot_of.assign(size_t(nL + 2), -1);
  // Blocking collectives: one unit is in use at a time, plus unit 0 for the whole pass when the head is
  // the embedding.
  const int n_slots = head == emb ? 2 : 1;
  const int64_t n = m.fsdp_->max_slot_numel();
  fs_slots.resize(size_t(n_slots));
  for (auto& sl : fs_slots) {
    sl.p = Tensor::zeros({n}, DType::F32, MemCategory::Params, "fsdp.slot.params");
    if (!f32) sl.wc = Tensor::zeros({n}, DType::BF16, MemCategory::Params, "fsdp.slot.bf16");
    sl.g = Tensor::zeros({n}, DType::F32, MemCategory::Grads, "fsdp.slot.grads");
    if (E > 0) alloc_packed(sl.p13f, sl.p13d, sl.p2f, sl.p2d, "fsdp.slot.experts");
  }
}

void Model::Impl::fs_acquire(int u, bool params, bool grads) {
  if (!fs_on) return;
  MT_CHECK(fs_slot_of[size_t(u)] < 0, "Model(fsdp)", "unit ", u, " gathered twice");
  int k = -1;
  for (size_t j = 0; j < fs_slots.size() && k < 0; ++j)
    if (fs_slots[j].unit < 0) k = int(j);
  MT_CHECK(k >= 0, "Model(fsdp)", "no free slot for unit ", u);
  FsSlot& sl = fs_slots[size_t(k)];
  sl.unit = u, sl.grads = grads, fs_slot_of[size_t(u)] = k;
  const int64_t n = m.fsdp_->unit(u).slot_numel;
  if (params) {
    MT_TRACE("fsdp.all_gather");
    m.fsdp_->gather_unit(sl.p.data<float>(), u);
    if (!f32) f32_to_bf16(sl.wc.data<bf16>(), sl.p.data<float>(), n);
    if (u >= 1 && u <= int(layers.size()) && layers[size_t(u - 1)].moe) {
      pack_experts(layers[size_t(u - 1)], sl.p13f, sl.p13d, sl.p2f, sl.p2d);
    }
  }
  if (grads) std::memset(sl.g.raw(), 0, size_t(n) * 4);
}

void Model::Impl::fs_release(int u) {
  if (!fs_on) return;
  const int k = fs_slot_of[size_t(u)];
  MT_CHECK(k >= 0, "Model(fsdp)", "unit ", u, " released but not gathered");
  FsSlot& sl = fs_slots[size_t(k)];
  if (sl.grads) {
    MT_TRACE("fsdp.reduce_scatter");
    m.fsdp_->reduce_scatter_unit(sl.g.data<float>(), u);
  }
  sl.unit = -1, sl.grads = false, fs_slot_of[size_t(u)] = -1;
}

}  // namespace moetron
