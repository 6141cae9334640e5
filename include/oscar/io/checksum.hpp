// CRC-32 (IEEE 802.3: reflected polynomial 0xEDB88320, initial and final complement), the
// checksum of zlib's crc32() and Python's zlib.crc32 / binascii.crc32, so a file oscar writes
// can be checked by either. Written here rather than linking zlib: a header-only library
// should not add a link dependency to every engine that reads a plan, for 20 lines.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

namespace oscar::io {

namespace checksum_detail {
constexpr std::array<uint32_t, 256> make_crc32_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1u ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}
inline constexpr std::array<uint32_t, 256> kCrc32Table = make_crc32_table();
}  // namespace checksum_detail

// crc32(b, crc32(a)) == crc32(a followed by b), as zlib's.
inline uint32_t crc32(std::span<const uint8_t> bytes, uint32_t crc = 0) {
  crc = ~crc;
  for (const uint8_t b : bytes) crc = checksum_detail::kCrc32Table[(crc ^ b) & 0xffu] ^ (crc >> 8);
  return ~crc;
}
inline uint32_t crc32(std::string_view text, uint32_t crc = 0) {
  return crc32(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()), crc);
}

}  // namespace oscar::io
