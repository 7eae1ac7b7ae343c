// tracefile/flight.h: `moetron trace flight DIR`: reads the flight-recorder dumps the watchdog wrote
// (DIR/rank<r>.json, include/moetron/flight_recorder.h) and says what went wrong between the ranks:
//   - who did not join: for a communicator, the lowest sequence number some members started and other members
//     never scheduled (their last call on it has a lower number), with the members that wrote no dump;
//   - who disagrees: two members recorded different kinds, or different sizes where the size must agree
//     (all_reduce, reduce_scatter, all_gather, barrier), for the same (group, sequence number);
//   - point-to-point: a receive still waiting whose message (same group, tag and message index) the sender
//     never posted, and the ranks that were inside no call at all (the likely culprits of a chain of waits).
// Only nlohmann_json: no engine. docs/reliability.md ("Watchdog"). Not the recorder itself.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace moetron::tracefile {

struct FlightMissing {
  std::string group, kind;
  int64_t seq = -1, bytes = 0;
  std::vector<int> started;  // ranks that started (or finished) it
  std::vector<int> absent;   // ranks with a dump that never scheduled it
  std::vector<int> no_dump;  // members that wrote no dump
  double t_started = 0;      // the earliest start among `started`
};

struct FlightMismatch {
  std::string group;
  int64_t seq = -1;
  // (rank, kind, bytes) of every member that recorded it
  struct Side {
    int rank;
    std::string kind;
    int64_t bytes;
  };
  std::vector<Side> sides;
};

// A receive that was waiting when the dumps were written, whose message the sender never posted.
struct FlightUnsent {
  std::string group;
  int receiver = -1, sender = -1;  // world ranks
  int tag = -1;
  int64_t msg = -1, bytes = 0;
  bool sender_dumped = true;  // false: the sender wrote no dump (so whether it posted is unknown)
};

struct FlightAnalysis {
  int world_size = 0;
  std::vector<int> ranks;            // ranks with a dump
  std::vector<std::string> reasons;  // per dump, in `ranks` order
  std::vector<FlightMissing> missing;    // one per group with a finding, earliest first
  std::vector<FlightMismatch> mismatches;
  std::vector<FlightUnsent> unsent;  // point-to-point: waits whose send was never posted
  std::vector<int> idle;             // ranks with a dump that were in no unfinished call (e.g. computing, delayed)
  std::string text() const;  // the report `moetron trace flight` prints
};

// dumps: the parsed rank<r>.json files (any order). Throws moetron-style std::runtime_error naming a
// malformed field.
FlightAnalysis analyze_flight(const std::vector<nlohmann::json>& dumps);
// Reads DIR/rank*.json; throws when there is none or one does not parse.
FlightAnalysis analyze_flight_dir(const std::string& dir);

}  // namespace moetron::tracefile
