// test_generators.cpp: the built-in schedule generators (gpipe, 1f1b, interleaved_1f1b, zb1p, zbv,
// dualpipev) against facts derived independently of the generator code: per-stage completeness, placement,
// warm-up counts from Megatron's formulas, ZB-H1's I/W split and memory bound, the V placement, DualPipeV's
// overlapped pairs, golden CSV files checked by eye against the published diagrams, and refused
// preconditions. A naive list-scheduling replay in this file (not simulate_timed) gives step times and
// bubble ratios that are compared with the closed formulas. Not the lowering pass or the simulators' own
// tests (test_validate.cpp, test_simulate.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "../unit/test_util.h"
#include "moetron/check.h"
#include "moetron/schedule.h"

using namespace moetron;
using namespace moetron::sched;

namespace {

using moetron::testing::error_of;

std::vector<Action> halves(const Action& a) {
  if (a.op == Op::FB) return {fwd_half(a), bwd_half(a)};
  return {a};
}

// Naive structure check: every compute action on the rank that owns its stage, per stage exactly M forwards,
// per (stage, mb) one B or one I then one W, B/I after the F, W after the I. Returns "" when all hold.
std::string structure_error(const Schedule& s) {
  if (int(s.actions.size()) != s.pp) return "wrong number of rows";
  if (int(s.stage_rank.size()) != s.n_stages) return "wrong stage_rank size";
  std::map<std::tuple<int, int, int>, int> seen;  // (kind F=0 B=1 I=2 W=3, stage, mb) -> count
  auto kind = [](Op op) { return op == Op::F ? 0 : op == Op::B ? 1 : op == Op::I ? 2 : 3; };
  for (int r = 0; r < s.pp; ++r)
    for (const Action& whole : s.actions[size_t(r)])
      for (const Action& a : halves(whole)) {
        const std::string where = "rank " + std::to_string(r) + " '" + to_string(whole) + "': ";
        if (!is_compute(a.op)) return where + "not a compute action";
        if (a.stage < 0 || a.stage >= s.n_stages || a.mb < 0 || a.mb >= s.n_microbatches)
          return where + "out of range";
        if (s.stage_rank[size_t(a.stage)] != r) return where + "stage owned by another rank";
        auto has = [&](int k) { return seen.count({k, a.stage, a.mb}) > 0; };
        if ((a.op == Op::B || a.op == Op::I) && !has(0)) return where + "backward before its forward";
        if (a.op == Op::W && !has(2)) return where + "W before its I";
        if (++seen[{kind(a.op), a.stage, a.mb}] > 1) return where + "duplicate";
      }
  for (int st = 0; st < s.n_stages; ++st)
    for (int m = 0; m < s.n_microbatches; ++m) {
      const bool f = seen.count({0, st, m}), b = seen.count({1, st, m}), i = seen.count({2, st, m}),
                 w = seen.count({3, st, m});
      if (!f) return "stage " + std::to_string(st) + " mb " + std::to_string(m) + ": no F";
      if (!((b && !i && !w) || (!b && i && w)))
        return "stage " + std::to_string(st) + " mb " + std::to_string(m) + ": incomplete backward";
    }
  return "";
}

// Naive replay: each rank runs its list in order; an action starts when the rank is free and its inputs are
// ready (F after the previous stage's F, B/I after this stage's F and the next stage's B/I, W after its I);
// no communication cost. Returns step time (< 0 on a deadlock), per-rank busy time and per-rank peak count of
// (stage, mb) activation sets held (F done, B or W not yet).
struct Replay {
  double step_time = -1;
  std::vector<double> busy;
  std::vector<int> peak;
  double bubble() const {
    double b = 0;
    for (double x : busy) b += x;
    return 1 - b / (double(busy.size()) * step_time);
  }
};
Replay replay(const Schedule& s, double f, double i, double w) {
  Replay out;
  out.busy.assign(size_t(s.pp), 0);
  out.peak.assign(size_t(s.pp), 0);
  std::map<std::tuple<int, int, int>, double> end;  // (0 F, 1 B/I, 2 W-or-B), stage, mb
  std::vector<size_t> pos(size_t(s.pp), 0);
  std::vector<double> t(size_t(s.pp), 0);
  std::vector<int> held(size_t(s.pp), 0);
  auto ready = [&](const Action& a, double& at) {
    auto need = [&](int k, int st) {
      auto it = end.find({k, st, a.mb});
      if (it == end.end()) return false;
      at = std::max(at, it->second);
      return true;
    };
    if (a.op == Op::F) return a.stage == 0 || need(0, a.stage - 1);
    if (a.op == Op::W) return need(1, a.stage);
    return need(0, a.stage) && (a.stage == s.n_stages - 1 || need(1, a.stage + 1));
  };
  auto cost = [&](const Action& a) { return a.op == Op::F ? f : a.op == Op::B ? i + w : a.op == Op::I ? i : w; };
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < s.pp; ++r) {
      const auto& row = s.actions[size_t(r)];
      while (pos[size_t(r)] < row.size()) {
        const Action& a = row[pos[size_t(r)]];
        double at = t[size_t(r)];
        bool ok = true;
        for (const Action& h : halves(a)) ok = ok && ready(h, at);
        if (!ok) break;
        double d = 0;
        for (const Action& h : halves(a)) d += cost(h);
        t[size_t(r)] = at + d;
        out.busy[size_t(r)] += d;
        for (const Action& h : halves(a)) {
          const int k = h.op == Op::F ? 0 : h.op == Op::W ? 2 : 1;
          end[{k, h.stage, h.mb}] = at + d;
          if (h.op == Op::B) end[{2, h.stage, h.mb}] = at + d;
          held[size_t(r)] += h.op == Op::F ? 1 : (h.op == Op::B || h.op == Op::W) ? -1 : 0;
          out.peak[size_t(r)] = std::max(out.peak[size_t(r)], held[size_t(r)]);
        }
        ++pos[size_t(r)];
        progress = true;
      }
    }
  }
  for (int r = 0; r < s.pp; ++r)
    if (pos[size_t(r)] < s.actions[size_t(r)].size()) return out;  // deadlock: step_time stays -1
  out.step_time = 0;
  for (double x : t) out.step_time = std::max(out.step_time, x);
  return out;
}

