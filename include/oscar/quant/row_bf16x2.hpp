// One cache row quantized by one thread, two bf16 elements per 32-bit register: the same
// bytes as quantize_row() (clip, fp16 metadata, codes, packing), in about a fifth of the
// warp instructions per row of a warp-per-row quantizer.
//
// Why a thread per row: a warp that shares one row of 128 elements repeats every per-row step
// (extremes, the clip threshold's selection, metadata, packing) on all 32 lanes for 4 elements
// each, ~330 warp instructions per row in demote_kernel. Here every step works on two
// elements per instruction (Hopper's 16x2 integer and bf16x2 instructions) and nothing is
// repeated: the row's registers are the only copy.
//
//  - The clip threshold (the L-th largest magnitude, L = head_dim - clip_k) comes from a
//    sorted top-N selection over 16-bit magnitudes (VIMNMX.U16x2: the two halves of a
//    register are two independent lists), not from serial pops. N = 8, 16 or 32 by L, up to
//    the widest selection compiled in (kWidestSelection, 16 or 32: the top-32 list costs
//    registers that spill in the thread-per-row demotion, so a caller whose clip ranks are all
//    within 16 compiles it out); past it a bitwise search with 16x2 counts. The last two lists
//    (the halves of a row, or a half row's and its partner's) are not merged: their union's
//    L-th largest is a max of L pairwise mins (rank_of_two_lists).
//  - Codes are two comparisons per pair against per-group thresholds in bf16 (HSET2; the
//    second's threshold picked by the first), not an fma and three comparisons per element:
//    the code of x is monotone in x, so
//    quantize_code(clamp(x), q) >= c exactly when x >= b_c for the smallest bf16 value b_c
//    that reaches c, found once per group: the float boundary where quantize_code's t crosses
//    c, rounded to bf16, proven by t on that key and its neighbour (a 16-step bitwise search
//    where the proof fails). No element is clamped: a threshold inside the group's clamped
//    range (lo, hi], which lies in (-tau, tau], compares the same on the raw and the clamped
//    value, and one outside it becomes -Inf (every element reaches c) or +Inf (none does).
//  - Bytes are packed in registers in the format's order with byte permutes.
//
// Bit-exact with quantize_row for every finite or non-finite bf16 row, clip rank and group
// size (tests/quant/test_row_bf16x2.cpp checks it on the CPU, test_functors_gpu on the GPU).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "oscar/core/config.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/quant/clip.hpp"
#include "oscar/quant/format.hpp"
#include "oscar/quant/quantize.hpp"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

