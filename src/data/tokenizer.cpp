// tokenizer.cpp: sentencepiece BPE training (C++ API, in-memory sentence iterator) and the
// line-aware encode/decode around it. See tokenizer.h for the contract.
#include "moetron/data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <mutex>
#include <unordered_map>

#include "io.h"
#include "moetron/check.h"

namespace moetron::data {

namespace {

constexpr int kSpecialPieces = 3;  // <unk>=0 <s>=1 </s>=2
constexpr int kBytePieces = 256;

// Feeds the non-empty lines of the documents to the trainer, without copying the corpus.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string>& texts) : texts_(texts) { advance(); }
  bool done() const override { return doc_ >= texts_.size(); }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }

 private:
  // Moves to the next non-empty line (CR before LF is dropped).
  void advance() {
    while (doc_ < texts_.size()) {
      const std::string& t = texts_[doc_];
      if (pos_ > t.size()) {
        ++doc_;
        pos_ = 0;
        continue;
      }
      size_t end = t.find('\n', pos_);
      if (end == std::string::npos) end = t.size();
      size_t len = end - pos_;
      if (len > 0 && t[pos_ + len - 1] == '\r') --len;
      line_.assign(t, pos_, len);
      pos_ = end + 1;
      if (!line_.empty()) return;
    }
  }
  const std::vector<std::string>& texts_;
  size_t doc_ = 0, pos_ = 0;
  std::string line_;
};

std::string status_text(const sentencepiece::util::Status& s) { return s.ToString(); }

}  // namespace

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
  std::string proto;
  int newline_id = -1;
};

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

std::string Tokenizer::train_model(const std::vector<std::string>& texts, const TokenizerTrainOptions& opt) {
  const int min_vocab = kSpecialPieces + kBytePieces + 1;
  MT_CHECK(opt.vocab_size >= min_vocab, "tokenizer", "vocab_size ", opt.vocab_size,
           " is too small: byte fallback alone needs ", kSpecialPieces + kBytePieces,
           " pieces (256 bytes + <unk> <s> </s>) plus the corpus characters; use at least a few hundred");
  MT_CHECK(opt.character_coverage > 0 && opt.character_coverage <= 1, "tokenizer", "character_coverage ",
           opt.character_coverage, " must be in (0, 1]");
  {
    LineIterator probe(texts);
    MT_CHECK(!probe.done(), "tokenizer", "no text to train on: the corpus is empty (", texts.size(),
             " documents, all blank)");
  }
  std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(opt.vocab_size)},
      {"byte_fallback", "true"},
      {"character_coverage", std::to_string(opt.character_coverage)},
      // Identity normalization and kept whitespace make decode(encode(s)) == s exactly.
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "true"},
      {"split_digits", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "-1"},
      {"num_threads", "1"},  // deterministic and cheap enough: BPE training is mostly serial anyway
      {"input_sentence_size", std::to_string(opt.max_sentences)},
      {"shuffle_input_sentence", "true"},
      {"max_sentence_length", std::to_string(opt.max_sentence_bytes)},
      {"minloglevel", "2"},
  };
  // sentencepiece keeps its seed in a process-wide variable: serialize concurrent trainings.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  sentencepiece::SetRandomGeneratorSeed(static_cast<unsigned>(opt.seed ^ (opt.seed >> 32)));
  LineIterator it(texts);
  std::string proto;
  auto st = sentencepiece::SentencePieceTrainer::Train(args, &it, &proto);
  MT_CHECK(st.ok(), "tokenizer", "sentencepiece BPE training failed (vocab_size=", opt.vocab_size,
           "): ", status_text(st));
  MT_CHECK(!proto.empty(), "tokenizer", "sentencepiece returned an empty model");
  return proto;
}

Tokenizer Tokenizer::train(const std::vector<std::string>& texts, const TokenizerTrainOptions& opt,
                           const std::string& path) {
  std::string proto = train_model(texts, opt);
  io::write_file_atomic(path, {proto});
  return from_serialized(proto);
}

Tokenizer Tokenizer::load(const std::string& path) {
  std::string proto = io::read_file(path);
  try {
    return from_serialized(proto);
  } catch (const Error& e) {
    MT_FAIL("tokenizer", "cannot load ", path, ": ", e.what());
  }
}

