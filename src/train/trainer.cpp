// trainer.cpp: the training loop behind `moetron train`. See trainer.h.
#include "moetron/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moetron/accounting.h"
#include "moetron/check.h"
#include "moetron/checkpoint.h"
#include "moetron/data.h"
#include "moetron/fsdp.h"
#include "moetron/gemm.h"
#include "moetron/memcheck.h"
#include "moetron/memory.h"
#include "moetron/mesh.h"
#include "moetron/model.h"
#include "moetron/optim.h"
#include "moetron/rng.h"
#include "moetron/router.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace moetron {

double lr_at(const OptimizerSpec& o, const LRSchedulerSpec& s, int64_t step, int64_t total) {
  MT_CHECK(step >= 1, "lr_at", "step must be >= 1, got ", step);
  const double lr = o.lr;
  if (s.warmup_steps > 0 && step <= s.warmup_steps) return lr * double(step) / double(s.warmup_steps);
  if (s.decay_type == DecayType::None) return lr;
  int64_t span = total - s.warmup_steps;
  double p = span > 0 ? std::min(1.0, double(step - s.warmup_steps) / double(span)) : 1.0;
  double mn = s.min_lr_ratio;
  double f = s.decay_type == DecayType::Cosine ? mn + (1 - mn) * 0.5 * (1 + std::cos(M_PI * p)) : 1 - (1 - mn) * p;
  return lr * f;
}

double measure_peak_gflops(ComputeDtype dt, int64_t n, int reps) {
  MT_CHECK(dt != ComputeDtype::Auto, "measure_peak_gflops", "resolve the compute dtype first");
  std::vector<float> a(size_t(n * n)), c(size_t(n * n));
  fill_normal(a.data(), n * n, rng_key(1, "peak"), 0, 0, 1);
  std::vector<bf16> ab(dt == ComputeDtype::BF16 ? size_t(n * n) : 0);
  if (!ab.empty()) f32_to_bf16(ab.data(), a.data(), n * n);
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {  // the first call creates the oneDNN primitive: not timed
    auto t0 = std::chrono::steady_clock::now();
    if (dt == ComputeDtype::BF16)
      gemm_bf16(Trans::N, Trans::N, n, n, n, 1.0f, ab.data(), n, ab.data(), n, 0.0f, c.data(), n);
    else  // the machine's sgemm limit: oneDNN's own sgemm, not moetron's batch-invariant kernel
      gemm_f32_onednn(Trans::N, Trans::N, n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f, c.data(), n);
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::min(best, t);
  }
  return 2.0 * double(n) * n * n / best * 1e-9;
}

namespace {

// A source of micro-batches [B, T] of inputs and targets, with a resumable position.
struct BatchSource {
  virtual ~BatchSource() = default;
  virtual void next(int32_t* in, int32_t* tg) = 0;
  virtual json state() const = 0;
  virtual void restore(const json& j) = 0;
};

// Synthetic text: each sequence is a random walk over the vocabulary with a few fixed "phrases", so a
// model can learn it and the loss falls. Sequence number q is a pure function of (seed, stream, q).
// Ranks: like the DataLoader, global step s is sequences [s*G, s*G + G); rank r of `world` takes the
// contiguous chunk of G/world starting at s*G + r*G/world, as micro-batches of B. So sequence i of a
// step is the same whatever the world size. Position = step_pos + micro*B (with world = 1: the number of
// sequences handed out); at a step boundary it does not depend on rank or world.
struct SyntheticSource : BatchSource {
  int64_t B, T, V, G, rank, world;
  uint64_t key, step_pos = 0, micro = 0;
  SyntheticSource(int64_t b, int64_t t, int64_t v, uint64_t seed, const char* stream, int64_t g, int r, int w)
      : B(b), T(t), V(v), G(g), rank(r), world(w), key(rng_key(seed, stream)) {}
  void next(int32_t* in, int32_t* tg) override {
    std::vector<int32_t> row(size_t(T + 1));
    const int64_t per = G / world;
    const uint64_t first = step_pos + uint64_t(rank * per) + micro * uint64_t(B);
    for (int64_t r = 0; r < B; ++r) {
      uint64_t base = (first + uint64_t(r)) * uint64_t(T + 1);
      int32_t cur = int32_t(philox4x32(key, base)[0] % uint64_t(V));
      for (int64_t t = 0; t <= T; ++t) {
        auto rnd = philox4x32(key, base + uint64_t(t) + 1);
        // 3/4 of the time the next token is a deterministic function of the current one.
        cur = (rnd[0] & 3) ? int32_t((uint64_t(cur) * 31 + 7) % uint64_t(V)) : int32_t(rnd[1] % uint64_t(V));
        row[size_t(t)] = cur;
      }
      std::copy(row.begin(), row.begin() + T, in + r * T);
      std::copy(row.begin() + 1, row.end(), tg + r * T);
    }
    if (int64_t(++micro) * B == per) micro = 0, step_pos += uint64_t(G);
  }
  json state() const override { return json{{"kind", "synthetic"}, {"position", step_pos + micro * uint64_t(B)}}; }
  void restore(const json& j) override {
    uint64_t pos = j.at("position").get<uint64_t>();
    step_pos = pos - pos % uint64_t(G), micro = (pos % uint64_t(G)) / uint64_t(B);
    MT_CHECK(micro == 0 || world == 1, "train", "synthetic data position ", pos,
             " is inside a step: only a step boundary restores under data parallelism");
  }
};

struct LoaderSource : BatchSource {
  data::DataLoader loader;
  data::Batch batch;
  LoaderSource(const std::vector<std::string>& paths, const data::LoaderOptions& o) : loader(paths, o) {}
  void next(int32_t* in, int32_t* tg) override {
    loader.next(batch);
    batch.split(in, tg);
  }
  json state() const override {
    auto s = loader.state();
    return json{{"kind", "loader"}, {"epoch", s.epoch}, {"position", s.position}, {"micro", s.micro}};
  }
  void restore(const json& j) override {
    data::LoaderState s;
    s.epoch = j.at("epoch").get<uint64_t>();
    s.position = j.at("position").get<uint64_t>();
    s.micro = j.at("micro").get<uint64_t>();
    loader.restore(s);
  }
};

uint64_t fnv1a(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  auto* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}

std::string human_bytes(int64_t b) {
  char buf[32];
  if (b >= (int64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(1 << 30));
  else std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(1 << 20));
  return buf;
}

}  // namespace

