// grouped_gemm_avx2.cpp: AVX2 + FMA tile kernels for the grouped GEMM and the dense fp32 GEMM (contract in
// grouped_gemm_tile.h), for CPUs without AVX512-BF16. Register block: 6 rows x 16 columns (12 ymm fp32
// accumulators, two B vectors, one A broadcast). The tile loop works in equal K blocks; between blocks the
// partial sums go through C, so every element is the plain sequential sum over the steps whatever the tiling.
// 64-column B panels are copied into contiguous 16-column strips first (see run_tile). bf16 pairs are widened
// to fp32 with a shift (even element) and a mask (odd element): two FMAs per pair, the even element first (the
// same order as the scalar kernel); the A block is widened once per tile. fp32 strips made of whole 6 x 16
// blocks run in one call (strip_f32). Also: the fp32 GEMM epilogue, the
// fp32 packers of the dense GEMM (B^T panels, 6-row A micro-panels) and the bf16 row-pair interleave. Not a
// scheduler (grouped_gemm.cpp, gemm_f32.cpp decide the work items). Everything but the entry points is
// file-local.
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/grouped_gemm_tile.h"

namespace moetron::gg {

namespace {

inline float as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline __m256i lane_mask(int64_t n) {  // lanes < n set
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(std::clamp<int64_t>(n, 0, 8))), idx);
}

// fp32 -> bf16 bits in the low half of each 32-bit lane: round to nearest even, NaN -> quiet NaN (bitwise
// moetron::to_bf16, denormals included).
inline __m256i rne_bf16_epi32(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, q, nan);
}

// Eight fp32 -> eight bf16 at dst (the first n of them).
inline void store_bf16(bf16* dst, __m256 x, int64_t n) {
  const __m256i w = rne_bf16_epi32(x);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  if (n >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), h);
  } else {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
    std::memcpy(dst, tmp, size_t(n) * 2);
  }
}

// Accumulators of one register block: MR rows x NV vectors of 8 columns; the last vector is partial (masked)
// when MASK. Full vectors are loaded and stored unmasked (AMD masked stores are slow).
template <int MR, int NV, bool MASK>
struct Acc {
  __m256 v[MR][NV];
  __attribute__((always_inline)) void load(const float* C, int64_t ldc, bool from_c, __m256i m) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j)
        v[r][j] = !from_c                       ? _mm256_setzero_ps()
                  : (MASK && j == NV - 1) ? _mm256_maskload_ps(C + r * ldc + 8 * j, m)
                                          : _mm256_loadu_ps(C + r * ldc + 8 * j);
  }
  __attribute__((always_inline)) void store(float* C, int64_t ldc, bf16* Cb, __m256i m, int64_t nlast, bool stream) {
    stream = stream && ((uintptr_t(C) | uintptr_t(ldc * 4)) & 31) == 0;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) {
        const bool part = MASK && j == NV - 1;
        if (part)
          _mm256_maskstore_ps(C + r * ldc + 8 * j, m, v[r][j]);
        else if (stream)
          _mm256_stream_ps(C + r * ldc + 8 * j, v[r][j]);
        else
          _mm256_storeu_ps(C + r * ldc + 8 * j, v[r][j]);
        if (Cb) store_bf16(Cb + r * ldc + 8 * j, v[r][j], part ? nlast : 8);
      }
  }
};

template <int NV, bool MASK>
__attribute__((always_inline)) inline __m256 load_b(const float* B, int j, __m256i m) {
  return (MASK && j == NV - 1) ? _mm256_maskload_ps(B + 8 * j, m) : _mm256_loadu_ps(B + 8 * j);
}

// C[MR, 8*NV] (= or +=) sum over `steps` fp32 steps. a(i, s) = A[i*rs + s*ss], b(s, :) = B[s*bss + :].
template <int MR, int NV, bool MASK>
void ukr_f32(const void* Av, int64_t rs, int64_t ss, const void* Bv, int64_t bss, int64_t steps, bool, __m256i m,
             int64_t nlast, float* C, int64_t ldc, bool from_c, bf16* Cb, bool stream) {
  const float* A = static_cast<const float*>(Av);
  const float* B = static_cast<const float*>(Bv);
  Acc<MR, NV, MASK> acc;
  acc.load(C, ldc, from_c, m);
  for (int64_t s = 0; s < steps; ++s) {
    __m256 b[NV];
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) b[j] = load_b<NV, MASK>(B, j, m);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * rs);
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc.v[r][j] = _mm256_fmadd_ps(a, b[j], acc.v[r][j]);
    }
    A += ss;
    B += bss;
  }
  acc.store(C, ldc, Cb, m, nlast, stream);
}

