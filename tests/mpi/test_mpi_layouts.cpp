// test_mpi_layouts.cpp: the layout sweep. `moetron train` on ds_tiny (8 routed experts, top-2, 2 MoE layers),
// synthetic data, 5 steps of the same global batch (8 sequences, micro-batch 1), under mpirun with 1, 2, 4
// and 8 ranks, for every layout that fits the world: data parallel only, ZeRO-1, FSDP, expert parallel 2/4/8 with
// the three dispatchers, with and without the FP8 dispatch payload, EP mixed with ZeRO-1 and dp_replicate, HSDP,
// pipelines, tensor parallelism (with sequence parallelism), context parallelism and their combinations, and
// qk_norm (Qwen3's per-head q/k RMSNorm) under DP and TP, and multi-token prediction under DP, PP, EP and FSDP.
// Every rank also trains the single-process reference (comm_local(), once per process) and each layout is
// compared with it. Then every impossible layout is started and must fail with an error naming its rule.
//
// What is bitwise and what is not (the tolerances below follow from this):
//  - Step 1's loss is BITWISE the single-process loss for data parallelism and for EP with the flat
//    dispatchers (alltoall, sync_free): parameters are equal, each token's forward is computed by the same
//    kernels on the same values (the bf16 dispatch payload is exact: the expert GEMMs consume bf16 rows on
//    one process too; combine brings fp32 rows back and sums them in slot order on the home rank, as
//    moe_unpermute does), and the per-micro-batch loss sums are folded in global micro-batch order.
//  - Hierarchical combine adds a token's expert outputs per node first (ep_dispatch.h): a different fp32
//    association, so step 1 differs by a few ulps of the MoE output: relative 1e-6 on the loss.
//  - Step 1's gradient (the reduced gradient the optimizer gets, in the global layout): one process
//    accumulates micro-batch gradients into the buffer in order; DP folds per-rank sums in rank order, and
//    under EP a rank's expert weight gradient sums the rows of all EP ranks' micro-batches in one grouped
//    GEMM. Same terms, different fp32 association: each element differs by <~ n * 2^-24 * sum |terms|, a
//    few 1e-7 relative; kGradRel = 1e-6 on the relative L2 of the whole gradient. This is the sharp check
//    of the backward: measured 4.8e-8 on 2 ranks; scaling ONE expert tensor's gradient by 0.999 gives 3e-5, and
//    dropping the routing-weight gradient by far more, while both barely move the loss after 5 steps.
//  - Steps 2..5: parameters differ by the reassociation above, and then by routing: a token whose top-k
//    scores are within that noise of a tie can pick another expert, a discrete change that shifts a few
//    experts' gradients by one token's share (measured on 4 ranks: 37% of the elements end up > 1e-6 apart,
//    relative L2 1.6e-4, loss 7e-6; on 2 and 8 ranks no flip occurs and the relative L2 is 3e-8). So the
//    trajectory is held to kLossRel = 1e-4 and kParamRelL2 = 1e-3: an order of magnitude above the
//    routing-flip effect, well below what a wrong gradient does in 5 steps (the missing routing-weight
//    gradient: params 2.4e-3 apart), and step 1 above is the precise check.
//  - FP8 payload: E4M3 keeps 3 mantissa bits, so each dispatched element has relative error <= 2^-4 (RNE,
//    1x128 block scales keep it in the normal range). That perturbs the expert inputs, hence the expert
//    outputs and every gradient downstream, by up to ~6%: kFp8GradRel = 0.1. AdamW's per-element step is
//    at most ~lr, so an element's update can change by up to ~lr * 2^-4 per step: after 5 steps |dp| <=
//    5 * 1e-3 * 2^-4 = 3e-4 against |p| ~ init_std 0.02, i.e. 1.6e-2 relative: kFp8ParamRelL2 = 2e-2.
//    The loss moves by the change of the MoE branch output: kFp8LossRel = 1e-2. The test prints the
//    measured error against one process (and so against the bf16 payload, which is exact).
//  - Tensor parallelism (Bar::Tp, fp32 compute): a row-parallel output (wo, w2, the experts' down projections)
//    is the sum of tp partial products over the heads / columns each rank holds, added by the reduce-scatter,
//    where one process sums all of them in one GEMM: the same terms in another fp32 association, so each output
//    element moves by <~ 2 * 2^-24 * sum |terms|. The partial gradients (the norms over the sequence shards, MLA's
//    latent gradients, the routing-weight gradients) are 2-term sums the same way. Step 1's loss is held to
//    kTpStep1LossRel = 1e-6 (measured: a few 1e-8 or bitwise), the trajectory to kTpLossRel = 1e-5 (the bar;
//    a routing flip moved DP runs by 7e-6, so a flip would show), the gradient and parameters to the DP bars.
// Replicas: whatever the layout, the parameters (gathered to the global layout) and the logged loss and
// grad norm are bitwise identical on every rank after every step.
// FSDP (zero = 3) is in the sweep too (its memory, resume and checkpoint tests are in test_mpi_train.cpp), and
// HSDP (zero = 3 with dp_replicate > 1, with and without EP) under the DP bars.
// Not a benchmark.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "moetron/gemm.h"
#include "moetron/accounting.h"
#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/param_layout.h"
#include "moetron/trainer.h"
#include "train_check.h"

using namespace moetron;
namespace fs = std::filesystem;

using namespace mt_test;  // world, repo, recorded, expect_same_on_all_ranks

