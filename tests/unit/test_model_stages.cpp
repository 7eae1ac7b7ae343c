// test_model_stages.cpp: the model as pipeline stages in one process (all stages local) against the whole
// model. Several micro-batches are driven through the stages by hand in pipeline orders (all forwards
// first, or one-forward-one-backward with fewer activation slots than micro-batches, or the split backward
// with every W deferred past later I halves), and the gradients of every parameter must equal the whole
// model's forward_backward over the same micro-batches bit for bit: per stage the weight gradients
// accumulate in micro-batch order, exactly as in the whole model. Covered: MHA and MLA, dense and MoE
// layers, qk_norm (GQA), empty stages, full and selective recompute, FSDP on a one-rank group, and the misuse
// errors.
// The multi-rank pipeline (PipelineRuntime over MPI with the trainer) is tested in tests/mpi/.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "moetron/check.h"
#include "moetron/comm.h"
#include "moetron/config.h"
#include "moetron/fsdp.h"
#include "moetron/model.h"
#include "moetron/rng.h"

using namespace moetron;

namespace {

std::string repo(const std::string& rel) { return std::string(MOETRON_SOURCE_DIR) + "/" + rel; }
constexpr int64_t kB = 2, kT = 32;

struct Batches {
  std::vector<std::vector<int32_t>> in, tg;
};
Batches make_batches(int M, int64_t V) {
  Batches b;
  for (int m = 0; m < M; ++m) {
    std::vector<int32_t> in(size_t(kB * kT)), tg(size_t(kB * kT));
    const uint64_t key = rng_key(11 + uint64_t(m), "stages.test");
    for (int64_t i = 0; i < kB * kT; ++i) {
      in[size_t(i)] = int32_t(philox4x32(key, uint64_t(i))[0] % uint64_t(V));
      tg[size_t(i)] = int32_t(philox4x32(key, uint64_t(i))[1] % uint64_t(V));
    }
    b.in.push_back(in), b.tg.push_back(tg);
  }
  return b;
}

// Stages over the 3-layer tiny models: {E + layer 0}, {layer 1}, {} (passes through), {layer 2 + head}.
std::vector<ModelStagePart> four_stages(int slots) {
  std::vector<ModelStagePart> p(4);
  p[0].stage = 0, p[0].embedding = true, p[0].layers = {0};
  p[1].stage = 1, p[1].layers = {1};
  p[2].stage = 2;
  p[3].stage = 3, p[3].layers = {2}, p[3].head = true;
  for (auto& s : p) s.slots = slots;
  return p;
}

enum class Order { AllForwardFirst, OneFOneB, SplitDeferredW };

// Runs M micro-batches through the local stages of `m` in the given order; returns the ce sum per mb.
std::vector<double> run_stages(Model& m, const Batches& b, int M, Order order) {
  const int S = m.n_stages();
  const int64_t n = m.tokens_per_micro_batch() * m.spec().d_model;
  // act[s][mb]: output of stage s; grad[s][mb]: dL/d(input of stage s)
  std::vector<std::vector<std::vector<float>>> act(static_cast<size_t>(S)), grad(static_cast<size_t>(S));
  for (int s = 0; s < S; ++s) {
    act[size_t(s)].assign(size_t(M), std::vector<float>(size_t(n)));
    grad[size_t(s)].assign(size_t(M), std::vector<float>(size_t(n)));
  }
  std::vector<double> ce(size_t(M), 0.0);
  const int slots = m.stage_part(0).slots;
  auto fwd = [&](int mb) {
    for (int s = 0; s < S; ++s) {
      const float* in = s == 0 ? nullptr : act[size_t(s - 1)][size_t(mb)].data();
      float* out = s == S - 1 ? nullptr : act[size_t(s)][size_t(mb)].data();
      ForwardStats st = m.stage_forward(s, mb % slots, b.in[size_t(mb)].data(), b.tg[size_t(mb)].data(), in, out);
      if (s == S - 1) ce[size_t(mb)] = st.ce_sum;
    }
  };
  auto bwd = [&](int mb, bool weights) {
    for (int s = S - 1; s >= 0; --s) {
      const float* dout = s == S - 1 ? nullptr : grad[size_t(s + 1)][size_t(mb)].data();
      float* din = s == 0 ? nullptr : grad[size_t(s)][size_t(mb)].data();
      m.stage_backward(s, mb % slots, b.in[size_t(mb)].data(), dout, din, weights);
    }
  };
  if (order == Order::AllForwardFirst) {
    for (int mb = 0; mb < M; ++mb) fwd(mb);
    for (int mb = 0; mb < M; ++mb) bwd(mb, true);
  } else if (order == Order::OneFOneB) {
    for (int mb = 0; mb < M; ++mb) fwd(mb), bwd(mb, true);
  } else {  // every I first (slots = M), the W halves afterwards in micro-batch order
    for (int mb = 0; mb < M; ++mb) fwd(mb);
    for (int mb = 0; mb < M; ++mb) bwd(mb, false);
    for (int mb = 0; mb < M; ++mb)
      for (int s = S - 1; s >= 0; --s) m.stage_backward_weight(s, mb % slots);
  }
  return ce;
}

std::vector<float> grads_of(Model& m, const ParamEntry& p) {
  std::vector<float> g(size_t(p.numel));
  if (m.fsdp()) {
    std::vector<float> flat(size_t(m.num_params()));
    m.fsdp()->gather_flat(flat.data(), m.fsdp()->grads());
    std::memcpy(g.data(), flat.data() + p.offset, g.size() * 4);
  } else {
    std::memcpy(g.data(), m.grad_data() + p.offset, g.size() * 4);
  }
  return g;
}

void check_bitwise(const std::string& cfg_name, std::vector<std::string> ov, Order order, bool fsdp = false) {
  JobConfig cfg = load_config(repo("configs/" + cfg_name), ov);
  const int M = 3;
  const Batches b = make_batches(M, cfg.model.vocab_size);
  const float ce_scale = 1.0f / float(M * kB * kT), aux_scale = 1.0f / float(M);

  // FSDP sums each micro-batch in a zeroed unit slot before adding it to the shard (test_fsdp.cpp): compare
  // FSDP stages with the FSDP whole model.
  FsdpOptions fo{comm_local(), comm_local()};
  ModelParallel wpar;
  if (fsdp) wpar.fsdp = &fo;
  Model whole(cfg.model, kB, kT, cfg.activation_checkpoint, wpar);
  whole.init_params(5);
  whole.zero_grads();
  std::vector<double> ce_whole;
  for (int mb = 0; mb < M; ++mb)
    ce_whole.push_back(whole.forward_backward(b.in[size_t(mb)].data(), b.tg[size_t(mb)].data(), ce_scale, aux_scale)
                           .ce_sum);

  const auto parts = four_stages(order == Order::OneFOneB ? 1 : M);
  ModelParallel par;
  par.stages = &parts;
  if (fsdp) par.fsdp = &fo;
  Model staged(cfg.model, kB, kT, cfg.activation_checkpoint, par);
  staged.init_params(5);
  staged.zero_grads();
  staged.set_loss_scales(ce_scale, aux_scale);
  const std::vector<double> ce = run_stages(staged, b, M, order);
  for (int mb = 0; mb < M; ++mb) EXPECT_EQ(ce[size_t(mb)], ce_whole[size_t(mb)]) << "ce of micro-batch " << mb;
  ASSERT_EQ(staged.params().size(), whole.params().size());
  for (const auto& p : whole.params()) {
    const ParamEntry& q = staged.param(p.name);
    const auto a = grads_of(whole, p), c = grads_of(staged, q);
    ASSERT_EQ(0, std::memcmp(a.data(), c.data(), a.size() * 4)) << cfg_name << ": gradient of " << p.name;
  }
  EXPECT_EQ(whole.take_expert_counts(), staged.take_expert_counts());
}

}  // namespace

