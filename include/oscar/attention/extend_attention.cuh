// Row-tiled extend: attention of many query rows per request (chunked prefill, prefix-cache
// hits, speculative verification) over the paged OSCAR cache, causal, split-KV.
//
// Why a second kernel. The decode kernel puts 16 keys in the MMA's M dimension and 8 query
// columns in N, so every 8 columns of an extend re-read and re-unpacked the whole prefix (a
// 16-token extend over 32K keys took 2.5x a decode, H200, docs/benchmarks.md). Here the
// queries are in M, as in FlashAttention-2: a block holds 64 rows (a row is one query token x
// one query head of the block's KV head), 16 per warp, and every warp multiplies the same
// staged key tile, so a tile's codes are read once per 64 rows and unpacked once per 16.
//
// - Scores: S[16 rows x 16 keys] = q·K^T, 2 n-tiles of 8 keys. INT2 keys enter as the B
//   operand straight from their codes (1024 + 4^k·c against q·4^-k, as in the decode kernel;
//   the channel order each lane reads is folded into q's A fragment), then s·(q·c) + offset·Σq.
// - Values: O[16 rows x D] += P'·C with P' = p·scale per key (the S accumulator is already the
//   A fragment of P, no transpose) and C the value codes as exact fp16 0..3, whose B fragments
//   are the decode kernel's A fragments of V^T register for register; Σ p·offset per row is
//   a running scalar. BF16 sink/window tiles use the same accumulators (bf16 MMAs, q as bf16
//   hi + lo).
// - The INT2 tiles are staged once per block through a cp.async ring shared by its 4 warps.
// - Every block writes its rows' partial (o, lse) to the workspace; extend_merge_kernel then
//   merges a request's chunks exactly, un-rotates by R_Vᵀ and writes bf16 (two launches, no
//   arrival counters). q is rotated by R_K once per query row by rotate_queries_kernel, not
//   once per chunk.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "oscar/attention/attention_fragments.cuh"
#include "oscar/attention/attention_plan.hpp"
#include "oscar/attention/paged_attention_params.hpp"
#include "oscar/kv/paged_kv.hpp"

namespace oscar {
namespace attention_detail {

inline constexpr int kExtendWarps = 4;
inline constexpr int kExtendThreads = 32 * kExtendWarps;
inline constexpr int kExtendRows = kAttentionRowTile;  // 16 per warp
static_assert(kExtendRows == 16 * kExtendWarps);
inline constexpr int kExtendStageTiles = 2;  // 16-token tiles per pipeline stage (one barrier each)
inline constexpr int kExtendStages = 4;

// 32-bit words of codes one lane reads per token: key bytes [j·D/16, (j+1)·D/16) and value
// bytes [r·D/32, (r+1)·D/32) (2 bytes at D = 64, read as one 16-bit load).
template <int D>
struct LaneCodeWords {
  static constexpr int kKWords = D / 64;
  static constexpr int kVBytes = D / 32;
  static constexpr int kVWords = kVBytes >= 4 ? kVBytes / 4 : 1;
};

// One pipeline stage: K codes [keys][D/4], V codes [keys][D/4], K meta [keys], V meta [keys].
template <int D>
struct ExtendStage {
  static constexpr int kKeys = kAttentionTileTokens * kExtendStageTiles;
  static constexpr int kRowBytes = D / 4;
  static constexpr int kCodes = kKeys * kRowBytes;
  static constexpr int kVCodes = kCodes;
  static constexpr int kKMeta = 2 * kCodes;
  static constexpr int kVMeta = kKMeta + 4 * kKeys;
  static constexpr int kBytes = kVMeta + 4 * kKeys;
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kCodeChunks = 2 * kKeys * kChunksPerRow;  // K and V
  static constexpr int kMetaChunks = 2 * kKeys / 4;              // 4 tokens' words per 16 bytes
  static constexpr int kChunks = kCodeChunks + kMetaChunks;
  static_assert(kRowBytes % 16 == 0, "whole 16-byte chunks per row");
};

template <int D>
struct ExtendLayout {
  static constexpr size_t q_rows = 0;  // float [64][D]: the block's q rows; later each warp's o
  static constexpr size_t q_bf16 = q_rows + sizeof(float) * kExtendRows * D;  // uint4 [warps][D/16][2][32]
  static constexpr size_t stages = q_bf16 + sizeof(uint4) * kExtendWarps * (D / 16) * 2 * 32;
  static constexpr size_t bytes = stages + size_t{kExtendStages} * ExtendStage<D>::kBytes;
};

struct ExtendArgs {
  PagedAttentionParams p;
  const AttentionWorkItem* items;
  float* partial_o;          // [items][kv_heads][64][D]
  float* partial_lse;        // [items][kv_heads][64], base 2
  const float* rotated_q;    // [tokens][qo_heads][D] float, or null: read p.q (bf16) as it is
  int32_t group_size;
  float scale2;  // sm_scale·log2(e)
};

// Per-warp state of this lane's two rows (r, r+8) of the warp's 16.
template <int D>
struct RowState {
  float o[D / 8][4];  // n-tile i: {row r, row r, row r+8, row r+8} x channels of columns 2j, 2j+1
  float m[2];
  float l[2];       // lane-partial; summed over the row's 4 lanes at the end
  float offset[2];  // lane-partial Σ p·offset of INT2 values
};

// Masks, runs the online-softmax update on this lane's scores s[n-tile][c] (c: {r, key 2j},
// {r, 2j+1}, {r+8, 2j}, {r+8, 2j+1}) and leaves the probabilities in s. `first_key` is the
// position of the tile's first key, `valid` the keys inside the segment.
template <int D>
OSCAR_DEVICE void row_softmax_step(RowState<D>& st, float (&s)[2][4], bool mask, int32_t first_key, int valid,
                                   const int32_t (&q_pos)[2], int j) {
  if (mask) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int key = 8 * n + 2 * j + (c & 1);
        if (key >= valid || first_key + key > q_pos[c >> 1]) s[n][c] = -INFINITY;
      }
    }
  }
  // Lazy running max (as in the decode kernel): moves only past +8 in log2 units.
  constexpr float kMaxGrowth = 8.0f;
  bool grow = false;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) grow |= s[n][c] > st.m[c >> 1] + kMaxGrowth;
  }
  if (__any_sync(kFullMask, grow)) {
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float tile_max = fmaxf(fmaxf(s[0][2 * i], s[0][2 * i + 1]), fmaxf(s[1][2 * i], s[1][2 * i + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float m_new = fmaxf(st.m[i], tile_max);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // every key so far masked
      alpha[i] = fast_exp2(st.m[i] - m_use);
      st.m[i] = m_new;
      st.l[i] *= alpha[i];
      st.offset[i] *= alpha[i];
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      st.o[nt][0] *= alpha[0];
      st.o[nt][1] *= alpha[0];
      st.o[nt][2] *= alpha[1];
      st.o[nt][3] *= alpha[1];
    }
  }
  float m_use[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) m_use[i] = st.m[i] == -INFINITY ? 0.0f : st.m[i];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[n][c] = fast_exp2(s[n][c] - m_use[c >> 1]);
      st.l[c >> 1] += s[n][c];
    }
  }
}

