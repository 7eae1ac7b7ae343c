// moe_dispatch.cu: MoE dispatch on the GPU (cuda/moe.h), the device twin of permute.h with capacity factor 0: the
// expert-major, stable plan (counts, offsets, row_of, token_of, slot_of) computed entirely on the device, and the
// gather / weighted scatter kernels with their backwards. The plan runs in three launches over chunks of 256
// (token, slot) assignments: per-chunk expert histograms, one scan (per expert over the chunks in order, then
// over the experts), and the stable rank of every assignment inside its chunk; integer arithmetic only, so the
// plan is exactly moe_permute_plan_ref's. Not capacity dropping and not the all-to-all between ranks.
#include "cuda_common.cuh"
#include "moetron/cuda/moe.h"

namespace moetron::cuda {
namespace {

constexpr int kChunk = 256;  // assignments per chunk = threads per block of the plan kernels

// hist[c, e] = assignments of chunk c routed to expert e. An index outside [0, E) traps (a device fault).
__global__ void chunk_hist_kernel(int32_t* __restrict__ hist, const int32_t* __restrict__ idx, int64_t total, int E) {
  extern __shared__ int32_t h[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) h[e] = 0;
  __syncthreads();
  const int64_t i = int64_t(blockIdx.x) * kChunk + threadIdx.x;
  if (i < total) {
    const int32_t e = idx[i];
    if (e < 0 || e >= E) __trap();
    atomicAdd(h + e, 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[int64_t(blockIdx.x) * E + e] = h[e];
}

// One block: counts[e] = sum over chunks; offsets = exclusive scan; base[c, e] = offsets[e] + sum_{c' < c} hist.
__global__ void plan_scan_kernel(int32_t* __restrict__ base, int32_t* __restrict__ counts,
                                 int32_t* __restrict__ offsets, const int32_t* __restrict__ hist, int64_t nchunks,
                                 int E) {
  extern __shared__ int32_t tot[];  // [E + 1]
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t t = 0;
    for (int64_t c = 0; c < nchunks; ++c) t += hist[c * E + e];
    tot[e] = t;
    counts[e] = t;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t r = 0;
    for (int e = 0; e < E; ++e) {
      const int32_t t = tot[e];
      tot[e] = r;
      offsets[e] = r;
      r += t;
    }
    offsets[E] = r;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t r = tot[e];
    for (int64_t c = 0; c < nchunks; ++c) {
      base[c * E + e] = r;
      r += hist[c * E + e];
    }
  }
}

// Row of assignment i = base[chunk, e] + #(earlier assignments of the chunk routed to e): stable.
__global__ void plan_assign_kernel(int32_t* __restrict__ row_of, int32_t* __restrict__ token_of,
                                   int32_t* __restrict__ slot_of, const int32_t* __restrict__ idx,
                                   const int32_t* __restrict__ base, int64_t total, int k, int E) {
  __shared__ int32_t ids[kChunk];
  const int64_t i = int64_t(blockIdx.x) * kChunk + threadIdx.x;
  const int32_t e = i < total ? idx[i] : -1;
  ids[threadIdx.x] = e;
  __syncthreads();
  if (e < 0) return;
  int32_t rank = 0;
  for (int j = 0; j < int(threadIdx.x); ++j) rank += ids[j] == e;
  const int32_t row = base[int64_t(blockIdx.x) * E + e] + rank;
  row_of[i] = row;
  token_of[row] = int32_t(i / k);
  if (slot_of) slot_of[row] = int32_t(i % k);
}

template <class TO>
__device__ __forceinline__ TO cvt(float v);
template <>
__device__ __forceinline__ float cvt<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 cvt<__nv_bfloat16>(float v) {
  return dev::to_bf(v);
}

template <class TO>
__global__ void permute_kernel(TO* __restrict__ xp, const float* __restrict__ x, const int32_t* __restrict__ token_of,
                               int64_t D) {
  const int64_t r = blockIdx.x;
  const float* src = x + int64_t(token_of[r]) * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) xp[r * D + d] = cvt<TO>(src[d]);
}

__global__ void permute_bwd_kernel(float* __restrict__ dx, const float* __restrict__ dxp,
                                   const int32_t* __restrict__ row_of, int k, int64_t D) {
  const int64_t t = blockIdx.x;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0;
    for (int s = 0; s < k; ++s) {
      const int32_t r = row_of[t * k + s];
      if (r >= 0) acc += dxp[int64_t(r) * D + d];
    }
    dx[t * D + d] = acc;
  }
}

__global__ void unpermute_kernel(float* __restrict__ y, const float* __restrict__ yp,
                                 const int32_t* __restrict__ row_of, const float* __restrict__ w, int k, int64_t D) {
  const int64_t t = blockIdx.x;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0;
    for (int s = 0; s < k; ++s) {
      const int32_t r = row_of[t * k + s];
      if (r >= 0) acc += w[t * k + s] * yp[int64_t(r) * D + d];
    }
    y[t * D + d] = acc;
  }
}

