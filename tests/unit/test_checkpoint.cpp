// test_checkpoint.cpp: safetensors round trips and every corruption the reader must reject, a
// third-party (Python stdlib) cross-check of the format, and the checkpoint store: atomic save, keep-last-K
// pruning, resume discovery that skips incomplete/corrupt checkpoints, stale tmp dirs, simulated crashes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "moetron/checkpoint.h"
#include "moetron/check.h"
#include "moetron/dtype.h"
#include "moetron/safetensors.h"

using namespace moetron;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed afterwards.
struct TmpDir {
  fs::path p;
  TmpDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    p = fs::temp_directory_path() /
        ("moetron_ckpt_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(p);
    fs::create_directories(p);
  }
  ~TmpDir() {
    std::error_code ec;
    fs::remove_all(p, ec);
  }
  std::string operator/(const std::string& s) const { return (p / s).string(); }
};

template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
void write_file(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

// A raw safetensors image: 8-byte length (the real one unless overridden), header text, data bytes.
std::vector<uint8_t> raw_st(const std::string& header, size_t data_bytes, std::optional<uint64_t> len = {}) {
  uint64_t n = len ? *len : header.size();
  std::vector<uint8_t> out;
  out.reserve(8 + header.size() + data_bytes);
  for (int i = 0; i < 8; ++i) out.push_back(uint8_t(n >> (8 * i)));
  for (char c : header) out.push_back(uint8_t(c));
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(uint8_t(i * 7 + 1));
  return out;
}
SafetensorsFile parse_raw(const std::string& header, size_t data_bytes, std::optional<uint64_t> len = {}) {
  return SafetensorsFile::from_bytes(raw_st(header, data_bytes, len), "mem.safetensors");
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint8_t(seed + i * 31 + (i >> 3));
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// CRC32C
// ---------------------------------------------------------------------------------------------------

TEST(Crc32c, KnownVectorAndIncremental) {
  const char* s = "123456789";
  EXPECT_EQ(crc32c_update(0, s, 9), 0xE3069283u);  // the standard CRC-32C check value
  EXPECT_EQ(crc32c_update(0, nullptr, 0), 0u);
  auto big = pattern(1000, 3);
  uint32_t whole = crc32c_update(0, big.data(), big.size());
  for (size_t cut : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(513), size_t(999)}) {
    uint32_t c = crc32c_update(0, big.data(), cut);
    EXPECT_EQ(crc32c_update(c, big.data() + cut, big.size() - cut), whole) << "cut " << cut;
  }
  big[500] ^= 1;
  EXPECT_NE(crc32c_update(0, big.data(), big.size()), whole);
}

// ---------------------------------------------------------------------------------------------------
// safetensors round trips
// ---------------------------------------------------------------------------------------------------

TEST(Safetensors, RoundTripAllDtypesEmptyScalarAndMetadata) {
  TmpDir tmp;
  std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -7.0f};
  std::vector<bf16> b16;
  for (float x : {1.0f, -0.5f, 3.0e38f, 1e-20f, -0.0f}) b16.push_back(to_bf16(x));
  std::vector<fp8_e4m3> e4;
  for (float x : {448.0f, -1.0f, 0.015625f, 0.0f}) e4.push_back(to_e4m3(x));
  std::vector<fp8_e5m2> e5;
  for (float x : {57344.0f, -2.0f, 0.5f}) e5.push_back(to_e5m2(x));
  std::vector<int32_t> i32 = {-1, 2, 2147483647, -2147483647 - 1};
  int64_t i64 = 0x123456789abcdefLL;
  std::vector<uint8_t> u8 = {0, 1, 254, 255, 128, 7, 9};

  std::vector<SafetensorsEntry> in = {
      {"u8", DType::U8, {7}, u8.data(), u8.size()},
      {"layers.0.wq", DType::F32, {2, 3}, f32.data(), f32.size() * 4},
      {"b16", DType::BF16, {5}, b16.data(), b16.size() * 2},
      {"e4", DType::F8E4M3, {2, 2}, e4.data(), e4.size()},
      {"e5", DType::F8E5M2, {3, 1}, e5.data(), e5.size()},
      {"i32", DType::I32, {4}, i32.data(), i32.size() * 4},
      {"step", DType::I64, {}, &i64, 8},  // a scalar: shape []
      {"empty", DType::F32, {0, 3}, nullptr, 0},
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "héllo ✓"}};
  const std::string path = tmp / "all.safetensors";
  SafetensorsWriteResult w = write_safetensors(path, in, meta);

  auto bytes = read_file(path);
  EXPECT_EQ(w.file_bytes, bytes.size());
  EXPECT_EQ(w.crc32c, crc32c_update(0, bytes.data(), bytes.size()));

  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_EQ(f.header_bytes() % 8, 0u);  // header padded: the data section starts 8-byte aligned
  EXPECT_EQ(f.tensors().size(), in.size());
  for (const auto& e : in) {
    ASSERT_TRUE(f.contains(e.name)) << e.name;
    const auto& t = f.info(e.name);
    EXPECT_EQ(t.dtype, e.dtype) << e.name;
    EXPECT_EQ(t.shape, e.shape) << e.name;
    auto b = f.bytes(e.name);
    ASSERT_EQ(b.size(), e.bytes) << e.name;
    if (e.bytes) {
      EXPECT_EQ(std::memcmp(b.data(), e.data, e.bytes), 0) << e.name;
      // The writer orders tensors by decreasing element size, so each is naturally aligned.
      EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % dtype_size(e.dtype), 0u) << e.name;
    }
  }
  // Typed load through load_into.
  std::vector<float> back(6);
  load_into(f, "layers.0.wq", DType::F32, {2, 3}, back.data());
  EXPECT_EQ(back, f32);
  int64_t step = 0;
  load_into(f, "step", DType::I64, {}, &step);
  EXPECT_EQ(step, i64);
  load_into(f, "empty", DType::F32, {0, 3}, nullptr);
  std::vector<bf16> b16b(5);
  load_into(f, "b16", DType::BF16, {5}, b16b.data());
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(b16b[i].bits, b16[i].bits);

  // Same bytes through the in-memory path.
  SafetensorsFile g = SafetensorsFile::from_bytes(bytes, "copy");
  EXPECT_EQ(g.tensors().size(), in.size());
}

