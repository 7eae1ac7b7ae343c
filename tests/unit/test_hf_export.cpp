// test_hf_export.cpp: the moetron <-> Hugging Face weight mapping (hf_weights.h). For each HF model type
// (deepseek, deepseek_v2, deepseek_v3, mixtral, qwen3_moe): export a seeded model, re-import it with the
// inverse mapping and require bitwise-equal parameters (the DeepSeek-V3 routing bias: shifted to a zero
// minimum); check HF names, shapes and values of chosen tensors against the moetron layout; check the MLA
// RoPE permutation by running HF's rotary convention on the exported weights; config.json re-imports to
// the same spec; export from a real checkpoint; and the errors a user sees (missing tensor, wrong shape,
// wrong dtype, unexpected tensor). Whether the export means the same model under each HF type's rules
// is test_hf_semantics.cpp. DeepSeek-V3's MTP layers: round trip (parameters and loss, bitwise), names and
// values, and the import errors (a copy of the embedding / head that differs, a missing MTP tensor).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "moetron/check.h"
#include "moetron/checkpoint.h"
#include "moetron/config.h"
#include "moetron/hf_weights.h"
#include "moetron/model.h"
#include "moetron/rng.h"
#include "moetron/rope.h"
#include "moetron/trainer.h"

#include "test_util.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }

std::string fresh_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("moetron_hfx_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

using moetron::testing::error_of;

JobConfig cfg_of(const std::string& rel, std::vector<std::string> ov = {}) { return load_config(repo(rel), ov); }

// DeepSeek-V2 (MLA, softmax, no q compression) from the V3-shaped tiny config.
const std::vector<std::string> kV2Overrides = {"--model.q_lora_rank=0",     "--model.score_func=softmax",
                                               "--model.load_balance=aux_loss", "--model.route_scale=1.0",
                                               "--model.n_group=1",         "--model.topk_group=1",
                                               "--model.norm_topk_prob=false"};

// Random values in every moetron tensor (norms included), so that a missed or swapped element shows.
std::vector<std::vector<float>> random_tensors(const HfWeightMap& map, std::vector<HfTensorRef>& refs, uint64_t seed) {
  std::vector<std::vector<float>> bufs;
  bufs.reserve(map.moetron.size());
  refs.clear();
  for (const auto& t : map.moetron) {
    bufs.emplace_back(static_cast<size_t>(shape_numel(t.shape)));
    fill_normal(bufs.back().data(), int64_t(bufs.back().size()), rng_key(seed, t.name), 0, 0.0f, 1.0f);
    refs.push_back({t.name, t.shape, bufs.back().data()});
  }
  return bufs;
}

const HfTensorData& find(const std::vector<HfTensorData>& v, const std::string& name) {
  for (const auto& t : v)
    if (t.name == name) return t;
  throw Error("test: no HF tensor " + name);
}
const HfTensorRef& find(const std::vector<HfTensorRef>& v, const std::string& name) {
  for (const auto& t : v)
    if (t.name == name) return t;
  throw Error("test: no moetron tensor " + name);
}
bool has(const std::vector<HfTensorData>& v, const std::string& name) {
  for (const auto& t : v)
    if (t.name == name) return true;
  return false;
}

void write_tensors(const std::string& path, const std::vector<HfTensorData>& v) {
  std::vector<SafetensorsEntry> e;
  for (const auto& t : v) e.push_back({t.name, DType::F32, t.shape, t.data.data(), t.data.size() * 4});
  write_safetensors(path, e, {{"format", "pt"}});
}

bool bitwise_equal(const float* a, const float* b, int64_t n) { return std::memcmp(a, b, size_t(n) * 4) == 0; }

// What DeepSeek-V3's e_score_correction_bias holds for a moetron bias b: b - min(b) when min(b) < 0.
std::vector<float> v3_bias(const float* b, int64_t n) {
  float lo = 0.0f;
  for (int64_t i = 0; i < n; ++i) lo = std::min(lo, b[i]);
  std::vector<float> v(b, b + n);
  for (auto& x : v) x -= lo;
  return v;
}

// Build the model, seed it, export (f32), re-import into a second model filled with NaN, compare bitwise.
void roundtrip_model(const JobConfig& cfg, const std::string& want_type, const std::string& tag) {
  const ModelSpec& spec = cfg.model;
  SCOPED_TRACE(tag);
  Model a(spec, 1, 4), b(spec, 1, 4);
  a.init_params(uint64_t(cfg.training.seed));
  const HfWeightMap map = hf_weight_map(spec);
  EXPECT_EQ(map.model_type, want_type);
  // The map lists exactly the Model's tensors, in order, with the same shapes.
  auto ra = model_tensor_refs(a);
  ASSERT_EQ(ra.size(), map.moetron.size());
  for (size_t i = 0; i < ra.size(); ++i) {
    EXPECT_EQ(ra[i].name, map.moetron[i].name);
    EXPECT_EQ(ra[i].shape, map.moetron[i].shape) << ra[i].name;
  }
  // A non-zero expert bias (the trained state of aux-free routing) where the format carries it.
  const bool v3 = want_type == "deepseek_v3";
  for (int i = 0; i < a.n_moe_layers(); ++i)
    if (v3) fill_normal(a.expert_bias(i), spec.moe.n_routed_experts, rng_key(5, "bias" + std::to_string(i)), 0, 0, 1);

  const std::string dir = fresh_dir(tag);
  HfExportOptions opt;
  opt.dtype = DType::F32;
  HfExportResult r = write_hf_model(dir, spec, ra, opt);
  EXPECT_EQ(r.model_type, want_type);
  EXPECT_TRUE(r.notes.empty());
  SafetensorsFile f = SafetensorsFile::open(r.safetensors_path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(int64_t(f.tensors().size()), int64_t(map.hf.size()));
  for (const auto& t : f.tensors()) EXPECT_EQ(t.dtype, DType::F32) << t.name;

  // Re-import into NaN-filled destinations: every element must be written, and bitwise equal.
  auto rb = model_tensor_refs(b);
  for (auto& t : rb) std::fill(t.data, t.data + shape_numel(t.shape), std::numeric_limits<float>::quiet_NaN());
  load_hf_weights(spec, f, rb);
  for (size_t i = 0; i < ra.size(); ++i) {
    const int64_t n = shape_numel(ra[i].shape);
    if (v3 && ra[i].name.starts_with("expert_bias")) {
      EXPECT_TRUE(bitwise_equal(v3_bias(ra[i].data, n).data(), rb[i].data, n)) << ra[i].name;
      EXPECT_LT(*std::min_element(ra[i].data, ra[i].data + n), 0.0f);  // the shift was exercised
    } else {
      EXPECT_TRUE(bitwise_equal(ra[i].data, rb[i].data, n)) << ra[i].name;
    }
  }

  // The flat-buffer form gives the same.
  std::vector<float> flat(size_t(b.num_params()), 0.0f);
  std::vector<std::vector<float>> bias(size_t(b.n_moe_layers()), std::vector<float>(size_t(spec.moe.n_routed_experts)));
  std::vector<float*> bias_ptr;
  for (auto& v : bias) bias_ptr.push_back(v.data());
  load_hf_weights(spec, f, flat.data(), b.params(), bias_ptr);
  for (const auto& p : a.params())
    EXPECT_TRUE(bitwise_equal(a.param_data() + p.offset, flat.data() + p.offset, p.numel)) << p.name;
  for (int i = 0; i < a.n_moe_layers(); ++i)
    EXPECT_TRUE(bitwise_equal(v3 ? v3_bias(a.expert_bias(i), spec.moe.n_routed_experts).data() : a.expert_bias(i),
                              bias[size_t(i)].data(), spec.moe.n_routed_experts));

  // config.json re-imports to the same spec.
  EXPECT_EQ(load_hf_config(r.config_path), spec);
  std::ifstream in(r.config_path);
  EXPECT_EQ(nlohmann::json::parse(in).at("torch_dtype"), "float32");
  fs::remove_all(dir);
}

}  // namespace

TEST(HfExport, RoundTripBitwiseDeepSeekMha) { roundtrip_model(cfg_of("configs/ds_tiny.toml"), "deepseek", "ds_tiny"); }

TEST(HfExport, RoundTripBitwiseDeepSeekV3Mla) {
  roundtrip_model(cfg_of("configs/ds_tiny_mla.toml"), "deepseek_v3", "ds_tiny_mla");
}

TEST(HfExport, RoundTripBitwiseDeepSeekV2MlaWithoutQCompression) {
  roundtrip_model(cfg_of("configs/ds_tiny_mla.toml", kV2Overrides), "deepseek_v2", "ds_tiny_v2");
}

TEST(HfExport, RoundTripBitwiseMixtral) {
  roundtrip_model(cfg_of("tests/data/hf_export/mixtral_tiny.toml"), "mixtral", "mixtral_tiny");
}

TEST(HfExport, RoundTripBitwiseDeepSeekWithoutSharedExperts) {
  // Without renormalized top-k weights the Mixtral-shaped spec is a DeepSeek-V1 model with no shared experts.
  roundtrip_model(cfg_of("tests/data/hf_export/mixtral_tiny.toml", {"--model.norm_topk_prob=false"}), "deepseek",
                  "deepseek_noshared");
}

TEST(HfExport, RoundTripBitwiseTiedEmbeddings) {
  JobConfig c = cfg_of("configs/ds_tiny.toml", {"--model.tie_embeddings=true"});
  roundtrip_model(c, "deepseek", "ds_tiny_tied");
  HfWeightMap m = hf_weight_map(c.model);
  for (const auto& t : m.hf) EXPECT_NE(t.hf_name, "lm_head.weight");
}

// Qwen3-MoE through the engine: its qk_norm parameters (attn.q_head_norm / k_head_norm) are the map's q_norm / k_norm.
TEST(HfExport, RoundTripBitwiseQwen3Moe) {
  roundtrip_model(cfg_of("tests/data/hf_export/qwen3_tiny.toml"), "qwen3_moe", "qwen3_tiny");
}

// Qwen3-MoE from the map alone (tensors made from the map, no Model): shapes and the v_proj layout.
TEST(HfExport, RoundTripBitwiseQwen3MoeFromMap) {
  JobConfig c = cfg_of("tests/data/hf_export/qwen3_tiny.toml");
  const ModelSpec& s = c.model;
  HfWeightMap map = hf_weight_map(s);
  EXPECT_EQ(map.model_type, "qwen3_moe");
  EXPECT_EQ(map.not_in_hf, (std::vector<std::string>{"expert_bias.0", "expert_bias.1"}));
  std::vector<HfTensorRef> src;
  auto bufs = random_tensors(map, src, 3);
  // The bias has nowhere to go in qwen3_moe: zero it so that export adds no note.
  for (auto& r : src)
    if (r.name.starts_with("expert_bias")) std::fill(r.data, r.data + shape_numel(r.shape), 0.0f);
  std::vector<std::string> notes;
  auto hf = export_hf_tensors(map, src, &notes);
  EXPECT_TRUE(notes.empty());

  const int64_t d = 64, H = 4, Hkv = 2, hd = 32, E = 8, Fe = 16;
  const auto& q = find(hf, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(q.shape, (Shape{H * hd, d}));  // head_dim 32: q_proj is wider than d_model
  EXPECT_EQ(find(hf, "model.layers.1.self_attn.k_proj.weight").shape, (Shape{Hkv * hd, d}));
  EXPECT_EQ(find(hf, "model.layers.1.self_attn.q_norm.weight").shape, (Shape{hd}));
  EXPECT_EQ(find(hf, "model.layers.1.self_attn.k_norm.weight").shape, (Shape{hd}));
  EXPECT_EQ(find(hf, "model.layers.0.mlp.gate.weight").shape, (Shape{E, d}));
  EXPECT_EQ(find(hf, "model.layers.0.mlp.experts.7.down_proj.weight").shape, (Shape{d, Fe}));
  EXPECT_FALSE(has(hf, "model.layers.0.mlp.shared_expert.gate_proj.weight"));
  // v_proj[r, c] == wqkv[c, (H + Hkv) hd + r]
  const auto& wqkv = find(src, "layers.1.attn.wqkv");
  const auto& v = find(hf, "model.layers.1.self_attn.v_proj.weight");
  const int64_t W = (H + 2 * Hkv) * hd;
  for (int64_t r = 0; r < Hkv * hd; r += 7)
    for (int64_t cc = 0; cc < d; cc += 5) ASSERT_EQ(v.data[r * d + cc], wqkv.data[cc * W + (H + Hkv) * hd + r]);

  const std::string dir = fresh_dir("qwen3");
  fs::create_directories(dir);
  write_tensors(dir + "/model.safetensors", hf);
  std::vector<HfTensorRef> dst;
  auto back = random_tensors(map, dst, 99);
  for (auto& t : dst) std::fill(t.data, t.data + shape_numel(t.shape), std::numeric_limits<float>::quiet_NaN());
  load_hf_weights(s, SafetensorsFile::open(dir + "/model.safetensors"), dst);
  for (size_t i = 0; i < src.size(); ++i)
    EXPECT_TRUE(bitwise_equal(src[i].data, dst[i].data, shape_numel(src[i].shape))) << src[i].name;
  EXPECT_EQ(model_spec_from_hf_json(to_hf_config_json(s)), s);
  fs::remove_all(dir);
}

TEST(HfExport, NamesShapesAndValuesMha) {
  JobConfig c = cfg_of("configs/ds_tiny.toml");
  HfWeightMap map = hf_weight_map(c.model);
  std::vector<HfTensorRef> src;
  auto bufs = random_tensors(map, src, 1);
  auto hf = export_hf_tensors(map, src);
  const int64_t d = 64, H = 4, hd = 16, F = 128, E = 8, Fe = 32, V = 512;
  const int64_t W = 3 * H * hd;
  EXPECT_EQ(find(hf, "model.embed_tokens.weight").shape, (Shape{V, d}));
  EXPECT_EQ(find(hf, "lm_head.weight").shape, (Shape{V, d}));
  EXPECT_EQ(find(hf, "model.norm.weight").shape, (Shape{d}));
  EXPECT_EQ(find(hf, "model.layers.0.self_attn.q_proj.weight").shape, (Shape{H * hd, d}));
  EXPECT_EQ(find(hf, "model.layers.0.self_attn.o_proj.weight").shape, (Shape{d, H * hd}));
  EXPECT_EQ(find(hf, "model.layers.0.mlp.gate_proj.weight").shape, (Shape{F, d}));
  EXPECT_EQ(find(hf, "model.layers.0.mlp.down_proj.weight").shape, (Shape{d, F}));
  EXPECT_EQ(find(hf, "model.layers.2.mlp.gate.weight").shape, (Shape{E, d}));
  EXPECT_EQ(find(hf, "model.layers.2.mlp.experts.5.up_proj.weight").shape, (Shape{Fe, d}));
  EXPECT_EQ(find(hf, "model.layers.2.mlp.shared_experts.gate_proj.weight").shape, (Shape{Fe, d}));
  EXPECT_EQ(find(hf, "model.layers.2.mlp.shared_experts.down_proj.weight").shape, (Shape{d, Fe}));
  EXPECT_FALSE(has(hf, "model.layers.2.mlp.gate.e_score_correction_bias"));
  EXPECT_FALSE(has(hf, "model.layers.0.mlp.gate.weight"));  // layer 0 is dense

  const auto& wqkv = find(src, "layers.1.attn.wqkv");
  const auto& q = find(hf, "model.layers.1.self_attn.q_proj.weight");
  const auto& k = find(hf, "model.layers.1.self_attn.k_proj.weight");
  for (int64_t r = 0; r < H * hd; ++r)
    for (int64_t cc = 0; cc < d; ++cc) {
      ASSERT_EQ(q.data[r * d + cc], wqkv.data[cc * W + r]);
      ASSERT_EQ(k.data[r * d + cc], wqkv.data[cc * W + H * hd + r]);
    }
  const auto& w13 = find(src, "layers.2.moe.experts.w13");  // [E, d, 2 Fe]
  const auto& w2 = find(src, "layers.2.moe.experts.w2");    // [E, Fe, d]
  const auto& gate = find(hf, "model.layers.2.mlp.experts.5.gate_proj.weight");
  const auto& up = find(hf, "model.layers.2.mlp.experts.5.up_proj.weight");
  const auto& down = find(hf, "model.layers.2.mlp.experts.5.down_proj.weight");
  for (int64_t r = 0; r < Fe; ++r)
    for (int64_t cc = 0; cc < d; ++cc) {
      ASSERT_EQ(gate.data[r * d + cc], w13.data[(5 * d + cc) * 2 * Fe + r]);
      ASSERT_EQ(up.data[r * d + cc], w13.data[(5 * d + cc) * 2 * Fe + Fe + r]);
      ASSERT_EQ(down.data[cc * Fe + r], w2.data[(5 * Fe + r) * d + cc]);
    }
  const auto& g = find(src, "layers.1.moe.gate");  // [d, E]
  const auto& hg = find(hf, "model.layers.1.mlp.gate.weight");
  for (int64_t e = 0; e < E; ++e)
    for (int64_t cc = 0; cc < d; ++cc) ASSERT_EQ(hg.data[e * d + cc], g.data[cc * E + e]);
  const auto& head = find(src, "head");
  EXPECT_TRUE(bitwise_equal(find(hf, "lm_head.weight").data.data(), head.data, V * d));
}

TEST(HfExport, NamesShapesAndValuesMixtral) {
  JobConfig c = cfg_of("tests/data/hf_export/mixtral_tiny.toml");
  HfWeightMap map = hf_weight_map(c.model);
  std::vector<HfTensorRef> src;
  auto bufs = random_tensors(map, src, 2);
  auto hf = export_hf_tensors(map, src);
  const int64_t d = 64, E = 4, Fe = 32;
  for (const auto& t : hf) EXPECT_EQ(t.name.find(".mlp."), std::string::npos) << t.name;
  EXPECT_EQ(find(hf, "model.layers.1.block_sparse_moe.gate.weight").shape, (Shape{E, d}));
  const auto& w1 = find(hf, "model.layers.1.block_sparse_moe.experts.3.w1.weight");
  const auto& w3 = find(hf, "model.layers.1.block_sparse_moe.experts.3.w3.weight");
  const auto& w2 = find(hf, "model.layers.1.block_sparse_moe.experts.3.w2.weight");
  EXPECT_EQ(w1.shape, (Shape{Fe, d}));
  EXPECT_EQ(w3.shape, (Shape{Fe, d}));
  EXPECT_EQ(w2.shape, (Shape{d, Fe}));
  const auto& w13 = find(src, "layers.1.moe.experts.w13");
  const auto& we2 = find(src, "layers.1.moe.experts.w2");
  for (int64_t r = 0; r < Fe; ++r)
    for (int64_t cc = 0; cc < d; ++cc) {
      ASSERT_EQ(w1.data[r * d + cc], w13.data[(3 * d + cc) * 2 * Fe + r]);       // gate
      ASSERT_EQ(w3.data[r * d + cc], w13.data[(3 * d + cc) * 2 * Fe + Fe + r]);  // up
      ASSERT_EQ(w2.data[cc * Fe + r], we2.data[(3 * Fe + r) * d + cc]);
    }
}

TEST(HfExport, NamesShapesAndValuesMla) {
  JobConfig c = cfg_of("configs/ds_tiny_mla.toml");
  HfWeightMap map = hf_weight_map(c.model);
  std::vector<HfTensorRef> src;
  auto bufs = random_tensors(map, src, 4);
  auto hf = export_hf_tensors(map, src);
  const int64_t d = 64, H = 4, rq = 32, rkv = 32, dn = 16, dr = 8, dv = 16, E = 8, Dqk = dn + dr;
  EXPECT_EQ(find(hf, "model.layers.1.self_attn.q_a_proj.weight").shape, (Shape{rq, d}));
  EXPECT_EQ(find(hf, "model.layers.1.self_attn.q_a_layernorm.weight").shape, (Shape{rq}));
  EXPECT_EQ(find(hf, "model.layers.1.self_attn.kv_a_layernorm.weight").shape, (Shape{rkv}));
  EXPECT_EQ(find(hf, "model.layers.1.self_attn.kv_b_proj.weight").shape, (Shape{H * (dn + dv), rkv}));
  EXPECT_EQ(find(hf, "model.layers.1.self_attn.o_proj.weight").shape, (Shape{d, H * dv}));
  EXPECT_EQ(find(hf, "model.layers.2.mlp.gate.e_score_correction_bias").shape, (Shape{E}));
  EXPECT_TRUE(bitwise_equal(find(hf, "model.layers.2.mlp.gate.e_score_correction_bias").data.data(),
                            v3_bias(find(src, "expert_bias.1").data, E).data(), E));
  // q_b_proj: per head, nope rows straight, rope rows interleaved (HF 2i <- i, 2i+1 <- i + dr/2).
  const auto& wuq = find(src, "layers.1.attn.wuq");  // [rq, H*Dqk]
  const auto& qb = find(hf, "model.layers.1.self_attn.q_b_proj.weight");
  ASSERT_EQ(qb.shape, (Shape{H * Dqk, rq}));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t cc = 0; cc < rq; ++cc) {
      for (int64_t i = 0; i < dn; ++i) ASSERT_EQ(qb.data[(h * Dqk + i) * rq + cc], wuq.data[cc * H * Dqk + h * Dqk + i]);
      for (int64_t i = 0; i < dr / 2; ++i) {
        ASSERT_EQ(qb.data[(h * Dqk + dn + 2 * i) * rq + cc], wuq.data[cc * H * Dqk + h * Dqk + dn + i]);
        ASSERT_EQ(qb.data[(h * Dqk + dn + 2 * i + 1) * rq + cc], wuq.data[cc * H * Dqk + h * Dqk + dn + i + dr / 2]);
      }
    }
  // kv_a_proj_with_mqa = [wdkv^T ; wkr^T with interleaved rows]: [rkv + dr, d]
  const auto& wdkv = find(src, "layers.2.attn.wdkv");
  const auto& wkr = find(src, "layers.2.attn.wkr");
  const auto& kva = find(hf, "model.layers.2.self_attn.kv_a_proj_with_mqa.weight");
  ASSERT_EQ(kva.shape, (Shape{rkv + dr, d}));
  for (int64_t cc = 0; cc < d; ++cc) {
    for (int64_t r = 0; r < rkv; ++r) ASSERT_EQ(kva.data[r * d + cc], wdkv.data[cc * rkv + r]);
    for (int64_t i = 0; i < dr / 2; ++i) {
      ASSERT_EQ(kva.data[(rkv + 2 * i) * d + cc], wkr.data[cc * dr + i]);
      ASSERT_EQ(kva.data[(rkv + 2 * i + 1) * d + cc], wkr.data[cc * dr + i + dr / 2]);
    }
  }
  // The V2 variant without q compression has q_proj [H*Dqk, d] and no q_a_*.
  JobConfig c2 = cfg_of("configs/ds_tiny_mla.toml", kV2Overrides);
  HfWeightMap m2 = hf_weight_map(c2.model);
  bool q_proj = false;
  for (const auto& t : m2.hf) {
    EXPECT_EQ(t.hf_name.find("q_a_proj"), std::string::npos);
    EXPECT_EQ(t.hf_name.find("e_score_correction_bias"), std::string::npos);
    if (t.hf_name == "model.layers.0.self_attn.q_proj.weight") {
      q_proj = true;
      EXPECT_EQ(t.hf_shape, (Shape{H * Dqk, d}));
    }
  }
  EXPECT_TRUE(q_proj);
}

// Run HF DeepSeek's rotary convention on the exported weights (project, de-interleave 2i -> i and
// 2i+1 -> i + R/2, then rotate_half) and require the same rotated q_pe / k_pe as moetron (project with
// [in, out] weights, rope.h half-split rotation). Swapping the export permutation breaks this test.
TEST(HfExport, MlaRopePermutationMatchesHfRotaryConvention) {
  JobConfig c = cfg_of("configs/ds_tiny_mla.toml", kV2Overrides);  // q_proj path: x -> q directly
  const ModelSpec& s = c.model;
  HfWeightMap map = hf_weight_map(s);
  std::vector<HfTensorRef> src;
  auto bufs = random_tensors(map, src, 8);
  auto hf = export_hf_tensors(map, src);
  const int64_t d = s.d_model, H = s.attn.n_heads, dn = s.attn.qk_nope_head_dim, dr = s.attn.qk_rope_head_dim;
  const int64_t Dqk = dn + dr, rkv = s.attn.kv_lora_rank, T = 6, t = 5;
  std::vector<float> cs(static_cast<size_t>(T * dr / 2)), sn(static_cast<size_t>(T * dr / 2));
  rope_table(cs.data(), sn.data(), T, dr, float(s.rope_theta));
  std::vector<float> x(static_cast<size_t>(d));
  fill_normal(x.data(), d, rng_key(9, "x"), 0, 0.0f, 1.0f);

  // moetron: y[o] = sum_i x[i] W[i, o]; rotate the rope slice in place at position t.
  auto ours = [&](const HfTensorRef& w, int64_t heads, int64_t ld_head, int64_t offset) {
    const int64_t out = w.shape[1];
    std::vector<float> y(size_t(T * out), 0.0f);  // only row t is used
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < d; ++i) acc += double(x[i]) * w.data[i * out + o];
      y[size_t(t * out + o)] = float(acc);
    }
    rope_ref<float>(y.data(), 1, T, heads, out, ld_head, offset, dr, cs.data(), sn.data(), false);
    return std::vector<float>(y.begin() + t * out, y.begin() + (t + 1) * out);
  };
  // HF: y = W_hf x; pe = y[row0 : row0 + dr]; de-interleave; q*cos + rotate_half(q)*sin.
  auto hf_rope = [&](const HfTensorData& w, int64_t row0) {
    const size_t R = static_cast<size_t>(dr);
    std::vector<double> pe(R), de(R), out(R);
    for (int64_t r = 0; r < dr; ++r) {
      double acc = 0;
      for (int64_t i = 0; i < d; ++i) acc += double(w.data[(row0 + r) * d + i]) * x[i];
      pe[size_t(r)] = acc;
    }
    for (int64_t j = 0; j < dr / 2; ++j) de[size_t(j)] = pe[size_t(2 * j)], de[size_t(j + dr / 2)] = pe[size_t(2 * j + 1)];
    for (int64_t k = 0; k < dr; ++k) {
      const int64_t f = k % (dr / 2);
      const double ang = double(t) * std::pow(s.rope_theta, -2.0 * double(f) / double(dr));
      const double rot = k < dr / 2 ? -de[size_t(k + dr / 2)] : de[size_t(k - dr / 2)];
      out[size_t(k)] = de[size_t(k)] * std::cos(ang) + rot * std::sin(ang);
    }
    return out;
  };
  const auto q_ours = ours(find(src, "layers.1.attn.wq"), H, Dqk, dn);
  const auto& q_hf = find(hf, "model.layers.1.self_attn.q_proj.weight");
  for (int64_t h = 0; h < H; ++h) {
    auto pe = hf_rope(q_hf, h * Dqk + dn);
    for (int64_t k = 0; k < dr; ++k) EXPECT_NEAR(q_ours[size_t(h * Dqk + dn + k)], pe[size_t(k)], 1e-4) << h << " " << k;
  }
  const auto k_ours = ours(find(src, "layers.1.attn.wkr"), 1, dr, 0);
  auto k_hf = hf_rope(find(hf, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"), rkv);
  for (int64_t k = 0; k < dr; ++k) EXPECT_NEAR(k_ours[size_t(k)], k_hf[size_t(k)], 1e-4) << k;
}

TEST(HfExport, Bf16ExportRoundsToNearestEven) {
  JobConfig c = cfg_of("configs/ds_tiny_mla.toml");
  Model a(c.model, 1, 4), b(c.model, 1, 4);
  a.init_params(1);
  for (int i = 0; i < a.n_moe_layers(); ++i) fill_normal(a.expert_bias(i), 8, rng_key(1, std::string("b") + std::to_string(i)), 0, 0, 1);
  const std::string dir = fresh_dir("bf16");
  HfExportResult r = write_hf_model(dir, c.model, model_tensor_refs(a));  // default: bf16
  SafetensorsFile f = SafetensorsFile::open(r.safetensors_path);
  EXPECT_EQ(f.info("model.layers.1.self_attn.q_b_proj.weight").dtype, DType::BF16);
  EXPECT_EQ(f.info("model.layers.1.mlp.gate.e_score_correction_bias").dtype, DType::F32);  // routing bias stays fp32
  load_hf_weights(c.model, f, model_tensor_refs(b));
  for (const auto& p : a.params())
    for (int64_t i = 0; i < p.numel; ++i)
      ASSERT_EQ(b.param_data()[p.offset + i], round_bf16(a.param_data()[p.offset + i])) << p.name << "[" << i << "]";
  for (int i = 0; i < a.n_moe_layers(); ++i)
    EXPECT_TRUE(bitwise_equal(v3_bias(a.expert_bias(i), 8).data(), b.expert_bias(i), 8));
  std::ifstream in(r.config_path);
  EXPECT_EQ(nlohmann::json::parse(in).at("torch_dtype"), "bfloat16");
  fs::remove_all(dir);
}

TEST(HfExport, NonZeroBiasWithoutHfSlotIsNotedAndZeroedOnImport) {
  std::vector<std::string> ov = kV2Overrides;
  ov.push_back("--model.load_balance=aux_free");  // deepseek_v2 has no e_score_correction_bias
  JobConfig c = cfg_of("configs/ds_tiny_mla.toml", ov);
  Model a(c.model, 1, 4);
  a.init_params(1);
  a.expert_bias(1)[3] = 0.5f;
  const std::string dir = fresh_dir("bias_note");
  HfExportResult r = write_hf_model(dir, c.model, model_tensor_refs(a));
  EXPECT_EQ(r.model_type, "deepseek_v2");
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find("expert_bias.1"), std::string::npos) << r.notes[0];
  auto refs = model_tensor_refs(a);
  load_hf_weights(c.model, SafetensorsFile::open(r.safetensors_path), refs);
  EXPECT_EQ(a.expert_bias(1)[3], 0.0f);
  fs::remove_all(dir);
}

