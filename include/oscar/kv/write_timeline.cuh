// A measurement knob for the phases of a decode append (append_columns_kernel or append_kernel,
// whichever exact_append_launch picks). Built
// with OSCAR_WRITE_TIMELINE defined, thread 0 of every block stamps clock64 at each
// WriteTimelineMark, and %globaltimer at the block's start and end, into g_write_timeline;
// bench_write_gpu prints, after each decode-append benchmark's last timed run, the span from
// the first block's start to the last block's end and each phase's average in cycles
// (docs/benchmarks.md, "Where a decode append spends its time"). Phases are clock64
// differences within a block (%globaltimer ticks about once a microsecond on the H200, too
// coarse for them). Without the macro the marks compile to nothing.
#pragma once

#include <cuda_runtime.h>

#include "oscar/core/config.hpp"

namespace oscar::write_detail {

enum WriteTimelineMark : int {
  kWriteStart,     // the block's first instruction
  kWriteIssued,    // R's loads (or copies) and the first rows' loads issued
  kWriteChecked,   // the slots checked (block-wide)
  kWriteStaged,    // R in shared memory (append_kernel) / the first rows in shared memory (columns)
  kWriteFirstRow,  // the first row (group of rows) rotated
  kWriteEnd,       // every warp done (after a barrier)
  kWriteTimelineMarks
};
inline constexpr int kWriteTimelineBlocks = 4096;  // blocks (blockIdx.x * gridDim.y + blockIdx.y) stamped
// Per block: the clock64 of every mark, then the %globaltimer of kWriteStart and kWriteEnd.
inline constexpr int kWriteTimelineStart = kWriteTimelineMarks, kWriteTimelineEnd = kWriteTimelineMarks + 1;

#ifdef OSCAR_WRITE_TIMELINE
static __device__ unsigned long long g_write_timeline[kWriteTimelineBlocks][kWriteTimelineMarks + 2];
OSCAR_DEVICE void write_timeline_mark(WriteTimelineMark mark) {
  const unsigned block = blockIdx.x * gridDim.y + blockIdx.y;
  if (threadIdx.x != 0 || block >= kWriteTimelineBlocks) return;
  unsigned long long t;
  if (mark == kWriteStart || mark == kWriteEnd) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    g_write_timeline[block][mark == kWriteStart ? kWriteTimelineStart : kWriteTimelineEnd] = t;
  }
  g_write_timeline[block][mark] = clock64();
}
// The end mark after a barrier, so that it covers every warp (all of the block's threads
// must call it).
OSCAR_DEVICE void write_timeline_end() {
  __syncthreads();
  write_timeline_mark(kWriteEnd);
}
#else
OSCAR_DEVICE void write_timeline_mark(WriteTimelineMark) {}
OSCAR_DEVICE void write_timeline_end() {}
#endif

}  // namespace oscar::write_detail
