// test_pipeline_runtime.cpp: single-process tests of the pipeline runtime (src/comm/pipeline_runtime.h)
// with the toy chain of tests/unit/pipeline_toy.h: pp 1 schedules (one stage; and the V shapes zbv and
// dualpipev, whose two stages on one rank hand tensors over in memory and whose FB actions run both halves)
// must give bitwise the losses and weight gradients of the sequential run; activation slots and the rank's
// peak in-flight count against hand-derived numbers and simulate_timed; the step record; repeated steps
// without new allocations; a schedule that runs backwards out of micro-batch order; and the set-up refusals
// with their messages. The multi-rank runs are in tests/mpi/test_mpi_pipeline.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moetron/comm.h"
#include "moetron/memory.h"
#include "moetron/schedule.h"
#include "comm/pipeline_runtime.h"
#include "pipeline_toy.h"
#include "test_util.h"

using namespace moetron;
using moetron::testing::error_of;
using pp_toy::ToyStage;

namespace {

struct ToyRun {
  std::vector<std::unique_ptr<ToyStage>> own;
  std::vector<pipeline::PipelineStage*> ptrs;
  ToyRun(const pp_toy::Dims& d, ToyStage::Accum acc) {
    for (int s = 0; s < d.S; ++s) {
      own.push_back(std::make_unique<ToyStage>(d, s, acc));
      ptrs.push_back(own.back().get());
    }
  }
};

sched::Schedule gen(const std::string& name, int pp, int vpp, int m) { return sched::generate({name, pp, vpp, m}); }

void expect_bitwise(const pp_toy::Result& want, const ToyRun& run, const std::string& what) {
  const auto& last = *run.own.back();
  ASSERT_EQ(last.losses().size(), want.losses.size()) << what;
  EXPECT_EQ(0, std::memcmp(last.losses().data(), want.losses.data(), want.losses.size() * 4)) << what << ": losses";
  for (size_t s = 0; s < run.own.size(); ++s) {
    const auto& g = run.own[s]->grads();
    ASSERT_EQ(g.size(), want.grads[s].size()) << what;
    EXPECT_EQ(0, std::memcmp(g.data(), want.grads[s].data(), g.size() * 4)) << what << ": stage " << s << " grads";
  }
}

}  // namespace

TEST(PipelineToy, GradientsMatchFloat64FiniteDifferences) {
  // The oracle's own backward against central differences of an independent float64 forward.
  const pp_toy::Dims d = pp_toy::make_dims(3);
  const int M = 2;
  const pp_toy::Result r = pp_toy::sequential_reference(d, M);
  double loss = 0;
  for (float l : r.losses) loss += l;
  EXPECT_NEAR(loss, pp_toy::toy_loss_f64(d, M, -1, -1, 0), 1e-5 * std::max(1.0, loss));
  for (int s = 0; s < d.S; ++s) {
    const int64_t n = int64_t(r.grads[size_t(s)].size());
    for (int64_t i = 0; i < n; i += 3) {
      const double h = 1e-4;
      const double fd = (pp_toy::toy_loss_f64(d, M, s, i, h) - pp_toy::toy_loss_f64(d, M, s, i, -h)) / (2 * h);
      EXPECT_NEAR(r.grads[size_t(s)][size_t(i)], fd, 2e-4 + 1e-3 * std::abs(fd)) << "stage " << s << " param " << i;
    }
  }
}

