// pipeline_executor.cpp: PipelineExecutor (see pipeline_executor.h).
#include "train/pipeline_executor.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "moetron/check.h"
#include "moetron/runtime.h"
#include "moetron/trace.h"

namespace moetron {

// One persistent thread that runs a task at a time as the model's lane 1 (it keeps its OpenMP team between
// tasks). run() hands it `task`, runs `here` on the calling thread meanwhile, waits, and rethrows either error.
struct PipelineExecutor::Worker {
  std::mutex mu;
  std::condition_variable cv;
  const std::function<void()>* task = nullptr;
  bool quit = false, done = false;
  std::exception_ptr err;
  std::thread th;
  Worker() {
    const int nt = num_threads();  // this (main) thread's OpenMP team size: the model's workspaces are sized for it
    th = std::thread([this, nt] {
      init_threads(nt);
      Model::set_thread_lane(1);
      trace::set_thread_track(2);  // the EP overlap's second lane (docs/profiling.md)
      std::unique_lock<std::mutex> lk(mu);
      for (;;) {
        cv.wait(lk, [this] { return quit || task != nullptr; });
        if (quit) return;
        const std::function<void()>* t = task;
        lk.unlock();
        std::exception_ptr e;
        try {
          (*t)();
        } catch (...) {
          e = std::current_exception();
        }
        lk.lock();
        err = e, task = nullptr, done = true;
        cv.notify_all();
      }
    });
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lk(mu);
      quit = true;
    }
    cv.notify_all();
    th.join();
  }
  void run(const std::function<void()>& here, const std::function<void()>& there) {
    {
      std::lock_guard<std::mutex> lk(mu);
      task = &there, done = false, err = nullptr;
    }
    cv.notify_all();
    std::exception_ptr mine;
    try {
      here();
    } catch (...) {
      mine = std::current_exception();
    }
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [this] { return done; });
    if (mine) std::rethrow_exception(mine);
    if (err) std::rethrow_exception(err);
  }
};

PipelineExecutor::PipelineExecutor(PipelinePlan& plan, const Comm& pp, int64_t act_floats, bool ep_overlap,
                                   const std::string& pair) {
  M_ = plan.lowered.n_microbatches;
  std::vector<pipeline::PipelineStage*> ptrs;
  for (size_t k = 0; k < plan.parts.size(); ++k) {
    stages_.push_back(std::make_unique<ModelStage>(int(k), plan.parts[k], act_floats));
    ptrs.push_back(stages_.back().get());
  }
  pipeline::RuntimeOptions ro;
  if (ep_overlap) {
    // parallelism.ep_pair_backward: how a fused pair's backward half runs: b (one full backward, layer by layer),
    // iw (input half, then weight half; RuntimeOptions::fb_backward_split; measured no better on the emulated
    // hosts, docs/benchmarks.md), iwfill (iw whose weight gradients also run early, while the backward lane waits in
    // an exchange and the other lane does not compute: Model::set_ep_wgrad_fill), iwcarry (every backward's weight
    // half carried into later exchange waits, on either lane) or auto (the default: iwcarry where the model can
    // fill, i.e. free lane order and no [quantize], else b; decided in bind()).
    MT_CHECK(pair == "auto" || pair == "b" || pair == "iw" || pair == "iwfill" || pair == "iwcarry", "pipeline",
             "parallelism.ep_pair_backward = ", pair, ": expected auto, b, iw, iwfill or iwcarry");
    ro.fb_backward_split = pair != "b";
    pair_auto_ = pair == "auto";
    wgrad_fill_ = pair == "iwfill" || pair == "iwcarry" || pair_auto_;  // told to the model in bind()
    wgrad_carry_ = pair == "iwcarry" || pair_auto_;
    worker_ = std::make_unique<Worker>();
    ro.run_fb = [this](const std::function<void()>& f, const std::function<void()>& b) {
      model_->begin_overlap_pair();
      try {
        worker_->run(f, b);
      } catch (...) {
        model_->end_overlap_pair();
        throw;
      }
      model_->end_overlap_pair();
    };
  }
  rt_ = std::make_unique<pipeline::PipelineRuntime>(plan.lowered, ptrs, pp, ro);
  for (size_t k = 0; k < plan.parts.size(); ++k) plan.parts[k].slots = stages_[k]->slots();
  data_.tokens.resize(size_t(M_)), data_.targets.resize(size_t(M_));
  stats_.resize(size_t(M_));
}

PipelineExecutor::~PipelineExecutor() = default;

