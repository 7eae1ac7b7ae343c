// pipeline_record.h: measured pipeline steps as data. A record holds the lowered schedule a run executed and,
// for each recorded step, every rank's executed actions with their start and end (seconds, one origin per step:
// the earliest rank's step start). The trainer writes one (pipeline_record.json in the run folder) for its
// profiled steps; `moetron viz pipeline --run DIR` draws a step of it and `moetron schedule compare --run DIR`
// sets the measured bubble per rank beside the timed simulator's, fed the durations measured in the same
// record. Part of the moetron_schedule library (no engine dependency). Not the runtime that measures
// (src/comm/pipeline_runtime.h) and not the picture (src/viz/).
//
// File format (JSON object; every key required):
//   "format": "moetron.pipeline_record", "version": 1,
//   "schedule": generator name or "csv", "lowered_csv": the lowered schedule in the CSV form of schedule.h,
//   "unit": "s",
//   "steps": [ { "step": optimizer step, "ranks": [ { "rank": r, "ops": [[index, start, end], ...] }, ... ] } ]
// An op's index is its position in rank r's lowered list (so the action is known from the schedule), start
// and end are seconds from the step's origin. Every rank 0..pp-1 appears once per step, ops in list order.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moetron/schedule.h"

namespace moetron::sched {

struct RecordedStep {
  int64_t step = 0;
  std::vector<TimedOp> ops;  // every rank's executed actions (rank, index, action, start, end)
};

struct PipelineRecord {
  std::string schedule_name;  // generator name or "csv"
  Schedule lowered;
  std::vector<RecordedStep> steps;
};

std::string record_to_json(const PipelineRecord& r);
// `source` names the text in errors (a path). Errors name the field and the value.
PipelineRecord record_from_json(const std::string& text, const std::string& source = "<record>");
void write_record(const PipelineRecord& r, const std::string& path);
PipelineRecord read_record(const std::string& path);

// One recorded step as a timed result: step_time (the latest end), per-rank busy time (sum of compute
// actions) and bubble (1 - busy / step_time, simulate_timed's definition), and the ops.
TimedResult measured_result(const PipelineRecord& r, size_t step_index);

// Mean measured duration per stage of F, B (as i with w = 0), I and W over every recorded step; FB actions
// count for their stage's F and backward through the stage's own F / B means when it has them, else split
// evenly. P2P = 0: on one host a message is a memory copy (microseconds against milliseconds of compute);
// RECV durations are waiting, not transfer, and are not used.
Durations measured_durations(const PipelineRecord& r);

struct BubbleComparison {
  std::vector<double> measured, simulated;  // per rank, averaged over the recorded steps (measured)
  double measured_total = 0, simulated_total = 0;  // 1 - sum(busy) / (pp * step_time)
  Durations durations;  // what the simulator was fed
};
BubbleComparison compare_bubbles(const PipelineRecord& r);

}  // namespace moetron::sched
