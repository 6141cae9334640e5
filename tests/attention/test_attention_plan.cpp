// The host plan of GPU attention: chunks cover every tile of every request exactly once, in
// order; split requests get one arrival counter; chunk sizes follow bytes (INT2 chunks hold
// more tokens than BF16 ones); bad shapes and lengths are refused with a clear message.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "oscar/attention/attention_plan.hpp"

using namespace oscar;

namespace {

AttentionShape headline() { return {32, 8, 128, 128, 16}; }

void check_cover(const AttentionPlan& plan, const std::vector<SegmentCounts>& lengths,
                 const std::vector<int32_t>& queries) {
  size_t i = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    const int64_t tiles = attention_tiles(lengths[b].sink) + attention_tiles(lengths[b].int2) +
                          attention_tiles(lengths[b].recent);
    const int64_t q = queries.empty() ? 1 : queries[b];
    const int64_t column_tiles = (q * plan.shape.group_size() + plan.tile_columns - 1) / plan.tile_columns;
    for (int64_t c = 0; c < column_tiles; ++c) {
      REQUIRE(i < plan.items.size());
      const AttentionWorkItem first = plan.items[i];
      CHECK(first.request == int32_t(b));
      CHECK(first.column_tile == c);
      CHECK(first.tile_begin == 0);
      CHECK(first.first_item == int32_t(i));
      int32_t end = 0;
      for (int32_t k = 0; k < first.num_chunks; ++k, ++i) {
        const AttentionWorkItem& item = plan.items[i];
        CHECK(item.tile_begin == end);
        CHECK(item.tile_end > item.tile_begin);
        CHECK(item.num_chunks == first.num_chunks);
        CHECK(item.counter == first.counter);
        // Row-tiled plans merge in a second launch: no arrival counters.
        CHECK((item.counter >= 0) == (first.num_chunks > 1 && !plan.row_tiled()));
        end = item.tile_end;
      }
      CHECK(end == tiles);
    }
  }
  CHECK(i == plan.items.size());
}

}  // namespace

