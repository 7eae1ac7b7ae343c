// record.cpp: measured pipeline records (include/moetron/pipeline_record.h): JSON form with checked reading,
// one recorded step as a timed result, the durations a record measured, and the measured-vs-simulated bubble.
// Not the gathering across ranks (the engine's src/parallel/pipeline_record.cpp) and not the picture.
#include "moetron/pipeline_record.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moetron/check.h"

namespace moetron::sched {

using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "moetron.pipeline_record";

[[noreturn]] void bad(const std::string& src, const std::string& field, const std::string& why) {
  MT_FAIL("pipeline record", src, ": ", field, ": ", why);
}

const json& need(const json& j, const char* key, const std::string& src, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) bad(src, where + key, "missing");
  return j.at(key);
}

}  // namespace

std::string record_to_json(const PipelineRecord& r) {
  json steps = json::array();
  for (const RecordedStep& st : r.steps) {
    std::vector<json> ranks(size_t(r.lowered.pp));
    for (int k = 0; k < r.lowered.pp; ++k) ranks[size_t(k)] = json{{"rank", k}, {"ops", json::array()}};
    for (const TimedOp& op : st.ops) ranks[size_t(op.rank)]["ops"].push_back(json::array({op.index, op.start, op.end}));
    steps.push_back(json{{"step", st.step}, {"ranks", ranks}});
  }
  json j{{"format", kFormat},       {"version", 1},  {"schedule", r.schedule_name},
         {"lowered_csv", to_csv(r.lowered)}, {"unit", "s"}, {"steps", steps}};
  return j.dump(1);
}

PipelineRecord record_from_json(const std::string& text, const std::string& src) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    bad(src, "(file)", std::string("not JSON: ") + e.what());
  }
  const json& fmt = need(j, "format", src, "");
  if (!fmt.is_string() || fmt.get<std::string>() != kFormat) bad(src, "format", "expected \"" + std::string(kFormat) + "\"");
  const json& ver = need(j, "version", src, "");
  if (!ver.is_number_integer() || ver.get<int>() != 1) bad(src, "version", "expected 1, got " + ver.dump());
  PipelineRecord r;
  const json& name = need(j, "schedule", src, "");
  if (!name.is_string()) bad(src, "schedule", "expected a string");
  r.schedule_name = name.get<std::string>();
  const json& csv = need(j, "lowered_csv", src, "");
  if (!csv.is_string()) bad(src, "lowered_csv", "expected a string");
  try {
    r.lowered = from_csv(csv.get<std::string>());
  } catch (const Error& e) {
    bad(src, "lowered_csv", e.what());
  }
  r.lowered.name = r.schedule_name;
  const Verdict v = validate(r.lowered);
  if (!v.ok) bad(src, "lowered_csv", "not a valid lowered schedule: " + v.error);
  const json& unit = need(j, "unit", src, "");
  if (!unit.is_string() || unit.get<std::string>() != "s") bad(src, "unit", "expected \"s\"");
  const json& steps = need(j, "steps", src, "");
  if (!steps.is_array()) bad(src, "steps", "expected an array");
  for (size_t si = 0; si < steps.size(); ++si) {
    const std::string at = "steps[" + std::to_string(si) + "].";
    RecordedStep st;
    const json& sn = need(steps[si], "step", src, at);
    if (!sn.is_number_integer()) bad(src, at + "step", "expected an integer");
    st.step = sn.get<int64_t>();
    const json& ranks = need(steps[si], "ranks", src, at);
    if (!ranks.is_array() || int(ranks.size()) != r.lowered.pp)
      bad(src, at + "ranks", "expected " + std::to_string(r.lowered.pp) + " ranks (the schedule's pp)");
    for (size_t k = 0; k < ranks.size(); ++k) {
      const std::string rat = at + "ranks[" + std::to_string(k) + "].";
      const json& rk = need(ranks[k], "rank", src, rat);
      if (!rk.is_number_integer() || rk.get<int>() != int(k)) bad(src, rat + "rank", "expected " + std::to_string(k));
      const json& ops = need(ranks[k], "ops", src, rat);
      if (!ops.is_array()) bad(src, rat + "ops", "expected an array");
      const auto& list = r.lowered.actions[k];
      int prev = -1;
      for (size_t o = 0; o < ops.size(); ++o) {
        const std::string oat = rat + "ops[" + std::to_string(o) + "]";
        const json& e = ops[o];
        if (!e.is_array() || e.size() != 3 || !e[0].is_number_integer() || !e[1].is_number() || !e[2].is_number())
          bad(src, oat, "expected [index, start, end]");
        TimedOp op;
        op.rank = int(k), op.index = e[0].get<int>(), op.start = e[1].get<double>(), op.end = e[2].get<double>();
        if (op.index <= prev || op.index >= int(list.size()))
          bad(src, oat, "index " + std::to_string(op.index) + " is not after the previous op and inside rank " +
                            std::to_string(k) + "'s " + std::to_string(list.size()) + " actions");
        if (!(std::isfinite(op.start) && std::isfinite(op.end) && op.start >= 0 && op.end >= op.start))
          bad(src, oat, "times must be finite with 0 <= start <= end");
        prev = op.index;
        op.action = list[size_t(op.index)];
        st.ops.push_back(op);
      }
    }
    r.steps.push_back(std::move(st));
  }
  return r;
}

