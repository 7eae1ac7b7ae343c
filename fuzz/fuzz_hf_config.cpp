// fuzz_hf_config: feeds the Hugging Face config.json import (model_spec_from_hf_json, src/job/hf_config.cpp).
// Input: JSON text. A finding is anything but a clean moetron::Error (a crash, a sanitizer report, a hang or an
// nlohmann exception leaking out), or an imported spec that exports (export may refuse a spec HF cannot express,
// with a moetron::Error) to a config.json that does not import again.
#include <string>

#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  ModelSpec s;
  try {
    s = model_spec_from_hf_json(fuzz::as_text(data, size), "fuzz config.json");
  } catch (const Error&) {
    return 0;
  }
  std::string out;
  try {
    out = to_hf_config_json(s);  // may refuse, by design, a spec HF cannot express (docs/hf_export.md)
  } catch (const Error&) {
    return 0;
  }
  try {
    (void)model_spec_from_hf_json(out, "re-exported config.json");
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    fuzz::invariant_broken("an imported spec's exported config.json does not import");
  }
  return 0;
}
