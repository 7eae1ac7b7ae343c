// dtype.cpp: dtype names and sizes, and the scalar FP8 encoders/decoders (reference quality; the
// vectorized paths in kernels/fp8 are tested against these).
#include "moetron/dtype.h"

#include <array>
#include <cmath>

#include "moetron/check.h"

namespace moetron {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F8E4M3: return 1;
    case DType::F8E5M2: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
  }
  MT_FAIL("dtype_size", "unknown dtype ", int(t));
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F8E4M3: return "f8_e4m3";
    case DType::F8E5M2: return "f8_e5m2";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
  }
  MT_FAIL("dtype_name", "unknown dtype ", int(t));
}

DType dtype_from_name(std::string_view n) {
  for (DType t : {DType::F32, DType::BF16, DType::F8E4M3, DType::F8E5M2, DType::I32, DType::I64, DType::U8})
    if (dtype_name(t) == n) return t;
  MT_FAIL("dtype_from_name", "unknown dtype '", n, "' (expected f32, bf16, f8_e4m3, f8_e5m2, i32, i64 or u8)");
}

namespace {

// Generic encoder for a sign + E exponent bits + M mantissa bits format with the given bias.
// max_bits is the bit pattern (without sign) of the largest finite value; nan_bits the NaN pattern.
uint8_t encode_fp8(float f, int M, int bias, uint8_t max_bits, uint8_t nan_bits) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  uint8_t sign = uint8_t((u >> 31) << 7);
  if (std::isnan(f)) return uint8_t(sign | nan_bits);
  float a = std::fabs(f);
  if (a == 0.0f) return sign;
  if (std::isinf(a)) return uint8_t(sign | max_bits);  // saturating conversion
  int emin = 1 - bias;  // exponent of the smallest normal
  int e;
  std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1)
  e -= 1;             // a = m' * 2^e with m' in [1, 2)
  uint32_t bits;
  if (e < emin) {
    // Subnormal: units of 2^(emin - M). A result of 2^M is exactly the smallest normal's encoding.
    double q = std::nearbyint(std::ldexp(double(a), M - emin));
    bits = uint32_t(q);
  } else {
    double m = std::nearbyint(std::ldexp(double(a), M - e));  // in [2^M, 2^(M+1)]
    if (m >= double(1u << (M + 1))) {
      m = double(1u << M);
      e += 1;
    }
    int ef = e + bias;
    if (ef > 0x7f >> M) return uint8_t(sign | max_bits);  // far out of range
    bits = (uint32_t(ef) << M) | (uint32_t(m) - (1u << M));
  }
  if (bits > max_bits) bits = max_bits;  // saturate (also maps infinity to the largest finite)
  return uint8_t(sign | bits);
}

float decode_fp8(uint8_t b, int M, int bias, bool has_inf, uint8_t nan_bits) {
  float sign = (b & 0x80) ? -1.0f : 1.0f;
  uint8_t v = b & 0x7f;
  int E = 7 - M;
  int ef = v >> M;
  int mant = v & ((1 << M) - 1);
  if (has_inf) {
    if (ef == (1 << E) - 1) return mant == 0 ? sign * INFINITY : NAN;
  } else if (v == nan_bits) {
    return NAN;
  }
  if (ef == 0) return sign * std::ldexp(float(mant), 1 - bias - M);
  return sign * std::ldexp(float((1 << M) + mant), ef - bias - M);
}

struct Fp8Tables {
  std::array<float, 256> e4m3, e5m2;
  Fp8Tables() {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = decode_fp8(uint8_t(i), 3, 7, false, 0x7f);
      e5m2[i] = decode_fp8(uint8_t(i), 2, 15, true, 0x7f);
    }
  }
};
const Fp8Tables& tables() {
  static const Fp8Tables t;
  return t;
}

}  // namespace

uint8_t float_to_e4m3_bits(float f) { return encode_fp8(f, 3, 7, 0x7e, 0x7f); }
uint8_t float_to_e5m2_bits(float f) { return encode_fp8(f, 2, 15, 0x7b, 0x7f); }
float e4m3_bits_to_float(uint8_t b) { return tables().e4m3[b]; }
float e5m2_bits_to_float(uint8_t b) { return tables().e5m2[b]; }

}  // namespace moetron
