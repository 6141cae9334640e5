// Accumulator files: an exact round trip (in memory and through an atomic save), the content
// checksum naming a changed value as corruption (before the value checks), files without one
// loading unchecked, truncation rejected, and a bounded fuzz of the reader.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "common/safetensors_edit.hpp"
#include "fit/fit_test_util.hpp"
#include "oscar/io/accumulator_file.hpp"

using namespace oscar;
using namespace oscar::io;

namespace {
const fit::ModelShape kShape{2, 4, 2, 16};

// Both passes over synthetic activations: C_K, C_V, A_h and attention-mass weighted values.
fit::CalibrationAccumulator make_accumulator() {
  auto acc = fit::CalibrationAccumulator::create(kShape);
  REQUIRE(acc.ok());
  const testing::Activations a = testing::make_activations(kShape, 40, 7);
  std::vector<float> weights(static_cast<size_t>(a.tokens) * kShape.num_kv_heads);
  std::mt19937_64 rng(3);
  for (float& w : weights) w = std::uniform_real_distribution<float>(0.0f, 2.0f)(rng);
  for (int32_t l = 0; l < kShape.num_layers; ++l) {
    REQUIRE(acc->add_chunk(l, a.q.data(), a.k.data(), a.v.data(), a.tokens).ok());
    REQUIRE(acc->add_values_weighted(l, a.v.data(), weights.data(), a.tokens).ok());
  }
  return std::move(*acc);
}

Result<fit::CalibrationAccumulator> parse(const std::vector<uint8_t>& bytes) {
  auto file = SafetensorsFile::parse(bytes, "acc.safetensors");
  if (!file.ok()) return file.status();
  return accumulators_from_safetensors(*file);
}
std::string error_of(const std::vector<uint8_t>& bytes) {
  auto acc = parse(bytes);
  return acc.ok() ? std::string() : acc.status().message();
}

// Byte k of element `element` of tensor `name` in a serialized file.
size_t byte_of(const std::vector<uint8_t>& bytes, const std::string& name, int64_t element, int k) {
  auto file = SafetensorsFile::parse(bytes);
  REQUIRE(file.ok());
  const TensorInfo* info = file->find(name);
  REQUIRE(info != nullptr);
  return static_cast<size_t>(testing::safetensors_data_start(bytes) + info->begin + 8 * element + k);
}
std::vector<uint8_t> with_metadata(const std::vector<uint8_t>& bytes, const std::string& key,
                                   const std::string* value, bool keep_checksum) {
  return testing::with_metadata_key(bytes, key, value, kAccumulatorChecksumKey, keep_checksum);
}
std::vector<uint8_t> without_checksum(const std::vector<uint8_t>& bytes) {
  return with_metadata(bytes, kAccumulatorChecksumKey, nullptr, false);
}

void check_same_sums(const fit::CalibrationAccumulator& a, const fit::CalibrationAccumulator& b) {
  CHECK(b.shape().num_layers == a.shape().num_layers);
  CHECK(b.value_weighting() == a.value_weighting());
  for (int32_t l = 0; l < a.shape().num_layers; ++l) {
    const fit::LayerSums &x = a.sums(l), &y = b.sums(l);
    // The file holds the full symmetric matrices; the accumulator fills the lower triangle.
    CHECK(fit::detail::symmetrized(x.ktk) == y.ktk);
    CHECK(fit::detail::symmetrized(x.vtv) == y.vtv);
    for (int32_t h = 0; h < a.shape().num_kv_heads; ++h) {
      CHECK(fit::detail::symmetrized(x.qtq[h]) == y.qtq[h]);
      CHECK(fit::detail::symmetrized(x.wvtv[h]) == y.wvtv[h]);
    }
    CHECK(x.wsum == y.wsum);
    CHECK(x.tokens == y.tokens);
    CHECK(x.value_tokens == y.value_tokens);
    CHECK(b.frozen_a(l) == a.frozen_a(l));
  }
}

// A worker of a distributed calibration with the authors' proxy weights: pass 1 over its own
// tokens, then pass 2 weighted by the A_h of `frozen_from` (itself when null).
fit::CalibrationAccumulator proxy_worker(uint64_t seed, const fit::CalibrationAccumulator* frozen_from) {
  auto acc = fit::CalibrationAccumulator::create(kShape);
  REQUIRE(acc.ok());
  const testing::Activations a = testing::make_activations(kShape, 24, seed);
  for (int32_t l = 0; l < kShape.num_layers; ++l) REQUIRE(acc->add_chunk(l, a.q.data(), a.k.data(), a.v.data(), a.tokens).ok());
  REQUIRE(acc->begin_value_pass(frozen_from ? *frozen_from : *acc).ok());
  for (int32_t l = 0; l < kShape.num_layers; ++l) REQUIRE(acc->add_values_proxy(l, a.k.data(), a.v.data(), a.tokens).ok());
  return std::move(*acc);
}

// The documented checksum recipe (docs/fitting.md), from the file's own metadata and bytes:
// "key=value\n" for format, format_version, num_layers, num_qo_heads, num_kv_heads, head_dim,
// value_weighting, then the bytes of the tensors `order` in that order (every tensor once).
std::string documented_crc(const SafetensorsFile& file, const std::vector<std::string>& order) {
  uint32_t crc = 0;
  for (const char* key : {"format", "format_version", "num_layers", "num_qo_heads", "num_kv_heads", "head_dim",
                          "value_weighting"}) {
    crc = crc32(std::string(key) + "=" + file.metadata().at(key) + "\n", crc);
  }
  CHECK(order.size() == file.tensors().size());
  for (const std::string& name : order) {
    const TensorInfo* info = file.find(name);
    REQUIRE(info != nullptr);
    crc = crc32(*file.read_bytes(*info), crc);
  }
  return detail::crc32_hex(crc);
}

// layers.0.qtq, .ktk, .vtv, .wvtv, .wsum, layers.1.qtq, ..., tokens, value_tokens.
std::vector<std::string> sums_order() {
  std::vector<std::string> order;
  for (int l = 0; l < kShape.num_layers; ++l) {
    for (const char* part : {"qtq", "ktk", "vtv", "wvtv", "wsum"}) order.push_back("layers." + std::to_string(l) + "." + part);
  }
  order.insert(order.end(), {"tokens", "value_tokens"});
  return order;
}
}  // namespace

