// pipeline_runtime.cpp: PipelineRuntime (pipeline_runtime.h): the set-up checks (collective), the buffer plan
// computed once from the lowered schedule, and the step loop that executes one rank's action list. Not the
// schedule IR (src/schedule/) and not a model stage.
//
// The plan. Walking this rank's lowered list once, every compute half gets its activation slot and the
// buffers it reads and writes, and every SEND / RECV the buffer it moves:
//   F(s, m)    slot: the lowest free slot of stage s (freed by B(s, m), or W(s, m) with split backward);
//              in: the buffer its RECV_F filled, or that F(s-1, m) on this rank wrote (none on stage 0);
//              out: a buffer of stage s+1's input pool when s+1 is on this rank, else of s's send pool.
//   B/I(s, m)  dout: from s's gradient-in pool (RECV_B or B/I(s+1, m) here; none on the last stage);
//              din: s-1's gradient-in pool when s-1 is here, else s's gradient send pool (none on stage 0).
// Input buffers are freed after the half that reads them. A send buffer is freed in the plan at the first
// RECV from the same peer that the peer sent after its RECV of that buffer's message (so the peer has
// received it: the send is complete); the step waits for its request only when it reuses the buffer, which
// then returns at once. The pools are as large as the plan's peak use; one block holds them all.
#include "comm/pipeline_runtime.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <string>

#include "moetron/check.h"
#include "moetron/memory.h"

namespace moetron::pipeline {

void PipelineStage::backward_input(int, int, const float*, float*) {
  MT_FAIL("pipeline", "backward_input called on a stage that does not implement the split backward (I/W)");
}
void PipelineStage::backward_weight(int, int) {
  MT_FAIL("pipeline", "backward_weight called on a stage that does not implement the split backward (I/W)");
}

namespace {

using sched::Action;
using sched::Op;

constexpr int64_t kHeaderFloats = 16;  // 64 bytes in front of every buffer (keeps the payload 64-byte aligned)
constexpr uint32_t kMagic = 0x4d545050u;

struct Header {
  uint32_t magic;
  int32_t fwd;    // 1: activation, 0: input gradient
  int32_t stage;  // producer stage
  int32_t mb;
  int64_t floats;
  int64_t step;
};
static_assert(sizeof(Header) <= size_t(kHeaderFloats) * 4);

enum Kind : int { kActIn = 0, kGradIn = 1, kActOut = 2, kGradOut = 3 };

struct BufRef {
  int pool = -1;  // local * 4 + kind
  int buf = -1;
  bool valid() const { return pool >= 0; }
};

struct Half {
  Op op = Op::F;
  int local = 0, stage = 0, mb = 0, slot = 0;
  BufRef in, out;
};

struct Instr {
  Action a;
  int nh = 0;
  Half h[2];
  // SEND / RECV
  BufRef buf;
  int peer = -1;
  bool fwd = true;
  int prod_stage = 0, mb = 0;
  int64_t floats = 0;
};

struct Pool {
  int64_t floats = 0;  // payload per buffer
  int64_t stride = 0;  // header + payload rounded up to 16 floats
  int count = 0;
  int64_t offset = 0;  // into the block, in floats
  int first_req = 0;   // send pools: index of buffer 0's request
};

// Lowest-free allocation, used only while planning.
struct FreeList {
  std::vector<char> used;
  int peak = 0;
  int alloc() {
    size_t i = 0;
    while (i < used.size() && used[i]) ++i;
    if (i == used.size()) used.push_back(0);
    used[i] = 1;
    peak = std::max(peak, int(i) + 1);
    return int(i);
  }
  void release(int i) { used[size_t(i)] = 0; }
};

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

struct PipelineRuntime::Impl {
  sched::Schedule s;
  Comm comm;
  RuntimeOptions opt;
  int me = 0;
  int S = 1, M = 1;
  std::vector<PipelineStage*> stages;  // local index
  std::vector<int> ids;                // local index -> stage
  std::vector<int> local_of;           // stage -> local index or -1
  std::vector<int64_t> in_size, out_size;  // [S], gathered from every rank
  std::vector<int> slots;                  // local index -> slot count
  int rank_peak = 0;
  std::vector<Instr> prog;
  std::vector<Pool> pools;  // [local * 4 + kind]
  float* block = nullptr;
  size_t block_bytes = 0;
  std::vector<CommRequest> reqs;     // one per send buffer
  std::vector<CommRequest> scratch;  // end-of-step wait_all
  int64_t step = 0;
  double t_step = 0;

