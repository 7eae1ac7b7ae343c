// check.h: runtime checks that report file:line, the op name and the offending values.
// Not an assertion framework: checks stay on in Release builds and throw moetron::Error.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace moetron {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
const char* short_path(const char* file);

template <class... A>
[[noreturn]] void check_fail(const char* file, int line, const char* op, const char* cond, const A&... args) {
  std::ostringstream os;
  os << short_path(file) << ":" << line << ": [" << op << "] ";
  if (cond && *cond) os << "check failed: " << cond;
  if constexpr (sizeof...(args) > 0) {
    if (cond && *cond) os << ": ";
    (os << ... << args);
  }
  throw Error(os.str());
}
}  // namespace detail
}  // namespace moetron

// MT_CHECK(cond, "op", "value ", x, " expected ", y);
#define MT_CHECK(cond, op, ...)                                                                     \
  do {                                                                                              \
    if (!(cond)) [[unlikely]]                                                                       \
      ::moetron::detail::check_fail(__FILE__, __LINE__, op, #cond __VA_OPT__(, ) __VA_ARGS__);      \
  } while (0)

// MT_FAIL("op", "what went wrong ", value);
#define MT_FAIL(op, ...) ::moetron::detail::check_fail(__FILE__, __LINE__, op, "" __VA_OPT__(, ) __VA_ARGS__)