// Value codes of tokens 2j, 2j+1 (x01) and 2j+8, 2j+9 (x89) of this lane group's bytes, as the
// B fragments of n-tile u*8 + idx (exact fp16 codes), then O += P'·C for those n-tiles.
template <int D>
OSCAR_DEVICE void int2_values(RowState<D>& st, const uint32_t (&pa)[4], const uint32_t (&vw)[4][LaneCodeWords<D>::kVWords]) {
  using Raw = LaneCodeWords<D>;
  constexpr int kUnits = D / 64;
  uint32_t x[2][kUnits];
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const uint32_t* t0 = vw[2 * pair];
    const uint32_t* t1 = vw[2 * pair + 1];
    if constexpr (Raw::kVBytes == 2) {
      x[pair][0] = t0[0] | (t1[0] << 16);
    } else {
#pragma unroll
      for (int w = 0; w < Raw::kVWords; ++w) {
        x[pair][2 * w] = __byte_perm(t0[w], t1[w], 0x5410);
        x[pair][2 * w + 1] = __byte_perm(t0[w], t1[w], 0x7632);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    const uint32_t xlo0 = x[0][u], xhi0 = x[0][u] >> 8, xlo1 = x[1][u], xhi1 = x[1][u] >> 8;
    const uint32_t c01[8] = {unpack_field<0>(xlo0), unpack_field<1>(xlo0), unpack_field<2>(xlo0),
                             unpack_field<3>(xlo0), unpack_field<0>(xhi0), unpack_field<1>(xhi0),
                             unpack_field<2>(xhi0), unpack_field<3>(xhi0)};
    const uint32_t c89[8] = {unpack_field<0>(xlo1), unpack_field<1>(xlo1), unpack_field<2>(xlo1),
                             unpack_field<3>(xlo1), unpack_field<0>(xhi1), unpack_field<1>(xhi1),
                             unpack_field<2>(xhi1), unpack_field<3>(xhi1)};
#pragma unroll
    for (int idx = 0; idx < 8; ++idx) mma_f16(st.o[u * 8 + idx], pa, c01[idx], c89[idx]);
  }
}

// One staged INT2 tile (16 keys at key offset kb of the stage) for this warp's 16 rows.
template <int D>
OSCAR_DEVICE void extend_int2_tile(RowState<D>& st, const uint32_t (&qa)[D / 16][4], const float (&qsum)[2],
                                   const float (&key_bias)[2], const unsigned char* stage, int kb, bool mask,
                                   int32_t first_key, int valid, const int32_t (&q_pos)[2], float scale2, int lane) {
  using S = ExtendStage<D>;
  using Raw = LaneCodeWords<D>;
  const int r = lane / 4, j = lane % 4;
  // Key rows r (n-tile 0) and r + 8 (n-tile 1): the bytes [j·D/16, (j+1)·D/16) of each.
  uint32_t kw[2][Raw::kKWords];
#pragma unroll
  for (int n = 0; n < 2; ++n) load_words<false>(stage + (kb + 8 * n + r) * S::kRowBytes + j * (D / 16), kw[n]);
  // Metadata of this lane's score columns: keys 8n + 2j, 8n + 2j + 1.
  uint2 kmeta[2], vmeta[2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    kmeta[n] = *reinterpret_cast<const uint2*>(stage + S::kKMeta + 4 * (kb + 8 * n + 2 * j));
    vmeta[n] = *reinterpret_cast<const uint2*>(stage + S::kVMeta + 4 * (kb + 8 * n + 2 * j));
  }
  // Value codes of tokens 2j, 2j+1, 2j+8, 2j+9, bytes [r·D/32, (r+1)·D/32).
  uint32_t vw[4][Raw::kVWords];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const unsigned char* p = stage + S::kVCodes + (kb + 8 * half + 2 * j + t) * S::kRowBytes + r * Raw::kVBytes;
      if constexpr (Raw::kVBytes == 2) {
        vw[2 * half + t][0] = *reinterpret_cast<const unsigned short*>(p);
      } else {
        load_words<false>(p, vw[2 * half + t]);
      }
    }
  }

  // Scores: four accumulators (n-tile x even/odd k-step), so no chain is longer than D/32 MMAs.
  float acc[2][4], acc_odd[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    acc[n][0] = acc[n][1] = -key_bias[0];
    acc[n][2] = acc[n][3] = -key_bias[1];
    acc_odd[n][0] = acc_odd[n][1] = acc_odd[n][2] = acc_odd[n][3] = 0.0f;
  }
