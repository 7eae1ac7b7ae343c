// trace_builder.h: hand-built rank traces for the trace-analysis tests: one call per event, times in
// microseconds, so a test reads like the timeline it draws. Not a recorder.
#pragma once
#include <string>
#include <vector>

#include "tracefile/reader.h"

namespace tracetest {

using moetron::tracefile::Cat;
using moetron::tracefile::Event;

struct RankBuilder {
  moetron::tracefile::RankTrace t;
  RankBuilder(int rank, int world, const std::string& source = "engine") {
    t.meta.rank = rank, t.meta.world = world, t.meta.source = source;
    t.meta.first_step = 0, t.meta.last_step = 0;
    t.track_names[0] = "compute";
  }
  RankBuilder& group(const std::string& id, const std::string& name, std::vector<int> ranks) {
    t.meta.groups[id] = {id, name, std::move(ranks)};
    return *this;
  }
  RankBuilder& limits(double flops_per_s, double bytes_per_s) {
    t.meta.limits = {flops_per_s, bytes_per_s, "fp32", "start-up measurement"};
    return *this;
  }
  Event& add(Cat c, const std::string& name, double ts, double dur, int tid) {
    Event e;
    e.cat = c, e.name = name, e.ts = ts, e.dur = dur, e.tid = tid;
    t.events.push_back(e);
    return t.events.back();
  }
  RankBuilder& step(int64_t n, double ts, double dur) {
    add(Cat::Step, "step", ts, dur, 0).step = n;
    return *this;
  }
  RankBuilder& action(const std::string& name, double ts, double dur, int64_t mb = 0, int64_t stage = 0) {
    Event& e = add(Cat::Action, name, ts, dur, 0);
    e.mb = mb, e.stage = stage, e.chunk = 0;
    return *this;
  }
  RankBuilder& module(const std::string& name, double ts, double dur, int64_t layer = -1) {
    add(Cat::Module, name, ts, dur, 0).layer = layer;
    return *this;
  }
  RankBuilder& kernel(const std::string& name, double ts, double dur, double flops = 0, double bytes = 0, int tid = 0) {
    Event& e = add(Cat::Kernel, name, ts, dur, tid);
    e.flops = flops, e.bytes = bytes;
    return *this;
  }
  RankBuilder& comm(const std::string& kind, const std::string& group, int64_t seq, double ts, double dur,
                    double bytes_in = 0, int tid = 0, double bytes_out = -1) {
    Event& e = add(Cat::Comm, kind, ts, dur, tid);
    e.group = group, e.seq = seq, e.bytes_in = bytes_in, e.bytes_out = bytes_out < 0 ? bytes_in : bytes_out;
    if (tid != 0) t.track_names[tid] = "comm";
    return *this;
  }
  RankBuilder& a2a(const std::string& group, int64_t seq, double ts, double dur, std::vector<double> send) {
    double total = 0;
    for (double v : send) total += v;
    Event& e = add(Cat::Comm, "all_to_all", ts, dur, 0);
    e.group = group, e.seq = seq, e.bytes_in = total, e.send_bytes = std::move(send);
    return *this;
  }
};

inline moetron::tracefile::Trace trace_of(std::vector<RankBuilder> rs, const std::string& dir = "hand") {
  moetron::tracefile::Trace t;
  t.dir = dir;
  for (auto& r : rs) t.ranks.push_back(r.t);
  return t;
}

}  // namespace tracetest
