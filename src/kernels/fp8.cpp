// fp8.cpp: FP8 quantize / dequantize / fake quant with tensor-, row- and block-wise scales: argument
// checks, the block plan, the OpenMP structure, the scalar row kernels (dtype.h codecs) and the dispatch
// to fp8_avx512.cpp / fp8_avx2.cpp, plus the reference twins. Not an FP8 GEMM (see fp8.h).
//
// Threading. With enough blocks (>= 2 per thread) every block is one work item: amax, scale, then
// encode while the block is still in cache (1 x 128 and 128 x 128 blocks, row scaling). With fewer
// blocks (tensor scaling, small matrices) each block's amax is a parallel max-reduction over its rows
// and the encode is parallel over rows. Max is exact and order free, so scales and codes are bitwise
// independent of the thread count.
#include "moetron/fp8.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "moetron/check.h"
#include "moetron/runtime.h"

namespace moetron {

// The row kernels each vector ISA provides (fp8_avx512.cpp: 16 lanes, fp8_avx2.cpp: 8 lanes), declared once.
#define MT_FP8_ROW_KERNELS                                                                                        \
  float amax(const float* x, int64_t n);                                                                          \
  void encode_scaled(uint8_t* q, const float* x, int64_t n, float scale, int fmt);                                \
  void decode_scaled(float* x, const uint8_t* q, int64_t n, float scale, int fmt);                                \
  void fake_scaled(float* y, const float* x, int64_t n, float scale, int fmt);                                    \
  void row_blocks(void* out, float* scales, const float* x, int64_t C, int64_t bc, int fmt, bool pow2, bool fake); \
  float amax_rows(const float* x, int64_t rows, int64_t n, int64_t ld);
namespace fp8_avx512 {
MT_FP8_ROW_KERNELS
}
namespace fp8_avx2 {
MT_FP8_ROW_KERNELS
}
#undef MT_FP8_ROW_KERNELS

float fp8_max(Fp8Format f) { return f == Fp8Format::E4M3 ? kE4M3Max : kE5M2Max; }
int fp8_mantissa_bits(Fp8Format f) { return f == Fp8Format::E4M3 ? 3 : 2; }
int fp8_min_normal_exp(Fp8Format f) { return f == Fp8Format::E4M3 ? -6 : -14; }
const char* fp8_format_name(Fp8Format f) { return f == Fp8Format::E4M3 ? "e4m3" : "e5m2"; }
const char* fp8_scaling_name(Fp8Scaling s) {
  return s == Fp8Scaling::Tensor ? "tensor" : s == Fp8Scaling::Row ? "row" : "block";
}

void fp8_block_shape(int64_t* br, int64_t* bc, int64_t R, int64_t C, Fp8Scaling s, int64_t block_r,
                     int64_t block_c) {
  MT_CHECK(R >= 0 && C >= 0, "fp8", "negative shape R=", R, " C=", C);
  switch (s) {
    case Fp8Scaling::Tensor: *br = R > 0 ? R : 1, *bc = C > 0 ? C : 1; return;
    case Fp8Scaling::Row: *br = 1, *bc = C > 0 ? C : 1; return;
    case Fp8Scaling::Block:
      MT_CHECK(block_r > 0 && block_c > 0, "fp8", "block scaling needs block_r, block_c > 0, got ", block_r, " x ",
               block_c);
      *br = block_r, *bc = block_c;
      return;
  }
  MT_FAIL("fp8", "unknown scaling ", int(s));
}

int64_t fp8_num_scales(int64_t R, int64_t C, Fp8Scaling s, int64_t block_r, int64_t block_c) {
  int64_t br, bc;
  fp8_block_shape(&br, &bc, R, C, s, block_r, block_c);
  return ((R + br - 1) / br) * ((C + bc - 1) / bc);
}

float fp8_scale_from_amax(float amax, Fp8Format f, bool pow2_scales) {
  float s = amax / fp8_max(f);
  if (!(s > 0.0f) || !std::isfinite(s)) return 1.0f;  // amax == 0, or underflow
  if (pow2_scales) {
    if (s < FLT_MIN) return FLT_MIN;  // 2^-126 >= s
    uint32_t b = std::bit_cast<uint32_t>(s);
    if (b & 0x7fffffu) b = (b & 0x7f800000u) + 0x800000u;  // next power of two up
    s = std::bit_cast<float>(b);
  }
  return s;
}

namespace {

// ---- scalar row kernels (the portable path; dtype.h codecs) ----
uint8_t enc(float v, int fmt) { return fmt == 0 ? float_to_e4m3_bits(v) : float_to_e5m2_bits(v); }
float dec(uint8_t b, int fmt) { return fmt == 0 ? e4m3_bits_to_float(b) : e5m2_bits_to_float(b); }

float amax_scalar(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    float a = std::fabs(x[i]);
    if (a < INFINITY && a > m) m = a;  // NaN and inf fail the first test
  }
  return m;
}
float amax_rows_scalar(const float* x, int64_t rows, int64_t n, int64_t ld) {
  float m = 0.0f;
  for (int64_t r = 0; r < rows; ++r) m = std::max(m, amax_scalar(x + r * ld, n));
  return m;
}
void encode_scalar(uint8_t* q, const float* x, int64_t n, float scale, int fmt) {
  for (int64_t i = 0; i < n; ++i) q[i] = enc(x[i] / scale, fmt);
}
// The 256 decoded values of each format, from the scalar codecs (so bitwise the same, NaN codes included):
// a table lookup instead of the bit manipulation, for the dequantize in the FP8 GEMMs' packing.
const float* decode_table(int fmt) {
  static const std::array<std::array<float, 256>, 2> t = [] {
    std::array<std::array<float, 256>, 2> a{};
    for (int f = 0; f < 2; ++f)
      for (int b = 0; b < 256; ++b) a[f][b] = dec(uint8_t(b), f);
    return a;
  }();
  return t[fmt].data();
}
void decode_scalar(float* x, const uint8_t* q, int64_t n, float scale, int fmt) {
  const float* t = decode_table(fmt);
  for (int64_t i = 0; i < n; ++i) x[i] = t[q[i]] * scale;
}
void fake_scalar(float* y, const float* x, int64_t n, float scale, int fmt) {
  for (int64_t i = 0; i < n; ++i) y[i] = dec(enc(x[i] / scale, fmt), fmt) * scale;
}

// One row of 1 x bc blocks: per block amax, scale (written to scales[bj]), then encode or fake quant.
void row_blocks_scalar(void* out, float* scales, const float* x, int64_t C, int64_t bc, int fmt, bool pow2,
                       bool fake) {
  for (int64_t bj = 0, c0 = 0; c0 < C; ++bj, c0 += bc) {
    const int64_t len = std::min(bc, C - c0);
    const float s = fp8_scale_from_amax(amax_scalar(x + c0, len), Fp8Format(fmt), pow2);
    scales[bj] = s;
    if (fake) fake_scalar(static_cast<float*>(out) + c0, x + c0, len, s, fmt);
    else encode_scalar(static_cast<uint8_t*>(out) + c0, x + c0, len, s, fmt);
  }
}

struct RowKernels {
  float (*amax)(const float*, int64_t);
  void (*encode)(uint8_t*, const float*, int64_t, float, int);
  void (*decode)(float*, const uint8_t*, int64_t, float, int);
  void (*fake)(float*, const float*, int64_t, float, int);
  void (*row_blocks)(void*, float*, const float*, int64_t, int64_t, int, bool, bool);
  float (*amax_rows)(const float*, int64_t, int64_t, int64_t);
};
RowKernels kernels() {
  if (active_isa() == Isa::Avx512)
    return {fp8_avx512::amax, fp8_avx512::encode_scaled, fp8_avx512::decode_scaled, fp8_avx512::fake_scaled,
            fp8_avx512::row_blocks, fp8_avx512::amax_rows};
  if (active_isa() == Isa::Avx2)
    return {fp8_avx2::amax, fp8_avx2::encode_scaled, fp8_avx2::decode_scaled, fp8_avx2::fake_scaled,
            fp8_avx2::row_blocks, fp8_avx2::amax_rows};
  return {amax_scalar, encode_scalar, decode_scalar, fake_scalar, row_blocks_scalar, amax_rows_scalar};
}

struct Plan {
  int64_t R, C, br, bc, nbr, nbc;
  int64_t nblocks() const { return nbr * nbc; }
};

Plan make_plan(const char* op, int64_t R, int64_t C, Fp8Format f, Fp8Scaling s, int64_t block_r, int64_t block_c) {
  MT_CHECK(f == Fp8Format::E4M3 || f == Fp8Format::E5M2, op, "unknown format ", int(f));
  Plan p{R, C, 0, 0, 0, 0};
  fp8_block_shape(&p.br, &p.bc, R, C, s, block_r, block_c);
  p.nbr = (R + p.br - 1) / p.br;
  p.nbc = (C + p.bc - 1) / p.bc;
  return p;
}

// Quantize (out = q, uint8) or fake-quantize (out = y, float) with block scales.
void scaled_pass(const Plan& p, void* out, bool fake, float* scales, const float* x, Fp8Format f, bool pow2,
                 const RowKernels& k) {
  if (p.R == 0 || p.C == 0) return;
  const int fmt = int(f);
  auto emit = [&](int64_t r, int64_t c0, int64_t len, float s) {
    const int64_t off = r * p.C + c0;
    if (fake) k.fake(static_cast<float*>(out) + off, x + off, len, s, fmt);
    else k.encode(static_cast<uint8_t*>(out) + off, x + off, len, s, fmt);
  };
  const int64_t nb = p.nblocks();
  auto block_amax = [&](int64_t bj, int64_t r0, int64_t r1) {
    const int64_t c0 = bj * p.bc, len = std::min(p.bc, p.C - c0);
    return k.amax_rows(x + r0 * p.C + c0, r1 - r0, len, p.C);
  };
  const int64_t nthr = omp_get_max_threads();
  if (p.br == 1 && p.R >= 2 * nthr) {  // row and 1 x bc blocks: a row is a work item, blocks left to right
    const size_t esz = fake ? sizeof(float) : 1;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < p.R; ++r)
      k.row_blocks(static_cast<char*>(out) + size_t(r * p.C) * esz, scales + r * p.nbc, x + r * p.C, p.C, p.bc, fmt,
                   pow2, fake);
    return;
  }
  if (nb >= 2 * nthr) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t bi = b / p.nbc, bj = b % p.nbc;
      const int64_t r0 = bi * p.br, r1 = std::min(p.R, r0 + p.br);
      const int64_t c0 = bj * p.bc, len = std::min(p.bc, p.C - c0);
      const float s = fp8_scale_from_amax(block_amax(bj, r0, r1), f, pow2);
      scales[b] = s;
      for (int64_t r = r0; r < r1; ++r) emit(r, c0, len, s);
    }
    return;
  }
  float red = 0.0f;
