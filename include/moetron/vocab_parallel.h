// vocab_parallel.h: Megatron-style vocabulary parallelism over a tensor-parallel group `tp` (a Comm of P ranks):
// the split of the vocabulary, the vocab-parallel token embedding (forward and backward) and the vocab-parallel
// fused linear cross-entropy (forward + backward, and forward only). Each rank holds the rows [v0, v1) of the
// embedding E [V, d] and of the head W [V, C] (the same rows: tieable); no rank ever holds the [N, V] logits.
// Not the loss arithmetic (the chunk loop and row passes are loss.h's linear_xent_shard_*; this file adds the
// Comm side: the exchange between the row passes and the reduction of dh) and not the model's wiring.
//
// The split. Rank r of P holds rows [r*V/P, (r+1)*V/P) (floor division; Comm's own convention for splitting m
// elements): shard sizes are floor(V/P) or ceil(V/P), never empty (V >= P is required), the larger ones last.
// When P divides V (the job config requires it: parallel_rules) every shard has V/P rows.
//
// Token rows. `tokens` / `targets` [N] are the full micro-batch on every rank. The dense activations come in
// one of three forms (TpReduce):
//   AllReduce     every rank holds all N rows (x, dh summed over tp: all_reduce);
//   ReduceScatter sequence parallelism: rank r holds rows [r*N/P, (r+1)*N/P) (reduce_scatter); P must divide N
//                 (refused by name otherwise; the job config requires it: parallel_rules);
//   None          this rank's partial over its vocabulary rows, unreduced (the caller reduces, e.g. to overlap).
//
// Determinism and equality with one process:
//   - embedding forward: non-owning ranks contribute -0.0 (the exact additive identity, x + -0.0 == x bitwise for
//     every x), so the all-reduced / reduce-scattered rows are bitwise E[token];
//   - embedding backward: each rank adds dL/dx rows into its shard in token order (row n = 0..N-1), exactly the
//     single-process scatter-add restricted to its rows, so its gradient rows are bitwise the single-process ones
//     (under sequence parallelism the rows are all-gathered first: a copy);
//   - loss: the max over the vocabulary is exact (the max of the shards' maxima); the target logit is the owner's
//     value (a copy); the sum of exps is the sum over ranks (Comm's fixed rank order) of each shard's double sum,
//     a reassociation of the single-process sum; dh is summed over ranks in fp32 (reassociation of the head GEMM's
//     K = V sum). Bitwise run to run and alike on every rank; the loss is returned alike on every rank.
//   With P = 1 every result is bitwise the single-process kernel's (linear_xent_fwd_bwd_* / linear_xent_fwd_*).
// All calls are collective over tp, with the same N, tokens / targets, chunk_rows and loss_scale on every rank.
#pragma once
#include <cstddef>
#include <cstdint>

#include "moetron/comm.h"
#include "moetron/dtype.h"

namespace moetron {

struct VocabRange {
  int64_t v0 = 0, v1 = 0;  // this rank's vocabulary rows [v0, v1)
  int64_t size() const { return v1 - v0; }
};

// Rank r of P: [r*V/P, (r+1)*V/P). Requires 1 <= P <= V and 0 <= r < P.
VocabRange vocab_shard_range(int64_t V, int rank, int P);
// The largest shard, ceil(V/P): buffers sized from it are alike on every rank.
int64_t vocab_shard_max_rows(int64_t V, int P);
// The rank that holds vocabulary row v (0 <= v < V).
int vocab_shard_owner(int64_t V, int P, int64_t v);

enum class TpReduce : uint8_t { None, AllReduce, ReduceScatter };

// ---- embedding ----
// Workspace: ReduceScatter needs [N, d] fp32 (the partial rows before the reduce-scatter, the all-gathered
// gradient rows in the backward); None / AllReduce need none (0 bytes).
size_t vocab_embed_workspace_bytes(int64_t N, int64_t d, TpReduce mode);
// x = E[tokens] summed over tp. E_shard [Vl, d] = rows [v0, v1) of E. x: [N, d] (None: the partial, E rows of this
// shard and -0.0 elsewhere; AllReduce: the full rows) or [N/P, d] (ReduceScatter: rows [r*N/P, (r+1)*N/P)).
// Tokens must be in [0, V).
void vocab_embed_forward(float* x, const float* E_shard, const int32_t* tokens /* [N] */, int64_t N, int64_t d,
                         int64_t V, const Comm& tp, TpReduce mode, void* ws);
// gE_shard [Vl, d] += the rows of dE for this shard: for n = 0..N-1 in order, gE[tokens[n] - v0] += g[n] when the
// token is in [v0, v1). g: [N, d] (None / AllReduce: the full rows, the same on every rank) or [N/P, d]
// (ReduceScatter: this rank's rows, all-gathered here first).
void vocab_embed_backward(float* gE_shard, const float* g, const int32_t* tokens /* [N] */, int64_t N, int64_t d,
                          int64_t V, const Comm& tp, TpReduce mode, void* ws);

// ---- fused linear cross-entropy ----
// loss = loss_scale * sum over rows n with targets[n] >= 0 of (logsumexp_v(h_n . W_v) - h_n . W_targets[n]), the
// vocabulary split over tp (loss.h has the single-process definition). h [N, C]: the full rows on every rank (the
// model all-gathers them under sequence parallelism), in the compute dtype. W_shard [Vl, C]: rows [v0, v1) of W.
// Returns the scaled loss, alike on every rank. dW_shard [Vl, C] += this shard's rows of dW. dh (overwritten):
//   None [N, C] this rank's partial; AllReduce [N, C] the sum; ReduceScatter [N/P, C] rows [r*N/P, (r+1)*N/P).
// chunk_rows <= 0: vocab_xent_default_chunk(V, P). ws: vocab_xent_workspace_bytes(...) bytes, 64-byte aligned.
int64_t vocab_xent_default_chunk(int64_t V, int P);  // linear_xent_default_chunk of the largest shard
size_t vocab_xent_workspace_bytes(int64_t N, int64_t C, int64_t V, int P, int64_t chunk_rows, TpReduce dh_mode);
double vocab_xent_fwd_bwd_bf16(float* dh, float* dW_shard /* += */, const bf16* h /* [N, C] */,
                               const bf16* W_shard /* [Vl, C] */, const int32_t* targets /* [N] */, int64_t N,
                               int64_t C, int64_t V, const Comm& tp, TpReduce dh_mode, float loss_scale,
                               int64_t chunk_rows, void* ws);
double vocab_xent_fwd_bwd_f32(float* dh, float* dW_shard /* += */, const float* h /* [N, C] */,
                              const float* W_shard /* [Vl, C] */, const int32_t* targets /* [N] */, int64_t N,
                              int64_t C, int64_t V, const Comm& tp, TpReduce dh_mode, float loss_scale,
                              int64_t chunk_rows, void* ws);
// Forward only (validation): row_loss [N] (may be null) the unscaled per-row loss, alike on every rank. ws:
// vocab_xent_workspace_bytes(N, C, V, P, chunk_rows, TpReduce::None).
double vocab_xent_fwd_bf16(double* row_loss, const bf16* h, const bf16* W_shard, const int32_t* targets, int64_t N,
                           int64_t C, int64_t V, const Comm& tp, float loss_scale, int64_t chunk_rows, void* ws);
double vocab_xent_fwd_f32(double* row_loss, const float* h, const float* W_shard, const int32_t* targets, int64_t N,
                          int64_t C, int64_t V, const Comm& tp, float loss_scale, int64_t chunk_rows, void* ws);

}  // namespace moetron
