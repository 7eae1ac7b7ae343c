// norm.h: RMSNorm over the last dimension, forward and backward, and the naive reference twins.
//   y[n, c] = x[n, c] * rstd[n] * w[c],   rstd[n] = 1 / sqrt(mean_c(x[n, c]^2) + eps)
// Row-wise and batch invariant: a row's y, rstd and dx depend only on that row. The weight gradient
// dw is reduced over rows in fixed row blocks whose partials are combined in block order, so it is
// bitwise identical for any OpenMP thread count. Not LayerNorm (no mean subtraction, no bias).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "moetron/dtype.h"

namespace moetron {

// y16 (optional, may be nullptr) receives y rounded to bf16 for a following bf16 GEMM.
void rmsnorm_forward(float* y /* [N, C] */, bf16* y16 /* [N, C] or nullptr */, float* rstd /* [N] */,
                     const float* x /* [N, C] */, const float* w /* [C] */, int64_t N, int64_t C, float eps);

// dx is overwritten; dw is accumulated (+=). `ws` is optional scratch of rmsnorm_backward_workspace_bytes(N, C)
// bytes (64-byte aligned); with nullptr the kernel allocates it itself.
void rmsnorm_backward(float* dx /* [N, C] */, float* dw /* [C], += */, const float* dy /* [N, C] */,
                      const float* x /* [N, C] */, const float* w /* [C] */, const float* rstd /* [N] */, int64_t N,
                      int64_t C, void* ws = nullptr);
size_t rmsnorm_backward_workspace_bytes(int64_t N, int64_t C);

// Data and weight gradient separately (zero-bubble schedules run them at different times). Together they
// do what rmsnorm_backward does; dw here is reduced in the same fixed row blocks, so the results match it.
void rmsnorm_backward_data(float* dx /* [N, C] */, const float* dy /* [N, C] */, const float* x /* [N, C] */,
                           const float* w /* [C] */, const float* rstd /* [N] */, int64_t N, int64_t C);
void rmsnorm_backward_weight(float* dw /* [C], += */, const float* dy /* [N, C] */, const float* x /* [N, C] */,
                             const float* rstd /* [N] */, int64_t N, int64_t C, void* ws = nullptr);

// ---- naive references (float or double), written for clarity ----

template <class T>
void rmsnorm_forward_ref(T* y /* [N, C] */, T* rstd /* [N] */, const T* x /* [N, C] */, const T* w /* [C] */,
                         int64_t N, int64_t C, T eps) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    T ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
    T r = T(1) / std::sqrt(ss / T(C) + eps);
    rstd[n] = r;
    for (int64_t c = 0; c < C; ++c) y[n * C + c] = xr[c] * r * w[c];
  }
}

// dx = rstd * (w*dy - xhat * mean(w*dy*xhat)),  xhat = x * rstd;  dw += sum_n dy * xhat.
template <class T>
void rmsnorm_backward_ref(T* dx /* [N, C] */, T* dw /* [C], += */, const T* dy /* [N, C] */, const T* x /* [N, C] */,
                          const T* w /* [C] */, const T* rstd /* [N] */, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    const T* dyr = dy + n * C;
    T r = rstd[n];
    T dot = 0;
    for (int64_t c = 0; c < C; ++c) dot += w[c] * dyr[c] * xr[c] * r;
    dot /= T(C);
    for (int64_t c = 0; c < C; ++c) {
      T xhat = xr[c] * r;
      dx[n * C + c] = r * (w[c] * dyr[c] - xhat * dot);
      dw[c] += dyr[c] * xhat;
    }
  }
}

}  // namespace moetron
