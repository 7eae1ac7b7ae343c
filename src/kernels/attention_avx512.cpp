// attention_avx512.cpp: the AVX-512 fp32 backend of the flash-attention algorithm in attention_impl.h, on the
// Avx512Ops of attention_avx512_ops.h (fp32 tile GEMM, vector exp2, transposes, softmax pieces).
// Entry points forward/backward are called by attention.cpp when active_isa() is Avx512.
// GCC 12 warns about _mm512_undefined_ps() inside its own intrinsic headers (a false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "attention_avx512_ops.h"

namespace moetron::attention_avx512 {

void forward(float* out, float* lse, const float* q, const float* k, const float* v, const AttnDims& d, float* ws,
             int nthreads) {
  flash_forward<Avx512Ops>(out, lse, q, k, v, d, ws, nthreads);
}

void backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse, const float* q,
              const float* k, const float* v, const AttnDims& d, float* ws, int nthreads) {
  flash_backward<Avx512Ops>(dq, dk, dv, dout, out, lse, q, k, v, d, ws, nthreads);
}

}  // namespace moetron::attention_avx512
