// The host/device functors give the same bits on the GPU as on the CPU: conversions (also
// against CUDA's own intrinsics), the row quantizer, Hadamard and dense rotation, the
// dequant-dot (to rounding, since nvcc contracts multiply-adds differently).
#include "common/gpu_test_main.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/quantizer_rows.hpp"
#include "common/random.hpp"
#include "oscar/quant/dequant_dot.hpp"
#include "oscar/quant/row.hpp"
#include "oscar/quant/row_bf16x2.hpp"
#include "oscar/rotate/dense.hpp"
#include "oscar/rotate/hadamard.hpp"

using namespace oscar;

namespace {

template <class T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) {
    CUDA_REQUIRE(cudaMalloc(&ptr, count * sizeof(T)));
    CUDA_REQUIRE(cudaMemset(ptr, 0xff, count * sizeof(T)));  // poison
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  void upload(const std::vector<T>& h) { CUDA_REQUIRE(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> download() const {
    std::vector<T> h(n);
    CUDA_REQUIRE(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

__global__ void convert_kernel(const float* in, int n, uint16_t* fp16_ours, uint16_t* fp16_cuda,
                               uint16_t* bf16_ours, uint16_t* bf16_cuda, uint32_t* bf16_pairs) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  fp16_ours[i] = float_to_fp16(in[i]).bits;
  fp16_cuda[i] = __half_as_ushort(__float2half_rn(in[i]));
  bf16_ours[i] = float_to_bf16(in[i]).bits;
  bf16_cuda[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
  bf16_pairs[i] = bf16_pair_bits(in[i], in[(i + 1) % n]);  // (each value once low, once high)
}

__global__ void quantize_kernel(const float* rows, int num_rows, int d, int group, int clip_k,
                                uint8_t* packed, QuantMeta* meta) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= num_rows) return;
  quantize_row(rows + size_t(r) * d, d, group, clip_k, packed + size_t(r) * d / 4, meta + size_t(r) * (d / group));
}

// A thread per row, as demote_rows_kernel runs it: the row's pairs in registers.
template <int D, int G, int S>
__global__ void quantize_bf16x2_kernel(const uint32_t* rows, int num_rows, int clip_k, uint32_t* words, QuantMeta* meta) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= num_rows) return;
  uint32_t x[D / 2];
  for (int i = 0; i < D / 2; ++i) x[i] = rows[size_t(r) * (D / 2) + i];
  uint32_t w[D / 16];
  QuantMeta m[D / G];
  quantize_row_bf16x2<D, G, S>(x, clip_k, w, m);
  for (int i = 0; i < D / 16; ++i) words[size_t(r) * (D / 16) + i] = w[i];
  for (int g = 0; g < D / G; ++g) meta[size_t(r) * (D / G) + g] = m[g];
}

// Two lanes per row, as the tensor-core append runs it: lane l of a warp holds half l / 16 of
// the warp's row l % 16. Pairs past the last row return at once: the others' shuffles name
// only their own pair.
template <int D, int G, int S>
__global__ void quantize_half_bf16x2_kernel(const uint32_t* rows, int num_rows, int clip_k, uint32_t* words,
                                            QuantMeta* meta) {
  const int lane = threadIdx.x % 32, h = lane / 16;
  const int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * 16 + lane % 16;
  if (r >= num_rows) return;
  uint32_t x[D / 4];
  for (int i = 0; i < D / 4; ++i) x[i] = rows[size_t(r) * (D / 2) + h * (D / 4) + i];
  constexpr int kGroups = kHalfRowGroups<D, G>;
  uint32_t w[D / 32];
  QuantMeta m[kGroups];
  quantize_half_row_bf16x2<D, G, S>(x, clip_k, lane, w, m);
  for (int i = 0; i < D / 32; ++i) words[size_t(r) * (D / 16) + h * (D / 32) + i] = w[i];
  if (G != D || h == 0) {
    for (int g = 0; g < kGroups; ++g) meta[size_t(r) * (D / G) + h * (G == D ? 0 : kGroups) + g] = m[g];
  }
}

__global__ void rotate_kernel(const float* rows, int num_rows, int d, const float* rotation, float* dense_out,
                              float* hadamard_out) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= num_rows) return;
  rotate_row(rows + size_t(r) * d, rotation, d, dense_out + size_t(r) * d);
  float* h = hadamard_out + size_t(r) * d;
  for (int i = 0; i < d; ++i) h[i] = rows[size_t(r) * d + i];
  hadamard_transform(h, d);
}

