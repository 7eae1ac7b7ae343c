// fuzz_common.h: small helpers shared by the fuzz targets in fuzz/ (libFuzzer entry points, also linked into the
// gcc replay driver tests run). Not a test framework: a target calls the parser and lets anything other than a
// moetron::Error escape, so libFuzzer (or the replay driver) reports it.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace moetron::fuzz {

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A per-process scratch directory under the system temp dir (created once, removed at exit).
inline const std::filesystem::path& scratch_dir(const char* target) {
  struct Dir {
    std::filesystem::path p;
    explicit Dir(const char* t)
        : p(std::filesystem::temp_directory_path() / ("moetron-fuzz-" + std::string(t) + "-" + std::to_string(::getpid()))) {
      std::filesystem::create_directories(p);
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  };
  static Dir d(target);
  return d.p;
}

inline void write_bytes(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), std::streamsize(size));
}

// Splits text at the first line that is exactly `marker`: returns the part before it and the lines after it.
inline std::string_view split_at_marker(std::string_view text, std::string_view marker, std::vector<std::string>* rest) {
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    if (text.substr(pos, eol - pos) == marker) {
      std::string_view tail = eol < text.size() ? text.substr(eol + 1) : std::string_view();
      size_t p = 0;
      while (p < tail.size()) {
        size_t e = tail.find('\n', p);
        if (e == std::string_view::npos) e = tail.size();
        if (e > p) rest->emplace_back(tail.substr(p, e - p));
        p = e + 1;
      }
      return text.substr(0, pos);
    }
    if (eol == text.size()) break;
    pos = eol + 1;
  }
  return text;
}

// The check a target makes on its own invariants (e.g. a round trip): abort so the fuzzer reports it.
[[noreturn]] inline void invariant_broken(const char* what) {
  std::fprintf(stderr, "fuzz invariant broken: %s\n", what);
  std::abort();
}

}  // namespace moetron::fuzz
