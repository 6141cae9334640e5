// python/oscar_plan.py, the plan reader for Python engines, against the C++ one: a plan written
// by oscar::io::save_plan reads back in Python with the same rotations and ratios and the
// same clip ranks as oscar::clip_rank (ratios on and off the rank boundaries, 1 = no clipping),
// and broken files the C++ loader refuses (empty, truncated, cut, a rotation not orthogonal,
// another INT2 format version, content that does not match its checksum) are refused in Python with the problem named (exit 2). Runs Debian's python3 with python3-numpy (scripts/install-deps.sh).
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/command.hpp"
#include "common/safetensors_edit.hpp"
#include "common/random.hpp"
#include "oscar/io/plan_file.hpp"
#include "oscar/io/safetensors.hpp"
#include "oscar/quant/clip.hpp"

namespace {

const std::filesystem::path kDir = std::filesystem::temp_directory_path() / "oscar_python_plan_reader";

oscar::testing::CommandResult python(const std::string& args) {
  std::filesystem::create_directories(kDir);
  return oscar::testing::run_command(std::string(OSCAR_PYTHON3) + " " + OSCAR_PLAN_PY + " " + args, kDir);
}

// A plan of 4 layers at d = 64 whose ratios sit on and between clip-rank boundaries.
oscar::io::Plan make_plan() {
  oscar::io::Plan p;
  p.method = "oscar";
  p.head_dim = 64;
  p.num_layers = 4;
  p.num_qo_heads = 9;
  p.num_kv_heads = 3;
  p.model_name = "synthetic";
  const float k_ratios[] = {0.96f, 0.875f, 1.0f, 0.5f + 1e-7f};
  const float v_ratios[] = {0.92f, 0.984375f, 0.015625f, 1.0f};
  for (int32_t l = 0; l < 4; ++l) {
    p.layers.push_back({oscar::testing::random_orthogonal(64, 2 * l + 1), oscar::testing::random_orthogonal(64, 2 * l + 2),
                        k_ratios[l], v_ratios[l]});
  }
  return p;
}

}  // namespace

TEST_CASE("the Python plan reader reads what save_plan writes, with oscar::clip_rank's ranks") {
  const oscar::io::Plan plan = make_plan();
  const std::string file = (kDir / "plan.safetensors").string();
  std::filesystem::create_directories(kDir);
  REQUIRE(oscar::io::save_plan(plan, file).ok());
  const auto r = python(file);
  INFO(r.err);
  REQUIRE(r.code == 0);
  CHECK(r.out.find("method=oscar clip_method=fitted num_layers=4 head_dim=64 num_qo_heads=9 num_kv_heads=3") !=
        std::string::npos);
  for (int32_t l = 0; l < 4; ++l) {
    const auto& layer = plan.layers[size_t(l)];
    char line[160];
    std::snprintf(line, sizeof(line), "layer %d: rho_k=%.4f rank_k=%d rho_v=%.4f rank_v=%d", l, layer.k_clip_ratio,
                  oscar::clip_rank(layer.k_clip_ratio, 64), layer.v_clip_ratio, oscar::clip_rank(layer.v_clip_ratio, 64));
    CAPTURE(line);
    CHECK(r.out.find(line) != std::string::npos);
  }
  // The rotations: two elements, printed by Python's repr of a float32 (shortest round trip).
  const std::string check = std::string(OSCAR_PYTHON3) + " -c \"import sys; sys.path.insert(0, '" +
                            std::filesystem::path(OSCAR_PLAN_PY).parent_path().string() +
                            "'); import oscar_plan, numpy as np; p = oscar_plan.load_plan('" + file +
                            "'); print(p.k_rotation[1, 2, 3], p.v_rotation[3, 63, 0], p.k_rotation.shape)\"";
  const auto values = oscar::testing::run_command(check, kDir);
  INFO(values.err);
  REQUIRE(values.code == 0);
  std::istringstream got(values.out);
  double a = 0, b = 0;
  got >> a >> b;
  CHECK(float(a) == plan.layers[1].k_rotation[2 * 64 + 3]);
  CHECK(float(b) == plan.layers[3].v_rotation[63 * 64 + 0]);
  CHECK(values.out.find("(4, 64, 64)") != std::string::npos);
}

