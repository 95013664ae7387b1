// Request validation and metric rendering of the HTTP server, without sockets or a model.
#include <gtest/gtest.h>

#include <algorithm>

#include "server/api.h"

namespace ds {
namespace {

using Json = nlohmann::json;

ApiLimits limits() {
  ApiLimits l;
  l.vocab = 100;
  l.context = 32;
  l.model_name = "m";
  return l;
}

int status_of(const Json& body, bool chat = false) {
  try {
    parse_api_request(body, chat, limits());
  } catch (const ApiError& e) {
    return e.status;
  }
  return 200;
}

TEST(ServerApi, TokenPromptsAndChoices) {
  auto r = parse_api_request(Json{{"model", "m"},
                                  {"prompt", {{1, 2}, {3}}},
                                  {"n", 2},
                                  {"max_tokens", 5},
                                  {"stop", "x"},
                                  {"priority", "batch"},
                                  {"seed", 3}},
                             false, limits());
  ASSERT_EQ(r.prompts.size(), 2u);
  ASSERT_EQ(r.engine.size(), 4u);  // prompt-major, n per prompt
  EXPECT_EQ(r.engine[1].prompt, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r.engine[2].prompt, (std::vector<int32_t>{3}));
  EXPECT_EQ(r.engine[0].max_tokens, 5);
  EXPECT_EQ(r.engine[0].stop, (std::vector<std::string>{"x"}));
  EXPECT_EQ(r.engine[0].priority, Priority::Batch);
  EXPECT_NE(r.engine[0].sampling.seed, r.engine[1].sampling.seed);
  EXPECT_FALSE(r.engine[0].ignore_eos);
}

TEST(ServerApi, TokenIdsAlwaysReturnedWithoutTokenizer) {
  // No tokenizer: the text is empty, so the ids are what a client can read.
  EXPECT_TRUE(parse_api_request(Json{{"prompt", {1}}}, false, limits()).return_token_ids);
  EXPECT_TRUE(parse_api_request(Json{{"prompt", {1}}, {"return_token_ids", false}}, false, limits())
                  .return_token_ids);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"return_token_ids", "yes"}}), 400);
}

TEST(ServerApi, IgnoreEosExtension) {
  auto r =
      parse_api_request(Json{{"prompt", {1}}, {"n", 2}, {"ignore_eos", true}}, false, limits());
  EXPECT_TRUE(r.engine[0].ignore_eos);
  EXPECT_TRUE(r.engine[1].ignore_eos);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"ignore_eos", "yes"}}), 400);
}

TEST(ServerApi, MaxTokensDefaultsAndClampsToContext) {
  auto r = parse_api_request(Json{{"prompt", {1, 2, 3}}}, false, limits());
  EXPECT_EQ(r.engine[0].max_tokens, 16);
  r = parse_api_request(Json{{"prompt", {1, 2, 3}}, {"max_tokens", 1000}}, false, limits());
  EXPECT_EQ(r.engine[0].max_tokens, 29);
  r = parse_api_request(Json{{"prompt", {1}}, {"max_completion_tokens", 2}}, false, limits());
  EXPECT_EQ(r.engine[0].max_tokens, 2);
}

TEST(ServerApi, RejectsBadRequests) {
  EXPECT_EQ(status_of(Json::array()), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"model", "other"}}), 404);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"max_tokens", 0}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"max_tokens", -1}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"max_tokens", "3"}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"temperature", 5}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"n", 0}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"stream", 1}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"priority", "urgent"}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"stop", {1}}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logprobs", true}}), 400);  // an integer here
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logprobs", 6}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logprobs", -1}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"top_logprobs", 2}}), 400);  // chat only
  EXPECT_EQ(status_of(Json{{"prompt", {100}}}), 400);                     // outside the vocabulary
  EXPECT_EQ(status_of(Json{{"prompt", std::vector<int>(32, 1)}}), 400);   // no room to generate
  EXPECT_EQ(status_of(Json{{"prompt", "text"}}), 400);                    // no tokenizer
  EXPECT_EQ(status_of(Json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, true), 400);
  EXPECT_EQ(status_of(Json::object()), 400);
}

// A byte-level BPE vocabulary of the 256 bytes (no merges) plus the ChatML markers.
std::unique_ptr<Tokenizer> byte_tokenizer() {
  TokenizerSpec spec;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool self = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    const uint32_t cp = self ? uint32_t(b) : uint32_t(next++);
    std::string s;  // the code point in UTF-8 (at most two bytes here)
    if (cp < 0x80) {
      s += char(cp);
    } else {
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3F));
    }
    spec.tokens.push_back(s);
    spec.types.push_back(TokenType::Normal);
  }
  for (const char* special : {"<|im_start|>", "<|im_end|>"}) {
    spec.tokens.push_back(special);
    spec.types.push_back(TokenType::Control);
  }
  return Tokenizer::create(spec);
}