GenSpec spec(const std::string& name, int pp, int vpp, int m, int group = 0) { return {name, pp, vpp, m, group}; }

int vpp_of(const std::string& name) { return is_v_shape(name) ? 2 : name == "interleaved_1f1b" ? 2 : 1; }

// Leading forwards of a rank's list (the F's before its first backward of any kind).
int forwards_before_first_backward(const std::vector<Action>& row) {
  int n = 0;
  for (const Action& a : row) {
    if (a.op != Op::F) break;
    ++n;
  }
  return n;
}

}  // namespace

TEST(ScheduleGenerators, NamesAndKinds) {
  EXPECT_EQ(schedule_names(),
            (std::vector<std::string>{"gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev"}));
  for (const auto& n : schedule_names()) {
    EXPECT_EQ(uses_split_backward(n), n == "zb1p" || n == "zbv" || n == "dualpipev") << n;
    EXPECT_EQ(is_v_shape(n), n == "zbv" || n == "dualpipev") << n;
  }
  EXPECT_FALSE(is_v_shape("nope"));
  EXPECT_FALSE(uses_split_backward("1f1b"));
}

TEST(ScheduleGenerators, EveryGeneratorIsCompleteAndRunsInDependencyOrder) {
  for (const auto& name : schedule_names())
    for (int pp = 1; pp <= 5; ++pp)
      for (int m : {1, 2, 3, 4, 5, 6, 8, 10, 12, 13}) {
        GenSpec g = spec(name, pp, vpp_of(name), m);
        if (!error_of([&] { check_spec(g); }).empty()) continue;  // precondition tests are below
        const Schedule s = generate(g);
        const std::string ctx = name + " pp" + std::to_string(pp) + " m" + std::to_string(m);
        EXPECT_EQ(s.name, name) << ctx;
        EXPECT_EQ(s.pp, pp) << ctx;
        EXPECT_EQ(s.n_stages, pp * g.vpp) << ctx;
        EXPECT_EQ(s.n_microbatches, m) << ctx;
        EXPECT_FALSE(s.lowered) << ctx;
        EXPECT_EQ(s.stage_rank, is_v_shape(name) ? v_placement(pp) : loop_placement(pp, pp * g.vpp)) << ctx;
        EXPECT_EQ(structure_error(s), "") << ctx;
        EXPECT_GT(replay(s, 1, 1, 1).step_time, 0) << ctx << ": deadlock\n" << to_text(s);
        // Only the split schedules use I/W; only dualpipev uses FB.
        for (const auto& row : s.actions)
          for (const Action& a : row) {
            if (!uses_split_backward(name)) {
              EXPECT_TRUE(a.op == Op::F || a.op == Op::B) << ctx;
            }
            if (name != "dualpipev") {
              EXPECT_NE(a.op, Op::FB) << ctx;
            }
            if (name == "zbv" || name == "zb1p") {
              EXPECT_NE(a.op, Op::B) << ctx;
            }
          }
      }
}

