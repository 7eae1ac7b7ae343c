// loss.cpp: fused linear + cross-entropy (see loss.h): argument checks, the chunk loop with the
// oneDNN GEMMs, the scalar row passes and the dispatch to loss_avx512.cpp / loss_avx2.cpp for the row passes
// (loss_row.h). One chunk loop serves the whole-vocabulary kernel and the vocabulary-sharded one: they differ
// only in the row step (all passes of a row at once, or each pass over the chunk's rows with the shard
// exchange in between). Not the reference: linear_xent_ref in loss.h is the unfused twin. Not the Comm side of
// the sharded loss (src/parallel/vocab_parallel.cpp).
//
// Workspace (one chunk of `ch` rows, Vl = the vocabulary rows held here: V unsharded):
//   logits  [ch, Vl] fp32  the chunk's logits, overwritten in place by dlogits (fp32, or bf16 packed
//                          at the start of each fp32 row, i.e. a bf16 matrix with leading dim 2Vl)
//   rowloss [ch]    f64    per-row loss of the chunk, summed in row order after the parallel pass (sharded:
//                          first the row's partial sum of exps, exchanged, then its loss)
//   sharded only: rowmax [ch] f32 and target logit [ch] f32, exchanged between the shards
#include "moetron/loss.h"

#include "loss_row.h"

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

namespace {

enum Mode { kFwd = 0, kGradF32 = 1, kGradBf16 = 2 };

size_t align64(size_t b) { return (b + 63) & ~size_t(63); }

// The scalar row passes (loss_row.h).
void put_scalar(float* z, int64_t j, float d, bool bf16) {
  if (!bf16) z[j] = d;
  else {
    uint16_t b = to_bf16(d).bits;
    std::memcpy(reinterpret_cast<char*>(z) + 2 * j, &b, 2);  // bytes 2j..2j+1 lie below float j: already read
  }
}
float row_max_scalar(const float* z, int64_t V) {
  float mx = -INFINITY;
  bool finite = true;
  for (int64_t j = 0; j < V; ++j) {
    finite &= std::fabs(z[j]) < INFINITY;
    mx = std::max(mx, z[j]);
  }
  return finite ? mx : NAN;
}
double row_exp_scalar(float* z, int64_t V, float mx, bool store) {
  double sum = 0.0;
  for (int64_t j = 0; j < V; ++j) {
    float e = std::exp(z[j] - mx);
    sum += double(e);
    if (store) z[j] = e;
  }
  return sum;
}
void row_grad_scalar(float* z, int64_t V, int64_t t, float inv, float scale, bool bf16) {
  const bool here = t >= 0 && t < V;
  const float et = here ? z[t] : 0.0f;
  for (int64_t j = 0; j < V; ++j) put_scalar(z, j, z[j] * inv, bf16);
  if (here) put_scalar(z, t, et * inv - scale, bf16);
}
void row_fill_scalar(float* z, int64_t V, float value, bool bf16) {
  for (int64_t j = 0; j < V; ++j) put_scalar(z, j, value, bf16);
}

XentRowOps row_ops(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return loss_avx512::row_ops();
    case Isa::Avx2: return loss_avx2::row_ops();
    default: return {row_max_scalar, row_exp_scalar, row_grad_scalar, row_fill_scalar};
  }
}

// One whole row of logits z [V]: returns logsumexp(z) - z[t] (unscaled, double). In the grad modes z is
// overwritten by dlogits = (softmax(z) - onehot(t)) * scale, as fp32 (kGradF32) or as bf16 written over
// the first 2V bytes of the row (kGradBf16). Ignored rows (t < 0) return 0 with zero dlogits. A row with
// a non-finite logit returns NaN and NaN dlogits.
double xent_row(const XentRowOps& k, float* z, int64_t V, int32_t t, float scale, int mode) {
  const bool bf = mode == kGradBf16;
  if (t < 0) {
    if (mode != kFwd) k.row_fill(z, V, 0.0f, bf);
    return 0.0;
  }
  const float mx = k.row_max(z, V);
  if (std::isnan(mx)) {
    if (mode != kFwd) k.row_fill(z, V, NAN, bf);
    return NAN;
  }
  const float zt = z[t];
  const double sum = k.row_exp(z, V, mx, mode != kFwd);
  const double loss = double(mx) + std::log(sum) - double(zt);
  if (mode != kFwd) k.row_grad(z, V, t, float(double(scale) / sum), scale, bf);
  return loss;
}

