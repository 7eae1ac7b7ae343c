// flight.cpp: the analysis of flight-recorder dumps behind `moetron trace flight` (see tracefile/flight.h).
// Not the recorder (src/comm/flight_recorder.cpp).
#include "tracefile/flight.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "moetron/check.h"
#include "tracefile/fail.h"

namespace moetron::tracefile {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

template <class... A>
[[noreturn]] void fail(const A&... parts) {
  fail_tagged("[trace flight] ", parts...);
}

struct Rec {
  std::string kind, state;
  int64_t bytes = 0;
  double t_started = 0;
};

// Kinds whose size must be the same on every member (flight_recorder.h: the result size).
bool size_must_agree(const std::string& k) {
  return k == "all_reduce" || k == "reduce_scatter" || k == "all_gather" || k == "barrier";
}

std::string list(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

template <class T>
T field(const json& j, const char* key, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) fail(where, ": missing field \"", key, "\"");
  try {
    return j.at(key).get<T>();
  } catch (const json::exception& e) {
    fail(where, ": field \"", key, "\": ", e.what());
  }
}

}  // namespace

FlightAnalysis analyze_flight(const std::vector<json>& dumps) {
  FlightAnalysis a;
  // group -> members; group -> rank -> seq -> record; group -> rank -> highest seq
  std::map<std::string, std::vector<int>> members;
  std::map<std::string, std::map<int, std::map<int64_t, Rec>>> recs;
  std::vector<std::pair<int, std::string>> order;
  struct P2p {
    std::string group, kind, state;
    int peer, tag;
    int64_t msg, bytes;
  };
  std::map<int, std::vector<P2p>> p2p;  // world rank -> its point-to-point entries
  std::map<int, bool> busy;             // world rank -> inside an unfinished call
  for (const json& d : dumps) {
    const int rank = field<int>(d, "rank", "dump");
    const std::string where = "rank " + std::to_string(rank) + "'s dump";
    a.world_size = std::max(a.world_size, field<int>(d, "world_size", where));
    order.emplace_back(rank, field<std::string>(d, "reason", where));
    const json groups = field<json>(d, "groups", where);
    if (!groups.is_object()) fail(where, ": \"groups\" is not an object");
    for (const auto& [g, m] : groups.items()) {
      if (!m.is_array()) fail(where, ": groups.", g, " is not a list of ranks");
      members[g] = m.get<std::vector<int>>();
    }
    const json entries = field<json>(d, "entries", where);
    if (!entries.is_array()) fail(where, ": \"entries\" is not an array");
    for (size_t i = 0; i < entries.size(); ++i) {
      const json& e = entries[i];
      const std::string w = where + ", entries[" + std::to_string(i) + "]";
      const int64_t seq = field<int64_t>(e, "seq", w);
      const std::string g = field<std::string>(e, "group", w);
      recs[g][rank];  // the rank took part in the group, even if only in point-to-point
      const std::string state = field<std::string>(e, "state", w);
      busy[rank] = busy[rank] || state == "started";
      if (seq < 0) {
        if (e.contains("peer"))
          p2p[rank].push_back({g, field<std::string>(e, "kind", w), state, field<int>(e, "peer", w),
                               field<int>(e, "tag", w), field<int64_t>(e, "msg", w), field<int64_t>(e, "bytes", w)});
        continue;
      }
      recs[g][rank][seq] = {field<std::string>(e, "kind", w), field<std::string>(e, "state", w),
                            field<int64_t>(e, "bytes", w), field<double>(e, "t_started", w)};
    }
  }
  std::sort(order.begin(), order.end());
  for (auto& [r, why] : order) a.ranks.push_back(r), a.reasons.push_back(why);
  const std::set<int> have(a.ranks.begin(), a.ranks.end());

  for (auto& [g, by_rank] : recs) {
    const std::vector<int>& mem = members[g];
    // disagreements on one (group, seq)
    std::set<int64_t> seqs;
    for (auto& [r, m] : by_rank)
      for (auto& [s, rec] : m) seqs.insert(s);
    for (int64_t s : seqs) {
      FlightMismatch mm{g, s, {}};
      std::set<std::string> kinds;
      std::set<int64_t> sizes;
      for (auto& [r, m] : by_rank) {
        auto it = m.find(s);
        if (it == m.end()) continue;
        mm.sides.push_back({r, it->second.kind, it->second.bytes});
        kinds.insert(it->second.kind);
        if (size_must_agree(it->second.kind)) sizes.insert(it->second.bytes);
      }
      if (kinds.size() > 1 || sizes.size() > 1) a.mismatches.push_back(std::move(mm));
    }
    // the lowest seq started by some member and never scheduled by another (its highest seq is lower)
    for (int64_t s : seqs) {
      FlightMissing fm;
      fm.group = g, fm.seq = s;
      for (auto& [r, m] : by_rank) {
        auto it = m.find(s);
        if (it != m.end()) {
          fm.started.push_back(r), fm.kind = it->second.kind, fm.bytes = it->second.bytes;
          if (fm.t_started == 0 || it->second.t_started < fm.t_started) fm.t_started = it->second.t_started;
        } else if (m.empty() || m.rbegin()->first < s) {
          fm.absent.push_back(r);
        }
      }
      for (int r : mem)
        if (!have.count(r)) fm.no_dump.push_back(r);
        else if (!by_rank.count(r)) fm.absent.push_back(r);  // dumped, never used this group in its window
      std::sort(fm.absent.begin(), fm.absent.end());
      if (!fm.started.empty() && (!fm.absent.empty() || !fm.no_dump.empty())) {
        a.missing.push_back(std::move(fm));
        break;
      }
    }
  }
  // point-to-point: a waiting receive against the sender's sends to it on the same group, tag and index
  for (auto& [r, list] : p2p)
    for (const P2p& e : list) {
      if (e.kind != "recv" || e.state != "started") continue;
      const std::vector<int>& mem = members[e.group];
      if (e.peer < 0 || e.peer >= int(mem.size())) continue;
      const int sender = mem[size_t(e.peer)];
      const auto me = std::find(mem.begin(), mem.end(), r);
      const int my_index = int(me - mem.begin());
      FlightUnsent u{e.group, r, sender, e.tag, e.msg, e.bytes, have.count(sender) > 0};
      bool posted = false;
      for (const P2p& x : p2p[sender])
        posted = posted || (x.kind == "send" && x.group == e.group && x.peer == my_index && x.tag == e.tag && x.msg == e.msg);
      if (!posted) a.unsent.push_back(u);
    }
  for (int r : a.ranks)
    if (!busy[r]) a.idle.push_back(r);
  std::sort(a.missing.begin(), a.missing.end(),
            [](const FlightMissing& x, const FlightMissing& y) { return x.t_started < y.t_started; });
  return a;
}

