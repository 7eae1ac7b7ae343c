// loss.cpp: fused linear + cross-entropy (see loss.h): argument checks, the chunk loop with the
// oneDNN GEMMs, the scalar row kernel and the dispatch to loss_avx512.cpp / loss_avx2.cpp for the row kernel.
// Not the reference: linear_xent_ref in loss.h is the unfused twin.
//
// Workspace (one chunk of `ch` rows):
//   logits  [ch, V] fp32   the chunk's logits, overwritten in place by dlogits (fp32, or bf16 packed
//                          at the start of each fp32 row, i.e. a bf16 matrix with leading dim 2V)
//   rowloss [ch]    f64    per-row loss of the chunk, summed in row order after the parallel pass
#include "moetron/loss.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "moetron/check.h"
#include "moetron/gemm.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

namespace loss_avx512 {
double xent_row(float* z, int64_t V, int32_t t, float scale, int mode);
}
namespace loss_avx2 {
double xent_row(float* z, int64_t V, int32_t t, float scale, int mode);
}

namespace {

enum Mode { kFwd = 0, kGradF32 = 1, kGradBf16 = 2 };

size_t align64(size_t b) { return (b + 63) & ~size_t(63); }

// One row of logits z [V]: returns logsumexp(z) - z[t] (unscaled, double). In the grad modes z is
// overwritten by dlogits = (softmax(z) - onehot(t)) * scale, as fp32 (kGradF32) or as bf16 written over
// the first 2V bytes of the row (kGradBf16). Ignored rows (t < 0) return 0 with zero dlogits. A row with
// a non-finite logit returns NaN and NaN dlogits.
double xent_row_scalar(float* z, int64_t V, int32_t t, float scale, int mode) {
  auto put = [&](int64_t j, float d) {
    if (mode == kGradF32) z[j] = d;
    else {
      uint16_t b = to_bf16(d).bits;
      std::memcpy(reinterpret_cast<char*>(z) + 2 * j, &b, 2);  // bytes 2j..2j+1 lie below float j: already read
    }
  };
  if (t < 0) {
    if (mode != kFwd)
      for (int64_t j = 0; j < V; ++j) put(j, 0.0f);
    return 0.0;
  }
  float mx = -INFINITY;
  bool finite = true;
  for (int64_t j = 0; j < V; ++j) {
    finite &= std::fabs(z[j]) < INFINITY;
    mx = std::max(mx, z[j]);
  }
  if (!finite) {
    if (mode != kFwd)
      for (int64_t j = 0; j < V; ++j) put(j, NAN);
    return NAN;
  }
  const float zt = z[t];
  double sum = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    float e = std::exp(z[j] - mx);
    sum += double(e);
    if (mode != kFwd) z[j] = e;
  }
  const double loss = double(mx) + std::log(sum) - double(zt);
  if (mode != kFwd) {
    const float inv = float(double(scale) / sum);
    const float et = z[t];
    for (int64_t j = 0; j < V; ++j) put(j, z[j] * inv);
    put(t, et * inv - scale);
  }
  return loss;
}

double xent_row(float* z, int64_t V, int32_t t, float scale, int mode, Isa isa) {
  switch (isa) {
    case Isa::Avx512: return loss_avx512::xent_row(z, V, t, scale, mode);
    case Isa::Avx2: return loss_avx2::xent_row(z, V, t, scale, mode);
    default: return xent_row_scalar(z, V, t, scale, mode);
  }
}

int64_t resolve_chunk(int64_t N, int64_t V, int64_t chunk_rows) {
  int64_t ch = chunk_rows > 0 ? chunk_rows : linear_xent_default_chunk(V);
  return std::max<int64_t>(1, std::min(ch, N));
}

void check_args(const char* op, const void* h, const void* W, const int32_t* targets, int64_t N, int64_t C,
                int64_t V, float loss_scale, void* ws) {
  MT_CHECK(N >= 0 && C > 0 && V > 0, op, "bad shape N=", N, " C=", C, " V=", V, " (N >= 0, C > 0, V > 0)");
  MT_CHECK(std::isfinite(loss_scale), op, "loss_scale must be finite, got ", loss_scale);
  if (N == 0) return;
  MT_CHECK(h && W && targets, op, "null input (h=", h, " W=", W, " targets=", (const void*)targets, ")");
  MT_CHECK(ws && (reinterpret_cast<uintptr_t>(ws) & 63) == 0, op, "workspace must be non-null and 64-byte aligned, got ",
           ws);
  for (int64_t n = 0; n < N; ++n)
    MT_CHECK(targets[n] >= -1 && targets[n] < V, op, "targets[", n, "]=", targets[n], " outside [-1, V=", V, ")");
}

template <class In>
void gemm_in(Trans ta, Trans tb, int64_t M, int64_t Nn, int64_t K, const In* A, int64_t lda, const In* B,
             int64_t ldb, float beta, float* Cm, int64_t ldc) {
  if constexpr (std::is_same_v<In, bf16>) gemm_bf16(ta, tb, M, Nn, K, 1.0f, A, lda, B, ldb, beta, Cm, ldc);
  else gemm_f32(ta, tb, M, Nn, K, 1.0f, A, lda, B, ldb, beta, Cm, ldc);
}

