// config.cpp: JobConfig from TOML (toml++) plus `--section.key=value` overrides, and the
// way back (to_toml, JSON). One table of fields drives everything: parsing, type checks, overrides,
// "did you mean" suggestions, serialization. Not the validation (config_validate.cpp) nor the model spec rules
// (src/job/spec.cpp).
#include "moetron/config.h"
#include "moetron/config_notes.h"
#include "job/toml_names.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <toml++/toml.h>
#include <type_traits>
#include <variant>

#include "moetron/check.h"
#include "moetron/memcheck.h"
#include "moetron/parallel_rules.h"

namespace moetron {

std::string_view to_string(Precision v) {
  switch (v) {
    case Precision::BF16: return "bf16";
    case Precision::FP32: return "fp32";
    case Precision::FP8: return "fp8";
  }
  return "?";
}
std::string_view to_string(ComputeDtype v) {
  switch (v) {
    case ComputeDtype::Auto: return "auto";
    case ComputeDtype::BF16: return "bf16";
    case ComputeDtype::FP32: return "fp32";
  }
  return "?";
}
Precision precision_of(ComputeDtype v) { return v == ComputeDtype::FP32 ? Precision::FP32 : Precision::BF16; }
std::string_view to_string(DecayType v) {
  switch (v) {
    case DecayType::Cosine: return "cosine";
    case DecayType::Linear: return "linear";
    case DecayType::None: return "none";
  }
  return "?";
}
std::string_view to_string(EpTransport v) { return v == EpTransport::Shm ? "shm" : "mpi"; }

std::string_view to_string(EpDispatcher v) {
  switch (v) {
    case EpDispatcher::AllToAll: return "alltoall";
    case EpDispatcher::SyncFree: return "sync_free";
    case EpDispatcher::Hierarchical: return "hierarchical";
  }
  return "?";
}
std::string_view to_string(Fp8Recipe v) {
  switch (v) {
    case Fp8Recipe::None: return "none";
    case Fp8Recipe::Tensorwise: return "tensorwise";
    case Fp8Recipe::Rowwise: return "rowwise";
    case Fp8Recipe::Blockwise: return "blockwise";
    case Fp8Recipe::MXFP8: return "mxfp8";
  }
  return "?";
}

std::string_view to_string(AcMode v) {
  switch (v) {
    case AcMode::None: return "none";
    case AcMode::Selective: return "selective";
    case AcMode::Full: return "full";
  }
  return "?";
}

bool ActivationCheckpointSpec::applies_to(int64_t layer) const {
  if (mode == AcMode::None) return false;
  return layer_ids.empty() || std::find(layer_ids.begin(), layer_ids.end(), layer) != layer_ids.end();
}
bool ActivationCheckpointSpec::has_module(std::string_view m) const {
  return std::find(modules.begin(), modules.end(), m) != modules.end();
}
bool QuantizeSpec::has_module(std::string_view m) const {
  return on() && std::find(modules.begin(), modules.end(), m) != modules.end();
}

namespace {

// ---- the field table --------------------------------------------------------------------------------
using IntList = std::vector<int64_t>;
using StrList = std::vector<std::string>;
using Value = std::variant<int64_t, double, bool, std::string, IntList, StrList>;
enum class Kind { Int, Float, Bool, String, Enum, IntList, StrList };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Int: return "integer";
    case Kind::Float: return "float";
    case Kind::Bool: return "boolean";
    case Kind::String: return "string";
    case Kind::Enum: return "string";
    case Kind::IntList: return "array of integers";
    case Kind::StrList: return "array of strings";
  }
  return "?";
}

struct Field {
  std::string section, key;
  Kind kind;
  std::vector<std::string> choices;  // Enum: names by underlying value
  std::function<void(JobConfig&, const Value&)> set;
  std::function<Value(const JobConfig&)> get;
  std::string full() const { return section + "." + key; }
};

template <class T>
struct is_vector : std::false_type {};
template <class T>
struct is_vector<std::vector<T>> : std::true_type {};

#define MT_F(sec, key, member) make_field(sec, key, [](JobConfig& c) -> auto& { return c.member; })
#define MT_E(sec, key, member, ...) \
  make_enum(sec, key, [](JobConfig& c) -> auto& { return c.member; }, __VA_ARGS__)