TEST(ScheduleGenerators, GPipeRunsAllForwardsFirst) {
  const Schedule s = generate(spec("gpipe", 3, 1, 5));
  for (int r = 0; r < 3; ++r) {
    const auto& row = s.actions[size_t(r)];
    ASSERT_EQ(row.size(), 10u);
    EXPECT_EQ(forwards_before_first_backward(row), 5);
    for (int m = 0; m < 5; ++m) EXPECT_EQ(row[size_t(5 + m)], B(r, m));
  }
  // GPipe holds every micro-batch: peak in-flight = m on every rank.
  for (int p : replay(s, 1, 1, 1).peak) EXPECT_EQ(p, 5);
}

TEST(ScheduleGenerators, OneFOneBWarmupAndAlternation) {
  for (int pp : {1, 2, 4, 6})
    for (int m : {pp, pp + 1, 2 * pp + 3}) {
      const Schedule s = generate(spec("1f1b", pp, 1, m));
      const Replay rp = replay(s, 1, 1, 1);
      for (int r = 0; r < pp; ++r) {
        const auto& row = s.actions[size_t(r)];
        // Megatron: pp-1-r warm-up forwards, then the steady phase opens with a forward before the first B.
        const int warm = pp - 1 - r;
        EXPECT_EQ(forwards_before_first_backward(row), warm + 1) << "pp" << pp << " m" << m << " rank " << r;
        // After the warm-up: F B F B ... while forwards remain, then the remaining B's.
        for (int k = 0; k < m - warm; ++k) {
          EXPECT_EQ(row[size_t(warm + 2 * k)], F(r, warm + k));
          EXPECT_EQ(row[size_t(warm + 2 * k + 1)], B(r, k));
        }
        EXPECT_EQ(rp.peak[size_t(r)], pp - r);  // activation sets held peak at pp - rank
      }
    }
}

TEST(ScheduleGenerators, OneFOneBBubbleMatchesClosedForm) {
  // Equal F and B times (F = 1, B = 1 as I + W = 0.5 + 0.5) and B = 2F both give (p-1)/(m+p-1).
  for (int pp : {2, 4, 16})
    for (int m : {pp, 2 * pp, 3 * pp + 1}) {
      const Schedule s = generate(spec("1f1b", pp, 1, m));
      const double want = double(pp - 1) / double(m + pp - 1);
      EXPECT_NEAR(replay(s, 1, 0.5, 0.5).bubble(), want, 1e-12) << pp << " " << m;
      EXPECT_NEAR(replay(s, 1, 1, 1).bubble(), want, 1e-12) << pp << " " << m;
    }
  // The seed documents' PP16 GA16 figure: 15/31 = 48.39%.
  EXPECT_NEAR(replay(generate(spec("1f1b", 16, 1, 16)), 1, 1, 1).bubble(), 15.0 / 31.0, 1e-12);
}

