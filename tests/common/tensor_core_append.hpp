// The tensor-core append path (AppendRotation::kTensorCores) against the CPU reference. Its
// rotation is not bit-exact (kv/tile_rotation.cuh), so it is checked in two parts, which
// together pin every stored byte:
//   - the rows it stores in BF16 slots: every element within the error bound of the split
//     (kRotationErrorBound of sum_i |x_i R_ij|, plus the bf16 rounding) of the exact product
//     (double), and few of them different from the FMA-ordered rotation rounded to bf16;
//   - the rows it stores in INT2 slots: exactly quantize_row() of its own rotated row (from
//     the BF16 run of the same inputs), i.e. the quantizer is the reference's, bit for bit;
//   - a run that mixes BF16 and INT2 slots (per token, so within the warps whose rows span
//     both kinds) stores each row as its kind's run did and leaves the other kind's slot
//     untouched.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#include "common/device_pools.hpp"
#include "oscar/kv/write.cuh"
#include "oscar/quant/row.hpp"
#include "oscar/rotate/dense.hpp"

namespace oscar::testing {

struct TensorCoreAppendShape {
  int layers = 2, heads = 2, head_dim = 128, group = 128, page = 16, tokens = 0;
  bool values_prerotated = false;
  int token_padding = 0;  // input elements after each token's heads (a token stride past heads * d)
};

// k or v [layer][token][head][dim] laid out with `padding` elements after each token's rows,
// the padding poisoned (a NaN pattern: a kernel that reads it stores wrong bytes).
inline std::vector<bf16_t> with_token_padding(const std::vector<bf16_t>& rows, int tokens_total, int row_elements,
                                             int padding) {
  std::vector<bf16_t> padded(size_t(tokens_total) * (row_elements + padding), bf16_t{0x7fc1});
  for (int t = 0; t < tokens_total; ++t) {
    std::copy_n(rows.begin() + size_t(t) * row_elements, row_elements, padded.begin() + size_t(t) * (row_elements + padding));
  }
  return padded;
}

// Inputs: k, v bf16 [layer][token][head][dim]; k_rotation, v_rotation float [layer][d][d]
// (empty: identity); clip ranks per layer.
struct TensorCoreAppendInputs {
  std::vector<bf16_t> k, v;
  std::vector<float> k_rotation, v_rotation;
  std::vector<int32_t> k_rank, v_rank;
  // LayeredKvPools::max_clip_distance, which picks the quantizer's compiled form (the bytes
  // must not depend on it); unset: widest_clip_distance of the ranks, as an engine sets it.
  std::optional<int32_t> max_clip_distance;
};

// |x·R_hi + x·R_lo - x·R| <= 2^-18 sum_i |x_i R_ij| (R_lo is R - R_hi to a bf16 rounding),
// and the fp32 accumulation of d <= 128 terms adds at most d·2^-23 = 2^-16 of the same sum:
// 2^-15 bounds both.
inline constexpr double kRotationErrorBound = 1.0 / 32768;

struct TensorCoreAppendReport {
  size_t elements = 0;
  size_t one_step_off = 0;     // rotated elements one bf16 step from the FMA reference's
  size_t further_off = 0;      // more than one step (where the sum cancels: a small y_j)
  size_t outside_bound = 0;    // farther from the exact product than the bound; must be 0
  size_t int2_mismatches = 0;  // INT2 bytes that differ from quantize_row of the GPU row; must be 0
  size_t mixed_mismatches = 0;  // bytes of the mixed BF16 / INT2 run unlike the pure runs'; must be 0
};

inline int64_t bf16_order(uint16_t bits) {  // bf16 bit patterns -> integers in value order
  return (bits & 0x8000u) ? -int64_t(bits & 0x7fffu) : int64_t(bits);
}

// One bf16 step (ulp) at the larger of |a| and |b|: what rounding the exact value can move.
inline double bf16_step(float a, double b) {
  const double m = std::max(std::fabs(double(a)), std::fabs(b));
  if (m == 0 || !std::isfinite(m)) return 0;
  return std::ldexp(1.0, std::max(std::ilogb(m), -126) - 7);
}

inline TensorCoreAppendReport run_tensor_core_append(const TensorCoreAppendShape& s, const TensorCoreAppendInputs& in) {
  const int d = s.head_dim;
  const int pages = (s.tokens + s.page - 1) / s.page;
  const Int2Layout layout{d, s.group, s.page};
  const size_t bf16_layer = size_t(pages) * s.heads * s.page * d;
  const size_t int2_layer = size_t(pages) * s.heads * layout.block_bytes();
  const std::vector<bf16_t> k_in = with_token_padding(in.k, s.layers * s.tokens, s.heads * d, s.token_padding);
  const std::vector<bf16_t> v_in = with_token_padding(in.v, s.layers * s.tokens, s.heads * d, s.token_padding);
  DeviceArray<bf16_t> k_bf16(s.layers * bf16_layer), v_bf16(k_bf16.count), d_k(k_in.size()), d_v(v_in.size());
  DeviceArray<uint8_t> k_int2(s.layers * int2_layer), v_int2(k_int2.count);
  DeviceArray<float> k_rot(in.k_rotation.size()), v_rot(in.v_rotation.size());
  DeviceArray<int32_t> k_rank(s.layers), v_rank(s.layers), flag(1);
  d_k.upload(k_in);
  d_v.upload(v_in);
  k_rot.upload(in.k_rotation);
  v_rot.upload(in.v_rotation);
  k_rank.upload(in.k_rank);
  v_rank.upload(in.v_rank);

  LayeredKvPools pools;
  pools.k_bf16 = Bf16PoolRef::packed(k_bf16.ptr, pages, s.heads, s.page, d);
  pools.v_bf16 = Bf16PoolRef::packed(v_bf16.ptr, pages, s.heads, s.page, d);
  pools.k_int2 = Int2PoolRef::packed(k_int2.ptr, pages, s.heads, layout);
  pools.v_int2 = Int2PoolRef::packed(v_int2.ptr, pages, s.heads, layout);
  pools.bf16_stride_layer = static_cast<int64_t>(bf16_layer);
  pools.int2_stride_layer = static_cast<int64_t>(int2_layer);
  pools.num_layers = s.layers;
  pools.k_rotation = in.k_rotation.empty() ? nullptr : k_rot.ptr;
  pools.v_rotation = in.v_rotation.empty() ? nullptr : v_rot.ptr;
  pools.k_clip_rank = k_rank.ptr;
  pools.v_clip_rank = v_rank.ptr;
  pools.max_clip_distance = in.max_clip_distance.value_or(widest_clip_distance(in.k_rank, in.v_rank, d));

  AppendParams p;
  p.pools = pools;
  p.k = d_k.ptr;
  p.v = d_v.ptr;
  p.in_stride_token = int64_t{s.heads} * d + s.token_padding;
  p.in_stride_layer = p.in_stride_token * s.tokens;
  p.num_tokens = s.tokens;
  p.values_prerotated = s.values_prerotated;
  p.rotation = AppendRotation::kTensorCores;
  p.error_flag = flag.ptr;
  // Run 0 stores every token in BF16 slots, run 1 every token in INT2 slots; poisoned first.
  // Run 2 (below) mixes them.
  const auto is_int2_in_mixed_run = [](int t) { return t % 3 != 0; };
  const auto run = [&](int32_t int2) {
    std::vector<TokenSlot> slots(s.tokens);
    for (int t = 0; t < s.tokens; ++t) slots[t] = {t / s.page, t % s.page, int2 == 2 ? int32_t{is_int2_in_mixed_run(t)} : int2};
    DeviceArray<TokenSlot> d_slots(slots.size());
    d_slots.upload(slots);
    p.slots = d_slots.ptr;
    k_int2.fill_bytes(0xa5);
    v_int2.fill_bytes(0xa5);
    if (int2 != 1) {
      k_bf16.fill_bytes(0xff);
      v_bf16.fill_bytes(0xff);
    }
    flag.fill_bytes(0);
    const Status status = append_kv(p);
    REQUIRE_MESSAGE(status.ok(), status.to_string());
    CUDA_REQUIRE(cudaDeviceSynchronize());
    REQUIRE(flag.download()[0] == 0);
  };
  run(0);
  run(1);

  TensorCoreAppendReport report;
  const std::vector<bf16_t> out_bf16[2] = {k_bf16.download(), v_bf16.download()};
  const std::vector<uint8_t> out_int2[2] = {k_int2.download(), v_int2.download()};

  // Run 2: a third of the tokens to BF16 slots, the rest to INT2. Slots are per token, so a
  // warp's 16 rows mix the two where they span a BF16 and an INT2 token (head counts below 16:
  // at 8 heads a warp holds tokens 2i and 2i + 1, mixed unless both are INT2, and the all-INT2
  // warps take the kernel's skip of its BF16 loop). Each row must store the bytes of its kind's
  // run above (the kernel is deterministic) and leave the other kind's slot poisoned.
  run(2);
  const std::vector<bf16_t> mixed_bf16[2] = {k_bf16.download(), v_bf16.download()};
  const std::vector<uint8_t> mixed_int2[2] = {k_int2.download(), v_int2.download()};
  for (int l = 0; l < s.layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int t = 0; t < s.tokens; ++t) {
        for (int h = 0; h < s.heads; ++h) {
          const int page = t / s.page, slot = t % s.page;
          const size_t row = l * bf16_layer + (size_t(page) * s.heads + h) * s.page * d + size_t(slot) * d;
          const size_t block = l * int2_layer + (size_t(page) * s.heads + h) * layout.block_bytes();
          const bool int2 = is_int2_in_mixed_run(t);
          for (int i = 0; i < d; ++i) {
            report.mixed_mismatches += mixed_bf16[kv][row + i].bits != (int2 ? uint16_t{0xffff} : out_bf16[kv][row + i].bits);
          }
          // The slot's code and metadata bytes in the mixed run's block and in the INT2 run's.
          const auto slot_bytes = [&](const std::vector<uint8_t>& pool) {
            const uint8_t* b = &pool[block];
            std::vector<uint8_t> bytes(layout.codes(b, slot), layout.codes(b, slot) + layout.code_bytes_per_row());
            const auto* meta_bytes = reinterpret_cast<const uint8_t*>(layout.meta(b, slot));
            bytes.insert(bytes.end(), meta_bytes, meta_bytes + layout.groups_per_row() * sizeof(QuantMeta));
            return bytes;
          };
          const std::vector<uint8_t> got = slot_bytes(mixed_int2[kv]), want = slot_bytes(out_int2[kv]);
          for (size_t i = 0; i < got.size(); ++i) report.mixed_mismatches += got[i] != (int2 ? want[i] : 0xa5);
        }
      }
    }
  }
  std::vector<float> x(d), y(d), gpu(d);
  std::vector<double> exact(d), bound(d);
  std::vector<uint8_t> codes(d / 4);
  std::vector<QuantMeta> meta(d / s.group);
  for (int l = 0; l < s.layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const std::vector<bf16_t>& input = kv ? in.v : in.k;
      const std::vector<float>& rotations = kv ? in.v_rotation : in.k_rotation;
      const float* rotation = rotations.empty() || (kv && s.values_prerotated) ? nullptr : &rotations[size_t(l) * d * d];
      const int rank = (kv ? in.v_rank : in.k_rank)[l];
      for (int t = 0; t < s.tokens; ++t) {
        for (int h = 0; h < s.heads; ++h) {
          const bf16_t* row = &input[((size_t(l) * s.tokens + t) * s.heads + h) * d];
          for (int i = 0; i < d; ++i) x[i] = bf16_to_float(row[i]);
          if (rotation) {
            rotate_row(x.data(), rotation, d, y.data());
          } else {
            y = x;
          }
          for (int j = 0; j < d; ++j) {  // the exact product and its error bound, in double
            double sum = 0, magnitude = 0;
            for (int i = 0; i < d; ++i) {
              const double term = double(x[i]) * (rotation ? rotation[size_t(i) * d + j] : double(i == j));
              sum += term;
              magnitude += std::fabs(term);
            }
            exact[j] = sum;
            bound[j] = kRotationErrorBound * magnitude;
          }
          const int page = t / s.page, slot = t % s.page;
          const bf16_t* stored = &out_bf16[kv][l * bf16_layer + (size_t(page) * s.heads + h) * s.page * d + size_t(slot) * d];
          for (int i = 0; i < d; ++i) {
            const bf16_t ref = float_to_bf16(y[i]);
            gpu[i] = bf16_to_float(stored[i]);
            ++report.elements;
            if (std::isnan(exact[i]) ? !std::isnan(gpu[i]) : !(std::fabs(gpu[i] - exact[i]) <= bound[i] + bf16_step(gpu[i], exact[i]))) {
              ++report.outside_bound;
            }
            if (ref.bits == stored[i].bits) continue;
            const int64_t steps = std::llabs(bf16_order(ref.bits) - bf16_order(stored[i].bits));
            (steps == 1 ? report.one_step_off : report.further_off) += 1;
          }
          quantize_row(gpu.data(), d, s.group, rank, codes.data(), meta.data());
          const uint8_t* block = &out_int2[kv][l * int2_layer + (size_t(page) * s.heads + h) * layout.block_bytes()];
          for (int b = 0; b < d / 4; ++b) report.int2_mismatches += codes[b] != layout.codes(block, slot)[b];
          const auto* stored_meta = reinterpret_cast<const uint8_t*>(layout.meta(block, slot));
          const auto* ref_meta = reinterpret_cast<const uint8_t*>(meta.data());
          for (size_t b = 0; b < meta.size() * sizeof(QuantMeta); ++b) report.int2_mismatches += ref_meta[b] != stored_meta[b];
        }
      }
    }
  }
  return report;
}

}  // namespace oscar::testing
