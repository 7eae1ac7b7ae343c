// measure.cpp: one calibration round on this machine (calib_measure.h): the engine's own kernels and Comm timed
// on every rank at once into plain figures (calib_round.h): GEMM rates by size in the compute dtype, the experts'
// grouped GEMM forward and backward by tokens per expert, attention, the fused head + loss, the memory-bound layer
// kernels (norm, SwiGLU, permute, router) at activation sizes, AdamW and the experts' re-packing per parameter,
// streaming memory bandwidth and, with two ranks or more, ping-pong messages, all-reduce and all-to-all. Every
// rank measures at once, so an oversubscribed launch measures each rank's share of the cores. Not the fit into
// planner hardware (src/plan/calibrate.cpp) and not a benchmark suite (bench/).
#include "moetron/calib_measure.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "moetron/attention.h"
#include "moetron/gemm.h"
#include "moetron/grouped_gemm.h"
#include "moetron/loss.h"
#include "moetron/model.h"
#include "moetron/norm.h"
#include "moetron/optim.h"
#include "moetron/permute.h"
#include "moetron/router.h"
#include "moetron/runtime.h"
#include "moetron/swiglu.h"

namespace moetron::calib {

double max_over_ranks(const Comm& w, double x) {
  std::vector<double> all(static_cast<size_t>(w.size()));
  w.all_gather(all.data(), &x, sizeof(double));
  return *std::max_element(all.begin(), all.end());
}

double min_over_ranks(const Comm& w, double x) { return -max_over_ranks(w, -x); }

CpuShare::CpuShare(int threads)
    : threads_(std::max(1, threads)), wall0_(now(CLOCK_MONOTONIC)), cpu0_(now(CLOCK_PROCESS_CPUTIME_ID)),
      sched0_(schedstat()) {}

double CpuShare::share() const {
  const Sched s = schedstat();
  if (s.ok && sched0_.ok) {
    const double run = s.run_ns - sched0_.run_ns, wait = s.wait_ns - sched0_.wait_ns;
    if (run > 0 && wait >= 0) return run / (run + wait);
  }
  const double wall = now(CLOCK_MONOTONIC) - wall0_;
  return wall > 0 ? (now(CLOCK_PROCESS_CPUTIME_ID) - cpu0_) / (wall * threads_) : 1.0;
}

CpuShare::Sched CpuShare::schedstat() {
  Sched r;
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream in(t.path() / "schedstat");
    double run = 0, wait = 0;
    if (in >> run >> wait) r.run_ns += run, r.wait_ns += wait, r.ok = true;
  }
  return r;
}

