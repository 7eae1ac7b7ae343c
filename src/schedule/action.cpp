// action.cpp: the schedule IR's text form (actions such as 0F3, 1I2, 2SEND_F5, 0F3&5B1), the CSV form of a
// whole schedule (one row per rank) and stage placements. Not the generators, validator or simulators.
#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include "moetron/check.h"
#include "moetron/schedule.h"

namespace moetron::sched {

namespace {
struct OpName {
  Op op;
  const char* name;
};
// Longest names first so that "SEND_F" is not read as "S..." of something shorter.
constexpr OpName kOps[] = {{Op::SEND_F, "SEND_F"}, {Op::RECV_F, "RECV_F"}, {Op::SEND_B, "SEND_B"},
                           {Op::RECV_B, "RECV_B"}, {Op::F, "F"},           {Op::B, "B"},
                           {Op::I, "I"},           {Op::W, "W"}};

const char* op_name(Op op) {
  for (const auto& o : kOps)
    if (o.op == op) return o.name;
  return "?";
}

// Reads "<digits><OP><digits>" (no FB) from the whole of `t`.
Action parse_simple(std::string_view t, std::string_view whole) {
  size_t p = 0;
  auto number = [&](const char* what) {
    size_t s = p;
    while (p < t.size() && std::isdigit(static_cast<unsigned char>(t[p]))) ++p;
    MT_CHECK(p > s, "schedule", "action '", whole, "': expected a ", what, " number at position ", s,
             " (actions look like 0F3, 1I2, 2SEND_F5 or 0F3&5B1)");
    MT_CHECK(p - s <= 9, "schedule", "action '", whole, "': ", what, " number too long");
    return int32_t(std::stol(std::string(t.substr(s, p - s))));
  };
  Action a;
  a.stage = number("stage");
  bool found = false;
  for (const auto& o : kOps) {
    std::string_view n(o.name);
    if (t.substr(p, n.size()) == n) {
      a.op = o.op;
      p += n.size();
      found = true;
      break;
    }
  }
  MT_CHECK(found, "schedule", "action '", whole, "': unknown kind at position ", p,
           " (expected F, B, I, W, SEND_F, RECV_F, SEND_B or RECV_B)");
  a.mb = number("micro-batch");
  MT_CHECK(p == t.size(), "schedule", "action '", whole, "': unexpected '", t.substr(p), "' after the micro-batch");
  return a;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}
}  // namespace

bool is_compute(Op op) { return op == Op::F || op == Op::B || op == Op::I || op == Op::W || op == Op::FB; }
bool is_comm(Op op) { return !is_compute(op); }

std::string to_string(const Action& a) {
  if (a.op == Op::FB)
    return std::to_string(a.stage) + "F" + std::to_string(a.mb) + "&" + std::to_string(a.stage2) + op_name(a.op2) +
           std::to_string(a.mb2);
  return std::to_string(a.stage) + op_name(a.op) + std::to_string(a.mb);
}

Action parse_action(std::string_view text) {
  const std::string_view t = trim(text);
  MT_CHECK(!t.empty(), "schedule", "empty action (actions look like 0F3, 1I2, 2SEND_F5 or 0F3&5B1)");
  const size_t amp = t.find('&');
  if (amp == std::string_view::npos) return parse_simple(t, t);
  const Action f = parse_simple(trim(t.substr(0, amp)), t);
  const Action b = parse_simple(trim(t.substr(amp + 1)), t);
  MT_CHECK(f.op == Op::F, "schedule", "action '", t, "': the first half of an F&B pair must be an F");
  MT_CHECK(b.op == Op::B || b.op == Op::I, "schedule", "action '", t,
           "': the second half of an F&B pair must be a B or an I");
  return FB(f.stage, f.mb, b.stage, b.mb, b.op);
}

std::vector<int> loop_placement(int pp, int n_stages) {
  MT_CHECK(pp >= 1 && n_stages >= pp && n_stages % pp == 0, "schedule", "n_stages = ", n_stages,
           " must be a positive multiple of pp = ", pp);
  std::vector<int> r(static_cast<size_t>(n_stages));
  for (int s = 0; s < n_stages; ++s) r[size_t(s)] = s % pp;
  return r;
}

std::vector<int> v_placement(int pp) {
  MT_CHECK(pp >= 1, "schedule", "pp = ", pp, " must be >= 1");
  std::vector<int> r(static_cast<size_t>(2 * pp));
  for (int s = 0; s < 2 * pp; ++s) r[size_t(s)] = s < pp ? s : 2 * pp - 1 - s;
  return r;
}

std::string to_csv(const Schedule& s) {
  std::string out;
  for (const auto& row : s.actions) {
    for (size_t i = 0; i < row.size(); ++i) {
      if (i) out += ',';
      out += to_string(row[i]);
    }
    out += '\n';
  }
  return out;
}

std::string to_text(const Schedule& s) {
  std::ostringstream os;
  for (size_t r = 0; r < s.actions.size(); ++r) {
    os << "rank " << r << ":";
    for (const auto& a : s.actions[r]) os << ' ' << to_string(a);
    os << '\n';
  }
  return os.str();
}

Schedule from_csv(std::string_view text) {
  Schedule s;
  s.name = "csv";
  s.actions.clear();
  size_t line_no = 0;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    ++line_no;
    pos = eol + 1;
    if (trim(line).empty()) {
      if (eol == text.size()) break;
      continue;  // blank lines (e.g. a trailing newline) carry no rank
    }
    std::vector<Action> row;
    size_t col = 0, c = 0;
    while (c <= line.size()) {
      size_t comma = line.find(',', c);
      if (comma == std::string_view::npos) comma = line.size();
      ++col;
      std::string_view cell = trim(line.substr(c, comma - c));
      if (!cell.empty()) {
        try {
          row.push_back(parse_action(cell));
        } catch (const Error& e) {
          MT_FAIL("schedule", "CSV row ", line_no, ", column ", col, ": ", e.what());
        }
      }
      c = comma + 1;
    }
    // A row of empty cells would count as a rank here but is written back by to_csv as a blank line, which
    // does not: refuse it rather than read a different rank count than the text shows.
    MT_CHECK(!row.empty(), "schedule", "CSV row ", line_no,
             " has no actions (only empty cells): every non-blank row is a pipeline rank and needs at least one");
    s.actions.push_back(std::move(row));
    if (eol == text.size()) break;
  }
  MT_CHECK(!s.actions.empty(), "schedule", "CSV has no rows (expected one row of actions per pipeline rank)");
  s.pp = int(s.actions.size());

