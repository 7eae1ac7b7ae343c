// tracefile/fail.h: the tracefile library's one way to reject input: a moetron::Error whose text starts with
// the command's tag ("[trace] ", "[trace flight] ") and goes on with the parts given. Private to src/tracefile.
#pragma once
#include <sstream>

#include "moetron/check.h"

namespace moetron::tracefile {

template <class... A>
[[noreturn]] void fail_tagged(const char* tag, const A&... parts) {
  std::ostringstream os;
  os << tag;
  (os << ... << parts);
  throw moetron::Error(os.str());
}

}  // namespace moetron::tracefile
