// test_run_data.cpp: the run report's reading and data (src/report/), linked without the engine: bad
// metrics.jsonl records named by file and line, a resumed run's records, the expert-load shares worked by hand,
// the trace analysis keys, and the web folder's missing files named with their install command. Not the page in
// a browser (check_report_page.py does that).
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "moetron/check.h"
#include "report/run_report.h"

namespace fs = std::filesystem;
using moetron::report::json;
namespace rep = moetron::report;

namespace {

// A fresh directory per test, removed at the end.
struct TempDir {
  fs::path p;
  TempDir() {
    const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
    p = fs::temp_directory_path() / (std::string("moetron_report_") + t->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(p);
    fs::create_directories(p);
  }
  ~TempDir() { fs::remove_all(p); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(p / name) << text;
    return (p / name).string();
  }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const moetron::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string rec(int step, double loss, const std::string& more = "") {
  return "{\"step\": " + std::to_string(step) + ", \"loss\": " + std::to_string(loss) + more + "}\n";
}

}  // namespace

TEST(ReportMetrics, MissingFileIsNamed) {
  TempDir d;
  const std::string path = (d.p / "metrics.jsonl").string();
  const std::string e = error_of([&] { rep::read_metrics(path); });
  EXPECT_NE(e.find(path + ": no such file"), std::string::npos) << e;
  const std::string e2 = error_of([&] { rep::load_run(d.p.string()); });
  EXPECT_NE(e2.find("metrics.jsonl: no such file"), std::string::npos) << e2;
}

TEST(ReportMetrics, CorruptLineIsNamedWithItsNumber) {
  TempDir d;
  const std::string path = d.write("metrics.jsonl", rec(1, 5.0) + "\n" + "{\"step\": 2, \"loss\": 4.\n" + rec(3, 4.0));
  const std::string e = error_of([&] { rep::read_metrics(path); });
  EXPECT_NE(e.find(path + ":3: not a JSON record"), std::string::npos) << e;
}

TEST(ReportMetrics, NumberBeyondDoubleIsNamedWithItsLine) {
  TempDir d;  // nlohmann reports this as out_of_range, not as a parse error
  const std::string path = d.write("metrics.jsonl", rec(1, 5.0) + "{\"step\": 2, \"loss\": 1e999}\n");
  const std::string e = error_of([&] { rep::read_metrics(path); });
  EXPECT_NE(e.find(path + ":2: not a JSON record"), std::string::npos) << e;
}

TEST(ReportMetrics, RecordWithoutLossOrWithTextStepIsNamed) {
  TempDir d;
  std::string path = d.write("a.jsonl", rec(1, 5.0) + "{\"step\": 2, \"lr\": 0.1}\n");
  std::string e = error_of([&] { rep::read_metrics(path); });
  EXPECT_NE(e.find(path + ":2: the record has no \"loss\""), std::string::npos) << e;
  path = d.write("b.jsonl", "{\"step\": \"one\", \"loss\": 1}\n");
  e = error_of([&] { rep::read_metrics(path); });
  EXPECT_NE(e.find(path + ":1: \"step\" is \"one\", not a number"), std::string::npos) << e;
  path = d.write("c.jsonl", "[1, 2]\n");
  e = error_of([&] { rep::read_metrics(path); });
  EXPECT_NE(e.find(path + ":1: a record is a JSON object"), std::string::npos) << e;
  path = d.write("d.jsonl", "\n\n");
  e = error_of([&] { rep::read_metrics(path); });
  EXPECT_NE(e.find(path + ": holds no records"), std::string::npos) << e;
}

TEST(ReportMetrics, ExpertCountsOfTheWrongShapeAreNamed) {
  TempDir d;
  const std::string ok = ", \"expert_counts\": {\"layers\": [1, 2], \"experts\": 4, \"bin\": 1, \"counts\": [[1,2,3,4],[4,3,2,1]]}";
  const std::string short_row = ", \"expert_counts\": {\"layers\": [1, 2], \"experts\": 4, \"bin\": 1, \"counts\": [[1,2,3,4],[4,3,2]]}";
  std::string path = d.write("a.jsonl", rec(1, 5.0, ok) + rec(2, 4.0, short_row));
  std::string e = error_of([&] { rep::read_metrics(path); });
  EXPECT_NE(e.find(path + ":2: expert_counts.counts[1] has 3 entries, expected 4"), std::string::npos) << e;
  const std::string other_layers = ", \"expert_counts\": {\"layers\": [1], \"experts\": 4, \"bin\": 1, \"counts\": [[1,2,3,4]]}";
  path = d.write("b.jsonl", rec(1, 5.0, ok) + rec(2, 4.0, other_layers));
  e = error_of([&] { rep::read_metrics(path); });
  EXPECT_NE(e.find(path + ":2: expert_counts changes shape"), std::string::npos) << e;
}

TEST(ReportMetrics, ResumedRunReplacesTheRecordsFromItsCheckpointOn) {
  TempDir d;
  // Steps 1..3 logged, then a resume from a step-1 checkpoint logs steps 2 and 3 again.
  const std::string path = d.write("m.jsonl", rec(1, 5.0) + rec(2, 4.0) + rec(3, 3.0) + rec(2, 4.5) + rec(3, 3.5));
  const json r = rep::read_metrics(path);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0]["step"], 1);
  EXPECT_EQ(r[1]["step"], 2);
  EXPECT_DOUBLE_EQ(r[1]["loss"].get<double>(), 4.5);
  EXPECT_DOUBLE_EQ(r[2]["loss"].get<double>(), 3.5);
}