// acc: [](JobConfig& c) -> T& { return c.x.y; }
template <class Acc>
Field make_field(const char* sec, const char* key, Acc acc) {
  using T = std::remove_reference_t<decltype(acc(std::declval<JobConfig&>()))>;
  Field f{sec, key, Kind::Int, {}, {}, {}};
  if constexpr (std::is_same_v<T, bool>) {
    f.kind = Kind::Bool;
    f.set = [acc](JobConfig& c, const Value& v) { acc(c) = std::get<bool>(v); };
    f.get = [acc](const JobConfig& c) { return Value(acc(const_cast<JobConfig&>(c))); };
  } else if constexpr (std::is_integral_v<T>) {
    f.kind = Kind::Int;
    f.set = [acc](JobConfig& c, const Value& v) { acc(c) = static_cast<T>(std::get<int64_t>(v)); };
    f.get = [acc](const JobConfig& c) { return Value(int64_t(acc(const_cast<JobConfig&>(c)))); };
  } else if constexpr (std::is_floating_point_v<T>) {
    f.kind = Kind::Float;
    f.set = [acc](JobConfig& c, const Value& v) { acc(c) = std::get<double>(v); };
    f.get = [acc](const JobConfig& c) { return Value(double(acc(const_cast<JobConfig&>(c)))); };
  } else if constexpr (std::is_same_v<T, std::string>) {
    f.kind = Kind::String;
    f.set = [acc](JobConfig& c, const Value& v) { acc(c) = std::get<std::string>(v); };
    f.get = [acc](const JobConfig& c) { return Value(acc(const_cast<JobConfig&>(c))); };
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    f.kind = Kind::StrList;
    f.set = [acc](JobConfig& c, const Value& v) { acc(c) = std::get<StrList>(v); };
    f.get = [acc](const JobConfig& c) { return Value(acc(const_cast<JobConfig&>(c))); };
  } else if constexpr (is_vector<T>::value) {
    using E = typename T::value_type;
    f.kind = Kind::IntList;
    f.set = [acc](JobConfig& c, const Value& v) {
      T out;
      for (int64_t x : std::get<IntList>(v)) out.push_back(static_cast<E>(x));
      acc(c) = out;
    };
    f.get = [acc](const JobConfig& c) {
      IntList out;
      for (auto x : acc(const_cast<JobConfig&>(c))) out.push_back(int64_t(x));
      return Value(out);
    };
  } else {
    static_assert(std::is_enum_v<T>, "unsupported config field type");
  }
  return f;
}

// Enum fields: stored as strings in TOML; `choices[i]` names the enumerator with underlying value i.
template <class Acc>
Field make_enum(const char* sec, const char* key, Acc acc, std::vector<std::string> choices) {
  using T = std::remove_reference_t<decltype(acc(std::declval<JobConfig&>()))>;
  Field f{sec, key, Kind::Enum, choices, {}, {}};
  if constexpr (std::is_same_v<T, std::string>) {  // a string restricted to `choices`
    f.set = [acc](JobConfig& c, const Value& v) { acc(c) = std::get<std::string>(v); };
    f.get = [acc](const JobConfig& c) { return Value(acc(const_cast<JobConfig&>(c))); };
  } else {
    static_assert(std::is_enum_v<T>);
    f.set = [acc, choices](JobConfig& c, const Value& v) {
      const auto& s = std::get<std::string>(v);
      for (size_t i = 0; i < choices.size(); ++i)
        if (choices[i] == s) acc(c) = static_cast<T>(i);
    };
    f.get = [acc, choices](const JobConfig& c) { return Value(choices.at(size_t(acc(const_cast<JobConfig&>(c))))); };
  }
  return f;
}

