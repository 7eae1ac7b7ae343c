// plan/hardware_catalog.cpp: the planner's named hardware entries (mi300x, mi325x, mi355x, a100, a100_nccl,
// h100, h200, h800, b200, gb200, gb300), each an embedded TOML text read by the one loader in hardware.cpp, with a
// public source (or an explicit "derived:" / "assumption:" / "fitted:" note) for every figure it sets. Not the loader
// and not a cost model.
//
// Conventions shared by every entry (docs/hardware.md has the full table):
//  - peaks are dense (no 2:4 sparsity); NVIDIA datasheets quote sparse figures, halved here;
//  - bandwidths are per GPU and per direction (NVLink's "900 GB/s" is bidirectional: 450 each way);
//  - scale-up bandwidths are line rates (links x link rate), never a measured collective bus bandwidth, in every
//    entry but a100_nccl, whose one figure is fitted and says so (docs/planner.md, the rules at the top);
//  - achievable_* are measured maximum GEMM rates, never datasheet peaks; where no public measurement
//    exists the source says "derived:" and how.
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "moetron/check.h"
#include "moetron/plan/hardware.h"
#include "gemm_shape_tables.h"

namespace moetron::plan {
namespace {

// ---- figures every entry shares (all of them assumptions, and labelled so) ----------------------------------
const char* const kSharedTop = R"toml(hbm_efficiency = 0.8
kernel_overhead_us = 4.0
host_launch_us = 45.0
attention_efficiency = 0.6
gemm_efficiency = [[64.0, 0.25], [128.0, 0.4], [256.0, 0.6], [512.0, 0.78], [1024.0, 0.9], [2048.0, 0.96], [4096.0, 1.0]]
)toml";

const char* const kSharedSources = R"toml(hbm_efficiency = "assumption: streaming kernels reach 80% of the datasheet HBM bandwidth; not measured for this GPU (replace with a calibrated figure)"
attention_efficiency = "derived: FlashAttention-3 (Shah et al., 2024) reports BF16 forward up to about 740 TFLOPS on H100 (75% of peak) with a slower backward; 0.6 of the achievable GEMM rate over forward and backward is an assumption on top, not measured per GPU"
kernel_overhead_us = "assumption: about 4 us launch and tail per kernel without graph capture; not measured for this GPU"
host_launch_us = "FITTED (2026-11-28) on the calibration rows of tests/data/published_moe_runs.csv (Megatron-Core / Megatron-Bridge runs): the value of 30-70 us in 5 us steps that minimizes their rms log error (45: 0.276; calibration median |error| 15.5 %); an effective host cost per kernel the planner counts, framework code included (Megatron-LM's DeepSeek-V3 GB200 write-up describes the host-bound MoE layers and the device-host synchronization per MoE layer); not measured"
gemm_efficiency = "assumption: generic fraction of the achievable rate by the GEMM's smallest dimension (25% at 64 rising to 100% at 4096); not measured for this GPU"
"scale_up.alpha_us" = "assumption: 3 us per message step inside the node (launch + wire + sync), the order of small-message collective latencies; not measured"
"scale_out.domain" = "assumption: a non-blocking fat tree of up to 65536 GPUs (a planning ceiling, not a product figure)"
"scale_out.alpha_us" = "assumption: 10 us per message step across nodes (NIC + switch hops + sync); not measured"
"scale_out.topology" = "assumption: rail-optimized non-blocking fat tree, any pair at the NIC rate"
)toml";

// Sources cited by several entries (or several times): {WHITEPAPER}, {AMD_MAF}, {MAMF}, {MAMF_PEAK}, {LOCKWOOD},
// {VERDA}, {DEEPEP_V1}, {HYBRIDEP}, {MLM_GB200} and {XLA_GEMM} in an entry's sources expand to these.
const char* const kWhitepaper = "AMD whitepaper 'At-Scale AI Training on AMD Instinct MI350/MI300X Series GPUs' (2025)";
const char* const kAmdMaf =
    "AMD ROCm blog 'Measuring Max-Achievable FLOPs - Part 2' (2025), Table 1, hipBLASLt-bench, "
    "https://rocm.blogs.amd.com/software-tools-optimization/measuring-max-achievable-flops-part2/README.html";
const char* const kLockwood =
    "G. Lockwood, notes on B300 / GB300 NVL72 as advertised at GTC 2025, "
    "https://glennklockwood.com/garden/processors/B300";
const char* const kVerda =
    "Verda blog 'NVIDIA GB300 NVL72: GPU Architecture & Performance' (2025), "
    "https://verda.com/blog/gb300-nvl72-architecture";
const char* const kMamfPeak =
    "S. Bekman, Machine Learning Engineering Open Book, 'TFLOPS comparison table' (2026, dense peaks from the vendors' "
    "specifications), https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md";
const char* const kDeepEpV1 =
    "deepseek-ai/DeepEP README, V1 normal-kernel table (now docs/legacy.md; H800 with about 160 GB/s NVLink "
    "maximum and ConnectX-7 400 Gb/s; 4096 tokens a batch, hidden 7168, top-8, FP8 dispatch, BF16 combine)";
const char* const kHybridEp =
    "deepseek-ai/DeepEP, hybrid-ep branch, Hybrid-EP_Implementation.md, 'Performance Results' (4096 tokens, hidden "
    "7168, top-8, random uniform router, 8 local experts; 'algorithm bandwidth', the Torch API figures); HybridEP is "
    "the dispatcher Megatron-Bridge's DeepSeek-V3 GB200 recipe names (v0.2.0, scripts/performance/configs)";
const char* const kMlmGb200 =
    "NVIDIA Megatron-LM, docs/discussions/deepseek-v3-gb200-optimization, section 2.2.1 (DeepEP at EP 32 on 256 "
    "GB200 GPUs, 24 SMs: dispatch about 400 GB/s and combine about 190 GB/s algorithm bandwidth against the 900 GB/s "
    "unidirectional MNNVL line rate); the same write-up is the source of rows nv-mlm-01 / 02 of "
    "tests/data/published_moe_runs.csv, which are not projected (seq_len not given): for them this figure would be an "
    "input from their own paper";
