// comm.cpp: the Comm handle (validation, fixed-order reductions, timing and byte counting) and the
// single-process backend. Not the MPI transport (comm_mpi.cpp).
#include "moetron/comm.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <atomic>
#include <map>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "comm_backend.h"
#include "moetron/check.h"
#include "moetron/memory.h"

namespace moetron {

namespace {
thread_local bool (*t_idle_fn)(void*) = nullptr;
thread_local void* t_idle_ctx = nullptr;
}  // namespace
CommIdleWork::CommIdleWork(bool (*fn)(void*), void* ctx) : prev_fn_(t_idle_fn), prev_ctx_(t_idle_ctx) {
  t_idle_fn = fn, t_idle_ctx = ctx;
}
CommIdleWork::~CommIdleWork() { t_idle_fn = prev_fn_, t_idle_ctx = prev_ctx_; }
bool CommIdleWork::run() { return t_idle_fn && t_idle_fn(t_idle_ctx); }

std::string_view comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::AllReduce: return "all_reduce";
    case CommOp::ReduceScatter: return "reduce_scatter";
    case CommOp::AllGather: return "all_gather";
    case CommOp::AllToAllV: return "all_to_all_v";
    case CommOp::Exchange: return "exchange";
    case CommOp::Send: return "send";
    case CommOp::Recv: return "recv";
    case CommOp::Barrier: return "barrier";
    case CommOp::Split: return "split";
  }
  return "?";
}

size_t reduce_type_size(ReduceType t) {
  switch (t) {
    case ReduceType::F32: return 4;
    case ReduceType::F64: return 8;
    case ReduceType::I32: return 4;
    case ReduceType::I64: return 8;
  }
  return 0;
}

CommOpStats CommStats::total() const {
  CommOpStats t;
  for (const auto& o : op) {
    t.calls += o.calls;
    t.bytes += o.bytes;
    t.wire_bytes += o.wire_bytes;
    t.seconds += o.seconds;
  }
  return t;
}

std::string CommStats::summary() const {
  std::ostringstream os;
  for (int i = 0; i < kNumCommOps; ++i) {
    const auto& o = op[size_t(i)];
    if (o.calls == 0) continue;
    os << comm_op_name(CommOp(i)) << ": calls " << o.calls << " bytes " << o.bytes << " wire " << o.wire_bytes
       << " s " << o.seconds << "\n";
  }
  return os.str();
}

// ---------------------------------------------------------------------------------------------------------
// Single-process backend: size 1, collectives are copies, send/recv to self go through a queue per tag. A
// message first completes the oldest pending irecv of its tag (MPI's matching order), else it is queued.

namespace detail {
namespace {

// The single-process communicator's shared memory: one tracked block, nobody to wait for.
class LocalShared final : public SharedMemory {
 public:
  explicit LocalShared(int64_t bytes) : bytes_((bytes + 63) / 64 * 64) {
    p_ = static_cast<char*>(mt_alloc(size_t(std::max<int64_t>(bytes_, 64)), MemCategory::Comm));
  }
  ~LocalShared() override { mt_free(p_, size_t(std::max<int64_t>(bytes_, 64)), MemCategory::Comm); }
  char* segment(int) const override { return p_; }
  int64_t bytes() const override { return bytes_; }
  void wait_until(const std::function<bool()>& ready) const override {
    MT_CHECK(ready(), "comm.shared_memory", "single-process wait on a condition that does not hold: it would "
             "never be met");
  }