#pragma omp parallel
  {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t bi = b / p.nbc, bj = b % p.nbc;
      const int64_t r0 = bi * p.br, r1 = std::min(p.R, r0 + p.br);
#pragma omp single
      red = 0.0f;
#pragma omp for schedule(static) reduction(max : red)
      for (int64_t r = r0; r < r1; ++r) red = std::max(red, block_amax(bj, r, r + 1));
#pragma omp single
      scales[b] = fp8_scale_from_amax(red, f, pow2);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.R; ++r)
      for (int64_t bj = 0; bj < p.nbc; ++bj) {
        const int64_t c0 = bj * p.bc;
        emit(r, c0, std::min(p.bc, p.C - c0), scales[(r / p.br) * p.nbc + bj]);
      }
  }
}

}  // namespace

void fp8_quantize(uint8_t* q, float* scales, const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Scaling s,
                  int64_t block_r, int64_t block_c, bool pow2_scales) {
  const Plan p = make_plan("fp8_quantize", R, C, f, s, block_r, block_c);
  if (R * C == 0) return;
  MT_CHECK(q && scales && x, "fp8_quantize", "null pointer (q=", (void*)q, " scales=", (void*)scales,
           " x=", (const void*)x, ")");
  scaled_pass(p, q, false, scales, x, f, pow2_scales, kernels());
}