TEST_CASE("accumulators round-trip exactly, in memory and through an atomic save") {
  const fit::CalibrationAccumulator acc = make_accumulator();
  const std::vector<uint8_t> bytes = *serialize_accumulators(acc);
  auto back = parse(bytes);
  REQUIRE(back.ok());
  check_same_sums(acc, *back);
  CHECK(back->sums(1).tokens == 40);

  const std::string path = (std::filesystem::temp_directory_path() /
                            ("oscar_acc_" + std::to_string(::getpid()) + ".safetensors"))
                               .string();
  REQUIRE(save_accumulators(acc, path).ok());
  auto loaded = load_accumulators(path);
  REQUIRE(loaded.ok());
  check_same_sums(acc, *loaded);
  std::filesystem::remove(path);
}

TEST_CASE("the content checksum names a changed value as corruption; files without one still load") {
  const std::vector<uint8_t> good = *serialize_accumulators(make_accumulator());
  const auto meta = SafetensorsFile::parse(good)->metadata();
  const std::string stored = meta.at(kAccumulatorChecksumKey);
  CHECK(stored.size() == 8);
  CHECK(stored.find_first_not_of("0123456789abcdef") == std::string::npos);

  // One mantissa bit of a value-pass covariance entry: a number every other check accepts.
  std::vector<uint8_t> flipped = good;
  flipped[byte_of(good, "layers.1.wvtv", 37, 0)] ^= 1u;
  // The top bytes of a layer-0 C_K entry set to a NaN's.
  std::vector<uint8_t> nan = good;
  nan[byte_of(good, "layers.0.ktk", 5, 7)] = 0x7f;
  nan[byte_of(good, "layers.0.ktk", 5, 6)] = 0xf8;
  // Low mantissa bits of a token count, and a different value weighting.
  std::vector<uint8_t> count = good;
  count[byte_of(good, "tokens", 0, 4)] ^= 0x10u;
  const std::string proxy = "proxy";
  struct Case {
    std::vector<uint8_t> bytes;
    const char* what;
  };
  for (const Case& c : std::vector<Case>{{flipped, "covariance bit"},
                                          {nan, "NaN entry"},
                                          {count, "token count"},
                                          {with_metadata(good, "value_weighting", &proxy, true), "value_weighting"}}) {
    CAPTURE(c.what);
    const std::string e = error_of(c.bytes);
    CHECK(e.find("acc.safetensors: content checksum mismatch (content_crc32 " + stored + ", computed ") == 0);
    CHECK(e.find("the file is corrupted") != std::string::npos);
  }
  // The same files without the checksum (an older writer's): the bit flip loads as it reads,
  // the NaN is refused by the value check that names its tensor.
  auto unchecked = parse(without_checksum(flipped));
  REQUIRE(unchecked.ok());
  CHECK(unchecked->sums(1).wvtv[0] != fit::detail::symmetrized(make_accumulator().sums(1).wvtv[0]));
  CHECK(error_of(without_checksum(nan)) == "acc.safetensors: tensor \"layers.0.ktk\" has a non-finite entry");
  // A checksum that is not 8 hex digits is a mismatch too.
  const std::string short_crc = "abc";
  CHECK(error_of(with_metadata(good, kAccumulatorChecksumKey, &short_crc, true)).find("content checksum mismatch") !=
        std::string::npos);
  // Without the key the file loads unchecked, the same sums.
  auto old = parse(without_checksum(good));
  REQUIRE(old.ok());
  check_same_sums(make_accumulator(), *old);
}

