// grouped_gemm_wmma.cu: the MoE expert GEMMs over all experts in one launch each (cuda/gemm.h), with the per-expert
// counts read on the device: a one-block kernel turns counts into row offsets and tile offsets, and each block of
// the GEMM finds its expert by a binary search over the tile offsets; blocks past the last tile exit. The grid is
// sized by the bound sum_e ceil(m_e / BM) <= ceil(M / BM) + E, so the host never reads the counts.
// The tile: BM x BN = 64 x 64 outputs per block of 4 warps, each warp 32 x 32 through WMMA 16x16x16 bf16 fragments
// with fp32 accumulators, K in steps of 32 staged through shared memory (zero-filled past the edges).
// Correct first: plain loads, no cp.async / TMA / wgmma pipeline yet (docs/gpu.md lists that as the next step).
#include <mma.h>

#include "cuda_common.cuh"
#include "moetron/cuda/gemm.h"

namespace moetron::cuda {
namespace {

constexpr int BM = 64, BN = 64, BK = 32, kThreads = 128;
constexpr int LDA = BK + 8, LDB = BN + 8, LDC = BN + 4;

// A(i, k) = a[i * a_rs + k * a_cs] for i < rows; B(k, j) = b[k * b_rs + j * b_cs] for j < cols.
struct View {
  const __nv_bfloat16* p;
  int64_t rs, cs;
};

// C[i, j] (+)= sum_k A(i, k) B(k, j) for i < rows, j < cols, k < Kred; C row stride ldc.
__device__ void tile_gemm(float* C, int64_t ldc, int rows, int cols, View A, View B, int64_t Kred, bool accumulate) {
#if __CUDA_ARCH__ >= 800
  using namespace nvcuda;
  __shared__ __align__(32) __nv_bfloat16 As[BM * LDA];
  __shared__ __align__(32) __nv_bfloat16 Bs[BK * LDB];
  __shared__ __align__(32) float Cs[BM * LDC];
  const int tid = threadIdx.x, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  const __nv_bfloat16 zero = __float2bfloat16(0.0f);
  for (int64_t k0 = 0; k0 < Kred; k0 += BK) {
    // A tile [BM, BK]: walk along whichever of A's dimensions is contiguous, so neighbouring threads read neighbours.
    for (int idx = tid; idx < BM * BK; idx += kThreads) {
      int i, k;
      if (A.cs == 1) i = idx / BK, k = idx % BK;
      else i = idx % BM, k = idx / BM;
      As[i * LDA + k] = (i < rows && k0 + k < Kred) ? A.p[int64_t(i) * A.rs + (k0 + k) * A.cs] : zero;
    }
    for (int idx = tid; idx < BK * BN; idx += kThreads) {
      int k, j;
      if (B.cs == 1) k = idx / BN, j = idx % BN;
      else k = idx % BK, j = idx / BK;
      Bs[k * LDB + j] = (j < cols && k0 + k < Kred) ? B.p[(k0 + k) * B.rs + int64_t(j) * B.cs] : zero;
    }
    __syncthreads();
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb[2];
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], As + (wm * 32 + i * 16) * LDA + kk, LDA);
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], Bs + kk * LDB + wn * 32 + j * 16, LDB);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(Cs + (wm * 32 + i * 16) * LDC + wn * 32 + j * 16, acc[i][j], LDC, wmma::mem_row_major);
  __syncthreads();
  for (int idx = tid; idx < BM * BN; idx += kThreads) {
    const int i = idx / BN, j = idx % BN;
    if (i < rows && j < cols) {
      float* c = C + int64_t(i) * ldc + j;
      *c = accumulate ? *c + Cs[i * LDC + j] : Cs[i * LDC + j];
    }
  }
#endif
}

// off[e] = rows before expert e (clamped to M), tile_off[e] = m-tiles before expert e. One thread: E is small.
__global__ void offsets_kernel(int64_t* off, int64_t* tile_off, const int32_t* counts, int64_t E, int64_t M) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t r = 0, t = 0;
  for (int64_t e = 0; e < E; ++e) {
    off[e] = r;
    tile_off[e] = t;
    const int64_t c = counts[e] > 0 ? counts[e] : 0;
    const int64_t next = r + c < M ? r + c : M;
    t += (next - r + BM - 1) / BM;
    r = next;
  }
  off[E] = r;
  tile_off[E] = t;
}

__device__ int64_t expert_of_tile(const int64_t* tile_off, int64_t E, int64_t tile) {
  int64_t lo = 0, hi = E;  // the last e with tile_off[e] <= tile
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (tile_off[mid] <= tile) lo = mid;
    else hi = mid;
  }
  return lo;
}

// mode 0: forward  Y_e[m, N] = X_e[m, K] · W_e[K, N]
// mode 1: dgrad    dX_e[m, K] = dY_e[m, N] · W_e^T
__global__ void __launch_bounds__(kThreads) grouped_mgrouped_kernel(float* out, const __nv_bfloat16* act,
                                                                    const __nv_bfloat16* W, const int64_t* off,
                                                                    const int64_t* tile_off, int64_t E, int64_t K,
                                                                    int64_t N, int mode) {
  const int64_t tile = blockIdx.x;
  if (tile >= tile_off[E]) return;
  const int64_t e = expert_of_tile(tile_off, E, tile);
  const int64_t row0 = off[e] + (tile - tile_off[e]) * BM;
  const int rows = int(min(int64_t(BM), off[e + 1] - row0));
  const __nv_bfloat16* We = W + e * K * N;
  if (mode == 0) {
    const int64_t j0 = int64_t(blockIdx.y) * BN;
    if (j0 >= N) return;
    tile_gemm(out + row0 * N + j0, N, rows, int(min(int64_t(BN), N - j0)), View{act + row0 * K, K, 1},
              View{We + j0, N, 1}, K, false);
  } else {
    const int64_t j0 = int64_t(blockIdx.y) * BN;  // over K
    if (j0 >= K) return;
    tile_gemm(out + row0 * K + j0, K, rows, int(min(int64_t(BN), K - j0)), View{act + row0 * N, N, 1},
              View{We + j0 * N, 1, N}, N, false);
  }
}

