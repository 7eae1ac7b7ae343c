// vocab_parallel.cpp: vocabulary parallelism over a tensor-parallel Comm (see vocab_parallel.h): the vocabulary
// split, the vocab-parallel embedding forward / backward, and the Comm side of the vocab-parallel fused loss (the
// exchange between the kernel's row passes, the reduction of dh). Not the loss arithmetic: the chunk loop and row
// passes are loss.cpp's linear_xent_shard_*, shared with the single-process kernel.
//
// Loss workspace (chunk of ch rows, Vm = the largest shard):
//   kernel  linear_xent_shard_workspace_bytes(N, Vm, ch)   logits chunk, row losses, row max and target logit
//   gather  [(P + 1), 2 ch] f32                            this rank's (max, target logit) rows and all ranks'
//   dh part [N, C] f32 (ReduceScatter only)                the partial before the reduce-scatter
#include "moetron/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "moetron/check.h"
#include "moetron/kernel_sizes.h"
#include "moetron/loss.h"

namespace moetron {

namespace {

size_t align64(size_t b) { return (b + 63) & ~size_t(63); }

void check_split(const char* op, int64_t V, int P) {
  MT_CHECK(P >= 1 && V >= P, op, "the vocabulary (V=", V, ") must have at least one row per tp rank (P=", P, ")");
}

void check_rows(const char* op, int64_t N, const Comm& tp, TpReduce mode) {
  MT_CHECK(N >= 0, op, "bad row count N=", N);
  if (mode == TpReduce::ReduceScatter)
    MT_CHECK(N % tp.size() == 0, op, "sequence parallelism splits the N=", N, " token rows evenly over tp=",
             tp.size(), ": tp must divide N");
}

void check_ws(const char* op, void* ws, size_t need) {
  if (need == 0) return;
  MT_CHECK(ws && (reinterpret_cast<uintptr_t>(ws) & 63) == 0, op,
           "workspace must be non-null and 64-byte aligned (", need, " bytes), got ", ws);
}

// The exchange of loss.h over tp: one all_gather of every rank's (row max, target logit) per chunk, then the max
// (NaN if any rank's is NaN) and the owner's target logit, alike on every rank; the sums by all_reduce (fixed
// rank order, bitwise alike on every rank).
class CommXentExchange final : public XentShardExchange {
 public:
  CommXentExchange(const Comm& tp, int64_t V, float* buf) : tp_(tp), V_(V), P_(tp.size()), buf_(buf) {}

  void max_and_target(float* mx, float* zt, const int32_t* targets, int64_t rows) override {
    float* send = buf_;              // [2 rows]
    float* recv = buf_ + 2 * rows;   // [P, 2 rows]
    std::memcpy(send, mx, size_t(rows) * sizeof(float));
    std::memcpy(send + rows, zt, size_t(rows) * sizeof(float));
    tp_.all_gather(recv, send, 2 * rows * int64_t(sizeof(float)));
    for (int64_t i = 0; i < rows; ++i) {
      if (targets[i] < 0) continue;
      float m = recv[i];
      bool nan = std::isnan(m);
      for (int r = 1; r < P_; ++r) {
        const float x = recv[r * 2 * rows + i];
        nan |= std::isnan(x);
        m = std::max(m, x);
      }
      mx[i] = nan ? NAN : m;
      zt[i] = recv[vocab_shard_owner(V_, P_, targets[i]) * 2 * rows + rows + i];
    }
  }

  void sum(double* s, int64_t rows) override { tp_.all_reduce(s, rows); }

