// kernel_sizes.h: the byte sizes of the kernels' buffers as pure arithmetic, written once for the kernels
// (src/kernels/) and the accounting (estimate_memory) alike: the flash-attention workspace, the grouped
// GEMM's packed weights and workspace, the fused loss's default chunk. The tile constants these sizes
// depend on live here too, and the kernels read them from here. Code in src/job/kernel_sizes.cpp (library
// moetron_job), so a planner can size a job without linking the engine.
// Not the kernels: no argument checks beyond what the arithmetic needs, no threads queried (callers pass
// the thread count), no allocation.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moetron {

// ---- flash attention (src/kernels/attention_impl.h carves its per-thread tiles from these sizes)
inline constexpr int64_t kAttnTile = 64;  // query rows and key columns per tile

// The shape terms the attention workspace depends on (attention.h's AttnDims: B, T, Hkv, Dqk, Dv, and
// whether k or v is one head shared by Hkv > 1 kv heads, i.e. head_k == 0 or head_v == 0); for bf16 (prec
// BF16) also the query rows Tq and the q heads Hq.
struct AttnWorkspaceShape {
  int64_t B = 0, T = 0, Hkv = 1, Dqk = 1, Dv = 1;  // T: keys per sequence
  bool shared_k = false, shared_v = false;
  bool bf16 = false;            // AttnPrec::BF16
  int64_t Tq = 0, Hq = 0;       // queries per sequence and q heads (bf16 only; 0: Tq = T, Hq = Hkv)
};
// Floats of one thread's tiles: max of the forward's (Q^T tile, scores) and the backward's (K^T, V^T, dK,
// dV accumulators, scores, dP, lse and D rows), head dims rounded up to 16.
int64_t attention_thread_floats(int64_t Dqk, int64_t Dv);
// Floats shared by all threads: per-kv-head gradient partials of a shared k (or v) head.
int64_t attention_shared_floats(const AttnWorkspaceShape& s);
// bf16 (4-byte units: a bf16 pair or a float each). Per thread: the forward's Q^T pair tile, scores and P pair
// tile, the backward's dK / dV accumulators, S, dP, the P / dS pair tiles, the bf16 dS rows, lse and D rows.
int64_t attention_bf16_thread_words(int64_t Dqk, int64_t Dv);
// Shared: the call's bf16 copies, per 64-row tile: the forward's k rows and v row pairs; the backward's k^T,
// k row pairs and v^T of each key tile and the q rows, q row pairs, dout rows and dout row pairs of each query
// tile (the larger of the two).
int64_t attention_bf16_shared_words(const AttnWorkspaceShape& s);
// Bytes of the whole workspace for `threads` threads (>= 1), plus 64 for alignment (bf16: the fp32 layout's
// shared partials after the bf16 words, and the fp32 per-thread tiles fit in the bf16 ones).
size_t attention_workspace_size(const AttnWorkspaceShape& s, int threads);

// ---- grouped GEMM (src/kernels/grouped_gemm.cpp; layouts in docs/kernels/gemm.md)
enum class GemmPrec : uint8_t { F32, BF16 };            // element type of activations and packed weights
enum class GroupedPackKind : uint8_t { Fwd, Dgrad };    // packed W[e] (forward) or W[e]^T (dgrad)
enum class GroupedOp : uint8_t { Fwd, Dgrad, Wgrad };

inline constexpr int64_t kGroupedPanel = 64;        // columns per packed B panel
inline constexpr int64_t kGroupedMR = 6;            // rows per microkernel call (and per A row block)
inline constexpr int64_t kGroupedWgradRows = 512;   // default rows of dW[e] per wgrad work item
inline constexpr int64_t kGroupedWgradChunk = 128;  // default token pairs per packed bf16 wgrad chunk

// Packed weight layout of W[E, K, N]. B = W[e] (Fwd: Kc = K contracted, Nc = N columns) or W[e]^T (Dgrad:
// Kc = N, Nc = K), cut into 64-wide column panels (the last one zero-padded). bf16 panel: [ceil(Kc/2)][64][2]
// (pairs along the contraction); fp32 panel: [Kc][64].
struct GroupedPackGeom {
  int64_t Kc, Nc, steps, npanels, panel_elems, expert_elems, elem_bytes;
};
GroupedPackGeom grouped_pack_geom(GroupedPackKind kind, GemmPrec prec, int64_t K, int64_t N);
// Bytes of packed storage (a multiple of 64). Sizes must be >= 0 (not checked here).
size_t grouped_packed_size(GroupedPackKind kind, GemmPrec prec, int64_t E, int64_t K, int64_t N);

// Rows of dW[e] per wgrad work item: K rounded up to the microkernel's rows, at most `wgrad_rows`.
int64_t grouped_wgrad_item_rows(int64_t K, int64_t wgrad_rows);
// Workspace layout of one call: schedule arrays (off[E+1], perm[E], pref[E+1], int64, each 64-byte
// aligned), then for bf16 wgrad one packing slot per thread (A: 64-row groups of a chunk of X_e^T, B:
// 64-column panels of a chunk of dY_e). Offsets in bytes from the (64-byte aligned) start.
struct GroupedWsLayout {
  size_t off = 0, perm = 0, pref = 0, slots = 0, slot_a = 0, slot_bytes = 0, fixed = 0;
};
GroupedWsLayout grouped_ws_layout(GroupedOp op, GemmPrec prec, int64_t E, int64_t K, int64_t N,
                                  int64_t wgrad_rows = kGroupedWgradRows, int64_t wgrad_chunk = kGroupedWgradChunk);
// fixed + threads * slot_bytes (threads >= 1).
size_t grouped_workspace_size(GroupedOp op, GemmPrec prec, int64_t E, int64_t K, int64_t N, int threads,
                              int64_t wgrad_rows = kGroupedWgradRows, int64_t wgrad_chunk = kGroupedWgradChunk);

// ---- fused linear + cross-entropy (src/kernels/loss.cpp)
// Default rows per chunk: about 8 MiB of fp32 logits, a multiple of 16, at least 256 rows.
int64_t linear_xent_default_chunk(int64_t V);

}  // namespace moetron
