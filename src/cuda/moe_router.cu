// moe_router.cu: the MoE router on the GPU (cuda/moe.h), the device twin of router.h's forward selection, weights,
// counts, backward of the weights, and the aux-loss-free bias update. One warp per token; a token's scores and
// selection scores live in shared memory; top-k and the group choice are k (topk_group) rounds of a warp argmax
// under router.h's order (larger value first, equal values to the lower index), so given the same scores the
// selection is exactly router_select_ref's. Not the aux / z losses, Sinkhorn or capacity routing.
#include "cuda_common.cuh"
#include "moetron/cuda/moe.h"

namespace moetron::cuda {
namespace {

constexpr int kWarps = 4;  // tokens per block

struct Cand {
  float v;
  int i;  // -1: none
};
// router.h's order: a before b iff a.v > b.v, or equal values and a lower index. "none" is after everything.
__device__ __forceinline__ bool before(const Cand& a, const Cand& b) {
  if (a.i < 0) return false;
  if (b.i < 0) return true;
  return a.v > b.v || (a.v == b.v && a.i < b.i);
}
__device__ __forceinline__ Cand warp_best(Cand c) {
  for (int o = 16; o > 0; o >>= 1) {
    Cand d;
    d.v = __shfl_xor_sync(0xffffffffu, c.v, o);
    d.i = __shfl_xor_sync(0xffffffffu, c.i, o);
    if (before(d, c)) c = d;
  }
  return c;
}

// Shared memory per warp: s [E], q [E], taken/eligible flags [E] (int8), group flags [n_group] (int8).
__global__ void router_fwd_kernel(int32_t* __restrict__ topk_idx, float* __restrict__ topk_w,
                                  int32_t* __restrict__ counts, float* __restrict__ scores,
                                  const float* __restrict__ logits, const float* __restrict__ bias,
                                  DeviceRouterConfig cfg, int64_t N) {
  extern __shared__ unsigned char smem_raw[];
  const int E = cfg.E, k = cfg.topk, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const size_t per_warp = size_t(E) * 8 + size_t(E) + size_t(cfg.n_group);
  unsigned char* base = smem_raw + warp * ((per_warp + 15) / 16 * 16);
  float* s = reinterpret_cast<float*>(base);
  float* q = s + E;
  signed char* ok = reinterpret_cast<signed char*>(q + E);  // 1 eligible, 0 not, -1 taken
  signed char* gok = ok + E;
  const int64_t n = int64_t(blockIdx.x) * kWarps + warp;
  if (n >= N) return;  // whole warps leave together
  const float* l = logits + n * E;
  if (!cfg.sigmoid) {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, l[e]);
    m = dev::warp_max(m);
    float z = 0;
    for (int e = lane; e < E; e += 32) z += expf(l[e] - m);
    z = dev::warp_sum(z);
    for (int e = lane; e < E; e += 32) s[e] = expf(l[e] - m) / z;
  } else {
    for (int e = lane; e < E; e += 32) s[e] = 1.0f / (1.0f + expf(-l[e]));
  }
  for (int e = lane; e < E; e += 32) {
    q[e] = __fadd_rn(s[e], bias ? bias[e] : 0.0f);
    scores[n * E + e] = s[e];
    ok[e] = 1;
  }
  __syncwarp();
  if (cfg.n_group > 1) {
    const int G = E / cfg.n_group;
    // Group scores: each lane takes whole groups; the top two of a group by the same order. topk_group rounds of
    // a warp argmax over the groups not yet kept.
    for (int g = lane; g < cfg.n_group; g += 32) gok[g] = 0;
    __syncwarp();
    for (int r = 0; r < cfg.topk_group; ++r) {
      Cand best{0.0f, -1};
      for (int g = lane; g < cfg.n_group; g += 32) {
        if (gok[g]) continue;
        Cand a{0.0f, -1}, b{0.0f, -1};
        for (int j = 0; j < G; ++j) {
          const Cand c{q[g * G + j], g * G + j};
          if (before(c, a)) b = a, a = c;
          else if (before(c, b)) b = c;
        }
        const float score = cfg.group_top2sum && G >= 2 ? a.v + b.v : a.v;
        const Cand cg{score, g};
        if (before(cg, best)) best = cg;
      }
      best = warp_best(best);
      if (lane == 0) gok[best.i] = 1;
      __syncwarp();
    }
    for (int e = lane; e < E; e += 32) ok[e] = gok[e / G] ? 1 : 0;
    __syncwarp();
  }
  float sum = 0;
  for (int j = 0; j < k; ++j) {
    Cand best{0.0f, -1};
    for (int e = lane; e < E; e += 32)
      if (ok[e] == 1) {
        const Cand c{q[e], e};
        if (before(c, best)) best = c;
      }
    best = warp_best(best);
    if (lane == 0) {
      ok[best.i] = -1;
      topk_idx[n * k + j] = best.i;
      sum += s[best.i];  // slot order, as the reference
      atomicAdd(counts + best.i, 1);
    }
    __syncwarp();
  }
  if (lane == 0)
    for (int j = 0; j < k; ++j) {
      const float sj = s[topk_idx[n * k + j]];
      topk_w[n * k + j] = cfg.route_scale * (cfg.norm_topk ? sj / (sum + 1e-20f) : sj);
    }
}

__global__ void router_bwd_kernel(float* __restrict__ dlogits, const float* __restrict__ dw,
                                  const float* __restrict__ scores, const int32_t* __restrict__ topk_idx,
                                  DeviceRouterConfig cfg, int64_t N) {
  extern __shared__ float ds_all[];
  const int E = cfg.E, k = cfg.topk, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* ds = ds_all + warp * E;
  const int64_t n = int64_t(blockIdx.x) * kWarps + warp;
  if (n >= N) return;
  const float* s = scores + n * E;
  const int32_t* idx = topk_idx + n * k;
  const float* g = dw + n * k;
  for (int e = lane; e < E; e += 32) ds[e] = 0.0f;
  __syncwarp();
  if (lane == 0) {
    const float rs = cfg.route_scale;
    if (cfg.norm_topk) {
      float S = 0, gs = 0;
      for (int j = 0; j < k; ++j) S += s[idx[j]];
      S += 1e-20f;
      for (int j = 0; j < k; ++j) gs += g[j] * s[idx[j]];
      for (int j = 0; j < k; ++j) ds[idx[j]] += rs * (g[j] / S - gs / (S * S));
    } else {
      for (int j = 0; j < k; ++j) ds[idx[j]] += rs * g[j];
    }
  }
  __syncwarp();
  float* dl = dlogits + n * E;
  if (!cfg.sigmoid) {
    float dot = 0;
    for (int e = lane; e < E; e += 32) dot += ds[e] * s[e];
    dot = dev::warp_sum(dot);
    for (int e = lane; e < E; e += 32) dl[e] = s[e] * (ds[e] - dot);
  } else {
    for (int e = lane; e < E; e += 32) dl[e] = ds[e] * s[e] * (1.0f - s[e]);
  }
}

__global__ void update_bias_kernel(float* __restrict__ bias, const int32_t* __restrict__ counts, int E, float rate) {
  __shared__ long long total;
  if (threadIdx.x == 0) {
    long long t = 0;
    for (int e = 0; e < E; ++e) t += counts[e];
    total = t;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const long long d = total - (long long)E * counts[e];
    bias[e] += d > 0 ? rate : d < 0 ? -rate : 0.0f;
  }
}

size_t fwd_smem(const DeviceRouterConfig& c) {
  const size_t per_warp = size_t(c.E) * 8 + size_t(c.E) + size_t(c.n_group);
  return kWarps * ((per_warp + 15) / 16 * 16);
}

void check_cfg(const DeviceRouterConfig& c, int64_t N, const char* op) {
  MT_CUDA_ARG(c.E >= 1 && c.E <= kDeviceRouterMaxExperts, op, "needs 1 <= E <= kDeviceRouterMaxExperts (1024)");
  MT_CUDA_ARG(c.topk >= 1 && c.topk <= c.E, op, "needs 1 <= topk <= E");
  MT_CUDA_ARG(c.n_group >= 1 && c.E % c.n_group == 0, op, "needs n_group >= 1 dividing E");
  MT_CUDA_ARG(c.topk_group >= 1 && c.topk_group <= c.n_group, op, "needs 1 <= topk_group <= n_group");
  MT_CUDA_ARG(c.topk <= c.topk_group * (c.E / c.n_group), op, "needs topk <= topk_group * E / n_group");
  MT_CUDA_ARG(c.route_scale > 0, op, "needs route_scale > 0");
  MT_CUDA_ARG(N >= 0 && N / kWarps < int64_t(INT32_MAX), op, "needs 0 <= N < 2^31 * 4");
}

}  // namespace