TEST(Safetensors, EmptyFileOfTensors) {
  TmpDir tmp;
  const std::string path = tmp / "none.safetensors";
  write_safetensors(path, {});
  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_TRUE(f.metadata().empty());
  EXPECT_EQ(read_file(path).size(), 16u);  // 8 + "{}" padded to 8
}

TEST(Safetensors, WriterRejectsBadRequests) {
  TmpDir tmp;
  float x[4] = {};
  expect_error([&] { write_safetensors(tmp / "a", {{"w", DType::F32, {2, 3}, x, 16}}); },
               "tensor 'w' is given 16 bytes but shape [2, 3] x f32 = 24 bytes");
  expect_error([&] { write_safetensors(tmp / "a", {{"w", DType::F32, {4}, x, 16}, {"w", DType::F32, {4}, x, 16}}); },
               "duplicate tensor name 'w'");
  expect_error([&] { write_safetensors(tmp / "a", {{"", DType::F32, {4}, x, 16}}); }, "empty tensor name");
  expect_error([&] { write_safetensors(tmp / "a", {{"__metadata__", DType::F32, {4}, x, 16}}); }, "reserved");
  expect_error([&] { write_safetensors(tmp / "a", {{"w", DType::F32, {4}, nullptr, 16}}); }, "null data");
  expect_error([&] { write_safetensors(tmp / "a", {{"w", DType::F32, {-1}, x, 0}}); }, "invalid shape");
  expect_error([&] { write_safetensors(tmp / "no/such/dir/a", {{"w", DType::F32, {4}, x, 16}}); },
               "cannot create file");
}

// ---------------------------------------------------------------------------------------------------
// safetensors corruptions: each must be a clear error naming the file and the problem
// ---------------------------------------------------------------------------------------------------

TEST(SafetensorsCorrupt, TruncatedFile) {
  TmpDir tmp;
  std::vector<float> a(16, 1.0f);
  const std::string path = tmp / "t.safetensors";
  write_safetensors(path, {{"a", DType::F32, {16}, a.data(), 64}});
  auto b = read_file(path);
  b.resize(b.size() - 4);
  write_file(path, b);
  expect_error([&] { SafetensorsFile::open(path); },
               path + ": tensor 'a' data_offsets [0, 64] out of range: the data section is 60 bytes (file truncated?)");
  b.resize(5);
  write_file(path, b);
  expect_error([&] { SafetensorsFile::open(path); }, path + ": file is 5 bytes, shorter than the 8-byte header");
  write_file(path, {});
  expect_error([&] { SafetensorsFile::open(path); }, "file is 0 bytes");
  expect_error([&] { SafetensorsFile::open(tmp / "missing.safetensors"); }, "cannot open");
}

