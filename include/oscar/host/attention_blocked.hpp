// The fast CPU path of decode and extend attention over the paged OSCAR cache: the same
// contract (AttentionParams) and the same semantics as attention_reference, organised so the
// arithmetic is matrix products.
//
// attention_reference walks keys per query row and per query head, so every INT2 key and
// value row is dequantized again for each of them: with 9 query heads over 3 KV heads and 16
// query tokens per extend step, 48 times. Here, for each (request, KV head):
//   - the query rows that read that head (every query token × every query head of its GQA
//     group) are rotated by R_K and gathered into one matrix Q [rows, d];
//   - the keys are walked in blocks (at most block_tokens keys, never across a segment); each
//     block's K and V rows are turned into float32 ONCE, BF16 rows by widening and INT2 rows
//     by the library's row dequantizer (quant/row.hpp), into K, V [keys, d];
//   - S = Q·Kᵀ·scale and O += P·V are Eigen products, with causal masking and the online
//     softmax of attention/softmax_state.hpp per query row.
// Then each output row is normalized and un-rotated by R_Vᵀ, exactly as the reference does.
//
// Results agree with the reference up to float32 summation order: one online softmax over all
// keys instead of split_tokens partials merged, the dequantized row dotted with q instead of
// scale·Σq·c + offset·Σq, and Eigen's blocked summation inside the products
// (tests/host/test_attention_blocked.cpp bounds the difference).
//
// Host only: it needs Eigen (link oscar::fit, or Eigen3::Eigen). The reference stays the
// oracle of the GPU kernels; PagedCache runs this path when AttentionOptions::path is
// blocked_attention().
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "oscar/attention/softmax_state.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"
#include "oscar/host/attention_reference.hpp"
#include "oscar/kv/paged_kv.hpp"
#include "oscar/quant/row.hpp"
#include "oscar/rotate/dense.hpp"

