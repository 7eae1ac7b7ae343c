// ep_wire.cpp: the row-parallel bf16 wire conversions of ep_wire.h (OpenMP over rows, serial below kParMin).
// Not the per-row codecs (inline in ep_wire.h) and not the payload choice (dispatcher.h).
#include "ep/ep_wire.h"

namespace moetron::ep {

void to_wire_bf16_rows(bf16* out, const float* in, int64_t rows, int64_t D) {
#pragma omp parallel for schedule(static) if (rows * D >= kParMin)
  for (int64_t r = 0; r < rows; ++r) to_wire_bf16(out + r * D, in + r * D, D);
}

void from_wire_bf16_rows(float* out, const bf16* in, int64_t rows, int64_t D) {
#pragma omp parallel for schedule(static) if (rows * D >= kParMin)
  for (int64_t r = 0; r < rows; ++r) from_wire_bf16(out + r * D, in + r * D, D);
}

}  // namespace moetron::ep