namespace {

constexpr int kSteps = 5;
constexpr int64_t kMicro = 1, kGlobal = 8;
constexpr double kGradRel = 1e-6, kLossRel = 1e-4, kParamRelL2 = 1e-3;
constexpr double kHierStep1LossRel = 1e-6;
constexpr double kTpStep1LossRel = 1e-6, kTpLossRel = 1e-5;
constexpr double kFp8GradRel = 0.1, kFp8LossRel = 1e-2, kFp8ParamRelL2 = 2e-2;


JobConfig tiny(const std::string& dump, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> ov = {"--job.dump_folder=" + dump,
                                 "--training.dataset=synthetic",
                                 "--metrics.peak_tflops=1.0",
                                 "--metrics.log_interval=1",
                                 "--checkpoint.enable=false",
                                 "--training.steps=" + std::to_string(kSteps),
                                 "--training.micro_batch_size=" + std::to_string(kMicro),
                                 "--training.global_batch_size=" + std::to_string(kGlobal)};
  ov.insert(ov.end(), extra.begin(), extra.end());
  return load_config(repo("configs/ds_tiny.toml"), ov);
}

std::string shared_dir(const std::string& name) { return mt_test::shared_dir("moetron_mpi_layout_", name); }

// The single-process run of the same model: the layout's --model.* and --quantize.* overrides (e.g. a capacity
// factor, an FP8 recipe) apply to it too. Trained once per model per process, on this rank alone.
const TrainResult& reference(const std::vector<std::string>& layout_args) {
  static std::map<std::string, TrainResult> cache;
  std::vector<std::string> model_args;
  std::string key;
  for (auto& a : layout_args)
    if (a.rfind("--model.", 0) == 0 || a.rfind("--quantize.", 0) == 0 || a.rfind("--training.compute_dtype", 0) == 0)
      model_args.push_back(a), key += a + " ";
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  static Comm local = comm_local();
  std::string d = temp_dir("moetron_mpi_layout_ref_rank" + std::to_string(world().rank()), std::to_string(cache.size()));
  fs::remove_all(d);
  return cache.emplace(key, train(tiny(d, model_args), recorded(&local))).first->second;
}

// The model a layout trains (ds_tiny with the layout's --model.* overrides).
ModelSpec reference_spec(const std::vector<std::string>& layout_args) {
  std::vector<std::string> model_args;
  for (auto& a : layout_args)
    if (a.rfind("--model.", 0) == 0) model_args.push_back(a);
  return tiny("unused", model_args).model;
}

enum class Bar { Exact, Hier, Fp8, Bitwise, Tp };

struct Layout {
  std::string name;
  int world;
  std::vector<std::string> args;
  Bar bar;
};

std::vector<Layout> layouts() {
  const std::string dp = "--parallelism.dp_shard=";
  std::vector<Layout> v;
  for (int w : {1, 2, 4, 8}) {
    const std::string W = std::to_string(w);
    v.push_back({"dp" + W, w, {dp + W}, Bar::Exact});
    if (w > 1) v.push_back({"dp" + W + "_zero1", w, {dp + W, "--parallelism.zero=1"}, Bar::Exact});
    if (w > 1) v.push_back({"dp" + W + "_fsdp", w, {dp + W, "--parallelism.zero=3"}, Bar::Exact});
    if (w == 2)
      v.push_back({"dp2_qk_norm", 2,
                   {dp + "2", "--model.attn_type=gqa", "--model.n_kv_heads=2", "--model.qk_norm=true"}, Bar::Exact});
    // Multi-token prediction (model.mtp_layers): its block is one more MoE layer, its eh_proj and norms dense
    // parameters; under DP, EP and FSDP they reduce like any other.
    if (w == 2) v.push_back({"dp2_mtp", 2, {dp + "2", "--model.mtp_layers=2"}, Bar::Exact});
  }
  for (int w : {2, 4, 8})
    for (int ep : {2, 4, 8}) {
      if (ep > w) continue;
      const std::string W = std::to_string(w), E = std::to_string(ep), base = "ep" + E + "_np" + W;
      const std::vector<std::string> a = {dp + W, "--parallelism.ep=" + E};
      auto with = [&](std::vector<std::string> extra) {
        std::vector<std::string> r = a;
        r.insert(r.end(), extra.begin(), extra.end());
        return r;
      };
      // Hierarchical: two "nodes" inside the EP group (ranks_per_node = ep / 2), so both stages run.
      const std::string rpn = "--parallelism.ranks_per_node=" + std::to_string(ep / 2);
      for (bool fp8 : {false, true}) {
        const std::string f = fp8 ? "--parallelism.fp8_dispatch=true" : "--parallelism.fp8_dispatch=false";
        const std::string sfx = fp8 ? "_fp8" : "";
        const Bar flat = fp8 ? Bar::Fp8 : Bar::Exact, hier = fp8 ? Bar::Fp8 : Bar::Hier;
        v.push_back({base + "_alltoall" + sfx, w, with({"--parallelism.ep_dispatcher=alltoall", f}), flat});
        v.push_back({base + "_sync_free" + sfx, w, with({"--parallelism.ep_dispatcher=sync_free", f}), flat});
        v.push_back({base + "_hierarchical" + sfx, w, with({"--parallelism.ep_dispatcher=hierarchical", rpn, f}), hier});
      }
      if (w == ep) {  // the rows through shared memory (ep_transport = "shm"): the same arithmetic, bitwise
        v.push_back({base + "_alltoall_shm", w, with({"--parallelism.ep_transport=shm"}), Bar::Exact});
        v.push_back({base + "_sync_free_shm", w,
                     with({"--parallelism.ep_dispatcher=sync_free", "--parallelism.ep_transport=shm"}), Bar::Exact});
      }
      if (w > ep) v.push_back({base + "_zero1", w, with({"--parallelism.zero=1"}), Bar::Exact});
      v.push_back({base + "_fsdp", w, with({"--parallelism.zero=3"}), Bar::Exact});
    }
  // Capacity drops: the home rank's capacity plan drops slots before dispatch (sent as -1), per micro-batch
  // exactly as one process drops them.
  v.push_back({"ep2_np2_capacity", 2, {dp + "2", "--parallelism.ep=2", "--model.capacity_factor=1.0"}, Bar::Exact});
  v.push_back({"ep4_np4_capacity_hierarchical", 4,
               {dp + "4", "--parallelism.ep=4", "--model.capacity_factor=1.0", "--parallelism.ep_dispatcher=hierarchical",
                "--parallelism.ranks_per_node=2"},
               Bar::Hier});
  // Aux-loss-free balancing: the expert bias is updated from router counts summed over DP, identical on every
  // rank (the parameter hash and final parameters include the biases).
  v.push_back({"ep2_np2_aux_free", 2, {dp + "2", "--parallelism.ep=2", "--model.load_balance=aux_free"}, Bar::Exact});
  v.push_back({"ep4_np8_aux_free_fsdp", 8,
               {dp + "8", "--parallelism.ep=4", "--model.load_balance=aux_free", "--parallelism.zero=3"}, Bar::Exact});
  // Pipeline parallelism. Alone it is BITWISE the single-process run at every step: each stage accumulates
  // its weight gradients in micro-batch order (every generator runs a stage's B or W in micro-batch order; the
  // split backward replays the deferred GEMMs on copies of their operands), the loss and aux sums are folded in
  // micro-batch and layer order, the gradient norm per parameter in global order, and tied embeddings add the
  // head's gradient after the embedding rows on both copies. Combined with DP / EP / FSDP the DP bars apply.
  const std::string pp = "--parallelism.pp=", sch = "--parallelism.pp_schedule=", lay = "--parallelism.pp_layout=";
  const std::string six = "--model.n_layers=6";
  for (int p : {2, 4}) {
    const std::string P = std::to_string(p);
    const std::string one = p == 2 ? "Ett|tL" : "Et|t|t|L";  // one stage per rank
    for (const char* name : {"gpipe", "1f1b", "zb1p"})
      v.push_back({"pp" + P + "_" + name, p, {pp + P, sch + name, lay + one}, Bar::Bitwise});
    for (const char* name : {"interleaved_1f1b", "zbv", "dualpipev"}) {  // two stages per rank
      if (p == 2) v.push_back({"pp2_" + std::string(name), 2, {pp + P, sch + name, lay + "Et|t|t|L"}, Bar::Bitwise});
      else v.push_back({"pp4_" + std::string(name), 4, {six, pp + P, sch + name, lay + "E|t|t|t|t|t|t|L"}, Bar::Bitwise});
    }
  }
  v.push_back({"pp2_interleaved_uneven", 2, {pp + "2", sch + "interleaved_1f1b", lay + "Ett|t||L"}, Bar::Bitwise});
  v.push_back({"pp2_even_split_less_layers", 2,
               {pp + "2", "--parallelism.pp_first_stage_less_layers=1", "--parallelism.pp_last_stage_less_layers=1"},
               Bar::Bitwise});
  v.push_back({"pp2_tied", 2, {"--model.tie_embeddings=true", pp + "2", lay + "Ett|tL"}, Bar::Bitwise});
  v.push_back({"pp2_zbv_tied", 2, {"--model.tie_embeddings=true", pp + "2", sch + "zbv", lay + "Et|t|t|L"}, Bar::Bitwise});
  // MTP on the last stage (with a copy of the embedding, whose gradient joins the first stage's like a tied head's):
  // bitwise one process, with 1F1B and with the split backward; with EP and FSDP the DP bars.
  v.push_back({"pp2_mtp", 2, {"--model.mtp_layers=2", pp + "2", lay + "Ett|tmmL"}, Bar::Bitwise});
  v.push_back({"pp2_zbv_mtp", 2, {"--model.mtp_layers=1", pp + "2", sch + "zbv", lay + "Et|t|t|L"}, Bar::Bitwise});
  v.push_back({"ep2_np2_mtp_fsdp", 2,
               {dp + "2", "--parallelism.ep=2", "--parallelism.zero=3", "--model.mtp_layers=1"}, Bar::Exact});
  // FSDP with MTP under PP: the last stage's embedding copy is its own FSDP unit; the depths' rows join it per
  // micro-batch before its reduce-scatter, and the two stages' shards are exchanged after the step (the DP bars).
  // With the V-shape schedule the first and last stage share a rank and its embedding's backward folds them.
  v.push_back({"pp2_dp2_fsdp_mtp", 4,
               {pp + "2", dp + "2", "--parallelism.zero=3", "--model.mtp_layers=1", lay + "Ett|tmL"}, Bar::Exact});
  v.push_back({"pp2_dp2_fsdp_zbv_mtp", 4,
               {pp + "2", dp + "2", "--parallelism.zero=3", "--model.mtp_layers=1", sch + "zbv", lay + "Et|t|t|L"},
               Bar::Exact});
  v.push_back({"pp2_aux_free", 2, {"--model.load_balance=aux_free", pp + "2", lay + "Et|ttL"}, Bar::Bitwise});
  v.push_back({"pp2_recompute_stage0", 2,
               {pp + "2", lay + "Ett|tL", "--activation_checkpoint.mode=full", "--activation_checkpoint.stage_ids=[0]"},
               Bar::Bitwise});
  v.push_back({"pp2_dp2_1f1b", 4, {pp + "2", dp + "2", lay + "Ett|tL"}, Bar::Exact});
  v.push_back({"pp2_dp2_zero1", 4, {pp + "2", dp + "2", "--parallelism.zero=1", lay + "Ett|tL"}, Bar::Exact});
  v.push_back({"pp2_dp2_fsdp_zb1p", 4, {pp + "2", dp + "2", "--parallelism.zero=3", sch + "zb1p", lay + "Ett|tL"},
               Bar::Exact});
  v.push_back({"pp2_ep2_alltoall", 4, {pp + "2", dp + "2", "--parallelism.ep=2", lay + "Et|ttL"}, Bar::Exact});
  v.push_back({"pp2_ep4_hierarchical_interleaved", 8,
               {pp + "2", dp + "4", "--parallelism.ep=4", "--parallelism.ep_dispatcher=hierarchical",
                "--parallelism.ranks_per_node=2", sch + "interleaved_1f1b", lay + "Et|t|t|L"},
               Bar::Hier});
  v.push_back({"pp4_dp2_zbv", 8, {six, pp + "4", dp + "2", sch + "zbv", lay + "E|t|t|t|t|t|t|L"}, Bar::Exact});
  // FP8 training ([quantize]) against one process with the same recipe. Data and pipeline parallelism keep each
  // micro-batch's GEMMs as they are on one process (the expert rows are quantized per expert, the dense rows per
  // micro-batch; delayed scaling reduces its amaxes over every rank): DP is Exact, PP Bitwise. Under EP an expert
  // computes the rows of all EP ranks' micro-batches at once, so the wgrad operands' token tiles (and a tensorwise
  // expert scale) span other rows than on one process: the FP8 bar.
  const std::string rec = "--quantize.recipe=", fmt = "--quantize.format=hybrid";
  v.push_back({"dp2_fp8_rowwise", 2, {dp + "2", rec + "rowwise", fmt}, Bar::Exact});
  v.push_back({"ep2_np2_fp8_blockwise", 2, {dp + "2", "--parallelism.ep=2", rec + "blockwise", fmt}, Bar::Fp8});
  v.push_back({"ep2_np2_fp8_delayed", 2,
               {dp + "2", "--parallelism.ep=2", rec + "tensorwise", "--quantize.scaling=delayed"}, Bar::Fp8});
  v.push_back({"pp2_fp8_mxfp8", 2, {pp + "2", lay + "Ett|tL", rec + "mxfp8", fmt}, Bar::Bitwise});
  v.push_back({"pp2_fp8_delayed", 2,
               {pp + "2", lay + "Ett|tL", rec + "tensorwise", "--quantize.scaling=delayed"}, Bar::Bitwise});
  // FP8 with MTP: the MTP blocks' FP8 linears on the last stage, their delayed-scaling amaxes reduced over every rank
  // with the others (the scales every rank uses are one process's), and the split backward's deferred FP8 weight
  // gradients of the MTP block and eh_proj: bitwise one process.
  v.push_back({"pp2_fp8_delayed_mtp", 2,
               {"--model.mtp_layers=1", pp + "2", lay + "Ett|tmL", rec + "tensorwise", "--quantize.scaling=delayed"},
               Bar::Bitwise});
  v.push_back({"pp2_zbv_fp8_blockwise_mtp", 2,
               {"--model.mtp_layers=1", pp + "2", sch + "zbv", lay + "Et|t|t|L", rec + "blockwise", fmt}, Bar::Bitwise});
  // HSDP (zero = 3 with dp_replicate > 1): parameters sharded over dp_shard and replicated over dp_replicate; a
  // unit's gradient reduce-scattered in its shard group, the step's shard then all-reduced over the replicas (a
  // different association of the same rank-order sums: the DP bars). Under EP the expert runs are sharded over
  // the shard group's ranks holding the same experts.
  const std::string rep = "--parallelism.dp_replicate=", z3 = "--parallelism.zero=3";
  v.push_back({"hsdp2x2", 4, {rep + "2", dp + "2", z3}, Bar::Exact});
  v.push_back({"hsdp2x2_ep2", 4, {rep + "2", dp + "2", z3, "--parallelism.ep=2"}, Bar::Exact});
  v.push_back({"hsdp2x4", 8, {rep + "2", dp + "4", z3}, Bar::Exact});
  v.push_back({"hsdp4x2", 8, {rep + "4", dp + "2", z3}, Bar::Exact});
  v.push_back({"hsdp2x4_ep2", 8, {rep + "2", dp + "4", z3, "--parallelism.ep=2"}, Bar::Exact});
  v.push_back({"hsdp2x4_ep4_sync_free", 8,
               {rep + "2", dp + "4", z3, "--parallelism.ep=4", "--parallelism.ep_dispatcher=sync_free"}, Bar::Exact});
  v.push_back({"ep2_rep2_shard2_zero1", 4,
               {"--parallelism.dp_replicate=2", "--parallelism.dp_shard=2", "--parallelism.ep=2", "--parallelism.zero=1"},
               Bar::Exact});
  // Tensor parallelism with sequence parallelism (fp32 compute; expert_tp = tp: every expert's width is divided).
  const std::vector<std::string> tp2 = {"--parallelism.tp=2", "--parallelism.expert_tp=2", "--training.compute_dtype=fp32"};
  auto tpw = [&](std::vector<std::string> extra) {
    std::vector<std::string> r = tp2;
    r.insert(r.end(), extra.begin(), extra.end());
    return r;
  };
  const std::vector<std::string> mla = {"--model.attn_type=mla", "--model.q_lora_rank=32", "--model.kv_lora_rank=32",
                                        "--model.qk_nope_head_dim=16", "--model.qk_rope_head_dim=8",
                                        "--model.v_head_dim=16"};
  v.push_back({"tp2", 2, tp2, Bar::Tp});
  v.push_back({"tp2_mla", 2, tpw(mla), Bar::Tp});
  // qk_norm (Qwen3's per-head q/k RMSNorm, GQA): under TP each rank norms its own heads, its weight gradient is a
  // partial sum over them (TpKind::Partial), summed over the TP group: the 2-term reassociation above.
  const std::vector<std::string> qkn = {"--model.attn_type=gqa", "--model.n_kv_heads=2", "--model.qk_norm=true"};
  v.push_back({"tp2_qk_norm", 2, tpw(qkn), Bar::Tp});
  v.push_back({"tp2_gqa_tied", 2, tpw({"--model.attn_type=gqa", "--model.n_kv_heads=2", "--model.tie_embeddings=true"}),
               Bar::Tp});
  v.push_back({"tp2_recompute", 2, tpw({"--activation_checkpoint.mode=full"}), Bar::Tp});
  v.push_back({"tp4", 4, {"--parallelism.tp=4", "--parallelism.expert_tp=4", "--training.compute_dtype=fp32"}, Bar::Tp});
  v.push_back({"tp2_dp2_zero1", 4, tpw({dp + "2", "--parallelism.zero=1"}), Bar::Tp});
  v.push_back({"tp2_dp2_ep2_alltoall", 4, tpw({dp + "2", "--parallelism.ep=2"}), Bar::Tp});
  v.push_back({"tp2_dp2_ep2_sync_free", 4, tpw({dp + "2", "--parallelism.ep=2", "--parallelism.ep_dispatcher=sync_free"}),
               Bar::Tp});
  v.push_back({"tp2_pp2_zb1p", 4, tpw({pp + "2", sch + "zb1p", lay + "Ett|tL"}), Bar::Tp});
  std::vector<std::string> mla_pp = mla;
  mla_pp.insert(mla_pp.end(), {pp + "2", sch + "interleaved_1f1b", lay + "Et|t|t|L"});
  v.push_back({"tp2_pp2_interleaved_mla", 4, tpw(mla_pp), Bar::Tp});
  v.push_back({"tp2_pp2_ep2", 8, tpw({pp + "2", dp + "2", "--parallelism.ep=2", lay + "Et|ttL"}), Bar::Tp});
  // Context parallelism (fp32 compute): ring attention over load-balanced chunks; the router's aux statistics,
  // the losses and the gradients summed over the CP ranks; EP carved out of dp x cp.
  const std::string cp = "--parallelism.cp=", f32 = "--training.compute_dtype=fp32";
  auto cpw = [&](std::vector<std::string> extra) {
    extra.push_back(f32);
    return extra;
  };
  v.push_back({"cp2", 2, cpw({cp + "2"}), Bar::Tp});
  v.push_back({"cp2_mla_zloss", 2, cpw({cp + "2", "--model.z_loss_coef=0.001", mla[0], mla[1], mla[2], mla[3], mla[4],
                                        mla[5]}), Bar::Tp});
  v.push_back({"cp4", 4, cpw({cp + "4"}), Bar::Tp});
  v.push_back({"cp2_ep2", 2, cpw({cp + "2", "--parallelism.ep=2"}), Bar::Tp});
  v.push_back({"cp2_recompute", 2, cpw({cp + "2", "--activation_checkpoint.mode=full"}), Bar::Tp});
  v.push_back({"cp2_aux_free", 2, cpw({cp + "2", "--model.load_balance=aux_free"}), Bar::Tp});
  v.push_back({"tp2_cp2", 4, tpw({cp + "2"}), Bar::Tp});
  v.push_back({"cp2_pp2", 4, cpw({cp + "2", pp + "2", lay + "Ett|tL"}), Bar::Tp});
  v.push_back({"cp2_dp2_zero1", 4, cpw({cp + "2", dp + "2", "--parallelism.zero=1"}), Bar::Tp});
  v.push_back({"cp2_dp2_fsdp_ep2", 4, cpw({cp + "2", dp + "2", "--parallelism.zero=3", "--parallelism.ep=2"}), Bar::Tp});
  // Balanced routing (ds_mini's: Sinkhorn selection and capacity routing over the micro-batch's tokens): every CP
  // rank gathers the micro-batch's score rows and routes the whole of it in its global order, as one process does.
  const std::vector<std::string> bal = {"--model.sinkhorn_iters=4", "--model.route_capacity=1.5"};
  v.push_back({"cp2_balanced", 2, cpw({cp + "2", bal[0], bal[1]}), Bar::Tp});
  v.push_back({"cp4_balanced", 4, cpw({cp + "4", bal[0], bal[1]}), Bar::Tp});
  v.push_back({"cp2_dp2_ep2_balanced", 4, cpw({cp + "2", dp + "2", "--parallelism.ep=2", bal[0], bal[1]}), Bar::Tp});
  v.push_back({"cp2_recompute_balanced", 2, cpw({cp + "2", "--activation_checkpoint.mode=full", bal[0], bal[1]}),
               Bar::Tp});
  v.push_back({"cp2_pp2_balanced", 4, cpw({cp + "2", pp + "2", lay + "Ett|tL", bal[0], bal[1]}), Bar::Tp});
  // Every schedule with TP and with CP (the stages exchange each rank's rows; the split backward records the TP /
  // CP layers' weight gradients like any others), the other EP dispatcher over CP ranks, HSDP under a pipeline.
  for (const char* name : {"gpipe", "zbv", "dualpipev"}) {
    const std::string two = std::string(name) == "gpipe" ? "Ett|tL" : "Et|t|t|L";
    v.push_back({"tp2_pp2_" + std::string(name), 4, tpw({pp + "2", sch + name, lay + two}), Bar::Tp});
    v.push_back({"cp2_pp2_" + std::string(name), 4, cpw({cp + "2", pp + "2", sch + name, lay + two}), Bar::Tp});
  }
  v.push_back({"cp2_pp2_zb1p", 4, cpw({cp + "2", pp + "2", sch + "zb1p", lay + "Ett|tL"}), Bar::Tp});
  // FP8 under CP: the forward's rowwise scales are per token row, but the weight gradients quantize their operands
  // along the tokens, and a rank holds half of each sequence's: other scales than on one process, the FP8 bar
  // (measured: gradient 2.5e-2, parameters 4.4e-3, loss 7.7e-5 relative).
  v.push_back({"cp2_fp8_rowwise", 2, cpw({cp + "2", "--quantize.recipe=rowwise", "--quantize.format=hybrid"}), Bar::Fp8});
  v.push_back({"hsdp2x2_ep2_hierarchical", 4, {"--parallelism.dp_replicate=2", dp + "2", "--parallelism.zero=3",
                                               "--parallelism.ep=2", "--parallelism.ep_dispatcher=hierarchical",
                                               "--parallelism.ranks_per_node=1"}, Bar::Hier});
  v.push_back({"cp2_pp2_interleaved", 4, cpw({cp + "2", pp + "2", sch + "interleaved_1f1b", lay + "Et|t|t|L"}), Bar::Tp});
  v.push_back({"cp2_ep2_sync_free", 2, cpw({cp + "2", "--parallelism.ep=2", "--parallelism.ep_dispatcher=sync_free"}),
               Bar::Tp});
  // HSDP 2 x 2 in fp32 held to the TP / CP bar too (the issue's: loss within 1e-5 over 5 steps).
  v.push_back({"hsdp2x2_fp32", 4, {"--parallelism.dp_replicate=2", dp + "2", "--parallelism.zero=3", f32}, Bar::Tp});
  v.push_back({"hsdp2x2_pp2_zb1p", 8, {pp + "2", "--parallelism.dp_replicate=2", dp + "2", "--parallelism.zero=3",
                                       sch + "zb1p", lay + "Ett|tL"}, Bar::Exact});
  // Multi-token prediction under TP (its blocks TP blocks; eh_proj and the depth's norms whole, their gradients partial
  // over the sequence-parallel rows; the tokens ahead through the vocabulary-parallel embedding and fused loss) and
  // under CP (the tokens ahead taken from the whole sequences' targets; the depth's losses summed over the CP group).
  v.push_back({"tp2_mtp", 2, tpw({"--model.mtp_layers=2"}), Bar::Tp});
  v.push_back({"cp2_mtp", 2, cpw({cp + "2", "--model.mtp_layers=2"}), Bar::Tp});
  v.push_back({"tp2_cp2_mtp", 4, tpw({cp + "2", "--model.mtp_layers=1"}), Bar::Tp});
  // The seeds' shape at small scale: tp x cp x pp with EP over the data (and context) ranks.
  v.push_back({"tp2_cp2_pp2_ep2", 8, tpw({cp + "2", pp + "2", "--parallelism.ep=2", lay + "Et|ttL"}), Bar::Tp});
  return v;
}

struct ParamDiff {
  double rel_l2 = 0, max_abs = 0, rel_l2_bulk = 0;  // bulk: without the outliers
  int64_t outliers = 0;                              // elements with |a - b| > kOutlierAbs
};
constexpr double kOutlierAbs = 1e-6;

ParamDiff param_diff(const std::vector<float>& a, const std::vector<float>& b) {
  ParamDiff r;
  double d2 = 0, n2 = 0, d2b = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    double d = double(a[i]) - double(b[i]);
    d2 += d * d, n2 += double(b[i]) * b[i], r.max_abs = std::max(r.max_abs, std::abs(d));
    if (std::abs(d) > kOutlierAbs) ++r.outliers;
    else d2b += d * d;
  }
  r.rel_l2 = std::sqrt(d2 / n2), r.rel_l2_bulk = std::sqrt(d2b / n2);
  return r;
}

}  // namespace

class MpiLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(MpiLayout, MatchesOneProcess) {
  const Layout& L = GetParam();
  if (L.world != world().size()) GTEST_SKIP() << L.name << " needs " << L.world << " ranks";
  const TrainResult& ref = reference(L.args);
  TrainResult got = train(tiny(shared_dir(L.name), L.args), recorded(&world()));
  ASSERT_EQ(got.history.size(), size_t(kSteps));
  ASSERT_EQ(got.final_params.size(), ref.final_params.size()) << "global parameter layout";

  std::vector<uint64_t> hashes;
  std::vector<double> logged;
  for (auto& h : got.history) hashes.push_back(h.param_hash), logged.push_back(h.loss), logged.push_back(h.grad_norm);
  expect_same_on_all_ranks(hashes.data(), int64_t(hashes.size() * 8), L.name + ": parameter hash per step");
  expect_same_on_all_ranks(logged.data(), int64_t(logged.size() * 8), L.name + ": loss and grad norm per step");
  expect_same_on_all_ranks(got.final_params.data(), int64_t(got.final_params.size() * 4), L.name + ": final params");

  const double loss_tol = L.bar == Bar::Fp8 ? kFp8LossRel : L.bar == Bar::Tp ? kTpLossRel : kLossRel;
  const double param_tol = L.bar == Bar::Fp8 ? kFp8ParamRelL2 : kParamRelL2;
  const double l1 = got.history[0].loss, r1 = ref.history[0].loss;
  if (L.bar == Bar::Exact || L.bar == Bar::Bitwise) {
    EXPECT_EQ(0, std::memcmp(&l1, &r1, sizeof(double))) << L.name << ": step 1 loss " << l1 << " vs one process " << r1;
  }
  if (L.bar == Bar::Bitwise) {  // every step, every parameter, the first gradient
    for (int i = 0; i < kSteps; ++i) {
      const StepRecord &a = got.history[size_t(i)], &b = ref.history[size_t(i)];
      EXPECT_EQ(0, std::memcmp(&a.loss, &b.loss, sizeof(double))) << L.name << " step " << i + 1 << " loss";
      EXPECT_EQ(0, std::memcmp(&a.aux_loss, &b.aux_loss, sizeof(double))) << L.name << " step " << i + 1 << " aux";
      EXPECT_EQ(0, std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double))) << L.name << " step " << i + 1 << " gnorm";
      EXPECT_EQ(a.param_hash, b.param_hash) << L.name << " step " << i + 1 << " parameter hash";
    }
    EXPECT_EQ(0, std::memcmp(got.final_params.data(), ref.final_params.data(), got.final_params.size() * 4))
        << L.name << ": final parameters";
    EXPECT_EQ(0, std::memcmp(got.first_grads.data(), ref.first_grads.data(), got.first_grads.size() * 4))
        << L.name << ": step 1 gradient";
  }
  if (L.bar == Bar::Hier) {
    EXPECT_LE(std::abs(l1 - r1) / std::abs(r1), kHierStep1LossRel) << L.name << ": step 1 loss";
  }
  if (L.bar == Bar::Tp) {
    EXPECT_LE(std::abs(l1 - r1) / std::abs(r1), kTpStep1LossRel) << L.name << ": step 1 loss";
  }
  ASSERT_EQ(got.first_grads.size(), ref.first_grads.size());
  const ParamDiff gd = param_diff(got.first_grads, ref.first_grads);
  EXPECT_LE(gd.rel_l2, L.bar == Bar::Fp8 ? kFp8GradRel : kGradRel) << L.name << ": step 1 gradient";
  // The logged step-1 norm is the norm of that gradient: | |g| - |g'| | <= |g - g'|, so it is within the gradient's
  // bar (a shard counted twice, e.g. HSDP's replicas both added, is off by sqrt(2)).
  if (L.bar != Bar::Fp8) {
    const double n1 = got.history[0].grad_norm, m1 = ref.history[0].grad_norm;
    EXPECT_LE(std::abs(n1 - m1) / m1, kGradRel) << L.name << ": step 1 grad norm " << n1 << " vs one process " << m1;
  }
  double worst = 0;
  for (int i = 0; i < kSteps; ++i) {
    const double a = got.history[size_t(i)].loss, b = ref.history[size_t(i)].loss;
    const double rel = std::abs(a - b) / std::abs(b);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, loss_tol) << L.name << " step " << i + 1 << ": " << a << " vs one process " << b;
  }
  // Multi-token prediction: the logged MTP term (its per-depth sums and position counts folded over PP, CP and DP) is
  // held to the same bar as the main loss: a depth's count or sum missing a rank's share is off by a factor ~2.
  double worst_mtp = 0;
  for (int i = 0; i < kSteps; ++i) {
    const double a = got.history[size_t(i)].mtp_loss, b = ref.history[size_t(i)].mtp_loss;
    if (b == 0) {
      EXPECT_EQ(a, 0.0) << L.name << " step " << i + 1 << ": mtp_loss without MTP";
      continue;
    }
    worst_mtp = std::max(worst_mtp, std::abs(a - b) / std::abs(b));
    EXPECT_LE(std::abs(a - b) / std::abs(b), loss_tol) << L.name << " step " << i + 1 << ": mtp_loss " << a
                                                       << " vs one process " << b;
  }
  if (worst_mtp > 0 || ref.history[0].mtp_loss != 0)
    if (world().rank() == 0) std::printf("[%-28s] mtp_loss: 5 steps max rel diff %.2e\n", L.name.c_str(), worst_mtp);
  // Memory: with EP the routed experts are 1/ep per rank, so (zero = 0) the optimizer state drops by exactly
  // 8 bytes per expert element not held here; ZeRO-1 / FSDP shard what remains (test_mpi_train.cpp).
  int ep = 1, zero = 0, pp_size = 1, tp = 1, cpn = 1;
  for (auto& a : L.args) {
    if (a.rfind("--parallelism.cp=", 0) == 0) cpn = std::stoi(a.substr(17));
    if (a.rfind("--parallelism.tp=", 0) == 0) tp = std::stoi(a.substr(17));
    if (a.rfind("--parallelism.pp=", 0) == 0) pp_size = std::stoi(a.substr(17));
    if (a.rfind("--parallelism.ep=", 0) == 0) ep = std::stoi(a.substr(17));
    if (a.rfind("--parallelism.zero=", 0) == 0) zero = std::stoi(a.substr(19));
  }
  if (tp > 1 && zero == 0 && pp_size == 1) {
    // TP: the optimizer state is 8 bytes per element this rank holds (model_param_layout of its TP slice and EP
    // shard), and every sliced tensor (attention, dense and shared-expert FFN, the experts' widths) holds 1/tp of its
    // elements; the measured parameter memory drops.
    const ModelSpec m = reference_spec(L.args);
    ParamSelection sel;
    sel.tp = tp, sel.tp_rank = 0, sel.ep = ep, sel.ep_rank = 0;
    int64_t held = 0, sliced = 0, sliced_whole = 0;
    for (const ParamEntry& e : model_param_layout(m, sel)) {
      held += param_padded_numel(e.numel);
      if (e.tp_sliced()) sliced += e.numel, sliced_whole += e.unsliced_numel();
    }
    EXPECT_EQ(got.opt_state_bytes, 8 * held) << L.name << ": optimizer state per rank";
    EXPECT_EQ(sliced * tp, sliced_whole) << L.name;
    // The start-up estimate (estimate_memory, what the memory check and the report use) against the measured peaks:
    // parameters (with the packed experts), gradients and optimizer state are this rank's slices, held to 1 % (the
    // 16-float padding of each tensor; measured: equal to the byte on every TP layout of the sweep).
    const MemoryEstimate est = estimate_memory(tiny("unused", L.args), 4, 1);
    EXPECT_NEAR(est.grads, double(got.grads_peak_bytes), 0.01 * double(got.grads_peak_bytes)) << L.name;
    EXPECT_NEAR(est.optimizer, double(got.optimizer_peak_bytes), 0.01 * double(got.optimizer_peak_bytes)) << L.name;
    EXPECT_NEAR(est.params, double(got.params_peak_bytes), 0.01 * double(got.params_peak_bytes)) << L.name;
    // Activations: every saved buffer, exactly (under EP the received-row buffers grow with the routing: not here).
    if (ep == 1) {
      EXPECT_EQ(est.activations, double(got.act_peak_bytes)) << L.name << ": estimate_memory's activations";
      // The report's term list also counts the embedding's token ids (4 bytes a token), which the engine keeps
      // outside its tracked buffers: exactly that apart.
      const int64_t ids = 4 * kMicro * tiny("unused", L.args).training.seq_len / cpn;
      EXPECT_EQ(got.act_predicted_bytes, got.act_peak_bytes + ids) << L.name << ": the run report's prediction";
    }
    if (world().rank() == 0)
      std::printf("[%-28s] activations: estimate_memory %.0f, report %lld, measured %lld\n", L.name.c_str(),
                  est.activations, (long long)got.act_predicted_bytes, (long long)got.act_peak_bytes);
    if (world().rank() == 0)
      std::printf("[%-28s] estimate_memory: grads %.0f (measured %lld), optimizer %.0f (%lld), params %.0f (%lld)\n",
                  L.name.c_str(), est.grads, (long long)got.grads_peak_bytes, est.optimizer,
                  (long long)got.optimizer_peak_bytes, est.params, (long long)got.params_peak_bytes);
    EXPECT_LT(got.params_peak_bytes, ref.params_peak_bytes) << L.name;
    if (world().rank() == 0)
      std::printf("[%-28s] per rank: optimizer %lld -> %lld bytes, params %lld -> %lld bytes; sliced tensors %lld of "
                  "%lld elements (tp %d, ep %d)\n", L.name.c_str(), (long long)ref.opt_state_bytes,
                  (long long)got.opt_state_bytes, (long long)ref.params_peak_bytes, (long long)got.params_peak_bytes,
                  (long long)sliced, (long long)sliced_whole, tp, ep);
  }
  if (cpn > 1 && ep == 1 && pp_size == 1) {
    // CP: a rank holds 1/cp of every sequence and every saved buffer follows its tokens, but for the few that do
    // not (per-expert counters, the offsets): the measured activation peak is 1/cp of one process's within 1 %.
    const double share = double(got.act_peak_bytes) / double(ref.act_peak_bytes) * (tp > 1 ? tp : 1);
    bool recompute = false;  // the reference keeps every layer's activations: compared like with like only
    for (auto& a : L.args) recompute |= a.rfind("--activation_checkpoint.", 0) == 0;
    if (tp == 1 && !recompute) {
      EXPECT_NEAR(share, 1.0 / cpn, 0.01 / cpn) << L.name << ": activations per rank";
    }
  }
  if (cpn > 1 && ep == 1 && pp_size == 1 && world().rank() == 0)
    std::printf("[%-28s] activations per rank: %lld -> %lld bytes (%.3f of one process; predicted %lld)\n",
                L.name.c_str(), (long long)ref.act_peak_bytes, (long long)got.act_peak_bytes,
                double(got.act_peak_bytes) / double(ref.act_peak_bytes), (long long)got.act_predicted_bytes);
  if (ep > 1 && zero == 0 && pp_size == 1 && tp == 1 && cpn == 1) {
    const ModelSpec& m = tiny("unused").model;
    int64_t expert_elems = 0;
    for (int64_t l = 0; l < m.n_layers; ++l)
      if (m.is_moe_layer(l)) expert_elems += m.moe.n_routed_experts * 3 * m.d_model * m.moe.moe_inter_size;
    EXPECT_EQ(got.opt_state_bytes, ref.opt_state_bytes - 8 * expert_elems / ep * (ep - 1))
        << L.name << ": optimizer state per rank";
    EXPECT_LT(got.params_peak_bytes, ref.params_peak_bytes) << L.name;
    if (world().rank() == 0)
      std::printf("[%-28s] per rank: optimizer %lld -> %lld bytes, params %lld -> %lld bytes (one process -> ep %d)\n",
                  L.name.c_str(), (long long)ref.opt_state_bytes, (long long)got.opt_state_bytes,
                  (long long)ref.params_peak_bytes, (long long)got.params_peak_bytes, ep);
  }
  const ParamDiff pd = param_diff(got.final_params, ref.final_params);
  EXPECT_LE(pd.rel_l2, param_tol) << L.name;
  if (world().rank() == 0)
    std::printf("[%-28s] step 1: loss %s, grad rel L2 %.2e; 5 steps: loss max rel diff %.2e, params rel L2 %.2e "
                "(bulk %.2e, %lld of %zu elements > %.0e, max abs %.2e); EP bytes/step inter %.0f intra %.0f\n",
                L.name.c_str(), l1 == r1 ? "bitwise" : "differs", gd.rel_l2, worst, pd.rel_l2,
                pd.rel_l2_bulk, (long long)pd.outliers, ref.final_params.size(), kOutlierAbs, pd.max_abs,
                got.ep_bytes_inter_per_step, got.ep_bytes_intra_per_step);
}

