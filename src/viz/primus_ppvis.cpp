// primus_ppvis.cpp: reads and writes Primus's pp_vis dump (DIR/config.json and DIR/pp_rank_<r>.json, per
// iteration the per-rank fwd/bwd/wgrad start and end times in ms, optionally each event's micro-batch and
// chunk) as a pp_vis Timeline. Every malformed dump is refused with the file and field named. Not the
// renderer (ppvis.cpp) and not Primus's tool (tools/visualization/pp_vis/vis.py in AMD-AGI/Primus): the
// layout was learned from its dumps and its reader, the code is moetron's.
//
// Reading. Events without micro-batch/chunk lists are numbered in Megatron's order: with one chunk in
// execution order; with V chunks per rank, forward event k runs chunk (k / pp) mod V and micro-batch
// (k / (pp V)) pp + k mod pp, backward event k the same micro-batch on chunk V - 1 - (k / pp) mod V. A "bwd"
// event is an input-gradient-only backward (I) when the rank has a "wgrad" event for the same chunk and
// micro-batch that is not a placeholder (below), and a full backward (B) otherwise; "wgrad" holds 0 to
// vp_size * num_mbs events (moetron's older exports and Primus's simulator write one only for split
// backwards), and fewer than all need their id lists. Without the field "bwd_pair_fwd", a fwd and a bwd event
// with the same start and end are the two halves of one overlapped F&B action (Primus's training dumps record
// a combined forward-backward step that way). Stage ids follow the loop placement (chunk c of rank r is stage
// c pp + r) unless config.json names a V-shaped schedule.
//
// Writing, for Primus's tool. The tool takes a rank's busy time as the plain sum of its fwd, bwd and wgrad
// event lengths over indices 0 .. vp_size * num_mbs - 1, so it needs (a) fwd and bwd lists of that length,
// (b) wgrad lists that are empty on every rank or of that length on every rank (it decides from rank 0
// whether to draw wgrad, then indexes every rank's list), and (c) no time counted twice. moetron therefore
// writes:
//  - every series with all its ids (micro-batch from 0, chunk);
//  - an F&B action (two fused blocks sharing [s, e]) as a fwd event [s, (s + e) / 2] and a bwd event
//    [(s + e) / 2, e], so the two halves add up to the action's span once and are drawn side by side; the
//    per-bwd-event list "bwd_pair_fwd" (index of the paired fwd event, -1 for none) lets the reader restore
//    both halves to [s, e]. With the field present, only the listed events are pairs;
//  - when any rank has a W, on every rank one wgrad event per backward: the W of each split backward (I), and
//    for each full backward (B) a zero-length placeholder at the B's end, which adds nothing to the tool's
//    sums. The per-wgrad-event list "wgrad_placeholder" (1 placeholder, 0 real W) tells the reader to drop
//    placeholders, so their bwd events stay B. Without any W, the wgrad lists are empty.
// Both fields are moetron's; Primus's tool ignores keys it does not know. Its bubble per rank, 1 - (sum of
// event lengths) / max "total", then equals moetron's 1 - busy / step time for every schedule moetron
// generates, since a rank's blocks do not overlap except for the halves of an F&B action.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "moetron/check.h"
#include "viz/ppvis.h"

namespace moetron::viz {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// moetron's own per-iteration fields (see the file comment); Primus's tool ignores them.
constexpr const char* kPairKey = "bwd_pair_fwd";
constexpr const char* kPlaceholderKey = "wgrad_placeholder";

json load_json(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  MT_CHECK(f.good(), "pp_vis", path.string(), ": cannot open (missing file?)");
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    MT_FAIL("pp_vis", path.string(), ": not valid JSON: ", e.what());
  }
}