#pragma unroll
  for (int wi = 0; wi < Raw::kKWords; ++wi) {
    const uint32_t lo0 = kw[0][wi], lo1 = kw[1][wi];
    const uint32_t hi0 = lo0 >> 8, hi1 = lo1 >> 8;
#define OSCAR_EXTEND_KSTEP(K, ACC)                                                                    \
  mma_f16(ACC[0], qa[wi * 4 + K], unpack_field_biased<K>(lo0), unpack_field_biased<K>(hi0));         \
  mma_f16(ACC[1], qa[wi * 4 + K], unpack_field_biased<K>(lo1), unpack_field_biased<K>(hi1));
    OSCAR_EXTEND_KSTEP(0, acc) OSCAR_EXTEND_KSTEP(1, acc_odd) OSCAR_EXTEND_KSTEP(2, acc) OSCAR_EXTEND_KSTEP(3, acc_odd)
#undef OSCAR_EXTEND_KSTEP
  }
  float s[2][4];
  float sv[2][2], ov[2][2];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const float2 k0 = __half22float2(bits_half2(kmeta[n].x)), k1 = __half22float2(bits_half2(kmeta[n].y));
    const float2 v0 = __half22float2(bits_half2(vmeta[n].x)), v1 = __half22float2(bits_half2(vmeta[n].y));
    const float sk[2] = {k0.x, k1.x}, ok[2] = {k0.y, k1.y};
    sv[n][0] = v0.x;
    sv[n][1] = v1.x;
    ov[n][0] = v0.y;
    ov[n][1] = v1.y;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[n][c] = ((acc[n][c] + acc_odd[n][c]) * sk[c & 1] + ok[c & 1] * qsum[c >> 1]) * scale2;
    }
  }
  row_softmax_step<D>(st, s, mask, first_key, valid, q_pos, j);
  // Masked keys have p = 0 and (past the segment) zero metadata: they add nothing.
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) st.offset[c >> 1] += s[n][c] * ov[n][c & 1];
  }
  // P' = p·scale as the A fragment: {row r, keys 2j..}, {row r+8, 2j..}, {r, 2j+8..}, {r+8, 2j+8..}.
  const uint32_t pa[4] = {pack_half2(s[0][0] * sv[0][0], s[0][1] * sv[0][1]),
                          pack_half2(s[0][2] * sv[0][0], s[0][3] * sv[0][1]),
                          pack_half2(s[1][0] * sv[1][0], s[1][1] * sv[1][1]),
                          pack_half2(s[1][2] * sv[1][0], s[1][3] * sv[1][1])};
  int2_values<D>(st, pa, vw);
}

