// Register- and shared-memory-level building blocks of the GPU attention kernels (decode in
// paged_attention.cuh, many-row extend in extend_attention.cuh): fp16/bf16 packing, the
// magic-number INT2 unpack, the value channel order, a request's segment pages (the MMA and
// cp.async wrappers live in core/tensor_core.cuh). Device code only; no kernel here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "oscar/attention/attention_plan.hpp"
#include "oscar/core/tensor_core.cuh"
#include "oscar/kv/paged_kv.hpp"

namespace oscar {
namespace attention_detail {

using ptx::cp_async16_or_zero;
using ptx::cp_async4_or_zero;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::lds_u16;
using ptx::lds_u32;
using ptx::lds_v2;
using ptx::lds_v4;
using ptx::mul_wide;
using ptx::mma_bf16;
using ptx::mma_f16;
using ptx::smem_address;

inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// ---- register-level building blocks ------------------------------------------------------

OSCAR_DEVICE uint32_t half2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
OSCAR_DEVICE __half2 bits_half2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

OSCAR_DEVICE uint32_t bf16x2_bits(__nv_bfloat162 h) { return *reinterpret_cast<uint32_t*>(&h); }
OSCAR_DEVICE __nv_bfloat162 bits_bf16x2(uint32_t u) { return *reinterpret_cast<__nv_bfloat162*>(&u); }

OSCAR_DEVICE uint32_t pack_half2(float lo, float hi) { return half2_bits(__floats2half2_rn(lo, hi)); }
OSCAR_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Four bf16 values (one 8-byte load: channel 2e in the low half of word e) as floats.
OSCAR_DEVICE float4 bf16x4_to_float4(uint2 raw) {
  return make_float4(bf16_to_float(bf16_t{static_cast<uint16_t>(raw.x)}),
                     bf16_to_float(bf16_t{static_cast<uint16_t>(raw.x >> 16)}),
                     bf16_to_float(bf16_t{static_cast<uint16_t>(raw.y)}),
                     bf16_to_float(bf16_t{static_cast<uint16_t>(raw.y >> 16)}));
}

// Eight bf16 values (one 16-byte load of q: channel 2e in the low half of word e) as floats.
// (Written out rather than as two bf16x4_to_float4: that reschedules the d = 256 decode kernel.)
OSCAR_DEVICE void bf16x8_to_float(uint4 raw, float (&v)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    v[2 * e] = bf16_to_float(bf16_t{static_cast<uint16_t>(words[e])});
    v[2 * e + 1] = bf16_to_float(bf16_t{static_cast<uint16_t>(words[e] >> 16)});
  }
}

// Codes of field k (bits 2k..2k+1 of bytes 0 and 2 of w) as two exact fp16 values 0..3.
template <int k>
OSCAR_DEVICE uint32_t unpack_field(uint32_t w) {
  uint32_t magic;  // (w & mask) | 0x64006400: fp16 1024 + 4^k·c in each half
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(magic) : "r"(w), "r"(0x00030003u << (2 * k)), "r"(0x64006400u));
  constexpr float inv = 1.0f / float(1 << (2 * k));
  const __half2 scale = __float2half2_rn(inv);            // exact: a power of two
  const __half2 bias = __float2half2_rn(-1024.0f * inv);  // exact
  return half2_bits(__hfma2(bits_half2(magic), scale, bias));  // exact: the result is c
}

// Codes of field k as two fp16 values 1024 + 4^k·c, exact, in one LOP3: the key MMAs take
// them as they are, with q prescaled by 4^-k and the 1024·Σq' they add removed through the
// accumulator's initial value (int2_tile), which saves the HFMA2 of unpack_field.
template <int k>
OSCAR_DEVICE uint32_t unpack_field_biased(uint32_t w) {
  uint32_t magic;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(magic) : "r"(w), "r"(0x00030003u << (2 * k)), "r"(0x64006400u));
  return magic;
}

