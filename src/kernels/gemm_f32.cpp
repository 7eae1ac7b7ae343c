// gemm_f32.cpp: the batch-invariant dense fp32 GEMM (gemm.h): a driver around the grouped GEMM's tile kernels
// (grouped_gemm_tile.h; a dense GEMM is their one-expert case). Every element of C is
//   acc = sum over k = 0..K-1 of op(A)[i][k] * op(B)[k][j]   (fused multiply-adds from 0, k in order; the
//                                                             scalar ISA level multiplies, then adds)
//   C   = alpha * acc                   if beta == 0 (C is not read)
//   C   = fma(beta, C, alpha * acc)     otherwise
// whatever the shape, the tiling and the thread count, so row i of C does not depend on M or on the rows around
// it (and column j not on N). Not oneDNN (gemm_f32_onednn in gemm.cpp) and not the grouped GEMM driver.
//
// Loop structure (the classic one, with the parallel loop over C tiles):
//   column block jc (nc columns of C)
//     K phase (kp equal K blocks of kc steps): pack op(B)[phase, jc] into panels of pw columns (shared,
//       all threads), one barrier, then the work items (mt-row x nt-column tiles of C, dynamic schedule), each
//       running its K blocks in order: pack the op(A) block into 6-row micro-panels (per thread) if needed,
//       run the tile kernel with the partial sums carried through C (or a scratch when beta != 0).
// The packed op(B) is double-buffered so a phase needs one barrier. pw is 16 for the AVX2 and scalar kernels
// (a 16-column strip of B is then kc x 64 contiguous bytes that stay in L1) and 64 for AVX-512 (its layout).
// The tiling changes which item computes an element, never how it is computed.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/gemm_common.h"
#include "kernels/grouped_gemm_tile.h"
#include "moetron/check.h"
#include "moetron/gemm.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

namespace {

using gg::kMR;
using gg::kPanel;

constexpr size_t kAPackBudget = size_t(8) << 20;  // bytes of packed op(A) per phase (and buffer)
constexpr int64_t kRowChunk = 4096;               // rows per chunk when op(A) is packed

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

struct AlignedFloats {  // grow-only 64-byte aligned scratch (thread_local: one per thread)
  float* p = nullptr;
  size_t n = 0;
  float* get(size_t want) {
    if (want > n) {
      std::free(p);
      p = static_cast<float*>(std::aligned_alloc(64, (want * sizeof(float) + 63) / 64 * 64));
      MT_CHECK(p, "gemm_f32", "cannot allocate ", want * sizeof(float), " bytes of scratch");
      n = want;
    }
    return p;
  }
  ~AlignedFloats() { std::free(p); }
};

void epilogue_scalar(float* C, int64_t ldc, const float* S, int64_t lds, int64_t rows, int64_t cols, float alpha,
                     float beta) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      C[i * ldc + j] = beta == 0.0f ? alpha * S[i * lds + j] : std::fma(beta, C[i * ldc + j], alpha * S[i * lds + j]);
}

// Rows [s0, s0 + ns) of op(B) = B, columns [c0, c0 + nb), into panels of w columns (zero-padded):
// out[(c / w) * ps + (s - s0) * w + c % w] = B[s][c0 + c]. Row-major reads.
void pack_b_rows(float* out, int64_t w, int64_t ps, const float* B, int64_t ldb, int64_t s0, int64_t ns, int64_t c0,
                 int64_t nb, int64_t srel0) {
  for (int64_t s = 0; s < ns; ++s) {
    const float* b = B + (s0 + s) * ldb + c0;
    for (int64_t c = 0; c < nb; c += w) {
      float* o = out + (c / w) * ps + (srel0 + s) * w;
      const int64_t n = std::min(w, nb - c);
      std::memcpy(o, b + c, size_t(n) * sizeof(float));
      if (n < w) std::memset(o + n, 0, size_t(w - n) * sizeof(float));
    }
  }
}

// Columns [c0, c0 + pc) of op(B) = Bt^T (Bt stored [N, K]), rows [s0, s0 + ns), into one panel of w columns:
// out[s * w + c] = Bt[(c0 + c) * ldb + s0 + s], zero for pc <= c < w.
void pack_bt(float* out, int64_t w, const float* Bt, int64_t ldb, int64_t s0, int64_t ns, int64_t c0, int64_t pc,
             bool simd) {
  const float* b = Bt + c0 * ldb + s0;
  if (simd) return gg::pack_bt_panel_f32_avx2(out, b, ldb, ns, pc, w);
  for (int64_t c = 0; c < w; ++c)
    for (int64_t s = 0; s < ns; ++s) out[s * w + c] = c < pc ? b[c * ldb + s] : 0.0f;
}