TEST(SafetensorsCorrupt, HeaderLength) {
  const std::string h = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  EXPECT_NO_THROW(parse_raw(h, 4));
  expect_error([&] { parse_raw(h, 4, h.size() + 5); }, "mem.safetensors: header length");
  expect_error([&] { parse_raw(h, 4, h.size() + 5); }, "exceeds the file size");
  expect_error([&] { parse_raw(h, 4, uint64_t(1) << 62); }, "exceeds the file size");
  expect_error([&] { parse_raw(h, 4, 0); }, "header length is 0");
  // A length that is too small cuts the JSON.
  expect_error([&] { parse_raw(h, 4, h.size() - 3); }, "header is not valid JSON");
}

TEST(SafetensorsCorrupt, BadJson) {
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]})", 4); },
               "mem.safetensors: header is not valid JSON");
  expect_error([&] { parse_raw(R"({"a" "U8"})", 0); }, "header is not valid JSON");
  expect_error([&] { parse_raw("[1,2]   ", 0); }, "header does not start with '{'");
  expect_error([&] { parse_raw("{\"a\xff\":1}", 0); }, "header is not valid JSON");  // invalid UTF-8
  expect_error([&] { parse_raw(R"({"a":5})", 0); }, "tensor 'a' entry is not an object");
}

TEST(SafetensorsCorrupt, FieldsAndDtypes) {
  expect_error([&] { parse_raw(R"({"a":{"dtype":"Q4","shape":[4],"data_offsets":[0,4]}})", 4); },
               "mem.safetensors: tensor 'a' has unknown dtype 'Q4'");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", 4); },
               "unknown dtype 'F16'");
  expect_error([&] { parse_raw(R"({"a":{"shape":[4],"data_offsets":[0,4]}})", 4); },
               "tensor 'a' has no string field 'dtype'");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","data_offsets":[0,4]}})", 4); }, "no array field 'shape'");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}})", 4); },
               "not a non-negative integer");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[4.0],"data_offsets":[0,4]}})", 4); },
               "not a non-negative integer");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[4]}})", 4); }, "data_offsets (missing)");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0]}})", 4); },
               "is not a pair of non-negative integers");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":1}})", 4); },
               "tensor 'a' has unexpected field 'x'");
  expect_error([&] { parse_raw(R"({"__metadata__":{"k":1}})", 0); }, "__metadata__ value for key 'k' is not a string");
  expect_error([&] { parse_raw(R"({"__metadata__":[1]})", 0); }, "__metadata__ is not an object");
  expect_error([&] { parse_raw(R"({"":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})", 0); }, "empty tensor name");
}

TEST(SafetensorsCorrupt, DuplicateNames) {
  expect_error(
      [&] {
        parse_raw(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                  4);
      },
      "mem.safetensors: header has duplicate key 'a'");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 2); },
               "duplicate key 'dtype'");
}

TEST(SafetensorsCorrupt, OffsetsOutOfRangeOverlapGapMismatch) {
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", 4); },
               "tensor 'a' data_offsets [0, 8] out of range: the data section is 4 bytes");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[3,2]}})", 4); }, "end before begin");
  expect_error(
      [&] {
        parse_raw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                  6);
      },
      "tensor 'b' data_offsets [2, 6] overlap tensor 'a' data_offsets [0, 4]");
  // An empty tensor inside another one is an overlap too.
  expect_error(
      [&] {
        parse_raw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})",
                  4);
      },
      "overlap");
  expect_error(
      [&] {
        parse_raw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
                  10);
      },
      "gap in the data section: bytes [4, 6] before tensor 'b' belong to no tensor");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6); },
               "gap in the data section: bytes [0, 2]");
  expect_error([&] { parse_raw(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 6); },
               "the data section is 6 bytes but the tensors cover only 4 (2 trailing bytes belong to no tensor)");
  expect_error([&] { parse_raw(R"({})", 3); }, "cover only 0");
  // The message of the brief, verbatim.
  expect_error([&] { parse_raw(R"({"layers.0.wq":{"dtype":"F32","shape":[4,8],"data_offsets":[0,100]}})", 100); },
               "mem.safetensors: tensor 'layers.0.wq' data_offsets [0, 100] do not match shape [4, 8] x f32 = 128 bytes");
  expect_error(
      [&] {
        parse_raw(R"({"a":{"dtype":"I64","shape":[4611686018427387904,8],"data_offsets":[0,0]}})", 0);
      },
      "overflows 64 bits");
  // Out-of-order entries in the header are fine as long as the data section is tiled exactly.
  SafetensorsFile ok = parse_raw(
      R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"z":{"dtype":"BF16","shape":[0,5],"data_offsets":[6,6]}})",
      6);
  ASSERT_EQ(ok.tensors().size(), 3u);
  EXPECT_EQ(ok.tensors()[0].name, "a");
  EXPECT_EQ(ok.tensors()[1].name, "b");
}

