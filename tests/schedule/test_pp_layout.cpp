// test_pp_layout.cpp: the pipeline layer layout (pp_layout.h): Megatron's grammar (repeats, groups, nesting,
// commas and spaces), every rule's message with its position, the TorchTitan-style even split with and
// without the less-layers options, stage -> rank placement (loop and V), and a DeepSeek-V3-like 61-layer
// layout on pp 8 x 4 stages per rank. Expected values are written out by hand. Not the schedule generators.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "../unit/test_util.h"
#include "moetron/check.h"
#include "moetron/pp_layout.h"

using namespace moetron;
using namespace moetron::sched;

namespace {
using moetron::testing::error_of;
#define EXPECT_HAS(msg, sub) EXPECT_NE((msg).find(sub), std::string::npos) << "message: " << (msg)

using Strs = std::vector<std::string>;
using Ints = std::vector<int>;

// Layer counts per stage.
Ints counts(const PpLayout& l) {
  Ints c;
  for (int s = 0; s < l.n_stages; ++s) c.push_back(int(l.layers(s).size()));
  return c;
}
}  // namespace

// ---- grammar ---------------------------------------------------------------------------------------------

TEST(PpLayoutGrammar, RepeatsGroupsNestingCommasAndSpaces) {
  EXPECT_EQ(expand_pp_layout("Et*3|t*4|tL"), (Strs{"Ettt", "tttt", "tL"}));
  EXPECT_EQ(expand_pp_layout("E(t|)*2L"), (Strs{"Et", "t", "L"}));
  // Inner group "(t|)*2t|" = "t|t|t|", twice: E t|t|t|t|t|t| L.
  EXPECT_EQ(expand_pp_layout("E((t|)*2t|)*2L"), (Strs{"Et", "t", "t", "t", "t", "t", "L"}));
  EXPECT_EQ(expand_pp_layout("E t*2, | t t , L"), (Strs{"Ett", "ttL"}));
  EXPECT_EQ(expand_pp_layout("E(t)*12L"), (Strs{"E" + std::string(12, 't').append("L")}));
  EXPECT_EQ(expand_pp_layout("Et|*2tL"), (Strs{"Et", "", "tL"}));  // a repeated separator: an empty stage
  EXPECT_EQ(expand_pp_layout("E*1t * 2L"), (Strs{"EttL"}));
  EXPECT_EQ(expand_pp_layout("(E)t(L)"), (Strs{"EtL"}));
  // Megatron's own example shape, with t in place of its MTP layer: 1 + 29 + 1 + 1 stages.
  const auto st = expand_pp_layout("Et*3|(tt|)*29,t|L");
  ASSERT_EQ(st.size(), 32u);
  EXPECT_EQ(st[0], "Ettt");
  for (int i = 1; i <= 29; ++i) EXPECT_EQ(st[size_t(i)], "tt") << i;
  EXPECT_EQ(st[30], "t");
  EXPECT_EQ(st[31], "L");
}

TEST(PpLayoutGrammar, ErrorsNameTheRuleAndThePosition) {
  struct Case {
    const char* text;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"Et*2|x", "pp_layout \"Et*2|x\": unknown character 'x' at position 6"},
      {"Et\x01L", "unknown character byte 0x1 at position 3"},
      {"E(tt|L", "unbalanced parentheses: '(' at position 2 is never closed"},
      {"E((t)*2|L", "unbalanced parentheses: '(' at position 2 is never closed"},
      {"Ett)|L", "unbalanced parentheses: ')' at position 4 has no matching '('"},
      {"E()tL", "empty group '()' at position 2"},
      {"Et*|L", "bad repeat count: '*' at position 3 must be followed by a number"},
      {"Et*0L", "bad repeat count: *0 at position 3 must be >= 1"},
      {"*3EtL", "bad repeat: '*' at position 1 does not follow a symbol or a group"},
      {"Et*2*3L", "bad repeat: '*' at position 5 does not follow a symbol or a group"},
      {"Et3L", "bad repeat count: digit '3' at position 3 has no '*' before it"},
      {"E(t)*1048577L", "bad repeat count: *1048577 at position 5 is above the size limit 2^20"},
      {"Et*99999999999999999999999L", "bad repeat count: *99999999999999999999999 at position 3 is above the size"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    EXPECT_HAS(error_of([&] { expand_pp_layout(c.text); }), c.expect);
  }
}