INSTANTIATE_TEST_SUITE_P(Sweep, MpiLayout, ::testing::ValuesIn(layouts()),
                         [](const ::testing::TestParamInfo<Layout>& i) { return i.param.name; });

// ---------------------------------------------------------------------------------------------------------
// Impossible layouts: each fails at start-up, on every rank, with a message naming the broken rule.

struct Bad {
  std::string name;
  std::vector<std::string> args;
  std::string expect;  // substring of the error
  int min_world = 1;
};

TEST(MpiLayoutErrors, EveryImpossibleLayoutIsRejected) {
  const int w = world().size();
  const std::string W = std::to_string(w), H2 = "--parallelism.dp_shard=" + std::to_string(std::max(1, w / 2));
  std::vector<Bad> bad = {
      {"world_mismatch",
       {"--parallelism.dp_shard=" + std::to_string(2 * w), "--training.global_batch_size=" + std::to_string(16 * w)},
       "world size"},
      {"ep_3_of_8_experts", {"--parallelism.dp_shard=" + W, "--parallelism.ep=3"}, "ep"},
      {"experts_not_divisible", {"--parallelism.dp_shard=" + W, "--parallelism.ep=4", "--model.n_routed_experts=6"},
       "n_routed_experts", 4},
      {"fp8_without_ep", {"--parallelism.dp_shard=" + W, "--parallelism.fp8_dispatch=true"}, "fp8_dispatch"},
      {"dispatcher_without_ep", {"--parallelism.dp_shard=" + W, "--parallelism.ep_dispatcher=sync_free"}, "ep_dispatcher"},
      {"shm_without_ep", {"--parallelism.dp_shard=" + W, "--parallelism.ep_transport=shm"}, "ep_transport"},
      {"shm_hierarchical", {"--parallelism.dp_shard=" + W, "--parallelism.ep=2",
                            "--parallelism.ep_dispatcher=hierarchical", "--parallelism.ranks_per_node=1",
                            "--parallelism.ep_transport=shm"},
       "use ep_transport = \"mpi\" with it", 2},
      {"zero_value", {"--parallelism.dp_shard=" + W, "--parallelism.zero=2"}, "zero"},
      {"pipeline_world", {"--parallelism.dp_shard=" + W, "--parallelism.pp=2"}, "pp"},
      {"pipeline_tied_fsdp", {"--parallelism.dp_shard=" + std::to_string(w / 2), "--parallelism.pp=2",
                              "--parallelism.zero=3", "--model.tie_embeddings=true"}, "tied embeddings under FSDP", 2},
      {"pipeline_too_few_microbatches", {"--parallelism.dp_shard=" + std::to_string(w / 2), "--parallelism.pp=2",
                                         "--training.global_batch_size=" + std::to_string(w / 2)},
       "pp_microbatches = 1 must be >= pp = 2", 2},
      {"batch_not_divisible", {"--parallelism.dp_shard=" + W, "--training.micro_batch_size=2", "--training.global_batch_size=" + std::to_string(2 * w + 1)},
       "global_batch_size"},
      {"ep_larger_than_dp", {"--parallelism.dp_shard=" + W, "--parallelism.ep=" + std::to_string(2 * w)}, "ep", 1},
      {"ranks_per_node", {"--parallelism.dp_shard=" + W, "--parallelism.ranks_per_node=3"}, "ranks_per_node", 4},
      // Tensor parallelism: what it does not compose with yet, and the shapes it cannot divide.
      {"tp_fsdp", {"--parallelism.tp=2", "--parallelism.expert_tp=2", "--parallelism.zero=3",
                   "--parallelism.dp_shard=" + std::to_string(w / 2)}, "FSDP (parallelism.zero = 3) is not implemented "
       "with tensor parallelism", 2},
      {"tp_fp8", {"--parallelism.tp=2", "--parallelism.expert_tp=2", H2, "--quantize.recipe=tensorwise"},
       "is not implemented with tensor parallelism", 2},
      {"tp_selective", {"--parallelism.tp=2", "--parallelism.expert_tp=2", H2, "--activation_checkpoint.mode=selective",
                        "--activation_checkpoint.modules=[\"norm\"]"}, "selective", 2},
      {"tp_expert_tp_mismatch", {"--parallelism.tp=2", H2}, "expert_tp must equal tp", 2},
      {"tp_hierarchical", {"--parallelism.tp=2", "--parallelism.expert_tp=2", "--parallelism.ep=2", H2,
                           "--parallelism.ep_dispatcher=hierarchical"},
       "hierarchical dispatch", 4},
      {"tp_heads", {"--parallelism.tp=4", "--parallelism.expert_tp=4", "--parallelism.dp_shard=" + std::to_string(w / 4),
                    "--model.n_heads=6", "--model.head_dim=8"}, "n_heads", 4},
      {"tp_rows", {"--parallelism.tp=2", "--parallelism.expert_tp=2", H2, "--training.seq_len=3"},
       "under sequence parallelism", 2},
      {"cp_seq_len", {"--parallelism.cp=2", "--parallelism.dp_shard=" + std::to_string(w / 2), "--training.seq_len=6"},
       "2 * cp must divide training.seq_len", 2},
      {"cp_ep_overlap", {"--parallelism.cp=2", "--parallelism.dp_shard=" + std::to_string(w / 4), "--model.n_layers=4",
                         "--parallelism.ep=2", "--parallelism.pp=2", "--parallelism.pp_schedule=interleaved_1f1b",
                         "--parallelism.pp_layout=Et|t|t|tL", "--parallelism.ep_overlap=true"},
       "ep_overlap = true is not implemented with context parallelism", 8},
      {"hsdp_ep_across_replicas", {"--parallelism.dp_replicate=2", "--parallelism.dp_shard=" + std::to_string(w / 2),
                                   "--parallelism.zero=3", "--parallelism.ep=" + W},
       "(HSDP) needs ep to divide dp_shard", 4},
      {"hsdp_cp", {"--parallelism.dp_replicate=2", "--parallelism.cp=2", "--parallelism.zero=3",
                   "--parallelism.dp_shard=" + std::to_string(std::max(1, w / 4))}, "(HSDP) is not implemented yet", 4},
  };
  for (auto& b : bad) {
    if (w < b.min_world) continue;
    std::string msg;
    try {
      TrainOptions o;
      o.quiet = true;
      o.comm = &world();
      train(tiny(shared_dir("bad_" + b.name), b.args), o);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    EXPECT_FALSE(msg.empty()) << b.name << ": the layout was accepted";
    if (!b.expect.empty()) {
      EXPECT_NE(msg.find(b.expect), std::string::npos) << b.name << ": " << msg;
    }
    if (world().rank() == 0) std::printf("[%s] %s\n", b.name.c_str(), msg.substr(0, 200).c_str());
  }
}

// ---------------------------------------------------------------------------------------------------------
// Checkpoints under EP hold global tensors (every expert, gathered over the EP group): an EP run resumes
// bitwise, and one process loading an EP checkpoint holds exactly the EP run's parameters.
TEST(MpiLayoutCheckpoint, ExpertParallelResumeAndLoadInOneProcess) {
  const int w = world().size();
  if (w < 2) GTEST_SKIP() << "needs 2 ranks or more";
  for (const char* zero : {"1", "3"}) {  // EP with ZeRO-1, and EP with FSDP
    const std::string z = zero;
    const std::vector<std::string> ep = {"--parallelism.dp_shard=" + std::to_string(w), "--parallelism.ep=2",
                                         "--parallelism.zero=" + z, "--checkpoint.enable=true",
                                         "--checkpoint.interval=3"};
    TrainResult full = train(tiny(shared_dir("ckpt_full_z" + z), ep), recorded(&world()));
    const std::string d = shared_dir("ckpt_resume_z" + z);
    train(tiny(d, ep), recorded(&world()));  // then cut back to the step-3 checkpoint (same LR schedule)
    if (world().rank() == 0) {
      fs::copy(fs::path(d) / "checkpoint", fs::path(d) / "checkpoint_final", fs::copy_options::recursive);
      fs::remove_all(fs::path(d) / "checkpoint" / ("step-" + std::to_string(kSteps)));
    }
    world().barrier();
    TrainResult resumed = train(tiny(d, ep), recorded(&world()));
    ASSERT_EQ(resumed.start_step, 3) << "zero=" << z;
    ASSERT_EQ(resumed.history.size(), size_t(kSteps - 3));
    for (size_t i = 0; i < resumed.history.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(&resumed.history[i].loss, &full.history[i + 3].loss, sizeof(double)))
          << "zero=" << z << " step " << i + 4;
      EXPECT_EQ(resumed.history[i].param_hash, full.history[i + 3].param_hash) << "zero=" << z << " step " << i + 4;
    }
    ASSERT_EQ(resumed.final_params.size(), full.final_params.size());
    EXPECT_EQ(0, std::memcmp(resumed.final_params.data(), full.final_params.data(), full.final_params.size() * 4))
        << "zero=" << z;
    // One process opens the final (step 5) checkpoint: nothing left to train, the parameters are the EP run's.
    if (world().rank() == 0) {
      static Comm local = comm_local();
      TrainResult one =
          train(tiny(d, {"--checkpoint.enable=true", "--checkpoint.folder=checkpoint_final"}), recorded(&local));
      EXPECT_EQ(one.start_step, kSteps);
      ASSERT_EQ(one.final_params.size(), full.final_params.size());
      EXPECT_EQ(0, std::memcmp(one.final_params.data(), full.final_params.data(), full.final_params.size() * 4))
          << "zero=" << z;
    }
    world().barrier();
  }
}

