// rope_avx2.cpp: AVX2 kernel rotating one head's rotary slice in place (called by rope.cpp when active_isa()
// is Avx2). Bitwise the portable kernel: the same products and differences, each rounded on its own (this file
// is compiled with -ffp-contract=off and uses no FMA intrinsic), 8 pairs per step, a masked tail.
// Not a driver: no threading or input checks here; not the AVX-512 kernel (that one fuses with FMAs).
#include <immintrin.h>

#include <cstdint>

#include "exp_avx2.h"

namespace moetron::rope_avx2 {

namespace {
template <bool kTail>
inline void rotate8(float* p, int64_t half, const float* c, const float* s, __m256 sign, __m256i mask) {
  auto ld = [&](const float* a) { return kTail ? _mm256_maskload_ps(a, mask) : _mm256_loadu_ps(a); };
  auto st = [&](float* a, __m256 x) {
    if constexpr (kTail) _mm256_maskstore_ps(a, mask, x);
    else _mm256_storeu_ps(a, x);
  };
  const __m256 x0 = ld(p), x1 = ld(p + half), vc = ld(c), sn = _mm256_mul_ps(sign, ld(s));
  st(p, _mm256_sub_ps(_mm256_mul_ps(x0, vc), _mm256_mul_ps(x1, sn)));
  st(p + half, _mm256_add_ps(_mm256_mul_ps(x1, vc), _mm256_mul_ps(x0, sn)));
}
}  // namespace

void rotate(float* p, int64_t half, const float* c, const float* s, bool inverse) {
  const __m256 sign = _mm256_set1_ps(inverse ? -1.0f : 1.0f);
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) rotate8<false>(p + i, half, c + i, s + i, sign, all);
  if (i < half) rotate8<true>(p + i, half, c + i, s + i, sign, avx2_tail_mask(half - i));
}

}  // namespace moetron::rope_avx2