namespace oscar {
namespace bf16x2 {

// Lane-wise unsigned 16-bit max and min (one VIMNMX.U16x2 each on sm_90).
OSCAR_HOST_DEVICE uint32_t max_u16(uint32_t a, uint32_t b) {
#if OSCAR_DEVICE_CODE
  return __vmaxu2(a, b);
#else
  const uint32_t lo = (a & 0xffffu) > (b & 0xffffu) ? a & 0xffffu : b & 0xffffu;
  const uint32_t hi = (a >> 16) > (b >> 16) ? a >> 16 : b >> 16;
  return lo | hi << 16;
#endif
}
OSCAR_HOST_DEVICE uint32_t min_u16(uint32_t a, uint32_t b) {
#if OSCAR_DEVICE_CODE
  return __vminu2(a, b);
#else
  const uint32_t lo = (a & 0xffffu) < (b & 0xffffu) ? a & 0xffffu : b & 0xffffu;
  const uint32_t hi = (a >> 16) < (b >> 16) ? a >> 16 : b >> 16;
  return lo | hi << 16;
#endif
}

// The bf16 value in the low / high half, widened exactly.
OSCAR_HOST_DEVICE float low(uint32_t w) { return float_from_bits(w << 16); }
OSCAR_HOST_DEVICE float high(uint32_t w) { return float_from_bits(w & 0xffff0000u); }

// __byte_perm: byte i of the result is byte (selector nibble i) of the 8 bytes {b:a}.
OSCAR_HOST_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#if OSCAR_DEVICE_CODE
  return __byte_perm(a, b, selector);
#else
  const uint64_t bytes = uint64_t{b} << 32 | a;
  uint32_t result = 0;
  for (int i = 0; i < 4; ++i) result |= uint32_t((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return result;
#endif
}

OSCAR_HOST_DEVICE uint32_t swap_halves(uint32_t w) { return w >> 16 | w << 16; }

#if OSCAR_DEVICE_CODE
OSCAR_DEVICE __nv_bfloat162 as_bf162(uint32_t w) { return *reinterpret_cast<const __nv_bfloat162*>(&w); }
OSCAR_DEVICE uint32_t as_u32(__nv_bfloat162 v) { return *reinterpret_cast<const uint32_t*>(&v); }
#endif

// Lane-wise min / max of finite bf16 values (HMNMX2.BF16). Which zero a tie of -0 and +0
// returns does not matter to the quantizer (make_group_quantizer maps both to +0).
OSCAR_HOST_DEVICE uint32_t min_bf16(uint32_t a, uint32_t b) {
#if OSCAR_DEVICE_CODE
  return as_u32(__hmin2(as_bf162(a), as_bf162(b)));
#else
  const uint32_t lo = low(b) < low(a) ? b & 0xffffu : a & 0xffffu;
  const uint32_t hi = high(b) < high(a) ? b & 0xffff0000u : a & 0xffff0000u;
  return lo | hi;
#endif
}
OSCAR_HOST_DEVICE uint32_t max_bf16(uint32_t a, uint32_t b) {
#if OSCAR_DEVICE_CODE
  return as_u32(__hmax2(as_bf162(a), as_bf162(b)));
#else
  const uint32_t lo = low(b) > low(a) ? b & 0xffffu : a & 0xffffu;
  const uint32_t hi = high(b) > high(a) ? b & 0xffff0000u : a & 0xffff0000u;
  return lo | hi;
#endif
}

// 0xffff in each half where a >= b as bf16 values (HSET2.BF16), else 0.
OSCAR_HOST_DEVICE uint32_t ge_mask(uint32_t a, uint32_t b) {
#if OSCAR_DEVICE_CODE
  return __hge2_mask(as_bf162(a), as_bf162(b));
#else
  return (low(a) >= low(b) ? 0xffffu : 0u) | (high(a) >= high(b) ? 0xffff0000u : 0u);
#endif
}

// Compare-exchange of two registers' halves: a gets the larger, b the smaller.
OSCAR_HOST_DEVICE void order_descending(uint32_t& a, uint32_t& b) {
  const uint32_t hi = max_u16(a, b);
  b = min_u16(a, b);
  a = hi;
}

// Batcher's odd-even merge sort as a list of compare-exchanges (a << 8 | b), built at compile
// time so that every register index is a constant: 19 exchanges for N = 8 (the fewest
// possible) and 63 for N = 16, where a bitonic sort takes 24 and 80.
template <int N>
struct OddEvenMergeSort {
  static_assert(N >= 2 && N <= 256 && (N & (N - 1)) == 0, "N is a power of two");
  template <class Visit>
  OSCAR_HOST_DEVICE static constexpr void visit(Visit visit_pair) {
    for (int p = 1; p < N; p <<= 1) {
      for (int k = p; k >= 1; k >>= 1) {
        for (int j = k % p; j + k < N; j += 2 * k) {
          for (int i = 0; i < k && i + j + k < N; ++i) {
            if ((i + j) / (2 * p) == (i + j + k) / (2 * p)) visit_pair(i + j, i + j + k);
          }
        }
      }
    }
  }
  OSCAR_HOST_DEVICE static constexpr int count() {
    int n = 0;
    visit([&n](int, int) { ++n; });
    return n;
  }
  struct Pairs {
    uint32_t pair[count()];
  };
  OSCAR_HOST_DEVICE static constexpr Pairs pairs() {
    Pairs list{};
    int n = 0;
    visit([&](int a, int b) { list.pair[n++] = uint32_t(a) << 8 | uint32_t(b); });
    return list;
  }
  static constexpr Pairs kPairs = pairs();
};

template <int N, size_t... I>
OSCAR_HOST_DEVICE void sort_descending(uint32_t (&v)[N], std::index_sequence<I...>) {
  using Network = OddEvenMergeSort<N>;
  (order_descending(v[std::integral_constant<uint32_t, (Network::kPairs.pair[I] >> 8)>::value],
                    v[std::integral_constant<uint32_t, (Network::kPairs.pair[I] & 0xffu)>::value]),
   ...);
}

// Sorts N registers descending in each half (two independent lists): the two halves are two
// lists of N 16-bit keys (tests/quant/test_row_bf16x2.cpp checks every 0-1 input for N = 8
// and 16, random inputs for 32; a review checked all 2^32 0-1 inputs of 32 once, bit-sliced).
template <int N>
OSCAR_HOST_DEVICE void sort_descending(uint32_t (&v)[N]) {
  sort_descending(v, std::make_index_sequence<OddEvenMergeSort<N>::count()>{});
}

// A bitonic sequence of N registers (per half) sorted descending by half-cleaners.
template <int N>
OSCAR_HOST_DEVICE void merge_descending(uint32_t (&v)[N]) {
  OSCAR_UNROLL
  for (int j = N >> 1; j > 0; j >>= 1) {
    OSCAR_UNROLL
    for (int i = 0; i < N; ++i) {
      const int l = i ^ j;
      if (l > i) order_descending(v[i], v[l]);
    }
  }
}

inline constexpr uint32_t kMagnitudes = 0x7fff7fffu;

// The N largest magnitudes of the even elements of the row, sorted descending, in the low
// halves of top[], and those of the odd elements in the high halves: two lists.
// Lists shorter than N (N > kPairs: the top-32 of a d = 64 half row's 16 pairs) are sorted
// as they are and padded with zero magnitudes, which cannot move a larger magnitude down the
// list (sorting the pads too would cost 128 more compare-exchanges).
template <int N, int kPairs>
OSCAR_HOST_DEVICE void largest_magnitudes_by_half(const uint32_t (&row)[kPairs], uint32_t (&top)[N]) {
  static_assert(kPairs % N == 0 || N % kPairs == 0, "the row splits into blocks of N pairs, or fits one");
  if constexpr (N > kPairs) {
    uint32_t sorted[kPairs];
    OSCAR_UNROLL
    for (int i = 0; i < kPairs; ++i) sorted[i] = row[i] & kMagnitudes;
    sort_descending(sorted);
    OSCAR_UNROLL
    for (int i = 0; i < N; ++i) top[i] = i < kPairs ? sorted[i] : 0u;
  } else {
    OSCAR_UNROLL
    for (int i = 0; i < N; ++i) top[i] = row[i] & kMagnitudes;
    sort_descending(top);
  }
  OSCAR_UNROLL
  for (int start = N; start < kPairs; start += N) {
    uint32_t block[N];
    OSCAR_UNROLL
    for (int i = 0; i < N; ++i) block[i] = row[start + i] & kMagnitudes;
    sort_descending(block);
    // The N largest of two descending lists: max(top_i, block_{N-1-i}) is bitonic.
    OSCAR_UNROLL
    for (int i = 0; i < N; ++i) top[i] = max_u16(top[i], block[N - 1 - i]);
    merge_descending(top);
  }
}

// The two lists of top[] merged: the N largest of their union, sorted descending, in both
// halves. The low list against the high one reversed is bitonic (in place, a pair of entries
// at a time: no second list of N registers).
template <int N>
OSCAR_HOST_DEVICE void join_halves(uint32_t (&top)[N]) {
  OSCAR_UNROLL
  for (int i = 0; i < N / 2; ++i) {
    const uint32_t a = top[i], b = top[N - 1 - i];
    top[i] = max_u16(a, swap_halves(b));
    top[N - 1 - i] = max_u16(b, swap_halves(a));
  }
  merge_descending(top);
}

// The R-th largest (R >= 1) of the union of two descending lists L and H, and the largest,
// where load(i) holds L_i in its low half and H_i in its high half (i < R; the lists hold at
// least R entries). Of the union's R largest, some j come from L and R - j from H, so the
// answer is max over j = 0..R of min(L_{j-1}, H_{R-j-1}), the absent L_{-1} and H_{-1} being
// larger than everything: ~1.5 R instructions, where merging the lists (2 log N compare-
// exchanges per entry) and picking entry R - 1 by selects took ~6 N. One min_u16 of load(j - 1)
// against load(R - j - 1) with halves swapped gives the terms j (low half) and R - j (high),
// so j = 1..ceil((R - 1) / 2) and load(R - 1) (the terms R and 0) cover them all.
template <int R, class Load>
OSCAR_HOST_DEVICE void rank_of_two_lists(Load load, uint32_t& largest, uint32_t& rank_th) {
  uint32_t x[R];
  OSCAR_UNROLL
  for (int i = 0; i < R; ++i) x[i] = load(i);
  uint32_t m = x[R - 1];
  OSCAR_UNROLL
  for (int j = 1; j <= R / 2; ++j) m = max_u16(m, min_u16(x[j - 1], swap_halves(x[R - j - 1])));
  largest = max_u16(x[0], x[0] >> 16) & 0xffffu;
  rank_th = max_u16(m, m >> 16) & 0xffffu;
}

// rank_of_two_lists for a runtime rank in [1, N], by a binary search over the compiled ranks
// (log2 N branches; each rank's terms are unrolled, so no list is indexed at run time and none
// goes to local memory). A rank below 1 selects none: rank_th +Inf, no clipping.
template <int Lo, int Hi, class Load>
OSCAR_HOST_DEVICE void rank_of_two_lists_between(Load load, int rank, uint32_t& largest, uint32_t& rank_th) {
  if constexpr (Lo == Hi) {
    rank_of_two_lists<Lo>(load, largest, rank_th);
  } else {
    constexpr int kMid = (Lo + Hi) / 2;
    if (rank <= kMid) {
      rank_of_two_lists_between<Lo, kMid>(load, rank, largest, rank_th);
    } else {
      rank_of_two_lists_between<kMid + 1, Hi>(load, rank, largest, rank_th);
    }
  }
}
template <int N, class Load>
OSCAR_HOST_DEVICE void rank_of_two_lists(Load load, int rank, uint32_t& largest, uint32_t& rank_th) {
  if (rank < 1) {
    const uint32_t x0 = load(0);
    largest = max_u16(x0, x0 >> 16) & 0xffffu;
    rank_th = 0x7f80u;
    return;
  }
  rank_of_two_lists_between<1, N>(load, rank, largest, rank_th);
}

// The k-th smallest magnitude (zero-based) for clip ranks past the sorted selections: a
// bitwise search over the 15 magnitude bits, counting both halves at once. (m <= T) is bit 15
// of (T | 0x8000) - m in each half, which cannot borrow across halves (m, T <= 0x7fff).
// count_both(c) turns this thread's two half-counts into the row's (a row split over two
// lanes adds its partner's).
template <int kPairs, class CountBoth>
OSCAR_HOST_DEVICE uint32_t magnitude_by_search(const uint32_t (&row)[kPairs], int k, CountBoth count_both) {
  uint32_t answer = 0;
  for (int bit = 14; bit >= 0; --bit) {
    const uint32_t trial = answer | ((1u << bit) - 1u);
    const uint32_t trial2 = (trial | trial << 16) | 0x80008000u;
    uint32_t count2 = 0;
    OSCAR_UNROLL
    for (int i = 0; i < kPairs; ++i) count2 += ((trial2 - (row[i] & kMagnitudes)) >> 15) & 0x00010001u;
    count2 = count_both(count2);
    if (int(count2 & 0xffffu) + int(count2 >> 16) <= k) answer |= 1u << bit;
  }
  return answer;
}

// bf16 bit patterns <-> 16-bit keys that order like the values: -NaN ... -Inf ... -0 < +0 ...
// +Inf ... +NaN.
OSCAR_HOST_DEVICE uint32_t ordered_key(uint32_t bits) { return bits & 0x8000u ? ~bits & 0xffffu : bits | 0x8000u; }
OSCAR_HOST_DEVICE uint32_t key_bits(uint32_t key) { return key & 0x8000u ? key & 0x7fffu : ~key & 0xffffu; }

inline constexpr uint32_t kPlusInfKey = 0xff80u;  // ordered_key(0x7f80)
inline constexpr uint32_t kMinusInfBits = 0xff80u, kPlusInfBits = 0x7f80u;

// quantize_code's t for the bf16 value of a key.
OSCAR_HOST_DEVICE float level_position(const GroupQuantizer& q, uint32_t key) {
  return level_position_of_difference(float_from_bits(key_bits(key) << 16) - q.offset, q);
}

// The smallest bf16 value that quantizes to level >= c under q (c = 1, 2, 3), as bf16 bits,
// for a group whose clamped values lie in [lo, hi] (ordered keys): -Inf where even lo reaches
// c, +Inf where not even hi does. quantize_code(x, q) >= c exactly when its t >= c, and t is
// monotone in x, so "t < c" holds on a prefix of the keys up to +Inf: the search builds the
// prefix's last key bit by bit with quantize_code's own arithmetic (16 steps). The reference
// for level_threshold, and its fallback.
OSCAR_HOST_DEVICE uint32_t level_threshold_by_search(const GroupQuantizer& q, float c, uint32_t lo, uint32_t hi) {
  uint32_t below = 0;  // the largest key known below the threshold (key 0, -NaN, is)
  OSCAR_UNROLL
  for (int bit = 15; bit >= 0; --bit) {
    const uint32_t trial = below | (1u << bit);
    if (trial < kPlusInfKey && !(level_position(q, trial) >= c)) below = trial;
  }
  const uint32_t threshold = below + 1;
  if (threshold <= lo) return kMinusInfBits;
  if (threshold > hi) return kPlusInfBits;
  return key_bits(threshold);
}

inline constexpr uint32_t kUnproven = 0xffffffffu;

// The threshold in (lo, hi] (t(lo) < c <= t(hi)) from a guess and a proof, in ~35
// instructions instead of the search's ~160, or kUnproven. t = fmaf(fl(x - offset),
// inv_scale, 1/2) reaches c exactly when fl(x - offset) >= D, the least float difference that
// reaches c (one of (c - 1/2)·scale, exact as scale has 11 significant bits, and its two float
// neighbours), and that holds for x above the midpoint between D and the float below it:
// x >= offset + D - h. That boundary, rounded to bf16, is the threshold's key k or the key
// below it (near zero, where bf16 values are denser than t's float arithmetic, offset + D
// cancels exactly and the boundary is exact). A key k in (lo, hi] with t(k - 1) < c <= t(k)
// is the threshold (t is monotone over the keys), whatever the guess was: the answer is exact
// by its check, not by the guess's error.
OSCAR_HOST_DEVICE uint32_t proven_level_guess(const GroupQuantizer& q, float c, uint32_t lo, uint32_t hi) {
  const float d0 = (c - 0.5f) * q.scale;  // > 0: scale >= 2^-24
  const float d_below = float_from_bits(float_bits(d0) - 1u), d_above = float_from_bits(float_bits(d0) + 1u);
  const float d = level_position_of_difference(d_below, q) >= c ? d_below
                  : level_position_of_difference(d0, q) >= c    ? d0
                                                                 : d_above;
  const float h = 0.5f * (d - float_from_bits(float_bits(d) - 1u));
  const float boundary = (q.offset + d) - h;
  uint32_t k = ordered_key((float_bits(boundary) + 0x8000u) >> 16);  // |boundary| < 2^18: no overflow
  k = k <= lo ? lo + 1 : (k > hi ? hi : k);
  // Reaches: k is the threshold unless k - 1 (>= lo, finite) reaches too. Does not: k + 1 is,
  // if it reaches (k < hi here, as t(hi) >= c).
  const bool reaches = level_position(q, k) >= c;
  const bool neighbour_reaches = level_position(q, reaches ? k - 1 : k + 1) >= c;
  return reaches != neighbour_reaches ? key_bits(reaches ? k : k + 1) : kUnproven;
}

// level_threshold_by_search's answer: the proven guess, the search where the proof fails
// (rarely: tests/quant/test_row_bf16x2.cpp counts it). t_lo and t_hi are level_position of lo
// and hi, shared by a group's three levels.
OSCAR_HOST_DEVICE uint32_t level_threshold(const GroupQuantizer& q, float c, uint32_t lo, uint32_t hi, float t_lo,
                                           float t_hi) {
  if (t_lo >= c) return kMinusInfBits;    // the whole group reaches c
  if (!(t_hi >= c)) return kPlusInfBits;  // none of it does; else the threshold is in (lo, hi]
  const uint32_t proven = proven_level_guess(q, c, lo, hi);
  return proven != kUnproven ? proven : level_threshold_by_search(q, c, lo, hi);
}
OSCAR_HOST_DEVICE uint32_t level_threshold(const GroupQuantizer& q, float c, uint32_t lo, uint32_t hi) {
  return level_threshold(q, c, lo, hi, level_position(q, lo), level_position(q, hi));
}

// The three level thresholds of a group, each broadcast to both halves of its register (the
// form quarter_code_bits compares pairs against).
OSCAR_HOST_DEVICE void level_thresholds(const GroupQuantizer& q, uint32_t lo, uint32_t hi, uint32_t (&level)[3]) {
  const float t_lo = level_position(q, lo), t_hi = level_position(q, hi);
  OSCAR_UNROLL
  for (int c = 0; c < 3; ++c) {
    const uint32_t b = level_threshold(q, float(c + 1), lo, hi, t_lo, t_hi);
    level[c] = b | b << 16;
  }
}

// The quantizer of a group whose extremes are mn, mx (bf16 values), clipped at tau (+Inf: no
// clipping), and the ordered keys lo, hi of its clipped extremes, which bound level_threshold's
// search. The clipped group's extremes are the clamped extremes (clipping is a monotone clamp),
// and they are bf16 values (elements of the row or tau), so their keys are exact.
OSCAR_HOST_DEVICE GroupQuantizer clipped_group_quantizer(float mn, float mx, float tau, uint32_t& lo, uint32_t& hi) {
  mn = clamp_magnitude(mn, tau);
  mx = clamp_magnitude(mx, tau);
  const GroupQuantizer q = make_group_quantizer(mn, mx, true);
  lo = ordered_key(float_bits(mn) >> 16);
  hi = ordered_key(float_bits(mx) >> 16);
  return q;
}

// Extremes of kCount pairs of row starting at pair `first` (finite values), as floats.
template <int kCount, int kPairs>
OSCAR_HOST_DEVICE void pair_extremes(const uint32_t (&row)[kPairs], int first, float& mn, float& mx) {
  uint32_t mn2 = row[first], mx2 = mn2;
  OSCAR_UNROLL
  for (int i = 1; i < kCount; ++i) {
    mn2 = min_bf16(mn2, row[first + i]);
    mx2 = max_bf16(mx2, row[first + i]);
  }
  mn = low(mn2) < high(mn2) ? low(mn2) : high(mn2);
  mx = low(mx2) > high(mx2) ? low(mx2) : high(mx2);
}

// Lane-wise select: the bits of x where mask is set, those of y elsewhere (one LOP3).
OSCAR_HOST_DEVICE uint32_t select_bits(uint32_t mask, uint32_t x, uint32_t y) { return (mask & x) | (~mask & y); }

// The 2-bit codes of elements 4k..4k+3 of one quarter of a group (pairs a = (4k, 4k+1) and
// b = (4k+2, 4k+3)) against the level thresholds b_1 <= b_2 <= b_3 (each broadcast to both
// halves), in bits `shift`, `shift` + 1 of bytes 0..3. Code bit 1 is x >= b_2; bit 0 is
// x >= b_3 where bit 1 is set and x >= b_1 where it is not, so the second comparison takes its
// threshold by a select: two comparisons and a select per pair, where three comparisons and
// their xor took one more. The byte permutes put the low and high halves of a, then of b, in
// bytes 0..3.
OSCAR_HOST_DEVICE uint32_t quarter_code_bits(uint32_t a, uint32_t b, const uint32_t (&level)[3], int shift) {
  const uint32_t a2 = ge_mask(a, level[1]), b2 = ge_mask(b, level[1]);
  const uint32_t a0 = ge_mask(a, select_bits(a2, level[2], level[0]));
  const uint32_t b0 = ge_mask(b, select_bits(b2, level[2], level[0]));
  const uint32_t bit0 = byte_perm(a0, b0, 0x6420u);
  const uint32_t bit1 = byte_perm(a2, b2, 0x6420u);
  return ((bit0 & 0x55555555u) | (bit1 & 0xaaaaaaaau)) & (0x03030303u << shift);
}

}  // namespace bf16x2

// The widest sorted clip selection a quantizer form compiles in: clip distances (head_dim -
// clip_k) up to it are selected by sorting, larger ones by the bitwise search. The same bytes
// either way.
inline constexpr int kRowBf16x2WidestSelection = 32;
inline constexpr int kRowBf16x2NarrowSelection = 16;

namespace bf16x2 {
// The row's largest magnitude (finiteness: bf16 Inf/NaN magnitudes are >= 0x7f80) and its clip
// threshold tau, the (head_dim - clip_k)-th largest magnitude (0x7f80, +Inf, when clip_k < 0),
// as magnitude bits, from this thread's pairs of the row. The hooks say how the row is held:
// select_rank(top, rank, largest, tau) finds the row's largest and rank-th largest from this
// thread's two top lists (largest_magnitudes_by_half), join_max(m) is a max of magnitudes over
// the row, count_both(c) a pair of half-counts over the row (a whole row: nothing to join).
template <int kHeadDim, int kWidestSelection, int kPairs, class SelectRank, class JoinMax, class CountBoth>
OSCAR_HOST_DEVICE void largest_and_clip(const uint32_t (&row)[kPairs], int clip_k, SelectRank select_rank,
                                        JoinMax join_max, CountBoth count_both, uint32_t& largest, uint32_t& tau) {
  largest = 0;
  tau = 0x7f80u;
  const int rank = kHeadDim - clip_k;
  static_assert(kWidestSelection == 16 || kWidestSelection == 32, "selections of 16 or 32");
  const auto select = [&](auto& top) {
    largest_magnitudes_by_half(row, top);
    select_rank(top, rank, largest, tau);
  };
  if (clip_k >= 0 && rank <= 8) {
    uint32_t top[8];
    select(top);
  } else if (clip_k >= 0 && rank <= 16) {
    uint32_t top[16];
    select(top);
  } else if (clip_k >= 0 && rank <= kWidestSelection) {  // (dead where kWidestSelection = 16)
    uint32_t top[kWidestSelection];
    select(top);
  } else {
    uint32_t m = 0;
    OSCAR_UNROLL
    for (int i = 0; i < kPairs; ++i) m = max_u16(m, row[i] & kMagnitudes);
    m = join_max(m);
    largest = max_u16(m, m >> 16) & 0xffffu;
    if (clip_k >= 0 && largest < 0x7f80u) tau = magnitude_by_search(row, clip_k, count_both);
  }
}
}  // namespace bf16x2

// Quantizes one row of kHeadDim bf16 values held as pairs (element 2i in the low half of
// row[i], 2i + 1 in the high half) with clip rank clip_k (clip_rank(); < 0: no clipping).
// Writes the packed codes as kHeadDim / 16 little-endian words (bytes in the format's order)
// and the fp16 metadata of each group: the bytes quantize_row() writes for the same row.
template <int kHeadDim, int kGroup, int kWidestSelection = kRowBf16x2WidestSelection>
OSCAR_HOST_DEVICE void quantize_row_bf16x2(const uint32_t (&row)[kHeadDim / 2], int clip_k,
                                           uint32_t (&codes)[kHeadDim / 16], QuantMeta (&meta)[kHeadDim / kGroup]) {
  using namespace bf16x2;
  constexpr int kGroups = kHeadDim / kGroup;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "a row of 256 does not fit one thread's registers");
  static_assert(kGroup >= 32 && kGroup <= kHeadDim && kHeadDim % kGroup == 0, "supported groups");

