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
// - That is the mma.sync path, for any sm_80+ build. An sm_90a build (OSCAR_HAS_WGMMA) runs the
//   warpgroup path instead (ExtendWgmma, below): each staged 64-key stage is unpacked once
//   into fp16 operands in shared memory, and wgmma multiplies them for all 64 rows at once, so
//   no warp unpacks for itself (1.4x at 64-256 new tokens over 32K, H100).
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
#include "oscar/core/programmatic_launch.cuh"
#include "oscar/core/wgmma.cuh"
#include "oscar/kv/paged_kv.hpp"

namespace oscar {
namespace attention_detail {

inline constexpr int kExtendWarps = 4;
inline constexpr int kExtendThreads = 32 * kExtendWarps;
inline constexpr int kExtendRows = kAttentionRowTile;  // 16 per warp
static_assert(kExtendRows == 16 * kExtendWarps);
// 16-token tiles per pipeline stage (one barrier each): 4, so that up to 4 warps sharing the
// same rows (replicas, below) each get a tile of every stage.
inline constexpr int kExtendStageTiles = 4;
inline constexpr int kExtendStages = 4;
// Resident blocks per SM the registers must leave room for. The mma.sync path: 3 x 4 warps at
// d = 128 (168 registers, q in shared memory); 2 left 8 warps per SM, too few to hide the
// dependent unpack -> MMA -> softmax chain (H200: 4.6 cycles per issue). The warpgroup path
// (sm_90a): 2, whose 255 registers hold a stage's scores without spills (Q64 / Q256 176 / 555
// us against 213 / 622 at 3, H100; docs/benchmarks.md). Only the device pass sees the
// difference: plans read the kernel's occupancy from the device.
#ifdef OSCAR_EXTEND_MIN_BLOCKS_PER_SM
inline constexpr int kExtendMinBlocks = OSCAR_EXTEND_MIN_BLOCKS_PER_SM;
#elif defined(OSCAR_HAS_WGMMA)
inline constexpr int kExtendMinBlocks = 2;
#else
inline constexpr int kExtendMinBlocks = 3;
#endif

// One pipeline stage: K codes [keys][D/4], V codes [keys / 8][9][D/4] (a pad row after every 8
// keys), K meta [keys], 64 bytes of pad, V meta [keys].
// The pads are for the shared-memory banks: the warpgroup path's V^T unpack has the 4 groups of
// 8 keys of a warp read the same word of a row, which without the pad row sit 8 rows (a
// multiple of 128 bytes) apart, a 4-way conflict on every load (ncu, H200: 30 % of the extend
// kernel's shared-load wavefronts were conflicts); and a key's K and V metadata, converted by
// neighbouring threads, sat 4·keys bytes apart, on the same bank.
template <int D>
struct ExtendStage {
  static constexpr int kKeys = kAttentionTileTokens * kExtendStageTiles;
  static constexpr int kRowBytes = D / 4;
  static constexpr int kCodes = kKeys * kRowBytes;
  static constexpr int kVCodes = kCodes;
  static constexpr int kVGroupBytes = 9 * kRowBytes;  // 8 value rows and the pad row
  static constexpr int kKMeta = kVCodes + kKeys / 8 * kVGroupBytes;
  static constexpr int kVMeta = kKMeta + 4 * kKeys + 64;
  static constexpr int kBytes = kVMeta + 4 * kKeys;
  // Byte offset of the value row of `key` (0 .. kKeys - 1) in the stage.
  OSCAR_HOST_DEVICE static constexpr int v_row(int key) {
    return kVCodes + (key / 8) * kVGroupBytes + (key % 8) * kRowBytes;
  }
  static constexpr int kChunksPerRow = kRowBytes / 16;
  static constexpr int kCodeChunks = 2 * kKeys * kChunksPerRow;  // K and V
  static constexpr int kMetaChunks = 2 * kKeys / 4;              // 4 tokens' words per 16 bytes
  static_assert(kRowBytes % 16 == 0 && kKMeta % 16 == 0 && kBytes % 16 == 0, "whole 16-byte chunks");
};

// Shared memory of one block. q stays in shared memory (the registers go to o): the fp16
// fragments are read once per k-step of an INT2 tile, the float rows by the few BF16 tiles.
template <int D>
struct ExtendLayout {
  static constexpr size_t q_rows = 0;  // float [64][D]: the block's q rows; at the end each warp's o
  static constexpr size_t q_f16 = q_rows + sizeof(float) * kExtendRows * D;  // uint4 [warps][D/16][32]
  static constexpr size_t stages = q_f16 + sizeof(uint4) * kExtendWarps * (D / 16) * 32;
  static constexpr size_t stats = stages + size_t{kExtendStages} * ExtendStage<D>::kBytes;  // float [2][warps][16]
  // float2 [2][stage keys]: a stage's key, then value metadata (scale, offset) in float, the
  // key's scaled by sm_scale·log2(e) (the warpgroup path; converted once per key, not once per
  // lane). Keys 2j, 2j + 1 of a lane are one 16-byte load.
  static constexpr size_t int2_meta = stats + sizeof(float) * 2 * kExtendWarps * 16;
  static constexpr size_t bytes = int2_meta + sizeof(float2) * 2 * ExtendStage<D>::kKeys;
  // The warpgroup path's operands of a stage (K' and V^T, fp16), which overlay the q rows. Its
  // second buffer (and a second metadata array) is static shared memory in that kernel: the
  // host pass, which sizes the dynamic part, cannot tell an sm_90a device build from another.
  static constexpr size_t operand_bytes = size_t{4} * ExtendStage<D>::kKeys * D;
  static_assert(operand_bytes <= sizeof(float) * kExtendRows * D, "the first operand buffer overlays the q rows");
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

// The online-softmax update of this lane's scores p[n-tile][c] (c: {r, key 2j}, {r, 2j+1},
// {r+8, 2j}, {r+8, 2j+1}; NT blocks of 8 keys), given relative to m_use, the running max of
// their row (0 where there is none yet); masked keys are -inf. Lazy running max (as in the
// decode kernel): it moves only when a score passes it by more than 8 (log2 units; where there
// is none yet, any key moves it), and then o, l and offset are rescaled and the scores shifted
// by the change (one more rounding of a value below 2^8, far under the fp16 rounding of P).
// Leaves the probabilities in p.
template <int D, int NT>
OSCAR_DEVICE void relative_softmax_step(RowState<D>& st, float (&p)[NT][4], float (&m_use)[2]) {
  constexpr float kMaxGrowth = 8.0f;
  bool grow = false;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) grow |= p[n][c] > (st.m[c >> 1] == -INFINITY ? -INFINITY : kMaxGrowth);
  }
  if (__any_sync(kFullMask, grow)) {
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float tile_max = fmaxf(p[0][2 * i], p[0][2 * i + 1]);
#pragma unroll
      for (int n = 1; n < NT; ++n) tile_max = fmaxf(tile_max, fmaxf(p[n][2 * i], p[n][2 * i + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
      const float m_new = fmaxf(st.m[i], m_use[i] + tile_max);  // all masked: -inf, m stays
      const float m_new_use = m_new == -INFINITY ? 0.0f : m_new;
      alpha[i] = fast_exp2(st.m[i] - m_new_use);
      st.m[i] = m_new;
      st.l[i] *= alpha[i];
      st.offset[i] *= alpha[i];
      const float shift = m_new_use - m_use[i];
      m_use[i] = m_new_use;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        p[n][2 * i] -= shift;
        p[n][2 * i + 1] -= shift;
      }
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      st.o[nt][0] *= alpha[0];
      st.o[nt][1] *= alpha[0];
      st.o[nt][2] *= alpha[1];
      st.o[nt][3] *= alpha[1];
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      p[n][c] = fast_exp2(p[n][c]);
      st.l[c >> 1] += p[n][c];
    }
  }
}

// The base relative_softmax_step's scores are given against: each row's running max, or 0
// where there is none yet.
template <int D>
OSCAR_DEVICE void running_max_base(const RowState<D>& st, float (&m_use)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) m_use[i] = st.m[i] == -INFINITY ? 0.0f : st.m[i];
}

// The causal and segment mask of this lane's scores: key 8n + 2j + (c & 1) of a tile starting
// at position first_key, of which `valid` are inside the segment.
template <int NT>
OSCAR_DEVICE void mask_scores(float (&s)[NT][4], int32_t first_key, int valid, const int32_t (&q_pos)[2], int j) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int key = 8 * n + 2 * j + (c & 1);
      if (key >= valid || first_key + key > q_pos[c >> 1]) s[n][c] = -INFINITY;
    }
  }
}

