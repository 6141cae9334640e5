// One layer of a host::PagedCache mirrored on the device for the attention kernels: the four
// pools, the three page tables of a batch, the layer's rotations, and the plan's workspace.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "common/device_pools.hpp"
#include "oscar/attention/attention_plan.hpp"
#include "oscar/attention/paged_attention.cuh"
#include "oscar/host/paged_cache.hpp"

namespace oscar::testing {

// Segment lengths of every request of a batch, as the plan takes them (host side).
inline std::vector<SegmentCounts> segment_lengths(const host::BatchTables& t) {
  const PageTableRef sink = host::BatchTables::ref(t.sink, t.page_size);
  const PageTableRef int2 = host::BatchTables::ref(t.int2, t.page_size);
  const PageTableRef recent = host::BatchTables::ref(t.recent, t.page_size);
  std::vector<SegmentCounts> out;
  for (int32_t b = 0; b < sink.batch_size; ++b) out.push_back({sink.num_tokens(b), int2.num_tokens(b), recent.num_tokens(b)});
  return out;
}

class DeviceLayer {
 public:
  DeviceLayer(const host::PagedCache& cache, int layer, const host::BatchTables& tables) {
    using T = host::PagedCache::Tensor;
    const Int2PoolRef ki = cache.int2_pool(layer, T::kKeys), vi = cache.int2_pool(layer, T::kValues);
    const Bf16PoolRef kb = cache.bf16_pool(layer, T::kKeys), vb = cache.bf16_pool(layer, T::kValues);
    const size_t int2_bytes = size_t(ki.num_pages) * ki.stride_page;
    const size_t bf16_elems = size_t(kb.num_pages) * kb.stride_page;
    k_int2_ = DeviceArray<uint8_t>(int2_bytes);
    v_int2_ = DeviceArray<uint8_t>(int2_bytes);
    k_bf16_ = DeviceArray<bf16_t>(bf16_elems);
    v_bf16_ = DeviceArray<bf16_t>(bf16_elems);
    k_int2_.upload(ki.data, int2_bytes);
    v_int2_.upload(vi.data, int2_bytes);
    k_bf16_.upload(kb.data, bf16_elems);
    v_bf16_.upload(vb.data, bf16_elems);
    kv_.k_int2 = ki;
    kv_.k_int2.data = k_int2_.ptr;
    kv_.v_int2 = vi;
    kv_.v_int2.data = v_int2_.ptr;
    kv_.k_bf16 = kb;
    kv_.k_bf16.data = k_bf16_.ptr;
    kv_.v_bf16 = vb;
    kv_.v_bf16.data = v_bf16_.ptr;
    kv_.sink = upload_table(tables.sink, tables.page_size, sink_);
    kv_.int2 = upload_table(tables.int2, tables.page_size, int2_);
    kv_.recent = upload_table(tables.recent, tables.page_size, recent_);
    const host::LayerQuantizer& q = cache.layer_quantizer(layer);
    if (!q.k_rotation.empty()) {
      k_rot_ = DeviceArray<float>(q.k_rotation.size());
      k_rot_.upload(q.k_rotation);
    }
    if (!q.v_rotation.empty()) {
      v_rot_ = DeviceArray<float>(q.v_rotation.size());
      v_rot_.upload(q.v_rotation);
    }
  }

  const PagedKvRef& kv() const { return kv_; }
  const float* k_rotation() const { return k_rot_.ptr; }
  const float* v_rotation() const { return v_rot_.ptr; }

 private:
  struct Table {
    DeviceArray<int32_t> indptr, indices, last;
  };
  static PageTableRef upload_table(const host::BatchTables::Table& t, int32_t page_size, Table& dst) {
    dst.indptr = DeviceArray<int32_t>(t.indptr.size());
    dst.indptr.upload(t.indptr);
    dst.indices = DeviceArray<int32_t>(std::max<size_t>(1, t.indices.size()));
    dst.indices.upload(t.indices);
    dst.last = DeviceArray<int32_t>(std::max<size_t>(1, t.last_page_len.size()));
    dst.last.upload(t.last_page_len);
    return {dst.indptr.ptr, dst.indices.ptr, dst.last.ptr, static_cast<int32_t>(t.last_page_len.size()), page_size};
  }

  DeviceArray<uint8_t> k_int2_, v_int2_;
  DeviceArray<bf16_t> k_bf16_, v_bf16_;
  DeviceArray<float> k_rot_, v_rot_;
  Table sink_, int2_, recent_;
  PagedKvRef kv_;
};

}  // namespace oscar::testing