TEST_CASE("the Python plan reader refuses broken plans and names the problem") {
  std::filesystem::create_directories(kDir);
  auto write = [](const std::string& name, const std::vector<uint8_t>& bytes) {
    const std::string path = (kDir / name).string();
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    return path;
  };
  const std::vector<uint8_t> good = *oscar::io::serialize_plan(make_plan());
  struct Case {
    std::string name;
    std::vector<uint8_t> bytes;
    std::string message;
  };
  std::vector<Case> cases = {
      {"empty.safetensors", {}, "truncated (no header length)"},
      {"short.safetensors", std::vector<uint8_t>(good.begin(), good.begin() + 100), "truncated (header of"},
      {"cut.safetensors", std::vector<uint8_t>(good.begin(), good.end() - 4), "lies outside the file"},
  };
  // Files save_plan refuses to write, rebuilt from the good one: one rotation no longer
  // orthogonal (without the content checksum, as an older writer left it, and with it: then the
  // checksum names the corruption first), and a plan fitted for another INT2 code order.
  auto file = oscar::io::SafetensorsFile::parse(good);
  REQUIRE(file.ok());
  auto rebuilt = [&](bool skew, const char* int2_version, bool keep_checksum = false) {
    oscar::io::SafetensorsWriter w;
    for (const auto& [k, v] : file->metadata()) {
      if (keep_checksum || k != oscar::io::kPlanChecksumKey) w.set_metadata(k, k == "int2_format_version" ? int2_version : v);
    }
    for (const oscar::io::TensorInfo& t : file->tensors()) {
      std::vector<uint8_t> bytes = *file->read_bytes(t);
      if (skew && t.name == "layers.2.v_rotation") {
        float x;
        std::memcpy(&x, bytes.data() + 20, 4);
        x += 0.01f;
        std::memcpy(bytes.data() + 20, &x, 4);
      }
      REQUIRE(w.add(t.name, t.dtype, t.shape, bytes).ok());
    }
    return w.serialize();
  };
  cases.push_back({"skewed.safetensors", rebuilt(true, "1"), "layers.2.v_rotation is not orthogonal"});
  cases.push_back({"int2v2.safetensors", rebuilt(false, "2"), "fitted for INT2 format version 2"});
  const std::string crc = file->metadata().at(oscar::io::kPlanChecksumKey);
  cases.push_back({"corrupted.safetensors", rebuilt(true, "1", true),
                   "content checksum mismatch (content_crc32 " + crc + ", computed "});
  // Header edits of the same length: a null checksum (which must not switch the check off) and
  // a lone surrogate escape in a checksummed key, both refused with a message, not a traceback.
  auto edited = [&](const std::string& from, const std::string& to) {
    REQUIRE(from.size() == to.size());
    std::string text(good.begin(), good.end());
    const size_t at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    return std::vector<uint8_t>(text.begin(), text.end());
  };
  cases.push_back({"null_crc.safetensors", edited("\"content_crc32\":\"" + crc + "\"", "\"content_crc32\":null      "),
                   "__metadata__ values must be strings"});
  cases.push_back({"surrogate.safetensors", edited("\"clip_method\":\"fitted\"", "\"clip_method\":\"\\ud800\""),
                   "metadata 'clip_method' is not valid UTF-8"});
  // Metadata the C++ loader refuses: a layer count no tensor list can hold (refused before
  // anything is built from it), an integer in another spelling, a required key missing, a
  // head_dim or group the kernels do not have, head counts that do not divide.
  auto with_meta = [&](const std::string& key, const char* value) {
    const std::string v = value ? value : "";
    return oscar::testing::with_metadata_key(good, key, value ? &v : nullptr, oscar::io::kPlanChecksumKey, false);
  };
  cases.push_back({"layers.safetensors", with_meta("num_layers", "300000000"), "num_layers 300000000 but only 10 tensors"});
  cases.push_back({"plus.safetensors", with_meta("num_layers", "+4"), "metadata 'num_layers' = '+4' is not an integer"});
  cases.push_back({"noname.safetensors", with_meta("model_name", nullptr), "metadata key 'model_name' is missing"});
  cases.push_back({"d96.safetensors", with_meta("head_dim", "96"), "head_dim 96 is not supported"});
  cases.push_back({"group.safetensors", with_meta("quant_group_size", "48"), "quant_group_size 48 is not supported"});
  cases.push_back({"heads.safetensors", with_meta("num_kv_heads", "2"), "num_qo_heads 9 is not a multiple of"});
  // Headers whose structure the C++ reader refuses: refused with a message, not a traceback.
  auto raw = [](const std::string& header, size_t data_bytes) {
    std::string text(8, '\0');  // the header's length, little-endian, then the header and the data
    for (int i = 0; i < 8; ++i) text[i] = char(uint64_t(header.size()) >> (8 * i));
    text += header;
    text.append(data_bytes, '\0');
    return std::vector<uint8_t>(text.begin(), text.end());
  };
  cases.push_back({"entry.safetensors", raw(R"({"x":[1,2]})", 0), "tensor 'x': entry is not an object"});
  cases.push_back({"shape.safetensors", raw(R"({"x":{"dtype":"F32","shape":1,"data_offsets":[0,4]}})", 4),
                   "shape must be a list of non-negative integers"});
  cases.push_back({"offsets.safetensors", raw(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4]}})", 4),
                   "data_offsets must be two non-negative integers"});
  cases.push_back({"overlap.safetensors",
                   raw(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                   "overlapping or non-contiguous tensors"});
  cases.push_back({"deep.safetensors", raw("{\"x\":" + std::string(100000, '[') + std::string(100000, ']') + "}", 0),
                   "corrupted header (nested too deeply)"});
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const auto r = python(write(c.name, c.bytes));
    CHECK(r.code == 2);
    CHECK(r.err.find(c.message) != std::string::npos);
    CHECK(r.out.empty());
  }
  const auto missing = python((kDir / "absent.safetensors").string());
  CHECK(missing.code == 2);
  CHECK(missing.err.find("cannot be read") != std::string::npos);
}
