// oscar-fit end to end: a calibration file in, a valid plan out; --help documents every
// option; bad arguments and bad files exit 2 with one message.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/command.hpp"
#include "fit/fit_test_util.hpp"
#include "oscar/io/accumulator_file.hpp"
#include "oscar/io/plan_file.hpp"
#include "oscar/io/safetensors.hpp"

#ifndef OSCAR_FIT_EXE
#error "OSCAR_FIT_EXE must name the oscar-fit executable"
#endif

using namespace oscar;

namespace {
const std::filesystem::path kDir = std::filesystem::temp_directory_path() / ("oscar_cli_" + std::to_string(::getpid()));

using Run = oscar::testing::CommandResult;
Run run(const std::string& args) { return oscar::testing::run_command(std::string(OSCAR_FIT_EXE) + " " + args, kDir); }

// 2 layers, 8 query / 2 KV heads, d = 64, bf16 q and k, f32 v, with attention masses.
std::string write_calibration(int64_t tokens) {
  const fit::ModelShape s{2, 8, 2, 64};
  io::SafetensorsWriter w;
  for (int32_t l = 0; l < 2; ++l) {
    const testing::Activations x = testing::make_activations(s, tokens, 70 + l);
    auto bf16 = [](const std::vector<float>& v) {
      std::vector<uint8_t> b(v.size() * 2);
      for (size_t i = 0; i < v.size(); ++i) {
        const uint16_t bits = float_to_bf16(v[i]).bits;
        b[2 * i] = static_cast<uint8_t>(bits);
        b[2 * i + 1] = static_cast<uint8_t>(bits >> 8);
      }
      return b;
    };
    REQUIRE(w.add(io::layer_tensor_name(l, "q"), io::DType::kBF16, {tokens, 8, 64}, bf16(x.q)).ok());
    REQUIRE(w.add(io::layer_tensor_name(l, "k"), io::DType::kBF16, {tokens, 2, 64}, bf16(x.k)).ok());
    REQUIRE(w.add_f32(io::layer_tensor_name(l, "v"), {tokens, 2, 64}, x.v).ok());
    std::vector<float> mass(tokens * 2);
    for (size_t i = 0; i < mass.size(); ++i) mass[i] = 0.5f + static_cast<float>(i % 7);
    REQUIRE(w.add_f32(io::layer_tensor_name(l, "attn_mass"), {tokens, 2}, mass).ok());
  }
  const std::string path = (kDir / "calib.safetensors").string();
  REQUIRE(io::write_file_atomic(path, w.serialize()).ok());
  return path;
}
}  // namespace

