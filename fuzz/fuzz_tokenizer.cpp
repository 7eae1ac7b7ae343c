// fuzz_tokenizer: feeds moetron's tokenizer wrapper (Tokenizer::from_serialized, src/data/tokenizer.cpp) with a
// tokenizer.model file, then encodes and decodes a fixed text with it and asks for every special id. The model
// proto itself is parsed by sentencepiece (Debian's libsentencepiece, not instrumented here): this fuzzes
// moetron's checks on what sentencepiece accepts, not sentencepiece's parser. Input: a tokenizer.model file.
// A finding is anything but a clean moetron::Error (a crash, a sanitizer report in moetron's code, a hang).
// MOETRON_FUZZ_SEED_OUT=<file>: first train a 300-piece model on a fixed text and write it there (the seed).
#include <cstdlib>
#include <fstream>
#include <string>

#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/data/tokenizer.h"

namespace {
bool write_seed() {
  if (const char* out = std::getenv("MOETRON_FUZZ_SEED_OUT")) {
    std::vector<std::string> texts = {"The harbor was quiet in the early morning.\nBoats rocked at their moorings.",
                                      "A workshop smells of sawdust and oil; the bench holds 42 tools."};
    moetron::data::TokenizerTrainOptions o;
    o.vocab_size = 300;
    std::ofstream(out, std::ios::binary) << moetron::data::Tokenizer::train_model(texts, o);
  }
  return true;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  static const bool seeded = write_seed();
  (void)seeded;
  data::Tokenizer t;
  try {
    t = data::Tokenizer::from_serialized(std::string(fuzz::as_text(data, size)));
  } catch (const Error&) {
    return 0;
  }
  (void)t.vocab_size(), (void)t.unk_id(), (void)t.bos_id(), (void)t.eos_id(), (void)t.newline_id();
  const std::string text = "The jury said\nit was \xc3\xa9t\xc3\xa9 42.\n";
  try {
    auto ids = t.encode(text);
    for (int32_t id : ids) (void)t.piece(id);
    (void)t.decode(ids);
  } catch (const Error&) {
  }
  return 0;
}
