// cmd_plan_calibrate.cpp: `moetron plan calibrate [--out FILE]`: measures this machine into a planner hardware
// TOML (docs/hardware.md): GEMM rates by size in the compute dtype, the experts' grouped GEMM forward and backward
// by tokens per expert, attention's rate, the fused head + loss, the memory-bound layer kernels (norm, SwiGLU,
// permute, router) at activation sizes, AdamW and the experts' re-packing per parameter, streaming memory
// bandwidth, and, under mpirun, the MPI alpha-beta of point-to-point messages (all-reduce and all-to-all are timed
// too and printed against the model). Each op is the engine's own kernel measured in isolation. Every rank
// measures at once, so an oversubscribed launch measures each rank's share of the cores. The command line links
// the engine's kernels; the planner library does not. Not a benchmark suite (bench/).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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
#include "moetron/loss.h"
#include "moetron/model.h"
#include "moetron/norm.h"
#include "moetron/optim.h"
#include "moetron/permute.h"
#include "moetron/router.h"
#include "moetron/swiglu.h"
#include "moetron/plan/comm_model.h"
#include "moetron/plan/hardware.h"
#include "moetron/runtime.h"

namespace {
using namespace moetron;
using clk = std::chrono::steady_clock;

double secs(clk::time_point a) { return std::chrono::duration<double>(clk::now() - a).count(); }

// Seconds per call of f() as every rank sustains it when it has its cores: one warm-up call, then at least `reps`
// calls back to back on every rank at once, timed from a common start to the LAST rank's end (ranks of this job
// sharing cores count: that is their real share), times the smallest share of its cores a rank received meanwhile
// (other processes on the machine do not count: the figure is the machine's, not the moment's load; see CpuShare).
// The share is only meaningful over many scheduler time slices (a few ms each): the calls repeat until the window
// lasts g_min_window, the count agreed over ranks from a timed pilot call (collectives need the same count everywhere).
double g_min_window = 0.25;  // seconds; --quick: 0.1 (set by calibrate_machine)
template <class F>
double best_of(const Comm& w, int reps, F&& f) {
  f();
  w.barrier();
  auto t0 = clk::now();
  f();
  const double pilot = moetron::cli::max_over_ranks(w, secs(t0));
  const int n = int(std::clamp(std::ceil(g_min_window / std::max(pilot, 1e-7)), double(reps), 100.0 * reps));
  w.barrier();
  const moetron::cli::CpuShare share(moetron::num_threads());
  t0 = clk::now();
  for (int r = 0; r < n; ++r) f();
  const double wall = moetron::cli::max_over_ranks(w, secs(t0));
  return wall * std::min(1.0, moetron::cli::min_over_ranks(w, share.share())) / n;
}

// FLOP/s of an m x n x k GEMM in the compute dtype. `cold`: each call reads the next of enough weight (B) copies to
// span twice the last-level cache (64 MiB), as the engine's layers do: between two uses of a weight the other layers'
// and experts' weights pass through the caches, while the input (A) was just written by the kernel before.
double gemm_rate(const Comm& w, ComputeDtype dt, int64_t m, int64_t n, int64_t k, int reps, bool cold = false) {
  const bool b16 = dt == ComputeDtype::BF16;
  const size_t nb = size_t(k * n), wbytes = nb * (b16 ? 2 : 4);
  const size_t copies = cold ? std::max<size_t>(1, (size_t(64) << 20) / wbytes) : 1;
  std::vector<float> a(size_t(m * k), 0.5f), b(cold && !b16 ? nb * copies : nb, 0.25f), c(size_t(m * n));
  std::vector<bf16> ab, bb;
  if (b16) {
    ab.resize(a.size()), bb.resize(nb * copies);
    f32_to_bf16(ab.data(), a.data(), int64_t(a.size()));
    for (size_t i = 0; i < copies; ++i) f32_to_bf16(bb.data() + i * nb, b.data(), int64_t(nb));
  }
  size_t next = 0;
  const double t = best_of(w, reps, [&] {
    const size_t off = nb * (next++ % copies);
    if (b16)
      gemm_bf16(Trans::N, Trans::N, m, n, k, 1.f, ab.data(), k, bb.data() + off, n, 0.f, c.data(), n);
    else
      gemm_f32(Trans::N, Trans::N, m, n, k, 1.f, a.data(), k, b.data() + off, n, 0.f, c.data(), n);
  });
  return 2.0 * double(m) * double(n) * double(k) / t;
}

// 64-byte aligned scratch (the grouped GEMMs' packed weights and workspaces need it).
struct Aligned {
  std::vector<char> v;
  explicit Aligned(size_t bytes) : v(bytes + 64) {}
  void* get() { return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63)); }
};

