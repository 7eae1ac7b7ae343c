// hf_weights.cpp: moetron <-> Hugging Face weight mapping (see hf_weights.h and docs/hf_export.md).
// One function, hf_weight_map, states the whole correspondence as data; export and import are the two
// directions of one generic row gather/scatter over it, so they cannot drift apart.
// Not a model loader for other architectures and not a dtype converter beyond F32/BF16.
#include "moetron/hf_weights.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "moetron/check.h"
#include "moetron/checkpoint.h"
#include "moetron/gemm.h"

namespace moetron {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::vector<int64_t> iota_cols(int64_t begin, int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = begin + i;
  return v;
}

// HF DeepSeek MLA rotary rows: HF row 2i <- our dim i, HF row 2i+1 <- our dim i + R/2 (file comment).
std::vector<int64_t> rope_interleaved_cols(int64_t begin, int64_t R) {
  std::vector<int64_t> v(static_cast<size_t>(R));
  for (int64_t i = 0; i < R / 2; ++i) {
    v[size_t(2 * i)] = begin + i;
    v[size_t(2 * i + 1)] = begin + i + R / 2;
  }
  return v;
}

std::string range_str(int64_t a, int64_t b) { return "[" + std::to_string(a) + ", " + std::to_string(b) + ")"; }

struct MapBuilder {
  HfWeightMap m;
  std::map<std::string, Shape> shapes;

  void moetron(const std::string& name, Shape shape) {
    shapes[name] = shape;
    m.moetron.push_back({name, std::move(shape), nullptr});
  }
  // HF tensor == moetron tensor (shift_nonneg: minus its minimum when that is negative, on export).
  void copy(const std::string& hf, const std::string& src, bool shift_nonneg = false) {
    HfTensorMap t;
    t.hf_name = hf, t.hf_shape = shapes.at(src), t.how = shift_nonneg ? "copy, minus min() if negative" : "copy";
    t.parts.push_back({src, -1, false, {}, shift_nonneg});
    m.hf.push_back(std::move(t));
  }
  // HF tensor with no moetron source: zeros (or empty) on export, must be zero on import.
  void fixed(const std::string& hf, Shape shape, const std::string& how) {
    HfTensorMap t;
    t.hf_name = hf, t.hf_shape = std::move(shape), t.how = how;
    m.hf.push_back(std::move(t));
  }
  // HF [rows, in] from transposed column sets of [in, out] sources (all with the same `in`).
  void linear(const std::string& hf, std::vector<HfPart> parts, const std::string& how) {
    HfTensorMap t;
    t.hf_name = hf;
    int64_t rows = 0, in = -1;
    for (auto& p : parts) {
      const Shape& s = shapes.at(p.src);
      const int64_t pin = s[s.size() - 2];
      MT_CHECK(in < 0 || pin == in, "hf_weight_map", "parts of ", hf, " disagree on the input width");
      in = pin;
      rows += int64_t(p.cols.size());
      p.transpose = true;
    }
    t.hf_shape = {rows, in};
    t.parts = std::move(parts);
    t.how = how;
    m.hf.push_back(std::move(t));
  }
  // The common case: HF = (columns [c0, c0 + n) of src)^T.
  void lin_cols(const std::string& hf, const std::string& src, int64_t expert, int64_t c0, int64_t n) {
    const Shape& s = shapes.at(src);
    const int64_t out = s.back();
    std::string how = "T";
    if (c0 != 0 || n != out) how += ", cols " + range_str(c0, c0 + n);
    if (expert >= 0) how = "[e] " + how;
    linear(hf, {{src, expert, true, iota_cols(c0, n)}}, how);
  }
};

// One SwiGLU's three HF tensors from a fused [.., d, 2F] w13 and a [.., F, d] w2.
void swiglu_tensors(MapBuilder& b, const std::string& pre, const std::string& w13, const std::string& w2, int64_t F,
                    int64_t expert, const char* gate, const char* up, const char* down) {
  b.lin_cols(pre + gate + ".weight", w13, expert, 0, F);
  b.lin_cols(pre + up + ".weight", w13, expert, F, F);
  b.lin_cols(pre + down + ".weight", w2, expert, 0, b.shapes.at(w2).back());
}

}  // namespace

std::string hf_model_type(const ModelSpec& spec) {
  return json::parse(to_hf_config_json(spec)).at("model_type").get<std::string>();
}

