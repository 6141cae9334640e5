// Caches whose storage format the library does not have, simulated ("fake-quantized"): rows
// are kept as floats and replaced by their reconstruction once they leave the BF16 sink and
// window, by the same segment rule as the paged cache (oscar::segment_counts). Attention is
// then plain softmax attention over the reconstructed rows. Two formats:
//   int4  per-token INT4 (16 levels, fp16 scale and offset per row, no rotation): the upper
//         reference. The library has no INT4 pages; the levels are computed here from the
//         library's group_range and fp16 rounding, the 2-bit quantizer's recipe with 15 steps.
//   kivi  KIVI-style INT2 (Liu et al. 2024): keys per channel over groups of kKiviTokenGroup
//         tokens (a group is quantized once all its tokens are in the INT2 region; until then
//         they stay BF16, KIVI's residual), values per token (the library's quantize_row /
//         dequantize_row, one group per row), no rotation, no clipping.
// Neither is a parallel implementation of the OSCAR format: INT2 rows go through the library's
// row functors, and only the layouts the library lacks (INT4 rows, per-channel key groups) are
// done here.
#pragma once

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "llama.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/quant/format.hpp"
#include "oscar/quant/quantize.hpp"
#include "oscar/quant/row.hpp"

namespace oscar::decode {

enum class SimulatedFormat { kInt4, kKivi };

inline constexpr int32_t kKiviTokenGroup = 32;  // KIVI's key group along tokens (their G = 32)
inline constexpr int kInt4MaxCode = 15;

// x <- its per-row INT4 reconstruction: asymmetric, 16 levels, fp16 metadata, codes computed
// against the rounded metadata (as the INT2 quantizer does).
inline void fake_quantize_int4(float* x, int n) {
  const GroupRange range = group_range(x, n);
  if (!range.finite) return;
  float scale = std::max((range.mx - range.mn) / static_cast<float>(kInt4MaxCode), kFp16MinSubnormal);
  scale = round_to_fp16(std::min(scale, kFp16Max));
  const float offset = round_to_fp16(std::clamp(range.mn, -kFp16Max, kFp16Max));
  for (int i = 0; i < n; ++i) {
    const float level = std::floor((x[i] - offset) / scale + 0.5f);
    x[i] = offset + std::clamp(level, 0.0f, static_cast<float>(kInt4MaxCode)) * scale;
  }
}

// x <- its INT2 reconstruction through the library's row quantizer (one group, no clipping).
inline void fake_quantize_int2_row(float* x, int n) {
  uint8_t packed[kMaxHeadDim / 4];
  QuantMeta meta[1];
  quantize_row(x, n, n, -1, packed, meta);
  dequantize_row(packed, meta, n, n, x);
}

// One channel of keys over a token group, strided: the same 2-bit recipe along tokens.
inline void fake_quantize_int2_column(float* x, int n, int64_t stride) {
  float column[kKiviTokenGroup];
  for (int i = 0; i < n; ++i) column[i] = x[i * stride];
  fake_quantize_int2_row(column, n);
  for (int i = 0; i < n; ++i) x[i * stride] = column[i];
}

class SimulatedKvCache final : public FloatRowsCache {
 public:
  SimulatedKvCache(const LlamaConfig& config, int64_t capacity, int32_t sink_tokens, int32_t recent_tokens,
                   int32_t page_size, SimulatedFormat format)
      : FloatRowsCache(config, capacity), sink_(sink_tokens), recent_(recent_tokens), page_size_(page_size),
        format_(format), k_done_(config.num_layers, 0), v_done_(config.num_layers, 0) {}
  Status write(int32_t layer, const float* k, const float* v) override {
    store_step(layer, k, v, [](float x) { return round_to_bf16(x); });
    // The rows that are now in the INT2 region (the paged cache's rule) get reconstructed.
    const SegmentCounts counts = segment_counts(length_, sink_, recent_, page_size_);
    const int64_t int2_end = counts.sink + counts.int2;
    for (int32_t h = 0; h < num_kv_heads_; ++h) {
      RowMatrix& kh = k_[layer][h];
      RowMatrix& vh = v_[layer][h];
      for (int64_t t = std::max<int64_t>(v_done_[layer], counts.sink); t < int2_end; ++t) {
        if (format_ == SimulatedFormat::kInt4) {
          fake_quantize_int4(kh.row(t).data(), head_dim_);
          fake_quantize_int4(vh.row(t).data(), head_dim_);
        } else {
          fake_quantize_int2_row(vh.row(t).data(), head_dim_);
        }
      }
      if (format_ == SimulatedFormat::kKivi) {
        for (int64_t g = std::max<int64_t>(k_done_[layer], counts.sink); g + kKiviTokenGroup <= int2_end;
             g += kKiviTokenGroup) {
          for (int32_t i = 0; i < head_dim_; ++i) fake_quantize_int2_column(&kh(g, i), kKiviTokenGroup, head_dim_);
        }
      }
    }
    v_done_[layer] = std::max<int64_t>(v_done_[layer], int2_end);
    if (format_ == SimulatedFormat::kInt4) {
      k_done_[layer] = v_done_[layer];
    } else {
      const int64_t start = std::max<int64_t>(k_done_[layer], counts.sink);
      if (int2_end > start) k_done_[layer] = start + (int2_end - start) / kKiviTokenGroup * kKiviTokenGroup;
    }
    return Status::Ok();
  }
  Status attend(int32_t layer, const float* q, float* out) override {
    attend_each_query(layer, q, out);
    return Status::Ok();
  }
  double bytes_per_token() const override {
    if (length_ == 0) return 0;
    const SegmentCounts counts = segment_counts(length_, sink_, recent_, page_size_);
    const double d = head_dim_;
    const double bf16_row = 2.0 * d;
    double quantized_rows = 0;  // bytes of K and V of one head over the INT2 region
    if (format_ == SimulatedFormat::kInt4) {
      quantized_rows = static_cast<double>(counts.int2) * 2.0 * (d / 2.0 + 4.0);
    } else {
      const int64_t key_groups = counts.int2 / kKiviTokenGroup;
      const double key_bytes = static_cast<double>(key_groups) * (kKiviTokenGroup * d / 4.0 + 4.0 * d) +
                               static_cast<double>(counts.int2 - key_groups * kKiviTokenGroup) * bf16_row;
      quantized_rows = key_bytes + static_cast<double>(counts.int2) * (d / 4.0 + 4.0);
    }
    const double bytes = quantized_rows + 2.0 * static_cast<double>(counts.sink + counts.recent) * bf16_row;
    return bytes / static_cast<double>(length_) * num_kv_heads_ * num_layers_;
  }

 private:
  int32_t sink_, recent_, page_size_;
  SimulatedFormat format_;
  std::vector<int64_t> k_done_, v_done_;       // per layer: rows before this are reconstructed
};

}  // namespace oscar::decode