 private:
  int64_t bytes_;
  char* p_ = nullptr;
};

class LocalBackend final : public CommBackend {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view name() const override { return "local"; }
  void all_to_all_v(void* recv, const int64_t* rc, const int64_t* rd, const void* send, const int64_t* sc,
                    const int64_t* sd) override {
    if (sc[0] > 0) std::memmove(static_cast<char*>(recv) + rd[0], static_cast<const char*>(send) + sd[0], size_t(rc[0]));
  }
  void all_gather_v(void* out, const int64_t* counts, const int64_t* displs, const void* in) override {
    if (counts[0] > 0) std::memmove(static_cast<char*>(out) + displs[0], in, size_t(counts[0]));
  }
  void exchange(void* recv, int64_t, const void* send, const int64_t* sc, const int64_t* sd) override {
    if (sc[0] > 0) std::memmove(recv, static_cast<const char*>(send) + sd[0], size_t(sc[0]));
  }
  void send(const void* buf, int64_t bytes, int, int tag) override {
    const char* p = static_cast<const char*>(buf);
    auto posted = posted_.find(tag);
    if (posted != posted_.end() && !posted->second.empty()) {  // completes the oldest pending irecv
      Req& r = reqs_[size_t(posted->second.front())];
      MT_CHECK(r.bytes == bytes, "comm.recv", "message of ", bytes, " bytes, expected ", r.bytes, " (tag ", tag,
               ", posted by irecv)");
      if (bytes > 0) std::memcpy(r.buf, p, size_t(bytes));
      r.done = true;
      posted->second.pop_front();
      return;
    }
    queue_[tag].emplace_back(p, p + bytes);
  }
  void recv(void* buf, int64_t bytes, int, int tag) override {
    MT_CHECK(take(buf, bytes, tag), "comm.recv", "single-process recv with no matching send (tag ", tag,
             ") would block forever");
  }
  int64_t isend(const void* buf, int64_t bytes, int dst, int tag) override {
    send(buf, bytes, dst, tag);  // buffered at once: complete when posted
    return new_req({nullptr, bytes, tag, true, true});
  }
  int64_t irecv(void* buf, int64_t bytes, int, int tag) override {
    const bool got = take(buf, bytes, tag);
    const int64_t id = new_req({buf, bytes, tag, got, true});
    if (!got) posted_[tag].push_back(id);
    return id;
  }
  std::string wait_all(const int64_t* ids, int n) override {
    for (int k = 0; k < n; ++k) {
      Req& r = reqs_[size_t(ids[k])];
      MT_CHECK(r.done, "comm.wait", "single-process irecv of ", r.bytes, " bytes (tag ", r.tag,
               ") has no matching send and would block forever");
    }
    for (int k = 0; k < n; ++k) {
      reqs_[size_t(ids[k])].live = false;
      free_.push_back(ids[k]);
    }
    return {};  // sizes were checked when the message met its irecv
  }
  void barrier() override {}
  std::shared_ptr<CommBackend> split(int, int) override { return std::make_shared<LocalBackend>(); }
  std::unique_ptr<SharedMemory> share_memory(int64_t bytes) override { return std::make_unique<LocalShared>(bytes); }
  std::vector<int> world_ranks() const override { return {0}; }

 private:
  struct Req {
    void* buf = nullptr;
    int64_t bytes = 0;
    int tag = 0;
    bool done = false;
    bool live = false;
  };
  // Takes the oldest queued message of `tag` into buf (its size must be `bytes`); false if none is queued.
  bool take(void* buf, int64_t bytes, int tag) {
    auto it = queue_.find(tag);
    if (it == queue_.end() || it->second.empty()) return false;
    std::vector<char>& m = it->second.front();
    MT_CHECK(int64_t(m.size()) == bytes, "comm.recv", "message of ", m.size(), " bytes, expected ", bytes,
             " (tag ", tag, ")");
    if (bytes > 0) std::memcpy(buf, m.data(), size_t(bytes));
    it->second.pop_front();
    return true;
  }
  int64_t new_req(const Req& r) { return put_request(reqs_, free_, r); }
  std::map<int, std::deque<std::vector<char>>> queue_;
  std::map<int, std::deque<int64_t>> posted_;  // pending irecv ids per tag, oldest first
  std::vector<Req> reqs_;
  std::vector<int64_t> free_;
};

}  // namespace

std::shared_ptr<CommBackend> make_local_backend() { return std::make_shared<LocalBackend>(); }

// Shared state of a Comm handle: the backend, the statistics, the trace hook and what traces number (the
// collective sequence, the point-to-point message counts, the splits), the pending non-blocking requests and a
// tracked workspace.
struct CommState {
  std::shared_ptr<CommBackend> be;
  CommStats stats;
  CommTraceHook hook;
  CommInfo info;             // name at once; world_ranks on first use (info_ready)
  bool info_ready = false;
  int64_t coll_seq = 0;      // collectives so far
  int64_t n_splits = 0;      // split() calls so far (names the children)
  // Messages so far per (peer, tag), sent and received: key peer * (kCommMaxUserTag + 1) + tag.
  std::unordered_map<int64_t, int64_t> sent_msgs, recv_msgs;
  struct Pending {
    CommOp op = CommOp::Send;
    int64_t bytes = 0, wire = 0;
    int64_t backend_id = -1;
    double t_post = 0, t_post_end = 0;
    int peer = -1, tag = -1;
    int64_t msg = -1;
    bool live = false;
  };
  std::vector<Pending> pending;  // indexed by CommRequest id; slots are reused
  std::vector<int64_t> pending_free;
  int64_t n_pending = 0;
  std::vector<int64_t> wait_ids;  // scratch of wait_all

