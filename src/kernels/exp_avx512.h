// exp_avx512.h: the one AVX-512 vector exponential e^x of the *_avx512.cpp kernels that need it (router, SwiGLU,
// loss). x = n ln2 + r with n = round(x log2 e) and a two-step Cody-Waite reduction (n ln2_hi exact), e^r by its
// degree-7 Taylor polynomial (|r| <= ln2 / 2: truncation < 2^-26 relative), times 2^n by vscalefps (one rounding:
// subnormals, the exact 0 and +inf come out right); about 2 ulp. The callers' historic variants are kept as
// parameters, so each computes bitwise what its own copy did before this header:
//   SwiGLU: clamp to [-104, 89], the 15-bit ln2 split      exp_ps<kClampHigh = true>(x)
//   loss:   clamp below -104 only (NaN -> -104 -> 0)         exp_ps<false>(x)
//   router: clamp to [-104, 88.7], the 9-bit (Cephes) split  exp_ps<true>(x, 88.7f, kLn2Cephes)
// exp_avx2.h's exp_ps is the SwiGLU variant on 8 lanes. Include only from *_avx512.cpp files (compiled with the
// AVX-512 flags); everything here is in an anonymous namespace. Not the attention's exp2 (attention_avx512_ops.h).
#pragma once
#include <immintrin.h>

namespace {

struct Ln2Split {
  float hi, lo;  // hi + lo ~ ln 2; hi has few enough significant bits that n * hi is exact for |n| <= 150
};
constexpr Ln2Split kLn2Short{0.693145751953125f, 1.42860682030941723e-6f};  // hi: 15 significant bits
constexpr Ln2Split kLn2Cephes{0.693359375f, -2.12194440e-4f};               // hi: 9 significant bits

template <bool kClampHigh = true>
inline __m512 exp_ps(__m512 x, float high = 89.0f, Ln2Split ln2 = kLn2Short) {
  if constexpr (kClampHigh) x = _mm512_min_ps(x, _mm512_set1_ps(high));
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ln2.hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ln2.lo), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace
