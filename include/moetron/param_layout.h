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
};

// Which part of the model a parameter list covers (model_param_layout): decoder layers (mask [n_layers];
// empty = all), the embedding stage, the head stage (final norm + head; with tied embeddings it carries the
// embedding too), and this rank's expert shard under expert parallelism.
struct ParamSelection {
  std::vector<char> layers;
  bool embedding = true, head = true;
  int ep = 1, ep_rank = 0;
};
// The parameter list in declaration order (embedding, layers ascending, final norm, head), with flat offsets
// as the model lays them out for that part. The default is the whole model on one process: the global
// layout that checkpoints and parameter hashes use.
std::vector<ParamEntry> model_param_layout(const ModelSpec& spec, const ParamSelection& sel = {});

// Elements a parameter takes in the flat buffers: its numel rounded up to 16 floats (64-byte alignment).
// The flat layout (ParamEntry::offset), FSDP runs and the trainer's global layout all follow it.
inline int64_t param_padded_numel(int64_t numel) { return (numel + 15) / 16 * 16; }

// Elements [first, first + count) of parameter e (indices into this rank's part of it) at their initial
// values: 1 for norm weights, otherwise Philox N(0, init_std) keyed by (seed, name) and the element's index
// in the whole tensor (shard_first + i), so any sharding gives the unsharded values.
void init_param_elements(float* dst, const ParamEntry& e, uint64_t seed, int64_t first, int64_t count);

}  // namespace moetron