// long: the field table, one line per key in file order (splitting it would split the key list).
const std::vector<Field>& fields() {
  static const std::vector<Field> table = [] {
    std::vector<Field> t;
    // [job]
    t.push_back(MT_F("job", "name", job.name));
    t.push_back(MT_F("job", "dump_folder", job.dump_folder));
    t.push_back(MT_F("job", "description", job.description));
    // [model]
    t.push_back(MT_F("model", "vocab_size", model.vocab_size));
    t.push_back(MT_F("model", "d_model", model.d_model));
    t.push_back(MT_F("model", "n_layers", model.n_layers));
    t.push_back(MT_F("model", "first_k_dense", model.first_k_dense));
    t.push_back(MT_F("model", "dense_layers", model.dense_layers));
    t.push_back(MT_F("model", "inter_size", model.inter_size));
    t.push_back(MT_E("model", "ffn", model.ffn, {"swiglu", "gelu"}));
    t.push_back(MT_F("model", "dropout", model.dropout));
    t.push_back(MT_E("model", "attention_impl", model.attention_impl, {"flash", "unfused"}));
    t.push_back(MT_F("model", "norm_eps", model.norm_eps));
    t.push_back(MT_F("model", "tie_embeddings", model.tie_embeddings));
    t.push_back(MT_F("model", "init_std", model.init_std));
    t.push_back(MT_F("model", "rope_theta", model.rope_theta));
    t.push_back(MT_E("model", "attn_type", model.attn.type, {"mha", "gqa", "mla"}));
    t.push_back(MT_F("model", "n_heads", model.attn.n_heads));
    t.push_back(MT_F("model", "n_kv_heads", model.attn.n_kv_heads));
    t.push_back(MT_F("model", "head_dim", model.attn.head_dim));
    t.push_back(MT_F("model", "qk_norm", model.attn.qk_norm));
    t.push_back(MT_F("model", "q_lora_rank", model.attn.q_lora_rank));
    t.push_back(MT_F("model", "kv_lora_rank", model.attn.kv_lora_rank));
    t.push_back(MT_F("model", "qk_nope_head_dim", model.attn.qk_nope_head_dim));
    t.push_back(MT_F("model", "qk_rope_head_dim", model.attn.qk_rope_head_dim));
    t.push_back(MT_F("model", "v_head_dim", model.attn.v_head_dim));
    t.push_back(MT_F("model", "n_routed_experts", model.moe.n_routed_experts));
    t.push_back(MT_F("model", "n_shared_experts", model.moe.n_shared_experts));
    t.push_back(MT_F("model", "moe_inter_size", model.moe.moe_inter_size));
    t.push_back(MT_F("model", "topk", model.moe.topk));
    t.push_back(MT_E("model", "expert_act", model.moe.expert_act, {"swiglu", "clamped_swiglu"}));
    t.push_back(MT_E("model", "score_func", model.moe.score_func, {"softmax", "sigmoid"}));
    t.push_back(MT_F("model", "n_group", model.moe.n_group));
    t.push_back(MT_F("model", "topk_group", model.moe.topk_group));
    t.push_back(MT_F("model", "norm_topk_prob", model.moe.norm_topk_prob));
    t.push_back(MT_F("model", "route_scale", model.moe.route_scale));
    t.push_back(MT_E("model", "load_balance", model.moe.load_balance, {"none", "aux_loss", "aux_free"}));
    t.push_back(MT_F("model", "aux_coef", model.moe.aux_coef));
    t.push_back(MT_F("model", "aux_seq_wise", model.moe.aux_seq_wise));
    t.push_back(MT_F("model", "bias_update_rate", model.moe.bias_update_rate));
    t.push_back(MT_E("model", "bias_update", model.moe.bias_update, {"sign", "proportional"}));
    t.push_back(MT_F("model", "sinkhorn_iters", model.moe.sinkhorn_iters));
    t.push_back(MT_F("model", "route_capacity", model.moe.route_capacity));
    t.push_back(MT_F("model", "z_loss_coef", model.moe.z_loss_coef));
    t.push_back(MT_F("model", "capacity_factor", model.moe.capacity_factor));
    t.push_back(MT_E("model", "drop_policy", model.moe.drop_policy, {"probs", "position"}));
    t.push_back(MT_F("model", "mtp_layers", model.mtp_layers));
    t.push_back(MT_F("model", "mtp_loss_weight", model.mtp_loss_weight));
    // [training]
    t.push_back(MT_F("training", "seq_len", training.seq_len));
    t.push_back(MT_F("training", "micro_batch_size", training.micro_batch_size));
    t.push_back(MT_F("training", "global_batch_size", training.global_batch_size));
    t.push_back(MT_F("training", "steps", training.steps));
    t.push_back(MT_F("training", "seed", training.seed));
    t.push_back(MT_F("training", "max_norm", training.max_norm));
    t.push_back(MT_F("training", "dataset", training.dataset));
    t.push_back(MT_F("training", "dataset_path", training.dataset_path));
    t.push_back(MT_F("training", "val_interval", training.val_interval));
    t.push_back(MT_F("training", "val_steps", training.val_steps));
    t.push_back(MT_E("training", "compute_dtype", training.compute_dtype, {"auto", "bf16", "fp32"}));
    t.push_back(MT_E("training", "attention_dtype", training.attention_dtype, {"auto", "bf16", "fp32"}));
    t.push_back(MT_F("training", "threads", training.threads));
    t.push_back(MT_F("training", "memory_check", training.memory_check));
    t.push_back(MT_E("training", "nonfinite", training.nonfinite, {"halt", "skip"}));
    t.push_back(MT_E("training", "device", training.device, {"cpu", "cuda"}));
    // [optimizer]
    t.push_back(MT_E("optimizer", "name", optimizer.name, {"adamw", "muon"}));
    t.push_back(MT_F("optimizer", "lr", optimizer.lr));
    t.push_back(MT_F("optimizer", "beta1", optimizer.beta1));
    t.push_back(MT_F("optimizer", "beta2", optimizer.beta2));
    t.push_back(MT_F("optimizer", "eps", optimizer.eps));
    t.push_back(MT_F("optimizer", "weight_decay", optimizer.weight_decay));
    t.push_back(MT_F("optimizer", "muon_momentum", optimizer.muon_momentum));
    t.push_back(MT_F("optimizer", "muon_nesterov", optimizer.muon_nesterov));
    t.push_back(MT_F("optimizer", "muon_ns_steps", optimizer.muon_ns_steps));
    // [lr_scheduler]
    t.push_back(MT_F("lr_scheduler", "warmup_steps", lr_scheduler.warmup_steps));
    t.push_back(MT_E("lr_scheduler", "decay_type", lr_scheduler.decay_type, {"cosine", "linear", "none"}));
    t.push_back(MT_F("lr_scheduler", "min_lr_ratio", lr_scheduler.min_lr_ratio));
    // [parallelism]
    t.push_back(MT_F("parallelism", "tp", parallelism.tp));
    t.push_back(MT_F("parallelism", "cp", parallelism.cp));
    t.push_back(MT_F("parallelism", "expert_tp", parallelism.expert_tp));
    t.push_back(MT_F("parallelism", "sequence_parallel", parallelism.sequence_parallel));
    t.push_back(MT_F("parallelism", "dp_replicate", parallelism.dp_replicate));
    t.push_back(MT_F("parallelism", "dp_shard", parallelism.dp_shard));
    t.push_back(MT_F("parallelism", "ep", parallelism.ep));
    t.push_back(MT_F("parallelism", "pp", parallelism.pp));
    t.push_back(MT_F("parallelism", "ranks_per_node", parallelism.ranks_per_node));
    t.push_back(MT_E("parallelism", "ep_dispatcher", parallelism.ep_dispatcher,
                     {"alltoall", "sync_free", "hierarchical"}));
    t.push_back(MT_E("parallelism", "ep_transport", parallelism.ep_transport, {"mpi", "shm"}));
    t.push_back(MT_F("parallelism", "fp8_dispatch", parallelism.fp8_dispatch));
    t.push_back(MT_F("parallelism", "zero", parallelism.zero));
    t.push_back(MT_E("parallelism", "pp_schedule", parallelism.pp_schedule,
                     {"gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev"}));
    t.push_back(MT_F("parallelism", "pp_virtual_stages", parallelism.pp_virtual_stages));
    t.push_back(MT_F("parallelism", "pp_microbatches", parallelism.pp_microbatches));
    t.push_back(MT_F("parallelism", "pp_layout", parallelism.pp_layout));
    t.push_back(MT_F("parallelism", "pp_schedule_csv", parallelism.pp_schedule_csv));
    t.push_back(MT_F("parallelism", "pp_first_stage_less_layers", parallelism.pp_first_stage_less_layers));
    t.push_back(MT_F("parallelism", "pp_last_stage_less_layers", parallelism.pp_last_stage_less_layers));
    t.push_back(MT_F("parallelism", "ep_overlap", parallelism.ep_overlap));
    t.push_back(MT_F("parallelism", "ep_overlap_split", parallelism.ep_overlap_split));
    t.push_back(MT_E("parallelism", "ep_pair_backward", parallelism.ep_pair_backward,
                     {"auto", "b", "iw", "iwfill", "iwcarry"}));
    t.push_back(MT_E("parallelism", "ep_baton", parallelism.ep_baton, {"free", "turn"}));
    t.push_back(MT_E("parallelism", "ep_link", parallelism.ep_link, {"shared", "paced"}));
    // [checkpoint]
    t.push_back(MT_F("checkpoint", "enable", checkpoint.enable));
    t.push_back(MT_F("checkpoint", "interval", checkpoint.interval));
    t.push_back(MT_F("checkpoint", "keep_latest_k", checkpoint.keep_latest_k));
    t.push_back(MT_F("checkpoint", "folder", checkpoint.folder));
    t.push_back(MT_F("checkpoint", "async", checkpoint.async));
    // [activation_checkpoint]
    t.push_back(MT_E("activation_checkpoint", "mode", activation_checkpoint.mode, {"none", "selective", "full"}));
    t.push_back(MT_F("activation_checkpoint", "layer_ids", activation_checkpoint.layer_ids));
    t.push_back(MT_F("activation_checkpoint", "stage_ids", activation_checkpoint.stage_ids));
    t.push_back(MT_F("activation_checkpoint", "modules", activation_checkpoint.modules));
    // [quantize]
    t.push_back(MT_E("quantize", "recipe", quantize.recipe, {"none", "tensorwise", "rowwise", "blockwise", "mxfp8"}));
    t.push_back(MT_E("quantize", "format", quantize.format, {"e4m3", "hybrid"}));
    t.push_back(MT_E("quantize", "scaling", quantize.scaling, {"current", "delayed"}));
    t.push_back(MT_F("quantize", "amax_history_len", quantize.amax_history_len));
    t.push_back(MT_F("quantize", "modules", quantize.modules));
    t.push_back(MT_F("quantize", "cache_fp8_activations", quantize.cache_fp8_activations));
    // [comm]
    t.push_back(MT_F("comm", "timeout_s", comm.timeout_s));
    t.push_back(MT_E("comm", "mpi_wait", comm.mpi_wait, {"poll", "spin"}));
    t.push_back(MT_F("comm", "mpi_max_nap_us", comm.mpi_max_nap_us));
    t.push_back(MT_E("comm", "mpi_thread", comm.mpi_thread, {"multiple", "funneled"}));
    // [metrics]
    t.push_back(MT_F("metrics", "log_interval", metrics.log_interval));
    t.push_back(MT_F("metrics", "peak_tflops", metrics.peak_tflops));
    t.push_back(MT_F("metrics", "jsonl", metrics.jsonl));
    // [profiling]
    t.push_back(MT_F("profiling", "enable", profiling.enable));
    t.push_back(MT_F("profiling", "start_step", profiling.start_step));
    t.push_back(MT_F("profiling", "end_step", profiling.end_step));
    t.push_back(MT_F("profiling", "folder", profiling.folder));
    t.push_back(MT_F("profiling", "max_events", profiling.max_events));
    // [hardware] (reserved for the planner)
    t.push_back(MT_F("hardware", "name", hardware.name));
    t.push_back(MT_F("hardware", "num_nodes", hardware.num_nodes));
    t.push_back(MT_F("hardware", "gpus_per_node", hardware.gpus_per_node));
    // to_toml writes a section header where the section changes: each section's keys must be one run.
    for (size_t k = 1; k < t.size(); ++k)
      for (size_t j = 0; j + 1 < k && t[k].section != t[k - 1].section; ++j)
        MT_CHECK(t[j].section != t[k].section, "config", "field table: section [", t[k].section,
                 "] is split (key '", t[k].key, "' is not next to the section's other keys)");
    return t;
  }();
  return table;
}
#undef MT_F
#undef MT_E

