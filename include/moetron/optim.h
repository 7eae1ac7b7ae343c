// optim.h: the AdamW step on fp32 master weights and state, and the global gradient norm used for
// gradient clipping. Element-wise and bandwidth bound; AVX-512 with a scalar fallback that computes
// bitwise the same values (same operation order, no FMA contraction).
// Not an optimizer object: parameter groups, LR schedules and which tensors decay live in src/train.
#pragma once
#include <cmath>
#include <cstdint>

namespace moetron {

struct AdamWConfig {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

// Per-step scalars shared by the kernel and its reference twin (computed once, in double).
struct AdamWScalars {
  float b1, one_minus_b1, b2, one_minus_b2;
  float decay;         // 1 - lr * weight_decay (param *= decay where decay applies)
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
  float eps;
};
AdamWScalars adamw_scalars(const AdamWConfig& c, int64_t step);  // checks step >= 1 and the config

// One AdamW step (t = step, 1-based) for one tensor of n elements, in this order per element:
//   gi = g * grad_scale                       (grad_scale: clip coefficient, and/or 1/loss-scale)
//   m  = b1 * m + (1 - b1) * gi
//   v  = b2 * v + (1 - b2) * (gi * gi)
//   p  = p * (1 - lr * wd)                    (only if apply_decay: decoupled weight decay)
//   p  = p - step_size * (m / (sqrt(v) * inv_sqrt_bc2 + eps))
// which is PyTorch's AdamW with bias correction folded into step_size and the denominator.
void adamw_step(float* p /* [n] */, float* m /* [n] */, float* v /* [n] */, const float* g /* [n] */, int64_t n,
                const AdamWConfig& c, int64_t step, float grad_scale, bool apply_decay);

// Sum of squares of g in double, bitwise independent of the thread count and of the ISA:
// blocks of kNormBlock elements are summed with 16 striped double lanes (element i of a block goes to
// lane i % 16; exact squares, lanes combined by a fixed pairwise tree), block sums are added in order
// into at most kNormChunks chunk sums (a chunk is a fixed run of blocks that depends on n only), and the
// chunk sums are added in order.
inline constexpr int64_t kNormBlock = 4096;
inline constexpr int kNormChunks = 256;
double grad_norm_sq(const float* g /* [n] */, int64_t n);
// The same over many tensors, summed in the order given: sqrt of the result is the global norm.
double grad_norm_sq_multi(const float* const* gs /* [count][ns[i]] */, const int64_t* ns /* [count] */,
                          int64_t count);

// Clip coefficient for a global norm: min(1, max_norm / (norm + 1e-6)); max_norm <= 0 disables (1).
// A non-finite norm returns NaN: the caller must check std::isfinite(norm) and skip the step.
float clip_coefficient(double total_norm, double max_norm);

// ---- reference twins (clarity first; T = float reproduces the kernel bitwise, T = double is exact-ish) ----

template <class T>
void adamw_step_ref(T* p, T* m, T* v, const T* g, int64_t n, const AdamWScalars& s, T grad_scale,
                    bool apply_decay) {
  for (int64_t i = 0; i < n; ++i) {
    T gi = g[i] * grad_scale;
    m[i] = T(s.b1) * m[i] + T(s.one_minus_b1) * gi;
    v[i] = T(s.b2) * v[i] + T(s.one_minus_b2) * (gi * gi);
    if (apply_decay) p[i] = p[i] * T(s.decay);
    T denom = std::sqrt(v[i]) * T(s.inv_sqrt_bc2) + T(s.eps);
    p[i] = p[i] - T(s.step_size) * (m[i] / denom);
  }
}

// Textbook AdamW in double straight from the config (no folded scalars): the independent check.
inline void adamw_step_textbook(double* p, double* m, double* v, const double* g, int64_t n, const AdamWConfig& c,
                                int64_t step, double grad_scale, bool apply_decay) {
  double bc1 = 1.0 - std::pow(double(c.beta1), double(step));
  double bc2 = 1.0 - std::pow(double(c.beta2), double(step));
  for (int64_t i = 0; i < n; ++i) {
    double gi = g[i] * grad_scale;
    m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * gi;
    v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * gi * gi;
    if (apply_decay) p[i] -= double(c.lr) * c.weight_decay * p[i];
    double mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= c.lr * mhat / (std::sqrt(vhat) + c.eps);
  }
}

template <class T>
T grad_norm_sq_ref(const T* g, int64_t n) {
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += g[i] * g[i];
  return s;
}

}  // namespace moetron
