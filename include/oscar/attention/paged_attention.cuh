// GPU paged attention over the OSCAR cache: decode (one query per request) and extend (several
// causal queries per request) over the three segments of every request (BF16 sink, INT2 pages,
// BF16 recent window), split-KV with the exact log-sum-exp merge, in one launch.
//
// Design (kernels.md §2):
// - Swap-AB tensor-core MMA (m16n8k16): 16 key tokens in M, 8 columns in N, where a column is
//   one (query token, query head) of the block's KV head; a decode step of a GQA group of up
//   to 8 heads is one pass over the keys.
// - INT2 keys: q·k̂ = s·(q·c) + offset·Σq per token, so the MMA runs on the raw codes. A code
//   becomes an fp16 with one LOP3 (the field ORed into the mantissa of 1024: 1024 + 4^k·c),
//   met by q·4^-k, with the 1024·Σq' it adds removed through the accumulator's start. No
//   channel shuffle: each lane reads contiguous bytes of a row, and q's channels are placed
//   in the B fragment to match the bytes it reads (the fragment order is folded into q, not
//   into the stored format, so format v1 pages are read as they are).
// - INT2 values: o = Σ_t (p_t·s_t)·c_t + Σ_t p_t·offset_t. The probabilities are scaled per
//   token, transposed into the B fragment with movmatrix, and the offset term is one running
//   scalar per column. V^T is the A operand: two tokens' codes share a register, built with
//   one PRMT per 2x16 codes; a code field enters as the fp16 subnormal 4^k·c·2^-24 (one AND,
//   no bias), and each accumulator register is scaled back by its field's 2^24·4^-k once,
//   after the warp's tiles (value_field_unit).
// - BF16 tiles (sink/window, or a whole BF16 cache: our BF16 baseline) go through the same
//   state; q is split into bf16 hi + lo parts there so the score keeps ~16 bits.
// - Each warp owns every kWarps-th tile of the block's chunk and its own online-softmax state; the
//   block merges its warps, and the last block of a split request (arrival counter) merges the
//   chunks and un-rotates the output. One launch, no host sync, no allocation. (Extends of
//   many rows run the row-tiled kernels of extend_attention.cuh instead: three launches.)
// - Extends of 9-48 rows per KV head carry two 8-column tiles per pass (NT = 2): each staged
//   INT2 tile is read and unpacked once for both tiles' MMAs, at the price of twice o and q's
//   fragments in registers (fewer blocks per SM).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "oscar/attention/attention_fragments.cuh"
#include "oscar/attention/attention_launch_checks.hpp"
#include "oscar/attention/attention_plan.hpp"
#include "oscar/attention/attention_timeline.cuh"
#include "oscar/attention/extend_attention.cuh"
#include "oscar/attention/paged_attention_params.hpp"
#include "oscar/core/cuda_status.hpp"
#include "oscar/core/kernel_attributes.cuh"
#include "oscar/core/status.hpp"
#include "oscar/kv/paged_kv.hpp"

namespace oscar {
namespace attention_detail {

// The launch shape per head dim: warps per block and the blocks per SM the register
// allocation must leave room for. The SM's resident warps hide the latency of the dependent
// unpack -> MMA -> softmax chain, so smaller blocks that fit more often win where registers
// allow (H200, docs/benchmarks.md). OSCAR_ATTENTION_WARPS / OSCAR_ATTENTION_MIN_BLOCKS_PER_SM
// override both for every head dim (measurement knobs).
// NT: the 8-column tiles a block carries through one pass over the keys (1 for decode; 2 for
// extends of 9-48 rows per KV head, whose two tiles then share each staged INT2 tile's copies,
// shared loads and unpack: attention_plan.hpp). Two tiles hold twice o and q's fragments, so
// fewer blocks fit per SM.
template <int D, int NT = 1>
struct KernelConfig {
  static_assert(NT == 1 || (NT == 2 && D <= 128), "two column tiles per pass at head dims up to 128");
#ifdef OSCAR_ATTENTION_WARPS
  static constexpr int kWarps = OSCAR_ATTENTION_WARPS;
#else
  static constexpr int kWarps = D == 256 ? 8 : 4;
#endif
#ifdef OSCAR_ATTENTION_MIN_BLOCKS_PER_SM
  static constexpr int kMinBlocks = OSCAR_ATTENTION_MIN_BLOCKS_PER_SM;
#else
  // d = 64: 128 registers, no spills; d = 128: 168 registers; d = 256 needs all 255.
  static constexpr int kMinBlocks = NT == 2 ? (D == 64 ? 3 : 2) : (D == 64 ? 4 : (D == 128 ? 3 : 1));
#endif
  static constexpr int kThreads = kWarps * 32;
  static_assert(kWarps == 4 || kWarps == 8, "4 or 8 warps per block");
  // OSCAR_ATTENTION_Q_SHARED=1 keeps q's fp16 fragments for the INT2 keys (D/8 registers per
  // lane) in shared memory, read per k-step (one LDS.64 per MMA): a measurement knob for when
  // registers are short; at 3 blocks per SM it bought nothing on the H200 (docs/benchmarks.md).
#ifdef OSCAR_ATTENTION_Q_SHARED
  static constexpr bool kQueryFragmentsShared = OSCAR_ATTENTION_Q_SHARED != 0;
#else
  static constexpr bool kQueryFragmentsShared = false;
#endif
};

// This lane's fp16 B fragments of q for the INT2 key MMAs, k-step s: {b0b1, b2b3}, prescaled by
// 4^-(s%4) to meet the code fields as int2_key_scores unpacks them, and by sm_scale·log2(e). In registers, or (where
// KernelConfig says so) in shared memory, [D/16][32] uint2 at this lane.
template <int D>
struct KeyQueryFragments {
  static constexpr bool kShared = KernelConfig<D>::kQueryFragmentsShared;
  uint32_t reg[kShared ? 1 : D / 16][2];
  const uint2* shared;

  OSCAR_DEVICE uint2 get(int s) const {
    if constexpr (kShared) {
      return shared[s * 32];
    } else {
      return make_uint2(reg[s][0], reg[s][1]);
    }
  }
};
inline constexpr int kCols = kAttentionTileColumns;
// Per-warp online-softmax state for this lane's two columns (2j, 2j+1) and its slots of o.
// The running max of a warp that has seen no key yet: finite, so the hot path subtracts it
// with no special case (every real score passes it by more than kMaxGrowth and moves the max
// before its first exponential; a masked -inf score gives exp2(-inf) = 0 against it, and the
// merges weigh an empty state by exp2(kNoKeyMax - m) = 0, or by 1 times its zero sums).
inline constexpr float kNoKeyMax = -1e30f;

template <int D>
OSCAR_DEVICE void to_value_units_of_one(float (&o)[D / 16][4]) {
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
    // o[mt][0..1]: register 2·mt of value_channel's order, o[mt][2..3]: register 2·mt + 1.
    constexpr float kInv[4] = {1.0f / value_field_unit(0), 1.0f / value_field_unit(1), 1.0f / value_field_unit(2),
                               1.0f / value_field_unit(3)};
    const float lo = kInv[value_field(2 * mt)], hi = kInv[value_field(2 * mt + 1)];
    o[mt][0] *= lo;
    o[mt][1] *= lo;
    o[mt][2] *= hi;
    o[mt][3] *= hi;
  }
}

template <int D>
struct WarpState {
  float o[D / 16][4];
  float m[2];  // kNoKeyMax until a key is seen
  float l[2];       // lane-partial; summed over the 8 lanes of a column at the end
  float offset[2];  // lane-partial Σ p·offset of INT2 values
};

struct TileContext {
  int32_t key_position0;  // position of the tile's first key in the request
  int valid;              // keys of the tile inside the segment (1..16)
  bool causal;
  int32_t q_pos[2];  // positions of this lane's two columns' queries (INT32_MAX: none)
};

// Masks, runs the online-softmax update on this lane's scores s[token r / r+8][column], and
// returns the probabilities in s. Rescales the warp's o and offset sums when the max moves.
// kMayMask = false: the caller knows the tile is whole and every column sees all its keys (the
// INT2 loop's tiles below full_end), so not even the test is made (its branch and
// reconvergence were ~6 instructions a tile).
template <int D, bool kMayMask = true>
OSCAR_DEVICE void softmax_step(WarpState<D>& st, float (&s)[2][2], const TileContext& tc, int r) {
  // A full tile of a decode step sees every key: the mask only costs where it can bite.
  if (kMayMask && (tc.causal || tc.valid < kAttentionTileTokens)) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r + 8 * half;
      const bool in_segment = row < tc.valid;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const bool visible = in_segment && (!tc.causal || tc.key_position0 + row <= tc.q_pos[i]);
        if (!visible) s[half][i] = -INFINITY;
      }
    }
  }
  // Lazy running max (as in FlashAttention-4): the max only moves when a score passes it by
  // more than kMaxGrowth (log2 units), so p = 2^(s - m) <= 2^8 stays exact in fp32 and far
  // from fp16 overflow in p * scale. Most tiles then cost one vote instead of three shuffle
  // rounds, two exponentials and a rescale of o.
  // The test is on s - m, the exponent the common path needs anyway (one subtraction per
  // score, not an add per column on top).
  constexpr float kMaxGrowth = 8.0f;
  float e[2][2];
  auto exponents = [&] {  // e = s - m, against the current max
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i < 2; ++i) e[half][i] = s[half][i] - st.m[i];
    }
  };
  exponents();
  const bool grow = e[0][0] > kMaxGrowth || e[1][0] > kMaxGrowth || e[0][1] > kMaxGrowth || e[1][1] > kMaxGrowth;
  if (__any_sync(kFullMask, grow)) {
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float tile_max = fmaxf(s[0][i], s[1][i]);
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 4));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 8));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 16));
      const float m_new = fmaxf(st.m[i], tile_max);
      alpha[i] = fast_exp2(st.m[i] - m_new);  // 0 from kNoKeyMax, on sums still 0
      st.m[i] = m_new;
      st.l[i] *= alpha[i];
      st.offset[i] *= alpha[i];
    }
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      st.o[mt][0] *= alpha[0];
      st.o[mt][1] *= alpha[1];
      st.o[mt][2] *= alpha[0];
      st.o[mt][3] *= alpha[1];
    }
    exponents();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    // m = kNoKeyMax here means every key so far is masked, and so is every key of this tile.
    s[0][i] = fast_exp2(e[0][i]);
    s[1][i] = fast_exp2(e[1][i]);
    st.l[i] += s[0][i] + s[1][i];
  }
}

