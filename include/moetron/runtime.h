// runtime.h: process-wide runtime facts: CPU features and the ISA the SIMD kernels dispatch to, and
// the OpenMP thread count. Not a scheduler: OpenMP and oneDNN (built on the same GNU OpenMP runtime)
// share one thread pool, sized here.
#pragma once
#include <string>
#include <string_view>

namespace moetron {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512bf16 = false;
  bool amx_bf16 = false;  // AMX-BF16 tiles (Intel Sapphire Rapids on): CPUID.(7,0):EDX[22]
  bool amd = false;       // vendor "AuthenticAMD" (CPUID leaf 0)
};
const CpuFeatures& cpu_features();

// The ISA levels the hand-written kernels are compiled for. Avx512 implies AVX512-BF16 here.
enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2 };
// Best ISA the CPU supports, lowered by MOETRON_ISA=scalar|avx2|avx512 (never raised above the CPU).
Isa active_isa();
void set_isa_override(Isa isa);  // for tests; clamps to what the CPU supports
std::string_view isa_name(Isa isa);

// The AMX-BF16 tile unit for the hand-written bf16 kernels (the grouped GEMM, bf16 attention's products): true
// when the CPU has it, the kernel granted this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, asked
// once), the active ISA is Avx512, and MOETRON_ISA is unset or "amx" ("avx512" keeps the kernels on vdpbf16ps).
// oneDNN's matmuls choose AMX on their own (DNNL_MAX_CPU_ISA caps them).
bool amx_active();
bool amx_available();            // the CPU has it and the OS granted it (whatever the caps)
void set_amx_override(int mode);  // for tests and benchmarks: 1 on (if available), 0 off, -1 the environment's choice

// Thread count: `requested` if > 0 (the trainer's training.threads), else OMP_NUM_THREADS, else the number
// of online cores divided by `local_ranks` (ranks sharing this machine), at least 1. Without `requested` a
// retired variable (MOETRON_NUM_THREADS, env.h) is refused first.
int init_threads(int requested = 0, int local_ranks = 1);
int num_threads();

std::string runtime_summary();  // one line: ISA, threads, oneDNN version

}  // namespace moetron