// Lines to prefetch while the row blocks of one strip compute (the next B panel): `per` lines before each
// block, line i at base + (i / 4) * stride + 64 * (i % 4), up to `total`.
struct PanelPf {
  const char* base = nullptr;
  int64_t stride = 0, done = 0, total = 0, per = 0;
};

// fp32, whole 6 x 16 blocks: nblk row blocks of one 16-column strip in one call, block q's A at A + q*abs and
// its C at C + 6q*ldc (the same products in the same order as ukr_f32<6, 2, false>, without its per-call
// set-up). The C lines of the next block are prefetched while a block computes.
void strip_f32(const float* A, int64_t abs, int64_t rs, int64_t ss, const float* B, int64_t bss, int64_t steps,
               int64_t nblk, float* C, int64_t ldc, bool from_c, bool stream, bool cpf, PanelPf& pf) {
  const __m256i m = _mm256_set1_epi32(-1);
  for (int64_t q = 0; q < nblk; ++q, A += abs, C += kMR * ldc) {
    for (int64_t i = 0; i < pf.per && pf.done < pf.total; ++i, ++pf.done)
      _mm_prefetch(pf.base + (pf.done / 4) * pf.stride + 64 * (pf.done % 4), _MM_HINT_T1);
    if (cpf && q + 1 < nblk)
      for (int64_t i = 0; i < kMR; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(C + (kMR + i) * ldc), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(C + (kMR + i) * ldc + 15), _MM_HINT_T0);
      }
    Acc<kMR, 2, false> acc;
    acc.load(C, ldc, from_c, m);
    const float* a = A;
    const float* b = B;
    for (int64_t s = 0; s < steps; ++s) {
      const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 8
      for (int r = 0; r < kMR; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + r * rs);
        acc.v[r][0] = _mm256_fmadd_ps(av, b0, acc.v[r][0]);
        acc.v[r][1] = _mm256_fmadd_ps(av, b1, acc.v[r][1]);
      }
      a += ss;
      b += bss;
    }
    acc.store(C, ldc, nullptr, m, 8, stream);
  }
}

inline int32_t load_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
template <int NV, bool MASK>
__attribute__((always_inline)) inline __m256i load_b16(const uint16_t* B, int j, __m256i m) {
  return (MASK && j == NV - 1) ? _mm256_maskload_epi32(reinterpret_cast<const int*>(B + 16 * j), m)
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(B + 16 * j));
}

// bf16: a step is a pair. b(s, :) holds 8*NV (even, odd) pairs; they are widened to two fp32 vectors each,
// and the pair's two products go into the accumulator even element first. With half_tail, the last step's A
// pair has only its first element (the second is not read).
template <int MR, int NV, bool MASK>
void ukr_bf16(const void* Av, int64_t rs, int64_t ss, const void* Bv, int64_t bss, int64_t steps, bool half_tail,
              __m256i m, int64_t nlast, float* C, int64_t ldc, bool from_c, bf16* Cb, bool stream) {
  const uint16_t* A = static_cast<const uint16_t*>(Av);
  const uint16_t* B = static_cast<const uint16_t*>(Bv);
  const __m256i hi = _mm256_set1_epi32(int32_t(0xffff0000u));
  Acc<MR, NV, MASK> acc;
  acc.load(C, ldc, from_c, m);
  const int64_t full = steps - (half_tail ? 1 : 0);
  // Even elements of the pair for all rows, then odd ones (12 accumulators + NV B vectors + 1 A in registers).
  for (int64_t s = 0; s < full; ++s) {
    __m256 b[NV];
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) b[j] = _mm256_castsi256_ps(_mm256_slli_epi32(load_b16<NV, MASK>(B, j, m), 16));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(load_pair(A + r * rs)), 16));
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc.v[r][j] = _mm256_fmadd_ps(a, b[j], acc.v[r][j]);
    }
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) b[j] = _mm256_castsi256_ps(_mm256_and_si256(load_b16<NV, MASK>(B, j, m), hi));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(_mm256_set1_epi32(load_pair(A + r * rs)), hi));
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc.v[r][j] = _mm256_fmadd_ps(a, b[j], acc.v[r][j]);
    }
    A += ss;
    B += bss;
  }
  if (half_tail) {
    __m256 b[NV];
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) b[j] = _mm256_castsi256_ps(_mm256_slli_epi32(load_b16<NV, MASK>(B, j, m), 16));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(uint32_t(A[r * rs]) << 16)));
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc.v[r][j] = _mm256_fmadd_ps(a, b[j], acc.v[r][j]);
    }
  }
  acc.store(C, ldc, Cb, m, nlast, stream);
}