// The fragments one lane reads of one staged INT2 tile (read_int2_tile): key rows r and r+8,
// the metadata of those tokens, value rows 2j, 2j+1, 2j+8, 2j+9.
template <int D>
struct Int2TileRaw {
  static constexpr int kKWords = LaneCodeWords<D>::kKWords;  // key words per lane per token
  static constexpr int kVBytes = LaneCodeWords<D>::kVBytes;  // value bytes per lane per token
  static constexpr int kVWords = LaneCodeWords<D>::kVWords;
  uint32_t kw[2][kKWords];
  uint32_t kmeta[2], vmeta[2];
  uint32_t vw[4][kVWords];
  int valid;  // keys of the tile inside the segment; 0: nothing loaded
  int32_t key_position0;
};

// ---- INT2 tiles staged through shared memory -------------------------------------------------
// A tile's bytes are a few contiguous runs in the pages (per 8-token half: 8 rows of codes and
// 8 metadata words, for K and for V), so a warp copies them with 16-byte cp.async into a
// per-warp stage and reads its fragments from there: a handful of copies and shared loads per
// lane instead of ten dependent global loads with their 64-bit address arithmetic, and the
// bytes in flight wait in shared memory rather than in registers.
// 6 or 8 stages measured slower on the H200 at every shape (B = 1 32K 37.0 -> 37.8 / 38.5 us),
// and on the H100, where the loop is bound by its copies (B = 1 32K 34.4-34.8 -> 36.3-36.4 /
// 37.1-37.7 us, B = 16 32K 156-157 -> 158 / 158, B = 64 8K 201-202 -> 204-205 / 206):
// more tiles in flight do not feed the loop faster.
#ifdef OSCAR_ATTENTION_INT2_STAGES
inline constexpr int kInt2Stages = OSCAR_ATTENTION_INT2_STAGES;  // measurement knob
#else
inline constexpr int kInt2Stages = 4;  // tiles per warp in flight or being computed
#endif

// A measurement knob that splits the INT2 loop's time between its two halves (build with
// -DOSCAR_ATTENTION_PROBE=N; the outputs are then wrong, and without the macro nothing
// changes): 1 = compute only, the tiles' copies are not issued and every warp computes on
// zeroed stages (zero metadata: scores 0, the max set once, the common path); 2 = copies only,
// every tile is waited for and refilled but not computed. What a producer warp that takes
// the copies off the consumers could gain is bounded by the first; what the copy pipeline
// alone reaches, by the second (docs/benchmarks.md).
#ifdef OSCAR_ATTENTION_PROBE
inline constexpr int kAttentionProbe = OSCAR_ATTENTION_PROBE;
#else
inline constexpr int kAttentionProbe = 0;
#endif

// Stage layout: K codes [16][D/4], V codes [16][D/4], K meta [16] words, V meta [16] words.
template <int D>
struct Int2Stage {
  static constexpr int kRowBytes = D / 4;
  static constexpr int kCodes = 16 * kRowBytes;
  static constexpr int kVCodes = kCodes;
  static constexpr int kKMeta = 2 * kCodes;
  static constexpr int kVMeta = kKMeta + 64;
  static constexpr int kBytes = kVMeta + 64;
  static constexpr int kCodeChunksPerHalf = 8 * kRowBytes / 16;  // 16-byte chunks of 8 rows
  static constexpr int kCodeChunks = 4 * kCodeChunksPerHalf;     // K/V x two halves
  // 8 lanes per half-region, chunks 128 bytes apart.
  static_assert(kCodeChunks % 32 == 0 && kCodeChunksPerHalf % 8 == 0, "whole chunks per lane");
};


// Which run of a tile this lane copies, fixed for the whole loop: lane l copies region l / 8
// (K half 0, K half 1, V half 0, V half 1) at chunks l % 8 + 8i, and the metadata word of the
// region's token l % 8 (4 bytes; 8 lanes make the half's 32). So a lane needs one page id and
// one 32-bit multiply per tile (page strides are below 2 GiB: the launcher checks), its chunks
// are compile-time offsets from it, and every lane issues the same copies: no predicate or
// branch in the issue (a half past the segment is the same copies reading 0 bytes, which
// zero-fill). (Copying a warp's tiles two at a time, one page lookup per pair, ran 6-12 % fewer
// instructions and was no faster on the H100, slower at B = 1: docs/benchmarks.md.)
template <int D>
struct Int2CopyLane {
  const uint8_t* src;    // the K or V pool of this lane's region, at the block's head and this lane's first chunk
  int32_t stride_page;   // bytes
  int32_t meta_delta;    // bytes from a token's first chunk to this lane's metadata word
  int32_t half_tokens;   // 0 or 8: the tile half this lane copies
  uint32_t code_dst;     // shared address of the first chunk in stage 0
  uint32_t meta_dst;     // shared address of the metadata word in stage 0
};

template <int D>
OSCAR_DEVICE Int2CopyLane<D> int2_copy_lane(const Int2HeadBlocks& blocks, uint32_t stages, int lane) {
  using S = Int2Stage<D>;
  const int region = lane / 8, idx = lane % 8;
  const int tensor = region >> 1;
  const int half = region & 1;
  Int2CopyLane<D> c;
  const int32_t code_src = idx * 16;
  c.src = (tensor == 0 ? blocks.k : blocks.v) + code_src;
  c.stride_page = static_cast<int32_t>(tensor == 0 ? blocks.k_stride_page : blocks.v_stride_page);
  c.half_tokens = 8 * half;
  c.code_dst = stages + tensor * S::kCodes + half * 8 * S::kRowBytes + idx * 16;
  c.meta_dst = stages + S::kKMeta + tensor * 64 + half * 32 + idx * 4;
  c.meta_delta = blocks.meta_offset + idx * 4 - code_src;
  return c;
}

// The page id of this lane's half of `tile` (-1: past the segment or not active), loaded a
// tile ahead of its copies.
template <int D>
OSCAR_DEVICE int32_t copy_page(const SegmentPages& seg, const Int2CopyLane<D>& c, int32_t tile, bool active) {
  const int32_t token = tile * kAttentionTileTokens + c.half_tokens;
  return active && token < seg.tokens ? seg.page_id(token) : -1;
}

// Issues this lane's copies of one tile into stage `stage` and commits a group. A half past the
// segment (page -1; every half of an absent tile) reads nothing and zero-fills: its metadata
// reads as zero, so its p = 0 meets a zero scale and offset (no 0 * stale NaN), and its codes
// are zero.
template <int D>
OSCAR_DEVICE void issue_int2_tile(const Int2CopyLane<D>& c, const SegmentPages& seg, int32_t tile, int32_t page,
                                  uint32_t stage_offset) {
  using S = Int2Stage<D>;
  if (kAttentionProbe != 1) {  // (probe 1, a measurement knob: no copies)
    const bool present = page >= 0;
    const int32_t slot = seg.slot(tile * kAttentionTileTokens + c.half_tokens);
    // Page 0 stands in for an absent half: a valid address, of which nothing is read.
    const uint8_t* src = c.src + mul_wide(max(page, 0), c.stride_page) + slot * S::kRowBytes;
    const uint32_t dst = c.code_dst + stage_offset;
#pragma unroll
    for (int i = 0; i < S::kCodeChunks / 32; ++i) cp_async16_or_zero(dst + 128 * i, src + 128 * i, !present);
    cp_async4_or_zero(c.meta_dst + stage_offset, src + (c.meta_delta - slot * (S::kRowBytes - 4)), !present);
  }
  cp_async_commit();
}