namespace {

// One decoder block's moetron tensors (model.cpp build() order) under prefix p ("layers.<l>." or
// "mtp.<k>.block."); moe: the block has an MoE FFN.
void block_moetron(MapBuilder& b, const ModelSpec& s, const std::string& p, bool moe) {
  const int64_t d = s.d_model, H = s.attn.n_heads;
  const int64_t Dqk = s.attn.qk_head_dim(), Dv = s.attn.v_dim();
  const int64_t E = s.moe.n_routed_experts, Fe = s.moe.moe_inter_size, Fs = s.moe.n_shared_experts * Fe;
  b.moetron(p + "attn_norm", {d});
  if (s.attn.type == AttnType::MLA) {
    const int64_t rq = s.attn.q_lora_rank, rkv = s.attn.kv_lora_rank, dr = s.attn.qk_rope_head_dim;
    const int64_t dn = s.attn.qk_nope_head_dim;
    if (rq > 0) {
      b.moetron(p + "attn.wdq", {d, rq});
      b.moetron(p + "attn.q_norm", {rq});
      b.moetron(p + "attn.wuq", {rq, H * Dqk});
    } else {
      b.moetron(p + "attn.wq", {d, H * Dqk});
    }
    b.moetron(p + "attn.wdkv", {d, rkv});
    b.moetron(p + "attn.wkr", {d, dr});
    b.moetron(p + "attn.kv_norm", {rkv});
    b.moetron(p + "attn.wukv", {rkv, H * (dn + Dv)});
  } else {
    const int64_t hd = s.attn.head_dim, Hkv = s.attn.kv_heads();
    b.moetron(p + "attn.wqkv", {d, (H + 2 * Hkv) * hd});
    if (s.attn.qk_norm) {
      b.moetron(p + "attn.q_head_norm", {hd});
      b.moetron(p + "attn.k_head_norm", {hd});
    }
  }
  b.moetron(p + "attn.wo", {H * Dv, d});
  b.moetron(p + "ffn_norm", {d});
  if (!moe) {
    b.moetron(p + "mlp.w13", {d, 2 * s.inter_size});
    b.moetron(p + "mlp.w2", {s.inter_size, d});
  } else {
    b.moetron(p + "moe.gate", {d, E});
    b.moetron(p + "moe.experts.w13", {E, d, 2 * Fe});
    b.moetron(p + "moe.experts.w2", {E, Fe, d});
    if (Fs > 0) {
      b.moetron(p + "moe.shared.w13", {d, 2 * Fs});
      b.moetron(p + "moe.shared.w2", {Fs, d});
    }
  }
}

// One decoder block's HF tensors: moetron prefix p, HF prefix h ("model.layers.<i>."); `bias` names the
// block's expert_bias.<i> when it is MoE.
void block_hf(MapBuilder& b, const ModelSpec& s, const std::string& p, const std::string& h, bool moe,
              const std::string& bias) {
  const std::string& type = b.m.model_type;
  const bool mixtral = type == "mixtral", v3 = type == "deepseek_v3";
  const bool mla_moe = type == "deepseek_v2" || v3;
  const int64_t d = s.d_model, H = s.attn.n_heads;
  const int64_t Dqk = s.attn.qk_head_dim(), Dv = s.attn.v_dim();
  const int64_t E = s.moe.n_routed_experts, Fe = s.moe.moe_inter_size, Fs = s.moe.n_shared_experts * Fe;
  const std::string at = h + "self_attn.";
  b.copy(h + "input_layernorm.weight", p + "attn_norm");
  if (s.attn.type == AttnType::MLA) {
    const int64_t rq = s.attn.q_lora_rank, rkv = s.attn.kv_lora_rank, dr = s.attn.qk_rope_head_dim;
    const int64_t dn = s.attn.qk_nope_head_dim;
    // q: per head [nope (dn) | rope (dr, interleaved on the HF side)]
    std::vector<int64_t> qcols;
    for (int64_t hh = 0; hh < H; ++hh) {
      auto nope = iota_cols(hh * Dqk, dn);
      auto rope = rope_interleaved_cols(hh * Dqk + dn, dr);
      qcols.insert(qcols.end(), nope.begin(), nope.end());
      qcols.insert(qcols.end(), rope.begin(), rope.end());
    }
    const std::string qhow = "T, per head rope rows interleaved (2i <- i, 2i+1 <- i+dr/2)";
    if (rq > 0) {
      b.lin_cols(at + "q_a_proj.weight", p + "attn.wdq", -1, 0, rq);
      b.copy(at + "q_a_layernorm.weight", p + "attn.q_norm");
      b.linear(at + "q_b_proj.weight", {{p + "attn.wuq", -1, true, qcols}}, qhow);
    } else {
      b.linear(at + "q_proj.weight", {{p + "attn.wq", -1, true, qcols}}, qhow);
    }
    b.linear(at + "kv_a_proj_with_mqa.weight",
             {{p + "attn.wdkv", -1, true, iota_cols(0, rkv)}, {p + "attn.wkr", -1, true, rope_interleaved_cols(0, dr)}},
             "concat(wdkv^T, wkr^T with rope rows interleaved)");
    b.copy(at + "kv_a_layernorm.weight", p + "attn.kv_norm");
    b.lin_cols(at + "kv_b_proj.weight", p + "attn.wukv", -1, 0, H * (dn + Dv));
  } else {
    const int64_t hd = s.attn.head_dim, Hkv = s.attn.kv_heads();
    b.lin_cols(at + "q_proj.weight", p + "attn.wqkv", -1, 0, H * hd);
    b.lin_cols(at + "k_proj.weight", p + "attn.wqkv", -1, H * hd, Hkv * hd);
    b.lin_cols(at + "v_proj.weight", p + "attn.wqkv", -1, (H + Hkv) * hd, Hkv * hd);
    if (s.attn.qk_norm) {
      b.copy(at + "q_norm.weight", p + "attn.q_head_norm");
      b.copy(at + "k_norm.weight", p + "attn.k_head_norm");
    }
  }
  b.lin_cols(at + "o_proj.weight", p + "attn.wo", -1, 0, d);
  b.copy(h + "post_attention_layernorm.weight", p + "ffn_norm");
  if (!moe) {
    swiglu_tensors(b, h + "mlp.", p + "mlp.w13", p + "mlp.w2", s.inter_size, -1, "gate_proj", "up_proj", "down_proj");
    return;
  }
  const std::string f = h + (mixtral ? "block_sparse_moe." : "mlp.");
  b.lin_cols(f + "gate.weight", p + "moe.gate", -1, 0, E);
  if (v3 && b.m.routes_with_bias) {
    b.copy(f + "gate.e_score_correction_bias", bias, true);  // see hf_weights.h: masked groups score 0.0
  } else {
    if (v3) b.fixed(f + "gate.e_score_correction_bias", {E}, "zeros (load_balance != aux_free: no bias in routing)");
    b.m.not_in_hf.push_back(bias);
  }
  for (int64_t e = 0; e < E; ++e) {
    const std::string ep = f + "experts." + std::to_string(e) + ".";
    if (mixtral) swiglu_tensors(b, ep, p + "moe.experts.w13", p + "moe.experts.w2", Fe, e, "w1", "w3", "w2");
    else swiglu_tensors(b, ep, p + "moe.experts.w13", p + "moe.experts.w2", Fe, e, "gate_proj", "up_proj", "down_proj");
  }
  if (Fs > 0) {
    // to_hf_config_json only picks deepseek* types for shared experts.
    swiglu_tensors(b, f + "shared_experts.", p + "moe.shared.w13", p + "moe.shared.w2", Fs, -1, "gate_proj", "up_proj",
                   "down_proj");
  } else if (mla_moe) {
    // n_shared_experts = 0: transformers' V2/V3 still build (and call) a shared MLP of width 0.
    b.fixed(f + "shared_experts.gate_proj.weight", {0, d}, "empty (n_shared_experts = 0)");
    b.fixed(f + "shared_experts.up_proj.weight", {0, d}, "empty (n_shared_experts = 0)");
    b.fixed(f + "shared_experts.down_proj.weight", {d, 0}, "empty (n_shared_experts = 0)");
  }
}

}  // namespace

