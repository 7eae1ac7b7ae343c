// memcheck.h: what keeps absurd or too-big jobs out before anything is allocated.
//   - Size limits of a JobConfig's non-model keys and of the products they form (check_size_limits,
//     called by JobConfig::validate; the model's own limits are in ModelSpec::validate). docs/model.md,
//     "Size limits".
//   - The start-up memory check: the accounting's per-rank estimate (estimate_memory, accounting.h)
//     against the memory this node has for each of its ranks, run by the trainer before it allocates
//     anything; an impossible job is rejected with both numbers and the config keys that drive the need.
// Not an allocator and not a planner: it answers yes or no and says why.
//
// Available memory = the smaller of /proc/meminfo MemAvailable and the cgroup's limit minus its usage
// (v2 memory.max - memory.current, or v1 memory.limit_in_bytes - memory.usage_in_bytes, over the
// process's cgroup and its ancestors), divided by the ranks on this node. `[training] memory_check = false`
// skips the check (docs/model.md).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "moetron/accounting.h"
#include "moetron/config.h"

namespace moetron {

// Throws moetron::Error "invalid config: <key> = <value>: must be <= 2^n = ... (size limit)" for the first
// key above its limit: training sizes and steps, parallel sizes, threads, hardware counts; then the
// products: dp_replicate * dp_shard, micro-batches per rank per step, routed rows of one micro-batch
// (< 2^31: the engine indexes them with int32) and the saved activations of one micro-batch (fp32, no
// checkpointing, in double; <= 2^56 bytes, so every int64 figure of the accounting fits). Values that are
// not positive are left to the other rules of JobConfig::validate. Expects c.model already validated.
void check_size_limits(const JobConfig& c);

// Memory the OS reports for this process's node.
struct NodeMemory {
  int64_t mem_available = -1;  // /proc/meminfo MemAvailable, bytes (-1 = unknown)
  int64_t cgroup_free = -1;    // cgroup limit minus usage, bytes (-1 = no limit found)
  std::string cgroup_file;     // the limit's file, for messages
  // The smaller of the known figures; -1 when neither is known.
  int64_t available() const;
  // e.g. "MemAvailable 21.6 GiB, cgroup /sys/fs/cgroup/job/memory.max minus usage 8.0 GiB"
  std::string describe() const;
};

// Reads /proc/meminfo and the process's cgroup (/proc/self/cgroup). A limit of "max" (v2) or >= 2^62
// (v1) is no limit. `root` prefixes every path, so tests can hand in a fake tree.
NodeMemory read_node_memory(const std::string& root = "");

// The reader check_job_memory uses. Tests inject one (a function returning the bytes they want);
// set_node_memory_reader returns the previous reader, and an empty one restores read_node_memory.
using NodeMemoryReader = std::function<NodeMemory()>;
NodeMemoryReader set_node_memory_reader(NodeMemoryReader reader);

// Throws moetron::Error when est.peak() is above node.available() / ranks_on_node. The message gives
// needed and available per rank in GiB, the largest categories, and the keys (with values) behind them.
// Does nothing when the available memory is unknown.
void check_memory(const JobConfig& c, const MemoryEstimate& est, const NodeMemory& node, int ranks_on_node);

// The trainer's start-up call: nothing when training.memory_check is false; otherwise
// estimate_memory(c, compute_bytes, threads) against the current reader's figures. compute_bytes is the
// element size of GEMM inputs (2 = bf16, 4 = fp32); threads, the OpenMP threads of one rank.
void check_job_memory(const JobConfig& c, int ranks_on_node, int64_t compute_bytes, int threads);

}  // namespace moetron