TrainResult train(const JobConfig& cfg_in, const TrainOptions& opt) {
  JobConfig cfg = cfg_in;
  const auto& tr = cfg.training;
  const ModelSpec& ms = cfg.model;
  // The compute dtype first: asking for bf16 where it is not native fails before anything is built.
  std::string compute_why;
  const ComputeDtype compute = resolve_compute_dtype(tr.compute_dtype, &compute_why);

  // ---- parallel layout: data parallelism only (ep = pp = 1). The mesh validates world vs [parallelism].
  const Comm world = opt.comm ? *opt.comm : comm_world();
  const DeviceMesh mesh(cfg.parallelism, world.size(), ms.is_moe() ? ms.moe.n_routed_experts : 0);
  MT_CHECK(mesh.pp() == 1, "train", "parallelism.pp = ", mesh.pp(),
           ": pipeline parallelism is not implemented in the trainer yet (use pp = 1). The [parallelism] pp_schedule, "
           "pp_virtual_stages, pp_microbatches, pp_layout and pp_schedule_csv keys are validated with the config, and "
           "`moetron schedule show` simulates pipeline schedules");
  MT_CHECK(mesh.ep() > 1 || !cfg.parallelism.fp8_dispatch, "train",
           "parallelism.fp8_dispatch = true needs expert parallelism (ep > 1): with ep = 1 nothing is dispatched");
  MT_CHECK(mesh.ep() > 1 || cfg.parallelism.ep_dispatcher == EpDispatcher::AllToAll, "train",
           "parallelism.ep_dispatcher = ", to_string(cfg.parallelism.ep_dispatcher),
           " needs expert parallelism (ep > 1): with ep = 1 nothing is dispatched");
  MT_CHECK(cfg.parallelism.zero == 0 || cfg.parallelism.zero == 1 || cfg.parallelism.zero == 3, "train",
           "parallelism.zero = ", cfg.parallelism.zero,
           " is not implemented in the trainer (use 0; 1 shards the optimizer state; 3 shards parameters, "
           "gradients and optimizer state)");
  const MeshComms mcs = world.size() == 1 ? MeshComms{world, world, world, world, world, world, world}
                                          : make_mesh_comms(mesh, world);
  const Comm dp = mcs.dp, epc = mcs.ep, edp = mcs.edp;
  const int EP = mesh.ep();
  const int rank = dp.rank(), D = dp.size();
  const bool root = world.rank() == 0;
  {
    // Ranks sharing this machine: the launcher says it; otherwise the mesh's ranks per node.
    int local = mesh.ranks_per_node();
    if (const char* e = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"); e && std::atoi(e) > 0) local = std::atoi(e);
    init_threads(int(tr.threads), local);
    // Before anything is allocated: the per-rank estimate against this node's memory (memcheck.h), with
    // GEMM inputs in the resolved compute dtype (bf16: 2 bytes, fp32: 4).
    check_job_memory(cfg, local, compute == ComputeDtype::FP32 ? 4 : 2, num_threads());
  }
  const bool say = !opt.quiet && root;
  const bool tty = say && opt.progress && isatty(fileno(stdout));
  const int64_t B = tr.micro_batch_size, T = tr.seq_len;
  const int64_t G = tr.global_batch_size > 0 ? tr.global_batch_size : B * D;
  MT_CHECK(G % (B * D) == 0, "train", "training.global_batch_size=", G, " is not a multiple of micro_batch_size * dp = ",
           B, " * ", D);
  const int64_t micro = G / B;            // micro-batches per step over all ranks
  const int64_t micro_local = micro / D;  // this rank's: sequences [rank*G/D, (rank+1)*G/D) of each step

  TrainResult res;
  res.rank = rank, res.world = D;
  res.dump_folder = cfg.job.dump_folder;
  fs::create_directories(res.dump_folder);

  // ---- data
  std::unique_ptr<BatchSource> src, val;
  int64_t val_windows = 0;
  if (tr.dataset == "synthetic") {
    src = std::make_unique<SyntheticSource>(B, T, ms.vocab_size, uint64_t(tr.seed), "data.synthetic.train", G, rank, D);
    val = std::make_unique<SyntheticSource>(B, T, ms.vocab_size, uint64_t(tr.seed), "data.synthetic.val", B, 0, 1);
  } else {
    std::string dir = tr.dataset_path;
    if (dir.empty()) dir = (fs::path(opt.data_root) / tr.dataset).string();
    if (!fs::exists(fs::path(dir) / "dataset.json")) {
      MT_CHECK(tr.dataset == "brown" || fs::exists(tr.dataset), "train", "dataset '", tr.dataset,
               "' is not prepared in ", dir, " (run `moetron data prepare --source ... --out ", dir, "`)");
    }
    if (!fs::exists(fs::path(dir) / "dataset.json") && root) {
      data::PrepareOptions po;
      po.source = tr.dataset;
      po.out_dir = dir;
      po.vocab_size = int(ms.vocab_size);
      po.verbose = say;
      if (say) std::printf("preparing dataset '%s' into %s (first run only)\n", tr.dataset.c_str(), dir.c_str());
      data::prepare_dataset(po);
    }
    if (world.size() > 1) world.barrier();  // rank 0 prepared the dataset
    data::DatasetInfo info = data::load_dataset(dir);
    MT_CHECK(info.vocab_size == ms.vocab_size, "train", "dataset ", dir, " has vocab ", info.vocab_size,
             " but model.vocab_size is ", ms.vocab_size);
    res.unigram_entropy = info.unigram_entropy;
    data::LoaderOptions lo;
    lo.seq_len = T, lo.micro_batch = B, lo.global_batch = G, lo.seed = uint64_t(tr.seed);
    lo.rank = rank, lo.world = D;
    src = std::make_unique<LoaderSource>(info.train_paths(), lo);
    // validation: a fixed set of windows, no shuffle
    data::LoaderOptions vo = lo;
    vo.shuffle = false, vo.random_offset = false, vo.global_batch = B, vo.rank = 0, vo.world = 1;
    val = std::make_unique<LoaderSource>(info.val_paths(), vo);
    val_windows = 1;
  }
  (void)val_windows;

  // ---- model and optimizer state
  auto& mt = MemoryTracker::global();
  ModelParallel mpar;
  if (EP > 1) {
    mpar.ep = &epc, mpar.dispatcher = cfg.parallelism.ep_dispatcher, mpar.fp8_dispatch = cfg.parallelism.fp8_dispatch;
    mpar.ep_ranks_per_node = mesh.ep_ranks_per_node();
  }
  // zero = 3 (FSDP): the model keeps only this rank's shards (include/moetron/fsdp.h); the expert group is
  // the expert-data-parallel group (the DP group without EP).
  const bool zero3 = cfg.parallelism.zero == 3;
  const FsdpOptions fsdp_opts{dp, edp};
  if (zero3) mpar.fsdp = &fsdp_opts;
  Model model(ms, B, T, cfg.activation_checkpoint, mpar, compute);
  Fsdp* fsdp = model.fsdp();
  model.init_params(uint64_t(tr.seed));
  const int64_t np = model.num_params();
  // Gradient runs: the flat buffer cut into maximal ranges of non-expert parameters (reduced over all of
  // DP) and, under EP, of this rank's routed-expert shards (reduced over the expert-data-parallel group).
  // Without EP it is one run [0, np) over DP. AdamW state: per run the whole range, or with zero = 1 this
  // rank's slice [s_lo, s_hi) of it over the run's group (ZeRO-1); the state buffers concatenate them.
  // zero = 3: the state has the layout of the parameter shard (fsdp->segments()); the runs are not used.
  const bool sharded = cfg.parallelism.zero == 1 && D > 1;
  struct Run {
    int64_t lo, hi, s_lo, s_hi, st;  // range, this rank's slice, slice's offset in the state buffers
    bool expert;
    const Comm* comm;
    std::vector<int64_t> counts, displs;  // bytes per group rank (all_gather_v of the slices)
  };
  std::vector<Run> runs;
  {
    const auto& ps = model.params();
    for (size_t i = 0; i < ps.size(); ++i) {
      const bool ex = ps[i].expert && EP > 1;
      const int64_t hi = i + 1 < ps.size() ? ps[i + 1].offset : np;
      if (!runs.empty() && runs.back().expert == ex) runs.back().hi = hi;
      else runs.push_back({ps[i].offset, hi, 0, 0, 0, ex, ex ? &edp : &dp, {}, {}});
    }
    int64_t st = 0;
    for (auto& r : runs) {
      const int S = sharded ? r.comm->size() : 1, q = sharded ? r.comm->rank() : 0;
      const int64_t n = r.hi - r.lo;
      r.s_lo = r.lo + n * q / S, r.s_hi = r.lo + n * (q + 1) / S, r.st = st, st += r.s_hi - r.s_lo;
      for (int g = 0; g < S; ++g)
        r.counts.push_back((n * (g + 1) / S - n * g / S) * 4), r.displs.push_back(n * g / S * 4);
    }
  }
  int64_t ns = 0, ns_max = 0;
  for (auto& r : runs) ns += r.s_hi - r.s_lo, ns_max = std::max(ns_max, r.s_hi - r.s_lo);
  if (zero3) ns = fsdp->shard_numel();
  Tensor mbuf = Tensor::zeros({std::max<int64_t>(ns, 1)}, DType::F32, MemCategory::Optimizer, "adam.m");
  Tensor vbuf = Tensor::zeros({std::max<int64_t>(ns, 1)}, DType::F32, MemCategory::Optimizer, "adam.v");
  res.opt_state_bytes = 2 * ns * 4;
  std::vector<float> stage;  // sharded: this rank's updated parameter slice, gathered into every rank
  if (sharded) stage.resize(size_t(ns_max));
  // local <-> full: a state vector in the local flat layout gathered from / sliced into the state buffers
  auto gather_state = [&](std::vector<float>& full, const float* st) {
    full.assign(size_t(np), 0.0f);
    if (zero3) return fsdp->gather_flat(full.data(), st);
    for (auto& r : runs) {
      if (sharded) r.comm->all_gather_v(full.data() + r.lo, r.counts.data(), r.displs.data(), st + r.st);
      else std::copy(st + r.st, st + r.st + (r.hi - r.lo), full.data() + r.lo);
    }
  };
  auto slice_state = [&](float* st, const std::vector<float>& full) {
    if (zero3) return fsdp->slice_flat(st, full.data());
    for (auto& r : runs) std::copy(full.begin() + r.s_lo, full.begin() + r.s_hi, st + r.st);
  };
  // zero = 3 keeps no flat parameter buffer: a flat copy is gathered when one is needed (collective).
  std::vector<float> p_full;
  auto local_params = [&]() -> const float* {
    if (!zero3) return model.param_data();
    p_full.resize(size_t(np));
    fsdp->gather_flat(p_full.data(), fsdp->params());
    return p_full.data();
  };
  auto local_grads = [&](std::vector<float>& flat) -> const float* {
    if (!zero3) return model.grad_data();
    flat.resize(size_t(np));
    fsdp->gather_flat(flat.data(), fsdp->grads());
    return flat.data();
  };
  // Global layout (what one process holds: every expert, offsets padded as Model lays them out) from a
  // local-layout vector: expert shards are gathered over the EP group. Collective under EP; without EP
  // it is a copy (the two layouts coincide).
  std::vector<int64_t> goff;
  int64_t gnp = 0;
  for (auto& p : model.params()) goff.push_back(gnp), gnp += param_padded_numel(shape_numel(p.global_shape));
  auto to_global = [&](const float* local) {
    std::vector<float> g(size_t(gnp), 0.0f);
    const auto& ps = model.params();
    for (size_t i = 0; i < ps.size(); ++i) {
      if (ps[i].expert && EP > 1) epc.all_gather(g.data() + goff[i], local + ps[i].offset, ps[i].numel * 4);
      else std::copy(local + ps[i].offset, local + ps[i].offset + ps[i].numel, g.data() + goff[i]);
    }
    return g;
  };
  auto from_global = [&](float* local, const std::vector<float>& g) {
    const auto& ps = model.params();
    for (size_t i = 0; i < ps.size(); ++i) {
      const float* src = g.data() + goff[i] + ps[i].shard_first;
      std::copy(src, src + ps[i].numel, local + ps[i].offset);
    }
  };
  std::vector<int32_t> in(size_t(B * T)), tg(size_t(B * T));

  FlopsPerToken fpt = flops_per_token(ms, T, true, cfg.activation_checkpoint);
  res.compute_dtype = compute;
  res.peak_gflops = cfg.metrics.peak_tflops > 0 ? cfg.metrics.peak_tflops * 1e3 : measure_peak_gflops(compute);

  // ---- checkpoint resume
  const std::string ckdir = (fs::path(res.dump_folder) / cfg.checkpoint.folder).string();
  res.checkpoint_dir = ckdir;
  int64_t step = 0;
  // Checkpoints hold global tensors (every expert): params, m and v go through global-layout vectors.
  std::vector<float> p_glob, m_glob, v_glob;
  auto model_tensors = [&]() {
    std::vector<CheckpointTensor> v;
    for (size_t i = 0; i < model.params().size(); ++i) {
      auto& p = model.params()[i];
      v.push_back({p.name, DType::F32, p.global_shape, p_glob.data() + goff[i]});
    }
    for (int i = 0; i < model.n_moe_layers(); ++i)
      v.push_back({"expert_bias." + std::to_string(i), DType::F32, {ms.moe.n_routed_experts}, model.expert_bias(i)});
    return v;
  };
  auto opt_tensors = [&]() {
    std::vector<CheckpointTensor> out;
    for (size_t i = 0; i < model.params().size(); ++i) {
      auto& p = model.params()[i];
      out.push_back({"m." + p.name, DType::F32, p.global_shape, m_glob.data() + goff[i]});
      out.push_back({"v." + p.name, DType::F32, p.global_shape, v_glob.data() + goff[i]});
    }
    return out;
  };
  auto free_glob = [&]() {
    std::vector<float>().swap(p_glob), std::vector<float>().swap(m_glob), std::vector<float>().swap(v_glob);
    std::vector<float>().swap(p_full);
  };
  if (cfg.checkpoint.enable) {
    if (auto latest = latest_complete_checkpoint(ckdir)) {
      LoadedCheckpoint ck = load_checkpoint(*latest);
      JobConfig saved = config_from_json(ck.state.at("config"));
      MT_CHECK(saved.model == ms, "train", "checkpoint ", *latest, " was written for a different model spec");
      p_glob.assign(size_t(gnp), 0.0f), m_glob.assign(size_t(gnp), 0.0f), v_glob.assign(size_t(gnp), 0.0f);
      for (auto& t : model_tensors()) load_into(ck.model, t.name, t.dtype, t.shape, const_cast<void*>(t.data));
      for (auto& t : opt_tensors()) load_into(ck.optimizer, t.name, t.dtype, t.shape, const_cast<void*>(t.data));
      if (zero3) {
        std::vector<float> pf(static_cast<size_t>(np));
        from_global(pf.data(), p_glob), fsdp->slice_flat(fsdp->params(), pf.data());
      } else {
        from_global(model.param_data(), p_glob);
      }
      std::vector<float> full(static_cast<size_t>(np));
      from_global(full.data(), m_glob), slice_state(mbuf.data<float>(), full);
      from_global(full.data(), v_glob), slice_state(vbuf.data<float>(), full);
      free_glob();
      step = ck.step;
      src->restore(ck.state.at("data"));
      model.sync_weights();
      if (say) std::printf("resumed from %s (step %lld)\n", latest->c_str(), (long long)step);
    }
  }
  res.start_step = step;
  if (step >= tr.steps && say)
    std::printf("nothing to train: the checkpoint is at step %lld and training.steps is %lld\n", (long long)step,
                (long long)tr.steps);

  res.metrics_path = (fs::path(res.dump_folder) / "metrics.jsonl").string();
  std::ofstream metrics;
  if (cfg.metrics.jsonl && root) {
    metrics.open(res.metrics_path, step > 0 ? std::ios::app : std::ios::trunc);
    MT_CHECK(metrics.good(), "train", "cannot open ", res.metrics_path, " for writing");
  }

  // Collective (the sharded optimizer state is gathered); rank 0 writes.
  auto save = [&](int64_t s) {
    {
      std::vector<float> full;
      p_glob = to_global(local_params());
      gather_state(full, mbuf.data<float>()), m_glob = to_global(full.data());
      gather_state(full, vbuf.data<float>()), v_glob = to_global(full.data());
    }
    struct Free {
      std::function<void()> f;
      ~Free() { f(); }
    } free_full{free_glob};
    if (!root) return std::string();
    CheckpointWriteRequest req;
    req.step = s;
    req.model = model_tensors();
    req.optimizer = opt_tensors();
    req.state = json{{"data", src->state()}, {"config", to_json(cfg)}, {"config_toml", to_toml(cfg)},
                     {"rng", {{"seed", tr.seed}}}};
    return save_checkpoint(ckdir, req, int(cfg.checkpoint.keep_latest_k));
  };

  // Validation batches 0..nb-1 (batch i = sequences [i*B, i*B + B) of the validation stream); under DP
  // rank r computes the contiguous range [nb*r/D, nb*(r+1)/D) and the per-batch sums are folded in batch
  // order (all_reduce_ordered), so the result is the single-process sum whatever D.
  auto run_validation = [&]() {
    const int64_t nb = std::max<int64_t>(1, tr.val_steps);
    const bool is_loader = val->state().contains("micro");
    std::vector<double> parts;
    int64_t cnt = 0;
    // Under EP and FSDP every rank must run the same number of forwards (MoE layers and unit gathers are
    // collective): ranks with fewer batches run their first one again and discard it.
    const int64_t lo = nb * rank / D, hi = nb * (rank + 1) / D;
    const int64_t iters = EP > 1 || zero3 ? (nb + D - 1) / D : hi - lo;
    for (int64_t j = 0; j < iters; ++j) {
      const int64_t i = lo + j < hi ? lo + j : lo;
      const uint64_t pos = uint64_t(i * B);
      val->restore(is_loader ? json{{"kind", "loader"}, {"epoch", 0}, {"position", pos}, {"micro", 0}}
                             : json{{"kind", "synthetic"}, {"position", pos}});
      val->next(in.data(), tg.data());
      ForwardStats fs_ = model.forward(in.data(), tg.data());
      if (lo + j >= hi) continue;
      parts.push_back(fs_.ce_sum), cnt += fs_.ce_count;
    }
    double sum = 0;
    dp.all_reduce_ordered(&sum, parts.data(), int64_t(parts.size()), 1);
    dp.all_reduce(&cnt, 1);
    return cnt ? sum / double(cnt) : 0.0;
  };

  if (say) {
    std::printf("training %s: %lld params, %d MoE layers, %lld tokens/step (%lld x %lld x %lld), %s, peak %.0f GFLOPS "
                "%s\n",
                cfg.job.name.c_str(), (long long)np, model.n_moe_layers(), (long long)(G * T), (long long)micro,
                (long long)B, (long long)T, runtime_summary().c_str(), res.peak_gflops,
                std::string(to_string(compute)).c_str());
    std::printf("compute dtype: %s (%s)\n", std::string(to_string(compute)).c_str(), compute_why.c_str());
  }
  if (say && D > 1)
    std::printf("data parallel: %s; %lld micro-batches per rank per step; optimizer state %s per rank%s\n",
                mesh.describe().c_str(), (long long)micro_local, human_bytes(res.opt_state_bytes).c_str(),
                sharded ? " (zero = 1: sharded)" : zero3 ? " (zero = 3: parameters, gradients, optimizer sharded)" : "");

  mt.reset_peaks();
  dp.reset_stats();
  const bool profiling = opt.profile || !opt.trace_path.empty();
  trace::reset();
  AdamWConfig ac;
  ac.beta1 = float(cfg.optimizer.beta1), ac.beta2 = float(cfg.optimizer.beta2), ac.eps = float(cfg.optimizer.eps);
  ac.weight_decay = float(cfg.optimizer.weight_decay);
  double time_total = 0;
  int64_t tokens_total = 0;
  double window_t = 0;
  int64_t window_tok = 0, window_steps = 0;
  EpTraffic ep_window0 = model.ep_traffic(), ep_run0 = ep_window0;
  std::vector<int64_t> load_sum;
  while (step < tr.steps) {
    // The first step warms caches and oneDNN primitives: it is not profiled.
    trace::enable(profiling && step > res.start_step);
    auto t0 = std::chrono::steady_clock::now();
    ++step;
    model.zero_grads();
    // Per micro-batch loss sums, folded in global micro-batch order below (= the single-process sum).
    std::vector<double> ce_parts(static_cast<size_t>(micro_local)), aux_parts(static_cast<size_t>(micro_local));
    int64_t ce_n = 0;
    // Normalized by the GLOBAL token count of the step (every target of the synthetic / loader data is valid).
    const float ce_scale = float(1.0 / double(G * T));
    for (int64_t mb = 0; mb < micro_local; ++mb) {
      {
        MT_TRACE("data");
        src->next(in.data(), tg.data());
      }
      if (opt.record_data)
        for (int64_t r = 0; r < B; ++r)
          res.data.push_back({step, rank * (G / D) + mb * B + r,
                              fnv1a(tg.data() + r * T, size_t(T) * 4, fnv1a(in.data() + r * T, size_t(T) * 4))});
      ForwardStats fs_ = model.forward_backward(in.data(), tg.data(), ce_scale, float(1.0 / double(micro)));
      ce_parts[size_t(mb)] = fs_.ce_sum, ce_n += fs_.ce_count, aux_parts[size_t(mb)] = fs_.aux_loss / double(micro);
    }
    double ce = 0, aux = 0;
    auto counts = model.take_expert_counts();
    {
      // DP: gradients summed over ranks (rank-order fold, bitwise identical on every rank) in buckets of
      // kCommReduceSegment elements of the flat buffer; loss sums, token and expert counts likewise.
      MT_TRACE("dp.all_reduce");
      dp.all_reduce_ordered(&ce, ce_parts.data(), micro_local, 1);
      dp.all_reduce_ordered(&aux, aux_parts.data(), micro_local, 1);
      if (D > 1) {
        dp.all_reduce(&ce_n, 1);
        // zero = 3: the gradients were reduce-scattered into the shards unit by unit, per micro-batch.
        for (auto& r : runs)
          if (r.comm->size() > 1 && !zero3)
            for (int64_t off = r.lo; off < r.hi; off += kCommReduceSegment)
              r.comm->all_reduce(model.grad_data() + off, std::min<int64_t>(kCommReduceSegment, r.hi - off));
        std::vector<int64_t> flat;
        for (auto& c : counts) flat.insert(flat.end(), c.begin(), c.end());
        dp.all_reduce(flat.data(), int64_t(flat.size()));
        size_t k = 0;
        for (auto& c : counts)
          for (auto& x : c) x = flat[k++];
      }
    }
    trace::Scope tr_opt("optimizer");
    double gn;
    if (zero3) {
      gn = std::sqrt(fsdp->grad_norm_sq());
    } else {  // replicated runs once, expert shards (EP only) summed over the EP group in rank order
      double sq_d = 0, sq_e = 0, sq_e_all = 0;
      for (auto& r : runs) (r.expert ? sq_e : sq_d) += grad_norm_sq(model.grad_data() + r.lo, r.hi - r.lo);
      epc.all_reduce_ordered(&sq_e_all, &sq_e, 1, 1);
      gn = std::sqrt(sq_d + sq_e_all);
    }
    if (opt.keep_first_grads && step == res.start_step + 1) {
      std::vector<float> flat;
      res.first_grads = to_global(local_grads(flat));
    }
    float clip = tr.max_norm > 0 ? clip_coefficient(gn, tr.max_norm) : 1.0f;
    ac.lr = float(lr_at(cfg.optimizer, cfg.lr_scheduler, step, tr.steps));
    // AdamW is element-wise: the update of this rank's slice is bitwise what the full update gives there.
    if (zero3) {  // the shard's pieces of parameters (a piece has one decay flag; padding is not updated)
      for (auto& sg : fsdp->segments())
        adamw_step(fsdp->params() + sg.shard_offset, mbuf.data<float>() + sg.shard_offset,
                   vbuf.data<float>() + sg.shard_offset, fsdp->grads() + sg.shard_offset, sg.count, ac, step, clip,
                   model.params()[size_t(sg.param)].decay);
    } else {
      for (auto& r : runs)
        for (auto& p : model.params()) {
          const int64_t a = std::max(r.s_lo, p.offset), b = std::min(r.s_hi, p.offset + p.numel);
          if (a < b)
            adamw_step(model.param_data() + a, mbuf.data<float>() + r.st + (a - r.s_lo),
                       vbuf.data<float>() + r.st + (a - r.s_lo), model.grad_data() + a, b - a, ac, step, clip,
                       p.decay);
        }
    }
    if (sharded) {
      MT_TRACE("dp.all_gather_params");
      for (auto& r : runs) {
        std::copy(model.param_data() + r.s_lo, model.param_data() + r.s_hi, stage.data());
        r.comm->all_gather_v(model.param_data() + r.lo, r.counts.data(), r.displs.data(), stage.data());
      }
    }
    model.update_expert_bias(counts);
    tr_opt.stop();
    {
      MT_TRACE("sync_weights");
      model.sync_weights();
    }
    trace::enable(false);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    time_total += dt, tokens_total += G * T, window_t += dt, window_tok += G * T, ++window_steps;

    StepRecord rec;
    rec.step = step, rec.loss = ce_n ? ce / double(ce_n) : 0, rec.aux_loss = aux, rec.lr = ac.lr, rec.grad_norm = gn;
    if (opt.record_param_hash) {
      uint64_t h = fnv1a(to_global(local_params()).data(), size_t(gnp) * 4);
      for (int i = 0; i < model.n_moe_layers(); ++i)
        h = fnv1a(model.expert_bias(i), size_t(ms.moe.n_routed_experts) * 4, h);
      rec.param_hash = h;
    }
    MT_CHECK(std::isfinite(rec.loss), "train", "loss became ", rec.loss, " at step ", step);
    bool do_val = tr.val_interval > 0 && (step % tr.val_interval == 0 || step == tr.steps);
    if (do_val) rec.val_loss = run_validation();
    res.history.push_back(rec);

    bool log_now = step % std::max<int64_t>(1, cfg.metrics.log_interval) == 0 || step == tr.steps || do_val;
    if (log_now) {
      // A start-up measurement taken while the machine was busy understates the peak (and overstates MFU):
      // re-measure briefly at every log step, outside the timed window, and keep the best figure.
      if (cfg.metrics.peak_tflops <= 0) res.peak_gflops = std::max(res.peak_gflops, measure_peak_gflops(compute, 1024, 3));
      double tps = window_tok / window_t;
      double tflops = tps * fpt.train * 1e-12;
      double mfu = tflops * 1e3 / (res.peak_gflops * D);  // peak measured per rank
      // expert load over all MoE layers of this step
      int64_t lmin = 0, lmax = 0;
      double cv = 0;
      if (!counts.empty()) {
        lmin = INT64_MAX;
        for (auto& c : counts) {
          LoadStats ls = router_load_stats(c.data(), int(c.size()));
          lmin = std::min(lmin, ls.min), lmax = std::max(lmax, ls.max), cv = std::max(cv, ls.cv);
        }
      }
      auto snap = mt.snapshot();
      json j{{"step", step},          {"loss", rec.loss},       {"aux_loss", rec.aux_loss}, {"lr", rec.lr},
             {"grad_norm", gn},       {"tokens_per_s", tps},   {"tflops", tflops},         {"mfu", mfu},
             {"mem_peak_bytes", snap.total_peak}, {"time_s", time_total},
             {"expert_load", {{"min", lmin}, {"max", lmax}, {"cv_max", cv}}}};
      json cat;
      for (int c = 0; c < kNumMemCategories; ++c) cat[std::string(mem_category_name(MemCategory(c)))] = snap.peak[c];
      j["mem_peak_by_category"] = cat;
      if (rec.val_loss >= 0) j["val_loss"] = rec.val_loss;
      if (EP > 1) {  // this rank's EP bytes sent and time per step over the window (validation included)
        EpTraffic now = model.ep_traffic();
        const double ws_ = double(std::max<int64_t>(1, window_steps));
        j["ep"] = {{"bytes_inter_per_step", double(now.bytes_inter - ep_window0.bytes_inter) / ws_},
                   {"bytes_intra_per_step", double(now.bytes_intra - ep_window0.bytes_intra) / ws_},
                   {"seconds_per_step", (now.seconds - ep_window0.seconds) / ws_}};
        ep_window0 = now;
      }
      if (metrics.is_open()) metrics << j.dump() << "\n" << std::flush;
      if (say) {
        char line[512];
        std::snprintf(line, sizeof line,
                      "step %5lld/%lld  loss %.4f  aux %.4f%s  lr %.2e  gnorm %.3f  %.0f tok/s  %.3f TFLOPS  MFU %.1f%%  "
                      "mem %s  load cv %.2f",
                      (long long)step, (long long)tr.steps, rec.loss, rec.aux_loss,
                      rec.val_loss >= 0 ? ("  val " + std::to_string(rec.val_loss).substr(0, 6)).c_str() : "", rec.lr,
                      gn, tps, tflops, mfu * 100, human_bytes(snap.total_peak).c_str(), cv);
        if (tty) std::printf("\r\033[K%s%s", line, (step == tr.steps || do_val) ? "\n" : "");
        else std::printf("%s\n", line);
        std::fflush(stdout);
      }
      window_t = 0, window_tok = 0, window_steps = 0;
    } else if (tty) {
      std::printf("\r\033[Kstep %5lld/%lld  loss %.4f", (long long)step, (long long)tr.steps, rec.loss);
      std::fflush(stdout);
    }
    if (cfg.checkpoint.enable && (step % std::max<int64_t>(1, cfg.checkpoint.interval) == 0 || step == tr.steps))
      save(step);
  }
  res.end_step = step;
  if (!res.history.empty()) {
    res.final_loss = res.history.back().loss;
    for (auto it = res.history.rbegin(); it != res.history.rend(); ++it)
      if (it->val_loss >= 0) {
        res.final_val_loss = it->val_loss;
        break;
      }
  }
  res.tokens_per_s = time_total > 0 ? double(tokens_total) / time_total : 0;
  res.tflops = res.tokens_per_s * fpt.train * 1e-12;
  res.mfu = res.tflops * 1e3 / (res.peak_gflops * D);
  res.comm_seconds = dp.stats().total().seconds;
  res.ep = EP;
  if (EP > 1) {
    EpTraffic t = model.ep_traffic();
    const double st_ = double(std::max<int64_t>(1, res.end_step - res.start_step));
    res.ep_bytes_inter_per_step = double(t.bytes_inter - ep_run0.bytes_inter) / st_;
    res.ep_bytes_intra_per_step = double(t.bytes_intra - ep_run0.bytes_intra) / st_;
    res.ep_seconds = t.seconds - ep_run0.seconds;
    res.ep_buffer_bytes = model.ep_buffer_bytes();
  }
  if (opt.keep_params) {
    res.final_params = to_global(local_params());
    for (int i = 0; i < model.n_moe_layers(); ++i)
      res.final_params.insert(res.final_params.end(), model.expert_bias(i),
                              model.expert_bias(i) + ms.moe.n_routed_experts);
  }
  res.mem_peak_bytes = mt.total_peak();
  res.act_peak_bytes = mt.peak(MemCategory::Activations);
  res.params_peak_bytes = mt.peak(MemCategory::Params);
  res.grads_peak_bytes = mt.peak(MemCategory::Grads);
  res.optimizer_peak_bytes = mt.peak(MemCategory::Optimizer);
  res.recompute_seconds = model.recompute_seconds();
  if (profiling) {
    double tot = 0;
    for (auto& t : trace::totals()) {
      res.op_seconds.push_back({t.name, t.seconds});
      if (t.name != "recompute.layer") tot += t.seconds;
    }
    if (!opt.trace_path.empty() && root) trace::write_chrome_trace(opt.trace_path, 0);
    if (say) {
      std::printf("\nper-op time over steps %lld..%lld (first step excluded; recompute.layer contains fwd.*):\n",
                  (long long)res.start_step + 2, (long long)res.end_step);
      for (auto& [n, sec] : res.op_seconds)
        std::printf("  %-22s %8.3f s  %5.1f%%\n", n.c_str(), sec, tot > 0 ? 100 * sec / tot : 0.0);
      if (!opt.trace_path.empty()) std::printf("chrome trace: %s\n", opt.trace_path.c_str());
    }
  }
  if (say) {
    std::printf("\nsummary: steps %lld..%lld  final loss %.4f  val loss %s  %.0f tokens/s  %.3f TFLOPS  MFU %.1f%% "
                "(of %.0f GFLOPS %s %s)\n",
                (long long)res.start_step, (long long)res.end_step, res.final_loss,
                res.final_val_loss >= 0 ? std::to_string(res.final_val_loss).c_str() : "n/a", res.tokens_per_s,
                res.tflops, res.mfu * 100, res.peak_gflops, std::string(to_string(compute)).c_str(),
                cfg.metrics.peak_tflops > 0 ? "stated in [metrics] peak_tflops" : "best measured in this run");
    auto snap = mt.snapshot();
    std::printf("memory peak %s:", human_bytes(snap.total_peak).c_str());
    for (int c = 0; c < kNumMemCategories; ++c)
      if (snap.peak[c]) std::printf(" %s %s", std::string(mem_category_name(MemCategory(c))).c_str(),
                                    human_bytes(snap.peak[c]).c_str());
    std::printf("\n");
    std::printf("memory per rank (peak): params %s  grads %s  optimizer %s  activations %s%s\n",
                human_bytes(res.params_peak_bytes).c_str(), human_bytes(res.grads_peak_bytes).c_str(),
                human_bytes(res.optimizer_peak_bytes).c_str(), human_bytes(res.act_peak_bytes).c_str(),
                zero3 ? "  (zero = 3: shards + one gathered unit)" : "");
    if (res.unigram_entropy > 0)
      std::printf("unigram entropy of the training data: %.4f nats/token (final train loss %.2f nats %s it)\n",
                  res.unigram_entropy, std::fabs(res.unigram_entropy - res.final_loss),
                  res.final_loss <= res.unigram_entropy ? "below" : "above");
    if (res.recompute_seconds > 0) std::printf("recompute time: %.2f s\n", res.recompute_seconds);
    std::printf("metrics: %s\n", res.metrics_path.c_str());
    if (cfg.checkpoint.enable) std::printf("checkpoints: %s\n", ckdir.c_str());
    if (D > 1) std::printf("DP collectives: %.3f s\n%s", res.comm_seconds, dp.stats().summary().c_str());
    if (EP > 1)
      std::printf("EP (%s%s): %.3f s in dispatch/combine; per step rank 0 sent %s to other nodes, %s inside its node; "
                  "dispatcher buffers %s\n",
                  std::string(to_string(cfg.parallelism.ep_dispatcher)).c_str(),
                  cfg.parallelism.fp8_dispatch ? ", fp8 payload" : "", res.ep_seconds,
                  human_bytes(int64_t(res.ep_bytes_inter_per_step)).c_str(),
                  human_bytes(int64_t(res.ep_bytes_intra_per_step)).c_str(), human_bytes(res.ep_buffer_bytes).c_str());
  }
  if (world.size() > 1) world.barrier();  // rank 0's checkpoint and metrics are on disk when any rank returns
  return res;
}

}  // namespace moetron
