// muon_state.cpp: MuonState (see muon_state.h): the owners of the matrices, the two exchanges of a shard group and
// the per-matrix Newton-Schulz. Not the kernels (src/kernels/muon.cpp) and not the state's layout (param_state.cpp).
#include "train/muon_state.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "moetron/check.h"
#include "moetron/muon.h"
#include "moetron/trace.h"

namespace moetron {

namespace {
int64_t overlap(int64_t a0, int64_t a1, int64_t b0, int64_t b1) { return std::max<int64_t>(0, std::min(a1, b1) - std::max(a0, b0)); }

// Newton-Schulz work of one stacked matrix (multiply-adds per iteration, over its column blocks).
double ns_cost(const MuonMatrices& mm) {
  double c = 0;
  for (int64_t s : mm.col_segs) {
    const double lo = double(std::min(mm.rows, s)), hi = double(std::max(mm.rows, s));
    c += 2 * lo * lo * hi + lo * lo * lo;
  }
  return c;
}
}  // namespace

MuonState::MuonState(std::vector<MuonBlock> blocks, float momentum, bool nesterov, int ns_steps, int64_t batch)
    : mu_(momentum), nesterov_(nesterov), steps_(ns_steps) {
  MT_CHECK(batch >= 1, "muon", "batch of ", batch, " elements");
  int64_t max_mine = 0, max_owned = 0, max_work = 0;
  for (auto& b : blocks) {
    const int S = b.comm ? b.comm->size() : 1;
    MT_CHECK(int(b.bounds.size()) == S + 1 && b.me >= 0 && b.me < S, "muon", "a block of ", b.bounds.size(),
             " bounds for a group of ", S);
    if (b.params.empty()) continue;
    std::vector<Slab> slabs;
    std::vector<double> load(size_t(S), 0.0);
    for (size_t j = 0; j < b.params.size(); ++j) {
      const MuonMatrices& mm = b.params[j].mm;
      const int64_t sz = mm.rows * mm.cols;
      const double cost = ns_cost(mm);
      for (int64_t k = 0; k < mm.count; ++k) {
        const int o = int(std::min_element(load.begin(), load.end()) - load.begin());  // the least loaded, lowest
        load[size_t(o)] += cost;
        slabs.push_back({int(j), b.params[j].start + k * sz, b.params[j].start + (k + 1) * sz, o});
      }
      for (int64_t s : mm.col_segs) max_work = std::max(max_work, muon_ns_workspace(mm.rows, s));
    }
    // Batches of consecutive matrices of at most `batch` elements (or one matrix), each exchanged and computed on
    // its own: the buffers stay bounded whatever the model's size.
    const int64_t blo = b.bounds[size_t(b.me)], bhi = b.bounds[size_t(b.me) + 1];
    for (size_t s0 = 0; s0 < slabs.size();) {
      size_t s1 = s0 + 1;
      int64_t n = slabs[s0].hi - slabs[s0].lo;
      while (s1 < slabs.size() && n + (slabs[s1].hi - slabs[s1].lo) <= batch) n += slabs[s1].hi - slabs[s1].lo, ++s1;
      Group g;
      g.b = b;
      g.slabs.assign(slabs.begin() + long(s0), slabs.begin() + long(s1));
      s0 = s1;
      g.to_owner.assign(size_t(S), 0), g.from_rank.assign(size_t(S), 0);
      for (const Slab& s : g.slabs) {
        g.to_owner[size_t(s.owner)] += overlap(s.lo, s.hi, blo, bhi);
        if (s.owner != b.me) continue;
        ++owned_;
        for (int q = 0; q < S; ++q) g.from_rank[size_t(q)] += overlap(s.lo, s.hi, b.bounds[size_t(q)], b.bounds[size_t(q) + 1]);
      }
      g.to_owner_at.assign(size_t(S), 0), g.from_rank_at.assign(size_t(S), 0);
      for (int q = 1; q < S; ++q) {
        g.to_owner_at[size_t(q)] = g.to_owner_at[size_t(q - 1)] + g.to_owner[size_t(q - 1)];
        g.from_rank_at[size_t(q)] = g.from_rank_at[size_t(q - 1)] + g.from_rank[size_t(q - 1)];
      }
      std::vector<int64_t> pos = g.to_owner_at;  // each piece's place in the send layout: by owner, matrix order
      for (Slab& s : g.slabs) s.at = pos[size_t(s.owner)], pos[size_t(s.owner)] += overlap(s.lo, s.hi, blo, bhi);
      for (int q = 0; q < S; ++q) g.mine += g.to_owner[size_t(q)], g.owned_numel += g.from_rank[size_t(q)];
      max_mine = std::max(max_mine, g.mine), max_owned = std::max(max_owned, g.owned_numel);
      groups_.push_back(std::move(g));
    }
  }
  xbuf_.resize(size_t(std::max(max_mine, max_owned)));  // unsharded groups use it for both
  sbuf_.resize(size_t(2 * max_owned));
  threads_ = std::max(1, omp_get_max_threads());
  work_per_thread_ = max_work;
  work_.resize(size_t(max_work) * size_t(threads_));
}

void MuonState::step(float lr, float weight_decay, float grad_scale) {
  trace::Scope tr("optim.muon");
  for (auto& g : groups_) group_step(g, lr, weight_decay, grad_scale);
}

void MuonState::group_step(Group& gr, float lr, float wd, float clip) {
  const MuonBlock& b = gr.b;
  const int S = b.comm ? b.comm->size() : 1;
  const int64_t blo = b.bounds[size_t(b.me)], bhi = b.bounds[size_t(b.me) + 1];
  float* x = xbuf_.data();
  // 1. Momentum and X of this rank's pieces, packed by owner in matrix order (Slab::at), a matrix per work item.
  const int64_t ns = int64_t(gr.slabs.size());
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads_) if (ns > 1)
  for (int64_t i = 0; i < ns; ++i) {
    const Slab& s = gr.slabs[size_t(i)];
    const int64_t a = std::max(s.lo, blo), e = std::min(s.hi, bhi);
    if (a < e) muon_momentum(b.m + (a - blo), x + s.at, b.g + (a - blo), e - a, mu_, nesterov_, clip);
  }
  // 2. The owned matrices, whole and in order (without sharding: x already is).
  float* mats = x;
  float* recv = sbuf_.data() + gr.owned_numel;
  auto bytes = [&](int k, const std::vector<int64_t>& v) -> int64_t* {
    bytes_[k].resize(v.size());
    for (size_t q = 0; q < v.size(); ++q) bytes_[k][q] = v[q] * 4;
    return bytes_[k].data();
  };
  // Walks the owned matrices' pieces in the receive layout (by source rank, then matrix order), calling
  // f(recv offset, matrix buffer offset, count).
  auto walk_owned = [&](auto&& f) {
    for (int q = 0; q < S; ++q) {
      int64_t at = gr.from_rank_at[size_t(q)], base = 0;
      for (const Slab& s : gr.slabs) {
        if (s.owner != b.me) continue;
        const int64_t a = std::max(s.lo, b.bounds[size_t(q)]), e = std::min(s.hi, b.bounds[size_t(q) + 1]);
        if (a < e) f(at, base + (a - s.lo), e - a), at += e - a;
        base += s.hi - s.lo;
      }
    }
  };
  if (S > 1) {
    MT_TRACE("muon.gather");
    b.comm->all_to_all_v(recv, bytes(0, gr.from_rank), bytes(1, gr.from_rank_at), x, bytes(2, gr.to_owner),
                         bytes(3, gr.to_owner_at));
    mats = sbuf_.data();
    walk_owned([&](int64_t r, int64_t m, int64_t n) { std::memcpy(mats + m, recv + r, size_t(n) * 4); });
  }
  // 3. U = scale * NS(X) per column block of each owned matrix. Many matrices (the routed experts): one thread each,
  // in one parallel region (its GEMMs then run on the calling thread: nested regions are inactive); few: one after
  // the other, each GEMM over all threads. The bits are the same either way (gemm_f32 is thread-count invariant).
  {
    MT_TRACE("muon.newton_schulz");
    struct Task {
      float* x;
      int64_t rows, seg, ld;
    };
    std::vector<Task> tasks;
    int64_t base = 0;
    for (const Slab& s : gr.slabs) {
      if (s.owner != b.me) continue;
      const MuonMatrices& mm = b.params[size_t(s.param)].mm;
      int64_t c0 = 0;
      for (int64_t seg : mm.col_segs) tasks.push_back({mats + base + c0, mm.rows, seg, mm.cols}), c0 += seg;
      base += s.hi - s.lo;
    }
    const int64_t nt = int64_t(tasks.size());
    auto run = [&](const Task& t, float* work) {
      newton_schulz(t.x, t.rows, t.seg, t.ld, steps_, muon_scale(t.rows, t.seg), work);
    };
    if (nt >= 4 * threads_) {
#pragma omp parallel num_threads(threads_)
      {
        float* work = work_.data() + size_t(omp_get_thread_num()) * size_t(work_per_thread_);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nt; ++i) run(tasks[size_t(i)], work);
      }
    } else {
      for (const Task& t : tasks) run(t, work_.data());
    }
  }
  // 4. The update's pieces back to their ranks, then applied.
  if (S > 1) {
    MT_TRACE("muon.scatter");
    walk_owned([&](int64_t r, int64_t m, int64_t n) { std::memcpy(recv + r, mats + m, size_t(n) * 4); });
    b.comm->all_to_all_v(x, bytes(0, gr.to_owner), bytes(1, gr.to_owner_at), recv, bytes(2, gr.from_rank),
                         bytes(3, gr.from_rank_at));
  }
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads_) if (ns > 1)
  for (int64_t i = 0; i < ns; ++i) {
    const Slab& s = gr.slabs[size_t(i)];
    const int64_t a = std::max(s.lo, blo), e = std::min(s.hi, bhi);
    if (a < e) muon_apply(b.p + (a - blo), x + s.at, e - a, lr, wd, b.params[size_t(s.param)].decay);
  }
}

}  // namespace moetron
