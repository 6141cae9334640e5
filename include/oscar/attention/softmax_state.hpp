// Online softmax over blocks of scores, and the exact merge of partial attention states.
//
// A running state is (m, l): the largest score seen and Σ exp(score - m). The caller keeps the
// unnormalized output accumulator o = Σ exp(score - m) · v and rescales it by the factor that
// update() returns. A finished partial state is (o / l, lse = m + log l); partial states of
// disjoint key sets merge exactly, in any order, which is what split-KV decode needs.
// Logarithms are natural; a kernel working in base 2 converts at its boundary.
#pragma once

#include <cmath>

#include "oscar/core/config.hpp"

namespace oscar {

struct SoftmaxRunning {
  float max = -INFINITY;
  float sum = 0.0f;
};

// Replaces scores[i] by exp(scores[i] - new max) and returns the factor exp(old max - new max)
// for the caller's accumulator. Masked keys carry -Inf and contribute 0. A NaN score makes
// the sum NaN: the fault shows in this row's output and nowhere else.
OSCAR_HOST_DEVICE float online_softmax_update(SoftmaxRunning& state, float* scores, int n) {
  float block_max = state.max;
  for (int i = 0; i < n; ++i) block_max = scores[i] > block_max ? scores[i] : block_max;
  if (block_max == -INFINITY) {  // nothing but masked keys so far
    for (int i = 0; i < n; ++i) {
      scores[i] = scores[i] == -INFINITY ? 0.0f : expf(scores[i] - block_max);  // NaN stays NaN
      state.sum += scores[i];
    }
    return 1.0f;
  }
  const float factor = expf(state.max - block_max);  // exp(-Inf) = 0 on the first block
  float block_sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    scores[i] = expf(scores[i] - block_max);
    block_sum += scores[i];
  }
  state.sum = state.sum * factor + block_sum;
  state.max = block_max;
  return factor;
}

// Log-sum-exp of the scores seen; -Inf for an empty state.
OSCAR_HOST_DEVICE float softmax_lse(const SoftmaxRunning& state) {
  return state.sum == 0.0f ? -INFINITY : state.max + logf(state.sum);
}

// o <- o / l (0 for an empty state, so an empty split contributes nothing when merged).
OSCAR_HOST_DEVICE void softmax_normalize(const SoftmaxRunning& state, float* o, int head_dim) {
  const float inv = state.sum == 0.0f ? 0.0f : 1.0f / state.sum;
  for (int i = 0; i < head_dim; ++i) o[i] *= inv;
}

// Merges the normalized partial state (o_other, lse_other) into (o, lse), exactly:
// lse' = log(e^lse + e^lse_other), o' = o·e^(lse-lse') + o_other·e^(lse_other-lse').
OSCAR_HOST_DEVICE void merge_attention_states(float* o, float& lse, const float* o_other,
                                              float lse_other, int head_dim) {
  if (lse_other == -INFINITY) return;
  if (lse == -INFINITY) {
    for (int i = 0; i < head_dim; ++i) o[i] = o_other[i];
    lse = lse_other;
    return;
  }
  const float m = lse > lse_other ? lse : lse_other;  // NaN on either side propagates below
  const float w = expf(lse - m);
  const float w_other = expf(lse_other - m);
  const float total = w + w_other;
  const float a = w / total;
  const float b = w_other / total;
  for (int i = 0; i < head_dim; ++i) o[i] = o[i] * a + o_other[i] * b;
  lse = m + logf(total);
}

}  // namespace oscar
