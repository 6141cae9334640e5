// Pack / unpack are exact inverses over every code in every position, in the documented order.
#include <doctest/doctest.h>

#include <random>
#include <vector>

#include "common/naive.hpp"
#include "oscar/quant/pack.hpp"

using namespace oscar;

TEST_CASE("the packed order is the documented per-group quartered layout") {
  for (int d : {64, 128, 256}) {
    for (int g : {32, 64, 128, 256}) {
      if (g > d) continue;
      for (int e = 0; e < d; ++e) {
        const auto expected = oscar::testing::naive_code_position(e, g);
        CHECK(code_byte(e, g) == expected.byte);
        CHECK(code_shift(e, g) == expected.shift);
      }
      if (g == d) {  // one group: exactly the authors' layout
        for (int j = 0; j < d / 4; ++j) {
          CHECK(code_byte(j, g) == j);
          CHECK(code_byte(d / 4 + j, g) == j);
          CHECK(code_shift(d / 2 + j, g) == 4);
          CHECK(code_shift(3 * d / 4 + j, g) == 6);
        }
      }
    }
  }
}

TEST_CASE("every code value in every position packs and unpacks exactly") {
  for (int d : {64, 128, 256}) {
    for (int g : {32, 64, 128, 256}) {
      if (g > d) continue;
      std::vector<uint8_t> codes(d), packed(d / 4), back(d);
      for (int e = 0; e < d; ++e) {
        for (uint8_t c = 0; c < 4; ++c) {
          std::fill(codes.begin(), codes.end(), uint8_t{0});
          codes[e] = c;
          pack_row(codes.data(), d, g, packed.data());
          CHECK(oscar::testing::naive_unpack(packed.data(), e, g) == c);
          unpack_row(packed.data(), d, g, back.data());
          CHECK(back == codes);
          CHECK(unpack_code(packed.data(), e, g) == c);
        }
      }
      // Every byte value, as an exhaustive check of one byte's four fields.
      for (int byte = 0; byte < 256; ++byte) {
        std::fill(packed.begin(), packed.end(), static_cast<uint8_t>(byte));
        unpack_row(packed.data(), d, g, back.data());
        std::vector<uint8_t> repacked(d / 4);
        pack_row(back.data(), d, g, repacked.data());
        CHECK(repacked == packed);
      }
      std::mt19937 rng(d + g);
      for (int trial = 0; trial < 50; ++trial) {
        for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() & 3u);
        pack_row(codes.data(), d, g, packed.data());
        unpack_row(packed.data(), d, g, back.data());
        CHECK(back == codes);
      }
    }
  }
}
