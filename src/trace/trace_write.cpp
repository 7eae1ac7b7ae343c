// trace_write.cpp: a rank's trace file, docs/profiling.md "Trace format (version 1)": the Chrome trace-event
// JSON object with the track names, every recorded event (times moved so that the session's start barrier is
// ts 0) and the `moetron` metadata object. Events are written by hand (there can be hundreds of thousands);
// the metadata through nlohmann::json. Not the recorder (trace.cpp, trace_comm.cpp), not the merge of ranks
// (src/tracefile/).
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/trace.h"
#include "trace/recorder.h"

namespace moetron::trace {

using detail::Cat;
using detail::Event;

namespace {

const char* cat_name(Cat c) {
  switch (c) {
    case Cat::Kernel: return "kernel";
    case Cat::Module: return "module";
    case Cat::Action: return "action";
    case Cat::Step: return "step";
    case Cat::Comm: return "comm";
    case Cat::Wait: return "comm";
    case Cat::Memory: return "memory";
  }
  return "?";
}

const char* track_name(int tid) {
  switch (tid) {
    case 0: return "compute";
    case 1: return "comm progress";
    case 2: return "EP overlap lane";
    default: return "thread";
  }
}

// Integers up to 2^53 print exactly; fractions of a microsecond with nanosecond resolution.
void num(std::string& o, double v) {
  char b[40];
  if (v == double(int64_t(v)) && v > -9e15 && v < 9e15) std::snprintf(b, sizeof b, "%lld", (long long)v);
  else std::snprintf(b, sizeof b, "%.3f", v);
  o += b;
}

void write_event(std::string& o, const Event& e, const detail::Store& s) {
  const double off = -s.t_sync_us;
  o += "{\"name\":\"";
  if (e.cat == Cat::Module && e.a[0] >= 0) o += "layer" + std::to_string(e.a[0]) + ".";
  o += e.name;
  o += "\",\"cat\":\"";
  o += cat_name(e.cat);
  o += e.cat == Cat::Memory ? "\",\"ph\":\"C\"" : "\",\"ph\":\"X\"";
  o += ",\"pid\":" + std::to_string(s.rank) + ",\"tid\":" + std::to_string(int(e.tid)) + ",\"ts\":";
  num(o, e.t0 + off);
  if (e.cat != Cat::Memory) {
    o += ",\"dur\":";
    num(o, e.t1 > e.t0 ? e.t1 - e.t0 : 0.0);
  }
  o += ",\"args\":{";
  auto arg = [&](const char* k, double v, bool first = false) {
    if (!first) o += ",";
    o += "\"";
    o += k;
    o += "\":";
    num(o, v);
  };
  auto counts = [&](const char* k, int64_t at, int n) {
    o += ",\"";
    o += k;
    o += "\":[";
    for (int q = 0; q < n; ++q) {
      if (q) o += ",";
      num(o, s.side[size_t(at + q)]);
    }
    o += "]";
  };
  switch (e.cat) {
    case Cat::Kernel:
      arg("flops", e.d[0], true), arg("bytes", e.d[1]);
      break;
    case Cat::Module:
      if (e.a[0] >= 0) arg("layer", e.a[0], true);
      break;
    case Cat::Action:
      arg("mb", e.a[0], true), arg("chunk", e.a[1]), arg("stage", e.a[2]);
      if (e.name2) {
        o += ",\"op2\":\"";
        o += e.name2;
        o += "\"";
        arg("mb2", e.a[3]), arg("stage2", e.a[4]);
      }
      break;
    case Cat::Step:
      arg("step", e.d[0], true);
      break;
    case Cat::Comm: {
      o += "\"group\":\"" + s.groups[size_t(e.a[0])].id + "\"";
      if (e.d[0] >= 0) arg("seq", e.d[0]);
      arg("bytes_in", e.d[1]), arg("bytes_out", e.d[2]);
      if (e.a[1] >= 0) arg("peer", e.a[1]), arg("tag", e.a[2]), arg("msg", e.d[3]);
      if (e.side >= 0) {
        counts("send_bytes", e.side, e.a[3]);
        if (e.flag) counts("recv_bytes", e.side + e.a[3], e.a[3]);
      } else if (e.flag) {
        arg("nonblocking", 1);
      }
      break;
    }
    case Cat::Wait:
      o += "\"group\":\"" + s.groups[size_t(e.a[0])].id + "\"";
      arg("requests", e.a[1]);
      break;
    case Cat::Memory: {
      static const char* keys[5] = {"params", "grads", "optimizer", "activations", "buffers"};
      for (int i = 0; i < 5; ++i) arg(keys[i], s.side[size_t(e.side + i)], i == 0);
      break;
    }
  }
  o += "}}";
}

}  // namespace

void end_session(const std::string& path) {
  set_comm_trace_sink(nullptr);
  auto& s = detail::store();
  std::lock_guard<std::mutex> lk(s.mu);
  MT_CHECK(s.session, "trace", "no trace session to write to ", path);
  s.session = false;
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream f(path, std::ios::binary);
  MT_CHECK(f.good(), "trace", "cannot write ", path);
  std::string o;
  o.reserve(1 << 20);
  const std::string pid = std::to_string(s.rank);
  o += "{\"traceEvents\":[\n";
  o += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":0,\"args\":{\"name\":\"rank " + pid + "\"}},\n";
  o += "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":0,\"args\":{\"sort_index\":" + pid +
       "}}";
  for (int t = 0; t < 8; ++t)
    if (s.tid_used[t])
      o += ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" + std::to_string(t) +
           ",\"args\":{\"name\":\"" + track_name(t) + "\"}}";
  for (const Event& e : s.events) {
    o += ",\n";
    write_event(o, e, s);
    if (o.size() > (1 << 20)) f << o, o.clear();
  }
  o += "\n],\n\"displayTimeUnit\":\"ms\",\n\"moetron\":";
  nlohmann::json m = s.meta;
  m["format"] = "moetron-trace";
  m["version"] = 1;
  m["rank"] = s.rank, m["world"] = s.world;
  if (!m.contains("source")) m["source"] = "engine";
  m["steps"] = s.first_step >= 0 ? nlohmann::json::array({s.first_step, s.last_step}) : nlohmann::json::array();
  nlohmann::json groups = nlohmann::json::object();
  for (const auto& g : s.groups) groups[g.id] = {{"name", g.name}, {"ranks", g.ranks}};
  m["groups"] = groups;
  m["clock_offset_us"] = -s.t_sync_us;
  m["max_events"] = s.max_events;
  m["dropped_events"] = s.dropped;
  o += m.dump();
  o += "}\n";
  f << o;
  MT_CHECK(f.good(), "trace", "writing ", path, " failed");
}

}  // namespace moetron::trace