// Shared addresses of this lane's reads of stage 0 (key rows r and r+8 at bytes j·D/16, their
// metadata, value rows 2j, 2j+1, 2j+8, 2j+9 at bytes r·D/32): fixed for the loop, so a stage's
// reads are one add each.
struct Int2ReadLane {
  uint32_t k, meta, v;
};

template <int D>
OSCAR_DEVICE Int2ReadLane int2_read_lane(uint32_t stages, int lane) {
  using S = Int2Stage<D>;
  const int r = lane / 4, j = lane % 4;
  return {stages + r * S::kRowBytes + j * (D / 16), stages + S::kKMeta + 4 * r,
          stages + S::kVCodes + 2 * j * S::kRowBytes + r * Int2TileRaw<D>::kVBytes};
}

// This lane's fragments of a staged tile (the registers int2_tile consumes).
template <int D>
OSCAR_DEVICE void read_int2_tile(Int2TileRaw<D>& raw, const Int2ReadLane& lane_addr, uint32_t stage_offset,
                                 const SegmentPages& seg, int32_t tile) {
  using Raw = Int2TileRaw<D>;
  using S = Int2Stage<D>;
  const int32_t t0 = tile * kAttentionTileTokens;
  raw.valid = min(seg.tokens - t0, kAttentionTileTokens);
  raw.key_position0 = seg.start + t0;
  const uint32_t k = lane_addr.k + stage_offset, meta = lane_addr.meta + stage_offset, v = lane_addr.v + stage_offset;
  // Both halves read unconditionally: an absent half's metadata was zeroed at issue.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const uint32_t kaddr = k + 8 * half * S::kRowBytes;
    if constexpr (Raw::kKWords == 1) {
      raw.kw[half][0] = lds_u32(kaddr);
    } else if constexpr (Raw::kKWords == 2) {
      const uint2 w = lds_v2(kaddr);
      raw.kw[half][0] = w.x, raw.kw[half][1] = w.y;
    } else {
      const uint4 w = lds_v4(kaddr);
      raw.kw[half][0] = w.x, raw.kw[half][1] = w.y, raw.kw[half][2] = w.z, raw.kw[half][3] = w.w;
    }
    raw.kmeta[half] = lds_u32(meta + 32 * half);
    raw.vmeta[half] = lds_u32(meta + 64 + 32 * half);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const uint32_t vaddr = v + (8 * half + t) * S::kRowBytes;
      if constexpr (Raw::kVBytes == 2) {
        raw.vw[2 * half + t][0] = lds_u16(vaddr);
      } else if constexpr (Raw::kVWords == 1) {
        raw.vw[2 * half + t][0] = lds_u32(vaddr);
      } else {
        const uint2 w = lds_v2(vaddr);
        raw.vw[2 * half + t][0] = w.x, raw.vw[2 * half + t][1] = w.y;
      }
    }
  }
}

// The scores' MMAs of one loaded INT2 tile: acc[n][2·half + i] = Σ_c q'·c of key row r + 8·half
// and column 8n + 2j + i, in log2 units before the tile's scale and offset (int2_tile_finish).
// Each k-step's codes are unpacked once for the NT column tiles.
template <int D, int NT>
OSCAR_DEVICE void int2_key_scores(float (&acc)[NT][4], const KeyQueryFragments<D> (&qf)[NT],
                                  const float (&key_bias)[NT][2], const Int2TileRaw<D>& raw) {
  constexpr int kKWords = Int2TileRaw<D>::kKWords;
  const auto& kw = raw.kw;
  // Two accumulators, even and odd k-steps: a single one makes the D/16 MMAs one dependent
  // chain (~30 cycles each), which two resident warps per scheduler cannot hide. The codes
  // enter as 1024 + 4^k·c against q·4^-k, so acc starts at -1024·Σq' of its column
  // (key_bias) to leave exactly Σ q·c.
  float acc_odd[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    acc[n][0] = acc[n][2] = key_bias[n][0];
    acc[n][1] = acc[n][3] = key_bias[n][1];
    acc_odd[n][0] = acc_odd[n][1] = acc_odd[n][2] = acc_odd[n][3] = 0.f;
  }
#pragma unroll
  for (int wi = 0; wi < kKWords; ++wi) {
    const uint32_t lo0 = kw[0][wi], lo1 = kw[1][wi];
    const uint32_t hi0 = lo0 >> 8, hi1 = lo1 >> 8;
#define OSCAR_KSTEP(K, ACC)                                                                         \
  {                                                                                                 \
    const uint32_t a[4] = {unpack_field_biased<K>(lo0), unpack_field_biased<K>(lo1),                \
                           unpack_field_biased<K>(hi0), unpack_field_biased<K>(hi1)};               \
    _Pragma("unroll") for (int n = 0; n < NT; ++n) {                                                \
      const uint2 b = qf[n].get(wi * 4 + K);                                                        \
      mma_f16(ACC[n], a, b.x, b.y);                                                                 \
    }                                                                                               \
  }
    OSCAR_KSTEP(0, acc) OSCAR_KSTEP(1, acc_odd) OSCAR_KSTEP(2, acc) OSCAR_KSTEP(3, acc_odd)
#undef OSCAR_KSTEP
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] += acc_odd[n][e];
  }
}

// Softmax and values of one loaded INT2 tile whose key scores' MMAs are in acc, for each of the
// NT column tiles (kMayMask: softmax_step's). The value codes are unpacked once for all of them.
template <int D, int NT, bool kMayMask>
OSCAR_DEVICE void int2_tile_finish(WarpState<D> (&st)[NT], const float (&acc)[NT][4], const float (&qsum)[NT][2],
                                   const Int2TileRaw<D>& raw, TileContext (&tc)[NT], int lane) {
  constexpr int kUnits = D / 64;  // 16-bit value units per lane per token
  const int r = lane / 4;
  const auto& vw = raw.vw;
  const uint32_t* kmeta = raw.kmeta;
  const uint32_t* vmeta = raw.vmeta;
  float sk[2], ok[2], sv[2], ov[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float2 km = __half22float2(bits_half2(kmeta[half]));  // (scale, offset)
    const float2 vm = __half22float2(bits_half2(vmeta[half]));
    sk[half] = km.x;
    ok[half] = km.y;
    sv[half] = vm.x;
    ov[half] = vm.y;
  }
  uint32_t b0[NT], b1[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    tc[n].valid = raw.valid;
    tc[n].key_position0 = raw.key_position0;
    float s[2][2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i < 2; ++i) s[half][i] = acc[n][2 * half + i] * sk[half] + ok[half] * qsum[n][i];  // q carries scale2
    }
    softmax_step<D, kMayMask>(st[n], s, tc[n], r);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      // Masked keys have p = 0 and metadata 0, so they add nothing (no 0·NaN from unread data).
      st[n].offset[i] += s[0][i] * ov[0] + s[1][i] * ov[1];
    }
    b0[n] = transpose8x8(pack_half2(s[0][0] * sv[0], s[0][1] * sv[0]));
    b1[n] = transpose8x8(pack_half2(s[1][0] * sv[1], s[1][1] * sv[1]));
  }

  // Values: token pairs (2j, 2j+1) and (2j+8, 2j+9) interleaved into one register per unit.
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    uint32_t c01[8], c89[8];  // registers u*8 .. u*8+7 of the two token pairs
    int2_value_codes<D, true>(vw, u, c01, c89);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t a[4] = {c01[2 * q], c01[2 * q + 1], c89[2 * q], c89[2 * q + 1]};
#pragma unroll
      for (int n = 0; n < NT; ++n) mma_f16(st[n].o[u * 4 + q], a, b0[n], b1[n]);
    }
  }
}

// Scores, softmax and values of one loaded INT2 tile, for the NT column tiles.
template <int D, int NT, bool kMayMask>
OSCAR_DEVICE void int2_tile(WarpState<D> (&st)[NT], const KeyQueryFragments<D> (&qf)[NT], const float (&qsum)[NT][2],
                            const float (&key_bias)[NT][2], const Int2TileRaw<D>& raw, TileContext (&tc)[NT],
                            int lane) {
  float acc[NT][4];
  int2_key_scores<D, NT>(acc, qf, key_bias, raw);
  int2_tile_finish<D, NT, kMayMask>(st, acc, qsum, raw, tc, lane);
}

