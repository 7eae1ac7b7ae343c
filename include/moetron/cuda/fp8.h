// cuda/fp8.h: the CUDA backend's FP8: tensorwise current scaling to E4M3 (fp8.h's Fp8Scaling::Tensor rule:
// amax over the finite values, scale = amax / 448 (1 when that is 0 or not finite), q = encode(x / scale), round
// to nearest even, saturating, NaN -> NaN, +-inf -> +-448) with the scale computed and kept ON THE DEVICE, its
// dequantize, and an FP8 GEMM through cuBLASLt that takes the device scales. The codec is written out in integer
// steps like dtype.cpp's, so q and the scale are bitwise fp8_quantize_ref's (Tensor, E4M3, no pow2 scales).
// The GEMM needs CUDA >= 12.0 at build time and a device with FP8 tensor cores (sm_89 with CUDA >= 12.1, sm_90+);
// elsewhere fp8_gemm_available says why and fp8_gemm_e4m3 throws naming the reason (it compiles everywhere,
// nvcc 11.8 included). Not E5M2, row/block scaling or delayed scaling (the CPU engine's fp8.h has them). C++17-clean.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace moetron::cuda {

// ws: fp8_quantize_workspace_bytes() device bytes (the amax). scale: device float [1].
size_t fp8_quantize_workspace_bytes();
void fp8_quantize_tensor_e4m3(uint8_t* q, float* scale, const float* x, int64_t n, void* ws, void* stream);
void fp8_dequantize_tensor_e4m3(float* x, const uint8_t* q, const float* scale, int64_t n, void* stream);

// Whether this build and the current device can run fp8_gemm_e4m3; *why gets the reason when not.
bool fp8_gemm_available(std::string* why = nullptr);
size_t fp8_gemm_workspace_bytes();  // cuBLASLt workspace handed to the call (32 MiB)
// C [M, N] (row-major, fp32) = a_scale * b_scale * A [M, K] · B [N, K]^T: both operands row-major with K
// contiguous (the layout quantized along the contraction dimension; cuBLASLt's "TN"), scales on the device.
// Needs M, N, K multiples of 16 and 16-byte aligned pointers. fp32 accumulation (no fast-accumulation mode).
void fp8_gemm_e4m3(float* C, const uint8_t* A, const float* a_scale, const uint8_t* B, const float* b_scale, int64_t M,
                   int64_t N, int64_t K, void* ws, size_t ws_bytes, void* stream);

}  // namespace moetron::cuda