// One BF16 tile (sink or window) for this warp's rows, read straight from the pool (these
// segments are a few tiles per request). qb: this lane's {hi, lo} A fragments per k-step.
template <int D>
OSCAR_DEVICE void extend_bf16_tile(RowState<D>& st, const uint4* qb, const Bf16PoolRef& kpool,
                                   const Bf16PoolRef& vpool, int32_t head, const TileHalves& th, int32_t first_key,
                                   int valid, const int32_t (&q_pos)[2], float scale2, int lane) {
  constexpr int kVWords = D / 64;
  const int r = lane / 4, j = lane % 4;
  // Keys r and r + 8: channels [32·b + 8j, 32·b + 8j + 8) of each block b of 32.
  uint4 krow[2][D / 32];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const bool ok = th.present[n] && r + 8 * n < valid;
    const bf16_t* row = kpool.row(th.page[n], head, th.slot[n] + r);
#pragma unroll
    for (int blk = 0; blk < D / 32; ++blk) {
      krow[n][blk] = ok ? __ldg(reinterpret_cast<const uint4*>(row + blk * 32 + 8 * j)) : make_uint4(0, 0, 0, 0);
    }
  }
  // Values: channels value_channel(r, ·) of tokens 2j, 2j+1, 2j+8, 2j+9 (as the decode kernel).
  uint32_t vw[4][4][kVWords];
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
          for (int w = 0; w < kVWords; ++w) vw[2 * half + t][k][w] = 0;
        }
      }
    }
  }
  float acc[2][4] = {}, acc_lo[2][4] = {};
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    const uint4 hi = qb[(2 * s) * 32], lo = qb[(2 * s + 1) * 32];
    const uint32_t a_hi[4] = {hi.x, hi.y, hi.z, hi.w}, a_lo[4] = {lo.x, lo.y, lo.z, lo.w};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const uint4 kr = krow[n][s / 2];
      const uint32_t b0 = s % 2 ? kr.z : kr.x, b1 = s % 2 ? kr.w : kr.y;
      mma_bf16(acc[n], a_hi, b0, b1);
      mma_bf16(acc_lo[n], a_lo, b0, b1);
    }
  }
  float sc[2][4];
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) sc[n][c] = (acc[n][c] + acc_lo[n][c]) * scale2;
  }
  row_softmax_step<D>(st, sc, true, first_key, valid, q_pos, j);
  const uint32_t pa[4] = {pack_bf16x2(sc[0][0], sc[0][1]), pack_bf16x2(sc[0][2], sc[0][3]),
                          pack_bf16x2(sc[1][0], sc[1][1]), pack_bf16x2(sc[1][2], sc[1][3])};
#pragma unroll
  for (int wi = 0; wi < kVWords; ++wi) {
    uint32_t c01[8], c89[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c01[k] = __byte_perm(vw[0][k][wi], vw[1][k][wi], 0x5410);
      c01[4 + k] = __byte_perm(vw[0][k][wi], vw[1][k][wi], 0x7632);
      c89[k] = __byte_perm(vw[2][k][wi], vw[3][k][wi], 0x5410);
      c89[4 + k] = __byte_perm(vw[2][k][wi], vw[3][k][wi], 0x7632);
    }
#pragma unroll
    for (int idx = 0; idx < 8; ++idx) mma_bf16(st.o[wi * 8 + idx], pa, c01[idx], c89[idx]);
  }
}

// Which 16-byte runs of a stage this thread copies, fixed for the whole loop: code chunk
// `tid` (K rows, then V rows) and, for kMetaChunks threads, one chunk of 4 tokens' metadata.
template <int D>
struct ExtendCopyRole {
  const uint8_t* code_pool = nullptr;  // the K or V blocks of the block's head; null: no code chunk
  int64_t code_stride = 0;
  int code_key = 0;        // token of the stage
  int code_src = 0;        // byte offset in the token's row
  uint32_t code_dst = 0;   // byte offset in the stage
  const uint8_t* meta_pool = nullptr;  // null: no metadata chunk
  int64_t meta_stride = 0;
  int meta_key = 0;
  int meta_src = 0;        // the blocks' metadata offset
  uint32_t meta_dst = 0;
};

template <int D>
OSCAR_DEVICE ExtendCopyRole<D> extend_copy_role(const Int2HeadBlocks& blocks, int tid) {
  using S = ExtendStage<D>;
  static_assert(S::kCodeChunks <= kExtendThreads && S::kMetaChunks <= kExtendThreads, "one chunk per thread");
  ExtendCopyRole<D> role;
  if (tid < S::kCodeChunks) {
    const int tensor = tid / (S::kKeys * S::kChunksPerRow);
    const int rem = tid % (S::kKeys * S::kChunksPerRow);
    role.code_pool = tensor == 0 ? blocks.k : blocks.v;
    role.code_stride = tensor == 0 ? blocks.k_stride_page : blocks.v_stride_page;
    role.code_key = rem / S::kChunksPerRow;
    role.code_src = (rem % S::kChunksPerRow) * 16;
    role.code_dst = tensor * S::kCodes + role.code_key * S::kRowBytes + role.code_src;
  }
  // Metadata chunks go to the threads after the code chunks (wrapping around).
  const int m = (tid - S::kCodeChunks + kExtendThreads) % kExtendThreads;
  if (m < S::kMetaChunks) {
    const int tensor = m / (S::kKeys / 4);
    role.meta_pool = tensor == 0 ? blocks.k : blocks.v;
    role.meta_stride = tensor == 0 ? blocks.k_stride_page : blocks.v_stride_page;
    role.meta_key = 4 * (m % (S::kKeys / 4));  // 4 tokens of one page: pages hold >= 8
    role.meta_src = blocks.meta_offset;
    role.meta_dst = S::kKMeta + tensor * 4 * S::kKeys + 4 * role.meta_key;
  }
  return role;
}