__global__ void dot_kernel(const float* q, const float* sums, const uint8_t* packed, const QuantMeta* meta,
                           int num_rows, int d, int group, float* out) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= num_rows) return;
  out[r] = dequant_dot(q, sums, packed + size_t(r) * d / 4, meta + size_t(r) * (d / group), d, group);
}

}  // namespace

TEST_CASE("fp16/bf16 conversion: ours on the GPU == ours on the CPU == CUDA intrinsics") {
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> any;
  const int n = 1 << 20;
  std::vector<float> in(n);
  for (int i = 0; i < n; ++i) {
    const uint32_t bits = i < n / 2 ? any(rng) : ((any(rng) & 0x807fffffu) | ((100u + any(rng) % 60u) << 23));
    in[i] = float_from_bits(bits);
  }
  DeviceBuffer<float> d_in(n);
  DeviceBuffer<uint16_t> a(n), b(n), c(n), e(n);
  DeviceBuffer<uint32_t> pairs(n);
  d_in.upload(in);
  convert_kernel<<<(n + 255) / 256, 256>>>(d_in.ptr, n, a.ptr, b.ptr, c.ptr, e.ptr, pairs.ptr);
  CUDA_REQUIRE(cudaGetLastError());
  CUDA_REQUIRE(cudaDeviceSynchronize());
  const auto fp16_ours = a.download(), fp16_cuda = b.download(), bf16_ours = c.download(), bf16_cuda = e.download();
  const auto bf16_pairs = pairs.download();
  int mismatches = 0, pair_mismatches = 0, nans = 0;
  for (int i = 0; i < n; ++i) {
    const bool nan = std::isnan(in[i]);
    nans += nan;
    // bf16_pair_bits (cvt.rn.bf16x2.f32 and a NaN select on sm_90) == float_to_bf16 of both,
    // NaNs included: one canonical NaN, as the integer path makes.
    pair_mismatches += bf16_pairs[i] != (uint32_t{float_to_bf16(in[i]).bits} | uint32_t{float_to_bf16(in[(i + 1) % n]).bits} << 16);
    mismatches += fp16_ours[i] != float_to_fp16(in[i]).bits;
    mismatches += bf16_ours[i] != float_to_bf16(in[i]).bits;
    if (!nan) {  // NaN payloads may differ; both are NaN
      mismatches += fp16_ours[i] != fp16_cuda[i];
      mismatches += bf16_ours[i] != bf16_cuda[i];
    }
  }
  CHECK(mismatches == 0);
  CHECK(pair_mismatches == 0);
  CHECK(nans > 0);  // the random bit patterns include NaNs (and subnormals, Inf, overflow to Inf)
}