// Masks (where `mask`), runs the online-softmax update on this lane's absolute scores
// s[n-tile][c] (log2 units; layout of relative_softmax_step: the mma.sync path's 16-key INT2
// tiles and both paths' BF16 tiles) and leaves the probabilities in s.
template <int D, int NT = 2>
OSCAR_DEVICE void row_softmax_step(RowState<D>& st, float (&s)[NT][4], bool mask, int32_t first_key, int valid,
                                   const int32_t (&q_pos)[2], int j) {
  if (mask) mask_scores(s, first_key, valid, q_pos, j);
  float m_use[2];
  running_max_base(st, m_use);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) s[n][c] -= m_use[c >> 1];
  }
  relative_softmax_step<D, NT>(st, s, m_use);
}

// The INT2 scores of NT blocks of 8 keys, and what the values need of them, for this lane's
// keys 2j, 2j+1 of each block: s = (q·c·s_k + offset_k·Σq)·sm_scale·log2(e), with q·c the
// accumulated q'·(1024 + 4^k·c) less the bias it started from; each key's value scale and
// offset. qc(n, c): the accumulated q·c of block n, element c; km / vm: the keys' fp16
// (scale, offset) metadata words.
template <int NT, class QC>
OSCAR_DEVICE void int2_block_scores(QC&& qc, const uint2 (&km)[NT], const uint2 (&vm)[NT], const float (&qsum)[2],
                                    float scale2, float (&s)[NT][4], float (&sv)[NT][2], float (&ov)[NT][2]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const float2 k0 = __half22float2(bits_half2(km[n].x)), k1 = __half22float2(bits_half2(km[n].y));
    const float2 v0 = __half22float2(bits_half2(vm[n].x)), v1 = __half22float2(bits_half2(vm[n].y));
    const float sk[2] = {k0.x, k1.x}, ok[2] = {k0.y, k1.y};
    sv[n][0] = v0.x;
    sv[n][1] = v1.x;
    ov[n][0] = v0.y;
    ov[n][1] = v1.y;
#pragma unroll
    for (int c = 0; c < 4; ++c) s[n][c] = (qc(n, c) * sk[c & 1] + ok[c & 1] * qsum[c >> 1]) * scale2;
  }
}

// After the softmax left the probabilities in s: Σ p·offset of the INT2 values into the state
// (masked keys have p = 0 and, past the segment, zero metadata: they add nothing), and
// P' = p·scale as the A fragments of the value MMAs, 16 keys each: {row r, keys 2j..},
// {r+8, 2j..}, {r, 2j+8..}, {r+8, 2j+8..} of blocks 2kk and 2kk + 1.
template <int D, int NT>
OSCAR_DEVICE void int2_value_inputs(RowState<D>& st, const float (&s)[NT][4], const float (&sv)[NT][2],
                                    const float (&ov)[NT][2], uint32_t (&pa)[NT / 2][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) st.offset[c >> 1] += s[n][c] * ov[n][c & 1];
  }
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    const int b0 = 2 * kk, b1 = 2 * kk + 1;
    pa[kk][0] = pack_half2(s[b0][0] * sv[b0][0], s[b0][1] * sv[b0][1]);
    pa[kk][1] = pack_half2(s[b0][2] * sv[b0][0], s[b0][3] * sv[b0][1]);
    pa[kk][2] = pack_half2(s[b1][0] * sv[b1][0], s[b1][1] * sv[b1][1]);
    pa[kk][3] = pack_half2(s[b1][2] * sv[b1][0], s[b1][3] * sv[b1][1]);
  }
}

// O += P'·C for the INT2 value codes of the tile (B fragments from int2_value_codes).
template <int D>
OSCAR_DEVICE void int2_values(RowState<D>& st, const uint32_t (&pa)[4], const uint32_t (&vw)[4][LaneCodeWords<D>::kVWords]) {
#pragma unroll
  for (int u = 0; u < D / 64; ++u) {
    uint32_t c01[8], c89[8];
    int2_value_codes<D>(vw, u, c01, c89);
#pragma unroll
    for (int idx = 0; idx < 8; ++idx) mma_f16(st.o[u * 8 + idx], pa, c01[idx], c89[idx]);
  }
}

// One staged INT2 tile (16 keys at key offset kb of the stage) for this warp's 16 rows.
template <int D>
OSCAR_DEVICE void extend_int2_tile(RowState<D>& st, const uint4* qa, const float (&qsum)[2],
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
      const unsigned char* p = stage + S::v_row(kb + 8 * half + 2 * j + t) + r * Raw::kVBytes;
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
  {                                                                                                   \
    const uint4 qv = qa[(wi * 4 + K) * 32];                                                           \
    const uint32_t a[4] = {qv.x, qv.y, qv.z, qv.w};                                                   \
    mma_f16(ACC[0], a, unpack_field_biased<K>(lo0), unpack_field_biased<K>(hi0));                     \
    mma_f16(ACC[1], a, unpack_field_biased<K>(lo1), unpack_field_biased<K>(hi1));                     \
  }
    OSCAR_EXTEND_KSTEP(0, acc) OSCAR_EXTEND_KSTEP(1, acc_odd) OSCAR_EXTEND_KSTEP(2, acc) OSCAR_EXTEND_KSTEP(3, acc_odd)
#undef OSCAR_EXTEND_KSTEP
  }
  float s[2][4], sv[2][2], ov[2][2];
  int2_block_scores([&](int n, int c) { return acc[n][c] + acc_odd[n][c]; }, kmeta, vmeta, qsum, scale2, s, sv, ov);
  row_softmax_step<D>(st, s, mask, first_key, valid, q_pos, j);
  uint32_t pa[1][4];
  int2_value_inputs<D>(st, s, sv, ov, pa);
  int2_values<D>(st, pa[0], vw);
}

// The bf16 hi + lo A fragments of k-step s of rows qr0 (r) and qr1 (r + 8): channels ch, ch+1
// | ch+2, ch+3 with ch = 32(s/2) + 8j + 4(s%2), the channels the B fragment of a key row reads.
OSCAR_DEVICE void bf16_q_fragment(const float* qr0, const float* qr1, int s, int j, uint32_t (&hi)[4],
                                  uint32_t (&lo)[4]) {
  const int ch = (s / 2) * 32 + 8 * j + 4 * (s % 2);
  const float4 a = *reinterpret_cast<const float4*>(qr0 + ch), b = *reinterpret_cast<const float4*>(qr1 + ch);
  const float x[2][4] = {{a.x, a.y, a.z, a.w}, {b.x, b.y, b.z, b.w}};
  float h[2][4], l[2][4];
#pragma unroll
  for (int row = 0; row < 2; ++row) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      h[row][e] = __bfloat162float(__float2bfloat16_rn(x[row][e]));
      l[row][e] = x[row][e] - h[row][e];
    }
  }
  hi[0] = pack_bf16x2(h[0][0], h[0][1]);
  hi[1] = pack_bf16x2(h[1][0], h[1][1]);
  hi[2] = pack_bf16x2(h[0][2], h[0][3]);
  hi[3] = pack_bf16x2(h[1][2], h[1][3]);
  lo[0] = pack_bf16x2(l[0][0], l[0][1]);
  lo[1] = pack_bf16x2(l[1][0], l[1][1]);
  lo[2] = pack_bf16x2(l[0][2], l[0][3]);
  lo[3] = pack_bf16x2(l[1][2], l[1][3]);
}

