// GPT-2 style byte-level BPE, built from a GGUF file's tokenizer.ggml.* metadata (the
// tokenizer of SmolLM2, StarCoder, GPT-2 and most "gpt2"-model GGUFs).
//
// encode(text):
//   1. special tokens (token types 3 "control" and 4 "user defined", e.g. <|im_start|>) are
//      cut out of the text first and map to their ids directly (when parse_special is set);
//   2. the rest is pre-tokenized like llama.cpp's "smollm" pre-tokenizer: every digit alone,
//      then the GPT-2 split 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (done by hand on code points; the Unicode letter/number classes are approximated by
//      tables of ranges below: exact for ASCII and Latin-1, close for common scripts);
//   3. each piece's bytes are mapped to printable code points (GPT-2's bytes_to_unicode) and
//      merged pairwise, lowest merge rank first, as listed in tokenizer.ggml.merges.
// decode(ids) maps the code points back to bytes; control tokens are emitted as their text.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gguf.hpp"
#include "oscar/core/status.hpp"

namespace oscar::decode {

namespace utf8 {

// Decodes one code point at s[i]; invalid or truncated sequences decode as one byte with
// code point 0xFFFD so that every byte still reaches the byte-level BPE.
inline uint32_t next(std::string_view s, size_t i, size_t& length) {
  const auto b = static_cast<unsigned char>(s[i]);
  auto cont = [&](size_t k) { return i + k < s.size() && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80; };
  auto at = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F); };
  if (b < 0x80) { length = 1; return b; }
  if ((b & 0xE0) == 0xC0 && b >= 0xC2 && cont(1)) { length = 2; return ((b & 0x1Fu) << 6) | at(1); }
  if ((b & 0xF0) == 0xE0 && cont(1) && cont(2)) {
    const uint32_t cp = ((b & 0x0Fu) << 12) | (at(1) << 6) | at(2);
    if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) { length = 3; return cp; }
  }
  if ((b & 0xF8) == 0xF0 && cont(1) && cont(2) && cont(3)) {
    const uint32_t cp = ((b & 0x07u) << 18) | (at(1) << 12) | (at(2) << 6) | at(3);
    if (cp >= 0x10000 && cp <= 0x10FFFF) { length = 4; return cp; }
  }
  length = 1;
  return 0xFFFD;
}

inline void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace utf8

