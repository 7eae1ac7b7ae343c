// cmd_plan_calibrate.cpp: `moetron plan calibrate [--out FILE]`: measures this machine into a planner hardware
// TOML (docs/hardware.md): GEMM rates by size in the compute dtype, the grouped-GEMM rate by tokens per expert is
// read through the same size curve, attention's rate, streaming memory bandwidth, and, under mpirun, the MPI
// alpha-beta of point-to-point messages (all-reduce and all-to-all are timed too and printed against the model).
// Every rank measures at once, so an oversubscribed launch measures each rank's share of the cores. The command
// line links the engine's kernels; the planner library does not. Not a benchmark suite (bench/).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli.h"
#include "plan_cmds.h"
#include "moetron/attention.h"
#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/gemm.h"
#include "moetron/grouped_gemm.h"
#include "moetron/model.h"
#include "moetron/plan/comm_model.h"
#include "moetron/plan/hardware.h"
#include "moetron/runtime.h"

namespace {
using namespace moetron;
using clk = std::chrono::steady_clock;

double secs(clk::time_point a) { return std::chrono::duration<double>(clk::now() - a).count(); }

// Seconds per call of f() as every rank sustains it: one warm-up call, then `reps` calls back to back on every
// rank at once, timed from a common start to the LAST rank's end. When ranks share cores this is each rank's
// real share (a per-call best or median would count the moments a rank happened to run alone).
template <class F>
double best_of(const Comm& w, int reps, F&& f) {
  f();
  w.barrier();
  const auto t0 = clk::now();
  for (int r = 0; r < reps; ++r) f();
  return moetron::cli::max_over_ranks(w, secs(t0)) / reps;
}

// FLOP/s of an m x n x k GEMM in the compute dtype.
double gemm_rate(const Comm& w, ComputeDtype dt, int64_t m, int64_t n, int64_t k, int reps) {
  std::vector<float> a(size_t(m * k), 0.5f), b(size_t(k * n), 0.25f), c(size_t(m * n));
  std::vector<bf16> ab, bb;
  if (dt == ComputeDtype::BF16) {
    ab.resize(a.size()), bb.resize(b.size());
    f32_to_bf16(ab.data(), a.data(), int64_t(a.size()));
    f32_to_bf16(bb.data(), b.data(), int64_t(b.size()));
  }
  const double t = best_of(w, reps, [&] {
    if (dt == ComputeDtype::BF16)
      gemm_bf16(Trans::N, Trans::N, m, n, k, 1.f, ab.data(), k, bb.data(), n, 0.f, c.data(), n);
    else
      gemm_f32(Trans::N, Trans::N, m, n, k, 1.f, a.data(), k, b.data(), n, 0.f, c.data(), n);
  });
  return 2.0 * double(m) * double(n) * double(k) / t;
}

}  // namespace