TEST(ServerApi, Logprobs) {
  auto r = parse_api_request(Json{{"prompt", {1}}}, false, limits());
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_EQ(r.engine[0].logprobs, -1);
  r = parse_api_request(Json{{"prompt", {1}}, {"logprobs", 3}, {"n", 2}}, false, limits());
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_EQ(r.engine[1].logprobs, 3);
  r = parse_api_request(Json{{"prompt", {1}}, {"logprobs", 0}}, false, limits());
  EXPECT_EQ(r.engine[0].logprobs, 0);

  const auto tok = byte_tokenizer();
  const ChatTemplate chat = ChatTemplate::of_kind(ChatTemplateKind::ChatML);
  ApiLimits lim = limits();
  lim.tokenizer = tok.get();
  lim.chat = &chat;
  lim.vocab = 258;
  lim.context = 1000;
  const Json msgs = {{{"role", "user"}, {"content", "hi"}}};
  auto chat_lp = [&](Json extra) {
    extra["messages"] = msgs;
    return parse_api_request(extra, true, lim).engine.at(0).logprobs;
  };
  auto chat_status = [&](Json extra) {
    try {
      chat_lp(std::move(extra));
    } catch (const ApiError& e) {
      return e.status;
    }
    return 200;
  };
  EXPECT_EQ(chat_lp(Json::object()), -1);
  EXPECT_EQ(chat_lp({{"logprobs", false}}), -1);
  EXPECT_EQ(chat_lp({{"logprobs", true}}), 0);
  EXPECT_EQ(chat_lp({{"logprobs", true}, {"top_logprobs", 20}}), 20);
  EXPECT_EQ(chat_lp({{"logprobs", false}, {"top_logprobs", 0}}), -1);
  EXPECT_EQ(chat_status({{"logprobs", true}, {"top_logprobs", 21}}), 400);
  EXPECT_EQ(chat_status({{"logprobs", true}, {"top_logprobs", -1}}), 400);
  EXPECT_EQ(chat_status({{"logprobs", true}, {"top_logprobs", 1.5}}), 400);
  EXPECT_EQ(chat_status({{"logprobs", 2}}), 400);      // a boolean in chat
  EXPECT_EQ(chat_status({{"top_logprobs", 2}}), 400);  // needs logprobs=true
  EXPECT_EQ(chat_status({{"logprobs", false}, {"top_logprobs", 2}}), 400);
}

TEST(ServerApi, LogitBias) {
  auto r = parse_api_request(
      Json{{"prompt", {1}}, {"n", 2}, {"logit_bias", {{"7", 100}, {"0", -2.5}}}}, false, limits());
  auto bias = r.engine[1].sampling.logit_bias;
  std::sort(bias.begin(), bias.end());
  EXPECT_EQ(bias, (std::vector<std::pair<int32_t, float>>{{0, -2.5f}, {7, 100.0f}}));
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logit_bias", {{"100", 1}}}}), 400);  // vocab
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logit_bias", {{"-1", 1}}}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logit_bias", {{"x", 1}}}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logit_bias", {{"1", 101}}}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logit_bias", {{"1", "2"}}}}), 400);
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"logit_bias", {1, 2}}}), 400);
}

TEST(ServerApi, EchoKeepsEachPromptsText) {
  auto r = parse_api_request(Json{{"prompt", {{1, 2}, {3}}}, {"n", 2}}, false, limits());
  EXPECT_FALSE(r.echo);
  EXPECT_TRUE(r.echo_text.empty());
  const auto tok = byte_tokenizer();
  ApiLimits lim = limits();
  lim.tokenizer = tok.get();
  lim.vocab = 258;
  r = parse_api_request(
      Json{{"prompt", Json::array({"Hi there", Json::array({72, 105})})}, {"echo", true}}, false,
      lim);
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.echo_text, (std::vector<std::string>{"Hi there", "Hi"}));
  EXPECT_EQ(status_of(Json{{"prompt", {1}}, {"echo", 1}}), 400);
}

TEST(ServerApi, UnsupportedFieldsAreRefusedByName) {
  auto param_of = [](const Json& body, bool chat = false) -> std::string {
    try {
      parse_api_request(body, chat, limits());
    } catch (const ApiError& e) {
      return e.status == 400 ? e.param : "status " + std::to_string(e.status);
    }
    return "accepted";
  };
  const Json p = {{"prompt", {1}}};
  auto with = [&](const char* k, Json v) {
    Json b = p;
    b[k] = std::move(v);
    return b;
  };
  EXPECT_EQ(param_of(with("best_of", 1)), "accepted");
  EXPECT_EQ(param_of(with("best_of", 3)), "best_of");
  EXPECT_EQ(param_of(with("response_format", {{"type", "text"}})), "accepted");
  EXPECT_EQ(param_of(with("response_format", {{"type", "json_object"}})), "response_format");
  EXPECT_EQ(param_of(with("response_format", "json")), "response_format");
  EXPECT_EQ(param_of(with("tools", Json::array())), "accepted");
  EXPECT_EQ(param_of(with("tools", {{{"type", "function"}}})), "tools");
  EXPECT_EQ(param_of(with("tool_choice", "none")), "accepted");
  EXPECT_EQ(param_of(with("tool_choice", "auto")), "tool_choice");
  EXPECT_EQ(param_of(with("functions", {{{"name", "f"}}})), "functions");
  EXPECT_EQ(param_of(with("echo", true), true), "echo");       // completions only
  EXPECT_EQ(param_of(with("echo", false), true), "messages");  // false passes (then no template)
}

TEST(ServerApi, ErrorBodyHasOpenAiFields) {
  const Json j = error_body(ApiError(401, "nope", "", "invalid_api_key"));
  EXPECT_EQ(j["error"]["message"], "nope");
  EXPECT_EQ(j["error"]["type"], "authentication_error");
  EXPECT_TRUE(j["error"]["param"].is_null());
  EXPECT_EQ(j["error"]["code"], "invalid_api_key");
}

}  // namespace
}  // namespace ds
