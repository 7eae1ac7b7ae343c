// mesh.h: the device mesh. From a ParallelSpec and the world size: the dimensions (pp, dp_replicate,
// dp_shard, cp, tp) with expert parallelism carved out of data parallelism, the rank <-> coordinate mapping,
// the node layout, validation with errors that name the rule, and the sub-communicators.
// Not a scheduler and not the sharding of tensors (DP/ZeRO, TP, CP and pipeline code use the groups made here).
//
// Rank order (row-major, pp outermost, tp innermost):
//   rank = (((pp_idx * dp_replicate + rep_idx) * dp_shard + shard_idx) * cp + cp_idx) * tp + tp_idx
//   dp_idx = rep_idx * dp_shard + shard_idx                       in [0, dp),  dp = dp_replicate * dp_shard
// tp is innermost because its collectives run in every layer (twice per block each way): its ranks are
// adjacent, so they share a node whenever tp divides ranks_per_node. cp comes next (one ring exchange per
// attention layer), then data parallelism (once per step), then pp (point-to-point between stages).
// Expert parallelism splits the data x context index dc = dp_idx * cp + cp_idx (ep must divide dp * cp; edp =
// dp * cp / ep is the expert-data-parallel size): the MoE layers run on each rank's own tokens, and under CP a
// rank's tokens are its share of the sequences, so CP ranks are data ranks to the experts (Megatron's folding):
//   ep_idx = dc % ep,  edp_idx = dc / ep
// within one tp_idx (under TP each rank's experts hold its 1/tp of every expert's width: expert_tp = tp), so an EP
// group's ranks are tp apart.
// With tp = cp = 1 the EP ranks of a group are CONTIGUOUS and sit within one node whenever ep <= ranks_per_node
// and ranks_per_node % ep == 0. The EDP group of a rank (the ranks that hold the same experts and all-reduce
// their gradients) has stride ep * cp * tp.
// Nodes: node = rank / ranks_per_node, local_rank = rank % ranks_per_node. A world smaller than one node
// is one node (ranks_per_node is then taken as world_size).
// Groups (each ordered by its own index, which is the rank within the sub-communicator):
//   dp           same pp, cp, tp;                  index dp_idx       (size dp)
//   dp_shard     same pp, rep, cp, tp;             index shard_idx    (size dp_shard)
//   dp_replicate same pp, shard, cp, tp;           index rep_idx      (size dp_replicate)
//   ep           same pp, edp, tp;                 index ep_idx       (size ep)
//   edp          same pp, ep, tp;                  index edp_idx      (size dp * cp / ep)
//   cp           same pp, dp, tp;                  index cp_idx       (size cp)
//   tp           same pp, dp, cp;                  index tp_idx       (size tp)
//   dp_cp        same pp, tp;                      index dp_idx*cp+cp (size dp * cp: where dense gradients are summed)
//   pp           same dp, cp, tp;                  index pp_idx       (size pp)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/parallel_spec.h"

namespace moetron {

struct MeshCoord {
  int rank = 0;
  int pp = 0, dp = 0, dp_replicate = 0, dp_shard = 0, cp = 0, tp = 0;
  int ep = 0, edp = 0;
  int node = 0, local_rank = 0;
};

enum class MeshGroup : uint8_t { Dp, DpShard, DpReplicate, Ep, Edp, Pp, Cp, Tp, DpCp };

class DeviceMesh {
 public:
  // Validates; throws moetron::Error naming the rule and the values:
  //   world_size >= 1 and every dimension >= 1;  world_size == pp * dp_replicate * dp_shard * cp * tp;
  //   dp % ep == 0;  n_routed_experts % ep == 0 (n_routed_experts = -1: unknown, not checked;
  //   0: a dense model, which allows only ep == 1);  ranks_per_node >= 1 and, when world_size >
  //   ranks_per_node, world_size % ranks_per_node == 0;  with ep_dispatcher = hierarchical the EP group must
  //   cover whole nodes or lie inside one: ep % rpn == 0 or rpn % ep == 0 (rpn = effective ranks_per_node).
  DeviceMesh(const ParallelSpec& spec, int world_size, int64_t n_routed_experts = -1);

  int world_size() const { return world_; }
  int pp() const { return pp_; }
  int dp() const { return dp_rep_ * dp_shard_; }
  int dp_replicate() const { return dp_rep_; }
  int dp_shard() const { return dp_shard_; }
  int cp() const { return cp_; }
  int tp() const { return tp_; }
  int ep() const { return ep_; }
  int edp() const { return dp() * cp_ / ep_; }
  int ranks_per_node() const { return rpn_; }  // effective: min(spec.ranks_per_node, world_size)
  int num_nodes() const { return world_ / rpn_; }
  // EP ranks per node as the EP dispatcher sees them (ep ranks r, r' share a node iff r / this == r' / this).
  int ep_ranks_per_node() const { return ep_ < rpn_ ? ep_ : rpn_; }
  bool ep_within_node() const { return ep_ <= rpn_ && rpn_ % ep_ == 0; }
  const ParallelSpec& spec() const { return spec_; }

  MeshCoord coord(int rank) const;
  int rank_of(int pp_idx, int dp_idx, int cp_idx = 0, int tp_idx = 0) const;
  int rank_of_ep(int pp_idx, int edp_idx, int ep_idx, int tp_idx = 0) const;
  // The world ranks of `rank`'s group, in group-index order (position i holds the rank with index i).
  std::vector<int> group(MeshGroup g, int rank) const;
  std::string describe() const;  // one line, e.g. "world 8 = pp 1 x dp_replicate 2 x dp_shard 4; ep 4 ..."

 private:
  ParallelSpec spec_;
  int world_ = 1, pp_ = 1, dp_rep_ = 1, dp_shard_ = 1, cp_ = 1, tp_ = 1, ep_ = 1, rpn_ = 1;
};

struct MeshComms {
  Comm world, dp, dp_shard, dp_replicate, ep, edp, pp, cp, tp, dp_cp;
  const Comm& get(MeshGroup g) const;
};

// Collective over `world` (whose size must equal mesh.world_size()): splits every group.
MeshComms make_mesh_comms(const DeviceMesh& mesh, const Comm& world);

}  // namespace moetron
