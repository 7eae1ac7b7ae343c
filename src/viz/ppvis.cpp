// ppvis.cpp: the pp_vis timeline model (from a simulated schedule, derived statistics, checks) and its
// rendering to a standalone SVG and a self-contained HTML page (inline SVG and CSS, native SVG tooltips, no
// network, no scripts). Not the Primus dump reader/writer (primus_ppvis.cpp) and not the simulator.
#include "viz/ppvis.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "moetron/check.h"
#include "moetron/html_text.h"

namespace moetron::viz {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::F: return "F";
    case Kind::B: return "B";
    case Kind::I: return "I";
    case Kind::W: return "W";
  }
  return "?";
}

double Timeline::peak_microbatches(int rank) const {
  return double(ranks.at(size_t(rank)).peak_inflight) / double(std::max(vpp, 1));
}

// ---- model ---------------------------------------------------------------------------------------------

namespace {

bool block_order(const Block& a, const Block& b) {
  if (a.start != b.start) return a.start < b.start;
  return int(a.kind) < int(b.kind);  // fused halves: F before B/I
}

Kind kind_of(sched::Op op) {
  switch (op) {
    case sched::Op::F: return Kind::F;
    case sched::Op::B: return Kind::B;
    case sched::Op::I: return Kind::I;
    case sched::Op::W: return Kind::W;
    default: break;
  }
  MT_FAIL("pp_vis", "op ", int(op), " is not a single compute action");
}

}  // namespace

Timeline from_simulation(const sched::Schedule& s, const sched::TimedResult& r, const std::string& source,
                         const std::string& unit) {
  MT_CHECK(s.pp >= 1 && s.n_stages >= s.pp && s.n_stages % s.pp == 0, "pp_vis", "schedule '", s.name,
           "': pp = ", s.pp, ", n_stages = ", s.n_stages);
  MT_CHECK(int(s.stage_rank.size()) == s.n_stages, "pp_vis", "schedule '", s.name, "': stage_rank has ",
           s.stage_rank.size(), " entries for ", s.n_stages, " stages");
  // A stage's chunk is its index among the stages of its rank, in stage order.
  std::vector<int> chunk(size_t(s.n_stages), 0), count(size_t(s.pp), 0);
  for (int st = 0; st < s.n_stages; ++st) {
    const int rk = s.stage_rank[size_t(st)];
    MT_CHECK(rk >= 0 && rk < s.pp, "pp_vis", "schedule '", s.name, "': stage ", st, " on rank ", rk);
    chunk[size_t(st)] = count[size_t(rk)]++;
  }
  Timeline t;
  t.title = s.name;
  t.schedule = s.name;
  t.source = source;
  t.unit = unit;
  t.pp = s.pp;
  t.vpp = s.stages_per_rank();
  t.microbatches = s.n_microbatches;
  t.step_time = r.step_time;
  t.bubble_ratio = r.bubble_ratio;
  t.ranks.resize(size_t(s.pp));
  for (int rk = 0; rk < s.pp; ++rk) t.ranks[size_t(rk)].rank = rk;
  auto block = [&](Kind k, int stage, int mb, const sched::TimedOp& op, bool fused) {
    MT_CHECK(stage >= 0 && stage < s.n_stages, "pp_vis", "rank ", op.rank, " action ", op.index, " '",
             sched::to_string(op.action), "': stage ", stage, " outside 0..", s.n_stages - 1);
    return Block{k, stage, chunk[size_t(stage)], mb, op.start, op.end, fused};
  };
  for (const sched::TimedOp& op : r.ops) {
    if (!sched::is_compute(op.action.op)) continue;
    MT_CHECK(op.rank >= 0 && op.rank < s.pp, "pp_vis", "timed op '", sched::to_string(op.action), "' on rank ",
             op.rank, " of pp = ", s.pp);
    auto& row = t.ranks[size_t(op.rank)].blocks;
    const sched::Action& a = op.action;
    if (a.op == sched::Op::FB) {
      row.push_back(block(Kind::F, a.stage, a.mb, op, true));
      row.push_back(block(kind_of(a.op2), a.stage2, a.mb2, op, true));
    } else {
      row.push_back(block(kind_of(a.op), a.stage, a.mb, op, false));
    }
  }
  for (auto& row : t.ranks) std::stable_sort(row.blocks.begin(), row.blocks.end(), block_order);
  // Busy time from the blocks; bubble ratio and peak in-flight are the simulator's when it reports them.
  derive_stats(t);
  t.step_time = r.step_time > 0 ? r.step_time : t.step_time;
  if (!r.ranks.empty()) {
    MT_CHECK(int(r.ranks.size()) == s.pp, "pp_vis", "timed result has ", r.ranks.size(), " ranks for pp = ", s.pp);
    for (const sched::RankStats& rs : r.ranks) {
      MT_CHECK(rs.rank >= 0 && rs.rank < s.pp, "pp_vis", "timed result names rank ", rs.rank);
      RankRow& row = t.ranks[size_t(rs.rank)];
      row.busy = rs.busy;
      row.bubble_ratio = rs.bubble_ratio;
      row.peak_inflight = rs.peak_inflight;
    }
    t.bubble_ratio = r.bubble_ratio;
  }
  check_timeline(t);
  return t;
}

