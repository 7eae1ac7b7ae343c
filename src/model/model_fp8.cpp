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
// Not the kernels (fp8_gemm.h) and not the high-precision paths (embedding, head and router stay fp32 / the
// compute dtype).
#include <algorithm>
#include <cmath>

#include "model/model_impl.h"
#include "moetron/trace.h"

namespace moetron {

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
bool fp8_module_of(const std::string& name, Fp8Module* m) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (name.rfind("layers.", 0) != 0 || has("norm")) return false;
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
    impl_->fp8.reset();
    if (lane1_) lane1_->fp8.reset();
    return;
  }
  auto st = std::make_shared<Fp8State>();
  st->q = q;
  for (const ParamEntry& e : model_param_layout(spec_)) {  // the whole model, global order
    Fp8Module m;
    if (!fp8_module_of(e.name, &m) || !q.has_module(fp8_module_name(m))) continue;
    Fp8Site s;
    s.param = e.name, s.module = m;
    s.hist.assign(3, Fp8AmaxHistory(q.amax_history_len));
    st->sites.push_back(std::move(s));
  }
  st->site_of.assign(params_.size(), -1);
  for (size_t i = 0; i < params_.size(); ++i)
    for (size_t k = 0; k < st->sites.size(); ++k)
      if (st->sites[k].param == params_[i].name) st->site_of[i] = int(k);
  impl_->fp8 = st;
  if (lane1_) lane1_->fp8 = st;
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
      // per module: the max amax, the smallest and largest scale over its sites
      auto it = std::find_if(out.begin(), out.end(), [&](const Fp8Stat& x) { return x.module == fp8_module_name(s.module); });
      if (it == out.end()) out.push_back(Fp8Stat{fp8_module_name(s.module), {}, {}, {}}), it = out.end() - 1;
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

Fp8Tensor Model::Impl::fp8_quant(int s, int op, const float* x, int64_t R, int64_t C, bool transposed, Fp8Role role) {
  MT_TRACE("fp8.quantize");
  Fp8State& st = *fp8;
  const QuantizeSpec& q = st.q;
  Fp8Site& site = st.sites[size_t(s)];
  const Fp8Format f = op == kFp8G && q.hybrid() ? Fp8Format::E5M2 : Fp8Format::E4M3;
  Fp8Tensor t;
  float amax = 0;
  if (q.delayed()) {  // tensorwise with the step's frozen scale (the histories move at the end of the step)
    t = fp8_quantize_scaled(x, R, C, f, role, site.hist[size_t(op)].scale(f), &amax);
    if (transposed) t = fp8_transpose(t);
  } else {
    t = transposed ? fp8_quantize_operand_t(x, R, C, f, q.recipe, role) : fp8_quantize_operand(x, R, C, f, q.recipe, role);
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

const float* Model::Impl::fp8_f32(int slot, const void* x, int64_t n) {
  if (f32) return static_cast<const float*>(x);
  std::vector<float>& t = fp8_tmp[slot];
  if (int64_t(t.size()) < n) t.resize(size_t(n));
  bf16_to_f32(t.data(), static_cast<const bf16*>(x), n);
  return t.data();
}

void Model::Impl::fp8_lin_fwd(int s, float* y, const void* x, int p, int64_t rows, int64_t in, int64_t out, bool acc) {
  const Fp8Tensor A = fp8_quant(s, kFp8X, fp8_f32(0, x, rows * in), rows, in, false, Fp8Role::Activation);
  const Fp8Tensor B = fp8_quant(s, kFp8W, P(p), in, out, true, Fp8Role::Weight);
  fp8_mm(y, out, A, B, acc ? 1.0f : 0.0f);
}

void Model::Impl::fp8_lin_dgrad(int s, float* dx, const void* dy, int p, int64_t rows, int64_t in, int64_t out,
                                bool acc) {
  const Fp8Tensor A = fp8_quant(s, kFp8G, fp8_f32(0, dy, rows * out), rows, out, false, Fp8Role::Activation);
  const Fp8Tensor B = fp8_quant(s, kFp8W, P(p), in, out, false, Fp8Role::Weight);
  fp8_mm(dx, in, A, B, acc ? 1.0f : 0.0f);
}

void Model::Impl::fp8_lin_wgrad(int s, int p, const void* x, const void* dy, int64_t rows, int64_t in, int64_t out) {
  const Fp8Tensor A = fp8_quant(s, kFp8X, fp8_f32(0, x, rows * in), rows, in, true, Fp8Role::Activation);
  const Fp8Tensor B = fp8_quant(s, kFp8G, fp8_f32(1, dy, rows * out), rows, out, true, Fp8Role::Activation);
  fp8_mm(G(p), out, A, B, 1.0f);
}

void Model::Impl::fp8_gg_fwd(int s, float* Y, const void* X, int p, const int32_t* kept, int64_t R, int64_t in,
                             int64_t out) {
  const float* x = fp8_f32(0, X, R * in);
  const float* w = P(p);
  int64_t o = 0;
  for (int64_t e = 0; e < El; ++e) {
    const int64_t m = kept[e];
    if (m > 0) {
      const Fp8Tensor A = fp8_quant(s, kFp8X, x + o * in, m, in, false, Fp8Role::Activation);
      const Fp8Tensor B = fp8_quant(s, kFp8W, w + e * in * out, in, out, true, Fp8Role::Weight);
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
      const Fp8Tensor A = fp8_quant(s, kFp8G, dy + o * out, m, out, false, Fp8Role::Activation);
      const Fp8Tensor B = fp8_quant(s, kFp8W, w + e * in * out, in, out, false, Fp8Role::Weight);
      fp8_mm(dX + o * in, in, A, B, 0.0f);
    }
    o += m;
  }
}

void Model::Impl::fp8_gg_wgrad(int s, int p, const void* X, const void* dY, const int32_t* kept, int64_t R, int64_t in,
                               int64_t out) {
  const float* x = fp8_f32(0, X, R * in);
  const float* dy = fp8_f32(1, dY, R * out);
  float* dW = G(p);
  int64_t o = 0;
  for (int64_t e = 0; e < El; ++e) {
    const int64_t m = kept[e];
    if (m > 0) {  // an expert without rows keeps its gradient
      const Fp8Tensor A = fp8_quant(s, kFp8X, x + o * in, m, in, true, Fp8Role::Activation);
      const Fp8Tensor B = fp8_quant(s, kFp8G, dy + o * out, m, out, true, Fp8Role::Activation);
      fp8_mm(dW + e * in * out, out, A, B, 1.0f);
    }
    o += m;
  }
}

}  // namespace moetron
