// published.cpp: the planner against published MoE training throughput (plan/published.h): the CSV reader, the
// row -> preset / catalog entry / layout / batch / recipe mapping (each refusal with its reason), the projection
// through plan_time (the `plan time` path: load_config with overrides, layout_from_config, plan_time), and the
// per-split summary and its table / JSON. Not a cost model: every figure comes from plan_time; nothing here is
// fitted to the published rows.
#include "moetron/plan/published.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/plan/calibrate.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/memory.h"

namespace moetron::plan {

namespace {

[[noreturn]] void csv_fail(std::string_view source, int64_t line, int64_t col, const std::string& what) {
  MT_FAIL("csv", source, ":", line, ":", col, ": ", what);
}

// Reads one record starting at text[i]; advances i past its line end. line / col track the position (1-based).
std::vector<std::string> read_record(std::string_view text, size_t& i, int64_t& line, std::string_view source) {
  std::vector<std::string> fields;
  std::string cur;
  int64_t col = 1;
  bool quoted = false, after_quote = false, field_start = true;
  int64_t quote_line = 0, quote_col = 0;
  while (i < text.size()) {
    const char ch = text[i];
    if (quoted) {
      if (ch == '"') {
        if (i + 1 < text.size() && text[i + 1] == '"') {
          cur += '"', i += 2, col += 2;
          continue;
        }
        quoted = false, after_quote = true;
      } else if (ch == '\n') {
        cur += ch, ++line, col = 0;
      } else {
        cur += ch;
      }
      ++i, ++col;
      continue;
    }
    if (ch == ',') {
      fields.push_back(std::move(cur)), cur.clear();
      after_quote = false, field_start = true;
      ++i, ++col;
      continue;
    }
    if (ch == '\n' || ch == '\r') {
      i += (ch == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ? 2 : 1;
      fields.push_back(std::move(cur));
      ++line;
      return fields;
    }
    if (after_quote) csv_fail(source, line, col, std::string("'") + ch + "' after a closing quote (expected ',' or the line's end)");
    if (ch == '"') {
      if (!field_start) csv_fail(source, line, col, "a quote inside an unquoted field (quote the whole field)");
      quoted = true, quote_line = line, quote_col = col;
    } else {
      cur += ch;
    }
    field_start = false;
    ++i, ++col;
  }
  if (quoted) csv_fail(source, quote_line, quote_col, "unterminated quoted field (no closing quote before the end)");
  fields.push_back(std::move(cur));
  ++line;
  return fields;
}

std::string lower(std::string_view s) {
  std::string o;
  for (char c : s) o += char(std::tolower(static_cast<unsigned char>(c)));
  return o;
}

// Lower case with spaces, '-' and '_' removed: "DeepSeek-V3" and "DeepSeekV3" agree.
std::string squash(std::string_view s) {
  std::string o;
  for (char c : s)
    if (c != ' ' && c != '-' && c != '_') o += char(std::tolower(static_cast<unsigned char>(c)));
  return o;
}

std::string trim(std::string_view s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return std::string(s.substr(a, b - a));
}

// A positive integer field: 0 when empty, -1 when not a positive integer.
int64_t positive(const std::string& s) {
  const std::string t = trim(s);
  if (t.empty()) return 0;
  if (!std::all_of(t.begin(), t.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) return -1;
  if (t.size() > 12) return -1;
  const int64_t v = std::stoll(t);
  return v >= 1 ? v : -1;
}

// The error text without the check's "file:line: [op] " prefix.
std::string reason_of(const std::exception& e) {
  std::string s = e.what();
  const size_t k = s.find("] ");
  if (k != std::string::npos && k < 80 && s.find('[') < k) s = s.substr(k + 2);
  return s;
}

// A comma-separated field's parts, trimmed, empty parts dropped.
std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  for (size_t p = 0; p <= text.size();) {
    const size_t e = std::min(text.find(',', p), text.size());
    std::string part = trim(text.substr(p, e - p));
    p = e + 1;
    if (!part.empty()) out.push_back(std::move(part));
  }
  return out;
}

}  // namespace

CsvTable read_csv(std::string_view text, std::string_view source) {
  CsvTable t;
  size_t i = 0;
  int64_t line = 1;
  if (text.substr(0, 3) == "\xEF\xBB\xBF") i = 3;  // a UTF-8 byte order mark
  MT_CHECK(i < text.size(), "csv", source, ": empty file (no header row)");
  t.header = read_record(text, i, line, source);
  while (i < text.size()) {
    const int64_t start = line;
    if (text[i] == '\n' || text[i] == '\r') {  // a blank line
      read_record(text, i, line, source);
      continue;
    }
    std::vector<std::string> r = read_record(text, i, line, source);
    if (r.size() != t.header.size())
      csv_fail(source, start, 1, std::to_string(r.size()) + " fields where the header has " +
                                     std::to_string(t.header.size()));
    t.rows.push_back(std::move(r));
    t.lines.push_back(start);
  }
  return t;
}

CsvTable read_csv_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MT_CHECK(in.good(), "csv", path, ": cannot open the file");
  std::stringstream ss;
  ss << in.rdbuf();
  return read_csv(ss.str(), path);
}

const std::string& PublishedRow::get(const std::string& key) const {
  static const std::string empty;
  auto it = f.find(key);
  return it == f.end() ? empty : it->second;
}

std::vector<PublishedRow> read_published(const std::string& path) {
  const CsvTable t = read_csv_file(path);
  for (const char* need : {"id", "publisher", "model", "hardware", "world", "tp", "pp", "ep", "cp", "dp", "vpp",
                           "expert_tp", "fsdp", "mbs", "global_batch", "global_batch_unit", "seq_len", "precision",
                           "throughput", "throughput_unit", "split"})
    MT_CHECK(std::find(t.header.begin(), t.header.end(), need) != t.header.end(), "published", path,
             ":1: the header has no column '", need, "'");
  std::vector<PublishedRow> out;
  for (size_t r = 0; r < t.rows.size(); ++r) {
    PublishedRow row;
    row.line = t.lines[r];
    for (size_t c = 0; c < t.header.size(); ++c) row.f[t.header[c]] = trim(t.rows[r][c]);
    out.push_back(std::move(row));
  }
  return out;
}

std::string preset_for_model(std::string_view model) {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"deepseekv3", "deepseek_v3.toml"},       {"deepseekv3671b", "deepseek_v3.toml"},
      {"deepseekv2", "deepseek_v2.toml"},       {"deepseekv2lite", "deepseek_v2_lite.toml"},
      {"qwen330ba3b", "qwen3_30b_a3b.toml"},    {"mixtral8x7b", "mixtral_8x7b.toml"},
      {"llama4scout", "llama4_scout.toml"},     {"llama4scout17b16e", "llama4_scout.toml"},
      {"qwen3235ba22b", "qwen3_235b_a22b.toml"}, {"qwen3235b", "qwen3_235b_a22b.toml"},
      {"gptoss120b", "gpt_oss_120b.toml"},      {"mixtral8x22b", "mixtral_8x22b.toml"},
  };
  const std::string k = squash(model);
  for (const auto& [name, file] : table)
    if (k == name) return file;
  return "";
}