TEST(ReportData, SeriesValidationAndMemory) {
  const json recs = json::parse(R"([
    {"step": 1, "loss": 5.0, "lr": 0.001, "mfu": 0.02, "mem_peak_bytes": 100,
     "mem_peak_by_category": {"params": 60, "activations": 40}},
    {"step": 2, "loss": 4.0, "val_loss": 4.2, "mfu": 0.03, "mem_peak_bytes": 300,
     "mem_peak_by_category": {"params": 60, "activations": 240}}])");
  const json d = rep::page_data(recs, "run", nullptr, nullptr);
  EXPECT_EQ(d["steps"], json::parse("[1, 2]"));
  EXPECT_EQ(d["lr"][0], 0.001);
  EXPECT_TRUE(d["lr"][1].is_null());  // absent in the second record: a gap, not a zero
  EXPECT_DOUBLE_EQ(d["mfu_pct"][1].get<double>(), 3.0);
  EXPECT_EQ(d["val"]["steps"], json::parse("[2]"));
  EXPECT_EQ(d["memory"]["step"], 2);  // the last record's peaks
  EXPECT_EQ(d["memory"]["by_category"]["activations"], 240);
  EXPECT_TRUE(d["experts"].is_null());
}

TEST(ReportData, ExpertSharesWorkedByHand) {
  // Layer 3: 8 tokens over 2 experts, 6 and 2: shares 6/4 = 1.5 and 2/4 = 0.5, imbalance 1.5.
  // Binned: 5 experts in bins of 2 (2, 2, 1 experts), counts 4, 2, 3 of 9 tokens (1.8 per expert): shares
  // 4/2/1.8 = 1.111, 2/2/1.8 = 0.556, 3/1/1.8 = 1.667, imbalance 1.667.
  const json a = json::parse(R"([{"step": 1, "loss": 1, "expert_counts": {"layers": [3], "experts": 2, "bin": 1,
                                 "counts": [[6, 2]]}}])");
  const json da = rep::page_data(a, "run", nullptr, nullptr)["experts"];
  EXPECT_EQ(da["layers"], json::parse("[3]"));
  EXPECT_EQ(da["share"][0][0], json::parse("[1.5, 0.5]"));
  EXPECT_EQ(da["imbalance"][0][0], 1.5);
  const json b = json::parse(R"([{"step": 1, "loss": 1, "expert_counts": {"layers": [1], "experts": 5, "bin": 2,
                                 "counts": [[4, 2, 3]]}}])");
  const json db = rep::page_data(b, "run", nullptr, nullptr)["experts"];
  EXPECT_EQ(db["share"][0][0], json::parse("[1.111, 0.556, 1.667]"));
  EXPECT_EQ(db["imbalance"][0][0], 1.667);
}

