// prepare.cpp: the dataset preparation pipeline behind `moetron data prepare`: load the corpus,
// split documents into train/val, train the tokenizer on train, encode (documents in parallel, each
// on its own so the result does not depend on the thread count), write shards, compute the unigram
// statistics, and write the manifest last. See prepare.h.
#include "moetron/data/prepare.h"

#include <omp.h>

#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "io.h"
#include "moetron/check.h"
#include "moetron/data/corpus.h"
#include "moetron/data/crc32c.h"
#include "moetron/data/shard.h"
#include "moetron/data/tokenizer.h"

namespace moetron::data {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kManifest = "dataset.json";

double cpu_s() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}
uint32_t parse_hex32(const std::string& s) { return uint32_t(std::stoul(s, nullptr, 16)); }

std::string source_spec(const std::string& source) {
  if (source == "brown") return source;
  return fs::weakly_canonical(fs::absolute(source)).string();
}

// The options that determine the output; the manifest must match them for a no-op.
json options_json(const PrepareOptions& o) {
  return json{{"source", source_spec(o.source)},
              {"vocab_size", o.vocab_size},
              {"val_fraction", o.val_fraction},
              {"seed", o.seed},
              {"character_coverage", o.character_coverage},
              {"max_shard_tokens", o.max_shard_tokens},
              {"format_version", kDatasetFormatVersion}};
}

json shard_json(const ShardInfo& s) {
  return json{{"file", s.file},
              {"tokens", s.tokens},
              {"documents", s.documents},
              {"bytes", s.bytes},
              {"crc32c", hex32(s.crc32c)}};
}

ShardInfo shard_from_json(const json& j) {
  ShardInfo s;
  s.file = j.at("file").get<std::string>();
  s.tokens = j.at("tokens").get<uint64_t>();
  s.documents = j.at("documents").get<uint64_t>();
  s.bytes = j.at("bytes").get<uint64_t>();
  s.crc32c = parse_hex32(j.at("crc32c").get<std::string>());
  return s;
}

DatasetInfo info_from_json(const json& j, const std::string& dir) {
  DatasetInfo d;
  d.dir = dir;
  const auto& src = j.at("source");
  d.source = src.at("spec").get<std::string>();
  d.source_kind = src.at("kind").get<std::string>();
  d.source_fingerprint = parse_hex32(src.at("fingerprint").get<std::string>());
  d.documents_train = src.at("documents").at("train").get<uint64_t>();
  d.documents_val = src.at("documents").at("val").get<uint64_t>();
  d.documents_skipped = src.at("documents").at("skipped_empty").get<uint64_t>();
  d.characters = src.at("characters").get<uint64_t>();
  const auto& tok = j.at("tokenizer");
  d.tokenizer_path = (fs::path(dir) / tok.at("file").get<std::string>()).string();
  d.vocab_size = tok.at("vocab_size").get<int>();
  d.eos_id = tok.at("eos_id").get<int>();
  d.bos_id = tok.at("bos_id").get<int>();
  d.dtype = j.at("dtype").get<std::string>();
  for (const auto& s : j.at("shards").at("train")) d.train_shards.push_back(shard_from_json(s));
  for (const auto& s : j.at("shards").at("val")) d.val_shards.push_back(shard_from_json(s));
  d.tokens_train = j.at("tokens").at("train").get<uint64_t>();
  d.tokens_val = j.at("tokens").at("val").get<uint64_t>();
  d.unigram_entropy = j.at("unigram_entropy_nats").get<double>();
  d.val_unigram_xent = j.at("val_unigram_xent_nats").get<double>();
  d.prepare_seconds = j.at("prepare_seconds").get<double>();
  return d;
}

bool file_has_size(const fs::path& p, uint64_t bytes) {
  std::error_code ec;
  auto sz = fs::file_size(p, ec);
  return !ec && sz == bytes;
}