TEST(PpLayoutGrammar, AbsurdExpansionsAreRefusedBeforeAllocation) {
  const auto t0 = std::chrono::steady_clock::now();
  // 2^20 * 2^20 symbols: sized from the parse tree, never built.
  EXPECT_HAS(error_of([] { expand_pp_layout("E((t)*1048576)*1048576L"); }), "expands to more than 2^20 = 1048576");
  EXPECT_HAS(error_of([] { expand_pp_layout("E(((t|)*1000)*1000)*1000L"); }), "expands to more than 2^20");
  // Nesting deeper than the limit.
  std::string deep = "E" + std::string(33, '(') + "t" + std::string(33, ')') + "L";
  EXPECT_HAS(error_of([&] { expand_pp_layout(deep); }), "'(' at position 34 nests deeper than 32 groups");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 0.5);
  // Exactly at the limit is accepted: 2^20 symbols including the two ends.
  EXPECT_EQ(expand_pp_layout("E(t)*1048574L")[0].size(), size_t(1) << 20);
}

// ---- layout rules ----------------------------------------------------------------------------------------

TEST(PpLayoutRules, EachRuleHasItsMessage) {
  struct Case {
    const char* text;
    int64_t n_layers;
    int pp, n_stages;
    bool v;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"Et*3|t*4L", 8, 2, 0, false, "pp_layout \"Et*3|t*4L\": has 7 decoder layers, model.n_layers = 8"},
      {"tt|tL", 3, 2, 0, false, "no E (embedding); it must appear exactly once, as the first item of stage 0"},
      {"EEt|tL", 2, 2, 0, false, "E (embedding) appears 2 times; it must appear exactly once"},
      {"tEt|tL", 3, 2, 0, false,
       "E (embedding) at position 2 must be the first item of stage 0; it is item 1 (0-based) of stage 0"},
      {"t|EtL", 2, 2, 0, false, "E (embedding) at position 3 must be the first item of stage 0; it is item 0 (0-based) "
                                "of stage 1"},
      {"Et|t", 2, 2, 0, false, "no L (loss); it must appear exactly once, as the last item of the last stage (stage 1)"},
      {"EtL|tL", 2, 2, 0, false, "L (loss) appears 2 times"},
      {"Et|Lt", 2, 2, 0, false,
       "L (loss) at position 4 must be the last item of the last stage (stage 1); it is item 0 (0-based) of stage 1"},
      {"EtL|t", 2, 2, 0, false, "L (loss) at position 3 must be the last item of the last stage (stage 1); it is item "
                                "2 (0-based) of stage 0"},
      {"Et|tL|", 2, 3, 0, false, "L (loss) at position 5 must be the last item of the last stage (stage 2)"},
      {"Et|t|tL", 3, 2, 0, false, "has 3 stages, not divisible by pp = 2 (stage s runs on rank s mod pp)"},
      {"Et|tL", 2, 2, 4, false, "has 2 stages, pp * stages per rank = 2 * 2 = 4"},
      {"Et|t|t|tL", 4, 1, 0, true, "has 4 stages; a V schedule places exactly 2 stages per rank: 2 * pp = 2"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    EXPECT_HAS(error_of([&] { parse_pp_layout(c.text, c.n_layers, c.pp, c.n_stages, c.v); }), c.expect);
  }
  EXPECT_HAS(error_of([] { parse_pp_layout("EtL", 1, 0); }), "pp = 0 must be >= 1");
}

