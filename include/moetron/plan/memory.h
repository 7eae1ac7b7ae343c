// plan/memory.h: the memory projection of a job's layout on a GPU: per pipeline rank (ranks of one stage
// hold the same), parameters, gradients, main parameters, optimizer state, activations by module, comm
// buffers and workspace, with a FITS / AT-RISK / OOM verdict against HBM. Parameters and activations come from
// the shared accounting (accounting.h); in-flight micro-batches from the schedule simulator (plan/pipeline.h).
// Not a step-time model (plan/cost.h).
//
// Precision recipes (bytes per element):
//   megatron  bf16 parameters (2), fp32 gradients (4, Megatron's main_grad buffer), fp32 main parameters (4)
//             and two fp32 Adam moments (4 + 4); the default, with the distributed optimizer (zero 1)
//   engine    moetron's own: fp32 parameters (4) plus their compute-dtype copy (2 under bf16) and the packed
//             expert weights (two layouts in the compute dtype), fp32 grads, no separate main copy, fp32
//             moments, fp32 activations; used when comparing with the engine (`plan validate`)
// Sharding: zero >= 1 shards main parameters and moments over the data-parallel group (dense parameters over
// dp x cp, routed experts over the expert data-parallel group edp); zero >= 2 shards gradients too; zero 3
// shards parameters and holds two gathered units (the current layer and the prefetched one). HSDP (zero 3 with
// dp_shard < dp): parameters, gradients, main parameters and moments are all sharded over dp_shard (x cp; the
// experts over edp x dp_shard / dp) and replicated over dp / dp_shard, as the engine does.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "moetron/config.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"

namespace moetron::plan {

struct Recipe {
  std::string name = "megatron";
  double param = 2, grad = 4, main = 4, moment = 4;  // bytes per element; `moment` per moment (two of them)
  double compute_copy = 0;                            // engine: the compute-dtype copy of the parameters
  double expert_packed = 0;  // engine: routed-expert weights packed for the grouped GEMMs (two layouts)
  // Activation element bytes: 0 = the GPU convention (bf16 activations; GEMM inputs 2 B, 1 B under FP8);
  // the engine keeps fp32 activations (4) and GEMM inputs in its compute dtype.
  double act_bytes = 0, gemm_bytes = 0;
  bool engine_buffers = false;  // engine: the buffers beside the term list (accounting.h engine_activation_extras)
};
// "megatron" or "engine" (the latter reads training.compute_dtype); throws naming the known recipes.
Recipe recipe_named(const std::string& name, const JobConfig& c);

struct PlanOptions {
  Recipe recipe;
  bool fused_loss = true;  // the fused head + cross-entropy (no logits kept)
  double margin = 0.10;    // AT-RISK above (1 - margin) x HBM: allocator fragmentation, runtime context
  bool detail = true;      // activations by module (the search's first pass leaves them out)
  // Routing imbalance: the routed rows of the busiest expert-parallel rank over the balanced count (tokens x topk),
  // >= 1. The routed-expert activations, the EP dispatch buffers and the experts' time scale by it (1 = balanced).
  double ep_imbalance = 1.0;
};
// The [activation_checkpoint] section a layout plans with: the config's layer / stage choices, the layout's mode
// and modules (resolve_checkpointing when stages are named).
ActivationCheckpointSpec plan_checkpointing(const JobConfig& c, const Layout& l);

struct RankMemory {
  int64_t rank = 0;                  // pipeline rank
  std::vector<int> stages;           // its stages
  int64_t layers = 0;
  // Parameter elements on one GPU of this pipeline rank, by divisor.
  double params_tp_sharded = 0, params_replicated = 0, params_experts = 0;
  double optimizer_elements = 0;     // the parameter elements this GPU's optimizer updates (its ZeRO shard)
  double params = 0, grads = 0, main_params = 0, optimizer = 0, activations = 0, buffers = 0, workspace = 0;
  double total() const { return params + grads + main_params + optimizer + activations + buffers + workspace; }
  int inflight_sets = 0;             // peak (stage, micro-batch) activation sets held
  double act_per_microbatch = 0;     // bytes of all this rank's stages for one micro-batch
  std::vector<std::pair<std::string, double>> act_by_module;  // at the peak, by module
  std::vector<std::pair<std::string, double>> buffers_by_kind;
};

struct MemoryPlan {
  Layout layout;
  std::string hardware;
  double hbm = 0, margin = 0;
  std::vector<RankMemory> per_rank;
  double max_total = 0;
  int64_t worst_rank = 0;
  std::string verdict;  // FITS, AT-RISK or OOM
};

struct StagePlan;
// `stages`: the layout's stage plan when the caller has it (plan/pipeline.h stage_plan; the search keeps them).
MemoryPlan plan_memory(const JobConfig& c, const Layout& l, const Hardware& h, const PlanOptions& o,
                       const StagePlan* stages = nullptr);
std::string verdict_for(double bytes, double hbm, double margin);
nlohmann::json to_json(const MemoryPlan& m);
std::string format_memory(const MemoryPlan& m);

}  // namespace moetron::plan
