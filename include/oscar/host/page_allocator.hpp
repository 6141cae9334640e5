// Reference-counted page ids of one pool: the host side of prefix sharing. A page returns to
// the free list when its last holder releases it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "oscar/core/status.hpp"

namespace oscar::host {

class PageAllocator {
 public:
  PageAllocator() = default;
  explicit PageAllocator(int32_t num_pages) : ref_counts_(num_pages, 0) {
    free_.reserve(num_pages);
    for (int32_t page = num_pages - 1; page >= 0; --page) free_.push_back(page);  // 0 first
  }

  int32_t capacity() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return capacity() - num_free(); }
  int32_t ref_count(int32_t page) const { return ref_counts_[page]; }
  // The same, or `outside` for a page that is not in the pool.
  int32_t ref_count_or(int32_t page, int32_t outside) const {
    return page >= 0 && page < capacity() ? ref_counts_[page] : outside;
  }

  // A page with one reference, or kResourceExhausted naming the pool.
  Result<int32_t> allocate(const char* pool_name) {
    if (free_.empty()) {
      return resource_exhausted(std::string("no free page left in the ") + pool_name +
                                " pool (" + std::to_string(capacity()) + " pages)");
    }
    const int32_t page = free_.back();
    free_.pop_back();
    ref_counts_[page] = 1;
    return page;
  }
  void retain(int32_t page) { ++ref_counts_[page]; }
  void release(int32_t page) {
    if (--ref_counts_[page] == 0) free_.push_back(page);
  }

 private:
  std::vector<int32_t> ref_counts_;
  std::vector<int32_t> free_;
};

}  // namespace oscar::host
