// shard.cpp: token shard writer (atomic) and reader (mmap + full verification). Format in shard.h.
#include "moetron/data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "io.h"
#include "moetron/check.h"
#include "moetron/data/crc32c.h"

namespace moetron::data {

namespace {
// Header field offsets (bytes).
constexpr size_t kOffMagic = 0, kOffVersion = 8, kOffTokenBytes = 12, kOffNumTokens = 16, kOffNumDocs = 24,
                 kOffVocab = 32, kOffEos = 36, kOffPayloadCrc = 40, kOffReserved = 44, kOffHeaderCrc = 60;

void put32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(p[i]) << (8 * i);
  return v;
}
uint64_t get64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}
std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", v);
  return b;
}
// The first bytes of a file, printable, for "bad magic" messages.
std::string show_bytes(const unsigned char* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = p[i];
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      s += char(c);
    } else {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      s += b;
    }
  }
  return s;
}
}  // namespace

uint32_t shard_token_bytes(uint32_t vocab_size) { return vocab_size <= 65536u ? 2u : 4u; }

void encode_shard_header(const ShardHeader& h, unsigned char out[kShardHeaderBytes]) {
  std::memset(out, 0, kShardHeaderBytes);
  std::memcpy(out + kOffMagic, kShardMagic, 8);
  put32(out + kOffVersion, h.version);
  put32(out + kOffTokenBytes, h.token_bytes);
  put64(out + kOffNumTokens, h.num_tokens);
  put64(out + kOffNumDocs, h.num_documents);
  put32(out + kOffVocab, h.vocab_size);
  put32(out + kOffEos, h.eos_id);
  put32(out + kOffPayloadCrc, h.payload_crc32c);
  put32(out + kOffHeaderCrc, crc32c(out, kOffHeaderCrc));
}

ShardHeader decode_shard_header(const unsigned char* b, size_t file_size, const std::string& path) {
  MT_CHECK(file_size >= kShardHeaderBytes, "shard", path, ": truncated shard: the file has ", file_size,
           " bytes, the header alone needs ", kShardHeaderBytes);
  MT_CHECK(std::memcmp(b + kOffMagic, kShardMagic, 8) == 0, "shard", path,
           ": not a moetron token shard: bad magic \"", show_bytes(b, 8), "\", expected \"MTTOK\\x00\\x00\\x00\"");
  ShardHeader h;
  h.version = get32(b + kOffVersion);
  MT_CHECK(h.version == kShardVersion, "shard", path, ": unsupported shard version ", h.version,
           " (this build reads version ", kShardVersion, ")");
  uint32_t stored = get32(b + kOffHeaderCrc), computed = crc32c(b, kOffHeaderCrc);
  MT_CHECK(stored == computed, "shard", path, ": corrupt shard header: header CRC-32C is ", hex32(computed),
           ", the header says ", hex32(stored));
  h.token_bytes = get32(b + kOffTokenBytes);
  h.num_tokens = get64(b + kOffNumTokens);
  h.num_documents = get64(b + kOffNumDocs);
  h.vocab_size = get32(b + kOffVocab);
  h.eos_id = get32(b + kOffEos);
  h.payload_crc32c = get32(b + kOffPayloadCrc);
  MT_CHECK(h.token_bytes == 2 || h.token_bytes == 4, "shard", path, ": bad dtype: ", h.token_bytes,
           " bytes per token (expected 2 or 4)");
  MT_CHECK(h.vocab_size > 0 && h.token_bytes >= shard_token_bytes(h.vocab_size), "shard", path, ": vocab size ",
           h.vocab_size, " does not fit ", h.token_bytes, "-byte tokens");
  MT_CHECK(h.eos_id < h.vocab_size, "shard", path, ": eos id ", h.eos_id, " outside the vocabulary (",
           h.vocab_size, ")");
  const uint64_t payload = file_size - kShardHeaderBytes;
  MT_CHECK(h.num_tokens <= payload / h.token_bytes, "shard", path, ": truncated shard: the header says ",
           h.num_tokens, " tokens (", h.num_tokens * h.token_bytes, " payload bytes), the file has ", payload,
           " payload bytes");
  MT_CHECK(h.num_tokens * h.token_bytes == payload, "shard", path, ": ", payload - h.num_tokens * h.token_bytes,
           " unexpected trailing bytes after ", h.num_tokens, " tokens");
  return h;
}

