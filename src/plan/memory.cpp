// memory.cpp: the planner's memory projection (plan/memory.h): parameters by divisor and precision recipe,
// activations from the shared accounting's sharded terms times the simulator's in-flight sets, comm buffers
// and workspace, and the verdict. Not a step-time model.
#include "moetron/plan/memory.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "moetron/accounting.h"
#include "moetron/check.h"
#include "moetron/muon_params.h"
#include "moetron/plan/pipeline.h"

namespace moetron::plan {

Recipe recipe_named(const std::string& name, const JobConfig& c) {
  Recipe r;
  r.name = name;
  if (name == "megatron") return r;  // bf16 params, fp32 main grads, fp32 main params, fp32 moments
  if (name == "engine") {
    // moetron's trainer: fp32 masters are the parameters; bf16 compute keeps a bf16 copy of them.
    const bool bf16 = c.training.compute_dtype != ComputeDtype::FP32;
    r.param = 4, r.grad = 4, r.main = 0, r.moment = 4, r.compute_copy = bf16 ? 2 : 0;
    r.expert_packed = 2 * (bf16 ? 2 : 4);
    r.act_bytes = 4, r.gemm_bytes = bf16 ? 2 : 4;
    r.engine_buffers = true;
    return r;
  }
  MT_FAIL("plan", "unknown precision recipe '", name, "' (known: megatron, engine)");
}

std::string verdict_for(double bytes, double hbm, double margin) {
  if (bytes <= (1.0 - margin) * hbm) return "FITS";
  if (bytes <= hbm) return "AT-RISK";
  return "OOM";
}

namespace {

// Parameter elements of one layer by divisor (before dividing).
struct ParamSplit {
  double tp_sharded = 0, replicated = 0, experts = 0;
  double aux_free_bias = 0;  // the aux-free routing bias: fp32 state beside the parameters, not trained
  // optimizer.name = "muon": the parts of tp_sharded and replicated Muon updates (one moment; muon_params.h). The
  // routed experts are all Muon's.
  double muon_tp_sharded = 0, muon_replicated = 0;
};

ParamSplit split_layer(const ModelSpec& s, int64_t layer) {
  const LayerParams lp = layer_params(s, layer);
  ParamSplit p;
  const auto& at = s.attn;
  const double d = double(s.d_model);
  double attn_rep = 0;  // attention weights every tp rank holds whole
  if (at.type == AttnType::MLA) {
    if (at.q_lora_rank > 0) attn_rep += d * double(at.q_lora_rank) + double(at.q_lora_rank);
    attn_rep += d * double(at.kv_lora_rank + at.qk_rope_head_dim) + double(at.kv_lora_rank);
  } else if (at.qk_norm) {
    attn_rep += 2.0 * double(at.head_dim);
  }
  if (lp.routed_experts > 0 && s.moe.load_balance == LoadBalance::AuxFree)
    p.aux_free_bias = double(s.moe.n_routed_experts);
  p.replicated = attn_rep + double(lp.norms + lp.router) - p.aux_free_bias;
  p.tp_sharded = double(lp.attention) - attn_rep + double(lp.dense_mlp + lp.shared_experts);
  p.experts = double(lp.routed_experts);
  const MuonLayerNumel mn = muon_layer_numel(s, layer);
  p.muon_tp_sharded = double(mn.sliced), p.muon_replicated = double(mn.replicated);
  return p;
}

// Module of an accounting term, for the breakdown.
const char* module_of(const std::string& t) {
  auto starts = [&](const char* p) { return t.rfind(p, 0) == 0; };
  if (starts("attn_norm") || starts("ffn_norm") || starts("final_norm")) return "norms";
  if (starts("attn")) return "attention";
  if (starts("router")) return "router";
  if (starts("moe")) return "routed_experts";
  if (starts("shared")) return "shared_experts";
  if (starts("mlp")) return "mlp";
  if (starts("loss")) return "loss";
  if (starts("embed")) return "embedding";
  if (starts("layer.input")) return "checkpointed_inputs";
  return "other";
}

struct BytesSum {
  static void add(void* ctx, const char*, double b) { *static_cast<double*>(ctx) += b; }
};

struct ModuleSum {
  std::map<std::string, double> by;
  static void add(void* ctx, const char* name, double b) { static_cast<ModuleSum*>(ctx)->by[module_of(name)] += b; }
};

// The terms that hold one entry per routed row a rank computes (accounting.h layer_terms_all): they follow the
// routing imbalance under EP.
struct RoutedRows {
  double bytes = 0;
  static void add(void* ctx, const char* name, double b) {
    const std::string_view t(name);
    if (t == "moe.x" || t == "moe.gate_up" || t == "moe.act" || t == "moe.y" || t == "moe.w13.x_fp8" ||
        t == "moe.w2.x_fp8")
      static_cast<RoutedRows*>(ctx)->bytes += b;
  }
};

// The routed rows a rank holds over the balanced count. A GPU framework sizes them by the busiest rank's rows
// (PlanOptions::ep_imbalance); the engine starts its buffers at the balanced count and grows them by at least a
// quarter when a dispatch brings more (src/model/model_ep.cpp ensure_rows), so any excess holds at least 1.25.
double held_rows_factor(const Layout& l, const PlanOptions& o) {
  const double imb = l.ep > 1 ? std::max(1.0, o.ep_imbalance) : 1.0;
  if (imb <= 1.0) return 1.0;
  return o.recipe.engine_buffers ? std::max(imb, 1.25) : imb;
}

constexpr double kGemmWorkspace = 32.0 * 1024 * 1024;  // cuBLAS: 32 MiB recommended workspace on Hopper (cuBLAS docs, cublasSetWorkspace)

}  // namespace

ActivationCheckpointSpec plan_checkpointing(const JobConfig& c, const Layout& l) {
  if (!c.activation_checkpoint.stage_ids.empty()) return resolve_checkpointing(apply_layout(c, l));
  ActivationCheckpointSpec ac = c.activation_checkpoint;
  ac.mode = l.recompute;
  ac.modules = l.recompute_modules;
  if (ac.mode == AcMode::None) ac.layer_ids.clear();
  return ac;
}

namespace {

// What the activation and parameter passes read: the job, the layout, the options and the figures derived once.
struct MemCtx {
  const JobConfig& c;
  const Layout& l;
  const PlanOptions& o;
  const StagePlan& sp;
  ActivationCheckpointSpec ac;
  ActShard sh;
  double B = 0, S = 0;  // micro-batch rows, sequence length
  double a = 0, g = 0;  // activation and GEMM-input element bytes (engine recipe: g = the compute dtype's, 2 or 4)
  Fp8CachePlan f8;      // the engine's cached FP8 activations (replacing their copies in its terms)
  double held = 1;      // routed rows held over the balanced count
  // The engine recipe under tensor parallelism: its layer sets are priced as it allocates them
  // (accounting.h engine_tp_layer_bytes), not by the term list's sharding convention.
  bool engine_tp = false;
};

// The activation bytes of one layer kind (dense / MoE, recompute on / off): kept, and when fully recomputed all
// its terms (the re-materialization); by module with the breakdown.
struct LayerKind {
  bool shared_counted = false;
  bool have = false;
  double bytes = 0, all = 0;
  ModuleSum mods;
};

// The engine's layer under TP (engine_tp_layer_bytes): its whole set, or with full recompute its input alone and
// the set re-materialized; the routed rows scaled to the held rows.
void price_engine_tp_kind(const MemCtx& x, bool moe, bool on, LayerKind& k) {
  const ModelSpec& s = x.c.model;
  const double N = x.B * x.S / double(x.sh.cp), tp = double(x.sh.tp);
  const double held = moe ? (x.held - 1.0) * engine_tp_routed_row_bytes(s, N, tp, int64_t(x.g)) : 0.0;
  if (x.ac.mode == AcMode::Full && on) {
    k.bytes = N / tp * double(s.d_model) * 4;
    k.all = engine_tp_layer_bytes(s, moe, N, tp, int64_t(x.g), false) + held;
  } else {
    k.bytes = engine_tp_layer_bytes(s, moe, N, tp, int64_t(x.g)) + held;
  }
  if (x.o.detail) k.mods.by[x.ac.mode == AcMode::Full && on ? "checkpointed_inputs" : "engine_tp_layer"] += k.bytes;
}

void price_kind(const MemCtx& x, int layer, bool moe, bool on, LayerKind& k) {
  const ModelSpec& s = x.c.model;
  const PlanOptions& o = x.o;
  k.have = true;
  if (x.engine_tp) return price_engine_tp_kind(x, moe, on, k);
  if (o.detail) {
    sharded_layer_terms(s, layer, x.B, x.S, x.a, x.g, x.ac, x.sh, &ModuleSum::add, &k.mods, x.f8);
    for (const auto& [name, v] : k.mods.by) k.bytes += v;
  } else {
    k.bytes = sharded_layer_bytes(s, layer, x.B, x.S, x.a, x.g, x.ac, x.sh, x.f8);
  }
  if (moe && x.held > 1.0) {  // the routed-row terms the layer keeps, scaled to the held rows
    RoutedRows rr;
    sharded_layer_terms(s, layer, x.B, x.S, x.a, x.g, x.ac, x.sh, &RoutedRows::add, &rr, x.f8);
    k.bytes += (x.held - 1.0) * rr.bytes;
    if (o.detail) k.mods.by["routed_experts"] += (x.held - 1.0) * rr.bytes;
  }
  if (x.ac.mode == AcMode::Full && on) k.all = sharded_layer_bytes_all(s, layer, x.B, x.S, x.a, x.g, x.sh, x.f8);
  if (o.recipe.engine_buffers) {  // the engine's own, for the tokens a rank holds (its 1/cp of every sequence)
    const double extra = engine_activation_extras(s, layer, x.B * x.S / double(x.sh.cp), x.ac, int64_t(x.g), x.f8);
    k.bytes += extra;
    if (o.detail) k.mods.by["engine_buffers"] += extra;
  }
}

// One micro-batch's activations per stage (with the breakdown, by module), the largest full-recompute
// re-materialization, and the engine's shared re-materialization sets.
struct StageActivations {
  std::vector<double> bytes;
  std::vector<ModuleSum> mods;
  double transient = 0;      // the largest full-recompute re-materialization
  double engine_shared = 0;  // engine, full recompute: the shared re-materialization sets
};

StageActivations stage_activations(const MemCtx& x) {
  const ModelSpec& s = x.c.model;
  const PlanOptions& o = x.o;
  const int n_stages = x.sp.layout.n_stages;
  StageActivations out;
  out.bytes.assign(static_cast<size_t>(n_stages), 0.0);
  out.mods.resize(static_cast<size_t>(n_stages));
  // A layer's terms depend on its kind (dense / MoE) and on whether recompute applies: four cases at most.
  const double d_model = double(s.d_model);
  LayerKind kinds[2][2];
  for (int st = 0; st < n_stages; ++st) {
    for_each_layer_group(x.sp, s, x.ac, st, [&](int layer, bool moe, bool on, int count) {
      LayerKind& k = kinds[moe ? 1 : 0][on ? 1 : 0];
      if (!k.have) price_kind(x, layer, moe, on, k);
      out.bytes[size_t(st)] += count * k.bytes;
      if (o.recipe.engine_buffers && x.ac.mode == AcMode::Full && on && !k.shared_counted) {
        // The engine re-materializes into one buffer set per layer kind, allocated for the whole run: it counts as
        // activations (held), not as a transient.
        k.shared_counted = true;
        const ActivationCheckpointSpec none;
        const int64_t cb = int64_t(x.g);
        out.engine_shared += x.engine_tp ? k.all
                                         : k.all + engine_activation_extras(s, layer, x.B * x.S, none, cb, x.f8) -
                                               x.B * x.S * d_model * x.a;
      }
      if (o.detail)
        for (const auto& [name, v] : k.mods.by) out.mods[size_t(st)].by[name] += count * v;
      out.transient = std::max(out.transient, k.all);
    });
    const bool first = x.sp.first[size_t(st)], last = x.sp.last[size_t(st)];
    if (last && s.mtp_layers > 0) {
      // The MTP depths on the last stage (docs/model.md, "Multi-token prediction"): each a block of the last layer's
      // kind (block n_layers + k for the recompute choice), and the depth's own buffers: the engine's (model_mtp.cpp:
      // its input h^{k-1} and embedding rows fp32, two rstd, the [enorm | hnorm] rows in the compute dtype, dL/dh^k
      // fp32); another recipe's the two norm inputs and the 2d-wide eh_proj input in the activation dtype.
      const bool moe_last = s.is_moe_layer(s.n_layers - 1);
      // Under TP the engine's are the rank's sequence-parallel rows (N / tp).
      const double N = x.B * x.S / double(x.sh.cp), Nr = x.engine_tp ? N / double(x.sh.tp) : N;
      const double own = x.o.recipe.engine_buffers ? Nr * d_model * (12 + 2 * x.g) + Nr * 8 : N * d_model * 4 * x.a;
      for (int64_t k = 0; k < s.mtp_layers; ++k) {
        const bool on = x.ac.applies_to(s.n_layers + k);
        LayerKind& kd = kinds[moe_last ? 1 : 0][on ? 1 : 0];
        if (!kd.have) price_kind(x, int(s.n_layers - 1), moe_last, on, kd);
        out.bytes[size_t(st)] += kd.bytes + own;
        if (o.detail) {
          for (const auto& [name, v] : kd.mods.by) out.mods[size_t(st)].by[name] += v;
          out.mods[size_t(st)].by["mtp"] += own;
        }
        out.transient = std::max(out.transient, kd.all);
      }
    }
    if (x.engine_tp) {  // the engine's final norm under TP; its vocabulary-parallel loss is fused (no logits kept)
      if (last) {
        const double fn = engine_tp_final_norm_bytes(s, x.B * x.S / double(x.sh.cp), double(x.sh.tp), int64_t(x.g));
        out.bytes[size_t(st)] += fn;
        if (o.detail) out.mods[size_t(st)].by["norms"] += fn;
      }
    } else if (o.detail) {
      ModuleSum outside;
      sharded_outside_terms(s, x.B, x.S, x.a, x.g, x.sh, o.fused_loss, first, last, &ModuleSum::add, &outside);
      for (const auto& [name, v] : outside.by) out.bytes[size_t(st)] += v, out.mods[size_t(st)].by[name] += v;
    } else {  // without the breakdown: the sum alone, no module map
      sharded_outside_terms(s, x.B, x.S, x.a, x.g, x.sh, o.fused_loss, first, last, &BytesSum::add,
                            &out.bytes[size_t(st)]);
    }
  }
  return out;
}

// The parameters of one pipeline rank's stages, by divisor (before dividing), and the largest FSDP unit.
struct RankParams {
  ParamSplit ps;
  double largest_unit = 0;  // elements on one GPU
  bool moe_here = false;
  int moe_layers = 0;              // MoE layers on this rank
  bool largest_unit_moe = false;   // the largest FSDP unit is a MoE layer
};

// One layer's parameter split per kind (dense, MoE), priced at the first layer of that kind met.
struct SplitCache {
  ParamSplit split[2];
  bool have[2] = {false, false};
};

RankParams rank_params(const MemCtx& x, SplitCache& cache, RankMemory& rm) {
  const ModelSpec& s = x.c.model;
  const Layout& l = x.l;
  const double d = double(s.d_model);
  RankParams p;
  for (int st : rm.stages) {
    for_each_layer_group(x.sp, s, x.ac, st, [&](int layer, bool moe, bool, int count) {
      const int km = moe ? 1 : 0;
      if (!cache.have[km]) cache.split[km] = split_layer(s, layer), cache.have[km] = true;
      const ParamSplit& y = cache.split[km];
      p.ps.tp_sharded += count * y.tp_sharded, p.ps.replicated += count * y.replicated, p.ps.experts += count * y.experts;
      p.ps.muon_tp_sharded += count * y.muon_tp_sharded, p.ps.muon_replicated += count * y.muon_replicated;
      p.ps.aux_free_bias += count * y.aux_free_bias;
      const double unit = y.tp_sharded / double(l.tp) + y.replicated + y.experts / double(l.ep * l.etp);
      if (unit > p.largest_unit)
        p.largest_unit = unit, p.largest_unit_moe = moe;
      p.moe_here = p.moe_here || moe;
      if (moe) p.moe_layers += count;
      rm.layers += count;
    });
    const double vd = double(s.vocab_size) * d;
    if ((x.sp.first[size_t(st)] || x.sp.last[size_t(st)]) && vd / double(l.tp) > p.largest_unit)
      p.largest_unit = vd / double(l.tp), p.largest_unit_moe = false;
    if (x.sp.first[size_t(st)]) p.ps.tp_sharded += vd;
    if (x.sp.last[size_t(st)]) p.ps.tp_sharded += vd, p.ps.replicated += d;  // head (a copy when tied) + final norm
    if (x.sp.last[size_t(st)] && s.mtp_layers > 0) {
      // The MTP depths (docs/model.md, "Multi-token prediction"): each a block of the last layer's kind, eh_proj
      // (2d x d, a Muon matrix) and three norms; under PP the last stage also holds a copy of the embedding (its
      // gradient exchanged like a tied head's). Their activations: stage_activations.
      const double D = double(s.mtp_layers);
      const ParamSplit y = split_layer(s, s.n_layers - 1);
      // (eh_proj and the norms whole on every TP rank: model_param_layout)
      p.ps.tp_sharded += D * y.tp_sharded, p.ps.replicated += D * (y.replicated + 2 * d * d + 3 * d);
      p.ps.experts += D * y.experts, p.ps.aux_free_bias += D * y.aux_free_bias;
      p.ps.muon_tp_sharded += D * y.muon_tp_sharded, p.ps.muon_replicated += D * (y.muon_replicated + 2 * d * d);
      if (s.is_moe_layer(s.n_layers - 1)) p.moe_here = true, p.moe_layers += int(D);
      if (!x.sp.first[size_t(st)]) p.ps.tp_sharded += vd;
    }
  }
  return p;
}

// Parameters, gradients, main parameters and optimizer state of one rank under its ZeRO stage.
void rank_state(const MemCtx& x, const RankParams& p, RankMemory& rm) {
  const Layout& l = x.l;
  const Recipe& rc = x.o.recipe;
  // The engine packs each MoE layer's local experts for its grouped GEMMs, padded to the kernels' tiles
  // (accounting.h engine_packed_expert_bytes); other recipes price expert_packed bytes per element.
  const double packed_layer =
      rc.engine_buffers && x.c.model.is_moe() ? engine_packed_expert_bytes(x.c.model, l.ep, l.etp, int64_t(x.g)) : 0.0;
  // The routing bias, fp32 on every rank: the engine keeps one per MoE layer whatever the balancing; a GPU framework
  // (Megatron-Core's expert_bias buffer) under aux-free balancing alone.
  const double bias = 4.0 * (rc.engine_buffers ? double(p.moe_layers) * double(x.c.model.moe.n_routed_experts)
                                               : p.ps.aux_free_bias);
  const double dense_dp = double(l.dp * l.cp);  // the distributed optimizer's group for dense parameters
  const double edp = double(l.edp());
  rm.params_tp_sharded = p.ps.tp_sharded / double(l.tp);
  rm.params_replicated = p.ps.replicated;
  rm.params_experts = p.ps.experts / double(l.ep * l.etp);
  const double Pd = rm.params_tp_sharded + rm.params_replicated, Pe = rm.params_experts;
  double fsdp_grad_slot = 0;
  // zero 3 shards over dp_shard (all of dp for FSDP; one replica's ranks for HSDP, whose replicas hold equal
  // shards): parameters, gradients, main parameters and optimizer state alike.
  const double dsh = double(l.zero == 3 && l.dp_shard > 0 ? l.dp_shard : l.dp);
  const double esh = std::max(1.0, edp * dsh / double(l.dp));
  if (l.zero == 3) {
    const double shard = Pd / (dsh * double(l.cp)) + Pe / esh;
    if (rc.engine_buffers) {
      // The engine keeps the fp32 shard alone and gathers one unit at a time (two with tied embeddings) into a
      // full-precision slot with its compute copy and the unit's packed experts, plus its gradient slot; both
      // count as parameters and gradients.
      const double slots = x.c.model.tie_embeddings ? 2.0 : 1.0;
      rm.params = shard * rc.param + slots * (p.largest_unit * (rc.param + rc.compute_copy) +
                                              (p.largest_unit_moe ? packed_layer : 0.0)) + bias;
      fsdp_grad_slot = slots * p.largest_unit * rc.grad;
    } else {
      rm.params = shard * (rc.param + rc.compute_copy) + bias;
      rm.buffers_by_kind.push_back({"fsdp_units", 2.0 * p.largest_unit * (rc.compute_copy > 0 ? rc.compute_copy : rc.param)});
    }
  } else {
    rm.params = (Pd + Pe) * (rc.param + rc.compute_copy) +
                (rc.engine_buffers ? double(p.moe_layers) * packed_layer : Pe * rc.expert_packed) + bias;
  }
  const double zd = l.zero == 3 ? dsh * double(l.cp) : dense_dp, ze = l.zero == 3 ? esh : edp;
  const double shard_d = l.zero >= 1 ? zd : 1.0, shard_e = l.zero >= 1 ? ze : 1.0;
  const double gshard_d = l.zero >= 2 ? zd : 1.0, gshard_e = l.zero >= 2 ? ze : 1.0;
  rm.grads = Pd * rc.grad / gshard_d + Pe * rc.grad / gshard_e + fsdp_grad_slot;
  rm.optimizer_elements = Pd / shard_d + Pe / shard_e;
  rm.main_params = rm.optimizer_elements * rc.main;
  rm.optimizer = 2.0 * rc.moment * rm.optimizer_elements;
  if (x.c.optimizer.muon()) {  // one moment (the momentum) for Muon's matrices, two for the AdamW parameters
    const double adam_d = (rm.params_tp_sharded - p.ps.muon_tp_sharded / double(l.tp)) +
                          (rm.params_replicated - p.ps.muon_replicated);
    rm.optimizer = rc.moment * (rm.optimizer_elements + adam_d / shard_d);
  }
}

// Activations: the simulator's peak of held sets, by module in the proportions of one micro-batch.
void rank_activations(const MemCtx& x, const StageActivations& sa, const Inflight& inf, int r, RankMemory& rm) {
  rm.inflight_sets = inf.peak_sets[size_t(r)];
  if (x.o.recipe.engine_buffers) {
    // The engine allocates each stage's activation slots once, as many as that stage ever holds: the sum of
    // the per-stage peaks, plus its shared re-materialization sets (a GPU allocator holds the peak of the sum).
    rm.activations = sa.engine_shared;
    for (int st : rm.stages) rm.activations += double(inf.stage_peak.at(size_t(st))) * sa.bytes[size_t(st)];
  } else {
    rm.activations = inf.peak_bytes[size_t(r)];
  }
  for (int st : rm.stages) rm.act_per_microbatch += sa.bytes[size_t(st)];
  if (x.o.detail) {
    std::map<std::string, double> mods;
    for (int st : rm.stages)
      for (const auto& [k, v] : sa.mods[size_t(st)].by) mods[k] += v;
    const double scale = rm.act_per_microbatch > 0 ? rm.activations / rm.act_per_microbatch : 0.0;
    for (const auto& [k, v] : mods) rm.act_by_module.push_back({k, v * scale});
  }
}

// Communication buffers (EP dispatch, PP send / receive) and the workspace: the GEMM library's, the SP all-gather
// of a layer input, a full recompute's transient.
void rank_buffers(const MemCtx& x, bool moe_here, double transient, RankMemory& rm) {
  const ModelSpec& s = x.c.model;
  const Layout& l = x.l;
  const double T = l.tokens_per_rank(x.c.training.seq_len), q = double(x.sh.token_div()), d = double(s.d_model);
  if (moe_here && l.ep > 1) {
    const double row = x.c.parallelism.fp8_dispatch ? d + d / 128.0 * 4.0 : d * 2.0;
    double rows = T / q * double(s.moe.topk) * double(l.etp) * x.held;
    if (x.c.parallelism.ep_dispatcher == EpDispatcher::SyncFree)  // worst case: every source sends all its copies here
      rows = T / q * double(l.ep) * double(std::min<int64_t>(s.moe.topk, s.moe.n_routed_experts / l.ep)) * double(l.etp);
    rm.buffers_by_kind.push_back({"ep_dispatch", 2.0 * rows * row});
  }
  if (l.pp > 1) rm.buffers_by_kind.push_back({"pp_p2p", 2.0 * T / q * d * x.a});
  for (const auto& [k, v] : rm.buffers_by_kind) rm.buffers += v;
  rm.workspace = kGemmWorkspace + (x.sh.sp ? T * d * x.a : 0.0) + (x.o.recipe.engine_buffers ? 0.0 : transient);
}

}  // namespace

MemoryPlan plan_memory(const JobConfig& c, const Layout& l, const Hardware& h, const PlanOptions& o,
                       const StagePlan* stages) {
  const auto spp = stages ? nullptr : stage_plan(c, l);
  const StagePlan& sp = stages ? *stages : *spp;
  MemCtx x{c,
           l,
           o,
           sp,
           plan_checkpointing(c, l),
           l.shard(),
           double(l.mbs),
           double(c.training.seq_len),
           o.recipe.act_bytes > 0 ? o.recipe.act_bytes : 2.0,
           o.recipe.gemm_bytes > 0 ? o.recipe.gemm_bytes : c.quantize.recipe == Fp8Recipe::None ? 2.0 : 1.0,
           // The engine's cached FP8 activations (quantize.cache_fp8_activations) replace their copies in its
           // terms; the GPU convention already counts every GEMM input at g = 1 byte under an FP8 recipe.
           o.recipe.engine_buffers ? fp8_cache_plan(c.quantize) : Fp8CachePlan{},
           1.0};
  MT_CHECK(o.ep_imbalance >= 1.0, "plan", "ep_imbalance = ", o.ep_imbalance,
           " must be >= 1 (the busiest rank's routed rows over the balanced count)");
  x.held = held_rows_factor(l, o);
  x.engine_tp = o.recipe.engine_buffers && l.tp > 1;
  const StageActivations sa = stage_activations(x);
  const Inflight inf = inflight(sp, sa.bytes);

  MemoryPlan m;
  m.layout = l;
  m.hardware = h.name;
  m.hbm = h.hbm_bytes;
  m.margin = o.margin;
  SplitCache splits;
  for (int r = 0; r < l.pp; ++r) {
    RankMemory rm;
    rm.rank = r;
    rm.stages = sp.rank_stages[size_t(r)];
    const RankParams p = rank_params(x, splits, rm);
    rank_state(x, p, rm);
    rank_activations(x, sa, inf, r, rm);
    rank_buffers(x, p.moe_here, sa.transient, rm);
    if (rm.total() > m.max_total) m.max_total = rm.total(), m.worst_rank = r;
    m.per_rank.push_back(std::move(rm));
  }
  m.verdict = verdict_for(m.max_total, m.hbm, m.margin);
  return m;
}

nlohmann::json to_json(const MemoryPlan& m) {
  nlohmann::json j;
  j["layout"] = m.layout.describe();
  j["hardware"] = m.hardware;
  j["hbm_bytes"] = m.hbm;
  j["margin"] = m.margin;
  for (const auto& r : m.per_rank) {
    nlohmann::json x;
    x["rank"] = r.rank;
    x["pp_stage"] = r.stages;
    x["layers"] = r.layers;
    x["params_bytes"] = r.params;
    x["grads_bytes"] = r.grads;
    x["main_params_bytes"] = r.main_params;
    x["optimizer_bytes"] = r.optimizer;
    x["activations_bytes"] = r.activations;
    x["buffers_bytes"] = r.buffers;
    x["workspace_bytes"] = r.workspace;
    x["total_bytes"] = r.total();
    x["inflight_sets"] = r.inflight_sets;
    x["params"] = {{"tp_sharded", r.params_tp_sharded}, {"replicated", r.params_replicated}, {"experts", r.params_experts}};
    for (const auto& [k, v] : r.act_by_module) x["activations_by_module"][k] = v;
    for (const auto& [k, v] : r.buffers_by_kind) x["buffers_by_kind"][k] = v;
    j["per_rank"].push_back(x);
  }
  j["max_total_bytes"] = m.max_total;
  j["worst_rank"] = m.worst_rank;
  j["verdict"] = m.verdict;
  return j;
}

std::string format_memory(const MemoryPlan& m) {
  auto gb = [](double b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%8.2f", b / 1e9);
    return std::string(buf);
  };
  std::ostringstream os;
  os << "layout  " << m.layout.describe() << "\nhardware " << m.hardware << ": " << gb(m.hbm) << " GB HBM, margin "
     << m.margin * 100 << "%\n\n";
  os << "pp rank  stages  layers  in-flight    params     grads      main       optim      activ      buffers    "
        "workspace  total (GB)\n";
  for (const auto& r : m.per_rank) {
    std::string st;
    for (size_t i = 0; i < r.stages.size(); ++i) st += (i ? "," : "") + std::to_string(r.stages[i]);
    char head[64];
    std::snprintf(head, sizeof head, "%7lld  %-6s  %6lld  %9d", (long long)r.rank, st.c_str(), (long long)r.layers,
                  r.inflight_sets);
    os << head << "  " << gb(r.params) << "  " << gb(r.grads) << "  " << gb(r.main_params) << "  " << gb(r.optimizer)
       << "  " << gb(r.activations) << "  " << gb(r.buffers) << "  " << gb(r.workspace) << "  " << gb(r.total()) << "\n";
  }
  const auto& w = m.per_rank.at(size_t(m.worst_rank));
  os << "\nworst pp rank " << w.rank << ": activations by module (GB):";
  for (const auto& [k, v] : w.act_by_module) os << " " << k << " " << gb(v);
  os << "\nparameters per GPU (elements): tp-sharded " << w.params_tp_sharded << ", replicated " << w.params_replicated
     << ", routed experts " << w.params_experts << "\n";
  os << "\nverdict: " << m.verdict << " (" << gb(m.max_total) << " GB of " << gb(m.hbm) << " GB; AT-RISK above "
     << gb((1 - m.margin) * m.hbm) << " GB)\n";
  return os.str();
}

}  // namespace moetron::plan
