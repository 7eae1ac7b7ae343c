// swiglu.h: the SwiGLU activation on a fused gate|up buffer, forward and backward, plus a row-scaled
// variant for MoE experts (the routing weight applied inside the activation), and the reference twins.
//   row n of gu = [ g (F) | u (F) ],   h[n, f] = silu(g) * u = g * sigmoid(g) * u
//   scaled:                            h[n, f] = s[n] * silu(g) * u
// Elementwise (the scaled backward adds one row reduction for ds), batch invariant. Not the GEMMs around it.
#pragma once
#include <cmath>
#include <cstdint>

#include "moetron/dtype.h"

namespace moetron {

// h may be null when h16 is not: then only the bf16 copy is written (the same bits).
void swiglu_forward(float* h /* [N, F] or nullptr */, bf16* h16 /* [N, F] or nullptr */, const float* gu /* [N, 2F] */,
                    int64_t N, int64_t F);
// dgu is overwritten.
void swiglu_backward(float* dgu /* [N, 2F] */, const float* dh /* [N, F] */, const float* gu /* [N, 2F] */,
                     int64_t N, int64_t F);
// The same gradient rounded to bf16 as each row is made (bitwise to_bf16 of swiglu_backward's dgu), with no fp32
// copy written: what a bf16 GEMM reads next.
void swiglu_backward_bf16(bf16* dgu16 /* [N, 2F] */, const float* dh /* [N, F] */, const float* gu /* [N, 2F] */,
                          int64_t N, int64_t F);

// Row-scaled variant: s[n] multiplies row n (e.g. the router weight of the token in this expert).
// Backward: dgu = s * (the unscaled local gradient); ds[n] = sum_f dh[n, f] * silu(g) * u (overwritten;
// ds may be nullptr when the scale needs no gradient).
void swiglu_scaled_forward(float* h /* [N, F] */, bf16* h16 /* [N, F] or nullptr */, const float* gu /* [N, 2F] */,
                           const float* s /* [N] */, int64_t N, int64_t F);
void swiglu_scaled_backward(float* dgu /* [N, 2F] */, float* ds /* [N] or nullptr */, const float* dh /* [N, F] */,
                            const float* gu /* [N, 2F] */, const float* s /* [N] */, int64_t N, int64_t F);

// ---- naive references (float or double). s == nullptr means no row scale. ----

template <class T>
T sigmoid_ref(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <class T>
void swiglu_forward_ref(T* h /* [N, F] */, const T* gu /* [N, 2F] */, const T* s /* [N] or nullptr */, int64_t N,
                        int64_t F) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      T g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f];
      h[n * F + f] = (s ? s[n] : T(1)) * g * sigmoid_ref(g) * u;
    }
}

// d/dg silu(g) = sig * (1 + g * (1 - sig)).
template <class T>
void swiglu_backward_ref(T* dgu /* [N, 2F] */, T* ds /* [N] or nullptr */, const T* dh /* [N, F] */,
                         const T* gu /* [N, 2F] */, const T* s /* [N] or nullptr */, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n) {
    T sc = s ? s[n] : T(1), acc = 0;
    for (int64_t f = 0; f < F; ++f) {
      T g = gu[n * 2 * F + f], u = gu[n * 2 * F + F + f], d = dh[n * F + f];
      T sig = sigmoid_ref(g);
      T silu = g * sig;
      dgu[n * 2 * F + f] = sc * d * u * sig * (T(1) + g * (T(1) - sig));
      dgu[n * 2 * F + F + f] = sc * d * silu;
      acc += d * silu * u;
    }
    if (ds) ds[n] = acc;
  }
}

}  // namespace moetron