  uint32_t largest, tau;
  const auto same = [](uint32_t v) { return v; };
  // The row's two lists are the halves of top[].
  const auto select_rank = [](auto& top, int rank, uint32_t& largest, uint32_t& tau) {
    constexpr int N = std::extent_v<std::remove_reference_t<decltype(top)>>;
    rank_of_two_lists<N>([&](int i) { return top[i]; }, rank, largest, tau);
  };
  largest_and_clip<kHeadDim, kWidestSelection>(row, clip_k, select_rank, same, same, largest, tau);
  const bool finite = largest < 0x7f80u;
  if (!finite) {
    // NaN metadata and zero codes in every group, as quantize_row stores a non-finite row.
    const GroupQuantizer q = make_group_quantizer(0.0f, 0.0f, false);
    OSCAR_UNROLL
    for (int g = 0; g < kGroups; ++g) meta[g] = q.meta;
    OSCAR_UNROLL
    for (int i = 0; i < kHeadDim / 16; ++i) codes[i] = 0;
    return;
  }
  const float tau_value = float_from_bits(tau << 16);  // +Inf when not clipping

  OSCAR_UNROLL
  for (int g = 0; g < kGroups; ++g) {
    float mn, mx;
    pair_extremes<kGroup / 2>(row, g * (kGroup / 2), mn, mx);
    uint32_t lo, hi;
    const GroupQuantizer q = clipped_group_quantizer(mn, mx, tau_value, lo, hi);
    meta[g] = q.meta;
    uint32_t level[3];
    level_thresholds(q, lo, hi, level);
    // Word k of the group's codes holds elements 4k..4k+3 of each quarter.
    constexpr int kQuarter = kGroup / 4;
    OSCAR_UNROLL
    for (int k = 0; k < kGroup / 16; ++k) {
      uint32_t word = 0;
      OSCAR_UNROLL
      for (int quarter = 0; quarter < 4; ++quarter) {
        const int pair = (g * kGroup + quarter * kQuarter + 4 * k) / 2;
        word |= quarter_code_bits(row[pair], row[pair + 1], level, 2 * quarter);
      }
      codes[g * (kGroup / 16) + k] = word;
    }
  }
}

#if defined(__CUDACC__)
template <int kHeadDim, int kGroup>
inline constexpr int kHalfRowGroups = kGroup == kHeadDim ? 1 : kHeadDim / 2 / kGroup;

// Half a row per lane: lanes l and l ^ 16 of a warp (l = `lane`, 0..31) hold elements
// [0, D/2) and [D/2, D) of one row (h = l / 16 = 0 and 1), as bf16 pairs, and exchange what
// the halves must agree on by shuffles within the pair: their top lists, the group extremes,
// the level thresholds and, for a group as wide as the row, the partial code words. Each lane
// then stores bytes [h·D/8, (h+1)·D/8) of the row's codes and the metadata of its groups (of
// the row's one group: h = 0). Half the registers and half the dependent chain of
// quantize_row_bf16x2 per lane, so a warp of 16 rows keeps every lane busy. Both lanes of a
// pair call it; other pairs need not (a pair's shuffles name only its two lanes, which take
// the same branches, a non-finite row's early return included). The bytes are quantize_row's
// (test_functors_gpu).
template <int kHeadDim, int kGroup, int kWidestSelection = kRowBf16x2WidestSelection>
__device__ __forceinline__ void quantize_half_row_bf16x2(const uint32_t (&half)[kHeadDim / 4], int clip_k, int lane,
                                                         uint32_t (&words)[kHeadDim / 32],
                                                         QuantMeta (&meta)[kHalfRowGroups<kHeadDim, kGroup>]) {
  using namespace bf16x2;
  constexpr int kPairs = kHeadDim / 4;
  constexpr bool kSplitGroup = kGroup == kHeadDim;  // the one group spans both halves
  constexpr int kGroups = kHalfRowGroups<kHeadDim, kGroup>;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "a half row of 256 does not fit one thread's registers");
  static_assert(kGroup >= 32 && kGroup <= kHeadDim && kHeadDim % kGroup == 0, "supported groups");
  const int h = lane / 16;
  const unsigned pair_mask = 0x10001u << (lane % 16);
  const auto partner = [pair_mask](uint32_t v) { return __shfl_xor_sync(pair_mask, v, 16); };

