// norm_swiglu.cu: RMSNorm forward/backward and SwiGLU forward/backward on the GPU (cuda/ops.h), the device twins
// of norm.h and swiglu.h. Simple, correct-first kernels: one block per row for row reductions, a grid-stride loop
// for element-wise work; every reduction has a fixed order (deterministic). Not fused with the GEMMs around them.
#include "cuda_common.cuh"
#include "moetron/cuda/ops.h"

namespace moetron::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rmsnorm_fwd_kernel(float* __restrict__ y, __nv_bfloat16* __restrict__ y16, float* __restrict__ rstd,
                                   const float* __restrict__ x, const float* __restrict__ w, int64_t C, float eps) {
  __shared__ float sm[32];
  const int64_t n = blockIdx.x;
  const float* xr = x + n * C;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += xr[c] * xr[c];
  ss = dev::block_sum(ss, sm);
  const float r = 1.0f / sqrtf(ss / float(C) + eps);
  if (threadIdx.x == 0) rstd[n] = r;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float v = xr[c] * r * w[c];
    y[n * C + c] = v;
    if (y16) y16[n * C + c] = dev::to_bf(v);
  }
}

// dx = rstd * (w*dy - xhat * mean(w*dy*xhat)) per row.
__global__ void rmsnorm_bwd_data_kernel(float* __restrict__ dx, const float* __restrict__ dy,
                                        const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ rstd, int64_t C) {
  __shared__ float sm[32];
  const int64_t n = blockIdx.x;
  const float r = rstd[n];
  const float *xr = x + n * C, *dyr = dy + n * C;
  float dot = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dot += w[c] * dyr[c] * xr[c] * r;
  dot = dev::block_sum(dot, sm) / float(C);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dx[n * C + c] = r * (w[c] * dyr[c] - xr[c] * r * dot);
}

// part[b, c] = sum over rows n of row block b of dy * x * rstd (rows in order).
__global__ void rmsnorm_bwd_weight_part(float* __restrict__ part, const float* __restrict__ dy,
                                        const float* __restrict__ x, const float* __restrict__ rstd, int64_t N,
                                        int64_t C, int64_t rows) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t b = blockIdx.y;
  if (c >= C) return;
  float acc = 0;
  const int64_t n1 = min(N, (b + 1) * rows);
  for (int64_t n = b * rows; n < n1; ++n) acc += dy[n * C + c] * x[n * C + c] * rstd[n];
  part[b * C + c] = acc;
}
__global__ void sum_parts_into(float* __restrict__ dw, const float* __restrict__ part, int64_t nb, int64_t C) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float acc = 0;
  for (int64_t b = 0; b < nb; ++b) acc += part[b * C + c];
  dw[c] += acc;
}

__device__ __forceinline__ float sigmoidf_(float g) { return 1.0f / (1.0f + expf(-g)); }

__global__ void swiglu_fwd_kernel(float* __restrict__ h, __nv_bfloat16* __restrict__ h16,
                                  const float* __restrict__ gu, const float* __restrict__ s, int64_t N, int64_t F) {
  const int64_t total = N * F;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / F, f = i - n * F;
    const float g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
    const float v = (s ? s[n] : 1.0f) * g * sigmoidf_(g) * u;
    h[i] = v;
    if (h16) h16[i] = dev::to_bf(v);
  }
}

// One block per row: dgu, and ds[n] = sum_f dh * silu(g) * u.
__global__ void swiglu_bwd_kernel(float* __restrict__ dgu, float* __restrict__ ds, const float* __restrict__ dh,
                                  const float* __restrict__ gu, const float* __restrict__ s, int64_t F) {
  __shared__ float sm[32];
  const int64_t n = blockIdx.x;
  const float sc = s ? s[n] : 1.0f;
  float acc = 0;
  for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
    const float g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f], d = dh[n * F + f];
    const float sig = sigmoidf_(g), silu = g * sig;
    dgu[n * 2 * F + f] = sc * d * u * sig * (1.0f + g * (1.0f - sig));
    dgu[n * 2 * F + F + f] = sc * d * silu;
    acc += d * silu * u;
  }
  acc = dev::block_sum(acc, sm);
  if (ds && threadIdx.x == 0) ds[n] = acc;
}

int grid_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 65536 ? (b > 0 ? b : 1) : 65536);
}

}  // namespace

void rmsnorm_forward(float* y, bf16* y16, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps, void* stream) {
  MT_CUDA_ARG(N >= 0 && C > 0, "cuda.rmsnorm_forward", "needs N >= 0 and C > 0");
  if (N == 0) return;
  rmsnorm_fwd_kernel<<<unsigned(N), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      y, reinterpret_cast<__nv_bfloat16*>(y16), rstd, x, w, C, eps);
  MT_CUDA_LAUNCHED("rmsnorm_fwd_kernel");
}

size_t rmsnorm_backward_workspace_bytes(int64_t N, int64_t C) {
  return size_t((N + kRmsnormRowBlock - 1) / kRmsnormRowBlock) * size_t(C) * sizeof(float);
}

void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t N, int64_t C, void* ws, void* stream) {
  MT_CUDA_ARG(N >= 0 && C > 0, "cuda.rmsnorm_backward", "needs N >= 0 and C > 0");
  MT_CUDA_ARG(ws || N == 0, "cuda.rmsnorm_backward", "needs a workspace of rmsnorm_backward_workspace_bytes(N, C)");
  if (N == 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  rmsnorm_bwd_data_kernel<<<unsigned(N), kThreads, 0, st>>>(dx, dy, x, w, rstd, C);
  MT_CUDA_LAUNCHED("rmsnorm_bwd_data_kernel");
  const int64_t nb = (N + kRmsnormRowBlock - 1) / kRmsnormRowBlock;
  float* part = static_cast<float*>(ws);
  rmsnorm_bwd_weight_part<<<dim3(unsigned((C + kThreads - 1) / kThreads), unsigned(nb)), kThreads, 0, st>>>(
      part, dy, x, rstd, N, C, kRmsnormRowBlock);
  MT_CUDA_LAUNCHED("rmsnorm_bwd_weight_part");
  sum_parts_into<<<unsigned((C + kThreads - 1) / kThreads), kThreads, 0, st>>>(dw, part, nb, C);
  MT_CUDA_LAUNCHED("sum_parts_into");
}

void swiglu_forward(float* h, bf16* h16, const float* gu, const float* s, int64_t N, int64_t F, void* stream) {
  MT_CUDA_ARG(N >= 0 && F > 0, "cuda.swiglu_forward", "needs N >= 0 and F > 0");
  if (N == 0) return;
  swiglu_fwd_kernel<<<grid_for(N * F), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      h, reinterpret_cast<__nv_bfloat16*>(h16), gu, s, N, F);
  MT_CUDA_LAUNCHED("swiglu_fwd_kernel");
}

void swiglu_backward(float* dgu, float* ds, const float* dh, const float* gu, const float* s, int64_t N, int64_t F,
                     void* stream) {
  MT_CUDA_ARG(N >= 0 && F > 0, "cuda.swiglu_backward", "needs N >= 0 and F > 0");
  if (N == 0) return;
  swiglu_bwd_kernel<<<unsigned(N), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(dgu, ds, dh, gu, s, F);
  MT_CUDA_LAUNCHED("swiglu_bwd_kernel");
}

}  // namespace moetron::cuda
