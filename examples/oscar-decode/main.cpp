// oscar-decode: a real Llama model (SmolLM2-135M-Instruct by default) on the CPU with its KV
// cache in the library's paged cache: BF16, INT4 (simulated), naive INT2, KIVI (simulated),
// Hadamard INT2 or OSCAR (fixed or fitted clip ratios from a plan file).
//
//   oscar-decode generate   --prompt "What is the capital of France?" [--cache METHOD]
//   oscar-decode perplexity --text FILE --ctx 512 --cache int2-hadamard
//   oscar-decode calibrate  --text FILE --out PLAN
//   oscar-decode dump       --text FILE --ctx N --out FILE [--layers 0,5]
//   oscar-decode share      --prompt A --prompt2 B
//   oscar-decode fidelity   --text FILE --ctx N --plan PLAN
//
// perplexity with one --cache ends its output with one line, the stable scripting interface:
//   perplexity=<float> kl=<float> tokens=<int>
// Every scored token reads its past through the cache exactly as decode would: tokens go in
// one at a time (or --chunk N at a time through extend over the already-quantized prefix),
// never as one full-precision prefill.
#include <Eigen/Core>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "cache_methods.hpp"
#include "calibration.hpp"
#include "fidelity.hpp"
#include "gguf.hpp"
#include "llama.hpp"
#include "model_location.hpp"
#include "oscar/io/plan_file.hpp"
#include "oscar/io/safetensors.hpp"
#include "tinystories.hpp"
#include "tokenizer.hpp"

namespace {

using namespace oscar::decode;
using oscar::Result;
using oscar::Status;

const std::vector<std::string> kModes = {"generate", "perplexity", "calibrate", "dump", "share", "fidelity"};

// The OSCAR plan shipped for the default model (scripts/make-default-plan.sh fits it: KJV
// Genesis 1-10, 6000 calibration tokens), so that the app's default run quantizes with the
// method's rotations and clip ratios without a calibration step first.
#ifndef OSCAR_DECODE_DEFAULT_PLAN
#define OSCAR_DECODE_DEFAULT_PLAN ""
#endif
constexpr const char* kDefaultPlanPath = OSCAR_DECODE_DEFAULT_PLAN;

// The last component of a path: what the outputs and the plan metadata name a file by.
std::string file_name(const std::string& path) { return std::filesystem::path(path).filename().string(); }

void print_help() {
  std::printf(
      "oscar-decode: run a Llama model on the CPU with its KV cache in oscar's paged INT2 cache\n"
      "\n"
      "usage:\n"
      "  oscar-decode generate   [--prompt TEXT] [options]\n"
      "  oscar-decode perplexity --text FILE [--ctx N] [--cache METHOD[,METHOD...]] [options]\n"
      "  oscar-decode calibrate  --text FILE --out PLAN [options]\n"
      "  oscar-decode dump       --text FILE --out FILE [--ctx N] [--layers LIST]\n"
      "  oscar-decode share      [--prompt TEXT] [--prompt2 TEXT] [options]\n"
      "  oscar-decode fidelity   --text FILE [--plan PLAN] [--ctx N] [--methods LIST] [options]\n"
      "  oscar-decode --help\n"
      "\n"
      "modes:\n"
      "  generate     greedy continuation of --prompt; prints the text, tokens/s and KV bytes/token\n"
      "  perplexity   teacher-forced perplexity of the first --ctx tokens of --text, and the mean\n"
      "               next-token KL(bf16 cache || this cache). With one --cache the last line is\n"
      "                 perplexity=<float> kl=<float> tokens=<int>\n"
      "               With a comma-separated list, all run in lockstep with one bf16 reference and\n"
      "               print one 'cache=M perplexity=.. kl=.. tokens=..' line each.\n"
      "  calibrate    fits an OSCAR plan (rotations + per-layer clip ratios) from --text through the\n"
      "               streaming accumulators and writes it to --out (a plan file, docs/fitting.md)\n"
      "  dump         writes the post-RoPE q/k/v of --layers for the first --ctx tokens of --text\n"
      "               as safetensors (layers.{l}.q [T, Hq, d], .k/.v [T, Hkv, d], F32): the\n"
      "               calibration input of oscar-fit\n"
      "  share        runs two prompts with a common prefix as two requests of one paged cache;\n"
      "               the second is a fork of the first after the prefix (shared pages by\n"
      "               reference count); prints pages and bytes saved against two separate caches\n"
      "  fidelity     per-layer attention fidelity of every method on the exact activations of\n"
      "               --text (logit error, score SNR, attention KL, output error before/after W_O,\n"
      "               top-k overlap, a needle in the INT2 region); key=value lines, docs/fidelity.md\n"
      "\n"
      "options:\n"
      "  --model FILE          GGUF (llama architecture) or llama2.c .bin model\n"
      "                        (default: $OSCAR_MODEL, else ${OSCAR_MODEL_DIR:-~/.cache/oscar}/%s,\n"
      "                        fetched by scripts/fetch-model.sh)\n"
      "  --cache METHOD        %s\n"
      "                        (default: generate and share on the default model: oscar-fit\n"
      "                        with the plan shipped for it; otherwise bf16)\n"
      "                          exact          float32 K/V, no rounding (reference)\n"
      "                          bf16           every token BF16 in the paged cache\n"
      "                          int4           per-token INT4, simulated (upper reference)\n"
      "                          int2-naive     INT2, no rotation, no clipping\n"
      "                          kivi           KIVI-style INT2 (per-channel keys over 32-token\n"
      "                                         groups, per-token values), simulated\n"
      "                          int2-hadamard  INT2 after a normalized Hadamard rotation\n"
      "                          oscar          INT2, the plan's rotations, the authors' fixed clip\n"
      "                                         ratios 0.96 (K) / 0.92 (V) (needs --plan)\n"
      "                          oscar-fit      INT2, the plan's rotations and fitted clip ratios\n"
      "                        METHOD@gpu (bf16, int2-naive, int2-hadamard, oscar, oscar-fit): the\n"
      "                        same cache in GPU memory, written and read by oscar's kernels\n"
      "                        (CUDA builds, a GPU visible; head_dim 64, 128 or 256)\n"
      "  --plan FILE           plan file (from calibrate or oscar-fit), for oscar and oscar-fit\n"
      "                        (shipped for the default model: examples/oscar-decode/plans/)\n"
      "  --sink N              first N tokens stay BF16 (default 0; calibrate (recorded in the plan) and fidelity: 64)\n"
      "  --recent N            newest N..N+page_size-1 tokens stay BF16 (default 0; calibrate and fidelity: 256)\n"
      "  --page-size N         tokens per cache page: 8, 16, ..., 256 (default 16)\n"
      "  --ctx N               perplexity, dump, fidelity: tokens taken from the start of the text\n"
      "                        (default 512; fidelity 2048); generate/share: cache capacity\n"
      "                        (default 2048); calibrate: tokens per calibration sequence (2048)\n"
      "  --chunk N             perplexity: tokens per cache step (default 1: token-by-token decode;\n"
      "                        N > 1 extends in chunks over the already-quantized prefix)\n"
      "  --text FILE           text (UTF-8) for perplexity, calibrate, dump, fidelity\n"
      "  --out FILE            calibrate: the plan to write; dump: the safetensors file\n"
      "  --calib-tokens N      calibrate: statistics tokens read from the text at most (default 16384)\n"
      "  --held-out-tokens N   calibrate: the text's last N tokens are held out for the clip\n"
      "                        search (default 1024)\n"
      "  --layers LIST         dump: comma-separated layer indices (default: all)\n"
      "  --methods LIST        fidelity: methods to evaluate (default: bf16,int4,int2-naive,kivi,\n"
      "                        int2-hadamard, and oscar,oscar-fit when --plan is given)\n"
      "  --queries N           fidelity: scored query positions, the last N of the text (default 128)\n"
      "  --prompt TEXT         prompt for generate and share (default: \"What is the capital of France?\")\n"
      "  --prompt2 TEXT        share: the second prompt (default: the first with another question)\n"
      "  --raw                 generate/share: use the prompts as is, without the chat template\n"
      "  --max-new-tokens N    generate/share: tokens to produce at most (default 64; share 16)\n"
      "  --threads N           threads for Eigen's matrix products and the paged cache's attention\n"
      "                        (default 1)\n"
      "  --attention PATH      paged-cache attention: blocked (default: per KV head and key block,\n"
      "                        rows dequantized once, matrix products) or reference (the scalar\n"
      "                        CPU oracle of the GPU kernels; same results up to float32 rounding)\n"
      "  --attention-block N   keys per block of the blocked attention (default 64; changes only\n"
      "                        float32 summation order)\n"
      "  --no-progress         no progress bar on stderr\n"
      "  --help                this text\n",
      kDefaultModelName, kCacheMethodList);
}

struct Options {
  std::string mode;
  std::string model;
  std::string cache;  // empty: not given (default_cache picks)
  std::string plan;
  std::string text;
  std::string out;
  std::string layers;
  std::string methods;
  std::string prompt = "What is the capital of France?";
  std::string prompt2;
  std::string attention = "blocked";
  int64_t sink = -1, recent = -1, page_size = 16, ctx = -1, chunk = 1, max_new_tokens = -1, threads = 1, attention_block = 64;
  int64_t calib_tokens = 16384, held_out_tokens = 1024, queries = 128;
  bool raw = false;
  bool progress = true;