double CpuShare::now(clockid_t c) {
  timespec t{};
  clock_gettime(c, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

namespace {

using clk = std::chrono::steady_clock;

double secs(clk::time_point a) { return std::chrono::duration<double>(clk::now() - a).count(); }

// Seconds per call of f() as every rank sustains it when it has its cores: one warm-up call, then at least `reps`
// calls back to back on every rank at once, timed from a common start to the LAST rank's end (ranks of this job
// sharing cores count: that is their real share), times the smallest share of its cores a rank received meanwhile
// (other processes on the machine do not count: the figure is the machine's, not the moment's load; see CpuShare).
// The share is only meaningful over many scheduler time slices (a few ms each): the calls repeat until the window
// lasts min_window, the count agreed over ranks from a timed pilot call (collectives need the same count everywhere).
struct Timer {
  const Comm& w;
  double min_window;  // seconds
  template <class F>
  double best_of(int reps, F&& f) const {
    f();
    w.barrier();
    auto t0 = clk::now();
    f();
    const double pilot = max_over_ranks(w, secs(t0));
    const int n = int(std::clamp(std::ceil(min_window / std::max(pilot, 1e-7)), double(reps), 100.0 * reps));
    w.barrier();
    const CpuShare share(num_threads());
    t0 = clk::now();
    for (int r = 0; r < n; ++r) f();
    const double wall = max_over_ranks(w, secs(t0));
    return wall * std::min(1.0, min_over_ranks(w, share.share())) / n;
  }
};

// 64-byte aligned scratch (the grouped GEMMs' packed weights and workspaces need it).
struct Aligned {
  std::vector<char> v;
  explicit Aligned(size_t bytes) : v(bytes + 64) {}
  void* get() { return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63)); }
};

// An m x n x k GEMM in the compute dtype, called once per run(). `cold`: each call reads the next of enough weight
// (B) copies to span twice the last-level cache (64 MiB), as the engine's layers do: between two uses of a weight the
// other layers' and experts' weights pass through the caches, while the input (A) was just written by the kernel
// before.
class GemmCall {
 public:
  GemmCall(ComputeDtype dt, int64_t m, int64_t n, int64_t k, bool cold)
      : b16_(dt == ComputeDtype::BF16), m_(m), n_(n), k_(k), nb_(size_t(k * n)),
        copies_(cold ? std::max<size_t>(1, (size_t(64) << 20) / (nb_ * (b16_ ? 2 : 4))) : 1),
        a_(size_t(m * k), 0.5f), b_(cold && !b16_ ? nb_ * copies_ : nb_, 0.25f), c_(size_t(m * n)) {
    if (!b16_) return;
    ab_.resize(a_.size()), bb_.resize(nb_ * copies_);
    f32_to_bf16(ab_.data(), a_.data(), int64_t(a_.size()));
    for (size_t i = 0; i < copies_; ++i) f32_to_bf16(bb_.data() + i * nb_, b_.data(), int64_t(nb_));
  }
  void run() {
    const size_t off = nb_ * (next_++ % copies_);
    if (b16_)
      gemm_bf16(Trans::N, Trans::N, m_, n_, k_, 1.f, ab_.data(), k_, bb_.data() + off, n_, 0.f, c_.data(), n_);
    else
      gemm_f32(Trans::N, Trans::N, m_, n_, k_, 1.f, a_.data(), k_, b_.data() + off, n_, 0.f, c_.data(), n_);
  }
  double flops() const { return 2.0 * double(m_) * double(n_) * double(k_); }

 private:
  bool b16_;
  int64_t m_, n_, k_;
  size_t nb_, copies_, next_ = 0;
  std::vector<float> a_, b_, c_;
  std::vector<bf16> ab_, bb_;
};

// FLOP/s of an m x n x k GEMM in the compute dtype (GemmCall; `cold`: its weights read from memory).
double gemm_rate(const Timer& tm, ComputeDtype dt, int64_t m, int64_t n, int64_t k, int reps, bool cold = false) {
  GemmCall g(dt, m, n, k, cold);
  return g.flops() / tm.best_of(reps, [&] { g.run(); });
}

// One of the experts' two GEMMs (gate_up d -> 2F, down F -> d) over El experts: weights packed for the forward
// and the dgrad, inputs and output gradients in fp32 and bf16.
struct ExpertMat {
  int64_t K = 0, N = 0;
  std::vector<float> W, dW, X, Y, dX, dY;
  std::vector<bf16> Xb, dYb;
  std::unique_ptr<Aligned> pf, pd;
  GroupedPackedWeights wf, wd;
  // Sets up K x N over El experts and M rows; returns the largest workspace its three ops need.
  size_t init(GemmPrec prec, int64_t El, int64_t M, int64_t k, int64_t n) {
    K = k, N = n;
    W.assign(static_cast<size_t>(El * K * N), 0.01f), dW.resize(W.size());
    X.assign(static_cast<size_t>(M * K), 0.1f), dX.resize(X.size());
    Y.resize(static_cast<size_t>(M * N)), dY.assign(Y.size(), 0.1f);
    Xb.resize(X.size()), dYb.resize(dY.size());
    f32_to_bf16(Xb.data(), X.data(), int64_t(X.size()));
    f32_to_bf16(dYb.data(), dY.data(), int64_t(dY.size()));
    pf = std::make_unique<Aligned>(grouped_packed_bytes(GroupedPackKind::Fwd, prec, El, K, N));
    pd = std::make_unique<Aligned>(grouped_packed_bytes(GroupedPackKind::Dgrad, prec, El, K, N));
    wf = grouped_pack_weights(pf->get(), W.data(), El, K, N, prec, GroupedPackKind::Fwd);
    wd = grouped_pack_weights(pd->get(), W.data(), El, K, N, prec, GroupedPackKind::Dgrad);
    size_t wsb = 0;
    for (GroupedOp op : {GroupedOp::Fwd, GroupedOp::Dgrad, GroupedOp::Wgrad})
      wsb = std::max(wsb, grouped_gemm_workspace_bytes(op, prec, El, M, K, N));
    return wsb;
  }
};

// The routed experts' grouped GEMMs as the engine runs them (model_moe.cpp experts_forward / experts_backward):
// gate_up d -> 2F and down F -> d over El experts with te tokens each. Seconds of the forward (both GEMMs) and of
// the backward (dgrad + wgrad of both), each sustained on every rank at once.
GroupedTime grouped_time(const Timer& tm, GemmPrec prec, int64_t El, int64_t d, int64_t F, int64_t te, int reps) {
  const int64_t M = te * El;
  ExpertMat mats[2];
  size_t wsb = mats[0].init(prec, El, M, d, 2 * F);
  wsb = std::max(wsb, mats[1].init(prec, El, M, F, d));
  Aligned wsv(wsb);
  void* ws = wsv.get();
  std::vector<int32_t> counts(static_cast<size_t>(El), int32_t(te));
  const bool b16 = prec == GemmPrec::BF16;
  GroupedTime g;
  g.tokens_per_expert = te;
  g.fwd_s = tm.best_of(reps, [&] {
    for (ExpertMat& x : mats) {
      if (b16) grouped_gemm_fwd(x.Y.data(), nullptr, x.Xb.data(), x.wf, counts.data(), El, M, x.K, x.N, ws, wsb);
      else grouped_gemm_fwd(x.Y.data(), x.X.data(), x.wf, counts.data(), El, M, x.K, x.N, ws, wsb);
    }
  });
  g.bwd_s = tm.best_of(reps, [&] {
    for (ExpertMat& x : mats) {
      if (b16) {
        grouped_gemm_wgrad(x.dW.data(), x.Xb.data(), x.dYb.data(), counts.data(), El, M, x.K, x.N, true, ws, wsb);
        grouped_gemm_dgrad(x.dX.data(), nullptr, x.dYb.data(), x.wd, counts.data(), El, M, x.K, x.N, ws, wsb);
      } else {
        grouped_gemm_wgrad(x.dW.data(), x.X.data(), x.dY.data(), counts.data(), El, M, x.K, x.N, true, ws, wsb);
        grouped_gemm_dgrad(x.dX.data(), x.dY.data(), x.wd, counts.data(), El, M, x.K, x.N, ws, wsb);
      }
    }
  });
  for (const ExpertMat& x : mats) g.flops_fwd += 2.0 * double(M) * double(x.K) * double(x.N);
  return g;
}

// The dense curve over the smallest dimension from skinny GEMMs (m rows against a big / 2 square weight): the
// shape of the routed experts' GEMMs, whose row count is the tokens each expert gets; the weight read cold, as in
// training (gemm_rate). Then the same 256-row GEMM with its weight cold and hot in the caches.
void measure_gemms(const Timer& tm, ComputeDtype dt, int reps, Round& r) {
  const int64_t big = r.big;
  for (int64_t m : {int64_t(8), int64_t(16), int64_t(32), int64_t(64), int64_t(128), int64_t(256), big / 2}) {
    if (m > big / 2 || (m == 256 && big / 2 == 256)) continue;  // ascending, no repeats (--quick: big = 512)
    r.skinny.push_back({m, gemm_rate(tm, dt, m, big / 2, big / 2, m < 128 ? reps * 8 : reps, /*cold=*/true)});
  }
  r.check_m = std::min<int64_t>(256, big / 2);
  r.check_cold = gemm_rate(tm, dt, r.check_m, big / 2, big / 2, reps, true);
  r.check_hot = gemm_rate(tm, dt, r.check_m, big / 2, big / 2, reps);
}

// Grouped GEMMs (the routed experts), forward and backward apart, by tokens per expert: a d = 512, F = 192 SwiGLU
// pair at 4, 8, 16, 32, 64 and 256 tokens per expert (the curve is steep below 64). 64 experts (their weights,
// 75 MB in fp32, do not stay in a cache between passes, as a layer's experts do not in training) up to 64 tokens
// each; 16 at 256 tokens, where the GEMMs are compute-bound.
void measure_grouped(const Timer& tm, ComputeDtype dt, bool quick, int reps, Round& r) {
  const GemmPrec prec = dt == ComputeDtype::BF16 ? GemmPrec::BF16 : GemmPrec::F32;
  for (int64_t te : {int64_t(4), int64_t(8), int64_t(16), int64_t(32), int64_t(64), int64_t(256)}) {
    if (quick && (te == 256 || te == 8)) continue;
    r.grouped.push_back(grouped_time(tm, prec, te <= 64 ? 64 : 16, 512, 192, te, te < 64 ? reps * 2 : reps));
  }
}

// The smallest GEMM's time: the floor under every op.
void measure_overhead(const Timer& tm, int reps, Round& r) {
  std::vector<float> a(64), b(64), c(64);
  r.kernel_overhead_s = tm.best_of(reps * 4, [&] {
    gemm_f32(Trans::N, Trans::N, 8, 8, 8, 1.f, a.data(), 8, b.data(), 8, 0.f, c.data(), 8);
  });
}

// Attention: causal, forward + backward, 8 heads of 64 over 512 tokens per call, by sequence length; in the
// precision the engine's attention runs in under this compute dtype (model.cpp: bf16 products with bf16 compute
// where attention_bf16_preferred(), else fp32).
void measure_attention(const Timer& tm, ComputeDtype dt, bool quick, int reps, Round& r) {
  for (int64_t T : {int64_t(128), quick ? int64_t(256) : int64_t(512)}) {
    const int64_t B = std::max<int64_t>(1, 512 / T), H = 8, D = 64;
    AttnDims d{B, T, H, H, D, D, H * D, H * D, H * D, H * D, D, D, D, D, 0.125f};
    if (dt == ComputeDtype::BF16 && attention_bf16_preferred()) d.prec = AttnPrec::BF16;
    std::vector<float> q(size_t(B * T * H * D), 0.1f), k = q, v = q, o = q, dq = q, dk = q, dv = q, dout = q;
    std::vector<float> lse(size_t(B * H * T));
    Aligned ws(attention_workspace_bytes(d, num_threads()));
    const double t = tm.best_of(reps, [&] {
      attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), d, ws.get());
      attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), o.data(), lse.data(), q.data(), k.data(),
                         v.data(), d, ws.get());
    });
    r.attention.push_back({T, attention_forward_flops(d), t});
  }
}