// bf16 B with the A block already widened to fp32 (a(i, s) = the floats A[i*rs + 2s], A[i*rs + 2s + 1]): the
// same products in the same order as ukr_bf16, without the per-row shift / mask of the A pair.
template <int MR, int NV, bool MASK>
void ukr_bf16_wa(const void* Av, int64_t rs, int64_t, const void* Bv, int64_t bss, int64_t steps, bool half_tail,
                 __m256i m, int64_t nlast, float* C, int64_t ldc, bool from_c, bf16* Cb, bool stream) {
  const float* A = static_cast<const float*>(Av);
  const uint16_t* B = static_cast<const uint16_t*>(Bv);
  const __m256i hi = _mm256_set1_epi32(int32_t(0xffff0000u));
  Acc<MR, NV, MASK> acc;
  acc.load(C, ldc, from_c, m);
  const int64_t full = steps - (half_tail ? 1 : 0);
  for (int64_t s = 0; s < full; ++s) {
    __m256 b[NV];
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) b[j] = _mm256_castsi256_ps(_mm256_slli_epi32(load_b16<NV, MASK>(B, j, m), 16));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * rs);
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc.v[r][j] = _mm256_fmadd_ps(a, b[j], acc.v[r][j]);
    }
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) b[j] = _mm256_castsi256_ps(_mm256_and_si256(load_b16<NV, MASK>(B, j, m), hi));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * rs + 1);
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc.v[r][j] = _mm256_fmadd_ps(a, b[j], acc.v[r][j]);
    }
    A += 2;
    B += bss;
  }
  if (half_tail) {
    __m256 b[NV];
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) b[j] = _mm256_castsi256_ps(_mm256_slli_epi32(load_b16<NV, MASK>(B, j, m), 16));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * rs);
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc.v[r][j] = _mm256_fmadd_ps(a, b[j], acc.v[r][j]);
    }
  }
  acc.store(C, ldc, Cb, m, nlast, stream);
}

using UkrFn = void (*)(const void*, int64_t, int64_t, const void*, int64_t, int64_t, bool, __m256i, int64_t, float*,
                       int64_t, bool, bf16*, bool);

enum Kind { kF32 = 0, kBf16 = 1, kBf16WideA = 2 };

template <int KIND, int MR, int NV, bool MASK>
constexpr UkrFn ukr_of() {
  if constexpr (KIND == kBf16)
    return &ukr_bf16<MR, NV, MASK>;
  else if constexpr (KIND == kBf16WideA)
    return &ukr_bf16_wa<MR, NV, MASK>;
  else
    return &ukr_f32<MR, NV, MASK>;
}

// t[mr-1][nv-1][mask]
template <int KIND>
struct Table {
  UkrFn t[kMR][2][2];
  template <int MR>
  constexpr void fill_row() {
    t[MR - 1][0][0] = ukr_of<KIND, MR, 1, false>();
    t[MR - 1][0][1] = ukr_of<KIND, MR, 1, true>();
    t[MR - 1][1][0] = ukr_of<KIND, MR, 2, false>();
    t[MR - 1][1][1] = ukr_of<KIND, MR, 2, true>();
  }
  constexpr Table() : t{} {
    fill_row<1>(), fill_row<2>(), fill_row<3>(), fill_row<4>(), fill_row<5>(), fill_row<6>();
  }
};
template <int KIND>
constexpr Table<KIND> kTable{};

