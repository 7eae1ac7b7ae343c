// pipeline_executor.cpp: PipelineExecutor (see pipeline_executor.h).
#include "train/pipeline_executor.h"

#include "moetron/check.h"
#include "moetron/trace.h"

namespace moetron {

PipelineExecutor::PipelineExecutor(PipelinePlan& plan, const Comm& pp, int64_t act_floats) {
  M_ = plan.lowered.n_microbatches;
  std::vector<pipeline::PipelineStage*> ptrs;
  for (size_t k = 0; k < plan.parts.size(); ++k) {
    stages_.push_back(std::make_unique<ModelStage>(int(k), plan.parts[k], act_floats));
    ptrs.push_back(stages_.back().get());
  }
  rt_ = std::make_unique<pipeline::PipelineRuntime>(plan.lowered, ptrs, pp);
  for (size_t k = 0; k < plan.parts.size(); ++k) plan.parts[k].slots = stages_[k]->slots();
  data_.tokens.resize(size_t(M_)), data_.targets.resize(size_t(M_));
  stats_.resize(size_t(M_));
}

void PipelineExecutor::bind(Model& m) {
  MT_CHECK(m.n_stages() == int(stages_.size()), "pipeline", "the model holds ", m.n_stages(), " stages, the plan ",
           stages_.size());
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
  out.runtime = rt_->run_step(record ? &out.record : nullptr);
  out.micro = stats_;
  return out;
}

}  // namespace moetron
