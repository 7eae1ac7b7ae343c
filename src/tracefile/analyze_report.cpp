// analyze_report.cpp: the forms of an Analysis (tracefile/analyze.h): JSON, the text report, CSV tables and
// one self-contained HTML page. Not the figures themselves (analyze.cpp).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moetron/check.h"
#include "moetron/html_text.h"
#include "tracefile/analyze.h"

namespace moetron::tracefile {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
std::string pct(double part, double whole) { return whole > 0 ? fmt("%5.1f%%", 100 * part / whole) : "    -"; }
std::string ranks_text(const std::vector<int>& r) {
  std::string s;
  for (size_t k = 0; k < r.size(); ++k) {
    if (k) s += ',';
    s += std::to_string(r[k]);
  }
  return s;
}
std::string limits_text(const Limits& l) {
  if (!l.known()) return "none (no moetron.limits and no --hw: roofline verdicts are 'unknown')";
  return fmt("%.1f GFLOP/s", l.flops_per_s / 1e9) + ", " + fmt("%.1f GB/s", l.bytes_per_s / 1e9) + " (" +
         (l.dtype.empty() ? "" : l.dtype + ", ") + (l.source.empty() ? "source not given" : l.source) + ")";
}
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string o = "\"";
  for (char c : s) o += c == '"' ? std::string("\"\"") : std::string(1, c);
  return o + "\"";
}
void write_file(const fs::path& p, const std::string& body) {
  std::ofstream out(p, std::ios::binary);
  if (!out) throw moetron::Error("[trace analyze] " + p.string() + ": cannot write");
  out << body;
}

}  // namespace

json to_json(const Analysis& a, int top) {
  json j;
  j["dir"] = a.dir, j["source"] = a.source, j["world"] = a.world, j["steps"] = a.steps;
  j["limits"] = {{"flops_per_s", a.limits.flops_per_s}, {"bytes_per_s", a.limits.bytes_per_s},
                 {"dtype", a.limits.dtype}, {"source", a.limits.source}};
  j["ranks"] = json::array();
  for (const RankBreakdown& r : a.ranks)
    j["ranks"].push_back({{"rank", r.rank}, {"steps", r.steps}, {"step_time_s", r.step_time_s},
                          {"compute_s", r.compute_s}, {"exposed_comm_s", r.exposed_comm_s}, {"idle_s", r.idle_s},
                          {"comm_s", r.comm_s}, {"comm_wait_s", r.comm_wait_s}, {"wait_caused_s", r.wait_caused_s},
                          {"exposed_comm_by_kind", r.exposed_comm_by_kind},
                          {"exposed_comm_by_group", r.exposed_comm_by_group}, {"action_s", r.action_s},
                          {"compute_by_kernel", r.compute_by_kernel}, {"peak_memory_bytes", r.peak_memory_bytes}});
  j["top_kernels"] = json::array();
  for (size_t k = 0; k < a.kernels.size() && (top <= 0 || int(k) < top); ++k) {
    const KernelStat& s = a.kernels[k];
    j["top_kernels"].push_back({{"name", s.name}, {"count", s.count}, {"total_s", s.total_s},
                                {"per_rank_step_s", s.per_rank_step_s}, {"flops", s.flops}, {"bytes", s.bytes},
                                {"flops_per_s", s.flops_per_s}, {"bytes_per_s", s.bytes_per_s},
                                {"intensity", s.intensity}, {"bound", s.bound}, {"limit_share", s.limit_share}});
  }
  j["hierarchy"] = json::array();
  for (size_t r = 0; r < a.hierarchy.size(); ++r) {
    json nodes = json::array();
    for (const HierNode& n : a.hierarchy[r])
      nodes.push_back({{"path", n.path}, {"name", n.name}, {"cat", cat_name(n.cat)}, {"depth", n.depth},
                       {"count", n.count}, {"total_s", n.total_s}, {"self_s", n.self_s}});
    j["hierarchy"].push_back({{"rank", int(r)}, {"nodes", nodes}});
  }
  j["collectives"] = json::array();
  for (const CollectiveStat& c : a.collectives)
    j["collectives"].push_back({{"kind", c.kind}, {"group", c.group_name}, {"group_size", c.group_size},
                                {"count", c.count}, {"bytes", c.bytes}, {"time_s", c.time_s},
                                {"transfer_s", c.transfer_s}, {"wait_s", c.wait_s}, {"algbw_bytes_per_s", c.algbw},
                                {"busbw_factor", c.busbw_factor}, {"busbw_bytes_per_s", c.busbw}});
  j["matched_collectives"] = a.matched_collectives;
  j["unmatched_collectives"] = a.unmatched_collectives;
  j["straggler_rank"] = a.straggler_rank;
  j["all_to_all"] = json::array();
  for (const AllToAllStat& t : a.all_to_all)
    j["all_to_all"].push_back({{"group", t.group}, {"group_name", t.group_name}, {"ranks", t.ranks},
                               {"count", t.count}, {"matrix_bytes", t.matrix}, {"sent_bytes", t.sent},
                               {"received_bytes", t.received}, {"imbalance", t.imbalance},
                               {"imbalance_mean", t.imbalance_mean}, {"imbalance_max", t.imbalance_max}});
  j["pipeline"] = json::array();
  for (const PipelineGroup& g : a.pipeline) {
    json rs = json::array();
    for (const PipelineRank& p : g.ranks)
      rs.push_back({{"rank", p.rank}, {"pp_index", p.pp_index}, {"busy_s", p.busy_s}, {"span_s", p.span_s},
                    {"bubble", p.bubble}});
    j["pipeline"].push_back({{"group", g.group}, {"bubble", g.bubble}, {"ranks", rs}});
  }
  j["dropped_events"] = a.dropped_events;
  j["warnings"] = a.warnings;
  return j;
}