std::string show(const json& v) {
  std::string s = v.dump();
  return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

// A positive integer config key; `alt` is the other spelling Primus uses.
int config_int(const json& cfg, const fs::path& path, const char* key, const char* alt, int64_t max) {
  const char* used = key;
  if (!cfg.contains(key) && alt && cfg.contains(alt)) used = alt;
  MT_CHECK(cfg.contains(used), "pp_vis", path.string(), ": field '", key, "'",
           alt ? std::string(" (or '") + alt + "')" : std::string(), " is missing");
  const json& v = cfg[used];
  MT_CHECK(v.is_number_integer(), "pp_vis", path.string(), ": field '", used, "' = ", show(v),
           " is not an integer");
  const int64_t x = v.get<int64_t>();
  MT_CHECK(x >= 1 && x <= max, "pp_vis", path.string(), ": field '", used, "' = ", x, " must be in 1..", max);
  return int(x);
}

struct Events {
  std::vector<double> start, end;
  std::vector<int> mb, chunk;
};

// One event series ("fwd", "bwd" or "wgrad") of one rank's iteration, checked. fwd and bwd have exactly
// `want` events; wgrad (`optional`) may be missing or hold up to `want`.
Events read_series(const json& it, const std::string& where, const std::string& series, size_t want,
                   bool optional, int vpp, int mbs) {
  Events e;
  auto numbers = [&](const std::string& key, std::vector<double>& out) {
    if (!it.contains(key) || it[key].is_null()) {
      MT_CHECK(optional, "pp_vis", where, ": field '", key, "' is missing");
      return;
    }
    const json& a = it[key];
    MT_CHECK(a.is_array(), "pp_vis", where, ": field '", key, "' = ", show(a), " is not a list");
    for (size_t i = 0; i < a.size(); ++i) {
      MT_CHECK(a[i].is_number(), "pp_vis", where, ": field '", key, "'[", i, "] = ", show(a[i]),
               " is not a number");
      const double v = a[i].get<double>();
      MT_CHECK(std::isfinite(v) && v >= 0, "pp_vis", where, ": field '", key, "'[", i, "] = ", v,
               " must be a finite time >= 0 (ms from the iteration's start)");
      out.push_back(v);
    }
  };
  numbers(series + "_start", e.start);
  numbers(series + "_end", e.end);
  MT_CHECK(e.start.size() == e.end.size(), "pp_vis", where, ": field '", series, "_start' has ", e.start.size(),
           " entries but '", series, "_end' has ", e.end.size());
  if (optional && e.start.empty()) return e;
  MT_CHECK(optional ? e.start.size() <= want : e.start.size() == want, "pp_vis", where, ": field '", series,
           "_start' has ", e.start.size(), " entries; ", optional ? "at most " : "", "vp_size * num_mbs = ", want,
           " expected");
  for (size_t i = 0; i < e.start.size(); ++i)
    MT_CHECK(e.end[i] >= e.start[i], "pp_vis", where, ": field '", series, "_end'[", i, "] = ", e.end[i],
             " is before '", series, "_start'[", i, "] = ", e.start[i]);
  auto ids = [&](const std::string& key, std::vector<int>& out, int limit) {
    if (!it.contains(key) || it[key].is_null() || (it[key].is_array() && it[key].empty())) return;
    const json& a = it[key];
    MT_CHECK(a.is_array(), "pp_vis", where, ": field '", key, "' = ", show(a), " is not a list");
    MT_CHECK(a.size() == e.start.size(), "pp_vis", where, ": field '", key, "' has ", a.size(), " entries; ",
             e.start.size(), " expected (one per '", series, "_start' entry)");
    for (size_t i = 0; i < a.size(); ++i) {
      MT_CHECK(a[i].is_number_integer(), "pp_vis", where, ": field '", key, "'[", i, "] = ", show(a[i]),
               " is not an integer");
      const int64_t v = a[i].get<int64_t>();
      MT_CHECK(v >= 0 && v < limit, "pp_vis", where, ": field '", key, "'[", i, "] = ", v, " outside 0..",
               limit - 1);
      out.push_back(int(v));
    }
  };
  ids(series + "_minibatch", e.mb, mbs);
  ids(series + "_chunk", e.chunk, vpp);
  return e;
}

// Megatron's event order for dumps without micro-batch/chunk lists (see the file comment).
void infer_ids(Events& e, const std::string& where, const std::string& series, int pp, int vpp, int mbs) {
  const size_t n = e.start.size();
  if (!e.mb.empty() && !e.chunk.empty()) return;
  MT_CHECK(n == size_t(vpp) * size_t(mbs), "pp_vis", where, ": fields '", series, "_minibatch' and '", series,
           "_chunk' are needed: '", series, "_start' has ", n, " of vp_size * num_mbs = ", size_t(vpp) * mbs,
           " events, so Megatron's event order does not say which is which");
  MT_CHECK(vpp == 1 || mbs % pp == 0, "pp_vis", where, ": fields '", series, "_minibatch' and '", series,
           "_chunk' are needed: without them the event order is Megatron's, which for vp_size = ", vpp,
           " needs num_mbs = ", mbs, " divisible by pp_size = ", pp);
  const bool fwd = series == "fwd";
  std::vector<int> mb(n), chunk(n);
  for (size_t k = 0; k < n; ++k) {
    if (vpp == 1) {
      mb[k] = int(k);
      chunk[k] = 0;
      continue;
    }
    const int64_t g = int64_t(k) / (int64_t(pp) * vpp), in = int64_t(k) % (int64_t(pp) * vpp);
    const int c = int(in / pp);
    mb[k] = int(g * pp + in % pp);
    chunk[k] = fwd ? c : vpp - 1 - c;
  }
  if (e.mb.empty()) e.mb = std::move(mb);
  if (e.chunk.empty()) e.chunk = std::move(chunk);
}

// The F&B pairs of one rank: for each bwd event the index of the fwd event that is the other half of its
// action, or -1. With the field 'bwd_pair_fwd' (moetron's dumps) the pairs are the listed ones and the two
// halves of each must meet; without it (Primus's dumps) a fwd and a bwd event with identical start and end
// are a pair.
std::vector<int> read_pairs(const json& it, const std::string& where, const Events& f, const Events& b) {
  std::vector<int> pair(b.start.size(), -1);
  if (!it.contains(kPairKey) || it[kPairKey].is_null()) {
    std::multimap<std::pair<double, double>, size_t> bwd_at;
    for (size_t j = 0; j < b.start.size(); ++j) bwd_at.emplace(std::pair{b.start[j], b.end[j]}, j);
    for (size_t i = 0; i < f.start.size(); ++i) {
      auto hit = bwd_at.find({f.start[i], f.end[i]});
      if (hit == bwd_at.end()) continue;
      pair[hit->second] = int(i);
      bwd_at.erase(hit);
    }
    return pair;
  }
  const json& a = it[kPairKey];
  MT_CHECK(a.is_array(), "pp_vis", where, ": field '", kPairKey, "' = ", show(a), " is not a list");
  MT_CHECK(a.size() == b.start.size(), "pp_vis", where, ": field '", kPairKey, "' has ", a.size(), " entries; ",
           b.start.size(), " expected (one per 'bwd_start' entry)");
  std::vector<int> owner(f.start.size(), -1);
  for (size_t j = 0; j < a.size(); ++j) {
    MT_CHECK(a[j].is_number_integer(), "pp_vis", where, ": field '", kPairKey, "'[", j, "] = ", show(a[j]),
             " is not an integer");
    const int64_t v = a[j].get<int64_t>();
    MT_CHECK(v >= -1 && v < int64_t(f.start.size()), "pp_vis", where, ": field '", kPairKey, "'[", j, "] = ", v,
             " outside -1..", int64_t(f.start.size()) - 1);
    if (v < 0) continue;
    const size_t i = size_t(v);
    MT_CHECK(owner[i] < 0, "pp_vis", where, ": field '", kPairKey, "'[", j, "] = ", v, ": fwd event ", v,
             " is already paired with bwd event ", owner[i]);
    MT_CHECK(f.end[i] == b.start[j], "pp_vis", where, ": field '", kPairKey, "'[", j, "] = ", v, ": 'fwd_end'[",
             v, "] = ", f.end[i], " differs from 'bwd_start'[", j, "] = ", b.start[j],
             " (the halves of an F&B action meet)");
    owner[i] = int(j);
    pair[j] = int(v);
  }
  return pair;
}

// Which wgrad events are placeholders for full backwards (field 'wgrad_placeholder', moetron's dumps); each
// has zero length. Without the field, none is. (Its bwd event exists: bwd holds every chunk and micro-batch.)
std::vector<bool> read_placeholders(const json& it, const std::string& where, const Events& w) {
  std::vector<bool> out(w.start.size(), false);
  if (!it.contains(kPlaceholderKey) || it[kPlaceholderKey].is_null()) return out;
  const json& a = it[kPlaceholderKey];
  MT_CHECK(a.is_array(), "pp_vis", where, ": field '", kPlaceholderKey, "' = ", show(a), " is not a list");
  MT_CHECK(a.size() == w.start.size(), "pp_vis", where, ": field '", kPlaceholderKey, "' has ", a.size(),
           " entries; ", w.start.size(), " expected (one per 'wgrad_start' entry)");
  for (size_t i = 0; i < a.size(); ++i) {
    MT_CHECK(a[i].is_number_integer() && (a[i].get<int64_t>() == 0 || a[i].get<int64_t>() == 1), "pp_vis", where,
             ": field '", kPlaceholderKey, "'[", i, "] = ", show(a[i]), " is not 0 or 1");
    if (a[i].get<int64_t>() == 0) continue;
    MT_CHECK(w.end[i] == w.start[i], "pp_vis", where, ": field '", kPlaceholderKey, "'[", i,
             "] = 1 but 'wgrad_start'[", i, "] = ", w.start[i], " and 'wgrad_end'[", i, "] = ", w.end[i],
             " (a placeholder has zero length)");
    out[i] = true;
  }
  return out;
}

}  // namespace