// Checkpoints under pipeline parallelism hold the whole model's tensors (every stage's parameters and moments,
// gathered over the pipeline ranks): a pipeline run resumes bitwise under its own layout, and its checkpoint
// continues bitwise under pp = 1 (one process) and under another schedule and stage split, since pure pipeline
// runs are bitwise the single-process run. The checkpoint files equal the single-process run's byte for byte.
TEST(MpiLayoutCheckpoint, PipelineResumesAndLoadsUnderOtherSchedules) {
  const int w = world().size();
  if (w != 2 && w != 4) GTEST_SKIP() << "pipeline of 2 or 4 stages";
  const std::string P = std::to_string(w);
  const std::vector<std::string> ck = {"--checkpoint.enable=true", "--checkpoint.interval=3"};
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.end(), ck.begin(), ck.end());
    return a;
  };
  const std::vector<std::string> pp = with({"--parallelism.pp=" + P, "--parallelism.pp_schedule=1f1b",
                                            "--parallelism.pp_layout=" + std::string(w == 2 ? "Ett|tL" : "Et|t|t|L")});
  const std::vector<std::string> other =
      with({"--parallelism.pp=" + P, "--parallelism.pp_schedule=" + std::string(w == 2 ? "zbv" : "gpipe"),
            "--parallelism.pp_layout=" + std::string(w == 2 ? "Et|t|t|L" : "E|ttt||L")});
  const std::string d = shared_dir("pp_ckpt_full");
  TrainResult full = train(tiny(d, pp), recorded(&world()));
  auto cut_to_step3 = [&](const std::string& name, bool per_rank) {
    const std::string to = per_rank ? temp_dir("moetron_mpi_layout_" + name + "_r", std::to_string(world().rank()))
                                    : shared_dir(name);
    copy_one_checkpoint(d, to, "step-3", per_rank);
    return to;
  };
  auto same_continuation = [&](const TrainResult& r, const std::string& what) {
    ASSERT_EQ(r.start_step, 3) << what;
    ASSERT_EQ(r.history.size(), size_t(kSteps - 3)) << what;
    for (size_t i = 0; i < r.history.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(&r.history[i].loss, &full.history[i + 3].loss, sizeof(double))) << what << " step " << i + 4;
      EXPECT_EQ(r.history[i].param_hash, full.history[i + 3].param_hash) << what << " step " << i + 4;
    }
    ASSERT_EQ(r.final_params.size(), full.final_params.size()) << what;
    EXPECT_EQ(0, std::memcmp(r.final_params.data(), full.final_params.data(), full.final_params.size() * 4)) << what;
  };
  same_continuation(train(tiny(cut_to_step3("pp_ckpt_same", false), pp), recorded(&world())), "same layout");
  same_continuation(train(tiny(cut_to_step3("pp_ckpt_other", false), other), recorded(&world())),
                    "another schedule and split");
  static Comm local = comm_local();
  same_continuation(train(tiny(cut_to_step3("pp_ckpt_one", true), ck), recorded(&local)), "one process");
  // The single-process run writes the same checkpoint files.
  const std::string one = temp_dir("moetron_mpi_layout_pp_ckpt_ref_r", std::to_string(world().rank()));
  fs::remove_all(one);
  train(tiny(one, ck), recorded(&local));
  if (world().rank() == 0)
    for (const char* f : {"model.safetensors", "optimizer.safetensors"})
      for (const char* st : {"step-3", "step-5"}) {
        auto bytes = [](const fs::path& p) {
          std::ifstream in(p, std::ios::binary);
          return std::string(std::istreambuf_iterator<char>(in), {});
        };
        EXPECT_TRUE(bytes(fs::path(d) / "checkpoint" / st / f) == bytes(fs::path(one) / "checkpoint" / st / f))
            << st << "/" << f << " differs between pp = " << w << " and one process";
      }
  world().barrier();
}

