// The GGUF reader: well-formed files parse, malformed ones (truncated anywhere, bad magic,
// unknown types, offsets out of range, absurd counts) give a clear Status and never crash;
// every block type dequantizes like an independent per-element reference written from the
// format description (ggml's block layouts).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "model/gguf_writer.hpp"

using oscar::StatusCode;
using oscar::decode::GgmlType;
using oscar::decode::GgufFile;
using oscar::testing::GgufWriter;

namespace {

// IEEE half -> double, from the definition (sign, 5-bit exponent bias 15, 10-bit fraction).
double half_to_double(uint16_t h) {
  const int sign = h >> 15, e = (h >> 10) & 31, f = h & 1023;
  double v = e == 0 ? std::ldexp(f, -24) : std::ldexp(1024 + f, e - 25);
  return sign ? -v : v;
}
uint16_t rd16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

// A random finite fp16 scale in [2^-10, 2^2): random fractions and exponents.
uint16_t random_scale(std::mt19937& rng, bool negative_ok) {
  const uint16_t e = static_cast<uint16_t>(5 + rng() % 12);
  uint16_t h = static_cast<uint16_t>((e << 10) | (rng() & 1023));
  if (negative_ok && (rng() & 1)) h |= 0x8000;
  return h;
}

// Per-element references: element i of one block, from the byte layout.
double ref_element(uint32_t type, const uint8_t* b, int i) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: { float f; std::memcpy(&f, b, 4); return f; }
    case GgmlType::kF16: return half_to_double(rd16(b));
    case GgmlType::kBF16: {
      const uint32_t bits = static_cast<uint32_t>(rd16(b)) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case GgmlType::kQ4_0: {  // d, then qs[16]: element i is the low nibble of qs[i] (i < 16) or the high of qs[i-16]
      const int q = i < 16 ? (b[2 + i] & 15) : (b[2 + i - 16] >> 4);
      return (q - 8) * half_to_double(rd16(b));
    }
    case GgmlType::kQ4_1: {
      const int q = i < 16 ? (b[4 + i] & 15) : (b[4 + i - 16] >> 4);
      return q * half_to_double(rd16(b)) + half_to_double(rd16(b + 2));
    }
    case GgmlType::kQ5_0: {  // d, qh (32 bits, bit i = 5th bit of element i), qs[16]
      const uint32_t qh = b[2] | (b[3] << 8) | (b[4] << 16) | (static_cast<uint32_t>(b[5]) << 24);
      const int lo = i < 16 ? (b[6 + i] & 15) : (b[6 + i - 16] >> 4);
      const int q = lo + 16 * static_cast<int>((qh >> i) & 1);
      return (q - 16) * half_to_double(rd16(b));
    }
    case GgmlType::kQ5_1: {
      const uint32_t qh = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
      const int lo = i < 16 ? (b[8 + i] & 15) : (b[8 + i - 16] >> 4);
      const int q = lo + 16 * static_cast<int>((qh >> i) & 1);
      return q * half_to_double(rd16(b)) + half_to_double(rd16(b + 2));
    }
    case GgmlType::kQ8_0: return static_cast<int8_t>(b[2 + i]) * half_to_double(rd16(b));
    case GgmlType::kQ4_K: {
      // d, dmin, 12 bytes of scales, qs[128]. Sub-block j = i / 32 has a 6-bit scale and min:
      // j < 4: scale = s[j] & 63, min = s[j+4] & 63; j >= 4: low 4 bits in s[j+4] (scale low
      // nibble, min high nibble), high 2 bits in the top bits of s[j-4] (scale) and s[j] (min).
      const uint8_t* s = b + 4;
      const int j = i / 32;
      int sc, mn;
      if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
      } else {
        sc = (s[j + 4] & 15) + 16 * (s[j - 4] >> 6);
        mn = (s[j + 4] >> 4) + 16 * (s[j] >> 6);
      }
      // Sub-blocks 2k and 2k+1 share 32 bytes: low nibbles, then high nibbles.
      const uint8_t byte = b[16 + (j / 2) * 32 + i % 32];
      const int q = j % 2 == 0 ? (byte & 15) : (byte >> 4);
      return half_to_double(rd16(b)) * sc * q - half_to_double(rd16(b + 2)) * mn;
    }
    case GgmlType::kQ6_K: {
      // ql[128], qh[64], scales[16] (int8), d. Each half of 128 elements uses 64 ql bytes,
      // 32 qh bytes and 8 scales; quarter g of a half: ql low nibbles (g = 0, 1: bytes l and
      // l + 32) or high nibbles (g = 2, 3), 2 high bits at shift 2g of qh[l]; scale l/16 + 2g.
      const int n = i / 128, r = i % 128, g = r / 32, l = r % 32;
      const uint8_t qlb = b[n * 64 + l + (g % 2) * 32];
      const int low = g < 2 ? (qlb & 15) : (qlb >> 4);
      const int high = (b[128 + n * 32 + l] >> (2 * g)) & 3;
      const int q = low + 16 * high - 32;
      const int sc = static_cast<int8_t>(b[192 + n * 8 + l / 16 + 2 * g]);
      return half_to_double(rd16(b + 208)) * sc * q;
    }
  }
  return NAN;
}

