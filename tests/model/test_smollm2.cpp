// SmolLM2-135M-Instruct (the GGUF fetched by scripts/fetch-model.sh): logits against an
// independent float64 forward on the raw GGUF tensors (llama.cpp's row order and adjacent-pair
// RoPE, so the loader's un-permutation is checked too), tokenizer ids of the chat template,
// a sane greedy answer, the BF16 paged cache against the exact float cache, and the
// perplexity ordering bf16 < int2-hadamard < int2-naive.
//
// Needs the model file: $OSCAR_MODEL or ${OSCAR_MODEL_DIR:-~/.cache/oscar}/SmolLM2-135M-Instruct.Q4_1.gguf.
// Without it the executable prints why and exits 77, which ctest reports as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cache_methods.hpp"
#include "calibration.hpp"
#include "model/smollm2_model.hpp"

using namespace oscar::decode;
using namespace oscar::decode::testing;

namespace {

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

// The same tokens are scored by each cache, so compare paired per-token NLL differences: the
// better cache must win by more than 3 standard errors of the mean difference (a one-sided
// z-test at p ~ 0.001 on 255 tokens), not by noise.
void check_paired_win(const std::vector<double>& better_nll, const std::vector<double>& worse_nll, const char* what) {
  std::vector<double> d;
  for (size_t i = 0; i < better_nll.size(); ++i) d.push_back(worse_nll[i] - better_nll[i]);
  const double m = mean(d);
  double var = 0;
  for (double x : d) var += (x - m) * (x - m);
  const double se = std::sqrt(var / static_cast<double>(d.size() - 1) / static_cast<double>(d.size()));
  MESSAGE(std::string(what) << ": mean NLL gap " << m << " nats, standard error " << se);
  CHECK_MESSAGE(m > 3 * se, what);
}

const std::string kChatPrompt =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";

// The float64 reference: weights dequantized from the file (each a float, exact in double),
// all arithmetic in double, llama.cpp's conventions (rows as stored, RoPE on pairs 2i, 2i+1).
std::vector<std::vector<double>> reference_logits(const std::vector<int32_t>& ids) {
  const GgufFile& f = model().file;
  const int64_t h = *f.get_int("llama.embedding_length"), L = *f.get_int("llama.block_count");
  const int64_t H = *f.get_int("llama.attention.head_count"), KV = *f.get_int("llama.attention.head_count_kv");
  const int64_t inter = *f.get_int("llama.feed_forward_length");
  const double base = *f.get_float("llama.rope.freq_base"), eps = *f.get_float("llama.attention.layer_norm_rms_epsilon");
  const int64_t hd = h / H, T = static_cast<int64_t>(ids.size());
  auto tensor = [&](const std::string& name) {
    auto t = f.read_f32(name);
    REQUIRE_MESSAGE(t.ok(), t.status().to_string());
    return std::move(t).value();
  };
  // y[t] = W x[t], W [rows, cols] with cols contiguous.
  auto matmul = [&](const std::vector<float>& w, const std::vector<std::vector<double>>& x, int64_t rows) {
    std::vector<std::vector<double>> y(x.size(), std::vector<double>(static_cast<size_t>(rows)));
    const size_t cols = x[0].size();
    for (size_t t = 0; t < x.size(); ++t)
      for (int64_t r = 0; r < rows; ++r) {
        double s = 0;
        const float* row = w.data() + static_cast<size_t>(r) * cols;
        for (size_t c = 0; c < cols; ++c) s += static_cast<double>(row[c]) * x[t][c];
        y[t][static_cast<size_t>(r)] = s;
      }
    return y;
  };
  auto norm = [&](const std::vector<std::vector<double>>& x, const std::vector<float>& w) {
    auto y = x;
    for (auto& row : y) {
      double ss = 0;
      for (double v : row) ss += v * v;
      const double s = 1.0 / std::sqrt(ss / static_cast<double>(row.size()) + eps);
      for (size_t i = 0; i < row.size(); ++i) row[i] *= s * w[i];
    }
    return y;
  };
  auto rope = [&](std::vector<std::vector<double>>& x) {
    for (int64_t t = 0; t < T; ++t)
      for (size_t head = 0; head < x[0].size() / static_cast<size_t>(hd); ++head)
        for (int64_t i = 0; i < hd / 2; ++i) {
          const double a = static_cast<double>(t) * std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(hd));
          double& x0 = x[static_cast<size_t>(t)][head * static_cast<size_t>(hd) + 2 * static_cast<size_t>(i)];
          double& x1 = x[static_cast<size_t>(t)][head * static_cast<size_t>(hd) + 2 * static_cast<size_t>(i) + 1];
          const double r0 = x0 * std::cos(a) - x1 * std::sin(a), r1 = x0 * std::sin(a) + x1 * std::cos(a);
          x0 = r0;
          x1 = r1;
        }
  };
  const std::vector<float> emb = tensor("token_embd.weight");
  std::vector<std::vector<double>> x;
  for (int32_t id : ids) x.emplace_back(emb.begin() + static_cast<std::ptrdiff_t>(id * h), emb.begin() + static_cast<std::ptrdiff_t>((id + 1) * h));
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    const auto xn = norm(x, tensor(p + "attn_norm.weight"));
    auto q = matmul(tensor(p + "attn_q.weight"), xn, H * hd);
    auto k = matmul(tensor(p + "attn_k.weight"), xn, KV * hd);
    const auto v = matmul(tensor(p + "attn_v.weight"), xn, KV * hd);
    rope(q);
    rope(k);
    std::vector<std::vector<double>> att(static_cast<size_t>(T), std::vector<double>(static_cast<size_t>(H * hd), 0.0));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t head = 0; head < H; ++head) {
        const int64_t kvh = head / (H / KV);
        std::vector<double> s(static_cast<size_t>(t + 1));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= t; ++j) {
          double d = 0;
          for (int64_t i = 0; i < hd; ++i) d += q[static_cast<size_t>(t)][static_cast<size_t>(head * hd + i)] * k[static_cast<size_t>(j)][static_cast<size_t>(kvh * hd + i)];
          s[static_cast<size_t>(j)] = d / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[static_cast<size_t>(j)]);
        }
        for (double& e : s) { e = std::exp(e - mx); sum += e; }
        for (int64_t j = 0; j <= t; ++j)
          for (int64_t i = 0; i < hd; ++i)
            att[static_cast<size_t>(t)][static_cast<size_t>(head * hd + i)] += s[static_cast<size_t>(j)] / sum * v[static_cast<size_t>(j)][static_cast<size_t>(kvh * hd + i)];
      }
    const auto o = matmul(tensor(p + "attn_output.weight"), att, h);
    for (int64_t t = 0; t < T; ++t) for (int64_t i = 0; i < h; ++i) x[static_cast<size_t>(t)][static_cast<size_t>(i)] += o[static_cast<size_t>(t)][static_cast<size_t>(i)];
    const auto xn2 = norm(x, tensor(p + "ffn_norm.weight"));
    auto g = matmul(tensor(p + "ffn_gate.weight"), xn2, inter);
    const auto u = matmul(tensor(p + "ffn_up.weight"), xn2, inter);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < inter; ++i) {
        double& gi = g[static_cast<size_t>(t)][static_cast<size_t>(i)];
        gi = gi / (1.0 + std::exp(-gi)) * u[static_cast<size_t>(t)][static_cast<size_t>(i)];
      }
    const auto d = matmul(tensor(p + "ffn_down.weight"), g, h);
    for (int64_t t = 0; t < T; ++t) for (int64_t i = 0; i < h; ++i) x[static_cast<size_t>(t)][static_cast<size_t>(i)] += d[static_cast<size_t>(t)][static_cast<size_t>(i)];
  }
  return matmul(emb, norm(x, tensor("output_norm.weight")), static_cast<int64_t>(emb.size()) / h);
}

}  // namespace

