// swiglu_avx2.cpp: AVX2 + FMA row kernels for SwiGLU (called by swiglu.cpp when active_isa() is Avx2), for
// CPUs without AVX-512; sigmoid = 1 / (1 + exp(-g)) with exp_ps of exp_avx2.h (about 2 ulp). The same
// per-element arithmetic as swiglu_avx512.cpp; the row sum of the scaled backward uses two 8-lane
// accumulators (even / odd vectors), i.e. 16 lane-striped partial sums as there. Not a driver: no threading
// or input checks here; only the entry points fwd_row / bwd_row are visible outside this file.
#include <immintrin.h>

#include <cstdint>

#include "exp_avx2.h"
#include "moetron/dtype.h"

namespace {

inline __m256 sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

inline __m256 load8(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, avx2_tail_mask(n));
}
inline void store8(float* p, __m256 v, int64_t n) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, avx2_tail_mask(n), v);
}

}  // namespace

namespace moetron::swiglu_avx2 {

void fwd_row(float* h, bf16* h16, const float* g, const float* u, float s, int64_t F) {
  const __m256 vs = _mm256_set1_ps(s);
  for (int64_t f = 0; f < F; f += 8) {
    const int64_t n = F - f;
    const __m256 vg = load8(g + f, n), vu = load8(u + f, n);
    const __m256 v = _mm256_mul_ps(vs, _mm256_mul_ps(_mm256_mul_ps(vg, sigmoid8(vg)), vu));
    store8(h + f, v, n);
    if (h16) store_bf16x8(h16 + f, v, n);
  }
}

float bwd_row(float* dg, float* du, const float* dh, const float* g, const float* u, float s, int64_t F) {
  const __m256 vs = _mm256_set1_ps(s), one = _mm256_set1_ps(1.0f);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // vectors 0, 2, 4, ... and 1, 3, 5, ...
  auto step = [&](int64_t f, __m256& acc) {
    const int64_t n = F - f;
    const __m256 vg = load8(g + f, n), vu = load8(u + f, n), d = load8(dh + f, n);
    const __m256 sig = sigmoid8(vg);
    const __m256 silu = _mm256_mul_ps(vg, sig);
    const __m256 dsilu = _mm256_mul_ps(sig, _mm256_fmadd_ps(vg, _mm256_sub_ps(one, sig), one));
    const __m256 dsu = _mm256_mul_ps(d, vu);
    store8(dg + f, _mm256_mul_ps(vs, _mm256_mul_ps(dsu, dsilu)), n);
    store8(du + f, _mm256_mul_ps(vs, _mm256_mul_ps(d, silu)), n);
    acc = _mm256_fmadd_ps(dsu, silu, acc);  // masked lanes load 0: dsu = 0, silu = 0
  };
  int64_t f = 0;
  for (; f + 16 <= F; f += 16) step(f, acc0), step(f + 8, acc1);
  if (f < F) step(f, acc0);
  if (f + 8 < F) step(f + 8, acc1);
  return avx2_hsum(_mm256_add_ps(acc0, acc1));
}

}  // namespace moetron::swiglu_avx2
