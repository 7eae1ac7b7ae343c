// grouped_gemm_avx512.cpp: AVX-512 tile kernels for the grouped GEMM (see grouped_gemm_tile.h).
// bf16: register-blocked MR x (16*NV) microkernel on vdpbf16ps (AVX512-BF16): A pairs are broadcast, B comes
// packed in VNNI pairs; fp32 accumulators stay in registers for a whole K block. fp32: the same blocking with
// vfmadd231ps. Also the row-pair interleave used to pack wgrad operands. Not a scheduler: the dispatcher in
// grouped_gemm.cpp decides the work items. Compiled with -mavx512f/bw/vl/dq/bf16; everything but the entry
// points is file-local.
#include <immintrin.h>

// GCC 12 reports a false -Wmaybe-uninitialized inside its own avx512fintrin.h shift intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/grouped_gemm_tile.h"
#include "kernels/mask_avx512.h"
#include "kernels/transpose_avx512.h"

namespace moetron::gg {

namespace {

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Store one accumulator row block: C (fp32) and optionally Cb (bf16).
template <int MR, int NV>
inline void store_acc(__m512 (&acc)[MR][NV], float* C, int64_t ldc, bf16* Cb, __mmask16 mlast, bool stream) {
  stream = stream && ((uintptr_t(C) | uintptr_t(ldc * 4)) & 63) == 0;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      __mmask16 m = v == NV - 1 ? mlast : __mmask16(0xffff);
      if (stream && m == 0xffff)
        _mm512_stream_ps(C + r * ldc + 16 * v, acc[r][v]);
      else
        _mm512_mask_storeu_ps(C + r * ldc + 16 * v, m, acc[r][v]);
      if (Cb) {
        __m256i h = (__m256i)_mm512_cvtneps_pbh(acc[r][v]);
        _mm256_mask_storeu_epi16(Cb + r * ldc + 16 * v, m, h);
      }
    }
}

template <int MR, int NV>
inline void load_acc(__m512 (&acc)[MR][NV], const float* C, int64_t ldc, bool from_c, __mmask16 mlast) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = from_c ? _mm512_maskz_loadu_ps(v == NV - 1 ? mlast : __mmask16(0xffff), C + r * ldc + 16 * v)
                         : _mm512_setzero_ps();
}

// C[MR, 16*NV (last vector masked)] (= or +=) sum over `steps` pairs. A, B point at the block's first step.
template <int MR, int NV>
void ukr_bf16(const uint16_t* A, int64_t rs, int64_t ss, const uint16_t* B, int64_t bss, int64_t steps, bool half_tail,
              __mmask16 mlast, float* C, int64_t ldc, bool from_c, bf16* Cb, bool stream) {
  __m512 acc[MR][NV];
  load_acc<MR, NV>(acc, C, ldc, from_c, mlast);
  const int64_t full = steps - (half_tail ? 1 : 0);
  for (int64_t s = 0; s < full; ++s) {
    __m512bh b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      b[v] = (__m512bh)(v == NV - 1 ? _mm512_maskz_loadu_epi32(mlast, B + 32 * v) : _mm512_loadu_si512(B + 32 * v));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512bh a = (__m512bh)_mm512_set1_epi32(load_i32(A + r * rs));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b[v], a);
    }
    A += ss;
    B += bss;
  }
  if (half_tail) {  // K odd: only the first element of the last A pair exists
    __m512bh b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_maskz_loadu_epi32(v == NV - 1 ? mlast : 0xffff, B + 32 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(A[r * rs]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b[v], a);
    }
  }
  store_acc<MR, NV>(acc, C, ldc, Cb, mlast, stream);
}