  // The row's two lists: this half's (its two lists joined) and the partner's, whose entries
  // come over one shuffle each, only as many as the rank reads. Both lanes of the pair take
  // the same rank's branch, so each shuffle has both its lanes.
  const auto select_rank = [&](auto& top, int rank, uint32_t& largest, uint32_t& tau) {
    constexpr int N = std::extent_v<std::remove_reference_t<decltype(top)>>;
    join_halves(top);
    rank_of_two_lists<N>([&](int i) { return byte_perm(top[i], partner(top[i]), 0x5410u); }, rank, largest, tau);
  };
  uint32_t largest, tau;
  largest_and_clip<kHeadDim, kWidestSelection>(half, clip_k, select_rank,
                                               [&](uint32_t m) { return max_u16(m, partner(m)); },
                                               [&](uint32_t c) { return c + partner(c); }, largest, tau);
  if (largest >= 0x7f80u) {  // a NaN or Inf anywhere in the row
    const GroupQuantizer q = make_group_quantizer(0.0f, 0.0f, false);
    OSCAR_UNROLL
    for (int g = 0; g < kGroups; ++g) meta[g] = q.meta;
    OSCAR_UNROLL
    for (int i = 0; i < kHeadDim / 32; ++i) words[i] = 0;
    return;
  }
  const float tau_value = float_from_bits(tau << 16);

