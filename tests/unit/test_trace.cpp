// test_trace.cpp: the profiler's per-rank trace of a single-process ds_tiny run (docs/profiling.md, "Trace format
// (version 1)"): the metadata, the documented events with sane arguments (FLOPs of the GEMM scopes from their
// shapes, the step's FLOPs against the accounting), the nesting step ⊇ action ⊇ module ⊇ kernel, the event cap,
// the [profiling] keys' errors, and the Comm fields the trace is built from.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "moetron/accounting.h"
#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/trace.h"
#include "moetron/trainer.h"
#include "test_util.h"
#include "trace_check.h"

using namespace moetron;
using moetron::testing::error_of;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }

std::string fresh_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("moetron_trace_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

JobConfig profiled_tiny(const std::string& dump, std::vector<std::string> extra = {}) {
  std::vector<std::string> ov = {"--job.dump_folder=" + dump, "--training.steps=3", "--metrics.peak_tflops=1.0",
                                 "--profiling.enable=true"};
  for (auto& e : extra) ov.push_back(e);
  return load_config(repo("configs/ds_tiny.toml"), ov);
}

json run_and_read(const JobConfig& cfg, const std::string& file) {
  TrainOptions o;
  o.quiet = true;
  train(cfg, o);
  std::ifstream f(file);
  EXPECT_TRUE(f.good()) << file;
  return json::parse(f);
}

std::vector<json> events(const json& t, const std::string& cat) {
  std::vector<json> v;
  for (const auto& e : t["traceEvents"])
    if (e.value("cat", "") == cat) v.push_back(e);
  return v;
}

}  // namespace