std::string hardware_for(std::string_view hw) {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"a100", "a100"},   {"h100", "h100"},       {"h200", "h200"},       {"b200", "b200"},
      {"gb200", "gb200"}, {"gb200(nvl72)", "gb200"}, {"mi300x", "mi300x"}, {"mi325x", "mi325x"},
      {"mi355x", "mi355x"}, {"gb300", "gb300"},   {"gb300(nvl72)", "gb300"}, {"h800", "h800"},
  };
  const std::string k = squash(hw);
  for (const auto& [name, entry] : table)
    if (k == name) return entry;
  return "";
}

bool per_gpu_tokens(std::string_view unit) {
  const std::string u = lower(trim(unit));
  for (const char* p : {"tokens/s/gpu", "tokens/s/device"})
    if (u.rfind(p, 0) == 0 && (u.size() == std::strlen(p) || u[std::strlen(p)] == ' ')) return true;
  return false;
}

RowMapping map_row(const PublishedRow& r) {
  RowMapping m;
  auto refuse = [&](const std::string& why) {
    m.ok = false, m.reason = "not projected: " + why;
    return m;
  };
  m.preset = preset_for_model(r.get("model"));
  if (m.preset.empty()) return refuse("no preset for " + r.get("model"));
  m.hardware = hardware_for(r.get("hardware"));
  if (m.hardware.empty()) return refuse("no hardware entry for " + r.get("hardware"));

  // Precision -> [quantize]: BF16 is the preset's compute (no recipe); Megatron's FP8-MX / MXFP8 is mxfp8, its
  // FP8-CS (current scaling, per tensor) is tensorwise with current scaling. Any other label is not guessed.
  const std::string prec = squash(r.get("precision"));
  std::vector<std::string> q;
  if (prec == "bf16") {
  } else if (prec == "fp8mx" || prec == "mxfp8") {
    q = {"--quantize.recipe=mxfp8"};
  } else if (prec == "fp8cs") {
    q = {"--quantize.recipe=tensorwise", "--quantize.scaling=current"};
  } else {
    return refuse("precision '" + r.get("precision") + "' has no planner recipe");
  }

  // Layout: tp, pp, ep have no planner default a published run could be assumed to share; cp, vpp and expert_tp
  // default to 1 (ParallelSpec's and Megatron's default when the flag is not given).
  std::vector<std::string> missing;
  auto need = [&](const char* key) {
    const int64_t v = positive(r.get(key));
    if (v == 0) missing.push_back(key);
    return v;
  };
  m.world = need("world");
  const int64_t tp = need("tp"), pp = need("pp"), ep = need("ep"), mbs = need("mbs"), gb = need("global_batch"),
                seq = need("seq_len");
  if (!missing.empty()) {
    std::string s;
    for (const auto& k : missing) s += (s.empty() ? "" : ", ") + k;
    return refuse(s + " not given");
  }
  const int64_t cp = std::max<int64_t>(positive(r.get("cp")), r.get("cp").empty() ? 1 : 0);
  const int64_t vpp = std::max<int64_t>(positive(r.get("vpp")), r.get("vpp").empty() ? 1 : 0);
  const int64_t etp = std::max<int64_t>(positive(r.get("expert_tp")), r.get("expert_tp").empty() ? 1 : 0);
  for (const auto& [k, v] : {std::pair<const char*, int64_t>{"world", m.world}, {"tp", tp}, {"pp", pp}, {"ep", ep},
                             {"mbs", mbs}, {"global_batch", gb}, {"seq_len", seq}, {"cp", cp}, {"vpp", vpp},
                             {"expert_tp", etp}})
    if (v < 1) return refuse(std::string(k) + " = '" + r.get(k) + "' is not a positive integer");
  if (m.world % (tp * cp * pp) != 0)
    return refuse("world " + std::to_string(m.world) + " is not a multiple of tp x cp x pp = " +
                  std::to_string(tp * cp * pp));
  const int64_t dp = m.world / (tp * cp * pp);
  if (const int64_t given = positive(r.get("dp")); given != 0 && given != dp)
    return refuse("dp = " + r.get("dp") + " disagrees with world / (tp x cp x pp) = " + std::to_string(dp));

  // FSDP: empty, 0 or '/' = none (Megatron's distributed optimizer, the planner's default); 1 or On = FSDP over
  // all of dp (zero 3); a degree n > 1 = zero 3 sharded over n (HSDP when n < dp).
  std::vector<std::string> z;
  const std::string fs = lower(r.get("fsdp"));
  if (fs.empty() || fs == "0" || fs == "/") {
  } else if (fs == "1" || fs == "on") {
    z = {"--parallelism.zero=3"};
  } else if (const int64_t n = positive(fs); n > 1 && dp % n == 0) {
    z = {"--parallelism.zero=3", "--parallelism.dp_shard=" + std::to_string(n),
         "--parallelism.dp_replicate=" + std::to_string(dp / n)};
  } else {
    return refuse("fsdp = '" + r.get("fsdp") + "' (neither 0, 1, On nor a degree dividing dp = " + std::to_string(dp) + ")");
  }

  // Global batch in sequences; a unit that starts with "tokens" is divided by seq_len.
  const std::string unit = lower(r.get("global_batch_unit"));
  int64_t seqs = gb;
  if (unit.rfind("token", 0) == 0) {
    if (gb % seq != 0) return refuse("global_batch " + r.get("global_batch") + " tokens is not a multiple of seq_len");
    seqs = gb / seq;
  } else if (!unit.empty() && unit.rfind("sequence", 0) != 0) {
    return refuse("global_batch_unit '" + r.get("global_batch_unit") + "' is neither sequences nor tokens");
  }

  // Recompute, when the publisher states it (the optional `recompute` column): empty = not stated (the preset's:
  // none), "none" / "/" = none, "full" = every layer, else a comma list of Megatron's recompute_modules mapped to
  // the planner's selective modules (layernorm / norm -> norm, act / moe_act -> moe_act, core_attn ->
  // attention_core); a module without a planner counterpart is not guessed.
  std::vector<std::string> ac;
  const std::string rc = lower(r.get("recompute"));
  if (rc.empty()) {
  } else if (rc == "none" || rc == "/") {
    ac = {"--activation_checkpoint.mode=none"};
  } else if (rc == "full") {
    ac = {"--activation_checkpoint.mode=full", "--activation_checkpoint.modules=[]"};
  } else {
    std::string mods;
    for (const std::string& part : split_list(rc)) {
      const char* mod = part == "norm" || part == "layernorm" ? "norm"
                        : part == "act" || part == "moe_act" ? "moe_act"
                        : part == "core_attn" || part == "attention_core" ? "attention_core"
                                                                             : nullptr;
      if (!mod) return refuse("recompute module '" + part + "' has no planner counterpart");
      mods += std::string(mods.empty() ? "" : ",") + "\"" + mod + "\"";
    }
    ac = {"--activation_checkpoint.mode=selective", "--activation_checkpoint.modules=[" + mods + "]"};
  }

  // The EP dispatcher and the 1F1B all-to-all overlap, when the publisher states them (the optional `dispatcher` and
  // `ep_overlap` columns): DeepEP -> hierarchical (each token crosses to a node once, then NVLink: moetron's
  // node-deduplicated dispatcher), A2A / alltoall -> alltoall; ep_overlap yes -> parallelism.ep_overlap. Empty = not
  // stated (the preset's); any other value is not guessed.
  std::vector<std::string> ep_keys;
  const std::string disp = lower(r.get("dispatcher"));
  if (disp == "deepep") ep_keys.push_back("--parallelism.ep_dispatcher=hierarchical");
  else if (disp == "a2a" || disp == "alltoall") ep_keys.push_back("--parallelism.ep_dispatcher=alltoall");
  else if (!disp.empty()) return refuse("dispatcher '" + r.get("dispatcher") + "' has no planner counterpart");
  const std::string ovl = lower(r.get("ep_overlap"));
  if (ovl == "yes") ep_keys.push_back("--parallelism.ep_overlap=true");
  else if (!ovl.empty() && ovl != "no") return refuse("ep_overlap '" + r.get("ep_overlap") + "' is neither yes nor no");
  // The routing, when the source states it (the optional `routing` column): forced balance (Megatron-Bridge's
  // benchmarks) prices every EP rank at the balanced rows; dropless routing at the FITTED kDroplessEpImbalance.
  const std::string routing = lower(r.get("routing"));
  if (routing == "dropless") m.ep_imbalance = kDroplessEpImbalance;
  else if (!routing.empty() && routing != "forced")
    return refuse("routing '" + r.get("routing") + "' is neither forced nor dropless");

  // The pipeline split, when the source's recipe states it (the optional `pp_split` column): Megatron's
  // --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split count the embedding and the
  // loss as one layer each of the first and last stage ("embedding", "loss", or both comma-separated); "even" or
  // empty = the plain even split. Any other value is not guessed.
  std::vector<std::string> split_keys;
  for (const std::string& part : split_list(lower(r.get("pp_split")))) {
    if (part == "embedding") split_keys.push_back("--parallelism.pp_first_stage_less_layers=1");
    else if (part == "loss") split_keys.push_back("--parallelism.pp_last_stage_less_layers=1");
    else if (part != "even") return refuse("pp_split '" + part + "' is neither embedding, loss nor even");
  }

  auto kv = [](const char* k, int64_t v) { return std::string("--") + k + "=" + std::to_string(v); };
  m.overrides = {kv("parallelism.tp", tp), kv("parallelism.pp", pp), kv("parallelism.ep", ep),
                 kv("parallelism.cp", cp), kv("parallelism.expert_tp", etp),
                 std::string("--parallelism.pp_schedule=") + (vpp > 1 ? "interleaved_1f1b" : "1f1b"),
                 kv("parallelism.pp_virtual_stages", vpp), "--parallelism.pp_microbatches=0",
                 kv("training.seq_len", seq), kv("training.micro_batch_size", mbs),
                 kv("training.global_batch_size", seqs)};
  for (auto& s : z) m.overrides.push_back(s);
  for (auto& s : q) m.overrides.push_back(s);
  for (auto& s : ac) m.overrides.push_back(s);
  for (auto& s : ep_keys) m.overrides.push_back(s);
  for (auto& s : split_keys) m.overrides.push_back(s);
  m.tokens_per_step = seqs * seq;
  m.ok = true;
  return m;
}

