// Calibration accumulators on disk, so an engine can save what it gathered during calibration
// prefill (per process or GPU) and oscar-fit can fit from it without activations. safetensors,
// float64, per layer l:
//   layers.{l}.qtq   F64 [num_kv_heads, d, d]  Σ q_jᵀq_j over tokens and the group's query heads
//   layers.{l}.ktk   F64 [d, d]                Σ kᵀk over tokens and KV heads
//   layers.{l}.vtv   F64 [d, d]
//   layers.{l}.wvtv  F64 [num_kv_heads, d, d]  Σ w_t vᵀv (value pass)
//   layers.{l}.wsum  F64 [num_kv_heads]        Σ w_t
// and tokens / value_tokens F64 [num_layers] (exact below 2^53). Metadata: format
// ("oscar-accumulators"), format_version, num_layers, num_qo_heads, num_kv_heads, head_dim,
// value_weighting (none, proxy, attention_mass), content_crc32. Sums, not means: files merge
// by addition.
//
// content_crc32 is the CRC-32 (zlib's) of "key=value\n" for each of kAccumulatorChecksummedKeys,
// then of every tensor's little-endian F64 bytes in the order the writer adds them
// (layers.0.qtq, .ktk, .vtv, .wvtv, .wsum, layers.1.qtq, ..., tokens, value_tokens): a flipped
// bit in a covariance entry, which every other check accepts, would otherwise bend the fitted
// rotations without a word. The loader checks it after the structure and before the values,
// so a corrupted file is named as one; files written before it (2026-12-07) load unchecked.
#pragma once

#include <algorithm>
#include <cmath>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "oscar/core/status.hpp"
#include "oscar/fit/accumulators.hpp"
#include "oscar/io/plan_file.hpp"
#include "oscar/io/safetensors.hpp"