TEST_CASE("the checksum is the documented recipe, recomputed from the file's own bytes") {
  // docs/fitting.md: "key=value\n" for format, format_version, num_layers, num_qo_heads,
  // num_kv_heads, head_dim, value_weighting, then every tensor's stored bytes in the order
  // layers.0.qtq, .ktk, .vtv, .wvtv, .wsum, layers.1.qtq, ..., tokens, value_tokens.
  const std::vector<uint8_t> good = *serialize_accumulators(make_accumulator());
  auto file = SafetensorsFile::parse(good);
  REQUIRE(file.ok());
  CHECK(file->metadata().at(kAccumulatorChecksumKey) == documented_crc(*file, sums_order()));
}

TEST_CASE("structure errors: extra tensors, and sizes the file does not hold, refused before any allocation") {
  const std::vector<uint8_t> good = *serialize_accumulators(make_accumulator());
  auto file = SafetensorsFile::parse(good);
  REQUIRE(file.ok());
  SafetensorsWriter extra;
  for (const auto& [k, v] : file->metadata()) extra.set_metadata(k, v);
  for (const TensorInfo& t : file->tensors()) REQUIRE(extra.add(t.name, t.dtype, t.shape, *file->read_bytes(t)).ok());
  REQUIRE(extra.add_f64("layers.9.ktk", {1}, std::vector<double>{1.0}).ok());
  CHECK(error_of(extra.serialize()) == "acc.safetensors: unexpected tensor \"layers.9.ktk\"");
  // The largest shape the metadata may name (4096 layers of 4096 heads at d = 1024: terabytes
  // of sums) in a file of a few kilobytes: the first tensor's shape says no, nothing is allocated.
  const std::string big_layers = "4096", big_heads = "4096", big_d = "1024";
  std::vector<uint8_t> huge = with_metadata(good, "num_layers", &big_layers, false);
  huge = with_metadata(huge, "num_qo_heads", &big_heads, false);
  huge = with_metadata(huge, "num_kv_heads", &big_heads, false);
  huge = with_metadata(huge, "head_dim", &big_d, false);
  CHECK(error_of(huge) == "acc.safetensors: tensor \"layers.0.qtq\" has shape [2, 16, 16]");
  // A shape the accumulators refuse (query heads not a multiple of the KV heads).
  const std::string three = "3";
  CHECK(error_of(with_metadata(good, "num_qo_heads", &three, false)).find("acc.safetensors: ") == 0);
}

TEST_CASE("a truncated accumulator file is rejected: every header byte, every tensor's end, and between") {
  const std::vector<uint8_t> good = *serialize_accumulators(make_accumulator());
  const uint64_t data = testing::safetensors_data_start(good);
  auto file = SafetensorsFile::parse(good);
  REQUIRE(file.ok());
  std::vector<size_t> cuts;
  for (size_t n = 0; n <= data; ++n) cuts.push_back(n);
  for (const TensorInfo& t : file->tensors()) cuts.push_back(static_cast<size_t>(data + t.end - 1));
  for (size_t n = data; n < good.size(); n += 97) cuts.push_back(n);
  cuts.push_back(good.size() - 1);
  for (const size_t n : cuts) {
    CAPTURE(n);
    CHECK(!error_of(std::vector<uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n))).empty());
  }
}

TEST_CASE("fuzz: mutated accumulator files never crash the reader") {
  const std::vector<uint8_t> good = *serialize_accumulators(make_accumulator());
  const uint64_t header_end = testing::safetensors_data_start(good);
  std::mt19937_64 rng(2026);
  int rejected = 0, accepted = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<uint8_t> b = good;
    switch (trial % 3) {
      case 0:  // a few random byte flips anywhere
        for (int k = 0, n = 1 + static_cast<int>(rng() % 8); k < n; ++k) b[rng() % b.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
        break;
      case 1:  // one byte of the data flipped: always caught by the checksum
        b[header_end + rng() % (b.size() - header_end)] ^= static_cast<uint8_t>(1 + rng() % 255);
        break;
      default:  // truncated, then random garbage appended
        b.resize(rng() % b.size());
        for (int k = 0, n = static_cast<int>(rng() % 64); k < n; ++k) b.push_back(static_cast<uint8_t>(rng()));
        break;
    }
    const std::string e = error_of(b);
    if (e.empty()) {
      ++accepted;
    } else {
      ++rejected;
    }
    if (trial % 3 == 1) CHECK(e.find("content checksum mismatch") != std::string::npos);
  }
  CHECK(rejected > 0);
  MESSAGE("fuzz: " << rejected << " rejected, " << accepted << " accepted (benign mutations)");
}