std::vector<uint8_t> random_blocks(uint32_t type, int blocks, std::mt19937& rng) {
  const auto shape = oscar::decode::block_shape(type);
  std::vector<uint8_t> data(static_cast<size_t>(shape.bytes * blocks));
  for (auto& x : data) x = static_cast<uint8_t>(rng());
  for (int k = 0; k < blocks; ++k) {
    uint8_t* b = data.data() + k * shape.bytes;
    auto put = [&](int at, uint16_t h) { b[at] = h & 0xFF; b[at + 1] = h >> 8; };
    switch (static_cast<GgmlType>(type)) {
      case GgmlType::kF32: { const float f = std::normal_distribution<float>()(rng); std::memcpy(b, &f, 4); break; }
      case GgmlType::kF16: put(0, random_scale(rng, true)); break;
      case GgmlType::kBF16: put(0, static_cast<uint16_t>((rng() & 0x807F) | ((120 + rng() % 16) << 7))); break;
      case GgmlType::kQ4_0: case GgmlType::kQ5_0: case GgmlType::kQ8_0: put(0, random_scale(rng, true)); break;
      case GgmlType::kQ4_1: case GgmlType::kQ5_1: case GgmlType::kQ4_K:
        put(0, random_scale(rng, true));
        put(2, random_scale(rng, true));
        break;
      case GgmlType::kQ6_K: put(208, random_scale(rng, true)); break;
    }
  }
  return data;
}

// Built with append: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string here.
std::string tensor_name(uint32_t type) {
  std::string name = "t";
  name.append(std::to_string(type));
  return name;
}

GgufFile parse_ok(std::vector<uint8_t> bytes) {
  auto f = GgufFile::parse(std::move(bytes), "test.gguf");
  REQUIRE_MESSAGE(f.ok(), f.status().to_string());
  return std::move(f).value();
}

// A small valid file: metadata of several types and two tensors (F32 and Q8_0).
GgufWriter sample_writer() {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", 2);
  w.add_f32("llama.rope.freq_base", 1e5f);
  w.add_bool("flag", true);
  w.add_string_array("names", {"a", "bc", ""});
  w.add_i32_array("ints", {-1, 7});
  std::vector<uint8_t> f32(4 * 6);
  for (int i = 0; i < 6; ++i) {
    const float v = static_cast<float>(i) - 2.5f;
    std::memcpy(f32.data() + 4 * i, &v, 4);
  }
  w.add_tensor({"vec", {3, 2}, 0, f32});
  std::mt19937 rng(7);
  w.add_tensor({"q8", {64}, 8, random_blocks(8, 2, rng)});
  return w;
}

}  // namespace

TEST_CASE("a well-formed GGUF parses: metadata, tensor table, data") {
  GgufFile f = parse_ok(sample_writer().build());
  CHECK(f.version() == 3);
  CHECK(*f.get_string("general.architecture") == "llama");
  CHECK(*f.get_int("llama.block_count") == 2);
  CHECK(*f.get_float("llama.rope.freq_base") == doctest::Approx(1e5));
  CHECK(*f.get_int("flag") == 1);
  REQUIRE(f.find("names") != nullptr);
  CHECK(f.find("names")->strings == std::vector<std::string>{"a", "bc", ""});
  CHECK(f.find("ints")->ints == std::vector<int64_t>{-1, 7});
  REQUIRE(f.tensors().size() == 2);
  auto vec = f.read_f32("vec", {3, 2});
  REQUIRE(vec.ok());
  for (int i = 0; i < 6; ++i) CHECK((*vec)[static_cast<size_t>(i)] == static_cast<float>(i) - 2.5f);
  CHECK(f.read_f32("vec", {2, 3}).status().code() == StatusCode::kDataLoss);  // wrong shape
  CHECK(f.read_f32("nope").status().message().find("'nope' is missing") != std::string::npos);
  CHECK(f.get_int("general.architecture").status().message().find("not an integer") != std::string::npos);
}

