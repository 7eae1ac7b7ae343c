// train_step.cpp: one optimizer step of TrainSession: the schedule (PipelineExecutor), the step-wide
// quantities folded over micro-batches, pipeline stages and data-parallel ranks, the gradient norm and
// clipping, the optimizer (AdamW, or Muon and AdamW), the aux-free bias update, the step record, its log line and its checkpoint; the non-finite
// decision (training.nonfinite, one answer on every rank) and the MOETRON_FAULT hook points (fault.h:
// forward, backward, optimizer, checkpoint).
//
// Step-wide quantities under pipeline parallelism (each rank holds some stages):
//   - losses: a micro-batch's cross-entropy comes from the head stage, its router aux / z losses from the
//     stages holding MoE layers, one value per MoE layer. They are summed over the pipeline ranks (every
//     value has exactly one nonzero source, so the sum is exact) and then folded in micro-batch and layer
//     order, the same additions one process makes;
//   - the gradients need no pipeline reduction (each rank holds its stages' parameters) except tied
//     embeddings, whose head gradient joins the embedding's between the first and the last stage's ranks;
//   - the gradient norm folds per-parameter sums in global order (ParamState::grad_norm);
//   - the aux-free expert counts are per MoE layer, each on its stage's ranks, summed over DP.
#include <chrono>
#include <cmath>

#include "moetron/check.h"
#include "moetron/trace.h"
#include "train/train_session.h"

