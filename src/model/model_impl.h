// model_impl.h: the private state of Model (Model::Impl: dimensions, per-layer parameter indices and saved
// activations, scratch, FSDP unit slots) and the small compute-dtype helpers every model_*.cpp uses (GEMM,
// norm and SwiGLU wrappers that pick bf16 or fp32). The member functions are defined by concern:
//   model.cpp             construction, parameter layout, buffers, the public Model API, the pass (run)
//   model_layer.cpp       one decoder layer by index (forward_layer / backward_layer), residuals, recompute
//   model_attention.cpp   the attention block (MHA/GQA/MLA) forward and backward
//   model_mlp.cpp         the dense SwiGLU FFN (dense layers and the MoE layers' shared experts)
//   model_moe.cpp         the MoE FFN: router, permute, grouped experts, combine, expert weight packing
//   model_ep.cpp          the routed experts under expert parallelism (dispatch / combine, growing rows)
//   model_embed_head.cpp  the embedding, the final norm and the fused head + cross-entropy loss
//   model_fsdp.cpp        FSDP mode: unit slots, gather and release
//   model_fp8.cpp         [quantize]: the FP8 linears (dense and grouped), their amax histories and statistics
//   model_tp.cpp          tensor parallelism: the row gathers / reduce-scatters of the sequence-parallel regions
//   model_stage.cpp       pipeline stages: activation slots, stage forward / backward, the deferred
//                         weight-gradient arena of the split backward (I / W)
// Not a public header (only src/model includes it) and not where the kernels live (include/moetron/*.h).
#pragma once
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "model/ep_exposure.h"
#include "moetron/attention.h"
#include "moetron/fp8_gemm.h"
#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/gemm.h"
#include "moetron/grouped_gemm.h"
#include "moetron/model.h"
#include "moetron/norm.h"
#include "moetron/router.h"
#include "moetron/swiglu.h"