TEST_CASE("SmolLM2: hyper-parameters from the GGUF") {
  const LlamaConfig& c = model().weights.config;
  CHECK(c.hidden == 576);
  CHECK(c.num_layers == 30);
  CHECK(c.num_qo_heads == 9);
  CHECK(c.num_kv_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.vocab_size == 49152);
  CHECK(c.rope_base == 100000.0f);
  CHECK(model().weights.output.size() == 0);  // tied to the embedding
}

TEST_CASE("SmolLM2: a block_count that disagrees with the blk.N tensors is refused before anything is sized") {
  // The u32 after the key "llama.block_count" (its u64 length, the key, the u32 type id 4).
  std::ifstream in(default_model_path(), std::ios::binary);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string key = "llama.block_count";
  const auto at = std::search(bytes.begin(), bytes.end(), key.begin(), key.end());
  REQUIRE(at != bytes.end());
  const size_t value = static_cast<size_t>(at - bytes.begin()) + key.size() + 4;
  REQUIRE(bytes[value] == 30);
  for (const uint32_t count : {29u, 31u, 1u << 30}) {
    CAPTURE(count);
    std::vector<uint8_t> patched = bytes;
    std::memcpy(patched.data() + value, &count, 4);
    auto file = GgufFile::parse(std::move(patched), "patched.gguf");
    REQUIRE(file.ok());
    const auto weights = load_llama(*file);
    CHECK(weights.status().message().find("llama.block_count " + std::to_string(count) +
                                          " does not match the file's blk.N tensors") != std::string::npos);
  }
}