HfWeightMap hf_weight_map(const ModelSpec& spec_in) {
  ModelSpec s = spec_in;
  s.resolve();
  MapBuilder b;
  b.m.model_type = hf_model_type(s);  // validates and rejects specs no HF format can express (MTP: deepseek_v3 only)
  b.m.routes_with_bias = s.moe.load_balance == LoadBalance::AuxFree;
  const int64_t d = s.d_model, V = s.vocab_size, L = s.n_layers;
  auto mtp_pre = [](int64_t k) { return "mtp." + std::to_string(k) + "."; };

  // moetron tensors, in Model order (param_layout.cpp): the embedding, the layers, the MTP depths (their own
  // tensors, then their blocks), the final norm and the head; then the expert biases (MTP blocks' after the layers').
  b.moetron("embed", {V, d});
  for (int64_t l = 0; l < L; ++l) block_moetron(b, s, "layers." + std::to_string(l) + ".", s.is_moe_layer(l));
  for (int64_t k = 0; k < s.mtp_layers; ++k) {
    b.moetron(mtp_pre(k) + "enorm", {d});
    b.moetron(mtp_pre(k) + "hnorm", {d});
    b.moetron(mtp_pre(k) + "eh_proj", {2 * d, d});
    b.moetron(mtp_pre(k) + "norm", {d});
    block_moetron(b, s, mtp_pre(k) + "block.", s.is_moe_block(L + k));
  }
  b.moetron("final_norm", {d});
  if (!s.tie_embeddings) b.moetron("head", {V, d});
  for (int64_t i = 0; i < s.n_moe_blocks(); ++i) b.moetron("expert_bias." + std::to_string(i), {s.moe.n_routed_experts});

  // HF tensors.
  b.copy("model.embed_tokens.weight", "embed");
  int64_t moe_i = 0;
  auto bias_of = [&](bool moe) { return moe ? "expert_bias." + std::to_string(moe_i++) : std::string(); };
  for (int64_t l = 0; l < L; ++l) {
    const bool moe = s.is_moe_layer(l);
    block_hf(b, s, "layers." + std::to_string(l) + ".", "model.layers." + std::to_string(l) + ".", moe, bias_of(moe));
  }
  // DeepSeek-V3's MTP depth k + 1 is decoder layer L + k: its own norms, eh_proj and block, the norm before the
  // head (shared_head.norm), and copies of the embedding and the head (import checks they equal the main ones).
  // eh_proj: HF [d, 2d] acts on [enorm(embedding) ; hnorm(hidden)], the engine's [2d, d] on the same order
  // (model_mtp.cpp), so it is the plain transpose.
  for (int64_t k = 0; k < s.mtp_layers; ++k) {
    const std::string h = "model.layers." + std::to_string(L + k) + ".", q = mtp_pre(k);
    b.copy(h + "embed_tokens.weight", "embed");
    b.m.hf.back().duplicate_of = "model.embed_tokens.weight";
    b.copy(h + "enorm.weight", q + "enorm");
    b.copy(h + "hnorm.weight", q + "hnorm");
    b.lin_cols(h + "eh_proj.weight", q + "eh_proj", -1, 0, d);
    const bool moe = s.is_moe_block(L + k);
    block_hf(b, s, q + "block.", h, moe, bias_of(moe));
    b.copy(h + "shared_head.norm.weight", q + "norm");
    b.copy(h + "shared_head.head.weight", s.tie_embeddings ? "embed" : "head");
    b.m.hf.back().duplicate_of = s.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  }
  b.copy("model.norm.weight", "final_norm");
  if (!s.tie_embeddings) b.copy("lm_head.weight", "head");
  return std::move(b.m);
}

