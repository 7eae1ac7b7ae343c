// test_ppvis.cpp: pp_vis (src/viz/): the timeline built from a timed schedule, its statistics against
// hand-derived numbers, the SVG (one rect per block with its label and colour class, labels dropped when a
// block is too narrow, axis ticks, a self-contained HTML page), and Primus pp_vis dumps: committed hand-written
// dumps read back to hand-computed blocks and bubbles, Megatron's event order for dumps without ids, export
// then import giving the same blocks for every generator, the export meeting what Primus's own pp_vis tool
// needs (complete or empty wgrad lists, F&B halves counted once, its bubbles equal to moetron's), moetron's
// earlier exports and the committed dumps reading as before, and every refusal of a bad dump naming file and
// field. The timed results come from a naive replay in this file (not simulate_timed). Not the browser check
// (tests/viz/check_ppvis_screenshot.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <tuple>
#include <unistd.h>

#include "moetron/check.h"
#include "moetron/schedule.h"
#include "viz/ppvis.h"
#include "../unit/test_util.h"

using namespace moetron;
using namespace moetron::viz;
namespace fs = std::filesystem;
using json = nlohmann::json;
using moetron::testing::error_of;

namespace {

std::vector<sched::Action> halves(const sched::Action& a) {
  if (a.op == sched::Op::FB) return {sched::fwd_half(a), sched::bwd_half(a)};
  return {a};
}

// Naive replay of an unlowered schedule: each rank runs its list in order; an action starts when the rank is
// free and its inputs are done (F after the previous stage's F, B/I after its F and the next stage's B/I, W
// after its I). F costs f, I costs i, W costs w, B costs i + w, an FB action the sum of its halves. Fills
// ops, step time, busy, bubble and peak in-flight (at each F start, the sets whose F has started and whose
// last backward ends later).
sched::TimedResult replay(const sched::Schedule& s, double f, double i, double w) {
  using sched::Op;
  sched::TimedResult out;
  std::map<std::tuple<int, int, int>, double> end;  // (0 F / 1 B,I / 2 B,W), stage, mb -> end
  std::vector<size_t> pos(size_t(s.pp), 0);
  std::vector<double> free_at(size_t(s.pp), 0);
  auto cost = [&](const sched::Action& a) {
    return a.op == Op::F ? f : a.op == Op::B ? i + w : a.op == Op::I ? i : w;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.pp; ++r) {
      const auto& row = s.actions[size_t(r)];
      while (pos[size_t(r)] < row.size()) {
        const sched::Action& a = row[pos[size_t(r)]];
        double at = free_at[size_t(r)];
        bool ok = true;
        for (const auto& h : halves(a)) {
          auto need = [&](int k, int st) {
            auto it = end.find({k, st, h.mb});
            if (it == end.end()) return false;
            at = std::max(at, it->second);
            return true;
          };
          if (h.op == Op::F) ok = ok && (h.stage == 0 || need(0, h.stage - 1));
          else if (h.op == Op::W) ok = ok && need(1, h.stage);
          else ok = ok && need(0, h.stage) && (h.stage == s.n_stages - 1 || need(1, h.stage + 1));
        }
        if (!ok) break;
        double d = 0;
        for (const auto& h : halves(a)) d += cost(h);
        out.ops.push_back({r, int(pos[size_t(r)]), a, at, at + d});
        for (const auto& h : halves(a)) {
          if (h.op != Op::W) end[{h.op == Op::F ? 0 : 1, h.stage, h.mb}] = at + d;
          if (h.op == Op::B || h.op == Op::W) end[{2, h.stage, h.mb}] = at + d;
        }
        free_at[size_t(r)] = at + d;
        ++pos[size_t(r)];
        progress = true;
      }
    }
  }
  for (int r = 0; r < s.pp; ++r) EXPECT_EQ(pos[size_t(r)], s.actions[size_t(r)].size()) << "deadlock";
  for (const auto& op : out.ops) out.step_time = std::max(out.step_time, op.end);
  double busy_all = 0;
  for (int r = 0; r < s.pp; ++r) {
    sched::RankStats st;
    st.rank = r;
    std::vector<const sched::TimedOp*> mine;
    for (const auto& op : out.ops)
      if (op.rank == r) {
        mine.push_back(&op);
        st.busy += op.end - op.start;
      }
    // Live at time t: F started by t, and the set's final backward (B or W) ends after t.
    for (const auto* op : mine)
      for (const auto& h : halves(op->action)) {
        if (h.op != Op::F) continue;
        const double t = op->start;
        int held = 0;
        for (const auto* o2 : mine)
          for (const auto& h2 : halves(o2->action))
            if (h2.op == Op::F && o2->start <= t && end.at({2, h2.stage, h2.mb}) > t) ++held;
        st.peak_inflight = std::max(st.peak_inflight, held);
      }
    st.bubble_ratio = 1 - st.busy / out.step_time;
    busy_all += st.busy;
    out.ranks.push_back(st);
  }
  out.bubble_ratio = 1 - busy_all / (s.pp * out.step_time);
  return out;
}

sched::Schedule gen(const std::string& name, int pp, int vpp, int m) { return sched::generate({name, pp, vpp, m}); }

fs::path temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("moetron_ppvis_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_json(const fs::path& p, const json& j) { std::ofstream(p) << j.dump(1); }

const fs::path kData = fs::path(MOETRON_SOURCE_DIR) / "tests" / "data" / "ppvis";

// Blocks in the SVG: class, x, width, fill, tooltip, and the label that follows the rect (or "").
struct SvgBlock {
  std::string kind, chunk, fill, tip, label;
  double x = 0, width = 0;
};
std::vector<SvgBlock> svg_blocks(const std::string& svg) {
  static const std::regex rect(
      "<rect class=\"blk k-([FBIW]) c-([0-9]+)\" x=\"([-0-9.]+)\" y=\"[-0-9.]+\" width=\"([0-9.]+)\" "
      "height=\"[0-9.]+\" fill=\"(#[0-9a-f]{6})\"[^>]*><title>([^<]*)</title></rect>"
      "(<text class=\"lbl[^\"]*\" x=\"[0-9.]+\" y=\"[0-9.]+\">([0-9]+)</text>)?");
  std::vector<SvgBlock> out;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), rect); it != std::sregex_iterator(); ++it) {
    const auto& m = *it;
    out.push_back({m[1], m[2], m[5], m[6], m[8], std::stod(m[3]), std::stod(m[4])});
  }
  return out;
}