// dW[e][K, N] (+)= X_e^T · dY_e; grid (K tiles, N tiles, E).
__global__ void __launch_bounds__(kThreads) grouped_wgrad_kernel(float* dW, const __nv_bfloat16* X,
                                                                 const __nv_bfloat16* dY, const int64_t* off, int64_t K,
                                                                 int64_t N, bool accumulate) {
  const int64_t e = blockIdx.z, i0 = int64_t(blockIdx.x) * BM, j0 = int64_t(blockIdx.y) * BN;
  const int64_t r0 = off[e], me = off[e + 1] - off[e];
  tile_gemm(dW + e * K * N + i0 * N + j0, N, int(min(int64_t(BM), K - i0)), int(min(int64_t(BN), N - j0)),
            View{X + r0 * K + i0, 1, K}, View{dY + r0 * N + j0, N, 1}, me, accumulate);
}

void check(const char* op, int64_t E, int64_t M, int64_t K, int64_t N, const void* ws) {
  MT_CUDA_ARG(E >= 1 && M >= 0 && K >= 1 && N >= 1, op, "needs E >= 1, M >= 0, K >= 1, N >= 1");
  MT_CUDA_ARG(ws != nullptr, op, "needs a workspace of grouped_gemm_workspace_bytes(E)");
  MT_CUDA_ARG((M + BM - 1) / BM + E < int64_t(INT32_MAX), op, "too many row tiles for one launch");
}

void offsets(const int32_t* counts, int64_t E, int64_t M, void* ws, cudaStream_t st) {
  auto* off = static_cast<int64_t*>(ws);
  offsets_kernel<<<1, 32, 0, st>>>(off, off + E + 1, counts, E, M);
  MT_CUDA_LAUNCHED("offsets_kernel");
}

}  // namespace

size_t grouped_gemm_workspace_bytes(int64_t E) { return size_t(2 * (E + 1)) * sizeof(int64_t); }

void grouped_gemm_fwd(float* Y, const bf16* X, const bf16* W, const int32_t* counts, int64_t E, int64_t M, int64_t K,
                      int64_t N, void* ws, void* stream) {
  check("cuda.grouped_gemm_fwd", E, M, K, N, ws);
  if (M == 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  offsets(counts, E, M, ws, st);
  auto* off = static_cast<int64_t*>(ws);
  dim3 grid(unsigned((M + BM - 1) / BM + E), unsigned((N + BN - 1) / BN));
  grouped_mgrouped_kernel<<<grid, kThreads, 0, st>>>(Y, reinterpret_cast<const __nv_bfloat16*>(X),
                                                      reinterpret_cast<const __nv_bfloat16*>(W), off, off + E + 1, E,
                                                      K, N, 0);
  MT_CUDA_LAUNCHED("grouped_mgrouped_kernel(fwd)");
}

void grouped_gemm_dgrad(float* dX, const bf16* dY, const bf16* W, const int32_t* counts, int64_t E, int64_t M,
                        int64_t K, int64_t N, void* ws, void* stream) {
  check("cuda.grouped_gemm_dgrad", E, M, K, N, ws);
  if (M == 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  offsets(counts, E, M, ws, st);
  auto* off = static_cast<int64_t*>(ws);
  dim3 grid(unsigned((M + BM - 1) / BM + E), unsigned((K + BN - 1) / BN));
  grouped_mgrouped_kernel<<<grid, kThreads, 0, st>>>(dX, reinterpret_cast<const __nv_bfloat16*>(dY),
                                                      reinterpret_cast<const __nv_bfloat16*>(W), off, off + E + 1, E,
                                                      K, N, 1);
  MT_CUDA_LAUNCHED("grouped_mgrouped_kernel(dgrad)");
}

void grouped_gemm_wgrad(float* dW, const bf16* X, const bf16* dY, const int32_t* counts, int64_t E, int64_t M,
                        int64_t K, int64_t N, bool accumulate, void* ws, void* stream) {
  check("cuda.grouped_gemm_wgrad", E, M, K, N, ws);
  auto st = static_cast<cudaStream_t>(stream);
  offsets(counts, E, M, ws, st);
  dim3 grid(unsigned((K + BM - 1) / BM), unsigned((N + BN - 1) / BN), unsigned(E));
  grouped_wgrad_kernel<<<grid, kThreads, 0, st>>>(dW, reinterpret_cast<const __nv_bfloat16*>(X),
                                                   reinterpret_cast<const __nv_bfloat16*>(dY),
                                                   static_cast<int64_t*>(ws), K, N, accumulate);
  MT_CUDA_LAUNCHED("grouped_wgrad_kernel");
}

}  // namespace moetron::cuda
