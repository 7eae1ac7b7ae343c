// merge.cpp: the per-rank trace files into one Perfetto-loadable trace with send -> receive flows (merge.h).
// Not the engine's writer (src/trace/) and not the analysis.
#include "tracefile/merge.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <stdexcept>
#include <tuple>

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moetron::tracefile {

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("[trace merge] " + msg); }

// One point-to-point event, as the flow matching sees it.
struct P2p {
  const json* ev = nullptr;
  int64_t msg = -1;  // -1: absent (ordered by time)
  double ts = 0;
};
using Key = std::tuple<std::string, int64_t, int64_t, int64_t>;  // group, sender, receiver, tag

int64_t int_arg(const json& args, const char* k, int64_t dflt) {
  auto it = args.find(k);
  return it != args.end() && it->is_number() ? it->get<int64_t>() : dflt;
}

// A point inside the slice (its middle), where the flow binds to it and not to a neighbour.
double inside(const json& ev) { return ev.value("ts", 0.0) + 0.5 * ev.value("dur", 0.0); }

}  // namespace

std::vector<std::string> rank_trace_files(const std::string& dir) {
  if (!fs::is_directory(dir)) fail(dir + ": not a directory");
  static const std::regex name(R"(rank([0-9]+)\.trace\.json)");
  std::vector<std::pair<long, std::string>> found;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string f = e.path().filename().string();
    if (e.is_regular_file() && std::regex_match(f, m, name)) found.push_back({std::stol(m[1]), e.path().string()});
  }
  if (found.empty()) fail(dir + ": no rank<r>.trace.json files (write them with `moetron train --trace " + dir + "`)");
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [r, p] : found) out.push_back(p);
  return out;
}

