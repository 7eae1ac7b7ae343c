// cmd_plan_calibrate.cpp: `moetron plan calibrate [--out FILE] [--quick] [--rounds N]`: measures this machine into a
// planner hardware TOML (docs/hardware.md). The flags, the rounds measured by the engine (calib_measure.h: its own
// kernels and Comm, every rank at once; under mpirun also the MPI alpha-beta) and the file written. The figures
// are fitted by the planner (plan/calibrate.h); nothing here computes one.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cli.h"
#include "moetron/calib_measure.h"
#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/plan/calibrate.h"
#include "moetron/plan/hardware.h"
#include "plan_cmds.h"

namespace moetron::cli {

plan::Hardware calibrate_machine(const Comm& w, bool quick, std::string* check_out, int rounds) {
  MT_CHECK(rounds >= 1 && rounds <= 50, "plan calibrate", "--rounds = ", rounds, " must lie in 1..50");
  std::vector<calib::Round> r;
  for (int i = 0; i < rounds; ++i) r.push_back(calib::measure_round(w, quick));
  return plan::calibrated_hardware(r, check_out);
}

void add_plan_calibrate(CLI::App* plan) {
  auto* cal = plan->add_subcommand("calibrate", "Measure this machine into a planner hardware TOML (run under mpirun "
                                                "for the MPI alpha-beta)");
  auto out = std::make_shared<std::string>();
  auto quick = std::make_shared<bool>(false);
  auto rounds = std::make_shared<int>(3);
  cal->add_option("--out", *out, "write the TOML here (default: print it)");
  cal->add_flag("--quick", *quick, "fewer repetitions and sizes (for tests)");
  cal->add_option("--rounds", *rounds,
                  "measure every figure this many times, interleaved, and keep the median (default 3; 1..50): a shared "
                  "host's speed moves within seconds")
      ->check(CLI::Range(1, 50));
  cal->callback([out, quick, rounds] {
    const Comm w = comm_world();
    std::string header;
    const plan::Hardware h = calibrate_machine(w, *quick, &header, *rounds);
    if (w.rank() != 0) return;
    const std::string toml = header + plan::hardware_to_toml(h);
    if (out->empty()) {
      std::printf("%s", toml.c_str());
    } else {
      std::ofstream f(*out);
      MT_CHECK(f.good(), "plan calibrate", "cannot write ", *out);
      f << toml;
      std::printf("wrote %s\n%s", out->c_str(), header.c_str());
    }
  });
}
}  // namespace moetron::cli