std::vector<HfTensorRef> model_tensor_refs(Model& model) {
  std::vector<HfTensorRef> v;
  for (const auto& p : model.params()) v.push_back({p.name, p.shape, model.param_data() + p.offset});
  for (int i = 0; i < model.n_moe_layers(); ++i)
    v.push_back({"expert_bias." + std::to_string(i), {model.spec().moe.n_routed_experts}, model.expert_bias(i)});
  return v;
}

namespace {

// Name -> ref, checking the refs against the map: every map tensor present with its shape, no extras.
std::map<std::string, const HfTensorRef*> match_refs(const HfWeightMap& map, const std::vector<HfTensorRef>& refs,
                                                     const char* op) {
  std::map<std::string, const HfTensorRef*> by_name;
  std::ostringstream bad;
  int nbad = 0;
  for (const auto& r : refs) {
    if (!by_name.emplace(r.name, &r).second) bad << "\n  duplicate moetron tensor '" << r.name << "'", ++nbad;
    if (!r.data && shape_numel(r.shape) > 0) bad << "\n  moetron tensor '" << r.name << "' has no data", ++nbad;
  }
  std::set<std::string> known;
  for (const auto& t : map.moetron) {
    known.insert(t.name);
    auto it = by_name.find(t.name);
    if (it == by_name.end()) {
      bad << "\n  missing moetron tensor '" << t.name << "' " << shape_str(t.shape), ++nbad;
    } else if (it->second->shape != t.shape) {
      bad << "\n  moetron tensor '" << t.name << "' has shape " << shape_str(it->second->shape) << ", the "
          << map.model_type << " mapping expects " << shape_str(t.shape);
      ++nbad;
    }
  }
  for (const auto& r : refs)
    if (!known.count(r.name))
      bad << "\n  moetron tensor '" << r.name << "' has no place in the " << map.model_type << " mapping", ++nbad;
  if (nbad) MT_FAIL(op, nbad, " problem(s) with the moetron tensors:", bad.str());
  return by_name;
}

// Source matrix view of one part.
struct View {
  float* base;
  int64_t in, out;
};
View part_view(const HfPart& p, const HfTensorRef& r) {
  const Shape& s = r.shape;
  const int64_t in = s[s.size() - 2], out = s.back();
  float* base = r.data;
  if (p.expert >= 0) base += p.expert * in * out;
  return {base, in, out};
}

// The one gather/scatter: to_hf = true copies moetron -> hf, false hf -> moetron.
void move_tensor(const HfTensorMap& t, const std::map<std::string, const HfTensorRef*>& refs, float* hf, bool to_hf) {
  int64_t row = 0;
  const int64_t ncols = t.hf_shape.size() == 2 ? t.hf_shape[1] : 0;
  for (const auto& p : t.parts) {
    const HfTensorRef& r = *refs.at(p.src);
    if (!p.transpose) {
      const size_t n = size_t(shape_numel(r.shape));
      const float lo = p.shift_nonneg && n > 0 ? *std::min_element(r.data, r.data + n) : 0.0f;
      if (to_hf && lo < 0.0f)
        for (size_t i = 0; i < n; ++i) hf[i] = r.data[i] - lo;
      else if (to_hf)
        std::memcpy(hf, r.data, n * sizeof(float));
      else
        std::memcpy(r.data, hf, n * sizeof(float));
      continue;
    }
    View v = part_view(p, r);
    const int64_t nr = int64_t(p.cols.size());
    // 64-row x 64-column tiles keep both sides in cache.
    for (int64_t i0 = 0; i0 < nr; i0 += 64)
      for (int64_t j0 = 0; j0 < v.in; j0 += 64) {
        const int64_t i1 = std::min(nr, i0 + 64), j1 = std::min(v.in, j0 + 64);
        for (int64_t i = i0; i < i1; ++i) {
          float* h = hf + (row + i) * ncols;
          const int64_t c = p.cols[size_t(i)];
          if (to_hf)
            for (int64_t j = j0; j < j1; ++j) h[j] = v.base[j * v.out + c];
          else
            for (int64_t j = j0; j < j1; ++j) v.base[j * v.out + c] = h[j];
        }
      }
    row += nr;
  }
}

// One F32 or BF16 tensor of a file, as fp32.
void read_f32(const SafetensorsFile& f, const SafetensorsTensorInfo& info, std::vector<float>& buf) {
  const int64_t n = shape_numel(info.shape);
  buf.resize(size_t(n));
  auto bytes = f.bytes(info.name);
  if (info.dtype == DType::F32) {
    if (n > 0) std::memcpy(buf.data(), bytes.data(), size_t(n) * 4);
  } else {
    std::vector<bf16> tmp(static_cast<size_t>(n));
    if (n > 0) std::memcpy(tmp.data(), bytes.data(), size_t(n) * 2);
    bf16_to_f32(buf.data(), tmp.data(), n);
  }
}

using Found = std::vector<std::pair<const SafetensorsFile*, const SafetensorsTensorInfo*>>;

// The copies (HfTensorMap::duplicate_of) must equal their originals element for element (fp32 bits after
// widening); returns the number of problems written to `bad`. A missing original is reported elsewhere.
int check_duplicates(const HfWeightMap& map, const std::vector<SafetensorsFile>& files, const Found& found,
                     std::ostringstream& bad) {
  int nbad = 0;
  std::vector<float> a, b;
  for (size_t k = 0; k < map.hf.size(); ++k) {
    const HfTensorMap& t = map.hf[k];
    if (t.duplicate_of.empty() || !found[k].first) continue;
    size_t o = 0;
    while (o < map.hf.size() && map.hf[o].hf_name != t.duplicate_of) ++o;
    MT_CHECK(o < map.hf.size(), "load_hf_weights", "the map has no tensor ", t.duplicate_of, " for ", t.hf_name);
    if (!found[o].first) continue;
    read_f32(*found[k].first, *found[k].second, a);
    read_f32(*found[o].first, *found[o].second, b);
    int64_t ndiff = 0, first = -1;
    for (size_t i = 0; i < a.size(); ++i)
      if (std::memcmp(&a[i], &b[i], 4) != 0) ndiff += 1, first = first < 0 ? int64_t(i) : first;
    if (ndiff == 0) continue;
    bad << "\n  tensor '" << t.hf_name << "' differs from '" << t.duplicate_of << "' in " << ndiff << " of "
        << a.size() << " elements (first at " << first << ": " << a[size_t(first)] << " vs " << b[size_t(first)]
        << "); moetron shares one tensor for both, so the copy must be equal";
    ++nbad;
  }
  return nbad;
}

}  // namespace

