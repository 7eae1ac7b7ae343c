// attention.h: causal scaled-dot-product attention, flash style, forward and backward, for MHA, GQA/MQA
// and MLA-shaped heads (Dqk != Dv), on strided views of fused buffers; and the naive reference twins.
//   S = scale * q k^T (causal: key s <= query t),  P = softmax_row(S),  out = P v,  lse = log sum_s exp(S)
// The optimized kernels never materialize T x T: the forward runs an online softmax over key tiles and
// stores only lse per row; the backward recomputes P per tile from lse with D_t = rowsum(dout * out).
// Key blocks (context parallelism, cp_attention.h): a block of T queries may attend a separate block of Tk keys
// with mask Full (every key visible: a key block wholly earlier in the sequence); the default mask Causal is
// the diagonal block (Tk == T, query and key blocks at the same positions). The backward of a block takes the
// merged lse and out of the whole row (see attention_backward), so the blocks' gradients sum to the row's.
// Precision (AttnDims::prec): F32 computes every product in fp32; BF16 rounds the operands of the products
// (q k^T, P v; backward dO v^T, P^T dO, dS k, dS^T q) to bf16 and accumulates in fp32 (vdpbf16ps, or the AMX
// tiles where amx_active()), with the softmax, lse, row sums and scaling in fp32. BF16 runs only where
// AVX512-BF16 is native (active_isa() is Avx512); elsewhere a BF16 request runs the fp32 kernels, bitwise as
// F32 (attention_bf16_active says which).
// Not: padding masks, sliding windows, dropout, KV caches or decoding.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace moetron {

// Element d of head h at token t of sequence b:
//   q  [(b*T + t)*ldq + h*head_q + d], h < Hq,  d < Dqk
//   k  [(b*T + t)*ldk + h*head_k + d], h < Hkv, d < Dqk
//   v  [(b*T + t)*ldv + h*head_v + d], h < Hkv, d < Dv
//   out[(b*T + t)*ldo + h*head_o + d], h < Hq,  d < Dv
// GQA: q head h reads kv head h / (Hq / Hkv). head_k = 0 (or head_v = 0) shares one k (v) head among all
// kv heads (MLA's broadcast k_pe, MQA-style); the backward then sums that head's gradient over them.
// lse is [B, Hq, T]. Gradients use the same layout as their forward tensors (dq like q, dout like out, ...).
// Key blocks: with Tk > 0 the keys have their own length, k [(b*Tk + s)*ldk + ...], v likewise, s < Tk.
enum class AttnMask : uint8_t {
  Causal,  // key s visible to query t iff s <= t (query and key blocks start at the same position; Tk == T)
  Full,    // every key visible to every query (the key block ends before the query block starts)
};
enum class AttnPrec : uint8_t {
  F32,   // fp32 products (every ISA)
  BF16,  // bf16 operands, fp32 accumulation, fp32 softmax (AVX512-BF16; else the F32 kernels)
};
struct AttnDims {
  int64_t B, T, Hq, Hkv, Dqk, Dv;
  int64_t ldq, ldk, ldv, ldo;              // element stride between consecutive tokens
  int64_t head_q, head_k, head_v, head_o;  // element stride between heads
  float scale;
  int64_t Tk = 0;                   // keys per sequence; 0: Tk = T (the default, plain causal attention)
  AttnMask mask = AttnMask::Causal;
  AttnPrec prec = AttnPrec::F32;
  int64_t keys() const { return Tk > 0 ? Tk : T; }
  bool causal() const { return mask == AttnMask::Causal; }
};

// Throws moetron::Error naming `op` and the offending value when d is inconsistent.
void attention_check(const AttnDims& d, const char* op);

