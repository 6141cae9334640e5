// The CPU reference of decode and extend attention over the paged OSCAR cache: the oracle for
// the GPU kernels (it reads exactly the views they read) and a usable CPU path.
//
// For every query row: rotate q by R_K, split each segment into chunks of `split_tokens`
// keys, compute a partial (o, lse) per chunk with the online softmax, reading INT2 keys with
// the fused dequant-dot and INT2 values with the dequant-axpy, merge the partials exactly,
// and un-rotate the output by R_Vᵀ.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "oscar/attention/softmax_state.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"
#include "oscar/kv/paged_kv.hpp"
#include "oscar/quant/dequant_dot.hpp"
#include "oscar/quant/row.hpp"
#include "oscar/rotate/dense.hpp"

namespace oscar::host {

struct AttentionParams {
  PagedKvRef kv;
  int32_t num_qo_heads = 0;  // a multiple of kv.k_int2.num_kv_heads (GQA)
  // [num_query_tokens, num_qo_heads, head_dim] float32. Request b's query tokens are rows
  // qo_indptr[b] .. qo_indptr[b+1]; they are its last tokens, so token i of n sits at
  // position num_tokens(b) - n + i and sees keys at positions <= its own (causal).
  const float* q = nullptr;
  // [batch_size + 1]; null means decode: one query token per request.
  const int32_t* qo_indptr = nullptr;
  // R_K, float32 [head_dim, head_dim] row-major. Null: q is already in the keys' basis (the
  // engine rotated it, or the cache is unrotated).
  const float* q_rotation = nullptr;
  // R_V, float32 [head_dim, head_dim] row-major. Null: leave the output in the rotated basis
  // (the engine folded R_Vᵀ into W_O).
  const float* output_unrotation = nullptr;
  float sm_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  int32_t split_tokens = 512;  // keys per partial state (split-KV); > 0
  float* out = nullptr;  // [num_query_tokens, num_qo_heads, head_dim] float32
  float* lse = nullptr;  // [num_query_tokens, num_qo_heads] float32, natural log; may be null
};

namespace detail {

// One query row over keys [begin, end) of one segment, as a normalized partial state.
struct SegmentReader {
  const PagedKvRef& kv;
  int32_t request;
  int32_t head;
  int head_dim;
  int quant_group_size;

  float key_dot(int which, int64_t token, const float* q, const float* q_sums) const {
    const PageTableRef& table = which == 0 ? kv.sink : (which == 1 ? kv.int2 : kv.recent);
    const int32_t page = table.page_of(request, token);
    const int32_t slot = static_cast<int32_t>(token % table.page_size);
    if (which == 1) {
      const uint8_t* block = kv.k_int2.block(page, head);
      return dequant_dot(q, q_sums, kv.k_int2.layout.codes(block, slot),
                         kv.k_int2.layout.meta(block, slot), head_dim, quant_group_size);
    }
    const bf16_t* row = kv.k_bf16.row(page, head, slot);
    float sum = 0.0f;
    for (int i = 0; i < head_dim; ++i) sum += q[i] * bf16_to_float(row[i]);
    return sum;
  }

