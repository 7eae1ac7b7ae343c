// run_data.cpp: the run report's data: metrics.jsonl read and checked line by line, the trace analysis checked,
// and both turned into the series the page draws (see run_report.h). Not the HTML (report_html.cpp).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moetron/check.h"
#include "report/run_report.h"

namespace fs = std::filesystem;

namespace moetron::report {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MT_CHECK(f.good(), "report", "cannot read ", path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// "FILE:LINE: " for the messages about one record.
struct Where {
  const std::string& path;
  int64_t line;
};
std::ostream& operator<<(std::ostream& o, const Where& w) { return o << w.path << ":" << w.line << ": "; }

void check_number(const json& r, const char* key, const Where& w, bool required) {
  const auto it = r.find(key);
  if (it == r.end() || (!required && it->is_null())) {
    MT_CHECK(!required, "report", w, "the record has no \"", key, "\" (every metrics.jsonl record has step and loss)");
    return;
  }
  MT_CHECK(it->is_number(), "report", w, "\"", key, "\" is ", it->dump(), ", not a number");
}

// The expert_counts object of one record (src/train/train_report.cpp writes it): its shape, and the same
// layers, experts and bin as the first record that has one.
void check_expert_counts(const json& x, const Where& w, json& first) {
  MT_CHECK(x.is_object(), "report", w, "\"expert_counts\" is not an object");
  for (const char* k : {"experts", "bin"})
    MT_CHECK(x.contains(k) && x[k].is_number_integer() && x[k].get<int64_t>() > 0, "report", w, "expert_counts.", k,
             " is missing or not a positive integer");
  MT_CHECK(x.contains("layers") && x["layers"].is_array() && !x["layers"].empty(), "report", w,
           "expert_counts.layers is missing or empty");
  MT_CHECK(x.contains("counts") && x["counts"].is_array(), "report", w, "expert_counts.counts is missing");
  const int64_t E = x["experts"], bin = x["bin"], cols = (E + bin - 1) / bin;
  if (x.contains("dead")) {  // experts of each layer with no token over the logging window (optional: older runs)
    const json& d = x["dead"];
    MT_CHECK(d.is_array() && d.size() == x["layers"].size(), "report", w, "expert_counts.dead is not one count per layer (",
             x["layers"].size(), " layers)");
    for (size_t l = 0; l < d.size(); ++l)
      MT_CHECK(d[l].is_number_integer() && d[l].get<int64_t>() >= 0 && d[l].get<int64_t>() <= E, "report", w,
               "expert_counts.dead[", l, "] is ", d[l].dump(), ", not a count of 0 to ", E, " experts");
  }
  const json& c = x["counts"];
  MT_CHECK(c.size() == x["layers"].size(), "report", w, "expert_counts.counts has ", c.size(), " rows for ",
           x["layers"].size(), " layers");
  for (size_t l = 0; l < c.size(); ++l) {
    MT_CHECK(c[l].is_array() && int64_t(c[l].size()) == cols, "report", w, "expert_counts.counts[", l, "] has ",
             c[l].is_array() ? c[l].size() : 0, " entries, expected ", cols, " (experts ", E, ", bin ", bin, ")");
    for (const json& v : c[l])
      MT_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0, "report", w, "expert_counts.counts[", l,
               "] holds ", v.dump(), ", not a token count");
  }
  if (first.is_null()) {
    first = json{{"layers", x["layers"]}, {"experts", E}, {"bin", bin}};
    return;
  }
  MT_CHECK(first["layers"] == x["layers"] && first["experts"] == x["experts"] && first["bin"] == x["bin"], "report", w,
           "expert_counts changes shape (layers ", x["layers"].dump(), ", experts ", E, ", bin ", bin,
           ") from the first record's (layers ", first["layers"].dump(), ", experts ", first["experts"], ", bin ",
           first["bin"], ")");
}

json numbers_or_null(const json& records, const char* key, double scale = 1) {
  json a = json::array();
  for (const json& r : records) {
    const auto it = r.find(key);
    a.push_back(it == r.end() || it->is_null() ? json(nullptr) : json(it->get<double>() * scale));
  }
  return a;
}

double round3(double x) { return std::round(x * 1000) / 1000; }

// Per MoE layer and sampled log step: each expert's (or bin's, per expert) share of the layer's tokens over the
// balanced share (1 = balanced), the layer's imbalance (the largest of those), and its dead experts (no token over
// the record's logging window; null where a record has none, the whole series null when no record has them).
json expert_series(const json& records) {
  std::vector<const json*> with;
  for (const json& r : records)
    if (r.contains("expert_counts")) with.push_back(&r);
  if (with.empty()) return nullptr;
  const json& x0 = with.front()->at("expert_counts");
  const int64_t E = x0["experts"], bin = x0["bin"], L = int64_t(x0["layers"].size()), cols = (E + bin - 1) / bin;
  const size_t stride = (with.size() + kMaxHeatmapSteps - 1) / kMaxHeatmapSteps;
  json steps = json::array(), share = json::array(), imbalance = json::array(), dead = json::array();
  for (int64_t l = 0; l < L; ++l) share.push_back(json::array()), imbalance.push_back(json::array()), dead.push_back(json::array());
  bool any_dead = false;
  for (size_t i = 0; i < with.size(); i += stride) {
    const json& r = *with[i];
    steps.push_back(r["step"]);
    for (int64_t l = 0; l < L; ++l) {
      const json& c = r["expert_counts"]["counts"][size_t(l)];
      double total = 0;
      for (const json& v : c) total += v.get<double>();
      const double per_expert = total / double(E);
      json row = json::array();
      double worst = 0;
      for (int64_t k = 0; k < cols; ++k) {
        const double n_in_bin = double(std::min(bin, E - k * bin));
        const double s = per_expert > 0 ? c[size_t(k)].get<double>() / n_in_bin / per_expert : 0;
        worst = std::max(worst, s);
        row.push_back(round3(s));
      }
      share[size_t(l)].push_back(row);
      imbalance[size_t(l)].push_back(round3(worst));
      const json& x = r["expert_counts"];
      dead[size_t(l)].push_back(x.contains("dead") ? x["dead"][size_t(l)] : json(nullptr));
      any_dead = any_dead || x.contains("dead");
    }
  }
  return {{"layers", x0["layers"]}, {"experts", E},         {"bin", bin},          {"stride", stride},
          {"steps", steps},         {"share", share},       {"imbalance", imbalance}, {"records", with.size()},
          {"dead", any_dead ? dead : json(nullptr)}};
}

bool is_number(const json& j, const char* k) { return j.contains(k) && j[k].is_number(); }

}  // namespace