// What Primus's pp_vis tool (tools/visualization/pp_vis/vis.py in AMD-AGI/Primus) needs from a dump, and the
// bubbles it computes: per rank, fwd and bwd lists of vp_size * num_mbs events; wgrad lists empty on every
// rank or of that length on every rank (it decides from rank 0 whether to draw them, then indexes every
// rank's); id lists no longer than their series and chunk ids below vp_size; a "memory" number; and, since
// it sums event lengths, no two events of a rank overlapping. Its bubble is 1 - (sum of fwd, bwd and wgrad
// lengths) / (max "total" over ranks). `problems` names file, field and value for each violation.
struct ToolView {
  std::vector<std::string> problems;
  std::vector<double> bubble;  // ratio, as moetron's RankRow::bubble_ratio
};

ToolView primus_tool_view(const fs::path& dir) {
  ToolView v;
  const json cfg = json::parse(slurp(dir / "config.json"));
  const int pp = cfg.at("pp_size"), vp = cfg.contains("vp_size") ? cfg.at("vp_size") : cfg.at("vpp_size");
  const int mbs = cfg.contains("num_mbs") ? cfg.at("num_mbs") : cfg.at("micro_batches");
  const size_t n = size_t(vp) * size_t(mbs);
  std::vector<json> its;
  double iter_time = 0;
  for (int r = 0; r < pp; ++r) {
    its.push_back(json::parse(slurp(dir / ("pp_rank_" + std::to_string(r) + ".json"))).at("0"));
    iter_time = std::max(iter_time, its.back().at("total").get<double>());
  }
  const bool wgrad = !its[0].value("wgrad_start", json::array()).empty();
  for (int r = 0; r < pp; ++r) {
    const json& it = its[size_t(r)];
    const std::string file = "pp_rank_" + std::to_string(r) + ".json";
    auto problem = [&](const std::string& what) { v.problems.push_back(file + ": " + what); };
    if (!it.contains("memory") || !it["memory"].is_number()) problem("field 'memory' missing or not a number");
    std::vector<std::pair<double, double>> spans;
    double sum = 0;
    for (const std::string series : {"fwd", "bwd", "wgrad"}) {
      const json st = it.value(series + "_start", json::array()), en = it.value(series + "_end", json::array());
      const size_t want = series != "wgrad" || wgrad ? n : 0;
      if (st.size() != want || en.size() != want)
        problem("'" + series + "_start'/'" + series + "_end' have " + std::to_string(st.size()) + "/" +
                std::to_string(en.size()) + " entries; the tool indexes " + std::to_string(want) +
                (series == "wgrad" ? " (wgrad on rank 0: " + std::to_string(wgrad) + ")" : ""));
      for (const char* ids : {"_minibatch", "_chunk"}) {
        const json a = it.value(series + ids, json::array());
        if (a.size() > want) problem("'" + series + ids + "' has " + std::to_string(a.size()) + " entries");
        if (std::string(ids) == "_chunk")
          for (const json& c : a)
            if (c.get<int>() < 0 || c.get<int>() >= vp) problem("'" + series + "_chunk' holds " + c.dump());
      }
      for (size_t i = 0; i < std::min({st.size(), en.size(), want}); ++i) {
        spans.emplace_back(st[i].get<double>(), en[i].get<double>());
        sum += en[i].get<double>() - st[i].get<double>();
      }
    }
    std::sort(spans.begin(), spans.end());
    size_t overlaps = 0, first = 0;
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second - 1e-12 * iter_time && overlaps++ == 0) first = i;
    if (overlaps > 0)
      problem(std::to_string(overlaps) + " overlapping event pairs, the tool counts their time twice; first [" +
              std::to_string(spans[first - 1].first) + ", " + std::to_string(spans[first - 1].second) + "] and [" +
              std::to_string(spans[first].first) + ", " + std::to_string(spans[first].second) + "]");
    v.bubble.push_back((iter_time - sum) / iter_time);
  }
  return v;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += "\n  " + l;
  return out;
}

// Every schedule moetron generates, as `moetron viz pipeline` builds it: lowered, timed by simulate_timed with
// unequal F, B, W, P2P and all-to-all costs.
struct GenCase {
  std::string name;
  int pp, vpp, m;
  bool ep_overlap = false;
};
const std::vector<GenCase> kAllGenerators = {
    {"gpipe", 4, 1, 8},  {"1f1b", 4, 1, 8},     {"interleaved_1f1b", 4, 2, 8}, {"interleaved_1f1b", 3, 3, 6},
    {"interleaved_1f1b", 4, 2, 8, true},        {"zb1p", 4, 1, 8},             {"zbv", 4, 2, 8},
    {"zbv", 3, 2, 4},    {"dualpipev", 4, 2, 10}, {"dualpipev", 2, 2, 4}};

std::string label(const GenCase& c) {
  return c.name + (c.ep_overlap ? "+ep_overlap" : "") + " pp " + std::to_string(c.pp) + " vpp " +
         std::to_string(c.vpp) + " m " + std::to_string(c.m);
}

Timeline simulated(const GenCase& c) {
  sched::GenSpec g{c.name, c.pp, c.vpp, c.m};
  g.ep_overlap = c.ep_overlap;
  const sched::Schedule s = sched::lower(sched::generate(g));
  sched::Durations d = sched::Durations::uniform(s.n_stages, 1.25, 2.5, 1.125, 0.1);
  for (auto& st : d.stage) st.a2a_f = st.a2a_b = 0.375;
  return from_simulation(s, sched::simulate_timed(s, d), "test");
}

}  // namespace