namespace moetron {
namespace model_detail {

inline void add_inplace(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

inline Tensor f32buf(int64_t n, MemCategory c = MemCategory::Activations) {
  return Tensor::zeros({n}, DType::F32, c);
}
inline Tensor i32buf(int64_t n, MemCategory c = MemCategory::Activations) {
  return Tensor::zeros({n}, DType::I32, c);
}

}  // namespace model_detail

// The FP8 linears of [quantize] (model_fp8.cpp). One site per quantized parameter of the whole model (every rank
// holds every site, in global parameter order, so a step's amaxes reduce over any layout), with three operands:
// the input activation X, the weight W and the output gradient dY.
enum class Fp8Module : uint8_t { Attention, DenseMlp, SharedExperts, RoutedExperts };
const char* fp8_module_name(Fp8Module m);
enum Fp8Operand : int { kFp8X = 0, kFp8W = 1, kFp8G = 2 };
struct Fp8Site {
  std::string param;
  Fp8Module module = Fp8Module::Attention;
  bool mtp = false;                  // a linear of an MTP block (mtp.<k>.block.*): its statistics go to "mtp.<module>"
  std::vector<Fp8AmaxHistory> hist;  // [3] delayed scaling: the last amax_history_len step amaxes per operand
  float amax[3] = {0, 0, 0};         // this step: the max over every quantization of the operand
  float smin[3] = {0, 0, 0}, smax[3] = {0, 0, 0};  // this step: the smallest and largest scale used (0 = none)
};
struct Fp8State {
  QuantizeSpec q;
  std::vector<Fp8Site> sites;
  std::vector<int> site_of;  // [local parameter] site index, -1 = high precision
  bool twin = false;         // tests: gemm_f32 of the dequantized operands in place of the FP8 GEMMs
  std::mutex mu;             // the lanes record amaxes and scales under it
};

// [quantize] cache_fp8_activations: a linear's input kept for its weight gradient as the FP8 operand its forward
// GEMM consumed (codes and scales; mxfp8 scales as E8M0 bytes), sized once for the most rows (fp8_cached_bytes).
// The routed experts' entry holds each expert's rows one after the other (expert e's tensorwise scale at e).
enum Fp8CacheSlot : int {
  kF8AttnIn = 0,  // the normed attention input into wqkv (MHA / GQA), or MLA's wq / wdq
  kF8AttnKv,      // MLA: the normed input into wdkv
  kF8AttnKr,      // MLA: the normed input into wkr
  kF8AttnUq,      // MLA: the normed q latent into wuq
  kF8AttnUkv,     // MLA: the normed kv latent into wukv
  kF8Mlp13, kF8Mlp2,  // dense layer: the ffn norm output into w13, the SwiGLU output into w2
  kF8Shared2,         // MoE layer: the shared experts' SwiGLU output into ws2
  kF8Exp13, kF8Exp2,  // MoE layer: the permuted rows into we13, the experts' SwiGLU output into we2
  kF8Slots
};
struct Fp8Saved {
  Tensor q, sc;              // codes (U8) and scales (F32; U8 E8M0 for mxfp8), allocated for the most rows
  int64_t rows = 0, cols = 0;  // of the last forward
  Fp8Format fmt = Fp8Format::E4M3;
  bool pow2 = false;
  bool defined() const { return q.defined(); }
};

// Saved activations of one layer (a checkpointed layer shares one set with the others of its kind and
// keeps only its input).
struct LayerBufs {
  Fp8Saved f8[kF8Slots];  // cache_fp8_activations: the FP8-cached linear inputs (undefined = not cached)
  Tensor rstd1, h1c, x_mid, rstd2, h2, h2c;
  // attention (mha/gqa)
  Tensor qkv;
  // qk_norm (mha/gqa): q and k before their per-head RMSNorm, [N*H, hd] q rows then [N*Hkv, hd] k rows, and the
  // rstd of each (token, head) row in the same order [N*H | N*Hkv]
  Tensor qkx, qkrstd;
  // attention (mla)
  Tensor cq, rstdq, cqnc, q, ckv, rstdkv, ckvnc, kpe, kv, k;
  Tensor ao, aoc, lse;
  // dense ffn / shared experts
  Tensor gu, actc;
  // moe
  Tensor logits, scores, topk_idx, topk_w, counts, kept, offsets, row_of, token_of, slot_of, xpc, egu, eactc, ez;
  int64_t R = 0;         // routed rows of the last forward (received rows under EP)
  int64_t rows_cap = 0;  // rows xpc / egu / eactc / ez hold (grows under EP when routing is skewed)
  int64_t rows_peak = 0; // the most rows one dispatch brought (EP)
};

// The split backward's deferred weight gradients (one arena per stage and slot): each task is one
// weight-gradient GEMM of the I half whose operands were copied here, run by W in recording order.
struct WTask {
  enum Kind : uint8_t { Lin, LinF32, Grouped } kind = Lin;
  int param = -1;
  int64_t rows = 0, in = 0, out = 0;
  size_t x = 0, dy = 0, kept = 0;  // byte offsets into the arena
};
struct WArena {
  std::vector<WTask> tasks;
  Tensor buf;       // bytes (as floats), grows when a record needs more (first steps, EP row growth)
  size_t used = 0;  // bytes
  size_t next = 0;  // tasks[0, next) already run (early, while the EP overlap's lanes both waited)
};
// The arenas' buffers, shared by every stage, slot and lane: an arena takes one when it records its first task and
// gives it back when its tasks have run, so the buffers alive are the arenas holding tasks at once (one per lane,
// and the carried one under iwcarry), not one per slot.
struct WArenaPool {
  std::mutex mu;
  std::vector<Tensor> free;
  void take(WArena& a);     // a.buf = the largest free buffer (or none: recording allocates)
  void give(WArena& a);     // a's buffer back, a empty
};

struct Layer {
  bool held = true;  // on one of this rank's pipeline stages (else no parameters, buffers or dispatcher)
  bool moe = false;
  bool recompute = false;                                 // full: re-run the whole layer forward
  bool sel_norm = false, sel_attn = false, sel_act = false;  // selective: recompute these modules
  int moe_index = -1;
  // parameter indices (-1 = absent)
  int attn_norm = -1, ffn_norm = -1;
  int wqkv = -1, wo = -1;                                          // mha/gqa
  int q_head_norm = -1, k_head_norm = -1;                          // mha/gqa qk_norm: [hd] per-head weights
  int wq = -1, wdq = -1, q_norm = -1, wuq = -1, wdkv = -1, wkr = -1, kv_norm = -1, wukv = -1;  // mla
  int w13 = -1, w2 = -1;                                           // dense ffn
  int gate = -1, we13 = -1, we2 = -1, ws13 = -1, ws2 = -1;         // moe
  Tensor x_in;        // [N, d] saved layer input (always): the active slot's
  LayerBufs* bufs = nullptr;  // the active slot's saved activations
  // Per activation slot (pipeline stages keep several micro-batches): inputs, saved activations and the EP
  // dispatcher that keeps each micro-batch's layout for its backward. use_slot() makes one active.
  std::vector<Tensor> slot_x_in;
  std::vector<LayerBufs*> slot_bufs;
  std::vector<EpDispatch*> slot_disp;
  // packed expert weights (refreshed by sync_weights)
  Tensor p13f, p13d, p2f, p2d;
  GroupedPackedWeights pk13f, pk13d, pk2f, pk2d;
  Tensor bias;        // [E] aux-free expert bias
  std::vector<int64_t> count_acc;  // tokens per expert since last take
  EpDispatch* disp = nullptr;  // expert parallelism: the active slot's dispatcher (keeps its layout for backward)
};

// A local pipeline stage at run time.
struct StageRt {
  ModelStagePart part;
  std::vector<int64_t> blocks;   // the layers it runs: part.layers, then the MTP blocks on the head stage
  std::vector<Tensor> head_g;    // head stage: dL/dx per slot, from the fused head in F until B
  std::vector<WArena> warena;    // per slot: the I half's deferred weight gradients
};

struct Model::Impl {
  Model& m;
  const ModelSpec& s;
  int64_t N, d, V;
  int64_t Vl = 0;  // vocabulary rows of the embedding / head held here (V / tp under TP: vocab_parallel.h)
  // attention dims
  int64_t H, Hkv, hd, Dqk, Dv, dn = 0, dr = 0, rq = 0, rkv = 0, Wqkv = 0;
  int64_t F = 0, E = 0, K = 0, Fe = 0, Fs = 0, Rmax = 0;
  // expert parallelism: El experts held here, the first is e0; ep = EP group size
  int64_t El = 0, e0 = 0;
  int ep = 1;
  ModelParallel par;
  Comm ep_comm;
  // ---- tensor parallelism (model_tp.cpp): heads, FFN widths and vocabulary-free dims above are this rank's
  // (H, Hkv, F, Fe, Fs divided by tp); the residual stream holds Nr = N / tp rows (sequence parallel), the blocks
  // between a gather and a reduce-scatter all N rows.
  Comm tp_comm;
  int tp = 1, tp_rank = 0;
  int64_t Nr = 0;
  Tensor tp_full, tp_fullc;  // [N, d]: gathered rows or partial sums before their reduce-scatter (fp32, compute)
  bool tp_lead() const { return tp_rank == 0; }  // adds the TP-replicated terms to a partial sum, once
  // ---- context parallelism: m.T_ is this rank's share of each sequence (its two chunks), m.seq_len_ the whole;
  // the stage calls take the whole micro-batch's tokens / targets and copy this rank's rows into cp_tok / cp_tgt.
  Comm cp_comm;
  int cp = 1, cp_rank = 0;
  std::vector<int32_t> cp_tok, cp_tgt;
  const int32_t* cp_rows(std::vector<int32_t>& dst, const int32_t* full);  // full itself without CP
  // Under TP only (callers skip them at tp = 1, where the rows are the whole micro-batch):
  // full [N rows] = every TP rank's [Nr rows] in rank order (row_bytes each);
  void tp_gather_rows(void* full, const void* local, int64_t row_bytes);
  // local [Nr, d] = the sum over the TP group of its rows of full [N, d].
  void tp_scatter_sum(float* local, const float* full);
  void tp_sum(float* x, int64_t n);  // in place over the TP group (rank-order sum); nothing without TP
  Tensor send_idx, dwr, iota_r, zero_r;  // EP scratch: slots sent (-1 = dropped), per-row dw, row maps
  int64_t scratch_rows = 0, sel_rows_cap = 0;
  std::vector<Layer> layers;  // every decoder layer of the model (held or not), indexed by layer id
  std::vector<std::unique_ptr<LayerBufs>> owned_bufs;
  std::vector<std::unique_ptr<EpDispatch>> owned_disp;
  std::vector<LayerBufs*> sel_act_bufs;  // the buffer sets whose eactc is the shared selective one
  std::vector<StageRt> stages;           // local pipeline stages, ascending (the whole model: one)
  bool whole = true;                     // one local stage with everything (forward_backward works)
  bool has_emb = true, has_head = true;  // the embedding / head stage is local
  int n_moe_total = 0;
  // The head stage's embedding gradient [Vl, d] (tied embeddings: the head's; MTP: its depths' embedding rows),
  // folded into the embedding's (fold_tied_head_grad, or FSDP's embed_backward).
  Tensor tied_hg;
  float step_ce_scale = 0, step_aux_scale = 0;
  std::vector<double> cur_aux, cur_z;    // per global MoE layer, the current pass
  // The split backward: while an I half runs, weight-gradient GEMMs are recorded into this arena.
  WArena* defer = nullptr;
  Tensor wc;  // bf16 copy of every parameter (bf16 mode only: fp32 mode multiplies the masters); the held routed
              // experts' part is not refreshed (sync_weights): their GEMMs read the packed copies, never W()
  // The weight refresh in pieces (made once, in flat-offset order, covering [0, n_params)): a piece of flat elements
  // [lo, hi) and what is made from it: the bf16 copy of its elements (layer < 0; bf16 mode), or the packed panels of
  // experts [e0, e1) of a held MoE layer's w13 (mat 0) or w2 (mat 1). Sized to stay in cache between an optimizer
  // update of the piece and its refresh (Model::update_and_sync).
  struct SyncPiece {
    int64_t lo = 0, hi = 0;
    int layer = -1, mat = 0;
    int64_t e0 = 0, e1 = 0;
  };
  std::vector<SyncPiece> sync_pieces;
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

