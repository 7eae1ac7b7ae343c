// cmd_trace.cpp: `moetron trace merge DIR -o run.json`: a run's per-rank trace files as one Perfetto-loadable
// file (src/tracefile/merge.h). The other `trace` subcommands register in their own cmd_trace_*.cpp files.
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cli.h"
#include "moetron/check.h"
#include "trace_cmds.h"
#include "tracefile/merge.h"

MT_REGISTER_COMMAND([](CLI::App& root) {
  CLI::App* t = moetron::cli::trace_command(root);
  auto* m = t->add_subcommand("merge", "Merge DIR/rank<r>.trace.json into one Perfetto trace with send -> recv flows");
  static std::string dir, out;
  m->add_option("dir", dir, "Trace folder of a run (moetron train --trace DIR)")->required();
  m->add_option("-o,--out", out, "Merged trace to write (e.g. run.json)")->required();
  m->callback([] {
    const moetron::tracefile::MergeResult r = moetron::tracefile::merge_trace_dir(dir);
    const std::filesystem::path p(out);
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
    std::ofstream f(out, std::ios::binary);
    MT_CHECK(f.good(), "trace merge", "cannot write ", out);
    f << r.trace.dump() << "\n";
    MT_CHECK(f.good(), "trace merge", "writing ", out, " failed");
    std::printf("merged %d ranks: %lld events, %lld send -> recv flows", r.ranks, (long long)r.events,
                (long long)r.flows);
    if (r.unmatched_sends || r.unmatched_recvs)
      std::printf(" (%lld sends and %lld receives without their other end in the files)",
                  (long long)r.unmatched_sends, (long long)r.unmatched_recvs);
    std::printf("\nwrote %s (open it in Perfetto: one process per rank)\n", out.c_str());
  });
});
