// The Ampere/Hopper warp-level primitives the kernels share: mma.sync (fp16 and bf16 inputs,
// fp32 accumulators), ldmatrix, and cp.async into shared memory. Thin wrappers over one PTX
// instruction each, so the attention and write kernels spell them the same way.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "oscar/core/config.hpp"

namespace oscar::ptx {

OSCAR_DEVICE uint32_t smem_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Shared-memory loads at a 32-bit shared address (the stage loops keep byte offsets, not
// generic pointers, so an address is one add). volatile: they stay after the cp.async wait
// that makes their bytes visible.
OSCAR_DEVICE uint32_t lds_u16(uint32_t addr) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}
OSCAR_DEVICE uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
OSCAR_DEVICE uint2 lds_v2(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
OSCAR_DEVICE uint4 lds_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// a·b as a 64-bit product of two 32-bit ints, in one instruction (int64 operands make the
// compiler emit the full 64x64 multiply even when both are sign-extended ints).
OSCAR_DEVICE int64_t mul_wide(int32_t a, int32_t b) {
  int64_t r;
  asm("mul.wide.s32 %0, %1, %2;" : "=l"(r) : "r"(a), "r"(b));
  return r;
}

// D += A·B for one m16n8k16 tile: A row-major 16x16 (four registers of two halves), B
// column-major 16x8 (two registers), D fp32 in the standard accumulator layout.
OSCAR_DEVICE void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
OSCAR_DEVICE void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 16-bit matrices from shared memory; lanes 8m..8m+7 give the row addresses of
// matrix m (16 bytes each). `trans` delivers each matrix transposed.
OSCAR_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
OSCAR_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

OSCAR_DEVICE void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// The same copy where `copy` holds, and nothing otherwise: a predicate instead of a branch,
// for lanes of a warp that copy different amounts.
OSCAR_DEVICE void cp_async16_if(bool copy, uint32_t dst, const void* src) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16;\n}" ::"r"(dst),
      "l"(src), "r"(int(copy))
      : "memory");
}
// 16 bytes from src to dst, or (zero_fill) 16 zero bytes at dst and nothing read: lanes that
// have nothing to copy issue the same instruction as those that do (the predicate is the
// copy's own ignore-src operand), with no branch around it.
OSCAR_DEVICE void cp_async16_or_zero(uint32_t dst, const void* src, bool zero_fill) {
  asm volatile(
      "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, z;\n}" ::"r"(dst),
      "l"(src), "r"(int(zero_fill))
      : "memory");
}
// The same for 4 bytes (through L1: cp.async copies 4 or 8 bytes only as .ca).
OSCAR_DEVICE void cp_async4_or_zero(uint32_t dst, const void* src, bool zero_fill) {
  asm volatile(
      "{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n cp.async.ca.shared.global [%0], [%1], 4, z;\n}" ::"r"(dst),
      "l"(src), "r"(int(zero_fill))
      : "memory");
}
OSCAR_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
OSCAR_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Waits until kThreads threads (a multiple of 32) of the block have arrived at barrier kId
// (1-15; 0 is __syncthreads'): a barrier for part of a block, e.g. one warpgroup. The id is an
// immediate: with a register id, ptxas reserves all 16 of the block's barriers.
template <int kId, int kThreads>
OSCAR_DEVICE void named_barrier_sync() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0);
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}
// Arrives at barrier kId without waiting: the producer's half of a handoff whose consumers
// bar.sync on it with the same kThreads (the arrivals of both sides); the barrier orders the
// arriving threads' earlier shared-memory writes before the waiting threads' later reads.
template <int kId, int kThreads>
OSCAR_DEVICE void named_barrier_arrive() {
  static_assert(kId > 0 && kId < 16 && kThreads % 32 == 0);
  asm volatile("bar.arrive %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}

}  // namespace oscar::ptx
