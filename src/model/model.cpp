// model.cpp: the decoder's construction (parameter layout, saved-activation and scratch buffers, kernel
// workspace), the public Model API (parameters, init, weight sync, expert bias and counts, EP figures) and
// one pass: the embedding, the decoder layers in order (forward_layer), the head + loss, and the backward
// in reverse (backward_layer, then the embedding gradient). See model.h; model_impl.h lists where each
// part of Model::Impl is defined.
// Per layer: x_mid = x + Attn(RMSNorm(x)); x_out = x_mid + FFN(RMSNorm(x_mid)), FFN dense SwiGLU or MoE
// (router -> permute -> grouped gate/up GEMM -> SwiGLU -> grouped down GEMM -> weighted combine, plus
// shared experts as one dense SwiGLU of width n_shared * moe_inter_size).
// Matmuls take operands in the compute dtype (bf16, or fp32 on CPUs without native bf16; see
// resolve_compute_dtype) with fp32 accumulation; the residual stream, norms, softmax, router and losses are
// fp32. A buffer named *c holds a GEMM operand in the compute dtype: in fp32 mode it is the fp32 tensor
// itself where one exists (no copy), otherwise its bf16 copy. Weights are stored input-major ([in, out])
// except the embedding and the head ([V, d]).
// Not the layer math (model_layer.cpp, model_attention.cpp, model_mlp.cpp, model_moe.cpp, model_ep.cpp),
// not the embedding / head steps (model_embed_head.cpp) and not FSDP's unit slots (model_fsdp.cpp).
#include "moetron/model.h"

#include <algorithm>
#include <cstring>

#include "model/model_impl.h"
#include "moetron/cp_attention.h"
#include "moetron/fsdp.h"
#include "moetron/gemm.h"
#include "moetron/loss.h"
#include "moetron/rng.h"
#include "moetron/rope.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"
#include "moetron/vocab_parallel.h"