// The fused head + cross-entropy, forward and backward (loss.h), as the engine calls it: 256 tokens, d = 512, a
// vocabulary of 8192, its default chunk; 6 N V d FLOPs.
void measure_loss(const Timer& tm, ComputeDtype dt, int reps, Round& r) {
  const int64_t N = 256, C = 512, V = 8192, chunk = linear_xent_default_chunk(V);
  std::vector<float> hf(static_cast<size_t>(N * C), 0.01f), Wf(static_cast<size_t>(V * C), 0.01f), dh(hf.size()),
      dW(Wf.size());
  std::vector<bf16> hb(hf.size()), Wb(Wf.size());
  f32_to_bf16(hb.data(), hf.data(), int64_t(hf.size()));
  f32_to_bf16(Wb.data(), Wf.data(), int64_t(Wf.size()));
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) tg[size_t(i)] = int32_t((i * 131) % V);
  Aligned ws(linear_xent_workspace_bytes(N, V, chunk));
  r.loss_s = tm.best_of(reps, [&] {
    if (dt == ComputeDtype::BF16)
      linear_xent_fwd_bwd_bf16(dh.data(), dW.data(), hb.data(), Wb.data(), tg.data(), N, C, V, 1.f, chunk, ws.get());
    else
      linear_xent_fwd_bwd_f32(dh.data(), dW.data(), hf.data(), Wf.data(), tg.data(), N, C, V, 1.f, chunk, ws.get());
  });
  r.loss_flops = 6.0 * double(N) * double(V) * double(C);
}

