// memcheck.cpp: the size limits of a JobConfig's non-model keys, and the start-up memory check (see
// memcheck.h): reading the node's available memory from /proc and the cgroup files, and comparing the
// accounting's per-rank estimate with it. Not the estimate itself (src/job/accounting.cpp,
// estimate_memory) and not the model's limits (src/job/spec.cpp).
#include "moetron/memcheck.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "moetron/check.h"

namespace moetron {

namespace {

std::string gib(double bytes) {
  const double g = bytes / double(int64_t(1) << 30);
  char buf[32];
  if (g >= 10) std::snprintf(buf, sizeof buf, "%.1f GiB", g);
  else std::snprintf(buf, sizeof buf, "%.3g GiB", g);
  return buf;
}

// The first line of a file, or "" when it cannot be read.
std::string first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (f) std::getline(f, line);
  return line;
}

// A byte count from a cgroup file: -1 for "max", a missing file or a value >= 2^62 (v1's "no limit").
int64_t cgroup_bytes(const std::string& path) {
  const std::string s = first_line(path);
  if (s.empty() || s == "max") return -1;
  try {
    size_t used = 0;
    const long long v = std::stoll(s, &used);
    if (v < 0 || v >= (int64_t(1) << 62)) return -1;
    return int64_t(v);
  } catch (const std::exception&) {
    return -1;
  }
}

// The cgroup and its ancestors, leaf first: "/a/b" -> "/a/b", "/a", "/".
std::vector<std::string> cgroup_chain(std::string path) {
  if (path.empty() || path[0] != '/') path = "/" + path;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  std::vector<std::string> out;
  while (true) {
    out.push_back(path);
    if (path == "/") break;
    const size_t slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  return out;
}

NodeMemoryReader& reader_slot() {
  static NodeMemoryReader r;
  return r;
}


void at_most(const char* key, int64_t v, int log2) {
  if (v > (int64_t(1) << log2)) invalid_config(key, v, "must be <= 2^", log2, " = ", int64_t(1) << log2, " (size limit)");
}

constexpr int kMaxTokensLog2 = 24;        // seq_len, micro_batch_size
constexpr int kMaxStepsLog2 = 40;         // steps, warmup_steps, val_interval, global_batch_size
constexpr int kMaxMicroPerStepLog2 = 20;  // micro-batches per rank per optimizer step; val_steps
constexpr int kMaxRanksLog2 = 20;         // dp_replicate, dp_shard, ep, pp
constexpr int kMaxDpLog2 = 24;            // dp_replicate * dp_shard; hardware.num_nodes
constexpr int kMaxLocalLog2 = 16;         // threads, ranks_per_node, gpus_per_node
constexpr int kMaxRowsLog2 = 31;          // routed rows of one micro-batch (int32 indices), exclusive
constexpr int kMaxActivationLog2 = 56;    // bytes of saved activations of one micro-batch (64 PiB)

}  // namespace

void check_size_limits(const JobConfig& c) {
  const auto& t = c.training;
  const auto& p = c.parallelism;
  at_most("training.seq_len", t.seq_len, kMaxTokensLog2);
  at_most("training.micro_batch_size", t.micro_batch_size, kMaxTokensLog2);
  at_most("training.global_batch_size", t.global_batch_size, kMaxStepsLog2);
  at_most("training.steps", t.steps, kMaxStepsLog2);
  at_most("training.val_interval", t.val_interval, kMaxStepsLog2);
  at_most("training.val_steps", t.val_steps, kMaxMicroPerStepLog2);
  at_most("training.threads", t.threads, kMaxLocalLog2);
  at_most("lr_scheduler.warmup_steps", c.lr_scheduler.warmup_steps, kMaxStepsLog2);
  at_most("parallelism.dp_replicate", p.dp_replicate, kMaxRanksLog2);
  at_most("parallelism.dp_shard", p.dp_shard, kMaxRanksLog2);
  at_most("parallelism.ep", p.ep, kMaxRanksLog2);
  at_most("parallelism.pp", p.pp, kMaxRanksLog2);
  at_most("parallelism.ranks_per_node", p.ranks_per_node, kMaxLocalLog2);
  at_most("hardware.num_nodes", c.hardware.num_nodes, kMaxDpLog2);
  at_most("hardware.gpus_per_node", c.hardware.gpus_per_node, kMaxLocalLog2);
  // Products, of factors each within its limit (so they fit in int64), when the factors are positive.
  const bool dp_ok = p.dp_replicate >= 1 && p.dp_shard >= 1;
  if (dp_ok && p.dp() > (int64_t(1) << kMaxDpLog2))
    invalid_config("parallelism.dp_shard", p.dp_shard, "dp_replicate * dp_shard = ", p.dp(), " must be <= 2^", kMaxDpLog2,
        " (size limit)");
  const int64_t B = t.micro_batch_size, S = t.seq_len;
  if (B < 1 || S < 1) return;
  if (dp_ok && t.global_batch_size / (B * p.dp()) > (int64_t(1) << kMaxMicroPerStepLog2))
    invalid_config("training.global_batch_size", t.global_batch_size, "global_batch_size / (micro_batch_size * dp) = ",
        t.global_batch_size / (B * p.dp()), " micro-batches per rank per step must be <= 2^", kMaxMicroPerStepLog2,
        " (size limit)");
  const int64_t k = std::max<int64_t>(1, c.model.moe.topk);
  const double rows = double(B) * double(S) * double(k);  // up to 2^64: in double
  if (rows >= double(int64_t(1) << kMaxRowsLog2)) {
    const std::string n = rows < 9e18 ? std::to_string(B * S * k) : std::to_string(rows);  // exact when it fits
    invalid_config("training.micro_batch_size", B, "micro_batch_size * seq_len (", S, ") * max(1, model.topk) (", k, ") = ", n,
        " rows per micro-batch must be < 2^", kMaxRowsLog2, " (the engine indexes rows with int32)");
  }
  // Saved activations of one micro-batch in double: fp32 and no checkpointing bound every precision and mode.
  const ActivationSize as = activation_size(c.model, B, S, 4, 4);
  if (as.total > double(int64_t(1) << kMaxActivationLog2)) {
    std::ostringstream os;
    os << "invalid config: one micro-batch would save " << as.total << " bytes of activations, more than 2^"
       << kMaxActivationLog2 << " (size limit): training.micro_batch_size = " << B << ", training.seq_len = " << S
       << ", model.n_layers = " << c.model.n_layers << "; the largest term is " << as.largest << " ("
       << activation_term_keys(c.model, as.largest) << ")";
    throw Error(os.str());
  }
}

int64_t NodeMemory::available() const {
  if (mem_available < 0) return cgroup_free;
  if (cgroup_free < 0) return mem_available;
  return std::min(mem_available, cgroup_free);
}

std::string NodeMemory::describe() const {
  std::string s;
  if (mem_available >= 0) s = "MemAvailable " + gib(double(mem_available));
  if (cgroup_free >= 0)
    s += (s.empty() ? "" : ", ") + std::string("cgroup ") + cgroup_file + " minus usage " + gib(double(cgroup_free));
  return s.empty() ? "unknown" : s;
}

NodeMemory read_node_memory(const std::string& root) {
  NodeMemory m;
  {
    std::ifstream f(root + "/proc/meminfo");
    std::string key;
    int64_t kib = 0;
    std::string line;
    while (std::getline(f, line)) {
      std::istringstream is(line);
      if (is >> key >> kib && key == "MemAvailable:") {
        m.mem_available = kib * 1024;
        break;
      }
    }
  }
  // /proc/self/cgroup: "0::/path" (v2) and "N:memory:/path" (v1, possibly with other controllers).
  std::ifstream f(root + "/proc/self/cgroup");
  std::string line;
  auto consider = [&](const std::string& limit_file, const std::string& usage_file) {
    const int64_t limit = cgroup_bytes(limit_file);
    if (limit < 0) return;
    const int64_t usage = std::max<int64_t>(0, cgroup_bytes(usage_file));
    const int64_t free = std::max<int64_t>(0, limit - usage);
    if (m.cgroup_free < 0 || free < m.cgroup_free) m.cgroup_free = free, m.cgroup_file = limit_file;
  };
  while (std::getline(f, line)) {
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) {  // v2 (unified, or hybrid under unified/)
      for (const char* mount : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"})
        for (const auto& p : cgroup_chain(path)) {
          const std::string dir = root + mount + (p == "/" ? "" : p);
          consider(dir + "/memory.max", dir + "/memory.current");
        }
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {  // v1
      for (const auto& p : cgroup_chain(path)) {
        const std::string dir = root + "/sys/fs/cgroup/memory" + (p == "/" ? "" : p);
        consider(dir + "/memory.limit_in_bytes", dir + "/memory.usage_in_bytes");
      }
    }
  }
  return m;
}

NodeMemoryReader set_node_memory_reader(NodeMemoryReader reader) {
  NodeMemoryReader old = std::move(reader_slot());
  reader_slot() = std::move(reader);
  return old;
}

void check_memory(const JobConfig& c, const MemoryEstimate& est, const NodeMemory& node, int ranks_on_node) {
  MT_CHECK(ranks_on_node >= 1, "memory check", "ranks on this node = ", ranks_on_node, " (expected >= 1)");
  const int64_t node_bytes = node.available();
  if (node_bytes < 0) return;  // nothing known to compare with
  const double per_rank = double(node_bytes) / double(ranks_on_node);
  const double need = est.peak();
  if (need <= per_rank) return;

  std::vector<std::pair<std::string, double>> cats = {{"optimizer", est.optimizer}, {"params", est.params},
                                                      {"grads", est.grads},         {"activations", est.activations},
                                                      {"workspace", est.workspace}, {"comm", est.comm}};
  std::stable_sort(cats.begin(), cats.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  std::ostringstream os;
  os << "memory check: this job needs " << gib(need) << " per rank";
  if (est.build_peak > est.total()) os << " (while the model is built)";
  os << " but " << gib(per_rank) << " is available per rank (" << node.describe() << ", " << ranks_on_node
     << (ranks_on_node == 1 ? " rank" : " ranks") << " on this node). By category:";
  for (size_t i = 0; i < cats.size(); ++i) os << (i ? ", " : " ") << cats[i].first << " " << gib(cats[i].second);
  os << ". The largest are driven by ";
  // The keys behind the two largest categories (params, grads and optimizer share theirs).
  std::vector<std::string> said;
  for (size_t i = 0; i < 2; ++i) {
    const std::string& n = cats[i].first;
    const std::string keys = n == "activations" ? est.activation_keys
                             : n == "workspace" ? est.workspace_keys
                             : n == "comm"      ? "parallelism.ep = " + std::to_string(c.parallelism.ep) +
                                                 ", parallelism.zero = " + std::to_string(c.parallelism.zero)
                                                : est.param_keys;
    if (std::find(said.begin(), said.end(), keys) != said.end()) continue;
    os << (said.empty() ? "" : "; and ") << keys << " (" << n << ")";
    said.push_back(keys);
  }
  os << ". Make them smaller, shard with parallelism.zero / parallelism.ep over more ranks, checkpoint "
        "activations, or set training.memory_check = false to skip this check.";
  throw Error(os.str());
}

void check_job_memory(const JobConfig& c, int ranks_on_node, int64_t compute_bytes, int threads) {
  if (!c.training.memory_check) return;
  const NodeMemoryReader& r = reader_slot();
  check_memory(c, estimate_memory(c, compute_bytes, threads), r ? r() : read_node_memory(), ranks_on_node);
}

}  // namespace moetron
