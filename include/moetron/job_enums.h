// job_enums.h: the enums of the job configuration that kernel and parallel headers name (the EP dispatcher,
// the FP8 recipe, the compute dtype, ...), with their to_string. Small on purpose: a kernel or parallel header
// includes this, not config.h.
// Not the job configuration (config.h: the sections, their defaults, loading and validation); to_string (the
// names the TOML keys take) is defined with the config, in src/job/config.cpp.
#pragma once
#include <cstdint>
#include <string_view>

namespace moetron {

enum class Precision : uint8_t { BF16, FP32, FP8 };  // element sizes for the accounting (planner and engine)
// [training] compute_dtype: the element type of the GEMM operands and of the activations saved for them.
// Auto picks BF16 where the CPU computes bf16 dot products natively (AVX512-BF16 or AMX-BF16) and FP32
// everywhere else (runtime.h: resolve_compute_dtype). Masters, optimizer state and reductions stay fp32.
enum class ComputeDtype : uint8_t { Auto, BF16, FP32 };
enum class DecayType : uint8_t { Cosine, Linear, None };
enum class EpDispatcher : uint8_t { AllToAll, SyncFree, Hierarchical };
// [parallelism] ep_transport: how the flat dispatchers' rows move between EP ranks: MPI messages, or shared
// memory when every EP rank is on one node (rows read and written in place; src/ep/dispatch_shm.cpp).
enum class EpTransport : uint8_t { Mpi, Shm };
enum class AcMode : uint8_t { None, Selective, Full };
// [quantize] recipe: the FP8 training recipe (how GEMM operands are scaled). The planner prices its GEMMs at
// the FP8 rate plus the quantization passes; the engine emulates the recipe exactly (QuantizeSpec in config.h).
enum class Fp8Recipe : uint8_t { None, Tensorwise, Rowwise, Blockwise, MXFP8 };

std::string_view to_string(Precision v);
std::string_view to_string(ComputeDtype v);
std::string_view to_string(DecayType v);
std::string_view to_string(EpDispatcher v);
std::string_view to_string(EpTransport v);
std::string_view to_string(AcMode v);
std::string_view to_string(Fp8Recipe v);

}  // namespace moetron