  // Registers a posted request: counts its call and bytes now, its posting time [t0, t1] in its op's seconds.
  CommRequest post(CommOp op, int64_t bytes, int64_t wire, double t0, double t1, int64_t backend_id, int peer, int tag,
                   int64_t msg) {
    int64_t id;
    if (!pending_free.empty()) {
      id = pending_free.back();
      pending_free.pop_back();
    } else {
      id = int64_t(pending.size());
      pending.emplace_back();
    }
    pending[size_t(id)] = {op, bytes, wire, backend_id, t0, t1, peer, tag, msg, true};
    ++n_pending;
    CommOpStats& o = stats.op[size_t(op)];
    o.calls += 1;
    o.bytes += bytes;
    o.wire_bytes += wire;
    o.seconds += t1 - t0;
    CommRequest r;
    r.owner_ = this;
    r.id_ = id;
    return r;
  }
  char* ws = nullptr;
  size_t ws_bytes = 0;
  std::vector<int64_t> c1, d1, c2, d2;  // count / displacement scratch, [size] each

  const CommInfo& get_info() {
    if (!info_ready) info.world_ranks = be->world_ranks(), info_ready = true;
    return info;
  }
  // The k-th message (from 0) to / from `peer` with `tag`, counted now.
  int64_t next_msg(bool sent, int peer, int tag) {
    return (sent ? sent_msgs : recv_msgs)[int64_t(peer) * (kCommMaxUserTag + 1) + tag]++;
  }

  CommState() { (void)MemoryTracker::global(); }  // constructed first, so it outlives static Comms
  ~CommState() { mt_free(ws, ws_bytes, MemCategory::Comm); }
  char* workspace(size_t bytes) {
    if (bytes > ws_bytes) {
      mt_free(ws, ws_bytes, MemCategory::Comm);
      ws = nullptr;
      ws = static_cast<char*>(mt_alloc(bytes, MemCategory::Comm));
      ws_bytes = bytes;
    }
    return ws;
  }
};

}  // namespace detail

using detail::CommState;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The process-wide trace sink (set_comm_trace_sink): read on every call, set only while nothing communicates.
std::atomic<bool> g_sink_on{false};
CommTraceHook g_sink;
// The flight recorder's sink (set_comm_flight_sink): the same events plus Scheduled / Started ones.
std::atomic<bool> g_flight_on{false};
CommTraceHook g_flight;

bool flight_on() { return g_flight_on.load(std::memory_order_relaxed); }
bool hooked(const CommState& s) { return s.hook || g_sink_on.load(std::memory_order_relaxed) || flight_on(); }
void emit(CommState& s, CommEvent& e) {
  e.comm = &s.get_info();
  if (e.state == CommEvent::State::Completed) {
    if (s.hook) s.hook(e);
    if (g_sink_on.load(std::memory_order_relaxed)) g_sink(e);
  }
  if (flight_on()) g_flight(e);
}
// A call that has not finished yet, for the flight recorder only.
void emit_open(CommState& s, CommEvent::State st, CommOp op, int64_t bytes, double t0, int64_t seq, int peer = -1,
               int tag = -1, int64_t msg = -1) {
  if (!flight_on()) return;
  CommEvent e{op, bytes, 0, t0, 0, s.be->size()};
  e.seq = seq, e.peer = peer, e.tag = tag, e.msg = msg, e.state = st;
  emit(s, e);
}

// Times one call and records it (also when the call throws: then nothing is recorded). Collectives take the
// communicator's next sequence number when they start.
struct OpTimer {
  CommState& s;
  CommOp op;
  double t0;
  int64_t seq = -1;
  // bytes: what the flight recorder compares between ranks (see flight_recorder.h), known before the call.
  OpTimer(CommState& s_, CommOp op_, int64_t bytes = 0, int peer = -1, int tag = -1, int64_t msg = -1)
      : s(s_), op(op_), t0(now_s()) {
    if (op != CommOp::Send && op != CommOp::Recv) seq = s.coll_seq++;
    emit_open(s, CommEvent::State::Started, op, bytes, t0, seq, peer, tag, msg);
  }
  // in / out: CommEvent::bytes_in / bytes_out; the rest as CommEvent says (point-to-point and per-peer counts).
  void done(int64_t bytes, int64_t wire, int64_t in = 0, int64_t out = 0, int peer = -1, int tag = -1,
            int64_t msg = -1, const int64_t* sc = nullptr, const int64_t* rc = nullptr) {
    double t1 = now_s();
    CommOpStats& o = s.stats.op[size_t(op)];
    o.calls += 1;
    o.bytes += bytes;
    o.wire_bytes += wire;
    o.seconds += t1 - t0;
    if (!hooked(s)) return;
    CommEvent e{op, bytes, wire, t0, t1, s.be->size()};
    e.bytes_in = in, e.bytes_out = out, e.seq = seq, e.peer = peer, e.tag = tag, e.msg = msg;
    e.send_counts = sc, e.recv_counts = rc;
    emit(s, e);
  }
};