// A block of op(A), rows [r0, r0 + rows) x steps [s0, s0 + ns), into 6-row micro-panels:
//   out[(r / 6) * 6 * ns + s * 6 + r % 6] = op(A)[r0 + r][s0 + s],
// the last micro-panel zero-padded to 6 rows. May write 2 floats past the end.
void pack_a(float* out, Trans ta, const float* A, int64_t lda, int64_t r0, int64_t s0, int64_t rows, int64_t M,
            int64_t ns, bool simd) {
  const int64_t nq = ceil_div(rows, kMR), full = rows / kMR;
  if (ta == Trans::T && simd) return gg::pack_at_f32_avx2(out, A + s0 * lda + r0, lda, rows, M - r0, ns);
  if (ta == Trans::T) {  // op(A)[r][s] = A[s][r]: rows of the stored A are contiguous in r
    for (int64_t s = 0; s < ns; ++s) {
      const float* a = A + (s0 + s) * lda + r0;
      for (int64_t q = 0; q < full; ++q) std::memcpy(out + q * kMR * ns + s * kMR, a + q * kMR, kMR * sizeof(float));
      if (full < nq) {
        float* o = out + full * kMR * ns + s * kMR;
        for (int64_t i = 0; i < kMR; ++i) o[i] = full * kMR + i < rows ? a[full * kMR + i] : 0.0f;
      }
    }
    return;
  }
  if (simd) return gg::pack_a_rows_f32_avx2(out, A + r0 * lda + s0, lda, rows, ns);
  for (int64_t q = 0; q < nq; ++q) {  // op(A)[r][s] = A[r][s]: interleave 6 rows
    float* o = out + q * kMR * ns;
    const int64_t nr = std::min(kMR, rows - q * kMR);
    for (int64_t i = 0; i < kMR; ++i) {
      const float* a = A + (r0 + q * kMR + i) * lda + s0;
      if (i < nr)
        for (int64_t s = 0; s < ns; ++s) o[s * kMR + i] = a[s];
      else
        for (int64_t s = 0; s < ns; ++s) o[s * kMR + i] = 0.0f;
    }
  }
}

