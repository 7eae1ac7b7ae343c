// flash_attention.cu: causal flash-style attention on the GPU (cuda/attention.h), forward and backward, the device
// twin of attention.h's Causal fp32 path. Correct-first: fp32 SIMT tiles in shared memory (32 queries x 32 keys; the
// dk/dv kernel takes 16 queries at a time), online softmax in the forward, P recomputed from lse in the backward.
// Shared-memory rows read across a warp's lanes are padded by one float (no bank conflicts). The entry points
// hand DeviceAttnDims::bf16 to the tensor-core kernels (flash_attention_wmma.cu); D_t is computed here for both.
// Not key blocks (Full mask), not a shared k/v head (head_k / head_v = 0).
#include "cuda_common.cuh"
#include "moetron/cuda/attention.h"

namespace moetron::cuda {
namespace {

constexpr int kThr = 256;
constexpr int FQ = 32, FK = 32;    // forward: queries, keys per tile (FK = warp size: one lane per key)
constexpr int BKk = 32, BQk = 16;  // dk/dv kernel: keys per block, queries per step
constexpr int QQ = 32, QK = 32;    // dq kernel

__device__ __forceinline__ float dotp(const float* a, const float* b, int n) {
  float acc = 0;
  for (int e = 0; e < n; ++e) acc += a[e] * b[e];
  return acc;
}

// Loads rows r0 .. r0 + rows - 1 (zero past T) of one head into smem [rows, stride].
__device__ __forceinline__ void load_rows(float* dst, int stride, const float* src, int64_t ld, int64_t r0, int rows,
                                          int cols, int64_t T) {
  for (int idx = threadIdx.x; idx < rows * cols; idx += blockDim.x) {
    const int i = idx / cols, e = idx % cols;
    dst[i * stride + e] = r0 + i < T ? src[(r0 + i) * ld + e] : 0.0f;
  }
}

__global__ void __launch_bounds__(kThr) attn_fwd_kernel(float* __restrict__ out, float* __restrict__ lse,
                                                        const float* __restrict__ q, const float* __restrict__ k,
                                                        const float* __restrict__ v, DeviceAttnDims d) {
  extern __shared__ float sm[];
  const int Dq = int(d.Dqk), Dv = int(d.Dv), KS = Dq + 1;
  float* Qs = sm;
  float* Ks = Qs + FQ * Dq;
  float* Vs = Ks + FK * KS;
  float* S = Vs + FK * Dv;
  float* Os = S + FQ * FK;
  float* mrow = Os + FQ * Dv;
  float* lrow = mrow + FQ;
  float* arow = lrow + FQ;
  const int64_t b = blockIdx.z, h = blockIdx.y, t0 = int64_t(blockIdx.x) * FQ, T = d.T;
  const int64_t hk = h / (d.Hq / d.Hkv);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nw = blockDim.x >> 5;
  load_rows(Qs, Dq, q + b * T * d.ldq + h * d.head_q, d.ldq, t0, FQ, Dq, T);
  for (int idx = tid; idx < FQ * Dv; idx += blockDim.x) Os[idx] = 0.0f;
  for (int i = tid; i < FQ; i += blockDim.x) mrow[i] = -INFINITY, lrow[i] = 0.0f;
  const int64_t s_end = T < t0 + FQ ? T : t0 + FQ;
  for (int64_t s0 = 0; s0 < s_end; s0 += FK) {
    __syncthreads();  // the previous tile's readers are done
    load_rows(Ks, KS, k + b * T * d.ldk + hk * d.head_k, d.ldk, s0, FK, Dq, T);
    load_rows(Vs, Dv, v + b * T * d.ldv + hk * d.head_v, d.ldv, s0, FK, Dv, T);
    __syncthreads();
    for (int idx = tid; idx < FQ * FK; idx += blockDim.x) {
      const int i = idx / FK, j = idx % FK;
      const int64_t t = t0 + i, s = s0 + j;
      S[idx] = (t < T && s <= t) ? d.scale * dotp(Qs + i * Dq, Ks + j * KS, Dq) : -INFINITY;
    }
    __syncthreads();
    for (int i = warp; i < FQ; i += nw) {  // one warp per row, one lane per key
      const float x = S[i * FK + lane];
      const float mold = mrow[i], mnew = fmaxf(mold, dev::warp_max(x));
      if (mnew == -INFINITY) {  // nothing visible yet (a row past T)
        S[i * FK + lane] = 0.0f;
        if (lane == 0) arow[i] = 1.0f;
        continue;
      }
      const float p = expf(x - mnew);
      S[i * FK + lane] = p;
      const float ps = dev::warp_sum(p);
      if (lane == 0) {
        const float a = expf(mold - mnew);
        lrow[i] = lrow[i] * a + ps;
        mrow[i] = mnew;
        arow[i] = a;
      }
    }
    __syncthreads();
    for (int idx = tid; idx < FQ * Dv; idx += blockDim.x) {
      const int i = idx / Dv, e = idx % Dv;
      float acc = Os[idx] * arow[i];
      for (int j = 0; j < FK; ++j) acc += S[i * FK + j] * Vs[j * Dv + e];
      Os[idx] = acc;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < FQ * Dv; idx += blockDim.x) {
    const int i = idx / Dv, e = idx % Dv;
    const int64_t t = t0 + i;
    if (t < T) out[(b * T + t) * d.ldo + h * d.head_o + e] = Os[idx] / lrow[i];
  }
  for (int i = tid; i < FQ; i += blockDim.x)
    if (t0 + i < T) lse[(b * d.Hq + h) * T + t0 + i] = mrow[i] + logf(lrow[i]);
}

// D[b, h, t] = sum_e dout * out; one warp per (b, t, h).
__global__ void attn_dsum_kernel(float* __restrict__ D, const float* __restrict__ dout, const float* __restrict__ out,
                                 DeviceAttnDims d) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= d.B * d.T * d.Hq) return;
  const int64_t h = w % d.Hq, bt = w / d.Hq, b = bt / d.T, t = bt % d.T;
  const float* o = out + bt * d.ldo + h * d.head_o;
  const float* g = dout + bt * d.ldo + h * d.head_o;
  float acc = 0;
  for (int64_t e = lane; e < d.Dv; e += 32) acc += g[e] * o[e];
  acc = dev::warp_sum(acc);
  if (lane == 0) D[(b * d.Hq + h) * d.T + t] = acc;
}

// P and dS of query i (row t) and key j (row s) of the current tiles; 0 where masked.
__device__ __forceinline__ void p_ds(float* p, float* ds, const float* Qi, const float* Kj, const float* dOi,
                                     const float* Vj, int Dq, int Dv, float L, float Dt, float scale, int64_t t,
                                     int64_t s, int64_t T) {
  *p = 0.0f;
  *ds = 0.0f;
  if (t < T && s <= t) {
    const float pp = expf(scale * dotp(Qi, Kj, Dq) - L);
    *p = pp;
    *ds = pp * (dotp(dOi, Vj, Dv) - Dt) * scale;
  }
}

// dk, dv of BKk keys of kv head hk: over the group's q heads in order, then the query tiles in order.
__global__ void __launch_bounds__(kThr) attn_dkv_kernel(float* __restrict__ dk, float* __restrict__ dv,
                                                        const float* __restrict__ dout, const float* __restrict__ lse,
                                                        const float* __restrict__ D, const float* __restrict__ q,
                                                        const float* __restrict__ k, const float* __restrict__ v,
                                                        DeviceAttnDims d) {
  extern __shared__ float sm[];
  const int Dq = int(d.Dqk), Dv = int(d.Dv), KS = Dq + 1, VS = Dv + 1;
  float* Ks = sm;
  float* Vs = Ks + BKk * KS;
  float* dKs = Vs + BKk * VS;
  float* dVs = dKs + BKk * Dq;
  float* Qs = dVs + BKk * Dv;
  float* dOs = Qs + BQk * Dq;
  float* P = dOs + BQk * Dv;
  float* dS = P + BQk * BKk;
  float* Ls = dS + BQk * BKk;
  float* Ds = Ls + BQk;
  const int64_t b = blockIdx.z, hk = blockIdx.y, s0 = int64_t(blockIdx.x) * BKk, T = d.T;
  const int64_t G = d.Hq / d.Hkv;
  const int tid = threadIdx.x;
  load_rows(Ks, KS, k + b * T * d.ldk + hk * d.head_k, d.ldk, s0, BKk, Dq, T);
  load_rows(Vs, VS, v + b * T * d.ldv + hk * d.head_v, d.ldv, s0, BKk, Dv, T);
  for (int idx = tid; idx < BKk * Dq; idx += blockDim.x) dKs[idx] = 0.0f;
  for (int idx = tid; idx < BKk * Dv; idx += blockDim.x) dVs[idx] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hk * G + g;
    for (int64_t t0 = s0 / BQk * BQk; t0 < T; t0 += BQk) {
      __syncthreads();
      load_rows(Qs, Dq, q + b * T * d.ldq + h * d.head_q, d.ldq, t0, BQk, Dq, T);
      load_rows(dOs, Dv, dout + b * T * d.ldo + h * d.head_o, d.ldo, t0, BQk, Dv, T);
      for (int i = tid; i < BQk; i += blockDim.x) {
        const bool ok = t0 + i < T;
        Ls[i] = ok ? lse[(b * d.Hq + h) * T + t0 + i] : 0.0f;
        Ds[i] = ok ? D[(b * d.Hq + h) * T + t0 + i] : 0.0f;
      }
      __syncthreads();
      for (int idx = tid; idx < BQk * BKk; idx += blockDim.x) {
        const int i = idx / BKk, j = idx % BKk;
        p_ds(P + idx, dS + idx, Qs + i * Dq, Ks + j * KS, dOs + i * Dv, Vs + j * VS, Dq, Dv, Ls[i], Ds[i], d.scale,
             t0 + i, s0 + j, T);
      }
      __syncthreads();
      for (int idx = tid; idx < BKk * Dv; idx += blockDim.x) {
        const int j = idx / Dv, e = idx % Dv;
        float acc = dVs[idx];
        for (int i = 0; i < BQk; ++i) acc += P[i * BKk + j] * dOs[i * Dv + e];
        dVs[idx] = acc;
      }
      for (int idx = tid; idx < BKk * Dq; idx += blockDim.x) {
        const int j = idx / Dq, e = idx % Dq;
        float acc = dKs[idx];
        for (int i = 0; i < BQk; ++i) acc += dS[i * BKk + j] * Qs[i * Dq + e];
        dKs[idx] = acc;
      }
    }
  }
  __syncthreads();
  for (int idx = tid; idx < BKk * Dq; idx += blockDim.x) {
    const int j = idx / Dq, e = idx % Dq;
    if (s0 + j < T) dk[(b * T + s0 + j) * d.ldk + hk * d.head_k + e] = dKs[idx];
  }
  for (int idx = tid; idx < BKk * Dv; idx += blockDim.x) {
    const int j = idx / Dv, e = idx % Dv;
    if (s0 + j < T) dv[(b * T + s0 + j) * d.ldv + hk * d.head_v + e] = dVs[idx];
  }
}

