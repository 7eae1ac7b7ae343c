// test_generators_grid.cpp: every built-in generator over a grid of pipeline sizes, virtual stages and
// micro-batch counts (non-multiples included where the schedule allows them) passes validate(), lowers to a
// schedule that validates and runs without deadlock in simulate_lockstep(), and simulate_timed() gives the
// known bubble ratios and peak in-flight counts. Not the generators' structural tests (test_generators.cpp)
// and not the simulators' own tests (test_simulate.cpp).
#include <gtest/gtest.h>

#include <string>

#include "moetron/check.h"
#include "moetron/schedule.h"

using namespace moetron;
using namespace moetron::sched;

namespace {

bool allowed(const GenSpec& g) {
  try {
    check_spec(g);
    return true;
  } catch (const Error&) {
    return false;
  }
}

std::vector<GenSpec> grid() {
  std::vector<GenSpec> out;
  for (const auto& name : schedule_names())
    for (int pp = 1; pp <= 6; ++pp)
      for (int m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16}) {
        std::vector<int> vpps = {1};
        if (name == "interleaved_1f1b") vpps = {2, 3};
        if (is_v_shape(name)) vpps = {2};
        for (int v : vpps) {
          std::vector<int> groups = {0};
          if (name == "interleaved_1f1b") groups = {0, pp + 1, pp + 2, m};
          for (int g : groups) {
            GenSpec s{name, pp, v, m, g};
            if (allowed(s)) out.push_back(s);
          }
        }
      }
  return out;
}

std::string label(const GenSpec& g) {
  return g.schedule + " pp" + std::to_string(g.pp) + " v" + std::to_string(g.vpp) + " m" +
         std::to_string(g.microbatches) + " g" + std::to_string(g.group_size);
}

}  // namespace

TEST(ScheduleGeneratorsGrid, ValidateLowerAndRunWithoutDeadlock) {
  const auto cases = grid();
  int non_multiples = 0;
  for (const GenSpec& g : cases) {
    non_multiples += g.microbatches % g.pp != 0;
    const Schedule s = generate(g);
    const Verdict v = validate(s);
    EXPECT_TRUE(v.ok) << label(g) << ": " << v.error;
    const LockstepResult lc = simulate_lockstep(s);
    EXPECT_FALSE(lc.deadlock) << label(g) << " (compute only): " << lc.error;
    const Schedule low = lower(s);
    EXPECT_TRUE(low.lowered) << label(g);
    const Verdict vl = validate(low);
    EXPECT_TRUE(vl.ok) << label(g) << " lowered: " << vl.error;
    const LockstepResult ll = simulate_lockstep(low);
    EXPECT_FALSE(ll.deadlock) << label(g) << " lowered: " << ll.error;
    // Timed replay with F = 1, B = 2 (I = W = 1), free communication: every rank is busy for exactly its
    // compute, and the step lasts at least the busiest rank's compute.
    const TimedResult t = simulate_timed(low, Durations::uniform(s.n_stages, 1, 2, 1, 0));
    const double per_rank = 3.0 * g.microbatches * s.stages_per_rank();
    for (const auto& r : t.ranks) EXPECT_DOUBLE_EQ(r.busy, per_rank) << label(g) << " rank " << r.rank;
    EXPECT_GE(t.step_time, per_rank) << label(g);
  }
  EXPECT_GT(cases.size(), 300u);
  EXPECT_GT(non_multiples, 30);  // the grid does exercise micro-batch counts that are not multiples of pp
}

