// Independent float64 implementations that the library's functors are tested against. They
// share no code with include/oscar: formulas are written from the method's definitions.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace oscar::testing {

// Rounds to the nearest value with `mantissa_bits` explicit fraction bits, ties to even, with
// gradual underflow below 2^min_exponent and overflow to Inf at the first value past max.
inline double naive_round_float(double x, int mantissa_bits, int min_exponent, double max_finite) {
  if (std::isnan(x)) return x;
  if (x == 0 || std::isinf(x)) return x;
  const double magnitude = std::abs(x);
  int exponent = static_cast<int>(std::floor(std::log2(magnitude)));
  if (std::ldexp(1.0, exponent) > magnitude) --exponent;  // guard log2 rounding
  if (std::ldexp(1.0, exponent + 1) <= magnitude) ++exponent;
  exponent = std::max(exponent, min_exponent);
  const double unit = std::ldexp(1.0, exponent - mantissa_bits);
  const double scaled = magnitude / unit;  // exact: a power-of-two division
  double rounded = std::floor(scaled);
  const double remainder = scaled - rounded;
  if (remainder > 0.5 || (remainder == 0.5 && std::fmod(rounded, 2.0) != 0.0)) rounded += 1.0;
  double result = rounded * unit;
  // Past the midpoint between max_finite and the next (unrepresentable) step: Inf.
  const double top_unit = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(max_finite))) - mantissa_bits);
  if (magnitude >= max_finite + top_unit / 2) result = std::numeric_limits<double>::infinity();
  return std::copysign(result, x);
}

inline double naive_fp16(double x) { return naive_round_float(x, 10, -14, 65504.0); }
inline double naive_bf16(double x) {
  return naive_round_float(x, 7, -126, (2.0 - std::ldexp(1.0, -7)) * std::ldexp(1.0, 127));
}

// Position of element e in a packed row (format.md): group g = e / G, quarter q = (e % G) / (G/4),
// column j = e % (G/4): byte g*G/4 + j, bits 2q..2q+1.
struct CodePosition {
  int byte;
  int shift;
};
inline CodePosition naive_code_position(int e, int group) {
  const int g = e / group;
  const int local = e - g * group;
  const int quarter_len = group / 4;
  return {g * quarter_len + local % quarter_len, 2 * (local / quarter_len)};
}

inline int naive_unpack(const uint8_t* packed, int e, int group) {
  const CodePosition p = naive_code_position(e, group);
  return (packed[p.byte] >> p.shift) & 3;
}

// The k-th smallest magnitude by sorting.
inline double naive_kth_magnitude(const std::vector<double>& x, int k) {
  std::vector<double> m(x.size());
  std::transform(x.begin(), x.end(), m.begin(), [](double v) { return std::abs(v); });
  std::sort(m.begin(), m.end());
  return m[k];
}

// y = x·R with R row-major [d][d].
inline std::vector<double> naive_rotate(const std::vector<double>& x, const std::vector<double>& r,
                                        int d) {
  std::vector<double> y(d, 0.0);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) y[j] += x[i] * r[static_cast<size_t>(i) * d + j];
  return y;
}
inline std::vector<double> naive_unrotate(const std::vector<double>& y, const std::vector<double>& r,
                                          int d) {
  std::vector<double> x(d, 0.0);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) x[i] += y[j] * r[static_cast<size_t>(i) * d + j];
  return x;
}

// Sylvester Hadamard, normalized, from its definition H[i][j] = (-1)^popcount(i&j) / sqrt(d).
inline std::vector<double> naive_hadamard(int d) {
  std::vector<double> h(static_cast<size_t>(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j)
      h[static_cast<size_t>(i) * d + j] =
          (std::popcount(static_cast<unsigned>(i & j)) % 2 ? -1.0 : 1.0) / std::sqrt(double(d));
  return h;
}

// softmax(q·Kᵀ·scale)·V over the keys with mask[t] true; returns lse too.
struct NaiveAttention {
  std::vector<double> out;
  double lse;
};
inline NaiveAttention naive_attention(const std::vector<double>& q,
                                      const std::vector<std::vector<double>>& keys,
                                      const std::vector<std::vector<double>>& values, double scale,
                                      size_t visible) {
  const size_t d = values.empty() ? q.size() : values[0].size();
  std::vector<double> s(visible);
  double m = -std::numeric_limits<double>::infinity();
  for (size_t t = 0; t < visible; ++t) {
    s[t] = scale * std::inner_product(q.begin(), q.end(), keys[t].begin(), 0.0);
    m = std::max(m, s[t]);
  }
  NaiveAttention r{std::vector<double>(d, 0.0), -std::numeric_limits<double>::infinity()};
  if (visible == 0) return r;
  double l = 0;
  for (size_t t = 0; t < visible; ++t) {
    const double p = std::exp(s[t] - m);
    l += p;
    for (size_t i = 0; i < d; ++i) r.out[i] += p * values[t][i];
  }
  for (double& o : r.out) o /= l;
  r.lse = m + std::log(l);
  return r;
}

}  // namespace oscar::testing