TEST_CASE("SmolLM2 tokenizer: chat template ids and known encodings") {
  const BpeTokenizer& tok = model().tokenizer;
  // The template's special tokens are ids 1 and 2 of SmolLM2's vocabulary.
  CHECK(tok.find("<|im_start|>") == 1);
  CHECK(tok.find("<|im_end|>") == 2);
  const std::vector<int32_t> ids = tok.encode(kChatPrompt);
  REQUIRE(ids.size() > 10);
  // <|im_start|> "system" "\n" ...: role names and the newline are single tokens.
  CHECK(ids[0] == 1);
  CHECK(ids[1] == tok.find("system"));
  CHECK(ids[2] == tok.find("\xC4\x8A"));  // "Ċ", GPT-2's code point for byte '\n'
  int starts = 0, ends = 0;
  for (int32_t id : ids) { starts += id == 1; ends += id == 2; }
  CHECK(starts == 3);
  CHECK(ends == 2);
  // ... <|im_end|> "\n" <|im_start|> assistant "\n" ("assistant" is whatever BPE makes of it).
  std::vector<int32_t> tail = {2, tok.find("\xC4\x8A"), 1};
  for (int32_t id : tok.encode("assistant")) tail.push_back(id);
  tail.push_back(tok.find("\xC4\x8A"));
  CHECK(std::vector<int32_t>(ids.end() - static_cast<std::ptrdiff_t>(tail.size()), ids.end()) == tail);
  CHECK(tok.decode(ids) == kChatPrompt);
  // Words with their leading space ("Ġ") are single tokens of the vocabulary.
  CHECK(tok.encode("Hello, world!") == std::vector<int32_t>{tok.find("Hello"), tok.find(","), tok.find("\xC4\xA0world"), tok.find("!")});
  CHECK(tok.encode(" the capital of France") ==
        std::vector<int32_t>{tok.find("\xC4\xA0the"), tok.find("\xC4\xA0" "capital"), tok.find("\xC4\xA0of"), tok.find("\xC4\xA0" "France")});
  // Digits are split one by one (the "smollm" pre-tokenizer).
  CHECK(tok.encode("2024") == std::vector<int32_t>{tok.find("2"), tok.find("0"), tok.find("2"), tok.find("4")});
  const std::string text = read_text();
  CHECK(tok.decode(tok.encode(text, false)) == text);
}

TEST_CASE("SmolLM2 tokenizer: BPE agrees with a rank-order sweep over the merges") {
  // Reference: apply the merges in rank order, each to every occurrence left to right. For a
  // merges list learned by BPE training (a merge only uses tokens made by earlier merges)
  // this equals "merge the lowest-ranked adjacent pair first", the tokenizer's algorithm.
  const BpeTokenizer& tok = model().tokenizer;
  const GgufValue* merges = model().file.find("tokenizer.ggml.merges");
  REQUIRE(merges != nullptr);
  const std::string text = read_text().substr(0, 700) + " assistant SmolLM Hugging Face naïve café";
  int checked = 0;
  for (auto [b, e] : pretokenize(text)) {
    const std::string piece = text.substr(b, e - b);
    std::vector<std::string> sym;
    for (unsigned char ch : piece) {  // bytes -> GPT-2 code points via the vocabulary's byte tokens
      const std::vector<int32_t> one = tok.encode(std::string(1, static_cast<char>(ch)), false);
      REQUIRE(one.size() == 1);
      sym.push_back(tok.token_text(one[0]));
    }
    for (const std::string& m : merges->strings) {
      if (sym.size() < 2) break;
      const size_t sp = m.find(' ');
      const std::string left = m.substr(0, sp), right = m.substr(sp + 1);
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        if (sym[i] == left && sym[i + 1] == right) {
          sym[i] += sym[i + 1];
          sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        }
      }
    }
    std::vector<int32_t> expected;
    for (const std::string& s : sym) expected.push_back(tok.find(s));
    CHECK_MESSAGE(tok.encode(piece, false) == expected, "'" << piece << "'");
    ++checked;
  }
  CHECK(checked > 100);
}

