// A GGUF reader (llama.cpp's model file format, version 2 and 3) and the dequantization of its
// common tensor types to float32. Every read is bounds-checked: a malformed file (truncated,
// bad magic, unknown type, tensor data out of range, absurd counts) gives a Status that names
// the problem, never a crash or a huge allocation.
//
// File layout (little-endian):
//   "GGUF" u32 version, u64 tensor_count, u64 metadata_kv_count
//   metadata: { string key, u32 value_type, value }*      string = u64 length + bytes
//   tensor infos: { string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset }*
//   padding to general.alignment (default 32), then the tensor data; offsets are relative
//   to the start of the data section. ne[0] is the innermost (contiguous) dimension.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"

namespace oscar::decode {

// Tensor element types (ggml_type). Only the ones with a dequantizer are named in
// ggml_type_name(); others are rejected when a tensor of that type is read.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ6_K = 14,
  kBF16 = 30,
};

// Elements per block and bytes per block of a type; {0, 0} for a type we cannot read.
struct BlockShape {
  int64_t elements = 0;
  int64_t bytes = 0;
};

inline BlockShape block_shape(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: return {1, 4};
    case GgmlType::kF16: return {1, 2};
    case GgmlType::kBF16: return {1, 2};
    case GgmlType::kQ4_0: return {32, 2 + 16};
    case GgmlType::kQ4_1: return {32, 2 + 2 + 16};
    case GgmlType::kQ5_0: return {32, 2 + 4 + 16};
    case GgmlType::kQ5_1: return {32, 2 + 2 + 4 + 16};
    case GgmlType::kQ8_0: return {32, 2 + 32};
    case GgmlType::kQ4_K: return {256, 2 + 2 + 12 + 128};
    case GgmlType::kQ6_K: return {256, 128 + 64 + 16 + 2};
  }
  return {};
}

inline std::string ggml_type_name(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: return "F32";
    case GgmlType::kF16: return "F16";
    case GgmlType::kBF16: return "BF16";
    case GgmlType::kQ4_0: return "Q4_0";
    case GgmlType::kQ4_1: return "Q4_1";
    case GgmlType::kQ5_0: return "Q5_0";
    case GgmlType::kQ5_1: return "Q5_1";
    case GgmlType::kQ8_0: return "Q8_0";
    case GgmlType::kQ4_K: return "Q4_K";
    case GgmlType::kQ6_K: return "Q6_K";
  }
  return "type " + std::to_string(type);
}

namespace detail {

inline float half(const uint8_t* p) {
  fp16_t h;
  h.bits = static_cast<uint16_t>(p[0] | (p[1] << 8));
  return fp16_to_float(h);
}
inline uint32_t le32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}

// Q4_K scales: 12 bytes pack 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

}  // namespace detail

// Dequantizes `count` elements (a multiple of the type's block size) from `data`, which holds
// count / elements * bytes bytes. Returns unsupported for a type without a dequantizer.
inline Status dequantize(uint32_t type, const uint8_t* data, int64_t count, float* out) {
  const BlockShape shape = block_shape(type);
  if (shape.elements == 0) return unsupported("tensor type " + ggml_type_name(type) + " cannot be dequantized");
  if (count % shape.elements != 0) {
    return invalid_argument(std::to_string(count) + " elements is not a multiple of the " +
                            ggml_type_name(type) + " block size " + std::to_string(shape.elements));
  }
  const int64_t blocks = count / shape.elements;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = data + b * shape.bytes;
    float* y = out + b * shape.elements;
    switch (static_cast<GgmlType>(type)) {
      case GgmlType::kF32: std::memcpy(y, p, 4); break;
      case GgmlType::kF16: y[0] = detail::half(p); break;
      case GgmlType::kBF16: {
        bf16_t v;
        v.bits = static_cast<uint16_t>(p[0] | (p[1] << 8));
        y[0] = bf16_to_float(v);
        break;
      }
      case GgmlType::kQ4_0: {  // d; 16 bytes: low nibbles are elements 0..15, high 16..31
        const float d = detail::half(p);
        for (int j = 0; j < 16; ++j) {
          y[j] = static_cast<float>((p[2 + j] & 0xF) - 8) * d;
          y[j + 16] = static_cast<float>((p[2 + j] >> 4) - 8) * d;
        }
        break;
      }
      case GgmlType::kQ4_1: {  // d, m; x = q*d + m
        const float d = detail::half(p), m = detail::half(p + 2);
        for (int j = 0; j < 16; ++j) {
          y[j] = static_cast<float>(p[4 + j] & 0xF) * d + m;
          y[j + 16] = static_cast<float>(p[4 + j] >> 4) * d + m;
        }
        break;
      }
      case GgmlType::kQ5_0: {  // d, 32 high bits, 16 bytes of low nibbles; x = (q - 16)*d
        const float d = detail::half(p);
        const uint32_t qh = detail::le32(p + 2);
        for (int j = 0; j < 16; ++j) {
          const int lo = (p[6 + j] & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
          const int hi = (p[6 + j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
          y[j] = static_cast<float>(lo - 16) * d;
          y[j + 16] = static_cast<float>(hi - 16) * d;
        }
        break;
      }
      case GgmlType::kQ5_1: {  // d, m, 32 high bits, 16 bytes; x = q*d + m
        const float d = detail::half(p), m = detail::half(p + 2);
        const uint32_t qh = detail::le32(p + 4);
        for (int j = 0; j < 16; ++j) {
          const int lo = (p[8 + j] & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
          const int hi = (p[8 + j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
          y[j] = static_cast<float>(lo) * d + m;
          y[j + 16] = static_cast<float>(hi) * d + m;
        }
        break;
      }
      case GgmlType::kQ8_0: {  // d, 32 int8
        const float d = detail::half(p);
        for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(p[2 + j])) * d;
        break;
      }
      case GgmlType::kQ4_K: {  // d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        const float d = detail::half(p), dmin = detail::half(p + 2);
        const uint8_t* scales = p + 4;
        const uint8_t* q = p + 16;
        for (int chunk = 0; chunk < 4; ++chunk) {  // 64 elements: 32 low nibbles, 32 high
          int sc0, m0, sc1, m1;
          detail::scale_min_k4(2 * chunk, scales, sc0, m0);
          detail::scale_min_k4(2 * chunk + 1, scales, sc1, m1);
          for (int l = 0; l < 32; ++l) {
            y[chunk * 64 + l] = d * static_cast<float>(sc0) * static_cast<float>(q[l] & 0xF) - dmin * static_cast<float>(m0);
            y[chunk * 64 + 32 + l] = d * static_cast<float>(sc1) * static_cast<float>(q[l] >> 4) - dmin * static_cast<float>(m1);
          }
          q += 32;
        }
        break;
      }
      case GgmlType::kQ6_K: {  // ql[128], qh[64], int8 scales[16], d
        const uint8_t* ql = p;
        const uint8_t* qh = p + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        const float d = detail::half(p + 208);
        for (int half = 0; half < 2; ++half) {  // 128 elements each
          float* yy = y + half * 128;
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            yy[l] = d * static_cast<float>(sc[is + 0] * q1);
            yy[l + 32] = d * static_cast<float>(sc[is + 2] * q2);
            yy[l + 64] = d * static_cast<float>(sc[is + 4] * q3);
            yy[l + 96] = d * static_cast<float>(sc[is + 6] * q4);
          }
          ql += 64;
          qh += 32;
          sc += 8;
        }
        break;
      }
    }
  }
  return Status::Ok();
}

// One metadata value. Scalars of every integer width are widened; arrays keep their element
// type in `array_type` and their values in `strings`, `ints` or `floats`.
enum class GgufValueType : uint32_t {
  kUint8 = 0, kInt8 = 1, kUint16 = 2, kInt16 = 3, kUint32 = 4, kInt32 = 5, kFloat32 = 6,
  kBool = 7, kString = 8, kArray = 9, kUint64 = 10, kInt64 = 11, kFloat64 = 12,
};

struct GgufValue {
  GgufValueType type = GgufValueType::kUint32;
  GgufValueType array_type = GgufValueType::kUint32;
  int64_t integer = 0;  // every integer type and bool (uint64 above 2^63 is rejected)
  double real = 0.0;
  std::string string;
  std::vector<std::string> strings;
  std::vector<int64_t> ints;
  std::vector<double> floats;

  bool is_integer() const {
    switch (type) {
      case GgufValueType::kUint8: case GgufValueType::kInt8: case GgufValueType::kUint16:
      case GgufValueType::kInt16: case GgufValueType::kUint32: case GgufValueType::kInt32:
      case GgufValueType::kUint64: case GgufValueType::kInt64: case GgufValueType::kBool:
        return true;
      default: return false;
    }
  }
};

struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> shape;  // ne[0] first: ne[0] is contiguous
  uint32_t type = 0;
  uint64_t offset = 0;  // from the start of the data section
  int64_t elements = 0;
  int64_t bytes = 0;
};

class GgufFile {
 public:
  // Parses a whole file image (kept in memory: tensors are dequantized from it on demand).
  static Result<GgufFile> parse(std::vector<uint8_t> bytes, std::string origin = "<memory>");
  static Result<GgufFile> open(const std::string& path) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) return io_error("cannot open model file '" + path + "'");
    const std::streamoff size = in.tellg();
    if (size < 0) return io_error("cannot size model file '" + path + "'");
    std::vector<uint8_t> bytes(static_cast<size_t>(size));
    in.seekg(0);
    if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) {
      return io_error("cannot read model file '" + path + "'");
    }
    return parse(std::move(bytes), path);
  }

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::string& origin() const { return origin_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }

  const GgufValue* find(const std::string& key) const {
    auto it = metadata_.find(key);
    return it == metadata_.end() ? nullptr : &it->second;
  }
  const GgufTensorInfo* find_tensor(const std::string& name) const {
    for (const GgufTensorInfo& t : tensors_) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }

  Result<int64_t> get_int(const std::string& key) const {
    const GgufValue* v = find(key);
    if (!v) return data_loss(origin_ + ": metadata key '" + key + "' is missing");
    if (!v->is_integer()) return data_loss(origin_ + ": metadata key '" + key + "' is not an integer");
    return v->integer;
  }
  Result<double> get_float(const std::string& key) const {
    const GgufValue* v = find(key);
    if (!v) return data_loss(origin_ + ": metadata key '" + key + "' is missing");
    if (v->type == GgufValueType::kFloat32 || v->type == GgufValueType::kFloat64) return v->real;
    if (v->is_integer()) return static_cast<double>(v->integer);
    return data_loss(origin_ + ": metadata key '" + key + "' is not a number");
  }
  Result<std::string> get_string(const std::string& key) const {
    const GgufValue* v = find(key);
    if (!v) return data_loss(origin_ + ": metadata key '" + key + "' is missing");
    if (v->type != GgufValueType::kString) return data_loss(origin_ + ": metadata key '" + key + "' is not a string");
    return v->string;
  }

  // The raw bytes of a tensor (validated to lie inside the file at parse time).
  std::span<const uint8_t> tensor_bytes(const GgufTensorInfo& t) const {
    return {bytes_.data() + data_start_ + t.offset, static_cast<size_t>(t.bytes)};
  }

  // A tensor dequantized to float32, ne[0] contiguous. `expected_shape` (ne[0] first), when
  // not empty, must match exactly.
  Result<std::vector<float>> read_f32(const std::string& name,
                                      const std::vector<int64_t>& expected_shape = {}) const {
    const GgufTensorInfo* t = find_tensor(name);
    if (!t) return data_loss(origin_ + ": tensor '" + name + "' is missing");
    if (!expected_shape.empty() && expected_shape != t->shape) {
      return data_loss(origin_ + ": tensor '" + name + "' has shape " + shape_string(t->shape) +
                       ", expected " + shape_string(expected_shape));
    }
    std::vector<float> out(static_cast<size_t>(t->elements));
    Status status = dequantize(t->type, tensor_bytes(*t).data(), t->elements, out.data());
    if (!status.ok()) return Status(status.code(), origin_ + ": tensor '" + name + "': " + status.message());
    return out;
  }

  static std::string shape_string(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }

 private:
  std::vector<uint8_t> bytes_;
  std::string origin_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_start_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
};