// One BF16 tile (sink or window) for this warp's rows, read straight from the pool (these
// segments are a few tiles per request). qr0 / qr1: this lane's q rows r and r + 8 (float).
template <int D>
OSCAR_DEVICE void extend_bf16_tile(RowState<D>& st, const float* qr0, const float* qr1, const Bf16PoolRef& kpool,
                                   const Bf16PoolRef& vpool, int32_t head, const TileHalves& th, int32_t first_key,
                                   int valid, const int32_t (&q_pos)[2], float scale2, int lane) {
  constexpr int kVWords = D / 64;
  const int j = lane % 4;
  // Keys r and r + 8 (r = lane / 4): channels [32·b + 8j, 32·b + 8j + 8) of each block b of 32.
  uint4 krow[2][D / 32];
  load_bf16_keys<D>(kpool, head, th, valid, lane, krow);
  uint32_t vw[4][4][kVWords];
  load_bf16_values<D>(vpool, head, th, valid, lane, vw);
  float acc[2][4] = {}, acc_lo[2][4] = {};
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    uint32_t a_hi[4], a_lo[4];
    bf16_q_fragment(qr0, qr1, s, j, a_hi, a_lo);
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
    bf16_value_pairs<D>(vw, wi, c01, c89);
#pragma unroll
    for (int idx = 0; idx < 8; ++idx) mma_bf16(st.o[wi * 8 + idx], pa, c01[idx], c89[idx]);
  }
}

// Issues this thread's copies of one stage: tiles from tile0 on, tokens below `limit` (the
// chunk's and the segment's end). Code chunks c = tid + 128i (K rows, then V rows), then one
// chunk of 4 tokens' metadata for the first kMetaChunks threads; the divisions are by powers
// of two. Rows past `limit` keep stale codes (finite whatever they are: every bit pattern is a
// code) and get zero metadata, so their p = 0 meets a zero scale and offset. Commits one
// group, empty or not.
template <int D>
OSCAR_DEVICE void issue_extend_stage(uint32_t stage, const SegmentPages& seg, const Int2HeadBlocks& blocks,
                                     int32_t tile0, int32_t limit, int tid) {
  using S = ExtendStage<D>;
  constexpr int kCopies = S::kCodeChunks / kExtendThreads;
  static_assert(S::kCodeChunks % kExtendThreads == 0 && S::kMetaChunks <= kExtendThreads, "whole rounds of copies");
  const int32_t first_token = tile0 * kAttentionTileTokens;
  // Every page id this thread needs is loaded before any copy is issued: one round trip for
  // all of them (each copy behind its own lookup made three in a row per stage). A token past
  // `limit` looks up the segment's token 0, which exists wherever a stage is issued, and
  // copies nothing. Page offsets are 32-bit products (the launcher refuses strides >= 2 GiB).
  // (Where a round of copies covers whole stages of K or V, every copy of a thread is the same
  // token's, K's and V's: one lookup.)
  constexpr bool kOneToken = kExtendThreads % (S::kKeys * S::kChunksPerRow) == 0;
  int32_t token[kCopies], page[kCopies];
#pragma unroll
  for (int i = 0; i < kCopies; ++i) {
    const int c = tid + kExtendThreads * i;
    token[i] = first_token + (c / S::kChunksPerRow) % S::kKeys;
    page[i] = kOneToken && i > 0 ? page[0] : seg.page_id(token[i] < limit ? token[i] : 0);
  }
  const bool meta_lane = tid < S::kMetaChunks;
  const int meta_tensor = tid / (S::kKeys / 4);
  const int meta_key = 4 * (tid % (S::kKeys / 4));  // 4 tokens of one page: pages hold >= 8
  const int32_t meta_token = first_token + meta_key;
  const bool meta_copy = meta_lane && meta_token < limit;
  const int32_t meta_page = meta_copy ? seg.page_id(meta_token) : 0;
  // The block of page `page` in K's (tensor 0) or V's pool.
  auto page_block = [&](int tensor, int32_t page) {
    return (tensor == 0 ? blocks.k : blocks.v) +
           mul_wide(page, static_cast<int32_t>(tensor == 0 ? blocks.k_stride_page : blocks.v_stride_page));
  };
#pragma unroll
  for (int i = 0; i < kCopies; ++i) {
    const int c = tid + kExtendThreads * i;
    const int tensor = c / (S::kKeys * S::kChunksPerRow);
    const int key = (c / S::kChunksPerRow) % S::kKeys;
    const int part = (c % S::kChunksPerRow) * 16;
    // A token past `limit` zero-fills its chunk (nothing read; the copy's own predicate).
    cp_async16_or_zero(stage + (tensor == 0 ? key * S::kRowBytes : S::v_row(key)) + part,
                       page_block(tensor, page[i]) + seg.slot(token[i]) * S::kRowBytes + part, !(token[i] < limit));
  }
  if (meta_lane) {
    // Metadata past `limit` reads as zero: the same copy, zero-filling.
    cp_async16_or_zero(stage + (meta_tensor == 0 ? S::kKMeta : S::kVMeta) + 4 * meta_key,
                       page_block(meta_tensor, meta_page) + blocks.meta_offset + seg.slot(meta_token) * 4, !meta_copy);
  }
  cp_async_commit();
}

#if defined(OSCAR_HAS_WGMMA)
// ---- the warpgroup path (sm_90a builds) --------------------------------------------------------
// The block's 4 warps are one warpgroup: warp w owns rows 16w .. 16w + 15 (no replicas), and
// each landed stage (64 keys) is unpacked once into fp16 operands in shared memory that one
// wgmma per k-step reads for all four warps (the mma.sync path re-unpacks every tile per
// warp; operands read per warp with ldmatrix were bound by shared-memory bandwidth instead,
// docs/benchmarks.md). Per stage: S[64 rows x 64 keys] = q'·K'^T (m64n64k16, both operands in
// shared memory), the online softmax on S in registers, O += P'·V (m64nDk16, P' from
// registers, V^T in shared memory).
//
// Operand layouts (no-swizzle K-major core matrices, wgmma.cuh): element (row, k) of an
// operand at (row / 8)·stride + (k / 8)·128 + (row % 8)·16 + (k % 8)·2.
// - q' (A, in q_f16's space): row = query row, k = position p of unpacked_key_channel's
//   order, fp16 q·4^-k: stride D/8·128.
// - K' (B of S, in the q rows' space): row = key, k = position p: fp16 subnormals 4^k·c·2^-24
//   (so S = 2^-24·q·c, no bias to cancel; the key scale carries the 2^24), stride D/8·128.
// - V^T (B of O, after K'): row = position 8·nt + n (channel value_channel(n, nt), as the BF16
//   tiles' o registers), k = key: fp16 subnormals 4^k·c·2^-24, stride 8·128 (64 keys).

// The channel of position p of a K' row: code word w's field k (bytes b = 4w..4w+3, channels
// b + k·D/4 ...) goes to positions k·D/4 + b .. + 3 as the channels b, b+2, b+1, b+3 (+ k·D/4)
// that the field masks of w and w >> 8 give (unpack_field_subnormal / unpack_field_biased).
template <int D>
OSCAR_HOST_DEVICE constexpr int unpacked_key_channel(int p) {
  const int quarter = p / (D / 4), rem = p % (D / 4);
  return quarter * (D / 4) + (rem & ~3) + ((rem & 1) << 1) + ((rem >> 1) & 1);
}

// The byte of a value row that holds channel value_channel(n, nt), in field value_field(nt).
template <int D>
OSCAR_HOST_DEVICE constexpr int value_byte(int n, int nt) {
  return n * (D / 32) + 2 * (nt / 8) + (nt % 8) / 4;
}

