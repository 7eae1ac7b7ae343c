// test_mpi_pipeline.cpp: the pipeline runtime (src/comm/pipeline_runtime.h) under mpirun with pp = the
// world size (2 and 4): every generator (gpipe, 1f1b, interleaved_1f1b with 2 and 3 stages per rank, zb1p,
// zbv, dualpipev) at several micro-batch counts runs the toy chain of tests/unit/pipeline_toy.h; the losses
// and every stage's weight gradients are gathered to rank 0 and compared with memcmp against the
// single-process sequential run. Also: per-micro-batch accumulation, messages past the eager limit, repeated
// steps, the step record and the communicator's byte counts, the 1F1B slot counts (pp - r on rank r), and the
// collective set-up refusals (wrong pp, a size mismatch between ranks, different schedules on different
// ranks), which every rank must report instead of hanging.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../unit/pipeline_toy.h"
#include "moetron/comm.h"
#include "moetron/memory.h"
#include "moetron/schedule.h"
#include "comm/pipeline_runtime.h"

using namespace moetron;
using pp_toy::ToyStage;

namespace {

Comm& world() {
  static Comm w = comm_world();
  return w;
}

// "interleaved_1f1b+ep_overlap": the interleaved schedule with its steady-state pairs fused into FB actions.
sched::Schedule gen(const std::string& name, int pp, int vpp, int m) {
  const bool ov = name == "interleaved_1f1b+ep_overlap";
  sched::GenSpec g{ov ? "interleaved_1f1b" : name, pp, vpp, m};
  g.ep_overlap = ov;
  return sched::generate(g);
}

std::string error_of_setup(const sched::Schedule& sc, std::vector<pipeline::PipelineStage*> st, const Comm& c) {
  try {
    pipeline::PipelineRuntime rt(sc, std::move(st), c);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// This rank's toy stages for a schedule.
struct Local {
  std::vector<std::unique_ptr<ToyStage>> own;
  std::vector<pipeline::PipelineStage*> ptrs;
  Local(const sched::Schedule& sc, const pp_toy::Dims& d, int me, ToyStage::Accum acc) {
    for (int s = 0; s < sc.n_stages; ++s)
      if (sc.stage_rank[size_t(s)] == me) {
        own.push_back(std::make_unique<ToyStage>(d, s, acc));
        ptrs.push_back(own.back().get());
      }
  }
};

// Gathers every stage's gradients (and the last stage's losses) to rank 0 and compares them there, bitwise,
// with the sequential run. Collective.
void gather_and_compare(const Comm& c, const sched::Schedule& sc, const pp_toy::Dims& d, const Local& loc,
                        const std::string& what) {
  const int p = c.size(), me = c.rank(), S = sc.n_stages, M = sc.n_microbatches;
  auto stage_floats = [&](int s) {
    const int64_t n = int64_t(d.width[size_t(s)] + 1) * d.width[size_t(s + 1)];
    return n + (s == S - 1 ? M : 0);
  };
  std::vector<int64_t> counts(size_t(p), 0), displs(size_t(p), 0);
  for (int s = 0; s < S; ++s) counts[size_t(sc.stage_rank[size_t(s)])] += stage_floats(s) * 4;
  for (int q = 1; q < p; ++q) displs[size_t(q)] = displs[size_t(q - 1)] + counts[size_t(q - 1)];
  std::vector<float> mine;
  for (const auto& st : loc.own) {  // ascending stage ids
    mine.insert(mine.end(), st->grads().begin(), st->grads().end());
    if (st->stage() == S - 1) mine.insert(mine.end(), st->losses().begin(), st->losses().end());
  }
  ASSERT_EQ(int64_t(mine.size()) * 4, counts[size_t(me)]) << what;
  std::vector<float> all(size_t((displs[size_t(p - 1)] + counts[size_t(p - 1)]) / 4));
  c.all_gather_v(all.data(), counts.data(), displs.data(), mine.data());
  if (me != 0) return;
  const pp_toy::Result want = pp_toy::sequential_reference(d, M);
  std::vector<int64_t> at(static_cast<size_t>(p));
  for (int q = 0; q < p; ++q) at[size_t(q)] = displs[size_t(q)] / 4;
  for (int s = 0; s < S; ++s) {
    const int r = sc.stage_rank[size_t(s)];
    const float* g = all.data() + at[size_t(r)];
    const auto& wg = want.grads[size_t(s)];
    EXPECT_EQ(0, std::memcmp(g, wg.data(), wg.size() * 4)) << what << ": stage " << s << " (rank " << r << ") grads";
    at[size_t(r)] += int64_t(wg.size());
    if (s == S - 1) {
      EXPECT_EQ(0, std::memcmp(all.data() + at[size_t(r)], want.losses.data(), size_t(M) * 4)) << what << ": losses";
      at[size_t(r)] += M;
    }
  }
}

struct Case {
  const char* name;
  int vpp;
  std::vector<int> m;  // as multiples of pp, plus offsets: m = a * pp + b
  std::vector<int> add;
};

}  // namespace

TEST(MpiPipeline, EveryGeneratorEqualsTheSequentialRunBitwise) {
  Comm& c = world();
  const int pp = c.size(), me = c.rank();
  const Case cases[] = {
      {"gpipe", 1, {0, 1, 2}, {1, 0, 1}},  {"1f1b", 1, {1, 2}, {0, 1}},       {"interleaved_1f1b", 2, {1, 2}, {0, 0}},
      {"interleaved_1f1b", 3, {2}, {0}},  {"zb1p", 1, {1, 2}, {0, 1}},        {"zbv", 2, {0, 1, 2}, {1, 0, 1}},
      {"dualpipev", 2, {2, 2}, {0, 2}},   {"interleaved_1f1b+ep_overlap", 2, {1, 2}, {0, 0}},
  };
  for (const Case& k : cases)
    for (size_t i = 0; i < k.m.size(); ++i) {
      const int M = k.m[i] * pp + k.add[i];
      const sched::Schedule sc = sched::lower(gen(k.name, pp, k.vpp, M));
      const pp_toy::Dims d = pp_toy::make_dims(sc.n_stages);
      for (auto acc : {ToyStage::Accum::Direct, ToyStage::Accum::PerMicrobatch}) {
        const std::string what = std::string(k.name) + " pp " + std::to_string(pp) + " vpp " + std::to_string(k.vpp) +
                                 " m " + std::to_string(M) + (acc == ToyStage::Accum::Direct ? " direct" : " per-mb");
        Local loc(sc, d, me, acc);
        pipeline::PipelineRuntime rt(sc, loc.ptrs, c);
        for (const auto& st : loc.own) EXPECT_TRUE(st->setup_info().weight_grads_in_mb_order) << what;
        // The runtime's rank peak is the simulator's.
        const sched::TimedResult tr = sched::simulate_timed(sc, sched::Durations{});
        EXPECT_EQ(rt.peak_inflight(), tr.ranks[size_t(me)].peak_inflight) << what;
        c.reset_stats();
        std::vector<sched::TimedOp> rec;
        const pipeline::StepStats ss = rt.run_step(&rec);
        for (auto& st : loc.own) st->finish_step();
        gather_and_compare(c, sc, d, loc, what);
        // The record: every action of this rank's list, in order.
        const auto& row = sc.actions[size_t(me)];
        ASSERT_EQ(rec.size(), row.size()) << what;
        int64_t sends = 0, recvs = 0;
        for (size_t j = 0; j < row.size(); ++j) {
          ASSERT_EQ(rec[j].action, row[j]) << what << " action " << j;
          ASSERT_EQ(rec[j].index, int(j));
          ASSERT_EQ(rec[j].rank, me);
          ASSERT_LE(rec[j].start, rec[j].end);
          sends += row[j].op == sched::Op::SEND_F || row[j].op == sched::Op::SEND_B;
          recvs += row[j].op == sched::Op::RECV_F || row[j].op == sched::Op::RECV_B;
        }
        // One message per SEND / RECV; the communicator counted exactly the runtime's bytes.
        EXPECT_EQ(ss.messages_sent, sends) << what;
        EXPECT_EQ(ss.messages_received, recvs) << what;
        const CommStats cs = c.stats();
        EXPECT_EQ(cs[CommOp::Send].calls, sends) << what;
        EXPECT_EQ(cs[CommOp::Send].bytes, ss.bytes_sent) << what;
        EXPECT_EQ(cs[CommOp::Recv].bytes, ss.bytes_received) << what;
        EXPECT_EQ(c.pending_requests(), 0) << what;
      }
    }
}

TEST(MpiPipeline, LargeMessagesAndRepeatedSteps) {
  // Activations of 64 x 100 floats (25.6 KB, past the shared-memory eager limit), three steps on one runtime:
  // each step must again give the sequential run's bits, with no new allocation.
  Comm& c = world();
  const int pp = c.size(), me = c.rank();
  for (const char* name : {"1f1b", "zbv", "dualpipev"}) {
    const int vpp = std::string(name) == "1f1b" ? 1 : 2;
    const sched::Schedule sc = sched::lower(gen(name, pp, vpp, 2 * pp + 2));
    const pp_toy::Dims d = pp_toy::make_dims(sc.n_stages, 64, 98);
    Local loc(sc, d, me, ToyStage::Accum::Direct);
    pipeline::PipelineRuntime rt(sc, loc.ptrs, c);
    const int64_t mem = MemoryTracker::global().current(MemCategory::Comm);
    for (int step = 0; step < 3; ++step) {
      for (auto& st : loc.own) st->zero_grads();
      rt.run_step();
      for (auto& st : loc.own) st->finish_step();
      EXPECT_EQ(MemoryTracker::global().current(MemCategory::Comm), mem) << name << " step " << step;
      gather_and_compare(c, sc, d, loc, std::string(name) + " large, step " + std::to_string(step));
    }
  }
}

TEST(MpiPipeline, OneFOneBSlotsArePpMinusRank) {
  Comm& c = world();
  const int pp = c.size(), me = c.rank();
  const sched::Schedule sc = gen("1f1b", pp, 1, 3 * pp);
  const pp_toy::Dims d = pp_toy::make_dims(pp);
  Local loc(sc, d, me, ToyStage::Accum::Direct);
  pipeline::PipelineRuntime rt(sc, loc.ptrs, c);  // compute-only: lowered by the runtime
  EXPECT_TRUE(rt.schedule().lowered);
  EXPECT_EQ(rt.stage_slots(me), pp - me);
  EXPECT_EQ(loc.own[0]->setup_info().slots, pp - me);
  rt.run_step();
  for (auto& st : loc.own) st->finish_step();
  gather_and_compare(c, sc, d, loc, "1f1b m 3pp");
  // Send buffers are reused once the peer is known to have received them, so 1F1B's buffers do not grow with
  // the micro-batch count; GPipe, which sends every forward before any backward comes back, needs one per
  // micro-batch on rank 0.
  auto bytes = [&](const char* name, int m) {
    const sched::Schedule s2 = gen(name, pp, 1, m);
    Local l2(s2, d, me, ToyStage::Accum::Direct);
    pipeline::PipelineRuntime r2(s2, l2.ptrs, c);
    return r2.buffer_bytes();
  };
  EXPECT_EQ(bytes("1f1b", 2 * pp), bytes("1f1b", 6 * pp));
  const int64_t stride = (16 + (d.out(0) + 15) / 16 * 16) * 4;  // header + payload, 64-byte multiple
  if (me == 0) {
    // Rank 0 (stage 0) holds activation send buffers and one gradient-in buffer.
    EXPECT_EQ(bytes("gpipe", 2 * pp), (2 * pp + 1) * stride);
    EXPECT_EQ(bytes("gpipe", 6 * pp), (6 * pp + 1) * stride);
    EXPECT_LT(bytes("1f1b", 6 * pp), (pp + 2) * stride);
  } else {
    (void)bytes("gpipe", 2 * pp);
    (void)bytes("gpipe", 6 * pp);
    (void)bytes("1f1b", 6 * pp);
  }
}

TEST(MpiPipeline, SetupRefusalsReachEveryRank) {
  Comm& c = world();
  const int pp = c.size(), me = c.rank();
  {  // a schedule for another number of ranks
    const sched::Schedule sc = gen("1f1b", 2 * pp, 1, 2 * pp);
    const pp_toy::Dims d = pp_toy::make_dims(sc.n_stages);
    Local loc(sc, d, me, ToyStage::Accum::Direct);
    const std::string e = error_of_setup(sc, loc.ptrs, c);
    EXPECT_NE(e.find("schedule '1f1b' is for pp = " + std::to_string(2 * pp) +
                     " ranks but the pipeline communicator has " + std::to_string(pp) + " rank(s)"),
              std::string::npos)
        << e;
  }
  {  // stage 1 (on rank 1) takes 2 floats fewer than stage 0 (rank 0) produces: every rank says so
    const sched::Schedule sc = gen("1f1b", pp, 1, pp);
    const pp_toy::Dims d = pp_toy::make_dims(pp);
    Local loc(sc, d, me, ToyStage::Accum::Direct);
    if (me == 1) loc.own[0]->in_size_override = d.in(1) - 2;
    const std::string e = error_of_setup(sc, loc.ptrs, c);
    EXPECT_NE(e.find("stage output size mismatch: stage 0 (rank 0) produces " + std::to_string(d.out(0)) +
                     " floats per micro-batch but stage 1 (rank 1) takes " + std::to_string(d.in(1) - 2)),
              std::string::npos)
        << e;
  }
  {  // rank 0 is given 1f1b, the others gpipe
    const sched::Schedule sc = gen(me == 0 ? "1f1b" : "gpipe", pp, 1, 2 * pp);
    const pp_toy::Dims d = pp_toy::make_dims(pp);
    Local loc(sc, d, me, ToyStage::Accum::Direct);
    const std::string e = error_of_setup(sc, loc.ptrs, c);
    EXPECT_NE(e.find("runs a different schedule than rank 0"), std::string::npos) << e;
  }
  {  // a local refusal on the last rank (its stage is missing): it names it, the others point at it
    const sched::Schedule sc = gen("1f1b", pp, 1, pp);
    const pp_toy::Dims d = pp_toy::make_dims(pp);
    Local loc(sc, d, me, ToyStage::Accum::Direct);
    if (me == pp - 1) loc.ptrs.clear();
    const std::string e = error_of_setup(sc, loc.ptrs, c);
    if (me == pp - 1)
      EXPECT_NE(e.find("rank " + std::to_string(me) + ": schedule '1f1b' places 1 stage(s) on this rank (" +
                       std::to_string(me) + ") but 0 PipelineStage object(s) were given"),
                std::string::npos)
          << e;
    else
      EXPECT_NE(e.find("set-up failed on rank " + std::to_string(pp - 1) + " (see that rank's error)"),
                std::string::npos)
          << e;
  }
  c.barrier();
}

TEST(MpiPipeline, ForeignMessageOnTheTagIsAnError) {
  // Rank 0 does not run its list but sends rank 1 a message of the right size on the pipeline tag that is not
  // a pipeline message: rank 1's first action (RECV_F of mb 0) reports it instead of using the data.
  Comm& c = world();
  const int pp = c.size(), me = c.rank();
  const sched::Schedule sc = sched::lower(gen("1f1b", pp, 1, pp));
  const pp_toy::Dims d = pp_toy::make_dims(pp);
  Local loc(sc, d, me, ToyStage::Accum::Direct);
  pipeline::PipelineRuntime rt(sc, loc.ptrs, c);
  ASSERT_EQ(sc.actions[1][0], (sched::Action{sched::Op::RECV_F, 1, 0}));
  const int64_t bytes = (16 + d.out(0)) * 4;
  if (me == 0) {
    std::vector<float> junk(size_t(bytes / 4), 0.5f);
    c.send(junk.data(), bytes, 1, pipeline::kPipelineTag);
  } else if (me == 1) {
    std::string e;
    try {
      rt.run_step();
    } catch (const Error& x) {
      e = x.what();
    }
    EXPECT_NE(e.find("rank 1, action 0 '1RECV_F0': received a foreign message from rank 0, expected stage 0's "
                     "activation of mb 0 (" + std::to_string(d.out(0)) + " floats, step 1)"),
              std::string::npos)
        << e;
  }
  c.barrier();
}
