// fp8_gemm.cpp: the FP8 recipes' operands (quantize along the contraction dimension, transposes, E8M0
// scales, delayed scaling) and the FP8 GEMM / grouped GEMM as an exact emulation: each operand is decoded to
// fp32 (decode(q) * scale) and the batch-invariant gemm_f32 multiplies them (see fp8_gemm.h for how exact that
// is), plus the float64 twins. Not the quantize kernels themselves (fp8.cpp) and not a native FP8 GEMM: a CPU
// has no FP8 arithmetic, so this saves no time, only memory for the stored operands.
#include "moetron/fp8_gemm.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "moetron/check.h"
#include "moetron/gemm.h"
#include "moetron/grouped_gemm.h"

namespace moetron {

namespace {

void check_operand(const char* op, const Fp8Tensor& a) {
  MT_CHECK(a.rows >= 0 && a.cols >= 0, op, "negative operand shape ", a.rows, " x ", a.cols);
  MT_CHECK(int64_t(a.q.size()) == a.rows * a.cols, op, "operand ", a.rows, " x ", a.cols, " holds ", a.q.size(),
           " codes");
  const Fp8Layout l = a.layout();
  const int64_t ns = fp8_num_scales(a.rows, a.cols, l.scaling, l.block_r, l.block_c);
  MT_CHECK(int64_t(a.scales.size()) == ns, op, "operand ", a.rows, " x ", a.cols, " (", to_string(a.recipe), ", ",
           fp8_role_name(a.role), ") needs ", ns, " scales, holds ", a.scales.size());
}

// x [R, C] -> t [C, R] (blocked, so neither side is walked with a large stride for long).
void transpose_f32(float* t, const float* x, int64_t R, int64_t C) {
  constexpr int64_t B = 32;
#pragma omp parallel for collapse(2) schedule(static) if (R * C >= (1 << 16))
  for (int64_t r0 = 0; r0 < R; r0 += B)
    for (int64_t c0 = 0; c0 < C; c0 += B)
      for (int64_t r = r0; r < std::min(R, r0 + B); ++r)
        for (int64_t c = c0; c < std::min(C, c0 + B); ++c) t[c * R + r] = x[r * C + c];
}

double decode64(uint8_t q, Fp8Format f) {
  return f == Fp8Format::E4M3 ? double(e4m3_bits_to_float(q)) : double(e5m2_bits_to_float(q));
}

// The exact dequantized operand in float64 (an fp8 value times an fp32 scale is exact in fp64).
std::vector<double> dequantize64(const Fp8Tensor& a) {
  const Fp8Layout l = a.layout();
  int64_t br, bc;
  fp8_block_shape(&br, &bc, a.rows, a.cols, l.scaling, l.block_r, l.block_c);
  const int64_t nbc = (a.cols + bc - 1) / bc;
  std::vector<double> out(static_cast<size_t>(a.rows * a.cols));
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t c = 0; c < a.cols; ++c)
      out[r * a.cols + c] = decode64(a.q[r * a.cols + c], a.fmt) * double(a.scales[(r / br) * nbc + c / bc]);
  return out;
}

// The decoded operands live in per-thread scratch that only grows (slot 0: A, slot 1: B), so a call in a
// training step neither allocates nor page-faults once the largest GEMM has run.
float* dequantize32(const Fp8Tensor& a, int slot) {
  thread_local std::vector<float> scratch[2];
  std::vector<float>& s = scratch[slot];
  const size_t n = static_cast<size_t>(a.rows * a.cols);
  if (s.size() < n) s.resize(n);
  fp8_dequantize_operand(s.data(), a);
  return s.data();
}

}  // namespace

const char* fp8_role_name(Fp8Role r) { return r == Fp8Role::Weight ? "weight" : "activation"; }

Fp8Layout fp8_recipe_layout(Fp8Recipe r, Fp8Role role, bool pow2_scales) {
  switch (r) {
    case Fp8Recipe::Tensorwise: return {Fp8Scaling::Tensor, 0, 0, pow2_scales};
    case Fp8Recipe::Rowwise: return {Fp8Scaling::Row, 0, 0, pow2_scales};
    case Fp8Recipe::Blockwise:
      return role == Fp8Role::Weight ? Fp8Layout{Fp8Scaling::Block, 128, 128, pow2_scales}
                                     : Fp8Layout{Fp8Scaling::Block, 1, 128, pow2_scales};
    case Fp8Recipe::MXFP8: return {Fp8Scaling::Block, 1, 32, true};
    case Fp8Recipe::None: break;
  }
  MT_FAIL("fp8", "recipe '", to_string(r), "' has no FP8 layout (known: tensorwise, rowwise, blockwise, mxfp8)");
}