const char* const kMamf =
    "S. Bekman, Machine Learning Engineering Open Book, 'Maximum Achievable Matmul FLOPS comparison table' "
    "(2025, torch matmul, mean at the best shape of a sweep), "
    "https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md";

// The measured GEMM shape tables' sources (gemm_shape_tables.cpp holds the tables).
const char* const kSm90GemmSource = R"toml(gemm_shape_efficiency = "measured: XLA's default matmul performance table for sm_90 (batch 1, BF16; its 4096^3 rate, 780.2 TFLOPS, is an H100 SXM's: {MAMF} measured 794.5), each point over that best point, {XLA_GEMM}; FP8 GEMMs take the BF16 shape (the table's sm_90 FP8 figures, up to 2,593 TFLOPS, exceed H100's 1,979 dense FP8 peak and are not used)"
)toml";
const char* const kSm90GemmSourceDerived = R"toml(gemm_shape_efficiency = "derived: the sm_90 table measured on H100 SXM (the same GH100 compute), {XLA_GEMM}; FP8 GEMMs take the BF16 shape"
)toml";
const char* const kSm100GemmSource = R"toml(gemm_shape_efficiency = "measured: XLA's default matmul performance table for sm_100 (batch 1, BF16; its best point, 4096^3, 1,416.9 TFLOPS), each point over that best point, {XLA_GEMM}; FP8 GEMMs take the BF16 shape"
)toml";
const char* const kSm100GemmSourceDerived = R"toml(gemm_shape_efficiency = "derived: the sm_100 table (B200; the same Blackwell tensor cores), {XLA_GEMM}; FP8 GEMMs take the BF16 shape"
)toml";
const char* const kXlaGemm =
    "openxla/xla, xla/service/gpu/model/matmul_interpolator_data.h (commit 71feeddf; in tensorflow/tensorflow at "
    "third_party/xla/xla/backends/gpu/cost_model/matmul_interpolator_data.h, a305421c): FLOP/s of one [m, k] x [k, n] "
    "dot for m, n, k in {256, 512, 1024, 2048, 4096}, written by XLA's matmul performance-table generator";

// MI300X and MI325X: the same 8-GPU xGMI full mesh and 400 Gb/s NICs.
const char* const kXgmiTiers = R"toml(
[scale_up]
domain = 8
topology = "full_mesh"
links = 7
link_bw_gbps = 64.0
link_efficiency = 1.0
bw_gbps = 448.0
alpha_us = 3.0
ep_dispatch_efficiency = [[8.0, 0.765]]
ep_combine_efficiency = [[8.0, 0.79]]

[scale_out]
domain = 65536
topology = "switch"
bw_gbps = 50.0
alpha_us = 10.0
)toml";

// H100 and H200 (SXM): the same NVLink 4 switch and 400 Gb/s NICs.
const char* const kNvlink4Tiers = R"toml(
[scale_up]
domain = 8
topology = "switch"
bw_gbps = 450.0
alpha_us = 3.0
ep_dispatch_efficiency = [[8.0, 0.765]]
ep_combine_efficiency = [[8.0, 0.79]]

[scale_out]
domain = 65536
topology = "switch"
bw_gbps = 50.0
alpha_us = 10.0
)toml";

// A100: the catalog entries `a100` (NVLink at line rate) and `a100_nccl` (the same GPU and node with the
// scale-up bandwidth fitted to the public dense anchors, 200 GB/s, about a measured NCCL all-reduce bus bandwidth)
// share every other figure and its source.
const char* const kA100Figures = R"toml(hbm_gb = 80.0
hbm_bw_gbps = 2039.0
peak_bf16_tflops = 312.0
peak_fp8_tflops = 0.0
achievable_bf16_tflops = 271.2
achievable_fp8_tflops = 0.0
)toml";
const char* const kA100Tiers = R"toml(domain = 8
topology = "switch"
alpha_us = 3.0
ep_dispatch_efficiency = [[8.0, 0.765]]
ep_combine_efficiency = [[8.0, 0.79]]

[scale_out]
domain = 65536
topology = "switch"
bw_gbps = 25.0
alpha_us = 10.0
)toml";
const char* const kA100Sources = R"toml(hbm_gb = "NVIDIA A100 Tensor Core GPU datasheet (2021), A100 80GB SXM: 80 GB HBM2e"
hbm_bw_gbps = "NVIDIA A100 Tensor Core GPU datasheet (2021), A100 80GB SXM: 2,039 GB/s ({MAMF} lists 2.00 TB/s)"
peak_bf16_tflops = "NVIDIA A100 Tensor Core GPU datasheet (2021): 624 TFLOPS BF16 Tensor Core with sparsity, 312 dense"
peak_fp8_tflops = "NVIDIA A100 Tensor Core GPU datasheet (2021): no FP8 Tensor Core format on Ampere (0 = no FP8; an FP8 recipe is refused)"
achievable_bf16_tflops = "measured: 271.2 TFLOPS BF16 (torch 2.6.0, CUDA 12.6, best shape 1024x10240x5120), {MAMF}"
achievable_fp8_tflops = "none: Ampere has no FP8 GEMM"
"scale_up.domain" = "NVIDIA DGX A100 datasheet (2020): 8 A100 GPUs per node on six NVSwitches; Selene is built of DGX A100 nodes (Narayanan et al. 2021, section 5)"
"scale_up.topology" = "NVIDIA A100 Tensor Core GPU architecture whitepaper (2020): second-generation NVSwitch, any GPU pair at the full 600 GB/s"
"scale_up.ep_dispatch_efficiency" = "derived: no measurement of an EP exchange on A100 found; H800's measured fraction of its line rate (DeepEP dispatch at EP 8, 153 of 200 GB/s = 0.765, {DEEPEP_V1}) is taken, so that every 8-GPU domain is derated alike (docs/planner.md, rule 2)"
"scale_up.ep_combine_efficiency" = "derived: as the dispatch, H800's combine at EP 8, 158 of 200 GB/s = 0.79, {DEEPEP_V1}"
"scale_out.bw_gbps" = "NVIDIA DGX A100 datasheet (2020): 8 single-port ConnectX-6 VPI 200 Gb/s HDR InfiniBand, one per GPU = 25 GB/s per direction; Selene's nodes likewise have eight 200 Gb/s HDR InfiniBand HCAs for application traffic on a fat tree (Narayanan et al. 2021, section 5; Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B', section 3)"
)toml";

