// mask_avx512.h: the one 16-lane tail mask of the AVX-512 and AMX kernels that work on 16 columns or pairs at a
// time (the grouped GEMM's tiles, the bf16 attention and its AMX products): lanes [0, n) set, n clamped to
// [0, 16]. Include only from files compiled with the AVX-512 flags; file-local. Not a kernel.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace {

inline __mmask16 mask16(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u);
}

}  // namespace
