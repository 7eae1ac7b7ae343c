// config_pipeline.cpp: resolve_pipeline (config.h), the [parallelism] pp_* keys turned into stages per rank,
// micro-batches per step, a layer layout and a checked schedule (the generator's preconditions, or a user's
// CSV schedule read and validated). Errors name the key and its value. Not the layout grammar or the
// generators (src/schedule/) and not the rest of config validation (config.cpp).
#include <algorithm>
#include <string>
#include <string_view>

#include "moetron/config.h"
#include "moetron/check.h"

namespace moetron {
namespace {

constexpr int64_t kMaxVirtualStages = 1024;
constexpr int64_t kMaxLessLayers = int64_t(1) << 14;  // model.n_layers' own limit

// Drops the "src/x/y.cpp:123: [op] " locations (and "check failed: <condition>: ") MT_CHECK puts in front of a
// message, also nested ones as in read_csv_file's "path: src/...: [schedule] CSV row ...": a config error names
// keys and values, not source lines.
std::string why_of(const Error& e) {
  std::string m = e.what();
  size_t from = 0;
  while (true) {
    const size_t b = m.find(": [", from);
    if (b == std::string::npos) break;
    const size_t close = m.find("] ", b);
    size_t start = m.rfind(' ', b);
    start = start == std::string::npos ? 0 : start + 1;
    const std::string_view loc(m.data() + start, b - start);  // "src/x.cpp:123"
    const size_t colon = loc.rfind(':');
    const bool is_loc = close != std::string::npos && colon != std::string_view::npos && colon + 1 < loc.size() &&
                        loc.substr(colon + 1).find_first_not_of("0123456789") == std::string_view::npos &&
                        (loc.substr(0, colon).ends_with(".cpp") || loc.substr(0, colon).ends_with(".h"));
    if (!is_loc) {
      from = b + 1;
      continue;
    }
    m.erase(start, close + 2 - start);
    // MT_CHECK's "check failed: <condition>: " is source code too.
    const std::string cf = "check failed: ";
    if (m.compare(start, cf.size(), cf) == 0) {
      const size_t end = m.find(": ", start + cf.size());
      if (end != std::string::npos) m.erase(start, end + 2 - start);
    }
    from = start;
  }
  return m;
}

std::string quoted(const std::string& s) { return "\"" + s + "\""; }

int default_stages_per_rank(const std::string& schedule) {
  return schedule == "interleaved_1f1b" || sched::is_v_shape(schedule) ? 2 : 1;
}

}  // namespace

PipelineSetup resolve_pipeline(const JobConfig& c) {
  const auto& p = c.parallelism;
  const auto& t = c.training;
  const int pp = int(p.pp);  // 1 .. 2^20 (validate checks pp and the size limits first)
  PipelineSetup out;

  // ---- plain ranges ----
  if (p.pp_virtual_stages < 0 || p.pp_virtual_stages > kMaxVirtualStages)
    invalid_config("parallelism.pp_virtual_stages", p.pp_virtual_stages, "must be in [0, ", kMaxVirtualStages,
        "] (stages per pipeline rank; 0 = from pp_layout or pp_schedule_csv, else the schedule's default)");
  for (auto [key, v] : {std::pair{"parallelism.pp_first_stage_less_layers", p.pp_first_stage_less_layers},
                        std::pair{"parallelism.pp_last_stage_less_layers", p.pp_last_stage_less_layers}}) {
    if (v < 0 || v > kMaxLessLayers)
      invalid_config(key, v, "must be in [0, 2^14] (layer-equivalents of the even split; 0 = plain even split)");
    if (v != 0 && !p.pp_layout.empty())
      invalid_config(key, v, "applies to the even split only, but parallelism.pp_layout = ", quoted(p.pp_layout),
          " places every layer (set it to 0 or drop pp_layout)");
  }

  if (p.ep_overlap_split && !p.ep_overlap)
    invalid_config("parallelism.ep_overlap_split", "true", "needs parallelism.ep_overlap = true: it splits the "
                   "warm-up and cool-down chunks that the 1F1B all-to-all overlap leaves unpaired");

  // ---- micro-batches per optimizer step ----
  const int64_t per_step = t.micro_batch_size * p.dp();  // validated > 0, and global_batch_size a multiple of it
  const int64_t derived = t.global_batch_size / per_step;
  if (p.pp_microbatches > 0 && p.pp_microbatches != derived)
    invalid_config("parallelism.pp_microbatches", p.pp_microbatches,
        "must equal training.global_batch_size / (micro_batch_size * dp) = ", t.global_batch_size, " / (",
        t.micro_batch_size, " * ", p.dp(), ") = ", derived,
        " (0 derives it; the pipeline runs every micro-batch of an optimizer step)");
  out.microbatches = p.pp_microbatches > 0 ? p.pp_microbatches : derived;

  // ---- a user's schedule ----
  const std::string csv_key = "parallelism.pp_schedule_csv";
  if (!p.pp_schedule_csv.empty()) {
    const std::string path = quoted(p.pp_schedule_csv);
    try {
      out.csv = sched::read_csv_file(p.pp_schedule_csv);
    } catch (const Error& e) {
      invalid_config(csv_key.c_str(), path, why_of(e));
    }
    out.from_csv = true;
    if (out.csv.pp != pp)
      invalid_config(csv_key.c_str(), path, "has ", out.csv.pp, " rows (one per pipeline rank), parallelism.pp = ", pp);
    if (out.csv.n_microbatches != out.microbatches)
      invalid_config(csv_key.c_str(), path, "runs ", out.csv.n_microbatches, " micro-batches, the job has ",
          out.microbatches, " per optimizer step (global_batch_size / (micro_batch_size * dp)",
          p.pp_microbatches > 0 ? ", = pp_microbatches" : "", ")");
    try {
      sched::check_valid(out.csv);
    } catch (const Error& e) {
      invalid_config(csv_key.c_str(), path, why_of(e));
    }
  }

  // ---- stages per rank ----
  const bool v_shape = !out.from_csv && sched::is_v_shape(p.pp_schedule);
  auto layout_error = [&](const Error& e) {
    std::string why = why_of(e);
    const std::string lead = "pp_layout \"";
    if (why.rfind(lead, 0) == 0) throw Error("invalid config: parallelism.pp_layout = " + why.substr(lead.size() - 1));
    invalid_config("parallelism.pp_layout", quoted(p.pp_layout), why);
  };
  int vpp = int(p.pp_virtual_stages);
  if (vpp == 0 && !p.pp_layout.empty()) {
    try {
      out.layout = sched::parse_pp_layout(p.pp_layout, c.model.n_layers, pp, 0, v_shape, c.model.mtp_layers);
    } catch (const Error& e) {
      layout_error(e);
    }
    vpp = out.layout.stages_per_rank();
  }
  if (vpp == 0) vpp = out.from_csv ? out.csv.stages_per_rank() : default_stages_per_rank(p.pp_schedule);
  out.stages_per_rank = vpp;
  const int n_stages = pp * vpp;  // <= 2^20 * 2^10

  // ---- the schedule's preconditions (before the layout: they say what the schedule needs) ----
  if (out.from_csv) {
    if (p.ep_overlap)
      invalid_config("parallelism.ep_overlap", "true", "applies to the generated interleaved_1f1b schedule, not to "
                     "parallelism.pp_schedule_csv");
    if (out.csv.n_stages != n_stages)
      invalid_config(csv_key.c_str(), quoted(p.pp_schedule_csv), "has ", out.csv.n_stages,
          " stages, pp * stages per rank = ", pp, " * ", vpp, " = ", n_stages,
          p.pp_virtual_stages > 0 ? " (pp_virtual_stages)" : !p.pp_layout.empty() ? " (from pp_layout)" : "");
  } else {
    out.spec.schedule = p.pp_schedule;
    out.spec.pp = pp;
    out.spec.vpp = vpp;
    out.spec.microbatches = int(out.microbatches);  // <= 2^20
    out.spec.group_size = 0;
    out.spec.ep_overlap = p.ep_overlap;
    if (p.ep_overlap && p.pp_schedule != "interleaved_1f1b")
      invalid_config("parallelism.ep_overlap", "true", "needs parallelism.pp_schedule = \"interleaved_1f1b\" (got \"",
                     p.pp_schedule, "\"): the overlap fuses the interleaved schedule's steady-state pairs");
    if (p.ep_overlap && p.ep < 2)
      invalid_config("parallelism.ep_overlap", "true", "needs expert parallelism (parallelism.ep > 1): without EP "
                     "there is no all-to-all to hide");
    try {
      sched::check_spec(out.spec);
    } catch (const Error& e) {
      std::string why = why_of(e);
      if (why.rfind(p.pp_schedule + ": ", 0) == 0) why.erase(0, p.pp_schedule.size() + 2);  // named by the key already
      invalid_config("parallelism.pp_schedule", p.pp_schedule, why, " (pp = ", pp, ", stages per rank = ", vpp,
          p.pp_virtual_stages > 0 ? " from pp_virtual_stages" : !p.pp_layout.empty() ? " from pp_layout" : " by default",
          ", micro-batches = ", out.microbatches, p.pp_microbatches > 0 ? " from pp_microbatches" :
          " = global_batch_size / (micro_batch_size * dp)", ")");
    }
  }

  // ---- the layer layout ----
  if (!p.pp_layout.empty()) {
    if (out.layout.stages.empty()) {  // not parsed above (pp_virtual_stages was given)
      try {
        out.layout = sched::parse_pp_layout(p.pp_layout, c.model.n_layers, pp, n_stages, v_shape, c.model.mtp_layers);
      } catch (const Error& e) {
        layout_error(e);
      }
    }
  } else {
    try {
      out.layout = sched::even_pp_layout(c.model.n_layers, pp, vpp, p.pp_first_stage_less_layers,
                                         p.pp_last_stage_less_layers, v_shape);
    } catch (const Error& e) {
      const std::string why = why_of(e);
      for (const char* k : {"pp_first_stage_less_layers", "pp_last_stage_less_layers"})
        if (why.rfind(k, 0) == 0) throw Error("invalid config: parallelism." + why);
      invalid_config("parallelism.pp", pp, why);
    }
  }
  if (out.from_csv) out.layout.stage_rank = out.csv.stage_rank;  // the CSV's placement (sizes checked above)
  return out;
}

ActivationCheckpointSpec resolve_checkpointing(const JobConfig& c) {
  ActivationCheckpointSpec a = c.activation_checkpoint;
  if (a.stage_ids.empty()) return a;
  const PipelineSetup ps = resolve_pipeline(c);
  std::vector<int> layers;
  for (int st : a.stage_ids) {
    MT_CHECK(st >= 0 && st < ps.layout.n_stages, "resolve_checkpointing", "stage ", st, " outside [0, ",
             ps.layout.n_stages, ")");
    std::vector<int> blocks = ps.layout.layers(st);
    if (st == ps.layout.n_stages - 1)  // the MTP blocks live on the last stage
      for (int64_t b = c.model.n_layers; b < c.model.n_blocks(); ++b) blocks.push_back(int(b));
    for (int l : blocks)
      if (a.layer_ids.empty() || std::find(a.layer_ids.begin(), a.layer_ids.end(), l) != a.layer_ids.end())
        layers.push_back(l);
  }
  std::sort(layers.begin(), layers.end());
  a.stage_ids.clear();
  a.layer_ids = layers;
  if (layers.empty()) a.mode = AcMode::None, a.modules.clear();
  return a;
}

}  // namespace moetron