TEST_CASE("chunks cover every tile once, in order") {
  const std::vector<SegmentCounts> lengths = {{1, 0, 0}, {64, 32768, 300}, {16, 1024, 33}, {64, 0, 12}};
  auto plan = make_attention_plan(headline(), lengths);
  REQUIRE(plan.ok());
  CHECK(plan->decode);
  CHECK(plan->tile_columns == kAttentionTileColumns);  // a decode step is one tile per KV head
  check_cover(*plan, lengths, {});
  CHECK(plan->num_counters >= 1);  // the 32K request is split
  CHECK(plan->workspace_bytes() >= plan->items.size() * sizeof(AttentionWorkItem));

  // 7 queries x 4 heads = 28 columns: 4 tiles, 2 paired ones (paired whatever the chunk count:
  // the next test case checks where the plan pairs).
  const std::vector<int32_t> queries = {1, 7, 3, 2};
  AttentionPlanOptions paired;
  paired.paired_max_chunks_per_tile = INT32_MAX;
  auto extend = make_attention_plan(headline(), lengths, queries, paired);
  REQUIRE(extend.ok());
  CHECK(!extend->decode);
  check_cover(*extend, lengths, queries);
  CHECK(!extend->row_tiled());  // 28 rows at most: the decode kernel's column tiles, two per pass
  CHECK(extend->paired_tiles());
  CHECK(extend->tile_columns == kAttentionPairedTileColumns);
  CHECK(extend->rotated_q_bytes() == 0);
  CHECK(extend->partial_o_bytes() >= extend->items.size() * 8 * size_t{kAttentionPairedTileColumns} * 128 * sizeof(float));
  CHECK(extend->partial_lse_bytes() >= extend->items.size() * 8 * size_t{kAttentionPairedTileColumns} * sizeof(float));

  // At most 8 rows in every request: one tile holds them, so no pairing (its second tile would
  // be empty everywhere); with the option off, single tiles whatever the rows.
  const std::vector<int32_t> two = {1, 2, 1, 2};
  auto few = make_attention_plan(headline(), lengths, two);
  REQUIRE(few.ok());
  CHECK(few->tile_columns == kAttentionTileColumns);
  check_cover(*few, lengths, two);
  AttentionPlanOptions unpaired = paired;
  unpaired.paired_column_tiles = false;
  auto single = make_attention_plan(headline(), lengths, queries, unpaired);
  REQUIRE(single.ok());
  CHECK(single->tile_columns == kAttentionTileColumns);
  check_cover(*single, lengths, queries);

  // 80 rows in one request: the row-tiled kernel's 64-row tiles (two for that request, one for
  // each other), no arrival counters, and room for the rotated queries (27 tokens x 32 heads).
  // (Unsplit: the next test case checks where a mixed batch is split.)
  const std::vector<int32_t> many = {1, 20, 4, 2};
  AttentionPlanOptions whole;
  whole.split_mixed_batches = false;
  auto rows = make_attention_plan(headline(), lengths, many, whole);
  REQUIRE(rows.ok());
  CHECK(!rows->column_part);
  CHECK(rows->row_tiled());
  CHECK(rows->tile_columns == kAttentionRowTile);
  CHECK(rows->num_query_tokens == 27);
  CHECK(rows->num_counters == 0);
  CHECK(rows->rotated_q_bytes() >= size_t{27} * 32 * 128 * sizeof(float));
  check_cover(*rows, lengths, many);

  // A lower threshold puts the 28-row plan on row tiles too (tests use it to run the
  // row-tiled kernel on short extends).
  AttentionPlanOptions low;
  low.row_tiled_min_rows = 8;
  low.split_mixed_batches = false;  // (a 4-row request beside 28 rows: the default may split them)
  auto short_rows = make_attention_plan(headline(), lengths, queries, low);
  REQUIRE(short_rows.ok());
  CHECK(short_rows->row_tiled());
  check_cover(*short_rows, lengths, queries);

  // d = 256, or the option off: the column tiles.
  AttentionShape wide = headline();
  wide.head_dim = wide.quant_group_size = 256;
  auto d256 = make_attention_plan(wide, lengths, many);
  REQUIRE(d256.ok());
  CHECK(!d256->column_part);
  CHECK(!d256->row_tiled());
  CHECK(d256->tile_columns == kAttentionTileColumns);  // no paired tiles above d = 128 either
  check_cover(*d256, lengths, many);
  AttentionPlanOptions columns = paired;
  columns.row_tiled_min_rows = INT32_MAX;
  auto off = make_attention_plan(headline(), lengths, many, columns);
  REQUIRE(off.ok());
  CHECK(off->tile_columns == kAttentionPairedTileColumns);
  check_cover(*off, lengths, many);
  columns.paired_column_tiles = false;
  auto off_single = make_attention_plan(headline(), lengths, many, columns);
  REQUIRE(off_single.ok());
  CHECK(off_single->tile_columns == kAttentionTileColumns);
  check_cover(*off_single, lengths, many);
}

