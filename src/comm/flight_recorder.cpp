// flight_recorder.cpp: the per-process ring buffer of recent communication calls, its JSON dump, and the
// watchdog thread (see flight_recorder.h). Not the analysis of the dumps (src/tracefile/flight.cpp).
#include "moetron/flight_recorder.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "moetron/check.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moetron {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

const char* state_name(CommEvent::State s) {
  switch (s) {
    case CommEvent::State::Scheduled: return "scheduled";
    case CommEvent::State::Started: return "started";
    case CommEvent::State::Completed: return "completed";
  }
  return "?";
}

struct Recorder {
  std::mutex mu;
  std::vector<FlightEntry> ring;
  int64_t head = 0, count = 0;  // next slot; entries held
  // Group id per communicator seen, with the name it was made from (a communicator may be renamed).
  std::map<const CommInfo*, std::pair<std::string, std::string>> ids;

  FlightEntry& at(int64_t k) { return ring[size_t((head - count + k + int64_t(ring.size())) % int64_t(ring.size()))]; }

  // The open entry (not completed) this event finishes: the newest with the same group and sequence number
  // (collectives) or the same peer, tag, message index and kind (point-to-point). Searched from the newest,
  // over a bounded window: calls finish in about the order they start.
  FlightEntry* find_open(const std::string& group, const CommEvent& e) {
    const int64_t window = std::min<int64_t>(count, 256);
    for (int64_t k = count - 1; k >= count - window; --k) {
      FlightEntry& f = at(k);
      if (f.state == CommEvent::State::Completed || f.group != group || f.op != e.op) continue;
      if (e.seq >= 0 ? f.seq == e.seq : (f.peer == e.peer && f.tag == e.tag && f.msg == e.msg)) return &f;
    }
    return nullptr;
  }

  void on_event(const CommEvent& e) {
    if (!e.comm) return;
    std::lock_guard<std::mutex> lk(mu);
    auto& [name, id] = ids[e.comm];
    if (id.empty() || name != e.comm->name) name = e.comm->name, id = comm_group_id(*e.comm);
    if (e.state != CommEvent::State::Scheduled) {
      if (FlightEntry* f = find_open(id, e)) {
        if (e.state == CommEvent::State::Started) f->t_started = e.t_begin;
        else f->t_completed = e.t_end;
        f->state = e.state;
        return;
      }
    }
    FlightEntry& f = ring[size_t(head)];
    head = (head + 1) % int64_t(ring.size());
    count = std::min<int64_t>(count + 1, int64_t(ring.size()));
    f.group = id;
    f.members = e.comm->world_ranks;
    f.seq = e.seq, f.op = e.op, f.bytes = e.bytes, f.peer = e.peer, f.tag = e.tag, f.msg = e.msg;
    f.state = e.state;
    f.t_scheduled = e.state == CommEvent::State::Scheduled ? e.t_begin : 0;
    f.t_started = e.state == CommEvent::State::Started ? e.t_begin : 0;
    f.t_completed = e.state == CommEvent::State::Completed ? e.t_end : 0;
    if (e.state == CommEvent::State::Completed) f.t_started = e.t_begin;  // a completion never seen starting
  }

  // The oldest started, unfinished call: its start time, or 0 when none.
  double oldest_started(FlightEntry* out) {
    std::lock_guard<std::mutex> lk(mu);
    double t = 0;
    for (int64_t k = 0; k < count; ++k) {
      const FlightEntry& f = at(k);
      if (f.state == CommEvent::State::Started && (t == 0 || f.t_started < t)) t = f.t_started, *out = f;
    }
    return t;
  }
};

Recorder* g_rec = nullptr;  // set while no communication runs (flight_recorder_start / stop)

std::string describe(const FlightEntry& f) {
  std::string s = std::string(comm_op_name(f.op));
  if (f.seq >= 0) s += " #" + std::to_string(f.seq);
  s += " on " + f.group + " (" + std::to_string(f.bytes) + " bytes";
  if (f.peer >= 0) s += ", peer " + std::to_string(f.peer) + ", tag " + std::to_string(f.tag);
  return s + ")";
}

}  // namespace

void flight_recorder_start(int64_t capacity) {
  MT_CHECK(capacity >= 1, "flight", "capacity must be >= 1, got ", capacity);
  flight_recorder_stop();
  g_rec = new Recorder();
  g_rec->ring.resize(size_t(capacity));
  Recorder* r = g_rec;
  set_comm_flight_sink([r](const CommEvent& e) { r->on_event(e); });
}

void flight_recorder_stop() {
  set_comm_flight_sink(nullptr);
  delete g_rec;
  g_rec = nullptr;
}