void derive_stats(Timeline& t) {
  double latest = 0;
  for (const auto& row : t.ranks)
    for (const Block& b : row.blocks) latest = std::max(latest, b.end);
  if (!(t.step_time > 0)) t.step_time = latest;
  double busy_sum = 0;
  for (auto& row : t.ranks) {
    // Busy: the union of the block intervals (the two halves of an FB action count once).
    std::vector<std::pair<double, double>> iv;
    for (const Block& b : row.blocks) iv.emplace_back(b.start, b.end);
    std::sort(iv.begin(), iv.end());
    double busy = 0, cur_s = 0, cur_e = -1;
    for (const auto& [s, e] : iv) {
      if (s > cur_e) {
        if (cur_e > cur_s) busy += cur_e - cur_s;
        cur_s = s;
        cur_e = e;
      } else {
        cur_e = std::max(cur_e, e);
      }
    }
    if (cur_e > cur_s) busy += cur_e - cur_s;
    row.busy = busy;
    row.bubble_ratio = t.step_time > 0 ? 1.0 - busy / t.step_time : 0.0;
    busy_sum += busy;
    // Peak in-flight: an activation set is live from its F's start until the last of its backward blocks
    // ends (B, or W when the backward is split); I frees nothing. At equal times releases come first, so an
    // F that starts as a B ends does not count the freed set, while the halves of an FB action (same start)
    // are both live, as in sched::simulate_timed.
    std::map<std::pair<int, int>, double> release;  // (stage, mb) -> end of its last backward block
    for (const Block& b : row.blocks)
      if (b.kind != Kind::F) {
        double& r = release[{b.stage, b.mb}];
        r = std::max(r, b.end);
      }
    std::vector<std::pair<double, int>> ev;
    for (const Block& b : row.blocks)
      if (b.kind == Kind::F) ev.emplace_back(b.start, +1);
    for (const auto& [key, when] : release) ev.emplace_back(when, -1);
    std::sort(ev.begin(), ev.end());
    int held = 0, peak = 0;
    for (const auto& [when, d] : ev) peak = std::max(peak, held += d);
    row.peak_inflight = peak;
  }
  t.bubble_ratio = t.step_time > 0 && t.pp > 0 ? 1.0 - busy_sum / (double(t.pp) * t.step_time) : 0.0;
}