TEST(PipelineRuntime, OneRankEqualsTheSequentialRunBitwise) {
  Comm c = comm_local();
  struct Case {
    const char* name;
    int vpp, m;
  };
  for (const Case k : {Case{"1f1b", 1, 1}, Case{"1f1b", 1, 4}, Case{"gpipe", 1, 3}, Case{"zb1p", 1, 3},
                       Case{"zbv", 2, 1}, Case{"zbv", 2, 3}, Case{"dualpipev", 2, 2}, Case{"dualpipev", 2, 5}}) {
    const sched::Schedule sc = gen(k.name, 1, k.vpp, k.m);
    const pp_toy::Dims d = pp_toy::make_dims(sc.n_stages);
    const pp_toy::Result want = pp_toy::sequential_reference(d, k.m);
    for (auto acc : {ToyStage::Accum::Direct, ToyStage::Accum::PerMicrobatch}) {
      const std::string what = std::string(k.name) + " m " + std::to_string(k.m) +
                               (acc == ToyStage::Accum::Direct ? " direct" : " per-mb");
      ToyRun run(d, acc);
      pipeline::PipelineRuntime rt(sc, run.ptrs, c);
      for (auto& st : run.own) EXPECT_TRUE(st->setup_info().weight_grads_in_mb_order) << what;
      const pipeline::StepStats ss = rt.run_step();
      for (auto& st : run.own) st->finish_step();
      expect_bitwise(want, run, what);
      EXPECT_EQ(ss.messages_sent, 0) << what;  // one rank: hand-overs in memory only
      EXPECT_EQ(c.pending_requests(), 0) << what;
    }
  }
}

TEST(PipelineRuntime, RunScheduleIsOneStep) {
  const sched::Schedule sc = gen("dualpipev", 1, 2, 3);
  const pp_toy::Dims d = pp_toy::make_dims(2, 2, 5);
  ToyRun run(d, ToyStage::Accum::Direct);
  std::vector<sched::TimedOp> rec;
  const pipeline::StepStats ss = pipeline::run_schedule(sc, run.ptrs, comm_local(), &rec);
  for (auto& st : run.own) st->finish_step();
  expect_bitwise(pp_toy::sequential_reference(d, 3), run, "run_schedule");
  EXPECT_EQ(rec.size(), sched::lower(sc).actions[0].size());
  EXPECT_GT(ss.compute_seconds, 0.0);
}

TEST(PipelineRuntime, SlotsArePeakInflightPerStage) {
  Comm c = comm_local();
  // GPipe runs every forward before any backward: all m micro-batches are held at once. 1F1B on one rank
  // alternates F and B: one. zbv on one rank, m = 3 (hand-traced from its list): see the simulator below.
  {
    const pp_toy::Dims d = pp_toy::make_dims(1);
    ToyRun run(d, ToyStage::Accum::Direct);
    pipeline::PipelineRuntime rt(gen("gpipe", 1, 1, 4), run.ptrs, c);
    EXPECT_EQ(rt.stage_slots(0), 4);
    EXPECT_EQ(rt.peak_inflight(), 4);
    EXPECT_EQ(run.own[0]->setup_info().slots, 4);
  }
  {
    const pp_toy::Dims d = pp_toy::make_dims(1);
    ToyRun run(d, ToyStage::Accum::Direct);
    pipeline::PipelineRuntime rt(gen("1f1b", 1, 1, 4), run.ptrs, c);
    EXPECT_EQ(rt.stage_slots(0), 1);
    EXPECT_EQ(rt.peak_inflight(), 1);
    EXPECT_NE(error_of([&] { (void)rt.stage_slots(1); }).find("stage 1 is not on rank 0"), std::string::npos);
  }
  for (const char* name : {"zbv", "dualpipev"}) {
    const sched::Schedule sc = gen(name, 1, 2, 4);
    const pp_toy::Dims d = pp_toy::make_dims(2);
    ToyRun run(d, ToyStage::Accum::Direct);
    pipeline::PipelineRuntime rt(sc, run.ptrs, c);
    const sched::TimedResult tr = sched::simulate_timed(sched::lower(sc), sched::Durations{});
    EXPECT_EQ(rt.peak_inflight(), tr.ranks[0].peak_inflight) << name;
    // Independent per-stage count straight from the compute list.
    for (int s = 0; s < 2; ++s) {
      int live = 0, peak = 0;
      for (const sched::Action& a : sc.actions[0]) {
        const sched::Action f = sched::fwd_half(a), b = sched::bwd_half(a);
        if (f.op == sched::Op::F && f.stage == s) peak = std::max(peak, ++live);
        if (a.op != sched::Op::F && (b.op == sched::Op::B || b.op == sched::Op::W) && b.stage == s) --live;
      }
      EXPECT_EQ(rt.stage_slots(s), peak) << name << " stage " << s;
      EXPECT_EQ(run.own[size_t(s)]->setup_info().slots, peak) << name << " stage " << s;
    }
  }
}

