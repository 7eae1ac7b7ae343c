// flash_attention_wmma.cu: the tensor-core variant of the causal flash attention (cuda/attention.h with
// DeviceAttnDims::bf16): every product (forward q k^T and P v; backward q k^T, dO v^T, P^T dO, dS^T q, dS k) runs
// on WMMA 16x16x16 bf16 fragments with fp32 accumulation, on operands rounded to bf16 when they are staged in
// shared memory (attention.h's AttnPrec::BF16 semantics); the scaling, mask, online softmax, lse, D_t and the
// accumulators stay fp32. Same tiling and determinism as flash_attention.cu (32 x 32 tiles, one block per query
// tile / key tile, no atomics); head dims are zero-padded to multiples of 16 in shared memory. Correct-first: the
// accumulators of P v, dk, dv, dq go through shared memory each step (no register-resident pipeline, no cp.async).
// Not the fp32 path (flash_attention.cu).
#include <mma.h>

#include <type_traits>

#include "cuda_common.cuh"
#include "moetron/cuda/attention.h"

namespace moetron::cuda::attn_wmma {

constexpr int kThr = 128;  // 4 warps
constexpr int TQ = 32, TK = 32;
constexpr int LP = TK + 8;  // bf16 row stride of P / dS tiles

struct Lay {
  int Dq, Dv, Dqp, Dvp, lq, lv;  // head dims, padded to 16, bf16 row strides (+8: fewer bank conflicts)
};
__host__ __device__ inline Lay lay(const DeviceAttnDims& d) {
  Lay l;
  l.Dq = int(d.Dqk), l.Dv = int(d.Dv);
  l.Dqp = (l.Dq + 15) / 16 * 16, l.Dvp = (l.Dv + 15) / 16 * 16;
  l.lq = l.Dqp + 8, l.lv = l.Dvp + 8;
  return l;
}
__host__ __device__ inline size_t al(size_t b) { return (b + 127) / 128 * 128; }

// Shared-memory carving: a bump pointer over the dynamic block, 128-byte aligned pieces.
struct Carve {
  char* p;
  template <class T>
  __device__ T* take(size_t n) {
    T* r = reinterpret_cast<T*>(p);
    p += al(n * sizeof(T));
    return r;
  }
};

// rows [r0, r0 + rows) of one head, rounded to bf16, zero past T and past cols (up to the padded width).
__device__ void load_bf(__nv_bfloat16* dst, int ld, const float* src, int64_t lds, int64_t r0, int rows, int cols,
                        int colsp, int64_t T) {
  for (int idx = threadIdx.x; idx < rows * colsp; idx += blockDim.x) {
    const int i = idx / colsp, e = idx % colsp;
    dst[i * ld + e] = dev::to_bf(r0 + i < T && e < cols ? src[(r0 + i) * lds + e] : 0.0f);
  }
}

// C[M, N] (fp32, ldc) = (acc ? C : 0) + A[M, K] · B[K, N] on tensor cores, tiles spread over the block's warps.
// A: row-major [M, K] (lda), or ACOL: stored as [K, M] row-major (A^T). B: row-major [K, N] (ldb), or BCOL: stored
// as [N, K] row-major (B^T). M, N, K multiples of 16.
template <bool ACOL, bool BCOL>
__device__ void mma(float* C, int ldc, const __nv_bfloat16* A, int lda, const __nv_bfloat16* B, int ldb, int M, int N,
                    int K, bool acc) {
#if __CUDA_ARCH__ >= 800
  using namespace nvcuda;
  using LA = typename std::conditional<ACOL, wmma::col_major, wmma::row_major>::type;
  using LB = typename std::conditional<BCOL, wmma::col_major, wmma::row_major>::type;
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5, nt = N / 16;
  for (int t = warp; t < (M / 16) * nt; t += nw) {
    const int ti = t / nt, tj = t % nt;
    float* c = C + ti * 16 * ldc + tj * 16;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> f;
    if (acc) wmma::load_matrix_sync(f, c, ldc, wmma::mem_row_major);
    else wmma::fill_fragment(f, 0.0f);
    for (int k = 0; k < K; k += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LA> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, LB> b;
      wmma::load_matrix_sync(a, ACOL ? A + k * lda + ti * 16 : A + ti * 16 * lda + k, lda);
      wmma::load_matrix_sync(b, BCOL ? B + tj * 16 * ldb + k : B + k * ldb + tj * 16, ldb);
      wmma::mma_sync(f, a, b, f);
    }
    wmma::store_matrix_sync(c, f, ldc, wmma::mem_row_major);
  }
#endif
}

__global__ void __launch_bounds__(kThr) fwd_kernel(float* __restrict__ out, float* __restrict__ lse,
                                                   const float* __restrict__ q, const float* __restrict__ k,
                                                   const float* __restrict__ v, DeviceAttnDims d) {
  extern __shared__ __align__(128) char smem[];
  const Lay L = lay(d);
  Carve cv{smem};
  auto* Qs = cv.take<__nv_bfloat16>(TQ * L.lq);
  auto* Ks = cv.take<__nv_bfloat16>(TK * L.lq);
  auto* Vs = cv.take<__nv_bfloat16>(TK * L.lv);
  auto* Ps = cv.take<__nv_bfloat16>(TQ * LP);
  float* S = cv.take<float>(TQ * TK);
  float* PV = cv.take<float>(TQ * L.Dvp);
  float* Os = cv.take<float>(TQ * L.Dvp);
  float* mrow = cv.take<float>(TQ);
  float* lrow = cv.take<float>(TQ);
  float* arow = cv.take<float>(TQ);
  const int64_t b = blockIdx.z, h = blockIdx.y, t0 = int64_t(blockIdx.x) * TQ, T = d.T;
  const int64_t hk = h / (d.Hq / d.Hkv);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nw = blockDim.x >> 5;
  load_bf(Qs, L.lq, q + b * T * d.ldq + h * d.head_q, d.ldq, t0, TQ, L.Dq, L.Dqp, T);
  for (int idx = tid; idx < TQ * L.Dvp; idx += blockDim.x) Os[idx] = 0.0f;
  for (int i = tid; i < TQ; i += blockDim.x) mrow[i] = -INFINITY, lrow[i] = 0.0f;
  const int64_t s_end = T < t0 + TQ ? T : t0 + TQ;
  for (int64_t s0 = 0; s0 < s_end; s0 += TK) {
    __syncthreads();
    load_bf(Ks, L.lq, k + b * T * d.ldk + hk * d.head_k, d.ldk, s0, TK, L.Dq, L.Dqp, T);
    load_bf(Vs, L.lv, v + b * T * d.ldv + hk * d.head_v, d.ldv, s0, TK, L.Dv, L.Dvp, T);
    __syncthreads();
    mma<false, true>(S, TK, Qs, L.lq, Ks, L.lq, TQ, TK, L.Dqp, false);  // S = Q K^T
    __syncthreads();
    for (int i = warp; i < TQ; i += nw) {  // one warp per row, one lane per key (TK = 32)
      const int64_t t = t0 + i, s = s0 + lane;
      const float x = (t < T && s <= t) ? d.scale * S[i * TK + lane] : -INFINITY;
      const float mold = mrow[i], mnew = fmaxf(mold, dev::warp_max(x));
      if (mnew == -INFINITY) {
        Ps[i * LP + lane] = dev::to_bf(0.0f);
        if (lane == 0) arow[i] = 1.0f;
        continue;
      }
      const float p = expf(x - mnew);
      Ps[i * LP + lane] = dev::to_bf(p);
      const float ps = dev::warp_sum(p);
      if (lane == 0) {
        const float a = expf(mold - mnew);
        lrow[i] = lrow[i] * a + ps;
        mrow[i] = mnew;
        arow[i] = a;
      }
    }
    __syncthreads();
    mma<false, false>(PV, L.Dvp, Ps, LP, Vs, L.lv, TQ, L.Dvp, TK, false);  // PV = P V
    __syncthreads();
    for (int idx = tid; idx < TQ * L.Dvp; idx += blockDim.x) Os[idx] = Os[idx] * arow[idx / L.Dvp] + PV[idx];
  }
  __syncthreads();
  for (int idx = tid; idx < TQ * L.Dv; idx += blockDim.x) {
    const int i = idx / L.Dv, e = idx % L.Dv;
    const int64_t t = t0 + i;
    if (t < T) out[(b * T + t) * d.ldo + h * d.head_o + e] = Os[i * L.Dvp + e] / lrow[i];
  }
  for (int i = tid; i < TQ; i += blockDim.x)
    if (t0 + i < T) lse[(b * d.Hq + h) * T + t0 + i] = mrow[i] + logf(lrow[i]);
}

// From S = q k^T and dP = dO v^T of the current tiles (fp32), P and dS (rounded to bf16 into Ps, dSs); 0 masked.
__device__ void p_ds_tile(__nv_bfloat16* Ps, __nv_bfloat16* dSs, const float* S, const float* dP, const float* Ls,
                          const float* Ds, float scale, int64_t t0, int64_t s0, int64_t T) {
  for (int idx = threadIdx.x; idx < TQ * TK; idx += blockDim.x) {
    const int i = idx / TK, j = idx % TK;
    const int64_t t = t0 + i, s = s0 + j;
    float p = 0.0f, ds = 0.0f;
    if (t < T && s <= t) {
      p = expf(scale * S[idx] - Ls[i]);
      ds = p * (dP[idx] - Ds[i]) * scale;
    }
    Ps[i * LP + j] = dev::to_bf(p);
    dSs[i * LP + j] = dev::to_bf(ds);
  }
}

__device__ void load_ld(float* Ls, float* Ds, const float* lse, const float* D, int64_t row0, int64_t t0, int64_t T) {
  for (int i = threadIdx.x; i < TQ; i += blockDim.x) {
    const bool ok = t0 + i < T;
    Ls[i] = ok ? lse[row0 + t0 + i] : 0.0f;
    Ds[i] = ok ? D[row0 + t0 + i] : 0.0f;
  }
}

// dk, dv of TK keys of kv head hk (grid: key tiles, Hkv, B).
__global__ void __launch_bounds__(kThr) dkv_kernel(float* __restrict__ dk, float* __restrict__ dv,
                                                   const float* __restrict__ dout, const float* __restrict__ lse,
                                                   const float* __restrict__ D, const float* __restrict__ q,
                                                   const float* __restrict__ k, const float* __restrict__ v,
                                                   DeviceAttnDims d) {
  extern __shared__ __align__(128) char smem[];
  const Lay L = lay(d);
  Carve cv{smem};
  auto* Ks = cv.take<__nv_bfloat16>(TK * L.lq);
  auto* Vs = cv.take<__nv_bfloat16>(TK * L.lv);
  auto* Qs = cv.take<__nv_bfloat16>(TQ * L.lq);
  auto* dOs = cv.take<__nv_bfloat16>(TQ * L.lv);
  auto* Ps = cv.take<__nv_bfloat16>(TQ * LP);
  auto* dSs = cv.take<__nv_bfloat16>(TQ * LP);
  float* dKs = cv.take<float>(TK * L.Dqp);
  float* dVs = cv.take<float>(TK * L.Dvp);
  float* S = cv.take<float>(TQ * TK);
  float* dP = cv.take<float>(TQ * TK);
  float* Ls = cv.take<float>(TQ);
  float* Ds = cv.take<float>(TQ);
  const int64_t b = blockIdx.z, hk = blockIdx.y, s0 = int64_t(blockIdx.x) * TK, T = d.T, G = d.Hq / d.Hkv;
  const int tid = threadIdx.x;
  load_bf(Ks, L.lq, k + b * T * d.ldk + hk * d.head_k, d.ldk, s0, TK, L.Dq, L.Dqp, T);
  load_bf(Vs, L.lv, v + b * T * d.ldv + hk * d.head_v, d.ldv, s0, TK, L.Dv, L.Dvp, T);
  for (int idx = tid; idx < TK * L.Dqp; idx += blockDim.x) dKs[idx] = 0.0f;
  for (int idx = tid; idx < TK * L.Dvp; idx += blockDim.x) dVs[idx] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hk * G + g;
    for (int64_t t0 = s0; t0 < T; t0 += TQ) {  // TQ == TK: the first query tile holding keys' rows
      __syncthreads();
      load_bf(Qs, L.lq, q + b * T * d.ldq + h * d.head_q, d.ldq, t0, TQ, L.Dq, L.Dqp, T);
      load_bf(dOs, L.lv, dout + b * T * d.ldo + h * d.head_o, d.ldo, t0, TQ, L.Dv, L.Dvp, T);
      load_ld(Ls, Ds, lse, D, (b * d.Hq + h) * T, t0, T);
      __syncthreads();
      mma<false, true>(S, TK, Qs, L.lq, Ks, L.lq, TQ, TK, L.Dqp, false);     // S = Q K^T
      mma<false, true>(dP, TK, dOs, L.lv, Vs, L.lv, TQ, TK, L.Dvp, false);   // dP = dO V^T
      __syncthreads();
      p_ds_tile(Ps, dSs, S, dP, Ls, Ds, d.scale, t0, s0, T);
      __syncthreads();
      mma<true, false>(dVs, L.Dvp, Ps, LP, dOs, L.lv, TK, L.Dvp, TQ, true);  // dV += P^T dO
      mma<true, false>(dKs, L.Dqp, dSs, LP, Qs, L.lq, TK, L.Dqp, TQ, true);  // dK += dS^T Q
    }
  }
  __syncthreads();
  for (int idx = tid; idx < TK * L.Dq; idx += blockDim.x) {
    const int j = idx / L.Dq, e = idx % L.Dq;
    if (s0 + j < T) dk[(b * T + s0 + j) * d.ldk + hk * d.head_k + e] = dKs[j * L.Dqp + e];
  }
  for (int idx = tid; idx < TK * L.Dv; idx += blockDim.x) {
    const int j = idx / L.Dv, e = idx % L.Dv;
    if (s0 + j < T) dv[(b * T + s0 + j) * d.ldv + hk * d.head_v + e] = dVs[j * L.Dvp + e];
  }
}