std::string format_text(const Analysis& a, int top, int hier_rank) {
  std::ostringstream os;
  os << "trace " << a.dir << ": " << a.source << ", world " << a.world << ", " << a.steps
     << " profiled step(s); limits " << limits_text(a.limits) << "\n";
  for (const std::string& w : a.warnings) os << "warning: " << w << "\n";

  os << "\nbreakdown per rank (ms per step; compute + exposed comm + idle = step)\n";
  os << "rank    step ms    compute           exposed comm      idle              comm wait  caused wait\n";
  for (const RankBreakdown& r : a.ranks) {
    char b[256];
    std::snprintf(b, sizeof b, "%-5d %10.3f  %10.3f %s  %10.3f %s  %10.3f %s  %9.3f  %11.3f\n", r.rank,
                  1e3 * r.step_time_s, 1e3 * r.compute_s, pct(r.compute_s, r.step_time_s).c_str(),
                  1e3 * r.exposed_comm_s, pct(r.exposed_comm_s, r.step_time_s).c_str(), 1e3 * r.idle_s,
                  pct(r.idle_s, r.step_time_s).c_str(), 1e3 * r.comm_wait_s, 1e3 * r.wait_caused_s);
    os << b;
  }
  os << "exposed comm by parallelism (ms per step):";
  {
    std::map<std::string, double> by;  // mean over ranks
    for (const RankBreakdown& r : a.ranks)
      for (const auto& [k, v] : r.exposed_comm_by_group) by[k] += v / double(a.ranks.size());
    if (by.empty()) os << " none";
    for (const auto& [k, v] : by) os << "  " << k << " " << fmt("%.3f", 1e3 * v);
    os << " (mean over ranks)\n";
  }
  if (a.straggler_rank >= 0)
    os << "straggler: rank " << a.straggler_rank << " (the others waited "
       << fmt("%.3f", 1e3 * a.ranks[size_t(a.straggler_rank)].wait_caused_s) << " ms per step for it in collectives)\n";
  else
    os << "straggler: none (no wait in matched collectives)\n";

  os << "\ntop kernels (self time, summed over ranks and steps; roofline against the limits above)\n";
  os << "kernel                          count   total ms  ms/rank/step    GFLOP/s      GB/s   FLOP/B  bound    of limit\n";
  double ktotal = 0;
  for (const KernelStat& k : a.kernels) ktotal += k.total_s;
  for (size_t i = 0; i < a.kernels.size() && int(i) < top; ++i) {
    const KernelStat& k = a.kernels[i];
    char b[320];
    std::snprintf(b, sizeof b, "%-30s %6lld %10.3f  %12.4f %10.2f %9.2f %8.2f  %-7s %8s\n", k.name.c_str(),
                  static_cast<long long>(k.count), 1e3 * k.total_s, 1e3 * k.per_rank_step_s, k.flops_per_s / 1e9,
                  k.bytes_per_s / 1e9, k.intensity, k.bound.c_str(),
                  k.bound == "unknown" ? "-" : fmt("%.1f%%", 100 * k.limit_share).c_str());
    os << b;
  }
  if (int(a.kernels.size()) > top) os << "(" << a.kernels.size() - size_t(top) << " more kernels)\n";

  os << "\ncollectives (totals over the profiled steps; matched by group and seq: transfer = shortest member, the "
        "rest is wait; "
     << a.matched_collectives << " matched, " << a.unmatched_collectives << " unmatched)\n";
  os << "kind            group   n   count        MB  transfer ms    wait ms  algbw GB/s  busbw GB/s (factor)\n";
  for (const CollectiveStat& c : a.collectives) {
    char b[320];
    std::snprintf(b, sizeof b, "%-15s %-6s %2d %7lld %9.3f %12.3f %10.3f %11.3f %11.3f (%.3f)\n", c.kind.c_str(),
                  c.group_name.c_str(), c.group_size, static_cast<long long>(c.count), c.bytes / 1e6,
                  1e3 * c.transfer_s, 1e3 * c.wait_s, c.algbw / 1e9, c.busbw / 1e9, c.busbw_factor);
    os << b;
  }

  for (const AllToAllStat& t : a.all_to_all) {
    os << "\nall-to-all group '" << t.group << "' (" << t.group_name << ", ranks " << ranks_text(t.ranks) << "): "
       << t.count << " calls, size imbalance " << fmt("%.3f", t.imbalance) << " (max rank / mean; per call mean "
       << fmt("%.3f", t.imbalance_mean) << ", worst " << fmt("%.3f", t.imbalance_max) << ")\n";
    char b[64];
    os << "  MB sent  ";
    for (int r : t.ranks) {
      std::snprintf(b, sizeof b, "%10s", ("to " + std::to_string(r)).c_str());
      os << b;
    }
    os << "\n";
    for (size_t i = 0; i < t.ranks.size(); ++i) {
      os << "  from " << fmt("%-4.0f", double(t.ranks[i]));
      for (double v : t.matrix[i]) os << fmt("%10.3f", v / 1e6);
      os << "\n";
    }
  }

  bool staged = false;  // any pipeline of more than one rank (pp > 1)
  for (const PipelineGroup& g : a.pipeline) staged |= g.ranks.size() > 1;
  if (staged) {
    os << "\npipeline bubble (pp_vis: 1 - busy / span; span = first to last schedule op of the group's ranks)\n";
    for (const PipelineGroup& g : a.pipeline) {
      if (g.ranks.size() < 2) continue;
      os << "  group " << (g.group.empty() ? std::string("(none)") : "'" + g.group + "'") << ": bubble "
         << fmt("%.2f%%", 100 * g.bubble) << "\n";
      for (const PipelineRank& p : g.ranks)
        os << "    rank " << p.rank << " (pp " << p.pp_index << "): busy " << fmt("%.3f", 1e3 * p.busy_s) << " ms of "
           << fmt("%.3f", 1e3 * p.span_s) << " ms, bubble " << fmt("%.2f%%", 100 * p.bubble) << "\n";
    }
  }

  if (hier_rank >= 0 && size_t(hier_rank) < a.hierarchy.size()) {
    os << "\nhierarchy of rank " << hier_rank << " (ms per step: total, self; calls per step; " << top
       << " largest children per node)\n";
    const auto& nodes = a.hierarchy[size_t(hier_rank)];
    std::map<std::string, int> shown;  // parent path -> children printed
    const double steps = std::max(1, a.ranks[size_t(hier_rank)].steps);
    std::vector<char> hidden(nodes.size(), 0);
    for (size_t k = 0; k < nodes.size(); ++k) {
      const HierNode& n = nodes[k];
      const size_t cut = n.path.rfind('/');
      const std::string par = cut == std::string::npos ? "" : n.path.substr(0, cut);
      bool hide = false;
      for (size_t q = 0; q < k; ++q)
        if (hidden[q] && n.path.rfind(nodes[q].path + "/", 0) == 0) hide = true;
      if (!hide && ++shown[par] > top) hide = true;
      hidden[k] = hide;
      if (hide) continue;
      char b[320];
      std::snprintf(b, sizeof b, "%*s%-*s %10.3f %10.3f %8.1f  %s\n", 2 * n.depth + 2, "",
                    std::max(1, 44 - 2 * n.depth), n.name.c_str(), 1e3 * n.total_s, 1e3 * n.self_s,
                    double(n.count) / steps,
                    cat_name(n.cat));
      os << b;
    }
  }
  return os.str();
}