// ---------------------------------------------------------------------------------------------------
// Loading into a model: missing / unexpected / mismatched tensors by name
// ---------------------------------------------------------------------------------------------------

TEST(Safetensors, LoadTensorsReportsEveryProblemByName) {
  TmpDir tmp;
  std::vector<float> a(6, 1.0f), b(4, 2.0f), c(2, 3.0f);
  const std::string path = tmp / "m.safetensors";
  write_safetensors(path, {{"a", DType::F32, {2, 3}, a.data(), 24},
                           {"b", DType::F32, {4}, b.data(), 16},
                           {"extra", DType::F32, {2}, c.data(), 8}});
  SafetensorsFile f = SafetensorsFile::open(path);
  std::vector<float> da(6), db(4), dm(3);
  expect_error([&] { load_into(f, "missing", DType::F32, {3}, dm.data()); }, "tensor 'missing' not found");
  expect_error([&] { load_into(f, "a", DType::BF16, {2, 3}, da.data()); }, "tensor 'a' has dtype f32, expected bf16");
  expect_error([&] { load_into(f, "a", DType::F32, {3, 2}, da.data()); },
               "tensor 'a' has shape [2, 3], expected [3, 2]");
  try {
    load_tensors(f, {{"a", DType::F32, {3, 2}, da.data()}, {"b", DType::F32, {4}, db.data()},
                     {"missing", DType::F32, {3}, dm.data()}});
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find(path + ": tensors do not match the model"), std::string::npos) << m;
    EXPECT_NE(m.find("1 missing: 'missing'"), std::string::npos) << m;
    EXPECT_NE(m.find("1 mismatched: 'a' (file [2, 3] x f32, expected [3, 2] x f32)"), std::string::npos) << m;
    EXPECT_NE(m.find("1 unexpected: 'extra'"), std::string::npos) << m;
  }
  EXPECT_EQ(db, std::vector<float>(4, 0.0f));  // nothing copied when the set does not match
  load_tensors(f, {{"a", DType::F32, {2, 3}, da.data()}, {"b", DType::F32, {4}, db.data()}}, /*allow_unexpected=*/true);
  EXPECT_EQ(da, a);
  EXPECT_EQ(db, b);
}

// ---------------------------------------------------------------------------------------------------
// Third-party check: Python with only json + struct reads our file by the format's rules, and writes one
// (unsorted header, no padding) that we read.
// ---------------------------------------------------------------------------------------------------