void check_timeline(const Timeline& t) {
  MT_CHECK(t.pp >= 1 && t.vpp >= 1 && t.microbatches >= 1, "pp_vis", "timeline '", t.title, "': pp = ", t.pp,
           ", vpp = ", t.vpp, ", microbatches = ", t.microbatches, " must all be >= 1");
  MT_CHECK(int(t.ranks.size()) == t.pp, "pp_vis", "timeline '", t.title, "': ", t.ranks.size(),
           " rank rows for pp = ", t.pp);
  MT_CHECK(std::isfinite(t.step_time) && t.step_time >= 0, "pp_vis", "timeline '", t.title,
           "': step_time = ", t.step_time);
  const double slack = 1e-9 * std::max(1.0, t.step_time);
  for (size_t r = 0; r < t.ranks.size(); ++r) {
    const RankRow& row = t.ranks[r];
    MT_CHECK(row.rank == int(r), "pp_vis", "timeline row ", r, " says rank ", row.rank);
    for (size_t i = 0; i < row.blocks.size(); ++i) {
      const Block& b = row.blocks[i];
      const auto where = [&] {
        return "rank " + std::to_string(r) + " block " + std::to_string(i) + " '" + std::to_string(b.stage) +
               kind_name(b.kind) + std::to_string(b.mb) + "'";
      };
      MT_CHECK(std::isfinite(b.start) && std::isfinite(b.end) && b.start >= -slack && b.end >= b.start,
               "pp_vis", where(), ": start = ", b.start, ", end = ", b.end);
      MT_CHECK(b.end <= t.step_time + slack, "pp_vis", where(), ": end = ", b.end, " after step_time = ",
               t.step_time);
      MT_CHECK(b.chunk >= 0 && b.chunk < t.vpp, "pp_vis", where(), ": chunk = ", b.chunk, " outside 0..",
               t.vpp - 1);
      MT_CHECK(b.mb >= 0 && b.mb < t.microbatches, "pp_vis", where(), ": micro-batch = ", b.mb, " outside 0..",
               t.microbatches - 1);
    }
  }
}

// ---- rendering -----------------------------------------------------------------------------------------

namespace {

// Eight hues (chunk c uses hue c mod 8); per hue the F (medium), B/I (dark) and W (light) shades.
constexpr const char* kPalette[8][3] = {
    {"#3b7dd8", "#1b3f78", "#a9c9f2"},  // blue
    {"#e8893a", "#8a4310", "#f8d2ae"},  // orange
    {"#3fa45b", "#1d5a2e", "#b3e1bf"},  // green
    {"#8e5cc8", "#4b2a75", "#d7c2ef"},  // purple
    {"#2aa6a6", "#135757", "#a8e0e0"},  // teal
    {"#d64f4f", "#7a1f1f", "#f3b7b7"},  // red
    {"#a8a232", "#5b5714", "#e2dfa5"},  // olive
    {"#d45a9e", "#78244f", "#f2bcda"},  // pink
};

int shade_of(Kind k) { return k == Kind::F ? 0 : k == Kind::W ? 2 : 1; }

bool is_dark(const std::string& hex) {
  unsigned r = 0, g = 0, b = 0;
  std::sscanf(hex.c_str(), "#%02x%02x%02x", &r, &g, &b);
  return 0.299 * r + 0.587 * g + 0.114 * b < 150;
}

std::string esc(const std::string& s) { return html_escape(s); }

std::string num(double v, int prec = 6) {  // short human form
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", prec, v);
  return buf;
}
std::string px(double v) {  // coordinates
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  std::string s = buf;
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}
std::string pct(double r) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f%%", 100.0 * r);
  return buf;
}
std::string peak_text(const Timeline& t, int rank) {
  if (t.vpp == 1) return std::to_string(t.ranks[size_t(rank)].peak_inflight);
  return num(t.peak_microbatches(rank), 3) + " mb";
}

