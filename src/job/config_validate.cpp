// config_validate.cpp: JobConfig::resolve (the values derived from others) and JobConfig::validate (every key's
// range and the rules between keys, each refusal naming its keys). Not the loading or the field table
// (config.cpp), not the model spec rules (src/job/spec.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/memcheck.h"
#include "moetron/parallel_rules.h"

namespace moetron {

void JobConfig::resolve() {
  model.resolve();
  auto& t = training;
  const auto& p = parallelism;
  if (t.global_batch_size == 0 && p.pp_microbatches > 0) {
    // Derived from the pipeline's micro-batch count; left 0 on overflow (validate() then names the keys).
    int64_t dp = 0, g = 0;
    if (!__builtin_mul_overflow(p.dp_replicate, p.dp_shard, &dp) && !__builtin_mul_overflow(t.micro_batch_size, dp, &g) &&
        !__builtin_mul_overflow(g, p.pp_microbatches, &g))
      t.global_batch_size = g;
  } else if (t.global_batch_size == 0) {
    t.global_batch_size = t.micro_batch_size * p.dp();
  }
}

namespace {

// [quantize]: the keys' ranges, and keys that would do nothing named (a recipe of none ignores them all).
void validate_quantize(const QuantizeSpec& q) {
  const QuantizeSpec dflt;
  if (q.amax_history_len < 1 || q.amax_history_len > 1024)
    invalid_config("quantize.amax_history_len", q.amax_history_len, "must be in [1, 1024]");
  std::vector<std::string> seen;
  for (const auto& m : q.modules) {
    if (m != "attention" && m != "dense_mlp" && m != "shared_experts" && m != "routed_experts")
      invalid_config("quantize.modules", "\"" + m + "\"", "expected attention, dense_mlp, shared_experts or "
          "routed_experts (the embedding, the output head and the router always stay in high precision)");
    if (std::find(seen.begin(), seen.end(), m) != seen.end())
      invalid_config("quantize.modules", "\"" + m + "\"", "listed twice");
    seen.push_back(m);
  }
  if (!q.on()) {
    if (q.format != dflt.format) invalid_config("quantize.format", q.format, "has no effect with quantize.recipe = none");
    if (q.scaling != dflt.scaling) invalid_config("quantize.scaling", q.scaling, "has no effect with quantize.recipe = none");
    if (q.amax_history_len != dflt.amax_history_len)
      invalid_config("quantize.amax_history_len", q.amax_history_len, "has no effect with quantize.recipe = none");
    if (q.cache_fp8_activations)
      invalid_config("quantize.cache_fp8_activations", "true", "has no effect with quantize.recipe = none");
    return;
  }
  if (q.modules.empty())
    invalid_config("quantize.modules", "[]", "quantize.recipe = ", to_string(q.recipe), " needs at least one module "
        "(attention, dense_mlp, shared_experts, routed_experts); use recipe = \"none\" for none");
  if (q.delayed() && q.recipe != Fp8Recipe::Tensorwise)
    invalid_config("quantize.scaling", "delayed", "delayed scaling is implemented for recipe = tensorwise only (",
        to_string(q.recipe), " scales each row or tile from its own current amax); use scaling = \"current\"");
  if (!q.delayed() && q.amax_history_len != dflt.amax_history_len)
    invalid_config("quantize.amax_history_len", q.amax_history_len, "applies to scaling = \"delayed\" only");
}

}  // namespace

void validate_overlap_lanes(const JobConfig& c) {
  const ParallelSpec& p = c.parallelism;
  if (p.ep_link == "paced" && p.ep_baton != "turn")
    invalid_config("parallelism.ep_link", p.ep_link, "needs parallelism.ep_baton = \"turn\" (got \"", p.ep_baton,
        "\"): under the free order the EP ranks could start their lanes' exchanges in different orders and wait on "
        "each other's links");
  if (p.pair_fills() && p.ep_baton != "free")
    invalid_config("parallelism.ep_pair_backward", p.ep_pair_backward, "needs the free lane order (parallelism.ep_baton "
        "= \"free\", the default; got \"", p.ep_baton, "\"): it takes the turn whenever no lane computes; use \"b\", "
        "\"iw\" or \"auto\"");
  if (p.pair_fills() && c.quantize.on())
    invalid_config("parallelism.ep_pair_backward", p.ep_pair_backward, "is not implemented with [quantize] "
        "(quantize.recipe = ", to_string(c.quantize.recipe), ": the FP8 weight gradients use the lane's operand "
        "buffers); use \"b\", \"iw\" or \"auto\"");
}

void JobConfig::validate() const {
  model.validate();

  const auto& t = training;
  const auto& p = parallelism;
  // pp_microbatches may have derived global_batch_size (resolve): name it before the batch's own limits do.
  if (p.pp_microbatches < 0 || p.pp_microbatches > (int64_t(1) << 20))
    invalid_config("parallelism.pp_microbatches", p.pp_microbatches, "must be in [0, 2^20] (0 = global_batch_size / "
        "(micro_batch_size * dp))");
  if (t.global_batch_size == 0 && p.pp_microbatches > 0 && t.micro_batch_size > 0 && p.dp_replicate > 0 && p.dp_shard > 0)
    invalid_config("parallelism.pp_microbatches", p.pp_microbatches, "training.global_batch_size = micro_batch_size * "
        "dp_replicate * dp_shard * pp_microbatches = ", t.micro_batch_size, " * ", p.dp_replicate, " * ", p.dp_shard,
        " * ", p.pp_microbatches, " overflows int64");
  check_size_limits(*this);  // first: nothing below may multiply or loop on an absurd value (memcheck.h)
  if (p.dp_replicate < 1) invalid_config("parallelism.dp_replicate", p.dp_replicate, "must be >= 1");
  if (p.dp_shard < 1) invalid_config("parallelism.dp_shard", p.dp_shard, "must be >= 1");
  if (t.seq_len <= 0) invalid_config("training.seq_len", t.seq_len, "must be > 0");
  if (t.micro_batch_size <= 0) invalid_config("training.micro_batch_size", t.micro_batch_size, "must be > 0");
  if (t.global_batch_size <= 0) invalid_config("training.global_batch_size", t.global_batch_size, "must be > 0");
  if (t.global_batch_size % (t.micro_batch_size * p.dp()) != 0)
    invalid_config("training.global_batch_size", t.global_batch_size, "must be a multiple of micro_batch_size * dp = ",
        t.micro_batch_size, " * ", p.dp(), " (dp = dp_replicate * dp_shard)");
  if (t.steps < 0) invalid_config("training.steps", t.steps, "must be >= 0");
  if (!(t.max_norm >= 0)) invalid_config("training.max_norm", t.max_norm, "must be >= 0 (0 = no clipping)");
  if (t.val_interval < 0) invalid_config("training.val_interval", t.val_interval, "must be >= 0 (0 = no validation)");
  if (t.val_steps < 0) invalid_config("training.val_steps", t.val_steps, "must be >= 0");
  if (t.val_interval > 0 && t.val_steps == 0)
    invalid_config("training.val_steps", t.val_steps, "must be > 0 when val_interval (", t.val_interval, ") is set");
  if (t.threads < 0) invalid_config("training.threads", t.threads, "must be >= 0 (0 = all)");
  if (t.dataset.empty()) invalid_config("training.dataset", "\"\"", "must name a dataset (\"synthetic\" needs no path)");

  const auto& o = optimizer;
  if (!(o.lr > 0)) invalid_config("optimizer.lr", o.lr, "must be > 0");
  if (!(o.beta1 >= 0 && o.beta1 < 1)) invalid_config("optimizer.beta1", o.beta1, "must be in [0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) invalid_config("optimizer.beta2", o.beta2, "must be in [0, 1)");
  if (!(o.eps > 0)) invalid_config("optimizer.eps", o.eps, "must be > 0");
  if (!(o.weight_decay >= 0)) invalid_config("optimizer.weight_decay", o.weight_decay, "must be >= 0");
  if (!(o.muon_momentum >= 0 && o.muon_momentum < 1))
    invalid_config("optimizer.muon_momentum", o.muon_momentum, "must be in [0, 1)");
  if (o.muon_ns_steps < 1 || o.muon_ns_steps > 20)
    invalid_config("optimizer.muon_ns_steps", o.muon_ns_steps, "must be in [1, 20] (Newton-Schulz iterations)");
  if (!o.muon()) {  // the muon_* keys do nothing under AdamW: set, they are refused rather than ignored
    const OptimizerSpec d;
    auto moot = [&](const char* key, const auto& v) {
      invalid_config(key, v, "applies to optimizer.name = \"muon\" only (optimizer.name = \"", o.name, "\")");
    };
    if (o.muon_momentum != d.muon_momentum) moot("optimizer.muon_momentum", o.muon_momentum);
    if (o.muon_nesterov != d.muon_nesterov) moot("optimizer.muon_nesterov", o.muon_nesterov ? "true" : "false");
    if (o.muon_ns_steps != d.muon_ns_steps) moot("optimizer.muon_ns_steps", o.muon_ns_steps);
  } else {
    // Newton-Schulz needs whole matrices; TP slices them over its ranks (gathering them first is not implemented).
    if (p.tp > 1)
      invalid_config("optimizer.name", "\"muon\"", "not implemented with parallelism.tp = ", p.tp,
                     " (Muon orthogonalizes whole matrices; tensor parallelism slices them over the TP ranks): use "
                     "tp = 1 or optimizer.name = \"adamw\"");
  }

  const auto& l = lr_scheduler;
  if (l.warmup_steps < 0) invalid_config("lr_scheduler.warmup_steps", l.warmup_steps, "must be >= 0");
  if (!(l.min_lr_ratio >= 0 && l.min_lr_ratio <= 1))
    invalid_config("lr_scheduler.min_lr_ratio", l.min_lr_ratio, "must be in [0, 1]");

  if (p.pp < 1) invalid_config("parallelism.pp", p.pp, "must be >= 1");
  // With dp_replicate = dp_shard = 1 the data-parallel size is left to the world (the planner's --world; the
  // engine's mesh then checks the same rules against the launched ranks).
  if (std::string e = parallel_degree_error(model, training.seq_len,
          {.tp = p.tp, .cp = p.cp, .ep = p.ep, .etp = p.expert_tp, .dp = p.dp() > 1 ? p.dp() : 0,
           .sp = p.sequence_parallel, .zero = p.zero});
      !e.empty())
    throw Error("invalid config: " + e);
  if (p.ranks_per_node < 1) invalid_config("parallelism.ranks_per_node", p.ranks_per_node, "must be >= 1");
  if (p.ep_transport == EpTransport::Shm && p.ep_dispatcher == EpDispatcher::Hierarchical)
    invalid_config("parallelism.ep_transport", "\"shm\"", "moves the rows of the flat dispatchers (alltoall, "
                   "sync_free); ep_dispatcher = \"hierarchical\" exists to cross nodes: use ep_transport = \"mpi\" with it");

  const auto& pr = profiling;
  if (pr.start_step < 0) invalid_config("profiling.start_step", pr.start_step, "must be >= 0 (0 = this run's second step)");
  if (pr.end_step < 0) invalid_config("profiling.end_step", pr.end_step, "must be >= 0 (0 = the last step)");
  if (pr.end_step > 0 && pr.end_step < pr.start_step)
    invalid_config("profiling.end_step", pr.end_step, "is before profiling.start_step = ", pr.start_step);
  if (pr.max_events < 1) invalid_config("profiling.max_events", pr.max_events, "must be >= 1");
  if (pr.enable && pr.folder.empty()) invalid_config("profiling.folder", "\"\"", "must be set when profiling is enabled");

  const auto& c = checkpoint;
  if (c.enable && c.interval <= 0) invalid_config("checkpoint.interval", c.interval, "must be > 0 when checkpoints are enabled");
  if (c.keep_latest_k < 0) invalid_config("checkpoint.keep_latest_k", c.keep_latest_k, "must be >= 0 (0 = keep all)");
  if (c.enable && c.folder.empty()) invalid_config("checkpoint.folder", "\"\"", "must be set when checkpoints are enabled");

  const auto& a = activation_checkpoint;
  // The MTP blocks (model.mtp_layers) are ids n_layers .. n_layers + mtp_layers - 1.
  std::vector<char> listed(size_t(model.n_blocks()), 0);  // linear in the list: it may be long
  for (int id : a.layer_ids) {
    if (id < 0 || id >= model.n_blocks())
      invalid_config("activation_checkpoint.layer_ids", id, "layer id out of range [0, ", model.n_blocks(), ")",
                     model.mtp_layers > 0 ? " (the MTP blocks follow the n_layers decoder layers)" : "");
    if (listed[size_t(id)]++) invalid_config("activation_checkpoint.layer_ids", id, "listed twice");
  }
  for (const auto& m : a.modules)
    if (m != "attention_core" && m != "moe_act" && m != "norm")
      invalid_config("activation_checkpoint.modules", "\"" + m + "\"", "expected attention_core, moe_act or norm");
  if (a.mode == AcMode::Selective && a.modules.empty())
    invalid_config("activation_checkpoint.modules", "[]", "selective mode needs at least one module "
        "(attention_core, moe_act, norm)");
  if (a.mode != AcMode::Selective && !a.modules.empty())
    invalid_config("activation_checkpoint.modules", a.modules.size(), " module(s) listed but mode is ", to_string(a.mode),
        " (modules apply to selective mode only)");

  if (!(comm.timeout_s >= 0 && comm.timeout_s <= 1e7))
    invalid_config("comm.timeout_s", comm.timeout_s, "must be in [0, 1e7] seconds (0 = no watchdog)");
  if (comm.mpi_max_nap_us < 20 || comm.mpi_max_nap_us > 5000)
    invalid_config("comm.mpi_max_nap_us", comm.mpi_max_nap_us, "must be in [20, 5000] microseconds (the longest "
        "sleep between two tests of a long MPI wait)");
  if (parallelism.ep_overlap) {  // otherwise the lanes' keys are moot (noted by the trainer, config_notes.cpp)
    validate_overlap_lanes(*this);
    if (comm.mpi_thread != "multiple")
      invalid_config("comm.mpi_thread", comm.mpi_thread, "parallelism.ep_overlap = true runs two micro-batches' EP "
          "exchanges at once on two threads, which needs comm.mpi_thread = \"multiple\"");
  }
  validate_quantize(quantize);

  if (metrics.log_interval < 1) invalid_config("metrics.log_interval", metrics.log_interval, "must be >= 1");
  if (!(metrics.peak_tflops >= 0)) invalid_config("metrics.peak_tflops", metrics.peak_tflops, "must be >= 0 (0 = measure)");
  if (hardware.num_nodes < 0) invalid_config("hardware.num_nodes", hardware.num_nodes, "must be >= 0");
  if (hardware.gpus_per_node < 0) invalid_config("hardware.gpus_per_node", hardware.gpus_per_node, "must be >= 0");

  // the pp_* keys: layout, schedule preconditions, a user's CSV (config_pipeline.cpp)
  const PipelineSetup ps = resolve_pipeline(*this);
  std::vector<char> st_listed(size_t(ps.layout.n_stages), 0);
  for (int id : activation_checkpoint.stage_ids) {
    if (id < 0 || id >= ps.layout.n_stages)
      invalid_config("activation_checkpoint.stage_ids", id, "pipeline stage out of range [0, ", ps.layout.n_stages,
                     ") (pp = ", parallelism.pp, " x ", ps.stages_per_rank, " stages per rank)");
    if (st_listed[size_t(id)]++) invalid_config("activation_checkpoint.stage_ids", id, "listed twice");
  }
  if (activation_checkpoint.mode == AcMode::None && !activation_checkpoint.stage_ids.empty())
    invalid_config("activation_checkpoint.stage_ids", activation_checkpoint.stage_ids.size(),
                   " stage(s) listed but mode is none (set activation_checkpoint.mode)");
}

}  // namespace moetron