TEST(Trace, SingleProcessRunHasTheDocumentedEvents) {
  const std::string dir = fresh_dir("single");
  const JobConfig cfg = profiled_tiny(dir);
  const double before = trace::now_us();
  const json t = run_and_read(cfg, dir + "/profile/rank0.trace.json");
  const double after = trace::now_us();

  // metadata
  const json& m = t["moetron"];
  EXPECT_EQ(m["format"], "moetron-trace");
  EXPECT_EQ(m["version"], 1);
  EXPECT_EQ(m["rank"], 0);
  EXPECT_EQ(m["world"], 1);
  EXPECT_EQ(m["source"], "engine");
  EXPECT_EQ(m["steps"], json::array({2, 3}));  // the first step warms caches
  EXPECT_DOUBLE_EQ(m["limits"]["flops_per_s"].get<double>(), 1e12);  // metrics.peak_tflops = 1
  EXPECT_GT(m["limits"]["bytes_per_s"].get<double>(), 1e8);
  EXPECT_EQ(m["layout"]["pp"], 1);
  EXPECT_EQ(m["layout"]["schedule"], "1f1b");
  EXPECT_NE(m["config"].get<std::string>().find("[profiling]"), std::string::npos);
  EXPECT_EQ(m["groups"]["world@0"]["ranks"], json::array({0}));
  EXPECT_EQ(m["dropped_events"], 0);
  // The trace's zero is the recorder's clock at the start barrier: inside this run, and every step ends
  // after it and before the run returned.
  const double sync = -m["clock_offset_us"].get<double>();
  EXPECT_GE(sync, before);
  EXPECT_LE(sync, after);
  for (const auto& e : t["traceEvents"]) {
    if (e.value("cat", "") != "step") continue;
    EXPECT_GE(e["ts"].get<double>(), 0.0);
    EXPECT_LE(sync + e["ts"].get<double>() + e["dur"].get<double>(), after);
  }

  // tracks
  bool named0 = false, process = false;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] != "M") continue;
    named0 |= e["name"] == "thread_name" && e["tid"] == 0 && e["args"]["name"] == "compute";
    process |= e["name"] == "process_name" && e["args"]["name"] == "rank 0";
  }
  EXPECT_TRUE(named0);
  EXPECT_TRUE(process);

  // steps, actions (2 micro-batches per step: F0 B0 F1 B1), modules
  const auto steps = events(t, "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0]["args"]["step"], 2);
  std::multiset<std::string> acts;
  for (const auto& a : events(t, "action")) {
    acts.insert(a["name"].get<std::string>() + std::to_string(a["args"]["mb"].get<int>()));
    EXPECT_EQ(a["args"]["chunk"], 0);
    EXPECT_EQ(a["args"]["stage"], 0);
  }
  EXPECT_EQ(acts, (std::multiset<std::string>{"F0", "F0", "B0", "B0", "F1", "F1", "B1", "B1"}));
  std::set<std::string> mods;
  for (const auto& e : events(t, "module")) mods.insert(e["name"]);
  for (const char* n : {"embed", "layer0.attn", "layer0.mlp", "layer1.attn", "layer1.moe", "layer2.moe", "head",
                        "optimizer"})
    EXPECT_TRUE(mods.count(n)) << n;
  for (const auto& e : events(t, "module"))
    if (e["name"] == "layer2.moe") { EXPECT_EQ(e["args"]["layer"], 2); }

  // kernels: every main kernel present with FLOPs and bytes; a GEMM's FLOPs from its shape
  const ModelSpec& s = cfg.model;
  const double N = double(cfg.training.micro_batch_size * cfg.training.seq_len);
  std::map<std::string, double> flops;
  for (const auto& e : events(t, "kernel")) {
    const double f = e["args"]["flops"], b = e["args"]["bytes"];
    EXPECT_GE(f, 0) << e;
    EXPECT_GE(b, 0) << e;
    flops[e["name"]] += f;
    if (e["name"] == "fwd.attn.out_proj") {  // [N, H*hd] x [H*hd, d]
      EXPECT_DOUBLE_EQ(f, 2.0 * N * double(s.attn.n_heads * s.attn.head_dim) * double(s.d_model));
    }
    if (e["name"] == "fwd.router.gate_gemm") {  // [N, d] x [d, E], fp32
      EXPECT_DOUBLE_EQ(f, 2.0 * N * double(s.d_model * s.moe.n_routed_experts));
    }
  }
  for (const char* k : {"fwd.attn.proj", "fwd.attn.core", "bwd.attn.core", "fwd.mlp", "bwd.mlp", "fwd.experts",
                        "bwd.experts", "fwd.shared", "loss.fused_linear_xent", "fwd.norm", "bwd.norm", "fwd.router",
                        "bwd.router", "fwd.combine", "bwd.permute", "optim.adamw"})
    EXPECT_GT(flops[k], 0) << k;
  EXPECT_TRUE(flops.count("fwd.permute"));  // a gather: bytes only
  // A step's kernel FLOPs: the accounting's model FLOPs (GEMMs and the attention forward exactly, per token) plus
  // what it leaves out: the attention backward's recomputed scores and the element-wise kernels (a few percent).
  const double model = flops_per_token(s, cfg.training.seq_len).train * double(cfg.training.global_batch_size) *
                       double(cfg.training.seq_len);
  double step_flops = 0;
  const double s0 = steps[0]["ts"], s1 = s0 + steps[0]["dur"].get<double>();
  for (const auto& e : events(t, "kernel"))
    if (e["ts"].get<double>() >= s0 && e["ts"].get<double>() <= s1) step_flops += e["args"]["flops"].get<double>();
  EXPECT_GT(step_flops, model);
  EXPECT_LT(step_flops, 1.10 * model);

  // memory counters at the step boundaries
  const auto mem = events(t, "memory");
  ASSERT_EQ(mem.size(), 6u);  // per step: memory at start and end, memory_peak at end
  for (const auto& e : mem) {
    EXPECT_EQ(e["ph"], "C");
    for (const char* k : {"params", "grads", "optimizer", "activations", "buffers"}) {
      EXPECT_TRUE(e["args"].contains(k)) << k;
    }
    EXPECT_GT(e["args"]["params"].get<double>(), 0);
  }

  // communication: the world communicator's collectives, numbered in order
  int64_t last = -1;
  for (const auto& e : events(t, "comm")) {
    EXPECT_EQ(e["args"]["group"], "world@0");
    if (!e["args"].contains("seq")) continue;
    EXPECT_GT(e["args"]["seq"].get<int64_t>(), last);
    last = e["args"]["seq"];
  }
  EXPECT_GE(last, 0);

  EXPECT_EQ(moetron::testing::trace_nesting_problem(t), "");
  fs::remove_all(dir);
}