// Copies the 16-column strips of one panel of B (ns steps of up to 64 columns at src + s * sstride bytes, nc
// valid columns) into contiguous strips: dst + (q * ns + s) * 64 bytes holds columns 16q .. 16q + 15 of step s
// (zero beyond nc). Reads whole 256-byte panel rows in order (a sequential stream for the prefetchers); B
// columns beyond nc are not read.
inline void copy_panel(char* dst, const char* src, int64_t sstride, int64_t ns, int64_t nc) {
  const int64_t nq = std::min<int64_t>(4, (nc + 15) / 16);
  for (int64_t s = 0; s < ns; ++s) {
    const char* p = src + s * sstride;
    for (int64_t q = 0; q < nq; ++q) {
      const int64_t lanes = std::min<int64_t>(16, nc - 16 * q);  // 32-bit lanes: an fp32 or a bf16 pair each
      __m256i v0, v1;
      if (lanes >= 16) {
        v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * q));
        v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * q + 32));
      } else {
        v0 = _mm256_maskload_epi32(reinterpret_cast<const int*>(p + 64 * q), lane_mask(lanes));
        v1 = _mm256_maskload_epi32(reinterpret_cast<const int*>(p + 64 * q + 32), lane_mask(lanes - 8));
      }
      char* d = dst + (q * ns + s) * 64;
      _mm256_store_si256(reinterpret_cast<__m256i*>(d), v0);
      _mm256_store_si256(reinterpret_cast<__m256i*>(d + 32), v1);
    }
  }
}

// Grow-only 64-byte aligned per-thread buffers: slot 0 for the panel copies, slot 1 for the widened A block.
char* thread_buffer(int slot, size_t bytes) {
  struct Buf {
    char* p = nullptr;
    size_t n = 0;
    ~Buf() { std::free(p); }
  };
  static thread_local Buf b[2];
  if (bytes > b[slot].n) {
    std::free(b[slot].p);
    b[slot].p = static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    b[slot].n = b[slot].p ? bytes : 0;
  }
  return b[slot].p;
}

// The bf16 A block of rows [0, rows) x steps [s0, s0 + ns) widened to fp32, row r at out + r * 2 * ns:
// (even, odd) floats per step; with odd_tail the last step's odd element is not read (0 is stored).
void widen_a(float* out, const Tile& t, int64_t s0, int64_t ns, bool odd_tail) {
  const uint16_t* A = static_cast<const uint16_t*>(t.A);
  for (int64_t r = 0; r < t.rows; ++r) {
    const uint16_t* a = A + (r / t.a_rb) * t.a_bs + (r % t.a_rb) * t.a_rs + s0 * t.a_ss;
    float* o = out + r * 2 * ns;
    const int64_t n = 2 * ns - (odd_tail ? 1 : 0);  // elements to read
    if (t.a_ss == 2) {  // the row's pairs are contiguous
      int64_t j = 0;
      for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(o + j, _mm256_castsi256_ps(_mm256_slli_epi32(
                                    _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + j))), 16)));
      for (; j < n; ++j) o[j] = as_float(uint32_t(a[j]) << 16);
    } else {
      for (int64_t s = 0; s < ns; ++s) {
        o[2 * s] = as_float(uint32_t(a[s * t.a_ss]) << 16);
        if (2 * s + 1 < n) o[2 * s + 1] = as_float(uint32_t(a[s * t.a_ss + 1]) << 16);
      }
    }
    if (n < 2 * ns) o[n] = 0.0f;
  }
}

