// layout.cpp: the planner's layout of a job (plan/layout.h): built from the [parallelism] keys and a world
// size, checked rule by rule (each message names the key), and written back into a JobConfig so that the
// shared pipeline resolution sees the planner's dp. Not a cost model.
#include "moetron/plan/layout.h"

#include <sstream>

#include "moetron/check.h"
#include "moetron/parallel_rules.h"

namespace moetron::plan {

std::string Layout::describe() const {
  std::ostringstream os;
  os << "tp" << tp << (tp > 1 && sp ? "+sp" : "") << " cp" << cp << " pp" << pp << " vpp" << vpp << " ep" << ep;
  if (etp > 1) os << " etp" << etp;
  os << " dp" << dp << " zero" << zero;
  if (zero == 3 && dp_shard > 0 && dp_shard < dp) os << "(shard " << dp_shard << ")";
  os << " " << schedule << (ep_overlap ? "+a2a_overlap" : "") << (ep_overlap_split ? "+split" : "") << " mbs" << mbs << " m" << microbatches << " ac="
     << to_string(recompute);
  if (recompute == AcMode::Selective) {
    os << "(";
    for (size_t i = 0; i < recompute_modules.size(); ++i) os << (i ? "," : "") << recompute_modules[i];
    os << ")";
  }
  if (recompute != AcMode::None && recompute_layers >= 0) os << "x" << recompute_layers;
  return os.str();
}

namespace {
template <class... A>
std::string msg(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}
}  // namespace

std::string layout_error(const JobConfig& c, const Layout& l, int64_t gbs) {
  const ModelSpec& m = c.model;
  if (l.tp < 1 || l.cp < 1 || l.pp < 1 || l.vpp < 1 || l.dp < 1 || l.ep < 1 || l.etp < 1 || l.mbs < 1)
    return msg("every parallel degree must be >= 1 (", l.describe(), ")");
  if (std::string e = parallel_degree_error(m, c.training.seq_len,
          {.tp = l.tp, .cp = l.cp, .ep = l.ep, .etp = l.etp, .dp = l.dp, .sp = l.sp, .zero = l.zero});
      !e.empty())
    return e;
  if (l.pp * l.vpp > m.n_layers)
    return msg("parallelism.pp x stages per rank = ", l.pp * l.vpp, " exceeds model.n_layers (", m.n_layers,
               "): every stage needs a layer");
  if (l.zero == 3 && l.dp_shard > 0 && l.dp % l.dp_shard != 0)
    return msg("parallelism.dp_shard = ", l.dp_shard, " must divide dp = ", l.dp, " (HSDP replicates the shards)");
  if (gbs % (l.mbs * l.dp) != 0)
    return msg("training.global_batch_size = ", gbs, " sequences must be a multiple of micro_batch_size x dp = ",
               l.mbs, " x ", l.dp, " = ", l.mbs * l.dp);
  if (l.ep_overlap && (l.ep < 2 || l.schedule != "interleaved_1f1b"))
    return "parallelism.ep_overlap needs ep > 1 and pp_schedule = \"interleaved_1f1b\"";
  if (l.ep_overlap_split && !l.ep_overlap) return "parallelism.ep_overlap_split needs parallelism.ep_overlap = true";
  return "";
}

Layout layout_from_config(const JobConfig& c, int64_t world, bool distributed_optimizer) {
  const ParallelSpec& p = c.parallelism;
  Layout l;
  l.tp = p.tp, l.cp = p.cp, l.pp = p.pp, l.ep = p.ep, l.etp = p.expert_tp, l.sp = p.sequence_parallel;
  l.schedule = p.pp_schedule, l.ep_overlap = p.ep_overlap, l.ep_overlap_split = p.ep_overlap_split, l.zero = p.zero;
  if (distributed_optimizer && l.zero == 0) l.zero = 1;
  l.mbs = c.training.micro_batch_size;
  l.recompute = c.activation_checkpoint.mode;
  l.recompute_modules = c.activation_checkpoint.modules;
  MT_CHECK(world >= 1, "plan", "--world = ", world, " must be >= 1");
  const int64_t inner = p.tp * p.cp * p.pp;
  MT_CHECK(world % inner == 0, "plan", "world ", world, " is not a multiple of tp x cp x pp = ", p.tp, " x ", p.cp,
           " x ", p.pp, " = ", inner, " (the world must be the product of the layout)");
  l.dp = world / inner;
  MT_CHECK(p.dp() == 1 || p.dp() == l.dp, "plan", "world ", world, " gives dp = ", l.dp,
           " but parallelism.dp_replicate x dp_shard = ", p.dp(), " (leave both 1 to take dp from the world)");
  if (p.zero == 3 && p.dp_shard > 1) l.dp_shard = p.dp_shard;
  const int64_t gbs = c.training.global_batch_size;
  if (std::string e = layout_error(c, l, gbs); !e.empty()) MT_FAIL("plan", e);
  l.vpp = 0;  // the config's own (pp_virtual_stages, pp_layout, CSV or the schedule's default), resolved below
  const JobConfig a = apply_layout(c, l);
  const PipelineSetup ps = resolve_pipeline(a);
  l.vpp = ps.stages_per_rank;
  l.microbatches = ps.microbatches;
  return l;
}

JobConfig apply_layout(const JobConfig& c, const Layout& l) {
  JobConfig a = c;
  ParallelSpec& p = a.parallelism;
  p.tp = l.tp, p.cp = l.cp, p.pp = l.pp, p.ep = l.ep, p.expert_tp = l.etp, p.sequence_parallel = l.sp;
  p.pp_schedule = l.schedule, p.ep_overlap = l.ep_overlap, p.ep_overlap_split = l.ep_overlap_split, p.zero = l.zero;
  if (l.zero == 3 && l.dp_shard > 0 && l.dp_shard < l.dp) {
    p.dp_shard = l.dp_shard, p.dp_replicate = l.dp / l.dp_shard;
  } else if (l.zero == 3) {
    p.dp_shard = l.dp, p.dp_replicate = 1;
  } else {
    p.dp_replicate = l.dp, p.dp_shard = 1;
  }
  // The global batch stays; the micro-batches follow from the planner's dp.
  if (p.pp_microbatches != 0 && p.pp_microbatches * l.mbs * l.dp != a.training.global_batch_size) p.pp_microbatches = 0;
  if (l.vpp > 0 && p.pp_layout.empty() && p.pp_schedule_csv.empty()) p.pp_virtual_stages = l.vpp;
  a.training.micro_batch_size = l.mbs;
  a.activation_checkpoint.mode = l.recompute;
  a.activation_checkpoint.modules = l.recompute_modules;
  return a;
}

}  // namespace moetron::plan
