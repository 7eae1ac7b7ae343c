// cp_attention.h: context parallelism's attention. Each sequence of T tokens is cut into 2 cp chunks; CP rank r
// holds chunks r and 2cp-1-r (every rank gets the same causal work). Ring attention over the cp group: K/V
// blocks travel around the ring, each rank attends its two query chunks to the block it holds (the kernel's
// key-block masks, attention.h) and merges the partial outputs by their lse; the backward rings K/V again and
// sends the dK/dV partials along with them back to their owner. Also: the split itself (positions, row counts,
// gather / scatter between the whole sequence and a rank's rows) for the model, RoPE, the data loader and
// the loss. docs/parallel.md "Context parallelism: ring attention".
// Not: the model's wiring (src/model), an all-to-all (Ulysses) variant, a bf16 wire format, padding masks.
#pragma once
#include <cstdint>
#include <vector>

#include "moetron/attention.h"
#include "moetron/comm.h"

namespace moetron {

// ---- the split: chunk c of a sequence of T tokens is [cp_chunk_begin(T, cp, c), cp_chunk_begin(T, cp, c + 1)),
// begin = floor(c T / (2 cp)), for c in [0, 2 cp]; chunks differ in length by at most one (T < 2 cp: some are
// empty). Rank r < cp holds chunk r, then chunk 2cp-1-r: its local rows are those of chunk r, then those of
// chunk 2cp-1-r, in sequence order within each.
int64_t cp_chunk_begin(int64_t T, int cp, int c);
int64_t cp_local_rows(int64_t T, int cp, int rank);
// The global position (in [0, T)) of each local row of `rank`, in local row order.
std::vector<int64_t> cp_positions(int64_t T, int cp, int rank);

// Rows of B sequences: full is [B, T, row_bytes], local [B, cp_local_rows, row_bytes].
// cp_take_rows copies a rank's rows out of the whole sequences; cp_put_rows writes them back (the other rows of
// `full` are left as they are: every rank's put fills the whole array).
void cp_take_rows(void* local, const void* full, int64_t B, int64_t T, int64_t row_bytes, int cp, int rank);
void cp_put_rows(void* full, const void* local, int64_t B, int64_t T, int64_t row_bytes, int cp, int rank);
template <class E>
std::vector<E> cp_take(const std::vector<E>& full, int64_t B, int64_t T, int64_t row, int cp, int rank) {
  std::vector<E> local(size_t(B * cp_local_rows(T, cp, rank) * row));
  cp_take_rows(local.data(), full.data(), B, T, row * int64_t(sizeof(E)), cp, rank);
  return local;
}

// ---- ring attention over `cp` (its size is the cp degree, its rank the CP rank; name it, e.g. "cp", for
// traces: Comm::set_name).
// q, k, v, out (and the gradients, like their tensors) are a rank's local rows: d describes them with
// d.T = cp_local_rows(seq_len, cp.size(), cp.rank()) rows per sequence, d.Tk = 0 and d.mask = Causal, strides
// and heads as for attention_forward (MHA, GQA, MLA's Dqk != Dv, head_k / head_v = 0 for one shared head).
// lse is [B, Hq, d.T], the merged log-sum-exp of each local row over all its keys. The result is causal
// attention over the whole sequence of seq_len tokens, restricted to the local rows.
// Collective over cp: every rank calls it with the same B, seq_len, heads and dims. Deterministic: the merge
// and the gradient sums run in a fixed order (ring order), independent of timing and of the thread count.
void cp_attention_forward(float* out, float* lse /* [B, Hq, d.T] */, const float* q, const float* k, const float* v,
                          const AttnDims& d, int64_t seq_len, const Comm& cp);
// dq, dk, dv of the local rows are overwritten; out and lse from cp_attention_forward.
void cp_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out,
                           const float* lse /* [B, Hq, d.T] */, const float* q, const float* k, const float* v,
                           const AttnDims& d, int64_t seq_len, const Comm& cp);

}  // namespace moetron