TEST(PpVis, FromSimulationOneBlockPerComputeHalf) {
  for (const auto& [name, vpp] : std::vector<std::pair<std::string, int>>{
           {"1f1b", 1}, {"interleaved_1f1b", 2}, {"zb1p", 1}, {"zbv", 2}, {"dualpipev", 2}}) {
    const int pp = 4, m = name == "dualpipev" ? 10 : 8;
    const sched::Schedule s = gen(name, pp, vpp, m);
    sched::TimedResult r = replay(s, 1, 1, 1);
    r.ops.push_back({0, 999, {sched::Op::SEND_F, 0, 0}, 0, 0});  // communication is not drawn
    const Timeline t = from_simulation(s, r, "test");
    EXPECT_EQ(t.pp, pp);
    EXPECT_EQ(t.vpp, vpp);
    EXPECT_EQ(t.microbatches, m);
    EXPECT_EQ(t.step_time, r.step_time);
    for (int rk = 0; rk < pp; ++rk) {
      size_t halves_n = 0, fb = 0;
      for (const auto& a : s.actions[size_t(rk)]) {
        halves_n += halves(a).size();
        fb += a.op == sched::Op::FB;
      }
      const RankRow& row = t.ranks[size_t(rk)];
      ASSERT_EQ(row.blocks.size(), halves_n) << name << " rank " << rk;
      size_t fused = 0;
      for (const Block& b : row.blocks) {
        fused += b.fused;
        EXPECT_EQ(s.stage_rank[size_t(b.stage)], rk);
        // Chunk: loop placement puts stage c*pp + r as chunk c; V places stage r then 2pp-1-r.
        EXPECT_EQ(b.chunk, sched::is_v_shape(name) ? (b.stage == rk ? 0 : 1) : b.stage / pp) << name;
      }
      EXPECT_EQ(fused, 2 * fb);
      // The simulator's stats are carried over; recomputing them from the blocks gives the same numbers.
      EXPECT_EQ(row.peak_inflight, r.ranks[size_t(rk)].peak_inflight);
    }
    Timeline d = t;
    derive_stats(d);
    for (int rk = 0; rk < pp; ++rk) {
      EXPECT_NEAR(d.ranks[size_t(rk)].busy, r.ranks[size_t(rk)].busy, 1e-12) << name;
      EXPECT_NEAR(d.ranks[size_t(rk)].bubble_ratio, r.ranks[size_t(rk)].bubble_ratio, 1e-12) << name;
      EXPECT_EQ(d.ranks[size_t(rk)].peak_inflight, r.ranks[size_t(rk)].peak_inflight) << name << " " << rk;
    }
    EXPECT_NEAR(d.bubble_ratio, r.bubble_ratio, 1e-12);
  }
}

// The real simulator on lowered schedules: one block per compute half, and the busy time, bubble and peak
// in-flight recomputed from the blocks' times agree with what simulate_timed counted from the action order.
TEST(PpVis, SimulateTimedStatsAgreeWithBlocks) {
  for (const auto& [name, vpp] : std::vector<std::pair<std::string, int>>{
           {"gpipe", 1}, {"1f1b", 1}, {"interleaved_1f1b", 2}, {"zb1p", 1}, {"zbv", 2}, {"dualpipev", 2}}) {
    const int pp = 4, m = name == "dualpipev" ? 10 : 8;
    const sched::Schedule s = sched::lower(gen(name, pp, vpp, m));
    sched::Durations d = sched::Durations::uniform(s.n_stages, 1, 2, 1, 0.1);
    for (auto& c : d.stage) c.a2a_f = c.a2a_b = 0.25;
    const sched::TimedResult r = sched::simulate_timed(s, d);
    const Timeline t = from_simulation(s, r, "test");
    Timeline again = t;
    derive_stats(again);
    EXPECT_NEAR(again.step_time, r.step_time, 1e-9) << name;  // the last action of a step is compute
    for (int rk = 0; rk < pp; ++rk) {
      size_t n = 0;
      for (const auto& a : s.actions[size_t(rk)])
        if (sched::is_compute(a.op)) n += halves(a).size();
      EXPECT_EQ(t.ranks[size_t(rk)].blocks.size(), n) << name;
      EXPECT_EQ(t.ranks[size_t(rk)].peak_inflight, r.ranks[size_t(rk)].peak_inflight) << name;
      EXPECT_NEAR(again.ranks[size_t(rk)].busy, r.ranks[size_t(rk)].busy, 1e-9) << name << " rank " << rk;
      EXPECT_NEAR(again.ranks[size_t(rk)].bubble_ratio, r.ranks[size_t(rk)].bubble_ratio, 1e-9) << name;
      EXPECT_EQ(again.ranks[size_t(rk)].peak_inflight, r.ranks[size_t(rk)].peak_inflight) << name << " " << rk;
    }
    EXPECT_NEAR(again.bubble_ratio, r.bubble_ratio, 1e-9) << name;
  }
}

TEST(PpVis, DerivedStatsMatchHandNumbers) {
  Timeline t;
  t.pp = 2;
  t.vpp = 1;
  t.microbatches = 2;
  t.step_time = 8;
  t.ranks.resize(2);
  t.ranks[1].rank = 1;
  // rank 0: F0 [0,1] F1 [1,2] | B0 [3,5] B1 [5,7]: busy 6 of 8; both sets live from t=1 to t=5.
  t.ranks[0].blocks = {{Kind::F, 0, 0, 0, 0, 1}, {Kind::F, 0, 0, 1, 1, 2}, {Kind::B, 0, 0, 0, 3, 5},
                       {Kind::B, 0, 0, 1, 5, 7}};
  // rank 1: F0 [1,2], then F1 and I0 overlapped [2,4] (one FB action), W0 [4,5], I1 [5,6], W1 [6,7].
  // Busy 1 + 2 + 1 + 1 + 1 = 6 (the fused pair counts once). Sets: mb0 live 1..5, mb1 live 2..7: peak 2.
  t.ranks[1].blocks = {{Kind::F, 1, 0, 0, 1, 2},       {Kind::F, 1, 0, 1, 2, 4, true}, {Kind::I, 1, 0, 0, 2, 4, true},
                       {Kind::W, 1, 0, 0, 4, 5},       {Kind::I, 1, 0, 1, 5, 6},       {Kind::W, 1, 0, 1, 6, 7}};
  derive_stats(t);
  EXPECT_DOUBLE_EQ(t.ranks[0].busy, 6);
  EXPECT_DOUBLE_EQ(t.ranks[0].bubble_ratio, 0.25);
  EXPECT_EQ(t.ranks[0].peak_inflight, 2);
  EXPECT_DOUBLE_EQ(t.ranks[1].busy, 6);
  EXPECT_DOUBLE_EQ(t.ranks[1].bubble_ratio, 2.0 / 8);
  EXPECT_EQ(t.ranks[1].peak_inflight, 2);
  t.ranks[1].blocks.pop_back();  // without W1 [6,7]: busy 5, and mb1's set is released when I1 ends
  derive_stats(t);
  EXPECT_DOUBLE_EQ(t.ranks[1].busy, 5);
  EXPECT_DOUBLE_EQ(t.bubble_ratio, 1 - 11.0 / 16);
  // An F starting as a B ends: the release counts first. The halves of an FB action are both live.
  t.ranks[0].blocks = {{Kind::F, 0, 0, 0, 0, 1}, {Kind::B, 0, 0, 0, 1, 3}, {Kind::F, 0, 0, 1, 3, 4}};
  derive_stats(t);
  EXPECT_EQ(t.ranks[0].peak_inflight, 1);
  t.ranks[0].blocks = {{Kind::F, 0, 0, 0, 0, 1}, {Kind::F, 0, 0, 1, 1, 3, true}, {Kind::B, 0, 0, 0, 1, 3, true},
                       {Kind::B, 0, 0, 1, 3, 4}};
  derive_stats(t);
  EXPECT_EQ(t.ranks[0].peak_inflight, 2);
  // step_time <= 0 is taken from the latest end (rank 1's I1 at 6).
  t.step_time = 0;
  derive_stats(t);
  EXPECT_DOUBLE_EQ(t.step_time, 6);
}

