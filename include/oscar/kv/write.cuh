// GPU write path: append (rotate -> bf16 -> store in the BF16 window, or clip -> quantize ->
// pack straight into INT2 pages) and demote (BF16 window pages -> INT2 pages), for one layer
// or a layer-strided set of layers in one launch.
//
// The exact rotation runs a warp per row (one token of one KV head, K or V): each lane holds
// the elements lane + 32·e and accumulates y_j = Σ_i x_i R_ij with fma in i order. Rows that
// are staged in shared memory anyway (head_dim <= 128) are quantized a row per thread in
// demotion (quantize_row_bf16x2) and a half row per lane in the tensor-core bulk append
// (quantize_half_row_bf16x2); the others by their warp (warp_quantize_row). All reduce
// exactly (integer selections for the clip threshold, min/max for the range), so the bytes
// equal the CPU reference's (host::PagedCache::write) bit for bit.
//
// Launchers validate their arguments, never allocate, never synchronize (CUDA-graph
// capturable, any stream) and return a Status. Device-resident slots are checked on the
// device: one out-of-range slot sets *error_flag and the launch writes nothing.
#pragma once

#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "oscar/core/cuda_status.hpp"
#include "oscar/core/kernel_attributes.cuh"
#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"
#include "oscar/kv/tile_rotation.cuh"
#include "oscar/kv/write_timeline.cuh"
#include "oscar/kv/write_params.hpp"
#include "oscar/quant/clip.hpp"
#include "oscar/quant/format.hpp"
#include "oscar/quant/quantize.hpp"
#include "oscar/quant/row_bf16x2.hpp"

namespace oscar {
namespace write_detail {

inline constexpr int kWarpsPerBlock = 4;
inline constexpr int kThreads = kWarpsPerBlock * 32;
// Append blocks are larger: each one stages R once for more rows.
inline constexpr int kAppendWarps = 8;
inline constexpr int kAppendThreads = kAppendWarps * 32;
inline constexpr unsigned kFullMask = 0xffffffffu;
// Up to this many slots (or demotions) every block checks them all itself; above, a separate
// pre-pass kernel does, so the check costs one extra launch only for bulk writes.
inline constexpr int kInBlockCheckLimit = 256;

OSCAR_DEVICE bool slot_ok(const TokenSlot& s, const LayeredKvPools& pools) {
  const int32_t pages = s.int2 ? pools.k_int2.num_pages : pools.k_bf16.num_pages;
  return s.page >= 0 && s.page < pages && s.slot >= 0 && s.slot < pools.k_int2.layout.page_size &&
         (s.int2 == 0 || s.int2 == 1);
}
OSCAR_DEVICE bool demotion_ok(const PageDemotion& d, const LayeredKvPools& pools) {
  return d.bf16_page >= 0 && d.bf16_page < pools.k_bf16.num_pages && d.int2_page >= 0 &&
         d.int2_page < pools.k_int2.num_pages && d.rows >= 0 && d.rows <= pools.k_int2.layout.page_size;
}

// Block-wide: true when every entry is valid; otherwise raises the flag.
template <class Entry, class Check>
OSCAR_DEVICE bool block_check(const Entry* entries, int n, const LayeredKvPools& pools, int32_t* error_flag,
                              Check check) {
  int bad = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) bad |= !check(entries[i], pools);
  if (__syncthreads_or(bad)) {
    if (threadIdx.x == 0) atomicExch(error_flag, kWriteErrorSlotOutOfRange);
    return false;
  }
  return true;
}

// Whether the launch may write: every entry valid. Up to kInBlockCheckLimit entries the block
// checks them itself; above, the pre-pass kernel did and left its verdict in *error_flag.
template <class Entry, class Check>
OSCAR_DEVICE bool entries_valid(const Entry* entries, int n, const LayeredKvPools& pools, int32_t* error_flag,
                                Check check) {
  if (n <= kInBlockCheckLimit) return block_check(entries, n, pools, error_flag, check);
  return *reinterpret_cast<volatile int32_t*>(error_flag) == 0;
}

// The pools and clip rank of one (layer, K or V) plane: blockIdx.y of every write kernel.
// The pools are layer 0's views; a layer's rows are offset by the layer strides.
struct WritePlane {
  const Bf16PoolRef& bf16;
  const Int2PoolRef& int2;
  int clip_k;
};
OSCAR_DEVICE WritePlane write_plane(const LayeredKvPools& pools, int layer, bool is_value) {
  return {is_value ? pools.v_bf16 : pools.k_bf16, is_value ? pools.v_int2 : pools.k_int2,
          (is_value ? pools.v_clip_rank : pools.k_clip_rank)[layer]};
}

// The new rows of plane (layer, K or V) of an append.
OSCAR_DEVICE const bf16_t* plane_input(const AppendParams& p, int layer, bool is_value) {
  return (is_value ? p.v : p.k) + layer * p.in_stride_layer;
}

// R of plane (layer, K or V) of an append, or null for the identity.
template <int kHeadDim>
OSCAR_DEVICE const float* plane_rotation(const AppendParams& p, int layer, bool is_value) {
  const float* r = is_value ? (p.values_prerotated ? nullptr : p.pools.v_rotation) : p.pools.k_rotation;
  return r ? r + size_t(layer) * kHeadDim * kHeadDim : nullptr;
}

__global__ void check_slots_kernel(const TokenSlot* slots, int n, const LayeredKvPools pools, int32_t* error_flag) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && !slot_ok(slots[i], pools)) atomicExch(error_flag, kWriteErrorSlotOutOfRange);
}
__global__ void check_demotions_kernel(const PageDemotion* demotions, int n, const LayeredKvPools pools,
                                       int32_t* error_flag) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && !demotion_ok(demotions[i], pools)) atomicExch(error_flag, kWriteErrorSlotOutOfRange);
}

// The exact k-th smallest |x_i| of the warp's row (finite bf16 values, as the cache
// quantizes), the same value as kth_smallest_magnitude. Magnitudes compare as their bit
// patterns. When few elements lie above the threshold (the usual case: rho = 0.96 leaves 5 of
// 128 above), each lane sorts its own few magnitudes and the largest remaining one leaves
// the warp `above` times. A bf16 magnitude fills only the high 16 bits of its float, so the
// low bits carry the lane (31 - lane: ties go to the lowest lane): one integer warp max
// (REDUX) then names both the value and the one lane that pops it. The answer is the largest
// head left. Otherwise, a 31-pass bitwise search with warp-summed counts. Both are exact, so
// the choice changes no bit.
template <int kHeadDim>
OSCAR_DEVICE float warp_kth_smallest_magnitude(const float (&x)[kHeadDim / 32], int k, int lane) {
  constexpr int kPerLane = kHeadDim / 32;
  constexpr uint32_t kMagnitude = 0x7fff0000u;  // a bf16 magnitude's bits within its float
  uint32_t key[kPerLane];
  const int above = kHeadDim - 1 - k;
  if (above < 24) {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) key[e] = (float_bits(x[e]) & kMagnitude) | uint32_t(31 - lane);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {  // descending, by exchanges: kPerLane is 2, 4 or 8
#pragma unroll
      for (int j = kPerLane - 1; j > i; --j) {
        const uint32_t hi = max(key[j - 1], key[j]), lo = min(key[j - 1], key[j]);
        key[j - 1] = hi;
        key[j] = lo;
      }
    }
    for (int r = 0; r < above; ++r) {
      // One instance leaves; an emptied lane's 0 never exceeds what remains.
      if (key[0] == __reduce_max_sync(kFullMask, key[0])) {
#pragma unroll
        for (int e = 0; e + 1 < kPerLane; ++e) key[e] = key[e + 1];
        key[kPerLane - 1] = 0;
      }
    }
    return float_from_bits(__reduce_max_sync(kFullMask, key[0]) & kMagnitude);
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) key[e] = float_bits(x[e]) & 0x7fffffffu;
  uint32_t answer = 0;
  for (int bit = 30; bit >= 0; --bit) {  // bit 31 (sign) is clear in every key
    const uint32_t trial = answer | ((1u << bit) - 1u);
    int count = 0;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) count += key[e] <= trial;
    if (__reduce_add_sync(kFullMask, count) <= k) answer |= 1u << bit;
  }
  return float_from_bits(answer);
}

// Floats <-> int32 in the same order (negative values: magnitude bits flipped), so the warp's
// float extremes are integer REDUX min/max. NaNs land beyond +-Inf at either end.
OSCAR_DEVICE int32_t ordered_int(float v) {
  const int32_t b = static_cast<int32_t>(float_bits(v));
  return b ^ ((b >> 31) & 0x7fffffff);
}
OSCAR_DEVICE float ordered_float(int32_t o) {
  return float_from_bits(static_cast<uint32_t>(o ^ ((o >> 31) & 0x7fffffff)));
}