// One block per assignment (t, s).
__global__ void unpermute_bwd_kernel(float* __restrict__ dyp, float* __restrict__ dw, const float* __restrict__ dy,
                                     const float* __restrict__ yp, const int32_t* __restrict__ row_of,
                                     const float* __restrict__ w, int k, int64_t D) {
  __shared__ float sm[32];
  const int64_t i = blockIdx.x, t = i / k;
  const int32_t r = row_of[i];
  float acc = 0;
  if (r >= 0) {
    const float wi = w[i];
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      const float g = dy[t * D + d];
      dyp[int64_t(r) * D + d] = wi * g;
      acc += g * yp[int64_t(r) * D + d];
    }
  }
  acc = dev::block_sum(acc, sm);
  if (threadIdx.x == 0) dw[i] = acc;
}

int64_t nchunks(int64_t N, int k) { return (N * k + kChunk - 1) / kChunk; }

void check_rows(const char* op, int64_t N, int k, int64_t D) {
  MT_CUDA_ARG(N >= 0 && k >= 1 && D >= 1, op, "needs N >= 0, k >= 1, D >= 1");
  MT_CUDA_ARG(N * k < int64_t(INT32_MAX), op, "needs N * k < 2^31 (int32 rows)");
}

}  // namespace

size_t moe_plan_workspace_bytes(int64_t N, int k, int E) {
  return size_t(2 * nchunks(N, k) * E) * sizeof(int32_t) + 16;
}

void moe_plan(int32_t* counts, int32_t* offsets, int32_t* row_of, int32_t* token_of, int32_t* slot_of,
              const int32_t* topk_idx, int64_t N, int k, int E, void* ws, void* stream) {
  check_rows("cuda.moe_plan", N, k, 1);
  MT_CUDA_ARG(E >= 1 && E <= 8192, "cuda.moe_plan", "needs 1 <= E <= 8192 (shared-memory histogram and scan)");
  MT_CUDA_ARG(ws != nullptr, "cuda.moe_plan", "needs a workspace of moe_plan_workspace_bytes(N, k, E)");
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t total = N * k, nc = nchunks(N, k);
  auto* hist = static_cast<int32_t*>(ws);
  int32_t* base = hist + nc * E;
  if (nc > 0) {
    chunk_hist_kernel<<<unsigned(nc), kChunk, size_t(E) * 4, st>>>(hist, topk_idx, total, E);
    MT_CUDA_LAUNCHED("chunk_hist_kernel");
  }
  plan_scan_kernel<<<1, 256, size_t(E + 1) * 4, st>>>(base, counts, offsets, hist, nc, E);
  MT_CUDA_LAUNCHED("plan_scan_kernel");
  if (nc > 0) {
    plan_assign_kernel<<<unsigned(nc), kChunk, 0, st>>>(row_of, token_of, slot_of, topk_idx, base, total, k, E);
    MT_CUDA_LAUNCHED("plan_assign_kernel");
  }
}

void moe_permute(float* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D, void* stream) {
  check_rows("cuda.moe_permute", R, 1, D);
  if (R == 0) return;
  permute_kernel<float><<<unsigned(R), 128, 0, static_cast<cudaStream_t>(stream)>>>(xp, x, token_of, D);
  MT_CUDA_LAUNCHED("permute_kernel<float>");
}

void moe_permute(bf16* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D, void* stream) {
  check_rows("cuda.moe_permute", R, 1, D);
  if (R == 0) return;
  permute_kernel<__nv_bfloat16><<<unsigned(R), 128, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<__nv_bfloat16*>(xp), x, token_of, D);
  MT_CUDA_LAUNCHED("permute_kernel<bf16>");
}

void moe_dispatch(bf16* xp, int32_t* counts, int32_t* offsets, int32_t* row_of, int32_t* token_of, int32_t* slot_of,
                  const float* x, const int32_t* topk_idx, int64_t N, int k, int E, int64_t D, void* ws,
                  void* stream) {
  moe_plan(counts, offsets, row_of, token_of, slot_of, topk_idx, N, k, E, ws, stream);
  moe_permute(xp, x, token_of, N * k, D, stream);
}

void moe_permute_backward(float* dx, const float* dxp, const int32_t* row_of, int64_t N, int k, int64_t D,
                          void* stream) {
  check_rows("cuda.moe_permute_backward", N, k, D);
  if (N == 0) return;
  permute_bwd_kernel<<<unsigned(N), 128, 0, static_cast<cudaStream_t>(stream)>>>(dx, dxp, row_of, k, D);
  MT_CUDA_LAUNCHED("permute_bwd_kernel");
}

void moe_unpermute(float* y, const float* yp, const int32_t* row_of, const float* w, int64_t N, int k, int64_t D,
                   void* stream) {
  check_rows("cuda.moe_unpermute", N, k, D);
  if (N == 0) return;
  unpermute_kernel<<<unsigned(N), 128, 0, static_cast<cudaStream_t>(stream)>>>(y, yp, row_of, w, k, D);
  MT_CUDA_LAUNCHED("unpermute_kernel");
}

void moe_unpermute_backward(float* dyp, float* dw, const float* dy, const float* yp, const int32_t* row_of,
                            const float* w, int64_t N, int k, int64_t D, void* stream) {
  check_rows("cuda.moe_unpermute_backward", N, k, D);
  if (N == 0) return;
  unpermute_bwd_kernel<<<unsigned(N * k), 128, 0, static_cast<cudaStream_t>(stream)>>>(dyp, dw, dy, yp, row_of, w,
                                                                                        k, D);
  MT_CUDA_LAUNCHED("unpermute_bwd_kernel");
}

}  // namespace moetron::cuda
