// swiglu.cpp: SwiGLU drivers (input checks, OpenMP over rows) and the portable row kernels. The AVX-512
// row kernels are in swiglu_avx512.cpp, the AVX2 + FMA ones in swiglu_avx2.cpp, chosen by active_isa().
// The unscaled ops are the scaled ones with s = 1 (multiplying by 1 is exact). Not the reference
// (swiglu_*_ref in swiglu.h).
#include <cmath>
#include <vector>

#include "moetron/check.h"
#include "moetron/gemm.h"
#include "moetron/runtime.h"
#include "moetron/swiglu.h"
#include "moetron/trace.h"

namespace moetron {

namespace swiglu_avx512 {
void fwd_row(float* h, bf16* h16, const float* g, const float* u, float s, int64_t F);
float bwd_row(float* dg, float* du, const float* dh, const float* g, const float* u, float s, int64_t F);
}  // namespace swiglu_avx512
namespace swiglu_avx2 {
void fwd_row(float* h, bf16* h16, const float* g, const float* u, float s, int64_t F);
float bwd_row(float* dg, float* du, const float* dh, const float* g, const float* u, float s, int64_t F);
}  // namespace swiglu_avx2

namespace {

void fwd_row(float* h, bf16* h16, const float* g, const float* u, float s, int64_t F) {
  for (int64_t f = 0; f < F; ++f) {
    float sig = 1.0f / (1.0f + std::exp(-g[f]));
    h[f] = s * (g[f] * sig * u[f]);
    if (h16) h16[f] = to_bf16(h[f]);
  }
}

// Returns sum_f dh * silu(g) * u (the gradient of the row scale).
float bwd_row(float* dg, float* du, const float* dh, const float* g, const float* u, float s, int64_t F) {
  float acc = 0;
  for (int64_t f = 0; f < F; ++f) {
    float sig = 1.0f / (1.0f + std::exp(-g[f]));
    float silu = g[f] * sig, d = dh[f];
    dg[f] = s * (d * u[f] * sig * (1.0f + g[f] * (1.0f - sig)));
    du[f] = s * (d * silu);
    acc += d * silu * u[f];
  }
  return acc;
}

void check_args(const char* op, const void* a, const void* b, const void* c, int64_t N, int64_t F) {
  MT_CHECK(N >= 0, op, "N=", N, " is negative");
  MT_CHECK(F > 0, op, "F=", F, " must be positive");
  MT_CHECK(N == 0 || (a && b && c), op, "null pointer");
}

// h null (h16 set): each row's fp32 values go to the thread's own row, only the bf16 copy is written.
void forward_impl(float* h, bf16* h16, const float* gu, const float* s, int64_t N, int64_t F) {
  // Per output: silu(g) * u (about 5 flops with the exp as one); g and u read, h (and its bf16 copy) written.
  MT_TRACE_COST(double(N * F) * (s ? 6.0 : 5.0),
                double(N * F) * ((h ? 12.0 : 8.0) + (h16 ? 2.0 : 0.0)) + (s ? 4.0 * double(N) : 0.0));
  const Isa isa = active_isa();
#pragma omp parallel if (N * F >= 16384)
  {
    std::vector<float> own(h ? 0 : size_t(F));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* g = gu + n * 2 * F;
      float* hr = h ? h + n * F : own.data();
      bf16* h16r = h16 ? h16 + n * F : nullptr;
      float sc = s ? s[n] : 1.0f;
      if (isa == Isa::Avx512) swiglu_avx512::fwd_row(hr, h16r, g, g + F, sc, F);
      else if (isa == Isa::Avx2) swiglu_avx2::fwd_row(hr, h16r, g, g + F, sc, F);
      else fwd_row(hr, h16r, g, g + F, sc, F);
    }
  }
}

// dgu16 set: each row is made in a thread's own fp32 row and rounded into dgu16 (dgu unused).
void backward_impl(float* dgu, bf16* dgu16, float* ds, const float* dh, const float* gu, const float* s, int64_t N,
                   int64_t F) {
  MT_TRACE_COST(10.0 * double(N * F), (dgu16 ? 16.0 : 20.0) * double(N * F));  // dh, g, u read; dg, du written
  const Isa isa = active_isa();
#pragma omp parallel if (N * F >= 16384)
  {
    std::vector<float> own(dgu16 ? size_t(2 * F) : 0);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* g = gu + n * 2 * F;
      float* dg = dgu16 ? own.data() : dgu + n * 2 * F;
      float sc = s ? s[n] : 1.0f;
      float acc = isa == Isa::Avx512 ? swiglu_avx512::bwd_row(dg, dg + F, dh + n * F, g, g + F, sc, F)
                  : isa == Isa::Avx2 ? swiglu_avx2::bwd_row(dg, dg + F, dh + n * F, g, g + F, sc, F)
                                     : bwd_row(dg, dg + F, dh + n * F, g, g + F, sc, F);
      if (dgu16) f32_to_bf16_serial(dgu16 + n * 2 * F, dg, 2 * F);
      if (ds) ds[n] = acc;
    }
  }
}

}  // namespace

void swiglu_forward(float* h, bf16* h16, const float* gu, int64_t N, int64_t F) {
  check_args("swiglu_forward", h ? static_cast<const void*>(h) : h16, gu, gu, N, F);
  forward_impl(h, h16, gu, nullptr, N, F);
}

void swiglu_backward(float* dgu, const float* dh, const float* gu, int64_t N, int64_t F) {
  check_args("swiglu_backward", dgu, dh, gu, N, F);
  backward_impl(dgu, nullptr, nullptr, dh, gu, nullptr, N, F);
}

void swiglu_backward_bf16(bf16* dgu16, const float* dh, const float* gu, int64_t N, int64_t F) {
  check_args("swiglu_backward_bf16", dgu16, dh, gu, N, F);
  backward_impl(nullptr, dgu16, nullptr, dh, gu, nullptr, N, F);
}

void swiglu_scaled_forward(float* h, bf16* h16, const float* gu, const float* s, int64_t N, int64_t F) {
  check_args("swiglu_scaled_forward", h ? static_cast<const void*>(h) : h16, gu, s, N, F);
  forward_impl(h, h16, gu, s, N, F);
}

void swiglu_scaled_backward(float* dgu, float* ds, const float* dh, const float* gu, const float* s, int64_t N,
                            int64_t F) {
  check_args("swiglu_scaled_backward", dgu, dh, gu, N, F);
  MT_CHECK(N == 0 || s, "swiglu_scaled_backward", "null pointer s");
  backward_impl(dgu, nullptr, ds, dh, gu, s, N, F);
}

}  // namespace moetron
