// Calibration accumulators on disk, so an engine can save what it gathered during calibration
// prefill (per process or GPU) and oscar-fit can fit from it without activations. safetensors,
// float64, per layer l:
//   layers.{l}.qtq   F64 [num_kv_heads, d, d]  Σ q_jᵀq_j over tokens and the group's query heads
//   layers.{l}.ktk   F64 [d, d]                Σ kᵀk over tokens and KV heads
//   layers.{l}.vtv   F64 [d, d]
//   layers.{l}.wvtv  F64 [num_kv_heads, d, d]  Σ w_t vᵀv (value pass)
//   layers.{l}.wsum  F64 [num_kv_heads]        Σ w_t
// then tokens / value_tokens F64 [num_layers] (exact below 2^53), then, for each layer whose
// proxy value pass has started (format_version 2), in layer order:
//   layers.{l}.frozen_a F64 [num_kv_heads, d, d]  the A_h that pass weights with
// so that a loaded pass-2 accumulator refuses pass-1 chunks and merges only with sums made
// under the same A_h, as the live one does. Metadata: format ("oscar-accumulators"),
// format_version (2; files of version 1, written before the value-pass state was saved, load
// without it), num_layers, num_qo_heads, num_kv_heads, head_dim, value_weighting (none, proxy,
// attention_mass), content_crc32. Sums, not means: files merge by addition.
//
// content_crc32 is the CRC-32 (zlib's) of "key=value\n" for each of kAccumulatorChecksummedKeys,
// then of every tensor's little-endian F64 bytes in the order above (layers.0.qtq, .ktk, .vtv,
// .wvtv, .wsum, layers.1.qtq, ..., tokens, value_tokens, the frozen A_h): a flipped bit in a
// covariance entry, which every other check accepts, would otherwise bend the fitted rotations
// without a word. The loader checks it after the structure and before the values, so a
// corrupted file is named as one; files written before it (2026-12-07) load unchecked.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
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

inline constexpr int32_t kAccumulatorFormatVersion = 2;  // written; 1 and 2 are read
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

// A layer's tensors, in the order the file holds them and the checksum covers them. The
// writer and the loader both walk this table, so the order is spelled once.
enum class AccumulatorPart { kQtq, kKtk, kVtv, kWvtv, kWsum };
inline constexpr AccumulatorPart kAccumulatorLayerParts[] = {AccumulatorPart::kQtq, AccumulatorPart::kKtk,
                                                            AccumulatorPart::kVtv, AccumulatorPart::kWvtv,
                                                            AccumulatorPart::kWsum};

inline const char* part_name(AccumulatorPart part) {
  switch (part) {
    case AccumulatorPart::kQtq: return "qtq";
    case AccumulatorPart::kKtk: return "ktk";
    case AccumulatorPart::kVtv: return "vtv";
    case AccumulatorPart::kWvtv: return "wvtv";
    case AccumulatorPart::kWsum: return "wsum";
  }
  return "";
}

// One tensor of the file: its name and shape. The per-layer counts (tokens, value_tokens)
// come after every layer's parts.
struct AccumulatorTensor {
  std::string name;
  std::vector<int64_t> shape;
};

inline std::vector<int64_t> part_shape(AccumulatorPart part, int64_t kv_heads, int64_t head_dim) {
  switch (part) {
    case AccumulatorPart::kKtk:
    case AccumulatorPart::kVtv: return {head_dim, head_dim};
    case AccumulatorPart::kWsum: return {kv_heads};
    default: return {kv_heads, head_dim, head_dim};
  }
}

// The file's tensors in order; frozen_layers: the layers whose frozen A_h it holds.
inline std::vector<AccumulatorTensor> accumulator_tensors(const fit::ModelShape& s,
                                                          const std::vector<int32_t>& frozen_layers) {
  std::vector<AccumulatorTensor> tensors;
  for (int32_t l = 0; l < s.num_layers; ++l) {
    for (AccumulatorPart part : kAccumulatorLayerParts) {
      tensors.push_back({layer_tensor_name(l, part_name(part)), part_shape(part, s.num_kv_heads, s.head_dim)});
    }
  }
  tensors.push_back({"tokens", {s.num_layers}});
  tensors.push_back({"value_tokens", {s.num_layers}});
  for (const int32_t l : frozen_layers) {
    tensors.push_back({layer_tensor_name(l, "frozen_a"), {s.num_kv_heads, s.head_dim, s.head_dim}});
  }
  return tensors;
}