TEST(PpVis, SvgHasOneRectPerBlockWithLabelAndColourClass) {
  const sched::Schedule s = gen("zbv", 4, 2, 8);
  const Timeline t = from_simulation(s, replay(s, 1, 1, 1), "test");
  const std::string svg = render_svg(t);
  const auto got = svg_blocks(svg);
  size_t n = 0;
  for (const auto& row : t.ranks) n += row.blocks.size();
  ASSERT_EQ(got.size(), n);
  EXPECT_EQ(svg.find("<?xml"), 0u);
  std::set<std::string> fills;
  size_t k = 0, labelled = 0;
  for (const auto& row : t.ranks)
    for (const Block& b : row.blocks) {
      const SvgBlock& g = got[k++];
      EXPECT_EQ(g.kind, kind_name(b.kind));
      EXPECT_EQ(g.chunk, std::to_string(b.chunk));
      EXPECT_EQ(g.fill, block_colour(b.kind, b.chunk));
      const std::string action = std::to_string(b.stage) + kind_name(b.kind) + std::to_string(b.mb);
      EXPECT_NE(g.tip.find("rank " + std::to_string(row.rank) + " \u00b7 " + action + " "), std::string::npos)
          << g.tip;
      if (!g.label.empty()) {
        EXPECT_EQ(g.label, std::to_string(b.mb));
        ++labelled;
      }
      fills.insert(g.fill);
    }
  // 1400 px wide, 18 units: a unit block is ~62 px, every label fits.
  EXPECT_EQ(labelled, n);
  // F, I and W of two chunks: six different colours, and the legend shows each.
  EXPECT_EQ(fills.size(), 6u);
  for (const auto& f : fills) EXPECT_NE(svg.find("class=\"sw k-"), std::string::npos) << f;
  for (const char* k : {"F", "I", "W"})
    for (int c = 0; c < 2; ++c)
      EXPECT_NE(svg.find(std::string("<rect class=\"sw k-") + k + " c-" + std::to_string(c) + "\""),
                std::string::npos);
  // Title names the schedule and its shape; each rank has its bubble and peak.
  EXPECT_NE(svg.find("zbv \u00b7 pp 4 \u00b7 vpp 2 \u00b7 m 8"), std::string::npos);
  for (int r = 0; r < 4; ++r) {
    char want[128];
    std::snprintf(want, sizeof want, "bubble %.2f%% \u00b7 peak", 100 * t.ranks[size_t(r)].bubble_ratio);
    EXPECT_NE(svg.find(want), std::string::npos) << want;
  }
}

TEST(PpVis, AxisTicksAreRoundNumbers) {
  Timeline t;
  t.pp = 1;
  t.microbatches = 1;
  t.ranks.resize(1);
  t.ranks[0].blocks = {{Kind::F, 0, 0, 0, 0, 3}, {Kind::B, 0, 0, 0, 3, 8}};
  t.step_time = 8;
  derive_stats(t);
  const std::string svg = render_svg(t);
  std::vector<std::string> ticks;
  static const std::regex tick("<text class=\"tick\" x=\"[0-9.]+\" y=\"[0-9.]+\">([^<]*)</text>");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tick); it != std::sregex_iterator(); ++it)
    ticks.push_back((*it)[1]);
  // Plot width 1400 - 84 - 200 = 1116 px, about one tick per 110 px: step 1 over 8 units.
  EXPECT_EQ(ticks, (std::vector<std::string>{"0", "1", "2", "3", "4", "5", "6", "7", "8"}));
  t.step_time = 11711.8;
  t.ranks[0].blocks = {{Kind::F, 0, 0, 0, 0, 5000}, {Kind::B, 0, 0, 0, 5000, 11000}};
  ticks.clear();
  const std::string svg2 = render_svg(t);
  for (auto it = std::sregex_iterator(svg2.begin(), svg2.end(), tick); it != std::sregex_iterator(); ++it)
    ticks.push_back((*it)[1]);
  EXPECT_EQ(ticks, (std::vector<std::string>{"0", "2000", "4000", "6000", "8000", "10000"}));
}

TEST(PpVis, LargeScheduleDropsLabelsThatDoNotFit) {
  const sched::Schedule s = gen("interleaved_1f1b", 16, 4, 64);
  const Timeline t = from_simulation(s, replay(s, 1, 1, 1), "test");
  const std::string svg = render_svg(t);
  const auto got = svg_blocks(svg);
  size_t n = 0;
  for (const auto& row : t.ranks) n += row.blocks.size();
  ASSERT_EQ(got.size(), n);
  EXPECT_EQ(n, size_t(16 * 4 * 64 * 2));
  size_t labelled = 0;
  for (const auto& g : got) {
    // A label is drawn exactly when its digits fit: 6.6 px per digit plus 3 px.
    const std::string id = std::to_string(std::stoi(g.tip.substr(g.tip.find("micro-batch ") + 12)));
    const bool fits = g.width >= id.size() * 6.6 + 3;
    EXPECT_EQ(!g.label.empty(), fits) << g.tip << " width " << g.width;
    labelled += !g.label.empty();
  }
  EXPECT_LT(labelled, n);
  EXPECT_NE(svg.find("interleaved_1f1b \u00b7 pp 16 \u00b7 vpp 4 \u00b7 m 64"), std::string::npos);
}

TEST(PpVis, HtmlIsSelfContained) {
  const sched::Schedule s = gen("1f1b", 4, 1, 8);
  const Timeline t = from_simulation(s, replay(s, 1, 2, 0), "test");
  const std::string html = render_html(t);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  // No network: the SVG namespace is the only URL; no external scripts, styles, images or fonts.
  std::string rest = html;
  rest.erase(rest.find("http://www.w3.org/2000/svg"), 26);
  for (const char* bad : {"http://", "https://", "<script", "<link", "@import", "url(", "<img", "src="})
    EXPECT_EQ(rest.find(bad), std::string::npos) << bad;
  EXPECT_EQ(svg_blocks(html).size(), size_t(4 * 8 * 2));
  const fs::path dir = temp_dir("html");
  const std::string svg_path = write_html_and_svg(t, (dir / "p.html").string());
  EXPECT_EQ(svg_path, (dir / "p.svg").string());
  EXPECT_EQ(slurp(dir / "p.html"), html);
  EXPECT_EQ(slurp(dir / "p.svg"), render_svg(t));
  EXPECT_NE(error_of([&] { write_html_and_svg(t, (dir / "p.svg").string()); }).find("would overwrite"),
            std::string::npos);
  fs::remove_all(dir);
}

