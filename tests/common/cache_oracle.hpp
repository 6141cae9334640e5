// Float64 attention over what a PagedCache holds: reads every stored token back through the
// page tables with the independent unpack of naive.hpp, then applies plain softmax attention.
// This is the oracle the CPU reference decode/extend is checked against (and, through the
// reference, the GPU kernels).
#pragma once

#include <cmath>
#include <vector>

#include "common/naive.hpp"
#include "oscar/host/paged_cache.hpp"

namespace oscar::testing {

struct DenseHead {
  std::vector<std::vector<double>> keys, values;  // [tokens][head_dim], rotated basis
};

inline std::vector<DenseHead> read_cache(const host::PagedCache& cache, int layer, host::RequestId id) {
  const auto& config = cache.config();
  const int d = config.head_dim;
  auto tables = cache.page_tables(std::span<const host::RequestId>(&id, 1));
  REQUIRE(tables.ok());
  const PagedKvRef kv = cache.view(layer, *tables);
  std::vector<DenseHead> heads(config.num_kv_heads);
  const int group = kv.k_int2.layout.quant_group_size;
  auto int2_row = [&](const Int2PoolRef& pool, int32_t page, int h, int slot) {
    const uint8_t* block = pool.block(page, h);
    const uint8_t* codes = pool.layout.codes(block, slot);
    const QuantMeta* meta = pool.layout.meta(block, slot);
    std::vector<double> row(d);
    for (int i = 0; i < d; ++i) {
      row[i] = double{fp16_to_float(meta[i / group].offset)} +
               naive_unpack(codes, i, group) * double{fp16_to_float(meta[i / group].scale)};
    }
    return row;
  };
  auto bf16_row = [&](const Bf16PoolRef& pool, int32_t page, int h, int slot) {
    const bf16_t* r = pool.row(page, h, slot);
    std::vector<double> row(d);
    for (int i = 0; i < d; ++i) row[i] = bf16_to_float(r[i]);
    return row;
  };
  for (int h = 0; h < config.num_kv_heads; ++h) {
    for (int which = 0; which < 3; ++which) {
      const PageTableRef& t = which == 0 ? kv.sink : (which == 1 ? kv.int2 : kv.recent);
      for (int64_t token = 0; token < t.num_tokens(0); ++token) {
        const int32_t page = t.page_of(0, token);
        const int slot = static_cast<int>(token % t.page_size);
        if (which == 1) {
          heads[h].keys.push_back(int2_row(kv.k_int2, page, h, slot));
          heads[h].values.push_back(int2_row(kv.v_int2, page, h, slot));
        } else {
          heads[h].keys.push_back(bf16_row(kv.k_bf16, page, h, slot));
          heads[h].values.push_back(bf16_row(kv.v_bf16, page, h, slot));
        }
      }
    }
  }
  return heads;
}

// Attention of one query row (model basis) at position q_pos over the cached tokens, output
// in the model basis: q is rotated by R_K and the result un-rotated by R_V in float64.
inline NaiveAttention oracle_attention(const host::PagedCache& cache, int layer,
                                       const std::vector<DenseHead>& heads, int qo_head,
                                       const float* q, int64_t q_pos) {
  const auto& config = cache.config();
  const int d = config.head_dim;
  const auto& quantizer = cache.layer_quantizer(layer);
  std::vector<double> qd(q, q + d);
  if (!quantizer.k_rotation.empty()) {
    qd = naive_rotate(qd, std::vector<double>(quantizer.k_rotation.begin(), quantizer.k_rotation.end()), d);
  }
  const DenseHead& head = heads[qo_head / (config.num_qo_heads / config.num_kv_heads)];
  NaiveAttention r = naive_attention(qd, head.keys, head.values, 1.0 / std::sqrt(double(d)),
                                     static_cast<size_t>(q_pos + 1));
  if (!quantizer.v_rotation.empty()) {
    r.out = naive_unrotate(r.out, std::vector<double>(quantizer.v_rotation.begin(), quantizer.v_rotation.end()), d);
  }
  return r;
}

}  // namespace oscar::testing