TEST(ModelStages, AllForwardsFirstIsBitwiseWhole) { check_bitwise("ds_tiny.toml", {}, Order::AllForwardFirst); }
TEST(ModelStages, OneSlotOneFOneBIsBitwiseWhole) { check_bitwise("ds_tiny.toml", {}, Order::OneFOneB); }
TEST(ModelStages, SplitBackwardIsBitwiseWhole) { check_bitwise("ds_tiny.toml", {}, Order::SplitDeferredW); }
TEST(ModelStages, SplitBackwardMla) { check_bitwise("ds_tiny_mla.toml", {}, Order::SplitDeferredW); }
TEST(ModelStages, SplitBackwardFullRecompute) {
  check_bitwise("ds_tiny.toml", {"--activation_checkpoint.mode=full"}, Order::SplitDeferredW);
}
TEST(ModelStages, SelectiveRecompute) {
  const std::vector<std::string> ov = {"--activation_checkpoint.mode=selective",
                                       "--activation_checkpoint.modules=[\"norm\", \"attention_core\", \"moe_act\"]"};
  check_bitwise("ds_tiny.toml", ov, Order::AllForwardFirst);
  check_bitwise("ds_tiny.toml", ov, Order::SplitDeferredW);
}
// qk_norm (Qwen3's per-head q/k RMSNorm, GQA): stages and the split backward, full and selective recompute are
// bitwise the whole model; and recompute is bitwise no recompute (the layer forward re-runs the q/k norm into the
// saved pre-norm values, which no selective module drops).
TEST(ModelStages, QkNormStagesAndRecompute) {
  const std::vector<std::string> qk = {"--model.attn_type=gqa", "--model.n_kv_heads=2", "--model.qk_norm=true"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> r = qk;
    r.insert(r.end(), extra.begin(), extra.end());
    return r;
  };
  const std::vector<std::string> full = {"--activation_checkpoint.mode=full"};
  const std::vector<std::string> sel = {"--activation_checkpoint.mode=selective",
                                        "--activation_checkpoint.modules=[\"norm\", \"attention_core\", \"moe_act\"]"};
  check_bitwise("ds_tiny.toml", qk, Order::SplitDeferredW);
  check_bitwise("ds_tiny.toml", with(full), Order::SplitDeferredW);
  check_bitwise("ds_tiny.toml", with(sel), Order::AllForwardFirst);
  auto grads = [&](std::vector<std::string> ov) {
    JobConfig cfg = load_config(repo("configs/ds_tiny.toml"), ov);
    const Batches b = make_batches(1, cfg.model.vocab_size);
    Model m(cfg.model, kB, kT, cfg.activation_checkpoint, ModelParallel{});
    m.init_params(5);
    m.zero_grads();
    m.forward_backward(b.in[0].data(), b.tg[0].data(), 1.0f / float(kB * kT), 1.0f);
    return std::vector<float>(m.grad_data(), m.grad_data() + m.num_params());
  };
  const std::vector<float> none = grads(qk);
  EXPECT_TRUE(none == grads(with(full))) << "full recompute changed the qk_norm model's gradients";
  EXPECT_TRUE(none == grads(with(sel))) << "selective recompute changed the qk_norm model's gradients";
}