// One micro-batch of the memory-bound layer kernels' buffers: 256 tokens, d = 512, fp32 activations; a SwiGLU of
// width 704 (two shared experts of 352); a top-6 route over 64 experts.
struct LayerBuffers {
  static constexpr int64_t N = 256, d = 512, F = 704, E = 64, K = 6, R = N * K;
  static RouterConfig router_config() {
    RouterConfig rc;
    rc.E = int(E), rc.topk = int(K), rc.norm_topk = false, rc.aux = AuxMode::SeqWise, rc.aux_coef = 1e-3f,
    rc.seq_len = 128;
    return rc;
  }
  std::vector<float> x = std::vector<float>(size_t(N * d), 0.5f), y = std::vector<float>(x.size()),
                     dy = std::vector<float>(x.size(), 0.1f), dx = std::vector<float>(x.size()),
                     nw = std::vector<float>(size_t(d), 1.f), dnw = std::vector<float>(nw.size()),
                     rstd = std::vector<float>(size_t(N));
  std::vector<float> gu = std::vector<float>(size_t(N * 2 * F), 0.3f), hh = std::vector<float>(size_t(N * F)),
                     dgu = std::vector<float>(gu.size());
  std::vector<float> logits = std::vector<float>(size_t(N * E)), scores = std::vector<float>(logits.size()),
                     dlog = std::vector<float>(logits.size());
  std::vector<int32_t> idx = std::vector<int32_t>(size_t(N * K)), cnt = std::vector<int32_t>(size_t(E)),
                       off = std::vector<int32_t>(size_t(E + 1)), row_of = std::vector<int32_t>(idx.size()),
                       token_of = std::vector<int32_t>(idx.size()), slot_of = std::vector<int32_t>(idx.size());
  std::vector<float> tw = std::vector<float>(idx.size()), dtw = std::vector<float>(idx.size()),
                     xp = std::vector<float>(size_t(R * d)), dxp = std::vector<float>(xp.size());
  RouterConfig rc = router_config();
  Aligned rws{router_workspace_bytes(rc, N)}, nws{rmsnorm_backward_workspace_bytes(N, d)};

