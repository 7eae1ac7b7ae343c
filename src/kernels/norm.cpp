// norm.cpp: RMSNorm forward/backward drivers: input checks, OpenMP over rows, the fixed row blocking of
// the dw reduction, and the portable row kernels. The AVX-512 and AVX2 row kernels are in norm_avx512.cpp and
// norm_avx2.cpp and are chosen by active_isa(). Not the reference (that is rmsnorm_*_ref in norm.h).
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "moetron/check.h"
#include "moetron/norm.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

// AVX-512 row kernels (norm_avx512.cpp).
namespace norm_avx512 {
void rmsnorm_fwd_row(float* y, bf16* y16, float* rstd, const float* x, const float* w, int64_t C, float eps);
void rmsnorm_bwd_row(float* dx, float* dwacc, const float* dy, const float* x, const float* w, float r, int64_t C);
void rmsnorm_dw_row(float* dwacc, const float* dy, const float* x, float r, int64_t C);
void add_rows(float* acc, const float* x, int64_t n);
}  // namespace norm_avx512
// AVX2 row kernels (norm_avx2.cpp), the same signatures.
namespace norm_avx2 {
void rmsnorm_fwd_row(float* y, bf16* y16, float* rstd, const float* x, const float* w, int64_t C, float eps);
void rmsnorm_bwd_row(float* dx, float* dwacc, const float* dy, const float* x, const float* w, float r, int64_t C);
void rmsnorm_dw_row(float* dwacc, const float* dy, const float* x, float r, int64_t C);
void add_rows(float* acc, const float* x, int64_t n);
}  // namespace norm_avx2

namespace {

void fwd_row(float* y, bf16* y16, float* rstd, const float* x, const float* w, int64_t C, float eps) {
  // Four partial sums (interleaved by c mod 4) keep the loop short and the rounding error ~ log(C).
  float s[4] = {0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 4 <= C; c += 4)
    for (int j = 0; j < 4; ++j) s[j] += x[c + j] * x[c + j];
  for (; c < C; ++c) s[0] += x[c] * x[c];
  float ss = (s[0] + s[1]) + (s[2] + s[3]);
  float r = 1.0f / std::sqrt(ss / float(C) + eps);
  *rstd = r;
  for (c = 0; c < C; ++c) y[c] = x[c] * r * w[c];
  if (y16)
    for (c = 0; c < C; ++c) y16[c] = to_bf16(y[c]);
}

void bwd_row(float* dx, float* dwacc, const float* dy, const float* x, const float* w, float r, int64_t C) {
  float s[4] = {0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 4 <= C; c += 4)
    for (int j = 0; j < 4; ++j) s[j] += w[c + j] * dy[c + j] * (x[c + j] * r);
  for (; c < C; ++c) s[0] += w[c] * dy[c] * (x[c] * r);
  float dot = ((s[0] + s[1]) + (s[2] + s[3])) / float(C);
  for (c = 0; c < C; ++c) {
    float xhat = x[c] * r;
    dx[c] = r * (w[c] * dy[c] - xhat * dot);
    if (dwacc) dwacc[c] += dy[c] * xhat;
  }
}

void dw_row(float* dwacc, const float* dy, const float* x, float r, int64_t C) {
  for (int64_t c = 0; c < C; ++c) dwacc[c] += dy[c] * (x[c] * r);
}

void add_rows(float* acc, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

// dw is reduced over fixed row blocks: the block count depends on N only (never on the thread count),
// at most kMaxBlocks so the partials stay small (kMaxBlocks * C floats).
constexpr int64_t kMaxBlocks = 64, kMinRowsPerBlock = 16;
// Below this many elements one thread is faster than waking a team (results do not depend on it).
constexpr int64_t kParallelMin = 32768;
int64_t num_blocks(int64_t N) { return std::max<int64_t>(1, std::min(kMaxBlocks, (N + kMinRowsPerBlock - 1) / kMinRowsPerBlock)); }
int64_t pad16(int64_t C) { return (C + 15) / 16 * 16; }

void check_common(const char* op, int64_t N, int64_t C) {
  MT_CHECK(N >= 0, op, "N=", N, " is negative");
  MT_CHECK(C > 0, op, "C=", C, " must be positive");
}

// Fused dx (optional) and dw over the fixed row blocks: partial[blk] = sum over its rows in row order,
// then dw[c] += partial[0][c] + partial[1][c] + ... in block order.
void backward_impl(const char* op, float* dx, float* dw, const float* dy, const float* x, const float* w,
                   const float* rstd, int64_t N, int64_t C, void* ws) {
  // Per element: about 4 flops for dx, 2 for dw; dy and x read, dx written, dw's partials.
  MT_TRACE_COST(double(N * C) * ((dx ? 4.0 : 0.0) + (dw ? 2.0 : 0.0)),
                double(N * C) * (8.0 + (dx ? 4.0 : 0.0)) + (dw ? 4.0 * double(C) : 0.0));
  const Isa isa = active_isa();
  const int64_t nblk = num_blocks(N), rows = (N + nblk - 1) / nblk, ldp = pad16(C);
  std::unique_ptr<float[]> own;
  float* part = static_cast<float*>(ws);
  if (dw && !part) {
    own.reset(new float[size_t(nblk * ldp)]);
    part = own.get();
  }
#pragma omp parallel if (N * C >= kParallelMin)
  {
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblk; ++blk) {
      float* acc = dw ? part + blk * ldp : nullptr;
      if (acc) std::memset(acc, 0, sizeof(float) * size_t(C));
      for (int64_t n = blk * rows; n < std::min(N, (blk + 1) * rows); ++n) {
        const float* dyr = dy + n * C;
        const float* xr = x + n * C;
        if (dx) {
          if (isa == Isa::Avx512) norm_avx512::rmsnorm_bwd_row(dx + n * C, acc, dyr, xr, w, rstd[n], C);
          else if (isa == Isa::Avx2) norm_avx2::rmsnorm_bwd_row(dx + n * C, acc, dyr, xr, w, rstd[n], C);
          else bwd_row(dx + n * C, acc, dyr, xr, w, rstd[n], C);
        } else {
          if (isa == Isa::Avx512) norm_avx512::rmsnorm_dw_row(acc, dyr, xr, rstd[n], C);
          else if (isa == Isa::Avx2) norm_avx2::rmsnorm_dw_row(acc, dyr, xr, rstd[n], C);
          else dw_row(acc, dyr, xr, rstd[n], C);
        }
      }
    }
    if (dw) {
      // Combine the partials in block order, columns split across threads in chunks of 256.
      const int64_t chunks = (C + 255) / 256;
#pragma omp for schedule(static)
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const int64_t c0 = ch * 256, nc = std::min<int64_t>(256, C - c0);
        for (int64_t blk = 0; blk < nblk && blk * rows < N; ++blk) {
          if (isa == Isa::Avx512) norm_avx512::add_rows(dw + c0, part + blk * ldp + c0, nc);
          else if (isa == Isa::Avx2) norm_avx2::add_rows(dw + c0, part + blk * ldp + c0, nc);
          else add_rows(dw + c0, part + blk * ldp + c0, nc);
        }
      }
    }
  }
}

}  // namespace

