// The library's paged cache with its pools on the GPU, behind oscar-decode's KvCache: what an
// engine does with oscar's kernels (docs/gpu.md), on a real model whose forward runs on the
// CPU. A books-only host::PagedCache plans each step's slots and demotions; demote_kv and
// append_kv write the step's K/V rows on the device, a layer at a time; paged_attention reads
// them (decode for one new token, extend for several). The rows cross the bus every layer,
// so this is a check of the kernels on a real model, not a fast path: an engine keeps its
// activations on the device. q, like K and V, reaches the kernels as bf16, and the attention
// output comes back as bf16.
//
// Built only where CUDA is (OSCAR_ENABLE_CUDA, which defines OSCAR_DECODE_GPU for the app);
// without it cache_methods.hpp refuses the @gpu methods with a status that says so.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kv_cache.hpp"
#include "oscar/core/status.hpp"
#include "oscar/host/paged_cache.hpp"

namespace oscar::decode {

// One request of up to `capacity` tokens in pools sized by `config` (paged_cache_config), with
// the per-layer rotations and clip ratios of `layers` (empty rotations: none). Fails with a
// clear status where no GPU is visible or the kernels do not support the shape (head_dim 64,
// 128 or 256; one quantization group per row for attention).
Result<std::unique_ptr<KvCache>> make_gpu_cache(const host::CacheConfig& config, int64_t capacity,
                                                std::vector<host::LayerQuantizer> layers);

}  // namespace oscar::decode