  OSCAR_UNROLL
  for (int g = 0; g < kGroups; ++g) {
    constexpr int kGroupPairs = kSplitGroup ? kPairs : kGroup / 2;
    float mn, mx;
    pair_extremes<kGroupPairs>(half, g * kGroupPairs, mn, mx);
    if constexpr (kSplitGroup) {
      const float other_mn = __uint_as_float(partner(__float_as_uint(mn)));
      const float other_mx = __uint_as_float(partner(__float_as_uint(mx)));
      mn = other_mn < mn ? other_mn : mn;
      mx = other_mx > mx ? other_mx : mx;
    }
    uint32_t lo, hi;
    const GroupQuantizer q = clipped_group_quantizer(mn, mx, tau_value, lo, hi);
    meta[g] = q.meta;
    // Both lanes of a split group find all three thresholds: a checked guess costs less than
    // the shuffle and selects that would share them.
    uint32_t level[3];
    level_thresholds(q, lo, hi, level);

    // Partial words: element e of the half is quarter e / (G/4) of the group (of the row's
    // quarters, this half holds 2h and 2h + 1 when the group is split).
    constexpr int kQuarter = kGroup / 4;
    constexpr int kWords = kGroup / 16;  // code words of one group
    constexpr int kQuartersHere = kSplitGroup ? 2 : 4;
    uint32_t part[kWords];
    OSCAR_UNROLL
    for (int k = 0; k < kWords; ++k) {
      uint32_t word = 0;
      OSCAR_UNROLL
      for (int j = 0; j < kQuartersHere; ++j) {
        const int pair = (g * (kSplitGroup ? 0 : kGroup) + j * kQuarter + 4 * k) / 2;
        word |= quarter_code_bits(half[pair], half[pair + 1], level, 2 * (kSplitGroup ? 2 * h + j : j));
      }
      part[k] = word;
    }
    if constexpr (kSplitGroup) {
      // Words [h·W/2, (h+1)·W/2) are this lane's to store: its own part or'ed with the partner's.
      OSCAR_UNROLL
      for (int k = 0; k < kWords / 2; ++k) {
        const uint32_t mine = h ? part[kWords / 2 + k] : part[k];
        const uint32_t theirs = partner(h ? part[k] : part[kWords / 2 + k]);
        words[k] = mine | theirs;
      }
    } else {
      OSCAR_UNROLL
      for (int k = 0; k < kWords; ++k) words[g * kWords + k] = part[k];
    }
  }
}
#endif

}  // namespace oscar
