// train_data.h: where the trainer's micro-batches come from: the synthetic stream and the prepared-dataset
// loader behind one resumable interface, the training and validation sources a job config asks for (preparing
// a named dataset on rank 0 the first time), and the FNV-1a hash the equivalence tests record sequences with.
// Not the data pipeline itself (include/moetron/data.h) and not the step (step_executor.h).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "moetron/comm.h"
#include "moetron/config.h"

namespace moetron {

// A source of micro-batches [B, T] of inputs and targets, with a resumable position.
struct BatchSource {
  virtual ~BatchSource() = default;
  virtual void next(int32_t* in, int32_t* tg) = 0;
  virtual nlohmann::json state() const = 0;
  virtual void restore(const nlohmann::json& j) = 0;
};

struct TrainSources {
  std::unique_ptr<BatchSource> train, val;
  double unigram_entropy = -1;  // of the prepared dataset's training split (nats/token), when known
};
// Data-parallel rank `rank` of `world` reads its share of every global batch of G sequences (micro-batches of
// B); validation reads the fixed validation stream. A named dataset that is not prepared yet is prepared by
// world rank 0 (collective over `world`). `say`: print what happens.
TrainSources make_train_sources(const JobConfig& cfg, const std::string& data_root, int rank, int world, int64_t G,
                                const Comm& world_comm, bool say);

uint64_t fnv1a(const void* p, size_t n, uint64_t h = 1469598103934665603ull);

}  // namespace moetron