TEST(ModelStages, FsdpOneRankSplitBackward) { check_bitwise("ds_tiny.toml", {}, Order::SplitDeferredW, true); }

TEST(ModelStages, TiedEmbeddingsFoldOnce) {
  // The head's gradient has a buffer of its own; folding it after the micro-batches gives the embedding
  // gradient (rows of every micro-batch) + (head gradient of every micro-batch) in both models.
  JobConfig cfg = load_config(repo("configs/ds_tiny.toml"), {"--model.tie_embeddings=true"});
  const int M = 2;
  const Batches b = make_batches(M, cfg.model.vocab_size);
  const auto parts = four_stages(M);
  ModelParallel par;
  par.stages = &parts;
  Model staged(cfg.model, kB, kT, {}, par);
  staged.init_params(5);
  staged.zero_grads();
  staged.set_loss_scales(0.01f, 0.5f);
  ASSERT_NE(staged.tied_head_grad(), nullptr);
  run_stages(staged, b, M, Order::AllForwardFirst);
  const ParamEntry& e = staged.param("embed");
  std::vector<float> rows(staged.grad_data() + e.offset, staged.grad_data() + e.offset + e.numel);
  std::vector<float> want(rows);
  for (int64_t i = 0; i < e.numel; ++i) want[size_t(i)] += staged.tied_head_grad()[i];
  staged.fold_tied_head_grad();
  EXPECT_EQ(0, std::memcmp(want.data(), staged.grad_data() + e.offset, size_t(e.numel) * 4));
  for (int64_t i = 0; i < e.numel; ++i) ASSERT_EQ(staged.tied_head_grad()[i], 0.0f);
  EXPECT_THROW(staged.forward(b.in[0].data(), b.tg[0].data()), Error);  // whole-model API refused on stages
}

