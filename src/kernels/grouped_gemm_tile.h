// grouped_gemm_tile.h: private interface between the GEMM drivers (grouped_gemm.cpp for the MoE experts,
// gemm_f32.cpp for the dense fp32 GEMM) and the ISA-specific tile kernels (grouped_gemm_avx512.cpp,
// grouped_gemm_avx2.cpp, the scalar one in grouped_gemm.cpp). A Tile is one work item:
//   C[rows, cols] (=, or += with accumulate) sum over steps s of  a(r, s) * b(s, c)
// with strided A and panel-blocked B. Not part of the public API.
//
// A rows come in groups of a_rb rows (q = r / a_rb, i = r % a_rb); the microkernel (kMR = 6 rows) never
// straddles a group.
// B columns come in panels of w = b_pw columns (64; the AVX2 and scalar kernels also take 16):
// bf16 (a step is a pair of adjacent contraction indices, as in VNNI / vdpbf16ps):
//   a(r, s) = the two bf16 at A + q*a_bs + i*a_rs + s*a_ss    (elements; 32-bit aligned not required)
//   b(s, c) = the two bf16 at B + p*b_ps + s*b_ss + 2*(c - w*p), p = c / w (panel)
//   If a_odd_tail, the last step's A pair holds only its first element (the second is not read).
// fp32 (a step is one contraction index):
//   a(r, s) = A[q*a_bs + i*a_rs + s*a_ss],  b(s, c) = B[p*b_ps + s*b_ss + (c - w*p)]
// B is only read at columns < cols (masked), A only at rows < rows.
#pragma once
#include <cstdint>

#include "moetron/dtype.h"
#include "moetron/kernel_sizes.h"
#include "moetron/runtime.h"

