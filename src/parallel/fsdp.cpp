// fsdp.cpp: the FSDP / ZeRO-3 shard layout, shards and collectives. See fsdp.h.
#include "moetron/fsdp.h"

#include <algorithm>
#include <cstring>

#include "moetron/check.h"
#include "moetron/param_layout.h"
#include "moetron/optim.h"

namespace moetron {

namespace {
int64_t pad16(int64_t n) { return param_padded_numel(n); }
}  // namespace

Fsdp::Fsdp(const std::vector<ParamEntry>& params, const std::vector<int>& unit_of, int n_units, const FsdpOptions& o)
    : params_(params), unit_of_(unit_of), dense_(o.dense), replicate_(o.replicate) {
  MT_CHECK(unit_of.size() == params.size(), "Fsdp", "unit_of has ", unit_of.size(), " entries for ", params.size(),
           " parameters");
  MT_CHECK(n_units >= 1, "Fsdp", "n_units = ", n_units);
  units_.resize(size_t(n_units));
  local_.assign(params.size(), -1);
  int last = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    MT_CHECK(unit_of[i] >= 0 && unit_of[i] < n_units, "Fsdp", "parameter ", params[i].name, " in unit ", unit_of[i],
             " outside [0, ", n_units, ")");
    MT_CHECK(unit_of[i] >= last, "Fsdp", "parameter ", params[i].name, " (unit ", unit_of[i],
             ") after a parameter of unit ", last, ": units must be ascending");
    last = unit_of[i];
  }
  for (int u = 0; u < n_units; ++u) {
    FsdpUnit& U = units_[size_t(u)];
    for (bool expert : {false, true}) {
      FsdpRun r;
      r.expert = expert;
      r.comm = expert ? o.expert : o.dense;
      r.size = r.comm.size(), r.rank = r.comm.rank();
      for (size_t i = 0; i < params.size(); ++i)
        if (unit_of[i] == u && params[i].expert == expert) {
          local_[i] = U.slot_numel + r.numel;
          r.params.push_back(int(i));
          r.numel += pad16(params[i].numel);
        }
      if (r.params.empty()) continue;
      r.chunk = pad16((r.numel + r.size - 1) / r.size);
      r.slot_offset = U.slot_numel;
      r.shard_offset = shard_numel_;
      // This rank's block [rank*chunk, rank*chunk + chunk) of the run's element space, per parameter.
      const int64_t b0 = int64_t(r.rank) * r.chunk, b1 = b0 + r.chunk;
      int64_t at = 0;
      for (int i : r.params) {
        const int64_t a = std::max(b0, at), b = std::min(b1, at + params[size_t(i)].numel);
        if (a < b) segs_.push_back({i, r.shard_offset + (a - b0), a - at, b - a});
        at += pad16(params[size_t(i)].numel);
      }
      U.slot_numel += int64_t(r.size) * r.chunk;
      shard_numel_ += r.chunk;
      max_chunk_ = std::max(max_chunk_, r.chunk);
      U.runs.push_back(std::move(r));
    }
    max_slot_ = std::max(max_slot_, U.slot_numel);
  }
  p_ = Tensor::zeros({std::max<int64_t>(shard_numel_, 1)}, DType::F32, MemCategory::Params, "fsdp.params");
  g_ = Tensor::zeros({std::max<int64_t>(shard_numel_, 1)}, DType::F32, MemCategory::Grads, "fsdp.grads");
  rs_tmp_ = Tensor::zeros({std::max<int64_t>(max_chunk_, 1)}, DType::F32, MemCategory::Comm, "fsdp.rs");
}

int64_t Fsdp::total_padded_numel() const {
  int64_t n = 0;
  for (auto& U : units_) n += U.slot_numel;
  return n;
}

void Fsdp::init(uint64_t seed) {
  float* p = params();
  std::memset(p, 0, size_t(shard_numel_) * 4);
  for (auto& s : segs_)
    init_param_elements(p + s.shard_offset, params_[size_t(s.param)], seed, s.elem_offset, s.count);
}

void Fsdp::zero_grads() { g_.zero_(); }

void Fsdp::gather_unit(float* slot, int u) const {
  for (auto& r : units_[size_t(u)].runs)
    r.comm.all_gather(slot + r.slot_offset, p_.data<float>() + r.shard_offset, r.chunk * 4);
}

void Fsdp::reduce_scatter_unit(const float* gslot, int u) {
  float* g = grads();
  float* t = rs_tmp_.data<float>();
  for (auto& r : units_[size_t(u)].runs) {
    r.comm.reduce_scatter(t, gslot + r.slot_offset, r.chunk);
    float* dst = g + r.shard_offset;
#pragma omp simd
    for (int64_t k = 0; k < r.chunk; ++k) dst[k] += t[k];
  }
}

void Fsdp::reduce_replicas() {
  if (replicate_.size() > 1) replicate_.all_reduce(grads(), shard_numel_);
}

void Fsdp::gather_flat(float* flat, const float* shard) const {
  std::vector<float> stage(static_cast<size_t>(max_slot_));
  for (auto& U : units_) {
    for (auto& r : U.runs) {
      r.comm.all_gather(stage.data(), shard + r.shard_offset, r.chunk * 4);
      int64_t at = 0;
      for (int i : r.params) {
        const ParamEntry& e = params_[size_t(i)];
        std::memcpy(flat + e.offset, stage.data() + at, size_t(e.numel) * 4);
        at += pad16(e.numel);
      }
    }
  }
}

void Fsdp::slice_flat(float* shard, const float* flat) const {
  std::memset(shard, 0, size_t(shard_numel_) * 4);
  for (auto& s : segs_)
    std::memcpy(shard + s.shard_offset, flat + params_[size_t(s.param)].offset + s.elem_offset, size_t(s.count) * 4);
}

// The shards partition the global gradient over the dense (shard) group: a dense element lives in one of its
// ranks' shards, and under EP an expert element in one (ep, expert shard) rank's shard, so one sum over the shard
// group counts each once. Under HSDP the other replicas hold the same shards and are not added.
double Fsdp::grad_norm_sq(int skip_unit) const {
  double s = 0;
  if (skip_unit < 0) {
    s = moetron::grad_norm_sq(g_.data<float>(), shard_numel_);
  } else {  // the shard without the unit's blocks: the norms of the pieces between them, in shard order
    std::vector<std::pair<int64_t, int64_t>> cut;
    for (const FsdpRun& r : units_[size_t(skip_unit)].runs) cut.push_back({r.shard_offset, r.shard_offset + r.chunk});
    std::sort(cut.begin(), cut.end());
    int64_t at = 0;
    for (const auto& [lo, hi] : cut) {
      if (lo > at) s += moetron::grad_norm_sq(g_.data<float>() + at, lo - at);
      at = std::max(at, hi);
    }
    if (shard_numel_ > at) s += moetron::grad_norm_sq(g_.data<float>() + at, shard_numel_ - at);
  }
  dense_.all_reduce(&s, 1);
  return s;
}

}  // namespace moetron
