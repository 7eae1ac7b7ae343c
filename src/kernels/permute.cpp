// permute.cpp: the MoE permutation plan and the fused gather / weighted scatter-add kernels (forward and
// backward), with input validation and ISA dispatch. Semantics: include/moetron/permute.h. Not the
// all-to-all between ranks, not the expert GEMMs.
//
// The plan is a serial counting sort over the N*k assignments (a few microseconds at N*k = 12k; it is
// integer, so it is exactly the reference). The data kernels are parallel over rows (permute) or tokens
// (the others); each output row is produced by one thread from a fixed sequence of operations, so results
// are bitwise independent of the thread count. The portable path is plain loops (the compiler vectorizes
// them at the baseline ISA); AVX-512 kernels live in permute_avx512.cpp, AVX2 ones (bitwise this path except
// the dw dot product) in permute_avx2.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "moetron/check.h"
#include "moetron/permute.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"
#include "permute_walk.h"

namespace moetron {

// permute_avx512.cpp
void moe_permute_f32_avx512(float* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D);
void moe_permute_bf16_avx512(bf16* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D);
void moe_permute_backward_avx512(float* dx, const float* dxp, const int32_t* row_of, int64_t N, int k, int64_t D);
void moe_unpermute_avx512(float* y, const float* yp, const int32_t* row_of, const float* w, int64_t N, int k,
                          int64_t D);
void moe_unpermute_backward_avx512(float* dyp32, bf16* dyp16, float* dw, const float* dy, const float* yp,
                                   const int32_t* row_of, const int32_t* token_of, const int32_t* slot_of,
                                   const float* w, int64_t N, int k, int64_t R, int64_t D);

// permute_avx2.cpp (the fp32 gather has none: the portable memcpy is glibc's vector copy)
void moe_permute_bf16_avx2(bf16* xp, const float* x, const int32_t* token_of, int64_t R, int64_t D);
void moe_permute_backward_avx2(float* dx, const float* dxp, const int32_t* row_of, int64_t N, int k, int64_t D);
void moe_unpermute_avx2(float* y, const float* yp, const int32_t* row_of, const float* w, int64_t N, int k,
                        int64_t D);
void moe_unpermute_backward_avx2(float* dyp32, bf16* dyp16, float* dw, const float* dy, const float* yp,
                                 const int32_t* row_of, const int32_t* token_of, const int32_t* slot_of,
                                 const float* w, int64_t N, int k, int64_t R, int64_t D);

namespace {

bool use_avx512() { return active_isa() == Isa::Avx512; }
bool use_avx2() { return active_isa() == Isa::Avx2; }

void check_sizes(const char* op, int64_t N, int k, int64_t R, int64_t D) {
  MT_CHECK(N >= 0 && D >= 0, op, "negative size N=", N, " D=", D);
  MT_CHECK(k >= 1, op, "k=", k, " must be >= 1");
  MT_CHECK(R >= 0 && R <= N * k, op, "rows R=", R, " outside [0, N*k=", N * k, "]");
}

void check_row_of(const char* op, const int32_t* row_of, int64_t N, int k, int64_t R) {
  MT_CHECK(row_of != nullptr || N == 0, op, "null row_of");
  for (int64_t i = 0; i < N * k; ++i)
    MT_CHECK(row_of[i] >= -1 && row_of[i] < R, op, "row_of[", i, "]=", row_of[i], " outside [-1, R=", R, ")");
}

void check_token_of(const char* op, const int32_t* token_of, int64_t R, int64_t N) {
  MT_CHECK(token_of != nullptr || R == 0, op, "null token_of");
  for (int64_t r = 0; r < R; ++r)
    MT_CHECK(token_of[r] >= 0 && token_of[r] < N, op, "token_of[", r, "]=", token_of[r], " outside [0, N=", N, ")");
}

void check_slot_of(const char* op, const int32_t* slot_of, int64_t R, int k) {
  MT_CHECK(slot_of != nullptr || R == 0, op, "null slot_of");
  for (int64_t r = 0; r < R; ++r)
    MT_CHECK(slot_of[r] >= 0 && slot_of[r] < k, op, "slot_of[", r, "]=", slot_of[r], " outside [0, k=", k, ")");
}

template <class TO>
void unpermute_backward_impl(TO* dyp, float* dw, const float* dy, const float* yp, const int32_t* row_of,
                             const int32_t* token_of, const int32_t* slot_of, const float* w, int64_t N, int k,
                             int64_t R, int64_t D) {
  const char* op = "moe_unpermute_backward";
  check_sizes(op, N, k, R, D);
  check_row_of(op, row_of, N, k, R);
  check_token_of(op, token_of, R, N);
  check_slot_of(op, slot_of, R, k);
  if (N == 0) return;
  MT_CHECK(dw && dy && w && (R == 0 || (dyp && yp)), op, "null array argument");
  // Per kept row: dyp = w * dy and dw = <dy, y>: about 3 flops per element; dy and yp read, dyp written.
  MT_TRACE_COST(3.0 * double(R * D), double(R * D) * (8.0 + double(sizeof(TO))) + 4.0 * double(N * D));
  if (use_avx512()) {
    if constexpr (std::is_same_v<TO, bf16>)
      moe_unpermute_backward_avx512(nullptr, dyp, dw, dy, yp, row_of, token_of, slot_of, w, N, k, R, D);
    else
      moe_unpermute_backward_avx512(dyp, nullptr, dw, dy, yp, row_of, token_of, slot_of, w, N, k, R, D);
    return;
  }
  if (use_avx2()) {
    if constexpr (std::is_same_v<TO, bf16>)
      moe_unpermute_backward_avx2(nullptr, dyp, dw, dy, yp, row_of, token_of, slot_of, w, N, k, R, D);
    else
      moe_unpermute_backward_avx2(dyp, nullptr, dw, dy, yp, row_of, token_of, slot_of, w, N, k, R, D);
    return;
  }
  // Portable path: the vector paths' walk with a scalar row.
  unpermute_backward_walk(dyp, dw, dy, yp, row_of, token_of, slot_of, w, N, k, R, D,
                          [](TO* o, const float* g, const float* v, float ws, int64_t n) {
                            float acc = 0;
                            for (int64_t d = 0; d < n; ++d) o[d] = permute_detail::cvt<TO>(ws * g[d]);
                            for (int64_t d = 0; d < n; ++d) acc += g[d] * v[d];
                            return acc;
                          });
}

}  // namespace

int64_t moe_capacity(double cf, int64_t N, int k, int E) {
  MT_CHECK(cf >= 0 && cf < 1e6, "moe_capacity", "capacity factor ", cf, " must be >= 0 (0: dropless)");
  MT_CHECK(E >= 1 && k >= 1 && N >= 0, "moe_capacity", "E=", E, " k=", k, " N=", N);
  if (cf == 0) return 0;
  double c = std::ceil(cf * double(N) * double(k) / double(E) - 1e-9);
  return std::max<int64_t>(int64_t(c), 1);
}

int64_t moe_permute_plan(int32_t* offsets, int32_t* row_of, int32_t* token_of, int32_t* slot_of,
                         const int32_t* topk_idx, const int32_t* counts, int64_t N, int k, int E,
                         double capacity_factor, const float* drop_w) {
  const char* op = "moe_permute_plan";
  MT_CHECK(E >= 1 && k >= 1 && N >= 0, op, "E=", E, " k=", k, " N=", N);
  MT_CHECK(N * k < (int64_t(1) << 31), op, "N*k=", N * k, " does not fit int32 row indices");
  MT_CHECK(offsets && counts, op, "null offsets or counts");
  MT_CHECK(N == 0 || (row_of && token_of && topk_idx), op, "null array argument");
  const int64_t C = moe_capacity(capacity_factor, N, k, E);
  const int64_t NK = N * k;
  // 1. histogram of topk_idx (in offsets[0..E)) must equal counts.
  for (int e = 0; e <= E; ++e) offsets[e] = 0;
  for (int64_t i = 0; i < NK; ++i) {
    const int32_t e = topk_idx[i];
    MT_CHECK(e >= 0 && e < E, op, "topk_idx[", i, "]=", e, " outside [0, E=", E, ")");
    ++offsets[e];
  }
  for (int e = 0; e < E; ++e)
    MT_CHECK(offsets[e] == counts[e], op, "counts[", e, "]=", counts[e], " but topk_idx assigns ", offsets[e],
             " tokens to expert ", e);
  // 2. offsets: exclusive prefix sum of the kept counts.
  int32_t run = 0;
  for (int e = 0; e < E; ++e) {
    const int32_t kept = C == 0 ? counts[e] : int32_t(std::min<int64_t>(counts[e], C));
    offsets[e] = run;
    run += kept;
  }
  offsets[E] = run;
  // 3. stable placement: cursors walk each expert's range in (token, slot) order.
  constexpr int kStack = 4096;
  int32_t stack_cur[kStack];
  std::vector<int32_t> heap_cur;
  int32_t* cur = stack_cur;
  if (E > kStack) {
    heap_cur.resize(size_t(E));
    cur = heap_cur.data();
  }
  int64_t dropped = 0;
  if (C > 0 && drop_w && run < NK) {
    // Drop by probability: group every (t, s) by expert in token_of (scratch until the placement below), keep
    // the C largest weights of each over-full expert (ties: the earlier (t, s)), and mark the rest row_of = -1.
    int32_t start = 0;
    for (int e = 0; e < E; ++e) cur[e] = start, start += counts[e];
    for (int64_t i = 0; i < NK; ++i) token_of[cur[topk_idx[i]]++] = int32_t(i), row_of[i] = 0;
    start = 0;
    for (int e = 0; e < E; ++e) {
      int32_t* first = token_of + start;
      start += counts[e];
      if (counts[e] <= C) continue;
      std::nth_element(first, first + C, token_of + start, [drop_w](int32_t a, int32_t b) {
        return drop_w[a] > drop_w[b] || (drop_w[a] == drop_w[b] && a < b);
      });
      for (int32_t* q = first + C; q < token_of + start; ++q) row_of[*q] = -1;
    }
    std::memcpy(cur, offsets, sizeof(int32_t) * size_t(E));
    for (int64_t i = 0; i < NK; ++i) {
      if (row_of[i] < 0) {
        ++dropped;
        continue;
      }
      const int32_t r = cur[topk_idx[i]]++;
      row_of[i] = r;
      token_of[r] = int32_t(i / k);
      if (slot_of) slot_of[r] = int32_t(i % k);
    }
    for (int64_t r = run; r < NK; ++r) {
      token_of[r] = -1;
      if (slot_of) slot_of[r] = -1;
    }
    return dropped;
  }
  std::memcpy(cur, offsets, sizeof(int32_t) * size_t(E));
  for (int64_t t = 0; t < N; ++t)
    for (int s = 0; s < k; ++s) {
      const int32_t e = topk_idx[t * k + s];
      if (cur[e] < offsets[e + 1]) {
        const int32_t r = cur[e]++;
        row_of[t * k + s] = r;
        token_of[r] = int32_t(t);
        if (slot_of) slot_of[r] = s;
      } else {
        row_of[t * k + s] = -1;
        ++dropped;
      }
    }
  for (int64_t r = run; r < NK; ++r) {
    token_of[r] = -1;
    if (slot_of) slot_of[r] = -1;
  }
  return dropped;
}

void moe_permute(float* xp, const float* x, const int32_t* token_of, int64_t R, int64_t N, int64_t D) {
  const char* op = "moe_permute";
  MT_CHECK(R >= 0 && N >= 0 && D >= 0, op, "negative size R=", R, " N=", N, " D=", D);
  check_token_of(op, token_of, R, N);
  if (R == 0 || D == 0) return;
  MT_CHECK(xp && x, op, "null xp or x");
  MT_TRACE_COST(0, 8.0 * double(R * D));  // a gather: rows read and written
  if (use_avx512()) return moe_permute_f32_avx512(xp, x, token_of, R, D);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) std::memcpy(xp + r * D, x + int64_t(token_of[r]) * D, sizeof(float) * size_t(D));
}

