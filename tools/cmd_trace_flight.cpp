// cmd_trace_flight.cpp: `moetron trace flight DIR`: the watchdog's flight-recorder dumps read together
// (src/tracefile/flight.h; docs/reliability.md, "Watchdog"): which rank did not join which collective, which
// ranks disagree on one. Exit code 0 whatever it finds; 1 on unreadable dumps. Not the recorder.
#include <cstdio>
#include <string>

#include "cli.h"
#include "trace_cmds.h"
#include "tracefile/flight.h"

MT_REGISTER_COMMAND([](CLI::App& root) {
  CLI::App* t = moetron::cli::trace_command(root);
  auto* f = t->add_subcommand("flight", "Read DIR/rank<r>.json flight-recorder dumps (written by the [comm] timeout_s "
                                        "watchdog): which rank did not join which collective, who disagrees");
  static std::string dir;
  f->add_option("dir", dir, "Dump folder (<dump_folder>/flight)")->required();
  f->callback([] { std::fputs(moetron::tracefile::analyze_flight_dir(dir).text().c_str(), stdout); });
});