template <int MR, int NV>
void ukr_f32(const float* A, int64_t rs, int64_t ss, const float* B, int64_t bss, int64_t steps, bool, __mmask16 mlast,
             float* C, int64_t ldc, bool from_c, bf16* Cb, bool stream) {
  __m512 acc[MR][NV];
  load_acc<MR, NV>(acc, C, ldc, from_c, mlast);
  for (int64_t s = 0; s < steps; ++s) {
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      b[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(mlast, B + 16 * v) : _mm512_loadu_ps(B + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512 a = _mm512_set1_ps(A[r * rs]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
    }
    A += ss;
    B += bss;
  }
  store_acc<MR, NV>(acc, C, ldc, Cb, mlast, stream);
}

template <class E>
using UkrFn = void (*)(const E*, int64_t, int64_t, const E*, int64_t, int64_t, bool, __mmask16, float*, int64_t, bool,
                       bf16*, bool);

template <class E, template <int, int> class K>
struct Table;

template <int MR, int NV>
struct Bf16K {
  static constexpr UkrFn<uint16_t> fn = &ukr_bf16<MR, NV>;
};
template <int MR, int NV>
struct F32K {
  static constexpr UkrFn<float> fn = &ukr_f32<MR, NV>;
};

template <class E, template <int, int> class K>
constexpr UkrFn<E> pick(int mr, int nv) {
  constexpr UkrFn<E> t[kMR][4] = {
      {K<1, 1>::fn, K<1, 2>::fn, K<1, 3>::fn, K<1, 4>::fn}, {K<2, 1>::fn, K<2, 2>::fn, K<2, 3>::fn, K<2, 4>::fn},
      {K<3, 1>::fn, K<3, 2>::fn, K<3, 3>::fn, K<3, 4>::fn}, {K<4, 1>::fn, K<4, 2>::fn, K<4, 3>::fn, K<4, 4>::fn},
      {K<5, 1>::fn, K<5, 2>::fn, K<5, 3>::fn, K<5, 4>::fn}, {K<6, 1>::fn, K<6, 2>::fn, K<6, 3>::fn, K<6, 4>::fn}};
  return t[mr - 1][nv - 1];
}

// Loop order: K block -> 64-column panel -> MR-row block. The B block (kc steps x 64 columns) stays in L1
// while all row blocks of the tile stream past it; partial sums go through C between K blocks, which keeps
// the per-element summation order the plain sequential one.
template <class E, template <int, int> class K>
void run_tile(const Tile& t, int64_t kc_max, int64_t step_elems) {
  const int64_t nkb = std::max<int64_t>(1, (t.steps + kc_max - 1) / kc_max);
  const int64_t kc = std::max<int64_t>(1, (t.steps + nkb - 1) / nkb);  // equal blocks
  const E* A = static_cast<const E*>(t.A);
  const E* B = static_cast<const E*>(t.B);
  const int64_t npanels = (t.cols + kPanel - 1) / kPanel;
  // Prefetch hint: spread the lines of t.pf over the microkernel calls of the first K block.
  const int64_t ncalls = npanels * ((t.rows + kMR - 1) / kMR + (t.rows + t.a_rb - 1) / t.a_rb);
  const int64_t pf_lines0 = (t.pf_bytes[0] + 63) / 64, pf_lines = pf_lines0 + (t.pf_bytes[1] + 63) / 64;
  const int64_t pf_per_call = pf_lines ? (pf_lines + ncalls - 1) / ncalls : 0;
  int64_t pf_next = 0;
  auto prefetch_some = [&] {
    for (int64_t i = 0; i < pf_per_call && pf_next < pf_lines; ++i, ++pf_next) {
      const char* a = pf_next < pf_lines0 ? t.pf[0] + 64 * pf_next : t.pf[1] + 64 * (pf_next - pf_lines0);
      _mm_prefetch(a, _MM_HINT_T1);
    }
  };
  int64_t s0 = 0;
  do {
    const int64_t ns = std::min(kc, t.steps - s0);
    const bool last = s0 + ns >= t.steps;
    const bool from_c = s0 > 0 || t.accumulate;
    const bool tail = last && t.a_odd_tail;
    const int order = tuning().order;
    // Row blocks of kMR inside groups of a_rb rows (an A block never straddles a group).
    auto call = [&](int64_t p, int64_t g0, int64_t r0, int64_t ge) {
      if (pf_next < pf_lines) prefetch_some();
      const int64_t pc = std::min(kPanel, t.cols - p * kPanel);
      const int nv = int((pc + 15) / 16);
      const __mmask16 mlast = mask16(pc - 16 * (nv - 1));
      const E* Bp = B + p * t.b_ps + s0 * t.b_ss;
      const int mr = int(std::min<int64_t>(kMR, ge - r0));
      pick<E, K>(mr, nv)(A + (g0 / t.a_rb) * t.a_bs + (r0 - g0) * t.a_rs + s0 * t.a_ss, t.a_rs, t.a_ss, Bp, t.b_ss, ns,
                         tail, mlast, t.C + r0 * t.ldc + p * kPanel, t.ldc, from_c,
                         last && t.Cb ? t.Cb + r0 * t.ldc + p * kPanel : nullptr, last && t.stream);
    };
    for (int64_t g0 = 0; g0 < t.rows; g0 += t.a_rb) {
      const int64_t ge = std::min(g0 + t.a_rb, t.rows);
      if (order == 0) {
        for (int64_t p = 0; p < npanels; ++p)
          for (int64_t r0 = g0; r0 < ge; r0 += kMR) call(p, g0, r0, ge);
      } else {
        for (int64_t r0 = g0; r0 < ge; r0 += kMR)
          for (int64_t p = 0; p < npanels; ++p) call(p, g0, r0, ge);
      }
    }
    s0 += ns;
  } while (s0 < t.steps);
  if (t.stream) _mm_sfence();  // order the non-temporal stores before the region's closing barrier
  (void)step_elems;
}

}  // namespace

void tile_bf16_avx512(const Tile& t) { run_tile<uint16_t, Bf16K>(t, tuning().kc_bf16, 2); }
void tile_f32_avx512(const Tile& t) { run_tile<float, F32K>(t, tuning().kc_f32, 1); }

void pack_pairs_avx512(bf16* out, int64_t panel_stride, const bf16* in, int64_t ld, int64_t n_rows, int64_t cols) {
  // vpermt2w: element 2c+j of the result is row j, column c (lo: columns 0..15 of the chunk, hi: 16..31).
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 32; ++i) {
    lo_idx[i] = uint16_t((i / 2) + (i % 2 ? 32 : 0));
    hi_idx[i] = uint16_t(16 + (i / 2) + (i % 2 ? 32 : 0));
  }
  const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_load_si512(hi_idx);
  const int64_t width = (cols + kPanel - 1) / kPanel * kPanel, npairs = (n_rows + 1) / 2;
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t p = 0; p < npairs; ++p) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(in + 2 * p * ld);
    const uint16_t* r1 = 2 * p + 1 < n_rows ? reinterpret_cast<const uint16_t*>(in + (2 * p + 1) * ld) : nullptr;
    for (int64_t c = 0; c < width; c += 32) {  // a 32-column chunk never crosses a panel
      const int64_t nc = std::clamp<int64_t>(cols - c, 0, 32);
      const __mmask32 lm = nc >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << nc) - 1u);
      const __m512i a = _mm512_maskz_loadu_epi16(lm, r0 + c);
      const __m512i b = r1 ? _mm512_maskz_loadu_epi16(lm, r1 + c) : _mm512_setzero_si512();
      uint16_t* dst = o + (c / kPanel) * panel_stride + p * 2 * kPanel + 2 * (c % kPanel);
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, ilo, b));
      _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(a, ihi, b));
    }
  }
}