TEST(ScheduleGenerators, InterleavedFollowsMegatronTableAndWarmup) {
  // Megatron-Core's documented example (model_parallel_config.py): PP=2, VP=2, group size 3, 5 micro-batches
  // -> forward micro-batch order 0 1 2 0 1 2 3 4 3 4 with chunks 0 0 0 1 1 1 0 0 1 1.
  {
    const Schedule s = generate(spec("interleaved_1f1b", 2, 2, 5, 3));
    const int mbs[] = {0, 1, 2, 0, 1, 2, 3, 4, 3, 4}, chunks[] = {0, 0, 0, 1, 1, 1, 0, 0, 1, 1};
    for (int r = 0; r < 2; ++r) {
      std::vector<Action> fw;
      for (const Action& a : s.actions[size_t(r)])
        if (a.op == Op::F) fw.push_back(a);
      ASSERT_EQ(fw.size(), 10u);
      for (int k = 0; k < 10; ++k) EXPECT_EQ(fw[size_t(k)], F(chunks[k] * 2 + r, mbs[k])) << "rank " << r << " k " << k;
    }
  }
  // PP=2, VP=2, group size 2, 4 micro-batches -> 0 1 0 1 2 3 2 3.
  {
    const Schedule s = generate(spec("interleaved_1f1b", 2, 2, 4, 2));
    const int mbs[] = {0, 1, 0, 1, 2, 3, 2, 3};
    int k = 0;
    for (const Action& a : s.actions[0])
      if (a.op == Op::F) {
        EXPECT_EQ(a.mb, mbs[k++]);
      }
  }
  // Warm-up forwards on each rank: min(m*v, 2*(pp-1-r) + (v-1)*n), then one more forward opens the steady
  // phase (unless every forward was in the warm-up).
  for (int pp : {2, 3, 4})
    for (int v : {2, 3})
      for (int m : {pp, 2 * pp, 3 * pp})
        for (int n : {0, pp, m}) {
          GenSpec g = spec("interleaved_1f1b", pp, v, m, n);
          if (!error_of([&] { check_spec(g); }).empty()) continue;
          const Schedule s = generate(g);
          const int group = n ? n : pp;
          for (int r = 0; r < pp; ++r) {
            const int warm = std::min(m * v, 2 * (pp - 1 - r) + (v - 1) * group);
            const int lead = warm == m * v ? warm : warm + 1;
            EXPECT_EQ(forwards_before_first_backward(s.actions[size_t(r)]), lead)
                << "pp" << pp << " v" << v << " m" << m << " n" << n << " rank " << r;
          }
          // First backward on every rank is for the last chunk of micro-batch 0.
          for (int r = 0; r < pp; ++r)
            if (2 * (pp - 1 - r) + (v - 1) * group < m * v) {
              EXPECT_EQ(s.actions[size_t(r)][size_t(forwards_before_first_backward(s.actions[size_t(r)]))],
                        B((v - 1) * pp + r, 0));
            }
        }
}

TEST(ScheduleGenerators, InterleavedBubbleMatchesClosedForm) {
  // (p-1)/(p-1+m*v) with equal F and B times, m a multiple of pp.
  for (int pp : {2, 4})
    for (int v : {2, 3, 4})
      for (int m : {pp, 2 * pp, 4 * pp}) {
        const Schedule s = generate(spec("interleaved_1f1b", pp, v, m));
        const double want = double(pp - 1) / double(pp - 1 + m * v);
        EXPECT_NEAR(replay(s, 1, 0.5, 0.5).bubble(), want, 1e-12) << pp << " " << v << " " << m;
        EXPECT_NEAR(replay(s, 1, 1, 1).bubble(), want, 1e-12) << pp << " " << v << " " << m;
      }
  // The seed documents' PP16 GA16 VPP6 figure: 15/111 = 13.51%.
  EXPECT_NEAR(replay(generate(spec("interleaved_1f1b", 16, 6, 16)), 1, 1, 1).bubble(), 15.0 / 111.0, 1e-12);
}

TEST(ScheduleGenerators, ZeroBubbleH1SplitsBackwardAndKeepsOneFOneBMemory) {
  for (int pp : {2, 4, 5})
    for (int m : {pp, 2 * pp + 1}) {
      const Schedule s = generate(spec("zb1p", pp, 1, m));
      const Schedule base = generate(spec("1f1b", pp, 1, m));
      const Replay rp = replay(s, 1, 1, 1), rb = replay(base, 1, 1, 1);
      int peak_base = 0;
      for (int p : rb.peak) peak_base = std::max(peak_base, p);
      for (int r = 0; r < pp; ++r) {
        const auto& row = s.actions[size_t(r)];
        int n_i = 0, n_w = 0, i_before_first_w = -1;
        for (const Action& a : row) {
          n_i += a.op == Op::I;
          if (a.op == Op::W && i_before_first_w < 0) i_before_first_w = n_i;
          n_w += a.op == Op::W;
        }
        EXPECT_EQ(n_i, m);
        EXPECT_EQ(n_w, m);
        // Rank r holds back r W's: its first W comes after its (r+1)-th I.
        EXPECT_EQ(i_before_first_w, std::min(r + 1, m)) << "pp" << pp << " rank " << r;
        // The forward/backward skeleton is 1F1B's (I in place of B).
        std::vector<Action> skeleton;
        for (const Action& a : row)
          if (a.op != Op::W) skeleton.push_back(a.op == Op::I ? B(a.stage, a.mb) : a);
        EXPECT_EQ(skeleton, base.actions[size_t(r)]);
        // Same peak activation memory as 1F1B (its rank 0 holds pp).
        EXPECT_LE(rp.peak[size_t(r)], peak_base);
      }
      // With F = I = W the bubble is a third of 1F1B's (zero-bubble paper): (p-1)(F+I-W) vs (p-1)(F+I+W).
      const double t_ideal = 3.0 * m;
      EXPECT_NEAR(rp.step_time, t_ideal + (pp - 1) * 1.0, 1e-12);
      EXPECT_NEAR(rb.step_time, t_ideal + (pp - 1) * 3.0, 1e-12);
      EXPECT_LT(rp.bubble(), rb.bubble());
    }
}