  void value_axpy(int which, int64_t token, float p, float* acc) const {
    const PageTableRef& table = which == 0 ? kv.sink : (which == 1 ? kv.int2 : kv.recent);
    const int32_t page = table.page_of(request, token);
    const int32_t slot = static_cast<int32_t>(token % table.page_size);
    if (which == 1) {
      const uint8_t* block = kv.v_int2.block(page, head);
      dequant_axpy(p, kv.v_int2.layout.codes(block, slot), kv.v_int2.layout.meta(block, slot),
                   head_dim, quant_group_size, acc);
      return;
    }
    const bf16_t* row = kv.v_bf16.row(page, head, slot);
    for (int i = 0; i < head_dim; ++i) acc[i] += p * bf16_to_float(row[i]);
  }
};

}  // namespace detail

// The argument checks of every CPU attention path (attention_reference, attention_blocked):
// one function, so that both reject the same inputs with the same messages.
inline Status validate(const AttentionParams& params) {
  OSCAR_RETURN_IF_ERROR(validate(params.kv));
  const PagedKvRef& kv = params.kv;
  const int32_t num_kv_heads = kv.k_int2.num_kv_heads;
  if (params.num_qo_heads <= 0 || params.num_qo_heads % num_kv_heads != 0) {
    return invalid_argument("num_qo_heads " + std::to_string(params.num_qo_heads) +
                            " is not a positive multiple of num_kv_heads " +
                            std::to_string(num_kv_heads));
  }
  if (params.split_tokens <= 0) return invalid_argument("split_tokens must be positive");
  const int32_t batch = kv.batch_size();
  if (batch > 0 && (!params.q || !params.out)) {
    return invalid_argument("q and out must not be null");
  }
  if (params.qo_indptr) {
    if (params.qo_indptr[0] != 0) return invalid_argument("qo_indptr[0] must be 0");
    for (int32_t b = 0; b < batch; ++b) {
      const int32_t n = params.qo_indptr[b + 1] - params.qo_indptr[b];
      if (n < 0 || n > kv.num_tokens(b)) {
        return invalid_argument("request " + std::to_string(b) + " has " + std::to_string(n) +
                                " query tokens but " + std::to_string(kv.num_tokens(b)) +
                                " cached tokens (queries are the newest cached tokens)");
      }
    }
  }
  return Status::Ok();
}

inline Status attention_reference(const AttentionParams& params) {
  OSCAR_RETURN_IF_ERROR(validate(params));
  const PagedKvRef& kv = params.kv;
  const int32_t num_kv_heads = kv.k_int2.num_kv_heads;
  const int head_dim = kv.k_int2.layout.head_dim;
  const int quant_group_size = kv.k_int2.layout.quant_group_size;
  const int32_t batch = kv.batch_size();

  const int group_size = params.num_qo_heads / num_kv_heads;
  const float sm_scale =
      params.sm_scale > 0.0f ? params.sm_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  constexpr int kBlock = 32;  // keys per online-softmax update
  std::vector<float> q_rot(head_dim), q_sums(head_dim), acc(head_dim), total(head_dim),
      scores(kBlock);

  for (int32_t b = 0; b < batch; ++b) {
    const int64_t length = kv.num_tokens(b);
    const int32_t q_begin = params.qo_indptr ? params.qo_indptr[b] : b;
    const int32_t q_count = params.qo_indptr ? params.qo_indptr[b + 1] - q_begin : 1;
    const int64_t segment_start[3] = {0, kv.sink.num_tokens(b),
                                      kv.sink.num_tokens(b) + kv.int2.num_tokens(b)};
    const int64_t segment_tokens[3] = {kv.sink.num_tokens(b), kv.int2.num_tokens(b),
                                       kv.recent.num_tokens(b)};
    for (int32_t qi = 0; qi < q_count; ++qi) {
      const int64_t q_pos = length - q_count + qi;
      for (int32_t h = 0; h < params.num_qo_heads; ++h) {
        const int64_t row_index = int64_t{q_begin + qi} * params.num_qo_heads + h;
        const float* q_in = params.q + row_index * head_dim;
        if (params.q_rotation) {
          rotate_row(q_in, params.q_rotation, head_dim, q_rot.data());
        } else {
          for (int i = 0; i < head_dim; ++i) q_rot[i] = q_in[i];
        }
        query_group_sums(q_rot.data(), head_dim, quant_group_size, q_sums.data());
        const detail::SegmentReader reader{kv, b, h / group_size, head_dim, quant_group_size};

        std::fill(total.begin(), total.end(), 0.0f);
        float total_lse = -INFINITY;
        for (int which = 0; which < 3; ++which) {
          // Keys past the query's position are masked; whole chunks past it are skipped.
          const int64_t visible =
              std::min(segment_tokens[which], std::max<int64_t>(0, q_pos + 1 - segment_start[which]));
          for (int64_t chunk = 0; chunk < visible; chunk += params.split_tokens) {
            const int64_t chunk_end = std::min<int64_t>(visible, chunk + params.split_tokens);
            SoftmaxRunning state;
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t t0 = chunk; t0 < chunk_end; t0 += kBlock) {
              const int n = static_cast<int>(std::min<int64_t>(kBlock, chunk_end - t0));
              for (int j = 0; j < n; ++j) {
                scores[j] = reader.key_dot(which, t0 + j, q_rot.data(), q_sums.data()) * sm_scale;
              }
              const float factor = online_softmax_update(state, scores.data(), n);
              for (int i = 0; i < head_dim; ++i) acc[i] *= factor;
              for (int j = 0; j < n; ++j) reader.value_axpy(which, t0 + j, scores[j], acc.data());
            }
            softmax_normalize(state, acc.data(), head_dim);
            merge_attention_states(total.data(), total_lse, acc.data(), softmax_lse(state),
                                   head_dim);
          }
        }
        float* out = params.out + row_index * head_dim;
        if (params.output_unrotation) {
          unrotate_row(total.data(), params.output_unrotation, head_dim, out);
        } else {
          for (int i = 0; i < head_dim; ++i) out[i] = total[i];
        }
        if (params.lse) params.lse[row_index] = total_lse;
      }
    }
  }
  return Status::Ok();
}

}  // namespace oscar::host
