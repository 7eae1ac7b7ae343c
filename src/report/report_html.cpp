// report_html.cpp: the run report's page: the web folder's files (the npm-installed plotting library, the
// page's script and style) read and inlined with the run's data into one HTML file that loads nothing at view
// time. Not the data (run_data.cpp) and not the drawing, which web/report.js does in the browser.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moetron/check.h"
#include "moetron/html_text.h"
#include "report/run_report.h"

namespace fs = std::filesystem;

namespace moetron::report {
namespace {

// A file of the web folder; a missing one is named with the command that installs it.
std::string web_file(const fs::path& web, const std::string& rel, bool from_npm) {
  const fs::path p = web / rel;
  std::ifstream f(p, std::ios::binary);
  if (!f.good()) {
    if (from_npm)
      MT_FAIL("report", "missing ", p.string(), ": the plotting library is installed by npm from ",
              (web / "package-lock.json").string(), "; run `npm ci --prefix ", web.string(),
              "` (scripts/setup.sh does it), or point $MOETRON_WEB_DIR / --web at a web folder that has it");
    MT_FAIL("report", "missing ", p.string(), " (part of the source tree's web/ folder; set $MOETRON_WEB_DIR or --web to ",
            "the web folder of a moetron checkout)");
  }
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// The library files end with a source-map comment naming a file the page does not carry: dropped.
std::string without_source_map(std::string js) {
  const size_t at = js.rfind("//# sourceMappingURL=");
  if (at != std::string::npos) js.erase(at);
  return js;
}

// Text placed inside a <script> element must not close it.
std::string script_safe(std::string s) {
  for (size_t at = 0; (at = s.find("</", at)) != std::string::npos; at += 3) s.replace(at, 2, "<\\/");
  return s;
}


}  // namespace

std::string default_web_dir() {
  if (const char* e = std::getenv("MOETRON_WEB_DIR"); e && *e) return e;
#ifdef MOETRON_WEB_DIR
  return MOETRON_WEB_DIR;
#else
  return "web";
#endif
}

WebAssets load_web_assets(const std::string& web_dir) {
  const fs::path web(web_dir);
  WebAssets a;
  a.chart_js = without_source_map(web_file(web, "node_modules/chart.js/dist/chart.umd.min.js", true));
  a.matrix_js = without_source_map(web_file(web, "node_modules/chartjs-chart-matrix/dist/chartjs-chart-matrix.min.js", true));
  a.page_js = web_file(web, "report.js", false);
  a.page_css = web_file(web, "report.css", false);
  return a;
}

std::string render_html(const json& data, const WebAssets& a) {
  std::string h;
  h.reserve(a.chart_js.size() + a.matrix_js.size() + a.page_js.size() + 65536);
  h += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  h += "<title>moetron run report: " + html_escape(data.value("title", std::string("run"))) + "</title>\n";
  h += "<style>\n" + a.page_css + "\n</style>\n</head>\n<body>\n";
  h += "<main id=\"report\"></main>\n";
  // The run's data, then the library (Chart.js, then its matrix chart, which registers itself), then the page.
  h += "<script id=\"run-data\" type=\"application/json\">" + script_safe(data.dump()) + "</script>\n";
  h += "<script>\n" + script_safe(a.chart_js) + "\n</script>\n";
  h += "<script>\n" + script_safe(a.matrix_js) + "\n</script>\n";
  h += "<script>\n" + script_safe(a.page_js) + "\n</script>\n";
  h += "</body>\n</html>\n";
  return h;
}

}  // namespace moetron::report
