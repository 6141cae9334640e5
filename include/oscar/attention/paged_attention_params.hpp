// What the GPU paged-attention kernel reads and writes for one layer of a batch (decode or
// extend). Every pointer is device memory; the page tables inside `kv` too.
#pragma once

#include <cstdint>

#include "oscar/core/numeric.hpp"
#include "oscar/kv/paged_kv.hpp"

namespace oscar {

struct PagedAttentionParams {
  PagedKvRef kv;  // pools and the three page tables (device pointers)
  int32_t num_qo_heads = 0;
  // [num_query_tokens, num_qo_heads, head_dim] bf16, after RoPE. Request b's query tokens are
  // rows qo_indptr[b] .. qo_indptr[b+1] (decode: row b); they are its newest cached tokens.
  const bf16_t* q = nullptr;
  // [batch_size + 1] (device), for extend plans; null for decode plans.
  const int32_t* qo_indptr = nullptr;
  // R_K, float32 [head_dim, head_dim] row-major: the kernels rotate q (q·R_K). Null: q is
  // already in the keys' basis (the engine rotated it, or the cache is unrotated).
  const float* q_rotation = nullptr;
  // R_V, float32 [head_dim, head_dim] row-major: the kernel un-rotates the output (o·R_Vᵀ).
  // Null: the output stays in the rotated basis (the engine folded R_Vᵀ into W_O).
  const float* output_unrotation = nullptr;
  float sm_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  bf16_t* out = nullptr;  // [num_query_tokens, num_qo_heads, head_dim] bf16
  float* lse = nullptr;   // [num_query_tokens, num_qo_heads] float32, natural log; may be null
};

}  // namespace oscar
