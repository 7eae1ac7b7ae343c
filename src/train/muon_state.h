// muon_state.h: the trainer's Muon step over this rank's share of the Muon matrices (optimizer.name = "muon";
// docs/optimizer.md). The momentum lives where ParamState's first moment does (whole, ZeRO-1 slices of the flat
// runs, or FSDP shard blocks); Newton-Schulz needs whole matrices, so each shard group sends every matrix's pieces
// to one owner rank, the owner orthogonalizes it and sends the update's pieces back.
// Not the AdamW part, not the state's layout (param_state.h builds the blocks) and not the kernels (muon.h).
//
// The scheme, per shard group (a ZeRO-1 run over its DP / expert-DP group, an FSDP unit's run over its shard group;
// unsharded state is a group of one rank):
//   1. every rank updates the momentum of its block and forms X (Nesterov: g + mu m) for its pieces of the Muon
//      matrices, packed by owner (one all_to_all_v);
//   2. the owner of a matrix (assigned once: each matrix in order to the rank with the least Newton-Schulz work so
//      far, so the group's ranks share the work) assembles it from the pieces (blocks are in rank order) and
//      computes U = scale * NS(X) per column block;
//   3. the pieces of U go back to the ranks holding them (the reverse all_to_all_v), and each rank applies
//      decoupled decay and W -= lr U to its block.
// Every rank of a group ends with what one process computes: X is assembled exactly (element-wise arithmetic on
// the same values), and Newton-Schulz runs on the whole matrix with the batch-invariant GEMM. Without sharding
// (zero = 0) every rank computes every matrix it holds: no communication, the same bits everywhere; under EP each
// rank holds whole experts, and the expert-data-parallel replicas compute the same.
#pragma once
#include <cstdint>
#include <vector>

#include "moetron/comm.h"
#include "moetron/muon_params.h"

namespace moetron {

// One shard group's element space and this rank's block of it. Element k of block `me` is at p / g / m
// [k - bounds[me]].
struct MuonBlock {
  const Comm* comm = nullptr;   // the group; null = this rank alone
  std::vector<int64_t> bounds;  // [S + 1]: rank q holds [bounds[q], bounds[q + 1])
  int me = 0;
  float* p = nullptr;
  const float* g = nullptr;
  float* m = nullptr;
  struct Param {
    int64_t start = 0;  // in the element space
    MuonMatrices mm;
    bool decay = true;
  };
  std::vector<Param> params;  // the Muon parameters of the space, ascending start
};

// The largest exchange of one group, in elements (a bigger matrix goes alone): the send, receive and matrix buffers
// hold at most this much (3 x 16 MiB), outside the tracked categories like ZeRO-1's parameter staging.
inline constexpr int64_t kMuonBatch = int64_t(1) << 22;

class MuonState {
 public:
  // batch: the largest exchange of a group in elements (kMuonBatch; tests pass small ones to get many batches).
  MuonState(std::vector<MuonBlock> blocks, float momentum, bool nesterov, int ns_steps, int64_t batch = kMuonBatch);
  // One step of every Muon matrix of this rank's blocks. Collective over each block's group.
  void step(float lr, float weight_decay, float grad_scale);
  int64_t owned_matrices() const { return owned_; }  // stacked matrices this rank orthogonalizes

 private:
  struct Slab {
    int param;       // into the block's params
    int64_t lo, hi;  // one stacked matrix's elements in the element space
    int owner;
    int64_t at = 0;  // this rank's piece of it: its offset in the send layout (by owner, then matrix order)
  };
  struct Group {  // one batch of a block's matrices
    MuonBlock b;
    std::vector<Slab> slabs;
    std::vector<int64_t> to_owner, to_owner_at, from_rank, from_rank_at;  // floats per peer (this rank's view)
    int64_t mine = 0, owned_numel = 0;
  };
  void group_step(Group& gr, float lr, float wd, float grad_scale);

  std::vector<Group> groups_;
  float mu_;
  bool nesterov_;
  int steps_;
  int64_t owned_ = 0;
  int threads_ = 1;
  int64_t work_per_thread_ = 0;
  std::vector<float> xbuf_, sbuf_, work_;
  std::vector<int64_t> bytes_[4];
};

}  // namespace moetron