TEST_CASE("quantize_row on the GPU is bit-exact with the CPU") {
  for (int d : {64, 128, 256}) {
    for (int group : {32, 64, 128, 256}) {
      if (group > d) continue;
      for (float rho : {1.0f, 0.96f, 0.92f}) {
        const int rows = 4096;
        oscar::testing::RowGenerator gen(d + group, d);
        std::vector<float> x;
        for (int r = 0; r < rows; ++r) {
          const auto row = gen.row();
          x.insert(x.end(), row.begin(), row.end());
        }
        x[17 * d + 3] = std::nanf("");  // one poisoned row must stay confined
        // Groups at the edges of the fp16 metadata: constant (the scale floor), beyond the
        // fp16 range (saturated scale and offset), and tiny (subnormal scales).
        for (int i = 0; i < d; ++i) {
          x[20 * d + i] = 0.5f;
          x[21 * d + i] = round_to_bf16(x[21 * d + i] * 3.0e4f);
          x[22 * d + i] = round_to_bf16(x[22 * d + i] * 1.0e-6f);
        }
        const int k = clip_rank(rho, d);
        DeviceBuffer<float> d_x(x.size());
        DeviceBuffer<uint8_t> d_packed(size_t(rows) * d / 4);
        DeviceBuffer<QuantMeta> d_meta(size_t(rows) * (d / group));
        d_x.upload(x);
        quantize_kernel<<<(rows + 127) / 128, 128>>>(d_x.ptr, rows, d, group, k, d_packed.ptr, d_meta.ptr);
        CUDA_REQUIRE(cudaGetLastError());
        CUDA_REQUIRE(cudaDeviceSynchronize());
        const auto packed = d_packed.download();
        const auto meta = d_meta.download();
        std::vector<uint8_t> host_packed(packed.size());
        std::vector<QuantMeta> host_meta(meta.size());
        for (int r = 0; r < rows; ++r) {
          quantize_row(x.data() + size_t(r) * d, d, group, k, host_packed.data() + size_t(r) * d / 4,
                       host_meta.data() + size_t(r) * (d / group));
        }
        CHECK(packed == host_packed);
        CHECK(std::memcmp(meta.data(), host_meta.data(), meta.size() * sizeof(QuantMeta)) == 0);

        // dequant-dot: same formula, contraction may differ: compare to float rounding.
        std::vector<float> q(d), sums(d / group);
        std::mt19937 rng(d);
        std::normal_distribution<float> normal;
        for (float& v : q) v = normal(rng);
        query_group_sums(q.data(), d, group, sums.data());
        DeviceBuffer<float> d_q(d), d_sums(sums.size()), d_out(rows);
        d_q.upload(q);
        d_sums.upload(sums);
        dot_kernel<<<(rows + 127) / 128, 128>>>(d_q.ptr, d_sums.ptr, d_packed.ptr, d_meta.ptr, rows, d, group, d_out.ptr);
        CUDA_REQUIRE(cudaGetLastError());
        const auto dots = d_out.download();
        for (int r = 0; r < rows; ++r) {
          const float expected = dequant_dot(q.data(), sums.data(), host_packed.data() + size_t(r) * d / 4,
                                             host_meta.data() + size_t(r) * (d / group), d, group);
          if (std::isnan(expected)) {
            CHECK(std::isnan(dots[r]));
          } else {
            CHECK(std::abs(dots[r] - expected) <= 1e-4f * (1.0f + std::abs(expected)));
          }
        }
      }
    }
  }
}

// The GPU's bf16x2 min/max and comparisons (HMNMX2, HSET2) and 16x2 integer min/max on
// subnormals, signed zeros, ties and non-finite rows: every clip rank, edge rows and random ones
// (a row count that is not a multiple of 16, so the last warp of half rows has pairs that return
// at once, and non-finite rows return early beside finite ones).
template <int D, int G, int S>
void check_bf16x2_quantizer_on_gpu() {
  std::vector<std::vector<float>> rows = oscar::testing::quantizer_edge_rows(D, 7 * D + G);
  oscar::testing::RowGenerator gen(3 * D + G, D, 6, 20.0f);
  for (int i = 0; i < 256; ++i) rows.push_back(gen.row());
  const int n = int(rows.size());
  std::vector<uint32_t> pairs;
  for (const auto& r : rows) {
    const auto p = oscar::testing::as_bf16_pairs(r);
    pairs.insert(pairs.end(), p.begin(), p.end());
  }
  DeviceBuffer<uint32_t> d_rows(pairs.size()), d_words(size_t(n) * D / 16);
  DeviceBuffer<QuantMeta> d_meta(size_t(n) * (D / G));
  d_rows.upload(pairs);
  int mismatched_ranks = 0;
  for (int clip_k = -1; clip_k < D; ++clip_k) {
    std::vector<uint8_t> want(size_t(n) * D / 4);
    std::vector<QuantMeta> want_meta(size_t(n) * (D / G));
    for (int r = 0; r < n; ++r) {
      quantize_row(rows[r].data(), D, G, clip_k, want.data() + size_t(r) * D / 4, want_meta.data() + size_t(r) * (D / G));
    }
    for (bool halves : {false, true}) {
      CUDA_REQUIRE(cudaMemset(d_words.ptr, 0xa5, d_words.n * sizeof(uint32_t)));  // poisoned before every run
      CUDA_REQUIRE(cudaMemset(d_meta.ptr, 0xa5, d_meta.n * sizeof(QuantMeta)));
      if (halves) {
        // 4 warps of 16 rows per block; the last warp's missing rows leave the shuffle mask.
        quantize_half_bf16x2_kernel<D, G, S><<<(n + 63) / 64, 128>>>(d_rows.ptr, n, clip_k, d_words.ptr, d_meta.ptr);
      } else {
        quantize_bf16x2_kernel<D, G, S><<<(n + 127) / 128, 128>>>(d_rows.ptr, n, clip_k, d_words.ptr, d_meta.ptr);
      }
      CUDA_REQUIRE(cudaGetLastError());
      CUDA_REQUIRE(cudaDeviceSynchronize());
      const auto words = d_words.download();
      const auto meta = d_meta.download();
      const bool same = std::memcmp(words.data(), want.data(), want.size()) == 0 &&
                        std::memcmp(meta.data(), want_meta.data(), want_meta.size() * sizeof(QuantMeta)) == 0;
      if (!same) {
        INFO("D " << D << " G " << G << " selection " << S << " clip_k " << clip_k << (halves ? " (half rows)" : " (whole rows)"));
        CHECK(same);
        ++mismatched_ranks;
      }
    }
  }
  CHECK(mismatched_ranks == 0);
}

