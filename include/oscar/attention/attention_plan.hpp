// The host plan of GPU paged attention (decode and extend): how the keys of every request are
// split into chunks (split-KV), one GPU work item per (request, column tile, chunk), and how
// large the workspace must be. Pure host code, so engines and tests can inspect a plan without
// a GPU; attention/paged_attention.cuh uploads it and runs the kernel.
//
// The plan/run split is FlashInfer's: plan once per step on the host from the lengths the
// engine already knows (no device read), then run, which allocates nothing and never
// synchronizes (CUDA-graph capturable for a fixed plan).
//
// Chunks are sized in bytes, not tokens: an INT2 token costs ~7x fewer bytes than a BF16
// token, so a chunk of INT2 pages holds ~7x more tokens for the same work (kernels.md §2.6).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "oscar/core/config.hpp"
#include "oscar/core/status.hpp"
#include "oscar/quant/format.hpp"

namespace oscar {

// Keys are processed in tiles of this many tokens (the M dimension of one MMA).
inline constexpr int kAttentionTileTokens = 16;
// One column tile: this many (query token, query head) columns share one pass over the keys
// (the N dimension of one MMA). A decode step of a GQA group of up to 8 heads is one tile.
inline constexpr int kAttentionTileColumns = 8;
// Extend plans whose requests have more rows per KV head than one tile holds (9 up to the
// row-tiled threshold: speculative verification of 3-12 drafted tokens at g = 4) carry two
// column tiles through each pass over the keys, at head dims up to
// kAttentionPairedTilesMaxHeadDim: the two share every INT2 tile's copies and unpack, where
// two single-tile passes each paid for them (AttentionPlanOptions::paired_column_tiles and
// paired_max_chunks_per_tile: batches pair, one long request cut into many chunks does not).
inline constexpr int kAttentionPairedTileColumns = 2 * kAttentionTileColumns;
inline constexpr int kAttentionPairedTilesMaxHeadDim = 128;
// Extend plans where some request has more than AttentionPlanOptions::row_tiled_min_rows rows
// (rows = query tokens x GQA group; default kAttentionRowTiledMinRows) run the row-tiled
// extend kernel instead: 64 rows per block, queries in the MMA's M dimension, so a block reads
// each key tile once for all its rows (extend_attention.cuh), at head dims up to
// kAttentionRowTiledMaxHeadDim. The threshold sits between the measured points (H100, 32K
// prefix, g = 4, docs/benchmarks.md): at 32 rows the column kernel is faster (60.6 vs 70.4
// us), at 64 the row-tiled one (74.4 vs 93.9 us; the column kernel grows ~1 us per row, the
// row-tiled one is nearly flat below one 64-row tile), so they cross near 43 rows.
inline constexpr int kAttentionRowTile = 64;
inline constexpr int kAttentionRowTiledMinRows = 48;
inline constexpr int kAttentionRowTiledMaxHeadDim = 128;

struct AttentionShape {
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 128;
  int32_t quant_group_size = 128;
  int32_t page_size = 16;