json read_rank_trace(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail(path + ": cannot open");
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    fail(path + ": not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("traceEvents") || !j["traceEvents"].is_array())
    fail(path + ": not a trace (expected an object with a traceEvents array)");
  if (!j.contains("moetron") || !j["moetron"].is_object())
    fail(path + ": no `moetron` metadata object (not written by moetron?)");
  const json& m = j["moetron"];
  if (m.value("format", "") != "moetron-trace")
    fail(path + ": moetron.format is " + m.value("format", std::string("missing")) + ", expected \"moetron-trace\"");
  if (m.value("version", 0) != 1)
    fail(path + ": moetron.version " + std::to_string(m.value("version", 0)) + " is not supported (this reads 1)");
  for (const char* k : {"rank", "world"})
    if (!m.contains(k) || !m[k].is_number_integer()) fail(path + ": moetron." + k + " missing or not an integer");
  return j;
}

MergeResult merge_traces(const std::vector<json>& ranks, const std::vector<std::string>& names) {
  if (ranks.empty()) fail("no rank traces to merge");
  MergeResult r;
  const int64_t world = ranks[0]["moetron"]["world"].get<int64_t>();
  std::vector<int> seen(size_t(std::max<int64_t>(world, 0)), -1);
  json events = json::array();
  json meta_ranks = json::array();
  json groups = json::object();
  std::map<Key, std::vector<P2p>> sends, recvs;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const json& t = ranks[i];
    const std::string& nm = i < names.size() ? names[i] : "rank file " + std::to_string(i);
    const json& m = t["moetron"];
    const int64_t rk = m["rank"].get<int64_t>();
    if (m["world"].get<int64_t>() != world)
      fail(nm + ": world " + std::to_string(m["world"].get<int64_t>()) + ", but the first rank file says " +
           std::to_string(world));
    if (rk < 0 || rk >= world) fail(nm + ": rank " + std::to_string(rk) + " outside [0, " + std::to_string(world) + ")");
    if (seen[size_t(rk)] >= 0) fail(nm + ": rank " + std::to_string(rk) + " again (also " + names[size_t(seen[size_t(rk)])] + ")");
    seen[size_t(rk)] = int(i);
    json mr = m;
    mr.erase("config");  // once, at the top
    meta_ranks.push_back(mr);
    if (m.contains("groups") && m["groups"].is_object())
      for (auto it = m["groups"].begin(); it != m["groups"].end(); ++it) groups[it.key()] = it.value();
    for (const json& ev : t["traceEvents"]) events.push_back(ev);
  }
  for (int64_t q = 0; q < world; ++q)
    if (seen[size_t(q)] < 0) fail("rank " + std::to_string(q) + " of " + std::to_string(world) + " has no trace file");
  r.ranks = int(ranks.size());
  r.events = int64_t(events.size());
  // The point-to-point events, keyed by (group, sender, receiver, tag); `events` no longer grows.
  for (const json& ev : events) {
    if (!ev.is_object() || ev.value("cat", "") != "comm") continue;
    const std::string n = ev.value("name", "");
    if (n != "send" && n != "recv") continue;
    const json& a = ev.contains("args") ? ev["args"] : json::object();
    const int64_t peer = int_arg(a, "peer", -1), me = ev.value("pid", int64_t(-1));
    if (peer < 0) continue;
    const std::string g = a.contains("group") ? a["group"].dump() : "";
    const int64_t tag = int_arg(a, "tag", 0);
    const P2p p{&ev, int_arg(a, "msg", -1), ev.value("ts", 0.0)};
    if (n == "send") sends[Key{g, me, peer, tag}].push_back(p);
    else recvs[Key{g, peer, me, tag}].push_back(p);
  }
  json flows = json::array();
  int64_t id = 0;
  auto order = [](std::vector<P2p>& v) {
    std::stable_sort(v.begin(), v.end(), [](const P2p& a, const P2p& b) {
      return a.msg >= 0 && b.msg >= 0 ? a.msg < b.msg : a.ts < b.ts;
    });
  };
  for (auto& [k, sv] : sends) {
    auto it = recvs.find(k);
    if (it == recvs.end()) {
      r.unmatched_sends += int64_t(sv.size());
      continue;
    }
    std::vector<P2p>& rv = it->second;
    order(sv), order(rv);
    const bool by_msg = std::all_of(sv.begin(), sv.end(), [](const P2p& p) { return p.msg >= 0; }) &&
                        std::all_of(rv.begin(), rv.end(), [](const P2p& p) { return p.msg >= 0; });
    size_t a = 0, b = 0;
    while (a < sv.size() && b < rv.size()) {
      if (by_msg && sv[a].msg != rv[b].msg) {  // one end's message is outside the other's profiled steps
        if (sv[a].msg < rv[b].msg) ++a, ++r.unmatched_sends;
        else ++b, ++r.unmatched_recvs;
        continue;
      }
      const json& s = *sv[a].ev;
      const json& d = *rv[b].ev;
      ++id;
      flows.push_back({{"name", "p2p"}, {"cat", "flow"}, {"ph", "s"}, {"id", id}, {"pid", s["pid"]},
                       {"tid", s.value("tid", 0)}, {"ts", inside(s)}});
      flows.push_back({{"name", "p2p"}, {"cat", "flow"}, {"ph", "f"}, {"bp", "e"}, {"id", id}, {"pid", d["pid"]},
                       {"tid", d.value("tid", 0)}, {"ts", inside(d)}});
      ++a, ++b;
    }
    r.unmatched_sends += int64_t(sv.size() - a);
    r.unmatched_recvs += int64_t(rv.size() - b);
  }
  for (auto& [k, rv] : recvs)
    if (!sends.count(k)) r.unmatched_recvs += int64_t(rv.size());
  r.flows = id;
  for (auto& f : flows) events.push_back(std::move(f));
  json meta = {{"format", "moetron-trace-merged"},
               {"version", 1},
               {"world", world},
               {"ranks", meta_ranks},
               {"groups", groups},
               {"flows", r.flows},
               {"unmatched_sends", r.unmatched_sends},
               {"unmatched_recvs", r.unmatched_recvs}};
  if (ranks[0]["moetron"].contains("config")) meta["config"] = ranks[0]["moetron"]["config"];
  r.trace = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}, {"moetron", std::move(meta)}};
  return r;
}

MergeResult merge_trace_dir(const std::string& dir) {
  const std::vector<std::string> files = rank_trace_files(dir);
  std::vector<json> ranks;
  for (const auto& f : files) ranks.push_back(read_rank_trace(f));
  return merge_traces(ranks, files);
}

}  // namespace moetron::tracefile
