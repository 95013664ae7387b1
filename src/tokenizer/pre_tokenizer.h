// Pre-tokenization: splitting text into words with the regexes of a BPE tokenizer (PCRE2).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ds {

// The pre-tokenizer families named by GGUF's `tokenizer.ggml.pre` (llama.cpp's names).
// Custom: split patterns taken from a tokenizer.json that match none of the known families.
enum class PreTokenizer {
  Gpt2,
  Llama3,
  DeepSeekLlm,
  DeepSeekCoder,
  SmolLM,
  Qwen2,
  Default,
  Custom
};

// Maps a `tokenizer.ggml.pre` value ("llama-bpe", "smollm", ...) to its family.
std::optional<PreTokenizer> pre_tokenizer_from_name(std::string_view name);
std::string_view pre_tokenizer_name(PreTokenizer pre);
// The split regexes llama.cpp applies for the family, in order (empty for Custom).
std::vector<std::string> pre_tokenizer_patterns(PreTokenizer pre);
// The family whose patterns equal `patterns` (accepting the (?i:...) spellings of
// tokenizer.json), or Custom.
PreTokenizer pre_tokenizer_from_patterns(const std::vector<std::string>& patterns);

// A byte range [begin, end) of the text being split.
using TextSpan = std::pair<size_t, size_t>;

// Applies split patterns in order: each pattern cuts every piece left by the previous one into
// its matches and the gaps between them (tokenizers' "Isolated" behaviour), each piece matched
// as a string of its own. \p{L}, \p{N}, \p{P}, \p{M}, \p{S} and \s follow Unicode 15.1 (the
// tables llama.cpp uses) when the pattern is otherwise ASCII; other patterns run in PCRE2's UTF
// mode with its own Unicode tables.
class RegexSplitter {
 public:
  explicit RegexSplitter(
      const std::vector<std::string>& patterns);  // throws Error on a bad pattern
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // `text` must be valid UTF-8.
  std::vector<TextSpan> split(std::string_view text) const;
  size_t num_patterns() const { return patterns_.size(); }

  struct Pattern;

 private:
  std::vector<std::unique_ptr<Pattern>> patterns_;
  bool any_collapsed_ = false;
  bool any_utf_ = false;
};

}  // namespace ds