std::vector<HfTensorData> export_hf_tensors(const HfWeightMap& map, const std::vector<HfTensorRef>& src,
                                            std::vector<std::string>* notes) {
  auto refs = match_refs(map, src, "export_hf_tensors");
  std::vector<HfTensorData> out;
  out.reserve(map.hf.size());
  for (const auto& t : map.hf) {
    HfTensorData o;
    o.name = t.hf_name, o.shape = t.hf_shape;
    o.data.resize(size_t(shape_numel(t.hf_shape)));
    move_tensor(t, refs, o.data.data(), true);
    out.push_back(std::move(o));
  }
  if (notes && map.routes_with_bias)
    for (const auto& name : map.not_in_hf) {
      const HfTensorRef& r = *refs.at(name);
      const int64_t n = shape_numel(r.shape);
      if (std::any_of(r.data, r.data + n, [](float x) { return x != 0.0f; }))
        notes->push_back(name + " (aux-loss-free routing bias) is non-zero, but HF " + map.model_type +
                         " has no tensor for it: dropped, so the exported model routes without it");
    }
  return out;
}

void load_hf_weights(const ModelSpec& spec, const std::vector<SafetensorsFile>& files,
                     const std::vector<HfTensorRef>& dst, const HfLoadOptions& opt) {
  const HfWeightMap map = hf_weight_map(spec);
  auto refs = match_refs(map, dst, "load_hf_weights");
  MT_CHECK(!files.empty(), "load_hf_weights", "no safetensors files given");
  auto label = [&] {
    std::string s = files[0].path();
    if (files.size() > 1) s += " (+" + std::to_string(files.size() - 1) + " more shards)";
    return s;
  };

  // Check the whole set first.
  std::ostringstream bad;
  int nbad = 0;
  Found found(map.hf.size());
  std::set<std::string> expected;
  for (size_t k = 0; k < map.hf.size(); ++k) {
    const HfTensorMap& t = map.hf[k];
    expected.insert(t.hf_name);
    const SafetensorsFile* f = nullptr;
    for (const auto& file : files)
      if (file.contains(t.hf_name)) {
        f = &file;
        break;
      }
    if (!f) {
      if (t.parts.empty()) continue;  // no moetron source: nothing to load
      bad << "\n  missing tensor '" << t.hf_name << "' (expected " << shape_str(t.hf_shape) << ")", ++nbad;
      continue;
    }
    const SafetensorsTensorInfo& info = f->info(t.hf_name);
    if (info.dtype != DType::F32 && info.dtype != DType::BF16) {
      bad << "\n  tensor '" << t.hf_name << "' has dtype " << safetensors_dtype_name(info.dtype)
          << "; only F32 and BF16 are supported (dequantize FP8 checkpoints first)";
      ++nbad;
      continue;
    }
    if (info.shape != t.hf_shape) {
      bad << "\n  tensor '" << t.hf_name << "' has shape " << shape_str(info.shape) << ", expected "
          << shape_str(t.hf_shape);
      ++nbad;
      continue;
    }
    if (t.parts.empty()) {
      std::vector<float> v;
      read_f32(*f, info, v);
      if (std::any_of(v.begin(), v.end(), [](float x) { return x != 0.0f; }))
        bad << "\n  tensor '" << t.hf_name << "' must be all zero for this spec (" << t.how
            << "): moetron has no place for its values", ++nbad;
      continue;
    }
    found[k] = {f, &info};
  }
  nbad += check_duplicates(map, files, found, bad);
  if (!opt.allow_unexpected) {
    for (const auto& file : files)
      for (const auto& info : file.tensors()) {
        const std::string& n = info.name;
        if (expected.count(n)) continue;
        if (n.ends_with("rotary_emb.inv_freq")) continue;
        if (spec.tie_embeddings && n == "lm_head.weight") continue;
        bad << "\n  unexpected tensor '" << n << "' " << shape_str(info.shape), ++nbad;
      }
  }
  if (nbad)
    MT_FAIL("load_hf_weights", label(), ": ", nbad, " problem(s) for HF model_type ", map.model_type, ":", bad.str());

  // Copy.
  std::vector<float> buf;
  for (size_t k = 0; k < map.hf.size(); ++k) {
    const auto [f, info] = found[k];
    if (!f || !map.hf[k].duplicate_of.empty()) continue;  // no moetron source, or a checked copy
    read_f32(*f, *info, buf);
    move_tensor(map.hf[k], refs, buf.data(), false);
  }
  for (const auto& name : map.not_in_hf) {
    const HfTensorRef& r = *refs.at(name);
    std::fill(r.data, r.data + shape_numel(r.shape), 0.0f);
  }
}

