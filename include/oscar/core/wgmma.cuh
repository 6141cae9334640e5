// Hopper's warpgroup MMA (wgmma.mma_async), for kernels built for sm_90a: a warpgroup of 4
// consecutive warps multiplies a 64-row A (from registers or shared memory) by a B read from
// shared memory once for all four warps. Defines OSCAR_HAS_WGMMA in the device pass of an
// sm_90a build (CMAKE_CUDA_ARCHITECTURES 90a, or -gencode=arch=compute_90a,code=sm_90a); an
// sm_90 build gets none of these instructions and the kernels keep their mma.sync paths.
//
// Operands in shared memory use the no-swizzle K-major layout: 8x8 "core matrices" of 16-bit
// elements (8 rows of 16 contiguous bytes, 128 bytes in all); the descriptor's leading byte
// offset is the distance between the two core matrices of a 16-deep k-step, its stride byte
// offset the distance between core matrices 8 rows apart (PTX ISA, "Shared Memory Matrix
// Layout"). Accumulators: warp w of the warpgroup holds rows 16w .. 16w + 15, in mma.m16n8's
// accumulator layout repeated over N/8 column blocks: d[i][0..1] row r = lane/4, columns
// 8i + 2(lane%4) + {0,1}; d[i][2..3] row r + 8.
#pragma once

#include <cstdint>
#include <type_traits>

#include "oscar/core/config.hpp"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OSCAR_HAS_WGMMA 1
#endif

namespace oscar::ptx {

// A shared-memory matrix descriptor without swizzle: start address, leading and stride byte
// offsets (all multiples of 16).
OSCAR_HOST_DEVICE constexpr uint64_t wgmma_descriptor(uint32_t smem_address, uint32_t leading_bytes,
                                                      uint32_t stride_bytes) {
  return uint64_t((smem_address & 0x3FFFFu) >> 4) | (uint64_t((leading_bytes & 0x3FFFFu) >> 4) << 16) |
         (uint64_t((stride_bytes & 0x3FFFFu) >> 4) << 32);
}

#if defined(OSCAR_HAS_WGMMA)
// Orders this thread's earlier register writes (accumulators, A fragments) before the
// warpgroup MMAs that follow.
OSCAR_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
OSCAR_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most kPending committed groups are still running.
template <int kPending>
OSCAR_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Pins MMA operand registers at this point of the program: accumulators (float), which the
// compiler sees the MMAs' asm write at issue, so without this it could read or move them
// between the MMA and the wait that completes it; and A fragments (uint32_t), after the
// wait, since their registers may not be reused before it (the MMAs read them
// asynchronously).
template <class T, int R, int C>
OSCAR_DEVICE void wgmma_fence_operands(T (&x)[R][C]) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint32_t>);
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if constexpr (std::is_same_v<T, float>) {
        asm volatile("" : "+f"(x[r][c])::"memory");
      } else {
        asm volatile("" : "+r"(x[r][c])::"memory");
      }
    }
  }
}
// Makes this thread's shared-memory stores visible to the async proxy that wgmma reads its
// operands through (then a barrier, for the other threads' stores).
OSCAR_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// D[64 x 64] = A[64 x 16] · B[16 x 64] (scale-d 0: D's old contents are not read, so the
// first MMA of a chain needs no zeroed accumulator). A and B in shared memory.
OSCAR_DEVICE void wgmma_m64n64k16_ss_first(float (&d)[8][4], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}"
      : "=f"(d[0][0]), "=f"(d[0][1]), "=f"(d[0][2]), "=f"(d[0][3]), "=f"(d[1][0]), "=f"(d[1][1]), "=f"(d[1][2]), "=f"(d[1][3]), "=f"(d[2][0]), "=f"(d[2][1]), "=f"(d[2][2]), "=f"(d[2][3]), "=f"(d[3][0]), "=f"(d[3][1]), "=f"(d[3][2]), "=f"(d[3][3]), "=f"(d[4][0]), "=f"(d[4][1]), "=f"(d[4][2]), "=f"(d[4][3]), "=f"(d[5][0]), "=f"(d[5][1]), "=f"(d[5][2]), "=f"(d[5][3]), "=f"(d[6][0]), "=f"(d[6][1]), "=f"(d[6][2]), "=f"(d[6][3]), "=f"(d[7][0]), "=f"(d[7][1]), "=f"(d[7][2]), "=f"(d[7][3])
      : "l"(a), "l"(b));
}

// D[64 x 64] += A[64 x 16] · B[16 x 64]: A and B in shared memory (K-major descriptors).
OSCAR_DEVICE void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a), "l"(b));
}

// D[64 x N] += A[64 x 16] · B[16 x N] for N = 64 and 128, on fp16 operands (the extend
// kernel's unpacked codes) or bf16 ones (the tensor-core append's rotation: bf16 rows times R
// split into bf16 R_hi + R_lo): A in registers (this thread's fragment of its warp's 16 rows,
// as mma.m16n8k16's A), B in shared memory (K-major descriptor). One body per shape, stamped
// out for each element type.
#define OSCAR_WGMMA_M64N64K16_RS(NAME, TYPE)                                                              \
  OSCAR_DEVICE void NAME(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b) {                          \
    asm volatile(                                                                                  \
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}" \
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                     \
  }
#define OSCAR_WGMMA_M64N128K16_RS(NAME, TYPE)                                                              \
  OSCAR_DEVICE void NAME(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b) {                          \
    asm volatile(                                                                                  \
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                                \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}" \
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                     \
  }
OSCAR_WGMMA_M64N64K16_RS(wgmma_m64n64k16_rs, "f16")
OSCAR_WGMMA_M64N128K16_RS(wgmma_m64n128k16_rs, "f16")
OSCAR_WGMMA_M64N64K16_RS(wgmma_m64n64k16_rs_bf16, "bf16")
OSCAR_WGMMA_M64N128K16_RS(wgmma_m64n128k16_rs_bf16, "bf16")
#undef OSCAR_WGMMA_M64N64K16_RS
#undef OSCAR_WGMMA_M64N128K16_RS
#endif  // OSCAR_HAS_WGMMA

}  // namespace oscar::ptx