TEST(PpVis, PrimusRoundTripKeepsBlocks) {
  for (const auto& [name, vpp] : std::vector<std::pair<std::string, int>>{
           {"gpipe", 1}, {"1f1b", 1}, {"interleaved_1f1b", 2}, {"interleaved_1f1b", 3}, {"zb1p", 1}, {"zbv", 2},
           {"dualpipev", 2}}) {
    const int pp = 4, m = name == "dualpipev" ? 10 : 8;
    const sched::Schedule s = gen(name, pp, vpp, m);
    const Timeline t = from_simulation(s, replay(s, 1.25, 1.5, 0.75), "test");
    const fs::path dir = temp_dir("rt_" + name);
    write_primus(t, dir.string());
    const Timeline back = read_primus(dir.string());
    EXPECT_EQ(back.pp, pp);
    EXPECT_EQ(back.vpp, vpp);
    EXPECT_EQ(back.microbatches, m);
    EXPECT_EQ(back.schedule, name);
    EXPECT_EQ(back.unit, "units");
    EXPECT_EQ(back.step_time, t.step_time);
    for (int r = 0; r < pp; ++r) {
      EXPECT_EQ(back.ranks[size_t(r)].blocks, t.ranks[size_t(r)].blocks) << name << " rank " << r;
      EXPECT_EQ(back.ranks[size_t(r)].peak_inflight, t.ranks[size_t(r)].peak_inflight) << name;
      EXPECT_NEAR(back.ranks[size_t(r)].bubble_ratio, t.ranks[size_t(r)].bubble_ratio, 1e-12) << name;
    }
    // The files are Primus's layout: vp_size * num_mbs events per series, iteration "0".
    const json r0 = json::parse(slurp(dir / "pp_rank_0.json"));
    EXPECT_EQ(r0["0"]["fwd_start"].size(), size_t(vpp * m));
    EXPECT_EQ(r0["0"]["bwd_end"].size(), size_t(vpp * m));
    EXPECT_EQ(json::parse(slurp(dir / "config.json"))["num_mbs"], m);
    fs::remove_all(dir);
  }
}

// tests/data/ppvis/pp2_vp1_m3: Primus's training-dump style (no id lists, two iterations). Iteration 2 by hand:
// rank 0 busy 10+10+20+10+20+20 = 90, rank 1 busy 10+20+10+20+15+20 = 95, step = max total = 126.
TEST(PpVis, PrimusTrainingDumpByHand) {
  const Timeline t = read_primus((kData / "pp2_vp1_m3").string());
  EXPECT_EQ(t.pp, 2);
  EXPECT_EQ(t.vpp, 1);
  EXPECT_EQ(t.microbatches, 3);
  EXPECT_EQ(t.unit, "ms");
  EXPECT_DOUBLE_EQ(t.step_time, 126);
  const std::vector<Block> rank1 = {{Kind::F, 1, 0, 0, 10, 20}, {Kind::B, 1, 0, 0, 20, 40}, {Kind::F, 1, 0, 1, 40, 50},
                                    {Kind::B, 1, 0, 1, 50, 70}, {Kind::F, 1, 0, 2, 70, 85}, {Kind::B, 1, 0, 2, 85, 105}};
  EXPECT_EQ(t.ranks[1].blocks, rank1);
  EXPECT_DOUBLE_EQ(t.ranks[0].busy, 90);
  EXPECT_DOUBLE_EQ(t.ranks[1].busy, 95);
  EXPECT_NEAR(t.ranks[0].bubble_ratio, 1 - 90.0 / 126, 1e-12);
  EXPECT_NEAR(t.ranks[1].bubble_ratio, 1 - 95.0 / 126, 1e-12);
  EXPECT_NEAR(t.bubble_ratio, 1 - 185.0 / 252, 1e-12);
  EXPECT_EQ(t.ranks[0].peak_inflight, 2);
  EXPECT_EQ(t.ranks[1].peak_inflight, 1);
  EXPECT_DOUBLE_EQ(t.ranks[0].memory, 21.5);
  // Iteration 1 is the same schedule at half speed.
  const Timeline t1 = read_primus((kData / "pp2_vp1_m3").string(), 1);
  EXPECT_DOUBLE_EQ(t1.step_time, 252);
  EXPECT_DOUBLE_EQ(t1.ranks[1].busy, 190);
}

// tests/data/ppvis/pp2_vpp2_m2_zb: Primus's simulator style (vpp_size, micro_batches, id lists, wgrad).
TEST(PpVis, PrimusSimulatorDumpByHand) {
  const Timeline t = read_primus((kData / "pp2_vpp2_m2_zb").string());
  EXPECT_EQ(t.vpp, 2);
  EXPECT_EQ(t.microbatches, 2);
  EXPECT_DOUBLE_EQ(t.step_time, 14);
  // bwd events are I (the ranks have wgrad events); rank 0 chunk 1 is stage 2.
  const Block first_i = t.ranks[0].blocks[4];
  EXPECT_EQ(first_i, (Block{Kind::I, 2, 1, 0, 6, 7}));
  for (int r = 0; r < 2; ++r) {
    EXPECT_DOUBLE_EQ(t.ranks[size_t(r)].busy, 12);
    EXPECT_EQ(t.ranks[size_t(r)].peak_inflight, 4);
    EXPECT_DOUBLE_EQ(t.peak_microbatches(r), 2);
  }
  EXPECT_NEAR(t.bubble_ratio, 2.0 / 14, 1e-12);
}

