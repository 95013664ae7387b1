// BPE core and pre-tokenizers on small in-memory vocabularies.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/error.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer_test_util.h"

namespace ds {
namespace {

using test::TinyVocab;
using Ids = std::vector<int32_t>;
using Merges = std::vector<std::pair<std::string, std::string>>;

std::vector<std::string> pieces(PreTokenizer pre, std::string_view text) {
  RegexSplitter splitter(pre_tokenizer_patterns(pre));
  std::vector<std::string> out;
  for (auto [b, e] : splitter.split(text)) out.emplace_back(text.substr(b, e - b));
  return out;
}

using Pieces = std::vector<std::string>;

TEST(PreTokenizer, Gpt2) {
  EXPECT_EQ(pieces(PreTokenizer::Gpt2, "Hello world's  test\n\n  x"),
            (Pieces{"Hello", " world", "'s", " ", " test", "\n\n ", " x"}));
  EXPECT_EQ(pieces(PreTokenizer::Gpt2, "a\tb  "), (Pieces{"a", "\t", "b", "  "}));
  EXPECT_EQ(pieces(PreTokenizer::Gpt2, "I'M 42!?"), (Pieces{"I", "'", "M", " 42", "!?"}));
}

TEST(PreTokenizer, SmolLmSplitsDigits) {
  EXPECT_EQ(pieces(PreTokenizer::SmolLM, "abc 12345 x"),
            (Pieces{"abc", " ", "1", "2", "3", "4", "5", " x"}));
  // Non-ASCII digits are numbers too (Arabic-Indic).
  EXPECT_EQ(pieces(PreTokenizer::SmolLM, "\u0663\u0664"), (Pieces{"\u0663", "\u0664"}));
}

TEST(PreTokenizer, Llama3) {
  EXPECT_EQ(pieces(PreTokenizer::Llama3, "Hello 12345 world!!\n\n"),
            (Pieces{"Hello", " ", "123", "45", " world", "!!\n\n"}));
  EXPECT_EQ(pieces(PreTokenizer::Llama3, "YOU'RE ok"), (Pieces{"YOU", "'RE", " ok"}));
}

TEST(PreTokenizer, Qwen2SplitsDigits) {
  EXPECT_EQ(pieces(PreTokenizer::Qwen2, "x 123"), (Pieces{"x", " ", "1", "2", "3"}));
}

TEST(PreTokenizer, DeepSeekCoder) {
  EXPECT_EQ(pieces(PreTokenizer::DeepSeekCoder, "int x=10;\n"),
            (Pieces{"int", " x", "=", "1", "0", ";", "\n"}));
}

TEST(PreTokenizer, DeepSeekLlm) {
  EXPECT_EQ(pieces(PreTokenizer::DeepSeekLlm, "Hello 世界 123"),
            (Pieces{"Hello", " ", "世界", " ", "123"}));
}

TEST(PreTokenizer, NonAsciiWhitespaceAndNewUnicode) {
  // U+3000 is whitespace (but only ' ' joins a following word); U+31350 (CJK ext. H, Unicode
  // 15.0) is a letter.
  EXPECT_EQ(pieces(PreTokenizer::Gpt2, "a\u3000\u3000b"), (Pieces{"a", "\u3000", "\u3000", "b"}));
  EXPECT_EQ(pieces(PreTokenizer::Gpt2, "x \U00031350\U00031351"),
            (Pieces{"x", " \U00031350\U00031351"}));
}

TEST(PreTokenizer, NamesAndPatterns) {
  EXPECT_EQ(pre_tokenizer_from_name("smollm"), PreTokenizer::SmolLM);
  EXPECT_EQ(pre_tokenizer_from_name("llama-bpe"), PreTokenizer::Llama3);
  EXPECT_EQ(pre_tokenizer_from_name("gpt-2"), PreTokenizer::Gpt2);
  EXPECT_FALSE(pre_tokenizer_from_name("no-such-thing").has_value());
  EXPECT_EQ(pre_tokenizer_from_patterns(pre_tokenizer_patterns(PreTokenizer::SmolLM)),
            PreTokenizer::SmolLM);
  EXPECT_EQ(pre_tokenizer_from_patterns({"[a-z]+"}), PreTokenizer::Custom);
  EXPECT_THROW(RegexSplitter({"(unclosed"}), Error);
}

TEST(PreTokenizer, UtfModePatternAndEmptyMatches) {
  // A pattern with a non-ASCII literal runs in PCRE2's UTF mode.
  RegexSplitter s({"é+"});
  std::string text = "caféé!";
  auto spans = s.split(text);
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(text.substr(spans[1].first, spans[1].second - spans[1].first), "éé");
  // An empty match cuts the text without consuming it.
  RegexSplitter digits({"(?=(\\d{3})+(?!\\d))"});
  std::string n = "1234567";
  std::vector<std::string> got;
  for (auto [b, e] : digits.split(n)) got.push_back(n.substr(b, e - b));
  EXPECT_EQ(got, (Pieces{"1", "234", "567"}));
}

TEST(Bpe, MergesByRank) {
  TinyVocab v(Merges{{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"b", "c"}, {"a", "b"}});
  auto tok = Tokenizer::create(v.spec);
  EXPECT_EQ(tok->encode("hello", false, false), Ids{v.id("hello")});
  // "bc" outranks "ab", so "abc" is a + bc rather than ab + c.
  EXPECT_EQ(tok->encode("abc", false, false), (Ids{v.id("a"), v.id("bc")}));
}

TEST(Bpe, EqualRanksMergeLeftmostFirst) {
  TinyVocab v(Merges{{"a", "a"}});
  auto tok = Tokenizer::create(v.spec);
  EXPECT_EQ(tok->encode("aaa", false, false), (Ids{v.id("aa"), v.id("a")}));
  EXPECT_EQ(tok->encode("aaaa", false, false), (Ids{v.id("aa"), v.id("aa")}));
}

TEST(Bpe, MergeResultMissingFromVocabFallsBackToCharacters) {
  TinyVocab v;
  v.spec.merges.emplace_back("x", "y");  // "xy" is no token
  auto tok = Tokenizer::create(v.spec);
  EXPECT_EQ(tok->encode("xy", false, false), (Ids{v.id("x"), v.id("y")}));
}

TEST(Bpe, BytesMissingFromVocabAreDropped) {
  TinyVocab v;
  const int32_t a9 = v.id("\xA9");
  v.spec.tokens[a9] = "<unused>";
  v.spec.types[a9] = TokenType::Unused;
  auto tok = Tokenizer::create(v.spec);
  EXPECT_EQ(tok->encode("é", false, false), Ids{v.id("\xC3")});  // é = C3 A9
}

TEST(Bpe, IgnoreMergesTakesWholeWords) {
  TinyVocab v;
  const int32_t abc = v.add("abc", TokenType::Normal);
  v.spec.ignore_merges = true;
  EXPECT_EQ(Tokenizer::create(v.spec)->encode("abc", false, false), Ids{abc});
  v.spec.ignore_merges = false;
  EXPECT_EQ(Tokenizer::create(v.spec)->encode("abc", false, false),
            (Ids{v.id("a"), v.id("b"), v.id("c")}));
}

TEST(Bpe, SpecialTokens) {
  TinyVocab v(Merges{{"a", "b"}});
  const int32_t start = v.add("<|im_start|>", TokenType::Control);
  const int32_t prefix = v.add("<|im", TokenType::Control);
  const int32_t user = v.add("[[x]]", TokenType::UserDefined);
  v.spec.bos_id = v.add("<s>", TokenType::Control);
  auto tok = Tokenizer::create(v.spec);
  EXPECT_EQ(tok->encode("ab<|im_start|>ab", false, true), (Ids{v.id("ab"), start, v.id("ab")}));
  // The longer token wins; the shorter one still matches elsewhere.
  EXPECT_EQ(tok->encode("<|im_start|><|im", false, true), (Ids{start, prefix}));
  // Without parse_special control-token text is plain text; user-defined tokens still match.
  Ids plain = tok->encode("<|im_start|>[[x]]", false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), start), 0);
  EXPECT_EQ(plain.back(), user);
  EXPECT_EQ(tok->decode(plain), "<|im_start|>[[x]]");
  EXPECT_EQ(tok->encode("ab", true, false), (Ids{v.spec.bos_id, v.id("ab")}));
  EXPECT_TRUE(tok->is_special(start));
  EXPECT_FALSE(tok->is_special(v.id("ab")));
  EXPECT_EQ(tok->decode(Ids{start, v.id("ab")}, /*skip_special=*/true), "ab");
  EXPECT_EQ(tok->decode(Ids{start, user}, false), "<|im_start|>[[x]]");
  EXPECT_EQ(tok->find_token("<|im_start|>"), start);
  EXPECT_FALSE(tok->find_token("nope").has_value());
}

