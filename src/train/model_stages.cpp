// model_stages.cpp: see model_stages.h. The plan (stages of this pipeline rank from the resolved layout and
// schedule), the ModelStage adapter, the per-micro-batch statistics, the forward-only chain and the
// tied-embedding exchange.
#include "train/model_stages.h"

#include <algorithm>

#include "moetron/check.h"
#include "moetron/fsdp.h"

namespace moetron {

PipelinePlan make_pipeline_plan(const JobConfig& cfg, int pp_rank) {
  PipelinePlan p;
  p.setup = resolve_pipeline(cfg);
  const sched::Schedule s = p.setup.from_csv ? p.setup.csv : sched::generate(p.setup.spec);
  p.lowered = s.lowered ? s : sched::lower(s);
  p.pp = p.lowered.pp;
  MT_CHECK(pp_rank >= 0 && pp_rank < p.pp, "pipeline", "pipeline rank ", pp_rank, " outside [0, ", p.pp, ")");
  p.pp_rank = pp_rank;
  const sched::PpLayout& lay = p.setup.layout;
  MT_CHECK(lay.n_stages == p.lowered.n_stages, "pipeline", "the layout has ", lay.n_stages,
           " stages but the schedule ", p.lowered.n_stages);
  for (int st = 0; st < lay.n_stages; ++st) {
    MT_CHECK(lay.stage_rank[size_t(st)] == p.lowered.stage_rank[size_t(st)], "pipeline", "stage ", st,
             " is on pipeline rank ", lay.stage_rank[size_t(st)], " in the layout but on rank ",
             p.lowered.stage_rank[size_t(st)], " in the schedule");
    if (lay.has_embedding(st)) p.first_stage_rank = lay.stage_rank[size_t(st)];
    if (lay.has_loss(st)) p.last_stage_rank = lay.stage_rank[size_t(st)];
    if (lay.stage_rank[size_t(st)] != pp_rank) continue;
    ModelStagePart part;
    part.stage = st;
    for (int l : lay.layers(st)) part.layers.push_back(l);
    part.embedding = lay.has_embedding(st), part.head = lay.has_loss(st);
    p.parts.push_back(part);
  }
  return p;
}

void MicroStats::add(const ForwardStats& s) {
  ce_sum += s.ce_sum, ce_count += s.ce_count, dropped += s.dropped;
  if (aux_by_layer.size() < s.aux_by_layer.size()) aux_by_layer.resize(s.aux_by_layer.size(), 0.0);
  if (z_by_layer.size() < s.z_by_layer.size()) z_by_layer.resize(s.z_by_layer.size(), 0.0);
  for (size_t i = 0; i < s.aux_by_layer.size(); ++i) aux_by_layer[i] += s.aux_by_layer[i];
  for (size_t i = 0; i < s.z_by_layer.size(); ++i) z_by_layer[i] += s.z_by_layer[i];
  if (mtp_ce.size() < s.mtp_ce.size()) mtp_ce.resize(s.mtp_ce.size(), 0.0), mtp_n.resize(s.mtp_ce.size(), 0);
  for (size_t i = 0; i < s.mtp_ce.size(); ++i) mtp_ce[i] += s.mtp_ce[i], mtp_n[i] += s.mtp_n[i];
}

ModelStage::ModelStage(int local, const ModelStagePart& part, int64_t act_floats)
    : local_(local), part_(part), act_(act_floats) {}

void ModelStage::setup(const pipeline::StageSetup& s) {
  MT_CHECK(s.stage == part_.stage, "pipeline", "the runtime set up stage ", s.stage, " for model stage ",
           part_.stage);
  MT_CHECK(s.weight_grads_in_mb_order, "pipeline", "stage ", s.stage,
           ": the schedule runs its weight gradients out of micro-batch order; the model accumulates them in "
           "place, which would change the result (use a schedule whose backward per stage is in micro-batch "
           "order: every built-in generator is)");
  slots_ = s.slots;
}

void ModelStage::forward(int mb, int slot, const float* in, float* out) {
  const ForwardStats st = m_->stage_forward(local_, slot, data_->tokens[size_t(mb)].data(),
                                            data_->targets[size_t(mb)].data(), in, out, true);
  (*stats_)[size_t(mb)].add(st);
}

void ModelStage::backward(int mb, int slot, const float* dout, float* din) {
  m_->stage_backward(local_, slot, data_->tokens[size_t(mb)].data(), dout, din, true);
}

void ModelStage::backward_input(int mb, int slot, const float* dout, float* din) {
  m_->stage_backward(local_, slot, data_->tokens[size_t(mb)].data(), dout, din, false);
}

void ModelStage::backward_weight(int, int slot) { m_->stage_backward_weight(local_, slot); }

ForwardStats pipeline_forward_only(Model& m, const PipelinePlan& plan, const Comm& pp, const int32_t* tokens,
                                   const int32_t* targets) {
  const int tag = pipeline::kPipelineTag + 1;
  const int64_t n = m.residual_rows() * m.spec().d_model;
  std::vector<float> in(static_cast<size_t>(n)), out(static_cast<size_t>(n));
  std::vector<CommRequest> sends;
  std::vector<std::vector<float>> send_bufs;
  send_bufs.reserve(size_t(m.n_stages()));  // posted sends keep pointing at their buffer
  ForwardStats total;
  for (int k = 0; k < m.n_stages(); ++k) {
    const ModelStagePart& part = m.stage_part(k);
    const int prev = part.stage > 0 ? plan.lowered.stage_rank[size_t(part.stage - 1)] : -1;
    const int next = part.head ? -1 : plan.lowered.stage_rank[size_t(part.stage + 1)];
    if (!part.embedding) {
      if (prev == plan.pp_rank) in.swap(out);  // the previous local stage's output
      else pp.recv(in.data(), n * 4, prev, tag);
    }
    const ForwardStats st = m.stage_forward(k, 0, tokens, targets, part.embedding ? nullptr : in.data(),
                                            part.head ? nullptr : out.data(), false);
    total.ce_sum += st.ce_sum, total.ce_count += st.ce_count, total.dropped += st.dropped;
    if (!part.head && next != plan.pp_rank) {
      send_bufs.push_back(out);
      sends.push_back(pp.isend(send_bufs.back().data(), n * 4, next, tag));
    }
  }
  if (!sends.empty()) pp.wait_all(sends.data(), sends.size());
  if (pp.size() > 1) {  // the head rank's loss to every pipeline rank (the others add exact zeros)
    pp.all_reduce(&total.ce_sum, 1);
    pp.all_reduce(&total.ce_count, 1);
  }
  return total;
}

namespace {

// FSDP (zero = 3) with MTP: the head stage folded its depths' embedding rows into its embedding copy's unit during the
// backward (model_mtp.cpp), so each rank holds its block of that copy's gradient shard. The copy and the original are
// one parameter each, sharded over the same group, so rank r of the first stage and rank r of the last hold the same
// elements: the first adds the last's block after its own and sends the sum back; both copies update alike.
void exchange_fsdp_copy(Model& m, const PipelinePlan& plan, const Comm& pp) {
  if (plan.first_stage_rank == plan.last_stage_rank) return;  // the embedding's backward folded them (embed_backward)
  if (plan.pp_rank != plan.first_stage_rank && plan.pp_rank != plan.last_stage_rank) return;
  Fsdp& f = *m.fsdp();
  const FsdpUnit& u = f.unit(0);
  MT_CHECK(u.runs.size() == 1 && u.runs[0].params.size() == 1 && m.params()[size_t(u.runs[0].params[0])].name == "embed",
           "exchange_tied_grads", "FSDP unit 0 of pipeline rank ", plan.pp_rank, " is not the embedding alone");
  const int tag = pipeline::kPipelineTag + 2;
  float* g = f.grads() + u.runs[0].shard_offset;
  const int64_t n = u.runs[0].chunk, bytes = n * 4;
  if (plan.pp_rank == plan.last_stage_rank) {
    pp.send(g, bytes, plan.first_stage_rank, tag);
    pp.recv(g, bytes, plan.first_stage_rank, tag);  // the sum: both copies update alike
  } else {
    std::vector<float> last(static_cast<size_t>(n));
    pp.recv(last.data(), bytes, plan.last_stage_rank, tag);
    for (int64_t i = 0; i < n; ++i) g[i] += last[size_t(i)];
    pp.send(g, bytes, plan.last_stage_rank, tag);
  }
}

}  // namespace

void exchange_tied_grads(Model& m, const PipelinePlan& plan, const Comm& pp) {
  // Tied embeddings or MTP (its depths embed tokens on the head stage): the head stage's embedding gradient.
  if (!m.spec().tie_embeddings && m.spec().mtp_layers == 0) return;
  if (m.fsdp()) return exchange_fsdp_copy(m, plan, pp);  // tied under FSDP: one stage only (refused otherwise)
  if (plan.first_stage_rank == plan.last_stage_rank) {
    if (plan.pp_rank == plan.first_stage_rank) m.fold_tied_head_grad();
    return;
  }
  const int tag = pipeline::kPipelineTag + 2;
  const ParamEntry& e = m.param("embed");
  const int64_t bytes = e.numel * 4;
  float* g = m.grad_data() + e.offset;
  if (plan.pp_rank == plan.last_stage_rank) {
    pp.send(m.tied_head_grad(), bytes, plan.first_stage_rank, tag);
    std::fill(m.tied_head_grad(), m.tied_head_grad() + e.numel, 0.0f);
    pp.recv(g, bytes, plan.first_stage_rank, tag);  // the folded sum: both copies update alike
  } else if (plan.pp_rank == plan.first_stage_rank) {
    std::vector<float> head(size_t(e.numel));
    pp.recv(head.data(), bytes, plan.last_stage_rank, tag);
    for (int64_t i = 0; i < e.numel; ++i) g[i] += head[size_t(i)];
    pp.send(g, bytes, plan.last_stage_rank, tag);
  }
}

}  // namespace moetron
