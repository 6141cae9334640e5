// The KV cache methods of oscar-decode, by name, and the cache each one builds. Every INT2
// method but kivi is the library's PagedCache with a different LayerQuantizer per layer; none
// has its own quantization code. int4 and kivi need layouts the library does not have and are
// simulated (simulated_cache.hpp).
//   exact          float32 K/V (ExactKvCache): no rounding at all, for tests and debugging
//   bf16           PagedCache whose sink covers the whole context: everything stays BF16
//   int4           per-token INT4 outside the sink/window (simulated): the upper reference
//   int2-naive     identity rotations, no clipping
//   kivi           KIVI-style INT2: per-channel keys over 32-token groups, per-token values (simulated)
//   int2-hadamard  normalized Sylvester Hadamard rotations for K and V (QuaRot-style), no clip
//   oscar          the plan's fitted rotations with the authors' fixed clip ratios 0.96 / 0.92
//   oscar-fit      the plan's fitted rotations and its fitted per-layer clip ratios
// A paged method (bf16, int2-naive, int2-hadamard, oscar, oscar-fit) with the suffix @gpu keeps
// its pools on the GPU, written and read by the library's kernels (gpu_cache.hpp): the same
// method through the engine's path, e.g. --cache oscar,oscar@gpu to compare the two.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "llama.hpp"
#include "oscar/core/status.hpp"
#include "oscar/fit/clip_search.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/io/plan_file.hpp"
#include "oscar/rotate/hadamard.hpp"
#include "simulated_cache.hpp"
#if OSCAR_DECODE_GPU
#include "gpu_cache.hpp"
#endif