TEST(ReportData, DeadExpertsPerLayerAndStep) {
  // Two MoE layers (1 and 2) of 4 experts, two records: dead counts [1, 0] then [4, 2] come through per layer and
  // step; a record without "dead" (a run written before they were logged) gives null there.
  const json a = json::parse(R"([
    {"step": 5, "loss": 1, "expert_counts": {"layers": [1, 2], "experts": 4, "bin": 1, "counts": [[3, 3, 0, 2], [2, 2, 2, 2]],
     "dead": [1, 0], "dead_window_steps": 5}},
    {"step": 10, "loss": 1, "expert_counts": {"layers": [1, 2], "experts": 4, "bin": 1, "counts": [[0, 0, 0, 0], [4, 4, 0, 0]],
     "dead": [4, 2], "dead_window_steps": 5}},
    {"step": 15, "loss": 1, "expert_counts": {"layers": [1, 2], "experts": 4, "bin": 1, "counts": [[1, 1, 1, 1], [1, 1, 1, 1]]}}])");
  const json e = rep::page_data(a, "run", nullptr, nullptr)["experts"];
  EXPECT_EQ(e["dead"], json::parse("[[1, 4, null], [0, 2, null]]"));
  // No record with "dead": the series is null (the page draws no dead-expert chart).
  const json b = json::parse(R"([{"step": 1, "loss": 1, "expert_counts": {"layers": [3], "experts": 2, "bin": 1,
                                 "counts": [[6, 2]]}}])");
  EXPECT_TRUE(rep::page_data(b, "run", nullptr, nullptr)["experts"]["dead"].is_null());
}

TEST(ReportMetrics, DeadExpertsOfTheWrongShapeAreNamed) {
  const std::string dir = ::testing::TempDir() + "/report_dead_bad";
  std::filesystem::create_directories(dir);
  for (const char* dead : {"[1]", "[1, 5]", "[1, -1]"}) {  // one entry for two layers; more than 4 experts; negative
    std::ofstream(dir + "/metrics.jsonl")
        << R"({"step": 1, "loss": 1, "expert_counts": {"layers": [1, 2], "experts": 4, "bin": 1, )"
        << R"("counts": [[1, 1, 1, 1], [1, 1, 1, 1]], "dead": )" << dead << "}}\n";
    try {
      rep::read_metrics(dir + "/metrics.jsonl");
      ADD_FAILURE() << "dead = " << dead << " was accepted";
    } catch (const moetron::Error& err) {
      EXPECT_NE(std::string(err.what()).find("expert_counts.dead"), std::string::npos) << err.what();
    }
  }
}

TEST(ReportData, LongRunsDrawEveryKthStepInTheHeatmaps) {
  json recs = json::array();
  const int n = 450;  // > kMaxHeatmapSteps = 200: every 3rd record, 150 columns
  for (int s = 1; s <= n; ++s)
    recs.push_back({{"step", s}, {"loss", 1.0},
                    {"expert_counts", {{"layers", {1}}, {"experts", 2}, {"bin", 1}, {"counts", {{s, 1}}}}}});
  const json e = rep::page_data(recs, "run", nullptr, nullptr)["experts"];
  EXPECT_EQ(e["stride"], (n + rep::kMaxHeatmapSteps - 1) / rep::kMaxHeatmapSteps);
  EXPECT_EQ(e["steps"].size(), 150u);
  EXPECT_EQ(e["steps"][1], 4);
  EXPECT_EQ(e["imbalance"][0].size(), 150u);
}