// The routed experts' grouped GEMMs as the engine runs them (model_moe.cpp experts_forward / experts_backward):
// gate_up d -> 2F and down F -> d over El experts with te tokens each. Seconds of the forward (both GEMMs) and of
// the backward (dgrad + wgrad of both), each sustained on every rank at once.
struct GroupedTimes {
  double fwd = 0, bwd = 0, flops_fwd = 0;
};
GroupedTimes grouped_times(const Comm& w, GemmPrec prec, int64_t El, int64_t d, int64_t F, int64_t te, int reps) {
  const int64_t M = te * El;
  struct Mat {
    int64_t K = 0, N = 0;
    std::vector<float> W, dW, X, Y, dX, dY;
    std::vector<bf16> Xb, dYb;
    std::unique_ptr<Aligned> pf, pd;
    GroupedPackedWeights wf, wd;
  };
  Mat mats[2];
  mats[0].K = d, mats[0].N = 2 * F, mats[1].K = F, mats[1].N = d;
  size_t wsb = 0;
  for (Mat& x : mats) {
    x.W.assign(static_cast<size_t>(El * x.K * x.N), 0.01f), x.dW.resize(x.W.size());
    x.X.assign(static_cast<size_t>(M * x.K), 0.1f), x.dX.resize(x.X.size());
    x.Y.resize(static_cast<size_t>(M * x.N)), x.dY.assign(x.Y.size(), 0.1f);
    x.Xb.resize(x.X.size()), x.dYb.resize(x.dY.size());
    f32_to_bf16(x.Xb.data(), x.X.data(), int64_t(x.X.size()));
    f32_to_bf16(x.dYb.data(), x.dY.data(), int64_t(x.dY.size()));
    x.pf = std::make_unique<Aligned>(grouped_packed_bytes(GroupedPackKind::Fwd, prec, El, x.K, x.N));
    x.pd = std::make_unique<Aligned>(grouped_packed_bytes(GroupedPackKind::Dgrad, prec, El, x.K, x.N));
    x.wf = grouped_pack_weights(x.pf->get(), x.W.data(), El, x.K, x.N, prec, GroupedPackKind::Fwd);
    x.wd = grouped_pack_weights(x.pd->get(), x.W.data(), El, x.K, x.N, prec, GroupedPackKind::Dgrad);
    for (GroupedOp op : {GroupedOp::Fwd, GroupedOp::Dgrad, GroupedOp::Wgrad})
      wsb = std::max(wsb, grouped_gemm_workspace_bytes(op, prec, El, M, x.K, x.N));
  }
  Aligned wsv(wsb);
  void* ws = wsv.get();
  std::vector<int32_t> counts(static_cast<size_t>(El), int32_t(te));
  const bool b16 = prec == GemmPrec::BF16;
  GroupedTimes g;
  g.fwd = best_of(w, reps, [&] {
    for (Mat& x : mats) {
      if (b16) grouped_gemm_fwd(x.Y.data(), nullptr, x.Xb.data(), x.wf, counts.data(), El, M, x.K, x.N, ws, wsb);
      else grouped_gemm_fwd(x.Y.data(), x.X.data(), x.wf, counts.data(), El, M, x.K, x.N, ws, wsb);
    }
  });
  g.bwd = best_of(w, reps, [&] {
    for (Mat& x : mats) {
      if (b16) {
        grouped_gemm_wgrad(x.dW.data(), x.Xb.data(), x.dYb.data(), counts.data(), El, M, x.K, x.N, true, ws, wsb);
        grouped_gemm_dgrad(x.dX.data(), nullptr, x.dYb.data(), x.wd, counts.data(), El, M, x.K, x.N, ws, wsb);
      } else {
        grouped_gemm_wgrad(x.dW.data(), x.X.data(), x.dY.data(), counts.data(), El, M, x.K, x.N, true, ws, wsb);
        grouped_gemm_dgrad(x.dX.data(), x.dY.data(), x.wd, counts.data(), El, M, x.K, x.N, ws, wsb);
      }
    }
  });
  for (const Mat& x : mats) g.flops_fwd += 2.0 * double(M) * double(x.K) * double(x.N);
  return g;
}

}  // namespace

