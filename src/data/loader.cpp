// loader.cpp: window numbering, per-epoch Philox shuffle, rank/micro-batch slicing and resumable
// state for training; in-order windows for validation. Semantics in loader.h.
#include "moetron/data/loader.h"

#include <algorithm>
#include <cstring>

#include "moetron/check.h"
#include "moetron/rng.h"

namespace moetron::data {

namespace {

// Windows of T+1 tokens at stride T starting at `phase` in a shard of n tokens.
uint64_t windows_in(uint64_t n, uint64_t phase, uint64_t T) { return n >= phase + T + 1 ? (n - phase - 1) / T : 0; }

std::vector<Shard> open_shards(const std::vector<std::string>& paths, std::vector<uint64_t>& base, uint64_t& total,
                               uint32_t& vocab, uint32_t& eos, const char* who) {
  MT_CHECK(!paths.empty(), who, "no shards given");
  std::vector<Shard> shards;
  total = 0;
  for (const auto& p : paths) {
    shards.push_back(Shard::open(p));
    const auto& h = shards.back().header();
    if (shards.size() == 1) {
      vocab = h.vocab_size;
      eos = h.eos_id;
    }
    MT_CHECK(h.vocab_size == vocab && h.eos_id == eos, who, p, ": vocab ", h.vocab_size, " / eos ", h.eos_id,
             " differ from ", paths[0], " (", vocab, " / ", eos, ")");
    base.push_back(total);
    total += h.num_tokens;
  }
  return shards;
}

void read_at(const std::vector<Shard>& shards, const std::vector<uint64_t>& base, uint64_t origin, int32_t* out,
             uint64_t n) {
  size_t k = std::upper_bound(base.begin(), base.end(), origin) - base.begin() - 1;
  // Empty shards share their base with the next one: skip to the shard that holds `origin`.
  while (k + 1 < shards.size() && origin >= base[k] + shards[k].size()) ++k;
  shards[k].read(out, origin - base[k], n);
}

}  // namespace

void Batch::split(int32_t* inputs, int32_t* targets) const {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(inputs + r * seq_len, row(r), sizeof(int32_t) * seq_len);
    std::memcpy(targets + r * seq_len, row(r) + 1, sizeof(int32_t) * seq_len);
  }
}

DataLoader::DataLoader(const std::vector<std::string>& shard_paths, const LoaderOptions& opt) : opt_(opt) {
  MT_CHECK(opt.seq_len >= 1, "loader", "seq_len ", opt.seq_len, " must be >= 1");
  MT_CHECK(opt.micro_batch >= 1, "loader", "micro_batch ", opt.micro_batch, " must be >= 1");
  MT_CHECK(opt.world >= 1 && opt.rank >= 0 && opt.rank < opt.world, "loader", "rank ", opt.rank, " world ", opt.world);
  G_ = opt.global_batch > 0 ? opt.global_batch : opt.micro_batch * opt.world;
  MT_CHECK(G_ % opt.world == 0, "loader", "global_batch ", G_, " is not divisible by world ", opt.world);
  MT_CHECK((G_ / opt.world) % opt.micro_batch == 0, "loader", "global_batch ", G_, " / world ", opt.world, " = ",
           G_ / opt.world, " sequences per rank is not a multiple of micro_batch ", opt.micro_batch);
  shards_ = open_shards(shard_paths, base_, total_, vocab_, eos_, "loader");
  key_shuffle_ = rng_key(opt.seed, "data.loader.shuffle");
  key_offset_ = rng_key(opt.seed, "data.loader.offset");
  uint64_t n0 = windows_in_epoch(0);
  // Phase 0 has the most windows: reserve once so later epochs do not reallocate.
  uint64_t nmax = 0;
  for (const auto& s : shards_) nmax += windows_in(s.size(), 0, uint64_t(opt.seq_len));
  perm_.reserve(nmax);
  MT_CHECK(n0 >= uint64_t(G_), "loader", "dataset too small: ", total_, " tokens give ", n0,
           " windows of seq_len+1 = ", opt.seq_len + 1, " tokens, fewer than one global batch of ", G_);
}

uint64_t DataLoader::phase(uint64_t e) const {
  return opt_.random_offset ? philox4x32(key_offset_, e)[0] % uint64_t(opt_.seq_len) : 0;
}

uint64_t DataLoader::windows_in_epoch(uint64_t e) const {
  uint64_t o = phase(e), n = 0;
  for (const auto& s : shards_) n += windows_in(s.size(), o, uint64_t(opt_.seq_len));
  return n;
}

uint64_t DataLoader::window_origin(uint64_t e, uint64_t w) const {
  const uint64_t o = phase(e), T = uint64_t(opt_.seq_len);
  for (size_t k = 0; k < shards_.size(); ++k) {
    uint64_t c = windows_in(shards_[k].size(), o, T);
    if (w < c) return base_[k] + o + w * T;
    w -= c;
  }
  MT_FAIL("loader", "window ", w, " past the end of epoch ", e);
}