json read_metrics(const std::string& path) {
  MT_CHECK(fs::is_regular_file(path), "report", path,
           ": no such file (a run directory holds the metrics.jsonl that `moetron train` writes when [metrics] "
           "jsonl = true)");
  std::ifstream f(path);
  MT_CHECK(f.good(), "report", "cannot read ", path);
  json out = json::array(), expert_shape;
  std::string text;
  for (int64_t line = 1; std::getline(f, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const Where w{path, line};
    json r;
    try {
      r = json::parse(text);
    } catch (const json::parse_error& e) {
      const std::string why = e.what();  // "... parse error at line 1, column C: ...": the line is ours
      const size_t at = why.find("column ");
      MT_FAIL("report", w, "not a JSON record (", at == std::string::npos ? why : why.substr(at), ")");
    } catch (const json::exception& e) {  // e.g. a number beyond double's range
      MT_FAIL("report", w, "not a JSON record (", e.what(), ")");
    }
    MT_CHECK(r.is_object(), "report", w, "a record is a JSON object, this line holds ", r.type_name());
    check_number(r, "step", w, true);
    MT_CHECK(r["step"].is_number_integer(), "report", w, "\"step\" is ", r["step"].dump(), ", not an integer");
    // A step skipped for a non-finite loss (training.nonfinite = "skip") logs "loss": null and "skipped": true.
    check_number(r, "loss", w, !(r.contains("skipped") && r["skipped"] == true));
    for (const char* k : {"aux_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "mem_peak_bytes",
                          "time_s"})
      check_number(r, k, w, false);
    if (r.contains("mem_peak_by_category")) {
      const json& m = r["mem_peak_by_category"];
      MT_CHECK(m.is_object(), "report", w, "\"mem_peak_by_category\" is not an object");
      for (auto it = m.begin(); it != m.end(); ++it)
        MT_CHECK(it->is_number(), "report", w, "mem_peak_by_category.", it.key(), " is ", it->dump(), ", not bytes");
    }
    if (r.contains("expert_counts")) check_expert_counts(r["expert_counts"], w, expert_shape);
    const int64_t step = r["step"];
    while (!out.empty() && out.back()["step"].get<int64_t>() >= step) out.erase(out.end() - 1);
    out.push_back(std::move(r));
  }
  MT_CHECK(!out.empty(), "report", path, ": holds no records");
  return out;
}

json read_analysis(const std::string& path) {
  MT_CHECK(fs::is_regular_file(path), "report", path, ": no such file (write it with `moetron trace analyze DIR --json > ",
           path, "`)");
  json a;
  try {
    a = json::parse(read_text(path));
  } catch (const json::parse_error& e) {
    MT_FAIL("report", path, ": not JSON (", e.what(), ")");
  } catch (const json::exception& e) {
    MT_FAIL("report", path, ": not JSON (", e.what(), ")");
  }
  MT_CHECK(a.is_object(), "report", path, ": a trace analysis is a JSON object");
  MT_CHECK(a.contains("ranks") && a["ranks"].is_array() && !a["ranks"].empty(), "report", path,
           ": \"ranks\" is missing or empty");
  json ranks = json::array();
  for (size_t i = 0; i < a["ranks"].size(); ++i) {
    const json& r = a["ranks"][i];
    json keep = json::object();
    for (const char* k : {"rank", "step_time_s", "compute_s", "exposed_comm_s", "idle_s"}) {
      MT_CHECK(r.is_object() && is_number(r, k), "report", path, ": ranks[", i, "].", k, " is missing or not a number");
      keep[k] = r[k];
    }
    ranks.push_back(keep);
  }
  json out{{"ranks", ranks}};
  for (const char* k : {"top_kernels", "collectives"}) {
    MT_CHECK(a.contains(k) && a[k].is_array(), "report", path, ": \"", k, "\" is missing or not an array");
    json rows = json::array();
    for (size_t i = 0; i < a[k].size() && i < size_t(kMaxTableRows); ++i) {
      MT_CHECK(a[k][i].is_object(), "report", path, ": ", k, "[", i, "] is not an object");
      rows.push_back(a[k][i]);
    }
    out[k] = rows;
    out[std::string(k) + "_total"] = a[k].size();
  }
  MT_CHECK(a.contains("straggler_rank") && (a["straggler_rank"].is_number_integer() || a["straggler_rank"].is_null()),
           "report", path, ": \"straggler_rank\" is missing (null when there is none) or not an integer");
  out["straggler_rank"] = a["straggler_rank"];
  return out;
}

json page_data(const json& records, const std::string& title, const json& config_text, const json& analysis) {
  json d;
  d["title"] = title;
  d["records"] = records.size();
  json steps = json::array();
  for (const json& r : records) steps.push_back(r["step"]);
  d["steps"] = steps;
  for (const char* k : {"loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mem_peak_bytes"})
    d[k] = numbers_or_null(records, k);
  d["mfu_pct"] = numbers_or_null(records, "mfu", 100);
  json vs = json::array(), vl = json::array();
  for (const json& r : records)
    if (is_number(r, "val_loss")) vs.push_back(r["step"]), vl.push_back(r["val_loss"]);
  d["val"] = {{"steps", vs}, {"loss", vl}};
  d["memory"] = nullptr;  // the last record's peaks: the run's peak per category so far
  for (auto it = records.rbegin(); it != records.rend(); ++it)
    if (it->contains("mem_peak_by_category")) {
      d["memory"] = {{"step", (*it)["step"]}, {"by_category", (*it)["mem_peak_by_category"]},
                     {"total_peak", it->value("mem_peak_bytes", 0.0)}};
      break;
    }
  d["experts"] = expert_series(records);
  d["config"] = config_text;
  d["analysis"] = analysis;
  return d;
}

json load_run(const std::string& run_dir, const std::string& analysis_path) {
  MT_CHECK(fs::is_directory(run_dir), "report", run_dir,
           ": not a directory (give the run's dump folder, [job] dump_folder, which holds metrics.jsonl)");
  const fs::path dir(run_dir);
  const json records = read_metrics((dir / "metrics.jsonl").string());
  json config = nullptr, analysis = nullptr;
  if (fs::is_regular_file(dir / "config.toml")) config = read_text((dir / "config.toml").string());
  std::string ap = analysis_path;
  if (ap.empty() && fs::is_regular_file(dir / "analysis.json")) ap = (dir / "analysis.json").string();
  if (!ap.empty()) analysis = read_analysis(ap);
  json d = page_data(records, dir.lexically_normal().string(), config, analysis);
  d["sources"] = {{"metrics", (dir / "metrics.jsonl").string()},
                  {"config", config.is_null() ? json(nullptr) : json((dir / "config.toml").string())},
                  {"analysis", ap.empty() ? json(nullptr) : json(ap)}};
  return d;
}

}  // namespace moetron::report
