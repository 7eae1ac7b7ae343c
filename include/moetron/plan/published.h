// plan/published.h: the planner against published MoE training throughput (tests/data/published_moe_runs.csv,
// issue 33): a CSV reader (RFC 4180 quoting; errors name the file, line and column), the mapping of one published
// row onto a preset config, a catalog entry, a layout, a batch and a [quantize] recipe (or the reason it cannot be
// mapped), its projection through plan_time (the same call as `plan time`; no cost model of its own), and the
// per-split summary (median and worst |error|). `moetron plan validate --published FILE` prints it. Not a cost
// model, not a calibration (it changes no figure), and it runs no engine.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace moetron::plan {

// A CSV file as read: the header row and the data rows (each with the line it starts on, 1-based).
struct CsvTable {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::vector<int64_t> lines;
};
// RFC 4180: comma-separated, fields in double quotes may hold commas, newlines and "" (a quote). Every row must
// have the header's field count. Throws moetron::Error "<source>:<line>:<column>: <what>" (1-based, the column
// in characters) for an unterminated quote, text after a closing quote, a quote inside an unquoted field, or a row
// with another field count.
CsvTable read_csv(std::string_view text, std::string_view source);
CsvTable read_csv_file(const std::string& path);

// One row of the published data set, its fields by column name ("" where empty or absent).
struct PublishedRow {
  std::map<std::string, std::string> f;
  int64_t line = 0;
  const std::string& get(const std::string& key) const;
};
// The rows of a published_moe_runs.csv; throws naming the file and the missing column if a needed one is absent.
std::vector<PublishedRow> read_published(const std::string& path);

// The explicit tables (case-insensitive; spaces, '-' and '_' ignored): a model name -> preset file name
// ("deepseek_v3.toml"), a hardware name -> catalog entry ("h100"); "" when there is none.
std::string preset_for_model(std::string_view model);
std::string hardware_for(std::string_view hw);

// A row mapped onto the planner's inputs, or the reason it is not projected.
struct RowMapping {
  bool ok = false;
  std::string reason;                  // "not projected: ..." when !ok
  std::string preset;                  // e.g. "deepseek_v3.toml"
  std::string hardware;                // catalog entry
  int64_t world = 0;
  int64_t tokens_per_step = 0;         // global batch in sequences x seq_len
  std::vector<std::string> overrides;  // "--section.key=value", applied to the preset as `plan time` applies them
  double ep_imbalance = 1;             // PlanOptions::ep_imbalance: kDroplessEpImbalance where the routing is dropless
};
// The busiest EP rank's routed rows over the balanced count taken for a row whose routing column says "dropless"
// (forced or not stated: 1). FITTED, not measured: the factor with which `plan time` reproduces the four
// forced-balance / dropless throughput pairs of Megatron-MoE-ModelZoo's Qwen3-235B long-context table (docs/planner.md,
// "Published MoE runs", ninth state); those pairs are not rows of the data set.
constexpr double kDroplessEpImbalance = 1.67;
RowMapping map_row(const PublishedRow& r);

// Whether the row's throughput unit is tokens per second per GPU (tokens/s/GPU, or tokens/s/device).
bool per_gpu_tokens(std::string_view unit);

struct PublishedResult {
  std::string id, split, publisher, model, hardware, precision, unit;
  int64_t world = 0;
  std::string status;      // "projected", "not projected: ...", "not compared: unit ..."
  bool projected = false;  // plan_time ran
  bool compared = false;   // projected and the unit is tokens/s/GPU
  std::string layout;      // Layout::describe() of the projected layout
  std::string memory;      // plan_memory's verdict for it (FITS, AT-RISK, OOM): the published run did fit
  double measured = 0;     // the published throughput (its unit), or tokens/s/GPU derived from a published step time
  std::string measured_from;  // "" (the throughput column) or "step time" (tokens_per_step / (step x world))
  double projected_tps = 0;  // tokens/s/GPU
  double error = 0;        // projected / measured - 1 (compared rows)
  double ep_imbalance = 1;  // the routing imbalance the row was projected with (RowMapping::ep_imbalance)
  // The projected step: seconds, and its split (plan_time's breakdown grouped): compute (compute.*), exposed TP /
  // CP, exposed EP, exposed DP, bubble (with P2P), exposed host kernel issue, other (optimizer, weight refresh).
  double step_s = 0, compute = 0, tp_cp = 0, ep = 0, dp = 0, bubble = 0, host = 0, other = 0;
};
// `configs_dir` holds the presets. Never throws for a row the planner refuses: the reason goes into status.
PublishedResult project_row(const PublishedRow& r, const std::string& configs_dir);

struct SplitSummary {
  std::string split;
  int64_t rows = 0, projected = 0, compared = 0;
  double median_abs_error = 0, worst_abs_error = 0;  // over compared rows (0 when none)
  std::string worst_id;
};
// Over the split's compared rows: the median of |error| (plan::median, calibrate.h) and the worst with its id.
SplitSummary summarize(const std::vector<PublishedResult>& rs, const std::string& split);

std::string format_published(const std::vector<PublishedResult>& rs, const std::vector<SplitSummary>& s);
nlohmann::json published_json(const std::vector<PublishedResult>& rs, const std::vector<SplitSummary>& s);

}  // namespace moetron::plan
