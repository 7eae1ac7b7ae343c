// model_fp8.cpp: the FP8 linears of [quantize] (docs/fp8.md): which parameters are FP8 (the sites), their three
// GEMMs per linear (forward, dgrad, wgrad) on operands quantized per the recipe, the routed experts' per-expert
// GEMMs, the delayed-scaling amax histories and the per-step amax / scale record.
//   forward  Y  = X · W        A = X [T, in] along in           B = W^T [out, in] along in
//   dgrad    dX = dY · W^T     A = dY [T, out] along out        B = W [in, out] along out
//   wgrad    dW += X^T · dY    A = X^T [in, T] along T          B = dY^T [out, T] along T
// (W is stored [in, out].) X and W are E4M3; dY is E4M3, or E5M2 with format = "hybrid". Weights are quantized
// from the fp32 masters at every use (the masters stay fp32). The routed experts quantize each expert's rows on
// their own (so a tensorwise scale does not depend on which other experts' rows share the GEMM, which keeps
// expert parallelism equal to one process) and run one FP8 GEMM per expert: bitwise the grouped GEMM's rows.
// With cache_fp8_activations the inputs fp8_cache_plan names are kept for the weight gradient as the FP8 operand
// of their forward GEMM (Fp8Saved, in the layer's buffers) and their high-precision buffers become shared scratch.
// Not the kernels (fp8_gemm.h) and not the high-precision paths (embedding, head and router stay fp32 / the
// compute dtype).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "moetron/accounting.h"

#include "model/model_impl.h"
#include "moetron/trace.h"

namespace moetron {

using model_detail::f32buf;

const char* fp8_module_name(Fp8Module m) {
  switch (m) {
    case Fp8Module::Attention: return "attention";
    case Fp8Module::DenseMlp: return "dense_mlp";
    case Fp8Module::SharedExperts: return "shared_experts";
    case Fp8Module::RoutedExperts: return "routed_experts";
  }
  return "?";
}

namespace {

// The module a parameter belongs to, or false when it stays in high precision (embedding, norms, router, head).
// The MTP blocks (mtp.<k>.block.*) are decoder layers like the main ones and get the same sites; the rest of an MTP
// depth stays in high precision: its norms, and eh_proj (docs/fp8.md, "Multi-token prediction": the projection
// that mixes the high-precision embedding rows into the depth's residual stream; inference engines load DeepSeek-V3's
// FP8 checkpoint with eh_proj as a plain linear while the block's linears take the FP8 config).
bool fp8_module_of(const std::string& name, Fp8Module* m) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  const bool mtp_block = name.rfind("mtp.", 0) == 0 && has(".block.");
  if ((name.rfind("layers.", 0) != 0 && !mtp_block) || has("norm")) return false;
  if (has(".attn.")) return *m = Fp8Module::Attention, true;
  if (has(".mlp.")) return *m = Fp8Module::DenseMlp, true;
  if (has(".moe.shared.")) return *m = Fp8Module::SharedExperts, true;
  if (has(".moe.experts.")) return *m = Fp8Module::RoutedExperts, true;
  return false;  // moe.gate: the router
}

float amax_of(const float* x, int64_t n) {
  float a = 0.0f;
#pragma omp parallel for schedule(static) reduction(max : a) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::fabs(x[i]);
    if (v < INFINITY && v > a) a = v;
  }
  return a;
}

}  // namespace