// The sharded row step over one chunk: the same passes as xent_row, each over all rows of the chunk, with the
// exchange between them (the max and the target logit, then the sum of exps). Every shard computes every row's
// loss alike from the exchanged values, so rl is the same on every shard. t0: the global first vocabulary row
// held here; tg: the chunk's targets (global).
void xent_rows_sharded(const XentRowOps& k, float* logits, double* rl, float* mx, float* zt, const int32_t* tg,
                       int64_t rows, int64_t Vl, int64_t t0, XentShardExchange& ex, float scale, int mode) {
  const bool bf = mode == kGradBf16, grad = mode != kFwd;
  auto local = [&](int64_t i) -> int64_t { return tg[i] >= t0 && tg[i] < t0 + Vl ? tg[i] - t0 : -1; };
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t tl = local(i);
    mx[i] = tg[i] < 0 ? 0.0f : k.row_max(logits + i * Vl, Vl);
    zt[i] = tl >= 0 ? logits[i * Vl + tl] : 0.0f;
  }
  ex.max_and_target(mx, zt, tg, rows);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i)
    rl[i] = tg[i] < 0 || std::isnan(mx[i]) ? 0.0 : k.row_exp(logits + i * Vl, Vl, mx[i], grad);
  ex.sum(rl, rows);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    float* z = logits + i * Vl;
    if (tg[i] < 0 || std::isnan(mx[i])) {
      rl[i] = tg[i] < 0 ? 0.0 : double(NAN);
      if (grad) k.row_fill(z, Vl, tg[i] < 0 ? 0.0f : NAN, bf);
      continue;
    }
    const double sum = rl[i];
    rl[i] = double(mx[i]) + std::log(sum) - double(zt[i]);
    if (grad) k.row_grad(z, Vl, local(i), float(double(scale) / sum), scale, bf);
  }
}

int64_t resolve_chunk(int64_t N, int64_t V, int64_t chunk_rows) {
  int64_t ch = chunk_rows > 0 ? chunk_rows : linear_xent_default_chunk(V);
  return std::max<int64_t>(1, std::min(ch, N));
}

// V: the whole vocabulary (targets index it); Vl: the rows of W held here (V unsharded).
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

void check_shard(const char* op, int64_t Vl, const XentShard& sh, int64_t chunk_rows) {
  MT_CHECK(sh.ex != nullptr, op, "no shard exchange given (XentShard::ex is null)");
  MT_CHECK(Vl > 0 && sh.v0 >= 0 && sh.v0 + Vl <= sh.V, op, "shard rows [", sh.v0, ", ", sh.v0 + Vl,
           ") are not a non-empty part of the vocabulary [0, V=", sh.V, ")");
  MT_CHECK(chunk_rows > 0, op, "chunk_rows must be > 0 (the same on every shard), got ", chunk_rows);
}

template <class In>
void gemm_in(Trans ta, Trans tb, int64_t M, int64_t Nn, int64_t K, const In* A, int64_t lda, const In* B,
             int64_t ldb, float beta, float* Cm, int64_t ldc) {
  if constexpr (std::is_same_v<In, bf16>) gemm_bf16(ta, tb, M, Nn, K, 1.0f, A, lda, B, ldb, beta, Cm, ldc);
  else gemm_f32(ta, tb, M, Nn, K, 1.0f, A, lda, B, ldb, beta, Cm, ldc);
}