void fp8_fake_quant(float* y, float* scales, const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Scaling s,
                    int64_t block_r, int64_t block_c, bool pow2_scales) {
  const Plan p = make_plan("fp8_fake_quant", R, C, f, s, block_r, block_c);
  if (R * C == 0) return;
  MT_CHECK(y && scales && x, "fp8_fake_quant", "null pointer (y=", (void*)y, " scales=", (void*)scales,
           " x=", (const void*)x, ")");
  scaled_pass(p, y, true, scales, x, f, pow2_scales, kernels());
}

void fp8_dequantize(float* x, const uint8_t* q, const float* scales, int64_t R, int64_t C, Fp8Format f,
                    Fp8Scaling s, int64_t block_r, int64_t block_c) {
  const Plan p = make_plan("fp8_dequantize", R, C, f, s, block_r, block_c);
  if (R * C == 0) return;
  MT_CHECK(q && scales && x, "fp8_dequantize", "null pointer (x=", (void*)x, " q=", (const void*)q,
           " scales=", (const void*)scales, ")");
  const RowKernels k = kernels();
  const int fmt = int(f);
#pragma omp parallel for schedule(static) if (R * C >= (1 << 16))
  for (int64_t r = 0; r < R; ++r)
    for (int64_t bj = 0; bj < p.nbc; ++bj) {
      const int64_t c0 = bj * p.bc;
      k.decode(x + r * C + c0, q + r * C + c0, std::min(p.bc, C - c0), scales[(r / p.br) * p.nbc + bj], fmt);
    }
}

