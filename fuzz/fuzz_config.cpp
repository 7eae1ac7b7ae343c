// fuzz_config: feeds the TOML job-config loader (load_config_string, src/job/config.cpp) and its
// `--section.key=value` overrides. Input: TOML text; after a line that is exactly "%%", one override per line.
// A finding is anything but a clean moetron::Error: a crash, a sanitizer report, a hang, a toml++/nlohmann
// exception leaking out, or a loaded config whose to_toml() text does not load back to the same config.
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  std::vector<std::string> overrides;
  std::string_view toml = fuzz::split_at_marker(fuzz::as_text(data, size), "%%", &overrides);
  JobConfig c;
  try {
    c = load_config_string(toml, overrides, "fuzz.toml");
  } catch (const Error&) {
    return 0;
  }
  JobConfig back;
  try {
    back = load_config_string(to_toml(c), {}, "round-trip");
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    fuzz::invariant_broken("to_toml(config) does not load back");
  }
  if (!(back == c)) fuzz::invariant_broken("load_config_string(to_toml(c)) != c");
  return 0;
}