// Clip, quantize and pack the warp's row x (lane holds elements lane + 32e; bf16 values).
// `codes` is the warp's shared scratch of kHeadDim bytes.
//
// The group extremes are taken once, before clipping: clipping is a monotone clamp, so the
// clipped row's extremes are the clamped extremes, and the same pass tells whether the row is
// finite (every group's extremes within +-Inf), which decides whether it is clipped at all.
template <int kHeadDim, int kGroup>
OSCAR_DEVICE void warp_quantize_row(float (&x)[kHeadDim / 32], int clip_k, uint8_t* codes, uint8_t* dst_codes,
                                    QuantMeta* dst_meta, int lane) {
  constexpr int kPerLane = kHeadDim / 32;
  constexpr int kGroups = kHeadDim / kGroup;
  constexpr int kLanesPerGroupSpan = kGroup / 32;  // consecutive e indices per group
  // With G >= 128 the four codes of every packed byte sit in one lane (a quarter of a group
  // is a multiple of 32 elements): the lane packs and stores its bytes, no shared scratch.
  constexpr bool kDirectPack = kGroup >= 128;
  constexpr int32_t kPlusInf = 0x7f800000, kMinusInf = static_cast<int32_t>(0x807fffffu);  // ordered_int(+-Inf)
  uint32_t code[kPerLane];
  float mn[kGroups], mx[kGroups];
  bool finite = true;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    int32_t lo = ordered_int(x[g * kLanesPerGroupSpan]), hi = lo;
#pragma unroll
    for (int e = g * kLanesPerGroupSpan + 1; e < (g + 1) * kLanesPerGroupSpan; ++e) {
      lo = min(lo, ordered_int(x[e]));
      hi = max(hi, ordered_int(x[e]));
    }
    lo = __reduce_min_sync(kFullMask, lo);
    hi = __reduce_max_sync(kFullMask, hi);
    finite = finite && lo > kMinusInf && hi < kPlusInf;
    mn[g] = ordered_float(lo);
    mx[g] = ordered_float(hi);
  }
  if (finite && clip_k >= 0) {
    const float tau = warp_kth_smallest_magnitude<kHeadDim>(x, clip_k, lane);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) x[e] = clamp_magnitude(x[e], tau);
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      mn[g] = clamp_magnitude(mn[g], tau);
      mx[g] = clamp_magnitude(mx[g], tau);
    }
  }
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const GroupQuantizer q = make_group_quantizer(mn[g], mx[g], finite);
    if (lane == 0) dst_meta[g] = q.meta;
#pragma unroll
    for (int e = g * kLanesPerGroupSpan; e < (g + 1) * kLanesPerGroupSpan; ++e) {
      code[e] = quantize_code(x[e], q);
      if constexpr (!kDirectPack) codes[lane + 32 * e] = static_cast<uint8_t>(code[e]);
    }
  }
  if constexpr (kDirectPack) {
    // Byte j of group g is this lane's element run j, j + G/4, ... (j = lane + 32·(e % span)).
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int b = 0; b < kGroup / 128; ++b) {
        const int e0 = g * kLanesPerGroupSpan + b;
        constexpr int q = kGroup / 128;  // e-steps between the four quarters
        dst_codes[g * (kGroup / 4) + b * 32 + lane] =
            static_cast<uint8_t>(code[e0] | code[e0 + q] << 2 | code[e0 + 2 * q] << 4 | code[e0 + 3 * q] << 6);
      }
    }
    return;
  }
  __syncwarp();
  // Pack in the format's order: byte j of group g holds local elements j, G/4+j, G/2+j, 3G/4+j.
  constexpr int kQuarter = kGroup / 4;
  for (int b = lane; b < kHeadDim / 4; b += 32) {
    const uint8_t* c = codes + (b / kQuarter) * kGroup + b % kQuarter;
    dst_codes[b] = static_cast<uint8_t>(c[0] | (c[kQuarter] << 2) | (c[2 * kQuarter] << 4) | (c[3 * kQuarter] << 6));
  }
  __syncwarp();
}

// Rotations up to this head_dim are staged in shared memory by each block (64 KB for 128),
// so the latency of reading R is paid once per block, not once per row and i.
template <int kHeadDim>
inline constexpr bool kStageRotation = kHeadDim <= 128;

template <int kHeadDim>
inline constexpr int kAppendSmemBytes = kStageRotation<kHeadDim> ? kHeadDim * kHeadDim * 4 : 0;

// blockIdx.y = layer * 2 + (0: K, 1: V); blockIdx.x strides over the (token, head) rows.
template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kAppendThreads) append_kernel(const AppendParams p) {
  constexpr int kPerLane = kHeadDim / 32;
  write_timeline_mark(kWriteStart);
  extern __shared__ __align__(16) float s_rotation[];
  __shared__ float s_row[kAppendWarps][kHeadDim];
  __shared__ uint8_t s_codes[kAppendWarps][kHeadDim];
  const int layer = blockIdx.y / 2;
  const bool is_value = blockIdx.y % 2;
  const float* rotation = plane_rotation<kHeadDim>(p, layer, is_value);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t heads = p.pools.k_int2.num_kv_heads;
  const uint32_t total = uint32_t(p.num_tokens) * heads;
  const uint32_t stride = gridDim.x * kAppendWarps;
  const WritePlane plane = write_plane(p.pools, layer, is_value);
  const bf16_t* input = plane_input(p, layer, is_value);
  // R's copies, the slot check and each warp's first input row and slot go out together, and
  // every row's input is loaded a row ahead: a decode-sized append waited for them one after
  // another, each a memory round trip, before any arithmetic.
  bf16_t next[kPerLane];
  TokenSlot next_slot{};
  auto load_row = [&](uint32_t row) {
    if (row >= total) return;
    const uint32_t token = row / heads, head = row % heads;
    const bf16_t* in = input + token * p.in_stride_token + head * kHeadDim;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) next[e] = in[lane + 32 * e];
    next_slot = p.slots[token];  // in range (token < num_tokens); used only once the launch is valid
  };
  const bool stage = kStageRotation<kHeadDim> && rotation;
  if (stage) {
    // Every 16-byte chunk in flight at once (cp.async), then one wait: the block pays one
    // memory latency for R, not one per loop trip.
    const char* from = reinterpret_cast<const char*>(rotation);
    char* to = reinterpret_cast<char*>(s_rotation);
    for (int i = threadIdx.x; i < kHeadDim * kHeadDim / 4; i += blockDim.x) {
      __pipeline_memcpy_async(to + 16 * i, from + 16 * i, 16);
    }
    __pipeline_commit();
  }
  const uint32_t first_row = blockIdx.x * kAppendWarps + warp;
  load_row(first_row);
  write_timeline_mark(kWriteIssued);
  const bool valid = entries_valid(p.slots, p.num_tokens, p.pools, p.error_flag, slot_ok);
  write_timeline_mark(kWriteChecked);
  if (stage) {
    __pipeline_wait_prior(0);  // also before an invalid launch's exit: no copy lands after it
    __syncthreads();
    rotation = s_rotation;
  }
  write_timeline_mark(kWriteStaged);
  if (!valid) return;
  for (uint32_t row = first_row; row < total; row += stride) {
    const uint32_t head = row % heads;
    const TokenSlot slot = next_slot;
    float* x = s_row[warp];
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) x[lane + 32 * e] = bf16_to_float(next[e]);
    load_row(row + stride);  // in flight during this row's rotation and store
    __syncwarp();
    float y[kPerLane];
    if (rotation) {
      const float* r = rotation + lane;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) y[e] = 0.0f;
#pragma unroll 8
      for (int i = 0; i < kHeadDim; ++i) {
        const float xi = x[i];
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) y[e] = fmaf(xi, r[i * kHeadDim + 32 * e], y[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) y[e] = x[lane + 32 * e];
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) y[e] = round_to_bf16(y[e]);
    if (row == first_row) write_timeline_mark(kWriteFirstRow);
    __syncwarp();  // everyone is done reading x before the next row overwrites it
    if (!slot.int2) {
      bf16_t* out = plane.bf16.row(slot.page, head, slot.slot) + layer * p.pools.bf16_stride_layer;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) out[lane + 32 * e] = float_to_bf16(y[e]);
    } else {
      uint8_t* block = plane.int2.block(slot.page, head) + layer * p.pools.int2_stride_layer;
      warp_quantize_row<kHeadDim, kGroup>(y, plane.clip_k, s_codes[warp], plane.int2.layout.codes(block, slot.slot),
                                          plane.int2.layout.meta(block, slot.slot), lane);
    }
  }
  write_timeline_end();
}

