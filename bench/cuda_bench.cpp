// cuda_bench.cpp: the CUDA backend's micro-benchmark for scripts/gpu_check.sh: the measured ceilings (cuBLAS bf16
// GEMM rate on random data, device-to-device copy bandwidth counting bytes read plus written), our grouped GEMM
// against dense cuBLAS at equal FLOPs (and cuBLAS's own grouped GEMM where the CUDA version has it), and the
// memory-bound kernels' bandwidth. Device events around each region, warm-up first, median of the repeats.
// Prints one "BENCH <name> <value> <unit> <extra>" line per figure. Not a correctness test (op_harness is).
// Links moetron_cuda only (no oneDNN): it builds in a GPU-only build.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "moetron/cuda/gemm.h"
#include "moetron/cuda/memory.h"
#include "moetron/cuda/ops.h"
#include "moetron/cuda/runtime.h"
#include "moetron/dtype.h"

using namespace moetron;
namespace cu = moetron::cuda;

static double median_ms(const std::function<void()>& f, int warm = 3, int reps = 15) {
  for (int i = 0; i < warm; ++i) f();
  cu::EventTimer t;
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    t.start(nullptr);
    f();
    t.stop(nullptr);
    ms.push_back(t.elapsed_ms());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
static cu::DeviceBuffer random_bf16(int64_t n, uint32_t seed) {
  std::vector<bf16> h(static_cast<size_t>(n));
  uint32_t s = seed * 2654435761u + 1;
  for (auto& v : h) {
    s = s * 1664525u + 1013904223u;
    v = to_bf16(float(int32_t(s >> 8) - (1 << 23)) / float(1 << 23));  // uniform in [-1, 1): never zeros
  }
  cu::DeviceBuffer d(size_t(n) * 2, MemCategory::Workspace);
  d.upload(h.data(), h.size() * 2);
  return d;
}
static void line(const char* name, double v, const char* unit, const std::string& extra = {}) {
  std::printf("BENCH %-34s %10.1f %-8s %s\n", name, v, unit, extra.c_str());
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  std::string why;
  if (cu::device_count(&why) == 0) {
    std::printf("cuda_bench: %s\n", why.c_str());
    return 4;
  }
  cu::select_device(0);
  std::printf("cuda_bench %s\n", cu::describe(cu::device_info(0)).c_str());
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  // 1. cuBLAS bf16 GEMM (fp32 accumulation and output), square, two input sets alternating.
  double peak_tflops = 0;
  for (int64_t n : quick ? std::vector<int64_t>{2048} : std::vector<int64_t>{4096, 8192}) {
    auto a0 = random_bf16(n * n, 1), b0 = random_bf16(n * n, 2), a1 = random_bf16(n * n, 3), b1 = random_bf16(n * n, 4);
    cu::DeviceBuffer c(size_t(n * n) * 4, MemCategory::Workspace);
    int k = 0;
    const double ms = median_ms([&] {
      const bool odd = (k++ & 1) != 0;
      cu::gemm_bf16(cu::Op::N, cu::Op::N, n, n, n, 1.0f, (odd ? a1 : a0).as<bf16>(), n, (odd ? b1 : b0).as<bf16>(), n,
                    0.0f, c.as<float>(), n, nullptr);
    });
    const double tf = 2.0 * n * n * n / (ms * 1e-3) / 1e12;
    peak_tflops = std::max(peak_tflops, tf);
    line(("gemm_bf16_cublas_" + std::to_string(n)).c_str(), tf, "TFLOP/s", std::to_string(ms) + " ms");
  }
  // 2. Grouped GEMM at DeepSeek-V2-Lite expert shapes (d 2048 -> moe_inter 1408), 64 experts, equal counts, against
  //    one dense cuBLAS GEMM of the same FLOPs ([M, K] x [K, N]).
  {
    const int64_t E = 64, me = quick ? 128 : 512, M = E * me, K = 2048, N = 1408;
    auto X = random_bf16(M * K, 5), W = random_bf16(E * K * N, 6), Wd = random_bf16(K * N, 7);
    cu::DeviceBuffer Y(size_t(M * N) * 4, MemCategory::Workspace), ws(cu::grouped_gemm_workspace_bytes(E), MemCategory::Workspace);
    std::vector<int32_t> counts(static_cast<size_t>(E), static_cast<int32_t>(me));
    cu::DeviceBuffer dc(counts.size() * 4, MemCategory::Workspace);
    dc.upload(counts.data(), counts.size() * 4);
    const double flops = 2.0 * M * K * N;
    const double dense = median_ms([&] {
      cu::gemm_bf16(cu::Op::N, cu::Op::N, M, N, K, 1.0f, X.as<bf16>(), K, Wd.as<bf16>(), N, 0.0f, Y.as<float>(), N, nullptr);
    });
    const double grouped = median_ms([&] {
      cu::grouped_gemm_fwd(Y.as<float>(), X.as<bf16>(), W.as<bf16>(), dc.as<int32_t>(), E, M, K, N, ws.data(), nullptr);
    });
    line("dense_equal_flops_cublas", flops / (dense * 1e-3) / 1e12, "TFLOP/s", std::to_string(dense) + " ms");
    line("grouped_gemm_fwd_own", flops / (grouped * 1e-3) / 1e12, "TFLOP/s",
         std::to_string(grouped) + " ms, " + std::to_string(100.0 * dense / grouped) + " % of dense");
    if (cu::grouped_gemm_cublas_available()) {
      try {
        const double cg = median_ms([&] {
          cu::grouped_gemm_fwd_cublas(Y.as<float>(), X.as<bf16>(), W.as<bf16>(), counts.data(), E, M, K, N, nullptr);
        });
        line("grouped_gemm_fwd_cublas_hostcounts", flops / (cg * 1e-3) / 1e12, "TFLOP/s",
             std::to_string(cg) + " ms (host counts, pointer upload included)");
      } catch (const std::exception& e) {
        std::printf("BENCH grouped_gemm_fwd_cublas_hostcounts n/a: %s\n", e.what());
      }
    }
  }
  // 3. Device-to-device copy: bytes read + written.
  {
    const size_t bytes = size_t(quick ? 256 : 2048) << 20;
    cu::DeviceBuffer a(bytes, MemCategory::Workspace), b(bytes, MemCategory::Workspace);
    a.zero();
    const double ms = median_ms([&] { cu::copy_d2d(b.data(), a.data(), bytes, nullptr); });
    line("copy_d2d", 2.0 * double(bytes) / (ms * 1e-3) / 1e9, "GB/s", std::to_string(ms) + " ms");
  }
  // 4. Memory-bound kernels: RMSNorm forward (read x, write y), AdamW (read p m v g, write p m v).
  {
    const int64_t N = 16384, C = 2048;
    auto x = random_bf16(N * C * 2, 8);  // reused as fp32 data: finite values
    cu::DeviceBuffer w(size_t(C) * 4, MemCategory::Workspace), y(size_t(N * C) * 4, MemCategory::Workspace),
        rs(size_t(N) * 4, MemCategory::Workspace);
    std::vector<float> ones(size_t(C), 1.0f);
    w.upload(ones.data(), ones.size() * 4);
    std::vector<float> hx(size_t(N * C));
    for (size_t i = 0; i < hx.size(); ++i) hx[i] = float(int(i % 1000) - 500) / 250.0f;
    cu::DeviceBuffer xf(hx.size() * 4, MemCategory::Workspace);
    xf.upload(hx.data(), hx.size() * 4);
    const double ms = median_ms([&] {
      cu::rmsnorm_forward(y.as<float>(), nullptr, rs.as<float>(), xf.as<float>(), w.as<float>(), N, C, 1e-6f, nullptr);
    });
    line("rmsnorm_fwd_16384x2048", 2.0 * N * C * 4 / (ms * 1e-3) / 1e9, "GB/s", std::to_string(ms) + " ms");
    const int64_t n = int64_t(quick ? 16 : 256) << 20;
    cu::DeviceBuffer p(size_t(n) * 4, MemCategory::Params), m(size_t(n) * 4, MemCategory::Optimizer),
        v(size_t(n) * 4, MemCategory::Optimizer), g(size_t(n) * 4, MemCategory::Grads);
    p.zero(), m.zero(), v.zero(), g.zero();
    AdamWScalars s{0.9f, 0.1f, 0.95f, 0.05f, 0.9999f, 1e-3f, 1.0f, 1e-8f};
    const double ma = median_ms([&] { cu::adamw_step(p.as<float>(), m.as<float>(), v.as<float>(), g.as<float>(), n, s, 1.0f, true, nullptr); });
    line("adamw_step_256M", 7.0 * n * 4 / (ma * 1e-3) / 1e9, "GB/s", std::to_string(ma) + " ms");
  }
  std::printf("BENCH peak_gemm_bf16_measured %10.1f TFLOP/s\n", peak_tflops);
  return 0;
}