// dq of TQ queries of q head h (grid: query tiles, Hq, B).
__global__ void __launch_bounds__(kThr) dq_kernel(float* __restrict__ dq, const float* __restrict__ dout,
                                                  const float* __restrict__ lse, const float* __restrict__ D,
                                                  const float* __restrict__ q, const float* __restrict__ k,
                                                  const float* __restrict__ v, DeviceAttnDims d) {
  extern __shared__ __align__(128) char smem[];
  const Lay L = lay(d);
  Carve cv{smem};
  auto* Qs = cv.take<__nv_bfloat16>(TQ * L.lq);
  auto* dOs = cv.take<__nv_bfloat16>(TQ * L.lv);
  auto* Ks = cv.take<__nv_bfloat16>(TK * L.lq);
  auto* Vs = cv.take<__nv_bfloat16>(TK * L.lv);
  auto* Ps = cv.take<__nv_bfloat16>(TQ * LP);
  auto* dSs = cv.take<__nv_bfloat16>(TQ * LP);
  float* dQs = cv.take<float>(TQ * L.Dqp);
  float* S = cv.take<float>(TQ * TK);
  float* dP = cv.take<float>(TQ * TK);
  float* Ls = cv.take<float>(TQ);
  float* Ds = cv.take<float>(TQ);
  const int64_t b = blockIdx.z, h = blockIdx.y, t0 = int64_t(blockIdx.x) * TQ, T = d.T;
  const int64_t hk = h / (d.Hq / d.Hkv);
  const int tid = threadIdx.x;
  load_bf(Qs, L.lq, q + b * T * d.ldq + h * d.head_q, d.ldq, t0, TQ, L.Dq, L.Dqp, T);
  load_bf(dOs, L.lv, dout + b * T * d.ldo + h * d.head_o, d.ldo, t0, TQ, L.Dv, L.Dvp, T);
  load_ld(Ls, Ds, lse, D, (b * d.Hq + h) * T, t0, T);
  for (int idx = tid; idx < TQ * L.Dqp; idx += blockDim.x) dQs[idx] = 0.0f;
  const int64_t s_end = T < t0 + TQ ? T : t0 + TQ;
  for (int64_t s0 = 0; s0 < s_end; s0 += TK) {
    __syncthreads();
    load_bf(Ks, L.lq, k + b * T * d.ldk + hk * d.head_k, d.ldk, s0, TK, L.Dq, L.Dqp, T);
    load_bf(Vs, L.lv, v + b * T * d.ldv + hk * d.head_v, d.ldv, s0, TK, L.Dv, L.Dvp, T);
    __syncthreads();
    mma<false, true>(S, TK, Qs, L.lq, Ks, L.lq, TQ, TK, L.Dqp, false);
    mma<false, true>(dP, TK, dOs, L.lv, Vs, L.lv, TQ, TK, L.Dvp, false);
    __syncthreads();
    p_ds_tile(Ps, dSs, S, dP, Ls, Ds, d.scale, t0, s0, T);
    __syncthreads();
    mma<false, false>(dQs, L.Dqp, dSs, LP, Ks, L.lq, TQ, L.Dqp, TK, true);  // dQ += dS K
  }
  __syncthreads();
  for (int idx = tid; idx < TQ * L.Dq; idx += blockDim.x) {
    const int i = idx / L.Dq, e = idx % L.Dq;
    if (t0 + i < T) dq[(b * T + t0 + i) * d.ldq + h * d.head_q + e] = dQs[i * L.Dqp + e];
  }
}