  int32_t sink_or(int32_t fallback) const { return sink >= 0 ? static_cast<int32_t>(sink) : fallback; }
  int32_t recent_or(int32_t fallback) const { return recent >= 0 ? static_cast<int32_t>(recent) : fallback; }
};

// The cache of a run without --cache. generate and share are the app's demonstration, so on
// the default model they run OSCAR (oscar-fit: the plan's rotations and fitted clip ratios)
// with the plan shipped for that model, or with --plan where one is given; every other mode
// and model defaults to BF16.
void apply_default_cache(Options& o) {
  if (!o.cache.empty()) return;
  o.cache = "bf16";
  if (o.mode != "generate" && o.mode != "share") return;
  if (!o.plan.empty()) {
    o.cache = "oscar-fit";
    return;
  }
  std::error_code error;
  if (file_name(o.model) != kDefaultModelName || !*kDefaultPlanPath || !std::filesystem::exists(kDefaultPlanPath, error)) {
    return;
  }
  o.cache = "oscar-fit";
  o.plan = kDefaultPlanPath;
}

int usage_error(const std::string& message) {
  std::fprintf(stderr, "oscar-decode: %s\n(run 'oscar-decode --help' for usage)\n", message.c_str());
  return 2;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// The flags each mode reads. A flag the mode does not read is refused rather than ignored:
// `fidelity --cache int4` or `perplexity --methods ...` would otherwise run something other
// than what was asked for. --model, --threads and --no-progress apply to every mode.
const std::map<std::string, std::set<std::string>>& mode_flags() {
  static const std::set<std::string> cache = {"--cache", "--plan", "--sink", "--recent", "--page-size",
                                              "--attention", "--attention-block"};
  static const std::map<std::string, std::set<std::string>> flags = [] {
    std::map<std::string, std::set<std::string>> f = {
        {"generate", {"--ctx", "--prompt", "--raw", "--max-new-tokens"}},
        {"perplexity", {"--ctx", "--text", "--chunk"}},
        {"share", {"--ctx", "--prompt", "--prompt2", "--raw", "--max-new-tokens"}},
        {"calibrate", {"--text", "--out", "--ctx", "--calib-tokens", "--held-out-tokens", "--sink", "--recent"}},
        {"dump", {"--text", "--out", "--ctx", "--layers"}},
        {"fidelity", {"--text", "--plan", "--ctx", "--methods", "--queries", "--sink", "--recent", "--page-size"}},
    };
    for (const char* mode : {"generate", "perplexity", "share"}) f[mode].insert(cache.begin(), cache.end());
    for (auto& [mode, set] : f) set.insert({"--model", "--threads", "--no-progress"});
    return f;
  }();
  return flags;
}

// Parses the command line; returns an error message or "".
std::string parse_args(int argc, char** argv, Options& o) {
  std::vector<std::string> given;  // the flags on the command line, in order
  std::map<std::string, std::string*> strings = {
      {"--model", &o.model}, {"--cache", &o.cache},   {"--plan", &o.plan},       {"--text", &o.text},
      {"--out", &o.out},     {"--layers", &o.layers}, {"--methods", &o.methods}, {"--prompt", &o.prompt},
      {"--prompt2", &o.prompt2}, {"--attention", &o.attention}};
  std::map<std::string, int64_t*> ints = {{"--sink", &o.sink},
                                          {"--recent", &o.recent},
                                          {"--page-size", &o.page_size},
                                          {"--ctx", &o.ctx},
                                          {"--chunk", &o.chunk},
                                          {"--max-new-tokens", &o.max_new_tokens},
                                          {"--threads", &o.threads},
                                          {"--attention-block", &o.attention_block},
                                          {"--calib-tokens", &o.calib_tokens},
                                          {"--held-out-tokens", &o.held_out_tokens},
                                          {"--queries", &o.queries}};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      o.mode = "help";
      return "";
    }
    if (arg == "--raw") { o.raw = true; given.push_back(arg); continue; }
    if (arg == "--no-progress") { o.progress = false; given.push_back(arg); continue; }
    if (arg.rfind("--", 0) != 0) {
      if (!o.mode.empty()) return "unexpected argument '" + arg + "' (the mode is already '" + o.mode + "')";
      if (std::find(kModes.begin(), kModes.end(), arg) == kModes.end()) {
        return "unknown mode '" + arg + "' (use generate, perplexity, calibrate, dump, share or fidelity)";
      }
      o.mode = arg;
      continue;
    }
    std::string value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    const bool known = strings.count(arg) || ints.count(arg);
    if (!known) return "unknown flag '" + arg + "'";
    given.push_back(arg);
    if (!has_value) {
      if (i + 1 >= argc) return "flag " + arg + " needs a value";
      value = argv[++i];
    }
    if (auto it = strings.find(arg); it != strings.end()) {
      *it->second = value;
      continue;
    }
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || errno != 0) return "flag " + arg + " needs an integer, got '" + value + "'";
    // -1 is the internal "not given" of these three; a user's negative value is an error.
    if (v < 0 && (arg == "--sink" || arg == "--recent" || arg == "--max-new-tokens")) return arg + " must be >= 0";
    // Most of these become int32 fields (page size, window sizes, threads): a larger value
    // would be cut to 32 bits and run as another.
    if (v > INT32_MAX || v < INT32_MIN) return arg + " is out of range, got '" + value + "'";
    *ints[arg] = v;
  }
  if (o.mode.empty()) return "no mode given (generate, perplexity, calibrate, dump, share or fidelity)";
  for (const std::string& flag : given) {
    if (!mode_flags().at(o.mode).contains(flag)) return flag + " is not used by " + o.mode + " (see --help)";
  }
  if (!oscar::is_supported_page_size(static_cast<int>(o.page_size))) {
    return "--page-size " + std::to_string(o.page_size) + " is not supported (8, 16, 32, 64, 128 or 256)";
  }
  if (o.chunk <= 0) return "--chunk must be positive";
  if (o.threads <= 0) return "--threads must be positive";
  if (o.attention_block <= 0 || o.attention_block > (1 << 20)) return "--attention-block must be in 1..1048576";
  if (o.attention != "blocked" && o.attention != "reference") {
    return "--attention must be blocked or reference, got '" + o.attention + "'";
  }
  if (o.ctx == 0 || o.ctx < -1) return "--ctx must be positive";
  // Caches are sized for --ctx up front: a bound that fails here, not in an allocation.
  constexpr int64_t kMaxTokens = int64_t{1} << 24;
  if (o.ctx > kMaxTokens || o.max_new_tokens > kMaxTokens) {
    return "--ctx and --max-new-tokens must be at most " + std::to_string(kMaxTokens);
  }
  if (o.calib_tokens <= 0 || o.held_out_tokens <= 0 || o.queries <= 0) {
    return "--calib-tokens, --held-out-tokens and --queries must be positive";
  }
  const bool needs_text = o.mode == "perplexity" || o.mode == "calibrate" || o.mode == "dump" || o.mode == "fidelity";
  if (needs_text && o.text.empty()) return o.mode + " needs --text FILE";
  if ((o.mode == "calibrate" || o.mode == "dump") && o.out.empty()) return o.mode + " needs --out FILE";
  return "";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// A loaded model with its tokenizer, whichever file format it came from.