struct Entry {
  const char* name;
  const char* head;     // top-level figures
  const char* tiers;    // [scale_up] and [scale_out]
  const char* sources;  // this entry's [sources] lines
  // Text shared with another entry, appended to head, tiers and sources (A100 variants).
  const char* shared_head = "";
  const char* shared_tiers = "";
  const char* shared_sources = "";
};

const Entry kEntries[] = {
    // ---- AMD ----------------------------------------------------------------------------------------------
    {"mi300x",
     R"toml(name = "mi300x"
description = "AMD Instinct MI300X (OAM, 750 W), 8 per node on an xGMI full mesh"
hbm_gb = 192.0
hbm_bw_gbps = 5300.0
peak_bf16_tflops = 1307.4
peak_fp8_tflops = 2614.9
achievable_bf16_tflops = 708.0
achievable_fp8_tflops = 1273.0
)toml",
     kXgmiTiers,
     R"toml(hbm_gb = "AMD Instinct MI300X data sheet (2023): 192 GB HBM3; same in {WHITEPAPER}"
hbm_bw_gbps = "AMD Instinct MI300X data sheet (2023): 5.3 TB/s peak; same in {WHITEPAPER}"
peak_bf16_tflops = "AMD Instinct MI300X data sheet (2023): 1307.4 TFLOPS dense BF16 (the whitepaper rounds to 1.3 PF)"
peak_fp8_tflops = "AMD Instinct MI300X data sheet (2023): 2614.9 TFLOPS dense FP8 (the whitepaper rounds to 2.6 PF)"
achievable_bf16_tflops = "measured: 708 TFLOPS BF16 max-achievable GEMM (M=4096 N=4864 K=32896, 1207 MHz median clock), {AMD_MAF}; an independent torch sweep measured 668.4 in {MAMF}"
achievable_fp8_tflops = "measured: 1273 TFLOPS FP8 max-achievable GEMM (M=4096 N=3648 K=32896), {AMD_MAF}"
"scale_up.domain" = "AMD Instinct MI300X platform: 8 OAM GPUs per node on one Infinity Fabric (xGMI) full mesh; {WHITEPAPER} (scale-up domain of 8)"
"scale_up.topology" = "AMD Instinct MI300X data sheet (2023): 7 Infinity Fabric links per GPU, each to one of the 7 peers (full mesh)"
"scale_up.links" = "AMD Instinct MI300X data sheet (2023): 7 Infinity Fabric links"
"scale_up.link_bw_gbps" = "AMD Instinct MI300X data sheet (2023): 128 GB/s peak bidirectional per Infinity Fabric link = 64 GB/s per direction"
"scale_up.link_efficiency" = "assumption: no derating; the whitepaper's 448 GB/s all-to-all figure equals 7 links x 64 GB/s at full rate"
"scale_up.bw_gbps" = "derived: 7 Infinity Fabric links x 64 GB/s per direction (AMD Instinct MI300X data sheet, 2023) = 448 GB/s per GPU, a line rate; {WHITEPAPER} prints the same All-to-All BW"
"scale_up.ep_dispatch_efficiency" = "derived: no measurement of an EP exchange on MI300X found; H800's measured fraction of its line rate (DeepEP dispatch at EP 8, 153 of 200 GB/s = 0.765, {DEEPEP_V1}) is taken, so that every 8-GPU domain is derated alike (docs/planner.md, rule 2)"
"scale_up.ep_combine_efficiency" = "derived: as the dispatch, H800's combine at EP 8, 158 of 200 GB/s = 0.79, {DEEPEP_V1}"
"scale_out.bw_gbps" = "400 Gb/s InfiniBand per GPU = 50 GB/s per direction: {WHITEPAPER}, footnote 1 (96 nodes of 8 MI300X, Azure, 400 Gbps InfiniBand)"
)toml"},
    {"mi325x",
     R"toml(name = "mi325x"
description = "AMD Instinct MI325X (OAM, 1000 W), 8 per node on an xGMI full mesh"
hbm_gb = 256.0
hbm_bw_gbps = 6000.0
peak_bf16_tflops = 1307.4
peak_fp8_tflops = 2614.9
achievable_bf16_tflops = 843.0
achievable_fp8_tflops = 1519.0
)toml",
     kXgmiTiers,
     R"toml(hbm_gb = "AMD Instinct MI325X data sheet (2024): 256 GB HBM3E; also PyTorch/AMD blog on TorchTitan MoE pre-training on 1,024 MI325X GPUs (2025)"