TEST(Safetensors, InteropWithPythonStdlib) {
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "python3 not available";
  TmpDir tmp;
  std::vector<float> w = {1.5f, -2.0f, 3.25f, 0.0f, 100.0f, -0.125f};
  int64_t step = 42;
  std::vector<bf16> h = {to_bf16(1.0f), to_bf16(-3.0f)};
  std::vector<uint8_t> u = {1, 2, 3};
  const std::string ours = tmp / "ours.safetensors";
  write_safetensors(ours,
                    {{"u", DType::U8, {3}, u.data(), 3},
                     {"w", DType::F32, {2, 3}, w.data(), 24},
                     {"h", DType::BF16, {2}, h.data(), 4},
                     {"step", DType::I64, {}, &step, 8}},
                    {{"kind", "test"}});
  const std::string script = tmp / "check.py";
  {
    std::ofstream s(script);
    s << R"PY(import json, struct, sys
ours, theirs = sys.argv[1], sys.argv[2]
SIZES = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I32": 4, "I64": 8, "U8": 1}
raw = open(ours, "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
assert n % 8 == 0, n
header = json.loads(raw[8:8 + n].decode("utf-8"))
data = raw[8 + n:]
assert header["__metadata__"] == {"kind": "test"}, header
ents = sorted((v["data_offsets"], k, v) for k, v in header.items() if k != "__metadata__")
pos = 0
for (b, e), k, v in ents:
    assert b == pos, (k, b, pos)
    numel = 1
    for d in v["shape"]:
        numel *= d
    assert e - b == numel * SIZES[v["dtype"]], k
    pos = e
assert pos == len(data)
def get(name):
    b, e = header[name]["data_offsets"]
    return data[b:e]
assert list(struct.unpack("<6f", get("w"))) == [1.5, -2.0, 3.25, 0.0, 100.0, -0.125]
assert header["w"]["shape"] == [2, 3] and header["w"]["dtype"] == "F32"
assert struct.unpack("<q", get("step"))[0] == 42 and header["step"]["shape"] == []
assert [struct.unpack("<f", b"\x00\x00" + get("h")[i:i + 2])[0] for i in (0, 2)] == [1.0, -3.0]
assert list(get("u")) == [1, 2, 3]
# Now write one by hand: keys unsorted, extra spaces, header length not a multiple of 8.
a = struct.pack("<3i", 7, -8, 9)
bb = struct.pack("<2d", 0, 0)[:4]
hdr = {"zz": {"dtype": "I32", "shape": [3], "data_offsets": [0, 12]},
       "__metadata__": {"src": "python"},
       "aa": {"dtype": "U8", "shape": [2, 2], "data_offsets": [12, 16]}}
text = json.dumps(hdr, indent=1).encode("utf-8") + b"   "
if len(text) % 8 == 0:
    text += b" "
open(theirs, "wb").write(struct.pack("<Q", len(text)) + text + a + bytes([5, 6, 7, 8]))
print("OK")
)PY";
  }
  const std::string theirs = tmp / "theirs.safetensors";
  const std::string cmd = "python3 " + script + " " + ours + " " + theirs;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  SafetensorsFile f = SafetensorsFile::open(theirs);
  EXPECT_NE(f.header_bytes() % 8, 0u);
  EXPECT_EQ(f.metadata().at("src"), "python");
  int32_t zz[3];
  load_into(f, "zz", DType::I32, {3}, zz);
  EXPECT_EQ(zz[0], 7);
  EXPECT_EQ(zz[1], -8);
  EXPECT_EQ(zz[2], 9);
  uint8_t aa[4];
  load_into(f, "aa", DType::U8, {2, 2}, aa);
  EXPECT_EQ(aa[3], 8);
}

// ---------------------------------------------------------------------------------------------------
// Checkpoint store
// ---------------------------------------------------------------------------------------------------

namespace {

// A tiny model + optimizer whose values depend on the step, so checkpoints are distinguishable.
struct FakeState {
  std::vector<float> wq, m, v;
  std::vector<bf16> emb;
  int64_t opt_step = 0;
  explicit FakeState(int64_t step) : wq(12), m(12), v(12), emb(8), opt_step(step) {
    for (size_t i = 0; i < 12; ++i) {
      wq[i] = float(step) + 0.25f * float(i);
      m[i] = -float(i) / float(step + 1);
      v[i] = float(i * i);
    }
    for (size_t i = 0; i < 8; ++i) emb[i] = to_bf16(float(step) - float(i));
  }
  CheckpointWriteRequest request(int64_t step) const {
    CheckpointWriteRequest r;
    r.step = step;
    r.model = {{"layers.0.wq", DType::F32, {3, 4}, wq.data()}, {"tok_emb", DType::BF16, {2, 4}, emb.data()}};
    r.optimizer = {{"layers.0.wq.m", DType::F32, {3, 4}, m.data()},
                   {"layers.0.wq.v", DType::F32, {3, 4}, v.data()},
                   {"step", DType::I64, {}, &opt_step}};
    r.state = {{"rng", {{"seed", 1234}, {"offsets", {{"dropout", 17 * step}, {"data", 3}}}}},
               {"data_loader", {{"shard", 2}, {"position", 1000 + step}}},
               {"config_toml", "[model]\nname = \"tiny\"\n[training]\nsteps = 10\n"}};
    return r;
  }
};

std::string save(const std::string& folder, int64_t step, int k) {
  FakeState s(step);
  return save_checkpoint(folder, s.request(step), k);
}

std::vector<std::string> entries(const std::string& folder) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(folder)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

void flip_byte(const std::string& path, size_t from_end) {
  auto b = read_file(path);
  b[b.size() - 1 - from_end] ^= 0x10;
  write_file(path, b);
}

}  // namespace