// True when d.prec is BF16 and this CPU / ISA cap runs the bf16 kernels (active_isa() is Avx512, which
// implies AVX512-BF16); false means the fp32 kernels run.
bool attention_bf16_active(const AttnDims& d);
// Whether bf16 attention is the faster choice here (what the model's automatic choice takes under bf16 compute):
// the bf16 kernels run (active_isa() is Avx512) and their products outrun the fp32 FMAs: on AMD's AVX512-BF16
// CPUs (Zen 4 / 5: one vdpbf16ps zmm, 64 FLOPs, per cycle, twice the FMAs' rate), and where the products go to
// the AMX-BF16 tiles (amx_active(): Intel Sapphire Rapids on, whose vdpbf16ps runs at half its FMAs' FLOP rate;
// docs/benchmarks.md, "bf16 attention" and "Attention on the AMX tiles"). A CPU property, never a timing.
bool attention_bf16_preferred();

// Scratch for the forward and the backward: per-thread tiles plus, when head_k or head_v is 0 with
// Hkv > 1, per-kv-head gradient partials; with prec BF16 also the call's bf16 copies of q, k, v, dout in the
// layouts the bf16 tile GEMMs read (kernel_sizes.h), whether or not this CPU then runs the bf16 kernels. `num_threads` must be the OpenMP thread count the kernels
// will run with (moetron::num_threads()). A ws of nullptr makes the kernel allocate it per call.
size_t attention_workspace_bytes(const AttnDims& d, int num_threads);

void attention_forward(float* out, float* lse /* [B, Hq, T] */, const float* q, const float* k, const float* v,
                       const AttnDims& d, void* ws = nullptr);

// dq, dk, dv are overwritten (dk/dv sum over the q heads of each GQA group, deterministically).
// out and lse must come from attention_forward with the same inputs; or, for one key block of a row split
// into blocks, be the row's merged out and lse (P = exp(S - lse) is then the row's probability and
// D_t = rowsum(dout * out) the row's): the blocks' dq then sum to the row's dq, and each block's dk, dv are
// its keys' gradients. With T == 0 (Full mask) dk and dv are zeroed.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out,
                        const float* lse /* [B, Hq, T] */, const float* q, const float* k, const float* v,
                        const AttnDims& d, void* ws = nullptr);

// FLOPs actually needed (Causal: only key <= query pairs; Full: T * Tk pairs): forward 2 matmuls, backward 5
// (S recomputed, dP, dV, dK, dQ), as in the FlashAttention-2 paper's count.
double attention_forward_flops(const AttnDims& d);
double attention_backward_flops(const AttnDims& d);

// ---- naive references (float or double): compute every score of each (b, h, query row) ----

// Keys visible to query t: s < attention_ref_keys(d, t).
inline int64_t attention_ref_keys(const AttnDims& d, int64_t t) { return d.causal() ? t + 1 : d.keys(); }

template <class T>
void attention_forward_ref(T* out, T* lse /* [B, Hq, T] */, const T* q, const T* k, const T* v, const AttnDims& d) {
  const int64_t G = d.Hq / d.Hkv, Tk = d.keys();
  std::vector<T> p(static_cast<size_t>(Tk));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t hk = h / G;
      for (int64_t t = 0; t < d.T; ++t) {
        const int64_t n = attention_ref_keys(d, t);
        const T* qr = q + (b * d.T + t) * d.ldq + h * d.head_q;
        T m = -std::numeric_limits<T>::infinity();
        for (int64_t s = 0; s < n; ++s) {
          const T* kr = k + (b * Tk + s) * d.ldk + hk * d.head_k;
          T acc = 0;
          for (int64_t e = 0; e < d.Dqk; ++e) acc += qr[e] * kr[e];
          p[s] = T(d.scale) * acc;
          m = std::max(m, p[s]);
        }
        T l = 0;
        for (int64_t s = 0; s < n; ++s) l += (p[s] = std::exp(p[s] - m));
        lse[(b * d.Hq + h) * d.T + t] = m + std::log(l);
        T* o = out + (b * d.T + t) * d.ldo + h * d.head_o;
        for (int64_t e = 0; e < d.Dv; ++e) {
          T acc = 0;
          for (int64_t s = 0; s < n; ++s) acc += p[s] * v[(b * Tk + s) * d.ldv + hk * d.head_v + e];
          o[e] = acc / l;
        }
      }
    }
}

