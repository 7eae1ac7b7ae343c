// fp8_avx2.cpp: AVX2 FP8 codecs and row kernels for fp8.cpp, 8 lanes: the same integer bit manipulation as
// fp8_avx512.cpp (its header comment derives the encode and decode), written with AVX2's compares and blends
// in place of mask registers, so that CPUs without AVX-512 (AMD Zen 2/3, where the FP8 path's quantize was
// half of an FP8 training step in the scalar codec) encode bit for bit like the scalar codecs of dtype.cpp.
// Tails go through an 8-lane stack buffer, so every element takes the vector path. Not called directly:
// fp8.cpp dispatches here when the active ISA is AVX2.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "moetron/fp8.h"  // fp8_scale_from_amax (out of line)

namespace moetron::fp8_avx2 {

namespace {

struct Fmt {
  int M, bias;
  uint32_t max_code, min_normal_bits;
  float sub_k, sub_unit;
  bool e5m2;
};
// E4M3: smallest normal 2^-6, K = 2^14, subnormal unit 2^-9. E5M2: 2^-14, K = 2^7, unit 2^-16.
constexpr Fmt kE4M3{3, 7, 0x7e, (127u - 6u) << 23, 16384.0f, 1.0f / 512.0f, false};
constexpr Fmt kE5M2{2, 15, 0x7b, (127u - 14u) << 23, 128.0f, 1.0f / 65536.0f, true};

inline __m256i set1(uint32_t v) { return _mm256_set1_epi32(int(v)); }

// Eight codes in the low byte of each 32-bit lane. |y| as bits is <= 0x7fffffff, so the signed compares of
// AVX2 order it correctly against the (positive) thresholds.
template <const Fmt& F>
inline __m256i encode8(__m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i a = _mm256_and_si256(u, set1(0x7fffffffu));
  constexpr int sh = 23 - F.M;
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, sh), set1(1));
  const __m256i rnd = _mm256_add_epi32(_mm256_add_epi32(a, set1((1u << (sh - 1)) - 1)), lsb);
  __m256i nrm = _mm256_sub_epi32(_mm256_srli_epi32(rnd, sh), set1((127u - F.bias) << F.M));
  nrm = _mm256_min_epu32(nrm, set1(F.max_code));  // above the largest finite value (inf too): saturate
  const __m256 k = _mm256_set1_ps(F.sub_k);
  const __m256i sub =
      _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), k)), _mm256_castps_si256(k));
  const __m256i is_sub = _mm256_cmpgt_epi32(set1(F.min_normal_bits), a);
  __m256i r = _mm256_blendv_epi8(nrm, sub, is_sub);
  const __m256i nan = _mm256_cmpgt_epi32(a, set1(0x7f800000u));
  r = _mm256_blendv_epi8(r, set1(0x7f), nan);
  return _mm256_or_si256(r, _mm256_and_si256(_mm256_srli_epi32(u, 24), set1(0x80)));
}

template <const Fmt& F>
inline __m256 decode8(__m256i v) {
  const __m256i e = _mm256_and_si256(v, set1(0x7f));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, set1(0x80)), 24);
  const __m256i nrm = _mm256_add_epi32(_mm256_slli_epi32(e, 23 - F.M), set1((127u - F.bias) << 23));
  const __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(e), _mm256_set1_ps(F.sub_unit)));
  const __m256i is_sub = _mm256_cmpgt_epi32(set1(1u << F.M), e);
  __m256i r = _mm256_or_si256(_mm256_blendv_epi8(nrm, sub, is_sub), sign);
  if constexpr (F.e5m2) {
    r = _mm256_blendv_epi8(r, _mm256_or_si256(sign, set1(0x7f800000u)), _mm256_cmpeq_epi32(e, set1(0x7c)));
    r = _mm256_blendv_epi8(r, set1(0x7fc00000u), _mm256_cmpgt_epi32(e, set1(0x7c)));
  } else {
    r = _mm256_blendv_epi8(r, set1(0x7fc00000u), _mm256_cmpeq_epi32(e, set1(0x7f)));
  }
  return _mm256_castsi256_ps(r);
}

// The low bytes of eight lanes (each 0..255) into eight bytes.
inline void store8(uint8_t* q, __m256i r) {
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packus_epi16(w, w));
}
inline __m256i load8(const uint8_t* q) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
}

