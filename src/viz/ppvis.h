// ppvis.h: pp_vis, the pipeline timeline picture. A Timeline model (one row of compute blocks per pipeline
// rank, with per-rank bubble ratio and peak in-flight activations) built from a simulated schedule or from a
// Primus pp_vis dump (config.json + pp_rank_<r>.json), rendered to a self-contained HTML page or a standalone
// SVG, and written back in Primus's dump format. Not the simulator (schedule.h) and not a general plotting
// library: it draws exactly this picture.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moetron/schedule.h"

namespace moetron::viz {

// F forward, B full backward, I input gradient, W weight gradient. The two halves of a DualPipe FB action
// are two blocks (an F and a B or I) with `fused` set and the same [start, end] on the same rank.
enum class Kind : uint8_t { F, B, I, W };
const char* kind_name(Kind k);  // "F", "B", "I", "W"

struct Block {
  Kind kind = Kind::F;
  int stage = 0;  // global stage id
  int chunk = 0;  // the stage's index among its rank's stages (Megatron's model chunk / virtual stage)
  int mb = 0;     // micro-batch id, from 0
  double start = 0, end = 0;
  bool fused = false;
  bool operator==(const Block&) const = default;
};

struct RankRow {
  int rank = 0;
  std::vector<Block> blocks;  // by start time (fused halves: F first)
  double busy = 0;            // time covered by at least one block
  double bubble_ratio = 0;    // 1 - busy / step_time
  int peak_inflight = 0;      // max activation sets live: F started, its backward (B, or W if split) not done
  double memory = -1;         // the dump's "memory" field (GB in Primus training dumps); -1 = none
};

struct Timeline {
  std::string title;     // first line of the picture, e.g. "1f1b"
  std::string source;    // where the data came from, e.g. "simulated (F,B,W,P2P = 1,2,1,0)" or a path
  std::string schedule;  // generator name, "csv" or "" when unknown (Primus dumps carry none)
  std::string unit = "ms";
  int pp = 1, vpp = 1, microbatches = 1;
  double step_time = 0;     // the picture spans [0, step_time]
  double bubble_ratio = 0;  // 1 - sum(busy) / (pp * step_time)
  std::vector<RankRow> ranks;
  // Peak in-flight in whole micro-batches (activation sets / vpp).
  double peak_microbatches(int rank) const;
};

// From a schedule and its timed replay (sched::simulate_timed): compute actions become blocks, FB actions two
// fused blocks; step time, bubble ratios and peak in-flight are the simulator's. `source` describes the
// durations. Throws when the result does not belong to the schedule (rank or action out of range).
Timeline from_simulation(const sched::Schedule& s, const sched::TimedResult& r, const std::string& source,
                         const std::string& unit = "units");

// Recomputes every row's busy time (union of its blocks), bubble ratio against `step_time` and peak
// in-flight from the block times (a set is live from its F's start to its B's or W's end; at equal times a
// release comes first), and the total bubble ratio. step_time <= 0 is first set to the latest block end.
void derive_stats(Timeline& t);

// Checks the model: ranks 0..pp-1 in order, every block end >= start >= 0 and end <= step_time, chunk in
// [0, vpp), micro-batch in [0, microbatches). Throws moetron::Error naming rank, block and field.
void check_timeline(const Timeline& t);

struct RenderOptions {
  int width = 1400;      // SVG width in px; time scales to fit
  int row_height = 30;   // px per rank
  double min_label_px = 0;  // 0 = drop a label when its text does not fit in the block
};
std::string render_svg(const Timeline& t, const RenderOptions& o = {});   // standalone SVG document
std::string render_html(const Timeline& t, const RenderOptions& o = {});  // one page: SVG inline + table
// Writes PATH (HTML) and PATH with its extension replaced by .svg; returns the SVG path.
std::string write_html_and_svg(const Timeline& t, const std::string& html_path, const RenderOptions& o = {});

// Fill colour of a block (the legend's swatch): hue by chunk, shade by kind (F medium, B/I dark, W light).
std::string block_colour(Kind k, int chunk);

// ---- Primus pp_vis dumps (primus_ppvis.cpp) ----------------------------------------------------------------
// DIR/config.json: {"pp_size": P, "vp_size": V, "num_mbs": M, ...} (Primus's simulator writes "vpp_size" and
// "micro_batches"; both spellings are read). DIR/pp_rank_<r>.json: {"<iteration>": {"total": ms,
// "memory": GB, "fwd_start": [...], "fwd_end": [...], "bwd_start", "bwd_end", "wgrad_start", "wgrad_end",
// optionally "<kind>_minibatch" and "<kind>_chunk" lists, and moetron's "bwd_pair_fwd" and
// "wgrad_placeholder"}} with times in ms from the iteration's start. `iteration` < 0 picks the largest
// iteration present in pp_rank_0.json. Every refusal names the file and the field (missing files, wrong list
// lengths, end < start, non-numbers, ids out of range, F&B halves that do not meet).
Timeline read_primus(const std::string& dir, int iteration = -1);
// Writes DIR/config.json (plus moetron's "schedule" and "time_unit" keys) and DIR/pp_rank_<r>.json
// (iteration "0" like Primus's simulator, every event with its micro-batch and chunk, "total" = the step
// time), creating DIR, in the form Primus's pp_vis tool sums and draws correctly: an F&B action split at its
// midpoint into its fwd and bwd events (listed in "bwd_pair_fwd"), and, when any rank has a W, one wgrad event
// per backward on every rank (zero-length placeholders, marked in "wgrad_placeholder", for full backwards).
// "memory" is the row's dump value or else, as Primus's simulator does, the peak in-flight activations in
// whole micro-batches. Refuses a timeline that is not a whole step (a rank without vp_size * num_mbs
// forwards and backwards, an I without its W, a fused block without its other half).
void write_primus(const Timeline& t, const std::string& dir);

}  // namespace moetron::viz