// Why an existing manifest does not describe what `opt` would produce ("" when it does).
std::string manifest_mismatch(const json& m, const PrepareOptions& opt, const Corpus* corpus) {
  if (!m.contains("options") || m["options"] != options_json(opt)) return "the options differ";
  const fs::path dir(opt.out_dir);
  const auto& tok = m.at("tokenizer");
  if (!file_has_size(dir / tok.at("file").get<std::string>(), tok.at("bytes").get<uint64_t>()))
    return "the tokenizer file is missing or has changed";
  for (const char* split : {"train", "val"})
    for (const auto& s : m.at("shards").at(split))
      if (!file_has_size(dir / s.at("file").get<std::string>(), s.at("bytes").get<uint64_t>()))
        return "shard " + s.at("file").get<std::string>() + " is missing or has changed";
  if (corpus && m.at("source").at("fingerprint").get<std::string>() != hex32(corpus->fingerprint))
    return "the source text has changed";
  return "";
}

// Document i goes to validation when floor((i+1) f) > floor(i f): round(n f) documents spread
// evenly over the corpus (every 20th for f = 0.05), so validation covers every genre/section.
std::vector<bool> val_split(size_t n, double f) {
  std::vector<bool> val(n, false);
  if (f <= 0) return val;
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    val[i] = std::floor(double(i + 1) * f) > std::floor(double(i) * f);
    count += val[i];
  }
  if (count == 0) val[n - 1] = true;  // tiny corpus: still give validation one document
  return val;
}

struct Split {
  std::vector<ShardInfo> shards;
  uint64_t tokens = 0, documents = 0;
};

// Concatenates documents (each followed by eos) into shards of about max_tokens and writes them.
Split write_split(const std::string& dir, const char* prefix, const std::vector<const std::vector<int32_t>*>& docs,
                  uint32_t vocab, uint32_t eos, uint64_t max_tokens) {
  Split out;
  std::vector<int32_t> buf;
  auto flush = [&] {
    if (buf.empty() && !out.shards.empty()) return;
    char name[64];
    std::snprintf(name, sizeof name, "%s_%03zu.bin", prefix, out.shards.size());
    std::string path = (fs::path(dir) / name).string();
    ShardHeader h = write_shard(path, buf.data(), buf.size(), vocab, eos);
    ShardInfo s;
    s.file = name;
    s.tokens = h.num_tokens;
    s.documents = h.num_documents;
    s.bytes = kShardHeaderBytes + h.num_tokens * h.token_bytes;
    s.crc32c = h.payload_crc32c;
    out.tokens += s.tokens;
    out.documents += s.documents;
    out.shards.push_back(s);
    buf.clear();
  };
  for (const auto* d : docs) {
    buf.insert(buf.end(), d->begin(), d->end());
    buf.push_back(int32_t(eos));
    if (buf.size() >= max_tokens) flush();
  }
  if (!buf.empty()) flush();
  return out;
}

}  // namespace

std::vector<std::string> DatasetInfo::train_paths() const {
  std::vector<std::string> p;
  for (const auto& s : train_shards) p.push_back((fs::path(dir) / s.file).string());
  return p;
}
std::vector<std::string> DatasetInfo::val_paths() const {
  std::vector<std::string> p;
  for (const auto& s : val_shards) p.push_back((fs::path(dir) / s.file).string());
  return p;
}

DatasetInfo load_dataset(const std::string& dir) {
  fs::path mp = fs::path(dir) / kManifest;
  MT_CHECK(fs::exists(mp), "data", "no dataset at ", dir, ": ", mp.string(),
           " is missing (run `moetron data prepare --out ", dir, "`)");
  json j;
  try {
    j = json::parse(io::read_file(mp.string()));
    MT_CHECK(j.value("format", "") == "moetron-dataset", "data", mp.string(), " is not a moetron dataset manifest");
    MT_CHECK(j.value("version", 0) == kDatasetFormatVersion, "data", mp.string(), ": manifest version ",
             j.value("version", 0), ", this build reads ", kDatasetFormatVersion);
    return info_from_json(j, dir);
  } catch (const json::exception& e) {
    MT_FAIL("data", mp.string(), ": malformed manifest: ", e.what());
  }
}

