// trace_comm.cpp: a rank's trace session (the start barrier that aligns the clocks, the Comm trace sink) and the
// communication events it records: one per call, with the communicator as a group (`<name>@<first member's
// rank>`, its members as ranks of the trainer's world), the collective's sequence number, bytes in and out, the
// peer, tag and message index of point-to-point calls, per-member counts of all-to-all calls; a non-blocking
// request as its posting plus one `wait` event per completing wait. Not the file (trace_write.cpp).
#include <algorithm>

#include "moetron/comm.h"
#include "moetron/trace.h"
#include "trace/recorder.h"

namespace moetron::trace {

using detail::Cat;
using detail::Event;
using detail::store;

namespace {

const char* op_event_name(CommOp op) {  // docs/profiling.md's names
  switch (op) {
    case CommOp::AllReduce: return "all_reduce";
    case CommOp::ReduceScatter: return "reduce_scatter";
    case CommOp::AllGather: return "all_gather";
    case CommOp::AllToAllV: return "all_to_all";
    case CommOp::Exchange: return "exchange";
    case CommOp::Send: return "send";
    case CommOp::Recv: return "recv";
    case CommOp::Barrier: return "barrier";
    case CommOp::Split: return "split";
  }
  return "comm";
}

// The group index of a communicator (under store().mu).
int group_index(detail::Store& s, const CommInfo& info) {
  auto it = s.group_of.find(&info);
  if (it != s.group_of.end() && s.groups[size_t(it->second)].name == info.name) return it->second;
  detail::Group g;
  g.name = info.name;
  for (int r : info.world_ranks) {
    auto w = s.world_index.find(r);
    g.ranks.push_back(w == s.world_index.end() ? r : w->second);
  }
  g.id = g.name + "@" + std::to_string(g.ranks.empty() ? 0 : g.ranks.front());
  int idx = -1;
  for (size_t k = 0; k < s.groups.size(); ++k)
    if (s.groups[k].id == g.id && s.groups[k].ranks == g.ranks) idx = int(k);
  if (idx < 0) idx = int(s.groups.size()), s.groups.push_back(std::move(g));
  s.group_of[&info] = idx;
  return idx;
}

void on_comm(const CommEvent& c) {
  if (!enabled() || !c.comm) return;
  const int tid = detail::t_track;
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  const int gi = group_index(s, *c.comm);
  const auto& ranks = s.groups[size_t(gi)].ranks;
  Event e;
  e.cat = Cat::Comm, e.name = op_event_name(c.op), e.tid = uint8_t(tid);
  e.t0 = c.t_begin * 1e6, e.t1 = (c.nonblocking ? c.t_post_end : c.t_end) * 1e6;
  e.a[0] = gi, e.a[3] = c.comm_size;
  if (c.peer >= 0) {
    e.a[1] = c.peer < int(ranks.size()) ? ranks[size_t(c.peer)] : c.peer;
    e.a[2] = c.tag, e.d[3] = double(c.msg);
  }
  e.d[0] = double(c.seq), e.d[1] = double(c.bytes_in), e.d[2] = double(c.bytes_out);
  e.flag = c.nonblocking;
  if (c.send_counts) {
    e.side = int64_t(s.side.size());
    e.flag = c.recv_counts != nullptr;
  }
  if (s.push(e) && c.send_counts) {
    for (int q = 0; q < c.comm_size; ++q) s.side.push_back(double(c.send_counts[q]));
    if (c.recv_counts)
      for (int q = 0; q < c.comm_size; ++q) s.side.push_back(double(c.recv_counts[q]));
  }
  if (c.nonblocking && c.wait_index == 0) {  // the wait that completed it, once per wait call
    Event w;
    w.cat = Cat::Wait, w.name = "wait", w.tid = uint8_t(tid);
    w.t0 = c.t_wait_begin * 1e6, w.t1 = c.t_end * 1e6;
    w.a[0] = gi, w.a[1] = c.wait_count;
    s.push(w);
  }
}

}  // namespace

void begin_session(const Comm& world, int64_t max_events, const nlohmann::json& meta) {
  world.barrier();  // every rank leaves it at about the same time: that moment is ts 0 on every rank
  const double t = now_us();
  auto& s = store();
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.session = true;
    s.rank = world.rank(), s.world = world.size();
    s.max_events = max_events;
    s.t_sync_us = t;
    s.world_index.clear();
    const CommInfo& wi = world.info();
    for (size_t r = 0; r < wi.world_ranks.size(); ++r) s.world_index[wi.world_ranks[r]] = int(r);
    s.meta = meta;
    s.groups.clear();
    s.group_of.clear();
    s.events.reserve(size_t(std::min<int64_t>(max_events, 1 << 16)));
  }
  set_comm_trace_sink(on_comm);
}

void cancel_session() {
  set_comm_trace_sink(nullptr);
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  s.session = false;
}

bool in_session() {
  auto& s = store();
  std::lock_guard<std::mutex> lk(s.mu);
  return s.session;
}

}  // namespace moetron::trace