Tokenizer Tokenizer::from_serialized(const std::string& model_proto) {
  Tokenizer t;
  t.impl_ = std::make_unique<Impl>();
  sentencepiece::util::Status st;
  try {
    st = t.impl_->sp.LoadFromSerializedProto(model_proto);
  } catch (const std::exception& e) {  // sentencepiece's trie builder throws on some malformed models
    MT_FAIL("tokenizer", "not a valid sentencepiece model (", model_proto.size(), " bytes): ", e.what());
  }
  MT_CHECK(st.ok(), "tokenizer", "not a valid sentencepiece model (", model_proto.size(), " bytes): ",
           status_text(st));
  t.impl_->proto = model_proto;
  t.impl_->newline_id = t.impl_->sp.PieceToId("<0x0A>");
  MT_CHECK(t.impl_->newline_id != t.impl_->sp.unk_id() && t.impl_->sp.IsByte(t.impl_->newline_id), "tokenizer",
           "model has no byte-fallback pieces (trained without byte_fallback?)");
  MT_CHECK(t.impl_->sp.eos_id() >= 0, "tokenizer", "model has no </s> piece");
  return t;
}

void Tokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  MT_CHECK(impl_, "tokenizer", "encode on an empty Tokenizer");
  std::vector<int> ids;
  size_t pos = 0;
  while (true) {
    size_t end = text.find('\n', pos);
    std::string_view line = text.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos);
    if (!line.empty()) {
      auto st = impl_->sp.Encode(line, &ids);
      MT_CHECK(st.ok(), "tokenizer", "encode failed: ", status_text(st));
      out.insert(out.end(), ids.begin(), ids.end());
    }
    if (end == std::string_view::npos) break;
    out.push_back(impl_->newline_id);
    pos = end + 1;
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode(text, out);
  return out;
}

std::string Tokenizer::decode(const int32_t* ids, size_t n) const {
  MT_CHECK(impl_, "tokenizer", "decode on an empty Tokenizer");
  const int V = vocab_size();
  std::string out, piece;
  std::vector<int> seg;
  auto flush = [&] {
    if (seg.empty()) return;
    auto st = impl_->sp.Decode(seg, &piece);
    MT_CHECK(st.ok(), "tokenizer", "decode failed: ", status_text(st));
    out += piece;
    seg.clear();
  };
  for (size_t i = 0; i < n; ++i) {
    MT_CHECK(ids[i] >= 0 && ids[i] < V, "tokenizer", "decode: id ", ids[i], " at position ", i,
             " is outside the vocabulary [0, ", V, ")");
    if (ids[i] == impl_->newline_id) {
      flush();
      out += '\n';
    } else {
      seg.push_back(ids[i]);
    }
  }
  flush();
  return out;
}

#define MT_TOKENIZER_LOADED() MT_CHECK(impl_, "tokenizer", "empty Tokenizer (use train, load or from_serialized)")
int Tokenizer::vocab_size() const { return impl_ ? impl_->sp.GetPieceSize() : 0; }
int Tokenizer::unk_id() const {
  MT_TOKENIZER_LOADED();
  return impl_->sp.unk_id();
}
int Tokenizer::bos_id() const {
  MT_TOKENIZER_LOADED();
  return impl_->sp.bos_id();
}
int Tokenizer::eos_id() const {
  MT_TOKENIZER_LOADED();
  return impl_->sp.eos_id();
}
int Tokenizer::newline_id() const {
  MT_TOKENIZER_LOADED();
  return impl_->newline_id;
}
std::string Tokenizer::piece(int id) const {
  MT_CHECK(id >= 0 && id < vocab_size(), "tokenizer", "piece: id ", id, " outside [0, ", vocab_size(), ")");
  return impl_->sp.IdToPiece(id);
}
bool Tokenizer::is_byte(int id) const {
  MT_TOKENIZER_LOADED();
  return id >= 0 && id < vocab_size() && impl_->sp.IsByte(id);
}
const std::string& Tokenizer::serialized() const {
  MT_TOKENIZER_LOADED();
  return impl_->proto;
}

}  // namespace moetron::data
