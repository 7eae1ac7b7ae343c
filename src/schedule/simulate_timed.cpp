// simulate_timed.cpp: the timed replay of a lowered schedule (simulate_timed), the uniform duration table
// (Durations::uniform) and the closed bubble formula (bubble_formula). Not the lock-step simulator
// (simulate_lockstep.cpp) and not a model of overlapping communication with compute beyond what is stated
// below.
//
// Model. Each rank runs its list in order, one action at a time, from time 0:
//   F        f + a2a_f of its stage            I   i + a2a_b           B   i + w + a2a_b        W   w
//   FB       max(f + b, a2a_f + a2a_b), f and a2a_f of the forward half's stage, b (i + w for a B half, i for
//            an I half) and a2a_b of the backward half's stage: the compute of one half hides the other half's
//            exposed all-to-all.
//   With Durations::split_unpaired an F, I or B whose all-to-all is not zero runs as two half micro-batches:
//   split_chunk_time(f2, a2a_f2) (i2 / i2 + w2 and a2a_b2 for I / B). Its exposed all-to-all is that time less
//   the unsplit compute (f, i or i + w): the half-size GEMMs' loss is paid to hide the exchange.
//   With Durations::carry_w a B that is not a pair's half runs as an I (i + a2a_b, or split i2 and a2a_b2) and
//   queues its w (w2 when split) on its rank. Every action's exposed all-to-all (its duration less its compute)
//   then runs queued weight gradients inside the wait: up to the queue, which that much shrinks; the filled part
//   is no longer exposed. After its last action a rank runs what is still queued (busy, and its end moves).
//   Each queued weight gradient is reported in `carried` as a W over the seconds that ran it.
//   SEND     takes no time on its rank (non-blocking); the tensor is issued when the rank reaches it.
//   RECV     starts when the rank reaches it and ends at max(that time, issue time of the SEND + p2p).
// A compute action starts when its rank reaches it: its inputs were produced earlier on the rank or received
// by an earlier RECV (lowering guarantees it). The replay is event-driven: a rank blocked on a RECV resumes
// when the matching SEND is issued.
// Results: step_time = the latest end of any action; per rank busy = the summed durations of its compute
// actions (their exposed all-to-all included: it is work, not pipeline idle; a2a_exposed is that part alone),
// bubble_ratio = 1 - busy /
// step_time; whole bubble_ratio = 1 - sum(busy) / (pp * step_time); steps = simulate_lockstep's count for the
// same lowered schedule. Peak in-flight counts the activation sets (stage, mb) a rank holds: +1 when an F
// runs, -1 when the set is freed by its B or, with split backward, its W (an I frees nothing). An FB counts
// its forward's set before its backward frees one (both are live while they overlap). The peak is taken after
// every action; peak_inflight_microbatches = peak / the number of stages the rank owns.
// Requires a lowered schedule (lower()), except with pp = 1 where nothing crosses ranks; the schedule is
// validated first (check_valid).
#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <utility>

#include "moetron/check.h"
#include "moetron/schedule.h"
#include "schedule/sim_internal.h"

