// safetensors.cpp: the safetensors writer (streaming, CRC32C on the fly) and the validating reader
// (mmap), written from the public format description. Also CRC32C (slicing-by-8, portable C++).
// Not a converter: dtypes are stored and returned exactly as given.
#include "moetron/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "moetron/check.h"

namespace moetron {

namespace {

constexpr const char* kOp = "safetensors";
// A sanity cap on the JSON header (the reference implementation uses 100 MB as well).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// ---- CRC32C, slicing-by-8 ----
using CrcTables = std::array<std::array<uint32_t, 256>, 8>;
constexpr CrcTables make_crc_tables() {
  CrcTables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  return t;
}
constexpr CrcTables kCrc = make_crc_tables();

std::string errno_str(int e) { return std::string(std::strerror(e)); }

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string offsets_str(uint64_t b, uint64_t e) {
  std::ostringstream os;  // (not string operator+: GCC 12 raises a false -Wrestrict on it here)
  os << "[" << b << ", " << e << "]";
  return os.str();
}

// numel(shape) * elem with overflow detection; false on overflow.
bool checked_bytes(const Shape& shape, size_t elem, uint64_t* out) {
  uint64_t n = elem;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (__builtin_mul_overflow(n, uint64_t(d), &n)) return false;
  }
  *out = n;
  return true;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_;
};

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      MT_FAIL(kOp, path, ": write failed: ", errno_str(errno));
    }
    p += w;
    n -= size_t(w);
  }
}

}  // namespace

uint32_t crc32c_update(uint32_t crc, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo = uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
    uint32_t hi = uint32_t(p[4]) | uint32_t(p[5]) << 8 | uint32_t(p[6]) << 16 | uint32_t(p[7]) << 24;
    lo ^= c;
    c = kCrc[7][lo & 0xff] ^ kCrc[6][(lo >> 8) & 0xff] ^ kCrc[5][(lo >> 16) & 0xff] ^ kCrc[4][lo >> 24] ^
        kCrc[3][hi & 0xff] ^ kCrc[2][(hi >> 8) & 0xff] ^ kCrc[1][(hi >> 16) & 0xff] ^ kCrc[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ kCrc[0][(c ^ *p++) & 0xff];
  return ~c;
}

std::string_view safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F8E4M3: return "F8_E4M3";
    case DType::F8E5M2: return "F8_E5M2";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
  }
  MT_FAIL(kOp, "unknown dtype ", int(t));
}

bool safetensors_dtype_from_name(std::string_view name, DType* out) {
  for (DType t : {DType::F32, DType::BF16, DType::F8E4M3, DType::F8E5M2, DType::I32, DType::I64, DType::U8}) {
    if (safetensors_dtype_name(t) == name) {
      *out = t;
      return true;
    }
  }
  return false;
}

// ------------------------------------------------------------------------------------------------
// Writer
// ------------------------------------------------------------------------------------------------

SafetensorsWriteResult write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                                         const std::map<std::string, std::string>& metadata,
                                         const SafetensorsWriteOptions& opt) {
  // Validate the request before touching the file system.
  std::unordered_set<std::string> seen;
  for (const auto& t : tensors) {
    MT_CHECK(!t.name.empty(), kOp, path, ": empty tensor name");
    MT_CHECK(t.name != "__metadata__", kOp, path, ": '__metadata__' is reserved and cannot name a tensor");
    MT_CHECK(seen.insert(t.name).second, kOp, path, ": duplicate tensor name '", t.name, "'");
    uint64_t want = 0;
    MT_CHECK(checked_bytes(t.shape, dtype_size(t.dtype), &want), kOp, path, ": tensor '", t.name,
             "' has an invalid shape ", shape_str(t.shape));
    MT_CHECK(want == t.bytes, kOp, path, ": tensor '", t.name, "' is given ", t.bytes, " bytes but shape ",
             shape_str(t.shape), " x ", dtype_name(t.dtype), " = ", want, " bytes");
    MT_CHECK(t.data != nullptr || t.bytes == 0, kOp, path, ": tensor '", t.name, "' has null data");
  }

  // Data order: decreasing element size (stable), so that each tensor is aligned to its element size.
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dtype_size(tensors[a].dtype) > dtype_size(tensors[b].dtype);
  });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const auto& t = tensors[i];
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    e["dtype"] = safetensors_dtype_name(t.dtype);
    e["shape"] = t.shape;
    e["data_offsets"] = {offset, offset + t.bytes};
    header[t.name] = std::move(e);
    offset += t.bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& ex) {
    MT_FAIL(kOp, path, ": cannot encode header (names and metadata must be valid UTF-8): ", ex.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // pad so the data section starts 8-byte aligned

  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(text.size()) >> (8 * i));

  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  MT_CHECK(fd.get() >= 0, kOp, path, ": cannot create file: ", errno_str(errno));
  SafetensorsWriteResult r;
  auto put = [&](const void* p, size_t n) {
    if (n == 0) return;
    write_all(fd.get(), p, n, path);
    r.crc32c = crc32c_update(r.crc32c, p, n);
    r.file_bytes += n;
  };
  put(len, 8);
  put(text.data(), text.size());
  for (size_t i : order) put(tensors[i].data, tensors[i].bytes);
  if (opt.fsync) MT_CHECK(::fsync(fd.get()) == 0, kOp, path, ": fsync failed: ", errno_str(errno));
  int raw = fd.release();
  MT_CHECK(::close(raw) == 0, kOp, path, ": close failed: ", errno_str(errno));
  return r;
}

