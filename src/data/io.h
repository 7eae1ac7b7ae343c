// io.h (private to src/data): whole-file reads and atomic writes (temp file, fsync, rename, fsync dir).
// Not a general I/O layer: files here are at most a few GB and written once.
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace moetron::data::io {

// Writes the concatenation of `parts` to `path` atomically: a reader sees the old file or the
// complete new one, never a torn one. Creates missing parent directories.
void write_file_atomic(const std::string& path, const std::vector<std::string_view>& parts);
std::string read_file(const std::string& path);  // throws moetron::Error naming the file

}  // namespace moetron::data::io
