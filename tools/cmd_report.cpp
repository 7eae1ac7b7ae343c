// cmd_report.cpp: `moetron report RUN_DIR -o report.html`, the self-contained HTML page of one training run
// (src/report/: metrics, config, optional trace analysis; the plotting library from web/). Not the trainer's
// metrics (src/train/train_report.cpp).
#include <cstdio>
#include <fstream>
#include <string>

#include "cli.h"
#include "moetron/check.h"
#include "report/run_report.h"

namespace {
using namespace moetron;

struct ReportArgs {
  std::string run_dir;
  std::string out = "report.html";
  std::string analysis;
  std::string web;
};

void run(const ReportArgs& a) {
  const report::json data = report::load_run(a.run_dir, a.analysis);
  const std::string web = a.web.empty() ? report::default_web_dir() : a.web;
  const std::string html = report::render_html(data, report::load_web_assets(web));
  std::ofstream f(a.out, std::ios::binary);
  f << html;
  f.close();
  MT_CHECK(f.good(), "report", "cannot write ", a.out);
  const auto& e = data["experts"];
  std::printf("report: %s: %zu log records (steps %lld..%lld)%s, expert load %s, config %s, trace analysis %s\n",
              a.run_dir.c_str(), data["records"].get<size_t>(), data["steps"].front().get<long long>(),
              data["steps"].back().get<long long>(), data["val"]["steps"].empty() ? "" : ", validation loss",
              e.is_null() ? "none" : (std::to_string(e["layers"].size()) + " MoE layers").c_str(),
              data["config"].is_null() ? "none" : "config.toml",
              data["sources"]["analysis"].is_null() ? "none" : data["sources"]["analysis"].get<std::string>().c_str());
  std::printf("wrote %s (%.0f KiB)\n", a.out.c_str(), double(html.size()) / 1024.0);
}

}  // namespace

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* c = root.add_subcommand(
      "report", "HTML page of a training run: loss, learning rate, grad norm, throughput, MFU, memory, expert load, "
                "the config and (when present) the trace analysis. Self-contained: opens without network");
  auto a = std::make_shared<ReportArgs>();
  c->add_option("run_dir", a->run_dir, "the run's dump folder ([job] dump_folder): metrics.jsonl, config.toml")
      ->required();
  c->add_option("-o,--out", a->out, "the HTML file to write")->capture_default_str();
  c->add_option("--analysis", a->analysis,
                "a `moetron trace analyze DIR --json` output (default: RUN_DIR/analysis.json when present)");
  c->add_option("--web", a->web,
                "the web folder with the npm-installed plotting library (default: $MOETRON_WEB_DIR, else the source "
                "tree's web/)");
  c->callback([a] { run(*a); });
});
