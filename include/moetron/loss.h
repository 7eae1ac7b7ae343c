// loss.h: fused output projection + softmax cross-entropy ("linear cross-entropy"), forward and
// backward in one call, chunked over rows so that the [N, V] logits never exist in full.
//   z = h · W^T                  h [N, C], W [V, C] (row per vocabulary entry: tieable with an embedding)
//   loss = loss_scale * sum over rows n with targets[n] >= 0 of (logsumexp(z_n) - z_n[targets[n]])
//   targets[n] == -1 ignores row n (zero loss, zero gradient)
// Per chunk of `chunk_rows` rows: logits chunk (oneDNN GEMM, fp32 out), row-wise softmax in place,
// minus one-hot, times loss_scale = dlogits chunk; dh_chunk = dlogits · W; dW += dlogits^T · h_chunk.
// In the bf16 variant dlogits is rounded to bf16 (in place, over its own fp32 row) for the two backward
// GEMMs, as in mixed-precision training; the fp32 variant keeps everything fp32.
// Deterministic: the chunk partition depends on chunk_rows only (never on the thread count), each row's
// softmax is done by one thread in a fixed order, row losses are summed in double in row order, and dW
// accumulates chunk after chunk.
// The vocabulary-sharded variant (linear_xent_shard_*, below) runs the same chunk loop on a shard of W's rows and
// exchanges per-row values between the row passes through an XentShardExchange; the Comm side of it (tensor
// parallelism, vocab_parallel.h / src/parallel/vocab_parallel.cpp) implements the exchange and reduces dh.
// Not a general softmax.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "moetron/dtype.h"
#include "moetron/kernel_sizes.h"

namespace moetron {

inline constexpr int32_t kIgnoreIndex = -1;

// Default rows per chunk, linear_xent_default_chunk(V) (kernel_sizes.h, shared with the accounting):
// max(256, rows filling 8 MiB of fp32 logits, a multiple of 16). Depends on V only. The floor keeps the dW
// GEMM (K = rows, dW re-read and re-written per chunk) compute bound.
// Workspace: the fp32 logits chunk [chunk, V] plus one double per chunk row. chunk_rows <= 0 means default.
size_t linear_xent_workspace_bytes(int64_t N, int64_t V, int64_t chunk_rows);

// Fused forward + backward. Returns the (scaled) loss. dh [N, C] is overwritten; dW [V, C] is accumulated
// into (+=). ws: linear_xent_workspace_bytes(N, V, chunk_rows) bytes, 64-byte aligned.
double linear_xent_fwd_bwd_bf16(float* dh /* [N, C] */, float* dW /* [V, C] += */, const bf16* h /* [N, C] */,
                                const bf16* W /* [V, C] */, const int32_t* targets /* [N] */, int64_t N, int64_t C,
                                int64_t V, float loss_scale, int64_t chunk_rows, void* ws);
double linear_xent_fwd_bwd_f32(float* dh /* [N, C] */, float* dW /* [V, C] += */, const float* h /* [N, C] */,
                               const float* W /* [V, C] */, const int32_t* targets /* [N] */, int64_t N, int64_t C,
                               int64_t V, float loss_scale, int64_t chunk_rows, void* ws);

// Forward only (validation). Returns the scaled loss; row_loss (may be null) gets the unscaled
// logsumexp(z_n) - z_n[target] per row, 0 for ignored rows.
double linear_xent_fwd_bf16(double* row_loss /* [N] or null */, const bf16* h /* [N, C] */,
                            const bf16* W /* [V, C] */, const int32_t* targets /* [N] */, int64_t N, int64_t C,
                            int64_t V, float loss_scale, int64_t chunk_rows, void* ws);
double linear_xent_fwd_f32(double* row_loss /* [N] or null */, const float* h /* [N, C] */,
                           const float* W /* [V, C] */, const int32_t* targets /* [N] */, int64_t N, int64_t C,
                           int64_t V, float loss_scale, int64_t chunk_rows, void* ws);

// ---- vocabulary-sharded variant ----
// This process holds W's rows [v0, v0 + Vl) of a vocabulary of V (targets are indices into the whole [0, V), -1
// ignored). Per chunk, the row passes of the kernel above run over the chunk's rows one pass at a time and the
// exchange combines the shards' per-row values between them: (1) each shard's row max and, from the shard
// holding the target, the target logit; (2) each shard's sum of exp(z - global max). The loss and the
// dlogits of every row then follow from the exchanged values exactly as in the whole-vocabulary kernel, so:
//   - the returned loss and row_loss are the same on every shard (computed from the same exchanged values);
//   - dh [N, C] is this shard's PART, dlogits_shard · W_shard: the sum of the shards' parts is dh (the caller
//     reduces it; vocab_parallel.h does); dW [Vl, C] += dlogits_shard^T · h is this shard's rows of dW;
//   - with one shard holding the whole vocabulary (v0 = 0, Vl = V, an exchange that returns its input) the
//     results are bitwise those of linear_xent_fwd_bwd_* / linear_xent_fwd_* (the same passes, in another
//     order over the rows of a chunk).
// Every shard must call with the same N, targets, chunk_rows (> 0: the chunks must line up across shards) and
// loss_scale, and its exchange calls are collective: once per chunk each, in chunk order.
class XentShardExchange {
 public:
  // mx[i]: this shard's max over row i's logits, NaN if any of them is non-finite; zt[i]: row i's target logit
  // if this shard holds targets[i], else 0. Rows with targets[i] < 0 hold 0 in both and may be left as they are.
  // On return, alike on every shard: mx[i] = the max over the shards (NaN if any shard's is NaN), zt[i] = the
  // target logit from the shard that holds it. targets: the chunk's rows, global indices.
  virtual void max_and_target(float* mx /* [rows] */, float* zt /* [rows] */, const int32_t* targets /* [rows] */,
                              int64_t rows) = 0;
  // s[i]: this shard's sum of exp(z - mx[i]) over its logits of row i (0 for an ignored or non-finite row). On
  // return: the sum over the shards, bitwise the same on every shard.
  virtual void sum(double* s /* [rows] */, int64_t rows) = 0;

