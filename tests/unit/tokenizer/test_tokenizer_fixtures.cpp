// Encodings compared with independent references: llama.cpp (llama-cpp-python) and HF
// `tokenizers`, recorded by tools/make_tokenizer_fixtures.py.
//   DS_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf     enables the GGUF tests
//   DS_SMOLLM2_TOKENIZER_JSON=/tmp/smollm2_tokenizer.json     enables the HF json test on the real
//   vocab
#include <gtest/gtest.h>

#include <chrono>
#include <iostream>
#include <map>

#include "formats/gguf.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"
#include "tokenizer_test_util.h"

namespace ds {
namespace {

using nlohmann::json;
using test::fixture_path;
using test::read_jsonl;
using Ids = std::vector<int32_t>;

std::string show(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02X", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string show(const Ids& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? "," : "") + std::to_string(ids[i]);
  return out + "]";
}

// Encodes every row and requires the recorded ids; prints the match rate.
void expect_rows_match(const Tokenizer& tok, const std::vector<json>& rows,
                       const std::string& what) {
  size_t matched = 0;
  size_t shown = 0;
  for (const auto& row : rows) {
    const std::string text = row.at("text").get<std::string>();
    const bool special = row.value("special", true);
    const Ids want = row.at("ids").get<Ids>();
    const Ids got = tok.encode(text, row.value("add_bos", false), special);
    if (got == want) {
      ++matched;
    } else if (shown++ < 10) {
      ADD_FAILURE() << what << ": text \"" << show(text) << "\" special=" << special << "\n  want "
                    << show(want) << "\n  got  " << show(got);
    }
  }
  std::cout << "[ match    ] " << what << ": " << matched << "/" << rows.size() << " identical\n";
  EXPECT_EQ(matched, rows.size()) << what;
  EXPECT_GT(rows.size(), 0u);
}

// Whether the vocab has a token for every byte of text (SmolLM2's lacks, e.g., 0xF1..0xF3, the
// lead bytes of planes 4..15: llama.cpp drops them, and so the round trip cannot hold).
bool all_bytes_in_vocab(const Tokenizer& tok, const std::string& text) {
  for (char c : text)
    if (!tok.find_token(gpt2_bytes_to_text(std::string(1, c)))) return false;
  return true;
}

void expect_round_trips(const Tokenizer& tok, const std::vector<json>& rows) {
  size_t failures = 0;
  size_t skipped = 0;
  for (const auto& row : rows) {
    const std::string text = row.at("text").get<std::string>();
    if (!all_bytes_in_vocab(tok, text)) {
      ++skipped;
      continue;
    }
    for (bool special : {false, true}) {
      const std::string back = tok.decode(tok.encode(text, false, special));
      if (back != text && failures++ < 10)
        ADD_FAILURE() << "round trip (special=" << special << ") of \"" << show(text)
                      << "\" gave \"" << show(back) << "\"";
    }
  }
  EXPECT_EQ(failures, 0u);
  std::cout << "[ roundtrip] " << rows.size() - skipped << " texts; " << skipped
            << " skipped for bytes the vocab lacks\n";
}

std::unique_ptr<GgufFile> open_smollm2() {
  const std::string path = test::env_or_empty("DS_SMOLLM2_GGUF");
  if (path.empty()) return nullptr;
  return std::make_unique<GgufFile>(GgufFile::open(path));
}

TEST(SmolLM2Gguf, MatchesLlamaCpp) {
  auto gguf = open_smollm2();
  if (!gguf) GTEST_SKIP() << "set DS_SMOLLM2_GGUF to the SmolLM2-135M-Instruct GGUF";
  auto tok = Tokenizer::from_gguf(*gguf);
  json header;
  auto rows = read_jsonl(fixture_path("smollm2_llamacpp.jsonl"), &header);
  EXPECT_GE(rows.size(), 2000u);
  expect_rows_match(*tok, rows,
                    "SmolLM2 GGUF vs llama.cpp " + header.value("llama_cpp_python", "?"));
}

TEST(SmolLM2Gguf, OtherPreTokenizersMatchLlamaCpp) {
  auto gguf = open_smollm2();
  if (!gguf) GTEST_SKIP() << "set DS_SMOLLM2_GGUF to the SmolLM2-135M-Instruct GGUF";
  const TokenizerSpec base = tokenizer_spec_from_gguf(*gguf);
  std::map<std::string, std::vector<json>> by_pre;
  for (auto& row : read_jsonl(fixture_path("smollm2_pre_llamacpp.jsonl")))
    by_pre[row.at("pre").get<std::string>()].push_back(row);
  EXPECT_EQ(by_pre.size(), 6u);
  for (const auto& [name, rows] : by_pre) {
    TokenizerSpec spec = base;
    auto pre = pre_tokenizer_from_name(name);
    ASSERT_TRUE(pre.has_value()) << name;
    spec.pre = *pre;
    spec.ignore_merges = *pre == PreTokenizer::Llama3;
    auto tok = Tokenizer::create(spec);
    expect_rows_match(*tok, rows, "SmolLM2 vocab, pre=" + name + " vs llama.cpp");
  }
}

TEST(SmolLM2Gguf, MetadataRoundTripAndSpeed) {
  auto gguf = open_smollm2();
  if (!gguf) GTEST_SKIP() << "set DS_SMOLLM2_GGUF to the SmolLM2-135M-Instruct GGUF";
  auto tok = Tokenizer::from_gguf(*gguf);
  EXPECT_EQ(tok->vocab_size(), 49152);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_FALSE(tok->add_bos_default());
  EXPECT_EQ(tok->pre_tokenizer(), PreTokenizer::SmolLM);
  EXPECT_EQ(tok->eog_ids(), (Ids{0, 2}));  // <|endoftext|>, <|im_end|>
  EXPECT_EQ(tok->find_token("<|im_start|>"), 1);
  EXPECT_NE(tok->chat_template().find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(tok->token_text(28), ",");
  auto rows = read_jsonl(fixture_path("smollm2_llamacpp.jsonl"));
  expect_round_trips(*tok, rows);

  std::string corpus;
  for (const auto& row : rows) {
    const std::string text = row.at("text").get<std::string>();
    if (all_bytes_in_vocab(*tok, text)) corpus += text + "\n";
  }
  std::string big;
  while (big.size() < (4u << 20)) big += corpus;
  auto fresh = Tokenizer::from_gguf(*gguf);  // cold word cache
  auto c0 = std::chrono::steady_clock::now();
  const size_t cold_tokens = fresh->encode(corpus, false, true).size();
  double cold = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
  std::cout << "[ speed    ] cold cache: " << corpus.size() / 1e3 << " kB into " << cold_tokens
            << " tokens in " << cold << " s (" << cold_tokens / cold / 1e6 << " M tokens/s)\n";
  auto t0 = std::chrono::steady_clock::now();
  Ids ids = fresh->encode(big, false, true);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "[ speed    ] warm cache: " << big.size() / 1e6 << " MB into " << ids.size()
            << " tokens in " << s << " s (" << ids.size() / s / 1e6 << " M tokens/s)\n";
  EXPECT_TRUE(fresh->decode(ids) == big);  // not EXPECT_EQ: its diff of 4 MB strings is huge
}

TEST(SmolLM2HfJson, MatchesHfTokenizersAndLlamaCpp) {
  const std::string path = test::env_or_empty("DS_SMOLLM2_TOKENIZER_JSON");
  if (path.empty())
    GTEST_SKIP() << "set DS_SMOLLM2_TOKENIZER_JSON (tools/make_tokenizer_fixtures.py writes one)";
  auto tok = Tokenizer::from_hf_json(path, "");
  EXPECT_EQ(tok->pre_tokenizer(), PreTokenizer::SmolLM);
  // Where HF's older Unicode tables made it disagree with llama.cpp, llama.cpp is the reference.
  std::map<std::string, Ids> llama;
  for (const auto& row : read_jsonl(fixture_path("smollm2_llamacpp.jsonl")))
    if (row.at("special").get<bool>())
      llama[row.at("text").get<std::string>()] = row.at("ids").get<Ids>();
  auto rows = read_jsonl(fixture_path("smollm2_hf.jsonl"));
  size_t disagreeing = 0;
  for (auto& row : rows) {
    if (!row.value("agrees_with_llamacpp", true)) {
      ++disagreeing;
      row["ids"] = llama.at(row.at("text").get<std::string>());
    }
  }
  std::cout << "[ note     ] " << disagreeing << " rows where HF tokenizers and llama.cpp differ\n";
  expect_rows_match(*tok, rows, "SmolLM2 tokenizer.json vs HF tokenizers");
}

TEST(TinyBpeJson, MatchesHfTokenizers) {
  auto tok = Tokenizer::from_hf_json(fixture_path("tiny_bpe/tokenizer.json"),
                                     fixture_path("tiny_bpe/tokenizer_config.json"));
  EXPECT_EQ(tok->vocab_size(), 501);
  EXPECT_EQ(tok->pre_tokenizer(), PreTokenizer::Llama3);
  EXPECT_TRUE(tok->add_bos_default());
  EXPECT_EQ(tok->bos_id(), 0);
  EXPECT_EQ(tok->eos_id(), 1);
  EXPECT_EQ(tok->token_type(500), TokenType::UserDefined);
  EXPECT_FALSE(tok->chat_template().empty());
  auto rows = read_jsonl(fixture_path("tiny_bpe_hf.jsonl"));
  EXPECT_GE(rows.size(), 300u);
  expect_rows_match(*tok, rows, "tiny tokenizer.json vs HF tokenizers");
  expect_round_trips(*tok, rows);
}

TEST(TinyBpeJson, MissingConfigAndBadFiles) {
  auto tok = Tokenizer::from_hf_json(fixture_path("tiny_bpe/tokenizer.json"), "/nonexistent.json");
  EXPECT_EQ(tok->bos_id(), 0);  // from the TemplateProcessing post-processor
  EXPECT_TRUE(tok->add_bos_default());
  EXPECT_THROW(Tokenizer::from_hf_json("/nonexistent/tokenizer.json", ""), Error);
  EXPECT_THROW(Tokenizer::from_hf_json(fixture_path("chat_templates.jsonl"), ""), Error);
}

}  // namespace
}  // namespace ds