void Model::set_quantize(const QuantizeSpec& q) {
  if (!q.on()) {
    impl_->fp8_cache_setup(false);
    impl_->fp8.reset();
    if (lane1_) lane1_->fp8.reset();
    return;
  }
  MT_CHECK(impl_->tp == 1, "Model::set_quantize", "[quantize] recipe = ", to_string(q.recipe), " is not implemented with "
           "tensor parallelism (parallelism.tp = ", impl_->tp, ") yet: the FP8 scales of a weight sliced over TP ranks "
           "would differ per rank; use recipe = \"none\"");
  auto st = std::make_shared<Fp8State>();
  st->q = q;
  for (const ParamEntry& e : model_param_layout(spec_)) {  // the whole model, global order
    Fp8Module m;
    if (!fp8_module_of(e.name, &m) || !q.has_module(fp8_module_name(m))) continue;
    Fp8Site s;
    s.param = e.name, s.module = m, s.mtp = e.name.rfind("mtp.", 0) == 0;
    s.hist.assign(3, Fp8AmaxHistory(q.amax_history_len));
    st->sites.push_back(std::move(s));
  }
  st->site_of.assign(params_.size(), -1);
  for (size_t i = 0; i < params_.size(); ++i)
    for (size_t k = 0; k < st->sites.size(); ++k)
      if (st->sites[k].param == params_[i].name) st->site_of[i] = int(k);
  impl_->fp8 = st;
  if (lane1_) lane1_->fp8 = st;
  impl_->fp8_cache_setup(q.cache_fp8_activations);
}

const QuantizeSpec& Model::quantize() const {
  static const QuantizeSpec none;
  return impl_->fp8 ? impl_->fp8->q : none;
}

void Model::set_fp8_twin(bool on) {
  MT_CHECK(impl_->fp8, "Model::set_fp8_twin", "FP8 is off (quantize.recipe = none)");
  impl_->fp8->twin = on;
}

std::vector<Model::Fp8Stat> Model::fp8_end_step(const Comm& world) {
  std::vector<Fp8Stat> out;
  if (!impl_->fp8) return out;
  Fp8State& st = *impl_->fp8;
  const size_t S = st.sites.size();
  // [site][op][amax, smin, smax] gathered from every rank: each rank saw its own micro-batches and sites.
  std::vector<float> mine(S * 9), all(S * 9 * size_t(world.size()));
  for (size_t k = 0; k < S; ++k)
    for (int op = 0; op < 3; ++op) {
      const Fp8Site& s = st.sites[k];
      float* v = &mine[(k * 3 + size_t(op)) * 3];
      v[0] = s.amax[op], v[1] = s.smin[op], v[2] = s.smax[op];
    }
  if (world.size() > 1) world.all_gather(all.data(), mine.data(), int64_t(mine.size() * 4));
  else all = mine;
  for (size_t k = 0; k < S; ++k) {
    Fp8Site& s = st.sites[k];
    for (int op = 0; op < 3; ++op) {
      float a = 0, lo = 0, hi = 0;
      for (int r = 0; r < world.size(); ++r) {
        const float* v = &all[size_t(r) * S * 9 + (k * 3 + size_t(op)) * 3];
        a = std::max(a, v[0]);
        if (v[1] > 0 && (lo == 0 || v[1] < lo)) lo = v[1];
        hi = std::max(hi, v[2]);
      }
      if (st.q.delayed()) s.hist[size_t(op)].push(a);
      s.amax[op] = 0, s.smin[op] = 0, s.smax[op] = 0;
      // per module: the max amax, the smallest and largest scale over its sites (the MTP blocks' apart, as
      // "mtp.<module>": a depth's block sees other activations than the main layers)
      const std::string mod = std::string(s.mtp ? "mtp." : "") + fp8_module_name(s.module);
      auto it = std::find_if(out.begin(), out.end(), [&](const Fp8Stat& x) { return x.module == mod; });
      if (it == out.end()) out.push_back(Fp8Stat{mod, {}, {}, {}}), it = out.end() - 1;
      it->amax[op] = std::max(it->amax[op], a);
      if (lo > 0 && (it->scale_min[op] == 0 || lo < it->scale_min[op])) it->scale_min[op] = lo;
      it->scale_max[op] = std::max(it->scale_max[op], hi);
    }
  }
  return out;
}

std::vector<float> Model::fp8_history() const {
  std::vector<float> h;
  if (!impl_->fp8 || !impl_->fp8->q.delayed()) return h;
  for (const Fp8Site& s : impl_->fp8->sites)
    for (const Fp8AmaxHistory& a : s.hist)  // oldest first: the ring unrolled from its write position
      for (size_t i = 0; i < a.history.size(); ++i) h.push_back(a.history[(size_t(a.pos) + i) % a.history.size()]);
  return h;
}

