// gemm_shape_tables.h (internal to src/plan): the catalog's measured GEMM shape tables, TOML text of the key
// `gemm_shape_efficiency` (docs/hardware.md). Data only; the source and its reading are in the .cpp.
#pragma once

namespace moetron::plan {

extern const char* const kSm90GemmShapeToml;   // Hopper (H100 / H200 / H800)
extern const char* const kSm100GemmShapeToml;  // Blackwell (B200, and GB200 / GB300 derived)

}  // namespace moetron::plan