// One BF16 tile (sink, window, or a BF16 cache) for one warp and its NT column tiles. qb holds
// this lane's bf16 fragments of q: [column tile][k-step][lane] {hi b0b1, hi b2b3, lo b0b1, lo
// b2b3}, at qb[(n·D/16 + s)·32]. subnormal_units: the block also reads INT2 values, whose
// accumulators are in value_field_unit units, so these values are scaled to them (exact powers
// of two). The tile's keys and values are loaded once for the NT column tiles.
template <int D, int NT>
OSCAR_DEVICE void bf16_tile(WarpState<D> (&st)[NT], const uint4* qb, const Bf16PoolRef& kpool, const Bf16PoolRef& vpool,
                            int32_t head, const TileHalves& th, const TileContext (&tc)[NT], float scale2,
                            bool subnormal_units, int lane) {
  constexpr int kVWords = D / 64;  // words per load of D/32 channels
  const int r = lane / 4;
  const int valid = tc[0].valid;
  uint4 krow[2][D / 32];
  load_bf16_keys<D>(kpool, head, th, valid, lane, krow);
  // Values: channels value_channel(r, ·) of tokens 2j, 2j+1, 2j+8, 2j+9.
  uint32_t vw[4][4][kVWords];
  load_bf16_values<D>(vpool, head, th, valid, lane, vw);
  uint32_t b0[NT], b1[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float acc_lo[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      const uint4 r0 = krow[0][s / 2], r1 = krow[1][s / 2];
      const uint32_t a[4] = {s % 2 ? r0.z : r0.x, s % 2 ? r1.z : r1.x, s % 2 ? r0.w : r0.y, s % 2 ? r1.w : r1.y};
      const uint4 q = qb[(n * (D / 16) + s) * 32];
      mma_bf16(acc, a, q.x, q.y);     // q's bf16 high parts
      mma_bf16(acc_lo, a, q.z, q.w);  // and its low parts: a second, independent MMA chain
    }
    float sc[2][2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i < 2; ++i) sc[half][i] = (acc[2 * half + i] + acc_lo[2 * half + i]) * scale2;
    }
    softmax_step<D>(st[n], sc, tc[n], r);
    b0[n] = transpose8x8(pack_bf16x2(sc[0][0], sc[0][1]));
    b1[n] = transpose8x8(pack_bf16x2(sc[1][0], sc[1][1]));
  }
#pragma unroll
  for (int wi = 0; wi < kVWords; ++wi) {
    uint32_t c01[8], c89[8];
    bf16_value_pairs<D>(vw, wi, c01, c89);
    if (subnormal_units) {  // the block's INT2 values accumulate in 4^k·2^-24 units (int2_tile)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const __nv_bfloat162 unit = __float2bfloat162_rn(value_field_unit(value_field(i)));  // exact
        c01[i] = bf16x2_bits(__hmul2(bits_bf16x2(c01[i]), unit));
        c89[i] = bf16x2_bits(__hmul2(bits_bf16x2(c89[i]), unit));
      }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t a[4] = {c01[2 * q], c01[2 * q + 1], c89[2 * q], c89[2 * q + 1]};
#pragma unroll
      for (int n = 0; n < NT; ++n) mma_bf16(st[n].o[wi * 4 + q], a, b0[n], b1[n]);
    }
  }
}

// Calls f<NC>() with NC = C / 2 when the block's valid columns fit (4 of 8 at a GQA group of
// 4, the headline shape), else C (the block's C = 8·NT columns): the rotations then only work
// on columns that exist.
template <int C, class F>
OSCAR_DEVICE void with_column_count(int valid_cols, F&& f) {
  if (valid_cols <= C / 2) {
    f.template operator()<C / 2>();
  } else {
    f.template operator()<C>();
  }
}

// q_rot[c] = q_in[c]·R (rows [C][D] float in shared memory) for columns c < NC; the other
// columns of q_rot are zeroed, as q_in's are. Thread i owns channel i of every column: four
// rows of R per step and q read as float4 (one shared load per column and 4 channels), ~11
// instructions per channel instead of ~27 with a load per product.
template <int D, int NC, int C, int kThreads>
OSCAR_DEVICE void rotate_query_columns(const float* q_in, const float* rotation, float* q_rot, int tid) {
  for (int i = tid; i < D; i += kThreads) {
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    // 64 rows of R in flight per batch: the prologue of every block waits on these L2 reads.
    constexpr int kBatch = D < 64 ? D : 64;
    for (int k0 = 0; k0 < D; k0 += kBatch) {
      float rk[kBatch];
#pragma unroll
      for (int kk = 0; kk < kBatch; ++kk) rk[kk] = __ldg(rotation + (k0 + kk) * D + i);
#pragma unroll
      for (int kk = 0; kk < kBatch; kk += 4) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const float4 qv = *reinterpret_cast<const float4*>(q_in + c * D + k0 + kk);
          acc[c] = fmaf(qv.x, rk[kk], acc[c]);
          acc[c] = fmaf(qv.y, rk[kk + 1], acc[c]);
          acc[c] = fmaf(qv.z, rk[kk + 2], acc[c]);
          acc[c] = fmaf(qv.w, rk[kk + 3], acc[c]);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < C; ++c) q_rot[c * D + i] = c < NC ? acc[c] : 0.0f;
  }
}

// The block's output rows, columns c < valid_cols <= NC of final_o ([C][D] float in shared
// memory): un-rotated by R_Vᵀ (o·R_Vᵀ: out_i = Σ_k o_k R_ik) unless the engine folds it, rounded
// to bf16.
// The un-rotation reads R by rows, 8 lanes per row: each load of a warp is 4 whole 128-byte
// lines (a thread per row made every load touch 32 lines, and the L1 serves a load a line at a
// time: ~3 us of the serial tail at d = 128, H200). Lane li of a row covers the float4 chunks
// li, li + 8, ... of k; the 8 partial sums of a row meet by shuffles.
template <int D, int NC, int kThreads>
OSCAR_DEVICE void write_output_columns(const float* final_o, const PagedAttentionParams& p, int32_t q_begin, int col0,
                                       int valid_cols, int g, int32_t head, int tid) {
  auto store = [&](int c, int i, float v) {
    const int64_t row = query_row(q_begin, col0 + c, g, p.num_qo_heads, head);
    reinterpret_cast<__nv_bfloat16*>(p.out)[row * D + i] = __float2bfloat16_rn(v);
  };
  if (!p.output_unrotation) {
    for (int i = tid; i < D; i += kThreads) {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        if (c < valid_cols) store(c, i, final_o[c * D + i]);
      }
    }
    return;
  }
  constexpr int kRowsPerWarp = D / (kThreads / 32);
  constexpr int kSteps = D / 32;  // float4 chunks of a row per lane
  // 16 float4 loads in flight per lane (8 at d = 256, whose kernel then spilled ~400 bytes).
  constexpr int kInFlight = D == 256 ? 8 : 16;
  constexpr int kGroups = std::min(std::max(kInFlight / kSteps, 1), kRowsPerWarp / 4);  // 4-row groups per batch
  static_assert(kRowsPerWarp % (4 * kGroups) == 0);
  const int warp = tid / 32, lane = tid % 32, rr = lane / 8, li = lane % 8;
  const float4* rotation = reinterpret_cast<const float4*>(p.output_unrotation);
  const uint32_t o_lane = smem_address(final_o) + 16 * li;  // this lane's first float4 of column 0
#pragma unroll 1
  for (int r0 = warp * kRowsPerWarp; r0 < (warp + 1) * kRowsPerWarp; r0 += 4 * kGroups) {
    float4 rv[kGroups][kSteps];  // a batch's loads, all in flight
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
#pragma unroll
      for (int st = 0; st < kSteps; ++st) rv[gi][st] = __ldg(rotation + (r0 + 4 * gi + rr) * (D / 4) + li + 8 * st);
    }
#pragma unroll
    for (int gi = 0; gi < kGroups; ++gi) {
      float part[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        part[c] = 0.0f;
#pragma unroll
        for (int st = 0; st < kSteps; ++st) {
          // (volatile shared loads: as plain loads the compiler kept all NC·kSteps of them live
          // across the groups, 64 registers, and the kernel spilled)
          const uint4 o = lds_v4(o_lane + 16 * (c * (D / 4) + 8 * st));
          part[c] = fmaf(__uint_as_float(o.x), rv[gi][st].x, part[c]);
          part[c] = fmaf(__uint_as_float(o.y), rv[gi][st].y, part[c]);
          part[c] = fmaf(__uint_as_float(o.z), rv[gi][st].z, part[c]);
          part[c] = fmaf(__uint_as_float(o.w), rv[gi][st].w, part[c]);
        }
#pragma unroll
        for (int m = 1; m < 8; m *= 2) part[c] += __shfl_xor_sync(kFullMask, part[c], m);
      }
      // Every lane of the row now holds all NC sums; lane li stores column li.
      float v = 0.0f;
#pragma unroll
      for (int c = 0; c < NC; ++c) v = li == c ? part[c] : v;
      if (li < NC && li < valid_cols) store(li, r0 + 4 * gi + rr, v);
    }
  }
}