// Issues this thread's copies of one stage: tiles from tile0 on, tokens below `limit` (the
// chunk's and the segment's end). Rows past it keep stale codes (finite whatever they are:
// every bit pattern is a code) and get zero metadata, so their p = 0 meets a zero scale and
// offset. Commits one group, empty or not.
template <int D>
OSCAR_DEVICE void issue_extend_stage(uint32_t stage, const SegmentPages& seg, const ExtendCopyRole<D>& role,
                                     int32_t tile0, int32_t limit) {
  using S = ExtendStage<D>;
  const int32_t first_token = tile0 * kAttentionTileTokens;
  if (role.code_pool) {
    const int32_t token = first_token + role.code_key;
    if (token < limit) {
      cp_async16(stage + role.code_dst, role.code_pool + seg.page_id(token) * role.code_stride +
                                            seg.slot(token) * S::kRowBytes + role.code_src);
    }
  }
  if (role.meta_pool) {
    const int32_t token = first_token + role.meta_key;
    if (token < limit) {
      cp_async16(stage + role.meta_dst,
                 role.meta_pool + seg.page_id(token) * role.meta_stride + role.meta_src + seg.slot(token) * 4);
    } else {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(stage + role.meta_dst), "r"(0u) : "memory");
    }
  }
  cp_async_commit();
}