PublishedResult project_row(const PublishedRow& r, const std::string& configs_dir) {
  PublishedResult o;
  o.id = r.get("id"), o.split = r.get("split"), o.publisher = r.get("publisher"), o.model = r.get("model");
  o.hardware = r.get("hardware"), o.precision = r.get("precision"), o.unit = r.get("throughput_unit");
  o.world = std::max<int64_t>(positive(r.get("world")), 0);
  try {
    o.measured = std::stod(r.get("throughput"));
  } catch (const std::exception&) {
    o.measured = 0;
  }
  const RowMapping m = map_row(r);
  if (!m.ok) {
    o.status = m.reason;
    return o;
  }
  try {
    const JobConfig c = load_config(configs_dir + "/" + m.preset, m.overrides);
    const Hardware h = catalog_hardware(m.hardware);
    const Layout l = layout_from_config(c, m.world, true);
    TimeOptions to;
    to.memory.recipe = recipe_named("megatron", c);
    to.memory.ep_imbalance = o.ep_imbalance = m.ep_imbalance;
    const MemoryPlan mem = plan_memory(c, l, h, to.memory);
    const TimePlan t = plan_time(c, l, h, to, &mem);
    o.projected = true;
    o.memory = mem.verdict;
    o.layout = l.describe();
    o.projected_tps = t.tokens_per_s_per_gpu;
    o.step_s = t.step_time;
    for (const auto& [k, v] : t.breakdown) {
      if (k.rfind("compute.", 0) == 0) o.compute += v;
      else if (k == "comm.tp" || k == "comm.cp") o.tp_cp += v;
      else if (k == "comm.ep") o.ep += v;
      else if (k == "comm.dp_exposed") o.dp += v;
      else if (k == "bubble_and_p2p") o.bubble += v;
      else if (k == "host.exposed") o.host += v;
      else o.other += v;
    }
  } catch (const std::exception& e) {
    o.status = "not projected: " + reason_of(e);
    return o;
  }
  if (!per_gpu_tokens(o.unit)) {
    // A published step time (the optional throughput2 column in seconds) gives tokens/s/GPU directly: the global
    // batch's tokens over the step and the world. Used only when the throughput column is not tokens/s/GPU.
    const std::string u2 = lower(r.get("throughput2_unit"));
    double step = 0;
    try {
      step = u2.rfind("step time s", 0) == 0 ? std::stod(r.get("throughput2")) : 0.0;
    } catch (const std::exception&) {
      step = 0;
    }
    if (step > 0 && m.tokens_per_step > 0 && m.world > 0) {
      o.measured = double(m.tokens_per_step) / (step * double(m.world));
      o.measured_from = "step time";
      o.unit = "tokens/s/GPU";
    }
  }
  if (!per_gpu_tokens(o.unit) || !(o.measured > 0)) {
    o.status = "not compared: unit " + o.unit;
    return o;
  }
  o.compared = true;
  o.error = o.projected_tps / o.measured - 1;
  o.status = "projected";
  return o;
}