namespace detail {

// Sequential, bounds-checked reads over the file image. Every failure says what was being
// read and at which offset.
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> bytes, const std::string& origin) : bytes_(bytes), origin_(origin) {}
  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return bytes_.size() - pos_; }
  const std::string& origin() const { return origin_; }

  Status truncated(const std::string& what) const {
    return data_loss(origin_ + ": file is truncated while reading " + what + " at byte " +
                     std::to_string(pos_) + " (file has " + std::to_string(bytes_.size()) + " bytes)");
  }
  template <class T>
  Status read(T& value, const std::string& what) {
    if (remaining() < sizeof(T)) return truncated(what);
    std::memcpy(&value, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }
  Status read_string(std::string& out, const std::string& what) {
    uint64_t length = 0;
    OSCAR_RETURN_IF_ERROR(read(length, what + " (length)"));
    if (length > remaining()) {
      return data_loss(origin_ + ": " + what + " claims " + std::to_string(length) +
                       " bytes at byte " + std::to_string(pos_) + " but only " +
                       std::to_string(remaining()) + " remain (truncated or corrupt file)");
    }
    out.assign(reinterpret_cast<const char*>(bytes_.data() + pos_), static_cast<size_t>(length));
    pos_ += length;
    return Status::Ok();
  }

 private:
  std::span<const uint8_t> bytes_;
  const std::string& origin_;
  uint64_t pos_ = 0;
};