// ---- append with R in registers (head_dim <= 128) --------------------------------------------
// Thread j of a block owns output column j: it holds R's column j (R_0j .. R_(D-1)j) in D
// registers for the whole launch and accumulates y_j = Σ_i x_i R_ij with fma in i order (the
// CPU reference's bytes), x_i of kColumnRows rows broadcast from shared memory as float4s,
// kColumnRows independent fma chains per thread. No block stages R in shared memory, so one
// that rotates a single group of rows finishes sooner than append_kernel's (which stages R and
// then reads all 64 KB of it per row); see use_column_kernel for where it is used. Its bound
// is the broadcast of x: every fma takes one x from shared memory, and a float4 broadcast costs
// 4 wavefronts (~2050 cycles per group of 4 rows at d = 128, H100), as few per fma as
// append_kernel's reads of R, so it does not rotate many rows faster.
// OSCAR_APPEND_COLUMN_ROWS (4 or 8) overrides it: a measurement knob.
#ifdef OSCAR_APPEND_COLUMN_ROWS
inline constexpr int kColumnRows = OSCAR_APPEND_COLUMN_ROWS;
#else
inline constexpr int kColumnRows = 4;
#endif
static_assert(kColumnRows % 4 == 0, "x of the group's rows is read as float4s");

template <int kHeadDim>
inline constexpr bool kColumnKernelFits = kHeadDim <= 128;  // R's column must fit in registers

// blockIdx.y = layer * 2 + (0: K, 1: V); blockIdx.x strides over groups of kColumnRows rows
// (token-major, head-minor). blockDim.x = kHeadDim.
template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kHeadDim) append_columns_kernel(const AppendParams p) {
  constexpr int kRows = kColumnRows;
  constexpr int kWarps = kHeadDim / 32;
  constexpr int kPerLane = kHeadDim / 32;
  write_timeline_mark(kWriteStart);
  __shared__ __align__(16) float s_x[kHeadDim][kRows];  // x_i of the group's rows: kRows / 4 float4 per i
  __shared__ float s_y[kRows][kHeadDim];                // rotated rows bound for INT2 pages
  __shared__ TokenSlot s_slot[kRows];
  __shared__ uint8_t s_codes[kWarps][kHeadDim];
  const int layer = blockIdx.y / 2;
  const bool is_value = blockIdx.y % 2;
  const float* rotation = plane_rotation<kHeadDim>(p, layer, is_value);
  const int j = threadIdx.x, warp = j / 32, lane = j % 32;
  const uint32_t heads = p.pools.k_int2.num_kv_heads;
  const uint32_t total = uint32_t(p.num_tokens) * heads;
  const uint32_t groups = (total + kRows - 1) / kRows;
  const WritePlane plane = write_plane(p.pools, layer, is_value);
  const bf16_t* input = plane_input(p, layer, is_value);

  // R's column, the slot check and the first group's rows go out together: each is a memory
  // round trip, and a decode-sized append has little else to wait on.
  float r_col[kHeadDim];
  if (rotation) {
#pragma unroll
    for (int i = 0; i < kHeadDim; ++i) r_col[i] = __ldg(rotation + i * kHeadDim + j);  // coalesced per warp
  }
  bf16_t next_x[kRows];
  TokenSlot next_slot{};
  auto load_group = [&](uint32_t group) {
    if (group >= groups) return;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const uint32_t row = group * kRows + r;
      // (Rows past the end read as 0 and are never stored.)
      next_x[r] = row < total ? input[(row / heads) * p.in_stride_token + (row % heads) * kHeadDim + j] : bf16_t{0};
    }
    const uint32_t row = group * kRows + j;
    if (j < kRows && row < total) next_slot = p.slots[row / heads];  // in range; used only once the launch is valid
  };
  uint32_t group = blockIdx.x;
  load_group(group);
  write_timeline_mark(kWriteIssued);
  const bool valid = entries_valid(p.slots, p.num_tokens, p.pools, p.error_flag, slot_ok);
  write_timeline_mark(kWriteChecked);
  if (!valid) return;
  for (; group < groups; group += gridDim.x) {
    // The previous group's readers of s_x, s_y and s_slot are done (the barrier at the loop's end).
#pragma unroll
    for (int q = 0; q < kRows / 4; ++q) {
      *reinterpret_cast<float4*>(&s_x[j][4 * q]) =
          make_float4(bf16_to_float(next_x[4 * q]), bf16_to_float(next_x[4 * q + 1]), bf16_to_float(next_x[4 * q + 2]),
                      bf16_to_float(next_x[4 * q + 3]));
    }
    if (j < kRows) s_slot[j] = next_slot;
    __syncthreads();
    if (group == blockIdx.x) write_timeline_mark(kWriteStaged);
    load_group(group + gridDim.x);  // in flight during this group's rotation and stores
    float y[kRows];
    if (rotation) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) y[r] = 0.0f;
#pragma unroll
      for (int i = 0; i < kHeadDim; ++i) {
#pragma unroll
        for (int q = 0; q < kRows / 4; ++q) {
          const float4 x = *reinterpret_cast<const float4*>(&s_x[i][4 * q]);  // one address per warp: a broadcast
          y[4 * q] = fmaf(x.x, r_col[i], y[4 * q]);
          y[4 * q + 1] = fmaf(x.y, r_col[i], y[4 * q + 1]);
          y[4 * q + 2] = fmaf(x.z, r_col[i], y[4 * q + 2]);
          y[4 * q + 3] = fmaf(x.w, r_col[i], y[4 * q + 3]);
        }
      }
    } else {
#pragma unroll
      for (int r = 0; r < kRows; ++r) y[r] = s_x[j][r];
    }
    if (group == blockIdx.x) write_timeline_mark(kWriteFirstRow);
    bool any_int2 = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const uint32_t row = group * kRows + r;
      if (row >= total) break;
      const TokenSlot slot = s_slot[r];  // the same for every thread: no divergence
      const float v = round_to_bf16(y[r]);
      if (!slot.int2) {
        bf16_t* out = plane.bf16.row(slot.page, row % heads, slot.slot) + layer * p.pools.bf16_stride_layer;
        out[j] = float_to_bf16(v);
      } else {
        s_y[r][j] = v;
        any_int2 = true;
      }
    }
    if (any_int2) {  // block-uniform
      __syncthreads();
      for (int r = warp; r < kRows; r += kWarps) {
        const uint32_t row = group * kRows + r;
        const TokenSlot slot = s_slot[r];
        if (row >= total || !slot.int2) continue;
        float x[kPerLane];
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) x[e] = s_y[r][lane + 32 * e];
        uint8_t* block = plane.int2.block(slot.page, row % heads) + layer * p.pools.int2_stride_layer;
        warp_quantize_row<kHeadDim, kGroup>(x, plane.clip_k, s_codes[warp], plane.int2.layout.codes(block, slot.slot),
                                            plane.int2.layout.meta(block, slot.slot), lane);
      }
    }
    __syncthreads();
  }
  write_timeline_end();
}

// A group's metadata as the word the INT2 layout stores (scale in the low half).
OSCAR_DEVICE uint32_t meta_word(const QuantMeta& meta) {
  return uint32_t{meta.scale.bits} | uint32_t{meta.offset.bits} << 16;
}

// One thread quantizes a row held as bf16 pairs (quantize_row_bf16x2) and stores it into
// INT2 block `block` at `token`: the codes in 16-byte pieces, the metadata as words.
template <int kHeadDim, int kGroup, int kSelection>
OSCAR_DEVICE void store_quantized_row(const uint32_t (&x)[kHeadDim / 2], int clip_k, const Int2Layout& layout,
                                      uint8_t* block, int token) {
  uint32_t codes[kHeadDim / 16];
  QuantMeta meta[kHeadDim / kGroup];
  quantize_row_bf16x2<kHeadDim, kGroup, kSelection>(x, clip_k, codes, meta);
  uint4* out = reinterpret_cast<uint4*>(layout.codes(block, token));
  OSCAR_UNROLL
  for (int i = 0; i < kHeadDim / 64; ++i) out[i] = make_uint4(codes[4 * i], codes[4 * i + 1], codes[4 * i + 2], codes[4 * i + 3]);
  uint32_t* meta_out = reinterpret_cast<uint32_t*>(layout.meta(block, token));
  OSCAR_UNROLL
  for (int g = 0; g < kHeadDim / kGroup; ++g) meta_out[g] = meta_word(meta[g]);
}

