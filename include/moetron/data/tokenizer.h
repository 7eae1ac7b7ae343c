// tokenizer.h: the BPE tokenizer, a thin wrapper over sentencepiece (BPE mode, byte fallback).
// Training is deterministic: single thread, fixed seed, identity normalization, so the same text and
// options give the same tokenizer.model byte for byte. Encoding is lossless for any valid UTF-8:
// decode(encode(s)) == s, with characters outside the vocabulary spelled as <0xNN> byte pieces.
// Newlines: sentencepiece works line by line, so encode() encodes each line on its own and puts the
// byte piece <0x0A> (newline_id()) between lines; decode() splits on it the same way.
// Not a general sentencepiece front end (no sampling, no n-best); sentencepiece headers stay private.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moetron::data {

struct TokenizerTrainOptions {
  int vocab_size = 8192;              // total pieces, including <unk> <s> </s> and the 256 byte pieces
  uint64_t seed = 1234;               // sentencepiece's sampling seed (only used beyond max_sentences)
  double character_coverage = 0.9995;  // rarer characters are left to byte fallback
  int64_t max_sentences = 2000000;    // training lines sampled (with `seed`) beyond this
  int max_sentence_bytes = 1 << 16;   // longer lines are skipped by the trainer
};

class Tokenizer {
 public:
  Tokenizer();
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Trains on `texts` (documents; split into lines here) and returns the serialized model proto.
  // Errors (too small a vocabulary, no text) are moetron::Error naming the cause.
  static std::string train_model(const std::vector<std::string>& texts, const TokenizerTrainOptions& opt);
  // train_model, then write the model atomically to `path` and load it.
  static Tokenizer train(const std::vector<std::string>& texts, const TokenizerTrainOptions& opt,
                         const std::string& path);
  static Tokenizer load(const std::string& path);
  static Tokenizer from_serialized(const std::string& model_proto);

  std::vector<int32_t> encode(std::string_view text) const;
  void encode(std::string_view text, std::vector<int32_t>& out) const;  // appends to out
  std::string decode(const int32_t* ids, size_t n) const;
  std::string decode(const std::vector<int32_t>& ids) const { return decode(ids.data(), ids.size()); }

  int vocab_size() const;
  int unk_id() const;
  int bos_id() const;
  int eos_id() const;
  int newline_id() const;  // the byte piece <0x0A>
  std::string piece(int id) const;
  bool is_byte(int id) const;  // one of the 256 byte-fallback pieces
  const std::string& serialized() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moetron::data