namespace moetron::cli {
namespace {
// One pass over every figure (each in its own window of g_min_window or more).
plan::Hardware calibrate_round(const Comm& w, bool quick, std::string* check_out) {
    const ComputeDtype dt = resolve_compute_dtype(ComputeDtype::Auto);
    const int reps = quick ? 2 : 5;
    g_min_window = quick ? 0.1 : 0.25;
    // The engine's thread count (train_session.cpp): the cores over the ranks sharing this machine, unless
    // OMP_NUM_THREADS says otherwise (training.threads = 0). Measuring with more threads than the engine runs would
    // price an oversubscription the engine does not have.
    {
      int local = w.size();
      if (const char* e = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"); e && std::atoi(e) > 0) local = std::atoi(e);
      init_threads(0, local);
    }
    const CpuShare cpu_share(num_threads());
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
    // The reference GEMM (the big cube), measured before each family of figures; the achievable rate is the best of
    // its median and the skinny GEMMs below (every measurement is already scaled to a full share of the cores:
    // best_of).
    std::vector<double> refs;
    auto ref = [&] {
      refs.push_back(gemm_rate(w, dt, big, big, big, reps));
      return refs.back();
    };
    ref();
    double r_ref = refs.front();
    h.peak_fp8 = h.achievable_fp8 = 0;
    // The curve over the smallest dimension from skinny GEMMs (m rows against a big / 2 square weight): the
    // shape of the routed experts' GEMMs, whose row count is the tokens each expert gets; the weight read cold, as
    // in training (gemm_rate).
    for (int64_t m : {int64_t(8), int64_t(16), int64_t(32), int64_t(64), int64_t(128), int64_t(256), big / 2}) {
      if (m > big / 2 || (m == 256 && big / 2 == 256)) continue;  // ascending, no repeats (--quick: big = 512)
      const double r = gemm_rate(w, dt, m, big / 2, big / 2, m < 128 ? reps * 8 : reps, /*cold=*/true);
      h.gemm_efficiency.push_back({double(m), r / r_ref});
    }
    h.gemm_efficiency.push_back({double(big), 1.0});
    // The same 256-row GEMM with its weight hot in the caches, printed beside the cold figure the curve keeps: how much
    // a weight-resident benchmark would overstate the engine's dense GEMMs on this machine.
    char gemm_check[200];
    {
      const int64_t m = std::min<int64_t>(256, big / 2);
      const double cold = gemm_rate(w, dt, m, big / 2, big / 2, reps, true), hot = gemm_rate(w, dt, m, big / 2, big / 2, reps);
      std::snprintf(gemm_check, sizeof gemm_check, "# dense GEMM %lld x %lld x %lld: weight read cold %.1f GFLOPS (the "
                    "curve's convention), hot in the caches %.1f\n", (long long)m, (long long)big / 2,
                    (long long)big / 2, cold / 1e9, hot / 1e9);
    }
    ref();
    // Grouped GEMMs (the routed experts), forward and backward apart, by tokens per expert: a d = 512, F = 192
    // SwiGLU pair, against the achievable rate, at 4, 8, 16, 32, 64 and 256 tokens per expert (the curve is steep
    // below 64). 64 experts (their weights, 75 MB in fp32, do not stay in a cache between passes, as a layer's
    // experts do not in training) up to 64 tokens each; 16 at 256 tokens, where the GEMMs are compute-bound.
    {
      const GemmPrec prec = dt == ComputeDtype::BF16 ? GemmPrec::BF16 : GemmPrec::F32;
      for (int64_t te : {int64_t(4), int64_t(8), int64_t(16), int64_t(32), int64_t(64), int64_t(256)}) {
        if (quick && (te == 256 || te == 8)) continue;
        const GroupedTimes g = grouped_times(w, prec, te <= 64 ? 64 : 16, 512, 192, te, te < 64 ? reps * 2 : reps);
        h.grouped_fwd_efficiency.push_back({double(te), g.flops_fwd / g.fwd / r_ref});
        h.grouped_bwd_efficiency.push_back({double(te), 2 * g.flops_fwd / g.bwd / r_ref});
      }
    }
    // The smallest GEMM's time: the floor under every op.
    {
      std::vector<float> a(64), b(64), c(64);
      h.kernel_overhead = best_of(w, reps * 4, [&] {
        gemm_f32(Trans::N, Trans::N, 8, 8, 8, 1.f, a.data(), 8, b.data(), 8, 0.f, c.data(), 8);
      });
    }
    // Attention: causal, forward + backward, 8 heads of 64 over 512 tokens per call, by sequence length, against the
    // GEMM rate. The rate is the cost model's: three times the forward's FLOPs (backward priced at twice the
    // forward) over the time of both. The longest sequence gives the scalar attention_efficiency.
    ref();
    for (int64_t T : {int64_t(128), quick ? int64_t(256) : int64_t(512)}) {
      const int64_t B = std::max<int64_t>(1, 512 / T), H = 8, D = 64;
      AttnDims d{B, T, H, H, D, D, H * D, H * D, H * D, H * D, D, D, D, D, 0.125f};
      std::vector<float> q(size_t(B * T * H * D), 0.1f), k = q, v = q, o = q, dq = q, dk = q, dv = q, dout = q;
      std::vector<float> lse(size_t(B * H * T));
      Aligned ws(attention_workspace_bytes(d, num_threads()));
      const double t = best_of(w, reps, [&] {
        attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), d, ws.get());
        attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), o.data(), lse.data(), q.data(), k.data(),
                           v.data(), d, ws.get());
      });
      const double eff = 3 * attention_forward_flops(d) / t / r_ref;
      h.attention_seq_efficiency.push_back({double(T), eff});
      h.attention_efficiency = eff;
    }
    // The fused head + cross-entropy, forward and backward (loss.h), as the engine calls it: 256 tokens, d = 512, a
    // vocabulary of 8192, its default chunk; 6 N V d FLOPs against the achievable rate.
    std::string detail = gemm_check;
    ref();
    {
      const int64_t N = 256, C = 512, V = 8192, chunk = linear_xent_default_chunk(V);
      std::vector<float> hf(static_cast<size_t>(N * C), 0.01f), Wf(static_cast<size_t>(V * C), 0.01f), dh(hf.size()),
          dW(Wf.size());
      std::vector<bf16> hb(hf.size()), Wb(Wf.size());
      f32_to_bf16(hb.data(), hf.data(), int64_t(hf.size()));
      f32_to_bf16(Wb.data(), Wf.data(), int64_t(Wf.size()));
      std::vector<int32_t> tg(static_cast<size_t>(N));
      for (int64_t i = 0; i < N; ++i) tg[size_t(i)] = int32_t((i * 131) % V);
      Aligned ws(linear_xent_workspace_bytes(N, V, chunk));
      const double t = best_of(w, reps, [&] {
        if (dt == ComputeDtype::BF16)
          linear_xent_fwd_bwd_bf16(dh.data(), dW.data(), hb.data(), Wb.data(), tg.data(), N, C, V, 1.f, chunk, ws.get());
        else
          linear_xent_fwd_bwd_f32(dh.data(), dW.data(), hf.data(), Wf.data(), tg.data(), N, C, V, 1.f, chunk, ws.get());
      });
      h.loss_efficiency = 6.0 * double(N) * double(V) * double(C) / t / r_ref;
    }
    // The memory-bound layer kernels at activation sizes (one micro-batch of 256 tokens, d = 512, fp32 activations):
    // two RMSNorms, a SwiGLU of width 704 (two shared experts of 352), a top-6 permute / unpermute over 64 experts,
    // the router's softmax / top-k; forward and backward. The rate is the bytes the cost model counts for them
    // (plan/cost.cpp: a norm reads and writes [N, d], a SwiGLU reads [N, 2F] and writes [N, F], a permute and an
    // unpermute read and write [R, d] each, the router reads, writes and re-reads [N, E] fp32 scores; backward
    // twice the forward) over the time taken.
    ref();
    {
      const int64_t N = 256, d = 512, F = 704, E = 64, K = 6, R = N * K;
      const double ab = 4;  // fp32 activations
      std::vector<float> x(static_cast<size_t>(N * d), 0.5f), y(x.size()), dy(x.size(), 0.1f), dx(x.size()),
          nw(static_cast<size_t>(d), 1.f), dnw(nw.size()), rstd(static_cast<size_t>(N));
      std::vector<float> gu(static_cast<size_t>(N * 2 * F), 0.3f), hh(static_cast<size_t>(N * F)), dgu(gu.size());
      std::vector<float> logits(static_cast<size_t>(N * E)), scores(logits.size()), dlog(logits.size());
      for (size_t i = 0; i < logits.size(); ++i) logits[i] = float((i * 2654435761u) % 1000) * 1e-3f;
      std::vector<int32_t> idx(static_cast<size_t>(N * K)), cnt(static_cast<size_t>(E)), off(static_cast<size_t>(E + 1)),
          row_of(idx.size()), token_of(idx.size()), slot_of(idx.size());
      std::vector<float> tw(idx.size()), dtw(idx.size()), xp(static_cast<size_t>(R * d)), dxp(xp.size());
      RouterConfig rc;
      rc.E = int(E), rc.topk = int(K), rc.norm_topk = false, rc.aux = AuxMode::SeqWise, rc.aux_coef = 1e-3f,
      rc.seq_len = 128;
      Aligned rws(router_workspace_bytes(rc, N)), nws(rmsnorm_backward_workspace_bytes(N, d));
      auto route = [&] {
        RouterLosses rl;
        router_forward(idx.data(), tw.data(), cnt.data(), scores.data(), &rl, logits.data(), nullptr, rc, N, rws.get());
        moe_permute_plan(off.data(), row_of.data(), token_of.data(), slot_of.data(), idx.data(), cnt.data(), N,
                         int(K), int(E), 0.0);
      };
      route();
      struct Fam {
        const char* name;
        double bytes;  // forward, as the cost model counts them
        double t;
      };
      Fam fam[4] = {
          {"norm", 2 * 2.0 * double(N * d) * ab, best_of(w, reps * 8, [&] {
             for (int i = 0; i < 2; ++i) {
               rmsnorm_forward(y.data(), nullptr, rstd.data(), x.data(), nw.data(), N, d, 1e-6f);
               rmsnorm_backward(dx.data(), dnw.data(), dy.data(), x.data(), nw.data(), rstd.data(), N, d, nws.get());
             }
           })},
          {"swiglu", 3.0 * double(N * F) * ab, best_of(w, reps * 8, [&] {
             swiglu_forward(hh.data(), nullptr, gu.data(), N, F);
             swiglu_backward(dgu.data(), hh.data(), gu.data(), N, F);
           })},
          {"permute", 2 * 2.0 * double(R * d) * ab, best_of(w, reps * 8, [&] {
             moe_permute(xp.data(), x.data(), token_of.data(), R, N, d);
             moe_unpermute(y.data(), xp.data(), row_of.data(), tw.data(), N, int(K), R, d);
             moe_unpermute_backward(dxp.data(), dtw.data(), dy.data(), xp.data(), row_of.data(), token_of.data(),
                                    slot_of.data(), tw.data(), N, int(K), R, d);
             moe_permute_backward(dx.data(), dxp.data(), row_of.data(), N, int(K), R, d);
           })},
          {"router", 3.0 * double(N * E) * 4, best_of(w, reps * 8, [&] {
             route();
             router_backward(dlog.data(), dtw.data(), scores.data(), idx.data(), nullptr, rc, N, rws.get());
           })},
      };
      double bytes = 0, t = 0;
      detail += "# memory-bound kernels (forward + backward, the cost model's bytes over the time):";
      for (const Fam& f : fam) {
        bytes += 3 * f.bytes, t += f.t;
        char b[96];
        std::snprintf(b, sizeof b, " %s %.2f GB/s (%.0f us);", f.name, 3 * f.bytes / f.t / 1e9, f.t * 1e6);
        detail += b;
      }
      detail += "\n";
      h.elementwise_bw = bytes / t;
    }
    // AdamW per parameter element (optim.h, fp32 masters and moments), and re-packing the experts' grouped-GEMM
    // layouts (forward and dgrad) per expert parameter, as after every optimizer step (Model::sync_weights).
    ref();
    {
      const int64_t n = quick ? (int64_t(1) << 21) : (int64_t(1) << 23);
      std::vector<float> p(static_cast<size_t>(n), 0.1f), m1(p.size()), v1(p.size()), g(p.size(), 0.01f);
      AdamWConfig ac;
      int64_t step = 0;
      const double t = best_of(w, reps, [&] { adamw_step(p.data(), m1.data(), v1.data(), g.data(), n, ac, ++step, 1.f, true); });
      h.optimizer_per_param = t / double(n);
      const double tn = best_of(w, reps, [&] { volatile double s2 = grad_norm_sq(g.data(), n); (void)s2; });
      h.grad_norm_per_param = tn / double(n);
      const double tz = best_of(w, reps, [&] { std::memset(g.data(), 0, size_t(n) * 4); });
      const GemmPrec prec = dt == ComputeDtype::BF16 ? GemmPrec::BF16 : GemmPrec::F32;
      const int64_t El = 64, d = 512, F = 192;  // larger than the caches, as a layer's experts are
      std::vector<float> w13(static_cast<size_t>(El * d * 2 * F), 0.01f), w2(static_cast<size_t>(El * F * d), 0.01f);
      Aligned a(grouped_packed_bytes(GroupedPackKind::Fwd, prec, El, d, 2 * F)),
          b(grouped_packed_bytes(GroupedPackKind::Dgrad, prec, El, d, 2 * F)),
          c2(grouped_packed_bytes(GroupedPackKind::Fwd, prec, El, F, d)),
          e(grouped_packed_bytes(GroupedPackKind::Dgrad, prec, El, F, d));
      const double tp = best_of(w, reps, [&] {
        grouped_pack_weights(a.get(), w13.data(), El, d, 2 * F, prec, GroupedPackKind::Fwd);
        grouped_pack_weights(b.get(), w13.data(), El, d, 2 * F, prec, GroupedPackKind::Dgrad);
        grouped_pack_weights(c2.get(), w2.data(), El, F, d, prec, GroupedPackKind::Fwd);
        grouped_pack_weights(e.get(), w2.data(), El, F, d, prec, GroupedPackKind::Dgrad);
      });
      h.expert_pack_per_param = tp / double(w13.size() + w2.size());
      char buf[200];
      std::snprintf(buf, sizeof buf, "# AdamW %.2f ns/param; gradient norm %.2f GB/s, zeroing %.2f GB/s (read / write 4 B "
                    "a parameter)\n", 1e9 * h.optimizer_per_param, 4.0 * double(n) / tn / 1e9, 4.0 * double(n) / tz / 1e9);
      detail += buf;
    }
    // Streaming bandwidth: a copy of 64 MiB (read + write).
    ref();
    {
      const size_t n = (quick ? 16u : 64u) << 20;
      std::vector<char> src(n, 1), dst(n);
      const double t = best_of(w, reps, [&] { std::memcpy(dst.data(), src.data(), n); });
      h.hbm_bw = 2.0 * double(n) / t;
      h.hbm_efficiency = 1.0;
    }
    // The fractions of the achievable rate above were taken against the first reference; re-base them on the
    // achievable rate written: the best of the median reference and the GEMM curve's points (a skinny GEMM whose
    // operands stay in the caches can beat the big cube).
    {
      std::vector<double> sorted = refs;
      std::sort(sorted.begin(), sorted.end());
      const double med = sorted[sorted.size() / 2];
      h.gemm_efficiency.back().eff = med / r_ref;  // the big cube at its median
      double best = 1.0;  // in units of r_ref
      for (const auto& p : h.gemm_efficiency) best = std::max(best, p.eff);
      best = std::max(best, med / r_ref);
      h.peak_bf16 = h.achievable_bf16 = best * r_ref;
      for (auto* cv : {&h.gemm_efficiency, &h.grouped_fwd_efficiency, &h.grouped_bwd_efficiency,
                       &h.attention_seq_efficiency})
        for (auto& p : *cv) p.eff = std::clamp(p.eff / best, 0.001, 1.0);
      h.attention_efficiency = std::clamp(h.attention_efficiency / best, 0.001, 1.0);
      h.loss_efficiency = std::clamp(h.loss_efficiency / best, 0.001, 1.0);
      char buf[260];
      std::snprintf(buf, sizeof buf, "# reference GEMM (%lld cube) over the calibration: %zu samples, %.1f to %.1f GFLOPS "
                    "(at a full share of the cores), median %.1f; achievable (the best GEMM measured) %.1f\n",
                    (long long)big, sorted.size(), sorted.front() / 1e9, sorted.back() / 1e9, med / 1e9,
                    h.achievable_bf16 / 1e9);
      detail = buf + detail;
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
                          "kernel_overhead_us", "attention_efficiency", "gemm_efficiency", "grouped_gemm_fwd_efficiency",
                          "grouped_gemm_bwd_efficiency", "loss_efficiency", "elementwise_bw_gbps",
                          "optimizer_ns_per_param", "grad_norm_ns_per_param", "expert_pack_ns_per_param",
                          "attention_seq_efficiency", "scale_up.domain",
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
      // The all-reduce as the engine's gradient reduction runs it: back-to-back calls of kCommReduceSegment fp32
      // elements (16 MiB) over a buffer larger than the caches (8 segments, 4 under --quick), timed as a whole and
      // fitted per segment; a single call alone took twice as long per byte here (the engine's dp_comm scope ran
      // at about 2 GB/s against 0.94 GB/s fitted to one call, docs/planner.md). The all-to-all at 4 MiB, the
      // order of one EP exchange.
      const int64_t n = kCommReduceSegment, segs = quick ? 4 : 8, na = 1 << 20;
      std::vector<float> x(static_cast<size_t>(n * segs), 1.f);
      const double ar = best_of(w, reps, [&] {
        for (int64_t k = 0; k < segs; ++k) w.all_reduce(x.data() + k * n, n);
      }) / double(segs);
      std::vector<char> s(static_cast<size_t>(4 * na)), r(static_cast<size_t>(4 * na));
      const double a2a = best_of(w, reps, [&] { w.all_to_all(r.data(), s.data(), 4 * na / w.size()); });
      const plan::Group g{w.size(), w.size()};
      // The collective bandwidth: what the ring all-reduce formula needs to give the measured time (the
      // point-to-point figure above stays the alpha; the fitted bandwidth covers the reduction arithmetic and the
      // sharing of cores that a ping-pong between two ranks does not see).
      const double p = double(w.size());
      const double ring_bytes = 2 * (p - 1) / p * 4.0 * double(n), lat = 2 * (p - 1) * h.scale_up.alpha;
      const double p2p_bw = h.scale_up.bw;
      if (ar > lat) h.scale_up.bw = std::min(p2p_bw, ring_bytes / (ar - lat));
      h.scale_out.bw = h.scale_up.bw;
      h.sources["scale_up.bw_gbps"] = when + "; fitted to back-to-back 16 MiB all-reduces with the ring formula";
      char buf[600];
      std::snprintf(buf, sizeof buf,
                    "# point-to-point %.2f GB/s (8 MiB ping-pong), alpha %.2f us (8 B); bw_gbps fitted to the all-reduce: "
                    "%.2f GB/s\n# check: all-reduce 16 MiB (one of a run of segments) measured %.3f ms, model %.3f ms; all-to-all 4 MiB measured "
                    "%.3f ms, model %.3f ms\n",
                    p2p_bw / 1e9, h.scale_up.alpha * 1e6, h.scale_up.bw / 1e9, 1e3 * ar,
                    1e3 * plan::all_reduce(h, 4.0 * n, g), 1e3 * a2a, 1e3 * plan::all_to_all(h, 4.0 * na, g));
      check = buf;
    }
  plan::validate_hardware(h, "calibrate");
  {
    char buf[160];
    std::snprintf(buf, sizeof buf, "# CPU share during the calibration: %.2f (the smallest over ranks; 1 = no other "
                  "process took these cores; every figure is scaled to a full share)\n", min_over_ranks(w, cpu_share.share()));
    detail = buf + detail;
  }
  if (check_out) *check_out = "# " + when + "\n" + detail + check;
  return h;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The rounds' figures combined: each the median over rounds. The curves (fractions of each round's achievable rate)