TEST_CASE("a file truncated at any byte gives a data-loss error, never a crash") {
  const std::vector<uint8_t> full = sample_writer().build();
  for (size_t n = 0; n < full.size(); ++n) {
    auto f = GgufFile::parse(std::vector<uint8_t>(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n)), "cut.gguf");
    REQUIRE_MESSAGE(!f.ok(), "a prefix of " << n << " bytes parsed");
    CHECK(f.status().code() == StatusCode::kDataLoss);
    const std::string& m = f.status().message();
    const bool clear = m.find("truncated") != std::string::npos || m.find("cannot fit") != std::string::npos ||
                       m.find("remain") != std::string::npos || m.find("outside") != std::string::npos;
    CHECK_MESSAGE(clear, "prefix " << n << ": " << m);
  }
}

TEST_CASE("bad magic, unsupported version, unknown types") {
  GgufWriter w = sample_writer();
  w.magic[0] = 'X';
  auto f = GgufFile::parse(w.build(), "bad.gguf");
  CHECK(f.status().message().find("not a GGUF file") != std::string::npos);

  w = sample_writer();
  w.version = 1;
  f = GgufFile::parse(w.build(), "old.gguf");
  CHECK(f.status().code() == StatusCode::kUnsupported);
  CHECK(f.status().message().find("version 1") != std::string::npos);

  w = GgufWriter();
  w.add_tensor({"t", {32}, 99, std::vector<uint8_t>(64)});
  f = GgufFile::parse(w.build(), "type.gguf");
  CHECK(f.status().code() == StatusCode::kUnsupported);
  CHECK(f.status().message().find("'t' has tensor type type 99") != std::string::npos);

  w = GgufWriter();
  w.add_raw("weird", 42, {0, 0, 0, 0});
  f = GgufFile::parse(w.build(), "kv.gguf");
  CHECK(f.status().message().find("unknown value type 42") != std::string::npos);

  w = GgufWriter();
  w.add_raw("b", 7, {2});  // a bool that is neither 0 nor 1
  f = GgufFile::parse(w.build(), "bool.gguf");
  CHECK(f.status().message().find("bool value 2") != std::string::npos);
}

TEST_CASE("offsets, shapes and counts out of range") {
  GgufWriter w;
  w.add_tensor({"t", {32}, 0, std::vector<uint8_t>(128), 4096});  // past the end
  auto f = GgufFile::parse(w.build(), "off.gguf");
  CHECK(f.status().message().find("outside the data section") != std::string::npos);

  w = GgufWriter();
  w.add_tensor({"t", {32}, 0, std::vector<uint8_t>(128), 8});  // not aligned
  f = GgufFile::parse(w.build(), "align.gguf");
  CHECK(f.status().message().find("not a multiple of the alignment") != std::string::npos);

  w = GgufWriter();
  w.add_tensor({"t", {30}, 8, std::vector<uint8_t>(34)});  // Q8_0 row not a multiple of 32
  f = GgufFile::parse(w.build(), "block.gguf");
  CHECK(f.status().message().find("block size") != std::string::npos);

  w = GgufWriter();
  w.add_tensor({"t", {1, 1, 1, 1, 1}, 0, std::vector<uint8_t>(4)});
  f = GgufFile::parse(w.build(), "dims.gguf");
  CHECK(f.status().message().find("5 dimensions") != std::string::npos);

  w = GgufWriter();
  w.add_tensor({"t", {0}, 0, {}});
  f = GgufFile::parse(w.build(), "zero.gguf");
  CHECK(f.status().message().find("invalid dimension 0") != std::string::npos);

  w = GgufWriter();
  w.add_tensor({"t", {uint64_t{1} << 39, uint64_t{1} << 39}, 0, {}});  // overflowing element count
  f = GgufFile::parse(w.build(), "huge.gguf");
  CHECK(f.status().message().find("invalid dimension") != std::string::npos);

  // A string or array whose length exceeds the file: rejected before any allocation.
  w = GgufWriter();
  std::vector<uint8_t> value = GgufWriter::bytes_of(uint64_t{1} << 60);
  w.add_raw("s", 8, value);
  f = GgufFile::parse(w.build(), "str.gguf");
  CHECK(f.status().message().find("remain") != std::string::npos);

  w = GgufWriter();
  std::vector<uint8_t> arr = GgufWriter::bytes_of(uint32_t{4});
  GgufWriter::append(arr, GgufWriter::bytes_of(uint64_t{1} << 40));
  w.add_raw("a", 9, arr);
  f = GgufFile::parse(w.build(), "arr.gguf");
  CHECK(f.status().message().find("more than the rest of the file") != std::string::npos);

  // Absurd header counts.
  std::vector<uint8_t> header = {'G', 'G', 'U', 'F'};
  GgufWriter::append(header, GgufWriter::bytes_of(uint32_t{3}));
  GgufWriter::append(header, GgufWriter::bytes_of(uint64_t{1} << 50));
  GgufWriter::append(header, GgufWriter::bytes_of(uint64_t{0}));
  f = GgufFile::parse(header, "count.gguf");
  CHECK(f.status().message().find("cannot fit") != std::string::npos);

  // A bad alignment value.
  w = GgufWriter();
  w.add_u32("general.alignment", 24);
  f = GgufFile::parse(w.build(), "a.gguf");
  CHECK(f.status().message().find("power of two") != std::string::npos);
}

