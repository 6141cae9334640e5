// The decode kernel builds with its measurement knob OSCAR_ATTENTION_PROBE=1 (compute only;
// docs/benchmarks.md), which no other target builds. The d = 64 kernel of paired column tiles
// is instantiated (its functions are the single-tile kernel's, with NT = 2), so the knob's
// code is generated, not only parsed.
#define OSCAR_ATTENTION_PROBE 1
#include "oscar/attention/paged_attention.cuh"

template __global__ void oscar::attention_detail::paged_attention_kernel<64, 2>(oscar::attention_detail::KernelArgs);