void load_hf_weights(const ModelSpec& spec, const SafetensorsFile& file, const std::vector<HfTensorRef>& dst,
                     const HfLoadOptions& opt) {
  load_hf_weights(spec, std::vector<SafetensorsFile>{file}, dst, opt);
}

void load_hf_weights(const ModelSpec& spec, const SafetensorsFile& file, float* data,
                     const std::vector<ParamEntry>& params, const std::vector<float*>& expert_bias,
                     const HfLoadOptions& opt) {
  MT_CHECK(data != nullptr, "load_hf_weights", "null parameter buffer");
  std::vector<HfTensorRef> refs;
  for (const auto& p : params) refs.push_back({p.name, p.shape, data + p.offset});
  for (size_t i = 0; i < expert_bias.size(); ++i)
    refs.push_back({"expert_bias." + std::to_string(i), {spec.moe.n_routed_experts}, expert_bias[i]});
  load_hf_weights(spec, std::vector<SafetensorsFile>{file}, refs, opt);
}

std::vector<SafetensorsFile> open_hf_safetensors(const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single)) return {SafetensorsFile::open(single.string())};
  if (!fs::exists(index))
    MT_FAIL("open_hf_safetensors", dir, ": neither model.safetensors nor model.safetensors.index.json");
  std::ifstream in(index);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    MT_FAIL("open_hf_safetensors", index.string(), ": invalid JSON: ", e.what());
  }
  MT_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "open_hf_safetensors", index.string(),
           ": no weight_map object");
  std::set<std::string> shards;
  for (const auto& [name, file] : j["weight_map"].items()) {
    MT_CHECK(file.is_string(), "open_hf_safetensors", index.string(), ": weight_map['", name, "'] is not a string");
    shards.insert(file.get<std::string>());
  }
  std::vector<SafetensorsFile> files;
  for (const auto& s : shards) files.push_back(SafetensorsFile::open((fs::path(dir) / s).string()));
  return files;
}