template <int D>
__global__ void __launch_bounds__(kExtendThreads, 2) extend_attention_kernel(const ExtendArgs args) {
  using L = ExtendLayout<D>;
  using S = ExtendStage<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* q_rows = reinterpret_cast<float*>(smem + L::q_rows);
  uint4* q_bf16 = reinterpret_cast<uint4*>(smem + L::q_bf16);
  unsigned char* stages = smem + L::stages;

  const PagedAttentionParams& p = args.p;
  const PagedKvRef& kv = p.kv;
  const int item_index = blockIdx.x;
  const AttentionWorkItem item = args.items[item_index];
  const int32_t head = blockIdx.y;
  const int32_t num_kv_heads = gridDim.y;
  const int32_t b_req = item.request;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int r = lane / 4, j = lane % 4;
  const int g = args.group_size;

  const SegmentPages sink = segment_pages(kv.sink, b_req, 0);
  const SegmentPages body = segment_pages(kv.int2, b_req, sink.tokens);
  const SegmentPages recent = segment_pages(kv.recent, b_req, sink.tokens + body.tokens);
  const int32_t length = recent.start + recent.tokens;
  const int32_t q_begin = p.qo_indptr[b_req];
  const int32_t n_q = p.qo_indptr[b_req + 1] - q_begin;
  const int32_t row0 = item.column_tile * kExtendRows;
  const int32_t n_rows = n_q * g;  // rows of the request: query token x query head of this KV head

  // 1. The block's q rows (rotated once by rotate_queries_kernel, or as given), zero past the end.
  for (int idx = tid; idx < kExtendRows * D; idx += kExtendThreads) {
    const int row = idx / D, i = idx % D;
    const int32_t gr = row0 + row;
    float v = 0.0f;
    if (gr < n_rows) {
      const int64_t qrow = int64_t{q_begin + gr / g} * p.num_qo_heads + head * g + gr % g;
      v = args.rotated_q ? args.rotated_q[qrow * D + i]
                         : __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p.q + qrow * D + i));
    }
    q_rows[idx] = v;
  }
  __syncthreads();

  // 2. This lane's A fragments of rows r and r + 8 of its warp: fp16 (x 4^-k for code field k,
  // channels in the order the lane's key bytes hold them) for INT2 keys, bf16 hi/lo for BF16
  // keys (in shared memory: only the few BF16 tiles read them).
  const float* qr0 = q_rows + (16 * warp + r) * D;
  const float* qr1 = qr0 + 8 * D;
  uint32_t qa[D / 16][4];
  float bias_part[2] = {0.0f, 0.0f};
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    const int wi = s / 4, k = s % 4;
    const int ch = j * (D / 16) + 4 * wi + k * (D / 4);
    const float inv = 1.0f / float(1 << (2 * k));  // exact scaling
    qa[s][0] = pack_half2(qr0[ch + 0] * inv, qr0[ch + 2] * inv);
    qa[s][1] = pack_half2(qr1[ch + 0] * inv, qr1[ch + 2] * inv);
    qa[s][2] = pack_half2(qr0[ch + 1] * inv, qr0[ch + 3] * inv);
    qa[s][3] = pack_half2(qr1[ch + 1] * inv, qr1[ch + 3] * inv);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 h = __half22float2(bits_half2(qa[s][e]));
      bias_part[e & 1] += h.x + h.y;
    }
  }
  float key_bias[2], qsum[2];
  {
    float sum[2] = {0.0f, 0.0f};
    for (int i = j; i < D; i += 4) {
      sum[0] += qr0[i];
      sum[1] += qr1[i];
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      bias_part[i] += __shfl_xor_sync(kFullMask, bias_part[i], 1);
      bias_part[i] += __shfl_xor_sync(kFullMask, bias_part[i], 2);
      sum[i] += __shfl_xor_sync(kFullMask, sum[i], 1);
      sum[i] += __shfl_xor_sync(kFullMask, sum[i], 2);
      key_bias[i] = 1024.0f * bias_part[i];
      qsum[i] = sum[i];
    }
  }
  uint4* qb = q_bf16 + warp * (D / 16) * 2 * 32 + lane;
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    const int ch = (s / 2) * 32 + 8 * j + 4 * (s % 2);
    float hi[2][4], lo[2][4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      hi[0][e] = __bfloat162float(__float2bfloat16_rn(qr0[ch + e]));
      lo[0][e] = qr0[ch + e] - hi[0][e];
      hi[1][e] = __bfloat162float(__float2bfloat16_rn(qr1[ch + e]));
      lo[1][e] = qr1[ch + e] - hi[1][e];
    }
    // A fragment: {row r, k 2j..}, {row r+8, 2j..}, {r, 2j+8..}, {r+8, 2j+8..} = channels
    // ch, ch+1 | ch+2, ch+3 (the B fragment of a key row reads the same channels).
    qb[(2 * s) * 32] = make_uint4(pack_bf16x2(hi[0][0], hi[0][1]), pack_bf16x2(hi[1][0], hi[1][1]),
                                  pack_bf16x2(hi[0][2], hi[0][3]), pack_bf16x2(hi[1][2], hi[1][3]));
    qb[(2 * s + 1) * 32] = make_uint4(pack_bf16x2(lo[0][0], lo[0][1]), pack_bf16x2(lo[1][0], lo[1][1]),
                                      pack_bf16x2(lo[0][2], lo[0][3]), pack_bf16x2(lo[1][2], lo[1][3]));
  }
  int32_t q_pos[2];
  int32_t warp_min_pos;  // the oldest query of the warp: keys up to it need no causal mask
  {
    const int32_t gr0 = row0 + 16 * warp + r, gr1 = gr0 + 8;
    q_pos[0] = gr0 < n_rows ? length - n_q + gr0 / g : INT32_MAX;
    q_pos[1] = gr1 < n_rows ? length - n_q + gr1 / g : INT32_MAX;
    const int32_t first = row0 + 16 * warp;
    warp_min_pos = first < n_rows ? length - n_q + first / g : INT32_MAX;
  }
  const bool warp_active = row0 + 16 * warp < n_rows;
  __syncwarp();  // this warp's bf16 fragments are written

  RowState<D> st;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) st.o[nt][0] = st.o[nt][1] = st.o[nt][2] = st.o[nt][3] = 0.0f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;
  st.offset[0] = st.offset[1] = 0.0f;
  const float scale2 = args.scale2;
  const int32_t sink_tiles = static_cast<int32_t>(attention_tiles(sink.tokens));
  const int32_t body_tiles = static_cast<int32_t>(attention_tiles(body.tokens));
  auto chunk_tiles = [&](const SegmentPages& seg, int32_t first_tile, int32_t& begin, int32_t& end) {
    begin = max(item.tile_begin - first_tile, 0);
    end = min(item.tile_end - first_tile, static_cast<int32_t>(attention_tiles(seg.tokens)));
  };
  auto bf16_segment = [&](const SegmentPages& seg, int32_t first_tile) {
    int32_t begin, end;
    chunk_tiles(seg, first_tile, begin, end);
    if (!warp_active) return;
    for (int32_t t = begin; t < end; ++t) {
      const int32_t t0 = t * kAttentionTileTokens;
      const TileHalves th = locate_tile(seg, t0);
      extend_bf16_tile<D>(st, qb, kv.k_bf16, kv.v_bf16, head, th, seg.start + t0,
                          min(seg.tokens - t0, kAttentionTileTokens), q_pos, scale2, lane);
    }
  };

  // 3. Sink, INT2 pages (staged for the whole block), window.
  bf16_segment(sink, 0);
  {
    int32_t begin, end;
    chunk_tiles(body, sink_tiles, begin, end);
    if (begin < end) {
      const ExtendCopyRole<D> role = extend_copy_role<D>(int2_head_blocks(kv.k_int2, kv.v_int2, head), tid);
      const uint32_t stage0 = smem_address(stages);
      const int32_t limit = min(end * kAttentionTileTokens, body.tokens);
      const int32_t groups = (end - begin + kExtendStageTiles - 1) / kExtendStageTiles;
#pragma unroll
      for (int k = 0; k < kExtendStages - 1; ++k) {
        issue_extend_stage<D>(stage0 + k * S::kBytes, body, role, begin + k * kExtendStageTiles, k < groups ? limit : 0);
      }
      for (int32_t gi = 0; gi < groups; ++gi) {
        cp_async_wait<kExtendStages - 2>();
        __syncthreads();  // stage gi has landed for every thread; every warp is done with gi - 1
        const int32_t next = gi + kExtendStages - 1;
        issue_extend_stage<D>(stage0 + (next % kExtendStages) * S::kBytes, body, role,
                              begin + next * kExtendStageTiles, next < groups ? limit : 0);
        if (warp_active) {
          const unsigned char* stage = stages + (gi % kExtendStages) * S::kBytes;
#pragma unroll
          for (int t = 0; t < kExtendStageTiles; ++t) {
            const int32_t tile = begin + gi * kExtendStageTiles + t;
            if (tile < end) {
              const int32_t t0 = tile * kAttentionTileTokens;
              const int valid = min(body.tokens - t0, kAttentionTileTokens);
              const int32_t first_key = body.start + t0;
              const bool mask = valid < kAttentionTileTokens || first_key + kAttentionTileTokens - 1 > warp_min_pos;
              extend_int2_tile<D>(st, qa, qsum, key_bias, stage, t * kAttentionTileTokens, mask, first_key, valid,
                                  q_pos, scale2, lane);
            }
          }
        }
      }
      cp_async_wait<0>();
    }
  }
  bf16_segment(recent, sink_tiles + body_tiles);

  // 4. This warp's rows: sums over each row's 4 lanes, the normalized o through shared memory
  // (its q rows are dead) for coalesced stores, and the lse, as the chunk's partial state.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int mask = 1; mask <= 2; mask *= 2) {
      st.l[i] += __shfl_xor_sync(kFullMask, st.l[i], mask);
      st.offset[i] += __shfl_xor_sync(kFullMask, st.offset[i], mask);
    }
  }
  float* wo = q_rows + 16 * warp * D;  // this warp's 16 rows: only it read them
  __syncwarp();
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int i = c >> 1;
      const float inv = st.l[i] == 0.0f ? 0.0f : 1.0f / st.l[i];  // NaN stays NaN
      wo[(r + 8 * i) * D + value_channel<D>(2 * j + (c & 1), nt)] = (st.o[nt][c] + st.offset[i]) * inv;
    }
  }
  __syncwarp();
  const size_t slot = size_t(item_index) * num_kv_heads + head;
  float* out_o = args.partial_o + (slot * kExtendRows + 16 * warp) * D;
  for (int idx = lane; idx < 16 * D / 4; idx += 32) {
    reinterpret_cast<float4*>(out_o)[idx] = reinterpret_cast<const float4*>(wo)[idx];
  }
  if (j == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      args.partial_lse[slot * kExtendRows + 16 * warp + r + 8 * i] =
          st.l[i] == 0.0f ? -INFINITY : st.m[i] + log2f(st.l[i]);
    }
  }
}

