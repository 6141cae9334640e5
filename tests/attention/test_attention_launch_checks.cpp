// The host-side checks of a paged_attention launch (validate_paged_attention), on a machine
// without a GPU: every refusal names its problem, and the arguments of a real launch pass.
// The pointers are addresses in a host arena with the alignment a device allocation has; the
// checks never dereference them (paged_attention runs the same checks before it queues a
// kernel; test_attention_gpu covers a few of them again on the device).
#include <doctest/doctest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status_names.hpp"
#include "oscar/attention/attention_launch_checks.hpp"

using namespace oscar;
using oscar::testing::names;

namespace {

constexpr int kD = 128, kPage = 16, kKvHeads = 8, kQoHeads = 32, kPages = 64, kBatch = 4;

struct Launch {
  AttentionPlan plan;
  PagedAttentionParams params;
  std::vector<unsigned char> workspace_storage;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  Status check() const { return validate_paged_attention(plan, params, workspace, workspace_bytes); }
};

// An arena of host memory standing in for device allocations: 256-byte aligned blocks.
unsigned char* arena() {
  alignas(256) static unsigned char bytes[1 << 16];
  return bytes;
}

// A decode launch of kBatch requests of 1000 tokens (sink 64, INT2 672, window 264), as an
// engine would make it: the plan from the lengths, packed pools, page tables in device memory.
Launch decode_launch() {
  Launch l;
  const AttentionShape shape{kQoHeads, kKvHeads, kD, kD, kPage};
  const std::vector<SegmentCounts> lengths(kBatch, SegmentCounts{64, 672, 264});
  auto plan = make_attention_plan(shape, lengths);
  REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
  l.plan = *plan;
  unsigned char* a = arena();
  const Int2Layout layout{kD, kD, kPage};
  PagedKvRef& kv = l.params.kv;
  kv.k_bf16 = Bf16PoolRef::packed(reinterpret_cast<bf16_t*>(a), kPages, kKvHeads, kPage, kD);
  kv.v_bf16 = Bf16PoolRef::packed(reinterpret_cast<bf16_t*>(a + 256), kPages, kKvHeads, kPage, kD);
  kv.k_int2 = Int2PoolRef::packed(a + 512, kPages, kKvHeads, layout);
  kv.v_int2 = Int2PoolRef::packed(a + 768, kPages, kKvHeads, layout);
  const auto* ints = reinterpret_cast<const int32_t*>(a + 1024);
  for (PageTableRef* t : {&kv.sink, &kv.int2, &kv.recent}) *t = PageTableRef{ints, ints, ints, kBatch, kPage};
  l.params.num_qo_heads = kQoHeads;
  l.params.q = reinterpret_cast<const bf16_t*>(a + 2048);
  l.params.out = reinterpret_cast<bf16_t*>(a + 4096);
  l.params.q_rotation = reinterpret_cast<const float*>(a + 8192);
  l.params.output_unrotation = reinterpret_cast<const float*>(a + 16384);
  l.workspace_bytes = l.plan.workspace_bytes();
  l.workspace = a + 32768;
  return l;
}

}  // namespace

TEST_CASE("the arguments of a real decode launch pass") {
  const Launch l = decode_launch();
  REQUIRE(l.plan.total_items() > 0);
  const Status s = l.check();
  CHECK_MESSAGE(s.ok(), s.to_string());
}

TEST_CASE("workspace: too small, null or misaligned") {
  Launch l = decode_launch();
  l.workspace_bytes -= 1;
  CHECK(names(l.check(), "smaller than the " + std::to_string(l.plan.workspace_bytes()) + " the plan needs"));
  l = decode_launch();
  l.workspace = nullptr;
  CHECK(names(l.check(), "256-byte aligned"));
  l = decode_launch();
  l.workspace = static_cast<unsigned char*>(l.workspace) + 16;
  CHECK(names(l.check(), "256-byte aligned"));
}

TEST_CASE("pools: the disagreeing field is named with both values") {
  Launch l = decode_launch();
  l.params.kv.v_int2.num_kv_heads = 4;
  CHECK(names(l.check(), "pools disagree: v_int2 num_kv_heads is 4, k_int2's 8"));
  l = decode_launch();
  l.params.kv.v_bf16.page_size = 8;
  CHECK(names(l.check(), "pools disagree: v_bf16 page_size is 8, k_int2's 16"));
  l = decode_launch();
  l.params.kv.v_bf16.num_pages = kPages - 1;
  CHECK(names(l.check(), "v_bf16 num_pages is 63, k_bf16's 64"));
  l = decode_launch();
  l.params.kv.k_bf16.num_kv_heads = 4;
  CHECK(names(l.check(), "k_bf16 num_kv_heads"));
  // A layout error names its pool.
  l = decode_launch();
  l.params.kv.v_int2.layout.head_dim = 96;
  CHECK(names(l.check(), "v_int2 pool: head_dim 96"));
}