// The CLI path: train ds_tiny for two steps with checkpoints, export the latest checkpoint, compare.
TEST(HfExport, ExportLatestCheckpointThenReimportBitwise) {
  const std::string dump = fresh_dir("ckpt");
  JobConfig c = cfg_of("configs/ds_tiny.toml", {"--job.dump_folder=" + dump, "--training.steps=2",
                                                "--checkpoint.enable=true", "--checkpoint.interval=1",
                                                "--metrics.peak_tflops=1.0", "--metrics.jsonl=false"});
  // Without a checkpoint: a clear error.
  HfExportRequest req;
  req.out_dir = dump + "/hf";
  req.opt.dtype = DType::F32;
  std::string m = error_of([&] { export_hf(c, req); });
  EXPECT_NE(m.find("no complete checkpoint"), std::string::npos) << m;
  TrainOptions o;
  o.quiet = true;
  train(c, o);
  std::string used;
  HfExportResult r = export_hf(c, req, &used);
  EXPECT_NE(used.find("step-2"), std::string::npos) << used;
  LoadedCheckpoint ck = load_checkpoint(used);
  Model b(c.model, 1, 4);
  auto refs = model_tensor_refs(b);
  load_hf_weights(c.model, open_hf_safetensors(req.out_dir), refs);
  std::vector<float> want;
  for (const auto& t : refs) {
    want.resize(size_t(shape_numel(t.shape)));
    load_into(ck.model, t.name, DType::F32, t.shape, want.data());
    EXPECT_TRUE(bitwise_equal(want.data(), t.data, int64_t(want.size()))) << t.name;
  }
  // An explicit step directory, and --init.
  req.checkpoint = (fs::path(dump) / "checkpoint" / "step-1").string();
  EXPECT_NO_THROW(export_hf(c, req, &used));
  EXPECT_NE(used.find("step-1"), std::string::npos);
  req.init = true;
  m = error_of([&] { export_hf(c, req); });
  EXPECT_NE(m.find("--init and --checkpoint"), std::string::npos) << m;
  req.checkpoint.clear();
  export_hf(c, req, &used);
  Model seed(c.model, 1, 4);
  seed.init_params(uint64_t(c.training.seed));
  load_hf_weights(c.model, open_hf_safetensors(req.out_dir), refs);
  for (const auto& p : seed.params())
    EXPECT_TRUE(bitwise_equal(seed.param_data() + p.offset, b.param_data() + p.offset, p.numel)) << p.name;
  // A checkpoint of another model is refused.
  JobConfig other = c;
  other.model.moe.topk = 3;
  req.init = false;
  m = error_of([&] { export_hf(other, req); });
  EXPECT_NE(m.find("different model spec"), std::string::npos) << m;
  fs::remove_all(dump);
}