namespace moetron::sched {

namespace {

void check_cost(const char* what, int stage, const char* name, double v) {
  MT_CHECK(std::isfinite(v) && v >= 0, "schedule", what, ": stage ", stage, " ", name, " = ", v,
           " must be finite and >= 0");
}

}  // namespace

Durations Durations::uniform(int n_stages, double f, double b, double w, double p2p) {
  MT_CHECK(n_stages >= 1, "schedule", "Durations::uniform: n_stages = ", n_stages, " must be >= 1");
  const std::pair<const char*, double> args[] = {{"f", f}, {"b", b}, {"w", w}, {"p2p", p2p}};
  for (const auto& [name, v] : args)
    MT_CHECK(std::isfinite(v) && v >= 0, "schedule", "Durations::uniform: ", name, " = ", v,
             " must be finite and >= 0");
  MT_CHECK(w <= b, "schedule", "Durations::uniform: w = ", w, " must be <= b = ", b,
           " (a full backward B is the input gradient I plus the weight gradient W)");
  Durations d;
  d.stage.assign(size_t(n_stages), StageCost{f, b - w, w, 0, 0});
  d.p2p = p2p;
  return d;
}

double split_chunk_time(double x2, double a2, int n) {
  MT_CHECK(n >= 1, "schedule", "split_chunk_time: n = ", n, " exchanges per chunk must be >= 1");
  // n = 1: half 1 computes [0, x2/2] and exchanges [x2/2, x2/2 + a2/2]; half 2 computes [x2/2, x2] and
  // exchanges from max(x2, x2/2 + a2/2) for a2/2. Larger n: the same two streams, segment by segment.
  const double c = x2 / (2.0 * n), e = a2 / (2.0 * n);
  double compute_free = 0, comm_free = 0, ready[2] = {0, 0};  // ready: when a half's previous exchange ended
  for (int k = 0; k < n; ++k)
    for (int h = 0; h < 2; ++h) {
      compute_free = std::max(compute_free, ready[h]) + c;
      comm_free = std::max(comm_free, compute_free) + e;
      ready[h] = comm_free;
    }
  return comm_free;
}

double unpaired_time(double compute, double a2a, double x2, double a2, bool split, int n) {
  return split && a2a > 0 ? split_chunk_time(x2, a2, n) : compute + a2a;
}

double bubble_formula(int pp, int microbatches, int vpp) {
  MT_CHECK(pp >= 1 && microbatches >= 1 && vpp >= 1, "schedule", "bubble_formula: pp = ", pp,
           ", microbatches = ", microbatches, ", vpp = ", vpp, " must all be >= 1");
  return double(pp - 1) / (double(pp - 1) + double(microbatches) * double(vpp));
}

namespace {

void check_durations(const Schedule& s, const Durations& d) {
  MT_CHECK(s.lowered || s.pp == 1, "schedule", "simulate_timed: schedule '", s.name,
           "' is not lowered; run lower() first (the timed replay needs its SEND/RECV actions)");
  MT_CHECK(d.stage.empty() || int64_t(d.stage.size()) == s.n_stages, "schedule", "simulate_timed: durations for ",
           d.stage.size(), " stages, the schedule has n_stages = ", s.n_stages);
  MT_CHECK(std::isfinite(d.p2p) && d.p2p >= 0, "schedule", "simulate_timed: p2p = ", d.p2p,
           " must be finite and >= 0");
  for (size_t k = 0; k < d.stage.size(); ++k) {
    const StageCost& c = d.stage[k];
    check_cost("simulate_timed", int(k), "f", c.f);
    check_cost("simulate_timed", int(k), "i", c.i);
    check_cost("simulate_timed", int(k), "w", c.w);
    check_cost("simulate_timed", int(k), "a2a_f", c.a2a_f);
    check_cost("simulate_timed", int(k), "a2a_b", c.a2a_b);
    check_cost("simulate_timed", int(k), "f2", c.f2);
    check_cost("simulate_timed", int(k), "i2", c.i2);
    check_cost("simulate_timed", int(k), "w2", c.w2);
    check_cost("simulate_timed", int(k), "a2a_f2", c.a2a_f2);
    check_cost("simulate_timed", int(k), "a2a_b2", c.a2a_b2);
  }
}

// An action's compute and its all-to-all: F, I and B pay both in sequence; an FB's compute of one half hides
// the other half's exchange, so it lasts the longer of the two.
// An unpaired action split in two halves (Durations::split_unpaired) lasts split_chunk_time of its halves.
struct Cost {
  double compute = 0, a2a = 0;
  double compute2 = 0, a2a2 = 0;  // the two halves summed
  int n_a2a = 1;                  // exchanges per chunk: the halves alternate at each
  double duration(Op op, bool split) const {
    if (op == Op::FB) return std::max(compute, a2a);
    return unpaired_time(compute, a2a, compute2, a2a2, split, n_a2a);
  }
};

// The timed replay's state (the model in the file's opening comment): per rank its clock, its position in its
// list and, under carry_w, its queue of weight gradients; per message its SEND's issue time and the rank blocked
// on its RECV.
class Replay {
 public:
  Replay(const Schedule& s, const Durations& d)
      : s_(s), d_(d), ops_(size_t(s.pp)), clock_(size_t(s.pp), 0.0), carry_(size_t(s.pp)), pc_(size_t(s.pp), 0),
        issued_(cells() * 2, -1.0), waiter_(cells() * 2, -1) {
    res_.ranks.resize(size_t(s.pp));
  }

