// Loader of llama2.c models in the llama2.ts "version 1" .bin format (the 260K-parameter
// TinyStories model in /work/shared/data/tinystories-260k) and their SentencePiece-style
// tokenizer. Layout: see that folder's README.md. A tiny real Llama for fast CI tests of the
// forward pass; head_dim 8 is too small for the paged cache (64/128/256), so tests use the
// exact cache with it.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "llama.hpp"
#include "oscar/core/status.hpp"
#include "tokenizer.hpp"

namespace oscar::decode {

// llama2.c tokenization: "▁" stands for a space and one is prepended to the text; text is
// split into code points (unknown ones fall back to <0xNN> byte tokens), then the adjacent
// pair whose concatenation is in the vocabulary with the highest score is merged, repeatedly.
class SentencePieceTokenizer {
 public:
  SentencePieceTokenizer() = default;
  SentencePieceTokenizer(std::vector<std::string> tokens, std::vector<float> scores)
      : tokens_(std::move(tokens)), scores_(std::move(scores)) {
    for (size_t i = 0; i < tokens_.size(); ++i) ids_.emplace(tokens_[i], static_cast<int32_t>(i));
  }
  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return 1; }
  int32_t eos_id() const { return 2; }
  const std::string& token_text(int32_t id) const { return tokens_.at(static_cast<size_t>(id)); }
  int32_t find(const std::string& s) const {
    auto it = ids_.find(s);
    return it == ids_.end() ? -1 : it->second;
  }

  // Without BOS; callers prepend bos_id() where the model expects it.
  std::vector<int32_t> encode(const std::string& text) const {
    std::string normalized = "\xE2\x96\x81";  // dummy prefix
    for (char ch : text) {
      if (ch == ' ') normalized += "\xE2\x96\x81";
      else normalized += ch;
    }
    std::vector<int32_t> ids;
    for (size_t i = 0; i < normalized.size();) {
      size_t length = 0;
      utf8::next(normalized, i, length);
      const int32_t id = find(normalized.substr(i, length));
      if (id >= 0) {
        ids.push_back(id);
      } else {
        for (size_t k = 0; k < length; ++k) {
          char hex[8];
          std::snprintf(hex, sizeof hex, "<0x%02X>", static_cast<unsigned char>(normalized[i + k]));
          const int32_t byte_id = find(hex);
          ids.push_back(byte_id >= 0 ? byte_id : 0);
        }
      }
      i += length;
    }
    while (true) {
      float best = -1e30f;
      int32_t best_id = -1;
      size_t best_at = 0;
      for (size_t i = 0; i + 1 < ids.size(); ++i) {
        const int32_t id = find(tokens_[static_cast<size_t>(ids[i])] + tokens_[static_cast<size_t>(ids[i + 1])]);
        if (id >= 0 && scores_[static_cast<size_t>(id)] > best) {
          best = scores_[static_cast<size_t>(id)];
          best_id = id;
          best_at = i;
        }
      }
      if (best_id < 0) break;
      ids[best_at] = best_id;
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    }
    return ids;
  }

  // `previous` is the id before `id` (a space after BOS is dropped, as llama2.c does).
  std::string decode(int32_t id, int32_t previous = -1) const {
    if (id < 0 || id >= vocab_size() || id == bos_id() || id == eos_id()) return {};
    std::string t = tokens_[static_cast<size_t>(id)];
    unsigned int byte = 0;
    if (t.size() == 6 && std::sscanf(t.c_str(), "<0x%02X>", &byte) == 1) return std::string(1, static_cast<char>(byte));
    std::string out;
    for (size_t i = 0; i < t.size();) {
      if (t.compare(i, 3, "\xE2\x96\x81") == 0) {
        out += ' ';
        i += 3;
      } else {
        out += t[i++];
      }
    }
    if (previous == bos_id() && !out.empty() && out[0] == ' ') out.erase(0, 1);
    return out;
  }
  std::string decode(const std::vector<int32_t>& ids) const {
    std::string out;
    int32_t previous = bos_id();
    for (int32_t id : ids) {
      out += decode(id, previous);
      previous = id;
    }
    return out;
  }

 private:
  std::vector<std::string> tokens_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int32_t> ids_;
};

struct Llama2cModel {
  LlamaWeights weights;
  SentencePieceTokenizer tokenizer;
};