namespace moetron {

using model_detail::f32buf;
using model_detail::i32buf;

// ---------------------------------------------------------------------------------------------------
// construction

bool Model::attention_bf16() const { return impl_->attn16; }

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
    : spec_(spec), ac_(ac), B_(B), T_(T), seq_len_(T), compute_(resolve_compute_dtype(compute)) {
  spec_.resolve();
  spec_.validate();
  MT_CHECK(B > 0 && T > 0, "Model", "micro-batch shape B=", B, " T=", T, " must be positive");
  // GPT-style keys the accounting and the planner describe (dense anchors) but the engine does not run.
  MT_CHECK(spec_.ffn == FfnKind::SwiGLU, "Model", "model.ffn = ", to_string(spec_.ffn),
           " is not implemented in the engine (the GELU MLP is planned only: `moetron plan`); use \"swiglu\"");
  MT_CHECK(spec_.dropout == 0, "Model", "model.dropout = ", spec_.dropout,
           " is not implemented in the engine (dropout is planned only: `moetron plan`); use 0");
  MT_CHECK(spec_.moe.expert_act == ExpertAct::SwiGLU, "Model", "model.expert_act = ", to_string(spec_.moe.expert_act),
           " is not implemented in the engine (GPT-OSS's clamped SwiGLU is planned only: `moetron plan`); use "
           "\"swiglu\"");
  MT_CHECK(spec_.attention_impl == AttnImpl::Flash, "Model", "model.attention_impl = ", to_string(spec_.attention_impl),
           " is not implemented in the engine (its attention is flash; unfused is planned only: `moetron plan`)");
  impl_ = std::make_unique<Impl>(*this);
  impl_->f32 = compute_ == ComputeDtype::FP32;
  MT_CHECK(par.attention != ComputeDtype::BF16 || !impl_->f32, "Model",
           "training.attention_dtype = \"bf16\" needs bf16 compute, but training.compute_dtype resolved to fp32 here; "
           "use attention_dtype \"auto\" or \"fp32\"");
  impl_->attn16 = !impl_->f32 && (par.attention == ComputeDtype::BF16 ||
                                  (par.attention == ComputeDtype::Auto && attention_bf16_preferred()));
  impl_->par = par;
  if (par.ep && par.ep->size() > 1) impl_->ep_comm = *par.ep, impl_->ep = par.ep->size();
  MT_CHECK(impl_->ep == 1 || spec_.is_moe(), "Model", "expert parallelism (ep = ", impl_->ep,
           ") needs an MoE model; this one has no routed experts");
  if (par.cp && par.cp->size() > 1) {
    const int cp = par.cp->size();
    MT_CHECK(T % (2 * cp) == 0, "Model", "training.seq_len = ", T, " is not divisible by 2 * parallelism.cp = ", 2 * cp,
             ": context parallelism cuts each sequence into 2 cp equal chunks");
    impl_->cp_comm = *par.cp, impl_->cp = cp, impl_->cp_rank = par.cp->rank();
    T_ = T / cp;
    const char* why = " is not implemented with context parallelism (parallelism.cp > 1) yet";
    MT_CHECK(!par.ep_overlap, "Model", "parallelism.ep_overlap = true", why, "; use false");
    MT_CHECK(ac.mode != AcMode::Selective, "Model", "activation_checkpoint.mode = \"selective\"", why,
             "; use \"full\" or \"none\"");
  }
  if (par.tp && par.tp->size() > 1) {
    impl_->tp_comm = *par.tp, impl_->tp = par.tp->size(), impl_->tp_rank = par.tp->rank();
    const char* why = " is not implemented with tensor parallelism (parallelism.tp > 1) yet";
    MT_CHECK(par.fsdp == nullptr, "Model", "FSDP (parallelism.zero = 3)", why, "; use zero = 0 or 1");
    MT_CHECK(!par.ep_overlap, "Model", "parallelism.ep_overlap = true", why, "; use false");
    MT_CHECK(ac.mode != AcMode::Selective, "Model", "activation_checkpoint.mode = \"selective\"", why,
             "; use \"full\" or \"none\"");
  }
  impl_->Dm = spec_.mtp_layers;
  if (spec_.mtp_layers > 0) {  // multi-token prediction (model_mtp.cpp): what it is not implemented with yet
    const std::string why = "model.mtp_layers = " + std::to_string(spec_.mtp_layers) + " is not implemented with ";
    MT_CHECK(T > spec_.mtp_layers, "Model", why, "training.seq_len = ", T, ": depth k predicts the token k + 1 "
             "positions ahead, so the sequence needs more than mtp_layers tokens");
    MT_CHECK(!par.ep_overlap || !spec_.tie_embeddings, "Model", why, "parallelism.ep_overlap = true and "
             "model.tie_embeddings = true yet (on the head stage the two lanes would both add into the tied weight's "
             "gradient at once: one lane's forward the head's, the other's backward the depths' embedding rows); use "
             "tie_embeddings = false or ep_overlap = false");
  }
  impl_->fs_opts = par.fsdp;
  MT_CHECK(!par.ep_overlap || (par.fsdp == nullptr && ac.mode == AcMode::None), "Model",
           "the EP overlap (parallelism.ep_overlap) runs two micro-batches at once on lanes that share the "
           "model's buffers: not with FSDP (parallelism.zero = 3) or activation recompute "
           "(activation_checkpoint.mode) yet");
  impl_->build();
  impl_->fs_opts = nullptr;
  if (impl_->ep > 1) impl_->exposure = std::make_shared<EpExposure>();
  if (par.ep_overlap) {
    impl_->baton = std::make_shared<Impl::Baton>(par.ep_free_order, par.ep_paced_link);
    lane1_ = impl_->make_lane();
  }
}

Model::~Model() = default;

void Model::Impl::build() {
  build_stages();
  build_params();
  build_buffers();
  build_slots();
  mtp_build();
}

// Every buffer a pass uses, sized for the micro-batch: saved activations (shared between checkpointed
// layers), selective-recompute buffers, per-MoE-layer bias / counts / dispatcher / packed experts, rope
// tables, scratch and the kernel workspace.
void Model::Impl::build_buffers() {
  // Selective recompute: the chosen modules' outputs live in one set of buffers shared by every
  // selected layer; each layer recomputes them right before its backward needs them.
  const bool selective = m.ac_.mode == AcMode::Selective;
  bool any_norm = false, any_attn = false, any_act = false;
  for (int64_t l = 0; l < s.n_blocks(); ++l) {  // the MTP blocks too (their ids follow the layers')
    Layer& L = layers[l];
    if (!L.held) continue;
    L.recompute = m.ac_.mode == AcMode::Full && m.ac_.applies_to(l);
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
    if (!L.moe || !L.held) continue;
    L.bias = f32buf(E, MemCategory::Params);
    L.count_acc.assign(size_t(E), 0);
    if (fs_on) continue;  // FSDP: the packed expert weights live in the unit slots
    alloc_packed(L.p13f, L.p13d, L.p2f, L.p2d, "experts.packed");
  }
  if (has_head && (s.tie_embeddings || Dm > 0)) tied_hg = f32buf(Vl * d, MemCategory::Grads);

  // rope tables
  int64_t R = s.attn.type == AttnType::MLA ? dr : hd;
  rope_cos = f32buf(m.T_ * R / 2, MemCategory::Workspace);
  rope_sin = f32buf(m.T_ * R / 2, MemCategory::Workspace);
  if (cp == 1) {
    rope_table(rope_cos.data<float>(), rope_sin.data<float>(), m.T_, R, float(s.rope_theta));
  } else {  // CP: the rows of the whole sequence's table at this rank's positions
    std::vector<float> c(size_t(m.seq_len_ * R / 2)), sn(c.size());
    rope_table(c.data(), sn.data(), m.seq_len_, R, float(s.rope_theta));
    cp_take_rows(rope_cos.raw(), c.data(), 1, m.seq_len_, R / 2 * 4, cp, cp_rank);
    cp_take_rows(rope_sin.raw(), sn.data(), 1, m.seq_len_, R / 2 * 4, cp, cp_rank);
  }

  // kernel workspace: the max over every call site
  // bf16 compute sizes the bf16 attention workspace whichever kernels run (the accounting cannot know the CPU).
  AttnDims ad = attn_dims();
  if (!f32) ad.prec = AttnPrec::BF16;
  size_t w = attention_workspace_bytes(ad, num_threads());
  if (has_head && tp == 1) w = std::max(w, linear_xent_workspace_bytes(N, V, linear_xent_default_chunk(V)));
  if (has_head && tp > 1)
    w = std::max(w, vocab_xent_workspace_bytes(N, d, V, tp, vocab_xent_default_chunk(V, tp), TpReduce::ReduceScatter));
  w = std::max(w, rmsnorm_backward_workspace_bytes(N, std::max<int64_t>({d, rq, rkv})));
  if (s.attn.qk_norm) w = std::max(w, rmsnorm_backward_workspace_bytes(N * H, hd));
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
    rcfg.sinkhorn_iters = int(s.moe.sinkhorn_iters);
    rcfg.capacity = float(s.moe.route_capacity);
    if (cp > 1)  // CP: a sequence's aux-loss counts span its chunks on every CP rank
      rcfg.split = cp, rcfg.sum_counts = [this](int32_t* c, int64_t n) { cp_comm.all_reduce(c, n); };
    if (cp > 1 && (rcfg.sinkhorn_iters > 0 || rcfg.capacity > 0)) {
      // Balanced routing selects over the whole micro-batch: the CP ranks' score rows, gathered in rank order,
      // each rank's rows being its chunks of every sequence (cp_positions), go to position b * seq_len + t.
      rcfg.split_rank = cp_rank;
      rcfg.split_rows.reserve(size_t(N * cp));
      for (int r = 0; r < cp; ++r) {
        const std::vector<int64_t> pos = cp_positions(m.seq_len_, cp, r);
        for (int64_t b = 0; b < m.B_; ++b)
          for (int64_t t : pos) rcfg.split_rows.push_back(b * m.seq_len_ + t);
      }
      rcfg.gather_rows = [this](float* all, const float* mine, int64_t n) {
        cp_comm.all_gather(all, mine, n * int64_t(sizeof(float)));
      };
    }
    router_validate(rcfg, N);
    w = std::max(w, router_workspace_bytes(rcfg, N));
    w = std::max(w, grouped_ws_bytes(Rmax));
  }
  ws_bytes = w;
  alloc_scratch();
}

