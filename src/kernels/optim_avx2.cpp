// optim_avx2.cpp: the gradient norm's block sum with AVX2 (compiled with -mavx2 -mfma, chosen at run time by
// optim.cpp). Bitwise the scalar path: the same 16 striped double lanes and the same lane tree. Not AdamW (its
// scalar path is memory-bound on AVX2 machines) and not the AVX-512 file.
#include <immintrin.h>

#include <cstdint>

namespace moetron::optim_avx2 {

// Lane j of the 16 double lanes accumulates elements i with i % 16 == j: lanes 0-3, 4-7, 8-11 and 12-15 live in
// a0..a3. The square of a float is exact in double, so FMA and mul+add agree. The tree is (j, j+8), (j, j+4),
// (j, j+2), (j, j+1), as in the scalar path; a tail of fewer than 16 elements continues the lanes in scalar code.
double norm_block(const float* g, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd(), a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x = _mm256_loadu_ps(g + i), y = _mm256_loadu_ps(g + i + 8);
    const __m256d x0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), x1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    const __m256d y0 = _mm256_cvtps_pd(_mm256_castps256_ps128(y)), y1 = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
    a0 = _mm256_fmadd_pd(x0, x0, a0);
    a1 = _mm256_fmadd_pd(x1, x1, a1);
    a2 = _mm256_fmadd_pd(y0, y0, a2);
    a3 = _mm256_fmadd_pd(y1, y1, a3);
  }
  alignas(32) double lane[16];
  _mm256_store_pd(lane, a0);
  _mm256_store_pd(lane + 4, a1);
  _mm256_store_pd(lane + 8, a2);
  _mm256_store_pd(lane + 12, a3);
  for (; i < n; ++i) {
    const double x = double(g[i]);
    lane[i & 15] += x * x;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] = lane[j] + lane[j + w];
  return lane[0];
}

}  // namespace moetron::optim_avx2