// Lanes l and l ^ 16 quantize the halves of one row (quantize_half_row_bf16x2) and store it
// into INT2 block `block` at `token`: each lane its half of the codes, and the metadata of its
// groups (of the row's one group: the lane with h = 0).
template <int kHeadDim, int kGroup, int kSelection>
OSCAR_DEVICE void store_quantized_half_row(const uint32_t (&x)[kHeadDim / 4], int clip_k, int lane,
                                           const Int2Layout& layout, uint8_t* block, int token) {
  const int h = lane / 16;
  constexpr int kGroups = kHalfRowGroups<kHeadDim, kGroup>;
  uint32_t codes[kHeadDim / 32];
  QuantMeta meta[kGroups];
  quantize_half_row_bf16x2<kHeadDim, kGroup, kSelection>(x, clip_k, lane, codes, meta);
  uint8_t* out = layout.codes(block, token) + h * (kHeadDim / 8);
  if constexpr (kHeadDim == 128) {
    *reinterpret_cast<uint4*>(out) = make_uint4(codes[0], codes[1], codes[2], codes[3]);
  } else {
    *reinterpret_cast<uint2*>(out) = make_uint2(codes[0], codes[1]);
  }
  if (kGroup != kHeadDim || h == 0) {
    uint32_t* meta_out = reinterpret_cast<uint32_t*>(layout.meta(block, token)) + h * (kGroup == kHeadDim ? 0 : kGroups);
    OSCAR_UNROLL
    for (int g = 0; g < kGroups; ++g) meta_out[g] = meta_word(meta[g]);
  }
}

// A warpgroup's kWarpgroupRows rows [first, first + 64) of the plane (token-major, head-minor)
// copied by cp.async into `rows` (swizzled, as tile_rotation.cuh reads them); the caller
// commits and waits. A thread copies one 16-byte column of every kRowStep-th row. Its source
// steps by a fixed (token, head) increment with one carry, and its shared address by a
// constant (the swizzle repeats every 8 rows): no division per row (a 32-bit division by the
// runtime head count is ~20 instructions). The step of kRowStep rows (token-major,
// head-minor): kRowStep / heads tokens and step_heads heads on, plus one token (wrap_elements)
// when the head passes `heads`. (Worked out per call: live across the loop they cost the
// quantizer registers.)
template <int kHeadDim>
OSCAR_DEVICE void copy_warpgroup_rows(const AppendParams& p, const bf16_t* input, uint32_t heads, uint32_t total,
                                      uint32_t first, int group_thread, bf16_t* rows) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  constexpr int kRowStep = 128 / kChunks;
  static_assert((kWarpgroupRows % kRowStep) == 0 && (kRowStep & 7) == 0, "the swizzle repeats every kRowStep rows");
  const uint32_t step_heads = kRowStep % heads;
  const int64_t step_elements = int64_t(kRowStep / heads) * p.in_stride_token + int64_t(step_heads) * kHeadDim;
  const int64_t wrap_elements = p.in_stride_token - int64_t(heads) * kHeadDim;
  const int r = group_thread / kChunks, column = (group_thread % kChunks) * 8;
  uint32_t row = first + r, head = row % heads;
  const bf16_t* src = input + (row / heads) * p.in_stride_token + head * kHeadDim + column;
  const uint32_t dst = ptx::smem_address(rows + swizzled<kHeadDim>(r, column));
  OSCAR_UNROLL
  for (int j = 0; j < kWarpgroupRows / kRowStep; ++j, row += kRowStep) {
    // (rows past `total` are the tile's missing rows: never read back)
    if (row < total) ptx::cp_async16(dst + j * kRowStep * kHeadDim * int(sizeof(bf16_t)), src);
    head += step_heads;
    src += step_elements;
    if (head >= heads) {
      head -= heads;
      src += wrap_elements;
    }
  }
}

// The calling warp's 16 rows of the tile at `first`, in `rows` (swizzled), stored: rows bound
// for the BF16 window by the warp in 16-byte pieces (a bulk prefill's warps, whose rows are all
// bound for INT2 pages, skip that loop's 16 rounds of shuffles), rows bound for INT2 pages
// quantized half a row per lane: lanes i and i + 16 take the halves of the warp's row i
// (quantize_half_row_bf16x2; the swizzle puts a phase's 8 rows in 8 bank groups). lane_slot is
// the slot of row lane_row = first + 16·warp + lane % 16.
template <int kHeadDim, int kGroup, int kSelection>
OSCAR_DEVICE void store_warp_rows(const AppendParams& p, const WritePlane& plane, int layer, const bf16_t* rows,
                                  uint32_t first, uint32_t heads, uint32_t total, int warp, int lane,
                                  uint32_t lane_row, const TokenSlot& lane_slot) {
  constexpr int kChunks = kHeadDim / 8;
  const bool all_int2 = __all_sync(kFullMask, lane_row >= total || lane_slot.int2);
  for (int i = 0; i < 16 && !all_int2; ++i) {
    const int r = warp * 16 + i;
    const uint32_t row = first + r;
    if (row >= total) break;
    const uint32_t head = row % heads;
    const TokenSlot slot{__shfl_sync(kFullMask, lane_slot.page, i), __shfl_sync(kFullMask, lane_slot.slot, i),
                         __shfl_sync(kFullMask, lane_slot.int2, i)};
    if (!slot.int2) {
      bf16_t* out = plane.bf16.row(slot.page, head, slot.slot) + layer * p.pools.bf16_stride_layer;
      if (lane < kChunks) {
        *reinterpret_cast<uint4*>(out + lane * 8) = *reinterpret_cast<const uint4*>(rows + swizzled<kHeadDim>(r, lane * 8));
      }
    }
  }
  if (lane_row < total && lane_slot.int2) {  // the same for both lanes of a row
    const int r = warp * 16 + lane % 16, h = lane / 16;
    uint32_t x[kHeadDim / 4];
    OSCAR_UNROLL
    for (int c = 0; c < kChunks / 2; ++c) {
      const uint4 v = *reinterpret_cast<const uint4*>(rows + swizzled<kHeadDim>(r, (h * kChunks / 2 + c) * 8));
      x[4 * c] = v.x;
      x[4 * c + 1] = v.y;
      x[4 * c + 2] = v.z;
      x[4 * c + 3] = v.w;
    }
    uint8_t* block = plane.int2.block(lane_slot.page, lane_row % heads) + layer * p.pools.int2_stride_layer;
    store_quantized_half_row<kHeadDim, kGroup, kSelection>(x, plane.clip_k, lane, plane.int2.layout, block, lane_slot.slot);
  }
}

// What a bulk-append block needs of its (layer, K/V) plane, blockIdx.y: its rows
// (token-major, head-minor, `total` of them), where they go and R (null: not rotated).
struct BulkAppendPlane {
  int layer;
  uint32_t heads, total;
  WritePlane plane;
  const bf16_t* input;
  const float* rotation;
};
template <int kHeadDim>
OSCAR_DEVICE BulkAppendPlane bulk_append_plane(const AppendParams& p, bool rotates) {
  const int layer = blockIdx.y / 2;
  const bool is_value = blockIdx.y % 2;
  const uint32_t heads = p.pools.k_int2.num_kv_heads;
  return {layer,
          heads,
          uint32_t(p.num_tokens) * heads,
          write_plane(p.pools, layer, is_value),
          plane_input(p, layer, is_value),
          rotates ? plane_rotation<kHeadDim>(p, layer, is_value) : nullptr};
}

// The bulk form of append_kernel: rows (token-major, head-minor) are loaded with cp.async,
// rotated on tensor cores (tile_rotation.cuh) and then stored by the warp that rotated them:
// into BF16 slots in 16-byte pieces, or quantized half a row per lane. Grid: (blocks, layer *
// 2 + K/V), one block of 4 warpgroups per SM. Each warpgroup (4 warps, 64 rows: one warpgroup
// MMA's M) takes every (blocks · 4)-th unit of 64 rows behind a barrier of its own, so the
// SM's warpgroups go through their loads, MMAs and quantization independently and keep its
// tensor cores, ALUs and memory busy at different times. The block stages its plane's R once
// for the 4 warpgroups, which leaves room for two row buffers per warpgroup: a warpgroup copies
// its next rows while it rotates and stores the current ones. 16 warps per SM (the copies and
// the quantizer are latency-bound) cap it at 128 registers, which the half-row quantizer fits
// (a row per thread took 177, or 88 bytes of spills at 128: 406 / 323 us against 279 with half
// rows, H100). kGroups: warpgroups per block, 4 where the device's shared memory per block
// allows (192 KB at d = 128 with R: Hopper), else 2 or 1 (the launcher picks; sm_80's 163 KB,
// sm_86's 99 KB), always at 128 registers. Against two blocks of 2 warpgroups with one buffer each (R staged twice per SM;
// the kernel of df612d9), measured on an H100: bulk write 149 -> 144 us rotated, 98.7 -> 97.4
// unrotated, fitted clip ratios 166 -> 155 / 114 -> 108 (docs/benchmarks.md).
// kStaged: some plane of the launch rotates (R staged in front of the buffers); a plane that
// does not rotate skips the staging and the MMAs either way. kSelection: the widest sorted clip
// selection compiled in (quantize_row_bf16x2; the launcher picks it from
// LayeredKvPools::max_clip_distance). It runs unrotated bulk appends everywhere, and rotated
// ones where append_rotating_producer_kernel (below) does not fit or is switched off.
template <int kHeadDim, bool kStaged>
inline constexpr int kStagedRotationBytes = kStaged ? int(sizeof(StagedRotation<kHeadDim>)) : 0;
template <int kHeadDim, bool kStaged, int kGroups>
inline constexpr int kTensorCoreSmemBytes =
    kStagedRotationBytes<kHeadDim, kStaged> + kGroups * 2 * kWarpgroupRows * kHeadDim * 2;