// Codes of field k as two fp16 subnormals 4^k·c·2^-24, exact, in one AND: no bias to remove,
// so nothing to round or cancel. The decode kernel's value MMAs take them as they are (fp16
// MMAs are exact on subnormal inputs) and scale each output register by 2^24·4^-k once, after
// its loop (value_field_scale); its BF16 value tiles meet them scaled by 4^k·2^-24.
template <int k>
OSCAR_DEVICE uint32_t unpack_field_subnormal(uint32_t w) {
  return w & (0x00030003u << (2 * k));
}

// Code field k of value register i (value_channel: register i holds field i % 4).
OSCAR_HOST_DEVICE constexpr int value_field(int i) { return i % 4; }

// The unit of value accumulator registers of code field k while a block reads INT2 values:
// the INT2 value codes enter the MMA as fp16 subnormals 4^k·c·2^-24 (unpack_field_subnormal:
// one AND per two codes, no bias), so the accumulators hold o·4^k·2^-24 until they are scaled
// back, once per warp after its tiles.
OSCAR_HOST_DEVICE constexpr float value_field_unit(int k) { return float(1 << (2 * k)) / float(1 << 24); }

// 2^x on the SFU, subnormal results flushed to 0 (exp2f adds a range reduction for them,
// ~6 instructions per call; a probability below 2^-126 of the running max adds nothing).
OSCAR_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Transposes the 8x8 16-bit matrix whose row lane/4, columns 2(lane%4)+{0,1} this lane holds.
OSCAR_DEVICE uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// kWords 32-bit words at p in one 4/8/16-byte load: through the read-only data path for
// global memory (kGlobal), a plain load for shared memory.
template <bool kGlobal, int kWords>
OSCAR_DEVICE void load_words(const void* p, uint32_t (&w)[kWords]) {
  static_assert(kWords == 1 || kWords == 2 || kWords == 4);
  using Vec = std::conditional_t<kWords == 1, uint32_t, std::conditional_t<kWords == 2, uint2, uint4>>;
  const Vec* vp = static_cast<const Vec*>(p);
  Vec v;
  if constexpr (kGlobal) {
    v = __ldg(vp);
  } else {
    v = *vp;
  }
  static_assert(sizeof(v) == sizeof(w));
  memcpy(w, &v, sizeof(w));
}

// ---- the channel order of the value fragments -----------------------------------------------
// Lane group r (lane / 4) reads bytes [r·D/32, (r+1)·D/32) of every value row. Its register i
// (0 <= i < D/8) of a token pair holds field i%4 of byte 2(i/8) + (i%8)/4 of that range, i.e.
// (format v1, one group per row) channel value_channel<D>(r, i). Output slot (m-tile M, row r)
// is register 2M, slot (M, row r+8) register 2M+1. BF16 value tiles load the same channels.
template <int D>
OSCAR_HOST_DEVICE constexpr int value_channel(int r, int i) {
  return r * (D / 32) + 2 * (i / 8) + (i % 8) / 4 + (i % 4) * (D / 4);
}


// One request's pages of one segment, resolved once per block: the tile loops then find a
// tile's pages with a shift and a mask (page sizes are powers of two) and one page-id load per
// 8-token half. Token counts are int32: the plan refuses longer requests.
struct SegmentPages {
  const int32_t* ids = nullptr;  // the request's page ids in this segment
  int32_t tokens = 0;
  int32_t start = 0;  // position of the segment's first token in the request
  int page_shift = 0;
  int32_t page_mask = 0;

  OSCAR_DEVICE int32_t page_id(int32_t token) const { return __ldg(ids + (token >> page_shift)); }
  OSCAR_DEVICE int32_t slot(int32_t token) const { return token & page_mask; }
};

OSCAR_DEVICE SegmentPages segment_pages(const PageTableRef& table, int32_t request, int32_t start) {
  SegmentPages s;
  s.ids = table.indices + table.indptr[request];
  s.tokens = static_cast<int32_t>(table.num_tokens(request));
  s.start = start;
  s.page_shift = __ffs(table.page_size) - 1;
  s.page_mask = table.page_size - 1;
  return s;
}