// Rows [0, M) of C; the public entry point splits M into row chunks (rows are independent) so that the packed
// op(A) of a phase stays bounded.
void gemm_rows(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
               const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const Isa isa = active_isa();
  const bool simd = isa != Isa::Scalar;
  const gg::Tuning& tu = gg::tuning();
  const gg::TileFn fn = gg::tile_fn(false);
  const auto epilogue = simd ? gg::gemm_epilogue_f32_avx2 : epilogue_scalar;
  const int threads = 2.0 * double(M) * double(N) * double(K) < double(1 << 21) ? 1 : num_threads();

  // ---- plan (none of it changes results) ----
  const int64_t pw = isa == Isa::Avx512 || tu.dpw >= kPanel ? kPanel : 16;
  const int64_t kc_max = std::max<int64_t>(1, isa == Isa::Avx512 ? tu.kc_f32 : tu.kc_f32_avx2);
  const int64_t nkb = ceil_div(K, kc_max), kc = ceil_div(K, nkb);  // equal K blocks
  const int64_t nc = std::min(round_up(N, kPanel), std::max<int64_t>(kPanel, tu.dnc / kPanel * kPanel));
  const bool packa = ta == Trans::T || tu.dpack_a;
  // K blocks per phase: the packed op(B) block within dbudget, the packed op(A) block within kAPackBudget.
  int64_t kp = int64_t(tu.dbudget / (sizeof(float) * size_t(kc * nc)));
  if (packa && tu.dshare_a) kp = std::min(kp, int64_t(kAPackBudget / (sizeof(float) * size_t(M) * size_t(kc))));
  kp = std::clamp<int64_t>(kp, 1, nkb);
  const int64_t nph = ceil_div(nkb, kp), ncb = ceil_div(N, nc);
  // Row tiles: about dmt rows, a multiple of the thread count when there are few.
  int64_t ntm = ceil_div(M, std::max(kMR, tu.dmt));
  if (ntm < 8 * threads) ntm = round_up(ntm, threads);
  ntm = std::min(ntm, ceil_div(M, kMR));
  const int64_t mt = round_up(ceil_div(M, ntm), kMR);
  ntm = ceil_div(M, mt);
  const bool share_a = packa && tu.dshare_a;  // op(A) packed once per phase for all items, else per item
  // Column tiles: dnt columns (all of the block when each item packs its own op(A)), narrower when that leaves
  // fewer than 4 items per thread.
  int64_t nt = packa && !share_a ? nc : std::min(nc, std::max<int64_t>(kPanel, tu.dnt / kPanel * kPanel));
  if (ntm * ceil_div(nc, nt) < 4 * threads)
    nt = std::max<int64_t>(kPanel, round_up(ceil_div(nc, ceil_div(4 * threads, ntm)), kPanel));
  // beta != 0: the raw sums go to a scratch, per item (thread-local) when an item sees all of K, else one
  // M x nc scratch for the call (the partial sums outlive the item).
  const bool call_scratch = beta != 0.0f && nph > 1;
  const int nbuf = nph * ncb > 1 ? 2 : 1;  // double-buffered packed operands when there are several phases
  const size_t bsize = size_t(round_up(nc, pw)) * size_t(kp * kc);
  const size_t asize = share_a ? size_t(ntm * mt) * size_t(kp * kc) + 8 : 0;  // + slack of the SIMD packer
  static thread_local AlignedFloats bbuf, abuf, sbuf;
  float* bp0 = bbuf.get(bsize * nbuf);
  float* ap0 = share_a ? abuf.get(asize * nbuf) : nullptr;
  float* bps[2] = {bp0, bp0 + (nbuf > 1 ? bsize : 0)};
  float* aps[2] = {ap0, ap0 + (nbuf > 1 ? asize : 0)};
  float* S = call_scratch ? sbuf.get(size_t(M) * size_t(nc)) : nullptr;

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    static thread_local AlignedFloats tbuf, tabuf;
    float* ts = beta != 0.0f && !call_scratch ? tbuf.get(size_t(mt) * size_t(nt)) : nullptr;
    float* tap = packa && !share_a ? tabuf.get(size_t(mt) * size_t(kc) + 8) : nullptr;
    int64_t phase = 0;
    for (int64_t j0 = 0; j0 < N; j0 += nc) {
      const int64_t nbj = std::min(nc, N - j0), npan = ceil_div(nbj, pw), ntn = ceil_div(nbj, nt);
      const int64_t nitems = ntm * ntn;
      for (int64_t ph = 0; ph < nph; ++ph, ++phase) {
        const int64_t s0 = ph * kp * kc, ns = std::min(kp * kc, K - s0);
        float* bp = bps[phase & 1];
        float* ap = aps[phase & 1];
        const int64_t ps = ns * pw;  // elements per packed op(B) panel
        // Pack op(B)[s0 .. s0 + ns, j0 .. j0 + nbj] by 16-row chunks (B) or by panels (B^T), and op(A)
        // rows [0, M) x steps [s0, s0 + ns) by row tiles (when packed), all threads, dynamic split.
        const int64_t nbu = tb == Trans::N ? ceil_div(ns, 16) : npan, nau = share_a ? ntm : 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < nbu + nau; ++u) {
          if (u >= nbu) {
            const int64_t r0 = (u - nbu) * mt;
            pack_a(ap + r0 * ns, ta, A, lda, r0, s0, std::min(mt, M - r0), M, ns, simd);
          } else if (tb == Trans::N) {
            pack_b_rows(bp, pw, ps, B, ldb, s0 + 16 * u, std::min<int64_t>(16, ns - 16 * u), j0, nbj, 16 * u);
          } else {
            pack_bt(bp + u * ps, pw, B, ldb, s0, ns, j0 + u * pw, std::min(pw, nbj - u * pw), simd);
          }
        }
        // (barrier) Items; no barrier after them: the next phase packs into the other buffers, and its
        // barrier orders this phase's items before the next phase's (same C tiles, possibly other threads).
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t item = 0; item < nitems; ++item) {
          const int64_t r0 = (item / ntn) * mt, c0 = (item % ntn) * nt;
          gg::Tile t;
          t.rows = std::min(mt, M - r0);
          t.cols = std::min(nt, nbj - c0);
          float* Ct = C + r0 * ldc + j0 + c0;
          if (beta == 0.0f) {
            t.C = Ct, t.ldc = ldc;
          } else if (call_scratch) {
            t.C = S + r0 * nc + c0, t.ldc = nc;
          } else {
            t.C = ts, t.ldc = nt;
          }
          t.b_ps = ps, t.b_ss = pw, t.b_pw = pw;
          for (int64_t k0 = s0; k0 < s0 + ns; k0 += kc) {
            const int64_t nk = std::min(kc, s0 + ns - k0);
            if (share_a) {
              t.A = ap + r0 * ns + (k0 - s0) * kMR, t.a_bs = kMR * ns, t.a_rs = 1, t.a_ss = kMR;
            } else if (packa) {
              pack_a(tap, ta, A, lda, r0, k0, t.rows, M, nk, simd);
              t.A = tap, t.a_bs = kMR * nk, t.a_rs = 1, t.a_ss = kMR;
            } else {
              t.A = A + r0 * lda + k0, t.a_bs = kMR * lda, t.a_rs = lda, t.a_ss = 1;
            }
            t.B = bp + (c0 / pw) * ps + (k0 - s0) * pw;
            t.steps = nk;
            t.accumulate = k0 > 0;
            fn(t);
          }
          if (ph == nph - 1 && (beta != 0.0f || alpha != 1.0f))
            epilogue(Ct, ldc, t.C, t.ldc, t.rows, t.cols, alpha, beta);
        }
      }
    }
  }
}

}  // namespace

void gemm_f32(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
              const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (gemm_detail::prologue("gemm_f32", ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc)) return;
  MT_TRACE_COST(2.0 * double(M) * double(N) * double(K), 4.0 * double(M * K + K * N + M * N * (beta != 0 ? 2 : 1)));
  // Rows are independent: chunks of kRowChunk rows bound the packed op(A) (one K block of 4096 rows is 4 MiB).
  const int64_t chunk = ta == Trans::T || gg::tuning().dpack_a ? kRowChunk : M;
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const float* a = ta == Trans::N ? A + r0 * lda : A + r0;
    gemm_rows(ta, tb, std::min(chunk, M - r0), N, K, alpha, a, lda, B, ldb, beta, C + r0 * ldc, ldc);
  }
}

}  // namespace moetron
