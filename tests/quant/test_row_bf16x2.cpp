// The thread-per-row quantizer (quantize_row_bf16x2) against the reference quantize_row: the
// same packed bytes and fp16 metadata, bit for bit, for every clip rank of every supported
// (head_dim, group), on rows built to hit its edges: ties of magnitude, signed zeros,
// subnormals, values beyond the fp16 range, constant groups, NaN and Inf, and the level
// thresholds crossing zero (symmetric groups put the middle threshold there, where bf16
// values are densest).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "common/quantizer_rows.hpp"
#include "common/random.hpp"
#include "oscar/quant/row.hpp"
#include "oscar/quant/row_bf16x2.hpp"

using namespace oscar;
using oscar::testing::as_bf16_pairs;
using oscar::testing::quantizer_edge_rows;

namespace {

// Returns the number of rows checked; every mismatch is a failed CHECK naming the row.
template <int D, int G, int S = kRowBf16x2WidestSelection>
int check_rows(const std::vector<std::vector<float>>& rows, int clip_k) {
  int checked = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const std::vector<float>& x = rows[r];
    uint8_t want_codes[D / 4];
    QuantMeta want_meta[D / G];
    quantize_row(x.data(), D, G, clip_k, want_codes, want_meta);

    uint32_t pairs[D / 2];
    const std::vector<uint32_t> p = as_bf16_pairs(x);
    std::memcpy(pairs, p.data(), sizeof pairs);
    uint32_t got_words[D / 16];
    QuantMeta got_meta[D / G];
    std::memset(got_words, 0xa5, sizeof got_words);  // poisoned: every word must be written
    std::memset(got_meta, 0xa5, sizeof got_meta);
    quantize_row_bf16x2<D, G, S>(pairs, clip_k, got_words, got_meta);
    uint8_t got_codes[D / 4];
    std::memcpy(got_codes, got_words, sizeof got_codes);  // little-endian words, as the GPU stores them

    const bool codes_equal = std::memcmp(got_codes, want_codes, sizeof got_codes) == 0;
    const bool meta_equal = std::memcmp(got_meta, want_meta, sizeof got_meta) == 0;
    if (!codes_equal || !meta_equal) {
      INFO("D=" << D << " G=" << G << " selection " << S << " clip_k=" << clip_k << " row " << r);
      CHECK(codes_equal);
      CHECK(meta_equal);
    }
    ++checked;
  }
  return checked;
}

template <int D, int G, int S>
void check_every_clip_rank() {
  const std::vector<std::vector<float>> rows = quantizer_edge_rows(D, D * 31 + G);
  int checked = 0;
  for (int clip_k = -1; clip_k < D; ++clip_k) checked += check_rows<D, G, S>(rows, clip_k);
  CHECK(checked == int(rows.size()) * (D + 1));
}

template <class F>
void for_each_selection(F f) {
  f.template operator()<kRowBf16x2WidestSelection>();
  f.template operator()<kRowBf16x2NarrowSelection>();
}

}  // namespace

TEST_CASE("quantize_row_bf16x2 writes quantize_row's bytes for every clip rank") {
  // Both compiled forms: with the top-32 selection and without it (distances 17-32 searched).
  for_each_selection([]<int S>() {
    check_every_clip_rank<64, 32, S>();
    check_every_clip_rank<64, 64, S>();
    check_every_clip_rank<128, 32, S>();
    check_every_clip_rank<128, 64, S>();
    check_every_clip_rank<128, 128, S>();
  });
}

TEST_CASE("quantize_row_bf16x2 on many random rows at the authors' clip ratios") {
  for (float rho : {0.96f, 0.92f, 0.85f, 1.0f}) {
    std::vector<std::vector<float>> rows;
    oscar::testing::RowGenerator gen(uint64_t(rho * 1000), 128, 6, 20.0f);
    for (int i = 0; i < 2000; ++i) rows.push_back(gen.row());
    CHECK(check_rows<128, 128>(rows, clip_rank(rho, 128)) == 2000);
    CHECK(check_rows<128, 64>(rows, clip_rank(rho, 128)) == 2000);
  }
}

