// The oscar-decode command line on SmolLM2: calibrate -> plan file -> --cache oscar --plan,
// dump -> readable safetensors of the right shapes, share -> fewer pages than two caches,
// and clear errors (exit 2, the problem named) for bad flags, a missing plan, a plan file that
// does not exist and plans of another shape. Skipped (exit 77) without the model file.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "common/command.hpp"
#include "model_location.hpp"
#include "oscar/io/plan_file.hpp"
#include "oscar/io/safetensors.hpp"

#ifndef OSCAR_DECODE_EXE
#error "OSCAR_DECODE_EXE must name the oscar-decode executable"
#endif

namespace {

const std::filesystem::path kDir =
    std::filesystem::temp_directory_path() / ("oscar_decode_cli_" + std::to_string(::getpid()));
const std::string kText = std::string(OSCAR_TEST_DATA_DIR) + "/lighthouse.txt";

using Run = oscar::testing::CommandResult;
Run run(const std::string& args) {
  return oscar::testing::run_command(std::string(OSCAR_DECODE_EXE) + " " + args + " --no-progress", kDir);
}

std::string path(const char* name) { return (kDir / name).string(); }

// A plan of `layers` identity rotations of size d (valid as a file, wrong for SmolLM2 unless
// layers = 30, d = 64, heads 9/3).
std::string write_plan(const char* name, int32_t layers, int32_t d, int32_t qo = 9, int32_t kv = 3) {
  oscar::io::Plan plan;
  plan.head_dim = d;
  plan.num_layers = layers;
  plan.num_qo_heads = qo;
  plan.num_kv_heads = kv;
  for (int32_t l = 0; l < layers; ++l) {
    oscar::io::PlanLayer layer;
    layer.k_rotation.assign(static_cast<size_t>(d) * d, 0.0f);
    for (int32_t i = 0; i < d; ++i) layer.k_rotation[static_cast<size_t>(i) * d + i] = 1.0f;
    layer.v_rotation = layer.k_rotation;
    plan.layers.push_back(layer);
  }
  REQUIRE(oscar::io::save_plan(plan, path(name)).ok());
  return path(name);
}

const std::regex kScriptLine("\nperplexity=([0-9.]+) kl=([0-9.]+) tokens=([0-9]+)\n$");

}  // namespace

TEST_CASE("oscar-decode: bad flags, a missing plan and wrong plans give exit 2 and name the problem") {
  Run r = run("perplexity --text " + kText + " --bogus 3");
  CHECK(r.code == 2);
  CHECK(r.err.find("unknown flag '--bogus'") != std::string::npos);
  r = run("perplexity --text " + kText + " --cache int3");
  CHECK(r.code == 2);
  CHECK(r.err.find("unknown cache method 'int3'") != std::string::npos);
  r = run("perplexity --text " + kText + " --cache oscar");
  CHECK(r.code == 2);
  CHECK(r.err.find("--cache oscar needs --plan FILE") != std::string::npos);
  r = run("perplexity --text " + kText + " --cache oscar-fit --plan " + path("absent.safetensors"));
  CHECK(r.code == 2);
  CHECK(r.err.find("absent.safetensors") != std::string::npos);
  r = run("perplexity --text " + kText + " --cache kivi@gpu");
  CHECK(r.code == 2);
  CHECK(r.err.find("kivi is not a paged cache and has no GPU path") != std::string::npos);
  r = run("perplexity --text " + kText + " --cache oscar@gpu");
  CHECK(r.code == 2);
  CHECK(r.err.find("--cache oscar@gpu needs --plan FILE") != std::string::npos);
  r = run("calibrate --text " + kText);
  CHECK(r.code == 2);
  CHECK(r.err.find("calibrate needs --out FILE") != std::string::npos);
  r = run("perplexity --text " + kText + " --cache int2-hadamard --plan " + write_plan("ok.safetensors", 30, 64));
  CHECK(r.code == 2);
  CHECK(r.err.find("--plan is only used by --cache oscar") != std::string::npos);
  // Plans of another model, refused after the model is read, before any work.
  r = run("perplexity --text " + kText + " --ctx 8 --cache oscar --plan " + write_plan("d128.safetensors", 30, 128));
  CHECK(r.code == 2);
  CHECK(r.err.find("head_dim = 128, the model declares 64") != std::string::npos);
  r = run("perplexity --text " + kText + " --ctx 8 --cache oscar --plan " + write_plan("l2.safetensors", 2, 64));
  CHECK(r.code == 2);
  CHECK(r.err.find("num_layers = 2, the model declares 30") != std::string::npos);
  r = run("perplexity --text " + kText + " --ctx 8 --cache oscar --plan " + write_plan("kv1.safetensors", 30, 64, 9, 1));
  CHECK(r.code == 2);
  CHECK(r.err.find("num_kv_heads = 1, the model declares 3") != std::string::npos);
  // Values that used to be cut to 32 bits (a page size of 2^32 + 16 ran as 16) or to size a
  // cache past memory, and a share prompt that encodes to nothing.
  r = run("perplexity --text " + kText + " --cache int4 --page-size 4294967312");
  CHECK(r.code == 2);
  CHECK(r.err.find("--page-size is out of range") != std::string::npos);
  r = run("generate --cache bf16 --ctx 20000000");
  CHECK(r.code == 2);
  CHECK(r.err.find("--ctx and --max-new-tokens must be at most 16777216") != std::string::npos);
  r = run("share --raw --prompt \"\" --prompt2 hello --cache int2-hadamard");
  CHECK(r.code == 2);
  CHECK(r.err.find("both prompts must encode to at least one token") != std::string::npos);
  // A flag the mode does not read is refused, not ignored (fidelity takes --methods, not
  // --cache; perplexity the reverse), and an unsupported page size is named as such before
  // any cache (the hidden bf16 reference's included) is built.
  const std::pair<std::string, const char*> refused[] = {
      {"fidelity --text " + kText + " --cache int4", "--cache is not used by fidelity"},
      {"perplexity --text " + kText + " --methods int4", "--methods is not used by perplexity"},
      {"generate --chunk 4", "--chunk is not used by generate"},
      {"dump --text " + kText + " --out " + path("x.safetensors") + " --sink 4", "--sink is not used by dump"},
      {"perplexity --text " + kText + " --cache int4 --page-size 7", "--page-size 7 is not supported"},
  };
  for (const auto& [args, message] : refused) {
    CAPTURE(args);
    r = run(args);
    CHECK(r.code == 2);
    CHECK(r.err.find(message) != std::string::npos);
  }
}