void moe_permute(bf16* xp, const float* x, const int32_t* token_of, int64_t R, int64_t N, int64_t D) {
  const char* op = "moe_permute(bf16)";
  MT_CHECK(R >= 0 && N >= 0 && D >= 0, op, "negative size R=", R, " N=", N, " D=", D);
  check_token_of(op, token_of, R, N);
  if (R == 0 || D == 0) return;
  MT_CHECK(xp && x, op, "null xp or x");
  MT_TRACE_COST(0, 6.0 * double(R * D));
  if (use_avx512()) return moe_permute_bf16_avx512(xp, x, token_of, R, D);
  if (use_avx2()) return moe_permute_bf16_avx2(xp, x, token_of, R, D);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const float* src = x + int64_t(token_of[r]) * D;
    bf16* dst = xp + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = to_bf16(src[d]);
  }
}

void moe_permute_backward(float* dx, const float* dxp, const int32_t* row_of, int64_t N, int k, int64_t R,
                          int64_t D) {
  const char* op = "moe_permute_backward";
  check_sizes(op, N, k, R, D);
  check_row_of(op, row_of, N, k, R);
  if (N == 0 || D == 0) return;
  MT_CHECK(dx && (R == 0 || dxp), op, "null dx or dxp");
  MT_TRACE_COST(double(R * D), 4.0 * double(R * D + N * D));  // each kept row added to its token
  if (use_avx512()) return moe_permute_backward_avx512(dx, dxp, row_of, N, k, D);
  if (use_avx2()) return moe_permute_backward_avx2(dx, dxp, row_of, N, k, D);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* o = dx + t * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0;
    for (int s = 0; s < k; ++s) {
      const int32_t r = row_of[t * k + s];
      if (r < 0) continue;
      const float* v = dxp + int64_t(r) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += v[d];
    }
  }
}

