// fuzz_tokenizer: feeds moetron's tokenizer wrapper (Tokenizer::from_serialized, src/data/tokenizer.cpp) with a
// tokenizer.model file, then encodes and decodes a fixed text with it and asks for every special id. The model
// proto itself is parsed by sentencepiece (Debian's libsentencepiece, not instrumented here): this fuzzes
// moetron's checks on what sentencepiece accepts, not sentencepiece's parser. Input: a tokenizer.model file.
// A finding is anything but a clean moetron::Error (a crash, a sanitizer report in moetron's code, a hang).
#include <string>

#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
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