hbm_bw_gbps = "AMD Instinct MI325X data sheet (2024): 6 TB/s peak"
peak_bf16_tflops = "AMD Instinct MI325X data sheet (2024): 1307.4 TFLOPS dense BF16"
peak_fp8_tflops = "AMD Instinct MI325X data sheet (2024): 2614.9 TFLOPS dense FP8"
achievable_bf16_tflops = "measured: 843 TFLOPS BF16 max-achievable GEMM (1447 MHz median clock), {AMD_MAF}; an independent torch sweep measured 784.9 in {MAMF}"
achievable_fp8_tflops = "measured: 1519 TFLOPS FP8 max-achievable GEMM (1464 MHz median clock), {AMD_MAF}"
"scale_up.domain" = "AMD Instinct MI325X platform (2024): 8 OAM GPUs per node on one Infinity Fabric full mesh"
"scale_up.topology" = "AMD Instinct MI325X data sheet (2024): 7 Infinity Fabric links per GPU (full mesh of 8)"
"scale_up.links" = "AMD Instinct MI325X data sheet (2024): 7 Infinity Fabric links"
"scale_up.link_bw_gbps" = "AMD Instinct MI325X data sheet (2024): 128 GB/s peak bidirectional per link = 64 GB/s per direction"
"scale_up.link_efficiency" = "assumption: no derating, as for mi300x (whose whitepaper all-to-all figure is the full link rate)"
"scale_up.bw_gbps" = "derived: 7 links x 64 GB/s = 448 GB/s, the same Infinity Fabric as MI300X (the whitepaper's MI300X all-to-all figure)"
"scale_up.ep_dispatch_efficiency" = "derived: no measurement of an EP exchange on MI325X found; H800's measured fraction of its line rate (DeepEP dispatch at EP 8, 153 of 200 GB/s = 0.765, {DEEPEP_V1}) is taken, so that every 8-GPU domain is derated alike (docs/planner.md, rule 2)"
"scale_up.ep_combine_efficiency" = "derived: as the dispatch, H800's combine at EP 8, 158 of 200 GB/s = 0.79, {DEEPEP_V1}"
"scale_out.bw_gbps" = "one 400 Gb RoCE v2 NIC (Broadcom Thor 2) per GPU = 50 GB/s per direction: PyTorch/AMD blog on TorchTitan MoE pre-training on 1,024 MI325X GPUs at TensorWave (2025)"
)toml"},
    {"mi355x",
     R"toml(name = "mi355x"
description = "AMD Instinct MI355X (OAM, liquid cooled, 1400 W), 8 per node on an xGMI full mesh"
hbm_gb = 288.0
hbm_bw_gbps = 8000.0
peak_bf16_tflops = 2500.0
peak_fp8_tflops = 5000.0
achievable_bf16_tflops = 1565.0
achievable_fp8_tflops = 2820.0
)toml",
     R"toml(
[scale_up]
domain = 8
topology = "full_mesh"
links = 7
link_bw_gbps = 76.8
link_efficiency = 1.0
bw_gbps = 537.6
alpha_us = 3.0
ep_dispatch_efficiency = [[8.0, 0.765]]
ep_combine_efficiency = [[8.0, 0.79]]

[scale_out]
domain = 65536
topology = "switch"
bw_gbps = 50.0
alpha_us = 10.0
)toml",
     R"toml(hbm_gb = "288 GB HBM3E: {WHITEPAPER}; AMD Instinct MI355X product page (2025)"
hbm_bw_gbps = "8.0 TB/s: {WHITEPAPER}; AMD Instinct MI355X product page (2025)"
peak_bf16_tflops = "2.5 PF dense BF16: {WHITEPAPER}; AMD Instinct MI355X product page (2025)"
peak_fp8_tflops = "5.0 PF dense FP8: {WHITEPAPER}; AMD Instinct MI355X product page (2025)"
achievable_bf16_tflops = "measured: 1565 TFLOPS BF16 (torch 2.8, ROCm 7.0.2, best shape 12288x8192x8192), {MAMF}"
achievable_fp8_tflops = "derived: no public FP8 GEMM maximum found for MI355X; 1565 (its measured BF16) x 1519/843 (MI325X's measured FP8/BF16 ratio in {AMD_MAF}) = 2820"
"scale_up.domain" = "AMD Instinct MI355X platform (2025): 8 GPUs per node on one Infinity Fabric full mesh; {WHITEPAPER} (scale-up domain of 8)"
"scale_up.topology" = "AMD Instinct MI355X product page (2025): 7 Infinity Fabric links per GPU (full mesh of 8)"
"scale_up.links" = "AMD Instinct MI355X product page (2025): 7 Infinity Fabric links"
"scale_up.link_bw_gbps" = "AMD Instinct MI355X product page (2025): 153.6 GB/s peak bidirectional per link = 76.8 GB/s per direction (7 x 76.8 = the whitepaper's 537.6)"
"scale_up.link_efficiency" = "assumption: no derating; the whitepaper's 537.6 GB/s all-to-all figure equals 7 links x 76.8 GB/s at full rate"
"scale_up.bw_gbps" = "derived: 7 Infinity Fabric links x 76.8 GB/s per direction (AMD Instinct MI355X product page, 2025) = 537.6 GB/s per GPU, a line rate; {WHITEPAPER} prints the same All-to-All BW"
"scale_up.ep_dispatch_efficiency" = "derived: no measurement of an EP exchange on MI355X found; H800's measured fraction of its line rate (DeepEP dispatch at EP 8, 153 of 200 GB/s = 0.765, {DEEPEP_V1}) is taken, so that every 8-GPU domain is derated alike (docs/planner.md, rule 2)"
"scale_up.ep_combine_efficiency" = "derived: as the dispatch, H800's combine at EP 8, 158 of 200 GB/s = 0.79, {DEEPEP_V1}"
"scale_out.bw_gbps" = "assumption: one 400 Gb/s NIC per GPU (e.g. AMD Pensando Pollara 400 AI NIC, 2025) = 50 GB/s per direction, as in the whitepaper's MI300X cluster"
)toml"},
    // ---- NVIDIA ------------------------------------------------------------------------------------------
    {"a100",
     R"toml(name = "a100"
description = "NVIDIA A100 SXM4 80GB (400 W), DGX A100 node as in Selene: 8 GPUs on NVSwitch, 8 HDR 200 Gb/s InfiniBand NICs"
)toml",
     "\n[scale_up]\nbw_gbps = 300.0\n",
     R"toml("scale_up.bw_gbps" = "NVIDIA A100 Tensor Core GPU datasheet (2021), SXM: third-generation NVLink 600 GB/s bidirectional = 300 GB/s per direction"
)toml",
     kA100Figures, kA100Tiers, kA100Sources},
    {"a100_nccl",
     R"toml(name = "a100_nccl"
description = "NVIDIA A100 SXM4 80GB in a DGX A100 node (as a100), with the scale-up bandwidth FITTED to the public dense anchors: 200 GB/s (about a measured NCCL all-reduce bus bandwidth) instead of the NVLink line rate"
)toml",
     "\n[scale_up]\nbw_gbps = 200.0\n",
     R"toml("scale_up.bw_gbps" = "fitted: chosen after the public dense anchors' step times fell short at the 300 GB/s line rate, in the change that tightened their bound (docs/planner.md); no other entry takes a collective's bus bandwidth for its line rate. Its basis, not the anchors' own runs: NCCL all-reduce bus bandwidth of about 200 GB/s on eight A100-SXM4-80GB on NVSwitch (nccl-tests all_reduce_perf up to 1 GiB, NCCL 2.18; NVIDIA/nccl-tests issue 149, 2023), against 300 GB/s NVLink line rate per direction; NCCL's maintainer puts its protocol overhead on NVLink at about 20 % of line rate (NVIDIA/nccl-tests issue 212). nccl-tests' bus bandwidth is defined so that a ring all-reduce of S bytes over n GPUs takes 2 (n - 1) / n x S / busbw, the cost model's ring formula"
)toml",
     kA100Figures, kA100Tiers, kA100Sources},
    {"h100",
     R"toml(name = "h100"
description = "NVIDIA H100 SXM5 80GB (700 W), HGX/DGX H100 8-GPU NVSwitch node"
hbm_gb = 80.0
hbm_bw_gbps = 3350.0
peak_bf16_tflops = 989.5
peak_fp8_tflops = 1979.0
achievable_bf16_tflops = 794.5
achievable_fp8_tflops = 1402.6
)toml",
     kNvlink4Tiers,
     R"toml(hbm_gb = "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: 80 GB HBM3"