// The chunk loop shared by the four entry points. dh/dW null: forward only.
template <class In>
double run(const char* op, double* row_loss, float* dh, float* dW, const In* h, const In* W, const int32_t* targets,
           int64_t N, int64_t C, int64_t V, float loss_scale, int64_t chunk_rows, void* ws) {
  check_args(op, h, W, targets, N, C, V, loss_scale, ws);
  const bool grad = dh != nullptr;
  if (grad) MT_CHECK(dW != nullptr, op, "dh given without dW");
  if (N == 0) return 0.0;
  const int64_t ch = resolve_chunk(N, V, chunk_rows);
  float* logits = static_cast<float*>(ws);
  double* rl = reinterpret_cast<double*>(static_cast<char*>(ws) + align64(size_t(ch * V) * sizeof(float)));
  const int mode = !grad ? kFwd : std::is_same_v<In, bf16> ? kGradBf16 : kGradF32;
  const Isa isa = active_isa();
  double loss = 0.0;
  for (int64_t r0 = 0; r0 < N; r0 += ch) {
    const int64_t rows = std::min(ch, N - r0);
    // logits [rows, V] = h[r0 : r0 + rows] · W^T
    gemm_in<In>(Trans::N, Trans::T, rows, V, C, h + r0 * C, C, W, C, 0.0f, logits, V);
    // The row pass over the logits (max, exp-sum, and the gradient): about 5 flops per logit, read and written.
    // The three GEMMs report their own work.
    MT_TRACE_COST(5.0 * double(rows * V), 8.0 * double(rows * V));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i) rl[i] = xent_row(logits + i * V, V, targets[r0 + i], loss_scale, mode, isa);
    for (int64_t i = 0; i < rows; ++i) {
      loss += rl[i] * double(loss_scale);
      if (row_loss) row_loss[r0 + i] = rl[i];
    }
    if (!grad) continue;
    if constexpr (std::is_same_v<In, bf16>) {
      const bf16* dl = reinterpret_cast<const bf16*>(logits);  // [rows, V] with leading dim 2V
      gemm_bf16(Trans::N, Trans::N, rows, C, V, 1.0f, dl, 2 * V, W, C, 0.0f, dh + r0 * C, C);
      gemm_bf16(Trans::T, Trans::N, V, C, rows, 1.0f, dl, 2 * V, h + r0 * C, C, 1.0f, dW, C);
    } else {
      gemm_f32(Trans::N, Trans::N, rows, C, V, 1.0f, logits, V, W, C, 0.0f, dh + r0 * C, C);
      gemm_f32(Trans::T, Trans::N, V, C, rows, 1.0f, logits, V, h + r0 * C, C, 1.0f, dW, C);
    }
  }
  return loss;
}

}  // namespace

// Two constraints. Memory: about 8 MiB of fp32 logits. Speed: every chunk re-reads and re-writes the
// fp32 dW [V, C] (8 V C bytes) for 2 rows V C flops of the dW GEMM, so rows / 4 flop per byte; at this
// machine's balance (~900 GFLOPS bf16 / ~20 GB/s = 45 flop/byte) that needs rows >= ~180. The floor of
size_t linear_xent_workspace_bytes(int64_t N, int64_t V, int64_t chunk_rows) {
  MT_CHECK(N >= 0 && V > 0, "linear_xent_workspace_bytes", "bad shape N=", N, " V=", V);
  if (N == 0) return 0;
  const int64_t ch = resolve_chunk(N, V, chunk_rows);
  return align64(size_t(ch * V) * sizeof(float))  // logits / dlogits chunk
         + align64(size_t(ch) * sizeof(double));   // per-row losses of the chunk
}

double linear_xent_fwd_bwd_bf16(float* dh, float* dW, const bf16* h, const bf16* W, const int32_t* targets, int64_t N,
                                int64_t C, int64_t V, float loss_scale, int64_t chunk_rows, void* ws) {
  MT_CHECK(N == 0 || (dh && dW), "linear_xent_fwd_bwd_bf16", "null gradient output (dh=", (void*)dh, " dW=",
           (void*)dW, ")");
  return run<bf16>("linear_xent_fwd_bwd_bf16", nullptr, dh, dW, h, W, targets, N, C, V, loss_scale, chunk_rows, ws);
}
double linear_xent_fwd_bwd_f32(float* dh, float* dW, const float* h, const float* W, const int32_t* targets,
                               int64_t N, int64_t C, int64_t V, float loss_scale, int64_t chunk_rows, void* ws) {
  MT_CHECK(N == 0 || (dh && dW), "linear_xent_fwd_bwd_f32", "null gradient output (dh=", (void*)dh, " dW=",
           (void*)dW, ")");
  return run<float>("linear_xent_fwd_bwd_f32", nullptr, dh, dW, h, W, targets, N, C, V, loss_scale, chunk_rows, ws);
}
double linear_xent_fwd_bf16(double* row_loss, const bf16* h, const bf16* W, const int32_t* targets, int64_t N,
                            int64_t C, int64_t V, float loss_scale, int64_t chunk_rows, void* ws) {
  return run<bf16>("linear_xent_fwd_bf16", row_loss, nullptr, nullptr, h, W, targets, N, C, V, loss_scale,
                   chunk_rows, ws);
}
double linear_xent_fwd_f32(double* row_loss, const float* h, const float* W, const int32_t* targets, int64_t N,
                           int64_t C, int64_t V, float loss_scale, int64_t chunk_rows, void* ws) {
  return run<float>("linear_xent_fwd_f32", row_loss, nullptr, nullptr, h, W, targets, N, C, V, loss_scale,
                    chunk_rows, ws);
}

}  // namespace moetron
