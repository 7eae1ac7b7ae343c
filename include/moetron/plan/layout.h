// plan/layout.h: one candidate parallel layout of a job on a GPU cluster, as the planner sees it, and the
// rules a layout must obey (each broken rule named by its key). The same [parallelism] keys the engine reads,
// plus tp, cp and expert_tp; dp is what the world leaves. Not a cost model: plan/memory.h and plan/cost.h
// price a layout.
//
// Rank order (outermost first): pp, dp, cp, tp -- tp innermost so a TP group stays inside one scale-up
// domain; the expert groups fold ep x expert_tp over the same tp x cp x dp ranks (Megatron's rule), ep
// innermost after expert_tp.
#pragma once
#include <cstdint>
#include <string>

#include "moetron/accounting.h"
#include "moetron/config.h"

namespace moetron::plan {

struct Layout {
  int64_t tp = 1, cp = 1, pp = 1, vpp = 1, dp = 1, ep = 1, etp = 1;
  bool sp = true;                       // sequence parallelism with tp (Megatron's --sequence-parallel)
  std::string schedule = "1f1b";
  bool ep_overlap = false;
  bool ep_overlap_split = false;        // unpaired chunks split in two overlapped halves (needs ep_overlap)
  int64_t zero = 1;                     // 0, 1 (distributed optimizer), 2, 3 (FSDP)
  int64_t dp_shard = 0;                 // zero 3: ranks a parameter is sharded over (0 = all of dp; < dp = HSDP)
  AcMode recompute = AcMode::None;
  std::vector<std::string> recompute_modules;  // selective
  int64_t recompute_layers = -1;        // layers per stage that recompute (-1 = all), Megatron's num_layers
  int64_t mbs = 1;                      // micro-batch size (sequences)
  int64_t microbatches = 1;             // per optimizer step per pipeline
  int64_t world() const { return tp * cp * pp * dp; }
  int64_t edp() const { return tp * cp * dp / (ep * etp); }  // expert data parallel
  // How the layout divides a layer's activations (accounting.h): tp, sequence parallelism (only with tp > 1),
  // cp, expert tp.
  ActShard shard() const { return {tp, sp && tp > 1, cp, etp}; }
  // Tokens of one micro-batch on one rank before the sequence-parallel split (cp divides the sequence).
  double tokens_per_rank(int64_t seq_len) const { return double(mbs) * double(seq_len) / double(cp); }
  std::string describe() const;         // "tp1 cp2 pp24 vpp1 ep8 etp1 dp16 zero1 1f1b mbs1 ac=none"
};

// The job's layout on `world` GPUs: the [parallelism] keys, dp = world / (tp cp pp), micro-batches from the
// global batch. Throws moetron::Error naming the key for a world that is not a multiple of tp x cp x pp, a
// global batch that does not split, a dp_replicate x dp_shard that disagrees with the world, ...
// distributed_optimizer: parallelism.zero = 0 is planned as 1 (Megatron's distributed optimizer, the planner's
// default; `--no-distributed-optimizer` keeps 0).
Layout layout_from_config(const JobConfig& c, int64_t world, bool distributed_optimizer = true);
// The rules, for a layout built any way (the search builds them directly). Returns "" when the layout can
// run, else the first broken rule, e.g. "parallelism.tp = 3 must divide model.n_heads (128)".
std::string layout_error(const JobConfig& c, const Layout& l, int64_t global_batch_seqs);
// The config with this layout written into its keys (dp as dp_shard for zero 3, else dp_replicate) and the
// pipeline resolved (resolve_pipeline then sees the planner's dp).
JobConfig apply_layout(const JobConfig& c, const Layout& l);

}  // namespace moetron::plan
