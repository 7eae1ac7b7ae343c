// muon.h: the arithmetic of one Muon step on one weight matrix (Keller Jordan's Muon, scaled as in Moonlight:
// "Muon is Scalable for LLM Training", Liu et al. 2025): the momentum update, the Newton-Schulz orthogonalization
// (the quintic iteration with the published coefficients, on fp32 through the batch-invariant gemm_f32), the RMS
// matching scale and the decoupled weight decay, each with a reference twin (float: the kernel's bits; double:
// the independent check).
// Not an optimizer object: which tensors are Muon matrices (muon_params.h), where the momentum lives and how it is
// gathered under ZeRO-1 / FSDP (src/train/muon_state.cpp) and the AdamW part (optim.h) are elsewhere.
//
// One step of a matrix W [rows, cols] with gradient G (grad_scale: the clip coefficient), in this order:
//   gi = G * grad_scale;   M = mu * M + gi;   X = nesterov ? gi + mu * M : M          (element-wise, fp32)
//   O  = NS_k(X)                                                                       (k = ns_steps)
//   U  = O * muon_scale(rows, cols)                                                    (fp32)
//   W  = W * (1 - lr * wd)   (decay: decoupled weight decay, where the parameter decays)
//   W  = W - lr * U
// NS_k: Y = X / (||X||_F + 1e-7) (transposed first when rows > cols, so Y is [m, n] with m <= n), then k times
//   A = Y Y^T;  B = b A + c A A;  Y = a Y + B Y        with (a, b, c) = (3.4445, -4.7750, 2.0315)
// (transposed back). Each iteration maps every singular value s of Y to p(s) = a s + b s^3 + c s^5 and keeps the
// singular vectors, so NS_k(X) = U p^k(S / ||X||_F) V^T for X = U S V^T: the quintic pushes singular values in
// (0, 1] into a band around 1 (about 0.7 .. 1.2) within 5 steps rather than to 1 exactly (Keller Jordan's choice:
// the largest slope at 0 that still keeps the band).
// Scale: Moonlight's 0.2 * sqrt(max(rows, cols)) ("Muon is Scalable for LLM Training", Liu et al. 2025, sec. 2.2):
// an orthogonal [A, B] matrix has RMS 1 / sqrt(max(A, B)), and 0.2 is the RMS of a typical AdamW update, so Muon
// reuses AdamW's learning rate and weight decay.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "moetron/gemm.h"
#include "moetron/optim.h"

namespace moetron {

inline constexpr float kMuonNsA = 3.4445f, kMuonNsB = -4.7750f, kMuonNsC = 2.0315f;
inline constexpr double kMuonNsEps = 1e-7;  // added to ||X||_F before the division
inline constexpr double kMuonRms = 0.2;     // Moonlight's update RMS

// 0.2 * sqrt(max(rows, cols)), rounded to float once.
float muon_scale(int64_t rows, int64_t cols);

// Element-wise, n elements: gi = g * grad_scale; m = mu * m + gi; x = nesterov ? gi + mu * m : m. x may alias g.
void muon_momentum(float* m /* [n] */, float* x /* [n] */, const float* g /* [n] */, int64_t n, float mu,
                   bool nesterov, float grad_scale);

// Floats of workspace newton_schulz needs for a rows x cols matrix: 2 m n + 2 m^2 (m = min, n = max).
int64_t muon_ns_workspace(int64_t rows, int64_t cols);
// X [rows, cols] (leading dimension ldx >= cols) := NS_steps(X) * scale, in place. work: muon_ns_workspace floats.
// Bitwise independent of the thread count (gemm_f32 is); the same bits on the AVX2 and AVX-512 paths.
void newton_schulz(float* X, int64_t rows, int64_t cols, int64_t ldx, int steps, float scale, float* work);

// Element-wise: w = decay ? w * float(1 - lr * wd) : w; w = w - lr * u.
void muon_apply(float* w /* [n] */, const float* u /* [n] */, int64_t n, float lr, float weight_decay, bool decay);

// ---- reference twins ----
// fused: the products accumulate with fma (the AVX2 / AVX-512 gemm_f32), else multiply then add (the scalar ISA);
// beta != 0 is added with one rounding, fma(beta, C, sum), on every ISA (gemm_f32's epilogue).
// T = float with the active ISA's `fused` reproduces newton_schulz bitwise; T = double is the independent check.
template <class T>
void matmul_twin(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
                 T beta, T* C, int64_t ldc, bool fused) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      T acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const T a = ta ? A[k * lda + i] : A[i * lda + k], b = tb ? B[j * ldb + k] : B[k * ldb + j];
        acc = fused ? std::fma(a, b, acc) : acc + a * b;
      }
      T& c = C[i * ldc + j];
      c = beta == T(0) ? acc : std::fma(beta, c, acc);  // gemm_f32's epilogue: one rounding on every ISA
    }
}