template <int kHeadDim, int kGroup, int kSelection, bool kStaged, int kGroups>
__global__ void __launch_bounds__(kGroups * 128, 4 / kGroups) append_tensor_core_kernel(const AppendParams p) {
  constexpr int kBufferElements = kWarpgroupRows * kHeadDim;
  extern __shared__ __align__(16) unsigned char s_raw[];
  StagedRotation<kHeadDim>& staged = *reinterpret_cast<StagedRotation<kHeadDim>*>(s_raw);
  if (!entries_valid(p.slots, p.num_tokens, p.pools, p.error_flag, slot_ok)) return;
  const auto [layer, heads, total, plane, input, rotation] = bulk_append_plane<kHeadDim>(p, kStaged);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / 4, group_warp = warp % 4, group_thread = threadIdx.x % 128;
  bf16_t* buffers = reinterpret_cast<bf16_t*>(s_raw + kStagedRotationBytes<kHeadDim, kStaged>) + group * 2 * kBufferElements;
  static_assert(kGroups == 1 || kGroups == 2 || kGroups == 4);
  const auto group_sync = [group] {  // the warpgroup's own barrier (immediate ids: see named_barrier_sync)
    switch (group) {
      case 0: ptx::named_barrier_sync<1, 128>(); break;
      case 1: ptx::named_barrier_sync<2, 128>(); break;
      case 2: ptx::named_barrier_sync<3, 128>(); break;
      default: ptx::named_barrier_sync<4, 128>(); break;
    }
  };
  const uint32_t stride = gridDim.x * kGroups * kWarpgroupRows;
  uint32_t first = (blockIdx.x * kGroups + group) * kWarpgroupRows;
  // The first rows' copies go out before R is staged, so the two overlap.
  if (first < total) copy_warpgroup_rows<kHeadDim>(p, input, heads, total, first, group_thread, buffers);
  ptx::cp_async_commit();
  if (rotation) stage_rotation<kHeadDim>(rotation, staged);  // the whole block; ends synchronized
  for (int buffer = 0; first < total; first += stride, buffer ^= 1) {
    // The other buffer held the previous rows: every warp of the group has stored them.
    group_sync();
    const uint32_t next = first + stride;
    if (next < total) {
      copy_warpgroup_rows<kHeadDim>(p, input, heads, total, next, group_thread, buffers + (buffer ^ 1) * kBufferElements);
    }
    ptx::cp_async_commit();  // (an empty group past the last rows)
    // Lanes i and i + 16 look up the slot of the warp's row i while the next rows' copies are
    // in flight, so the 16 lookups share their round trip instead of one dependent load per
    // row below; both lanes of a row use it when they quantize its halves.
    const uint32_t lane_row = first + group_warp * 16 + lane % 16;
    TokenSlot lane_slot{};
    if (lane_row < total) lane_slot = p.slots[lane_row / heads];
    ptx::cp_async_wait<1>();  // these rows' copies (all but the newest group)
    group_sync();
    bf16_t* rows = buffers + buffer * kBufferElements;
    if (rotation) rotate_warp_rows<kHeadDim>(staged, rows, group_warp, lane);
    store_warp_rows<kHeadDim, kGroup, kSelection>(p, plane, layer, rows, first, heads, total, group_warp, lane, lane_row,
                                                  lane_slot);
  }
}

// The rotated bulk append with its roles split (Hopper: warpgroup MMAs, and its 160 KB of
// shared memory at d = 128). In append_tensor_core_kernel a warpgroup's four warps issue
// nothing while its rotation's MMAs run, and the quantizer, latency-bound, runs no faster on
// the SM's other warps meanwhile. Here one producer warpgroup per block copies every unit of 64
// rows into a row buffer, rotates it in place on tensor cores and hands it to one of
// kRotatingConsumers quantizing warpgroups, which only look up slots, quantize and store: the
// MMAs run beside the quantizers instead of in their place. Each consumer owns two buffers
// (units k, k + 3, ... alternate them), so the producer fills one while the consumer quantizes
// the other. Handoffs are named barriers of 256 threads, the producer's warpgroup and one
// consumer's: kFullBarrier + slot (the producer arrives, the consumer waits) says a buffer
// holds its rotated rows, kEmptyBarrier + slot (both wait) that its consumer is done with it.
// Both sides skip the empty handoff of a buffer's last use, so no barrier is left half
// arrived. A plane that does not rotate (values_prerotated) has the producer copy only. 4
// warpgroups at 128 registers fill the SM's register file: one block per SM. Measured on an
// H100 (docs/benchmarks.md): 32K tokens x 8 heads 145 -> 132 us, at fitted clip ratios 155 ->
// 140; three quantizing warpgroups now bound it (the unrotated write's four take 98 us).
inline constexpr int kRotatingConsumers = 3;
inline constexpr int kRotatingSlots = 2 * kRotatingConsumers;
inline constexpr int kRotatingCopiesAhead = 3;  // units with copies in flight, the one rotated next included
inline constexpr int kRotatingThreads = (kRotatingConsumers + 1) * 128;
// (R and two buffers per consumer: the layout of append_tensor_core_kernel's block with one
// warpgroup per consumer.)
template <int kHeadDim>
inline constexpr int kRotatingSmemBytes = kTensorCoreSmemBytes<kHeadDim, true, kRotatingConsumers>;

// Barrier ids 1-6: buffer `slot` holds rotated rows; 7-12: its consumer is done with it;
// 13: the producer warpgroup's own. (Immediate ids: see named_barrier_sync.)
inline constexpr int kFullBarrier = 1, kEmptyBarrier = 7, kProducerBarrier = 13;
template <int kBase, bool kArrive>
OSCAR_DEVICE void handoff(int slot) {
  static_assert(kRotatingSlots == 6, "one case per slot");
  const auto at = [&]<int kId>() {
    if constexpr (kArrive) {
      ptx::named_barrier_arrive<kId, 256>();
    } else {
      ptx::named_barrier_sync<kId, 256>();
    }
  };
  switch (slot) {
    case 0: at.template operator()<kBase>(); break;
    case 1: at.template operator()<kBase + 1>(); break;
    case 2: at.template operator()<kBase + 2>(); break;
    case 3: at.template operator()<kBase + 3>(); break;
    case 4: at.template operator()<kBase + 4>(); break;
    default: at.template operator()<kBase + 5>(); break;
  }
}

template <int kHeadDim, int kGroup, int kSelection>
__global__ void __launch_bounds__(kRotatingThreads, 1) append_rotating_producer_kernel(const AppendParams p) {
  constexpr int kBufferElements = kWarpgroupRows * kHeadDim;
  constexpr int kProducer = kRotatingConsumers;  // the last warpgroup (warps 12-15: a warpgroup MMA's)
  extern __shared__ __align__(16) unsigned char s_raw[];
  StagedRotation<kHeadDim>& staged = *reinterpret_cast<StagedRotation<kHeadDim>*>(s_raw);
  bf16_t* buffers = reinterpret_cast<bf16_t*>(s_raw + kStagedRotationBytes<kHeadDim, true>);
  if (!entries_valid(p.slots, p.num_tokens, p.pools, p.error_flag, slot_ok)) return;
  const auto [layer, heads, total, plane, input, rotation] = bulk_append_plane<kHeadDim>(p, true);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / 4, group_warp = warp % 4, group_thread = threadIdx.x % 128;
  // The block's units: rows [first(k), first(k) + 64) for k < units, strided over the grid.
  const uint32_t stride = gridDim.x * kWarpgroupRows, first0 = blockIdx.x * kWarpgroupRows;
  const int units = first0 < total ? int((total - first0 - 1) / stride + 1) : 0;
  const auto first = [&](int k) { return first0 + uint32_t(k) * stride; };
  const auto rows = [&](int k) { return buffers + (k % kRotatingSlots) * kBufferElements; };
  if (group == kProducer) {  // the first units' copies go out before R is staged
    for (int k = 0; k < kRotatingCopiesAhead; ++k) {
      if (k < units) copy_warpgroup_rows<kHeadDim>(p, input, heads, total, first(k), group_thread, rows(k));
      ptx::cp_async_commit();
    }
  }
  if (rotation) stage_rotation<kHeadDim>(rotation, staged);  // the whole block; ends synchronized
  if (group == kProducer) {
    for (int k = 0; k < units; ++k) {
      ptx::cp_async_wait<kRotatingCopiesAhead - 1>();  // unit k's copies (this thread's)
      ptx::named_barrier_sync<kProducerBarrier, 128>();  // ... and every producer thread's
      if (rotation) rotate_warp_rows<kHeadDim>(staged, rows(k), group_warp, lane);
      handoff<kFullBarrier, true>(k % kRotatingSlots);
      const int next = k + kRotatingCopiesAhead;
      if (next < units) {
        // The buffer's previous unit (next - 6) has been stored by its consumer.
        if (next >= kRotatingSlots) handoff<kEmptyBarrier, false>(next % kRotatingSlots);
        copy_warpgroup_rows<kHeadDim>(p, input, heads, total, first(next), group_thread, rows(next));
      }
      ptx::cp_async_commit();  // (an empty group past the last unit)
    }
  } else {
    for (int k = group; k < units; k += kRotatingConsumers) {
      // Lanes i and i + 16 look up the slot of the warp's row i before the rows are ready.
      const uint32_t lane_row = first(k) + group_warp * 16 + lane % 16;
      TokenSlot lane_slot{};
      if (lane_row < total) lane_slot = p.slots[lane_row / heads];
      handoff<kFullBarrier, false>(k % kRotatingSlots);
      store_warp_rows<kHeadDim, kGroup, kSelection>(p, plane, layer, rows(k), first(k), heads, total, group_warp, lane,
                                                    lane_row, lane_slot);
      // (A bar.sync where an arrive would do: it costs nothing, since the producer reaches it
      // right after it hands over this consumer's next unit, which the consumer waits for
      // anyway. compute-sanitizer's racecheck does not honour bar.arrive's ordering, and
      // reports the full handoff's arrive/sync, the PTX ISA's own producer/consumer example,
      // as hazards: docs/testing.md.)
      if (k + kRotatingSlots < units) handoff<kEmptyBarrier, false>(k % kRotatingSlots);
    }
  }
}

