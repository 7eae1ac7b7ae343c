// fuzz_dataset_manifest: feeds the dataset manifest reader (load_dataset, src/data/prepare.cpp), the dataset.json
// that `data prepare` writes and `train` reads before it opens any shard. Input: the dataset.json text (written
// to a scratch directory). A finding is anything but a clean moetron::Error (a crash, a sanitizer report, a hang,
// an nlohmann exception leaking out).
// MOETRON_FUZZ_SEED_OUT=<dir>: first prepare tests/data/text/corpus (300-piece vocabulary) into <dir> (the
// seed is <dir>/dataset.json; MOETRON_FUZZ_SOURCE overrides the text folder).
#include <cstdlib>

#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/data/prepare.h"

namespace {
bool write_seed() {
  if (const char* out = std::getenv("MOETRON_FUZZ_SEED_OUT")) {
    moetron::data::PrepareOptions o;
    const char* src = std::getenv("MOETRON_FUZZ_SOURCE");
    o.source = src ? src : "tests/data/text/corpus";
    o.out_dir = out;
    o.vocab_size = 300;
    o.verbose = false;
    moetron::data::prepare_dataset(o);
  }
  return true;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  static const bool seeded = write_seed();
  (void)seeded;
  const auto& dir = fuzz::scratch_dir("dataset_manifest");
  fuzz::write_bytes(dir / "dataset.json", data, size);
  try {
    data::DatasetInfo info = data::load_dataset(dir.string());
    (void)info.train_paths();
    (void)info.val_paths();
  } catch (const Error&) {
  }
  return 0;
}