// Without id lists and with vp_size 2, events follow Megatron's interleaved order (listed here by hand).
TEST(PpVis, PrimusMegatronOrderWithoutIds) {
  const fs::path dir = temp_dir("order");
  write_json(dir / "config.json", {{"pp_size", 2}, {"vp_size", 2}, {"num_mbs", 4}});
  json it = {{"total", 100}};
  for (const char* k : {"fwd", "bwd"}) {
    json st = json::array(), en = json::array();
    for (int i = 0; i < 8; ++i) {
      st.push_back((k[0] == 'f' ? 0 : 50) + 5 * i);
      en.push_back((k[0] == 'f' ? 0 : 50) + 5 * i + 4);
    }
    it[std::string(k) + "_start"] = st;
    it[std::string(k) + "_end"] = en;
  }
  write_json(dir / "pp_rank_0.json", {{"3", it}});
  write_json(dir / "pp_rank_1.json", {{"3", it}});
  const Timeline t = read_primus(dir.string());
  const std::vector<std::pair<int, int>> fwd = {{0, 0}, {0, 1}, {1, 0}, {1, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}};
  const std::vector<std::pair<int, int>> bwd = {{1, 0}, {1, 1}, {0, 0}, {0, 1}, {1, 2}, {1, 3}, {0, 2}, {0, 3}};
  const auto& blocks = t.ranks[1].blocks;
  ASSERT_EQ(blocks.size(), 16u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(std::pair(blocks[i].chunk, blocks[i].mb), fwd[i]) << i;
    EXPECT_EQ(blocks[i].stage, fwd[i].first * 2 + 1);
    EXPECT_EQ(blocks[i].kind, Kind::F);
    EXPECT_EQ(std::pair(blocks[8 + i].chunk, blocks[8 + i].mb), bwd[i]) << i;
    EXPECT_EQ(blocks[8 + i].kind, Kind::B);
  }
  fs::remove_all(dir);
}

TEST(PpVis, BadPrimusDumpsAreRefusedNamingFileAndField) {
  const sched::Schedule s = gen("zb1p", 2, 1, 2);
  const Timeline good = from_simulation(s, replay(s, 1, 1, 1), "test");
  const fs::path dir = temp_dir("bad");
  const std::string cfg = (dir / "config.json").string(), r1 = (dir / "pp_rank_1.json").string();
  struct Case {
    std::string what;
    std::function<void()> spoil;
    std::vector<std::string> want;  // substrings of the message
  };
  auto edit_rank1 = [&](const std::function<void(json&)>& f) {
    json j = json::parse(slurp(r1));
    f(j["0"]);
    write_json(r1, j);
  };
  auto edit_cfg = [&](const std::function<void(json&)>& f) {
    json j = json::parse(slurp(cfg));
    f(j);
    write_json(cfg, j);
  };
  const std::vector<Case> cases = {
      {"no config", [&] { fs::remove(cfg); }, {cfg, "cannot open"}},
      {"no rank file", [&] { fs::remove(r1); }, {r1, "cannot open"}},
      {"not json", [&] { std::ofstream(r1) << "{\"0\": [1, 2"; }, {r1, "not valid JSON"}},
      {"no pp_size", [&] { edit_cfg([](json& c) { c.erase("pp_size"); }); }, {cfg, "'pp_size'", "missing"}},
      {"vp_size text", [&] { edit_cfg([](json& c) { c["vp_size"] = "two"; }); }, {cfg, "'vp_size'", "not an integer"}},
      {"num_mbs zero", [&] { edit_cfg([](json& c) { c["num_mbs"] = 0; }); }, {cfg, "'num_mbs' = 0"}},
      {"iteration key", [&] { write_json(dir / "pp_rank_0.json", {{"last", json::object()}}); },
       {"pp_rank_0.json", "iteration key 'last'"}},
      {"iteration missing", [&] { write_json(r1, {{"7", json::object()}}); }, {r1, "iteration '0' is missing"}},
      {"no fwd_end", [&] { edit_rank1([](json& it) { it.erase("fwd_end"); }); }, {r1, "'fwd_end' is missing"}},
      {"not a list", [&] { edit_rank1([](json& it) { it["bwd_start"] = 3; }); }, {r1, "'bwd_start' = 3 is not a list"}},
      {"short list", [&] { edit_rank1([](json& it) { it["fwd_start"].erase(0); }); },
       {r1, "'fwd_start' has 1 entries but 'fwd_end' has 2"}},
      {"both short",
       [&] { edit_rank1([](json& it) { it["fwd_start"].erase(0); it["fwd_end"].erase(0); }); },
       {r1, "'fwd_start' has 1 entries; vp_size * num_mbs = 2 expected"}},
      {"end before start", [&] { edit_rank1([](json& it) { it["bwd_end"][1] = 0.5; }); },
       {r1, "'bwd_end'[1] = 0.5 is before 'bwd_start'[1]"}},
      {"not a number", [&] { edit_rank1([](json& it) { it["wgrad_start"][0] = "abc"; }); },
       {r1, "'wgrad_start'[0] = \"abc\" is not a number"}},
      {"negative time", [&] { edit_rank1([](json& it) { it["fwd_start"][0] = -1; }); },
       {r1, "'fwd_start'[0] = -1 must be a finite time >= 0"}},
      {"total text", [&] { edit_rank1([](json& it) { it["total"] = "x"; }); }, {r1, "'total' = \"x\""}},
      {"mb out of range", [&] { edit_rank1([](json& it) { it["bwd_minibatch"][0] = 2; }); },
       {r1, "'bwd_minibatch'[0] = 2 outside 0..1"}},
      {"chunk out of range", [&] { edit_rank1([](json& it) { it["fwd_chunk"][1] = 1; }); },
       {r1, "'fwd_chunk'[1] = 1 outside 0..0"}},
      {"ids wrong length", [&] { edit_rank1([](json& it) { it["wgrad_minibatch"].push_back(0); }); },
       {r1, "'wgrad_minibatch' has 3 entries; 2 expected"}},
      {"duplicate", [&] { edit_rank1([](json& it) { it["fwd_minibatch"][1] = 0; }); },
       {r1, "fwd events 0 and 1 are both chunk 0 micro-batch 0"}},
      {"partial wgrad without ids",
       [&] { edit_rank1([](json& it) { for (const char* k : {"wgrad_start", "wgrad_end"}) it[k].erase(0);
                                       it.erase("wgrad_minibatch"); it.erase("wgrad_chunk"); }); },
       {r1, "'wgrad_minibatch' and 'wgrad_chunk' are needed"}},
      {"too many wgrad",
       [&] { edit_rank1([](json& it) { for (const char* k : {"wgrad_start", "wgrad_end"}) it[k].push_back(9); }); },
       {r1, "'wgrad_start' has 3 entries; at most vp_size * num_mbs = 2 expected"}},
  };
  for (const Case& c : cases) {
    fs::remove_all(dir);
    write_primus(good, dir.string());
    ASSERT_NO_THROW(read_primus(dir.string())) << c.what;
    c.spoil();
    const std::string msg = error_of([&] { read_primus(dir.string()); });
    ASSERT_FALSE(msg.empty()) << c.what << ": accepted";
    for (const std::string& w : c.want) EXPECT_NE(msg.find(w), std::string::npos) << c.what << ": " << msg;
  }
  EXPECT_NE(error_of([&] { read_primus((dir / "nowhere").string()); }).find("not a directory"), std::string::npos);
  // Export refuses a timeline that is not a whole step (a rank without all its forwards).
  Timeline partial = good;
  partial.ranks[0].blocks.erase(partial.ranks[0].blocks.begin());
  EXPECT_NE(error_of([&] { write_primus(partial, dir.string()); }).find("rank 0 has 1 fwd blocks"), std::string::npos);
  fs::remove_all(dir);
}