namespace {
// fp32 -> bf16 bits in the low 16 bits of each 32-bit lane, round to nearest even, NaN -> quiet NaN
// (bitwise the same as moetron::to_bf16, denormals included).
inline __m512i rne_bf16_epi32(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}
}  // namespace

// The panel's 64-byte lines are written with streaming stores (no read for ownership: a packed tensor is written
// whole and read later by the GEMMs, from memory for all but the smallest), then fenced. out: 64-byte aligned.
void pack_weight_panel_bf16_avx512(bf16* out, const float* We, int64_t K, int64_t N, bool fwd, int64_t c0, int64_t pc,
                                   int64_t steps) {
  uint32_t* o = reinterpret_cast<uint32_t*>(out);  // one 32-bit word per (step, column) pair
  if (fwd) {                                       // word (s, c) = (W[2s][c0+c], W[2s+1][c0+c])
    for (int64_t s = 0; s < steps; ++s) {
      const float* r0 = We + 2 * s * N + c0;
      const float* r1 = 2 * s + 1 < K ? r0 + N : nullptr;
      for (int v = 0; v < 4; ++v) {
        const __mmask16 m = mask16(std::max<int64_t>(0, pc - 16 * v));
        const __m512i lo = rne_bf16_epi32(_mm512_maskz_loadu_ps(m, r0 + 16 * v));
        const __m512i hi = r1 ? rne_bf16_epi32(_mm512_maskz_loadu_ps(m, r1 + 16 * v)) : _mm512_setzero_si512();
        _mm512_stream_si512(reinterpret_cast<__m512i*>(o + s * kPanel + 16 * v),
                            _mm512_maskz_or_epi32(m, lo, _mm512_slli_epi32(hi, 16)));
      }
    }
    _mm_sfence();
    return;
  }
  // dgrad: word (q, c) = (W[c0+c][2q], W[c0+c][2q+1]) = word q of row c0+c converted to bf16. Blocks of 16
  // columns x 16 words: each row's 16 words in one zmm, then a 16 x 16 transpose gives 16 steps' 64-byte runs
  // of the panel, stored whole (was one 32-bit store per word).
  const __m512i evens = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26,
                                         24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  for (int64_t cb = 0; cb < kPanel; cb += 16)
    for (int64_t q0 = 0; q0 < steps; q0 += 16) {
      __m512i v[16], w[16];
      const int64_t j = 2 * q0;  // first element of the block's words in each row
      const __mmask16 ma = mask16(std::max<int64_t>(0, N - j)), mb = mask16(std::max<int64_t>(0, N - j - 16));
      for (int k = 0; k < 16; ++k) {
        if (cb + k >= pc) {
          v[k] = _mm512_setzero_si512();
          continue;
        }
        const float* row = We + (c0 + cb + k) * N + j;
        const __m512i a = rne_bf16_epi32(_mm512_maskz_loadu_ps(ma, row));       // elements j .. j+15
        const __m512i b = rne_bf16_epi32(_mm512_maskz_loadu_ps(mb, row + 16));  // elements j+16 .. j+31
        v[k] = _mm512_permutex2var_epi16(a, evens, b);  // words (a0,a1) .. (b14,b15): even lanes low, odd high
      }
      transpose16x16_epi32(v, w);
      const int64_t nq = std::min<int64_t>(16, steps - q0);
      for (int64_t q = 0; q < nq; ++q)
        _mm512_stream_si512(reinterpret_cast<__m512i*>(o + (q0 + q) * kPanel + cb), w[q]);
    }
  _mm_sfence();
}

}  // namespace moetron::gg
