// crc32c.cpp: table-driven CRC-32C, slicing-by-8 (eight 256-entry tables, one 8-byte word per step).
// Tables are built once at first use from the reflected polynomial; no hardware CRC instruction, so
// the result and the code path are the same on every x86-64.
#include "moetron/data/crc32c.h"

#include <array>
#include <cstring>

namespace moetron::data {

namespace {
constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, bit-reflected

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    // t[k][i] = CRC of byte i followed by k zero bytes.
    for (int k = 1; k < 8; ++k)
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
};

const Tables& tables() {
  static const Tables tab;
  return tab;
}
}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto& t = tables().t;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // x86-64 is little-endian: byte 0 is the low byte
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xff];
  return ~c;
}

}  // namespace moetron::data
