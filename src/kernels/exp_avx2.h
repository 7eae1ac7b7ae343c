// exp_avx2.h: the AVX2 + FMA vector exponentials shared by the *_avx2.cpp kernels (attention, loss, SwiGLU),
// plus the two small helpers those files also share (8-lane tail masks, fp32 -> bf16 rounding). One
// algorithm: x = n + f (base 2) or x = n ln2 + r (base e), a degree-7 polynomial for the fraction, and
// the exact power-of-two scaling mul_pow2, which stands in for AVX-512's vscalefps (one rounding, so the
// subnormal range and the underflow to 0 come out as they do there). The polynomials and range reductions
// are the ones of the AVX-512 kernels, so exp2_ps / exp_ps give bitwise the same values as their AVX-512
// twins. Include only from *_avx2.cpp files (compiled with -mavx2 -mfma -mf16c): everything here is in an
// anonymous namespace, so no AVX2 code can be merged into a translation unit built for the baseline ISA.
// Not a public header, not a general SIMD library.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace {

// Lanes < rem set (all for rem >= 8), as the mask operand of _mm256_maskload_ps / _mm256_maskstore_ps.
inline __m256i avx2_tail_mask(int64_t rem) {
  const int32_t n = rem >= 8 ? 8 : int32_t(rem);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Horizontal sums, in a fixed order (lanes paired 0+4, 1+5, ..., then halves).
inline float avx2_hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline double avx2_hsum(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
  return _mm_cvtsd_f64(s);
}
inline float avx2_hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// p * 2^n for integral n in [-150, 128] with one rounding: n = n1 + n2, n1 = floor(n / 2), both in
// [-75, 64] (normal exponents). p in [0.5, 2] times 2^n1 is exact; times 2^n2 rounds once, into the
// subnormals or to 0 (2^-150 ties to 0) or to +inf, exactly as vscalefps(p, n) does.
inline __m256 mul_pow2(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

// 2^x; x below -150 gives exactly 0, above 128 gives +inf (NaN gives +inf, as the AVX-512 twin).
// f = x - round(x) in [-0.5, 0.5] is exact; degree-7 polynomial for 2^f; about 1 ulp.
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(128.0f)), _mm256_set1_ps(-150.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.2402265069591007f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931471805599453f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  return mul_pow2(p, n);
}

// e^x for x in [-104, 89] (clamped outside: below gives 0, above +inf). x = n ln2 + r with
// n = round(x log2 e) and a two-step Cody-Waite reduction (ln2_hi has 15 significant bits, so n ln2_hi is
// exact), |r| <= ln2 / 2; e^r by its degree-7 Taylor polynomial (truncation < 2^-26 relative); about 2 ulp.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(89.0f)), _mm256_set1_ps(-104.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2_hi
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);    // ln2_lo = ln2 - ln2_hi
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  return mul_pow2(p, n);
}

// fp32 -> bf16 bits, round to nearest even, NaN stays a quiet NaN (as moetron::to_bf16), 8 lanes packed
// into the 8 uint16 of the result.
inline __m128i bf16_round8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i b = _mm256_blendv_epi8(rounded, quiet, nan);  // each lane in [0, 65535]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08));
}

// Stores the first n (<= 8) bf16 values of bf16_round8(v) at dst (2-byte units; n < 8 via a bounce buffer).
inline void store_bf16x8(void* dst, __m256 v, int64_t n) {
  const __m128i b = bf16_round8(v);
  if (n >= 8) {
    _mm_storeu_si128(static_cast<__m128i*>(dst), b);
    return;
  }
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), b);
  auto* d = static_cast<unsigned char*>(dst);
  for (int64_t i = 0; i < n; ++i) __builtin_memcpy(d + 2 * i, tmp + i, 2);
}

}  // namespace
