// hf_reference.h (tests only): an independent forward pass written from the Hugging Face modelling code
// of the model types moetron exports (DeepSeek-V1's remote modeling_deepseek.py, transformers'
// modeling_deepseek_v2.py, modeling_deepseek_v3.py, modeling_mixtral.py and modeling_qwen3_moe.py: its
// per-head q_norm / k_norm before RoPE). It reads ONLY config.json and the exported HF tensors by their HF names - never a moetron
// ModelSpec - and applies each type's own rules, the way transformers would:
//   - which config fields the type reads, and what it does with a null (None) there: where transformers
//     would fail to build or run the model (None * int, range(None), calling a shared block it did not
//     create) the reference throws, naming the field;
//   - routing per type: V1 softmax, renormalized only when top_k > 1 and norm_topk_prob; V2 softmax,
//     greedy or group_limited_greedy (group score = max, masked with 0.0), weights * routed_scaling_factor,
//     never renormalized; V3 sigmoid + e_score_correction_bias for selection, group score = sum of the top
//     2 biased scores, masked with 0.0, renormalized when norm_topk_prob, then * routed_scaling_factor;
//     Mixtral softmax over all experts, top-k, renormalized;
//   - MLA q_a_layernorm / kv_a_layernorm with transformers' default eps 1e-6, every other RMSNorm with
//     rms_norm_eps; MLA RoPE de-interleaves q_pe / k_pe, the other types use rotate_half directly;
//   - every tensor's shape as the modules built from the config expect it (transformers' size check);
//   - DeepSeek-V3's MTP layers (num_nextn_predict_layers; decoder layer num_hidden_layers + k - 1 for depth k,
//     with its enorm, hnorm, eh_proj, shared_head and own embed_tokens copy): Forward::mtp_logits.
// It records the config keys it reads and the tensors it uses, so that a test can require that every
// field the exporter writes is one the type reads, and that every tensor written is one it loads.
// Numerics follow moetron's (GEMM operands rounded to bf16 when the model computes in bf16, fp32 router
// logits) so that the comparison with moetron's logits can be tight; accumulation is in double. Not a
// model implementation, not fast.
#pragma once
#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/dtype.h"
#include "moetron/hf_weights.h"

namespace hfref {

using moetron::HfTensorData;
using moetron::Shape;
using Mat = std::vector<double>;
using json = nlohmann::json;

// Where transformers would fail on this config / checkpoint (or the reference does not model it).
struct Fail : moetron::Error {
  using moetron::Error::Error;
};

// config.json access that records every key read. A key the type reads must be present: the reference
// does not guess transformers' defaults.
struct Config {
  const json& j;
  std::string type;
  std::set<std::string> read;