struct Model {
  LlamaWeights weights;
  std::function<std::vector<int32_t>(const std::string&, bool parse_special)> encode;
  std::function<std::string(int32_t previous, int32_t id)> decode;
  std::vector<int32_t> stop_ids;
  int32_t bos = -1;
  bool add_bos = false;
  bool chat = false;  // has <|im_start|>/<|im_end|>
};

Result<Model> load_model(const std::string& path) {
  std::ifstream probe(path, std::ios::binary);
  if (!probe) {
    std::string hint = path == default_model_path() ? " (fetch it with scripts/fetch-model.sh, or pass --model FILE)" : "";
    return oscar::io_error("model file '" + path + "' cannot be opened" + hint);
  }
  char magic[4] = {};
  probe.read(magic, 4);
  probe.close();
  Model m;
  if (std::string(magic, 4) == "GGUF") {
    auto file = GgufFile::open(path);
    if (!file.ok()) return file.status();
    auto weights = load_llama(*file);
    if (!weights.ok()) return weights.status();
    auto tok = BpeTokenizer::from_gguf(*file);
    if (!tok.ok()) return tok.status();
    auto shared = std::make_shared<BpeTokenizer>(std::move(*tok));
    m.weights = std::move(*weights);
    m.encode = [shared](const std::string& s, bool special) { return shared->encode(s, special); };
    m.decode = [shared](int32_t, int32_t id) { return shared->decode(id); };
    if (shared->eos_id() >= 0) m.stop_ids.push_back(shared->eos_id());
    const int32_t im_end = shared->find("<|im_end|>");
    if (im_end >= 0) m.stop_ids.push_back(im_end);
    m.chat = shared->find("<|im_start|>") >= 0 && im_end >= 0;
    m.bos = shared->bos_id();
    auto add_bos = file->get_int("tokenizer.ggml.add_bos_token");
    m.add_bos = add_bos.ok() && *add_bos != 0;
    return m;
  }
  if (magic[0] != 1) {
    return oscar::data_loss("'" + path + "' is not a model file this tool reads: neither GGUF (it does not start "
                            "with \"GGUF\") nor a llama2.c version-1 .bin");
  }
  auto model = load_llama2c(path);
  if (!model.ok()) return model.status();
  auto shared = std::make_shared<SentencePieceTokenizer>(std::move(model->tokenizer));
  m.weights = std::move(model->weights);
  m.encode = [shared](const std::string& s, bool) { return shared->encode(s); };
  m.decode = [shared](int32_t previous, int32_t id) { return shared->decode(id, previous); };
  m.stop_ids = {shared->eos_id()};
  m.bos = shared->bos_id();
  m.add_bos = true;
  return m;
}

// The plan of --plan, loaded once (empty when none was given).
struct Plans {
  std::optional<oscar::io::Plan> plan;
};

