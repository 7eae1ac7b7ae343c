// recorder.h (internal to src/trace): the recorder's event store and session state, shared by trace.cpp (the
// scopes and totals), trace_comm.cpp (communication events from the Comm sink) and trace_write.cpp (the file).
// Not a public header.
#pragma once
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

namespace moetron::trace::detail {

enum class Cat : uint8_t { Kernel, Module, Action, Step, Comm, Wait, Memory };

// One event; the fields each kind uses are noted (a = ints, d = doubles, side = a run of doubles in Store::side).
struct Event {
  double t0 = 0, t1 = 0;  // microseconds, steady clock (absolute)
  const char* name = "";  // a literal, or the module kind
  Cat cat = Cat::Kernel;
  uint8_t tid = 0;
  bool flag = false;  // comm: non-blocking; comm collective with per-peer receive counts
  int32_t a[5] = {-1, -1, -1, -1, -1};
  //   module: a0 layer | action: a0 mb, a1 chunk, a2 stage, a3 mb2, a4 stage2 (name2 = op2)
  //   step: d0 step | comm: a0 group, a1 peer (global rank), a2 tag, a3 comm size; d0 seq, d1 bytes in, d2 bytes
  //   out, d3 msg | wait: a0 group, a1 requests | kernel: d0 flops, d1 bytes | memory: side (5 values)
  double d[4] = {0, 0, 0, 0};
  const char* name2 = nullptr;
  int64_t side = -1;  // comm: send counts [a3] (then receive counts [a3] when flag); memory: 5 values
};

// A communicator seen in the trace, named `<name>@<first member's rank>`.
struct Group {
  std::string id, name;
  std::vector<int> ranks;  // global ranks (the trainer's world) in the communicator's order
};

struct Store {
  std::mutex mu;
  std::vector<Event> events;
  std::vector<double> side;
  int64_t max_events = 200000;
  int64_t dropped = 0;
  // session
  bool session = false;
  int rank = 0, world = 1;
  double t_sync_us = 0;                      // ts 0 (the end of the start barrier)
  std::unordered_map<int, int> world_index;  // MPI_COMM_WORLD rank -> rank in the trainer's world
  nlohmann::json meta = nlohmann::json::object();
  std::vector<Group> groups;
  std::unordered_map<const void*, int> group_of;  // CommInfo* -> index in groups
  int64_t first_step = -1, last_step = -1;
  bool tid_used[8] = {true, false, false, false, false, false, false, false};
  // Appends e (under mu) unless the cap is reached; returns the stored event or nullptr.
  Event* push(const Event& e);
};
Store& store();
extern thread_local int t_track;  // the calling thread's track (set_thread_track)

}  // namespace moetron::trace::detail
