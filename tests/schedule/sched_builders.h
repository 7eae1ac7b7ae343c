// sched_builders.h: small hand-written schedules and checks for the schedule tests (validator, lowering,
// simulators): GPipe and 1F1B written out from their textbook definitions, a schedule from text rows, a
// random valid compute-only schedule, and an independent check of the per-rank-pair send/receive order.
// Not the library's generators (src/schedule/generators*.cpp): these are the tests' own oracle.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "moetron/check.h"
#include "moetron/schedule.h"

namespace sched_test {
using namespace moetron::sched;

template <class Fn>
std::string error_of(Fn&& f) {
  try {
    f();
  } catch (const moetron::Error& e) {
    return e.what();
  }
  return "";
}

// A schedule from rows of space-separated actions ("0F0 0F1 0B0").
inline Schedule from_rows(int n_stages, int m, std::vector<int> placement, const std::vector<std::string>& rows,
                          bool lowered = false) {
  Schedule s;
  s.name = "test";
  s.pp = int(rows.size());
  s.n_stages = n_stages;
  s.n_microbatches = m;
  s.stage_rank = std::move(placement);
  s.lowered = lowered;
  for (const auto& row : rows) {
    std::istringstream in(row);
    std::vector<Action> list;
    for (std::string tok; in >> tok;) list.push_back(parse_action(tok));
    s.actions.push_back(std::move(list));
  }
  return s;
}

inline std::string row_text(const std::vector<Action>& row) {
  std::string out;
  for (const auto& a : row) out += (out.empty() ? "" : " ") + to_string(a);
  return out;
}

inline Schedule empty(int pp, int m) {
  Schedule s;
  s.name = "test";
  s.pp = pp;
  s.n_stages = pp;
  s.n_microbatches = m;
  for (int r = 0; r < pp; ++r) s.stage_rank.push_back(r);
  s.actions.assign(size_t(pp), {});
  return s;
}

// GPipe: every rank runs all forwards, then all backwards, in micro-batch order.
inline Schedule gpipe(int pp, int m) {
  Schedule s = empty(pp, m);
  for (int r = 0; r < pp; ++r) {
    for (int i = 0; i < m; ++i) s.actions[size_t(r)].push_back(F(r, i));
    for (int i = 0; i < m; ++i) s.actions[size_t(r)].push_back(B(r, i));
  }
  return s;
}

// 1F1B: rank r runs min(pp-1-r, m) warm-up forwards, then alternates forward and backward, then drains the
// backwards. With `split`, each backward is an I immediately followed by its W.
inline Schedule one_f_one_b(int pp, int m, bool split = false) {
  Schedule s = empty(pp, m);
  for (int r = 0; r < pp; ++r) {
    auto& row = s.actions[size_t(r)];
    auto bwd = [&](int i) {
      if (split) {
        row.push_back(I(r, i));
        row.push_back(W(r, i));
      } else {
        row.push_back(B(r, i));
      }
    };
    const int warm = std::min(pp - 1 - r, m);
    for (int i = 0; i < warm; ++i) row.push_back(F(r, i));
    for (int i = 0; i < m - warm; ++i) {
      row.push_back(F(r, warm + i));
      bwd(i);
    }
    for (int i = m - warm; i < m; ++i) bwd(i);
  }
  return s;
}

// A random valid compute-only schedule: replays one global order in which every action's inputs come first,
// choosing at random which rank moves and which of its ready actions it takes; sometimes a split backward
// (I then W) and sometimes an FB pair. Any such list set runs to the end, so it is valid.
inline Schedule random_schedule(std::mt19937& rng, int pp, int vpp, int m, bool v_shape) {
  Schedule s;
  s.name = "random";
  s.pp = pp;
  s.n_stages = pp * vpp;
  s.n_microbatches = m;
  s.stage_rank = v_shape ? v_placement(pp) : loop_placement(pp, pp * vpp);
  s.actions.assign(size_t(pp), {});
  const int n = s.n_stages;
  auto at = [&](int st, int mb) { return size_t(st) * size_t(m) + size_t(mb); };
  std::vector<int> f(size_t(n * m), 0), bwd(size_t(n * m), 0), w(size_t(n * m), 0);  // bwd: 1 B, 2 I
  std::vector<uint8_t> split(size_t(n * m));
  for (auto& x : split) x = uint8_t(rng() % 2);
  size_t total = 0, want = 0;
  for (int i = 0; i < n * m; ++i) want += split[size_t(i)] ? 3 : 2;
  while (total < want) {
    const int r = int(rng() % unsigned(pp));
    std::vector<Action> fw, bw;
    for (int st = 0; st < n; ++st) {
      if (s.stage_rank[size_t(st)] != r) continue;
      for (int mb = 0; mb < m; ++mb) {
        const size_t i = at(st, mb);
        if (!f[i] && (st == 0 || f[at(st - 1, mb)])) fw.push_back(F(st, mb));
        if (f[i] && !bwd[i] && (st == n - 1 || bwd[at(st + 1, mb)]))
          bw.push_back(split[i] ? I(st, mb) : B(st, mb));
        if (bwd[i] == 2 && !w[i]) bw.push_back(W(st, mb));
      }
    }
    if (fw.empty() && bw.empty()) continue;
    Action a;
    const unsigned pick = rng() % 3;
    if (pick == 0 && !fw.empty() && !bw.empty() && bw.front().op != Op::W) {
      const Action x = fw[rng() % fw.size()], y = bw.front();
      a = FB(x.stage, x.mb, y.stage, y.mb, y.op);
    } else if ((pick == 1 || bw.empty()) && !fw.empty()) {
      a = fw[rng() % fw.size()];
    } else {
      a = bw[rng() % bw.size()];
    }
    s.actions[size_t(r)].push_back(a);
    const Action halves[2] = {fwd_half(a), bwd_half(a)};
    for (int k = 0; k < (a.op == Op::FB ? 2 : 1); ++k) {
      const Action& h = halves[k];
      const size_t i = at(h.stage, h.mb);
      if (h.op == Op::F) f[i] = 1;
      else if (h.op == Op::W) w[i] = 1;
      else bwd[i] = h.op == Op::B ? 1 : 2;
      ++total;
    }
  }
  return s;
}

// Independent check of the lowering's order guarantee: for every ordered pair of ranks (a, b), the tensors a
// sends to b, in a's order, are exactly the tensors b receives from a, in b's order. Tensors are identified
// as (forward?, producer stage, mb).
inline void expect_same_order_per_pair(const Schedule& s) {
  using Key = std::tuple<bool, int, int>;
  std::map<std::pair<int, int>, std::vector<Key>> sent, received;
  for (int r = 0; r < s.pp; ++r)
    for (const Action& a : s.actions[size_t(r)]) {
      if (a.op == Op::SEND_F) sent[{r, s.stage_rank[size_t(a.stage + 1)]}].push_back({true, a.stage, a.mb});
      if (a.op == Op::SEND_B) sent[{r, s.stage_rank[size_t(a.stage - 1)]}].push_back({false, a.stage, a.mb});
      if (a.op == Op::RECV_F)
        received[{s.stage_rank[size_t(a.stage - 1)], r}].push_back({true, a.stage - 1, a.mb});
      if (a.op == Op::RECV_B)
        received[{s.stage_rank[size_t(a.stage + 1)], r}].push_back({false, a.stage + 1, a.mb});
    }
  EXPECT_EQ(sent, received) << to_text(s);
}

}  // namespace sched_test