TEST(Trace, EventCapCountsTheDropped) {
  const std::string dir = fresh_dir("cap");
  const json t = run_and_read(profiled_tiny(dir, {"--profiling.max_events=40", "--profiling.folder=" + dir + "/tr"}),
                              dir + "/tr/rank0.trace.json");
  int64_t n = 0;
  for (const auto& e : t["traceEvents"]) n += e["ph"] != "M";
  EXPECT_EQ(n, 40);
  EXPECT_GT(t["moetron"]["dropped_events"].get<int64_t>(), 0);
  EXPECT_EQ(t["moetron"]["max_events"], 40);
  fs::remove_all(dir);
}

TEST(Trace, WindowAndNoFileWithoutProfiling) {
  const std::string dir = fresh_dir("window");
  const json t = run_and_read(profiled_tiny(dir, {"--profiling.start_step=3", "--profiling.end_step=3"}),
                              dir + "/profile/rank0.trace.json");
  EXPECT_EQ(t["moetron"]["steps"], json::array({3, 3}));
  EXPECT_EQ(events(t, "step").size(), 1u);
  // Without [profiling] enable nothing is written and nothing is recorded.
  const std::string off = fresh_dir("off");
  TrainOptions o;
  o.quiet = true;
  train(load_config(repo("configs/ds_tiny.toml"), {"--job.dump_folder=" + off, "--training.steps=1",
                                                   "--metrics.peak_tflops=1.0"}),
        o);
  EXPECT_FALSE(fs::exists(off + "/profile"));
  EXPECT_EQ(trace::events_recorded(), 0);
  fs::remove_all(dir);
  fs::remove_all(off);
}

TEST(Trace, ProfilingKeysAreValidated) {
  const std::string tiny = repo("configs/ds_tiny.toml");
  auto err = [&](std::vector<std::string> ov) { return error_of([&] { load_config(tiny, ov); }); };
  EXPECT_NE(err({"--profiling.start_step=5", "--profiling.end_step=3"})
                .find("profiling.end_step = 3: is before profiling.start_step = 5"),
            std::string::npos);
  EXPECT_NE(err({"--profiling.max_events=0"}).find("profiling.max_events = 0"), std::string::npos);
  EXPECT_NE(err({"--profiling.start_step=-1"}).find("profiling.start_step"), std::string::npos);
  EXPECT_NE(err({"--profiling.enable=true", "--profiling.folder="}).find("profiling.folder"), std::string::npos);
  EXPECT_NE(err({"--profiling.enabled=true"}).find("profiling.enable"), std::string::npos);  // did you mean
  const JobConfig c = load_config(tiny, {"--profiling.enable=true", "--profiling.start_step=4"});
  EXPECT_EQ(load_config_string(to_toml(c)), c);
}

TEST(Trace, CommEventsCarryGroupSequenceAndMessageIndex) {
  Comm c = comm_local();
  c.set_name("pp");
  std::vector<CommEvent> seen;
  std::vector<std::vector<int64_t>> counts;
  c.set_trace_hook([&](const CommEvent& e) {
    seen.push_back(e);
    counts.push_back(e.send_counts ? std::vector<int64_t>{e.send_counts[0]} : std::vector<int64_t>{});
    EXPECT_EQ(e.comm->name, "pp");
    EXPECT_EQ(e.comm->world_ranks, std::vector<int>{0});
  });
  float x[4] = {};
  c.all_reduce(x, 4);
  c.send(x, 8, 0, 7);
  c.send(x, 8, 0, 7);
  c.recv(x, 8, 0, 7);
  char a[6] = {}, b[6] = {};
  c.all_to_all(b, a, 6);
  c.barrier();
  ASSERT_EQ(seen.size(), 6u);
  EXPECT_EQ(seen[0].seq, 0);
  EXPECT_EQ(seen[0].bytes_in, 16);
  EXPECT_EQ(seen[1].seq, -1);
  EXPECT_EQ(seen[1].msg, 0);
  EXPECT_EQ(seen[2].msg, 1);  // the second message to rank 0 with tag 7
  EXPECT_EQ(seen[3].msg, 0);  // the first received
  EXPECT_EQ(seen[3].peer, 0);
  EXPECT_EQ(seen[3].tag, 7);
  EXPECT_EQ(seen[4].seq, 1);
  EXPECT_EQ(counts[4], std::vector<int64_t>{6});
  EXPECT_EQ(seen[5].seq, 2);
  // A split's child is named after its parent and the split's index.
  Comm d = c.split(0, 0);
  Comm e = c.split(0, 0);
  EXPECT_EQ(d.info().name, "pp.0");
  EXPECT_EQ(e.info().name, "pp.1");
}