size_t fwd_bytes(const DeviceAttnDims& d) {
  const Lay L = lay(d);
  const size_t b2 = 2, b4 = 4;
  return al(TQ * L.lq * b2) + al(TK * L.lq * b2) + al(TK * L.lv * b2) + al(TQ * LP * b2) + al(TQ * TK * b4) +
         2 * al(TQ * L.Dvp * b4) + 3 * al(TQ * b4);
}
size_t dkv_bytes(const DeviceAttnDims& d) {
  const Lay L = lay(d);
  const size_t b2 = 2, b4 = 4;
  return al(TK * L.lq * b2) + al(TK * L.lv * b2) + al(TQ * L.lq * b2) + al(TQ * L.lv * b2) + 2 * al(TQ * LP * b2) +
         al(TK * L.Dqp * b4) + al(TK * L.Dvp * b4) + 2 * al(TQ * TK * b4) + 2 * al(TQ * b4);
}
size_t dq_bytes(const DeviceAttnDims& d) {
  const Lay L = lay(d);
  const size_t b2 = 2, b4 = 4;
  return al(TQ * L.lq * b2) + al(TQ * L.lv * b2) + al(TK * L.lq * b2) + al(TK * L.lv * b2) + 2 * al(TQ * LP * b2) +
         al(TQ * L.Dqp * b4) + 2 * al(TQ * TK * b4) + 2 * al(TQ * b4);
}

