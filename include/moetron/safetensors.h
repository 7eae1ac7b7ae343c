// safetensors.h: reader and writer for the safetensors file format, written from the public format
// description. A file is: an 8-byte little-endian header length N, N bytes of UTF-8 JSON mapping each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data section
// that follows the header) plus an optional "__metadata__" object of string -> string, then the data
// section: row-major little-endian tensors, contiguous, no gaps, no overlaps.
//
// The reader validates everything before handing out a byte (header length vs file size, JSON, dtypes,
// shapes, offsets vs dtype x shape, overlaps, gaps, trailing bytes, duplicate names) and throws
// moetron::Error naming the file, the tensor and the problem. The file is memory-mapped read-only.
// Not a tensor library: it hands out raw bytes plus (dtype, shape); load_into / load_tensors copy them
// into caller memory after checking the dtype and shape match exactly. No dtype conversion, ever.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moetron/dtype.h"
#include "moetron/tensor.h"

namespace moetron {

// Safetensors dtype strings: F32, BF16, F8_E4M3, F8_E5M2, I32, I64, U8.
std::string_view safetensors_dtype_name(DType t);
bool safetensors_dtype_from_name(std::string_view name, DType* out);  // false if unknown

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI / ext4. Incremental:
// crc32c_update(crc32c_update(0, a), b) == crc32c(a ++ b). crc32c("123456789") == 0xE3069283.
uint32_t crc32c_update(uint32_t crc, const void* data, size_t n);

// ---- writer ----

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  const void* data = nullptr;  // bytes, row-major; may be null only when bytes == 0
  size_t bytes = 0;            // must equal numel(shape) * dtype_size(dtype)
};

struct SafetensorsWriteResult {
  uint64_t file_bytes = 0;  // total bytes written (8 + header + data)
  uint32_t crc32c = 0;      // CRC32C of the whole file, computed while streaming
};

struct SafetensorsWriteOptions {
  bool fsync = false;  // fsync the file before closing it
};

// Streams the tensors to `path` (created or truncated). Tensors are laid out in the data section sorted
// by decreasing element size (stable), so every tensor is aligned to its element size given the 8-byte
// padded header. Throws on duplicate / empty names, a bytes/shape mismatch, or any I/O error.
SafetensorsWriteResult write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                                         const std::map<std::string, std::string>& metadata = {},
                                         const SafetensorsWriteOptions& opt = {});

// ---- reader ----

struct SafetensorsTensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // data_offsets, relative to the data section
  uint64_t bytes() const { return end - begin; }
};

class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  // Maps and validates the file. Throws moetron::Error "<path>: <problem>" on any violation.
  static SafetensorsFile open(const std::string& path);
  // Validates an in-memory image (used by tests and fuzzers); `label` names it in errors.
  static SafetensorsFile from_bytes(std::vector<uint8_t> bytes, const std::string& label);

  bool is_open() const { return impl_ != nullptr; }
  const std::string& path() const;
  const std::map<std::string, std::string>& metadata() const;
  // All tensors, in data-section order.
  const std::vector<SafetensorsTensorInfo>& tensors() const;
  bool contains(const std::string& name) const;
  const SafetensorsTensorInfo& info(const std::string& name) const;  // throws if absent
  // Raw bytes of one tensor (alignment follows the file layout; use load_into to copy safely).
  std::span<const uint8_t> bytes(const std::string& name) const;
  // The whole file image (for checksums).
  std::span<const uint8_t> file_bytes() const;
  uint64_t header_bytes() const;  // N, the JSON header length

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// Copies tensor `name` into dst after checking it is present with exactly this dtype and shape.
void load_into(const SafetensorsFile& f, const std::string& name, DType dtype, const Shape& shape, void* dst);

// One destination for load_tensors.
struct TensorSlot {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  void* data = nullptr;
};

// Checks the whole set first, then copies. Reports every missing, unexpected (unless allow_unexpected)
// and mismatched (dtype or shape) tensor by name in one error.
void load_tensors(const SafetensorsFile& f, const std::vector<TensorSlot>& slots, bool allow_unexpected = false);

}  // namespace moetron