namespace {

// Unigram statistics of the token streams (eos included, as the model predicts it too): the training
// stream's entropy and the validation stream's cross-entropy under add-one smoothed training counts.
struct UnigramStats {
  double entropy = 0, val_xent = 0;
};
UnigramStats unigram_stats(const std::vector<const std::vector<int32_t>*>& train_docs,
                           const std::vector<const std::vector<int32_t>*>& val_docs, uint32_t V, uint32_t eos,
                           uint64_t train_tokens, uint64_t val_tokens) {
  std::vector<uint64_t> count(V, 0);
  for (const auto* d : train_docs) {
    for (int32_t t : *d) ++count[size_t(t)];
    ++count[eos];
  }
  double H = 0;
  const double N = double(train_tokens);
  for (uint64_t c : count)
    if (c) H -= double(c) / N * std::log(double(c) / N);
  double xent = 0;
  if (val_tokens > 0) {
    auto lp = [&](int32_t t) { return std::log((double(count[size_t(t)]) + 1.0) / (N + double(V))); };
    for (const auto* d : val_docs) {
      for (int32_t t : *d) xent -= lp(t);
      xent -= lp(int32_t(eos));
    }
    xent /= double(val_tokens);
  }
  return {H, xent};
}

// The manifest of a prepared dataset (docs/data.md): options, source, tokenizer, shards, token counts, stats.
json manifest_json(const PrepareOptions& opt, const Corpus& corpus, uint64_t characters, const Tokenizer& tok,
                   const std::string& tok_proto, const Split& train, const Split& val, const UnigramStats& uni,
                   double seconds) {
  const uint32_t V = uint32_t(tok.vocab_size());
  const std::string& tok_bytes = tok_proto;
  json shards_train = json::array(), shards_val = json::array();
  for (const auto& s : train.shards) shards_train.push_back(shard_json(s));
  for (const auto& s : val.shards) shards_val.push_back(shard_json(s));
  return {
      {"format", "moetron-dataset"},
      {"version", kDatasetFormatVersion},
      {"created_by", "moetron data prepare"},
      {"options", options_json(opt)},
      {"source",
       {{"kind", corpus.kind},
        {"spec", source_spec(opt.source)},
        {"package", corpus.kind == "brown" ? json(kBrownPackage) : json(nullptr)},
        {"fingerprint", hex32(corpus.fingerprint)},
        {"documents", {{"train", train.documents}, {"val", val.documents}, {"skipped_empty", corpus.skipped_empty}}},
        {"characters", characters}}},
      {"tokenizer",
       {{"file", "tokenizer.model"},
        {"type", "sentencepiece-bpe"},
        {"byte_fallback", true},
        {"vocab_size", tok.vocab_size()},
        {"unk_id", tok.unk_id()},
        {"bos_id", tok.bos_id()},
        {"eos_id", tok.eos_id()},
        {"newline_id", tok.newline_id()},
        {"bytes", tok_bytes.size()},
        {"crc32c", hex32(crc32c(tok_bytes.data(), tok_bytes.size()))}}},
      {"dtype", shard_token_bytes(V) == 2 ? "u16" : "u32"},
      {"shards", {{"train", shards_train}, {"val", shards_val}}},
      {"tokens", {{"train", train.tokens}, {"val", val.tokens}}},
      {"unigram_entropy_nats", uni.entropy},
      {"val_unigram_xent_nats", uni.val_xent},
      {"prepare_seconds", seconds},
  };
}

// Shards of an older preparation (its manifest `old`) that the new one does not list.
void remove_stale_shards(const json& old, const fs::path& dir, const Split& train, const Split& val) {
  if (!old.contains("shards") || !old["shards"].is_object()) return;
  std::set<std::string> keep;
  for (const auto& s : train.shards) keep.insert(s.file);
  for (const auto& s : val.shards) keep.insert(s.file);
  for (const char* split : {"train", "val"})
    if (old["shards"].contains(split) && old["shards"][split].is_array())
      for (const auto& s : old["shards"][split])
        if (s.contains("file") && s["file"].is_string() && !keep.count(s["file"].get<std::string>()))
          fs::remove(dir / fs::path(s["file"].get<std::string>()).filename());
}

}  // namespace

