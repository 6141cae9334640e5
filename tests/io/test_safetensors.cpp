// The safetensors reader/writer: round trips, files laid out the way other writers lay them
// out, and rejection of every malformed header with a message.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "oscar/io/safetensors.hpp"

using namespace oscar;
using namespace oscar::io;

namespace {
std::vector<uint8_t> file_with_header(const std::string& json, size_t data_bytes) {
  std::vector<uint8_t> out(8 + json.size() + data_bytes, 0);
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(out.data() + 8, json.data(), json.size());
  for (size_t i = 0; i < data_bytes; ++i) out[8 + json.size() + i] = static_cast<uint8_t>(i * 7 + 1);
  return out;
}
std::string error_of(const std::vector<uint8_t>& bytes) {
  auto f = SafetensorsFile::parse(bytes, "t.safetensors");
  return f.ok() ? std::string() : f.status().message();
}
}  // namespace

TEST_CASE("writer output round-trips through the reader, for every float dtype") {
  SafetensorsWriter w;
  const std::vector<float> f32{1.5f, -2.25f, 3.0e-8f, 65504.0f, -0.0f, 7.0f};
  const std::vector<double> f64{1.0 / 3.0, -1e300};
  REQUIRE(w.add_f32("a.f32", {2, 3}, f32).ok());
  REQUIRE(w.add_f64("b.f64", {2}, f64).ok());
  // 1.0, -2.0 in fp16 (0x3c00, 0xc000) and bf16 (0x3f80, 0xc000), little-endian.
  REQUIRE(w.add("c.f16", DType::kF16, {2}, {0x00, 0x3c, 0x00, 0xc0}).ok());
  REQUIRE(w.add("d.bf16", DType::kBF16, {1, 2}, {0x80, 0x3f, 0x00, 0xc0}).ok());
  REQUIRE(w.add("e.empty", DType::kI32, {0, 4}, {}).ok());
  w.set_metadata("model", "tiny");
  const std::vector<uint8_t> bytes = w.serialize();
  CHECK((bytes.size() - 8) % 8 == 0);  // header padded: tensors start 8-byte aligned
  auto f = SafetensorsFile::parse(bytes);
  REQUIRE(f.ok());
  CHECK(f->metadata().at("model") == "tiny");
  CHECK(f->tensors().size() == 5);
  CHECK(*f->read_as<float>("a.f32") == f32);
  CHECK(*f->read_as<double>("b.f64") == f64);
  CHECK(*f->read_as<float>("c.f16") == std::vector<float>{1.0f, -2.0f});
  CHECK(*f->read_as<float>("d.bf16") == std::vector<float>{1.0f, -2.0f});
  CHECK(f->find("d.bf16")->shape == std::vector<int64_t>{1, 2});
  CHECK(f->read_as<float>("e.empty").status().message().find("I32") != std::string::npos);
  CHECK(f->read_as<float>("nope").status().message().find("no tensor \"nope\"") != std::string::npos);
  // Misuse of the writer.
  CHECK(!w.add("a.f32", DType::kF32, {1}, {0, 0, 0, 0}).ok());
  CHECK(!w.add("x", DType::kF32, {2}, {0, 0, 0, 0}).ok());
  CHECK(!w.add("__metadata__", DType::kU8, {1}, {0}).ok());
}

TEST_CASE("a file laid out like Python's safetensors (unpadded header, reordered keys) parses") {
  const std::string json =
      R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}})";
  auto f = SafetensorsFile::parse(file_with_header(json, 12));
  REQUIRE(f.ok());
  CHECK(f->find("a")->begin == 0);
  CHECK(f->find("b")->end == 12);
  CHECK(f->metadata().at("format") == "pt");
}