TEST_CASE("a proxy value pass keeps its frozen A_h through a save: merge and add_chunk behave as before it") {
  // Two workers that each froze their own A_h: their pass-2 sums must not merge, live or loaded.
  const fit::CalibrationAccumulator a = proxy_worker(5, nullptr), b = proxy_worker(6, nullptr);
  auto a_file = parse(*serialize_accumulators(a));
  auto b_file = parse(*serialize_accumulators(b));
  REQUIRE_MESSAGE(a_file.ok(), a_file.status().to_string());
  REQUIRE_MESSAGE(b_file.ok(), b_file.status().to_string());
  check_same_sums(a, *a_file);
  CHECK(a_file->value_pass_started(0));
  fit::CalibrationAccumulator live = a;
  CHECK(live.merge(b).message().find("different frozen A_h") != std::string::npos);
  CHECK(a_file->merge(*b_file).message().find("different frozen A_h") != std::string::npos);
  // The same A_h (a loaded copy of the same worker) merges; pass 1 stays closed after a load.
  fit::CalibrationAccumulator again = a;
  CHECK(again.merge(*a_file).ok());
  const testing::Activations x = testing::make_activations(kShape, 4, 9);
  CHECK(a_file->add_chunk(0, x.q.data(), x.k.data(), x.v.data(), x.tokens).message().find("A_h is frozen") !=
        std::string::npos);
  // Workers whose pass 2 started from one merged pass 1 merge after a round trip.
  fit::CalibrationAccumulator merged = proxy_worker(7, nullptr);
  const fit::CalibrationAccumulator c = proxy_worker(8, &merged), d = proxy_worker(9, &merged);
  auto c_file = parse(*serialize_accumulators(c));
  auto d_file = parse(*serialize_accumulators(d));
  REQUIRE(c_file.ok());
  REQUIRE(d_file.ok());
  CHECK(c_file->merge(*d_file).ok());
}

TEST_CASE("the frozen A_h come last in the checksum, in layer order; version 1 files hold none") {
  auto worker = fit::CalibrationAccumulator::create(kShape);
  REQUIRE(worker.ok());
  const testing::Activations a = testing::make_activations(kShape, 16, 4);
  for (int32_t l = 0; l < kShape.num_layers; ++l) REQUIRE(worker->add_chunk(l, a.q.data(), a.k.data(), a.v.data(), a.tokens).ok());
  REQUIRE(worker->freeze_layer(1).ok());  // one layer's value pass started, as a tool that goes layer by layer
  const std::vector<uint8_t> good = *serialize_accumulators(*worker);
  auto file = SafetensorsFile::parse(good);
  REQUIRE(file.ok());
  CHECK(file->metadata().at("format_version") == "2");
  CHECK(file->find("layers.0.frozen_a") == nullptr);
  REQUIRE(file->find("layers.1.frozen_a") != nullptr);
  std::vector<std::string> order = sums_order();
  order.push_back("layers.1.frozen_a");  // after the sums and counts
  CHECK(file->metadata().at(kAccumulatorChecksumKey) == documented_crc(*file, order));
  auto back = parse(good);
  REQUIRE_MESSAGE(back.ok(), back.status().to_string());
  CHECK(!back->value_pass_started(0));
  CHECK(back->value_pass_started(1));
  check_same_sums(*worker, *back);
  // A changed A_h entry is corruption.
  std::vector<uint8_t> bad = good;
  bad[byte_of(good, "layers.1.frozen_a", 17, 3)] ^= 0x10;
  CHECK(error_of(bad).find("content checksum mismatch") != std::string::npos);
  // Version 1 (written before the A_h were saved): the same sums, no value pass state; a
  // frozen_a tensor there is not part of the format.
  const std::string one = "1";
  CHECK(error_of(with_metadata(good, "format_version", &one, false)) ==
        "acc.safetensors: unexpected tensor \"layers.1.frozen_a\"");
  auto v1 = parse(with_metadata(*serialize_accumulators(make_accumulator()), "format_version", &one, false));
  REQUIRE(v1.ok());
  CHECK(!v1->value_pass_started(0));
  const std::string three = "3";
  CHECK(error_of(with_metadata(good, "format_version", &three, false)).find("format_version 3") != std::string::npos);
}
