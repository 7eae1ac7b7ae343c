// elementwise.cu: RoPE (rope.h's half-split convention, in place on strided views), the AdamW step (optim.h's
// per-element order, FMA contraction forbidden through __fmul_rn/__fadd_rn so the result is bitwise the float
// reference) and the gradient's sum of squares in double (fixed blocks, deterministic) on the GPU (cuda/ops.h).
// Not the optimizer object or the clipping decision (the caller reads the norm back once per step).
#include "cuda_common.cuh"
#include "moetron/cuda/ops.h"

namespace moetron::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rope_kernel(float* __restrict__ x, int64_t B, int64_t T, int64_t H, int64_t ld_token,
                            int64_t ld_head, int64_t offset, int64_t half, const float* __restrict__ cs,
                            const float* __restrict__ sn, bool inverse) {
  const int64_t total = B * T * H * half;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t h = (idx / half) % H;
    const int64_t bt = idx / (half * H);  // b * T + t
    const int64_t t = bt % T;
    float* p = x + bt * ld_token + h * ld_head + offset;
    const float c = cs[t * half + i], s = inverse ? -sn[t * half + i] : sn[t * half + i];
    const float x0 = p[i], x1 = p[i + half];
    // the reference's order: x0 * c - x1 * s, x1 * c + x0 * s (no contraction, so both agree bitwise)
    p[i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    p[i + half] = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
  }
}

__global__ void adamw_kernel(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                             const float* __restrict__ g, int64_t n, AdamWScalars s, float grad_scale,
                             bool apply_decay) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = __fmul_rn(g[i], grad_scale);
    const float mi = __fadd_rn(__fmul_rn(s.b1, m[i]), __fmul_rn(s.one_minus_b1, gi));
    const float vi = __fadd_rn(__fmul_rn(s.b2, v[i]), __fmul_rn(s.one_minus_b2, __fmul_rn(gi, gi)));
    float pi = p[i];
    if (apply_decay) pi = __fmul_rn(pi, s.decay);
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), s.inv_sqrt_bc2), s.eps);
    pi = __fsub_rn(pi, __fmul_rn(s.step_size, __fdiv_rn(mi, denom)));
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
  }
}

constexpr int64_t kNormBlockElems = 1 << 16;
// part[b] = sum of squares of block b (a fixed run of kNormBlockElems elements), in double.
__global__ void sumsq_part(double* __restrict__ part, const float* __restrict__ g, int64_t n) {
  __shared__ double sm[32];
  const int64_t b0 = int64_t(blockIdx.x) * kNormBlockElems, b1 = min(n, b0 + kNormBlockElems);
  double acc = 0;
  for (int64_t i = b0 + threadIdx.x; i < b1; i += blockDim.x) acc += double(g[i]) * double(g[i]);
  acc = dev::block_sum(acc, sm);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}
__global__ void sum_in_order(double* __restrict__ out, const double* __restrict__ part, int64_t nb) {
  __shared__ double sm[32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < nb; i += blockDim.x) acc += part[i];
  acc = dev::block_sum(acc, sm);
  if (threadIdx.x == 0) *out = acc;
}

int grid_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 65536 ? (b > 0 ? b : 1) : 65536);
}

}  // namespace

void rope_apply(float* x, int64_t B, int64_t T, int64_t H, int64_t ld_token, int64_t ld_head, int64_t offset,
                int64_t R, const float* cos, const float* sin, bool inverse, void* stream) {
  MT_CUDA_ARG(R > 0 && R % 2 == 0, "cuda.rope_apply", "the rotary width R must be even and positive");
  MT_CUDA_ARG(B >= 0 && T >= 0 && H >= 0, "cuda.rope_apply", "negative size");
  const int64_t total = B * T * H * (R / 2);
  if (total == 0) return;
  rope_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, B, T, H, ld_token, ld_head,
                                                                                   offset, R / 2, cos, sin, inverse);
  MT_CUDA_LAUNCHED("rope_kernel");
}

void adamw_step(float* p, float* m, float* v, const float* g, int64_t n, const AdamWScalars& s, float grad_scale,
                bool apply_decay, void* stream) {
  MT_CUDA_ARG(n >= 0, "cuda.adamw_step", "negative size");
  if (n == 0) return;
  adamw_kernel<<<grid_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p, m, v, g, n, s, grad_scale,
                                                                                apply_decay);
  MT_CUDA_LAUNCHED("adamw_kernel");
}

size_t grad_norm_sq_workspace_bytes(int64_t n) {
  return size_t((n + kNormBlockElems - 1) / kNormBlockElems + 1) * sizeof(double);
}

void grad_norm_sq(double* out, const float* g, int64_t n, void* ws, void* stream) {
  MT_CUDA_ARG(n >= 0 && ws, "cuda.grad_norm_sq", "needs n >= 0 and a workspace");
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t nb = (n + kNormBlockElems - 1) / kNormBlockElems;
  double* part = static_cast<double*>(ws);
  if (nb > 0) {
    sumsq_part<<<unsigned(nb), kThreads, 0, st>>>(part, g, n);
    MT_CUDA_LAUNCHED("sumsq_part");
  }
  sum_in_order<<<1, kThreads, 0, st>>>(out, part, nb);
  MT_CUDA_LAUNCHED("sum_in_order");
}

}  // namespace moetron::cuda