TEST_CASE("a mixed batch: long requests on row tiles, the short ones on column tiles after them") {
  // Continuous batching with chunked prefill: one request appends a 512-token chunk to a 32K
  // prefix, 31 others decode over 8K (4 rows each). Unsplit, the row-tiled kernel would give
  // each decode a 64-row tile of which 4 rows are used; split, they run on the column kernel.
  std::vector<SegmentCounts> lengths(32, SegmentCounts{64, 8192 - 320, 256});
  lengths[5] = SegmentCounts{64, 32768 - 320, 256 + 512};
  std::vector<int32_t> queries(32, 1);
  queries[5] = 512;
  const AttentionPlanOptions split;  // the default: split where the whole plan would slow the long request
  CHECK(split.split_mixed_batches);
  auto plan = make_attention_plan(headline(), lengths, queries, split);
  REQUIRE(plan.ok());
  REQUIRE(plan->column_part);
  const AttentionPlan& part = *plan->column_part;
  CHECK(plan->row_tiled());
  CHECK(part.tile_columns == kAttentionTileColumns);  // 4 rows per request: one tile, unpaired
  CHECK(!part.column_part);
  CHECK(!part.decode);
  CHECK(part.batch_size == plan->batch_size);
  // The row-tiled part rotates every query row of the batch (its rotated-q buffer is indexed by
  // the batch's qo_indptr), so it needs the batch's count.
  CHECK(plan->num_query_tokens == 32 - 1 + 512);
  // Each part covers its own requests (the others' query counts zeroed) and nothing else.
  std::vector<int32_t> long_only(32, 0), short_only = queries;
  long_only[5] = 512;
  short_only[5] = 0;
  check_cover(*plan, lengths, long_only);
  check_cover(part, lengths, short_only);
  CHECK(plan->num_counters == 0);  // the row-tiled kernel merges in its own launch
  // The column part's workspace starts after the row-tiled part's rotated queries.
  CHECK(plan->own_workspace_bytes() >= plan->rotated_q_bytes() + plan->partial_o_bytes());
  CHECK(plan->rotated_q_bytes() >= size_t{543} * 32 * 128 * sizeof(float));

  // Short requests of 3 new tokens (12 rows) run paired column tiles in their part.
  std::vector<int32_t> verify = queries;
  for (size_t b = 0; b < verify.size(); ++b) verify[b] = b == 5 ? 512 : 3;
  auto paired = make_attention_plan(headline(), lengths, verify, split);
  REQUIRE(paired.ok());
  REQUIRE(paired->column_part);
  CHECK(paired->column_part->paired_tiles());

  // The option off: one row-tiled plan over the whole batch. By default (the chunks-and-waves
  // rule) one decode of 8K beside the chunk stays in one plan: the chunk's 32 row tiles of
  // each KV head leave one of the 33 slots of a wave (132 SMs x 2 blocks / 8 KV heads) free,
  // and the decode takes it. Two decodes would make the whole plan cut the chunk's request
  // into 4 chunks (its bytes are then planned against the decodes' too), so they split, as
  // 3 and 4 do. Measured on an H100 (docs/benchmarks.md): 1 decode 925 us whole against 969
  // split; 2 decodes 1014 whole against 973 split.
  AttentionPlanOptions off;
  off.split_mixed_batches = false;
  auto whole = make_attention_plan(headline(), lengths, queries, off);
  REQUIRE(whole.ok());
  CHECK(!whole->column_part);
  CHECK(whole->row_tiled());
  check_cover(*whole, lengths, queries);
  for (const int decodes : {1, 2, 3, 4}) {
    CAPTURE(decodes);
    std::vector<SegmentCounts> few(decodes + 1, SegmentCounts{64, 8192 - 320, 256});
    few[0] = lengths[5];
    std::vector<int32_t> few_queries(decodes + 1, 1);
    few_queries[0] = 512;
    auto by_default = make_attention_plan(headline(), few, few_queries);
    REQUIRE(by_default.ok());
    REQUIRE(static_cast<bool>(by_default->column_part) == (decodes >= 2));
    if (by_default->column_part) {
      std::vector<int32_t> chunk_only(decodes + 1, 0), decodes_only(decodes + 1, 1);
      chunk_only[0] = 512;
      decodes_only[0] = 0;
      check_cover(*by_default, few, chunk_only);
      check_cover(*by_default->column_part, few, decodes_only);
    } else {
      check_cover(*by_default, few, few_queries);
    }
  }
  // d = 64 with 3 KV heads (SmolLM2-style): the chunk's 24 row tiles per KV head cut into 3
  // chunks leave 16 of the wave's 88 slots free, so up to 16 decodes of 8K ride in the whole
  // plan; 24 make it cut the chunk's request into other chunks, and split (H100: 16 decodes
  // 260 us whole against 287 split; 24: 376 whole against 292 split).
  AttentionShape small = headline();
  small.num_qo_heads = 9;
  small.num_kv_heads = 3;
  small.head_dim = 64;
  small.quant_group_size = 64;
  for (const int decodes : {1, 8, 16, 24, 63}) {
    CAPTURE(decodes);
    std::vector<SegmentCounts> few(decodes + 1, SegmentCounts{64, 8192 - 320, 256});
    few[0] = lengths[5];
    std::vector<int32_t> few_queries(decodes + 1, 1);
    few_queries[0] = 512;
    auto by_default = make_attention_plan(small, few, few_queries);
    REQUIRE(by_default.ok());
    CHECK(static_cast<bool>(by_default->column_part) == (decodes > 16));
  }
  // mixed_split_min_bytes >= 0: the short requests' bytes over every KV head decide instead.
  AttentionPlanOptions high = split;
  int64_t short_bytes = 0;
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (b == 5) continue;
    const AttentionShape h = headline();
    short_bytes += h.num_kv_heads * (attention_tiles(lengths[b].sink) * attention_tile_bytes(h, false) +
                                     attention_tiles(lengths[b].int2) * attention_tile_bytes(h, true) +
                                     attention_tiles(lengths[b].recent) * attention_tile_bytes(h, false));
  }
  high.mixed_split_min_bytes = short_bytes + 1;
  auto below = make_attention_plan(headline(), lengths, queries, high);
  REQUIRE(below.ok());
  CHECK(!below->column_part);
  high.mixed_split_min_bytes = short_bytes;
  auto at = make_attention_plan(headline(), lengths, queries, high);
  REQUIRE(at.ok());
  CHECK(at->column_part);

  // Every request long, or every request short: nothing to split. d = 256 has no row-tiled
  // kernel: one column plan.
  std::vector<int32_t> all_long(32, 16);
  auto longs = make_attention_plan(headline(), lengths, all_long, split);
  REQUIRE(longs.ok());
  CHECK(!longs->column_part);
  CHECK(longs->row_tiled());
  AttentionShape wide = headline();
  wide.head_dim = wide.quant_group_size = 256;
  auto d256 = make_attention_plan(wide, lengths, queries, split);
  REQUIRE(d256.ok());
  CHECK(!d256->column_part);
  check_cover(*d256, lengths, queries);
}