TEST(ScheduleGenerators, VShapesPlaceStagesInAV) {
  for (const std::string name : {"zbv", "dualpipev"})
    for (int pp : {1, 2, 4}) {
      const Schedule s = generate(spec(name, pp, 2, 2 * pp + 2));
      EXPECT_EQ(s.n_stages, 2 * pp);
      EXPECT_EQ(s.stage_rank.front(), 0);
      EXPECT_EQ(s.stage_rank.back(), 0);
      for (int r = 0; r < pp; ++r) {
        std::set<int> stages;
        for (const Action& a : s.actions[size_t(r)])
          for (const Action& h : halves(a)) stages.insert(h.stage);
        EXPECT_EQ(stages, (std::set<int>{r, 2 * pp - 1 - r})) << name << " rank " << r;
      }
    }
}

TEST(ScheduleGenerators, ZbvIsZeroBubbleWithEqualTimes) {
  // With F = I = W every rank's only idle time is the start delay of the last rank, (pp-1)*F, which no
  // schedule can avoid; the peak held activation sets equal 2*pp chunks = pp whole-rank micro-batches, as 1F1B.
  for (int pp : {2, 3, 4, 6})
    for (int m : {2 * pp - 1, 2 * pp, 4 * pp}) {
      const Schedule s = generate(spec("zbv", pp, 2, m));
      const Replay rp = replay(s, 1, 1, 1);
      EXPECT_NEAR(rp.step_time, 6.0 * m + (pp - 1), 1e-12) << pp << " " << m;
      for (int p : rp.peak) EXPECT_LE(p, 2 * pp);
      EXPECT_EQ(rp.peak[0], 2 * pp);
      // Lower bubble than ZB-H1 for the same micro-batches.
      EXPECT_LT(rp.bubble(), replay(generate(spec("zb1p", pp, 1, m)), 1, 1, 1).bubble()) << pp << " " << m;
    }
}

TEST(ScheduleGenerators, DualPipeVOverlapsForwardAndBackward) {
  for (int pp : {1, 2, 3, 4})
    for (int m : {2 * pp, 2 * pp + 3}) {
      const Schedule s = generate(spec("dualpipev", pp, 2, m));
      for (int r = 0; r < pp; ++r) {
        // DualPipeV's main step runs (m - 2pp + r + 1) x (F0&B1, F1&B0), the last rank's first pair split;
        // its step 5 adds (pp-1-r) F1&B0 pairs.
        const int main_steps = m - 2 * pp + r + 1;
        const int want = 2 * main_steps - (r == pp - 1 ? 1 : 0) + (pp - 1 - r);
        int fb = 0;
        for (const Action& a : s.actions[size_t(r)]) {
          if (a.op != Op::FB) continue;
          ++fb;
          EXPECT_EQ(a.op2, Op::B);
          EXPECT_NE(a.stage, a.stage2);  // one chunk forward, the other backward
        }
        EXPECT_EQ(fb, want) << "pp" << pp << " m" << m << " rank " << r;
      }
      // Published bubble (DualPipe README, with F = I): (pp-1)(F&B + B - 3W) per rank, F&B = F + B here.
      const Replay rp = replay(s, 1, 1, 1);
      EXPECT_NEAR(rp.step_time, 6.0 * m + (pp - 1) * (3 + 2 - 3), 1e-12) << pp << " " << m;
      const Replay rh = replay(s, 1, 1, 0.5);
      EXPECT_NEAR(rh.step_time, 5.0 * m + (pp - 1) * (2.5 + 1.5 - 1.5), 1e-12) << pp << " " << m;
      // Peak held activation sets: 2*pp + 1 chunks (the README's PP+1 with PP = stages).
      EXPECT_EQ(rp.peak[0], 2 * pp + 1);
    }
}

