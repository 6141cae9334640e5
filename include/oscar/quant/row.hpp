// One cache row (one token of one KV head, already rotated) through the whole quantizer:
// clip -> per-group metadata -> codes -> packed bytes; and the way back to floats.
#pragma once

#include <cstdint>

#include "oscar/core/config.hpp"
#include "oscar/quant/clip.hpp"
#include "oscar/quant/format.hpp"
#include "oscar/quant/pack.hpp"
#include "oscar/quant/quantize.hpp"

namespace oscar {

inline constexpr int kMaxHeadDim = 256;

// `x` is the rotated row as the cache holds it (bf16 values widened to float: the format
// quantizes the bf16-rounded rotation, so a token demoted from the BF16 window and a token
// written straight to INT2 get the same bytes). `clip_k` comes from clip_rank().
//
// A row with any NaN or Inf is stored with NaN metadata and zero codes in every group: it
// reads back as NaN, so its own request's output shows the fault instead of a silently wrong
// number, and no other row, token or request is touched.
OSCAR_HOST_DEVICE void quantize_row(const float* x, int head_dim, int quant_group_size,
                                    int clip_k, uint8_t* packed, QuantMeta* meta) {
  bool finite = true;
  float clipped[kMaxHeadDim];
  for (int i = 0; i < head_dim; ++i) {
    clipped[i] = x[i];
    finite = finite && is_finite(x[i]);
  }
  if (finite) clip_row(clipped, head_dim, clip_k);

  uint8_t codes[kMaxHeadDim];
  for (int start = 0, g = 0; start < head_dim; start += quant_group_size, ++g) {
    const GroupRange range = group_range(clipped + start, quant_group_size);
    const GroupQuantizer q = make_group_quantizer(range.mn, range.mx, finite);
    meta[g] = q.meta;
    for (int i = 0; i < quant_group_size; ++i) {
      codes[start + i] = static_cast<uint8_t>(quantize_code(clipped[start + i], q));
    }
  }
  pack_row(codes, head_dim, quant_group_size, packed);
}

// Per group, the four levels dequantize_code(0..3) once, then one lookup per element in
// pack_row's byte order: the same bits as dequantize_code(unpack_code(...)) element by element
// (tests/quant/test_quantize.cpp checks it), without a division, a metadata conversion and an
// fmaf per element, which made this the hot loop of the blocked CPU attention.
OSCAR_HOST_DEVICE void dequantize_row(const uint8_t* packed, const QuantMeta* meta, int head_dim,
                                      int quant_group_size, float* out) {
  const int quarter = quant_group_size / 4;
  for (int start = 0, g = 0; start < head_dim; start += quant_group_size, ++g) {
    const float scale = fp16_to_float(meta[g].scale);
    const float offset = fp16_to_float(meta[g].offset);
    const uint8_t* bytes = packed + start / 4;
    float* o = out + start;
#if defined(__FMA__) && !defined(__CUDA_ARCH__)
    // Where the ISA has FMA, dequantize_code itself per element: each field's loop compiles to
    // 8-wide zero-extend, shift, mask, convert and fma, faster than 4 scalar lookups per byte.
    for (int field = 0; field < 4; ++field) {
      for (int j = 0; j < quarter; ++j) {
        o[field * quarter + j] = dequantize_code((uint32_t{bytes[j]} >> (2 * field)) & 3u, scale, offset);
      }
    }
#else
    float level[4];
    for (uint32_t c = 0; c < 4; ++c) level[c] = dequantize_code(c, scale, offset);
    for (int j = 0; j < quarter; ++j) {
      const uint32_t byte = bytes[j];
      o[j] = level[byte & 3u];
      o[quarter + j] = level[(byte >> 2) & 3u];
      o[2 * quarter + j] = level[(byte >> 4) & 3u];
      o[3 * quarter + j] = level[byte >> 6];
    }
#endif
  }
}

}  // namespace oscar