hbm_bw_gbps = "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: 3.35 TB/s"
peak_bf16_tflops = "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: 1979 TFLOPS BF16 with sparsity, halved for dense"
peak_fp8_tflops = "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: 3958 TFLOPS FP8 with sparsity, halved for dense"
achievable_bf16_tflops = "measured: 794.5 TFLOPS BF16 (torch 2.7, CUDA 12.6, best shape 2048x2048x13312), {MAMF}"
achievable_fp8_tflops = "measured: 1402.6 TFLOPS FP8 e4m3 (torch 2.7, CUDA 12.6), {MAMF}"
"scale_up.domain" = "NVIDIA DGX H100 datasheet (2023): 8 H100 GPUs per node on NVSwitch"
"scale_up.topology" = "NVIDIA DGX H100 datasheet (2023): 4th-generation NVSwitch, any pair at full NVLink bandwidth"
"scale_up.bw_gbps" = "NVIDIA H100 Tensor Core GPU datasheet (2023): NVLink 900 GB/s bidirectional = 450 GB/s per direction"
"scale_up.ep_dispatch_efficiency" = "derived: no measurement of an EP exchange on H100 found; H800's measured fraction of its line rate (DeepEP dispatch at EP 8, 153 of 200 GB/s = 0.765, {DEEPEP_V1}) is taken, so that every 8-GPU domain is derated alike (docs/planner.md, rule 2)"
"scale_up.ep_combine_efficiency" = "derived: as the dispatch, H800's combine at EP 8, 158 of 200 GB/s = 0.79, {DEEPEP_V1}"
"scale_out.bw_gbps" = "NVIDIA DGX H100 datasheet (2023): 8 ConnectX-7 400 Gb/s ports for the compute fabric, one per GPU = 50 GB/s per direction"
)toml",
     kSm90GemmShapeToml, "", kSm90GemmSource},
    {"h200",
     R"toml(name = "h200"
description = "NVIDIA H200 SXM 141GB (700 W), HGX/DGX H200 8-GPU NVSwitch node"
hbm_gb = 141.0
hbm_bw_gbps = 4800.0
peak_bf16_tflops = 989.5
peak_fp8_tflops = 1979.0
achievable_bf16_tflops = 794.5
achievable_fp8_tflops = 1453.4
)toml",
     kNvlink4Tiers,
     R"toml(hbm_gb = "NVIDIA H200 Tensor Core GPU product page/datasheet (2024), H200 SXM: 141 GB HBM3e"
hbm_bw_gbps = "NVIDIA H200 Tensor Core GPU product page/datasheet (2024), H200 SXM: 4.8 TB/s"
peak_bf16_tflops = "NVIDIA H200 datasheet (2024), H200 SXM: 1979 TFLOPS BF16 with sparsity, halved for dense"
peak_fp8_tflops = "NVIDIA H200 datasheet (2024), H200 SXM: 3958 TFLOPS FP8 with sparsity, halved for dense"
achievable_bf16_tflops = "measured on H100 SXM: 794.5 TFLOPS BF16; the table notes H200 is the same (same GH100 compute), {MAMF}"
achievable_fp8_tflops = "measured: 1453.4 TFLOPS FP8 e4m3 on H200 SXM (torch 2.7.1, CUDA 12.8), {MAMF}"
"scale_up.domain" = "NVIDIA DGX H200 datasheet (2024): 8 H200 GPUs per node on NVSwitch"
"scale_up.topology" = "NVIDIA DGX H200 datasheet (2024): NVSwitch, any pair at full NVLink bandwidth"
"scale_up.bw_gbps" = "NVIDIA H200 datasheet (2024): NVLink 900 GB/s bidirectional = 450 GB/s per direction"
"scale_up.ep_dispatch_efficiency" = "derived: no measurement of an EP exchange on H200 found; H800's measured fraction of its line rate (DeepEP dispatch at EP 8, 153 of 200 GB/s = 0.765, {DEEPEP_V1}) is taken, so that every 8-GPU domain is derated alike (docs/planner.md, rule 2)"
"scale_up.ep_combine_efficiency" = "derived: as the dispatch, H800's combine at EP 8, 158 of 200 GB/s = 0.79, {DEEPEP_V1}"
"scale_out.bw_gbps" = "NVIDIA DGX H200 datasheet (2024): 8 ConnectX-7 400 Gb/s ports for the compute fabric, one per GPU = 50 GB/s per direction"
)toml",
     kSm90GemmShapeToml, "", kSm90GemmSourceDerived},
    {"h800",
     R"toml(name = "h800"
description = "NVIDIA H800 SXM5 80GB: the H100 SXM with NVLink cut to 400 GB/s bidirectional, HGX 8-GPU NVSwitch node"
hbm_gb = 80.0
hbm_bw_gbps = 3350.0
peak_bf16_tflops = 989.5
peak_fp8_tflops = 1979.0
achievable_bf16_tflops = 794.5
achievable_fp8_tflops = 1402.6
)toml",
     R"toml(