namespace moetron::gg {

inline constexpr int64_t kPanel = kGroupedPanel;  // columns per B panel, 64 (4 zmm / 8 ymm of fp32)
inline constexpr int64_t kMR = kGroupedMR;         // rows per microkernel call (and per A row block), 6

// Tile-size and kernel choices (heuristics kept apart from the kernels). Internal: benchmarks may change them
// between calls to compare variants; results never depend on them beyond fp32 summation blocking, which
// does not change the order of the sum (partial sums go through C in order).
struct Tuning {
  int64_t kc_bf16 = 256;  // max K block (pairs) of the bf16 tile loop; blocks are equal-sized
  int64_t kc_f32 = 256;   // same for fp32 (singles)
  int64_t kc_bf16_avx2 = 128;  // the same two for the AVX2 kernels (6 x 16 register block)
  int64_t kc_f32_avx2 = 256;
  int order_avx2 = 0;          // AVX2 tile loop: 0 16-column strip outer, 1 row-block outer
  bool strip_copy_avx2 = true; // AVX2, order 0: copy 64-column panels of B into contiguous 16-column strips
  bool strip_pf_avx2 = true;   // ... and prefetch the next panel while the current one computes
  bool widen_a_avx2 = true;
  bool strip_f32_avx2 = true;  // AVX2 fp32, order 0: all whole 6 x 16 blocks of a strip in one kernel call    // AVX2 bf16: widen each K block of A to fp32 once per tile (not per strip)
  int64_t mt = 96;        // M-grouped: rows per work item
  int64_t mt_avx2 = 192;  // the same for the AVX2 kernel (each item reads its expert's weights: fewer reads)
  int64_t nt = 512;       // M-grouped: max columns per work item (multiple of 64)
  int64_t wmt = kGroupedWgradRows;    // wgrad: rows of dW[e] per work item (512)
  int64_t wnt = 512;      // wgrad fp32: max columns per work item (bf16 items cover all N)
  int64_t wmc = kGroupedWgradChunk;   // wgrad bf16: token pairs per packed chunk (128)
  int order = 1;          // tile loop: 0 panel-outer, 1 row-block-outer
  bool stream = false;    // non-temporal stores for write-only fp32 outputs (forward / dgrad)
  bool prefetch = true;   // wgrad bf16: prefetch the next chunk's X / dY rows during the current chunk
  // fp32 on AVX2: copy the A operand into 6-row micro-panels (contiguous per microkernel call) before the tile
  // runs: forward / dgrad the item's rows of the input (fpack_avx2), wgrad each chunk of wmc_f32 tokens of
  // X_e^T (wpack_avx2; read in place a step touches one cache line per 6 floats).
  bool fpack_avx2 = true;
  bool wpack_avx2 = true;
  int64_t wmc_f32 = 256;
  // Dense fp32 GEMM (gemm_f32.cpp): rows / columns per work item, columns per column block, bytes of packed
  // op(B) per K phase, packed op(B) panel width for the AVX2 / scalar kernels (16 or 64), whether op(A) = A
  // is packed too (A^T always is), and whether packed op(A) is shared by all items of a phase (packed once
  // per phase with op(B)) or packed by each item for itself.
  int64_t dmt = 96;
  int64_t dnt = 256;
  int64_t dnc = 1024;
  size_t dbudget = size_t(1) << 20;
  int64_t dpw = 16;
  bool dpack_a = false;
  bool dshare_a = true;
};
Tuning& tuning();

struct Tile {
  const void* A = nullptr;
  int64_t a_rb = kMR, a_bs = 0, a_rs = 0, a_ss = 0;
  const void* B = nullptr;
  int64_t b_ps = 0, b_ss = 0;
  int64_t b_pw = kPanel;  // columns per B panel: 64, or 16 (AVX2 / scalar kernels only)
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
  bool cprefetch = true;  // AVX2: prefetch the next microkernel call's block of C
};

// The tile kernel of the active ISA (active_isa()): AMX (bf16, amx_active()), AVX-512, AVX2 or scalar.
using TileFn = void (*)(const Tile&);
TileFn tile_fn(bool bf16);

// Entry points of the ISA files (plain functions; everything else there is file-local).
void tile_bf16_avx512(const Tile& t);
// AMX-BF16 (amx_active()): tiles whose A rows are uniformly strided with adjacent pairs (a_ss == 2,
// a_bs == a_rb * a_rs, 64-column panels); others go to tile_bf16_avx512.
void tile_bf16_amx(const Tile& t);
bool amx_kernels_built();  // false where the compiler had no -mamx-tile / -mamx-bf16
inline bool use_amx() { return amx_kernels_built() && amx_active(); }
// The wgrad A operand for the AMX kernel, X^T as rows of token pairs:
//   out[r * ldo + 2 s + j] = in[(2 s + j) * ld + r]  for r < rows, s < ceil(n_rows / 2); zero where 2 s + j >= n_rows.
void pack_xt_pairs_amx(bf16* out, int64_t ldo, const bf16* in /* [n_rows, ld] */, int64_t ld, int64_t n_rows,
                       int64_t rows);
void tile_f32_avx512(const Tile& t);
void tile_bf16_avx2(const Tile& t);
void tile_f32_avx2(const Tile& t);
// Dense fp32 GEMM epilogue on rows x cols: C = alpha * S if beta == 0 (C not read), else
// C = fma(beta, C, alpha * S) (one rounding for the add). S may equal C (then lds == ldc).
void gemm_epilogue_f32_avx2(float* C, int64_t ldc, const float* S, int64_t lds, int64_t rows, int64_t cols,
                            float alpha, float beta);
// One fp32 panel of B^T, w = 16 or 64 columns wide: out[s * w + c] = Bt[c * ldb + s] for s < steps, c < pc;
// zero for pc <= c < w.
void pack_bt_panel_f32_avx2(float* out, const float* Bt, int64_t ldb, int64_t steps, int64_t pc, int64_t w);
// 6-row micro-panels of a row-major fp32 block: out[(r / 6) * 6 * ns + s * 6 + r % 6] = A[r * lda + s] for
// r < rows, s < ns, zero for the missing rows of the last micro-panel. Writes up to 2 floats past the end.
void pack_a_rows_f32_avx2(float* out, const float* A, int64_t lda, int64_t rows, int64_t ns);
// The same for op(A) = A^T (A stored [K, M], pointing at step 0, row 0 of the block): out[(r / 6) * 6 * ns +
// s * 6 + r % 6] = A[s * lda + r]; `avail` >= rows columns of each stored row may be read.
void pack_at_f32_avx2(float* out, const float* A, int64_t lda, int64_t rows, int64_t avail, int64_t ns);
// bf16 wgrad row-pair interleave (pack_pairs_avx512's contract, AVX2 instructions).
void pack_pairs_avx2(bf16* out, int64_t panel_stride, const bf16* in, int64_t ld, int64_t n_rows, int64_t cols);
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
