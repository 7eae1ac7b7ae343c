// dtype.h: element types (fp32, bf16, fp8 e4m3 / e5m2, int32, int64, uint8) and scalar conversions.
// Conversions round to nearest even. FP8 encoders saturate to the largest finite value (the "satfinite"
// behaviour that FP8 training recipes use); NaN stays NaN. Vectorized conversions live in kernels.
#pragma once
#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moetron {

enum class DType : uint8_t { F32, BF16, F8E4M3, F8E5M2, I32, I64, U8 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
DType dtype_from_name(std::string_view name);  // throws on unknown names

struct bf16 {
  uint16_t bits = 0;
};

inline bf16 to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                                  // round to nearest even
  return bf16{uint16_t(u >> 16)};
}
inline float from_bf16(bf16 b) { return std::bit_cast<float>(uint32_t(b.bits) << 16); }
inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }

// FP8 formats (OCP 8-bit floating point specification):
//   E4M3 "fn": bias 7, no infinities, 0x7f/0xff are NaN, largest finite 448.
//   E5M2:      bias 15, IEEE-like with infinities, largest finite 57344.
struct fp8_e4m3 {
  uint8_t bits = 0;
};
struct fp8_e5m2 {
  uint8_t bits = 0;
};
inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

uint8_t float_to_e4m3_bits(float f);
uint8_t float_to_e5m2_bits(float f);
float e4m3_bits_to_float(uint8_t b);
float e5m2_bits_to_float(uint8_t b);

inline fp8_e4m3 to_e4m3(float f) { return fp8_e4m3{float_to_e4m3_bits(f)}; }
inline fp8_e5m2 to_e5m2(float f) { return fp8_e5m2{float_to_e5m2_bits(f)}; }
inline float from_fp8(fp8_e4m3 v) { return e4m3_bits_to_float(v.bits); }
inline float from_fp8(fp8_e5m2 v) { return e5m2_bits_to_float(v.bits); }

template <class T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <> constexpr DType dtype_of<fp8_e4m3>() { return DType::F8E4M3; }
template <> constexpr DType dtype_of<fp8_e5m2>() { return DType::F8E5M2; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }

}  // namespace moetron
