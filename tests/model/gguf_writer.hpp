// Builds small GGUF files in memory for the reader's tests, written from the format
// description (not from the reader): header, metadata, tensor infos, alignment padding, data.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace oscar::testing {

class GgufWriter {
 public:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> shape;
    uint32_t type;
    std::vector<uint8_t> data;
    uint64_t offset_override = UINT64_MAX;  // to forge bad offsets
  };

  uint32_t version = 3;
  uint64_t alignment = 32;
  char magic[4] = {'G', 'G', 'U', 'F'};

  void add_u32(const std::string& key, uint32_t v) { kv(key, 4, bytes_of(v)); }
  void add_i32(const std::string& key, int32_t v) { kv(key, 5, bytes_of(v)); }
  void add_f32(const std::string& key, float v) { kv(key, 6, bytes_of(v)); }
  void add_bool(const std::string& key, bool v) { kv(key, 7, {static_cast<uint8_t>(v)}); }
  void add_string(const std::string& key, const std::string& v) { kv(key, 8, str(v)); }
  void add_string_array(const std::string& key, const std::vector<std::string>& values) {
    std::vector<uint8_t> b = bytes_of(uint32_t{8});
    append(b, bytes_of(static_cast<uint64_t>(values.size())));
    for (const auto& s : values) append(b, str(s));
    kv(key, 9, b);
  }
  void add_i32_array(const std::string& key, const std::vector<int32_t>& values) {
    std::vector<uint8_t> b = bytes_of(uint32_t{5});
    append(b, bytes_of(static_cast<uint64_t>(values.size())));
    for (int32_t v : values) append(b, bytes_of(v));
    kv(key, 9, b);
  }
  // A raw entry: key, value type, value bytes as given (for malformed entries).
  void add_raw(const std::string& key, uint32_t type, const std::vector<uint8_t>& value) { kv(key, type, value); }

  void add_tensor(Tensor t) { tensors_.push_back(std::move(t)); }

  std::vector<uint8_t> build() const {
    std::vector<uint8_t> out(magic, magic + 4);
    append(out, bytes_of(version));
    append(out, bytes_of(static_cast<uint64_t>(tensors_.size())));
    append(out, bytes_of(static_cast<uint64_t>(num_kv_)));
    append(out, metadata_);
    uint64_t offset = 0;
    std::vector<uint64_t> offsets;
    for (const Tensor& t : tensors_) {
      offsets.push_back(offset);
      offset += (t.data.size() + alignment - 1) / alignment * alignment;
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const Tensor& t = tensors_[i];
      append(out, str(t.name));
      append(out, bytes_of(static_cast<uint32_t>(t.shape.size())));
      for (uint64_t d : t.shape) append(out, bytes_of(d));
      append(out, bytes_of(t.type));
      append(out, bytes_of(t.offset_override != UINT64_MAX ? t.offset_override : offsets[i]));
    }
    while (out.size() % alignment) out.push_back(0);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      append(out, tensors_[i].data);
      // Pad between tensors only: the last tensor's data ends the file, so any truncation
      // cuts into it.
      if (i + 1 < tensors_.size()) {
        while (out.size() % alignment) out.push_back(0);
      }
    }
    return out;
  }

  template <class T>
  static std::vector<uint8_t> bytes_of(T v) {
    std::vector<uint8_t> b(sizeof(T));
    std::memcpy(b.data(), &v, sizeof(T));
    return b;
  }
  static std::vector<uint8_t> str(const std::string& s) {
    // Sized once: GCC 12 warns falsely (-Warray-bounds) on inserting after an 8-byte vector.
    std::vector<uint8_t> b(8 + s.size());
    const uint64_t n = s.size();
    std::memcpy(b.data(), &n, 8);
    if (n) std::memcpy(b.data() + 8, s.data(), n);
    return b;
  }
  static void append(std::vector<uint8_t>& a, const std::vector<uint8_t>& b) { a.insert(a.end(), b.begin(), b.end()); }

 private:
  void kv(const std::string& key, uint32_t type, const std::vector<uint8_t>& value) {
    append(metadata_, str(key));
    append(metadata_, bytes_of(type));
    append(metadata_, value);
    ++num_kv_;
  }
  std::vector<uint8_t> metadata_;
  size_t num_kv_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace oscar::testing
