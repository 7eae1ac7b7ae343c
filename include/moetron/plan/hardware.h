// plan/hardware.h: what the planner knows of a GPU cluster: one GPU's memory and compute rates, the
// scale-up domain (NVLink switch or xGMI full mesh) and the scale-out network, each figure with the public
// source it came from. A catalog of named entries (lower case: mi300x, mi325x, mi355x, a100, h100, h200,
// b200, gb200) and user TOML files share one loader. Not a cost model (plan/comm_model.h, plan/cost.h) and
// nothing the engine reads.
//
// Units inside the struct are SI: bytes, bytes/s, FLOP/s, seconds. The TOML form uses GB, GB/s, TFLOPS and
// microseconds (docs/hardware.md lists every key and the catalog's sources).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace moetron::plan {

// Achieved fraction of the achievable matmul rate for a GEMM of m x n x k: a table over the smallest of
// the three dimensions (log-linear interpolation, clamped at the ends). Empty = 1.0 everywhere. The other
// curves below use the same form over their own abscissa.
struct EffPoint {
  double dim = 0;
  double eff = 1;
};

// One interconnect tier. Bandwidths are per GPU and per direction.
struct Tier {
  int64_t domain = 8;           // GPUs reachable at this tier's bandwidth (scale-up: GPUs per node / NVL domain)
  double bw = 0;                // bytes/s per GPU per direction that a collective can use at this tier
  double alpha = 0;             // seconds: latency of one message step (launch + wire + sync)
  std::string topology = "switch";  // "switch" (any pair at full bw) or "full_mesh" (point-to-point links)
  int64_t links = 0;            // full_mesh: links per GPU (domain - 1 for a full mesh)
  double link_bw = 0;           // full_mesh: bytes/s per link per direction
  double link_efficiency = 1;   // full_mesh: achievable fraction of a link (derating)
  // What a ring all-gather / reduce-scatter inside the domain reaches where it differs from bw (measured by `plan
  // calibrate` through the engine's own calls; 0 = bw, as every catalog entry).
  double gather_bw = 0, scatter_bw = 0;
  // What one GPU can push to ONE peer at a time (a ring step, a P2P): switch = bw, full_mesh = link_bw * eff.
  double pair_bw() const { return topology == "full_mesh" ? link_bw * link_efficiency : bw; }
  // What one GPU can push to ALL peers at once (all-to-all): switch = bw, full_mesh = links * link_bw * eff.
  double all_peers_bw() const {
    return topology == "full_mesh" ? double(links) * link_bw * link_efficiency : bw;
  }
  // The fraction of this tier's bandwidth an EP exchange reaches (a measured dispatcher's bandwidth over the
  // line rate), by the ranks of the exchange at this tier: the group's ranks in one domain for scale_up, its
  // whole size for scale_out. Empty: 1.0, the line rate. The dispatch (rows out to the experts) and the
  // combine (rows back) are measured apart; a backward leg runs as the other direction's kernel.
  std::vector<EffPoint> ep_dispatch_efficiency, ep_combine_efficiency;
  double ep_eff(bool combine, double ranks) const;
};

// Measured GEMM efficiency by shape: a full grid over the listed m, n and k (every combination present), eff the
// fraction of the achievable rate. Interpolated log-linearly along each axis (trilinear); above an axis's last
// value clamped; below its first, the time of the smallest measured size (eff scaled by dim / first).
struct GemmShapeTable {
  std::vector<double> m, n, k;  // ascending axes
  std::vector<double> eff;      // eff[(i * n.size() + j) * k.size() + l] at (m[i], n[j], k[l])
  bool empty() const { return eff.empty(); }
  double at(double mm, double nn, double kk) const;
  // From [m, n, k, eff] points in any order; throws moetron::Error (naming `key`) unless they fill a grid once.
  static GemmShapeTable from_points(const std::vector<std::vector<double>>& pts, const std::string& key);
};