FlightAnalysis analyze_flight_dir(const std::string& dir) {
  if (!fs::is_directory(dir)) fail(dir, " is not a folder (the watchdog writes <dump_folder>/flight/rank<r>.json)");
  std::vector<json> dumps;
  for (const auto& d : fs::directory_iterator(dir)) {
    const std::string n = d.path().filename().string();
    if (n.rfind("rank", 0) != 0 || d.path().extension() != ".json") continue;
    std::ifstream f(d.path());
    try {
      dumps.push_back(json::parse(f));
    } catch (const json::exception& e) {
      fail(d.path().string(), ": not JSON: ", e.what());
    }
  }
  if (dumps.empty()) fail("no rank<r>.json in ", dir);
  return analyze_flight(dumps);
}

std::string FlightAnalysis::text() const {
  std::ostringstream os;
  os << "flight dumps of " << ranks.size() << " rank(s) (world size " << world_size << ")\n";
  for (size_t i = 0; i < ranks.size(); ++i) os << "  rank " << ranks[i] << ": " << reasons[i] << "\n";
  std::vector<int> none;
  for (int r = 0; r < world_size; ++r)
    if (!std::binary_search(ranks.begin(), ranks.end(), r)) none.push_back(r);
  if (!none.empty()) os << "  no dump from rank(s) " << list(none) << "\n";
  for (const FlightMismatch& m : mismatches) {
    os << "DISAGREE: " << m.group << " #" << m.seq << ":";
    for (const auto& s : m.sides) os << " rank " << s.rank << " " << s.kind << " " << s.bytes << " bytes;";
    os << "\n";
  }
  for (const FlightMissing& m : missing) {
    os << "NOT JOINED: " << m.kind << " #" << m.seq << " on " << m.group << " (" << m.bytes << " bytes), started by rank(s) "
       << list(m.started);
    if (!m.absent.empty()) os << "; never scheduled by rank(s) " << list(m.absent);
    if (!m.no_dump.empty()) os << "; no dump from member rank(s) " << list(m.no_dump);
    os << "\n";
  }
  for (const FlightUnsent& u : unsent) {
    os << "NOT SENT: rank " << u.receiver << " waits for message #" << u.msg << " (tag " << u.tag << ", " << u.bytes
       << " bytes) from rank " << u.sender << " on " << u.group << "; ";
    os << (u.sender_dumped ? "rank " + std::to_string(u.sender) + " never posted it" : "that rank wrote no dump") << "\n";
  }
  if (!idle.empty() && (!missing.empty() || !unsent.empty()))
    os << "rank(s) " << list(idle) << " were inside no communication call (computing, or delayed): start there\n";
  if (missing.empty() && mismatches.empty() && unsent.empty())
    os << "no collective that some ranks started and others never scheduled, no disagreement on kind or size, and "
          "no receive waiting for a message never sent\n";
  return os.str();
}

}  // namespace moetron::tracefile
