// param_state.cpp: ParamState and pipeline_ownership (see param_state.h).
//
// Runs: the flat gradient buffer cut into maximal ranges of non-expert parameters (reduced over all of DP)
// and, under EP, of this rank's routed-expert shards (reduced over the expert-data-parallel group). Without EP
// it is one run [0, np) over DP. AdamW state: per run the whole range, or with zero = 1 this rank's slice
// [s_lo, s_hi) of it over the run's group (ZeRO-1); the state buffers concatenate them. zero = 3: the state has
// the layout of the parameter shard (fsdp->segments()); the runs are not used. Under HSDP (zero = 3 with
// dp_replicate > 1) the shard is one replica's: the optimizer state is replicated like the parameters.
// Muon (optimizer.name = "muon"): m holds the momentum of the Muon matrices in the same layout; v holds only the
// AdamW parameters' elements, packed in state order (adam_); MuonState's blocks are the runs (or FSDP unit runs).
#include "train/param_state.h"

#include <limits>

#include <algorithm>
#include <cmath>
#include <map>

#include "moetron/check.h"
#include "moetron/fsdp.h"
#include "moetron/trace.h"

namespace moetron {

PipelineOwnership pipeline_ownership(const ModelSpec& spec, const std::vector<ParamEntry>& gp,
                                     const std::vector<std::vector<int>>& stage_layers,
                                     const std::vector<int>& stage_rank, int first_stage_rank, int last_stage_rank) {
  std::vector<int> layer_rank(size_t(spec.n_blocks()), -1);
  for (size_t s = 0; s < stage_layers.size(); ++s)
    for (int l : stage_layers[s]) layer_rank[size_t(l)] = stage_rank[s];
  for (int64_t b = spec.n_layers; b < spec.n_blocks(); ++b) layer_rank[size_t(b)] = last_stage_rank;  // MTP
  PipelineOwnership o;
  for (const auto& p : gp)
    o.param_rank.push_back(p.layer >= 0 ? layer_rank[size_t(p.layer)]
                                        : p.name == "embed" ? first_stage_rank : last_stage_rank);
  for (int64_t l = 0; l < spec.n_blocks(); ++l)
    if (spec.is_moe_block(l)) o.moe_rank.push_back(layer_rank[size_t(l)]);
  return o;
}

ParamState::ParamState(Model& m, const JobConfig& cfg, const ParamStateComms& c, const PipelineOwnership& own,
                       int pp_rank)
    : m_(m), fsdp_(m.fsdp()), c_(c), own_(own), pp_rank_(pp_rank), EP_(c.ep.size()) {
  zero3_ = cfg.parallelism.zero == 3;
  sharded_ = cfg.parallelism.zero == 1 && c.dp.size() > 1;
  E_ = cfg.model.is_moe() ? cfg.model.moe.n_routed_experts : 0;
  np_ = m.num_params();
  const auto& ps = m.params();
  for (size_t i = 0; i < ps.size(); ++i) {
    const bool ex = ps[i].expert && EP_ > 1;
    const int64_t hi = i + 1 < ps.size() ? ps[i + 1].offset : np_;
    if (!runs_.empty() && runs_.back().expert == ex) runs_.back().hi = hi;
    else runs_.push_back({ps[i].offset, hi, 0, 0, 0, ex, ex ? &c_.edp : &c_.dp, {}, {}});
  }
  int64_t st = 0, ns_max = 0;
  for (auto& r : runs_) {
    const int S = sharded_ ? r.comm->size() : 1, q = sharded_ ? r.comm->rank() : 0;
    const int64_t n = r.hi - r.lo;
    r.s_lo = r.lo + n * q / S, r.s_hi = r.lo + n * (q + 1) / S, r.st = st, st += r.s_hi - r.s_lo;
    ns_max = std::max(ns_max, r.s_hi - r.s_lo);
    for (int g = 0; g < S; ++g) r.counts.push_back((n * (g + 1) / S - n * g / S) * 4), r.displs.push_back(n * g / S * 4);
  }
  ns_ = zero3_ ? fsdp_->shard_numel() : st;
  mbuf_ = Tensor::zeros({std::max<int64_t>(ns_, 1)}, DType::F32, MemCategory::Optimizer, "adam.m");
  if (sharded_) stage_.resize(size_t(ns_max));

  gparams_ = model_param_layout(cfg.model);
  std::map<std::string, int> by_name;
  for (size_t g = 0; g < gparams_.size(); ++g) {
    by_name[gparams_[g].name] = int(g);
    goff_.push_back(gparams_[g].offset);
  }
  gnp_ = gparams_.empty() ? 0 : gparams_.back().offset + param_padded_numel(gparams_.back().numel);
  for (const auto& p : ps) {
    auto it = by_name.find(p.name);
    MT_CHECK(it != by_name.end(), "train", "parameter ", p.name, " is not in the model's global layout");
    gidx_.push_back(it->second);
  }
  MT_CHECK(own_.param_rank.size() == gparams_.size(), "train", "ownership of ", own_.param_rank.size(),
           " parameters for ", gparams_.size());
  build_optimizer(cfg);
}

// The AdamW pieces of the state (every parameter, or under Muon those that are not Muon matrices: v then holds
// only theirs, packed) and the Muon blocks over the same state layout.
void ParamState::build_optimizer(const JobConfig& cfg) {
  const auto& ps = m_.params();
  const bool muon = cfg.optimizer.muon();
  std::vector<MuonMatrices> mm(ps.size());
  if (muon)
    for (size_t i = 0; i < ps.size(); ++i) mm[i] = muon_matrices(cfg.model, ps[i].name, ps[i].shape);
  int64_t nv = 0;
  auto add = [&](int64_t st, int64_t flat, int64_t n, int param) {
    if (mm[size_t(param)].muon()) return;
    adam_.push_back({st, muon ? nv : st, flat, n, param});
    nv += n;
  };
  if (zero3_) {
    for (auto& sg : fsdp_->segments()) add(sg.shard_offset, sg.shard_offset, sg.count, sg.param);
  } else {
    for (auto& r : runs_)
      for (size_t i = 0; i < ps.size(); ++i) {
        const int64_t a = std::max(r.s_lo, ps[i].offset), b = std::min(r.s_hi, ps[i].offset + ps[i].numel);
        if (a < b) add(r.st + (a - r.s_lo), a, b - a, int(i));
      }
  }
  if (!zero3_ && !sharded_)  // step() walks the pieces along the flat layout
    for (size_t k = 1; k < adam_.size(); ++k)
      MT_CHECK(adam_[k - 1].flat + adam_[k - 1].n <= adam_[k].flat, "train", "AdamW pieces out of flat order at ", k);
  nv_ = muon ? nv : ns_;
  vbuf_ = Tensor::zeros({std::max<int64_t>(nv_, 1)}, DType::F32, MemCategory::Optimizer, "adam.v");
  if (!muon) return;
  muon_global_.assign(gparams_.size(), 0);
  for (size_t g = 0; g < gparams_.size(); ++g)
    muon_global_[g] = muon_matrices(cfg.model, gparams_[g].name, gparams_[g].global_shape).muon();
  float* mb = mbuf_.data<float>();
  std::vector<MuonBlock> blocks;
  auto add_params = [&](MuonBlock& b, const std::vector<int>& idx, auto&& start_of) {
    for (int i : idx)
      if (mm[size_t(i)].muon()) b.params.push_back({start_of(i), mm[size_t(i)], ps[size_t(i)].decay});
  };
  if (zero3_) {  // an FSDP unit's run: its element space, cut into equal blocks over the shard group
    for (int u = 0; u < fsdp_->n_units(); ++u)
      for (const FsdpRun& r : fsdp_->unit(u).runs) {
        MuonBlock b;
        b.comm = &r.comm, b.me = r.rank;
        for (int q = 0; q <= r.size; ++q) b.bounds.push_back(int64_t(q) * r.chunk);
        b.p = fsdp_->params() + r.shard_offset, b.g = fsdp_->grads() + r.shard_offset, b.m = mb + r.shard_offset;
        add_params(b, r.params, [&](int i) { return fsdp_->local_offset(i) - r.slot_offset; });
        blocks.push_back(std::move(b));
      }
  } else {  // a run of the flat layout: whole, or ZeRO-1 slices over the run's group
    for (auto& r : runs_) {
      MuonBlock b;
      if (sharded_) {
        b.comm = r.comm, b.me = r.comm->rank();
        for (int64_t d : r.displs) b.bounds.push_back(r.lo + d / 4);
        b.bounds.push_back(r.hi);
      } else {
        b.bounds = {r.lo, r.hi};
      }
      b.p = m_.param_data() + r.s_lo, b.g = m_.grad_data() + r.s_lo, b.m = mb + r.st;
      std::vector<int> idx;
      for (size_t i = 0; i < ps.size(); ++i)
        if (ps[i].offset >= r.lo && ps[i].offset < r.hi) idx.push_back(int(i));
      add_params(b, idx, [&](int i) { return ps[size_t(i)].offset; });
      blocks.push_back(std::move(b));
    }
  }
  const auto& o = cfg.optimizer;
  muon_ = std::make_unique<MuonState>(std::move(blocks), float(o.muon_momentum), o.muon_nesterov, int(o.muon_ns_steps));
}

// ---------------------------------------------------------------------------------------------------
// the step

void ParamState::reduce_grads() {
  if (c_.tp.size() > 1) {
    MT_TRACE("tp.all_reduce_grads");
    for (const auto& p : m_.params())
      if (p.tp_partial) c_.tp.all_reduce(m_.grad_data() + p.offset, p.numel);
  }
  if (zero3_) {  // reduce-scattered unit by unit during the backward; HSDP: then summed over the replicas
    if (fsdp_->replicas() > 1) {
      MT_TRACE("fsdp.replica_all_reduce");
      fsdp_->reduce_replicas();
    }
    return;
  }
  if (c_.dp.size() == 1) return;
  MT_TRACE("dp.all_reduce");
  for (auto& r : runs_)
    if (r.comm->size() > 1)
      for (int64_t off = r.lo; off < r.hi; off += kCommReduceSegment)
        r.comm->all_reduce(m_.grad_data() + off, std::min<int64_t>(kCommReduceSegment, r.hi - off));
}

double ParamState::grad_norm() {
  if (zero3_) {
    int copy_unit = -1;  // the head stage's embedding copy (MTP under PP): counted on the first stage
    const auto& ps = m_.params();
    for (size_t i = 0; i < ps.size(); ++i)
      if (own_.param_rank[size_t(gidx_[i])] != pp_rank_) {
        copy_unit = fsdp_->unit_of(int(i));
        MT_CHECK(fsdp_->unit(copy_unit).runs.size() == 1 && fsdp_->unit(copy_unit).runs[0].params.size() == 1, "train",
                 "the pipeline copy of ", ps[i].name, " shares its FSDP unit with other parameters");
      }
    double sq = fsdp_->grad_norm_sq(copy_unit);
    if (c_.pp.size() > 1) {
      double tot = 0;
      c_.pp.all_reduce_ordered(&tot, &sq, 1, 1);
      sq = tot;
    }
    return std::sqrt(sq);
  }
  const auto& ps = m_.params();
  std::vector<double> sq(gparams_.size(), 0.0);
  std::vector<double> ex_local, ex_sum;
  std::vector<int> ex_idx;
  std::vector<double> tp_v;  // TP-sliced tensors: this rank's slice, summed over TP below
  std::vector<size_t> tp_i;
  for (size_t i = 0; i < ps.size(); ++i) {
    const int g = gidx_[i];
    if (own_.param_rank[size_t(g)] != pp_rank_) continue;  // a tied copy: counted where it is owned
    const double v = grad_norm_sq(m_.grad_data() + ps[i].offset, ps[i].numel);
    if (ps[i].tp_sliced()) tp_v.push_back(v), tp_i.push_back(i);
    else if (ps[i].expert && EP_ > 1) ex_local.push_back(v), ex_idx.push_back(g);
    else sq[size_t(g)] = v;
  }
  if (!tp_v.empty()) {  // the slices' sums in TP rank order; then experts over EP like the others
    c_.tp.all_reduce(tp_v.data(), int64_t(tp_v.size()));
    for (size_t k = 0; k < tp_i.size(); ++k) {
      const int g = gidx_[tp_i[k]];
      if (ps[tp_i[k]].expert && EP_ > 1) ex_local.push_back(tp_v[k]), ex_idx.push_back(g);
      else sq[size_t(g)] = tp_v[k];
    }
  }
  if (EP_ > 1 && !ex_local.empty()) {  // expert tensors: their shards summed over EP in rank order (every EP rank
    // of a stage holds the same tensors)
    ex_sum.assign(ex_local.size(), 0.0);
    c_.ep.all_reduce_ordered(ex_sum.data(), ex_local.data(), 1, int64_t(ex_local.size()));
    for (size_t k = 0; k < ex_idx.size(); ++k) sq[size_t(ex_idx[k])] = ex_sum[k];
  }
  if (c_.pp.size() > 1) c_.pp.all_reduce(sq.data(), int64_t(sq.size()));  // one owner each: exact
  double total = 0;
  for (double v : sq) total += v;
  return std::sqrt(total);
}

// AdamW is element-wise: the update of this rank's slice is bitwise what the full update gives there. Muon's
// matrices: MuonState (the owner scheme of muon_state.h gives every rank the single-process update).
void ParamState::step(const AdamWConfig& ac, int64_t step, float clip) {
  if (muon_) muon_->step(ac.lr, ac.weight_decay, clip);
  float* mb = mbuf_.data<float>();
  float* vb = vbuf_.data<float>();
  trace::Scope tr_adamw("optim.adamw");  // this rank's slice; the ZeRO-1 parameter gather is its own kernel scope
  // zero = 3: the shard's pieces of parameters (a piece has one decay flag; padding is not updated); else the
  // run slices' pieces.
  float* P = zero3_ ? fsdp_->params() : m_.param_data();
  const float* G = zero3_ ? fsdp_->grads() : m_.grad_data();
  auto adamw = [&](const AdamPiece& a, int64_t lo, int64_t hi) {  // the piece's elements [lo, hi) of the flat layout
    const int64_t o = lo - a.flat;
    const bool decay = m_.params()[size_t(a.param)].decay;
    adamw_step(P + lo, mb + a.st + o, vb + a.v + o, G + lo, hi - lo, ac, step, clip, decay);
  };
  if (!zero3_ && !sharded_) {  // every master is this rank's: each piece updated, then refreshed while in cache
    tr_adamw.stop();
    size_t next = 0;  // adam_ is in flat order here (build_optimizer checks it): the first piece not yet done
    m_.update_and_sync([&](int64_t lo, int64_t hi) {
      while (next < adam_.size() && adam_[next].flat + adam_[next].n <= lo) ++next;
      for (size_t k = next; k < adam_.size() && adam_[k].flat < hi; ++k)
        adamw(adam_[k], std::max(lo, adam_[k].flat), std::min(hi, adam_[k].flat + adam_[k].n));
    });
    return;
  }
  for (const AdamPiece& a : adam_) adamw(a, a.flat, a.flat + a.n);
  if (zero3_) return;  // FSDP: the units' copies are made where they are gathered
  tr_adamw.stop();
  {
    MT_TRACE("dp.all_gather_params");
    for (auto& r : runs_) {
      std::copy(m_.param_data() + r.s_lo, m_.param_data() + r.s_hi, stage_.data());
      r.comm->all_gather_v(m_.param_data() + r.lo, r.counts.data(), r.displs.data(), stage_.data());
    }
  }
  MT_TRACE("sync_weights");
  m_.sync_weights();
}

// ---------------------------------------------------------------------------------------------------
// local flat layout <-> state buffers, and the global layout

void ParamState::poison_grad() {
  float* g = zero3_ ? fsdp_->grads() : m_.grad_data();
  if (g) g[0] = std::numeric_limits<float>::quiet_NaN();
}

void ParamState::poison_param() {
  float* p = zero3_ ? fsdp_->params() : m_.param_data();
  if (p) p[0] = std::numeric_limits<float>::quiet_NaN();
}

const float* ParamState::local_params() {
  if (!zero3_) return m_.param_data();
  flat_.resize(size_t(np_));
  fsdp_->gather_flat(flat_.data(), fsdp_->params());
  return flat_.data();
}

const float* ParamState::local_grads() {
  if (!zero3_) return m_.grad_data();
  flat_.resize(size_t(np_));
  fsdp_->gather_flat(flat_.data(), fsdp_->grads());
  return flat_.data();
}

std::vector<float> ParamState::gather_state(const float* st) {
  std::vector<float> full(size_t(np_), 0.0f);
  if (zero3_) {
    fsdp_->gather_flat(full.data(), st);
    return full;
  }
  for (auto& r : runs_) {
    if (sharded_) r.comm->all_gather_v(full.data() + r.lo, r.counts.data(), r.displs.data(), st + r.st);
    else std::copy(st + r.st, st + r.st + (r.hi - r.lo), full.data() + r.lo);
  }
  return full;
}

void ParamState::slice_state(float* st, const std::vector<float>& full) {
  if (zero3_) return fsdp_->slice_flat(st, full.data());
  for (auto& r : runs_) std::copy(full.begin() + r.s_lo, full.begin() + r.s_hi, st + r.st);
}

// Gathers every pipeline rank's owned pieces of g (piece k: offs[k], sizes[k] floats, owner[k]) into every
// rank's g. Collective over pp; a copy-free no-op with one pipeline rank.
void ParamState::gather_pp(std::vector<float>& g, const std::vector<int64_t>& offs, const std::vector<int64_t>& sizes,
                           const std::vector<int>& owner) {
  const int P = c_.pp.size();
  if (P == 1) return;
  std::vector<int64_t> counts(static_cast<size_t>(P), 0), displs(static_cast<size_t>(P), 0);
  for (size_t k = 0; k < offs.size(); ++k) counts[size_t(owner[k])] += sizes[k] * 4;
  for (int r = 1; r < P; ++r) displs[size_t(r)] = displs[size_t(r - 1)] + counts[size_t(r - 1)];
  std::vector<float> mine;
  mine.reserve(size_t(counts[size_t(pp_rank_)] / 4));
  for (size_t k = 0; k < offs.size(); ++k)
    if (owner[k] == pp_rank_) mine.insert(mine.end(), g.begin() + offs[k], g.begin() + offs[k] + sizes[k]);
  std::vector<float> all(size_t((displs[size_t(P - 1)] + counts[size_t(P - 1)]) / 4));
  c_.pp.all_gather_v(all.data(), counts.data(), displs.data(), mine.data());
  std::vector<int64_t> pos(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) pos[size_t(r)] = displs[size_t(r)] / 4;
  for (size_t k = 0; k < offs.size(); ++k) {
    int64_t& p = pos[size_t(owner[k])];
    std::copy(all.begin() + p, all.begin() + p + sizes[k], g.begin() + offs[k]);
    p += sizes[k];
  }
}

// Global layout from a local-layout vector: expert shards gathered over EP, then the pipeline ranks' parameters
// over PP. Collective under EP and PP; otherwise a copy.
std::vector<float> ParamState::to_global(const float* local) {
  std::vector<float> g(size_t(gnp_), 0.0f);
  const auto& ps = m_.params();
  std::vector<float> slices, whole;
  for (size_t i = 0; i < ps.size(); ++i) {
    float* dst = g.data() + goff_[size_t(gidx_[i])];
    const float* src = local + ps[i].offset;
    if (ps[i].tp_sliced()) {  // the TP slices gathered and put back in place: this rank's (EP shard of the) tensor
      const int T = c_.tp.size();
      slices.resize(size_t(ps[i].numel) * size_t(T)), whole.resize(size_t(ps[i].tp_whole_numel));
      c_.tp.all_gather(slices.data(), src, ps[i].numel * 4);
      for (int r = 0; r < T; ++r) tp_unslice(ps[i], r, whole.data(), slices.data() + int64_t(r) * ps[i].numel);
      src = whole.data();
    }
    const int64_t n = ps[i].unsliced_numel();
    if (ps[i].expert && EP_ > 1) c_.ep.all_gather(dst, src, n * 4);
    else std::copy(src, src + n, dst);
  }
  std::vector<int64_t> sizes;
  for (const auto& p : gparams_) sizes.push_back(p.numel);
  gather_pp(g, goff_, sizes, own_.param_rank);
  return g;
}

void ParamState::from_global(float* local, const std::vector<float>& g) {
  MT_CHECK(int64_t(g.size()) == gnp_, "train", "global vector of ", g.size(), " floats, expected ", gnp_);
  const auto& ps = m_.params();
  for (size_t i = 0; i < ps.size(); ++i) {
    const float* src = g.data() + goff_[size_t(gidx_[i])] + ps[i].shard_first;
    tp_slice(ps[i], ps[i].tp_rank, local + ps[i].offset, src);  // a copy unless TP slices it
  }
}

std::vector<float> ParamState::global_params_values() { return to_global(local_params()); }
std::vector<float> ParamState::global_grads() { return to_global(local_grads()); }
std::vector<float> ParamState::global_moment(int which) {
  if (which == 1 && muon_) {
    const std::vector<float> st = v_state();
    const std::vector<float> full = gather_state(st.data());
    return to_global(full.data());
  }
  const std::vector<float> full = gather_state((which == 0 ? mbuf_ : vbuf_).data<float>());
  return to_global(full.data());
}

std::vector<float> ParamState::v_state() const {
  std::vector<float> st(size_t(ns_), 0.0f);
  const float* vb = vbuf_.data<float>();
  for (const AdamPiece& a : adam_) std::copy(vb + a.v, vb + a.v + a.n, st.begin() + a.st);
  return st;
}

void ParamState::set_v_state(const std::vector<float>& st) {
  float* vb = vbuf_.data<float>();
  for (const AdamPiece& a : adam_) std::copy(st.begin() + a.st, st.begin() + a.st + a.n, vb + a.v);
}

std::vector<float> ParamState::global_biases() {
  const size_t n_moe = own_.moe_rank.size();
  std::vector<float> g(n_moe * size_t(E_), 0.0f);
  for (int i : m_.local_moe_layers()) std::copy(m_.expert_bias(i), m_.expert_bias(i) + E_, g.begin() + i * E_);
  std::vector<int64_t> offs, sizes;
  for (size_t i = 0; i < n_moe; ++i) offs.push_back(int64_t(i) * E_), sizes.push_back(E_);
  gather_pp(g, offs, sizes, own_.moe_rank);
  return g;
}

void ParamState::set_params(const std::vector<float>& g) {
  if (zero3_) {
    std::vector<float> pf(static_cast<size_t>(np_));
    from_global(pf.data(), g);
    fsdp_->slice_flat(fsdp_->params(), pf.data());
  } else {
    from_global(m_.param_data(), g);
  }
}

void ParamState::set_moment(int which, const std::vector<float>& g) {
  std::vector<float> full(static_cast<size_t>(np_));
  from_global(full.data(), g);
  if (which == 1 && muon_) {
    std::vector<float> st(size_t(std::max<int64_t>(ns_, 1)), 0.0f);
    slice_state(st.data(), full);
    return set_v_state(st);
  }
  slice_state((which == 0 ? mbuf_ : vbuf_).data<float>(), full);
}

void ParamState::set_biases(const std::vector<float>& g) {
  MT_CHECK(g.size() == own_.moe_rank.size() * size_t(E_), "train", "expert biases of ", g.size(), " floats, expected ",
           own_.moe_rank.size() * size_t(E_));
  for (int i : m_.local_moe_layers()) std::copy(g.begin() + i * E_, g.begin() + (i + 1) * E_, m_.expert_bias(i));
}

}  // namespace moetron