TEST_CASE("paired tiles where the single-tile plan would cut few chunks per tile") {
  // One request of 32K verifying 4 tokens: a single-tile plan cuts each of its two tiles into
  // ~24 chunks, so it stays on single tiles (the paired kernel's longer prologue and tail lose
  // there); sixteen such requests get one chunk per tile and are paired. The threshold is an
  // option.
  AttentionPlanOptions options;
  options.target_blocks_per_sm = 3;
  options.target_paired_blocks_per_sm = 2;
  const std::vector<int32_t> q1(1, 4), q16(16, 4);
  const std::vector<SegmentCounts> one(1, SegmentCounts{64, 32768 - 320, 256}), sixteen(16, one[0]);
  auto single = make_attention_plan(headline(), one, q1, options);
  auto batch = make_attention_plan(headline(), sixteen, q16, options);
  REQUIRE(single.ok());
  REQUIRE(batch.ok());
  CHECK(single->tile_columns == kAttentionTileColumns);
  CHECK(single->items.size() > 8 * 2);  // more than 8 chunks for each of the 2 tiles
  CHECK(batch->tile_columns == kAttentionPairedTileColumns);
  check_cover(*single, one, q1);
  check_cover(*batch, sixteen, q16);
  options.paired_max_chunks_per_tile = INT32_MAX;
  auto forced = make_attention_plan(headline(), one, q1, options);
  REQUIRE(forced.ok());
  CHECK(forced->tile_columns == kAttentionPairedTileColumns);
  check_cover(*forced, one, q1);
}

