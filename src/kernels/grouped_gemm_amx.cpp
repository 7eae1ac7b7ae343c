// grouped_gemm_amx.cpp: the AMX-BF16 tile kernel of the grouped GEMM (bf16 steps; the contract in
// grouped_gemm_tile.h) and the wgrad operand packing it needs (X^T as rows of token pairs). The tile unit
// multiplies a 16-row x 16-pair A tile by a 16-pair x 16-column B tile in VNNI pairs into a 16 x 16 fp32
// tile: B comes from the packed panels as they are (a 64-byte row of a panel's 16 columns per step), A must
// have each row's pairs contiguous, so this kernel takes tiles whose A rows are uniformly strided with
// adjacent pairs (forward, dgrad, and the wgrad operand packed by pack_xt_pairs_amx); any other tile goes
// to the AVX-512 kernel. Not a scheduler (grouped_gemm.cpp decides the work items), not the dense GEMM.
//
// Order of the sum: each output element is C (when accumulating), then the K chunks of 16 pairs in order,
// each one tile instruction; the chunk boundaries are fixed by the tile's steps, never by its rows, so a
// row's result does not depend on which rows were grouped with it. Results differ from the vdpbf16ps
// kernel's in the last bits (another summation order); both are held to the same bound (docs/kernels/gemm.md).
// Compiled with the AVX-512 flags plus -mamx-tile -mamx-bf16; everything but the entry points is file-local.
#include <immintrin.h>

// GCC 12 reports a false -Wmaybe-uninitialized inside its own avx512fintrin.h intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/amx_tiles.h"
#include "kernels/grouped_gemm_tile.h"
#include "kernels/mask_avx512.h"
#include "kernels/transpose_avx512.h"

namespace moetron::gg {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

bool amx_kernels_built() { return true; }

namespace {

// Tile registers: 0 1 2 3 = C00 C01 C10 C11 (fp32 2 x 2 block of 16 x 16), 4 5 = A0 A1 (rows 0-15, 16-31),
// 6 7 = B0 B1 (columns 0-15, 16-31 of the block).
enum : int { kC00 = 0, kC01 = 1, kC10 = 2, kC11 = 3, kA0 = 4, kA1 = 5, kB0 = 6, kB1 = 7 };
constexpr int kChunk = 16;  // pairs per tile instruction (64-byte tile rows)

// The configuration for a row block of ra0 + ra1 rows (ra0 <= 16, ra1 = 0 when the block has <= 16 rows).
// Loading a configuration zeroes every tile, so it changes only between blocks.
void configure(int ra0, int ra1) {
  AmxTileCfg c;
  auto set = [&](int t, int rows) { c.rows[t] = uint8_t(rows), c.colsb[t] = 64; };
  set(kC00, ra0), set(kC01, ra0), set(kA0, ra0);
  if (ra1 > 0) set(kC10, ra1), set(kC11, ra1), set(kA1, ra1);
  set(kB0, kChunk), set(kB1, kChunk);
  _tile_loadconfig(&c);
}

struct Scratch {
  alignas(64) uint32_t a[32 * kChunk];  // the last K chunk of a row block's A, zero-padded
  alignas(64) uint32_t b[kChunk * 32];  // the last K chunk of a column block's B, zero-padded
  alignas(64) float c[16 * 16];         // a C sub-tile whose columns are cut by the tile's edge
};

// The C sub-tiles are named through amx_tiles.h's switch on T.
#define MT_TILE_CASES(OP) MT_AMX_C_CASES(T, OP)

// One C sub-tile (T, 0-3) of rows x cols at C: start (zero or C) and finish (store, bf16 copy).
inline void c_start(int T, float* C, int64_t ldc, int rows, int cols, bool acc, Scratch& s) {
  const void* src = C;
  int64_t lds = ldc * int64_t(sizeof(float));
  if (acc && cols < 16) {
    for (int r = 0; r < rows; ++r) _mm512_store_ps(s.c + 16 * r, _mm512_maskz_loadu_ps(mask16(cols), C + r * ldc));
    src = s.c, lds = 64;
  }
#define MT_ZERO(n) _tile_zero(n)
#define MT_LOAD(n) _tile_loadd(n, src, lds)
  if (!acc) {
    MT_TILE_CASES(MT_ZERO)
  } else {
    MT_TILE_CASES(MT_LOAD)
  }
#undef MT_ZERO
#undef MT_LOAD
}
inline void c_finish(int T, float* C, bf16* Cb, int64_t ldc, int rows, int cols, Scratch& s) {
  const __mmask16 m = mask16(cols);
  float* dst = cols == 16 ? C : s.c;
  const int64_t ldd = cols == 16 ? ldc : 16;
#define MT_STORE(n) _tile_stored(n, dst, ldd * int64_t(sizeof(float)))
  MT_TILE_CASES(MT_STORE)
#undef MT_STORE
  if (cols < 16)
    for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(C + r * ldc, m, _mm512_load_ps(s.c + 16 * r));
  if (Cb)
    for (int r = 0; r < rows; ++r)
      _mm256_mask_storeu_epi16(Cb + r * ldc, m, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(dst + r * ldd)));
}
#undef MT_TILE_CASES

bool amx_tile_fits(const Tile& t) { return t.a_ss == 2 && t.a_bs == t.a_rb * t.a_rs && t.b_pw == kPanel; }

}  // namespace

