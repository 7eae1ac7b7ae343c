// primus_ppvis.cpp: reads and writes Primus's pp_vis dump (DIR/config.json and DIR/pp_rank_<r>.json, per
// iteration the per-rank fwd/bwd/wgrad start and end times in ms, optionally each event's micro-batch and
// chunk) as a pp_vis Timeline. Every malformed dump is refused with the file and field named. Not the
// renderer (ppvis.cpp) and not Primus's tool: the layout was learned from its dumps, the code is moetron's.
//
// Mapping. Events without micro-batch/chunk lists are numbered in Megatron's order: with one chunk in
// execution order; with V chunks per rank, forward event k runs chunk (k / pp) mod V and micro-batch
// (k / (pp V)) pp + k mod pp, backward event k the same micro-batch on chunk V - 1 - (k / pp) mod V. A "bwd"
// event is an input-gradient-only backward (I) when the rank has a "wgrad" event for the same chunk and
// micro-batch, and a full backward (B) otherwise; "wgrad" holds 0 to vp_size * num_mbs events (schedules like
// DualPipeV split only some backwards), and fewer than all need their id lists. A fwd and a bwd event with
// the same start and end are the two halves of one overlapped F&B action (Primus records combined
// forward-backward steps that way). Stage ids follow the loop placement (chunk c of rank r is stage
// c pp + r) unless config.json names a V-shaped schedule.
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
    // Overlapped F&B halves: a fwd and a bwd event with identical start and end.
    std::multimap<std::pair<double, double>, size_t> bwd_at;
    for (size_t i = 0; i < b.start.size(); ++i) bwd_at.emplace(std::pair{b.start[i], b.end[i]}, i);
    std::vector<bool> b_fused(b.start.size(), false), f_fused(f.start.size(), false);
    for (size_t i = 0; i < f.start.size(); ++i) {
      auto hit = bwd_at.find({f.start[i], f.end[i]});
      if (hit == bwd_at.end()) continue;
      f_fused[i] = b_fused[hit->second] = true;
      bwd_at.erase(hit);
    }
    std::set<std::pair<int, int>> split;  // (chunk, mb) with a wgrad event: their bwd is I
    for (size_t i = 0; i < w.start.size(); ++i) split.insert({w.chunk[i], w.mb[i]});
    for (size_t i = 0; i < f.start.size(); ++i)
      row.blocks.push_back({Kind::F, stage_of(f.chunk[i]), f.chunk[i], f.mb[i], f.start[i], f.end[i], f_fused[i]});
    for (size_t i = 0; i < b.start.size(); ++i) {
      const Kind k = split.count({b.chunk[i], b.mb[i]}) ? Kind::I : Kind::B;
      row.blocks.push_back({k, stage_of(b.chunk[i]), b.chunk[i], b.mb[i], b.start[i], b.end[i], b_fused[i]});
    }
    for (size_t i = 0; i < w.start.size(); ++i)
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

void write_primus(const Timeline& t, const std::string& dir_text) {
  check_timeline(t);
  const fs::path dir(dir_text);
  fs::create_directories(dir);
  const size_t n = size_t(t.vpp) * size_t(t.microbatches);
  std::vector<json> rank_docs;
  for (const RankRow& row : t.ranks) {
    json it = json::object();
    it["total"] = t.step_time;
    it["memory"] = row.memory >= 0 ? row.memory : t.peak_microbatches(row.rank);
    std::vector<const Block*> series[3];  // fwd, bwd, wgrad; blocks are already in start order
    for (const Block& b : row.blocks) series[b.kind == Kind::F ? 0 : b.kind == Kind::W ? 2 : 1].push_back(&b);
    const char* names[3] = {"fwd", "bwd", "wgrad"};
    // The reader takes a bwd event for I exactly when a wgrad event has its chunk and micro-batch.
    std::set<std::pair<int, int>> split;
    for (const Block* b : series[2]) split.insert({b->chunk, b->mb});
    for (const Block* b : series[1])
      MT_CHECK((b->kind == Kind::I) == (split.count({b->chunk, b->mb}) > 0), "pp_vis", "--export-primus: rank ",
               row.rank, " block '", b->stage, kind_name(b->kind), b->mb, "': an I needs its W and a B has none");
    for (int s = 0; s < 3; ++s) {
      MT_CHECK(s == 2 ? series[s].size() <= n : series[s].size() == n, "pp_vis", "--export-primus: rank ",
               row.rank, " has ", series[s].size(), " ", names[s], " blocks; the dump format needs ",
               s == 2 ? "at most " : "", "vp_size * num_mbs = ", n);
      json st = json::array(), en = json::array(), mb = json::array(), ch = json::array();
      for (const Block* b : series[s]) {
        st.push_back(b->start);
        en.push_back(b->end);
        mb.push_back(b->mb);
        ch.push_back(b->chunk);
      }
      const std::string name = names[s];
      it[name + "_start"] = st;
      it[name + "_end"] = en;
      it[name + "_minibatch"] = mb;
      it[name + "_chunk"] = ch;
    }
    json doc = json::object();
    doc["0"] = it;
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