namespace unicode {

inline bool in(uint32_t cp, uint32_t lo, uint32_t hi) { return cp >= lo && cp <= hi; }

inline bool is_whitespace(uint32_t cp) {
  return in(cp, 0x09, 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         in(cp, 0x2000, 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

// \p{N}: decimal digits of common scripts, superscripts, fractions, circled and roman numbers.
inline bool is_number(uint32_t cp) {
  if (cp < 0x80) return in(cp, '0', '9');
  return cp == 0xB2 || cp == 0xB3 || cp == 0xB9 || in(cp, 0xBC, 0xBE) || in(cp, 0x0660, 0x0669) ||
         in(cp, 0x06F0, 0x06F9) || in(cp, 0x0966, 0x096F) || in(cp, 0x09E6, 0x09EF) ||
         in(cp, 0x0E50, 0x0E59) || cp == 0x2070 || in(cp, 0x2074, 0x2079) || in(cp, 0x2080, 0x2089) ||
         in(cp, 0x2150, 0x2189) || in(cp, 0x2460, 0x249B) || in(cp, 0x24EA, 0x24FF) ||
         in(cp, 0x2776, 0x2793) || cp == 0x3007 || in(cp, 0x3021, 0x3029) || in(cp, 0xFF10, 0xFF19);
}

// Neither letter, number nor space: controls, punctuation, symbols, combining marks, emoji.
inline bool is_other(uint32_t cp) {
  if (is_whitespace(cp)) return false;
  if (cp < 0x80) return !(in(cp, 'a', 'z') || in(cp, 'A', 'Z') || in(cp, '0', '9'));
  return in(cp, 0x80, 0xA9) || in(cp, 0xAB, 0xB4) || in(cp, 0xB6, 0xB9) || in(cp, 0xBB, 0xBF) ||
         cp == 0xD7 || cp == 0xF7 || in(cp, 0x02C2, 0x02C5) || in(cp, 0x02D2, 0x02DF) ||
         in(cp, 0x0300, 0x036F) || in(cp, 0x2000, 0x206F) || in(cp, 0x20A0, 0x20FF) ||
         in(cp, 0x2100, 0x214F) || in(cp, 0x2190, 0x2BFF) || in(cp, 0x2E00, 0x2E7F) ||
         in(cp, 0x3000, 0x3004) || in(cp, 0x3008, 0x303F) || in(cp, 0xE000, 0xF8FF) ||
         in(cp, 0xFE00, 0xFE6F) || in(cp, 0xFF01, 0xFF0F) || in(cp, 0xFF1A, 0xFF20) ||
         in(cp, 0xFF3B, 0xFF40) || in(cp, 0xFF5B, 0xFF65) || in(cp, 0x1F000, 0x1FAFF) || cp == 0xFFFD;
}

inline bool is_letter(uint32_t cp) { return !is_whitespace(cp) && !is_number(cp) && !is_other(cp); }

}  // namespace unicode

// The pieces of llama.cpp's "smollm" pre-tokenizer, as byte ranges [begin, end) of `text`.
inline std::vector<std::pair<size_t, size_t>> pretokenize(std::string_view text) {
  struct Cp { uint32_t cp; size_t begin, end; };
  std::vector<Cp> cps;
  for (size_t i = 0; i < text.size();) {
    size_t length = 0;
    const uint32_t cp = utf8::next(text, i, length);
    cps.push_back({cp, i, i + length});
    i += length;
  }
  std::vector<std::pair<size_t, size_t>> pieces;
  // Pass 1 (\p{N}): every digit is its own piece; pass 2 (GPT-2) runs within the stretches
  // between digits, which end where a digit or the text ends.
  size_t start = 0;
  auto gpt2 = [&](size_t lo, size_t hi) {  // code point indices [lo, hi)
    constexpr uint32_t kEnd = 0xFFFFFFFF;
    auto cp_at = [&](size_t k) { return k < hi ? cps[k].cp : kEnd; };
    auto add = [&](size_t a, size_t b) { pieces.emplace_back(cps[a].begin, cps[b - 1].end); };
    size_t pos = lo;
    while (pos < hi) {
      const uint32_t c = cp_at(pos);
      if (c == '\'' && pos + 1 < hi) {
        const uint32_t n1 = cp_at(pos + 1);
        if (n1 == 's' || n1 == 't' || n1 == 'm' || n1 == 'd') { add(pos, pos + 2); pos += 2; continue; }
        if (pos + 2 < hi) {
          const uint32_t n2 = cp_at(pos + 2);
          if ((n1 == 'r' && n2 == 'e') || (n1 == 'v' && n2 == 'e') || (n1 == 'l' && n2 == 'l')) {
            add(pos, pos + 3);
            pos += 3;
            continue;
          }
        }
      }
      const uint32_t c2 = c == ' ' ? cp_at(pos + 1) : c;
      const size_t first = c == ' ' ? pos + 1 : pos;
      auto run = [&](auto pred) {
        size_t k = first;
        while (k < hi && pred(cps[k].cp)) ++k;
        add(pos, k);
        pos = k;
      };
      if (c2 != kEnd && unicode::is_letter(c2)) { run(unicode::is_letter); continue; }
      if (c2 != kEnd && unicode::is_number(c2)) { run(unicode::is_number); continue; }
      if (c2 != kEnd && unicode::is_other(c2)) { run(unicode::is_other); continue; }
      size_t spaces = 0;
      while (pos + spaces < hi && unicode::is_whitespace(cps[pos + spaces].cp)) ++spaces;
      if (spaces > 1 && pos + spaces < hi) {  // \s+(?!\S): leave one space for the next word
        add(pos, pos + spaces - 1);
        pos += spaces - 1;
        continue;
      }
      if (spaces > 0) { add(pos, pos + spaces); pos += spaces; continue; }
      add(pos, pos + 1);  // unreachable with the classes above; keeps the loop total
      ++pos;
    }
  };
  for (size_t k = 0; k < cps.size(); ++k) {
    if (unicode::is_number(cps[k].cp)) {
      gpt2(start, k);
      pieces.emplace_back(cps[k].begin, cps[k].end);
      start = k + 1;
    }
  }
  gpt2(start, cps.size());
  return pieces;
}

class BpeTokenizer {
 public:
  static Result<BpeTokenizer> from_gguf(const GgufFile& file) {
    auto model = file.get_string("tokenizer.ggml.model");
    if (!model.ok()) return model.status();
    if (*model != "gpt2") {
      return unsupported(file.origin() + ": tokenizer model '" + *model +
                         "' is not supported (only byte-level BPE, 'gpt2')");
    }
    // The pre-tokenizer splits text before the merges, and models differ in it (Llama 3's
    // "llama-bpe" groups up to 3 digits where "smollm" splits every digit): only the one
    // implemented here is accepted, rather than tokenizing another model's text wrongly.
    // Files without the key predate it in llama.cpp and are read as "smollm".
    if (file.find("tokenizer.ggml.pre")) {
      auto pre = file.get_string("tokenizer.ggml.pre");
      if (!pre.ok()) return data_loss(file.origin() + ": tokenizer.ggml.pre is not a string");
      if (*pre != "smollm") {
        return unsupported(file.origin() + ": pre-tokenizer '" + *pre + "' is not supported (only 'smollm')");
      }
    }
    const GgufValue* tokens = file.find("tokenizer.ggml.tokens");
    const GgufValue* merges = file.find("tokenizer.ggml.merges");
    if (!tokens || tokens->array_type != GgufValueType::kString || tokens->strings.empty()) {
      return data_loss(file.origin() + ": tokenizer.ggml.tokens is missing or not a string array");
    }
    if (!merges || merges->array_type != GgufValueType::kString) {
      return data_loss(file.origin() + ": tokenizer.ggml.merges is missing or not a string array");
    }
    std::vector<int32_t> types;
    if (const GgufValue* t = file.find("tokenizer.ggml.token_type")) {
      for (int64_t v : t->ints) types.push_back(static_cast<int32_t>(v));
    }
    BpeTokenizer tok;
    tok.tokens_ = tokens->strings;
    tok.types_ = types;
    tok.types_.resize(tok.tokens_.size(), 1);
    for (size_t i = 0; i < tok.tokens_.size(); ++i) {
      tok.token_to_id_.emplace(tok.tokens_[i], static_cast<int32_t>(i));
      if ((tok.types_[i] == 3 || tok.types_[i] == 4) && !tok.tokens_[i].empty()) {
        tok.specials_.push_back(static_cast<int32_t>(i));
      }
    }
    // Longest first, so that a special token that is a prefix of another never wins.
    std::sort(tok.specials_.begin(), tok.specials_.end(), [&](int32_t a, int32_t b) {
      return tok.tokens_[a].size() > tok.tokens_[b].size();
    });
    for (size_t i = 0; i < merges->strings.size(); ++i) {
      const std::string& m = merges->strings[i];
      if (m.find(' ') == std::string::npos) {
        return data_loss(file.origin() + ": merge " + std::to_string(i) + " ('" + m + "') has no space");
      }
      tok.merge_rank_.emplace(m, static_cast<int32_t>(i));
    }
    auto id_or = [&](const char* key, int32_t fallback) {
      auto v = file.get_int(key);
      return v.ok() && *v >= 0 && *v < static_cast<int64_t>(tok.tokens_.size()) ? static_cast<int32_t>(*v) : fallback;
    };
    tok.bos_id_ = id_or("tokenizer.ggml.bos_token_id", -1);
    tok.eos_id_ = id_or("tokenizer.ggml.eos_token_id", -1);
    tok.unknown_id_ = id_or("tokenizer.ggml.unknown_token_id", 0);
    // GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others are moved
    // to 256 + n in byte order.
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      tok.byte_to_cp_[b] = cp;
      tok.cp_to_byte_.emplace(cp, static_cast<uint8_t>(b));
    }
    return Result<BpeTokenizer>(std::move(tok));
  }

  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  const std::string& token_text(int32_t id) const { return tokens_.at(static_cast<size_t>(id)); }
  // -1 when `text` is not one token of the vocabulary.
  int32_t find(const std::string& text) const {
    auto it = token_to_id_.find(text);
    return it == token_to_id_.end() ? -1 : it->second;
  }
  bool is_special(int32_t id) const { return types_[static_cast<size_t>(id)] == 3 || types_[static_cast<size_t>(id)] == 4; }

  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const {
    std::vector<int32_t> ids;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t next = text.size();
      int32_t special = -1;
      if (parse_special) {
        for (int32_t id : specials_) {
          const size_t at = text.find(tokens_[id], pos);
          if (at != std::string_view::npos && (at < next || (at == next && special < 0))) {
            next = at;
            special = id;
          }
        }
      }
      encode_plain(text.substr(pos, next - pos), ids);
      if (special < 0) break;
      ids.push_back(special);
      pos = next + tokens_[special].size();
    }
    return ids;
  }

  std::string decode(int32_t id) const {
    if (id < 0 || id >= vocab_size()) return {};
    const std::string& t = tokens_[id];
    if (is_special(id)) return t;
    std::string out;
    for (size_t i = 0; i < t.size();) {
      size_t length = 0;
      const uint32_t cp = utf8::next(t, i, length);
      auto it = cp_to_byte_.find(cp);
      if (it != cp_to_byte_.end()) {
        out += static_cast<char>(it->second);
      } else {
        out.append(t, i, length);  // not a byte-level token: keep its text
      }
      i += length;
    }
    return out;
  }
  std::string decode(const std::vector<int32_t>& ids) const {
    std::string out;
    for (int32_t id : ids) out += decode(id);
    return out;
  }

 private:
  // Applies the merges to a piece's symbols: repeatedly the adjacent pair of lowest merge rank,
  // the leftmost among equal ranks, until no pair has a rule. A heap of candidate pairs over a
  // linked list of symbols: O(n log n) in the piece's length (rescanning every pair per merge
  // was quadratic, ~35 s for one 30 KB run of letters). A heap entry is stale once either
  // symbol changed (its version) or left the list.
  std::vector<std::string> merge_symbols(std::vector<std::string> symbols) const {
    const size_t n = symbols.size();
    if (n < 2) return symbols;
    std::vector<size_t> next(n), prev(n);
    std::vector<uint32_t> version(n, 0);
    std::vector<bool> alive(n, true);
    for (size_t i = 0; i < n; ++i) {
      next[i] = i + 1;  // n: none
      prev[i] = i == 0 ? n : i - 1;
    }
    struct Candidate {
      int32_t rank;
      size_t left, right;
      uint32_t left_version, right_version;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::vector<Candidate> heap;
    const auto push = [&](size_t left) {
      const size_t right = next[left];
      if (right >= n) return;
      const auto it = merge_rank_.find(symbols[left] + " " + symbols[right]);
      if (it == merge_rank_.end()) return;
      heap.push_back({it->second, left, right, version[left], version[right]});
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    };
    for (size_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      const Candidate c = heap.back();
      heap.pop_back();
      if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right || version[c.left] != c.left_version ||
          version[c.right] != c.right_version) {
        continue;
      }
      symbols[c.left] += symbols[c.right];
      ++version[c.left];
      alive[c.right] = false;
      next[c.left] = next[c.right];
      if (next[c.left] < n) prev[next[c.left]] = c.left;
      if (prev[c.left] < n) push(prev[c.left]);
      push(c.left);
    }
    std::vector<std::string> merged;
    for (size_t i = 0; i < n; i = next[i]) merged.push_back(std::move(symbols[i]));
    return merged;
  }

  void encode_plain(std::string_view text, std::vector<int32_t>& ids) const {
    for (auto [begin, end] : pretokenize(text)) {
      const std::string_view piece = text.substr(begin, end - begin);
      auto cached = cache_.find(std::string(piece));
      if (cached != cache_.end()) {
        ids.insert(ids.end(), cached->second.begin(), cached->second.end());
        continue;
      }
      std::vector<std::string> symbols;
      for (unsigned char b : piece) {
        std::string s;
        utf8::append(s, byte_to_cp_[b]);
        symbols.push_back(std::move(s));
      }
      symbols = merge_symbols(std::move(symbols));
      std::vector<int32_t> piece_ids;
      for (const std::string& s : symbols) {
        const int32_t id = find(s);
        if (id >= 0) {
          piece_ids.push_back(id);
          continue;
        }
        // A merge result missing from the vocabulary (a broken file): fall back to bytes.
        for (size_t i = 0; i < s.size();) {
          size_t length = 0;
          utf8::next(s, i, length);
          const int32_t byte_id = find(s.substr(i, length));
          piece_ids.push_back(byte_id >= 0 ? byte_id : unknown_id_);
          i += length;
        }
      }
      if (cache_.size() < 200000) cache_.emplace(std::string(piece), piece_ids);
      ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
    }
  }

  std::vector<std::string> tokens_;
  std::vector<int32_t> types_;
  std::unordered_map<std::string, int32_t> token_to_id_;
  std::unordered_map<std::string, int32_t> merge_rank_;
  std::vector<int32_t> specials_;
  uint32_t byte_to_cp_[256] = {};
  std::unordered_map<uint32_t, uint8_t> cp_to_byte_;
  int32_t bos_id_ = -1, eos_id_ = -1, unknown_id_ = 0;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;  // piece -> ids
};

}  // namespace oscar::decode
