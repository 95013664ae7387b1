// Helpers shared by the tokenizer tests: fixture reading and small in-memory vocabularies.
#pragma once

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace ds::test {

inline std::string fixture_path(const std::string& name) {
  return std::string(DS_FIXTURES_DIR) + "/tokenizer/" + name;
}

// Reads a .jsonl fixture; rows with a "reference" key are headers and go to *header.
inline std::vector<nlohmann::json> read_jsonl(const std::string& path,
                                              nlohmann::json* header = nullptr) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::vector<nlohmann::json> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    if (j.contains("reference")) {
      if (header) *header = j;
      continue;
    }
    rows.push_back(std::move(j));
  }
  return rows;
}

inline std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// A byte-level vocab: the 256 byte characters (ids 0..255) plus the given merges' results, in
// order, plus extra tokens appended with their types.
struct TinyVocab {
  TokenizerSpec spec;
  explicit TinyVocab(const std::vector<std::pair<std::string, std::string>>& merges = {},
                     PreTokenizer pre = PreTokenizer::Gpt2) {
    for (int b = 0; b < 256; ++b) {
      std::string s;
      utf8_append(s, gpt2_byte_to_codepoint()[b]);
      spec.tokens.push_back(s);
    }
    for (const auto& [a, b] : merges) {
      spec.merges.emplace_back(gpt2_bytes_to_text(a), gpt2_bytes_to_text(b));
      spec.tokens.push_back(gpt2_bytes_to_text(a + b));
    }
    spec.types.assign(spec.tokens.size(), TokenType::Normal);
    spec.pre = pre;
  }
  int32_t add(const std::string& text, TokenType type) {
    spec.tokens.push_back(type == TokenType::Normal ? gpt2_bytes_to_text(text) : text);
    spec.types.push_back(type);
    return static_cast<int32_t>(spec.tokens.size()) - 1;
  }
  // Id of a token by its raw bytes.
  int32_t id(const std::string& raw) const {
    std::string t = gpt2_bytes_to_text(raw);
    for (size_t i = spec.tokens.size(); i-- > 0;)
      if (spec.tokens[i] == t) return static_cast<int32_t>(i);
    return -1;
  }
};

}  // namespace ds::test