  TimedResult run() {
    std::vector<int> ready;
    for (int r = 0; r < s_.pp; ++r) {
      ready.push_back(r);
      ops_[size_t(r)].reserve(s_.actions[size_t(r)].size());
    }
    while (!ready.empty()) {
      const int r = ready.back();
      ready.pop_back();
      run_rank(r, ready);
    }
    for (int r = 0; r < s_.pp; ++r)
      MT_CHECK(pc_[size_t(r)] == s_.actions[size_t(r)].size(), "schedule", "simulate_timed: internal error: rank ", r,
               " stopped at action ", pc_[size_t(r)], " of a validated schedule");
    for (int r = 0; r < s_.pp; ++r) {  // carry_w: what no wait took runs after the rank's last action
      const double rest = run_carried(r, clock_[size_t(r)], std::numeric_limits<double>::infinity());
      clock_[size_t(r)] += rest;
      res_.ranks[size_t(r)].busy += rest;
    }
    finish();
    return std::move(res_);
  }

 private:
  // carry_w: a weight gradient not yet run (the W it becomes, its seconds left, and whether it has started).
  struct Carried {
    TimedOp w;
    double left = 0;
    bool started = false;
  };

  size_t cells() const { return size_t(s_.n_stages) * size_t(s_.n_microbatches); }
  size_t cell(const detail::Msg& m) const {
    return (size_t(m.stage) * size_t(s_.n_microbatches) + size_t(m.mb)) * 2 + (m.fwd ? 1 : 0);
  }
  const StageCost& cost(int stage) const { return d_.stage.empty() ? dflt_ : d_.stage[size_t(stage)]; }

  Cost action_cost(const Action& a) const {
    const StageCost& c = cost(a.stage);
    switch (a.op) {
      case Op::F: return {c.f, c.a2a_f, c.f2, c.a2a_f2, c.n_a2a};
      case Op::I: return {c.i, c.a2a_b, c.i2, c.a2a_b2, c.n_a2a};
      case Op::B:
        if (d_.carry_w) return {c.i, c.a2a_b, c.i2, c.a2a_b2, c.n_a2a};  // w queued (run_compute)
        return {c.i + c.w, c.a2a_b, c.i2 + c.w2, c.a2a_b2, c.n_a2a};
      case Op::W: return {c.w, 0};
      case Op::FB: {
        const StageCost& cb = cost(a.stage2);
        return {c.f + (a.op2 == Op::B ? cb.i + cb.w : cb.i), c.a2a_f + cb.a2a_b};
      }
      default: return {};
    }
  }

  // Runs up to `len` seconds of rank r's queue from time t0; returns the seconds run.
  double run_carried(int r, double t0, double len) {
    double t = t0;
    auto& q = carry_[size_t(r)];
    while (!q.empty() && t < t0 + len) {
      Carried& c = q.front();
      const double run = std::min(c.left, t0 + len - t);
      if (!c.started) c.w.start = t, c.started = true;
      t += run, c.left -= run;
      if (c.left > 0) break;  // the wait ended first
      c.w.end = t;
      res_.carried.push_back(c.w);
      q.pop_front();
    }
    return t - t0;
  }

  // A compute action from op.start: its end, the rank's busy and exposed all-to-all, and under carry_w the
  // queued weight gradients run inside its wait and, for a B, its own queued.
  void run_compute(int r, size_t idx, const Action& a, TimedOp& op) {
    const Cost c = action_cost(a);
    const double dur = c.duration(a.op, d_.split_unpaired);
    op.end = op.start + dur;
    res_.ranks[size_t(r)].busy += op.end - op.start;
    const double exposed = dur - c.compute;  // the wait: the action's tail
    const double fill = d_.carry_w ? run_carried(r, op.end - exposed, exposed) : 0.0;
    res_.ranks[size_t(r)].a2a_exposed += exposed - fill;
    if (d_.carry_w && a.op == Op::B) {
      const StageCost& sc = cost(a.stage);
      Carried q{TimedOp{r, int(idx), Action{Op::W, a.stage, a.mb}, 0, 0}, 0, false};
      q.left = d_.split_unpaired && c.a2a > 0 ? sc.w2 : sc.w;
      if (q.left > 0) carry_[size_t(r)].push_back(q);
    }
  }