inline Result<Llama2cModel> load_llama2c(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return io_error("cannot open model file '" + path + "'");
  const std::streamoff file_size = in.tellg();
  std::vector<uint8_t> bytes(static_cast<size_t>(file_size > 0 ? file_size : 0));
  in.seekg(0);
  if (!bytes.empty() && !in.read(reinterpret_cast<char*>(bytes.data()), file_size)) {
    return io_error("cannot read model file '" + path + "'");
  }
  size_t pos = 0;
  auto need = [&](size_t n, const char* what) -> Status {
    if (bytes.size() - pos < n || pos > bytes.size()) {
      return data_loss(path + ": file is truncated while reading " + std::string(what) + " at byte " + std::to_string(pos));
    }
    return Status::Ok();
  };
  auto read_i32 = [&](int32_t& v, const char* what) -> Status {
    OSCAR_RETURN_IF_ERROR(need(4, what));
    std::memcpy(&v, bytes.data() + pos, 4);
    pos += 4;
    return Status::Ok();
  };
  OSCAR_RETURN_IF_ERROR(need(1, "the version"));
  if (bytes[0] != 1) return unsupported(path + ": llama2.ts model version " + std::to_string(bytes[0]) + " (only 1)");
  pos = 1;
  int32_t name_len = 0;
  OSCAR_RETURN_IF_ERROR(read_i32(name_len, "the architecture name length"));
  if (name_len < 0 || name_len > 64) return data_loss(path + ": bad architecture name length");
  OSCAR_RETURN_IF_ERROR(need(static_cast<size_t>(name_len), "the architecture name"));
  const std::string arch(reinterpret_cast<const char*>(bytes.data() + pos), static_cast<size_t>(name_len));
  pos += static_cast<size_t>(name_len);
  if (arch != "llama") return unsupported(path + ": architecture '" + arch + "' (only 'llama')");
  LlamaConfig c;
  c.rope_style = RopeStyle::kAdjacentPairs;
  c.rope_base = 10000.0f;
  c.rms_eps = 1e-5f;
  int32_t* fields[] = {&c.hidden, &c.intermediate, &c.max_seq_len, &c.vocab_size, &c.num_layers, &c.num_qo_heads, &c.num_kv_heads};
  for (int32_t* f : fields) {
    OSCAR_RETURN_IF_ERROR(read_i32(*f, "the header"));
    if (*f <= 0 || *f > (1 << 20)) return data_loss(path + ": header field out of range");
  }
  OSCAR_RETURN_IF_ERROR(need(1, "the shared-output flag"));
  const bool shared = bytes[pos] != 0;
  if (c.hidden % c.num_qo_heads != 0) return data_loss(path + ": hidden size is not a multiple of the head count");
  c.head_dim = c.hidden / c.num_qo_heads;
  OSCAR_RETURN_IF_ERROR(validate(c));

  pos = 256;
  std::vector<std::string> tokens;
  std::vector<float> scores;
  for (int32_t i = 0; i < c.vocab_size; ++i) {
    float score = 0;
    int32_t len = 0;
    OSCAR_RETURN_IF_ERROR(need(4, "a vocabulary score"));
    std::memcpy(&score, bytes.data() + pos, 4);
    pos += 4;
    OSCAR_RETURN_IF_ERROR(read_i32(len, "a vocabulary entry length"));
    if (len < 0) return data_loss(path + ": negative token length");
    OSCAR_RETURN_IF_ERROR(need(static_cast<size_t>(len), "a vocabulary entry"));
    tokens.emplace_back(reinterpret_cast<const char*>(bytes.data() + pos), static_cast<size_t>(len));
    scores.push_back(score);
    pos += static_cast<size_t>(len);
  }

  const int64_t h = c.hidden, kv = static_cast<int64_t>(c.num_kv_heads) * c.head_dim, L = c.num_layers;
  const int64_t inter = c.intermediate, V = c.vocab_size;
  const int64_t floats = V * h + L * h + L * h * h + 2 * L * kv * h + L * h * h + L * h +
                         3 * L * inter * h + h + (shared ? 0 : V * h);
  // Each header field is at most 2^20, so the count fits int64 (< 2^63) but 4x it need not fit
  // size_t: compared by division.
  OSCAR_RETURN_IF_ERROR(need(0, "the weights"));
  if (floats < 0 || static_cast<uint64_t>(floats) > (bytes.size() - pos) / 4) {
    return data_loss(path + ": the header's shape needs " + std::to_string(floats) + " weights; the file holds " +
                     std::to_string((bytes.size() - pos) / 4) + " (truncated or corrupted)");
  }
  const float* p = reinterpret_cast<const float*>(bytes.data() + pos);  // memcpy'd below
  std::vector<float> all(static_cast<size_t>(floats));
  std::memcpy(all.data(), p, all.size() * 4);
  const float* cur = all.data();
  auto take = [&](int64_t rows, int64_t cols) {
    RowMatrix m = Eigen::Map<const RowMatrix>(cur, rows, cols);
    cur += rows * cols;
    return m;
  };
  Llama2cModel model;
  LlamaWeights& w = model.weights;
  w.config = c;
  w.layers.resize(static_cast<size_t>(L));
  w.embedding = take(V, h);
  for (auto& layer : w.layers) layer.attn_norm = take(h, 1);
  for (auto& layer : w.layers) layer.wq = take(h, h);
  for (auto& layer : w.layers) layer.wk = take(kv, h);
  for (auto& layer : w.layers) layer.wv = take(kv, h);
  for (auto& layer : w.layers) layer.wo = take(h, h);
  for (auto& layer : w.layers) layer.ffn_norm = take(h, 1);
  for (auto& layer : w.layers) layer.w_gate = take(inter, h);  // w1
  for (auto& layer : w.layers) layer.w_up = take(inter, h);    // w3
  for (auto& layer : w.layers) layer.w_down = take(h, inter);  // w2
  w.final_norm = take(h, 1);
  if (!shared) w.output = take(V, h);
  model.tokenizer = SentencePieceTokenizer(std::move(tokens), std::move(scores));
  return Result<Llama2cModel>(std::move(model));
}

}  // namespace oscar::decode
