// One write step on the device as an engine runs it, for the tests that compare it with the
// CPU reference: the plan's demotions, then one append of the step's rows for every layer with
// the exact rotation (the CPU reference's bytes), every status and the error flag checked.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "common/cuda_check.hpp"
#include "common/device_pools.hpp"
#include "oscar/host/paged_cache.hpp"
#include "oscar/kv/write.cuh"

namespace oscar::testing {

// k, v: the step's rows, [layer][token][kv_head][head_dim] bf16, one token per plan slot.
inline void device_write_step(const DevicePools& device, const host::CacheConfig& c, const host::WritePlan& plan,
                              const std::vector<bf16_t>& k, const std::vector<bf16_t>& v) {
  const int tokens = static_cast<int>(plan.slots.size());
  DeviceArray<bf16_t> d_k(k.size()), d_v(v.size());
  d_k.upload(k);
  d_v.upload(v);
  DeviceArray<TokenSlot> d_slots(plan.slots.size());
  d_slots.upload(plan.slots);
  DeviceArray<PageDemotion> d_demotions(plan.demotions.size());
  d_demotions.upload(plan.demotions);
  DeviceArray<int32_t> d_flag(1);
  d_flag.fill_bytes(0);

  DemoteParams demote;
  demote.pools = device.view();
  demote.num_demotions = static_cast<int32_t>(plan.demotions.size());
  demote.demotions = d_demotions.ptr;
  demote.error_flag = d_flag.ptr;
  const Status ds = demote_kv(demote);  // also with no demotions: the launcher accepts an empty list
  REQUIRE_MESSAGE(ds.ok(), ds.to_string());

  AppendParams append;
  append.pools = device.view();
  append.k = d_k.ptr;
  append.v = d_v.ptr;
  append.in_stride_token = int64_t{c.num_kv_heads} * c.head_dim;
  append.in_stride_layer = append.in_stride_token * tokens;
  append.num_tokens = tokens;
  append.slots = d_slots.ptr;
  append.values_prerotated = c.values_prerotated;
  append.rotation = AppendRotation::kExactFma;  // the CPU reference's bytes (tensor cores: their own cases)
  append.error_flag = d_flag.ptr;
  const Status as = append_kv(append);
  REQUIRE_MESSAGE(as.ok(), as.to_string());
  CUDA_REQUIRE(cudaDeviceSynchronize());
  CHECK(d_flag.download()[0] == 0);
}

}  // namespace oscar::testing