  LayerBuffers() {
    for (size_t i = 0; i < logits.size(); ++i) logits[i] = float((i * 2654435761u) % 1000) * 1e-3f;
    route();
  }
  void route() {
    RouterLosses rl;
    router_forward(idx.data(), tw.data(), cnt.data(), scores.data(), &rl, logits.data(), nullptr, rc, N, rws.get());
    moe_permute_plan(off.data(), row_of.data(), token_of.data(), slot_of.data(), idx.data(), cnt.data(), N, int(K),
                     int(E), 0.0);
  }
};

// The memory-bound layer kernels at activation sizes, forward and backward: two RMSNorms, the SwiGLU, a permute /
// unpermute, the router's softmax / top-k. Each with the bytes the cost model counts for its forward
// (plan/cost.cpp: a norm reads and writes [N, d], a SwiGLU reads [N, 2F] and writes [N, F], a permute and an
// unpermute read and write [R, d] each, the router reads, writes and re-reads [N, E] fp32 scores).
void measure_memory_bound(const Timer& tm, int reps, Round& r) {
  using L = LayerBuffers;
  const int64_t N = L::N, d = L::d, F = L::F, E = L::E, K = L::K, R = L::R;
  const double ab = 4;  // fp32 activations
  L b;
  const double norm_s = tm.best_of(reps * 8, [&] {
    for (int i = 0; i < 2; ++i) {
      rmsnorm_forward(b.y.data(), nullptr, b.rstd.data(), b.x.data(), b.nw.data(), N, d, 1e-6f);
      rmsnorm_backward(b.dx.data(), b.dnw.data(), b.dy.data(), b.x.data(), b.nw.data(), b.rstd.data(), N, d,
                       b.nws.get());
    }
  });
  const double swiglu_s = tm.best_of(reps * 8, [&] {
    swiglu_forward(b.hh.data(), nullptr, b.gu.data(), N, F);
    swiglu_backward(b.dgu.data(), b.hh.data(), b.gu.data(), N, F);
  });
  const double permute_s = tm.best_of(reps * 8, [&] {
    moe_permute(b.xp.data(), b.x.data(), b.token_of.data(), R, N, d);
    moe_unpermute(b.y.data(), b.xp.data(), b.row_of.data(), b.tw.data(), N, int(K), R, d);
    moe_unpermute_backward(b.dxp.data(), b.dtw.data(), b.dy.data(), b.xp.data(), b.row_of.data(), b.token_of.data(),
                           b.slot_of.data(), b.tw.data(), N, int(K), R, d);
    moe_permute_backward(b.dx.data(), b.dxp.data(), b.row_of.data(), N, int(K), R, d);
  });
  const double router_s = tm.best_of(reps * 8, [&] {
    b.route();
    router_backward(b.dlog.data(), b.dtw.data(), b.scores.data(), b.idx.data(), nullptr, b.rc, N, b.rws.get());
  });
  r.memory_bound = {{"norm", 2 * 2.0 * double(N * d) * ab, norm_s},
                    {"swiglu", 3.0 * double(N * F) * ab, swiglu_s},
                    {"permute", 2 * 2.0 * double(R * d) * ab, permute_s},
                    {"router", 3.0 * double(N * E) * 4, router_s}};
}