SplitSummary summarize(const std::vector<PublishedResult>& rs, const std::string& split) {
  SplitSummary s;
  s.split = split;
  std::vector<double> errs;
  for (const auto& r : rs) {
    if (r.split != split) continue;
    ++s.rows;
    if (r.projected) ++s.projected;
    if (!r.compared) continue;
    ++s.compared;
    const double a = std::fabs(r.error);
    errs.push_back(a);
    if (s.worst_id.empty() || a > s.worst_abs_error) s.worst_abs_error = a, s.worst_id = r.id;
  }
  if (!errs.empty()) s.median_abs_error = median(errs);
  return s;
}

namespace {
std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}
std::string pct(double part, double whole) { return whole > 0 ? fmt("%.0f%%", 100 * part / whole) : "-"; }

std::string summary_line(const SplitSummary& s) {
  std::ostringstream os;
  os << s.split << ": " << s.rows << " rows, " << s.projected << " projected, " << s.compared << " compared";
  if (s.compared > 0)
    os << ", median |error| " << fmt("%.1f%%", 100 * s.median_abs_error) << ", worst |error| "
       << fmt("%.1f%%", 100 * s.worst_abs_error) << " (" << s.worst_id << ")";
  else
    os << ", median |error| n/a";
  return os.str();
}
}  // namespace