void check_counts(const char* op, const int64_t* counts, const int64_t* displs, int p, const char* what) {
  MT_CHECK(p == 0 || (counts && displs), op, "null ", what, " counts or displacements");
  for (int q = 0; q < p; ++q) {
    MT_CHECK(counts[q] >= 0, op, what, " count for peer ", q, " is negative: ", counts[q]);
    MT_CHECK(displs[q] >= 0, op, what, " displacement for peer ", q, " is negative: ", displs[q]);
  }
}

// acc[i] += v[i] for n elements of type t (integers wrap).
void accumulate(void* acc, const void* v, int64_t n, ReduceType t) {
  switch (t) {
    case ReduceType::F32: {
      float* a = static_cast<float*>(acc);
      const float* b = static_cast<const float*>(v);
      for (int64_t i = 0; i < n; ++i) a[i] += b[i];
      break;
    }
    case ReduceType::F64: {
      double* a = static_cast<double*>(acc);
      const double* b = static_cast<const double*>(v);
      for (int64_t i = 0; i < n; ++i) a[i] += b[i];
      break;
    }
    case ReduceType::I32: {
      uint32_t* a = static_cast<uint32_t*>(acc);
      const uint32_t* b = static_cast<const uint32_t*>(v);
      for (int64_t i = 0; i < n; ++i) a[i] += b[i];
      break;
    }
    case ReduceType::I64: {
      uint64_t* a = static_cast<uint64_t*>(acc);
      const uint64_t* b = static_cast<const uint64_t*>(v);
      for (int64_t i = 0; i < n; ++i) a[i] += b[i];
      break;
    }
  }
}

}  // namespace

Comm::Comm() : Comm(detail::make_local_backend()) {}

Comm::Comm(std::shared_ptr<detail::CommBackend> backend) : s_(std::make_shared<CommState>()) {
  MT_CHECK(backend != nullptr, "comm", "null backend");
  s_->be = std::move(backend);
  s_->info.name = "local";
  const size_t p = size_t(s_->be->size());
  s_->c1.resize(p);
  s_->d1.resize(p);
  s_->c2.resize(p);
  s_->d2.resize(p);
}

int Comm::rank() const { return s_->be->rank(); }
int Comm::size() const { return s_->be->size(); }
std::string_view Comm::backend_name() const { return s_->be->name(); }
CommStats Comm::stats() const { return s_->stats; }
void Comm::reset_stats() const { s_->stats = CommStats{}; }
void Comm::set_trace_hook(CommTraceHook hook) const { s_->hook = std::move(hook); }

void Comm::all_reduce(float* x, int64_t n) const { all_reduce(x, n, ReduceType::F32); }
void Comm::all_reduce(double* x, int64_t n) const { all_reduce(x, n, ReduceType::F64); }
void Comm::all_reduce(int32_t* x, int64_t n) const { all_reduce(x, n, ReduceType::I32); }
void Comm::all_reduce(int64_t* x, int64_t n) const { all_reduce(x, n, ReduceType::I64); }

void Comm::all_reduce(void* x, int64_t n, ReduceType t) const {
  const char* op = "comm.all_reduce";
  MT_CHECK(n >= 0, op, "negative element count ", n);
  MT_CHECK(x != nullptr || n == 0, op, "null buffer for ", n, " elements");
  OpTimer tm(*s_, CommOp::AllReduce, n * int64_t(reduce_type_size(t)));
  const int64_t es = int64_t(reduce_type_size(t));
  const int p = size(), me = rank();
  int64_t wire = 0;
  if (p > 1) {
    auto& sc = s_->c1;
    auto& sd = s_->d1;
    auto& rc = s_->c2;
    auto& rd = s_->d2;
    char* xb = static_cast<char*>(x);
    for (int64_t s0 = 0; s0 < n; s0 += kCommReduceSegment) {
      const int64_t m = std::min(kCommReduceSegment, n - s0);
      auto lo = [&](int r) { return r * m / p; };
      const int64_t len = lo(me + 1) - lo(me);
      char* ws = s_->workspace(size_t(p * len * es));
      for (int q = 0; q < p; ++q) {
        sc[size_t(q)] = (lo(q + 1) - lo(q)) * es;
        sd[size_t(q)] = lo(q) * es;
        rc[size_t(q)] = len * es;
        rd[size_t(q)] = q * len * es;
        if (q != me) wire += sc[size_t(q)];
      }
      s_->be->all_to_all_v(ws, rc.data(), rd.data(), xb + s0 * es, sc.data(), sd.data());
      for (int q = 1; q < p; ++q) accumulate(ws, ws + q * len * es, len, t);  // fold in rank order
      s_->be->all_gather_v(xb + s0 * es, sc.data(), sd.data(), ws);
      wire += len * es * (p - 1);
    }
  }
  tm.done(n * es, wire, n * es, n * es);
}