  const json& raw(const std::string& k) {
    read.insert(k);
    if (!j.contains(k)) throw Fail(type + ": config.json has no '" + k + "', which " + type + " reads");
    return j.at(k);
  }
  bool is_null(const std::string& k) { return raw(k).is_null(); }
  int64_t i(const std::string& k, const char* use = "an integer") {
    const json& v = raw(k);
    if (v.is_null()) throw Fail(type + ": '" + k + "' is null, but transformers uses it as " + use);
    if (!v.is_number_integer()) throw Fail(type + ": '" + k + "' is not an integer");
    return v.get<int64_t>();
  }
  double f(const std::string& k) {
    const json& v = raw(k);
    if (!v.is_number()) throw Fail(type + ": '" + k + "' is not a number");
    return v.get<double>();
  }
  bool b(const std::string& k) {
    const json& v = raw(k);
    if (!v.is_boolean()) throw Fail(type + ": '" + k + "' is not a boolean");
    return v.get<bool>();
  }
  std::string s(const std::string& k) {
    const json& v = raw(k);
    if (!v.is_string()) throw Fail(type + ": '" + k + "' is not a string");
    return v.get<std::string>();
  }
  // A field that this type's transformers code ignores but DeepSeek's remote code reads: it must hold
  // the value that gives both the same model.
  template <class T>
  void same_in_remote_code(const std::string& k, const T& want, const char* why) {
    const json& v = raw(k);
    if (v != json(want)) throw Fail(type + ": '" + k + "' = " + v.dump() + " (" + why + ")");
  }
};

enum class Score { Softmax, Sigmoid };
enum class Select { Greedy, GroupMax, GroupTop2Sum };
enum class Norm { Never, WithEps, NoEps };  // renormalize the top-k weights (+1e-20, or exactly)

// What the type's modelling code builds from the config.
struct Rules {
  std::string type;
  int64_t V = 0, d = 0, L = 0, H = 0, Hkv = 0, hd = 0;
  double eps = 0, theta = 0;
  bool tied = false;
  bool mla = false;
  int64_t q_lora = 0, kv_lora = 0, dn = 0, dr = 0, dv = 0;  // q_lora 0: q_proj (None in the config)
  double latent_eps = 1e-6;  // q_a_layernorm / kv_a_layernorm: DeepseekV2/V3RMSNorm's default eps
  bool qk_norm = false;
  int64_t inter = 0;  // dense MLP width
  std::vector<bool> moe_layer;
  std::string ffn = "mlp.";  // mixtral: block_sparse_moe.
  bool mixtral_names = false;
  // MoE (when some layer is MoE)
  int64_t E = 0, K = 0, Fe = 0, Fshared = -1;  // Fshared -1: no shared block
  Score score = Score::Softmax;
  bool bias = false;
  Select select = Select::Greedy;
  int64_t n_group = 1, topk_group = 1;
  Norm norm = Norm::Never;
  double scale = 1.0;
  int64_t mtp = 0;  // deepseek_v3: num_nextn_predict_layers (decoder layers L .. L + mtp - 1)
};

inline Rules parse_rules(Config& c) {
  Rules r;
  r.type = c.s("model_type");
  c.type = r.type;
  const std::string& t = r.type;
  if (t != "deepseek" && t != "deepseek_v2" && t != "deepseek_v3" && t != "mixtral" && t != "qwen3_moe")
    throw Fail("model_type " + t + " is not modelled");
  if (c.s("hidden_act") != "silu") throw Fail(t + ": hidden_act must be silu");
  r.V = c.i("vocab_size"), r.d = c.i("hidden_size"), r.L = c.i("num_hidden_layers");
  r.H = c.i("num_attention_heads"), r.Hkv = c.i("num_key_value_heads");
  r.eps = c.f("rms_norm_eps"), r.theta = c.f("rope_theta"), r.tied = c.b("tie_word_embeddings");
  if (t != "mixtral" && c.b("attention_bias")) throw Fail(t + ": attention_bias = true is not modelled");
  r.moe_layer.assign(size_t(r.L), false);

  if (t == "mixtral") {
    r.hd = c.is_null("head_dim") ? r.d / r.H : c.i("head_dim");
    r.E = c.i("num_local_experts"), r.K = c.i("num_experts_per_tok"), r.Fe = c.i("intermediate_size");
    r.moe_layer.assign(size_t(r.L), true);
    r.ffn = "block_sparse_moe.", r.mixtral_names = true, r.norm = Norm::NoEps;
    return r;
  }
  if (t == "qwen3_moe") {
    r.hd = c.i("head_dim"), r.qk_norm = true, r.inter = c.i("intermediate_size");
    r.E = c.i("num_experts"), r.K = c.i("num_experts_per_tok"), r.Fe = c.i("moe_intermediate_size");
    r.norm = c.b("norm_topk_prob") ? Norm::NoEps : Norm::Never;
    const int64_t step = c.i("decoder_sparse_step");
    std::vector<int64_t> mlp_only = c.raw("mlp_only_layers").get<std::vector<int64_t>>();
    for (int64_t l = 0; l < r.L; ++l)
      r.moe_layer[size_t(l)] = std::count(mlp_only.begin(), mlp_only.end(), l) == 0 && r.E > 0 && (l + 1) % step == 0;
    return r;
  }

  // DeepSeek V1 / V2 / V3
  const int version = t == "deepseek" ? 1 : t == "deepseek_v2" ? 2 : 3;
  r.inter = c.i("intermediate_size");
  const int64_t first_k = c.i("first_k_dense_replace"), freq = c.i("moe_layer_freq");
  bool routed_null = false;
  if (version == 1) {
    r.hd = r.d / r.H;  // DeepseekAttention: head_dim = hidden_size // num_heads
    const bool has_experts = !c.is_null("n_routed_experts");
    for (int64_t l = 0; l < r.L; ++l) r.moe_layer[size_t(l)] = has_experts && l >= first_k && l % freq == 0;
  } else {
    r.mla = true;
    // transformers' V2/V3 decoder layer: MoE at and after first_k_dense_replace, nothing else decides.
    // (DeepSeek's remote code also reads n_routed_experts = null as "no MoE layers"; read it here so
    // that the two agree below.)
    for (int64_t l = 0; l < r.L; ++l) r.moe_layer[size_t(l)] = l >= first_k;
    routed_null = c.is_null("n_routed_experts");
    if (version == 3) {
      // The MTP layers L + k (transformers builds none of them; DeepSeek's and the serving engines' MTP modules
      // build a decoder layer with that index): MoE when n_routed_experts is set and the index >= first_k.
      r.mtp = c.i("num_nextn_predict_layers");
      if (r.mtp < 0) throw Fail(t + ": num_nextn_predict_layers < 0");
      for (int64_t k = 0; k < r.mtp; ++k) r.moe_layer.push_back(!routed_null && r.L + k >= first_k);
    }
    c.same_in_remote_code("moe_layer_freq", 1, "transformers ignores it; DeepSeek's remote code skips layers");
    if (r.Hkv != r.H) throw Fail(t + ": num_key_value_heads != num_attention_heads breaks MLA's repeat_kv");
    r.q_lora = c.is_null("q_lora_rank") ? 0 : c.i("q_lora_rank");
    r.kv_lora = c.i("kv_lora_rank"), r.dn = c.i("qk_nope_head_dim"), r.dr = c.i("qk_rope_head_dim");
    r.dv = c.i("v_head_dim");
  }
  if (std::none_of(r.moe_layer.begin(), r.moe_layer.end(), [](bool x) { return x; })) return r;

  if (routed_null && std::any_of(r.moe_layer.begin(), r.moe_layer.begin() + r.L, [](bool x) { return x; }))
    throw Fail(t + ": 'n_routed_experts' is null, but layers >= first_k_dense_replace build an MoE block "
                   "(range(None))");
  r.E = c.i("n_routed_experts"), r.K = c.i("num_experts_per_tok"), r.Fe = c.i("moe_intermediate_size");
  if (version == 1) {
    if (c.s("scoring_func") != "softmax") throw Fail(t + ": scoring_func other than softmax: NotImplementedError");
    const bool norm = c.b("norm_topk_prob");  // MoEGate.__init__ reads it; used only when top_k > 1
    r.norm = r.K > 1 && norm ? Norm::WithEps : Norm::Never;
    r.Fshared = c.is_null("n_shared_experts") ? -1 : r.Fe * c.i("n_shared_experts");
    return r;
  }
  if (c.is_null("n_shared_experts"))
    throw Fail(t + ": 'n_shared_experts' is null: " +
               (version == 3 ? std::string("moe_intermediate_size * None raises TypeError")
                             : std::string("the MoE block calls a shared_experts it never created")));
  r.Fshared = r.Fe * c.i("n_shared_experts");
  r.scale = c.f("routed_scaling_factor");
  if (version == 2) {
    c.same_in_remote_code("scoring_func", "softmax", "transformers' V2 always uses softmax");
    c.same_in_remote_code("norm_topk_prob", false, "transformers' V2 never renormalizes; remote code would");
    const std::string method = c.s("topk_method");
    if (method == "greedy") {
      r.select = Select::Greedy;
    } else if (method == "group_limited_greedy") {
      r.select = Select::GroupMax, r.n_group = c.i("n_group"), r.topk_group = c.i("topk_group");
    } else {
      throw Fail(t + ": topk_method " + method + " leaves topk_idx undefined in transformers' V2 gate");
    }
  } else {
    c.same_in_remote_code("scoring_func", "sigmoid", "transformers' V3 always uses sigmoid");
    c.same_in_remote_code("topk_method", "noaux_tc", "transformers' V3 always routes like noaux_tc");
    r.score = Score::Sigmoid, r.bias = true, r.select = Select::GroupTop2Sum;
    r.n_group = c.i("n_group"), r.topk_group = c.i("topk_group");
    if (r.E / r.n_group < 2) throw Fail(t + ": groups of one expert: topk(2) within a group fails");
    r.norm = c.b("norm_topk_prob") ? Norm::WithEps : Norm::Never;
  }
  return r;
}

inline double r16(double v) { return double(moetron::round_bf16(float(v))); }

struct Forward {
  const Rules& R;
  bool bf16;  // round GEMM operands to bf16 (the model's compute dtype)
  std::map<std::string, const HfTensorData*> t;
  mutable std::set<std::string> used;

