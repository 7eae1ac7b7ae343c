// tracefile/reader.h: moetron's per-rank profiler traces (docs/profiling.md, "Trace format (version 1)") as
// data: the typed event model, the checked reader of one rank's file and of a run's directory, and the writer
// of the same format (the planner's simulated step and the tests' hand-built traces use it). Library
// moetron_tracefile: links nlohmann_json only, never the engine. Not the engine's recorder (src/trace/), not
// the analysis (analyze.h) and not the merge into one Perfetto file (merge.h).
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moetron::tracefile {

// What an event is, from its `cat`. Unknown categories are kept as Other (the analysis ignores them).
enum class Cat : uint8_t { Step, Action, Module, Kernel, Comm, Other };
const char* cat_name(Cat c);  // "step", "action", "module", "kernel", "comm", "other"

// One complete ("X") event. Times are microseconds on the rank's aligned clock. Arguments that an event does
// not carry keep their defaults (-1 for ids, 0 for sizes, empty for strings and lists).
struct Event {
  Cat cat = Cat::Other;
  std::string cat_text;  // the `cat` as written (for Other)
  std::string name;
  int tid = 0;
  double ts = 0, dur = 0;
  double end() const { return ts + dur; }
  // step / action / module
  int64_t step = -1, mb = -1, chunk = -1, stage = -1, layer = -1;
  // kernel
  double flops = 0, bytes = 0;
  std::string shape;
  // comm
  std::string group;  // group id (a key of Meta::groups)
  int64_t seq = -1;
  double bytes_in = 0, bytes_out = 0;
  int peer = -1;
  int64_t tag = -1;
  std::vector<double> send_bytes, recv_bytes;  // all-to-all: per member of the group, in group order
};

// A memory counter ("C" event named "memory" or "memory_peak"): bytes per category at time ts.
struct Counter {
  std::string name = "memory";
  double ts = 0;
  std::map<std::string, double> values;
};

struct Limits {
  double flops_per_s = 0, bytes_per_s = 0;
  std::string dtype, source;
  bool known() const { return flops_per_s > 0 && bytes_per_s > 0; }
};

struct Group {
  std::string id, name;     // id: the key in the metadata; name: "dp", "ep", "pp", "edp", "world", ...
  std::vector<int> ranks;   // global ranks in group order
};

// The `moetron` metadata object.
struct Meta {
  int rank = 0, world = 1;
  std::string source;  // "engine" or "planner"
  std::string config;  // resolved config, TOML text
  nlohmann::json layout = nlohmann::json::object();
  Limits limits;
  int64_t first_step = -1, last_step = -1;
  std::map<std::string, Group> groups;
  double clock_offset_us = 0;
  int64_t dropped_events = 0;
};

struct RankTrace {
  Meta meta;
  std::vector<Event> events;            // X events in file order
  std::vector<Counter> memory;          // C events
  std::map<int, std::string> track_names;  // tid -> thread_name
  std::string process_name;
  std::string path;                     // where it was read from ("" when built in memory)
};

struct Trace {
  std::string dir;
  std::vector<RankTrace> ranks;  // ranks[r].meta.rank == r
  int world() const { return int(ranks.size()); }
};

// Parses one rank's file. `source` names the text in errors. Every refusal throws moetron::Error naming the
// source, the event index and the field, e.g. "DIR/rank1.trace.json: traceEvents[12] (comm 'all_reduce'):
// args.seq missing".
RankTrace parse_rank(const std::string& text, const std::string& source = "<trace>");
RankTrace read_rank_file(const std::string& path);
// Reads DIR/rank<r>.trace.json for r = 0 .. world-1 (world from rank 0's metadata). Refuses a missing rank,
// a file whose rank or world disagrees with its name, and a directory without traces.
Trace read_dir(const std::string& dir);
// The name of rank r's file: "rank<r>.trace.json".
std::string rank_file_name(int rank);

// The format as JSON (metadata, process and thread names, X and C events) and written as DIR/rank<r>.trace.json
// (DIR is created). Reading the written file gives the same RankTrace back.
nlohmann::json to_json(const RankTrace& t);
void write_rank_file(const RankTrace& t, const std::string& dir);

}  // namespace moetron::tracefile
