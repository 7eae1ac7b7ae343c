// test_util.h: small helpers shared by the unit tests.
#pragma once
#include <string>

#include "moetron/check.h"

namespace moetron::testing {

// The moetron::Error message of f(), or "" if it did not throw one.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace moetron::testing