// Where the two 8-token halves of a tile live: page ids and slots (page 0 past the segment).
struct TileHalves {
  int32_t page[2];
  int32_t slot[2];
  bool present[2];
};

OSCAR_DEVICE TileHalves locate_tile(const SegmentPages& s, int32_t t0) {
  TileHalves h;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int32_t token = t0 + 8 * half;
    h.present[half] = token < s.tokens;
    h.page[half] = h.present[half] ? s.page_id(token) : 0;
    h.slot[half] = s.slot(token);
  }
  return h;
}

// The INT2 blocks of one KV head: pool base plus the head's offset, hoisted out of the loop.
struct Int2HeadBlocks {
  const uint8_t* k;
  const uint8_t* v;
  int64_t k_stride_page;
  int64_t v_stride_page;
  int32_t meta_offset;  // bytes of codes before a block's metadata
};

OSCAR_DEVICE Int2HeadBlocks int2_head_blocks(const Int2PoolRef& kpool, const Int2PoolRef& vpool, int32_t head) {
  return {kpool.data + head * kpool.stride_head, vpool.data + head * vpool.stride_head, kpool.stride_page,
          vpool.stride_page, static_cast<int32_t>(kpool.layout.code_bytes())};
}


// The part [begin, end) of a segment, whose tiles are numbered from first_tile in the
// request, that a work item's chunk covers, in the segment's own tile numbers.
OSCAR_DEVICE void chunk_tile_range(const AttentionWorkItem& item, const SegmentPages& seg, int32_t first_tile,
                                   int32_t& begin, int32_t& end) {
  begin = max(item.tile_begin - first_tile, 0);
  end = min(item.tile_end - first_tile, static_cast<int32_t>(attention_tiles(seg.tokens)));
}

// The row of q, out and lse ([tokens][qo_heads]) of a request's column (or row) c: query token
// q_begin + c / g, query head head·g + c % g of KV head `head`.
OSCAR_DEVICE int64_t query_row(int32_t q_begin, int32_t c, int g, int32_t num_qo_heads, int32_t head) {
  return int64_t{q_begin + c / g} * num_qo_heads + head * g + c % g;
}

// The exact merge of split chunks, block-wide (every thread calls it; it synchronizes): on
// entry w[k·C + c] holds chunk k's lse (base 2) of column c and every thread's writes of it
// are visible; on return lse[c] is the merged lse (-inf: no key in any chunk) and
// w[k·C + c] = 2^(lse_k - lse), the chunk's weight (0 for an empty column).
// One warp per column, its lanes over the chunks (threads a multiple of 32): a thread per
// column walking up to 64 chunks serially was ~1 us of the merge tail at B = 1.
template <int C>
OSCAR_DEVICE void chunk_merge_weights(float* w, float* lse, int chunks, int tid, int threads) {
  const int lane = tid % 32;
  for (int c = tid / 32; c < C; c += threads / 32) {
    float m = -INFINITY;
    for (int k = lane; k < chunks; k += 32) m = fmaxf(m, w[k * C + c]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(kFullMask, m, o));
    float sum = 0.0f;
    if (m != -INFINITY) {  // the same in every lane
      for (int k = lane; k < chunks; k += 32) sum += exp2f(w[k * C + c] - m);  // -inf: 0
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(kFullMask, sum, o);
    if (lane == 0) lse[c] = sum == 0.0f ? -INFINITY : m + log2f(sum);
  }
  __syncthreads();
  for (int idx = tid; idx < chunks * C; idx += threads) {
    const float l = lse[idx % C];
    w[idx] = l == -INFINITY ? 0.0f : exp2f(w[idx] - l);
  }
  __syncthreads();
}

// Σ_k w_k·o_k over a split request's chunks, for the first `valid_rows` of kRows rows of D
// elements (valid_rows <= kRows), into out; chunk k's rows start at base + k·stride and its
// weights at w[k·kWeightStride]. The partial outputs are in L2, so this serial tail is a few
// round trips: each thread owns kRows·D/threads elements and keeps kInFlight loads in flight;
// a remainder batch is predicated, not walked a chunk per round trip (38 chunks at B = 1 32K
// were 10 round trips, ~7.5 us on the H200). Rows past valid_rows are neither read (never
// written) nor stored; with kEveryRow all kRows are valid. The decode kernel's last block and
// the extend merge kernel both run it.
template <int D, int kRows, int kWeightStride, int kThreads, int kInFlight, bool kEveryRow = false>
OSCAR_DEVICE void merge_chunk_outputs(const float* base, size_t stride, const float* w, int chunks, int valid_rows,
                                      float* out, int tid) {
  constexpr int kPerThread = kRows * D / kThreads;
  static_assert(kRows * D % kThreads == 0 && kPerThread >= 1 && kInFlight >= kPerThread);
  constexpr int kBatch = kInFlight / kPerThread;  // chunks in flight
  // (A constant valid_rows = kRows still left a compare per element; kEveryRow drops them.)
  const auto valid = [&](int idx) { return kEveryRow || idx < valid_rows * D; };
  float o[kPerThread];
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) o[e] = 0.0f;
  for (int k0 = 0; k0 < chunks; k0 += kBatch) {
    float v[kBatch][kPerThread];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        const int idx = tid + e * kThreads;
        v[k][e] = k0 + k < chunks && valid(idx) ? __ldcg(base + (k0 + k) * stride + idx) : 0.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        if (k0 + k < chunks) o[e] = fmaf(w[(k0 + k) * kWeightStride + (tid + e * kThreads) / D], v[k][e], o[e]);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) {
    const int idx = tid + e * kThreads;
    if (valid(idx)) out[idx] = o[e];  // Σ w = 1, or every weight 0 for an empty state
  }
}

