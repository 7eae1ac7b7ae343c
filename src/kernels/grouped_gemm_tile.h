// grouped_gemm_tile.h: private interface between the grouped GEMM dispatcher (grouped_gemm.cpp) and its
// ISA-specific tile kernels (grouped_gemm_avx512.cpp, grouped_gemm_avx2.cpp). A Tile is one work item:
//   C[rows, cols] (=, or += with accumulate) sum over steps s of  a(r, s) * b(s, c)
// with strided A and panel-blocked B. Not part of the public API.
//
// A rows come in groups of a_rb rows (q = r / a_rb, i = r % a_rb); the microkernel (kMR = 6 rows) never
// straddles a group.
// bf16 (a step is a pair of adjacent contraction indices, as in VNNI / vdpbf16ps):
//   a(r, s) = the two bf16 at A + q*a_bs + i*a_rs + s*a_ss    (elements; 32-bit aligned not required)
//   b(s, c) = the two bf16 at B + p*b_ps + s*b_ss + 2*(c - 64p), p = c / 64 (panel)
//   If a_odd_tail, the last step's A pair holds only its first element (the second is not read).
// fp32 (a step is one contraction index):
//   a(r, s) = A[q*a_bs + i*a_rs + s*a_ss],  b(s, c) = B[p*b_ps + s*b_ss + (c - 64p)]
// B is only read at columns < cols (masked), A only at rows < rows.
#pragma once
#include <cstdint>

#include "moetron/dtype.h"

namespace moetron::gg {

inline constexpr int64_t kPanel = 64;  // columns per B panel (4 zmm of fp32 accumulators)
inline constexpr int64_t kMR = 6;      // rows per microkernel call (and per A row block)

// Tile-size and kernel choices (heuristics kept apart from the kernels). Internal: benchmarks may change them
// between calls to compare variants; results never depend on them beyond fp32 summation blocking, which
// does not change the order of the sum (partial sums go through C in order).
struct Tuning {
  int64_t kc_bf16 = 256;  // max K block (pairs) of the bf16 tile loop; blocks are equal-sized
  int64_t kc_f32 = 256;   // same for fp32 (singles)
  int64_t mt = 96;        // M-grouped: rows per work item
  int64_t nt = 512;       // M-grouped: max columns per work item (multiple of 64)
  int64_t wmt = 512;      // wgrad: rows of dW[e] per work item
  int64_t wnt = 512;      // wgrad fp32: max columns per work item (bf16 items cover all N)
  int64_t wmc = 128;      // wgrad bf16: token pairs per packed chunk
  int order = 1;          // tile loop: 0 panel-outer, 1 row-block-outer
  bool stream = false;    // non-temporal stores for write-only fp32 outputs (forward / dgrad)
  bool prefetch = true;   // wgrad bf16: prefetch the next chunk's X / dY rows during the current chunk
};
Tuning& tuning();

struct Tile {
  const void* A = nullptr;
  int64_t a_rb = kMR, a_bs = 0, a_rs = 0, a_ss = 0;
  const void* B = nullptr;
  int64_t b_ps = 0, b_ss = 0;
  float* C = nullptr;
  bf16* Cb = nullptr;  // optional bf16 copy of C (same ldc)
  int64_t ldc = 0;
  int64_t rows = 0, cols = 0, steps = 0;
  bool a_odd_tail = false;
  bool accumulate = false;
  bool stream = false;  // C is write-only and not needed in cache soon: non-temporal stores where aligned
  // Optional memory to prefetch into L2 while the tile computes (the next chunk's inputs): up to two byte
  // ranges, spread over the microkernel calls. A hint only; never dereferenced.
  const char* pf[2] = {nullptr, nullptr};
  int64_t pf_bytes[2] = {0, 0};
};

// Entry points of the ISA files (plain functions; everything else there is file-local).
void tile_bf16_avx512(const Tile& t);
void tile_f32_avx512(const Tile& t);
void tile_bf16_avx2(const Tile& t);
void tile_f32_avx2(const Tile& t);
// bf16 wgrad packing: row pairs interleaved into 64-column panels (the VNNI layout of both wgrad operands):
//   out[(c / 64) * panel_stride + p * 128 + 2*(c % 64) + j] = in[2p + j][c]
// for p < ceil(n_rows / 2) and c < round_up(cols, 64); zero where 2p + j >= n_rows or c >= cols.
void pack_pairs_avx512(bf16* out, int64_t panel_stride, const bf16* in /* [n_rows, ld] */, int64_t ld, int64_t n_rows,
                       int64_t cols);

// Weight packing, one bf16 panel (layout in grouped_gemm.cpp): B = W_e [K, N] (fwd) or W_e^T (dgrad), panel
// columns [c0, c0 + pc), `steps` pairs; rounding is bitwise moetron::to_bf16.
void pack_weight_panel_bf16_avx512(bf16* out /* [steps][64][2] */, const float* We /* [K, N] */, int64_t K, int64_t N,
                                   bool fwd, int64_t c0, int64_t pc, int64_t steps);

}  // namespace moetron::gg
