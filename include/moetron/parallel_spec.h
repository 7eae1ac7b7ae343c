// parallel_spec.h: ParallelSpec, the [parallelism] section of the job config (tp, cp, dp, ep, pp, the EP
// dispatcher, the pipeline keys), on its own so that the device mesh (mesh.h) and other parallel code read it
// without the whole job config.
// Not the loading or validation of the keys (config.h, src/job/config*.cpp) and not the mesh built from it
// (mesh.h).
#pragma once
#include <cstdint>
#include <string>

#include "moetron/job_enums.h"

namespace moetron {

struct ParallelSpec {
  // Tensor and context parallelism (docs/parallel.md): tp shards attention heads, FFN widths and the vocabulary
  // (with sequence parallelism the norm / residual regions shard the micro-batch's rows over tp too; the engine runs
  // only that form); cp shards every sequence into load-balanced chunks (ring attention); expert_tp shards each
  // routed expert's FFN width (the engine: expert_tp = tp on a MoE model). The planner carves expert groups
  // (ep x expert_tp) out of tp x cp x dp, Megatron's rule; the engine carves ep out of dp x cp within a tp index.
  int64_t tp = 1;
  int64_t cp = 1;
  int64_t expert_tp = 1;
  bool sequence_parallel = true;
  int64_t dp_replicate = 1;
  int64_t dp_shard = 1;
  int64_t ep = 1;
  int64_t pp = 1;  // pipeline ranks (the pp_* keys: resolve_pipeline)
  int64_t ranks_per_node = 8;
  EpDispatcher ep_dispatcher = EpDispatcher::AllToAll;
  EpTransport ep_transport = EpTransport::Mpi;  // shm: alltoall / sync_free rows through shared memory (one node)
  bool fp8_dispatch = false;
  int64_t zero = 0;  // 0, 1, 2 (planner only: gradients sharded too) or 3
  // Pipeline (schedule.h, pp_layout.h). pp_schedule names the generator: gpipe, 1f1b, interleaved_1f1b, zb1p,
  // zbv or dualpipev. pp_schedule_csv (a path) replaces the generator by a user's schedule.
  std::string pp_schedule = "1f1b";
  int64_t pp_virtual_stages = 0;  // stages per rank; 0 = from pp_layout or the CSV, else the schedule's default
  int64_t pp_microbatches = 0;    // per optimizer step; 0 = global_batch_size / (micro_batch_size * dp)
  std::string pp_layout;          // Megatron's grammar, e.g. "Et*3|t*4|t*4|t*2L"; "" = even split
  std::string pp_schedule_csv;
  int64_t pp_first_stage_less_layers = 0;  // even split: layer-equivalents the embedding counts for
  int64_t pp_last_stage_less_layers = 0;   // even split: layer-equivalents the head + loss count for
  // The 1F1B all-to-all overlap (interleaved_1f1b with EP): one more warm-up forward, then each steady-state
  // forward / backward pair runs at once on two threads, so one micro-batch's EP dispatch / combine proceeds
  // while the other computes (schedule.h GenSpec::ep_overlap; docs/pipeline.md).
  bool ep_overlap = false;
  // Planner only (the engine refuses it): under ep_overlap, the warm-up and cool-down chunks that run unpaired
  // are split into two half micro-batches whose compute and all-to-all alternate (DeepEP-style two-micro-batch
  // overlap), so half of one chunk's exchange runs under the other half's compute (docs/planner.md, Step time).
  bool ep_overlap_split = false;
  // How ep_overlap's two lanes run (the engine reads these only with ep_overlap = true; docs/pipeline.md). None
  // changes what is computed: every choice is bitwise the plain interleaved run; they change what overlaps what.
  // ep_pair_backward: a fused pair's backward half as "b" (one full backward, layer by layer), "iw" (its input
  // half, then its weight half), "iwfill" (iw, and the backward lane runs its recorded weight gradients while it
  // waits in an exchange and the other lane does not compute), "iwcarry" (every backward, paired or alone, carries
  // its weight gradients into later exchange waits on either lane) or "auto" (iwcarry where the engine can fill,
  // i.e. ep_baton = "free" and no [quantize], else b). The planner reads it too: auto projects both iwcarry and b
  // and keeps the faster, iwcarry carries, b / iw / iwfill do not (docs/planner.md, Carried weight gradients).
  std::string ep_pair_backward = "auto";
  // ep_baton: which lane computes. "free": whichever lane is ready; "turn": strict turns, lane 0 first, the same
  // order of compute segments on every EP rank (kept for comparison; iwfill and iwcarry need "free").
  std::string ep_baton = "free";
  // ep_link: "shared" lets both lanes' exchanges be in flight at once; "paced" holds a lane's exchange until the
  // other lane's has completed (one exchange at a time per rank); needs ep_baton = "turn".
  std::string ep_link = "shared";
  bool pair_fills() const { return ep_pair_backward == "iwfill" || ep_pair_backward == "iwcarry"; }
  int64_t dp() const { return dp_replicate * dp_shard; }
  int64_t world_size() const { return tp * cp * dp() * pp; }
  bool operator==(const ParallelSpec&) const = default;
};

}  // namespace moetron