TEST_CASE("oscar-decode: an @gpu cache runs on a GPU, or says that there is none") {
  const Run r = run("perplexity --text " + kText + " --ctx 24 --sink 4 --recent 8 --cache int2-hadamard@gpu");
  if (r.code == 0) {  // a machine with a GPU: the scripting line, as on the CPU
    MESSAGE("ran on a GPU: " << r.out.substr(r.out.rfind("perplexity=")));
    CHECK(std::regex_search(r.out, kScriptLine));
  } else {  // every CI machine: the failure names the missing device (or the build without CUDA)
    MESSAGE("no GPU here: " << r.err.substr(0, r.err.find('\n')));
    CHECK(r.code == 1);
    CHECK((r.err.find("no CUDA device visible") != std::string::npos ||
           r.err.find("this build has no CUDA") != std::string::npos));
  }
}

TEST_CASE("oscar-decode: calibrate writes a plan that --cache oscar and oscar-fit read") {
  const std::string plan = path("calibrated.safetensors");
  Run r = run("calibrate --text " + kText + " --out " + plan +
              " --ctx 256 --calib-tokens 256 --held-out-tokens 128 --sink 32 --recent 64 --threads 2");
  REQUIRE_MESSAGE(r.code == 0, r.err);
  auto loaded = oscar::io::load_plan(plan);
  REQUIRE_MESSAGE(loaded.ok(), loaded.status().to_string());
  CHECK(loaded->num_layers == 30);
  CHECK(loaded->head_dim == 64);
  CHECK(loaded->num_qo_heads == 9);
  CHECK(loaded->num_kv_heads == 3);
  CHECK(loaded->sink_tokens == 32);   // the flags are recorded
  CHECK(loaded->recent_tokens == 64);
  CHECK(loaded->calibration_tokens == 256 - 16);
  for (const char* method : {"oscar", "oscar-fit"}) {
    r = run(std::string("perplexity --text ") + kText + " --ctx 48 --cache " + method + " --plan " + plan);
    REQUIRE_MESSAGE(r.code == 0, r.err);
    std::smatch m;
    REQUIRE_MESSAGE(std::regex_search(r.out, m, kScriptLine), r.out);
    CHECK(m[3] == "47");
    const double ppl = std::stod(m[1]), kl = std::stod(m[2]);
    // A working INT2 cache on English text: finite, and far from a uniform guess over 49152
    // tokens; its KL against bf16 is positive (the cache does quantize: 48 tokens, sink 0,
    // so two pages are INT2).
    CHECK(std::isfinite(ppl));
    CHECK(ppl < 1000.0);
    CHECK(kl > 0.0);
  }
}