std::vector<std::string> sections() {
  std::vector<std::string> s;
  for (const auto& f : fields())
    if (s.empty() || s.back() != f.section) s.push_back(f.section);
  return s;
}

const Field* find_field(std::string_view section, std::string_view key) {
  for (const auto& f : fields())
    if (f.section == section && f.key == key) return &f;
  return nullptr;
}

size_t levenshtein(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// ---- errors -------------------------------------------------------------------------------------------
std::string where(std::string_view source, int64_t line) {
  std::string w(source);
  if (line > 0) {
    w.push_back(':');
    w.append(std::to_string(line));
  }
  w.append(": ");
  return w;
}

// Keys that existed once: a config that still sets one is told what replaced it (never silently ignored).
struct RetiredKey {
  const char* name;
  const char* why;
};
constexpr RetiredKey kRetired[] = {
    {"training.dtype",
     "was retired: it only reached the accounting. Use training.compute_dtype = \"auto\" | \"bf16\" | \"fp32\" "
     "(FP8 training will be configured in its own section)"},
    {"parallelism.pipeline_layout",
     "was retired: use parallelism.pp_layout, in Megatron's layout grammar (e.g. \"Et*3|t*4|t*4|t*2L\": E embedding, "
     "t decoder layer, L loss, | between stages)"},
};

bool is_retired(const std::string& name) {
  for (const auto& r : kRetired)
    if (name == r.name) return true;
  return false;
}

std::string unknown_key_text(const std::string& name) {
  for (const auto& r : kRetired)
    if (name == r.name) return "key '" + name + "' " + r.why;
  std::string msg = "unknown key '" + name + "'";
  std::string s = suggest_key(name);
  if (!s.empty()) msg += "; did you mean '" + s + "'?";
  return msg;
}

[[noreturn]] void unknown_key(std::string_view source, int64_t line, const std::string& name) {
  throw Error(where(source, line) + unknown_key_text(name));
}

// ---- TOML node -> Value --------------------------------------------------------------------------------

std::string choices_text(const Field& f) {
  std::string s;
  for (const auto& c : f.choices) s += (s.empty() ? "" : "|") + c;
  return s;
}

Value enum_value(const Field& f, const std::string& s, const std::string& ctx) {
  if (std::find(f.choices.begin(), f.choices.end(), s) == f.choices.end())
    throw Error(ctx + f.full() + ": expected one of " + choices_text(f) + ", got '" + s + "'");
  return s;
}

Value from_toml(const Field& f, const toml::node& n, std::string_view source) {
  const std::string ctx = where(source, n.source().begin.line);
  auto wrong = [&](const char* got) -> Error {
    return Error(ctx + f.full() + ": expected " + kind_name(f.kind) + ", got " + got);
  };
  switch (f.kind) {
    case Kind::Int:
      if (!n.is_integer()) throw wrong(toml_type_name(n));
      return n.as_integer()->get();
    case Kind::Float:
      if (n.is_integer()) return double(n.as_integer()->get());
      if (!n.is_floating_point()) throw wrong(toml_type_name(n));
      return n.as_floating_point()->get();
    case Kind::Bool:
      if (!n.is_boolean()) throw wrong(toml_type_name(n));
      return n.as_boolean()->get();
    case Kind::String:
      if (!n.is_string()) throw wrong(toml_type_name(n));
      return n.as_string()->get();
    case Kind::Enum:
      if (!n.is_string()) throw wrong(toml_type_name(n));
      return enum_value(f, n.as_string()->get(), ctx);
    case Kind::IntList: {
      if (!n.is_array()) throw wrong(toml_type_name(n));
      IntList out;
      for (const auto& e : *n.as_array()) {
        if (!e.is_integer()) throw wrong((std::string("array containing a ") + toml_type_name(e)).c_str());
        out.push_back(e.as_integer()->get());
      }
      return out;
    }
    case Kind::StrList: {
      if (!n.is_array()) throw wrong(toml_type_name(n));
      StrList out;
      for (const auto& e : *n.as_array()) {
        if (!e.is_string()) throw wrong((std::string("array containing a ") + toml_type_name(e)).c_str());
        out.push_back(e.as_string()->get());
      }
      return out;
    }
  }
  throw Error("unreachable");
}

// Values stored in `int` members must fit.
void check_int_range(const Field& f, const Value& v, const std::string& ctx) {
  auto fits = [](int64_t x) { return x >= std::numeric_limits<int>::min() && x <= std::numeric_limits<int>::max(); };
  if (f.kind == Kind::IntList)
    for (int64_t x : std::get<IntList>(v))
      if (!fits(x)) throw Error(ctx + f.full() + ": value " + std::to_string(x) + " out of range");
}

// ---- override text -> Value ----------------------------------------------------------------------------
std::string trim(std::string_view s) {
  size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b, e - b + 1));
}
std::string unquote(std::string s) {
  if (s.size() >= 2 && ((s.front() == '"' && s.back() == '"') || (s.front() == '\'' && s.back() == '\'')))
    return s.substr(1, s.size() - 2);
  return s;
}
bool parse_int(const std::string& s, int64_t& out) {
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (b != e && *b == '+') ++b;
  auto r = std::from_chars(b, e, out);
  return r.ec == std::errc() && r.ptr == e && b != e;
}
bool parse_float(const std::string& s, double& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size();
}
std::vector<std::string> split_list(const std::string& text, bool& ok) {
  std::string s = trim(text);
  ok = true;
  if (!s.empty() && s.front() == '[') {
    if (s.back() != ']') {
      ok = false;
      return {};
    }
    s = s.substr(1, s.size() - 2);
  }
  std::vector<std::string> items;
  if (trim(s).empty()) return items;
  size_t start = 0;
  while (true) {
    size_t comma = s.find(',', start);
    items.push_back(trim(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return items;
}

Value from_text(const Field& f, const std::string& raw, const std::string& ctx) {
  const std::string t = trim(raw);
  auto wrong = [&]() { return Error(ctx + f.full() + ": expected " + kind_name(f.kind) + ", got '" + raw + "'"); };
  switch (f.kind) {
    case Kind::Int: {
      int64_t v;
      if (!parse_int(t, v)) throw wrong();
      return v;
    }
    case Kind::Float: {
      double v;
      if (!parse_float(t, v)) throw wrong();
      return v;
    }
    case Kind::Bool:
      if (t == "true" || t == "1") return true;
      if (t == "false" || t == "0") return false;
      throw wrong();
    case Kind::String: return unquote(t);
    case Kind::Enum: return enum_value(f, unquote(t), ctx);
    case Kind::IntList: {
      bool ok;
      auto items = split_list(t, ok);
      if (!ok) throw wrong();
      IntList out;
      for (const auto& it : items) {
        int64_t v;
        if (!parse_int(it, v)) throw wrong();
        out.push_back(v);
      }
      return out;
    }
    case Kind::StrList: {
      bool ok;
      auto items = split_list(t, ok);
      if (!ok) throw wrong();
      StrList out;
      for (const auto& it : items) {
        if (it.empty()) throw wrong();
        out.push_back(unquote(it));
      }
      return out;
    }
  }
  throw Error("unreachable");
}

// ---- Value -> TOML text ---------------------------------------------------------------------------------
std::string toml_string(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\t': o += "\\t"; break;
      case '\r': o += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          o += buf;
        } else {
          o += char(c);
        }
    }
  }
  return o + "\"";
}