TEST_CASE("SmolLM2: float32 logits match an independent float64 forward") {
  const BpeTokenizer& tok = model().tokenizer;
  std::vector<int32_t> ids = tok.encode("<|im_start|>user\nThe capital of France is");
  REQUIRE(ids.size() >= 6);
  ids.resize(6);
  const auto expected = reference_logits(ids);
  ExactKvCache cache(model().weights.config, 16);
  const auto got = run(cache, ids, {1});
  const int V = model().weights.config.vocab_size;
  double worst = 0, scale = 0;
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int i = 0; i < V; ++i) {
      worst = std::max(worst, std::abs(got[t][static_cast<size_t>(i)] - expected[t][static_cast<size_t>(i)]));
      scale = std::max(scale, std::abs(expected[t][static_cast<size_t>(i)]));
    }
    CHECK(argmax(got[t].data(), V) ==
          static_cast<int>(std::max_element(expected[t].begin(), expected[t].end()) - expected[t].begin()));
  }
  MESSAGE("max |logit error| " << worst << " (max |logit| " << scale << ")");
  // float32 sums of up to 1536 products err by ~sqrt(1536) * 2^-24 ~ 2.5e-6 of the terms'
  // scale; 30 layers of residual adds and RMSNorm rescalings (SmolLM2 has outlier
  // activations ~100x the median) compound this to ~1e-4 of the largest logit. 1e-3 leaves
  // a margin of ~10; a layout mistake (RoPE pairs, Q/K permutation) moves logits by O(1).
  CHECK(worst <= 1e-3 * scale);
}

TEST_CASE("SmolLM2: greedy answer through the bf16 paged cache names Paris") {
  const BpeTokenizer& tok = model().tokenizer;
  const std::vector<int32_t> ids = tok.encode(kChatPrompt);
  auto cache = make_cache(CacheMethod::kBf16, model().weights.config, {256, 0, 0, 16});
  REQUIRE(cache.ok());
  auto logits = forward(model().weights, **cache, ids, true);
  REQUIRE(logits.ok());
  std::string answer;
  for (int i = 0; i < 24; ++i) {
    const int32_t next = argmax(logits->data(), model().weights.config.vocab_size);
    if (next == 2 || next == tok.eos_id()) break;
    answer += tok.decode(next);
    logits = forward(model().weights, **cache, {next}, true);
    REQUIRE(logits.ok());
  }
  MESSAGE("answer: " << answer);
  CHECK(answer.find("Paris") != std::string::npos);
}

TEST_CASE("SmolLM2: bf16 paged cache agrees with the exact float cache within bf16 error") {
  std::vector<int32_t> ids = model().tokenizer.encode(read_text(), false);
  ids.resize(96);
  const LlamaConfig& c = model().weights.config;
  ExactKvCache exact(c, 96);
  auto bf16 = make_cache(CacheMethod::kBf16, c, {96, 0, 0, 16});
  REQUIRE(bf16.ok());
  const auto a = run(exact, ids, {16});
  const auto b = run(**bf16, ids, {16});
  const LogitGap gap = logit_gap(a, b);
  const double kl = gap.mean_kl, worst = gap.worst_logit;
  const int same_top1 = gap.same_top1;
  MESSAGE("mean KL(exact || bf16) " << kl << ", max |logit diff| " << worst << ", top-1 agreement " << same_top1 << "/" << ids.size());
  // bf16 keeps 8 significant bits: each cached K/V element moves by up to 2^-9 of itself,
  // so attention logits and outputs move by ~2^-9 of their scale, and the final logits
  // (|z| up to ~30) by a few 1e-2 at most. Two softmaxes whose logits differ by delta have
  // KL <= delta_max^2 / 2 ~ 1e-3 for delta_max ~ 0.05. The bf16 cache must also be doing
  // something: a cache that dropped or misplaced tokens gives KL ~ 1 and different argmaxes.
  CHECK(kl <= 1e-3);
  CHECK(worst <= 0.5);
  CHECK(same_top1 >= static_cast<int>(ids.size()) * 9 / 10);
}