int64_t Fp8Tensor::storage_bytes() const {
  return int64_t(q.size()) + int64_t(scales.size()) * (recipe == Fp8Recipe::MXFP8 ? 1 : 4);
}

void fp8_quantize_operand_into(Fp8Tensor& t, const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Recipe r,
                               Fp8Role role, bool pow2_scales) {
  t.rows = R, t.cols = C, t.fmt = f, t.recipe = r, t.role = role;
  const Fp8Layout l = fp8_recipe_layout(r, role, pow2_scales);
  t.pow2 = l.pow2;
  MT_CHECK(R >= 0 && C >= 0, "fp8_quantize_operand", "negative shape ", R, " x ", C);
  t.q.resize(static_cast<size_t>(R * C));  // within the capacity: no allocation; every code and scale is written
  t.scales.resize(static_cast<size_t>(fp8_num_scales(R, C, l.scaling, l.block_r, l.block_c)));
  if (R * C > 0) fp8_quantize(t.q.data(), t.scales.data(), x, R, C, f, l.scaling, l.block_r, l.block_c, l.pow2);
}

Fp8Tensor fp8_quantize_operand(const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Recipe r, Fp8Role role,
                               bool pow2_scales) {
  Fp8Tensor t;
  fp8_quantize_operand_into(t, x, R, C, f, r, role, pow2_scales);
  return t;
}

void fp8_quantize_operand_t_into(Fp8Tensor& t, std::vector<float>& xt, const float* x, int64_t R, int64_t C,
                                 Fp8Format f, Fp8Recipe r, Fp8Role role, bool pow2_scales) {
  MT_CHECK(R >= 0 && C >= 0, "fp8_quantize_operand_t", "negative shape ", R, " x ", C);
  xt.resize(static_cast<size_t>(R * C));
  transpose_f32(xt.data(), x, R, C);
  fp8_quantize_operand_into(t, xt.data(), C, R, f, r, role, pow2_scales);
}

Fp8Tensor fp8_quantize_operand_t(const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Recipe r, Fp8Role role,
                                 bool pow2_scales) {
  std::vector<float> xt;
  Fp8Tensor t;
  fp8_quantize_operand_t_into(t, xt, x, R, C, f, r, role, pow2_scales);
  return t;
}

void fp8_transpose_into(Fp8Tensor& t, const Fp8Tensor& a) {
  check_operand("fp8_transpose", a);
  MT_CHECK(&t != &a, "fp8_transpose_into", "the output is the input");
  const Fp8Layout l = a.layout();
  const bool square = l.scaling == Fp8Scaling::Block && l.block_r == l.block_c;
  MT_CHECK(l.scaling == Fp8Scaling::Tensor || square, "fp8_transpose",
           "the quantized data of recipe '", to_string(a.recipe), "' (", fp8_role_name(a.role),
           ") cannot be transposed exactly: its scale tiles are not square; quantize the transpose again "
           "(fp8_quantize_operand_t)");
  t.fmt = a.fmt, t.recipe = a.recipe, t.role = a.role, t.pow2 = a.pow2;
  t.rows = a.cols, t.cols = a.rows;
  t.q.resize(a.q.size());
  t.scales.assign(a.scales.begin(), a.scales.end());
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t c = 0; c < a.cols; ++c) t.q[c * a.rows + r] = a.q[r * a.cols + c];
  if (square) {
    const int64_t nbr = (a.rows + l.block_r - 1) / l.block_r, nbc = (a.cols + l.block_c - 1) / l.block_c;
    for (int64_t i = 0; i < nbr; ++i)
      for (int64_t j = 0; j < nbc; ++j) t.scales[j * nbr + i] = a.scales[i * nbc + j];
  }
}

Fp8Tensor fp8_transpose(const Fp8Tensor& a) {
  Fp8Tensor t;
  fp8_transpose_into(t, a);
  return t;
}

void fp8_dequantize_operand(float* out, const Fp8Tensor& a) {
  check_operand("fp8_dequantize_operand", a);
  if (a.rows * a.cols == 0) return;
  const Fp8Layout l = a.layout();
  fp8_dequantize(out, a.q.data(), a.scales.data(), a.rows, a.cols, a.fmt, l.scaling, l.block_r, l.block_c);
}

