// param_layout.cpp: a model's parameter table (see moetron/param_layout.h): the list for the whole model or a
// part of it (the layers of this rank's pipeline stages, with or without the embedding and the head, this rank's
// experts under EP), and each element's initial value. Not the model's buffers (src/model/param_layout.cpp).
#include "moetron/param_layout.h"

#include <algorithm>
#include <string>

#include "moetron/check.h"
#include "moetron/rng.h"

namespace moetron {

namespace {

// How tensor parallelism treats a tensor: Cols / Rows: sliced along its last / its first non-expert dimension;
// Same: whole on every TP rank with the same gradient; Partial: whole, each rank's gradient a partial sum.
enum class TpKind : uint8_t { Same, Partial, Cols, Rows };

void tp_check_divides(const ModelSpec& s, int tp) {
  const char* op = "tensor parallelism";
  MT_CHECK(s.attn.n_heads % tp == 0, op, "parallelism.tp = ", tp, " does not divide model.n_heads = ", s.attn.n_heads,
           ": attention heads are divided over the TP ranks");
  if (s.attn.type != AttnType::MLA)
    MT_CHECK(s.attn.kv_heads() % tp == 0, op, "parallelism.tp = ", tp, " does not divide the ", s.attn.kv_heads(),
             " key / value heads (model.n_kv_heads): each TP rank holds whole kv heads (replicating kv heads is not "
             "implemented)");
  if (s.inter_size > 0 && s.n_dense_layers() > 0)
    MT_CHECK(s.inter_size % tp == 0, op, "parallelism.tp = ", tp, " does not divide model.inter_size = ", s.inter_size);
  if (s.is_moe())
    MT_CHECK(s.moe.moe_inter_size % tp == 0, op, "parallelism.tp = ", tp, " does not divide model.moe_inter_size = ",
             s.moe.moe_inter_size, ": each expert's width is divided over the TP ranks (expert_tp = tp)");
}

// The entry's TP fields from its kind (shape: this rank's tensor before TP slicing; the leading expert dimension,
// when present, stays outer).
void tp_mark(ParamEntry& e, TpKind k, std::vector<int64_t> segs, int tp, int r) {
  e.tp = tp, e.tp_rank = r;
  e.tp_partial = k == TpKind::Partial;
  if (k != TpKind::Cols && k != TpKind::Rows) return;
  Shape& sh = e.shape;
  const size_t nd = sh.size();
  int64_t split = 0;
  for (int64_t w : segs) split += w;
  if (k == TpKind::Cols) {
    MT_CHECK(sh[nd - 1] == split, "model_param_layout", e.name, ": segments of ", split, " columns for ", sh[nd - 1]);
    e.tp_outer = e.numel / split, e.tp_inner = 1;
    sh[nd - 1] = split / tp;
  } else {
    const size_t dim = nd == 3 ? 1 : 0;  // [E, F, d]: the expert's rows
    MT_CHECK(sh[dim] == split, "model_param_layout", e.name, ": segments of ", split, " rows for ", sh[dim]);
    e.tp_outer = dim == 1 ? sh[0] : 1, e.tp_inner = sh[nd - 1];
    sh[dim] = split / tp;
  }
  for (int64_t w : segs)
    MT_CHECK(w % tp == 0, "model_param_layout", e.name, ": a segment of ", w, " is not divisible by tp = ", tp);
  e.tp_segs = std::move(segs);
  e.numel = shape_numel(sh);
}

// The copy between the unsliced tensor and slice r, either way.
void tp_copy(const ParamEntry& e, int r, float* slice, float* whole, bool to_slice) {
  if (!e.tp_sliced()) {
    if (to_slice) std::copy(whole, whole + e.numel, slice);
    else std::copy(slice, slice + e.numel, whole);
    return;
  }
  int64_t split = 0;
  for (int64_t w : e.tp_segs) split += w;
  const int64_t local = split / e.tp, in = e.tp_inner;
  for (int64_t o = 0; o < e.tp_outer; ++o) {
    int64_t g0 = 0, l0 = 0;
    for (int64_t w : e.tp_segs) {
      const int64_t part = w / e.tp;
      float* wp = whole + (o * split + g0 + int64_t(r) * part) * in;
      float* sp = slice + (o * local + l0) * in;
      if (to_slice) std::copy(wp, wp + part * in, sp);
      else std::copy(sp, sp + part * in, wp);
      g0 += w, l0 += part;
    }
  }
}

}  // namespace

void tp_slice(const ParamEntry& e, int r, float* slice, const float* whole) {
  tp_copy(e, r, slice, const_cast<float*>(whole), true);
}
void tp_unslice(const ParamEntry& e, int r, float* whole, const float* slice) {
  tp_copy(e, r, const_cast<float*>(slice), whole, false);
}

std::vector<ParamEntry> model_param_layout(const ModelSpec& spec, const ParamSelection& sel) {
  ModelSpec s = spec;
  s.resolve();
  const int64_t d = s.d_model, V = s.vocab_size, H = s.attn.n_heads;
  const int64_t Dqk = s.attn.qk_head_dim(), Dv = s.attn.v_dim();
  const int64_t F = s.inter_size;
  int64_t E = 0, Fe = 0, Fs = 0;
  if (s.is_moe()) E = s.moe.n_routed_experts, Fe = s.moe.moe_inter_size, Fs = s.moe.n_shared_experts * Fe;
  MT_CHECK(sel.ep >= 1 && sel.ep_rank >= 0 && sel.ep_rank < sel.ep, "model_param_layout", "EP rank ", sel.ep_rank,
           " of ", sel.ep);
  MT_CHECK(sel.ep == 1 || (E > 0 && E % sel.ep == 0), "model_param_layout", "n_routed_experts = ", E,
           " is not divisible by the expert-parallel size ", sel.ep);
  MT_CHECK(sel.layers.empty() || int64_t(sel.layers.size()) == s.n_layers, "model_param_layout", "layer mask of ",
           sel.layers.size(), " entries for ", s.n_layers, " layers");
  const int64_t El = sel.ep > 1 ? E / sel.ep : E, e0 = int64_t(sel.ep_rank) * El;
  const int tp = sel.tp;
  MT_CHECK(tp >= 1 && sel.tp_rank >= 0 && sel.tp_rank < tp, "model_param_layout", "TP rank ", sel.tp_rank, " of ", tp);
  if (tp > 1) tp_check_divides(s, tp);
  std::vector<ParamEntry> P;
  int64_t off = 0;
  // tpk: how tensor parallelism treats the tensor (TpKind); segs: the widths of its split dimension's segments.
  auto add = [&](const std::string& name, Shape shape, bool decay, int layer, bool expert = false, bool ones = false,
                 TpKind tpk = TpKind::Same, std::vector<int64_t> segs = {}) {
    ParamEntry e;
    e.name = name, e.shape = shape, e.numel = shape_numel(shape), e.decay = decay, e.layer = layer;
    e.expert = expert, e.ones = ones, e.init_std = float(s.init_std), e.offset = off;
    e.global_shape = shape;
    if (expert && sel.ep > 1) {  // this rank's experts [e0, e0 + El) of the [E, ...] tensor
      e.shape[0] = El;
      e.numel = shape_numel(e.shape);
      e.shard_first = e0 * (e.numel / El);
    }
    e.tp_whole_numel = e.numel;
    if (tp > 1) tp_mark(e, tpk, std::move(segs), tp, sel.tp_rank);
    off += param_padded_numel(e.numel);  // keep every tensor 64-byte aligned
    P.push_back(e);
  };
  const TpKind Col = TpKind::Cols, Row = TpKind::Rows, Part = TpKind::Partial;
  // The embedding on its stage, and on the head's when tied (the head multiplies by it) or with MTP (its depths
  // embed the tokens ahead).
  if (sel.embedding || (sel.head && (s.tie_embeddings || s.mtp_layers > 0))) add("embed", {V, d}, true, -1, false, false, Row, {V});
  // The decoder layers, then (with the head) the MTP depths' blocks: block b >= n_layers is depth k = b - n_layers,
  // its parameters named mtp.<k>.block.* and with ParamEntry::layer = b (one FSDP unit, one pipeline stage).
  for (int64_t l = 0; l < s.n_blocks(); ++l) {
    const bool mtp = l >= s.n_layers;
    if (mtp ? !sel.head : !sel.layers.empty() && !sel.layers[size_t(l)]) continue;
    const std::string p = mtp ? "mtp." + std::to_string(l - s.n_layers) + ".block." : "layers." + std::to_string(l) + ".";
    const int li = int(l);
    if (mtp) {  // the depth's own: the norms of its two inputs, their projection 2d -> d, the norm before the head
      // (TP: whole on every rank, applied to its sequence-parallel rows, so each gradient is partial over them)
      const std::string q = "mtp." + std::to_string(l - s.n_layers) + ".";
      add(q + "enorm", {d}, false, li, false, true, Part);
      add(q + "hnorm", {d}, false, li, false, true, Part);
      add(q + "eh_proj", {2 * d, d}, true, li, false, false, Part);
      add(q + "norm", {d}, false, li, false, true, Part);
    }
    add(p + "attn_norm", {d}, false, li, false, true, Part);
    if (s.attn.type == AttnType::MLA) {
      const int64_t dn = s.attn.qk_nope_head_dim, dr = s.attn.qk_rope_head_dim;
      const int64_t rq = s.attn.q_lora_rank, rkv = s.attn.kv_lora_rank;
      if (rq > 0) {
        add(p + "attn.wdq", {d, rq}, true, li);
        add(p + "attn.q_norm", {rq}, false, li, false, true);
        add(p + "attn.wuq", {rq, H * Dqk}, true, li, false, false, Col, {H * Dqk});
      } else {
        add(p + "attn.wq", {d, H * Dqk}, true, li, false, false, Col, {H * Dqk});
      }
      add(p + "attn.wdkv", {d, rkv}, true, li);
      add(p + "attn.wkr", {d, dr}, true, li);
      add(p + "attn.kv_norm", {rkv}, false, li, false, true);
      add(p + "attn.wukv", {rkv, H * (dn + Dv)}, true, li, false, false, Col, {H * (dn + Dv)});
    } else {
      const int64_t hd = s.attn.head_dim, Hkv = s.attn.kv_heads();
      add(p + "attn.wqkv", {d, (H + 2 * Hkv) * hd}, true, li, false, false, Col, {H * hd, Hkv * hd, Hkv * hd});
      if (s.attn.qk_norm) {  // Qwen3: whole on every TP rank, each rank's gradient sums over its own heads
        add(p + "attn.q_head_norm", {hd}, false, li, false, true, Part);
        add(p + "attn.k_head_norm", {hd}, false, li, false, true, Part);
      }
    }
    add(p + "attn.wo", {H * Dv, d}, true, li, false, false, Row, {H * Dv});
    add(p + "ffn_norm", {d}, false, li, false, true, Part);
    if (!s.is_moe_block(l)) {
      add(p + "mlp.w13", {d, 2 * F}, true, li, false, false, Col, {F, F});
      add(p + "mlp.w2", {F, d}, true, li, false, false, Row, {F});
    } else {
      add(p + "moe.gate", {d, E}, true, li);
      add(p + "moe.experts.w13", {E, d, 2 * Fe}, true, li, true, false, Col, {Fe, Fe});
      add(p + "moe.experts.w2", {E, Fe, d}, true, li, true, false, Row, {Fe});
      if (Fs > 0) {
        add(p + "moe.shared.w13", {d, 2 * Fs}, true, li, false, false, Col, {Fs, Fs});
        add(p + "moe.shared.w2", {Fs, d}, true, li, false, false, Row, {Fs});
      }
    }
  }
  if (sel.head) {
    add("final_norm", {d}, false, -1, false, true, Part);
    if (!s.tie_embeddings) add("head", {V, d}, true, -1, false, false, Row, {V});  // vocabulary rows
  }
  return P;
}

void init_param_elements(float* dst, const ParamEntry& e, uint64_t seed, int64_t first, int64_t count) {
  if (e.ones) return std::fill(dst, dst + count, 1.0f);
  if (!e.tp_sliced())
    return fill_normal(dst, count, rng_key(seed, e.name), uint64_t(e.shard_first + first), 0.0f, e.init_std);
  // A TP slice: the unsliced values, then this rank's slice of them.
  std::vector<float> whole(size_t(e.tp_whole_numel)), slice(size_t(e.numel));
  fill_normal(whole.data(), e.tp_whole_numel, rng_key(seed, e.name), uint64_t(e.shard_first), 0.0f, e.init_std);
  tp_slice(e, e.tp_rank, slice.data(), whole.data());
  std::copy(slice.begin() + first, slice.begin() + first + count, dst);
}

}  // namespace moetron
