// xent_fused.cu: the fused linear cross-entropy on the GPU (cuda/loss.h), the device twin of loss.h's linear_xent:
// chunked logits GEMM through cuBLAS, one row kernel per chunk (softmax, row loss, dlogits in place or as bf16),
// the two backward GEMMs through cuBLAS, and a fixed-order sum of the fp64 row losses. Not vocabulary-sharded.
#include <type_traits>

#include "cuda_common.cuh"
#include "moetron/cuda/gemm.h"
#include "moetron/cuda/loss.h"

namespace moetron::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float block_max_f(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = dev::warp_max(v);
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float r = lane < nw ? smem[lane] : -INFINITY;
  return dev::warp_max(r);
}

// One block per row of the chunk. z [rows, V] fp32; dlogits go to z (d16 == null) or to d16 [rows, V] (bf16).
__global__ void xent_rows_kernel(float* __restrict__ z, __nv_bfloat16* __restrict__ d16,
                                 double* __restrict__ row_loss, const int32_t* __restrict__ targets, int64_t V,
                                 float loss_scale, bool want_grad) {
  __shared__ float smf[32];
  __shared__ double smd[32];
  const int64_t n = blockIdx.x;
  float* zr = z + n * V;
  const int32_t t = targets[n];
  if (t < 0 || t >= V) {  // ignored row; a target >= V (the device cannot throw) is ignored too
    if (threadIdx.x == 0) row_loss[n] = 0.0;
    if (want_grad)
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
        if (d16) d16[n * V + v] = dev::to_bf(0.0f);
        else zr[v] = 0.0f;
      }
    return;
  }
  float mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, zr[v]);
  mx = block_max_f(mx, smf);
  double sum = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) sum += double(expf(zr[v] - mx));
  sum = dev::block_sum(sum, smd);
  const float lse = mx + float(log(sum));
  if (threadIdx.x == 0) row_loss[n] = double(lse) - double(zr[t]);
  if (!want_grad) return;
  __syncthreads();  // zr[t] read above before it is overwritten
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float g = (expf(zr[v] - lse) - (v == t ? 1.0f : 0.0f)) * loss_scale;
    if (d16) d16[n * V + v] = dev::to_bf(g);
    else zr[v] = g;
  }
}

// loss = loss_scale * sum of row_loss, one block, fixed order.
__global__ void xent_sum_kernel(double* __restrict__ loss, const double* __restrict__ row_loss, int64_t N,
                                float loss_scale) {
  __shared__ double sm[32];
  double acc = 0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) acc += row_loss[n];
  acc = dev::block_sum(acc, sm);
  if (threadIdx.x == 0) *loss = acc * double(loss_scale);
}

constexpr int64_t kDefaultChunk = 4096;
constexpr int64_t kMaxLogitBytes = int64_t(256) << 20;

size_t align256(size_t b) { return (b + 255) / 256 * 256; }

// p + n for float and for the incomplete moetron::bf16 (2 bytes, __nv_bfloat16's layout).
const float* adv(const float* p, int64_t n) { return p + n; }
const bf16* adv(const bf16* p, int64_t n) {
  return reinterpret_cast<const bf16*>(reinterpret_cast<const __nv_bfloat16*>(p) + n);
}

