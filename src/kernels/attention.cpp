// attention.cpp: causal flash attention drivers (input checks, workspace, ISA dispatch) and the portable
// backend of the tiled algorithm in attention_impl.h (plain loops the compiler vectorizes at the baseline
// ISA). The AVX-512 backend is attention_avx512.cpp, the AVX2 + FMA one attention_avx2.cpp, the bf16 one
// (AttnPrec::BF16 on AVX512-BF16) attention_bf16_avx512.cpp. Not the reference
// (attention_*_ref in attention.h).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "attention_impl.h"
#include "kernels/attention_amx.h"
#include "moetron/attention.h"
#include "moetron/check.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

namespace attention_avx512 {
void forward(float* out, float* lse, const float* q, const float* k, const float* v, const AttnDims& d, float* ws,
             int nthreads);
void backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse, const float* q,
              const float* k, const float* v, const AttnDims& d, float* ws, int nthreads);
}  // namespace attention_avx512
namespace attention_avx2 {
void forward(float* out, float* lse, const float* q, const float* k, const float* v, const AttnDims& d, float* ws,
             int nthreads);
void backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse, const float* q,
              const float* k, const float* v, const AttnDims& d, float* ws, int nthreads);
}  // namespace attention_avx2
namespace attention_bf16_avx512 {
void forward(float* out, float* lse, const float* q, const float* k, const float* v, const AttnDims& d, float* ws,
             int nthreads);
void backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse, const float* q,
              const float* k, const float* v, const AttnDims& d, float* ws, int nthreads);
}  // namespace attention_bf16_avx512

