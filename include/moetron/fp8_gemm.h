// fp8_gemm.h: the FP8 training recipes' operands and GEMMs, as an exact emulation on the CPU.
//   * Fp8Tensor: an operand quantized along its contraction dimension (the last, contiguous one) with the
//     scales of one recipe (tensorwise, rowwise, blockwise, mxfp8) in E4M3 or E5M2;
//   * fp8_gemm: C[M, N] = A[M, K] · B[N, K]^T, both operands quantized along K ("TN", the layout FP8 tensor
//     cores require); forward, dgrad and wgrad are this one call with differently quantized operands;
//   * fp8_grouped_gemm_m / _k: the MoE expert GEMMs (M-grouped forward and dgrad, K-grouped wgrad);
//   * the naive twins (dequantize, multiply and add in float64);
//   * Fp8AmaxHistory: the data structure for delayed (history-based) tensorwise scaling.
// Not the model integration (which linears are FP8, caching activations, metrics): that is the model's job.
//
// Recipes and their scale tiles, for an operand [R, C] quantized along C (see fp8.h for the scale rule):
//   tensorwise  one fp32 scale for the tensor
//   rowwise     one fp32 scale per row (per token for activations, per output channel for weights)
//   blockwise   1 x 128 tiles for activations and gradients, 128 x 128 blocks for weights (DeepSeek-V3)
//   mxfp8       1 x 32 tiles with a power-of-two scale (an E8M0 exponent; OCP Microscaling): the scale is
//               amax / fmt_max rounded UP to a power of two, so no element saturates. Held here as an fp32
//               that is exactly 2^e; fp8_e8m0_encode packs it into the one byte a kernel would store.
//
// The three GEMMs of a linear Y = X · W^T (X [T, in], W [out, in], dY [T, out]) and their operands:
//   forward  Y  [T, out] = X [T, in]   · W [out, in]^T     X along in,   W along in
//   dgrad    dX [T, in]  = dY [T, out] · (W^T) [in, out]^T  dY along out, W^T along out
//   wgrad    dW [out, in] = (dY^T) [out, T] · (X^T) [in, T]^T  dY^T and X^T along the tokens T
// How the transposed operands W^T, dY^T, X^T are obtained, per recipe:
//   tensorwise  fp8_transpose: the codes are transposed and the one scale kept (exact, no requantization);
//   blockwise   weights: fp8_transpose of the 128 x 128 blocks (a block is its own transpose; exact, which
//               is why DeepSeek-V3 uses square weight blocks); activations and gradients: quantized again
//               from the high-precision tensor with 1 x 128 tiles along the tokens (128 x 1 in the original);
//   rowwise and mxfp8: quantized again from the high-precision tensor along the other dimension
//               (fp8_quantize_operand_t), because a scale per row of X is not a scale per row of X^T.
// fp8_transpose refuses rowwise, mxfp8 and 1 x 128 tiles by name.
//
// How exact the emulation is. The kernels decode each operand to fp32 (decode(q) * scale, in the packing
// step) and run the batch-invariant fp32 GEMM (gemm_f32). An FP8 value has at most 4 significant bits, so
//   * with a power-of-two scale (mxfp8 always, other recipes with pow2_scales) decode(q) * scale is exact in
//     fp32 (barring underflow below 2^-149), and so is the product of two such values (<= 8 significant
//     bits; barring products that underflow below 2^-126): the only rounding is the fp32 accumulation,
//     |C - C_exact| <= gamma_K * sum_k |a_k b_k| with gamma_K = K u / (1 - K u), u = 2^-24; such values are
//     also exact in bf16 (8 significant bits);
//   * with an arbitrary fp32 scale (amax / fmt_max) the dequantized value is rounded once (u) and the product
//     once more (u): the bound is gamma_(K+2).
// The result is bitwise equal to gemm_f32 (Trans::N, Trans::T) of the dequantized operands, whose order of
// accumulation (k = 0..K-1, fused multiply-adds) it shares. The fp64 twin is exact up to fp64 rounding
// (products are exact in fp64; sums round at 2^-53).
#pragma once
#include <cstdint>
#include <vector>

#include "moetron/fp8.h"
#include "moetron/job_enums.h"

