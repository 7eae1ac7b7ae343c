// attention_amx.cpp: the bf16 flash attention's tile products on Intel's AMX-BF16 tiles (attention_amx.h):
// blocks of 16 rows x 64 columns held in four 16 x 16 fp32 tiles, 16 pairs of K per tile instruction. The
// operands are the layouts attention_bf16_avx512.cpp already builds: B (pairs along K, columns contiguous) is
// the tile unit's B layout as it is; A in rows of pairs is loaded in place; a transposed A (pairs along M) goes
// through a 16 x 16 register transpose first; edges (rows, columns or pairs short of 16) go through zero-padded
// scratch. Order of the sum: C (when accumulating), then the chunks of 16 pairs in order, each one instruction,
// the chunk boundaries fixed by K alone. Compiled with the AVX-512 flags plus -mamx-tile -mamx-bf16. Not the
// softmax or the schedules (attention_bf16_avx512.cpp), not the grouped GEMM's tiles (grouped_gemm_amx.cpp).
#include "kernels/attention_amx.h"

#include <immintrin.h>

// GCC 12 reports a false -Wmaybe-uninitialized inside its own avx512fintrin.h intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <cstring>

#include "kernels/amx_tiles.h"
#include "kernels/mask_avx512.h"
#include "kernels/transpose_avx512.h"