TEST_CASE("SmolLM2: perplexity orders bf16 < int2-hadamard < int2-naive") {
  std::vector<int32_t> ids = model().tokenizer.encode(read_text(), false);
  REQUIRE(ids.size() >= 256);
  ids.resize(256);
  const LlamaConfig& c = model().weights.config;
  // Pure INT2 (sink 0, recent 0), extended 16 tokens at a time over the quantized prefix.
  auto nll_of = [&](CacheMethod method) {
    auto cache = make_cache(method, c, {256, 0, 0, 16});
    REQUIRE(cache.ok());
    const auto logits = run(**cache, std::vector<int32_t>(ids.begin(), ids.end() - 1), {16});
    std::vector<double> nll;
    for (size_t t = 0; t + 1 < ids.size(); ++t) nll.push_back(-log_softmax(logits[t])[static_cast<size_t>(ids[t + 1])]);
    return nll;
  };
  const auto bf16 = nll_of(CacheMethod::kBf16);
  const auto hadamard = nll_of(CacheMethod::kInt2Hadamard);
  const auto naive = nll_of(CacheMethod::kInt2Naive);
  MESSAGE("perplexity bf16 " << std::exp(mean(bf16)) << ", int2-hadamard " << std::exp(mean(hadamard))
                             << ", int2-naive " << std::exp(mean(naive)));
  check_paired_win(bf16, hadamard, "bf16 < int2-hadamard");
  check_paired_win(hadamard, naive, "int2-hadamard < int2-naive");
}

// A plan calibrated in-process on the text after the first 256 tokens (statistics: two
// sequences of 192 tokens; held out for the clip search: the text's last 128 tokens), so the
// first 256 tokens, which the perplexity tests score, are not part of it.
const CalibrationResult& small_plan() {
  static std::unique_ptr<CalibrationResult> result = [] {
    const std::vector<int32_t> ids = model().tokenizer.encode(read_text(), false);
    REQUIRE(ids.size() >= 256 + 384 + 128);
    CalibrationOptions options;
    options.sequence_tokens = 192;
    options.max_tokens = 384;
    options.held_out_tokens = 128;
    options.fit.threads = 2;
    auto r = calibrate(model().weights, std::vector<int32_t>(ids.begin() + 256, ids.end()), options);
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    return std::unique_ptr<CalibrationResult>(new CalibrationResult(std::move(*r)));
  }();
  return *result;
}

TEST_CASE("SmolLM2: calibrate gives a valid plan for this model from the streaming accumulators") {
  const CalibrationResult& r = small_plan();
  const oscar::io::Plan& plan = r.fit.plan;
  CHECK(oscar::io::validate(plan).ok());
  CHECK(oscar::io::check_plan_matches(plan, cache_shape(model().weights.config)).ok());
  CHECK(plan.method == "oscar");
  CHECK(plan.clip_method == "fitted");
  // Two sequences of 192 tokens, the first 16 positions of each skipped.
  CHECK(r.statistics_tokens == 2 * (192 - 16));
  CHECK(plan.calibration_tokens == r.statistics_tokens);
  CHECK(r.held_out_tokens == 128 - 16);
  // Fitted ratios come from the search grid (1.00 ... 0.85), and the fit beats the Hadamard
  // baseline on its own objective on average (the search includes ratios near the
  // baseline's, and the query-aware basis targets J_K directly).
  double jk = 0;
  for (const auto& report : r.fit.reports) {
    CHECK(report.k_clip_ratio >= 0.85f - 1e-6f);
    CHECK(report.k_clip_ratio <= 1.0f);
    CHECK(report.v_clip_ratio >= 0.85f - 1e-6f);
    jk += report.j_k / report.j_k_hadamard;
  }
  CHECK(jk / static_cast<double>(r.fit.reports.size()) < 1.0);
  // The round trip through the file format keeps every number.
  auto bytes = oscar::io::serialize_plan(plan);
  REQUIRE(bytes.ok());
  auto back = oscar::io::parse_plan(*bytes);
  REQUIRE(back.ok());
  CHECK(*back == plan);
}

