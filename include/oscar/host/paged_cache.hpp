// The CPU reference of the whole paged OSCAR cache: a usable CPU KV cache and the oracle for
// every GPU test. It owns its page pools and page tables, and exposes them as the same
// non-owning views (PagedKvRef) that the GPU kernels take.
//
// One append step, the way an engine runs it:
//   auto plan = cache.plan_append(requests, new_tokens);  // reserves slots, all layers
//   for each layer: cache.write(layer, *plan, k, v);      // rotate, store, demote
//                   cache.decode(layer, ...) / extend()   // attention sees the new tokens
//   cache.finish(*plan);                                  // frees demoted BF16 pages
// Each request holds a BF16 sink (its first sink_tokens tokens), whole INT2 pages, and a BF16
// recent window of recent_tokens .. recent_tokens + page_size - 1 tokens (segment_counts()).
// Tokens that a step pushes past the window go straight to INT2, with the bytes a later
// demotion would have written. Full pages shared by forked requests are never rewritten.
#pragma once

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "oscar/core/aligned_buffer.hpp"
#include "oscar/core/numeric.hpp"
#include "oscar/core/status.hpp"
#include "oscar/host/attention_reference.hpp"
#include "oscar/host/page_allocator.hpp"
#include "oscar/kv/paged_kv.hpp"
#include "oscar/kv/write_params.hpp"
#include "oscar/quant/clip.hpp"
#include "oscar/quant/format.hpp"
#include "oscar/quant/row.hpp"
#include "oscar/rotate/dense.hpp"

namespace oscar::host {

using RequestId = int32_t;

struct CacheConfig {
  int32_t num_layers = 1;
  int32_t num_qo_heads = 1;
  int32_t num_kv_heads = 1;
  int32_t head_dim = 128;
  int32_t quant_group_size = 0;  // 0: one group per row (the whole head)
  int32_t page_size = 16;        // tokens per page, BF16 and INT2 alike
  int32_t sink_tokens = 64;      // first tokens of a request kept in BF16
  int32_t recent_tokens = 256;   // newest tokens kept in BF16
  int32_t num_int2_pages = 0;    // pool capacities, shared by all requests
  int32_t num_bf16_pages = 0;
  int32_t max_requests = 1024;
  // V arrives already multiplied by R_V (the engine folded R_V into W_V): store it as is.
  bool values_prerotated = false;
  // false: the pools live on the GPU (docs/gpu.md) and the cache only keeps the books:
  // plan_append, finish, cancel, fork_request (which then reports the BF16 pages to copy),
  // page_tables and segments work as always; write, decode and extend, which need the pool
  // bytes, refuse; no host memory is allocated for the pools.
  bool host_pools = true;

  int32_t effective_quant_group_size() const {
    return quant_group_size == 0 ? head_dim : quant_group_size;
  }
  Int2Layout int2_layout() const { return {head_dim, effective_quant_group_size(), page_size}; }
  // One layer of one INT2 pool (K or V), packed [page][kv_head][block]: bytes; of one BF16 pool,
  // [page][kv_head][slot][head_dim]: elements. The CPU cache's pools and the device pools an
  // engine allocates (device_cache_layout.hpp) are these sizes.
  int64_t int2_pool_layer_bytes() const {
    return int64_t{num_int2_pages} * num_kv_heads * int2_layout().block_bytes();
  }
  int64_t bf16_pool_layer_elements() const { return int64_t{num_bf16_pages} * num_kv_heads * page_size * head_dim; }
};

// What OSCAR fits offline for one layer. An empty rotation is the identity.
struct LayerQuantizer {
  std::vector<float> k_rotation;  // R_K, float32 [head_dim, head_dim] row-major, orthogonal
  std::vector<float> v_rotation;  // R_V, same
  float k_clip_ratio = 1.0f;      // rho_K; >= 1 disables clipping
  float v_clip_ratio = 1.0f;      // rho_V
};

struct AttentionOptions {
  bool q_rotated = false;       // q already multiplied by R_K
  bool output_rotated = false;  // leave the output multiplied by R_V (R_Vᵀ folded into W_O)
  float sm_scale = 0.0f;        // 0: 1/sqrt(head_dim)
  int32_t split_tokens = 512;   // keys per partial state (split-KV)
  // The CPU attention path decode() and extend() run; empty: attention_reference, the scalar
  // oracle of the GPU kernels. blocked_attention() (host/attention_blocked.hpp) gives the
  // fast path with the same contract. A hook rather than an include: the blocked path needs
  // Eigen, and this header is also compiled by nvcc for the GPU tests, which must not.
  std::function<Status(const AttentionParams&)> path;
};

// The slots of one append step. The same mapping drives a GPU write kernel.
struct WritePlan {
  uint64_t id = 0;
  std::vector<RequestId> requests;
  std::vector<int32_t> token_indptr;  // [requests + 1]: rows of k/v per request
  std::vector<TokenSlot> slots;       // [token_indptr.back()]
  std::vector<PageDemotion> demotions;
  std::vector<int32_t> bf16_pages_to_release;  // after every layer is written
  std::vector<bool> layer_written;
};

// A BF16 page that fork_request gave the child as a copy of the parent's partial page (every
// layer, K and V, all num_kv_heads): with device pools the engine copies it before the next step.
struct PageCopy {
  int32_t from = 0;
  int32_t to = 0;
};

// The three page tables of a batch, owned; views are built on demand so moving is safe.
struct BatchTables {
  struct Table {
    std::vector<int32_t> indptr{0};
    std::vector<int32_t> indices;
    std::vector<int32_t> last_page_len;
  };
  Table sink, int2, recent;
  int32_t page_size = 0;

