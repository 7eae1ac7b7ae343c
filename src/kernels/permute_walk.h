// permute_walk.h: the row walk of the unpermute backward, written once for the portable path (permute.cpp) and
// the vector backends (permute_avx2.cpp, permute_avx512.cpp): dropped slots get dw = 0, then the permuted rows are
// visited in order (the two large buffers stream, only the dy rows are gathered) and `scale_dot(dyp row, dy row,
// yp row, w, D)` writes dyp[r] = w * dy[t] (TO: float or bf16) and returns dw = dot(dy[t], yp[r]). In an anonymous
// namespace: each backend's translation unit instantiates it with its own ISA flags. Not a public header.
#pragma once
#include <cstdint>

#include "moetron/dtype.h"

namespace moetron {
namespace {

template <class TO, class ScaleDot>
void unpermute_backward_walk(TO* dyp, float* dw, const float* dy, const float* yp, const int32_t* row_of,
                             const int32_t* token_of, const int32_t* slot_of, const float* w, int64_t N, int k,
                             int64_t R, int64_t D, ScaleDot scale_dot) {
#pragma omp parallel
  {
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < N * k; ++i)
      if (row_of[i] < 0) dw[i] = 0;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = int64_t(token_of[r]) * k + slot_of[r];
      dw[i] = scale_dot(dyp + r * D, dy + int64_t(token_of[r]) * D, yp + r * D, w[i], D);
    }
  }
}

}  // namespace
}  // namespace moetron