  // ---- FSDP mode (see model.h, fsdp.h; model_fsdp.cpp): units 0 = embedding, 1..n_layers = decoder layers,
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
  int layer_unit(int64_t l) const { return int(l) + 1; }       // FSDP unit of decoder layer l
  int head_unit() const { return int(layers.size()) + 1; }     // FSDP unit of the final norm + head

  // Parameter i's fp32 value, gradient and bf16 copy: in the flat buffers, or in FSDP mode in its unit's slot.
  float* P(int i) {
    return fs_on ? fs_slot(i).p.data<float>() + fs_local[i] : m.pbuf_.data<float>() + m.params_[i].offset;
  }
  float* G(int i) {
    if (fs_on) return fs_slot(i).g.data<float>() + fs_local[i];
    float* g = m.gbuf_.data<float>() + m.params_[i].offset;
    if (m.grads_pending_ && m.grad_unwritten_[size_t(i)]) {  // first use in a step begun by begin_grads()
      zero_bytes(g, size_t(m.params_[size_t(i)].numel) * 4);
      m.grad_unwritten_[size_t(i)] = 0;
    }
    return g;
  }
  // Parameter i's gradient for a writer that produces all `elems` of it in one go: `overwrite` says whether it may
  // write (no one has yet in this step) instead of adding. A writer of part of a gradient, or of none of it (no rows),
  // adds to the gradient G(i) gives.
  float* G_whole(int i, int64_t elems, bool nonempty, bool& overwrite) {
    overwrite = !fs_on && nonempty && m.grads_pending_ && m.grad_unwritten_[size_t(i)] &&
                elems == m.params_[size_t(i)].numel;
    if (overwrite) m.grad_unwritten_[size_t(i)] = 0;  // so G(i) below leaves it as it is
    return G(i);
  }
  // Parameter i as a GEMM operand: the fp32 master itself in fp32 mode, else its bf16 copy.
  const void* W(int i) {
    if (f32) return P(i);
    return fs_on ? fs_slot(i).wc.data<bf16>() + fs_local[i] : wc.data<bf16>() + m.params_[i].offset;
  }
  void* wsp() { return ws.defined() ? ws.raw() : nullptr; }