void write_csv(const Analysis& a, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw moetron::Error("[trace analyze] " + dir + ": cannot create: " + ec.message());
  std::ostringstream r;
  r << "rank,steps,step_time_s,compute_s,exposed_comm_s,idle_s,comm_s,comm_wait_s,wait_caused_s\n";
  for (const RankBreakdown& x : a.ranks)
    r << x.rank << "," << x.steps << "," << x.step_time_s << "," << x.compute_s << "," << x.exposed_comm_s << ","
      << x.idle_s << "," << x.comm_s << "," << x.comm_wait_s << "," << x.wait_caused_s << "\n";
  write_file(fs::path(dir) / "ranks.csv", r.str());
  std::ostringstream k;
  k << "name,count,total_s,per_rank_step_s,flops,bytes,flops_per_s,bytes_per_s,intensity,bound,limit_share\n";
  for (const KernelStat& x : a.kernels)
    k << csv_field(x.name) << "," << x.count << "," << x.total_s << "," << x.per_rank_step_s << "," << x.flops << ","
      << x.bytes << "," << x.flops_per_s << "," << x.bytes_per_s << "," << x.intensity << "," << x.bound << ","
      << x.limit_share << "\n";
  write_file(fs::path(dir) / "kernels.csv", k.str());
  std::ostringstream c;
  c << "kind,group,group_size,count,bytes,time_s,transfer_s,wait_s,algbw_bytes_per_s,busbw_factor,busbw_bytes_per_s\n";
  for (const CollectiveStat& x : a.collectives)
    c << x.kind << "," << csv_field(x.group_name) << "," << x.group_size << "," << x.count << "," << x.bytes << ","
      << x.time_s << "," << x.transfer_s << "," << x.wait_s << "," << x.algbw << "," << x.busbw_factor << ","
      << x.busbw << "\n";
  write_file(fs::path(dir) / "collectives.csv", c.str());
  std::ostringstream h;
  h << "rank,path,cat,depth,count,total_s,self_s\n";
  for (size_t q = 0; q < a.hierarchy.size(); ++q)
    for (const HierNode& n : a.hierarchy[q])
      h << q << "," << csv_field(n.path) << "," << cat_name(n.cat) << "," << n.depth << "," << n.count << ","
        << n.total_s << "," << n.self_s << "\n";
  write_file(fs::path(dir) / "hierarchy.csv", h.str());
  std::ostringstream p;
  p << "group,rank,pp_index,busy_s,span_s,bubble\n";
  for (const PipelineGroup& g : a.pipeline)
    for (const PipelineRank& x : g.ranks)
      p << csv_field(g.group) << "," << x.rank << "," << x.pp_index << "," << x.busy_s << "," << x.span_s << ","
        << x.bubble << "\n";
  write_file(fs::path(dir) / "pipeline.csv", p.str());
  for (const AllToAllStat& t : a.all_to_all) {
    std::ostringstream m;
    m << "from\\to";
    for (int rr : t.ranks) m << "," << rr;
    m << "\n";
    for (size_t i = 0; i < t.ranks.size(); ++i) {
      m << t.ranks[i];
      for (double v : t.matrix[i]) m << "," << v;
      m << "\n";
    }
    std::string name = t.group;
    for (char& ch : name)
      if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_') ch = '_';
    write_file(fs::path(dir) / ("all_to_all_" + name + ".csv"), m.str());
  }
}

