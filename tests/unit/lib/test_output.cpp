// OutputProcessor: stop strings, held-back text, EOS, UTF-8 across tokens.
#include <gtest/gtest.h>

#include "engine/output.h"

namespace ds {
namespace {

const Tokenizer& tiny() {
  static auto tok = Tokenizer::from_hf_json(
      std::string(DS_FIXTURES_DIR) + "/tokenizer/tiny_bpe/tokenizer.json",
      std::string(DS_FIXTURES_DIR) + "/tokenizer/tiny_bpe/tokenizer_config.json");
  return *tok;
}

struct Fed {
  std::string streamed;
  bool finished = false;
  std::string text;
};

// Feeds `text` one token at a time; collects what the processor releases.
Fed feed(const std::string& text, std::vector<std::string> stop, bool close = true) {
  const auto ids = tiny().encode(text, false, false);
  OutputProcessor p(&tiny(), std::move(stop), false, -1);
  Fed r;
  for (int32_t id : ids) {
    const auto d = p.push(id);
    r.streamed += d.text;
    if (d.finished) {
      r.finished = true;
      break;
    }
  }
  if (close && !r.finished) r.streamed += p.close();
  r.text = p.text();
  return r;
}

TEST(Output, NoStopStringsStreamsEverything) {
  const std::string s = "hello world, this is a test";
  const Fed r = feed(s, {});
  EXPECT_EQ(r.streamed, s);
  EXPECT_EQ(r.text, s);
  EXPECT_FALSE(r.finished);
}

TEST(Output, StopStringCutsTextAndEnds) {
  const Fed r = feed("the cat sat. STOP and then more", {"STOP"});
  EXPECT_TRUE(r.finished);
  EXPECT_EQ(r.text, "the cat sat. ");
  EXPECT_EQ(r.streamed, r.text);
}

TEST(Output, EarliestOfSeveralStopStringsWins) {
  const Fed r = feed("one two three four", {"four", "two"});
  EXPECT_TRUE(r.finished);
  EXPECT_EQ(r.text, "one ");
}

TEST(Output, PossibleStopPrefixIsHeldThenReleased) {
  // "ST" could start "STOP": held back while streaming, released by close().
  const std::string s = "abc ST";
  const auto ids = tiny().encode(s, false, false);
  OutputProcessor p(&tiny(), {"STOP"}, false, -1);
  std::string streamed;
  for (int32_t id : ids) streamed += p.push(id).text;
  EXPECT_EQ(streamed, "abc ");
  streamed += p.close();
  EXPECT_EQ(streamed, s);
}

TEST(Output, EosEndsUnlessIgnored) {
  const auto ids = tiny().encode("hi", false, false);
  const int32_t eos = 7;
  OutputProcessor p(&tiny(), {}, false, eos);
  std::string streamed;
  for (int32_t id : ids) streamed += p.push(id).text;
  const auto d = p.push(eos);
  EXPECT_TRUE(d.finished);
  EXPECT_EQ(streamed + std::string(d.text), "hi");
  OutputProcessor q(&tiny(), {}, true, eos);
  EXPECT_FALSE(q.push(eos).finished);
}

TEST(Output, MultiByteCharactersAreNeverSplit) {
  const std::string s = "naïve café 日本語 🎉 done";
  const auto ids = tiny().encode(s, false, false);
  OutputProcessor p(&tiny(), {}, false, -1);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string_view d = p.push(id).text;
    // Every delta is complete UTF-8: it never ends inside a sequence.
    if (!d.empty()) {
      size_t i = d.size() - 1;
      while (i > 0 && (uint8_t(d[i]) & 0xC0) == 0x80) --i;
      const uint8_t lead = uint8_t(d[i]);
      const size_t need = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
      EXPECT_EQ(d.size() - i, need) << "delta ends mid-character";
    }
    streamed += d;
  }
  streamed += p.close();
  EXPECT_EQ(streamed, s);
}

}  // namespace
}  // namespace ds
