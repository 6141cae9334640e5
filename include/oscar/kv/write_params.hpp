// Arguments of the GPU write kernels (append, demote) and their host-side validation. Host
// code: the CPU reference builds the same slot lists (host::WritePlan), and the launchers in
// write.cuh check these before anything is launched.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

#include "oscar/core/config.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"
#include "oscar/kv/pools.hpp"
#include "oscar/quant/format.hpp"

namespace oscar {

// Where one new token goes: a BF16 slot (sink or window) or, past the window, an INT2 slot.
struct TokenSlot {
  int32_t page = 0;
  int32_t slot = 0;
  int32_t int2 = 0;  // 0: BF16 pools, 1: INT2 pools
};

// A window page that leaves BF16: rows [0, rows) are quantized from the BF16 page into the
// same rows of the INT2 page.
struct PageDemotion {
  int32_t bf16_page = 0;
  int32_t int2_page = 0;
  int32_t rows = 0;
};

// The per-layer pools and quantizers, for one layer or (num_layers > 1) a layer-strided set:
// layer l's pools start at the layer-0 view's data plus l * stride_layer.
struct LayeredKvPools {
  Bf16PoolRef k_bf16, v_bf16;    // layer 0
  Int2PoolRef k_int2, v_int2;    // layer 0
  int64_t bf16_stride_layer = 0;  // elements
  int64_t int2_stride_layer = 0;  // bytes
  int32_t num_layers = 1;
  // R_K, R_V: float32 [num_layers][head_dim][head_dim] row-major (device memory, 16-byte
  // aligned), or null for the identity. v_rotation is ignored when values arrive pre-rotated.
  const float* k_rotation = nullptr;
  const float* v_rotation = nullptr;
  // Clip ranks from clip_rank(), int32 [num_layers] (device memory); -1 disables.
  const int32_t* k_clip_rank = nullptr;
  const int32_t* v_clip_rank = nullptr;
  // The largest clip_distance() of the ranks above (every layer, K and V), as the host knows
  // them from the plan, or -1: not given. A hint that never changes the bytes: it picks which
  // compiled form of the row quantizer the write kernels run. Given and <= 16 (clip ratios
  // >= 0.875 at d = 128) runs a form without the sorted top-32 selection, whose registers cost
  // the thread-per-row demotion ~2-3 %; otherwise the form with it, which serves distances
  // 17-32 (fitted V ratios ~0.87 at d = 128) ~20 % faster than the bitwise search. A wrong
  // value is only slower.
  int32_t max_clip_distance = -1;

