// test_layout.cpp: the planner's layout rules (plan/layout.h): every broken rule is named by its key, and a
// config's [parallelism] keys with a world give the planner's dp and micro-batches.
#include <gtest/gtest.h>

#include <functional>

#include "moetron/check.h"
#include "moetron/plan/layout.h"

using namespace moetron;

namespace {
JobConfig cfg(const std::string& name, std::vector<std::string> ov = {}) {
  return load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/" + name + ".toml", ov);
}
std::string fail_msg(const JobConfig& c, int64_t world) {
  try {
    plan::layout_from_config(c, world);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(PlanLayout, FromConfigTakesDpFromTheWorld) {
  // moe_1t at the seeds' 768-GPU layout: pp 24, ep 8, cp 2 -> dp 16; 512 sequences of mbs 1 -> 32 micro-batches.
  auto c = cfg("moe_1t", {"--parallelism.pp=24", "--parallelism.ep=8", "--parallelism.cp=2"});
  auto l = plan::layout_from_config(c, 768);
  EXPECT_EQ(l.dp, 16);
  EXPECT_EQ(l.microbatches, 512 / 16);
  EXPECT_EQ(l.edp(), 2 * 16 / 8);
  EXPECT_EQ(l.world(), 768);
}

TEST(PlanLayout, ImpossibleLayoutsNameTheirRule) {
  auto c = cfg("deepseek_v3");
  EXPECT_NE(fail_msg(cfg("deepseek_v3", {"--parallelism.pp=16"}), 1000).find("not a multiple"), std::string::npos)
      << "world vs layout";
  // tp not dividing the heads, ep not dividing the experts, cp not dividing the sequence
  auto l = plan::layout_from_config(c, 64);
  l.tp = 3;
  EXPECT_NE(plan::layout_error(c, l, 64).find("parallelism.tp = 3: must divide model.n_heads"), std::string::npos);
  l.tp = 1, l.ep = 7;
  EXPECT_NE(plan::layout_error(c, l, 64).find("parallelism.ep = 7: must divide model.n_routed_experts"),
            std::string::npos);
  l.ep = 1, l.cp = 3;
  EXPECT_NE(plan::layout_error(c, l, 64).find("parallelism.cp = 3"), std::string::npos);
  l.cp = 1;
  EXPECT_EQ(plan::layout_error(c, l, 64), "");
  l.ep_overlap_split = true;  // the split of unpaired chunks needs the overlap it completes
  EXPECT_NE(plan::layout_error(c, l, 64).find("parallelism.ep_overlap_split needs parallelism.ep_overlap = true"),
            std::string::npos);
  l.ep_overlap_split = false;
  EXPECT_NE(plan::layout_error(c, l, 63).find("global_batch_size"), std::string::npos);
  // ep x etp must divide tp x cp x dp
  l.ep = 128, l.dp = 64;
  EXPECT_NE(plan::layout_error(c, l, 64).find("must divide tp x cp x dp"), std::string::npos);
}

TEST(PlanLayout, ConfigDpMustAgreeWithTheWorld) {
  auto c = cfg("ds_tiny", {"--parallelism.dp_replicate=2"});
  EXPECT_NE(fail_msg(c, 4).find("dp_replicate x dp_shard = 2"), std::string::npos);
  EXPECT_EQ(plan::layout_from_config(c, 2).dp, 2);
}

TEST(PlanLayout, TheConfigAndThePlannerStateOneRuleOnce) {
  // The same broken degree reads the same in the engine's config validation and in a planner layout: both come
  // from parallel_degree_error (parallel_rules.h).
  const auto base = cfg("ds_tiny");
  const std::vector<std::pair<std::string, std::function<void(plan::Layout&)>>> cases = {
      {"--parallelism.tp=3", [](plan::Layout& l) { l.tp = 3; }},
      {"--parallelism.cp=3", [](plan::Layout& l) { l.cp = 3; }},
      {"--parallelism.ep=3", [](plan::Layout& l) { l.ep = 3; }},
      {"--parallelism.expert_tp=7", [](plan::Layout& l) { l.etp = 7; }},
  };
  for (const auto& [ov, set] : cases) {
    std::string from_config;
    try {
      load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/ds_tiny.toml", {ov});
    } catch (const Error& e) {
      from_config = e.what();
    }
    auto l = plan::layout_from_config(base, 1);
    set(l);
    const std::string from_plan = plan::layout_error(base, l, base.training.global_batch_size);
    ASSERT_FALSE(from_plan.empty()) << ov;
    EXPECT_NE(from_config.find(from_plan), std::string::npos) << ov << ": config says '" << from_config
                                                              << "', the planner '" << from_plan << "'";
  }
}