  ~Impl() { mt_free(block, block_bytes, MemCategory::Comm); }

  float* header(const BufRef& b) {
    const Pool& p = pools[size_t(b.pool)];
    return block + p.offset + int64_t(b.buf) * p.stride;
  }
  float* data(const BufRef& b) { return b.valid() ? header(b) + kHeaderFloats : nullptr; }
  CommRequest* req(const BufRef& b) {
    const int k = b.pool % 4;
    if (k != kActOut && k != kGradOut) return nullptr;
    return &reqs[size_t(pools[size_t(b.pool)].first_req + b.buf)];
  }

  void check_and_gather(std::vector<PipelineStage*> st);
  void plan();
  void allocate();
};

// ---------------------------------------------------------------------------------------------------------
// Set-up checks. The schedule-wide ones are the same on every rank (so every rank throws alike, before any
// collective); the per-rank ones are agreed through two all_gathers so that no rank is left waiting.

void PipelineRuntime::Impl::check_and_gather(std::vector<PipelineStage*> st) {
  const char* op = "pipeline";
  // Per-rank checks: an error here is reported after the first all_gather.
  std::string err;
  auto fail = [&](auto&&... a) {
    if (!err.empty()) return;
    std::ostringstream os;
    os << "rank " << me << ": ";
    (os << ... << a);
    err = os.str();
  };
  for (int q = 0; q < S; ++q)
    if (s.stage_rank[size_t(q)] == me) ids.push_back(q);
  local_of.assign(size_t(S), -1);
  for (size_t l = 0; l < ids.size(); ++l) local_of[size_t(ids[l])] = int(l);
  if (st.size() != ids.size()) {
    std::string list;
    for (int q : ids) list += (list.empty() ? "" : ", ") + std::to_string(q);
    fail("schedule '", s.name, "' places ", ids.size(), " stage(s) on this rank (", list, ") but ", st.size(),
         " PipelineStage object(s) were given");
  }
  std::vector<int64_t> sizes(size_t(2 * S), -1);
  for (size_t l = 0; l < st.size() && l < ids.size() && err.empty(); ++l) {
    const int q = ids[l];
    if (!st[l]) {
      fail("stage ", q, ": null PipelineStage");
      break;
    }
    const int64_t in = st[l]->in_size(), out = st[l]->out_size();
    if (q == 0 && in != 0)
      fail("stage 0 is the first stage: in_size must be 0 (it fetches its own input), got ", in);
    else if (q > 0 && in <= 0)
      fail("stage ", q, ": in_size = ", in, " must be > 0 (it receives stage ", q - 1, "'s activation)");
    else if (q == S - 1 && out != 0)
      fail("stage ", q, " is the last stage: out_size must be 0 (it computes the loss), got ", out);
    else if (q < S - 1 && out <= 0)
      fail("stage ", q, ": out_size = ", out, " must be > 0 (it feeds stage ", q + 1, ")");
    sizes[size_t(2 * q)] = in;
    sizes[size_t(2 * q + 1)] = out;
    bool split = false;
    for (const Action& a : s.actions[size_t(me)]) {
      const Action b = sched::bwd_half(a);
      if ((b.op == Op::I || b.op == Op::W) && b.stage == q) split = true;
    }
    if (split && !st[l]->supports_split_backward())
      fail("stage ", q, ": schedule '", s.name,
           "' splits the backward into I and W, but the stage does not implement backward_input / backward_weight");
  }
  stages = std::move(st);

  // Round 1: who failed, and is everyone running the same schedule?
  const int p = comm.size();
  int64_t mine[4] = {err.empty() ? 1 : 0, int64_t(fnv1a(sched::to_csv(s)) >> 1), S, M};
  std::vector<int64_t> all(size_t(4 * p));
  comm.all_gather(all.data(), mine, sizeof mine);
  if (!err.empty()) MT_FAIL(op, err);
  for (int q = 0; q < p; ++q)
    MT_CHECK(all[size_t(4 * q)] == 1, op, "rank ", me, ": set-up failed on rank ", q, " (see that rank's error)");
  for (int q = 1; q < p; ++q)
    MT_CHECK(all[size_t(4 * q + 1)] == all[1] && all[size_t(4 * q + 2)] == all[2] && all[size_t(4 * q + 3)] == all[3],
             op, "rank ", me, ": rank ", q, " runs a different schedule than rank 0 (", all[size_t(4 * q + 2)],
             " stages, ", all[size_t(4 * q + 3)], " micro-batches vs ", all[2], ", ", all[3],
             "); every rank must be given the same schedule");

  // Round 2: every stage's sizes, from its owner.
  std::vector<int64_t> gathered(size_t(2 * S) * size_t(p));
  comm.all_gather(gathered.data(), sizes.data(), int64_t(sizes.size() * 8));
  in_size.assign(size_t(S), 0);
  out_size.assign(size_t(S), 0);
  for (int q = 0; q < S; ++q) {
    const int r = s.stage_rank[size_t(q)];
    in_size[size_t(q)] = gathered[size_t(r) * size_t(2 * S) + size_t(2 * q)];
    out_size[size_t(q)] = gathered[size_t(r) * size_t(2 * S) + size_t(2 * q + 1)];
  }
  for (int q = 0; q + 1 < S; ++q)
    MT_CHECK(out_size[size_t(q)] == in_size[size_t(q + 1)], op, "stage output size mismatch: stage ", q, " (rank ",
             s.stage_rank[size_t(q)], ") produces ", out_size[size_t(q)], " floats per micro-batch but stage ", q + 1,
             " (rank ", s.stage_rank[size_t(q + 1)], ") takes ", in_size[size_t(q + 1)]);
}

// ---------------------------------------------------------------------------------------------------------
// The plan (see the file comment).

void PipelineRuntime::Impl::plan() {
  const char* op = "pipeline";
  const size_t L = ids.size();
  auto cell = [&](bool fwd, int prod, int mb) { return (size_t(prod) * size_t(M) + size_t(mb)) * 2 + (fwd ? 1 : 0); };
  const size_t n_cells = size_t(S) * size_t(M) * 2;

  // Every message's SEND and RECV position in its rank's list.
  std::vector<int> send_idx(n_cells, -1), recv_idx(n_cells, -1);
  for (int r = 0; r < s.pp; ++r) {
    const auto& row = s.actions[size_t(r)];
    for (size_t k = 0; k < row.size(); ++k) {
      const Action& a = row[k];
      switch (a.op) {
        case Op::SEND_F: send_idx[cell(true, a.stage, a.mb)] = int(k); break;
        case Op::SEND_B: send_idx[cell(false, a.stage, a.mb)] = int(k); break;
        case Op::RECV_F: recv_idx[cell(true, a.stage - 1, a.mb)] = int(k); break;
        case Op::RECV_B: recv_idx[cell(false, a.stage + 1, a.mb)] = int(k); break;
        default: break;
      }
    }
  }

  std::vector<FreeList> slot_fl(L), buf_fl(L * 4);
  std::vector<int> slot_of(size_t(S) * size_t(M), -1);
  std::vector<BufRef> msg_buf(n_cells);   // a message's buffer from its producer (or RECV) to its consumer
  std::vector<BufRef> sent_buf(n_cells);  // a sent message's buffer until the send is known complete
  std::vector<std::vector<size_t>> chan(size_t(s.pp));  // messages this rank sent to each peer, in order
  std::vector<size_t> chan_done(size_t(s.pp), 0);      // how many of them are known complete
  auto alloc = [&](int local, int kind) {
    const int pool = local * 4 + kind;
    return BufRef{pool, buf_fl[size_t(pool)].alloc()};
  };
  auto release = [&](const BufRef& b) { buf_fl[size_t(b.pool)].release(b.buf); };
  auto need = [&](size_t c, const Action& a) -> BufRef {
    MT_CHECK(msg_buf[c].valid(), op, "internal error: no buffer for the input of '", sched::to_string(a), "'");
    const BufRef b = msg_buf[c];
    msg_buf[c] = BufRef{};
    return b;
  };

  int live = 0;
  const auto& row = s.actions[size_t(me)];
  prog.resize(row.size());
  for (size_t k = 0; k < row.size(); ++k) {
    const Action& a = row[k];
    Instr& in = prog[k];
    in.a = a;
    if (sched::is_compute(a.op)) {
      in.nh = a.op == Op::FB ? 2 : 1;
      const Action hs[2] = {sched::fwd_half(a), sched::bwd_half(a)};
      std::vector<BufRef> to_free;
      for (int q = 0; q < in.nh; ++q) {
        const Action& x = hs[q];
        Half& h = in.h[q];
        h.op = x.op;
        h.stage = x.stage;
        h.mb = x.mb;
        h.local = local_of[size_t(x.stage)];
        MT_CHECK(h.local >= 0, op, "internal error: '", sched::to_string(x), "' is not on rank ", me);
        const size_t sm = size_t(x.stage) * size_t(M) + size_t(x.mb);
        if (x.op == Op::F) {
          h.slot = slot_fl[size_t(h.local)].alloc();
          slot_of[sm] = h.slot;
          rank_peak = std::max(rank_peak, ++live);
          if (x.stage > 0) h.in = need(cell(true, x.stage - 1, x.mb), x);
          if (x.stage < S - 1) {
            const int nxt = local_of[size_t(x.stage + 1)];
            h.out = nxt >= 0 ? alloc(nxt, kActIn) : alloc(h.local, kActOut);
            msg_buf[cell(true, x.stage, x.mb)] = h.out;
          }
        } else {
          h.slot = slot_of[sm];
          MT_CHECK(h.slot >= 0, op, "internal error: no slot for '", sched::to_string(x), "'");
          if (x.op != Op::W) {
            if (x.stage < S - 1) h.in = need(cell(false, x.stage + 1, x.mb), x);
            if (x.stage > 0) {
              const int prv = local_of[size_t(x.stage - 1)];
              h.out = prv >= 0 ? alloc(prv, kGradIn) : alloc(h.local, kGradOut);
              msg_buf[cell(false, x.stage, x.mb)] = h.out;
            }
          }
        }
        if (h.in.valid()) to_free.push_back(h.in);
      }
      // Slots freed after both halves (an FB's forward and backward are live together); inputs likewise.
      for (int q = 0; q < in.nh; ++q) {
        const Half& h = in.h[q];
        if (h.op == Op::B || h.op == Op::W) {
          slot_fl[size_t(h.local)].release(h.slot);
          slot_of[size_t(h.stage) * size_t(M) + size_t(h.mb)] = -1;
          --live;
        }
      }
      for (const BufRef& b : to_free) release(b);
      continue;
    }
    // Communication.
    const bool send = a.op == Op::SEND_F || a.op == Op::SEND_B;
    in.fwd = a.op == Op::SEND_F || a.op == Op::RECV_F;
    in.prod_stage = send ? a.stage : (in.fwd ? a.stage - 1 : a.stage + 1);
    in.mb = a.mb;
    const int cons = in.fwd ? in.prod_stage + 1 : in.prod_stage - 1;
    // An activation has out_size(producer) floats, a gradient in_size(producer).
    in.floats = in.fwd ? out_size[size_t(in.prod_stage)] : in_size[size_t(in.prod_stage)];
    const size_t c = cell(in.fwd, in.prod_stage, in.mb);
    if (send) {
      in.peer = s.stage_rank[size_t(cons)];
      in.buf = msg_buf[c];
      MT_CHECK(in.buf.valid(), op, "internal error: '", sched::to_string(a), "' before its producer");
      msg_buf[c] = BufRef{};
      sent_buf[c] = in.buf;
      chan[size_t(in.peer)].push_back(c);
    } else {
      in.peer = s.stage_rank[size_t(in.prod_stage)];
      const int local = local_of[size_t(cons)];
      in.buf = alloc(local, in.fwd ? kActIn : kGradIn);
      msg_buf[c] = in.buf;
      // Sends to the peer that it received before sending this message are complete: their buffers are free.
      auto& ch = chan[size_t(in.peer)];
      size_t& done = chan_done[size_t(in.peer)];
      while (done < ch.size() && recv_idx[ch[done]] < send_idx[c]) release(sent_buf[ch[done++]]);
    }
  }
  for (size_t l = 0; l < L; ++l) slots.push_back(slot_fl[l].peak);
  pools.resize(L * 4);
  for (size_t l = 0; l < L; ++l) {
    const int q = ids[l];
    const int64_t fl[4] = {in_size[size_t(q)], q < S - 1 ? out_size[size_t(q)] : 0, out_size[size_t(q)],
                           in_size[size_t(q)]};
    for (int kk = 0; kk < 4; ++kk) {
      Pool& p = pools[l * 4 + size_t(kk)];
      p.count = buf_fl[l * 4 + size_t(kk)].peak;
      p.floats = fl[kk];
      p.stride = kHeaderFloats + (fl[kk] + 15) / 16 * 16;
    }
  }
}

void PipelineRuntime::Impl::allocate() {
  int64_t total = 0;
  int n_req = 0;
  for (size_t i = 0; i < pools.size(); ++i) {
    Pool& p = pools[i];
    p.offset = total;
    total += p.stride * p.count;
    if (int(i % 4) == kActOut || int(i % 4) == kGradOut) {
      p.first_req = n_req;
      n_req += p.count;
    }
  }
  block_bytes = size_t(total) * 4;
  if (block_bytes > 0) {
    block = static_cast<float*>(mt_alloc(block_bytes, MemCategory::Comm));
    std::memset(block, 0, block_bytes);
  }
  reqs.resize(size_t(n_req));
  scratch.reserve(size_t(n_req));
}

// ---------------------------------------------------------------------------------------------------------

PipelineRuntime::PipelineRuntime(const sched::Schedule& schedule, std::vector<PipelineStage*> stages, Comm pp,
                                 RuntimeOptions opt)
    : p_(std::make_unique<Impl>()) {
  const char* op = "pipeline";
  Impl& m = *p_;
  m.comm = std::move(pp);
  m.opt = opt;
  MT_CHECK(opt.tag >= 0 && opt.tag <= kCommMaxUserTag, op, "RuntimeOptions::tag = ", opt.tag, " outside [0, ",
           kCommMaxUserTag, "]");
  MT_CHECK(schedule.pp == m.comm.size(), op, "schedule '", schedule.name, "' is for pp = ", schedule.pp,
           " ranks but the pipeline communicator has ", m.comm.size(), " rank(s)");
  if (schedule.lowered) {
    sched::check_valid(schedule);
    m.s = schedule;
  } else {
    m.s = sched::lower(schedule);  // validates
  }
  m.me = m.comm.rank();
  m.S = m.s.n_stages;
  m.M = m.s.n_microbatches;
  m.check_and_gather(std::move(stages));
  m.plan();
  m.allocate();
  for (size_t l = 0; l < m.ids.size(); ++l) {
    StageSetup st;
    st.stage = m.ids[l];
    st.n_stages = m.S;
    st.n_microbatches = m.M;
    st.rank = m.me;
    st.slots = m.slots[l];
    for (const Instr& in : m.prog)
      for (int q = 0; q < in.nh; ++q) {
        const Half& h = in.h[q];
        if (h.stage != st.stage) continue;
        if (h.op == Op::I) st.split_backward = true;
        if (h.op == Op::B || h.op == Op::W) st.weight_grad_order.push_back(h.mb);
      }
    for (size_t i = 0; i < st.weight_grad_order.size(); ++i)
      if (st.weight_grad_order[i] != int(i)) st.weight_grads_in_mb_order = false;
    m.stages[l]->setup(st);
  }
}

PipelineRuntime::~PipelineRuntime() = default;

const sched::Schedule& PipelineRuntime::schedule() const { return p_->s; }
int PipelineRuntime::rank() const { return p_->me; }
const std::vector<int>& PipelineRuntime::stage_ids() const { return p_->ids; }
int PipelineRuntime::peak_inflight() const { return p_->rank_peak; }
int64_t PipelineRuntime::buffer_bytes() const { return int64_t(p_->block_bytes); }
double PipelineRuntime::step_start() const { return p_->t_step; }
void PipelineRuntime::set_fb_backward_split(bool on) { p_->opt.fb_backward_split = on; }
int PipelineRuntime::stage_slots(int stage) const {
  MT_CHECK(stage >= 0 && stage < p_->S && p_->local_of[size_t(stage)] >= 0, "pipeline", "stage_slots: stage ", stage,
           " is not on rank ", p_->me);
  return p_->slots[size_t(p_->local_of[size_t(stage)])];
}

StepStats PipelineRuntime::run_step(std::vector<sched::TimedOp>* record) {
  const char* op = "pipeline";
  Impl& m = *p_;
  StepStats st;
  ++m.step;
  if (record) {
    record->clear();
    record->reserve(m.prog.size());
  }
  m.t_step = now_s();
  for (size_t k = 0; k < m.prog.size(); ++k) {
    Instr& in = m.prog[k];
    // Reusing a send buffer: its earlier send is known complete (the plan), so this returns at once.
    for (int q = 0; q < in.nh; ++q) {
      CommRequest* r = in.h[q].out.valid() ? m.req(in.h[q].out) : nullptr;
      if (r && r->pending()) {
        const double t0 = now_s();
        m.comm.wait(*r);
        st.send_wait_seconds += now_s() - t0;
      }
    }
    const double t0 = now_s();
    switch (in.a.op) {
      case Op::F:
      case Op::B:
      case Op::I:
      case Op::W:
      case Op::FB: {
        auto run_half = [&](int q) {
          const Half& h = in.h[q];
          PipelineStage& stg = *m.stages[size_t(h.local)];
          switch (h.op) {
            case Op::F: stg.forward(h.mb, h.slot, m.data(h.in), m.data(h.out)); break;
            case Op::B:
              if (in.nh == 2 && m.opt.fb_backward_split && stg.supports_split_backward()) {
                stg.backward_input(h.mb, h.slot, m.data(h.in), m.data(h.out));
                stg.backward_weight(h.mb, h.slot);
              } else {
                stg.backward(h.mb, h.slot, m.data(h.in), m.data(h.out));
              }
              break;
            case Op::I: stg.backward_input(h.mb, h.slot, m.data(h.in), m.data(h.out)); break;
            case Op::W: stg.backward_weight(h.mb, h.slot); break;
            default: MT_FAIL(op, "internal error: compute half '", sched::to_string(in.a), "'");
          }
        };
        if (in.nh == 2 && m.opt.run_fb) m.opt.run_fb([&] { run_half(0); }, [&] { run_half(1); });
        else
          for (int q = 0; q < in.nh; ++q) run_half(q);
        break;
      }
      case Op::SEND_F:
      case Op::SEND_B: {
        float* hp = m.header(in.buf);
        Header hd{kMagic, in.fwd ? 1 : 0, in.prod_stage, in.mb, in.floats, m.step};
        std::memcpy(hp, &hd, sizeof hd);
        const int64_t bytes = (kHeaderFloats + in.floats) * 4;
        *m.req(in.buf) = m.comm.isend(hp, bytes, in.peer, m.opt.tag);
        st.messages_sent += 1;
        st.bytes_sent += bytes;
        break;
      }
      case Op::RECV_F:
      case Op::RECV_B: {
        float* hp = m.header(in.buf);
        const int64_t bytes = (kHeaderFloats + in.floats) * 4;
        m.comm.recv(hp, bytes, in.peer, m.opt.tag);
        Header hd;
        std::memcpy(&hd, hp, sizeof hd);
        auto what = [](int fwd, int stage, int mb, int64_t floats, int64_t step) {
          return "stage " + std::to_string(stage) + "'s " + (fwd ? "activation" : "gradient") + " of mb " +
                 std::to_string(mb) + " (" + std::to_string(floats) + " floats, step " + std::to_string(step) + ")";
        };
        MT_CHECK(hd.magic == kMagic && hd.fwd == (in.fwd ? 1 : 0) && hd.stage == in.prod_stage && hd.mb == in.mb &&
                     hd.floats == in.floats && hd.step == m.step,
                 op, "rank ", m.me, ", action ", k, " '", sched::to_string(in.a), "': received ",
                 hd.magic == kMagic ? what(hd.fwd, hd.stage, hd.mb, hd.floats, hd.step) : std::string("a foreign message"),
                 " from rank ", in.peer, ", expected ", what(in.fwd, in.prod_stage, in.mb, in.floats, m.step),
                 ": the ranks do not run the same schedule, or other traffic uses tag ", m.opt.tag);
        st.messages_received += 1;
        st.bytes_received += bytes;
        break;
      }
    }
    const double t1 = now_s();
    if (sched::is_compute(in.a.op))
      st.compute_seconds += t1 - t0;
    else if (in.a.op == Op::RECV_F || in.a.op == Op::RECV_B)
      st.recv_seconds += t1 - t0;
    if (record) record->push_back(sched::TimedOp{m.me, int(k), in.a, t0 - m.t_step, t1 - m.t_step});
  }
  // Sends still open.
  m.scratch.clear();
  for (CommRequest& r : m.reqs)
    if (r.pending()) m.scratch.push_back(std::move(r));
  const double t0 = now_s();
  m.comm.wait_all(m.scratch.data(), m.scratch.size());
  const double t1 = now_s();
  st.send_wait_seconds += t1 - t0;
  st.seconds = t1 - m.t_step;
  return st;
}

StepStats run_schedule(const sched::Schedule& schedule, std::vector<PipelineStage*> stages, const Comm& pp,
                       std::vector<sched::TimedOp>* record) {
  PipelineRuntime rt(schedule, std::move(stages), pp);
  return rt.run_step(record);
}

}  // namespace moetron::pipeline
