// reader.cpp: moetron trace files (tracefile/reader.h) read with every field checked, and written back in the
// same format. Not the analysis (analyze.cpp) and not the engine's recorder.
#include "tracefile/reader.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "moetron/check.h"

namespace moetron::tracefile {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

template <class... A>
[[noreturn]] void fail(const A&... parts) {
  std::ostringstream os;
  os << "[trace] ";
  (os << ... << parts);
  throw moetron::Error(os.str());
}

struct Where {
  const std::string& src;
  std::string what;  // e.g. "traceEvents[12] (comm 'all_reduce')"
};

double num(const json& j, const char* key, const Where& w, bool required, bool nonneg = true) {
  if (!j.is_object() || !j.contains(key)) {
    if (required) fail(w.src, ": ", w.what, ": ", key, " missing");
    return 0;
  }
  const json& v = j.at(key);
  if (!v.is_number()) fail(w.src, ": ", w.what, ": ", key, " = ", v.dump(), " is not a number");
  const double d = v.get<double>();
  if (nonneg && !(d >= 0)) fail(w.src, ": ", w.what, ": ", key, " = ", v.dump(), " must be >= 0");
  return d;
}

int64_t integer(const json& j, const char* key, const Where& w, bool required, int64_t dflt = -1) {
  if (!j.is_object() || !j.contains(key)) {
    if (required) fail(w.src, ": ", w.what, ": ", key, " missing");
    return dflt;
  }
  const json& v = j.at(key);
  if (!v.is_number_integer()) fail(w.src, ": ", w.what, ": ", key, " = ", v.dump(), " is not an integer");
  return v.get<int64_t>();
}

std::string text(const json& j, const char* key, const Where& w, bool required) {
  if (!j.is_object() || !j.contains(key)) {
    if (required) fail(w.src, ": ", w.what, ": ", key, " missing");
    return {};
  }
  const json& v = j.at(key);
  if (!v.is_string()) fail(w.src, ": ", w.what, ": ", key, " = ", v.dump(), " is not a string");
  return v.get<std::string>();
}

std::vector<double> numbers(const json& j, const char* key, const Where& w) {
  std::vector<double> out;
  if (!j.is_object() || !j.contains(key)) return out;
  const json& v = j.at(key);
  if (!v.is_array()) fail(w.src, ": ", w.what, ": ", key, " is not a list");
  for (const json& x : v) {
    if (!x.is_number() || x.get<double>() < 0)
      fail(w.src, ": ", w.what, ": ", key, " holds ", x.dump(), " (want numbers >= 0)");
    out.push_back(x.get<double>());
  }
  return out;
}

Cat cat_of(const std::string& s) {
  if (s == "step") return Cat::Step;
  if (s == "action") return Cat::Action;
  if (s == "module") return Cat::Module;
  if (s == "kernel") return Cat::Kernel;
  if (s == "comm") return Cat::Comm;
  return Cat::Other;
}

bool is_p2p(const std::string& name) { return name == "send" || name == "recv"; }
// Communication events that are not collectives: point-to-point calls and the wait that completes non-blocking
// requests. They carry no sequence number.
bool unsequenced(const std::string& name) { return is_p2p(name) || name == "wait"; }

Meta parse_meta(const json& m, const std::string& src) {
  const Where w{src, "moetron"};
  if (!m.is_object()) fail(src, ": the metadata object 'moetron' is missing (is this a moetron trace?)");
  Meta meta;
  const std::string fmt = text(m, "format", w, true);
  if (fmt != "moetron-trace") fail(src, ": moetron.format = \"", fmt, "\", expected \"moetron-trace\"");
  const int64_t ver = integer(m, "version", w, true);
  if (ver != 1) fail(src, ": moetron.version = ", ver, ": this reader knows version 1");
  meta.rank = int(integer(m, "rank", w, true));
  meta.world = int(integer(m, "world", w, true));
  if (meta.world < 1 || meta.rank < 0 || meta.rank >= meta.world)
    fail(src, ": moetron.rank = ", meta.rank, ", world = ", meta.world, ": need 0 <= rank < world");
  meta.source = text(m, "source", w, true);
  if (meta.source != "engine" && meta.source != "planner")
    fail(src, ": moetron.source = \"", meta.source, "\", expected \"engine\" or \"planner\"");
  meta.config = text(m, "config", w, false);
  if (m.contains("layout")) {
    if (!m.at("layout").is_object()) fail(src, ": moetron.layout is not an object");
    meta.layout = m.at("layout");
  }
  if (m.contains("limits")) {
    const json& l = m.at("limits");
    const Where wl{src, "moetron.limits"};
    meta.limits.flops_per_s = num(l, "flops_per_s", wl, true);
    meta.limits.bytes_per_s = num(l, "bytes_per_s", wl, true);
    meta.limits.dtype = text(l, "dtype", wl, false);
    meta.limits.source = text(l, "source", wl, false);
  }
  if (m.contains("steps")) {
    const json& s = m.at("steps");
    const bool none = s.is_array() && s.empty();  // no profiled step
    if (!none && (!s.is_array() || s.size() != 2 || !s[0].is_number_integer() || !s[1].is_number_integer()))
      fail(src, ": moetron.steps = ", s.dump(), ": expected [first, last] or []");
    if (!none) meta.first_step = s[0].get<int64_t>(), meta.last_step = s[1].get<int64_t>();
  }
  if (m.contains("groups")) {
    const json& g = m.at("groups");
    if (!g.is_object()) fail(src, ": moetron.groups is not an object");
    for (const auto& [id, v] : g.items()) {
      const Where wg{src, "moetron.groups['" + id + "']"};
      Group grp;
      grp.id = id;
      grp.name = text(v, "name", wg, true);
      if (!v.contains("ranks") || !v.at("ranks").is_array() || v.at("ranks").empty())
        fail(src, ": ", wg.what, ": ranks missing or empty");
      for (const json& r : v.at("ranks")) {
        if (!r.is_number_integer() || r.get<int64_t>() < 0 || r.get<int64_t>() >= meta.world)
          fail(src, ": ", wg.what, ": rank ", r.dump(), " is not in [0, world = ", meta.world, ")");
        grp.ranks.push_back(r.get<int>());
      }
      meta.groups[id] = grp;
    }
  }
  meta.clock_offset_us = num(m, "clock_offset_us", w, false, false);
  meta.dropped_events = integer(m, "dropped_events", w, false, 0);
  return meta;
}

}  // namespace