// The chunk loop shared by the eight entry points. dh/dW null: forward only. W holds the Vl vocabulary rows
// [sh.v0, sh.v0 + Vl) of sh.V; sh.ex null: the whole vocabulary (Vl == sh.V, v0 == 0) and the one-call row step.
template <class In>
double run(const char* op, double* row_loss, float* dh, float* dW, const In* h, const In* W, const int32_t* targets,
           int64_t N, int64_t C, int64_t Vl, const XentShard& sh, float loss_scale, int64_t chunk_rows, void* ws) {
  check_args(op, h, W, targets, N, C, sh.V, loss_scale, ws);
  const bool grad = dh != nullptr;
  if (grad) MT_CHECK(dW != nullptr, op, "dh given without dW");
  if (N == 0) return 0.0;
  const int64_t ch = resolve_chunk(N, Vl, chunk_rows);
  float* logits = static_cast<float*>(ws);
  char* p = static_cast<char*>(ws) + align64(size_t(ch * Vl) * sizeof(float));
  double* rl = reinterpret_cast<double*>(p);
  float* mx = reinterpret_cast<float*>(p + align64(size_t(ch) * sizeof(double)));  // sharded only
  float* zt = mx + ch;
  const int mode = !grad ? kFwd : std::is_same_v<In, bf16> ? kGradBf16 : kGradF32;
  const XentRowOps k = row_ops(active_isa());
  double loss = 0.0;
  for (int64_t r0 = 0; r0 < N; r0 += ch) {
    const int64_t rows = std::min(ch, N - r0);
    // logits [rows, Vl] = h[r0 : r0 + rows] · W^T
    gemm_in<In>(Trans::N, Trans::T, rows, Vl, C, h + r0 * C, C, W, C, 0.0f, logits, Vl);
    // The row pass over the logits (max, exp-sum, and the gradient): about 5 flops per logit, read and written.
    // The three GEMMs report their own work.
    MT_TRACE_COST(5.0 * double(rows * Vl), 8.0 * double(rows * Vl));
    if (sh.ex) {
      xent_rows_sharded(k, logits, rl, mx, zt, targets + r0, rows, Vl, sh.v0, *sh.ex, loss_scale, mode);
    } else {
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < rows; ++i) rl[i] = xent_row(k, logits + i * Vl, Vl, targets[r0 + i], loss_scale, mode);
    }
    for (int64_t i = 0; i < rows; ++i) {
      loss += rl[i] * double(loss_scale);
      if (row_loss) row_loss[r0 + i] = rl[i];
    }
    if (!grad) continue;
    if constexpr (std::is_same_v<In, bf16>) {
      const bf16* dl = reinterpret_cast<const bf16*>(logits);  // [rows, Vl] with leading dim 2Vl
      gemm_bf16(Trans::N, Trans::N, rows, C, Vl, 1.0f, dl, 2 * Vl, W, C, 0.0f, dh + r0 * C, C);
      gemm_bf16(Trans::T, Trans::N, Vl, C, rows, 1.0f, dl, 2 * Vl, h + r0 * C, C, 1.0f, dW, C);
    } else {
      gemm_f32(Trans::N, Trans::N, rows, C, Vl, 1.0f, logits, Vl, W, C, 0.0f, dh + r0 * C, C);
      gemm_f32(Trans::T, Trans::N, Vl, C, rows, 1.0f, logits, Vl, h + r0 * C, C, 1.0f, dW, C);
    }
  }
  return loss;
}

XentShard whole(int64_t V) { return XentShard{0, V, nullptr}; }

}  // namespace

// Two constraints. Memory: about 8 MiB of fp32 logits. Speed: every chunk re-reads and re-writes the
// fp32 dW [V, C] (8 V C bytes) for 2 rows V C flops of the dW GEMM, so rows / 4 flop per byte; at this
// machine's balance (~900 GFLOPS bf16 / ~20 GB/s = 45 flop/byte) that needs rows >= ~180. The floor of 256 rows in
// linear_xent_default_chunk (kernel_sizes.cpp) keeps it.
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
  return run<bf16>("linear_xent_fwd_bwd_bf16", nullptr, dh, dW, h, W, targets, N, C, V, whole(V), loss_scale, chunk_rows, ws);
}
double linear_xent_fwd_bwd_f32(float* dh, float* dW, const float* h, const float* W, const int32_t* targets,
                               int64_t N, int64_t C, int64_t V, float loss_scale, int64_t chunk_rows, void* ws) {
  MT_CHECK(N == 0 || (dh && dW), "linear_xent_fwd_bwd_f32", "null gradient output (dh=", (void*)dh, " dW=",
           (void*)dW, ")");
  return run<float>("linear_xent_fwd_bwd_f32", nullptr, dh, dW, h, W, targets, N, C, V, whole(V), loss_scale, chunk_rows, ws);
}
double linear_xent_fwd_bf16(double* row_loss, const bf16* h, const bf16* W, const int32_t* targets, int64_t N,
                            int64_t C, int64_t V, float loss_scale, int64_t chunk_rows, void* ws) {
  return run<bf16>("linear_xent_fwd_bf16", row_loss, nullptr, nullptr, h, W, targets, N, C, V, whole(V),
                   loss_scale, chunk_rows, ws);
}
double linear_xent_fwd_f32(double* row_loss, const float* h, const float* W, const int32_t* targets, int64_t N,
                           int64_t C, int64_t V, float loss_scale, int64_t chunk_rows, void* ws) {
  return run<float>("linear_xent_fwd_f32", row_loss, nullptr, nullptr, h, W, targets, N, C, V, whole(V),
                    loss_scale, chunk_rows, ws);
}