// Shared memory of one block (dynamic), C = 8·NT columns. The q buffers are dead once the
// fragments are built, so the warps' partial outputs reuse them.
template <int D, int NT = 1>
struct SharedLayout {
  static constexpr int kWarps = KernelConfig<D, NT>::kWarps;
  static constexpr int C = kCols * NT;
  // The INT2 stages are filled from the start (their first tiles are issued before q is
  // read), so q's buffers lie outside them: q_in in final_o, dead until the warps merge.
  static constexpr size_t warp_o = 0;                                  // float [warps][C][D], after the loop
  static constexpr size_t int2_stages = 0;  // [warps][kInt2Stages][Int2Stage<D>::kBytes], until the loop ends
  static constexpr size_t stage_bytes = size_t{kWarps} * kInt2Stages * Int2Stage<D>::kBytes;
  static constexpr size_t region_a = std::max(sizeof(float) * C * D * kWarps, stage_bytes);
  static constexpr size_t q_frag = region_a;                           // uint4 [NT][D/16][32]
  static constexpr size_t final_o = q_frag + sizeof(uint4) * NT * (D / 16) * 32;  // float [C][D]
  static constexpr size_t q_in = final_o;                              // float [C][D], the prologue only
  static constexpr size_t q_rot = final_o + sizeof(float) * C * D;     // float [C][D], the prologue only
  static constexpr size_t stats = q_rot + sizeof(float) * C * D;       // float [3][warps][C] + [C]
  static constexpr size_t key_q_frag = stats + sizeof(float) * (3 * kWarps * C + C) + 16;  // uint2 [NT][D/16][32]
  static constexpr size_t key_q_frag_bytes =
      KernelConfig<D, NT>::kQueryFragmentsShared ? sizeof(uint2) * NT * (D / 16) * 32 : 0;
  static constexpr size_t bytes = key_q_frag + key_q_frag_bytes;
  static_assert(kMaxAttentionChunks * C <= kWarps * C * D, "merge weights reuse warp_o");
};

struct KernelArgs {
  PagedAttentionParams p;
  const AttentionWorkItem* items;
  int32_t* counters;
  float* partial_o;
  float* partial_lse;  // base 2
  int32_t group_size;
  float scale2;  // sm_scale·log2(e)
  bool decode;
};

// NT column tiles of 8 per block (KernelConfig): C = 8·NT (query token, query head) columns of
// one KV head share every pass over the keys.
template <int D, int NT>
__global__ void __launch_bounds__(KernelConfig<D, NT>::kThreads, KernelConfig<D, NT>::kMinBlocks)
    paged_attention_kernel(const KernelArgs args) {
  constexpr int kWarps = KernelConfig<D, NT>::kWarps;
  constexpr int kThreads = KernelConfig<D, NT>::kThreads;
  constexpr int C = kCols * NT;
  using L = SharedLayout<D, NT>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* q_in = reinterpret_cast<float*>(smem + L::q_in);
  float* q_rot = reinterpret_cast<float*>(smem + L::q_rot);
  float* warp_o = reinterpret_cast<float*>(smem + L::warp_o);
  uint4* q_frag = reinterpret_cast<uint4*>(smem + L::q_frag);
  float* final_o = reinterpret_cast<float*>(smem + L::final_o);
  float* warp_m = reinterpret_cast<float*>(smem + L::stats);
  float* warp_l = warp_m + kWarps * C;
  float* warp_off = warp_l + kWarps * C;
  float* final_lse = warp_off + kWarps * C;
  __shared__ int is_last_block;

  const PagedAttentionParams& p = args.p;
  const PagedKvRef& kv = p.kv;
  const int item_index = blockIdx.x;
  const AttentionWorkItem item = args.items[item_index];
  const int32_t head = blockIdx.y;
  const int32_t num_kv_heads = gridDim.y;
  const int32_t b_req = item.request;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int g = args.group_size;
  timeline_mark(kMarkStart);

  const int32_t q_begin = args.decode ? b_req : p.qo_indptr[b_req];
  const int32_t n_q = args.decode ? 1 : p.qo_indptr[b_req + 1] - q_begin;
  const int col0 = item.column_tile * C;
  const int valid_cols = min(C, n_q * g - col0);
  // q's 16-byte loads (8 channels each; the launcher checks q's alignment) go out first: the
  // page-table walk and the INT2 copies below then queue behind them, not they behind them.
  constexpr int kQLoads = (C * D / 8 + kThreads - 1) / kThreads;  // per thread
  uint4 q_raw[kQLoads];
#pragma unroll
  for (int e = 0; e < kQLoads; ++e) {
    const int idx = tid + e * kThreads, q_col = idx / (D / 8), q_ch = (idx % (D / 8)) * 8;
    q_raw[e] = make_uint4(0, 0, 0, 0);
    if (idx < C * D / 8 && q_col < valid_cols) {
      const int64_t row = query_row(q_begin, col0 + q_col, g, p.num_qo_heads, head);
      q_raw[e] = __ldg(reinterpret_cast<const uint4*>(p.q + row * D + q_ch));
    }
  }

  // R_Vᵀ is read in the tail of the request's last block, after the loop: each chunk's block
  // asks L2 for its share of R_V's lines now, so that tail finds them there, not in DRAM.
  if (p.output_unrotation) {
    constexpr int kLines = D * D * int(sizeof(float)) / 128;
    const int chunk = item_index - item.first_item;
    const int first = chunk * kLines / item.num_chunks, last = (chunk + 1) * kLines / item.num_chunks;
    for (int line = first + tid; line < last; line += kThreads) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(p.output_unrotation) + 128 * line));
    }
  }

  // Each segment's pages resolved once (no per-tile table walks, no local arrays).
  const SegmentPages sink = segment_pages(kv.sink, b_req, 0);
  const SegmentPages body = segment_pages(kv.int2, b_req, sink.tokens);
  const SegmentPages recent = segment_pages(kv.recent, b_req, sink.tokens + body.tokens);

  // 0. The chunk's first kInt2Stages INT2 tiles per warp are issued before anything else, so
  // their DRAM latency overlaps q's load and rotation and the sink's BF16 tiles.
  const int32_t sink_tiles = static_cast<int32_t>(attention_tiles(sink.tokens));
  const int32_t body_tiles = static_cast<int32_t>(attention_tiles(body.tokens));
  int32_t body_begin, body_end;
  chunk_tile_range(item, body, sink_tiles, body_begin, body_end);
  using S = Int2Stage<D>;
  const uint32_t stages = smem_address(smem + L::int2_stages + warp * (kInt2Stages * S::kBytes));
  if constexpr (kAttentionProbe == 1) {
    for (uint32_t b = 16 * lane; b < kInt2Stages * S::kBytes; b += 16 * 32) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(stages + b), "r"(0u) : "memory");
    }
    __syncwarp();
  }
  if (body_begin < body_end) {
    // (The copy lane is built again for the loop: kept live through the prologue and the BF16
    // tiles, its registers made the loop spill.)
    const Int2CopyLane<D> copy = int2_copy_lane<D>(int2_head_blocks(kv.k_int2, kv.v_int2, head), stages, lane);
#pragma unroll
    for (int k = 0; k < kInt2Stages; ++k) {
      const int32_t t = body_begin + warp + k * kWarps;
      issue_int2_tile<D>(copy, body, t, copy_page<D>(body, copy, t, t < body_end), k * S::kBytes);
    }
  }

  timeline_mark(kMarkIssued);
  // 1. q of the block's columns (loaded above), rotated into the keys' basis.
