// The plan file: what offline fitting hands to an engine. A safetensors file (readable by
// Python's `safetensors` and PyTorch) holding, per layer l,
//   layers.{l}.k_rotation   F32 [head_dim, head_dim]   R_K, row-major, k' = k·R_K
//   layers.{l}.v_rotation   F32 [head_dim, head_dim]   R_V
// and for all layers
//   k_clip_ratios           F32 [num_layers]           rho_K per layer
//   v_clip_ratios           F32 [num_layers]           rho_V per layer
// with string metadata: format ("oscar-plan"), format_version, int2_format_version, method,
// clip_method, head_dim, num_layers, num_qo_heads, num_kv_heads, quant_group_size,
// sink_tokens, recent_tokens, calibration_tokens, model_name, content_crc32. docs/fitting.md
// lists them.
//
// Loading validates everything and names the tensor or key at fault: a truncated or corrupted
// file (content_crc32, the CRC-32 of every tensor and of the metadata but model_name, catches
// what the structural checks cannot: a changed clip ratio, sink size or rotation entry), a
// missing or unexpected tensor, a wrong dtype or shape, a non-finite value, a matrix
// that is not orthogonal (max |R·Rᵀ - I| > 1e-4), a clip ratio outside (0, 1], and (through
// check_plan_matches) a plan fitted for another model. Saving is atomic.
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "oscar/core/status.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/io/checksum.hpp"
#include "oscar/io/safetensors.hpp"
#include "oscar/quant/format.hpp"