TEST_CASE("SmolLM2: int4 and oscar-fit beat int2-hadamard on held-out tokens; a wrong plan is refused") {
  std::vector<int32_t> ids = model().tokenizer.encode(read_text(), false);
  ids.resize(256);
  const LlamaConfig& c = model().weights.config;
  const oscar::io::Plan& plan = small_plan().fit.plan;
  // sink 0 / recent 0: every token past the first page is quantized, token by token.
  auto nll_of = [&](CacheMethod method) {
    auto cache = make_cache(method, c, {256, 0, 0, 16}, &plan);
    REQUIRE_MESSAGE(cache.ok(), cache.status().to_string());
    const auto logits = run(**cache, std::vector<int32_t>(ids.begin(), ids.end() - 1), {1});
    std::vector<double> nll;
    for (size_t t = 0; t + 1 < ids.size(); ++t) nll.push_back(-log_softmax(logits[t])[static_cast<size_t>(ids[t + 1])]);
    return nll;
  };
  const auto hadamard = nll_of(CacheMethod::kInt2Hadamard);
  const auto int4 = nll_of(CacheMethod::kInt4);
  const auto fitted = nll_of(CacheMethod::kOscarFit);
  MESSAGE("perplexity int4 " << std::exp(mean(int4)) << ", oscar-fit " << std::exp(mean(fitted)) << ", int2-hadamard "
                             << std::exp(mean(hadamard)));
  check_paired_win(int4, hadamard, "int4 < int2-hadamard");
  check_paired_win(fitted, hadamard, "oscar-fit < int2-hadamard");

  // A plan of another shape is refused with the mismatch named.
  oscar::io::Plan wrong = plan;
  wrong.num_layers = 2;
  wrong.layers.resize(2);
  auto refused = make_cache(CacheMethod::kOscar, c, {256, 0, 0, 16}, &wrong);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().message().find("num_layers") != std::string::npos);
  CHECK_FALSE(make_cache(CacheMethod::kOscarFit, c, {256, 0, 0, 16}, nullptr).ok());
}

TEST_CASE("SmolLM2: a forked request shares the prefix's INT2 pages and computes the same logits") {
  const std::vector<int32_t> ids = model().tokenizer.encode(read_text(), false);
  const LlamaConfig& c = model().weights.config;
  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + 100);
  const std::vector<int32_t> suffix_a(ids.begin() + 100, ids.begin() + 120);
  const std::vector<int32_t> suffix_b(ids.begin() + 300, ids.begin() + 320);
  auto shared = PagedKvCache::create(c, 160, 0, 0, 16, hadamard_quantizers(c.num_layers, c.head_dim), 2);
  REQUIRE(shared.ok());
  PagedKvCache& kv = **shared;
  const auto a = kv.active_request();
  REQUIRE(forward(model().weights, kv, prefix).ok());
  auto b = kv.fork_active();
  REQUIRE(b.ok());
  // 100 tokens with no sink and no window: 6 full INT2 pages (96 tokens), 4 BF16 tokens.
  CHECK(kv.cache().usage().int2_pages_shared == 6);
  auto logits_b = forward(model().weights, kv, suffix_b);
  REQUIRE(logits_b.ok());
  REQUIRE(kv.activate(a).ok());
  REQUIRE(forward(model().weights, kv, suffix_a).ok());
  const auto usage = kv.cache().usage();
  // Each request then holds 120 tokens = 7 INT2 pages: 6 shared + 1 own each, 8 in all
  // instead of 14 for two separate caches.
  CHECK(usage.int2_pages_shared == 6);
  CHECK(usage.int2_pages_used == 8);
  // The same computation without sharing gives the same logits: shared pages are read, not copied or changed.
  auto alone = PagedKvCache::create(c, 160, 0, 0, 16, hadamard_quantizers(c.num_layers, c.head_dim));
  REQUIRE(alone.ok());
  REQUIRE(forward(model().weights, **alone, prefix).ok());
  auto logits_alone = forward(model().weights, **alone, suffix_b);
  REQUIRE(logits_alone.ok());
  CHECK((*logits_alone - *logits_b).cwiseAbs().maxCoeff() == 0.0f);
}

int main(int argc, char** argv) {
  if (!smollm2_model_present()) return 77;
  doctest::Context context(argc, argv);
  return context.run();
}