// The block's o registers between the units of the BF16 tiles (one) and of the INT2 values
// (n-tile nt: value_field_unit(value_field(nt))): scaled into the latter before the INT2
// stages and back after them. Powers of two, exact.
template <int D>
OSCAR_DEVICE void scale_value_units(RowState<D>& st, bool into_int2_units) {
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const float unit = value_field_unit(value_field(nt));
    const float f = into_int2_units ? unit : 1.0f / unit;
#pragma unroll
    for (int c = 0; c < 4; ++c) st.o[nt][c] *= f;
  }
}

template <int D>
struct ExtendWgmma {
  static constexpr uint32_t kRowGroupBytes = D / 8 * 128;  // q' and K': 8 rows
  static constexpr uint32_t kKeys = ExtendStage<D>::kKeys;
  static constexpr uint32_t kK = 0;
  static constexpr uint32_t kV = kKeys / 8 * kRowGroupBytes;
  static constexpr uint32_t kVRowGroupBytes = kKeys / 8 * 128;
  static constexpr uint32_t kBytes = kV + D / 8 * kVRowGroupBytes;
  static_assert(kBytes <= sizeof(float) * kExtendRows * D, "K' and V^T overlay the float q rows");
  static_assert(kExtendRows * D * 2 <= sizeof(uint4) * kExtendWarps * (D / 16) * 32, "q' fits q_f16's space");
  static_assert(kExtendThreads == 2 * kKeys && kExtendWarps == 4, "one warpgroup; two threads per key");
  OSCAR_HOST_DEVICE static constexpr uint32_t chunk(uint32_t row_group_bytes, int row, int k8) {
    return (row / 8) * row_group_bytes + k8 * 128 + (row % 8) * 16;
  }
};

// q' of the block's 64 rows into the A operand (every thread), and this lane's qsum (Σ q of
// its rows r and r + 8 of warp w).
template <int D>
OSCAR_DEVICE void write_query_operand(const float* q_rows, uint32_t qa, int tid, float (&qsum)[2]) {
  using W = ExtendWgmma<D>;
  for (int idx = tid; idx < kExtendRows * (D / 8); idx += kExtendThreads) {
    const int row = idx / (D / 8), c = idx % (D / 8);
    const float* q = q_rows + row * D;
    const float inv = 1.0f / float(1 << (2 * (8 * c / (D / 4))));  // one code field per 8 positions
    uint32_t h[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      h[e] = pack_half2(q[unpacked_key_channel<D>(8 * c + 2 * e)] * inv, q[unpacked_key_channel<D>(8 * c + 2 * e + 1)] * inv);
    }
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(qa + W::chunk(W::kRowGroupBytes, row, c)), "r"(h[0]),
                 "r"(h[1]), "r"(h[2]), "r"(h[3])
                 : "memory");
  }
  const int lane = tid % 32, warp = tid / 32, r = lane / 4, j = lane % 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float* q = q_rows + (16 * warp + r + 8 * i) * D;
    float sum = 0.0f;
    for (int c = j; c < D; c += 4) sum += q[c];  // the 4 lanes of the row cover all channels
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    qsum[i] = sum;
  }
}

// Row n of V^T's core matrices (n-tile nt, key group kg) for the n-tiles of half kHalf: the
// value codes of keys 8kg .. 8kg + 7 at channel value_channel(n, nt), as fp16 subnormals.
template <int D, int kHalf>
OSCAR_DEVICE void unpack_value_columns(const unsigned char* stage, uint32_t vt, int n, int kg) {
  using S = ExtendStage<D>;
  using W = ExtendWgmma<D>;
  constexpr int kTiles = D / 16;  // n-tiles per half
  // Every n-tile of this half reads the same code word of a value row (value_byte: n·D/32 plus
  // 0..3, all inside one word for this thread's n): one load per key.
  const int word = (value_byte<D>(n, kHalf * kTiles)) / 4;
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = *reinterpret_cast<const uint32_t*>(stage + S::v_row(8 * kg + i) + 4 * word);
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const int nt = kHalf * kTiles + t;
    const uint32_t byte = value_byte<D>(n, nt) % 4;
    const uint32_t selector = byte | ((4 + byte) << 8);
    uint32_t pair[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      pair[k] = __byte_perm(w[2 * k], w[2 * k + 1], selector) & (0x00030003u << (2 * value_field(nt)));
    }
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(vt + W::chunk(W::kVRowGroupBytes, 8 * nt + n, kg)),
                 "r"(pair[0]), "r"(pair[1]), "r"(pair[2]), "r"(pair[3])
                 : "memory");
  }
}

// Every thread: its half of one key's K' row and its rows of V^T (unpack_value_columns), from
// the staged codes of a stage.
template <int D>
OSCAR_DEVICE void unpack_stage_operands(const unsigned char* stage, uint32_t operands, uint32_t meta, float scale2,
                                        int tid) {
  using S = ExtendStage<D>;
  using W = ExtendWgmma<D>;
  {
    // Metadata: thread 2·key + 0 converts the key's (scale, offset) into {s_k', o_k'} at
    // float2 key, 2·key + 1 the value's into {s_v, o_v} at float2 kKeys + key: s_k' =
    // s_k·sm_scale·log2(e)·2^24 (the subnormal codes' unit, exact), o_k' = o_k·sm_scale·log2(e).
    static_assert(kExtendThreads == 2 * S::kKeys);
    const int key = tid / 2, is_value = tid % 2;
    const float2 f = __half22float2(bits_half2(
        *reinterpret_cast<const uint32_t*>(stage + (is_value ? S::kVMeta : S::kKMeta) + 4 * key)));
    const float scale = is_value ? 1.0f : scale2;
    const float code_unit = is_value ? 1.0f : float(1 << 24);
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(meta + 8 * (key + is_value * S::kKeys)), "f"(f.x * scale * code_unit),
                 "f"(f.y * scale)
                 : "memory");
  }
  {
    // K': words [part·D/32, ...) of key `key`, two words per 16-byte chunk of each field.
    // Threads 16h .. 16h + 15 take keys 8h .. 8h + 7, both halves: the first 8 keys 0-3 of
    // half 0 and keys 4-7 of half 1, the next 8 the others. So every 8 threads (a phase of a
    // 16-byte access) load 8 different 16-byte columns of 4 rows (no bank twice; key-major
    // threads read rows 32 bytes apart, a 2-way conflict at d = 128) and store to 8 different
    // rows of a core matrix (the store's bank is set by key % 8 alone).
    constexpr int kWords = D / 32;
    const int i8 = tid % 8, phase = tid / 8;
    const int key = 8 * (phase / 2) + i8, part = (i8 / 4) ^ (phase % 2);
    uint32_t w[kWords];
    load_words<false>(stage + key * S::kRowBytes + part * 4 * kWords, w);
#pragma unroll
    for (int m = 0; m < kWords / 2; ++m) {
      const uint32_t lo0 = w[2 * m], hi0 = w[2 * m] >> 8, lo1 = w[2 * m + 1], hi1 = w[2 * m + 1] >> 8;
      const int b = 4 * (part * kWords + 2 * m);  // the pair's first byte
      const uint32_t f[4][4] = {
          {unpack_field_subnormal<0>(lo0), unpack_field_subnormal<0>(hi0), unpack_field_subnormal<0>(lo1), unpack_field_subnormal<0>(hi1)},
          {unpack_field_subnormal<1>(lo0), unpack_field_subnormal<1>(hi0), unpack_field_subnormal<1>(lo1), unpack_field_subnormal<1>(hi1)},
          {unpack_field_subnormal<2>(lo0), unpack_field_subnormal<2>(hi0), unpack_field_subnormal<2>(lo1), unpack_field_subnormal<2>(hi1)},
          {unpack_field_subnormal<3>(lo0), unpack_field_subnormal<3>(hi0), unpack_field_subnormal<3>(lo1), unpack_field_subnormal<3>(hi1)}};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t addr = operands + W::kK + W::chunk(W::kRowGroupBytes, key, (k * (D / 4) + b) / 8);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(f[k][0]), "r"(f[k][1]), "r"(f[k][2]),
                     "r"(f[k][3])
                     : "memory");
      }
    }
  }
  // V^T: thread (n, key group, half) writes row n of the core matrices (nt, key group) of its
  // half of the n-tiles; the 8 threads of a store phase write one core matrix's 128 bytes.
  const int n = tid % 8, kg = (tid / 8) % 8;
  if (tid < kExtendThreads / 2) {
    unpack_value_columns<D, 0>(stage, operands + W::kV, n, kg);
  } else {
    unpack_value_columns<D, 1>(stage, operands + W::kV, n, kg);
  }
}