TEST(PipelineRuntime, RecordsEveryActionInOrder) {
  Comm c = comm_local();
  const sched::Schedule sc = sched::lower(gen("dualpipev", 1, 2, 4));
  const pp_toy::Dims d = pp_toy::make_dims(2);
  ToyRun run(d, ToyStage::Accum::Direct);
  pipeline::PipelineRuntime rt(sc, run.ptrs, c);
  std::vector<sched::TimedOp> rec;
  const pipeline::StepStats ss = rt.run_step(&rec);
  const auto& row = sc.actions[0];
  ASSERT_EQ(rec.size(), row.size());
  bool has_fb = false;
  for (size_t k = 0; k < rec.size(); ++k) {
    EXPECT_EQ(rec[k].rank, 0);
    EXPECT_EQ(rec[k].index, int(k));
    EXPECT_EQ(rec[k].action, row[k]) << k;
    EXPECT_LE(0.0, rec[k].start);
    EXPECT_LE(rec[k].start, rec[k].end);
    if (k) {
      EXPECT_LE(rec[k - 1].end, rec[k].start);
    }
    has_fb |= row[k].op == sched::Op::FB;
  }
  EXPECT_TRUE(has_fb);
  EXPECT_LE(rec.back().end, ss.seconds);
  EXPECT_LE(ss.compute_seconds, ss.seconds);
}

TEST(PipelineRuntime, RepeatedStepsReuseTheBuffers) {
  Comm c = comm_local();
  const sched::Schedule sc = gen("zbv", 1, 2, 5);
  const pp_toy::Dims d = pp_toy::make_dims(2, 4, 6);
  const pp_toy::Result want = pp_toy::sequential_reference(d, 5);
  ToyRun run(d, ToyStage::Accum::Direct);
  const int64_t before = MemoryTracker::global().current(MemCategory::Comm);
  pipeline::PipelineRuntime rt(sc, run.ptrs, c);
  EXPECT_GT(rt.buffer_bytes(), 0);  // the V's tip hands activations and gradients over in memory
  EXPECT_EQ(MemoryTracker::global().current(MemCategory::Comm) - before, rt.buffer_bytes());
  std::vector<sched::TimedOp> rec;
  for (int step = 0; step < 3; ++step) {
    for (auto& st : run.own) st->zero_grads();
    const int64_t mem = MemoryTracker::global().current(MemCategory::Comm);
    rt.run_step(&rec);
    EXPECT_EQ(MemoryTracker::global().current(MemCategory::Comm), mem) << "step " << step;
    for (auto& st : run.own) st->finish_step();
    expect_bitwise(want, run, "zbv step " + std::to_string(step));
  }
}

TEST(PipelineRuntime, BackwardsOutOfMicrobatchOrderNeedPerMicrobatchParts) {
  // A valid hand-written schedule that runs the backwards in reverse micro-batch order: the runtime says so,
  // and per-micro-batch parts summed in micro-batch order still give the sequential run's bits.
  Comm c = comm_local();
  const sched::Schedule sc = sched::from_csv("0F0,1F0,0F1,1F1,0F2,1F2,1B2,0B2,1B1,0B1,1B0,0B0\n");
  ASSERT_EQ(sc.n_stages, 2);
  const pp_toy::Dims d = pp_toy::make_dims(2);
  const pp_toy::Result want = pp_toy::sequential_reference(d, 3);
  ToyRun run(d, ToyStage::Accum::PerMicrobatch);
  pipeline::PipelineRuntime rt(sc, run.ptrs, c);
  for (auto& st : run.own) {
    EXPECT_FALSE(st->setup_info().weight_grads_in_mb_order);
    EXPECT_EQ(st->setup_info().weight_grad_order, (std::vector<int>{2, 1, 0}));
  }
  EXPECT_EQ(rt.stage_slots(0), 3);
  rt.run_step();
  for (auto& st : run.own) st->finish_step();
  expect_bitwise(want, run, "reverse backwards");
}