void DataLoader::ensure_epoch(uint64_t e) {
  if (perm_epoch_ == e) return;
  const uint64_t n = windows_in_epoch(e);
  perm_.resize(n);
  for (uint64_t i = 0; i < n; ++i) perm_[i] = i;
  if (opt_.shuffle) {
    // Fisher-Yates from the top; draw j uniform in [0, i] as the high half of r * (i + 1).
    for (uint64_t i = n; i-- > 1;) {
      auto r = philox4x32(key_shuffle_, i, e);
      uint64_t x = uint64_t(r[0]) | uint64_t(r[1]) << 32;
      uint64_t j = uint64_t((unsigned __int128)x * (i + 1) >> 64);
      std::swap(perm_[i], perm_[j]);
    }
  }
  perm_epoch_ = e;
}

uint64_t DataLoader::permuted(uint64_t e, uint64_t i) {
  ensure_epoch(e);
  MT_CHECK(i < perm_.size(), "loader", "index ", i, " past the ", perm_.size(), " windows of epoch ", e);
  return perm_[i];
}

void DataLoader::next(Batch& out) {
  const uint64_t G = uint64_t(G_), B = uint64_t(opt_.micro_batch), T = uint64_t(opt_.seq_len);
  ensure_epoch(st_.epoch);
  if (st_.position + G > perm_.size()) {  // the epoch's tail is shorter than a global batch: next epoch
    MT_CHECK(st_.micro == 0, "loader", "inconsistent state: micro ", st_.micro, " at the end of epoch ", st_.epoch);
    st_.epoch += 1;
    st_.position = 0;
    ensure_epoch(st_.epoch);
    MT_CHECK(perm_.size() >= G, "loader", "epoch ", st_.epoch, " has ", perm_.size(), " windows, fewer than global_batch ",
             G);
  }
  out.rows = int64_t(B);
  out.seq_len = opt_.seq_len;
  out.tokens.resize(B * (T + 1));
  out.origin.resize(B);
  out.epoch = st_.epoch;
  out.position = st_.position;
  out.micro = st_.micro;
  const uint64_t first = st_.position + uint64_t(opt_.rank) * (G / uint64_t(opt_.world)) + st_.micro * B;
  for (uint64_t r = 0; r < B; ++r) {
    uint64_t origin = window_origin(st_.epoch, perm_[first + r]);
    out.origin[r] = origin;
    read_at(shards_, base_, origin, out.tokens.data() + r * (T + 1), T + 1);
  }
  if (++st_.micro == uint64_t(micro_per_step())) {
    st_.micro = 0;
    st_.position += G;
  }
}

void DataLoader::restore(const LoaderState& s) {
  MT_CHECK(s.micro < uint64_t(micro_per_step()), "loader", "restore: micro ", s.micro, " but a step has ",
           micro_per_step(), " micro-batches");
  if (s.micro > 0) {
    uint64_t n = windows_in_epoch(s.epoch);
    MT_CHECK(s.position + uint64_t(G_) <= n, "loader", "restore: mid-step state at position ", s.position,
             " past the last full step of epoch ", s.epoch, " (", n, " windows)");
  }
  st_ = s;
}

ValLoader::ValLoader(const std::vector<std::string>& shard_paths, const ValOptions& opt) : opt_(opt) {
  MT_CHECK(opt.seq_len >= 1 && opt.micro_batch >= 1, "val_loader", "seq_len ", opt.seq_len, " micro_batch ",
           opt.micro_batch);
  MT_CHECK(opt.world >= 1 && opt.rank >= 0 && opt.rank < opt.world, "val_loader", "rank ", opt.rank, " world ",
           opt.world);
  MT_CHECK(opt.max_windows >= 0, "val_loader", "max_windows ", opt.max_windows);
  uint64_t total = 0;
  uint32_t vocab = 0, eos = 0;
  shards_ = open_shards(shard_paths, base_, total, vocab, eos, "val_loader");
  for (const auto& s : shards_) n_ += windows_in(s.size(), 0, uint64_t(opt.seq_len));
  if (opt.max_windows > 0) n_ = std::min<uint64_t>(n_, uint64_t(opt.max_windows));
  MT_CHECK(n_ > 0, "val_loader", "no validation window: ", total, " tokens, seq_len+1 = ", opt.seq_len + 1);
  begin_ = n_ * uint64_t(opt.rank) / uint64_t(opt.world);
  end_ = n_ * uint64_t(opt.rank + 1) / uint64_t(opt.world);
  cursor_ = begin_;
}

bool ValLoader::next(Batch& out) {
  if (cursor_ >= end_) return false;
  const uint64_t T = uint64_t(opt_.seq_len);
  const uint64_t rows = std::min<uint64_t>(uint64_t(opt_.micro_batch), end_ - cursor_);
  out.rows = int64_t(rows);
  out.seq_len = opt_.seq_len;
  out.tokens.resize(rows * (T + 1));
  out.origin.resize(rows);
  out.epoch = 0;
  out.position = cursor_;
  out.micro = 0;
  for (uint64_t r = 0; r < rows; ++r) {
    uint64_t w = cursor_ + r, origin = 0;
    for (size_t k = 0; k < shards_.size(); ++k) {
      uint64_t c = windows_in(shards_[k].size(), 0, T);
      if (w < c) {
        origin = base_[k] + w * T;
        break;
      }
      w -= c;
    }
    out.origin[r] = origin;
    read_at(shards_, base_, origin, out.tokens.data() + r * (T + 1), T + 1);
  }
  cursor_ += rows;
  return true;
}

}  // namespace moetron::data
