// rope.cpp: RoPE table, and the in-place rotation of a strided view (forward and inverse): input checks,
// OpenMP over tokens, a portable head kernel. The AVX-512 and AVX2 head kernels are in rope_avx512.cpp and
// rope_avx2.cpp (bitwise this file's), chosen by active_isa(). Not the reference (rope_*_ref in rope.h).
#include <cmath>

#include "moetron/check.h"
#include "moetron/rope.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

namespace rope_avx512 {
void rotate(float* p, int64_t half, const float* c, const float* s, bool inverse);
}
namespace rope_avx2 {
void rotate(float* p, int64_t half, const float* c, const float* s, bool inverse);
}

namespace {

void rotate(float* p, int64_t half, const float* c, const float* s, bool inverse) {
  const float sign = inverse ? -1.0f : 1.0f;
  for (int64_t i = 0; i < half; ++i) {
    float x0 = p[i], x1 = p[i + half], sn = sign * s[i];
    p[i] = x0 * c[i] - x1 * sn;
    p[i + half] = x1 * c[i] + x0 * sn;
  }
}

void apply(const char* op, float* x, int64_t B, int64_t T, int64_t H, int64_t ld_token, int64_t ld_head,
           int64_t offset, int64_t R, const float* cos, const float* sin, bool inverse) {
  MT_CHECK(B >= 0 && T >= 0 && H >= 0, op, "negative size B=", B, " T=", T, " H=", H);
  MT_CHECK(R >= 2 && R % 2 == 0, op, "rotary dims R=", R, " must be even and >= 2");
  MT_CHECK(offset >= 0, op, "offset=", offset, " is negative");
  MT_CHECK(H <= 1 || ld_head >= offset + R, op, "ld_head=", ld_head, " < offset + R = ", offset + R,
           " (heads would overlap)");
  MT_CHECK(B * T <= 1 || ld_token >= (H - 1) * ld_head + offset + R, op, "ld_token=", ld_token,
           " < (H-1)*ld_head + offset + R = ", (H - 1) * ld_head + offset + R, " (tokens would overlap)");
  if (B * T * H == 0) return;
  MT_CHECK(x && cos && sin, op, "null pointer");
  MT_TRACE_COST(3.0 * double(B * T * H * R), 8.0 * double(B * T * H * R));  // 6 flops per rotated pair, in place
  const Isa isa = active_isa();
  const int64_t half = R / 2;
#pragma omp parallel for schedule(static) if (B * T * H * R >= 32768)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t t = bt % T;
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int64_t h = 0; h < H; ++h) {
      float* p = x + bt * ld_token + h * ld_head + offset;
      if (isa == Isa::Avx512) rope_avx512::rotate(p, half, c, s, inverse);
      else if (isa == Isa::Avx2) rope_avx2::rotate(p, half, c, s, inverse);
      else rotate(p, half, c, s, inverse);
    }
  }
}

}  // namespace

void rope_table(float* cos, float* sin, int64_t T, int64_t R, float theta) {
  MT_CHECK(T >= 0, "rope_table", "T=", T, " is negative");
  MT_CHECK(R >= 2 && R % 2 == 0, "rope_table", "rotary dims R=", R, " must be even and >= 2");
  MT_CHECK(theta > 1.0f, "rope_table", "theta=", theta, " must be > 1");
  MT_CHECK(T == 0 || (cos && sin), "rope_table", "null pointer");
  const int64_t half = R / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(double(theta), -2.0 * double(i) / double(R));
    for (int64_t t = 0; t < T; ++t) {
      const double ang = double(t) * inv_freq;
      cos[t * half + i] = float(std::cos(ang));
      sin[t * half + i] = float(std::sin(ang));
    }
  }
}

void rope_forward(float* x, int64_t B, int64_t T, int64_t H, int64_t ld_token, int64_t ld_head, int64_t offset,
                  int64_t R, const float* cos, const float* sin) {
  apply("rope_forward", x, B, T, H, ld_token, ld_head, offset, R, cos, sin, false);
}

void rope_backward(float* dx, int64_t B, int64_t T, int64_t H, int64_t ld_token, int64_t ld_head, int64_t offset,
                   int64_t R, const float* cos, const float* sin) {
  apply("rope_backward", dx, B, T, H, ld_token, ld_head, offset, R, cos, sin, true);
}

}  // namespace moetron