// AdamW per parameter element (optim.h, fp32 masters and moments), the gradient norm and zeroing, and re-packing
// the experts' grouped-GEMM layouts (forward and dgrad) per expert parameter, as after every optimizer step: alone
// (Model::sync_weights) and fused with AdamW (Model::update_and_sync).
void measure_optimizer(const Timer& tm, ComputeDtype dt, bool quick, int reps, Round& r) {
  const int64_t n = quick ? (int64_t(1) << 21) : (int64_t(1) << 23);
  std::vector<float> p(static_cast<size_t>(n), 0.1f), m1(p.size()), v1(p.size()), g(p.size(), 0.01f);
  AdamWConfig ac;
  int64_t step = 0;
  r.optimizer_params = double(n);
  r.adamw_s = tm.best_of(reps, [&] { adamw_step(p.data(), m1.data(), v1.data(), g.data(), n, ac, ++step, 1.f, true); });
  r.grad_norm_s = tm.best_of(reps, [&] { volatile double s2 = grad_norm_sq(g.data(), n); (void)s2; });
  r.zero_s = tm.best_of(reps, [&] { zero_bytes(g.data(), size_t(n) * 4); });  // as Model::zero_grads
  const GemmPrec prec = dt == ComputeDtype::BF16 ? GemmPrec::BF16 : GemmPrec::F32;
  const int64_t El = 64, d = 512, F = 192;  // larger than the caches, as a layer's experts are
  std::vector<float> w13(static_cast<size_t>(El * d * 2 * F), 0.01f), w2(static_cast<size_t>(El * F * d), 0.01f);
  Aligned a(grouped_packed_bytes(GroupedPackKind::Fwd, prec, El, d, 2 * F)),
      b(grouped_packed_bytes(GroupedPackKind::Dgrad, prec, El, d, 2 * F)),
      c2(grouped_packed_bytes(GroupedPackKind::Fwd, prec, El, F, d)),
      e(grouped_packed_bytes(GroupedPackKind::Dgrad, prec, El, F, d));
  r.pack_s = tm.best_of(reps, [&] {
    grouped_pack_weights(a.get(), w13.data(), El, d, 2 * F, prec, GroupedPackKind::Fwd);
    grouped_pack_weights(b.get(), w13.data(), El, d, 2 * F, prec, GroupedPackKind::Dgrad);
    grouped_pack_weights(c2.get(), w2.data(), El, F, d, prec, GroupedPackKind::Fwd);
    grouped_pack_weights(e.get(), w2.data(), El, F, d, prec, GroupedPackKind::Dgrad);
  });
  r.pack_params = double(w13.size() + w2.size());
  // Fused, as the trainer runs it where every master is on the rank: AdamW over a piece of whole experts, then the
  // piece's panels, piece after piece; what it adds to AdamW over the same masters alone.
  std::vector<float> m13(w13.size()), v13(w13.size()), g13(w13.size(), 0.01f), m2(w2.size()), v2(w2.size()),
      g2(w2.size(), 0.01f);
  struct Mat {
    float *w, *m, *v, *g;
    int64_t K, N;
    void *f, *d;
  };
  const Mat mats[2] = {{w13.data(), m13.data(), v13.data(), g13.data(), d, 2 * F, a.get(), b.get()},
                       {w2.data(), m2.data(), v2.data(), g2.data(), F, d, c2.get(), e.get()}};
  auto pass = [&](bool pack) {
    for (const Mat& x : mats) {
      const int64_t per = x.K * x.N, group = Model::sync_experts_per_piece(per);
      for (int64_t e0 = 0; e0 < El; e0 += group) {
        const int64_t e1 = std::min(El, e0 + group), o = e0 * per, len = (e1 - e0) * per;
        adamw_step(x.w + o, x.m + o, x.v + o, x.g + o, len, ac, ++step, 1.f, true);
        if (!pack) continue;
        grouped_pack_weights(x.f, x.w, El, x.K, x.N, prec, GroupedPackKind::Fwd, e0, e1);
        grouped_pack_weights(x.d, x.w, El, x.K, x.N, prec, GroupedPackKind::Dgrad, e0, e1);
      }
    }
  };
  const double adamw_alone = tm.best_of(reps, [&] { pass(false); });
  r.pack_fused_s = std::max(0.0, tm.best_of(reps, [&] { pass(true); }) - adamw_alone);
}

// Streaming bandwidth: a copy of 64 MiB (--quick: 16 MiB), read + write.
void measure_copy(const Timer& tm, bool quick, int reps, Round& r) {
  const size_t n = (quick ? 16u : 64u) << 20;
  std::vector<char> src(n, 1), dst(n);
  r.copy_s = tm.best_of(reps, [&] { std::memcpy(dst.data(), src.data(), n); });
  r.copy_bytes = double(n);
}