// Shortest text that reads back to the same double, always a TOML float.
std::string toml_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string toml_value(const Value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, int64_t>) return std::to_string(x);
        else if constexpr (std::is_same_v<T, double>) return toml_float(x);
        else if constexpr (std::is_same_v<T, bool>) return x ? "true" : "false";
        else if constexpr (std::is_same_v<T, std::string>) return toml_string(x);
        else if constexpr (std::is_same_v<T, IntList>) {
          std::string s = "[";
          for (size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + std::to_string(x[i]);
          return s + "]";
        } else {
          std::string s = "[";
          for (size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + toml_string(x[i]);
          return s + "]";
        }
      },
      v);
}

// ---- loading ---------------------------------------------------------------------------------------------
void apply_table(JobConfig& c, const toml::table& root, std::string_view source) {
  const auto secs = sections();
  for (auto&& [k, node] : root) {
    const std::string sec(k.str());
    const int64_t line = k.source().begin.line;
    const bool known = std::find(secs.begin(), secs.end(), sec) != secs.end();
    if (!node.is_table()) {
      if (known)
        throw Error(where(source, line) + sec + ": expected a table ([" + sec + "]), got " + toml_type_name(node));
      unknown_key(source, line, sec);
    }
    for (auto&& [kk, v] : *node.as_table()) {
      const std::string key(kk.str());
      const Field* f = known ? find_field(sec, key) : nullptr;
      if (!f) unknown_key(source, kk.source().begin.line, sec + "." + key);
      Value val = from_toml(*f, v, source);
      check_int_range(*f, val, where(source, v.source().begin.line));
      f->set(c, val);
    }
  }
}

