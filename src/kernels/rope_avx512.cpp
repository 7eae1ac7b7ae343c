// rope_avx512.cpp: AVX-512 kernel rotating one head's rotary slice in place (called by rope.cpp when
// active_isa() is Avx512). Not a driver: no threading or input checks here.
// GCC 12 warns about _mm512_undefined_ps() inside its own intrinsic headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

namespace moetron::rope_avx512 {

void rotate(float* p, int64_t half, const float* c, const float* s, bool inverse) {
  const __m512 sign = _mm512_set1_ps(inverse ? -1.0f : 1.0f);
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = half - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (half - i)) - 1u);
    __m512 x0 = _mm512_maskz_loadu_ps(m, p + i), x1 = _mm512_maskz_loadu_ps(m, p + i + half);
    __m512 vc = _mm512_maskz_loadu_ps(m, c + i), vs = _mm512_mul_ps(sign, _mm512_maskz_loadu_ps(m, s + i));
    _mm512_mask_storeu_ps(p + i, m, _mm512_fmsub_ps(x0, vc, _mm512_mul_ps(x1, vs)));
    _mm512_mask_storeu_ps(p + i + half, m, _mm512_fmadd_ps(x0, vs, _mm512_mul_ps(x1, vc)));
  }
}

}  // namespace moetron::rope_avx512
