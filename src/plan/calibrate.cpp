// calibrate.cpp: measured rounds (calib::Round) to planner hardware (plan/calibrate.h): curves against the
// achievable GEMM rate, the rates of the memory-bound kernels, the optimizer and the copy, the alpha-beta of
// messages with the bandwidth fitted to the measured all-reduce, the sources and comments of the TOML, and the
// rounds' medians. Pure arithmetic on the figures handed in: no kernel, no clock, no communicator.
#include "moetron/plan/calibrate.h"

#include <algorithm>
#include <cstdio>

#include "moetron/check.h"
#include "moetron/plan/comm_model.h"

namespace moetron::plan {

namespace {

// printf into a std::string (the comment lines are short).
template <class... A>
std::string fmt(const char* f, A... a) {
  char buf[640];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

// The round's provenance: where, how many ranks and threads.
std::string when_of(const calib::Round& r) {
  return "measured by `moetron plan calibrate` on " + r.cpu + ", " + std::to_string(r.ranks) +
         " rank(s) at once, " + std::to_string(r.threads) + " thread(s) each";
}

// The compute figures, each a fraction of the round's first reference rate r_ref (re-based later by rebase()):
// the dense curve over the skinny GEMMs' rows (the big cube at 1), the grouped forward and backward by tokens per
// expert, attention by sequence length (three times the forward's FLOPs over the time of both), the fused loss.
void compute_fractions(const calib::Round& r, double r_ref, Hardware& h) {
  h.peak_fp8 = h.achievable_fp8 = 0;
  for (const calib::GemmRate& g : r.skinny) h.gemm_efficiency.push_back({double(g.m), g.flops_per_s / r_ref});
  h.gemm_efficiency.push_back({double(r.big), 1.0});
  for (const calib::GroupedTime& g : r.grouped) {
    h.grouped_fwd_efficiency.push_back({double(g.tokens_per_expert), g.flops_fwd / g.fwd_s / r_ref});
    h.grouped_bwd_efficiency.push_back({double(g.tokens_per_expert), 2 * g.flops_fwd / g.bwd_s / r_ref});
  }
  h.kernel_overhead = r.kernel_overhead_s;
  for (const calib::AttentionTime& a : r.attention) {
    const double eff = 3 * a.flops_fwd / a.seconds / r_ref;
    h.attention_seq_efficiency.push_back({double(a.seq_len), eff});
    h.attention_efficiency = eff;
  }
  h.loss_efficiency = r.loss_flops / r.loss_s / r_ref;
  h.achievable_fp32 = r.fp32_cube;
}

// The memory-bound kernels' rate: the bytes the cost model counts for them (backward twice the forward) over the
// time taken; the comment line lists each family.
std::string memory_bound_rate(const calib::Round& r, Hardware& h) {
  double bytes = 0, t = 0;
  std::string line = "# memory-bound kernels (forward + backward, the cost model's bytes over the time):";
  for (const calib::MemoryKernel& f : r.memory_bound) {
    bytes += 3 * f.bytes_fwd, t += f.seconds;
    line += fmt(" %s %.2f GB/s (%.0f us);", f.name.c_str(), 3 * f.bytes_fwd / f.seconds / 1e9, f.seconds * 1e6);
  }
  h.elementwise_bw = bytes / t;
  return line + "\n";
}

// AdamW, the gradient norm and the experts' re-packing per parameter element, and the streaming bandwidth of a
// copy (read + write); the comment line holds the optimizer's figures.
std::string per_param_rates(const calib::Round& r, Hardware& h) {
  const double n = r.optimizer_params;
  h.optimizer_per_param = r.adamw_s / n;
  h.grad_norm_per_param = r.grad_norm_s / n;
  h.expert_pack_per_param = r.pack_s / r.pack_params;
  h.expert_pack_fused_per_param = r.pack_fused_s / r.pack_params;
  h.hbm_bw = 2.0 * r.copy_bytes / r.copy_s;
  h.hbm_efficiency = 1.0;
  return fmt("# AdamW %.2f ns/param; gradient norm %.2f GB/s, zeroing %.2f GB/s (read / write 4 B a parameter)\n",
             1e9 * h.optimizer_per_param, 4.0 * n / r.grad_norm_s / 1e9, 4.0 * n / r.zero_s / 1e9);
}

// The fractions taken against the first reference re-based on the achievable rate written: the best of the
// median reference and the dense curve's points (a skinny GEMM whose operands stay in the caches can beat the big
// cube). Returns the comment line on the reference's spread.
std::string rebase(const calib::Round& r, double r_ref, Hardware& h) {
  std::vector<double> sorted = r.reference;
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
  return fmt("# reference GEMM (%lld cube) over the calibration: %zu samples, %.1f to %.1f GFLOPS (at a full share "
             "of the cores), median %.1f; achievable (the best GEMM measured) %.1f\n",
             (long long)r.big, sorted.size(), sorted.front() / 1e9, sorted.back() / 1e9, med / 1e9,
             h.achievable_bf16 / 1e9);
}

// The message tiers: with two ranks or more the ping-pong's alpha (the small message's one-way time) and
// bandwidth (the large message's extra time); with one, assumptions (1 us, half the copy bandwidth). One node: the
// scale-out tier repeats the scale-up one.
void message_tiers(const calib::Round& r, Hardware& h) {
  h.scale_up.domain = r.ranks;
  h.scale_up.topology = "switch";
  if (r.ranks >= 2) {
    const double small = r.pingpong_small_s / 2, large = r.pingpong_large_s / 2;
    h.scale_up.alpha = small;
    h.scale_up.bw = r.pingpong_large_bytes / std::max(large - small, 1e-9);
  } else {
    h.scale_up.alpha = 1e-6;
    h.scale_up.bw = h.hbm_bw / 2;
  }
  h.scale_out = h.scale_up;
  h.scale_out.domain = 1 << 20;
}

// The source of every figure written.
void set_sources(const calib::Round& r, const std::string& when, Hardware& h) {
  for (const char* k : {"hbm_gb", "hbm_bw_gbps", "hbm_efficiency", "peak_bf16_tflops", "achievable_bf16_tflops",
                        "achievable_fp32_tflops", "kernel_overhead_us", "attention_efficiency", "gemm_efficiency", "grouped_gemm_fwd_efficiency",
                        "grouped_gemm_bwd_efficiency", "loss_efficiency", "elementwise_bw_gbps",
                        "optimizer_ns_per_param", "grad_norm_ns_per_param", "expert_pack_ns_per_param",
                        "expert_pack_fused_ns_per_param", "attention_seq_efficiency", "scale_up.domain",
                        "scale_up.bw_gbps", "scale_up.alpha_us", "scale_up.topology"})
    h.sources[k] = when;
  h.sources["hbm_gb"] = "MemTotal of /proc/meminfo over the ranks on this node";
  h.sources["peak_bf16_tflops"] = when + "; a CPU has no datasheet figure here: the best measured rate, in the "
                                         "compute dtype (the bf16 keys hold fp32 rates on an fp32 machine)";
  if (r.ranks < 2) h.sources["scale_up.bw_gbps"] = "one rank: no message measured (half the copy bandwidth)";
  if (r.ranks < 2) h.sources["scale_up.alpha_us"] = "one rank: no message measured (assumption: 1 us)";
  for (const char* k : {"scale_out.domain", "scale_out.bw_gbps", "scale_out.alpha_us", "scale_out.topology"})
    h.sources[k] = "one node: the scale-up figures";
}

// With two ranks or more: the collective bandwidth, what the ring all-reduce formula needs to give the measured
// time (the point-to-point figure stays the alpha; the fitted bandwidth covers the reduction arithmetic and the
// sharing of cores that a ping-pong between two ranks does not see), never above the point-to-point one. Returns
// the comment lines: the fit, and the all-reduce and all-to-all measured against the model.
std::string fit_collectives(const calib::Round& r, const std::string& when, Hardware& h) {
  if (r.ranks < 2) return "";
  const double n = r.all_reduce_elements, ar = r.all_reduce_s, a2a = r.all_to_all_s;
  const Group g{r.ranks, r.ranks};
  const double p = double(r.ranks);
  const double p2p_bw = h.scale_up.bw;
  // The ring formula's bandwidth for a collective of `passes` ring passes over the 16 MiB that took t seconds, never
  // above the point-to-point rate; bw unchanged when t is not above the latency alone (or not measured).
  auto fit = [&](double t, int passes, double& bw) {
    const double lat = passes * (p - 1) * h.scale_up.alpha, bytes = passes * (p - 1) / p * 4.0 * n;
    if (!(t > lat)) return false;
    bw = std::min(p2p_bw, bytes / (t - lat));
    return true;
  };
  fit(ar, 2, h.scale_up.bw);
  h.scale_out.bw = h.scale_up.bw;
  h.sources["scale_up.bw_gbps"] = when + "; fitted to back-to-back 16 MiB all-reduces with the ring formula";
  // The all-gather and the reduce-scatter of the same bytes, each with the one-pass ring formula, when measured.
  if (fit(r.all_gather_s, 1, h.scale_up.gather_bw))
    h.sources["scale_up.gather_bw_gbps"] =
        when + "; fitted to back-to-back 16 MiB all-gathers (the output) with the one-pass ring formula";
  if (fit(r.reduce_scatter_s, 1, h.scale_up.scatter_bw))
    h.sources["scale_up.scatter_bw_gbps"] =
        when + "; fitted to back-to-back 16 MiB reduce-scatters (the input) with the one-pass ring formula";
  return fmt("# point-to-point %.2f GB/s (8 MiB ping-pong), alpha %.2f us (8 B); bw_gbps fitted to the all-reduce: "
             "%.2f GB/s; gather_bw_gbps %.2f, scatter_bw_gbps %.2f (0: not measured)\n# check: all-reduce 16 MiB (one "
             "of a run of segments) measured %.3f ms, model %.3f ms; all-gather %.3f / %.3f ms, reduce-scatter %.3f / "
             "%.3f ms; all-to-all 4 MiB measured %.3f ms, model %.3f ms\n",
             p2p_bw / 1e9, h.scale_up.alpha * 1e6, h.scale_up.bw / 1e9, h.scale_up.gather_bw / 1e9,
             h.scale_up.scatter_bw / 1e9, 1e3 * ar, 1e3 * all_reduce(h, 4.0 * n, g), 1e3 * r.all_gather_s,
             1e3 * all_gather(h, 4.0 * n, g), 1e3 * r.reduce_scatter_s, 1e3 * reduce_scatter(h, 4.0 * n, g), 1e3 * a2a,
             1e3 * all_to_all(h, r.all_to_all_bytes, g));
}

// With two ranks or more: the ranks' drift between synchronizing collectives (rank_skew), a point per measured
// segment length (ms), the fraction kept above 1e-4 (a curve point must be > 0). Returns the comment line.
std::string rank_skew(const calib::Round& r, const std::string& when, Hardware& h) {
  if (r.ranks < 2 || r.skew.empty()) return "";
  std::string line = "# rank skew (the slowest rank's excess over the mean, same GEMMs on every rank, by segment):";
  for (const calib::SkewPoint& p : r.skew) {
    if (!(p.segment_s > 0) || (!h.rank_skew.empty() && !(1e3 * p.segment_s > h.rank_skew.back().dim))) continue;
    h.rank_skew.push_back({1e3 * p.segment_s, std::clamp(p.excess, 1e-4, 1.0)});
    line += fmt(" %.1f ms %.2f %%", 1e3 * p.segment_s, 100 * p.excess);
  }
  h.sources["rank_skew"] = when + "; every rank the same GEMMs for a segment, then a collective";
  return line + "\n";
}

// With two ranks or more: what a blocking exchange costs beyond its transfer when its partner comes late
// (wait_overshoot). Returns the comment line.
std::string wait_overshoot(const calib::Round& r, const std::string& when, Hardware& h) {
  if (r.ranks < 2 || !(r.wait_overshoot_s > 0)) return "";  // not measured (or no later than together)
  h.wait_overshoot = r.wait_overshoot_s;
  h.sources["wait_overshoot_us"] = when + "; a 16 KiB all-reduce with one rank 2 ms late, against the same entered "
                                          "together, on the late rank";
  return fmt("# wait overshoot (a partner 2 ms late, the late rank's exchange beyond one entered together): %.1f us\n",
             1e6 * h.wait_overshoot);
}

// The dense GEMM at check_m rows with its weight cold (the curve's convention) and hot in the caches: how much a
// weight-resident benchmark would overstate the engine's dense GEMMs on this machine.
std::string gemm_check(const calib::Round& r) {
  return fmt("# dense GEMM %lld x %lld x %lld: weight read cold %.1f GFLOPS (the curve's convention), hot in the "
             "caches %.1f\n",
             (long long)r.check_m, (long long)r.big / 2, (long long)r.big / 2, r.check_cold / 1e9, r.check_hot / 1e9);
}

}  // namespace

double median(std::vector<double> v) {
  MT_CHECK(!v.empty(), "plan calibrate", "median of no figures");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Hardware hardware_from_round(const calib::Round& r, std::string* comments) {
  MT_CHECK(!r.reference.empty() && r.reference.front() > 0, "plan calibrate",
           "a round needs the reference GEMM's rate (measured at least once, > 0)");
  Hardware h;
  h.name = "this_machine";
  const std::string when = when_of(r);
  h.description = "this machine (" + r.cpu + "), one rank's share: " + std::string(r.bf16 ? "bf16" : "fp32") +
                  " compute";
  h.hbm_bytes = r.mem_total_bytes / r.local_ranks;  // this rank's share of the node's memory
  const double r_ref = r.reference.front();
  compute_fractions(r, r_ref, h);
  std::string detail = gemm_check(r);
  detail += memory_bound_rate(r, h);
  detail += per_param_rates(r, h);
  detail = rebase(r, r_ref, h) + detail;
  message_tiers(r, h);
  set_sources(r, when, h);
  const std::string check = fit_collectives(r, when, h) + rank_skew(r, when, h) + wait_overshoot(r, when, h);
  validate_hardware(h, "calibrate");
  detail = fmt("# CPU share during the calibration: %.2f (the smallest over ranks; 1 = no other process took these "
               "cores; every figure is scaled to a full share)\n",
               r.cpu_share) +
           detail;
  if (comments) *comments = "# " + when + "\n" + detail + check;
  return h;
}

Hardware combine_rounds(const std::vector<Hardware>& r) {
  MT_CHECK(!r.empty(), "plan calibrate", "no rounds to combine");
  Hardware h = r.back();
  auto med = [&](auto get) {
    std::vector<double> v;
    for (const Hardware& x : r) v.push_back(get(x));
    return median(std::move(v));
  };
  using H = Hardware;
  for (double H::*f : {&H::hbm_bw, &H::kernel_overhead, &H::elementwise_bw, &H::optimizer_per_param,
                       &H::grad_norm_per_param, &H::expert_pack_per_param, &H::expert_pack_fused_per_param,
                       &H::achievable_fp32, &H::wait_overshoot})
    h.*f = med([&](const H& x) { return x.*f; });
  for (Tier H::*t : {&H::scale_up, &H::scale_out}) {
    (h.*t).bw = med([&](const H& x) { return (x.*t).bw; });
    (h.*t).alpha = med([&](const H& x) { return (x.*t).alpha; });
    (h.*t).gather_bw = med([&](const H& x) { return (x.*t).gather_bw; });
    (h.*t).scatter_bw = med([&](const H& x) { return (x.*t).scatter_bw; });
  }
  for (size_t i = 0; i < h.rank_skew.size(); ++i)  // the rounds measure the same segments (within a round's pilot)
    h.rank_skew[i].eff = med([&](const H& x) { return i < x.rank_skew.size() ? x.rank_skew[i].eff : 1e-4; });
  double ach = med([](const H& x) { return x.achievable_bf16; });
  std::vector<EffPoint> H::*curves[] = {&H::gemm_efficiency, &H::grouped_fwd_efficiency, &H::grouped_bwd_efficiency,
                                        &H::attention_seq_efficiency};
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

Hardware calibrated_hardware(const std::vector<calib::Round>& rounds, std::string* header) {
  MT_CHECK(!rounds.empty() && rounds.size() <= 50, "plan calibrate", "--rounds = ", rounds.size(),
           " must lie in 1..50");
  std::vector<Hardware> hs;
  std::string last;
  for (const calib::Round& r : rounds) hs.push_back(hardware_from_round(r, &last));
  Hardware h = combine_rounds(hs);
  validate_hardware(h, "calibrate");
  if (header) {
    std::string line = "# " + std::to_string(rounds.size()) + " round(s), every figure the median over them (the "
                       "comments below are the last round's); achievable GEMM rate per round:";
    for (const Hardware& x : hs) line += fmt(" %.1f", x.achievable_bf16 / 1e9);
    *header = line + fmt(" GFLOPS, written %.1f\n", h.achievable_bf16 / 1e9) + last;
  }
  return h;
}

}  // namespace moetron::plan
