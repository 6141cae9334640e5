// GpuKvCache: oscar-decode's KvCache over device pools, written and read by the library's
// kernels (gpu_cache.hpp says what and why; docs/gpu.md is the engine's guide it follows).
#include "gpu_cache.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <span>
#include <string>
#include <utility>

#include "oscar/attention/paged_attention.cuh"
#include "oscar/kv/write.cuh"
#include "oscar/host/device_cache_layout.hpp"

namespace oscar::decode {
namespace {

Status cuda_call(cudaError_t error, const std::string& what) {
  return cuda_status(error, ("gpu cache: " + what).c_str());
}

// Device memory that grows on demand (its contents are not kept when it grows) and frees itself.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  Status reserve(size_t bytes) {
    bytes = std::max<size_t>(bytes, 256);  // never null, and 256-byte aligned (cudaMalloc)
    if (bytes <= bytes_) return Status::Ok();
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
    OSCAR_RETURN_IF_ERROR(cuda_call(cudaMalloc(&ptr_, bytes), "cudaMalloc"));
    bytes_ = bytes;
    return Status::Ok();
  }
  template <class T>
  Status upload(std::span<const T> host) {
    OSCAR_RETURN_IF_ERROR(reserve(host.size_bytes()));
    if (host.empty()) return Status::Ok();
    return cuda_call(cudaMemcpy(ptr_, host.data(), host.size_bytes(), cudaMemcpyHostToDevice), "upload");
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A page table's three arrays on the device.
struct DeviceTable {
  DeviceBuffer indptr, indices, last_page_len;
  Status upload(const host::BatchTables::Table& t) {
    OSCAR_RETURN_IF_ERROR(indptr.upload(std::span<const int32_t>(t.indptr)));
    OSCAR_RETURN_IF_ERROR(indices.upload(std::span<const int32_t>(t.indices)));
    return last_page_len.upload(std::span<const int32_t>(t.last_page_len));
  }
  PageTableRef ref(const host::BatchTables::Table& t, int32_t page_size) const {
    return {indptr.as<int32_t>(), indices.as<int32_t>(), last_page_len.as<int32_t>(),
            static_cast<int32_t>(t.last_page_len.size()), page_size};
  }
};

class GpuKvCache final : public KvCache {
 public:
  static Result<std::unique_ptr<KvCache>> create(const host::CacheConfig& config, int64_t capacity,
                                                 std::vector<host::LayerQuantizer> layers) {
    int devices = 0;
    const cudaError_t count = cudaGetDeviceCount(&devices);
    if (count != cudaSuccess || devices == 0) {
      return failed_precondition(std::string("no CUDA device visible (") +
                                 (count == cudaSuccess ? "none found" : cudaGetErrorString(count)) +
                                 "): the @gpu caches need one");
    }
    auto options = attention_plan_options_for_device(config.head_dim);
    if (!options.ok()) return options.status();
    const Int2Layout layout = config.int2_layout();
    OSCAR_RETURN_IF_ERROR(validate(AttentionShape{config.num_qo_heads, config.num_kv_heads, config.head_dim,
                                                  layout.quant_group_size, config.page_size}));
    // The pools' sizes, the stacked rotations and the clip ranks (the library's rule: a tensor
    // no layer rotates gets no rotation at all).
    auto arrays = host::device_cache_arrays(config, layers);
    if (!arrays.ok()) return arrays.status();
    host::CacheConfig books_config = config;
    books_config.host_pools = false;  // the books only: the rows live on the device
    auto books = host::PagedCache::create(books_config, std::move(layers));
    if (!books.ok()) return books.status();

    std::unique_ptr<GpuKvCache> cache(new GpuKvCache(std::move(*books), capacity, *options));
    GpuKvCache& c = *cache;
    for (auto [buffer, bytes] : {std::pair{&c.k_int2_, arrays->int2_pool_bytes}, std::pair{&c.v_int2_, arrays->int2_pool_bytes},
                                 std::pair{&c.k_bf16_, arrays->bf16_pool_bytes}, std::pair{&c.v_bf16_, arrays->bf16_pool_bytes}}) {
      OSCAR_RETURN_IF_ERROR(buffer->reserve(bytes));
      OSCAR_RETURN_IF_ERROR(cuda_call(cudaMemset(buffer->as<void>(), 0, bytes), "cudaMemset"));
    }
    OSCAR_RETURN_IF_ERROR(c.k_rotation_.upload(std::span<const float>(arrays->k_rotations)));
    OSCAR_RETURN_IF_ERROR(c.v_rotation_.upload(std::span<const float>(arrays->v_rotations)));
    OSCAR_RETURN_IF_ERROR(c.k_clip_rank_.upload(std::span<const int32_t>(arrays->k_clip_ranks)));
    OSCAR_RETURN_IF_ERROR(c.v_clip_rank_.upload(std::span<const int32_t>(arrays->v_clip_ranks)));
    const int32_t zero = 0;
    OSCAR_RETURN_IF_ERROR(c.error_flag_.upload(std::span<const int32_t>(&zero, 1)));

    auto pools = host::layered_kv_pools(
        config, *arrays,
        {c.k_int2_.as<uint8_t>(), c.v_int2_.as<uint8_t>(), c.k_bf16_.as<bf16_t>(), c.v_bf16_.as<bf16_t>(),
         arrays->k_rotations.empty() ? nullptr : c.k_rotation_.as<float>(),
         arrays->v_rotations.empty() ? nullptr : c.v_rotation_.as<float>(), c.k_clip_rank_.as<int32_t>(),
         c.v_clip_rank_.as<int32_t>()});
    if (!pools.ok()) return pools.status();
    c.pools_ = *pools;

    auto request = c.books_.add_request();
    if (!request.ok()) return request.status();
    c.request_ = *request;
    return std::unique_ptr<KvCache>(std::move(cache));
  }

  Status begin_step(int32_t n) override {
    if (step_ != 0) return failed_precondition("gpu cache: begin_step while a step is open");
    if (n <= 0) return invalid_argument("gpu cache: a step needs at least one token");
    if (length_ + n > capacity_) {
      return resource_exhausted("context full: " + std::to_string(length_ + n) + " tokens > " +
                                std::to_string(capacity_));
    }
    const int32_t counts[1] = {n};
    auto plan = books_.plan_append(std::span<const host::RequestId>(&request_, 1), counts);
    if (!plan.ok()) return plan.status();
    plan_ = std::move(*plan);
    // Everything the step's launches read, uploaded once; on failure the books forget the step.
    const Status prepared = prepare_step(n);
    if (!prepared.ok()) {
      (void)books_.cancel(plan_);
      return prepared;
    }
    step_ = n;
    length_ += n;
    return Status::Ok();
  }

  Status write(int32_t layer, const float* k, const float* v) override {
    OSCAR_RETURN_IF_ERROR(check_layer_call(layer, "write"));
    const host::CacheConfig& c = books_.config();
    const size_t count = size_t(step_) * c.num_kv_heads * c.head_dim;
    rows_to_bf16(k, count, staging_);
    OSCAR_RETURN_IF_ERROR(k_in_.upload(std::span<const bf16_t>(staging_)));
    rows_to_bf16(v, count, staging_);
    OSCAR_RETURN_IF_ERROR(v_in_.upload(std::span<const bf16_t>(staging_)));
    // The layer's window pages that leave BF16 this step first, then the new rows (a demoted
    // page stays allocated until end_step, so no new row lands in it).
    const LayeredKvPools pools = layer_pools(layer);
    DemoteParams demote;
    demote.pools = pools;
    demote.num_demotions = static_cast<int32_t>(plan_.demotions.size());
    demote.demotions = demotions_.as<PageDemotion>();
    demote.error_flag = error_flag_.as<int32_t>();
    OSCAR_RETURN_IF_ERROR(demote_kv(demote));
    AppendParams append;
    append.pools = pools;
    append.k = k_in_.as<bf16_t>();
    append.v = v_in_.as<bf16_t>();
    append.in_stride_token = int64_t{c.num_kv_heads} * c.head_dim;
    append.in_stride_layer = append.in_stride_token * step_;
    append.num_tokens = step_;
    append.slots = slots_.as<TokenSlot>();
    append.values_prerotated = c.values_prerotated;
    // kAuto, as an engine would run it: prefill chunks of 4096 rows or more (tokens x KV heads)
    // rotate on tensor cores, within 2^-15 of the CPU cache's FMA rotation (docs/gpu.md §3).
    append.error_flag = error_flag_.as<int32_t>();
    OSCAR_RETURN_IF_ERROR(append_kv(append));
    plan_.layer_written[size_t(layer)] = true;
    return Status::Ok();
  }

  Status attend(int32_t layer, const float* q, float* out) override {
    OSCAR_RETURN_IF_ERROR(check_layer_call(layer, "attend"));
    const host::CacheConfig& c = books_.config();
    const size_t count = size_t(step_) * c.num_qo_heads * c.head_dim;
    rows_to_bf16(q, count, staging_);  // the kernels take bf16 q, as an engine holds it
    OSCAR_RETURN_IF_ERROR(q_.upload(std::span<const bf16_t>(staging_)));
    OSCAR_RETURN_IF_ERROR(out_.reserve(count * sizeof(bf16_t)));
    const LayeredKvPools pools = layer_pools(layer);
    PagedAttentionParams p;
    p.kv = {pools.k_bf16,
            pools.v_bf16,
            pools.k_int2,
            pools.v_int2,
            sink_table_.ref(tables_.sink, c.page_size),
            int2_table_.ref(tables_.int2, c.page_size),
            recent_table_.ref(tables_.recent, c.page_size)};
    p.num_qo_heads = c.num_qo_heads;
    p.q = q_.as<bf16_t>();
    p.qo_indptr = step_ > 1 ? qo_indptr_.as<int32_t>() : nullptr;
    p.q_rotation = pools.k_rotation;  // the kernels rotate q into the keys' basis ...
    p.output_unrotation = pools.v_rotation;  // ... and bring the output back from the values'
    p.out = out_.as<bf16_t>();
    OSCAR_RETURN_IF_ERROR(paged_attention(attention_plan_, p, workspace_.as<void>(), workspace_.bytes()));
    out_host_.resize(count);
    // (This copy waits for the layer's launches: an error of any of them surfaces here.)
    OSCAR_RETURN_IF_ERROR(cuda_call(cudaMemcpy(out_host_.data(), p.out, count * sizeof(bf16_t), cudaMemcpyDeviceToHost),
                                    "layer " + std::to_string(layer) + " kernels"));
    for (size_t i = 0; i < count; ++i) out[i] = bf16_to_float(out_host_[i]);
    return Status::Ok();
  }

  // Closes the step once every layer is written (the books then free the demoted window
  // pages, whose rows must have reached their INT2 pages first). A write kernel that refused a
  // slot of the books' plan (a bug: the books and the pools disagree) cancels the step.
  Status end_step() override {
    if (step_ == 0) return failed_precondition("gpu cache: end_step without begin_step");
    const auto& written = plan_.layer_written;
    const auto missing = std::find(written.begin(), written.end(), false);
    if (missing != written.end()) {
      return failed_precondition("gpu cache: end_step before layer " + std::to_string(missing - written.begin()) +
                                 " was written");
    }
    int32_t flag = 0;
    OSCAR_RETURN_IF_ERROR(
        cuda_call(cudaMemcpy(&flag, error_flag_.as<int32_t>(), sizeof(flag), cudaMemcpyDeviceToHost), "error flag"));
    if (flag != 0) {
      const int32_t zero = 0;
      OSCAR_RETURN_IF_ERROR(error_flag_.upload(std::span<const int32_t>(&zero, 1)));  // as create() sets it
      OSCAR_RETURN_IF_ERROR(books_.cancel(plan_));
      length_ -= step_;
      step_ = 0;
      return {StatusCode::kInternal, "gpu cache: a write kernel refused a slot of the books' plan; the step was cancelled"};
    }
    OSCAR_RETURN_IF_ERROR(books_.finish(plan_));
    step_ = 0;
    return Status::Ok();
  }

  int64_t length() const override { return length_; }
  double bytes_per_token() const override { return paged_bytes_per_token(books_.config(), length_); }

 private:
  GpuKvCache(host::PagedCache books, int64_t capacity, AttentionPlanOptions options)
      : books_(std::move(books)), capacity_(capacity), plan_options_(options) {}

  // Uploads the step's slots, demotions and page tables (the lengths after the step), and
  // plans and uploads the attention of its n query tokens.
  Status prepare_step(int32_t n) {
    const host::CacheConfig& c = books_.config();
    OSCAR_RETURN_IF_ERROR(slots_.upload(std::span<const TokenSlot>(plan_.slots)));
    OSCAR_RETURN_IF_ERROR(demotions_.upload(std::span<const PageDemotion>(plan_.demotions)));
    auto tables = books_.page_tables(std::span<const host::RequestId>(&request_, 1));
    if (!tables.ok()) return tables.status();
    tables_ = std::move(*tables);
    OSCAR_RETURN_IF_ERROR(sink_table_.upload(tables_.sink));
    OSCAR_RETURN_IF_ERROR(int2_table_.upload(tables_.int2));
    OSCAR_RETURN_IF_ERROR(recent_table_.upload(tables_.recent));
    const int32_t qo_indptr[2] = {0, n};
    OSCAR_RETURN_IF_ERROR(qo_indptr_.upload(std::span<const int32_t>(qo_indptr)));
    const SegmentCounts segments[1] = {books_.segments(request_)};
    const AttentionShape shape{c.num_qo_heads, c.num_kv_heads, c.head_dim, books_.int2_layout().quant_group_size,
                               c.page_size};
    auto plan = make_attention_plan(shape, segments, n > 1 ? std::span<const int32_t>(&n, 1) : std::span<const int32_t>(),
                                    plan_options_);
    if (!plan.ok()) return plan.status();
    attention_plan_ = std::move(*plan);
    OSCAR_RETURN_IF_ERROR(workspace_.reserve(attention_plan_.workspace_bytes()));
    return upload_attention_plan(attention_plan_, workspace_.as<void>(), workspace_.bytes());
  }

  Status check_layer_call(int32_t layer, const char* call) const {
    if (step_ == 0) return failed_precondition(std::string("gpu cache: ") + call + " outside a step");
    if (layer < 0 || layer >= books_.config().num_layers) {
      return out_of_range("gpu cache: layer " + std::to_string(layer) + " of " +
                          std::to_string(books_.config().num_layers));
    }
    return Status::Ok();
  }

  // Layer `layer`'s pools, rotations and clip ranks as a one-layer view.
  LayeredKvPools layer_pools(int32_t layer) const { return pools_.layer_view(layer); }

  host::PagedCache books_;
  int64_t capacity_;
  AttentionPlanOptions plan_options_;
  host::RequestId request_ = 0;
  host::WritePlan plan_;
  host::BatchTables tables_;
  AttentionPlan attention_plan_;
  int64_t length_ = 0;
  int32_t step_ = 0;
  LayeredKvPools pools_;
  DeviceBuffer k_int2_, v_int2_, k_bf16_, v_bf16_;       // every layer, layer-strided
  DeviceBuffer k_rotation_, v_rotation_, k_clip_rank_, v_clip_rank_, error_flag_;
  DeviceBuffer slots_, demotions_, qo_indptr_, workspace_;  // the step's
  DeviceTable sink_table_, int2_table_, recent_table_;
  DeviceBuffer k_in_, v_in_, q_, out_;  // a layer's rows
  std::vector<bf16_t> staging_, out_host_;
};

}  // namespace

Result<std::unique_ptr<KvCache>> make_gpu_cache(const host::CacheConfig& config, int64_t capacity,
                                                std::vector<host::LayerQuantizer> layers) {
  return GpuKvCache::create(config, capacity, std::move(layers));
}

}  // namespace oscar::decode
