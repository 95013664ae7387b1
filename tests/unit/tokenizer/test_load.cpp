// Loading tokenizers from small GGUF files built in memory and hand-written tokenizer.json files.
#include <gtest/gtest.h>

#include "../formats/format_writers.h"
#include "core/error.h"
#include "formats/gguf.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer_test_util.h"

namespace ds {
namespace {

using Ids = std::vector<int32_t>;

// Byte characters (ids 0..255), "Ġw", "Ġwo", <|im_end|>.
test::GgufBuilder tiny_gguf(const std::string& model, const std::string& pre) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(gpt2_bytes_to_text(std::string(1, char(b))));
  tokens.push_back("Ġw");
  tokens.push_back("Ġwo");
  tokens.push_back("<|im_end|>");
  std::vector<int32_t> types(tokens.size(), 1);
  types.back() = 3;
  test::GgufBuilder g;
  g.kv_str("general.architecture", "llama")
      .kv_str("tokenizer.ggml.model", model)
      .kv_str("tokenizer.ggml.pre", pre)
      .kv_str_array("tokenizer.ggml.tokens", tokens)
      .kv_array<int32_t>("tokenizer.ggml.token_type", GgufType::I32, types)
      .kv_str_array("tokenizer.ggml.merges", {"Ġ w", "Ġw o"})
      .kv<uint32_t>("tokenizer.ggml.eos_token_id", GgufType::U32, 258)
      .kv<uint8_t>("tokenizer.ggml.add_bos_token", GgufType::Bool, 0)
      .kv_str("tokenizer.chat_template", "{{ '<|im_start|>' }}");
  return g;
}

TEST(LoadGguf, TinyVocab) {
  const auto bytes = tiny_gguf("gpt2", "gpt-2").build();
  const auto f = GgufFile::parse(bytes, "tiny.gguf");
  auto tok = Tokenizer::from_gguf(f);
  EXPECT_EQ(tok->vocab_size(), 259);
  EXPECT_EQ(tok->pre_tokenizer(), PreTokenizer::Gpt2);
  EXPECT_EQ(tok->eos_id(), 258);
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_EQ(tok->eog_ids(), Ids{258});
  EXPECT_EQ(tok->chat_template(), "{{ '<|im_start|>' }}");
  EXPECT_EQ(tok->encode("a wo<|im_end|>", false, true), (Ids{'a', 257, 258}));
}

TEST(LoadGguf, Errors) {
  const auto spm = tiny_gguf("llama", "default").build();
  EXPECT_THROW(Tokenizer::from_gguf(GgufFile::parse(spm, "spm.gguf")), UnsupportedError);
  const auto pre = tiny_gguf("gpt2", "no-such-pre").build();
  EXPECT_THROW(Tokenizer::from_gguf(GgufFile::parse(pre, "pre.gguf")), UnsupportedError);
  test::GgufBuilder empty;
  empty.kv_str("tokenizer.ggml.model", "gpt2");
  const auto eb = empty.build();
  EXPECT_THROW(Tokenizer::from_gguf(GgufFile::parse(eb, "empty.gguf")), Error);
}

class HfJsonTest : public ::testing::Test {
 protected:
  std::filesystem::path write(const std::string& name, const std::string& text) {
    auto p = dir_.path() / name;
    std::ofstream(p) << text;
    return p;
  }
  test::TempDir dir_;
};

// Vocab: bytes a, b, c, space (Ġ) and digits, merges given as pairs.
std::string hf_json(const std::string& pre_tokenizer, const std::string& model_type = "BPE") {
  return R"({"model": {"type": ")" + model_type + R"(",
      "vocab": {"a": 0, "b": 1, "c": 2, "Ġ": 3, "1": 4, "2": 5, "ab": 6, "Ġab": 7, "12": 8},
      "merges": [["a", "b"], "Ġ ab", ["1", "2"]]},
    "added_tokens": [
      {"id": 9, "content": "<eos>", "special": true, "lstrip": false, "rstrip": true},
      {"id": 10, "content": "[x]", "special": false}],
    "normalizer": null,
    "pre_tokenizer": )" +
         pre_tokenizer + R"(,
    "post_processor": null, "decoder": {"type": "ByteLevel"}})";
}

TEST_F(HfJsonTest, MergesAsStringsAndPairsAddedTokensDigits) {
  auto path = write("tokenizer.json", hf_json(R"({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": false},
        {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}]})"));
  auto cfg = write("tokenizer_config.json",
                   R"({"eos_token": {"content": "<eos>"}, "add_bos_token": false,
                       "chat_template": [{"name": "default", "template": "T"}]})");
  auto tok = Tokenizer::from_hf_json(path, cfg);
  EXPECT_EQ(tok->vocab_size(), 11);
  EXPECT_EQ(tok->eos_id(), 9);
  EXPECT_EQ(tok->chat_template(), "T");
  EXPECT_FALSE(tok->add_bos_default());
  EXPECT_EQ(tok->token_type(10), TokenType::UserDefined);
  // "<eos>" swallows the spaces after it (rstrip); "[x]" is matched without parse_special.
  EXPECT_EQ(tok->encode("ab ab<eos>  12[x]", false, true), (Ids{6, 7, 9, 8, 10}));
  EXPECT_EQ(tok->encode("ab[x]", false, false), (Ids{6, 10}));
}

TEST_F(HfJsonTest, SplitStringPatternAndPrefixSpace) {
  auto path = write("tokenizer.json", hf_json(R"({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": "c"}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": true, "use_regex": false}]})"));
  auto tok = Tokenizer::from_hf_json(path, "");
  EXPECT_EQ(tok->pre_tokenizer(), PreTokenizer::Custom);
  // The prefix space makes " ab" (7); "c" is split off by the literal pattern.
  EXPECT_EQ(tok->encode("abcab", false, true), (Ids{7, 2, 6}));
}

TEST_F(HfJsonTest, UnsupportedPieces) {
  auto wp = write("wp.json", hf_json("null", "WordPiece"));
  EXPECT_THROW(Tokenizer::from_hf_json(wp, ""), UnsupportedError);
  auto meta = write("meta.json", hf_json(R"({"type": "Metaspace"})"));
  EXPECT_THROW(Tokenizer::from_hf_json(meta, ""), UnsupportedError);
  auto merged = write("merged.json", hf_json(R"({"type": "Split", "pattern": {"Regex": "a"},
      "behavior": "MergedWithPrevious", "invert": false})"));
  EXPECT_THROW(Tokenizer::from_hf_json(merged, ""), UnsupportedError);
  auto broken = write("broken.json", "{\"model\": ");
  EXPECT_THROW(Tokenizer::from_hf_json(broken, ""), Error);
}

}  // namespace
}  // namespace ds
