// plan/validate.h: the planner held against measured engine runs (`moetron plan validate`, docs/planner.md): the
// small layouts it runs and their job overrides, a run's figures as plain data (MeasuredRun, reduced over ranks
// by the caller), the engine's trace scopes grouped like the projection's op groups, the projection of the same
// job under the engine's precision convention, and the comparison (errors, bounds, the report's rows, text and
// JSON). Not the runs: the engine trains the layouts (tools/cmd_plan_validate.cpp); nothing here links it.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "moetron/config.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"

namespace moetron::plan {

// One layout plan validate runs: its name, the smallest world it needs, its overrides (for a world of w ranks,
// "{w}" and "{w2}" (w / 2) are replaced).
struct ValidationCase {
  std::string name;
  int min_world = 1;
  std::vector<std::string> args;
};
// DP, ZeRO-1, FSDP, EP with each dispatcher, PP with two schedules, recompute, HSDP (4 ranks or more).
std::vector<ValidationCase> validation_cases();
// s with "{w2}" replaced by world / 2 and "{w}" by world.
std::string substitute_world(std::string s, int world);
// Whether `only` (comma-separated names or parts of names; empty: all) picks the case named `name`.
bool case_picked(const std::string& name, const std::string& only);
// The overrides of a case at a world: a small job (2 sequences of 128 tokens per micro-batch, 8 per step, which
// every layout divides) of `steps` steps in `compute` ("bf16" / "fp32"), its files under `dump`, then the case's.
std::vector<std::string> case_overrides(const ValidationCase& cs, int world, int64_t steps, const std::string& dump,
                                        const std::string& compute);

// projected / measured - 1 (0 when nothing was measured): positive when the projection is above the measurement.
double relative_error(double projected, double measured);

// The step time by op group, seconds per step: the compute groups of plan/cost.h (forward, backward) and the
// step-level parts. Trivially copyable (the caller gathers it over ranks).
enum StepPart : int { kRecompute = 0, kOptimizer, kRefresh, kEp, kDp, kFsdp, kOther, kNumStepParts };
const char* step_part_name(int part);
struct OpTimes {
  double f[kNumPlanOps] = {}, b[kNumPlanOps] = {};
  double part[kNumStepParts] = {};  // recompute: also inside the forward groups (the engine's scopes keep their names)
};
// The compute groups' sum (forward and backward).
double compute_seconds(const OpTimes& o);
// The rank that computes the most (the first such): the projection's groups are those of its slowest pipeline
// rank; a rank that computes less waits inside its communication, which a per-group maximum would count twice.
const OpTimes& busiest(const std::vector<OpTimes>& ranks);

// The engine's kernel scopes (trace::totals(): by name, none nested; summed over the profiled steps, all but the
// first of step_seconds) grouped like the projection. A recomputed layer's kernels keep their forward names, so
// under recompute the forward groups hold them and the recompute row is the model's own clock (recompute_s over
// all steps). What no scope covers and the scopes the projection does not split out are `other`: the mean
// profiled step less the scopes it groups.
OpTimes measured_ops(const std::vector<std::pair<std::string, double>>& scopes, const std::vector<double>& step_seconds,
                     double recompute_s);
// The projection's figures in the same groups: its recompute also spread over the forward groups in proportion
// to them (full recompute is the layer's forward again); under FSDP the weight refresh counts with the gathers.
OpTimes projected_ops(const TimePlan& t);

// A run's step time: the median over the steps after the first (which creates the kernels' primitives); the
// only step when there is one; 0 without steps.
double run_step_time(const std::vector<double>& step_seconds);
// The run with the median step time among a layout's runs (the upper middle one for an even count).
size_t median_run(const std::vector<double>& run_step_s);

// One engine run of a layout, its figures already reduced over the ranks.
struct MeasuredRun {
  double params = 0, grads = 0, optimizer = 0, activations = 0;  // bytes: the largest rank's peak per category
  double step_s = 0;           // the run's step time (run_step_time), the slowest rank's
  double cpu_share = 1;        // the smallest share of its cores a rank received during the run
  double ep_rows_peak = 0;     // EP: the most rows one dispatch brought over tokens x topk (largest over ranks)
  double ep_rows_held = 0;     // EP: the rows the buffers hold over the balanced count (largest over ranks)
  OpTimes ops;                 // by op group, the busiest rank's
  std::vector<double> step_runs;  // every run's step time (this one is their median's)
};

// The bounds on |error|; 0 = report only. EP layouts' activations take their own bound.
struct ValidationBounds {
  double memory = 0, ep_activations = 0.10, step_time = 0;
};

// One compared figure.
struct FigureRow {
  std::string figure;  // params, grads, optimizer, activations, step_s
  double measured = 0, projected = 0, error = 0, bound = 0;
  bool over = false;   // |error| beyond a nonzero bound
};
// One op group's seconds per step, measured and projected (at the run's CPU share).
struct OpRow {
  std::string name;
  double measured_s = 0, projected_s = 0;
};

struct LayoutValidation {
  std::string name, planner_layout;
  bool ep = false;
  double ep_measured = 0, ep_held = 0, ep_projected_with = 1;  // routing imbalance (EP layouts)
  std::vector<FigureRow> figures;
  std::vector<OpRow> ops;
  double cpu_share = 1;
  double step_full_share = 0;    // the projected step at a full share of the cores
  double dense_gemm_speed = 1;   // the run's dense GEMMs' speed over the projection's (a diagnostic)
  std::vector<double> step_runs;
};

// The routing imbalance EP layouts are projected with: `option` "measured" (the engine's, at least 1) or a
// number >= 1; throws naming --ep-imbalance otherwise.
double ep_imbalance_for(const std::string& option, double measured);

// The projection of case `name` (config c, on `world` ranks; one when the job is a single process) on h under
// the engine's precision convention and the measured routing imbalance, compared with the run. The projection is
// for ranks that own their cores: it is compared at the run's CPU share (times scaled by 1 / share, the share
// taken in [0.05, 1]).
LayoutValidation validate_layout(const JobConfig& c, const std::string& name, int world, const Hardware& h,
                                 const MeasuredRun& run, const ValidationBounds& bounds,
                                 const std::string& ep_imbalance = "measured");

// The report's lines for a layout: the header, the figure rows, with `ops` the op rows, then the CPU share, the
// dense GEMMs' speed, the runs' step times (several runs) and the EP rows (EP layouts).
std::string validation_header();
std::string format_validation(const LayoutValidation& v, bool ops);
// "<layout> <figure> error <e>" for every figure beyond its bound.
std::vector<std::string> beyond_bounds(const LayoutValidation& v);
nlohmann::json to_json(const LayoutValidation& v);
// The whole report: the world, the hardware's TOML, the calibration's comments, the layouts.
nlohmann::json validation_json(int world, const Hardware& h, const std::string& calibration,
                               const std::vector<LayoutValidation>& layouts);

}  // namespace moetron::plan