Result<std::unique_ptr<KvCache>> build_cache(const std::string& name, const Options& o, const LlamaConfig& config,
                                             int64_t capacity, const Plans& plans) {
  auto spec = parse_cache_spec(name);
  if (!spec.ok()) return spec.status();
  if (needs_plan(spec->method) && !plans.plan) {
    return oscar::invalid_argument("--cache " + name + " needs --plan FILE (write one with 'oscar-decode calibrate')");
  }
  CacheOptions co;
  co.capacity = capacity;
  co.sink_tokens = o.sink_or(0);
  co.recent_tokens = o.recent_or(0);
  co.page_size = static_cast<int32_t>(o.page_size);
  co.reference_attention = o.attention == "reference";
  co.attention_threads = static_cast<int32_t>(o.threads);
  co.attention_block = static_cast<int32_t>(o.attention_block);
  auto cache = make_cache(*spec, config, co, plans.plan ? &*plans.plan : nullptr);
  if (!cache.ok()) {
    const std::string where = needs_plan(spec->method) ? "--cache " + name + " --plan " + o.plan : "--cache " + name;
    return oscar::Status(cache.status().code(), where + ": " + cache.status().message());
  }
  return cache;
}

class Progress {
 public:
  Progress(bool enabled, int64_t total) : enabled_(enabled && isatty(2)), total_(total) {}
  void update(int64_t done, const std::string& extra) {
    if (!enabled_) return;
    const int width = 40;
    const int filled = total_ > 0 ? static_cast<int>(width * std::min(done, total_) / total_) : width;
    std::fprintf(stderr, "\r[%s%s] %lld/%lld %s", std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(), static_cast<long long>(done),
                 static_cast<long long>(total_), extra.c_str());
    std::fflush(stderr);
  }
  void reset(int64_t total) { total_ = total; }
  void done() {
    if (enabled_) std::fprintf(stderr, "\n");
  }

 private:
  bool enabled_;
  int64_t total_;
};

int argmax(const float* logits, int32_t n) {
  int best = 0;
  for (int i = 1; i < n; ++i) if (logits[i] > logits[best]) best = i;
  return best;
}

// log-softmax of a row, in double.
std::vector<double> log_softmax(const float* logits, int32_t n) {
  double m = logits[0];
  for (int i = 1; i < n; ++i) m = std::max(m, static_cast<double>(logits[i]));
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - m);
  const double lse = m + std::log(sum);
  std::vector<double> out(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<double>(logits[i]) - lse;
  return out;
}

int fail(const Status& status) {
  std::fprintf(stderr, "oscar-decode: %s\n", status.to_string().c_str());
  return 1;
}

std::string chat_prompt(const Model& m, const std::string& user, bool raw) {
  if (!m.chat || raw) return user;
  return "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
         "<|im_start|>user\n" + user + "<|im_end|>\n<|im_start|>assistant\n";
}

std::vector<int32_t> encode_prompt(const Model& m, const std::string& user, bool raw) {
  const bool chat = m.chat && !raw;
  std::vector<int32_t> ids = m.encode(chat_prompt(m, user, raw), chat);
  if (m.add_bos && m.bos >= 0) ids.insert(ids.begin(), m.bos);
  return ids;
}

std::vector<int32_t> encode_text(const Model& m, const std::string& text) {
  std::vector<int32_t> ids = m.encode(text, /*parse_special=*/false);
  if (m.add_bos && m.bos >= 0) ids.insert(ids.begin(), m.bos);
  return ids;
}

int run_generate(const Options& o, const Model& m, const Plans& plans) {
  const LlamaConfig& c = m.weights.config;
  const bool chat = m.chat && !o.raw;
  std::vector<int32_t> ids = encode_prompt(m, o.prompt, o.raw);
  if (ids.empty()) return usage_error("the prompt is empty");
  const int64_t max_new = o.max_new_tokens >= 0 ? o.max_new_tokens : 64;
  const int64_t capacity = o.ctx > 0 ? o.ctx : 2048;
  if (static_cast<int64_t>(ids.size()) + max_new > capacity) {
    return usage_error("prompt (" + std::to_string(ids.size()) + " tokens) + --max-new-tokens exceeds --ctx " +
                       std::to_string(capacity));
  }
  auto cache = build_cache(o.cache, o, c, capacity, plans);
  if (!cache.ok()) return fail(cache.status());
  KvCache& kv = **cache;
  const auto t0 = std::chrono::steady_clock::now();
  auto logits = forward(m.weights, kv, ids, /*last_only=*/true);
  if (!logits.ok()) return fail(logits.status());
  const auto t1 = std::chrono::steady_clock::now();
  std::printf("%s", chat ? "" : o.prompt.c_str());
  std::fflush(stdout);
  int32_t previous = ids.back();
  int64_t generated = 0;
  for (int64_t step = 0; step < max_new; ++step) {
    const int32_t next = argmax(logits->data(), c.vocab_size);
    bool stop = false;
    for (int32_t s : m.stop_ids) stop |= next == s;
    if (stop) break;
    std::printf("%s", m.decode(previous, next).c_str());
    std::fflush(stdout);
    previous = next;
    ++generated;
    if (step + 1 == max_new) break;
    logits = forward(m.weights, kv, {next}, true);
    if (!logits.ok()) return fail(logits.status());
  }
  const auto t2 = std::chrono::steady_clock::now();
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  const double bf16_bytes = 2.0 * 2.0 * c.head_dim * c.num_kv_heads * c.num_layers;
  std::printf("\n\n");
  const std::string plan_name = plans.plan ? " plan=" + file_name(o.plan) : "";
  std::printf("cache=%s%s prompt_tokens=%zu new_tokens=%lld prefill_tokens_per_s=%.1f decode_tokens_per_s=%.1f\n",
              o.cache.c_str(), plan_name.c_str(), ids.size(), static_cast<long long>(generated),
              static_cast<double>(ids.size()) / prefill_s, generated > 1 ? static_cast<double>(generated - 1) / decode_s : 0.0);
  std::printf("kv_bytes_per_token=%.1f (bf16: %.1f, %.2fx smaller) at %lld tokens\n", kv.bytes_per_token(), bf16_bytes,
              bf16_bytes / kv.bytes_per_token(), static_cast<long long>(kv.length()));
  return 0;
}

Result<std::vector<int32_t>> text_tokens(const Options& o, const Model& m, int64_t ctx) {
  std::ifstream in(o.text, std::ios::binary);
  if (!in) return oscar::invalid_argument("--text '" + o.text + "' cannot be opened");
  std::vector<int32_t> ids = encode_text(m, read_file(o.text));
  if (ctx > 0 && static_cast<int64_t>(ids.size()) > ctx) ids.resize(static_cast<size_t>(ctx));
  return ids;
}

