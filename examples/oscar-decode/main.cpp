// oscar-decode: a real Llama model (SmolLM2-135M-Instruct by default) on the CPU with its KV
// cache in the library's paged cache: BF16, naive INT2, Hadamard INT2 or OSCAR.
//
//   oscar-decode generate   --prompt "What is the capital of France?" [--cache METHOD]
//   oscar-decode perplexity --text FILE --ctx 512 --cache int2-hadamard
//
// perplexity ends its output with one line, the stable scripting interface:
//   perplexity=<float> kl=<float> tokens=<int>
// Every scored token reads its past through the cache exactly as decode would: tokens go in
// one at a time (or --chunk N at a time through extend over the already-quantized prefix),
// never as one full-precision prefill.
#include <Eigen/Core>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "cache_methods.hpp"
#include "gguf.hpp"
#include "llama.hpp"
#include "tinystories.hpp"
#include "tokenizer.hpp"

namespace {

using namespace oscar::decode;
using oscar::Result;
using oscar::Status;

constexpr const char* kDefaultModelName = "SmolLM2-135M-Instruct.Q4_1.gguf";

std::string default_model_path() {
  if (const char* m = std::getenv("OSCAR_MODEL"); m && *m) return m;
  std::string dir;
  if (const char* d = std::getenv("OSCAR_MODEL_DIR"); d && *d) {
    dir = d;
  } else {
    const char* home = std::getenv("HOME");
    dir = std::string(home ? home : ".") + "/.cache/oscar";
  }
  return dir + "/" + kDefaultModelName;
}

void print_help() {
  std::printf(
      "oscar-decode: run a Llama model on the CPU with its KV cache in oscar's paged INT2 cache\n"
      "\n"
      "usage:\n"
      "  oscar-decode generate   [--prompt TEXT] [options]\n"
      "  oscar-decode perplexity --text FILE [--ctx N] [options]\n"
      "  oscar-decode --help\n"
      "\n"
      "modes:\n"
      "  generate     greedy continuation of --prompt; prints the text, tokens/s and KV bytes/token\n"
      "  perplexity   teacher-forced perplexity of the first --ctx tokens of --text, and the mean\n"
      "               next-token KL(bf16 cache || this cache); last line:\n"
      "               perplexity=<float> kl=<float> tokens=<int>\n"
      "\n"
      "options:\n"
      "  --model FILE          GGUF (llama architecture) or llama2.c .bin model\n"
      "                        (default: $OSCAR_MODEL, else ${OSCAR_MODEL_DIR:-~/.cache/oscar}/%s,\n"
      "                        fetched by scripts/fetch-model.sh)\n"
      "  --cache METHOD        %s (default bf16)\n"
      "                          exact          float32 K/V, no rounding (reference)\n"
      "                          bf16           every token BF16 in the paged cache\n"
      "                          int2-naive     INT2, no rotation, no clipping\n"
      "                          int2-hadamard  INT2 after a normalized Hadamard rotation\n"
      "                          oscar          INT2 with fitted rotations/clip ratios (--plan)\n"
      "  --plan FILE           fitted OSCAR plan (needed by --cache oscar)\n"
      "  --sink N              first N tokens stay BF16 (default 0)\n"
      "  --recent N            newest N..N+page_size-1 tokens stay BF16 (default 0)\n"
      "  --page-size N         tokens per cache page: 8, 16, ..., 256 (default 16)\n"
      "  --ctx N               perplexity: tokens scored, from the start of the text (default 512);\n"
      "                        generate: cache capacity in tokens (default 2048)\n"
      "  --chunk N             perplexity: tokens per cache step (default 1: token-by-token decode;\n"
      "                        N > 1 extends in chunks over the already-quantized prefix)\n"
      "  --text FILE           text for perplexity (UTF-8)\n"
      "  --prompt TEXT         prompt for generate (default: \"What is the capital of France?\")\n"
      "  --raw                 generate: use the prompt as is, without the model's chat template\n"
      "  --max-new-tokens N    generate: tokens to produce at most (default 64)\n"
      "  --threads N           threads for Eigen's matrix products (default 1)\n"
      "  --no-progress         no progress bar on stderr\n"
      "  --help                this text\n",
      kDefaultModelName, kCacheMethodList);
}

struct Options {
  std::string mode;
  std::string model;
  std::string cache = "bf16";
  std::string plan;
  std::string text;
  std::string prompt = "What is the capital of France?";
  int64_t sink = 0, recent = 0, page_size = 16, ctx = -1, chunk = 1, max_new_tokens = 64, threads = 1;
  bool raw = false;
  bool progress = true;
};

int usage_error(const std::string& message) {
  std::fprintf(stderr, "oscar-decode: %s\n(run 'oscar-decode --help' for usage)\n", message.c_str());
  return 2;
}

// Parses the command line; returns an error message or "".
std::string parse_args(int argc, char** argv, Options& o) {
  std::map<std::string, std::string*> strings = {
      {"--model", &o.model}, {"--cache", &o.cache}, {"--plan", &o.plan}, {"--text", &o.text}, {"--prompt", &o.prompt}};
  std::map<std::string, int64_t*> ints = {{"--sink", &o.sink},
                                          {"--recent", &o.recent},
                                          {"--page-size", &o.page_size},
                                          {"--ctx", &o.ctx},
                                          {"--chunk", &o.chunk},
                                          {"--max-new-tokens", &o.max_new_tokens},
                                          {"--threads", &o.threads}};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      o.mode = "help";
      return "";
    }
    if (arg == "--raw") { o.raw = true; continue; }
    if (arg == "--no-progress") { o.progress = false; continue; }
    if (arg.rfind("--", 0) != 0) {
      if (!o.mode.empty()) return "unexpected argument '" + arg + "' (the mode is already '" + o.mode + "')";
      if (arg != "generate" && arg != "perplexity") return "unknown mode '" + arg + "' (use generate or perplexity)";
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
    *ints[arg] = v;
  }
  if (o.mode.empty()) return "no mode given (generate or perplexity)";
  if (o.sink < 0 || o.recent < 0) return "--sink and --recent must be >= 0";
  if (o.chunk <= 0) return "--chunk must be positive";
  if (o.max_new_tokens < 0) return "--max-new-tokens must be >= 0";
  if (o.threads <= 0) return "--threads must be positive";
  if (o.ctx == 0 || o.ctx < -1) return "--ctx must be positive";
  if (o.mode == "perplexity" && o.text.empty()) return "perplexity needs --text FILE";
  return "";
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

Result<std::unique_ptr<KvCache>> build_cache(const Options& o, const LlamaConfig& config, int64_t capacity) {
  auto method = parse_cache_method(o.cache);
  if (!method.ok()) return method.status();
  if (*method == CacheMethod::kOscar && o.plan.empty()) {
    return oscar::invalid_argument("--cache oscar needs --plan FILE (plan files arrive with oscar-fit)");
  }
  if (*method == CacheMethod::kOscar) {
    return oscar::unsupported("--plan '" + o.plan +
                              "': this build cannot read plan files yet (they arrive with oscar-fit); "
                              "use bf16, int2-naive or int2-hadamard");
  }
  if (*method != CacheMethod::kExact && *method != CacheMethod::kBf16 && !o.plan.empty()) {
    return oscar::invalid_argument("--plan is only used by --cache oscar");
  }
  CacheOptions co;
  co.capacity = capacity;
  co.sink_tokens = static_cast<int32_t>(o.sink);
  co.recent_tokens = static_cast<int32_t>(o.recent);
  co.page_size = static_cast<int32_t>(o.page_size);
  auto cache = make_cache(*method, config, co);
  if (!cache.ok()) return oscar::Status(cache.status().code(), "--cache " + o.cache + ": " + cache.status().message());
  return cache;
}

class Progress {
 public:
  Progress(bool enabled, int64_t total) : enabled_(enabled && isatty(2)), total_(total) {}
  void update(int64_t done, const std::string& extra) {
    if (!enabled_) return;
    const int width = 40;
    const int filled = total_ > 0 ? static_cast<int>(width * done / total_) : width;
    std::fprintf(stderr, "\r[%s%s] %lld/%lld %s", std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(), static_cast<long long>(done),
                 static_cast<long long>(total_), extra.c_str());
    std::fflush(stderr);
  }
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

int run_generate(const Options& o, const Model& m) {
  const LlamaConfig& c = m.weights.config;
  std::string prompt = o.prompt;
  const bool chat = m.chat && !o.raw;
  if (chat) {
    prompt = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
             "<|im_start|>user\n" + o.prompt + "<|im_end|>\n<|im_start|>assistant\n";
  }
  std::vector<int32_t> ids = m.encode(prompt, chat);
  if (m.add_bos && m.bos >= 0) ids.insert(ids.begin(), m.bos);
  if (ids.empty()) return usage_error("the prompt is empty");
  const int64_t capacity = o.ctx > 0 ? o.ctx : 2048;
  if (static_cast<int64_t>(ids.size()) + o.max_new_tokens > capacity) {
    return usage_error("prompt (" + std::to_string(ids.size()) + " tokens) + --max-new-tokens exceeds --ctx " +
                       std::to_string(capacity));
  }
  auto cache = build_cache(o, c, capacity);
  if (!cache.ok()) {
    std::fprintf(stderr, "oscar-decode: %s\n", cache.status().to_string().c_str());
    return 1;
  }
  KvCache& kv = **cache;
  const auto t0 = std::chrono::steady_clock::now();
  auto logits = forward(m.weights, kv, ids, /*last_only=*/true);
  if (!logits.ok()) {
    std::fprintf(stderr, "oscar-decode: %s\n", logits.status().to_string().c_str());
    return 1;
  }
  const auto t1 = std::chrono::steady_clock::now();
  std::printf("%s", chat ? "" : prompt.c_str());
  std::fflush(stdout);
  int32_t previous = ids.back();
  int64_t generated = 0;
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    const int32_t next = argmax(logits->data(), c.vocab_size);
    bool stop = false;
    for (int32_t s : m.stop_ids) stop |= next == s;
    if (stop) break;
    std::printf("%s", m.decode(previous, next).c_str());
    std::fflush(stdout);
    previous = next;
    ++generated;
    if (step + 1 == o.max_new_tokens) break;
    logits = forward(m.weights, kv, {next}, true);
    if (!logits.ok()) {
      std::fprintf(stderr, "\noscar-decode: %s\n", logits.status().to_string().c_str());
      return 1;
    }
  }
  const auto t2 = std::chrono::steady_clock::now();
  const double prefill_s = std::chrono::duration<double>(t1 - t0).count();
  const double decode_s = std::chrono::duration<double>(t2 - t1).count();
  const double bf16_bytes = 2.0 * 2.0 * c.head_dim * c.num_kv_heads * c.num_layers;
  std::printf("\n\n");
  std::printf("cache=%s prompt_tokens=%zu new_tokens=%lld prefill_tokens_per_s=%.1f decode_tokens_per_s=%.1f\n",
              o.cache.c_str(), ids.size(), static_cast<long long>(generated),
              static_cast<double>(ids.size()) / prefill_s, generated > 1 ? static_cast<double>(generated - 1) / decode_s : 0.0);
  std::printf("kv_bytes_per_token=%.1f (bf16: %.1f, %.2fx smaller) at %lld tokens\n", kv.bytes_per_token(), bf16_bytes,
              bf16_bytes / kv.bytes_per_token(), static_cast<long long>(kv.length()));
  return 0;
}

int run_perplexity(const Options& o, const Model& m) {
  const LlamaConfig& c = m.weights.config;
  std::ifstream in(o.text, std::ios::binary);
  if (!in) return usage_error("--text '" + o.text + "' cannot be opened");
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::vector<int32_t> ids = m.encode(buffer.str(), /*parse_special=*/false);
  if (m.add_bos && m.bos >= 0) ids.insert(ids.begin(), m.bos);
  const int64_t ctx = o.ctx > 0 ? o.ctx : 512;
  if (static_cast<int64_t>(ids.size()) > ctx) ids.resize(static_cast<size_t>(ctx));
  if (ids.size() < 2) return usage_error("--text '" + o.text + "' has fewer than 2 tokens");
  const int64_t n = static_cast<int64_t>(ids.size());

  auto cache = build_cache(o, c, n);
  if (!cache.ok()) {
    std::fprintf(stderr, "oscar-decode: %s\n", cache.status().to_string().c_str());
    return 1;
  }
  // The reference for the KL: the same run through a BF16 cache (skipped when this is it).
  std::unique_ptr<KvCache> reference;
  if (o.cache != "bf16") {
    Options ro = o;
    ro.cache = "bf16";
    ro.plan.clear();
    auto r = build_cache(ro, c, n);
    if (r.ok()) {
      reference = std::move(*r);
    } else if (o.cache == "exact") {
      // e.g. head_dim 8 (TinyStories): the paged cache cannot hold it, the exact one can.
      std::fprintf(stderr, "oscar-decode: note: no bf16 reference for the KL (%s); kl=nan\n",
                   r.status().message().c_str());
    } else {
      std::fprintf(stderr, "oscar-decode: %s\n", r.status().to_string().c_str());
      return 1;
    }
  }
  Progress progress(o.progress, n - 1);
  double nll = 0, kl = 0;
  int64_t scored = 0;
  const auto t0 = std::chrono::steady_clock::now();
  // Feed tokens 0..n-2; the logits after token t predict token t+1.
  for (int64_t start = 0; start < n - 1; start += o.chunk) {
    const int64_t end = std::min<int64_t>(start + o.chunk, n - 1);
    std::vector<int32_t> chunk(ids.begin() + start, ids.begin() + end);
    auto logits = forward(m.weights, **cache, chunk);
    if (!logits.ok()) {
      std::fprintf(stderr, "oscar-decode: %s\n", logits.status().to_string().c_str());
      return 1;
    }
    Result<RowMatrix> ref_logits = RowMatrix();
    if (reference) {
      ref_logits = forward(m.weights, *reference, chunk);
      if (!ref_logits.ok()) {
        std::fprintf(stderr, "oscar-decode: %s\n", ref_logits.status().to_string().c_str());
        return 1;
      }
    }
    for (int64_t t = start; t < end; ++t) {
      const auto row = static_cast<Eigen::Index>(t - start);
      const std::vector<double> lp = log_softmax(logits->row(row).data(), c.vocab_size);
      nll -= lp[static_cast<size_t>(ids[static_cast<size_t>(t + 1)])];
      if (reference) {
        const std::vector<double> lq = log_softmax(ref_logits->row(row).data(), c.vocab_size);
        double k = 0;
        for (int32_t i = 0; i < c.vocab_size; ++i) k += std::exp(lq[static_cast<size_t>(i)]) * (lq[static_cast<size_t>(i)] - lp[static_cast<size_t>(i)]);
        kl += k;
      }
      ++scored;
    }
    char extra[96];
    std::snprintf(extra, sizeof extra, "ppl %.3f", std::exp(nll / static_cast<double>(scored)));
    progress.update(scored, extra);
  }
  progress.done();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("cache=%s sink=%lld recent=%lld page_size=%lld chunk=%lld kv_bytes_per_token=%.1f tokens_per_s=%.1f\n",
              o.cache.c_str(), static_cast<long long>(o.sink), static_cast<long long>(o.recent),
              static_cast<long long>(o.page_size), static_cast<long long>(o.chunk), (*cache)->bytes_per_token(),
              static_cast<double>(scored) / seconds);
  const bool has_kl = reference || o.cache == "bf16";
  std::printf("perplexity=%.6f kl=%.6f tokens=%lld\n", std::exp(nll / static_cast<double>(scored)),
              has_kl ? kl / static_cast<double>(scored) : std::nan(""), static_cast<long long>(scored));
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
  // Check the cache flags before the (slow) model load.
  if (auto method = parse_cache_method(o.cache); !method.ok()) return usage_error(method.status().message());
  if (o.cache == "oscar" && o.plan.empty()) {
    return usage_error("--cache oscar needs --plan FILE (plan files arrive with oscar-fit)");
  }
  if (!o.text.empty()) {
    std::ifstream t(o.text);
    if (!t) return usage_error("--text '" + o.text + "' cannot be opened");
  }
  auto model = load_model(o.model);
  if (!model.ok()) {
    std::fprintf(stderr, "oscar-decode: %s\n", model.status().to_string().c_str());
    return 1;
  }
  return o.mode == "generate" ? run_generate(o, *model) : run_perplexity(o, *model);
}
