// grouped_gemm_tile.h: private interface between the grouped GEMM dispatcher (grouped_gemm.cpp) and its
// ISA-specific tile kernels (grouped_gemm_avx512.cpp, grouped_gemm_avx2.cpp). A Tile is one work item:
//   C[rows, cols] (=, or += with accumulate) sum over steps s of  a(r, s) * b(s, c)
// with strided A and panel-blocked B. Not part of the public API.
//
// bf16 (a step is a pair of adjacent contraction indices, as in VNNI / vdpbf16ps):
//   a(r, s) = the two bf16 at A + r*a_rs + s*a_ss            (elements; 32-bit aligned not required)
//   b(s, c) = the two bf16 at B + p*b_ps + s*b_ss + 2*(c - 64p), p = c / 64 (panel)
//   If a_odd_tail, the last step's A pair holds only its first element (the second is not read).
// fp32 (a step is one contraction index):
//   a(r, s) = A[r*a_rs + s*a_ss],  b(s, c) = B[p*b_ps + s*b_ss + (c - 64p)]
// B is only read at columns < cols (masked), A only at rows < rows.
#pragma once
#include <cstdint>

#include "moetron/dtype.h"

namespace moetron::gg {

inline constexpr int64_t kPanel = 64;  // columns per B panel (4 zmm of fp32 accumulators)

struct Tile {
  const void* A = nullptr;
  int64_t a_rs = 0, a_ss = 0;
  const void* B = nullptr;
  int64_t b_ps = 0, b_ss = 0;
  float* C = nullptr;
  bf16* Cb = nullptr;  // optional bf16 copy of C (same ldc)
  int64_t ldc = 0;
  int64_t rows = 0, cols = 0, steps = 0;
  bool a_odd_tail = false;
  bool accumulate = false;
};

// Entry points of the ISA files (plain functions; everything else there is file-local).
void tile_bf16_avx512(const Tile& t);
void tile_f32_avx512(const Tile& t);
void tile_bf16_avx2(const Tile& t);
void tile_f32_avx2(const Tile& t);
// bf16 wgrad packing: interleave row pairs, out[p][c][2] = (in[2p][c], in[2p+1][c]), rows >= n_rows and
// columns in [cols, width) are zero.
void interleave_rows_avx512(bf16* out /* [ceil(n_rows/2), width, 2] */, const bf16* in /* [n_rows, ld] */,
                            int64_t ld, int64_t n_rows, int64_t cols, int64_t width);

}  // namespace moetron::gg
