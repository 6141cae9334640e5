// Rotation of a tile of cache rows, y = x·R, on tensor cores: the bulk-write path of append
// (a prefill chunk writes thousands of rows per layer, and the d² FMAs per row on CUDA cores
// were two thirds of its time).
//
// R (fp32, d×d) is staged once per block in shared memory as two bf16 matrices,
// R_hi = bf16(R) and R_lo = bf16(R − R_hi); the rows are bf16 already, so each product is
// exact and x·R_lo + x·R_hi, accumulated in fp32 by the MMAs (warpgroup MMAs on sm_90a,
// mma.sync elsewhere), is x·R to 2^-18 of Σ_i |x_i R_ij| plus the fp32 accumulation error,
// which the FMA path has too. The bf16 rounding that follows is 2^-9 relative, so the stored
// row nearly always equals the FMA-ordered rotation of the CPU reference, but not always: an
// element near a rounding boundary can land on the neighbouring bf16 value, and where the sum
// cancels (|y_j| much smaller than Σ|x_i R_ij|) a few steps away (~0.2% of elements in all,
// measured on the H200 and the H100 with random and real rows;
// tests/common/tensor_core_append.hpp bounds them). Callers that need the CPU reference's
// bytes choose the FMA path (AppendRotation::kExactFma).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "oscar/core/numeric.hpp"
#include "oscar/core/tensor_core.cuh"
#include "oscar/core/wgmma.cuh"