// The probabilities of one stage for this lane's scores (NT blocks of 8 keys, the layout of
// relative_softmax_step), computed relative to the running max in one fma chain per score:
// s - m = q·c·s_k' + (o_k'·Σq - m), with s_k', o_k' the key metadata already scaled by
// sm_scale·log2(e) (meta: the stage's key metadata, a float2 per key), then relative_softmax_step.
template <int D, int NT>
OSCAR_DEVICE void int2_stage_probabilities(RowState<D>& st, const float (&acc)[NT][4], const float2* meta,
                                           const float (&qsum)[2], bool mask, int32_t first_key, int valid,
                                           const int32_t (&q_pos)[2], int j, float (&p)[NT][4]) {
  float sk[NT][2], ok[NT][2];  // (the value halves are read later: fewer registers live here)
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const float4 m = *reinterpret_cast<const float4*>(meta + 8 * n + 2 * j);  // keys 8n + 2j, 8n + 2j + 1
    sk[n][0] = m.x, ok[n][0] = m.y, sk[n][1] = m.z, ok[n][1] = m.w;
  }
  float m_use[2];
  running_max_base(st, m_use);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) p[n][c] = fmaf(acc[n][c], sk[n][c & 1], fmaf(ok[n][c & 1], qsum[c >> 1], -m_use[c >> 1]));
  }
  if (mask) mask_scores(p, first_key, valid, q_pos, j);
  relative_softmax_step<D, NT>(st, p, m_use);
}

// The score MMAs of one stage, issued and committed as one wgmma group, not waited for:
// acc = 2^-24·q·c (K' holds the codes as fp16 subnormals 4^k·c·2^-24, q' is q·4^-k), no bias to
// start from or cancel; s_k' carries the 2^24.
template <int D>
OSCAR_DEVICE void issue_stage_scores(float (&acc)[ExtendStage<D>::kKeys / 8][4], uint64_t q_desc, uint64_t k_desc) {
  ptx::wgmma_fence();
  ptx::wgmma_m64n64k16_ss_first(acc, q_desc, k_desc);
#pragma unroll
  for (int s = 1; s < D / 16; ++s) ptx::wgmma_m64n64k16_ss(acc, q_desc + 16 * s, k_desc + 16 * s);  // +256 bytes
  ptx::wgmma_commit();
}

// The rest of one stage (64 keys from key offset 0 of the stage, `valid` of them inside the
// chunk and segment) for the warpgroup's 64 rows, once its scores have landed in acc: the
// online softmax, then O += P'·V issued as one wgmma group and not waited for (its A operand
// stays in pa, which must not change before that group completes). meta: the stage's
// converted metadata.
template <int D>
OSCAR_DEVICE void issue_stage_values(RowState<D>& st, const float (&acc)[ExtendStage<D>::kKeys / 8][4],
                                     uint32_t (&pa)[ExtendStage<D>::kKeys / 16][4], uint64_t v_desc,
                                     const float (&qsum)[2], const float2* meta, bool mask, int32_t first_key,
                                     int valid, const int32_t (&q_pos)[2], int lane) {
  constexpr int kBlocks = ExtendStage<D>::kKeys / 8;  // 8-key blocks of S
  const int j = lane % 4;
  float pr[kBlocks][4], sv[kBlocks][2], ov[kBlocks][2];
  int2_stage_probabilities<D, kBlocks>(st, acc, meta, qsum, mask, first_key, valid, q_pos, j, pr);
#pragma unroll
  for (int n = 0; n < kBlocks; ++n) {
    const float4 m = *reinterpret_cast<const float4*>(meta + ExtendStage<D>::kKeys + 8 * n + 2 * j);
    sv[n][0] = m.x, ov[n][0] = m.y, sv[n][1] = m.z, ov[n][1] = m.w;
  }
  int2_value_inputs<D>(st, pr, sv, ov, pa);
  ptx::wgmma_fence_operands(st.o);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlocks / 2; ++kk) {
    if constexpr (D == 128) {
      ptx::wgmma_m64n128k16_rs(st.o, pa[kk], v_desc + 16 * kk);
    } else {
      ptx::wgmma_m64n64k16_rs(st.o, pa[kk], v_desc + 16 * kk);
    }
  }
  ptx::wgmma_commit();
}

// After a wait that completed the value MMAs reading pa: pa's registers may change from here
// (an empty asm that reads and writes them, so the compiler neither frees nor reuses them
// before this point).
template <int N>
OSCAR_DEVICE void release_value_operands(uint32_t (&pa)[N][4]) {
#pragma unroll
  for (int kk = 0; kk < N; ++kk) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(pa[kk][e])::"memory");
  }
}
#endif  // OSCAR_HAS_WGMMA

template <int D>
__global__ void __launch_bounds__(kExtendThreads, kExtendMinBlocks) extend_attention_kernel(const ExtendArgs args) {
  using L = ExtendLayout<D>;
  using S = ExtendStage<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* q_rows = reinterpret_cast<float*>(smem + L::q_rows);
  unsigned char* stages = smem + L::stages;

  const PagedAttentionParams& p = args.p;
  const PagedKvRef& kv = p.kv;
  const int item_index = blockIdx.x;
  // The merge grid may be scheduled once every block of this one has started: its blocks stage
  // R_V while this grid's last wave runs, then wait for it.
  ptx::allow_dependent_launch();
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
  // Warps split the block's rows into groups of 16; where there are only 1 or 2 groups (a
  // short extend, e.g. speculative verification), the warps of a group (replicas) share its
  // rows and split the tiles instead, and are merged at the end, so no warp idles.
#if defined(OSCAR_HAS_WGMMA)
  // The warpgroup path: warp w owns rows 16w .. 16w + 15, the A rows of its wgmma fragment.
  constexpr int row_groups = kExtendWarps, replicas = 1;
  const int group = warp, replica = 0;
  const bool warp_active = row0 + 16 * warp < n_rows;  // (its INT2 work is the warpgroup's all the same)
#else
  const int row_groups = (min(kExtendRows, n_rows - row0) + 15) / 16;
  const int replicas = row_groups <= 2 ? kExtendWarps / row_groups : 1;
  const int group = warp % row_groups, replica = warp / row_groups;
  const bool warp_active = replica < replicas;  // 3 groups: the fourth warp idles
#endif

  // 1. The block's q rows (rotated once by rotate_queries_kernel, or as given), zero past the end,
  // 4 channels per load (16 bytes of rotated floats or 8 of bf16; the workspace and q are 16-byte
  // aligned). A load per channel cost ~1800 instructions per thread; 8 bf16 channels per load in
  // a loop of its own made ptxas spill in the INT2 loop. Launched as the programmatic dependent
  // of the rotation, the block waits for it here: the page tables' walk above ran under it.
  ptx::wait_for_prerequisite_grid();
  for (int idx = tid; idx < kExtendRows * D / 4; idx += kExtendThreads) {
    const int row = idx / (D / 4), i = (idx % (D / 4)) * 4;
    const int32_t gr = row0 + row;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (gr < n_rows) {
      const int64_t qrow = query_row(q_begin, gr, g, p.num_qo_heads, head);
      if (args.rotated_q) {
        v = *reinterpret_cast<const float4*>(args.rotated_q + qrow * D + i);
      } else {
        v = bf16x4_to_float4(__ldg(reinterpret_cast<const uint2*>(p.q + qrow * D + i)));
      }
    }
    *reinterpret_cast<float4*>(q_rows + row * D + i) = v;
  }
  __syncthreads();

  // 2. This lane's A fragments of rows r and r + 8 of its warp for INT2 keys: fp16, x 4^-k for
  // code field k, channels in the order the lane's key bytes hold them (BF16 tiles build
  // theirs from the float rows).
  const float* qr0 = q_rows + (16 * group + r) * D;
  const float* qr1 = qr0 + 8 * D;
#if defined(OSCAR_HAS_WGMMA)
  // (The warpgroup path: q' of all 64 rows as the A operand in shared memory instead.)
  float qsum[2];
  write_query_operand<D>(q_rows, smem_address(smem + L::q_f16), tid, qsum);
#else
  float key_bias[2], qsum[2];
  uint4* qa = reinterpret_cast<uint4*>(smem + L::q_f16) + warp * (D / 16) * 32 + lane;
  float bias_part[2] = {0.0f, 0.0f};
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    const int wi = s / 4, k = s % 4;
    const int ch = j * (D / 16) + 4 * wi + k * (D / 4);
    const float inv = 1.0f / float(1 << (2 * k));  // exact scaling
    const uint32_t a[4] = {pack_half2(qr0[ch + 0] * inv, qr0[ch + 2] * inv), pack_half2(qr1[ch + 0] * inv, qr1[ch + 2] * inv),
                           pack_half2(qr0[ch + 1] * inv, qr0[ch + 3] * inv), pack_half2(qr1[ch + 1] * inv, qr1[ch + 3] * inv)};
    qa[s * 32] = make_uint4(a[0], a[1], a[2], a[3]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 h = __half22float2(bits_half2(a[e]));
      bias_part[e & 1] += h.x + h.y;
    }
  }
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
  __syncwarp();  // this warp's fp16 fragments are written