TEST_CASE("BF16 pools must be 16-byte aligned: the kernels read rows 8 elements per load") {
  Launch l = decode_launch();
  l.params.kv.k_bf16.data += 1;  // 2 bytes off
  CHECK(names(l.check(), "BF16 pools must be 16-byte aligned"));
  l = decode_launch();
  l.params.kv.v_bf16.stride_head += 1;  // every head's rows but the first off by 2 bytes
  l.params.kv.v_bf16.stride_page = l.params.kv.v_bf16.stride_head * kKvHeads;
  CHECK(names(l.check(), "BF16 pools must be 16-byte aligned"));
}

TEST_CASE("INT2 page strides of 2 GiB or more are refused (32-bit page offsets)") {
  Launch l = decode_launch();
  l.params.kv.k_int2.stride_page = int64_t{1} << 31;
  l.params.kv.k_int2.num_pages = 1;
  l.params.kv.v_int2.num_pages = 1;
  CHECK(l.check().code() == StatusCode::kUnsupported);
  CHECK(names(l.check(), "2 GiB"));
}

TEST_CASE("the plan against the pools, the page tables and num_qo_heads") {
  Launch l = decode_launch();
  l.params.num_qo_heads = 16;
  CHECK(names(l.check(), "disagree with the plan's shape"));
  for (int t = 0; t < 3; ++t) {
    l = decode_launch();
    PageTableRef* tables[] = {&l.params.kv.sink, &l.params.kv.int2, &l.params.kv.recent};
    const char* table_names[] = {"sink", "int2", "recent"};
    tables[t]->batch_size = kBatch - 1;
    CAPTURE(t);
    CHECK(names(l.check(), std::string("the ") + table_names[t] + " page table holds 3 requests, the plan 4"));
  }
  l = decode_launch();
  l.params.kv.recent.page_size = 32;
  CHECK(names(l.check(), "page tables and pools disagree on page_size"));
  l = decode_launch();
  l.params.kv.int2.indptr = nullptr;
  CHECK(names(l.check(), "indptr and last_page_len must not be null"));
}

TEST_CASE("the pointers the kernels dereference") {
  Launch l = decode_launch();
  l.params.out = nullptr;
  CHECK(names(l.check(), "q and out must not be null"));
  l = decode_launch();
  l.params.q += 1;
  CHECK(names(l.check(), "q must be 16-byte aligned"));
  l = decode_launch();
  l.params.q_rotation += 1;  // 4 bytes off: the rotation reads R_K as float4
  CHECK(names(l.check(), "q_rotation and output_unrotation must be 16-byte aligned"));
  l = decode_launch();
  l.params.output_unrotation += 2;
  CHECK(names(l.check(), "q_rotation and output_unrotation must be 16-byte aligned"));
  l = decode_launch();
  l.params.q_rotation = nullptr;  // the engine rotated q, and folded R_V into W_O
  l.params.output_unrotation = nullptr;
  CHECK(l.check().ok());
  l = decode_launch();
  l.params.qo_indptr = reinterpret_cast<const int32_t*>(arena() + 1024);
  CHECK(names(l.check(), "a decode plan takes no qo_indptr"));
}

TEST_CASE("an extend plan needs qo_indptr") {
  Launch l = decode_launch();
  const std::vector<SegmentCounts> lengths(kBatch, SegmentCounts{64, 672, 264});
  const std::vector<int32_t> queries(kBatch, 4);
  auto plan = make_attention_plan(l.plan.shape, lengths, queries);
  REQUIRE(plan.ok());
  l.plan = *plan;
  l.workspace_bytes = l.plan.workspace_bytes();
  CHECK(names(l.check(), "an extend plan needs qo_indptr"));
  l.params.qo_indptr = reinterpret_cast<const int32_t*>(arena() + 1024);
  CHECK(l.check().ok());
}

TEST_CASE("a column part that is not the plan's (forged or stale) is refused whole") {
  Launch l = decode_launch();
  AttentionPlan part = l.plan;
  part.shape.head_dim = 64;
  l.plan.column_part = std::make_shared<const AttentionPlan>(part);
  l.workspace_bytes = l.plan.workspace_bytes();
  CHECK(names(l.check(), "column part disagrees"));
  part = decode_launch().plan;
  part.tile_columns = kAttentionRowTile;
  l.plan.column_part = std::make_shared<const AttentionPlan>(part);
  l.workspace_bytes = l.plan.workspace_bytes();
  CHECK(names(l.check(), "column part disagrees"));
}

TEST_CASE("an empty batch checks only the workspace, pools and shapes") {
  Launch l = decode_launch();
  auto plan = make_attention_plan(l.plan.shape, std::vector<SegmentCounts>{});
  REQUIRE_MESSAGE(plan.ok(), plan.status().to_string());
  REQUIRE(plan->total_items() == 0);
  l.plan = *plan;
  l.workspace_bytes = l.plan.workspace_bytes();
  for (PageTableRef* t : {&l.params.kv.sink, &l.params.kv.int2, &l.params.kv.recent}) t->batch_size = 0;
  l.params.q = nullptr;  // nothing will read it
  CHECK(l.check().ok());
  l.params.kv.k_bf16.data += 1;
  CHECK(names(l.check(), "BF16 pools must be 16-byte aligned"));
}
