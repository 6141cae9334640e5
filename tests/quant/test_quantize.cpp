// The row quantizer (clip -> fp16 metadata -> codes -> packed) against a float64 model of the
// method's definition.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/naive.hpp"
#include "common/random.hpp"
#include "oscar/quant/row.hpp"

using namespace oscar;
using oscar::testing::naive_fp16;

namespace {

struct NaiveGroup {
  double scale, offset;  // fp16-rounded
  std::vector<int> codes;
  std::vector<bool> near_tie;  // (x - offset)/scale within 1e-4 of a rounding boundary
};

// Method.md §3 in float64: clip, mn/mx, s = max(mx-mn, eps)/3 rounded like the format says
// (float quotient, then fp16), codes against the rounded metadata, nearest level, ties up.
std::vector<NaiveGroup> naive_quantize(const std::vector<float>& row, int group, int clip_k) {
  const int d = static_cast<int>(row.size());
  std::vector<double> x(row.begin(), row.end());
  if (clip_k >= 0) {
    const double tau = oscar::testing::naive_kth_magnitude(x, clip_k);
    for (double& v : x) v = std::clamp(v, -tau, tau);
  }
  std::vector<NaiveGroup> groups;
  for (int start = 0; start < d; start += group) {
    const auto begin = x.begin() + start, end = begin + group;
    const double mn = *std::min_element(begin, end), mx = *std::max_element(begin, end);
    double s = static_cast<float>(static_cast<float>(mx - mn) / 3.0f);
    s = std::clamp(s, std::ldexp(1.0, -24), 65504.0);
    NaiveGroup g{naive_fp16(s), naive_fp16(std::clamp(mn, -65504.0, 65504.0)), {}, {}};
    for (auto it = begin; it != end; ++it) {
      const double level = (*it - g.offset) / g.scale;
      g.codes.push_back(static_cast<int>(std::clamp(std::floor(level + 0.5), 0.0, 3.0)));
      const double frac = level - std::floor(level);
      g.near_tie.push_back(std::abs(frac - 0.5) < 1e-4);
    }
    groups.push_back(g);
  }
  return groups;
}

}  // namespace

TEST_CASE("quantize_row matches the float64 definition: metadata exactly, codes off ties") {
  for (int d : {64, 128, 256}) {
    for (int group : {32, 64, 128, 256}) {
      if (group > d) continue;
      for (float rho : {1.0f, 0.96f, 0.9f}) {
        oscar::testing::RowGenerator gen(d * 7 + group, d);
        const int k = clip_rank(rho, d);
        int tie_mismatches = 0;
        for (int trial = 0; trial < 200; ++trial) {
          const std::vector<float> row = gen.row();
          std::vector<uint8_t> packed(d / 4);
          std::vector<QuantMeta> meta(d / group);
          quantize_row(row.data(), d, group, k, packed.data(), meta.data());
          const auto expected = naive_quantize(row, group, k);
          for (int gi = 0; gi < d / group; ++gi) {
            CHECK(fp16_to_float(meta[gi].scale) == expected[gi].scale);
            CHECK(fp16_to_float(meta[gi].offset) == expected[gi].offset);
            for (int i = 0; i < group; ++i) {
              const int code = oscar::testing::naive_unpack(packed.data(), gi * group + i, group);
              if (code != expected[gi].codes[i]) {
                CHECK(expected[gi].near_tie[i]);  // only float rounding at a boundary may differ
                ++tie_mismatches;
              }
            }
          }
        }
        CHECK(tie_mismatches <= 2);
      }
    }
  }
}

TEST_CASE("reconstruction error is at most half a step plus the metadata rounding") {
  const int d = 128;
  oscar::testing::RowGenerator gen(11, d);
  for (int group : {32, 64, 128}) {
    for (int trial = 0; trial < 300; ++trial) {
      const std::vector<float> row = gen.row();
      std::vector<uint8_t> packed(d / 4);
      std::vector<QuantMeta> meta(d / group);
      quantize_row(row.data(), d, group, -1, packed.data(), meta.data());
      std::vector<float> back(d);
      dequantize_row(packed.data(), meta.data(), d, group, back.data());
      for (int start = 0; start < d; start += group) {
        const double mn = *std::min_element(row.begin() + start, row.begin() + start + group);
        const double mx = *std::max_element(row.begin() + start, row.begin() + start + group);
        const double s = fp16_to_float(meta[start / group].scale);
        const double off = fp16_to_float(meta[start / group].offset);
        // Levels sit at off + c*s instead of mn + c*(mx-mn)/3.
        const double bound = s / 2 + std::abs(off - mn) + 3 * std::abs(s - (mx - mn) / 3) + 1e-6 * std::abs(mx);
        for (int i = start; i < start + group; ++i) CHECK(std::abs(back[i] - row[i]) <= bound);
      }
    }
  }
}