  Forward(const Rules& rules, const std::vector<HfTensorData>& tensors, bool bf16_operands)
      : R(rules), bf16(bf16_operands) {
    for (const auto& x : tensors) t[x.name] = &x;
  }
  const HfTensorData& w(const std::string& n, const Shape& want) const {
    auto it = t.find(n);
    if (it == t.end()) throw Fail("no HF tensor " + n + " (transformers would initialize it randomly)");
    if (it->second->shape != want)
      throw Fail("size mismatch for " + n + ": checkpoint " + moetron::shape_str(it->second->shape) +
                 ", model " + moetron::shape_str(want));
    used.insert(n);
    return *it->second;
  }
  // y[N, out] = x[N, in] . W^T (W [out, in]); with bf16 operands (and not the router) both are rounded.
  Mat linear(const Mat& x, int64_t N, const HfTensorData& W, bool router = false) const {
    const bool round = bf16 && !router;
    const int64_t out = W.shape[0], in = W.shape[1];
    Mat y(static_cast<size_t>(N * out), 0.0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < out; ++o) {
        double acc = 0;
        for (int64_t i = 0; i < in; ++i) {
          const double a = x[size_t(n * in + i)], b = W.data[size_t(o * in + i)];
          acc += round ? r16(a) * r16(b) : a * b;
        }
        y[size_t(n * out + o)] = acc;
      }
    return y;
  }
  static Mat rmsnorm(const Mat& x, int64_t N, const HfTensorData& W, double eps) {
    const int64_t D = W.shape[0];
    Mat y(x.size());
    for (int64_t n = 0; n < N; ++n) {
      double ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += x[size_t(n * D + i)] * x[size_t(n * D + i)];
      const double rs = 1.0 / std::sqrt(ss / double(D) + eps);
      for (int64_t i = 0; i < D; ++i) y[size_t(n * D + i)] = x[size_t(n * D + i)] * rs * W.data[size_t(i)];
    }
    return y;
  }
  // apply_rotary_pos_emb on v[0:R] at position p; interleaved = DeepSeek MLA's de-interleave first.
  void rope(double* v, int64_t Rd, int64_t p, bool interleaved) const {
    std::vector<double> x(v, v + Rd);
    if (interleaved)
      for (int64_t j = 0; j < Rd / 2; ++j) x[size_t(j)] = v[2 * j], x[size_t(j + Rd / 2)] = v[2 * j + 1];
    for (int64_t k = 0; k < Rd; ++k) {
      const double ang = double(p) * std::pow(R.theta, -2.0 * double(k % (Rd / 2)) / double(Rd));
      const double rot = k < Rd / 2 ? -x[size_t(k + Rd / 2)] : x[size_t(k - Rd / 2)];
      v[k] = x[size_t(k)] * std::cos(ang) + rot * std::sin(ang);
    }
  }
  Mat attention(const Mat& h, int64_t T, const std::string& p) const {
    const int64_t H = R.H, d = R.d;
    int64_t Hkv, Dqk, Dv;
    Mat q, k, v;  // [T, H(kv), D]
    if (!R.mla) {
      const int64_t hd = R.hd;
      Hkv = R.Hkv, Dqk = Dv = hd;
      q = linear(h, T, w(p + "q_proj.weight", {H * hd, d}));
      k = linear(h, T, w(p + "k_proj.weight", {Hkv * hd, d}));
      v = linear(h, T, w(p + "v_proj.weight", {Hkv * hd, d}));
      if (R.qk_norm) {  // Qwen3MoeAttention: RMSNorm over each head's head_dim (eps rms_norm_eps), before RoPE
        q = rmsnorm(q, T * H, w(p + "q_norm.weight", {hd}), R.eps);
        k = rmsnorm(k, T * Hkv, w(p + "k_norm.weight", {hd}), R.eps);
      }
      for (int64_t s = 0; s < T; ++s) {
        for (int64_t hh = 0; hh < H; ++hh) rope(&q[size_t((s * H + hh) * hd)], hd, s, false);
        for (int64_t hh = 0; hh < Hkv; ++hh) rope(&k[size_t((s * Hkv + hh) * hd)], hd, s, false);
      }
    } else {
      const int64_t dn = R.dn, dr = R.dr, rkv = R.kv_lora;
      Hkv = H, Dqk = dn + dr, Dv = R.dv;
      if (R.q_lora > 0) {
        Mat cq = rmsnorm(linear(h, T, w(p + "q_a_proj.weight", {R.q_lora, d})), T,
                         w(p + "q_a_layernorm.weight", {R.q_lora}), R.latent_eps);
        q = linear(cq, T, w(p + "q_b_proj.weight", {H * Dqk, R.q_lora}));
      } else {
        q = linear(h, T, w(p + "q_proj.weight", {H * Dqk, d}));
      }
      Mat ckv = linear(h, T, w(p + "kv_a_proj_with_mqa.weight", {rkv + dr, d}));
      Mat c(static_cast<size_t>(T * rkv));
      for (int64_t s = 0; s < T; ++s)
        for (int64_t i = 0; i < rkv; ++i) c[size_t(s * rkv + i)] = ckv[size_t(s * (rkv + dr) + i)];
      Mat kv = linear(rmsnorm(c, T, w(p + "kv_a_layernorm.weight", {rkv}), R.latent_eps), T,
                      w(p + "kv_b_proj.weight", {H * (dn + Dv), rkv}));
      k.assign(static_cast<size_t>(T * H * Dqk), 0.0);
      v.assign(static_cast<size_t>(T * H * Dv), 0.0);
      for (int64_t s = 0; s < T; ++s) {
        double* pe = &ckv[size_t(s * (rkv + dr) + rkv)];
        rope(pe, dr, s, true);
        for (int64_t hh = 0; hh < H; ++hh) {
          rope(&q[size_t((s * H + hh) * Dqk + dn)], dr, s, true);
          const double* src = &kv[size_t((s * H + hh) * (dn + Dv))];
          for (int64_t i = 0; i < dn; ++i) k[size_t((s * H + hh) * Dqk + i)] = src[i];
          for (int64_t i = 0; i < dr; ++i) k[size_t((s * H + hh) * Dqk + dn + i)] = pe[i];
          for (int64_t i = 0; i < Dv; ++i) v[size_t((s * H + hh) * Dv + i)] = src[dn + i];
        }
      }
    }
    Mat o(static_cast<size_t>(T * H * Dv), 0.0);
    const double scale = 1.0 / std::sqrt(double(Dqk));
    for (int64_t hh = 0; hh < H; ++hh) {
      const int64_t kh = hh / (H / Hkv);
      for (int64_t s = 0; s < T; ++s) {
        std::vector<double> sc(static_cast<size_t>(s + 1));
        double mx = -1e300, sum = 0;
        for (int64_t u = 0; u <= s; ++u) {
          double dot = 0;
          for (int64_t i = 0; i < Dqk; ++i) dot += q[size_t((s * H + hh) * Dqk + i)] * k[size_t((u * Hkv + kh) * Dqk + i)];
          sc[size_t(u)] = dot * scale, mx = std::max(mx, dot * scale);
        }
        for (auto& x : sc) x = std::exp(x - mx), sum += x;
        for (int64_t u = 0; u <= s; ++u)
          for (int64_t i = 0; i < Dv; ++i)
            o[size_t((s * H + hh) * Dv + i)] += sc[size_t(u)] / sum * v[size_t((u * Hkv + kh) * Dv + i)];
      }
    }
    return linear(o, T, w(p + "o_proj.weight", {d, H * Dv}));
  }
  Mat swiglu(const Mat& h, int64_t N, const std::string& pre, int64_t F, const char* g, const char* u,
             const char* dn) const {
    Mat a = linear(h, N, w(pre + g + ".weight", {F, R.d})), b = linear(h, N, w(pre + u + ".weight", {F, R.d}));
    for (size_t i = 0; i < a.size(); ++i) a[i] = a[i] / (1.0 + std::exp(-a[i])) * b[i];
    return linear(a, N, w(pre + dn + ".weight", {R.d, F}));
  }
  // The experts of one token, in selection order, and their weights.
  void route(const double* lg, const HfTensorData* bias, std::vector<int64_t>& idx, std::vector<double>& wt) const {
    const int64_t E = R.E, K = R.K;
    std::vector<double> sc(static_cast<size_t>(E));
    if (R.score == Score::Sigmoid) {
      for (int64_t e = 0; e < E; ++e) sc[size_t(e)] = 1.0 / (1.0 + std::exp(-lg[e]));
    } else {
      double mx = *std::max_element(lg, lg + E), sum = 0;
      for (int64_t e = 0; e < E; ++e) sc[size_t(e)] = std::exp(lg[e] - mx), sum += sc[size_t(e)];
      for (auto& x : sc) x /= sum;
    }
    std::vector<double> choice = sc;
    if (bias)
      for (int64_t e = 0; e < E; ++e) choice[size_t(e)] += bias->data[size_t(e)];
    if (R.select != Select::Greedy) {
      const int64_t G = R.n_group, per = E / G;
      std::vector<std::pair<double, int64_t>> gs;
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> m(choice.begin() + g * per, choice.begin() + (g + 1) * per);
        std::sort(m.rbegin(), m.rend());
        gs.push_back({R.select == Select::GroupMax ? m[0] : m[0] + m[1], g});
      }
      std::stable_sort(gs.begin(), gs.end(), [](auto& a, auto& b) { return a.first > b.first; });
      std::vector<bool> keep(static_cast<size_t>(G), false);
      for (int64_t i = 0; i < R.topk_group; ++i) keep[size_t(gs[size_t(i)].second)] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[size_t(e / per)]) choice[size_t(e)] = 0.0;  // masked_fill(~mask, 0.0)
    }
    idx.resize(size_t(E));
    for (int64_t e = 0; e < E; ++e) idx[size_t(e)] = e;
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return choice[size_t(a)] > choice[size_t(b)]; });
    idx.resize(size_t(K));
    wt.resize(size_t(K));
    double sum = 0;
    for (int64_t j = 0; j < K; ++j) wt[size_t(j)] = sc[size_t(idx[size_t(j)])], sum += wt[size_t(j)];
    for (auto& x : wt) {
      if (R.norm == Norm::WithEps) x /= sum + 1e-20;
      if (R.norm == Norm::NoEps) x /= sum;
      x *= R.scale;
    }
  }
  Mat moe(const Mat& h, int64_t T, const std::string& p) const {
    const int64_t d = R.d, E = R.E;
    Mat logits = linear(h, T, w(p + "gate.weight", {E, d}), true);  // fp32 router
    const HfTensorData* bias = R.bias ? &w(p + "gate.e_score_correction_bias", {E}) : nullptr;
    Mat y(static_cast<size_t>(T * d), 0.0);
    std::vector<int64_t> idx;
    std::vector<double> wt;
    for (int64_t s = 0; s < T; ++s) {
      route(&logits[size_t(s * E)], bias, idx, wt);
      Mat hs(h.begin() + s * d, h.begin() + (s + 1) * d);
      for (size_t j = 0; j < idx.size(); ++j) {
        const std::string ep = p + "experts." + std::to_string(idx[j]) + ".";
        Mat ye = R.mixtral_names ? swiglu(hs, 1, ep, R.Fe, "w1", "w3", "w2")
                                 : swiglu(hs, 1, ep, R.Fe, "gate_proj", "up_proj", "down_proj");
        for (int64_t i = 0; i < d; ++i) y[size_t(s * d + i)] += wt[j] * ye[size_t(i)];
      }
    }
    if (R.Fshared >= 0) {
      Mat ys = swiglu(h, T, p + "shared_experts.", R.Fshared, "gate_proj", "up_proj", "down_proj");
      for (size_t i = 0; i < y.size(); ++i) y[i] += ys[i];
    }
    // Load every expert, used by these tokens or not (transformers loads them all).
    for (int64_t e = 0; e < E; ++e) {
      const std::string ep = p + "experts." + std::to_string(e) + ".";
      for (const char* n : R.mixtral_names ? std::vector<const char*>{"w1", "w3"} : std::vector<const char*>{"gate_proj", "up_proj"})
        w(ep + n + ".weight", {R.Fe, d});
      w(ep + (R.mixtral_names ? "w2" : "down_proj") + ".weight", {d, R.Fe});
    }
    return y;
  }
  Mat embed(const std::vector<int32_t>& tok, const std::string& name) const {
    const int64_t T = int64_t(tok.size()), d = R.d;
    const auto& emb = w(name, {R.V, d});
    Mat x(static_cast<size_t>(T * d));
    for (int64_t s = 0; s < T; ++s)
      for (int64_t i = 0; i < d; ++i) x[size_t(s * d + i)] = emb.data[size_t(tok[size_t(s)] * d + i)];
    return x;
  }
  // One decoder layer (index l: its MoE-ness) on x [T, d] in place; p = "model.layers.<l>.".
  void layer(Mat& x, int64_t T, int64_t l, const std::string& p) const {
    const int64_t d = R.d;
    Mat a = attention(rmsnorm(x, T, w(p + "input_layernorm.weight", {d}), R.eps), T, p + "self_attn.");
    for (size_t i = 0; i < x.size(); ++i) x[i] += a[i];
    Mat h = rmsnorm(x, T, w(p + "post_attention_layernorm.weight", {d}), R.eps);
    Mat f = R.moe_layer[size_t(l)] ? moe(h, T, p + R.ffn)
                                   : swiglu(h, T, p + "mlp.", R.inter, "gate_proj", "up_proj", "down_proj");
    for (size_t i = 0; i < x.size(); ++i) x[i] += f[i];
  }
  // The last decoder layer's output (before model.norm), [T, d].
  Mat hidden(const std::vector<int32_t>& tok) const {
    const int64_t T = int64_t(tok.size());
    Mat x = embed(tok, "model.embed_tokens.weight");
    for (int64_t l = 0; l < R.L; ++l) layer(x, T, l, "model.layers." + std::to_string(l) + ".");
    return x;
  }
  Mat logits(const std::vector<int32_t>& tok) const {
    const int64_t T = int64_t(tok.size()), d = R.d;
    Mat hf = rmsnorm(hidden(tok), T, w("model.norm.weight", {d}), R.eps);
    return linear(hf, T, w(R.tied ? "model.embed_tokens.weight" : "lm_head.weight", {R.V, d}));
  }
  // DeepSeek-V3's multi-token prediction (its report, section 2.2; num_nextn_predict_layers = D, depth k the
  // decoder layer L + k - 1, which uses its OWN copies embed_tokens and shared_head.head):
  //   h^0 = hidden(tok) (the main model's last layer output, before model.norm)
  //   h'  = eh_proj( cat[ enorm(embed_tokens(t_{i+k})), hnorm(h^{k-1}_i) ] )     (the embedding FIRST)
  //   h^k = decoder layer L + k - 1 (h')       logits_k = shared_head.head(shared_head.norm(h^k))
  // over positions i < T - k. Returns logits [T - depth, V] of depth `depth` (1 .. D). hidden_first = true swaps
  // the two halves of the concatenation (a wrong reading, for tests).
  Mat mtp_logits(const std::vector<int32_t>& tok, int64_t depth, bool hidden_first = false) const {
    const int64_t T = int64_t(tok.size()), d = R.d;
    if (depth < 1 || depth > R.mtp) throw Fail("no MTP depth " + std::to_string(depth));
    Mat h = hidden(tok);
    Mat lg;
    for (int64_t k = 1; k <= depth; ++k) {
      const int64_t Tk = T - k, l = R.L + k - 1;
      const std::string p = "model.layers." + std::to_string(l) + ".";
      h.resize(size_t(Tk * d));  // causal: the first T - k positions do not depend on the later ones
      Mat e = rmsnorm(embed(std::vector<int32_t>(tok.begin() + k, tok.end()), p + "embed_tokens.weight"), Tk,
                      w(p + "enorm.weight", {d}), R.eps);
      Mat hn = rmsnorm(h, Tk, w(p + "hnorm.weight", {d}), R.eps);
      Mat cat(static_cast<size_t>(Tk * 2 * d));
      for (int64_t s = 0; s < Tk; ++s)
        for (int64_t i = 0; i < d; ++i) {
          cat[size_t(s * 2 * d + (hidden_first ? d : 0) + i)] = e[size_t(s * d + i)];
          cat[size_t(s * 2 * d + (hidden_first ? 0 : d) + i)] = hn[size_t(s * d + i)];
        }
      h = linear(cat, Tk, w(p + "eh_proj.weight", {d, 2 * d}));
      layer(h, Tk, l, p);
      if (k == depth)
        lg = linear(rmsnorm(h, Tk, w(p + "shared_head.norm.weight", {d}), R.eps), Tk,
                    w(p + "shared_head.head.weight", {R.V, d}));
    }
    return lg;
  }
};

}  // namespace hfref