void rmsnorm_forward(float* y, bf16* y16, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps) {
  check_common("rmsnorm_forward", N, C);
  MT_CHECK(eps >= 0.0f, "rmsnorm_forward", "eps=", eps, " is negative");
  if (N == 0) return;
  MT_CHECK(y && rstd && x && w, "rmsnorm_forward", "null pointer (y, rstd, x and w are required)");
  // Per element: square-add, scale, weight (about 4 flops); x read, y (and its bf16 copy) written.
  MT_TRACE_COST(4.0 * double(N * C), double(N * C) * (8.0 + (y16 ? 2.0 : 0.0)) + 4.0 * double(C + N));
  const Isa isa = active_isa();
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    bf16* y16r = y16 ? y16 + n * C : nullptr;
    if (isa == Isa::Avx512) norm_avx512::rmsnorm_fwd_row(y + n * C, y16r, rstd + n, x + n * C, w, C, eps);
    else if (isa == Isa::Avx2) norm_avx2::rmsnorm_fwd_row(y + n * C, y16r, rstd + n, x + n * C, w, C, eps);
    else fwd_row(y + n * C, y16r, rstd + n, x + n * C, w, C, eps);
  }
}

size_t rmsnorm_backward_workspace_bytes(int64_t N, int64_t C) {
  check_common("rmsnorm_backward_workspace_bytes", N, C);
  return sizeof(float) * size_t(num_blocks(N) * pad16(C));
}

void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t N, int64_t C, void* ws) {
  check_common("rmsnorm_backward", N, C);
  if (N == 0) return;
  MT_CHECK(dx && dw && dy && x && w && rstd, "rmsnorm_backward", "null pointer (all arguments but ws are required)");
  backward_impl("rmsnorm_backward", dx, dw, dy, x, w, rstd, N, C, ws);
}

void rmsnorm_backward_data(float* dx, const float* dy, const float* x, const float* w, const float* rstd, int64_t N,
                           int64_t C) {
  check_common("rmsnorm_backward_data", N, C);
  if (N == 0) return;
  MT_CHECK(dx && dy && x && w && rstd, "rmsnorm_backward_data", "null pointer");
  backward_impl("rmsnorm_backward_data", dx, nullptr, dy, x, w, rstd, N, C, nullptr);
}

void rmsnorm_backward_weight(float* dw, const float* dy, const float* x, const float* rstd, int64_t N, int64_t C,
                             void* ws) {
  check_common("rmsnorm_backward_weight", N, C);
  if (N == 0) return;
  MT_CHECK(dw && dy && x && rstd, "rmsnorm_backward_weight", "null pointer");
  backward_impl("rmsnorm_backward_weight", nullptr, dw, dy, x, nullptr, rstd, N, C, ws);
}

}  // namespace moetron
