// train_session.cpp: TrainSession's set-up, validation, and checkpoint save / resume (see train_session.h).
// Checkpoints hold global tensors (every expert, every pipeline stage, at the whole model's layout), so a run
// resumes under any layout: the parameter state gathers them over EP, PP (and DP for zero = 3) before rank 0
// writes, and every rank takes its part when loading.
#include "train/train_session.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "moetron/accounting.h"
#include "moetron/check.h"
#include "moetron/checkpoint.h"
#include "moetron/cuda/runtime.h"
#include "moetron/env.h"
#include "moetron/fsdp.h"
#include "moetron/memcheck.h"
#include "moetron/memory.h"
#include "moetron/runtime.h"
#include "moetron/schedule.h"
#include "moetron/trace.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moetron {

namespace {

// The keys only the planner implements, refused by name before the mesh is built (a layout the engine cannot
// run is named, rather than failing on the world size); returns the parallel spec for the mesh.
const ParallelSpec& engine_parallelism(const JobConfig& cfg) {
  const ParallelSpec& p = cfg.parallelism;
  MT_CHECK(p.tp == 1 || p.sequence_parallel, "train", "parallelism.sequence_parallel = false with tp = ", p.tp,
           " is not implemented in the engine: its TP always shards the norm / residual regions' rows over the TP "
           "ranks (Megatron's sequence parallelism); use true");
  // Tensor parallelism slices every expert's width over the TP ranks (expert_tp = tp); experts sharded by EP
  // across the TP ranks instead (Megatron's parallel folding, expert_tp = 1 with tp > 1) is not built.
  if (cfg.model.is_moe())
    MT_CHECK(p.expert_tp == p.tp, "train", "parallelism.expert_tp = ", p.expert_tp, " with tp = ", p.tp,
             ": the engine divides every expert's width over the TP ranks, so expert_tp must equal tp (", p.tp,
             "); experts spread by EP over the TP ranks instead (expert_tp = 1 with tp > 1, MoE parallel folding) "
             "is planned only: `moetron plan`");

  MT_CHECK(p.expert_tp == 1 || cfg.model.is_moe(), "train", "parallelism.expert_tp = ", p.expert_tp,
           " needs a MoE model (this one has no routed experts); use 1");
  // HSDP (zero = 3 with dp_replicate > 1): a unit's expert run is sharded over the ranks of one shard group that
  // hold the same experts, which needs every EP group inside one shard group.
  MT_CHECK(p.zero != 3 || p.dp_replicate == 1 || p.ep < 1 || p.dp_shard % p.ep == 0, "train", "parallelism.ep = ",
           p.ep, " with zero = 3 and dp_replicate = ", p.dp_replicate, " (HSDP) needs ep to divide dp_shard = ",
           p.dp_shard, ": the expert parameters are sharded over the ranks of one shard group that hold the same "
           "experts; use an ep that divides dp_shard, or dp_replicate = 1");
  MT_CHECK(p.zero != 3 || p.dp_replicate == 1 || p.cp == 1, "train", "parallelism.cp = ", p.cp, " with zero = 3 and "
           "dp_replicate = ", p.dp_replicate, " (HSDP) is not implemented yet (the shard group would span dp_shard x cp); "
           "use dp_replicate = 1 (FSDP over dp x cp) or cp = 1");
  MT_CHECK(!p.ep_overlap_split, "train", "parallelism.ep_overlap_split = true is not implemented in the engine (the "
           "split of unpaired chunks into two overlapped halves is planned only: `moetron plan`); use false");
  return p;
}

// The combinations the trainer cannot run, each named by its rule.
void check_layout(const JobConfig& cfg, const DeviceMesh& mesh) {
  MT_CHECK(mesh.ep() > 1 || !cfg.parallelism.fp8_dispatch, "train",
           "parallelism.fp8_dispatch = true needs expert parallelism (ep > 1): with ep = 1 nothing is dispatched");
  MT_CHECK(mesh.ep() > 1 || cfg.parallelism.ep_dispatcher == EpDispatcher::AllToAll, "train",
           "parallelism.ep_dispatcher = ", to_string(cfg.parallelism.ep_dispatcher),
           " needs expert parallelism (ep > 1): with ep = 1 nothing is dispatched");
  MT_CHECK(mesh.ep() > 1 || cfg.parallelism.ep_transport == EpTransport::Mpi, "train",
           "parallelism.ep_transport = \"shm\" needs expert parallelism (ep > 1): with ep = 1 nothing is dispatched");
  const ParallelSpec& p = cfg.parallelism;
  if (cfg.quantize.cache_fp8_activations) {  // the combinations the cached FP8 activations do not cover (docs/fp8.md)
    MT_CHECK(mesh.ep() == 1, "train", "quantize.cache_fp8_activations = true is not implemented with expert "
             "parallelism (parallelism.ep = ", mesh.ep(), "): the routed rows a rank receives vary per step; use false");
    MT_CHECK(resolve_checkpointing(cfg).mode != AcMode::Selective, "train", "quantize.cache_fp8_activations = true "
             "is not implemented with activation_checkpoint.mode = \"selective\"; use \"full\" or \"none\", or false");
    MT_CHECK(mesh.pp() == 1 || (p.pp_schedule_csv.empty() && !sched::uses_split_backward(p.pp_schedule)), "train",
             "quantize.cache_fp8_activations = true is not implemented with a split backward (parallelism.pp_schedule = ",
             p.pp_schedule, p.pp_schedule_csv.empty() ? "" : ", or a pp_schedule_csv", "): the deferred weight gradient "
             "would need the cached FP8 operands; use a schedule with B (gpipe, 1f1b, interleaved_1f1b) or false");
  }
  MT_CHECK(cfg.parallelism.zero == 0 || cfg.parallelism.zero == 1 || cfg.parallelism.zero == 3, "train",
           "parallelism.zero = ", cfg.parallelism.zero,
           " is not implemented in the trainer (use 0; 1 shards the optimizer state; 3 shards parameters, "
           "gradients and optimizer state)");
}

// HSDP's expert shard group: the ranks of this rank's shard group holding the same experts (ep divides dp_shard,
// so an EP group lies inside one shard group and ep_idx = shard_idx % ep), ordered by shard_idx / ep. Collective
// over the shard group; the shard group itself without EP.
Comm hsdp_expert_group(const MeshComms& mcs, int ep) {
  if (ep == 1) return mcs.dp_shard;
  const int s = mcs.dp_shard.rank();
  Comm g = mcs.dp_shard.split(s % ep, s / ep);
  g.set_name("edp_shard");
  return g;
}

// The job's world communicator. First the retired environment variables are refused (env.h: each names its
// config key), then the [comm] MPI settings are applied: the waits' mode, and the thread level, which MPI_Init takes
// as an argument, so it is set before comm_world() first starts MPI (in `moetron train` that is here, after the
// config is read). A process whose MPI has already started at another level cannot honour comm.mpi_thread: refused.
// training.device: "cpu" is the CPU engine; "cuda" is refused by name: without the backend or a usable GPU
// (cuda::require_device says which), and, with both, because the trainer does not run on the GPU yet.
void check_device(const JobConfig& cfg) {
  if (cfg.training.device == "cpu") return;
  const std::string what = "training.device = \"" + cfg.training.device + "\"";
  cuda::require_device(what);
  MT_FAIL("train", what, ": the CUDA backend has its kernels and their tests (docs/gpu.md), but the trainer does not "
          "run on the GPU yet; use training.device = \"cpu\"");
}

Comm job_world(const JobConfig& cfg, const TrainOptions& o) {
  check_device(cfg);
  refuse_retired_env();
  const CommSpec& c = cfg.comm;
  MT_CHECK(comm_request_mpi_thread(c.mpi_thread == "multiple"), "train", "comm.mpi_thread = ", c.mpi_thread,
           ": MPI has already started in this process at another thread level (the level is chosen once, when MPI "
           "starts); run the job in a new process");
  comm_set_mpi_wait(c.mpi_wait == "poll", int(c.mpi_max_nap_us));
  return o.comm ? *o.comm : comm_world();
}

}  // namespace