  // Runs rank r until it blocks or finishes; ranks woken by its SENDs go to `ready`.
  void run_rank(int r, std::vector<int>& ready) {
    const auto& row = s_.actions[size_t(r)];
    double& t = clock_[size_t(r)];
    while (pc_[size_t(r)] < row.size()) {
      const size_t idx = pc_[size_t(r)];
      const Action& a = row[idx];
      TimedOp op{r, int(idx), a, t, t};
      if (is_compute(a.op)) {
        run_compute(r, idx, a, op);
      } else if (a.op == Op::SEND_F || a.op == Op::SEND_B) {
        const size_t c = cell(detail::msg_of(a));
        issued_[c] = t;
        if (waiter_[c] >= 0) {
          ready.push_back(waiter_[c]);
          waiter_[c] = -1;
        }
      } else {
        const size_t c = cell(detail::msg_of(a));
        if (issued_[c] < 0) {
          waiter_[c] = r;
          break;
        }
        op.end = std::max(t, issued_[c] + d_.p2p);
      }
      t = op.end;
      ops_[size_t(r)].push_back(op);
      ++pc_[size_t(r)];
    }
  }

  // Rank r's peak of held activation sets: +1 per F half, -1 per B or W half, the peak taken after the F halves.
  int peak_inflight(int r) const {
    int live = 0, peak = 0;
    for (const Action& a : s_.actions[size_t(r)]) {
      Action h[2];
      if (!is_compute(a.op)) continue;
      const int nh = detail::halves(a, h);
      for (int k = 0; k < nh; ++k) {
        if (h[k].op == Op::F) ++live;
        peak = std::max(peak, live);
      }
      for (int k = 0; k < nh; ++k)
        if (h[k].op == Op::B || h[k].op == Op::W) --live;
    }
    return peak;
  }

  // The step time, the bubbles, the in-flight peaks, the lock-step count and the ops rank by rank.
  void finish() {
    double total_busy = 0;
    for (int r = 0; r < s_.pp; ++r) res_.step_time = std::max(res_.step_time, clock_[size_t(r)]);
    for (int r = 0; r < s_.pp; ++r) {
      RankStats& rs = res_.ranks[size_t(r)];
      rs.rank = r;
      rs.bubble_ratio = res_.step_time > 0 ? 1.0 - rs.busy / res_.step_time : 0.0;
      total_busy += rs.busy;
      rs.peak_inflight = peak_inflight(r);
      const auto owned = std::count(s_.stage_rank.begin(), s_.stage_rank.end(), r);
      rs.peak_inflight_microbatches = double(rs.peak_inflight) / double(std::max<int64_t>(owned, 1));
    }
    res_.bubble_ratio = res_.step_time > 0 ? 1.0 - total_busy / (double(s_.pp) * res_.step_time) : 0.0;
    res_.steps = detail::lockstep(s_, nullptr, nullptr).steps;
    for (auto& row : ops_) res_.ops.insert(res_.ops.end(), row.begin(), row.end());
  }

  const Schedule& s_;
  const Durations& d_;
  const StageCost dflt_{};
  TimedResult res_;
  std::vector<std::vector<TimedOp>> ops_;
  std::vector<double> clock_;
  std::vector<std::deque<Carried>> carry_;
  std::vector<size_t> pc_;
  std::vector<double> issued_;  // SEND issue time per message
  std::vector<int> waiter_;     // rank blocked on a RECV of the message
};

}  // namespace

TimedResult simulate_timed(const Schedule& s, const Durations& d) {
  check_durations(s, d);
  check_valid(s);
  return Replay(s, d).run();
}

}  // namespace moetron::sched
