// Tokenizers: the hand-written pre-tokenizer against splits derived by hand from the regex,
// and byte-level BPE on a synthetic vocabulary (merge order, special tokens, byte round
// trips). The llama2.c tokenizer of the TinyStories model is checked in test_tinystories.cpp.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "model/gguf_writer.hpp"
#include "tokenizer.hpp"

using oscar::decode::BpeTokenizer;
using oscar::decode::GgufFile;
using oscar::testing::GgufWriter;

namespace {

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  for (auto [b, e] : oscar::decode::pretokenize(text)) out.push_back(text.substr(b, e - b));
  return out;
}

using Pieces = std::vector<std::string>;

// GPT-2's bytes_to_unicode, from its definition: bytes '!'..'~', '¡'..'¬', '®'..'ÿ' map to
// the code point of the same value; the other 68 bytes, in order, to 256, 257, ...
std::vector<std::string> byte_tokens() {
  std::vector<std::string> t(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool same = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    oscar::decode::utf8::append(t[static_cast<size_t>(b)], static_cast<uint32_t>(same ? b : next++));
  }
  return t;
}

BpeTokenizer synthetic_tokenizer() {
  std::vector<std::string> tokens = byte_tokens();
  std::vector<int32_t> types(tokens.size(), 1);
  for (const char* t : {"lo", "ll", "he", "hel", "Ġw", "Ġwo"}) {
    tokens.push_back(t);
    types.push_back(1);
  }
  tokens.push_back("<|im_start|>");
  types.push_back(3);
  tokens.push_back("<|im_start|>x");  // a longer special sharing the prefix: longest wins
  types.push_back(3);
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", {"l o", "l l", "h e", "he l", "Ġ w", "Ġw o"});
  auto f = GgufFile::parse(w.build(), "tok.gguf");
  REQUIRE_MESSAGE(f.ok(), f.status().to_string());
  auto tok = BpeTokenizer::from_gguf(*f);
  REQUIRE_MESSAGE(tok.ok(), tok.status().to_string());
  return std::move(tok).value();
}

}  // namespace

TEST_CASE("pre-tokenizer: splits derived by hand from the smollm regexes") {
  CHECK(split("Hello world") == Pieces{"Hello", " world"});
  CHECK(split("it's 2024!") == Pieces{"it", "'s", " ", "2", "0", "2", "4", "!"});
  CHECK(split("I'm sure they'll go, don't") == Pieces{"I", "'m", " sure", " they", "'ll", " go", ",", " don", "'t"});
  CHECK(split("a  b") == Pieces{"a", " ", " b"});
  CHECK(split("x\n\ny") == Pieces{"x", "\n", "\n", "y"});
  CHECK(split("hello   ") == Pieces{"hello", "   "});
  CHECK(split("hi !! ok...") == Pieces{"hi", " !!", " ok", "..."});
  CHECK(split("caf\xC3\xA9 \xC3\xBC" "ber") == Pieces{"caf\xC3\xA9", " \xC3\xBC" "ber"});
  CHECK(split("\xE2\x82\xAC" "5") == Pieces{"\xE2\x82\xAC", "5"});  // euro sign, then a digit
  CHECK(split("x12y") == Pieces{"x", "1", "2", "y"});
  CHECK(split("") == Pieces{});
  // Every byte lands in exactly one piece, in order, even for invalid UTF-8.
  const std::string messy = "a\xFF\xC3 b\t\t\xE2\x82 9'x";
  std::string joined;
  for (const auto& p : split(messy)) joined += p;
  CHECK(joined == messy);
}

TEST_CASE("byte-level BPE: merges apply lowest rank first") {
  const BpeTokenizer tok = synthetic_tokenizer();
  // h e l l o: "l o" (rank 0) first, then "h e", then "he l": [hel, lo]; "l l" never forms.
  CHECK(tok.encode("hello") == std::vector<int32_t>{tok.find("hel"), tok.find("lo")});
  CHECK(tok.encode(" wo") == std::vector<int32_t>{tok.find("Ġwo")});
  CHECK(tok.encode("ll") == std::vector<int32_t>{tok.find("ll")});
  // Pieces never merge across the pre-tokenizer's boundaries: "l" "'s"... "lo" inside one.
  CHECK(tok.encode("l'o").size() == 3);
}

