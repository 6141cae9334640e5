// A reader and writer of the safetensors format (the one PyTorch, JAX and the Hugging Face
// `safetensors` package use), written here so that plan files and calibration dumps need no
// Python and no extra library beyond nlohmann-json:
//
//   [8 bytes: N, little-endian u64][N bytes: JSON header][data buffer]
//   header = {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..],
//             "data_offsets": [begin, end]}, ...}, offsets relative to the data buffer.
//
// Every offset, shape and size in a file is untrusted: the reader checks them all against the
// file size before any data is touched (tensors must tile the data buffer exactly, as the
// reference implementation requires), so a truncated, corrupted or hostile file yields a
// Status, never an out-of-bounds read. Nothing here throws: JSON is parsed without exceptions
// and every JSON value's type is checked before it is read.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"

namespace oscar::io {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

inline const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kF64: return "F64";
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kI64: return "I64";
    case DType::kI32: return "I32";
    case DType::kI16: return "I16";
    case DType::kI8: return "I8";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

inline int dtype_bytes(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64: return 8;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16: return 2;
    case DType::kI8:
    case DType::kU8:
    case DType::kBool: return 1;
  }
  return 0;
}

inline bool parse_dtype(std::string_view name, DType* out) {
  static constexpr DType kAll[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kI64,
                                   DType::kI32, DType::kI16, DType::kI8,  DType::kU8,   DType::kBool};
  for (DType d : kAll) {
    if (name == to_string(d)) {
      *out = d;
      return true;
    }
  }
  return false;
}

