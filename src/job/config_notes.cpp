// config_notes.cpp: which non-default settings a training run of a given shape leaves without effect (see
// config_notes.h). Each rule names the key that makes another one moot; the rules follow what the engine reads,
// so a rule here is a statement about the trainer (tests/config/check_keys_honoured.py walks every key).
#include "moetron/config_notes.h"

#include <initializer_list>
#include <map>

namespace moetron {

std::vector<InertSetting> inert_settings(const JobConfig& c, const RunShape& run) {
  const std::map<std::string, std::string> set = non_default_settings(c);
  std::vector<InertSetting> out;
  auto moot = [&](std::initializer_list<const char*> keys, bool when, const std::string& why) {
    if (!when) return;
    for (const char* k : keys)
      if (auto it = set.find(k); it != set.end()) out.push_back({k, it->second, why});
  };
  const auto& p = c.parallelism;
  const auto& moe = c.model.moe;
  // [model]: routing keys another routing key turns off.
  if (c.model.is_moe()) {
    moot({"model.bias_update_rate", "model.bias_update"}, moe.load_balance != LoadBalance::AuxFree,
         "the expert bias is updated only with model.load_balance = \"aux_free\"");
    moot({"model.aux_coef", "model.aux_seq_wise"}, moe.load_balance == LoadBalance::None,
         "model.load_balance = \"none\" adds no balance loss");
    moot({"model.aux_seq_wise"}, moe.load_balance != LoadBalance::None && moe.aux_coef == 0,
         "model.aux_coef = 0 adds no balance loss");
    moot({"model.drop_policy"}, moe.capacity_factor == 0, "model.capacity_factor = 0 drops no token (dropless)");
  }
  moot({"model.mtp_loss_weight"}, c.model.mtp_layers == 0,
       "model.mtp_layers = 0 adds no multi-token prediction loss");
  moot({"model.inter_size"}, c.model.n_layers > 0 && c.model.n_dense_layers() == 0,
       "every layer is an MoE layer (inter_size is the dense layers' width; experts use moe_inter_size)");
  // [training]
  moot({"training.dataset_path"}, c.training.dataset == "synthetic",
       "training.dataset = \"synthetic\" generates its tokens and reads no files");
  moot({"training.val_steps"}, c.training.val_interval == 0, "training.val_interval = 0 runs no validation");
  // [parallelism]: layout keys the run's shape makes moot.
  moot({"parallelism.sequence_parallel"}, p.tp == 1,
       "sequence parallelism shards the tensor-parallel regions, and tp = 1");
  moot({"parallelism.ranks_per_node"}, run.world == 1, "one process runs, on one node");
  moot({"parallelism.zero"}, run.dp == 1, "one data-parallel rank holds every parameter and optimizer state");
  moot({"parallelism.ep_pair_backward", "parallelism.ep_baton", "parallelism.ep_link"}, !p.ep_overlap,
       "parallelism.ep_overlap = false runs no overlapped pairs (these keys choose how the overlap's two lanes run)");
  if (set.count("parallelism.pp_first_stage_less_layers") || set.count("parallelism.pp_last_stage_less_layers"))
    moot({"parallelism.pp_first_stage_less_layers", "parallelism.pp_last_stage_less_layers"},
         resolve_pipeline(c).layout.n_stages == 1, "the pipeline has one stage, which holds every layer");
  // [checkpoint], [activation_checkpoint], [quantize], [profiling]: keys of a feature that is off.
  moot({"checkpoint.interval", "checkpoint.keep_latest_k", "checkpoint.folder", "checkpoint.async"},
       !c.checkpoint.enable, "checkpoint.enable = false writes no checkpoint");
  moot({"activation_checkpoint.layer_ids", "activation_checkpoint.modules"},
       c.activation_checkpoint.mode == AcMode::None, "activation_checkpoint.mode = \"none\" recomputes nothing");
  moot({"activation_checkpoint.modules"}, c.activation_checkpoint.mode == AcMode::Full,
       "activation_checkpoint.mode = \"full\" recomputes whole layers (modules choose parts for \"selective\")");
  moot({"quantize.format", "quantize.scaling", "quantize.amax_history_len", "quantize.modules",
        "quantize.cache_fp8_activations"},
       !c.quantize.on(), "quantize.recipe = \"none\" quantizes nothing");
  moot({"quantize.amax_history_len"}, c.quantize.on() && !c.quantize.delayed(),
       "the amax history is kept only with quantize.scaling = \"delayed\"");
  moot({"profiling.folder", "profiling.max_events"}, !c.profiling.enable,
       "profiling.enable = false writes no trace");
  moot({"profiling.start_step", "profiling.end_step"}, !c.profiling.enable && !run.profile_flag,
       "profiling.enable = false and no --profile: nothing is profiled");
  // [comm]: the watchdog watches calls between processes.
  moot({"comm.timeout_s"}, run.world == 1, "one process makes no communication calls to watch");
  moot({"comm.mpi_wait", "comm.mpi_max_nap_us", "comm.mpi_thread"}, run.world == 1,
       "one process waits on no other rank (and runs no EP overlap)");
  moot({"comm.mpi_max_nap_us"}, run.world > 1 && c.comm.mpi_wait == "spin",
       "comm.mpi_wait = \"spin\" waits inside MPI, without sleeping between tests");
  // [hardware]: the planner's target cluster.
  moot({"hardware.name", "hardware.num_nodes", "hardware.gpus_per_node"}, true,
       "[hardware] describes the cluster `moetron plan` projects onto; training runs on this machine");
  return out;
}

std::string format_note(const InertSetting& s) {
  return "note: " + s.key + " = " + s.value + " has no effect: " + s.why;
}

}  // namespace moetron
