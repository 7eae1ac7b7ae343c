// muon.cpp: the Muon kernels of muon.h: the momentum update, Newton-Schulz on fp32 through gemm_f32 (three GEMMs
// per iteration), the scale and the decoupled-decay apply. Element-wise loops are plain C++ (this file is built
// without FMA, so the compiler does not contract them: the twins' bits); the GEMMs carry the ISA's accumulation.
// Not the trainer's Muon (src/train/muon_state.cpp: which matrices, where their momentum lives, the gathers).
#include "moetron/muon.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moetron/check.h"
#include "moetron/trace.h"

namespace moetron {

float muon_scale(int64_t rows, int64_t cols) {
  MT_CHECK(rows > 0 && cols > 0, "muon", "matrix of ", rows, " x ", cols);
  return float(kMuonRms * std::sqrt(double(std::max(rows, cols))));
}

void muon_momentum(float* m, float* x, const float* g, int64_t n, float mu, bool nesterov, float grad_scale) {
  MT_CHECK(n >= 0, "muon_momentum", "negative size n=", n);
  if (n == 0) return;
  MT_CHECK(m && x && g, "muon_momentum", "null pointer");
  MT_CHECK(std::isfinite(grad_scale), "muon_momentum", "grad_scale must be finite, got ", grad_scale);
  MT_TRACE_COST(5.0 * double(n), 16.0 * double(n));
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    const float mi = mu * m[i] + gi;
    m[i] = mi;
    x[i] = nesterov ? gi + mu * mi : mi;
  }
}

int64_t muon_ns_workspace(int64_t rows, int64_t cols) {
  const int64_t m = std::min(rows, cols), n = std::max(rows, cols);
  return 2 * m * n + 2 * m * m;
}

void newton_schulz(float* X, int64_t rows, int64_t cols, int64_t ldx, int steps, float scale, float* work) {
  MT_CHECK(rows > 0 && cols > 0 && ldx >= cols, "newton_schulz", "matrix of ", rows, " x ", cols, " with ldx ", ldx);
  MT_CHECK(X && work, "newton_schulz", "null pointer");
  MT_CHECK(steps >= 0, "newton_schulz", "steps must be >= 0, got ", steps);
  const bool tr = rows > cols;
  const int64_t m = tr ? cols : rows, n = tr ? rows : cols;
  MT_TRACE_COST(double(steps) * 2.0 * (2.0 * double(m) * double(m) * double(n) + double(m) * double(m) * double(m)),
                4.0 * double(steps) * (3.0 * double(m) * double(n) + 4.0 * double(m) * double(m)));
  float* Y = work;
  float* Z = Y + m * n;
  float* A = Z + m * n;
  float* B = A + m * m;
  if (tr) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) Y[i * n + j] = X[j * ldx + i];
  } else {
    for (int64_t i = 0; i < m; ++i) std::memcpy(Y + i * n, X + i * ldx, size_t(n) * 4);
  }
  const float inv = float(1.0 / (std::sqrt(grad_norm_sq(Y, m * n)) + kMuonNsEps));
  for (int64_t i = 0; i < m * n; ++i) Y[i] = Y[i] * inv;
  for (int s = 0; s < steps; ++s) {
    gemm_f32(Trans::N, Trans::T, m, m, n, 1.0f, Y, n, Y, n, 0.0f, A, m);  // A = Y Y^T
    std::memcpy(B, A, size_t(m * m) * 4);
    gemm_f32(Trans::N, Trans::N, m, m, m, kMuonNsC, A, m, A, m, kMuonNsB, B, m);  // B = b A + c A A
    std::memcpy(Z, Y, size_t(m * n) * 4);
    gemm_f32(Trans::N, Trans::N, m, n, m, 1.0f, B, m, Y, n, kMuonNsA, Z, n);  // Z = a Y + B Y
    std::swap(Y, Z);
  }
  if (tr) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) X[j * ldx + i] = Y[i * n + j] * scale;
  } else {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) X[i * ldx + j] = Y[i * n + j] * scale;
  }
}

void muon_apply(float* w, const float* u, int64_t n, float lr, float weight_decay, bool decay) {
  MT_CHECK(n >= 0, "muon_apply", "negative size n=", n);
  if (n == 0) return;
  MT_CHECK(w && u, "muon_apply", "null pointer");
  MT_TRACE_COST(3.0 * double(n), 12.0 * double(n));
  const float d = float(1.0 - double(lr) * double(weight_decay));
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float wi = decay ? w[i] * d : w[i];
    w[i] = wi - lr * u[i];
  }
}

}  // namespace moetron