TEST(HfExport, ShardedCheckpointLoads) {
  JobConfig c = cfg_of("tests/data/hf_export/mixtral_tiny.toml");
  HfWeightMap map = hf_weight_map(c.model);
  std::vector<HfTensorRef> src;
  auto bufs = random_tensors(map, src, 6);
  for (auto& r : src)
    if (r.name.starts_with("expert_bias")) std::fill(r.data, r.data + shape_numel(r.shape), 0.0f);
  auto hf = export_hf_tensors(map, src);
  const std::string dir = fresh_dir("sharded");
  fs::create_directories(dir);
  std::vector<HfTensorData> a(hf.begin(), hf.begin() + 10), b(hf.begin() + 10, hf.end());
  write_tensors(dir + "/model-00001-of-00002.safetensors", a);
  write_tensors(dir + "/model-00002-of-00002.safetensors", b);
  nlohmann::json idx;
  for (const auto& t : a) idx["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const auto& t : b) idx["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  std::ofstream(dir + "/model.safetensors.index.json") << idx.dump();
  std::vector<HfTensorRef> dst;
  auto back = random_tensors(map, dst, 7);
  load_hf_weights(c.model, open_hf_safetensors(dir), dst);
  for (size_t i = 0; i < src.size(); ++i)
    EXPECT_TRUE(bitwise_equal(src[i].data, dst[i].data, shape_numel(src[i].shape))) << src[i].name;
  fs::remove_all(dir);
  EXPECT_NE(error_of([&] { open_hf_safetensors(dir); }).find("neither model.safetensors"), std::string::npos);
}

TEST(HfExport, ImportErrorsNameTheTensor) {
  JobConfig c = cfg_of("tests/data/hf_export/qwen3_tiny.toml");
  const ModelSpec& s = c.model;
  HfWeightMap map = hf_weight_map(s);
  std::vector<HfTensorRef> src;
  auto bufs = random_tensors(map, src, 10);
  const auto good = export_hf_tensors(map, src);
  const std::string dir = fresh_dir("errors");
  fs::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  auto load = [&](const std::vector<HfTensorData>& v, HfLoadOptions opt = {}) {
    write_tensors(path, v);
    return error_of([&] { load_hf_weights(s, SafetensorsFile::open(path), src, opt); });
  };

  // A missing tensor.
  std::vector<HfTensorData> v;
  for (const auto& t : good)
    if (t.name != "model.layers.1.mlp.experts.3.up_proj.weight") v.push_back(t);
  std::string m = load(v);
  EXPECT_NE(m.find("missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"), std::string::npos) << m;
  EXPECT_NE(m.find("[16, 64]"), std::string::npos) << m;

  // A wrong shape (q_proj stored [in, out], as moetron would).
  v = good;
  for (auto& t : v)
    if (t.name == "model.layers.0.self_attn.q_proj.weight") t.shape = {64, 128};
  m = load(v);
  EXPECT_NE(m.find("'model.layers.0.self_attn.q_proj.weight' has shape [64, 128], expected [128, 64]"),
            std::string::npos)
      << m;

  // Several problems at once, all reported; plus an unexpected tensor.
  v.pop_back();  // lm_head.weight
  HfTensorData extra{"model.layers.2.mlp.gate.weight", {8, 64}, std::vector<float>(8 * 64)};
  v.push_back(extra);
  m = load(v);
  EXPECT_NE(m.find("3 problem(s)"), std::string::npos) << m;
  EXPECT_NE(m.find("missing tensor 'lm_head.weight'"), std::string::npos) << m;
  EXPECT_NE(m.find("unexpected tensor 'model.layers.2.mlp.gate.weight'"), std::string::npos) << m;
  EXPECT_NE(m.find("qwen3_moe"), std::string::npos) << m;
  // allow_unexpected tolerates the extra tensor (e.g. an MTP layer), not the other problems.
  v = good;
  v.push_back(extra);
  HfLoadOptions lenient;
  lenient.allow_unexpected = true;
  EXPECT_EQ(load(v, lenient), "");  // loads
  EXPECT_NE(load(v).find("unexpected tensor"), std::string::npos);

  // An unsupported dtype.
  {
    std::vector<SafetensorsEntry> e;
    std::vector<int32_t> ints(64);
    for (const auto& t : good) {
      if (t.name == "model.norm.weight") e.push_back({t.name, DType::I32, t.shape, ints.data(), 64 * 4});
      else e.push_back({t.name, DType::F32, t.shape, t.data.data(), t.data.size() * 4});
    }
    write_safetensors(path, e);
    m = error_of([&] { load_hf_weights(s, SafetensorsFile::open(path), src); });
    EXPECT_NE(m.find("'model.norm.weight' has dtype I32"), std::string::npos) << m;
  }

  // Destination tensors that do not match the mapping.
  write_tensors(path, good);
  auto dst = src;
  dst[0].shape = {256, 32};
  dst.pop_back();
  m = error_of([&] { load_hf_weights(s, SafetensorsFile::open(path), dst); });
  EXPECT_NE(m.find("moetron tensor 'embed' has shape [256, 32]"), std::string::npos) << m;
  EXPECT_NE(m.find("missing moetron tensor '" + src.back().name + "'"), std::string::npos) << m;

  // A spec no HF format expresses.
  ModelSpec bad = s;
  bad.moe.n_shared_experts = 1;  // qwen3_moe (qk_norm) has no shared experts
  EXPECT_NE(error_of([&] { hf_weight_map(bad); }).find("no shared experts"), std::string::npos);
  fs::remove_all(dir);
}

// ---- multi-token prediction (deepseek_v3, model.mtp_layers) -----------------------------------------
TEST(HfExport, RoundTripBitwiseDeepSeekV3Mtp) {
  roundtrip_model(cfg_of("configs/ds_tiny_mla.toml", {"--model.mtp_layers=2"}), "deepseek_v3", "ds_tiny_mla_mtp2");
  roundtrip_model(cfg_of("configs/ds_tiny_mla.toml", {"--model.mtp_layers=1", "--model.tie_embeddings=true",
                                                      "--model.mtp_loss_weight=0.1"}),
                  "deepseek_v3", "ds_tiny_mla_mtp1_tied");
}

// Export -> import -> the same parameters and the same loss (main and MTP), bitwise. The bias is non-negative,
// so it is exported unshifted and the imported model routes with the same bits.
TEST(HfExport, MtpExportImportGivesTheSameLoss) {
  const JobConfig c = cfg_of("configs/ds_tiny_mla.toml", {"--model.mtp_layers=2"});
  const ModelSpec& s = c.model;
  const int64_t T = 16;
  Model a(s, 1, T), b(s, 1, T);
  a.init_params(uint64_t(c.training.seed));
  for (int i = 0; i < a.n_moe_layers(); ++i) {
    float* e = a.expert_bias(i);
    fill_normal(e, s.moe.n_routed_experts, rng_key(6, "b" + std::to_string(i)), 0, 0, 1);
    for (int64_t j = 0; j < s.moe.n_routed_experts; ++j) e[j] = std::fabs(e[j]);
  }
  EXPECT_EQ(a.n_moe_layers(), int(s.n_moe_layers() + 2));  // the two MTP blocks are MoE
  const std::string dir = fresh_dir("mtp_loss");
  HfExportOptions opt;
  opt.dtype = DType::F32;
  write_hf_model(dir, s, model_tensor_refs(a), opt);
  b.init_params(uint64_t(c.training.seed) + 1);
  const ModelSpec back = load_hf_config(dir + "/config.json");
  EXPECT_EQ(back, s);
  load_hf_weights(back, open_hf_safetensors(dir), model_tensor_refs(b));
  b.sync_weights();  // the packed expert weights (and bf16 copies) from the loaded masters
  EXPECT_TRUE(bitwise_equal(a.param_data(), b.param_data(), a.num_params()));
  std::vector<int32_t> seq(size_t(T + 1));
  for (int64_t t = 0; t <= T; ++t) seq[size_t(t)] = int32_t((t * 53 + 7) % s.vocab_size);
  const ForwardStats fa = a.forward(seq.data(), seq.data() + 1), fb = b.forward(seq.data(), seq.data() + 1);
  EXPECT_EQ(fa.ce_sum, fb.ce_sum);
  ASSERT_EQ(fa.mtp_ce.size(), 2u);
  EXPECT_EQ(fa.mtp_ce, fb.mtp_ce);
  EXPECT_GT(fa.mtp_ce[0], 0.0);
  fs::remove_all(dir);
}

TEST(HfExport, MtpNamesShapesAndValues) {
  const JobConfig c = cfg_of("configs/ds_tiny_mla.toml", {"--model.mtp_layers=1"});
  const ModelSpec& s = c.model;
  const int64_t d = s.d_model, L = s.n_layers;
  HfWeightMap map = hf_weight_map(s);
  std::vector<HfTensorRef> src;
  auto bufs = random_tensors(map, src, 11);
  const auto hf = export_hf_tensors(map, src);
  const std::string h = "model.layers." + std::to_string(L) + ".";
  EXPECT_FALSE(has(hf, "model.layers." + std::to_string(L + 1) + ".enorm.weight"));
  // eh_proj [d, 2d]: row o, column j = the engine's [2d, d] element [j, o]; columns [0, d) take enorm(embedding).
  const auto& eh = find(hf, h + "eh_proj.weight");
  EXPECT_EQ(eh.shape, (Shape{d, 2 * d}));
  const auto& me = find(src, "mtp.0.eh_proj");
  for (int64_t o : {int64_t(0), int64_t(5), d - 1})
    for (int64_t j : {int64_t(0), int64_t(3), d, 2 * d - 1}) EXPECT_EQ(eh.data[size_t(o * 2 * d + j)], me.data[j * d + o]);
  for (const auto& [hn, mn] : std::vector<std::pair<std::string, std::string>>{
           {"enorm.weight", "mtp.0.enorm"}, {"hnorm.weight", "mtp.0.hnorm"}, {"shared_head.norm.weight", "mtp.0.norm"},
           {"embed_tokens.weight", "embed"}, {"shared_head.head.weight", "head"},
           {"input_layernorm.weight", "mtp.0.block.attn_norm"}, {"self_attn.kv_a_layernorm.weight", "mtp.0.block.attn.kv_norm"}}) {
    const auto& t = find(hf, h + hn);
    const auto& m = find(src, mn);
    ASSERT_EQ(int64_t(t.data.size()), shape_numel(m.shape)) << hn;
    EXPECT_TRUE(bitwise_equal(t.data.data(), m.data, shape_numel(m.shape))) << hn;
  }
  // The block is the last layer's kind (MoE here), with the routing bias of MoE layer n_moe_layers() (the MTP
  // blocks are numbered after the main model's), shifted like the others.
  EXPECT_TRUE(has(hf, h + "mlp.experts.0.gate_proj.weight"));
  EXPECT_TRUE(has(hf, h + "mlp.shared_experts.down_proj.weight"));
  const auto& bias = find(hf, h + "mlp.gate.e_score_correction_bias");
  const auto& mb = find(src, "expert_bias." + std::to_string(s.n_moe_layers()));
  EXPECT_EQ(bias.data, v3_bias(mb.data, s.moe.n_routed_experts));
  const auto j = nlohmann::json::parse(to_hf_config_json(s));
  EXPECT_EQ(j["num_nextn_predict_layers"], 1);
  EXPECT_EQ(j["num_hidden_layers"], L);
  EXPECT_EQ(nlohmann::json::parse(to_hf_config_json(cfg_of("configs/ds_tiny_mla.toml").model))["num_nextn_predict_layers"], 0);
}

TEST(HfExport, MtpImportErrorsNameTheTensor) {
  const JobConfig c = cfg_of("configs/ds_tiny_mla.toml", {"--model.mtp_layers=1"});
  const ModelSpec& s = c.model;
  const std::string h = "model.layers." + std::to_string(s.n_layers) + ".";
  HfWeightMap map = hf_weight_map(s);
  std::vector<HfTensorRef> src;
  auto bufs = random_tensors(map, src, 12);
  const auto good = export_hf_tensors(map, src);
  const std::string dir = fresh_dir("mtp_errors");
  fs::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  auto load = [&](const ModelSpec& spec, const std::vector<HfTensorData>& v, HfLoadOptions opt = {}) {
    write_tensors(path, v);
    HfWeightMap mm = hf_weight_map(spec);
    std::vector<HfTensorRef> dst;
    auto keep = random_tensors(mm, dst, 13);
    return error_of([&] { load_hf_weights(spec, SafetensorsFile::open(path), dst, opt); });
  };
  EXPECT_EQ(load(s, good), "");
  // Copies of the embedding and the head that differ from the main ones: refused by name.
  std::vector<HfTensorData> v = good;
  for (auto& t : v)
    if (t.name == h + "embed_tokens.weight") t.data[7] += 1.0f;
    else if (t.name == h + "shared_head.head.weight") t.data[0] = -t.data[0];
  std::string m = load(s, v);
  EXPECT_NE(m.find("2 problem(s)"), std::string::npos) << m;
  EXPECT_NE(m.find("tensor '" + h + "embed_tokens.weight' differs from 'model.embed_tokens.weight' in 1 of"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("(first at 7: "), std::string::npos) << m;
  EXPECT_NE(m.find("tensor '" + h + "shared_head.head.weight' differs from 'lm_head.weight'"), std::string::npos) << m;
  // A missing MTP tensor; the MTP layer of a checkpoint read into a spec without MTP: unexpected (tolerated
  // with allow_unexpected, as for DeepSeek-V3's own checkpoint).
  v.clear();
  for (const auto& t : good)
    if (t.name != h + "eh_proj.weight") v.push_back(t);
  m = load(s, v);
  EXPECT_NE(m.find("missing tensor '" + h + "eh_proj.weight' (expected [64, 128])"), std::string::npos) << m;
  ModelSpec no_mtp = s;
  no_mtp.mtp_layers = 0;
  m = load(no_mtp, good);
  EXPECT_NE(m.find("unexpected tensor '" + h + "eh_proj.weight' [64, 128]"), std::string::npos) << m;
  HfLoadOptions lenient;
  lenient.allow_unexpected = true;
  EXPECT_EQ(load(no_mtp, good, lenient), "");
  // A negative num_nextn_predict_layers.
  auto j = nlohmann::json::parse(to_hf_config_json(s));
  j["num_nextn_predict_layers"] = -1;
  EXPECT_NE(error_of([&] { model_spec_from_hf_json(j.dump(), "cfg.json"); }).find("'num_nextn_predict_layers' must be >= 0"),
            std::string::npos);
  fs::remove_all(dir);
}