TEST(Checkpoint, SaveLoadRoundTripAndLayout) {
  TmpDir tmp;
  const std::string folder = tmp / "ckpt";
  EXPECT_EQ(latest_complete_checkpoint(folder), std::nullopt);  // folder does not exist yet
  const std::string dir = save(folder, 10, 3);
  EXPECT_EQ(dir, folder + "/step-10");
  EXPECT_EQ(entries(folder), std::vector<std::string>{"step-10"});
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"model.safetensors", "optimizer.safetensors", "state.json"}));
  EXPECT_EQ(latest_complete_checkpoint(folder), dir);

  LoadedCheckpoint ck = load_checkpoint(dir);
  EXPECT_EQ(ck.step, 10);
  EXPECT_EQ(ck.dir, dir);
  const auto& s = ck.state;
  EXPECT_EQ(s["format"], "moetron-checkpoint");
  EXPECT_EQ(s["format_version"], 1);
  EXPECT_EQ(s["step"], 10);
  EXPECT_EQ(s["moetron_version"], std::string(kMoetronVersion));
  EXPECT_EQ(s["rng"]["seed"], 1234);
  EXPECT_EQ(s["rng"]["offsets"]["dropout"], 170);
  EXPECT_EQ(s["data_loader"]["position"], 1010);
  EXPECT_EQ(s["config_toml"], "[model]\nname = \"tiny\"\n[training]\nsteps = 10\n");
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    auto bytes = read_file(dir + "/" + f);
    EXPECT_EQ(s["files"][f]["bytes"], bytes.size());
    char hex[16];
    std::snprintf(hex, sizeof hex, "%08x", crc32c_update(0, bytes.data(), bytes.size()));
    EXPECT_EQ(s["files"][f]["crc32c"], hex);
  }
  EXPECT_EQ(ck.model.metadata().at("moetron.kind"), "model");
  EXPECT_EQ(ck.optimizer.metadata().at("moetron.step"), "10");

  FakeState want(10), got(0);
  load_tensors(ck.model, {{"layers.0.wq", DType::F32, {3, 4}, got.wq.data()}, {"tok_emb", DType::BF16, {2, 4}, got.emb.data()}});
  load_tensors(ck.optimizer, {{"layers.0.wq.m", DType::F32, {3, 4}, got.m.data()},
                              {"layers.0.wq.v", DType::F32, {3, 4}, got.v.data()},
                              {"step", DType::I64, {}, &got.opt_step}});
  EXPECT_EQ(got.wq, want.wq);
  EXPECT_EQ(got.m, want.m);
  EXPECT_EQ(got.v, want.v);
  EXPECT_EQ(got.opt_step, 10);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(got.emb[i].bits, want.emb[i].bits);

  // Saving the same inputs again gives the same bytes (state.json holds no timestamp).
  auto before = read_file(dir + "/state.json");
  save(folder, 10, 3);
  EXPECT_EQ(read_file(dir + "/state.json"), before);
  EXPECT_EQ(entries(folder), std::vector<std::string>{"step-10"});
}

TEST(Checkpoint, RejectsBadRequests) {
  TmpDir tmp;
  FakeState s(1);
  auto r = s.request(1);
  r.state["step"] = 5;
  expect_error([&] { save_checkpoint(tmp / "c", r, 1); }, "state key 'step' is reserved");
  r = s.request(1);
  r.state = nlohmann::json::array();
  expect_error([&] { save_checkpoint(tmp / "c", r, 1); }, "state must be a JSON object");
  r = s.request(-1);
  expect_error([&] { save_checkpoint(tmp / "c", r, 1); }, "negative step -1");
  r = s.request(1);
  r.model.push_back(r.model[0]);  // duplicate name
  expect_error([&] { save_checkpoint(tmp / "c", r, 1); }, "duplicate tensor name 'layers.0.wq'");
  // A failed save leaves nothing behind.
  EXPECT_TRUE(entries(tmp / "c").empty());
}

TEST(Checkpoint, KeepLatestKPrunes) {
  TmpDir tmp;
  const std::string folder = tmp / "ckpt";
  for (int64_t step : {5, 10, 15, 20, 25}) save(folder, step, 2);
  EXPECT_EQ(entries(folder), (std::vector<std::string>{"step-20", "step-25"}));
  // keep_latest_k <= 0 keeps everything.
  for (int64_t step : {30, 35}) save(folder, step, 0);
  EXPECT_EQ(entries(folder), (std::vector<std::string>{"step-20", "step-25", "step-30", "step-35"}));
  save(folder, 40, 1);
  EXPECT_EQ(entries(folder), std::vector<std::string>{"step-40"});
  auto dirs = list_checkpoint_dirs(folder);
  ASSERT_EQ(dirs.size(), 1u);
  EXPECT_EQ(dirs[0].first, 40);
}