namespace moetron {

// Which tile a blockwise recipe uses: activations and gradients 1 x 128, weights 128 x 128.
enum class Fp8Role : uint8_t { Activation, Weight };

// The scale tiling of a recipe for one role, in the terms of fp8.h.
struct Fp8Layout {
  Fp8Scaling scaling = Fp8Scaling::Tensor;
  int64_t block_r = 0, block_c = 0;
  bool pow2 = false;  // scales are powers of two
};
// Throws for Fp8Recipe::None. pow2_scales asks for power-of-two scales in the other recipes (mxfp8 always has).
Fp8Layout fp8_recipe_layout(Fp8Recipe r, Fp8Role role, bool pow2_scales = false);
const char* fp8_role_name(Fp8Role r);

// An operand [rows, cols], quantized along cols (row-major codes, scales as fp8.h lays them out).
struct Fp8Tensor {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  int64_t rows = 0, cols = 0;
  Fp8Format fmt = Fp8Format::E4M3;
  Fp8Recipe recipe = Fp8Recipe::Tensorwise;
  Fp8Role role = Fp8Role::Activation;
  bool pow2 = false;
  Fp8Layout layout() const { return fp8_recipe_layout(recipe, role, pow2); }
  // Bytes a GPU kernel would hold: 1 per code, 4 per fp32 scale, 1 per E8M0 scale (mxfp8).
  int64_t storage_bytes() const;
};

// Current scaling: x [R, C] quantized along C (scales from the amax of each tile now).
Fp8Tensor fp8_quantize_operand(const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Recipe r, Fp8Role role,
                               bool pow2_scales = false);
// x^T [C, R] quantized along R, from the high-precision x [R, C] (the transposed operands of dgrad / wgrad).
Fp8Tensor fp8_quantize_operand_t(const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Recipe r, Fp8Role role,
                                 bool pow2_scales = false);
// The exact transpose of quantized data: tensorwise, and blockwise with square blocks (weights). Other
// recipes throw (quantize the transpose again with fp8_quantize_operand_t).
Fp8Tensor fp8_transpose(const Fp8Tensor& a);
// The three above into an existing operand, reusing its storage (and xt's, the transposed copy of x): once `t` and
// `xt` have held an operand as large, nothing is allocated. Bitwise the by-value forms, which call these.
void fp8_quantize_operand_into(Fp8Tensor& t, const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Recipe r,
                               Fp8Role role, bool pow2_scales = false);
void fp8_quantize_operand_t_into(Fp8Tensor& t, std::vector<float>& xt, const float* x, int64_t R, int64_t C,
                                 Fp8Format f, Fp8Recipe r, Fp8Role role, bool pow2_scales = false);
void fp8_transpose_into(Fp8Tensor& t, const Fp8Tensor& a);  // t must not be a
// out [rows, cols] = decode(q) * scale.
void fp8_dequantize_operand(float* out, const Fp8Tensor& a);

// E8M0 (bias 127, 0xFF = NaN): exact for the powers of two 2^-127 .. 2^127. Encoding a non-power of two or an
// out-of-range value throws.
uint8_t fp8_e8m0_encode(float pow2_scale);
float fp8_e8m0_decode(uint8_t e);

// ---- GEMMs: fp32 accumulation and output ----
// C[M, N] = A[M, K] · B[N, K]^T (beta == 0) or + beta * C. A.cols == B.cols == K; ldc >= N.
void fp8_gemm(float* C, int64_t ldc, const Fp8Tensor& A, const Fp8Tensor& B, float beta = 0.0f);

// M-grouped (forward and dgrad): rows [off[e], off[e+1]) of A (off = prefix sum of counts) times B[e]^T go to
// the same rows of C [M, N]. A [M, K] is quantized along K for all experts at once (its tiles lie within a
// row, so a row split is valid for rowwise, 1 x 128 and mxfp8; tensorwise shares one scale); B[e] [N, K].
void fp8_grouped_gemm_m(float* C /* [M, N] */, const Fp8Tensor& A, const std::vector<Fp8Tensor>& B,
                        const int32_t* counts /* [E] */);
// K-grouped (wgrad): C[e] [K, N] = (or +=) A[e] · B[e]^T with A[e] = X_e^T [K, m_e] and B[e] = dY_e^T [N, m_e],
// each quantized along the tokens of expert e (tiles never straddle two experts). m_e == 0 gives C[e] = 0
// (or keeps it when accumulating).
void fp8_grouped_gemm_k(float* C /* [E, K, N] */, const std::vector<Fp8Tensor>& A, const std::vector<Fp8Tensor>& B,
                        int64_t K, int64_t N, bool accumulate);
// The per-expert transposes of a row-grouped x [M, C]: element e is x_e^T [C, m_e] quantized along m_e.
std::vector<Fp8Tensor> fp8_quantize_groups_t(const float* x, int64_t M, int64_t C, const int32_t* counts, int64_t E,
                                             Fp8Format f, Fp8Recipe r, bool pow2_scales = false);

// ---- naive twins: dequantize exactly into float64, multiply and add in float64 ----
void fp8_gemm_ref(double* C /* [M, N] */, const Fp8Tensor& A, const Fp8Tensor& B);
void fp8_grouped_gemm_m_ref(double* C, const Fp8Tensor& A, const std::vector<Fp8Tensor>& B, const int32_t* counts);
void fp8_grouped_gemm_k_ref(double* C, const std::vector<Fp8Tensor>& A, const std::vector<Fp8Tensor>& B, int64_t K,
                            int64_t N);

// ---- delayed scaling (Transformer Engine's recipe; tensorwise only) ----
// The scale of step t comes from the amax of the previous `len` steps; the quantization of step t records its
// own amax. State to checkpoint: history and pos.
struct Fp8AmaxHistory {
  std::vector<float> history;  // ring of the last len amaxes (0 = not seen yet)
  int64_t pos = 0;             // next slot to write
  explicit Fp8AmaxHistory(int64_t len = 16);
  float amax() const;  // max over the history
  float scale(Fp8Format f, bool pow2_scales = false) const { return fp8_scale_from_amax(amax(), f, pow2_scales); }
  void push(float amax);
};
// Tensorwise quantization of x [R, C] with a given scale (> 0; values beyond fmt_max * scale saturate); the
// tensor's own amax goes to *amax_out when given. What delayed scaling quantizes with.
Fp8Tensor fp8_quantize_scaled(const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Role role, float scale,
                              float* amax_out = nullptr, bool pow2_scales = false);
// fp8_quantize_scaled with the history's scale, then the tensor's own amax pushed into hist. Returns the operand.
Fp8Tensor fp8_quantize_delayed(const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Role role, Fp8AmaxHistory& hist,
                               bool pow2_scales = false);

}  // namespace moetron