namespace moetron::attn_amx {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

bool built() { return true; }

namespace {

constexpr int kChunk = 16;  // pairs per tile instruction (64-byte tile rows)
constexpr int kCols = 64;   // output columns per block: four C tiles

// Tile registers: 0-3 the C tiles of a 16 x 64 block, 4 the A chunk, 5 the B chunk. Every tile is 16 rows
// of 64 bytes; edges are padded in scratch, so the configuration never changes inside a call.
// One static record: built once, so no compiler can drop its stores as dead (GCC 12 did, for a local record
// whose only reader was the inlined _tile_loadconfig: the tiles came up unconfigured and the first tile
// instruction faulted).
void configure() {
  static const AmxTileCfg cfg = [] {
    AmxTileCfg c;
    for (int t = 0; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    return c;
  }();
  _tile_loadconfig(&cfg);
}

struct Scratch {
  alignas(64) uint32_t a[16 * kChunk];  // an A chunk: 16 rows of 16 pairs
  alignas(64) uint32_t b[kChunk * 16];  // a B chunk: 16 pairs of 16 columns
  alignas(64) float c[16 * 16];         // a C tile cut by the block's edge
};

// C tile j named by a literal (amx_tiles.h).
#define MT_C_CASES(OP) MT_AMX_C_CASES(j, OP)

// C tile j of rows x cols at C: zero, or loaded (through scratch when cut).
inline void c_start(int j, bool acc, const float* C, int64_t ldc, int rows, int cols, Scratch& s) {
  if (!acc) {
#define MT_ZERO(n) _tile_zero(n)
    MT_C_CASES(MT_ZERO)
#undef MT_ZERO
    return;
  }
  const void* src = C;
  int64_t ld = ldc * int64_t(sizeof(float));
  if (rows < 16 || cols < 16) {
    for (int r = 0; r < 16; ++r)
      _mm512_store_ps(s.c + 16 * r, r < rows ? _mm512_maskz_loadu_ps(mask16(cols), C + r * ldc) : _mm512_setzero_ps());
    src = s.c, ld = 64;
  }
#define MT_LOAD(n) _tile_loadd(n, src, ld)
  MT_C_CASES(MT_LOAD)
#undef MT_LOAD
}
inline void c_finish(int j, float* C, int64_t ldc, int rows, int cols, Scratch& s) {
  const bool cut = rows < 16 || cols < 16;
  float* dst = cut ? s.c : C;
  const int64_t ld = cut ? 64 : ldc * int64_t(sizeof(float));
#define MT_STORE(n) _tile_stored(n, dst, ld)
  MT_C_CASES(MT_STORE)
#undef MT_STORE
  if (cut)
    for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(C + r * ldc, mask16(cols), _mm512_load_ps(s.c + 16 * r));
}
inline void c_dot(int j) {
#define MT_DOT(n) _tile_dpbf16ps(n, 4, 5)
  MT_C_CASES(MT_DOT)
#undef MT_DOT
}
#undef MT_C_CASES

// A 16 x 16 block of 32-bit words from src (rows ld words apart) into dst, only rows [0, rows) and columns
// [0, cols) read, the rest 0: an operand chunk cut by an edge, padded for a 16-row tile load.
inline void pad16(uint32_t* dst, const uint32_t* src, int64_t ld, int rows, int cols) {
  for (int r = 0; r < 16; ++r)
    _mm512_store_si512(dst + 16 * r, r < rows ? _mm512_maskz_loadu_epi32(mask16(cols), src + r * ld)
                                              : _mm512_setzero_si512());
}

// The A chunk of rows [m0, m0 + mr) and pairs [p0, p0 + ps) into tile 4.
inline void load_a(bool ta, const uint32_t* A, int64_t lda, int64_t m0, int mr, int64_t p0, int ps, Scratch& s) {
  if (!ta) {
    if (mr == 16 && ps == 16) {
      _tile_loadd(4, A + m0 * lda + p0, lda * 4);
      return;
    }
    pad16(s.a, A + m0 * lda + p0, lda, mr, ps);
  } else {  // A[p*lda + m]: 16 pair rows of 16 row lanes, transposed into 16 rows of 16 pairs
    __m512i v[16], w[16];
    for (int p = 0; p < 16; ++p)
      v[p] = p < ps ? _mm512_maskz_loadu_epi32(mask16(mr), A + (p0 + p) * lda + m0) : _mm512_setzero_si512();
    transpose16x16_epi32(v, w);
    for (int r = 0; r < 16; ++r) _mm512_store_si512(s.a + 16 * r, w[r]);
  }
  _tile_loadd(4, s.a, 64);
}

// The B chunk of pairs [p0, p0 + ps) and columns [n0, n0 + nc) into tile 5.
inline void load_b(const uint32_t* B, int64_t ldb, int64_t p0, int ps, int64_t n0, int nc, Scratch& s) {
  if (ps == 16 && nc == 16) {
    _tile_loadd(5, B + p0 * ldb + n0, ldb * 4);
    return;
  }
  pad16(s.b, B + p0 * ldb + n0, ldb, ps, nc);
  _tile_loadd(5, s.b, 64);
}

thread_local bool t_session = false;  // a Session holds this thread's configuration

}  // namespace

Session::Session(bool on) : on_(on && !t_session) {
  if (on_) configure(), t_session = true;
}
Session::~Session() {
  if (on_) _tile_release(), t_session = false;
}

void gemm(int tri, bool acc, bool trans_a, int64_t M, int64_t N, int64_t K, const uint32_t* A, int64_t lda,
          const uint32_t* B, int64_t ldb, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  static thread_local Scratch s;
  const bool own = !t_session;
  if (own) configure();
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int mr = int(std::min<int64_t>(16, M - m0));
    const int64_t last = m0 + mr;  // the block's bound: its last row's (attention_amx.h)
    int64_t n_lo = 0, n_hi = N, k_lo = 0, k_hi = K;
    switch (tri) {
      case kNUpTo: n_hi = std::min(N, last); break;
      case kNFrom: n_lo = std::min(m0, N); break;
      case kKUpTo: k_hi = std::min(K, last); break;
      case kKFrom: k_lo = std::min(m0, K); break;  // m0 is a multiple of 16: a whole pair
      default: break;
    }
    const int64_t p_hi = (k_hi + 1) / 2, p_lo = k_lo < k_hi ? k_lo / 2 : p_hi;
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += kCols) {
      const int64_t nn = std::min<int64_t>(kCols, n_hi - n0);
      const int nt = int((nn + 15) / 16);
      int cols[kCols / 16];  // columns of each C tile of the block
      for (int j = 0; j < nt; ++j) cols[j] = int(std::min<int64_t>(16, nn - 16 * j));
      for (int j = 0; j < nt; ++j) c_start(j, acc, C + m0 * ldc + n0 + 16 * j, ldc, mr, cols[j], s);
      for (int64_t p0 = p_lo; p0 < p_hi; p0 += kChunk) {
        const int ps = int(std::min<int64_t>(kChunk, p_hi - p0));
        load_a(trans_a, A, lda, m0, mr, p0, ps, s);
        for (int j = 0; j < nt; ++j) {
          load_b(B, ldb, p0, ps, n0 + 16 * j, cols[j], s);
          c_dot(j);
        }
      }
      for (int j = 0; j < nt; ++j) c_finish(j, C + m0 * ldc + n0 + 16 * j, ldc, mr, cols[j], s);
    }
  }
  if (own) _tile_release();
}

#else  // a compiler without the tile instructions: never chosen (built() is false)

bool built() { return false; }
Session::Session(bool) : on_(false) {}
Session::~Session() {}
void gemm(int, bool, bool, int64_t, int64_t, int64_t, const uint32_t*, int64_t, const uint32_t*, int64_t, float*,
          int64_t) {}

#endif

}  // namespace moetron::attn_amx