  int max_stage = -1, max_mb = -1;
  int64_t n_compute = 0;
  for (const auto& row : s.actions)
    for (const auto& a : row) {
      max_stage = std::max({max_stage, a.stage, a.op == Op::FB ? a.stage2 : -1});
      max_mb = std::max({max_mb, a.mb, a.op == Op::FB ? a.mb2 : -1});
      if (is_comm(a.op)) s.lowered = true;
      else ++n_compute;
    }
  MT_CHECK(max_stage >= 0, "schedule", "CSV has no actions");
  // Every stage and micro-batch needs at least one compute action, so ids beyond that count cannot be valid;
  // refusing them here keeps a stray huge id from sizing the placement table.
  MT_CHECK(int64_t(max_stage) < n_compute && int64_t(max_mb) < n_compute, "schedule", "CSV names stage ", max_stage,
           " and micro-batch ", max_mb, " but has only ", n_compute,
           " compute actions: stage and micro-batch ids count from 0 with no gaps");
  s.n_stages = max_stage + 1;
  s.n_microbatches = max_mb + 1;
  MT_CHECK(s.n_stages % s.pp == 0, "schedule", "CSV names ", s.n_stages, " stages on ", s.pp,
           " ranks: the stage count must be a multiple of the rank count");

  // Each stage is computed on exactly one rank: the first rank whose row computes it (validate() reports a
  // stage computed on two ranks).
  s.stage_rank.assign(size_t(s.n_stages), -1);
  for (int r = 0; r < s.pp; ++r)
    for (const auto& a : s.actions[size_t(r)]) {
      if (!is_compute(a.op)) continue;
      for (int st : {a.stage, a.op == Op::FB ? a.stage2 : -1})
        if (st >= 0 && s.stage_rank[size_t(st)] < 0) s.stage_rank[size_t(st)] = r;
    }
  for (int st = 0; st < s.n_stages; ++st)
    MT_CHECK(s.stage_rank[size_t(st)] >= 0, "schedule", "CSV: no rank computes stage ", st, " (stages 0..",
             s.n_stages - 1, " are named)");
  return s;
}

Schedule read_csv_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.good(), "schedule", "cannot open schedule CSV '", path, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  try {
    return from_csv(ss.str());
  } catch (const Error& e) {
    MT_FAIL("schedule", path, ": ", e.what());
  }
}

}  // namespace moetron::sched