  int32_t group_size() const { return num_qo_heads / num_kv_heads; }
};

struct AttentionPlanOptions {
  int32_t num_sms = 132;  // streaming multiprocessors of the target GPU
  // Thread blocks to aim for per SM. Fewer means longer chunks and less partial-state traffic;
  // more means more bytes in flight. 0: the default below.
  int32_t target_blocks_per_sm = 0;
  // The shortest chunk, in bytes of K and V of one KV head: below it, partial states and the
  // pipeline's fill cost more than they save. 32 KB since the split merge keeps its loads in
  // flight (H200, B = 1 32K: d = 128 37.0 -> 35.3 us, d = 64 25.0 -> 21.0 us against 64 KB;
  // 16 KB measured the same as 32 KB, as the chunk count caps first).
  int64_t min_chunk_bytes = 32 * 1024;
  // Extend plans with more than row_tiled_min_rows rows in some request run on the
  // row-tiled extend kernel; INT32_MAX keeps every extend on the decode kernel's 8-column tiles.
  int32_t row_tiled_min_rows = kAttentionRowTiledMinRows;
  // target_blocks_per_sm for row-tiled extend plans (a different kernel, with its own
  // occupancy). 0: kDefaultTargetBlocksPerSm.
  int32_t target_extend_blocks_per_sm = 0;
  // Extend plans of up to row_tiled_min_rows rows per request and KV head, some request above
  // one 8-column tile, run with kAttentionPairedTileColumns per tile (false: 8-column tiles,
  // each its own pass over the keys). Every request of such a plan then gets 16-column tiles,
  // so a request of 8 rows or fewer in it computes an empty second tile.
  bool paired_column_tiles = true;
  // target_blocks_per_sm for paired-tile plans (more registers per block). 0:
  // kDefaultTargetBlocksPerSm.
  int32_t target_paired_blocks_per_sm = 0;
  // Pair only where the single-tile plan would cut each (request, column tile) into at most this
  // many chunks on average; a few requests cut into many short chunks run single tiles
  // (make_attention_plan says why). Between the measured points (H100, 32K): 5.5 and 1 won
  // (d = 64 B = 16, d = 128 B = 16), 12 and 24 lost (d = 128 B = 1, Q = 8 and 4).
  int32_t paired_max_chunks_per_tile = 8;
  // Mixed batches (continuous batching with chunked prefill: a few requests above
  // row_tiled_min_rows, the others decoding or verifying a few tokens): the short requests run
  // on the column kernel as AttentionPlan::column_part, a second launch, where the row-tiled
  // kernel would give each of them a 64-row tile with g of its rows used.
  // mixed_split_min_bytes < 0 (the default) splits unless the whole batch on the row-tiled
  // kernel costs the long requests nothing: the whole plan cuts every long request into as
  // many chunks as the long requests' plan alone, and its blocks take as many waves of the
  // row-tiled kernel's resident blocks. The short requests' tiles then fill slots of the long
  // part's last wave, where the split would add the column kernel's launch and its ~20 us
  // after it; otherwise they stretch the long part by whole waves, or by the extra chunks
  // and merges of the long requests that their bytes cause. Measured (H100, a 512- or
  // 64-token chunk over 32K beside decodes, bench_attention_gpu's mixed/ against
  // mixed_whole/, docs/benchmarks.md): the rule picks the faster form in all 13 shapes,
  // where no byte threshold serves both head dims (d = 128: two decodes of 8K, 12 MB, already
  // pay for the split, 973 against 1014 us; d = 64: 16 decodes, 19 MB, still ride free, 260
  // against 287). mixed_split_min_bytes >= 0: split where the short requests read at least
  // that many bytes of K and V over every KV head (0: always).
  bool split_mixed_batches = true;
  int64_t mixed_split_min_bytes = -1;
};

inline constexpr int32_t kDefaultTargetBlocksPerSm = 2;
// A request is cut into at most this many chunks: the last block merges them all, and more
// partial states cost more to write and read than the parallelism gains.
inline constexpr int32_t kMaxAttentionChunks = 64;

// One thread block's work (for every KV head: the grid is items x num_kv_heads). Tiles are
// numbered over the request's segments in order: ceil(sink/16) sink tiles, then ceil(int2/16)
// INT2 tiles, then ceil(recent/16) recent tiles.
struct AttentionWorkItem {
  int32_t request = 0;
  int32_t column_tile = 0;  // columns [w*column_tile, w*column_tile + w) of the request, w = plan.tile_columns
  int32_t tile_begin = 0;
  int32_t tile_end = 0;
  int32_t first_item = 0;   // the first chunk of this (request, column tile)
  int32_t num_chunks = 1;   // 1: the block writes the output itself, no partial state
  int32_t counter = 0;      // index of the arrival counter of this (request, column tile)
  int32_t reserved = 0;
};
static_assert(sizeof(AttentionWorkItem) == 32);

struct AttentionPlan {
  AttentionShape shape;
  int32_t batch_size = 0;
  bool decode = true;  // one query token per request
  std::vector<AttentionWorkItem> items;
  int32_t num_counters = 0;  // (request, column tile) pairs split into more than one chunk
  // Columns (query token, query head of the KV head) per tile: kAttentionTileColumns for the
  // decode kernel, kAttentionPairedTileColumns for its paired-tile extends, kAttentionRowTile
  // for the row-tiled extend kernel.
  int32_t tile_columns = kAttentionTileColumns;
  int64_t num_query_tokens = 0;  // over the batch