JobConfig finish(JobConfig c, const std::vector<std::string>& overrides, std::string_view source) {
  for (const auto& o : overrides) apply_override(c, o);
  c.resolve();
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(std::string(source) + ": " + e.what());
  }
  return c;
}


}  // namespace

std::vector<std::string> config_keys() {
  std::vector<std::string> k;
  for (const auto& f : fields()) k.push_back(f.full());
  return k;
}

std::map<std::string, std::string> non_default_settings(const JobConfig& c) {
  static const JobConfig defaults;
  std::map<std::string, std::string> out;
  for (const auto& f : fields()) {
    std::string v = toml_value(f.get(c));
    if (v != toml_value(f.get(defaults))) out.emplace(f.full(), std::move(v));
  }
  return out;
}

std::string suggest_key(std::string_view name) {
  const size_t dot = name.find('.');
  const std::string_view key = dot == std::string_view::npos ? name : name.substr(dot + 1);
  const Field* best = nullptr;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& f : fields()) {
    size_t d = levenshtein(name, f.full());
    if (f.key == key) d = std::min<size_t>(d, 1);  // right key, wrong (or no) section
    if (key.size() >= 3 && f.full().rfind(name, 0) == 0) d = std::min<size_t>(d, 1);  // a prefix of a key
    if (d < best_d) best_d = d, best = &f;
  }
  const size_t limit = std::max<size_t>(2, name.size() / 3);
  return best && best_d <= limit ? best->full() : std::string();
}