namespace {

struct PortableOps {
  static constexpr int64_t kRows = 8;
  static void gemm(bool acc, bool trans_a, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                   const float* B, int64_t ldb, float* C, int64_t ldc) {
    for (int64_t m = 0; m < M; ++m) {
      float* c = C + m * ldc;
      if (!acc)
        for (int64_t n = 0; n < N; ++n) c[n] = 0.0f;
      for (int64_t kk = 0; kk < K; ++kk) {
        const float a = trans_a ? A[kk * lda + m] : A[m * lda + kk];
        const float* b = B + kk * ldb;
        for (int64_t n = 0; n < N; ++n) c[n] += a * b[n];
      }
    }
  }
  static float exp2_row(float* p, int64_t n, float c, float m) {
    float s = 0;
    for (int64_t i = 0; i < n; ++i) s += (p[i] = std::exp2(p[i] * c - m));
    return s;
  }
  static void col_max(float* mx, const float* S, int64_t ld, int64_t rows, int64_t cols) {
    for (int64_t j = 0; j < cols; ++j) mx[j] = S[j];
    for (int64_t i = 1; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) mx[j] = std::max(mx[j], S[i * ld + j]);
  }
  static void exp2_cols(float* S, int64_t ld, int64_t rows, int64_t cols, float c, const float* m, float* sum) {
    for (int64_t j = 0; j < cols; ++j) sum[j] = 0.0f;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) sum[j] += (S[i * ld + j] = std::exp2(S[i * ld + j] * c - m[j]));
  }
  static void scale_row(float* p, int64_t n, float a) {
    for (int64_t i = 0; i < n; ++i) p[i] *= a;
  }
  static void zero_row(float* p, int64_t n) { std::memset(p, 0, sizeof(float) * size_t(n)); }
  static float dot(const float* a, const float* b, int64_t n) {
    float s = 0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void ds_row(float* s, float* dp, int64_t n, float c, float lse2, float Dr, float scale) {
    for (int64_t i = 0; i < n; ++i) {
      const float p = std::exp2(s[i] * c - lse2);
      s[i] = p;
      dp[i] = scale * p * (dp[i] - Dr);
    }
  }
  static void pack_t(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
};

size_t ws_bytes(const AttnDims& d, int nthreads) { return attention_workspace_size(ws_shape(d), nthreads); }

float* align64(void* p) {
  auto u = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<float*>((u + 63) & ~uintptr_t(63));
}

}  // namespace

void attention_check(const AttnDims& d, const char* op) {
  MT_CHECK(d.B >= 0 && d.T >= 0, op, "negative size B=", d.B, " T=", d.T);
  MT_CHECK(d.Tk >= 0, op, "negative key length Tk=", d.Tk);
  MT_CHECK(d.mask == AttnMask::Causal || d.mask == AttnMask::Full, op, "unknown mask ", int(d.mask));
  MT_CHECK(d.prec == AttnPrec::F32 || d.prec == AttnPrec::BF16, op, "unknown precision ", int(d.prec));
  MT_CHECK(!d.causal() || d.keys() == d.T, op, "the causal mask needs as many keys as queries: Tk=", d.Tk,
           " T=", d.T, " (a key block before the queries takes mask Full)");
  MT_CHECK(d.Hq >= 1 && d.Hkv >= 1, op, "head counts must be >= 1: Hq=", d.Hq, " Hkv=", d.Hkv);
  MT_CHECK(d.Hq % d.Hkv == 0, op, "Hq=", d.Hq, " is not a multiple of Hkv=", d.Hkv);
  MT_CHECK(d.Dqk >= 1 && d.Dv >= 1, op, "head dims must be >= 1: Dqk=", d.Dqk, " Dv=", d.Dv);
  MT_CHECK(std::isfinite(d.scale) && d.scale > 0.0f, op, "scale=", d.scale, " must be finite and > 0");
  MT_CHECK(d.head_q >= 0 && d.head_k >= 0 && d.head_v >= 0 && d.head_o >= 0, op, "negative head stride: head_q=",
           d.head_q, " head_k=", d.head_k, " head_v=", d.head_v, " head_o=", d.head_o);
  // Heads may not overlap (k and v heads may alias entirely with stride 0: a shared head).
  MT_CHECK(d.Hq == 1 || d.head_q >= d.Dqk, op, "head_q=", d.head_q, " < Dqk=", d.Dqk, " (q heads overlap)");
  MT_CHECK(d.Hq == 1 || d.head_o >= d.Dv, op, "head_o=", d.head_o, " < Dv=", d.Dv, " (out heads overlap)");
  MT_CHECK(d.Hkv == 1 || d.head_k == 0 || d.head_k >= d.Dqk, op, "head_k=", d.head_k, " < Dqk=", d.Dqk,
           " (k heads overlap; use 0 for one shared head)");
  MT_CHECK(d.Hkv == 1 || d.head_v == 0 || d.head_v >= d.Dv, op, "head_v=", d.head_v, " < Dv=", d.Dv,
           " (v heads overlap; use 0 for one shared head)");
  auto span = [](int64_t H, int64_t hs, int64_t D) { return (H - 1) * hs + D; };
  if (d.B * d.T > 1) {
    MT_CHECK(d.ldq >= span(d.Hq, d.head_q, d.Dqk), op, "ldq=", d.ldq, " < ", span(d.Hq, d.head_q, d.Dqk));
    MT_CHECK(d.ldo >= span(d.Hq, d.head_o, d.Dv), op, "ldo=", d.ldo, " < ", span(d.Hq, d.head_o, d.Dv));
  }
  if (d.B * d.keys() > 1) {
    MT_CHECK(d.ldk >= span(d.Hkv, d.head_k, d.Dqk), op, "ldk=", d.ldk, " < ", span(d.Hkv, d.head_k, d.Dqk));
    MT_CHECK(d.ldv >= span(d.Hkv, d.head_v, d.Dv), op, "ldv=", d.ldv, " < ", span(d.Hkv, d.head_v, d.Dv));
  }
}

bool attention_bf16_active(const AttnDims& d) { return d.prec == AttnPrec::BF16 && active_isa() == Isa::Avx512; }

bool attention_bf16_preferred() {
  return active_isa() == Isa::Avx512 && (cpu_features().amd || (attn_amx::built() && amx_active()));
}

size_t attention_workspace_bytes(const AttnDims& d, int nthreads) {
  attention_check(d, "attention_workspace_bytes");
  MT_CHECK(nthreads >= 1, "attention_workspace_bytes", "num_threads=", nthreads);
  return ws_bytes(d, nthreads);
}

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, const AttnDims& d,
                       void* ws) {
  attention_check(d, "attention_forward");
  if (d.B * d.T == 0) return;
  MT_CHECK(out && lse && q && k && v, "attention_forward", "null pointer");
  MT_TRACE_COST(attention_forward_flops(d), 4.0 * (double(d.B * d.T) * double(d.Hq * d.Dqk + d.Hq * (d.Dv + 1)) +
                                                   double(d.B * d.keys()) * double(d.Hkv * (d.Dqk + d.Dv))));
  const int nt = num_threads();
  std::unique_ptr<char[]> own;
  if (!ws) {
    own.reset(new char[ws_bytes(d, nt)]);
    ws = own.get();
  }
  float* w = align64(ws);
  const Isa isa = active_isa();
  if (attention_bf16_active(d)) attention_bf16_avx512::forward(out, lse, q, k, v, d, w, nt);
  else if (isa == Isa::Avx512) attention_avx512::forward(out, lse, q, k, v, d, w, nt);
  else if (isa == Isa::Avx2) attention_avx2::forward(out, lse, q, k, v, d, w, nt);
  else flash_forward<PortableOps>(out, lse, q, k, v, d, w, nt);
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, const AttnDims& d, void* ws) {
  attention_check(d, "attention_backward");
  if (d.B * d.T == 0) {  // Full mask, no queries: the keys get no gradient
    const int64_t rows = d.B * d.keys(), nhk = d.head_k == 0 ? 1 : d.Hkv, nhv = d.head_v == 0 ? 1 : d.Hkv;
    MT_CHECK(rows == 0 || (dk && dv), "attention_backward", "null pointer");
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < nhk; ++h) std::memset(dk + r * d.ldk + h * d.head_k, 0, sizeof(float) * size_t(d.Dqk));
      for (int64_t h = 0; h < nhv; ++h) std::memset(dv + r * d.ldv + h * d.head_v, 0, sizeof(float) * size_t(d.Dv));
    }
    return;
  }
  MT_CHECK(dq && dk && dv && dout && out && lse && q && k && v, "attention_backward", "null pointer");
  // The kernel's own work (it recomputes the scores: 3 Dqk + 2 Dv per pair, not the accounting's 2 x forward).
  MT_TRACE_COST(attention_backward_flops(d), 8.0 * (double(d.B * d.T) * double(d.Hq * d.Dqk + d.Hq * (d.Dv + 1)) +
                                                    double(d.B * d.keys()) * double(d.Hkv * (d.Dqk + d.Dv))));
  const int nt = num_threads();
  std::unique_ptr<char[]> own;
  if (!ws) {
    own.reset(new char[ws_bytes(d, nt)]);
    ws = own.get();
  }
  float* w = align64(ws);
  const Isa isa = active_isa();
  if (attention_bf16_active(d)) attention_bf16_avx512::backward(dq, dk, dv, dout, out, lse, q, k, v, d, w, nt);
  else if (isa == Isa::Avx512) attention_avx512::backward(dq, dk, dv, dout, out, lse, q, k, v, d, w, nt);
  else if (isa == Isa::Avx2) attention_avx2::backward(dq, dk, dv, dout, out, lse, q, k, v, d, w, nt);
  else flash_backward<PortableOps>(dq, dk, dv, dout, out, lse, q, k, v, d, w, nt);
}

// (query, key) pairs computed: key <= query (Causal), all (Full).
static double attention_pairs(const AttnDims& d) {
  return d.causal() ? double(d.T) * double(d.T + 1) / 2 : double(d.T) * double(d.keys());
}

double attention_forward_flops(const AttnDims& d) {
  const double pairs = attention_pairs(d);
  return 2.0 * pairs * double(d.Dqk + d.Dv) * double(d.B * d.Hq);
}

double attention_backward_flops(const AttnDims& d) {
  const double pairs = attention_pairs(d);
  return 2.0 * pairs * double(3 * d.Dqk + 2 * d.Dv) * double(d.B * d.Hq);
}

}  // namespace moetron
