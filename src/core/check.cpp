// check.cpp: path shortening for check messages ("src/kernels/gemm.cpp" rather than an absolute path).
#include "moetron/check.h"

#include <cstring>

namespace moetron::detail {

const char* short_path(const char* file) {
  for (const char* root : {"/src/", "/include/", "/tests/", "/tools/", "/bench/"}) {
    if (const char* p = std::strstr(file, root)) return p + 1;
  }
  return file;
}

}  // namespace moetron::detail