 private:
  const Comm& tp_;
  int64_t V_;
  int P_;
  float* buf_;
};

struct LossWs {
  void* kernel = nullptr;
  float* gather = nullptr;
  float* dh_part = nullptr;  // ReduceScatter only
};

LossWs carve(void* ws, int64_t N, int64_t V, int P, int64_t ch, TpReduce mode) {
  LossWs w;
  char* p = static_cast<char*>(ws);
  w.kernel = p;
  p += align64(linear_xent_shard_workspace_bytes(N, vocab_shard_max_rows(V, P), ch));
  w.gather = reinterpret_cast<float*>(p);
  p += align64(size_t((P + 1) * 2 * ch) * sizeof(float));
  if (mode == TpReduce::ReduceScatter) w.dh_part = reinterpret_cast<float*>(p);
  return w;
}

int64_t resolve_chunk(int64_t V, int P, int64_t chunk_rows) {
  return chunk_rows > 0 ? chunk_rows : vocab_xent_default_chunk(V, P);
}

// One driver for the four entry points: dh null = forward only.
template <class In>
double run_loss(const char* op, double* row_loss, float* dh, float* dW, const In* h, const In* W,
                const int32_t* targets, int64_t N, int64_t C, int64_t V, const Comm& tp, TpReduce mode,
                float loss_scale, int64_t chunk_rows, void* ws) {
  const int P = tp.size();
  check_split(op, V, P);
  check_rows(op, N, tp, mode);
  const int64_t ch = resolve_chunk(V, P, chunk_rows);
  check_ws(op, ws, vocab_xent_workspace_bytes(N, C, V, P, ch, dh ? mode : TpReduce::None));
  if (N == 0) return 0.0;
  const VocabRange vr = vocab_shard_range(V, tp.rank(), P);
  const LossWs w = carve(ws, N, V, P, ch, dh ? mode : TpReduce::None);
  CommXentExchange ex(tp, V, w.gather);
  const XentShard sh{vr.v0, V, &ex};
  const int64_t Vl = vr.size();
  if (!dh) {
    if constexpr (std::is_same_v<In, bf16>)
      return linear_xent_shard_fwd_bf16(row_loss, h, W, targets, N, C, Vl, sh, loss_scale, ch, w.kernel);
    else
      return linear_xent_shard_fwd_f32(row_loss, h, W, targets, N, C, Vl, sh, loss_scale, ch, w.kernel);
  }
  float* part = mode == TpReduce::ReduceScatter ? w.dh_part : dh;
  double loss;
  if constexpr (std::is_same_v<In, bf16>)
    loss = linear_xent_shard_fwd_bwd_bf16(part, dW, h, W, targets, N, C, Vl, sh, loss_scale, ch, w.kernel);
  else
    loss = linear_xent_shard_fwd_bwd_f32(part, dW, h, W, targets, N, C, Vl, sh, loss_scale, ch, w.kernel);
  if (mode == TpReduce::AllReduce) tp.all_reduce(dh, N * C);
  else if (mode == TpReduce::ReduceScatter) tp.reduce_scatter(dh, part, N / P * C);
  return loss;
}

}  // namespace

// ---- the split ----

VocabRange vocab_shard_range(int64_t V, int rank, int P) {
  check_split("vocab_shard_range", V, P);
  MT_CHECK(rank >= 0 && rank < P, "vocab_shard_range", "rank ", rank, " outside [0, P=", P, ")");
  return VocabRange{int64_t(rank) * V / P, int64_t(rank + 1) * V / P};
}

int64_t vocab_shard_max_rows(int64_t V, int P) {
  check_split("vocab_shard_max_rows", V, P);
  return (V + P - 1) / P;
}

int vocab_shard_owner(int64_t V, int P, int64_t v) {
  MT_CHECK(v >= 0 && v < V, "vocab_shard_owner", "row ", v, " outside [0, V=", V, ")");
  // floor(r V / P) <= v  <=>  r <= (v P + P - 1) / V (integers): the largest such r owns v.
  return int(std::min<int64_t>(P - 1, (v * P + P - 1) / V));
}

// ---- embedding ----

namespace {
// The embedding calls' argument checks (out / in: the two arrays). False: nothing to do (N = 0).
bool check_embed(const char* op, const void* out, const void* in, const int32_t* tokens, int64_t N, int64_t d,
                 int64_t V, const Comm& tp, TpReduce mode, void* ws) {
  check_split(op, V, tp.size());
  check_rows(op, N, tp, mode);
  MT_CHECK(d > 0, op, "bad width d=", d);
  check_ws(op, ws, vocab_embed_workspace_bytes(N, d, mode));
  if (N == 0) return false;
  MT_CHECK(out && in && tokens, op, "null input (", out, ", ", in, ", tokens=", (const void*)tokens, ")");
  for (int64_t n = 0; n < N; ++n)
    MT_CHECK(tokens[n] >= 0 && tokens[n] < V, op, "tokens[", n, "]=", tokens[n], " outside [0, V=", V, ")");
  return true;
}
}  // namespace

size_t vocab_embed_workspace_bytes(int64_t N, int64_t d, TpReduce mode) {
  MT_CHECK(N >= 0 && d > 0, "vocab_embed_workspace_bytes", "bad shape N=", N, " d=", d);
  return mode == TpReduce::ReduceScatter ? align64(size_t(N * d) * sizeof(float)) : 0;
}

void vocab_embed_forward(float* x, const float* E_shard, const int32_t* tokens, int64_t N, int64_t d, int64_t V,
                         const Comm& tp, TpReduce mode, void* ws) {
  const int P = tp.size();
  if (!check_embed("vocab_embed_forward", x, E_shard, tokens, N, d, V, tp, mode, ws)) return;
  const VocabRange vr = vocab_shard_range(V, tp.rank(), P);
  float* part = mode == TpReduce::ReduceScatter ? static_cast<float*>(ws) : x;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = tokens[n];
    float* dst = part + n * d;
    if (t >= vr.v0 && t < vr.v1) std::memcpy(dst, E_shard + (t - vr.v0) * d, size_t(d) * sizeof(float));
    else std::fill(dst, dst + d, -0.0f);  // the additive identity: the owner's row comes through bitwise
  }
  if (mode == TpReduce::AllReduce) tp.all_reduce(x, N * d);
  else if (mode == TpReduce::ReduceScatter) tp.reduce_scatter(x, part, N / P * d);
}