TEST_CASE("oscar-fit: calibration file to plan, accumulators to plan, and every error exits 2") {
  std::filesystem::create_directories(kDir);
  const std::string calib = write_calibration(1200);
  const std::string plan = (kDir / "plan.safetensors").string(), acc = (kDir / "acc.safetensors").string();

  const Run help = run("--help");
  CHECK(help.code == 0);
  for (const char* opt : {"--calibration", "--accumulators", "--held-out", "--output", "--save-accumulators",
                          "--method", "--clip ", "--clip-grid", "--k-clip", "--v-clip", "--value-weights",
                          "--held-out-fraction", "--max-held-out-tokens", "--skip-tokens", "--seed",
                          "--no-bit-reversal", "--quant-group-size", "--sink-tokens", "--recent-tokens",
                          "--model-name", "--threads", "--chunk-tokens", "--quiet", "--help"}) {
    CAPTURE(opt);
    CHECK(help.out.find(opt) != std::string::npos);
  }

  const Run ok = run("--calibration " + calib + " --output " + plan + " --save-accumulators " + acc +
                     " --model-name tiny --skip-tokens 16 --seed 3");
  CAPTURE(ok.err);
  REQUIRE(ok.code == 0);
  CHECK(ok.err.find("[oscar-fit] layer 2/2") != std::string::npos);
  CHECK(ok.out.find("J_K/J_K(H)") != std::string::npos);
  auto p = io::load_plan(plan);
  REQUIRE(p.ok());
  CHECK(p->num_layers == 2);
  CHECK(p->num_qo_heads == 8);
  CHECK(p->model_name == "tiny");
  CHECK(p->calibration_tokens == 1200 - 16 - 118);  // held out: 10% of the 1184 usable tokens

  // From the saved accumulators, with fixed ratios (no held-out tokens needed) and with held-out tokens.
  const Run from_acc = run("--accumulators " + acc + " --output " + plan + " --clip fixed --method ktk --quiet");
  CAPTURE(from_acc.err);
  CHECK(from_acc.code == 0);
  CHECK(io::load_plan(plan)->layers[1].k_clip_ratio == 0.96f);
  CHECK(run("--accumulators " + acc + " --output " + plan + " --clip fixed --k-clip 0.9 --v-clip 0.8 --quiet").code == 0);
  CHECK(io::load_plan(plan)->layers[0].k_clip_ratio == 0.9f);
  CHECK(io::load_plan(plan)->layers[0].v_clip_ratio == 0.8f);
  CHECK(run("--accumulators " + acc + " --held-out " + calib + " --output " + plan + " --value-weights mass").code == 0);
  CHECK(run("--calibration " + calib + " --output " + plan + " --value-weights mass --clip-grid 1,0.95,0.9").code == 0);

  struct Bad {
    std::string args;
    const char* expect;
  };
  const std::string garbage = (kDir / "garbage").string();
  std::ofstream(garbage) << "not a safetensors file at all";
  const std::vector<Bad> bad = {
      {"", "exactly one of"},
      {"--calibration " + calib, "--output is required"},
      {"--calibration " + calib + " --output " + plan + " --method quarot", "unknown rotation method"},
      {"--calibration " + calib + " --output " + plan + " --clip-grid 1.0:0.8", "HI:LO:STEP"},
      {"--calibration " + calib + " --output " + plan + " --clip-grid 1.2,0.9", "outside (0, 1]"},
      {"--calibration " + calib + " --output " + plan + " --seed x", "not an integer"},
      {"--calibration " + calib + " --output " + plan + " --bogus", "unknown option"},
      {"--calibration " + calib + " --output " + plan + " --held-out-fraction 1.5", "[0, 1)"},
      {"--calibration " + calib + " --output " + plan + " --quant-group-size 48", "--quant-group-size: 48 is not supported"},
      {"--accumulators " + acc + " --output " + plan, "needs held-out tokens"},
      // Flags that cannot apply to the rest of the command line are refused, not ignored.
      {"--calibration " + calib + " --output " + plan + " --k-clip 0.9", "--k-clip sets a fixed ratio"},
      {"--calibration " + calib + " --output " + plan + " --clip fitted --v-clip 0.9", "--v-clip sets a fixed ratio"},
      {"--calibration " + calib + " --output " + plan + " --clip fixed --clip-grid 1,0.9", "--clip-grid is searched"},
      {"--accumulators " + acc + " --output " + plan + " --clip fixed --skip-tokens 4", "--skip-tokens goes with"},
      {"--accumulators " + acc + " --output " + plan + " --clip fixed --chunk-tokens 64", "--chunk-tokens goes with"},
      {"--accumulators " + acc + " --output " + plan + " --clip fixed --held-out-fraction 0.2", "--held-out-fraction goes"},
      {"--calibration " + garbage + " --output " + plan, "garbage"},
      {"--calibration " + (kDir / "missing").string() + " --output " + plan, "cannot open"},
      {"--accumulators " + calib + " --output " + plan + " --clip fixed", "not oscar accumulators"},
      {"--calibration " + acc + " --output " + plan, "no tensor \"layers.0.k\""},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.args);
    const Run r = run(b.args);
    CAPTURE(r.err);
    CHECK(r.code == 2);
    CHECK(r.err.find(b.expect) != std::string::npos);
    CHECK(r.err.rfind("oscar-fit: ", 0) == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);  // one message
  }
  std::filesystem::remove_all(kDir);
}