// What one execution lane writes while it runs a pass (see model_impl.h, "lanes"): the residual and gradient
// scratch, the routed-row scratch, the head's buffers and the kernel workspace.
void Model::Impl::alloc_scratch() {
  if (ep > 1) send_idx = i32buf(N * K, MemCategory::Workspace);
  if (has_head) xf = f32buf(Nr * d), rstdf = f32buf(Nr), hfc = cbuf(N * d);
  if (tp > 1) tp_full = f32buf(N * d, MemCategory::Workspace), tp_fullc = cbuf(N * d, MemCategory::Workspace);
  if (m.ac_.mode == AcMode::Full) recompute_out = f32buf(N * d, MemCategory::Workspace);
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

  if (ws_bytes > 0) ws = Tensor::zeros({int64_t((ws_bytes + 3) / 4)}, DType::F32, MemCategory::Workspace, "kernel.ws");
}

void Model::Impl::alloc_bufs(LayerBufs& b, bool moe) {
  b.rstd1 = f32buf(Nr), b.h1c = cbuf(N * d), b.x_mid = f32buf(Nr * d), b.rstd2 = f32buf(Nr);
  b.h2 = f32buf(N * d), b.h2c = cbuf_or(b.h2, N * d);
  if (s.attn.type == AttnType::MLA) {
    if (rq > 0) b.cq = f32buf(N * rq), b.rstdq = f32buf(N), b.cqnc = cbuf(N * rq);
    b.q = f32buf(N * H * Dqk), b.ckv = f32buf(N * rkv), b.rstdkv = f32buf(N), b.ckvnc = cbuf(N * rkv);
    b.kpe = f32buf(N * dr), b.kv = f32buf(N * H * (dn + Dv)), b.k = f32buf(N * H * Dqk);
  } else {
    b.qkv = f32buf(N * Wqkv);
    if (s.attn.qk_norm) b.qkx = f32buf(N * (H + Hkv) * hd), b.qkrstd = f32buf(N * (H + Hkv));
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

const ParamEntry& Model::param(const std::string& name) const {
  for (auto& p : params_)
    if (p.name == name) return p;
  MT_FAIL("Model::param", "no parameter named '", name, "'");
}

void Model::init_params(uint64_t seed) {
  if (fsdp_) {
    fsdp_->init(seed);
    for (auto& L : impl_->layers)
      if (L.moe && L.held) L.bias.zero_();
    return;
  }
  float* p = pbuf_.data<float>();
  for (auto& e : params_) init_param_elements(p + e.offset, e, seed, 0, e.numel);
  for (auto& L : impl_->layers)
    if (L.moe && L.held) L.bias.zero_();
  sync_weights();
}

void Model::set_sync_piece_elems(int64_t elems) {
  MT_CHECK(elems >= 1, "Model::set_sync_piece_elems", "a piece needs at least one element, got ", elems);
  sync_piece_elems_ = elems;
  impl_->sync_pieces.clear();
}

// The refresh's pieces, in flat-offset order: the held routed experts' matrices in groups of experts (their GEMMs
// read only the packed panels; W() is never asked for them, so they have no bf16 copy), everything else in runs of
// at most sync_piece_elems_ (bf16 mode: converted to the bf16 copy; fp32 mode: nothing to make). By default 2 MiB of
// fp32 masters a piece: the optimizer's update of a piece streams four such arrays (p, m, v, g) through the caches,
// and the refresh that follows finds the piece's masters still there (the 32 MiB L3 of the machines measured).
void Model::plan_sync_pieces() {
  auto& I = *impl_;
  if (!I.sync_pieces.empty() || fsdp_) return;
  const int64_t piece = sync_piece_elems_;
  using Piece = Impl::SyncPiece;
  std::vector<Piece> experts;  // the packed-only ranges, one piece per group of experts
  for (size_t l = 0; l < I.layers.size(); ++l) {
    Layer& L = I.layers[l];
    if (!L.moe || !L.held) continue;
    for (int mat = 0; mat < 2; ++mat) {
      const ParamEntry& e = params_[size_t(mat == 0 ? L.we13 : L.we2)];
      const int64_t per = e.numel / std::max<int64_t>(I.El, 1);
      const int64_t group = sync_experts_per_piece(per, piece);
      for (int64_t e0 = 0; e0 < I.El; e0 += group) {
        const int64_t e1 = std::min(I.El, e0 + group);
        experts.push_back(Piece{e.offset + e0 * per, e.offset + e1 * per, int(l), mat, e0, e1});
      }
    }
  }
  std::sort(experts.begin(), experts.end(), [](const Piece& a, const Piece& b) { return a.lo < b.lo; });
  auto plain = [&](int64_t lo, int64_t hi) {
    for (int64_t a = lo; a < hi; a += piece) I.sync_pieces.push_back(Piece{a, std::min(hi, a + piece)});
  };
  int64_t at = 0;
  for (const Piece& x : experts) {
    plain(at, x.lo);
    I.sync_pieces.push_back(x);
    at = x.hi;
  }
  plain(at, n_params_);
}

void Model::refresh_piece(size_t k) {
  auto& I = *impl_;
  const Impl::SyncPiece& x = I.sync_pieces[k];
  if (x.layer >= 0) {
    Layer& L = I.layers[size_t(x.layer)];
    I.pack_expert_range(L, x.mat, x.e0, x.e1, x.mat == 0 ? L.p13f : L.p2f, x.mat == 0 ? L.p13d : L.p2d);
  }
  else if (!I.f32) f32_to_bf16(I.wc.data<bf16>() + x.lo, pbuf_.data<float>() + x.lo, x.hi - x.lo);
}

void Model::sync_weights() {
  if (fsdp_) return;  // FSDP: a unit's bf16 copy and packed experts are made when it is gathered
  plan_sync_pieces();
  for (size_t k = 0; k < impl_->sync_pieces.size(); ++k) refresh_piece(k);
  if (lane1_) lane1_->sync_lane_from(*impl_);
}

void Model::update_and_sync(const std::function<void(int64_t lo, int64_t hi)>& update) {
  MT_CHECK(!fsdp_, "Model::update_and_sync", "FSDP models refresh a unit where it is gathered (use sync_weights)");
  plan_sync_pieces();
  for (size_t k = 0; k < impl_->sync_pieces.size(); ++k) {
    const Impl::SyncPiece& x = impl_->sync_pieces[k];
    {
      MT_TRACE("optim.adamw");
      update(x.lo, x.hi);
    }
    MT_TRACE("sync_weights");
    refresh_piece(k);
  }
  if (lane1_) lane1_->sync_lane_from(*impl_);
}

void Model::zero_grads() {
  MT_TRACE("optim.zero_grads");  // the planner's optimizer row counts it (plan validate)
  grads_pending_ = false;
  if (fsdp_) fsdp_->zero_grads();
  else zero_bytes(gbuf_.raw(), gbuf_.nbytes());
  if (impl_->tied_hg.defined()) impl_->tied_hg.zero_();
}

void Model::begin_grads() {
  if (fsdp_ || !gbuf_.defined()) return zero_grads();
  MT_TRACE("optim.zero_grads");
  grad_unwritten_.assign(params_.size(), 1);
  grads_pending_ = true;
  if (impl_->tied_hg.defined()) impl_->tied_hg.zero_();
}

void Model::settle_pending_grads() {
  MT_TRACE("optim.zero_grads");
  grads_pending_ = false;
  float* g = gbuf_.data<float>();
  for (size_t i = 0; i < params_.size(); ++i)
    if (grad_unwritten_[i]) zero_bytes(g + params_[i].offset, size_t(params_[i].numel) * 4), grad_unwritten_[i] = 0;
}

int Model::ep_size() const { return impl_->ep; }
int64_t Model::residual_rows() const { return impl_->Nr; }
int Model::first_expert() const { return int(impl_->e0); }
int Model::local_experts() const { return int(impl_->El); }

EpTraffic Model::ep_traffic() const {
  EpTraffic t;
  for (auto& dp : impl_->owned_disp) {
    EpStats s = dp->stats();
    t.add(s.dispatch), t.add(s.combine), t.add(s.backward);
  }
  return t;
}

Model::EpExposed Model::ep_exposed() const {
  EpExposed e;
  if (!impl_->exposure) return e;
  e.wait_seconds = impl_->exposure->wait_total();
  e.exposed_seconds = impl_->exposure->exposed_total();
  e.exposed_paired_seconds = impl_->exposure->exposed_paired_total();
  if (impl_->baton) {
    std::lock_guard<std::mutex> lk(impl_->baton->mu);
    e.wgrad_fill_tasks = impl_->baton->filled, e.wgrad_fill_seconds = impl_->baton->filled_seconds;
  }
  return e;
}

Model::EpRows Model::ep_rows() const {
  EpRows r;
  const auto& I = *impl_;
  if (I.ep <= 1) return r;
  for (const auto& L : I.layers) {
    if (!L.moe || !L.held) continue;
    int64_t peak = 0, held = 0;
    for (const LayerBufs* b : L.slot_bufs) peak = std::max(peak, b->rows_peak), held = std::max(held, b->rows_cap);
    r.peak += peak, r.held += held, r.balanced += I.N * I.K;
  }
  return r;
}

int64_t Model::ep_buffer_bytes() const {
  int64_t b = 0;
  for (auto& dp : impl_->owned_disp) b += dp->buffer_bytes();
  return b;
}

int Model::n_moe_layers() const {
  int n = 0;
  for (auto& L : impl_->layers) n += L.moe && L.held;
  return n;
}

int Model::n_moe_layers_total() const { return impl_->n_moe_total; }

std::vector<int> Model::local_moe_layers() const {
  std::vector<int> v;
  for (auto& L : impl_->layers)
    if (L.moe && L.held) v.push_back(L.moe_index);
  return v;
}

float* Model::expert_bias(int moe_layer) {
  for (auto& L : impl_->layers)
    if (L.moe && L.held && L.moe_index == moe_layer) return L.bias.data<float>();
  MT_FAIL("Model::expert_bias", "MoE layer ", moe_layer, " is not on this rank (", n_moe_layers(), " of ",
          impl_->n_moe_total, " MoE layers are)");
}

std::vector<std::vector<int64_t>> Model::take_expert_counts() {
  std::vector<std::vector<int64_t>> out;
  for (auto& L : impl_->layers) {
    if (!L.moe || !L.held) continue;
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
    if (!L.moe || !L.held) continue;
    const float rate = float(spec_.moe.bias_update_rate);
    if (spec_.moe.bias_update == BiasUpdate::Proportional)
      router_update_bias_proportional(L.bias.data<float>(), counts[i++].data(), int(impl_->E), rate);
    else
      router_update_bias(L.bias.data<float>(), counts[i++].data(), int(impl_->E), rate);
  }
}

// ---------------------------------------------------------------------------------------------------
// one pass

ForwardStats Model::Impl::run(const int32_t* tokens, const int32_t* targets, bool backward, float ce_scale,
                              float aux_scale) {
  MT_CHECK(whole, "Model::forward", "this model holds pipeline stages (", stages.size(),
           " local); run them with stage_forward / stage_backward");
  const float ce0 = step_ce_scale, aux0 = step_aux_scale;
  step_ce_scale = ce_scale, step_aux_scale = aux_scale;
  ForwardStats st = m.stage_forward(0, 0, tokens, targets, nullptr, nullptr, backward);
  if (backward) {
    m.stage_backward(0, 0, tokens, nullptr, nullptr, true);
    m.fold_tied_head_grad();
  }
  step_ce_scale = ce0, step_aux_scale = aux0;
  return st;
}

ForwardStats Model::forward_backward(const int32_t* tokens, const int32_t* targets, float ce_scale, float aux_scale) {
  return impl_->run(tokens, targets, true, ce_scale, aux_scale);
}

ForwardStats Model::forward(const int32_t* tokens, const int32_t* targets) {
  return impl_->run(tokens, targets, false, 0.0f, 0.0f);
}

}  // namespace moetron
