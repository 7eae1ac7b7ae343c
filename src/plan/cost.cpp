// cost.cpp: the step-time projection (plan/cost.h): per-op FLOPs and bytes of one layer on one GPU under the
// layout, priced on the hardware; TP / CP / EP / PP / DP communication from the alpha-beta model
// (plan/comm_model.h); the pipeline replayed by the shared timed simulator. Not a memory model.
#include "moetron/plan/cost.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "moetron/accounting.h"
#include "moetron/check.h"
#include "moetron/plan/comm_model.h"
#include "moetron/plan/pipeline.h"
#include "cost_rank.h"
#include "cost_terms.h"

namespace moetron::plan {

namespace {

struct Ctx {
  const JobConfig& c;
  const Layout& l;
  const Hardware& h;
  bool fp8;
  double T;   // tokens per rank per micro-batch (after CP)
  double q;   // sequence-parallel divisor
  double ab;  // activation element bytes of the memory-bound passes and GEMM outputs (2: bf16; the engine's fp32: 4)
  double gb;  // GEMM input element bytes (2: bf16, 1: FP8, the engine's compute dtype)
  double imb; // the busiest EP rank's routed rows over the balanced count (PlanOptions::ep_imbalance)
  bool engine;  // the engine's recipe (its buffers and transports, not a GPU framework's)
};

// Time of a GEMM m x n x k on the hardware (flop-bound or byte-bound, floored by the launch overhead), and the
// FP8 quantization passes over its two inputs when a recipe is set and FP8 applies to the GEMM (`fp8_here`; below).
struct GemmCost {
  double t = 0, quant = 0, flops = 0;
};
GemmCost gemm(const Ctx& x, double m, double n, double k, bool fp8_here = true) {
  GemmCost g;
  if (m <= 0 || n <= 0 || k <= 0) return g;
  const bool fp8 = x.fp8 && fp8_here;
  const double gb = fp8 || !x.fp8 ? x.gb : 2.0;  // a BF16 GEMM inside an FP8 run reads bf16
  g.flops = 2 * m * n * k;
  const double bytes = gb * (m * k + k * n) + x.ab * m * n;
  const double bw = x.h.stream_bw();
  g.t = std::max({g.flops / x.h.gemm_rate(m, n, k, fp8), bytes / bw, x.h.kernel_overhead});
  if (fp8) g.quant = std::max(fp8_quant_bytes(x.c.quantize) * (m * k + k * n) / bw, x.h.kernel_overhead);
  return g;
}
// Whether FP8 applies to a GEMM of op group `op`: the layer modules quantize.modules lists (attention: the
// projections; dense_mlp; shared_experts; routed_experts), as the engine reads them (accounting.cpp). Never the router,
// whose logits Megatron-Core computes with a plain matmul in the input / router dtype (megatron/core/transformer/moe/
// moe_utils.py, router_gating_linear) and the engine in its compute dtype, nor the output head (Megatron-Core's
// output_layer is its own ColumnParallelLinear, not a Transformer Engine module, so fp8_autocast does not reach it;
// quantize.modules has no head); the core attention is priced in BF16 already. Before issue 33's fifth state every
// GEMM of an FP8 run was priced in FP8 with its quantization.
bool fp8_applies(const QuantizeSpec& q, int op, bool shared) {
  switch (op) {
    case kOpAttnProj: return q.has_module("attention");
    case kOpFfn: return q.has_module(shared ? "shared_experts" : "dense_mlp");
    case kOpExperts: return q.has_module("routed_experts");
    default: return op == kOpOther;  // MTP's eh_proj: a Transformer Engine linear in Megatron-Core
  }
}

// A memory-bound kernel over `bytes` (what it reads and writes) at the layer kernels' rate.
double membound(const Ctx& x, double bytes) {
  return bytes <= 0 ? 0.0 : std::max(bytes / x.h.elementwise_rate(), x.h.kernel_overhead);
}

// The SMs an overlapped exchange takes from the compute: DeepSeek-V3's dispatch / combine kernels run on 20 of an
// H800's 132 SMs while the other stream computes (DeepSeek-V3 Technical Report, arXiv 2412.19437, section 3.2.2:
// "only 20 SMs are sufficient to fully utilize the bandwidths of IB and NVLink"). A share of the SMs, taken for
// every GPU and dispatcher (an assumption: the report measured its own kernels on H800; H100 has the same 132 SMs).
constexpr double kCommSmShare = 20.0 / 132.0;
// Under ep_overlap a chunk's compute runs beside another chunk's exchange (sched: an FB pair costs max(f + b, a2a)).
// While the exchange of A seconds is in flight the compute runs on 1 - s of the SMs: a stage of C seconds of GPU
// work then takes C + s A where C >= (1 - s) A, else C / (1 - s) (hidden under A): so the stage's compute grows by
// min(s A, s C / (1 - s)), spread over F, I and W by their shares. The unpaired warm-up / cool-down chunks, whose
// exchange is not overlapped, pay it too (an overstatement of their share of the chunks, small at many
// micro-batches). Issue 33's fifth state; before it an overlapped exchange cost the compute nothing.
void add_comm_sm_share(StageTime& t) {
  const double A = t.a2a_f + t.a2a_b, C = t.f + t.i + t.w - t.host_f - t.host_b, s = kCommSmShare;
  if (A <= 0 || C <= 0) return;
  const double extra = std::min(s * A, s * C / (1 - s)), k = extra / C;
  t.f += k * (t.f - t.host_f), t.i += k * (t.i - t.host_b), t.w += k * t.w;
  t.comm_sm = extra;
}

// Ranks of a group inside one scale-up domain, for a group of `size` ranks laid out with `stride` between
// neighbours (tp innermost: stride tp for dp / cp groups).
Group place(const Hardware& h, int64_t size, int64_t stride) {
  Group g;
  g.size = size;
  const int64_t per = std::max<int64_t>(1, h.scale_up.domain / std::max<int64_t>(1, stride));
  g.per_node = std::min(size, per);
  while (g.size % g.per_node != 0) --g.per_node;
  return g;
}

// Seconds of one part of a layer: forward (F), the backward's input half (I) and weight half (W).
// The unfused core attention of Megatron-LM 2021-22 (Korthikanti et al. 2022, section 4.1; Megatron-LM's
// CoreAttention with its fused scale-mask-softmax kernels): per micro-batch row b and local head, two batched
// GEMMs over the full (masked, not skipped) score matrix, QK^T [S, dqk] x [dqk, S] and PV [S, S] x [S, dv],
// priced at the hardware's GEMM curve for that shape; the dgrad / wgrad pairs of each repeat its FLOPs. Then
// memory-bound passes over the materialized scores [b, H, S, S], a elements bytes each (bf16 / fp16: 2):
//   forward:  softmax (scale, mask fused) reads a, writes a; dropout reads a, writes a and a 1-byte mask
//   backward: dropout reads the gradient (a) and the mask (1), writes a; softmax reads the gradient and its
//             output (2 a), writes a
// so 2a + (dropout ? 2a + 1 : 0) bytes an element forward and 3a + (dropout ? 2a + 1 : 0) backward.
struct UnfusedAttnCost {
  GemmCost gemm;          // both score GEMMs, the forward (dgrad + wgrad repeat it)
  double mem_f = 0, mem_b = 0;  // the forward's softmax / dropout passes, the backward's
  double elements = 0;    // score elements per rank per micro-batch
};
UnfusedAttnCost unfused_attention(const Ctx& x) {
  const ModelSpec& s = x.c.model;
  const auto& at = s.attn;
  const double S = double(x.c.training.seq_len), H = double(at.n_heads) / double(x.l.tp);
  const double n = H * x.T / (S / double(x.l.cp));  // batched GEMMs: local heads x micro-batch rows
  const GemmCost qk = gemm(x, S / double(x.l.cp), S, double(at.qk_head_dim()), false);  // BF16: fp8_applies
  const GemmCost pv = gemm(x, S / double(x.l.cp), double(at.v_dim()), S, false);
  UnfusedAttnCost u;
  u.gemm.t = std::max(n * (qk.t + pv.t), x.h.kernel_overhead);
  u.gemm.quant = n * (qk.quant + pv.quant);
  u.gemm.flops = n * (qk.flops + pv.flops);
  u.elements = H * x.T * S;
  const double drop = s.dropout > 0 ? 2 * x.ab + 1 : 0;
  u.mem_f = membound(x, u.elements * (2 * x.ab + drop));
  u.mem_b = membound(x, u.elements * (3 * x.ab + drop));
  return u;
}

struct Part {
  double f = 0, i = 0, w = 0;
};

// Kernels the host issues per part of a layer (F, I, W), for the host-bound spans (plan/cost.h). Counted from the
// op list below: a GEMM is one kernel per pass and FP8 adds its quantization kernels (two inputs in F, the output
// gradient in I); a memory-bound pass is one kernel forward and one backward; the exceptions are named where
// they are counted.
struct Launches {
  double f = 0, i = 0, w = 0;
};
// The router of a Megatron-Core MoE layer with its fused kernels (`--moe-router-fusion`): 31 kernels, from 72
// unfused (Megatron-LM docs/discussions/deepseek-v3-gb200-optimization, section 2.1.4). Counted once in the forward
// and, an assumption, as many in the backward (autograd mirrors the element-wise chain).
constexpr double kRouterKernels = 31;

struct LayerCost {
  Part op[kNumPlanOps];           // compute by op group
  Part gemm, attn, mem, quant;    // the same compute by kind (the breakdown)
  double flops_f = 0;             // forward FLOPs
  double tp_f = 0, tp_b = 0;      // exposed TP collectives
  double cp_f = 0, cp_b = 0;      // exposed CP exchange
  double a2a = 0;                 // one dispatch + one combine
  double a2a_bd = 0;              // the backward's exchanges less the forward's (the engine's shm transport)
  double a2a_wf = 0, a2a_wb = 0;  // waits for the slowest rank at them, forward and backward (rank_skew)
  double recompute = 0;           // forward work redone in backward
  Launches launch;                // kernels the host issues
  double qk = 1;                  // host kernels per quantized GEMM input (fp8_quant_kernels)
  double sum_f() const { double t = 0; for (const Part& p : op) t += p.f; return t; }
  double sum_i() const { double t = 0; for (const Part& p : op) t += p.i; return t; }
  double sum_w() const { double t = 0; for (const Part& p : op) t += p.w; return t; }
  // A GEMM: dgrad (I) and wgrad (W) repeat its FLOPs; FP8 quantizes the inputs in F and again in I.
  // `kernels`: how many GEMMs g stands for (the local experts, one cuBLAS call each).
  void add_gemm(int o, const GemmCost& g, double kernels = 1) {
    op[o].f += g.t + g.quant, op[o].i += g.t + g.quant, op[o].w += g.t;
    gemm.f += g.t, gemm.i += g.t, gemm.w += g.t, quant.f += g.quant, quant.i += g.quant;
    flops_f += g.flops;
    count_gemm(g.quant > 0, kernels);
  }
  void count_gemm(bool fp8, double kernels) {
    launch.f += kernels * (fp8 ? 1 + 2 * qk : 1), launch.i += kernels * (fp8 ? 1 + qk : 1), launch.w += kernels;
  }
  // A memory-bound pass: its backward reads and writes about twice the bytes.
  void add_mem(int o, double t) {
    op[o].f += t, op[o].i += 2 * t, mem.f += t, mem.i += 2 * t;
    if (t > 0) launch.f += 1, launch.i += 1;
  }
  // A memory-bound pass of the forward alone (no backward: e.g. a selection).
  void add_mem_forward(int o, double t) {
    op[o].f += t, mem.f += t;
    if (t > 0) launch.f += 1;
  }
};

// The routed experts' two grouped GEMMs (gate_up, then down) over `local` experts of `te` tokens each.
void add_routed_experts(const Ctx& x, LayerCost& lc, double te, double local, double Im, double d) {
  double ef = 0, eb = 0;
  const bool curves = x.h.grouped_split_eff(te, &ef, &eb);
  for (int part = 0; part < 2; ++part) {  // gate_up, then down, one GEMM per local expert
    const bool f8 = fp8_applies(x.c.quantize, kOpExperts, false);
    const GemmCost g = part == 0 ? gemm(x, te, 2 * Im, d, f8) : gemm(x, te, d, Im, f8);
    GemmCost all{local * g.t, local * g.quant, local * g.flops};
    // Kernels: one GEMM per local expert (Megatron-Core's grouped GEMM is cuBLAS on several streams, one call per
    // expert: the GB200 write-up above, section 1, item 3).
    if (!curves) {
      lc.add_gemm(kOpExperts, all, local);
      continue;
    }
    lc.count_gemm(all.quant > 0, local);
    // Measured grouped-GEMM curves (by tokens per expert) replace the per-expert GEMM estimate: the forward at
    // its own efficiency, dgrad + wgrad (twice the FLOPs) at the backward's, split evenly between I and W.
    const double rate = x.fp8 ? x.h.achievable_fp8 : x.h.achievable_bf16;
    const double tf = std::max(all.flops / (rate * ef), x.h.kernel_overhead);
    const double tb = std::max(2 * all.flops / (rate * eb), 2 * x.h.kernel_overhead);
    Part& p = lc.op[kOpExperts];
    p.f += tf + all.quant, p.i += tb / 2 + all.quant, p.w += tb / 2;
    lc.gemm.f += tf, lc.gemm.i += tb / 2, lc.gemm.w += tb / 2, lc.quant.f += all.quant, lc.quant.i += all.quant;
    lc.flops_f += all.flops;
  }
}

// TP's and CP's exchanges of one layer (exposed: lc.tp_f / tp_b, and the CP ring beyond the core attention's
// `attn_fwd` seconds it overlaps).
void add_tp_cp_comm(const Ctx& x, LayerCost& lc, double attn_fwd) {
  const Layout& l = x.l;
  const auto& at = x.c.model.attn;
  const double T = x.T, d = double(x.c.model.d_model), tp = double(l.tp), ab = x.ab, H = double(at.n_heads) / tp;
  // TP: with SP two all-gathers and two reduce-scatters of the layer's [T, d] activations per pass; without SP
  // two all-reduces. Not overlapped (no TP comm overlap is modelled). Elements at the recipe's activation size,
  // but the forward's first gather, of the attention's GEMM input, at its GEMM input size (at least 2 B): bf16
  // throughout on a GPU recipe; the engine gathers that input in its compute dtype and the rest in fp32
  // (model_layer.cpp). Before the tenth session every element was priced at 2 B.
  if (l.tp > 1) {
    const Group g = place(x.h, l.tp, 1);
    const double row = T * d, a = row * ab, in = row * std::max(x.gb, 2.0);
    if (l.sp) {
      const double ag = all_gather(x.h, a, g), rs = reduce_scatter(x.h, a, g);
      lc.tp_f = all_gather(x.h, in, g) + ag + 2 * rs, lc.tp_b = 2 * (ag + rs);
    } else lc.tp_f = lc.tp_b = 2 * all_reduce(x.h, a, g);
    lc.launch.f += l.sp ? 4 : 2, lc.launch.i += l.sp ? 4 : 2;
  }
  // CP: the ring passes K and V (backward also dK, dV) around cp ranks, overlapped with the core attention; bf16 on
  // a GPU recipe, fp32 in the engine (its ring sends fp32 blocks: src/parallel/cp_attention.cpp).
  if (l.cp > 1) {
    const double kvw = at.type == AttnType::MLA ? H * double(at.qk_head_dim() + at.v_head_dim)
                                                : 2 * double(at.n_kv_heads) / tp * double(at.head_dim);
    const Group g = place(x.h, l.cp, l.tp);
    const double ring = double(l.cp - 1) * p2p(x.h, T * kvw * ab, g.nodes() > 1);  // K, V at the activations' size
    lc.cp_f = std::max(0.0, ring - attn_fwd);
    lc.cp_b = std::max(0.0, 2 * ring - 2 * attn_fwd);
  }
}

// Waiting for the slowest rank at one layer's blocking exchanges (Hardware::rank_skew: measured on the engine's
// machine, none in the catalog): each exchange lines its group up after a segment of the pass's compute (the pass
// over its exchanges), and every rank waits the slowest rank's excess over the mean; split over TP, CP and EP by
// their exchanges (EP's dispatch and combine, whose waits the EP overlap's other lane may hide as it hides the
// exchange). After the layer's compute, TP / CP exchanges and EP exchange are priced. Each of those exchanges also
// pays Hardware::wait_overshoot once a pass (measured: the late rank's exchange returns that much later than one
// entered together, as the early rank's sleeping wait wakes late; none in the catalog).
void add_rank_skew_waits(const Ctx& x, LayerCost& lc) {
  const Layout& l = x.l;
  const double k_tp = l.tp > 1 ? (l.sp ? 4 : 2) : 0, k_cp = l.cp > 1 ? double(l.cp - 1) : 0;
  const double k_ep = lc.a2a > 0 ? 2 : 0, k = k_tp + k_cp + k_ep, ov = x.h.wait_overshoot;
  if (k > 0 && (!x.h.rank_skew.empty() || ov > 0)) {
    auto wait = [&](double compute) { return x.h.skew_fraction(compute / k) * compute; };
    const double wf = wait(lc.sum_f()), wb = wait(lc.sum_i() + lc.sum_w());
    lc.tp_f += wf * k_tp / k + ov * k_tp, lc.tp_b += wb * k_tp / k + ov * k_tp;
    lc.cp_f += wf * k_cp / k + ov * k_cp, lc.cp_b += wb * k_cp / k + ov * k_cp;
    lc.a2a_wf = wf * k_ep / k + ov * k_ep, lc.a2a_wb = wb * k_ep / k + ov * k_ep;
  }
}

// EP dispatch + combine of this rank's rows (before the expert-TP gather); the busiest rank receives imb times
// the balanced rows. Dispatched rows are GEMM inputs (FP8 with its scales under fp8_dispatch), combined rows
// are outputs (the recipe's element sizes: bf16 both on a GPU recipe, the engine's compute dtype / fp32).
void add_ep_exchange(const Ctx& x, double T, LayerCost& lc) {
  const MoESpec& m = x.c.model.moe;
  const double d = double(x.c.model.d_model), k = double(m.topk), ab = x.ab;
  const double row_in = x.c.parallelism.fp8_dispatch ? d + d / 128 * 4 : d * std::max(x.gb, 2.0);
  const Group g = place(x.h, x.l.ep, x.l.etp);
  // Each leg at its measured share of the tiers' bandwidth (Tier::ep_eff); the backward runs the same two
  // kernels the other way round (a dispatch's gradient is a combine), so both directions cost the same sum.
  auto a2a = [&](double row, EpLeg leg) {
    const double bytes = T / x.q * k * row * x.imb;
    if (x.c.parallelism.ep_dispatcher == EpDispatcher::AllToAll || g.nodes() == 1)
      return all_to_all(x.h, bytes, g, leg);
    const int64_t max_nodes = m.n_group > 1 ? m.topk_group : 0;
    const double npt = expected_nodes_per_token(m.n_routed_experts, m.topk, g.nodes(), max_nodes);
    return all_to_all_hierarchical(x.h, bytes, m.topk, npt, g, leg);
  };
  lc.a2a = a2a(row_in, EpLeg::Dispatch) + a2a(d * ab, EpLeg::Combine);
  if (x.c.parallelism.ep_transport == EpTransport::Shm && x.engine) {
    // The engine's shared-memory transport (src/ep/dispatch_shm.cpp): a dispatch copies each row once from the
    // home's segment into its landing (read + write at the memory-bound rate, its own rows too); a combine of
    // the trainer's expert outputs copies them into the combine rows once (the homes' sum then reads them where
    // they are, priced with the permute pass as before). The backward's redispatch keeps its MPI exchange.
    const double rows = T / x.q * k * x.imb;
    const double shm_d = membound(x, 2 * rows * row_in), shm_c = membound(x, 2 * rows * d * ab);
    lc.a2a_bd = a2a(d * ab, EpLeg::Dispatch) - shm_d;
    lc.a2a = shm_d + shm_c;
  }
}

LayerCost layer_cost(const Ctx& x, int64_t layer, const ActivationCheckpointSpec& ac) {
  const ModelSpec& s = x.c.model;
  const Layout& l = x.l;
  const double T = x.T, d = double(s.d_model), tp = double(l.tp), ab = x.ab;
  const auto& at = s.attn;
  const double H = double(at.n_heads) / tp;
  LayerCost lc;
  int cur = kOpAttnProj;  // the op group the GEMMs below belong to
  lc.qk = fp8_quant_kernels(x.c.quantize);
  bool shared = false;  // the FFN GEMMs below are the shared experts'
  auto G = [&](double m, double n, double k) {
    lc.add_gemm(cur, gemm(x, m, n, k, fp8_applies(x.c.quantize, cur, shared)));
  };
  // Attention projections (rows: the full sequence of this cp rank, after the SP all-gather).
  if (at.type == AttnType::MLA) {
    const double rq = double(at.q_lora_rank), rkv = double(at.kv_lora_rank), dqk = double(at.qk_head_dim());
    if (at.q_lora_rank > 0) G(T, rq, d), G(T, H * dqk, rq);
    else G(T, H * dqk, d);
    G(T, rkv + double(at.qk_rope_head_dim), d);
    G(T, H * double(at.qk_nope_head_dim + at.v_head_dim), rkv);
    G(T, d, H * double(at.v_head_dim));
  } else {
    const double hd = double(at.head_dim), Hkv = double(at.n_kv_heads) / tp;
    G(T, (H + 2 * Hkv) * hd, d);
    G(T, d, H * hd);
    // QK-norm (Qwen3): a per-head RMSNorm of q and k before RoPE, read + write of H + Hkv heads a token.
    if (at.qk_norm) lc.add_mem(kOpNorm, membound(x, 2 * (H + Hkv) * hd * T * ab));
  }
  lc.add_mem(kOpAttnProj, membound(x, 2 * 2 * H * double(at.qk_head_dim()) * T * ab));  // RoPE on q and k
  // Core attention: causal, each cp rank's queries see on average (seq + 1) / 2 keys (load-balanced chunks).
  double attn_fwd = 0;  // the core attention's forward (what selective recompute of attention_core redoes)
  if (s.attention_impl == AttnImpl::Flash) {
    const double ctx = (double(x.c.training.seq_len) + 1) / 2;
    const double attn_flops = 2.0 * H * double(at.qk_head_dim() + at.v_dim()) * T * ctx;
    const double attn_rate = fused_attention_rate(x.h, double(x.c.training.seq_len), double(at.qk_head_dim()));
    attn_fwd = std::max(attn_flops / attn_rate, x.h.kernel_overhead);
    lc.op[kOpAttnCore].f += attn_fwd, lc.op[kOpAttnCore].i += 2 * attn_fwd;
    lc.attn.f += attn_fwd, lc.attn.i += 2 * attn_fwd;
    lc.flops_f += attn_flops;
    lc.launch.f += 1, lc.launch.i += 2;  // the fused kernel; its backward with the row-sum preprocess
  } else {
    const UnfusedAttnCost u = unfused_attention(x);
    lc.add_gemm(kOpAttnCore, u.gemm, 2);  // QK^T and PV, one batched GEMM each
    lc.op[kOpAttnCore].f += u.mem_f, lc.op[kOpAttnCore].i += u.mem_b;
    lc.launch.f += s.dropout > 0 ? 2 : 1, lc.launch.i += s.dropout > 0 ? 2 : 1;  // softmax (+ dropout)
    lc.mem.f += u.mem_f, lc.mem.i += u.mem_b;
    attn_fwd = u.gemm.t + u.mem_f;
  }
  // Two norms (read + write) and two residual adds (read two, write one), on the SP shard (T / q rows).
  const double norm_bytes = 2 * 2 * d * ab * T / x.q;
  lc.add_mem(kOpNorm, membound(x, norm_bytes));
  lc.add_mem(kOpOther, membound(x, 2 * 3 * d * ab * T / x.q));
  const bool moe = s.is_moe_layer(layer);
  double act_bytes = 0;      // SwiGLU / GELU passes of the FFN op, counted in bf16 bytes (what moe_act recompute redoes)
  double exp_act_bytes = 0;  // the routed experts' SwiGLU, likewise
  cur = kOpFfn;
  if (!moe && s.ffn == FfnKind::GELU) {  // GPT: up (d -> I), GELU (read I, write I), down (I -> d)
    const double I = double(s.inter_size) / tp;
    G(T, I, d), G(T, d, I);
    act_bytes = 2 * I * 2 * T;
  } else if (!moe) {
    const double I = double(s.inter_size) / tp;
    G(T, 2 * I, d), G(T, d, I);
    act_bytes = 3 * I * 2 * T;
  } else {
    const auto& m = s.moe;
    const double E = double(m.n_routed_experts), k = double(m.topk), Im = double(m.moe_inter_size) / double(l.etp);
    // Rows per rank (balanced): T / q tokens x topk copies (capacity-capped when a capacity factor is set),
    // gathered over expert_tp; the busiest rank gets imb times as many.
    const double per_tok = m.capacity_factor > 0 ? double(routed_rows(s, int64_t(T / x.q))) / (T / x.q) : k;
    const double R = per_tok * T / x.q * double(l.etp) * x.imb;
    const double local = E / double(l.ep);
    const double te = R / local;  // tokens per local expert
    cur = kOpRouter;
    const Launches before = lc.launch;
    G(T / x.q, E, d);             // router
    lc.add_mem(kOpRouter, membound(x, T / x.q * E * 4 * 3));  // softmax / top-k over fp32 scores
    // Balanced selection (docs/routing.md), forward only (it chooses experts; no gradient flows through it): each
    // Sinkhorn iteration reads the fp32 scores twice (row factors, then column sums); capacity routing reads them
    // once more, tokens in order.
    const double balance_passes = 2.0 * double(m.sinkhorn_iters) + (m.route_capacity > 0 ? 1.0 : 0.0);
    lc.add_mem_forward(kOpRouter, membound(x, T / x.q * E * 4 * balance_passes));
    lc.launch = before, lc.launch.f += kRouterKernels, lc.launch.i += kRouterKernels;
    add_routed_experts(x, lc, te, local, Im, d);
    exp_act_bytes = 3 * Im * 2 * R;
    // GPT-OSS's clamped SwiGLU as Megatron-Core runs it (NVIDIA/Megatron-LM 0d8e0714, in the 25.11 container): two
    // clamps and a cat in plain PyTorch before the fused GeGLU (each reads and writes 2 Im elements a row: 8 Im), the
    // down projection's bias added per local expert (the bias times the routing weight, the add: a Python loop) and
    // the rows joined by a cat (6 d elements a row); the backward at twice the bytes as every pass here, moe_act
    // recompute redoing them. Kernels: the clamps and cats, and two per local expert.
    if (m.expert_act == ExpertAct::ClampedSwiGLU) {
      exp_act_bytes += (8 * Im + 6 * d) * 2 * R;
      lc.launch.f += 4 + 2 * local, lc.launch.i += 4 + 2 * local;
    }
    lc.add_mem(kOpPermute, membound(x, 2 * 2 * R * d * ab));  // permute and unpermute (read + write each)
    lc.launch.f += 1, lc.launch.i += 1;                        // two kernels, counted once above
    if (m.n_shared_experts > 0) {
      cur = kOpFfn, shared = true;
      const double Is = double(m.n_shared_experts * m.moe_inter_size) / tp;
      G(T, 2 * Is, d), G(T, d, Is);
      act_bytes += 3 * Is * 2 * T;
    }
    if (l.ep > 1) {
      add_ep_exchange(x, T, lc);
      lc.launch.f += 2, lc.launch.i += 2;  // dispatch and combine
    }
  }
  // The branches count SwiGLU bytes at 2 per element; the recipe's activations may be wider.
  lc.add_mem(kOpFfn, membound(x, act_bytes * ab / 2));
  lc.add_mem(kOpExperts, membound(x, exp_act_bytes * ab / 2));
  // Dropout (GPT) on the attention and FFN outputs, fused with the residual add: a 1-byte mask written per
  // element (on the SP shard); the backward reads it back.
  if (s.dropout > 0) lc.add_mem(kOpOther, membound(x, 2 * d * 1 * T / x.q));
  add_tp_cp_comm(x, lc, attn_fwd);
  add_rank_skew_waits(x, lc);
  // Recompute in backward.
  if (ac.applies_to(layer)) {
    if (ac.mode == AcMode::Full) lc.recompute = lc.sum_f() + lc.tp_f, lc.launch.i += lc.launch.f;
    else if (ac.mode == AcMode::Selective) {
      if (ac.has_module("attention_core")) lc.recompute += attn_fwd;
      if (ac.has_module("moe_act")) lc.recompute += membound(x, (act_bytes + exp_act_bytes) * ab / 2);
      if (ac.has_module("norm")) lc.recompute += membound(x, norm_bytes / 2);
    }
  }
  return lc;
}

}  // namespace

const char* plan_op_name(int op) {
  static const char* const names[kNumPlanOps] = {"attn_proj", "attn_core", "norm",  "ffn",  "router",
                                                 "permute",   "experts",   "loss",  "other"};
  return op >= 0 && op < kNumPlanOps ? names[op] : "?";
}

std::vector<StageTime> stage_times_at(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o,
                                      const StagePlan& sp, double token_share) {
  const ModelSpec& s = c.model;
  const bool fp8 = c.quantize.recipe != Fp8Recipe::None;
  const Recipe& rc = o.memory.recipe;
  const Ctx x{c,
              l,
              h,
              fp8,
              l.tokens_per_rank(c.training.seq_len) * token_share,
              double(l.shard().token_div()),
              rc.act_bytes > 0 ? rc.act_bytes : 2.0,
              rc.gemm_bytes > 0 ? rc.gemm_bytes : fp8 ? 1.0 : 2.0,
              l.ep > 1 ? std::max(1.0, o.memory.ep_imbalance) : 1.0,  // without EP every rank holds every expert
              rc.engine_buffers};
  const ActivationCheckpointSpec ac = plan_checkpointing(c, l);
  // Layers of one kind cost the same unless recompute applies to some of them: cache by (moe, recompute).
  LayerCost cache[2][2];
  bool have[2][2] = {{false, false}, {false, false}};
  const int n_stages = int(sp.stage_layers.size());
  std::vector<StageTime> out(static_cast<size_t>(n_stages));
  for (int st = 0; st < n_stages; ++st) {
    StageTime& t = out[size_t(st)];
    int moe_a2a_layers = 0;
    // Host-bound spans (plan/cost.h): a forward span ends at each MoE layer's device-host synchronization (the
    // tokens per expert); the backward, which has none, is one span. A span costs the slower of the GPU's work and
    // the host's kernel issue: the host's excess is exposed.
    const double hl = h.host_launch;
    // sync_free sizes its buffers from a bound and never reads the counts back (Primus-Turbo's sync-free MoE: seed
    // 001, "Sync-Free MoE"): its MoE layers end no span.
    const bool syncs = c.parallelism.ep_dispatcher != EpDispatcher::SyncFree;
    double span_gpu = 0, span_host = 0, bwd_gpu = 0, bwd_host = 0, host_f = 0;
    auto close_span = [&] { host_f += std::max(0.0, span_host - span_gpu), span_gpu = span_host = 0; };
    auto add_layers = [&](int layer, bool moe, bool on, int count) {
      const int km = moe ? 1 : 0, kr = on ? 1 : 0;
      if (!have[km][kr]) cache[km][kr] = layer_cost(x, layer, ac), have[km][kr] = true;
      const LayerCost& lc = cache[km][kr];
      const double n = count;
      // Backward: input gradients = the forward GEMMs again (dgrad), attention backward at twice the forward,
      // the memory-bound passes twice; weight gradients = the forward GEMMs' FLOPs again (LayerCost's parts).
      t.f += n * (lc.sum_f() + lc.tp_f + lc.cp_f);
      t.i += n * (lc.sum_i() + lc.tp_b + lc.cp_b + lc.recompute);
      t.w += n * lc.sum_w();
      for (int k = 0; k < kNumPlanOps; ++k)
        t.op_f[size_t(k)] += n * lc.op[k].f, t.op_b[size_t(k)] += n * (lc.op[k].i + lc.op[k].w);
      t.a2a_f += n * (lc.a2a + lc.a2a_wf), t.a2a_b += n * (lc.a2a + lc.a2a_bd + lc.a2a_wb);
      if (moe && lc.a2a > 0) moe_a2a_layers += count;
      t.gemm += n * (lc.gemm.f + lc.gemm.i + lc.gemm.w), t.attention += n * (lc.attn.f + lc.attn.i);
      t.memory_bound += n * (lc.mem.f + lc.mem.i), t.quantize += n * (lc.quant.f + lc.quant.i);
      t.recompute += n * lc.recompute;
      t.tp_comm += n * (lc.tp_f + lc.tp_b), t.cp_comm += n * (lc.cp_f + lc.cp_b);
      t.flops += n * 3 * lc.flops_f;
      if (hl > 0) {
        const double gf = lc.sum_f() + lc.tp_f + lc.cp_f + lc.a2a + lc.a2a_wf, hf = lc.launch.f * hl;
        span_gpu += gf, span_host += hf;
        if (moe && syncs) close_span(), host_f += (n - 1) * std::max(0.0, hf - gf);
        else span_gpu += (n - 1) * gf, span_host += (n - 1) * hf;
        bwd_gpu += n * (lc.sum_i() + lc.sum_w() + lc.tp_b + lc.cp_b + lc.recompute + lc.a2a + lc.a2a_bd + lc.a2a_wb);
        bwd_host += n * (lc.launch.i + lc.launch.w) * hl;
      }
    };
    for_each_layer_group(sp, s, ac, st, add_layers);
    // The MTP depths (model.mtp_layers; docs/model.md, "Multi-token prediction") on the last stage: each a block of
    // the last layer's kind (and its recompute choice), eh_proj (T x 2d -> d) and three norms (the embedding's, the
    // hidden state's, the head's); each depth's head and loss are counted with the main head below.
    const bool last = sp.last[size_t(st)];
    const double D = last ? double(s.mtp_layers) : 0.0;
    if (D > 0) {
      const int ll = int(s.n_layers - 1);
      add_layers(ll, s.is_moe_layer(ll), ac.applies_to(ll), int(D));
      LayerCost e;
      e.qk = fp8_quant_kernels(c.quantize);
      const double dm = double(s.d_model);
      e.add_gemm(kOpOther, gemm(x, x.T, dm, 2 * dm));
      e.add_mem(kOpNorm, membound(x, 3 * 2 * dm * x.ab * x.T / x.q));
      t.f += D * e.sum_f(), t.i += D * e.sum_i(), t.w += D * e.sum_w();
      for (int k = 0; k < kNumPlanOps; ++k)
        t.op_f[size_t(k)] += D * e.op[k].f, t.op_b[size_t(k)] += D * (e.op[k].i + e.op[k].w);
      t.gemm += D * (e.gemm.f + e.gemm.i + e.gemm.w), t.memory_bound += D * (e.mem.f + e.mem.i);
      t.quantize += D * (e.quant.f + e.quant.i), t.flops += D * 3 * e.flops_f;
      span_gpu += D * e.sum_f(), span_host += D * e.launch.f * hl;
      bwd_gpu += D * (e.sum_i() + e.sum_w()), bwd_host += D * (e.launch.i + e.launch.w) * hl;
    }
    close_span();
    t.host_f = host_f, t.host_b = std::max(0.0, bwd_host - bwd_gpu);
    t.f += t.host_f, t.i += t.host_b;
    if (l.ep_overlap) add_comm_sm_share(t);
    t.n_a2a = std::max(1, 2 * moe_a2a_layers);
    if (last) {  // the head GEMM and the loss (fused: one pass over the logits chunks), once per head (1 + D)
      const double V = double(s.vocab_size) / double(l.tp), d = double(s.d_model);
      const GemmCost g = gemm(x, x.T, V, d, false);  // BF16 under FP8 (fp8_applies)
      double f = g.t + g.quant, i = g.t + g.quant, w = g.t;
      if (h.loss_efficiency > 0) {
        // Measured: the fused head + loss, forward and backward (three GEMMs' FLOPs and the passes over the
        // logits chunks), split evenly over F, I and W.
        const double all = std::max(3 * g.flops / (h.achievable_bf16 * h.loss_efficiency), 3 * h.kernel_overhead);
        f = all / 3 + g.quant, i = all / 3 + g.quant, w = all / 3;
        t.gemm += all;
      } else {
        const double loss = membound(x, x.T * V * (o.memory.fused_loss ? 4.0 : 12.0));
        f += loss, i += loss;
        t.gemm += 3 * g.t, t.memory_bound += 2 * loss;
      }
      const double heads = 1 + D;
      if (h.loss_efficiency > 0) t.gemm += (heads - 1) * 3 * (f - g.quant);
      else t.gemm += (heads - 1) * 3 * g.t, t.memory_bound += (heads - 1) * 2 * (f - g.t - g.quant);
      t.f += heads * f, t.i += heads * i, t.w += heads * w;
      t.op_f[kOpLoss] += heads * f, t.op_b[kOpLoss] += heads * (i + w);
      t.quantize += heads * 2 * g.quant, t.flops += heads * 3 * g.flops;
    }
  }
  return out;
}

void set_split_halves(std::vector<StageTime>& whole, const std::vector<StageTime>& half) {
  MT_CHECK(whole.size() == half.size(), "plan time", "split halves for ", half.size(), " stages, not ", whole.size());
  for (size_t k = 0; k < whole.size(); ++k) {
    const StageTime& x = half[k];
    whole[k].f2 = 2 * x.f, whole[k].i2 = 2 * x.i, whole[k].w2 = 2 * x.w;
    whole[k].a2a_f2 = 2 * x.a2a_f, whole[k].a2a_b2 = 2 * x.a2a_b;
  }
}

std::vector<StageTime> stage_times(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o,
                                   const StagePlan& sp) {
  std::vector<StageTime> out = stage_times_at(c, l, h, o, sp, 1.0);
  // each unpaired chunk may run as two halves: both priced at half the tokens
  if (l.ep_overlap_split) set_split_halves(out, stage_times_at(c, l, h, o, sp, 0.5));
  return out;
}

sched::Durations replay_durations(const TimePlan& tp) {
  sched::Durations d;
  d.p2p = tp.p2p;
  for (const auto& st : tp.stages)
    d.stage.push_back({st.f, st.i, st.w, st.a2a_f, st.a2a_b, st.f2, st.i2, st.w2, st.a2a_f2, st.a2a_b2, st.n_a2a});
  d.split_unpaired = tp.layout.ep_overlap_split;
  d.carry_w = tp.carry_w;
  return d;
}

namespace {

// The memory projection plan_time reads for the DP collectives (parameter counts), without module detail.
MemoryPlan dp_memory(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o,
                     const StagePlan& sp) {
  PlanOptions quick = o.memory;
  quick.detail = false;
  return plan_memory(c, l, h, quick, &sp);
}

// A carried unpaired backward of a stage (TimePlan::carry_w): its exposed wait when it runs as an I, and the
// weight gradient it queues (the halves' when split).
struct CarriedB {
  double wait = 0, w = 0;
};
CarriedB carried_b(const StageTime& x, bool split) {
  return {sched::unpaired_time(x.i, x.a2a_b, x.i2, x.a2a_b2, split, x.n_a2a) - x.i,
          split && x.a2a_b > 0 ? x.w2 : x.w};
}

// The pipeline as the replay or the analytic estimate saw it: per pipeline rank the exposed EP seconds and, per
// stage, the DP collectives' windows (DpWindow) with the replayed pipeline's end they refer to; `windows` stays
// empty for the analytic pass (dp_rank fills them from the schedule's shape).
struct PipelineRun {
  std::vector<double> a2a_exposed;
  std::vector<std::vector<DpWindow>> windows;
  double windows_end = 0;
};

// The timed replay of the schedule: the pipeline's time, bubble and replayed micro-batches into tp. Long steps:
// m1 and 2 m1 micro-batches (multiples of pp) simulated and the steady state extended linearly.
PipelineRun pipeline_simulated(const Layout& l, const StagePlan& sp, TimePlan& tp) {
  const sched::Durations d = replay_durations(tp);
  const int64_t m = l.microbatches;
  PipelineRun pr;
  pr.a2a_exposed.assign(size_t(l.pp), 0.0);
  sched::GenSpec g = sp.spec;
  const int64_t m1 = 8 * int64_t(g.pp);
  auto run = [&](int64_t mb) {
    sched::GenSpec gg = g;
    gg.microbatches = int(mb);
    sched::Schedule sch = sp.from_csv ? sp.csv : sched::generate(gg);
    return sched::simulate_timed(sched::lower(sch), d);
  };
  if (sp.from_csv || m <= 2 * m1) {
    const auto r = run(m);
    tp.pipeline_time = r.step_time, tp.bubble_ratio = r.bubble_ratio, tp.simulated_microbatches = m;
    for (const auto& rs : r.ranks) pr.a2a_exposed[size_t(rs.rank)] = rs.a2a_exposed;
    pr.windows = dp_windows(r, int(l.pp), int(tp.stages.size())), pr.windows_end = r.step_time;
    return pr;
  }
  const auto r1 = run(m1), r2 = run(2 * m1);
  // A figure of the m1 and 2 m1 replays, extended linearly to m micro-batches.
  auto extend = [&](double v1, double v2) { return v1 + (v2 - v1) / double(m1) * double(m - m1); };
  tp.pipeline_time = extend(r1.step_time, r2.step_time);
  for (size_t r = 0; r < pr.a2a_exposed.size(); ++r)
    pr.a2a_exposed[r] = extend(r1.ranks[r].a2a_exposed, r2.ranks[r].a2a_exposed);
  // The first forwards and the last backwards sit in the warm-up and the cool-down, whose shape does not
  // depend on m: the shorter replay's windows, its last backwards moved to the extended end.
  pr.windows = dp_windows(r2, int(l.pp), int(tp.stages.size()));
  for (auto& row : pr.windows)
    for (DpWindow& x : row) x.last_bwd_start += tp.pipeline_time - r2.step_time;
  pr.windows_end = tp.pipeline_time;
  double busy = 0;
  for (const auto& rs : r2.ranks) busy = std::max(busy, rs.busy);
  const double per_mb_busy = busy / double(2 * m1);
  tp.bubble_ratio = 1.0 - per_mb_busy * double(m) / tp.pipeline_time;
  tp.simulated_microbatches = 2 * m1;
  return pr;
}

// Analytic: the slowest rank's per-micro-batch time, m of them, plus the warm-up / cool-down of (pp - 1) / vpp
// micro-batches' worth (the closed bubble formula's shape). Under ep_overlap (the fused interleaved schedule)
// the rank's warm-up forwards and cool-down backwards run unpaired and show their whole all-to-all; each
// fused steady-state pair shows the part beyond the pair's compute (what the timed simulator charges,
// averaged over the rank's chunks). With ep_overlap_split an unpaired chunk shows its split time
// (sched::unpaired_time) less its unsplit compute.
PipelineRun pipeline_analytic(const Layout& l, const StagePlan& sp, TimePlan& tp) {
  const int64_t m = l.microbatches;
  double worst = 0;
  for (int r = 0; r < l.pp; ++r) {
    double unpaired = 1.0;  // the share of the rank's chunks whose all-to-all is not overlapped
    if (l.ep_overlap && !sp.from_csv) {
      sched::GenSpec g = sp.spec;
      g.microbatches = int(m);
      const double chunks = double(m) * double(sp.rank_stages[size_t(r)].size());
      unpaired = std::min(1.0, double(sched::warmup_forwards(g, r)) / chunks);
    }
    // The steady per-micro-batch time stretches by the ramp; the unpaired exchanges are paid once per chunk
    // (they sit in the ramp, where the other ranks idle anyway, so the ramp does not stretch them again).
    double steady = 0, once = 0;
    for (int st : sp.rank_stages[size_t(r)]) {
      const auto& x = tp.stages[size_t(st)];
      const double a2a = x.a2a_f + x.a2a_b, compute = x.f + x.i + x.w;
      steady += compute + (1 - unpaired) * std::max(0.0, a2a - compute) + 2 * tp.p2p;
      // The unpaired forward and backward (a B: ep_overlap runs interleaved_1f1b) beyond their compute.
      const bool split = l.ep_overlap_split;
      const double exposed_f = sched::unpaired_time(x.f, x.a2a_f, x.f2, x.a2a_f2, split, x.n_a2a) - x.f;
      // Carried weight gradients (tp.carry_w): the B runs as an I and the weight gradient it queues fills the
      // next unpaired backward's wait, as the replay does in the cool-down.
      const CarriedB cb = carried_b(x, split);
      const double exposed_b =
          tp.carry_w ? std::max(0.0, cb.wait - cb.w)
                     : sched::unpaired_time(x.i + x.w, x.a2a_b, x.i2 + x.w2, x.a2a_b2, split, x.n_a2a) - (x.i + x.w);
      once += unpaired * (exposed_f + exposed_b);
    }
    worst = std::max(worst, steady * (double(m) + double(l.pp - 1) / double(l.vpp)) + once * double(m));
  }
  tp.pipeline_time = worst;
  tp.bubble_ratio = 1.0 - double(m) / (double(m) + double(l.pp - 1) / double(l.vpp));
  tp.simulated = false;
  return PipelineRun{std::vector<double>(size_t(l.pp), 0.0), {}, 0};
}

// The stage windows of pipeline rank r for the overlapped DP collectives: the replay's, or analytic ones for the
// rank placed first in the pipeline (the shortest windows); each with its stage's share of the rank's parameters
// by its layers (the embedding and the head count as one layer each).
std::vector<DpWindow> rank_windows(const Layout& l, const StagePlan& sp, const TimePlan& tp, const PipelineRun& pr,
                                   int r, double end) {
  const auto& own = sp.rank_stages[size_t(r)];
  auto stage_layers = [&](int st) {
    const size_t i = size_t(st);
    return double(sp.n_moe[i] + sp.n_dense[i] + sp.first[i] + sp.last[i]);
  };
  double layers = 0;
  for (int st : own) layers += stage_layers(st);
  std::vector<DpWindow> w;
  for (size_t c = 0; c < own.size(); ++c) {
    const int st = own[c];
    DpWindow x;
    if (!pr.windows.empty()) x = pr.windows[size_t(r)][size_t(st)];
    else {
      // Analytic: chunk c's first forward ends after c groups of forwards of the earlier chunks, its last
      // backward starts c groups of backwards before the end (Megatron's interleaved order; one chunk under 1F1B).
      const double G = double(sp.spec.group_size > 0 ? sp.spec.group_size : l.pp);
      const auto& x0 = tp.stages[size_t(st)];
      x.first_fwd_end = (double(c) * G + 1) * x0.f;
      x.last_bwd_start = end - (double(c) * G + 1) * (x0.i + x0.w);
      // Carried weight gradients longer than the waits that could run them pile up and run at the rank's end
      // (the replay's shape): the stage's reduction starts there.
      if (tp.carry_w) {
        const CarriedB cb = carried_b(x0, l.ep_overlap_split);
        if (cb.w > cb.wait) x.last_bwd_start = end;
      }
    }
    x.share = stage_layers(st) / std::max(layers, 1.0);
    w.push_back(x);
  }
  return w;
}

// Data parallel for pipeline rank r: gradients reduced (reduce-scatter with a distributed optimizer, else
// all-reduce) after the last micro-batch's backward, overlapped with that backward; parameters all-gathered after
// the step, overlapped with the first micro-batch's forward. FSDP (zero 3) gathers per micro-batch and hides
// behind each stage's compute (prefetch); HSDP adds the replicas' all-reduce of the gradient shard once per step.
// Its exposed and total seconds.
struct DpCost {
  double exposed = 0, total = 0;
};
DpCost dp_rank(const Layout& l, const Hardware& h, const TimeOptions& o, const StagePlan& sp, const TimePlan& tp,
               const PipelineRun& pr, const RankMemory& rm, int r) {
  const PlanOptions& po = o.memory;
  const int64_t m = l.microbatches;
  // HSDP (zero 3, dp_shard < dp): gathers and reduce-scatters inside the shard group (dp_shard, inner to the
  // replicas), the experts' inside its ranks holding the same experts; then one all-reduce of the gradient shard
  // over the dp / dp_shard replicas per step.
  const bool hsdp = l.zero == 3 && l.dp_shard > 0 && l.dp_shard < l.dp;
  const int64_t dsh = hsdp ? l.dp_shard : l.dp, esh = hsdp ? std::max<int64_t>(1, l.edp() * dsh / l.dp) : l.edp();
  const Group gd = place(h, dsh * l.cp, l.tp);
  const Group ge = place(h, esh, l.ep * l.etp);
  const double Pd = rm.params_tp_sharded + rm.params_replicated, Pe = rm.params_experts;
  double f1 = 0, b1 = 0;
  for (int st : sp.rank_stages[size_t(r)]) f1 += tp.stages[size_t(st)].f, b1 += tp.stages[size_t(st)].i + tp.stages[size_t(st)].w;
  const double gb = po.recipe.grad, pb = po.recipe.param;
  double red = 0, gather = 0;
  // The engine all-reduces the gradients with ZeRO-1 too (each rank then updates its shard and the parameters
  // are all-gathered); a distributed optimizer reduce-scatters them.
  const bool scatter = l.zero >= 1 && !(po.recipe.engine_buffers && l.zero < 3);
  auto red_fn = [&](double bytes, Group g) { return scatter ? reduce_scatter(h, bytes, g) : all_reduce(h, bytes, g); };
  red = red_fn(Pd * gb, gd) + (Pe > 0 ? red_fn(Pe * gb, ge) : 0.0);
  if (l.zero >= 1) gather = all_gather(h, Pd * pb, gd) + (Pe > 0 ? all_gather(h, Pe * pb, ge) : 0.0);
  DpCost dc;
  const double hide_f = o.overlap_dp ? f1 : 0.0, hide_b = o.overlap_dp ? b1 : 0.0;
  if (l.zero == 3) {
    // per micro-batch: gather for forward and again for backward, reduce-scatter of the gradients
    const double per_mb = 2 * gather + red;
    // HSDP's replica all-reduce runs after the step's backward (the engine's order), exposed.
    const double rep = hsdp ? all_reduce(h, (Pd / double(dsh * l.cp) + Pe / double(esh)) * gb,
                                         place(h, l.dp / dsh, l.tp * l.cp * dsh))
                            : 0.0;
    dc.total = per_mb * double(m) + rep;
    dc.exposed = double(m) * (std::max(0.0, gather - hide_f) + std::max(0.0, gather + red - hide_b)) + rep;
  } else if (!o.overlap_dp) {
    dc.total = dc.exposed = red + gather;
  } else {
    // Stage by stage behind the pipeline (DpWindow).
    const double end = pr.windows.empty() ? tp.pipeline_time : pr.windows_end;
    const std::vector<DpWindow> w = rank_windows(l, sp, tp, pr, r, end);
    dc.total = red + gather;
    dc.exposed = reduce_overrun(w, red, end) + gather_stall(w, gather);
  }
  return dc;
}


// Breakdown: the slowest rank's compute parts per micro-batch times m, exposed EP, p2p and bubble the rest.
void fill_breakdown(const Layout& l, const StagePlan& sp, const PipelineRun& pr, TimePlan& tp) {
  const int64_t m = l.microbatches;
  int worst = 0;
  double wt = -1;
  for (int r = 0; r < l.pp; ++r) {
    double t = 0;
    for (int st : sp.rank_stages[size_t(r)]) t += tp.stages[size_t(st)].f + tp.stages[size_t(st)].i + tp.stages[size_t(st)].w;
    if (t > wt) wt = t, worst = r;
  }
  StageTime sum;
  for (int st : sp.rank_stages[size_t(worst)]) {
    const auto& x = tp.stages[size_t(st)];
    for (int k = 0; k < kNumPlanOps; ++k)
      tp.ops_f[size_t(k)] += x.op_f[size_t(k)] * double(m), tp.ops_b[size_t(k)] += x.op_b[size_t(k)] * double(m);
    sum.gemm += x.gemm, sum.attention += x.attention, sum.memory_bound += x.memory_bound, sum.quantize += x.quantize;
    sum.recompute += x.recompute, sum.tp_comm += x.tp_comm, sum.cp_comm += x.cp_comm;
    sum.host_f += x.host_f, sum.host_b += x.host_b, sum.comm_sm += x.comm_sm;
  }
  const double mm = double(m);
  auto& b = tp.breakdown;
  b["compute.gemm"] = sum.gemm * mm;
  b["compute.attention"] = sum.attention * mm;
  b["compute.memory_bound"] = sum.memory_bound * mm;
  b["compute.fp8_quantize"] = sum.quantize * mm;
  b["compute.recompute"] = sum.recompute * mm;
  b["comm.tp"] = sum.tp_comm * mm;
  b["comm.cp"] = sum.cp_comm * mm;
  b["host.exposed"] = (sum.host_f + sum.host_b) * mm;
  if (sum.comm_sm > 0) b["compute.comm_sm_share"] = sum.comm_sm * mm;
  // Exposed EP: what the timed replay charged this rank beyond compute (under ep_overlap the unpaired warm-up
  // forwards and cool-down backwards, and each fused pair's exchange beyond its compute).
  b["comm.ep"] = pr.a2a_exposed[size_t(worst)];
  b["comm.pp_p2p"] = 0;
  double accounted = 0;
  for (const auto& [k, v] : b) accounted += v;
  b["bubble_and_p2p"] = std::max(0.0, tp.pipeline_time - accounted);
  b["comm.dp_exposed"] = tp.dp_exposed;
  b["optimizer"] = tp.optimizer;
  b["weight_refresh"] = tp.weight_refresh;
  b.erase("comm.pp_p2p");
}

TimePlan plan_time_with(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o,
                        const MemoryPlan* memory, const StagePlan* stages, const std::vector<StageTime>* durations,
                        bool carry) {
  const ModelSpec& s = c.model;
  TimePlan tp;
  tp.layout = l;
  tp.hardware = h.name;
  tp.carry_w = carry;
  const auto spp = stages ? nullptr : stage_plan(c, l);
  const StagePlan& sp = stages ? *stages : *spp;
  if (durations) {
    MT_CHECK(durations->size() == sp.stage_layers.size(), "plan time", "durations for ", durations->size(),
             " stages, the layout has ", sp.stage_layers.size());
    tp.stages = *durations;
  } else {
    tp.stages = stage_times(c, l, h, o, sp);
  }
  const double T = l.tokens_per_rank(c.training.seq_len);
  const bool pp_cross = l.world() / l.pp >= h.scale_up.domain;
  // Each tp rank sends 1/tp of the boundary activation: its sequence shard under sequence parallelism, else
  // Megatron's scatter / gather split of the replicated tensor (Narayanan et al. 2021, section 4.1).
  tp.p2p = l.pp > 1 ? p2p(h, T / double(l.tp) * double(s.d_model) * 2, pp_cross) : 0.0;
  const PipelineRun pr = o.simulate ? pipeline_simulated(l, sp, tp) : pipeline_analytic(l, sp, tp);

  // Per pipeline rank: the DP collectives, the optimizer and the weight refresh; the slowest rank counts.
  MemoryPlan own;
  if (!memory) own = dp_memory(c, l, h, o, sp);
  const MemoryPlan& mp = memory ? *memory : own;
  for (int r = 0; r < l.pp; ++r) {
    const RankMemory& rm = mp.per_rank[size_t(r)];
    const DpCost dc = dp_rank(l, h, o, sp, tp, pr, rm, r);
    if (dc.exposed > tp.dp_exposed) tp.dp_exposed = dc.exposed, tp.dp_total = dc.total;
    tp.optimizer = std::max(tp.optimizer, optimizer_rank(l, h, o.memory.recipe, rm) +
                                              newton_schulz_rank(c, l, h, o.memory.recipe, sp, r));
    tp.weight_refresh = std::max(tp.weight_refresh, refresh_rank(l, h, o.memory.recipe, rm));
  }
  tp.step_time = tp.pipeline_time + tp.dp_exposed + tp.optimizer + tp.weight_refresh;

  const double world = double(l.world());
  tp.tokens_per_step = double(c.training.global_batch_size) * double(c.training.seq_len);
  tp.tokens_per_s_per_gpu = tp.tokens_per_step / tp.step_time / world;
  const double fl = o.model_flops_per_token > 0 ? o.model_flops_per_token : flops_per_token(s, c.training.seq_len).train;
  tp.tflops_per_gpu = fl * tp.tokens_per_s_per_gpu / 1e12;
  tp.mfu = fl * tp.tokens_per_s_per_gpu / h.peak_bf16;
  // (Not for the analytic pass: the search ranks by throughput alone and projects the winners again.)
  if (o.simulate) fill_breakdown(l, sp, pr, tp);
  return tp;
}

}  // namespace

TimePlan plan_time(const JobConfig& c, const Layout& l, const Hardware& h, const TimeOptions& o,
                   const MemoryPlan* memory, const StagePlan* stages, const std::vector<StageTime>* durations) {
  // Carrying weight gradients under ep_overlap is the engine's parallelism.ep_pair_backward: iwcarry carries; b, iw
  // and iwfill do not (the replay prices a pair as max(f + b, a2a) whatever the order inside it, and an unpaired
  // backward whole); auto is iwcarry where the engine can fill (free lane order, no [quantize]) and b elsewhere,
  // a choice the engine makes at run time, so the projection takes the faster of the two. Without ep_overlap in
  // the layout the key is moot (as in the engine).
  const ParallelSpec& p = c.parallelism;
  if (l.ep_overlap) validate_overlap_lanes(c);  // iwcarry under turns or [quantize]: the engine refuses it too
  const bool can = l.ep_overlap && c.quantize.recipe == Fp8Recipe::None && p.ep_baton == "free";
  const int carry = p.ep_pair_backward == "iwcarry" ? 1 : p.ep_pair_backward == "auto" ? -1 : 0;
  if (!can || carry >= 0) return plan_time_with(c, l, h, o, memory, stages, durations, can && carry == 1);
  // Both projections share the stage plan, the stage durations and the memory projection: priced once here.
  const auto spp = stages ? nullptr : stage_plan(c, l);
  const StagePlan& sp = stages ? *stages : *spp;
  const std::vector<StageTime> own_d = durations ? std::vector<StageTime>{} : stage_times(c, l, h, o, sp);
  const MemoryPlan own_m = memory ? MemoryPlan{} : dp_memory(c, l, h, o, sp);
  const std::vector<StageTime>* d = durations ? durations : &own_d;
  const MemoryPlan* m = memory ? memory : &own_m;
  TimePlan plain = plan_time_with(c, l, h, o, m, &sp, d, false);
  TimePlan carried = plan_time_with(c, l, h, o, m, &sp, d, true);
  return carried.step_time < plain.step_time ? carried : plain;
}

}  // namespace moetron::plan