TEST_CASE("paired-tile plans size their chunks for the paired kernel's occupancy") {
  // Sixteen requests of 32K verifying 4 drafted tokens each (16 rows per KV head): the chunk
  // count follows target_paired_blocks_per_sm, not the decode kernel's target.
  const std::vector<SegmentCounts> lengths(16, SegmentCounts{64, 32768 - 320, 256});
  const std::vector<int32_t> queries(16, 4);
  AttentionPlanOptions few_paired, many_paired;
  few_paired.target_blocks_per_sm = many_paired.target_paired_blocks_per_sm = 4;
  few_paired.target_paired_blocks_per_sm = many_paired.target_blocks_per_sm = 1;
  auto a = make_attention_plan(headline(), lengths, queries, few_paired);
  auto b = make_attention_plan(headline(), lengths, queries, many_paired);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->paired_tiles());
  CHECK(b->paired_tiles());
  CHECK(b->items.size() > a->items.size());
  check_cover(*a, lengths, queries);
  check_cover(*b, lengths, queries);
}

TEST_CASE("chunks are sized in bytes: an INT2 chunk holds ~7x the tokens of a BF16 chunk") {
  AttentionPlanOptions options;
  options.num_sms = 132;
  const std::vector<SegmentCounts> int2 = {{0, 65536, 0}}, bf16 = {{65536, 0, 0}};
  auto a = make_attention_plan(headline(), int2, {}, options);
  auto b = make_attention_plan(headline(), bf16, {}, options);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  // Same request length, same target number of blocks: the same parallelism for both...
  CHECK(a->items.size() == b->items.size());
  // ...and at a fixed chunk size in bytes, 512/72 = 7.1x fewer INT2 chunks.
  AttentionPlanOptions fixed = options;
  // 32 MB of BF16 K+V / 1 MB = 32 chunks: below the kMaxAttentionChunks cap, so the
  // byte size alone decides; 4.7 MB of INT2 pages make 5 chunks.
  fixed.min_chunk_bytes = 1 << 20;
  fixed.target_blocks_per_sm = 8;
  auto c = make_attention_plan(headline(), int2, {}, fixed);
  auto d = make_attention_plan(headline(), bf16, {}, fixed);
  REQUIRE(c.ok());
  REQUIRE(d.ok());
  const double ratio = double(d->items.size()) / double(c->items.size());
  CHECK(ratio > 5.0);
  CHECK(ratio < 8.0);
}

// How full the waves of the target blocks are, the last one included (1: whole waves).
static double wave_fill(int64_t blocks, int64_t slots) {
  const double waves = double(blocks) / double(slots);
  return waves / std::ceil(waves);
}

TEST_CASE("a batch of equal requests fills its waves of the target blocks") {
  for (const int32_t blocks_per_sm : {1, 2, 3, 4}) {
    AttentionPlanOptions options;
    options.num_sms = 132;
    options.target_blocks_per_sm = blocks_per_sm;
    const int64_t slots = int64_t{options.num_sms} * blocks_per_sm;
    for (const int64_t length : {int64_t{8192}, int64_t{32768}}) {
      for (const int batch : {1, 16, 40, 50, 64, 100, 300}) {
        const std::vector<SegmentCounts> lengths(batch, SegmentCounts{64, length - 320, 256});
        auto plan = make_attention_plan(headline(), lengths, {}, options);
        REQUIRE(plan.ok());
        check_cover(*plan, lengths, {});
        CAPTURE(blocks_per_sm);
        CAPTURE(length);
        CAPTURE(batch);
        const int64_t blocks = int64_t(plan->items.size()) * headline().num_kv_heads;
        const int64_t request_bytes = attention_tiles(64) * attention_tile_bytes(headline(), false) +
                                      attention_tiles(length - 320) * attention_tile_bytes(headline(), true) +
                                      attention_tiles(256) * attention_tile_bytes(headline(), false);
        const int64_t chunks_per_request =
            std::min<int64_t>(kMaxAttentionChunks, std::max<int64_t>(1, request_bytes / options.min_chunk_bytes));
        if (int64_t{batch} * headline().num_kv_heads <= slots) {
          // The requests fit in one wave: one wave, at least half used, as far as the cap of
          // kMaxAttentionChunks chunks per request and the shortest chunk allow. (Half, not the
          // two thirds rounding to the nearest gave: where that spills past the wave the plan
          // rounds down, 1.65 chunks per request to 1 at B = 40, 8K, 4 blocks per SM: 0.61 of
          // the wave, which the measured 0.73-wave plan beating the 1.09-wave one favours.)
          CHECK(blocks <= slots);
          const int64_t usable = std::min<int64_t>(slots, int64_t{batch} * headline().num_kv_heads * chunks_per_request);
          CHECK(2 * blocks >= usable);
        } else {
          // More requests than a wave has blocks: chunks so that the last wave is mostly full,
          // not a few blocks past a whole wave.
          CHECK(wave_fill(blocks, slots) >= 0.75);
          CHECK(wave_fill(blocks, slots) >= wave_fill(int64_t{batch} * headline().num_kv_heads, slots));
        }
      }
    }
  }
}