void PipelineExecutor::bind(Model& m) {
  MT_CHECK(m.n_stages() == int(stages_.size()), "pipeline", "the model holds ", m.n_stages(), " stages, the plan ",
           stages_.size());
  model_ = &m;
  if (pair_auto_ && !m.ep_wgrad_fill_possible()) {  // auto: one full backward where the fill cannot run
    wgrad_fill_ = wgrad_carry_ = false;
    rt_->set_fb_backward_split(false);
  }
  m.set_ep_wgrad_fill(wgrad_fill_, wgrad_carry_);
  for (auto& s : stages_) s->bind(&m, &data_, &stats_);
}

StepOutcome PipelineExecutor::run(BatchSource& src, int64_t B, int64_t T, bool record, std::vector<uint64_t>* seqs) {
  {
    MT_TRACE("data");
    for (int mb = 0; mb < M_; ++mb) {
      auto& in = data_.tokens[size_t(mb)];
      auto& tg = data_.targets[size_t(mb)];
      in.resize(size_t(B * T)), tg.resize(size_t(B * T));
      src.next(in.data(), tg.data());
      if (seqs)
        for (int64_t r = 0; r < B; ++r)
          seqs->push_back(fnv1a(tg.data() + r * T, size_t(T) * 4, fnv1a(in.data() + r * T, size_t(T) * 4)));
    }
  }
  for (auto& s : stats_) s = MicroStats{};
  StepOutcome out;
  const bool tracing = trace::enabled();
  out.runtime = rt_->run_step(record || tracing ? &out.record : nullptr);
  if (wgrad_carry_) {  // the last pair's weight half, carried with no pair after it (timed as the step's compute)
    const auto t0 = std::chrono::steady_clock::now();
    model_->flush_carried_wgrads();
    out.runtime.compute_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  out.micro = stats_;
  if (tracing) trace_actions(out.record);
  return out;
}

// The executed compute actions as trace events (after the step: the runtime timed them), on track 0 where the
// runtime ran them; an FB action's backward half may have run on the second lane meanwhile.
void PipelineExecutor::trace_actions(const std::vector<sched::TimedOp>& ops) const {
  const double base = rt_->step_start() * 1e6;
  const std::vector<int>& mine = rt_->stage_ids();
  auto chunk = [&](int stage) { return int(std::find(mine.begin(), mine.end(), stage) - mine.begin()); };
  for (const sched::TimedOp& op : ops) {
    const sched::Action& a = op.action;
    if (!sched::is_compute(a.op)) continue;  // SEND / RECV: their communication events say it
    trace::ActionEvent e;
    e.name = a.op == sched::Op::F ? "F" : a.op == sched::Op::B ? "B" : a.op == sched::Op::I ? "I"
           : a.op == sched::Op::W ? "W" : "FB";
    e.t0 = base + op.start * 1e6, e.t1 = base + op.end * 1e6;
    e.mb = a.mb, e.stage = a.stage, e.chunk = chunk(a.stage);
    if (a.op == sched::Op::FB) e.op2 = a.op2 == sched::Op::I ? "I" : "B", e.mb2 = a.mb2, e.stage2 = a.stage2;
    trace::record_action(e);
  }
}

sched::RecordedStep PipelineExecutor::gather_record(int64_t step, const StepOutcome& o, const Comm& pp) const {
  // Per rank: [step start (absolute), then (index, start, end) per op].
  std::vector<double> mine = {rt_->step_start()};
  for (const sched::TimedOp& op : o.record) mine.insert(mine.end(), {double(op.index), op.start, op.end});
  const int P = pp.size();
  std::vector<int64_t> counts(static_cast<size_t>(P)), displs(static_cast<size_t>(P), 0);
  const int64_t my_bytes = int64_t(mine.size()) * 8;
  pp.all_gather(counts.data(), &my_bytes, 8);
  for (int r = 1; r < P; ++r) displs[size_t(r)] = displs[size_t(r - 1)] + counts[size_t(r - 1)];
  std::vector<double> all(size_t((displs[size_t(P - 1)] + counts[size_t(P - 1)]) / 8));
  pp.all_gather_v(all.data(), counts.data(), displs.data(), mine.data());
  double origin = 0;
  for (int r = 0; r < P; ++r) origin = r == 0 ? all[0] : std::min(origin, all[size_t(displs[size_t(r)] / 8)]);
  sched::RecordedStep st;
  st.step = step;
  const sched::Schedule& s = rt_->schedule();
  for (int r = 0; r < P; ++r) {
    const size_t a = size_t(displs[size_t(r)] / 8), n = size_t(counts[size_t(r)] / 8);
    const double shift = all[a] - origin;
    for (size_t k = a + 1; k + 3 <= a + n; k += 3) {
      sched::TimedOp op;
      op.rank = r, op.index = int(all[k]), op.start = all[k + 1] + shift, op.end = all[k + 2] + shift;
      op.action = s.actions[size_t(r)][size_t(op.index)];
      st.ops.push_back(op);
    }
  }
  return st;
}

}  // namespace moetron