// Activation memory per pipeline rank: the tracked peak of the activations category against the accounting's
// prediction (activation slots = the schedule's peak in-flight micro-batches, times the bytes one micro-batch
// saves in the rank's layers, plus the embedding / head terms). Within 5% (measured: 0 to 1.2%): the terms are the engine's own
// buffers (the same sizes), the remainder is what the accounting leaves out (per-slot head gradient, EP row
// growth). gpipe keeps every micro-batch in flight, 1f1b at most pp - rank of them.
TEST(MpiLayoutMemory, PipelineActivationsFollowTheScheduleInFlightCount) {
  const int w = world().size();
  if (w != 2 && w != 4) GTEST_SKIP() << "pipeline of 2 or 4 stages";
  const std::string lay = w == 2 ? "Ett|tL" : "Et|t|t|L";
  int64_t peak[2] = {0, 0};
  int k = 0;
  for (const char* sch : {"1f1b", "gpipe"}) {
    TrainResult r = train(tiny(shared_dir(std::string("pp_mem_") + sch),
                               {"--parallelism.pp=" + std::to_string(w), "--parallelism.pp_schedule=" + std::string(sch),
                                "--parallelism.pp_layout=" + lay}),
                          recorded(&world()));
    const double ratio = double(r.act_peak_bytes) / double(r.act_predicted_bytes);
    std::printf("[pp_mem %-5s] rank %d: activations peak %lld bytes measured, %lld predicted (ratio %.3f)\n", sch,
                world().rank(), (long long)r.act_peak_bytes, (long long)r.act_predicted_bytes, ratio);
    EXPECT_GT(r.act_predicted_bytes, 0);
    EXPECT_NEAR(ratio, 1.0, 0.05) << sch << " rank " << world().rank();
    peak[k++] = r.act_peak_bytes;
  }
  if (world().rank() < w - 1) {
    EXPECT_GT(peak[1], peak[0]) << "gpipe holds more micro-batches than 1f1b";
  }
}

