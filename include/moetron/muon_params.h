// muon_params.h: which parameters Muon updates (optimizer.name = "muon") and how each splits into the matrices it
// orthogonalizes, plus their element counts per layer for the memory accounting and the planner.
// Not the Muon arithmetic (muon.h) and not where the trainer keeps the momentum (src/train/muon_state.cpp).
//
// Muon takes the 2-D weight matrices of the decoder blocks: the attention projections (wqkv, wo; MLA's wq or wdq
// and wuq, wdkv, wkr, wukv), the dense FFN (w13, w2), the shared experts (w13, w2) and every routed expert's
// matrices, one expert at a time ([E, R, C] is E matrices of R x C). AdamW takes the rest: the embedding, the
// output head, the norms (1-D) and the router (moe.gate), as Moonlight / Kimi K2 and the Megatron and TorchTitan
// implementations do. Fused weights are orthogonalized per logical matrix, as the models that Muon was published
// on hold them apart: wqkv as its q, k and v column blocks, w13 as gate and up.
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

#include "moetron/spec.h"

namespace moetron {

struct MuonMatrices {
  int64_t count = 0;              // matrices stacked along the leading dimension (routed experts); 0 = AdamW
  int64_t rows = 0, cols = 0;     // one stacked matrix: [rows, cols], row-major
  std::vector<int64_t> col_segs;  // its column blocks, each orthogonalized on its own (sum = cols)
  bool muon() const { return count > 0; }
};

// The Muon matrices of the parameter `name` (model_param_layout's names) of this shape (this rank's: under EP the
// local experts' [El, R, C]). Tensor-parallel slices are not handled (Muon refuses tp > 1).
MuonMatrices muon_matrices(const ModelSpec& spec, std::string_view name, const std::vector<int64_t>& shape);

// Elements of one decoder layer that Muon updates (the others are AdamW's): by how tensor parallelism treats them.
struct MuonLayerNumel {
  int64_t sliced = 0;      // TP-sliced matrices: attention q / kv up / o projections, dense FFN, shared experts
  int64_t replicated = 0;  // whole on every TP rank: MLA's down projections (wdq, wdkv, wkr)
  int64_t experts = 0;     // every routed expert of the layer (all E)
  int64_t total() const { return sliced + replicated + experts; }
};
MuonLayerNumel muon_layer_numel(const ModelSpec& spec, int64_t layer);

// The logical matrices Muon orthogonalizes in one decoder layer (whole, before any TP slicing): `count` matrices of
// rows x cols each, by the MuonLayerNumel kind they count under (muon_layer_numel sums these). wqkv's q, k and v and
// w13's gate and up are separate matrices, as muon_matrices splits them.
struct MuonShape {
  enum class Kind { Sliced, Replicated, Experts } kind = Kind::Sliced;
  int64_t count = 0, rows = 0, cols = 0;
};
std::vector<MuonShape> muon_layer_matrices(const ModelSpec& spec, int64_t layer);
// FLOPs of `steps` Newton-Schulz iterations on one rows x cols matrix (muon.h's three GEMMs an iteration, on the
// m x n orientation with m = min: A = X X^T, 2 m^2 n; B = b A + c A A, 2 m^3; X' = a X + B X, 2 m^2 n).
double newton_schulz_flops(int64_t rows, int64_t cols, int64_t steps);

}  // namespace moetron
