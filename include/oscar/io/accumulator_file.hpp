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
// value_weighting (none, proxy, attention_mass). Sums, not means: files merge by addition.
#pragma once

#include <cmath>
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

inline Result<std::vector<uint8_t>> serialize_accumulators(const fit::CalibrationAccumulator& acc) {
  const fit::ModelShape& s = acc.shape();
  const int64_t d = s.head_dim, h = s.num_kv_heads;
  SafetensorsWriter w;
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
    OSCAR_RETURN_IF_ERROR(w.add_f64(layer_tensor_name(l, "qtq"), {h, d, d}, stack(sums.qtq)));
    OSCAR_RETURN_IF_ERROR(w.add_f64(layer_tensor_name(l, "ktk"), {d, d}, stack({sums.ktk})));
    OSCAR_RETURN_IF_ERROR(w.add_f64(layer_tensor_name(l, "vtv"), {d, d}, stack({sums.vtv})));
    OSCAR_RETURN_IF_ERROR(w.add_f64(layer_tensor_name(l, "wvtv"), {h, d, d}, stack(sums.wvtv)));
    const std::vector<double> wsum(sums.wsum.data(), sums.wsum.data() + h);
    OSCAR_RETURN_IF_ERROR(w.add_f64(layer_tensor_name(l, "wsum"), {h}, wsum));
    tokens.push_back(static_cast<double>(sums.tokens));
    value_tokens.push_back(static_cast<double>(sums.value_tokens));
  }
  OSCAR_RETURN_IF_ERROR(w.add_f64("tokens", {s.num_layers}, tokens));
  OSCAR_RETURN_IF_ERROR(w.add_f64("value_tokens", {s.num_layers}, value_tokens));
  w.set_metadata("format", kAccumulatorFormatTag);
  w.set_metadata("format_version", std::to_string(kAccumulatorFormatVersion));
  w.set_metadata("num_layers", std::to_string(s.num_layers));
  w.set_metadata("num_qo_heads", std::to_string(s.num_qo_heads));
  w.set_metadata("num_kv_heads", std::to_string(s.num_kv_heads));
  w.set_metadata("head_dim", std::to_string(s.head_dim));
  w.set_metadata("value_weighting", fit::to_string(acc.value_weighting()));
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
  auto created = fit::CalibrationAccumulator::create(shape);
  if (!created.ok()) return Status(StatusCode::kDataLoss, what + ": " + created.status().message());
  fit::CalibrationAccumulator acc = std::move(*created);
  bool known = false;
  for (fit::ValueWeighting w :
       {fit::ValueWeighting::kNone, fit::ValueWeighting::kProxy, fit::ValueWeighting::kAttentionMass}) {
    if (weighting == fit::to_string(w)) {
      acc.set_value_weighting(w);
      known = true;
    }
  }
  if (!known) return data_loss(what + ": unknown value_weighting \"" + weighting + "\"");

  auto read = [&](const std::string& name, std::vector<int64_t> shape_expected) -> Result<std::vector<double>> {
    const TensorInfo* info = file.find(name);
    if (!info) return data_loss(what + ": tensor \"" + name + "\" is missing");
    if (info->dtype != DType::kF64) return data_loss(what + ": tensor \"" + name + "\" is not F64");
    if (info->shape != shape_expected) {
      return data_loss(what + ": tensor \"" + name + "\" has shape " + info->shape_string());
    }
    auto v = file.read_as<double>(*info);
    if (!v.ok()) return v.status();
    for (double x : *v) {
      if (!std::isfinite(x)) return data_loss(what + ": tensor \"" + name + "\" has a non-finite entry");
    }
    return v;
  };
  auto tokens = read("tokens", {layers});
  if (!tokens.ok()) return tokens.status();
  auto value_tokens = read("value_tokens", {layers});
  if (!value_tokens.ok()) return value_tokens.status();
  auto unstack = [&](const std::vector<double>& v, int64_t index) {
    Eigen::MatrixXd m(d, d);
    for (int64_t i = 0; i < d; ++i) {
      for (int64_t j = 0; j < d; ++j) m(i, j) = v[(index * d + i) * d + j];
    }
    return m;
  };
  for (int32_t l = 0; l < shape.num_layers; ++l) {
    fit::LayerSums& s = acc.mutable_sums(l);
    auto qtq = read(layer_tensor_name(l, "qtq"), {kv, d, d});
    if (!qtq.ok()) return qtq.status();
    auto ktk = read(layer_tensor_name(l, "ktk"), {d, d});
    if (!ktk.ok()) return ktk.status();
    auto vtv = read(layer_tensor_name(l, "vtv"), {d, d});
    if (!vtv.ok()) return vtv.status();
    auto wvtv = read(layer_tensor_name(l, "wvtv"), {kv, d, d});
    if (!wvtv.ok()) return wvtv.status();
    auto wsum = read(layer_tensor_name(l, "wsum"), {kv});
    if (!wsum.ok()) return wsum.status();
    for (int64_t h = 0; h < kv; ++h) {
      s.qtq[h] = unstack(*qtq, h);
      s.wvtv[h] = unstack(*wvtv, h);
      s.wsum[h] = (*wsum)[h];
    }
    s.ktk = unstack(*ktk, 0);
    s.vtv = unstack(*vtv, 0);
    const double t = (*tokens)[l], vt = (*value_tokens)[l];
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