// ---- value fragments (both kernels) ---------------------------------------------------------
// A lane (r, j) holds the values of tokens 2j, 2j+1 (pair 0) and 2j+8, 2j+9 (pair 1) of a
// 16-token tile, channels value_channel(r, ·). Its registers c01[i] / c89[i] hold two tokens'
// value at one channel: the A fragments of Vᵀ in the decode kernel, the B fragments of V in
// the extend kernel, register for register.

// 32-bit words of codes one lane reads per token: key bytes [j·D/16, (j+1)·D/16) and value
// bytes [r·D/32, (r+1)·D/32) (2 bytes at D = 64, read as one 16-bit load).
template <int D>
struct LaneCodeWords {
  static constexpr int kKWords = D / 64;
  static constexpr int kVBytes = D / 32;
  static constexpr int kVWords = kVBytes >= 4 ? kVBytes / 4 : 1;
};

// INT2 values: registers u·8 .. u·8+7 (unit u of D/64) as exact fp16 codes, from the value
// bytes vw[token] of tokens 2j, 2j+1, 2j+8, 2j+9 (one PRMT interleaves two tokens' bytes).
// kSubnormal: the codes as unpack_field_subnormal's 4^k·c·2^-24 (the decode kernel), else as
// exact fp16 values c (the extend kernel).
template <int k, bool kSubnormal>
OSCAR_DEVICE uint32_t unpack_value_field(uint32_t w) {
  if constexpr (kSubnormal) {
    return unpack_field_subnormal<k>(w);
  } else {
    return unpack_field<k>(w);
  }
}

