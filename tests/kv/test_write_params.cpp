// The host-side checks of the write launchers (validate(AppendParams), validate(DemoteParams)),
// on a machine without a GPU: the layer strides against every pool's span, the input strides,
// the pointers. append_kv and demote_kv run them before anything is queued; the pointers are
// addresses in a host arena with a device allocation's alignment, never dereferenced.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "common/status_names.hpp"
#include "oscar/kv/write_params.hpp"

using namespace oscar;
using oscar::testing::names;

namespace {

constexpr int kD = 128, kPage = 16, kHeads = 8, kPages = 32, kLayers = 4;

unsigned char* arena() {
  alignas(256) static unsigned char bytes[1 << 12];
  return bytes;
}

// Four layers of packed pools, each layer's K and V one after another in a layer-strided
// allocation, as an engine lays them out.
LayeredKvPools layered_pools() {
  unsigned char* a = arena();
  const Int2Layout layout{kD, kD, kPage};
  LayeredKvPools p;
  p.k_bf16 = Bf16PoolRef::packed(reinterpret_cast<bf16_t*>(a), kPages, kHeads, kPage, kD);
  p.v_bf16 = Bf16PoolRef::packed(reinterpret_cast<bf16_t*>(a + 256), kPages, kHeads, kPage, kD);
  p.k_int2 = Int2PoolRef::packed(a + 512, kPages, kHeads, layout);
  p.v_int2 = Int2PoolRef::packed(a + 768, kPages, kHeads, layout);
  p.bf16_stride_layer = p.k_bf16.stride_page * kPages;
  p.int2_stride_layer = p.k_int2.stride_page * kPages;
  p.num_layers = kLayers;
  p.k_clip_rank = reinterpret_cast<const int32_t*>(a + 1024);
  p.v_clip_rank = reinterpret_cast<const int32_t*>(a + 1024);
  return p;
}

AppendParams append_params() {
  AppendParams p;
  p.pools = layered_pools();
  p.k = reinterpret_cast<const bf16_t*>(arena() + 2048);
  p.v = p.k;
  p.num_tokens = 3;
  p.in_stride_token = kHeads * kD;
  p.in_stride_layer = p.in_stride_token * p.num_tokens;
  p.slots = reinterpret_cast<const TokenSlot*>(arena() + 3072);
  return p;
}

}  // namespace

TEST_CASE("a layer-strided set of packed pools passes") {
  CHECK(validate(layered_pools()).ok());
  CHECK(validate(append_params()).ok());
}

TEST_CASE("layer strides must clear the larger of each layer's K and V pools") {
  // V's pages padded to twice K's stride: at K's layer stride, layer 0's V pages would run
  // into layer 1's and the last layer's past the allocation.
  LayeredKvPools p = layered_pools();
  p.v_bf16.stride_page *= 2;
  CHECK(names(validate(p), "layers overlap"));
  p.bf16_stride_layer = p.v_bf16.stride_page * kPages;
  CHECK(validate(p).ok());
  p = layered_pools();
  p.v_int2.stride_page *= 2;
  CHECK(names(validate(p), "layers overlap"));
  p.int2_stride_layer = p.v_int2.stride_page * kPages;
  CHECK(validate(p).ok());
  // One layer: no layer stride to check.
  p = layered_pools();
  p.num_layers = 1;
  p.v_int2.stride_page *= 2;
  p.int2_stride_layer = 0;
  CHECK(validate(p).ok());
}

TEST_CASE("append inputs: strides and pointers") {
  AppendParams p = append_params();
  p.in_stride_token = kHeads * kD - 8;
  CHECK(names(validate(p), "in_stride_token 1016 is smaller than num_kv_heads * head_dim = 1024"));
  p = append_params();
  p.in_stride_layer = p.in_stride_token * p.num_tokens - 1;
  CHECK(names(validate(p), "in_stride_layer smaller than one layer's rows"));
  p = append_params();
  p.slots = nullptr;
  CHECK(names(validate(p), "k, v and slots must not be null"));
  p = append_params();
  p.rotation = static_cast<AppendRotation>(7);
  CHECK(names(validate(p), "rotation must be"));
  p = append_params();
  p.pools.k_rotation = reinterpret_cast<const float*>(arena() + 4);
  CHECK(names(validate(p), "k_rotation and v_rotation must be 16-byte aligned"));
  p = append_params();
  p.pools.v_clip_rank = nullptr;
  CHECK(names(validate(p), "k_clip_rank and v_clip_rank must not be null"));
}

TEST_CASE("demotions: pointers and counts") {
  DemoteParams d;
  d.pools = layered_pools();
  d.num_demotions = 2;
  CHECK(names(validate(d), "demotions must not be null"));
  d.num_demotions = -1;
  CHECK(names(validate(d), "num_demotions must be >= 0"));
  d.num_demotions = 0;
  CHECK(validate(d).ok());
}
