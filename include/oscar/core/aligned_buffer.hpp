// An owning, zero-initialized host byte buffer with a guaranteed alignment (the page pools
// need 16 bytes; 64 keeps rows on cache lines).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace oscar {

class AlignedBuffer {
 public:
  static constexpr std::size_t kAlignment = 64;

  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t bytes) : size_(bytes) {
    if (bytes == 0) return;
    const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    data_.reset(static_cast<std::byte*>(std::aligned_alloc(kAlignment, rounded)));
    if (data_) std::memset(data_.get(), 0, rounded);
  }

  // False when the allocation failed.
  bool allocated() const { return size_ == 0 || data_ != nullptr; }
  std::size_t size() const { return size_; }
  template <class T>
  T* as() {
    return reinterpret_cast<T*>(data_.get());
  }
  template <class T>
  const T* as() const {
    return reinterpret_cast<const T*>(data_.get());
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  std::size_t size_ = 0;
};

}  // namespace oscar
