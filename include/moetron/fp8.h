// fp8.h: FP8 (E4M3 / E5M2) quantize and dequantize of fp32 matrices with per-tensor, per-row or
// per-block fp32 scales, the "fake quant" (quantize then dequantize) helper with its straight-through
// backward, and vector codecs that match the scalar codecs of dtype.h bit for bit.
// Not an FP8 GEMM: the recipes' operands (quantized along the contraction dimension) and the FP8 GEMM and
// grouped GEMM built on these kernels are in fp8_gemm.h.
//
// Scales. A matrix x [R, C] (row-major, contiguous) is cut into blocks of br x bc (the last block row /
// column may be partial). Tensor scaling is one block (br = R, bc = C); Row is br = 1, bc = C; Block takes
// (block_r, block_c): 1 x 128 for activations, 128 x 128 for weights. Scales are stored row-major
// [ceil(R / br), ceil(C / bc)], one fp32 per block:
//   amax  = max |x| over the finite values of the block (NaN and +-inf are ignored)
//   scale = amax / fmt_max            (1 if amax == 0 or the quotient underflows to 0)
//   pow2 : scale rounded up to a power of two (then x / scale and q * scale are exact)
//   q     = encode(x / scale)         (round to nearest even, saturating; NaN -> NaN, +-inf -> +-max)
//   x'    = decode(q) * scale
#pragma once
#include <cstdint>

#include "moetron/dtype.h"

namespace moetron {

enum class Fp8Format { E4M3, E5M2 };
enum class Fp8Scaling { Tensor, Row, Block };

float fp8_max(Fp8Format f);            // 448 or 57344
int fp8_mantissa_bits(Fp8Format f);    // 3 or 2
int fp8_min_normal_exp(Fp8Format f);   // -6 or -14: smallest normal is 2^this
const char* fp8_format_name(Fp8Format f);
const char* fp8_scaling_name(Fp8Scaling s);

// The block shape a scaling resolves to for an [R, C] matrix (checks block_r, block_c for Block).
void fp8_block_shape(int64_t* br, int64_t* bc, int64_t R, int64_t C, Fp8Scaling s, int64_t block_r,
                     int64_t block_c);
int64_t fp8_num_scales(int64_t R, int64_t C, Fp8Scaling s, int64_t block_r, int64_t block_c);

void fp8_quantize(uint8_t* q /* [R, C] */, float* scales /* [fp8_num_scales] */, const float* x /* [R, C] */,
                  int64_t R, int64_t C, Fp8Format f, Fp8Scaling s, int64_t block_r, int64_t block_c,
                  bool pow2_scales = false);
void fp8_dequantize(float* x /* [R, C] */, const uint8_t* q /* [R, C] */, const float* scales /* [num_scales] */,
                    int64_t R, int64_t C, Fp8Format f, Fp8Scaling s, int64_t block_r, int64_t block_c);

// Fake quant: y = dequantize(quantize(x)) without materializing q; scales are written too (the caller
// owns [fp8_num_scales]). y may alias x. Backward is the straight-through estimator: dx = dy.
void fp8_fake_quant(float* y /* [R, C] */, float* scales /* [num_scales] */, const float* x /* [R, C] */, int64_t R,
                    int64_t C, Fp8Format f, Fp8Scaling s, int64_t block_r, int64_t block_c, bool pow2_scales = false);
void fp8_fake_quant_backward(float* dx /* [n] */, const float* dy /* [n] */, int64_t n);

// Vector codecs (AVX-512 when active, else the scalar codecs): out[i] = encode(in[i]) / decode(in[i]).
void fp8_encode(uint8_t* out /* [n] */, const float* in /* [n] */, int64_t n, Fp8Format f);
void fp8_decode(float* out /* [n] */, const uint8_t* in /* [n] */, int64_t n, Fp8Format f);

// Scale for one block from its amax (the rule above); shared by the kernels and the reference.
float fp8_scale_from_amax(float amax, Fp8Format f, bool pow2_scales);

// ---- reference twins: one block at a time, scalar codecs of dtype.h ----
void fp8_quantize_ref(uint8_t* q, float* scales, const float* x, int64_t R, int64_t C, Fp8Format f, Fp8Scaling s,
                      int64_t block_r, int64_t block_c, bool pow2_scales = false);
void fp8_dequantize_ref(float* x, const uint8_t* q, const float* scales, int64_t R, int64_t C, Fp8Format f,
                        Fp8Scaling s, int64_t block_r, int64_t block_c);

}  // namespace moetron