  // Layer `layer` alone, as a one-layer view: its pools, and its rotations and clip ranks where
  // the set has them (a null rotation stays null: no rotation). What a per-layer launch, or
  // attention over one layer (PagedKvRef's pools, q_rotation, output_unrotation), reads. The
  // caller keeps 0 <= layer < num_layers.
  LayeredKvPools layer_view(int32_t layer) const {
    LayeredKvPools p = *this;
    p.k_bf16.data += layer * bf16_stride_layer;
    p.v_bf16.data += layer * bf16_stride_layer;
    p.k_int2.data += layer * int2_stride_layer;
    p.v_int2.data += layer * int2_stride_layer;
    const int64_t rotation = int64_t{k_int2.layout.head_dim} * k_int2.layout.head_dim;
    if (p.k_rotation) p.k_rotation += layer * rotation;
    if (p.v_rotation) p.v_rotation += layer * rotation;
    if (p.k_clip_rank) p.k_clip_rank += layer;
    if (p.v_clip_rank) p.v_clip_rank += layer;
    p.num_layers = 1;
    return p;
  }
};

// How far the clip threshold sits from a row's largest magnitude: the rank from the top,
// head_dim - clip_k, which sizes the selection that finds it; 0 when clipping is off.
inline int32_t clip_distance(int clip_k, int head_dim) { return clip_k < 0 ? 0 : head_dim - clip_k; }

// LayeredKvPools::max_clip_distance from host copies of the per-layer K and V clip ranks.
inline int32_t widest_clip_distance(std::span<const int32_t> k_clip_ranks, std::span<const int32_t> v_clip_ranks,
                                    int head_dim) {
  int32_t widest = 0;
  for (const int32_t rank : k_clip_ranks) widest = std::max(widest, clip_distance(rank, head_dim));
  for (const int32_t rank : v_clip_ranks) widest = std::max(widest, clip_distance(rank, head_dim));
  return widest;
}

// How append rotates the new rows. kExactFma: FMA in input-channel order on CUDA cores, the
// CPU reference's bytes exactly. kTensorCores: bf16 hi/lo split of R on tensor cores (head_dim
// <= 128, 16-byte aligned inputs), ~2.5x faster for bulk writes, each element within
// 2^-15·Σ_i |x_i R_ij| of the exact rotation and ~0.2% of them one or more bf16 steps from
// the FMA path's; the quantization of the rotated rows is exact (kv/tile_rotation.cuh).
// kAuto: tensor cores for bulk appends
// (kTensorCoreMinRows rows or more, where they can run), the exact path otherwise.
enum class AppendRotation : int32_t { kAuto = 0, kExactFma = 1, kTensorCores = 2 };
inline constexpr int64_t kTensorCoreMinRows = 4096;

struct AppendParams {
  LayeredKvPools pools;
  // New rows, bf16, post-RoPE, element (layer, token, head, dim) at
  // k[layer * in_stride_layer + token * in_stride_token + head * head_dim + dim].
  const bf16_t* k = nullptr;
  const bf16_t* v = nullptr;
  int64_t in_stride_layer = 0;  // elements
  int64_t in_stride_token = 0;  // elements; >= num_kv_heads * head_dim
  int32_t num_tokens = 0;
  const TokenSlot* slots = nullptr;  // [num_tokens], device memory
  bool values_prerotated = false;
  AppendRotation rotation = AppendRotation::kAuto;
  // Required, device memory: set to a non-zero code when a slot is out of range; the launch
  // then writes nothing at all. Left untouched on success. Zero it before the launch, and
  // again after handling an error: a launch of more than kInBlockCheckLimit entries checks
  // them in a pre-pass and writes only while the flag is zero, so a flag left set by an
  // earlier launch (even one of demote_kv sharing it) stops it writing; smaller launches
  // check their own entries only.
  int32_t* error_flag = nullptr;
};

struct DemoteParams {
  LayeredKvPools pools;
  int32_t num_demotions = 0;
  const PageDemotion* demotions = nullptr;  // [num_demotions], device memory, all layers
  int32_t* error_flag = nullptr;            // as in AppendParams
};

// Error codes the kernels leave in error_flag.
inline constexpr int32_t kWriteErrorSlotOutOfRange = 1;

inline Status validate(const LayeredKvPools& pools) {
  OSCAR_RETURN_IF_ERROR(validate_pool_set(pools.k_bf16, pools.v_bf16, pools.k_int2, pools.v_int2));
  if (pools.num_layers < 1) return invalid_argument("num_layers must be >= 1");
  if (pools.num_layers > 1) {
    // Each layer's K and V pools, at the same layer stride, must both end before the next
    // layer's begin: V's strides may differ from K's (the pools only carry strides).
    const int64_t bf16_span = std::max(pools.k_bf16.stride_page * pools.k_bf16.num_pages,
                                       pools.v_bf16.stride_page * pools.v_bf16.num_pages);
    const int64_t int2_span = std::max(pools.k_int2.stride_page * pools.k_int2.num_pages,
                                       pools.v_int2.stride_page * pools.v_int2.num_pages);
    if (pools.bf16_stride_layer < bf16_span || pools.int2_stride_layer < int2_span) {
      return invalid_argument("layer strides smaller than one layer's pool: layers overlap");
    }
    if (pools.int2_stride_layer % 16 != 0) return invalid_argument("int2_stride_layer must be a multiple of 16 bytes");
  }
  if (reinterpret_cast<uintptr_t>(pools.k_rotation) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(pools.v_rotation) % 16 != 0) {
    return invalid_argument(
        "k_rotation and v_rotation must be 16-byte aligned (the kernels read R in 16-byte pieces)");
  }
  if (!pools.k_clip_rank || !pools.v_clip_rank) {
    return invalid_argument("k_clip_rank and v_clip_rank must not be null (use -1 per layer to disable)");
  }
  return Status::Ok();
}

inline Status validate(const AppendParams& p) {
  OSCAR_RETURN_IF_ERROR(validate(p.pools));
  if (p.num_tokens < 0) return invalid_argument("num_tokens must be >= 0");
  if (p.num_tokens == 0) return Status::Ok();
  if (!p.k || !p.v || !p.slots) return invalid_argument("k, v and slots must not be null");
  const int64_t row = int64_t{p.pools.k_int2.num_kv_heads} * p.pools.k_int2.layout.head_dim;
  if (p.in_stride_token < row) {
    return invalid_argument("in_stride_token " + std::to_string(p.in_stride_token) +
                            " is smaller than num_kv_heads * head_dim = " + std::to_string(row));
  }
  if (p.pools.num_layers > 1 && p.in_stride_layer < p.in_stride_token * p.num_tokens) {
    return invalid_argument("in_stride_layer smaller than one layer's rows: layers overlap");
  }
  if (p.rotation != AppendRotation::kAuto && p.rotation != AppendRotation::kExactFma &&
      p.rotation != AppendRotation::kTensorCores) {
    return invalid_argument("rotation must be kAuto, kExactFma or kTensorCores");
  }
  return Status::Ok();
}

inline Status validate(const DemoteParams& p) {
  OSCAR_RETURN_IF_ERROR(validate(p.pools));
  if (p.num_demotions < 0) return invalid_argument("num_demotions must be >= 0");
  if (p.num_demotions > 0 && !p.demotions) return invalid_argument("demotions must not be null");
  return Status::Ok();
}

}  // namespace oscar
