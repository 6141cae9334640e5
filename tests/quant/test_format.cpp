// The storage format: sizes, alignment, validation messages, and the one cost function.
#include <doctest/doctest.h>

#include "oscar/quant/format.hpp"

using namespace oscar;

TEST_CASE("block sizes and 16-byte alignment for every supported shape") {
  for (int d : {64, 128, 256}) {
    for (int g : {32, 64, 128, 256}) {
      if (g > d) continue;
      for (int p = 8; p <= 256; p *= 2) {
        const Int2Layout layout{d, g, p};
        REQUIRE(validate(layout).ok());
        CHECK(layout.code_bytes_per_row() == d / 4);
        CHECK(layout.code_bytes() == p * d / 4);
        CHECK(layout.meta_bytes() == p * (d / g) * 4);
        CHECK(layout.block_bytes() % 16 == 0);
        CHECK(layout.code_bytes() % 16 == 0);
        CHECK(layout.code_bytes_per_row() % 16 == 0);
      }
    }
  }
}

TEST_CASE("unsupported shapes are named in the error") {
  Status s = validate(Int2Layout{96, 96, 16});
  CHECK(s.code() == StatusCode::kUnsupported);
  CHECK(s.message().find("head_dim 96") != std::string::npos);
  s = validate(Int2Layout{128, 48, 16});
  CHECK(s.message().find("quant_group_size 48") != std::string::npos);
  s = validate(Int2Layout{128, 128, 12});
  CHECK(s.message().find("page_size 12") != std::string::npos);
  CHECK_FALSE(validate(Int2Layout{128, 128, 512}).ok());
  CHECK_FALSE(validate(Int2Layout{128, 128, 4}).ok());
  CHECK_FALSE(validate(Int2Layout{64, 128, 16}).ok());  // group larger than the head
}

TEST_CASE("segment_counts: sink, whole INT2 pages, a window of W..W+P-1") {
  const int sink = 64, recent = 256, page = 16;
  for (int64_t length = 0; length < 2000; ++length) {
    const SegmentCounts c = segment_counts(length, sink, recent, page);
    CHECK(c.sink + c.int2 + c.recent == length);
    CHECK(c.int2 % page == 0);
    CHECK(c.sink == std::min<int64_t>(length, sink));
    if (c.int2 > 0) {
      CHECK(c.recent >= recent);
      CHECK(c.recent < recent + page);
    } else {
      CHECK(c.recent < recent + page);
    }
  }
  const SegmentCounts none = segment_counts(100, 0, 0, 8);
  CHECK(none.int2 == 96);
  CHECK(none.recent == 4);
}

TEST_CASE("storage_cost matches the method's formula and the byte count") {
  const Int2Layout layout{128, 128, 16};
  // All INT2: 2 + 32/128 bits per element.
  StorageCost cost = storage_cost(layout, {0, 1024, 0});
  CHECK(cost.bits_per_element == doctest::Approx(2.25));
  CHECK(cost.bytes_per_token == doctest::Approx(72.0));  // kernels.md: 72 bytes, K and V
  CHECK(cost.compression_vs_bf16 == doctest::Approx(512.0 / 72.0));
  // method.md: 2 + 32/G + (S+W)/L (16 - 2 - 32/G), S+W = 320, L = 128K.
  const int64_t L = 131072;
  cost = storage_cost(layout, {64, L - 320, 256});
  const double formula = 2 + 32.0 / 128 + 320.0 / L * (16 - 2 - 32.0 / 128);
  CHECK(cost.bits_per_element == doctest::Approx(formula).epsilon(1e-12));
  CHECK(storage_cost(Int2Layout{128, 32, 16}, {0, 10, 0}).bytes_per_token == doctest::Approx(96.0));
  CHECK(storage_cost(Int2Layout{128, 64, 16}, {0, 10, 0}).bytes_per_token == doctest::Approx(80.0));
  CHECK(storage_cost(layout, {0, 0, 0}).bytes_per_token == 0.0);
}