[scale_up]
domain = 8
topology = "switch"
bw_gbps = 200.0
alpha_us = 3.0
ep_dispatch_efficiency = [[8.0, 0.765]]
ep_combine_efficiency = [[8.0, 0.79]]

[scale_out]
domain = 65536
topology = "switch"
bw_gbps = 50.0
alpha_us = 10.0
)toml",
     R"toml(hbm_gb = "NVIDIA H800 Tensor Core GPU datasheet (2023), H800 SXM: 80 GB HBM3 (as H100 SXM)"
hbm_bw_gbps = "NVIDIA H800 Tensor Core GPU datasheet (2023), H800 SXM: 3.35 TB/s (as H100 SXM)"
peak_bf16_tflops = "NVIDIA H800 Tensor Core GPU datasheet (2023), H800 SXM: 1979 TFLOPS BF16 with sparsity, halved for dense (the same GH100 compute as H100 SXM)"
peak_fp8_tflops = "NVIDIA H800 Tensor Core GPU datasheet (2023), H800 SXM: 3958 TFLOPS FP8 with sparsity, halved for dense"
achievable_bf16_tflops = "derived: no public GEMM maximum for H800; its dense BF16 peak and its GH100 compute equal H100 SXM's, so H100 SXM's measured 794.5 TFLOPS BF16 (torch 2.7, CUDA 12.6) is taken, {MAMF}"
achievable_fp8_tflops = "derived: no public GEMM maximum for H800; H100 SXM's measured 1402.6 TFLOPS FP8 e4m3 (same GH100 compute and FP8 peak) is taken, {MAMF}"
"scale_up.domain" = "NVIDIA H800 Tensor Core GPU datasheet (2023): HGX H800 systems of up to 8 GPUs on NVSwitch, as HGX H100; the DeepSeek-V3 report (arXiv 2412.19437, sec. 3.1) describes its H800 nodes likewise (8 GPUs on NVLink and NVSwitch), an input from the paper of the compared row ds-v3-01"
"scale_up.topology" = "NVSwitch as in HGX H100 (NVIDIA DGX H100 datasheet, 2023): any pair at the full NVLink bandwidth"
"scale_up.bw_gbps" = "NVIDIA H800 Tensor Core GPU datasheet (2023), H800 SXM: NVLink 400 GB/s bidirectional = 200 GB/s per direction, a line rate. The DeepSeek-V3 report (arXiv 2412.19437, sec. 3.2.2) states 160 GB/s for NVLink on its H800 cluster, 80 % of this line rate; not used: it is a delivered figure from the paper of the compared row ds-v3-01, and every sourced entry carries the line rate (docs/planner.md, rules 1 and 2)"
"scale_up.ep_dispatch_efficiency" = "measured: DeepEP's normal kernels at EP 8 inside an H800 node, dispatch 153 GB/s NVLink bottleneck bandwidth over the 200 GB/s line rate = 0.765, {DEEPEP_V1}"
"scale_up.ep_combine_efficiency" = "measured: the same, combine 158 GB/s over 200 = 0.79, {DEEPEP_V1}"
"scale_out.bw_gbps" = "400 Gb/s per GPU = 50 GB/s per direction, the 8 ConnectX-7 400 Gb/s compute ports of a DGX H100 (NVIDIA DGX H100 datasheet, 2023), as every Hopper entry; the DeepSeek-V3 report (arXiv 2412.19437, sec. 3.2.2) gives the same 50 GB/s InfiniBand per GPU for its H800 cluster, an input from the paper of the compared row ds-v3-01"
)toml",
     kSm90GemmShapeToml, "", kSm90GemmSourceDerived},
    {"b200",
     R"toml(name = "b200"
description = "NVIDIA B200 (1000 W), HGX/DGX B200 8-GPU NVLink 5 node"
hbm_gb = 180.0
hbm_bw_gbps = 8000.0
peak_bf16_tflops = 2250.0
peak_fp8_tflops = 4500.0
achievable_bf16_tflops = 1745.0
achievable_fp8_tflops = 3432.5
)toml",
     R"toml(
[scale_up]
domain = 8
topology = "switch"
bw_gbps = 900.0
alpha_us = 3.0
ep_dispatch_efficiency = [[8.0, 0.521]]
ep_combine_efficiency = [[8.0, 0.516]]

[scale_out]
domain = 65536
topology = "switch"
bw_gbps = 50.0
alpha_us = 10.0
)toml",
     R"toml(hbm_gb = "NVIDIA DGX B200 datasheet (2024): 1,440 GB GPU memory for 8 GPUs = 180 GB per GPU"