TEST_CASE("malformed headers are rejected with a message naming the problem") {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  CHECK(error_of(file_with_header(ok, 8)).empty());
  struct Case {
    std::string json;
    size_t data;
    const char* expect;
  };
  const Case cases[] = {
      {ok, 4, "needs more than the 4 bytes"},
      {ok, 12, "bytes after the last tensor"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 16, "need 12"},
      {R"({"a":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8, "unknown dtype"},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "non-negative"},
      {R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8, "non-negative"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "outside"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8, "data_offsets"},
      {R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8, "dtype"},
      {R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8, "shape"},
      {R"({"a":[1,2]})", 8, "not an object"},
      {R"([1,2])", 8, "not a JSON object"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8, "not valid JSON"},
      {R"({"__metadata__":{"k":3},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, "not a string"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8, "overlapping"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8, "expected 0"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8, "needs more than"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]}})", 8, "outside"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.json);
    const std::string e = error_of(file_with_header(c.json, c.data));
    CAPTURE(e);
    CHECK(e.find(c.expect) != std::string::npos);
    CHECK(e.find("t.safetensors") == 0);  // names the file
  }
  // Nesting deeper than a safetensors header has is refused before the parser builds it
  // (the 100 MB header cap alone allowed ~4 GB of nested arrays); brackets inside strings do
  // not count, and a header at the depth limit parses.
  const std::string deep = "{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  CHECK(error_of(file_with_header(deep, 0)) == "t.safetensors: the header nests deeper than 8 levels (not a safetensors header)");
  const std::string brackets = R"({"__metadata__":{"k":"[[[[[[[[[[{{{{{{{{\"]]"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  CHECK(error_of(file_with_header(brackets, 8)).empty());
  const std::string eight = R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":[[[[[[1]]]]]]}})";  // 8 levels
  CHECK(error_of(file_with_header(eight, 8)).empty());
  // Length prefix: too short a file, a header longer than the file, an absurd length.
  CHECK(error_of({1, 2, 3}).find("too short") != std::string::npos);
  std::vector<uint8_t> bad = file_with_header(ok, 8);
  bad[0] = 0xff;
  CHECK(error_of(bad).find("only") != std::string::npos);
  bad[7] = 0xff;
  CHECK(error_of(bad).find("100 MB") != std::string::npos);
}

TEST_CASE("open() reads the header only and tensors on demand; writes are atomic") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("oscar_st_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "x.safetensors").string();
  SafetensorsWriter w;
  const std::vector<float> values{1, 2, 3, 4};
  REQUIRE(w.add_f32("x", {4}, values).ok());
  REQUIRE(write_file_atomic(path, w.serialize()).ok());
  // Overwrite: the new content replaces the old, and no temporary file stays behind.
  SafetensorsWriter w2;
  REQUIRE(w2.add_f32("y", {2}, std::vector<float>{5, 6}).ok());
  REQUIRE(write_file_atomic(path, w2.serialize()).ok());
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  CHECK(files == 1);
  auto f = SafetensorsFile::open(path);
  REQUIRE(f.ok());
  CHECK(*f->read_as<float>("y") == std::vector<float>{5, 6});
  CHECK(f->find("x") == nullptr);
  // Truncated on disk.
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1);
  CHECK(SafetensorsFile::open(path).status().code() == StatusCode::kDataLoss);
  CHECK(SafetensorsFile::open((dir / "missing").string()).status().code() == StatusCode::kIoError);
  CHECK(write_file_atomic((dir / "no" / "such" / "dir").string(), {}).code() == StatusCode::kIoError);
  std::filesystem::remove_all(dir);
}

TEST_CASE("concurrent atomic writes to one path each install a whole file, through temporary files of their own") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("oscar_st_mt_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "p.safetensors").string();
  std::vector<std::vector<uint8_t>> files;
  for (int t = 0; t < 4; ++t) {
    SafetensorsWriter w;
    REQUIRE(w.add_f32("t", {4096}, std::vector<float>(4096, float(t))).ok());
    files.push_back(w.serialize());
  }
  std::vector<std::thread> threads;
  std::vector<int> failures(files.size(), 0);
  for (size_t t = 0; t < files.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) failures[t] += !write_file_atomic(path, files[t]).ok();
    });
  }
  for (std::thread& t : threads) t.join();
  CHECK(failures == std::vector<int>(files.size(), 0));
  auto f = SafetensorsFile::open(path);
  REQUIRE(f.ok());
  const std::vector<float> v = *f->read_as<float>("t");
  CHECK(std::count(v.begin(), v.end(), v[0]) == 4096);  // one writer's file, whole
  int entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++entries;
  CHECK(entries == 1);  // no temporary file left behind
  std::filesystem::remove_all(dir);
}

TEST_CASE("the writer refuses a shape whose size overflows instead of wrapping") {
  SafetensorsWriter w;
  const Status s = w.add("x", DType::kF32, {int64_t{1} << 32, int64_t{1} << 32}, {});
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().find("too large") != std::string::npos);
  CHECK(w.add("y", DType::kF64, {int64_t{1} << 61, 1}, {}).message().find("too large") != std::string::npos);
}
