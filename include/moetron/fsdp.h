// fsdp.h: the sharded parameter store behind FSDP / ZeRO-3 (parallelism.zero = 3). It knows the layout:
// which parameters form which unit (embedding, one per decoder layer, final norm + head), how each unit
// splits into runs (dense parameters, routed-expert parameters), and which equal block of every run this
// rank owns. It holds this rank's shards (master fp32 parameters, fp32 gradients) and does the collectives:
// all-gather a unit into a caller's slot, reduce-scatter a unit's slot gradient into the gradient shard,
// gather / slice the whole flat layout for checkpoints, the sharded gradient norm, and under HSDP the
// all-reduce of the gradient shard over the replicas.
// Not the model (which owns the unit slots, the bf16 copies and the packed expert weights and decides when
// a unit is gathered and released: src/model/model.cpp) and not the optimizer (the trainer runs AdamW on
// segments()). See docs/parallel.md, "FSDP / ZeRO-3".
//
// Layout. A unit is a set of parameters (in declaration order). Its parameters with ParamEntry::expert form
// the expert run, the others the dense run (a run is absent when it has no parameter). A run's element space
// is its parameters' 16-aligned extents concatenated (pad16(numel) each, the same padding as the flat
// buffer of the plain model); with S = the run's group size, it is cut into S equal blocks of
// chunk = pad16(ceil(n / S)) elements (the tail of the last blocks is zero padding), so Comm::all_gather and
// Comm::reduce_scatter apply to it directly. Rank r (index r in the run's group) owns block r. The unit's
// slot (what the model computes with) holds every run's S * chunk elements back to back (dense run first),
// so parameter i lives at slot + local_offset(i). This rank's shard is the concatenation over units and
// runs of its block: shard_numel() = sum over runs of chunk.
//
// HSDP (hybrid sharding): the run groups are one replica's shard group, and FsdpOptions::replicate joins the
// ranks holding the same block in the other replicas. Gathers and reduce-scatters stay inside the shard group;
// reduce_replicas() then sums the gradient shard over the replicate group, so every replica holds the same
// reduced shard. With a replicate group of one rank (plain FSDP) it does nothing.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/tensor.h"

namespace moetron {

struct ParamEntry;

struct FsdpOptions {
  Comm dense;   // the shard group: dense parameters are sharded over it (FSDP: all of DP; HSDP: dp_shard)
  Comm expert;  // routed-expert parameters' shard group: the ranks of `dense` holding the same experts (FSDP: the
                // expert-data-parallel group; = dense when ep = 1)
  // HSDP: the ranks holding this rank's block in the other replicas (dp_replicate; the same group for the expert
  // runs, since ep divides dp_shard). Default: one rank (FSDP).
  Comm replicate = Comm();
};

struct FsdpRun {
  bool expert = false;
  Comm comm;
  int size = 1, rank = 0;     // of comm
  std::vector<int> params;    // parameter indices, in order
  int64_t numel = 0;          // sum of pad16(numel) over params
  int64_t chunk = 0;          // elements per rank: pad16(ceil(numel / size))
  int64_t slot_offset = 0;    // of the run's [size * chunk] region in the unit slot
  int64_t shard_offset = 0;   // of this rank's block in the shard
};

struct FsdpUnit {
  std::vector<FsdpRun> runs;
  int64_t slot_numel = 0;  // sum over runs of size * chunk
};

// A piece of one parameter inside this rank's shard: shard[shard_offset + k] is element elem_offset + k of
// parameter `param` (k < count). Padding is in no segment.
struct FsdpSegment {
  int param = -1;
  int64_t shard_offset = 0, elem_offset = 0, count = 0;
};

class Fsdp {
 public:
  // unit_of[i]: the unit of parameter i, in [0, n_units); the units' parameters must be ascending.
  Fsdp(const std::vector<ParamEntry>& params, const std::vector<int>& unit_of, int n_units, const FsdpOptions& o);

  int n_units() const { return int(units_.size()); }
  const FsdpUnit& unit(int u) const { return units_[size_t(u)]; }
  int unit_of(int param) const { return unit_of_[size_t(param)]; }
  int64_t local_offset(int param) const { return local_[size_t(param)]; }
  int64_t max_slot_numel() const { return max_slot_; }
  int64_t shard_numel() const { return shard_numel_; }
  const std::vector<FsdpSegment>& segments() const { return segs_; }
  // Bytes (and elements) of every rank's shard, counted from the layout alone.
  int64_t total_padded_numel() const;  // sum over runs of size * chunk

  float* params() { return p_.data<float>(); }  // [shard_numel] master fp32 (MemCategory::Params)
  float* grads() { return g_.data<float>(); }   // [shard_numel] (MemCategory::Grads)
  const float* params() const { return p_.data<float>(); }

  // Philox init of this rank's shard: identical values to the unsharded init (fill by element index).
  void init(uint64_t seed);
  void zero_grads();

  // Collective over the unit's run groups: slot[0, slot_numel) = the unit's parameters (zero padding).
  void gather_unit(float* slot /* [slot_numel(u)] */, int u) const;
  // Collective: grads shard += the rank-order sum over the group of every rank's slot gradient (the slot's
  // padding must be zero).
  void reduce_scatter_unit(const float* gslot /* [slot_numel(u)] */, int u);
  // Collective over the replicate group (HSDP; nothing with one replica): grads shard = the rank-order sum over
  // the replicas of their grads shards (Comm::all_reduce, bitwise the same on every replica). Once per step,
  // after the last unit's reduce-scatter.
  void reduce_replicas();
  int replicas() const { return replicate_.size(); }

  // Whole flat layout (ParamEntry::offset, the plain model's param_data()): collective gather of a shard
  // vector (params, grads or an optimizer moment) into every rank's `flat`, and the local slice back.
  void gather_flat(float* flat /* [flat_numel] */, const float* shard /* [shard_numel] */) const;
  void slice_flat(float* shard /* [shard_numel] */, const float* flat /* [flat_numel] */) const;

  // Squared L2 norm of the gradient (collective): each rank's shard norm (grad_norm_sq), folded in rank
  // order over the shard group (double): one replica's shards, since replicas hold equal ones. Equals the
  // unsharded norm up to the order of the double additions.
  // skip_unit >= 0: without that unit's blocks (a copy counted where its original is: the pipeline's head-stage
  // embedding copy under multi-token prediction).
  double grad_norm_sq(int skip_unit = -1) const;

 private:
  const std::vector<ParamEntry>& params_;
  std::vector<FsdpUnit> units_;
  std::vector<int> unit_of_;
  std::vector<int64_t> local_;
  std::vector<FsdpSegment> segs_;
  int64_t max_slot_ = 0, shard_numel_ = 0, max_chunk_ = 0;
  Comm dense_, replicate_;
  Tensor p_, g_, rs_tmp_;
};

}  // namespace moetron
