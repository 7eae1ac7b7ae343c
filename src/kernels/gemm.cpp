// gemm.cpp: the dense GEMMs through oneDNN: gemm_f32_onednn (dnnl_sgemm, not batch invariant) and gemm_bf16
// (a matmul primitive cached per shape, alpha and beta, since oneDNN primitive creation costs far more than a
// small matmul; alpha is an output scale and beta a sum post-op, strides and transposes are memory-descriptor
// strides, so nothing is copied; where oneDNN has no bf16 matmul, the operands are widened to fp32 and go
// through gemm_f32). Also the bf16 <-> fp32 vector conversions and a threaded zero fill. Not the batch-invariant gemm_f32 (that is
// gemm_f32.cpp) nor the grouped (MoE) GEMM (grouped_gemm.cpp).
#include <algorithm>
#include <cstring>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "kernels/gemm_common.h"
#include "moetron/check.h"
#include "moetron/gemm.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

namespace {

dnnl::engine& cpu_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

struct MatmulKey {
  int64_t M, N, K, sa0, sa1, sb0, sb1, ldc;
  float alpha, beta;
  bool operator==(const MatmulKey& o) const {
    return std::tie(M, N, K, sa0, sa1, sb0, sb1, ldc, alpha, beta) ==
           std::tie(o.M, o.N, o.K, o.sa0, o.sa1, o.sb0, o.sb1, o.ldc, o.alpha, o.beta);
  }
};
struct MatmulKeyHash {
  size_t operator()(const MatmulKey& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : {k.M, k.N, k.K, k.sa0, k.sa1, k.sb0, k.sb1, k.ldc}) h = (h ^ size_t(v)) * 1099511628211ull;
    return h ^ std::hash<float>()(k.alpha) ^ (std::hash<float>()(k.beta) << 1);
  }
};

struct CachedMatmul {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c;
  bool ok = false;  // false: oneDNN has no bf16 matmul here
};

CachedMatmul& get_bf16_matmul(const MatmulKey& k) {
  static std::unordered_map<MatmulKey, CachedMatmul, MatmulKeyHash> cache;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  using dt = dnnl::memory::data_type;
  dnnl::memory::desc a({k.M, k.K}, dt::bf16, dnnl::memory::dims{k.sa0, k.sa1});
  dnnl::memory::desc b({k.K, k.N}, dt::bf16, dnnl::memory::dims{k.sb0, k.sb1});
  dnnl::memory::desc c({k.M, k.N}, dt::f32, dnnl::memory::dims{k.ldc, 1});
  dnnl::primitive_attr attr;
  if (k.alpha != 1.0f) attr.set_output_scales(0, {k.alpha});
  if (k.beta != 0.0f) {  // C = alpha * A·B + beta * C through the sum post-op
    dnnl::post_ops po;
    po.append_sum(k.beta);
    attr.set_post_ops(po);
  }
  CachedMatmul cm{{}, a, b, c, false};
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, cpu_engine());
    cm.prim = dnnl::matmul(pd);
    cm.ok = true;
  } catch (const dnnl::error&) {
    // No bf16 matmul on this CPU (oneDNN 2.x needs AVX512-BF16 or AVX512-core for it): gemm_bf16 falls back.
  }
  auto [pos, _] = cache.emplace(k, std::move(cm));
  return pos->second;
}

}  // namespace

void gemm_f32_onednn(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (gemm_detail::prologue("gemm_f32_onednn", ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc)) return;
  MT_TRACE_COST(2.0 * double(M) * double(N) * double(K), 4.0 * double(M * K + K * N + M * N * (beta != 0 ? 2 : 1)));
  dnnl_status_t st = dnnl_sgemm(ta == Trans::T ? 'T' : 'N', tb == Trans::T ? 'T' : 'N', M, N, K, alpha, A, lda, B,
                                ldb, beta, C, ldc);
  MT_CHECK(st == dnnl_success, "gemm_f32_onednn", "dnnl_sgemm failed with status ", int(st));
}