// Loop order inside a K block (tuning().order_avx2): 0 = 16-column strip outer (the strip's B block, kc x 64
// bytes, stays in L1 while the row blocks stream past), 1 = row block outer (the 6-row A block stays in L1
// while the strips stream past). Rows come in groups of a_rb (an A block never straddles a group). With order
// 0, B in 64-column panels (packed weights, or a row-major matrix read in place) and at least 3 row blocks,
// each panel is first copied into 4 contiguous strips: inside a 64-column panel (or a row-major matrix) a
// strip's rows sit 256 bytes (or ldb) apart, which maps them onto a quarter (or fewer) of the L1 sets, so the
// strip would not stay in L1, and a strided stream is also a poor one for the hardware prefetchers.
template <bool BF>
void run_tile(const Tile& t, int64_t kc_max) {
  const int64_t esz = BF ? 2 : 4, pair = BF ? 2 : 1;  // bytes per element; elements per B column per step
  const int64_t nkb = std::max<int64_t>(1, (t.steps + kc_max - 1) / kc_max);
  const int64_t kc = std::max<int64_t>(1, (t.steps + nkb - 1) / nkb);  // equal blocks
  const char* A = static_cast<const char*>(t.A);
  const char* B = static_cast<const char*>(t.B);
  const int64_t nstrips = (t.cols + 15) / 16;
  const int order = tuning().order_avx2;
  const int64_t nrb = (t.rows + kMR - 1) / kMR + (t.rows + t.a_rb - 1) / t.a_rb - 1;  // row blocks per strip
  const bool copy = order == 0 && t.b_pw == kPanel && nrb >= 3 && tuning().strip_copy_avx2;
  char* pbuf = copy ? thread_buffer(0, size_t(4 * kc * 64)) : nullptr;
  // bf16: with order 0 and several strips, each row block's A pairs would be shifted / masked once per strip;
  // widen the K block of A to fp32 once instead (up to 192 KiB; larger tiles keep the plain path).
  const bool wide = BF && order == 0 && nstrips >= 2 && t.rows * 2 * kc * 4 <= (192 << 10) && tuning().widen_a_avx2;
  float* abuf = wide ? reinterpret_cast<float*>(thread_buffer(1, size_t(t.rows * 2 * kc * 4))) : nullptr;
  // Prefetch hint: spread the lines of t.pf over the microkernel calls of the first K block.
  const int64_t ncalls = nstrips * nrb;
  const int64_t pf_lines0 = (t.pf_bytes[0] + 63) / 64, pf_lines = pf_lines0 + (t.pf_bytes[1] + 63) / 64;
  const int64_t pf_per_call = pf_lines ? (pf_lines + ncalls - 1) / ncalls : 0;
  int64_t pf_next = 0;
  int64_t s0 = 0;
  do {
    const int64_t ns = std::min(kc, t.steps - s0);
    const bool last = s0 + ns >= t.steps;
    const bool from_c = s0 > 0 || t.accumulate;
    const bool tail = last && t.a_odd_tail;
    // One microkernel call: rows [r0, r0 + 6) of group g0 (rows < ge), strip st, B at Bp with step stride bss.
    auto call = [&](int64_t st, int64_t g0, int64_t r0, int64_t ge, const char* Bp, int64_t bss) {
      for (int64_t i = 0; i < pf_per_call && pf_next < pf_lines; ++i, ++pf_next)
        _mm_prefetch(pf_next < pf_lines0 ? t.pf[0] + 64 * pf_next : t.pf[1] + 64 * (pf_next - pf_lines0),
                     _MM_HINT_T1);
      const int64_t c = 16 * st, nc = std::min<int64_t>(16, t.cols - c);
      const int nv = nc > 8 ? 2 : 1;
      const int64_t nlast = nc - 8 * (nv - 1);
      const int mr = int(std::min<int64_t>(kMR, ge - r0));
      const char* Ap = A + ((g0 / t.a_rb) * t.a_bs + (r0 - g0) * t.a_rs + s0 * t.a_ss) * esz;
      // Prefetch the C block of the next call (its accumulators start from C, or it stores there), so that
      // its first FMAs do not wait for L2 / L3.
      if (t.cprefetch) {
        int64_t nr0 = r0, nst = st;
        if (order == 0) {
          nr0 = r0 + kMR < ge ? r0 + kMR : g0 + t.a_rb, nst = st;
          if (nr0 >= t.rows) nr0 = 0, nst = st + 1;
        } else {
          nst = st + 1 < nstrips ? st + 1 : 0, nr0 = st + 1 < nstrips ? r0 : r0 + kMR;
        }
        if (nst < nstrips && nr0 < t.rows) {
          const float* cn = t.C + nr0 * t.ldc + 16 * nst;
          const int64_t nrows = std::min<int64_t>(kMR, t.rows - nr0);
          const int64_t span = std::min<int64_t>(16, t.cols - 16 * nst) - 1;
          for (int64_t i = 0; i < nrows; ++i) {
            _mm_prefetch(reinterpret_cast<const char*>(cn + i * t.ldc), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(cn + i * t.ldc + span), _MM_HINT_T0);
          }
        }
      }
      const UkrFn fn = wide ? kTable<kBf16WideA>.t[mr - 1][nv - 1][nlast < 8]
                            : kTable<BF ? kBf16 : kF32>.t[mr - 1][nv - 1][nlast < 8];
      fn(wide ? static_cast<const void*>(abuf + r0 * 2 * ns) : Ap, wide ? 2 * ns : t.a_rs, t.a_ss, Bp, bss, ns, tail,
         lane_mask(nlast), nlast, t.C + r0 * t.ldc + c, t.ldc, from_c, last && t.Cb ? t.Cb + r0 * t.ldc + c : nullptr,
         last && t.stream);
    };
    auto strip_b = [&](int64_t st) {
      const int64_t c = 16 * st;
      return B + ((c / t.b_pw) * t.b_ps + s0 * t.b_ss + (c % t.b_pw) * pair) * esz;
    };
    if (wide) widen_a(abuf, t, s0, ns, tail);
    const bool fast = !BF && t.a_rb == kMR && !t.Cb && pf_lines == 0 && tuning().strip_f32_avx2;
    if (order == 0) {
      const char* pf_panel = nullptr;
      int64_t pf_lines_p = 0, pf_per = 0, pf_done = 0;
      for (int64_t st = 0; st < nstrips; ++st) {
        const char* Bp = strip_b(st);
        int64_t bss = t.b_ss;
        if (pbuf) {
          if (st % 4 == 0) copy_panel(pbuf, Bp, t.b_ss * esz, ns, std::min<int64_t>(kPanel, t.cols - 16 * st));
          Bp = pbuf + (st % 4) * ns * 64, bss = 16 * pair;
        }
        // While a panel computes, prefetch the next panel's rows (to L2), spread over the panel's calls.
        if (pbuf && st % 4 == 0) {
          const int64_t np = std::min<int64_t>(4, nstrips - st);
          pf_panel = st + 4 < nstrips && tuning().strip_pf_avx2 ? strip_b(st + 4) : nullptr;
          pf_lines_p = pf_panel ? ns * 4 : 0, pf_per = pf_panel ? (pf_lines_p + np * nrb - 1) / (np * nrb) : 0;
          pf_done = 0;
        }
        int64_t g_start = 0;
        // fp32 whole 6 x 16 blocks (rows in groups of 6, a full strip, no bf16 copy of C, no prefetch hints of
        // the caller): one strip_f32 call for all of them; the rest, if any, block by block below.
        if (!BF && fast && 16 * st + 16 <= t.cols) {
          const int64_t nblk = t.rows / kMR;
          PanelPf ppf{pf_panel, t.b_ss * esz, pf_done, pf_lines_p, pf_per};
          strip_f32(reinterpret_cast<const float*>(A) + s0 * t.a_ss, t.a_bs, t.a_rs, t.a_ss,
                    reinterpret_cast<const float*>(Bp), bss, ns, nblk, t.C + 16 * st, t.ldc, from_c,
                    last && t.stream, t.cprefetch, ppf);
          pf_done = ppf.done;
          g_start = nblk * kMR;
        }
        for (int64_t g0 = g_start; g0 < t.rows; g0 += t.a_rb) {
          const int64_t ge = std::min(g0 + t.a_rb, t.rows);
          for (int64_t r0 = g0; r0 < ge; r0 += kMR) {
            for (int64_t i = 0; i < pf_per && pf_done < pf_lines_p; ++i, ++pf_done)
              _mm_prefetch(pf_panel + (pf_done / 4) * t.b_ss * esz + 64 * (pf_done % 4), _MM_HINT_T1);
            call(st, g0, r0, ge, Bp, bss);
          }
        }
      }
    } else {
      for (int64_t g0 = 0; g0 < t.rows; g0 += t.a_rb) {
        const int64_t ge = std::min(g0 + t.a_rb, t.rows);
        for (int64_t r0 = g0; r0 < ge; r0 += kMR)
          for (int64_t st = 0; st < nstrips; ++st) call(st, g0, r0, ge, strip_b(st), t.b_ss);
      }
    }
    s0 += ns;
  } while (s0 < t.steps);
  if (t.stream) _mm_sfence();
}

}  // namespace

