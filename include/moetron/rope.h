// rope.h: rotary position embedding, half-split convention (HF Llama `rotate_half`): within the rotary
// slice of R dims, element i pairs with i + R/2 and is rotated by angle pos * theta^(-2i/R), i < R/2:
//   y[i]       = x[i] cos - x[i+R/2] sin
//   y[i+R/2]   = x[i+R/2] cos + x[i] sin
// In place on a strided view, so it works inside fused qkv buffers and on the decoupled rotary part of
// MLA heads (q_pe of every head; the single shared k_pe head per token). Positions are t = 0..T-1 within
// each of the B sequences. Not the interleaved-pairs (GPT-J / complex view) convention, not YaRN scaling.
#pragma once
#include <cmath>
#include <cstdint>

namespace moetron {

// cos/sin tables: [T, R/2], angle t * theta^(-2i/R) (computed in double, stored in float).
void rope_table(float* cos /* [T, R/2] */, float* sin /* [T, R/2] */, int64_t T, int64_t R, float theta);

// Element (b, t, h, i) of the rotary slice lives at x[(b*T + t)*ld_token + h*ld_head + offset + i], i < R.
void rope_forward(float* x, int64_t B, int64_t T, int64_t H, int64_t ld_token /* elements between tokens */,
                  int64_t ld_head /* elements between heads */, int64_t offset /* start of the rotary slice */,
                  int64_t R, const float* cos /* [T, R/2] */, const float* sin /* [T, R/2] */);
// The inverse rotation (the transpose), applied in place to the gradient.
void rope_backward(float* dx, int64_t B, int64_t T, int64_t H, int64_t ld_token, int64_t ld_head, int64_t offset,
                   int64_t R, const float* cos /* [T, R/2] */, const float* sin /* [T, R/2] */);

// ---- naive references (float or double) ----

template <class T>
void rope_table_ref(T* cos /* [T, R/2] */, T* sin /* [T, R/2] */, int64_t Tn, int64_t R, double theta) {
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t i = 0; i < R / 2; ++i) {
      double ang = double(t) * std::pow(theta, -2.0 * double(i) / double(R));
      cos[t * (R / 2) + i] = T(std::cos(ang));
      sin[t * (R / 2) + i] = T(std::sin(ang));
    }
}

// inverse = false: forward rotation; true: the inverse (backward).
template <class T>
void rope_ref(T* x, int64_t B, int64_t Tn, int64_t H, int64_t ld_token, int64_t ld_head, int64_t offset, int64_t R,
              const T* cos, const T* sin, bool inverse) {
  const int64_t half = R / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t)
      for (int64_t h = 0; h < H; ++h) {
        T* p = x + (b * Tn + t) * ld_token + h * ld_head + offset;
        for (int64_t i = 0; i < half; ++i) {
          T c = cos[t * half + i], s = inverse ? -sin[t * half + i] : sin[t * half + i];
          T x0 = p[i], x1 = p[i + half];
          p[i] = x0 * c - x1 * s;
          p[i + half] = x1 * c + x0 * s;
        }
      }
}

}  // namespace moetron