TEST(ModelStages, PartialModelHoldsOnlyItsParameters) {
  JobConfig cfg = load_config(repo("configs/ds_tiny.toml"));
  std::vector<ModelStagePart> mid(1);
  mid[0].stage = 1, mid[0].layers = {1, 2}, mid[0].slots = 2;
  ModelParallel par;
  par.stages = &mid;
  Model m(cfg.model, kB, kT, {}, par);
  EXPECT_FALSE(m.holds_embedding());
  EXPECT_FALSE(m.holds_head());
  EXPECT_FALSE(m.holds_layer(0));
  EXPECT_TRUE(m.holds_layer(2));
  for (auto& p : m.params()) EXPECT_TRUE(p.layer == 1 || p.layer == 2) << p.name;
  EXPECT_EQ(m.local_moe_layers(), std::vector<int>({0, 1}));  // layers 1 and 2 are the two MoE layers
  EXPECT_EQ(m.n_moe_layers_total(), 2);
  EXPECT_THROW(m.expert_bias(5), Error);
}

TEST(ModelStages, MisuseIsRefused) {
  JobConfig cfg = load_config(repo("configs/ds_tiny.toml"));
  auto make = [&](std::vector<ModelStagePart> p) {
    ModelParallel par;
    par.stages = &p;
    Model m(cfg.model, kB, kT, {}, par);
  };
  std::vector<ModelStagePart> gap(1);
  gap[0].layers = {0, 2};
  EXPECT_THROW(make(gap), Error);  // not contiguous
  std::vector<ModelStagePart> dup(2);
  dup[0].stage = 0, dup[0].layers = {0}, dup[1].stage = 1, dup[1].layers = {0};
  EXPECT_THROW(make(dup), Error);  // a layer twice
  std::vector<ModelStagePart> emb(1);
  emb[0].embedding = true, emb[0].layers = {1};
  EXPECT_THROW(make(emb), Error);  // embedding stage not starting at layer 0
  std::vector<ModelStagePart> noslot(1);
  noslot[0].slots = 0;
  EXPECT_THROW(make(noslot), Error);

  const Batches b = make_batches(1, cfg.model.vocab_size);
  const auto parts = four_stages(1);
  ModelParallel par;
  par.stages = &parts;
  Model m(cfg.model, kB, kT, {}, par);
  m.init_params(1);
  m.set_loss_scales(1.0f, 1.0f);
  std::vector<float> a(size_t(kB * kT * cfg.model.d_model)), a2(a.size()), g(a.size()), g2(a.size());
  EXPECT_THROW(m.stage_forward(0, 1, b.in[0].data(), nullptr, nullptr, a.data()), Error);  // slot out of range
  EXPECT_THROW(m.stage_forward(1, 0, nullptr, nullptr, nullptr, a.data()), Error);         // no input
  m.stage_forward(0, 0, b.in[0].data(), nullptr, nullptr, a.data());
  m.stage_forward(1, 0, nullptr, nullptr, a.data(), a2.data());
  m.stage_backward(1, 0, nullptr, g.data(), g2.data(), false);
  EXPECT_THROW(m.stage_backward(1, 0, nullptr, g.data(), g2.data(), false), Error);  // I again before its W
}