PrepareResult prepare_dataset(const PrepareOptions& opt_in) {
  PrepareOptions opt = opt_in;
  const double t0 = now_s(), c0 = cpu_s();
  MT_CHECK(!opt.out_dir.empty(), "data", "empty output directory");
  MT_CHECK(opt.val_fraction >= 0 && opt.val_fraction <= 0.5, "data", "val_fraction ", opt.val_fraction,
           " must be in [0, 0.5]");
  MT_CHECK(opt.max_shard_tokens >= 1, "data", "max_shard_tokens must be >= 1");
  MT_CHECK(opt.vocab_size >= 260, "data", "vocab_size ", opt.vocab_size,
           " is too small: byte fallback needs 259 pieces (256 bytes + <unk> <s> </s>) plus the corpus characters");
  if (opt.npm_cache.empty()) opt.npm_cache = (fs::path(opt.out_dir) / "npm").string();
  auto say = [&](const std::string& s) {
    if (opt.verbose) {
      std::printf("%s\n", s.c_str());
      std::fflush(stdout);
    }
  };

  PrepareResult res;
  const fs::path dir(opt.out_dir);
  const fs::path mpath = dir / kManifest;
  json old;
  bool have_old = false;
  if (fs::exists(mpath)) {
    try {
      old = json::parse(io::read_file(mpath.string()));
      have_old = old.is_object();
    } catch (const std::exception&) {
      have_old = false;  // unreadable manifest: prepare again
    }
  }

  // Folder and JSONL sources are re-read to fingerprint them; Brown is pinned by package version.
  Corpus corpus;
  bool loaded = false;
  double tl = now_s();
  if (have_old && !opt.force) {
    std::string why;
    try {
      if (opt.source != "brown") {
        corpus = load_corpus(opt.source, opt.npm_cache, opt.verbose);
        loaded = true;
      }
      why = manifest_mismatch(old, opt, loaded ? &corpus : nullptr);
    } catch (const json::exception& e) {
      why = std::string("the manifest is malformed (") + e.what() + ")";
    }
    if (why.empty()) {
      res.skipped = true;
      res.info = load_dataset(opt.out_dir);
      res.seconds = now_s() - t0;
      res.cpu_seconds = cpu_s() - c0;
      say("dataset " + opt.out_dir + " is up to date (" + mpath.string() + " matches the options); nothing to do");
      return res;
    }
    say("re-preparing " + opt.out_dir + ": " + why);
  }

  if (!loaded) {
    say("loading corpus " + opt.source + " ...");
    corpus = load_corpus(opt.source, opt.npm_cache, opt.verbose);
  }
  res.seconds_load = now_s() - tl;
  const size_t ndoc = corpus.docs.size();
  auto is_val = val_split(ndoc, opt.val_fraction);
  MT_CHECK(opt.val_fraction == 0 || ndoc >= 2, "data", "a validation split needs at least 2 documents, the corpus ",
           opt.source, " has ", ndoc, " (pass --val-fraction 0 to use them all for training)");
  std::vector<std::string> train_text;
  uint64_t characters = 0;
  for (size_t i = 0; i < ndoc; ++i) {
    characters += corpus.docs[i].text.size();
    if (!is_val[i]) train_text.push_back(corpus.docs[i].text);
  }

  // Tokenizer.
  double tt = now_s();
  say("training BPE tokenizer (vocab " + std::to_string(opt.vocab_size) + ") on " + std::to_string(train_text.size()) +
      " documents ...");
  TokenizerTrainOptions topt;
  topt.vocab_size = opt.vocab_size;
  topt.seed = opt.seed;
  topt.character_coverage = opt.character_coverage;
  // Trained in memory: nothing on disk changes until everything that can fail on bad input has run.
  const std::string tok_proto = Tokenizer::train_model(train_text, topt);
  Tokenizer tok = Tokenizer::from_serialized(tok_proto);
  train_text.clear();
  train_text.shrink_to_fit();
  res.seconds_tokenizer = now_s() - tt;

  // Encode every document independently (order-preserving, thread-count independent).
  double te = now_s();
  say("encoding " + std::to_string(ndoc) + " documents ...");
  std::vector<std::vector<int32_t>> ids(ndoc);
  std::string err;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < int64_t(ndoc); ++i) {
    try {
      tok.encode(corpus.docs[size_t(i)].text, ids[size_t(i)]);
    } catch (const std::exception& e) {
#pragma omp critical
      err = corpus.docs[size_t(i)].name + ": " + e.what();
    }
  }
  MT_CHECK(err.empty(), "data", "encoding failed: ", err);
  res.seconds_encode = now_s() - te;

  // The directory is incomplete from here until the new manifest is written.
  double tw = now_s();
  fs::create_directories(dir);
  fs::remove(mpath);
  io::write_file_atomic((dir / "tokenizer.model").string(), {tok_proto});
  std::vector<const std::vector<int32_t>*> train_docs, val_docs;
  for (size_t i = 0; i < ndoc; ++i) (is_val[i] ? val_docs : train_docs).push_back(&ids[i]);
  const uint32_t V = uint32_t(tok.vocab_size()), eos = uint32_t(tok.eos_id());
  Split train = write_split(opt.out_dir, "train", train_docs, V, eos, opt.max_shard_tokens);
  Split val;
  if (!val_docs.empty()) val = write_split(opt.out_dir, "val", val_docs, V, eos, opt.max_shard_tokens);
  res.seconds_write = now_s() - tw;

  const UnigramStats uni = unigram_stats(train_docs, val_docs, V, eos, train.tokens, val.tokens);
  res.seconds = now_s() - t0;
  res.cpu_seconds = cpu_s() - c0;
  const json m = manifest_json(opt, corpus, characters, tok, tok_proto, train, val, uni, res.seconds);
  io::write_file_atomic(mpath.string(), {m.dump(2) + "\n"});

  if (have_old) remove_stale_shards(old, dir, train, val);
  res.info = load_dataset(opt.out_dir);
  return res;
}