HfExportResult write_hf_model(const std::string& out_dir, const ModelSpec& spec, const std::vector<HfTensorRef>& src,
                              const HfExportOptions& opt) {
  MT_CHECK(opt.dtype == DType::F32 || opt.dtype == DType::BF16, "write_hf_model", "dtype must be F32 or BF16, got ",
           safetensors_dtype_name(opt.dtype));
  const HfWeightMap map = hf_weight_map(spec);
  HfExportResult res;
  res.model_type = map.model_type;
  std::vector<HfTensorData> tensors = export_hf_tensors(map, src, &res.notes);
  if (spec.is_moe() && spec.moe.capacity_factor > 0) {
    std::ostringstream cf;
    cf << spec.moe.capacity_factor;
    res.notes.push_back("model.capacity_factor = " + cf.str() + ": HF " + map.model_type +
                        " never drops tokens, so it computes the dropless model");
  }

  std::vector<std::vector<bf16>> b16;
  b16.reserve(tensors.size());
  std::vector<SafetensorsEntry> entries;
  for (const auto& t : tensors) {
    SafetensorsEntry e;
    e.name = t.name, e.shape = t.shape;
    const int64_t n = int64_t(t.data.size());
    // The routing bias stays fp32 (DeepSeek-V3 keeps it fp32: top-k selection is sensitive to it).
    const bool keep_f32 = opt.dtype == DType::F32 || t.name.ends_with("e_score_correction_bias");
    if (keep_f32) {
      e.dtype = DType::F32, e.data = t.data.data(), e.bytes = size_t(n) * 4;
    } else {
      b16.emplace_back(size_t(n));
      f32_to_bf16(b16.back().data(), t.data.data(), n);
      e.dtype = DType::BF16, e.data = b16.back().data(), e.bytes = size_t(n) * 2;
    }
    entries.push_back(e);
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  MT_CHECK(!ec, "write_hf_model", "cannot create ", out_dir, ": ", ec.message());
  res.safetensors_path = (fs::path(out_dir) / "model.safetensors").string();
  SafetensorsWriteResult w = write_safetensors(res.safetensors_path, entries, {{"format", "pt"}});
  res.file_bytes = w.file_bytes;
  res.n_tensors = int64_t(entries.size());

  json cfg = json::parse(to_hf_config_json(spec));
  cfg["torch_dtype"] = opt.dtype == DType::F32 ? "float32" : "bfloat16";
  res.config_path = (fs::path(out_dir) / "config.json").string();
  std::ofstream out(res.config_path, std::ios::trunc);
  out << cfg.dump(2) << "\n";
  out.close();
  MT_CHECK(out.good(), "write_hf_model", "cannot write ", res.config_path);
  return res;
}

HfExportResult export_hf(const JobConfig& cfg, const HfExportRequest& req, std::string* source_used) {
  MT_CHECK(!req.out_dir.empty(), "export_hf", "no output directory (--out)");
  const ModelSpec& spec = cfg.model;
  if (req.init) {
    MT_CHECK(req.checkpoint.empty(), "export_hf", "--init and --checkpoint exclude each other");
    // Smallest activation buffers: only the parameters matter here.
    Model model(spec, 1, 1);
    model.init_params(uint64_t(cfg.training.seed));
    if (source_used) *source_used = "seed init (training.seed = " + std::to_string(cfg.training.seed) + ")";
    return write_hf_model(req.out_dir, spec, model_tensor_refs(model), req.opt);
  }
  std::string dir = req.checkpoint;
  if (dir.empty()) {
    const std::string folder = (fs::path(cfg.job.dump_folder) / cfg.checkpoint.folder).string();
    auto latest = latest_complete_checkpoint(folder);
    MT_CHECK(latest.has_value(), "export_hf", "no complete checkpoint in ", folder,
             " (train with checkpoint.enable = true, pass --checkpoint DIR, or --init for the seed init)");
    dir = *latest;
  }
  LoadedCheckpoint ck = load_checkpoint(dir);
  if (ck.state.contains("config")) {
    JobConfig saved = config_from_json(ck.state.at("config"));
    MT_CHECK(saved.model == spec, "export_hf", "checkpoint ", dir,
             " was written for a different model spec than the config's [model] section");
  }
  const HfWeightMap map = hf_weight_map(spec);
  std::vector<std::vector<float>> bufs;
  bufs.reserve(map.moetron.size());
  std::vector<HfTensorRef> refs;
  for (const auto& t : map.moetron) {
    bufs.emplace_back(size_t(shape_numel(t.shape)));
    load_into(ck.model, t.name, DType::F32, t.shape, bufs.back().data());
    refs.push_back({t.name, t.shape, bufs.back().data()});
  }
  if (source_used) *source_used = dir;
  return write_hf_model(req.out_dir, spec, refs, req.opt);
}

}  // namespace moetron
