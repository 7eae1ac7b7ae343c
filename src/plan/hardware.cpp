// plan/hardware.cpp: the hardware description's TOML loader and writer, its validation, the GEMM
// efficiency curve and the `--hw` resolution (catalog name or file). Not the catalog's figures
// (hardware_catalog.cpp holds those, as TOML read by this same loader) and no cost model.
#include "moetron/plan/hardware.h"
#include "job/toml_names.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "moetron/check.h"

namespace moetron::plan {
namespace {

// ---- the key schema ------------------------------------------------------------------------------------
// Every key a hardware file may set, with its TOML unit (the factor from the TOML number to SI).
enum class Kind { Number, Integer, String, Curve, Grid };

struct Key {
  const char* name;  // full dotted key as in [sources]
  Kind kind;
  double scale;      // TOML value x scale = SI value (Number only)
  bool required;
  const char* what;  // one line for messages and docs
};

constexpr double kGB = 1e9, kT = 1e12, kUs = 1e-6, kNs = 1e-9;

constexpr Key kTop[] = {
    {"name", Kind::String, 1, false, "entry name (defaults to the file name)"},
    {"description", Kind::String, 1, false, "free text"},
    {"hbm_gb", Kind::Number, kGB, true, "device memory, GB (1e9 bytes)"},
    {"hbm_bw_gbps", Kind::Number, kGB, true, "peak HBM bandwidth, GB/s"},
    {"hbm_efficiency", Kind::Number, 1, false, "achievable fraction of hbm_bw_gbps for streaming kernels"},
    {"peak_bf16_tflops", Kind::Number, kT, true, "dense BF16 datasheet peak, TFLOPS"},
    {"peak_fp8_tflops", Kind::Number, kT, false, "dense FP8 datasheet peak, TFLOPS (0 = no FP8)"},
    {"achievable_bf16_tflops", Kind::Number, kT, true, "measured large-GEMM BF16 rate, TFLOPS"},
    {"achievable_fp8_tflops", Kind::Number, kT, false, "measured large-GEMM FP8 rate, TFLOPS"},
    {"achievable_fp32_tflops", Kind::Number, kT, false,
     "measured large-GEMM FP32 rate through the engine's fp32 GEMM (Muon's Newton-Schulz), TFLOPS (0 = not measured)"},
    {"kernel_overhead_us", Kind::Number, kUs, false, "per-kernel floor, microseconds"},
    {"host_launch_us", Kind::Number, kUs, false,
     "host time to issue one kernel from the training framework, microseconds (0 = the host always runs ahead)"},
    {"attention_efficiency", Kind::Number, 1, false, "fused attention's rate as a fraction of achievable_bf16"},
    {"gemm_efficiency", Kind::Curve, 1, false, "[[min_dim, eff], ...] fraction of the achievable rate"},
    {"gemm_shape_efficiency", Kind::Grid, 1, false,
     "[[m, n, k, eff], ...] measured fraction of the achievable rate by shape, a full grid (replaces gemm_efficiency)"},
    {"grouped_gemm_efficiency", Kind::Curve, 1, false,
     "[[tokens_per_expert, eff], ...] the experts' grouped GEMMs (forward + backward) against the achievable rate"},
    {"grouped_gemm_fwd_efficiency", Kind::Curve, 1, false,
     "[[tokens_per_expert, eff], ...] the experts' grouped GEMM forward against the achievable rate"},
    {"grouped_gemm_bwd_efficiency", Kind::Curve, 1, false,
     "[[tokens_per_expert, eff], ...] the experts' grouped GEMM backward (dgrad + wgrad) against the achievable rate"},
    {"loss_efficiency", Kind::Number, 1, false,
     "fused head + cross-entropy, forward and backward, as a fraction of the achievable rate"},
    {"elementwise_bw_gbps", Kind::Number, kGB, false, "memory-bound layer kernels at activation sizes, GB/s"},
    {"attention_seq_efficiency", Kind::Curve, 1, false,
     "[[seq_len, eff], ...] attention's rate by sequence length (replaces attention_efficiency)"},
    {"rank_skew", Kind::Curve, 1, false,
     "[[segment_ms, fraction], ...] the slowest rank's excess over the ranks' mean for a segment of compute between "
     "two synchronizing collectives (measured by plan calibrate; empty = none)"},
    {"wait_overshoot_us", Kind::Number, kUs, false,
     "a blocking exchange's cost beyond its transfer when a rank waits for a late partner (measured by plan "
     "calibrate; 0 = none), microseconds"},
    {"optimizer_ns_per_param", Kind::Number, kNs, false, "AdamW update per parameter element, nanoseconds"},
    {"grad_norm_ns_per_param", Kind::Number, kNs, false, "the gradient-norm pass per gradient element, nanoseconds"},
    {"expert_pack_ns_per_param", Kind::Number, kNs, false,
     "re-packing the routed experts' GEMM layouts per expert parameter, nanoseconds"},
    {"expert_pack_fused_ns_per_param", Kind::Number, kNs, false,
     "the same re-packing fused with AdamW's update of the same masters: what it adds to AdamW, nanoseconds"},
};
constexpr Key kTier[] = {
    {"domain", Kind::Integer, 1, true, "GPUs reachable at this tier"},
    {"bw_gbps", Kind::Number, kGB, false, "per-GPU per-direction bandwidth, GB/s"},
    {"alpha_us", Kind::Number, kUs, false, "latency of one message step, microseconds"},
    {"topology", Kind::String, 1, false, "\"switch\" or \"full_mesh\""},
    {"links", Kind::Integer, 1, false, "full_mesh: links per GPU"},
    {"link_bw_gbps", Kind::Number, kGB, false, "full_mesh: per-link per-direction bandwidth, GB/s"},
    {"link_efficiency", Kind::Number, 1, false, "full_mesh: achievable fraction of a link"},
    {"gather_bw_gbps", Kind::Number, kGB, false, "a ring all-gather's per-GPU bandwidth where it differs from bw_gbps"},
    {"scatter_bw_gbps", Kind::Number, kGB, false,
     "a ring reduce-scatter's per-GPU bandwidth where it differs from bw_gbps"},
    {"ep_dispatch_efficiency", Kind::Curve, 1, false,
     "[[ranks, eff], ...] an EP dispatch's fraction of bw_gbps by the exchange's ranks at this tier"},
    {"ep_combine_efficiency", Kind::Curve, 1, false,
     "[[ranks, eff], ...] an EP combine's fraction of bw_gbps by the exchange's ranks at this tier"},
};
constexpr const char* kTierCurveKeys[] = {"ep_dispatch_efficiency", "ep_combine_efficiency"};
constexpr const char* kTiers[] = {"scale_up", "scale_out"};
constexpr const char* kCurveKeys[] = {"gemm_efficiency", "grouped_gemm_efficiency", "grouped_gemm_fwd_efficiency",
                                      "grouped_gemm_bwd_efficiency", "attention_seq_efficiency", "rank_skew"};

std::vector<std::string> all_keys() {
  std::vector<std::string> out;
  for (const auto& k : kTop) out.push_back(k.name);
  for (const char* t : kTiers)
    for (const auto& k : kTier) out.push_back(std::string(t) + "." + k.name);
  return out;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// The closest known key, if it is close enough to be a plausible typo ("" otherwise).
std::string closest(std::string_view name, const std::vector<std::string>& known) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& k : known) {
    size_t d = edit_distance(name, k);
    const size_t dot = k.rfind('.');
    if (dot != std::string::npos && std::string_view(k).substr(dot + 1) == name) d = std::min<size_t>(d, 1);
    if (d < best_d) best_d = d, best = k;
  }
  return best_d <= std::max<size_t>(2, name.size() / 3) ? best : std::string();
}

std::string where(std::string_view source, const toml::node& n) {
  std::string w(source);
  if (n.source().begin.line > 0) w += ":" + std::to_string(n.source().begin.line);
  return w + ": ";
}

[[noreturn]] void unknown(std::string_view source, const toml::node& n, const std::string& key,
                          const std::vector<std::string>& known) {
  std::string msg = where(source, n) + "unknown key '" + key + "'";
  const std::string s = closest(key, known);
  if (!s.empty()) msg += "; did you mean '" + s + "'?";
  throw Error(msg);
}


[[noreturn]] void wrong_type(std::string_view source, const toml::node& n, const std::string& key,
                             const char* expected) {
  throw Error(where(source, n) + key + ": expected " + expected + ", got " + toml_type_name(n));
}

double as_number(std::string_view source, const toml::node& n, const std::string& key) {
  if (auto i = n.as_integer()) return double(i->get());
  if (auto f = n.as_floating_point()) {
    const double v = f->get();
    if (!std::isfinite(v)) throw Error(where(source, n) + key + ": must be a finite number");
    return v;
  }
  wrong_type(source, n, key, "a number");
}

int64_t as_int(std::string_view source, const toml::node& n, const std::string& key) {
  if (auto i = n.as_integer()) return i->get();
  wrong_type(source, n, key, "an integer");
}

std::string as_string(std::string_view source, const toml::node& n, const std::string& key) {
  if (auto s = n.as_string()) return s->get();
  wrong_type(source, n, key, "a string");
}

std::vector<EffPoint> as_curve(std::string_view source, const toml::node& n, const std::string& key) {
  const auto* arr = n.as_array();
  if (!arr) wrong_type(source, n, key, "an array of [dim, eff] pairs");
  std::vector<EffPoint> out;
  for (const auto& el : *arr) {
    const auto* pair = el.as_array();
    if (!pair || pair->size() != 2) wrong_type(source, el, key, "a [dim, eff] pair");
    out.push_back({as_number(source, (*pair)[0], key), as_number(source, (*pair)[1], key)});
  }
  return out;
}

std::vector<std::vector<double>> as_points(std::string_view source, const toml::node& n, const std::string& key) {
  const auto* arr = n.as_array();
  if (!arr) wrong_type(source, n, key, "an array of [m, n, k, eff] points");
  std::vector<std::vector<double>> out;
  for (const auto& el : *arr) {
    const auto* p = el.as_array();
    if (!p || p->size() != 4) wrong_type(source, el, key, "an [m, n, k, eff] point");
    out.push_back({});
    for (const auto& x : *p) out.back().push_back(as_number(source, x, key));
  }
  return out;
}

// Pointers from a key to the Hardware field it fills.
double* number_field(Hardware& h, std::string_view key) {
  if (key == "hbm_gb") return &h.hbm_bytes;
  if (key == "hbm_bw_gbps") return &h.hbm_bw;
  if (key == "hbm_efficiency") return &h.hbm_efficiency;
  if (key == "peak_bf16_tflops") return &h.peak_bf16;
  if (key == "peak_fp8_tflops") return &h.peak_fp8;
  if (key == "achievable_bf16_tflops") return &h.achievable_bf16;
  if (key == "achievable_fp8_tflops") return &h.achievable_fp8;
  if (key == "achievable_fp32_tflops") return &h.achievable_fp32;
  if (key == "kernel_overhead_us") return &h.kernel_overhead;
  if (key == "host_launch_us") return &h.host_launch;
  if (key == "attention_efficiency") return &h.attention_efficiency;
  if (key == "loss_efficiency") return &h.loss_efficiency;
  if (key == "elementwise_bw_gbps") return &h.elementwise_bw;
  if (key == "wait_overshoot_us") return &h.wait_overshoot;
  if (key == "optimizer_ns_per_param") return &h.optimizer_per_param;
  if (key == "grad_norm_ns_per_param") return &h.grad_norm_per_param;
  if (key == "expert_pack_ns_per_param") return &h.expert_pack_per_param;
  if (key == "expert_pack_fused_ns_per_param") return &h.expert_pack_fused_per_param;
  return nullptr;
}
template <class H>  // Hardware or const Hardware
auto curve_field(H& h, std::string_view key) -> decltype(&h.gemm_efficiency) {
  if (key == "gemm_efficiency") return &h.gemm_efficiency;
  if (key == "grouped_gemm_efficiency") return &h.grouped_gemm_efficiency;
  if (key == "grouped_gemm_fwd_efficiency") return &h.grouped_fwd_efficiency;
  if (key == "grouped_gemm_bwd_efficiency") return &h.grouped_bwd_efficiency;
  if (key == "attention_seq_efficiency") return &h.attention_seq_efficiency;
  if (key == "rank_skew") return &h.rank_skew;
  return nullptr;
}
double* number_field(Tier& t, std::string_view key) {
  if (key == "bw_gbps") return &t.bw;
  if (key == "alpha_us") return &t.alpha;
  if (key == "link_bw_gbps") return &t.link_bw;
  if (key == "link_efficiency") return &t.link_efficiency;
  if (key == "gather_bw_gbps") return &t.gather_bw;
  if (key == "scatter_bw_gbps") return &t.scatter_bw;
  return nullptr;
}
template <class T>  // Tier or const Tier
auto tier_curve_field(T& t, std::string_view key) -> decltype(&t.ep_dispatch_efficiency) {
  if (key == "ep_dispatch_efficiency") return &t.ep_dispatch_efficiency;
  if (key == "ep_combine_efficiency") return &t.ep_combine_efficiency;
  return nullptr;
}
int64_t* int_field(Tier& t, std::string_view key) {
  if (key == "domain") return &t.domain;
  if (key == "links") return &t.links;
  return nullptr;
}

void read_tier(std::string_view source, const toml::table& tbl, const std::string& tier, Tier& t,
               const std::vector<std::string>& known) {
  bool seen[std::size(kTier)] = {};
  for (const auto& [k, v] : tbl) {
    const std::string key(k.str());
    const std::string full = tier + "." + key;
    size_t idx = std::size(kTier);
    for (size_t i = 0; i < std::size(kTier); ++i)
      if (key == kTier[i].name) idx = i;
    if (idx == std::size(kTier)) unknown(source, v, full, known);
    seen[idx] = true;
    const Key& spec = kTier[idx];
    if (spec.kind == Kind::Integer) *int_field(t, key) = as_int(source, v, full);
    else if (spec.kind == Kind::String) t.topology = as_string(source, v, full);
    else if (spec.kind == Kind::Curve) *tier_curve_field(t, key) = as_curve(source, v, full);
    else *number_field(t, key) = as_number(source, v, full) * spec.scale;
  }
  for (size_t i = 0; i < std::size(kTier); ++i)
    if (kTier[i].required && !seen[i])
      throw Error(std::string(source) + ": missing required key '" + tier + "." + kTier[i].name + "' (" +
                  kTier[i].what + ")");
  const bool has_bw = seen[1];
  if (t.topology == "full_mesh") {
    if (!seen[4] || !seen[5])
      throw Error(std::string(source) + ": " + tier + ".topology = \"full_mesh\" needs '" + tier + "." +
                  (seen[4] ? "link_bw_gbps" : "links") + "'");
    if (!has_bw) t.bw = t.all_peers_bw();  // the aggregate, when the file gives only the links
  } else if (!has_bw) {
    throw Error(std::string(source) + ": missing required key '" + tier + ".bw_gbps' (" + kTier[1].what + ")");
  }
}

// ---- number formatting -----------------------------------------------------------------------------------
std::string shortest(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// The shortest decimal d with d * scale == v exactly, so that a written file reads back to the same double.
std::string in_units(double v, double scale) {
  if (scale == 1) return shortest(v);
  for (int p = 1; p <= 17; ++p) {
    char buf[64];
    auto r = std::to_chars(buf, buf + sizeof buf, v / scale, std::chars_format::general, p);
    const double d = std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
    if (d * scale == v) return shortest(d);  // shortest() writes 8000, not 8e+03
  }
  return shortest(v / scale);
}

// A TOML float literal (always with a '.', 'e' or inf/nan so it reads back as a float).
std::string toml_float(std::string s) {
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string quoted(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char esc[8];
          std::snprintf(esc, sizeof esc, "\\u%04x", c);
          out += esc;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

std::string source_stem(std::string_view source) {
  std::string_view s = source;
  if (auto slash = s.find_last_of('/'); slash != std::string_view::npos) s = s.substr(slash + 1);
  if (s.size() > 5 && s.substr(s.size() - 5) == ".toml") s = s.substr(0, s.size() - 5);
  return std::string(s);
}

// ---- validation ---------------------------------------------------------------------------------------------
struct Checker {
  std::string_view source;
  [[noreturn]] void fail(const std::string& key, double toml_value, const std::string& rule) const {
    throw Error(std::string(source) + ": " + key + " = " + shortest(toml_value) + ": " + rule);
  }
  void positive(const std::string& key, double si, double scale) const {
    if (!(si > 0)) fail(key, si / scale, "must be > 0");
  }
  void non_negative(const std::string& key, double si, double scale) const {
    if (!(si >= 0)) fail(key, si / scale, "must be >= 0");
  }
  void fraction(const std::string& key, double v) const {
    if (!(v > 0 && v <= 1)) fail(key, v, "must be in (0, 1]");
  }
  // A curve: abscissae > 0 and ascending, every value a fraction.
  void curve(const std::string& key, const std::vector<EffPoint>& cv) const {
    for (size_t i = 0; i < cv.size(); ++i) {
      const std::string at = key + "[" + std::to_string(i) + "]";
      if (!(cv[i].dim > 0)) fail(at + ".dim", cv[i].dim, "must be > 0");
      if (i > 0 && !(cv[i].dim > cv[i - 1].dim))
        fail(at + ".dim", cv[i].dim, "must be > the previous point's dim (ascending)");
      fraction(at + ".eff", cv[i].eff);
    }
  }
};

void validate_tier(const Checker& c, const Tier& t, const std::string& tier) {
  if (t.domain < 1) c.fail(tier + ".domain", double(t.domain), "must be >= 1");
  c.positive(tier + ".bw_gbps", t.bw, kGB);
  c.non_negative(tier + ".alpha_us", t.alpha, kUs);
  if (t.topology != "switch" && t.topology != "full_mesh")
    throw Error(std::string(c.source) + ": " + tier + ".topology = \"" + t.topology +
                "\": must be \"switch\" or \"full_mesh\"");
  if (t.topology == "full_mesh") {
    if (t.links < 1) c.fail(tier + ".links", double(t.links), "must be >= 1 for a full mesh");
    if (t.links > t.domain - 1)
      c.fail(tier + ".links", double(t.links),
             "must be <= domain - 1 = " + std::to_string(t.domain - 1) + " (one link per peer)");
    c.positive(tier + ".link_bw_gbps", t.link_bw, kGB);
    c.fraction(tier + ".link_efficiency", t.link_efficiency);
  } else {
    if (t.links < 0) c.fail(tier + ".links", double(t.links), "must be >= 0");
    c.non_negative(tier + ".link_bw_gbps", t.link_bw, kGB);
    c.fraction(tier + ".link_efficiency", t.link_efficiency);
  }
  c.non_negative(tier + ".gather_bw_gbps", t.gather_bw, kGB);
  c.non_negative(tier + ".scatter_bw_gbps", t.scatter_bw, kGB);
  for (const char* key : kTierCurveKeys) c.curve(tier + "." + key, *tier_curve_field(t, key));
}

}  // namespace

// ---- Hardware methods ---------------------------------------------------------------------------------------
namespace {
// Where x falls on an ascending axis of n points (the i-th at abscissa(i)): the two neighbours and x's log-linear
// weight towards the upper one; clamped to the end point at and beyond either end. One lookup for the curves by one
// dimension and for each axis of the GEMM shape grid.
struct Cell {
  size_t lo = 0, hi = 0;
  double w = 0;
};
template <class Abscissa>
Cell log_cell(size_t n, Abscissa abscissa, double x) {
  if (n == 1 || !(x > abscissa(0))) return {0, 0, 0};
  if (x >= abscissa(n - 1)) return {n - 1, n - 1, 0};
  size_t i = 1;
  while (abscissa(i) < x) ++i;  // abscissa(i - 1) < x <= abscissa(i)
  const double x0 = std::log(abscissa(i - 1)), x1 = std::log(abscissa(i));
  return {i - 1, i, (std::log(x) - x0) / (x1 - x0)};
}
Cell axis_cell(const std::vector<double>& a, double x) {
  return log_cell(a.size(), [&](size_t i) { return a[i]; }, x);
}

// Log-linear interpolation in a curve, clamped at both ends; 1.0 for an empty curve.
double curve_at(const std::vector<EffPoint>& t, double min_dim) {
  if (t.empty()) return 1.0;
  const Cell c = log_cell(t.size(), [&](size_t i) { return t[i].dim; }, min_dim);
  return t[c.lo].eff + c.w * (t[c.hi].eff - t[c.lo].eff);
}

[[noreturn]] void grid_fail(const std::string& key, const std::string& what) { throw Error(key + ": " + what); }
std::string grid_point(const std::vector<double>& p) {
  return "[" + shortest(p[0]) + ", " + shortest(p[1]) + ", " + shortest(p[2]) + "]";
}
}  // namespace

double GemmShapeTable::at(double mm, double nn, double kk) const {
  if (empty()) return 1.0;
  const Cell cm = axis_cell(m, mm), cn = axis_cell(n, nn), ck = axis_cell(k, kk);
  auto e = [&](size_t i, size_t j, size_t l) { return eff[(i * n.size() + j) * k.size() + l]; };
  double v = 0;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      for (int c = 0; c < 2; ++c) {
        const double w = (a ? cm.w : 1 - cm.w) * (b ? cn.w : 1 - cn.w) * (c ? ck.w : 1 - ck.w);
        if (w > 0) v += w * e(a ? cm.hi : cm.lo, b ? cn.hi : cn.lo, c ? ck.hi : ck.lo);
      }
  // Below an axis's first value the GEMM takes the time of the smallest measured one (its tiles are no fewer).
  for (const auto& [x, axis] : {std::pair{mm, &m}, std::pair{nn, &n}, std::pair{kk, &k}})
    if (x < axis->front()) v *= std::max(x, 0.0) / axis->front();
  return v;
}

GemmShapeTable GemmShapeTable::from_points(const std::vector<std::vector<double>>& pts, const std::string& key) {
  GemmShapeTable t;
  for (const auto& p : pts) {
    if (p.size() != 4) grid_fail(key, "each point is [m, n, k, eff], got " + std::to_string(p.size()) + " numbers");
    for (int d = 0; d < 3; ++d)
      if (!(p[d] > 0 && std::isfinite(p[d]))) grid_fail(key, grid_point(p) + ": every dimension must be > 0");
    t.m.push_back(p[0]), t.n.push_back(p[1]), t.k.push_back(p[2]);
  }
  for (auto* a : {&t.m, &t.n, &t.k}) {
    std::sort(a->begin(), a->end());
    a->erase(std::unique(a->begin(), a->end()), a->end());
  }
  const size_t cells = t.m.size() * t.n.size() * t.k.size();
  if (pts.size() != cells)
    grid_fail(key, std::to_string(pts.size()) + " points do not fill the grid of " + std::to_string(t.m.size()) +
                       " m x " + std::to_string(t.n.size()) + " n x " + std::to_string(t.k.size()) + " k values (" +
                       std::to_string(cells) + " points, each once)");
  t.eff.assign(cells, -1.0);
  auto index = [](const std::vector<double>& a, double x) {
    return size_t(std::lower_bound(a.begin(), a.end(), x) - a.begin());
  };
  for (const auto& p : pts) {
    double& slot = t.eff[(index(t.m, p[0]) * t.n.size() + index(t.n, p[1])) * t.k.size() + index(t.k, p[2])];
    if (slot >= 0) grid_fail(key, "the point " + grid_point(p) + " is given twice");
    slot = p[3];
  }
  return t;
}

double Tier::ep_eff(bool combine, double ranks) const {
  return curve_at(combine ? ep_combine_efficiency : ep_dispatch_efficiency, ranks);
}
double Hardware::gemm_eff(double min_dim) const { return curve_at(gemm_efficiency, min_dim); }
double Hardware::attention_eff(double seq_len) const {
  return attention_seq_efficiency.empty() ? attention_efficiency : curve_at(attention_seq_efficiency, seq_len);
}
double Hardware::skew_fraction(double segment_s) const {
  return rank_skew.empty() ? 0.0 : curve_at(rank_skew, 1e3 * segment_s);
}
double Hardware::grouped_eff(double tokens_per_expert) const {
  return curve_at(grouped_gemm_efficiency, tokens_per_expert);
}
bool Hardware::grouped_split_eff(double tokens_per_expert, double* fwd, double* bwd) const {
  if (grouped_fwd_efficiency.empty() && grouped_bwd_efficiency.empty() && grouped_gemm_efficiency.empty())
    return false;
  const double both = curve_at(grouped_gemm_efficiency, tokens_per_expert);
  *fwd = grouped_fwd_efficiency.empty() ? both : curve_at(grouped_fwd_efficiency, tokens_per_expert);
  *bwd = grouped_bwd_efficiency.empty() ? both : curve_at(grouped_bwd_efficiency, tokens_per_expert);
  return true;
}

double Hardware::gemm_rate(double m, double n, double k, bool fp8) const {
  const double rate = fp8 ? achievable_fp8 : achievable_bf16;
  if (!(rate > 0))
    throw Error("hardware '" + name + "': no " + (fp8 ? "achievable_fp8_tflops" : "achievable_bf16_tflops") +
                " figure, so no " + (fp8 ? "FP8" : "BF16") + " GEMM rate");
  return rate * (gemm_shape_efficiency.empty() ? gemm_eff(std::min({m, n, k})) : gemm_shape_efficiency.at(m, n, k));
}

// ---- TOML -> Hardware --------------------------------------------------------------------------------------
Hardware hardware_from_toml(std::string_view toml_text, std::string_view source) {
  toml::table root;
  try {
    root = toml::parse(toml_text, source);
  } catch (const toml::parse_error& e) {
    throw Error(std::string(source) + ":" + std::to_string(e.source().begin.line) +
                ": TOML syntax error: " + std::string(e.description()));
  }
  const std::vector<std::string> known = all_keys();
  Hardware h;
  bool seen[std::size(kTop)] = {};
  bool seen_tier[2] = {};
  const toml::table* sources = nullptr;
  for (const auto& [k, v] : root) {
    const std::string key(k.str());
    if (key == "sources") {
      sources = v.as_table();
      if (!sources) wrong_type(source, v, key, "a table of key = \"source\" strings");
      continue;
    }
    if (key == "scale_up" || key == "scale_out") {
      const auto* tbl = v.as_table();
      if (!tbl) wrong_type(source, v, key, "a table");
      const int ti = key == "scale_up" ? 0 : 1;
      seen_tier[ti] = true;
      read_tier(source, *tbl, key, ti == 0 ? h.scale_up : h.scale_out, known);
      continue;
    }
    size_t idx = std::size(kTop);
    for (size_t i = 0; i < std::size(kTop); ++i)
      if (key == kTop[i].name) idx = i;
    if (idx == std::size(kTop)) unknown(source, v, key, known);
    seen[idx] = true;
    const Key& spec = kTop[idx];
    switch (spec.kind) {
      case Kind::String:
        (key == "name" ? h.name : h.description) = as_string(source, v, key);
        break;
      case Kind::Curve:
        *curve_field(h, key) = as_curve(source, v, key);
        break;
      case Kind::Grid:
        try {
          h.gemm_shape_efficiency = GemmShapeTable::from_points(as_points(source, v, key), key);
        } catch (const Error& e) {
          throw Error(std::string(source) + ": " + e.what());
        }
        break;
      case Kind::Number: *number_field(h, key) = as_number(source, v, key) * spec.scale; break;
      case Kind::Integer: break;  // no top-level integers
    }
  }
  for (size_t i = 0; i < std::size(kTop); ++i)
    if (kTop[i].required && !seen[i])
      throw Error(std::string(source) + ": missing required key '" + kTop[i].name + "' (" + kTop[i].what + ")");
  for (int ti = 0; ti < 2; ++ti)
    if (!seen_tier[ti])
      throw Error(std::string(source) + ": missing required table [" + kTiers[ti] + "] (domain, bw_gbps, ...)");
  if (!seen[0]) h.name = source_stem(source);
  if (sources) {
    for (const auto& [k, v] : *sources) {
      const std::string key(k.str());
      if (std::find(known.begin(), known.end(), key) == known.end())
        unknown(source, v, "sources." + key, [&] {
          std::vector<std::string> s;
          for (const auto& kk : known) s.push_back("sources." + kk);
          return s;
        }());
      h.sources[key] = as_string(source, v, "sources." + key);
    }
  }
  return h;
}

// ---- Hardware -> TOML --------------------------------------------------------------------------------------
namespace {
// `key = [[dim, eff], ...]` (an empty curve writes nothing: absent means 1.0 everywhere).
void write_curve(std::ostream& os, std::string_view key, const std::vector<EffPoint>& cv) {
  if (cv.empty() && key != "gemm_efficiency") return;
  os << key << " = [";
  for (size_t i = 0; i < cv.size(); ++i)
    os << (i ? ", " : "") << "[" << toml_float(shortest(cv[i].dim)) << ", " << toml_float(shortest(cv[i].eff)) << "]";
  os << "]\n";
}
}  // namespace

std::string hardware_to_toml(const Hardware& h) {
  std::ostringstream os;
  auto num = [&](const char* key, double si, double scale) {
    os << key << " = " << toml_float(in_units(si, scale)) << "\n";
  };
  os << "name = " << quoted(h.name) << "\n";
  os << "description = " << quoted(h.description) << "\n";
  num("hbm_gb", h.hbm_bytes, kGB);
  num("hbm_bw_gbps", h.hbm_bw, kGB);
  num("hbm_efficiency", h.hbm_efficiency, 1);
  num("peak_bf16_tflops", h.peak_bf16, kT);
  num("peak_fp8_tflops", h.peak_fp8, kT);
  num("achievable_bf16_tflops", h.achievable_bf16, kT);
  num("achievable_fp8_tflops", h.achievable_fp8, kT);
  if (h.achievable_fp32 > 0) num("achievable_fp32_tflops", h.achievable_fp32, kT);
  num("kernel_overhead_us", h.kernel_overhead, kUs);
  num("attention_efficiency", h.attention_efficiency, 1);
  if (h.host_launch > 0) num("host_launch_us", h.host_launch, kUs);
  // The measured per-op figures only when set (0 means "not measured": the cost model's generic pricing).
  if (h.loss_efficiency > 0) num("loss_efficiency", h.loss_efficiency, 1);
  if (h.elementwise_bw > 0) num("elementwise_bw_gbps", h.elementwise_bw, kGB);
  if (h.wait_overshoot > 0) num("wait_overshoot_us", h.wait_overshoot, kUs);
  if (h.optimizer_per_param > 0) num("optimizer_ns_per_param", h.optimizer_per_param, kNs);
  if (h.grad_norm_per_param > 0) num("grad_norm_ns_per_param", h.grad_norm_per_param, kNs);
  if (h.expert_pack_per_param > 0) num("expert_pack_ns_per_param", h.expert_pack_per_param, kNs);
  if (h.expert_pack_fused_per_param > 0) num("expert_pack_fused_ns_per_param", h.expert_pack_fused_per_param, kNs);
  for (const char* key : kCurveKeys) write_curve(os, key, *curve_field(h, key));
  if (!h.gemm_shape_efficiency.empty()) {
    const GemmShapeTable& t = h.gemm_shape_efficiency;
    os << "gemm_shape_efficiency = [\n";
    for (size_t i = 0; i < t.m.size(); ++i)
      for (size_t j = 0; j < t.n.size(); ++j)
        for (size_t l = 0; l < t.k.size(); ++l)
          os << "  [" << toml_float(shortest(t.m[i])) << ", " << toml_float(shortest(t.n[j])) << ", "
             << toml_float(shortest(t.k[l])) << ", "
             << toml_float(shortest(t.eff[(i * t.n.size() + j) * t.k.size() + l])) << "],\n";
    os << "]\n";
  }
  for (int ti = 0; ti < 2; ++ti) {
    const Tier& t = ti == 0 ? h.scale_up : h.scale_out;
    os << "\n[" << kTiers[ti] << "]\n";
    os << "domain = " << t.domain << "\n";
    num("bw_gbps", t.bw, kGB);
    num("alpha_us", t.alpha, kUs);
    os << "topology = " << quoted(t.topology) << "\n";
    os << "links = " << t.links << "\n";
    num("link_bw_gbps", t.link_bw, kGB);
    num("link_efficiency", t.link_efficiency, 1);
    if (t.gather_bw > 0) num("gather_bw_gbps", t.gather_bw, kGB);
    if (t.scatter_bw > 0) num("scatter_bw_gbps", t.scatter_bw, kGB);
    for (const char* key : kTierCurveKeys) write_curve(os, key, *tier_curve_field(t, key));
  }
  if (!h.sources.empty()) {
    os << "\n[sources]\n";
    for (const auto& [k, v] : h.sources) os << quoted(k) << " = " << quoted(v) << "\n";
  }
  return os.str();
}

// ---- validation ---------------------------------------------------------------------------------------------
void validate_hardware(const Hardware& h, std::string_view source) {
  const Checker c{source};
  c.positive("hbm_gb", h.hbm_bytes, kGB);
  c.positive("hbm_bw_gbps", h.hbm_bw, kGB);
  c.fraction("hbm_efficiency", h.hbm_efficiency);
  c.positive("peak_bf16_tflops", h.peak_bf16, kT);
  c.positive("achievable_bf16_tflops", h.achievable_bf16, kT);
  if (h.achievable_bf16 > h.peak_bf16)
    c.fail("achievable_bf16_tflops", h.achievable_bf16 / kT,
           "must be <= peak_bf16_tflops = " + shortest(h.peak_bf16 / kT) + " (a measured rate, not above the peak)");
  c.non_negative("peak_fp8_tflops", h.peak_fp8, kT);
  c.non_negative("achievable_fp8_tflops", h.achievable_fp8, kT);
  c.non_negative("achievable_fp32_tflops", h.achievable_fp32, kT);
  if (h.achievable_fp8 > 0 && !(h.peak_fp8 > 0))
    c.fail("peak_fp8_tflops", h.peak_fp8 / kT, "must be > 0 when achievable_fp8_tflops is set");
  if (h.achievable_fp8 > h.peak_fp8)
    c.fail("achievable_fp8_tflops", h.achievable_fp8 / kT,
           "must be <= peak_fp8_tflops = " + shortest(h.peak_fp8 / kT));
  c.non_negative("kernel_overhead_us", h.kernel_overhead, kUs);
  c.non_negative("host_launch_us", h.host_launch, kUs);
  if (!(h.attention_efficiency > 0 && h.attention_efficiency <= 1))
    c.fail("attention_efficiency", h.attention_efficiency, "must lie in (0, 1]");
  if (!(h.loss_efficiency >= 0 && h.loss_efficiency <= 1))
    c.fail("loss_efficiency", h.loss_efficiency, "must lie in [0, 1] (0 = not measured)");
  c.non_negative("elementwise_bw_gbps", h.elementwise_bw, kGB);
  c.non_negative("wait_overshoot_us", h.wait_overshoot, kUs);
  c.non_negative("optimizer_ns_per_param", h.optimizer_per_param, kNs);
  c.non_negative("grad_norm_ns_per_param", h.grad_norm_per_param, kNs);
  c.non_negative("expert_pack_ns_per_param", h.expert_pack_per_param, kNs);
  c.non_negative("expert_pack_fused_ns_per_param", h.expert_pack_fused_per_param, kNs);
  for (const char* key : kCurveKeys) c.curve(key, *curve_field(h, key));
  const GemmShapeTable& g = h.gemm_shape_efficiency;
  for (size_t i = 0; i < g.eff.size(); ++i) {
    const size_t l = i % g.k.size(), j = (i / g.k.size()) % g.n.size(), mi = i / (g.k.size() * g.n.size());
    c.fraction("gemm_shape_efficiency[" + shortest(g.m[mi]) + ", " + shortest(g.n[j]) + ", " + shortest(g.k[l]) + "]",
               g.eff[i]);
  }
  validate_tier(c, h.scale_up, "scale_up");
  validate_tier(c, h.scale_out, "scale_out");
}

// ---- --hw resolution ----------------------------------------------------------------------------------------
Hardware resolve_hardware(const std::string& name_or_path) {
  const bool is_path = name_or_path.find('/') != std::string::npos ||
                       (name_or_path.size() >= 5 && name_or_path.compare(name_or_path.size() - 5, 5, ".toml") == 0);
  if (!is_path) return catalog_hardware(name_or_path);
  std::ifstream in(name_or_path, std::ios::binary);
  if (!in) {
    const int err = errno;
    throw Error("hardware file '" + name_or_path + "': cannot read (" + std::strerror(err ? err : ENOENT) +
                "); pass a catalog name or a readable TOML file");
  }
  std::ostringstream text;
  text << in.rdbuf();
  Hardware h = hardware_from_toml(text.str(), name_or_path);
  validate_hardware(h, name_or_path);
  return h;
}

}  // namespace moetron::plan