TEST_CASE("the level thresholds are the smallest bf16 values that reach each level") {
  // Direct check of the search on one group: every bf16 value in [mn, mx] against its code.
  const GroupQuantizer q = make_group_quantizer(-2.5f, 3.0f, true);
  const uint32_t lo = bf16x2::ordered_key(float_to_bf16(-2.5f).bits), hi = bf16x2::ordered_key(float_to_bf16(3.0f).bits);
  for (int c = 1; c <= 3; ++c) {
    const uint32_t b = bf16x2::level_threshold(q, float(c), lo, hi);
    const float threshold = bf16_to_float(bf16_t{uint16_t(b)});
    int mismatches = 0;
    for (uint32_t key = lo; key <= hi; ++key) {
      const float v = bf16_to_float(bf16_t{uint16_t(bf16x2::key_bits(key))});
      mismatches += (quantize_code(v, q) >= uint32_t(c)) != (v >= threshold);
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("the checked guess of a level threshold is the search's answer for every group") {
  // level_threshold (a guess proven by its neighbour, the search as its fallback) against
  // level_threshold_by_search on groups from subnormal fp16 scales to beyond the fp16 range,
  // symmetric groups (the middle level at zero), clipped extremes and constant groups. The
  // fallback must be rare for the fast path to pay: counted, and bounded below.
  std::mt19937_64 rng(20261206);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-40, 20);
  const auto bf16 = [](float v) { return round_to_bf16(v); };
  int groups = 0, fallbacks = 0, mismatches = 0;
  for (int i = 0; i < 200000; ++i) {
    const float magnitude = std::ldexp(1.0f, exponent(rng));
    float mn = bf16(unit(rng) * magnitude), mx = bf16(unit(rng) * magnitude);
    switch (i % 4) {
      case 1: mn = -mx; break;                                // symmetric, as a row clipped on both sides
      case 2: mx = oscar::testing::bf16_keys_above(mn, 1 + i % 9); break;  // a few bf16 steps wide: scale at the fp16 floor
      default: break;
    }
    if (mn > mx) std::swap(mn, mx);
    uint32_t lo, hi;
    const GroupQuantizer q = bf16x2::clipped_group_quantizer(mn, mx, INFINITY, lo, hi);
    for (int c = 1; c <= 3; ++c) {
      const uint32_t want = bf16x2::level_threshold_by_search(q, float(c), lo, hi);
      const uint32_t got = bf16x2::level_threshold(q, float(c), lo, hi);
      if (got != want) {
        INFO("mn=" << mn << " mx=" << mx << " c=" << c << " want=" << want << " got=" << got);
        CHECK(got == want);
        ++mismatches;
      }
      // How often the guess does not prove itself and the search answers.
      const float t_lo = bf16x2::level_position(q, lo), t_hi = bf16x2::level_position(q, hi);
      if (!(t_lo >= c) && t_hi >= c) fallbacks += bf16x2::proven_level_guess(q, float(c), lo, hi) == bf16x2::kUnproven;
      ++groups;
    }
  }
  CHECK(mismatches == 0);
  MESSAGE(fallbacks << " of " << groups << " thresholds fell back to the search");
  CHECK(fallbacks * 1000 < groups);  // under 0.1 % (none when written): the guess is the path
}

template <int N>
void check_sorts_every_0_1_input() {
  // The 0-1 principle: a comparator network that sorts every 0-1 input sorts every input.
  // Both halves of each register are lists: the low half gets the input, the high half its
  // complement, so the two lists are checked independently.
  int unsorted = 0;
  for (uint32_t input = 0; input < (1u << N); ++input) {
    uint32_t v[N];
    for (int i = 0; i < N; ++i) {
      const uint32_t bit = (input >> i) & 1u;
      v[i] = bit | (bit ^ 1u) << 16;
    }
    bf16x2::sort_descending(v);
    for (int i = 1; i < N; ++i) unsorted += (v[i] & 0xffffu) > (v[i - 1] & 0xffffu) || (v[i] >> 16) > (v[i - 1] >> 16);
  }
  CHECK(unsorted == 0);
}

TEST_CASE("sort_descending sorts every 0-1 input, so every input") {
  check_sorts_every_0_1_input<8>();
  check_sorts_every_0_1_input<16>();
}

TEST_CASE("sort_descending<32> sorts random inputs") {
  // 2^32 0-1 inputs are too many: random 16-bit keys, both halves, instead (the network is
  // Batcher's construction, the same code as the exhaustively checked 8 and 16).
  std::mt19937_64 rng(32);
  int unsorted = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    uint32_t v[32];
    for (uint32_t& w : v) w = uint32_t(rng()) & (trial % 2 ? 0x000f000fu : 0x7fff7fffu);  // ties, then spread
    bf16x2::sort_descending(v);
    for (int i = 1; i < 32; ++i) unsorted += (v[i] & 0xffffu) > (v[i - 1] & 0xffffu) || (v[i] >> 16) > (v[i - 1] >> 16);
  }
  CHECK(unsorted == 0);
}

namespace {

// largest_magnitudes_by_half<N>(row) then join_halves (the half-row form's own list) against a
// sort of the row's magnitudes: entry i of both halves is the i-th largest (0 past the row's
// 2·kPairs values), and the same bitonic join across two lanes (one list against the other
// reversed, then merged) gives the two rows' union. And rank_of_two_lists, for every rank
// 0..N: of one row's two half lists (the thread-per-row form) and of the two lanes' joined
// lists (the half-row form), the largest and the rank-th largest of the sort (+Inf for rank 0).
template <int N, int kPairs>
int count_wrong_top_lists(std::mt19937_64& rng, int trials) {
  int wrong = 0;
  for (int trial = 0; trial < trials; ++trial) {
    uint32_t rows[2][kPairs];
    std::vector<uint32_t> mags[3];  // lane 0, lane 1, both
    for (int lane = 0; lane < 2; ++lane) {
      for (uint32_t& w : rows[lane]) {
        w = uint32_t(rng()) & (trial % 3 == 0 ? 0x800f800fu : 0xffffffffu);  // many ties and signs, then spread
        for (const uint32_t m : {w & 0x7fffu, (w >> 16) & 0x7fffu}) {
          mags[lane].push_back(m);
          mags[2].push_back(m);
        }
      }
    }
    for (auto& m : mags) std::sort(m.begin(), m.end(), std::greater<>());
    uint32_t top[2][N];
    const auto check_ranks = [&](auto load, const std::vector<uint32_t>& sorted) {
      for (int rank = 0; rank <= N; ++rank) {
        uint32_t largest = 0xdeadu, tau = 0xdeadu;
        bf16x2::rank_of_two_lists<N>(load, rank, largest, tau);
        wrong += largest != sorted[0] || tau != (rank == 0 ? 0x7f80u : sorted[rank - 1]);
      }
    };
    for (int lane = 0; lane < 2; ++lane) {
      uint32_t by_half[N];
      bf16x2::largest_magnitudes_by_half(rows[lane], by_half);
      check_ranks([&](int i) { return by_half[i]; }, mags[lane]);
      bf16x2::largest_magnitudes_by_half(rows[lane], top[lane]);
      bf16x2::join_halves(top[lane]);
      for (int i = 0; i < N; ++i) {
        const uint32_t want = i < int(mags[lane].size()) ? mags[lane][i] : 0u;
        wrong += (top[lane][i] & 0xffffu) != want || (top[lane][i] >> 16) != want;
      }
    }
    uint32_t joined[N];
    for (int i = 0; i < N; ++i) joined[i] = bf16x2::max_u16(top[0][i], top[1][N - 1 - i]);
    bf16x2::merge_descending(joined);
    for (int i = 0; i < N; ++i) wrong += (joined[i] & 0xffffu) != mags[2][i];
    check_ranks([&](int i) { return (top[0][i] & 0xffffu) | top[1][i] << 16; }, mags[2]);
  }
  return wrong;
}

}  // namespace

TEST_CASE("largest_magnitudes_by_half and join_halves: the sorted top lists, lists longer than the row padded, the lane join, the rank") {
  std::mt19937_64 rng(17);
  CHECK(count_wrong_top_lists<8, 16>(rng, 3000) == 0);
  CHECK(count_wrong_top_lists<16, 16>(rng, 3000) == 0);
  CHECK(count_wrong_top_lists<16, 32>(rng, 3000) == 0);
  CHECK(count_wrong_top_lists<32, 16>(rng, 3000) == 0);  // d = 64 half rows: 16 pairs, 32 entries
  CHECK(count_wrong_top_lists<32, 32>(rng, 3000) == 0);
  CHECK(count_wrong_top_lists<32, 64>(rng, 3000) == 0);
}
