// optim.cpp: AdamW step and global gradient norm: argument checks, the per-step scalars, the scalar
// path and the dispatch to optim_avx512.cpp and optim_avx2.cpp (AdamW, norm). The scalar and vector
// paths compute bitwise the same results (same operation order; the vector files use non-contracting
// intrinsics).
// Not an optimizer object (see src/train).
#include "moetron/optim.h"

#include <cmath>
#include <limits>

#include "moetron/check.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

namespace optim_avx512 {
void adamw_range(float* p, float* m, float* v, const float* g, int64_t n, const AdamWScalars& s, float grad_scale,
                 bool apply_decay);
double norm_block(const float* g, int64_t n);
}  // namespace optim_avx512
namespace optim_avx2 {
void adamw_range(float* p, float* m, float* v, const float* g, int64_t n, const AdamWScalars& s, float grad_scale,
                 bool apply_decay);
double norm_block(const float* g, int64_t n);
}  // namespace optim_avx2

namespace {

constexpr int64_t kAdamWParallelMin = 1 << 15;  // below this a parallel region costs more than it saves
constexpr int64_t kAdamWGrain = 1 << 12;        // elements per work item (a multiple of 16)

void adamw_range_scalar(float* p, float* m, float* v, const float* g, int64_t n, const AdamWScalars& s,
                        float grad_scale, bool apply_decay) {
  adamw_step_ref<float>(p, m, v, g, n, s, grad_scale, apply_decay);
}

// Sum of squares of one block (n <= kNormBlock): 16 striped double lanes, fixed pairwise lane tree.
double norm_block_scalar(const float* g, int64_t n) {
  double lane[16] = {};
  for (int64_t i = 0; i < n; ++i) {
    double x = double(g[i]);
    lane[i & 15] += x * x;  // the square of a float is exact in double
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] = lane[j] + lane[j + w];
  return lane[0];
}

}  // namespace

AdamWScalars adamw_scalars(const AdamWConfig& c, int64_t step) {
  MT_CHECK(step >= 1, "adamw_step", "step is 1-based, got ", step);
  MT_CHECK(c.beta1 >= 0.0f && c.beta1 < 1.0f, "adamw_step", "beta1 must be in [0, 1), got ", c.beta1);
  MT_CHECK(c.beta2 >= 0.0f && c.beta2 < 1.0f, "adamw_step", "beta2 must be in [0, 1), got ", c.beta2);
  MT_CHECK(c.eps > 0.0f, "adamw_step", "eps must be > 0, got ", c.eps);
  MT_CHECK(c.lr >= 0.0f && std::isfinite(c.lr), "adamw_step", "lr must be finite and >= 0, got ", c.lr);
  MT_CHECK(c.weight_decay >= 0.0f && std::isfinite(c.weight_decay), "adamw_step",
           "weight_decay must be finite and >= 0, got ", c.weight_decay);
  double b1 = c.beta1, b2 = c.beta2;
  double bc1 = 1.0 - std::pow(b1, double(step));
  double bc2 = 1.0 - std::pow(b2, double(step));
  AdamWScalars s;
  s.b1 = c.beta1;
  s.one_minus_b1 = float(1.0 - b1);
  s.b2 = c.beta2;
  s.one_minus_b2 = float(1.0 - b2);
  s.decay = float(1.0 - double(c.lr) * double(c.weight_decay));
  s.step_size = float(double(c.lr) / bc1);
  s.inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  s.eps = c.eps;
  return s;
}

void adamw_step(float* p, float* m, float* v, const float* g, int64_t n, const AdamWConfig& c, int64_t step,
                float grad_scale, bool apply_decay) {
  MT_CHECK(n >= 0, "adamw_step", "negative size n=", n);
  if (n == 0) return;
  MT_CHECK(p && m && v && g, "adamw_step", "null pointer (p=", (void*)p, " m=", (void*)m, " v=", (void*)v,
           " g=", (const void*)g, ")");
  MT_CHECK(std::isfinite(grad_scale), "adamw_step", "grad_scale must be finite, got ", grad_scale);
  MT_TRACE_COST(15.0 * double(n), 28.0 * double(n));  // p, m, v, g read; p, m, v written
  const AdamWScalars s = adamw_scalars(c, step);
  const Isa isa = active_isa();
  auto run = [&](int64_t i0, int64_t i1) {
    const int64_t len = i1 - i0;
    if (isa == Isa::Avx512) optim_avx512::adamw_range(p + i0, m + i0, v + i0, g + i0, len, s, grad_scale, apply_decay);
    else if (isa == Isa::Avx2) optim_avx2::adamw_range(p + i0, m + i0, v + i0, g + i0, len, s, grad_scale, apply_decay);
    else adamw_range_scalar(p + i0, m + i0, v + i0, g + i0, len, s, grad_scale, apply_decay);
  };
  if (n < kAdamWParallelMin) {
    run(0, n);
    return;
  }
  const int64_t items = (n + kAdamWGrain - 1) / kAdamWGrain;
#pragma omp parallel for schedule(static)
  for (int64_t it = 0; it < items; ++it) run(it * kAdamWGrain, std::min(n, (it + 1) * kAdamWGrain));
}

double grad_norm_sq(const float* g, int64_t n) {
  MT_CHECK(n >= 0, "grad_norm_sq", "negative size n=", n);
  if (n == 0) return 0.0;
  MT_CHECK(g != nullptr, "grad_norm_sq", "null gradient with n=", n);
  MT_TRACE_COST(2.0 * double(n), 4.0 * double(n));
  const Isa isa = active_isa();
  const int64_t nblocks = (n + kNormBlock - 1) / kNormBlock;
  const int64_t per_chunk = (nblocks + kNormChunks - 1) / kNormChunks;  // depends on n only
  const int64_t nchunks = (nblocks + per_chunk - 1) / per_chunk;
  double partial[kNormChunks];
#pragma omp parallel for schedule(static) if (nchunks > 1 && n >= (1 << 16))
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    double s = 0.0;
    const int64_t b1 = std::min(nblocks, (ch + 1) * per_chunk);
    for (int64_t b = ch * per_chunk; b < b1; ++b) {
      const int64_t i0 = b * kNormBlock, len = std::min(kNormBlock, n - i0);
      s += isa == Isa::Avx512 ? optim_avx512::norm_block(g + i0, len)
           : isa == Isa::Avx2 ? optim_avx2::norm_block(g + i0, len)
                              : norm_block_scalar(g + i0, len);
    }
    partial[ch] = s;
  }
  double total = 0.0;
  for (int64_t ch = 0; ch < nchunks; ++ch) total += partial[ch];
  return total;
}

double grad_norm_sq_multi(const float* const* gs, const int64_t* ns, int64_t count) {
  MT_CHECK(count >= 0, "grad_norm_sq_multi", "negative tensor count ", count);
  MT_CHECK(count == 0 || (gs && ns), "grad_norm_sq_multi", "null tensor list with count=", count);
  double total = 0.0;
  for (int64_t i = 0; i < count; ++i) total += grad_norm_sq(gs[i], ns[i]);
  return total;
}

float clip_coefficient(double total_norm, double max_norm) {
  if (!(max_norm > 0.0)) return 1.0f;
  if (!std::isfinite(total_norm)) return std::numeric_limits<float>::quiet_NaN();
  double c = max_norm / (total_norm + 1e-6);
  return c < 1.0 ? float(c) : 1.0f;
}

}  // namespace moetron