#pragma unroll
  for (int e = 0; e < kQLoads; ++e) {
    const int idx = tid + e * kThreads, q_col = idx / (D / 8), q_ch = (idx % (D / 8)) * 8;
    if (idx < C * D / 8) {
      float v[8];
      bf16x8_to_float(q_raw[e], v);
      *reinterpret_cast<float4*>(q_in + q_col * D + q_ch) = make_float4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<float4*>(q_in + q_col * D + q_ch + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
  }
  __syncthreads();
  const float* q_basis = q_in;
  timeline_mark(kMarkQLoaded);
  if (p.q_rotation) {
    with_column_count<C>(valid_cols, [&]<int NC>() {
      rotate_query_columns<D, NC, C, kThreads>(q_in, p.q_rotation, q_rot, tid);
    });
    __syncthreads();
    q_basis = q_rot;
  }
  timeline_mark(kMarkRotated);

  // 2. This lane's fragments, per column tile n (columns 8n..8n+7): fp16 q for INT2 keys
  // (registers), bf16 hi/lo for BF16 keys (smem).
  const int r = lane / 4, j = lane % 4;
  KeyQueryFragments<D> qf[NT];
  float key_bias[NT][2];
  float qsum[NT][2];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    uint32_t frag[D / 16][2];
    float q_part = 0.0f;  // Σ of column 8n + r's float q over this lane's channels (a quarter of them)
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      const int wi = s / 4, k = s % 4;
      const int ch = j * (D / 16) + 4 * wi + k * (D / 4);
      const float4 qv = *reinterpret_cast<const float4*>(q_basis + (8 * n + r) * D + ch);  // column 8n + lane/4
      // k-step s meets code field k (the 4^-k is exact); sm_scale·log2(e) is folded in here, so
      // the scores leave the MMA in log2 units.
      const float inv = args.scale2 / float(1 << (2 * k));
      frag[s][0] = pack_half2(qv.x * inv, qv.z * inv);
      frag[s][1] = pack_half2(qv.y * inv, qv.w * inv);
      q_part += (qv.x + qv.y) + (qv.z + qv.w);
    }
    if constexpr (KeyQueryFragments<D>::kShared) {
      uint2* shared = reinterpret_cast<uint2*>(smem + L::key_q_frag) + n * (D / 16) * 32;
      if (warp == 0) {  // every warp's lanes hold the same fragments
#pragma unroll
        for (int s = 0; s < D / 16; ++s) shared[s * 32 + lane] = make_uint2(frag[s][0], frag[s][1]);
      }
      qf[n].shared = shared + lane;  // read after the __syncthreads below
    } else {
#pragma unroll
      for (int s = 0; s < D / 16; ++s) qf[n].reg[s][0] = frag[s][0], qf[n].reg[s][1] = frag[s][1];
    }
    // -1024·Σ q' over column r's fp16 fragments (this lane's channels, then its 4 lanes), then
    // fetched for this lane's accumulator columns 2j, 2j+1: the key MMAs' starting value.
    {
      float part = 0.0f;
#pragma unroll
      for (int s = 0; s < D / 16; ++s) {
        const float2 a = __half22float2(bits_half2(frag[s][0])), b = __half22float2(bits_half2(frag[s][1]));
        part += (a.x + a.y) + (b.x + b.y);
      }
      part += __shfl_xor_sync(kFullMask, part, 1);
      part += __shfl_xor_sync(kFullMask, part, 2);
      key_bias[n][0] = -1024.0f * __shfl_sync(kFullMask, part, 4 * (2 * j));
      key_bias[n][1] = -1024.0f * __shfl_sync(kFullMask, part, 4 * (2 * j + 1));
    }
    // Σ q·sm_scale·log2(e) of this lane's accumulator columns 2j, 2j+1, for the keys' offsets:
    // the lanes' quarters summed over the 4 lanes of a column, as for key_bias (a serial walk
    // over the D channels here was ~4.6 us of every block's prologue at d = 128, H200).
    {
      q_part += __shfl_xor_sync(kFullMask, q_part, 1);
      q_part += __shfl_xor_sync(kFullMask, q_part, 2);
      qsum[n][0] = args.scale2 * __shfl_sync(kFullMask, q_part, 4 * (2 * j));
      qsum[n][1] = args.scale2 * __shfl_sync(kFullMask, q_part, 4 * (2 * j + 1));
    }
  }
  // q_frag[n][s][lane]: column tile n's bf16 hi/lo fragments for the BF16 tiles.
  for (int idx = tid; idx < NT * (D / 16) * 32; idx += kThreads) {
    const int n = idx / ((D / 16) * 32), s = idx / 32 % (D / 16), ln = idx % 32;
    const int col = 8 * n + ln / 4, jj = ln % 4;
    const int ch = (s / 2) * 32 + 8 * jj + 4 * (s % 2);
    const float* qn = q_basis + col * D + ch;
    float hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      hi[e] = __bfloat162float(__float2bfloat16_rn(qn[e]));
      lo[e] = qn[e] - hi[e];
    }
    q_frag[idx] = make_uint4(pack_bf16x2(hi[0], hi[1]), pack_bf16x2(hi[2], hi[3]), pack_bf16x2(lo[0], lo[1]),
                             pack_bf16x2(lo[2], lo[3]));
  }
  timeline_mark(kMarkFragments);
  // The queries' positions, for the causal mask of an extend; a decode never masks, so it
  // skips them (their first use waited on the recent table's loads before the barrier below).
  TileContext tc[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    tc[n].causal = !args.decode;
    tc[n].q_pos[0] = tc[n].q_pos[1] = INT32_MAX;
  }
  int32_t keys_seen_by_all = INT32_MAX;  // keys at positions below this are visible to every column
  if (!args.decode) {
    const int32_t length = recent.start + recent.tokens;
    keys_seen_by_all = length - n_q + col0 / g + 1;  // the block's first column has the earliest query
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int c = 8 * n + 2 * j + i;
        if (c < valid_cols) tc[n].q_pos[i] = length - n_q + (col0 + c) / g;
      }
    }
  }
  __syncthreads();  // q_frag ready; q_in / q_rot are dead from here
  timeline_mark(kMarkLoopStart);

  // 3. The chunk's tiles, every 8th one per warp, segment by segment (tiles are numbered over
  // the sink, INT2 and recent segments in order).
  WarpState<D> st[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) st[n].o[mt][0] = st[n].o[mt][1] = st[n].o[mt][2] = st[n].o[mt][3] = 0.0f;
    st[n].m[0] = st[n].m[1] = kNoKeyMax;
    st[n].l[0] = st[n].l[1] = 0.0f;
    st[n].offset[0] = st[n].offset[1] = 0.0f;
  }
  const float scale2 = args.scale2;
  const bool subnormal_units = body_begin < body_end;  // value_field_unit: the block reads INT2 values
  auto bf16_segment = [&](const SegmentPages& seg, int32_t first_tile) {
    int32_t begin, end;
    chunk_tile_range(item, seg, first_tile, begin, end);
    for (int32_t t = begin + warp; t < end; t += kWarps) {
      const int32_t t0 = t * kAttentionTileTokens;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        tc[n].key_position0 = seg.start + t0;
        tc[n].valid = min(seg.tokens - t0, kAttentionTileTokens);
      }
      const TileHalves th = locate_tile(seg, t0);
      bf16_tile<D, NT>(st, q_frag + lane, kv.k_bf16, kv.v_bf16, head, th, tc, scale2, subnormal_units, lane);
    }
  };
  bf16_segment(sink, 0);
  {
    const int32_t begin = body_begin, end = body_end;
    if (begin < end) {
      // kInt2Stages tiles per warp (issued at 0.): wait for the oldest, compute it, refill its stage.
      const Int2CopyLane<D> copy = int2_copy_lane<D>(int2_head_blocks(kv.k_int2, kv.v_int2, head), stages, lane);
      const Int2ReadLane read_lane = int2_read_lane<D>(stages, lane);
      int32_t next = begin + warp + kInt2Stages * kWarps;  // the next tile to issue
      int32_t next_page = copy_page<D>(body, copy, next, next < end);
      // (Reading the next tile's fragments one tile ahead into registers measured 3 % slower
      // on the H200: more registers and moves for latency the other warps already hide.)
      uint32_t stage_offset = 0;  // bytes of the oldest stage from the first
      auto read_and_refill = [&](Int2TileRaw<D>& raw, int32_t tile) {
        cp_async_wait<kInt2Stages - 1>();
        __syncwarp();  // every lane's copies of this tile are visible
        read_int2_tile<D>(raw, read_lane, stage_offset, body, tile);
        __syncwarp();  // every lane has read the stage before it is refilled
        issue_int2_tile<D>(copy, body, next, next_page, stage_offset);
        next += kWarps;
        next_page = copy_page<D>(body, copy, next, next < end);
        stage_offset = stage_offset == (kInt2Stages - 1) * S::kBytes ? 0 : stage_offset + S::kBytes;
      };
      Int2TileRaw<D> cur;
      // Tiles below full_end are whole and every column sees all their keys, so they skip the
      // mask test; only a segment's last tile, or the tiles an extend's causal mask reaches,
      // run it. (Two copies of the tile's code, one loop each: a uniform test inside one loop
      // costs a branch and its reconvergence per tile.)
      const int32_t full_end =
          min(end, min(body.tokens, keys_seen_by_all - body.start) / kAttentionTileTokens);
      int32_t t = begin + warp;
      for (; t < full_end; t += kWarps) {
        read_and_refill(cur, t);
        if constexpr (kAttentionProbe != 2) int2_tile<D, NT, false>(st, qf, qsum, key_bias, cur, tc, lane);
      }
      for (; t < end; t += kWarps) {
        read_and_refill(cur, t);
        if constexpr (kAttentionProbe != 2) int2_tile<D, NT, true>(st, qf, qsum, key_bias, cur, tc, lane);
      }
      cp_async_wait<0>();  // no copy may land after the stages are reused below
    }
  }
  bf16_segment(recent, sink_tiles + body_tiles);
  timeline_mark(kMarkLoopEnd);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    if (subnormal_units) to_value_units_of_one<D>(st[n].o);
  }

  // 4. Merge the warps: sums over the 8 lanes of a column, then across warps in smem.
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int mask = 4; mask <= 16; mask *= 2) {
        st[n].l[i] += __shfl_xor_sync(kFullMask, st[n].l[i], mask);
        st[n].offset[i] += __shfl_xor_sync(kFullMask, st[n].offset[i], mask);
      }
    }
    if (r == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        warp_m[warp * C + 8 * n + 2 * j + i] = st[n].m[i];
        warp_l[warp * C + 8 * n + 2 * j + i] = st[n].l[i];
        warp_off[warp * C + 8 * n + 2 * j + i] = st[n].offset[i];
      }
    }
  }
  __syncthreads();  // every warp is done with its INT2 stages, which warp_o overlays
  float* my_o = warp_o + warp * C * D;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      const int ch_lo = value_channel<D>(r, 2 * mt);
      const int ch_hi = value_channel<D>(r, 2 * mt + 1);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        my_o[(8 * n + 2 * j + i) * D + ch_lo] = st[n].o[mt][i];
        my_o[(8 * n + 2 * j + i) * D + ch_hi] = st[n].o[mt][2 + i];
      }
    }
  }
  // Each column's warp weights once, in place (thread c owns column c's stats): warp_l becomes
  // e_w / Σ e_w·l_w, warp_off[c] the merged offset term, so the elements below are plain
  // weighted sums (an exp2 and a division per element and warp were ~1 us of the tail).
  if (tid < C) {
    const int c = tid;
    float m = kNoKeyMax;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_m[w * C + c]);
    float e[kWarps], sum = 0.0f, off = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {  // an empty warp state: weight 0, or 1 on zero sums
      e[w] = exp2f(warp_m[w * C + c] - m);
      sum += e[w] * warp_l[w * C + c];
      off += e[w] * warp_off[w * C + c];
    }
    const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) warp_l[w * C + c] = e[w] * inv;
    warp_off[c] = off * inv;
    final_lse[c] = sum == 0.0f ? -INFINITY : m + log2f(sum);
  }
  __syncthreads();
  for (int idx = tid; idx < C * D; idx += kThreads) {
    const int c = idx / D;
    float o = warp_off[c];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o = fmaf(warp_l[w * C + c], warp_o[(w * C) * D + idx], o);
    final_o[idx] = final_lse[c] == -INFINITY ? 0.0f : o;  // no key: 0; a NaN of a seen key stays NaN
  }
  __syncthreads();

  timeline_mark(kMarkWarpsMerged);
  // 5. Split requests: publish the partial state; the last block to arrive merges them all.
  if (item.num_chunks > 1) {
    const size_t slot = size_t(item_index) * num_kv_heads + head;
    for (int idx = tid; idx < valid_cols * D; idx += kThreads) args.partial_o[slot * C * D + idx] = final_o[idx];
    if (tid < C) args.partial_lse[slot * C + tid] = final_lse[tid];
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      int32_t* counter = args.counters + size_t(item.counter) * num_kv_heads + head;
      const int arrived = atomicAdd(counter, 1);
      is_last_block = arrived == item.num_chunks - 1;
      if (is_last_block) *counter = 0;  // ready for the next run (CUDA-graph replay)
    }
    __syncthreads();
    if (!is_last_block) {
      timeline_mark(kMarkPublished);
      return;
    }
    __threadfence();
    // Weights of the chunks per column, in parallel: w[k][c] = exp2(lse_k - max) / Σ. The lse
    // loads all go out at once (one L2 round trip).
    float* w = warp_o;  // dead since step 4; kMaxChunks x C floats
    const int chunks = item.num_chunks;
    constexpr int kLsePerThread = (kMaxAttentionChunks * C + kThreads - 1) / kThreads;
    float lse_k[kLsePerThread];
