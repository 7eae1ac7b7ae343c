// runtime.cpp: CPU feature detection, ISA override and thread-count policy.
#include "moetron/env.h"
#include "moetron/runtime.h"

#include <cpuid.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>
#include <sstream>
#include <string>

#include "moetron/check.h"

namespace moetron {

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    CpuFeatures c;
    __builtin_cpu_init();
    c.avx2 = __builtin_cpu_supports("avx2");
    c.fma = __builtin_cpu_supports("fma");
    c.f16c = true;  // present on every AVX2 CPU we target; checked together with avx2 below
    c.avx512f = __builtin_cpu_supports("avx512f");
    c.avx512bw = __builtin_cpu_supports("avx512bw");
    c.avx512vl = __builtin_cpu_supports("avx512vl");
    c.avx512dq = __builtin_cpu_supports("avx512dq");
    c.avx512bf16 = __builtin_cpu_supports("avx512bf16");
    unsigned a = 0, b = 0, cx = 0, dx = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &cx, &dx)) c.amx_bf16 = (dx >> 22) & 1u;
    if (__get_cpuid(0, &a, &b, &cx, &dx)) c.amd = b == 0x68747541u && dx == 0x69746e65u && cx == 0x444d4163u;
    return c;
  }();
  return f;
}

static Isa cpu_best_isa() {
  const auto& c = cpu_features();
  if (c.avx512f && c.avx512bw && c.avx512vl && c.avx512dq && c.avx512bf16) return Isa::Avx512;
  if (c.avx2 && c.fma) return Isa::Avx2;
  return Isa::Scalar;
}

// MOETRON_ISA, read on first use (not at static initialisation, so a bad value is an Error the caller reports,
// naming the variable, rather than a termination before main); never raises the ISA above the CPU's.
static const std::string& env_isa_choice() {
  static const std::string s = env_choice("MOETRON_ISA", "", {"scalar", "avx2", "avx512", "amx"}, "kernel ISA");
  return s;
}
static Isa env_isa() {
  const Isa best = cpu_best_isa();
  const std::string& s = env_isa_choice();
  if (s.empty()) return best;
  const Isa want = s == "scalar" ? Isa::Scalar : s == "avx2" ? Isa::Avx2 : Isa::Avx512;
  return want < best ? want : best;
}
static std::atomic<int> g_isa_override{-1};  // set_isa_override (tests): replaces the environment's choice

Isa active_isa() {
  const int o = g_isa_override.load(std::memory_order_relaxed);
  if (o >= 0) return Isa(o);
  static const Isa from_env = env_isa();
  return from_env;
}
void set_isa_override(Isa isa) {
  const Isa best = cpu_best_isa();
  g_isa_override.store(int(isa < best ? isa : best), std::memory_order_relaxed);
}

bool amx_available() {
  static const bool ok = [] {
    if (!cpu_features().amx_bf16 || cpu_best_isa() != Isa::Avx512) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    // Linux 5.16+: the tile data state (XFEATURE 18) must be requested before the first tile instruction.
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}
static std::atomic<int> g_amx_override{-1};
bool amx_active() {
  if (active_isa() != Isa::Avx512 || !amx_available()) return false;
  const int o = g_amx_override.load(std::memory_order_relaxed);
  if (o >= 0) return o == 1;
  return env_isa_choice() != "avx512";
}
void set_amx_override(int mode) { g_amx_override.store(mode < 0 ? -1 : mode > 0 ? 1 : 0, std::memory_order_relaxed); }

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "?";
}

static int env_int(const char* name) { return int(env_int_in(name, 0, 1, 4096, "init_threads")); }

int init_threads(int requested, int local_ranks) {
  int n = requested;
  if (n <= 0) refuse_retired_env();  // MOETRON_NUM_THREADS (retired: training.threads) is an error, not a fallback
  if (n <= 0) n = env_int("OMP_NUM_THREADS");
  if (n <= 0) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    n = int(cores > 0 ? cores : 1) / (local_ranks > 0 ? local_ranks : 1);
  }
  if (n < 1) n = 1;
  omp_set_num_threads(n);
  return n;
}

int num_threads() { return omp_get_max_threads(); }

std::string runtime_summary() {
  const dnnl_version_t* v = dnnl_version();
  std::ostringstream os;
  os << "isa=" << isa_name(active_isa()) << (amx_active() ? "+amx" : "") << " threads=" << num_threads() << " onednn=" << v->major << "."
     << v->minor << "." << v->patch;
  return os.str();
}

}  // namespace moetron
