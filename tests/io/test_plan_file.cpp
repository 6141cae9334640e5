// Plan files: exact round trip, atomic save, and rejection of every corruption with a message
// that names the tensor or key at fault; plus a bounded randomized fuzz of the readers.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "common/random.hpp"
#include "common/safetensors_edit.hpp"
#include "oscar/io/plan_file.hpp"

using namespace oscar;
using namespace oscar::io;

namespace {
Plan make_plan(int32_t layers = 3, int32_t d = 64) {
  Plan p;
  p.method = "oscar";
  p.head_dim = d;
  p.num_layers = layers;
  p.num_qo_heads = 8;
  p.num_kv_heads = 2;
  p.quant_group_size = 32;
  p.sink_tokens = 64;
  p.recent_tokens = 256;
  p.calibration_tokens = 30000;
  p.model_name = "Qwen/Qwen3-8B (synthetic)";
  for (int32_t l = 0; l < layers; ++l) {
    p.layers.push_back({testing::random_orthogonal(d, 2 * l + 1), testing::random_orthogonal(d, 2 * l + 2),
                        0.9f + 0.01f * l, 0.97f - 0.01f * l});
  }
  return p;
}

std::string error_of(const std::vector<uint8_t>& bytes) {
  auto p = parse_plan(bytes, "plan.safetensors");
  return p.ok() ? std::string() : p.status().message();
}

// Rewrites a plan's file with one tensor replaced (or dropped when dtype is absent), without
// the content checksum unless keep_checksum (so that the value checks behind it are reached,
// as for a plan written before the checksum existed).
std::vector<uint8_t> with_tensor(const Plan& plan, const std::string& name, DType dtype, std::vector<int64_t> shape,
                                 std::vector<uint8_t> bytes, bool drop = false, bool keep_checksum = false) {
  auto file = SafetensorsFile::parse(*serialize_plan(plan));
  SafetensorsWriter w;
  for (const auto& [k, v] : file->metadata()) {
    if (keep_checksum || k != kPlanChecksumKey) w.set_metadata(k, v);
  }
  bool replaced = false;
  for (const TensorInfo& t : file->tensors()) {
    if (t.name == name) {
      replaced = true;
      if (!drop) REQUIRE(w.add(name, dtype, shape, bytes).ok());
      continue;
    }
    REQUIRE(w.add(t.name, t.dtype, t.shape, *file->read_bytes(t)).ok());
  }
  if (!replaced && !drop) REQUIRE(w.add(name, dtype, shape, bytes).ok());
  return w.serialize();
}
std::vector<uint8_t> with_metadata(const Plan& plan, const std::string& key, const std::string* value,
                                   bool keep_checksum = false) {
  return testing::with_metadata_key(*serialize_plan(plan), key, value, kPlanChecksumKey, keep_checksum);
}
std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}
}  // namespace

TEST_CASE("a plan round-trips exactly, in memory and through an atomic save") {
  const Plan plan = make_plan();
  auto bytes = serialize_plan(plan);
  REQUIRE(bytes.ok());
  auto back = parse_plan(*bytes);
  REQUIRE(back.ok());
  CHECK(*back == plan);  // every float bit, every metadata field
  const std::string path =
      (std::filesystem::temp_directory_path() / ("oscar_plan_" + std::to_string(::getpid()) + ".safetensors")).string();
  REQUIRE(save_plan(plan, path).ok());
  auto loaded = load_plan(path);
  REQUIRE(loaded.ok());
  CHECK(*loaded == plan);
  // The file holds what the docs promise, under those names.
  auto file = SafetensorsFile::open(path);
  CHECK(file->find("layers.2.v_rotation")->shape == std::vector<int64_t>{64, 64});
  CHECK(file->find("k_clip_ratios")->shape == std::vector<int64_t>{3});
  for (const char* key : {"format", "format_version", "int2_format_version", "method", "clip_method", "head_dim",
                          "num_layers", "num_qo_heads", "num_kv_heads", "quant_group_size", "sink_tokens",
                          "recent_tokens", "calibration_tokens", "model_name", "content_crc32"}) {
    CHECK(file->metadata().count(key) == 1);
  }
  // Saving an invalid plan fails and leaves the good file in place.
  Plan bad = plan;
  bad.layers[1].k_rotation[5] += 0.1f;
  CHECK(save_plan(bad, path).message().find("layers.1.k_rotation: not orthogonal") != std::string::npos);
  CHECK(*load_plan(path) == plan);
  std::filesystem::remove(path);
  // And it converts to what the cache consumes.
  const auto q = to_layer_quantizers(plan);
  REQUIRE(q.size() == 3);
  CHECK(q[1].v_rotation == plan.layers[1].v_rotation);
  CHECK(q[2].k_clip_ratio == plan.layers[2].k_clip_ratio);
}