void Comm::reduce_scatter(float* out, const float* in, int64_t n) const { reduce_scatter(out, in, n, ReduceType::F32); }
void Comm::reduce_scatter(double* out, const double* in, int64_t n) const { reduce_scatter(out, in, n, ReduceType::F64); }
void Comm::reduce_scatter(int32_t* out, const int32_t* in, int64_t n) const {
  reduce_scatter(out, in, n, ReduceType::I32);
}
void Comm::reduce_scatter(int64_t* out, const int64_t* in, int64_t n) const {
  reduce_scatter(out, in, n, ReduceType::I64);
}

void Comm::reduce_scatter(void* out, const void* in, int64_t n, ReduceType t) const {
  const char* op = "comm.reduce_scatter";
  MT_CHECK(n >= 0, op, "negative element count ", n);
  MT_CHECK((out && in) || n == 0, op, "null buffer for ", n, " elements per rank");
  OpTimer tm(*s_, CommOp::ReduceScatter, n * int64_t(reduce_type_size(t)));
  const int64_t es = int64_t(reduce_type_size(t));
  const int p = size(), me = rank();
  int64_t wire = 0;
  if (p == 1) {
    if (n > 0 && out != in) std::memmove(out, in, size_t(n * es));
  } else if (n > 0) {
    char* ws = s_->workspace(size_t(p * n * es));
    auto& sc = s_->c1;
    auto& sd = s_->d1;
    auto& rc = s_->c2;
    auto& rd = s_->d2;
    for (int q = 0; q < p; ++q) {
      sc[size_t(q)] = n * es;
      sd[size_t(q)] = q * n * es;
      rc[size_t(q)] = n * es;
      rd[size_t(q)] = q * n * es;
      if (q != me) wire += n * es;
    }
    s_->be->all_to_all_v(ws, rc.data(), rd.data(), in, sc.data(), sd.data());
    for (int q = 1; q < p; ++q) accumulate(ws, ws + q * n * es, n, t);
    std::memcpy(out, ws, size_t(n * es));
  }
  tm.done(p * n * es, wire, n * es, p * n * es);
}

namespace {
template <class T>
void ordered_impl(CommState& s, T* out, const T* parts, int64_t m_local, int64_t n) {
  const char* op = "comm.all_reduce_ordered";
  MT_CHECK(n >= 0 && m_local >= 0, op, "negative size n=", n, " m_local=", m_local);
  MT_CHECK(out != nullptr || n == 0, op, "null out");
  MT_CHECK(parts != nullptr || n == 0 || m_local == 0, op, "null parts");
  MT_CHECK(n == 0 || m_local == 0 || (out + n <= parts || parts + m_local * n <= out), op, "out aliases parts");
  OpTimer tm(s, CommOp::AllReduce, n * int64_t(sizeof(T)));
  const int p = s.be->size();
  // Everyone learns every rank's part count.
  std::vector<int64_t> m(static_cast<size_t>(p)), cnt(static_cast<size_t>(p)), dsp(static_cast<size_t>(p));
  for (int q = 0; q < p; ++q) {
    cnt[size_t(q)] = 8;
    dsp[size_t(q)] = 8 * q;
  }
  s.be->all_gather_v(m.data(), cnt.data(), dsp.data(), &m_local);
  int64_t M = 0;
  for (int64_t v : m) M += v;
  int64_t wire = 8 * (p - 1);
  const int64_t es = sizeof(T);
  // Column blocks of width w so that the gathered [M, w] block stays bounded.
  const int64_t w = std::max<int64_t>(1, kCommReduceSegment / std::max<int64_t>(M, 1));
  for (int64_t c0 = 0; c0 < n; c0 += w) {
    const int64_t cw = std::min(w, n - c0);
    char* ws = s.workspace(size_t((M + m_local) * cw * es));
    T* all = reinterpret_cast<T*>(ws);
    T* mine = all + M * cw;
    for (int64_t i = 0; i < m_local; ++i) std::memcpy(mine + i * cw, parts + i * n + c0, size_t(cw * es));
    int64_t off = 0;
    for (int q = 0; q < p; ++q) {
      cnt[size_t(q)] = m[size_t(q)] * cw * es;
      dsp[size_t(q)] = off;
      off += cnt[size_t(q)];
    }
    s.be->all_gather_v(all, cnt.data(), dsp.data(), mine);
    wire += m_local * cw * es * (p - 1);
    T* o = out + c0;
    if (M == 0) {
      for (int64_t j = 0; j < cw; ++j) o[j] = T(0);
      continue;
    }
    std::memcpy(o, all, size_t(cw * es));
    for (int64_t i = 1; i < M; ++i) {
      const T* v = all + i * cw;
      for (int64_t j = 0; j < cw; ++j) o[j] += v[j];
    }
  }
  tm.done(m_local * n * es, wire, n * es, m_local * n * es);
}
}  // namespace

