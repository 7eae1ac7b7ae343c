// cmd_trace_analyze.cpp: `moetron trace analyze DIR` and `moetron trace diff A B`, the command line of the
// trace analysis (src/tracefile/analyze.h, diff.h; docs/profiling.md). Reads per-rank trace directories
// written by the engine or by `moetron plan time --trace`. Not the merge (cmd_trace_merge.cpp) and not the
// analysis itself.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "cli.h"
#include "moetron/check.h"
#include "moetron/plan/hardware.h"
#include "trace_cmds.h"
#include "tracefile/analyze.h"
#include "tracefile/diff.h"
#include "tracefile/reader.h"

namespace {
using namespace moetron;

struct AnalyzeArgs {
  std::string dir, csv, html, hw;
  bool json = false;
  int top = 15;
  int rank = 0;
};

struct DiffArgs {
  std::string a, b, hw;
  bool json = false;
  int top = 20;
};

// The roofline limits of a planner hardware entry (catalog name or TOML file): its achievable matmul rate
// (`plan calibrate` writes this machine's compute-dtype rate there) and its streaming bandwidth.
tracefile::Limits hardware_limits(const std::string& name) {
  const plan::Hardware h = plan::resolve_hardware(name);
  tracefile::Limits l;
  l.flops_per_s = h.achievable_bf16;
  l.bytes_per_s = h.stream_bw();
  l.dtype = "bf16";
  l.source = "hardware file " + h.name;
  if (!l.known())
    MT_FAIL("trace analyze", "--hw ", name, ": achievable_bf16 = ", h.achievable_bf16,
            " and the streaming bandwidth = ", h.stream_bw(), " must both be > 0 for a roofline");
  return l;
}

tracefile::Analysis run_analysis(const std::string& dir, const std::string& hw) {
  tracefile::AnalyzeOptions o;
  if (!hw.empty()) o.limits = hardware_limits(hw);
  return tracefile::analyze(tracefile::read_dir(dir), o);
}

}  // namespace

MT_REGISTER_COMMAND([](CLI::App& root) {
  CLI::App* trace = moetron::cli::trace_command(root);

  auto aa = std::make_shared<AnalyzeArgs>();
  auto* an = trace->add_subcommand(
      "analyze", "Per-rank breakdown (compute / exposed comm / idle), hierarchy, roofline, collectives, straggler, "
                 "EP all-to-all, pipeline bubble");
  an->add_option("dir", aa->dir, "directory of rank<r>.trace.json files (a profiled run or `plan time --trace`)")
      ->required();
  an->add_flag("--json", aa->json, "print one JSON object (docs/profiling.md lists the keys)");
  an->add_option("--csv", aa->csv, "also write the tables as CSV files into this directory");
  an->add_option("--html", aa->html, "also write a self-contained HTML page");
  an->add_option("--hw", aa->hw, "roofline limits from a planner hardware entry (catalog name or TOML file) "
                                 "instead of the trace's moetron.limits");
  an->add_option("--top", aa->top, "kernels and hierarchy children to show (default 15)");
  an->add_option("--rank", aa->rank, "rank whose hierarchy the text report prints (default 0)");
  an->callback([aa] {
    const tracefile::Analysis a = run_analysis(aa->dir, aa->hw);
    if (aa->rank < 0 || aa->rank >= a.world)
      MT_FAIL("trace analyze", "--rank ", aa->rank, " is not a rank of this trace (world ", a.world, ")");
    if (!aa->csv.empty()) tracefile::write_csv(a, aa->csv);
    if (!aa->html.empty()) {
      std::ofstream out(aa->html, std::ios::binary);
      if (!out.good()) MT_FAIL("trace analyze", "--html ", aa->html, ": cannot write");
      out << tracefile::render_html(a, std::max(aa->top, 30));
    }
    if (aa->json) std::printf("%s\n", tracefile::to_json(a, aa->top).dump(2).c_str());
    else std::printf("%s", tracefile::format_text(a, aa->top, aa->rank).c_str());
  });

  auto da = std::make_shared<DiffArgs>();
  auto* df = trace->add_subcommand(
      "diff", "Compare two trace directories (B against A): step-time change by category, per-op deltas, new and "
              "missing ops");
  df->add_option("a", da->a, "baseline trace directory")->required();
  df->add_option("b", da->b, "trace directory compared against it")->required();
  df->add_flag("--json", da->json, "print one JSON object");
  df->add_option("--top", da->top, "ops to list (default 20)");
  df->add_option("--hw", da->hw, "roofline limits for both sides (as for analyze)");
  df->callback([da] {
    const tracefile::TraceDiff d = tracefile::diff(run_analysis(da->a, da->hw), run_analysis(da->b, da->hw));
    if (da->json) std::printf("%s\n", tracefile::to_json(d).dump(2).c_str());
    else std::printf("%s", tracefile::format_text(d, da->top).c_str());
  });
});