void tile_bf16_avx2(const Tile& t) { run_tile<true>(t, tuning().kc_bf16_avx2); }
void tile_f32_avx2(const Tile& t) { run_tile<false>(t, tuning().kc_f32_avx2); }

void gemm_epilogue_f32_avx2(float* C, int64_t ldc, const float* S, int64_t lds, int64_t rows, int64_t cols,
                            float alpha, float beta) {
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  for (int64_t i = 0; i < rows; ++i) {
    float* c = C + i * ldc;
    const float* s = S + i * lds;
    int64_t j = 0;
    if (beta == 0.0f) {
      for (; j + 8 <= cols; j += 8) _mm256_storeu_ps(c + j, _mm256_mul_ps(va, _mm256_loadu_ps(s + j)));
      for (; j < cols; ++j) c[j] = alpha * s[j];
    } else {
      for (; j + 8 <= cols; j += 8)
        _mm256_storeu_ps(c + j, _mm256_fmadd_ps(vb, _mm256_loadu_ps(c + j), _mm256_mul_ps(va, _mm256_loadu_ps(s + j))));
      for (; j < cols; ++j) {  // the same fused multiply-add on one lane
        const __m128 r = _mm_fmadd_ss(_mm_set_ss(beta), _mm_set_ss(c[j]), _mm_set_ss(alpha * s[j]));
        c[j] = _mm_cvtss_f32(r);
      }
    }
  }
}