namespace oscar::decode {

enum class CacheMethod { kExact, kBf16, kInt4, kInt2Naive, kKivi, kInt2Hadamard, kOscar, kOscarFit };

inline const char* kCacheMethodList = "exact, bf16, int4, int2-naive, kivi, int2-hadamard, oscar, oscar-fit";

inline Result<CacheMethod> parse_cache_method(const std::string& name) {
  if (name == "exact") return CacheMethod::kExact;
  if (name == "bf16") return CacheMethod::kBf16;
  if (name == "int4") return CacheMethod::kInt4;
  if (name == "int2-naive") return CacheMethod::kInt2Naive;
  if (name == "kivi") return CacheMethod::kKivi;
  if (name == "int2-hadamard") return CacheMethod::kInt2Hadamard;
  if (name == "oscar") return CacheMethod::kOscar;
  if (name == "oscar-fit") return CacheMethod::kOscarFit;
  return invalid_argument("unknown cache method '" + name + "' (choose one of: " + kCacheMethodList + ")");
}

inline bool needs_plan(CacheMethod m) { return m == CacheMethod::kOscar || m == CacheMethod::kOscarFit; }

// Whether the method is the library's PagedCache (every method but exact and the simulated int4
// and kivi): what share and the @gpu caches need.
inline bool is_paged(CacheMethod m) {
  return m != CacheMethod::kExact && m != CacheMethod::kInt4 && m != CacheMethod::kKivi;
}
inline constexpr const char* kPagedMethodList = "bf16, int2-naive, int2-hadamard, oscar, oscar-fit";

// A --cache entry: a method, on the CPU or (suffix @gpu) on the GPU.
struct CacheSpec {
  CacheSpec(CacheMethod m, bool on_gpu = false) : method(m), gpu(on_gpu) {}  // implicit: a method is a CPU spec
  CacheMethod method;
  bool gpu;
};

inline constexpr const char* kGpuSuffix = "@gpu";

inline Result<CacheSpec> parse_cache_spec(const std::string& name) {
  const size_t suffix = std::char_traits<char>::length(kGpuSuffix);
  const bool gpu = name.size() > suffix && name.compare(name.size() - suffix, suffix, kGpuSuffix) == 0;
  auto method = parse_cache_method(gpu ? name.substr(0, name.size() - suffix) : name);
  if (!method.ok()) return method.status();
  if (gpu && !is_paged(*method)) {
    return invalid_argument("cache method '" + name + "': " + name.substr(0, name.size() - suffix) +
                            " is not a paged cache and has no GPU path (the @gpu methods: " + kPagedMethodList + ")");
  }
  return CacheSpec{*method, gpu};
}

struct CacheOptions {
  int64_t capacity = 2048;  // tokens
  int32_t sink_tokens = 0;
  int32_t recent_tokens = 0;
  int32_t page_size = 16;
  // The paged cache's attention: the blocked fast path with this many threads, or the scalar
  // reference (--attention reference; the same numbers up to float32 summation order).
  bool reference_attention = false;
  int32_t attention_threads = 1;
  int32_t attention_block = 64;  // keys per block of the blocked path
};

inline host::AttentionOptions attention_options(const CacheOptions& options) {
  if (options.reference_attention) return {};
  host::BlockedAttentionOptions blocked;
  blocked.num_threads = options.attention_threads;
  blocked.block_tokens = options.attention_block;
  return {.path = host::blocked_attention(blocked)};
}

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

// The per-layer quantizers of oscar (fixed ratios) or oscar-fit (the plan's ratios), after
// checking that the plan was fitted for this model.
inline Result<std::vector<host::LayerQuantizer>> plan_quantizers(CacheMethod method, const io::Plan& plan,
                                                                 const LlamaConfig& model) {
  OSCAR_RETURN_IF_ERROR(io::check_plan_matches(plan, cache_shape(model)));
  std::vector<host::LayerQuantizer> layers = io::to_layer_quantizers(plan);
  if (method == CacheMethod::kOscar) {
    for (auto& l : layers) {
      l.k_clip_ratio = fit::kAuthorsKeyClipRatio;
      l.v_clip_ratio = fit::kAuthorsValueClipRatio;
    }
  }
  return layers;
}

inline Result<std::unique_ptr<KvCache>> make_quantized_cache(const LlamaConfig& model, const CacheOptions& options,
                                                             std::vector<host::LayerQuantizer> layers,
                                                             bool gpu = false) {
  if (gpu) {
#if OSCAR_DECODE_GPU
    auto config = paged_cache_config(cache_shape(model), options.capacity, options.sink_tokens,
                                      options.recent_tokens, options.page_size);
    if (!config.ok()) return config.status();
    return make_gpu_cache(*config, options.capacity, std::move(layers));
#else
    return unsupported("this build has no CUDA (OSCAR_ENABLE_CUDA=OFF), so no @gpu cache");
#endif
  }
  auto cache = PagedKvCache::create(model, options.capacity, options.sink_tokens, options.recent_tokens,
                                    options.page_size, std::move(layers));
  if (!cache.ok()) return cache.status();
  (*cache)->set_attention(attention_options(options));
  return std::unique_ptr<KvCache>(std::move(*cache));
}

// The settings a paged method runs with: bf16 keeps every token BF16 (a sink as long as the
// context, no window, so no INT2 page is ever written); the others as given.
inline CacheOptions paged_options(CacheMethod method, CacheOptions options) {
  if (method == CacheMethod::kBf16) {
    options.sink_tokens = static_cast<int32_t>(options.capacity);
    options.recent_tokens = 0;
  }
  return options;
}

// The layers' quantizers of a paged method (is_paged): none for bf16 and int2-naive, the
// normalized Hadamard for int2-hadamard, the plan's for oscar and oscar-fit (which need it).
inline Result<std::vector<host::LayerQuantizer>> paged_quantizers(CacheMethod method, const LlamaConfig& model,
                                                                  const io::Plan* plan) {
  switch (method) {
    case CacheMethod::kBf16:
    case CacheMethod::kInt2Naive:
      return identity_quantizers(model.num_layers);
    case CacheMethod::kInt2Hadamard:
      return hadamard_quantizers(model.num_layers, model.head_dim);
    case CacheMethod::kOscar:
    case CacheMethod::kOscarFit:
      if (!plan) return failed_precondition("needs a plan file (--plan FILE, written by oscar-decode calibrate or oscar-fit)");
      return plan_quantizers(method, *plan, model);
    default:
      return invalid_argument("not a paged cache method (" + std::string(kPagedMethodList) + ")");
  }
}

// Builds the cache of `spec`. `plan` is needed by oscar and oscar-fit and ignored otherwise.
inline Result<std::unique_ptr<KvCache>> make_cache(CacheSpec spec, const LlamaConfig& model,
                                                   const CacheOptions& options, const io::Plan* plan = nullptr) {
  const CacheMethod method = spec.method;
  switch (method) {
    case CacheMethod::kExact:
      return std::unique_ptr<KvCache>(new ExactKvCache(model, options.capacity));
    case CacheMethod::kInt4:
    case CacheMethod::kKivi:
      if (options.page_size <= 0) return invalid_argument("--page-size must be positive");
      return std::unique_ptr<KvCache>(new SimulatedKvCache(
          model, options.capacity, options.sink_tokens, options.recent_tokens, options.page_size,
          method == CacheMethod::kInt4 ? SimulatedFormat::kInt4 : SimulatedFormat::kKivi));
    default: {
      auto layers = paged_quantizers(method, model, plan);
      if (!layers.ok()) return layers.status();
      return make_quantized_cache(model, paged_options(method, options), std::move(*layers), spec.gpu);
    }
  }
}

}  // namespace oscar::decode