  static PageTableRef ref(const Table& table, int32_t page_size) {
    return {table.indptr.data(), table.indices.data(), table.last_page_len.data(),
            static_cast<int32_t>(table.last_page_len.size()), page_size};
  }
};

struct PoolUsage {
  int32_t int2_pages_used = 0;
  int32_t int2_pages_total = 0;
  int32_t bf16_pages_used = 0;
  int32_t bf16_pages_total = 0;
  int32_t int2_pages_shared = 0;  // pages with more than one holder
  int32_t bf16_pages_shared = 0;
};

inline Status validate(const CacheConfig& config) {
  OSCAR_RETURN_IF_ERROR(validate(config.int2_layout()));
  if (config.num_layers <= 0) return invalid_argument("num_layers must be positive");
  if (config.num_kv_heads <= 0 || config.num_qo_heads <= 0 ||
      config.num_qo_heads % config.num_kv_heads != 0) {
    return invalid_argument("num_qo_heads (" + std::to_string(config.num_qo_heads) +
                            ") must be a positive multiple of num_kv_heads (" +
                            std::to_string(config.num_kv_heads) + ")");
  }
  if (config.sink_tokens < 0 || config.recent_tokens < 0) {
    return invalid_argument("sink_tokens and recent_tokens must be >= 0");
  }
  if (config.num_int2_pages < 0 || config.num_bf16_pages < 0 || config.max_requests <= 0) {
    return invalid_argument("pool sizes must be >= 0 and max_requests > 0");
  }
  return Status::Ok();
}

namespace detail {

inline Status check_rotation(const std::vector<float>& r, int32_t d, size_t layer, const char* name) {
  const std::string what = "layer " + std::to_string(layer) + " " + name;
  if (r.empty()) return Status::Ok();
  if (r.size() != static_cast<size_t>(d) * d) {
    return invalid_argument(what + " has " + std::to_string(r.size()) + " entries, expected " + std::to_string(d) +
                            "x" + std::to_string(d));
  }
  double worst = 0.0;
  for (int32_t i = 0; i < d; ++i) {
    for (int32_t j = 0; j < d; ++j) {
      double dot = 0.0;
      for (int32_t k = 0; k < d; ++k) dot += double{r[i * d + k]} * r[j * d + k];
      worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  if (!(worst <= 1e-4)) {
    return invalid_argument(what + " is not orthogonal: max |R·Rᵀ - I| = " + std::to_string(worst));
  }
  return Status::Ok();
}

}  // namespace detail

// One quantizer per layer, each rotation empty or an orthogonal head_dim x head_dim matrix,
// finite clip ratios: what PagedCache::create and the device layout (device_cache_layout.hpp)
// accept.
inline Status validate_layer_quantizers(const CacheConfig& config, std::span<const LayerQuantizer> layers) {
  if (static_cast<int64_t>(layers.size()) != config.num_layers) {
    return invalid_argument("got " + std::to_string(layers.size()) + " layer quantizers for num_layers = " +
                            std::to_string(config.num_layers));
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    OSCAR_RETURN_IF_ERROR(detail::check_rotation(layers[l].k_rotation, config.head_dim, l, "k_rotation"));
    OSCAR_RETURN_IF_ERROR(detail::check_rotation(layers[l].v_rotation, config.head_dim, l, "v_rotation"));
    if (!std::isfinite(layers[l].k_clip_ratio) || !std::isfinite(layers[l].v_clip_ratio)) {
      return invalid_argument("layer " + std::to_string(l) + ": clip ratio is not finite");
    }
  }
  return Status::Ok();
}

class PagedCache {
 public:
  static Result<PagedCache> create(const CacheConfig& config, std::vector<LayerQuantizer> layers) {
    OSCAR_RETURN_IF_ERROR(validate(config));
    OSCAR_RETURN_IF_ERROR(validate_layer_quantizers(config, layers));
    PagedCache cache;
    cache.config_ = config;
    cache.layout_ = config.int2_layout();
    cache.layers_ = std::move(layers);
    cache.int2_pages_ = PageAllocator(config.num_int2_pages);
    cache.bf16_pages_ = PageAllocator(config.num_bf16_pages);
    cache.sequences_.resize(config.max_requests);
    const size_t int2_bytes = config.host_pools ? static_cast<size_t>(config.int2_pool_layer_bytes()) : 0;
    const size_t bf16_bytes =
        config.host_pools ? static_cast<size_t>(config.bf16_pool_layer_elements()) * sizeof(bf16_t) : 0;
    for (int32_t l = 0; l < config.num_layers; ++l) {
      LayerPools pools{AlignedBuffer(int2_bytes), AlignedBuffer(int2_bytes),
                       AlignedBuffer(bf16_bytes), AlignedBuffer(bf16_bytes)};
      if (!pools.k_int2.allocated() || !pools.v_int2.allocated() || !pools.k_bf16.allocated() ||
          !pools.v_bf16.allocated()) {  // an empty buffer (host_pools = false) counts as allocated
        return resource_exhausted("could not allocate the page pools of layer " + std::to_string(l));
      }
      cache.pools_.push_back(std::move(pools));
      const int32_t d = config.head_dim;
      cache.k_clip_rank_.push_back(clip_rank(cache.layers_[l].k_clip_ratio, d));
      cache.v_clip_rank_.push_back(clip_rank(cache.layers_[l].v_clip_ratio, d));
    }
    return Result<PagedCache>(std::move(cache));  // spelled out: nvcc lacks the C++20 implicit move here
  }

  const CacheConfig& config() const { return config_; }
  const Int2Layout& int2_layout() const { return layout_; }
  // layer in 0..num_layers-1 (checked in debug builds; the Status paths check it always).
  const LayerQuantizer& layer_quantizer(int32_t layer) const {
    assert(check_layer(layer).ok());
    return layers_[layer];
  }
  std::span<const LayerQuantizer> layer_quantizers() const { return layers_; }

  // ---- requests -------------------------------------------------------------------------

  Result<RequestId> add_request() {
    OSCAR_RETURN_IF_ERROR(require_no_plan("add_request"));
    for (RequestId id = 0; id < static_cast<RequestId>(sequences_.size()); ++id) {
      if (!sequences_[id].alive) {
        sequences_[id] = Sequence{};
        sequences_[id].alive = true;
        return id;
      }
    }
    return resource_exhausted("all " + std::to_string(sequences_.size()) +
                              " request slots are in use");
  }

  // A new request with the parent's tokens. Full pages (every INT2 page, full BF16 pages) are
  // shared by reference count and never written again; a partially filled BF16 page is copied
  // because the next append writes into it.
  // With host pools the partial pages are copied here (and, if `copies` is given, listed
  // too); without them `copies` is required and receives the copies the engine must make.
  Result<RequestId> fork_request(RequestId parent, std::vector<PageCopy>* copies = nullptr) {
    OSCAR_RETURN_IF_ERROR(require_no_plan("fork_request"));
    OSCAR_RETURN_IF_ERROR(check_request(parent));
    if (!config_.host_pools && !copies) {
      return invalid_argument("fork_request: the pools live on the device (host_pools = false); pass `copies` "
                              "to receive the BF16 pages to copy");
    }
    if (copies) copies->clear();
    auto child = add_request();
    if (!child.ok()) return child.status();
    const Sequence& from = sequences_[parent];
    Sequence seq = from;  // copies page lists and lengths
    seq.sink_pages.clear();
    seq.recent_pages.clear();
    std::vector<int32_t> copied;  // rolled back if the pool runs out
    auto share_or_copy = [&](const std::vector<int32_t>& pages, int64_t tokens,
                             std::vector<int32_t>& into) -> Status {
      for (size_t i = 0; i < pages.size(); ++i) {
        const bool full = static_cast<int64_t>(i + 1) * config_.page_size <= tokens;
        if (full) {
          bf16_pages_.retain(pages[i]);
          into.push_back(pages[i]);
          continue;
        }
        auto page = bf16_pages_.allocate("BF16");
        if (!page.ok()) return page.status();
        if (config_.host_pools) copy_bf16_page(pages[i], *page);
        if (copies) copies->push_back({pages[i], *page});
        copied.push_back(*page);
        into.push_back(*page);
      }
      return Status::Ok();
    };
    const Status status = [&]() -> Status {
      OSCAR_RETURN_IF_ERROR(share_or_copy(from.sink_pages, from.sink_len, seq.sink_pages));
      return share_or_copy(from.recent_pages, from.recent_len, seq.recent_pages);
    }();
    if (!status.ok()) {
      for (int32_t page : seq.sink_pages) bf16_pages_.release(page);
      for (int32_t page : seq.recent_pages) bf16_pages_.release(page);
      sequences_[*child].alive = false;
      if (copies) copies->clear();
      return status;
    }
    for (int32_t page : seq.int2_pages) int2_pages_.retain(page);
    seq.alive = true;
    sequences_[*child] = std::move(seq);
    return *child;
  }

  Status release_request(RequestId id) {
    OSCAR_RETURN_IF_ERROR(require_no_plan("release_request"));
    OSCAR_RETURN_IF_ERROR(check_request(id));
    Sequence& seq = sequences_[id];
    for (int32_t page : seq.sink_pages) bf16_pages_.release(page);
    for (int32_t page : seq.recent_pages) bf16_pages_.release(page);
    for (int32_t page : seq.int2_pages) int2_pages_.release(page);
    seq = Sequence{};
    return Status::Ok();
  }

  int64_t length(RequestId id) const {
    return check_request(id).ok() ? length_of(sequences_[id]) : -1;
  }
  SegmentCounts segments(RequestId id) const {
    if (!check_request(id).ok()) return {};
    const Sequence& seq = sequences_[id];
    return {seq.sink_len, static_cast<int64_t>(seq.int2_pages.size()) * config_.page_size,
            seq.recent_len};
  }

  // ---- writing ----------------------------------------------------------------------------

  // Reserves the slots for num_new_tokens[i] new tokens of requests[i], in every layer, and
  // updates the page tables to the lengths after the step. Fails without changing anything
  // (unknown request, repeated request, pool exhausted, another plan still open).
  Result<WritePlan> plan_append(std::span<const RequestId> requests,
                                std::span<const int32_t> num_new_tokens) {
    OSCAR_RETURN_IF_ERROR(require_no_plan("plan_append"));
    if (requests.size() != num_new_tokens.size()) {
      return invalid_argument("requests and num_new_tokens have different lengths (" +
                              std::to_string(requests.size()) + " vs " +
                              std::to_string(num_new_tokens.size()) + ")");
    }
    std::vector<bool> seen(sequences_.size(), false);
    for (size_t i = 0; i < requests.size(); ++i) {
      OSCAR_RETURN_IF_ERROR(check_request(requests[i]));
      if (seen[requests[i]]) {
        return invalid_argument("request " + std::to_string(requests[i]) +
                                " appears twice in one append");
      }
      seen[requests[i]] = true;
      if (num_new_tokens[i] < 0) {
        return invalid_argument("num_new_tokens[" + std::to_string(i) + "] is negative");
      }
    }

    // Plan on copies; commit only when every page could be had.
    const PageAllocator int2_snapshot = int2_pages_;
    const PageAllocator bf16_snapshot = bf16_pages_;
    WritePlan plan;
    plan.requests.assign(requests.begin(), requests.end());
    plan.token_indptr.push_back(0);
    std::vector<Sequence> updated;
    for (size_t i = 0; i < requests.size(); ++i) {
      updated.push_back(sequences_[requests[i]]);
      const Status status = plan_request(updated.back(), num_new_tokens[i], plan);
      if (!status.ok()) {
        int2_pages_ = int2_snapshot;
        bf16_pages_ = bf16_snapshot;
        return status;
      }
      plan.token_indptr.push_back(static_cast<int32_t>(plan.slots.size()));
    }
    open_step_.before.clear();
    for (size_t i = 0; i < requests.size(); ++i) {
      open_step_.before.emplace_back(requests[i], std::move(sequences_[requests[i]]));
      sequences_[requests[i]] = std::move(updated[i]);
    }
    open_step_.int2_pages = int2_snapshot;
    open_step_.bf16_pages = bf16_snapshot;
    plan.id = next_plan_id();
    plan.layer_written.assign(config_.num_layers, false);
    open_plan_ = plan.id;
    return Result<WritePlan>(std::move(plan));
  }

  // Writes one layer's new K/V rows, bf16 [plan.slots.size(), num_kv_heads, head_dim] each,
  // post-RoPE, in request order. K is rotated by R_K, V by R_V (unless values_prerotated);
  // the rotated rows are rounded to bf16, then stored or quantized. Nothing is written when
  // an argument is wrong.
  Status write(int32_t layer, WritePlan& plan, const bf16_t* k, const bf16_t* v) {
    OSCAR_RETURN_IF_ERROR(require_host_pools("write"));
    OSCAR_RETURN_IF_ERROR(check_plan(plan));
    OSCAR_RETURN_IF_ERROR(check_layer(layer));
    if (!plan.slots.empty() && (!k || !v)) return invalid_argument("k and v must not be null");
    const int d = config_.head_dim;
    const int32_t heads = config_.num_kv_heads;
    const int g = layout_.quant_group_size;
    LayerPools& pools = pools_[layer];
    const Int2PoolRef k_int2 = int2_ref(pools.k_int2), v_int2 = int2_ref(pools.v_int2);
    const Bf16PoolRef k_bf16 = bf16_ref(pools.k_bf16), v_bf16 = bf16_ref(pools.v_bf16);
    const int k_rank = k_clip_rank_[layer], v_rank = v_clip_rank_[layer];
    std::vector<float> row(d), rotated(d);

    // Demotions read rows written in earlier steps; this step's rows never overwrite them.
    for (const PageDemotion& demotion : plan.demotions) {
      for (int32_t h = 0; h < heads; ++h) {
        for (int32_t r = 0; r < demotion.rows; ++r) {
          quantize_bf16_row(k_bf16.row(demotion.bf16_page, h, r), k_int2, demotion.int2_page, h, r,
                            k_rank, row.data());
          quantize_bf16_row(v_bf16.row(demotion.bf16_page, h, r), v_int2, demotion.int2_page, h, r,
                            v_rank, row.data());
        }
      }
    }

    const LayerQuantizer& quantizer = layers_[layer];
    for (size_t t = 0; t < plan.slots.size(); ++t) {
      const TokenSlot& slot = plan.slots[t];
      for (int32_t h = 0; h < heads; ++h) {
        const int64_t offset = (static_cast<int64_t>(t) * heads + h) * d;
        for (int pass = 0; pass < 2; ++pass) {
          const bf16_t* in = (pass == 0 ? k : v) + offset;
          const std::vector<float>& rotation =
              pass == 0 ? quantizer.k_rotation
                        : (config_.values_prerotated ? kNoRotation : quantizer.v_rotation);
          for (int i = 0; i < d; ++i) row[i] = bf16_to_float(in[i]);
          if (!rotation.empty()) {
            rotate_row(row.data(), rotation.data(), d, rotated.data());
            std::swap(row, rotated);
          }
          for (int i = 0; i < d; ++i) row[i] = round_to_bf16(row[i]);
          if (slot.int2) {
            const Int2PoolRef& pool = pass == 0 ? k_int2 : v_int2;
            uint8_t* block = pool.block(slot.page, h);
            quantize_row(row.data(), d, g, pass == 0 ? k_rank : v_rank,
                         layout_.codes(block, slot.slot), layout_.meta(block, slot.slot));
          } else {
            bf16_t* out = (pass == 0 ? k_bf16 : v_bf16).row(slot.page, h, slot.slot);
            for (int i = 0; i < d; ++i) out[i] = float_to_bf16(row[i]);
          }
        }
      }
    }
    plan.layer_written[layer] = true;
    return Status::Ok();
  }

  // Closes the step: frees the BF16 pages that were demoted. Every layer must be written
  // (with device pools: every layer's demote_kv / append_kv issued, on the stream that later
  // steps write on, so a freed page is reused only after its demotion has read it).
  Status finish(WritePlan& plan) {
    OSCAR_RETURN_IF_ERROR(check_plan(plan));
    for (int32_t l = 0; config_.host_pools && l < config_.num_layers; ++l) {
      if (!plan.layer_written[l]) {
        return failed_precondition("finish: layer " + std::to_string(l) +
                                   " of this step was not written");
      }
    }
    for (int32_t page : plan.bf16_pages_to_release) bf16_pages_.release(page);
    plan.bf16_pages_to_release.clear();
    open_step_ = OpenStep{};
    open_plan_ = 0;
    return Status::Ok();
  }

  // Undoes an open step: the requests get back their lengths and pages, as if plan_append
  // had not been called. Safe after some layers were written: their rows sit in slots that
  // no request references any more (partial pages are never shared).
  Status cancel(WritePlan& plan) {
    OSCAR_RETURN_IF_ERROR(check_plan(plan));
    for (auto& [id, seq] : open_step_.before) sequences_[id] = std::move(seq);
    int2_pages_ = std::move(open_step_.int2_pages);
    bf16_pages_ = std::move(open_step_.bf16_pages);
    open_step_ = OpenStep{};
    plan.bf16_pages_to_release.clear();
    open_plan_ = 0;
    return Status::Ok();
  }

  // Plans, writes every layer and finishes: k and v are [num_layers][tokens][kv heads][d].
  Status append(std::span<const RequestId> requests, std::span<const int32_t> num_new_tokens,
                const bf16_t* k, const bf16_t* v) {
    if (!k || !v) return invalid_argument("k and v must not be null");
    auto plan = plan_append(requests, num_new_tokens);
    if (!plan.ok()) return plan.status();
    const int64_t layer_stride =
        static_cast<int64_t>(plan->slots.size()) * config_.num_kv_heads * config_.head_dim;
    for (int32_t l = 0; l < config_.num_layers; ++l) {
      Status status = write(l, *plan, k ? k + l * layer_stride : nullptr,
                            v ? v + l * layer_stride : nullptr);
      if (!status.ok()) {
        const Status cancelled = cancel(*plan);  // the plan is ours and open: cannot fail
        static_cast<void>(cancelled);
        return status;
      }
    }
    return finish(*plan);
  }

  // ---- attention ---------------------------------------------------------------------------

  // The page tables of `requests`, in order, as the kernels take them.
  Result<BatchTables> page_tables(std::span<const RequestId> requests) const {
    BatchTables tables;
    tables.page_size = config_.page_size;
    for (RequestId id : requests) {
      OSCAR_RETURN_IF_ERROR(check_request(id));
      const Sequence& seq = sequences_[id];
      append_table(tables.sink, seq.sink_pages, seq.sink_len);
      append_table(tables.int2, seq.int2_pages,
                   static_cast<int64_t>(seq.int2_pages.size()) * config_.page_size);
      append_table(tables.recent, seq.recent_pages, seq.recent_len);
    }
    return Result<BatchTables>(std::move(tables));
  }

  // A layer outside 0..num_layers-1 gives a view (and int2_pool / bf16_pool give pools) with
  // null data, which validate() and every attention path and launcher refuse by name.
  PagedKvRef view(int32_t layer, const BatchTables& tables) const {
    const LayerPools& pools = pools_of(layer);
    return {bf16_ref(pools.k_bf16),
            bf16_ref(pools.v_bf16),
            int2_ref(pools.k_int2),
            int2_ref(pools.v_int2),
            BatchTables::ref(tables.sink, tables.page_size),
            BatchTables::ref(tables.int2, tables.page_size),
            BatchTables::ref(tables.recent, tables.page_size)};
  }

  // One query token per request: q float32 [requests, num_qo_heads, head_dim] in the model's
  // basis (unless q_rotated), out the same shape, lse [requests, num_qo_heads] or null.
  Status decode(int32_t layer, std::span<const RequestId> requests, const float* q, float* out,
                float* lse, const AttentionOptions& options = {}) const {
    return attend(layer, requests, nullptr, q, out, lse, options);
  }

  // Several query tokens per request, the newest ones (written by this step's write()), each
  // attending causally to the cached prefix and the new tokens before it. q float32
  // [Σ num_query_tokens, num_qo_heads, head_dim].
  Status extend(int32_t layer, std::span<const RequestId> requests,
                std::span<const int32_t> num_query_tokens, const float* q, float* out, float* lse,
                const AttentionOptions& options = {}) const {
    if (num_query_tokens.size() != requests.size()) {
      return invalid_argument("requests and num_query_tokens have different lengths");
    }
    std::vector<int32_t> qo_indptr{0};
    for (int32_t n : num_query_tokens) qo_indptr.push_back(qo_indptr.back() + n);
    return attend(layer, requests, qo_indptr.data(), q, out, lse, options);
  }

  // ---- inspection ------------------------------------------------------------------------------

  PoolUsage usage() const {
    PoolUsage usage{int2_pages_.num_used(), int2_pages_.capacity(), bf16_pages_.num_used(),
                    bf16_pages_.capacity(), 0, 0};
    for (int32_t p = 0; p < int2_pages_.capacity(); ++p) usage.int2_pages_shared += int2_pages_.ref_count(p) > 1;
    for (int32_t p = 0; p < bf16_pages_.capacity(); ++p) usage.bf16_pages_shared += bf16_pages_.ref_count(p) > 1;
    return usage;
  }
  // Requests holding the page (0: free), or -1 for a page outside the pool.
  int32_t int2_ref_count(int32_t page) const { return int2_pages_.ref_count_or(page, -1); }
  int32_t bf16_ref_count(int32_t page) const { return bf16_pages_.ref_count_or(page, -1); }

  enum class Tensor { kKeys, kValues };
  Int2PoolRef int2_pool(int32_t layer, Tensor which) const {
    const LayerPools& pools = pools_of(layer);
    return int2_ref(which == Tensor::kKeys ? pools.k_int2 : pools.v_int2);
  }
  Bf16PoolRef bf16_pool(int32_t layer, Tensor which) const {
    const LayerPools& pools = pools_of(layer);
    return bf16_ref(which == Tensor::kKeys ? pools.k_bf16 : pools.v_bf16);
  }

 private:
  struct Sequence {
    bool alive = false;
    std::vector<int32_t> sink_pages, int2_pages, recent_pages;
    int64_t sink_len = 0;
    int64_t recent_len = 0;
  };
  // What plan_append changed, so that cancel() can put it back.
  struct OpenStep {
    std::vector<std::pair<RequestId, Sequence>> before;
    PageAllocator int2_pages, bf16_pages;
  };
  struct LayerPools {
    AlignedBuffer k_int2, v_int2, k_bf16, v_bf16;
  };
  inline static const std::vector<float> kNoRotation{};

  PagedCache() = default;

 public:
  // Owns its pools: movable, not copyable.
  PagedCache(PagedCache&&) noexcept = default;
  PagedCache& operator=(PagedCache&&) noexcept = default;
  PagedCache(const PagedCache&) = delete;
  PagedCache& operator=(const PagedCache&) = delete;

 private:

  Status require_no_plan(const char* call) const {
    if (open_plan_ != 0) {
      return failed_precondition(std::string(call) +
                                 ": an append step is open; finish() it first");
    }
    return Status::Ok();
  }
  Status check_request(RequestId id) const {
    if (id < 0 || id >= static_cast<RequestId>(sequences_.size()) || !sequences_[id].alive) {
      return out_of_range("request " + std::to_string(id) + " does not exist");
    }
    return Status::Ok();
  }
  // The layer's pools, or unallocated ones (null data) for a layer outside the cache.
  const LayerPools& pools_of(int32_t layer) const {
    static const LayerPools kNone{};
    return check_layer(layer).ok() ? pools_[layer] : kNone;
  }
  Status check_layer(int32_t layer) const {
    if (layer < 0 || layer >= config_.num_layers) {
      return out_of_range("layer " + std::to_string(layer) + " outside 0.." +
                          std::to_string(config_.num_layers - 1));
    }
    return Status::Ok();
  }
  // Plan ids are unique in the process, not per cache: a plan made by another cache (a draft
  // and a target model's, say) never matches this cache's open step, whose slots and pages it
  // does not describe.
  static uint64_t next_plan_id() {
    static std::atomic<uint64_t> last{0};
    return last.fetch_add(1, std::memory_order_relaxed) + 1;
  }
  Status check_plan(const WritePlan& plan) const {
    if (plan.id == 0 || plan.id != open_plan_) {
      return failed_precondition("this write plan is not the open step of this cache");
    }
    return Status::Ok();
  }
  int64_t length_of(const Sequence& seq) const {
    return seq.sink_len + static_cast<int64_t>(seq.int2_pages.size()) * config_.page_size +
           seq.recent_len;
  }

  // Appends `count` tokens to `seq`, recording their slots and the demotions they cause.
  Status plan_request(Sequence& seq, int32_t count, WritePlan& plan) {
    const int32_t page_size = config_.page_size;
    // Per window page, the rows written in earlier steps: all of them but in the last page.
    std::vector<int32_t> old_rows(seq.recent_pages.size(), page_size);
    if (!old_rows.empty()) {
      old_rows.back() = static_cast<int32_t>(
          seq.recent_len - static_cast<int64_t>(old_rows.size() - 1) * page_size);
    }
    // This step's window tokens leave the window in order: the first not yet demoted.
    size_t next_window_slot = plan.slots.size();
    for (int32_t t = 0; t < count; ++t) {
      if (seq.sink_len < config_.sink_tokens) {
        if (seq.sink_len % page_size == 0) {
          auto page = bf16_pages_.allocate("BF16");
          if (!page.ok()) return page.status();
          seq.sink_pages.push_back(*page);
        }
        plan.slots.push_back(
            {seq.sink_pages.back(), static_cast<int32_t>(seq.sink_len % page_size), 0});
        ++seq.sink_len;
        next_window_slot = plan.slots.size();
        continue;
      }
      if (seq.recent_len % page_size == 0) {
        auto page = bf16_pages_.allocate("BF16");
        if (!page.ok()) return page.status();
        seq.recent_pages.push_back(*page);
        old_rows.push_back(0);
      }
      plan.slots.push_back(
          {seq.recent_pages.back(), static_cast<int32_t>(seq.recent_len % page_size), 0});
      ++seq.recent_len;
      while (seq.recent_len - page_size >= config_.recent_tokens) {
        auto int2_page = int2_pages_.allocate("INT2");
        if (!int2_page.ok()) return int2_page.status();
        const int32_t bf16_page = seq.recent_pages.front();
        const int32_t rows = old_rows.front();
        // This step's tokens in the leaving page (its rows `rows`..page_size-1) go straight
        // to INT2, into the same rows.
        for (int32_t r = rows; r < page_size; ++r, ++next_window_slot) {
          plan.slots[next_window_slot] = {*int2_page, r, 1};
        }
        if (rows > 0) {
          plan.demotions.push_back({bf16_page, *int2_page, rows});
          plan.bf16_pages_to_release.push_back(bf16_page);  // read by every layer's write
        } else {
          bf16_pages_.release(bf16_page);  // never written: reusable at once
        }
        seq.int2_pages.push_back(*int2_page);
        seq.recent_pages.erase(seq.recent_pages.begin());
        old_rows.erase(old_rows.begin());
        seq.recent_len -= page_size;
      }
    }
    return Status::Ok();
  }

  void append_table(BatchTables::Table& table, const std::vector<int32_t>& pages,
                    int64_t tokens) const {
    table.indices.insert(table.indices.end(), pages.begin(), pages.end());
    table.indptr.push_back(static_cast<int32_t>(table.indices.size()));
    const int64_t last = pages.empty() ? 0 : tokens - static_cast<int64_t>(pages.size() - 1) * config_.page_size;
    table.last_page_len.push_back(static_cast<int32_t>(last));
  }

  Status attend(int32_t layer, std::span<const RequestId> requests, const int32_t* qo_indptr,
                const float* q, float* out, float* lse, const AttentionOptions& options) const {
    OSCAR_RETURN_IF_ERROR(require_host_pools(qo_indptr ? "extend" : "decode"));
    OSCAR_RETURN_IF_ERROR(check_layer(layer));
    auto tables = page_tables(requests);
    if (!tables.ok()) return tables.status();
    const LayerQuantizer& quantizer = layers_[layer];
    AttentionParams params;
    params.kv = view(layer, *tables);
    params.num_qo_heads = config_.num_qo_heads;
    params.q = q;
    params.qo_indptr = qo_indptr;
    params.q_rotation = options.q_rotated || quantizer.k_rotation.empty() ? nullptr : quantizer.k_rotation.data();
    params.output_unrotation =
        options.output_rotated || quantizer.v_rotation.empty() ? nullptr : quantizer.v_rotation.data();
    params.sm_scale = options.sm_scale;
    params.split_tokens = options.split_tokens;
    params.out = out;
    params.lse = lse;
    return options.path ? options.path(params) : attention_reference(params);
  }

  void quantize_bf16_row(const bf16_t* in, const Int2PoolRef& pool, int32_t page, int32_t head,
                         int32_t slot, int clip_k, float* scratch) const {
    for (int i = 0; i < config_.head_dim; ++i) scratch[i] = bf16_to_float(in[i]);
    uint8_t* block = pool.block(page, head);
    quantize_row(scratch, config_.head_dim, layout_.quant_group_size, clip_k,
                 layout_.codes(block, slot), layout_.meta(block, slot));
  }

  Status require_host_pools(const char* what) const {
    if (config_.host_pools) return Status::Ok();
    return failed_precondition(std::string(what) + ": this cache keeps only the books (host_pools = false); "
                               "its pools live on the device");
  }

  void copy_bf16_page(int32_t from, int32_t to) {
    for (LayerPools& pools : pools_) {
      for (AlignedBuffer* buffer : {&pools.k_bf16, &pools.v_bf16}) {
        const Bf16PoolRef ref = bf16_ref(*buffer);
        std::copy_n(ref.data + from * ref.stride_page, ref.stride_page, ref.data + to * ref.stride_page);
      }
    }
  }

  Int2PoolRef int2_ref(const AlignedBuffer& buffer) const {
    return Int2PoolRef::packed(const_cast<uint8_t*>(buffer.as<uint8_t>()), config_.num_int2_pages,
                               config_.num_kv_heads, layout_);
  }
  Bf16PoolRef bf16_ref(const AlignedBuffer& buffer) const {
    return Bf16PoolRef::packed(const_cast<bf16_t*>(buffer.as<bf16_t>()), config_.num_bf16_pages,
                               config_.num_kv_heads, config_.page_size, config_.head_dim);
  }

  CacheConfig config_;
  Int2Layout layout_;
  std::vector<LayerQuantizer> layers_;
  std::vector<int> k_clip_rank_, v_clip_rank_;
  PageAllocator int2_pages_, bf16_pages_;
  std::vector<LayerPools> pools_;
  std::vector<Sequence> sequences_;
  uint64_t open_plan_ = 0;
  OpenStep open_step_;
};

}  // namespace oscar::host
