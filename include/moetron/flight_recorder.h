// flight_recorder.h: what each rank remembers of its recent communication, and the hang watchdog
// (docs/reliability.md, "Watchdog"). The recorder is a ring buffer of the last N calls this process made on
// any communicator, fed by the Comm layer's flight sink (comm.h: set_comm_flight_sink), so a collective's
// sequence number is the one traces use. Each entry: group id (`<name>@<first world rank>`), per-group
// sequence number (collectives; -1 for point-to-point), kind, bytes, peer / tag / message index
// (point-to-point), state (scheduled, started, completed) and times.
//
// bytes: for reductions and gathers the size of the result (the same on every member of a correct call);
// for all_to_all_v / exchange / send what this rank sends, for recv what it receives.
//
// The watchdog is a thread: when a started call has been running longer than the timeout, it writes this
// rank's buffer to <folder>/rank<r>.json, says so on stderr and ends the process (exit code 3), which makes
// mpirun end the job. A rank that is not stuck in a call (e.g. sleeping, or computing) writes its dump too when
// it sees another rank's dump appear in the folder, so `moetron trace flight` can tell who did not join.
// The analysis of the dumps is src/tracefile/flight.cpp. Not a profiler (trace.h) and not a debugger.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moetron/comm.h"

namespace moetron {

struct FlightEntry {
  std::string group;  // comm_group_id
  std::vector<int> members;  // world ranks of the group (kept once per group in dumps)
  int64_t seq = -1;
  CommOp op = CommOp::AllReduce;
  int64_t bytes = 0;
  int peer = -1, tag = -1;
  int64_t msg = -1;
  CommEvent::State state = CommEvent::State::Started;
  double t_scheduled = 0, t_started = 0, t_completed = 0;  // steady clock seconds; 0 = not (yet)
};

// Install (or remove) the process-wide recorder with `capacity` entries; collects from now on.
void flight_recorder_start(int64_t capacity = 2048);
void flight_recorder_stop();
// The recorder's entries, oldest first (empty when not started).
std::vector<FlightEntry> flight_recorder_entries();
// The dump as JSON text: {"rank", "world_size", "reason", "now", "entries": [...], "groups": {...}}.
std::string flight_recorder_json(int world_rank, int world_size, const std::string& reason);

// The watchdog thread; stops (joins) when destroyed. timeout_s <= 0: no thread.
class FlightWatchdog {
 public:
  FlightWatchdog(double timeout_s, std::string folder, int world_rank, int world_size);
  ~FlightWatchdog();
  FlightWatchdog(const FlightWatchdog&) = delete;
  FlightWatchdog& operator=(const FlightWatchdog&) = delete;

 private:
  struct Impl;
  Impl* impl_ = nullptr;
};

}  // namespace moetron
