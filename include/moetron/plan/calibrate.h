// plan/calibrate.h: a machine's measured figures (calib::Round, calib_round.h) turned into planner hardware: the
// efficiency curves against the achievable GEMM rate, the memory-bound, optimizer and copy rates, the alpha-beta
// of messages fitted to the measured all-reduce, the rounds combined by their medians, and the comment header of
// the TOML `moetron plan calibrate` writes (docs/hardware.md, docs/planner.md). Not the measuring: the engine's
// side times its kernels and Comm (calib_measure.h); nothing here runs a kernel.
#pragma once
#include <string>
#include <vector>

#include "moetron/calib_round.h"
#include "moetron/plan/hardware.h"

namespace moetron::plan {

// The median of v (the mean of the middle two for an even count); v must not be empty.
double median(std::vector<double> v);

// One round as hardware. Every curve point is first a fraction of the round's first reference rate, then
// re-based on the achievable rate written: the best of the reference's median (the upper middle sample) and the
// dense curve's points, each point clamped to [0.001, 1]. `comments` (may be null) receives the round's
// provenance and measurement lines ("# ..."), the collectives timed against the fitted model last. Throws like
// validate_hardware when a figure is out of range.
Hardware hardware_from_round(const calib::Round& r, std::string* comments = nullptr);

// The rounds' figures combined: each the median over rounds. The curves (fractions of each round's achievable
// rate) are combined as absolute rates, then taken again as fractions of the combined achievable rate: the
// median of the rounds' achievable rates, raised to the fastest combined dense-GEMM point; points are clamped to
// [0.001, 1]. The rest (names, sources, domains) is the last round's.
Hardware combine_rounds(const std::vector<Hardware>& rounds);

// Rounds (1..50 of them) to the hardware `plan calibrate` writes, checked by validate_hardware. `header` (may be
// null) receives the comment lines above the TOML: the rounds' achievable rates and the one written, then the
// last round's comments.
Hardware calibrated_hardware(const std::vector<calib::Round>& rounds, std::string* header = nullptr);

}  // namespace moetron::plan