namespace oscar::io {

inline constexpr int32_t kAccumulatorFormatVersion = 1;
inline constexpr const char* kAccumulatorFormatTag = "oscar-accumulators";
inline constexpr const char* kAccumulatorChecksumKey = "content_crc32";

namespace detail {
// The metadata keys content_crc32 covers, in this order (all of them but the checksum).
inline constexpr const char* kAccumulatorChecksummedKeys[] = {"format",       "format_version", "num_layers",
                                                              "num_qo_heads", "num_kv_heads",   "head_dim",
                                                              "value_weighting"};

inline uint32_t accumulator_metadata_crc32(const std::map<std::string, std::string>& meta) {
  uint32_t crc = 0;
  for (const char* key : kAccumulatorChecksummedKeys) {
    const auto it = meta.find(key);
    crc = crc32(std::string(key) + "=" + (it == meta.end() ? std::string() : it->second) + "\n", crc);
  }
  return crc;
}
inline uint32_t crc32_of_doubles(std::span<const double> values, uint32_t crc) {
  return crc32(f64_le_bytes(values), crc);  // the bytes the file stores
}
}  // namespace detail

inline Result<std::vector<uint8_t>> serialize_accumulators(const fit::CalibrationAccumulator& acc) {
  const fit::ModelShape& s = acc.shape();
  const int64_t d = s.head_dim, h = s.num_kv_heads;
  const std::map<std::string, std::string> meta = {
      {"format", kAccumulatorFormatTag},
      {"format_version", std::to_string(kAccumulatorFormatVersion)},
      {"num_layers", std::to_string(s.num_layers)},
      {"num_qo_heads", std::to_string(s.num_qo_heads)},
      {"num_kv_heads", std::to_string(s.num_kv_heads)},
      {"head_dim", std::to_string(s.head_dim)},
      {"value_weighting", fit::to_string(acc.value_weighting())}};
  uint32_t crc = detail::accumulator_metadata_crc32(meta);
  SafetensorsWriter w;
  // Every tensor goes into the file and the checksum in the same order, its bytes encoded once.
  const auto add = [&](const std::string& name, std::vector<int64_t> shape, const std::vector<double>& values) {
    std::vector<uint8_t> bytes = f64_le_bytes(values);
    crc = crc32(bytes, crc);
    return w.add(name, DType::kF64, std::move(shape), std::move(bytes));
  };
  std::vector<double> tokens, value_tokens;
  auto stack = [&](const std::vector<Eigen::MatrixXd>& ms) {
    std::vector<double> out;
    for (const Eigen::MatrixXd& m : ms) {
      const Eigen::MatrixXd full = fit::detail::symmetrized(m);
      for (int64_t i = 0; i < d; ++i) {
        for (int64_t j = 0; j < d; ++j) out.push_back(full(i, j));
      }
    }
    return out;
  };
  for (int32_t l = 0; l < s.num_layers; ++l) {
    const fit::LayerSums& sums = acc.sums(l);
    OSCAR_RETURN_IF_ERROR(add(layer_tensor_name(l, "qtq"), {h, d, d}, stack(sums.qtq)));
    OSCAR_RETURN_IF_ERROR(add(layer_tensor_name(l, "ktk"), {d, d}, stack({sums.ktk})));
    OSCAR_RETURN_IF_ERROR(add(layer_tensor_name(l, "vtv"), {d, d}, stack({sums.vtv})));
    OSCAR_RETURN_IF_ERROR(add(layer_tensor_name(l, "wvtv"), {h, d, d}, stack(sums.wvtv)));
    OSCAR_RETURN_IF_ERROR(add(layer_tensor_name(l, "wsum"), {h}, std::vector<double>(sums.wsum.data(), sums.wsum.data() + h)));
    tokens.push_back(static_cast<double>(sums.tokens));
    value_tokens.push_back(static_cast<double>(sums.value_tokens));
  }
  OSCAR_RETURN_IF_ERROR(add("tokens", {s.num_layers}, tokens));
  OSCAR_RETURN_IF_ERROR(add("value_tokens", {s.num_layers}, value_tokens));
  for (const auto& [key, value] : meta) w.set_metadata(key, value);
  w.set_metadata(kAccumulatorChecksumKey, detail::crc32_hex(crc));
  return w.serialize();
}

inline Status save_accumulators(const fit::CalibrationAccumulator& acc, const std::string& path) {
  auto bytes = serialize_accumulators(acc);
  if (!bytes.ok()) return bytes.status();
  return write_file_atomic(path, *bytes);
}

inline Result<fit::CalibrationAccumulator> accumulators_from_safetensors(const SafetensorsFile& file) {
  const std::string& what = file.source();
  const auto& meta = file.metadata();
  const auto format = meta.find("format");
  if (format == meta.end()) return data_loss(what + ": not oscar accumulators (no \"format\" metadata)");
  const std::string& tag = format->second;
  if (tag != kAccumulatorFormatTag) {
    return data_loss(what + ": metadata \"format\" is \"" + tag + "\", not oscar accumulators");
  }
  int64_t version = 0, layers = 0, qo = 0, kv = 0, d = 0;
  OSCAR_RETURN_IF_ERROR(detail::parse_int(meta, what, "format_version", 0, INT32_MAX, &version));
  if (version != kAccumulatorFormatVersion) {
    return unsupported(what + ": accumulator format_version " + std::to_string(version));
  }
  OSCAR_RETURN_IF_ERROR(detail::parse_int(meta, what, "num_layers", 1, 4096, &layers));
  OSCAR_RETURN_IF_ERROR(detail::parse_int(meta, what, "num_qo_heads", 1, 4096, &qo));
  OSCAR_RETURN_IF_ERROR(detail::parse_int(meta, what, "num_kv_heads", 1, 4096, &kv));
  OSCAR_RETURN_IF_ERROR(detail::parse_int(meta, what, "head_dim", 1, 1024, &d));
  std::string weighting;
  OSCAR_RETURN_IF_ERROR(detail::parse_string(meta, what, "value_weighting", &weighting));
  const fit::ModelShape shape{static_cast<int32_t>(layers), static_cast<int32_t>(qo), static_cast<int32_t>(kv),
                              static_cast<int32_t>(d)};
  if (const Status valid = fit::validate(shape); !valid.ok()) {
    return Status(StatusCode::kDataLoss, what + ": " + valid.message());
  }
  bool known = false;
  fit::ValueWeighting value_weighting = fit::ValueWeighting::kNone;
  for (fit::ValueWeighting w :
       {fit::ValueWeighting::kNone, fit::ValueWeighting::kProxy, fit::ValueWeighting::kAttentionMass}) {
    if (weighting == fit::to_string(w)) {
      value_weighting = w;
      known = true;
    }
  }
  if (!known) return data_loss(what + ": unknown value_weighting \"" + weighting + "\"");

  // Every tensor's structure (present, F64, its shape) first, all of them read: nothing is
  // allocated for the metadata's sizes before the file's own tensors have shown them (a
  // corrupted num_layers or head_dim in a small file would otherwise ask for gigabytes).
  auto read = [&](const std::string& name, std::vector<int64_t> shape_expected) -> Result<std::vector<double>> {
    const TensorInfo* info = file.find(name);
    if (!info) return data_loss(what + ": tensor \"" + name + "\" is missing");
    if (info->dtype != DType::kF64) return data_loss(what + ": tensor \"" + name + "\" is not F64");
    if (info->shape != shape_expected) {
      return data_loss(what + ": tensor \"" + name + "\" has shape " + info->shape_string());
    }
    return file.read_as<double>(*info);
  };
  struct Stored {
    std::string name;
    std::vector<double> values;
  };
  std::vector<Stored> stored;  // in the writer's order: the checksum's
  for (int32_t l = 0; l < shape.num_layers; ++l) {
    for (const auto& [part, dims] : std::vector<std::pair<const char*, std::vector<int64_t>>>{
             {"qtq", {kv, d, d}}, {"ktk", {d, d}}, {"vtv", {d, d}}, {"wvtv", {kv, d, d}}, {"wsum", {kv}}}) {
      const std::string name = layer_tensor_name(l, part);
      auto values = read(name, dims);
      if (!values.ok()) return values.status();
      stored.push_back({name, std::move(*values)});
    }
  }
  for (const char* name : {"tokens", "value_tokens"}) {
    auto values = read(name, {layers});
    if (!values.ok()) return values.status();
    stored.push_back({name, std::move(*values)});
  }
  // Tensors the format does not have (the checksum would not cover them).
  if (file.tensors().size() != stored.size()) {
    for (const TensorInfo& t : file.tensors()) {
      if (std::none_of(stored.begin(), stored.end(), [&](const Stored& s) { return s.name == t.name; })) {
        return data_loss(what + ": unexpected tensor \"" + t.name + "\"");
      }
    }
  }
  // Then the checksum, before any value check, so that a corrupted file is named as one.
  if (const auto crc_it = meta.find(kAccumulatorChecksumKey); crc_it != meta.end()) {
    uint32_t crc = detail::accumulator_metadata_crc32(meta);
    for (const Stored& t : stored) crc = detail::crc32_of_doubles(t.values, crc);
    const std::string computed = detail::crc32_hex(crc);
    if (crc_it->second != computed) {
      return data_loss(what + ": content checksum mismatch (" + kAccumulatorChecksumKey + " " + crc_it->second +
                       ", computed " + computed + "): the file is corrupted");
    }
  }
  for (const Stored& t : stored) {
    for (double x : t.values) {
      if (!std::isfinite(x)) return data_loss(what + ": tensor \"" + t.name + "\" has a non-finite entry");
    }
  }
  auto created = fit::CalibrationAccumulator::create(shape);
  if (!created.ok()) return Status(StatusCode::kDataLoss, what + ": " + created.status().message());
  fit::CalibrationAccumulator acc = std::move(*created);
  acc.set_value_weighting(value_weighting);
  auto unstack = [&](const std::vector<double>& v, int64_t index) {
    Eigen::MatrixXd m(d, d);
    for (int64_t i = 0; i < d; ++i) {
      for (int64_t j = 0; j < d; ++j) m(i, j) = v[(index * d + i) * d + j];
    }
    return m;
  };
  const std::vector<double>& tokens = stored[stored.size() - 2].values;
  const std::vector<double>& value_tokens = stored.back().values;
  for (int32_t l = 0; l < shape.num_layers; ++l) {
    fit::LayerSums& s = acc.mutable_sums(l);
    const std::vector<double>& qtq = stored[5 * l].values;
    const std::vector<double>& ktk = stored[5 * l + 1].values;
    const std::vector<double>& vtv = stored[5 * l + 2].values;
    const std::vector<double>& wvtv = stored[5 * l + 3].values;
    const std::vector<double>& wsum = stored[5 * l + 4].values;
    for (int64_t h = 0; h < kv; ++h) {
      s.qtq[h] = unstack(qtq, h);
      s.wvtv[h] = unstack(wvtv, h);
      s.wsum[h] = wsum[h];
    }
    s.ktk = unstack(ktk, 0);
    s.vtv = unstack(vtv, 0);
    const double t = tokens[l], vt = value_tokens[l];
    if (!(t >= 0 && vt >= 0 && t == std::floor(t) && vt == std::floor(vt) && t < 9.0e15 && vt < 9.0e15)) {
      return data_loss(what + ": tokens/value_tokens of layer " + std::to_string(l) + " are not counts");
    }
    s.tokens = static_cast<int64_t>(t);
    s.value_tokens = static_cast<int64_t>(vt);
  }
  return Result<fit::CalibrationAccumulator>(std::move(acc));
}

inline Result<fit::CalibrationAccumulator> load_accumulators(const std::string& path) {
  auto file = SafetensorsFile::open(path);
  if (!file.ok()) return file.status();
  return accumulators_from_safetensors(*file);
}

}  // namespace oscar::io