// A "nice" tick step (1, 2 or 5 times a power of ten) giving about `target` ticks over `span`.
double tick_step(double span, int target) {
  if (!(span > 0)) return 1;
  const double raw = span / target, mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

struct Legend {
  std::string svg;
  double height = 0;
};

// Swatches: per chunk the F, B/I and W shades present in the timeline; wraps to more lines when needed.
Legend legend(const Timeline& t, double x0, double y0, double max_x) {
  bool has[4] = {false, false, false, false};
  bool fused = false;
  for (const auto& row : t.ranks)
    for (const Block& b : row.blocks) {
      has[int(b.kind)] = true;
      fused = fused || b.fused;
    }
  std::string bname = has[int(Kind::B)] && has[int(Kind::I)] ? "B/I" : has[int(Kind::I)] ? "I" : "B";
  std::vector<std::pair<Kind, std::string>> kinds = {{Kind::F, "F"}};
  // B and I share a shade; the swatch carries the class of the kind present (B when both are).
  kinds.push_back({has[int(Kind::I)] && !has[int(Kind::B)] ? Kind::I : Kind::B, bname});
  if (has[int(Kind::W)]) kinds.push_back({Kind::W, "W"});
  std::ostringstream o;
  double x = x0, y = y0;
  const double line = 20;
  for (int c = 0; c < t.vpp; ++c) {
    const std::string head = t.vpp > 1 ? "chunk " + std::to_string(c) + ":" : "";
    double w = head.size() * 7.0 + (head.empty() ? 0 : 6);
    for (const auto& k : kinds) w += 18 + k.second.size() * 7.0 + 12;
    if (x > x0 && x + w > max_x) {
      x = x0;
      y += line;
    }
    if (!head.empty()) {
      o << "<text class=\"lg\" x=\"" << px(x) << "\" y=\"" << px(y + 11) << "\">" << head << "</text>";
      x += head.size() * 7.0 + 6;
    }
    for (const auto& [k, name] : kinds) {
      o << "<rect class=\"sw k-" << kind_name(k) << " c-" << c << "\" x=\"" << px(x) << "\" y=\"" << px(y)
        << "\" width=\"14\" height=\"14\" fill=\"" << block_colour(k, c) << "\"/>";
      o << "<text class=\"lg\" x=\"" << px(x + 18) << "\" y=\"" << px(y + 11) << "\">" << name << "</text>";
      x += 18 + name.size() * 7.0 + 12;
    }
    x += 10;
  }
  if (fused) {
    const std::string note = "F&B overlapped (DualPipe): F upper half, backward lower half";
    if (x > x0 && x + note.size() * 6.5 > max_x) {
      x = x0;
      y += line;
    }
    o << "<text class=\"lg\" x=\"" << px(x) << "\" y=\"" << px(y + 11) << "\">" << esc(note) << "</text>";
  }
  return {o.str(), y + line - y0};
}

// The <svg> element (no XML prologue), shared by the standalone SVG and the HTML page.
std::string svg_element(const Timeline& t, const RenderOptions& opt) {
  check_timeline(t);
  const double W = std::max(opt.width, 480), rh = std::max(opt.row_height, 12);
  const double left = 84, right = 200, plot_w = W - left - right;
  const double span = t.step_time > 0 ? t.step_time : 1;
  const Legend lg = legend(t, left, 56, W - 10);
  const double top = 56 + lg.height + 8, axis_y = top + t.pp * rh + 4, H = axis_y + 44;
  auto X = [&](double time) { return left + time / span * plot_w; };

  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << px(W) << "\" height=\"" << px(H)
    << "\" viewBox=\"0 0 " << px(W) << " " << px(H) << "\" class=\"ppvis\" data-pp=\"" << t.pp
    << "\" data-vpp=\"" << t.vpp << "\" data-microbatches=\"" << t.microbatches << "\">\n";
  o << "<style>"
       "text{font-family:'DejaVu Sans','Liberation Sans',Arial,sans-serif;fill:#1d2430}"
       ".ttl{font-size:17px;font-weight:bold}.sub{font-size:12.5px;fill:#3c4654}"
       ".lg{font-size:12px}.rk{font-size:12px;text-anchor:end}.st{font-size:12px}"
       ".lbl{font-size:11px;text-anchor:middle;pointer-events:none}.lbl.sm{font-size:9px}"
       ".lbl.on-dark{fill:#ffffff}.tick{font-size:11px;text-anchor:middle;fill:#3c4654}"
       ".lane{fill:#eceff3}.grid{stroke:#d3d8df;stroke-width:0.6}.axis{stroke:#3c4654;stroke-width:1}"
       ".blk:hover{stroke:#000000;stroke-width:1.5}"
       "</style>\n";
  o << "<rect x=\"0\" y=\"0\" width=\"" << px(W) << "\" height=\"" << px(H) << "\" fill=\"#ffffff\"/>\n";
  // Title: schedule and shape; subtitle: step time, total bubble, source.
  std::string title = (t.title.empty() ? std::string("pipeline") : t.title) + " \u00b7 pp " +
                      std::to_string(t.pp) + " \u00b7 vpp " + std::to_string(t.vpp) + " \u00b7 m " +
                      std::to_string(t.microbatches);
  std::string sub = "step " + num(t.step_time) + " " + t.unit + " \u00b7 bubble " + pct(t.bubble_ratio) +
                    (t.source.empty() ? "" : " \u00b7 " + t.source);
  o << "<text class=\"ttl\" x=\"" << px(left) << "\" y=\"24\">" << esc(title) << "</text>\n";
  o << "<text class=\"sub\" x=\"" << px(left) << "\" y=\"44\">" << esc(sub) << "</text>\n";
  o << "<g class=\"legend\">" << lg.svg << "</g>\n";
  // Lanes, then grid lines, then blocks.
  const double step = tick_step(span, std::max(4, int(plot_w / 110)));
  o << "<g class=\"lanes\">";
  for (int r = 0; r < t.pp; ++r) {
    const double y0 = top + r * rh;
    o << "<rect class=\"lane\" x=\"" << px(left) << "\" y=\"" << px(y0 + 1) << "\" width=\"" << px(plot_w)
      << "\" height=\"" << px(rh - 2) << "\"/>";
    o << "<text class=\"rk\" x=\"" << px(left - 8) << "\" y=\"" << px(y0 + rh / 2 + 4) << "\">rank " << r
      << "</text>";
    const RankRow& row = t.ranks[size_t(r)];
    o << "<text class=\"st\" x=\"" << px(left + plot_w + 10) << "\" y=\"" << px(y0 + rh / 2 + 4)
      << "\">bubble " << pct(row.bubble_ratio) << " \u00b7 peak " << peak_text(t, r);
    o << "<title>rank " << r << ": busy " << num(row.busy) << " " << esc(t.unit) << ", bubble "
      << pct(row.bubble_ratio) << ", peak in-flight " << row.peak_inflight << " activation sets ("
      << num(t.peak_microbatches(r), 3) << " micro-batches)"
      << (row.memory >= 0 ? ", memory " + num(row.memory, 4) : std::string()) << "</title></text>\n";
  }
  o << "</g>\n<g class=\"gridlines\">";
  for (int i = 0; i * step <= span * (1 + 1e-9); ++i)
    o << "<line class=\"grid\" x1=\"" << px(X(i * step)) << "\" y1=\"" << px(top) << "\" x2=\""
      << px(X(i * step)) << "\" y2=\"" << px(axis_y) << "\"/>";
  o << "</g>\n<g class=\"blocks\">\n";
  for (int r = 0; r < t.pp; ++r) {
    const double y0 = top + r * rh + 3, h = rh - 6;
    for (const Block& b : t.ranks[size_t(r)].blocks) {
      const double x = X(b.start), w = std::max(X(b.end) - x, 0.75);
      const double by = b.fused && b.kind != Kind::F ? y0 + h / 2 : y0, bh = b.fused ? h / 2 : h;
      const std::string fill = block_colour(b.kind, b.chunk), id = std::to_string(b.mb);
      o << "<rect class=\"blk k-" << kind_name(b.kind) << " c-" << b.chunk << "\" x=\"" << px(x) << "\" y=\""
        << px(by) << "\" width=\"" << px(w) << "\" height=\"" << px(bh) << "\" fill=\"" << fill << "\"";
      if (w >= 3) o << " stroke=\"#ffffff\" stroke-width=\"0.6\"";
      o << "><title>rank " << r << " \u00b7 " << b.stage << kind_name(b.kind) << b.mb << " (stage " << b.stage
        << ", chunk " << b.chunk << ", micro-batch " << b.mb << (b.fused ? ", overlapped F&amp;B" : "")
        << ") \u00b7 " << num(b.start) << "\u2013" << num(b.end) << " " << esc(t.unit) << "</title></rect>";
      // The micro-batch id, when it fits (about 6.6 px per digit at 11 px, 5.4 at 9 px).
      const double need = std::max(opt.min_label_px, id.size() * (b.fused ? 5.4 : 6.6) + 3);
      if (w >= need)
        o << "<text class=\"lbl" << (b.fused ? " sm" : "") << (is_dark(fill) ? " on-dark" : "") << "\" x=\""
          << px(x + w / 2) << "\" y=\"" << px(by + bh / 2 + (b.fused ? 3 : 4)) << "\">" << id << "</text>";
      o << "\n";
    }
  }
  o << "</g>\n<g class=\"xaxis\">";
  o << "<line class=\"axis\" x1=\"" << px(left) << "\" y1=\"" << px(axis_y) << "\" x2=\"" << px(left + plot_w)
    << "\" y2=\"" << px(axis_y) << "\"/>";
  for (int i = 0; i * step <= span * (1 + 1e-9); ++i) {
    const double x = X(i * step);
    o << "<line class=\"axis\" x1=\"" << px(x) << "\" y1=\"" << px(axis_y) << "\" x2=\"" << px(x) << "\" y2=\""
      << px(axis_y + 5) << "\"/><text class=\"tick\" x=\"" << px(x) << "\" y=\"" << px(axis_y + 18) << "\">"
      << num(i * step) << "</text>";
  }
  o << "<text class=\"st\" x=\"" << px(left + plot_w + 10) << "\" y=\"" << px(axis_y + 18) << "\">time ("
    << esc(t.unit) << ")</text>";
  o << "</g>\n</svg>\n";
  return o.str();
}

}  // namespace