size_t bwd_bytes(const DeviceAttnDims& d) { return dkv_bytes(d) > dq_bytes(d) ? dkv_bytes(d) : dq_bytes(d); }

void forward(float* out, float* lse, const float* q, const float* k, const float* v, const DeviceAttnDims& d,
             cudaStream_t st) {
  const char* op = "cuda.attention_forward (bf16, tensor cores)";
  const size_t bytes = fwd_bytes(d);
  detail::smem_optin(reinterpret_cast<const void*>(&fwd_kernel), bytes, op);
  const dim3 grid(unsigned((d.T + TQ - 1) / TQ), unsigned(d.Hq), unsigned(d.B));
  fwd_kernel<<<grid, kThr, bytes, st>>>(out, lse, q, k, v, d);
  MT_CUDA_LAUNCHED("attn_wmma::fwd_kernel");
}

void backward(float* dq, float* dk, float* dv, const float* dout, const float* lse, const float* D, const float* q,
              const float* k, const float* v, const DeviceAttnDims& d, cudaStream_t st) {
  const char* op = "cuda.attention_backward (bf16, tensor cores)";
  const size_t b1 = dkv_bytes(d), b2 = dq_bytes(d);
  detail::smem_optin(reinterpret_cast<const void*>(&dkv_kernel), b1, op);
  detail::smem_optin(reinterpret_cast<const void*>(&dq_kernel), b2, op);
  dkv_kernel<<<dim3(unsigned((d.T + TK - 1) / TK), unsigned(d.Hkv), unsigned(d.B)), kThr, b1, st>>>(
      dk, dv, dout, lse, D, q, k, v, d);
  MT_CUDA_LAUNCHED("attn_wmma::dkv_kernel");
  dq_kernel<<<dim3(unsigned((d.T + TQ - 1) / TQ), unsigned(d.Hq), unsigned(d.B)), kThr, b2, st>>>(dq, dout, lse, D, q,
                                                                                                   k, v, d);
  MT_CUDA_LAUNCHED("attn_wmma::dq_kernel");
}

}  // namespace moetron::cuda::attn_wmma
