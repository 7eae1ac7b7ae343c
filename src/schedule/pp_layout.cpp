// pp_layout.cpp: the pipeline layer layout (pp_layout.h): a recursive-descent parser for Megatron's layout
// grammar (symbols, repeats, nested groups) that sizes the expansion before building it, the layout rules
// (E first, L last, layer and stage counts), the TorchTitan-style even split, and the stage -> rank helpers.
// Not the schedule generators and not the engine's model split.
#include "moetron/pp_layout.h"

#include <algorithm>
#include <sstream>

#include "moetron/check.h"
#include "moetron/schedule.h"

namespace moetron::sched {
namespace {

constexpr const char* kOp = "pp_layout";

// The layout text as messages quote it: long texts are cut (a config string may be anything).
std::string quoted(std::string_view text) {
  std::string s(text.substr(0, 80));
  if (text.size() > 80) s += "...";
  return "pp_layout \"" + s + "\"";
}

std::string char_text(char c) {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 0x21 && u < 0x7f) return std::string("'") + c + "'";
  std::ostringstream os;
  os << "byte 0x" << std::hex << int(u);
  return os.str();
}

bool ignorable(char c) { return c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_symbol(char c) { return c == 'E' || c == 't' || c == 'L' || c == '|' || c == 'm'; }

struct Sym {
  char c;
  int pos;  // 1-based position in the text
};

// A symbol or a parenthesized group, repeated `repeat` times.
struct Node {
  char sym = 0;  // 0 for a group
  int pos = 0;
  int64_t repeat = 1;
  std::vector<Node> kids;
};

class Parser {
 public:
  explicit Parser(std::string_view text) : t_(text) {}

  std::vector<Node> parse() { return seq(0, -1); }

 private:
  std::string_view t_;
  size_t i_ = 0;

  int pos() const { return int(i_) + 1; }
  void skip() {
    while (i_ < t_.size() && ignorable(t_[i_])) ++i_;
  }
  template <class... A>
  [[noreturn]] void fail(const A&... why) const {
    MT_FAIL(kOp, quoted(t_), ": ", why...);
  }

  // A sequence up to the end of the text (open < 0) or up to the ')' closing the '(' at position `open`.
  std::vector<Node> seq(int depth, int open) {
    std::vector<Node> out;
    while (true) {
      skip();
      if (i_ == t_.size()) {
        if (open >= 0) fail("unbalanced parentheses: '(' at position ", open, " is never closed");
        return out;
      }
      const char c = t_[i_];
      Node n;
      n.pos = pos();
      if (c == ')') {
        if (open < 0) fail("unbalanced parentheses: ')' at position ", pos(), " has no matching '('");
        ++i_;
        return out;
      } else if (c == '(') {
        if (depth + 1 > kMaxLayoutDepth)
          fail("'(' at position ", pos(), " nests deeper than ", kMaxLayoutDepth, " groups (size limit)");
        ++i_;
        n.kids = seq(depth + 1, n.pos);
        if (n.kids.empty()) fail("empty group '()' at position ", n.pos, " (a group needs at least one symbol)");
      } else if (is_symbol(c)) {
        n.sym = c;
        ++i_;
      } else if (c == '*') {
        fail("bad repeat: '*' at position ", pos(), " does not follow a symbol or a group (write t*3 or (tt|)*3)");
      } else if (c >= '0' && c <= '9') {
        fail("bad repeat count: digit '", c, "' at position ", pos(), " has no '*' before it (write t*3)");
      } else {
        fail("unknown character ", char_text(c), " at position ", pos(),
             " (expected E, t, m, L, |, (, ), *, a repeat count, commas or spaces)");
      }
      skip();
      if (i_ < t_.size() && t_[i_] == '*') {
        const int star = pos();
        ++i_;
        skip();
        const size_t d0 = i_;
        int64_t v = 0;
        while (i_ < t_.size() && t_[i_] >= '0' && t_[i_] <= '9') {
          v = std::min<int64_t>(v * 10 + (t_[i_] - '0'), kMaxLayoutItems + 1);  // saturates: no overflow
          ++i_;
        }
        if (i_ == d0) fail("bad repeat count: '*' at position ", star, " must be followed by a number (write t*3)");
        const std::string digits(t_.substr(d0, i_ - d0));
        if (v == 0) fail("bad repeat count: *", digits, " at position ", star, " must be >= 1");
        if (v > kMaxLayoutItems)
          fail("bad repeat count: *", digits, " at position ", star, " is above the size limit 2^20 = ",
               kMaxLayoutItems);
        n.repeat = v;
      }
      out.push_back(std::move(n));
    }
  }
};

// Expanded length, saturating just above the limit (so it cannot overflow: each factor is <= limit + 1).
int64_t expanded_size(const std::vector<Node>& nodes) {
  int64_t total = 0;
  for (const auto& n : nodes) {
    const int64_t unit = n.sym ? 1 : expanded_size(n.kids);
    total = std::min(total + unit * n.repeat, kMaxLayoutItems + 1);
  }
  return total;
}

void expand(const std::vector<Node>& nodes, std::vector<Sym>& out) {
  for (const auto& n : nodes)
    for (int64_t r = 0; r < n.repeat; ++r) {
      if (n.sym) out.push_back({n.sym, n.pos});
      else expand(n.kids, out);
    }
}

// Grammar errors only; the result is split into stages at '|'.
std::vector<std::vector<Sym>> expand_stages(std::string_view text) {
  const auto nodes = Parser(text).parse();
  const int64_t size = expanded_size(nodes);
  if (size > kMaxLayoutItems)
    MT_FAIL(kOp, quoted(text), ": expands to more than 2^20 = ", kMaxLayoutItems, " symbols (size limit)");
  std::vector<Sym> flat;
  flat.reserve(size_t(size));
  expand(nodes, flat);
  std::vector<std::vector<Sym>> stages(1);
  for (const Sym& s : flat) {
    if (s.c == '|') stages.emplace_back();
    else stages.back().push_back(s);
  }
  return stages;
}

std::vector<int> placement(int pp, int n_stages, bool v_shape) {
  return v_shape ? v_placement(pp) : loop_placement(pp, n_stages);
}

// "layers 3-5", "layer 3", "layers 3, 7" (non-contiguous lists cannot come from a layout, but stay exact).
std::string layer_text(const std::vector<int>& ls) {
  if (ls.empty()) return "";
  bool contiguous = true;
  for (size_t i = 1; i < ls.size(); ++i) contiguous &= ls[i] == ls[i - 1] + 1;
  std::ostringstream os;
  if (ls.size() == 1) os << "layer " << ls[0];
  else if (contiguous) os << "layers " << ls.front() << "-" << ls.back();
  else {
    os << "layers ";
    for (size_t i = 0; i < ls.size(); ++i) os << (i ? ", " : "") << ls[i];
  }
  return os.str();
}

}  // namespace

int64_t PpLayout::n_layers() const {
  int64_t n = 0;
  for (const auto& st : stages)
    for (const auto& it : st) n += it.kind == LayoutItem::Layer;
  return n;
}

std::vector<int> PpLayout::stages_for_rank(int rank) const {
  if (rank < 0 || rank >= pp) MT_FAIL(kOp, "rank ", rank, " out of range [0, ", pp, ")");
  std::vector<int> out;
  for (int s = 0; s < n_stages; ++s)
    if (stage_rank[size_t(s)] == rank) out.push_back(s);
  return out;
}

std::vector<int> PpLayout::layers(int stage) const {
  if (stage < 0 || stage >= n_stages) MT_FAIL(kOp, "stage ", stage, " out of range [0, ", n_stages, ")");
  std::vector<int> out;
  for (const auto& it : stages[size_t(stage)])
    if (it.kind == LayoutItem::Layer) out.push_back(it.layer);
  return out;
}

bool PpLayout::has_embedding(int stage) const {
  if (stage < 0 || stage >= n_stages) MT_FAIL(kOp, "stage ", stage, " out of range [0, ", n_stages, ")");
  for (const auto& it : stages[size_t(stage)])
    if (it.kind == LayoutItem::Embedding) return true;
  return false;
}

bool PpLayout::has_loss(int stage) const {
  if (stage < 0 || stage >= n_stages) MT_FAIL(kOp, "stage ", stage, " out of range [0, ", n_stages, ")");
  for (const auto& it : stages[size_t(stage)])
    if (it.kind == LayoutItem::Loss) return true;
  return false;
}

std::string PpLayout::to_string() const {
  std::string s;
  for (size_t i = 0; i < stages.size(); ++i) {
    if (i) s += '|';
    for (const auto& it : stages[i]) s += it.kind == LayoutItem::Embedding ? 'E' : it.kind == LayoutItem::Loss ? 'L' : 't';
  }
  return s;
}

std::string PpLayout::describe() const {
  std::ostringstream os;
  for (int s = 0; s < n_stages; ++s) {
    std::vector<std::string> parts;
    if (has_embedding(s)) parts.push_back("embedding");
    const auto ls = layers(s);
    if (!ls.empty()) parts.push_back(layer_text(ls));
    if (has_loss(s)) parts.push_back("loss");
    os << "stage " << s << " (rank " << stage_rank[size_t(s)] << "): ";
    if (parts.empty()) os << "(empty stage)";
    for (size_t i = 0; i < parts.size(); ++i) os << (i ? ", " : "") << parts[i];
    os << '\n';
  }
  return os.str();
}

std::vector<std::string> expand_pp_layout(std::string_view text) {
  std::vector<std::string> out;
  for (const auto& st : expand_stages(text)) {
    std::string s;
    for (const Sym& x : st) s += x.c;
    out.push_back(s);
  }
  return out;
}

PpLayout parse_pp_layout(std::string_view text, int64_t n_layers, int pp, int n_stages, bool v_shape,
                         int64_t mtp_layers) {
  if (pp < 1) MT_FAIL(kOp, "pp = ", pp, " must be >= 1");
  if (n_stages < 0) MT_FAIL(kOp, "n_stages = ", n_stages, " must be >= 0 (0 = any multiple of pp)");
  const auto st = expand_stages(text);
  const int count = int(st.size());  // <= kMaxLayoutItems + 1
  const std::string q = quoted(text);

  // E: exactly once, first item of stage 0. L: exactly once, last item of the last stage.
  for (const char c : {'E', 'L'}) {
    const char* what = c == 'E' ? "E (embedding)" : "L (loss)";
    const std::string where = c == 'E' ? std::string("the first item of stage 0")
                                       : "the last item of the last stage (stage " + std::to_string(count - 1) + ")";
    int n = 0, stage = -1, idx = -1, at = 0;  // count, and where the first one is
    for (int s = 0; s < count; ++s)
      for (size_t k = 0; k < st[size_t(s)].size(); ++k)
        if (st[size_t(s)][k].c == c && n++ == 0) stage = s, idx = int(k), at = st[size_t(s)][k].pos;
    if (n == 0) MT_FAIL(kOp, q, ": no ", what, "; it must appear exactly once, as ", where);
    if (n > 1) MT_FAIL(kOp, q, ": ", what, " appears ", n, " times; it must appear exactly once, as ", where);
    const int want_stage = c == 'E' ? 0 : count - 1;
    const int want_idx = c == 'E' ? 0 : int(st[size_t(want_stage)].size()) - 1;
    if (stage != want_stage || idx != want_idx)
      MT_FAIL(kOp, q, ": ", what, " at position ", at, " must be ", where, "; it is item ", idx, " (0-based) of stage ",
              stage);
  }
  // m (an MTP depth, model.mtp_layers): optional, but if written one per depth, right before L on the last stage.
  int64_t n_m = 0;
  for (const auto& s : st)
    for (const Sym& x : s) n_m += x.c == 'm';
  if (n_m > 0) {
    if (n_m != mtp_layers)
      MT_FAIL(kOp, q, ": has ", n_m, " MTP layers (m), model.mtp_layers = ", mtp_layers,
              mtp_layers == 0 ? " (set model.mtp_layers, or drop the m)" : " (one m per depth, or none)");
    const auto& last = st[size_t(count - 1)];
    for (size_t k = 0; k < last.size(); ++k) {
      const bool should = k + 1 < last.size() && k + 1 + size_t(n_m) >= last.size();
      if ((last[k].c == 'm') != should)
        MT_FAIL(kOp, q, ": the MTP layers (m) must be the items right before L on the last stage (the MTP modules live "
                "with the head), as in \"...t|mL\"");
    }
    for (size_t s = 0; s + 1 < st.size(); ++s)
      for (const Sym& x : st[s])
        if (x.c == 'm')
          MT_FAIL(kOp, q, ": m at position ", x.pos, " is on stage ", s, "; the MTP layers live on the last stage, "
                  "right before L");
  }
  int64_t layers = 0;
  for (const auto& s : st)
    for (const Sym& x : s) layers += x.c == 't';
  if (layers != n_layers) MT_FAIL(kOp, q, ": has ", layers, " decoder layers, model.n_layers = ", n_layers);
  if (n_stages > 0 && count != n_stages)
    MT_FAIL(kOp, q, ": has ", count, " stages, pp * stages per rank = ", pp, " * ", n_stages / pp, " = ", n_stages);
  if (count % pp != 0)
    MT_FAIL(kOp, q, ": has ", count, " stages, not divisible by pp = ", pp, " (stage s runs on rank s mod pp)");
  if (v_shape && count != 2 * pp)
    MT_FAIL(kOp, q, ": has ", count, " stages; a V schedule places exactly 2 stages per rank: 2 * pp = ", 2 * pp);

  PpLayout L;
  L.pp = pp;
  L.n_stages = count;
  L.stages.resize(size_t(count));
  int32_t next = 0;
  for (int s = 0; s < count; ++s)
    for (const Sym& x : st[size_t(s)]) {
      if (x.c == 'm') continue;  // the MTP blocks go with L (ModelStagePart::head): not an item of their own
      LayoutItem it;
      if (x.c == 'E') it.kind = LayoutItem::Embedding;
      else if (x.c == 'L') it.kind = LayoutItem::Loss;
      else it.layer = next++;
      L.stages[size_t(s)].push_back(it);
    }
  L.stage_rank = placement(pp, count, v_shape);
  return L;
}

PpLayout even_pp_layout(int64_t n_layers, int pp, int vpp, int64_t first_less, int64_t last_less, bool v_shape) {
  if (pp < 1) MT_FAIL(kOp, "pp = ", pp, " must be >= 1");
  if (vpp < 1) MT_FAIL(kOp, "stages per rank = ", vpp, " must be >= 1");
  if (n_layers < 0) MT_FAIL(kOp, "model.n_layers = ", n_layers, " must be >= 0");
  if (first_less < 0) MT_FAIL(kOp, "pp_first_stage_less_layers = ", first_less, " must be >= 0");
  if (last_less < 0) MT_FAIL(kOp, "pp_last_stage_less_layers = ", last_less, " must be >= 0");
  // Bounds that keep every sum below in range and every allocation small.
  if (n_layers > kMaxLayoutItems) MT_FAIL(kOp, "model.n_layers = ", n_layers, " must be <= 2^20 (size limit)");
  if (first_less > kMaxLayoutItems)
    MT_FAIL(kOp, "pp_first_stage_less_layers = ", first_less, " must be <= 2^20 (size limit)");
  if (last_less > kMaxLayoutItems)
    MT_FAIL(kOp, "pp_last_stage_less_layers = ", last_less, " must be <= 2^20 (size limit)");
  if (v_shape && vpp != 2) MT_FAIL(kOp, "a V schedule places exactly 2 stages per rank, got ", vpp);
  // Everything in int64 before anything is allocated: pp and vpp are ints, each < 2^31, and e <= 3 * 2^20, so
  // more than one stage is only allocated when there are at most e of them.
  const int64_t n = int64_t(pp) * vpp;
  const int64_t e = n_layers + first_less + last_less;
  if (n > 1) {
    if (n > e)
      MT_FAIL(kOp, "cannot split model.n_layers = ", n_layers, " over pp * stages per rank = ", pp, " * ", vpp, " = ", n,
              " stages: only ", e, " layer-equivalents (n_layers + pp_first_stage_less_layers ", first_less,
              " + pp_last_stage_less_layers ", last_less, "), so a stage would be empty; use fewer stages or place "
              "the layers with pp_layout");
    const int64_t per = e / n;
    if (first_less > per)
      MT_FAIL(kOp, "pp_first_stage_less_layers = ", first_less, " exceeds the ", per, " layer-equivalents of a stage (",
              e, " over ", n, " stages)");
    if (last_less > per)
      MT_FAIL(kOp, "pp_last_stage_less_layers = ", last_less, " exceeds the ", per, " layer-equivalents of a stage (",
              e, " over ", n, " stages)");
  }
  PpLayout L;
  L.pp = pp;
  L.n_stages = int(n);
  L.stages.resize(size_t(n));
  int32_t next = 0;
  const int64_t per = n > 1 ? e / n : 0, extra = n > 1 ? e % n : 0;
  for (int64_t s = 0; s < n; ++s) {
    auto& items = L.stages[size_t(s)];
    int64_t take = n == 1 ? n_layers : per + (s < extra ? 1 : 0);
    if (s == 0) items.push_back({LayoutItem::Embedding, -1});
    if (n > 1 && s == 0) take -= first_less;
    if (n > 1 && s == n - 1) take -= last_less;
    for (int64_t k = 0; k < take; ++k) items.push_back({LayoutItem::Layer, next++});
    if (s == n - 1) items.push_back({LayoutItem::Loss, -1});
  }
  if (next != n_layers) MT_FAIL(kOp, "internal: even split placed ", next, " of ", n_layers, " layers");
  L.stage_rank = placement(pp, int(n), v_shape);
  return L;
}

}  // namespace moetron::sched