// ---- the vocabulary-sharded entry points ----

size_t linear_xent_shard_workspace_bytes(int64_t N, int64_t Vl, int64_t chunk_rows) {
  MT_CHECK(chunk_rows > 0, "linear_xent_shard_workspace_bytes", "chunk_rows must be > 0, got ", chunk_rows);
  if (N == 0) return linear_xent_workspace_bytes(N, Vl, chunk_rows);
  return linear_xent_workspace_bytes(N, Vl, chunk_rows) +
         align64(size_t(2 * resolve_chunk(N, Vl, chunk_rows)) * sizeof(float));  // row max, target logit
}

double linear_xent_shard_fwd_bwd_bf16(float* dh, float* dW, const bf16* h, const bf16* W, const int32_t* targets,
                                      int64_t N, int64_t C, int64_t Vl, const XentShard& sh, float loss_scale,
                                      int64_t chunk_rows, void* ws) {
  const char* op = "linear_xent_shard_fwd_bwd_bf16";
  check_shard(op, Vl, sh, chunk_rows);
  MT_CHECK(N == 0 || (dh && dW), op, "null gradient output (dh=", (void*)dh, " dW=", (void*)dW, ")");
  return run<bf16>(op, nullptr, dh, dW, h, W, targets, N, C, Vl, sh, loss_scale, chunk_rows, ws);
}
double linear_xent_shard_fwd_bwd_f32(float* dh, float* dW, const float* h, const float* W, const int32_t* targets,
                                     int64_t N, int64_t C, int64_t Vl, const XentShard& sh, float loss_scale,
                                     int64_t chunk_rows, void* ws) {
  const char* op = "linear_xent_shard_fwd_bwd_f32";
  check_shard(op, Vl, sh, chunk_rows);
  MT_CHECK(N == 0 || (dh && dW), op, "null gradient output (dh=", (void*)dh, " dW=", (void*)dW, ")");
  return run<float>(op, nullptr, dh, dW, h, W, targets, N, C, Vl, sh, loss_scale, chunk_rows, ws);
}
double linear_xent_shard_fwd_bf16(double* row_loss, const bf16* h, const bf16* W, const int32_t* targets, int64_t N,
                                  int64_t C, int64_t Vl, const XentShard& sh, float loss_scale, int64_t chunk_rows,
                                  void* ws) {
  check_shard("linear_xent_shard_fwd_bf16", Vl, sh, chunk_rows);
  return run<bf16>("linear_xent_shard_fwd_bf16", row_loss, nullptr, nullptr, h, W, targets, N, C, Vl, sh, loss_scale,
                   chunk_rows, ws);
}
double linear_xent_shard_fwd_f32(double* row_loss, const float* h, const float* W, const int32_t* targets, int64_t N,
                                 int64_t C, int64_t Vl, const XentShard& sh, float loss_scale, int64_t chunk_rows,
                                 void* ws) {
  check_shard("linear_xent_shard_fwd_f32", Vl, sh, chunk_rows);
  return run<float>("linear_xent_shard_fwd_f32", row_loss, nullptr, nullptr, h, W, targets, N, C, Vl, sh, loss_scale,
                    chunk_rows, ws);
}

}  // namespace moetron
