// Packing of 2-bit codes into the byte order of format.hpp, and the way back.
#pragma once

#include <cstdint>

#include "oscar/core/config.hpp"
#include "oscar/quant/format.hpp"

namespace oscar {

// codes[i] in {0..3} for i < head_dim -> packed[head_dim / 4]. Every byte is written in full.
OSCAR_HOST_DEVICE void pack_row(const uint8_t* codes, int head_dim, int quant_group_size,
                                uint8_t* packed) {
  const int quarter = quant_group_size / 4;
  for (int group_start = 0; group_start < head_dim; group_start += quant_group_size) {
    const uint8_t* c = codes + group_start;
    uint8_t* out = packed + group_start / 4;
    for (int j = 0; j < quarter; ++j) {
      out[j] = static_cast<uint8_t>((c[j] & 3u) | ((c[quarter + j] & 3u) << 2) |
                                    ((c[2 * quarter + j] & 3u) << 4) |
                                    ((c[3 * quarter + j] & 3u) << 6));
    }
  }
}

OSCAR_HOST_DEVICE uint32_t unpack_code(const uint8_t* packed, int element, int quant_group_size) {
  return (packed[code_byte(element, quant_group_size)] >> code_shift(element, quant_group_size)) &
         3u;
}

// packed[head_dim / 4] -> codes[head_dim].
OSCAR_HOST_DEVICE void unpack_row(const uint8_t* packed, int head_dim, int quant_group_size,
                                  uint8_t* codes) {
  const int quarter = quant_group_size / 4;
  for (int group_start = 0; group_start < head_dim; group_start += quant_group_size) {
    const uint8_t* in = packed + group_start / 4;
    uint8_t* c = codes + group_start;
    for (int j = 0; j < quarter; ++j) {
      const uint32_t byte = in[j];
      c[j] = byte & 3u;
      c[quarter + j] = (byte >> 2) & 3u;
      c[2 * quarter + j] = (byte >> 4) & 3u;
      c[3 * quarter + j] = (byte >> 6) & 3u;
    }
  }
}

}  // namespace oscar