// ------------------------------------------------------------------------------------------------
// Reader
// ------------------------------------------------------------------------------------------------

struct SafetensorsFile::Impl {
  std::string path;
  const uint8_t* base = nullptr;  // whole file image
  uint64_t size = 0;
  void* map = nullptr;  // mmap'd region (or null when backed by `owned`)
  std::vector<uint8_t> owned;
  uint64_t header_len = 0;
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsTensorInfo> tensors;  // data order
  std::unordered_map<std::string, size_t> index;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (map) ::munmap(map, size);
  }

  const uint8_t* data_section() const { return base + 8 + header_len; }
  void parse();
};

void SafetensorsFile::Impl::parse() {
  const std::string& p = path;
  MT_CHECK(size >= 8, kOp, p, ": file is ", size, " bytes, shorter than the 8-byte header length field");
  header_len = read_le64(base);
  MT_CHECK(header_len > 0, kOp, p, ": header length is 0 (a header is at least '{}')");
  MT_CHECK(header_len <= size - 8, kOp, p, ": header length ", header_len, " exceeds the file size (", size,
           " bytes; at most ", size - 8, " header bytes are available; file truncated or not safetensors?)");
  MT_CHECK(header_len <= kMaxHeaderBytes, kOp, p, ": header length ", header_len, " exceeds the ",
           kMaxHeaderBytes, "-byte limit");
  const char* hb = reinterpret_cast<const char*>(base + 8);
  MT_CHECK(hb[0] == '{', kOp, p, ": header does not start with '{' (found byte 0x", std::hex,
           int(uint8_t(hb[0])), std::dec, ")");
  const uint64_t data_size = size - 8 - header_len;

  // Parse, catching duplicate keys in any object (nlohmann keeps the last one silently).
  std::vector<std::unordered_set<std::string>> keys;
  std::string duplicate;
  nlohmann::json::parser_callback_t cb = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json& v) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start) keys.emplace_back();
    else if (ev == E::object_end) keys.pop_back();
    else if (ev == E::key && !keys.empty() && !keys.back().insert(v.get<std::string>()).second &&
             duplicate.empty())
      duplicate = v.get<std::string>();
    return true;
  };
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(hb, hb + header_len, cb);
  } catch (const nlohmann::json::exception& ex) {
    MT_FAIL(kOp, p, ": header is not valid JSON: ", ex.what());
  }
  MT_CHECK(duplicate.empty(), kOp, p, ": header has duplicate key '", duplicate, "'");
  MT_CHECK(h.is_object(), kOp, p, ": header is not a JSON object");

  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      MT_CHECK(v.is_object(), kOp, p, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        MT_CHECK(m.value().is_string(), kOp, p, ": __metadata__ value for key '", m.key(), "' is not a string");
        metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    MT_CHECK(!name.empty(), kOp, p, ": empty tensor name");
    MT_CHECK(v.is_object(), kOp, p, ": tensor '", name, "' entry is not an object");
    for (auto k = v.begin(); k != v.end(); ++k)
      MT_CHECK(k.key() == "dtype" || k.key() == "shape" || k.key() == "data_offsets", kOp, p, ": tensor '",
               name, "' has unexpected field '", k.key(), "'");
    SafetensorsTensorInfo t;
    t.name = name;
    // dtype
    MT_CHECK(v.contains("dtype") && v["dtype"].is_string(), kOp, p, ": tensor '", name,
             "' has no string field 'dtype'");
    const std::string ds = v["dtype"].get<std::string>();
    MT_CHECK(safetensors_dtype_from_name(ds, &t.dtype), kOp, p, ": tensor '", name, "' has unknown dtype '", ds,
             "' (supported: F32, BF16, F8_E4M3, F8_E5M2, I32, I64, U8)");
    // shape
    MT_CHECK(v.contains("shape") && v["shape"].is_array(), kOp, p, ": tensor '", name,
             "' has no array field 'shape'");
    for (const auto& d : v["shape"]) {
      MT_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()), kOp,
               p, ": tensor '", name, "' shape ", v["shape"].dump(), " has an entry that is not a non-negative integer");
      t.shape.push_back(int64_t(d.get<uint64_t>()));
    }
    // data_offsets
    const nlohmann::json* off = v.contains("data_offsets") ? &v["data_offsets"] : nullptr;
    MT_CHECK(off && off->is_array() && off->size() == 2 && (*off)[0].is_number_unsigned() &&
                 (*off)[1].is_number_unsigned(),
             kOp, p, ": tensor '", name, "' data_offsets ", off ? off->dump() : std::string("(missing)"),
             " is not a pair of non-negative integers");
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    MT_CHECK(t.begin <= t.end, kOp, p, ": tensor '", name, "' data_offsets ", offsets_str(t.begin, t.end),
             " end before begin");
    MT_CHECK(t.end <= data_size, kOp, p, ": tensor '", name, "' data_offsets ", offsets_str(t.begin, t.end),
             " out of range: the data section is ", data_size, " bytes (file truncated?)");
    uint64_t want = 0;
    MT_CHECK(checked_bytes(t.shape, dtype_size(t.dtype), &want), kOp, p, ": tensor '", name, "' shape ",
             shape_str(t.shape), " x ", dtype_name(t.dtype), " overflows 64 bits");
    MT_CHECK(t.end - t.begin == want, kOp, p, ": tensor '", name, "' data_offsets ", offsets_str(t.begin, t.end),
             " do not match shape ", shape_str(t.shape), " x ", dtype_name(t.dtype), " = ", want, " bytes");
    tensors.push_back(std::move(t));
  }

  // Coverage: sorted by offsets, each tensor starts where the previous one ended; the last ends at the
  // end of the file.
  std::stable_sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const SafetensorsTensorInfo* prev = nullptr;
  for (const auto& t : tensors) {
    MT_CHECK(t.begin >= cursor, kOp, p, ": tensor '", t.name, "' data_offsets ", offsets_str(t.begin, t.end),
             " overlap tensor '", prev ? prev->name : "", "' data_offsets ",
             prev ? offsets_str(prev->begin, prev->end) : "");
    MT_CHECK(t.begin == cursor, kOp, p, ": gap in the data section: bytes ", offsets_str(cursor, t.begin),
             " before tensor '", t.name, "' belong to no tensor");
    cursor = t.end;
    prev = &t;
  }
  MT_CHECK(cursor == data_size, kOp, p, ": the data section is ", data_size, " bytes but the tensors cover only ",
           cursor, " (", data_size - cursor, " trailing bytes belong to no tensor)");
  for (size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  MT_CHECK(fd.get() >= 0, kOp, path, ": cannot open: ", errno_str(errno));
  struct stat st {};
  MT_CHECK(::fstat(fd.get(), &st) == 0, kOp, path, ": fstat failed: ", errno_str(errno));
  MT_CHECK(S_ISREG(st.st_mode), kOp, path, ": not a regular file");
  impl->size = uint64_t(st.st_size);
  if (impl->size > 0) {
    void* m = ::mmap(nullptr, impl->size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    MT_CHECK(m != MAP_FAILED, kOp, path, ": mmap failed: ", errno_str(errno));
    impl->map = m;
    impl->base = static_cast<const uint8_t*>(m);
  }
  impl->parse();
  SafetensorsFile f;
  f.impl_ = std::move(impl);
  return f;
}

SafetensorsFile SafetensorsFile::from_bytes(std::vector<uint8_t> bytes, const std::string& label) {
  auto impl = std::make_shared<Impl>();
  impl->path = label;
  impl->owned = std::move(bytes);
  impl->base = impl->owned.data();
  impl->size = impl->owned.size();
  impl->parse();
  SafetensorsFile f;
  f.impl_ = std::move(impl);
  return f;
}

#define MT_ST_OPEN() MT_CHECK(impl_ != nullptr, kOp, "SafetensorsFile is not open")

const std::string& SafetensorsFile::path() const {
  MT_ST_OPEN();
  return impl_->path;
}
const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  MT_ST_OPEN();
  return impl_->metadata;
}
const std::vector<SafetensorsTensorInfo>& SafetensorsFile::tensors() const {
  MT_ST_OPEN();
  return impl_->tensors;
}
bool SafetensorsFile::contains(const std::string& name) const {
  MT_ST_OPEN();
  return impl_->index.count(name) != 0;
}
const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& name) const {
  MT_ST_OPEN();
  auto it = impl_->index.find(name);
  MT_CHECK(it != impl_->index.end(), kOp, impl_->path, ": tensor '", name, "' not found (the file has ",
           impl_->tensors.size(), " tensors)");
  return impl_->tensors[it->second];
}
std::span<const uint8_t> SafetensorsFile::bytes(const std::string& name) const {
  const auto& t = info(name);
  return {impl_->data_section() + t.begin, size_t(t.bytes())};
}
std::span<const uint8_t> SafetensorsFile::file_bytes() const {
  MT_ST_OPEN();
  return {impl_->base, size_t(impl_->size)};
}
uint64_t SafetensorsFile::header_bytes() const {
  MT_ST_OPEN();
  return impl_->header_len;
}

