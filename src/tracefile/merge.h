// merge.h: `moetron trace merge`: a run's per-rank trace files (docs/profiling.md, "Trace format (version 1)")
// as one Chrome trace JSON that Perfetto loads: every rank's events as its own process (pid = rank, with the
// rank's named tracks), and a flow arrow from each point-to-point send to its receive. Part of the
// moetron_tracefile library, which links nlohmann_json only (no engine). Not the analysis (analyze / diff).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moetron::tracefile {

// The rank files of a trace folder, rank<r>.trace.json, in rank order. Throws naming the folder when it has none.
std::vector<std::string> rank_trace_files(const std::string& dir);

// One rank file, parsed and checked: the object form with traceEvents and a `moetron` metadata object of format
// "moetron-trace", version 1. Errors name the file and the field.
nlohmann::json read_rank_trace(const std::string& path);

struct MergeResult {
  nlohmann::json trace;  // {"traceEvents": [...], "displayTimeUnit": "ms", "moetron": {...merged metadata...}}
  int ranks = 0;
  int64_t events = 0;           // the ranks' events (metadata events included), without the flows
  int64_t flows = 0;            // send -> receive pairs drawn
  int64_t unmatched_sends = 0;  // sends whose receive is not in the files (e.g. outside the profiled steps)
  int64_t unmatched_recvs = 0;
};

// Merges parsed rank files (read_rank_trace); `names` label them in errors. The ranks must be distinct, agree on
// the world size, and be every rank of it.
//
// Flows. A send and a receive pair when they have the same group and tag, the sender and receiver agree (the
// send's pid and `peer`, the receive's `peer` and pid) and they are the same message: the k-th send from a to b
// with tag t on a group pairs with the k-th receive at b from a with tag t, k being the events' `msg` argument
// (both ends number their messages alike), or their order in time where `msg` is absent. Each pair becomes a
// flow start ("s") inside the send's slice and a flow end ("f", "bp": "e") inside the receive's, with one id.
MergeResult merge_traces(const std::vector<nlohmann::json>& ranks, const std::vector<std::string>& names);

// rank_trace_files + read_rank_trace + merge_traces.
MergeResult merge_trace_dir(const std::string& dir);

}  // namespace moetron::tracefile
