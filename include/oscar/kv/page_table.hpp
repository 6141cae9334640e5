// A FlashInfer-style page table for one segment kind (BF16 sink, INT2 body or BF16 recent
// window): request b owns pages indices[indptr[b] .. indptr[b+1]), all full except the last,
// which holds last_page_len[b] tokens. Non-owning and trivially copyable: pass it by value
// into kernels.
#pragma once

#include <cstdint>
#include <string>

#include "oscar/core/config.hpp"
#include "oscar/core/status.hpp"

namespace oscar {

struct PageTableRef {
  const int32_t* indptr = nullptr;         // [batch_size + 1], indptr[0] == 0, non-decreasing
  const int32_t* indices = nullptr;        // [indptr[batch_size]] page ids into a pool
  const int32_t* last_page_len = nullptr;  // [batch_size]; 1..page_size, or 0 with no pages
  int32_t batch_size = 0;
  int32_t page_size = 0;

  OSCAR_HOST_DEVICE int32_t num_pages(int32_t request) const {
    return indptr[request + 1] - indptr[request];
  }
  OSCAR_HOST_DEVICE int64_t num_tokens(int32_t request) const {
    const int32_t pages = num_pages(request);
    return pages == 0 ? 0 : int64_t{pages - 1} * page_size + last_page_len[request];
  }
  // Page id and slot of the request's token `token` (0-based inside this segment).
  OSCAR_HOST_DEVICE int32_t page_of(int32_t request, int64_t token) const {
    return indices[indptr[request] + static_cast<int32_t>(token / page_size)];
  }
};

// Checks every entry against a pool of `num_pool_pages` pages (host memory only). `name`
// says which table the message is about.
inline Status validate(const PageTableRef& table, int32_t num_pool_pages, const char* name) {
  const std::string what = std::string(name) + " page table: ";
  if (table.batch_size < 0) return invalid_argument(what + "negative batch_size");
  if (table.batch_size == 0) return Status::Ok();
  if (!table.indptr || !table.last_page_len) {
    return invalid_argument(what + "indptr and last_page_len must not be null");
  }
  if (table.indptr[0] != 0) return invalid_argument(what + "indptr[0] must be 0");
  for (int32_t b = 0; b < table.batch_size; ++b) {
    if (table.indptr[b + 1] < table.indptr[b]) {  // compared, not subtracted: the difference can overflow
      return invalid_argument(what + "indptr decreases at request " + std::to_string(b));
    }
    const int32_t pages = table.indptr[b + 1] - table.indptr[b];
    const int32_t last = table.last_page_len[b];
    if (pages == 0 ? last != 0 : (last < 1 || last > table.page_size)) {
      return invalid_argument(what + "last_page_len[" + std::to_string(b) + "] = " +
                              std::to_string(last) + " with " + std::to_string(pages) +
                              " pages (must be 1.." + std::to_string(table.page_size) +
                              ", or 0 without pages)");
    }
  }
  if (table.indptr[table.batch_size] > 0 && !table.indices) {
    return invalid_argument(what + "indices must not be null");
  }
  for (int32_t i = 0; i < table.indptr[table.batch_size]; ++i) {
    if (table.indices[i] < 0 || table.indices[i] >= num_pool_pages) {
      return out_of_range(what + "indices[" + std::to_string(i) + "] = " +
                          std::to_string(table.indices[i]) + " outside the pool of " +
                          std::to_string(num_pool_pages) + " pages");
    }
  }
  return Status::Ok();
}

}  // namespace oscar