namespace oscar::io {

inline constexpr int32_t kPlanFormatVersion = 1;
inline constexpr const char* kPlanFormatTag = "oscar-plan";
// float32 rotations fitted in float64 are orthogonal to ~1e-7 per entry; 1e-4 leaves room for
// any honest rounding and still rejects a corrupted or wrong matrix (one flipped mantissa bit
// above bit 13 of one entry already exceeds it).
inline constexpr double kOrthogonalityTolerance = 1e-4;
// The metadata key of the content checksum (8 lowercase hex digits). Plans written before it
// existed have none and load unchecked.
inline constexpr const char* kPlanChecksumKey = "content_crc32";

struct PlanLayer {
  std::vector<float> k_rotation;  // [head_dim * head_dim], row-major
  std::vector<float> v_rotation;
  float k_clip_ratio = 1.0f;
  float v_clip_ratio = 1.0f;
  bool operator==(const PlanLayer&) const = default;
};

struct Plan {
  int32_t format_version = kPlanFormatVersion;
  std::string method = "oscar";        // rotation method (oscar, hadamard, ...)
  std::string clip_method = "fitted";  // fitted (grid search) or fixed
  int32_t head_dim = 128;
  int32_t num_layers = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t quant_group_size = 0;  // 0: one group per row
  int32_t sink_tokens = 64;      // defaults the plan was fitted for; an engine may override
  int32_t recent_tokens = 256;
  int64_t calibration_tokens = 0;
  std::string model_name;
  std::vector<PlanLayer> layers;
  bool operator==(const Plan&) const = default;
};

inline std::string layer_tensor_name(int32_t layer, const char* what) {
  return "layers." + std::to_string(layer) + "." + what;
}

namespace detail {

inline Status check_matrix(const std::vector<float>& r, int32_t d, const std::string& name) {
  if (r.size() != static_cast<size_t>(d) * d) {
    return invalid_argument(name + ": " + std::to_string(r.size()) + " entries, expected " + std::to_string(d) +
                            "x" + std::to_string(d));
  }
  for (size_t i = 0; i < r.size(); ++i) {
    if (!std::isfinite(r[i])) return invalid_argument(name + ": entry " + std::to_string(i) + " is not finite");
  }
  const Eigen::MatrixXd m =
      Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(r.data(), d, d)
          .cast<double>();
  const double err = (m * m.transpose() - Eigen::MatrixXd::Identity(d, d)).cwiseAbs().maxCoeff();
  if (!(err <= kOrthogonalityTolerance)) {
    return invalid_argument(name + ": not orthogonal (max |R·Rᵀ - I| = " + std::to_string(err) + " > 1e-4)");
  }
  return Status::Ok();
}

inline Status parse_int(const std::map<std::string, std::string>& meta, const std::string& what, const char* key,
                        int64_t lo, int64_t hi, int64_t* out) {
  const auto it = meta.find(key);
  if (it == meta.end()) return data_loss(what + ": metadata key \"" + key + "\" is missing");
  const std::string& s = it->second;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty()) {
    return data_loss(what + ": metadata \"" + key + "\" = \"" + s + "\" is not an integer");
  }
  if (v < lo || v > hi) {
    return data_loss(what + ": metadata \"" + key + "\" = " + s + " outside [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  }
  *out = v;
  return Status::Ok();
}

inline Status parse_string(const std::map<std::string, std::string>& meta, const std::string& what, const char* key,
                           std::string* out) {
  const auto it = meta.find(key);
  if (it == meta.end()) return data_loss(what + ": metadata key \"" + key + "\" is missing");
  *out = it->second;
  return Status::Ok();
}

// The metadata keys the content checksum covers, in this order: all of them but model_name
// (free text, which a writer may have to re-encode as UTF-8) and the checksum itself.
inline constexpr const char* kChecksummedKeys[] = {
    "format",          "format_version", "int2_format_version", "method",        "clip_method",
    "head_dim",        "num_layers",     "num_qo_heads",        "num_kv_heads",  "quant_group_size",
    "sink_tokens",     "recent_tokens",  "calibration_tokens"};

inline uint32_t crc32_of_floats(std::span<const float> values, uint32_t crc) {
  return crc32(f32_le_bytes(values), crc);  // the bytes the file stores
}

// CRC-32 of "key=value\n" for each checksummed key (an absent key counts as an empty value),
// then of the tensors' little-endian bytes in this order: layers.0.k_rotation,
// layers.0.v_rotation, layers.1.k_rotation, ..., k_clip_ratios, v_clip_ratios.
// python/oscar_plan.py computes the same.
inline uint32_t plan_content_crc32(const std::map<std::string, std::string>& meta, const Plan& plan) {
  uint32_t crc = 0;
  for (const char* key : kChecksummedKeys) {
    const auto it = meta.find(key);
    crc = crc32(std::string(key) + "=" + (it == meta.end() ? std::string() : it->second) + "\n", crc);
  }
  std::vector<float> k_clip, v_clip;
  for (const PlanLayer& layer : plan.layers) {
    crc = crc32_of_floats(layer.k_rotation, crc);
    crc = crc32_of_floats(layer.v_rotation, crc);
    k_clip.push_back(layer.k_clip_ratio);
    v_clip.push_back(layer.v_clip_ratio);
  }
  crc = crc32_of_floats(k_clip, crc);
  return crc32_of_floats(v_clip, crc);
}

inline std::string crc32_hex(uint32_t crc) {
  static const char* kDigits = "0123456789abcdef";
  std::string hex(8, '0');
  for (int i = 7; i >= 0; --i, crc >>= 4) hex[i] = kDigits[crc & 0xfu];
  return hex;
}

}  // namespace detail

// Everything a plan must satisfy, whether it comes from a fit or from a file.
inline Status validate(const Plan& plan) {
  if (plan.format_version != kPlanFormatVersion) {
    return unsupported("plan format_version " + std::to_string(plan.format_version) + " (this oscar reads " +
                       std::to_string(kPlanFormatVersion) + ")");
  }
  if (!is_supported_head_dim(plan.head_dim)) {
    return invalid_argument("plan head_dim " + std::to_string(plan.head_dim) + " is not supported (64, 128, 256)");
  }
  if (plan.quant_group_size != 0 && !is_supported_quant_group(plan.head_dim, plan.quant_group_size)) {
    return invalid_argument("plan quant_group_size " + std::to_string(plan.quant_group_size) +
                            " is not supported for head_dim " + std::to_string(plan.head_dim));
  }
  if (plan.num_layers <= 0 || static_cast<size_t>(plan.num_layers) != plan.layers.size()) {
    return invalid_argument("plan num_layers " + std::to_string(plan.num_layers) + " but " +
                            std::to_string(plan.layers.size()) + " layers");
  }
  if (plan.num_kv_heads <= 0 || plan.num_qo_heads <= 0 || plan.num_qo_heads % plan.num_kv_heads != 0) {
    return invalid_argument("plan num_qo_heads " + std::to_string(plan.num_qo_heads) +
                            " is not a positive multiple of num_kv_heads " + std::to_string(plan.num_kv_heads));
  }
  if (plan.sink_tokens < 0 || plan.recent_tokens < 0 || plan.calibration_tokens < 0) {
    return invalid_argument("plan sink_tokens, recent_tokens and calibration_tokens must be >= 0");
  }
  // Printable ASCII: the checksum covers these strings as written, and the writer would store
  // invalid UTF-8 as U+FFFD: a plan holding other bytes would be saved unreadable.
  for (const auto& [key, value] : {std::pair{"method", &plan.method}, std::pair{"clip_method", &plan.clip_method}}) {
    for (const char ch : *value) {
      if (ch < 0x20 || ch > 0x7e) {
        return invalid_argument(std::string("plan ") + key + " must be printable ASCII (a name such as \"oscar\")");
      }
    }
  }
  for (int32_t l = 0; l < plan.num_layers; ++l) {
    const PlanLayer& layer = plan.layers[l];
    OSCAR_RETURN_IF_ERROR(detail::check_matrix(layer.k_rotation, plan.head_dim, layer_tensor_name(l, "k_rotation")));
    OSCAR_RETURN_IF_ERROR(detail::check_matrix(layer.v_rotation, plan.head_dim, layer_tensor_name(l, "v_rotation")));
    for (const auto& [name, rho] : {std::pair{"k_clip_ratios", layer.k_clip_ratio}, std::pair{"v_clip_ratios", layer.v_clip_ratio}}) {
      if (!(rho > 0.0f && rho <= 1.0f)) {
        return invalid_argument(std::string(name) + "[" + std::to_string(l) + "] = " + std::to_string(rho) +
                                " outside (0, 1]");
      }
    }
  }
  return Status::Ok();
}

inline Result<std::vector<uint8_t>> serialize_plan(const Plan& plan) {
  OSCAR_RETURN_IF_ERROR(validate(plan));
  SafetensorsWriter w;
  const int64_t d = plan.head_dim;
  std::vector<float> k_clip, v_clip;
  for (int32_t l = 0; l < plan.num_layers; ++l) {
    OSCAR_RETURN_IF_ERROR(w.add_f32(layer_tensor_name(l, "k_rotation"), {d, d}, plan.layers[l].k_rotation));
    OSCAR_RETURN_IF_ERROR(w.add_f32(layer_tensor_name(l, "v_rotation"), {d, d}, plan.layers[l].v_rotation));
    k_clip.push_back(plan.layers[l].k_clip_ratio);
    v_clip.push_back(plan.layers[l].v_clip_ratio);
  }
  OSCAR_RETURN_IF_ERROR(w.add_f32("k_clip_ratios", {plan.num_layers}, k_clip));
  OSCAR_RETURN_IF_ERROR(w.add_f32("v_clip_ratios", {plan.num_layers}, v_clip));
  std::map<std::string, std::string> meta{
      {"format", kPlanFormatTag},
      {"format_version", std::to_string(plan.format_version)},
      {"int2_format_version", std::to_string(kInt2FormatVersion)},
      {"method", plan.method},
      {"clip_method", plan.clip_method},
      {"head_dim", std::to_string(plan.head_dim)},
      {"num_layers", std::to_string(plan.num_layers)},
      {"num_qo_heads", std::to_string(plan.num_qo_heads)},
      {"num_kv_heads", std::to_string(plan.num_kv_heads)},
      {"quant_group_size", std::to_string(plan.quant_group_size)},
      {"sink_tokens", std::to_string(plan.sink_tokens)},
      {"recent_tokens", std::to_string(plan.recent_tokens)},
      {"calibration_tokens", std::to_string(plan.calibration_tokens)},
      {"model_name", plan.model_name}};
  meta[kPlanChecksumKey] = detail::crc32_hex(detail::plan_content_crc32(meta, plan));
  for (const auto& [key, value] : meta) w.set_metadata(key, value);
  return w.serialize();
}

inline Result<Plan> plan_from_safetensors(const SafetensorsFile& file) {
  const std::string& what = file.source();
  const auto& meta = file.metadata();
  const auto format = meta.find("format");
  if (format == meta.end()) return data_loss(what + ": not an oscar plan (no \"format\" metadata)");
  const std::string& tag = format->second;
  if (tag != kPlanFormatTag) return data_loss(what + ": metadata \"format\" is \"" + tag + "\", not an oscar plan");
  Plan plan;
  int64_t v = 0;
  OSCAR_RETURN_IF_ERROR(detail::parse_int(meta, what, "format_version", 0, INT32_MAX, &v));
  if (v != kPlanFormatVersion) {
    return unsupported(what + ": plan format_version " + std::to_string(v) + " (this oscar reads " +
                       std::to_string(kPlanFormatVersion) + ")");
  }
  plan.format_version = static_cast<int32_t>(v);
  OSCAR_RETURN_IF_ERROR(detail::parse_int(meta, what, "int2_format_version", 0, INT32_MAX, &v));
  if (v != kInt2FormatVersion) {
    return unsupported(what + ": fitted for INT2 format version " + std::to_string(v) + ", this oscar writes " +
                       std::to_string(kInt2FormatVersion));
  }
  auto get_i32 = [&](const char* key, int64_t lo, int32_t* out) -> Status {
    int64_t x = 0;
    OSCAR_RETURN_IF_ERROR(detail::parse_int(meta, what, key, lo, INT32_MAX, &x));
    *out = static_cast<int32_t>(x);
    return Status::Ok();
  };
  OSCAR_RETURN_IF_ERROR(get_i32("head_dim", 1, &plan.head_dim));
  OSCAR_RETURN_IF_ERROR(get_i32("num_layers", 1, &plan.num_layers));
  OSCAR_RETURN_IF_ERROR(get_i32("num_qo_heads", 1, &plan.num_qo_heads));
  OSCAR_RETURN_IF_ERROR(get_i32("num_kv_heads", 1, &plan.num_kv_heads));
  OSCAR_RETURN_IF_ERROR(get_i32("quant_group_size", 0, &plan.quant_group_size));
  OSCAR_RETURN_IF_ERROR(get_i32("sink_tokens", 0, &plan.sink_tokens));
  OSCAR_RETURN_IF_ERROR(get_i32("recent_tokens", 0, &plan.recent_tokens));
  OSCAR_RETURN_IF_ERROR(detail::parse_int(meta, what, "calibration_tokens", 0, INT64_MAX, &plan.calibration_tokens));
  OSCAR_RETURN_IF_ERROR(detail::parse_string(meta, what, "method", &plan.method));
  OSCAR_RETURN_IF_ERROR(detail::parse_string(meta, what, "clip_method", &plan.clip_method));
  OSCAR_RETURN_IF_ERROR(detail::parse_string(meta, what, "model_name", &plan.model_name));
  if (!is_supported_head_dim(plan.head_dim)) {
    return data_loss(what + ": head_dim " + std::to_string(plan.head_dim) + " is not supported (64, 128, 256)");
  }
  // Bounded before any allocation that depends on it: 2 d×d tensors per layer must exist.
  if (static_cast<uint64_t>(plan.num_layers) > file.tensors().size()) {
    return data_loss(what + ": num_layers " + std::to_string(plan.num_layers) + " but only " +
                     std::to_string(file.tensors().size()) + " tensors");
  }

  std::set<std::string> expected;
  const int64_t d = plan.head_dim;
  auto read_f32 = [&](const std::string& name, std::vector<int64_t> shape, std::vector<float>* out) -> Status {
    expected.insert(name);
    const TensorInfo* info = file.find(name);
    if (!info) return data_loss(what + ": tensor \"" + name + "\" is missing");
    if (info->dtype != DType::kF32) {
      return data_loss(what + ": tensor \"" + name + "\" has dtype " + to_string(info->dtype) + ", expected F32");
    }
    if (info->shape != shape) {
      TensorInfo want;
      want.shape = shape;
      return data_loss(what + ": tensor \"" + name + "\" has shape " + info->shape_string() + ", expected " +
                       want.shape_string());
    }
    auto values = file.read_as<float>(*info);
    if (!values.ok()) return values.status();
    *out = std::move(*values);
    return Status::Ok();
  };
  plan.layers.resize(plan.num_layers);
  for (int32_t l = 0; l < plan.num_layers; ++l) {
    OSCAR_RETURN_IF_ERROR(read_f32(layer_tensor_name(l, "k_rotation"), {d, d}, &plan.layers[l].k_rotation));
    OSCAR_RETURN_IF_ERROR(read_f32(layer_tensor_name(l, "v_rotation"), {d, d}, &plan.layers[l].v_rotation));
  }
  std::vector<float> k_clip, v_clip;
  OSCAR_RETURN_IF_ERROR(read_f32("k_clip_ratios", {plan.num_layers}, &k_clip));
  OSCAR_RETURN_IF_ERROR(read_f32("v_clip_ratios", {plan.num_layers}, &v_clip));
  for (int32_t l = 0; l < plan.num_layers; ++l) {
    plan.layers[l].k_clip_ratio = k_clip[l];
    plan.layers[l].v_clip_ratio = v_clip[l];
  }
  for (const TensorInfo& t : file.tensors()) {
    if (!expected.count(t.name)) return data_loss(what + ": unexpected tensor \"" + t.name + "\"");
  }
  // Before the value checks, so that a corrupted file is named as one.
  if (const auto stored = meta.find(kPlanChecksumKey); stored != meta.end()) {
    const std::string computed = detail::crc32_hex(detail::plan_content_crc32(meta, plan));
    if (stored->second != computed) {
      return data_loss(what + ": content checksum mismatch (" + kPlanChecksumKey + " " + stored->second +
                       ", computed " + computed + "): the file is corrupted");
    }
  }
  const Status valid = validate(plan);
  if (!valid.ok()) return Status(valid.code(), what + ": " + valid.message());
  return Result<Plan>(std::move(plan));
}

inline Result<Plan> parse_plan(std::span<const uint8_t> bytes, std::string what = "plan buffer") {
  auto file = SafetensorsFile::parse(bytes, std::move(what));
  if (!file.ok()) return file.status();
  return plan_from_safetensors(*file);
}

inline Result<Plan> load_plan(const std::string& path) {
  auto file = SafetensorsFile::open(path);
  if (!file.ok()) return file.status();
  return plan_from_safetensors(*file);
}

// Atomic: a crash leaves the previous file (or none), never half a plan.
inline Status save_plan(const Plan& plan, const std::string& path) {
  auto bytes = serialize_plan(plan);
  if (!bytes.ok()) return bytes.status();
  return write_file_atomic(path, *bytes);
}

// The plan fits the model the engine declares.
inline Status check_plan_matches(const Plan& plan, const host::CacheConfig& config) {
  auto mismatch = [](const char* key, int64_t in_plan, int64_t in_config) {
    return invalid_argument(std::string("plan was fitted for ") + key + " = " + std::to_string(in_plan) +
                            ", the model declares " + std::to_string(in_config));
  };
  if (plan.head_dim != config.head_dim) return mismatch("head_dim", plan.head_dim, config.head_dim);
  if (plan.num_layers != config.num_layers) return mismatch("num_layers", plan.num_layers, config.num_layers);
  if (plan.num_qo_heads != config.num_qo_heads) return mismatch("num_qo_heads", plan.num_qo_heads, config.num_qo_heads);
  if (plan.num_kv_heads != config.num_kv_heads) return mismatch("num_kv_heads", plan.num_kv_heads, config.num_kv_heads);
  const int32_t plan_group = plan.quant_group_size == 0 ? plan.head_dim : plan.quant_group_size;
  if (plan_group != config.effective_quant_group_size()) {
    return mismatch("quant_group_size", plan_group, config.effective_quant_group_size());
  }
  return Status::Ok();
}

// What PagedCache::create consumes.
inline std::vector<host::LayerQuantizer> to_layer_quantizers(const Plan& plan) {
  std::vector<host::LayerQuantizer> out;
  for (const PlanLayer& l : plan.layers) out.push_back({l.k_rotation, l.v_rotation, l.k_clip_ratio, l.v_clip_ratio});
  return out;
}

}  // namespace oscar::io