// Rows of one (demotion, head) a warp loads before it quantizes them: their loads are in
// flight together, so a warp waits for memory once per item instead of once per row.
inline constexpr int kDemoteRowsPerItem = 4;

// blockIdx.y = layer * 2 + (0: K, 1: V); blockIdx.x strides over (demotion, head, 4-row chunk).
template <int kHeadDim, int kGroup>
__global__ void __launch_bounds__(kThreads) demote_kernel(const DemoteParams p) {
  constexpr int kPerLane = kHeadDim / 32;
  constexpr int kRows = kDemoteRowsPerItem;
  __shared__ uint8_t s_codes[kWarpsPerBlock][kHeadDim];
  if (!entries_valid(p.demotions, p.num_demotions, p.pools, p.error_flag, demotion_ok)) return;
  const int layer = blockIdx.y / 2;
  const bool is_value = blockIdx.y % 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t heads = p.pools.k_int2.num_kv_heads;
  const uint32_t chunks = uint32_t(p.pools.k_int2.layout.page_size) / kRows;  // page sizes are powers of two >= 8
  const uint32_t items = uint32_t(p.num_demotions) * heads * chunks;
  const WritePlane plane = write_plane(p.pools, layer, is_value);
  const Int2Layout& layout = plane.int2.layout;
  for (uint32_t item = blockIdx.x * kWarpsPerBlock + warp; item < items; item += gridDim.x * kWarpsPerBlock) {
    const uint32_t first = (item % chunks) * kRows;
    const uint32_t head = (item / chunks) % heads;
    const PageDemotion d = p.demotions[item / chunks / heads];
    const bf16_t* in = plane.bf16.row(d.bf16_page, head, first) + layer * p.pools.bf16_stride_layer;
    float x[kRows][kPerLane];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (first + r < uint32_t(d.rows)) {
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) x[r][e] = bf16_to_float(in[r * kHeadDim + lane + 32 * e]);
      }
    }
    uint8_t* block = plane.int2.block(d.int2_page, head) + layer * p.pools.int2_stride_layer;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (first + r >= uint32_t(d.rows)) break;
      warp_quantize_row<kHeadDim, kGroup>(x[r], plane.clip_k, s_codes[warp], layout.codes(block, first + r),
                                          layout.meta(block, first + r), lane);
    }
  }
}

// Demotion with a thread per row (head_dim <= 128; quantize_row_bf16x2): each warp stages 32
// rows of (demotion, head, token) order through shared memory with coalesced 16-byte
// cp.async (a lane reading its own row directly would touch 32 rows' lines per load), then
// every lane quantizes its row from registers and stores its codes and metadata whole. Rows
// past a demotion's `rows` are neither read nor written. (Half rows per lane, as the
// tensor-core append runs them, measured slower here: 22.2 against 20.6 us at 256 pages on
// the H100, 37 % more instructions for the exchanges and the shared threshold searches.)
inline constexpr int kRowWarps = 4;
// 4 blocks of 4 warps per SM: 128 registers, without spills in the narrow quantizer form (164
// unbounded, which allowed 3; the wide form's top-32 list spills 108-116 bytes at d = 128),
// and 528 resident blocks on 132 SMs hold a 256-page demotion's 512 blocks in one wave
// (3 per SM made 1.3 waves: H100, 21.3 against 20.6 us).
#if defined(OSCAR_ROW_MIN_BLOCKS)
inline constexpr int kRowMinBlocks = OSCAR_ROW_MIN_BLOCKS;  // measurement knob
#else
inline constexpr int kRowMinBlocks = 4;
#endif
template <int kHeadDim>
inline constexpr int kStagedRowBytes = kHeadDim * 2 + 16;  // + 16: a phase's 16-byte reads hit distinct banks

template <int kHeadDim, int kGroup, int kSelection>  // kSelection: as in append_tensor_core_kernel
__global__ void __launch_bounds__(kRowWarps * 32, kRowMinBlocks) demote_rows_kernel(const DemoteParams p) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte pieces per row
  __shared__ __align__(16) uint8_t s_rows[kRowWarps][32 * kStagedRowBytes<kHeadDim>];
  if (!entries_valid(p.demotions, p.num_demotions, p.pools, p.error_flag, demotion_ok)) return;
  const int layer = blockIdx.y / 2;
  const bool is_value = blockIdx.y % 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t heads = p.pools.k_int2.num_kv_heads;
  const uint32_t page = uint32_t(p.pools.k_int2.layout.page_size);  // a power of two >= 8
  const uint32_t rows = uint32_t(p.num_demotions) * heads * page;
  const WritePlane plane = write_plane(p.pools, layer, is_value);
  const Int2Layout& layout = plane.int2.layout;
  uint8_t* staged = s_rows[warp];
  for (uint32_t first = (blockIdx.x * kRowWarps + warp) * 32; first < rows; first += gridDim.x * kRowWarps * 32) {
    const uint32_t row = first + lane;
    const uint32_t token = row % page, head = (row / page) % heads;
    PageDemotion d{};
    if (row < rows) d = p.demotions[row / page / heads];
    const bool mine = row < rows && token < uint32_t(d.rows);
    const bf16_t* src = mine ? plane.bf16.row(d.bf16_page, head, token) + layer * p.pools.bf16_stride_layer : nullptr;
    // 32 rows x kChunks pieces; piece c of the warp's rows is lane c % 32's, of row c / kChunks.
    __syncwarp();  // the previous rows' reads are done before they are overwritten
    OSCAR_UNROLL
    for (int i = 0; i < kChunks; ++i) {
      const int c = lane + 32 * i, r = c / kChunks, part = c % kChunks;
      const bf16_t* from = reinterpret_cast<const bf16_t*>(__shfl_sync(kFullMask, reinterpret_cast<uintptr_t>(src), r));
      ptx::cp_async16_if(from != nullptr, ptx::smem_address(staged + r * kStagedRowBytes<kHeadDim> + part * 16),
                         from != nullptr ? from + part * 8 : from);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<0>();
    __syncwarp();
    if (!mine) continue;
    uint32_t x[kHeadDim / 2];
    OSCAR_UNROLL
    for (int i = 0; i < kChunks; ++i) {
      const uint4 v = *reinterpret_cast<const uint4*>(staged + lane * kStagedRowBytes<kHeadDim> + i * 16);
      x[4 * i] = v.x;
      x[4 * i + 1] = v.y;
      x[4 * i + 2] = v.z;
      x[4 * i + 3] = v.w;
    }
    uint8_t* block = plane.int2.block(d.int2_page, head) + layer * p.pools.int2_stride_layer;
    store_quantized_row<kHeadDim, kGroup, kSelection>(x, plane.clip_k, layout, block, token);
  }
}