void Comm::all_reduce_ordered(float* out, const float* parts, int64_t m_local, int64_t n) const {
  ordered_impl(*s_, out, parts, m_local, n);
}
void Comm::all_reduce_ordered(double* out, const double* parts, int64_t m_local, int64_t n) const {
  ordered_impl(*s_, out, parts, m_local, n);
}

void Comm::all_gather(void* out, const void* in, int64_t bytes) const {
  const char* op = "comm.all_gather";
  MT_CHECK(bytes >= 0, op, "negative byte count ", bytes);
  MT_CHECK((out && in) || bytes == 0, op, "null buffer");
  const int p = size();
  MT_CHECK(bytes == 0 || static_cast<const char*>(in) + bytes <= static_cast<char*>(out) ||
               static_cast<char*>(out) + p * bytes <= static_cast<const char*>(in),
           op, "out aliases in");
  OpTimer tm(*s_, CommOp::AllGather, bytes * p);
  auto& c = s_->c1;
  auto& d = s_->d1;
  for (int q = 0; q < p; ++q) {
    c[size_t(q)] = bytes;
    d[size_t(q)] = q * bytes;
  }
  if (bytes > 0) s_->be->all_gather_v(out, c.data(), d.data(), in);
  tm.done(bytes, bytes * (p - 1), bytes * p, bytes);
}

void Comm::all_gather_v(void* out, const int64_t* counts, const int64_t* displs, const void* in) const {
  const char* op = "comm.all_gather_v";
  const int p = size(), me = rank();
  check_counts(op, counts, displs, p, "gather");
  MT_CHECK(out != nullptr, op, "null out");
  MT_CHECK(in != nullptr || counts[me] == 0, op, "null in with ", counts[me], " bytes");
  int64_t all = 0;
  for (int q = 0; q < p; ++q) all += counts[q];
  OpTimer tm(*s_, CommOp::AllGather, all);
  s_->be->all_gather_v(out, counts, displs, in);
  tm.done(counts[me], counts[me] * (p - 1), all, counts[me]);
}

void Comm::all_to_all_v(void* recv, const int64_t* recv_counts, const int64_t* recv_displs, const void* send,
                        const int64_t* send_counts, const int64_t* send_displs) const {
  const char* op = "comm.all_to_all_v";
  const int p = size(), me = rank();
  check_counts(op, send_counts, send_displs, p, "send");
  check_counts(op, recv_counts, recv_displs, p, "recv");
  int64_t sent = 0, recvd = 0;
  for (int q = 0; q < p; ++q) {
    sent += send_counts[q];
    recvd += recv_counts[q];
  }
  MT_CHECK(send != nullptr || sent == 0, op, "null send buffer with ", sent, " bytes to send");
  MT_CHECK(recv != nullptr || recvd == 0, op, "null recv buffer with ", recvd, " bytes to receive");
  MT_CHECK(send_counts[me] == recv_counts[me], op, "self block: sending ", send_counts[me], " bytes but receiving ",
           recv_counts[me]);
  OpTimer tm(*s_, CommOp::AllToAllV, sent);
  s_->be->all_to_all_v(recv, recv_counts, recv_displs, send, send_counts, send_displs);
  tm.done(sent, sent - send_counts[me], recvd, sent, -1, -1, -1, send_counts, recv_counts);
}

void Comm::all_to_all(void* recv, const void* send, int64_t bytes_per_peer) const {
  MT_CHECK(bytes_per_peer >= 0, "comm.all_to_all", "negative byte count ", bytes_per_peer);
  const int p = size();
  std::vector<int64_t> c(size_t(p), bytes_per_peer), d(static_cast<size_t>(p));
  for (int q = 0; q < p; ++q) d[size_t(q)] = q * bytes_per_peer;
  all_to_all_v(recv, c.data(), d.data(), send, c.data(), d.data());
}

void Comm::exchange(void* recv, int64_t capacity, const void* send, const int64_t* send_counts,
                    const int64_t* send_displs) const {
  const char* op = "comm.exchange";
  const int p = size(), me = rank();
  MT_CHECK(capacity >= 0, op, "negative capacity ", capacity);
  check_counts(op, send_counts, send_displs, p, "send");
  int64_t sent = 0;
  for (int q = 0; q < p; ++q) {
    MT_CHECK(send_counts[q] <= capacity, op, "message for peer ", q, " has ", send_counts[q],
             " bytes, more than the capacity ", capacity);
    sent += send_counts[q];
  }
  MT_CHECK(send != nullptr || sent == 0, op, "null send buffer");
  MT_CHECK(recv != nullptr || capacity == 0, op, "null recv buffer");
  OpTimer tm(*s_, CommOp::Exchange, sent);
  s_->be->exchange(recv, capacity, send, send_counts, send_displs);
  tm.done(sent, sent - send_counts[me], 0, sent, -1, -1, -1, send_counts, nullptr);
}