std::vector<FlightEntry> flight_recorder_entries() {
  std::vector<FlightEntry> v;
  if (!g_rec) return v;
  std::lock_guard<std::mutex> lk(g_rec->mu);
  for (int64_t k = 0; k < g_rec->count; ++k) v.push_back(g_rec->at(k));
  return v;
}

std::string flight_recorder_json(int world_rank, int world_size, const std::string& reason) {
  json j{{"rank", world_rank}, {"world_size", world_size}, {"reason", reason}, {"now", now_s()}};
  json entries = json::array(), groups = json::object();
  for (const FlightEntry& f : flight_recorder_entries()) {
    json e{{"group", f.group}, {"seq", f.seq}, {"kind", std::string(comm_op_name(f.op))}, {"bytes", f.bytes},
           {"state", state_name(f.state)}, {"t_scheduled", f.t_scheduled}, {"t_started", f.t_started},
           {"t_completed", f.t_completed}};
    if (f.peer >= 0) e["peer"] = f.peer, e["tag"] = f.tag, e["msg"] = f.msg;
    entries.push_back(std::move(e));
    groups[f.group] = f.members;
  }
  j["entries"] = std::move(entries);
  j["groups"] = std::move(groups);
  return j.dump(1);
}

// ---------------------------------------------------------------------------------------------------------

struct FlightWatchdog::Impl {
  double timeout;
  std::string folder;
  int rank, world;
  double t_begin = now_s();
  fs::file_time_type start_file_time = fs::file_time_type::clock::now();
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool dumped = false;
  std::thread th;

  std::string path() const { return (fs::path(folder) / ("rank" + std::to_string(rank) + ".json")).string(); }

  void dump(const std::string& reason) {
    std::error_code ec;
    fs::create_directories(folder, ec);
    const std::string p = path(), tmp = p + ".tmp";
    {
      std::ofstream f(tmp);
      f << flight_recorder_json(rank, world, reason) << "\n";
    }
    fs::rename(tmp, p, ec);
    dumped = true;
  }

  // Another rank's dump written during this run (the first found), or -1.
  int other_dump() const {
    std::error_code ec;
    if (!fs::is_directory(folder, ec)) return -1;
    for (const auto& d : fs::directory_iterator(folder, ec)) {
      const std::string n = d.path().filename().string();
      if (n.rfind("rank", 0) != 0 || d.path().extension() != ".json") continue;
      const int r = std::atoi(n.c_str() + 4);
      if (r == rank) continue;
      if (fs::last_write_time(d.path(), ec) >= start_file_time) return r;
    }
    return -1;
  }

  void run() {
    const double poll = std::clamp(timeout / 10, 0.05, 1.0);
    std::unique_lock<std::mutex> lk(mu);
    while (!cv.wait_for(lk, std::chrono::duration<double>(poll), [&] { return stop; })) {
      FlightEntry f;
      const double t = g_rec ? g_rec->oldest_started(&f) : 0;
      const double now = now_s();
      if (t > 0 && now - t > timeout) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "running for %.1f s, longer than comm.timeout_s = %g", now - t, timeout);
        const std::string why = describe(f) + " " + buf;
        dump("timeout: " + why);
        std::fprintf(stderr,
                     "moetron: rank %d: watchdog: %s; flight recorder written to %s; aborting (read the dumps with "
                     "`moetron trace flight %s`)\n",
                     rank, why.c_str(), path().c_str(), folder.c_str());
        std::fflush(stderr);
        // Give the other ranks' watchdogs time to write their dumps, then end the job.
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::duration<double>(std::min(2.0, 3 * poll + 0.5)));
        std::_Exit(3);
      }
      if (!dumped) {
        const int other = other_dump();
        if (other >= 0) {
          dump("rank " + std::to_string(other) + " timed out");
          std::fprintf(stderr, "moetron: rank %d: watchdog: rank %d timed out; flight recorder written to %s\n", rank,
                       other, path().c_str());
          std::fflush(stderr);
        }
      }
    }
  }
};

FlightWatchdog::FlightWatchdog(double timeout_s, std::string folder, int world_rank, int world_size) {
  if (!(timeout_s > 0)) return;
  impl_ = new Impl{timeout_s, std::move(folder), world_rank, world_size};
  std::error_code ec;
  fs::remove(impl_->path(), ec);  // this rank's dump of an earlier run
  impl_->th = std::thread([this] { impl_->run(); });
}

FlightWatchdog::~FlightWatchdog() {
  if (!impl_) return;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  impl_->th.join();
  delete impl_;
}

}  // namespace moetron