// Merges the chunks of a (request, row tile) exactly (weights 2^(lse_k - lse)), un-rotates
// by R_Vᵀ and writes bf16 o and the natural-log lse. Grid: items x KV heads x (64 / 4) row
// groups; blocks of items that are not the first chunk of their tile return at once.
inline constexpr int kMergeRows = 4;

template <int D>
__global__ void __launch_bounds__(128) extend_merge_kernel(const ExtendArgs args) {
  __shared__ float w[kMaxAttentionChunks][kMergeRows];
  __shared__ float o[kMergeRows][D];
  __shared__ float lse[kMergeRows];
  const AttentionWorkItem item = args.items[blockIdx.x];
  if (item.first_item != int32_t(blockIdx.x)) return;
  const PagedAttentionParams& p = args.p;
  const int32_t head = blockIdx.y, num_kv_heads = gridDim.y;
  const int g = args.group_size;
  const int32_t q_begin = p.qo_indptr[item.request];
  const int32_t n_rows = (p.qo_indptr[item.request + 1] - q_begin) * g;
  const int tile_row0 = kMergeRows * blockIdx.z;  // within the 64-row tile
  const int32_t row0 = item.column_tile * kExtendRows + tile_row0;
  if (row0 >= n_rows) return;
  const int rows = min(kMergeRows, n_rows - row0);
  const int chunks = item.num_chunks;
  const int tid = threadIdx.x;
  auto slot_of = [&](int k) { return (size_t(item.first_item + k) * num_kv_heads + head) * kExtendRows + tile_row0; };
  for (int idx = tid; idx < chunks * kMergeRows; idx += blockDim.x) {
    w[idx / kMergeRows][idx % kMergeRows] = args.partial_lse[slot_of(idx / kMergeRows) + idx % kMergeRows];
  }
  __syncthreads();
  if (tid < kMergeRows) {
    float m = -INFINITY;
    for (int k = 0; k < chunks; ++k) m = fmaxf(m, w[k][tid]);
    float sum = 0.0f;
    if (m != -INFINITY) {
      for (int k = 0; k < chunks; ++k) sum += exp2f(w[k][tid] - m);  // -inf: 0
    }
    lse[tid] = sum == 0.0f ? -INFINITY : m + log2f(sum);
  }
  __syncthreads();
  for (int idx = tid; idx < chunks * kMergeRows; idx += blockDim.x) {
    const float l = lse[idx % kMergeRows];
    float& wk = w[idx / kMergeRows][idx % kMergeRows];
    wk = l == -INFINITY ? 0.0f : exp2f(wk - l);
  }
  __syncthreads();
  for (int idx = tid; idx < kMergeRows * D; idx += blockDim.x) {
    const int rr = idx / D;
    float acc = 0.0f;
    for (int k = 0; k < chunks; ++k) acc += w[k][rr] * args.partial_o[slot_of(k) * D + idx];
    o[rr][idx % D] = acc;
  }
  __syncthreads();
  for (int i = tid; i < D; i += blockDim.x) {
    float out[kMergeRows];
    if (p.output_unrotation) {
#pragma unroll
      for (int rr = 0; rr < kMergeRows; ++rr) out[rr] = 0.0f;
      const float4* rv_row = reinterpret_cast<const float4*>(p.output_unrotation + size_t(i) * D);
      for (int k4 = 0; k4 < D / 4; ++k4) {
        const float4 rv = __ldg(rv_row + k4);
#pragma unroll
        for (int rr = 0; rr < kMergeRows; ++rr) {
          out[rr] = fmaf(o[rr][4 * k4], rv.x, out[rr]);
          out[rr] = fmaf(o[rr][4 * k4 + 1], rv.y, out[rr]);
          out[rr] = fmaf(o[rr][4 * k4 + 2], rv.z, out[rr]);
          out[rr] = fmaf(o[rr][4 * k4 + 3], rv.w, out[rr]);
        }
      }
    } else {
#pragma unroll
      for (int rr = 0; rr < kMergeRows; ++rr) out[rr] = o[rr][i];
    }
    for (int rr = 0; rr < rows; ++rr) {
      const int32_t gr = row0 + rr;
      const int64_t qrow = int64_t{q_begin + gr / g} * p.num_qo_heads + head * g + gr % g;
      reinterpret_cast<__nv_bfloat16*>(p.out)[qrow * D + i] = __float2bfloat16_rn(out[rr]);
    }
  }
  if (p.lse && tid < rows) {
    const int32_t gr = row0 + tid;
    const int64_t qrow = int64_t{q_begin + gr / g} * p.num_qo_heads + head * g + gr % g;
    p.lse[qrow] = lse[tid] * kLn2;
  }
}

