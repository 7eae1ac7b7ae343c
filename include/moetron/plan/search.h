// plan/search.h: the layout search (`moetron plan search`) and strong scaling (`moetron plan scale`).
// Enumerates TP, CP, PP, stages per rank and schedule, EP, ZeRO / FSDP, recompute, micro-batch size and the
// all-to-all overlap for a world and a global batch; prunes what cannot run (the layout rules) or cannot fit
// (the memory projection); ranks the rest by tokens/s/GPU with the analytic pipeline estimate; replays the top
// candidates in the timed simulator. Not a cost model itself: it calls plan_memory and plan_time.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "moetron/config.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/memory.h"

namespace moetron::plan {

struct SearchOptions {
  TimeOptions time;
  int64_t top_k = 5;
  int64_t max_mbs = 8;
  std::vector<std::string> schedules = {"1f1b", "interleaved_1f1b", "zb1p", "zbv"};
  bool allow_tp = true, allow_cp = true, allow_fsdp = true, allow_recompute = true, allow_ep_overlap = true;
  bool allow_ep_overlap_split = true;  // ep_overlap layouts also with parallelism.ep_overlap_split
  int64_t max_pp = 0;  // 0 = n_layers
  // Only layouts whose replica (tp x cp x pp GPUs, the unit data parallelism copies) has at least this many GPUs
  // (the whitepaper's "largest possible replica"; 1 = any).
  int64_t min_replica = 1;
  int64_t threads = 0;  // workers for the analytic pass (0 = the machine's hardware threads, at most 16)
};

struct Candidate {
  Layout layout;
  double analytic_tokens_per_s_per_gpu = 0;
  double memory_total = 0;  // the projected worst rank
  std::string verdict;
  TimePlan time;            // top candidates: simulated
  MemoryPlan memory;
};

struct SearchResult {
  int64_t world = 0;
  double global_batch_tokens = 0;
  int64_t enumerated = 0, invalid = 0, oom = 0, evaluated = 0;
  double seconds = 0;             // wall time of the whole search
  double layouts_per_second = 0;  // enumerated / analytic phase seconds
  std::vector<Candidate> top;     // best first (simulated)
  std::string why;                // why the winner wins, in words
};

// c.training.global_batch_size is replaced by global_batch_tokens / seq_len (must divide).
SearchResult search(const JobConfig& c, const Hardware& h, int64_t world, double global_batch_tokens,
                    const SearchOptions& o = {});

// Strong scaling, the whitepaper's way: the best layout at the largest world fixes the replica (tp x cp x pp with
// its ep, schedule, recompute and micro-batch); every world runs that replica times dp, so smaller worlds give
// each replica more micro-batches of the fixed global batch. Each world is also searched afresh (reported
// beside it); a world the replica does not divide takes its searched best.
struct ScalePoint {
  int64_t world = 0;
  bool found = false;
  Candidate best;            // the replica scaled in dp when it runs here (replica_ok), else the searched layout
  bool replica_ok = false;   // the first world's replica, scaled in dp, can run here
  Candidate replica;
  bool searched_ok = false;
  Candidate searched;
  double efficiency = 0;  // tokens/s/GPU relative to the first world's
  std::string note;       // where efficiency goes
};
std::vector<ScalePoint> scale(const JobConfig& c, const Hardware& h, const std::vector<int64_t>& worlds,
                              double global_batch_tokens, const SearchOptions& o = {});

nlohmann::json to_json(const SearchResult& r);
std::string format_search(const SearchResult& r);
nlohmann::json to_json(const std::vector<ScalePoint>& s);
std::string format_scale(const std::vector<ScalePoint>& s);

}  // namespace moetron::plan
