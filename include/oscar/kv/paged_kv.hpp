// Everything attention reads for one layer of a batch: the four pools and the page tables of
// the three segments of every request. Request b's tokens, in order, are its sink tokens,
// then its INT2 tokens, then its recent-window tokens; the position of a key is its index in
// that order. Keys are stored rotated (K·R_K, V·R_V), so one rotated query serves them all.
#pragma once

#include <cstdint>
#include <string>

#include "oscar/core/config.hpp"
#include "oscar/core/status.hpp"
#include "oscar/kv/page_table.hpp"
#include "oscar/kv/pools.hpp"

namespace oscar {

struct PagedKvRef {
  Bf16PoolRef k_bf16;  // sink and recent pages
  Bf16PoolRef v_bf16;
  Int2PoolRef k_int2;  // INT2 pages
  Int2PoolRef v_int2;
  PageTableRef sink;    // into the BF16 pools
  PageTableRef int2;    // into the INT2 pools; every page full
  PageTableRef recent;  // into the BF16 pools

  OSCAR_HOST_DEVICE int32_t batch_size() const { return sink.batch_size; }
  OSCAR_HOST_DEVICE int64_t num_tokens(int32_t request) const {
    return sink.num_tokens(request) + int2.num_tokens(request) + recent.num_tokens(request);
  }
};

inline Status validate(const PagedKvRef& kv) {
  OSCAR_RETURN_IF_ERROR(validate_pool_set(kv.k_bf16, kv.v_bf16, kv.k_int2, kv.v_int2));
  const int32_t page_size = kv.k_int2.layout.page_size;
  if (kv.int2.batch_size != kv.sink.batch_size || kv.recent.batch_size != kv.sink.batch_size) {
    return invalid_argument("sink, int2 and recent page tables have different batch sizes");
  }
  if (kv.sink.page_size != page_size || kv.int2.page_size != page_size ||
      kv.recent.page_size != page_size) {
    return invalid_argument("page tables and pools disagree on page_size");
  }
  OSCAR_RETURN_IF_ERROR(validate(kv.sink, kv.k_bf16.num_pages, "sink"));
  OSCAR_RETURN_IF_ERROR(validate(kv.int2, kv.k_int2.num_pages, "int2"));
  OSCAR_RETURN_IF_ERROR(validate(kv.recent, kv.k_bf16.num_pages, "recent"));
  for (int32_t b = 0; b < kv.int2.batch_size; ++b) {
    if (kv.int2.num_pages(b) > 0 && kv.int2.last_page_len[b] != page_size) {
      return invalid_argument("int2 page table: request " + std::to_string(b) +
                              " has a partial INT2 page; INT2 pages are always full");
    }
  }
  return Status::Ok();
}

}  // namespace oscar
