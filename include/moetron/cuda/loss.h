// cuda/loss.h: the CUDA backend's fused output projection + softmax cross-entropy, the device twin of loss.h's
// linear_xent (same definition: z = h · W^T, loss = loss_scale * sum over rows with targets >= 0 of
// logsumexp(z_n) - z_n[target], targets -1 ignored; a target >= V is ignored too: a kernel cannot throw). Chunked over rows so the [N, V] logits never exist in full:
// per chunk, the logits GEMM (cuBLAS), one row kernel (max, sum of exp in fp64, row loss, dlogits = (softmax -
// onehot) * loss_scale written in place, or rounded to bf16 in the bf16 variant as on the CPU), then
// dh_chunk = dlogits · W and dW += dlogits^T · h_chunk (cuBLAS). The loss is a device double: the row losses
// (fp64) summed by one block in a fixed order (deterministic); nothing is read back to the host.
// Not the vocabulary-sharded variant (loss.h's linear_xent_shard_*). C++17-clean.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moetron {
struct bf16;
}

namespace moetron::cuda {

// chunk_rows <= 0: 4096 rows (or fewer when the [chunk, V] fp32 logits would pass 256 MiB).
int64_t linear_xent_chunk_rows(int64_t N, int64_t V, int64_t chunk_rows);
size_t linear_xent_workspace_bytes(int64_t N, int64_t V, int64_t chunk_rows);
// loss: device double [1] (the scaled loss); row_loss: device double [N] or null (unscaled, 0 for ignored rows).
// dh [N, C] overwritten and dW [V, C] accumulated (+=); both null: forward only. targets: device int32 [N].
void linear_xent_bf16(double* loss, double* row_loss, float* dh, float* dW, const bf16* h, const bf16* W,
                      const int32_t* targets, int64_t N, int64_t C, int64_t V, float loss_scale, int64_t chunk_rows,
                      void* ws, void* stream);
void linear_xent_f32(double* loss, double* row_loss, float* dh, float* dW, const float* h, const float* W,
                     const int32_t* targets, int64_t N, int64_t C, int64_t V, float loss_scale, int64_t chunk_rows,
                     void* ws, void* stream);

}  // namespace moetron::cuda