// Matrices as the file's row-major values, one after another, and matrix `index` of such values.
using RowMajorMatrixXd = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
inline std::vector<double> matrices_values(const std::vector<Eigen::MatrixXd>& matrices) {
  std::vector<double> out;
  for (const Eigen::MatrixXd& m : matrices) {
    const size_t at = out.size();
    out.resize(at + size_t(m.size()));
    Eigen::Map<RowMajorMatrixXd>(out.data() + at, m.rows(), m.cols()) = m;
  }
  return out;
}
inline Eigen::MatrixXd matrix_of(const std::vector<double>& values, int64_t index, int64_t d) {
  return Eigen::Map<const RowMajorMatrixXd>(values.data() + index * d * d, d, d);
}

// A part of one layer's sums as the file's row-major values (symmetric matrices stored whole).
inline std::vector<double> part_values(const fit::LayerSums& sums, AccumulatorPart part) {
  const auto full = [](const std::vector<Eigen::MatrixXd>& lower) {
    std::vector<Eigen::MatrixXd> out;
    for (const Eigen::MatrixXd& m : lower) out.push_back(fit::detail::symmetrized(m));
    return matrices_values(out);
  };
  switch (part) {
    case AccumulatorPart::kQtq: return full(sums.qtq);
    case AccumulatorPart::kKtk: return full({sums.ktk});
    case AccumulatorPart::kVtv: return full({sums.vtv});
    case AccumulatorPart::kWvtv: return full(sums.wvtv);
    case AccumulatorPart::kWsum: return std::vector<double>(sums.wsum.data(), sums.wsum.data() + sums.wsum.size());
  }
  return {};
}

// The inverse of part_values, into sums shaped by CalibrationAccumulator::create.
inline void set_part(fit::LayerSums& sums, AccumulatorPart part, const std::vector<double>& values, int64_t d) {
  const auto matrix = [&](int64_t index) { return matrix_of(values, index, d); };
  switch (part) {
    case AccumulatorPart::kQtq:
      for (size_t h = 0; h < sums.qtq.size(); ++h) sums.qtq[h] = matrix(int64_t(h));
      break;
    case AccumulatorPart::kKtk: sums.ktk = matrix(0); break;
    case AccumulatorPart::kVtv: sums.vtv = matrix(0); break;
    case AccumulatorPart::kWvtv:
      for (size_t h = 0; h < sums.wvtv.size(); ++h) sums.wvtv[h] = matrix(int64_t(h));
      break;
    case AccumulatorPart::kWsum:
      for (int64_t h = 0; h < sums.wsum.size(); ++h) sums.wsum[h] = values[size_t(h)];
      break;
  }
}

// F64 little-endian bytes as doubles (the file's bytes, the host's order as read_as assumes).
inline std::vector<double> doubles_of(const std::vector<uint8_t>& bytes) {
  std::vector<double> out(bytes.size() / 8);
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * 8);
  return out;
}
}  // namespace detail