// With two ranks or more: ping-pong between ranks 0 and 1 (8 B for alpha, 8 MiB for the bandwidth); the
// all-reduce as the engine's gradient reduction runs it: back-to-back calls of kCommReduceSegment fp32 elements
// (16 MiB) over a buffer larger than the caches (8 segments, 4 under --quick), timed as a whole and taken per
// segment (a single call alone took twice as long per byte here: docs/planner.md); the same segments as all-gathers
// and reduce-scatters (they run at other rates than the all-reduce here: docs/planner.md); the all-to-all at 4 MiB,
// the order of one EP exchange.
void measure_messages(const Timer& tm, bool quick, int reps, Round& r) {
  const Comm& w = tm.w;
  if (w.size() < 2) return;
  auto pingpong = [&](int64_t bytes) {
    std::vector<char> buf(static_cast<size_t>(bytes));
    return tm.best_of(reps * 2, [&] {
      if (w.rank() == 0) w.send(buf.data(), bytes, 1), w.recv(buf.data(), bytes, 1);
      else if (w.rank() == 1) w.recv(buf.data(), bytes, 0), w.send(buf.data(), bytes, 0);
    });
  };
  r.pingpong_small_bytes = 8, r.pingpong_small_s = pingpong(8);
  r.pingpong_large_bytes = double(8 << 20), r.pingpong_large_s = pingpong(8 << 20);
  const int64_t n = kCommReduceSegment, segs = quick ? 4 : 8, na = 1 << 20;
  std::vector<float> x(static_cast<size_t>(n * segs), 1.f);
  r.all_reduce_elements = double(n);
  r.all_reduce_s = tm.best_of(reps, [&] {
    for (int64_t k = 0; k < segs; ++k) w.all_reduce(x.data() + k * n, n);
  }) / double(segs);
  const int64_t part = n / w.size();  // the per-rank share; the gather's output and the scatter's input are p parts
  std::vector<float> mine(static_cast<size_t>(part), 1.f);
  const double per_segment = double(n) / double(part * w.size()) / double(segs);  // scaled to n elements a segment
  r.all_gather_s = per_segment * tm.best_of(reps, [&] {
    for (int64_t k = 0; k < segs; ++k) w.all_gather(x.data() + k * n, mine.data(), 4 * part);
  });
  r.reduce_scatter_s = per_segment * tm.best_of(reps, [&] {
    for (int64_t k = 0; k < segs; ++k) w.reduce_scatter(mine.data(), x.data() + k * n, part);
  });
  std::vector<char> s(static_cast<size_t>(4 * na)), rb(static_cast<size_t>(4 * na));
  r.all_to_all_bytes = 4.0 * double(na);
  r.all_to_all_s = tm.best_of(reps, [&] { w.all_to_all(rb.data(), s.data(), 4 * na / w.size()); });
}

// With two ranks or more: how far the ranks drift apart over a segment of the same compute between two
// synchronizing collectives. Every rank runs the same GEMMs (128 x 512 x 512 in the compute dtype, the weights
// cycled through 64 MiB as the layers' are) for a segment, then a collective lines them up again; the slowest
// rank's time over the ranks' mean is what every rank waits at the collective. Segments of 1 to 64 ms (the engine's
// per-layer exchanges are that far apart), the same GEMM count on every rank (from the slowest pilot); per length
// the summed excess over the summed mean.
void measure_skew(const Comm& w, ComputeDtype dt, bool quick, Round& r) {
  if (w.size() < 2) return;
  GemmCall g(dt, 128, 512, 512, /*cold=*/true);
  for (int i = 0; i < 4; ++i) g.run();
  w.barrier();
  auto t0 = clk::now();
  for (int i = 0; i < 8; ++i) g.run();
  const double per_gemm = max_over_ranks(w, secs(t0)) / 8;
  const std::vector<std::pair<double, int>> plan =
      quick ? std::vector<std::pair<double, int>>{{2e-3, 24}, {16e-3, 8}}
            : std::vector<std::pair<double, int>>{{1e-3, 64}, {4e-3, 32}, {16e-3, 24}, {64e-3, 12}};
  std::vector<double> all(static_cast<size_t>(w.size()));
  for (const auto& [target, reps] : plan) {
    const int count = std::max(1, int(std::lround(target / std::max(per_gemm, 1e-7))));
    double excess = 0, mean_sum = 0;
    for (int rep = 0; rep < reps; ++rep) {
      w.barrier();
      t0 = clk::now();
      for (int i = 0; i < count; ++i) g.run();
      const double mine = secs(t0);
      w.all_gather(all.data(), &mine, sizeof(double));
      double mean = 0, slowest = 0;
      for (double x : all) mean += x / double(all.size()), slowest = std::max(slowest, x);
      excess += slowest - mean, mean_sum += mean;
    }
    r.skew.push_back({mean_sum / reps, mean_sum > 0 ? excess / mean_sum : 0});
  }
}