template <int D, bool kSubnormal = false>
OSCAR_DEVICE void int2_value_codes(const uint32_t (&vw)[4][LaneCodeWords<D>::kVWords], int u, uint32_t (&c01)[8],
                                   uint32_t (&c89)[8]) {
  uint32_t x[2];
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const uint32_t* t0 = vw[2 * pair];
    const uint32_t* t1 = vw[2 * pair + 1];
    if constexpr (LaneCodeWords<D>::kVBytes == 2) {
      x[pair] = t0[0] | (t1[0] << 16);
    } else {
      x[pair] = __byte_perm(t0[u / 2], t1[u / 2], u % 2 ? 0x7632 : 0x5410);
    }
  }
  const uint32_t xlo0 = x[0], xhi0 = x[0] >> 8, xlo1 = x[1], xhi1 = x[1] >> 8;
  constexpr bool S = kSubnormal;
  c01[0] = unpack_value_field<0, S>(xlo0); c01[1] = unpack_value_field<1, S>(xlo0);
  c01[2] = unpack_value_field<2, S>(xlo0); c01[3] = unpack_value_field<3, S>(xlo0);
  c01[4] = unpack_value_field<0, S>(xhi0); c01[5] = unpack_value_field<1, S>(xhi0);
  c01[6] = unpack_value_field<2, S>(xhi0); c01[7] = unpack_value_field<3, S>(xhi0);
  c89[0] = unpack_value_field<0, S>(xlo1); c89[1] = unpack_value_field<1, S>(xlo1);
  c89[2] = unpack_value_field<2, S>(xlo1); c89[3] = unpack_value_field<3, S>(xlo1);
  c89[4] = unpack_value_field<0, S>(xhi1); c89[5] = unpack_value_field<1, S>(xhi1);
  c89[6] = unpack_value_field<2, S>(xhi1); c89[7] = unpack_value_field<3, S>(xhi1);
}

// BF16 keys: the lane's rows r and r + 8 of a tile (zero past `valid` or in an absent half),
// channels [32·b + 8j, 32·b + 8j + 8) of each block b of 32, straight from the pool. Both
// kernels' BF16 tiles read their keys this way (as A operands in the decode kernel, B in the
// row-tiled one).
template <int D>
OSCAR_DEVICE void load_bf16_keys(const Bf16PoolRef& kpool, int32_t head, const TileHalves& th, int valid, int lane,
                                 uint4 (&krow)[2][D / 32]) {
  const int r = lane / 4, j = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const bool ok = th.present[half] && r + 8 * half < valid;
    const bf16_t* row = kpool.row(th.page[half], head, th.slot[half] + r);
#pragma unroll
    for (int blk = 0; blk < D / 32; ++blk) {
      krow[half][blk] = ok ? __ldg(reinterpret_cast<const uint4*>(row + blk * 32 + 8 * j)) : make_uint4(0, 0, 0, 0);
    }
  }
}

// BF16 values: the lane's channels of tokens 2j, 2j+1, 2j+8, 2j+9 of a tile (zero past
// `valid`), vw[token][field k][word], straight from the pool.
template <int D>
OSCAR_DEVICE void load_bf16_values(const Bf16PoolRef& vpool, int32_t head, const TileHalves& th, int valid, int lane,
                                   uint32_t (&vw)[4][4][D / 64]) {
  const int r = lane / 4, j = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const bool ok = th.present[half] && 2 * j + t + 8 * half < valid;
      const bf16_t* row = vpool.row(th.page[half], head, th.slot[half] + 2 * j + t);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (ok) {
          load_words<true>(row + r * (D / 32) + k * (D / 4), vw[2 * half + t][k]);
        } else {
#pragma unroll
          for (int w = 0; w < D / 64; ++w) vw[2 * half + t][k][w] = 0;
        }
      }
    }
  }
}

// Registers wi·8 .. wi·8+7 of the loaded BF16 values, two tokens per register.
template <int D>
OSCAR_DEVICE void bf16_value_pairs(const uint32_t (&vw)[4][4][D / 64], int wi, uint32_t (&c01)[8], uint32_t (&c89)[8]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    c01[k] = __byte_perm(vw[0][k][wi], vw[1][k][wi], 0x5410);
    c01[4 + k] = __byte_perm(vw[0][k][wi], vw[1][k][wi], 0x7632);
    c89[k] = __byte_perm(vw[2][k][wi], vw[3][k][wi], 0x5410);
    c89[4 + k] = __byte_perm(vw[2][k][wi], vw[3][k][wi], 0x7632);
  }
}

}  // namespace attention_detail
}  // namespace oscar