// Work items of the plan for `batch` equal decode requests of `length` tokens (sink 64, window
// 256) on 132 SMs at `blocks_per_sm`.
static size_t equal_batch_items(const AttentionShape& shape, int batch, int64_t length, int32_t blocks_per_sm) {
  AttentionPlanOptions options;
  options.num_sms = 132;
  options.target_blocks_per_sm = blocks_per_sm;
  const std::vector<SegmentCounts> lengths(batch, SegmentCounts{64, length - 320, 256});
  auto plan = make_attention_plan(shape, lengths, {}, options);
  REQUIRE(plan.ok());
  check_cover(*plan, lengths, {});
  return plan->items.size();
}

TEST_CASE("the measured spills past a wave are planned away") {
  // d = 64, 9 / 3 heads, B = 64, 8K: 2 chunks per request (0.73 waves), not 3 (1.09).
  CHECK(equal_batch_items({9, 3, 64, 64, 16}, 64, 8192, 4) == 128);
  // d = 128, 32 / 8 heads, B = 64, 8K: 3 chunks per request (3.88 waves), not 1 (1.29).
  CHECK(equal_batch_items(headline(), 64, 8192, 3) == 192);
  // d = 128, B = 16, 32K: 3 chunks per request (0.97 waves), as before.
  CHECK(equal_batch_items(headline(), 16, 32768, 3) == 48);
}

TEST_CASE("bad shapes and lengths are refused") {
  AttentionShape s = headline();
  s.num_qo_heads = 30;
  CHECK(make_attention_plan(s, std::vector<SegmentCounts>{{1, 0, 0}}).status().message().find("multiple") !=
        std::string::npos);
  s = headline();
  s.quant_group_size = 32;
  CHECK(make_attention_plan(s, std::vector<SegmentCounts>{{1, 0, 0}}).status().code() == StatusCode::kUnsupported);
  s = headline();
  s.page_size = 12;
  CHECK(make_attention_plan(s, std::vector<SegmentCounts>{{1, 0, 0}}).status().message().find("page_size 12") !=
        std::string::npos);
  CHECK(make_attention_plan(headline(), std::vector<SegmentCounts>{{0, 10, 0}}).status().message().find("whole pages") !=
        std::string::npos);
  CHECK(make_attention_plan(headline(), std::vector<SegmentCounts>{{0, 0, 0}}).status().message().find("0 cached") !=
        std::string::npos);
  const std::vector<int32_t> too_many = {5};
  CHECK(make_attention_plan(headline(), std::vector<SegmentCounts>{{4, 0, 0}}, too_many).status().message().find(
            "5 query tokens") != std::string::npos);
  AttentionPlanOptions options;
  options.num_sms = 0;
  CHECK(make_attention_plan(headline(), std::vector<SegmentCounts>{{4, 0, 0}}, {}, options).status().message().find(
            "num_sms") != std::string::npos);
  options = {};
  options.min_chunk_bytes = 0;  // would divide by zero for a batch of no bytes
  CHECK(make_attention_plan(headline(), std::vector<SegmentCounts>{{4, 0, 0}}, {}, options).status().message().find(
            "min_chunk_bytes") != std::string::npos);
}