 protected:
  ~XentShardExchange() = default;
};

struct XentShard {
  int64_t v0 = 0;                  // first vocabulary row held here
  int64_t V = 0;                   // the whole vocabulary
  XentShardExchange* ex = nullptr;  // required
};

// The kernel's workspace plus the row max and target logit of a chunk (2 floats per chunk row). chunk_rows > 0.
size_t linear_xent_shard_workspace_bytes(int64_t N, int64_t Vl, int64_t chunk_rows);
double linear_xent_shard_fwd_bwd_bf16(float* dh /* [N, C] part */, float* dW /* [Vl, C] += */, const bf16* h /* [N, C] */,
                                      const bf16* W /* [Vl, C] */, const int32_t* targets /* [N] */, int64_t N,
                                      int64_t C, int64_t Vl, const XentShard& sh, float loss_scale, int64_t chunk_rows,
                                      void* ws);
double linear_xent_shard_fwd_bwd_f32(float* dh /* [N, C] part */, float* dW /* [Vl, C] += */, const float* h /* [N, C] */,
                                     const float* W /* [Vl, C] */, const int32_t* targets /* [N] */, int64_t N,
                                     int64_t C, int64_t Vl, const XentShard& sh, float loss_scale, int64_t chunk_rows,
                                     void* ws);
double linear_xent_shard_fwd_bf16(double* row_loss /* [N] or null */, const bf16* h /* [N, C] */,
                                  const bf16* W /* [Vl, C] */, const int32_t* targets /* [N] */, int64_t N, int64_t C,
                                  int64_t Vl, const XentShard& sh, float loss_scale, int64_t chunk_rows, void* ws);
double linear_xent_shard_fwd_f32(double* row_loss /* [N] or null */, const float* h /* [N, C] */,
                                 const float* W /* [Vl, C] */, const int32_t* targets /* [N] */, int64_t N, int64_t C,
                                 int64_t Vl, const XentShard& sh, float loss_scale, int64_t chunk_rows, void* ws);

// ---- reference twin: unfused, materializes the [N, V] logits in T (float or double) ----
// Returns the scaled loss; dh (=) and dW (+=) may be null for a forward-only evaluation.
template <class T>
T linear_xent_ref(T* row_loss /* [N] or null */, T* dh /* [N, C] or null */, T* dW /* [V, C] += or null */,
                  const T* h /* [N, C] */, const T* W /* [V, C] */, const int32_t* targets /* [N] */, int64_t N,
                  int64_t C, int64_t V, T loss_scale) {
  std::vector<T> z(size_t(N * V));  // the full logits: what the fused kernel avoids
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v) {
      T acc = 0;
      for (int64_t c = 0; c < C; ++c) acc += h[n * C + c] * W[v * C + c];
      z[n * V + v] = acc;
    }
  T loss = 0;
  for (int64_t n = 0; n < N; ++n) {
    T* zn = &z[n * V];
    const int32_t t = targets[n];
    if (t < 0) {
      if (row_loss) row_loss[n] = 0;
      for (int64_t v = 0; v < V; ++v) zn[v] = 0;  // dlogits of an ignored row
      continue;
    }
    T mx = zn[0];
    for (int64_t v = 1; v < V; ++v) mx = zn[v] > mx ? zn[v] : mx;
    T sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(zn[v] - mx);
    const T lse = mx + std::log(sum);
    const T ln = lse - zn[t];
    if (row_loss) row_loss[n] = ln;
    loss += ln * loss_scale;
    for (int64_t v = 0; v < V; ++v) zn[v] = (std::exp(zn[v] - lse) - (v == t ? T(1) : T(0))) * loss_scale;
  }
  if (dh)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        T acc = 0;
        for (int64_t v = 0; v < V; ++v) acc += z[n * V + v] * W[v * C + c];
        dh[n * C + c] = acc;
      }
  if (dW)
    for (int64_t v = 0; v < V; ++v)
      for (int64_t c = 0; c < C; ++c) {
        T acc = 0;
        for (int64_t n = 0; n < N; ++n) acc += z[n * V + v] * h[n * C + c];
        dW[v * C + c] += acc;
      }
  return loss;
}

}  // namespace moetron