// The reference implementation caps the header at 100 MB; so do we, before allocating it.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data buffer, [begin, end)
  uint64_t end = 0;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  std::string shape_string() const {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

namespace detail {

inline uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Parses and validates the JSON header against the size of the data buffer.
inline constexpr int kMaxSafetensorsHeaderDepth = 8;

// Whether JSON text opens more than `limit` nested arrays or objects (brackets inside strings,
// escapes included, do not count). Linear, no allocation.
inline bool json_nesting_exceeds(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

inline Status parse_header(std::string_view what, const char* json_begin, size_t json_size,
                           uint64_t data_bytes, std::vector<TensorInfo>* tensors,
                           std::map<std::string, std::string>* metadata) {
  using nlohmann::json;
  // A safetensors header nests 3 deep (the object, a tensor's entry, its shape). Deeper input
  // is refused before parsing: the parser would build every level (a 100 MB header of '['
  // took ~4 GB).
  if (json_nesting_exceeds(std::string_view(json_begin, json_size), kMaxSafetensorsHeaderDepth)) {
    return data_loss(std::string(what) + ": the header nests deeper than " + std::to_string(kMaxSafetensorsHeaderDepth) +
                     " levels (not a safetensors header)");
  }
  const json header = json::parse(json_begin, json_begin + json_size, nullptr,
                                  /*allow_exceptions=*/false);
  if (header.is_discarded()) return data_loss(std::string(what) + ": the header is not valid JSON");
  if (!header.is_object()) return data_loss(std::string(what) + ": the header is not a JSON object");
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const json& value = it.value();
    if (key == "__metadata__") {
      if (!value.is_object()) return data_loss(std::string(what) + ": __metadata__ is not an object");
      for (auto m = value.begin(); m != value.end(); ++m) {
        if (!m.value().is_string()) {
          return data_loss(std::string(what) + ": metadata \"" + m.key() + "\" is not a string");
        }
        (*metadata)[m.key()] = m.value().get_ref<const std::string&>();
      }
      continue;
    }
    const std::string where = std::string(what) + ": tensor \"" + key + "\"";
    if (!value.is_object()) return data_loss(where + ": entry is not an object");
    const auto dtype = value.find("dtype");
    const auto shape = value.find("shape");
    const auto offsets = value.find("data_offsets");
    if (dtype == value.end() || !dtype->is_string()) return data_loss(where + ": missing or bad \"dtype\"");
    if (shape == value.end() || !shape->is_array()) return data_loss(where + ": missing or bad \"shape\"");
    if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2) {
      return data_loss(where + ": missing or bad \"data_offsets\"");
    }
    TensorInfo info;
    info.name = key;
    if (!parse_dtype(dtype->get_ref<const std::string&>(), &info.dtype)) {
      return data_loss(where + ": unknown dtype \"" + dtype->get_ref<const std::string&>() + "\"");
    }
    // numel * element size must fit in the data buffer; check the product as it grows.
    uint64_t bytes = static_cast<uint64_t>(dtype_bytes(info.dtype));
    bool empty = false;
    for (const json& dim : *shape) {
      if (!dim.is_number_unsigned()) return data_loss(where + ": shape entries must be non-negative integers");
      const uint64_t n = dim.get<uint64_t>();
      if (n > static_cast<uint64_t>(INT64_MAX)) return data_loss(where + ": shape entry too large");
      info.shape.push_back(static_cast<int64_t>(n));
      if (n == 0) empty = true;
      if (!empty && bytes > data_bytes / n) {
        return data_loss(where + ": shape " + info.shape_string() + "... needs more than the " +
                         std::to_string(data_bytes) + " bytes of the data buffer (truncated file?)");
      }
      bytes = empty ? 0 : bytes * n;
    }
    for (const json& o : *offsets) {
      if (!o.is_number_unsigned()) return data_loss(where + ": data_offsets must be non-negative integers");
    }
    info.begin = (*offsets)[0].get<uint64_t>();
    info.end = (*offsets)[1].get<uint64_t>();
    if (info.begin > info.end || info.end > data_bytes) {
      return data_loss(where + ": data_offsets [" + std::to_string(info.begin) + ", " +
                       std::to_string(info.end) + "] outside the data buffer of " +
                       std::to_string(data_bytes) + " bytes (truncated file?)");
    }
    if (info.end - info.begin != bytes) {
      return data_loss(where + ": data_offsets span " + std::to_string(info.end - info.begin) +
                       " bytes but dtype " + to_string(info.dtype) + " and shape " +
                       info.shape_string() + " need " + std::to_string(bytes));
    }
    tensors->push_back(std::move(info));
  }
  // The tensors must tile the buffer: no overlap (aliasing), no holes, nothing after the last.
  std::vector<const TensorInfo*> order;
  for (const TensorInfo& t : *tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  for (const TensorInfo* t : order) {
    if (t->begin != covered) {
      return data_loss(std::string(what) + ": tensor \"" + t->name + "\" starts at byte " +
                       std::to_string(t->begin) + " of the data buffer, expected " +
                       std::to_string(covered) + " (overlapping or non-contiguous tensors)");
    }
    covered = t->end;
  }
  if (covered != data_bytes) {
    return data_loss(std::string(what) + ": " + std::to_string(data_bytes - covered) +
                     " bytes after the last tensor (corrupted header or trailing garbage)");
  }
  return Status::Ok();
}

}  // namespace detail

// A parsed safetensors file. The data stays where it is (in memory, or in the file, read on
// demand), so a many-gigabyte calibration dump can be read one tensor at a time.
class SafetensorsFile {
 public:
  // From bytes in memory (copied). `what` names the source in messages.
  static Result<SafetensorsFile> parse(std::span<const uint8_t> bytes, std::string what = "safetensors buffer") {
    SafetensorsFile file;
    file.what_ = std::move(what);
    file.memory_.assign(bytes.begin(), bytes.end());
    file.in_memory_ = true;
    OSCAR_RETURN_IF_ERROR(file.parse_prefix(file.memory_.size()));
    return Result<SafetensorsFile>(std::move(file));
  }

  // Opens a file and reads its header only.
  static Result<SafetensorsFile> open(const std::string& path) {
    SafetensorsFile file;
    file.what_ = path;
    file.stream_ = std::make_unique<std::ifstream>(path, std::ios::binary);
    if (!*file.stream_) return io_error(path + ": cannot open for reading (" + std::strerror(errno) + ")");
    file.stream_->seekg(0, std::ios::end);
    const std::streamoff size = file.stream_->tellg();
    if (size < 0) return io_error(path + ": cannot determine the file size");
    OSCAR_RETURN_IF_ERROR(file.parse_prefix(static_cast<uint64_t>(size)));
    return Result<SafetensorsFile>(std::move(file));
  }

  const std::string& source() const { return what_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  const TensorInfo* find(std::string_view name) const {
    for (const TensorInfo& t : tensors_) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }

  // The raw little-endian bytes of a tensor.
  Result<std::vector<uint8_t>> read_bytes(const TensorInfo& info) const {
    std::vector<uint8_t> out(info.end - info.begin);
    const uint64_t at = data_start_ + info.begin;
    if (in_memory_) {
      std::memcpy(out.data(), memory_.data() + at, out.size());
    } else {
      stream_->clear();
      stream_->seekg(static_cast<std::streamoff>(at));
      stream_->read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
      if (!*stream_) return io_error(what_ + ": reading tensor \"" + info.name + "\" failed");
    }
    return Result<std::vector<uint8_t>>(std::move(out));
  }

  // A float tensor widened (F32/F16/BF16/F64 -> T): what fitting reads activations with.
  template <class T>
  Result<std::vector<T>> read_as(const TensorInfo& info) const {
    auto bytes = read_bytes(info);
    if (!bytes.ok()) return bytes.status();
    const uint8_t* p = bytes->data();
    const size_t n = static_cast<size_t>(info.numel());
    std::vector<T> out(n);
    switch (info.dtype) {
      case DType::kF32:
        for (size_t i = 0; i < n; ++i) {
          float f;
          std::memcpy(&f, p + 4 * i, 4);
          out[i] = static_cast<T>(f);
        }
        break;
      case DType::kF64:
        for (size_t i = 0; i < n; ++i) {
          double f;
          std::memcpy(&f, p + 8 * i, 8);
          out[i] = static_cast<T>(f);
        }
        break;
      case DType::kF16:
        for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(fp16_to_float(fp16_t{static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8))}));
        break;
      case DType::kBF16:
        for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(bf16_to_float(bf16_t{static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8))}));
        break;
      default:
        return invalid_argument(what_ + ": tensor \"" + info.name + "\" has dtype " +
                                to_string(info.dtype) + ", expected F32, F16, BF16 or F64");
    }
    return Result<std::vector<T>>(std::move(out));
  }

  template <class T>
  Result<std::vector<T>> read_as(std::string_view name) const {
    const TensorInfo* info = find(name);
    if (!info) return invalid_argument(what_ + ": no tensor \"" + std::string(name) + "\"");
    return read_as<T>(*info);
  }

 private:
  Status parse_prefix(uint64_t file_bytes) {
    if (file_bytes < 8) {
      return data_loss(what_ + ": " + std::to_string(file_bytes) +
                       " bytes, too short for a safetensors file (truncated?)");
    }
    uint8_t len_bytes[8];
    OSCAR_RETURN_IF_ERROR(read_at(0, len_bytes, 8));
    const uint64_t header_bytes = detail::read_le64(len_bytes);
    if (header_bytes > kMaxSafetensorsHeaderBytes) {
      return data_loss(what_ + ": header length " + std::to_string(header_bytes) +
                       " exceeds the 100 MB limit (not a safetensors file?)");
    }
    if (header_bytes > file_bytes - 8) {
      return data_loss(what_ + ": header length " + std::to_string(header_bytes) + " but only " +
                       std::to_string(file_bytes - 8) + " bytes follow (truncated file)");
    }
    std::string json(header_bytes, '\0');
    OSCAR_RETURN_IF_ERROR(read_at(8, json.data(), header_bytes));
    data_start_ = 8 + header_bytes;
    return detail::parse_header(what_, json.data(), json.size(), file_bytes - data_start_, &tensors_,
                                &metadata_);
  }

  Status read_at(uint64_t at, void* out, uint64_t n) const {
    if (in_memory_) {
      std::memcpy(out, memory_.data() + at, n);
      return Status::Ok();
    }
    stream_->clear();
    stream_->seekg(static_cast<std::streamoff>(at));
    stream_->read(static_cast<char*>(out), static_cast<std::streamsize>(n));
    return *stream_ ? Status::Ok() : io_error(what_ + ": read failed");
  }

  std::string what_;
  bool in_memory_ = false;
  std::vector<uint8_t> memory_;
  std::unique_ptr<std::ifstream> stream_;
  uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The bytes of F32 values as safetensors stores them (little-endian, whatever the host).