// The export for every generator is a dump Primus's tool handles: complete or empty wgrad lists on every rank,
// no time counted twice (F&B halves side by side), and the tool's bubble per rank equal to moetron's and
// non-negative. The dump reads back to the same blocks and statistics.
TEST(PpVis, PrimusExportMeetsPrimusToolInvariants) {
  bool saw_pair = false, saw_mixed = false;
  for (const GenCase& c : kAllGenerators) {
    const Timeline t = simulated(c);
    size_t fused = 0, full = 0, split = 0;
    for (const RankRow& row : t.ranks)
      for (const Block& b : row.blocks) {
        fused += b.fused;
        full += b.kind == Kind::B;
        split += b.kind == Kind::I;
      }
    saw_pair = saw_pair || fused > 0;
    saw_mixed = saw_mixed || (full > 0 && split > 0);
    const fs::path dir = temp_dir("tool");
    write_primus(t, dir.string());
    const ToolView v = primus_tool_view(dir);
    EXPECT_TRUE(v.problems.empty()) << label(c) << ":" << joined(v.problems);
    ASSERT_EQ(v.bubble.size(), size_t(c.pp)) << label(c);
    for (int r = 0; r < c.pp; ++r) {
      EXPECT_NEAR(v.bubble[size_t(r)], t.ranks[size_t(r)].bubble_ratio, 1e-12) << label(c) << " rank " << r;
      EXPECT_GE(v.bubble[size_t(r)], 0) << label(c) << " rank " << r;
    }
    const Timeline back = read_primus(dir.string());
    for (int r = 0; r < c.pp; ++r) {
      const RankRow &a = t.ranks[size_t(r)], &b = back.ranks[size_t(r)];
      EXPECT_EQ(b.blocks, a.blocks) << label(c) << " rank " << r;
      EXPECT_NEAR(b.busy, a.busy, 1e-12) << label(c) << " rank " << r;
      EXPECT_NEAR(b.bubble_ratio, a.bubble_ratio, 1e-12) << label(c) << " rank " << r;
      EXPECT_EQ(b.peak_inflight, a.peak_inflight) << label(c) << " rank " << r;
    }
    EXPECT_NEAR(back.bubble_ratio, t.bubble_ratio, 1e-12) << label(c);
    fs::remove_all(dir);
  }
  // The cases exercise both fixes: F&B pairs (dualpipev, ep_overlap) and ranks mixing B with I and W.
  EXPECT_TRUE(saw_pair);
  EXPECT_TRUE(saw_mixed);
}

// The two moetron fields by hand on dualpipev pp 2 m 4: rank 0 runs 0F3&3B1 (an F&B pair with a full
// backward) and 3I0 3W0 (a split one). The pair is written split at its midpoint and listed in
// 'bwd_pair_fwd'; every full backward has a zero-length wgrad placeholder at its end.
TEST(PpVis, PrimusExportPairAndPlaceholderByHand) {
  const Timeline t = simulated({"dualpipev", 2, 2, 4});
  const fs::path dir = temp_dir("hand");
  write_primus(t, dir.string());
  const json it = json::parse(slurp(dir / "pp_rank_0.json"))["0"];
  const auto find = [&](const std::string& series, int chunk, int mb) {
    for (size_t i = 0; i < it[series + "_start"].size(); ++i)
      if (it[series + "_chunk"][i] == chunk && it[series + "_minibatch"][i] == mb) return i;
    ADD_FAILURE() << series << " chunk " << chunk << " mb " << mb << " not in the dump";
    return size_t(0);
  };
  const Block* f3 = nullptr;
  for (const Block& b : t.ranks[0].blocks)
    if (b.kind == Kind::F && b.stage == 0 && b.mb == 3) f3 = &b;
  ASSERT_TRUE(f3 != nullptr && f3->fused);
  const size_t fi = find("fwd", 0, 3), bi = find("bwd", 1, 1);
  const double mid = f3->start + (f3->end - f3->start) / 2;
  EXPECT_EQ(it["fwd_start"][fi], f3->start);
  EXPECT_EQ(it["fwd_end"][fi], mid);
  EXPECT_EQ(it["bwd_start"][bi], mid);
  EXPECT_EQ(it["bwd_end"][bi], f3->end);
  EXPECT_EQ(it["bwd_pair_fwd"][bi], int(fi));
  EXPECT_EQ(it["bwd_pair_fwd"][find("bwd", 1, 0)], -1);
  // 3B1 (stage 3 = chunk 1) is a full backward: placeholder at its end. 3I0's wgrad is its real W.
  const size_t p = find("wgrad", 1, 1), w = find("wgrad", 1, 0);
  EXPECT_EQ(it["wgrad_placeholder"][p], 1);
  EXPECT_EQ(it["wgrad_start"][p], f3->end);
  EXPECT_EQ(it["wgrad_end"][p], f3->end);
  EXPECT_EQ(it["wgrad_placeholder"][w], 0);
  EXPECT_GT(it["wgrad_end"][w].get<double>(), it["wgrad_start"][w].get<double>());
  // A schedule without W writes empty wgrad lists on every rank.
  write_primus(simulated({"1f1b", 2, 1, 4}), dir.string());
  for (int r = 0; r < 2; ++r) {
    const json j = json::parse(slurp(dir / ("pp_rank_" + std::to_string(r) + ".json")))["0"];
    EXPECT_TRUE(j["wgrad_start"].empty() && j["wgrad_placeholder"].empty()) << r;
    EXPECT_EQ(j["bwd_pair_fwd"], json(std::vector<int>(4, -1))) << r;
  }
  fs::remove_all(dir);
}

