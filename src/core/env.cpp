// env.cpp: the environment knobs' readers (env.h). Not a config loader.
#include "moetron/env.h"

#include <cerrno>
#include <cstdlib>

#include "moetron/check.h"

namespace moetron {

std::string env_choice(const char* name, const char* fallback, std::initializer_list<const char*> choices,
                       const char* op) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  std::string allowed;
  size_t k = 0;
  for (const char* c : choices) {
    if (std::string(c) == v) return v;
    allowed += std::string(k == 0 ? "" : k + 1 == choices.size() ? " or " : ", ") + "'" + c + "'";
    ++k;
  }
  MT_FAIL(op, name, " must be ", allowed, ", not '", v, "'");
}

int64_t env_int_in(const char* name, int64_t fallback, int64_t lo, int64_t hi, const char* op) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  MT_CHECK(end != v && *end == '\0' && errno == 0 && x >= lo && x <= hi, op, name, " must be an integer in [", lo,
           ", ", hi, "], not '", v, "'");
  return int64_t(x);
}

}  // namespace moetron