namespace oscar::write_detail {

// A warpgroup's rows: 4 warps x 16, each warp owning the 16 rows of its place in the warpgroup
// MMA's M dimension (on sm_90a, warps 4g .. 4g + 3 are warpgroup g).
inline constexpr int kWarpgroupRows = 64;

// Element (row, col) of a [rows][D] bf16 array in shared memory: the 16-byte chunk c of row r
// sits at chunk c ^ (r % 8), so the 8 rows one ldmatrix phase reads fall in 8 different
// 16-byte bank groups instead of one (every row is a multiple of 128 bytes long).
template <int D>
OSCAR_DEVICE int swizzled(int row, int col) {
  static_assert(D % 64 == 0, "the swizzle needs at least 8 chunks per row");
  return row * D + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// Where R's element (i, j) (i = input channel, the MMA's k; j = output channel, its n) sits
// in r_hi / r_lo. sm_90a (warpgroup MMAs, wgmma.cuh): B's no-swizzle K-major core matrices,
// 8 output channels x 8 input channels of 16 contiguous bytes each, ordered [j / 8][i / 8];
// a 16-deep k-step is then 2 core matrices 128 bytes apart (the descriptor's leading byte
// offset), and output channels 8 apart are 16·D bytes apart (its stride byte offset).
// Otherwise (mma.sync, read by ldmatrix.trans): row i, swizzled.
template <int D>
OSCAR_DEVICE int rotation_index(int i, int j) {
#if defined(OSCAR_HAS_WGMMA)
  return (j / 8) * (8 * D) + (i / 8) * 64 + (j % 8) * 8 + i % 8;
#else
  return swizzled<D>(i, j);
#endif
}

// The epilogue converts the accumulators two at a time with bf16_pair_bits (cvt.rn.bf16x2.f32
// and a NaN select: ~3 instructions per pair) instead of float_to_bf16's integer steps (~10
// per element): the same bytes (test_functors_gpu checks bf16_pair_bits against float_to_bf16
// on a million floats, NaNs included). Measured on an H100: the rotated bulk write 182 -> 158
// us (fitted clip ratios 206 -> 187), unrotated unchanged. -DOSCAR_ROTATION_PAIR_CONVERSION=0
// restores the integer steps, for comparison.
#if defined(OSCAR_ROTATION_PAIR_CONVERSION)
inline constexpr bool kRotationPairConversion = OSCAR_ROTATION_PAIR_CONVERSION;
#else
inline constexpr bool kRotationPairConversion = true;
#endif
// Two rotated elements as a bf16 pair (lo in the low half), by the knob's conversion.
OSCAR_DEVICE uint32_t rotated_pair_bits(float lo, float hi) {
  if constexpr (kRotationPairConversion) {
    return bf16_pair_bits(lo, hi);
  } else {
    return uint32_t{float_to_bf16(lo).bits} | uint32_t{float_to_bf16(hi).bits} << 16;
  }
}

// R as the block's MMAs read it.
template <int D>
struct StagedRotation {
  bf16_t r_hi[D * D];  // R_hi at rotation_index(i, j)
  bf16_t r_lo[D * D];
};

// An element of R as its bf16 parts: hi = bf16(r), lo = bf16(r - hi).
struct Bf16Split {
  uint16_t hi, lo;
};
OSCAR_DEVICE Bf16Split split_bf16(float r) {
  const bf16_t hi = float_to_bf16(r);
  return {hi.bits, float_to_bf16(r - bf16_to_float(hi)).bits};
}

// R (16-byte aligned, row-major) -> the block's R_hi / R_lo. All threads; ends synchronized.
template <int D>
OSCAR_DEVICE void stage_rotation(const float* rotation, StagedRotation<D>& tile) {
#if defined(OSCAR_HAS_WGMMA)
  // A thread takes 8 input channels of one output channel (one 16-byte piece of a core
  // matrix); the lanes of a warp read 32 consecutive output channels of each row of R.
  for (int idx = threadIdx.x; idx < D * D / 8; idx += blockDim.x) {
    const int i0 = (idx / D) * 8, j = idx % D;
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int c = 0; c < 8; c += 2) {
      const Bf16Split a = split_bf16(__ldg(rotation + (i0 + c) * D + j));
      const Bf16Split b = split_bf16(__ldg(rotation + (i0 + c + 1) * D + j));
      hi[c / 2] = a.hi | uint32_t{b.hi} << 16;
      lo[c / 2] = a.lo | uint32_t{b.lo} << 16;
    }
    *reinterpret_cast<uint4*>(tile.r_hi + rotation_index<D>(i0, j)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(tile.r_lo + rotation_index<D>(i0, j)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
  ptx::fence_proxy_async_shared();  // the stores visible to the warpgroup MMAs that read them
#else
  for (int idx = threadIdx.x; idx < D * D / 4; idx += blockDim.x) {
    const int i = idx / (D / 4), j = (idx % (D / 4)) * 4;
    const float4 r = __ldg(reinterpret_cast<const float4*>(rotation) + idx);
    const float v[4] = {r.x, r.y, r.z, r.w};
    Bf16Split part[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) part[c] = split_bf16(v[c]);
    *reinterpret_cast<uint2*>(tile.r_hi + rotation_index<D>(i, j)) =
        make_uint2(part[0].hi | uint32_t{part[1].hi} << 16, part[2].hi | uint32_t{part[3].hi} << 16);
    *reinterpret_cast<uint2*>(tile.r_lo + rotation_index<D>(i, j)) =
        make_uint2(part[0].lo | uint32_t{part[1].lo} << 16, part[2].lo | uint32_t{part[3].lo} << 16);
  }
#endif
  __syncthreads();
}

// The calling warp's 16 rows of `tile_rows` (swizzled; rows 16·warp ...) become their
// rotation, rounded to bf16 (float_to_bf16's bytes: ties to even, one canonical NaN). Touches
// no other rows. On sm_90a the 4 warps of a warpgroup call it together, with warp = 4k .. 4k + 3
// for rows 64k .. 64k + 63 of tile_rows (warp % 4 is the warp's place in the warpgroup MMA's
// M): each warpgroup MMA multiplies the 64 rows of 4 warps by a 16-deep slice of R_lo or R_hi
// read once from shared memory, where mma.sync's warps each read all of R per 16 rows (64 KB
// at d = 128: shared-memory bandwidth bound the rotation).
template <int D>
OSCAR_DEVICE void rotate_warp_rows(const StagedRotation<D>& tile, bf16_t* tile_rows, int warp, int lane) {
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  // ldmatrix addresses: lanes 8m..8m+7 give the rows of matrix m. A (x, row-major 16x16):
  // m = (row half, k half) = (m & 1, m >> 1).
  const int a_row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int half = (lane >> 4) * 8;
  const uint32_t rows = ptx::smem_address(tile_rows), hi = ptx::smem_address(tile.r_hi),
                 lo = ptx::smem_address(tile.r_lo);
#if defined(OSCAR_HAS_WGMMA)
  // The MMAs read their A registers asynchronously, until the wait: half of the k-steps' A
  // fragments are loaded, multiplied and waited for, then the other half into the same
  // registers (all 8 at once would hold 32 registers beside the 64 accumulators: spills).
  constexpr int kSteps = D / 16, kHalf = kSteps / 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t a[kHalf][4];
#pragma unroll
    for (int s = 0; s < kHalf; ++s) ptx::ldmatrix_x4(a[s], rows + 2 * swizzled<D>(a_row, 16 * (h * kHalf + s) + half));
    ptx::wgmma_fence_operands(acc);
    ptx::wgmma_fence();
#pragma unroll
    for (int s = 0; s < kHalf; ++s) {
      // k-step k starts 2 core matrices (256 bytes) after the previous one.
      const int k = h * kHalf + s;
      const uint64_t b_lo = ptx::wgmma_descriptor(lo + 256 * k, 128, 16 * D);
      const uint64_t b_hi = ptx::wgmma_descriptor(hi + 256 * k, 128, 16 * D);
      if constexpr (D == 128) {
        ptx::wgmma_m64n128k16_rs_bf16(acc, a[s], b_lo);  // the small terms first
        ptx::wgmma_m64n128k16_rs_bf16(acc, a[s], b_hi);
      } else {
        static_assert(D == 64, "the warpgroup rotation covers head_dim 64 and 128");
        ptx::wgmma_m64n64k16_rs_bf16(acc, a[s], b_lo);
        ptx::wgmma_m64n64k16_rs_bf16(acc, a[s], b_hi);
      }
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    ptx::wgmma_fence_operands(acc);
    ptx::wgmma_fence_operands(a);  // the A registers stay untouched until the MMAs are done
  }
#else
  // B (R, stored k-major, read transposed): m = (k half, n tile) = (m & 1, m >> 1), matching
  // b0/b1 of two n tiles.
  const int b_k = (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll 2
  for (int k = 0; k < D; k += 16) {
    uint32_t a[4];
    ptx::ldmatrix_x4(a, rows + 2 * swizzled<D>(a_row, k + half));
#pragma unroll
    for (int n = 0; n < D; n += 16) {
      const int offset = 2 * rotation_index<D>(k + b_k, n + half);
      uint32_t b[4];
      ptx::ldmatrix_x4_trans(b, lo + offset);  // the small terms first
      ptx::mma_bf16(acc[n / 8], a, b[0], b[1]);
      ptx::mma_bf16(acc[n / 8 + 1], a, b[2], b[3]);
      ptx::ldmatrix_x4_trans(b, hi + offset);
      ptx::mma_bf16(acc[n / 8], a, b[0], b[1]);
      ptx::mma_bf16(acc[n / 8 + 1], a, b[2], b[3]);
    }
  }
#endif
  __syncwarp();  // every lane's A fragments are read before the rows are overwritten
  const int r0 = warp * 16 + lane / 4, c0 = 2 * (lane % 4);
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = n * 8 + c0;
    *reinterpret_cast<uint32_t*>(tile_rows + swizzled<D>(r0, col)) = rotated_pair_bits(acc[n][0], acc[n][1]);
    *reinterpret_cast<uint32_t*>(tile_rows + swizzled<D>(r0 + 8, col)) = rotated_pair_bits(acc[n][2], acc[n][3]);
  }
  __syncwarp();
}

}  // namespace oscar::write_detail