TEST_CASE("byte-level BPE: special tokens, longest first, only when asked") {
  const BpeTokenizer tok = synthetic_tokenizer();
  const int32_t start = tok.find("<|im_start|>");
  const int32_t start_x = tok.find("<|im_start|>x");
  const std::vector<int32_t> ids = tok.encode("he<|im_start|>he<|im_start|>xhe");
  CHECK(ids == std::vector<int32_t>{tok.find("he"), start, tok.find("he"), start_x, tok.find("he")});
  const std::vector<int32_t> plain = tok.encode("<|im_start|>", /*parse_special=*/false);
  CHECK(plain.size() > 1);
  CHECK(tok.decode(plain) == "<|im_start|>");
  CHECK(tok.decode(ids) == "he<|im_start|>he<|im_start|>xhe");
}

TEST_CASE("byte-level BPE: any byte string round-trips") {
  const BpeTokenizer tok = synthetic_tokenizer();
  std::mt19937 rng(11);
  const std::vector<std::string> alphabet = {"a", "l", "o", "h", "e", " ", "  ", "\n", "'", "s", "1", "9", ".", "!",
                                             "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80", "\xFF", "\x80", "\t"};
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    const int n = static_cast<int>(rng() % 24);
    for (int i = 0; i < n; ++i) s += alphabet[rng() % alphabet.size()];
    CHECK_MESSAGE(tok.decode(tok.encode(s, false)) == s, "'" << s << "'");
  }
}

TEST_CASE("a GGUF without a usable tokenizer is refused with the reason") {
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "llama");
  auto f = GgufFile::parse(w.build(), "spm.gguf");
  REQUIRE(f.ok());
  CHECK(BpeTokenizer::from_gguf(*f).status().message().find("'llama' is not supported") != std::string::npos);
  GgufWriter w2;
  w2.add_string("tokenizer.ggml.model", "gpt2");
  auto f2 = GgufFile::parse(w2.build(), "empty.gguf");
  REQUIRE(f2.ok());
  CHECK(BpeTokenizer::from_gguf(*f2).status().message().find("tokenizer.ggml.tokens is missing") != std::string::npos);
}

TEST_CASE("BPE merges: lowest rank first, leftmost among equal ranks, on long pieces, as a rescan of every pair") {
  // Chained and overlapping merges over three letters; a piece of letters is one
  // pre-token, so its merges are the whole encoding. The tokenizer's heap of candidate pairs
  // must pick exactly what rescanning every pair after every merge picks.
  const std::vector<std::string> merges{"a a", "b b", "a b", "aa a", "ab c", "c a", "aa aa", "bb a", "ca b", "aaa aa"};
  std::vector<std::string> tokens = byte_tokens();
  std::vector<int32_t> types(tokens.size(), 1);
  for (const std::string& m : merges) {
    tokens.push_back(m.substr(0, m.find(' ')) + m.substr(m.find(' ') + 1));
    types.push_back(1);
  }
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", merges);
  auto f = GgufFile::parse(w.build(), "merges.gguf");
  REQUIRE(f.ok());
  auto tok = BpeTokenizer::from_gguf(*f);
  REQUIRE(tok.ok());
  const auto rescan = [&](const std::string& text) {
    std::vector<std::string> symbols;
    for (char ch : text) symbols.emplace_back(1, ch);
    for (;;) {
      size_t best = symbols.size(), best_rank = merges.size();
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        const auto it = std::find(merges.begin(), merges.end(), symbols[i] + " " + symbols[i + 1]);
        const size_t rank = static_cast<size_t>(it - merges.begin());
        if (rank < best_rank) best_rank = rank, best = i;
      }
      if (best == symbols.size()) break;
      symbols[best] += symbols[best + 1];
      symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    }
    std::vector<int32_t> ids;
    for (const std::string& s : symbols) ids.push_back(tok->find(s));
    return ids;
  };
  std::mt19937 rng(17);
  for (int length : {1, 2, 3, 7, 64, 257, 2000}) {
    for (int trial = 0; trial < (length < 100 ? 20 : 3); ++trial) {
      std::string text;
      for (int i = 0; i < length; ++i) text.push_back("aabc"[rng() % 4]);
      CAPTURE(text);
      CHECK(tok->encode(text) == rescan(text));
    }
  }
  CHECK(tok->encode(std::string(3000, 'a')) == rescan(std::string(3000, 'a')));
}

TEST_CASE("a pre-tokenizer other than smollm is refused, not applied wrongly") {
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "llama-bpe");
  w.add_string_array("tokenizer.ggml.tokens", byte_tokens());
  w.add_string_array("tokenizer.ggml.merges", {});
  auto f = GgufFile::parse(w.build(), "llama3.gguf");
  REQUIRE(f.ok());
  CHECK(BpeTokenizer::from_gguf(*f).status().message().find("pre-tokenizer 'llama-bpe' is not supported") !=
        std::string::npos);
}