TEST(Bpe, LstripRstripSwallowSpaces) {
  TinyVocab v;
  const int32_t mask = v.add("<mask>", TokenType::Control);
  v.spec.lstrip_ids = {mask};
  v.spec.rstrip_ids = {mask};
  auto tok = Tokenizer::create(v.spec);
  EXPECT_EQ(tok->encode("a  <mask>  b", false, true), (Ids{v.id("a"), mask, v.id("b")}));
}

TEST(Bpe, EogAndTokenBytes) {
  TinyVocab v;
  const int32_t im_end = v.add("<|im_end|>", TokenType::UserDefined);  // forced to control
  const int32_t byte = v.add("<0x41>", TokenType::Byte);
  v.spec.eos_id = v.add("</s>", TokenType::Control);
  auto tok = Tokenizer::create(v.spec);
  EXPECT_EQ(tok->eog_ids(), (Ids{im_end, v.spec.eos_id}));
  EXPECT_TRUE(tok->is_eog(im_end));
  EXPECT_EQ(tok->token_type(im_end), TokenType::Control);
  EXPECT_EQ(tok->token_bytes(byte), "A");
  EXPECT_EQ(tok->token_bytes(v.id(" ")), " ");
  EXPECT_EQ(tok->token_text(v.id(" ")), "Ġ");
  EXPECT_THROW(tok->decode(Ids{-1}), Error);
  EXPECT_THROW(tok->token_bytes(-1), Error);
}