void pack_bt_panel_f32_avx2(float* out, const float* Bt, int64_t ldb, int64_t steps, int64_t pc, int64_t w) {
  // out[s][c] = Bt[c * ldb + s]: 8 x 8 blocks through an in-register transpose; the edges by scalar code.
  const int64_t s8 = steps / 8 * 8, c8 = pc / 8 * 8;
  for (int64_t c = 0; c < c8; c += 8) {
    for (int64_t s = 0; s < s8; s += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(Bt + (c + i) * ldb + s);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
      float* o = out + s * w + c;
      _mm256_storeu_ps(o + 0 * w, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * w, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * w, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * w, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * w, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * w, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * w, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * w, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
    for (int64_t s = s8; s < steps; ++s)
      for (int64_t i = 0; i < 8; ++i) out[s * w + c + i] = Bt[(c + i) * ldb + s];
  }
  for (int64_t c = c8; c < w; ++c)
    for (int64_t s = 0; s < steps; ++s) out[s * w + c] = c < pc ? Bt[c * ldb + s] : 0.0f;
}

void pack_a_rows_f32_avx2(float* out, const float* A, int64_t lda, int64_t rows, int64_t ns) {
  // Six rows at a time: 8 steps of each through an 8 x 8 transpose (rows 6 and 7 are don't-cares), stored as
  // 8 overlapping 8-float writes 6 floats apart in increasing order, so each write's two spare lanes are
  // overwritten by the next one; the last write of a micro-panel spills 2 floats into the next micro-panel
  // (written later) or the buffer's slack.
  const int64_t nq = (rows + kMR - 1) / kMR, s8 = ns / 8 * 8;
  for (int64_t q = 0; q < nq; ++q) {
    float* o = out + q * kMR * ns;
    const int64_t nr = std::min<int64_t>(kMR, rows - q * kMR);
    const float* a[kMR];
    for (int64_t i = 0; i < kMR; ++i) a[i] = A + (q * kMR + std::min(i, nr - 1)) * lda;
    if (nr == kMR) {
      for (int64_t s = 0; s < s8; s += 8) {
        const __m256 r0 = _mm256_loadu_ps(a[0] + s), r1 = _mm256_loadu_ps(a[1] + s);
        const __m256 r2 = _mm256_loadu_ps(a[2] + s), r3 = _mm256_loadu_ps(a[3] + s);
        const __m256 r4 = _mm256_loadu_ps(a[4] + s), r5 = _mm256_loadu_ps(a[5] + s);
        const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
        const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
        const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
        // u_k: rows 0-3 of step k (low half) and step k + 4 (high half); v_k: rows 4-5 of the same steps.
        const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xee),
                             _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xee)};
        const __m256 v[4] = {_mm256_shuffle_ps(t4, t4, 0x44), _mm256_shuffle_ps(t4, t4, 0xee),
                             _mm256_shuffle_ps(t5, t5, 0x44), _mm256_shuffle_ps(t5, t5, 0xee)};
        float* d = o + s * kMR;
        for (int k = 0; k < 4; ++k) _mm256_storeu_ps(d + k * kMR, _mm256_permute2f128_ps(u[k], v[k], 0x20));
        for (int k = 0; k < 4; ++k) _mm256_storeu_ps(d + (k + 4) * kMR, _mm256_permute2f128_ps(u[k], v[k], 0x31));
      }
    }
    for (int64_t s = nr == kMR ? s8 : 0; s < ns; ++s)
      for (int64_t i = 0; i < kMR; ++i) o[s * kMR + i] = i < nr ? a[i][s] : 0.0f;
  }
}