void Comm::send(const void* buf, int64_t bytes, int dst, int tag) const {
  const char* op = "comm.send";
  MT_CHECK(dst >= 0 && dst < size(), op, "destination rank ", dst, " outside [0, ", size(), ")");
  MT_CHECK(tag >= 0 && tag <= kCommMaxUserTag, op, "tag ", tag, " outside [0, ", kCommMaxUserTag, "]");
  MT_CHECK(bytes >= 0 && (buf || bytes == 0), op, "bad buffer: ", bytes, " bytes");
  const int64_t msg = s_->next_msg(true, dst, tag);
  OpTimer tm(*s_, CommOp::Send, bytes, dst, tag, msg);
  s_->be->send(buf, bytes, dst, tag);
  tm.done(bytes, dst == rank() ? 0 : bytes, 0, bytes, dst, tag, msg);
}

void Comm::recv(void* buf, int64_t bytes, int src, int tag) const {
  const char* op = "comm.recv";
  MT_CHECK(src >= 0 && src < size(), op, "source rank ", src, " outside [0, ", size(), ")");
  MT_CHECK(tag >= 0 && tag <= kCommMaxUserTag, op, "tag ", tag, " outside [0, ", kCommMaxUserTag, "]");
  MT_CHECK(bytes >= 0 && (buf || bytes == 0), op, "bad buffer: ", bytes, " bytes");
  const int64_t msg = s_->next_msg(false, src, tag);
  OpTimer tm(*s_, CommOp::Recv, bytes, src, tag, msg);
  s_->be->recv(buf, bytes, src, tag);
  tm.done(bytes, 0, bytes, 0, src, tag, msg);
}

CommRequest Comm::isend(const void* buf, int64_t bytes, int dst, int tag) const {
  const char* op = "comm.isend";
  MT_CHECK(dst >= 0 && dst < size(), op, "destination rank ", dst, " outside [0, ", size(), ")");
  MT_CHECK(tag >= 0 && tag <= kCommMaxUserTag, op, "tag ", tag, " outside [0, ", kCommMaxUserTag, "]");
  MT_CHECK(bytes >= 0 && (buf || bytes == 0), op, "bad buffer: ", bytes, " bytes");
  const double t0 = now_s();
  const int64_t msg = s_->next_msg(true, dst, tag);
  emit_open(*s_, CommEvent::State::Scheduled, CommOp::Send, bytes, t0, -1, dst, tag, msg);
  const int64_t id = s_->be->isend(buf, bytes, dst, tag);
  return s_->post(CommOp::Send, bytes, dst == rank() ? 0 : bytes, t0, now_s(), id, dst, tag, msg);
}

CommRequest Comm::irecv(void* buf, int64_t bytes, int src, int tag) const {
  const char* op = "comm.irecv";
  MT_CHECK(src >= 0 && src < size(), op, "source rank ", src, " outside [0, ", size(), ")");
  MT_CHECK(tag >= 0 && tag <= kCommMaxUserTag, op, "tag ", tag, " outside [0, ", kCommMaxUserTag, "]");
  MT_CHECK(bytes >= 0 && (buf || bytes == 0), op, "bad buffer: ", bytes, " bytes");
  const double t0 = now_s();
  const int64_t msg = s_->next_msg(false, src, tag);
  emit_open(*s_, CommEvent::State::Scheduled, CommOp::Recv, bytes, t0, -1, src, tag, msg);
  const int64_t id = s_->be->irecv(buf, bytes, src, tag);
  return s_->post(CommOp::Recv, bytes, 0, t0, now_s(), id, src, tag, msg);
}

void Comm::wait(CommRequest& r) const { wait_all(&r, 1); }

