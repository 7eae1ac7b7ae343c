// model_stage.cpp: the model as pipeline stages. Which layers and ends this rank holds (ModelParallel::stages,
// or the whole model as one stage), the per-slot activations that let a stage keep several micro-batches in
// flight (inputs, saved activations, EP dispatchers; a fully recomputed layer keeps only its input per slot),
// one stage's forward and backward for one micro-batch, and the split backward: the I half records every
// weight-gradient GEMM with copies of its operands, the W half replays them in the same order.
// Not the order of stages and micro-batches (the pipeline runtime runs the schedule: src/parallel/) and not
// the layer math (model_layer.cpp and the blocks).
#include <algorithm>
#include <utility>
#include <cstring>
#include <string>

#include "model/model_impl.h"
#include "moetron/trace.h"

namespace moetron {

using model_detail::f32buf;

void Model::Impl::build_stages() {
  const int64_t nL = s.n_layers;
  layers.assign(size_t(s.n_blocks()), Layer{});  // the decoder layers, then the MTP blocks (held with the head)
  const std::vector<ModelStagePart>* parts = par.stages;
  if (!parts || parts->empty()) {
    ModelStagePart all;
    all.stage = 0, all.embedding = true, all.head = true, all.slots = 1;
    for (int64_t l = 0; l < nL; ++l) all.layers.push_back(l);
    stages.push_back(StageRt{all, {}, {}, {}});
  } else {
    for (const auto& p : *parts) stages.push_back(StageRt{p, {}, {}, {}});
  }
  for (auto& L : layers) L.held = false;
  has_emb = has_head = false;
  int prev_stage = -1;
  for (const auto& st : stages) {
    const ModelStagePart& p = st.part;
    MT_CHECK(p.stage > prev_stage, "Model(stages)", "stage ids must ascend; got ", p.stage, " after ", prev_stage);
    MT_CHECK(p.slots >= 1, "Model(stages)", "stage ", p.stage, " has ", p.slots, " activation slots (need >= 1)");
    prev_stage = p.stage;
    for (size_t i = 0; i < p.layers.size(); ++i) {
      const int64_t l = p.layers[i];
      MT_CHECK(l >= 0 && l < nL, "Model(stages)", "stage ", p.stage, " names layer ", l, " of a ", nL,
               "-layer model");
      MT_CHECK(i == 0 || l == p.layers[i - 1] + 1, "Model(stages)", "stage ", p.stage,
               " layers must be contiguous and ascending (", p.layers[i - 1], " then ", l, ")");
      MT_CHECK(!layers[size_t(l)].held, "Model(stages)", "layer ", l, " is in two local stages");
      layers[size_t(l)].held = true;
    }
    MT_CHECK(!p.embedding || p.layers.empty() || p.layers.front() == 0, "Model(stages)", "the embedding stage ",
             p.stage, " must start at layer 0, not ", p.layers.front());
    MT_CHECK(!p.head || p.layers.empty() || p.layers.back() == nL - 1, "Model(stages)", "the head stage ", p.stage,
             " must end at layer ", nL - 1, ", not ", p.layers.back());
    has_emb |= p.embedding, has_head |= p.head;
  }
  for (auto& st : stages) {  // the blocks a stage runs: its layers, then the MTP blocks on the head stage
    st.blocks = st.part.layers;
    if (st.part.head)
      for (int64_t b = nL; b < s.n_blocks(); ++b) st.blocks.push_back(b), layers[size_t(b)].held = true;
  }
  whole = stages.size() == 1 && has_emb && has_head && int64_t(stages[0].part.layers.size()) == nL &&
          stages[0].part.slots == 1;
  MT_CHECK(whole || !fs_opts || !s.tie_embeddings, "Model(stages)",
           "tied embeddings under FSDP (parallelism.zero = 3) need the whole model in one stage with one micro-batch "
           "in flight: the tied weight's unit stays gathered from the embedding to the head (set "
           "model.tie_embeddings = false, another parallelism.zero, or pp = 1 with pp_schedule = \"1f1b\")");
}

// Per-slot buffers of the held layers. A layer under full recompute keeps only its input per slot and
// shares one set of saved activations (and one dispatcher) with the other recomputed layers of its kind: its
// backward recomputes them right before use.
void Model::Impl::build_slots() {
  LayerBufs* shared[2] = {nullptr, nullptr};
  EpDispatch* shared_disp = nullptr;
  auto make_disp = [&]() {
    EpDispatchConfig dc;
    dc.kind = par.dispatcher, dc.n_experts = int(E), dc.topk = int(K), dc.hidden = d, dc.max_tokens = N;
    dc.ranks_per_node = par.ep_ranks_per_node;
    dc.dispatch_payload = par.fp8_dispatch ? EpPayload::E4M3 : f32 ? EpPayload::F32 : EpPayload::BF16;
    dc.combine_payload = EpPayload::F32;
    dc.transport = par.ep_transport;
    dc.land_rows = !par.fp8_dispatch;  // rows in the compute dtype land where the experts' GEMMs read them
    // With the overlap two dispatchers may exchange at once: each gets a communicator of its own (collective
    // over the EP group; every EP rank builds the same dispatchers in the same order).
    owned_disp.push_back(std::make_unique<EpDispatch>(par.ep_overlap ? ep_comm.split(0, ep_comm.rank()) : ep_comm, dc));
    return owned_disp.back().get();
  };
  auto new_bufs = [&](bool moe) {
    owned_bufs.push_back(std::make_unique<LayerBufs>());
    alloc_bufs(*owned_bufs.back(), moe);
    return owned_bufs.back().get();
  };
  for (auto& st : stages) {
    const int S = st.part.slots;
    for (int64_t l : st.blocks) {
      Layer& L = layers[size_t(l)];
      for (int k = 0; k < S; ++k) {
        L.slot_x_in.push_back(f32buf(Nr * d));
        LayerBufs* b = nullptr;
        if (L.recompute) {
          if (!shared[L.moe]) shared[L.moe] = new_bufs(L.moe);
          b = shared[L.moe];
        } else {
          b = new_bufs(L.moe);
        }
        L.slot_bufs.push_back(b);
        if (L.moe && ep > 1) {
          if (L.recompute && !shared_disp) shared_disp = make_disp();
          L.slot_disp.push_back(L.recompute ? shared_disp : make_disp());
        }
        if (L.sel_norm) b->h1c = sel.h1c, b->h2 = sel.h2, b->h2c = sel.h2c;
        if (L.sel_attn) b->ao = sel.ao, b->aoc = sel.aoc, b->lse = sel.lse;
        if (L.sel_act) {
          b->eactc = sel.eactc;
          if (Fs > 0) b->actc = sel.actc;
          sel_act_bufs.push_back(b);
        }
      }
    }
    st.warena.resize(size_t(S));
    if (st.part.head) {
      // One stage with one slot: the scratch dx is free between its F and B (nothing else runs between).
      if (stages.size() == 1 && S == 1) st.head_g.push_back(dx);
      else
        for (int k = 0; k < S; ++k) st.head_g.push_back(f32buf(Nr * d));
    }
    use_slot(st, 0);
  }
}

void Model::Impl::use_slot(StageRt& st, int slot) {
  MT_CHECK(slot >= 0 && slot < st.part.slots, "Model::stage", "slot ", slot, " of stage ", st.part.stage,
           " outside [0, ", st.part.slots, ")");
  for (int64_t l : st.blocks) {
    Layer& L = layers[size_t(l)];
    L.x_in = L.slot_x_in[size_t(slot)];
    L.bufs = L.slot_bufs[size_t(slot)];
    L.disp = L.slot_disp.empty() ? nullptr : L.slot_disp[size_t(slot)];
  }
}

void Model::Impl::begin_pass() {
  last_aux = last_z = 0;
  last_dropped = 0;
  cur_aux.assign(size_t(n_moe_total), 0.0);
  cur_z.assign(size_t(n_moe_total), 0.0);
}

void Model::Impl::end_pass(ForwardStats& st) {
  st.aux_loss = last_aux, st.z_loss = last_z, st.dropped = last_dropped;
  st.aux_by_layer = cur_aux, st.z_by_layer = cur_z;
}

// ---------------------------------------------------------------------------------------------------
// the split backward's arena

void Model::Impl::record_wgrad(WTask::Kind k, int p, const void* x, const void* dy, const int32_t* kept,
                               int64_t rows, int64_t in, int64_t out) {
  MT_CHECK(!fp8_cached(p), "Model (split backward)", "quantize.cache_fp8_activations = true is not implemented with "
           "a split backward (pp_schedule zb1p, zbv, dualpipev, or a schedule CSV with I / W): the deferred weight "
           "gradient would need the cached FP8 operands; use false, or a schedule with B");
  WArena& a = *defer;
  if (a.tasks.empty() && !a.buf.defined()) wpool->take(a);
  const size_t esz = k == WTask::LinF32 || f32 ? 4 : 2;
  auto al = [](size_t b) { return (b + 63) / 64 * 64; };
  const size_t xb = size_t(rows * in) * esz, yb = size_t(rows * out) * esz;
  const size_t kb = k == WTask::Grouped ? size_t(El) * 4 : 0;
  const size_t need = a.used + al(xb) + al(yb) + al(kb);
  const size_t cap = a.buf.defined() ? size_t(a.buf.numel()) * 4 : 0;
  if (need > cap) {  // grows on the first steps (and with EP row growth); keeps what is recorded
    const size_t ncap = std::max(need, cap + cap / 4);
    Tensor nb = Tensor::zeros({int64_t((ncap + 3) / 4)}, DType::F32, MemCategory::Activations, "split_bwd.arena");
    if (a.used) std::memcpy(nb.raw(), a.buf.raw(), a.used);
    a.buf = nb;
  }
  char* base = static_cast<char*>(a.buf.raw());
  WTask t;
  t.kind = k, t.param = p, t.rows = rows, t.in = in, t.out = out;
  t.x = a.used, std::memcpy(base + t.x, x, xb), a.used += al(xb);
  t.dy = a.used, std::memcpy(base + t.dy, dy, yb), a.used += al(yb);
  if (kb) t.kept = a.used, std::memcpy(base + t.kept, kept, kb), a.used += al(kb);
  a.tasks.push_back(t);
}

// Runs the recorded GEMMs in recording order (layers descending), each layer's FSDP unit gathered for its
// gradient only (released: reduce-scattered into the shard).
void Model::Impl::replay_wgrads(WArena& a) {
  MT_CHECK(!defer, "Model::stage_backward_weight", "called inside an I half");
  int unit = -1;
  for (size_t k = a.next; k < a.tasks.size(); ++k) {  // from the first not yet run (fill_with_wgrad)
    const WTask& t = a.tasks[k];
    const int u = fs_on ? fs_unit[size_t(t.param)] : -1;
    if (u != unit) {
      if (unit >= 0) fs_release(unit);
      if (u >= 0) fs_acquire(u, false, true);
      unit = u;
    }
    run_wtask(a, t);
  }
  if (unit >= 0) fs_release(unit);
  wpool->give(a);
}

void WArenaPool::take(WArena& a) {
  std::lock_guard<std::mutex> lk(mu);
  if (free.empty()) return;
  auto big = std::max_element(free.begin(), free.end(),
                              [](const Tensor& x, const Tensor& y) { return x.numel() < y.numel(); });
  a.buf = std::move(*big);
  free.erase(big);
}

void WArenaPool::give(WArena& a) {
  a.tasks.clear(), a.used = 0, a.next = 0;
  if (!a.buf.defined()) return;
  std::lock_guard<std::mutex> lk(mu);
  free.push_back(std::move(a.buf));
  a.buf = Tensor();
}

void Model::Impl::run_wtask(const WArena& a, const WTask& t) {
  const char* base = static_cast<const char*>(a.buf.raw());  // read now: recording may have grown the arena
  const void* x = base + t.x;
  const void* dy = base + t.dy;
  if (t.kind == WTask::Lin) lin_wgrad(t.param, x, dy, t.rows, t.in, t.out);
  else if (t.kind == WTask::LinF32)
    lin_wgrad_f32(t.param, static_cast<const float*>(x), static_cast<const float*>(dy), t.rows, t.in, t.out);
  else gg_wgrad(t.param, x, dy, reinterpret_cast<const int32_t*>(base + t.kept), t.rows, t.in, t.out);
}

// Bitwise the plain run: a parameter's weight gradient of this micro-batch is one task, recorded after the input
// gradient that produced its operands; running it earlier changes no accumulation order (the gradient buffer
// takes this micro-batch's term between the previous and the next micro-batch's, as in W). Carried arenas are
// older than this lane's own I half, so they run first; within an arena, tasks run in recording order.
bool Model::Impl::fill_with_wgrad() {
  if (fs_on || !baton) return false;
  WArena* a = nullptr;
  {  // take the turn if no lane computes, and the oldest task not yet run
    std::lock_guard<std::mutex> lk(baton->mu);
    // inside a pair: only when no lane holds the turn; outside one (iwcarry) this lane is the only one running
    if (baton->active && (!baton->free_order || baton->turn >= 0)) return false;
    auto& q = baton->carried;
    while (!q.empty() && q.front()->next >= q.front()->tasks.size()) {  // all run early: the arena is free again
      wpool->give(*q.front());
      q.pop_front();
    }
    if (!q.empty()) a = q.front();
    else if (defer && defer->next < defer->tasks.size()) a = defer;
    if (!a) return false;
    if (baton->active) baton->turn = lane_id;
  }
  const double t0 = EpExposure::now();
  busy_open();
  WArena* const mine = defer;
  defer = nullptr;  // run, not record (no trace scope: it runs inside the exchange's scope)
  run_wtask(*a, a->tasks[a->next]);
  ++a->next;
  defer = mine;
  busy_close();
  {
    std::lock_guard<std::mutex> lk(baton->mu);
    ++baton->filled, baton->filled_seconds += EpExposure::now() - t0;
  }
  baton->pass(lane_id);
  return true;
}

void Model::Impl::carry(WArena& a) {
  if (a.tasks.empty()) return;
  std::lock_guard<std::mutex> lk(baton->mu);
  baton->carried.push_back(&a);
}

// Runs the carried weight halves, oldest first: all of them, or (upto) those up to and including upto when it is
// carried (else none). The caller holds the turn or runs outside a pair, so no fill reads the queue meanwhile.
void Model::Impl::flush_carried(const WArena* upto) {
  if (!baton || baton->carried.empty()) return;
  auto& q = baton->carried;
  if (upto && std::find(q.begin(), q.end(), upto) == q.end()) return;
  while (!q.empty()) {
    WArena* a = q.front();
    q.pop_front();
    replay_wgrads(*a);
    if (a == upto) break;
  }
}

// ---------------------------------------------------------------------------------------------------
// lanes

namespace {
thread_local int t_lane = 0;
}

void Model::set_thread_lane(int lane) {
  MT_CHECK(lane == 0 || lane == 1, "Model::set_thread_lane", "lane ", lane, " (0 or 1)");
  t_lane = lane;
}

Model::Impl& Model::lane() {
  if (t_lane == 0) return *impl_;
  MT_CHECK(lane1_ != nullptr, "Model", "this thread runs on lane 1, but the model has one lane (ModelParallel::ep_overlap)");
  return *lane1_;
}

std::unique_ptr<Model::Impl> Model::Impl::make_lane() const {
  auto p = std::make_unique<Impl>(m);
  Impl& o = *p;
  o.N = N, o.d = d, o.V = V, o.Vl = Vl, o.H = H, o.Hkv = Hkv, o.hd = hd, o.Dqk = Dqk, o.Dv = Dv, o.dn = dn, o.dr = dr;
  o.rq = rq, o.rkv = rkv, o.Wqkv = Wqkv, o.F = F, o.E = E, o.K = K, o.Fe = Fe, o.Fs = Fs, o.Rmax = Rmax;
  o.El = El, o.e0 = e0, o.ep = ep, o.par = par, o.ep_comm = ep_comm;
  o.Nr = Nr, o.tp = tp, o.tp_rank = tp_rank, o.tp_comm = tp_comm;
  o.cp = cp, o.cp_rank = cp_rank, o.cp_comm = cp_comm;
  o.layers = layers;  // handles: the slots' saved activations, dispatchers and packed weights are shared
  o.stages = stages;
  o.whole = whole, o.has_emb = has_emb, o.has_head = has_head, o.n_moe_total = n_moe_total;
  o.tied_hg = tied_hg, o.step_ce_scale = step_ce_scale, o.step_aux_scale = step_aux_scale;
  o.wc = wc, o.rope_cos = rope_cos, o.rope_sin = rope_sin;
  o.emb = emb, o.head = head, o.final_norm = final_norm, o.rcfg = rcfg, o.f32 = f32, o.ws_bytes = ws_bytes;
  o.attn16 = attn16;
  o.alloc_scratch();
  o.Dm = Dm, o.mtp = mtp, o.mtp_home = const_cast<Impl*>(this);  // MTP: lane 0's per-slot buffers, its own scratch
  o.mtp_scratch();
  o.baton = baton;
  o.exposure = exposure;
  o.wpool = wpool;
  o.lane_id = 1;
  return p;
}

void Model::Impl::sync_lane_from(const Impl& o) {
  for (size_t l = 0; l < layers.size(); ++l) {
    Layer& L = layers[l];
    const Layer& S = o.layers[l];
    L.pk13f = S.pk13f, L.pk13d = S.pk13d, L.pk2f = S.pk2f, L.pk2d = S.pk2d;
  }
  step_ce_scale = o.step_ce_scale, step_aux_scale = o.step_aux_scale;
}

Model::Impl::Baton::Baton(bool free, bool paced) : free_order(free), paced_link(paced) {
  MT_CHECK(!paced_link || !free_order, "model",
           "parallelism.ep_link = \"paced\" needs parallelism.ep_baton = \"turn\" (under the free order the EP ranks "
           "could start their lanes' exchanges in different orders and wait on each other's links)");
}
void Model::Impl::Baton::begin_pair() {
  std::lock_guard<std::mutex> lk(mu);
  active = true, turn = free_order ? -1 : 0, done[0] = done[1] = false, next_ticket = serving = 0;
}
void Model::Impl::Baton::link_acquire(int lane) {
  if (!paced_link) return;
  std::unique_lock<std::mutex> lk(mu);
  cv.wait(lk, [&] { return !active || serving == ticket[lane]; });
}
void Model::Impl::Baton::link_release(int lane) {
  if (!paced_link) return;
  std::lock_guard<std::mutex> lk(mu);
  if (active && serving == ticket[lane]) ++serving;
  cv.notify_all();
}
void Model::Impl::Baton::end_pair() {
  std::lock_guard<std::mutex> lk(mu);
  active = false;
}
void Model::Impl::Baton::acquire(int lane) {
  std::unique_lock<std::mutex> lk(mu);
  if (free_order) {
    cv.wait(lk, [&] { return !active || turn < 0 || turn == lane; });
    if (active) turn = lane;
    return;
  }
  cv.wait(lk, [&] { return !active || turn == lane || done[1 - lane]; });
}
void Model::Impl::Baton::pass(int lane) {
  std::lock_guard<std::mutex> lk(mu);
  // Paced: the ticket is taken here, while this lane holds the turn (or the other lane's half has ended).
  if (active && paced_link) ticket[lane] = next_ticket++;
  if (active && turn == lane) turn = free_order ? -1 : 1 - lane;
  cv.notify_all();
}
void Model::Impl::Baton::finish(int lane) {
  std::lock_guard<std::mutex> lk(mu);
  if (active) done[lane] = true, turn = free_order ? (turn == lane ? -1 : turn) : 1 - lane;
  cv.notify_all();
}

bool Model::ep_wgrad_fill_possible() const { return impl_->baton && impl_->baton->free_order && !impl_->fp8; }

void Model::set_ep_wgrad_fill(bool on, bool carry) {
  const char* mode = carry ? "parallelism.ep_pair_backward = iwcarry" : "parallelism.ep_pair_backward = iwfill";
  MT_CHECK(!carry || on, "Model::set_ep_wgrad_fill", "carrying the weight halves needs the fill");
  MT_CHECK(!on || impl_->baton, "Model::set_ep_wgrad_fill", "needs parallelism.ep_overlap = true");
  MT_CHECK(!on || impl_->baton->free_order, "Model::set_ep_wgrad_fill", mode,
           " needs the free lane order (parallelism.ep_baton = \"free\", the default): it takes the turn whenever no "
           "lane computes");
  MT_CHECK(!on || !impl_->fp8, "Model::set_ep_wgrad_fill", mode,
           " is not implemented with [quantize] (the FP8 weight gradients use the lane's operand buffers)");
  if (impl_->baton) impl_->baton->fill_w = on, impl_->baton->carry_w = carry;
}

void Model::begin_overlap_pair() {  // what was recorded before belongs to actions that ran alone
  if (impl_->exposure) impl_->exposure->fold();
  if (impl_->baton) impl_->baton->begin_pair();
}
void Model::end_overlap_pair() {  // both halves have returned: no span is open on either lane
  if (impl_->baton) impl_->baton->end_pair();
  if (impl_->exposure) impl_->exposure->fold(true);
}

// ---------------------------------------------------------------------------------------------------
// the public stage API

int Model::n_stages() const { return int(impl_->stages.size()); }
const ModelStagePart& Model::stage_part(int local) const {
  MT_CHECK(local >= 0 && local < n_stages(), "Model::stage_part", "local stage ", local, " outside [0, ",
           n_stages(), ")");
  return impl_->stages[size_t(local)].part;
}
bool Model::holds_embedding() const { return impl_->has_emb; }
bool Model::holds_head() const { return impl_->has_head; }
bool Model::holds_layer(int64_t l) const {
  return l >= 0 && l < int64_t(impl_->layers.size()) && impl_->layers[size_t(l)].held;
}

void Model::set_loss_scales(float ce_scale, float aux_scale) {
  auto& I = *impl_;
  I.step_ce_scale = ce_scale, I.step_aux_scale = aux_scale;
  if (lane1_) lane1_->step_ce_scale = ce_scale, lane1_->step_aux_scale = aux_scale;
  if (I.fs_on) {  // a step that threw may have left units held
    for (auto& sl : I.fs_slots) sl.unit = -1;
    std::fill(I.fs_slot_of.begin(), I.fs_slot_of.end(), -1);
  }
  if (I.baton)  // a step that threw may have left weight halves carried: dropped with it
    for (WArena* a : std::exchange(I.baton->carried, {})) I.wpool->give(*a);
}

float* Model::tied_head_grad() {
  return impl_->tied_hg.defined() && !impl_->fs_on ? impl_->tied_hg.data<float>() : nullptr;
}

void Model::fold_tied_head_grad() {
  auto& I = *impl_;
  if (!I.tied_hg.defined() || !I.has_emb || I.fs_on) return;  // FSDP folds per micro-batch (embed_backward)
  model_detail::add_inplace(I.G(I.emb), I.tied_hg.data<float>(), I.Vl * I.d);  // TP: this rank's vocabulary rows
  I.tied_hg.zero_();
}

ForwardStats Model::stage_forward(int local, int slot, const int32_t* tokens, const int32_t* targets,
                                  const float* in, float* out, bool backward) {
  auto& I = lane();
  Impl::StageTurn turn(I);
  StageRt& st = I.stage_rt(local, "Model::stage_forward");
  const ModelStagePart& p = st.part;
  MT_CHECK(p.embedding ? tokens != nullptr : in != nullptr, "Model::stage_forward", "stage ", p.stage,
           p.embedding ? " embeds tokens: tokens must not be null" : " needs its input activation");
  MT_CHECK(p.head ? targets != nullptr : out != nullptr, "Model::stage_forward", "stage ", p.stage,
           p.head ? " computes the loss: targets must not be null" : " needs an output buffer");
  I.use_slot(st, slot);
  I.begin_pass();
  // The residual stream: the output buffer itself, or on the head stage the scratch x.
  float* xr = p.head ? I.x.data<float>() : out;
  if (p.embedding) {
    for (int64_t t = 0; t < B_ * seq_len_; ++t)
      MT_CHECK(tokens[t] >= 0 && tokens[t] < I.V, "Model::forward", "token ", tokens[t], " at position ", t,
               " outside the vocabulary [0, ", I.V, ")");
    I.embed_forward(I.cp_rows(I.cp_tok, tokens), xr, backward && p.head);
  } else {
    std::memcpy(xr, in, size_t(I.Nr * I.d) * 4);
  }
  for (int64_t l : p.layers) I.forward_layer(l, xr);
  ForwardStats fs;
  if (p.head) {
    I.head_loss(xr, I.cp_rows(I.cp_tgt, targets), backward, I.step_ce_scale, st.head_g[size_t(slot)].data<float>(), fs);
    if (I.Dm > 0) I.mtp_forward(slot, xr, targets, backward, I.step_ce_scale, fs);
  }
  I.end_pass(fs);
  return fs;
}

void Model::stage_backward(int local, int slot, const int32_t* tokens, const float* dout, float* din,
                           bool weights) {
  auto& I = lane();
  Impl::StageTurn turn(I);
  StageRt& st = I.stage_rt(local, "Model::stage_backward");
  const ModelStagePart& p = st.part;
  MT_CHECK(p.head || dout != nullptr, "Model::stage_backward", "stage ", p.stage, " needs dL/d(output)");
  MT_CHECK(p.embedding ? tokens != nullptr : din != nullptr, "Model::stage_backward", "stage ", p.stage,
           p.embedding ? " adds the embedding gradient: tokens must not be null" : " needs an input-gradient buffer");
  I.use_slot(st, slot);
  I.cur_aux_scale = I.step_aux_scale;
  float* g = p.head ? st.head_g[size_t(slot)].data<float>() : I.dx.data<float>();
  if (!p.head) std::memcpy(g, dout, size_t(I.Nr * I.d) * 4);
  WArena& a = st.warena[size_t(slot)];
  // iwcarry: every backward records its weight gradients and carries them (below and in stage_backward_weight);
  // reusing a slot whose weight half is still carried runs the carried ones up to it first
  const bool carry = I.baton && I.baton->carry_w;
  if (carry) I.flush_carried(&a);
  MT_CHECK(a.tasks.empty(), "Model::stage_backward", "stage ", p.stage, " slot ", slot,
           " still holds the weight gradients of an earlier I half (run its W first)");
  if (!weights || carry) I.defer = &a;
  struct Undefer {
    Impl& i;
    ~Undefer() { i.defer = nullptr; }
  } undefer{I};
  if (p.head && I.Dm > 0) I.mtp_backward(slot, g);  // the MTP depths, last first; their dL/dh0 joins g
  for (auto it = p.layers.rbegin(); it != p.layers.rend(); ++it) I.backward_layer(*it, g);
  if (p.embedding) I.embed_backward(I.cp_rows(I.cp_tok, tokens), g);
  else std::memcpy(din, g, size_t(I.Nr * I.d) * 4);
  if (carry && weights) I.carry(a);  // a whole backward (run alone): its weight half waits for exchange waits too
}

void Model::stage_backward_weight(int local, int slot) {
  auto& I = lane();
  Impl::StageTurn turn(I);
  StageRt& st = I.stage_rt(local, "Model::stage_backward_weight");
  MT_CHECK(slot >= 0 && slot < st.part.slots, "Model::stage_backward_weight", "slot ", slot, " outside [0, ",
           st.part.slots, ")");
  MT_TRACE("bwd.weight");
  WArena& a = st.warena[size_t(slot)];
  if (I.baton && I.baton->carry_w) return I.carry(a);  // run by later exchange waits, a slot's reuse or the step's end
  I.replay_wgrads(a);
}

void Model::flush_carried_wgrads() {
  if (!impl_->baton || !impl_->baton->carry_w || impl_->baton->carried.empty()) return;
  MT_TRACE("bwd.weight");
  impl_->flush_carried();
}

}  // namespace moetron