TEST(PpLayoutRules, UnevenAndEmptyMiddleStagesAreAllowed) {
  // Stage 1 is empty (it only passes activations on), stage 0 holds only the embedding.
  PpLayout l = parse_pp_layout("E|ttt||tL", 4, 2);
  EXPECT_EQ(l.n_stages, 4);
  EXPECT_EQ(l.stages_per_rank(), 2);
  EXPECT_EQ(counts(l), (Ints{0, 3, 0, 1}));
  EXPECT_EQ(l.layers(1), (Ints{0, 1, 2}));
  EXPECT_EQ(l.layers(3), (Ints{3}));
  EXPECT_TRUE(l.has_embedding(0));
  EXPECT_FALSE(l.has_embedding(1));
  EXPECT_TRUE(l.has_loss(3));
  EXPECT_EQ(l.n_layers(), 4);
  EXPECT_EQ(l.to_string(), "E|ttt||tL");
  EXPECT_EQ(l.describe(), "stage 0 (rank 0): embedding\nstage 1 (rank 1): layers 0-2\nstage 2 (rank 0): (empty stage)\n"
                          "stage 3 (rank 1): layer 3, loss\n");
  // The loss stage may hold only L.
  EXPECT_EQ(counts(parse_pp_layout("Ett|L", 2, 2)), (Ints{2, 0}));
  // One stage holds everything.
  PpLayout one = parse_pp_layout("EtttL", 3, 1);
  EXPECT_EQ(one.n_stages, 1);
  ASSERT_EQ(one.stages[0].size(), 5u);
  EXPECT_EQ(one.stages[0][0], (LayoutItem{LayoutItem::Embedding, -1}));
  EXPECT_EQ(one.stages[0][2], (LayoutItem{LayoutItem::Layer, 1}));
  EXPECT_EQ(one.stages[0][4], (LayoutItem{LayoutItem::Loss, -1}));
}

