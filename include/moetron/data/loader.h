// loader.h: the deterministic, resumable data loader over token shards.
//
// Windows. A window is T+1 consecutive tokens of one shard (inputs = first T, targets = last T).
// In epoch e the windows of a shard start at o_e, o_e + T, o_e + 2T, ... where the phase o_e in [0, T)
// is drawn from Philox(seed, "data.loader.offset", e) (0 when random_offset is off), so successive
// epochs cut the text at different places. Windows never cross a shard boundary. All windows of all
// shards, in shard order, are numbered 0 .. N_e-1.
// Order. Epoch e visits the windows in a Fisher-Yates permutation P_e of [0, N_e) driven by
// Philox(seed, "data.loader.shuffle", counter (i, e)). Global step s of the epoch is the G sequences
// P_e[s*G .. s*G+G); the epoch ends when fewer than G windows are left (the tail is dropped).
// Ranks. Global step sequences are split into `world` contiguous chunks of G/world; rank r takes
// chunk r and hands it out as micro-batches of B rows (G/world/B micro-batches per step). So
// sequence i of global step s is the same whatever world and B are: only who computes it changes.
// State. (epoch, position, micro): position = index into P_e of the current step's first sequence,
// micro = next micro-batch of this rank within the step. At a step boundary (micro == 0) the state
// does not depend on rank or world, so a checkpoint restores under another data-parallel layout.
// Validation. ValLoader: the first max_windows windows of the validation shards (phase 0, no
// shuffle), split into contiguous rank chunks; the last batch of a rank may have fewer rows.
// Not a streaming loader: shards are memory-mapped, verified once at open, and read in place.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moetron/data/shard.h"

namespace moetron::data {

struct Batch {
  int64_t rows = 0;               // sequences in this micro-batch (train: always micro_batch)
  int64_t seq_len = 0;            // T
  std::vector<int32_t> tokens;    // [rows, T+1]: row r = inputs tokens[r][0:T], targets tokens[r][1:T+1]
  std::vector<uint64_t> origin;   // [rows]: offset of the window's first token in the shards laid end to end
  uint64_t epoch = 0, position = 0, micro = 0;  // where this batch came from (train); position = step start

  const int32_t* row(int64_t r) const { return tokens.data() + r * (seq_len + 1); }
  // Copy out inputs and targets as two dense arrays.
  void split(int32_t* inputs /* [rows, T] */, int32_t* targets /* [rows, T] */) const;
};

struct LoaderOptions {
  int64_t seq_len = 256;      // T
  int64_t micro_batch = 8;    // B: rows per next()
  int64_t global_batch = 0;   // G: sequences per optimizer step over all ranks; 0 = micro_batch * world
  int rank = 0, world = 1;
  uint64_t seed = 1234;
  bool shuffle = true;        // false: windows in order (P_e = identity)
  bool random_offset = true;  // false: phase o_e = 0 every epoch
};

struct LoaderState {
  uint64_t epoch = 0;
  uint64_t position = 0;  // index into the epoch's permutation where the current global step starts
  uint64_t micro = 0;     // next micro-batch of this rank within the step
  bool operator==(const LoaderState&) const = default;
};

class DataLoader {
 public:
  DataLoader(const std::vector<std::string>& shard_paths, const LoaderOptions& opt);

  void next(Batch& out);  // the next micro-batch of this rank; reuses out's buffers
  LoaderState state() const { return st_; }
  void restore(const LoaderState& s);

  uint64_t windows_in_epoch(uint64_t epoch) const;  // N_e
  uint64_t steps_in_epoch(uint64_t epoch) const { return windows_in_epoch(epoch) / uint64_t(G_); }
  int64_t micro_per_step() const { return G_ / opt_.world / opt_.micro_batch; }
  int64_t global_batch() const { return G_; }
  uint64_t total_tokens() const { return total_; }
  uint32_t vocab_size() const { return vocab_; }
  uint32_t eos_id() const { return eos_; }
  // Window w of epoch e: offset of its first token in the shards laid end to end.
  uint64_t window_origin(uint64_t epoch, uint64_t w) const;
  // The epoch's permutation entry P_e[i] (computes and caches P_e).
  uint64_t permuted(uint64_t epoch, uint64_t i);

 private:
  void ensure_epoch(uint64_t e);
  uint64_t phase(uint64_t e) const;
  void read_window(uint64_t origin, int32_t* out) const;

  LoaderOptions opt_;
  int64_t G_ = 0;
  std::vector<Shard> shards_;
  std::vector<uint64_t> base_;  // [shards]: offset of shard k's first token
  uint64_t total_ = 0;
  uint32_t vocab_ = 0, eos_ = 0;
  uint64_t key_shuffle_ = 0, key_offset_ = 0;
  LoaderState st_;
  uint64_t perm_epoch_ = ~0ull;
  std::vector<uint64_t> perm_;  // [N_e] window ids of epoch perm_epoch_
};

struct ValOptions {
  int64_t seq_len = 256;
  int64_t micro_batch = 8;
  int64_t max_windows = 0;  // 0 = every window
  int rank = 0, world = 1;
};

class ValLoader {
 public:
  ValLoader(const std::vector<std::string>& shard_paths, const ValOptions& opt);
  bool next(Batch& out);  // false when this rank's windows are exhausted
  void reset() { cursor_ = begin_; }
  uint64_t num_windows() const { return n_; }        // over all ranks
  uint64_t rank_windows() const { return end_ - begin_; }

 private:
  ValOptions opt_;
  std::vector<Shard> shards_;
  std::vector<uint64_t> base_;  // [shards]: offset of shard k's first token
  uint64_t n_ = 0, begin_ = 0, end_ = 0, cursor_ = 0;
};

}  // namespace moetron::data