void write_record(const PipelineRecord& r, const std::string& path) {
  std::ofstream out(path);
  MT_CHECK(out.good(), "pipeline record", "cannot write ", path);
  out << record_to_json(r) << "\n";
  MT_CHECK(out.good(), "pipeline record", "writing ", path, " failed");
}

PipelineRecord read_record(const std::string& path) {
  std::ifstream in(path);
  MT_CHECK(in.good(), "pipeline record", "cannot read ", path,
           " (a run writes it when profiled: moetron train ... --profile)");
  std::ostringstream ss;
  ss << in.rdbuf();
  return record_from_json(ss.str(), path);
}

TimedResult measured_result(const PipelineRecord& r, size_t step_index) {
  MT_CHECK(step_index < r.steps.size(), "pipeline record", "step index ", step_index, " of ", r.steps.size(),
           " recorded steps");
  const RecordedStep& st = r.steps[step_index];
  TimedResult t;
  t.ops = st.ops;
  t.ranks.resize(size_t(r.lowered.pp));
  double busy_sum = 0;
  for (const TimedOp& op : st.ops) {
    t.step_time = std::max(t.step_time, op.end);
    if (is_compute(op.action.op)) t.ranks[size_t(op.rank)].busy += op.end - op.start;
  }
  for (int k = 0; k < r.lowered.pp; ++k) {
    RankStats& rs = t.ranks[size_t(k)];
    rs.rank = k;
    rs.bubble_ratio = t.step_time > 0 ? 1 - rs.busy / t.step_time : 0;
    busy_sum += rs.busy;
  }
  t.bubble_ratio = t.step_time > 0 ? 1 - busy_sum / (r.lowered.pp * t.step_time) : 0;
  return t;
}

Durations measured_durations(const PipelineRecord& r) {
  const int S = r.lowered.n_stages;
  struct Acc {
    double sum = 0;
    int n = 0;
    double mean() const { return n ? sum / n : 0; }
    void add(double v) { sum += v, ++n; }
  };
  const size_t n = static_cast<size_t>(S);
  std::vector<Acc> f(n), b(n), i(n), w(n), fb(n);
  for (const RecordedStep& st : r.steps)
    for (const TimedOp& op : st.ops) {
      const double d = op.end - op.start;
      const size_t s = size_t(op.action.stage);
      switch (op.action.op) {
        case Op::F: f[s].add(d); break;
        case Op::B: b[s].add(d); break;
        case Op::I: i[s].add(d); break;
        case Op::W: w[s].add(d); break;
        case Op::FB: fb[s].add(d); break;
        default: break;
      }
    }
  Durations d;
  d.p2p = 0;
  d.stage.resize(size_t(S));
  for (int s = 0; s < S; ++s) {
    StageCost& c = d.stage[size_t(s)];
    c.f = f[size_t(s)].mean();
    // Full backward as i with w = 0 (B costs i + w); split schedules measure I and W themselves.
    c.i = i[size_t(s)].n ? i[size_t(s)].mean() : b[size_t(s)].mean();
    c.w = w[size_t(s)].mean();
    if (fb[size_t(s)].n && (c.f == 0 || c.i == 0)) {  // only fused: split the FB time evenly
      const double half = fb[size_t(s)].mean() / 2;
      if (c.f == 0) c.f = half;
      if (c.i == 0) c.i = half;
    }
  }
  return d;
}

BubbleComparison compare_bubbles(const PipelineRecord& r) {
  MT_CHECK(!r.steps.empty(), "pipeline record", "no recorded steps to compare");
  BubbleComparison c;
  const int P = r.lowered.pp;
  c.measured.assign(size_t(P), 0.0);
  for (size_t k = 0; k < r.steps.size(); ++k) {
    const TimedResult m = measured_result(r, k);
    for (int q = 0; q < P; ++q) c.measured[size_t(q)] += m.ranks[size_t(q)].bubble_ratio / double(r.steps.size());
    c.measured_total += m.bubble_ratio / double(r.steps.size());
  }
  c.durations = measured_durations(r);
  const TimedResult s = simulate_timed(r.lowered, c.durations);
  for (int q = 0; q < P; ++q) c.simulated.push_back(s.ranks[size_t(q)].bubble_ratio);
  c.simulated_total = s.bubble_ratio;
  return c;
}

}  // namespace moetron::sched