TEST_CASE("quantize_row_bf16x2 and its half-row form on the GPU are bit-exact with quantize_row on the CPU") {
  // Both compiled forms: with the top-32 selection and without it (distances 17-32 searched).
  for (const auto check : {check_bf16x2_quantizer_on_gpu<64, 32, kRowBf16x2WidestSelection>,
                           check_bf16x2_quantizer_on_gpu<64, 64, kRowBf16x2WidestSelection>,
                           check_bf16x2_quantizer_on_gpu<128, 32, kRowBf16x2WidestSelection>,
                           check_bf16x2_quantizer_on_gpu<128, 64, kRowBf16x2WidestSelection>,
                           check_bf16x2_quantizer_on_gpu<128, 128, kRowBf16x2WidestSelection>,
                           check_bf16x2_quantizer_on_gpu<64, 32, kRowBf16x2NarrowSelection>,
                           check_bf16x2_quantizer_on_gpu<64, 64, kRowBf16x2NarrowSelection>,
                           check_bf16x2_quantizer_on_gpu<128, 32, kRowBf16x2NarrowSelection>,
                           check_bf16x2_quantizer_on_gpu<128, 64, kRowBf16x2NarrowSelection>,
                           check_bf16x2_quantizer_on_gpu<128, 128, kRowBf16x2NarrowSelection>}) {
    check();
  }
}

TEST_CASE("dense rotation and Hadamard transform on the GPU equal the CPU") {
  const int rows = 1024;
  for (int d : {64, 128, 256}) {
    oscar::testing::RowGenerator gen(d, d);
    std::vector<float> x;
    for (int r = 0; r < rows; ++r) {
      const auto row = gen.row();
      x.insert(x.end(), row.begin(), row.end());
    }
    const auto rotation = oscar::testing::random_orthogonal(d, 3);
    DeviceBuffer<float> d_x(x.size()), d_r(rotation.size()), d_dense(x.size()), d_h(x.size());
    d_x.upload(x);
    d_r.upload(rotation);
    rotate_kernel<<<(rows + 127) / 128, 128>>>(d_x.ptr, rows, d, d_r.ptr, d_dense.ptr, d_h.ptr);
    CUDA_REQUIRE(cudaGetLastError());
    CUDA_REQUIRE(cudaDeviceSynchronize());
    const auto dense = d_dense.download(), had = d_h.download();
    std::vector<float> y(d), h(d);
    int mismatches = 0;
    for (int r = 0; r < rows; ++r) {
      rotate_row(x.data() + size_t(r) * d, rotation.data(), d, y.data());  // explicit fma: exact
      std::copy_n(x.data() + size_t(r) * d, d, h.data());
      hadamard_transform(h.data(), d);
      for (int i = 0; i < d; ++i) {
        mismatches += dense[size_t(r) * d + i] != y[i];
        mismatches += had[size_t(r) * d + i] != h[i];
      }
    }
    CHECK(mismatches == 0);
  }
}