struct Hardware {
  std::string name;         // catalog key or the TOML's top-level name (default: the file's stem)
  std::string description;  // e.g. "AMD Instinct MI300X (OAM, 750 W)"
  double hbm_bytes = 0;     // usable device memory
  double hbm_bw = 0;        // peak HBM bytes/s
  double hbm_efficiency = 1;  // achievable fraction of hbm_bw for streaming (memory-bound) kernels
  double stream_bw() const { return hbm_bw * hbm_efficiency; }  // bytes/s a memory-bound kernel reaches
  double peak_bf16 = 0;     // dense FLOP/s, datasheet
  double peak_fp8 = 0;      // dense FLOP/s, datasheet
  double achievable_bf16 = 0;  // FLOP/s measured on large GEMMs (not the datasheet peak)
  double achievable_fp8 = 0;
  // FLOP/s of a large fp32 GEMM through the engine's own fp32 GEMM (what Muon's Newton-Schulz runs on in the engine);
  // `plan calibrate` measures it, the GPU entries have none (0: the engine recipe then prices fp32 at achievable_bf16).
  double achievable_fp32 = 0;
  std::vector<EffPoint> gemm_efficiency;  // by the GEMM's smallest dimension
  // Measured by shape (the catalog's Hopper and Blackwell entries); when set it replaces gemm_efficiency for the
  // BF16 and FP8 GEMMs of gemm_rate.
  GemmShapeTable gemm_shape_efficiency;
  // The routed experts' grouped GEMMs, forward + dgrad + wgrad together, by tokens per expert (fraction of
  // the achievable rate). Empty = each expert priced as its own GEMM through gemm_efficiency.
  std::vector<EffPoint> grouped_gemm_efficiency;
  double kernel_overhead = 0;  // seconds per kernel launch (a floor under every op)
  // Seconds the host spends issuing one kernel (framework code + launch). It is exposed only where the host cannot
  // run ahead of the GPU: after a device-host synchronization (plan/cost.h, "Host-bound spans"). 0 = never exposed.
  double host_launch = 0;
  double attention_efficiency = 1;  // fused (flash) attention's FLOP rate as a fraction of achievable_bf16
  // Measured per-op figures (`plan calibrate` writes them for this machine; the catalog has none). Each one, when
  // set, replaces the generic pricing of its op; unset (empty / 0), the op is priced from the rates above.
  std::vector<EffPoint> grouped_fwd_efficiency;  // the experts' grouped GEMM forward, by tokens per expert
  std::vector<EffPoint> grouped_bwd_efficiency;  // its backward (dgrad + wgrad), by tokens per expert
  double loss_efficiency = 0;      // fused head + cross-entropy, forward + backward (6 N V d FLOPs), of achievable
  double elementwise_bw = 0;       // bytes/s of the layers' memory-bound kernels at activation sizes (0: stream_bw)
  std::vector<EffPoint> attention_seq_efficiency;  // attention_efficiency by sequence length (empty: the scalar)
  double optimizer_per_param = 0;  // seconds per AdamW element update (0: its bytes at stream_bw)
  double grad_norm_per_param = 0;  // seconds per gradient element of the global-norm pass (0: 4 B at stream_bw)
  double expert_pack_per_param = 0;  // seconds per routed-expert parameter to rebuild its packed GEMM layouts
  // ... when fused with the optimizer's update of the same masters (the engine where every master is on the rank):
  // what the rebuild adds to AdamW (0: not measured; then expert_pack_per_param)
  double expert_pack_fused_per_param = 0;
  // The ranks' drift between two synchronizing collectives (`plan calibrate` measures it on the engine's machine; the
  // catalog has none): by the segment of compute between them (dim in ms), the slowest rank's excess over the ranks'
  // mean as a fraction of the segment, which every rank then waits at the collective. Empty = no drift.
  std::vector<EffPoint> rank_skew;
  double skew_fraction(double segment_s) const;  // rank_skew at segment_s (clamped at its ends); 0 when empty
  // What a blocking exchange costs beyond its transfer when one rank reaches it first and waits (the engine's waits
  // sleep between tests and wake late): seconds per exchange, measured by `plan calibrate`; 0 = none (the catalog).
  double wait_overshoot = 0;
  double elementwise_rate() const { return elementwise_bw > 0 ? elementwise_bw : stream_bw(); }
  Tier scale_up;
  Tier scale_out;
  // Public source of each figure, by TOML key ("hbm_gb", "peak_bf16_tflops", "scale_up.bw_gbps", ...).
  std::map<std::string, std::string> sources;

  // FLOP/s a GEMM of m x n x k reaches in bf16 (fp8 = true: fp8): achievable x the shape table at (m, n, k) when
  // there is one, else x gemm_efficiency(min dim).
  double gemm_rate(double m, double n, double k, bool fp8) const;
  double gemm_eff(double min_dim) const;
  double grouped_eff(double tokens_per_expert) const;  // grouped_gemm_efficiency (1.0 when empty)
  // The grouped GEMM's forward / backward efficiency by tokens per expert: the split curves when measured, else
  // grouped_gemm_efficiency; false when neither is set (the experts are then priced one GEMM each).
  bool grouped_split_eff(double tokens_per_expert, double* fwd, double* bwd) const;
  double attention_eff(double seq_len) const;  // attention_seq_efficiency at seq_len, else attention_efficiency
};

const std::vector<std::string>& catalog_names();
// A catalog entry; throws moetron::Error naming the known entries for an unknown name.
Hardware catalog_hardware(std::string_view name);
// The embedded TOML text of a catalog entry (what catalog_hardware parses); throws like catalog_hardware.
std::string_view catalog_toml(std::string_view name);
// The TOML form of an entry (the catalog is written in it, and `plan calibrate` writes it).
Hardware hardware_from_toml(std::string_view toml_text, std::string_view source = "<string>");
std::string hardware_to_toml(const Hardware& h);
// `--hw` argument: a catalog name, or a path to a TOML file (anything with '/' or ending in .toml).
Hardware resolve_hardware(const std::string& name_or_path);
// Throws naming the key when a figure is missing or out of range (negative, zero where needed).
void validate_hardware(const Hardware& h, std::string_view source);

}  // namespace moetron::plan
