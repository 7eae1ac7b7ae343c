// tracefile/analyze.h: `moetron trace analyze`: what a run's per-rank traces say about where the step went.
// Per rank the step splits into compute, exposed communication and idle (the three add up to the step); the
// time is broken down step > action > module > kernel; every kernel gets a roofline verdict; collectives are
// matched across ranks by (group, seq) and split into transfer and wait; the rank the others wait for is named;
// EP all-to-all sizes are laid out rank by rank; the pipeline bubble is measured per PP rank the way pp_vis
// measures it. docs/profiling.md ("trace analyze") defines every figure and the JSON keys. Not the reader
// (reader.h) and not the diff of two analyses (diff.h).
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tracefile/reader.h"

namespace moetron::tracefile {

struct AnalyzeOptions {
  // Overrides the traces' moetron.limits (e.g. a planner hardware file). Without it the roofline uses the largest
  // FLOP/s and bytes/s over the ranks' limits (each rank measures at start-up, some while others share its cores).
  std::optional<Limits> limits;
};

// One rank, seconds per profiled step (the mean over the steps the rank's trace holds).
// step_time_s = compute_s + exposed_comm_s + idle_s exactly.
struct RankBreakdown {
  int rank = 0;
  int steps = 0;
  double step_time_s = 0;
  double compute_s = 0;       // union over tracks of kernel time, minus the track's own communication inside it
  double exposed_comm_s = 0;  // communication time not overlapped by compute on any track of the rank
  double idle_s = 0;          // the rest of the step
  double comm_s = 0;          // all communication time (union over tracks), overlapped or not
  double comm_wait_s = 0;     // of the rank's matched collectives: time spent waiting for the slowest member
  double wait_caused_s = 0;   // others' wait in collectives where this rank arrived last
  std::map<std::string, double> compute_by_kernel;     // partition of compute_s by innermost kernel name
  std::map<std::string, double> exposed_comm_by_kind;  // partition of exposed_comm_s by collective kind
  // The same time by the parallelism whose group ran it: the group's name up to its first '.' ("tp", "cp", "ep",
  // "dp", "edp", "pp", "dp_shard", ...; a dispatcher's "ep.2" is "ep"), "none" for an event without a group.
  std::map<std::string, double> exposed_comm_by_group;
  std::map<std::string, double> action_s;              // time inside actions per action name (F, B, I, W, FB)
  std::map<std::string, double> peak_memory_bytes;     // largest memory / memory_peak counter value per category
};

// One kernel name over every rank and profiled step. Time is self time: the kernel's duration minus the
// kernels and communication nested in it on its track.
struct KernelStat {
  std::string name;
  int64_t count = 0;
  double total_s = 0;           // summed over ranks and steps
  double per_rank_step_s = 0;   // total_s / (ranks * steps)
  double flops = 0, bytes = 0;  // summed
  double flops_per_s = 0, bytes_per_s = 0;  // achieved: flops / total_s, bytes / total_s
  double intensity = 0;         // flops / bytes (0 when bytes = 0)
  std::string bound;            // "compute", "memory" or "unknown" (no FLOPs or bytes recorded, or no limits)
  double limit_share = 0;       // achieved over the limit of its bound (FLOP/s or bytes/s)
};

// One node of a rank's time hierarchy, aggregated by path (names of the enclosing events), seconds per step.
struct HierNode {
  std::string path;  // "step/F/layer3.moe/moe.grouped_gemm"
  std::string name;
  Cat cat = Cat::Other;
  int depth = 0;     // step = 0
  int64_t count = 0;
  double total_s = 0, self_s = 0;
};

// Collectives of one kind in one group kind (group name) and size, matched across ranks.
struct CollectiveStat {
  std::string kind, group_name;
  int group_size = 0;
  int64_t count = 0;            // matched instances
  double bytes = 0;             // sum over instances of the collective's size (docs: which bytes per kind)
  double time_s = 0;            // sum of every member's duration
  double transfer_s = 0;        // sum over instances of the shortest member duration
  double wait_s = 0;            // time_s - members * transfer: waiting for the slowest member
  double algbw = 0;             // bytes / transfer_s (bytes/s)
  double busbw_factor = 0;      // all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all, exchange (n-1)/n
  double busbw = 0;             // algbw * busbw_factor
};

// All-to-all (and exchange) traffic of one group: bytes sent from member i to member j summed over instances.
struct AllToAllStat {
  std::string group;            // group id
  std::string group_name;
  std::vector<int> ranks;       // members (global ranks) in group order
  int64_t count = 0;
  std::vector<std::vector<double>> matrix;  // [sender][receiver] bytes
  std::vector<double> sent, received;       // per member, summed
  double imbalance = 0;         // max over members of sent / mean sent (1 = balanced)
  double imbalance_mean = 0, imbalance_max = 0;  // per instance max/mean, averaged and worst
};

// The pipeline of one PP group, pp_vis's measure (a measured pipeline record's, pipeline_record.h): per step the
// span runs from the first to the last moment any of the group's ranks runs a schedule op (an action, a send or
// a receive); a rank's busy time is the union of its actions; bubble = 1 - busy / span, averaged over steps.
struct PipelineRank {
  int rank = 0, pp_index = 0;
  double busy_s = 0, span_s = 0, bubble = 0;
};
struct PipelineGroup {
  std::string group;  // group id ("" for a rank without a pp group)
  std::vector<PipelineRank> ranks;
  double bubble = 0;  // 1 - sum busy / (pp * span), averaged over steps
};

struct Analysis {
  std::string dir, source;
  int world = 0;
  int steps = 0;  // profiled steps found on rank 0
  Limits limits;
  std::vector<RankBreakdown> ranks;
  std::vector<KernelStat> kernels;                 // every kernel, by total_s descending
  std::vector<std::vector<HierNode>> hierarchy;    // [rank], depth-first, children by total_s descending
  std::vector<CollectiveStat> collectives;         // by time_s descending
  int straggler_rank = -1;                         // the rank whose lateness the others waited for most (-1: none)
  int64_t matched_collectives = 0, unmatched_collectives = 0;
  std::vector<AllToAllStat> all_to_all;
  std::vector<PipelineGroup> pipeline;
  int64_t dropped_events = 0;                      // summed over ranks (moetron.dropped_events)
  std::vector<std::string> warnings;
};

Analysis analyze(const Trace& t, const AnalyzeOptions& o = {});

// Machine-readable form (docs/profiling.md lists the keys); `top` limits top_kernels (0 = all).
nlohmann::json to_json(const Analysis& a, int top = 20);
// The human-readable report: breakdown, top kernels with roofline, collectives, straggler, all-to-all,
// pipeline, and the hierarchy of rank `hier_rank` (children per node capped at `top`).
std::string format_text(const Analysis& a, int top = 15, int hier_rank = 0);
// DIR/{ranks,kernels,collectives,hierarchy,pipeline}.csv and DIR/all_to_all_<group>.csv (DIR is created).
void write_csv(const Analysis& a, const std::string& dir);
// One self-contained HTML page (no scripts, no network): the tables above with breakdown bars.
std::string render_html(const Analysis& a, int top = 30);

// The bus-bandwidth factor of a collective kind over n members (0 for barriers and unknown kinds).
double busbw_factor(const std::string& kind, int n);

}  // namespace moetron::tracefile