TEST_CASE("truncation anywhere is rejected") {
  const std::vector<uint8_t> bytes = *serialize_plan(make_plan(2));
  const uint64_t data_start = testing::safetensors_data_start(bytes);
  // Every byte of the length prefix and the header, then the data section every 61 bytes and
  // at each tensor boundary.
  std::vector<size_t> cuts;
  for (size_t n = 0; n < data_start; ++n) cuts.push_back(n);
  for (size_t n = data_start; n < bytes.size(); n += 61) cuts.push_back(n);
  auto file = SafetensorsFile::parse(bytes);
  for (const TensorInfo& t : file->tensors()) cuts.push_back(data_start + t.end - 1);
  for (size_t n : cuts) {
    CAPTURE(n);
    const std::string e = error_of(std::vector<uint8_t>(bytes.begin(), bytes.begin() + n));
    CHECK(!e.empty());
  }
}

TEST_CASE("wrong dtypes, shapes, values, metadata and extra tensors are rejected, naming the culprit") {
  const Plan plan = make_plan(2);
  const std::vector<float> r = plan.layers[0].k_rotation;
  struct Case {
    std::vector<uint8_t> bytes;
    const char* expect;
  };
  std::vector<float> not_orthogonal = r;
  not_orthogonal[7] *= 1.01f;
  std::vector<float> nan_entry = r;
  nan_entry[3] = std::nanf("");
  std::vector<uint8_t> f64(64 * 64 * 8, 0);
  const std::string bad_int = "12x", huge = "99999999999", v2 = "2", other = "safetensors", d7 = "96", g = "48";
  const std::vector<Case> cases = {
      {with_tensor(plan, "layers.0.k_rotation", DType::kF64, {64, 64}, f64), "layers.0.k_rotation\" has dtype F64"},
      {with_tensor(plan, "layers.1.v_rotation", DType::kF32, {32, 128}, f32_bytes(r)),
       "layers.1.v_rotation\" has shape [32, 128], expected [64, 64]"},
      {with_tensor(plan, "layers.0.v_rotation", DType::kF32, {64, 64}, f32_bytes(not_orthogonal)),
       "layers.0.v_rotation: not orthogonal"},
      {with_tensor(plan, "layers.1.k_rotation", DType::kF32, {64, 64}, f32_bytes(nan_entry)),
       "layers.1.k_rotation: entry 3 is not finite"},
      {with_tensor(plan, "layers.1.k_rotation", DType::kF32, {}, {}, true), "layers.1.k_rotation\" is missing"},
      {with_tensor(plan, "k_clip_ratios", DType::kF32, {2}, f32_bytes({0.9f, 1.5f})), "k_clip_ratios[1]"},
      {with_tensor(plan, "v_clip_ratios", DType::kF32, {3}, f32_bytes({0.9f, 0.9f, 0.9f})), "v_clip_ratios"},
      {with_tensor(plan, "layers.2.k_rotation", DType::kF32, {64, 64}, f32_bytes(r)), "unexpected tensor"},
      {with_metadata(plan, "head_dim", nullptr), "\"head_dim\" is missing"},
      {with_metadata(plan, "num_layers", &bad_int), "\"num_layers\" = \"12x\" is not an integer"},
      {with_metadata(plan, "num_layers", &huge), "num_layers"},
      {with_metadata(plan, "format_version", &v2), "format_version 2"},
      {with_metadata(plan, "format", &other), "not an oscar plan"},
      {with_metadata(plan, "head_dim", &d7), "head_dim 96"},
      {with_metadata(plan, "quant_group_size", &g), "quant_group_size 48"},
      {with_metadata(plan, "num_kv_heads", &d7), "num_qo_heads 8 is not a positive multiple"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.expect);
    const std::string e = error_of(c.bytes);
    CHECK(e.find(c.expect) != std::string::npos);
    CHECK(e.find("plan.safetensors") == 0);
  }
}