TEST(Checkpoint, PruningNeverCountsOrDeletesIncompleteOnes) {
  TmpDir tmp;
  const std::string folder = tmp / "ckpt";
  save(folder, 1, 0);
  save(folder, 2, 0);
  fs::remove(folder + "/step-2/state.json");  // step-2 is now incomplete
  save(folder, 3, 2);
  // Kept: the two newest complete ones (3 and 1); step-2 is incomplete, neither counted nor deleted.
  EXPECT_EQ(entries(folder), (std::vector<std::string>{"step-1", "step-2", "step-3"}));
}

TEST(Checkpoint, ChecksumMismatchIsDetectedAndSkipped) {
  TmpDir tmp;
  const std::string folder = tmp / "ckpt";
  save(folder, 1, 0);
  const std::string d2 = save(folder, 2, 0);
  flip_byte(d2 + "/model.safetensors", 3);  // one byte inside the last tensor's data
  expect_error([&] { load_checkpoint(d2); }, d2 + "/model.safetensors: CRC32C ");
  expect_error([&] { load_checkpoint(d2); }, "recorded in state.json (file corrupted)");
  ::testing::internal::CaptureStderr();
  auto latest = latest_complete_checkpoint(folder);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(latest, folder + "/step-1");
  EXPECT_NE(err.find("moetron: warning: skipping checkpoint " + d2), std::string::npos) << err;

  // A flipped byte in the optimizer file, or a truncated file, is caught too.
  const std::string d3 = save(folder, 3, 0);
  flip_byte(d3 + "/optimizer.safetensors", 0);
  expect_error([&] { load_checkpoint(d3); }, d3 + "/optimizer.safetensors: CRC32C");
  const std::string d4 = save(folder, 4, 0);
  auto b = read_file(d4 + "/model.safetensors");
  b.pop_back();
  write_file(d4 + "/model.safetensors", b);
  expect_error([&] { load_checkpoint(d4); }, "state.json records");
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(latest_complete_checkpoint(folder), folder + "/step-1");
  ::testing::internal::GetCapturedStderr();
}

TEST(Checkpoint, IncompleteOrInconsistentCheckpointsAreIgnored) {
  TmpDir tmp;
  const std::string folder = tmp / "ckpt";
  save(folder, 7, 0);
  const std::string d8 = save(folder, 8, 0);
  fs::remove(d8 + "/state.json");
  expect_error([&] { load_checkpoint(d8); }, d8 + "/state.json: missing (incomplete checkpoint)");
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(latest_complete_checkpoint(folder), folder + "/step-7");
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("incomplete checkpoint"), std::string::npos);

  // A missing tensor file.
  const std::string d9 = save(folder, 9, 0);
  fs::remove(d9 + "/optimizer.safetensors");
  expect_error([&] { load_checkpoint(d9); }, "optimizer.safetensors: cannot open");
  // state.json that is not JSON.
  const std::string d10 = save(folder, 10, 0);
  { std::ofstream(d10 + "/state.json") << "{\"step\": 10,"; }
  expect_error([&] { load_checkpoint(d10); }, d10 + "/state.json: not valid JSON");
  // A directory renamed to another step.
  const std::string d11 = save(folder, 11, 0);
  fs::rename(d11, folder + "/step-12");
  expect_error([&] { load_checkpoint(folder + "/step-12"); }, "step 11 does not match the directory name");
  // Names that only look like checkpoints are not listed.
  fs::create_directories(folder + "/step-99x");
  fs::create_directories(folder + "/step-");
  fs::create_directories(folder + "/notes");
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(latest_complete_checkpoint(folder), folder + "/step-7");
  ::testing::internal::GetCapturedStderr();
}