TEST_CASE("edge rows: constant, tiny, huge, NaN, Inf") {
  const int d = 64;
  std::vector<uint8_t> packed(d / 4);
  std::vector<QuantMeta> meta(1);
  std::vector<float> back(d);

  std::vector<float> row(d, 0.75f);  // constant: exact, every code 0
  quantize_row(row.data(), d, d, -1, packed.data(), meta.data());
  dequantize_row(packed.data(), meta.data(), d, d, back.data());
  CHECK(back == row);
  for (uint8_t b : packed) CHECK(b == 0);

  for (int i = 0; i < d; ++i) row[i] = (i % 4) * 1e-9f;  // below fp16 resolution: stays finite
  quantize_row(row.data(), d, d, -1, packed.data(), meta.data());
  dequantize_row(packed.data(), meta.data(), d, d, back.data());
  for (int i = 0; i < d; ++i) CHECK(std::abs(back[i] - row[i]) < 1e-7f);

  for (int i = 0; i < d; ++i) row[i] = (i % 2 ? 1.0f : -1.0f) * 1e6f;  // saturates, stays finite
  quantize_row(row.data(), d, d, -1, packed.data(), meta.data());
  CHECK(std::isfinite(fp16_to_float(meta[0].scale)));
  CHECK(std::isfinite(fp16_to_float(meta[0].offset)));

  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    for (int i = 0; i < d; ++i) row[i] = static_cast<float>(i);
    row[5] = bad;
    std::fill(packed.begin(), packed.end(), uint8_t{0xff});
    quantize_row(row.data(), d, d, clip_rank(0.9f, d), packed.data(), meta.data());
    CHECK(std::isnan(fp16_to_float(meta[0].scale)));
    CHECK(std::isnan(fp16_to_float(meta[0].offset)));
    for (uint8_t b : packed) CHECK(b == 0);
    dequantize_row(packed.data(), meta.data(), d, d, back.data());
    for (float v : back) CHECK(std::isnan(v));
  }
}

TEST_CASE("a NaN in one group of a multi-group row marks the whole row") {
  const int d = 128, group = 32;
  std::vector<float> row(d, 1.0f);
  row[100] = std::nanf("");
  std::vector<uint8_t> packed(d / 4);
  std::vector<QuantMeta> meta(d / group);
  quantize_row(row.data(), d, group, -1, packed.data(), meta.data());
  for (const QuantMeta& m : meta) CHECK(std::isnan(fp16_to_float(m.scale)));
}

TEST_CASE("dequantize_row is dequantize_code(unpack_code) element by element, bit for bit") {
  // dequantize_row reads each group's metadata once and looks its four levels up; every
  // element must still get exactly dequantize_code(code, meta), whatever the bytes and the
  // metadata (any fp16 bit pattern: subnormal, huge, Inf, NaN).
  std::mt19937_64 rng(2024);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> bits(0, 0xffff);
  for (int d : {8, 64, 128, 256}) {
    for (int group : {8, 16, 32, 64, 128, 256}) {
      if (group > d) continue;
      for (int trial = 0; trial < 50; ++trial) {
        std::vector<uint8_t> packed(d / 4);
        for (auto& b : packed) b = static_cast<uint8_t>(byte(rng));
        std::vector<QuantMeta> meta(d / group);
        for (auto& m : meta) {
          m.scale = fp16_t{static_cast<uint16_t>(bits(rng))};
          m.offset = fp16_t{static_cast<uint16_t>(bits(rng))};
        }
        std::vector<float> row(d);
        dequantize_row(packed.data(), meta.data(), d, group, row.data());
        for (int i = 0; i < d; ++i) {
          const float expect = dequantize_code(unpack_code(packed.data(), i, group), meta[i / group]);
          uint32_t a, b;
          std::memcpy(&a, &row[i], 4);
          std::memcpy(&b, &expect, 4);
          // NaNs compare by being NaN (their payload is not part of the format).
          CHECK((std::isnan(expect) ? std::isnan(row[i]) : a == b));
        }
      }
    }
  }
}