inline std::vector<uint8_t> f32_le_bytes(std::span<const float> values) {
  std::vector<uint8_t> bytes(values.size() * 4);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint32_t b = float_bits(values[i]);
    for (int k = 0; k < 4; ++k) bytes[4 * i + k] = static_cast<uint8_t>(b >> (8 * k));
  }
  return bytes;
}

// The same for F64 values.
inline std::vector<uint8_t> f64_le_bytes(std::span<const double> values) {
  std::vector<uint8_t> bytes(values.size() * 8);
  for (size_t i = 0; i < values.size(); ++i) {
    uint64_t b;
    std::memcpy(&b, &values[i], 8);
    for (int k = 0; k < 8; ++k) bytes[8 * i + k] = static_cast<uint8_t>(b >> (8 * k));
  }
  return bytes;
}

// Collects tensors and metadata, then serializes them in one go.
class SafetensorsWriter {
 public:
  Status add(std::string name, DType dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
    if (name.empty() || name == "__metadata__") return invalid_argument("tensor name \"" + name + "\" is reserved or empty");
    for (const Entry& e : entries_) {
      if (e.info.name == name) return invalid_argument("tensor \"" + name + "\" added twice");
    }
    Entry e;
    e.info.name = std::move(name);
    e.info.dtype = dtype;
    e.info.shape = std::move(shape);
    uint64_t size = static_cast<uint64_t>(dtype_bytes(dtype));  // checked as it grows: numel() could wrap
    for (int64_t s : e.info.shape) {
      if (s < 0) return invalid_argument("tensor \"" + e.info.name + "\": negative shape entry");
      if (__builtin_mul_overflow(size, static_cast<uint64_t>(s), &size) || size > uint64_t{INT64_MAX}) {
        return invalid_argument("tensor \"" + e.info.name + "\": shape " + e.info.shape_string() + " is too large");
      }
    }
    if (size != bytes.size()) {
      return invalid_argument("tensor \"" + e.info.name + "\": " + std::to_string(bytes.size()) +
                              " bytes for shape " + e.info.shape_string() + " of " + to_string(dtype));
    }
    e.bytes = std::move(bytes);
    entries_.push_back(std::move(e));
    return Status::Ok();
  }
  Status add_f32(std::string name, std::vector<int64_t> shape, std::span<const float> values) {
    return add(std::move(name), DType::kF32, std::move(shape), f32_le_bytes(values));
  }
  Status add_f64(std::string name, std::vector<int64_t> shape, std::span<const double> values) {
    return add(std::move(name), DType::kF64, std::move(shape), f64_le_bytes(values));
  }
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  // The whole file. The header is padded with spaces to a multiple of 8 bytes so that every
  // tensor starts 8-byte aligned for readers that map the file.
  std::vector<uint8_t> serialize() const {
    nlohmann::json header = nlohmann::json::object();
    if (!metadata_.empty()) header["__metadata__"] = metadata_;
    uint64_t offset = 0;
    for (const Entry& e : entries_) {
      header[e.info.name] = {{"dtype", to_string(e.info.dtype)},
                             {"shape", e.info.shape},
                             {"data_offsets", {offset, offset + e.bytes.size()}}};
      offset += e.bytes.size();
    }
    // `replace`: a metadata string that is not UTF-8 must not throw from dump().
    std::string json = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    while (json.size() % 8 != 0) json.push_back(' ');
    std::vector<uint8_t> out(8 + json.size() + offset);
    for (int k = 0; k < 8; ++k) out[k] = static_cast<uint8_t>(static_cast<uint64_t>(json.size()) >> (8 * k));
    std::memcpy(out.data() + 8, json.data(), json.size());
    uint8_t* p = out.data() + 8 + json.size();
    for (const Entry& e : entries_) {
      if (!e.bytes.empty()) std::memcpy(p, e.bytes.data(), e.bytes.size());
      p += e.bytes.size();
    }
    return out;
  }

 private:
  struct Entry {
    TensorInfo info;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes `bytes` to `path` atomically: a temporary file in the same directory, flushed to
// disk, then renamed over `path`. A crash leaves either the old file or the new one, never a
// half-written one (rename is atomic within a file system on POSIX).
// The temporary file is created exclusively (O_EXCL: never one another thread or process is
// writing, never through a link left at its name), named by the process and a counter.
inline Status write_file_atomic(const std::string& path, std::span<const uint8_t> bytes) {
  static std::atomic<uint64_t> counter{0};
  std::string temp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    temp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return io_error(temp + ": cannot create (" + std::strerror(errno) + ")");
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      ::unlink(temp.c_str());
      return io_error(temp + ": write failed (" + why + ")");
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const int sync_errno = errno;
  const bool closed = ::close(fd) == 0;  // closed whether or not the flush worked
  if (!synced || !closed) {
    const std::string why = std::strerror(synced ? errno : sync_errno);
    ::unlink(temp.c_str());
    return io_error(temp + ": flush failed (" + why + ")");
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(temp.c_str());
    return io_error(path + ": cannot rename the temporary file into place (" + why + ")");
  }
  return Status::Ok();
}

}  // namespace oscar::io