template <const Fmt& F>
void encode_impl(uint8_t* q, const float* x, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(q + i, encode8<F>(_mm256_div_ps(_mm256_loadu_ps(x + i), s)));
  if (i < n) {
    float t[8] = {};
    uint8_t b[8];
    std::memcpy(t, x + i, size_t(n - i) * sizeof(float));
    store8(b, encode8<F>(_mm256_div_ps(_mm256_loadu_ps(t), s)));
    std::memcpy(q + i, b, size_t(n - i));
  }
}

template <const Fmt& F>
void decode_impl(float* x, const uint8_t* q, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(decode8<F>(load8(q + i)), s));
  if (i < n) {
    uint8_t b[8] = {};
    float t[8];
    std::memcpy(b, q + i, size_t(n - i));
    _mm256_storeu_ps(t, _mm256_mul_ps(decode8<F>(load8(b)), s));
    std::memcpy(x + i, t, size_t(n - i) * sizeof(float));
  }
}

template <const Fmt& F>
void fake_impl(float* y, const float* x, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  auto one = [&](const float* in) {
    return _mm256_mul_ps(decode8<F>(encode8<F>(_mm256_div_ps(_mm256_loadu_ps(in), s))), s);
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, one(x + i));
  if (i < n) {
    float t[8] = {};
    std::memcpy(t, x + i, size_t(n - i) * sizeof(float));
    _mm256_storeu_ps(t, one(t));
    std::memcpy(y + i, t, size_t(n - i) * sizeof(float));
  }
}

// Lanes of |x| below inf (NaN and inf fail the ordered compare and count as 0), folded by max.
inline __m256 finite_abs(__m256 v) {
  const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), set1(0x7fffffffu)));
  return _mm256_and_ps(a, _mm256_cmp_ps(a, _mm256_set1_ps(__builtin_inff()), _CMP_LT_OQ));
}
inline float hmax(__m256 m) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
inline void amax_accumulate(__m256& m0, __m256& m1, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(m0, finite_abs(_mm256_loadu_ps(x + i)));
    m1 = _mm256_max_ps(m1, finite_abs(_mm256_loadu_ps(x + i + 8)));
  }
  for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(m0, finite_abs(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float t[8] = {};
    std::memcpy(t, x + i, size_t(n - i) * sizeof(float));
    m1 = _mm256_max_ps(m1, finite_abs(_mm256_loadu_ps(t)));
  }
}

}  // namespace

float amax(const float* x, int64_t n) {
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  amax_accumulate(m0, m1, x, n);
  return hmax(_mm256_max_ps(m0, m1));
}

float amax_rows(const float* x, int64_t rows, int64_t n, int64_t ld) {
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) amax_accumulate(m0, m1, x + r * ld, n);
  return hmax(_mm256_max_ps(m0, m1));
}

void encode_scaled(uint8_t* q, const float* x, int64_t n, float scale, int fmt) {
  if (fmt == 0) encode_impl<kE4M3>(q, x, n, scale);
  else encode_impl<kE5M2>(q, x, n, scale);
}

void decode_scaled(float* x, const uint8_t* q, int64_t n, float scale, int fmt) {
  if (fmt == 0) decode_impl<kE4M3>(x, q, n, scale);
  else decode_impl<kE5M2>(x, q, n, scale);
}

void fake_scaled(float* y, const float* x, int64_t n, float scale, int fmt) {
  if (fmt == 0) fake_impl<kE4M3>(y, x, n, scale);
  else fake_impl<kE5M2>(y, x, n, scale);
}

void row_blocks(void* out, float* scales, const float* x, int64_t C, int64_t bc, int fmt, bool pow2, bool fake) {
  const Fp8Format f = fmt == 0 ? Fp8Format::E4M3 : Fp8Format::E5M2;
  for (int64_t bj = 0, c0 = 0; c0 < C; ++bj, c0 += bc)  // all scales first (the amax chains overlap), then encode
    scales[bj] = fp8_scale_from_amax(amax(x + c0, C - c0 < bc ? C - c0 : bc), f, pow2);
  for (int64_t bj = 0, c0 = 0; c0 < C; ++bj, c0 += bc) {
    const int64_t len = C - c0 < bc ? C - c0 : bc;
    if (fake) fake_scaled(static_cast<float*>(out) + c0, x + c0, len, scales[bj], fmt);
    else encode_scaled(static_cast<uint8_t*>(out) + c0, x + c0, len, scales[bj], fmt);
  }
}

}  // namespace moetron::fp8_avx2
