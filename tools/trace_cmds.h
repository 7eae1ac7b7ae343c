// trace_cmds.h: the `moetron trace` command, shared by the files that add its subcommands (merge, analyze,
// diff, ...). Each tools/cmd_trace*.cpp registers its own subcommands under the one `trace` command this
// returns, whatever order the registry runs them in. Not the trace format (docs/profiling.md).
#pragma once
#include <CLI/CLI.hpp>

namespace moetron::cli {
inline CLI::App* trace_command(CLI::App& root) {
  for (CLI::App* s : root.get_subcommands([](CLI::App*) { return true; }))
    if (s->get_name() == "trace") return s;
  auto* t = root.add_subcommand("trace", "Profiler traces: merge per-rank files, analyze, diff");
  t->require_subcommand(1);
  return t;
}
}  // namespace moetron::cli