void apply_override(JobConfig& c, std::string_view text) {
  std::string s(text);
  const std::string ctx = "override '" + s + "': ";
  if (s.rfind("--", 0) == 0) s = s.substr(2);
  const size_t eq = s.find('=');
  if (eq == std::string::npos) throw Error(ctx + "expected --section.key=value");
  const std::string name = trim(s.substr(0, eq));
  const size_t dot = name.find('.');
  const Field* f = dot == std::string::npos ? nullptr : find_field(name.substr(0, dot), name.substr(dot + 1));
  if (!f) throw Error(ctx + unknown_key_text(name));
  Value v = from_text(*f, s.substr(eq + 1), ctx);
  check_int_range(*f, v, ctx);
  f->set(c, v);
}

JobConfig load_config_string(std::string_view text, const std::vector<std::string>& overrides,
                             std::string_view source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw Error(where(source, e.source().begin.line) + "TOML syntax error: " + std::string(e.description()));
  }
  JobConfig c;
  apply_table(c, root, source);
  return finish(std::move(c), overrides, source);
}

JobConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error("config file '" + path + "' not found (or not a regular file)");
  toml::table root;
  try {
    root = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw Error(where(path, e.source().begin.line) + "TOML syntax error: " + std::string(e.description()));
  }
  JobConfig c;
  apply_table(c, root, path);
  return finish(std::move(c), overrides, path);
}