#pragma unroll
    for (int e = 0; e < kLsePerThread; ++e) {
      const int idx = tid + e * kThreads;
      const size_t s2 = size_t(item.first_item + idx / C) * num_kv_heads + head;
      lse_k[e] = idx < chunks * C ? __ldcg(args.partial_lse + s2 * C + idx % C) : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < kLsePerThread; ++e) {
      if (tid + e * kThreads < chunks * C) w[tid + e * kThreads] = lse_k[e];
    }
    __syncthreads();
    chunk_merge_weights<C>(w, final_lse, chunks, tid, kThreads);
    const float* base = args.partial_o + (size_t(item.first_item) * num_kv_heads + head) * C * D;
    const size_t stride = size_t(num_kv_heads) * C * D;  // one chunk further
    with_column_count<C>(valid_cols, [&]<int NC>() {
      // Loads in flight: 64, or 32 where the kernel runs in 128 registers (d = 64: 64 spilled).
      constexpr int kInFlight = KernelConfig<D>::kMinBlocks >= 4 ? 32 : 64;
      merge_chunk_outputs<D, NC, C, kThreads, kInFlight>(base, stride, w, chunks, valid_cols, final_o, tid);
    });
    __syncthreads();
  }

  timeline_mark(kMarkChunksMerged);
  // 6. Output: un-rotate by R_Vᵀ (o·R_Vᵀ: out_i = Σ_k o_k R_ik), round to bf16.
  // (8 columns at a time: all 16 of a paired tile at once kept 16 sums and 16 of R's float4
  // live per lane, and the kernel spilled ~1 KB.)
  with_column_count<C>(valid_cols, [&]<int NC>() {
#pragma unroll 1
    for (int c0 = 0; c0 < NC; c0 += kCols) {
      write_output_columns<D, std::min(NC, kCols), kThreads>(final_o + c0 * D, p, q_begin, col0 + c0, valid_cols - c0,
                                                             g, head, tid);
    }
  });
  if (p.lse && tid < valid_cols) {
    const int gc = col0 + tid;
    const int64_t row = query_row(q_begin, gc, g, p.num_qo_heads, head);
    p.lse[row] = final_lse[tid] * kLn2;
  }
  timeline_mark(kMarkEnd);
}

template <class Launch>
Status dispatch_head_dim(int head_dim, Launch&& launch) {
  switch (head_dim) {
    case 64: return launch.template operator()<64>();
    case 128: return launch.template operator()<128>();
    case 256: return launch.template operator()<256>();
    default: return unsupported("head_dim " + std::to_string(head_dim) + " is not supported (64, 128, 256)");
  }
}

struct WorkspaceParts {
  AttentionWorkItem* items;
  int32_t* counters;
  float* partial_o;
  float* partial_lse;
  float* rotated_q;  // row-tiled plans only
};

inline WorkspaceParts workspace_parts(const AttentionPlan& plan, void* workspace) {
  auto* base = static_cast<unsigned char*>(workspace);
  WorkspaceParts w;
  w.items = reinterpret_cast<AttentionWorkItem*>(base);
  w.counters = reinterpret_cast<int32_t*>(base + plan.items_bytes());
  w.partial_o = reinterpret_cast<float*>(base + plan.items_bytes() + plan.counters_bytes());
  w.partial_lse = reinterpret_cast<float*>(base + plan.items_bytes() + plan.counters_bytes() + plan.partial_o_bytes());
  w.rotated_q = plan.row_tiled() ? reinterpret_cast<float*>(base + plan.items_bytes() + plan.counters_bytes() +
                                                            plan.partial_o_bytes() + plan.partial_lse_bytes())
                                 : nullptr;
  return w;
}