// Blocks along x for `rows` rows per (layer, K/V) plane: enough resident warps to hide
// latency across the whole grid; the rest loop.
// (An attribute of the current device, or `fallback` where it cannot be read: the launchers
// size grids and pick block shapes by it, and a failed query must not fail the launch.)
inline int current_device_attribute(cudaDeviceAttr attribute, int fallback) {
  int device = 0, value = fallback;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) {
    return fallback;
  }
  return value;
}
inline int multiprocessors() { return current_device_attribute(cudaDevAttrMultiProcessorCount, 132); }

inline dim3 grid_for(int64_t warp_items, int planes, int warps_per_block = kWarpsPerBlock) {
  const int sms = multiprocessors();
  const int64_t blocks = (warp_items + warps_per_block - 1) / warps_per_block;
  const int64_t cap = std::max<int64_t>(1, int64_t{sms} * 16 / planes);
  return dim3(static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, cap)), static_cast<unsigned>(planes));
}

// The closed list of compiled (head_dim, quant_group_size) pairs.
template <class Launch>
Status dispatch_shape(int head_dim, int group, Launch&& launch) {
#define OSCAR_WRITE_CASE(D, G) \
  if (head_dim == D && group == G) return launch.template operator()<D, G>();
  OSCAR_WRITE_CASE(64, 64)
  OSCAR_WRITE_CASE(64, 32)
  OSCAR_WRITE_CASE(128, 128)
  OSCAR_WRITE_CASE(128, 64)
  OSCAR_WRITE_CASE(128, 32)
  OSCAR_WRITE_CASE(256, 256)
  OSCAR_WRITE_CASE(256, 128)
  OSCAR_WRITE_CASE(256, 64)
  OSCAR_WRITE_CASE(256, 32)
#undef OSCAR_WRITE_CASE
  return unsupported("head_dim " + std::to_string(head_dim) + " with quant_group_size " + std::to_string(group) +
                     " is not compiled in");
}

}  // namespace write_detail

namespace write_detail {

// Why the tensor-core rotation cannot take these arguments, or "" when it can: it reads rows
// and R in 16-byte pieces and stores BF16 rows in 16-byte pieces.
inline std::string tensor_core_rotation_blocker(const AppendParams& p) {
  const int d = p.pools.k_int2.layout.head_dim;
  if (d > 128) return "head_dim " + std::to_string(d) + " is above the tensor-core rotation's 128";
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(p.k) || !aligned(p.v) || p.in_stride_token % 8 != 0 ||
      (p.pools.num_layers > 1 && p.in_stride_layer % 8 != 0)) {
    return "k, v, in_stride_token and in_stride_layer must be 16-byte aligned for the tensor-core rotation";
  }
  if (!bf16_rows_16b_aligned(p.pools.k_bf16) || !bf16_rows_16b_aligned(p.pools.v_bf16) ||
      p.pools.bf16_stride_layer % 8 != 0) {
    return "BF16 pools and their strides must be 16-byte aligned for the tensor-core rotation";
  }
  return {};
}

// Blocks along x per (layer, K/V) plane for the column kernel. Every block loads all of its
// plane's R from L2 (64 KB at d = 128: about a microsecond at one SM's share of the L2
// bandwidth, H200), so a decode-sized append gets at most one block per SM and plane, each
// rotating a few groups of rows; only where every block would have more than
// kColumnGroupsPerLoad groups does the grid fill the SMs with as many blocks as fit.
inline constexpr int64_t kColumnGroupsPerLoad = 4;
inline unsigned column_blocks(int64_t rows, int planes, int resident_per_sm) {
  const int64_t sms = multiprocessors();
  const int64_t groups = (rows + kColumnRows - 1) / kColumnRows;
  const int64_t one_per_sm = std::max<int64_t>(1, sms / planes);
  const int64_t cap = groups > one_per_sm * kColumnGroupsPerLoad
                          ? std::max<int64_t>(1, sms * resident_per_sm / planes)
                          : one_per_sm;
  return static_cast<unsigned>(std::clamp<int64_t>(groups, 1, std::min<int64_t>(cap, 65535)));
}

// Whether an append rotates any plane (R_K, or R_V where the values are not pre-rotated).
inline bool append_rotates(const AppendParams& p) {
  return p.pools.k_rotation || (p.pools.v_rotation && !p.values_prerotated);
}

// Which exact appends take append_columns_kernel: rotated ones where every block rotates one
// group of rows (at most SMs / planes groups per plane: up to 33 tokens of 8 KV heads in a
// one-layer launch on 132 SMs). Each block then does what a B = 1 block does (R's load, the
// slot check, one group): 3.4-3.6 us of kernel, where append_kernel's rotation of 8 rows per
// block from shared memory takes ~5 us (H100, docs/benchmarks.md). With more groups per
// block the broadcast of x from shared memory bounds it (~2050 cycles a group) and
// append_kernel is as fast or faster (B = 64: 8.6-9.0 against 8.1-8.2 us; unrotated bulk 868
// against 298 us). OSCAR_APPEND_COLUMN_KERNEL=0 / 1 makes it never / always (a measurement
// knob).
inline bool use_column_kernel(int64_t rows, int planes, bool rotated) {
#ifdef OSCAR_APPEND_COLUMN_KERNEL
  (void)rows, (void)planes, (void)rotated;
  return OSCAR_APPEND_COLUMN_KERNEL != 0;
#else
  const int64_t groups = (rows + kColumnRows - 1) / kColumnRows;
  return rotated && groups <= std::max<int64_t>(1, multiprocessors() / planes);
#endif
}

// The exact path's kernel and grid for an append of `rows` rows: append_columns_kernel where
// use_column_kernel says so, else append_kernel. Shared by append_kv and the benchmark's
// timeline readout, so the two cannot disagree on which kernel ran.
struct ExactAppendLaunch {
  bool columns;  // append_columns_kernel (blockDim D), else append_kernel (kAppendThreads)
  dim3 grid;
};

template <int D, int G>
ExactAppendLaunch exact_append_launch(const AppendParams& p, int64_t rows) {
  const int planes = p.pools.num_layers * 2;
  if constexpr (kColumnKernelFits<D>) {
    if (use_column_kernel(rows, planes, append_rotates(p))) {
      const int per_sm = resident_blocks_per_sm<append_columns_kernel<D, G>, D, 0>();
      return {true, dim3(column_blocks(rows, planes, per_sm), static_cast<unsigned>(planes))};
    }
  }
  return {false, grid_for(rows, planes, kAppendWarps)};
}

// The widest sorted clip selection the bf16x2 quantizers need for these pools: the narrow form
// (fewer registers) only where the host says every clip distance is within it. Either form
// writes the same bytes for any rank; the narrow one takes the bitwise search past 16.
inline bool wide_clip_selection(const LayeredKvPools& pools) {
  return pools.max_clip_distance < 0 || pools.max_clip_distance > kRowBf16x2NarrowSelection;
}

// Launches a bulk-append kernel (kThreads per block, kSmem of dynamic shared memory) over
// enough blocks to fill the GPU once; each block loops over its rows. kBlockRows: the rows a
// block takes per round (the grid is no larger than the rounds need). The opt-in to its
// shared memory is made once per (kernel, context), the occupancy query once per device
// (oscar/core/kernel_attributes.cuh says why).
template <auto kKernel, int kSmem, int kThreads, int kBlockRows>
Status launch_bulk_kernel(const AppendParams& params, int64_t rows, cudaStream_t stream) {
  OSCAR_RETURN_IF_ERROR(cuda_status(opt_in_dynamic_shared_memory(kKernel, kSmem), "append_kv shared-memory opt-in"));
  const int per_sm = resident_blocks_per_sm<kKernel, kThreads, kSmem>();
  const int planes = params.pools.num_layers * 2;
  const int64_t steps = (rows + kBlockRows - 1) / kBlockRows;  // rounds of the whole block
  const int64_t cap = std::max<int64_t>(1, int64_t{multiprocessors()} * per_sm / planes);
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(steps, 1, cap)), static_cast<unsigned>(planes));
  kKernel<<<grid, kThreads, kSmem, stream>>>(params);
  return cuda_status(cudaGetLastError(), "append_kv launch");
}
template <int D, int G, int S, bool kStaged, int kGroups>
Status launch_tile_kernel(const AppendParams& params, int64_t rows, cudaStream_t stream) {
  return launch_bulk_kernel<append_tensor_core_kernel<D, G, S, kStaged, kGroups>, kTensorCoreSmemBytes<D, kStaged, kGroups>,
                            kGroups * 128, kGroups * kWarpgroupRows>(params, rows, stream);
}

// Rotated bulk appends take append_rotating_producer_kernel where its shared memory fits.
// -DOSCAR_APPEND_ROTATING_PRODUCER=0 keeps them on append_tensor_core_kernel (a measurement
// and test knob).
#if defined(OSCAR_APPEND_ROTATING_PRODUCER)
inline constexpr bool kRotatingProducer = OSCAR_APPEND_ROTATING_PRODUCER;
#else
inline constexpr bool kRotatingProducer = true;
#endif