#endif
  int32_t q_pos[2];
  int32_t warp_min_pos;  // the oldest query of the warp: keys up to it need no causal mask
  {
    const int32_t gr0 = row0 + 16 * group + r, gr1 = gr0 + 8;
    q_pos[0] = gr0 < n_rows ? length - n_q + gr0 / g : INT32_MAX;
    q_pos[1] = gr1 < n_rows ? length - n_q + gr1 / g : INT32_MAX;
    warp_min_pos = length - n_q + (row0 + 16 * group) / g;  // the group's first row (if any)
  }

  RowState<D> st;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) st.o[nt][0] = st.o[nt][1] = st.o[nt][2] = st.o[nt][3] = 0.0f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;
  st.offset[0] = st.offset[1] = 0.0f;
  const float scale2 = args.scale2;
  const int32_t sink_tiles = static_cast<int32_t>(attention_tiles(sink.tokens));
  const int32_t body_tiles = static_cast<int32_t>(attention_tiles(body.tokens));
  auto bf16_segment = [&](const SegmentPages& seg, int32_t first_tile) {
    int32_t begin, end;
    chunk_tile_range(item, seg, first_tile, begin, end);
    if (!warp_active) return;
    for (int32_t t = begin + replica; t < end; t += replicas) {
      const int32_t t0 = t * kAttentionTileTokens;
      const TileHalves th = locate_tile(seg, t0);
      extend_bf16_tile<D>(st, qr0, qr1, kv.k_bf16, kv.v_bf16, head, th, seg.start + t0,
                          min(seg.tokens - t0, kAttentionTileTokens), q_pos, scale2, lane);
    }
  };

  // The chunk's INT2 tiles [begin, end), in stages of kExtendStageTiles; issue_stage(gi) copies
  // stage gi into its ring slot (none past the chunk's last stage).
  int32_t begin, end;
  chunk_tile_range(item, body, sink_tiles, begin, end);
  const int32_t limit = min(end * kAttentionTileTokens, body.tokens);
  const int32_t groups = (end - begin + kExtendStageTiles - 1) / kExtendStageTiles;
  const Int2HeadBlocks blocks = int2_head_blocks(kv.k_int2, kv.v_int2, head);
  const uint32_t stage0 = smem_address(stages);
  auto issue_stage = [&](int32_t gi) {
    issue_extend_stage<D>(stage0 + (gi % kExtendStages) * S::kBytes, body, blocks, begin + gi * kExtendStageTiles,
                          gi < groups ? limit : 0, tid);
  };

#if defined(OSCAR_HAS_WGMMA)
  // 3. The chunk's first INT2 stages are issued, the sink and window tiles run under their
  // copies, then the INT2 stages: each unpacked once into the operands (in the q rows' space,
  // free once the BF16 tiles are done) and multiplied by the warpgroup.
  {
    // The second operand buffer and metadata array (ExtendLayout).
    __shared__ __align__(128) struct {
      unsigned char operands[L::operand_bytes];
      float2 meta[2 * ExtendStage<D>::kKeys];
    } second;
    if (begin < end) {
#pragma unroll
      for (int k = 0; k < kExtendStages - 1; ++k) issue_stage(k);
    }
    bf16_segment(sink, 0);
    bf16_segment(recent, sink_tiles + body_tiles);
    if (begin < end) {
      // Software pipeline over two operand buffers: stage gi's score MMAs run while the block
      // unpacks stage gi + 1 into the other buffer; its value MMAs run under the end-of-stage
      // barrier and the next stage's score issue, and are waited for before that unpack (they
      // read the buffer it overwrites). One stage at a time in one buffer made the unpack wait
      // for both MMAs of the stage before.
      using W = ExtendWgmma<D>;
      static_assert(W::kBytes <= L::operand_bytes, "a stage's operands fit each buffer");
      constexpr int kBlocks = W::kKeys / 8;
      // Buffer b at operands0 + b·buffer_step (arithmetic, not an array a runtime b would index
      // in local memory).
      const uint32_t operands0 = smem_address(q_rows), buffer_step = smem_address(second.operands) - operands0;
      auto operands = [&](int b) { return operands0 + b * buffer_step; };
      const uint64_t q_desc = ptx::wgmma_descriptor(smem_address(smem + L::q_f16), 128, W::kRowGroupBytes);
      const float2* const meta0 = reinterpret_cast<const float2*>(smem + L::int2_meta);
      auto meta = [&](int b) { return b ? second.meta : meta0; };
      auto k_desc = [&](int b) { return ptx::wgmma_descriptor(operands(b) + W::kK, 128, W::kRowGroupBytes); };
      auto v_desc = [&](int b) { return ptx::wgmma_descriptor(operands(b) + W::kV, 128, W::kVRowGroupBytes); };
      auto stage_at = [&](int32_t gi) { return stages + (gi % kExtendStages) * S::kBytes; };
      scale_value_units<D>(st, true);
      // Stage 0 into buffer 0, which overlays the q rows: every warp is done with them (the
      // BF16 tiles) at the barrier.
      cp_async_wait<kExtendStages - 2>();
      __syncthreads();
      issue_stage(kExtendStages - 1);
      unpack_stage_operands<D>(stage_at(0), operands(0), smem_address(meta(0)), scale2, tid);
      ptx::fence_proxy_async_shared();  // the stores (and q') visible to wgmma
      __syncthreads();
      uint32_t pa[kBlocks / 2][4] = {};  // P' of the stage whose value MMAs are in flight
      for (int32_t gi = 0; gi < groups; ++gi) {
        const int b = gi & 1;
        float acc[kBlocks][4];
        issue_stage_scores<D>(acc, q_desc, k_desc(b));
        if (gi + 1 < groups) {
          // Buffer b ^ 1 is the one stage gi - 1's value MMAs read: this warp's are done after
          // the wait, every warp's after the barrier, which also sees stage gi + 1 landed.
          ptx::wgmma_wait<1>();
          release_value_operands(pa);
          cp_async_wait<kExtendStages - 2>();
          __syncthreads();
          issue_stage(gi + kExtendStages);  // into the ring slot of stage gi, unpacked before
          unpack_stage_operands<D>(stage_at(gi + 1), operands(b ^ 1), smem_address(meta(b ^ 1)), scale2, tid);
          ptx::fence_proxy_async_shared();
        }
        ptx::wgmma_wait<0>();
        release_value_operands(pa);
        ptx::wgmma_fence_operands(acc);
        ptx::wgmma_fence_operands(st.o);
        const int32_t t0 = (begin + gi * kExtendStageTiles) * kAttentionTileTokens;
        const int valid = min(limit - t0, int(W::kKeys));
        const int32_t first_key = body.start + t0;
        const bool mask = valid < int(W::kKeys) || first_key + int(W::kKeys) - 1 > warp_min_pos;
        issue_stage_values<D>(st, acc, pa, v_desc(b), qsum, meta(b), mask, first_key, valid, q_pos, lane);
        // The next buffer's stores (every thread's) visible before its score MMAs read it.
        __syncthreads();
      }
      ptx::wgmma_wait<0>();
      release_value_operands(pa);
      ptx::wgmma_fence_operands(st.o);
      cp_async_wait<0>();
      scale_value_units<D>(st, false);
    }
  }
