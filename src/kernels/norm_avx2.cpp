// norm_avx2.cpp: AVX2 + FMA row kernels for RMSNorm (called by the drivers in norm.cpp when active_isa() is
// Avx2). Same contract as the AVX-512 row kernels (norm_avx512.cpp), not bitwise the portable ones: the
// forward's sum of squares runs in 4 x 8 = 32 striped lanes (the AVX-512 kernel's 2 x 16) and the backward's
// dot in 2 x 8 = 16 lanes (its 16), each lane's chain of FMAs in column order, then a fixed combination tree;
// so each partial sums at most ceil(C / 16) products and the (C / 16 + 16) u tolerance of the harness is
// derived for this order as for AVX-512's. The elementwise parts (y = x r w, dx, the dw rows) are the same
// operations as the AVX-512 kernels'. Tails of C mod 8 use masked loads and stores.
// Not a driver: no threading or input checks here.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "exp_avx2.h"
#include "moetron/dtype.h"

namespace moetron::norm_avx2 {

namespace {
// Loads / stores of up to 8 floats: full vectors for n >= 8, masked ones for the tail.
inline __m256 load(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, avx2_tail_mask(n));
}
inline void store(float* p, __m256 v, int64_t n) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, avx2_tail_mask(n), v);
}
}  // namespace

void rmsnorm_fwd_row(float* y, bf16* y16, float* rstd, const float* x, const float* w, int64_t C, float eps) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t c = 0;
  for (; c + 32 <= C; c += 32) {
    const __m256 a = _mm256_loadu_ps(x + c), b = _mm256_loadu_ps(x + c + 8);
    const __m256 d = _mm256_loadu_ps(x + c + 16), e = _mm256_loadu_ps(x + c + 24);
    s0 = _mm256_fmadd_ps(a, a, s0);
    s1 = _mm256_fmadd_ps(b, b, s1);
    s2 = _mm256_fmadd_ps(d, d, s2);
    s3 = _mm256_fmadd_ps(e, e, s3);
  }
  for (; c < C; c += 8) {
    const __m256 a = load(x + c, C - c);
    s0 = _mm256_fmadd_ps(a, a, s0);
  }
  const float ss = avx2_hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  const float r = 1.0f / std::sqrt(ss / float(C) + eps);
  *rstd = r;
  const __m256 vr = _mm256_set1_ps(r);
  for (c = 0; c < C; c += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_mul_ps(load(x + c, C - c), vr), load(w + c, C - c));
    store(y + c, v, C - c);
    if (y16) store_bf16x8(y16 + c, v, C - c);
  }
}

void rmsnorm_bwd_row(float* dx, float* dwacc, const float* dy, const float* x, const float* w, float r, int64_t C) {
  const __m256 vr = _mm256_set1_ps(r);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    const __m256 xh0 = _mm256_mul_ps(_mm256_loadu_ps(x + c), vr), xh1 = _mm256_mul_ps(_mm256_loadu_ps(x + c + 8), vr);
    s0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(dy + c)), xh0, s0);
    s1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(w + c + 8), _mm256_loadu_ps(dy + c + 8)), xh1, s1);
  }
  for (; c < C; c += 8) {
    const __m256 xh = _mm256_mul_ps(load(x + c, C - c), vr);
    s0 = _mm256_fmadd_ps(_mm256_mul_ps(load(w + c, C - c), load(dy + c, C - c)), xh, s0);
  }
  const __m256 dot = _mm256_set1_ps(avx2_hsum(_mm256_add_ps(s0, s1)) / float(C));
  for (c = 0; c < C; c += 8) {
    const int64_t n = C - c;
    const __m256 xh = _mm256_mul_ps(load(x + c, n), vr);
    const __m256 d = load(dy + c, n);
    const __m256 wdy = _mm256_mul_ps(load(w + c, n), d);
    store(dx + c, _mm256_mul_ps(vr, _mm256_fnmadd_ps(xh, dot, wdy)), n);
    if (dwacc) store(dwacc + c, _mm256_fmadd_ps(d, xh, load(dwacc + c, n)), n);
  }
}

void rmsnorm_dw_row(float* dwacc, const float* dy, const float* x, float r, int64_t C) {
  const __m256 vr = _mm256_set1_ps(r);
  for (int64_t c = 0; c < C; c += 8) {
    const int64_t n = C - c;
    const __m256 xh = _mm256_mul_ps(load(x + c, n), vr);
    store(dwacc + c, _mm256_fmadd_ps(load(dy + c, n), xh, load(dwacc + c, n)), n);
  }
}

void add_rows(float* acc, const float* x, int64_t n) {
  for (int64_t c = 0; c < n; c += 8) store(acc + c, _mm256_add_ps(load(acc + c, n - c), load(x + c, n - c)), n - c);
}

}  // namespace moetron::norm_avx2