  // ---- the compute dtype: every call that depends on it goes through these ----
  bool f32 = false;  // compute dtype FP32 (else BF16)
  bool attn16 = false;  // bf16 attention (AttnPrec::BF16; only with bf16 compute, see ModelParallel::attention)
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
  // SwiGLU's backward in the compute dtype: fp32 mode into out32 (returned), bf16 mode rounded into dst row by row
  // (no fp32 copy made; the bits to_c of the fp32 gradient gives).
  const void* swiglu_backward_c(Tensor& dst, float* out32, const float* dh, const float* gu, int64_t rows, int64_t F) {
    if (f32) {
      swiglu_backward(out32, dh, gu, rows, F);
      return out32;
    }
    swiglu_backward_bf16(dst.data<bf16>(), dh, gu, rows, F);
    return dst.raw();
  }
  // src copied into the compute-dtype buffer dst (rounded to bf16 in bf16 mode).
  void copy_c(Tensor& dst, const float* src, int64_t n) {
    if (f32) std::memcpy(dst.raw(), src, size_t(n) * 4);
    else f32_to_bf16(dst.data<bf16>(), src, n);
  }
  // y[N,out] (+)= x[N,in] · W[in,out] with W = parameter p (FP8 when [quantize] selects it)
  void lin_fwd(float* y, const void* x, int p, int64_t rows, int64_t in, int64_t out, bool acc = false) {
    if (p == cap_p) capture_operand(0, x, rows, in, out);
    if (const int s = fp8_site(p); s >= 0) return fp8_lin_fwd(s, y, x, p, rows, in, out, acc);
    gemm_c(Trans::N, Trans::N, rows, out, in, x, in, W(p), out, acc ? 1.0f : 0.0f, y, out);
  }
  // dx[N,in] (+)= dy[N,out] · W[in,out]^T
  void lin_dgrad(float* dx, const void* dy, int p, int64_t rows, int64_t in, int64_t out, bool acc = false) {
    if (p == cap_p) capture_operand(2, dy, rows, in, out);
    if (const int s = fp8_site(p); s >= 0) return fp8_lin_dgrad(s, dx, dy, p, rows, in, out, acc);
    gemm_c(Trans::N, Trans::T, rows, in, out, dy, out, W(p), out, acc ? 1.0f : 0.0f, dx, in);
  }
  // dW[in,out] of parameter p += x[N,in]^T · dy[N,out] (compute dtype; recorded instead inside an I half)
  void lin_wgrad(int p, const void* x, const void* dy, int64_t rows, int64_t in, int64_t out) {
    if (defer) return record_wgrad(WTask::Lin, p, x, dy, nullptr, rows, in, out);
    if (const int s = fp8_site(p); s >= 0) return fp8_lin_wgrad(s, p, x, dy, rows, in, out);
    bool first = false;
    float* g = G_whole(p, in * out, rows > 0, first);
    gemm_c(Trans::T, Trans::N, in, out, rows, x, in, dy, out, first ? 0.0f : 1.0f, g, out);
  }
  // The same on fp32 operands whatever the compute dtype (the router's gate).
  void lin_wgrad_f32(int p, const float* x, const float* dy, int64_t rows, int64_t in, int64_t out) {
    if (defer) return record_wgrad(WTask::LinF32, p, x, dy, nullptr, rows, in, out);
    bool first = false;
    float* g = G_whole(p, in * out, rows > 0, first);
    gemm_f32(Trans::T, Trans::N, in, out, rows, 1.0f, x, in, dy, out, first ? 0.0f : 1.0f, g, out);
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
  // SwiGLU whose output only feeds the down GEMM: into hc in the compute dtype (bf16 mode writes no fp32 copy).
  void swiglu_c(Tensor& hc, const float* gu, int64_t rows, int64_t Fw) {
    if (f32) swiglu_forward(hc.data<float>(), nullptr, gu, rows, Fw);
    else swiglu_forward(nullptr, hc.data<bf16>(), gu, rows, Fw);  // only the bf16 copy: its fp32 values unused
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
  void gg_wgrad(int p, const void* X, const void* dY, const int32_t* kept, int64_t R, int64_t in, int64_t out) {
    if (defer) return record_wgrad(WTask::Grouped, p, X, dY, kept, R, in, out);
    if (const int s = fp8_site(p); s >= 0) return fp8_gg_wgrad(s, p, X, dY, kept, R, in, out);
    bool first = false;  // writing: every expert's block is written, an expert without rows as zeros
    float* dW = G_whole(p, El * in * out, true, first);
    if (f32)
      grouped_gemm_wgrad(dW, static_cast<const float*>(X), static_cast<const float*>(dY), kept, El, R, in, out, !first,
                         wsp(), ws_bytes);
    else
      grouped_gemm_wgrad(dW, static_cast<const bf16*>(X), static_cast<const bf16*>(dY), kept, El, R, in, out, !first,
                         wsp(), ws_bytes);
  }

  // ---- FP8 linears (model_fp8.cpp) ----
  std::shared_ptr<Fp8State> fp8;  // null = no FP8 (shared by the lanes)
  std::vector<float> fp8_tmp[2];  // this lane's fp32 copies of bf16 operands
  // This lane's operand buffers, reused by every FP8 GEMM (they only grow): A, B, and a cached operand being read;
  // fp8_xt: the transposed fp32 copy a transposed quantization makes.
  Fp8Tensor fp8_op[3];
  std::vector<float> fp8_xt;
  int fp8_site(int p) const { return fp8 ? fp8->site_of[size_t(p)] : -1; }
  int cap_p = -1;  // Model::capture_linear: the parameter whose operands the next pass copies out
  Model::LinearOperands cap;
  void capture_operand(int which /* 0: X and W, 2: dY */, const void* t, int64_t rows, int64_t in, int64_t out);
  // Operand `op` of site s, x [R, C] (fp32), quantized along C, or transposed: x^T [C, R] along R; into t
  // (one of fp8_op, reused), which it returns.
  const Fp8Tensor& fp8_quant(int s, int op, const float* x, int64_t R, int64_t C, bool transposed, Fp8Role role,
                             Fp8Tensor& t);
  // The FP8 GEMM C (+)= A · B^T, or in twin mode gemm_f32 of the dequantized operands.
  void fp8_mm(float* C, int64_t ldc, const Fp8Tensor& A, const Fp8Tensor& B, float beta);
  const float* fp8_f32(int slot, const void* x, int64_t n);  // x as fp32 (x itself in fp32 mode)
  void fp8_lin_fwd(int s, float* y, const void* x, int p, int64_t rows, int64_t in, int64_t out, bool acc);
  void fp8_lin_dgrad(int s, float* dx, const void* dy, int p, int64_t rows, int64_t in, int64_t out, bool acc);
  void fp8_lin_wgrad(int s, int p, const void* x, const void* dy, int64_t rows, int64_t in, int64_t out);
  // The routed experts' grouped GEMMs (El local experts of parameter p, [El, in, out]; kept rows per expert).
  void fp8_gg_fwd(int s, float* Y, const void* X, int p, const int32_t* kept, int64_t R, int64_t in, int64_t out);
  void fp8_gg_dgrad(int s, float* dX, const void* dY, int p, const int32_t* kept, int64_t R, int64_t in, int64_t out);
  void fp8_gg_wgrad(int s, int p, const void* X, const void* dY, const int32_t* kept, int64_t R, int64_t in,
                    int64_t out);
  // cache_fp8_activations (model_fp8.cpp): per parameter its cache slot (-1 = not cached); the layer whose
  // buffers the current forward / backward uses; the shared scratch that replaces the dropped inputs.
  std::vector<int8_t> f8_slot;
  LayerBufs* f8_bufs = nullptr;
  LayerBufs f8_scratch;
  bool f8_on = false;
  void fp8_cache_setup(bool on);  // allocate the caches and share the dropped buffers, or undo it
  Fp8Saved* fp8_cached(int p) {
    const int k = f8_on && size_t(p) < f8_slot.size() ? f8_slot[size_t(p)] : -1;
    return k >= 0 && f8_bufs && f8_bufs->f8[k].defined() ? &f8_bufs->f8[k] : nullptr;
  }
  // The cache of parameter p for its weight gradient over rows x in (null when not cached); a shape other than the
  // forward's stored one is an error naming the parameter.
  const Fp8Saved* fp8_cached_for_wgrad(int p, int64_t rows, int64_t in);
  // Stores operand A (rows [r0, r0 + A.rows) of the slot, its scales from scale index s0) into the cache.
  void fp8_cache_store(Fp8Saved& c, const Fp8Tensor& A, int64_t r0, int64_t s0);
  // The cached rows [r0, r0 + rows) as an Fp8Tensor [rows, cols] along cols (scales from index s0), into t.
  void fp8_cache_load(const Fp8Saved& c, int64_t r0, int64_t rows, int64_t s0, int64_t n_scales, Fp8Tensor& t);
  // The wgrad operand X^T [cols, rows] along the tokens from a cached X, into t: the exact transpose (tensorwise),
  // else dequantized and quantized again along the tokens (double quantization).
  const Fp8Tensor& fp8_cached_xt(int s, const Fp8Tensor& x, Fp8Tensor& t);

  // ---- pipeline stages (model_stage.cpp) ----
  void build_stages();  // from par.stages (or the whole model): which layers / ends are held
  void build_slots();   // per-slot inputs, saved activations and dispatchers of the held layers
  void use_slot(StageRt& st, int slot);
  void begin_pass();    // statistics of one stage pass reset
  void end_pass(ForwardStats& st);
  void record_wgrad(WTask::Kind k, int p, const void* x, const void* dy, const int32_t* kept, int64_t rows,
                    int64_t in, int64_t out);
  void replay_wgrads(WArena& a);
  void run_wtask(const WArena& a, const WTask& t);  // one recorded weight-gradient GEMM (not under FSDP)
  // The EP overlap's fill (Baton::fill_w): while this lane waits inside an exchange and the other lane does not
  // compute (or, outside a pair, at any wait), run the oldest weight gradient not yet run: a carried arena's
  // (iwcarry), else this lane's own I half's; false when there is none or the turn is taken.
  bool fill_with_wgrad();
  void carry(WArena& a);  // iwcarry: a's recorded weight gradients join the carried queue (run later)
  void flush_carried(const WArena* upto = nullptr);  // runs carried weight gradients, oldest first (all, or up to upto)
  static bool fill_hook(void* self) { return static_cast<Impl*>(self)->fill_with_wgrad(); }
  float* head_weight_grad() { return head == emb ? tied_hg.data<float>() : G(head); }

  // ---- construction and buffers (model.cpp) ----
  void build();
  void build_params();   // the parameter layout: names, shapes, offsets (flat or FSDP shards)
  void build_buffers();  // saved activations, recompute sharing, dispatchers, scratch, kernel workspace
  void alloc_scratch();  // a lane's own buffers (below)

  // ---- lanes (model_stage.cpp): the EP all-to-all overlap runs one micro-batch's forward and another's
  // backward at once, on two threads. Lane 1 is a second Impl that shares everything of the model (parameters,
  // gradients, per-slot saved activations and dispatchers, packed weights, the aux-free state) but has its own
  // scratch and per-pass state (alloc_scratch, last_aux, cur_aux_scale, ...). A thread picks its lane with
  // Model::set_thread_lane. Lane 0 is this Impl; forwards (and so the expert counts) run on lane 0.
  std::unique_ptr<Impl> make_lane() const;
  // The compute baton, shared by the two lanes while an FB pair runs (begin_pair / end_pair): one lane computes
  // at a time, so the lanes never compete for the cores, and a lane gives the baton up at each EP exchange
  // (EpYield) and when its half ends. Outside a pair it is inactive (no waits). Two orders:
  //  - free (the default, parallelism.ep_baton = "free"): the compute goes to whichever lane is ready, so a lane whose
  //    exchange has finished computes while the other still waits (each dispatcher has its own communicator, so
  //    the lanes' exchanges match their peers in any interleaving);
  //  - turn (ep_baton = "turn"): strict turns, lane 0 first, the same order of compute segments on every EP
  //    rank. It hides less on the emulated slow link (docs/benchmarks.md) and is kept for comparison.
  // The link (parallelism.ep_link): shared (the default) lets both lanes' exchanges be in flight at once, sharing the
  // rank's link; paced holds a lane's exchange until the other lane's has completed, so one exchange at a time
  // runs at the link's whole rate and its lane computes again sooner. Paced needs turn order: the exchanges then
  // start in the turns' order, the same on every EP rank, so no two ranks wait on each other's link (under free
  // order two ranks could hold their links for different lanes' exchanges and wait on each other for ever).
  struct Baton {
    Baton(bool free, bool paced);  // ModelParallel::ep_free_order, ep_paced_link
    std::mutex mu;
    std::condition_variable cv;
    bool active = false;
    bool free_order = true;   // ep_baton = "free" (default) | "turn"
    int turn = 0;             // turn order: whose turn; free order: the lane computing, -1 none
    bool done[2] = {false, false};
    bool paced_link = false;  // ep_link = "paced" | "shared" (default)
    // ep_pair_backward = "iwfill" (Model::set_ep_wgrad_fill): a lane waiting in an exchange of its I half takes
    // the turn when no lane computes (fill_with_wgrad) to run recorded weight gradients. Free order only.
    bool fill_w = false;
    // ep_pair_backward = "iwcarry": every backward (a pair's backward lane, or one run alone) records its weight
    // gradients and carries them: any exchange wait, on either lane, runs the oldest when no lane computes (outside
    // a pair: whenever the one running lane waits); the rest runs when its slot is reused and at the step's end
    // (flush_carried). The queue is touched only by the lane holding the turn, or outside a pair by the one lane.
    bool carry_w = false;
    std::deque<WArena*> carried;  // oldest first: arenas (either lane's) whose tasks [next, size) have not run
    int64_t filled = 0;         // weight-gradient tasks run that way, and their seconds (Model::ep_exposed)
    double filled_seconds = 0;
    // Paced: each exchange takes a ticket when its lane passes the turn (so in the turns' order, the same on every
    // EP rank) and runs when the tickets before it have completed.
    int64_t next_ticket = 0, serving = 0, ticket[2] = {0, 0};
    void begin_pair();
    void end_pair();
    void acquire(int lane);  // wait for this lane's turn (or the other lane's half has ended)
    void pass(int lane);     // hand the turn to the other lane
    void finish(int lane);   // this lane's half has ended: the other lane runs on without waiting
    void link_acquire(int lane);  // paced: wait until this lane's ticket is served
    void link_release(int lane);
  };
  std::shared_ptr<Baton> baton;
  int lane_id = 0;
  // The exposed EP time (ep_exposure.h): shared by the lanes when ep > 1 (else null). busy_since: when this
  // lane's current compute span began (< 0: none open).
  std::shared_ptr<EpExposure> exposure;
  std::shared_ptr<WArenaPool> wpool = std::make_shared<WArenaPool>();
  double busy_since = -1;
  void busy_open() {
    if (exposure) busy_since = EpExposure::now();
  }
  double busy_close() {  // closes the open compute span; returns now
    if (!exposure) return 0;
    const double t = EpExposure::now();
    if (busy_since >= 0) exposure->busy(busy_since, t);
    busy_since = -1;
    return t;
  }
  struct StageTurn {  // scope of a stage call on a lane
    Impl& i;
    explicit StageTurn(Impl& x) : i(x) {
      if (i.baton) i.baton->acquire(i.lane_id);
      i.busy_open();
    }
    ~StageTurn() {
      i.busy_close();
      if (i.baton) i.baton->finish(i.lane_id);
    }
  };
  struct EpYield {  // scope of one EP exchange: the other lane computes meanwhile
    Impl& i;
    double t0 = 0;
    std::optional<CommIdleWork> fill;  // the I half's recorded weight gradients, run while both lanes wait
    explicit EpYield(Impl& x) : i(x) {
      t0 = i.busy_close();
      if (i.baton) i.baton->pass(i.lane_id), i.baton->link_acquire(i.lane_id);
      if (i.baton && i.baton->fill_w && (i.defer || i.baton->carry_w)) fill.emplace(&Impl::fill_hook, &i);
    }
    ~EpYield() {
      if (i.exposure) i.exposure->wait(t0, EpExposure::now());
      if (i.baton) i.baton->link_release(i.lane_id), i.baton->acquire(i.lane_id);
      i.busy_open();
    }
  };
  StageRt& stage_rt(int local, const char* op) {
    MT_CHECK(local >= 0 && local < int(stages.size()), op, "local stage ", local, " outside [0, ", stages.size(), ")");
    return stages[size_t(local)];
  }
  void sync_lane_from(const Impl& o);  // the per-layer packed-weight descriptors after sync_weights
  void alloc_bufs(LayerBufs& b, bool moe);
  void alloc_row_scratch(int64_t rows);

  // ---- multi-token prediction (model_mtp.cpp; docs/model.md, "Multi-token prediction") ----
  // Depth k (0-based) is the block layers[n_layers + k] (held with the head stage) and the parameters below; it reads
  // the previous depth's output (the main model's last layer output for k = 0) and the embedding of the tokens k + 1
  // ahead, and predicts the tokens k + 2 ahead through the shared head.
  int64_t Dm = 0;  // MTP depths (model.mtp_layers)
  struct MtpParams {
    int enorm = -1, hnorm = -1, eh_proj = -1, norm = -1;
  };
  std::vector<MtpParams> mtp;
  // Saved per activation slot and depth: the depth's input hidden state hin and embedding rows erows (the norms'
  // inputs) with their rstd, the concatenation [N, 2d] in the compute dtype (eh_proj's input), hg = dL/d(depth
  // output) (its head's, plus the next depth's through its hnorm), and the depth's input tokens and targets.
  struct MtpBufs {
    Tensor hin, erows, rstd_e, rstd_h, cat, hg;
    std::vector<int32_t> tok, tgt;
  };
  std::vector<std::vector<MtpBufs>> mtp_slot;  // [slot][depth], the head stage's
  Impl* mtp_home = nullptr;  // the EP overlap's lane 1: the lane whose mtp_slot it uses (a slot's forward and backward
                             // may run on different lanes)
  MtpBufs& mtp_buf(int slot, int64_t k) { return (mtp_home ? mtp_home : this)->mtp_slot[size_t(slot)][size_t(k)]; }
  Tensor mtp_x, mtp_a, mtp_b, mtp_hfc, mtp_rstd;  // scratch: [N, d], [N, 2d], [N, d] fp32; the head's norm output
  void mtp_build();  // the buffers above (build, after build_slots)
  void mtp_scratch();  // the scratch of the line above it (mtp_x .. mtp_rstd): one set per lane
  // After the main head: the depths' forward and their fused heads (with backward, each depth's dL/d(output) kept in
  // its hg); the per-depth cross-entropy sums into st.mtp_ce / mtp_n. targets: the whole micro-batch's.
  void mtp_forward(int slot, const float* h0, const int32_t* targets, bool backward, float ce_scale, ForwardStats& st);
  // The depths' backward, last first (block, eh_proj, the two norms, the embedding rows into tied_hg); the first
  // depth's dL/dh0 is added into g.
  void mtp_backward(int slot, float* g);
  // One depth's head: its norm, the shared head's fused cross-entropy (scale: the loss gradient's), with backward
  // dL/dx into g. Returns the cross-entropy sum over its targets.
  double mtp_head(int64_t k, const float* x, const int32_t* tgt, bool backward, float scale, float* g);

  // ---- the pass (model.cpp): embedding, the layers in order, head + loss, and back ----
  ForwardStats run(const int32_t* tokens, const int32_t* targets, bool backward, float ce_scale, float aux_scale);

  // ---- embedding and head (model_embed_head.cpp) ----
  // x [N, d] = the tokens' embedding rows. head_grads: the pass will run the head backward (with tied
  // embeddings the embedding unit then stays gathered, with its gradient, until embed_backward).
  void embed_forward(const int32_t* tokens, float* x, bool head_grads);
  // Final norm of x (the last layer's output) and the fused head + cross-entropy. Sets ce_sum and ce_count.
  // backward: also the loss and final-norm backward, leaving dL/dx in g (ce_scale scales the loss gradient).
  void head_loss(const float* x, const int32_t* targets, bool backward, float ce_scale, float* g, ForwardStats& st);
  // The embedding gradient from g = dL/d(embedding output), rows in token order (deterministic).
  void embed_backward(const int32_t* tokens, const float* g);

  // ---- one decoder layer (model_layer.cpp) ----
  // forward_layer(l, x): layer l on the residual stream x [N, d] in place (saves its input, gathers and
  // releases its FSDP unit). backward_layer(l, g): g = dL/d(layer output) in, dL/d(layer input) out; full
  // recompute first when the layer is checkpointed. Layers run in any contiguous range, forward ascending
  // and backward descending, given the matching x / g and the pass state run() sets first (statistics
  // reset, cur_aux_scale). Each layer keeps one micro-batch's saved activations.
  void forward_layer(int64_t l, float* x);
  void backward_layer(int64_t l, float* g);
  void layer_forward(Layer& L, const float* xin, float* xout);  // compute only (no unit, no input save)
  void layer_backward(Layer& L, float* dxio);  // dxio: gradient w.r.t. layer output in, input out
  // The FFN of a layer, dense or MoE: y [N, d] from b.h2 / b.h2c; dh2 (out) = grad of h2 from dy.
  void ffn_forward(Layer& L, LayerBufs& b, float* y /* [N,d] */);
  void ffn_backward(Layer& L, LayerBufs& b, const float* dy, float* dh2 /* out */, float aux_scale);
  void recompute_selected_ffn(Layer& L, LayerBufs& b);
  void recompute_selected_attn(Layer& L, LayerBufs& b);
  LayerBufs sel;  // buffers shared by the layers whose modules are selectively recomputed

  // ---- attention (model_attention.cpp) ----
  AttnDims attn_dims() const;
  void attn_forward(Layer& L, LayerBufs& b);
  void attn_core(LayerBufs& b);
  void attn_core_backward(float* dq, float* dk, float* dv, const float* dao, LayerBufs& b, const float* q,
                          const float* k, const float* v, const AttnDims& ad);
  void attn_backward(Layer& L, LayerBufs& b, const void* do_c, float* dh /* [N,d] out: grad of h1 */);
  // qk_norm (MHA/GQA): the per-head RMSNorm of q and k in place on b.qkv (before rope), saving b.qkx / b.qkrstd;
  // and its backward on dqkv [N, Wqkv] (after rope's backward), accumulating the two weight gradients.
  void qk_norm_forward(Layer& L, LayerBufs& b);
  void qk_norm_backward(Layer& L, LayerBufs& b, float* dqkv);

  // ---- dense SwiGLU FFN (model_mlp.cpp) ----
  // y [N, d] (+= when acc) = (SwiGLU(h2 W13[w13]) W2[w2]), width Fw; b.gu / b.actc keep the activations.
  void swiglu_mlp_forward(LayerBufs& b, int w13, int w2, int64_t Fw, float* y, bool acc);
  // Its backward from dy (compute dtype): weight gradients accumulated, dh2 (+= when acc) = grad of h2.
  void swiglu_mlp_backward(LayerBufs& b, int w13, int w2, int64_t Fw, const void* dy_c, float* dh2, bool acc);

  // ---- MoE FFN (model_moe.cpp) ----
  void moe_forward(Layer& L, LayerBufs& b, float* y);
  void moe_backward(Layer& L, LayerBufs& b, const float* dy, const void* dy_c, float* dh2, float aux_scale);
  // The El local experts on R rows grouped by expert (b.kept counts, b.xpc input): gate/up GEMM, SwiGLU,
  // down GEMM into b.ez; and the backward from the weighted output gradient dz (compute dtype), which
  // accumulates the expert weight gradients and returns the input gradient [R, d] (in s_f1).
  void experts_forward(Layer& L, LayerBufs& b, int64_t R);
  float* experts_backward(Layer& L, LayerBufs& b, const void* dz, int64_t R);
  // Packed expert weights (gate/up and down, forward and dgrad layouts) of the El local experts: the four
  // buffers, and packing a layer's fp32 expert weights into them (the layer's pk* handles point there).
  void alloc_packed(Tensor& p13f, Tensor& p13d, Tensor& p2f, Tensor& p2d, const char* name);
  void pack_experts(Layer& L, Tensor& p13f, Tensor& p13d, Tensor& p2f, Tensor& p2d);
  // Experts [e0, e1) of L's w13 (mat 0) or w2 (mat 1) into the forward and dgrad panels pf, pd (L's pk* handles
  // point there); pack_experts is all experts of both.
  void pack_expert_range(Layer& L, int mat, int64_t e0, int64_t e1, Tensor& pf, Tensor& pd);
  size_t grouped_ws_bytes(int64_t rows) const;

  // ---- the routed experts under expert parallelism (model_ep.cpp; after the router, before the shared
  // experts) ----
  void ep_ffn_forward(Layer& L, LayerBufs& b, float* y);
  void ep_ffn_backward(Layer& L, LayerBufs& b, const float* dy, float* dh2);
  void ensure_rows(Layer& L, int64_t R);
  void ensure_scratch(int64_t R);
};

}  // namespace moetron
