// pp_layout.h: which model pieces (embedding, decoder layers, loss/head) each pipeline stage holds, and which
// pipeline rank runs each stage. Two ways to get one: parse Megatron's layout grammar (`[parallelism]
// pp_layout`), or split the layers evenly (TorchTitan-style, with first/last stages counted lighter).
// Not the schedule (schedule.h: the order of F/B/W actions) and not the engine's model split: this is data,
// part of the moetron_schedule library, with no engine dependency.
//
// Grammar (Megatron-Core's `pipeline_model_parallel_layout`):
//   E  embedding          t  one decoder layer          L  loss (final norm + head + loss)
//   m  one MTP depth (model.mtp_layers): optional; if written, one per depth, right before L (Megatron's "mL")
//   |  ends a stage       t*3  repeats one symbol (any of E t L |)
//   (tt|)*4  repeats a group; groups nest, e.g. "((t|)*2t|)*3"
//   commas and spaces are ignored ("Et*3|(tt|)*29,t|L" reads as "Et*3|(tt|)*29t|L").
// Decoder layers are numbered in stage order. Stage s runs on pipeline rank s mod pp (loop placement, the
// interleaved schedules), or on the V placement of schedule.h (zbv, dualpipev: rank s for s < pp, else
// 2*pp-1-s), which is how Primus reads a layout for V schedules.
//
// Rules (every violation throws moetron::Error whose text starts `pp_layout "<text>"` and names the rule):
//   - grammar: unknown character (with its 1-based position), unbalanced parentheses (the position of the unmatched one), an empty
//     group "()", '*' not after a symbol or group, a missing / zero / oversized repeat count, nesting deeper
//     than kMaxLayoutDepth, an expansion longer than kMaxLayoutItems symbols (refused before it is built);
//   - E exactly once, as the first item of stage 0 (Megatron only asks for E first in layer order, which
//     also admits an empty stage 0 followed by "E..."; moetron requires it in stage 0);
//   - L exactly once, as the last item of the last stage;
//   - the number of t equals model.n_layers;
//   - m: as many as model.mtp_layers (or none: the MTP modules go with L anyway), all right before L;
//   - the stage count is a multiple of pp, and equals pp * stages-per-rank when that is fixed.
// Empty stages are allowed between the first and the last (Megatron allows them: such a stage only passes
// activations on); stage 0 always holds E and the last stage L, so they are never empty.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moetron::sched {

inline constexpr int64_t kMaxLayoutItems = int64_t(1) << 20;  // expanded symbols, separators included
inline constexpr int kMaxLayoutDepth = 32;                     // parentheses nesting

struct LayoutItem {
  enum Kind : uint8_t { Embedding, Layer, Loss };
  Kind kind = Layer;
  int32_t layer = -1;  // Layer: the decoder layer index (0-based, model order); else -1
  bool operator==(const LayoutItem&) const = default;
};

struct PpLayout {
  int pp = 1;
  int n_stages = 1;                             // pp * stages per rank
  std::vector<std::vector<LayoutItem>> stages;  // [n_stages], in model order
  std::vector<int> stage_rank;                  // [n_stages]: the pipeline rank that runs each stage

  int stages_per_rank() const { return n_stages / pp; }
  int64_t n_layers() const;                       // decoder layers over all stages
  std::vector<int> stages_for_rank(int rank) const;  // ascending stage ids (the rank's chunks in model order)
  std::vector<int> layers(int stage) const;         // decoder layer indices of one stage, ascending
  bool has_embedding(int stage) const;
  bool has_loss(int stage) const;
  // Canonical text: each stage's items without repeats, e.g. "Ett|tt|tL"; parses back to the same layout.
  std::string to_string() const;
  // Megatron-style table, one line per stage: "stage 3 (rank 1): layers 5-6" / "embedding, layers 0-1".
  std::string describe() const;
  bool operator==(const PpLayout&) const = default;
};

// The grammar alone: each stage's symbols after expanding repeats and groups, e.g. "E(t|)*2L" ->
// {"Et", "t", "L"}. Throws on grammar errors only (not on the E/L/count rules).
std::vector<std::string> expand_pp_layout(std::string_view text);

// Parse and check a layout for a model of `n_layers` decoder layers on `pp` ranks. `n_stages` > 0 fixes the
// stage count (pp * stages per rank); 0 accepts any multiple of pp. `v_shape` selects the V placement
// (needs exactly 2 stages per rank).
// mtp_layers: model.mtp_layers, the number of m the text may hold (the m items are checked and dropped: the MTP
// blocks live with L).
PpLayout parse_pp_layout(std::string_view text, int64_t n_layers, int pp, int n_stages = 0, bool v_shape = false,
                         int64_t mtp_layers = 0);

// No layout given: split n_layers over n_stages = pp * vpp stages the way TorchTitan does. The embedding
// counts as `first_less` layers and the head/loss as `last_less` layers (TorchTitan's
// pipeline_parallel_first_stage_less_layers / last_stage_less_layers, whose default there is 1; here the
// default is 0, a plain even split). With e = n_layers + first_less + last_less layer-equivalents, stage s
// gets e / n_stages layer-equivalents, plus one for the first e % n_stages stages; stage 0 then gives
// first_less of them to E and the last stage last_less to L. Refused (naming the keys): fewer
// layer-equivalents than stages (a stage would be empty), or first_less / last_less above e / n_stages
// (more than one stage's share). One stage gets everything whatever the two options say.
PpLayout even_pp_layout(int64_t n_layers, int pp, int vpp, int64_t first_less = 0, int64_t last_less = 0,
                        bool v_shape = false);

}  // namespace moetron::sched
