// The INT2 storage format: the contract between the write kernels, the decode kernels, the CPU
// reference and the plan files. docs/format.md describes the same thing in prose; a change
// here that alters bytes on disk or in memory must bump kInt2FormatVersion.
#pragma once

#include <cstdint>
#include <string>

#include "oscar/core/config.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"

namespace oscar {

// Version 1: codes "quartered" inside each quantization group (see code_byte / code_shift),
// fp16 (scale, offset) per (token, group) after the codes of a page block.
inline constexpr uint32_t kInt2FormatVersion = 1;

// Metadata of one quantization group of one token: x̂ = offset + code * scale.
struct QuantMeta {
  fp16_t scale;
  fp16_t offset;
};
static_assert(sizeof(QuantMeta) == 4);

OSCAR_HOST_DEVICE constexpr bool is_power_of_two(int value) {
  return value > 0 && (value & (value - 1)) == 0;
}
OSCAR_HOST_DEVICE constexpr bool is_supported_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}
OSCAR_HOST_DEVICE constexpr bool is_supported_page_size(int page_size) {
  return is_power_of_two(page_size) && page_size >= 8 && page_size <= 256;
}
// A group is the whole head or one of 32/64/128 elements that divides it.
OSCAR_HOST_DEVICE constexpr bool is_supported_quant_group(int head_dim, int quant_group_size) {
  return is_power_of_two(quant_group_size) && quant_group_size >= 32 &&
         quant_group_size <= head_dim;
}

// Where element `element` of a row lives in the packed codes. Inside group g (elements
// [g*G, (g+1)*G)), byte j of the group's G/4 bytes holds local elements j, G/4+j, G/2+j,
// 3G/4+j in bits 0-1, 2-3, 4-5, 6-7 (the authors' "quartered" layout, applied per group; for
// one group per row it is exactly theirs). A group's codes are therefore contiguous bytes.
OSCAR_HOST_DEVICE constexpr int code_byte(int element, int quant_group_size) {
  const int quarter = quant_group_size / 4;
  const int local = element % quant_group_size;
  return (element / quant_group_size) * quarter + local % quarter;
}
OSCAR_HOST_DEVICE constexpr int code_shift(int element, int quant_group_size) {
  return 2 * ((element % quant_group_size) / (quant_group_size / 4));
}

// Byte layout of one (page, kv head) block of the INT2 pool, for K or for V:
//   codes: [page_size][head_dim / 4] bytes, token-major;
//   meta:  [page_size][head_dim / quant_group_size] QuantMeta, right after the codes.
// Every size is a multiple of 16 bytes for the supported shapes, so each block, each token's
// codes and the metadata start 16-byte aligned when the pool is.
struct Int2Layout {
  int head_dim = 128;
  int quant_group_size = 128;
  int page_size = 16;

  OSCAR_HOST_DEVICE constexpr int groups_per_row() const { return head_dim / quant_group_size; }
  OSCAR_HOST_DEVICE constexpr int code_bytes_per_row() const { return head_dim / 4; }
  OSCAR_HOST_DEVICE constexpr int64_t code_bytes() const {
    return int64_t{page_size} * code_bytes_per_row();
  }
  OSCAR_HOST_DEVICE constexpr int64_t meta_bytes() const {
    return int64_t{page_size} * groups_per_row() * static_cast<int64_t>(sizeof(QuantMeta));
  }
  OSCAR_HOST_DEVICE constexpr int64_t block_bytes() const { return code_bytes() + meta_bytes(); }

  OSCAR_HOST_DEVICE uint8_t* codes(uint8_t* block, int token) const {
    return block + int64_t{token} * code_bytes_per_row();
  }
  OSCAR_HOST_DEVICE const uint8_t* codes(const uint8_t* block, int token) const {
    return block + int64_t{token} * code_bytes_per_row();
  }
  OSCAR_HOST_DEVICE QuantMeta* meta(uint8_t* block, int token) const {
    return reinterpret_cast<QuantMeta*>(block + code_bytes()) + int64_t{token} * groups_per_row();
  }
  OSCAR_HOST_DEVICE const QuantMeta* meta(const uint8_t* block, int token) const {
    return reinterpret_cast<const QuantMeta*>(block + code_bytes()) +
           int64_t{token} * groups_per_row();
  }
};

inline Status validate(const Int2Layout& layout) {
  if (!is_supported_head_dim(layout.head_dim)) {
    return unsupported("head_dim " + std::to_string(layout.head_dim) +
                       " is not supported (supported: 64, 128, 256)");
  }
  if (!is_supported_quant_group(layout.head_dim, layout.quant_group_size)) {
    return unsupported("quant_group_size " + std::to_string(layout.quant_group_size) +
                       " is not supported for head_dim " + std::to_string(layout.head_dim) +
                       " (a power of two from 32 up to head_dim)");
  }
  if (!is_supported_page_size(layout.page_size)) {
    return unsupported("page_size " + std::to_string(layout.page_size) +
                       " is not supported (a power of two from 8 to 256)");
  }
  return Status::Ok();
}

// How the cache splits a sequence of `length` tokens: the first min(length, sink) tokens stay
// in the BF16 sink; of the rest, whole pages are demoted to INT2 as long as at least `recent`
// tokens remain, so the BF16 recent window holds between `recent` and recent + page_size - 1
// tokens once the sequence is long enough. The cache applies exactly this rule, so the split
// depends only on the length, not on how the tokens arrived.
struct SegmentCounts {
  int64_t sink = 0;
  int64_t int2 = 0;
  int64_t recent = 0;
};

OSCAR_HOST_DEVICE constexpr SegmentCounts segment_counts(int64_t length, int sink_tokens,
                                                         int recent_tokens, int page_size) {
  SegmentCounts counts;
  counts.sink = length < sink_tokens ? length : sink_tokens;
  const int64_t rest = length - counts.sink;
  const int64_t int2_pages = rest >= recent_tokens ? (rest - recent_tokens) / page_size : 0;
  counts.int2 = int2_pages * page_size;
  counts.recent = rest - counts.int2;
  return counts;
}

// Memory of the cache for one layer and one KV head, K and V together.
struct StorageCost {
  double bytes_per_token = 0;     // average over the sequence
  double bits_per_element = 0;    // bytes_per_token * 8 / (2 * head_dim)
  double compression_vs_bf16 = 0;
};

// The one function that prices a cache: the app prints it, the docs quote it, tests check it.
// INT2 tokens cost head_dim/4 code bytes plus 4 metadata bytes per group; BF16 tokens 2 bytes
// per element; both for K and for V.
inline StorageCost storage_cost(const Int2Layout& layout, SegmentCounts counts) {
  StorageCost cost;
  const int64_t tokens = counts.sink + counts.int2 + counts.recent;
  if (tokens == 0) return cost;
  const double int2_row = static_cast<double>(layout.code_bytes_per_row()) +
                          static_cast<double>(layout.groups_per_row() * sizeof(QuantMeta));
  const double bf16_row = 2.0 * layout.head_dim;
  const double bytes = 2.0 * (static_cast<double>(counts.int2) * int2_row +
                              static_cast<double>(counts.sink + counts.recent) * bf16_row);
  cost.bytes_per_token = bytes / static_cast<double>(tokens);
  cost.bits_per_element = cost.bytes_per_token * 8.0 / (2.0 * layout.head_dim);
  cost.compression_vs_bf16 = 2.0 * bf16_row / cost.bytes_per_token;
  return cost;
}

}  // namespace oscar
