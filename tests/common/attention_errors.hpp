// How far a GPU attention output is from the CPU reference's, in the units the GPU tests bound:
// errors relative to max|v| of the request (the scale of o), lse relative to 1 + |lse|. The
// bounds and their derivation are in tests/gpu/test_attention_gpu.cu.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "host/cache_test_util.hpp"
#include "oscar/host/paged_cache.hpp"

namespace oscar::testing {

struct AttentionErrors {
  double worst = 0, mean = 0, worst_lse = 0;
  bool finite = true;
};

// out/lse: the kernel's, [rows, num_qo_heads, head_dim] / [rows, num_qo_heads]; ref/ref_lse
// the reference's; request b owns rows qo_indptr[b] .. qo_indptr[b+1].
inline AttentionErrors attention_errors(const host::PagedCache& cache, int layer, const std::vector<host::RequestId>& ids,
                                        const std::vector<int32_t>& qo_indptr, const std::vector<bf16_t>& out,
                                        const std::vector<float>& lse, const std::vector<float>& ref,
                                        const std::vector<float>& ref_lse) {
  const host::CacheConfig& c = cache.config();
  const int d = c.head_dim;
  AttentionErrors e;
  for (size_t b = 0; b < ids.size(); ++b) {
    const double scale = std::max(value_scale(read_cache(cache, layer, ids[b])), 1e-30);
    for (int32_t row = qo_indptr[b]; row < qo_indptr[b + 1]; ++row) {
      for (int h = 0; h < c.num_qo_heads; ++h) {
        const size_t o = (size_t(row) * c.num_qo_heads + h) * d;
        for (int i = 0; i < d; ++i) {
          const double got = bf16_to_float(out[o + i]);
          if (!std::isfinite(got)) e.finite = false;
          const double err = std::abs(got - ref[o + i]) / scale;
          e.worst = std::max(e.worst, err);
          e.mean += err;
        }
        const size_t lr = size_t(row) * c.num_qo_heads + h;
        e.worst_lse = std::max(e.worst_lse, std::abs(double(lse[lr]) - ref_lse[lr]) / (1 + std::abs(ref_lse[lr])));
      }
    }
  }
  e.mean /= double(qo_indptr.back()) * c.num_qo_heads * d;
  return e;
}

inline void check_attention_errors(const AttentionErrors& e) {
  CHECK(e.finite);
  CHECK(e.worst <= 0.02);
  CHECK(e.mean <= 0.003);
  CHECK(e.worst_lse <= 2e-3);
}

}  // namespace oscar::testing