Timeline read_primus(const std::string& dir_text, int iteration) {
  const fs::path dir(dir_text);
  MT_CHECK(fs::is_directory(dir), "pp_vis", "--primus ", dir_text, ": not a directory");
  const fs::path cfg_path = dir / "config.json";
  const json cfg = load_json(cfg_path);
  MT_CHECK(cfg.is_object(), "pp_vis", cfg_path.string(), ": not a JSON object");
  Timeline t;
  t.pp = config_int(cfg, cfg_path, "pp_size", nullptr, 4096);
  t.vpp = config_int(cfg, cfg_path, "vp_size", "vpp_size", 1024);
  t.microbatches = config_int(cfg, cfg_path, "num_mbs", "micro_batches", 1 << 20);
  MT_CHECK(int64_t(t.pp) * t.vpp * t.microbatches <= sched::kMaxComputeActions, "pp_vis", cfg_path.string(),
           ": pp_size * vp_size * num_mbs = ", int64_t(t.pp) * t.vpp * t.microbatches, " is beyond ",
           sched::kMaxComputeActions);
  for (const char* key : {"schedule", "time_unit"})
    if (cfg.contains(key))
      MT_CHECK(cfg[key].is_string(), "pp_vis", cfg_path.string(), ": field '", key, "' = ", show(cfg[key]),
               " is not a string");
  t.schedule = cfg.value("schedule", std::string());
  t.unit = cfg.value("time_unit", std::string("ms"));
  const bool v_shape = !t.schedule.empty() && sched::is_v_shape(t.schedule);
  MT_CHECK(!v_shape || t.vpp == 2, "pp_vis", cfg_path.string(), ": schedule '", t.schedule,
           "' is V-shaped but vp_size = ", t.vpp, " (2 expected)");

  std::vector<json> files(size_t(t.pp));
  std::vector<fs::path> paths(size_t(t.pp));
  for (int r = 0; r < t.pp; ++r) {
    paths[size_t(r)] = dir / ("pp_rank_" + std::to_string(r) + ".json");
    files[size_t(r)] = load_json(paths[size_t(r)]);
    MT_CHECK(files[size_t(r)].is_object() && !files[size_t(r)].empty(), "pp_vis", paths[size_t(r)].string(),
             ": expected an object of iterations, {\"<iteration>\": {...}}");
  }
  if (iteration < 0) {
    for (const auto& [key, v] : files[0].items()) {
      size_t used = 0;
      int64_t k = -1;
      try {
        k = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      MT_CHECK(used == key.size() && k >= 0 && k <= (int64_t(1) << 30), "pp_vis", paths[0].string(),
               ": iteration key '", key, "' is not a non-negative integer");
      iteration = std::max(iteration, int(k));
    }
  }
  const std::string it_key = std::to_string(iteration);
  const size_t n = size_t(t.vpp) * size_t(t.microbatches);
  double latest = 0;
  t.ranks.resize(size_t(t.pp));
  for (int r = 0; r < t.pp; ++r) {
    const std::string file = paths[size_t(r)].string();
    MT_CHECK(files[size_t(r)].contains(it_key), "pp_vis", file, ": iteration '", it_key, "' is missing");
    const json& it = files[size_t(r)][it_key];
    const std::string where = file + ": iteration '" + it_key + "'";
    MT_CHECK(it.is_object(), "pp_vis", where, " is ", show(it), ", not an object");
    RankRow& row = t.ranks[size_t(r)];
    row.rank = r;
    for (const char* key : {"total", "memory"}) {
      if (!it.contains(key) || it[key].is_null()) continue;
      MT_CHECK(it[key].is_number() && std::isfinite(it[key].get<double>()) && it[key].get<double>() >= 0,
               "pp_vis", where, ": field '", key, "' = ", show(it[key]), " is not a number >= 0");
      if (std::string(key) == "total") latest = std::max(latest, it[key].get<double>());
      else row.memory = it[key].get<double>();
    }
    Events f = read_series(it, where, "fwd", n, false, t.vpp, t.microbatches);
    Events b = read_series(it, where, "bwd", n, false, t.vpp, t.microbatches);
    Events w = read_series(it, where, "wgrad", n, true, t.vpp, t.microbatches);
    infer_ids(f, where, "fwd", t.pp, t.vpp, t.microbatches);
    infer_ids(b, where, "bwd", t.pp, t.vpp, t.microbatches);
    if (!w.start.empty()) infer_ids(w, where, "wgrad", t.pp, t.vpp, t.microbatches);
    // Each (chunk, micro-batch) exactly once per series: n events over n distinct keys.
    const std::pair<const char*, const Events*> all[] = {{"fwd", &f}, {"bwd", &b}, {"wgrad", &w}};
    for (const auto& [series, ev] : all) {
      std::map<std::pair<int, int>, size_t> seen;
      for (size_t i = 0; i < ev->start.size(); ++i) {
        auto [pos, fresh] = seen.emplace(std::pair{ev->chunk[i], ev->mb[i]}, i);
        MT_CHECK(fresh, "pp_vis", where, ": ", series, " events ", pos->second, " and ", i, " are both chunk ",
                 ev->chunk[i], " micro-batch ", ev->mb[i]);
      }
    }
    const auto stage_of = [&](int chunk) {
      return v_shape ? (chunk == 0 ? r : 2 * t.pp - 1 - r) : chunk * t.pp + r;
    };
    // F&B pairs (both halves span the action: the fwd's start to the bwd's end) and wgrad placeholders.
    const std::vector<int> pair = read_pairs(it, where, f, b);
    const std::vector<bool> placeholder = read_placeholders(it, where, w);
    std::vector<int> fwd_pair(f.start.size(), -1);
    for (size_t j = 0; j < pair.size(); ++j)
      if (pair[j] >= 0) fwd_pair[size_t(pair[j])] = int(j);
    std::set<std::pair<int, int>> split;  // (chunk, mb) with a wgrad event that is not a placeholder: bwd is I
    for (size_t i = 0; i < w.start.size(); ++i)
      if (!placeholder[i]) split.insert({w.chunk[i], w.mb[i]});
    for (size_t i = 0; i < f.start.size(); ++i) {
      const int j = fwd_pair[i];
      const double end = j >= 0 ? b.end[size_t(j)] : f.end[i];
      row.blocks.push_back({Kind::F, stage_of(f.chunk[i]), f.chunk[i], f.mb[i], f.start[i], end, j >= 0});
    }
    for (size_t j = 0; j < b.start.size(); ++j) {
      const Kind k = split.count({b.chunk[j], b.mb[j]}) ? Kind::I : Kind::B;
      const double start = pair[j] >= 0 ? f.start[size_t(pair[j])] : b.start[j];
      row.blocks.push_back({k, stage_of(b.chunk[j]), b.chunk[j], b.mb[j], start, b.end[j], pair[j] >= 0});
    }
    for (size_t i = 0; i < w.start.size(); ++i)
      if (!placeholder[i])
        row.blocks.push_back({Kind::W, stage_of(w.chunk[i]), w.chunk[i], w.mb[i], w.start[i], w.end[i], false});
    std::stable_sort(row.blocks.begin(), row.blocks.end(), [](const Block& x, const Block& y) {
      return x.start != y.start ? x.start < y.start : int(x.kind) < int(y.kind);
    });
    for (const Block& blk : row.blocks) latest = std::max(latest, blk.end);
  }
  t.step_time = latest;
  t.title = !t.schedule.empty() ? t.schedule : dir.filename().empty() ? dir.parent_path().filename().string()
                                                                       : dir.filename().string();
  t.source = "Primus pp_vis dump " + dir_text + ", iteration " + it_key;
  derive_stats(t);
  check_timeline(t);
  return t;
}

namespace {

// One event of the dump being written. `pair`: for a bwd event, the index of the fwd event that is the other
// half of its F&B action (-1: none). `placeholder`: a zero-length wgrad event standing for a full backward.
struct OutEvent {
  double start = 0, end = 0;
  int mb = 0, chunk = 0;
  int pair = -1;
  bool placeholder = false;
};

struct RankEvents {
  std::vector<OutEvent> fwd, bwd, wgrad;
};

std::string block_name(int rank, const Block& b) {
  return "rank " + std::to_string(rank) + " block '" + std::to_string(b.stage) + kind_name(b.kind) +
         std::to_string(b.mb) + "'";
}

// For each fused block the index of its other half (a fused F and a fused B or I with the same start and end);
// -1 for blocks that are not fused. Refuses a fused block without a partner.
std::vector<int> fused_partners(const RankRow& row) {
  std::vector<int> partner(row.blocks.size(), -1);
  std::multimap<std::pair<double, double>, size_t> open_f;
  for (size_t i = 0; i < row.blocks.size(); ++i) {
    const Block& b = row.blocks[i];
    if (b.fused && b.kind == Kind::F) open_f.emplace(std::pair{b.start, b.end}, i);
  }
  for (size_t i = 0; i < row.blocks.size(); ++i) {
    const Block& b = row.blocks[i];
    if (!b.fused || b.kind == Kind::F) continue;
    auto hit = open_f.find({b.start, b.end});
    MT_CHECK(b.kind != Kind::W && hit != open_f.end(), "pp_vis", "--export-primus: ", block_name(row.rank, b),
             " [", b.start, ", ", b.end, "] is marked fused but has no fused F with the same times");
    partner[i] = int(hit->second);
    partner[hit->second] = int(i);
    open_f.erase(hit);
  }
  for (const auto& [times, i] : open_f)
    MT_FAIL("pp_vis", "--export-primus: ", block_name(row.rank, row.blocks[i]), " [", times.first, ", ",
            times.second, "] is marked fused but has no fused B or I with the same times");
  return partner;
}

// One rank's events in the form Primus's tool sums and draws correctly (see the file comment): an F&B
// action's span split at its midpoint, F first; with `complete_wgrad`, a zero-length wgrad placeholder at the
// end of every full backward. wgrad events in start order.
RankEvents rank_events(const RankRow& row, bool complete_wgrad) {
  const std::vector<int> partner = fused_partners(row);
  std::vector<int> fwd_index(row.blocks.size(), -1);
  RankEvents ev;
  const auto mid = [](const Block& b) { return b.start + (b.end - b.start) / 2; };
  for (size_t i = 0; i < row.blocks.size(); ++i) {
    const Block& b = row.blocks[i];
    if (b.kind != Kind::F) continue;
    fwd_index[i] = int(ev.fwd.size());
    ev.fwd.push_back({b.start, b.fused ? mid(b) : b.end, b.mb, b.chunk});
  }
  for (size_t i = 0; i < row.blocks.size(); ++i) {
    const Block& b = row.blocks[i];
    if (b.kind == Kind::B || b.kind == Kind::I) {
      const int pair = b.fused ? fwd_index[size_t(partner[i])] : -1;
      ev.bwd.push_back({b.fused ? mid(b) : b.start, b.end, b.mb, b.chunk, pair});
      if (b.kind == Kind::B && complete_wgrad) ev.wgrad.push_back({b.end, b.end, b.mb, b.chunk, -1, true});
    } else if (b.kind == Kind::W) {
      ev.wgrad.push_back({b.start, b.end, b.mb, b.chunk});
    }
  }
  std::stable_sort(ev.wgrad.begin(), ev.wgrad.end(),
                   [](const OutEvent& x, const OutEvent& y) { return x.start < y.start; });
  return ev;
}

// The reader takes a bwd event for an I exactly when a wgrad event that is not a placeholder has its chunk and
// micro-batch, and every series must hold vp_size * num_mbs events (wgrad: all ranks or none).
void check_rank_events(const RankRow& row, const RankEvents& ev, size_t n, bool complete_wgrad) {
  std::set<std::pair<int, int>> split;
  for (const OutEvent& w : ev.wgrad)
    if (!w.placeholder) split.insert({w.chunk, w.mb});
  for (const Block& b : row.blocks)
    if (b.kind == Kind::B || b.kind == Kind::I)
      MT_CHECK((b.kind == Kind::I) == (split.count({b.chunk, b.mb}) > 0), "pp_vis", "--export-primus: ",
               block_name(row.rank, b), ": an I needs its W and a B has none");
  const std::pair<const char*, size_t> counts[] = {
      {"fwd", ev.fwd.size()}, {"bwd", ev.bwd.size()}, {"wgrad", ev.wgrad.size()}};
  for (const auto& [name, got] : counts) {
    const size_t want = std::string(name) != "wgrad" || complete_wgrad ? n : 0;
    MT_CHECK(got == want, "pp_vis", "--export-primus: rank ", row.rank, " has ", got, " ", name,
             std::string(name) == "wgrad" ? " events (W blocks and placeholders for B blocks)" : " blocks",
             "; the dump format needs ", want, std::string(name) == "wgrad" && want == 0 ? " (no rank has a W)" : "",
             want == n ? " = vp_size * num_mbs" : "");
  }
}

void put_series(json& it, const std::string& name, const std::vector<OutEvent>& ev) {
  json st = json::array(), en = json::array(), mb = json::array(), ch = json::array();
  for (const OutEvent& e : ev) {
    st.push_back(e.start);
    en.push_back(e.end);
    mb.push_back(e.mb);
    ch.push_back(e.chunk);
  }
  it[name + "_start"] = st;
  it[name + "_end"] = en;
  it[name + "_minibatch"] = mb;
  it[name + "_chunk"] = ch;
}

json rank_iteration(const Timeline& t, const RankRow& row, bool complete_wgrad) {
  const RankEvents ev = rank_events(row, complete_wgrad);
  check_rank_events(row, ev, size_t(t.vpp) * size_t(t.microbatches), complete_wgrad);
  json it = json::object();
  it["total"] = t.step_time;
  it["memory"] = row.memory >= 0 ? row.memory : t.peak_microbatches(row.rank);
  put_series(it, "fwd", ev.fwd);
  put_series(it, "bwd", ev.bwd);
  put_series(it, "wgrad", ev.wgrad);
  json pair = json::array(), placeholder = json::array();
  for (const OutEvent& e : ev.bwd) pair.push_back(e.pair);
  for (const OutEvent& e : ev.wgrad) placeholder.push_back(e.placeholder ? 1 : 0);
  it[kPairKey] = pair;
  it[kPlaceholderKey] = placeholder;
  return it;
}

}  // namespace

void write_primus(const Timeline& t, const std::string& dir_text) {
  check_timeline(t);
  const fs::path dir(dir_text);
  fs::create_directories(dir);
  bool any_w = false;
  for (const RankRow& row : t.ranks)
    for (const Block& b : row.blocks) any_w = any_w || b.kind == Kind::W;
  std::vector<json> rank_docs;
  for (const RankRow& row : t.ranks) {
    json doc = json::object();
    doc["0"] = rank_iteration(t, row, any_w);  // iteration "0", as Primus's simulator writes
    rank_docs.push_back(doc);
  }
  json cfg = {{"pp_size", t.pp}, {"vp_size", t.vpp}, {"num_mbs", t.microbatches}, {"time_unit", t.unit}};
  if (!t.schedule.empty()) cfg["schedule"] = t.schedule;
  auto write = [&](const fs::path& path, const json& doc) {
    std::ofstream f(path, std::ios::binary);
    MT_CHECK(f.good(), "pp_vis", "--export-primus: cannot write ", path.string());
    f << doc.dump(2) << "\n";
    f.close();
    MT_CHECK(f.good(), "pp_vis", "--export-primus: error writing ", path.string());
  };
  write(dir / "config.json", cfg);
  for (size_t r = 0; r < rank_docs.size(); ++r)
    write(dir / ("pp_rank_" + std::to_string(r) + ".json"), rank_docs[r]);
}

}  // namespace moetron::viz