// q·R_K of every query row of the batch, once, in float ([tokens][qo_heads][D]): the extend
// blocks of every chunk then read the rotated rows instead of each rotating its own.
inline constexpr int kRotateRows = 8;

template <int D>
__global__ void __launch_bounds__(128) rotate_queries_kernel(const bf16_t* q, const float* rotation, int64_t rows,
                                                             float* rotated) {
  __shared__ float qs[kRotateRows][D];
  const int64_t row0 = int64_t{blockIdx.x} * kRotateRows;
  for (int idx = threadIdx.x; idx < kRotateRows * D; idx += blockDim.x) {
    const int64_t row = row0 + idx / D;
    qs[idx / D][idx % D] =
        row < rows ? __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(q + row * D + idx % D)) : 0.0f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float acc[kRotateRows] = {};
#pragma unroll 8
    for (int k = 0; k < D; ++k) {
      const float rk = __ldg(rotation + k * D + i);
#pragma unroll
      for (int rr = 0; rr < kRotateRows; ++rr) acc[rr] = fmaf(qs[rr][k], rk, acc[rr]);
    }
#pragma unroll
    for (int rr = 0; rr < kRotateRows; ++rr) {
      if (row0 + rr < rows) rotated[(row0 + rr) * D + i] = acc[rr];
    }
  }
}

}  // namespace attention_detail
}  // namespace oscar