// Teacher-forced scoring of `ids` through every method's cache in lockstep, with one bf16
// reference for the KL (the bf16 method itself, if listed, is the reference: KL 0).
struct Score {
  std::string method;
  double nll = 0, kl = 0;
  bool has_kl = true;
  double bytes_per_token = 0;
};

int run_perplexity(const Options& o, const Model& m, const Plans& plans) {
  const LlamaConfig& c = m.weights.config;
  auto tokens = text_tokens(o, m, o.ctx > 0 ? o.ctx : 512);
  if (!tokens.ok()) return usage_error(tokens.status().message());
  const std::vector<int32_t>& ids = *tokens;
  if (ids.size() < 2) return usage_error("--text '" + o.text + "' has fewer than 2 tokens");
  const int64_t n = static_cast<int64_t>(ids.size());
  const std::vector<std::string> methods = split_list(o.cache);
  if (methods.empty()) return usage_error("--cache is empty");

  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<Score> scores;
  int reference = -1;  // index in caches of the bf16 reference
  for (const std::string& name : methods) {
    auto cache = build_cache(name, o, c, n, plans);
    if (!cache.ok()) return fail(cache.status());
    if (name == "bf16") reference = static_cast<int>(caches.size());
    caches.push_back(std::move(*cache));
    scores.push_back({name});
  }
  if (reference < 0) {
    auto r = build_cache("bf16", o, c, n, plans);
    if (r.ok()) {
      reference = static_cast<int>(caches.size());
      caches.push_back(std::move(*r));
    } else if (methods == std::vector<std::string>{"exact"}) {
      // e.g. head_dim 8 (TinyStories): the paged cache cannot hold it, the exact one can.
      std::fprintf(stderr, "oscar-decode: note: no bf16 reference for the KL (%s); kl=nan\n",
                   r.status().message().c_str());
      scores[0].has_kl = false;
    } else {
      return fail(r.status());
    }
  }
  std::vector<KvCache*> raw;
  for (auto& cache : caches) raw.push_back(cache.get());
  Progress progress(o.progress, n - 1);
  int64_t scored = 0;
  const auto t0 = std::chrono::steady_clock::now();
  // Feed tokens 0..n-2; the logits after token t predict token t+1.
  for (int64_t start = 0; start < n - 1; start += o.chunk) {
    const int64_t end = std::min<int64_t>(start + o.chunk, n - 1);
    std::vector<int32_t> chunk(ids.begin() + start, ids.begin() + end);
    auto logits = forward_lockstep(m.weights, raw, chunk);
    if (!logits.ok()) return fail(logits.status());
    for (int64_t t = start; t < end; ++t) {
      const auto row = static_cast<Eigen::Index>(t - start);
      std::vector<double> lq;
      if (reference >= 0) lq = log_softmax((*logits)[static_cast<size_t>(reference)].row(row).data(), c.vocab_size);
      for (size_t i = 0; i < scores.size(); ++i) {
        const std::vector<double> lp = log_softmax((*logits)[i].row(row).data(), c.vocab_size);
        scores[i].nll -= lp[static_cast<size_t>(ids[static_cast<size_t>(t + 1)])];
        if (reference >= 0) {
          double k = 0;
          for (int32_t v = 0; v < c.vocab_size; ++v) {
            k += std::exp(lq[static_cast<size_t>(v)]) * (lq[static_cast<size_t>(v)] - lp[static_cast<size_t>(v)]);
          }
          scores[i].kl += k;
        }
      }
      ++scored;
    }
    char extra[96];
    std::snprintf(extra, sizeof extra, "ppl(%s) %.3f", scores[0].method.c_str(),
                  std::exp(scores[0].nll / static_cast<double>(scored)));
    progress.update(scored, extra);
  }
  progress.done();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i = 0; i < scores.size(); ++i) scores[i].bytes_per_token = caches[i]->bytes_per_token();
  auto ppl = [&](const Score& s) { return std::exp(s.nll / static_cast<double>(scored)); };
  auto kl = [&](const Score& s) { return s.has_kl ? s.kl / static_cast<double>(scored) : std::nan(""); };
  if (scores.size() == 1) {
    std::printf("cache=%s sink=%d recent=%d page_size=%lld chunk=%lld kv_bytes_per_token=%.1f tokens_per_s=%.1f\n",
                o.cache.c_str(), o.sink_or(0), o.recent_or(0), static_cast<long long>(o.page_size),
                static_cast<long long>(o.chunk), scores[0].bytes_per_token, static_cast<double>(scored) / seconds);
    std::printf("perplexity=%.6f kl=%.6f tokens=%lld\n", ppl(scores[0]), kl(scores[0]), static_cast<long long>(scored));
    return 0;
  }
  std::printf("sink=%d recent=%d page_size=%lld chunk=%lld caches=%zu tokens_per_s=%.1f (all caches together)\n",
              o.sink_or(0), o.recent_or(0), static_cast<long long>(o.page_size), static_cast<long long>(o.chunk),
              caches.size(), static_cast<double>(scored) / seconds);
  for (const Score& s : scores) {
    std::printf("cache=%s kv_bytes_per_token=%.1f perplexity=%.6f kl=%.6f tokens=%lld\n", s.method.c_str(),
                s.bytes_per_token, ppl(s), kl(s), static_cast<long long>(scored));
  }
  return 0;
}

