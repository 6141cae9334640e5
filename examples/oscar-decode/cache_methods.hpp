// The KV cache methods of oscar-decode, by name, and the cache each one builds. Every quantized
// method is the library's PagedCache with a different LayerQuantizer per layer; none has its
// own quantization code.
//   exact          float32 K/V (ExactKvCache): no rounding at all, for tests and debugging
//   bf16           PagedCache whose sink covers the whole context: everything stays BF16
//   int2-naive     identity rotations, no clipping
//   int2-hadamard  normalized Sylvester Hadamard rotations for K and V (QuaRot-style), no clip
//   oscar          fitted per-layer rotations and clip ratios from a plan file (--plan)
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "llama.hpp"
#include "oscar/core/status.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/rotate/hadamard.hpp"

namespace oscar::decode {

enum class CacheMethod { kExact, kBf16, kInt2Naive, kInt2Hadamard, kOscar };

inline const char* kCacheMethodList = "exact, bf16, int2-naive, int2-hadamard, oscar";

inline Result<CacheMethod> parse_cache_method(const std::string& name) {
  if (name == "exact") return CacheMethod::kExact;
  if (name == "bf16") return CacheMethod::kBf16;
  if (name == "int2-naive") return CacheMethod::kInt2Naive;
  if (name == "int2-hadamard") return CacheMethod::kInt2Hadamard;
  if (name == "oscar") return CacheMethod::kOscar;
  return invalid_argument("unknown cache method '" + name + "' (choose one of: " + kCacheMethodList + ")");
}

struct CacheOptions {
  int64_t capacity = 2048;  // tokens
  int32_t sink_tokens = 0;
  int32_t recent_tokens = 0;
  int32_t page_size = 16;
};

inline std::vector<host::LayerQuantizer> identity_quantizers(int32_t num_layers) {
  return std::vector<host::LayerQuantizer>(static_cast<size_t>(num_layers));
}

inline std::vector<host::LayerQuantizer> hadamard_quantizers(int32_t num_layers, int32_t head_dim) {
  std::vector<float> h(static_cast<size_t>(head_dim) * head_dim);
  for (int32_t i = 0; i < head_dim; ++i) {
    for (int32_t j = 0; j < head_dim; ++j) h[static_cast<size_t>(i) * head_dim + j] = hadamard_entry(i, j, head_dim);
  }
  std::vector<host::LayerQuantizer> layers(static_cast<size_t>(num_layers));
  for (auto& q : layers) {
    q.k_rotation = h;
    q.v_rotation = h;
  }
  return layers;
}

// The hook for fitted quantizers (OSCAR): one LayerQuantizer per layer, e.g. read from a plan
// file by oscar::io once plan files exist on this branch.
inline Result<std::unique_ptr<KvCache>> make_quantized_cache(const LlamaConfig& model, const CacheOptions& options,
                                                             std::vector<host::LayerQuantizer> layers) {
  auto cache = PagedKvCache::create(model, options.capacity, options.sink_tokens, options.recent_tokens,
                                    options.page_size, std::move(layers));
  if (!cache.ok()) return cache.status();
  return std::unique_ptr<KvCache>(std::move(*cache));
}

// Builds the cache of a method that needs no fitted data (every method but oscar).
inline Result<std::unique_ptr<KvCache>> make_cache(CacheMethod method, const LlamaConfig& model,
                                                   const CacheOptions& options) {
  switch (method) {
    case CacheMethod::kExact:
      return std::unique_ptr<KvCache>(new ExactKvCache(model, options.capacity));
    case CacheMethod::kBf16: {
      CacheOptions bf16 = options;
      // A sink longer than the context keeps every token BF16 (no INT2 page is ever written).
      bf16.sink_tokens = static_cast<int32_t>(options.capacity);
      bf16.recent_tokens = 0;
      return make_quantized_cache(model, bf16, identity_quantizers(model.num_layers));
    }
    case CacheMethod::kInt2Naive:
      return make_quantized_cache(model, options, identity_quantizers(model.num_layers));
    case CacheMethod::kInt2Hadamard:
      return make_quantized_cache(model, options, hadamard_quantizers(model.num_layers, model.head_dim));
    case CacheMethod::kOscar:
      return failed_precondition(
          "--cache oscar needs --plan FILE with fitted rotations (plan files arrive with oscar-fit; "
          "they are not readable by this build yet)");
  }
  return invalid_argument("unknown cache method");
}

}  // namespace oscar::decode
