// diff.cpp: two analyses compared (tracefile/diff.h). Not the analysis itself (analyze.cpp).
#include "tracefile/diff.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

namespace moetron::tracefile {

using json = nlohmann::json;

namespace {

struct Side {
  double step = 0, compute = 0, exposed = 0, idle = 0, flops = 0;
  std::map<std::string, double> by_kind, actions;
  double rank_steps = 0, steps = 0;
};

Side summarize(const Analysis& a) {
  Side s;
  const double n = a.ranks.empty() ? 1 : double(a.ranks.size());
  for (const RankBreakdown& r : a.ranks) {
    s.step += r.step_time_s / n, s.compute += r.compute_s / n, s.exposed += r.exposed_comm_s / n;
    s.idle += r.idle_s / n;
    for (const auto& [k, v] : r.exposed_comm_by_kind) s.by_kind[k] += v / n;
    for (const auto& [k, v] : r.action_s) s.actions[k] += v / n;
    s.rank_steps += r.steps;
  }
  s.steps = std::max(1.0, s.rank_steps / n);
  s.rank_steps = std::max(1.0, s.rank_steps);
  for (const KernelStat& k : a.kernels) s.flops += k.flops / s.rank_steps;
  return s;
}

struct Op {
  std::string kind;
  double time = 0, count = 0, rate = 0;
  std::string unit;
};

std::map<std::string, Op> ops_of(const Analysis& a, const Side& s) {
  std::map<std::string, Op> m;
  for (const KernelStat& k : a.kernels) {
    Op& o = m[k.name];
    o.kind = "kernel";
    o.time = k.total_s / s.rank_steps, o.count = double(k.count) / s.rank_steps;
    o.rate = k.flops > 0 ? k.flops_per_s : k.bytes_per_s;
    o.unit = k.flops > 0 ? "FLOP/s" : k.bytes > 0 ? "B/s" : "-";  // "-": the trace carries neither
  }
  // Modules by name (e.g. layer1.recompute): time inside them per rank and step (the hierarchy is per step).
  const double ranks = a.ranks.empty() ? 1 : double(a.ranks.size());
  for (const auto& nodes : a.hierarchy)
    for (const HierNode& n : nodes) {
      if (n.cat != Cat::Module) continue;
      Op& o = m["module:" + n.name];
      o.kind = "module", o.unit = "-";
      o.time += n.total_s / ranks;
      o.count += double(n.count) / ranks / s.steps;
    }
  // Collective kinds over every group: member time per rank and step; the bus rate over all their bytes.
  std::map<std::string, double> bus_bytes, transfer;
  for (const CollectiveStat& c : a.collectives) {
    Op& o = m["comm:" + c.kind];
    o.kind = "comm", o.unit = "busB/s";
    o.time += c.time_s / s.rank_steps;
    o.count += double(c.count) * double(c.group_size) / s.rank_steps;
    bus_bytes[c.kind] += c.bytes * c.busbw_factor, transfer[c.kind] += c.transfer_s;
  }
  for (auto& [k, t] : transfer)
    if (t > 0) m["comm:" + k].rate = bus_bytes[k] / t;
  return m;
}

std::vector<Delta> deltas(const std::map<std::string, double>& a, const std::map<std::string, double>& b) {
  std::set<std::string> keys;
  for (const auto& [k, v] : a) keys.insert(k);
  for (const auto& [k, v] : b) keys.insert(k);
  std::vector<Delta> out;
  for (const std::string& k : keys) {
    Delta d{k};
    if (auto it = a.find(k); it != a.end()) d.a = it->second;
    if (auto it = b.find(k); it != b.end()) d.b = it->second;
    out.push_back(d);
  }
  std::sort(out.begin(), out.end(), [](const Delta& x, const Delta& y) { return std::fabs(x.delta()) > std::fabs(y.delta()); });
  return out;
}

std::string sgn(double v, const char* f = "%+.3f") {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

json delta_json(const Delta& d) { return {{"name", d.name}, {"a", d.a}, {"b", d.b}, {"delta", d.delta()}}; }

}  // namespace

TraceDiff diff(const Analysis& a, const Analysis& b) {
  TraceDiff d;
  d.a_dir = a.dir, d.b_dir = b.dir, d.a_source = a.source, d.b_source = b.source;
  const Side sa = summarize(a), sb = summarize(b);
  d.step = {"step", sa.step, sb.step};
  d.categories = {{"compute", sa.compute, sb.compute}, {"exposed_comm", sa.exposed, sb.exposed}, {"idle", sa.idle, sb.idle}};
  d.flops = {"flops", sa.flops, sb.flops};
  d.exposed_comm_by_kind = deltas(sa.by_kind, sb.by_kind);
  d.actions = deltas(sa.actions, sb.actions);
  if (a.ranks.size() == b.ranks.size())
    for (size_t r = 0; r < a.ranks.size(); ++r)
      d.ranks.push_back({"rank " + std::to_string(r), a.ranks[r].step_time_s, b.ranks[r].step_time_s});
  const auto oa = ops_of(a, sa), ob = ops_of(b, sb);
  std::set<std::string> names;
  for (const auto& [k, v] : oa) names.insert(k);
  for (const auto& [k, v] : ob) names.insert(k);
  for (const std::string& n : names) {
    OpDelta o;
    o.name = n;
    auto ia = oa.find(n);
    auto ib = ob.find(n);
    const Op& any = ia != oa.end() ? ia->second : ib->second;
    o.kind = any.kind, o.rate_unit = any.unit;
    if (ia != oa.end()) o.time_a = ia->second.time, o.count_a = ia->second.count, o.rate_a = ia->second.rate;
    if (ib != ob.end()) o.time_b = ib->second.time, o.count_b = ib->second.count, o.rate_b = ib->second.rate;
    o.status = ia == oa.end() ? "new" : ib == ob.end() ? "missing" : "both";
    if (o.status == "new") d.new_ops.push_back(n);
    if (o.status == "missing") d.missing_ops.push_back(n);
    d.ops.push_back(o);
  }
  std::sort(d.ops.begin(), d.ops.end(), [](const OpDelta& x, const OpDelta& y) {
    return std::fabs(x.time_b - x.time_a) > std::fabs(y.time_b - y.time_a);
  });
  const Delta* big = &d.categories[0];
  for (const Delta& c : d.categories)
    if (std::fabs(c.delta()) > std::fabs(big->delta())) big = &c;
  d.largest = big->name;
  return d;
}

json to_json(const TraceDiff& d) {
  json j;
  j["a"] = {{"dir", d.a_dir}, {"source", d.a_source}};
  j["b"] = {{"dir", d.b_dir}, {"source", d.b_source}};
  j["step"] = delta_json(d.step);
  j["flops"] = delta_json(d.flops);
  for (const char* key : {"categories", "exposed_comm_by_kind", "actions", "ranks"}) j[key] = json::array();
  for (const Delta& x : d.categories) j["categories"].push_back(delta_json(x));
  for (const Delta& x : d.exposed_comm_by_kind) j["exposed_comm_by_kind"].push_back(delta_json(x));
  for (const Delta& x : d.actions) j["actions"].push_back(delta_json(x));
  for (const Delta& x : d.ranks) j["ranks"].push_back(delta_json(x));
  j["ops"] = json::array();
  for (const OpDelta& o : d.ops)
    j["ops"].push_back({{"name", o.name}, {"kind", o.kind}, {"status", o.status}, {"time_a_s", o.time_a},
                        {"time_b_s", o.time_b}, {"time_delta_s", o.time_b - o.time_a}, {"count_a", o.count_a},
                        {"count_b", o.count_b}, {"rate_a", o.rate_a}, {"rate_b", o.rate_b}, {"rate_unit", o.rate_unit}});
  j["new_ops"] = d.new_ops;
  j["missing_ops"] = d.missing_ops;
  j["largest_category"] = d.largest;
  return j;
}

std::string format_text(const TraceDiff& d, int top) {
  std::ostringstream os;
  char b[320];
  os << "A: " << d.a_dir << " (" << d.a_source << ")\nB: " << d.b_dir << " (" << d.b_source << ")\n";
  os << "ms per rank and step (mean over ranks); delta = B - A\n\n";
  std::snprintf(b, sizeof b, "%-22s %11s %11s %11s %8s\n", "category", "A", "B", "delta", "");
  os << b;
  auto row = [&](const Delta& x, const char* indent) {
    std::snprintf(b, sizeof b, "%s%-*s %11.3f %11.3f %11s %8s\n", indent, int(22 - std::string(indent).size()),
                  x.name.c_str(), 1e3 * x.a, 1e3 * x.b, sgn(1e3 * x.delta()).c_str(),
                  x.a > 0 ? sgn(100 * x.delta() / x.a, "%+.1f%%").c_str() : "");
    os << b;
  };
  row(d.step, "");
  for (const Delta& c : d.categories) {
    row(c, "  ");
    if (c.name == "exposed_comm")
      for (const Delta& k : d.exposed_comm_by_kind) row(k, "    ");
  }
  os << "step-time change " << sgn(1e3 * d.step.delta()) << " ms = compute " << sgn(1e3 * d.categories[0].delta())
     << " + exposed comm " << sgn(1e3 * d.categories[1].delta()) << " + idle " << sgn(1e3 * d.categories[2].delta())
     << "; largest: " << d.largest << "\n";
  if (d.flops.a > 0 && d.flops.b > 0) {
    std::snprintf(b, sizeof b, "kernel work %.4g -> %.4g FLOP per rank and step (%s)\n", d.flops.a, d.flops.b,
                  sgn(100 * d.flops.delta() / d.flops.a, "%+.1f%%").c_str());
    os << b;
  } else if (d.flops.a > 0 || d.flops.b > 0) {
    os << "kernel work: " << (d.flops.a > 0 ? "B" : "A") << "'s kernels carry no FLOPs\n";
  }
  if (!d.actions.empty()) {
    os << "\ntime in schedule actions\n";
    for (const Delta& x : d.actions) row(x, "  ");
  }
  if (!d.ranks.empty()) {
    os << "\nstep time per rank\n";
    for (const Delta& x : d.ranks) row(x, "  ");
  }
  os << "\nops by |time delta| (time and calls per rank and step; achieved rate)\n";
  std::snprintf(b, sizeof b, "%-30s %-7s %10s %10s %11s %7s %7s %10s %10s %s\n", "op", "status", "A ms", "B ms", "delta ms",
                "A n", "B n", "A rate", "B rate", "unit");
  os << b;
  for (size_t k = 0; k < d.ops.size() && int(k) < top; ++k) {
    const OpDelta& o = d.ops[k];
    std::snprintf(b, sizeof b, "%-30s %-7s %10.3f %10.3f %11s %7.1f %7.1f %10.3g %10.3g %s\n", o.name.c_str(),
                  o.status.c_str(), 1e3 * o.time_a, 1e3 * o.time_b, sgn(1e3 * (o.time_b - o.time_a)).c_str(), o.count_a, o.count_b,
                  o.rate_a, o.rate_b, o.rate_unit.c_str());
    os << b;
  }
  if (int(d.ops.size()) > top) os << "(" << d.ops.size() - size_t(top) << " more ops)\n";
  auto list = [&](const char* what, const std::vector<std::string>& v) {
    os << what << " (" << v.size() << "):";
    for (const std::string& s : v) os << " " << s;
    os << "\n";
  };
  os << "\n";
  list("new in B", d.new_ops);
  list("missing in B", d.missing_ops);
  return os.str();
}

}  // namespace moetron::tracefile