// dP = dout v^T, dS = P * (dP - rowsum(dout * out)), dq = scale dS k, dk = scale dS^T q, dv = P^T dout.
// Recomputes P from q, k (not from lse), so it is a reference for the gradient formulas alone; unless `lse`
// [B, Hq, T] is given: then P = exp(S - lse), the semantics of a key block's backward under the row's merged
// lse and out (attention_backward), so the blocks' references sum to the whole row's.
template <class T>
void attention_backward_ref(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* q, const T* k, const T* v,
                            const AttnDims& d, const T* lse = nullptr) {
  const int64_t G = d.Hq / d.Hkv, Tk = d.keys();
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t t = 0; t < d.T; ++t)
      for (int64_t h = 0; h < d.Hq; ++h)
        for (int64_t e = 0; e < d.Dqk; ++e) dq[(b * d.T + t) * d.ldq + h * d.head_q + e] = 0;
    for (int64_t t = 0; t < Tk; ++t)
      for (int64_t h = 0; h < d.Hkv; ++h) {
        for (int64_t e = 0; e < d.Dqk; ++e) dk[(b * Tk + t) * d.ldk + h * d.head_k + e] = 0;
        for (int64_t e = 0; e < d.Dv; ++e) dv[(b * Tk + t) * d.ldv + h * d.head_v + e] = 0;
      }
  }
  std::vector<T> p(static_cast<size_t>(Tk)), dp(static_cast<size_t>(Tk));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.Hq; ++h) {
      const int64_t hk = h / G;
      auto Q = [&](int64_t t) { return q + (b * d.T + t) * d.ldq + h * d.head_q; };
      auto K = [&](int64_t s) { return k + (b * Tk + s) * d.ldk + hk * d.head_k; };
      auto V = [&](int64_t s) { return v + (b * Tk + s) * d.ldv + hk * d.head_v; };
      for (int64_t t = 0; t < d.T; ++t) {
        const int64_t n = attention_ref_keys(d, t);
        const T* dO = dout + (b * d.T + t) * d.ldo + h * d.head_o;
        const T* O = out + (b * d.T + t) * d.ldo + h * d.head_o;
        T m = -std::numeric_limits<T>::infinity(), l = 0, Dt = 0;
        for (int64_t s = 0; s < n; ++s) {
          T acc = 0;
          for (int64_t e = 0; e < d.Dqk; ++e) acc += Q(t)[e] * K(s)[e];
          p[s] = T(d.scale) * acc;
          m = std::max(m, p[s]);
        }
        if (lse) {
          const T L = lse[(b * d.Hq + h) * d.T + t];
          for (int64_t s = 0; s < n; ++s) p[s] = std::exp(p[s] - L);
        } else {
          for (int64_t s = 0; s < n; ++s) l += (p[s] = std::exp(p[s] - m));
          for (int64_t s = 0; s < n; ++s) p[s] /= l;
        }
        for (int64_t e = 0; e < d.Dv; ++e) Dt += dO[e] * O[e];
        for (int64_t s = 0; s < n; ++s) {
          T acc = 0;
          for (int64_t e = 0; e < d.Dv; ++e) acc += dO[e] * V(s)[e];
          dp[s] = acc;
        }
        for (int64_t s = 0; s < n; ++s) {
          T ds = p[s] * (dp[s] - Dt) * T(d.scale);
          T* dqr = dq + (b * d.T + t) * d.ldq + h * d.head_q;
          T* dkr = dk + (b * Tk + s) * d.ldk + hk * d.head_k;
          T* dvr = dv + (b * Tk + s) * d.ldv + hk * d.head_v;
          for (int64_t e = 0; e < d.Dqk; ++e) {
            dqr[e] += ds * K(s)[e];
            dkr[e] += ds * Q(t)[e];
          }
          for (int64_t e = 0; e < d.Dv; ++e) dvr[e] += p[s] * dO[e];
        }
      }
    }
}

}  // namespace moetron
