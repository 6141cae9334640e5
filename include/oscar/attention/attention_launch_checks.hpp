// The host-side checks of a paged_attention launch: everything that can be checked without
// reading device memory (the workspace, the pools and their alignment, the plan against the
// pools and tables, the pointers the kernels dereference, a plan's column part). Host code
// only, so that the refusals are tested on machines without a GPU
// (tests/attention/test_attention_launch_checks.cpp); paged_attention runs them before it
// queues anything.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "oscar/attention/attention_plan.hpp"
#include "oscar/attention/paged_attention_params.hpp"
#include "oscar/core/status.hpp"
#include "oscar/kv/paged_kv.hpp"
#include "oscar/kv/pools.hpp"

namespace oscar {
namespace attention_detail {

inline Status check_workspace(const AttentionPlan& plan, const void* workspace, size_t bytes, const char* what) {
  if (bytes < plan.workspace_bytes()) {
    return invalid_argument(std::string(what) + ": workspace of " + std::to_string(bytes) + " bytes is smaller than the " +
                            std::to_string(plan.workspace_bytes()) + " the plan needs");
  }
  if (plan.workspace_bytes() > 0 && (!workspace || reinterpret_cast<uintptr_t>(workspace) % 256 != 0)) {
    return invalid_argument(std::string(what) + ": workspace must be a non-null, 256-byte aligned device pointer");
  }
  return Status::Ok();
}

// Whether a kernel of this library runs the plan part's tiles at its head_dim: row tiles up
// to kAttentionRowTiledMaxHeadDim, single column tiles, paired ones up to
// kAttentionPairedTilesMaxHeadDim. paged_attention asks before it queues anything, so a forged
// part is refused whole; launch_plan's dispatch refuses the same plans again where it must
// name a kernel.
inline bool kernel_runs_tiles(const AttentionPlan& plan) {
  const int d = plan.shape.head_dim;
  return plan.tile_columns == kAttentionTileColumns ||
         (plan.paired_tiles() && d <= kAttentionPairedTilesMaxHeadDim) ||
         (plan.row_tiled() && d <= kAttentionRowTiledMaxHeadDim);
}

}  // namespace attention_detail

// Whether paged_attention can take these arguments: Ok, or an error that names the problem.
inline Status validate_paged_attention(const AttentionPlan& plan, const PagedAttentionParams& params,
                                       const void* workspace, size_t workspace_bytes) {
  using namespace attention_detail;
  OSCAR_RETURN_IF_ERROR(check_workspace(plan, workspace, workspace_bytes, "paged_attention"));
  const PagedKvRef& kv = params.kv;
  OSCAR_RETURN_IF_ERROR(validate_pool_set(kv.k_bf16, kv.v_bf16, kv.k_int2, kv.v_int2));
  if (!bf16_rows_16b_aligned(kv.k_bf16) || !bf16_rows_16b_aligned(kv.v_bf16)) {
    return invalid_argument("paged_attention: BF16 pools must be 16-byte aligned (data, and stride_page and "
                            "stride_head in multiples of 8 elements): the kernels read rows 8 elements per load");
  }
  if (kv.k_int2.stride_page > INT32_MAX || kv.v_int2.stride_page > INT32_MAX) {
    return unsupported("paged_attention: INT2 page strides of 2 GiB or more (the kernel's page offsets are 32-bit "
                       "multiplies)");
  }
  const AttentionShape& shape = plan.shape;
  const Int2Layout& layout = kv.k_int2.layout;
  if (layout.head_dim != shape.head_dim || layout.quant_group_size != shape.quant_group_size ||
      layout.page_size != shape.page_size || kv.k_int2.num_kv_heads != shape.num_kv_heads ||
      params.num_qo_heads != shape.num_qo_heads) {
    return invalid_argument("paged_attention: the pools or num_qo_heads disagree with the plan's shape (head_dim " +
                            std::to_string(shape.head_dim) + ", group " + std::to_string(shape.quant_group_size) +
                            ", page_size " + std::to_string(shape.page_size) + ", kv heads " +
                            std::to_string(shape.num_kv_heads) + ", qo heads " + std::to_string(shape.num_qo_heads) + ")");
  }
  for (const auto& [table, name] : {std::pair{&kv.sink, "sink"}, std::pair{&kv.int2, "int2"}, std::pair{&kv.recent, "recent"}}) {
    if (table->batch_size != plan.batch_size) {
      return invalid_argument(std::string("paged_attention: the ") + name + " page table holds " +
                              std::to_string(table->batch_size) + " requests, the plan " +
                              std::to_string(plan.batch_size));
    }
  }
  if (kv.sink.page_size != shape.page_size || kv.int2.page_size != shape.page_size ||
      kv.recent.page_size != shape.page_size) {
    return invalid_argument("paged_attention: page tables and pools disagree on page_size");
  }
  if (plan.total_items() == 0) return Status::Ok();  // nothing will read the pointers below
  for (const PageTableRef* t : {&kv.sink, &kv.int2, &kv.recent}) {
    if (!t->indptr || !t->last_page_len) {
      return invalid_argument("paged_attention: page table indptr and last_page_len must not be null");
    }
  }
  if (!params.q || !params.out) return invalid_argument("paged_attention: q and out must not be null");
  if (plan.decode != (params.qo_indptr == nullptr)) {
    return invalid_argument(plan.decode ? "paged_attention: a decode plan takes no qo_indptr"
                                        : "paged_attention: an extend plan needs qo_indptr");
  }
  if (reinterpret_cast<uintptr_t>(params.output_unrotation) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(params.q_rotation) % 16 != 0) {
    return invalid_argument("paged_attention: q_rotation and output_unrotation must be 16-byte aligned (the kernels "
                            "read them 4 floats per load)");
  }
  if (reinterpret_cast<uintptr_t>(params.q) % 16 != 0) {
    return invalid_argument("paged_attention: q must be 16-byte aligned (the kernels read 8 channels per load)");
  }
  if (shape.num_kv_heads > 65535) return unsupported("paged_attention: more than 65535 KV heads");

  if (plan.column_part) {
    const AttentionPlan& part = *plan.column_part;
    if (part.column_part || part.row_tiled() || !kernel_runs_tiles(part) || part.items.empty() ||
        part.decode != plan.decode || part.batch_size != plan.batch_size || part.shape.head_dim != shape.head_dim ||
        part.shape.num_qo_heads != shape.num_qo_heads || part.shape.num_kv_heads != shape.num_kv_heads ||
        part.shape.page_size != shape.page_size || part.shape.quant_group_size != shape.quant_group_size) {
      return invalid_argument("paged_attention: the plan's column part disagrees with the plan (not a plan of this "
                              "library)");
    }
  }
  return Status::Ok();
}

}  // namespace oscar