// dq of QQ queries of q head h: over the key tiles in order.
__global__ void __launch_bounds__(kThr) attn_dq_kernel(float* __restrict__ dq, const float* __restrict__ dout,
                                                       const float* __restrict__ lse, const float* __restrict__ D,
                                                       const float* __restrict__ q, const float* __restrict__ k,
                                                       const float* __restrict__ v, DeviceAttnDims d) {
  extern __shared__ float sm[];
  const int Dq = int(d.Dqk), Dv = int(d.Dv), KS = Dq + 1, VS = Dv + 1;
  float* Qs = sm;
  float* dOs = Qs + QQ * Dq;
  float* dQs = dOs + QQ * Dv;
  float* Ks = dQs + QQ * Dq;
  float* Vs = Ks + QK * KS;
  float* dS = Vs + QK * VS;
  float* Ls = dS + QQ * QK;
  float* Ds = Ls + QQ;
  const int64_t b = blockIdx.z, h = blockIdx.y, t0 = int64_t(blockIdx.x) * QQ, T = d.T;
  const int64_t hk = h / (d.Hq / d.Hkv);
  const int tid = threadIdx.x;
  load_rows(Qs, Dq, q + b * T * d.ldq + h * d.head_q, d.ldq, t0, QQ, Dq, T);
  load_rows(dOs, Dv, dout + b * T * d.ldo + h * d.head_o, d.ldo, t0, QQ, Dv, T);
  for (int idx = tid; idx < QQ * Dq; idx += blockDim.x) dQs[idx] = 0.0f;
  for (int i = tid; i < QQ; i += blockDim.x) {
    const bool ok = t0 + i < T;
    Ls[i] = ok ? lse[(b * d.Hq + h) * T + t0 + i] : 0.0f;
    Ds[i] = ok ? D[(b * d.Hq + h) * T + t0 + i] : 0.0f;
  }
  const int64_t s_end = T < t0 + QQ ? T : t0 + QQ;
  for (int64_t s0 = 0; s0 < s_end; s0 += QK) {
    __syncthreads();
    load_rows(Ks, KS, k + b * T * d.ldk + hk * d.head_k, d.ldk, s0, QK, Dq, T);
    load_rows(Vs, VS, v + b * T * d.ldv + hk * d.head_v, d.ldv, s0, QK, Dv, T);
    __syncthreads();
    for (int idx = tid; idx < QQ * QK; idx += blockDim.x) {
      const int i = idx / QK, j = idx % QK;
      float p;
      p_ds(&p, dS + idx, Qs + i * Dq, Ks + j * KS, dOs + i * Dv, Vs + j * VS, Dq, Dv, Ls[i], Ds[i], d.scale, t0 + i,
           s0 + j, T);
    }
    __syncthreads();
    for (int idx = tid; idx < QQ * Dq; idx += blockDim.x) {
      const int i = idx / Dq, e = idx % Dq;
      float acc = dQs[idx];
      for (int j = 0; j < QK; ++j) acc += dS[i * QK + j] * Ks[j * KS + e];
      dQs[idx] = acc;
    }
  }
  __syncthreads();
  for (int idx = tid; idx < QQ * Dq; idx += blockDim.x) {
    const int i = idx / Dq, e = idx % Dq;
    if (t0 + i < T) dq[(b * T + t0 + i) * d.ldq + h * d.head_q + e] = dQs[idx];
  }
}