std::string dataset_summary(const PrepareResult& r) {
  const DatasetInfo& d = r.info;
  std::ostringstream os;
  char buf[256];
  os << "dataset     " << d.dir << (r.skipped ? "  (up to date, nothing done)" : "") << "\n";
  os << "source      " << d.source << " (" << d.source_kind << ")\n";
  os << "documents   " << d.documents_train + d.documents_val << " (train " << d.documents_train << ", val "
     << d.documents_val << ", skipped empty " << d.documents_skipped << ")\n";
  os << "characters  " << d.characters << "\n";
  std::snprintf(buf, sizeof buf, "tokens      train %llu, val %llu (%.2f characters/token)\n",
                (unsigned long long)d.tokens_train, (unsigned long long)d.tokens_val,
                d.tokens_train + d.tokens_val ? double(d.characters) / double(d.tokens_train + d.tokens_val) : 0.0);
  os << buf;
  os << "vocab       " << d.vocab_size << " (sentencepiece BPE, byte fallback, eos " << d.eos_id << "), shards "
     << d.dtype << ": " << d.train_shards.size() << " train, " << d.val_shards.size() << " val\n";
  std::snprintf(buf, sizeof buf,
                "entropy     unigram %.4f nats/token (train); val cross-entropy under it %.4f nats/token\n",
                d.unigram_entropy, d.val_unigram_xent);
  os << buf;
  if (r.skipped) {
    std::snprintf(buf, sizeof buf, "time        %.2f s (originally prepared in %.2f s)\n", r.seconds, d.prepare_seconds);
  } else {
    std::snprintf(buf, sizeof buf,
                  "time        %.2f s wall (load %.2f, tokenizer %.2f, encode %.2f, write %.2f), %.2f s CPU\n", r.seconds,
                  r.seconds_load, r.seconds_tokenizer, r.seconds_encode, r.seconds_write, r.cpu_seconds);
  }
  os << buf;
  return os.str();
}

}  // namespace moetron::data
