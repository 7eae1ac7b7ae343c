// calib_round.h: what one round of `moetron plan calibrate` measured on this machine, as plain figures (seconds,
// FLOP/s, bytes) before any fit. The engine's side fills it (calib_measure.h: its own kernels and Comm, timed);
// the planner's side turns rounds into a Hardware (plan/calibrate.h: curves, medians over rounds, the alpha-beta
// fit, the TOML's comments). Data only: no code, no library, so either side and the planner's tests (hand-made
// rounds) include it without linking the other.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moetron::calib {

// A dense GEMM's rate at a row count (FLOP/s in the compute dtype, at a full share of the cores).
struct GemmRate {
  int64_t m = 0;
  double flops_per_s = 0;
};

// The routed experts' grouped GEMMs (gate_up then down) at some tokens per expert: the forward's FLOPs and the
// seconds of the forward and of the backward (dgrad + wgrad: twice the forward's FLOPs).
struct GroupedTime {
  int64_t tokens_per_expert = 0;
  double flops_fwd = 0, fwd_s = 0, bwd_s = 0;
};

// Causal attention, forward + backward, at a sequence length: the forward's FLOPs and the seconds of both.
struct AttentionTime {
  int64_t seq_len = 0;
  double flops_fwd = 0, seconds = 0;
};

// A memory-bound layer kernel family, forward + backward: the bytes the cost model counts for its forward and
// the seconds of both.
struct MemoryKernel {
  std::string name;
  double bytes_fwd = 0, seconds = 0;
};

// The ranks' drift over a segment of the same compute between two synchronizing collectives: the segment's mean
// seconds over the ranks and the slowest rank's excess over that mean, as a fraction of it.
struct SkewPoint {
  double segment_s = 0, excess = 0;
};

// One pass over every figure. Every time is the slowest rank's, scaled to a full share of its cores.
struct Round {
  // Where and how it was measured.
  std::string cpu;             // /proc/cpuinfo's model name ("" when unknown)
  int ranks = 1;               // ranks measuring at once
  int local_ranks = 1;         // of them on this node (the node's memory is shared by these)
  int threads = 1;             // threads per rank (the engine's count)
  bool bf16 = false;           // compute dtype: bf16, else fp32
  double mem_total_bytes = 0;  // the node's MemTotal
  double cpu_share = 1;        // the smallest share of its cores a rank received (1 = no other process took them)

  // Dense GEMMs: the reference cube (big x big x big) each time it was measured, the first being the base every
  // curve point is taken against; skinny GEMMs m x big/2 x big/2 with the weight read cold, ascending m; and
  // one of them (check_m rows) with the weight cold and hot in the caches.
  int64_t big = 0;
  std::vector<double> reference;
  std::vector<GemmRate> skinny;
  int64_t check_m = 0;
  double check_cold = 0, check_hot = 0;  // FLOP/s
  double fp32_cube = 0;                  // FLOP/s of the reference cube in fp32 (gemm_f32: Muon's Newton-Schulz)

  std::vector<GroupedTime> grouped;      // ascending tokens per expert
  double kernel_overhead_s = 0;          // the smallest GEMM (8 x 8 x 8)
  std::vector<AttentionTime> attention;  // ascending sequence length
  double loss_flops = 0, loss_s = 0;     // the fused head + loss, forward and backward (6 N V d FLOPs)
  std::vector<MemoryKernel> memory_bound;

  // Per parameter element (fp32): AdamW, the gradient norm and zeroing over optimizer_params elements; the
  // experts' re-packing (forward and dgrad layouts) over pack_params elements: alone (pack_s, the masters read from
  // memory) and fused with AdamW piece by piece as Model::update_and_sync runs it (pack_fused_s: the fused pass's
  // time beyond AdamW's alone over the same masters; 0 when not measured).
  double optimizer_params = 0, adamw_s = 0, grad_norm_s = 0, zero_s = 0;
  double pack_params = 0, pack_s = 0, pack_fused_s = 0;
  double copy_bytes = 0, copy_s = 0;  // a memcpy of copy_bytes (read and written)

  // Messages, with two ranks or more (else zero): ping-pong round trips between ranks 0 and 1 at two sizes,
  // back-to-back all-reduces (seconds per segment of all_reduce_elements fp32 elements) and an all-to-all.
  double pingpong_small_bytes = 0, pingpong_small_s = 0;
  double pingpong_large_bytes = 0, pingpong_large_s = 0;
  double all_reduce_elements = 0, all_reduce_s = 0;
  // The same segments as an all-gather (all_reduce_elements fp32 elements out) and a reduce-scatter (that many in),
  // seconds per segment: ZeRO-1's and FSDP's gathers and scatters and sequence parallelism's go through these calls.
  double all_gather_s = 0, reduce_scatter_s = 0;
  double all_to_all_bytes = 0, all_to_all_s = 0;
  std::vector<SkewPoint> skew;  // ascending segment length (measure_skew)
  // A blocking exchange whose partner comes late (measure_wait_overshoot): how much later than an exchange entered
  // together it returns on the late rank, seconds (the early rank's waits sleep between tests: comm.mpi_wait).
  double wait_overshoot_s = 0;
};

}  // namespace moetron::calib