// are combined as absolute rates, then taken again as fractions of the combined achievable rate: the median round
// reference, raised to the fastest combined dense-GEMM point as one round does; grouped points above it are capped
// at 1 as in one round.
plan::Hardware combine_rounds(const std::vector<plan::Hardware>& r) {
  plan::Hardware h = r.back();
  auto med = [&](auto get) {
    std::vector<double> v;
    for (const plan::Hardware& x : r) v.push_back(get(x));
    return median(std::move(v));
  };
  using H = plan::Hardware;
  for (double H::*f : {&H::hbm_bw, &H::kernel_overhead, &H::elementwise_bw, &H::optimizer_per_param,
                       &H::grad_norm_per_param, &H::expert_pack_per_param})
    h.*f = med([&](const H& x) { return x.*f; });
  for (plan::Tier H::*t : {&H::scale_up, &H::scale_out}) {
    (h.*t).bw = med([&](const H& x) { return (x.*t).bw; });
    (h.*t).alpha = med([&](const H& x) { return (x.*t).alpha; });
  }
  double ach = med([](const H& x) { return x.achievable_bf16; });
  std::vector<plan::EffPoint> H::*curves[] = {&H::gemm_efficiency, &H::grouped_fwd_efficiency,
                                               &H::grouped_bwd_efficiency, &H::attention_seq_efficiency};
  std::vector<std::vector<double>> abs_rates;  // per curve, per point: the median absolute rate
  for (auto cv : curves) {
    abs_rates.emplace_back();
    for (size_t i = 0; i < (h.*cv).size(); ++i)
      abs_rates.back().push_back(med([&](const H& x) { return (x.*cv)[i].eff * x.achievable_bf16; }));
  }
  for (double rate : abs_rates[0]) ach = std::max(ach, rate);
  for (size_t c = 0; c < std::size(curves); ++c)
    for (size_t i = 0; i < (h.*curves[c]).size(); ++i)
      (h.*curves[c])[i].eff = std::clamp(abs_rates[c][i] / ach, 0.001, 1.0);
  for (double H::*f : {&H::attention_efficiency, &H::loss_efficiency})
    h.*f = std::clamp(med([&](const H& x) { return x.*f * x.achievable_bf16; }) / ach, 0.001, 1.0);
  h.peak_bf16 = h.achievable_bf16 = ach;
  return h;
}
}  // namespace