template <class T>
void run(double* loss, double* row_loss, float* dh, float* dW, const T* h, const T* W, const int32_t* targets,
         int64_t N, int64_t C, int64_t V, float loss_scale, int64_t chunk_rows, void* ws, void* stream,
         const char* op) {
  constexpr bool kBf16 = std::is_same<T, bf16>::value;
  MT_CUDA_ARG(N >= 0 && C >= 1 && V >= 1, op, "needs N >= 0, C >= 1, V >= 1");
  MT_CUDA_ARG(V < int64_t(INT32_MAX), op, "needs V < 2^31 (int32 targets)");
  MT_CUDA_ARG((dh == nullptr) == (dW == nullptr), op, "takes dh and dW both or neither (forward only)");
  MT_CUDA_ARG(ws != nullptr && loss != nullptr, op, "needs loss and a workspace of linear_xent_workspace_bytes");
  auto st = static_cast<cudaStream_t>(stream);
  const int64_t ch = linear_xent_chunk_rows(N, V, chunk_rows);
  char* p = static_cast<char*>(ws);
  float* z = reinterpret_cast<float*>(p);
  p += align256(size_t(ch * V) * sizeof(float));
  auto* d16 = reinterpret_cast<__nv_bfloat16*>(p);
  p += align256(size_t(ch * V) * sizeof(__nv_bfloat16));
  double* rl = row_loss ? row_loss : reinterpret_cast<double*>(p);
  const bool grad = dh != nullptr;
  for (int64_t n0 = 0; n0 < N; n0 += ch) {
    const int64_t rows = N - n0 < ch ? N - n0 : ch;
    if constexpr (kBf16)
      gemm_bf16(Op::N, Op::T, rows, V, C, 1.0f, adv(h, n0 * C), C, W, C, 0.0f, z, V, stream);
    else
      gemm_f32(Op::N, Op::T, rows, V, C, 1.0f, adv(h, n0 * C), C, W, C, 0.0f, z, V, stream);
    xent_rows_kernel<<<unsigned(rows), kThreads, 0, st>>>(z, kBf16 ? d16 : nullptr, rl + n0, targets + n0, V,
                                                           loss_scale, grad);
    MT_CUDA_LAUNCHED("xent_rows_kernel");
    if (!grad) continue;
    if constexpr (kBf16) {
      const bf16* g = reinterpret_cast<const bf16*>(d16);
      gemm_bf16(Op::N, Op::N, rows, C, V, 1.0f, g, V, W, C, 0.0f, dh + n0 * C, C, stream);
      gemm_bf16(Op::T, Op::N, V, C, rows, 1.0f, g, V, adv(h, n0 * C), C, 1.0f, dW, C, stream);
    } else {
      gemm_f32(Op::N, Op::N, rows, C, V, 1.0f, z, V, W, C, 0.0f, dh + n0 * C, C, stream);
      gemm_f32(Op::T, Op::N, V, C, rows, 1.0f, z, V, adv(h, n0 * C), C, 1.0f, dW, C, stream);
    }
  }
  xent_sum_kernel<<<1, 1024, 0, st>>>(loss, rl, N, loss_scale);
  MT_CUDA_LAUNCHED("xent_sum_kernel");
}

}  // namespace

int64_t linear_xent_chunk_rows(int64_t N, int64_t V, int64_t chunk_rows) {
  int64_t ch = chunk_rows > 0 ? chunk_rows : kDefaultChunk;
  if (chunk_rows <= 0)
    while (ch > 16 && ch * V * int64_t(sizeof(float)) > kMaxLogitBytes) ch /= 2;
  if (N > 0 && ch > N) ch = N;
  return ch < 1 ? 1 : ch;
}

size_t linear_xent_workspace_bytes(int64_t N, int64_t V, int64_t chunk_rows) {
  const int64_t ch = linear_xent_chunk_rows(N, V, chunk_rows);
  return align256(size_t(ch * V) * sizeof(float)) + align256(size_t(ch * V) * sizeof(__nv_bfloat16)) +
         align256(size_t(N > 0 ? N : 1) * sizeof(double));
}

void linear_xent_bf16(double* loss, double* row_loss, float* dh, float* dW, const bf16* h, const bf16* W,
                      const int32_t* targets, int64_t N, int64_t C, int64_t V, float loss_scale, int64_t chunk_rows,
                      void* ws, void* stream) {
  run<bf16>(loss, row_loss, dh, dW, h, W, targets, N, C, V, loss_scale, chunk_rows, ws, stream,
            "cuda.linear_xent_bf16");
}

void linear_xent_f32(double* loss, double* row_loss, float* dh, float* dW, const float* h, const float* W,
                     const int32_t* targets, int64_t N, int64_t C, int64_t V, float loss_scale, int64_t chunk_rows,
                     void* ws, void* stream) {
  run<float>(loss, row_loss, dh, dW, h, W, targets, N, C, V, loss_scale, chunk_rows, ws, stream,
             "cuda.linear_xent_f32");
}

}  // namespace moetron::cuda