const char* cat_name(Cat c) {
  switch (c) {
    case Cat::Step: return "step";
    case Cat::Action: return "action";
    case Cat::Module: return "module";
    case Cat::Kernel: return "kernel";
    case Cat::Comm: return "comm";
    default: return "other";
  }
}

std::string rank_file_name(int rank) { return "rank" + std::to_string(rank) + ".trace.json"; }

RankTrace parse_rank(const std::string& body, const std::string& src) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    fail(src, ": not JSON: ", e.what());
  }
  if (!j.is_object()) fail(src, ": expected the JSON object form {\"traceEvents\": [...], \"moetron\": {...}}");
  RankTrace t;
  t.path = src;
  t.meta = parse_meta(j.contains("moetron") ? j.at("moetron") : json(), src);
  for (const auto& [id, g] : t.meta.groups) {
    bool member = false;
    for (int r : g.ranks) member |= r == t.meta.rank;
    if (!member) fail(src, ": moetron.groups['", id, "'] does not hold this rank (", t.meta.rank, ")");
  }
  if (!j.contains("traceEvents") || !j.at("traceEvents").is_array()) fail(src, ": traceEvents missing or not a list");
  const json& evs = j.at("traceEvents");
  for (size_t k = 0; k < evs.size(); ++k) {
    const json& e = evs[k];
    Where w{src, "traceEvents[" + std::to_string(k) + "]"};
    if (!e.is_object()) fail(src, ": ", w.what, " is not an object");
    const std::string ph = text(e, "ph", w, true);
    if (ph == "M") {
      const std::string name = text(e, "name", w, true);
      const json args = e.value("args", json::object());
      if (name == "thread_name") t.track_names[int(integer(e, "tid", w, true))] = text(args, "name", w, true);
      if (name == "process_name") t.process_name = text(args, "name", w, true);
      continue;
    }
    if (ph == "C") {
      const std::string cname = text(e, "name", w, true);
      if (cname != "memory" && cname != "memory_peak") continue;
      Counter c;
      c.name = cname;
      c.ts = num(e, "ts", w, true, false);
      if (e.contains("args")) {
        if (!e.at("args").is_object()) fail(src, ": ", w.what, ": args is not an object");
        for (const auto& [key, v] : e.at("args").items()) {
          if (!v.is_number()) fail(src, ": ", w.what, " (memory): args.", key, " = ", v.dump(), " is not a number");
          c.values[key] = v.get<double>();
        }
      }
      t.memory.push_back(c);
      continue;
    }
    if (ph != "X") continue;  // flows, instants: not read
    Event ev;
    ev.name = text(e, "name", w, true);
    ev.cat_text = text(e, "cat", w, true);
    ev.cat = cat_of(ev.cat_text);
    w.what += " (" + ev.cat_text + " '" + ev.name + "')";
    const int64_t pid = integer(e, "pid", w, true);
    if (pid != t.meta.rank) fail(src, ": ", w.what, ": pid = ", pid, " but this is rank ", t.meta.rank, "'s trace");
    ev.tid = int(integer(e, "tid", w, true));
    ev.ts = num(e, "ts", w, true, false);
    ev.dur = num(e, "dur", w, true);
    const json args = e.value("args", json::object());
    if (!args.is_object()) fail(src, ": ", w.what, ": args is not an object");
    const Where wa{src, w.what + " args"};
    switch (ev.cat) {
      case Cat::Step: ev.step = integer(args, "step", wa, true); break;
      case Cat::Action:
        ev.mb = integer(args, "mb", wa, false), ev.chunk = integer(args, "chunk", wa, false);
        ev.stage = integer(args, "stage", wa, false);
        break;
      case Cat::Module: ev.layer = integer(args, "layer", wa, false); break;
      case Cat::Kernel:
        ev.flops = num(args, "flops", wa, false), ev.bytes = num(args, "bytes", wa, false);
        ev.shape = text(args, "shape", wa, false);
        break;
      case Cat::Comm: {
        const bool p2p = is_p2p(ev.name);
        ev.group = text(args, "group", wa, !unsequenced(ev.name));
        ev.seq = integer(args, "seq", wa, !unsequenced(ev.name));
        ev.bytes_in = num(args, "bytes_in", wa, false), ev.bytes_out = num(args, "bytes_out", wa, false);
        ev.peer = int(integer(args, "peer", wa, p2p));
        if (p2p && (ev.peer < 0 || ev.peer >= t.meta.world))
          fail(src, ": ", wa.what, ": peer = ", ev.peer, " is not a rank of world ", t.meta.world);
        ev.tag = integer(args, "tag", wa, false);
        ev.send_bytes = numbers(args, "send_bytes", wa), ev.recv_bytes = numbers(args, "recv_bytes", wa);
        if (!ev.group.empty()) {
          auto g = t.meta.groups.find(ev.group);
          if (g == t.meta.groups.end()) fail(src, ": ", wa.what, ": group '", ev.group, "' is not in moetron.groups");
          const size_t n = g->second.ranks.size();
          if ((!ev.send_bytes.empty() && ev.send_bytes.size() != n) || (!ev.recv_bytes.empty() && ev.recv_bytes.size() != n))
            fail(src, ": ", wa.what, ": send_bytes / recv_bytes need one entry per member of group '", ev.group,
                 "' (", n, ")");
        }
        break;
      }
      default: break;
    }
    t.events.push_back(std::move(ev));
  }
  return t;
}

