// fp8_avx512.cpp: AVX-512 FP8 codecs for fp8.cpp: 16 lanes of integer bit manipulation that
// reproduce the scalar codecs of dtype.cpp bit for bit (round to nearest even, saturating to the largest
// finite value, NaN -> 0x7f | sign, +-0 kept). Not called directly: fp8.cpp dispatches here.
//
// Encode of y (one lane), a = |y| as bits, M mantissa bits, bias B, smallest normal 2^emin:
//   a >  bits(fmt_max) (incl. inf):  the normal path gives a code above the largest finite one, and an
//                                    unsigned min saturates it (NaN handled after)
//   a >= bits(2^emin)  (normal):     round the float mantissa to M bits with the "add 0x7ff..f + lsb"
//                                    RNE trick, shift, and rebias the exponent (127 - B) << M; a carry
//                                    out of the mantissa lands in the exponent, as it should
//   a <  bits(2^emin)  (subnormal):  add K = 2^(emin - M + 23): the float sum has ulp 2^(emin - M), the
//                                    fp8 subnormal spacing, so the FPU's RNE does the rounding, and
//                                    bits(y + K) - bits(K) is the code (2^M = smallest normal is right)
// Decode: normal codes shift into a float and rebias; subnormal codes are int -> float times
// 2^(1 - B - M) (exact); NaN codes give 0x7fc00000 (the scalar decoder's NAN) and e5m2 0x7c is inf.
// GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_* helpers (a known
// false positive); silence it for this file only.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "moetron/fp8.h"  // fp8_scale_from_amax (an out-of-line baseline function); no inline helpers used

namespace moetron::fp8_avx512 {

namespace {

struct Fmt {
  int M, bias;
  uint32_t max_code, max_float_bits, min_normal_bits;
  float sub_k, sub_unit;
  bool e5m2;
};
// E4M3: max 448 = 0x43e00000, 2^-6, K = 2^14, subnormal unit 2^-9.
constexpr Fmt kE4M3{3, 7, 0x7e, 0x43e00000u, (127u - 6u) << 23, 16384.0f, 1.0f / 512.0f, false};
// E5M2: max 57344 = 0x47600000, 2^-14, K = 2^7, subnormal unit 2^-16.
constexpr Fmt kE5M2{2, 15, 0x7b, 0x47600000u, (127u - 14u) << 23, 128.0f, 1.0f / 65536.0f, true};

template <const Fmt& F>
inline __m512i encode16(__m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const int sh = 23 - F.M;
  // normal: RNE to M mantissa bits, rebias. For a above the largest finite value (inf included) this
  // gives a code above max_code (never wraps: a <= 0x7fffffff), so an unsigned min saturates.
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, sh), _mm512_set1_epi32(1));
  __m512i rnd = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((1 << (sh - 1)) - 1)), lsb);
  __m512i nrm = _mm512_sub_epi32(_mm512_srli_epi32(rnd, sh), _mm512_set1_epi32((127 - F.bias) << F.M));
  nrm = _mm512_min_epu32(nrm, _mm512_set1_epi32(int(F.max_code)));
  // subnormal
  const __m512 k = _mm512_set1_ps(F.sub_k);
  __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), k)),
                                 _mm512_castps_si512(k));
  __mmask16 is_sub = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(int(F.min_normal_bits)));
  __m512i r = _mm512_mask_blend_epi32(is_sub, nrm, sub);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7f));
  // r | ((u >> 24) & 0x80): the sign into bit 7 (ternary logic 0xf8 = A | (B & C))
  return _mm512_ternarylogic_epi32(r, _mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80), 0xf8);
}

template <const Fmt& F>
inline __m512 decode16(__m512i v) {
  const __m512i e = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  __m512i nrm = _mm512_add_epi32(_mm512_slli_epi32(e, 23 - F.M), _mm512_set1_epi32((127 - F.bias) << 23));
  __m512i sub = _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(F.sub_unit)));
  __mmask16 is_sub = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(1 << F.M));
  __m512i r = _mm512_or_si512(_mm512_mask_blend_epi32(is_sub, nrm, sub), sign);
  if constexpr (F.e5m2) {
    r = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(0x7c)), r,
                                _mm512_or_si512(sign, _mm512_set1_epi32(0x7f800000)));
    r = _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(0x7c)), r,
                                _mm512_set1_epi32(0x7fc00000));
  } else {
    r = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(0x7f)), r,
                                _mm512_set1_epi32(0x7fc00000));
  }
  return _mm512_castsi512_ps(r);
}

inline __mmask16 tail_mask(int64_t left) { return __mmask16((1u << left) - 1u); }

template <const Fmt& F, bool kScaled>
void encode_impl(uint8_t* q, const float* x, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 y = _mm512_loadu_ps(x + i);
    if constexpr (kScaled) y = _mm512_div_ps(y, s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(encode16<F>(y)));
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    __m512 y = _mm512_maskz_loadu_ps(m, x + i);
    if constexpr (kScaled) y = _mm512_div_ps(y, s);
    _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(encode16<F>(y)));
  }
}