TEST(ReportAnalysis, KeysCheckedAndTablesCut) {
  TempDir d;
  json a{{"ranks", {{{"rank", 0}, {"step_time_s", 1.0}, {"compute_s", 0.7}, {"exposed_comm_s", 0.2}, {"idle_s", 0.1}},
                    {{"rank", 1}, {"step_time_s", 1.0}, {"compute_s", 0.6}, {"exposed_comm_s", 0.3}}}},
         {"top_kernels", json::array()},
         {"collectives", json::array()},
         {"straggler_rank", 1}};
  std::string path = d.write("a.json", a.dump());
  std::string e = error_of([&] { rep::read_analysis(path); });
  EXPECT_NE(e.find(path + ": ranks[1].idle_s is missing or not a number"), std::string::npos) << e;
  a["ranks"][1]["idle_s"] = 0.1;
  for (int k = 0; k < 30; ++k) a["top_kernels"].push_back({{"name", std::string(1, 'k') + std::to_string(k)}, {"total_s", 1.0 / (k + 1)}});
  a.erase("collectives");
  path = d.write("b.json", a.dump());
  e = error_of([&] { rep::read_analysis(path); });
  EXPECT_NE(e.find(path + ": \"collectives\" is missing or not an array"), std::string::npos) << e;
  a["collectives"] = json::array();
  path = d.write("c.json", a.dump());
  const json r = rep::read_analysis(path);
  EXPECT_EQ(r["top_kernels"].size(), size_t(rep::kMaxTableRows));
  EXPECT_EQ(r["top_kernels_total"], 30);
  EXPECT_EQ(r["straggler_rank"], 1);
  EXPECT_EQ(r["ranks"][1]["exposed_comm_s"], 0.3);
}

TEST(ReportWeb, MissingLibraryNamesTheFileAndTheInstallCommand) {
  TempDir d;
  const std::string e = error_of([&] { rep::load_web_assets(d.p.string()); });
  EXPECT_NE(e.find("missing " + (d.p / "node_modules/chart.js/dist/chart.umd.min.js").string()), std::string::npos) << e;
  EXPECT_NE(e.find("npm ci --prefix " + d.p.string()), std::string::npos) << e;
}

TEST(ReportWeb, PageInlinesEverythingAndKeepsScriptsClosed) {
  rep::WebAssets a{"/*lib*/var Chart={};\n//# sourceMappingURL=chart.umd.min.js.map", "/*matrix*/", "/*page*/",
                   "body{}"};
  TempDir d;
  for (auto [rel, text] : {std::pair{"node_modules/chart.js/dist/chart.umd.min.js", a.chart_js},
                           {"node_modules/chartjs-chart-matrix/dist/chartjs-chart-matrix.min.js", a.matrix_js},
                           {"report.js", a.page_js},
                           {"report.css", a.page_css}}) {
    fs::create_directories((d.p / rel).parent_path());
    d.write(rel, text);
  }
  const rep::WebAssets got = rep::load_web_assets(d.p.string());
  EXPECT_EQ(got.chart_js.find("sourceMappingURL"), std::string::npos);
  // A config text that would close the data's <script> element early.
  const json data = rep::page_data(json::parse(R"([{"step": 1, "loss": 2}])"), "run", "name = \"</script><b>\"",
                                   nullptr);
  const std::string html = rep::render_html(data, got);
  size_t closes = 0;
  for (size_t at = 0; (at = html.find("</script>", at)) != std::string::npos; ++at) ++closes;
  EXPECT_EQ(closes, 4u);  // data, library, matrix chart, page: nothing else closes a script
  EXPECT_NE(html.find("<\\/script><b>"), std::string::npos);
  EXPECT_EQ(html.find("<script src"), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_NE(html.find("/*lib*/var Chart={};"), std::string::npos);
}
