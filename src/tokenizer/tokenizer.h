// Byte-level BPE tokenizer loaded from GGUF metadata or a Hugging Face tokenizer.json.
// Encoding follows llama.cpp's (special-token partition, split regexes, ranked merges), so the
// same text gives the same ids.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tokenizer/pre_tokenizer.h"

namespace ds {

class GgufFile;

// GGUF's tokenizer.ggml.token_type values.
enum class TokenType : uint8_t {
  Undefined = 0,
  Normal = 1,
  Unknown = 2,
  Control = 3,
  UserDefined = 4,
  Unused = 5,
  Byte = 6,
};

// Everything a tokenizer is built from; the loaders fill it, tests build small ones by hand.
struct TokenizerSpec {
  std::vector<std::string> tokens;  // text as stored: byte-level for Normal tokens, raw otherwise
  std::vector<TokenType> types;     // empty: all Normal
  std::vector<std::pair<std::string, std::string>> merges;  // highest priority first
  PreTokenizer pre = PreTokenizer::Default;
  std::vector<std::string> split_patterns;  // empty: the patterns of `pre`
  bool ignore_merges = false;               // a word that is a whole token is taken as is (llama3)
  bool add_prefix_space = false;  // prepend ' ' to text not starting with one (HF ByteLevel)
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  std::vector<int32_t> extra_eog_ids;  // eot / eom ids named in the metadata
  bool add_bos = false;
  std::vector<int32_t> lstrip_ids;  // added tokens that swallow whitespace on their left
  std::vector<int32_t> rstrip_ids;  // ... and on their right
  std::string chat_template;
};

// Reads tokenizer.ggml.* (model gpt2 only); throws Error / UnsupportedError.
TokenizerSpec tokenizer_spec_from_gguf(const GgufFile& f);
// Reads tokenizer.json (model BPE) and, when it exists, tokenizer_config.json.
TokenizerSpec tokenizer_spec_from_hf_json(const std::filesystem::path& tokenizer_json,
                                          const std::filesystem::path& tokenizer_config_json);

class Tokenizer {
 public:
  static std::unique_ptr<Tokenizer> create(TokenizerSpec spec);
  static std::unique_ptr<Tokenizer> from_gguf(const GgufFile& f);
  static std::unique_ptr<Tokenizer> from_hf_json(
      const std::filesystem::path& tokenizer_json,
      const std::filesystem::path& tokenizer_config_json /*may not exist*/);
  ~Tokenizer();

  // parse_special: text of control tokens ("<|im_start|>") becomes those tokens; user-defined
  // tokens are matched either way. Invalid UTF-8 bytes are read as U+FFFD.
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const;
  // Model vocabularies are often padded past the tokenizer's: an id >= vocab_size() is a
  // valid output with no token, which decodes to nothing (empty text and bytes, type Unused).
  // Negative ids throw Error.
  // skip_special drops control and unknown tokens.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;
  std::string token_bytes(int32_t id) const;        // the raw bytes the token stands for
  const std::string& token_text(int32_t id) const;  // as stored in the vocab
  bool has_token(int32_t id) const { return id >= 0 && id < vocab_size(); }

  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return bos_id_; }  // -1 if none
  int32_t eos_id() const { return eos_id_; }  // -1 if none
  // End-of-generation tokens present in the vocab: eos, <|im_end|>, <|eot_id|>, ...
  const std::vector<int32_t>& eog_ids() const { return eog_ids_; }
  bool is_eog(int32_t id) const;
  bool add_bos_default() const { return add_bos_; }
  // Control, unknown and user-defined tokens: matched whole in text, never merged.
  bool is_special(int32_t id) const;
  TokenType token_type(int32_t id) const;
  std::optional<int32_t> find_token(std::string_view text) const;
  std::string chat_template() const { return chat_template_; }  // "" if none
  PreTokenizer pre_tokenizer() const { return pre_; }

 private:
  struct Impl;
  explicit Tokenizer(TokenizerSpec spec);
  void check_id(int32_t id) const;
  // Appends the ids of text with no special tokens in it.
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  std::vector<std::string> bytes_;  // token_bytes() of each id
  std::unordered_map<std::string, int32_t> text_to_id_;
  PreTokenizer pre_;
  bool ignore_merges_;
  bool add_prefix_space_;
  int32_t bos_id_;
  int32_t eos_id_;
  bool add_bos_;
  std::vector<int32_t> eog_ids_;
  std::string chat_template_;
  std::unique_ptr<Impl> impl_;  // merge table, splitter, special-token matcher, word cache
};

// Turns a stream of ids into text as they arrive without ever emitting a broken UTF-8
// sequence: incomplete trailing bytes are held back until the rest arrives.
class StreamingDetokenizer {
 public:
  explicit StreamingDetokenizer(const Tokenizer& tok, bool skip_special = true);
  // The text that became complete with this token (may be empty).
  std::string push(int32_t id);
  // Whatever is held back, with ill-formed bytes replaced by U+FFFD; resets the stream.
  std::string flush();

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::string pending_;  // bytes not yet emitted
};

}  // namespace ds