void router_forward(int32_t* topk_idx, float* topk_w, int32_t* counts, float* scores, const float* logits,
                    const float* bias, const DeviceRouterConfig& cfg, int64_t N, void* stream) {
  check_cfg(cfg, N, "cuda.router_forward");
  auto st = static_cast<cudaStream_t>(stream);
  MT_CUDA_CHECK(cudaMemsetAsync(counts, 0, size_t(cfg.E) * sizeof(int32_t), st));
  if (N == 0) return;
  router_fwd_kernel<<<unsigned((N + kWarps - 1) / kWarps), kWarps * 32, fwd_smem(cfg), st>>>(
      topk_idx, topk_w, counts, scores, logits, bias, cfg, N);
  MT_CUDA_LAUNCHED("router_fwd_kernel");
}

void router_backward(float* dlogits, const float* dtopk_w, const float* scores, const int32_t* topk_idx,
                     const DeviceRouterConfig& cfg, int64_t N, void* stream) {
  check_cfg(cfg, N, "cuda.router_backward");
  if (N == 0) return;
  router_bwd_kernel<<<unsigned((N + kWarps - 1) / kWarps), kWarps * 32, size_t(kWarps) * cfg.E * sizeof(float),
                      static_cast<cudaStream_t>(stream)>>>(dlogits, dtopk_w, scores, topk_idx, cfg, N);
  MT_CUDA_LAUNCHED("router_bwd_kernel");
}

void router_update_bias(float* bias, const int32_t* counts, int E, float rate, void* stream) {
  MT_CUDA_ARG(E >= 1 && bias && counts, "cuda.router_update_bias", "needs E >= 1, bias and counts");
  update_bias_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(bias, counts, E, rate);
  MT_CUDA_LAUNCHED("update_bias_kernel");
}

}  // namespace moetron::cuda