template <class T>
void newton_schulz_ref(T* X, int64_t rows, int64_t cols, int64_t ldx, int steps, T scale, bool fused = true) {
  const bool tr = rows > cols;
  const int64_t m = tr ? cols : rows, n = tr ? rows : cols;
  std::vector<T> Y(size_t(m * n)), Z(size_t(m * n)), A(size_t(m * m)), B(size_t(m * m));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) Y[size_t(i * n + j)] = tr ? X[j * ldx + i] : X[i * ldx + j];
  double sq = 0;
  if constexpr (sizeof(T) == 4) {
    sq = grad_norm_sq(Y.data(), m * n);  // the kernel's (tested) sum of squares, for the bits
  } else {
    for (const T& y : Y) sq += double(y) * double(y);
  }
  const T inv = T(1.0 / (std::sqrt(sq) + kMuonNsEps));
  for (T& y : Y) y = y * inv;
  for (int s = 0; s < steps; ++s) {
    matmul_twin<T>(false, true, m, m, n, Y.data(), n, Y.data(), n, T(0), A.data(), m, fused);
    B = A;  // B = b A + c (A A): as the kernel's gemm (alpha = c, beta = b): fma(b, A, c * sum)
    std::vector<T> AA(size_t(m * m));
    matmul_twin<T>(false, false, m, m, m, A.data(), m, A.data(), m, T(0), AA.data(), m, fused);
    for (size_t q = 0; q < AA.size(); ++q) {
      const T ca = T(kMuonNsC) * AA[q];
      B[q] = std::fma(T(kMuonNsB), B[q], ca);
    }
    Z = Y;
    matmul_twin<T>(false, false, m, n, m, B.data(), m, Y.data(), n, T(kMuonNsA), Z.data(), n, fused);
    std::swap(Y, Z);
  }
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const T v = Y[size_t(i * n + j)] * scale;
      (tr ? X[j * ldx + i] : X[i * ldx + j]) = v;
    }
}

// The whole Muon step of one matrix in T, from the formulas above (T = double: the independent check). col_segs:
// the matrix's column segments, each orthogonalized on its own ([rows, seg], scale muon_scale(rows, seg)); empty =
// one segment of all columns.
template <class T>
void muon_update_ref(T* w, T* mom, const T* g, int64_t rows, int64_t cols, std::vector<int64_t> col_segs, T mu,
                     bool nesterov, int steps, T grad_scale, T lr, T wd, bool decay) {
  const int64_t n = rows * cols;
  std::vector<T> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const T gi = g[i] * grad_scale;
    mom[i] = mu * mom[i] + gi;
    x[size_t(i)] = nesterov ? gi + mu * mom[i] : mom[i];
  }
  if (col_segs.empty()) col_segs = {cols};
  int64_t c0 = 0;
  for (int64_t seg : col_segs) {
    const T scale = T(kMuonRms) * std::sqrt(T(std::max(rows, seg)));
    newton_schulz_ref<T>(x.data() + c0, rows, seg, cols, steps, scale);
    c0 += seg;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (decay) w[i] -= lr * wd * w[i];
    w[i] -= lr * x[size_t(i)];
  }
}

}  // namespace moetron
