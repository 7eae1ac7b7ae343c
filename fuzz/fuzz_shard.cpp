// fuzz_shard: feeds the token shard reader (decode_shard_header and Shard::open, src/data/shard.cpp), which the
// data loader runs on every shard of a prepared dataset; an opened shard is then read in full. Input: a whole
// "MTTOK" shard file (written to a scratch file, since Shard::open maps a path). A finding is anything but a
// clean moetron::Error: a crash, an out-of-bounds read past the mapping, a hang, or a token read back that is not
// below the header's vocab size.
#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/data/shard.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  try {
    (void)data::decode_shard_header(data, size, "fuzz header");
  } catch (const Error&) {
  }
  const auto path = fuzz::scratch_dir("shard") / "shard.bin";
  fuzz::write_bytes(path, data, size);
  try {
    data::Shard s = data::Shard::open(path.string());
    for (int32_t t : s.read_all())
      if (t < 0 || uint32_t(t) >= s.header().vocab_size) fuzz::invariant_broken("a token outside the vocabulary");
  } catch (const Error&) {
  }
  return 0;
}