TEST_CASE("oscar-decode: dump writes post-RoPE q/k/v of the chosen layers as safetensors") {
  const std::string out = path("dump.safetensors");
  Run r = run("dump --text " + kText + " --ctx 40 --layers 0,29 --out " + out);
  REQUIRE_MESSAGE(r.code == 0, r.err);
  auto file = oscar::io::SafetensorsFile::open(out);
  REQUIRE_MESSAGE(file.ok(), file.status().to_string());
  CHECK(file->tensors().size() == 6);
  for (int layer : {0, 29}) {
    for (const char* name : {"q", "k", "v"}) {
      const oscar::io::TensorInfo* t = file->find(oscar::io::layer_tensor_name(layer, name));
      REQUIRE(t != nullptr);
      CHECK(t->dtype == oscar::io::DType::kF32);
      CHECK(t->shape == std::vector<int64_t>{40, name[0] == 'q' ? 9 : 3, 64});
      auto values = file->read_as<float>(*t);
      REQUIRE(values.ok());
      double norm = 0;
      for (float x : *values) norm += static_cast<double>(x) * x;
      CHECK(std::isfinite(norm));
      CHECK(norm > 0.0);
    }
  }
  CHECK(file->find("layers.1.k") == nullptr);
  r = run("dump --text " + kText + " --ctx 40 --layers 30 --out " + out);
  CHECK(r.code == 2);
  CHECK(r.err.find("'30' is not a layer of this model") != std::string::npos);
}

TEST_CASE("oscar-decode: share holds the common prefix once") {
  const std::string prefix = "Read this passage about the old lighthouse keeper and the storm that came in the night, "
                             "when the lamp failed and the boats were still out at sea beyond the rocks of the harbour.";
  Run r = run("share --cache int2-hadamard --max-new-tokens 2 --prompt \"" + prefix + " Who kept the lamp?\" --prompt2 \"" +
              prefix + " What failed?\"");
  REQUIRE_MESSAGE(r.code == 0, r.err);
  std::smatch m;
  REQUIRE_MESSAGE(std::regex_search(r.out, m, std::regex("int2_pages: shared_cache=([0-9]+) separate_caches=([0-9]+) "
                                                         "\\(pages held by both: ([0-9]+)\\)")),
                  r.out);
  const int shared = std::stoi(m[1]), separate = std::stoi(m[2]), both = std::stoi(m[3]);
  CHECK(both >= 2);  // the prefix is ~70 tokens: at least 4 full pages of 16
  CHECK(shared + both == separate);
  REQUIRE(std::regex_search(r.out, m, std::regex("saved=([0-9]+)")));
  CHECK(std::stod(m[1]) > 0);
}

TEST_CASE("oscar-decode: generate without --cache runs OSCAR with the plan shipped for the default model") {
  // The main job (README): the default model, no flags. Its answer to the default question
  // must still name Paris, through a cache whose pages past the first are INT2.
  Run r = run("generate --max-new-tokens 12");
  REQUIRE_MESSAGE(r.code == 0, r.err);
  const bool default_model = oscar::decode::default_model_path().ends_with(std::string("/") + oscar::decode::kDefaultModelName);
  if (default_model) {
    CHECK(r.out.find("cache=oscar-fit plan=SmolLM2-135M-Instruct.Q4_1.plan.safetensors ") != std::string::npos);
    CHECK(r.out.find("Paris") != std::string::npos);
    std::smatch m;
    REQUIRE_MESSAGE(std::regex_search(r.out, m, std::regex("\\(bf16: [0-9.]+, ([0-9.]+)x smaller\\)")), r.out);
    CHECK(std::stod(m[1]) > 2.0);  // ~45 tokens: 2 of 3 pages INT2
  } else {
    CHECK(r.out.find("cache=bf16 ") != std::string::npos);  // another model: no plan of its own
  }
  // An explicit --cache keeps its meaning; --plan alone implies oscar-fit.
  r = run("generate --max-new-tokens 2 --cache bf16");
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(r.out.find("cache=bf16 prompt_tokens=") != std::string::npos);
  r = run("generate --max-new-tokens 2 --plan " + std::string(OSCAR_DECODE_DEFAULT_PLAN));
  if (default_model) {
    REQUIRE_MESSAGE(r.code == 0, r.err);
    CHECK(r.out.find("cache=oscar-fit plan=") != std::string::npos);
  }
}

int main(int argc, char** argv) {
  const std::string model = oscar::decode::default_model_path();
  if (!std::ifstream(model)) {
    std::printf("SKIPPED: SmolLM2 model not found at %s (run scripts/fetch-model.sh, or set OSCAR_MODEL)\n", model.c_str());
    return 77;
  }
  std::filesystem::create_directories(kDir);
  doctest::Context context(argc, argv);
  const int code = context.run();
  std::filesystem::remove_all(kDir);
  return code;
}