hbm_bw_gbps = "NVIDIA DGX B200 datasheet (2024): 64 TB/s HBM3e for 8 GPUs = 8 TB/s per GPU"
peak_bf16_tflops = "NVIDIA HGX B200 specifications (2024): 36 PFLOPS FP16/BF16 for 8 GPUs with sparsity = 2.25 PF dense per GPU"
peak_fp8_tflops = "NVIDIA HGX B200 specifications (2024): 72 PFLOPS FP8 for 8 GPUs with sparsity = 4.5 PF dense per GPU"
achievable_bf16_tflops = "measured: 1745 TFLOPS BF16 (torch 2.7.1, CUDA 12.8, best shape 1792x16128x3072), {MAMF}"
achievable_fp8_tflops = "measured: 3432.5 TFLOPS FP8 e4m3 (torch 2.7.1, CUDA 12.8), {MAMF}"
"scale_up.domain" = "NVIDIA DGX B200 datasheet (2024): 8 B200 GPUs per node on NVLink 5 switches"
"scale_up.topology" = "NVIDIA HGX B200 specifications (2024): NVLink Switch, any pair at full NVLink bandwidth"
"scale_up.bw_gbps" = "NVIDIA HGX B200 specifications (2024): NVLink 5 1.8 TB/s bidirectional per GPU = 900 GB/s per direction"
"scale_up.ep_dispatch_efficiency" = "measured: HybridEP on B200 at EP 8 with 16 SMs, BF16 dispatch 535.94 GB/s algorithm bandwidth through the Torch API, which counts the rank's own eighth, so 7/8 of it crosses NVLink: 469 GB/s over the 900 GB/s line rate = 0.521, {HYBRIDEP}"
"scale_up.ep_combine_efficiency" = "measured: the same, combine 530.86 GB/s, 7/8 of it over 900 = 0.516, {HYBRIDEP}"
"scale_out.bw_gbps" = "NVIDIA DGX B200 datasheet (2024): 8 single-port ConnectX-7 VPI 400 Gb/s for the compute fabric, one per GPU = 50 GB/s per direction"
)toml",
     kSm100GemmShapeToml, "", kSm100GemmSource},
    {"gb200",
     R"toml(name = "gb200"
description = "NVIDIA GB200 NVL72: 72 Blackwell GPUs in one NVLink 5 domain (rack scale)"
hbm_gb = 186.0
hbm_bw_gbps = 8000.0
peak_bf16_tflops = 2500.0
peak_fp8_tflops = 5000.0
achievable_bf16_tflops = 1822.0
achievable_fp8_tflops = 3615.6
)toml",
     R"toml(
[scale_up]
domain = 72
topology = "switch"
bw_gbps = 900.0
alpha_us = 3.0
ep_dispatch_efficiency = [[8.0, 0.535], [16.0, 0.493], [24.0, 0.471], [32.0, 0.523], [36.0, 0.508]]
ep_combine_efficiency = [[8.0, 0.523], [16.0, 0.494], [24.0, 0.473], [32.0, 0.456], [36.0, 0.452]]

[scale_out]
domain = 65536
topology = "switch"
bw_gbps = 50.0
alpha_us = 10.0
)toml",
     R"toml(hbm_gb = "NVIDIA GB200 NVL72 specifications (2024): up to 13.4 TB HBM3e for 72 GPUs = 186 GB per GPU"
hbm_bw_gbps = "NVIDIA GB200 NVL72 specifications (2024): 576 TB/s for 72 GPUs = 8 TB/s per GPU"
peak_bf16_tflops = "NVIDIA GB200 NVL72 specifications (2024): 360 PFLOPS FP16/BF16 for 72 GPUs with sparsity = 2.5 PF dense per GPU"
peak_fp8_tflops = "NVIDIA GB200 NVL72 specifications (2024): 720 PFLOPS FP8 for 72 GPUs with sparsity = 5 PF dense per GPU"
achievable_bf16_tflops = "measured: 1822 TFLOPS BF16 on a GB200 GPU (torch 2.10 nightly, CUDA 13.0, best shape 4096x9728x2048), {MAMF}"
achievable_fp8_tflops = "measured: 3615.6 TFLOPS FP8 e4m3 on a GB200 GPU (torch 2.10 nightly, CUDA 13.0), {MAMF}"
"scale_up.domain" = "NVIDIA GB200 NVL72 specifications (2024): 72 GPUs in one NVLink domain"
"scale_up.topology" = "NVIDIA GB200 NVL72 specifications (2024): NVLink Switch trays, any pair of the 72 at full NVLink bandwidth"
"scale_up.bw_gbps" = "NVIDIA GB200 NVL72 specifications (2024): 130 TB/s NVLink for 72 GPUs = 1.8 TB/s bidirectional per GPU = 900 GB/s per direction"
"scale_up.ep_dispatch_efficiency" = "measured: HybridEP on GB200 at EP 8, 16, 24, 32 and 36 with 16 SMs, BF16 dispatch 550.10, 472.84, 441.89, 485.50 and 469.96 GB/s algorithm bandwidth through the Torch API; (n - 1) / n of it leaves the rank: over the 900 GB/s line rate 0.535, 0.493, 0.471, 0.523, 0.508, {HYBRIDEP}; beyond 36 ranks the EP 36 figure (no wider measurement). DeepEP on the same machine at EP 32 reached about 400 / 190 GB/s, {MLM_GB200}"
"scale_up.ep_combine_efficiency" = "measured: the same runs' combine, 538.44, 474.48, 444.40, 423.19 and 418.27 GB/s: 0.523, 0.494, 0.473, 0.456, 0.452, {HYBRIDEP}"
"scale_out.bw_gbps" = "NVIDIA DGX SuperPOD reference architecture with DGX GB200 (2024): one ConnectX-7 400 Gb/s InfiniBand port per GPU for the compute fabric = 50 GB/s per direction"
)toml",
     kSm100GemmShapeToml, "", kSm100GemmSourceDerived},
    {"gb300",
     R"toml(name = "gb300"
description = "NVIDIA GB300 NVL72: 72 Blackwell Ultra GPUs in one NVLink 5 domain (rack scale), one ConnectX-8 800 Gb/s NIC per GPU"
hbm_gb = 277.8
hbm_bw_gbps = 8000.0
peak_bf16_tflops = 2500.0
peak_fp8_tflops = 5000.0
achievable_bf16_tflops = 1822.0
achievable_fp8_tflops = 3615.6
)toml",
     R"toml(
