// Rows that hit the row quantizers' edges (shared by the CPU and GPU tests of
// quantize_row_bf16x2): outlier channels, ties of magnitude at and around every clip rank,
// signed zeros, bf16 subnormals, scales from subnormal fp16 metadata to beyond the fp16 range,
// constant groups, a symmetric row (the middle level's threshold at zero), a huge outlier,
// and NaN / +Inf / -Inf rows. Every value is a bf16 value.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/random.hpp"
#include "oscar/core/numeric.hpp"

namespace oscar::testing {

// A row as quantize_row_bf16x2 takes it: element 2i in the low half of word i.
inline std::vector<uint32_t> as_bf16_pairs(const std::vector<float>& row) {
  std::vector<uint32_t> pairs(row.size() / 2);
  for (size_t i = 0; i < pairs.size(); ++i) {
    pairs[i] = uint32_t{float_to_bf16(row[2 * i]).bits} | uint32_t{float_to_bf16(row[2 * i + 1]).bits} << 16;
  }
  return pairs;
}

// The bf16 value `steps` bf16 values above v (a bf16 value), in value order (-0 and +0 apart).
// Written out here rather than through bf16x2::ordered_key / key_bits, which are under test.
inline float bf16_keys_above(float v, int steps) {
  const uint32_t bits = float_to_bf16(v).bits;
  const uint32_t key = (bits & 0x8000u ? ~bits & 0xffffu : bits | 0x8000u) + uint32_t(steps);
  return bf16_to_float(bf16_t{uint16_t(key & 0x8000u ? key & 0x7fffu : ~key & 0xffffu)});
}

inline std::vector<std::vector<float>> quantizer_edge_rows(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> rows;
  oscar::testing::RowGenerator gen(seed, d);
  for (int i = 0; i < 24; ++i) rows.push_back(gen.row());  // outlier channels
  for (float scale : {1e-3f, 1e-30f, 3e-38f, 1e4f, 2e5f, 1e30f}) {  // subnormal fp16 metadata .. beyond fp16
    std::vector<float> r(d);
    for (float& v : r) v = round_to_bf16(normal(rng) * scale);
    rows.push_back(r);
  }
  {  // bf16 subnormals mixed with normals
    std::vector<float> r(d);
    for (int i = 0; i < d; ++i) r[i] = bf16_to_float(bf16_t{uint16_t((i % 3 ? 0x0001 + i : 0x3f80 + i) | (i % 2 ? 0x8000 : 0))});
    rows.push_back(r);
  }
  rows.push_back(std::vector<float>(d, 0.0f));
  rows.push_back(std::vector<float>(d, -0.0f));
  rows.push_back(std::vector<float>(d, 1.5f));
  rows.push_back(std::vector<float>(d, -7.0f));
  {  // signed zeros and a few values: thresholds around zero
    std::vector<float> r(d, 0.0f);
    for (int i = 0; i < d; i += 2) r[i] = -0.0f;
    r[3] = 1.0f;
    r[5] = -1.0f;
    rows.push_back(r);
  }
  for (int copies : {2, 5, 9, 17, 40}) {  // ties of magnitude at and around every clip rank
    std::vector<float> r(d);
    for (int i = 0; i < d; ++i) r[i] = round_to_bf16(normal(rng));
    for (int i = 0; i < copies; ++i) r[(i * 7) % d] = (i % 2 ? -3.0f : 3.0f);
    rows.push_back(r);
  }
  {  // symmetric: the middle level's threshold sits at zero
    std::vector<float> r(d);
    for (int i = 0; i < d / 2; ++i) {
      r[i] = round_to_bf16(std::abs(normal(rng)) + 0.01f);
      r[d / 2 + i] = -r[i];
    }
    rows.push_back(r);
  }
  {  // one huge outlier
    std::vector<float> r(d);
    for (float& v : r) v = round_to_bf16(normal(rng));
    r[d / 3] = round_to_bf16(6e4f);  // rows hold bf16 values
    rows.push_back(r);
  }
  const float specials[] = {NAN, INFINITY, -INFINITY};
  for (float s : specials) {  // non-finite rows: NaN metadata and zero codes
    std::vector<float> r(d);
    for (float& v : r) v = round_to_bf16(normal(rng));
    r[(d * 5) / 7] = s;
    rows.push_back(r);
  }
  return rows;
}

}  // namespace oscar::testing