int run_calibrate(const Options& o, const Model& m) {
  const LlamaConfig& c = m.weights.config;
  auto tokens = text_tokens(o, m, -1);
  if (!tokens.ok()) return usage_error(tokens.status().message());
  CalibrationOptions co;
  co.sequence_tokens = o.ctx > 0 ? o.ctx : 2048;
  co.max_tokens = o.calib_tokens;
  co.held_out_tokens = o.held_out_tokens;
  co.fit.sink_tokens = o.sink_or(64);
  co.fit.recent_tokens = o.recent_or(256);
  co.fit.model_name = file_name(o.model);
  co.fit.threads = static_cast<int>(o.threads);
  if (!oscar::is_supported_head_dim(c.head_dim)) {
    return usage_error("the model's head_dim " + std::to_string(c.head_dim) +
                       " is not supported by the INT2 cache (64, 128, 256): nothing to calibrate");
  }
  Progress progress(o.progress, 1);
  std::string phase;
  const auto t0 = std::chrono::steady_clock::now();
  auto result = calibrate(m.weights, *tokens, co, [&](const CalibrationProgress& p) {
    if (phase != p.phase) {
      if (!phase.empty()) progress.done();
      phase = p.phase;
      progress.reset(p.total);
    }
    progress.update(p.done, p.phase);
  });
  progress.done();
  if (!result.ok()) {
    if (result.status().code() == oscar::StatusCode::kInvalidArgument) return usage_error(result.status().message());
    return fail(result.status());
  }
  const Status saved = oscar::io::save_plan(result->fit.plan, o.out);
  if (!saved.ok()) return fail(saved);
  std::printf("%5s %9s %9s %6s %6s %12s %12s\n", "layer", "spread_K", "spread_V", "rho_K", "rho_V", "J_K/J_K(H)",
              "J_V/J_V(H)");
  for (const auto& r : result->fit.reports) {
    std::printf("%5d %9.2f %9.2f %6.2f %6.2f %12.4f %12.4f\n", r.layer, r.k_spread, r.v_spread, r.k_clip_ratio,
                r.v_clip_ratio, r.j_k / r.j_k_hadamard, r.j_v / r.j_v_hadamard);
  }
  std::printf("(J relative to normalized Hadamard with rho 0.96/0.92 on the held-out tokens; below 1 is better)\n");
  std::printf("wrote %s: %d layers, head_dim %d, %lld calibration tokens, %lld held-out tokens, %.1f s\n", o.out.c_str(),
              c.num_layers, c.head_dim, static_cast<long long>(result->statistics_tokens),
              static_cast<long long>(result->held_out_tokens),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

int run_dump(const Options& o, const Model& m) {
  const LlamaConfig& c = m.weights.config;
  auto tokens = text_tokens(o, m, o.ctx > 0 ? o.ctx : 512);
  if (!tokens.ok()) return usage_error(tokens.status().message());
  std::vector<int32_t> layers;
  if (o.layers.empty()) {
    for (int32_t l = 0; l < c.num_layers; ++l) layers.push_back(l);
  } else {
    for (const std::string& item : split_list(o.layers)) {
      char* end = nullptr;
      const long v = std::strtol(item.c_str(), &end, 10);
      if (*end != '\0' || v < 0 || v >= c.num_layers) {
        return usage_error("--layers: '" + item + "' is not a layer of this model (0.." + std::to_string(c.num_layers - 1) + ")");
      }
      layers.push_back(static_cast<int32_t>(v));
    }
  }
  auto acts = capture_activations(m.weights, *tokens);
  if (!acts.ok()) return fail(acts.status());
  const int64_t T = static_cast<int64_t>(tokens->size());
  oscar::io::SafetensorsWriter writer;
  for (int32_t l : std::set<int32_t>(layers.begin(), layers.end())) {
    const auto add = [&](const char* name, const RowMatrix& x, int64_t heads) {
      return writer.add_f32(oscar::io::layer_tensor_name(l, name), {T, heads, c.head_dim},
                            std::span<const float>(x.data(), static_cast<size_t>(x.size())));
    };
    Status s = add("q", acts->q[static_cast<size_t>(l)], c.num_qo_heads);
    if (s.ok()) s = add("k", acts->k[static_cast<size_t>(l)], c.num_kv_heads);
    if (s.ok()) s = add("v", acts->v[static_cast<size_t>(l)], c.num_kv_heads);
    if (!s.ok()) return fail(s);
  }
  writer.set_metadata("format", "oscar-activations");
  writer.set_metadata("source", "oscar-decode dump");
  writer.set_metadata("model", file_name(o.model));
  writer.set_metadata("text", o.text);
  writer.set_metadata("tokens", std::to_string(T));
  writer.set_metadata("layout", "post-RoPE (Hugging Face half-split), q [T, Hq, d], k/v [T, Hkv, d]");
  const std::vector<uint8_t> bytes = writer.serialize();
  const Status written = oscar::io::write_file_atomic(o.out, bytes);
  if (!written.ok()) return fail(written);
  std::printf("wrote %s: %zu layers, %lld tokens, q [%lld, %d, %d], k/v [%lld, %d, %d], %zu bytes\n", o.out.c_str(),
              std::set<int32_t>(layers.begin(), layers.end()).size(), static_cast<long long>(T),
              static_cast<long long>(T), c.num_qo_heads, c.head_dim, static_cast<long long>(T), c.num_kv_heads,
              c.head_dim, bytes.size());
  return 0;
}

int run_share(const Options& o, const Model& m, const Plans& plans) {
  const LlamaConfig& c = m.weights.config;
  const std::string second = o.prompt2.empty() ? o.prompt + " And what is the capital of Italy?" : o.prompt2;
  const std::vector<int32_t> a = encode_prompt(m, o.prompt, o.raw), b = encode_prompt(m, second, o.raw);
  if (a.empty() || b.empty()) return usage_error("share: both prompts must encode to at least one token");
  size_t common = 0;
  while (common < a.size() && common < b.size() && a[common] == b[common]) ++common;
  // Both requests must have a token of their own to run after the fork.
  if (common == a.size() || common == b.size()) --common;
  if (common == 0) return usage_error("the two prompts share no token prefix");
  const int64_t max_new = o.max_new_tokens >= 0 ? o.max_new_tokens : 16;
  const int64_t capacity = o.ctx > 0 ? o.ctx : 2048;
  if (static_cast<int64_t>(std::max(a.size(), b.size())) + max_new > capacity) return usage_error("prompts exceed --ctx");
  auto method = parse_cache_method(o.cache);
  if (!method.ok()) return usage_error(method.status().message());
  if (!is_paged(*method)) return usage_error(std::string("share needs a paged cache method (") + kPagedMethodList + ")");
  if (needs_plan(*method) && !plans.plan) return usage_error("--cache " + o.cache + " needs --plan FILE");
  CacheOptions co{capacity, o.sink_or(0), o.recent_or(0), static_cast<int32_t>(o.page_size)};
  co.reference_attention = o.attention == "reference";
  co.attention_threads = static_cast<int32_t>(o.threads);
  co.attention_block = static_cast<int32_t>(o.attention_block);
  co = paged_options(*method, co);
  auto layers = paged_quantizers(*method, c, plans.plan ? &*plans.plan : nullptr);
  if (!layers.ok()) return usage_error("--plan " + o.plan + ": " + layers.status().message());
  auto cache = PagedKvCache::create(c, capacity, co.sink_tokens, co.recent_tokens, co.page_size, std::move(*layers), 2);
  if (!cache.ok()) return fail(cache.status());
  PagedKvCache& kv = **cache;
  kv.set_attention(attention_options(co));
  const oscar::host::RequestId first = kv.active_request();
  auto run = [&](const std::vector<int32_t>& ids, size_t from) -> Result<RowMatrix> {
    return forward(m.weights, kv, std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(from), ids.end()), true);
  };
  auto prefix = run(std::vector<int32_t>(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(common)), 0);
  if (!prefix.ok()) return fail(prefix.status());
  auto forked = kv.fork_active();
  if (!forked.ok()) return fail(forked.status());
  const oscar::host::RequestId second_id = *forked;
  std::string answers[2];
  for (int r = 0; r < 2; ++r) {
    const std::vector<int32_t>& ids = r == 0 ? a : b;
    Status s = kv.activate(r == 0 ? first : second_id);
    if (!s.ok()) return fail(s);
    auto logits = run(ids, common);
    if (!logits.ok()) return fail(logits.status());
    int32_t previous = ids.back();
    for (int64_t step = 0; step < max_new; ++step) {
      const int32_t next = argmax(logits->data(), c.vocab_size);
      bool stop = false;
      for (int32_t id : m.stop_ids) stop |= next == id;
      if (stop) break;
      answers[r] += m.decode(previous, next);
      previous = next;
      if (step + 1 == max_new) break;
      logits = forward(m.weights, kv, {next}, true);
      if (!logits.ok()) return fail(logits.status());
    }
  }
  const oscar::host::PagedCache& pc = kv.cache();
  const auto& cfg = pc.config();
  const oscar::host::PoolUsage usage = pc.usage();
  auto pages_of = [&](oscar::host::RequestId id, int64_t* int2, int64_t* bf16) {
    const oscar::SegmentCounts s = pc.segments(id);
    *int2 = s.int2 / cfg.page_size;
    *bf16 = (s.sink + cfg.page_size - 1) / cfg.page_size + (s.recent + cfg.page_size - 1) / cfg.page_size;
  };
  int64_t int2_a = 0, bf16_a = 0, int2_b = 0, bf16_b = 0;
  pages_of(first, &int2_a, &bf16_a);
  pages_of(second_id, &int2_b, &bf16_b);
  const double int2_page_bytes = 2.0 * cfg.num_layers * cfg.num_kv_heads * static_cast<double>(pc.int2_layout().block_bytes());
  const double bf16_page_bytes = 2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.page_size * cfg.head_dim * 2.0;
  const int64_t int2_separate = int2_a + int2_b, bf16_separate = bf16_a + bf16_b;
  const double separate = int2_separate * int2_page_bytes + bf16_separate * bf16_page_bytes;
  const double shared = usage.int2_pages_used * int2_page_bytes + usage.bf16_pages_used * bf16_page_bytes;
  std::printf("prompt A (%zu tokens): %s\n  -> %s\n", a.size(), o.prompt.c_str(), answers[0].c_str());
  std::printf("prompt B (%zu tokens): %s\n  -> %s\n", b.size(), second.c_str(), answers[1].c_str());
  std::printf("common prefix: %zu tokens, computed once; B is a fork of A after it\n", common);
  std::printf("cache=%s page_size=%d sink=%d recent=%d\n", o.cache.c_str(), cfg.page_size, co.sink_tokens, co.recent_tokens);
  std::printf("int2_pages: shared_cache=%d separate_caches=%lld (pages held by both: %d)\n", usage.int2_pages_used,
              static_cast<long long>(int2_separate), usage.int2_pages_shared);
  std::printf("bf16_pages: shared_cache=%d separate_caches=%lld (pages held by both: %d)\n", usage.bf16_pages_used,
              static_cast<long long>(bf16_separate), usage.bf16_pages_shared);
  std::printf("kv_bytes: shared_cache=%.0f separate_caches=%.0f saved=%.0f (%.1f%%)\n", shared, separate,
              separate - shared, separate > 0 ? 100.0 * (separate - shared) / separate : 0.0);
  return 0;
}

int run_fidelity(const Options& o, const Model& m, const Plans& plans) {
  const LlamaConfig& c = m.weights.config;
  auto tokens = text_tokens(o, m, o.ctx > 0 ? o.ctx : 2048);
  if (!tokens.ok()) return usage_error(tokens.status().message());
  std::vector<std::string> names = split_list(o.methods);
  if (names.empty()) {
    names = {"bf16", "int4", "int2-naive", "kivi", "int2-hadamard"};
    if (plans.plan) {
      names.push_back("oscar");
      names.push_back("oscar-fit");
    }
  }
  std::vector<CacheMethod> methods;
  std::vector<std::vector<oscar::host::LayerQuantizer>> quantizers;
  for (const std::string& name : names) {
    auto method = parse_cache_method(name);
    if (!method.ok()) return usage_error("--methods: " + method.status().message());
    if (*method == CacheMethod::kExact) return usage_error("--methods: exact is the reference, not a method");
    if (needs_plan(*method) && !plans.plan) return usage_error("--methods " + name + " needs --plan FILE");
    // int4 and kivi rotate nothing; the paged methods as their caches do.
    std::vector<oscar::host::LayerQuantizer> per_layer = identity_quantizers(c.num_layers);
    if (is_paged(*method)) {
      auto q = paged_quantizers(*method, c, plans.plan ? &*plans.plan : nullptr);
      if (!q.ok()) return usage_error("--plan " + o.plan + ": " + q.status().message());
      per_layer = std::move(*q);
    }
    methods.push_back(*method);
    quantizers.push_back(std::move(per_layer));
  }
  const CacheGeometry geometry{o.sink_or(64), o.recent_or(256), static_cast<int32_t>(o.page_size)};
  const int64_t T = static_cast<int64_t>(tokens->size());
  if (T < geometry.sink_tokens + geometry.recent_tokens + 4 * geometry.page_size + 64) {
    return usage_error("fidelity: --text gives " + std::to_string(T) + " tokens; the INT2 region needs more than sink + recent");
  }
  // The needle: kNeedle random tokens planted at the first quarter (in the INT2 region, past
  // the sink) and repeated as the last tokens.
  constexpr int64_t kNeedle = 16;
  std::vector<int32_t> needle_ids = *tokens;
  std::mt19937 rng(1234);
  // Ids away from the special tokens at either end of the vocabulary where it has room (a
  // vocabulary under 4000 tokens, TinyStories' 512, takes any id).
  const int32_t margin = c.vocab_size > 4000 ? 1000 : 0;
  std::uniform_int_distribution<int32_t> pick(margin, c.vocab_size - std::max(margin, 1));
  std::vector<int32_t> needle(kNeedle);
  for (auto& id : needle) id = pick(rng);
  const int64_t plant = std::max<int64_t>(geometry.sink_tokens + geometry.page_size, T / 4);
  for (int64_t i = 0; i < kNeedle; ++i) {
    needle_ids[static_cast<size_t>(plant + i)] = needle[static_cast<size_t>(i)];
    needle_ids[static_cast<size_t>(T - kNeedle + i)] = needle[static_cast<size_t>(i)];
  }
  const NeedleSpec spec{plant, plant + kNeedle, T - kNeedle + 1};

  std::fprintf(stderr, "oscar-decode: fidelity: exact activations of %lld tokens (and the needle copy)...\n",
               static_cast<long long>(T));
  auto acts = capture_activations(m.weights, *tokens);
  if (!acts.ok()) return fail(acts.status());
  auto needle_acts = capture_activations(m.weights, needle_ids);
  if (!needle_acts.ok()) return fail(needle_acts.status());

  std::printf("fidelity tokens=%lld queries=%lld sink=%d recent=%d page_size=%d needle_at=%lld needle_tokens=%lld\n",
              static_cast<long long>(T), static_cast<long long>(std::min<int64_t>(o.queries, T)), geometry.sink_tokens,
              geometry.recent_tokens, geometry.page_size, static_cast<long long>(plant), static_cast<long long>(kNeedle));
  Progress progress(o.progress, c.num_layers * static_cast<int64_t>(methods.size()));
  std::vector<std::vector<LayerFidelity>> all(methods.size());
  int64_t done = 0;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    for (size_t i = 0; i < methods.size(); ++i) {
      auto f = layer_fidelity(methods[i], &quantizers[i][static_cast<size_t>(l)], m.weights.layers[static_cast<size_t>(l)], c,
                              acts->q[static_cast<size_t>(l)], acts->k[static_cast<size_t>(l)],
                              acts->v[static_cast<size_t>(l)], o.queries, geometry, &*needle_acts, &spec, l);
      if (!f.ok()) return fail(f.status());
      all[i].push_back(*f);
      progress.update(++done, "layer " + std::to_string(l));
    }
  }
  progress.done();
  auto line = [](const char* what, const std::string& method, const LayerFidelity& f) {
    std::printf("%s method=%s logit_rel_err=%.6g score_snr_db=%.4f attn_kl=%.6g out_rel_err=%.6g out_wo_rel_err=%.6g "
                "top1=%.4f top8=%.4f top32=%.4f retrieval_heads=%d needle_top1=%.4f needle_mass_ratio=%.4f\n",
                what, method.c_str(), f.logit_rel_err, f.score_snr_db, f.attn_kl, f.out_rel_err, f.out_wo_rel_err, f.top1,
                f.top8, f.top32, f.retrieval_heads, f.needle_top1, f.needle_mass_ratio);
  };
  for (int32_t l = 0; l < c.num_layers; ++l) {
    for (size_t i = 0; i < methods.size(); ++i) line(("layer=" + std::to_string(l)).c_str(), names[i], all[i][static_cast<size_t>(l)]);
  }
  for (size_t i = 0; i < methods.size(); ++i) {
    LayerFidelity mean;
    int64_t needle_pairs = 0;
    for (const LayerFidelity& f : all[i]) {
      mean.logit_rel_err += f.logit_rel_err;
      mean.score_snr_db += f.score_snr_db;
      mean.attn_kl += f.attn_kl;
      mean.out_rel_err += f.out_rel_err;
      mean.out_wo_rel_err += f.out_wo_rel_err;
      mean.top1 += f.top1;
      mean.top8 += f.top8;
      mean.top32 += f.top32;
      mean.retrieval_heads += f.retrieval_heads;
      // Needle figures: weighted by each layer's retrieval heads.
      mean.needle_top1 += f.needle_top1 * f.retrieval_heads;
      mean.needle_mass_ratio += f.needle_mass_ratio * f.retrieval_heads;
      needle_pairs += f.retrieval_heads;
    }
    const double L = static_cast<double>(all[i].size());
    mean.logit_rel_err /= L;
    mean.score_snr_db /= L;
    mean.attn_kl /= L;
    mean.out_rel_err /= L;
    mean.out_wo_rel_err /= L;
    mean.top1 /= L;
    mean.top8 /= L;
    mean.top32 /= L;
    if (needle_pairs > 0) {
      mean.needle_top1 /= static_cast<double>(needle_pairs);
      mean.needle_mass_ratio /= static_cast<double>(needle_pairs);
    }
    line("mean", names[i], mean);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (argc <= 1) {
    print_help();
    return 2;
  }
  if (std::string error = parse_args(argc, argv, o); !error.empty()) return usage_error(error);
  if (o.mode == "help") {
    print_help();
    return 0;
  }
  Eigen::setNbThreads(static_cast<int>(o.threads));
  if (o.model.empty()) o.model = default_model_path();
  apply_default_cache(o);
  // Check the cache flags and files before the (slow) model load.
  bool plan_needed = false;
  if (o.mode == "generate" || o.mode == "perplexity" || o.mode == "share") {
    for (const std::string& name : split_list(o.cache)) {
      auto spec = parse_cache_spec(name);
      if (!spec.ok()) return usage_error(spec.status().message());
      plan_needed |= needs_plan(spec->method);
    }
    if (plan_needed && o.plan.empty()) {
      return usage_error("--cache " + o.cache + " needs --plan FILE (write one with 'oscar-decode calibrate --text FILE --out PLAN')");
    }
  }
  if (!o.text.empty()) {
    std::ifstream t(o.text);
    if (!t) return usage_error("--text '" + o.text + "' cannot be opened");
  }
  Plans plans;
  if (!o.plan.empty()) {
    if (!plan_needed && o.mode != "fidelity") return usage_error("--plan is only used by --cache oscar and oscar-fit");
    auto plan = oscar::io::load_plan(o.plan);
    if (!plan.ok()) return usage_error("--plan '" + o.plan + "': " + plan.status().message());
    plans.plan = std::move(*plan);
  }
  auto model = load_model(o.model);
  if (!model.ok()) return fail(model.status());
  if (plans.plan) {
    // A plan of another model is a usage error, named before any work.
    const Status matches = oscar::io::check_plan_matches(*plans.plan, cache_shape(model->weights.config));
    if (!matches.ok()) return usage_error("--plan '" + o.plan + "': " + matches.message());
  }
  if (o.mode == "generate") return run_generate(o, *model, plans);
  if (o.mode == "perplexity") return run_perplexity(o, *model, plans);
  if (o.mode == "calibrate") return run_calibrate(o, *model);
  if (o.mode == "dump") return run_dump(o, *model);
  if (o.mode == "share") return run_share(o, *model, plans);
  return run_fidelity(o, *model, plans);
}