// The 1F1B all-to-all overlap (parallelism.ep_overlap): the interleaved schedule with its steady-state pairs
// fused, each pair's backward half on a second thread (the model's lane 1) while the forward half runs. The
// per-parameter accumulation order is the plain schedule's, so the run is BITWISE the plain interleaved run
// of the same layout (every step's loss, aux, gradient norm and parameter hash, the final parameters).
TEST(MpiLayoutOverlap, EpOverlapIsBitwiseThePlainInterleavedRun) {
  const int w = world().size();
  if (w != 4 && w != 8) GTEST_SKIP() << "pp 2 x dp (w / 2) with EP";
  const std::vector<std::string> base = {
      "--parallelism.pp=2", "--parallelism.dp_shard=" + std::to_string(w / 2),
      "--parallelism.ep=" + std::to_string(w / 2), "--parallelism.pp_schedule=interleaved_1f1b",
      "--parallelism.pp_layout=Et|t|t|L", "--training.global_batch_size=" + std::to_string(4 * w),
      w == 8 ? "--parallelism.ep_dispatcher=hierarchical" : "--parallelism.ep_dispatcher=alltoall",
      "--parallelism.ranks_per_node=" + std::to_string(w == 8 ? 2 : 8)};
  // fp32 everywhere; bf16 too where it is native (its backward makes compute-dtype copies in lane scratch, which
  // once met a reallocation on the other lane: NaN gradients).
  std::vector<std::string> dtypes = {"fp32"};
  if (gemm_bf16_native()) dtypes.push_back("bf16");
  for (const std::string& dt : dtypes) {
    SCOPED_TRACE("compute_dtype " + dt);
    auto with = [&](bool ov, std::vector<std::string> lanes = {}) {
      std::vector<std::string> a = base;
      a.push_back(std::string("--parallelism.ep_overlap=") + (ov ? "true" : "false"));
      a.push_back("--training.compute_dtype=" + dt);
      a.insert(a.end(), lanes.begin(), lanes.end());
      return a;
    };
    const TrainResult plain = train(tiny(shared_dir("ovl_plain_" + dt), with(false)), recorded(&world()));
    // the turn-taking lanes, then the free order (the compute to whichever lane is ready); a pair's backward half
    // as one full backward (b) and as input then weight half (iw), also with the weight gradients run early while
    // both lanes wait (iwfill), and with every backward's weight half carried into later waits on either lane
    // (iwcarry); the turns with the paced link (one exchange in flight per rank); the default ("": auto, the key
    // not set), iwcarry under the free order and b under turns; iwcarry with comm.mpi_wait = "spin", where the MPI
    // wait runs no hook, so no weight gradient runs inside a wait (the key reaches the transport)
    struct Variant {
      const char *order, *pair, *link;
      bool spin = false;
    };
    for (const Variant v : {Variant{"turn", "b", "shared"}, Variant{"turn", "b", "paced"}, Variant{"free", "b", "shared"},
                            Variant{"free", "iw", "shared"}, Variant{"free", "iwfill", "shared"},
                            Variant{"free", "iwcarry", "shared"}, Variant{"free", "", "shared"},
                            Variant{"turn", "", "shared"}, Variant{"free", "iwcarry", "shared", true}}) {
      std::vector<std::string> lanes = {std::string("--parallelism.ep_baton=") + v.order,
                                        std::string("--parallelism.ep_link=") + v.link};
      if (*v.pair) lanes.push_back(std::string("--parallelism.ep_pair_backward=") + v.pair);
      if (v.spin) lanes.push_back("--comm.mpi_wait=spin");
      std::string trace;
      for (const std::string& l : lanes) trace += l + " ";
      SCOPED_TRACE(trace);
      const TrainResult ov = train(
          tiny(shared_dir(std::string("ovl_on_") + v.order + v.pair + v.link + (v.spin ? "_spin" : "") + "_" + dt),
               with(true, lanes)),
          recorded(&world()));
      // the measured exposed EP time: without the overlap all of the wait, with it at most the wait
      EXPECT_GT(plain.ep_wait_seconds, 0.0);
      EXPECT_EQ(plain.ep_exposed_seconds, plain.ep_wait_seconds);
      EXPECT_GT(ov.ep_wait_seconds, 0.0);
      EXPECT_LE(ov.ep_exposed_seconds, ov.ep_wait_seconds);
      // inside pairs: none without the overlap, a part of the exposed time with it
      EXPECT_EQ(plain.ep_exposed_paired_seconds, 0.0);
      EXPECT_LE(ov.ep_exposed_paired_seconds, ov.ep_exposed_seconds);
      // the fill runs weight gradients only where asked; where asked, some (summed over ranks: when both lanes wait
      // at once depends on timing; on this test's oversubscribed ranks it happens in every run)
      EXPECT_EQ(plain.ep_wgrad_fill_tasks, 0);
      int64_t filled = ov.ep_wgrad_fill_tasks;
      world().all_reduce(&filled, 1);
      std::printf("[overlap %s/%s%s] rank %d: %lld weight gradients filled (%lld over ranks)\n", v.order,
                  *v.pair ? v.pair : "default", v.spin ? "/spin" : "",
                  world().rank(), (long long)ov.ep_wgrad_fill_tasks, (long long)filled);
      const std::string pair = v.pair, order = v.order;
      if ((pair == "iwfill" || pair == "iwcarry" || (pair.empty() && order == "free")) && !v.spin) EXPECT_GT(filled, 0);
      else EXPECT_EQ(ov.ep_wgrad_fill_tasks, 0);
      ASSERT_EQ(ov.history.size(), plain.history.size());
      for (size_t i = 0; i < plain.history.size(); ++i) {
        const StepRecord &a = ov.history[i], &b = plain.history[i];
        EXPECT_EQ(0, std::memcmp(&a.loss, &b.loss, sizeof(double))) << "step " << i + 1 << ": " << a.loss << " vs " << b.loss;
        EXPECT_EQ(0, std::memcmp(&a.aux_loss, &b.aux_loss, sizeof(double))) << "step " << i + 1;
        EXPECT_EQ(0, std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double))) << "step " << i + 1;
        EXPECT_EQ(a.param_hash, b.param_hash) << "step " << i + 1;
      }
      ASSERT_EQ(ov.final_params.size(), plain.final_params.size());
      EXPECT_EQ(0, std::memcmp(ov.final_params.data(), plain.final_params.data(), plain.final_params.size() * 4));
      EXPECT_GT(ov.ep_bytes_inter_per_step + ov.ep_bytes_intra_per_step + plain.ep_bytes_intra_per_step, 0.0);
    }
  }
}