void fp8_fake_quant_backward(float* dx, const float* dy, int64_t n) {
  MT_CHECK(n >= 0, "fp8_fake_quant_backward", "negative size n=", n);
  if (n == 0 || dx == dy) return;
  MT_CHECK(dx && dy, "fp8_fake_quant_backward", "null pointer with n=", n);
  std::memcpy(dx, dy, size_t(n) * sizeof(float));  // straight-through estimator
}

void fp8_encode(uint8_t* out, const float* in, int64_t n, Fp8Format f) {
  MT_CHECK(n >= 0, "fp8_encode", "negative size n=", n);
  kernels().encode(out, in, n, 1.0f, int(f));
}
void fp8_decode(float* out, const uint8_t* in, int64_t n, Fp8Format f) {
  MT_CHECK(n >= 0, "fp8_decode", "negative size n=", n);
  kernels().decode(out, in, n, 1.0f, int(f));
}

// ---- reference twins: block by block, written for clarity ----

void fp8_quantize_ref(uint8_t* q, float* scales, const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Scaling s,
                      int64_t block_r, int64_t block_c, bool pow2_scales) {
  const Plan p = make_plan("fp8_quantize_ref", R, C, f, s, block_r, block_c);
  for (int64_t bi = 0; bi < p.nbr; ++bi)
    for (int64_t bj = 0; bj < p.nbc; ++bj) {
      const int64_t r1 = std::min(R, (bi + 1) * p.br), c1 = std::min(C, (bj + 1) * p.bc);
      float amax = 0.0f;
      for (int64_t r = bi * p.br; r < r1; ++r)
        for (int64_t c = bj * p.bc; c < c1; ++c)
          if (std::isfinite(x[r * C + c])) amax = std::max(amax, std::fabs(x[r * C + c]));
      const float sc = fp8_scale_from_amax(amax, f, pow2_scales);
      scales[bi * p.nbc + bj] = sc;
      for (int64_t r = bi * p.br; r < r1; ++r)
        for (int64_t c = bj * p.bc; c < c1; ++c)
          q[r * C + c] = f == Fp8Format::E4M3 ? float_to_e4m3_bits(x[r * C + c] / sc)
                                              : float_to_e5m2_bits(x[r * C + c] / sc);
    }
}

void fp8_dequantize_ref(float* x, const uint8_t* q, const float* scales, int64_t R, int64_t C, Fp8Format f,
                        Fp8Scaling s, int64_t block_r, int64_t block_c) {
  const Plan p = make_plan("fp8_dequantize_ref", R, C, f, s, block_r, block_c);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const float sc = scales[(r / p.br) * p.nbc + c / p.bc];
      x[r * C + c] = (f == Fp8Format::E4M3 ? e4m3_bits_to_float(q[r * C + c]) : e5m2_bits_to_float(q[r * C + c])) * sc;
    }
}

}  // namespace moetron
