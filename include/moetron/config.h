// config.h: JobConfig, the whole description of a training job, loaded from TOML (toml++) with
// `--section.key=value` command-line overrides, validated, and written back to TOML or JSON.
// Not the trainer and not the planner: both read a JobConfig and nothing else.
//
// Sections: [job] [model] [training] [optimizer] [lr_scheduler] [parallelism] [checkpoint]
// [activation_checkpoint] [quantize] [metrics] [profiling] [hardware]. Every key has a default (below); [model] sizes default
// to 0 and must be given. Unknown sections or keys are errors with a "did you mean" suggestion.
// Presets are flat files: there is no `inherit`/include mechanism. docs/model.md lists every key.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "moetron/check.h"
#include "moetron/job_enums.h"
#include "moetron/parallel_spec.h"
#include "moetron/pp_layout.h"
#include "moetron/schedule.h"
#include "moetron/spec.h"

namespace moetron {

// The enums of the sections (Precision, ComputeDtype, DecayType, EpDispatcher, AcMode, Fp8Recipe) and their
// to_string are in job_enums.h, which kernel and parallel headers include instead of this file.

// The accounting's element sizes for a resolved compute dtype (Auto counts as BF16, the GPU default).
Precision precision_of(ComputeDtype v);

struct JobSpec {
  std::string name = "moetron";
  std::string dump_folder = "./outputs";
  std::string description;
  bool operator==(const JobSpec&) const = default;
};

struct TrainSpec {
  int64_t seq_len = 0;
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 0;  // sequences per optimizer step; 0 = micro_batch_size * dp
  int64_t steps = 1;
  int64_t seed = 0;
  double max_norm = 1.0;  // gradient clipping (0 = off)
  std::string dataset = "synthetic";
  std::string dataset_path;
  int64_t val_interval = 0;  // 0 = no validation
  int64_t val_steps = 0;
  ComputeDtype compute_dtype = ComputeDtype::Auto;  // replaces the retired `dtype` key
  // The attention kernels' products under bf16 compute: "auto" = bf16 where attention_bf16_preferred() (the
  // faster choice on this CPU: AMD's AVX512-BF16, Intel's AMX), else fp32; "bf16" / "fp32" force one ("bf16"
  // needs bf16 compute: an error naming both keys otherwise). fp32 compute always runs fp32 attention.
  ComputeDtype attention_dtype = ComputeDtype::Auto;
  int64_t threads = 0;  // 0 = all hardware threads
  bool memory_check = true;  // reject at start-up a job that needs more memory than the node has (memcheck.h)
  // A step whose loss or global gradient norm is not finite: "halt" (stop with an error naming the first
  // parameter whose gradient is not finite) or "skip" (no optimizer step; counted in metrics.jsonl as
  // skipped_steps). Every rank takes the same decision (docs/reliability.md).
  std::string nonfinite = "halt";
  // Where the engine computes: "cpu" (the CPU engine, unchanged) or "cuda" (the CUDA backend, docs/gpu.md). "cuda" is
  // refused at start-up, naming the key: by a build without the backend, on a machine without a usable GPU, and,
  // until the trainer runs on the GPU, everywhere (the backend has kernels and their tests, not yet a training step).
  std::string device = "cpu";
  bool operator==(const TrainSpec&) const = default;
};

// [optimizer]: name "adamw" (every parameter) or "muon" (docs/optimizer.md): Muon updates the 2-D weight matrices of
// the decoder blocks (attention projections, dense FFN, shared experts, each routed expert's matrices) with
// momentum orthogonalized by Newton-Schulz, scaled to AdamW's update RMS (Moonlight's 0.2 * sqrt(max(A, B)));
// AdamW (beta1, beta2, eps) updates the rest: embedding, head, norms, router. lr, the schedule and weight_decay
// are shared by both (Moonlight's recipe). The muon_* keys apply to name = "muon" only (set otherwise: refused).
struct OptimizerSpec {
  std::string name = "adamw";
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double muon_momentum = 0.95;  // m = muon_momentum * m + g
  bool muon_nesterov = true;    // orthogonalize g + muon_momentum * m (else m)
  int64_t muon_ns_steps = 5;    // Newton-Schulz iterations of the quintic (3.4445, -4.7750, 2.0315)
  bool muon() const { return name == "muon"; }
  bool operator==(const OptimizerSpec&) const = default;
};

struct LRSchedulerSpec {
  int64_t warmup_steps = 0;
  DecayType decay_type = DecayType::Cosine;
  double min_lr_ratio = 0.1;
  bool operator==(const LRSchedulerSpec&) const = default;
};

// [parallelism]: ParallelSpec, in parallel_spec.h (the device mesh reads it without the rest of the config).

struct CheckpointSpec {
  bool enable = false;
  int64_t interval = 500;
  int64_t keep_latest_k = 2;  // 0 = keep all
  std::string folder = "checkpoint";
  // Write in the background: the state is gathered and copied at the step boundary, then a thread writes the
  // files while training goes on. The checkpoint counts only once its state.json is in place (as always).
  bool async = false;
  bool operator==(const CheckpointSpec&) const = default;
};

struct ActivationCheckpointSpec {
  AcMode mode = AcMode::None;
  std::vector<int> layer_ids;         // layers the mode applies to; empty = every layer
  std::vector<std::string> modules;   // selective: any of attention_core, moe_act, norm
  // Pipeline stages whose layers the mode applies to (with layer_ids: the layers in both); empty = every
  // stage. Only chosen stages recompute, e.g. the first ones, which hold the most micro-batches in flight.
  // resolve_checkpointing turns it into layer_ids; applies_to() reads layer_ids only.
  std::vector<int> stage_ids;
  bool applies_to(int64_t layer) const;
  bool has_module(std::string_view m) const;
  bool operator==(const ActivationCheckpointSpec&) const = default;
};

struct MetricsSpec {
  int64_t log_interval = 10;
  double peak_tflops = 0.0;  // 0 = measure at start-up
  bool jsonl = true;
  bool operator==(const MetricsSpec&) const = default;
};

// [profiling]: per-rank traces (docs/profiling.md). Steps start_step..end_step (1-based, as the progress line
// counts them) are profiled: their kernels, modules, schedule actions, communication and memory counters go to
// <folder>/rank<r>.trace.json (folder relative to job.dump_folder unless absolute); `moetron train --trace DIR`
// is enable = true with folder = DIR. start_step = 0: from this run's second step (the first warms caches);
// end_step = 0: to the last step. The window also bounds `moetron train --profile`'s per-op breakdown.
struct ProfilingSpec {
  bool enable = false;
  int64_t start_step = 0;
  int64_t end_step = 0;
  std::string folder = "profile";
  int64_t max_events = 200000;  // per rank; later events are dropped and counted (moetron.dropped_events)
  bool operator==(const ProfilingSpec&) const = default;
};

// [comm]: the communication watchdog (docs/reliability.md) and how the MPI transport waits. A collective or
// point-to-point call running longer than timeout_s seconds makes every rank dump its flight recorder (its last
// collectives and messages) to <dump_folder>/flight/rank<r>.json and abort the job. 0 = no watchdog (the flight
// recorder still runs). The mpi_* keys apply to runs of several processes (MPI); none changes what is computed.
struct CommSpec {
  double timeout_s = 0;
  // mpi_wait: how a rank waits for its MPI requests. "poll" tests them back to back for 50 us, then sleeps
  // between tests (20 us, doubling up to mpi_max_nap_us), so a waiting rank leaves its core to the ranks and
  // threads that compute; "spin" waits inside MPI_Waitall. Only "poll" runs the EP overlap's weight gradients
  // inside waits (comm.h CommIdleWork).
  std::string mpi_wait = "poll";
  int64_t mpi_max_nap_us = 200;  // the longest sleep between two tests under "poll", in [20, 5000] microseconds
  // mpi_thread: the thread level asked of MPI_Init: "multiple" (MPI_THREAD_MULTIPLE, which ep_overlap needs) or
  // "funneled" (MPI_THREAD_FUNNELED, for comparisons). MPI starts once per process, when the trainer first needs
  // it, after the config is read; a process whose MPI was already started at another level refuses the job.
  std::string mpi_thread = "multiple";
  bool operator==(const CommSpec&) const = default;
};

// [quantize]: FP8 training of the chosen linears (docs/fp8.md). The engine emulates FP8 exactly on the CPU
// (numerics and memory, no speed); the embedding, the output head and the router stay in high precision.
//   recipe      none | tensorwise | rowwise | blockwise | mxfp8 (how GEMM operands are scaled)
//   format      e4m3 (every operand E4M3) | hybrid (E4M3 forward operands, E5M2 gradients)
//   scaling     current (scales from this tensor's amax) | delayed (tensorwise only: the scale of a step comes
//               from the max of the last amax_history_len steps' amaxes, Transformer Engine's recipe)
//   modules     which linears are FP8: any of attention, dense_mlp, shared_experts, routed_experts
//   cache_fp8_activations  keep the wgrad inputs as their forward FP8 operands (docs/fp8.md "Cached FP8 activations")
struct QuantizeSpec {
  Fp8Recipe recipe = Fp8Recipe::None;
  std::string format = "e4m3";
  std::string scaling = "current";
  int64_t amax_history_len = 16;
  std::vector<std::string> modules = {"attention", "dense_mlp", "shared_experts", "routed_experts"};
  bool cache_fp8_activations = false;
  bool on() const { return recipe != Fp8Recipe::None; }
  bool hybrid() const { return format == "hybrid"; }
  bool delayed() const { return scaling == "delayed"; }
  bool has_module(std::string_view m) const;  // FP8 is on and m is listed
  bool operator==(const QuantizeSpec&) const = default;
};
// Reserved for the planner (GPU catalog entry and cluster size); the engine ignores it.
struct HardwareSpec {
  std::string name;  // e.g. "mi300x" (catalog key), empty = none
  int64_t num_nodes = 0;
  int64_t gpus_per_node = 0;
  bool operator==(const HardwareSpec&) const = default;
};

struct JobConfig {
  JobSpec job;
  ModelSpec model;
  TrainSpec training;
  OptimizerSpec optimizer;
  LRSchedulerSpec lr_scheduler;
  ParallelSpec parallelism;
  CheckpointSpec checkpoint;
  ActivationCheckpointSpec activation_checkpoint;
  QuantizeSpec quantize;
  CommSpec comm;
  MetricsSpec metrics;
  ProfilingSpec profiling;
  HardwareSpec hardware;

