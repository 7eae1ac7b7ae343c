// run_report.h: `moetron report`, the HTML page of one training run. It reads the run's files (metrics.jsonl,
// config.toml, an optional trace analysis), turns them into the page's data (one JSON object), and writes a
// self-contained page that inlines the plotting library installed by npm in web/ (Chart.js with its matrix
// chart) and the page's own script (web/report.js). Not the trainer that writes the files
// (src/train/train_report.cpp) and not the trace analyzer (`moetron trace analyze`). Links no engine code.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace moetron::report {

using json = nlohmann::json;

// Columns of the expert-load heatmaps: beyond this many log records, every k-th record is drawn.
inline constexpr int kMaxHeatmapSteps = 200;
// Rows of the trace analysis tables (top kernels, collectives) kept in the page.
inline constexpr int kMaxTableRows = 20;

// metrics.jsonl: one JSON object per line, each with a numeric "step" and "loss". A record whose step is not
// after the previous one (a resumed run appends from its checkpoint) replaces the records from that step on.
// Throws moetron::Error naming the file and line of a bad record, or the file when it is missing or empty.
json read_metrics(const std::string& path);

// A `moetron trace analyze --json` file: checks the keys the page draws (ranks[].{rank, step_time_s,
// compute_s, exposed_comm_s, idle_s}, top_kernels[], collectives[], straggler_rank) and keeps those, the
// tables cut to kMaxTableRows. Throws moetron::Error naming the file and the key.
json read_analysis(const std::string& path);

// The page's data from a run directory: RUN_DIR/metrics.jsonl (required), RUN_DIR/config.toml (optional),
// the analysis from analysis_path, else RUN_DIR/analysis.json when present, else none.
json load_run(const std::string& run_dir, const std::string& analysis_path = "");

// The page's data from records already read (read_metrics) plus optional config text and analysis (null).
json page_data(const json& records, const std::string& title, const json& config_text, const json& analysis);

// What the page inlines, read from the web folder (default: the source tree's web/, or $MOETRON_WEB_DIR).
struct WebAssets {
  std::string chart_js;   // node_modules/chart.js/dist/chart.umd.min.js
  std::string matrix_js;  // node_modules/chartjs-chart-matrix/dist/chartjs-chart-matrix.min.js
  std::string page_js;    // report.js
  std::string page_css;   // report.css
};
std::string default_web_dir();
// Throws moetron::Error naming a missing file and the command that installs it.
WebAssets load_web_assets(const std::string& web_dir);

// The whole page: no external reference (no network at view time).
std::string render_html(const json& data, const WebAssets& assets);

}  // namespace moetron::report
