// cost_format.cpp: the step-time projection's printed forms (plan/cost.h): the JSON object `plan time --json` writes
// and the text table. Not the projection itself (cost.cpp).
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moetron/plan/cost.h"

namespace moetron::plan {

nlohmann::json to_json(const TimePlan& t) {
  nlohmann::json j;
  j["layout"] = t.layout.describe();
  j["hardware"] = t.hardware;
  j["step_time_s"] = t.step_time;
  j["tokens_per_s_per_gpu"] = t.tokens_per_s_per_gpu;
  j["tflops_per_gpu"] = t.tflops_per_gpu;
  j["mfu"] = t.mfu;
  j["bubble_ratio"] = t.bubble_ratio;
  j["carry_w"] = t.carry_w;
  j["pipeline_time_s"] = t.pipeline_time;
  j["dp_exposed_s"] = t.dp_exposed;
  j["dp_total_s"] = t.dp_total;
  j["optimizer_s"] = t.optimizer;
  j["weight_refresh_s"] = t.weight_refresh;
  if (t.simulated)
    for (int k = 0; k < kNumPlanOps; ++k)
      j["ops"][plan_op_name(k)] = {{"fwd_s", t.ops_f[size_t(k)]}, {"bwd_s", t.ops_b[size_t(k)]}};
  j["tokens_per_step"] = t.tokens_per_step;
  j["simulated"] = t.simulated;
  j["simulated_microbatches"] = t.simulated_microbatches;
  j["breakdown"] = t.breakdown;
  for (const auto& s : t.stages) {
    nlohmann::json x = {{"f_s", s.f}, {"i_s", s.i}, {"w_s", s.w}, {"a2a_f_s", s.a2a_f}, {"a2a_b_s", s.a2a_b}};
    if (t.layout.ep_overlap_split)  // the chunk as two half micro-batches, both halves summed
      x.update({{"f2_s", s.f2}, {"i2_s", s.i2}, {"w2_s", s.w2}, {"a2a_f2_s", s.a2a_f2}, {"a2a_b2_s", s.a2a_b2},
                {"n_a2a", s.n_a2a}});
    j["stages"].push_back(x);
  }
  return j;
}

std::string format_time(const TimePlan& t) {
  std::ostringstream os;
  char buf[256];
  os << "layout   " << t.layout.describe() << "\nhardware " << t.hardware << "\n";
  std::snprintf(buf, sizeof buf,
                "step %.3f s   %.0f tokens/s/GPU   %.1f TFLOPS/GPU   MFU %.1f%%   bubble %.1f%%\n", t.step_time,
                t.tokens_per_s_per_gpu, t.tflops_per_gpu, 100 * t.mfu, 100 * t.bubble_ratio);
  os << buf;
  if (t.carry_w)
    os << "weight gradients of the unpaired backwards carried into later exchange waits (the engine's iwcarry)\n";
  os << "breakdown (s per step):\n";
  for (const auto& [k, v] : t.breakdown) {
    std::snprintf(buf, sizeof buf, "  %-22s %10.4f  %5.1f%%\n", k.c_str(), v, 100 * v / t.step_time);
    os << buf;
  }
  return os.str();
}

}  // namespace moetron::plan