uint8_t fp8_e8m0_encode(float s) {
  MT_CHECK(s > 0.0f && std::isfinite(s), "fp8_e8m0_encode", "scale ", s, " is not a positive finite power of two");
  int e;
  const float m = std::frexp(s, &e);  // s = m * 2^e, m in [0.5, 1)
  MT_CHECK(m == 0.5f, "fp8_e8m0_encode", "scale ", s, " is not a power of two");
  const int biased = e - 1 + 127;
  MT_CHECK(biased >= 0 && biased <= 254, "fp8_e8m0_encode", "scale ", s, " is outside E8M0's 2^-127 .. 2^127");
  return uint8_t(biased);
}

float fp8_e8m0_decode(uint8_t e) { return e == 0xFF ? NAN : std::ldexp(1.0f, int(e) - 127); }

// ---- GEMMs ----

void fp8_gemm(float* C, int64_t ldc, const Fp8Tensor& A, const Fp8Tensor& B, float beta) {
  check_operand("fp8_gemm", A);
  check_operand("fp8_gemm", B);
  MT_CHECK(A.cols == B.cols, "fp8_gemm", "contraction sizes differ: A is ", A.rows, " x ", A.cols, ", B is ",
           B.rows, " x ", B.cols, " (both must be quantized along K)");
  const int64_t M = A.rows, N = B.rows, K = A.cols;
  if (M == 0 || N == 0) return;
  // The packing step: decode both operands to fp32 (exact with power-of-two scales), then the fp32 tile kernels.
  const float* a = dequantize32(A, 0);
  const float* b = dequantize32(B, 1);
  gemm_f32(Trans::N, Trans::T, M, N, K, 1.0f, a, std::max<int64_t>(K, 1), b, std::max<int64_t>(K, 1), beta, C, ldc);
}

void fp8_grouped_gemm_m(float* C, const Fp8Tensor& A, const std::vector<Fp8Tensor>& B, const int32_t* counts) {
  check_operand("fp8_grouped_gemm_m", A);
  const int64_t E = int64_t(B.size()), K = A.cols;
  MT_CHECK(E == 0 || counts, "fp8_grouped_gemm_m", "null counts with ", E, " experts");
  std::vector<int64_t> off(static_cast<size_t>(E + 1));
  grouped_offsets(off.data(), counts, E, A.rows);
  const int64_t N = E > 0 ? B[0].rows : 0;
  for (int64_t e = 0; e < E; ++e) {
    check_operand("fp8_grouped_gemm_m", B[size_t(e)]);
    MT_CHECK(B[size_t(e)].rows == N && B[size_t(e)].cols == K, "fp8_grouped_gemm_m", "expert ", e, " weight is ",
             B[size_t(e)].rows, " x ", B[size_t(e)].cols, ", expected ", N, " x ", K);
  }
  if (A.rows == 0 || N == 0) return;
  const float* a = dequantize32(A, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t m = off[e + 1] - off[e];
    if (m == 0) continue;
    const float* b = dequantize32(B[size_t(e)], 1);
    gemm_f32(Trans::N, Trans::T, m, N, K, 1.0f, a + off[e] * K, std::max<int64_t>(K, 1), b, std::max<int64_t>(K, 1),
             0.0f, C + off[e] * N, N);
  }
}

void fp8_grouped_gemm_k(float* C, const std::vector<Fp8Tensor>& A, const std::vector<Fp8Tensor>& B, int64_t K,
                        int64_t N, bool accumulate) {
  MT_CHECK(A.size() == B.size(), "fp8_grouped_gemm_k", A.size(), " A operands but ", B.size(), " B operands");
  for (size_t e = 0; e < A.size(); ++e) {
    check_operand("fp8_grouped_gemm_k", A[e]);
    check_operand("fp8_grouped_gemm_k", B[e]);
    MT_CHECK(A[e].rows == K && B[e].rows == N && A[e].cols == B[e].cols, "fp8_grouped_gemm_k", "expert ", e,
             ": A is ", A[e].rows, " x ", A[e].cols, ", B is ", B[e].rows, " x ", B[e].cols, ", expected ", K,
             " x m and ", N, " x m");
    float* Ce = C + int64_t(e) * K * N;
    if (A[e].cols == 0) {
      if (!accumulate) std::fill(Ce, Ce + K * N, 0.0f);
      continue;
    }
    fp8_gemm(Ce, N, A[e], B[e], accumulate ? 1.0f : 0.0f);
  }
}