TEST_CASE("crc32 is zlib's") {
  CHECK(crc32(std::string_view("123456789")) == 0xCBF43926u);  // the CRC-32/ISO-HDLC check value
  CHECK(crc32(std::string_view("")) == 0u);
  CHECK(crc32(std::string_view("6789"), crc32(std::string_view("12345"))) == 0xCBF43926u);
}

TEST_CASE("the content checksum names a changed value as corruption; plans without one still load") {
  const Plan plan = make_plan(2);
  const std::vector<uint8_t> good = *serialize_plan(plan);
  const auto stored = SafetensorsFile::parse(good)->metadata().at(kPlanChecksumKey);
  CHECK(stored.size() == 8);
  CHECK(stored == detail::crc32_hex(detail::plan_content_crc32(SafetensorsFile::parse(good)->metadata(), plan)));
  // Values every other check accepts: a clip ratio, one mantissa bit of a rotation entry, the
  // sink size, the clip method.
  std::vector<float> r = plan.layers[1].v_rotation;
  r[100] = float_from_bits(float_bits(r[100]) ^ 1u);
  const std::string sink = "32", fixed = "fixed", name = "another model";
  struct Case {
    std::vector<uint8_t> bytes;
    const char* what;
  };
  const std::vector<Case> changed = {
      {with_tensor(plan, "k_clip_ratios", DType::kF32, {2}, f32_bytes({0.9f, 0.8f}), false, true), "clip ratio"},
      {with_tensor(plan, "layers.1.v_rotation", DType::kF32, {64, 64}, f32_bytes(r), false, true), "rotation bit"},
      {with_metadata(plan, "sink_tokens", &sink, true), "sink_tokens"},
      {with_metadata(plan, "clip_method", &fixed, true), "clip_method"},
  };
  for (const Case& c : changed) {
    CAPTURE(c.what);
    const std::string e = error_of(c.bytes);
    CHECK(e.find("plan.safetensors: content checksum mismatch (content_crc32 " + stored + ", computed ") == 0);
    CHECK(e.find("the file is corrupted") != std::string::npos);
  }
  // The same change in a file without the checksum (an older writer's) loads as it reads.
  const auto unchecked = parse_plan(with_tensor(plan, "k_clip_ratios", DType::kF32, {2}, f32_bytes({0.9f, 0.8f})));
  REQUIRE(unchecked.ok());
  CHECK(unchecked->layers[1].k_clip_ratio == 0.8f);
  // model_name is free text, outside the checksum.
  CHECK(parse_plan(with_metadata(plan, "model_name", &name, true)).ok());
  // A checksum that is not 8 hex digits is a mismatch too.
  const std::string short_crc = "abc";
  CHECK(error_of(with_metadata(plan, kPlanChecksumKey, &short_crc, true)).find("content checksum mismatch") !=
        std::string::npos);
  // A method that is not printable ASCII is refused at save: the writer would store it as
  // U+FFFD, and the file would then fail its own checksum. The file already there stays.
  const std::string path =
      (std::filesystem::temp_directory_path() / ("oscar_plan_crc_" + std::to_string(::getpid()) + ".safetensors")).string();
  REQUIRE(save_plan(plan, path).ok());
  Plan odd = plan;
  odd.method = "oscar\xff";
  CHECK(save_plan(odd, path).message() == "plan method must be printable ASCII (a name such as \"oscar\")");
  odd = plan;
  odd.clip_method = "fixed\n";
  CHECK(!serialize_plan(odd).ok());
  CHECK(*load_plan(path) == plan);
  std::filesystem::remove(path);
  // Without the key the plan loads unchecked, the same plan.
  auto old = parse_plan(with_metadata(plan, kPlanChecksumKey, nullptr));
  REQUIRE(old.ok());
  CHECK(*old == plan);
}

