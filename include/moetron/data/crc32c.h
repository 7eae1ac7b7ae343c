// crc32c.h: CRC-32C (Castagnoli polynomial, reflected 0x82F63B78), the checksum of token shards and
// of the data manifest. Software only (slicing-by-8 tables), so it runs on the baseline ISA.
// Not a cryptographic hash: it detects torn writes, truncation and bit flips, not tampering.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moetron::data {

// CRC-32C of data[0, n). To checksum in pieces, pass the previous result as `crc`:
// crc32c(b, nb, crc32c(a, na)) == crc32c(a ++ b). crc32c("123456789", 9) == 0xE3069283.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace moetron::data