  // A mixed batch's short requests (AttentionPlanOptions::split_mixed_batches): a plan of the
  // same batch whose items cover only them, on the column kernel, launched by paged_attention
  // after this plan's row-tiled kernels; this plan's items then cover only the long requests.
  // Null otherwise. Its workspace follows this plan's own.
  std::shared_ptr<const AttentionPlan> column_part;

  bool row_tiled() const { return tile_columns == kAttentionRowTile; }
  bool paired_tiles() const { return tile_columns == kAttentionPairedTileColumns; }
  // Work items over both parts (the thread blocks of one run, KV heads aside).
  size_t total_items() const { return items.size() + (column_part ? column_part->items.size() : 0); }

  // Workspace layout (device, 256-byte aligned parts): work items, arrival counters, partial
  // outputs [items][kv_heads][tile_columns][head_dim] float, partial lse
  // [items][kv_heads][tile_columns] float, and for row-tiled plans the rotated queries
  // [num_query_tokens][num_qo_heads][head_dim] float; then the column part's workspace.
  static constexpr size_t align(size_t bytes) { return (bytes + 255) / 256 * 256; }
  size_t items_bytes() const { return align(items.size() * sizeof(AttentionWorkItem)); }
  size_t counters_bytes() const { return align(size_t(num_counters) * shape.num_kv_heads * sizeof(int32_t)); }
  size_t partial_o_bytes() const {
    return align(items.size() * shape.num_kv_heads * size_t(tile_columns) * shape.head_dim * sizeof(float));
  }
  size_t partial_lse_bytes() const {
    return align(items.size() * shape.num_kv_heads * size_t(tile_columns) * sizeof(float));
  }
  size_t rotated_q_bytes() const {
    return row_tiled() ? align(size_t(num_query_tokens) * shape.num_qo_heads * shape.head_dim * sizeof(float)) : 0;
  }
  // This plan's own parts (the column part's workspace starts here).
  size_t own_workspace_bytes() const {
    return items_bytes() + counters_bytes() + partial_o_bytes() + partial_lse_bytes() + rotated_q_bytes();
  }
  size_t workspace_bytes() const {
    return own_workspace_bytes() + (column_part ? column_part->workspace_bytes() : 0);
  }
};

// The blocks per SM a plan of this kind aims for: the target of the kernel that runs it (0:
// kDefaultTargetBlocksPerSm).
inline int32_t plan_target_blocks_per_sm(const AttentionPlan& plan, const AttentionPlanOptions& options) {
  return plan.row_tiled()      ? options.target_extend_blocks_per_sm
         : plan.paired_tiles() ? options.target_paired_blocks_per_sm
                               : options.target_blocks_per_sm;
}

namespace attention_plan_detail {
// A target of blocks per SM as the planner uses it (0: kDefaultTargetBlocksPerSm).
inline int64_t blocks_per_sm_or_default(int32_t target) { return target > 0 ? target : kDefaultTargetBlocksPerSm; }
}  // namespace attention_plan_detail

OSCAR_HOST_DEVICE constexpr int64_t attention_tiles(int64_t tokens) {
  return (tokens + kAttentionTileTokens - 1) / kAttentionTileTokens;
}

// Bytes of K and V one tile of a segment reads for one KV head (the cost the chunks balance).
inline int64_t attention_tile_bytes(const AttentionShape& shape, bool int2) {
  const int64_t row = int2 ? shape.head_dim / 4 + 4 * (shape.head_dim / shape.quant_group_size)
                           : 2 * int64_t{shape.head_dim};
  return 2 * row * kAttentionTileTokens;
}

inline Status validate(const AttentionShape& shape) {
  if (shape.num_kv_heads <= 0 || shape.num_qo_heads <= 0 || shape.num_qo_heads % shape.num_kv_heads != 0) {
    return invalid_argument("num_qo_heads " + std::to_string(shape.num_qo_heads) +
                            " is not a positive multiple of num_kv_heads " + std::to_string(shape.num_kv_heads));
  }
  if (shape.group_size() > kAttentionTileColumns) {
    return unsupported("GQA group of " + std::to_string(shape.group_size()) +
                       " query heads per KV head is not supported (at most 8)");
  }
  OSCAR_RETURN_IF_ERROR(validate(Int2Layout{shape.head_dim, shape.quant_group_size, shape.page_size}));
  if (shape.quant_group_size != shape.head_dim) {
    return unsupported("GPU attention reads INT2 pages with one quantization group per row; quant_group_size " +
                       std::to_string(shape.quant_group_size) + " < head_dim " + std::to_string(shape.head_dim) +
                       " runs on the CPU reference only");
  }
  return Status::Ok();
}

// The number of chunks each request is cut into. request_bytes[b]: the K and V bytes of request
// b (one KV head), column_tiles[b]: its column tiles (each runs its own chunks), wave_items:
// the work items one wave of the target blocks holds (SMs x blocks per SM / KV heads).
//  1. Nearest: request_bytes / chunk_bytes rounded to the nearest, in [1, kMaxAttentionChunks]
//     (chunk_bytes >= min_chunk_bytes). A batch of equal requests then makes about one wave
//     (rounding 3.06 chunks up to 4 had made 1.29 waves on the H200).
//  2. Where that spills past one wave, rounded down instead, if that fits in one wave
//     (2.75 -> 3 chunks had made 1.09 waves at d = 64, B = 64, 8K; 2 fit in 0.73 waves).
//  3. Where even that needs more than a wave (more requests than a wave has blocks: one chunk
//     per request made 1.29 waves at d = 128, B = 64, 8K), the counts are multiplied by the m
//     in 1..4 whose waves fill their last one best (m = 3: 3.88 waves, 233 -> 210 us on the
//     H100; m = 2, 2.59 waves, measured 209), so the last wave is mostly full.
inline std::vector<int64_t> wave_aligned_chunk_counts(std::span<const int64_t> request_bytes,
                                                      std::span<const int64_t> column_tiles, int64_t chunk_bytes,
                                                      int64_t min_chunk_bytes, double wave_items) {
  const size_t n = request_bytes.size();
  auto counts = [&](bool round_nearest, int64_t multiple) {
    std::vector<int64_t> c(n);
    for (size_t b = 0; b < n; ++b) {
      const int64_t base = (request_bytes[b] + (round_nearest ? chunk_bytes / 2 : 0)) / chunk_bytes;
      // Multiplied counts keep every chunk at least min_chunk_bytes long (the others are by
      // chunk_bytes >= min_chunk_bytes).
      const int64_t most = multiple == 1 ? kMaxAttentionChunks
                                         : std::clamp<int64_t>(request_bytes[b] / std::max<int64_t>(1, min_chunk_bytes),
                                                               1, kMaxAttentionChunks);
      c[b] = std::clamp<int64_t>(multiple * std::max<int64_t>(1, base), 1, most);
    }
    return c;
  };
  auto waves = [&](const std::vector<int64_t>& c) {
    double items = 0;
    for (size_t b = 0; b < n; ++b) items += double(c[b]) * double(column_tiles[b]);
    return items / std::max(1.0, wave_items);
  };
  std::vector<int64_t> nearest = counts(true, 1);
  if (waves(nearest) <= 1.0) return nearest;
  std::vector<int64_t> best = counts(false, 1);
  if (waves(best) <= 1.0) return best;
  auto fill = [](double w) { return w / std::ceil(w); };  // how full the waves are, last one included
  for (int64_t m = 2; m <= 4; ++m) {
    std::vector<int64_t> c = counts(false, m);
    if (fill(waves(c)) > fill(waves(best)) + 0.02) best = std::move(c);  // a clear gain, else fewer chunks
  }
  return best;
}

namespace attention_plan_detail {

// Fills plan.tile_columns and plan.items for the requests with request_rows[b] > 0 (query
// tokens x GQA group; decode: the group), request_bytes[b] the K and V bytes of request b's
// tiles for one KV head. The kernel follows the largest request: the row-tiled one above
// row_tiled_min_rows rows, paired column tiles above one tile's columns, else single tiles.
inline Status plan_items(AttentionPlan& plan, std::span<const SegmentCounts> segments,
                         std::span<const int64_t> request_rows, std::span<const int64_t> request_bytes,
                         const AttentionPlanOptions& options) {
  const AttentionShape& shape = plan.shape;
  const int64_t int2_tile = attention_tile_bytes(shape, true);
  const int64_t bf16_tile = attention_tile_bytes(shape, false);
  const int64_t max_rows = plan.decode ? 0 : *std::max_element(request_rows.begin(), request_rows.end());
  plan.tile_columns = kAttentionTileColumns;
  if (!plan.decode && shape.head_dim <= kAttentionRowTiledMaxHeadDim && max_rows > options.row_tiled_min_rows) {
    plan.tile_columns = kAttentionRowTile;
  } else if (!plan.decode && options.paired_column_tiles && shape.head_dim <= kAttentionPairedTilesMaxHeadDim &&
             max_rows > kAttentionTileColumns) {
    plan.tile_columns = kAttentionPairedTileColumns;
  }

  // Chunks per request for column tiles `tiles` (per request) and a target of blocks per SM:
  // about chunk_bytes each (the bytes over every column tile spread over the work items one
  // wave of the target holds), adjusted so that the blocks do not spill just past a whole wave
  // of the target: a last wave of a few blocks costs nearly a whole block's time (H100,
  // 2026-12-05: d = 128, B = 16, 32K at 0.97 waves 164 us, at 1.29 waves 219;
  // wave_aligned_chunk_counts, docs/benchmarks.md).
  auto chunk_counts = [&](std::span<const int64_t> tiles, int32_t target) {
    const int64_t blocks_per_sm = blocks_per_sm_or_default(target);
    const int64_t target_items = std::max<int64_t>(1, options.num_sms * blocks_per_sm / shape.num_kv_heads);
    int64_t total_bytes = 0;  // per KV head, over every column tile
    for (size_t b = 0; b < segments.size(); ++b) total_bytes += request_bytes[b] * tiles[b];
    const int64_t chunk_bytes = std::max(options.min_chunk_bytes, (total_bytes + target_items - 1) / target_items);
    return wave_aligned_chunk_counts(request_bytes, tiles, chunk_bytes, options.min_chunk_bytes,
                                     double(options.num_sms) * double(blocks_per_sm) / double(shape.num_kv_heads));
  };
  auto tiles_of = [&](int64_t columns) {
    std::vector<int64_t> tiles(segments.size());
    for (size_t b = 0; b < segments.size(); ++b) tiles[b] = (request_rows[b] + columns - 1) / columns;
    return tiles;
  };
  // Paired tiles pay where a block streams a long chunk: the pass over the keys is then most
  // of its time, and sharing each tile's copies and unpack between two tiles saved a quarter of
  // it. Where the single-tile plan cuts a few requests into many short chunks, the paired
  // kernel's longer prologue and serial tail (16 columns of q rotated, twice the partial states
  // merged, 16 outputs un-rotated, at fewer blocks per SM) cost more than it saves (H100, 32K,
  // d = 128: B = 1 Q = 4 44.8 -> 62.1 us, 24 chunks per tile; B = 16 Q = 4 271 -> 204, one
  // chunk per tile; docs/benchmarks.md).
  if (plan.paired_tiles()) {
    const std::vector<int64_t> single_tiles = tiles_of(kAttentionTileColumns);
    const std::vector<int64_t> chunks = chunk_counts(single_tiles, options.target_blocks_per_sm);
    double tiles = 0.0, items = 0.0;
    for (size_t b = 0; b < segments.size(); ++b) {
      tiles += double(single_tiles[b]);
      items += double(chunks[b]) * double(single_tiles[b]);
    }
    if (items > double(options.paired_max_chunks_per_tile) * tiles) plan.tile_columns = kAttentionTileColumns;
  }
  const std::vector<int64_t> column_tiles = tiles_of(plan.tile_columns);
  const std::vector<int64_t> request_chunks = chunk_counts(column_tiles, plan_target_blocks_per_sm(plan, options));

  for (size_t b = 0; b < segments.size(); ++b) {
    if (column_tiles[b] == 0) continue;  // a request of the other part, or of no query tokens
    const SegmentCounts& s = segments[b];
    const int32_t tiles[3] = {static_cast<int32_t>(attention_tiles(s.sink)),
                              static_cast<int32_t>(attention_tiles(s.int2)),
                              static_cast<int32_t>(attention_tiles(s.recent))};
    const int64_t tile_cost[3] = {bf16_tile, int2_tile, bf16_tile};
    // Cut the request's tiles into request_chunks[b] chunks of about equal bytes, walking the
    // segments in order.
    const int64_t request_chunk = (request_bytes[b] + request_chunks[b] - 1) / request_chunks[b];
    std::vector<int32_t> cuts{0};
    int64_t filled = 0;
    int32_t tile = 0;
    for (int seg = 0; seg < 3; ++seg) {
      for (int32_t t = 0; t < tiles[seg]; ++t, ++tile) {
        if (filled >= request_chunk) {
          cuts.push_back(tile);
          filled = 0;
        }
        filled += tile_cost[seg];
      }
    }
    cuts.push_back(tile);
    const int32_t chunks = static_cast<int32_t>(cuts.size()) - 1;
    for (int64_t c = 0; c < column_tiles[b]; ++c) {
      const int32_t first = static_cast<int32_t>(plan.items.size());
      // The row-tiled kernel merges chunks in a second launch and needs no arrival counter.
      const int32_t counter = chunks > 1 && !plan.row_tiled() ? plan.num_counters++ : -1;
      for (int32_t k = 0; k < chunks; ++k) {
        AttentionWorkItem item;
        item.request = static_cast<int32_t>(b);
        item.column_tile = static_cast<int32_t>(c);
        item.tile_begin = cuts[k];
        item.tile_end = cuts[k + 1];
        item.first_item = first;
        item.num_chunks = chunks;
        item.counter = counter;
        plan.items.push_back(item);
      }
    }
  }
  if (plan.items.size() > size_t{INT32_MAX}) return invalid_argument("attention plan: too many work items");
  return Status::Ok();
}

// The split rule of a mixed batch (AttentionPlanOptions::mixed_split_min_bytes < 0): whether
// `whole` (every request on row tiles) cuts some long request into other chunks than
// `long_part` (the long requests alone) does, or takes more waves of the row-tiled kernel's
// resident blocks.
inline bool whole_batch_slows_long_part(const AttentionPlan& whole, const AttentionPlan& long_part,
                                        const AttentionPlanOptions& options) {
  std::vector<int32_t> long_chunks(size_t(long_part.batch_size), 0);  // 0: not a long request
  for (const AttentionWorkItem& item : long_part.items) long_chunks[item.request] = item.num_chunks;
  for (const AttentionWorkItem& item : whole.items) {
    if (long_chunks[item.request] != 0 && long_chunks[item.request] != item.num_chunks) return true;
  }
  const int64_t resident = options.num_sms * blocks_per_sm_or_default(plan_target_blocks_per_sm(whole, options));
  const auto waves = [&](const AttentionPlan& p) {
    return (int64_t(p.items.size()) * p.shape.num_kv_heads + resident - 1) / resident;
  };
  return waves(whole) > waves(long_part);
}

}  // namespace attention_plan_detail

// Plans attention for a batch whose request b has segments[b] cached tokens (sink, INT2,
// recent; the INT2 count a multiple of page_size) and query_tokens[b] query tokens (its
// newest cached tokens, causal). An empty query_tokens means decode: one query per request.
// A mixed extend batch (some requests above row_tiled_min_rows rows, others below) is planned
// as two parts (AttentionPlanOptions::split_mixed_batches, AttentionPlan::column_part).
inline Result<AttentionPlan> make_attention_plan(const AttentionShape& shape, std::span<const SegmentCounts> segments,
                                                 std::span<const int32_t> query_tokens = {},
                                                 const AttentionPlanOptions& options = {}) {
  OSCAR_RETURN_IF_ERROR(validate(shape));
  if (!query_tokens.empty() && query_tokens.size() != segments.size()) {
    return invalid_argument("query_tokens has " + std::to_string(query_tokens.size()) + " entries for " +
                            std::to_string(segments.size()) + " requests");
  }
  if (options.num_sms <= 0) return invalid_argument("num_sms must be positive");
  if (options.min_chunk_bytes <= 0) {
    return invalid_argument("min_chunk_bytes must be positive (it is " + std::to_string(options.min_chunk_bytes) + ")");
  }
  AttentionPlan plan;
  plan.shape = shape;
  plan.batch_size = static_cast<int32_t>(segments.size());
  plan.decode = query_tokens.empty();

  const int64_t int2_tile = attention_tile_bytes(shape, true);
  const int64_t bf16_tile = attention_tile_bytes(shape, false);
  std::vector<int64_t> request_bytes(segments.size());  // K and V of one KV head (each column tile reads them)
  std::vector<int64_t> request_rows(segments.size());   // query tokens x GQA group
  for (size_t b = 0; b < segments.size(); ++b) {
    const SegmentCounts& s = segments[b];
    if (s.sink < 0 || s.int2 < 0 || s.recent < 0 || s.int2 % shape.page_size != 0) {
      return invalid_argument("request " + std::to_string(b) + ": segment lengths must be >= 0 and the INT2 "
                              "segment whole pages of " + std::to_string(shape.page_size));
    }
    const int64_t length = s.sink + s.int2 + s.recent;
    if (length > int64_t{INT32_MAX}) {
      return invalid_argument("request " + std::to_string(b) + " has " + std::to_string(length) +
                              " cached tokens; GPU attention supports at most 2^31 - 1 per request");
    }
    const int64_t queries = plan.decode ? 1 : query_tokens[b];
    if (queries < 0 || queries > length || (plan.decode && length == 0)) {
      return invalid_argument("request " + std::to_string(b) + " has " + std::to_string(queries) +
                              " query tokens but " + std::to_string(length) +
                              " cached tokens (queries are the newest cached tokens)");
    }
    plan.num_query_tokens += queries;
    request_rows[b] = queries * shape.group_size();
    request_bytes[b] = attention_tiles(s.sink) * bf16_tile + attention_tiles(s.int2) * int2_tile +
                       attention_tiles(s.recent) * bf16_tile;
  }

  if (segments.empty()) return plan;

  // A mixed batch: the long requests on the row-tiled kernel, the short ones on the column
  // kernel (each part's chunks sized for its own kernel's waves, as the parts run one after
  // the other).
  const int64_t max_rows = *std::max_element(request_rows.begin(), request_rows.end());
  if (!plan.decode && options.split_mixed_batches && shape.head_dim <= kAttentionRowTiledMaxHeadDim &&
      max_rows > options.row_tiled_min_rows) {
    std::vector<int64_t> long_rows(segments.size()), short_rows(segments.size());
    int64_t short_bytes = 0;  // over every KV head
    for (size_t b = 0; b < segments.size(); ++b) {
      const bool is_long = request_rows[b] > options.row_tiled_min_rows;
      (is_long ? long_rows : short_rows)[b] = request_rows[b];
      if (!is_long && request_rows[b] > 0) short_bytes += request_bytes[b] * shape.num_kv_heads;
    }
    if (short_bytes > 0 && (options.mixed_split_min_bytes < 0 || short_bytes >= options.mixed_split_min_bytes)) {
      AttentionPlan long_part = plan;  // the batch's shape, size and query count; no items yet
      OSCAR_RETURN_IF_ERROR(attention_plan_detail::plan_items(long_part, segments, long_rows, request_bytes, options));
      if (options.mixed_split_min_bytes < 0) {
        AttentionPlan whole = plan;
        OSCAR_RETURN_IF_ERROR(attention_plan_detail::plan_items(whole, segments, request_rows, request_bytes, options));
        if (!attention_plan_detail::whole_batch_slows_long_part(whole, long_part, options)) return whole;
      }
      AttentionPlan part = plan;
      OSCAR_RETURN_IF_ERROR(attention_plan_detail::plan_items(part, segments, short_rows, request_bytes, options));
      long_part.column_part = std::make_shared<const AttentionPlan>(std::move(part));
      return long_part;
    }
  }
  OSCAR_RETURN_IF_ERROR(attention_plan_detail::plan_items(plan, segments, request_rows, request_bytes, options));
  return plan;
}

}  // namespace oscar
