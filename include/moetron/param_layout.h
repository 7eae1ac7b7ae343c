// param_layout.h: a model's parameter table, written once: each tensor's name, shape, flat offset (padded to
// 16 floats), weight-decay and init flags, and its initial values. The Model lays out its buffers from it, FSDP
// shards it, the trainer's global checkpoint layout follows it. It sits below the model and FSDP (src/params/),
// so both read one table. Not the buffers, not FSDP's shards and not the model's arithmetic.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moetron/spec.h"
#include "moetron/tensor.h"

namespace moetron {

struct ParamEntry {
  std::string name;
  Shape shape;
  int64_t offset = 0;  // into the flat fp32 parameter / gradient buffers
  int64_t numel = 0;
  bool decay = true;    // weight decay applies (matrices yes; norms no)
  bool expert = false;  // routed-expert weight (sharded over the EP group)
  Shape global_shape;   // the whole tensor (= shape unless sharded)
  int64_t shard_first = 0;  // element index of this shard's first element in the whole tensor
  int layer = -1;       // -1 for embeddings / head / final norm
  bool ones = false;    // initialised to 1 (norm weights) rather than N(0, std)
  float init_std = 0.02f;
  // Tensor parallelism (ParamSelection::tp > 1). The tensor before TP slicing (the whole tensor, or under EP this
  // rank's experts: tp_whole_numel elements from shard_first) is viewed as [tp_outer, sum(tp_segs), tp_inner]; each
  // segment of the middle dimension is cut into tp equal parts and this entry holds part tp_rank of every segment,
  // in segment order (column-parallel [d, q|k|v]: segments q, k, v; row-parallel [F, d]: one segment, tp_inner = d).
  // tp_segs empty: not sliced (every TP rank holds the whole tensor).
  int tp = 1, tp_rank = 0;
  int64_t tp_outer = 1, tp_inner = 1, tp_whole_numel = 0;
  std::vector<int64_t> tp_segs;
  // The gradient over the TP group: tp_sliced() entries own distinct pieces; an unsliced entry either gets the same
  // gradient on every TP rank (its inputs were gathered: the router, MLA's down projections and their norms) or,
  // with tp_partial, each rank's sum over its own sequence rows (the norms of the sequence-parallel regions) or over
  // its own heads (qk_norm's q/k head norms), summed over the TP group once per step. The embedding and the head
  // are sliced by vocabulary rows (vocab_parallel.h).
  bool tp_partial = false;
  bool tp_sliced() const { return tp > 1 && !tp_segs.empty(); }
  int64_t unsliced_numel() const { return tp_sliced() ? tp_whole_numel : numel; }
};

// Which part of the model a parameter list covers (model_param_layout): decoder layers (mask [n_layers];
// empty = all), the embedding stage, the head stage (final norm + head; with tied embeddings it carries the
// embedding too), and this rank's expert shard under expert parallelism.
struct ParamSelection {
  std::vector<char> layers;
  bool embedding = true, head = true;
  int ep = 1, ep_rank = 0;
  int tp = 1, tp_rank = 0;  // tensor parallelism: this rank's slices (ParamEntry::tp_*; docs/parallel.md)
};
// The parameter list in declaration order (embedding, layers ascending, final norm, head), with flat offsets
// as the model lays them out for that part. The default is the whole model on one process: the global
// layout that checkpoints and parameter hashes use.
std::vector<ParamEntry> model_param_layout(const ModelSpec& spec, const ParamSelection& sel = {});

// Elements a parameter takes in the flat buffers: its numel rounded up to 16 floats (64-byte alignment).
// The flat layout (ParamEntry::offset), FSDP runs and the trainer's global layout all follow it.
inline int64_t param_padded_numel(int64_t numel) { return (numel + 15) / 16 * 16; }

// Tensor parallelism: copy between the unsliced tensor (tp_whole_numel elements) and TP rank r's slice of it
// (e.numel elements; e.tp_rank is ignored, r is used). Identity copies for an unsliced entry.
void tp_slice(const ParamEntry& e, int r, float* slice, const float* whole);
void tp_unslice(const ParamEntry& e, int r, float* whole, const float* slice);

// Elements [first, first + count) of parameter e (indices into this rank's part of it) at their initial
// values: 1 for norm weights, otherwise Philox N(0, init_std) keyed by (seed, name) and the element's index
// in the whole tensor (shard_first + i), so any sharding gives the unsharded values. A TP-sliced entry maps each
// element to its place in the unsliced tensor first.
void init_param_elements(float* dst, const ParamEntry& e, uint64_t seed, int64_t first, int64_t count);

}  // namespace moetron