namespace oscar::host {

struct BlockedAttentionOptions {
  // Keys dequantized and multiplied per step. Larger blocks mean bigger products and fewer
  // online-softmax rescales of the accumulator, smaller ones less scratch; 64 keeps the
  // float K and V blocks (2 · 64 · d floats) in L1/L2 for every head_dim up to 256.
  int32_t block_tokens = 64;
  // Threads over the (request, KV head) pairs, which touch disjoint output rows. 1: run on
  // the caller's thread (no thread is started).
  int32_t num_threads = 1;
};

namespace detail {

using RowMatrixF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Scratch of one worker, reused over its (request, KV head) items.
struct BlockedScratch {
  RowMatrixF q, acc, keys, values, scores;
  std::vector<SoftmaxRunning> state;
  std::vector<float> row;
};

// One (request, KV head): every query row that reads this head, over all the request's keys.
inline void attend_request_head(const AttentionParams& params, int32_t b, int32_t kv_head,
                                int block_tokens, float sm_scale, BlockedScratch& s) {
  const PagedKvRef& kv = params.kv;
  const int d = kv.k_int2.layout.head_dim;
  const int quant_group_size = kv.k_int2.layout.quant_group_size;
  const int group = params.num_qo_heads / kv.k_int2.num_kv_heads;
  const int64_t length = kv.num_tokens(b);
  const int32_t q_begin = params.qo_indptr ? params.qo_indptr[b] : b;
  const int32_t q_count = params.qo_indptr ? params.qo_indptr[b + 1] - q_begin : 1;
  if (q_count == 0) return;
  const int rows = q_count * group;
  // Query row r is token r / group (position length - q_count + r / group), head
  // kv_head * group + r % group: rows of one token are adjacent, so the rows that see a key
  // at position t are a suffix (those of tokens at positions >= t).
  auto in_index = [&](int r) {
    return (int64_t{q_begin} + r / group) * params.num_qo_heads + int64_t{kv_head} * group + r % group;
  };
  const int64_t first_q_pos = length - q_count;

  s.q.resize(rows, d);
  s.acc.setZero(rows, d);
  s.state.assign(rows, SoftmaxRunning{});
  for (int r = 0; r < rows; ++r) {
    const float* q_in = params.q + in_index(r) * d;
    float* q_row = s.q.row(r).data();
    if (params.q_rotation) {
      rotate_row(q_in, params.q_rotation, d, q_row);
    } else {
      std::copy(q_in, q_in + d, q_row);
    }
  }
  s.q *= sm_scale;  // one multiply per query element instead of one per score

  const PageTableRef* tables[3] = {&kv.sink, &kv.int2, &kv.recent};
  int64_t segment_start = 0;
  for (int which = 0; which < 3; ++which) {
    const PageTableRef& table = *tables[which];
    const int64_t tokens = table.num_tokens(b);
    for (int64_t t0 = 0; t0 < tokens; t0 += block_tokens) {
      const int n = static_cast<int>(std::min<int64_t>(block_tokens, tokens - t0));
      const int64_t key_pos = segment_start + t0;  // position of the block's first key
      // Rows whose position is before the block's first key see none of it.
      const int64_t first_token = std::max<int64_t>(0, key_pos - first_q_pos);
      const int r0 = static_cast<int>(first_token) * group;
      const int nr = rows - r0;

      s.keys.resize(n, d);
      s.values.resize(n, d);
      for (int j = 0; j < n; ++j) {
        const int64_t token = t0 + j;
        const int32_t page = table.page_of(b, token);
        const int32_t slot = static_cast<int32_t>(token % table.page_size);
        if (which == 1) {
          const uint8_t* kb = kv.k_int2.block(page, kv_head);
          const uint8_t* vb = kv.v_int2.block(page, kv_head);
          dequantize_row(kv.k_int2.layout.codes(kb, slot), kv.k_int2.layout.meta(kb, slot), d,
                         quant_group_size, s.keys.row(j).data());
          dequantize_row(kv.v_int2.layout.codes(vb, slot), kv.v_int2.layout.meta(vb, slot), d,
                         quant_group_size, s.values.row(j).data());
        } else {
          const bf16_t* kr = kv.k_bf16.row(page, kv_head, slot);
          const bf16_t* vr = kv.v_bf16.row(page, kv_head, slot);
          float* kd = s.keys.row(j).data();
          float* vd = s.values.row(j).data();
          for (int i = 0; i < d; ++i) kd[i] = bf16_to_float(kr[i]);
          for (int i = 0; i < d; ++i) vd[i] = bf16_to_float(vr[i]);
        }
      }

      s.scores.resize(nr, n);
      s.scores.noalias() = s.q.bottomRows(nr) * s.keys.transpose();
      // Rows that see the whole block form a suffix too; the others (the block holds the
      // diagonal) see a prefix of it.
      const int64_t last_pos = key_pos + n - 1;
      const int full_from =
          static_cast<int>(std::min<int64_t>(q_count, std::max<int64_t>(0, last_pos - first_q_pos))) * group;
      for (int r = r0; r < rows; ++r) {
        float* sc = s.scores.row(r - r0).data();
        const int64_t q_pos = first_q_pos + r / group;
        const int seen = static_cast<int>(std::min<int64_t>(n, q_pos - key_pos + 1));
        for (int j = seen; j < n; ++j) sc[j] = -INFINITY;
        const float factor = online_softmax_update(s.state[r], sc, n);
        s.acc.row(r) *= factor;
        if (r < full_from) {
          // Masked keys have p = 0 but must not be multiplied at all: a non-finite value row
          // the query cannot see would turn 0·Inf into NaN (the reference never reads it).
          s.acc.row(r).noalias() += s.scores.row(r - r0).head(seen) * s.values.topRows(seen);
        }
      }
      const int full_rows = rows - std::max(full_from, r0);
      if (full_rows > 0) {
        s.acc.bottomRows(full_rows).noalias() += s.scores.bottomRows(full_rows) * s.values;
      }
    }
    segment_start += tokens;
  }

  s.row.resize(d);
  for (int r = 0; r < rows; ++r) {
    float* acc = s.acc.row(r).data();
    softmax_normalize(s.state[r], acc, d);
    const int64_t index = in_index(r);
    float* out = params.out + index * d;
    if (params.output_unrotation) {
      unrotate_row(acc, params.output_unrotation, d, out);
    } else {
      std::copy(acc, acc + d, out);
    }
    if (params.lse) params.lse[index] = softmax_lse(s.state[r]);
  }
}

}  // namespace detail

inline Status attention_blocked(const AttentionParams& params,
                                const BlockedAttentionOptions& options = {}) {
  OSCAR_RETURN_IF_ERROR(validate(params));
  if (options.block_tokens <= 0) return invalid_argument("block_tokens must be positive");
  if (options.num_threads <= 0) return invalid_argument("num_threads must be positive");
  const PagedKvRef& kv = params.kv;
  const int head_dim = kv.k_int2.layout.head_dim;
  const float sm_scale =
      params.sm_scale > 0.0f ? params.sm_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int32_t num_kv_heads = kv.k_int2.num_kv_heads;
  const int64_t items = int64_t{kv.batch_size()} * num_kv_heads;

  auto run = [&](int64_t first, int64_t step) {
    detail::BlockedScratch scratch;
    for (int64_t item = first; item < items; item += step) {
      detail::attend_request_head(params, static_cast<int32_t>(item / num_kv_heads),
                                  static_cast<int32_t>(item % num_kv_heads), options.block_tokens,
                                  sm_scale, scratch);
    }
  };
  const int64_t workers = std::min<int64_t>(options.num_threads, items);
  if (workers <= 1) {
    run(0, 1);
    return Status::Ok();
  }
  std::vector<std::thread> threads;
  for (int64_t w = 1; w < workers; ++w) threads.emplace_back(run, w, workers);
  run(0, workers);
  for (std::thread& t : threads) t.join();
  return Status::Ok();
}

// attention_blocked as a PagedCache attention path (AttentionOptions::path).
inline std::function<Status(const AttentionParams&)> blocked_attention(
    BlockedAttentionOptions options = {}) {
  return [options](const AttentionParams& params) { return attention_blocked(params, options); };
}

}  // namespace oscar::host
