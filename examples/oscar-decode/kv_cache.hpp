// The KV cache interface the Llama forward attends through (llama.hpp), and what the library's
// paged caches behind it share: sizing the pools for a context, bf16 rounding of the rows
// handed to write(), and the bytes a token costs. No Eigen and no CUDA here, so the CPU
// caches (llama.hpp) and the GPU one (gpu_cache.cu, compiled by nvcc) both include it.
//
// One step at a time:
//   begin_step(n)  reserve n new tokens (all layers)
//   per layer: write(layer, k, v) then attend(layer, q, out)
//   end_step()
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/quant/format.hpp"

namespace oscar::decode {

class KvCache {
 public:
  virtual ~KvCache() = default;
  virtual Status begin_step(int32_t num_tokens) = 0;
  // k, v: float32 [num_tokens, num_kv_heads, head_dim], K after RoPE.
  virtual Status write(int32_t layer, const float* k, const float* v) = 0;
  // q: float32 [num_tokens, num_qo_heads, head_dim] after RoPE; out the same shape. Query i of
  // the step sits at position length() - num_tokens + i and sees keys up to it (causal).
  virtual Status attend(int32_t layer, const float* q, float* out) = 0;
  virtual Status end_step() = 0;
  virtual int64_t length() const = 0;  // tokens stored, this step's included once begun
  // Average bytes of K and V per token over all layers and heads at the current length.
  virtual double bytes_per_token() const = 0;
};

// The geometry of a paged cache for `capacity` tokens of up to `max_requests` requests.
// `config` carries the model's shape (layers, heads, head_dim); the page counts are set here.
inline Result<host::CacheConfig> paged_cache_config(host::CacheConfig config, int64_t capacity, int32_t sink_tokens,
                                                    int32_t recent_tokens, int32_t page_size,
                                                    int32_t max_requests = 1) {
  if (page_size <= 0) return invalid_argument("--page-size must be positive");
  config.page_size = page_size;
  config.sink_tokens = sink_tokens;
  config.recent_tokens = recent_tokens;
  config.max_requests = max_requests;
  const int64_t pages = (capacity + page_size - 1) / page_size;
  // BF16: the sink pages, the window's pages (recent + page_size - 1 tokens: at most
  // recent/page_size + 2 pages), and as many again for window pages that a long step
  // demotes, which stay allocated until finish(); INT2: every page of the context at most.
  const int64_t sink_pages = (std::min<int64_t>(sink_tokens, capacity) + page_size - 1) / page_size;
  const int64_t window_pages = std::min<int64_t>(pages, (recent_tokens + page_size - 1) / page_size + 2);
  config.num_bf16_pages = static_cast<int32_t>((sink_pages + 2 * window_pages + 2) * max_requests);
  config.num_int2_pages = static_cast<int32_t>((pages + 1) * max_requests);
  return config;
}

// What one token of a request of `length` tokens costs in a paged cache, K and V, every layer
// and KV head (the BF16 sink and window amortized over the length).
inline double paged_bytes_per_token(const host::CacheConfig& c, int64_t length) {
  const SegmentCounts counts = segment_counts(length, c.sink_tokens, c.recent_tokens, c.page_size);
  return storage_cost(c.int2_layout(), counts).bytes_per_token * c.num_kv_heads * c.num_layers;
}

// K/V rows rounded to bf16 as write() hands them on, like an engine holding bf16 activations.
inline void rows_to_bf16(const float* in, size_t count, std::vector<bf16_t>& out) {
  out.resize(count);
  for (size_t i = 0; i < count; ++i) out[i] = float_to_bf16(in[i]);
}

}  // namespace oscar::decode