// The overlap with multi-token prediction (model.mtp_layers): the MTP depths run on the head stage's lanes like its
// layers (lane 1 has its own MTP scratch and uses lane 0's per-slot buffers: a slot's forward and backward may run
// on different lanes), BITWISE the plain interleaved run: every step's loss, MTP loss, aux, gradient norm and
// parameter hash, the final parameters. Two lane variants: the default (free order, iwcarry) and turns with b.
TEST(MpiLayoutOverlap, EpOverlapWithMtpIsBitwiseThePlainRun) {
  const int w = world().size();
  if (w != 4) GTEST_SKIP() << "pp 2 x dp 2 with EP 2";
  const std::vector<std::string> base = {
      "--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2", "--parallelism.pp_schedule=interleaved_1f1b",
      "--parallelism.pp_layout=Et|t|t|L", "--training.global_batch_size=" + std::to_string(4 * w),
      "--parallelism.ep_dispatcher=alltoall", "--training.compute_dtype=fp32", "--model.mtp_layers=2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const TrainResult plain = train(tiny(shared_dir("ovl_mtp_plain"), with({"--parallelism.ep_overlap=false"})),
                                  recorded(&world()));
  // default lanes, the turns with b, and the default lanes over the shared-memory transport (each lane's own
  // segments; its flag waits run the lane's deferred work like any other wait)
  for (const std::vector<std::string>& lanes :
       {std::vector<std::string>{}, std::vector<std::string>{"--parallelism.ep_baton=turn",
                                                             "--parallelism.ep_pair_backward=b"},
        std::vector<std::string>{"--parallelism.ep_transport=shm"}}) {
    SCOPED_TRACE(lanes.empty() ? "default lanes" : lanes[0]);
    std::vector<std::string> a = {"--parallelism.ep_overlap=true"};
    a.insert(a.end(), lanes.begin(), lanes.end());
    const std::string tag = lanes.empty() ? "0" : lanes[0].substr(14, 6);  // "ep_bat" / "ep_tra"
    const TrainResult ov = train(tiny(shared_dir("ovl_mtp_on" + tag), with(a)), recorded(&world()));
    ASSERT_EQ(ov.history.size(), plain.history.size());
    for (size_t i = 0; i < plain.history.size(); ++i) {
      const StepRecord &x = ov.history[i], &y = plain.history[i];
      EXPECT_GT(y.mtp_loss, 0.0);
      EXPECT_EQ(0, std::memcmp(&x.loss, &y.loss, sizeof(double))) << "step " << i + 1 << ": " << x.loss << " vs " << y.loss;
      EXPECT_EQ(0, std::memcmp(&x.mtp_loss, &y.mtp_loss, sizeof(double))) << "step " << i + 1;
      EXPECT_EQ(0, std::memcmp(&x.aux_loss, &y.aux_loss, sizeof(double))) << "step " << i + 1;
      EXPECT_EQ(0, std::memcmp(&x.grad_norm, &y.grad_norm, sizeof(double))) << "step " << i + 1;
      EXPECT_EQ(x.param_hash, y.param_hash) << "step " << i + 1;
    }
    ASSERT_EQ(ov.final_params.size(), plain.final_params.size());
    EXPECT_EQ(0, std::memcmp(ov.final_params.data(), plain.final_params.data(), plain.final_params.size() * 4));
  }
}

// FSDP with MTP under PP: the last stage's embedding copy (its own FSDP unit, its shards exchanged with the first
// stage's after each step) is restored from the checkpoint like the original: 2 steps + resume + 2 equal 4 straight
// (losses, MTP losses, parameter hashes). Control: the first run's step 3 differs from its step 2 (a real resume).
TEST(MpiLayoutFsdp, PpMtpResumesBitwise) {
  if (world().size() != 4) GTEST_SKIP() << "pp 2 x dp 2";
  const std::vector<std::string> ov = {"--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.zero=3",
                                       "--model.mtp_layers=1", "--parallelism.pp_layout=Ett|tmL",
                                       "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.steps=4"};
  const TrainResult full = train(tiny(shared_dir("fsdp_pp_mtp_full"), ov), recorded(&world()));
  const std::string d = shared_dir("fsdp_pp_mtp_cut");
  train(tiny(d, ov), recorded(&world()));
  if (world().rank() == 0) fs::remove_all(fs::path(d) / "checkpoint" / "step-4");
  world().barrier();
  const TrainResult res = train(tiny(d, ov), recorded(&world()));
  EXPECT_EQ(res.start_step, 2);
  ASSERT_EQ(res.history.size(), 2u);
  EXPECT_NE(full.history[2].loss, full.history[1].loss);
  for (size_t i = 0; i < 2; ++i) {
    const StepRecord &a = res.history[i], &b = full.history[2 + i];
    EXPECT_GT(b.mtp_loss, 0.0);
    EXPECT_EQ(0, std::memcmp(&a.loss, &b.loss, sizeof(double))) << "step " << 3 + i;
    EXPECT_EQ(0, std::memcmp(&a.mtp_loss, &b.mtp_loss, sizeof(double))) << "step " << 3 + i;
    EXPECT_EQ(0, std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double))) << "step " << 3 + i;
    EXPECT_EQ(a.param_hash, b.param_hash) << "step " << 3 + i;
  }
}

// [comm] mpi_thread is MPI_Init's argument, chosen once per process: here MPI started asking for MULTIPLE (the test
// main's comm_world()), so a job asking for FUNNELED cannot be honoured and is refused naming the key (on every rank,
// before any collective); the same job asking for MULTIPLE runs.
TEST(MpiLayoutComm, MpiThreadLevelIsChosenOnceAndNamedWhenItCannotBe) {
  const int w = world().size();
  const std::vector<std::string> dp = {"--parallelism.dp_shard=" + std::to_string(w),
                                       "--training.global_batch_size=" + std::to_string(kMicro * w),
                                       "--training.steps=1"};
  auto with = [&](const char* level) {
    std::vector<std::string> a = dp;
    a.push_back(std::string("--comm.mpi_thread=") + level);
    return a;
  };
  std::string err;
  try {
    train(tiny(shared_dir("mpi_thread_funneled"), with("funneled")), recorded(&world()));
  } catch (const Error& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("comm.mpi_thread = funneled: MPI has already started in this process at another thread level"),
            std::string::npos)
      << err;
  EXPECT_EQ(train(tiny(shared_dir("mpi_thread_multiple"), with("multiple")), recorded(&world())).history.size(), 1u);
}

// What the overlap refuses, each naming its rule.
TEST(MpiLayoutOverlap, EpOverlapRefusals) {
  const int w = world().size();
  if (w != 4) GTEST_SKIP() << "4 ranks";
  const std::vector<std::string> base = {"--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.ep=2",
                                         "--parallelism.pp_schedule=interleaved_1f1b",
                                         "--parallelism.pp_layout=Et|t|t|L", "--parallelism.ep_overlap=true"};
  auto error_of = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    try {
      train(tiny(shared_dir("ovl_bad"), a), recorded(&world()));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of({"--parallelism.pp_schedule=1f1b", "--parallelism.pp_layout=Ett|tL"})
                .find("needs parallelism.pp_schedule = \"interleaved_1f1b\""),
            std::string::npos);
  EXPECT_NE(error_of({"--parallelism.ep=1"}).find("needs expert parallelism"), std::string::npos);
  EXPECT_NE(error_of({"--parallelism.zero=3"}).find("not with FSDP"), std::string::npos);
  EXPECT_NE(error_of({"--activation_checkpoint.mode=full"}).find("activation recompute"), std::string::npos);
  // The overlap's lane keys: a bad value is refused by name, and the combinations that cannot run (the paced link
  // without turns, the fill without the free order or with [quantize]).
  EXPECT_NE(error_of({"--parallelism.ep_baton=fast"}).find("parallelism.ep_baton: expected one of free|turn, got 'fast'"),
            std::string::npos);
  EXPECT_NE(error_of({"--parallelism.ep_link=wide"}).find("parallelism.ep_link: expected one of shared|paced, got 'wide'"),
            std::string::npos);
  EXPECT_NE(error_of({"--parallelism.ep_link=paced"}).find("parallelism.ep_link = paced: needs parallelism.ep_baton = "
                                                           "\"turn\""),
            std::string::npos);
  EXPECT_NE(error_of({"--parallelism.ep_pair_backward=wb"})
                .find("parallelism.ep_pair_backward: expected one of auto|b|iw|iwfill|iwcarry, got 'wb'"),
            std::string::npos);
  EXPECT_NE(error_of({"--parallelism.ep_pair_backward=iwcarry", "--parallelism.ep_baton=turn"})
                .find("parallelism.ep_pair_backward = iwcarry: needs the free lane order"),
            std::string::npos);
  EXPECT_NE(error_of({"--parallelism.ep_pair_backward=iwfill", "--parallelism.ep_baton=turn"})
                .find("parallelism.ep_pair_backward = iwfill: needs the free lane order"),
            std::string::npos);
  const std::string fp8 = error_of({"--quantize.recipe=tensorwise", "--parallelism.ep_pair_backward=iwfill"});
  EXPECT_NE(fp8.find("parallelism.ep_pair_backward = iwfill: is not implemented with [quantize]"), std::string::npos)
      << fp8;
  EXPECT_NE(error_of({"--comm.mpi_thread=funneled"}).find("comm.mpi_thread = funneled: parallelism.ep_overlap = true"),
            std::string::npos);
  // the default (auto) runs [quantize] with one full backward per pair instead
  EXPECT_EQ(error_of({"--quantize.recipe=tensorwise"}), "");
}