bool gemm_bf16_native() {
  static const bool ok = [] {
    if (!cpu_features().avx512bf16) return false;  // oneDNN would emulate or refuse: not native either way
    try {
      using dt = dnnl::memory::data_type;
      dnnl::memory::desc a({64, 64}, dt::bf16, dnnl::memory::dims{64, 1});
      dnnl::memory::desc c({64, 64}, dt::f32, dnnl::memory::dims{64, 1});
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, a, c), cpu_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return ok;
}

void gemm_bf16(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A, int64_t lda,
               const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (gemm_detail::prologue("gemm_bf16", ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc)) return;
  MatmulKey key{M,
                N,
                K,
                ta == Trans::N ? lda : 1,
                ta == Trans::N ? 1 : lda,
                tb == Trans::N ? ldb : 1,
                tb == Trans::N ? 1 : ldb,
                ldc,
                alpha,
                beta};
  CachedMatmul& mm = get_bf16_matmul(key);
  if (!mm.ok) {
    // Fallback: widen the stored operands to fp32 (exact) and run gemm_f32 (fp32 accumulation, as promised).
    const int64_t ar = ta == Trans::N ? M : K, ac = ta == Trans::N ? K : M;
    const int64_t br = tb == Trans::N ? K : N, bc = tb == Trans::N ? N : K;
    static thread_local std::vector<float> a32, b32;
    a32.resize(size_t(ar * ac)), b32.resize(size_t(br * bc));
    for (int64_t i = 0; i < ar; ++i) bf16_to_f32_serial(a32.data() + i * ac, A + i * lda, ac);
    for (int64_t i = 0; i < br; ++i) bf16_to_f32_serial(b32.data() + i * bc, B + i * ldb, bc);
    return gemm_f32(ta, tb, M, N, K, alpha, a32.data(), ac, b32.data(), bc, beta, C, ldc);
  }
  MT_TRACE_COST(2.0 * double(M) * double(N) * double(K),
                2.0 * double(M * K + K * N) + 4.0 * double(M * N * (beta != 0 ? 2 : 1)));
  auto& eng = cpu_engine();
  dnnl::memory ma(mm.a, eng, const_cast<bf16*>(A));
  dnnl::memory mb(mm.b, eng, const_cast<bf16*>(B));
  dnnl::memory mc(mm.c, eng, C);
  dnnl::stream s(eng);
  mm.prim.execute(s, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  s.wait();
}

void f32_to_bf16_avx512(bf16* out, const float* in, int64_t n);  // convert_avx512.cpp
void bf16_to_f32_avx512(float* out, const bf16* in, int64_t n);

void f32_to_bf16_serial(bf16* out, const float* in, int64_t n) {
  if (active_isa() == Isa::Avx512) return f32_to_bf16_avx512(out, in, n);
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(in[i]);
}

void bf16_to_f32_serial(float* out, const bf16* in, int64_t n) {
  if (active_isa() == Isa::Avx512) return bf16_to_f32_avx512(out, in, n);
  for (int64_t i = 0; i < n; ++i) out[i] = from_bf16(in[i]);
}

namespace {
constexpr int64_t kConvertChunk = 1 << 16;  // elements per work item: fixed, so results never depend on threads
template <class F>
void chunked(int64_t n, F&& f) {
  if (n <= kConvertChunk) return f(int64_t(0), n);
  const int64_t chunks = (n + kConvertChunk - 1) / kConvertChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) f(c * kConvertChunk, std::min(n, (c + 1) * kConvertChunk) - c * kConvertChunk);
}
}  // namespace

void f32_to_bf16(bf16* out, const float* in, int64_t n) {
  chunked(n, [&](int64_t o, int64_t m) { f32_to_bf16_serial(out + o, in + o, m); });
}

void bf16_to_f32(float* out, const bf16* in, int64_t n) {
  chunked(n, [&](int64_t o, int64_t m) { bf16_to_f32_serial(out + o, in + o, m); });
}

void zero_bytes(void* p, size_t bytes) {
  char* c = static_cast<char*>(p);
  chunked(int64_t(bytes / 4), [&](int64_t o, int64_t m) { std::memset(c + 4 * o, 0, size_t(m) * 4); });
  if (bytes % 4) std::memset(c + bytes / 4 * 4, 0, bytes % 4);
}

}  // namespace moetron