TEST_CASE("a missing file is an i/o error naming the path") {
  auto f = GgufFile::open("/nonexistent/dir/model.gguf");
  CHECK(f.status().code() == StatusCode::kIoError);
  CHECK(f.status().message().find("/nonexistent/dir/model.gguf") != std::string::npos);
}

TEST_CASE("every block type dequantizes like the per-element reference") {
  std::mt19937 rng(2024);
  for (uint32_t type : {0u, 1u, 30u, 2u, 3u, 6u, 7u, 8u, 12u, 14u}) {
    CAPTURE(oscar::decode::ggml_type_name(type));
    const auto shape = oscar::decode::block_shape(type);
    const int blocks = static_cast<int>(std::max<int64_t>(1, 512 / shape.elements));
    const std::vector<uint8_t> data = random_blocks(type, blocks, rng);
    std::vector<float> out(static_cast<size_t>(blocks * shape.elements));
    REQUIRE(oscar::decode::dequantize(type, data.data(), blocks * shape.elements, out.data()).ok());
    // The library works in float: a product of up to 3 factors and one sum, each rounded
    // once (relative 2^-24), against a double reference: 4 roundings of the largest term.
    for (int k = 0; k < blocks; ++k) {
      for (int i = 0; i < shape.elements; ++i) {
        const double ref = ref_element(type, data.data() + k * shape.bytes, static_cast<int>(i));
        const double got = out[static_cast<size_t>(k * shape.elements + i)];
        // Largest |term| with |d|, |m| < 4: e.g. Q4_K d*63*15, Q6_K d*128*32, Q8_0 d*128.
        double bound = 0;
        switch (type) {
          case 2: bound = 32; break;
          case 3: case 6: bound = 64; break;
          case 7: bound = 128; break;
          case 8: bound = 512; break;
          case 12: bound = 4096; break;
          case 14: bound = 16384; break;
          default: bound = 0;  // F32, F16, BF16: exact conversions
        }
        const double scale = std::max(bound, std::abs(ref));
        REQUIRE_MESSAGE(std::abs(got - ref) <= 4 * std::ldexp(scale, -24),
                        "block " << k << " element " << i << ": " << got << " vs " << ref);
      }
    }
  }
  // Unknown types and partial blocks are errors, not reads past the buffer.
  float y[32];
  uint8_t x[64] = {};
  CHECK(oscar::decode::dequantize(99, x, 32, y).code() == StatusCode::kUnsupported);
  CHECK(oscar::decode::dequantize(8, x, 31, y).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("tensors of every type read back through the file") {
  std::mt19937 rng(5);
  GgufWriter w;
  std::vector<std::pair<uint32_t, std::vector<uint8_t>>> made;
  for (uint32_t type : {0u, 1u, 30u, 2u, 3u, 6u, 7u, 8u, 12u, 14u}) {
    const auto shape = oscar::decode::block_shape(type);
    const int64_t cols = 256;
    const std::vector<uint8_t> data = random_blocks(type, static_cast<int>(2 * cols / shape.elements), rng);
    w.add_tensor({tensor_name(type), {static_cast<uint64_t>(cols), 2}, type, data});
    made.emplace_back(type, data);
  }
  GgufFile f = parse_ok(w.build());
  for (const auto& [type, data] : made) {
    CAPTURE(type);
    auto t = f.read_f32(tensor_name(type), {256, 2});
    REQUIRE(t.ok());
    std::vector<float> direct(512);
    REQUIRE(oscar::decode::dequantize(type, data.data(), 512, direct.data()).ok());
    CHECK(*t == direct);
  }
}
