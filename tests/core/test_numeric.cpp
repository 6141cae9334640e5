// fp16 / bf16 conversions against float64 rounding from the definition, and against the
// compiler's own _Float16 where it has one.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "common/naive.hpp"
#include "oscar/core/numeric.hpp"

using namespace oscar;
using oscar::testing::naive_bf16;
using oscar::testing::naive_fp16;

namespace {
bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }
}  // namespace

TEST_CASE("every fp16 value survives the round trip through float") {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const fp16_t h{static_cast<uint16_t>(bits)};
    const float f = fp16_to_float(h);
    const fp16_t back = float_to_fp16(f);
    if (std::isnan(f)) {
      CHECK((back.bits & 0x7c00u) == 0x7c00u);
      CHECK((back.bits & 0x3ffu) != 0u);
    } else {
      CHECK(back.bits == h.bits);
    }
  }
}

TEST_CASE("float to fp16 rounds to nearest, ties to even, like float64 rounding") {
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> any;
  int mismatches = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    // Spread over the fp16 range and beyond: random exponent window, random mantissa.
    const uint32_t bits = (any(rng) & 0x807fffffu) | ((100u + any(rng) % 60u) << 23);
    const float f = float_from_bits(bits);
    mismatches += !same_value(fp16_to_float(float_to_fp16(f)), naive_fp16(f));
  }
  CHECK(mismatches == 0);

  // Every midpoint between neighbouring fp16 values: the tie cases.
  for (uint32_t bits = 0; bits < 0x7bffu; ++bits) {
    const double lo = fp16_to_float(fp16_t{static_cast<uint16_t>(bits)});
    const double hi = fp16_to_float(fp16_t{static_cast<uint16_t>(bits + 1)});
    const float mid = static_cast<float>((lo + hi) / 2);  // exact in float
    REQUIRE(static_cast<double>(mid) == (lo + hi) / 2);
    const uint16_t even = (bits & 1u) ? static_cast<uint16_t>(bits + 1) : static_cast<uint16_t>(bits);
    CHECK(float_to_fp16(mid).bits == even);
    CHECK(float_to_fp16(-mid).bits == (even | 0x8000u));
  }
  CHECK(float_to_fp16(65504.0f).bits == 0x7bffu);
  CHECK(float_to_fp16(65519.99f).bits == 0x7bffu);
  CHECK(float_to_fp16(65520.0f).bits == 0x7c00u);  // the tie above the largest value is Inf
  CHECK(float_to_fp16(INFINITY).bits == 0x7c00u);
  CHECK(float_to_fp16(-0.0f).bits == 0x8000u);
  CHECK(float_to_fp16(std::ldexp(1.0f, -25)).bits == 0u);       // tie to even: zero
  CHECK(float_to_fp16(std::ldexp(1.5f, -25)).bits == 1u);       // above the tie: 2^-24
}

#if defined(__FLT16_MAX__)
TEST_CASE("float to fp16 agrees with the compiler's _Float16 on a sweep of all floats") {
  int mismatches = 0;
  for (uint64_t bits = 0; bits < (1ull << 32); bits += 997) {
    const float f = float_from_bits(static_cast<uint32_t>(bits));
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t expected;
    std::memcpy(&expected, &h, 2);
    const uint16_t got = float_to_fp16(f).bits;
    const bool both_nan = std::isnan(f) && (got & 0x7c00u) == 0x7c00u && (got & 0x3ffu);
    mismatches += !(both_nan || got == expected);
  }
  CHECK(mismatches == 0);
}
#endif

TEST_CASE("bf16: every value round trips, conversion rounds like float64") {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const bf16_t b{static_cast<uint16_t>(bits)};
    const float f = bf16_to_float(b);
    if (std::isnan(f)) {
      CHECK(std::isnan(bf16_to_float(float_to_bf16(f))));
    } else {
      CHECK(float_to_bf16(f).bits == b.bits);
    }
  }
  std::mt19937 rng(2);
  std::uniform_int_distribution<uint32_t> any;
  int mismatches = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    const float f = float_from_bits(any(rng));
    mismatches += !same_value(round_to_bf16(f), naive_bf16(f));
  }
  CHECK(mismatches == 0);
  CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8)).bits == float_to_bf16(1.0f).bits);  // tie, even
  CHECK(float_to_bf16(std::nanf("")).bits != float_to_bf16(INFINITY).bits);
}

TEST_CASE("is_finite") {
  CHECK(is_finite(0.0f));
  CHECK(is_finite(-65504.0f));
  CHECK_FALSE(is_finite(INFINITY));
  CHECK_FALSE(is_finite(-INFINITY));
  CHECK_FALSE(is_finite(std::nanf("")));
}
