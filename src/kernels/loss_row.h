// loss_row.h: the row passes of the fused linear cross-entropy (loss.cpp), one set per ISA
// (loss_avx512.cpp, loss_avx2.cpp, the scalar set in loss.cpp), each pass a separate call so that a
// vocabulary-sharded loss can exchange per-row values between them:
//   row_max   max over the row, NaN if any logit is non-finite (inf or NaN)
//   row_exp   e = exp(z - mx) summed in double lanes (a fixed lane order), e stored in place if `store`
//   row_grad  d = e * inv over the row, as fp32 or as bf16 packed at the start of the row (bf16 element j at
//             bytes 2j..2j+1, below fp32 element j, already read); then entry t (if 0 <= t < V) = e_t inv - scale
//   row_fill  the whole row = value (fp32 or packed bf16): ignored rows (0) and non-finite rows (NaN)
// Called one after the other on one row they are exactly the passes of the former single-call row kernel, so the
// single-process loss is bitwise what it was. Private to src/kernels: not a public header, no threading here.
#pragma once
#include <cstdint>

namespace moetron {

struct XentRowOps {
  float (*row_max)(const float* z, int64_t V);
  double (*row_exp)(float* z, int64_t V, float mx, bool store);
  void (*row_grad)(float* z, int64_t V, int64_t t, float inv, float scale, bool bf16);
  void (*row_fill)(float* z, int64_t V, float value, bool bf16);
};

namespace loss_avx512 {
XentRowOps row_ops();
}
namespace loss_avx2 {
XentRowOps row_ops();
}

}  // namespace moetron