TEST(PpLayoutRules, StageToRankLoopAndV) {
  // Loop placement: stage s on rank s mod pp.
  PpLayout l = parse_pp_layout("Et|t|t|t|t|t|t|tL", 8, 4);
  EXPECT_EQ(l.stage_rank, (Ints{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(l.stages_for_rank(1), (Ints{1, 5}));
  EXPECT_EQ(l.stages_for_rank(3), (Ints{3, 7}));
  EXPECT_HAS(error_of([&] { l.stages_for_rank(4); }), "rank 4 out of range [0, 4)");
  EXPECT_HAS(error_of([&] { l.layers(8); }), "stage 8 out of range [0, 8)");
  // V placement: rank r holds stages r and 2 pp - 1 - r.
  PpLayout v = parse_pp_layout("Ett|tt|tt|ttL", 8, 2, 4, true);
  EXPECT_EQ(v.stage_rank, (Ints{0, 1, 1, 0}));
  EXPECT_EQ(v.stages_for_rank(0), (Ints{0, 3}));
  EXPECT_EQ(v.stages_for_rank(1), (Ints{1, 2}));
  EXPECT_EQ(v.layers(3), (Ints{6, 7}));
}

TEST(PpLayoutRules, DeepSeekV3LikeLayoutOnPp8Vpp4) {
  // 61 decoder layers: stage 0 = E + 2 layers, stages 1..29 = 2 layers each, stage 30 = 1 layer, stage 31 = L.
  // 2 + 29 * 2 + 1 = 61; 32 stages = 8 ranks * 4.
  const char* text = "Et*2|(tt|)*29,t|L";
  PpLayout l = parse_pp_layout(text, 61, 8, 32);
  ASSERT_EQ(l.n_stages, 32);
  EXPECT_EQ(l.stages_per_rank(), 4);
  EXPECT_EQ(l.layers(0), (Ints{0, 1}));
  EXPECT_TRUE(l.has_embedding(0));
  for (int s = 1; s <= 29; ++s) EXPECT_EQ(l.layers(s), (Ints{2 * s, 2 * s + 1})) << s;
  EXPECT_EQ(l.layers(30), (Ints{60}));
  EXPECT_TRUE(l.layers(31).empty());
  EXPECT_TRUE(l.has_loss(31));
  // Rank 0 runs stages 0, 8, 16, 24; rank 7 runs 7, 15, 23, 31 (the last holds only the loss).
  EXPECT_EQ(l.stages_for_rank(0), (Ints{0, 8, 16, 24}));
  EXPECT_EQ(l.layers(8), (Ints{16, 17}));
  EXPECT_EQ(l.layers(24), (Ints{48, 49}));
  EXPECT_EQ(l.stages_for_rank(7), (Ints{7, 15, 23, 31}));
  EXPECT_EQ(l.layers(23), (Ints{46, 47}));
  EXPECT_EQ(l.stages_for_rank(6), (Ints{6, 14, 22, 30}));
  int64_t on_rank6 = 0;
  for (int s : l.stages_for_rank(6)) on_rank6 += int64_t(l.layers(s).size());
  EXPECT_EQ(on_rank6, 7);  // 2 + 2 + 2 + 1
  EXPECT_EQ(l.n_layers(), 61);
  // Canonical text parses back to the same layout; the wrong layer count or stage count is refused.
  EXPECT_EQ(parse_pp_layout(l.to_string(), 61, 8, 32), l);
  EXPECT_HAS(error_of([&] { parse_pp_layout(text, 62, 8); }), "has 61 decoder layers, model.n_layers = 62");
  EXPECT_HAS(error_of([&] { parse_pp_layout(text, 61, 8, 16); }), "has 32 stages, pp * stages per rank = 8 * 2 = 16");
  EXPECT_HAS(error_of([&] { parse_pp_layout(text, 61, 5); }), "has 32 stages, not divisible by pp = 5");
}

// ---- even split ------------------------------------------------------------------------------------------

TEST(PpLayoutEven, PlainSplitGivesTheFirstStagesTheRemainder) {
  EXPECT_EQ(even_pp_layout(8, 4, 1).to_string(), "Ett|tt|tt|ttL");
  // 61 over 8: 61 = 8 * 7 + 5, so stages 0-4 get 8 and 5-7 get 7.
  PpLayout l = even_pp_layout(61, 8, 1);
  EXPECT_EQ(counts(l), (Ints{8, 8, 8, 8, 8, 7, 7, 7}));
  EXPECT_EQ(l.layers(5), (Ints{40, 41, 42, 43, 44, 45, 46}));
  EXPECT_EQ(l.n_layers(), 61);
  // Interleaved: pp 2 x 2 stages per rank, loop placement.
  PpLayout i = even_pp_layout(6, 2, 2);
  EXPECT_EQ(i.to_string(), "Ett|tt|t|tL");
  EXPECT_EQ(i.stages_for_rank(0), (Ints{0, 2}));
  // One stage: everything, whatever the less-layers options say.
  EXPECT_EQ(even_pp_layout(3, 1, 1, 5, 5).to_string(), "EtttL");
  // The same as parsing the equivalent text.
  EXPECT_EQ(even_pp_layout(61, 8, 1), parse_pp_layout("Et*8|(t*8|)*4t*7|t*7|t*7L", 61, 8));
}

TEST(PpLayoutEven, LessLayersCountTheEmbeddingAndTheHead) {
  // e = 8 + 1 + 1 = 10 over 4 stages: 3, 3, 2, 2 layer-equivalents; stage 0 gives 1 to E, stage 3 gives 1 to L.
  EXPECT_EQ(counts(even_pp_layout(8, 4, 1, 1, 1)), (Ints{2, 3, 2, 1}));
  // e = 61 + 1 + 1 = 63 over 32 stages: 2 each for stages 0-30, 1 for stage 31; E takes 1, L takes 1.
  PpLayout l = even_pp_layout(61, 8, 4, 1, 1);
  Ints want(32, 2);
  want[0] = 1;
  want[31] = 0;
  EXPECT_EQ(counts(l), want);
  EXPECT_EQ(l.n_layers(), 61);
  EXPECT_EQ(l.layers(31), Ints{});
  EXPECT_TRUE(l.has_loss(31));
  // Only the first option: e = 3 + 1 = 4 over 4 stages, stage 0 holds only the embedding.
  EXPECT_EQ(even_pp_layout(3, 4, 1, 1, 0).to_string(), "E|t|t|tL");
  // Only the last: e = 9 over 4 = 3, 2, 2, 2; the last stage keeps 2 - 1 = 1.
  EXPECT_EQ(counts(even_pp_layout(8, 4, 1, 0, 1)), (Ints{3, 2, 2, 1}));
  // V placement.
  PpLayout v = even_pp_layout(8, 2, 2, 0, 0, true);
  EXPECT_EQ(v.stage_rank, (Ints{0, 1, 1, 0}));
  EXPECT_EQ(v.to_string(), "Ett|tt|tt|ttL");
}

TEST(PpLayoutEven, ImpossibleSplitsNameTheKeys) {
  EXPECT_HAS(error_of([] { even_pp_layout(2, 3, 1); }),
             "cannot split model.n_layers = 2 over pp * stages per rank = 3 * 1 = 3 stages: only 2 layer-equivalents "
             "(n_layers + pp_first_stage_less_layers 0 + pp_last_stage_less_layers 0), so a stage would be empty");
  // With the options, e = 2 + 1 + 0 = 3 covers 3 stages (stage 0 = E only).
  EXPECT_EQ(even_pp_layout(2, 3, 1, 1, 0).to_string(), "E|t|tL");
  // e = 4 + 2 = 6 over 4 stages: 1 per stage, so E cannot count for 2.
  EXPECT_HAS(error_of([] { even_pp_layout(4, 2, 2, 2, 0); }),
             "pp_first_stage_less_layers = 2 exceeds the 1 layer-equivalents of a stage (6 over 4 stages)");
  EXPECT_HAS(error_of([] { even_pp_layout(4, 2, 2, 0, 3); }), "pp_last_stage_less_layers = 3 exceeds the 1");
  EXPECT_HAS(error_of([] { even_pp_layout(4, 2, 1, -1, 0); }), "pp_first_stage_less_layers = -1 must be >= 0");
  EXPECT_HAS(error_of([] { even_pp_layout(8, 2, 3, 0, 0, true); }), "a V schedule places exactly 2 stages per rank");
  // Absurd stage counts are refused before anything is allocated.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_HAS(error_of([] { even_pp_layout(16, 1 << 20, 1 << 10); }), "cannot split model.n_layers = 16");
  EXPECT_HAS(error_of([] { even_pp_layout(int64_t(1) << 40, 2, 1); }), "must be <= 2^20 (size limit)");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.5);
}

// Megatron's MTP token m (model.mtp_layers): one per depth right before L on the last stage, or none (the MTP blocks
// go with L either way); dropped from the stages' items.
TEST(PpLayoutMtp, MBeforeLOnTheLastStage) {
  const PpLayout plain = parse_pp_layout("Et|tL", 2, 2);
  EXPECT_EQ(parse_pp_layout("Et|tmL", 2, 2, 0, false, 1), plain);
  EXPECT_EQ(parse_pp_layout("Et|tmmL", 2, 2, 0, false, 2), plain);
  EXPECT_EQ(parse_pp_layout("Et|tL", 2, 2, 0, false, 1), plain);  // m may be left out
  EXPECT_EQ(expand_pp_layout("Et|tm*2L"), (std::vector<std::string>{"Et", "tmmL"}));
  auto err = [](const char* text, int64_t mtp) {
    try {
      parse_pp_layout(text, 2, 2, 0, false, mtp);
    } catch (const moetron::Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(err("Et|tmL", 0).find("has 1 MTP layers (m), model.mtp_layers = 0"), std::string::npos) << err("Et|tmL", 0);
  EXPECT_NE(err("Et|tmmL", 1).find("has 2 MTP layers (m), model.mtp_layers = 1"), std::string::npos);
  EXPECT_NE(err("Et|mtL", 1).find("must be the items right before L on the last stage"), std::string::npos);
  EXPECT_NE(err("Etm|tL", 1).find("right before L"), std::string::npos) << err("Etm|tL", 1);
}
