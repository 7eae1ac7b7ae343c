// test_published.cpp: `plan validate --published`'s library parts (plan/published.h): the CSV reader (quoted
// commas, quotes, newlines; a bad line's error names the file, line and column), a published row mapped onto a
// preset, a catalog entry, a layout, a batch and a recipe (a DeepSeekV3 H100 row, refused rows with their reasons,
// and the CSV's spellings of the issue-33 presets and catalog entries), the projection being plan_time's own
// figure, and the per-split median / worst |error|. Not a check of the planner's accuracy against the published
// figures (docs/planner.md, "Published MoE runs", records that).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/config.h"
#include "moetron/plan/cost.h"
#include "moetron/plan/hardware.h"
#include "moetron/plan/layout.h"
#include "moetron/plan/published.h"

using namespace moetron;
using namespace moetron::plan;

namespace {

std::string error_of(std::string_view text) {
  try {
    read_csv(text, "runs.csv");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A DeepSeekV3 row on H100 with every layout key the mapping reads (the Megatron-Bridge columns).
PublishedRow ds_h100() {
  PublishedRow r;
  r.f = {{"id", "x-01"},         {"publisher", "P"},     {"model", "DeepSeek-V3"}, {"hardware", "H100"},
         {"world", "1024"},      {"tp", "2"},            {"pp", "8"},              {"ep", "64"},
         {"cp", "1"},            {"dp", ""},             {"vpp", "4"},             {"expert_tp", "1"},
         {"fsdp", "0"},          {"mbs", "1"},           {"global_batch", "8192"}, {"global_batch_unit", "sequences"},
         {"seq_len", "4096"},    {"precision", "FP8-CS"}, {"throughput", "1000"},  {"throughput_unit", "tokens/s/GPU"},
         {"split", "validation"}};
  return r;
}

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

}  // namespace

TEST(PlanPublished, CsvQuotedFieldsKeepCommasQuotesAndNewlines) {
  const CsvTable t = read_csv("a,b,c\n1,\"x, y\",\"say \"\"hi\"\"\"\n2,\"two\nlines\",\n3,,z\r\n", "t.csv");
  ASSERT_EQ(t.header, (std::vector<std::string>{"a", "b", "c"}));
  ASSERT_EQ(t.rows.size(), 3u);
  EXPECT_EQ(t.rows[0], (std::vector<std::string>{"1", "x, y", "say \"hi\""}));
  EXPECT_EQ(t.rows[1], (std::vector<std::string>{"2", "two\nlines", ""}));
  EXPECT_EQ(t.rows[2], (std::vector<std::string>{"3", "", "z"}));
  EXPECT_EQ(t.lines, (std::vector<int64_t>{2, 3, 5}));  // the quoted newline moves the third row to line 5
}

TEST(PlanPublished, CsvBadLineNamesFileLineAndColumn) {
  // Row on line 3 has 4 fields where the header has 3.
  EXPECT_NE(error_of("a,b,c\n1,2,3\n4,5,6,7\n").find("runs.csv:3:1: 4 fields where the header has 3"),
            std::string::npos)
      << error_of("a,b,c\n1,2,3\n4,5,6,7\n");
  // Text after a closing quote: line 2, column 5 (the 'x' after "ab").
  EXPECT_NE(error_of("a,b\n\"ab\"x,1\n").find("runs.csv:2:5: 'x' after a closing quote"), std::string::npos)
      << error_of("a,b\n\"ab\"x,1\n");
  // A quote in the middle of an unquoted field: line 2, column 4.
  EXPECT_NE(error_of("a,b\n1,x\"y\n").find("runs.csv:2:4: a quote inside an unquoted field"), std::string::npos)
      << error_of("a,b\n1,x\"y\n");
  // An unterminated quote is reported where it opened: line 3, column 3.
  EXPECT_NE(error_of("a,b\n1,2\n3,\"open\n").find("runs.csv:3:3: unterminated quoted field"), std::string::npos)
      << error_of("a,b\n1,2\n3,\"open\n");
}

TEST(PlanPublished, TheDataSetReads) {
  const auto rows = read_published(std::string(MOETRON_SOURCE_DIR) + "/tests/data/published_moe_runs.csv");
  ASSERT_EQ(rows.size(), 35u);
  EXPECT_EQ(rows.front().get("id"), "nv-mb-01");
  EXPECT_EQ(rows.front().line, 2);
  EXPECT_EQ(rows.back().get("id"), "pt-tt-03");
}

// The presets and catalog entries added for issue 33: the CSV's own spellings map onto them, and every row that
// names one of them is projected or refused for a reason other than a missing preset or hardware entry.
TEST(PlanPublished, Issue33PresetsAndHardwareMapAndProject) {
  EXPECT_EQ(preset_for_model("GPT OSS 120B"), "gpt_oss_120b.toml");
  EXPECT_EQ(preset_for_model("Qwen3_235B_a22B"), "qwen3_235b_a22b.toml");
  EXPECT_EQ(preset_for_model("Qwen3-235B"), "qwen3_235b_a22b.toml");
  EXPECT_EQ(preset_for_model("Mixtral 8X22B"), "mixtral_8x22b.toml");
  EXPECT_EQ(preset_for_model("Qwen3-Next-80B-A3B"), "");  // hybrid linear attention: no honest preset
  EXPECT_EQ(hardware_for("GB300"), "gb300");
  EXPECT_EQ(hardware_for("H800"), "h800");
  const std::string dir = std::string(MOETRON_SOURCE_DIR) + "/configs";
  int seen = 0, projected = 0;
  for (const PublishedRow& r : read_published(std::string(MOETRON_SOURCE_DIR) + "/tests/data/published_moe_runs.csv")) {
    const std::string p = preset_for_model(r.get("model")), hw = hardware_for(r.get("hardware"));
    if (p != "gpt_oss_120b.toml" && p != "qwen3_235b_a22b.toml" && p != "mixtral_8x22b.toml" && hw != "gb300" &&
        hw != "h800")
      continue;
    SCOPED_TRACE(r.get("id"));
    ++seen;
    const PublishedResult o = project_row(r, dir);
    EXPECT_EQ(o.status.find("no preset"), std::string::npos) << o.status;
    EXPECT_EQ(o.status.find("no hardware entry for GB300"), std::string::npos) << o.status;
    EXPECT_EQ(o.status.find("no hardware entry for H800"), std::string::npos) << o.status;
    if (o.projected) ++projected;
  }
  // 4 GPT OSS + 3 + 5 Qwen3-235B + 1 Mixtral 8x22B rows, and the GB300 Qwen3-30B / DeepSeek-V3 rows and the H800 row.
  EXPECT_EQ(seen, 17);
  // All but gg-mt-02 (TPU v6e) and ds-v3-01 (precision "FP8 mixed" has no planner recipe; no layout or batch
  // either). nv-mz-04 (pp 32 x vpp 3 = 96 stages for 94 layers) projects since its pp_split counts the embedding
  // and the loss.
  EXPECT_EQ(projected, 15);
}

TEST(PlanPublished, DeepSeekV3H100RowMapsOntoThePresetAndLayout) {
  EXPECT_EQ(preset_for_model("DeepSeekV3"), "deepseek_v3.toml");
  EXPECT_EQ(preset_for_model("deepseek-v3"), "deepseek_v3.toml");
  EXPECT_EQ(preset_for_model("Qwen3_30B_a3B"), "qwen3_30b_a3b.toml");
  EXPECT_EQ(preset_for_model("Mixtral 8X7B"), "mixtral_8x7b.toml");
  EXPECT_EQ(hardware_for("GB200 (NVL72)"), "gb200");
  const RowMapping m = map_row(ds_h100());
  ASSERT_TRUE(m.ok) << m.reason;
  EXPECT_EQ(m.preset, "deepseek_v3.toml");
  EXPECT_EQ(m.hardware, "h100");
  EXPECT_EQ(m.world, 1024);
  for (const char* o : {"--parallelism.tp=2", "--parallelism.pp=8", "--parallelism.ep=64", "--parallelism.cp=1",
                        "--parallelism.expert_tp=1", "--parallelism.pp_schedule=interleaved_1f1b",
                        "--parallelism.pp_virtual_stages=4", "--training.seq_len=4096",
                        "--training.micro_batch_size=1", "--training.global_batch_size=8192",
                        "--quantize.recipe=tensorwise"})
    EXPECT_TRUE(has(m.overrides, o)) << o;
  // The projection is plan time's figure for the same job: dp = 1024 / (2 x 8) = 64, m = 8192 / 64 = 128.
  const PublishedResult r = project_row(ds_h100(), std::string(MOETRON_SOURCE_DIR) + "/configs");
  ASSERT_TRUE(r.compared) << r.status;
  const JobConfig c = load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/deepseek_v3.toml", m.overrides);
  const Layout l = layout_from_config(c, 1024, true);
  EXPECT_EQ(l.dp, 64);
  EXPECT_EQ(l.microbatches, 128);
  TimeOptions o;
  o.memory.recipe = recipe_named("megatron", c);
  const TimePlan t = plan_time(c, l, catalog_hardware("h100"), o);
  EXPECT_DOUBLE_EQ(r.projected_tps, t.tokens_per_s_per_gpu);
  EXPECT_DOUBLE_EQ(r.error, t.tokens_per_s_per_gpu / 1000.0 - 1);
  EXPECT_NEAR(r.compute + r.tp_cp + r.ep + r.dp + r.bubble + r.other, t.step_time, 1e-9 * t.step_time);
}

TEST(PlanPublished, RefusedRowsNameTheirReason) {
  PublishedRow r = ds_h100();
  r.f["model"] = "Qwen3-Next-80B-A3B";
  EXPECT_EQ(map_row(r).reason, "not projected: no preset for Qwen3-Next-80B-A3B");
  r = ds_h100();
  r.f["hardware"] = "TPU v6e";
  EXPECT_EQ(map_row(r).reason, "not projected: no hardware entry for TPU v6e");
  r = ds_h100();
  r.f["precision"] = "FP8 mixed";
  EXPECT_EQ(map_row(r).reason, "not projected: precision 'FP8 mixed' has no planner recipe");
  r = ds_h100();
  r.f["tp"] = "", r.f["seq_len"] = "";
  EXPECT_EQ(map_row(r).reason, "not projected: tp, seq_len not given");
  r = ds_h100();
  r.f["cp"] = "", r.f["vpp"] = "", r.f["expert_tp"] = "";  // these three have a default (1)
  EXPECT_TRUE(map_row(r).ok) << map_row(r).reason;
  r = ds_h100();
  r.f["dp"] = "32";
  EXPECT_EQ(map_row(r).reason, "not projected: dp = 32 disagrees with world / (tp x cp x pp) = 64");
  r = ds_h100();
  r.f["global_batch_unit"] = "tokens", r.f["global_batch"] = std::to_string(8192 * 4096);
  EXPECT_TRUE(has(map_row(r).overrides, "--training.global_batch_size=8192"));
  r = ds_h100();
  r.f["throughput_unit"] = "TFLOP/s/GPU";
  const PublishedResult p = project_row(r, std::string(MOETRON_SOURCE_DIR) + "/configs");
  EXPECT_TRUE(p.projected);
  EXPECT_FALSE(p.compared);
  EXPECT_EQ(p.status, "not compared: unit TFLOP/s/GPU");
}

// A row whose throughput is not tokens/s/GPU but which states its step time is compared on the tokens/s/GPU that
// step gives (global batch tokens / (step x world)); without a step time it is not compared.
TEST(PlanPublished, StepTimeGivesTokensPerSecondWhenTheUnitIsNot) {
  const std::string configs = std::string(MOETRON_SOURCE_DIR) + "/configs";
  PublishedRow r = ds_h100();
  r.f["throughput_unit"] = "TFLOP/s/GPU", r.f["throughput"] = "245";
  r.f["throughput2"] = "19.7", r.f["throughput2_unit"] = "step time s";
  const PublishedResult p = project_row(r, configs);
  ASSERT_TRUE(p.compared) << p.status;
  EXPECT_EQ(p.measured_from, "step time");
  EXPECT_DOUBLE_EQ(p.measured, 8192.0 * 4096.0 / (19.7 * 1024.0));
  EXPECT_DOUBLE_EQ(p.error, p.projected_tps / p.measured - 1);
  r.f["throughput2_unit"] = "MFU %";  // a second figure that is not a step time
  EXPECT_FALSE(project_row(r, configs).compared);
  r = ds_h100();  // a tokens/s/GPU row keeps its own figure even beside a step time
  r.f["throughput2"] = "19.7", r.f["throughput2_unit"] = "step time s";
  const PublishedResult q = project_row(r, configs);
  EXPECT_TRUE(q.measured_from.empty());
  EXPECT_DOUBLE_EQ(q.measured, 1000.0);
}

// The recompute the publisher states maps onto the planner's activation checkpointing; a module it has no
// counterpart for refuses the row by name; empty = not stated (the preset's).
TEST(PlanPublished, StatedRecomputeMapsOntoActivationCheckpointing) {
  PublishedRow r = ds_h100();
  r.f["recompute"] = "norm, act";
  RowMapping m = map_row(r);
  ASSERT_TRUE(m.ok) << m.reason;
  EXPECT_TRUE(has(m.overrides, "--activation_checkpoint.mode=selective"));
  EXPECT_TRUE(has(m.overrides, "--activation_checkpoint.modules=[\"norm\",\"moe_act\"]"));
  r.f["recompute"] = "Full";
  m = map_row(r);
  EXPECT_TRUE(has(m.overrides, "--activation_checkpoint.mode=full"));
  const JobConfig c = load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/deepseek_v3.toml", m.overrides);
  EXPECT_EQ(c.activation_checkpoint.mode, AcMode::Full);
  r.f["recompute"] = "norm, act, shared_expert";
  EXPECT_EQ(map_row(r).reason, "not projected: recompute module 'shared_expert' has no planner counterpart");
  r.f["recompute"] = "";
  for (const auto& o : map_row(r).overrides) EXPECT_EQ(o.find("activation_checkpoint"), std::string::npos) << o;
}

// The dispatcher and the 1F1B all-to-all overlap the publisher states map onto the planner's keys; a value it has
// no counterpart for refuses the row by name; empty = not stated (the preset's).
TEST(PlanPublished, StatedDispatcherAndOverlapMapOntoTheLayout) {
  PublishedRow r = ds_h100();
  r.f["dispatcher"] = "DeepEP";
  r.f["ep_overlap"] = "yes";
  RowMapping m = map_row(r);
  ASSERT_TRUE(m.ok) << m.reason;
  EXPECT_TRUE(has(m.overrides, "--parallelism.ep_dispatcher=hierarchical"));
  EXPECT_TRUE(has(m.overrides, "--parallelism.ep_overlap=true"));
  const JobConfig c = load_config(std::string(MOETRON_SOURCE_DIR) + "/configs/deepseek_v3.toml", m.overrides);
  EXPECT_EQ(c.parallelism.ep_dispatcher, EpDispatcher::Hierarchical);
  EXPECT_TRUE(c.parallelism.ep_overlap);
  r.f["dispatcher"] = "A2A";
  r.f["ep_overlap"] = "";
  m = map_row(r);
  EXPECT_TRUE(has(m.overrides, "--parallelism.ep_dispatcher=alltoall"));
  for (const auto& o : m.overrides) EXPECT_EQ(o.find("ep_overlap"), std::string::npos) << o;
  r.f["dispatcher"] = "HybridEP";
  EXPECT_EQ(map_row(r).reason, "not projected: dispatcher 'HybridEP' has no planner counterpart");
  r.f["dispatcher"] = "";
  r.f["ep_overlap"] = "maybe";
  EXPECT_EQ(map_row(r).reason, "not projected: ep_overlap 'maybe' is neither yes nor no");
  r.f["ep_overlap"] = "";
  for (const auto& o : map_row(r).overrides) EXPECT_EQ(o.find("ep_dispatcher"), std::string::npos) << o;
}

// The routing the publisher states: forced balance (or not stated) projects every EP rank at the balanced rows,
// dropless at the FITTED kDroplessEpImbalance, which then slows the projection as plan time's --ep-imbalance does;
// another value refuses the row by name.
TEST(PlanPublished, StatedRoutingSetsTheEpImbalance) {
  PublishedRow r = ds_h100();
  EXPECT_EQ(map_row(r).ep_imbalance, 1.0);
  r.f["routing"] = "forced";
  EXPECT_EQ(map_row(r).ep_imbalance, 1.0);
  const PublishedResult forced = project_row(r, std::string(MOETRON_SOURCE_DIR) + "/configs");
  r.f["routing"] = "Dropless";
  EXPECT_EQ(map_row(r).ep_imbalance, kDroplessEpImbalance);
  EXPECT_GT(kDroplessEpImbalance, 1.0);
  const PublishedResult dropless = project_row(r, std::string(MOETRON_SOURCE_DIR) + "/configs");
  ASSERT_TRUE(forced.projected && dropless.projected) << forced.status << " / " << dropless.status;
  EXPECT_EQ(dropless.ep_imbalance, kDroplessEpImbalance);
  EXPECT_GT(dropless.step_s, forced.step_s);
  EXPECT_GT(dropless.ep, forced.ep);
  r.f["routing"] = "capacity";
  EXPECT_EQ(map_row(r).reason, "not projected: routing 'capacity' is neither forced nor dropless");
}

// The pipeline split the recipe states: Megatron's account-for-embedding / loss flags count each as one layer of
// the first / last stage (so 94 layers fill PP 32 x VPP 3); "even" or empty is the plain split; another value
// refuses the row by name.
TEST(PlanPublished, StatedPipelineSplitCountsEmbeddingAndLoss) {
  PublishedRow r = ds_h100();
  for (const auto& o : map_row(r).overrides) EXPECT_EQ(o.find("less_layers"), std::string::npos) << o;
  r.f["pp_split"] = "Embedding, loss";
  RowMapping m = map_row(r);
  ASSERT_TRUE(m.ok) << m.reason;
  EXPECT_TRUE(has(m.overrides, "--parallelism.pp_first_stage_less_layers=1"));
  EXPECT_TRUE(has(m.overrides, "--parallelism.pp_last_stage_less_layers=1"));
  r.f["pp_split"] = "loss";
  m = map_row(r);
  EXPECT_FALSE(has(m.overrides, "--parallelism.pp_first_stage_less_layers=1"));
  EXPECT_TRUE(has(m.overrides, "--parallelism.pp_last_stage_less_layers=1"));
  r.f["pp_split"] = "even";
  for (const auto& o : map_row(r).overrides) EXPECT_EQ(o.find("less_layers"), std::string::npos) << o;
  r.f["pp_split"] = "embedding,mtp";
  EXPECT_EQ(map_row(r).reason, "not projected: pp_split 'mtp' is neither embedding, loss nor even");
  // Qwen3-235B's 94 layers on PP 32 x VPP 3 project only with both counted (96 layer-equivalents).
  const std::string configs = std::string(MOETRON_SOURCE_DIR) + "/configs";
  r = ds_h100();
  r.f["model"] = "Qwen3-235B", r.f["world"] = "256", r.f["tp"] = "2", r.f["pp"] = "32", r.f["vpp"] = "3";
  r.f["ep"] = "8", r.f["dp"] = "4", r.f["global_batch"] = "2048", r.f["precision"] = "BF16";
  EXPECT_FALSE(project_row(r, configs).projected);
  r.f["pp_split"] = "embedding,loss";
  const PublishedResult p = project_row(r, configs);
  EXPECT_TRUE(p.projected) << p.status;
}

TEST(PlanPublished, SplitMedianAndWorst) {
  std::vector<PublishedResult> rs(6);
  const double errs[] = {0.10, -0.40, 0.20, -0.05, 0.30, 0.0};
  const char* splits[] = {"calibration", "calibration", "calibration", "calibration", "validation", "validation"};
  for (size_t i = 0; i < rs.size(); ++i) {
    rs[i].id = std::string(1, 'r') + char('0' + i), rs[i].split = splits[i];  // not "r" + to_string: GCC 12 -Wrestrict
    rs[i].projected = rs[i].compared = i != 5, rs[i].error = errs[i];
  }
  const SplitSummary c = summarize(rs, "calibration");
  EXPECT_EQ(c.rows, 4);
  EXPECT_EQ(c.compared, 4);
  EXPECT_DOUBLE_EQ(c.median_abs_error, 0.15);  // |errors| 0.05 0.10 0.20 0.40: the mean of the middle two
  EXPECT_DOUBLE_EQ(c.worst_abs_error, 0.40);   // the negative one: |error|, not error
  EXPECT_EQ(c.worst_id, "r1");
  const SplitSummary v = summarize(rs, "validation");
  EXPECT_EQ(v.rows, 2);
  EXPECT_EQ(v.projected, 1);
  EXPECT_EQ(v.compared, 1);  // the row not compared does not count
  EXPECT_DOUBLE_EQ(v.median_abs_error, 0.30);
  EXPECT_EQ(v.worst_id, "r4");
}
