// plan/pipeline.h: what the planner asks of the schedule IR: the layers of each pipeline stage for a
// layout, and the peak activation sets each pipeline rank holds, taken from the schedule simulator (the same
// generators and timed simulator the engine's runs are compared with), not from a closed formula. Not a
// cost model.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "moetron/config.h"
#include "moetron/plan/layout.h"
#include "moetron/schedule.h"

namespace moetron::plan {

struct InflightPeaks;  // pipeline.cpp: the simulator's held-set peaks of a schedule
struct StagePlan {
  sched::PpLayout layout;    // layers per stage, stage -> rank
  sched::GenSpec spec;       // the generator's input for the planner's dp
  bool from_csv = false;
  sched::Schedule csv;
  // Read off `layout` once (the projections ask for them per candidate):
  std::vector<std::vector<int>> stage_layers;  // [n_stages] decoder layer ids
  std::vector<int> n_moe, n_dense;             // [n_stages] MoE / dense layer counts
  std::vector<int> rep_moe, rep_dense;         // [n_stages] the stage's first MoE / dense layer (-1: none)
  std::vector<char> first, last;               // [n_stages] holds the embedding / the head and loss
  std::vector<std::vector<int>> rank_stages;   // [pp] the rank's stages, ascending
  std::shared_ptr<const InflightPeaks> peaks;  // set by stage_plan (generated schedules); inflight() reads it
};
// Calls fn(layer, moe, recompute, count) for groups of a stage's layers that cost the same: per kind when the
// recompute choice is uniform (no layer_ids), else layer by layer.
template <class Fn>
void for_each_layer_group(const StagePlan& sp, const ModelSpec& s, const ActivationCheckpointSpec& ac, int st, Fn&& fn) {
  const size_t i = static_cast<size_t>(st);
  if (ac.layer_ids.empty()) {
    const bool on = ac.mode != AcMode::None;
    if (sp.n_dense[i] > 0) fn(sp.rep_dense[i], false, on, sp.n_dense[i]);
    if (sp.n_moe[i] > 0) fn(sp.rep_moe[i], true, on, sp.n_moe[i]);
    return;
  }
  for (int layer : sp.stage_layers[i]) fn(layer, s.is_moe_layer(layer), ac.applies_to(layer), 1);
}
// Cached by the pipeline keys (a search asks for the same shapes many times); shared, never copied.
std::shared_ptr<const StagePlan> stage_plan(const JobConfig& c, const Layout& l);

// Peak in-flight activation sets per pipeline rank: the timed simulator replays the schedule with F = 1,
// B = 2 (I = W = 1) and the rank's held (stage, micro-batch) sets are tracked in time order. A set is held
// from its F to its B (or W). With stage_bytes given, peak_bytes[r] is the largest sum of held sets' bytes.
// Micro-batch counts above 4 pp are simulated at 4 pp (a multiple of pp that every generator accepts): the
// warm-up of every schedule here ends within (vpp + 1) pp forwards, so the peak is reached by then
// (tests/plan/test_memory.cpp checks capped against uncapped). Results are cached by (schedule, pp, vpp,
// micro-batches, ep_overlap).
struct Inflight {
  std::vector<int> peak_sets;        // per rank
  std::vector<double> peak_bytes;    // per rank (0 when no stage_bytes)
  std::vector<int> stage_peak;       // per stage: the most sets it ever holds at once
  int64_t simulated_microbatches = 0;
};
Inflight inflight(const StagePlan& p, const std::vector<double>& stage_bytes = {});
// The capped micro-batch count inflight() simulates.
int64_t inflight_microbatches(const sched::GenSpec& g);

}  // namespace moetron::plan