TEST(ScheduleGenerators, GoldenCsv) {
  // Small cases checked by eye: 1f1b and zb1p against the zero-bubble paper's figures (p = 4), dualpipev
  // against DeepSeek's dualpipev.png (4 ranks, 10 micro-batches), interleaved against Megatron's table.
  // MOETRON_UPDATE_GOLDEN=1 rewrites the files instead of comparing.
  const std::vector<std::pair<std::string, GenSpec>> cases = {
      {"gpipe_pp4_m8", spec("gpipe", 4, 1, 8)},
      {"1f1b_pp4_m8", spec("1f1b", 4, 1, 8)},
      {"interleaved_1f1b_pp4_v2_m8", spec("interleaved_1f1b", 4, 2, 8)},
      {"interleaved_1f1b_pp2_v2_m5_g3", spec("interleaved_1f1b", 2, 2, 5, 3)},
      {"zb1p_pp4_m8", spec("zb1p", 4, 1, 8)},
      {"zbv_pp4_m8", spec("zbv", 4, 2, 8)},
      {"dualpipev_pp4_m10", spec("dualpipev", 4, 2, 10)},
  };
  const char* upd = std::getenv("MOETRON_UPDATE_GOLDEN");
  const bool update = upd && std::string(upd) == "1";
  for (const auto& [file, g] : cases) {
    const std::string path = std::string(MOETRON_SOURCE_DIR) + "/tests/data/schedule/" + file + ".csv";
    const std::string got = to_csv(generate(g));
    if (update) {
      std::ofstream(path, std::ios::binary) << got;
      continue;
    }
    std::ifstream in(path, std::ios::binary);
    ASSERT_TRUE(in.good()) << path << " missing (run with MOETRON_UPDATE_GOLDEN=1 to write it)";
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_EQ(got, ss.str()) << file << " differs from the golden file (MOETRON_UPDATE_GOLDEN=1 rewrites it)";
    // The file reads back as the same schedule shape.
    const Schedule back = from_csv(ss.str());
    EXPECT_EQ(back.actions, generate(g).actions);
    EXPECT_EQ(back.stage_rank, generate(g).stage_rank);
  }
}