std::string format_published(const std::vector<PublishedResult>& rs, const std::vector<SplitSummary>& ss) {
  std::ostringstream os;
  os << "# published MoE runs: projected with plan time (megatron recipe; ep_imbalance 1, or the FITTED "
     << fmt("%.2f", kDroplessEpImbalance) << " where the row's routing is dropless); error = projected / measured - 1\n";
  os << "# step split: % of the projected step (compute, exposed TP/CP, exposed EP, exposed DP, bubble+P2P, host, other)\n";
  for (const auto& r : rs) {
    os << r.id << " [" << r.split << "] " << r.publisher << " | " << r.model << " | " << r.hardware << " x" << r.world
       << " | " << r.precision;
    if (r.projected) {
      os << " | " << r.layout << (r.ep_imbalance != 1 ? " dropless imb " + fmt("%.2f", r.ep_imbalance) : "")
         << " | measured " << fmt("%.0f", r.measured)
         << (r.measured_from.empty() ? "" : " (from the " + r.measured_from + ")") << " projected "
         << fmt("%.0f", r.projected_tps) << " tokens/s/GPU";
      if (r.compared) os << " | error " << fmt("%+.1f%%", 100 * r.error);
      os << " | memory " << r.memory << " | step " << fmt("%.3f", r.step_s) << " s: compute " << pct(r.compute, r.step_s) << ", tp/cp "
         << pct(r.tp_cp, r.step_s) << ", ep " << pct(r.ep, r.step_s) << ", dp " << pct(r.dp, r.step_s)
         << ", bubble " << pct(r.bubble, r.step_s) << ", host " << pct(r.host, r.step_s)
         << ", other " << pct(r.other, r.step_s);
    }
    if (!r.compared) os << " | " << r.status;
    os << "\n";
  }
  for (const auto& s : ss) os << "summary " << summary_line(s) << "\n";
  return os.str();
}