// Launches the kernels of one plan part (row-tiled: the q rotation, the extend kernel and its
// merge; else the decode kernel with one or two column tiles per pass), its arguments checked
// by paged_attention.
inline Status launch_plan(const AttentionPlan& plan, const PagedAttentionParams& params, void* workspace,
                          cudaStream_t stream) {
  if (plan.items.empty()) return Status::Ok();
  const AttentionShape& shape = plan.shape;
  const WorkspaceParts w = workspace_parts(plan, workspace);
  KernelArgs args;
  args.p = params;
  args.items = w.items;
  args.counters = w.counters;
  args.partial_o = w.partial_o;
  args.partial_lse = w.partial_lse;
  args.group_size = shape.group_size();
  const float sm_scale = params.sm_scale > 0.0f ? params.sm_scale : 1.0f / std::sqrt(float(shape.head_dim));
  args.scale2 = sm_scale * kLog2e;
  args.decode = plan.decode;
  if (plan.row_tiled()) {
    // Row-tiled extend: rotate q once, attend per (row tile, chunk), merge and un-rotate.
    ExtendArgs ea;
    ea.p = params;
    ea.items = w.items;
    ea.partial_o = w.partial_o;
    ea.partial_lse = w.partial_lse;
    ea.rotated_q = params.q_rotation ? w.rotated_q : nullptr;
    ea.group_size = args.group_size;
    ea.scale2 = args.scale2;
    return dispatch_head_dim(shape.head_dim, [&]<int D>() -> Status {
      if constexpr (D > kAttentionRowTiledMaxHeadDim) {
        return unsupported("paged_attention: row-tiled extend plans need head_dim <= " +
                           std::to_string(kAttentionRowTiledMaxHeadDim));
      } else {
        // The extend grid starts as the programmatic dependent of the rotation (its page-table
        // walk under the rotation's tail) and the merge as that of the extend grid (R_V staged
        // under its last wave); each waits in the kernel before reading its predecessor's output.
        const int64_t rows = plan.num_query_tokens * shape.num_qo_heads;
        const bool rotated = params.q_rotation && rows > 0;
        if (rotated) {
          const unsigned blocks = static_cast<unsigned>((rows + kRotateRows - 1) / kRotateRows);
          const size_t rotate_smem = RotateLayout<D>::bytes;
          OSCAR_RETURN_IF_ERROR(cuda_status(opt_in_dynamic_shared_memory(rotate_queries_kernel<D>, int(rotate_smem)),
                                            "paged_attention: query rotation shared memory attribute"));
          rotate_queries_kernel<D><<<blocks, kRotateThreads, rotate_smem, stream>>>(params.q, params.q_rotation, rows,
                                                                                   w.rotated_q);
          OSCAR_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "paged_attention: query rotation launch"));
        }
        const size_t smem = ExtendLayout<D>::bytes;
        OSCAR_RETURN_IF_ERROR(cuda_status(
            opt_in_dynamic_shared_memory(extend_attention_kernel<D>, int(smem)),
            "paged_attention: extend shared memory attribute"));
        const dim3 grid(static_cast<unsigned>(plan.items.size()), static_cast<unsigned>(shape.num_kv_heads));
        OSCAR_RETURN_IF_ERROR(cuda_status(
            launch_maybe_programmatic(rotated, extend_attention_kernel<D>, grid, dim3(kExtendThreads), smem, stream, ea),
            "paged_attention: extend launch"));
        const dim3 merge_grid(grid.x, grid.y, kExtendRows / kMergeRows);
        const size_t merge_smem = MergeLayout<D>::bytes;
        OSCAR_RETURN_IF_ERROR(cuda_status(
            opt_in_dynamic_shared_memory(extend_merge_kernel<D>, int(merge_smem)),
            "paged_attention: extend merge shared memory attribute"));
        OSCAR_RETURN_IF_ERROR(cuda_status(
            launch_maybe_programmatic(true, extend_merge_kernel<D>, merge_grid, dim3(kMergeThreads), merge_smem, stream, ea),
            "paged_attention: extend merge launch"));
        return Status::Ok();
      }
    });
  }
  auto launch = [&]<int D, int NT>() -> Status {
    const size_t smem = SharedLayout<D, NT>::bytes;
    OSCAR_RETURN_IF_ERROR(cuda_status(
        opt_in_dynamic_shared_memory(paged_attention_kernel<D, NT>, int(smem)),
        "paged_attention: shared memory attribute"));
    const dim3 grid(static_cast<unsigned>(plan.items.size()), static_cast<unsigned>(shape.num_kv_heads));
    paged_attention_kernel<D, NT><<<grid, KernelConfig<D, NT>::kThreads, smem, stream>>>(args);
    return cuda_status(cudaGetLastError(), "paged_attention launch");
  };
  return dispatch_head_dim(shape.head_dim, [&]<int D>() -> Status {
    if (plan.tile_columns == kAttentionTileColumns) return launch.template operator()<D, 1>();
    if constexpr (D <= kAttentionPairedTilesMaxHeadDim) {
      if (plan.tile_columns == kAttentionPairedTileColumns) return launch.template operator()<D, 2>();
    }
    return invalid_argument("paged_attention: a plan of " + std::to_string(plan.tile_columns) +
                            " columns per tile at head_dim " + std::to_string(D) + " (not a plan of this library)");
  });
}

}  // namespace attention_detail

// Plan options for the current device and head_dim: its SM count and the number of blocks
// of the kernel that are resident per SM (registers and shared memory decide it), so the plan
// makes whole waves. Measured on the H200 at d = 128 (1 resident block): a plan assuming 2
// made 2.91 waves and took 565 us where a plan of 1 block per SM took 469 us
// (docs/benchmarks.md). Host-side, call once at start-up, not per step.
inline Result<AttentionPlanOptions> attention_plan_options_for_device(int head_dim) {
  using namespace attention_detail;
  int device = 0;
  OSCAR_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "attention_plan_options_for_device: cudaGetDevice"));
  AttentionPlanOptions options;
  OSCAR_RETURN_IF_ERROR(cuda_status(cudaDeviceGetAttribute(&options.num_sms, cudaDevAttrMultiProcessorCount, device),
                                    "attention_plan_options_for_device: SM count"));
  // Blocks of `kernel` resident per SM with `smem` bytes of dynamic shared memory (its limit
  // raised to that first, as the launch does); `what` names the kernel in an error.
  auto resident_blocks = [](auto kernel, int threads, size_t smem, const std::string& what, int& blocks) -> Status {
    OSCAR_RETURN_IF_ERROR(
        cuda_status(opt_in_dynamic_shared_memory(kernel, int(smem)),
                    ("attention_plan_options_for_device: " + what + "shared memory attribute").c_str()));
    return cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem),
                       ("attention_plan_options_for_device: " + what + "occupancy").c_str());
  };
  int resident = 0;
  int paired_resident = 0;  // stays 0 where the kernel has no paired column tiles (d = 256)
  int extend_resident = 0;  // stays 0 where no row-tiled kernel exists (d = 256)
  OSCAR_RETURN_IF_ERROR(dispatch_head_dim(head_dim, [&]<int D>() -> Status {
    OSCAR_RETURN_IF_ERROR(
        resident_blocks(paged_attention_kernel<D, 1>, KernelConfig<D>::kThreads, SharedLayout<D>::bytes, "", resident));
    if constexpr (D <= kAttentionPairedTilesMaxHeadDim) {
      OSCAR_RETURN_IF_ERROR(resident_blocks(paged_attention_kernel<D, 2>, KernelConfig<D, 2>::kThreads,
                                            SharedLayout<D, 2>::bytes, "paired-tile ", paired_resident));
    }
    if constexpr (D <= kAttentionRowTiledMaxHeadDim) {
      OSCAR_RETURN_IF_ERROR(resident_blocks(extend_attention_kernel<D>, kExtendThreads, ExtendLayout<D>::bytes,
                                            "extend ", extend_resident));
    }
    return Status::Ok();
  }));
  options.target_blocks_per_sm = std::max(1, resident);
  options.target_paired_blocks_per_sm = std::max(1, paired_resident);
  options.target_extend_blocks_per_sm = std::max(1, extend_resident);
  return options;
}

// Copies the plan's work items into the workspace and zeroes its arrival counters (stream
// ordered; the host vector may be freed once the stream reaches this point). Call after every
// make_attention_plan; paged_attention may then run any number of times with that plan.
inline Status upload_attention_plan(const AttentionPlan& plan, void* workspace, size_t workspace_bytes,
                                    cudaStream_t stream = nullptr) {
  using namespace attention_detail;
  OSCAR_RETURN_IF_ERROR(check_workspace(plan, workspace, workspace_bytes, "upload_attention_plan"));
  if (plan.total_items() == 0) return Status::Ok();
  const WorkspaceParts w = workspace_parts(plan, workspace);
  OSCAR_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(w.items, plan.items.data(), plan.items.size() * sizeof(AttentionWorkItem),
                                                    cudaMemcpyHostToDevice, stream),
                                    "upload_attention_plan: copy of the work items"));
  if (plan.num_counters > 0) {
    OSCAR_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(w.counters, 0, plan.counters_bytes(), stream),
                                      "upload_attention_plan: counter reset"));
  }
  if (plan.column_part) {
    return upload_attention_plan(*plan.column_part, static_cast<unsigned char*>(workspace) + plan.own_workspace_bytes(),
                                 workspace_bytes - plan.own_workspace_bytes(), stream);
  }
  return Status::Ok();
}

// Attention of every query of the plan over the paged cache. The page tables must describe
// the lengths the plan was made from. Validates what it can without reading device memory,
// then launches the plan's kernels (a mixed batch's column part after its row-tiled part);
// no allocation, no synchronization.
inline Status paged_attention(const AttentionPlan& plan, const PagedAttentionParams& params, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream = nullptr) {
  using namespace attention_detail;
  OSCAR_RETURN_IF_ERROR(validate_paged_attention(plan, params, workspace, workspace_bytes));
  if (plan.total_items() == 0) return Status::Ok();
  OSCAR_RETURN_IF_ERROR(launch_plan(plan, params, workspace, stream));
  if (!plan.column_part) return Status::Ok();
  // A mixed batch's short requests, on the column kernel after the row-tiled part.
  return launch_plan(*plan.column_part, params, static_cast<unsigned char*>(workspace) + plan.own_workspace_bytes(),
                     stream);
}

}  // namespace oscar
