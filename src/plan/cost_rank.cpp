// cost_rank.cpp: the per-rank step-time terms of cost_rank.h (the optimizer, Muon's Newton-Schulz, the weight
// refresh), each priced from the rank's memory projection and the hardware's rates, and the data-parallel windows
// read off a pipeline replay. Not the pipeline.
#include "cost_rank.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "moetron/muon_params.h"

namespace moetron::plan {

// Optimizer of one rank: zero the gradient buffer once per step (write what the rank holds; not in the engine without
// FSDP, whose first weight-gradient GEMMs of a step write instead of adding: Model::begin_grads; what it still zeroes
// on first use, the embedding, head and norm gradients, is left out, ~6 % of ds_mini's gradients); the gradient norm
// (read the gradients: the shard under a distributed optimizer or FSDP, every local one in the engine without
// FSDP); AdamW over the shard (read and write parameters, main parameters and moments, read gradients), at the
// measured per-element rate when the hardware file has one.
double optimizer_rank(const Layout& l, const Hardware& h, const Recipe& rc, const RankMemory& rm) {
  const double Pd = rm.params_tp_sharded + rm.params_replicated, Pe = rm.params_experts;
  const double bw = h.stream_bw();
  const double per_elem = 2 * (rc.param + rc.compute_copy) + 2 * rc.main + 4 * rc.moment + rc.grad;
  const double adamw = h.optimizer_per_param > 0 ? rm.optimizer_elements * h.optimizer_per_param
                                                 : rm.optimizer_elements * per_elem / bw;
  const double norm_elems = rc.engine_buffers && l.zero < 3 ? Pd + Pe : rm.optimizer_elements;
  const double norm = h.grad_norm_per_param > 0 ? norm_elems * h.grad_norm_per_param : norm_elems * rc.grad / bw;
  const double zeroing = rc.engine_buffers && l.zero < 3 ? 0.0 : rm.grads / bw;
  return zeroing + norm + adamw;
}

// Muon's Newton-Schulz on one pipeline rank (optimizer.name = "muon"; muon_params.h, docs/optimizer.md): every
// matrix of its stages' layers (the routed experts: its E / ep), three GEMMs an iteration priced on the GEMM curve.
// Under a distributed optimizer or FSDP the matrices are spread over their shard group's ranks by owner (the
// non-expert ones over dp x cp, or the zero-3 shard group; the experts over their expert-data-parallel group): the
// average rank's share, so the busiest rank may own one matrix more. Without sharding every rank computes every
// matrix it holds. The engine recipe runs it in fp32 through its own fp32 GEMM (achievable_fp32 when measured);
// a GPU recipe in bf16. Under TP the sliced matrices' work is divided over the TP ranks (an assumption: the engine
// refuses Muon with tp > 1).
double newton_schulz_rank(const JobConfig& c, const Layout& l, const Hardware& h, const Recipe& rc,
                          const StagePlan& sp, int r) {
  if (!c.optimizer.muon()) return 0;
  const bool fp32 = rc.engine_buffers && h.achievable_fp32 > 0;
  auto rate = [&](double m, double n, double k) {
    return fp32 ? h.achievable_fp32 * h.gemm_eff(std::min({m, n, k})) : h.gemm_rate(m, n, k, false);
  };
  const int64_t shard = l.zero == 3 && l.dp_shard > 0 ? l.dp_shard : l.dp;
  const double dense_div = l.zero == 0 ? 1.0 : double(shard * l.cp);
  const double expert_div = l.zero == 0 ? 1.0 : std::max(1.0, double(l.edp()) * double(shard) / double(l.dp));
  const double steps = double(c.optimizer.muon_ns_steps);
  double t = 0;
  // The matrices of the rank's layers; the last stage adds each MTP depth's block (the last layer's kind) and its
  // eh_proj (2d x d).
  std::vector<std::pair<MuonShape, double>> mats;  // a layer's matrices, how many such layers
  for (int st : sp.rank_stages[size_t(r)]) {
    for (int layer : sp.stage_layers[size_t(st)])
      for (const MuonShape& m : muon_layer_matrices(c.model, layer)) mats.push_back({m, 1.0});
    if (sp.last[size_t(st)] && c.model.mtp_layers > 0) {
      const double D = double(c.model.mtp_layers);
      for (const MuonShape& m : muon_layer_matrices(c.model, c.model.n_layers - 1)) mats.push_back({m, D});
      mats.push_back({MuonShape{MuonShape::Kind::Sliced, 1, 2 * c.model.d_model, c.model.d_model}, D});
    }
  }
  for (const auto& [m, layers] : mats) {
    const double a = double(std::min(m.rows, m.cols)), b = double(std::max(m.rows, m.cols));
    const double one =
        steps * (2 * a * a * b / rate(a, a, b) + 2 * a * a * a / rate(a, a, a) + 2 * a * b * a / rate(a, b, a));
    const bool expert = m.kind == MuonShape::Kind::Experts;
    const double count = expert ? double(m.count) / double(l.ep) : double(m.count);
    const double div = expert ? expert_div : dense_div * (m.kind == MuonShape::Kind::Sliced ? double(l.tp) : 1.0);
    t += layers * count * one / div;
  }
  return t;
}

// Weight refresh of one rank (the engine's convention; a bf16 GPU recipe has none): every local weight's compute
// copy (read the master, write the copy; not of the routed experts outside FSDP) and the routed experts' packed
// GEMM layouts, once per step; under FSDP
// each gathered unit is refreshed where it is gathered, twice per micro-batch (forward and backward). Where every
// master is on the rank (zero 0, or zero 1 without a group to shard over) the engine refreshes each piece of masters
// right after its AdamW update (Model::update_and_sync): the masters are read from cache, not memory, and the
// packs cost what the calibration measured fused.
double refresh_rank(const Layout& l, const Hardware& h, const Recipe& rc, const RankMemory& rm) {
  const double Pd = rm.params_tp_sharded + rm.params_replicated, Pe = rm.params_experts;
  const double bw = h.stream_bw();
  const bool fused = l.zero == 0 || (l.zero == 1 && l.dp * l.cp == 1);
  // The engine's refresh converts every parameter but the routed experts, which their GEMMs read only in the
  // packed layouts; FSDP converts each gathered unit whole.
  const double copied = l.zero == 3 ? Pd + Pe : Pd;
  const double copy = rc.compute_copy > 0 ? copied * ((fused ? 0.0 : rc.param) + rc.compute_copy) / bw : 0.0;
  const double read = fused ? 0.0 : rc.compute_copy > 0 ? rc.compute_copy : rc.param;
  const double pack = rc.expert_packed <= 0                               ? 0.0
                      : fused && h.expert_pack_fused_per_param > 0        ? Pe * h.expert_pack_fused_per_param
                      : h.expert_pack_per_param > 0                       ? Pe * h.expert_pack_per_param
                                                                          : Pe * (rc.expert_packed + read) / bw;
  const double refreshes = l.zero == 3 ? 2.0 * double(l.microbatches) : 1.0;
  return refreshes * (copy + pack);
}

double reduce_overrun(std::vector<DpWindow> w, double total, double end) {
  std::sort(w.begin(), w.end(), [](const DpWindow& a, const DpWindow& b) { return a.last_bwd_start < b.last_bwd_start; });
  double t = 0;
  for (const DpWindow& x : w) t = std::max(t, x.last_bwd_start) + x.share * total;
  return std::max(0.0, t - end);
}
double gather_stall(std::vector<DpWindow> w, double total) {
  std::sort(w.begin(), w.end(), [](const DpWindow& a, const DpWindow& b) { return a.first_fwd_end < b.first_fwd_end; });
  double t = 0, stall = 0;
  for (const DpWindow& x : w) t += x.share * total, stall = std::max(stall, t - x.first_fwd_end);
  return stall;
}
std::vector<std::vector<DpWindow>> dp_windows(const sched::TimedResult& r, int pp, int n_stages) {
  std::vector<std::vector<DpWindow>> w(size_t(pp), std::vector<DpWindow>(size_t(n_stages), DpWindow{}));
  std::vector<std::vector<char>> seen(size_t(pp), std::vector<char>(size_t(n_stages), char(0)));
  for (const sched::TimedOp& op : r.ops) {
    const sched::Action& a = op.action;
    auto& row = w[size_t(op.rank)];
    int fwd = -1, bwd = -1;
    if (a.op == sched::Op::F) fwd = a.stage;
    else if (a.op == sched::Op::B || a.op == sched::Op::W) bwd = a.stage;
    else if (a.op == sched::Op::FB) fwd = a.stage, bwd = a.op2 == sched::Op::B ? a.stage2 : -1;
    if (fwd >= 0 && !seen[size_t(op.rank)][size_t(fwd)]) row[size_t(fwd)].first_fwd_end = op.end, seen[size_t(op.rank)][size_t(fwd)] = 1;
    if (bwd >= 0) row[size_t(bwd)].last_bwd_start = std::max(row[size_t(bwd)].last_bwd_start, op.start);
  }
  // Carried weight gradients (Durations::carry_w): a stage's gradients are final when its last one runs.
  for (const sched::TimedOp& op : r.carried) {
    double& t = w[size_t(op.rank)][size_t(op.action.stage)].last_bwd_start;
    t = std::max(t, op.start);
  }
  return w;
}

}  // namespace moetron::plan