void moe_unpermute(float* y, const float* yp, const int32_t* row_of, const float* w, int64_t N, int k, int64_t R,
                   int64_t D) {
  const char* op = "moe_unpermute";
  check_sizes(op, N, k, R, D);
  check_row_of(op, row_of, N, k, R);
  if (N == 0 || D == 0) return;
  MT_CHECK(y && w && (R == 0 || yp), op, "null y, w or yp");
  MT_TRACE_COST(2.0 * double(R * D), 4.0 * double(R * D + N * D));  // weighted sum of each token's rows
  if (use_avx512()) return moe_unpermute_avx512(y, yp, row_of, w, N, k, D);
  if (use_avx2()) return moe_unpermute_avx2(y, yp, row_of, w, N, k, D);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    float* o = y + t * D;
    for (int64_t d = 0; d < D; ++d) o[d] = 0;
    for (int s = 0; s < k; ++s) {
      const int32_t r = row_of[t * k + s];
      if (r < 0) continue;
      const float ws = w[t * k + s];
      const float* v = yp + int64_t(r) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += ws * v[d];
    }
  }
}

void moe_unpermute_backward(float* dyp, float* dw, const float* dy, const float* yp, const int32_t* row_of,
                            const int32_t* token_of, const int32_t* slot_of, const float* w, int64_t N, int k,
                            int64_t R, int64_t D) {
  unpermute_backward_impl(dyp, dw, dy, yp, row_of, token_of, slot_of, w, N, k, R, D);
}
void moe_unpermute_backward(bf16* dyp, float* dw, const float* dy, const float* yp, const int32_t* row_of,
                            const int32_t* token_of, const int32_t* slot_of, const float* w, int64_t N, int k,
                            int64_t R, int64_t D) {
  unpermute_backward_impl(dyp, dw, dy, yp, row_of, token_of, slot_of, w, N, k, R, D);
}

}  // namespace moetron