namespace moetron::cli {
plan::Hardware calibrate_machine(const Comm& w, bool quick, std::string* check_out) {
    const ComputeDtype dt = resolve_compute_dtype(ComputeDtype::Auto);
    const int reps = quick ? 2 : 5;
    plan::Hardware h;
    h.name = "this_machine";
    char cpu[256] = "";
    {
      std::ifstream f("/proc/cpuinfo");
      std::string line;
      while (std::getline(f, line))
        if (line.rfind("model name", 0) == 0) {
          std::snprintf(cpu, sizeof cpu, "%s", line.substr(line.find(':') + 2).c_str());
          break;
        }
    }
    const std::string when = "measured by `moetron plan calibrate` on " + std::string(cpu) + ", " +
                             std::to_string(w.size()) + " rank(s) at once, " + std::to_string(num_threads()) +
                             " thread(s) each";
    h.description = "this machine (" + std::string(cpu) + "), one rank's share: " +
                    std::string(dt == ComputeDtype::BF16 ? "bf16" : "fp32") + " compute";
    // Memory: this rank's share of the node's RAM.
    {
      std::ifstream f("/proc/meminfo");
      std::string k;
      double kb = 0;
      f >> k >> kb;
      int local = w.size();
      if (const char* e = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"); e && std::atoi(e) > 0) local = std::atoi(e);
      h.hbm_bytes = kb * 1024.0 / local;
    }
    // GEMM: the largest size is the achievable rate; the curve over the smallest dimension.
    const int64_t big = quick ? 512 : 1024;
    const double top = gemm_rate(w, dt, big, big, big, reps);
    h.peak_bf16 = h.achievable_bf16 = top;
    h.peak_fp8 = h.achievable_fp8 = 0;
    // The curve over the smallest dimension from skinny GEMMs (m rows against a big / 2 square weight): the
    // shape of the routed experts' GEMMs, whose row count is the tokens each expert gets.
    for (int64_t m : {int64_t(8), int64_t(16), int64_t(32), int64_t(64), int64_t(128), int64_t(256), big / 2}) {
      if (m > big / 2 || (m == 256 && big / 2 == 256)) continue;  // ascending, no repeats (--quick: big = 512)
      const double r = gemm_rate(w, dt, m, big / 2, big / 2, m < 128 ? reps * 8 : reps);
      h.gemm_efficiency.push_back({double(m), std::min(1.0, r / top)});
    }
    h.gemm_efficiency.push_back({double(big), 1.0});
    // Grouped GEMMs (the routed experts): forward + dgrad + wgrad of 8 experts with d = 512 in, 384 out, by
    // tokens per expert, against the achievable rate.
    {
      const int64_t El = 8, K = 512, N = 384;
      const GemmPrec prec = dt == ComputeDtype::BF16 ? GemmPrec::BF16 : GemmPrec::F32;
      std::vector<float> W(static_cast<size_t>(El * K * N), 0.01f), dW(W.size());
      std::vector<char> pf(grouped_packed_bytes(GroupedPackKind::Fwd, prec, El, K, N) + 64),
          pd(grouped_packed_bytes(GroupedPackKind::Dgrad, prec, El, K, N) + 64);
      auto align = [](std::vector<char>& v) { return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63)); };
      const GroupedPackedWeights wf = grouped_pack_weights(align(pf), W.data(), El, K, N, prec, GroupedPackKind::Fwd);
      const GroupedPackedWeights wd = grouped_pack_weights(align(pd), W.data(), El, K, N, prec, GroupedPackKind::Dgrad);
      for (int64_t te : {int64_t(4), int64_t(16), int64_t(64), int64_t(256)}) {
        const int64_t M = te * El;
        std::vector<int32_t> counts(static_cast<size_t>(El), int32_t(te));
        std::vector<float> X(static_cast<size_t>(M * K), 0.1f), Y(static_cast<size_t>(M * N)), dX(X.size()), dY(Y.size(), 0.1f);
        std::vector<bf16> Xb(X.size()), dYb(Y.size());
        f32_to_bf16(Xb.data(), X.data(), int64_t(X.size()));
        f32_to_bf16(dYb.data(), dY.data(), int64_t(dY.size()));
        size_t wsb = 0;
        for (GroupedOp op : {GroupedOp::Fwd, GroupedOp::Dgrad, GroupedOp::Wgrad})
          wsb = std::max(wsb, grouped_gemm_workspace_bytes(op, prec, El, M, K, N));
        std::vector<char> wsv(wsb + 64);
        void* ws = align(wsv);
        const double t = best_of(w, te < 64 ? reps * 8 : reps, [&] {
          if (prec == GemmPrec::BF16) {
            grouped_gemm_fwd(Y.data(), nullptr, Xb.data(), wf, counts.data(), El, M, K, N, ws, wsb);
            grouped_gemm_dgrad(dX.data(), nullptr, dYb.data(), wd, counts.data(), El, M, K, N, ws, wsb);
            grouped_gemm_wgrad(dW.data(), Xb.data(), dYb.data(), counts.data(), El, M, K, N, false, ws, wsb);
          } else {
            grouped_gemm_fwd(Y.data(), X.data(), wf, counts.data(), El, M, K, N, ws, wsb);
            grouped_gemm_dgrad(dX.data(), dY.data(), wd, counts.data(), El, M, K, N, ws, wsb);
            grouped_gemm_wgrad(dW.data(), X.data(), dY.data(), counts.data(), El, M, K, N, false, ws, wsb);
          }
        });
        const double rate = 3 * 2.0 * double(M) * double(K) * double(N) / t;
        h.grouped_gemm_efficiency.push_back({double(te), std::clamp(rate / top, 0.001, 1.0)});
      }
    }
    // The smallest GEMM's time: the floor under every op.
    {
      std::vector<float> a(64), b(64), c(64);
      h.kernel_overhead = best_of(w, reps * 4, [&] {
        gemm_f32(Trans::N, Trans::N, 8, 8, 8, 1.f, a.data(), 8, b.data(), 8, 0.f, c.data(), 8);
      });
    }
    // Attention: causal, forward + backward, against the GEMM rate.
    {
      const int64_t B = 1, T = quick ? 256 : 512, H = 8, D = 64;
      AttnDims d{B, T, H, H, D, D, H * D, H * D, H * D, H * D, D, D, D, D, 0.125f};
      std::vector<float> q(size_t(B * T * H * D), 0.1f), k = q, v = q, o = q, dq = q, dk = q, dv = q, dout = q;
      std::vector<float> lse(size_t(B * H * T));
      const double t = best_of(w, reps, [&] {
        attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), d);
        attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), o.data(), lse.data(), q.data(), k.data(),
                           v.data(), d);
      });
      const double rate = (attention_forward_flops(d) + attention_backward_flops(d)) / t;
      h.attention_efficiency = std::clamp(rate / top, 0.01, 1.0);
    }
    // Streaming bandwidth: a copy of 64 MiB (read + write).
    {
      const size_t n = (quick ? 16u : 64u) << 20;
      std::vector<char> src(n, 1), dst(n);
      const double t = best_of(w, reps, [&] { std::memcpy(dst.data(), src.data(), n); });
      h.hbm_bw = 2.0 * double(n) / t;
      h.hbm_efficiency = 1.0;
    }
    // MPI: ping-pong between ranks 0 and 1 (8 B for alpha, 8 MiB for the bandwidth).
    h.scale_up.domain = w.size();
    h.scale_up.topology = "switch";
    if (w.size() >= 2) {
      auto pingpong = [&](int64_t bytes) {
        std::vector<char> buf(static_cast<size_t>(bytes));
        return best_of(w, reps * 2, [&] {
          if (w.rank() == 0) w.send(buf.data(), bytes, 1), w.recv(buf.data(), bytes, 1);
          else if (w.rank() == 1) w.recv(buf.data(), bytes, 0), w.send(buf.data(), bytes, 0);
        });
      };
      const double small = pingpong(8) / 2, large = pingpong(8 << 20) / 2;
      h.scale_up.alpha = small;
      h.scale_up.bw = double(8 << 20) / std::max(large - small, 1e-9);
    } else {
      h.scale_up.alpha = 1e-6;
      h.scale_up.bw = h.hbm_bw / 2;
    }
    h.scale_out = h.scale_up;
    h.scale_out.domain = 1 << 20;
    for (const char* k : {"hbm_gb", "hbm_bw_gbps", "hbm_efficiency", "peak_bf16_tflops", "achievable_bf16_tflops",
                          "kernel_overhead_us", "attention_efficiency", "gemm_efficiency", "grouped_gemm_efficiency",
                          "scale_up.domain",
                          "scale_up.bw_gbps", "scale_up.alpha_us", "scale_up.topology"})
      h.sources[k] = when;
    h.sources["hbm_gb"] = "MemTotal of /proc/meminfo over the ranks on this node";
    h.sources["peak_bf16_tflops"] = when + "; a CPU has no datasheet figure here: the best measured rate, in the "
                                            "compute dtype (the bf16 keys hold fp32 rates on an fp32 machine)";
    if (w.size() < 2) h.sources["scale_up.bw_gbps"] = "one rank: no message measured (half the copy bandwidth)";
    if (w.size() < 2) h.sources["scale_up.alpha_us"] = "one rank: no message measured (assumption: 1 us)";
    for (const char* k : {"scale_out.domain", "scale_out.bw_gbps", "scale_out.alpha_us", "scale_out.topology"})
      h.sources[k] = "one node: the scale-up figures";
    // Collectives measured against the model (printed, a check of the alpha-beta fit).
    std::string check;
    if (w.size() >= 2) {
      const int64_t n = 1 << 20;  // floats: 4 MiB
      std::vector<float> x(static_cast<size_t>(n), 1.f);
      const double ar = best_of(w, reps, [&] { w.all_reduce(x.data(), n); });
      std::vector<char> s(static_cast<size_t>(4 * n)), r(static_cast<size_t>(4 * n));
      const double a2a = best_of(w, reps, [&] { w.all_to_all(r.data(), s.data(), 4 * n / w.size()); });
      const plan::Group g{w.size(), w.size()};
      // The collective bandwidth: what the ring all-reduce formula needs to give the measured time (the
      // point-to-point figure above stays the alpha; the fitted bandwidth covers the reduction arithmetic and the
      // sharing of cores that a ping-pong between two ranks does not see).
      const double p = double(w.size());
      const double ring_bytes = 2 * (p - 1) / p * 4.0 * double(n), lat = 2 * (p - 1) * h.scale_up.alpha;
      const double p2p_bw = h.scale_up.bw;
      if (ar > lat) h.scale_up.bw = std::min(p2p_bw, ring_bytes / (ar - lat));
      h.scale_out.bw = h.scale_up.bw;
      h.sources["scale_up.bw_gbps"] = when + "; fitted to a 4 MiB all-reduce with the ring formula";
      char buf[600];
      std::snprintf(buf, sizeof buf,
                    "# point-to-point %.2f GB/s (8 MiB ping-pong), alpha %.2f us (8 B); bw_gbps fitted to the all-reduce: "
                    "%.2f GB/s\n# check: all-reduce 4 MiB measured %.3f ms, model %.3f ms; all-to-all 4 MiB measured "
                    "%.3f ms, model %.3f ms\n",
                    p2p_bw / 1e9, h.scale_up.alpha * 1e6, h.scale_up.bw / 1e9, 1e3 * ar,
                    1e3 * plan::all_reduce(h, 4.0 * n, g), 1e3 * a2a, 1e3 * plan::all_to_all(h, 4.0 * n, g));
      check = buf;
    }
  plan::validate_hardware(h, "calibrate");
  if (check_out) *check_out = "# " + when + "\n" + check;
  return h;
}

void add_plan_calibrate(CLI::App* plan) {
  auto* cal = plan->add_subcommand("calibrate", "Measure this machine into a planner hardware TOML (run under mpirun "
                                                "for the MPI alpha-beta)");
  auto out = std::make_shared<std::string>();
  auto quick = std::make_shared<bool>(false);
  cal->add_option("--out", *out, "write the TOML here (default: print it)");
  cal->add_flag("--quick", *quick, "fewer repetitions and sizes (for tests)");
  cal->callback([out, quick] {
    const Comm w = comm_world();
    std::string header;
    const plan::Hardware h = calibrate_machine(w, *quick, &header);
    if (w.rank() != 0) return;
    const std::string toml = header + plan::hardware_to_toml(h);
    if (out->empty()) {
      std::printf("%s", toml.c_str());
    } else {
      std::ofstream f(*out);
      MT_CHECK(f.good(), "plan calibrate", "cannot write ", *out);
      f << toml;
      std::printf("wrote %s\n%s", out->c_str(), header.c_str());
    }
  });
}
}  // namespace moetron::cli