// A padded model vocabulary samples ids the tokenizer lacks: they stand for no text.
TEST(Bpe, IdsPastTheVocabularyHaveNoText) {
  TinyVocab v;
  auto tok = Tokenizer::create(v.spec);
  const int32_t past = tok->vocab_size(), far = tok->vocab_size() + 1000;
  EXPECT_FALSE(tok->has_token(past));
  EXPECT_TRUE(tok->has_token(past - 1));
  EXPECT_EQ(tok->token_text(past), "");
  EXPECT_EQ(tok->token_bytes(far), "");
  EXPECT_EQ(tok->token_type(past), TokenType::Unused);
  EXPECT_FALSE(tok->is_special(past));
  EXPECT_FALSE(tok->is_eog(past));
  const Ids hi = tok->encode("hi", false, false);
  Ids mixed = {past};
  mixed.insert(mixed.end(), hi.begin(), hi.end());
  mixed.push_back(far);
  EXPECT_EQ(tok->decode(mixed), "hi");
  EXPECT_EQ(tok->decode(mixed, /*skip_special=*/true), "hi");
}

// An id with no token between the bytes of one UTF-8 character leaves the character whole.
TEST(Bpe, StreamingKeepsUtf8AcrossIdsWithoutText) {
  TinyVocab v;
  auto tok = Tokenizer::create(v.spec);
  const Ids e_acute = tok->encode("\xC3\xA9", false, false);  // two byte tokens
  ASSERT_EQ(e_acute.size(), 2u);
  StreamingDetokenizer d(*tok);
  EXPECT_EQ(d.push(e_acute[0]), "");
  EXPECT_EQ(d.push(tok->vocab_size() + 7), "");
  EXPECT_EQ(d.push(e_acute[1]), "\xC3\xA9");
  EXPECT_EQ(d.flush(), "");
  EXPECT_THROW(d.push(-3), Error);
}

TEST(Bpe, InvalidUtf8IsReadAsReplacementChar) {
  TinyVocab v;
  auto tok = Tokenizer::create(v.spec);
  EXPECT_EQ(tok->decode(tok->encode("a\xFF"
                                    "b",
                                    false, false)),
            "a\xEF\xBF\xBD"
            "b");
}

TEST(Bpe, LongWordIsFast) {
  // 16 doubling merges; one 200 KB word must not take quadratic time.
  std::vector<std::pair<std::string, std::string>> merges;
  std::string w = "a";
  for (int i = 0; i < 16; ++i, w += w) merges.emplace_back(w, w);
  TinyVocab v(merges);
  auto tok = Tokenizer::create(v.spec);
  const std::string text(200000, 'a');
  auto t0 = std::chrono::steady_clock::now();
  Ids ids = tok->encode(text, false, false);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 2.0);
  EXPECT_EQ(tok->decode(ids), text);
  EXPECT_EQ(ids.front(), v.id(std::string(65536, 'a')));
}

TEST(Bpe, CacheGivesSameAnswers) {
  TinyVocab v(Merges{{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}});
  auto tok = Tokenizer::create(v.spec);
  Ids first = tok->encode("hello hello hello", false, false);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(tok->encode("hello hello hello", false, false), first);
}

TEST(Bpe, ConcurrentEncodesAgree) {
  TinyVocab v(Merges{{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {" ", "w"}});
  auto tok = Tokenizer::create(v.spec);
  std::string text;
  for (int i = 0; i < 2000; ++i) text += "hello world " + std::to_string(i) + " ";
  const Ids want = tok->encode(text, false, false);
  auto cold = Tokenizer::create(v.spec);  // threads race on an empty word cache
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto fresh = cold->encode(text, false, false);
      ok[t] = fresh == want;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok, (std::vector<int>{1, 1, 1, 1}));
}

TEST(Bpe, WordCacheEvictionKeepsAnswers) {
  TinyVocab v(Merges{{"1", "2"}, {" ", "1"}});
  auto tok = Tokenizer::create(v.spec);
  std::string text;
  for (int i = 0; i < 80000; ++i) text += " " + std::to_string(i);  // > 2 cache generations
  const Ids first = tok->encode(text, false, false);
  EXPECT_EQ(tok->encode(text, false, false), first);
  EXPECT_EQ(tok->decode(first), text);
  auto fresh = Tokenizer::create(v.spec);
  EXPECT_EQ(fresh->encode(text, false, false), first);
}

}  // namespace
}  // namespace ds
