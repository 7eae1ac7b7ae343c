// train_data.cpp: the synthetic and loader sources and make_train_sources (see train_data.h).
#include "train/train_data.h"

#include <cstdio>
#include <filesystem>
#include <vector>

#include "moetron/check.h"
#include "moetron/data.h"
#include "moetron/rng.h"

namespace fs = std::filesystem;

namespace moetron {

namespace {

// Synthetic text: each sequence is a random walk over the vocabulary with a few fixed "phrases", so a
// model can learn it and the loss falls. Sequence number q is a pure function of (seed, stream, q).
// Ranks: like the DataLoader, global step s is sequences [s*G, s*G + G); rank r of `world` takes the
// contiguous chunk of G/world starting at s*G + r*G/world, as micro-batches of B. So sequence i of a
// step is the same whatever the world size. Position = step_pos + micro*B (with world = 1: the number of
// sequences handed out); at a step boundary it does not depend on rank or world.
struct SyntheticSource : BatchSource {
  int64_t B, T, V, G, rank, world;
  uint64_t key, step_pos = 0, micro = 0;
  SyntheticSource(int64_t b, int64_t t, int64_t v, uint64_t seed, const char* stream, int64_t g, int r, int w)
      : B(b), T(t), V(v), G(g), rank(r), world(w), key(rng_key(seed, stream)) {}
  void next(int32_t* in, int32_t* tg) override {
    std::vector<int32_t> row(size_t(T + 1));
    const int64_t per = G / world;
    const uint64_t first = step_pos + uint64_t(rank * per) + micro * uint64_t(B);
    for (int64_t r = 0; r < B; ++r) {
      uint64_t base = (first + uint64_t(r)) * uint64_t(T + 1);
      int32_t cur = int32_t(philox4x32(key, base)[0] % uint64_t(V));
      for (int64_t t = 0; t <= T; ++t) {
        auto rnd = philox4x32(key, base + uint64_t(t) + 1);
        // 3/4 of the time the next token is a deterministic function of the current one.
        cur = (rnd[0] & 3) ? int32_t((uint64_t(cur) * 31 + 7) % uint64_t(V)) : int32_t(rnd[1] % uint64_t(V));
        row[size_t(t)] = cur;
      }
      std::copy(row.begin(), row.begin() + T, in + r * T);
      std::copy(row.begin() + 1, row.end(), tg + r * T);
    }
    if (int64_t(++micro) * B == per) micro = 0, step_pos += uint64_t(G);
  }
  nlohmann::json state() const override { return nlohmann::json{{"kind", "synthetic"}, {"position", step_pos + micro * uint64_t(B)}}; }
  void restore(const nlohmann::json& j) override {
    uint64_t pos = j.at("position").get<uint64_t>();
    step_pos = pos - pos % uint64_t(G), micro = (pos % uint64_t(G)) / uint64_t(B);
    MT_CHECK(micro == 0 || world == 1, "train", "synthetic data position ", pos,
             " is inside a step: only a step boundary restores under data parallelism");
  }
};

struct LoaderSource : BatchSource {
  data::DataLoader loader;
  data::Batch batch;
  LoaderSource(const std::vector<std::string>& paths, const data::LoaderOptions& o) : loader(paths, o) {}
  void next(int32_t* in, int32_t* tg) override {
    loader.next(batch);
    batch.split(in, tg);
  }
  nlohmann::json state() const override {
    auto s = loader.state();
    return nlohmann::json{{"kind", "loader"}, {"epoch", s.epoch}, {"position", s.position}, {"micro", s.micro}};
  }
  void restore(const nlohmann::json& j) override {
    data::LoaderState s;
    s.epoch = j.at("epoch").get<uint64_t>();
    s.position = j.at("position").get<uint64_t>();
    s.micro = j.at("micro").get<uint64_t>();
    loader.restore(s);
  }
};

}  // namespace

TrainSources make_train_sources(const JobConfig& cfg, const std::string& data_root, int rank, int D, int64_t G,
                                const Comm& world, bool say) {
  const auto& tr = cfg.training;
  const ModelSpec& ms = cfg.model;
  const int64_t B = tr.micro_batch_size, T = tr.seq_len;
  TrainSources s;
  if (tr.dataset == "synthetic") {
    s.train = std::make_unique<SyntheticSource>(B, T, ms.vocab_size, uint64_t(tr.seed), "data.synthetic.train", G,
                                                rank, D);
    s.val = std::make_unique<SyntheticSource>(B, T, ms.vocab_size, uint64_t(tr.seed), "data.synthetic.val", B, 0, 1);
    return s;
  }
  std::string dir = tr.dataset_path;
  if (dir.empty()) dir = (fs::path(data_root) / tr.dataset).string();
  if (!fs::exists(fs::path(dir) / "dataset.json")) {
    MT_CHECK(tr.dataset == "brown" || fs::exists(tr.dataset), "train", "dataset '", tr.dataset,
             "' is not prepared in ", dir, " (run `moetron data prepare --source ... --out ", dir, "`)");
  }
  if (!fs::exists(fs::path(dir) / "dataset.json") && world.rank() == 0) {
    data::PrepareOptions po;
    po.source = tr.dataset;
    po.out_dir = dir;
    po.vocab_size = int(ms.vocab_size);
    po.verbose = say;
    if (say) std::printf("preparing dataset '%s' into %s (first run only)\n", tr.dataset.c_str(), dir.c_str());
    data::prepare_dataset(po);
  }
  if (world.size() > 1) world.barrier();  // rank 0 prepared the dataset
  data::DatasetInfo info = data::load_dataset(dir);
  MT_CHECK(info.vocab_size == ms.vocab_size, "train", "dataset ", dir, " has vocab ", info.vocab_size,
           " but model.vocab_size is ", ms.vocab_size);
  s.unigram_entropy = info.unigram_entropy;
  data::LoaderOptions lo;
  lo.seq_len = T, lo.micro_batch = B, lo.global_batch = G, lo.seed = uint64_t(tr.seed);
  lo.rank = rank, lo.world = D;
  s.train = std::make_unique<LoaderSource>(info.train_paths(), lo);
  // validation: a fixed set of windows, no shuffle
  data::LoaderOptions vo = lo;
  vo.shuffle = false, vo.random_offset = false, vo.global_batch = B, vo.rank = 0, vo.world = 1;
  s.val = std::make_unique<LoaderSource>(info.val_paths(), vo);
  return s;
}

uint64_t fnv1a(const void* p, size_t n, uint64_t h) {
  auto* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}

}  // namespace moetron