#else
  // 3. Sink, INT2 pages (staged for the whole block), window.
  bf16_segment(sink, 0);
  {
    if (begin < end) {
#pragma unroll
      for (int k = 0; k < kExtendStages - 1; ++k) issue_stage(k);
      for (int32_t gi = 0; gi < groups; ++gi) {
        cp_async_wait<kExtendStages - 2>();
        __syncthreads();  // stage gi has landed for every thread; every warp is done with gi - 1
        issue_stage(gi + kExtendStages - 1);
        if (warp_active) {
          const unsigned char* stage = stages + (gi % kExtendStages) * S::kBytes;
#pragma unroll
          for (int t = 0; t < kExtendStageTiles; ++t) {
            const int32_t tile = begin + gi * kExtendStageTiles + t;
            if (t % replicas == replica && tile < end) {
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
#endif
  __syncthreads();  // every warp is done with the q rows, which now take the warps' o

  // 4. Each warp's unnormalized o + offset (through shared memory: its slot of the q rows)
  // and its m, l per row; then the first replica of each row group merges its group's
  // replicas exactly and writes the block's partial state, with coalesced stores.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int mask = 1; mask <= 2; mask *= 2) {
      st.l[i] += __shfl_xor_sync(kFullMask, st.l[i], mask);
      st.offset[i] += __shfl_xor_sync(kFullMask, st.offset[i], mask);
    }
  }
  float* slot_o = q_rows;  // [warps][16][D]
  float* stat_m = reinterpret_cast<float*>(smem + L::stats);  // [warps][16]
  float* stat_w = stat_m + kExtendWarps * 16;                   // l, then the merge weights
  {
    float* wo = slot_o + 16 * warp * D;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        wo[(r + 8 * (c >> 1)) * D + value_channel<D>(2 * j + (c & 1), nt)] = st.o[nt][c] + st.offset[c >> 1];
      }
    }
    if (j == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        stat_m[warp * 16 + r + 8 * i] = warp_active ? st.m[i] : -INFINITY;
        stat_w[warp * 16 + r + 8 * i] = warp_active ? st.l[i] : 0.0f;
      }
    }
  }
  __syncthreads();
  if (replica != 0) return;
  const size_t slot = size_t(item_index) * num_kv_heads + head;
  if (lane < 16) {
    // Row `lane` of the group: weights 2^(m_k - M) / L of its replicas, and the lse.
    float m = -INFINITY;
    for (int k = 0; k < replicas; ++k) m = fmaxf(m, stat_m[(group + k * row_groups) * 16 + lane]);
    float l = 0.0f;
    if (m != -INFINITY) {
      for (int k = 0; k < replicas; ++k) {
        const int w = (group + k * row_groups) * 16 + lane;
        l += exp2f(stat_m[w] - m) * stat_w[w];
      }
    }
    for (int k = 0; k < replicas; ++k) {
      const int w = (group + k * row_groups) * 16 + lane;
      stat_w[w] = l == 0.0f ? 0.0f : exp2f(stat_m[w] - m) / l;  // NaN stays NaN
    }
    args.partial_lse[slot * kExtendRows + 16 * group + lane] = l == 0.0f ? -INFINITY : m + log2f(l);
  }
  __syncwarp();
  float* out_o = args.partial_o + (slot * kExtendRows + 16 * group) * D;
  for (int idx = lane; idx < 16 * D; idx += 32) {
    const int row = idx / D;
    float o = 0.0f;
    for (int k = 0; k < replicas; ++k) {
      const int w = group + k * row_groups;
      o += stat_w[w * 16 + row] * slot_o[w * 16 * D + idx];
    }
    out_o[idx] = o;
  }
}

// Channel i = tid % D of rows part, part + P, ... (part = tid / D, P = kThreads / D) of x·M,
// with x's rows (D floats each) and M ([k][i], D x D) in shared memory: all of a thread's rows
// at once, one load of M per k and a float4 of each row per 4 k (a row at a time was one chain
// of D dependent fmas per row), the fmas in k order (the CPU reference's).
template <int D, int kThreads, int kRows>
OSCAR_DEVICE void rows_times_matrix(const float* x, const float* m, int tid, float (&out)[kRows / (kThreads / D)]) {
  constexpr int kParts = kThreads / D;
  static_assert(kThreads % D == 0 && kRows % kParts == 0, "whole rows per thread");
  const int i = tid % D, part = tid / D;
#pragma unroll
  for (int rr = 0; rr < kRows / kParts; ++rr) out[rr] = 0.0f;
#pragma unroll 2
  for (int k = 0; k < D; k += 4) {
    const float m0 = m[k * D + i], m1 = m[(k + 1) * D + i], m2 = m[(k + 2) * D + i], m3 = m[(k + 3) * D + i];
#pragma unroll
    for (int rr = 0; rr < kRows / kParts; ++rr) {
      const float4 v = *reinterpret_cast<const float4*>(x + (part + rr * kParts) * D + k);
      out[rr] = fmaf(v.w, m3, fmaf(v.z, m2, fmaf(v.y, m1, fmaf(v.x, m0, out[rr]))));
    }
  }
}

// Merges the chunks of a (request, row tile) exactly (weights 2^(lse_k - lse)), un-rotates
// by R_Vᵀ and writes bf16 o and the natural-log lse. Grid: items x KV heads x (64 / 16) row
// groups; blocks of items that are not the first chunk of their tile return at once. R_V is
// staged (transposed) in shared memory with one round of coalesced loads: read straight from
// global memory, each thread's row of R_V was a chain of dependent cold-cache loads (~30 us
// for one 16-token extend on the H200).
inline constexpr int kMergeRows = 16;
inline constexpr int kMergeThreads = 256;

template <int D>
struct MergeLayout {
  static constexpr size_t rotation = 0;                                     // float [D][D], R_Vᵀ
  static constexpr size_t o = rotation + sizeof(float) * D * D;             // float [16][D]
  static constexpr size_t w = o + sizeof(float) * kMergeRows * D;           // float [chunks][16]
  static constexpr size_t lse = w + sizeof(float) * kMaxAttentionChunks * kMergeRows;  // float [16]
  static constexpr size_t bytes = lse + sizeof(float) * kMergeRows;
};