// ------------------------------------------------------------------------------------------------
// Loading into caller memory
// ------------------------------------------------------------------------------------------------

void load_into(const SafetensorsFile& f, const std::string& name, DType dtype, const Shape& shape, void* dst) {
  const auto& t = f.info(name);
  MT_CHECK(t.dtype == dtype, kOp, f.path(), ": tensor '", name, "' has dtype ", dtype_name(t.dtype),
           ", expected ", dtype_name(dtype));
  MT_CHECK(t.shape == shape, kOp, f.path(), ": tensor '", name, "' has shape ", shape_str(t.shape),
           ", expected ", shape_str(shape));
  auto b = f.bytes(name);
  MT_CHECK(dst != nullptr || b.empty(), kOp, f.path(), ": null destination for tensor '", name, "'");
  if (!b.empty()) std::memcpy(dst, b.data(), b.size());
}

void load_tensors(const SafetensorsFile& f, const std::vector<TensorSlot>& slots, bool allow_unexpected) {
  constexpr size_t kMaxListed = 16;
  std::vector<std::string> missing, mismatched, unexpected, dup;
  std::unordered_set<std::string> wanted;
  for (const auto& s : slots) {
    if (!wanted.insert(s.name).second) dup.push_back("'" + s.name + "'");
    if (!f.contains(s.name)) {
      missing.push_back("'" + s.name + "'");
      continue;
    }
    const auto& t = f.info(s.name);
    if (t.dtype != s.dtype || t.shape != s.shape) {
      mismatched.push_back("'" + s.name + "' (file " + shape_str(t.shape) + " x " + std::string(dtype_name(t.dtype)) +
                           ", expected " + shape_str(s.shape) + " x " + std::string(dtype_name(s.dtype)) + ")");
    }
  }
  if (!allow_unexpected)
    for (const auto& t : f.tensors())
      if (!wanted.count(t.name)) unexpected.push_back("'" + t.name + "'");
  if (!missing.empty() || !mismatched.empty() || !unexpected.empty() || !dup.empty()) {
    std::ostringstream os;
    auto list = [&](const char* what, const std::vector<std::string>& v) {
      if (v.empty()) return;
      os << "; " << v.size() << " " << what << ": ";
      for (size_t i = 0; i < v.size() && i < kMaxListed; ++i) os << (i ? ", " : "") << v[i];
      if (v.size() > kMaxListed) os << ", ... (" << v.size() - kMaxListed << " more)";
    };
    list("missing", missing);
    list("mismatched", mismatched);
    list("unexpected", unexpected);
    list("requested twice", dup);
    MT_FAIL(kOp, f.path(), ": tensors do not match the model", os.str());
  }
  for (const auto& s : slots) load_into(f, s.name, s.dtype, s.shape, s.data);
}

}  // namespace moetron