RankTrace read_rank_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse_rank(ss.str(), path);
}

Trace read_dir(const std::string& dir) {
  if (!fs::is_directory(dir)) fail(dir, ": not a directory");
  const fs::path first = fs::path(dir) / rank_file_name(0);
  if (!fs::exists(first)) fail(dir, ": no ", rank_file_name(0), " (a profiled run writes rank<r>.trace.json per rank)");
  Trace t;
  t.dir = dir;
  t.ranks.push_back(read_rank_file(first.string()));
  const int world = t.ranks[0].meta.world;
  for (int r = 0; r < world; ++r) {
    const fs::path p = fs::path(dir) / rank_file_name(r);
    if (r > 0) {
      if (!fs::exists(p)) fail(dir, ": ", rank_file_name(r), " missing (rank 0 says world = ", world, ")");
      t.ranks.push_back(read_rank_file(p.string()));
    }
    const Meta& m = t.ranks.back().meta;
    if (m.rank != r) fail(p.string(), ": moetron.rank = ", m.rank, " but the file is rank ", r, "'s");
    if (m.world != world) fail(p.string(), ": moetron.world = ", m.world, " but rank 0 says ", world);
    if (m.source != t.ranks[0].meta.source)
      fail(p.string(), ": moetron.source = \"", m.source, "\" but rank 0's is \"", t.ranks[0].meta.source, "\"");
  }
  return t;
}