std::string render_html(const Analysis& a, int top) {
  std::ostringstream os;
  os << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>moetron trace analyze</title><style>\n"
        "body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0 20px}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right;font-size:13px}th{background:#f2f2f2}"
        "td.l,th.l{text-align:left}.bar{display:flex;width:420px;height:14px;border:1px solid #999}"
        ".c{background:#3b7dd8}.x{background:#e0703a}.i{background:#ddd}.warn{color:#a40}\n"
        "</style></head><body>\n";
  os << "<h1>Trace analysis</h1><p>" << html_escape(a.dir) << ": " << html_escape(a.source) << ", world " << a.world
     << ", " << a.steps << " profiled step(s). Limits: " << html_escape(limits_text(a.limits)) << "</p>\n";
  for (const std::string& w : a.warnings) os << "<p class=\"warn\">warning: " << html_escape(w) << "</p>\n";
  os << "<h2>Breakdown per rank</h2><p>Seconds per step; compute (blue) + exposed communication (orange) + idle "
        "(grey) = step.</p><table><tr><th>rank</th><th>step s</th><th>compute s</th><th>exposed comm s</th>"
        "<th>idle s</th><th>comm wait s</th><th>caused wait s</th><th class=\"l\">share</th></tr>\n";
  for (const RankBreakdown& r : a.ranks) {
    const double s = r.step_time_s > 0 ? r.step_time_s : 1;
    os << "<tr><td>" << r.rank << "</td><td>" << fmt("%.4f", r.step_time_s) << "</td><td>" << fmt("%.4f", r.compute_s)
       << "</td><td>" << fmt("%.4f", r.exposed_comm_s) << "</td><td>" << fmt("%.4f", r.idle_s) << "</td><td>"
       << fmt("%.4f", r.comm_wait_s) << "</td><td>" << fmt("%.4f", r.wait_caused_s)
       << "</td><td class=\"l\"><div class=\"bar\"><div class=\"c\" style=\"width:" << fmt("%.2f", 100 * r.compute_s / s)
       << "%\"></div><div class=\"x\" style=\"width:" << fmt("%.2f", 100 * r.exposed_comm_s / s)
       << "%\"></div><div class=\"i\" style=\"width:" << fmt("%.2f", 100 * r.idle_s / s) << "%\"></div></div></td></tr>\n";
  }
  os << "</table><p>Straggler: "
     << (a.straggler_rank >= 0 ? "rank " + std::to_string(a.straggler_rank) : std::string("none")) << "</p>\n";
  os << "<h2>Top kernels</h2><table><tr><th class=\"l\">kernel</th><th>count</th><th>total s</th><th>GFLOP/s</th>"
        "<th>GB/s</th><th>FLOP/B</th><th class=\"l\">bound</th><th>of limit</th></tr>\n";
  for (size_t i = 0; i < a.kernels.size() && int(i) < top; ++i) {
    const KernelStat& k = a.kernels[i];
    os << "<tr><td class=\"l\">" << html_escape(k.name) << "</td><td>" << k.count << "</td><td>"
       << fmt("%.4f", k.total_s) << "</td><td>" << fmt("%.2f", k.flops_per_s / 1e9) << "</td><td>"
       << fmt("%.2f", k.bytes_per_s / 1e9) << "</td><td>" << fmt("%.2f", k.intensity) << "</td><td class=\"l\">"
       << k.bound << "</td><td>" << (k.bound == "unknown" ? "-" : fmt("%.1f%%", 100 * k.limit_share)) << "</td></tr>\n";
  }
  os << "</table>\n<h2>Collectives</h2><table><tr><th class=\"l\">kind</th><th class=\"l\">group</th><th>n</th>"
        "<th>count</th><th>MB</th><th>transfer s</th><th>wait s</th><th>algbw GB/s</th><th>busbw GB/s</th>"
        "<th>factor</th></tr>\n";
  for (const CollectiveStat& c : a.collectives)
    os << "<tr><td class=\"l\">" << html_escape(c.kind) << "</td><td class=\"l\">" << html_escape(c.group_name)
       << "</td><td>" << c.group_size << "</td><td>" << c.count << "</td><td>" << fmt("%.3f", c.bytes / 1e6)
       << "</td><td>" << fmt("%.5f", c.transfer_s) << "</td><td>" << fmt("%.5f", c.wait_s) << "</td><td>"
       << fmt("%.3f", c.algbw / 1e9) << "</td><td>" << fmt("%.3f", c.busbw / 1e9) << "</td><td>"
       << fmt("%.3f", c.busbw_factor) << "</td></tr>\n";
  os << "</table>\n";
  for (const AllToAllStat& t : a.all_to_all) {
    double mx = 0;
    for (const auto& row : t.matrix)
      for (double v : row) mx = std::max(mx, v);
    os << "<h2>All-to-all, group " << html_escape(t.group) << "</h2><p>" << t.count << " calls, size imbalance "
       << fmt("%.3f", t.imbalance) << " (max rank / mean). MB sent, row = sender.</p><table><tr><th></th>";
    for (int r : t.ranks) os << "<th>to " << r << "</th>";
    os << "</tr>\n";
    for (size_t i = 0; i < t.ranks.size(); ++i) {
      os << "<tr><th>from " << t.ranks[i] << "</th>";
      for (double v : t.matrix[i])
        os << "<td style=\"background:rgba(59,125,216," << fmt("%.2f", mx > 0 ? 0.8 * v / mx : 0) << ")\">"
           << fmt("%.3f", v / 1e6) << "</td>";
      os << "</tr>\n";
    }
    os << "</table>\n";
  }
  bool staged = false;
  for (const PipelineGroup& g : a.pipeline) staged |= g.ranks.size() > 1;
  if (staged) {
    os << "<h2>Pipeline bubble</h2><table><tr><th class=\"l\">group</th><th>rank</th><th>pp index</th><th>busy s</th>"
          "<th>span s</th><th>bubble</th></tr>\n";
    for (const PipelineGroup& g : a.pipeline)
      for (const PipelineRank& p : g.ranks)
        if (g.ranks.size() > 1)
          os << "<tr><td class=\"l\">" << html_escape(g.group) << "</td><td>" << p.rank << "</td><td>" << p.pp_index
           << "</td><td>" << fmt("%.4f", p.busy_s) << "</td><td>" << fmt("%.4f", p.span_s) << "</td><td>"
           << fmt("%.2f%%", 100 * p.bubble) << "</td></tr>\n";
    os << "</table>\n";
  }
  os << "</body></html>\n";
  return os.str();
}

}  // namespace moetron::tracefile
