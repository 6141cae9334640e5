// A measurement knob for the decode kernel's phases. Built with OSCAR_ATTENTION_TIMELINE
// defined, thread 0 of every block stamps %globaltimer at each TimelineMark into
// g_attention_timeline, and bench_attention_gpu prints, after a benchmark's last timed run,
// the stamps of the block that finished last and each phase's average over the blocks
// (docs/benchmarks.md, "Where a B = 1 decode spends its time"). Without it the marks compile
// to nothing. %globaltimer ticks coarsely (about a microsecond on the H200), so read a single
// phase only as an average over many blocks.
#pragma once

#include <cuda_runtime.h>

#include "oscar/core/config.hpp"

namespace oscar::attention_detail {

enum TimelineMark : int {
  kMarkStart,         // the block's first instruction
  kMarkIssued,        // page tables read, the first INT2 copies issued
  kMarkQLoaded,       // q in shared memory
  kMarkRotated,       // q rotated by R_K (or not: engine-rotated)
  kMarkFragments,     // q's fragments and sums built
  kMarkLoopStart,     // past the fragments' barrier
  kMarkLoopEnd,       // the chunk's tiles done
  kMarkWarpsMerged,   // the block's warps merged
  kMarkPublished,     // a split request's non-last block: partial state published, exits
  kMarkChunksMerged,  // the last block: every chunk merged
  kMarkEnd,           // output written
  kTimelineMarks
};
inline constexpr int kTimelineBlocks = 8192;  // blocks (blockIdx.x * gridDim.y + blockIdx.y) stamped

#ifdef OSCAR_ATTENTION_TIMELINE
static __device__ unsigned long long g_attention_timeline[kTimelineBlocks][kTimelineMarks];
OSCAR_DEVICE void timeline_mark(TimelineMark mark) {
  const unsigned block = blockIdx.x * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0 && block < kTimelineBlocks) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    g_attention_timeline[block][mark] = t;
  }
}
#else
OSCAR_DEVICE void timeline_mark(TimelineMark) {}
#endif

}  // namespace oscar::attention_detail
