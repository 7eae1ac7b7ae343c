// plan_cmds.h: the `moetron plan` subcommands that need the engine (calibrate measures this machine's kernels
// and MPI; validate runs the engine), added to the `plan` command by tools/cmd_plan.cpp.
#pragma once
#include <CLI/CLI.hpp>
#include <algorithm>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/plan/hardware.h"

namespace moetron::cli {
// The largest of every rank's x (a collective over w).
inline double max_over_ranks(const Comm& w, double x) {
  std::vector<double> all(static_cast<size_t>(w.size()));
  w.all_gather(all.data(), &x, sizeof(double));
  return *std::max_element(all.begin(), all.end());
}

void add_plan_calibrate(CLI::App* plan);
void add_plan_validate(CLI::App* plan);
// This machine measured as planner hardware (every rank of `w` at once); check_out receives a comment header
// with the measurement's provenance and the collectives timed against the model.
plan::Hardware calibrate_machine(const Comm& w, bool quick, std::string* check_out);
}  // namespace moetron::cli