template <const Fmt& F, bool kScaled>
void decode_impl(float* x, const uint8_t* q, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 y = decode16<F>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    if constexpr (kScaled) y = _mm512_mul_ps(y, s);
    _mm512_storeu_ps(x + i, y);
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    __m512 y = decode16<F>(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, q + i)));
    if constexpr (kScaled) y = _mm512_mul_ps(y, s);
    _mm512_mask_storeu_ps(x + i, m, y);
  }
}

template <const Fmt& F>
void fake_impl(float* y, const float* x, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), s);
    _mm512_storeu_ps(y + i, _mm512_mul_ps(decode16<F>(encode16<F>(v)), s));
  }
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), s);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(decode16<F>(encode16<F>(v)), s));
  }
}

}  // namespace

// amax over a [rows, n] sub-matrix with leading dimension ld: one vector accumulator, one reduction.
float amax_rows(const float* x, int64_t rows, int64_t n, int64_t ld) {
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
  __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ld;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(xr + i)), absmask));
      __m512 b = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(xr + i + 16)), absmask));
      m0 = _mm512_mask_max_ps(m0, _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ), m0, a);
      m1 = _mm512_mask_max_ps(m1, _mm512_cmp_ps_mask(b, inf, _CMP_LT_OQ), m1, b);
    }
    for (; i < n; i += 16) {
      const __mmask16 t = n - i >= 16 ? __mmask16(0xffff) : tail_mask(n - i);
      __m512 a =
          _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_maskz_loadu_ps(t, xr + i)), absmask));
      m0 = _mm512_mask_max_ps(m0, _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ), m0, a);
    }
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

float amax(const float* x, int64_t n) {
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
  __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + i)), absmask));
    __m512 b = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + i + 16)), absmask));
    m0 = _mm512_mask_max_ps(m0, _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ), m0, a);
    m1 = _mm512_mask_max_ps(m1, _mm512_cmp_ps_mask(b, inf, _CMP_LT_OQ), m1, b);
  }
  for (; i < n; i += 16) {
    const __mmask16 t = n - i >= 16 ? __mmask16(0xffff) : tail_mask(n - i);
    __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_maskz_loadu_ps(t, x + i)), absmask));
    m0 = _mm512_mask_max_ps(m0, _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ), m0, a);
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

void encode_scaled(uint8_t* q, const float* x, int64_t n, float scale, int fmt) {
  if (fmt == 0) {
    if (scale == 1.0f) encode_impl<kE4M3, false>(q, x, n, scale);
    else encode_impl<kE4M3, true>(q, x, n, scale);
  } else {
    if (scale == 1.0f) encode_impl<kE5M2, false>(q, x, n, scale);
    else encode_impl<kE5M2, true>(q, x, n, scale);
  }
}

void decode_scaled(float* x, const uint8_t* q, int64_t n, float scale, int fmt) {
  if (fmt == 0) {
    if (scale == 1.0f) decode_impl<kE4M3, false>(x, q, n, scale);
    else decode_impl<kE4M3, true>(x, q, n, scale);
  } else {
    if (scale == 1.0f) decode_impl<kE5M2, false>(x, q, n, scale);
    else decode_impl<kE5M2, true>(x, q, n, scale);
  }
}

void fake_scaled(float* y, const float* x, int64_t n, float scale, int fmt) {
  if (fmt == 0) fake_impl<kE4M3>(y, x, n, scale);
  else fake_impl<kE5M2>(y, x, n, scale);
}

template <const Fmt& F>
void row_blocks_impl(void* out, float* scales, const float* x, int64_t C, int64_t bc, Fp8Format f, bool pow2,
                     bool fake) {
  // Two sweeps over the row (it stays in L1/L2): all block scales first, so that the latency chains of
  // the blocks' amax reductions overlap, then the encodes.
  for (int64_t bj = 0, c0 = 0; c0 < C; ++bj, c0 += bc)
    scales[bj] = fp8_scale_from_amax(amax(x + c0, C - c0 < bc ? C - c0 : bc), f, pow2);
  for (int64_t bj = 0, c0 = 0; c0 < C; ++bj, c0 += bc) {
    const int64_t len = C - c0 < bc ? C - c0 : bc;
    const float s = scales[bj];
    if (fake) fake_impl<F>(static_cast<float*>(out) + c0, x + c0, len, s);
    else if (s == 1.0f) encode_impl<F, false>(static_cast<uint8_t*>(out) + c0, x + c0, len, s);
    else encode_impl<F, true>(static_cast<uint8_t*>(out) + c0, x + c0, len, s);
  }
}

void row_blocks(void* out, float* scales, const float* x, int64_t C, int64_t bc, int fmt, bool pow2, bool fake) {
  if (fmt == 0) row_blocks_impl<kE4M3>(out, scales, x, C, bc, Fp8Format::E4M3, pow2, fake);
  else row_blocks_impl<kE5M2>(out, scales, x, C, bc, Fp8Format::E5M2, pow2, fake);
}

}  // namespace moetron::fp8_avx512