TEST(PipelineRuntime, SetupRefusalsNameTheProblem) {
  Comm c = comm_local();
  const pp_toy::Dims d2 = pp_toy::make_dims(2);
  {  // stage 1 takes fewer floats than stage 0 produces (the V's two stages on this rank)
    ToyRun run(d2, ToyStage::Accum::Direct);
    run.own[1]->in_size_override = d2.out(0) - 3;
    const std::string e = error_of([&] { pipeline::PipelineRuntime rt(gen("zbv", 1, 2, 2), run.ptrs, c); });
    EXPECT_NE(e.find("stage output size mismatch: stage 0 (rank 0) produces " + std::to_string(d2.out(0)) +
                     " floats per micro-batch but stage 1 (rank 0) takes " + std::to_string(d2.out(0) - 3)),
              std::string::npos)
        << e;
  }
  {  // a schedule for two ranks on a one-rank communicator
    ToyRun run(d2, ToyStage::Accum::Direct);
    const std::string e = error_of([&] { pipeline::PipelineRuntime rt(gen("1f1b", 2, 1, 2), run.ptrs, c); });
    EXPECT_NE(e.find("schedule '1f1b' is for pp = 2 ranks but the pipeline communicator has 1 rank(s)"),
              std::string::npos)
        << e;
  }
  {  // one stage object for a rank that holds two stages
    ToyRun run(d2, ToyStage::Accum::Direct);
    run.ptrs.pop_back();
    const std::string e = error_of([&] { pipeline::PipelineRuntime rt(gen("zbv", 1, 2, 2), run.ptrs, c); });
    EXPECT_NE(e.find("places 2 stage(s) on this rank (0, 1) but 1 PipelineStage object(s) were given"),
              std::string::npos)
        << e;
  }
  {  // split backward asked of a stage without it
    ToyRun run(d2, ToyStage::Accum::Direct);
    run.own[1]->split_supported = false;
    const std::string e = error_of([&] { pipeline::PipelineRuntime rt(gen("zbv", 1, 2, 2), run.ptrs, c); });
    EXPECT_NE(e.find("stage 1: schedule 'zbv' splits the backward into I and W"), std::string::npos) << e;
  }
  {  // the first stage must fetch its own input
    const pp_toy::Dims d1 = pp_toy::make_dims(1);
    ToyRun run(d1, ToyStage::Accum::Direct);
    run.own[0]->in_size_override = 5;
    const std::string e = error_of([&] { pipeline::PipelineRuntime rt(gen("1f1b", 1, 1, 2), run.ptrs, c); });
    EXPECT_NE(e.find("stage 0 is the first stage: in_size must be 0 (it fetches its own input), got 5"),
              std::string::npos)
        << e;
  }
  {  // an invalid schedule: the validator's message
    ToyRun run(d2, ToyStage::Accum::Direct);
    const std::string e = error_of([&] {
      pipeline::PipelineRuntime rt(sched::from_csv("0F0,1F0,0B0,1B0\n"), run.ptrs, c);
    });
    EXPECT_NE(e.find("'0B0': no"), std::string::npos) << e;
  }
  {  // a bad tag
    ToyRun run(d2, ToyStage::Accum::Direct);
    pipeline::RuntimeOptions o;
    o.tag = kCommMaxUserTag + 1;
    const std::string e = error_of([&] { pipeline::PipelineRuntime rt(gen("zbv", 1, 2, 2), run.ptrs, c, o); });
    EXPECT_NE(e.find("RuntimeOptions::tag = 30000"), std::string::npos) << e;
  }
}