nlohmann::json published_json(const std::vector<PublishedResult>& rs, const std::vector<SplitSummary>& ss) {
  nlohmann::json j;
  j["rows"] = nlohmann::json::array();
  for (const auto& r : rs) {
    nlohmann::json x = {{"id", r.id},         {"split", r.split},         {"publisher", r.publisher},
                        {"model", r.model},   {"hardware", r.hardware},   {"world", r.world},
                        {"precision", r.precision}, {"status", r.status}, {"projected", r.projected},
                        {"compared", r.compared}, {"measured", r.measured}, {"measured_unit", r.unit}};
    if (!r.measured_from.empty()) x["measured_from"] = r.measured_from;
    if (r.projected) {
      x["layout"] = r.layout;
      x["memory_verdict"] = r.memory;
      x["projected_tokens_per_s_per_gpu"] = r.projected_tps;
      x["step_time_s"] = r.step_s;
      x["ep_imbalance"] = r.ep_imbalance;
      x["step_split_s"] = {{"compute", r.compute}, {"tp_cp_exposed", r.tp_cp}, {"ep_exposed", r.ep},
                           {"dp_exposed", r.dp},   {"bubble_and_p2p", r.bubble}, {"host", r.host},
                           {"other", r.other}};
    }
    if (r.compared) x["error"] = r.error;
    j["rows"].push_back(x);
  }
  j["summary"] = nlohmann::json::array();
  for (const auto& s : ss) {
    nlohmann::json x = {{"split", s.split}, {"rows", s.rows}, {"projected", s.projected}, {"compared", s.compared}};
    if (s.compared > 0) {
      x["median_abs_error"] = s.median_abs_error;
      x["worst_abs_error"] = s.worst_abs_error;
      x["worst_id"] = s.worst_id;
    }
    j["summary"].push_back(x);
  }
  return j;
}

}  // namespace moetron::plan
