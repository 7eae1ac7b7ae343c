// shard.h: token shards, moetron's binary file of token ids ("MTTOK", version 1).
// Layout (little-endian; spec and byte table in docs/data.md):
//   [0, 64)   header: magic "MTTOK\0\0\0", version, bytes per token (2 = u16, 4 = u32), token count,
//             document count, vocab size, eos id, CRC-32C of the payload, reserved zeros,
//             CRC-32C of header bytes [0, 60)
//   [64, ..)  payload: token_count ids of `bytes per token` each; documents end with eos
// Writes are atomic (temp file, fsync, rename). Opening checks, in this order: size >= 64, magic,
// version, header CRC, dtype, exact file size, payload CRC, ids < vocab; each failure is a
// moetron::Error naming the file and what is wrong.
// Not a general container: no compression, no index of document offsets (find eos if needed).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moetron::data {

inline constexpr char kShardMagic[8] = {'M', 'T', 'T', 'O', 'K', 0, 0, 0};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;

struct ShardHeader {
  uint32_t version = kShardVersion;
  uint32_t token_bytes = 2;  // 2 (u16) when vocab_size <= 65536, else 4 (u32)
  uint64_t num_tokens = 0;
  uint64_t num_documents = 0;
  uint32_t vocab_size = 0;
  uint32_t eos_id = 0;
  uint32_t payload_crc32c = 0;
};

// Bytes per token for a vocabulary: 2 when every id fits in u16, else 4.
uint32_t shard_token_bytes(uint32_t vocab_size);

// Serialize / parse the 64-byte header (parse does every header check; `path` names the file in errors).
void encode_shard_header(const ShardHeader& h, unsigned char out[kShardHeaderBytes]);
ShardHeader decode_shard_header(const unsigned char* bytes, size_t file_size, const std::string& path);

// Writes tokens[0, n) (each in [0, vocab_size)) atomically to `path`. Returns the header written.
ShardHeader write_shard(const std::string& path, const int32_t* tokens, size_t n, uint32_t vocab_size,
                        uint32_t eos_id);

// A shard opened read-only (memory-mapped) and fully verified. Movable, not copyable.
class Shard {
 public:
  static Shard open(const std::string& path);
  Shard() = default;
  ~Shard();
  Shard(Shard&&) noexcept;
  Shard& operator=(Shard&&) noexcept;
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  const ShardHeader& header() const { return h_; }
  const std::string& path() const { return path_; }
  uint64_t size() const { return h_.num_tokens; }
  int32_t token(uint64_t i) const;
  // out[k] = token(first + k) for k < n; first + n <= size().
  void read(int32_t* out, uint64_t first, uint64_t n) const;
  std::vector<int32_t> read_all() const;

 private:
  std::string path_;
  ShardHeader h_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* payload_ = nullptr;
};

}  // namespace moetron::data
