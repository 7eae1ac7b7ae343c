// fuzz_pp_layout: feeds the pipeline layout grammar (expand_pp_layout, parse_pp_layout; src/schedule/pp_layout.cpp).
// Input: a first line "n_layers pp n_stages v_shape" (four integers; missing ones default to 4 2 0 0, values are
// clamped to what a validated config can hold), then the layout text, e.g. "Et|tt|t|tL". A finding is anything
// but a clean moetron::Error, or an accepted layout whose canonical text does not parse back to the same layout.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "fuzz_common.h"
#include "moetron/check.h"
#include "moetron/pp_layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moetron;
  std::string_view in = fuzz::as_text(data, size);
  size_t eol = in.find('\n');
  std::string head(in.substr(0, eol));
  std::string_view text = eol == std::string_view::npos ? std::string_view() : in.substr(eol + 1);
  long long v[4] = {4, 2, 0, 0};
  const char* p = head.c_str();
  for (int i = 0; i < 4; ++i) {
    char* end = nullptr;
    long long x = std::strtoll(p, &end, 10);
    if (end == p) break;
    v[i] = x;
    p = end;
  }
  // The limits config validation applies before a layout is parsed (n_layers <= 2^14, pp <= 2^14).
  const int64_t n_layers = std::clamp<long long>(v[0], 0, 1 << 14);
  const int pp = int(std::clamp<long long>(v[1], 1, 1 << 14));
  const int n_stages = int(std::clamp<long long>(v[2], 0, 1 << 15));
  const bool v_shape = v[3] != 0;
  try {
    (void)sched::expand_pp_layout(text);
  } catch (const Error&) {
  }
  sched::PpLayout l;
  try {
    l = sched::parse_pp_layout(text, n_layers, pp, n_stages, v_shape);
  } catch (const Error&) {
    return 0;
  }
  (void)l.describe();
  try {
    if (!(sched::parse_pp_layout(l.to_string(), n_layers, pp, n_stages, v_shape) == l))
      fuzz::invariant_broken("parse_pp_layout(layout.to_string()) != layout");
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    fuzz::invariant_broken("a parsed layout's canonical text does not parse");
  }
  return 0;
}