TEST(ScheduleGeneratorsGrid, BubbleRatiosMatchKnownFigures) {
  auto timed = [](const GenSpec& g, double f, double b, double w) {
    const Schedule s = generate(g);
    return simulate_timed(lower(s), Durations::uniform(s.n_stages, f, b, w, 0));
  };
  for (int pp : {2, 3, 4, 6})
    for (int k : {1, 2, 4}) {
      const int m = k * pp;
      // 1F1B: (p-1)/(m+p-1) with equal F and B times (and with B = 2F).
      const double one = double(pp - 1) / double(m + pp - 1);
      EXPECT_NEAR(timed({"1f1b", pp, 1, m}, 1, 1, 0.5).bubble_ratio, one, 1e-9) << pp << " " << m;
      EXPECT_NEAR(timed({"1f1b", pp, 1, m}, 1, 2, 1).bubble_ratio, one, 1e-9) << pp << " " << m;
      EXPECT_NEAR(bubble_formula(pp, m, 1), one, 1e-12);
      // Interleaved: (p-1)/(p-1+m*v) with equal F and B times.
      for (int v : {2, 3}) {
        const double want = double(pp - 1) / double(pp - 1 + m * v);
        EXPECT_NEAR(timed({"interleaved_1f1b", pp, v, m}, 1, 1, 0.5).bubble_ratio, want, 1e-9)
            << pp << " " << v << " " << m;
        EXPECT_NEAR(bubble_formula(pp, m, v), want, 1e-12);
      }
      // Split backward (F = I = W = 1): ZB-H1 below 1F1B, the V shapes lower still (DualPipeV, whose FB pairs
      // gain nothing without all-to-all to hide, no higher than ZB-H1).
      const double b1 = timed({"1f1b", pp, 1, m}, 1, 2, 1).bubble_ratio;
      const double zb = timed({"zb1p", pp, 1, m}, 1, 2, 1).bubble_ratio;
      EXPECT_LT(zb, b1) << pp << " " << m;
      if (m >= 2 * pp - 1) {
        EXPECT_LT(timed({"zbv", pp, 2, m}, 1, 2, 1).bubble_ratio, zb) << pp << " " << m;
      }
      if (m >= 2 * pp) {
        EXPECT_LE(timed({"dualpipev", pp, 2, m}, 1, 2, 1).bubble_ratio, zb + 1e-9) << pp << " " << m;
      }
    }
  // The seed documents' PP16 GA16 figures: 48.39% (VPP1) and 13.51% (VPP6).
  EXPECT_NEAR(timed({"1f1b", 16, 1, 16}, 1, 2, 1).bubble_ratio, 15.0 / 31.0, 1e-9);
  EXPECT_NEAR(timed({"interleaved_1f1b", 16, 6, 16}, 1, 1, 0.5).bubble_ratio, 15.0 / 111.0, 1e-9);
}

TEST(ScheduleGeneratorsGrid, PeakInFlight) {
  for (int pp : {2, 4, 5})
    for (int m : {pp, 2 * pp + 1}) {
      const Schedule s = generate({"1f1b", pp, 1, m});
      const TimedResult t = simulate_timed(lower(s), Durations::uniform(s.n_stages, 1, 2, 1, 0));
      for (const auto& r : t.ranks) EXPECT_EQ(r.peak_inflight, pp - r.rank) << pp << " " << m;
      const Schedule gp = generate({"gpipe", pp, 1, m});
      const TimedResult tg = simulate_timed(lower(gp), Durations::uniform(gp.n_stages, 1, 2, 1, 0));
      for (const auto& r : tg.ranks) EXPECT_EQ(r.peak_inflight, m) << pp << " " << m;
      // ZB-H1 keeps 1F1B's peak (pp on the first rank) on every rank; ZB-V holds 2*pp chunks = pp micro-batches.
      const Schedule zb = generate({"zb1p", pp, 1, m});
      for (const auto& r : simulate_timed(lower(zb), Durations::uniform(pp, 1, 2, 1, 0)).ranks)
        EXPECT_LE(r.peak_inflight, pp);
      if (m >= 2 * pp - 1) {
        const Schedule zv = generate({"zbv", pp, 2, m});
        for (const auto& r : simulate_timed(lower(zv), Durations::uniform(2 * pp, 1, 2, 1, 0)).ranks)
          EXPECT_DOUBLE_EQ(r.peak_inflight_microbatches, double(pp));
      }
    }
}