inline uint64_t scalar_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8: case GgufValueType::kInt8: case GgufValueType::kBool: return 1;
    case GgufValueType::kUint16: case GgufValueType::kInt16: return 2;
    case GgufValueType::kUint32: case GgufValueType::kInt32: case GgufValueType::kFloat32: return 4;
    case GgufValueType::kUint64: case GgufValueType::kInt64: case GgufValueType::kFloat64: return 8;
    default: return 0;
  }
}

// Reads one scalar of type t into integer or real.
inline Status read_scalar(ByteReader& r, GgufValueType t, int64_t& integer, double& real,
                          const std::string& what) {
  switch (t) {
    case GgufValueType::kUint8: { uint8_t v = 0; OSCAR_RETURN_IF_ERROR(r.read(v, what)); integer = v; return Status::Ok(); }
    case GgufValueType::kInt8: { int8_t v = 0; OSCAR_RETURN_IF_ERROR(r.read(v, what)); integer = v; return Status::Ok(); }
    case GgufValueType::kUint16: { uint16_t v = 0; OSCAR_RETURN_IF_ERROR(r.read(v, what)); integer = v; return Status::Ok(); }
    case GgufValueType::kInt16: { int16_t v = 0; OSCAR_RETURN_IF_ERROR(r.read(v, what)); integer = v; return Status::Ok(); }
    case GgufValueType::kUint32: { uint32_t v = 0; OSCAR_RETURN_IF_ERROR(r.read(v, what)); integer = v; return Status::Ok(); }
    case GgufValueType::kInt32: { int32_t v = 0; OSCAR_RETURN_IF_ERROR(r.read(v, what)); integer = v; return Status::Ok(); }
    case GgufValueType::kInt64: { int64_t v = 0; OSCAR_RETURN_IF_ERROR(r.read(v, what)); integer = v; return Status::Ok(); }
    case GgufValueType::kUint64: {
      uint64_t v = 0;
      OSCAR_RETURN_IF_ERROR(r.read(v, what));
      if (v > static_cast<uint64_t>(INT64_MAX)) return data_loss(r.origin() + ": " + what + ": uint64 value " + std::to_string(v) + " is too large");
      integer = static_cast<int64_t>(v);
      return Status::Ok();
    }
    case GgufValueType::kBool: {
      uint8_t v = 0;
      OSCAR_RETURN_IF_ERROR(r.read(v, what));
      if (v > 1) return data_loss(r.origin() + ": " + what + ": bool value " + std::to_string(v) + " is neither 0 nor 1");
      integer = v;
      return Status::Ok();
    }
    case GgufValueType::kFloat32: { float v = 0; OSCAR_RETURN_IF_ERROR(r.read(v, what)); real = v; return Status::Ok(); }
    case GgufValueType::kFloat64: { double v = 0; OSCAR_RETURN_IF_ERROR(r.read(v, what)); real = v; return Status::Ok(); }
    default: return data_loss(r.origin() + ": " + what + ": not a scalar type");
  }
}

