// analyze.cpp: the figures of `moetron trace analyze` (tracefile/analyze.h) computed from a run's traces:
// per-track innermost-event timelines, the compute / exposed communication / idle sweep, kernel self times and
// rooflines, the step > action > module > kernel hierarchy, collectives matched by (group, seq), the
// all-to-all matrices and the pipeline bubble. Not the report forms (analyze_report.cpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <set>
#include <tuple>

#include "tracefile/analyze.h"

namespace moetron::tracefile {

namespace {

constexpr double kUs = 1e-6;  // trace microseconds -> seconds
// Events that touch within a nanosecond are back to back, not nested (rounding of ts + dur in microseconds).
constexpr double kTouchUs = 1e-3;

bool is_p2p(const std::string& n) { return n == "send" || n == "recv"; }

struct Window {
  int64_t step = 0;
  double a = 0, b = 0;
};

// Nesting order on one track: by start; at one start, zero-length events (a send issued as the previous action
// ended) first, so they sit beside the events that start there rather than inside them; then longer first.
bool nest_order(const Event& x, const Event& y) {
  if (x.ts != y.ts) return x.ts < y.ts;
  if ((x.dur == 0) != (y.dur == 0)) return x.dur == 0;
  return x.dur > y.dur;
}

// A piece of one track's timeline labelled by its innermost kernel or comm event (-1: neither).
struct Seg {
  double a = 0, b = 0;
  int ev = -1;
};

// Innermost-event segments of one track from events that nest (sorted by start, longer first). An event that
// starts within kTouchUs of the open event's end follows it; one that overruns its parent is cut at the
// parent's end. The timeline never overlaps itself.
std::vector<Seg> innermost(const std::vector<Event>& evs, std::vector<int> idx) {
  std::sort(idx.begin(), idx.end(), [&](int x, int y) { return nest_order(evs[size_t(x)], evs[size_t(y)]); });
  std::vector<Seg> out;
  std::vector<std::pair<int, double>> stack;  // event, effective end
  double cur = -std::numeric_limits<double>::infinity();
  auto emit = [&](double a, double b, int ev) {
    if (b > a) out.push_back({a, b, ev});
  };
  for (int k : idx) {
    const Event& e = evs[size_t(k)];
    while (!stack.empty() && stack.back().second <= e.ts + kTouchUs) {
      emit(cur, stack.back().second, stack.back().first);
      cur = std::max(cur, stack.back().second);
      stack.pop_back();
    }
    if (!stack.empty()) emit(cur, e.ts, stack.back().first);
    cur = std::max(cur, e.ts);  // (a popped event may have ended up to kTouchUs after e.ts: e starts there)
    const double end = stack.empty() ? e.end() : std::min(e.end(), stack.back().second);
    stack.push_back({k, end});
  }
  while (!stack.empty()) {
    emit(cur, stack.back().second, stack.back().first);
    cur = std::max(cur, stack.back().second);
    stack.pop_back();
  }
  return out;
}

// Length of the union of [a, b) intervals clipped to [lo, hi).
double union_length(std::vector<std::pair<double, double>> iv, double lo, double hi) {
  for (auto& p : iv) p.first = std::max(p.first, lo), p.second = std::min(p.second, hi);
  std::sort(iv.begin(), iv.end());
  double total = 0, ca = 0, cb = -std::numeric_limits<double>::infinity();
  for (const auto& [a, b] : iv) {
    if (b <= a) continue;
    if (a > cb) {
      if (cb > ca) total += cb - ca;
      ca = a, cb = b;
    } else {
      cb = std::max(cb, b);
    }
  }
  if (cb > ca) total += cb - ca;
  return total;
}

// The window (sorted by start, not overlapping) holding ts, or -1.
int window_of(const std::vector<Window>& w, double ts) {
  auto it = std::upper_bound(w.begin(), w.end(), ts, [](double t, const Window& x) { return t < x.a; });
  if (it == w.begin()) return -1;
  --it;
  return ts < it->b ? int(it - w.begin()) : -1;
}

// Per-rank working state.
struct RankWork {
  const RankTrace* t = nullptr;
  std::vector<Window> windows;
  std::map<int, std::vector<Seg>> tracks;  // tid -> innermost kernel/comm segments
  std::vector<double> self_us;             // per event: self time from the segments (kernels and comm)
  std::vector<int> win;                    // per event: the window it starts in (-1: none)
  std::vector<std::vector<int>> in_window;  // per window: its events
};

RankWork prepare(const RankTrace& t) {
  RankWork w;
  w.t = &t;
  for (const Event& e : t.events)
    if (e.cat == Cat::Step) w.windows.push_back({e.step, e.ts, e.end()});
  std::sort(w.windows.begin(), w.windows.end(), [](const Window& x, const Window& y) { return x.a < y.a; });
  w.win.assign(t.events.size(), -1);
  w.in_window.resize(w.windows.size());
  for (size_t k = 0; k < t.events.size(); ++k)
    if ((w.win[k] = window_of(w.windows, t.events[k].ts)) >= 0) w.in_window[size_t(w.win[k])].push_back(int(k));
  std::map<int, std::vector<int>> by_tid;
  for (size_t k = 0; k < t.events.size(); ++k)
    if (t.events[k].cat == Cat::Kernel || t.events[k].cat == Cat::Comm) by_tid[t.events[k].tid].push_back(int(k));
  w.self_us.assign(t.events.size(), 0.0);
  for (auto& [tid, idx] : by_tid) {
    w.tracks[tid] = innermost(t.events, idx);
    for (const Seg& s : w.tracks[tid]) w.self_us[size_t(s.ev)] += s.b - s.a;
  }
  return w;
}

// The parallelism a communication event belongs to: its group's name up to the first '.'.
std::string group_kind(const RankTrace& t, const Event& e) {
  if (e.group.empty()) return "none";
  const auto it = t.meta.groups.find(e.group);
  const std::string& n = it == t.meta.groups.end() ? e.group : it->second.name;
  return n.substr(0, n.find('.'));
}

// compute / exposed comm / idle of one window, with the partitions by kernel, comm kind and comm group (microseconds).
void sweep(const RankWork& w, size_t wi, RankBreakdown& rb) {
  const auto& evs = w.t->events;
  const Window& win = w.windows[wi];
  std::vector<double> cuts{win.a, win.b};
  std::map<int, size_t> pos;  // per track: first segment that may cover the current piece
  for (const auto& [tid, segs] : w.tracks) {
    // Segments are ordered and do not overlap: the first one ending after the window's start opens it.
    const size_t first = size_t(std::partition_point(segs.begin(), segs.end(), [&](const Seg& x) { return x.b <= win.a; }) -
                                segs.begin());
    pos[tid] = first;
    for (size_t k = first; k < segs.size() && segs[k].a < win.b; ++k)
      cuts.push_back(std::max(segs[k].a, win.a)), cuts.push_back(std::min(segs[k].b, win.b));
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  double compute = 0, exposed = 0, comm = 0;
  for (size_t k = 0; k + 1 < cuts.size(); ++k) {
    const double a = cuts[k], b = cuts[k + 1], mid = 0.5 * (a + b), len = b - a;
    int kern = -1, com = -1;  // lowest track's innermost kernel / comm covering the piece
    for (const auto& [tid, segs] : w.tracks) {
      size_t& p = pos[tid];
      while (p < segs.size() && segs[p].b <= mid) ++p;
      if (p >= segs.size() || segs[p].a > mid) continue;
      const int ev = segs[p].ev;
      if (evs[size_t(ev)].cat == Cat::Kernel) {
        if (kern < 0) kern = ev;
      } else if (com < 0) {
        com = ev;
      }
    }
    if (com >= 0) comm += len;
    if (kern >= 0) {
      compute += len;
      rb.compute_by_kernel[evs[size_t(kern)].name] += len * kUs;
    } else if (com >= 0) {
      exposed += len;
      rb.exposed_comm_by_kind[evs[size_t(com)].name] += len * kUs;
      rb.exposed_comm_by_group[group_kind(*w.t, evs[size_t(com)])] += len * kUs;
    }
  }
  const double step = win.b - win.a;
  rb.step_time_s += step * kUs;
  rb.compute_s += compute * kUs;
  rb.exposed_comm_s += exposed * kUs;
  rb.idle_s += std::max(0.0, step - compute - exposed) * kUs;  // (max: rounding when the pieces fill the step)
  rb.comm_s += comm * kUs;
  for (int k : w.in_window[wi]) {
    const Event& e = evs[size_t(k)];
    if (e.cat == Cat::Action) rb.action_s[e.name] += (std::min(e.end(), win.b) - e.ts) * kUs;
  }
}

// Hierarchy of one rank: parents by nesting on each track, then aggregation by path.
std::vector<HierNode> hierarchy(const RankWork& w, int steps) {
  const auto& evs = w.t->events;
  std::vector<int> parent(evs.size(), -1);
  std::map<int, std::vector<int>> by_tid;
  for (size_t k = 0; k < evs.size(); ++k)
    if (evs[k].cat != Cat::Other) by_tid[evs[k].tid].push_back(int(k));
  for (auto& [tid, idx] : by_tid) {
    std::sort(idx.begin(), idx.end(), [&](int x, int y) { return nest_order(evs[size_t(x)], evs[size_t(y)]); });
    std::vector<int> stack;
    for (int k : idx) {
      while (!stack.empty() && evs[size_t(stack.back())].end() <= evs[size_t(k)].ts + kTouchUs) stack.pop_back();
      parent[size_t(k)] = stack.empty() ? -1 : stack.back();
      stack.push_back(k);
    }
  }
  // Children's time per event (clipped to the parent) for self times.
  std::vector<double> child_us(evs.size(), 0.0);
  for (size_t k = 0; k < evs.size(); ++k)
    if (parent[k] >= 0) {
      const Event& p = evs[size_t(parent[k])];
      child_us[size_t(parent[k])] += std::max(0.0, std::min(evs[k].end(), p.end()) - evs[k].ts);
    }
  std::map<std::string, HierNode> nodes;
  std::vector<std::string> path(evs.size());
  // Events are visited parents first (a parent starts no later and sorts first), so paths resolve in one pass
  // over events sorted by start.
  std::vector<int> order(evs.size());
  for (size_t k = 0; k < evs.size(); ++k) order[k] = int(k);
  std::sort(order.begin(), order.end(), [&](int x, int y) { return nest_order(evs[size_t(x)], evs[size_t(y)]); });
  std::vector<int> depth(evs.size(), -1);
  for (int k : order) {
    const Event& e = evs[size_t(k)];
    if (e.cat == Cat::Other) continue;
    const int p = parent[size_t(k)];
    if (p >= 0) {
      if (depth[size_t(p)] < 0) continue;  // under something outside every step
      path[size_t(k)] = path[size_t(p)] + "/" + e.name;
      depth[size_t(k)] = depth[size_t(p)] + 1;
    } else if (e.cat == Cat::Step) {
      path[size_t(k)] = "step", depth[size_t(k)] = 0;
    } else {
      if (w.win[size_t(k)] < 0) continue;
      path[size_t(k)] = "step/track" + std::to_string(e.tid) + "/" + e.name;  // another track's root event
      depth[size_t(k)] = 1;
    }
    HierNode& n = nodes[path[size_t(k)]];
    n.path = path[size_t(k)], n.name = e.name, n.cat = e.cat, n.depth = depth[size_t(k)];
    ++n.count;
    n.total_s += e.dur * kUs;
    n.self_s += std::max(0.0, e.dur - child_us[size_t(k)]) * kUs;
  }
  // Depth-first order, children by time.
  std::map<std::string, std::vector<const HierNode*>> kids;
  std::vector<const HierNode*> roots;
  for (const auto& [p, n] : nodes) {
    const size_t cut = p.rfind('/');
    std::string par = cut == std::string::npos ? "" : p.substr(0, cut);
    if (n.depth == 1 && p.rfind("step/track", 0) == 0) par = "step";
    if (par.empty() || !nodes.count(par)) roots.push_back(&n);
    else kids[par].push_back(&n);
  }
  std::vector<HierNode> out;
  const double div = std::max(1, steps);
  auto by_time = [](const HierNode* x, const HierNode* y) { return x->total_s > y->total_s; };
  std::function<void(const HierNode*)> visit = [&](const HierNode* n) {
    HierNode c = *n;
    c.total_s /= div, c.self_s /= div;
    out.push_back(c);
    auto it = kids.find(n->path);
    if (it == kids.end()) return;
    std::sort(it->second.begin(), it->second.end(), by_time);
    for (const HierNode* k : it->second) visit(k);
  };
  std::sort(roots.begin(), roots.end(), by_time);
  for (const HierNode* r : roots) visit(r);
  return out;
}

struct Member {
  int rank;
  const Event* e;
};

// The bytes one collective moves, by kind: the output for all_gather, the input otherwise (mean over members).
double collective_bytes(const std::string& kind, const std::vector<Member>& ms) {
  double s = 0;
  for (const Member& m : ms) s += kind == "all_gather" ? m.e->bytes_out : m.e->bytes_in;
  return ms.empty() ? 0 : s / double(ms.size());
}

}  // namespace

double busbw_factor(const std::string& kind, int n) {
  if (n < 1) return 0;
  const double f = double(n - 1) / double(n);
  if (kind == "all_reduce") return 2 * f;
  if (kind == "reduce_scatter" || kind == "all_gather" || kind == "all_to_all" || kind == "exchange") return f;
  return 0;
}

namespace {

// The roofline's limits: the options', else the largest figure over the ranks (every rank measured the same kind
// of machine at start-up, some while others competed for its cores), with a warning when they differ by 10%.
void set_limits(const Trace& t, const AnalyzeOptions& o, Analysis& an) {
  an.limits = o.limits ? *o.limits : t.ranks[0].meta.limits;
  if (o.limits) return;
  double f_lo = an.limits.flops_per_s, b_lo = an.limits.bytes_per_s;
  for (const RankTrace& r : t.ranks) {
    const Limits& l = r.meta.limits;
    an.limits.flops_per_s = std::max(an.limits.flops_per_s, l.flops_per_s);
    an.limits.bytes_per_s = std::max(an.limits.bytes_per_s, l.bytes_per_s);
    f_lo = std::min(f_lo, l.flops_per_s), b_lo = std::min(b_lo, l.bytes_per_s);
  }
  if (f_lo < 0.9 * an.limits.flops_per_s || b_lo < 0.9 * an.limits.bytes_per_s) {
    char b[256];
    std::snprintf(b, sizeof b,
                  "the ranks' moetron.limits differ by more than 10%% (%.3g..%.3g FLOP/s, %.3g..%.3g B/s): the "
                  "roofline uses the largest",
                  f_lo, an.limits.flops_per_s, b_lo, an.limits.bytes_per_s);
    an.warnings.push_back(b);
  }
}

// One rank's breakdown: its windows swept, averaged per step, and its peak memory counters.
RankBreakdown rank_breakdown(const RankWork& w, int rank) {
  RankBreakdown rb;
  rb.rank = rank;
  rb.steps = int(w.windows.size());
  for (size_t wi = 0; wi < w.windows.size(); ++wi) sweep(w, wi, rb);
  if (rb.steps > 0) {
    const double d = rb.steps;
    rb.step_time_s /= d, rb.compute_s /= d, rb.exposed_comm_s /= d, rb.idle_s /= d, rb.comm_s /= d;
    for (auto* m : {&rb.compute_by_kernel, &rb.exposed_comm_by_kind, &rb.exposed_comm_by_group, &rb.action_s})
      for (auto& [k, v] : *m) v /= d;
  }
  for (const Counter& c : w.t->memory)
    for (const auto& [k, v] : c.values) rb.peak_memory_bytes[k] = std::max(rb.peak_memory_bytes[k], v);
  return rb;
}

// The kernels' totals over every rank's steps, then per rank-step, their rates and the roofline bound, by time.
void add_kernels(const std::vector<RankWork>& work, int64_t rank_steps, Analysis& an) {
  std::map<std::string, KernelStat> kstats;
  for (const RankWork& w : work) {
    const auto& evs = w.t->events;
    for (size_t k = 0; k < evs.size(); ++k) {
      const Event& e = evs[k];
      if (e.cat != Cat::Kernel || w.win[k] < 0) continue;
      KernelStat& ks = kstats[e.name];
      ks.name = e.name;
      ++ks.count;
      ks.total_s += w.self_us[k] * kUs;
      ks.flops += e.flops, ks.bytes += e.bytes;
    }
  }
  for (auto& [name, ks] : kstats) {
    ks.per_rank_step_s = rank_steps > 0 ? ks.total_s / double(rank_steps) : 0;
    if (ks.total_s > 0) ks.flops_per_s = ks.flops / ks.total_s, ks.bytes_per_s = ks.bytes / ks.total_s;
    ks.intensity = ks.bytes > 0 ? ks.flops / ks.bytes : 0;
    ks.bound = "unknown";
    if (an.limits.known() && ks.total_s > 0 && (ks.flops > 0 || ks.bytes > 0)) {
      const double ridge = an.limits.flops_per_s / an.limits.bytes_per_s;
      const bool compute = ks.bytes <= 0 || ks.intensity >= ridge;
      ks.bound = compute ? "compute" : "memory";
      ks.limit_share = compute ? ks.flops_per_s / an.limits.flops_per_s : ks.bytes_per_s / an.limits.bytes_per_s;
    }
    an.kernels.push_back(ks);
  }
  std::sort(an.kernels.begin(), an.kernels.end(),
            [](const KernelStat& x, const KernelStat& y) { return x.total_s > y.total_s; });
}

// Breakdown, hierarchy and kernels, rank by rank.
void add_ranks(const std::vector<RankWork>& work, Analysis& an) {
  int64_t rank_steps = 0;
  for (size_t r = 0; r < work.size(); ++r) {
    const RankWork& w = work[r];
    const RankBreakdown rb = rank_breakdown(w, int(r));
    if (rb.steps != an.steps)
      an.warnings.push_back("rank " + std::to_string(r) + " holds " + std::to_string(rb.steps) +
                            " step events, rank 0 holds " + std::to_string(an.steps));
    an.ranks.push_back(rb);
    an.hierarchy.push_back(hierarchy(w, rb.steps));
    rank_steps += rb.steps;
    an.dropped_events += w.t->meta.dropped_events;
  }
  if (an.dropped_events > 0)
    an.warnings.push_back(std::to_string(an.dropped_events) +
                          " events were dropped by the recorder's cap ([profiling] max_events): figures are partial");
  add_kernels(work, rank_steps, an);
}

// The collective instances inside a step on some rank, keyed by (group, seq), with their members.
using Instances = std::map<std::pair<std::string, int64_t>, std::vector<Member>>;
Instances collective_instances(const std::vector<RankWork>& work) {
  Instances inst;
  for (size_t r = 0; r < work.size(); ++r)
    for (const Event& e : work[r].t->events)
      if (e.cat == Cat::Comm && !is_p2p(e.name) && !e.group.empty() && e.seq >= 0 &&
          window_of(work[r].windows, e.ts) >= 0)
        inst[{e.group, e.seq}].push_back({int(r), &e});
  return inst;
}

// The straggler of one collective: the member with the shortest duration (it arrived last and waited least);
// ties go to the later start, then the lower rank.
size_t straggler_of(const std::vector<Member>& ms) {
  size_t s = 0;
  for (size_t k = 1; k < ms.size(); ++k) {
    const Event& a = *ms[k].e;
    const Event& b = *ms[s].e;
    if (a.dur < b.dur || (a.dur == b.dur && (a.ts > b.ts || (a.ts == b.ts && ms[k].rank < ms[s].rank)))) s = k;
  }
  return s;
}

// One all-to-all instance added to its group's matrix: who sent what to whom, and the send imbalance.
void add_all_to_all(AllToAllStat& at, const std::string& id, const Group& g, const std::vector<Member>& ms) {
  const size_t n = g.ranks.size();
  if (at.matrix.empty()) {
    at.group = id, at.group_name = g.name, at.ranks = g.ranks;
    at.matrix.assign(n, std::vector<double>(n, 0.0));
    at.sent.assign(n, 0.0), at.received.assign(n, 0.0);
  }
  ++at.count;
  std::vector<double> sent(n, 0.0);
  for (const Member& m : ms) {
    const size_t i = size_t(std::find(g.ranks.begin(), g.ranks.end(), m.rank) - g.ranks.begin());
    for (size_t j = 0; j < n && j < m.e->send_bytes.size(); ++j) {
      at.matrix[i][j] += m.e->send_bytes[j];
      at.received[j] += m.e->send_bytes[j];
      sent[i] += m.e->send_bytes[j];
    }
    at.sent[i] += sent[i];
  }
  double mx = 0, mean = 0;
  for (double v : sent) mx = std::max(mx, v), mean += v / double(n);
  const double imb = mean > 0 ? mx / mean : 1.0;
  at.imbalance_mean += imb;
  at.imbalance_max = std::max(at.imbalance_max, imb);
}

// The collectives' tallies while they are matched: by (kind, group name, size), all-to-all matrices by group, and
// per rank the wait it caused and the wait it sat in (seconds, summed over steps).
struct CollectiveTally {
  std::map<std::tuple<std::string, std::string, int>, CollectiveStat> stats;
  std::map<std::string, AllToAllStat> a2a;
  std::vector<double> caused, waited;
  std::set<std::string> warned_kinds;
};

// One complete instance: its transfer (the straggler's duration), each member's wait, its bytes and matrix.
void add_instance(const std::pair<std::string, int64_t>& key, const std::vector<Member>& ms, const Group& g,
                  CollectiveTally& ct, Analysis& an) {
  const std::string& kind = ms[0].e->name;
  for (const Member& m : ms)
    if (m.e->name != kind && ct.warned_kinds.insert(key.first).second)
      an.warnings.push_back("group '" + key.first + "' seq " + std::to_string(key.second) + ": rank " +
                            std::to_string(m.rank) + " ran '" + m.e->name + "', rank " + std::to_string(ms[0].rank) +
                            " ran '" + kind + "'");
  const size_t s = straggler_of(ms);
  const double transfer = ms[s].e->dur * kUs;
  double wait = 0, total = 0;
  for (const Member& m : ms) {
    const double wr = m.e->dur * kUs - transfer;
    ct.waited[size_t(m.rank)] += wr;
    wait += wr, total += m.e->dur * kUs;
  }
  ct.caused[size_t(ms[s].rank)] += wait;
  CollectiveStat& cs = ct.stats[{kind, g.name, int(g.ranks.size())}];
  cs.kind = kind, cs.group_name = g.name, cs.group_size = int(g.ranks.size());
  ++cs.count;
  cs.bytes += collective_bytes(kind, ms);
  cs.time_s += total, cs.transfer_s += transfer, cs.wait_s += wait;
  if ((kind == "all_to_all" || kind == "exchange") && !ms[0].e->send_bytes.empty())
    add_all_to_all(ct.a2a[key.first], key.first, g, ms);
}

// Collectives matched by (group, seq) over the ranks: per-kind rates, all-to-all matrices, waits and the straggler.
void add_collectives(const std::vector<RankWork>& work, Analysis& an) {
  CollectiveTally ct;
  ct.caused.assign(work.size(), 0.0), ct.waited.assign(work.size(), 0.0);
  for (auto& [key, ms] : collective_instances(work)) {
    const Group& g = work[size_t(ms[0].rank)].t->meta.groups.at(key.first);
    std::set<int> seen;
    for (const Member& m : ms) seen.insert(m.rank);
    const bool complete = seen.size() == ms.size() && seen == std::set<int>(g.ranks.begin(), g.ranks.end());
    if (!complete) {
      ++an.unmatched_collectives;
      continue;
    }
    ++an.matched_collectives;
    add_instance(key, ms, g, ct, an);
  }
  if (an.unmatched_collectives > 0)
    an.warnings.push_back(std::to_string(an.unmatched_collectives) +
                          " collectives were not found on every member of their group (left out of the wait "
                          "analysis)");
  for (auto& [k, cs] : ct.stats) {
    cs.busbw_factor = busbw_factor(cs.kind, cs.group_size);
    cs.algbw = cs.transfer_s > 0 ? cs.bytes / cs.transfer_s : 0;
    cs.busbw = cs.algbw * cs.busbw_factor;
    an.collectives.push_back(cs);
  }
  std::sort(an.collectives.begin(), an.collectives.end(),
            [](const CollectiveStat& x, const CollectiveStat& y) { return x.time_s > y.time_s; });
  for (auto& [id, at] : ct.a2a) {
    at.imbalance_mean /= double(std::max<int64_t>(1, at.count));
    double mx = 0, mean = 0;
    for (double v : at.sent) mx = std::max(mx, v), mean += v / double(at.sent.size());
    at.imbalance = mean > 0 ? mx / mean : 1.0;
    an.all_to_all.push_back(at);
  }
  double most = 0;
  for (size_t r = 0; r < work.size(); ++r) {
    const double d = std::max(1, an.ranks[r].steps);
    an.ranks[r].comm_wait_s = ct.waited[r] / d;
    an.ranks[r].wait_caused_s = ct.caused[r] / d;
    if (ct.caused[r] > most) most = ct.caused[r], an.straggler_rank = int(r);
  }
}

// The pipeline groups: one per distinct "pp" group, then each rank in none standing alone.
std::vector<std::pair<std::string, std::vector<int>>> pipeline_members(const Trace& t, size_t n_ranks) {
  std::map<std::string, std::vector<int>> ppg;
  std::vector<char> placed(n_ranks, 0);
  for (const RankTrace& r : t.ranks)
    for (const auto& [id, g] : r.meta.groups)
      if (g.name == "pp" && !ppg.count(id)) {
        ppg[id] = g.ranks;
        for (int m : g.ranks) placed[size_t(m)] = 1;
      }
  std::vector<std::pair<std::string, std::vector<int>>> groups(ppg.begin(), ppg.end());
  for (size_t r = 0; r < n_ranks; ++r)
    if (!placed[r]) groups.push_back({"", {int(r)}});
  return groups;
}

// One step of a pipeline group: the span of the schedule's ops (actions, sends and receives) over the group's
// ranks, as in a pipeline record, and each rank's action intervals. False when a member lacks the step or the
// span is empty.
bool step_span(const std::vector<RankWork>& work, const std::vector<int>& members, int64_t step, double& lo,
               double& hi, std::vector<std::vector<std::pair<double, double>>>& acts) {
  lo = std::numeric_limits<double>::infinity(), hi = -lo;
  acts.assign(members.size(), {});
  for (size_t i = 0; i < members.size(); ++i) {
    const RankWork& w = work[size_t(members[i])];
    auto it = std::find_if(w.windows.begin(), w.windows.end(), [&](const Window& x) { return x.step == step; });
    if (it == w.windows.end()) return false;
    for (int k : w.in_window[size_t(it - w.windows.begin())]) {
      const Event& e = w.t->events[size_t(k)];
      const bool act = e.cat == Cat::Action, p2p = e.cat == Cat::Comm && is_p2p(e.name);
      if (act) acts[i].push_back({e.ts, e.end()});
      if (act || p2p) lo = std::min(lo, e.ts), hi = std::max(hi, e.end());
    }
  }
  return hi > lo;
}

// Pipeline bubbles: per group and rank, busy time over the step's span, averaged over the steps every member ran.
void add_pipeline(const Trace& t, const std::vector<RankWork>& work, Analysis& an) {
  for (const auto& [id, members] : pipeline_members(t, work.size())) {
    PipelineGroup pg;
    pg.group = id;
    for (size_t i = 0; i < members.size(); ++i) pg.ranks.push_back({members[i], int(i)});
    double group_bubble = 0;  // summed over steps
    int n_steps = 0;
    for (const Window& w0 : work[size_t(members[0])].windows) {
      double lo = 0, hi = 0;
      std::vector<std::vector<std::pair<double, double>>> acts;
      if (!step_span(work, members, w0.step, lo, hi, acts)) continue;
      ++n_steps;
      const double span = hi - lo;
      double busy_sum = 0;
      for (size_t i = 0; i < members.size(); ++i) {
        const double busy = union_length(acts[i], lo, hi);
        pg.ranks[i].busy_s += busy * kUs, pg.ranks[i].span_s += span * kUs;
        pg.ranks[i].bubble += 1 - busy / span;
        busy_sum += busy;
      }
      group_bubble += 1 - busy_sum / (span * double(members.size()));
    }
    if (n_steps == 0) continue;
    for (PipelineRank& pr : pg.ranks) pr.busy_s /= n_steps, pr.span_s /= n_steps, pr.bubble /= n_steps;
    pg.bubble = group_bubble / n_steps;
    an.pipeline.push_back(pg);
  }
}

}  // namespace

Analysis analyze(const Trace& t, const AnalyzeOptions& o) {
  Analysis an;
  an.dir = t.dir;
  an.world = t.world();
  if (t.ranks.empty()) return an;
  an.source = t.ranks[0].meta.source;
  set_limits(t, o, an);
  std::vector<RankWork> work;
  work.reserve(t.ranks.size());
  for (const RankTrace& r : t.ranks) work.push_back(prepare(r));
  an.steps = int(work[0].windows.size());
  if (an.steps == 0) an.warnings.push_back("rank 0's trace holds no step event: nothing to break down");
  add_ranks(work, an);
  add_collectives(work, an);
  add_pipeline(t, work, an);
  return an;
}

}  // namespace moetron::tracefile
