// Non-owning views of the page pools the engine allocates: where the bytes of a (page,
// kv head) live. K and V have separate pools of identical shape. Trivially copyable.
#pragma once

#include <cstdint>
#include <string>

#include "oscar/core/config.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"
#include "oscar/quant/format.hpp"

namespace oscar {

// INT2 pool: block (page, head) at data + page * stride_page + head * stride_head, each block
// laid out as Int2Layout says. The default strides pack [num_pages][num_kv_heads][block].
// A layer-strided engine pool is the same view with data offset per layer.
struct Int2PoolRef {
  uint8_t* data = nullptr;
  int32_t num_pages = 0;
  int32_t num_kv_heads = 0;
  int64_t stride_page = 0;  // bytes
  int64_t stride_head = 0;  // bytes
  Int2Layout layout;

  static Int2PoolRef packed(uint8_t* data, int32_t num_pages, int32_t num_kv_heads,
                            Int2Layout layout) {
    return {data, num_pages, num_kv_heads, num_kv_heads * layout.block_bytes(),
            layout.block_bytes(), layout};
  }
  OSCAR_HOST_DEVICE uint8_t* block(int32_t page, int32_t head) const {
    return data + page * stride_page + head * stride_head;
  }
};

// BF16 pool, FlashInfer's HND layout: element (page, head, token, dim) at
// data[page * stride_page + head * stride_head + token * head_dim + dim] (strides in elements).
struct Bf16PoolRef {
  bf16_t* data = nullptr;
  int32_t num_pages = 0;
  int32_t num_kv_heads = 0;
  int32_t page_size = 0;
  int32_t head_dim = 0;
  int64_t stride_page = 0;  // elements
  int64_t stride_head = 0;  // elements

  static Bf16PoolRef packed(bf16_t* data, int32_t num_pages, int32_t num_kv_heads,
                            int32_t page_size, int32_t head_dim) {
    const int64_t head = int64_t{page_size} * head_dim;
    return {data, num_pages, num_kv_heads, page_size, head_dim, num_kv_heads * head, head};
  }
  OSCAR_HOST_DEVICE bf16_t* row(int32_t page, int32_t head, int32_t token) const {
    return data + page * stride_page + head * stride_head + int64_t{token} * head_dim;
  }
};

inline Status validate(const Int2PoolRef& pool, const char* name) {
  const std::string what = std::string(name) + ": ";
  if (const Status layout = validate(pool.layout); !layout.ok()) return Status(layout.code(), what + layout.message());
  if (pool.num_pages > 0 && !pool.data) return invalid_argument(what + "data must not be null");
  if (pool.num_pages < 0 || pool.num_kv_heads <= 0) {
    return invalid_argument(what + "num_pages must be >= 0 and num_kv_heads > 0");
  }
  if (reinterpret_cast<uintptr_t>(pool.data) % 16 != 0 || pool.stride_page % 16 != 0 ||
      pool.stride_head % 16 != 0) {
    return invalid_argument(what + "data and strides must be 16-byte aligned");
  }
  if (pool.stride_head < pool.layout.block_bytes() ||
      pool.stride_page < pool.stride_head * pool.num_kv_heads) {
    return invalid_argument(what + "strides smaller than a block (" +
                            std::to_string(pool.layout.block_bytes()) + " bytes): blocks overlap");
  }
  return Status::Ok();
}

inline Status validate(const Bf16PoolRef& pool, const char* name) {
  const std::string what = std::string(name) + ": ";
  if (pool.num_pages > 0 && !pool.data) return invalid_argument(what + "data must not be null");
  if (pool.num_pages < 0 || pool.num_kv_heads <= 0) {
    return invalid_argument(what + "num_pages must be >= 0 and num_kv_heads > 0");
  }
  if (!is_supported_head_dim(pool.head_dim)) {
    return unsupported(what + "head_dim " + std::to_string(pool.head_dim) +
                       " is not supported (supported: 64, 128, 256)");
  }
  if (!is_supported_page_size(pool.page_size)) {
    return unsupported(what + "page_size " + std::to_string(pool.page_size) +
                       " is not supported (a power of two from 8 to 256)");
  }
  const int64_t head = int64_t{pool.page_size} * pool.head_dim;
  if (pool.stride_head < head || pool.stride_page < pool.stride_head * pool.num_kv_heads) {
    return invalid_argument(what + "strides smaller than a page of one head: pages overlap");
  }
  return Status::Ok();
}

// Whether every row of a BF16 pool starts 16-byte aligned (its data and strides; rows are
// head_dim * 2 bytes, a multiple of 128): what kernels that read or copy rows in 16-byte
// pieces need. The attention kernels require it; the write kernels fall back to element-wise
// copies without it.
inline bool bf16_rows_16b_aligned(const Bf16PoolRef& pool) {
  return reinterpret_cast<uintptr_t>(pool.data) % 16 == 0 && pool.stride_page % 8 == 0 && pool.stride_head % 8 == 0;
}

// The four pools of one layer (K and V, BF16 and INT2): each valid on its own, and all of one
// shape, so that a page id, head and row mean the same thing in each of them.
inline Status validate_pool_set(const Bf16PoolRef& k_bf16, const Bf16PoolRef& v_bf16, const Int2PoolRef& k_int2,
                                const Int2PoolRef& v_int2) {
  OSCAR_RETURN_IF_ERROR(validate(k_bf16, "k_bf16 pool"));
  OSCAR_RETURN_IF_ERROR(validate(v_bf16, "v_bf16 pool"));
  OSCAR_RETURN_IF_ERROR(validate(k_int2, "k_int2 pool"));
  OSCAR_RETURN_IF_ERROR(validate(v_int2, "v_int2 pool"));
  // The first field on which a pool disagrees with the pool it must match, named with both values.
  const Int2Layout& layout = k_int2.layout;
  struct Field {
    const char *what, *reference;
    int64_t value, expected;
  };
  const Field fields[] = {
      {"v_int2 head_dim", "k_int2", v_int2.layout.head_dim, layout.head_dim},
      {"v_int2 quant_group_size", "k_int2", v_int2.layout.quant_group_size, layout.quant_group_size},
      {"v_int2 page_size", "k_int2", v_int2.layout.page_size, layout.page_size},
      {"v_int2 num_kv_heads", "k_int2", v_int2.num_kv_heads, k_int2.num_kv_heads},
      {"v_int2 num_pages", "k_int2", v_int2.num_pages, k_int2.num_pages},
      {"k_bf16 head_dim", "k_int2", k_bf16.head_dim, layout.head_dim},
      {"v_bf16 head_dim", "k_int2", v_bf16.head_dim, layout.head_dim},
      {"k_bf16 page_size", "k_int2", k_bf16.page_size, layout.page_size},
      {"v_bf16 page_size", "k_int2", v_bf16.page_size, layout.page_size},
      {"k_bf16 num_kv_heads", "k_int2", k_bf16.num_kv_heads, k_int2.num_kv_heads},
      {"v_bf16 num_kv_heads", "k_int2", v_bf16.num_kv_heads, k_int2.num_kv_heads},
      {"v_bf16 num_pages", "k_bf16", v_bf16.num_pages, k_bf16.num_pages},
  };
  for (const Field& f : fields) {
    if (f.value != f.expected) {
      return invalid_argument(std::string("pools disagree: ") + f.what + " is " + std::to_string(f.value) + ", " +
                              f.reference + "'s " + std::to_string(f.expected));
    }
  }
  return Status::Ok();
}

}  // namespace oscar