inline bool known_value_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::kFloat64); }

}  // namespace detail

inline Result<GgufFile> GgufFile::parse(std::vector<uint8_t> bytes, std::string origin) {
  GgufFile file;
  file.bytes_ = std::move(bytes);
  file.origin_ = std::move(origin);
  const std::string& o = file.origin_;
  detail::ByteReader r(file.bytes_, o);

  char magic[4];
  OSCAR_RETURN_IF_ERROR(r.read(magic, "the magic"));
  if (std::memcmp(magic, "GGUF", 4) != 0) {
    return data_loss(o + ": not a GGUF file (the first 4 bytes are not \"GGUF\")");
  }
  OSCAR_RETURN_IF_ERROR(r.read(file.version_, "the version"));
  if (file.version_ != 2 && file.version_ != 3) {
    return unsupported(o + ": GGUF version " + std::to_string(file.version_) + " is not supported (2 or 3)");
  }
  uint64_t tensor_count = 0, kv_count = 0;
  OSCAR_RETURN_IF_ERROR(r.read(tensor_count, "the tensor count"));
  OSCAR_RETURN_IF_ERROR(r.read(kv_count, "the metadata count"));
  // Each metadata entry needs at least 8 + 4 + 1 bytes and each tensor info 8 + 4 + 4 + 8:
  // larger counts cannot fit in the file, whatever follows.
  if (kv_count > r.remaining() / 13) {
    return data_loss(o + ": metadata count " + std::to_string(kv_count) + " cannot fit in the file");
  }
  if (tensor_count > r.remaining() / 24) {
    return data_loss(o + ": tensor count " + std::to_string(tensor_count) + " cannot fit in the file");
  }

  for (uint64_t i = 0; i < kv_count; ++i) {
    std::string key;
    const std::string entry = "metadata entry " + std::to_string(i);
    OSCAR_RETURN_IF_ERROR(r.read_string(key, entry + " key"));
    const std::string what = entry + " ('" + key + "')";
    uint32_t type_raw = 0;
    OSCAR_RETURN_IF_ERROR(r.read(type_raw, what + " type"));
    if (!detail::known_value_type(type_raw)) {
      return data_loss(o + ": " + what + " has unknown value type " + std::to_string(type_raw));
    }
    GgufValue value;
    value.type = static_cast<GgufValueType>(type_raw);
    if (value.type == GgufValueType::kString) {
      OSCAR_RETURN_IF_ERROR(r.read_string(value.string, what));
    } else if (value.type == GgufValueType::kArray) {
      uint32_t elem_raw = 0;
      uint64_t n = 0;
      OSCAR_RETURN_IF_ERROR(r.read(elem_raw, what + " array type"));
      OSCAR_RETURN_IF_ERROR(r.read(n, what + " array length"));
      if (!detail::known_value_type(elem_raw) || elem_raw == static_cast<uint32_t>(GgufValueType::kArray)) {
        return data_loss(o + ": " + what + " has unsupported array element type " + std::to_string(elem_raw));
      }
      value.array_type = static_cast<GgufValueType>(elem_raw);
      const uint64_t min_size = value.array_type == GgufValueType::kString ? 8 : detail::scalar_size(value.array_type);
      if (n > r.remaining() / min_size) {
        return data_loss(o + ": " + what + " claims " + std::to_string(n) +
                         " elements, more than the rest of the file can hold (truncated or corrupt)");
      }
      for (uint64_t k = 0; k < n; ++k) {
        if (value.array_type == GgufValueType::kString) {
          std::string s;
          OSCAR_RETURN_IF_ERROR(r.read_string(s, what + " element " + std::to_string(k)));
          value.strings.push_back(std::move(s));
        } else {
          int64_t integer = 0;
          double real = 0;
          OSCAR_RETURN_IF_ERROR(detail::read_scalar(r, value.array_type, integer, real, what));
          if (value.array_type == GgufValueType::kFloat32 || value.array_type == GgufValueType::kFloat64) {
            value.floats.push_back(real);
          } else {
            value.ints.push_back(integer);
          }
        }
      }
    } else {
      OSCAR_RETURN_IF_ERROR(detail::read_scalar(r, value.type, value.integer, value.real, what));
    }
    file.metadata_[key] = std::move(value);
  }

  if (const GgufValue* a = file.find("general.alignment")) {
    if (!a->is_integer() || a->integer <= 0 || (a->integer & (a->integer - 1)) != 0 || a->integer > (1 << 20)) {
      return data_loss(o + ": general.alignment must be a power of two up to 2^20");
    }
    file.alignment_ = static_cast<uint64_t>(a->integer);
  }

  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo t;
    OSCAR_RETURN_IF_ERROR(r.read_string(t.name, "tensor info " + std::to_string(i) + " name"));
    const std::string what = "tensor '" + t.name + "'";
    uint32_t n_dims = 0;
    OSCAR_RETURN_IF_ERROR(r.read(n_dims, what + " dimension count"));
    if (n_dims == 0 || n_dims > 4) {
      return data_loss(o + ": " + what + " has " + std::to_string(n_dims) + " dimensions (1 to 4 allowed)");
    }
    t.elements = 1;
    for (uint32_t k = 0; k < n_dims; ++k) {
      uint64_t ne = 0;
      OSCAR_RETURN_IF_ERROR(r.read(ne, what + " dimension " + std::to_string(k)));
      // 2^40 elements per dimension and in total keeps every product below 2^63.
      if (ne == 0 || ne > (uint64_t{1} << 40) / static_cast<uint64_t>(t.elements)) {
        return data_loss(o + ": " + what + " has an invalid dimension " + std::to_string(ne));
      }
      t.shape.push_back(static_cast<int64_t>(ne));
      t.elements *= static_cast<int64_t>(ne);
    }
    OSCAR_RETURN_IF_ERROR(r.read(t.type, what + " type"));
    OSCAR_RETURN_IF_ERROR(r.read(t.offset, what + " offset"));
    const BlockShape shape = block_shape(t.type);
    if (shape.elements == 0) {
      return unsupported(o + ": " + what + " has tensor type " + ggml_type_name(t.type) +
                         ", which this reader cannot dequantize (supported: F32, F16, BF16, Q4_0, "
                         "Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K)");
    }
    if (t.shape[0] % shape.elements != 0) {
      return data_loss(o + ": " + what + " row length " + std::to_string(t.shape[0]) +
                       " is not a multiple of the " + ggml_type_name(t.type) + " block size");
    }
    t.bytes = t.elements / shape.elements * shape.bytes;
    if (t.offset % file.alignment_ != 0) {
      return data_loss(o + ": " + what + " offset " + std::to_string(t.offset) +
                       " is not a multiple of the alignment " + std::to_string(file.alignment_));
    }
    file.tensors_.push_back(std::move(t));
  }

  const uint64_t a = file.alignment_;
  file.data_start_ = (r.pos() + a - 1) / a * a;
  const uint64_t size = file.bytes_.size();
  if (file.data_start_ > size && !file.tensors_.empty()) {
    return data_loss(o + ": file is truncated: the tensor data section would start at byte " +
                     std::to_string(file.data_start_) + " but the file has " + std::to_string(size));
  }
  const uint64_t data_size = file.data_start_ <= size ? size - file.data_start_ : 0;
  for (const GgufTensorInfo& t : file.tensors_) {
    if (t.offset > data_size || static_cast<uint64_t>(t.bytes) > data_size - t.offset) {
      return data_loss(o + ": tensor '" + t.name + "' data [" + std::to_string(t.offset) + ", " +
                       std::to_string(t.offset + static_cast<uint64_t>(t.bytes)) +
                       ") lies outside the data section of " + std::to_string(data_size) +
                       " bytes (truncated or corrupt file)");
    }
  }
  return Result<GgufFile>(std::move(file));
}

}  // namespace oscar::decode