void Model::set_fp8_history(const std::vector<float>& h) {
  const std::vector<float> cur = fp8_history();
  MT_CHECK(h.size() == cur.size(), "Model::set_fp8_history", "got ", h.size(), " values, the model's FP8 sites hold ",
           cur.size(), " (quantize.modules or amax_history_len changed?)");
  size_t i = 0;
  for (Fp8Site& s : impl_->fp8->sites)
    for (Fp8AmaxHistory& a : s.hist) {
      for (float& v : a.history) v = h[i++];
      a.pos = 0;  // the next write replaces the oldest
    }
}

int64_t Model::fp8_sites() const { return impl_->fp8 ? int64_t(impl_->fp8->sites.size()) : 0; }

void Model::capture_linear(const std::string& param) {
  impl_->cap_p = -1, impl_->cap = {};
  if (param.empty()) return;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == param) impl_->cap_p = int(i);
  MT_CHECK(impl_->cap_p >= 0 && params_[size_t(impl_->cap_p)].shape.size() == 2, "Model::capture_linear", "'", param,
           "' is not a dense linear weight of this model");
}

const Model::LinearOperands& Model::captured_linear() const { return impl_->cap; }

void Model::Impl::capture_operand(int which, const void* t, int64_t rows, int64_t in, int64_t out) {
  cap.rows = rows, cap.in = in, cap.out = out;
  const int64_t n = rows * (which == 0 ? in : out);
  const float* f = fp8_f32(0, t, n);
  (which == 0 ? cap.x : cap.dy).assign(f, f + n);
  if (which == 0) cap.w.assign(P(cap_p), P(cap_p) + in * out);
}

// ---- Impl: operands and GEMMs ----

const Fp8Tensor& Model::Impl::fp8_quant(int s, int op, const float* x, int64_t R, int64_t C, bool transposed,
                                        Fp8Role role, Fp8Tensor& t) {
  MT_TRACE("fp8.quantize");
  Fp8State& st = *fp8;
  const QuantizeSpec& q = st.q;
  Fp8Site& site = st.sites[size_t(s)];
  const Fp8Format f = op == kFp8G && q.hybrid() ? Fp8Format::E5M2 : Fp8Format::E4M3;
  float amax = 0;
  if (q.delayed()) {  // tensorwise with the step's frozen scale (the histories move at the end of the step)
    Fp8Tensor d = fp8_quantize_scaled(x, R, C, f, role, site.hist[size_t(op)].scale(f), &amax);
    if (transposed) fp8_transpose_into(t, d);
    else t = std::move(d);
  } else {
    if (transposed) fp8_quantize_operand_t_into(t, fp8_xt, x, R, C, f, q.recipe, role);
    else fp8_quantize_operand_into(t, x, R, C, f, q.recipe, role);
    amax = amax_of(x, R * C);
  }
  if (R * C > 0) {
    const auto [lo, hi] = std::minmax_element(t.scales.begin(), t.scales.end());
    std::lock_guard<std::mutex> g(st.mu);
    site.amax[op] = std::max(site.amax[op], amax);
    if (site.smin[op] == 0 || *lo < site.smin[op]) site.smin[op] = *lo;
    site.smax[op] = std::max(site.smax[op], *hi);
  }
  return t;
}

void Model::Impl::fp8_mm(float* C, int64_t ldc, const Fp8Tensor& A, const Fp8Tensor& B, float beta) {
  MT_TRACE("fp8.gemm");
  if (!fp8->twin) return fp8_gemm(C, ldc, A, B, beta);
  // The twin: the operands dequantized, then the plain fp32 GEMM (what fp8_gemm must equal bitwise).
  MT_CHECK(A.cols == B.cols, "fp8 twin", "contraction sizes differ");
  const int64_t M = A.rows, Nn = B.rows, Kk = A.cols;
  if (M == 0 || Nn == 0) return;
  std::vector<float> a(size_t(M * Kk)), b(size_t(Nn * Kk));
  fp8_dequantize_operand(a.data(), A);
  fp8_dequantize_operand(b.data(), B);
  gemm_f32(Trans::N, Trans::T, M, Nn, Kk, 1.0f, a.data(), std::max<int64_t>(Kk, 1), b.data(), std::max<int64_t>(Kk, 1),
           beta, C, ldc);
}