std::vector<Fp8Tensor> fp8_quantize_groups_t(const float* x, int64_t M, int64_t C, const int32_t* counts, int64_t E,
                                             Fp8Format f, Fp8Recipe r, bool pow2_scales) {
  std::vector<int64_t> off(static_cast<size_t>(E + 1));
  grouped_offsets(off.data(), counts, E, M);
  std::vector<Fp8Tensor> out;
  out.reserve(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    out.push_back(fp8_quantize_operand_t(x + off[e] * C, off[e + 1] - off[e], C, f, r, Fp8Role::Activation,
                                         pow2_scales));
  return out;
}

// ---- float64 twins ----

void fp8_gemm_ref(double* C, const Fp8Tensor& A, const Fp8Tensor& B) {
  check_operand("fp8_gemm_ref", A);
  check_operand("fp8_gemm_ref", B);
  MT_CHECK(A.cols == B.cols, "fp8_gemm_ref", "contraction sizes differ: ", A.cols, " vs ", B.cols);
  const std::vector<double> a = dequantize64(A), b = dequantize64(B);
  gemm_ref<double>(Trans::N, Trans::T, A.rows, B.rows, A.cols, 1.0, a.data(), std::max<int64_t>(A.cols, 1), b.data(),
                   std::max<int64_t>(A.cols, 1), 0.0, C, std::max<int64_t>(B.rows, 1));
}

void fp8_grouped_gemm_m_ref(double* C, const Fp8Tensor& A, const std::vector<Fp8Tensor>& B, const int32_t* counts) {
  const int64_t E = int64_t(B.size()), K = A.cols, N = E > 0 ? B[0].rows : 0;
  const std::vector<double> a = dequantize64(A);
  int64_t o = 0;
  for (int64_t e = 0; e < E; ++e) {
    const std::vector<double> b = dequantize64(B[size_t(e)]);
    gemm_ref<double>(Trans::N, Trans::T, counts[e], N, K, 1.0, a.data() + o * K, std::max<int64_t>(K, 1), b.data(),
                     std::max<int64_t>(K, 1), 0.0, C + o * N, std::max<int64_t>(N, 1));
    o += counts[e];
  }
}

void fp8_grouped_gemm_k_ref(double* C, const std::vector<Fp8Tensor>& A, const std::vector<Fp8Tensor>& B, int64_t K,
                            int64_t N) {
  for (size_t e = 0; e < A.size(); ++e) {
    double* Ce = C + int64_t(e) * K * N;
    if (A[e].cols == 0) {
      std::fill(Ce, Ce + K * N, 0.0);
      continue;
    }
    fp8_gemm_ref(Ce, A[e], B[e]);
  }
}

// ---- delayed scaling ----

Fp8AmaxHistory::Fp8AmaxHistory(int64_t len) {
  MT_CHECK(len >= 1, "fp8", "amax_history_len must be >= 1, got ", len);
  history.assign(size_t(len), 0.0f);
}

float Fp8AmaxHistory::amax() const { return *std::max_element(history.begin(), history.end()); }

void Fp8AmaxHistory::push(float a) {
  history[size_t(pos)] = a;
  pos = (pos + 1) % int64_t(history.size());
}

Fp8Tensor fp8_quantize_scaled(const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Role role, float scale,
                              float* amax_out, bool pow2_scales) {
  MT_CHECK(R >= 0 && C >= 0, "fp8_quantize_scaled", "negative shape ", R, " x ", C);
  MT_CHECK(scale > 0.0f && std::isfinite(scale), "fp8_quantize_scaled", "scale ", scale, " is not positive and finite");
  Fp8Tensor t;
  t.rows = R, t.cols = C, t.fmt = f, t.recipe = Fp8Recipe::Tensorwise, t.role = role, t.pow2 = pow2_scales;
  t.scales.assign(1, scale);
  const int64_t n = R * C;
  t.q.resize(static_cast<size_t>(n));
  std::vector<float> y(static_cast<size_t>(n));
  float amax = 0.0f;
#pragma omp parallel for schedule(static) reduction(max : amax) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a < INFINITY && a > amax) amax = a;
    y[i] = x[i] / scale;  // the division of the current-scaling kernels
  }
  fp8_encode(t.q.data(), y.data(), n, f);
  if (amax_out) *amax_out = amax;
  return t;
}

Fp8Tensor fp8_quantize_delayed(const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Role role, Fp8AmaxHistory& hist,
                               bool pow2_scales) {
  MT_CHECK(R >= 0 && C >= 0, "fp8_quantize_delayed", "negative shape ", R, " x ", C);
  float amax = 0.0f;
  Fp8Tensor t = fp8_quantize_scaled(x, R, C, f, role, hist.scale(f, pow2_scales), &amax, pow2_scales);
  hist.push(amax);
  return t;
}

}  // namespace moetron