template <int D>
__global__ void __launch_bounds__(kMergeThreads) extend_merge_kernel(const ExtendArgs args) {
  using L = MergeLayout<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* rot_t = reinterpret_cast<float*>(smem + L::rotation);
  float* o = reinterpret_cast<float*>(smem + L::o);
  float* w = reinterpret_cast<float*>(smem + L::w);
  float* lse = reinterpret_cast<float*>(smem + L::lse);
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
  // R_V's rows and then the lse loads all go out before any is stored: one L2 / DRAM round trip
  // for both (the staging loop as the compiler unrolled it kept 4 float4 in flight per thread:
  // four round trips, ~4 us of a cold-cache merge). R_V is read before the wait for the extend
  // grid (launched as its programmatic dependent, the merge may start during its last wave).
  constexpr int kRotationLoads = D * D / 4 / kMergeThreads;
  static_assert(D * D / 4 % kMergeThreads == 0);
  float4 r[kRotationLoads];
  if (p.output_unrotation) {
#pragma unroll
    for (int e = 0; e < kRotationLoads; ++e) {
      const int idx = tid + e * kMergeThreads, i = idx % D, k4 = idx / D;
      r[e] = __ldg(reinterpret_cast<const float4*>(p.output_unrotation + size_t(i) * D) + k4);
    }
  }
  ptx::wait_for_prerequisite_grid();  // the partial (o, lse) of every chunk
  constexpr int kLsePerThread = (kMaxAttentionChunks * kMergeRows + kMergeThreads - 1) / kMergeThreads;
  float lse_k[kLsePerThread];
#pragma unroll
  for (int e = 0; e < kLsePerThread; ++e) {
    const int idx = tid + e * kMergeThreads;
    lse_k[e] = idx < chunks * kMergeRows ? __ldcg(args.partial_lse + slot_of(idx / kMergeRows) + idx % kMergeRows) : 0.0f;
  }
  if (p.output_unrotation) {
    // rot_t[k][i] = R_V[i][k]. Consecutive threads hold consecutive rows i, so the transposed
    // stores hit distinct banks.
#pragma unroll
    for (int e = 0; e < kRotationLoads; ++e) {
      const int idx = tid + e * kMergeThreads, i = idx % D, k4 = idx / D;
      rot_t[(4 * k4 + 0) * D + i] = r[e].x;
      rot_t[(4 * k4 + 1) * D + i] = r[e].y;
      rot_t[(4 * k4 + 2) * D + i] = r[e].z;
      rot_t[(4 * k4 + 3) * D + i] = r[e].w;
    }
  }
#pragma unroll
  for (int e = 0; e < kLsePerThread; ++e) {
    if (tid + e * kMergeThreads < chunks * kMergeRows) w[tid + e * kMergeThreads] = lse_k[e];
  }
  __syncthreads();  // w and the staged R_V
  chunk_merge_weights<kMergeRows>(w, lse, chunks, tid, kMergeThreads);
  // Σ_k w_k·o_k of the 16 rows, every row (rows past n_rows are zeros and not stored below).
  // (A loop over a thread's elements, each with its own 8-chunk batches and a round trip per
  // leftover chunk, chained 8 x chunks / 8 L2 round trips at d = 128; on the H200 the batched
  // form measured within noise of that at Q = 64 / 256, 251 / 814 -> 249 / 809 us: the merge
  // is a small part of those extends.)
  const size_t chunk_stride = size_t(num_kv_heads) * kExtendRows * D;
  constexpr int kInFlight = 64;
  merge_chunk_outputs<D, kMergeRows, kMergeRows, kMergeThreads, kInFlight, /*kEveryRow=*/true>(
      args.partial_o + slot_of(0) * D, chunk_stride, w, chunks, kMergeRows, o, tid);
  __syncthreads();
  // Thread (i, part): output channel i of rows part, part + P, ... (P = threads / D).
  constexpr int kParts = kMergeThreads / D;
  constexpr int kRowsPerThread = kMergeRows / kParts;
  const int i = tid % D, part = tid / D;
  float out[kRowsPerThread];
  if (p.output_unrotation) {
    rows_times_matrix<D, kMergeThreads, kMergeRows>(o, rot_t, tid, out);
  } else {
#pragma unroll
    for (int rr = 0; rr < kRowsPerThread; ++rr) out[rr] = o[(part + rr * kParts) * D + i];
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerThread; ++rr) {
    if (part + rr * kParts < rows) {
      const int32_t gr = row0 + part + rr * kParts;
      const int64_t qrow = query_row(q_begin, gr, g, p.num_qo_heads, head);
      reinterpret_cast<__nv_bfloat16*>(p.out)[qrow * D + i] = __float2bfloat16_rn(out[rr]);
    }
  }
  if (p.lse && tid < rows) {
    const int32_t gr = row0 + tid;
    const int64_t qrow = query_row(q_begin, gr, g, p.num_qo_heads, head);
    p.lse[qrow] = lse[tid] * kLn2;
  }
}

// q·R_K of every query row of the batch, once, in float ([rows][D], rows = tokens x qo
// heads): the extend blocks of every chunk then read the rotated rows instead of each
// rotating its own. R_K is staged in shared memory by one round of coalesced loads, all in
// flight at once. 16 rows per block: at 8 new tokens (256 rows) 32 rows per block left 8 SMs
// doing 4,200 instructions per thread each, ~10 us on the H200.
inline constexpr int kRotateRows = 16;
inline constexpr int kRotateThreads = 256;

template <int D>
struct RotateLayout {
  static_assert(D <= kAttentionRowTiledMaxHeadDim, "the row-tiled extend path's head dims");
  static constexpr size_t rotation = 0;                 // float [D][D]
  static constexpr size_t q = sizeof(float) * D * D;     // float [16][D]
  static constexpr size_t bytes = q + sizeof(float) * kRotateRows * D;
};

template <int D>
__global__ void __launch_bounds__(kRotateThreads) rotate_queries_kernel(const bf16_t* q, const float* rotation,
                                                                        int64_t rows, float* rotated) {
  using L = RotateLayout<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* rs = reinterpret_cast<float*>(smem + L::rotation);
  float* qs = reinterpret_cast<float*>(smem + L::q);
  ptx::allow_dependent_launch();  // the extend blocks' prologue runs under this grid
  const int64_t row0 = int64_t{blockIdx.x} * kRotateRows;
  constexpr int kRotationLoads = D * D / 4 / kRotateThreads;
  static_assert(D * D / 4 % kRotateThreads == 0);
  float4 r[kRotationLoads];
#pragma unroll
  for (int e = 0; e < kRotationLoads; ++e) {
    r[e] = __ldg(reinterpret_cast<const float4*>(rotation) + threadIdx.x + e * kRotateThreads);
  }
  for (int idx = threadIdx.x; idx < kRotateRows * D / 8; idx += kRotateThreads) {  // 8 bf16 channels per load
    const int64_t row = row0 + idx / (D / 8);
    const int i = (idx % (D / 8)) * 8;
    float v[8] = {};
    if (row < rows) bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(q + row * D + i)), v);
    *reinterpret_cast<float4*>(qs + (idx / (D / 8)) * D + i) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(qs + (idx / (D / 8)) * D + i + 4) = make_float4(v[4], v[5], v[6], v[7]);
  }
#pragma unroll
  for (int e = 0; e < kRotationLoads; ++e) reinterpret_cast<float4*>(rs)[threadIdx.x + e * kRotateThreads] = r[e];
  __syncthreads();
  // Thread (i, part): channel i of rows part, part + P, ... (P = threads / D).
  constexpr int kParts = kRotateThreads / D;
  constexpr int kRowsPerThread = kRotateRows / kParts;
  const int i = threadIdx.x % D, part = threadIdx.x / D;
  float acc[kRowsPerThread];
  rows_times_matrix<D, kRotateThreads, kRotateRows>(qs, rs, threadIdx.x, acc);
#pragma unroll
  for (int rr = 0; rr < kRowsPerThread; ++rr) {
    const int64_t row = row0 + part + rr * kParts;
    if (row < rows) rotated[row * D + i] = acc[rr];
  }
}

}  // namespace attention_detail
}  // namespace oscar