size_t fwd_bytes(const DeviceAttnDims& d) {
  const int64_t Dq = d.Dqk, Dv = d.Dv;
  return size_t(FQ * Dq + FK * (Dq + 1) + FK * Dv + FQ * FK + FQ * Dv + 3 * FQ) * sizeof(float);
}
size_t dkv_bytes(const DeviceAttnDims& d) {
  const int64_t Dq = d.Dqk, Dv = d.Dv;
  return size_t(BKk * (Dq + 1) + BKk * (Dv + 1) + BKk * Dq + BKk * Dv + BQk * Dq + BQk * Dv + 2 * BQk * BKk +
                2 * BQk) *
         sizeof(float);
}
size_t dq_bytes(const DeviceAttnDims& d) {
  const int64_t Dq = d.Dqk, Dv = d.Dv;
  return size_t(2 * QQ * Dq + QQ * Dv + QK * (Dq + 1) + QK * (Dv + 1) + QQ * QK + 2 * QQ) * sizeof(float);
}

void check_dims(const DeviceAttnDims& d, const char* op) {
  MT_CUDA_ARG(d.B >= 1 && d.T >= 0 && d.Hq >= 1 && d.Hkv >= 1, op, "needs B >= 1, T >= 0, Hq >= 1, Hkv >= 1");
  MT_CUDA_ARG(d.Hq % d.Hkv == 0, op, "needs Hq a multiple of Hkv (GQA groups)");
  MT_CUDA_ARG(d.Dqk >= 1 && d.Dqk <= kDeviceAttnMaxHeadDim && d.Dv >= 1 && d.Dv <= kDeviceAttnMaxHeadDim, op,
              "needs 1 <= Dqk, Dv <= 256");
  MT_CUDA_ARG(d.Hkv == 1 || (d.head_k != 0 && d.head_v != 0), op,
              "takes no shared k/v head (head_k or head_v = 0 with Hkv > 1): expand it first");
  MT_CUDA_ARG(d.B <= 65535 && d.Hq <= 65535, op, "needs B, Hq <= 65535 (grid dimensions)");
  MT_CUDA_ARG(d.ldq >= 1 && d.ldk >= 1 && d.ldv >= 1 && d.ldo >= 1, op, "needs positive token strides");
}

}  // namespace