inline constexpr int64_t kPackAhead = 6;  // rows of lookahead for the A^T packer's prefetches

void pack_at_f32_avx2(float* out, const float* A, int64_t lda, int64_t rows, int64_t avail, int64_t ns) {
  // Row s of the stored A holds the 6-row groups of op(A) contiguously: copy each group with one 8-float load
  // and one 8-float store into its micro-panel; the store's 2 extra floats land on the slot of step s + 1 of
  // the same micro-panel, written later (steps go in increasing order), except at the last step, which is
  // stored with a 6-lane mask. Groups whose 8-float load would pass `avail` columns use scalar code.
  const int64_t nq = (rows + kMR - 1) / kMR;
  const __m256i m6 = lane_mask(kMR);
  for (int64_t s = 0; s < ns; ++s) {
    const float* a = A + s * lda;
    if (s + kPackAhead < ns)  // rows of A sit lda apart: prefetch a few rows ahead
      for (int64_t c = 0; c < rows; c += 16) _mm_prefetch(reinterpret_cast<const char*>(a + kPackAhead * lda + c), _MM_HINT_T0);
    for (int64_t q = 0; q < nq; ++q) {
      float* o = out + q * kMR * ns + s * kMR;
      const int64_t r = q * kMR;
      if (r + 8 <= avail && r + kMR <= rows) {
        const __m256 v = _mm256_loadu_ps(a + r);
        if (s + 1 < ns)
          _mm256_storeu_ps(o, v);
        else
          _mm256_maskstore_ps(o, m6, v);
      } else {
        for (int64_t i = 0; i < kMR; ++i) o[i] = r + i < rows ? a[r + i] : 0.0f;
      }
    }
  }
}

void pack_pairs_avx2(bf16* out, int64_t panel_stride, const bf16* in, int64_t ld, int64_t n_rows, int64_t cols) {
  // Word c of the output row pair p is (row 2p, column c) | (row 2p+1, column c) << 16: unpacklo/hi of the two
  // rows' 16-bit elements, 16 columns at a time (an in-lane interleave, fixed up by the 128-bit lane order).
  const int64_t width = (cols + kPanel - 1) / kPanel * kPanel, npairs = (n_rows + 1) / 2;
  const int64_t c16 = cols / 16 * 16;
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t p = 0; p < npairs; ++p) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(in + 2 * p * ld);
    const uint16_t* r1 = 2 * p + 1 < n_rows ? reinterpret_cast<const uint16_t*>(in + (2 * p + 1) * ld) : nullptr;
    for (int64_t c = 0; c < c16; c += 16) {  // 16 columns never cross a 64-column panel
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + c));
      const __m256i b = r1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + c)) : _mm256_setzero_si256();
      const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
      uint16_t* dst = o + (c / kPanel) * panel_stride + p * 2 * kPanel + 2 * (c % kPanel);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
    for (int64_t c = c16; c < width; ++c) {
      uint16_t* dst = o + (c / kPanel) * panel_stride + p * 2 * kPanel + 2 * (c % kPanel);
      dst[0] = c < cols ? r0[c] : uint16_t(0);
      dst[1] = (c < cols && r1) ? r1[c] : uint16_t(0);
    }
  }
}

}  // namespace moetron::gg