// Dumps without moetron's fields still read as before: moetron's earlier exports (an F&B pair as a fwd and a
// bwd event with identical times, wgrad events only for split backwards) give the same timeline as the
// current export, and re-exporting the committed Primus dumps gives dumps the tool handles and the same
// blocks again.
TEST(PpVis, PrimusDumpsWithoutMoetronFieldsReadAsBefore) {
  for (const GenCase& c : {GenCase{"dualpipev", 4, 2, 10}, GenCase{"interleaved_1f1b", 4, 2, 8, true}}) {
    const Timeline t = simulated(c);
    const fs::path dir = temp_dir("old");
    write_primus(t, dir.string());
    for (int r = 0; r < c.pp; ++r) {  // the earlier export's form
      const fs::path file = dir / ("pp_rank_" + std::to_string(r) + ".json");
      json doc = json::parse(slurp(file));
      json& it = doc["0"];
      for (size_t j = 0; j < it["bwd_pair_fwd"].size(); ++j) {
        const int i = it["bwd_pair_fwd"][j];
        if (i < 0) continue;
        it["fwd_end"][size_t(i)] = it["bwd_end"][j];
        it["bwd_start"][j] = it["fwd_start"][size_t(i)];
      }
      json kept = json::object();
      for (const char* k : {"start", "end", "minibatch", "chunk"}) kept[k] = json::array();
      for (size_t i = 0; i < it["wgrad_placeholder"].size(); ++i)
        if (it["wgrad_placeholder"][i] == 0)
          for (const char* k : {"start", "end", "minibatch", "chunk"})
            kept[k].push_back(it[std::string("wgrad_") + k][i]);
      for (const char* k : {"start", "end", "minibatch", "chunk"}) it[std::string("wgrad_") + k] = kept[k];
      it.erase("bwd_pair_fwd");
      it.erase("wgrad_placeholder");
      write_json(file, doc);
    }
    const Timeline back = read_primus(dir.string());
    for (int r = 0; r < c.pp; ++r) {
      EXPECT_EQ(back.ranks[size_t(r)].blocks, t.ranks[size_t(r)].blocks) << label(c) << " rank " << r;
      EXPECT_NEAR(back.ranks[size_t(r)].bubble_ratio, t.ranks[size_t(r)].bubble_ratio, 1e-12) << label(c);
    }
    fs::remove_all(dir);
  }
  for (const char* name : {"pp2_vp1_m3", "pp2_vpp2_m2_zb"}) {
    const Timeline t = read_primus((kData / name).string());
    const fs::path dir = temp_dir(std::string("re_") + name);
    write_primus(t, dir.string());
    const ToolView v = primus_tool_view(dir);
    EXPECT_TRUE(v.problems.empty()) << name << ":" << joined(v.problems);
    const Timeline back = read_primus(dir.string());
    for (int r = 0; r < t.pp; ++r) {
      EXPECT_EQ(back.ranks[size_t(r)].blocks, t.ranks[size_t(r)].blocks) << name << " rank " << r;
      EXPECT_NEAR(v.bubble[size_t(r)], t.ranks[size_t(r)].bubble_ratio, 1e-12) << name << " rank " << r;
    }
    fs::remove_all(dir);
  }
}

TEST(PpVis, BadPairAndPlaceholderFieldsAreRefused) {
  const Timeline good = simulated({"dualpipev", 2, 2, 4});
  const fs::path dir = temp_dir("bad_fields");
  const std::string r0 = (dir / "pp_rank_0.json").string();
  json it0;
  auto edit = [&](const std::function<void(json&)>& f) {
    json j = json::parse(slurp(r0));
    f(j["0"]);
    write_json(r0, j);
  };
  write_primus(good, dir.string());
  it0 = json::parse(slurp(r0))["0"];
  int paired = -1, placeholder = -1, real_w = -1;  // a paired bwd event, a placeholder, a real W
  for (size_t j = 0; j < it0["bwd_pair_fwd"].size(); ++j)
    if (it0["bwd_pair_fwd"][j] >= 0 && paired < 0) paired = int(j);
  for (size_t i = 0; i < it0["wgrad_placeholder"].size(); ++i)
    (it0["wgrad_placeholder"][i] == 1 ? placeholder : real_w) = int(i);
  ASSERT_TRUE(paired >= 0 && paired < 7 && placeholder >= 0 && real_w >= 0);
  const int fwd = it0["bwd_pair_fwd"][size_t(paired)];
  const std::string P = "'bwd_pair_fwd'", W = "'wgrad_placeholder'";
  struct Case {
    std::string what;
    std::function<void(json&)> spoil;
    std::vector<std::string> want;
  };
  const std::vector<Case> cases = {
      {"pairs not a list", [](json& it) { it["bwd_pair_fwd"] = 1; }, {P + " = 1 is not a list"}},
      {"pairs short", [](json& it) { it["bwd_pair_fwd"].erase(0); }, {P + " has 7 entries; 8 expected"}},
      {"pair text", [&](json& it) { it["bwd_pair_fwd"][size_t(paired)] = "x"; }, {"is not an integer"}},
      {"pair out of range", [&](json& it) { it["bwd_pair_fwd"][size_t(paired)] = 8; }, {"= 8 outside -1..7"}},
      {"fwd paired twice",
       [&](json& it) {
         it["bwd_pair_fwd"][7] = fwd;  // checked after the pair's own entry
       },
       {"fwd event " + std::to_string(fwd) + " is already paired with bwd event"}},
      {"halves apart",
       [&](json& it) { it["bwd_start"][size_t(paired)] = it["bwd_start"][size_t(paired)].get<double>() + 0.5; },
       {"'fwd_end'[" + std::to_string(fwd) + "]", "differs from 'bwd_start'[" + std::to_string(paired) + "]"}},
      {"placeholders short", [](json& it) { it["wgrad_placeholder"].erase(0); }, {W + " has 7 entries; 8 expected"}},
      {"placeholder 2", [&](json& it) { it["wgrad_placeholder"][size_t(placeholder)] = 2; },
       {W + "[" + std::to_string(placeholder) + "] = 2 is not 0 or 1"}},
      {"placeholder with length", [&](json& it) { it["wgrad_placeholder"][size_t(real_w)] = 1; },
       {W + "[" + std::to_string(real_w) + "] = 1 but 'wgrad_start'", "a placeholder has zero length"}},
  };
  for (const Case& c : cases) {
    fs::remove_all(dir);
    write_primus(good, dir.string());
    ASSERT_NO_THROW(read_primus(dir.string())) << c.what;
    edit(c.spoil);
    const std::string msg = error_of([&] { read_primus(dir.string()); });
    ASSERT_FALSE(msg.empty()) << c.what << ": accepted";
    EXPECT_NE(msg.find(r0), std::string::npos) << c.what << ": " << msg;
    for (const std::string& w : c.want) EXPECT_NE(msg.find(w), std::string::npos) << c.what << ": " << msg;
  }
  // Export refuses a fused block without its other half.
  Timeline lone = good;
  for (Block& b : lone.ranks[0].blocks)
    if (b.fused && b.kind != Kind::F) {
      b.fused = false;
      break;
    }
  EXPECT_NE(error_of([&] { write_primus(lone, dir.string()); }).find("is marked fused but has no fused B or I"),
            std::string::npos);
  fs::remove_all(dir);
}