inline Result<std::vector<uint8_t>> serialize_accumulators(const fit::CalibrationAccumulator& acc) {
  const fit::ModelShape& s = acc.shape();
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
  std::vector<double> tokens, value_tokens;
  for (int32_t l = 0; l < s.num_layers; ++l) {
    tokens.push_back(static_cast<double>(acc.sums(l).tokens));
    value_tokens.push_back(static_cast<double>(acc.sums(l).value_tokens));
  }
  std::vector<int32_t> frozen_layers;
  for (int32_t l = 0; l < s.num_layers; ++l) {
    if (acc.value_pass_started(l)) frozen_layers.push_back(l);
  }
  const std::vector<detail::AccumulatorTensor> tensors = detail::accumulator_tensors(s, frozen_layers);
  constexpr size_t kParts = std::size(detail::kAccumulatorLayerParts);
  const size_t layer_tensors = size_t(s.num_layers) * kParts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::vector<double> values =
        i < layer_tensors       ? detail::part_values(acc.sums(int32_t(i / kParts)), detail::kAccumulatorLayerParts[i % kParts])
        : i == layer_tensors     ? tokens
        : i == layer_tensors + 1 ? value_tokens
                                 : detail::matrices_values(acc.frozen_a(frozen_layers[i - layer_tensors - 2]));
    // Into the file and the checksum in the same order, its bytes encoded once.
    std::vector<uint8_t> bytes = f64_le_bytes(values);
    crc = crc32(bytes, crc);
    OSCAR_RETURN_IF_ERROR(w.add(tensors[i].name, DType::kF64, tensors[i].shape, std::move(bytes)));
  }
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
  if (version != 1 && version != kAccumulatorFormatVersion) {
    return unsupported(what + ": accumulator format_version " + std::to_string(version) + " (this oscar reads 1 and " +
                       std::to_string(kAccumulatorFormatVersion) + ")");
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
  // The checksum runs over the bytes as read, in the table's order.
  std::vector<int32_t> frozen_layers;  // version 2: where the file holds the value pass's A_h
  if (version >= 2) {
    for (int32_t l = 0; l < shape.num_layers; ++l) {
      if (file.find(layer_tensor_name(l, "frozen_a"))) frozen_layers.push_back(l);
    }
  }
  const std::vector<detail::AccumulatorTensor> tensors = detail::accumulator_tensors(shape, frozen_layers);
  std::vector<std::vector<double>> stored;  // tensors[i]'s values
  uint32_t crc = detail::accumulator_metadata_crc32(meta);
  for (const detail::AccumulatorTensor& t : tensors) {
    const TensorInfo* info = file.find(t.name);
    if (!info) return data_loss(what + ": tensor \"" + t.name + "\" is missing");
    if (info->dtype != DType::kF64) return data_loss(what + ": tensor \"" + t.name + "\" is not F64");
    if (info->shape != t.shape) return data_loss(what + ": tensor \"" + t.name + "\" has shape " + info->shape_string());
    auto bytes = file.read_bytes(*info);
    if (!bytes.ok()) return bytes.status();
    crc = crc32(*bytes, crc);
    stored.push_back(detail::doubles_of(*bytes));
  }
  // Tensors the format does not have (the checksum would not cover them).
  if (file.tensors().size() != tensors.size()) {
    for (const TensorInfo& info : file.tensors()) {
      if (std::none_of(tensors.begin(), tensors.end(),
                       [&](const detail::AccumulatorTensor& t) { return t.name == info.name; })) {
        return data_loss(what + ": unexpected tensor \"" + info.name + "\"");
      }
    }
  }
  // Then the checksum, before any value check, so that a corrupted file is named as one.
  if (const auto crc_it = meta.find(kAccumulatorChecksumKey); crc_it != meta.end()) {
    const std::string computed = detail::crc32_hex(crc);
    if (crc_it->second != computed) {
      return data_loss(what + ": content checksum mismatch (" + kAccumulatorChecksumKey + " " + crc_it->second +
                       ", computed " + computed + "): the file is corrupted");
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (double x : stored[i]) {
      if (!std::isfinite(x)) return data_loss(what + ": tensor \"" + tensors[i].name + "\" has a non-finite entry");
    }
  }
  auto created = fit::CalibrationAccumulator::create(shape);
  if (!created.ok()) return Status(StatusCode::kDataLoss, what + ": " + created.status().message());
  fit::CalibrationAccumulator acc = std::move(*created);
  acc.set_value_weighting(value_weighting);
  constexpr size_t kParts = std::size(detail::kAccumulatorLayerParts);
  const size_t layer_tensors = size_t(shape.num_layers) * kParts;  // then tokens, value_tokens, the A_h
  const std::vector<double>& tokens = stored[layer_tensors];
  const std::vector<double>& value_tokens = stored[layer_tensors + 1];
  for (int32_t l = 0; l < shape.num_layers; ++l) {
    fit::LayerSums& s = acc.mutable_sums(l);
    for (size_t p = 0; p < kParts; ++p) detail::set_part(s, detail::kAccumulatorLayerParts[p], stored[l * kParts + p], d);
    const double t = tokens[l], vt = value_tokens[l];
    if (!(t >= 0 && vt >= 0 && t == std::floor(t) && vt == std::floor(vt) && t < 9.0e15 && vt < 9.0e15)) {
      return data_loss(what + ": tokens/value_tokens of layer " + std::to_string(l) + " are not counts");
    }
    s.tokens = static_cast<int64_t>(t);
    s.value_tokens = static_cast<int64_t>(vt);
  }
  for (size_t i = 0; i < frozen_layers.size(); ++i) {
    const std::vector<double>& values = stored[layer_tensors + 2 + i];
    std::vector<Eigen::MatrixXd> a;
    for (int64_t h = 0; h < kv; ++h) a.push_back(detail::matrix_of(values, h, d));
    OSCAR_RETURN_IF_ERROR(acc.restore_frozen_a(frozen_layers[i], std::move(a)));
  }
  return Result<fit::CalibrationAccumulator>(std::move(acc));
}

inline Result<fit::CalibrationAccumulator> load_accumulators(const std::string& path) {
  auto file = SafetensorsFile::open(path);
  if (!file.ok()) return file.status();
  return accumulators_from_safetensors(*file);
}

}  // namespace oscar::io
