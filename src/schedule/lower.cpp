// lower.cpp: the lowering pass of the schedule IR (lower): turns a valid compute-only schedule into one with
// explicit point-to-point communication. Not the validator (validate.cpp), not the runtime that issues the
// calls (src/parallel/).
//
// What it adds. For every compute action whose output goes to a stage on another rank (F(s) -> s+1,
// B/I(s) -> s-1), a SEND right after it on the producer's rank; for the consumer, the matching RECV in the
// consumer's list before the compute action that uses it. Neighbouring stages on one rank (V shapes) pass the
// tensor in memory: no action. An FB action sends its forward half's output first, then its backward half's.
//
// Order. Between two ranks a and b, b must receive a's tensors in the order a sends them (one FIFO channel per
// ordered pair: that is how NCCL and untagged MPI pair a send with a receive). The sends sit right after their
// producers, so a's program fixes that order. Each RECV starts just before its consumer; when b would consume
// a's tensors in another order than a sends them, an earlier-sent tensor's RECV moves up to just before the
// first consumer of any later-sent tensor of the same channel: anchor(i) = min over j >= i (in send order) of
// consumer(j). RECVs that share an anchor are emitted by source rank, then in send order.
//
// Why it cannot hang (blocking RECV, non-blocking SEND). In the compute-only schedule, b's k-th compute can
// run once the tensors it consumes have been sent. After lowering, b reaches compute k after the RECVs
// anchored at or before k, i.e. after tensors i whose channel also carries a later-sent tensor j consumed at
// or before k. Since a sends i before j and j is needed for compute k anyway, the lowered schedule waits for
// nothing the compute-only one did not already wait for: if the latter runs to the end (validate() checks it
// with the lock-step replay), so does the former. A SEND costs its rank no waiting.
//
// Compared with torch.distributed.pipelining (_add_send_recv), which steps the ranks round-robin and appends
// a RECV to the consumer's list when the sender schedules its compute, this pass places each RECV next to its
// consumer (so it waits as late as possible) and enforces the per-pair order explicitly. Megatron-Core pairs
// its neighbour exchanges differently (batched isend/irecv per step, or even ranks send first and odd ranks
// receive first); here each call stands alone and only the per-pair FIFO order matters.
//
// Refusals: an already lowered schedule ("already lowered"), and an invalid compute-only schedule (the
// validator's message).
#include <algorithm>
#include <map>

#include "moetron/check.h"
#include "moetron/schedule.h"
#include "schedule/sim_internal.h"

namespace moetron::sched {

Schedule lower(const Schedule& in) {
  MT_CHECK(!in.lowered, "schedule", "lower: schedule '", in.name,
           "' is already lowered (it has SEND/RECV actions); lower its compute-only form instead");
  check_valid(in);  // also refuses SEND/RECV in a schedule not marked lowered

  using detail::Msg;
  const int M = in.n_microbatches;
  auto cell = [&](const Msg& m) { return (size_t(m.stage) * size_t(M) + size_t(m.mb)) * 2 + (m.fwd ? 1 : 0); };

  // Sends after each compute action, and each channel's messages in send order.
  std::vector<std::vector<std::vector<Msg>>> sends(size_t(in.pp));
  std::map<std::pair<int, int>, std::vector<Msg>> channel;  // (src rank, dst rank)
  // The consumer's compute index of every remote message (its natural RECV anchor).
  std::vector<int> consumer(size_t(in.n_stages) * size_t(M) * 2, -1);
  for (int r = 0; r < in.pp; ++r) {
    const auto& row = in.actions[size_t(r)];
    sends[size_t(r)].resize(row.size());
    for (size_t k = 0; k < row.size(); ++k) {
      Action h[2];
      const int nh = detail::halves(row[k], h);
      for (int q = 0; q < nh; ++q) {
        for (const Msg& m : detail::remote_outputs(in, h[q])) {
          sends[size_t(r)][k].push_back(m);
          channel[{r, in.stage_rank[size_t(m.dst_stage())]}].push_back(m);
        }
        for (const Msg& m : detail::remote_inputs(in, h[q])) consumer[cell(m)] = int(k);
      }
    }
  }

  // RECVs before each compute action, hoisted to keep every channel in send order.
  struct Recv {
    int src, seq;
    Msg msg;
  };
  std::vector<std::vector<std::vector<Recv>>> recvs(size_t(in.pp));
  for (int r = 0; r < in.pp; ++r) recvs[size_t(r)].resize(in.actions[size_t(r)].size());
  for (const auto& [pair, msgs] : channel) {
    int anchor = 1 << 30;
    for (int i = int(msgs.size()) - 1; i >= 0; --i) {
      const int c = consumer[cell(msgs[size_t(i)])];
      MT_CHECK(c >= 0, "schedule", "lower: internal error: ", to_string(detail::send_of(msgs[size_t(i)])),
               " has no consumer");
      anchor = std::min(anchor, c);
      recvs[size_t(pair.second)][size_t(anchor)].push_back({pair.first, i, msgs[size_t(i)]});
    }
  }

  Schedule out = in;
  out.lowered = true;
  for (int r = 0; r < in.pp; ++r) {
    const auto& row = in.actions[size_t(r)];
    auto& dst = out.actions[size_t(r)];
    dst.clear();
    for (size_t k = 0; k < row.size(); ++k) {
      auto& before = recvs[size_t(r)][k];
      std::sort(before.begin(), before.end(),
                [](const Recv& a, const Recv& b) { return a.src != b.src ? a.src < b.src : a.seq < b.seq; });
      for (const Recv& x : before) dst.push_back(detail::recv_of(x.msg));
      dst.push_back(row[k]);
      for (const Msg& m : sends[size_t(r)][k]) dst.push_back(detail::send_of(m));
    }
  }
  const Verdict v = detail::validate_structure(out);
  MT_CHECK(v.ok, "schedule", "lower: internal error, the lowered schedule '", in.name, "' is invalid: ", v.error);
  return out;
}

}  // namespace moetron::sched