void vocab_embed_backward(float* gE_shard, const float* g, const int32_t* tokens, int64_t N, int64_t d, int64_t V,
                          const Comm& tp, TpReduce mode, void* ws) {
  const int P = tp.size();
  if (!check_embed("vocab_embed_backward", gE_shard, g, tokens, N, d, V, tp, mode, ws)) return;
  const VocabRange vr = vocab_shard_range(V, tp.rank(), P);
  const float* rows = g;
  if (mode == TpReduce::ReduceScatter) {
    tp.all_gather(ws, g, N / P * d * int64_t(sizeof(float)));  // rank r's rows land at r*N/P: row order
    rows = static_cast<const float*>(ws);
  }
  // The single-process scatter-add (model_embed_head.cpp, embed_backward), restricted to this shard's rows.
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = tokens[n];
    if (t < vr.v0 || t >= vr.v1) continue;
    float* dst = gE_shard + (t - vr.v0) * d;
    const float* src = rows + n * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] += src[i];
  }
}

// ---- fused linear cross-entropy ----

int64_t vocab_xent_default_chunk(int64_t V, int P) { return linear_xent_default_chunk(vocab_shard_max_rows(V, P)); }

size_t vocab_xent_workspace_bytes(int64_t N, int64_t C, int64_t V, int P, int64_t chunk_rows, TpReduce dh_mode) {
  const char* op = "vocab_xent_workspace_bytes";
  check_split(op, V, P);
  MT_CHECK(N >= 0 && C > 0, op, "bad shape N=", N, " C=", C);
  if (N == 0) return 0;
  const int64_t ch = resolve_chunk(V, P, chunk_rows);
  size_t b = align64(linear_xent_shard_workspace_bytes(N, vocab_shard_max_rows(V, P), ch)) +
             align64(size_t((P + 1) * 2 * ch) * sizeof(float));
  if (dh_mode == TpReduce::ReduceScatter) b += align64(size_t(N * C) * sizeof(float));
  return b;
}

double vocab_xent_fwd_bwd_bf16(float* dh, float* dW_shard, const bf16* h, const bf16* W_shard, const int32_t* targets,
                               int64_t N, int64_t C, int64_t V, const Comm& tp, TpReduce dh_mode, float loss_scale,
                               int64_t chunk_rows, void* ws) {
  const char* op = "vocab_xent_fwd_bwd_bf16";
  MT_CHECK(N == 0 || (dh && dW_shard), op, "null gradient output (dh=", (void*)dh, " dW_shard=", (void*)dW_shard, ")");
  return run_loss<bf16>(op, nullptr, dh, dW_shard, h, W_shard, targets, N, C, V, tp, dh_mode, loss_scale, chunk_rows,
                        ws);
}

double vocab_xent_fwd_bwd_f32(float* dh, float* dW_shard, const float* h, const float* W_shard, const int32_t* targets,
                              int64_t N, int64_t C, int64_t V, const Comm& tp, TpReduce dh_mode, float loss_scale,
                              int64_t chunk_rows, void* ws) {
  const char* op = "vocab_xent_fwd_bwd_f32";
  MT_CHECK(N == 0 || (dh && dW_shard), op, "null gradient output (dh=", (void*)dh, " dW_shard=", (void*)dW_shard, ")");
  return run_loss<float>(op, nullptr, dh, dW_shard, h, W_shard, targets, N, C, V, tp, dh_mode, loss_scale, chunk_rows,
                         ws);
}

double vocab_xent_fwd_bf16(double* row_loss, const bf16* h, const bf16* W_shard, const int32_t* targets, int64_t N,
                           int64_t C, int64_t V, const Comm& tp, float loss_scale, int64_t chunk_rows, void* ws) {
  return run_loss<bf16>("vocab_xent_fwd_bf16", row_loss, nullptr, nullptr, h, W_shard, targets, N, C, V, tp,
                        TpReduce::None, loss_scale, chunk_rows, ws);
}

double vocab_xent_fwd_f32(double* row_loss, const float* h, const float* W_shard, const int32_t* targets, int64_t N,
                          int64_t C, int64_t V, const Comm& tp, float loss_scale, int64_t chunk_rows, void* ws) {
  return run_loss<float>("vocab_xent_fwd_f32", row_loss, nullptr, nullptr, h, W_shard, targets, N, C, V, tp,
                         TpReduce::None, loss_scale, chunk_rows, ws);
}

}  // namespace moetron
