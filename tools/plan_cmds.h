// plan_cmds.h: the `moetron plan` subcommands that need the engine (calibrate measures this machine's kernels
// and MPI; validate runs the engine), added to the `plan` command by tools/cmd_plan.cpp.
#pragma once
#include <CLI/CLI.hpp>

#include <string>

#include "moetron/calib_measure.h"
#include "moetron/comm.h"
#include "moetron/plan/hardware.h"

namespace moetron::cli {
// Figures reduced over ranks and the CPU share of a measured run (the engine's side: calib_measure.h).
using calib::CpuShare;
using calib::max_over_ranks;
using calib::min_over_ranks;

void add_plan_calibrate(CLI::App* plan);
void add_plan_validate(CLI::App* plan);
// This machine measured as planner hardware (every rank of `w` at once), `rounds` passes over every figure with
// the median kept; check_out receives a comment header with the measurement's provenance and the collectives
// timed against the model.
plan::Hardware calibrate_machine(const Comm& w, bool quick, std::string* check_out, int rounds);
}  // namespace moetron::cli