const Fp8Saved* Model::Impl::fp8_cached_for_wgrad(int p, int64_t rows, int64_t in) {
  const Fp8Saved* c = fp8_cached(p);
  MT_CHECK(!c || (c->rows == rows && c->cols == in), "fp8 cache", m.params_[size_t(p)].name, ": cached ",
           c ? c->rows : 0, " x ", c ? c->cols : 0, ", the weight gradient needs ", rows, " x ", in);
  return c;
}

const float* Model::Impl::fp8_f32(int slot, const void* x, int64_t n) {
  if (f32) return static_cast<const float*>(x);
  std::vector<float>& t = fp8_tmp[slot];
  if (int64_t(t.size()) < n) t.resize(size_t(n));
  bf16_to_f32(t.data(), static_cast<const bf16*>(x), n);
  return t.data();
}

void Model::Impl::fp8_lin_fwd(int s, float* y, const void* x, int p, int64_t rows, int64_t in, int64_t out, bool acc) {
  const Fp8Tensor& A = fp8_quant(s, kFp8X, fp8_f32(0, x, rows * in), rows, in, false, Fp8Role::Activation, fp8_op[0]);
  if (Fp8Saved* c = fp8_cached(p)) fp8_cache_store(*c, A, 0, 0), c->rows = rows;
  const Fp8Tensor& B = fp8_quant(s, kFp8W, P(p), in, out, true, Fp8Role::Weight, fp8_op[1]);
  fp8_mm(y, out, A, B, acc ? 1.0f : 0.0f);
}

void Model::Impl::fp8_lin_dgrad(int s, float* dx, const void* dy, int p, int64_t rows, int64_t in, int64_t out,
                                bool acc) {
  const Fp8Tensor& A = fp8_quant(s, kFp8G, fp8_f32(0, dy, rows * out), rows, out, false, Fp8Role::Activation, fp8_op[0]);
  const Fp8Tensor& B = fp8_quant(s, kFp8W, P(p), in, out, false, Fp8Role::Weight, fp8_op[1]);
  fp8_mm(dx, in, A, B, acc ? 1.0f : 0.0f);
}

void Model::Impl::fp8_lin_wgrad(int s, int p, const void* x, const void* dy, int64_t rows, int64_t in, int64_t out) {
  const Fp8Saved* c = fp8_cached_for_wgrad(p, rows, in);  // x is shared scratch then: the cached operand is the input
  if (c) fp8_cache_load(*c, 0, rows, 0, fp8_cached_scales(fp8->q.recipe, rows, in, 1), fp8_op[2]);
  const Fp8Tensor& A = c ? fp8_cached_xt(s, fp8_op[2], fp8_op[0])
                         : fp8_quant(s, kFp8X, fp8_f32(0, x, rows * in), rows, in, true, Fp8Role::Activation, fp8_op[0]);
  const Fp8Tensor& B = fp8_quant(s, kFp8G, fp8_f32(1, dy, rows * out), rows, out, true, Fp8Role::Activation, fp8_op[1]);
  fp8_mm(G(p), out, A, B, 1.0f);
}

void Model::Impl::fp8_gg_fwd(int s, float* Y, const void* X, int p, const int32_t* kept, int64_t R, int64_t in,
                             int64_t out) {
  const float* x = fp8_f32(0, X, R * in);
  const float* w = P(p);
  Fp8Saved* c = fp8_cached(p);
  const bool tw = fp8->q.recipe == Fp8Recipe::Tensorwise;
  if (c) c->rows = R;
  int64_t o = 0;
  for (int64_t e = 0; e < El; ++e) {
    const int64_t m = kept[e];
    if (m > 0) {
      const Fp8Tensor& A = fp8_quant(s, kFp8X, x + o * in, m, in, false, Fp8Role::Activation, fp8_op[0]);
      if (c) fp8_cache_store(*c, A, o, tw ? e : fp8_cached_scales(fp8->q.recipe, o, in, 1));
      const Fp8Tensor& B = fp8_quant(s, kFp8W, w + e * in * out, in, out, true, Fp8Role::Weight, fp8_op[1]);
      fp8_mm(Y + o * out, out, A, B, 0.0f);
    }
    o += m;
  }
  MT_CHECK(o == R, "fp8 experts", "expert rows sum to ", o, ", expected ", R);
}