TrainSession::TrainSession(const JobConfig& cfg_in, const TrainOptions& o)
    : cfg(cfg_in),
      opt(o),
      compute(resolve_compute_dtype(cfg_in.training.compute_dtype, &compute_why)),  // bf16 refused first
      world(job_world(cfg_in, o)),
      mesh(engine_parallelism(cfg_in), world.size(), cfg_in.model.is_moe() ? cfg_in.model.moe.n_routed_experts : 0) {
  const auto& tr = cfg.training;
  const ModelSpec& ms = cfg.model;
  check_layout(cfg, mesh);
  mcs = world.size() == 1 ? MeshComms{world, world, world, world, world, world, world, world, world, world} : make_mesh_comms(mesh, world);
  EP = mesh.ep(), PP = mesh.pp();
  rank = mcs.dp.rank(), D = mcs.dp.size(), pp_rank = mesh.coord(world.rank()).pp;
  gdp = mesh.cp() > 1 ? mcs.dp_cp : mcs.dp, gedp = mcs.edp;  // (edp spans dp x cp: mesh.h)
  root = world.rank() == 0;
  {
    // Ranks sharing this machine: the launcher says it; otherwise the mesh's ranks per node.
    int local = mesh.ranks_per_node();
    if (const char* e = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"); e && std::atoi(e) > 0) local = std::atoi(e);
    init_threads(int(tr.threads), local);
    // Before anything is allocated: the per-rank estimate against this node's memory (memcheck.h), with
    // GEMM inputs in the resolved compute dtype (bf16: 2 bytes, fp32: 4).
    check_job_memory(cfg, local, compute == ComputeDtype::FP32 ? 4 : 2, num_threads());
  }
  say = !opt.quiet && root;
  tty = say && opt.progress && isatty(fileno(stdout));
  B = tr.micro_batch_size, T = tr.seq_len;
  G = tr.global_batch_size > 0 ? tr.global_batch_size : B * D;
  MT_CHECK(G % (B * D) == 0, "train", "training.global_batch_size=", G, " is not a multiple of micro_batch_size * dp = ",
           B, " * ", D);
  micro = G / B;            // micro-batches per step over all ranks
  micro_local = micro / D;  // this rank's: sequences [rank*G/D, (rank+1)*G/D) of each step
  zero3 = cfg.parallelism.zero == 3;
  res.rank = rank, res.world = D;
  res.dump_folder = cfg.job.dump_folder;
  fs::create_directories(res.dump_folder);

  data = make_train_sources(cfg, opt.data_root, rank, D, G, world, say);
  res.unigram_entropy = data.unigram_entropy;

  // The pipeline: this rank's stages and the schedule (pp = 1: the whole model, the trivial schedule). The
  // runtime plans the activation slots before the model is built with them.
  plan = make_pipeline_plan(cfg, pp_rank);
  MT_CHECK(plan.lowered.n_microbatches == micro_local, "train", "the pipeline schedule has ",
           plan.lowered.n_microbatches, " micro-batches per step, the data ", micro_local,
           " (global_batch_size / (micro_batch_size * dp))");
  const bool overlap = cfg.parallelism.ep_overlap;
  MT_CHECK(!overlap || comm_thread_multiple(), "train",
           "parallelism.ep_overlap = true runs two micro-batches' EP exchanges at once on two threads, which needs MPI "
           "with MPI_THREAD_MULTIPLE; this MPI did not provide it");
  // The activations between stages: this rank's rows of the residual stream (all of them without TP).
  MT_CHECK(T % (2 * mesh.cp()) == 0, "train", "training.seq_len = ", T, " is not divisible by 2 * parallelism.cp = ",
           2 * mesh.cp(), ": context parallelism cuts each sequence into 2 cp equal chunks");
  MT_CHECK(B * T / mesh.cp() % mesh.tp() == 0, "train", "micro_batch_size * seq_len / cp = ", B * T / mesh.cp(),
           " is not divisible by parallelism.tp = ", mesh.tp(), ": under sequence parallelism each TP rank holds an "
           "equal share of the rows");
  exec = std::make_unique<PipelineExecutor>(plan, mcs.pp, B * T / mesh.cp() / mesh.tp() * ms.d_model, overlap,
                                            cfg.parallelism.ep_pair_backward);

  ModelParallel mpar;
  mpar.attention = cfg.training.attention_dtype;
  if (EP > 1) {
    mpar.ep = &mcs.ep, mpar.dispatcher = cfg.parallelism.ep_dispatcher,
    mpar.ep_transport = cfg.parallelism.ep_transport, mpar.fp8_dispatch = cfg.parallelism.fp8_dispatch;
    mpar.ep_ranks_per_node = mesh.ep_ranks_per_node();
  }
  // zero = 3 (FSDP): the model keeps only this rank's shards (include/moetron/fsdp.h); the expert group is
  // the expert-data-parallel group (the DP group without EP); under CP both span dp x cp. HSDP (dp_replicate > 1):
  // both are one replica's, the shard group and its ranks holding this rank's experts, and the replicate group sums
  // the gradient shards.
  if (zero3) {
    fsdp_opts = std::make_unique<FsdpOptions>(FsdpOptions{gdp, gedp});
    if (mesh.dp_replicate() > 1) fsdp_opts->dense = mcs.dp_shard, fsdp_opts->expert = hsdp_expert_group(mcs, EP),
                                 fsdp_opts->replicate = mcs.dp_replicate;
    mpar.fsdp = fsdp_opts.get();
  }
  if (mesh.tp() > 1) mpar.tp = &mcs.tp;
  if (mesh.cp() > 1) mpar.cp = &mcs.cp;
  mpar.stages = &plan.parts;
  mpar.ep_overlap = overlap;
  mpar.ep_free_order = cfg.parallelism.ep_baton == "free";
  mpar.ep_paced_link = cfg.parallelism.ep_link == "paced";
  const ActivationCheckpointSpec ac = resolve_checkpointing(cfg);
  model = std::make_unique<Model>(ms, B, T, ac, mpar, compute);
  model->init_params(uint64_t(tr.seed));
  model->set_quantize(cfg.quantize);
  exec->bind(*model);

  std::vector<std::vector<int>> stage_layers;
  for (int s = 0; s < plan.setup.layout.n_stages; ++s) stage_layers.push_back(plan.setup.layout.layers(s));
  const PipelineOwnership own = pipeline_ownership(ms, model_param_layout(ms), stage_layers, plan.lowered.stage_rank,
                                                   plan.first_stage_rank, plan.last_stage_rank);
  state = std::make_unique<ParamState>(*model, cfg, ParamStateComms{gdp, mcs.ep, gedp, mcs.pp, mcs.tp}, own, pp_rank);
  res.opt_state_bytes = state->state_bytes();

  fpt = flops_per_token(ms, T, true, ac);
  res.compute_dtype = compute;
  res.peak_gflops = cfg.metrics.peak_tflops > 0 ? cfg.metrics.peak_tflops * 1e3 : measure_peak_gflops(compute);
  ckdir = (fs::path(res.dump_folder) / cfg.checkpoint.folder).string();
  res.checkpoint_dir = ckdir;
  adam.beta1 = float(cfg.optimizer.beta1), adam.beta2 = float(cfg.optimizer.beta2), adam.eps = float(cfg.optimizer.eps);
  adam.weight_decay = float(cfg.optimizer.weight_decay);
  faults = FaultInjector::from_env(world.rank());
  // The flight recorder runs in every training run; the watchdog only with [comm] timeout_s.
  flight_recorder_start();
  watchdog = std::make_unique<FlightWatchdog>(cfg.comm.timeout_s, (fs::path(res.dump_folder) / "flight").string(),
                                              world.rank(), world.size());
  vin.resize(size_t(B * T)), vtg.resize(size_t(B * T));
}

TrainSession::~TrainSession() {
  trace::enable(false);  // a run that threw mid-step: stop recording and drop the trace session
  trace::cancel_session();
  watchdog.reset();  // before the recorder it reads
  flight_recorder_stop();
}

namespace {

// The checkpoint's tensors over global-layout vectors: parameters (or a moment, with a name prefix) and the
// expert biases.
// Under Muon its matrices have no second moment: no "v." tensor for them.
std::vector<CheckpointTensor> global_tensors(const ParamState& st, const std::vector<float>& g, const std::string& pre) {
  std::vector<CheckpointTensor> v;
  const auto& gp = st.global_params();
  for (size_t i = 0; i < gp.size(); ++i)
    if (pre != "v." || !st.muon_param(i)) v.push_back({pre + gp[i].name, DType::F32, gp[i].global_shape, g.data() + gp[i].offset});
  return v;
}
void add_biases(std::vector<CheckpointTensor>& v, const std::vector<float>& b, int64_t E) {
  for (int64_t i = 0; E > 0 && i * E < int64_t(b.size()); ++i)
    v.push_back({"expert_bias." + std::to_string(i), DType::F32, {E}, b.data() + i * E});
}

}  // namespace

void TrainSession::resume() {
  if (!cfg.checkpoint.enable) return;
  auto latest = latest_complete_checkpoint(ckdir);
  if (!latest) return;
  LoadedCheckpoint ck = load_checkpoint(*latest);
  JobConfig saved = config_from_json(ck.state.at("config"));
  MT_CHECK(saved.model == cfg.model, "train", "checkpoint ", *latest, " was written for a different model spec");
  MT_CHECK(saved.optimizer.name == cfg.optimizer.name, "train", "checkpoint ", *latest, " holds the state of optimizer.name = \"",
           saved.optimizer.name, "\", this run is optimizer.name = \"", cfg.optimizer.name,
           "\" (the moments do not carry over): resume with the same optimizer or start in another folder");
  const int64_t E = cfg.model.is_moe() ? cfg.model.moe.n_routed_experts : 0;
  std::vector<float> p(size_t(state->global_numel()), 0.0f), m(p.size(), 0.0f), v(p.size(), 0.0f);
  std::vector<float> bias(size_t(model->n_moe_layers_total() * E), 0.0f);
  auto mt = global_tensors(*state, p, "");
  add_biases(mt, bias, E);
  for (auto& t : mt) load_into(ck.model, t.name, t.dtype, t.shape, const_cast<void*>(t.data));
  for (auto& t : global_tensors(*state, m, "m.")) load_into(ck.optimizer, t.name, t.dtype, t.shape, const_cast<void*>(t.data));
  for (auto& t : global_tensors(*state, v, "v.")) load_into(ck.optimizer, t.name, t.dtype, t.shape, const_cast<void*>(t.data));
  state->set_params(p);
  state->set_moment(0, m);
  state->set_moment(1, v);
  state->set_biases(bias);
  if (cfg.quantize.delayed()) {  // the delayed-scaling amax histories (every rank holds every site)
    std::vector<float> h = model->fp8_history();
    MT_CHECK(ck.state.contains("fp8_amax_history_len"), "train", "checkpoint ", *latest,
             " has no FP8 amax history, but quantize.scaling = \"delayed\" (it was written without delayed scaling)");
    load_into(ck.model, "fp8.amax_history", DType::F32, {model->fp8_sites(), 3, cfg.quantize.amax_history_len}, h.data());
    model->set_fp8_history(h);
  }
  step = ck.step;
  data.train->restore(ck.state.at("data"));
  model->sync_weights();
  if (say) std::printf("resumed from %s (step %lld)\n", latest->c_str(), (long long)step);
}

// Collective (parameters, moments and biases are gathered to the global layout); rank 0 writes. The request's
// tensors point into `Snapshot`'s vectors, which the background writer owns until its write ends.
std::string TrainSession::save(int64_t s) {
  struct Snapshot {
    std::vector<float> p, m, v, bias, fp8h;
    CheckpointWriteRequest req;
  };
  auto snap = std::make_shared<Snapshot>();
  snap->p = state->global_params_values(), snap->m = state->global_moment(0), snap->v = state->global_moment(1);
  snap->bias = state->global_biases();
  snap->fp8h = model->fp8_history();  // delayed scaling only; the same on every rank
  // Nothing non-finite reaches a checkpoint. Every rank holds the same gathered vectors, so every rank takes
  // the same decision without communicating.
  {
    std::string bad;
    auto scan = [&](const std::vector<float>& g, const char* pre) {
      for (const auto& e : state->global_params())
        for (int64_t i = 0; bad.empty() && i < e.numel; ++i)
          if (!std::isfinite(g[size_t(e.offset + i)]))
            bad = std::string(pre) + e.name + " element " + std::to_string(i) + " = " + std::to_string(g[size_t(e.offset + i)]);
    };
    scan(snap->p, ""), scan(snap->m, "m."), scan(snap->v, "v.");
    for (size_t i = 0; bad.empty() && i < snap->bias.size(); ++i)
      if (!std::isfinite(snap->bias[i])) bad = "expert_bias element " + std::to_string(i);
    if (!bad.empty()) {
      if (cfg.training.nonfinite != "skip")
        MT_FAIL("train", "checkpoint at step ", s, " refused: ", bad, " is not finite (training.nonfinite = halt)");
      if (say) std::printf("checkpoint at step %lld not written: %s is not finite\n", (long long)s, bad.c_str());
      return std::string();
    }
  }
  if (!root) return std::string();
  CheckpointWriteRequest& req = snap->req;
  req.step = s;
  req.model = global_tensors(*state, snap->p, "");
  add_biases(req.model, snap->bias, cfg.model.is_moe() ? cfg.model.moe.n_routed_experts : 0);
  if (!snap->fp8h.empty())
    req.model.push_back({"fp8.amax_history", DType::F32, {model->fp8_sites(), 3, cfg.quantize.amax_history_len},
                         snap->fp8h.data()});
  for (const char* pre : {"m.", "v."}) {
    auto t = global_tensors(*state, pre[0] == 'm' ? snap->m : snap->v, pre);
    req.optimizer.insert(req.optimizer.end(), t.begin(), t.end());
  }
  req.state = json{{"data", data.train->state()}, {"config", to_json(cfg)}, {"config_toml", to_toml(cfg)},
                   {"rng", {{"seed", cfg.training.seed}}}};
  if (!snap->fp8h.empty()) req.state["fp8_amax_history_len"] = cfg.quantize.amax_history_len;
  const int keep = int(cfg.checkpoint.keep_latest_k);
  if (!cfg.checkpoint.async) return save_checkpoint(ckdir, req, keep);
  ckwriter.submit([snap, dir = ckdir, keep] { save_checkpoint(dir, snap->req, keep); });
  return checkpoint_path(ckdir, s);
}

void TrainSession::wait_for_checkpoint() { ckwriter.wait(); }

// Validation batches 0..nb-1 (batch i = sequences [i*B, i*B + B) of the validation stream); under DP rank r
// computes the contiguous range [nb*r/D, nb*(r+1)/D) through its pipeline and the per-batch sums are folded in
// batch order (all_reduce_ordered), so the result is the single-process sum whatever the layout.
double TrainSession::validate() {
  const int64_t nb = std::max<int64_t>(1, cfg.training.val_steps);
  BatchSource& val = *data.val;
  const bool is_loader = val.state().contains("micro");
  std::vector<double> parts;
  int64_t cnt = 0;
  // Under EP and FSDP every rank must run the same number of forwards (MoE layers and unit gathers are
  // collective): ranks with fewer batches run their first one again and discard it.
  const int64_t lo = nb * rank / D, hi = nb * (rank + 1) / D;
  const int64_t iters = EP > 1 || zero3 ? (nb + D - 1) / D : hi - lo;
  for (int64_t j = 0; j < iters; ++j) {
    const int64_t i = lo + j < hi ? lo + j : lo;
    const uint64_t pos = uint64_t(i * B);
    val.restore(is_loader ? json{{"kind", "loader"}, {"epoch", 0}, {"position", pos}, {"micro", 0}}
                          : json{{"kind", "synthetic"}, {"position", pos}});
    val.next(vin.data(), vtg.data());
    ForwardStats fs_ = pipeline_forward_only(*model, plan, mcs.pp, vin.data(), vtg.data());
    if (lo + j >= hi) continue;
    parts.push_back(fs_.ce_sum), cnt += fs_.ce_count;
  }
  // Validation routes tokens too: its expert counts must not reach the next step's bias update.
  model->take_expert_counts();
  if (mesh.cp() > 1) {  // each CP rank's sums cover its share of every sequence
    mcs.cp.all_reduce(parts.data(), int64_t(parts.size()));
    mcs.cp.all_reduce(&cnt, 1);
  }
  double sum = 0;
  mcs.dp.all_reduce_ordered(&sum, parts.data(), int64_t(parts.size()), 1);
  mcs.dp.all_reduce(&cnt, 1);
  return cnt ? sum / double(cnt) : 0.0;
}

}  // namespace moetron