ShardHeader write_shard(const std::string& path, const int32_t* tokens, size_t n, uint32_t vocab_size,
                        uint32_t eos_id) {
  MT_CHECK(n == 0 || tokens, "shard", "null tokens for ", path);
  MT_CHECK(vocab_size > 0 && eos_id < vocab_size, "shard", "bad vocab_size ", vocab_size, " / eos_id ", eos_id,
           " for ", path);
  ShardHeader h;
  h.token_bytes = shard_token_bytes(vocab_size);
  h.num_tokens = n;
  h.vocab_size = vocab_size;
  h.eos_id = eos_id;
  std::string payload(n * h.token_bytes, '\0');
  auto* p = reinterpret_cast<unsigned char*>(payload.data());
  for (size_t i = 0; i < n; ++i) {
    MT_CHECK(tokens[i] >= 0 && uint32_t(tokens[i]) < vocab_size, "shard", "token ", tokens[i], " at index ", i,
             " outside the vocabulary [0, ", vocab_size, ") writing ", path);
    if (uint32_t(tokens[i]) == eos_id) ++h.num_documents;
    if (h.token_bytes == 2) {
      p[2 * i] = static_cast<unsigned char>(tokens[i]);
      p[2 * i + 1] = static_cast<unsigned char>(tokens[i] >> 8);
    } else {
      put32(p + 4 * i, uint32_t(tokens[i]));
    }
  }
  h.payload_crc32c = crc32c(payload.data(), payload.size());
  unsigned char head[kShardHeaderBytes];
  encode_shard_header(h, head);
  io::write_file_atomic(path, {std::string_view(reinterpret_cast<char*>(head), kShardHeaderBytes), payload});
  return h;
}

Shard Shard::open(const std::string& path) {
  Shard s;
  s.path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MT_CHECK(fd >= 0, "shard", path, ": cannot open shard: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    MT_FAIL("shard", path, ": cannot stat: ", std::strerror(e));
  }
  size_t bytes = size_t(st.st_size);
  if (bytes > 0) {
    void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    ::close(fd);
    MT_CHECK(m != MAP_FAILED, "shard", path, ": mmap failed: ", std::strerror(e));
    s.map_ = m;
    s.map_bytes_ = bytes;
  } else {
    ::close(fd);
  }
  const auto* b = static_cast<const unsigned char*>(s.map_);
  unsigned char empty[1] = {0};
  s.h_ = decode_shard_header(b ? b : empty, bytes, path);
  s.payload_ = b + kShardHeaderBytes;
  const size_t payload = bytes - kShardHeaderBytes;
  uint32_t computed = crc32c(s.payload_, payload);
  MT_CHECK(computed == s.h_.payload_crc32c, "shard", path, ": corrupt shard payload: CRC-32C of the ",
           s.h_.num_tokens, " tokens is ", hex32(computed), ", the header says ", hex32(s.h_.payload_crc32c));
  // Ids are checked once here, so readers never see an id outside the vocabulary.
  uint32_t max_id = 0;
  uint64_t max_at = 0;
  for (uint64_t i = 0; i < s.h_.num_tokens; ++i) {
    uint32_t v = s.h_.token_bytes == 2 ? uint32_t(s.payload_[2 * i]) | uint32_t(s.payload_[2 * i + 1]) << 8
                                       : get32(s.payload_ + 4 * i);
    if (v > max_id) max_id = v, max_at = i;
  }
  MT_CHECK(s.h_.num_tokens == 0 || max_id < s.h_.vocab_size, "shard", path, ": token ", max_id, " at index ", max_at,
           " is outside the vocabulary (", s.h_.vocab_size, ")");
  return s;
}

Shard::~Shard() {
  if (map_) ::munmap(map_, map_bytes_);
}
Shard::Shard(Shard&& o) noexcept { *this = std::move(o); }
Shard& Shard::operator=(Shard&& o) noexcept {
  if (this != &o) {
    if (map_) ::munmap(map_, map_bytes_);
    path_ = std::move(o.path_);
    h_ = o.h_;
    map_ = o.map_;
    map_bytes_ = o.map_bytes_;
    payload_ = o.payload_;
    o.map_ = nullptr;
    o.map_bytes_ = 0;
    o.payload_ = nullptr;
  }
  return *this;
}

int32_t Shard::token(uint64_t i) const {
  MT_CHECK(i < h_.num_tokens, "shard", path_, ": token index ", i, " out of range (", h_.num_tokens, " tokens)");
  int32_t v;
  read(&v, i, 1);
  return v;
}

void Shard::read(int32_t* out, uint64_t first, uint64_t n) const {
  MT_CHECK(first <= h_.num_tokens && n <= h_.num_tokens - first, "shard", path_, ": read [", first, ", ",
           first + n, ") past the end (", h_.num_tokens, " tokens)");
  if (h_.token_bytes == 2) {
    const unsigned char* p = payload_ + 2 * first;
    for (uint64_t k = 0; k < n; ++k) out[k] = int32_t(uint32_t(p[2 * k]) | uint32_t(p[2 * k + 1]) << 8);
  } else {
    const unsigned char* p = payload_ + 4 * first;
    for (uint64_t k = 0; k < n; ++k) out[k] = int32_t(get32(p + 4 * k));
  }
}

std::vector<int32_t> Shard::read_all() const {
  std::vector<int32_t> v(h_.num_tokens);
  read(v.data(), 0, h_.num_tokens);
  return v;
}

}  // namespace moetron::data