void Model::Impl::fp8_gg_dgrad(int s, float* dX, const void* dY, int p, const int32_t* kept, int64_t R, int64_t in,
                               int64_t out) {
  const float* dy = fp8_f32(0, dY, R * out);
  const float* w = P(p);
  int64_t o = 0;
  for (int64_t e = 0; e < El; ++e) {
    const int64_t m = kept[e];
    if (m > 0) {
      const Fp8Tensor& A = fp8_quant(s, kFp8G, dy + o * out, m, out, false, Fp8Role::Activation, fp8_op[0]);
      const Fp8Tensor& B = fp8_quant(s, kFp8W, w + e * in * out, in, out, false, Fp8Role::Weight, fp8_op[1]);
      fp8_mm(dX + o * in, in, A, B, 0.0f);
    }
    o += m;
  }
}

void Model::Impl::fp8_gg_wgrad(int s, int p, const void* X, const void* dY, const int32_t* kept, int64_t R, int64_t in,
                               int64_t out) {
  const Fp8Saved* c = fp8_cached_for_wgrad(p, R, in);  // X is shared scratch then: the cached operands are the input
  const float* x = c ? nullptr : fp8_f32(0, X, R * in);
  const float* dy = fp8_f32(1, dY, R * out);
  float* dW = G(p);
  const Fp8Recipe r = fp8->q.recipe;
  int64_t o = 0;
  for (int64_t e = 0; e < El; ++e) {
    const int64_t m = kept[e];
    if (m > 0) {  // an expert without rows keeps its gradient
      if (c)
        fp8_cache_load(*c, o, m, r == Fp8Recipe::Tensorwise ? e : fp8_cached_scales(r, o, in, 1),
                       fp8_cached_scales(r, m, in, 1), fp8_op[2]);
      const Fp8Tensor& A = c ? fp8_cached_xt(s, fp8_op[2], fp8_op[0])
                             : fp8_quant(s, kFp8X, x + o * in, m, in, true, Fp8Role::Activation, fp8_op[0]);
      const Fp8Tensor& B = fp8_quant(s, kFp8G, dy + o * out, m, out, true, Fp8Role::Activation, fp8_op[1]);
      fp8_mm(dW + e * in * out, out, A, B, 1.0f);
    }
    o += m;
  }
}

// ---- cache_fp8_activations ----

void Model::Impl::fp8_cache_store(Fp8Saved& c, const Fp8Tensor& A, int64_t r0, int64_t s0) {
  const int64_t n = A.rows * A.cols, ns = int64_t(A.scales.size());
  MT_CHECK((r0 + A.rows) * A.cols <= c.q.numel() && s0 + ns <= c.sc.numel(), "fp8 cache", "an operand of ", A.rows,
           " x ", A.cols, " with ", ns, " scales at row ", r0, " exceeds its cache (", c.q.numel(), " codes, ",
           c.sc.numel(), " scales)");
  std::memcpy(c.q.data<uint8_t>() + r0 * A.cols, A.q.data(), size_t(n));
  if (c.sc.dtype() == DType::U8)  // mxfp8: the E8M0 byte a kernel would keep
    for (int64_t i = 0; i < ns; ++i) c.sc.data<uint8_t>()[s0 + i] = fp8_e8m0_encode(A.scales[size_t(i)]);
  else
    std::memcpy(c.sc.data<float>() + s0, A.scales.data(), size_t(ns) * 4);
  c.cols = A.cols, c.fmt = A.fmt, c.pow2 = A.pow2;
}