[scale_up]
domain = 72
topology = "switch"
bw_gbps = 900.0
alpha_us = 3.0
ep_dispatch_efficiency = [[8.0, 0.535], [16.0, 0.493], [24.0, 0.471], [32.0, 0.523], [36.0, 0.508]]
ep_combine_efficiency = [[8.0, 0.523], [16.0, 0.494], [24.0, 0.473], [32.0, 0.456], [36.0, 0.452]]

[scale_out]
domain = 65536
topology = "switch"
bw_gbps = 100.0
alpha_us = 10.0
)toml",
     R"toml(hbm_gb = "20 TB HBM3e for 72 GPUs = 277.8 GB per GPU: GB300 NVL72 as advertised by NVIDIA ({LOCKWOOD}: '20 TB HBM at 576 TB/s'; {VERDA}, rack table: 20 TB); the 288 GB Blackwell Ultra package less what the system reserves, as GB200's 186 of 192; {VERDA} lists 279 GB per GPU"
hbm_bw_gbps = "576 TB/s HBM3e for 72 GPUs = 8 TB/s per GPU: {LOCKWOOD}; {VERDA}, rack and per-GPU tables"
peak_bf16_tflops = "2500 TFLOPS dense BF16 per GPU (GB200's figure; Blackwell Ultra raises FP4, not BF16): {MAMF_PEAK}, from the NVIDIA GB300 NVL72 specifications; {VERDA}: 180 PFLOPS dense FP16/BF16 for 72 GPUs"
peak_fp8_tflops = "5000 TFLOPS dense FP8 per GPU: {MAMF_PEAK}, from the NVIDIA GB300 NVL72 specifications; {VERDA}: 360 PFLOPS dense FP8 for 72 GPUs; {LOCKWOOD}: '360 PF FP8 for training'"
achievable_bf16_tflops = "derived: no public GEMM maximum for GB300; its dense BF16 peak equals GB200's, so GB200's measured 1822 TFLOPS BF16 (torch 2.10 nightly, CUDA 13.0) is taken, {MAMF}; a B300 SXM (the same Blackwell Ultra die, HGX, 2250 peak) measured 1769.0 in the same table"
achievable_fp8_tflops = "derived: no public GEMM maximum for GB300; its dense FP8 peak equals GB200's, so GB200's measured 3615.6 TFLOPS FP8 e4m3 is taken, {MAMF}; a B300 SXM measured 3353.3 in the same table"
"scale_up.domain" = "72 Blackwell Ultra GPUs (and 36 Grace CPUs) in one NVLink domain: {LOCKWOOD}; {VERDA}"
"scale_up.topology" = "NVLink Switch trays (18 NVLink switches, {LOCKWOOD}), any pair of the 72 at full NVLink bandwidth, as GB200 NVL72"
"scale_up.bw_gbps" = "130 TB/s NVLink for 72 GPUs = 1.8 TB/s bidirectional per GPU = 900 GB/s per direction (fifth-generation NVLink, as GB200): {LOCKWOOD}; {VERDA}"
"scale_up.ep_dispatch_efficiency" = "derived: GB200 NVL72's HybridEP measurement (the same fifth-generation NVLink domain; no GB300 measurement found), {HYBRIDEP}"
"scale_up.ep_combine_efficiency" = "derived: GB200 NVL72's HybridEP combine, {HYBRIDEP}"
"scale_out.bw_gbps" = "one ConnectX-8 SuperNIC per GPU (72 for the 72 GPUs, {LOCKWOOD}) at 800 Gb/s (NVIDIA InfiniBand adapters page: 'up to 800 Gb/s' for ConnectX-8) = 100 GB/s per direction"
)toml",
     kSm100GemmShapeToml, "", kSm100GemmSourceDerived},
};

std::string expand(std::string s) {
  const std::pair<const char*, const char*> subs[] = {
      {"{WHITEPAPER}", kWhitepaper}, {"{AMD_MAF}", kAmdMaf}, {"{MAMF}", kMamf}, {"{MAMF_PEAK}", kMamfPeak},
      {"{LOCKWOOD}", kLockwood},     {"{VERDA}", kVerda},   {"{DEEPEP_V1}", kDeepEpV1},
      {"{HYBRIDEP}", kHybridEp},   {"{MLM_GB200}", kMlmGb200},   {"{XLA_GEMM}", kXlaGemm}};
  for (const auto& [token, text] : subs)
    for (size_t at = s.find(token); at != std::string::npos; at = s.find(token, at))
      s.replace(at, std::strlen(token), text);
  return s;
}

const std::map<std::string, std::string, std::less<>>& texts() {
  static const auto* m = [] {
    auto* out = new std::map<std::string, std::string, std::less<>>;
    for (const auto& e : kEntries)
      (*out)[e.name] =
          std::string(e.head) + e.shared_head + kSharedTop + e.tiers + e.shared_tiers + "\n[sources]\n" +
          expand(std::string(e.sources) + e.shared_sources) + kSharedSources;
    return out;
  }();
  return *m;
}

[[noreturn]] void unknown_entry(std::string_view name) {
  std::string msg = "unknown hardware '" + std::string(name) + "'; the catalog has: ";
  const auto& names = catalog_names();
  for (size_t i = 0; i < names.size(); ++i) msg += (i ? ", " : "") + names[i];
  msg += " (or pass a path to a TOML file: anything containing '/' or ending in .toml; docs/hardware.md)";
  throw Error(msg);
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  return out;
}

}  // namespace

const std::vector<std::string>& catalog_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& e : kEntries) v.push_back(e.name);
    return v;
  }();
  return names;
}

std::string_view catalog_toml(std::string_view name) {
  const auto& m = texts();
  auto it = m.find(lower(name));
  if (it == m.end()) unknown_entry(name);
  return it->second;
}

Hardware catalog_hardware(std::string_view name) {
  const std::string key = lower(name);
  const std::string source = "catalog entry '" + key + "'";
  Hardware h = hardware_from_toml(catalog_toml(key), source);
  validate_hardware(h, source);
  return h;
}

}  // namespace moetron::plan