TEST(Checkpoint, LeftoverTmpDirsAreIgnoredAndPruned) {
  TmpDir tmp;
  const std::string folder = tmp / "ckpt";
  save(folder, 1, 3);
  // A dead writer's leftover (pid beyond pid_max, so certainly not alive), holding a "complete" copy.
  const std::string dead = folder + "/step-2.tmp-2147483646";
  fs::copy(folder + "/step-1", dead);
  // A live process's tmp dir (our parent is alive) must not be touched.
  const std::string live = folder + "/step-3.tmp-" + std::to_string(::getppid());
  fs::create_directories(live);
  EXPECT_EQ(latest_complete_checkpoint(folder), folder + "/step-1");
  save(folder, 4, 3);
  EXPECT_EQ(entries(folder), (std::vector<std::string>{"step-1", "step-3.tmp-" + std::to_string(::getppid()), "step-4"}));
  fs::remove_all(live);
}

TEST(Checkpoint, ReplacingTheSameStepIsAtomic) {
  TmpDir tmp;
  const std::string folder = tmp / "ckpt";
  save(folder, 5, 2);
  FakeState other(99);
  const std::string d = save_checkpoint(folder, other.request(5), 2);  // same step, different contents
  EXPECT_EQ(entries(folder), std::vector<std::string>{"step-5"});
  LoadedCheckpoint ck = load_checkpoint(d);
  std::vector<float> wq(12);
  load_into(ck.model, "layers.0.wq", DType::F32, {3, 4}, wq.data());
  EXPECT_EQ(wq, other.wq);
}

// A crash (the process dies) at each point of the protocol leaves the previous checkpoint as the latest
// complete one; the next save prunes the dead writer's temporary directory.
TEST(CheckpointDeathTest, CrashBeforeRenameKeepsPreviousCheckpoint) {
  TmpDir tmp;
  const std::string folder = tmp / "ckpt";
  save(folder, 1, 2);
  for (const char* stage : {"tmp_created", "model_written", "optimizer_written", "state_written", "before_rename"}) {
    EXPECT_EXIT(
        {
          set_checkpoint_fault_hook([stage](std::string_view s) {
            if (s == stage) ::_exit(42);
          });
          save(folder, 2, 2);
        },
        ::testing::ExitedWithCode(42), "")
        << stage;
    auto names = entries(folder);
    ASSERT_EQ(names.size(), 2u) << stage;  // step-1 and the dead child's step-2.tmp-<pid>
    EXPECT_EQ(names[0], "step-1");
    EXPECT_EQ(names[1].rfind("step-2.tmp-", 0), 0u) << names[1];
    EXPECT_EQ(latest_complete_checkpoint(folder), folder + "/step-1") << stage;
    save(folder, 1, 2);  // the next save prunes the dead child's tmp dir
    EXPECT_EQ(entries(folder), std::vector<std::string>{"step-1"}) << stage;
  }
  // A crash right after the rename: the new checkpoint is complete and is the latest.
  EXPECT_EXIT(
      {
        set_checkpoint_fault_hook([](std::string_view s) {
          if (s == "after_rename") ::_exit(42);
        });
        save(folder, 2, 2);
      },
      ::testing::ExitedWithCode(42), "");
  EXPECT_EQ(latest_complete_checkpoint(folder), folder + "/step-2");
  // A crash while replacing an existing step (after the exchange, before deleting the old copy).
  EXPECT_EXIT(
      {
        set_checkpoint_fault_hook([](std::string_view s) {
          if (s == "after_rename") ::_exit(42);
        });
        FakeState other(77);
        save_checkpoint(folder, other.request(2), 2);
      },
      ::testing::ExitedWithCode(42), "");
  EXPECT_EQ(latest_complete_checkpoint(folder), folder + "/step-2");
  std::vector<float> wq(12);
  load_into(load_checkpoint(folder + "/step-2").model, "layers.0.wq", DType::F32, {3, 4}, wq.data());
  EXPECT_EQ(wq, FakeState(77).wq);
  save(folder, 3, 2);
  EXPECT_EQ(entries(folder), (std::vector<std::string>{"step-2", "step-3"}));
}

// A failed write (an exception, not a crash) cleans up its temporary directory and leaves the rest alone.
TEST(Checkpoint, FailedSaveCleansUp) {
  TmpDir tmp;
  const std::string folder = tmp / "ckpt";
  save(folder, 1, 2);
  set_checkpoint_fault_hook([](std::string_view s) {
    if (s == "state_written") throw Error("injected failure");
  });
  EXPECT_THROW(save(folder, 2, 2), Error);
  set_checkpoint_fault_hook({});
  EXPECT_EQ(entries(folder), std::vector<std::string>{"step-1"});
  EXPECT_EQ(latest_complete_checkpoint(folder), folder + "/step-1");
}