namespace moetron {

StepTotals TrainSession::forward_backward() {
  StepTotals t;
  model->begin_grads();  // no zeroing pass: the first weight-gradient GEMMs write, settle_grads() zeroes the rest
  // Normalized by the GLOBAL token count of the step (every target of the synthetic / loader data is valid).
  model->set_loss_scales(float(1.0 / double(G * T)), float(1.0 / double(micro)));
  const bool record_seqs = opt.record_data && pp_rank == plan.first_stage_rank;
  std::vector<uint64_t> seqs;
  const bool rec = trace::enabled() && record.steps.size() < kMaxRecordedSteps;  // a profiled step
  const bool nan_loss = fault_point(FaultPhase::Forward);
  StepOutcome o = exec->run(*data.train, B, T, rec, record_seqs ? &seqs : nullptr);
  model->settle_grads();
  if (fault_point(FaultPhase::Backward)) state->poison_grad();
  t.runtime = o.runtime;
  if (rec) record.steps.push_back(exec->gather_record(step, o, mcs.pp));
  for (size_t k = 0; k < seqs.size(); ++k)
    res.data.push_back({step, rank * (G / D) + int64_t(k), seqs[k]});
  exchange_tied_grads(*model, plan, mcs.pp);

  // Per micro-batch: [ce, aux of MoE layer 0, 1, ...], summed over the pipeline ranks.
  const int n_moe = model->n_moe_layers_total();
  const size_t w = size_t(1 + n_moe);
  std::vector<double> per(size_t(micro_local) * w, 0.0);
  int64_t ce_n = 0;
  for (int64_t mb = 0; mb < micro_local; ++mb) {
    const MicroStats& s = o.micro[size_t(mb)];
    per[size_t(mb) * w] = mb == 0 && nan_loss ? std::nan("") : s.ce_sum;
    for (size_t l = 0; l < s.aux_by_layer.size() && l < size_t(n_moe); ++l) per[size_t(mb) * w + 1 + l] = s.aux_by_layer[l];
    ce_n += s.ce_count;
  }
  if (PP > 1) mcs.pp.all_reduce(per.data(), int64_t(per.size())), mcs.pp.all_reduce(&ce_n, 1);
  // CP: every rank holds a share of each sequence; its losses are its share (rank-order sum over the CP group).
  if (mesh.cp() > 1) mcs.cp.all_reduce(per.data(), int64_t(per.size())), mcs.cp.all_reduce(&ce_n, 1);
  std::vector<double> ce_parts(static_cast<size_t>(micro_local)), aux_parts(static_cast<size_t>(micro_local));
  for (int64_t mb = 0; mb < micro_local; ++mb) {
    ce_parts[size_t(mb)] = per[size_t(mb) * w];
    double aux = 0;
    for (int l = 0; l < n_moe; ++l) aux += per[size_t(mb) * w + 1 + size_t(l)];
    aux_parts[size_t(mb)] = aux / double(micro);
  }
  // MTP: per micro-batch and depth [ce sums | counts], from the head stage (exact over pp), folded like ce over DP.
  const int64_t Dm = cfg.model.mtp_layers;
  if (Dm > 0) {
    std::vector<double> mce(size_t(micro_local * Dm), 0.0);
    std::vector<int64_t> mn(size_t(Dm), 0);
    for (int64_t mb = 0; mb < micro_local; ++mb) {
      const MicroStats& s = o.micro[size_t(mb)];
      for (size_t k = 0; k < s.mtp_ce.size() && k < size_t(Dm); ++k)
        mce[size_t(mb * Dm) + k] = s.mtp_ce[k], mn[k] += s.mtp_n[k];
    }
    if (PP > 1) mcs.pp.all_reduce(mce.data(), int64_t(mce.size())), mcs.pp.all_reduce(mn.data(), Dm);
    // CP: each rank's sums are over its chunks' positions (rank-order sum over the CP group, as the main loss's)
    if (mesh.cp() > 1) mcs.cp.all_reduce(mce.data(), int64_t(mce.size())), mcs.cp.all_reduce(mn.data(), Dm);
    t.mtp_ce.assign(size_t(Dm), 0.0);
    mcs.dp.all_reduce_ordered(t.mtp_ce.data(), mce.data(), micro_local, Dm);
    if (D > 1) mcs.dp.all_reduce(mn.data(), Dm);
    t.mtp_n = mn;
  }
  t.counts = model->take_expert_counts();
  {
    // DP: loss sums folded in global micro-batch order (= the single-process sum); gradients, token and
    // expert counts summed over the ranks.
    MT_TRACE_MODULE("grad_reduce");
    mcs.dp.all_reduce_ordered(&t.ce, ce_parts.data(), micro_local, 1);
    mcs.dp.all_reduce_ordered(&t.aux, aux_parts.data(), micro_local, 1);
    if (D > 1) mcs.dp.all_reduce(&ce_n, 1);
    state->reduce_grads();  // TP's partial gradients, then over DP (and CP)
    if (gdp.size() > 1) {
      std::vector<int64_t> flat;
      for (auto& c : t.counts) flat.insert(flat.end(), c.begin(), c.end());
      gdp.all_reduce(flat.data(), int64_t(flat.size()));
      size_t k = 0;
      for (auto& c : t.counts)
        for (auto& x : c) x = flat[k++];
    }
  }
  t.ce_n = ce_n;
  return t;
}

void TrainSession::run_step() {
  const auto& tr = cfg.training;
  // Profiled steps ([profiling] start_step .. end_step; by default the first step, which warms caches and oneDNN
  // primitives, is not).
  const bool prof = profiled(step + 1);
  trace::enable(prof);
  if (prof) trace_step_begin();
  const auto t0 = std::chrono::steady_clock::now();
  ++step;
  StepTotals t = forward_backward();
  trace::Module tr_opt("optimizer");
  {
    MT_TRACE("optim.grad_norm");
    t.grad_norm = state->grad_norm();
  }
  if (opt.keep_first_grads && step == res.start_step + 1) res.first_grads = state->global_grads();
  const double loss = t.ce_n ? t.ce / double(t.ce_n) : 0;
  fault_point(FaultPhase::Optimizer);
  const bool skip = nonfinite_step(loss, t.grad_norm);
  adam.lr = float(lr_at(cfg.optimizer, cfg.lr_scheduler, step, tr.steps));
  if (!skip) {
    const float clip = tr.max_norm > 0 ? clip_coefficient(t.grad_norm, tr.max_norm) : 1.0f;
    state->step(adam, step, clip);  // AdamW, or Muon + AdamW; then the weights' compute copies
    model->update_expert_bias(t.counts);
  }
  t.fp8 = model->fp8_end_step(world);  // collective: the step's amaxes over every rank (delayed: the histories)
  tr_opt.stop();
  if (prof) trace_step_end(step);
  trace::enable(false);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  time_total += dt, tokens_total += G * T, window_t += dt, window_tok += G * T, ++window_steps;

  StepRecord rec;
  rec.step = step, rec.loss = loss, rec.skipped = skip, rec.aux_loss = t.aux, rec.lr = adam.lr;
  for (size_t k = 0; k < t.mtp_ce.size(); ++k)  // weight * mean over depths of each depth's mean cross-entropy
    rec.mtp_loss += t.mtp_n[k] ? t.mtp_ce[k] / double(t.mtp_n[k]) : 0.0;
  if (!t.mtp_ce.empty()) rec.mtp_loss *= cfg.model.mtp_loss_weight / double(t.mtp_ce.size());
  rec.grad_norm = t.grad_norm;
  rec.seconds = dt;
  if (opt.record_param_hash) {
    const std::vector<float> p = state->global_params_values(), b = state->global_biases();
    rec.param_hash = fnv1a(b.data(), b.size() * 4, fnv1a(p.data(), p.size() * 4));
  }
  const bool do_val = tr.val_interval > 0 && (step % tr.val_interval == 0 || step == tr.steps);
  if (do_val) rec.val_loss = validate();
  res.history.push_back(rec);
  log_step(rec, t, do_val);
  if (cfg.checkpoint.enable && (step % std::max<int64_t>(1, cfg.checkpoint.interval) == 0 || step == tr.steps)) {
    if (fault_point(FaultPhase::Checkpoint)) state->poison_param();
    save(step);
  }
}

bool TrainSession::fault_point(FaultPhase phase) {
  if (faults.empty()) return false;
  bool nan = false;
  for (const FaultSpec& f : faults.take(phase, step)) {
    if (f.rank == world.rank()) FaultInjector::act(f);  // message; kill and delay act here
    if (f.kind == FaultKind::Nan) nan = true;
    // A mismatch fault is known to every rank (FaultInjector keeps it): the others run the other side.
    if (f.kind == FaultKind::Mismatch) {
      // The faulty rank enters a barrier; the others, at the same point, an all_reduce: a collective that never
      // matches (the watchdog's test, docs/reliability.md).
      int64_t x[4] = {0, 0, 0, 0};
      if (world.rank() == f.rank) world.barrier();
      else world.all_reduce(x, 4);
    }
  }
  return nan;
}

bool TrainSession::nonfinite_step(double loss, double grad_norm) {
  int32_t bad = std::isfinite(loss) && std::isfinite(grad_norm) ? 0 : 1;
  if (world.size() > 1) world.all_reduce(&bad, 1);  // one decision for all ranks
  if (bad == 0) return false;
  if (cfg.training.nonfinite == "skip") {
    ++skipped_steps;
    if (say)
      std::printf("step %lld: loss %g, gradient norm %g: not finite, optimizer step skipped (%lld skipped so far; "
                  "training.nonfinite = skip)\n", (long long)step, loss, grad_norm, (long long)skipped_steps);
    return true;
  }
  // halt: find the first non-finite gradient in global parameter order (collective: the global gather).
  const std::vector<float> g = state->global_grads();
  std::string where = "every gradient is finite (the loss is not: the forward produced it)";
  for (const auto& e : state->global_params()) {
    int64_t i = 0;
    while (i < e.numel && std::isfinite(g[size_t(e.offset + i)])) ++i;
    if (i == e.numel) continue;
    where = "the first non-finite gradient in parameter order is " + e.name +
            (e.layer >= 0 ? " (layer " + std::to_string(e.layer) + ")" : std::string(" (not in a layer)")) +
            ", element " + std::to_string(i) + " = " + std::to_string(g[size_t(e.offset + i)]);
    break;
  }
  MT_FAIL("train", "step ", step, ": loss ", loss, ", gradient norm ", grad_norm, " not finite; ", where,
          " (training.nonfinite = halt; \"skip\" skips such steps)");
}

}  // namespace moetron