void tile_bf16_amx(const Tile& t) {
  if (t.rows <= 0 || t.cols <= 0) return;
  if (!amx_tile_fits(t) || t.steps == 0) return tile_bf16_avx512(t);
  static thread_local Scratch s;
  const char* A = static_cast<const char*>(t.A);
  const char* B = static_cast<const char*>(t.B);
  const int64_t lda = t.a_rs * 2, ldb = t.b_ss * 2, ldc = t.ldc;  // bytes (A, B), floats (C)
  // K chunks read in place, then (when the steps are not a multiple of 16, or the last pair has only its
  // first element) one chunk through the zero-padded scratch.
  const bool tail = t.steps % kChunk != 0 || t.a_odd_tail;
  const int64_t nmain = tail ? (t.steps - 1) / kChunk : t.steps / kChunk;
  const int64_t ts0 = nmain * kChunk, tn = t.steps - ts0;
  int cfg0 = -1, cfg1 = -1;
  for (int64_t r0 = 0; r0 < t.rows; r0 += 32) {
    const int rb = int(std::min<int64_t>(32, t.rows - r0)), ra0 = std::min(16, rb), ra1 = rb - ra0;
    if (ra0 != cfg0 || ra1 != cfg1) configure(ra0, ra1), cfg0 = ra0, cfg1 = ra1;
    const char* Ar = A + r0 * lda;
    if (tail) {
      std::memset(s.a, 0, sizeof s.a);
      for (int r = 0; r < rb; ++r) {
        // With an odd tail the last pair's second element is not read (it may lie past the buffer); the
        // zeroed scratch supplies it.
        std::memcpy(s.a + r * kChunk, Ar + r * lda + ts0 * 4, size_t(tn) * 4 - (t.a_odd_tail ? 2 : 0));
      }
    }
    for (int64_t c0 = 0; c0 < t.cols; c0 += 32) {
      const int cb = int(std::min<int64_t>(32, t.cols - c0)), cb0 = std::min(16, cb), cb1 = cb - cb0;
      const char* Bc = B + (c0 / kPanel) * t.b_ps * 2 + (c0 % kPanel) * 4;
      float* C = t.C + r0 * ldc + c0;
      c_start(kC00, C, ldc, ra0, cb0, t.accumulate, s);
      if (cb1) c_start(kC01, C + 16, ldc, ra0, cb1, t.accumulate, s);
      if (ra1) {
        c_start(kC10, C + 16 * ldc, ldc, ra1, cb0, t.accumulate, s);
        if (cb1) c_start(kC11, C + 16 * ldc + 16, ldc, ra1, cb1, t.accumulate, s);
      }
      auto step = [&](const void* a, int64_t sa, const void* b, int64_t sb) {
        _tile_loadd(4, a, sa);
        _tile_loadd(6, b, sb);
        _tile_dpbf16ps(0, 4, 6);
        if (cb1) {
          _tile_loadd(7, static_cast<const char*>(b) + 64, sb);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (ra1) {
          _tile_loadd(5, static_cast<const char*>(a) + 16 * sa, sa);
          _tile_dpbf16ps(2, 5, 6);
          if (cb1) _tile_dpbf16ps(3, 5, 7);
        }
      };
      for (int64_t k = 0; k < nmain; ++k) step(Ar + k * kChunk * 4, lda, Bc + k * kChunk * ldb, ldb);
      if (tail) {
        std::memset(s.b, 0, sizeof s.b);
        for (int64_t j = 0; j < tn; ++j) std::memcpy(s.b + j * 32, Bc + (ts0 + j) * ldb, 128);
        step(s.a, kChunk * 4, s.b, 128);
      }
      bf16* Cb = t.Cb ? t.Cb + r0 * ldc + c0 : nullptr;
      c_finish(kC00, C, Cb, ldc, ra0, cb0, s);
      if (cb1) c_finish(kC01, C + 16, Cb ? Cb + 16 : nullptr, ldc, ra0, cb1, s);
      if (ra1) {
        c_finish(kC10, C + 16 * ldc, Cb ? Cb + 16 * ldc : nullptr, ldc, ra1, cb0, s);
        if (cb1) c_finish(kC11, C + 16 * ldc + 16, Cb ? Cb + 16 * ldc + 16 : nullptr, ldc, ra1, cb1, s);
      }
    }
  }
  _tile_release();
}

// out[r * ldo + 2 s + j] = in[(2 s + j) * ld + r] for r < rows, s < ceil(n_rows / 2); zero where 2 s + j >=
// n_rows. Blocks of 16 rows x 16 pairs: each pair step is one zmm of 16 rows' pairs, and a 16 x 16 transpose
// of 32-bit lanes turns them into 16 rows of 16 pairs.
void pack_xt_pairs_amx(bf16* out, int64_t ldo, const bf16* in, int64_t ld, int64_t n_rows, int64_t rows) {
  const int64_t np = (n_rows + 1) / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int rn = int(std::min<int64_t>(16, rows - r0));
    const __mmask16 rm = mask16(rn);
    for (int64_t s0 = 0; s0 < np; s0 += 16) {
      const int sn = int(std::min<int64_t>(16, np - s0));
      __m512i v[16];
      for (int k = 0; k < 16; ++k) {
        const int64_t t0 = 2 * (s0 + k), t1 = t0 + 1;
        const __m512i lo = k < sn ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rm, in + t0 * ld + r0))
                                  : _mm512_setzero_si512();
        const __m512i hi = (k < sn && t1 < n_rows)
                               ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rm, in + t1 * ld + r0))
                               : _mm512_setzero_si512();
        v[k] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));  // lane i: the pair of row r0 + i at step s0 + k
      }
      __m512i w[16];  // w[c] lane k = v[k] lane c: row r0 + c's pairs at steps s0 .. s0 + 15
      transpose16x16_epi32(v, w);
      const __mmask16 sm = mask16(sn);
      for (int c = 0; c < rn; ++c) _mm512_mask_storeu_epi32(out + (r0 + c) * ldo + 2 * s0, sm, w[c]);
    }
  }
}

#else  // a compiler without the tile instructions: never chosen (amx_kernels_built() is false)

bool amx_kernels_built() { return false; }
void tile_bf16_amx(const Tile& t) { tile_bf16_avx512(t); }
void pack_xt_pairs_amx(bf16*, int64_t, const bf16*, int64_t, int64_t, int64_t) {}

#endif

}  // namespace moetron::gg