void detail::smem_optin(const void* kernel, size_t bytes, const char* op) {
  int dev = 0, optin = 0;
  MT_CUDA_CHECK(cudaGetDevice(&dev));
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  MT_CUDA_ARG(bytes <= size_t(optin), op, "needs more shared memory per block than this device has (head dims?)");
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// The tensor-core variant (flash_attention_wmma.cu).
namespace attn_wmma {
size_t fwd_bytes(const DeviceAttnDims& d);
size_t bwd_bytes(const DeviceAttnDims& d);
void forward(float* out, float* lse, const float* q, const float* k, const float* v, const DeviceAttnDims& d,
             cudaStream_t st);
void backward(float* dq, float* dk, float* dv, const float* dout, const float* lse, const float* D, const float* q,
              const float* k, const float* v, const DeviceAttnDims& d, cudaStream_t st);
}  // namespace attn_wmma

size_t attention_forward_smem_bytes(const DeviceAttnDims& d) {
  return d.bf16 ? attn_wmma::fwd_bytes(d) : fwd_bytes(d);
}
size_t attention_backward_smem_bytes(const DeviceAttnDims& d) {
  if (d.bf16) return attn_wmma::bwd_bytes(d);
  return dkv_bytes(d) > dq_bytes(d) ? dkv_bytes(d) : dq_bytes(d);
}
size_t attention_backward_workspace_bytes(const DeviceAttnDims& d) {
  return size_t(d.B * d.Hq * (d.T > 0 ? d.T : 1)) * sizeof(float);
}

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, const DeviceAttnDims& d,
                       void* stream) {
  check_dims(d, "cuda.attention_forward");
  if (d.T == 0) return;
  if (d.bf16) return attn_wmma::forward(out, lse, q, k, v, d, static_cast<cudaStream_t>(stream));
  const size_t bytes = fwd_bytes(d);
  detail::smem_optin(reinterpret_cast<const void*>(&attn_fwd_kernel), bytes, "cuda.attention_forward");
  const dim3 grid(unsigned((d.T + FQ - 1) / FQ), unsigned(d.Hq), unsigned(d.B));
  attn_fwd_kernel<<<grid, kThr, bytes, static_cast<cudaStream_t>(stream)>>>(out, lse, q, k, v, d);
  MT_CUDA_LAUNCHED("attn_fwd_kernel");
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                        const float* q, const float* k, const float* v, const DeviceAttnDims& d, void* ws,
                        void* stream) {
  const char* op = "cuda.attention_backward";
  check_dims(d, op);
  MT_CUDA_ARG(ws != nullptr, op, "needs a workspace of attention_backward_workspace_bytes(d)");
  if (d.T == 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  auto* D = static_cast<float*>(ws);
  const int64_t rows = d.B * d.T * d.Hq;
  attn_dsum_kernel<<<unsigned((rows * 32 + kThr - 1) / kThr), kThr, 0, st>>>(D, dout, out, d);
  MT_CUDA_LAUNCHED("attn_dsum_kernel");
  if (d.bf16) return attn_wmma::backward(dq, dk, dv, dout, lse, D, q, k, v, d, st);
  const size_t b1 = dkv_bytes(d), b2 = dq_bytes(d);
  detail::smem_optin(reinterpret_cast<const void*>(&attn_dkv_kernel), b1, op);
  detail::smem_optin(reinterpret_cast<const void*>(&attn_dq_kernel), b2, op);
  attn_dkv_kernel<<<dim3(unsigned((d.T + BKk - 1) / BKk), unsigned(d.Hkv), unsigned(d.B)), kThr, b1, st>>>(
      dk, dv, dout, lse, D, q, k, v, d);
  MT_CUDA_LAUNCHED("attn_dkv_kernel");
  attn_dq_kernel<<<dim3(unsigned((d.T + QQ - 1) / QQ), unsigned(d.Hq), unsigned(d.B)), kThr, b2, st>>>(
      dq, dout, lse, D, q, k, v, d);
  MT_CUDA_LAUNCHED("attn_dq_kernel");
}

}  // namespace moetron::cuda