std::string to_toml(const JobConfig& c) {
  std::string out;
  std::string sec;
  for (const auto& f : fields()) {
    if (f.section != sec) {
      out += (sec.empty() ? "[" : "\n[") + f.section + "]\n";
      sec = f.section;
    }
    out += f.key + " = " + toml_value(f.get(c)) + "\n";
  }
  return out;
}

nlohmann::json to_json(const JobConfig& c) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& f : fields()) {
    std::visit([&](const auto& x) { j[f.section][f.key] = x; }, f.get(c));
  }
  return j;
}

JobConfig config_from_json(const nlohmann::json& j) {
  JobConfig c;
  if (!j.is_object()) throw Error("config JSON: expected an object of sections");
  for (const auto& [sec, body] : j.items()) {
    if (!body.is_object()) unknown_key("config JSON", 0, sec);
    for (const auto& item : body.items()) {
      const std::string& key = item.key();
      const nlohmann::json& v = item.value();  // a named reference, not a binding: clang 14 cannot capture those
      const Field* f = find_field(sec, key);
      // A stored config (a checkpoint's) may carry keys retired since it was written: they are skipped, so an
      // old checkpoint still loads. Only keys that never existed are errors.
      if (!f && is_retired(sec + "." + key)) continue;
      if (!f) unknown_key("config JSON", 0, sec + "." + key);
      const std::string ctx = "config JSON: ";
      auto wrong = [&]() { return Error(ctx + f->full() + ": expected " + kind_name(f->kind) + ", got " + v.type_name()); };
      Value val;
      switch (f->kind) {
        case Kind::Int:
          if (!v.is_number_integer()) throw wrong();
          val = v.get<int64_t>();
          break;
        case Kind::Float:
          if (!v.is_number()) throw wrong();
          val = v.get<double>();
          break;
        case Kind::Bool:
          if (!v.is_boolean()) throw wrong();
          val = v.get<bool>();
          break;
        case Kind::String:
          if (!v.is_string()) throw wrong();
          val = v.get<std::string>();
          break;
        case Kind::Enum:
          if (!v.is_string()) throw wrong();
          val = enum_value(*f, v.get<std::string>(), ctx);
          break;
        case Kind::IntList: {
          if (!v.is_array()) throw wrong();
          IntList l;
          for (const auto& e : v) {
            if (!e.is_number_integer()) throw wrong();
            l.push_back(e.get<int64_t>());
          }
          val = l;
          break;
        }
        case Kind::StrList: {
          if (!v.is_array()) throw wrong();
          StrList l;
          for (const auto& e : v) {
            if (!e.is_string()) throw wrong();
            l.push_back(e.get<std::string>());
          }
          val = l;
          break;
        }
      }
      check_int_range(*f, val, ctx);
      f->set(c, val);
    }
  }
  c.resolve();
  c.validate();
  return c;
}

}  // namespace moetron
