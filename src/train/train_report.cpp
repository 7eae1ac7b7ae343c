// train_report.cpp: what a training run prints and logs: the start-up lines and the resolved config.toml in the
// dump folder, one metrics.jsonl record and progress line per log step, and the end summary; plus
// TrainSession::finish, which fills the result's totals. Not the step (train_step.cpp); not the HTML run
// report that reads these files (src/report/).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "moetron/check.h"
#include "moetron/config_notes.h"
#include "moetron/memory.h"
#include "moetron/router.h"
#include "moetron/runtime.h"
#include "train/train_session.h"

using json = nlohmann::json;

namespace moetron {

std::string human_bytes(int64_t b) {
  char buf[32];
  if (b >= (int64_t(1) << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(1 << 30));
  else std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(1 << 20));
  return buf;
}

namespace {
// The per-layer expert load of one log step for metrics.jsonl (the run report's heatmap): tokens routed to each
// expert of each MoE layer this rank holds, summed over DP. A record keeps at most kMaxExpertCells numbers:
// beyond that, consecutive experts are summed in bins of `bin` (the last bin may be smaller).
constexpr int64_t kMaxExpertCells = 1024;
json expert_counts_json(const ModelSpec& ms, const std::vector<int>& moe_ids,
                        const std::vector<std::vector<int64_t>>& counts) {
  const int64_t L = int64_t(counts.size()), E = int64_t(counts[0].size());
  const int64_t cols = std::clamp<int64_t>(kMaxExpertCells / L, 1, E), bin = (E + cols - 1) / cols;
  std::vector<int64_t> layer_of;  // model layer of each global MoE index (the MTP blocks' ids follow the layers')
  for (int64_t l = 0; l < ms.n_blocks(); ++l)
    if (ms.is_moe_block(l)) layer_of.push_back(l);
  json layers = json::array(), rows = json::array();
  for (int64_t k = 0; k < L; ++k) {
    layers.push_back(layer_of.at(size_t(moe_ids.at(size_t(k)))));
    std::vector<int64_t> row(size_t((E + bin - 1) / bin), 0);
    for (int64_t e = 0; e < E; ++e) row[size_t(e / bin)] += counts[size_t(k)][size_t(e)];
    rows.push_back(row);
  }
  return {{"layers", layers}, {"experts", E}, {"bin", bin}, {"counts", rows}};
}

// Dead experts per MoE layer: experts that received no token in any step of the logging window (the steps since
// the previous log record; validation excluded). One entry per row of `window` (global MoE order).
json dead_experts_json(const std::vector<std::vector<int64_t>>& window) {
  json dead = json::array();
  for (const auto& c : window) dead.push_back(std::count(c.begin(), c.end(), int64_t(0)));
  return dead;
}

// Under pipeline parallelism each rank holds its stages' MoE layers: every pipeline rank sends its
// (MoE index, experts, counts...) rows and gets all of them, in global MoE order.
void gather_stage_counts(const Comm& pp, std::vector<int>& ids, std::vector<std::vector<int64_t>>& counts) {
  std::vector<int64_t> mine;
  for (size_t k = 0; k < ids.size(); ++k) {
    mine.insert(mine.end(), {int64_t(ids[k]), int64_t(counts[k].size())});
    mine.insert(mine.end(), counts[k].begin(), counts[k].end());
  }
  const int P = pp.size();
  std::vector<int64_t> bytes(static_cast<size_t>(P)), displs(static_cast<size_t>(P), 0);
  const int64_t my_bytes = int64_t(mine.size()) * 8;
  pp.all_gather(bytes.data(), &my_bytes, 8);
  for (int r = 1; r < P; ++r) displs[size_t(r)] = displs[size_t(r - 1)] + bytes[size_t(r - 1)];
  std::vector<int64_t> all(size_t((displs[size_t(P - 1)] + bytes[size_t(P - 1)]) / 8));
  pp.all_gather_v(all.data(), bytes.data(), displs.data(), mine.data());
  std::map<int, std::vector<int64_t>> by_id;
  for (size_t i = 0; i + 2 <= all.size(); i += 2 + size_t(all[i + 1]))
    by_id[int(all[i])].assign(all.begin() + int64_t(i) + 2, all.begin() + int64_t(i) + 2 + all[i + 1]);
  ids.clear(), counts.clear();
  for (auto& [id, c] : by_id) ids.push_back(id), counts.push_back(std::move(c));
}
}  // namespace

void TrainSession::print_start() const {
  if (root) {  // the resolved config beside metrics.jsonl, every key (moetron report shows it)
    const std::string path = (std::filesystem::path(res.dump_folder) / "config.toml").string();
    std::ofstream f(path);
    f << to_toml(cfg);
    MT_CHECK(f.good(), "train", "cannot write ", path);
  }
  if (root)  // settings this run leaves without effect, named even under --quiet (config_notes.h)
    for (const InertSetting& n : inert_settings(cfg, {.world = world.size(), .dp = int(D), .profile_flag = opt.profile}))
      std::fprintf(stderr, "%s\n", format_note(n).c_str());
  if (!say) return;
  {
    std::printf("training %s: %lld params, %d MoE layers, %lld tokens/step (%lld x %lld x %lld), %s, peak %.0f GFLOPS "
                "%s\n",
                cfg.job.name.c_str(), (long long)state->global_numel(), model->n_moe_layers_total(), (long long)(G * T), (long long)micro,
                (long long)B, (long long)T, runtime_summary().c_str(), res.peak_gflops,
                std::string(to_string(compute)).c_str());
    std::printf("compute dtype: %s (%s)\n", std::string(to_string(compute)).c_str(), compute_why.c_str());
    if (compute == ComputeDtype::BF16)
      std::printf("attention: %s\n", model->attention_bf16()
                                          ? "bf16 products (vdpbf16ps outruns fp32 FMAs on this CPU)"
                                          : "fp32 products (vdpbf16ps is no faster than fp32 FMAs on this CPU)");
    if (!cfg.training.memory_check)
      std::printf("memory check: off (training.memory_check = false): the estimate is not held to this node's memory\n");
    const CheckpointSpec& ck = cfg.checkpoint;
    if (ck.enable)
      std::printf("checkpoints: every %lld steps into %s, keeping %s, written %s\n", (long long)ck.interval,
                  ck.folder.c_str(), ck.keep_latest_k > 0 ? ("the latest " + std::to_string(ck.keep_latest_k)).c_str() : "all",
                  ck.async ? "in the background (checkpoint.async)" : "at the step boundary");
  }
  if (D > 1)
    std::printf("data parallel: %s; %lld micro-batches per rank per step; optimizer state %s per rank%s\n",
                mesh.describe().c_str(), (long long)micro_local, human_bytes(res.opt_state_bytes).c_str(),
                state->zero1() ? " (zero = 1: sharded)" : zero3 ? " (zero = 3: parameters, gradients, optimizer sharded)" : "");

  if (PP > 1) {
    const auto& rt = exec->runtime();
    std::printf("pipeline: %s, %d stages (%s), %lld micro-batches per step; this rank holds stage",
                plan.setup.spec.schedule.c_str(), plan.lowered.n_stages, plan.setup.layout.to_string().c_str(),
                (long long)micro_local);
    for (int s : rt.stage_ids()) std::printf(" %d (%d activation slots)", s, rt.stage_slots(s));
    std::printf("\n");
  }
}

void TrainSession::log_step(const StepRecord& rec, const StepTotals& t, bool do_val) {
const auto& tr = cfg.training;
const bool log_now =
    step % std::max<int64_t>(1, cfg.metrics.log_interval) == 0 || step == tr.steps || do_val || rec.skipped;
auto& mt = MemoryTracker::global();
const auto& counts = t.counts;
const double gn = t.grad_norm;
if (window_counts.size() != counts.size()) {
  window_counts.assign(counts.size(), {});
  for (size_t k = 0; k < counts.size(); ++k) window_counts[k].assign(counts[k].size(), 0);
}
for (size_t k = 0; k < counts.size(); ++k)
  for (size_t e = 0; e < counts[k].size(); ++e) window_counts[k][e] += counts[k][e];
if (log_now) {
    // A start-up measurement taken while the machine was busy understates the peak (and overstates MFU):
    // re-measure briefly at every log step, outside the timed window, and keep the best figure.
    if (cfg.metrics.peak_tflops <= 0) res.peak_gflops = std::max(res.peak_gflops, measure_peak_gflops(compute, 1024, 3));
    double tps = window_tok / window_t;
    double tflops = tps * fpt.train * 1e-12;
    double mfu = tflops * 1e3 / (res.peak_gflops * world.size());  // peak measured per rank
    // expert load over all MoE layers of this step
    int64_t lmin = 0, lmax = 0, dead_total = 0;
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
    if (cfg.model.mtp_layers > 0) j["mtp_loss"] = rec.mtp_loss;  // not in "loss" (the main model's alone)
    j["skipped_steps"] = skipped_steps;  // training.nonfinite = "skip": steps without an update so far
    if (rec.skipped) j["skipped"] = true;
    if (!t.fp8.empty()) {  // [quantize]: per module and operand, the step's amax and the range of scales used
      json f;
      for (const auto& m : t.fp8) {
        json mj;
        const char* ops[3] = {"x", "w", "dy"};
        for (int op = 0; op < 3; ++op)
          mj[ops[op]] = {{"amax", m.amax[op]}, {"scale_min", m.scale_min[op]}, {"scale_max", m.scale_max[op]}};
        f[m.module] = mj;
      }
      j["fp8"] = f;
    }
    if (model->n_moe_layers_total() > 0) {  // every pipeline rank takes part in the gather
      std::vector<int> ids = model->local_moe_layers();
      std::vector<std::vector<int64_t>> all = counts, win = window_counts;
      std::vector<int> win_ids = ids;
      if (PP > 1) gather_stage_counts(mcs.pp, ids, all), gather_stage_counts(mcs.pp, win_ids, win);
      if (!all.empty()) {
        j["expert_counts"] = expert_counts_json(cfg.model, ids, all);
        j["expert_counts"]["dead"] = dead_experts_json(win);
        j["expert_counts"]["dead_window_steps"] = window_steps;
        for (const auto& n : j["expert_counts"]["dead"]) dead_total += n.get<int64_t>();
      }
    }
    for (auto& c : window_counts) std::fill(c.begin(), c.end(), 0);
    if (PP > 1) {  // this rank's (rank 0: the first stage's) measured step: busy, waiting, bubble
      const auto& r = t.runtime;
      j["pp"] = {{"step_s", r.seconds}, {"compute_s", r.compute_seconds}, {"recv_wait_s", r.recv_seconds},
                 {"send_wait_s", r.send_wait_seconds}, {"bubble", r.seconds > 0 ? 1 - r.compute_seconds / r.seconds : 0.0}};
    }
    if (EP > 1) {  // this rank's EP bytes sent and time per step over the window (validation included)
      EpTraffic now = model->ep_traffic();
      const double ws_ = double(std::max<int64_t>(1, window_steps));
      // wait / exposed: the measured union of the lanes' exchange waits and the part of it no lane's compute
      // covered (ep_exposure.h); seconds_per_step sums the exchange calls of both lanes.
      const Model::EpExposed ex = model->ep_exposed();
      j["ep"] = {{"bytes_inter_per_step", double(now.bytes_inter - ep_window0.bytes_inter) / ws_},
                 {"bytes_intra_per_step", double(now.bytes_intra - ep_window0.bytes_intra) / ws_},
                 {"seconds_per_step", (now.seconds - ep_window0.seconds) / ws_},
                 {"wait_seconds_per_step", (ex.wait_seconds - ep_exp_window0.wait_seconds) / ws_},
                 {"exposed_seconds_per_step", (ex.exposed_seconds - ep_exp_window0.exposed_seconds) / ws_},
                 {"exposed_paired_seconds_per_step",
                  (ex.exposed_paired_seconds - ep_exp_window0.exposed_paired_seconds) / ws_},
                 {"wgrad_fill_seconds_per_step", (ex.wgrad_fill_seconds - ep_exp_window0.wgrad_fill_seconds) / ws_}};
      ep_window0 = now, ep_exp_window0 = ex;
    }
    if (metrics.is_open()) metrics << j.dump() << "\n" << std::flush;
    if (say) {
      char line[512];
      std::snprintf(line, sizeof line,
                    "step %5lld/%lld  loss %.4f  aux %.4f%s  lr %.2e  gnorm %.3f  %.0f tok/s  %.3f TFLOPS  MFU %.1f%%  "
                    "mem %s  load cv %.2f  dead %lld%s",
                    (long long)step, (long long)tr.steps, rec.loss, rec.aux_loss,
                    rec.val_loss >= 0 ? ("  val " + std::to_string(rec.val_loss).substr(0, 6)).c_str() : "", rec.lr,
                    gn, tps, tflops, mfu * 100, human_bytes(snap.total_peak).c_str(), cv, (long long)dead_total,
                    cfg.model.mtp_layers > 0 ? ("  mtp " + std::to_string(rec.mtp_loss).substr(0, 6)).c_str() : "");
      if (tty) std::printf("\r\033[K%s%s", line, (step == tr.steps || do_val) ? "\n" : "");
      else std::printf("%s\n", line);
      std::fflush(stdout);
    }
    window_t = 0, window_tok = 0, window_steps = 0;
  } else if (tty) {
    std::printf("\r\033[Kstep %5lld/%lld  loss %.4f", (long long)step, (long long)tr.steps, rec.loss);
    std::fflush(stdout);
  }
}

void TrainSession::finish() {
  auto& mt = MemoryTracker::global();
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
  res.mfu = res.tflops * 1e3 / (res.peak_gflops * world.size());
  res.comm_seconds = mcs.dp.stats().total().seconds;
  res.ep = EP;
  if (EP > 1) {
    EpTraffic t = model->ep_traffic();
    const double st_ = double(std::max<int64_t>(1, res.end_step - res.start_step));
    res.ep_bytes_inter_per_step = double(t.bytes_inter - ep_run0.bytes_inter) / st_;
    res.ep_bytes_intra_per_step = double(t.bytes_intra - ep_run0.bytes_intra) / st_;
    res.ep_seconds = t.seconds - ep_run0.seconds;
    const Model::EpExposed ex = model->ep_exposed();
    res.ep_wait_seconds = ex.wait_seconds - ep_run0_exposed.wait_seconds;
    res.ep_exposed_seconds = ex.exposed_seconds - ep_run0_exposed.exposed_seconds;
    res.ep_exposed_paired_seconds = ex.exposed_paired_seconds - ep_run0_exposed.exposed_paired_seconds;
    res.ep_wgrad_fill_tasks = ex.wgrad_fill_tasks - ep_run0_exposed.wgrad_fill_tasks;
    res.ep_buffer_bytes = model->ep_buffer_bytes();
    const Model::EpRows er = model->ep_rows();
    if (er.balanced > 0)
      res.ep_rows_peak_ratio = double(er.peak) / double(er.balanced), res.ep_rows_held_ratio = double(er.held) / double(er.balanced);
  }
  if (opt.keep_params) {
    res.final_params = state->global_params_values();
    const std::vector<float> b = state->global_biases();
    res.final_params.insert(res.final_params.end(), b.begin(), b.end());
  }
  res.mem_peak_bytes = mt.total_peak();
  res.act_peak_bytes = mt.peak(MemCategory::Activations);
  {
    // The engine's convention: fp32 activations, GEMM inputs in the compute dtype.
    const Fp8CachePlan f8 = fp8_cache_plan(cfg.quantize);  // cached FP8 activations replace their copies
    // CP: the model holds seq_len / cp tokens of each sequence, and every buffer follows them.
    const int64_t Tl = T / mesh.cp();
    const ActivationBytes ab = engine_activation_bytes(cfg.model, B, Tl, compute == ComputeDtype::BF16 ? 2 : 4,
                                                       resolve_checkpointing(cfg), f8);
    int64_t pred = 0;
    for (int k = 0; k < model->n_stages(); ++k) {
      const ModelStagePart& p = model->stage_part(k);
      int64_t per_mb = 0;
      const ActivationCheckpointSpec acr = resolve_checkpointing(cfg);
      const int64_t cb = compute == ComputeDtype::BF16 ? 2 : 4;
      const double tp = double(mesh.tp());
      bool shared[2] = {false, false};  // TP with full recompute: one re-materialization set per layer kind
      auto tp_block = [&](int64_t l) {  // a TP layer (or MTP block, of the last layer's kind) on the rank's rows
        const bool moe = cfg.model.is_moe_block(l), rec = acr.mode == AcMode::Full && acr.applies_to(l);
        per_mb += rec ? int64_t(double(B * Tl) / tp * double(cfg.model.d_model) * 4)
                      : int64_t(engine_tp_layer_bytes(cfg.model, moe, double(B * Tl), tp, cb));
        if (rec && !shared[moe]) pred += int64_t(engine_tp_layer_bytes(cfg.model, moe, double(B * Tl), tp, cb, false)),
                                  shared[moe] = true;
      };
      // Without TP, full recompute: the one re-materialization set per layer kind the engine shares (a block's
      // saved buffers when not recomputed, less its input, which the recomputed block keeps).
      const ActivationBytes ab_none = engine_activation_bytes(cfg.model, B, Tl, cb, ActivationCheckpointSpec{}, f8);
      auto full_set = [&](int64_t l) {
        const bool moe = cfg.model.is_moe_block(l);
        if (tp > 1 || acr.mode != AcMode::Full || !acr.applies_to(l) || shared[moe]) return;
        const int64_t like = l < cfg.model.n_layers ? l : cfg.model.n_layers - 1;
        pred += ab_none.layers[size_t(like)].total() +
                int64_t(engine_activation_extras(cfg.model, like, double(B * Tl), ActivationCheckpointSpec{}, cb, f8)) -
                B * Tl * cfg.model.d_model * 4;
        shared[moe] = true;
      };
      for (int64_t l : p.layers) {
        if (tp == 1) {
          per_mb += ab.layers[size_t(l)].total() + int64_t(engine_activation_extras(cfg.model, l, double(B * Tl), acr, cb, f8));
          full_set(l);
          continue;
        }
        tp_block(l);
      }
      // The MTP depths (model_mtp.cpp) on the head stage: each a block of the last layer's kind (with its own
      // recompute choice, by block id) and the depth's own buffers, on the rank's rows.
      const int64_t nL = cfg.model.n_layers;
      for (int64_t k = 0; p.head && k < cfg.model.mtp_layers; ++k) {
        const int64_t blk = nL + k;
        if (tp > 1) {
          tp_block(blk);
        } else {  // the last layer's terms under the depth's own recompute choice
          ActivationCheckpointSpec ac_d = acr;
          ac_d.layer_ids.clear(), ac_d.stage_ids.clear();
          if (!acr.applies_to(blk)) ac_d = ActivationCheckpointSpec{};
          const ActivationBytes ab_d = engine_activation_bytes(cfg.model, B, Tl, cb, ac_d, f8);
          per_mb += ab_d.layers[size_t(nL - 1)].total() +
                    int64_t(engine_activation_extras(cfg.model, blk, double(B * Tl), acr, cb, f8));
          full_set(blk);
        }
        const int64_t Nr = B * Tl / mesh.tp(), dm = cfg.model.d_model;
        per_mb += Nr * dm * (12 + 2 * cb) + Nr * 8;
      }
      pred += int64_t(p.slots) * per_mb;
      for (const ActTerm& t : ab.outside.terms) {  // embed.* on the embedding stage, the rest on the head stage;
        // loss.dx is kept per micro-batch in flight
        if (!(t.name.rfind("embed.", 0) == 0 ? p.embedding : p.head)) continue;
        // (one stage with one slot keeps it in the backward scratch: Model's build_slots)
        const bool scratch = model->n_stages() == 1 && p.slots == 1;
        // TP: the final norm's input and rstd and the head's dL/dx hold this rank's rows; the norm's output (the
        // head's input) all rows
        const bool rows = t.name == "final_norm.x" || t.name == "final_norm.rstd" || t.name == "loss.dx";
        const int64_t bytes = rows ? t.bytes / mesh.tp() : t.bytes;
        pred += t.name == "loss.dx" ? (scratch ? 0 : int64_t(p.slots) * bytes) : bytes;
      }
    }
    res.act_predicted_bytes = pred;
  }
  res.params_peak_bytes = mt.peak(MemCategory::Params);
  res.grads_peak_bytes = mt.peak(MemCategory::Grads);
  res.optimizer_peak_bytes = mt.peak(MemCategory::Optimizer);
  res.recompute_seconds = model->recompute_seconds();
  end_profiling();  // the per-op breakdown and this rank's trace file (train_profile.cpp)
  if (root && !record.steps.empty()) {
    record.schedule_name = plan.lowered.name, record.lowered = plan.lowered;
    res.pipeline_record_path = (std::filesystem::path(res.dump_folder) / "pipeline_record.json").string();
    sched::write_record(record, res.pipeline_record_path);
  }
  print_summary();
  if (world.size() > 1) world.barrier();  // rank 0's checkpoint and metrics are on disk when any rank returns
}

void TrainSession::print_summary() const {
  auto& mt = MemoryTracker::global();
  if (!say) return;
  {
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
    if (PP > 1)
      std::printf("activations on this rank: peak %s measured, %s predicted (activation slots x bytes per "
                  "micro-batch of the stage's layers)\n",
                  human_bytes(res.act_peak_bytes).c_str(), human_bytes(res.act_predicted_bytes).c_str());
    std::printf("metrics: %s\n", res.metrics_path.c_str());
    if (cfg.checkpoint.enable) std::printf("checkpoints: %s\n", ckdir.c_str());
    if (!res.pipeline_record_path.empty())
      std::printf("pipeline record: %s (%zu steps; moetron viz pipeline --run %s)\n", res.pipeline_record_path.c_str(),
                  record.steps.size(), res.dump_folder.c_str());
    if (D > 1) std::printf("DP collectives: %.3f s\n%s", res.comm_seconds, mcs.dp.stats().summary().c_str());
    if (EP > 1)
      std::printf("EP (%s%s): %.3f s in dispatch/combine; per step rank 0 sent %s to other nodes, %s inside its node; "
                  "dispatcher buffers %s\n",
                  std::string(to_string(cfg.parallelism.ep_dispatcher)).c_str(),
                  cfg.parallelism.fp8_dispatch ? ", fp8 payload" : "", res.ep_seconds,
                  human_bytes(int64_t(res.ep_bytes_inter_per_step)).c_str(),
                  human_bytes(int64_t(res.ep_bytes_intra_per_step)).c_str(), human_bytes(res.ep_buffer_bytes).c_str());
  }
}

}  // namespace moetron