TEST_CASE("a plan for another model is refused by check_plan_matches") {
  const Plan plan = make_plan(2);
  host::CacheConfig c;
  c.num_layers = 2;
  c.num_qo_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.quant_group_size = 32;
  CHECK(check_plan_matches(plan, c).ok());
  c.quant_group_size = 0;
  CHECK(check_plan_matches(plan, c).message() ==
        "plan was fitted for quant_group_size = 32, the model declares 64");
  c.quant_group_size = 32;
  c.num_layers = 36;
  CHECK(check_plan_matches(plan, c).message().find("num_layers = 2, the model declares 36") != std::string::npos);
  c.num_layers = 2;
  c.head_dim = 128;
  CHECK(check_plan_matches(plan, c).message().find("head_dim") != std::string::npos);
}

// Bounded fuzz (runs in CI in about a second): mutations of a valid plan file must either be
// rejected with a message or parse to a plan that passes validation; never crash, never read
// out of bounds (the address sanitizer build checks that part: see docs/fitting.md).
TEST_CASE("fuzz: mutated plan files never crash the readers") {
  const std::vector<uint8_t> good = *serialize_plan(make_plan(1));
  const uint64_t data_start = testing::safetensors_data_start(good);
  std::mt19937_64 rng(12345);
  int rejected = 0, accepted = 0;
  auto run = [&](const std::vector<uint8_t>& bytes) {
    auto p = parse_plan(bytes, "fuzz");
    if (p.ok()) {
      CHECK(validate(*p).ok());
      ++accepted;
    } else {
      CHECK(!p.status().message().empty());
      ++rejected;
    }
  };
  // Every single-byte flip of the length prefix and the header.
  for (size_t i = 0; i < data_start; ++i) {
    std::vector<uint8_t> b = good;
    b[i] ^= static_cast<uint8_t>(1u << (i % 8));
    run(b);
  }
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> b = good;
    switch (trial % 5) {
      case 0:  // a few random byte flips anywhere
        for (int k = 0, n = 1 + static_cast<int>(rng() % 8); k < n; ++k) b[rng() % b.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
        break;
      case 1:  // a random byte of the header replaced by JSON punctuation
        b[8 + rng() % (data_start - 8)] = static_cast<uint8_t>("{}[]\",:0-9e "[rng() % 12]);
        break;
      case 2:  // truncated, then random garbage appended
        b.resize(rng() % b.size());
        for (int k = 0, n = static_cast<int>(rng() % 64); k < n; ++k) b.push_back(static_cast<uint8_t>(rng()));
        break;
      case 3:  // a random length prefix
        for (int k = 0; k < 8; ++k) b[k] = static_cast<uint8_t>(k < 3 || rng() % 4 == 0 ? rng() : 0);
        break;
      default:  // pure garbage
        b.assign(rng() % 512, 0);
        for (uint8_t& x : b) x = static_cast<uint8_t>(rng());
        break;
    }
    run(b);
  }
  CHECK(rejected > 0);
  MESSAGE("fuzz: " << rejected << " rejected, " << accepted << " accepted (benign mutations)");
}
