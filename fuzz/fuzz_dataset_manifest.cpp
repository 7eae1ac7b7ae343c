// fuzz_dataset_manifest: feeds the dataset manifest reader (load_dataset, src/data/prepare.cpp), the dataset.json
// that `data prepare` writes and `train` reads before it opens any shard. Input: the dataset.json text (written
// to a scratch directory). A finding is anything but a clean moetron::Error (a crash, a sanitizer report, a hang,
// an nlohmann exception leaking out).
#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/data/prepare.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
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