void Model::Impl::fp8_cache_load(const Fp8Saved& c, int64_t r0, int64_t rows, int64_t s0, int64_t ns, Fp8Tensor& t) {
  t.rows = rows, t.cols = c.cols, t.fmt = c.fmt, t.recipe = fp8->q.recipe, t.role = Fp8Role::Activation, t.pow2 = c.pow2;
  const uint8_t* q = c.q.data<uint8_t>() + r0 * c.cols;
  t.q.assign(q, q + rows * c.cols);
  t.scales.resize(size_t(ns));
  if (c.sc.dtype() == DType::U8)
    for (int64_t i = 0; i < ns; ++i) t.scales[size_t(i)] = fp8_e8m0_decode(c.sc.data<uint8_t>()[s0 + i]);
  else
    std::memcpy(t.scales.data(), c.sc.data<float>() + s0, size_t(ns) * 4);
}

const Fp8Tensor& Model::Impl::fp8_cached_xt(int s, const Fp8Tensor& x, Fp8Tensor& out) {
  MT_TRACE("fp8.cache_transpose");
  if (x.recipe == Fp8Recipe::Tensorwise) return fp8_transpose_into(out, x), out;  // the same codes and scale: exact
  // Rowwise, 1 x 128 and 1 x 32 scales run along the features; the weight gradient needs them along the tokens:
  // the cached values are dequantized and quantized again (the second quantization's rounding is the extra error).
  std::vector<float>& t = fp8_tmp[0];
  if (int64_t(t.size()) < x.rows * x.cols) t.resize(size_t(x.rows * x.cols));
  fp8_dequantize_operand(t.data(), x);
  return fp8_quant(s, kFp8X, t.data(), x.rows, x.cols, true, Fp8Role::Activation, out);
}