std::string block_colour(Kind k, int chunk) { return kPalette[((chunk % 8) + 8) % 8][shade_of(k)]; }

std::string render_svg(const Timeline& t, const RenderOptions& o) {
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n" + svg_element(t, o);
}

std::string render_html(const Timeline& t, const RenderOptions& opt) {
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>pp_vis: "
    << esc(t.title.empty() ? "pipeline" : t.title) << "</title>\n<style>\n"
    << "body{margin:16px;font-family:'DejaVu Sans','Liberation Sans',Arial,sans-serif;color:#1d2430;"
       "background:#ffffff}\n"
    << ".wrap{overflow-x:auto}\n"
    << "table{border-collapse:collapse;margin-top:12px;font-size:13px}\n"
    << "th,td{border:1px solid #d3d8df;padding:3px 10px;text-align:right}\n"
    << "th{background:#f4f6f9}\np.note{font-size:12px;color:#3c4654;max-width:1100px}\n"
    << "</style>\n</head>\n<body>\n<div class=\"wrap\">\n"
    << svg_element(t, opt) << "</div>\n";
  o << "<table>\n<tr><th>rank</th><th>busy (" << esc(t.unit) << ")</th><th>bubble</th>"
    << "<th>peak in-flight (activation sets)</th><th>peak in-flight (micro-batches)</th><th>blocks</th>";
  bool memory = false;
  for (const auto& row : t.ranks) memory = memory || row.memory >= 0;
  if (memory) o << "<th>memory (dump)</th>";
  o << "</tr>\n";
  for (int r = 0; r < t.pp; ++r) {
    const RankRow& row = t.ranks[size_t(r)];
    o << "<tr><td>" << r << "</td><td>" << num(row.busy) << "</td><td>" << pct(row.bubble_ratio) << "</td><td>"
      << row.peak_inflight << "</td><td>" << num(t.peak_microbatches(r), 3) << "</td><td>" << row.blocks.size()
      << "</td>";
    if (memory) o << "<td>" << (row.memory >= 0 ? num(row.memory, 4) : std::string("-")) << "</td>";
    o << "</tr>\n";
  }
  o << "<tr><th>all</th><td>step " << num(t.step_time) << "</td><td>" << pct(t.bubble_ratio)
    << "</td><td></td><td></td><td></td>" << (memory ? "<td></td>" : "") << "</tr>\n</table>\n";
  o << "<p class=\"note\">One row per pipeline rank; each block is one compute action labelled with its "
       "micro-batch id (labels are dropped where a block is too narrow; hover a block for its stage, chunk "
       "and times). Colour is the chunk (the stage's index on its rank); the shade tells forward (F), "
       "backward (B, or I when the weight gradient is split off) and weight gradient (W) apart. Grey is "
       "idle time. Bubble = 1 - busy / step time. Source: "
    << esc(t.source) << ".</p>\n</body>\n</html>\n";
  return o.str();
}

std::string write_html_and_svg(const Timeline& t, const std::string& html_path, const RenderOptions& o) {
  namespace fs = std::filesystem;
  const fs::path html(html_path);
  fs::path svg = html;
  svg.replace_extension(".svg");
  MT_CHECK(svg != html, "pp_vis", "--out ", html_path, ": the SVG would overwrite the HTML page");
  if (html.has_parent_path()) fs::create_directories(html.parent_path());
  const std::pair<fs::path, std::string> files[] = {{html, render_html(t, o)}, {svg, render_svg(t, o)}};
  for (const auto& [path, text] : files) {
    std::ofstream f(path, std::ios::binary);
    MT_CHECK(f.good(), "pp_vis", "cannot write ", path.string());
    f << text;
    f.close();
    MT_CHECK(f.good(), "pp_vis", "error writing ", path.string());
  }
  return svg.string();
}

}  // namespace moetron::viz
