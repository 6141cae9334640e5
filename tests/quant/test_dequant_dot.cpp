// The fused dequant-dot / dequant-axpy against float64 arithmetic on the dequantized row.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/naive.hpp"
#include "common/random.hpp"
#include "oscar/quant/dequant_dot.hpp"
#include "oscar/quant/row.hpp"

using namespace oscar;

TEST_CASE("dequant_dot and dequant_axpy equal float64 on the reconstruction") {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (int d : {64, 128, 256}) {
    for (int group : {32, 64, 128, 256}) {
      if (group > d) continue;
      oscar::testing::RowGenerator gen(d + 3 * group, d);
      for (int trial = 0; trial < 100; ++trial) {
        const std::vector<float> row = gen.row();
        std::vector<uint8_t> packed(d / 4);
        std::vector<QuantMeta> meta(d / group);
        quantize_row(row.data(), d, group, clip_rank(0.96f, d), packed.data(), meta.data());

        std::vector<double> x_hat(d);  // independent reconstruction: naive unpack, float64
        for (int i = 0; i < d; ++i) {
          const QuantMeta& m = meta[i / group];
          x_hat[i] = fp16_to_float(m.offset) +
                     oscar::testing::naive_unpack(packed.data(), i, group) * double{fp16_to_float(m.scale)};
        }
        std::vector<float> q(d);
        for (float& v : q) v = normal(rng);
        std::vector<float> sums(d / group);
        query_group_sums(q.data(), d, group, sums.data());

        double expected = 0, magnitude = 0;
        for (int i = 0; i < d; ++i) {
          expected += q[i] * x_hat[i];
          magnitude += std::abs(q[i] * x_hat[i]);
        }
        const float got = dequant_dot(q.data(), sums.data(), packed.data(), meta.data(), d, group);
        // float32 accumulation of d products plus the offset split: a few ulps of Σ|q x̂|.
        // The offset term mn·Σq can be large against the result, hence |mn|·Σ|q| as well.
        double offset_mag = 0;
        for (int i = 0; i < d; ++i) offset_mag += std::abs(q[i] * fp16_to_float(meta[i / group].offset));
        CHECK(std::abs(got - expected) <= 4e-6 * (magnitude + offset_mag) + 1e-30);

        const float p = 0.37f;
        std::vector<float> acc(d, 0.5f);
        dequant_axpy(p, packed.data(), meta.data(), d, group, acc.data());
        for (int i = 0; i < d; ++i) {
          CHECK(std::abs(acc[i] - (0.5 + p * x_hat[i])) <= 1e-6 * (0.5 + std::abs(p * x_hat[i])) + 1e-6 * std::abs(p * fp16_to_float(meta[i / group].offset)));
        }
      }
    }
  }
}