// With two ranks or more: a blocking exchange whose partner comes late, as the engine's TP / CP / EP exchanges meet
// after segments of compute that drift apart. A 16 KiB all-reduce (the small TP sums' size) entered together after
// a barrier, then with rank 0 arriving 2 ms after the others (a busy wait): the late rank's time in the call beyond
// the together-figure is what the early ranks' sleeping waits (comm.mpi_wait) add to the exchange. Medians of 15.
void measure_wait_overshoot(const Comm& w, Round& r) {
  if (w.size() < 2) return;
  std::vector<float> x(4096, 1.f);
  auto timed = [&](double late_s) {
    std::vector<double> t;
    for (int i = 0; i < 15; ++i) {
      w.barrier();
      if (w.rank() == 0) {
        const auto until = clk::now() + std::chrono::duration<double>(late_s);
        while (clk::now() < until) {
        }
      }
      const auto t0 = clk::now();
      w.all_reduce(x.data(), int64_t(x.size()));
      t.push_back(secs(t0));
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  timed(0.0);  // warm-up
  const double together = timed(0.0), late = timed(2e-3);
  r.wait_overshoot_s = max_over_ranks(w, w.rank() == 0 ? std::max(0.0, late - together) : 0.0);
}

// The ranks of this job on this node (OMPI_COMM_WORLD_LOCAL_SIZE under mpirun; else all of them).
int local_ranks(const Comm& w) {
  int local = w.size();
  if (const char* e = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"); e && std::atoi(e) > 0) local = std::atoi(e);
  return local;
}

// The machine: its CPU's model name (/proc/cpuinfo), its memory (/proc/meminfo's MemTotal), the ranks and threads.
void describe_machine(const Comm& w, ComputeDtype dt, Round& r) {
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
  r.cpu = cpu;
  r.ranks = w.size();
  r.local_ranks = local_ranks(w);
  r.threads = num_threads();
  r.bf16 = dt == ComputeDtype::BF16;
  std::ifstream f("/proc/meminfo");
  std::string k;
  double kb = 0;
  f >> k >> kb;
  r.mem_total_bytes = kb * 1024.0;
}

}  // namespace

Round measure_round(const Comm& w, bool quick) {
  const ComputeDtype dt = resolve_compute_dtype(ComputeDtype::Auto);
  const int reps = quick ? 2 : 5;
  const Timer tm{w, quick ? 0.1 : 0.25};
  // The engine's thread count (train_session.cpp): the cores over the ranks sharing this machine, unless
  // OMP_NUM_THREADS says otherwise (training.threads = 0). Measuring with more threads than the engine runs would
  // price an oversubscription the engine does not have.
  init_threads(0, local_ranks(w));
  const CpuShare cpu_share(num_threads());
  Round r;
  describe_machine(w, dt, r);
  // The reference GEMM (the big cube), measured before each family of figures: the planner takes every figure
  // against the first and the achievable rate from their median (every measurement is already scaled to a full
  // share of the cores: Timer::best_of).
  r.big = quick ? 512 : 1024;
  auto ref = [&] { r.reference.push_back(gemm_rate(tm, dt, r.big, r.big, r.big, reps)); };
  ref();
  r.fp32_cube = gemm_rate(tm, ComputeDtype::FP32, r.big, r.big, r.big, reps);
  measure_gemms(tm, dt, reps, r);
  ref();
  measure_grouped(tm, dt, quick, reps, r);
  measure_overhead(tm, reps, r);
  ref();
  measure_attention(tm, dt, quick, reps, r);
  ref();
  measure_loss(tm, dt, reps, r);
  ref();
  measure_memory_bound(tm, reps, r);
  ref();
  measure_optimizer(tm, dt, quick, reps, r);
  ref();
  measure_copy(tm, quick, reps, r);
  measure_messages(tm, quick, reps, r);
  measure_skew(w, dt, quick, r);
  measure_wait_overshoot(w, r);
  r.cpu_share = min_over_ranks(w, cpu_share.share());
  return r;
}

}  // namespace moetron::calib