json to_json(const RankTrace& t) {
  const Meta& m = t.meta;
  json evs = json::array();
  evs.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", m.rank}, {"tid", 0},
                 {"args", {{"name", t.process_name.empty() ? "rank " + std::to_string(m.rank) : t.process_name}}}});
  for (const auto& [tid, name] : t.track_names)
    evs.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", m.rank}, {"tid", tid}, {"args", {{"name", name}}}});
  for (const Event& e : t.events) {
    json args = json::object();
    switch (e.cat) {
      case Cat::Step: args["step"] = e.step; break;
      case Cat::Action:
        if (e.mb >= 0) args["mb"] = e.mb;
        if (e.chunk >= 0) args["chunk"] = e.chunk;
        if (e.stage >= 0) args["stage"] = e.stage;
        break;
      case Cat::Module:
        if (e.layer >= 0) args["layer"] = e.layer;
        break;
      case Cat::Kernel:
        args["flops"] = e.flops, args["bytes"] = e.bytes;
        if (!e.shape.empty()) args["shape"] = e.shape;
        break;
      case Cat::Comm:
        if (!e.group.empty()) args["group"] = e.group;
        if (e.seq >= 0) args["seq"] = e.seq;
        args["bytes_in"] = e.bytes_in, args["bytes_out"] = e.bytes_out;
        if (e.peer >= 0) args["peer"] = e.peer;
        if (e.tag >= 0) args["tag"] = e.tag;
        if (!e.send_bytes.empty()) args["send_bytes"] = e.send_bytes;
        if (!e.recv_bytes.empty()) args["recv_bytes"] = e.recv_bytes;
        break;
      default: break;
    }
    evs.push_back({{"ph", "X"}, {"cat", e.cat == Cat::Other ? e.cat_text : std::string(cat_name(e.cat))},
                   {"name", e.name}, {"pid", m.rank}, {"tid", e.tid}, {"ts", e.ts}, {"dur", e.dur}, {"args", args}});
  }
  for (const Counter& c : t.memory)
    evs.push_back({{"ph", "C"}, {"name", c.name}, {"pid", m.rank}, {"tid", 0}, {"ts", c.ts}, {"args", c.values}});
  json groups = json::object();
  for (const auto& [id, g] : m.groups) groups[id] = {{"name", g.name}, {"ranks", g.ranks}};
  json meta = {{"format", "moetron-trace"}, {"version", 1}, {"rank", m.rank}, {"world", m.world},
               {"source", m.source}, {"config", m.config}, {"layout", m.layout}, {"groups", groups},
               {"clock_offset_us", m.clock_offset_us}, {"dropped_events", m.dropped_events}};
  if (m.first_step >= 0) meta["steps"] = {m.first_step, m.last_step};
  if (m.limits.flops_per_s > 0 || m.limits.bytes_per_s > 0)
    meta["limits"] = {{"flops_per_s", m.limits.flops_per_s}, {"bytes_per_s", m.limits.bytes_per_s},
                      {"dtype", m.limits.dtype}, {"source", m.limits.source}};
  return {{"traceEvents", evs}, {"displayTimeUnit", "ms"}, {"moetron", meta}};
}

void write_rank_file(const RankTrace& t, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(dir, ": cannot create: ", ec.message());
  const fs::path p = fs::path(dir) / rank_file_name(t.meta.rank);
  std::ofstream out(p, std::ios::binary);
  if (!out) fail(p.string(), ": cannot write");
  out << to_json(t).dump() << "\n";
  if (!out) fail(p.string(), ": write failed");
}

}  // namespace moetron::tracefile