void Model::Impl::fp8_cache_setup(bool on) {
  if (f8_on) {  // undo: every layer gets its own buffers back, the caches and the scratch are freed
    std::set<LayerBufs*> done;
    for (Layer& L : layers)
      for (LayerBufs* b : L.slot_bufs) {
        if (!done.insert(b).second) continue;
        for (Fp8Saved& c : b->f8) c = Fp8Saved{};
        auto back = [&](Tensor& t, const Tensor& scratch, int64_t n) {
          if (t.defined() && scratch.defined() && t.raw() == scratch.raw()) t = cbuf(n);
        };
        back(b->h1c, f8_scratch.h1c, N * d);
        if (rq > 0) back(b->cqnc, f8_scratch.cqnc, N * rq);
        back(b->ckvnc, f8_scratch.ckvnc, N * rkv);
        if (f8_scratch.h2.defined() && b->h2.raw() == f8_scratch.h2.raw()) b->h2 = f32buf(N * d), b->h2c = cbuf_or(b->h2, N * d);
        back(b->actc, f8_scratch.actc, N * (L.moe ? Fs : F));
        back(b->xpc, f8_scratch.xpc, b->rows_cap * d);
        back(b->eactc, f8_scratch.eactc, b->rows_cap * Fe);
      }
    f8_scratch = LayerBufs{};
    f8_slot.clear(), f8_on = false, f8_bufs = nullptr;
  }
  if (!on) return;
  const Fp8CachePlan plan = fp8_cache_plan(fp8->q);
  MT_CHECK(ep == 1, "Model", "quantize.cache_fp8_activations = true is not implemented with expert parallelism "
           "(parallelism.ep = ", ep, "): the routed rows a rank receives vary per step; use false or ep = 1");
  for (const Layer& L : layers)
    MT_CHECK(!(L.sel_norm || L.sel_attn || L.sel_act), "Model", "quantize.cache_fp8_activations = true is not "
             "implemented with activation_checkpoint.mode = \"selective\" (the recomputed modules' buffers are shared "
             "already); use mode = \"full\" or \"none\", or cache_fp8_activations = false");
  const Fp8Recipe r = plan.recipe;
  f8_slot.assign(m.params_.size(), -1);
  const bool mla = s.attn.type == AttnType::MLA;
  bool any_dense = false, any_shared = false, any_routed = false;
  for (const Layer& L : layers) {
    if (!L.held) continue;
    auto set = [&](int p, int k) {
      if (p >= 0) f8_slot[size_t(p)] = int8_t(k);
    };
    if (plan.attention) {
      if (!mla) set(L.wqkv, kF8AttnIn);
      else {
        set(rq > 0 ? L.wdq : L.wq, kF8AttnIn), set(L.wdkv, kF8AttnKv), set(L.wkr, kF8AttnKr), set(L.wukv, kF8AttnUkv);
        if (rq > 0) set(L.wuq, kF8AttnUq);
      }
    }
    if (!L.moe && plan.dense_mlp) set(L.w13, kF8Mlp13), set(L.w2, kF8Mlp2), any_dense = true;
    if (L.moe && plan.shared_experts && Fs > 0) set(L.ws2, kF8Shared2), any_shared = true;
    if (L.moe && plan.routed_experts) set(L.we13, kF8Exp13), set(L.we2, kF8Exp2), any_routed = true;
  }
  // The scratch that replaces the dropped inputs: written by a forward, read by nothing after it (Workspace).
  const MemCategory ws = MemCategory::Workspace;
  if (plan.attention) {
    f8_scratch.h1c = cbuf(N * d, ws);
    if (mla && rq > 0) f8_scratch.cqnc = cbuf(N * rq, ws);
    if (mla) f8_scratch.ckvnc = cbuf(N * rkv, ws);
  }
  if (any_dense) f8_scratch.h2 = f32buf(N * d, ws), f8_scratch.h2c = f32 ? f8_scratch.h2 : cbuf(N * d, ws);
  if (any_dense || any_shared) f8_scratch.actc = cbuf(N * std::max(any_dense ? F : 0, any_shared ? Fs : 0), ws);
  if (any_routed) f8_scratch.xpc = cbuf(Rmax * d, ws), f8_scratch.eactc = cbuf(Rmax * Fe, ws);
  auto alloc = [&](Fp8Saved& c, int64_t rows, int64_t cols, int64_t groups, const char* name) {
    c.q = Tensor::zeros({rows * cols}, DType::U8, MemCategory::Activations, name);
    c.sc = Tensor::zeros({fp8_cached_scales(r, rows, cols, groups)}, r == Fp8Recipe::MXFP8 ? DType::U8 : DType::F32,
                         MemCategory::Activations, name);
    c.rows = 0, c.cols = cols;
  };
  std::set<LayerBufs*> done;
  for (Layer& L : layers)
    for (LayerBufs* b : L.slot_bufs) {
      if (!done.insert(b).second) continue;
      if (plan.attention) {
        alloc(b->f8[kF8AttnIn], N, d, 1, "fp8_cache.attn");
        b->h1c = f8_scratch.h1c;
        if (mla) {
          alloc(b->f8[kF8AttnKv], N, d, 1, "fp8_cache.attn"), alloc(b->f8[kF8AttnKr], N, d, 1, "fp8_cache.attn");
          alloc(b->f8[kF8AttnUkv], N, rkv, 1, "fp8_cache.attn"), b->ckvnc = f8_scratch.ckvnc;
          if (rq > 0) alloc(b->f8[kF8AttnUq], N, rq, 1, "fp8_cache.attn"), b->cqnc = f8_scratch.cqnc;
        }
      }
      if (!L.moe && plan.dense_mlp) {
        alloc(b->f8[kF8Mlp13], N, d, 1, "fp8_cache.mlp"), alloc(b->f8[kF8Mlp2], N, F, 1, "fp8_cache.mlp");
        b->h2 = f8_scratch.h2, b->h2c = f8_scratch.h2c, b->actc = f8_scratch.actc;
      }
      if (L.moe && plan.shared_experts && Fs > 0)
        alloc(b->f8[kF8Shared2], N, Fs, 1, "fp8_cache.shared"), b->actc = f8_scratch.actc;
      if (L.moe && plan.routed_experts) {
        alloc(b->f8[kF8Exp13], Rmax, d, El, "fp8_cache.experts"), alloc(b->f8[kF8Exp2], Rmax, Fe, El, "fp8_cache.experts");
        b->xpc = f8_scratch.xpc, b->eactc = f8_scratch.eactc;
      }
    }
  f8_on = true;
}

}  // namespace moetron