plan::Hardware calibrate_machine(const Comm& w, bool quick, std::string* check_out, int rounds) {
  MT_CHECK(rounds >= 1 && rounds <= 50, "plan calibrate", "--rounds = ", rounds, " must lie in 1..50");
  std::vector<plan::Hardware> r;
  std::string header;
  for (int i = 0; i < rounds; ++i) r.push_back(calibrate_round(w, quick, &header));
  plan::Hardware h = combine_rounds(r);
  plan::validate_hardware(h, "calibrate");
  if (check_out) {
    std::vector<double> ach;
    for (const plan::Hardware& x : r) ach.push_back(x.achievable_bf16 / 1e9);
    std::string line = "# " + std::to_string(rounds) + " round(s), every figure the median over them (the comments below "
                       "are the last round's); achievable GEMM rate per round:";
    for (double a : ach) {
      char b[32];
      std::snprintf(b, sizeof b, " %.1f", a);
      line += b;
    }
    char b[64];
    std::snprintf(b, sizeof b, " GFLOPS, written %.1f\n", h.achievable_bf16 / 1e9);
    *check_out = line + b + header;
  }
  return h;
}

void add_plan_calibrate(CLI::App* plan) {
  auto* cal = plan->add_subcommand("calibrate", "Measure this machine into a planner hardware TOML (run under mpirun "
                                                "for the MPI alpha-beta)");
  auto out = std::make_shared<std::string>();
  auto quick = std::make_shared<bool>(false);
  auto rounds = std::make_shared<int>(3);
  cal->add_option("--out", *out, "write the TOML here (default: print it)");
  cal->add_flag("--quick", *quick, "fewer repetitions and sizes (for tests)");
  cal->add_option("--rounds", *rounds,
                  "measure every figure this many times, interleaved, and keep the median (default 3; 1..50): a shared "
                  "host's speed moves within seconds")
      ->check(CLI::Range(1, 50));
  cal->callback([out, quick, rounds] {
    const Comm w = comm_world();
    std::string header;
    const plan::Hardware h = calibrate_machine(w, *quick, &header, *rounds);
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