void Comm::wait_all(CommRequest* reqs, size_t n) const {
  const char* op = "comm.wait";
  MT_CHECK(reqs != nullptr || n == 0, op, "null request list of ", n, " requests");
  CommState& s = *s_;
  for (size_t k = 0; k < n; ++k) {
    MT_CHECK(reqs[k].pending(), op, "request ", k, " of ", n, " is empty (never posted, or already completed)");
    MT_CHECK(reqs[k].owner_ == &s, op, "request ", k, " of ", n, " was posted on another communicator");
    MT_CHECK(s.pending[size_t(reqs[k].id_)].live, op, "request ", k, " of ", n, " is not pending");
  }
  if (n == 0) return;
  const double t0 = now_s();
  if (flight_on())
    for (size_t k = 0; k < n; ++k) {
      const CommState::Pending& p = s.pending[size_t(reqs[k].id_)];
      emit_open(s, CommEvent::State::Started, p.op, p.bytes, t0, -1, p.peer, p.tag, p.msg);
    }
  s.wait_ids.resize(n);
  for (size_t k = 0; k < n; ++k) s.wait_ids[k] = s.pending[size_t(reqs[k].id_)].backend_id;
  const std::string problem = s.be->wait_all(s.wait_ids.data(), int(n));
  const double t1 = now_s();
  const double share = (t1 - t0) / double(n);
  for (size_t k = 0; k < n; ++k) {
    CommState::Pending& p = s.pending[size_t(reqs[k].id_)];
    s.stats.op[size_t(p.op)].seconds += share;
    if (hooked(s)) {
      CommEvent e{p.op, p.bytes, p.wire, p.t_post, t1, s.be->size()};
      const bool sent = p.op == CommOp::Send;
      e.bytes_in = sent ? 0 : p.bytes, e.bytes_out = sent ? p.bytes : 0;
      e.peer = p.peer, e.tag = p.tag, e.msg = p.msg;
      e.nonblocking = true, e.t_post_end = p.t_post_end, e.t_wait_begin = t0;
      e.wait_index = int(k), e.wait_count = int(n);
      emit(s, e);
    }
    p.live = false;
    s.pending_free.push_back(reqs[k].id_);
    --s.n_pending;
    reqs[k].id_ = -1;
  }
  if (!problem.empty()) MT_FAIL(op, problem);
}

int64_t Comm::pending_requests() const { return s_->n_pending; }

void Comm::barrier() const {
  OpTimer tm(*s_, CommOp::Barrier);
  s_->be->barrier();
  tm.done(0, 0);
}

std::unique_ptr<SharedMemory> Comm::share_memory(int64_t bytes) const {
  MT_CHECK(bytes >= 0, "comm.share_memory", "negative size ", bytes);
  OpTimer tm(*s_, CommOp::Barrier);
  auto m = s_->be->share_memory(bytes);
  tm.done(0, 0);
  return m;
}

void Comm::wait_shared(const SharedMemory& m, const std::function<bool()>& ready) const {
  OpTimer tm(*s_, CommOp::Barrier);
  m.wait_until(ready);
  tm.done(0, 0);
}

void SharedMemory::publish(int64_t* flag, int64_t v) {
  std::atomic_ref<int64_t>(*flag).store(v, std::memory_order_release);
}
int64_t SharedMemory::seen(const int64_t* flag) {
  return std::atomic_ref<int64_t>(*const_cast<int64_t*>(flag)).load(std::memory_order_acquire);
}

Comm Comm::split(int color, int key) const {
  MT_CHECK(color >= 0, "comm.split", "color ", color, " must be >= 0");
  OpTimer tm(*s_, CommOp::Split);
  Comm c(s_->be->split(color, key));
  c.s_->info.name = s_->info.name + "." + std::to_string(s_->n_splits++);
  tm.done(0, 0);
  return c;
}

void Comm::set_name(std::string name) const { s_->info.name = std::move(name); }
const CommInfo& Comm::info() const { return s_->get_info(); }

void set_comm_flight_sink(CommTraceHook hook) {
  g_flight_on.store(false);
  g_flight = std::move(hook);
  g_flight_on.store(bool(g_flight));
}

std::string comm_group_id(const CommInfo& info) {
  return info.name + "@" + std::to_string(info.world_ranks.empty() ? 0 : info.world_ranks.front());
}

void set_comm_trace_sink(CommTraceHook hook) {
  g_sink_on.store(false);
  g_sink = std::move(hook);
  g_sink_on.store(bool(g_sink));
}

Comm comm_local() { return Comm(detail::make_local_backend()); }

bool comm_mpi_built() {
#if MOETRON_WITH_MPI
  return true;
#else
  return false;
#endif
}

Comm comm_world() {
#if MOETRON_WITH_MPI
  if (detail::mpi_launched()) {
    static Comm world = [] {  // one handle: every caller shares its stats
      Comm w(detail::mpi_world_backend());
      w.set_name("world");
      return w;
    }();
    return world;
  }
#endif
  static Comm local = [] {
    Comm l = comm_local();
    l.set_name("world");
    return l;
  }();
  return local;
}

bool comm_thread_multiple() {
#if MOETRON_WITH_MPI
  return detail::mpi_thread_multiple();
#else
  return false;
#endif
}

bool comm_request_mpi_thread(bool multiple) {
#if MOETRON_WITH_MPI
  return detail::mpi_request_thread(multiple);
#else
  (void)multiple;
  return true;
#endif
}

void comm_set_mpi_wait(bool poll, int max_nap_us) {
#if MOETRON_WITH_MPI
  detail::mpi_set_wait(poll, max_nap_us);
#else
  (void)poll, (void)max_nap_us;
#endif
}

void comm_finalize() {
#if MOETRON_WITH_MPI
  detail::mpi_finalize_if_owned();
#endif
}

}  // namespace moetron
