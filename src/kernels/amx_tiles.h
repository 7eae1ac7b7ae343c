// amx_tiles.h: what the AMX-BF16 kernels share (grouped_gemm_amx.cpp, attention_amx.cpp): the 64-byte tile
// configuration record of palette 1 and the switch that names C tiles 0-3 by a literal. Include only from
// files compiled with -mamx-tile -mamx-bf16; everything here is file-local. Not a kernel.
#pragma once
#include <cstdint>

namespace {

// The memory image _tile_loadconfig reads: palette 1, then per tile register its bytes per row and its rows.
struct alignas(64) AmxTileCfg {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

// GCC's tile intrinsics paste the register number into the assembly text: it must be a literal, so a C tile
// chosen at run time (IDX, 0-3) is named through this switch; OP(n) is the statement for tile n.
#define MT_AMX_C_CASES(IDX, OP) \
  switch (IDX) {                \
    case 0: OP(0); break;       \
    case 1: OP(1); break;       \
    case 2: OP(2); break;       \
    default: OP(3); break;      \
  }