// The most warpgroups per block whose shared memory the device has. (Test knob:
// -DOSCAR_APPEND_TENSOR_CORE_GROUPS=1, 2 or 4 forces a count, so that a Hopper runs the others.)
template <int D, int G, int S, bool kStaged>
Status launch_tile_kernel_fitting(const AppendParams& params, int64_t rows, cudaStream_t stream) {
#if defined(OSCAR_APPEND_TENSOR_CORE_GROUPS)
  return launch_tile_kernel<D, G, S, kStaged, OSCAR_APPEND_TENSOR_CORE_GROUPS>(params, rows, stream);
#else
  const int smem = current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, 48 * 1024);
  if constexpr (kStaged && kRotatingProducer) {
    // Hopper only: elsewhere the producer's rotation is mma.sync, whose warps each read all of
    // R per 16 rows (~4 K cycles of shared memory per unit at d = 128: the producer would bound it).
    if (kRotatingSmemBytes<D> <= smem && current_device_attribute(cudaDevAttrComputeCapabilityMajor, 0) >= 9) {
      return launch_bulk_kernel<append_rotating_producer_kernel<D, G, S>, kRotatingSmemBytes<D>, kRotatingThreads,
                                kRotatingConsumers * kWarpgroupRows>(params, rows, stream);
    }
  }
  if (kTensorCoreSmemBytes<D, kStaged, 4> <= smem) return launch_tile_kernel<D, G, S, kStaged, 4>(params, rows, stream);
  if (kTensorCoreSmemBytes<D, kStaged, 2> <= smem) return launch_tile_kernel<D, G, S, kStaged, 2>(params, rows, stream);
  return launch_tile_kernel<D, G, S, kStaged, 1>(params, rows, stream);  // 96 KB at d = 128: every sm_80+
#endif
}

template <int D, int G, int S>
Status launch_append_tensor_cores(const AppendParams& params, int64_t rows, cudaStream_t stream) {
  if constexpr (D > 128) {
    return unsupported("append_kv: no tensor-core rotation for head_dim " + std::to_string(D));
  } else {
    const bool rotates = params.pools.k_rotation || (params.pools.v_rotation && !params.values_prerotated);
    return rotates ? launch_tile_kernel_fitting<D, G, S, true>(params, rows, stream)
                   : launch_tile_kernel_fitting<D, G, S, false>(params, rows, stream);
  }
}

}  // namespace write_detail

// Writes params.num_tokens new tokens of every layer in params.pools. error_flag is required.
inline Status append_kv(const AppendParams& params, cudaStream_t stream = nullptr) {
  OSCAR_RETURN_IF_ERROR(validate(params));
  if (!params.error_flag) return invalid_argument("error_flag must not be null");
  if (params.num_tokens == 0) return Status::Ok();
  using namespace write_detail;
  const int64_t rows = int64_t{params.num_tokens} * params.pools.k_int2.num_kv_heads;
  if (rows >= (int64_t{1} << 31) || params.pools.num_layers * 2 > 65535) {
    return invalid_argument("append_kv: too many rows or layers for one launch; split it");
  }
  // The blocker (a string) is only worked out where tensor cores are wanted: not on every
  // decode step's small append.
  const bool want_tensor_cores = params.rotation == AppendRotation::kTensorCores ||
                                 (params.rotation == AppendRotation::kAuto && rows >= kTensorCoreMinRows);
  bool tensor_cores = false;
  if (want_tensor_cores) {
    const std::string blocker = tensor_core_rotation_blocker(params);
    if (params.rotation == AppendRotation::kTensorCores && !blocker.empty()) {
      return unsupported("append_kv: " + blocker);
    }
    tensor_cores = blocker.empty();
  }
  if (params.num_tokens > kInBlockCheckLimit) {
    check_slots_kernel<<<(params.num_tokens + 255) / 256, 256, 0, stream>>>(params.slots, params.num_tokens,
                                                                            params.pools, params.error_flag);
    OSCAR_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "append_kv slot check launch"));
  }
  const Int2Layout& layout = params.pools.k_int2.layout;
  return dispatch_shape(layout.head_dim, layout.quant_group_size, [&]<int D, int G>() {
    if (tensor_cores) {
      return wide_clip_selection(params.pools)
                 ? launch_append_tensor_cores<D, G, kRowBf16x2WidestSelection>(params, rows, stream)
                 : launch_append_tensor_cores<D, G, kRowBf16x2NarrowSelection>(params, rows, stream);
    }
    const ExactAppendLaunch launch = exact_append_launch<D, G>(params, rows);
    if constexpr (kColumnKernelFits<D>) {
      if (launch.columns) {
        append_columns_kernel<D, G><<<launch.grid, D, 0, stream>>>(params);
        return cuda_status(cudaGetLastError(), "append_kv launch");
      }
    }
    constexpr int smem = kAppendSmemBytes<D>;
    const bool staged = params.pools.k_rotation || params.pools.v_rotation;
    if (staged) {
      OSCAR_RETURN_IF_ERROR(
          cuda_status(opt_in_dynamic_shared_memory(append_kernel<D, G>, smem), "append_kv shared-memory opt-in"));
    }
    append_kernel<D, G><<<launch.grid, kAppendThreads, staged ? smem : 0, stream>>>(params);
    return cuda_status(cudaGetLastError(), "append_kv launch");
  });
}

namespace write_detail {
// Whether demote_rows_kernel can take these pools: a thread per row needs head_dim <= 128
// (the row in registers) and 16-byte aligned BF16 rows (its staging copies); otherwise the
// warp-per-row demote_kernel runs, with the same bytes.
inline bool demote_by_rows(const LayeredKvPools& pools) {
#if defined(OSCAR_DEMOTE_ROWS_KERNEL)
  if (!OSCAR_DEMOTE_ROWS_KERNEL) return false;  // measurement knob: =0 forces demote_kernel
#endif
  return pools.k_int2.layout.head_dim <= 128 && bf16_rows_16b_aligned(pools.k_bf16) &&
         bf16_rows_16b_aligned(pools.v_bf16) && (pools.num_layers == 1 || pools.bf16_stride_layer % 8 == 0);
}
}  // namespace write_detail

// Quantizes the listed window pages of every layer into their INT2 pages. error_flag required.
inline Status demote_kv(const DemoteParams& params, cudaStream_t stream = nullptr) {
  OSCAR_RETURN_IF_ERROR(validate(params));
  if (!params.error_flag) return invalid_argument("error_flag must not be null");
  if (params.num_demotions == 0) return Status::Ok();
  using namespace write_detail;
  const Int2Layout& layout = params.pools.k_int2.layout;
  const int64_t rows = int64_t{params.num_demotions} * params.pools.k_int2.num_kv_heads * layout.page_size;
  if (rows >= (int64_t{1} << 31) || params.pools.num_layers * 2 > 65535) {
    return invalid_argument("demote_kv: too many rows or layers for one launch; split it");
  }
  if (params.num_demotions > kInBlockCheckLimit) {  // after every host check: a refusal queues nothing
    check_demotions_kernel<<<(params.num_demotions + 255) / 256, 256, 0, stream>>>(
        params.demotions, params.num_demotions, params.pools, params.error_flag);
    OSCAR_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "demote_kv check launch"));
  }
  const int64_t items = rows / kDemoteRowsPerItem;
  const int planes = params.pools.num_layers * 2;
  const bool rows_kernel = demote_by_rows(params.pools);
  return dispatch_shape(layout.head_dim, layout.quant_group_size, [&]<int D, int G>() {
    if constexpr (D <= 128) {
      if (rows_kernel) {
        const auto launch = [&](auto kernel) {
          // 4 blocks per SM need 139 KB of shared memory: ask for the largest carveout. Set at
          // every launch, so that it survives cudaDeviceReset, which a once-flag would not: a
          // host call (none in a graph replay; ~0.4 us event-timed, as the opt-in measured
          // before kernel_attributes.cuh cached it per context: a candidate for that cache).
          OSCAR_RETURN_IF_ERROR(cuda_status(
              cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
              "demote_kv: shared-memory carveout"));
          kernel<<<grid_for((rows + 31) / 32, planes, kRowWarps), kRowWarps * 32, 0, stream>>>(params);
          return cuda_status(cudaGetLastError(), "demote_kv launch");
        };
        return wide_clip_selection(params.pools) ? launch(demote_rows_kernel<D, G, kRowBf16x2WidestSelection>)
                                                 : launch(demote_rows_kernel<D, G, kRowBf16x2NarrowSelection>);
      }
    }
    demote_kernel<D, G><<<grid_for(items, planes), kThreads, 0, stream>>>(params);
    return cuda_status(cudaGetLastError(), "demote_kv launch");
  });
}

}  // namespace oscar
