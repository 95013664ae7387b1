// StreamingDetokenizer: text as tokens arrive, never a broken UTF-8 sequence.
#include <gtest/gtest.h>

#include "formats/gguf.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"
#include "tokenizer_test_util.h"

namespace ds {
namespace {

using test::TinyVocab;

// Pushes each byte of `bytes` as its own token; returns what each push gave.
std::vector<std::string> push_bytes(StreamingDetokenizer& d, const TinyVocab& v,
                                    const std::string& bytes) {
  std::vector<std::string> out;
  for (char c : bytes) out.push_back(d.push(v.id(std::string(1, c))));
  return out;
}

TEST(StreamingDetokenizer, HoldsBackSplitCharacters) {
  TinyVocab v;
  auto tok = Tokenizer::create(v.spec);
  StreamingDetokenizer d(*tok);
  EXPECT_EQ(push_bytes(d, v, "a\xC3\xA9"), (std::vector<std::string>{"a", "", "\xC3\xA9"}));
  EXPECT_EQ(push_bytes(d, v, "\xF0\x9F\x98\x80"),
            (std::vector<std::string>{"", "", "", "\xF0\x9F\x98\x80"}));
  EXPECT_EQ(d.flush(), "");
}

TEST(StreamingDetokenizer, EmojiZwjSequenceAndSkinTone) {
  TinyVocab v;
  auto tok = Tokenizer::create(v.spec);
  StreamingDetokenizer d(*tok);
  const std::string text = "👨‍👩‍👧‍👦 👍🏽!";
  std::string joined;
  for (const auto& piece : push_bytes(d, v, text)) {
    EXPECT_TRUE(utf8_is_valid(piece));
    joined += piece;
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(d.flush(), "");
}

TEST(StreamingDetokenizer, IncompleteTailBecomesReplacementAtFlush) {
  TinyVocab v;
  auto tok = Tokenizer::create(v.spec);
  StreamingDetokenizer d(*tok);
  EXPECT_EQ(push_bytes(d, v, "ok\xE2\x82"), (std::vector<std::string>{"o", "k", "", ""}));
  EXPECT_EQ(d.flush(), "\xEF\xBF\xBD");  // one U+FFFD for the cut-off sequence
  EXPECT_EQ(d.flush(), "");
  EXPECT_EQ(d.push(v.id("x")), "x");  // the stream goes on after a flush
}

TEST(StreamingDetokenizer, InvalidBytesNeverPassThrough) {
  TinyVocab v;
  auto tok = Tokenizer::create(v.spec);
  StreamingDetokenizer d(*tok);
  // A lead byte followed by a non-continuation can never complete: it is replaced as soon as
  // that is known, so the stream does not stall; a lone 0xFF likewise.
  std::string out;
  for (const auto& piece : push_bytes(d, v,
                                      "\xE2"
                                      "a\xFF"
                                      "b\xC3")) {
    EXPECT_TRUE(utf8_is_valid(piece)) << piece;
    out += piece;
  }
  EXPECT_EQ(out,
            "\xEF\xBF\xBD"
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(d.flush(), "\xEF\xBF\xBD");
}

TEST(StreamingDetokenizer, SpecialTokens) {
  TinyVocab v;
  const int32_t end = v.add("<|im_end|>", TokenType::Control);
  auto tok = Tokenizer::create(v.spec);
  StreamingDetokenizer skip(*tok);
  EXPECT_EQ(skip.push(end), "");
  StreamingDetokenizer keep(*tok, /*skip_special=*/false);
  EXPECT_EQ(keep.push(end), "<|im_end|>");
}

// Every fixture text streamed token by token equals the plain decode, and no push emits a
// broken sequence.
void expect_streams_like_decode(const Tokenizer& tok, const std::vector<nlohmann::json>& rows) {
  size_t checked = 0;
  for (const auto& row : rows) {
    const std::string text = row.at("text").get<std::string>();
    const auto ids = tok.encode(text, false, true);
    StreamingDetokenizer d(tok, /*skip_special=*/false);
    std::string out;
    for (int32_t id : ids) {
      std::string piece = d.push(id);
      ASSERT_TRUE(utf8_is_valid(piece)) << text;
      out += piece;
    }
    out += d.flush();
    EXPECT_EQ(out, utf8_sanitize(tok.decode(ids))) << text;
    ++checked;
  }
  EXPECT_GT(checked, 300u);
}

TEST(StreamingDetokenizer, TinyTokenizerFixtureTexts) {
  auto tok = Tokenizer::from_hf_json(test::fixture_path("tiny_bpe/tokenizer.json"), "");
  expect_streams_like_decode(*tok, test::read_jsonl(test::fixture_path("tiny_bpe_hf.jsonl")));
}

TEST(StreamingDetokenizer, SmolLM2FixtureTexts) {
  const std::string path = test::env_or_empty("DS_SMOLLM2_GGUF");
  if (path.empty()) GTEST_SKIP() << "set DS_SMOLLM2_GGUF to the SmolLM2-135M-Instruct GGUF";
  auto tok = Tokenizer::from_gguf(GgufFile::open(path));
  expect_streams_like_decode(*tok, test::read_jsonl(test::fixture_path("smollm2_llamacpp.jsonl")));
}

}  // namespace
}  // namespace ds