TEST(ScheduleGenerators, PreconditionsAreRefusedByName) {
  auto msg = [](GenSpec g) { return error_of([&] { check_spec(g); }); };
  auto has = [](const std::string& m, const std::string& part) {
    return m.find(part) != std::string::npos ? ::testing::AssertionSuccess()
                                             : ::testing::AssertionFailure() << "'" << m << "' lacks '" << part << "'";
  };
  EXPECT_TRUE(has(msg(spec("1f1b", 4, 1, 2)), "[schedule] 1f1b: pp_microbatches = 2 must be >= pp = 4"));
  EXPECT_TRUE(has(msg(spec("zb1p", 3, 1, 2)), "zb1p: pp_microbatches = 2 must be >= pp = 3"));
  EXPECT_TRUE(has(msg(spec("zbv", 4, 3, 8)), "zbv: needs exactly 2 stages per rank (pp_virtual_stages = 3)"));
  EXPECT_TRUE(has(msg(spec("dualpipev", 4, 1, 8)), "dualpipev: needs exactly 2 stages per rank (pp_virtual_stages = 1)"));
  EXPECT_TRUE(has(msg(spec("dualpipev", 4, 2, 7)), "dualpipev: pp_microbatches = 7 must be >= 2 * pp = 8"));
  EXPECT_TRUE(has(msg(spec("1f1b", 4, 2, 8)), "1f1b: runs one stage per rank (pp_virtual_stages = 2)"));
  EXPECT_TRUE(has(msg(spec("gpipe", 2, 1, 0)), "gpipe: pp_microbatches = 0 must be >= 1"));
  EXPECT_TRUE(has(msg(spec("gpipe", 0, 1, 4)), "gpipe: pp = 0 must be >= 1"));
  EXPECT_TRUE(has(msg(spec("interleaved_1f1b", 4, 1, 8)), "interleaved_1f1b: pp_virtual_stages = 1 must be >= 2"));
  EXPECT_TRUE(has(msg(spec("interleaved_1f1b", 1, 2, 8)), "interleaved_1f1b: pp = 1 must be >= 2"));
  EXPECT_TRUE(has(msg(spec("interleaved_1f1b", 4, 2, 3)), "interleaved_1f1b: pp_microbatches = 3 must be >= pp = 4"));
  EXPECT_TRUE(has(msg(spec("interleaved_1f1b", 4, 2, 8, 3)), "group_size = 3 must lie in [pp, pp_microbatches] = [4, 8]"));
  EXPECT_TRUE(has(msg(spec("interleaved_1f1b", 4, 2, 8, 9)), "group_size = 9 must lie in"));
  EXPECT_TRUE(has(msg(spec("interleaved_1f1b", 4, 2, 10)), "leaves a last group of 2 micro-batches"));
  EXPECT_TRUE(has(msg(spec("interleaved_1f1b", 4, 2, 8, -1)), "group_size = -1 must be >= 0"));
  EXPECT_TRUE(has(msg(spec("1f1b", 4, 1, 8, 4)), "1f1b: group_size = 4 applies to interleaved_1f1b only"));
  const std::string unknown = msg(spec("pipedream", 4, 1, 8));
  EXPECT_TRUE(has(unknown, "unknown pp_schedule 'pipedream'"));
  EXPECT_TRUE(has(unknown, "gpipe, 1f1b, interleaved_1f1b, zb1p, zbv, dualpipev"));
  EXPECT_TRUE(has(msg(spec("1f1b", 1 << 20, 1, 1 << 20)), "kMaxComputeActions"));
  EXPECT_TRUE(has(msg(spec("interleaved_1f1b", 1 << 30, 1 << 30, 1 << 30)), "kMaxComputeActions"));
  EXPECT_TRUE(has(msg(spec("gpipe", 1, 1, 1 << 30)), "kMaxComputeActions"));
  // generate() runs the same checks.
  EXPECT_TRUE(has(error_of([] { generate(spec("1f1b", 4, 1, 2)); }), "must be >= pp = 4"));
  // Allowed edges: Megatron's non-multiples with a remainder >= pp (10 = 6 + 4 with group 6 on pp 4), zbv with
  // fewer micro-batches than 2*pp-1, gpipe with fewer micro-batches than ranks, and a size just under the cap.
  EXPECT_EQ(msg(spec("interleaved_1f1b", 4, 2, 10, 6)), "");
  EXPECT_EQ(msg(spec("interleaved_1f1b", 4, 2, 10, 5)), "");
  EXPECT_EQ(msg(spec("zbv", 4, 2, 1)), "");
  EXPECT_EQ(msg(spec("gpipe", 4, 1, 1)), "");
  EXPECT_EQ(msg(spec("1f1b", 8, 1, int(kMaxComputeActions / 16))), "");
}

TEST(Generators, WarmupForwardsMatchTheGeneratedLists) {
  for (const char* name : {"gpipe", "1f1b", "zb1p", "interleaved_1f1b"})
    for (int pp : {2, 4})
      for (int m : {pp, 3 * pp}) {
        GenSpec g;
        g.schedule = name, g.pp = pp, g.microbatches = m, g.vpp = std::string(name) == "interleaved_1f1b" ? 2 : 1;
        const Schedule s = generate(g);
        for (int r = 0; r < pp; ++r) {
          // Megatron's warm-up counts, and the list agrees: the warm-up forwards, then (when forwards remain) the
          // steady state's first forward, lead the rank's list.
          const int total = m * g.vpp;
          const int want = std::string(name) == "gpipe"              ? m
                           : std::string(name) == "interleaved_1f1b" ? std::min(total, 2 * (pp - 1 - r) + pp)
                                                                      : std::min(m, pp - 1 - r);
          EXPECT_EQ(warmup_forwards(g, r), want) << name << " pp " << pp << " m " << m << " rank " << r;
          const auto& row = s.actions[size_t(r)];
          int n = 0;
          while (n < int(row.size()) && row[size_t(n)].op == Op::F) ++n;
          EXPECT_EQ(n, std::min(total, want + 1)) << name << " pp " << pp << " m " << m << " rank " << r;
        }
      }
  GenSpec v;
  v.schedule = "zbv", v.pp = 2, v.vpp = 2, v.microbatches = 4;
  EXPECT_THROW(warmup_forwards(v, 0), Error);
}