  void resolve();         // derived defaults (model dims, global_batch_size 0 -> micro * dp)
  void validate() const;  // throws moetron::Error naming the key and the value
  bool operator==(const JobConfig&) const = default;
};

// Throws moetron::Error "invalid config: <key> = <value>: <why...>", the form of every validation message.
template <class V, class... A>
[[noreturn]] void invalid_config(const char* key, const V& value, const A&... why) {
  std::ostringstream os;
  os << "invalid config: " << key << " = " << value << ": ";
  (os << ... << why);
  throw Error(os.str());
}

// The pipeline the [parallelism] keys describe, resolved and checked (JobConfig::validate calls this; tools
// such as `moetron schedule` use the result). Throws "invalid config: parallelism.<key> = <value>: <why>".
//   - stages per rank: pp_virtual_stages if > 0, else the layout's (or the CSV's) stage count / pp, else the
//     schedule's default (2 for interleaved_1f1b, zbv and dualpipev, 1 otherwise);
//   - micro-batches: pp_microbatches if > 0 (it must then equal global_batch_size / (micro_batch_size * dp)),
//     else that quotient;
//   - the layout: pp_layout parsed for n_layers and pp * stages per rank stages, or the even split with the
//     two less-layers keys (which a pp_layout makes meaningless: setting both is an error);
//   - the schedule: sched::check_spec of the generator's spec, or, with pp_schedule_csv, the CSV read and
//     checked by sched::check_valid, with pp rows, pp * stages per rank stages and the job's micro-batches.
// Stages are placed on ranks the schedule's way: the V placement for zbv / dualpipev, the CSV's own
// placement for a CSV, stage s on rank s mod pp otherwise.
struct PipelineSetup {
  int stages_per_rank = 1;
  int64_t microbatches = 1;
  sched::GenSpec spec;        // the generator's input (schedule name, pp, vpp, micro-batches)
  sched::PpLayout layout;     // layers per stage and stage -> rank
  bool from_csv = false;
  sched::Schedule csv;        // from_csv: the user's schedule as read (validated)
};
PipelineSetup resolve_pipeline(const JobConfig& c);

// [activation_checkpoint] with stage_ids resolved against the pipeline layout: layer_ids = the layers of those
// stages (intersected with layer_ids when both are given; mode none when nothing is left) and stage_ids
// cleared. Without stage_ids, the section as it is. The engine and the accounting use this.
ActivationCheckpointSpec resolve_checkpointing(const JobConfig& c);

// The rules ep_overlap adds for how its lanes run: parallelism.ep_link = "paced" needs ep_baton = "turn";
// ep_pair_backward = "iwfill" / "iwcarry" needs ep_baton = "free" and no [quantize] recipe. Throws "invalid config:
// <key> = <value>: <why>" for the first broken one, whatever ep_overlap says: JobConfig::validate calls it with
// ep_overlap = true, the planner for the layouts it projects with the overlap.
void validate_overlap_lanes(const JobConfig& c);

// Load a TOML file, apply overrides (each "--section.key=value" or "section.key=value"), resolve and
// validate. Errors name the file and line (when known), the key, and a suggestion for unknown keys.
JobConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from TOML text; `source` names it in error messages.
JobConfig load_config_string(std::string_view toml_text, const std::vector<std::string>& overrides = {},
                             std::string_view source = "<string>");
// Apply one "--section.key=value" override to an already loaded config (not re-validated).
void apply_override(JobConfig& c, std::string_view override_text);

// Every key, in file order; load_config_string(to_toml(c)) == c for any resolved config.
std::string to_toml(const JobConfig& c);
// JSON object {section: {key: value}} (for checkpoint metadata) and back.
nlohmann::json to_json(const JobConfig& c);
JobConfig config_from_json(const nlohmann::json& j);

// The known keys, "section.key", in file order (for docs, completion and tests).
std::vector<std::string> config_keys();
// Closest known "section.key" to `name` by edit distance, or "" when nothing is close.
std::string suggest_key(std::string_view name);

}  // namespace moetron
