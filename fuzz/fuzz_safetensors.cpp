// fuzz_safetensors: feeds the safetensors reader (SafetensorsFile::from_bytes, src/train/safetensors.cpp), the
// checks behind every model, optimizer and HF weight file moetron opens, then reads each tensor the way the
// loaders do (bytes(), load_into with the tensor's own dtype and shape). Input: a whole .safetensors file. A
// finding is anything but a clean moetron::Error: a crash, an out-of-bounds read, an allocation driven by the
// header rather than by the file's size, or a leaked nlohmann exception.
#include <vector>

#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  SafetensorsFile f;
  try {
    f = SafetensorsFile::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz.safetensors");
  } catch (const Error&) {
    return 0;
  }
  (void)f.metadata();
  for (const auto& t : f.tensors()) {
    if (t.end < t.begin || t.end - t.begin > size) fuzz::invariant_broken("a tensor's byte range exceeds the file");
    auto b = f.bytes(t.name);
    if (b.size() != t.bytes()) fuzz::invariant_broken("bytes(name).size() != info.bytes()");
    std::vector<uint8_t> dst(b.size() + 1);
    try {
      load_into(f, t.name, t.dtype, t.shape, dst.data());
    } catch (const Error&) {
    }
  }
  return 0;
}
